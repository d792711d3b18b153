"""The Ollama TEMPLATE line (ship/modelfile.py, issue 40): our Go templates against the released Jinja
chat templates of the families the GGUF export writes.

Two independent references: Go's own text/template, executed as Ollama executes a template
(tests/fixtures/ollama/go_render.go; its renderings are committed in go_renders.json, made by
make_go_renders.py), and transformers' apply_chat_template on the chat templates as released
(released_chat_templates.json names where each was copied from). render_go, the Python renderer the
export uses to choose a template, must agree with Go everywhere; Go's rendering must equal
transformers' on every conversation the check uses."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tui_merger.core.ship.modelfile import CONVERSATIONS, DATE_TEMPLATES, GO_TEMPLATES, chosen_template, render_go

FIXTURES = Path(__file__).parent / "fixtures" / "ollama"
GO = json.loads((FIXTURES / "go_renders.json").read_text())
RELEASED = json.loads((FIXTURES / "released_chat_templates.json").read_text())["templates"]
DATE_FORMATS = ("%Y-%m-%d", *DATE_TEMPLATES)  # as Ollama's currentDate writes it, and those our templates build from it


def on_today(recorded: str) -> str:
    """A Go rendering recorded with currentDate answering GO["today"], as it reads today (the Jinja templates
    write today's date through transformers' strftime_now): the recorded day's dates, in each format, replaced."""
    then, now = datetime.date.fromisoformat(GO["today"]), datetime.date.today()
    for fmt in DATE_FORMATS:
        recorded = recorded.replace(then.strftime(fmt), now.strftime(fmt))
    return recorded


def tokenizer(entry: dict, chat_template: str | None = None):
    """A tokenizer that renders the template with the family's own BOS and EOS strings."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                   bos_token=entry["bos_token"], eos_token=entry["eos_token"],
                                   chat_template=chat_template or entry["chat_template"])


def test_the_recorded_go_renderings_are_of_the_current_templates():
    assert {n: e["template"] for n, e in GO["templates"].items()} == GO_TEMPLATES, \
        "GO_TEMPLATES changed: rerun tests/fixtures/ollama/make_go_renders.py"
    assert [list(c) for c in CONVERSATIONS] == GO["conversations"][:len(CONVERSATIONS)]


@pytest.mark.parametrize("name", sorted(GO_TEMPLATES))
def test_render_go_renders_what_go_renders(name):
    """Every template on every recorded conversation (collated roles, two system messages, none at all)."""
    for messages, want in zip(GO["conversations"], GO["templates"][name]["renders"], strict=True):
        assert render_go(GO_TEMPLATES[name], messages, today=GO["today"]) == want, messages


@pytest.mark.parametrize("fmt", sorted(DATE_TEMPLATES))
def test_a_date_built_from_currentdate_is_strftimes(fmt):
    """Granite's "%B %d, %Y" and SmolLM3's "%d %B %Y", built by Go from Ollama's currentDate on a day of each month,
    equal Python's strftime, and render_go renders them alike."""
    recorded = GO["dates"][fmt]
    assert recorded["template"] == DATE_TEMPLATES[fmt] and len(recorded["renders"]) == 12
    for day, go in recorded["renders"].items():
        assert go == datetime.date.fromisoformat(day).strftime(fmt) == render_go(DATE_TEMPLATES[fmt], [], today=day)


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain here (the committed renderings still check)")
def test_render_go_renders_what_go_renders_now():
    """With a Go toolchain: Go renders the templates again, also one the fixtures do not hold."""
    odd = '{{- $x := "" }}{{ range $i, $_ := .Messages }}{{ if ne $i 0 }},{{ end }}{{ $x = .Role }}{{ $x }}' \
          '{{ if or (eq .Role "tool") (not .Content) }}!{{ else }}={{ len (slice $.Messages $i) }}{{ end }}{{ end }}'
    cases = [{"template": t, "messages": m} for t in [*GO_TEMPLATES.values(), odd] for m in CONVERSATIONS]
    run = subprocess.run(["go", "run", "go_render.go"], cwd=FIXTURES, input=json.dumps({"today": "2031-02-03", "cases": cases}),
                         capture_output=True, text=True, check=True, timeout=300)
    assert [render_go(c["template"], c["messages"], today="2031-02-03") for c in cases] == json.loads(run.stdout)


@pytest.mark.parametrize("entry", RELEASED, ids=[e["model"] for e in RELEASED])
def test_a_released_chat_template_gets_the_go_template_that_renders_it(entry):
    """Go's rendering (not ours) plus the BOS llama.cpp adds equals transformers' rendering of the released
    template on each conversation it accepts; the export chooses that template, or none where none does."""
    tok = tokenizer(entry)
    add_bos = "bos_token" in entry["chat_template"]  # the template writes the BOS: the GGUF says add it
    name, why = chosen_template(tok, add_bos)
    assert name == entry["go_template"], why
    if name is None:
        assert "knows no Ollama template" in why
        return
    compared = 0
    for messages, go in zip(GO["conversations"], GO["templates"][name]["renders"]):
        if not messages or messages not in [list(c) for c in CONVERSATIONS]:
            continue
        try:
            want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - Gemma 1/2 and Mistral v0.1 refuse a system message
            assert any(m["role"] == "system" for m in messages)
            continue
        assert want == (entry["bos_token"] if add_bos else "") + on_today(go), messages
        compared += 1
    assert compared >= 2


def test_a_template_that_moves_the_system_prompt_is_not_matched():
    """Mistral's v1 template with the system prompt in the last user message (as later Mistral templates put
    it) renders like v1 on one turn; the multi-turn conversation with a system message tells them apart."""
    entry = next(e for e in RELEASED if e["go_template"] == "mistral-v1")
    moved = entry["chat_template"].replace("loop.first and system_message", "loop.last and system_message")
    assert moved != entry["chat_template"]
    tok = tokenizer(entry, moved)
    one_turn = list(CONVERSATIONS[1])
    assert tok.apply_chat_template(one_turn, tokenize=False, add_generation_prompt=True) == \
        "<s>" + render_go(GO_TEMPLATES["mistral-v1"], one_turn)
    name, why = chosen_template(tok, True)
    assert name is None and "knows no Ollama template" in why


def test_a_bos_the_gguf_does_not_add_is_not_matched():
    """The template writes <bos> but llama.cpp would not add one: our templates never write it, so none fits."""
    entry = next(e for e in RELEASED if e["go_template"] == "gemma")
    name, why = chosen_template(tokenizer(entry), False)
    assert name is None and "knows no Ollama template" in why


@pytest.mark.parametrize("template", [
    "{{ .Prompt }}", "{{ range .Messages }}{{ printf \"%s\" .Content }}{{ end }}", "{{ if .System }}x",
    "{{ range .Messages }}{{ .Images }}{{ end }}", "{{ end }}",
])
def test_render_go_refuses_what_it_does_not_render(template):
    with pytest.raises(ValueError, match="render_go"):
        render_go(template, [{"role": "user", "content": "x"}])


def test_a_modelfile_with_a_dated_template_says_what_it_leaves_out(tmp_path):
    """write_modelfile end to end on GPT-OSS's released template (a saved tokenizer, a GGUF header without BOS): the
    TEMPLATE line is the harmony template, a comment above it says what it leaves out, the stops are the tokenizer's
    end tokens, and the template read back from the file renders what the tokenizer renders today."""
    import gguf
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tui_merger.core.ship.modelfile import GO_TEMPLATE_NOTES, write_modelfile

    entry = next(e for e in RELEASED if e["go_template"] == "gpt-oss")
    vocab = {"<unk>": 0, "<|return|>": 1, "<|call|>": 2, "<|endoftext|>": 3}
    folder = tmp_path / "oss-merged"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            eos_token="<|return|>", chat_template=entry["chat_template"]).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3, 2]}))
    path = folder / "oss-merged-Q4_K_M.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    mf = write_modelfile(folder, path, "q4_k_m")
    assert mf.template == "gpt-oss" and mf.stops == ("<|return|>", "<|endoftext|>", "<|call|>")
    lines = mf.path.read_text().splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("# TEMPLATE renders"))
    assert lines[note].endswith(GO_TEMPLATE_NOTES["gpt-oss"]) and "currentDate" in lines[note]
    assert lines[note + 1].startswith('TEMPLATE """')
    text = mf.path.read_text()
    start = text.index('TEMPLATE """') + len('TEMPLATE """')
    written = text[start:text.index('"""', start)]
    assert written == GO_TEMPLATES["gpt-oss"]
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    for messages in CONVERSATIONS:
        assert render_go(written, messages) == tok.apply_chat_template(list(messages), tokenize=False,
                                                                       add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["gemma4", "gemma3"])
def test_gemma_4_gets_no_template_and_says_that_ollama_renders_it(tmp_path, arch):
    """Gemma 4's released templates (small and large, as Ollama committed them) are no template of ours, and a
    gemma4 GGUF gets no TEMPLATE line: Ollama sets its own gemma4 renderer from the GGUF's architecture and prompts
    with it whatever TEMPLATE says (server/create.go, server/prompt.go). The comment says that, not that Ollama
    takes the GGUF's Jinja, which is what the same tokenizer gets under another architecture."""
    import gguf
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tui_merger.core.ship.modelfile import OLLAMA_RENDERERS, write_modelfile

    small, large = (e for e in RELEASED if e["model"].startswith("Gemma 4"))
    tok = tokenizer(small)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True) == \
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert tokenizer(large).apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                add_generation_prompt=True).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<turn|>": 3}
    folder = tmp_path / "gemma-4-e4b-sql-merged"
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), bos_token="<bos>",
                            eos_token="<eos>", chat_template=small["chat_template"]).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    path = folder / "gemma-4-e4b-sql-merged-Q4_K_M.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    mf = write_modelfile(folder, path, "q4_k_m")
    text = mf.path.read_text()
    assert mf.template is None and "TEMPLATE" not in text.replace("# No TEMPLATE", "").replace("a TEMPLATE here", "")
    assert mf.stops == ("<eos>", "<turn|>")
    if arch == "gemma4":
        assert f"\n# No TEMPLATE: {OLLAMA_RENDERERS['gemma4']}\n" in text and "renderer" in mf.why_no_template
    else:
        assert "knows no Ollama template" in mf.why_no_template and "renderer" not in text
