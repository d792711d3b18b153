"""An Ollama ``Modelfile`` beside a GGUF, and the exact lines to run it (Ollama, llama.cpp).

``FROM ./<file>.gguf`` (Ollama resolves it against the Modelfile's folder), then:

- ``TEMPLATE`` only where a correct conversion of the tokenizer's chat template to Ollama's Go template
  is known: each template in ``GO_TEMPLATES`` is rendered here (``render_go``, the subset of Go's
  text/template these use) and compared with the tokenizer's own rendering of the same conversations
  (system or not, one turn or several, the generation prompt), character for character, with the BOS
  llama.cpp adds itself when the GGUF says so. The first that equals it on every conversation is
  written; none equal: no TEMPLATE line, and a comment saying that Ollama takes the chat template from
  the GGUF's own ``tokenizer.chat_template`` (it matches it against its known templates when it
  creates the model). The templates are ours, written after the released chat templates of the families
  the GGUF export writes (ChatML, Llama 3, Gemma 1-3, Phi-3, Phi-4, OLMo 2, Mistral's [INST] v0.1 / v1 / v7,
  Granite 3.0, 3.1-3.3 and 4, DeepSeek-V2, V3 and V3.1, Command R7B, GLM-4, GLM-4.5, GPT-OSS, SmolLM3, EXAONE 4);
  tests/test_modelfile.py holds them against Go's own text/template and the released Jinja templates. Templates that write today's date use
  Ollama's ``currentDate``; what a template leaves out (tools, thinking modes) is a comment above it
  (``GO_TEMPLATE_NOTES``). A chat template no template of ours renders exactly keeps the comment.
  An architecture Ollama prompts with its own renderer whatever the TEMPLATE says (Gemma 4:
  ``OLLAMA_RENDERERS``) gets no TEMPLATE and a comment saying so.
- ``PARAMETER stop`` for each end token the tokenizer names: its ``eos_token`` and the
  ``eos_token_id`` of ``generation_config.json`` (one id or a list). Nothing else is invented.

The file is named after the GGUF (``<name>-Q4_K_M.Modelfile``), so that GGUFs of several types in one
folder each keep theirs; ``ollama create NAME -f FILE`` takes any file name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Ollama Go templates for chat formats we can check against a tokenizer's template by rendering both. Ours,
# each written after a family's released Jinja template (tests/fixtures/ollama/ names the sources). Ollama
# passes every message, system ones included, in .Messages, and the system messages joined in .System.
# A system message the Jinja template refuses (Gemma 1/2, Mistral v0.1) goes, as Gemma 3 and Mistral's
# later templates put it, in front of the first user message.
_FIRST_USER_SYSTEM = "{{ if and (eq $i 1) $.System }}{{ $.System }}\n\n{{ end }}"
# Today's date as strftime's "%B %d, %Y" (Granite) and "%d %B %Y" (SmolLM3) from Ollama's currentDate (YYYY-MM-DD,
# Ollama 0.11 and later): the month's name by its number, the day and the year by position.
_MONTH_NAME = "{{ $m := slice $d 5 7 }}" + "".join(
    f'{{{{ {"if" if n == 1 else "else if"} eq $m "{n:02d}" }}}}{name}' for n, name in enumerate(
        ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
         "December"), start=1)) + "{{ end }}"
_DATE_B_D_Y = "{{ $d := currentDate }}" + _MONTH_NAME + " {{ slice $d 8 10 }}, {{ slice $d 0 4 }}"
_DATE_D_B_Y = "{{ $d := currentDate }}{{ slice $d 8 10 }} " + _MONTH_NAME + " {{ slice $d 0 4 }}"
DATE_TEMPLATES = {"%B %d, %Y": _DATE_B_D_Y, "%d %B %Y": _DATE_D_B_Y}
_SMOLLM3_THINK = (  # SmolLM3's custom instructions in its default reasoning mode (/think) when the system prompt gives none
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Your role as an assistant involves thoroughly "
    "exploring questions through a systematic thinking process before providing the final precise and accurate solutions. "
    "This requires engaging in a comprehensive cycle of analysis, summarizing, exploration, reassessment, reflection, "
    "backtracking, and iteration to develop well-considered thinking process. Please structure your response into two "
    "main sections: Thought and Solution using the specified format: <think> Thought section </think> Solution section. "
    "In the Thought section, detail your reasoning process in steps. Each step should include detailed considerations "
    "such as analysing questions, summarizing relevant findings, brainstorming new ideas, verifying the accuracy of the "
    "current steps, refining any errors, and revisiting previous steps. In the Solution section, based on various "
    "attempts, explorations, and reflections from the Thought section, systematically present the final solution that "
    "you deem correct. The Solution section should be logical, accurate, and concise and detail necessary steps needed "
    "to reach the conclusion."
)

GO_TEMPLATES = {
    "chatml": "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
    "llama3": (
        "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n"
        "{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "gemma": (  # Gemma 1, 2 and 3: the model's turns are "model"; Gemma 3 puts the system prompt in the first user turn
        "{{- range $i, $_ := .Messages }}{{ if eq .Role \"user\" }}<start_of_turn>user\n" + _FIRST_USER_SYSTEM +
        "{{ .Content }}<end_of_turn>\n{{ else if eq .Role \"assistant\" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n"
        "{{ end }}{{ end }}<start_of_turn>model\n"
    ),
    "phi3": "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
    "phi4": (  # <|im_start|>role<|im_sep|> (Phi-4): the assistant's header follows each user message
        "{{- range .Messages }}{{ if eq .Role \"system\" }}<|im_start|>system<|im_sep|>{{ .Content }}<|im_end|>"
        "{{ else if eq .Role \"user\" }}<|im_start|>user<|im_sep|>{{ .Content }}<|im_end|><|im_start|>assistant<|im_sep|>"
        "{{ else if eq .Role \"assistant\" }}{{ .Content }}<|im_end|>{{ end }}{{ end }}"
    ),
    "olmo2": (  # OLMo 2 (Tulu 3's format with the BOS): <|user|>, an assistant turn closed by <|endoftext|>
        "{{- range .Messages }}{{ if eq .Role \"system\" }}<|system|>\n{{ .Content }}\n{{ else if eq .Role \"user\" }}"
        "<|user|>\n{{ .Content }}\n{{ else if eq .Role \"assistant\" }}<|assistant|>\n{{ .Content }}<|endoftext|>\n"
        "{{ end }}{{ end }}<|assistant|>\n"
    ),
    "mistral-instruct": (  # [INST] ... [/INST] (Mistral 7B v0.1/v0.2 as first released), no generation prompt
        "{{- range $i, $_ := .Messages }}{{ if eq .Role \"user\" }}[INST] " + _FIRST_USER_SYSTEM +
        "{{ .Content }} [/INST]{{ else if eq .Role \"assistant\" }}{{ .Content }}</s>{{ end }}{{ end }}"
    ),
    "mistral-v1": (  # mistral-common's "v1" template: " [INST] ", the system prompt in the first user message
        "{{- range $i, $_ := .Messages }}{{ if eq .Role \"user\" }} [INST] " + _FIRST_USER_SYSTEM +
        "{{ .Content }} [/INST]{{ else if eq .Role \"assistant\" }} {{ .Content }}</s>{{ end }}{{ end }}"
    ),
    "mistral-v7": (  # [SYSTEM_PROMPT] ... [/SYSTEM_PROMPT] (Mistral Large 2411)
        "{{- range .Messages }}{{ if eq .Role \"system\" }}[SYSTEM_PROMPT] {{ .Content }}[/SYSTEM_PROMPT]"
        "{{ else if eq .Role \"user\" }}[INST] {{ .Content }}[/INST]{{ else if eq .Role \"assistant\" }} {{ .Content }}</s>"
        "{{ end }}{{ end }}"
    ),
    "granite3": (
        "{{- range .Messages }}<|start_of_role|>{{ .Role }}<|end_of_role|>{{ .Content }}<|end_of_text|>\n"
        "{{ end }}<|start_of_role|>assistant<|end_of_role|>"
    ),
    "deepseek-v3": (  # DeepSeek-V3 (and R1 templates that render alike): every system message first, joined by a blank line
        "{{- $.System }}{{ range .Messages }}{{ if eq .Role \"user\" }}<\uff5cUser\uff5c>{{ .Content }}{{ else if eq .Role \"assistant\" }}"
        "<\uff5cAssistant\uff5c>{{ .Content }}<\uff5cend\u2581of\u2581sentence\uff5c>{{ end }}{{ end }}<\uff5cAssistant\uff5c>"
    ),
    "deepseek-v3.1": (  # DeepSeek-V3.1 in its default non-thinking mode: "</think>" opens each assistant turn
        "{{- $.System }}{{ range .Messages }}{{ if eq .Role \"user\" }}<\uff5cUser\uff5c>{{ .Content }}{{ else if eq .Role \"assistant\" }}"
        "<\uff5cAssistant\uff5c></think>{{ .Content }}<\uff5cend\u2581of\u2581sentence\uff5c>{{ end }}{{ end }}<\uff5cAssistant\uff5c></think>"
    ),
    "command-r7b": (  # Cohere2 (Command R7B)'s default template without tools or documents: the first system message, or an empty system turn
        "{{- range $i, $_ := .Messages }}{{ if eq $i 0 }}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>{{ if eq .Role \"system\" }}{{ .Content }}"
        "{{ end }}<|END_OF_TURN_TOKEN|>{{ end }}{{ if eq .Role \"user\" }}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ .Content }}<|END_OF_TURN_TOKEN|>"
        "{{ else if eq .Role \"assistant\" }}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{{ .Content }}<|END_RESPONSE|>"
        "<|END_OF_TURN_TOKEN|>{{ end }}{{ end }}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>"
    ),
    "glm4": (  # GLM-4 chat: [gMASK]<sop>, then <|role|> and a newline before each message that has content
        "[gMASK]<sop>{{ range .Messages }}{{ if .Content }}<|{{ .Role }}|>\n{{ .Content }}{{ end }}{{ end }}<|assistant|>"
    ),
    "granite3.1": (  # Granite 3.1 / 3.2: without a system message, a default one that carries today's date
        "{{- range $i, $_ := .Messages }}{{ if and (eq $i 0) (ne .Role \"system\") }}<|start_of_role|>system<|end_of_role|>"
        "Knowledge Cutoff Date: April 2024.\nToday's Date: " + _DATE_B_D_Y + ".\nYou are Granite, developed by IBM. "
        "You are a helpful AI assistant.<|end_of_text|>\n{{ end }}<|start_of_role|>{{ .Role }}<|end_of_role|>{{ .Content }}<|end_of_text|>\n"
        "{{ end }}<|start_of_role|>assistant<|end_of_role|>"
    ),
    "granite3.3": (  # Granite 3.3: the same, its default system message spaced as its template writes it
        "{{- range $i, $_ := .Messages }}{{ if and (eq $i 0) (ne .Role \"system\") }}<|start_of_role|>system<|end_of_role|>"
        " Knowledge Cutoff Date: April 2024.\n Today's Date: " + _DATE_B_D_Y + ". You are Granite, developed by IBM. "
        "You are a helpful AI assistant.<|end_of_text|>\n{{ end }}<|start_of_role|>{{ .Role }}<|end_of_role|>{{ .Content }}<|end_of_text|>\n"
        "{{ end }}<|start_of_role|>assistant<|end_of_role|>"
    ),
    "granite4": (  # Granite 4 as Ollama's granite4:350m carries it: without a system message, a fixed default one
        "{{- range $i, $_ := .Messages }}{{ if and (eq $i 0) (ne .Role \"system\") }}<|start_of_role|>system<|end_of_role|>"
        "You are a helpful assistant. Please ensure responses are professional, accurate, and safe.<|end_of_text|>\n"
        "{{ end }}<|start_of_role|>{{ .Role }}<|end_of_role|>{{ .Content }}<|end_of_text|>\n{{ end }}"
        "<|start_of_role|>assistant<|end_of_role|>"
    ),
    "gpt-oss": (  # harmony without tools: the system header with today's date, the first system message as developer
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
        "Current date: {{ currentDate }}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.<|end|>{{ range $i, $_ := .Messages }}{{ if eq .Role \"system\" }}"
        "{{ if and (eq $i 0) .Content }}<|start|>developer<|message|># Instructions\n\n{{ .Content }}\n\n<|end|>{{ end }}"
        "{{ else if eq .Role \"user\" }}<|start|>user<|message|>{{ .Content }}<|end|>{{ else if eq .Role \"assistant\" }}"
        "<|start|>assistant<|channel|>final<|message|>{{ .Content }}<|end|>{{ end }}{{ end }}<|start|>assistant"
    ),
    "smollm3": (  # SmolLM3 in its default reasoning mode (/think): the metadata header with today's date, the first
        # system message as custom instructions; its template closes that header with <|im_end|> only when it lists tools
        "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nToday Date: " + _DATE_D_B_Y +
        "\nReasoning Mode: /think\n\n## Custom Instructions\n\n{{ $custom := \"\" }}{{ range $i, $_ := .Messages }}"
        "{{ if and (eq $i 0) (eq .Role \"system\") }}{{ $custom = .Content }}{{ end }}{{ end }}{{ if $custom }}{{ $custom }}"
        "{{ else }}" + _SMOLLM3_THINK + "{{ end }}\n\n{{ range .Messages }}{{ if eq .Role \"user\" }}<|im_start|>user\n"
        "{{ .Content }}<|im_end|>\n{{ else if eq .Role \"assistant\" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n"
        "{{ end }}{{ end }}<|im_start|>assistant\n"
    ),
    "exaone4": (  # EXAONE 4 in its default non-reasoning mode: an empty think block opens each assistant turn
        "{{- range .Messages }}[|{{ .Role }}|]\n{{ if and (eq .Role \"assistant\") .Content }}<think>\n\n</think>\n\n{{ end }}"
        "{{ .Content }}[|endofturn|]\n{{ end }}[|assistant|]\n<think>\n\n</think>\n\n"
    ),
    "glm4.5": (  # GLM-4.5 / 4.6 (glm4moe): past assistant turns with an empty think block, thinking left on for the answer
        "[gMASK]<sop>{{ range .Messages }}{{ if eq .Role \"user\" }}<|user|>\n{{ .Content }}{{ else if eq .Role \"assistant\" }}"
        "<|assistant|>\n<think></think>{{ if .Content }}\n{{ .Content }}{{ end }}{{ else if eq .Role \"system\" }}<|system|>\n"
        "{{ .Content }}{{ end }}{{ end }}<|assistant|>"
    ),
    "deepseek-v2": (
        "{{- range .Messages }}{{ if eq .Role \"user\" }}User: {{ .Content }}\n\n{{ else if eq .Role \"assistant\" }}"
        "Assistant: {{ .Content }}<\uff5cend\u2581of\u2581sentence\uff5c>{{ else if eq .Role \"system\" }}{{ .Content }}\n\n"
        "{{ end }}{{ end }}Assistant:"
    ),
}
# What a template leaves out (written as a comment above its TEMPLATE line): the check compares plain conversations,
# so tools, documents and thinking switches are never claimed; a date comes from Ollama's currentDate (0.11 and later).
_NO_TOOLS = "tools are not rendered"
_TODAY_NOTE = "today's date comes from Ollama's currentDate (Ollama 0.11 or later)"
GO_TEMPLATE_NOTES = {
    "deepseek-v3.1": f"non-thinking mode only; {_NO_TOOLS}.",
    "deepseek-v3": f"{_NO_TOOLS}.",
    "command-r7b": f"the template's plain chat only ({_NO_TOOLS}, nor documents); it keeps the spaces around a message "
                   "that the Jinja template strips.",
    "glm4": f"{_NO_TOOLS}.",
    "granite3.1": f"{_TODAY_NOTE}; {_NO_TOOLS}, nor documents.",
    "granite3.3": f"{_TODAY_NOTE}; thinking mode, tools and documents are not rendered.",
    "smollm3": f"{_TODAY_NOTE}; the default reasoning mode (/think) only: a /think or /no_think in the system prompt "
               f"and Ollama's think switch are not rendered as the template renders them; {_NO_TOOLS}.",
    "exaone4": f"non-reasoning mode only (the template's default); {_NO_TOOLS}.",
    "glm4.5": f"thinking stays on (the template's default); {_NO_TOOLS}; it keeps the spaces around an answer that the "
              "Jinja template strips.",
    "granite4": f"{_NO_TOOLS}, nor documents.",
    "gpt-oss": f"{_TODAY_NOTE}; reasoning stays at the template's default (medium); {_NO_TOOLS}, nor past reasoning "
               "(the template drops it too).",
}
# Architectures Ollama renders with its own code, not a TEMPLATE: creating a model from such a GGUF sets its renderer
# and parser from general.architecture, and a model with a renderer is prompted by it (server/create.go, server/prompt.go
# in ollama/ollama, read at fb30760). Gemma 4: since Ollama v0.20.0, the release that added the architecture. No Go
# template is written for them: one would not be used (the released Gemma 4 templates are in
# tests/fixtures/ollama/released_chat_templates.json, and no template of ours claims them).
OLLAMA_RENDERERS = {
    "gemma4": (
        "Ollama renders Gemma 4 (GGUF architecture gemma4) with its own gemma4 renderer and parser, which it sets from the "
        "architecture when it creates the model (Ollama 0.20.0 and later, the versions that run Gemma 4; the E2B/E4B or the "
        "12B-and-larger prompt, by the model's name or size), so a TEMPLATE here would not be used."
    ),
}
CONVERSATIONS = (  # what both renderings must agree on, with the generation prompt added
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Name a colour.\nOne word."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "Thanks"}],
)


@dataclass(frozen=True)
class Modelfile:
    path: Path
    text: str
    template: str | None  # the GO_TEMPLATES name written as TEMPLATE; None: none
    why_no_template: str | None  # the sentence the file carries instead
    stops: tuple[str, ...]
    ollama_name: str
    adapter: Path | None = None  # a GGUF LoRA the Modelfile applies (ADAPTER) to the GGUF of FROM

    def commands(self, gguf_path: Path) -> list[str]:
        return run_lines(gguf_path, self)


def write_modelfile(folder: Path, gguf_path: Path, type_: str, adapter: Path | None = None,
                    projector: Path | None = None) -> Modelfile:
    """Write ``<gguf stem>.Modelfile`` beside the GGUF (replacing an older one) and return it. With
    ``adapter`` (a GGUF LoRA, ship/gguf_lora.py), the Modelfile is ``<adapter stem>.Modelfile`` beside the
    adapter: ``FROM`` the base GGUF (``./name`` when in the same folder, else its whole path) and
    ``ADAPTER ./<adapter>``."""
    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.ship.trial import load_tokenizer

    folder, gguf_path = Path(folder).absolute(), Path(gguf_path).absolute()
    tok = load_tokenizer(folder)
    add_bos = _gguf_adds_bos(gguf_path)
    renderer = OLLAMA_RENDERERS.get(_gguf_architecture(gguf_path) or "")
    name, why = (None, renderer) if renderer else chosen_template(tok, add_bos)
    stops = end_tokens(tok, json_object_or_none(folder / "generation_config.json") or {})
    ollama_name = ollama_model_name(folder.name, type_)
    path = gguf_path.with_name(gguf_path.stem + ".Modelfile")
    source = "./" + gguf_path.name
    if adapter is not None:
        adapter = Path(adapter).absolute()
        ollama_name = ollama_model_name(adapter.parent.name, type_)
        path = adapter.with_name(adapter.stem + ".Modelfile")
        source = "./" + gguf_path.name if gguf_path.parent == adapter.parent else str(gguf_path)
    shown = gguf_path.name + (f" with the LoRA {adapter.name}" if adapter is not None else "")
    lines = [
        f"# Ollama Modelfile for {shown}, written by tui-merger. Create the model with:",
        f"#   ollama create {ollama_name} -f {path.name}",
        f"FROM {_quote(source)}",
    ]
    if adapter is not None:
        lines.append(f"ADAPTER {_quote('./' + adapter.name)}")
    if projector is not None:  # a second FROM of general.type mmproj: Ollama 0.30+ passes it to llama-server as --mmproj
        projector = Path(projector).absolute()
        lines.append("# The vision tower (mmproj): Ollama 0.30 and later run it with the model to read images.")
        lines.append(f"FROM {_quote('./' + projector.name if projector.parent == path.parent else str(projector))}")
    if name is not None:
        if name in GO_TEMPLATE_NOTES:
            lines.append(f"# TEMPLATE renders the chat template exactly on plain conversations; {GO_TEMPLATE_NOTES[name]}")
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
    return Modelfile(path, text, name, why, tuple(stops), ollama_name, adapter)


def run_lines(gguf_path: Path, modelfile: Modelfile | None) -> list[str]:
    """The exact commands that run the GGUF: Ollama (when a Modelfile was written) and llama.cpp."""
    import shlex

    lines = []
    if modelfile is not None:
        lines.append(f"ollama create {modelfile.ollama_name} -f {shlex.quote(str(modelfile.path))}")
    lora = f" --lora {shlex.quote(str(modelfile.adapter))}" if modelfile is not None and modelfile.adapter else ""
    lines.append(f"llama-cli -m {shlex.quote(str(Path(gguf_path).absolute()))}{lora}")
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
                  "takes the chat template from the GGUF (tokenizer.chat_template): Ollama 0.30 and later render it as it is, "
                  "older versions use the closest of their own templates, or send prompts as they are when none is close.")


def _renders_alike(tok, go: str, bos: str) -> bool:
    import datetime

    compared = 0
    for messages in CONVERSATIONS:
        for _ in range(2):  # a date-bearing template rendered across midnight: render both again on the new day
            today = datetime.date.today().isoformat()
            try:
                want = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - a template may refuse a conversation (a system role) in any way
                want = None
                break
            got = bos + render_go(go, messages, today=today)
            if datetime.date.today().isoformat() == today:
                break
        if want is None:
            continue
        if want != got:
            return False
        compared += 1
    return compared >= 2


_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.S)
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<int>-?\d+)|(?P<op>:=|=|\(|\)|,)|(?P<word>[^\s()=,:]+))')


def render_go(template: str, messages, today: str | None = None) -> str:
    """Render ``template`` as Ollama renders a template that uses ``.Messages`` (its template.Execute): the
    messages collated (consecutive messages of one role joined by a blank line), ``.System`` all system
    messages joined, executed by the subset of Go's text/template that GO_TEMPLATES use: text with the
    ``{{-`` / ``-}}`` trims; ``range .Messages`` (also ``range $i, $_ := .Messages``), ``if`` / ``else if`` /
    ``else`` / ``end``, ``$x := ...``, ``.Role``, ``.Content``, ``$.System``, ``$.Messages``, string and
    integer constants, and the functions ``eq``, ``ne``, ``and``, ``or``, ``not``, ``len``, ``slice`` and Ollama's
    ``currentDate`` (``today``, YYYY-MM-DD; by default the local date, as Ollama's server takes it).
    Anything else raises ValueError (not rendered, never guessed)."""
    import datetime

    system, collated = _collate(messages)
    root = {"System": system, "Messages": collated, _TODAY: today or datetime.date.today().isoformat()}
    body, i = _parse(_lex(template), 0)
    if i != len(_lex(template)):
        raise ValueError("render_go: an {{ end }} without its block")
    out: list[str] = []
    _exec(body, root, root, [{}], out)
    return "".join(out)


def _collate(messages):
    system, collated = [], []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "system":
            system.append(content)
        if collated and collated[-1]["Role"] == role and role != "tool":
            collated[-1]["Content"] += "\n\n" + content
        else:
            collated.append({"Role": role, "Content": content})
    return "\n\n".join(system), collated


def _lex(template: str) -> list[tuple[str, str]]:
    items: list[tuple[str, str]] = []
    pos, trim_next = 0, False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip(" \t\r\n")
        if m.group(1):
            text = text.rstrip(" \t\r\n")
        items.append(("text", text))
        items.append(("action", m.group(2)))
        trim_next, pos = bool(m.group(3)), m.end()
    tail = template[pos:]
    items.append(("text", tail.lstrip(" \t\r\n") if trim_next else tail))
    return items


def _parse(items, i, stop=("end",)):
    """(list of nodes, index of the item that stopped it) - nodes: ("text", s), ("out", expr),
    ("set", name, expr, declare), ("if", [(cond, body)...], else_body), ("range", key, value, expr, body)."""
    nodes = []
    while i < len(items):
        kind, value = items[i]
        if kind == "text":
            nodes.append(("text", value))
            i += 1
            continue
        head = value.split(None, 1)[0] if value else ""
        if head in ("end", "else"):
            if head not in stop:
                raise ValueError(f"render_go: unexpected {{{{ {value} }}}}")
            return nodes, i
        if head == "if":
            branches, cond = [], value[2:].strip()
            while True:
                body, i = _parse(items, i + 1, stop=("end", "else"))
                branches.append((cond, body))
                if i >= len(items):
                    raise ValueError("render_go: an {{ if }} without its {{ end }}")
                closing = items[i][1]
                if closing == "end":
                    nodes.append(("if", branches, []))
                    break
                if closing.startswith("else if "):
                    cond = closing[len("else if "):].strip()
                    continue
                if closing == "else":
                    else_body, i = _parse(items, i + 1)
                    if i >= len(items):
                        raise ValueError("render_go: an {{ else }} without its {{ end }}")
                    nodes.append(("if", branches, else_body))
                    break
                raise ValueError(f"render_go: does not render {{{{ {closing} }}}}")
            i += 1
        elif head == "range":
            m = re.fullmatch(r"range\s+(?:(\$\w*)\s*,\s*(\$\w*)\s*:=\s*)?(.+)", value, re.S)
            if not m:
                raise ValueError(f"render_go: does not render {{{{ {value} }}}}")
            body, i = _parse(items, i + 1)
            if i >= len(items):
                raise ValueError("render_go: a {{ range }} without its {{ end }}")
            nodes.append(("range", m.group(1), m.group(2), m.group(3), body))
            i += 1
        else:
            m = re.fullmatch(r"(\$\w+)\s*(:=|=)\s*(.+)", value, re.S)
            nodes.append(("set", m.group(1), m.group(3), m.group(2) == ":=") if m else ("out", value))
            i += 1
    return nodes, i


def _exec(nodes, dot, root, scopes, out):
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "out":
            out.append(_print(_eval(node[1], dot, root, scopes)))
        elif kind == "set":
            _, name, expr, declare = node
            value = _eval(expr, dot, root, scopes)
            if declare:
                scopes[-1][name] = value
            else:
                next(s for s in reversed(scopes) if name in s)[name] = value
        elif kind == "if":
            for cond, body in node[1]:
                if _truth(_eval(cond, dot, root, scopes)):
                    _exec(body, dot, root, scopes + [{}], out)
                    break
            else:
                _exec(node[2], dot, root, scopes + [{}], out)
        elif kind == "range":
            _, key, val, expr, body = node
            seq = _eval(expr, dot, root, scopes)
            for n, item in enumerate(seq or []):
                scope = {key: n, val: item} if key else {}
                _exec(body, item, root, scopes + [scope], out)


def _eval(expr: str, dot, root, scopes):
    tokens = [next(k for k, v in m.groupdict().items() if v is not None) + ":" + m.group(0).strip()
              for m in _TOKEN.finditer(expr) if m.group(0).strip()]
    if "".join(t.split(":", 1)[1] for t in tokens) != re.sub(r"\s+", "", expr):
        raise ValueError(f"render_go: does not render {{{{ {expr} }}}}")
    value, rest = _command(tokens, dot, root, scopes)
    if rest:
        raise ValueError(f"render_go: does not render {{{{ {expr} }}}}")
    return value


_TODAY = " today"  # the root's key for currentDate's answer (no Go field has a space)
_FUNCS = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "not": lambda a: not _truth(a), "len": len,
    "slice": lambda s, i=0, j=None: s[i:j],
}


def _command(tokens, dot, root, scopes):
    """Evaluate one command (an operand, or a function and its arguments) up to a ')' or the end."""
    if tokens and tokens[0] in ("word:and", "word:or", "word:currentDate") or tokens and tokens[0].split(":", 1)[1] in _FUNCS:
        name, args, rest = tokens[0].split(":", 1)[1], [], tokens[1:]
        while rest and rest[0] != "op:)":
            arg, rest = _operand(rest, dot, root, scopes)
            args.append(arg)
        if name == "and":
            return next((a for a in args if not _truth(a)), args[-1]), rest
        if name == "or":
            return next((a for a in args if _truth(a)), args[-1]), rest
        if name == "currentDate":  # Ollama's: the date as YYYY-MM-DD, its arguments ignored
            return root[_TODAY], rest
        return _FUNCS[name](*args), rest
    return _operand(tokens, dot, root, scopes)


def _operand(tokens, dot, root, scopes):
    kind, text = tokens[0].split(":", 1)
    rest = tokens[1:]
    if kind == "op" and text == "(":
        value, rest = _command(rest, dot, root, scopes)
        if not rest or rest[0] != "op:)":
            raise ValueError("render_go: a '(' without its ')'")
        return value, rest[1:]
    if kind == "str":
        return json.loads(text), rest
    if kind == "int":
        return int(text), rest
    if kind == "word":
        if text.startswith("$."):
            return _field(root, text[2:]), rest
        if text.startswith("."):
            return (dot if text == "." else _field(dot, text[1:])), rest
        if text == "$":
            return root, rest
        if text.startswith("$"):
            for scope in reversed(scopes):
                if text in scope:
                    return scope[text], rest
            raise ValueError(f"render_go: undefined variable {text}")
    raise ValueError(f"render_go: does not render {text!r}")


def _field(value, path: str):
    for name in path.split("."):
        if not isinstance(value, dict) or name not in value:
            raise ValueError(f"render_go: no field .{name}")
        value = value[name]
    return value


def _truth(value) -> bool:
    return bool(value)


def _print(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value)
    raise ValueError(f"render_go: does not print {type(value).__name__}")


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


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7


def _gguf_adds_bos(path: Path) -> bool:
    """The file's tokenizer.ggml.add_bos_token."""
    return _gguf_header_values(path).get("tokenizer.ggml.add_bos_token") is True


def _gguf_architecture(path: Path) -> str | None:
    """The file's general.architecture (llama.cpp's name: gemma4, qwen3...)."""
    arch = _gguf_header_values(path).get("general.architecture")
    return arch if isinstance(arch, str) else None


_HEADER_KEYS = (b"tokenizer.ggml.add_bos_token", b"general.architecture")


def _gguf_header_values(path: Path) -> dict:
    """The header keys Modelfile needs (_HEADER_KEYS: a bool, a string), read by walking the file's key-value
    header only (gguf's GGUFReader parses every array, a 150k-token vocabulary in seconds and hundreds of MB)."""
    import mmap
    import struct

    found: dict = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            return found
        pos, n_kv = 24, struct.unpack_from("<Q", buf, 16)[0]

        def skip(kind: int, pos: int) -> int:
            if kind == _GGUF_STRING:
                return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
            if kind == _GGUF_ARRAY:
                inner, count = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                if inner in _GGUF_SIZES:
                    return pos + count * _GGUF_SIZES[inner]
                for _ in range(count):
                    pos = skip(inner, pos)
                return pos
            return pos + _GGUF_SIZES[kind]

        for _ in range(n_kv):
            length = struct.unpack_from("<Q", buf, pos)[0]
            key = bytes(buf[pos + 8 : pos + 8 + length])
            pos += 8 + length
            kind = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
            if key in _HEADER_KEYS:
                if kind == _GGUF_BOOL:
                    found[key.decode()] = buf[pos] != 0
                elif kind == _GGUF_STRING:
                    length = struct.unpack_from("<Q", buf, pos)[0]
                    found[key.decode()] = bytes(buf[pos + 8 : pos + 8 + length]).decode("utf-8", "replace")
                if len(found) == len(_HEADER_KEYS):
                    break
            pos = skip(kind, pos)
    return found


def _quote(value: str, always: bool = False) -> str:
    """A Modelfile argument as Ollama's parser reads it back (no escapes: '"..."', or '\"\"\"...\"\"\"')."""
    if not always and not re.search(r'[\s"]', value):
        return value
    return f'"""{value}"""' if '"' in value else f'"{value}"'
