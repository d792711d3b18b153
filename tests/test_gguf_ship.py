"""After the GGUF is written (issue 40): the check of the file (ship/gguf_check.py), the Ollama Modelfile
(ship/modelfile.py), "Run it locally" (ship/run_locally.py) in the command, the plain flow and the
upload. The CI path is transformers' own GGUF reader (llama.cpp is not installed there); the llama.cpp
path runs outside CI: benchmarks/gguf_check_spreads.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from test_gguf import QWEN_TEMPLATE, byte_level_tokenizer, gguf_fields, make_model, merged, models  # noqa: F401 - fixtures
from tui_merger.core.ship.gguf import export_gguf
from tui_merger.core.ship.gguf_check import FAILED, LIMITS, NOT_CHECKED, PASSED, check_gguf, record_check
from tui_merger.core.ship.modelfile import GO_TEMPLATES, render_go, write_modelfile


@pytest.fixture
def model_copy(merged, tmp_path) -> Path:
    return shutil.copytree(merged, tmp_path / "qwen2-sql-merged")


def _tensor_bytes(path: Path, name: str):
    """(offset, nbytes) of one tensor's data in a GGUF file, as gguf's reader finds it."""
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return int(t.data_offset), int(t.n_bytes)


# -- the check ------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_", ["q8_0", "q4_k_m"])
def test_a_correct_file_passes_with_transformers_reader(model_copy, type_):
    result = export_gguf(model_copy, type_)
    check = check_gguf(model_copy, result.path, type_, reader="transformers")
    d = check.details
    assert check.status == PASSED, check.summary
    assert check.reader.startswith("transformers ") and "GGUF reader" in check.reader
    assert d["ids_equal"] == d["texts"] == 6  # five samples and the rendered chat with its special tokens
    assert 0 < d["logits_rel"] <= LIMITS[type_] and d["top_equal"] + d["top_near_ties"] == d["positions"]


@pytest.mark.parametrize("type_", ["q8_0", "q4_k_m"])
def test_a_mixture_of_experts_is_judged_at_its_median_position(models, tmp_path, type_):
    """Qwen3-MoE: a correct file PASSES (positions where rounding turns the router are said, not hidden);
    its experts' down projections scaled by -4 in one layer FAIL."""
    import numpy as np

    folder = models["qwen3_moe"]
    path = export_gguf(folder, type_, tmp_path / f"moe-{type_}.gguf").path
    check = check_gguf(folder, path, type_, reader="transformers")
    assert check.passed and check.details["experts"] == 4, check.summary
    assert check.details["logits_rel_median"] <= LIMITS[type_] and "at the median position" in check.summary
    f16 = export_gguf(folder, "f16", tmp_path / "moe-f16.gguf").path
    offset, n = _tensor_bytes(f16, "blk.1.ffn_down_exps.weight")
    with open(f16, "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(n), dtype=np.float16) * np.float16(-4)
        f.seek(offset)
        f.write(values.tobytes())
    assert check_gguf(folder, f16, "f16", reader="transformers").status == FAILED


def test_one_corrupted_tensor_fails(model_copy):
    """The same file with one layer's down projection scaled (its f16 values' exponent bits moved) is FAILED."""
    import numpy as np

    result = export_gguf(model_copy, "f16")
    assert check_gguf(model_copy, result.path, "f16", reader="transformers").passed
    offset, n = _tensor_bytes(result.path, "blk.1.ffn_down.weight")
    with open(result.path, "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(n), dtype=np.float16) * np.float16(-4)
        f.seek(offset)
        f.write(values.tobytes())
    check = check_gguf(model_copy, result.path, "f16", reader="transformers")
    assert check.status == FAILED and check.details["logits_rel"] > 10 * LIMITS["f16"], check.summary
    assert check.details["ids_equal"] == 6  # the tokenizer is still right: only the logits say it


def test_a_file_with_another_tokenizer_fails(model_copy, tmp_path):
    """A GGUF made from the same weights but another vocabulary's merges: the token ids differ."""
    other = shutil.copytree(model_copy, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][: len(tok["model"]["merges"]) // 2]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    result = export_gguf(other, "f16", tmp_path / "other.gguf")
    check = check_gguf(model_copy, result.path, "f16", reader="transformers")
    assert check.status == FAILED and check.details["ids_equal"] < check.details["texts"]


def test_an_architecture_transformers_reader_does_not_know_is_not_checked(model_copy, tmp_path):
    """A file whose architecture transformers' reader does not map (the header's qwen2 renamed olmo2,
    a llama.cpp architecture of the same length) is "not checked", with the reason, never PASSED."""
    import gguf

    result = export_gguf(model_copy, "f16", tmp_path / "x.gguf")
    start = int(gguf.GGUFReader(result.path).data_offset)
    data = bytearray(result.path.read_bytes())
    data[:start] = bytes(data[:start]).replace(b"qwen2", b"olmo2")
    result.path.write_bytes(bytes(data))
    assert gguf_fields(result.path)["general.architecture"] == "olmo2"
    check = check_gguf(model_copy, result.path, "f16", reader="transformers")
    assert check.status == NOT_CHECKED and check.reader is None
    assert "does not know the olmo2 architecture" in check.summary and "llama-cpp-python" in check.summary
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:  # CI: "auto" is transformers' reader
        assert check_gguf(model_copy, result.path, "f16").status == NOT_CHECKED
        assert check_gguf(model_copy, result.path, "f16", reader="llama.cpp").summary == (
            "llama.cpp's Python binding (llama_cpp) is not installed here.")


def test_the_check_is_recorded_in_the_manifest_and_the_model_card(model_copy):
    from tui_merger.core.record.manifest import read_manifest
    from tui_merger.core.ship.run_locally import make_local

    made = make_local(model_copy, "q8_0", check="transformers")
    entry = next(e for e in read_manifest(model_copy)["gguf"] if e["path"] == "qwen2-sql-merged-Q8_0.gguf")
    assert entry["check"]["status"] == PASSED and entry["check"]["summary"] == made.check.summary
    assert entry["modelfile"] == "qwen2-sql-merged-Q8_0.Modelfile" and (model_copy / entry["modelfile"]).is_file()
    card = (model_copy / "README.md").read_text()
    assert "## GGUF" in card and "- `qwen2-sql-merged-Q8_0.gguf` (Q8_0; Ollama: `qwen2-sql-merged-Q8_0.Modelfile`). Check PASSED: token ids equal on 6/6 texts" in card
    skipped = make_local(model_copy, "f16", check="none")
    assert skipped.check.status == NOT_CHECKED
    assert "- `qwen2-sql-merged-F16.gguf` (F16; Ollama: `qwen2-sql-merged-F16.Modelfile`). Check not checked: skipped (--check none)." in (model_copy / "README.md").read_text()


def test_record_check_without_an_entry_changes_nothing(models, tmp_path):
    folder = shutil.copytree(models["qwen2"], tmp_path / "plain")  # no merge_manifest.json
    result = export_gguf(folder, "f16")
    from tui_merger.core.ship.gguf_check import GgufCheck

    assert record_check(folder, result.path, GgufCheck(NOT_CHECKED, None, "x")) is False
    assert not (folder / "merge_manifest.json").exists()


# -- the Modelfile ---------------------------------------------------------------------------------


def test_modelfile_for_a_chatml_model(model_copy):
    result = export_gguf(model_copy, "q8_0")
    mf = write_modelfile(model_copy, result.path, "q8_0")
    assert mf.path == model_copy / "qwen2-sql-merged-Q8_0.Modelfile" and mf.template == "chatml"
    lines = mf.path.read_text().splitlines()
    assert "FROM ./qwen2-sql-merged-Q8_0.gguf" in lines
    assert 'PARAMETER stop "<|im_end|>"' in lines and sum(line.startswith("PARAMETER") for line in lines) == 1
    text = mf.path.read_text()
    template = text[text.index('TEMPLATE """') + 12: text.index('"""', text.index('TEMPLATE """') + 12)]
    assert template == GO_TEMPLATES["chatml"]
    assert mf.commands(result.path) == [
        f"ollama create qwen2-sql-merged:q8_0 -f {mf.path}", f"llama-cli -m {result.path}"]


def test_the_go_template_renders_what_the_tokenizers_template_renders():
    """The check behind TEMPLATE: the written Go template, rendered, equals transformers' rendering."""
    tok = byte_level_tokenizer("qwen")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
    assert render_go(GO_TEMPLATES["chatml"], messages) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_modelfile_for_a_llama3_model_leaves_the_bos_to_llama_cpp(models, tmp_path):
    folder = make_model(tmp_path / "llama3-chat", "llama", torch.bfloat16)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    result = export_gguf(folder, "f16")
    assert gguf_fields(result.path)["tokenizer.ggml.add_bos_token"] is True
    mf = write_modelfile(folder, result.path, "f16")
    assert mf.template == "llama3"
    assert mf.stops == ("<|eot_id|>", "<|end_of_text|>")  # eos_token, then generation_config's ids 1 and 4


def test_a_template_no_known_conversion_renders_gets_no_template_line(models, tmp_path):
    folder = shutil.copytree(models["qwen2"], tmp_path / "odd")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = QWEN_TEMPLATE.replace("<|im_start|>{{ m['role'] }}\n", "<|im_start|>{{ m['role'] }}:\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    result = export_gguf(folder, "f16")
    mf = write_modelfile(folder, result.path, "f16")
    assert mf.template is None and "TEMPLATE" not in mf.text.replace("# No TEMPLATE", "")
    assert "# No TEMPLATE: tui-merger knows no Ollama template that renders this model's chat template exactly" in mf.text
    assert "tokenizer.chat_template" in mf.text


# -- the command, the estimate, the plain flow, the upload ---------------------------------------------


def test_cli_checks_writes_the_modelfile_and_prints_the_lines(model_copy, capsys):
    from tui_merger.cli import main

    assert main(["gguf", str(model_copy), "--type", "q8_0", "--check", "transformers", "--plain"]) == 0
    out, _ = capsys.readouterr()
    gguf_path, mf = model_copy / "qwen2-sql-merged-Q8_0.gguf", model_copy / "qwen2-sql-merged-Q8_0.Modelfile"
    assert "  check PASSED: token ids equal on 6/6 texts" in out and "read by transformers" in out
    assert f"  Ollama Modelfile {mf}\n" in out
    assert out.rstrip().endswith(f"Run it:\n  ollama create qwen2-sql-merged:q8_0 -f {mf}\n  llama-cli -m {gguf_path}")


def test_cli_exits_4_when_the_check_fails(model_copy, capsys, monkeypatch):
    """A limit below the file's real spread: FAILED, exit 4, and the file stands, recorded as failed."""
    from tui_merger.cli import main
    from tui_merger.core.record.manifest import read_manifest
    from tui_merger.core.ship import gguf_check

    monkeypatch.setitem(gguf_check.LIMITS, "q8_0", 1e-9)
    monkeypatch.setattr(gguf_check, "QUANT_FACTOR", 0)  # nor a limit from the model's own movement
    assert main(["gguf", str(model_copy), "--type", "q8_0", "--check", "transformers", "--plain"]) == 4
    out, err = capsys.readouterr()
    assert "  check FAILED: " in out and "do not share it" in err
    assert read_manifest(model_copy)["gguf"][0]["check"]["status"] == FAILED


def test_the_estimate_is_the_size_written(model_copy):
    from tui_merger.core.ship.run_locally import estimate

    before = sorted(model_copy.iterdir())
    e = estimate(model_copy, "q4_k_m")
    assert sorted(model_copy.iterdir()) == before  # the estimate wrote nothing
    size = export_gguf(model_copy, "q4_k_m").size
    assert e.size <= size <= e.size + 2_000_000 and e.seconds > 0  # the header and tokenizer come on top


def test_upload_carries_the_modelfile_of_a_gguf_written_outside(model_copy, tmp_path):
    import subprocess
    import sys

    from hub_server import HubServer

    from tui_merger.core.ship.run_locally import make_local

    inside = make_local(model_copy, "q8_0", check="none")
    outside = make_local(model_copy, "f16", tmp_path / "shared.gguf", check="none")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    code = "import sys; from tui_merger.cli import main; sys.exit(main(sys.argv[1:]))"
    with HubServer() as hub:
        hub.add_token("hf_alice_write_5ecret", "alice", "write")
        env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
                   HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_alice_write_5ecret")
        run = subprocess.run([sys.executable, "-c", code, "upload", str(model_copy), "--repo-id", "alice/m"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        stored = hub.repos["alice/m"].files()
    assert stored[inside.modelfile.path.name] == inside.modelfile.path.read_bytes()
    assert stored["shared.gguf"] == outside.result.path.read_bytes()
    assert stored["shared.Modelfile"] == outside.modelfile.path.read_bytes()
    assert b"FROM ./shared.gguf" in stored["shared.Modelfile"]
    assert f"Uploading its Ollama Modelfile {outside.modelfile.path} as shared.Modelfile." in run.stderr


def test_the_plain_flow_offers_run_it_locally_with_q4_k_m_first(tmp_path, monkeypatch):
    """The plain flow's Finish: "Run it locally" preselects q4_k_m, says size and time before writing,
    then writes, checks, and prints the Modelfile and the lines to run it."""
    import io

    from tui_merger.demo import build_demo
    from tui_merger.plain import run_plain

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    base, _ = build_demo(tmp_path / "ws")
    answers = ["", "", "", "", "2", "", "", "", "4"]  # Find, output, start, no trial; Run it locally, q4_k_m, its file, no LoRA; Done
    out = io.StringIO()
    code = run_plain(tmp_path / "ws", input=io.StringIO("".join(a + "\n" for a in answers)), output=out, dumb=True)
    text = out.getvalue()
    assert code == 0, text
    assert "2) Run it locally: a GGUF for llama.cpp, Ollama, LM Studio (checked, with an Ollama Modelfile)" in text
    assert "q4_k_m (recommended)" in text
    said = text.index("About ")
    assert " to write (at the speed measured on a 2-core machine), then checked against the model." in text[said:]
    assert said < text.index("GGUF written: ")  # size and time before the file
    [gguf_file] = list((tmp_path / "ws").glob("*/*-Q4_K_M.gguf"))
    assert f"Check PASSED: token ids equal on " in text
    assert f"Ollama Modelfile: {gguf_file.with_suffix('.Modelfile')}" in text
    assert f"  llama-cli -m {gguf_file}" in text


def test_the_farewell_gives_the_ollama_line_of_each_gguf_with_a_modelfile(model_copy):
    from types import SimpleNamespace

    from tui_merger.core.ship.run_locally import make_local
    from tui_merger.tui.steps.finish import farewell

    made = make_local(model_copy, "q8_0", check="none")
    wizard = SimpleNamespace(result=SimpleNamespace(out=model_copy), report=SimpleNamespace(passed=True), job=None,
                             out_path=model_copy)
    lines = farewell(wizard).splitlines()
    assert lines[-2:] == [f"  llama.cpp:    llama-cli -m {made.result.path}",
                          f"  Ollama:       ollama create qwen2-sql-merged:q8_0 -f {made.modelfile.path}"]
