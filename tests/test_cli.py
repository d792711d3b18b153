"""The command line as users run it: real subprocesses, exit codes, output on stdout and stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factory import logits_of, probe_ids, qwen_config, reference, save_adapter, save_base

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, cwd=None, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tui_merger", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = save_base(root / "base", qwen_config())
    adapter = save_adapter(root / "adapter", base, target_modules=["q_proj", "v_proj", "down_proj"])
    return base, adapter


def test_merge_command_writes_a_model_transformers_loads(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", base, "--adapter", adapter, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "Merged model written to" in proc.stdout
    assert "[merge]" in proc.stderr and "100.0%" in proc.stderr  # plain progress lines off a terminal
    assert "Traceback" not in proc.stderr
    probe = probe_ids()
    ref_logits, _, _ = reference(base, adapter, probe=probe)
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)


def test_merge_command_dtype_and_shards(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", base, "--adapter", adapter, "--out", out, "--dtype", "bf16", "--shard-size", "100KB")
    assert proc.returncode == 0, proc.stderr
    from factory import read_output

    tensors = read_output(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert (out / "model.safetensors.index.json").is_file()


def test_bad_input_is_one_sentence_and_exit_1(pair, tmp_path):
    base, _ = pair
    proc = run_cli("merge", "--base", base, "--adapter", tmp_path / "nope", "--out", tmp_path / "o")
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]) and "Traceback" not in proc.stderr
    assert "does not exist" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_help_and_version():
    proc = run_cli("--help")
    assert proc.returncode == 0 and "merge" in proc.stdout and "demo" in proc.stdout
    proc = run_cli("merge", "--help")
    assert proc.returncode == 0 and "--shard-size" in proc.stdout
    proc = run_cli("--version")
    assert proc.returncode == 0 and "tui-merger" in proc.stdout


def test_demo_builds_and_merges_offline(tmp_path):
    proc = run_cli("demo", "--workspace", tmp_path / "ws")
    assert proc.returncode == 0, proc.stderr
    # a quiet start: the libraries' progress bars and warnings while building are not shown
    before = proc.stderr.split("[plan]")[0]
    assert before.strip() == f"Building a tiny demo model and LoRA adapter in {tmp_path / 'ws'} ...", before
    assert "Writing model shards" not in proc.stdout + proc.stderr and "FutureWarning" not in before
    merged = tmp_path / "ws" / "merged"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(merged)
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok("a merge adds the update", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == model.config.vocab_size
    assert tok.chat_template
    # the adapter really changed the weights
    from factory import read_output

    base = read_output(tmp_path / "ws" / "base")
    ours = read_output(merged)
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"], ours["model.layers.0.self_attn.q_proj.weight"])
    # issue 38 item 7: the Try it line runs as printed from a shell whose PATH has no python (after pipx,
    # `python` there is not the one with transformers): tui-merger's own Python, by its full path
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("Try it:  ")]
    assert line.startswith(f"Try it:  {sys.executable} -c "), line
    env = {**os.environ, "PATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    tried = subprocess.run(["/bin/bash", "-c", line.split(":  ", 1)[1]], capture_output=True, text=True, env=env,
                           timeout=300)
    assert tried.returncode == 0, tried.stderr[-2000:]
    # running it again reuses the workspace and replaces the merged folder
    again = run_cli("demo", "--workspace", tmp_path / "ws")
    assert again.returncode == 0, again.stderr


def test_demo_refuses_a_foreign_workspace(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "thesis.tex").write_text("precious")
    proc = run_cli("demo", "--workspace", tmp_path / "ws")
    assert proc.returncode == 1 and "not a tui-merger demo folder" in proc.stderr
    assert (tmp_path / "ws" / "thesis.tex").read_text() == "precious"


def test_merge_on_a_terminal_draws_a_progress_bar(pair, tmp_path):
    """On a terminal stderr gets rich's live bar instead of plain lines."""
    import pty

    base, adapter = pair
    master, slave = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "100"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui_merger", "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "o")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    screen = b"".join(chunks).decode("utf-8", "replace")
    assert proc.returncode == 0, screen
    assert "━" in screen and "[merge]" not in screen  # a bar, not the plain lines
    assert b"Merged model written to" in out


def test_no_terminal_explains_what_to_run_instead(pair, tmp_path):
    """Without a terminal (stdin not a TTY) and without --plain, the assistant does not start or hang:
    it names the non-interactive commands."""
    base, adapter = pair
    proc = subprocess.run(
        [sys.executable, "-m", "tui_merger", str(adapter.parent)], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "tui-merger inspect" in proc.stderr and "tui-merger merge" in proc.stderr


def _adapter_copy(adapter: Path, dest: Path, **config) -> Path:
    """A copy of ``adapter`` whose adapter_config.json has ``config`` applied (None: the key removed)."""
    import json
    import shutil

    shutil.copytree(adapter, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    for key, value in config.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def test_lora_alpha_for_an_adapter_that_records_none_is_used_and_said(pair, tmp_path):
    """Issue 38: --lora-alpha was dropped for a PEFT adapter without lora_alpha (merged at peft's 8, the
    plan said alpha=8, the manifest null). It is used, said once in the plan and the merge, recorded."""
    import json

    base, adapter = pair
    bare = _adapter_copy(adapter, tmp_path / "bare", lora_alpha=None)
    told = _adapter_copy(adapter, tmp_path / "told", lora_alpha=32)  # what peft merges at alpha 32
    out = tmp_path / "merged"
    dry = run_cli("merge", "--base", base, "--adapter", bare, "--out", out, "--lora-alpha", "32", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "alpha=32 (from --lora-alpha)" in dry.stdout and "alpha 32, from --lora-alpha" in dry.stdout
    assert "has no lora_alpha" not in dry.stdout + dry.stderr  # the warning about peft's 8 is not true here
    proc = run_cli("merge", "--base", base, "--adapter", bare, "--out", out, "--lora-alpha", "32")
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout + proc.stderr
    assert said.count("alpha 32, from --lora-alpha") == 1 and "has no lora_alpha" not in said
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["adapter"]["alpha"] == 32 and manifest["adapter"]["alpha_from"] == "--lora-alpha"
    assert all(c["status"] == "pass" for c in manifest["verification"]["checks"])
    _, want, _ = reference(base, told)
    _, at_eight, _ = reference(base, bare)
    from factory import read_output

    got = read_output(out)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(want[name], at_eight[name])  # the test tells alpha 32 from peft's 8
    for key, value in want.items():
        if key in got:
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0)


def test_no_lora_alpha_is_warned_once_in_one_wording(pair, tmp_path):
    base, adapter = pair
    bare = _adapter_copy(adapter, tmp_path / "bare", lora_alpha=None)
    proc = run_cli("merge", "--base", base, "--adapter", bare, "--out", tmp_path / "merged", "--no-verify")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("has no lora_alpha") == 1 and proc.stderr.count("default of 8") == 1, proc.stderr
    assert "give it with --lora-alpha" in proc.stderr


def test_lora_alpha_given_over_a_recorded_one_is_used_and_said(pair, tmp_path):
    """The user typed it: used instead of the recorded value, and said (as for verl's Megatron export)."""
    base, adapter = pair
    told = _adapter_copy(adapter, tmp_path / "told", lora_alpha=32)
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", base, "--adapter", adapter, "--out", out, "--lora-alpha", "32", "--no-verify")
    assert proc.returncode == 0, proc.stderr
    assert "alpha 32, from --lora-alpha, instead of the 8 recorded in" in proc.stderr
    _, want, _ = reference(base, told)
    from factory import read_output

    got = read_output(out)
    for key, value in want.items():
        if key in got:
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0)
    same = run_cli("merge", "--base", base, "--adapter", adapter, "--out", tmp_path / "same", "--lora-alpha", "8", "--dry-run")
    assert same.returncode == 0 and "from --lora-alpha" not in same.stdout  # the recorded value: nothing to say


def test_lora_alpha_given_over_a_recorded_zero_is_used_and_said(pair, tmp_path):
    """Issue 38: a recorded lora_alpha of 0 (which would change nothing) plus --lora-alpha was refused by
    the adapter reader. The user's value is used, said, recorded, and equals peft's merge at that alpha;
    without --lora-alpha it is still refused, in one sentence that says what to pass."""
    import json

    base, adapter = pair
    zero = _adapter_copy(adapter, tmp_path / "zero", lora_alpha=0)
    told = _adapter_copy(adapter, tmp_path / "told", lora_alpha=32)
    refused = run_cli("merge", "--base", base, "--adapter", zero, "--out", tmp_path / "no", "--dry-run")
    assert refused.returncode == 1 and "lora_alpha is 0" in refused.stdout and "pass --lora-alpha" in refused.stdout
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", base, "--adapter", zero, "--out", out, "--lora-alpha", "32")
    assert proc.returncode == 0, proc.stderr
    assert "alpha 32, from --lora-alpha, instead of the 0 recorded in" in proc.stderr
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["adapter"]["alpha"] == 32 and manifest["adapter"]["alpha_from"] == "--lora-alpha"
    assert all(c["status"] == "pass" for c in manifest["verification"]["checks"])
    _, want, _ = reference(base, told)
    from factory import read_output

    got = read_output(out)
    assert any(not torch.equal(got[k], v) for k, v in reference(base, adapter)[1].items() if k in got)  # not alpha 8
    for key, value in want.items():
        if key in got:
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0)


def test_adapter_option_without_base_takes_the_base_the_adapter_names(pair, tmp_path):
    """Issue 38 item 10: `merge --adapter A --out O` failed ("Say what to merge") when A names a base on
    this machine, while `merge A --out O` worked. Both take it; one that names no local base is told
    to give --base."""
    base, adapter = pair
    out = tmp_path / "merged"
    proc = run_cli("merge", "--adapter", adapter, "--out", out, "--no-verify")
    assert proc.returncode == 0, proc.stderr
    assert f"it is merged into {base}, the base model it names" in proc.stderr
    probe = probe_ids()
    ref_logits, _, _ = reference(base, adapter, probe=probe)
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)
    elsewhere = _adapter_copy(adapter, tmp_path / "elsewhere", base_model_name_or_path="someone/not-here")
    refused = run_cli("merge", "--adapter", elsewhere, "--out", tmp_path / "other")
    assert refused.returncode == 1 and "--base MODEL" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1 and not (tmp_path / "other").exists()
