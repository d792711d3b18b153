"""The model card says which base model was used and why that one, from the manifest, with no local
paths and the verdict said once (issue 32, items 2 and 10): a local folder taken in place of a Hub model
that is not here, a snapshot of the Hugging Face cache (the Hub id in the front matter), a local copy
named like the Hub model. Real merges of the demo's model and adapter on the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factory import edit_adapter_config
from test_cli import run_cli

from tui_merger.core.record.manifest import MANIFEST_NAME

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    from tui_merger.demo import build_demo

    base, _ = build_demo(tmp_path_factory.mktemp("card") / "ws")
    return base.parent


def front_and_body(out: Path) -> tuple[str, str]:
    card = (out / "README.md").read_text()
    _, front, body = card.split("---", 2)
    return front, body


def test_a_local_base_taken_for_a_hub_model_that_is_not_here(demo, tmp_path):
    """The issue's case: the adapter names Qwen/Qwen2.5-0.5B-Instruct, the merge used ./base."""
    ws = tmp_path / "runs"
    shutil.copytree(demo / "base", ws / "base")
    shutil.copytree(demo / "adapter", ws / "my-adapter")
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path=HUB_ID)
    proc = run_cli("merge", "--base", ws / "base", "--adapter", ws / "my-adapter", "--out", ws / "merged")
    assert proc.returncode == 0, proc.stderr
    front, body = front_and_body(ws / "merged")
    assert "base_model" not in front  # not established that ./base is that Hub model
    assert (
        "Base model: the local model folder `base` (Qwen2ForCausalLM, 4 layers), taken because its architecture and "
        "weight shapes fit all 28 LoRA modules of the adapter; the adapter names Qwen/Qwen2.5-0.5B-Instruct as its "
        "base, which was not on the machine it was merged on."
    ) in body
    assert f"This model is {HUB_ID}" not in body and "This model is that base with a LoRA adapter merged" in body
    assert "\nMerged adapter: `my-adapter`.\n" in body  # issue 38 item 18: which adapter, by name
    assert "Passed: structure, recompute, behaviour\n" in body and "Passed: passed" not in body
    assert "- behaviour: pass — The merged model answers like the adapter on the base: largest difference" in body
    assert str(tmp_path) not in body and "/tmp" not in body  # no local paths in a published card
    used = json.loads((ws / "merged" / MANIFEST_NAME).read_text())["base_used"]
    assert used == {
        "folder": "base", "repo": None, "named": HUB_ID, "named_is_this": False, "named_found": False,
        "modules": 28, "architecture": "Qwen2ForCausalLM, 4 layers",
    }


def test_a_snapshot_of_the_hugging_face_cache_is_named_by_its_hub_id(demo, tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-qwen"
    shutil.copytree(demo / "base", repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    adapter = shutil.copytree(demo / "adapter", tmp_path / "adapter")
    edit_adapter_config(adapter, base_model_name_or_path="someone/tiny-qwen")
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", repo / "snapshots" / sha, "--adapter", adapter, "--out", out, "--no-verify")
    assert proc.returncode == 0, proc.stderr
    front, body = front_and_body(out)
    assert 'base_model: "someone/tiny-qwen"' in front and "base_model_relation: finetune" in front
    assert "Base model: `someone/tiny-qwen` (Qwen2ForCausalLM, 4 layers), the base model the adapter names." in body
    assert "Not verified yet" in body and str(tmp_path) not in body


def test_a_local_copy_named_like_the_hub_model_keeps_the_hub_link(demo, tmp_path):
    """`hf download ORG/NAME --local-dir NAME` makes a folder named like the model: the card links it."""
    base = shutil.copytree(demo / "base", tmp_path / "models" / "Qwen2.5-0.5B-Instruct")
    adapter = shutil.copytree(demo / "adapter", tmp_path / "adapter")
    edit_adapter_config(adapter, base_model_name_or_path=HUB_ID)
    out = tmp_path / "merged"
    proc = run_cli("merge", "--base", base, "--adapter", adapter, "--out", out, "--no-verify")
    assert proc.returncode == 0, proc.stderr
    front, body = front_and_body(out)
    assert f'base_model: "{HUB_ID}"' in front
    assert (
        f"Base model: `{HUB_ID}` (Qwen2ForCausalLM, 4 layers), a local copy of the base model the adapter names (by "
        "its folder's name); its architecture and weight shapes fit all 28 LoRA modules of the adapter."
    ) in body
    assert str(tmp_path) not in body


def test_the_card_names_the_checkpoint_and_the_title_the_base_used(demo, tmp_path):
    """Issue 38 item 18: a trainer's checkpoint-N is named with its run; the suggested output name (the card's
    title) comes from the base the merge used, not from the Hub model the adapter names and that is not here."""
    ws = tmp_path / "runs"
    shutil.copytree(demo / "base", ws / "base")
    shutil.copytree(demo / "adapter", ws / "my-run" / "checkpoint-200")
    edit_adapter_config(ws / "my-run" / "checkpoint-200", base_model_name_or_path=HUB_ID)
    proc = run_cli("merge", "--base", ws / "base", "--adapter", ws / "my-run" / "checkpoint-200", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    [suggested] = [line.split("suggested: ")[1] for line in proc.stdout.splitlines() if "suggested: " in line]
    assert suggested.startswith("base-my-run-r8-") and "Qwen2.5" not in suggested
    out = ws / suggested
    proc = run_cli("merge", "--base", ws / "base", "--adapter", ws / "my-run" / "checkpoint-200", "--out", out,
                   "--no-verify")
    assert proc.returncode == 0, proc.stderr
    _, body = front_and_body(out)
    assert f"\n# {suggested}\n" in body and "the local model folder `base`" in body
    assert "\nMerged adapter: `my-run/checkpoint-200`.\n" in body and str(tmp_path) not in body
