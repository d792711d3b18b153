"""An Ollama ``Modelfile`` beside a GGUF, and the exact lines to run it (Ollama, llama.cpp).

``FROM ./<file>.gguf`` (Ollama resolves it against the Modelfile's folder), then:

- ``TEMPLATE`` only where a correct conversion of the tokenizer's chat template to Ollama's Go template
  is known: each template in ``GO_TEMPLATES`` is rendered here (``render_go``, the subset of Go's
  text/template these use) and compared with the tokenizer's own rendering of the same conversations
  (system or not, one turn or several, the generation prompt), character for character, with the BOS
  llama.cpp adds itself when the GGUF says so. The first that equals it on every conversation is
  written; none equal: no TEMPLATE line, and a comment saying that Ollama takes the chat template from
  the GGUF's own ``tokenizer.chat_template`` (it matches it against its known templates when it
  creates the model). The templates are ours, written after the formats (ChatML, Llama 3) that Ollama's
  ``template/`` folder lists.
- ``PARAMETER stop`` for each end token the tokenizer names: its ``eos_token`` and the
  ``eos_token_id`` of ``generation_config.json`` (one id or a list). Nothing else is invented.

The file is named after the GGUF (``<name>-Q4_K_M.Modelfile``), so that GGUFs of several types in one
folder each keep theirs; ``ollama create NAME -f FILE`` takes any file name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Ollama Go templates for chat formats we can check against a tokenizer's template by rendering both
GO_TEMPLATES = {
    "chatml": "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
    "llama3": (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
        "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}
CONVERSATIONS = (  # what both renderings must agree on, with the generation prompt added
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Name a colour.\nOne word."}],
)


@dataclass(frozen=True)
class Modelfile:
    path: Path
    text: str
    template: str | None  # the GO_TEMPLATES name written as TEMPLATE; None: none
    why_no_template: str | None  # the sentence the file carries instead
    stops: tuple[str, ...]
    ollama_name: str

    def commands(self, gguf_path: Path) -> list[str]:
        return run_lines(gguf_path, self)


def write_modelfile(folder: Path, gguf_path: Path, type_: str) -> Modelfile:
    """Write ``<gguf stem>.Modelfile`` beside the GGUF (replacing an older one) and return it."""
    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.ship.trial import _load_tokenizer

    folder, gguf_path = Path(folder).absolute(), Path(gguf_path).absolute()
    tok = _load_tokenizer(folder)
    add_bos = _gguf_adds_bos(gguf_path)
    name, why = chosen_template(tok, add_bos)
    stops = end_tokens(tok, json_object_or_none(folder / "generation_config.json") or {})
    ollama_name = ollama_model_name(folder.name, type_)
    path = gguf_path.with_name(gguf_path.stem + ".Modelfile")
    lines = [
        f"# Ollama Modelfile for {gguf_path.name}, written by tui-merger. Create the model with:",
        f"#   ollama create {ollama_name} -f {path.name}",
        f"FROM {_quote('./' + gguf_path.name)}",
    ]
    if name is not None:
        lines.append(f'TEMPLATE """{GO_TEMPLATES[name]}"""')
    else:
        lines.append(f"# No TEMPLATE: {why}")
    for stop in stops:
        lines.append(f"PARAMETER stop {_quote(stop, always=True)}")
    if not stops:
        lines.append("# No PARAMETER stop: the tokenizer names no end token.")
    text = "\n".join(lines) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return Modelfile(path, text, name, why, tuple(stops), ollama_name)


def run_lines(gguf_path: Path, modelfile: Modelfile | None) -> list[str]:
    """The exact commands that run the GGUF: Ollama (when a Modelfile was written) and llama.cpp."""
    import shlex

    lines = []
    if modelfile is not None:
        lines.append(f"ollama create {modelfile.ollama_name} -f {shlex.quote(str(modelfile.path))}")
    lines.append(f"llama-cli -m {shlex.quote(str(Path(gguf_path).absolute()))}")
    return lines


def ollama_model_name(folder_name: str, type_: str) -> str:
    """NAME:TAG as Ollama accepts it: the folder's name in lower case, other characters as '-', the type as tag."""
    base = re.sub(r"[^a-z0-9._-]+", "-", folder_name.lower()).strip("-._") or "merged-model"
    return f"{base}:{type_.lower()}"


# -- the template ----------------------------------------------------------------------------------


def chosen_template(tok, add_bos: bool) -> tuple[str | None, str | None]:
    """(the GO_TEMPLATES name that renders like the tokenizer's chat template, None) or (None, why not)."""
    if not getattr(tok, "chat_template", None):
        return None, ("the tokenizer has no chat template, so Ollama sends prompts as they are "
                      "(add a TEMPLATE here if the model was trained on a chat format).")
    bos = tok.bos_token if add_bos and tok.bos_token else ""
    for name, go in GO_TEMPLATES.items():
        if _renders_alike(tok, go, bos):
            return name, None
    return None, ("tui-merger knows no Ollama template that renders this model's chat template exactly, so Ollama "
                  "uses the chat template the GGUF carries (tokenizer.chat_template) as it creates the model.")


def _renders_alike(tok, go: str, bos: str) -> bool:
    compared = 0
    for messages in CONVERSATIONS:
        try:
            want = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001, S112 - a template may refuse a conversation (a system role) in any way
            continue
        if want != bos + render_go(go, messages):
            return False
        compared += 1
    return compared >= 2


_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def render_go(template: str, messages) -> str:
    """Render the subset of Go's text/template that GO_TEMPLATES use (``range .Messages``, ``.Role``,
    ``.Content``, ``end``, the ``{{-`` / ``-}}`` trims) as Ollama would for ``messages``."""
    parts: list[tuple[str, str]] = []  # ("text", s) or ("action", s)
    pos = 0
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        if parts and parts[-1][0] == "trim-next":
            parts.pop()
            text = text.lstrip(" \t\r\n")
        parts.append(("text", text))
        parts.append(("action", m.group(2)))
        if m.group(3):
            parts.append(("trim-next", ""))
        pos = m.end()
    tail = template[pos:]
    if parts and parts[-1][0] == "trim-next":
        parts.pop()
        tail = tail.lstrip(" \t\r\n")
    parts.append(("text", tail))
    return _run(parts, messages, None)[0]


def _run(parts, messages, message, i=0):
    out = []
    while i < len(parts):
        kind, value = parts[i]
        i += 1
        if kind == "text":
            out.append(value)
        elif value == "range .Messages":
            start, end = i, i
            for m in messages:
                body, end = _run(parts, messages, m, start)
                out.append(body)
            if not messages:
                _, end = _run(parts, messages, {"role": "", "content": ""}, start)
            i = end
        elif value == "end":
            return "".join(out), i
        elif value in (".Role", ".Content"):
            out.append(message[value[1:].lower()])
        else:
            raise ValueError(f"render_go does not render {{{{ {value} }}}}")
    return "".join(out), i


# -- stops and the GGUF's BOS ----------------------------------------------------------------------------


def end_tokens(tok, generation_config: dict) -> list[str]:
    """The tokenizer's end tokens as text: eos_token, then generation_config.json's eos_token_id(s)."""
    stops: list[str] = []
    if tok.eos_token:
        stops.append(str(tok.eos_token))
    ids = generation_config.get("eos_token_id")
    for i in ids if isinstance(ids, list) else [ids]:
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tok):
            token = tok.convert_ids_to_tokens(i)
            if isinstance(token, str) and token:
                stops.append(token)
    return [s for n, s in enumerate(stops) if s not in stops[:n] and "\n" not in s]


def _gguf_adds_bos(path: Path) -> bool:
    import gguf

    field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.parts[field.data[0]][0])


def _quote(value: str, always: bool = False) -> str:
    """A Modelfile argument as Ollama's parser reads it back (no escapes: '"..."', or '\"\"\"...\"\"\"')."""
    if not always and not re.search(r'[\s"]', value):
        return value
    return f'"""{value}"""' if '"' in value else f'"{value}"'
