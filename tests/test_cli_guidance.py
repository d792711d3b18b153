"""The command line meets people where they are (issue 32, items 5 and 9): ``tui-merger merge ./my-adapter``
takes the adapter when its base is known and says the ``--adapter``/``--base`` command when not; a complete
model given there is said to be one; inspect advises the download command the installed
huggingface_hub has (``hf download``). Real subprocesses on the demo's model and adapter."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from factory import edit_adapter_config
from test_cli import run_cli

from tui_merger.core.record.manifest import MANIFEST_NAME


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    from tui_merger.demo import build_demo

    base, _ = build_demo(tmp_path_factory.mktemp("guidance") / "ws")
    return base.parent


@pytest.fixture
def ws(demo, tmp_path) -> Path:
    ws = tmp_path / "ws"
    shutil.copytree(demo / "base", ws / "base")
    shutil.copytree(demo / "adapter", ws / "my-adapter")
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path=str(ws / "base"))
    return ws


def errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_an_adapter_given_as_the_checkpoint_is_merged_into_the_base_it_names(ws):
    proc = run_cli("merge", "./my-adapter", "--out", "x", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert f"note: my-adapter is a PEFT adapter folder: it is merged into {ws / 'base'}, the base model it names." in proc.stderr
    assert "verl" not in proc.stderr and "Verification of" in proc.stdout and "PASSED" in proc.stdout
    manifest = json.loads((ws / "x" / MANIFEST_NAME).read_text())
    assert {i["role"]: Path(i["path"]).name for i in manifest["inputs"]} == {"base": "base", "adapter": "my-adapter"}


def test_an_adapter_given_as_the_checkpoint_goes_into_the_base_given(ws):
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct")
    proc = run_cli("merge", "my-adapter", "--base", "base", "--out", "x", "--dry-run", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert "note: my-adapter is a PEFT adapter folder: it is merged into base as --adapter." in proc.stderr
    assert "adapter    my-adapter" in proc.stdout


def test_an_adapter_without_a_known_base_gets_the_command_to_run(ws):
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct")
    proc = run_cli("merge", "./my-adapter", "--out", "x", "--force", cwd=ws)
    assert proc.returncode == 1
    assert errors(proc) == [
        "error: my-adapter is a PEFT adapter folder, not a training checkpoint, and its base model is not known here "
        "(it names Qwen/Qwen2.5-0.5B-Instruct, which is not on this machine); merge it into the model it was trained "
        "on with `tui-merger merge --base MODEL --adapter my-adapter --out x`."
    ]
    assert not (ws / "x").exists() and "Traceback" not in proc.stderr


def test_a_complete_model_given_as_the_checkpoint_is_said_to_be_one(ws):
    proc = run_cli("merge", "base", "--out", "x", cwd=ws)
    assert proc.returncode == 1
    assert errors(proc) == [
        "error: base is already a complete model (a Hugging Face model folder), so there is nothing to merge; to "
        "merge an adapter into it, run `tui-merger merge --base base --adapter ADAPTER --out x`."
    ]


def test_a_folder_that_is_nothing_still_gets_the_checkpoint_sentence(ws):
    (ws / "empty").mkdir()
    proc = run_cli("merge", "empty", "--out", "x", cwd=ws)
    assert proc.returncode == 1 and "No verl FSDP model files" in errors(proc)[0]


def test_inspect_advises_the_download_command_the_installed_client_has(ws):
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct")
    proc = run_cli("inspect", "my-adapter", cwd=ws)
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct` puts it in that cache" in proc.stdout + proc.stderr
    assert "huggingface-cli" not in proc.stdout + proc.stderr
    hf = shutil.which("hf")
    if hf is None:
        pytest.skip("huggingface_hub's hf command is not on PATH here")
    assert subprocess.run([hf, "download", "--help"], capture_output=True, text=True).returncode == 0


def test_a_kohya_file_given_as_the_checkpoint_is_an_adapter_too(ws):
    from test_base_candidates import kohya_file

    kohya_file(ws / "my-adapter", ws / "style.safetensors")
    proc = run_cli("merge", "style.safetensors", "--base", "base", "--out", "k", "--dry-run", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert "note: style.safetensors is a kohya-style LoRA file: it is merged into base as --adapter." in proc.stderr
    proc = run_cli("merge", "style.safetensors", "--out", "k", cwd=ws)
    assert proc.returncode == 1 and errors(proc)[0].startswith(
        "error: style.safetensors is a kohya-style LoRA file, not a training checkpoint, and its base model is not known here;")


def test_a_model_given_as_the_checkpoint_with_an_adapter_is_the_base(ws):
    proc = run_cli("merge", "base", "--adapter", "my-adapter", "--out", "x", "--dry-run", cwd=ws)
    assert proc.returncode == 0, proc.stderr
    assert "note: base is a Hugging Face model folder: it is the base the adapter goes into (--base)." in proc.stderr
    assert "base       base" in proc.stdout and "adapter    my-adapter" in proc.stdout


def test_an_adapter_given_as_the_checkpoint_beside_other_adapters_is_said(ws):
    proc = run_cli("merge", "my-adapter", "--adapter", "my-adapter", "--out", "x", cwd=ws)
    assert proc.returncode == 1
    assert errors(proc) == [
        "error: my-adapter is a PEFT adapter folder; give every adapter with --adapter, and the base model with --base."
    ]


def test_where_hf_is_not_on_the_path_the_full_path_of_ours_is_said(ws, tmp_path):
    """Issue 38 item 7: after a pipx install only `tui-merger` is on the PATH; the `hf` beside tui-merger's
    Python is said by its full path, and that command runs from a shell with that PATH."""
    import os
    import sys

    from test_cli import ROOT

    edit_adapter_config(ws / "my-adapter", base_model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct")
    bare = tmp_path / "bin"  # a PATH with no hf and no python on it
    bare.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "PATH": str(bare)}
    proc = subprocess.run([sys.executable, "-m", "tui_merger", "inspect", "my-adapter"], capture_output=True,
                          text=True, cwd=ws, env=env, stdin=subprocess.DEVNULL, timeout=300)
    ours = Path(sys.executable).parent / "hf"
    assert ours.is_file()
    said = f"`{ours} download Qwen/Qwen2.5-0.5B-Instruct` puts it in that cache"
    assert said in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    command = f"{ours} download --help"
    assert subprocess.run(["/bin/bash", "-c", command], capture_output=True, env=env, timeout=120).returncode == 0
