"""verl Megatron LoRA runs: the Hugging Face adapter export path.

A Megatron LoRA run (Megatron-Bridge PEFT) holds the adapter, not the base weights. Megatron-Bridge can
also export the adapter in Hugging Face PEFT format, which verl keeps in ``model/huggingface/adapter/``
(``adapter_config.json`` + ``adapter_model.safetensors``); that export is merged into ``--base`` (or the
base the export names).

What is real and what is laid out here: Megatron-Bridge cannot be installed on a CPU machine (its LoRA
modules import Transformer Engine, whose torch extension needs CUDA to build), so no Megatron-Bridge
adapter shards exist in these tests and none is made by hand. The adapter export is a real PEFT adapter
written by peft's ``save_pretrained`` on a tiny Qwen2 model (what the export is); the run folder around
it (``ckpt_contents.json`` with ``backend.peft``, ``model/huggingface/config.json``) follows verl's v2
layout as issue 20 describes it. The reference is peft itself: ``PeftModel`` logits (unmerged) and
``merge_and_unload`` tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import ALL_LINEAR, probe_ids, qwen_config, read_output, reference, refused_by_cli, save_adapter, save_base

from tui_merger.cli import main as cli_main

ATOL = 1e-5  # fp32: W + s*B@A in another order than peft's


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    top = tmp_path_factory.mktemp("mlora")
    base = save_base(top / "base", qwen_config())
    adapter = save_adapter(top / "adapter", base, r=4, lora_alpha=16, target_modules=ALL_LINEAR)
    return base, adapter


def _run(tmp_path: Path, made, *, export=True, names_base=True) -> Path:
    """A verl v2 Megatron LoRA run folder (global_step_3/actor) around the PEFT adapter export."""
    base, adapter = made
    run = tmp_path / "run"
    actor = run / "global_step_3" / "actor"
    hf = actor / "model" / "huggingface"
    hf.mkdir(parents=True)
    qwen_config().save_pretrained(hf)
    (actor / "model" / "dist_ckpt").mkdir()  # where Megatron-Bridge's adapter shards would be
    if export:
        shutil.copytree(adapter, hf / "adapter")
        if not names_base:
            cfg = json.loads((hf / "adapter" / "adapter_config.json").read_text())
            cfg["base_model_name_or_path"] = str(tmp_path / "moved-away")
            (hf / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    manifest = {
        "schema_version": 2, "framework": "megatron", "role": "actor", "arch": "Qwen2ForCausalLM", "global_step": 3,
        "backend": {"has_bridge": True, "use_dist_checkpointing": True, "peft": True},
        "contents": {"peft_adapters": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"},
                     "hf_config": {"path": "model/huggingface", "format": "huggingface"}},
    }
    (actor / "ckpt_contents.json").write_text(json.dumps(manifest))
    (run / "latest_checkpointed_iteration.txt").write_text("3")
    return run


def _merge(run: Path, out: Path, *extra) -> int:
    return cli_main(["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(out), "--plain",
                     *extra])


def _same_as_peft(out: Path, base: Path, adapter: Path) -> None:
    probe = probe_ids()
    logits, merged, _ = reference(base, adapter, probe=probe)
    ours = read_output(out)
    assert set(ours) == {k for k in merged if k != "lm_head.weight" or "lm_head.weight" in ours}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, merged[name], atol=ATOL, rtol=0, msg=name)
    from factory import logits_of

    torch.testing.assert_close(logits_of(out, probe), logits, atol=1e-4, rtol=0)


def test_export_is_merged_into_the_base_it_names(tmp_path, made):
    base, adapter = made
    out = tmp_path / "merged"
    assert _merge(_run(tmp_path, made), out) == 0
    _same_as_peft(out, base, adapter)
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert {c["name"]: c["status"] for c in manifest["verification"]["checks"]} == {
        "structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_base_given_with_base(tmp_path, made):
    """The export names a base that is not here: --base says which."""
    base, adapter = made
    out = tmp_path / "merged"
    assert _merge(_run(tmp_path, made, names_base=False), out, "--base", str(base)) == 0
    _same_as_peft(out, base, adapter)


def test_export_adapter_writes_the_base_and_the_peft_adapter(tmp_path, made):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter = made
    out = tmp_path / "exported"
    assert _merge(_run(tmp_path, made), out, "--export-adapter") == 0
    ours, want = read_output(out), read_output(base)
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want)
    probe = probe_ids()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / "lora_adapter")
    logits, _, _ = reference(base, adapter, probe=probe)
    with torch.no_grad():
        torch.testing.assert_close(model(probe).logits, logits, atol=1e-5, rtol=0)


def test_lora_alpha_given_replaces_the_recorded_one(tmp_path, made, capsys):
    base, adapter = made
    edited = tmp_path / "edited-adapter"
    shutil.copytree(adapter, edited)
    cfg = json.loads((edited / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 4
    (edited / "adapter_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "merged"
    assert _merge(_run(tmp_path, made), out, "--lora-alpha", "4") == 0
    said = capsys.readouterr()
    assert "lora_alpha 4 (--lora-alpha) is used instead of the 16 recorded" in said.out + said.err
    _same_as_peft(out, base, edited)


def test_an_export_without_lora_alpha_needs_lora_alpha(tmp_path, made, capsys):
    run = _run(tmp_path, made)
    path = run / "global_step_3" / "actor" / "model" / "huggingface" / "adapter" / "adapter_config.json"
    cfg = json.loads(path.read_text())
    del cfg["lora_alpha"]
    path.write_text(json.dumps(cfg))
    args = ["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(tmp_path / "merged"), "--plain"]
    refused_by_cli(capsys, tmp_path, args, ["lora_alpha", "is not recorded", "--lora-alpha"])


def test_a_run_without_the_export_says_what_is_missing(tmp_path, made, capsys):
    run = _run(tmp_path, made, export=False)
    args = ["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(tmp_path / "merged"), "--plain"]
    line = refused_by_cli(capsys, tmp_path, args, ["model/dist_ckpt holds no complete dist checkpoint", ".metadata",
                                                   "model/huggingface/adapter/", "--base"])
    assert line.count(".") <= 6  # one sentence (paths and file names have dots)


def test_a_base_that_is_not_here_is_asked_for(tmp_path, made, capsys):
    run = _run(tmp_path, made, names_base=False)
    args = ["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(tmp_path / "merged"), "--plain"]
    refused_by_cli(capsys, tmp_path, args, ["Megatron LoRA run", "moved-away", "not on this machine", "--base"])


def test_inspect_shows_the_lora_run(tmp_path, made):
    from tui_merger.core.formats.registry import format_of
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import needs_base, why_not_mergeable

    base, _ = made
    run = _run(tmp_path, made)
    (c,) = [c for c in scan(run).candidates if c.kind == "verl-megatron"]
    assert c.lora["r"] == 4 and c.lora["alpha"] == 16 and c.lora["n_modules"] == 2 * 7
    assert c.lora["target_modules"] == sorted(ALL_LINEAR)
    assert c.base_path == str(base) and c.base_resolves == "path"
    assert why_not_mergeable(c) is None and not needs_base(c)
    assert any("LoRA run" in n and "adapter export" in n for n in c.notes)
    step = format_of(c).next_step(c, str(run), str(base), "out")
    assert step.startswith("tui-merger merge --backend megatron") and "--base" in step
    # no export: inspect says what is missing, and the assistant does not offer a merge
    other = _run(tmp_path / "other", made, export=False)
    (c,) = [c for c in scan(other).candidates if c.kind == "verl-megatron"]
    problem = why_not_mergeable(c)
    assert problem and "Megatron-Bridge adapters" in problem and "model/huggingface/adapter/" in problem
    assert format_of(c).next_step(c, str(other), "BASE", "out") == problem
