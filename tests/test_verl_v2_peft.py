"""verl's v2 Megatron layout with Megatron-Bridge PEFT, the adapters only in ``model/dist_ckpt`` (issue 39).

The fixture (tests/fixtures/verl_v2_peft/run, made by generate.py) follows verl's v2 save call by call
(megatron_checkpoint_manager.py: the model's sharded state dict filtered to its adapters by Megatron-Bridge 0.3.1's
own ``apply_peft_adapter_filter_to_state_dict``, saved by megatron-core's ``dist_checkpointing.save`` as verl's
``save_dist_checkpointing`` calls it, TP 2 over gloo; ``model/huggingface/config.json``; ``ckpt_contents.json``).
Bridge 0.3.1 has no ``save_hf_adapter``, so the run holds no Hugging Face adapter export: the case that was refused.
References: W + alpha/r * B @ A on the tensors torch.distributed.checkpoint reads from model/dist_ckpt, with the
weights the model was imported from (fw/hf_dense, ``save_pretrained``); and Megatron-Bridge's own
``export_hf_weights(merge_adapter_weights=True)`` of the trained model (``expected_merged.safetensors``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import merge_checkpoint, refused

from tui_merger.core.formats.scan import scan

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN = FIXTURES / "verl_v2_peft" / "run"
BASE = FIXTURES / "megatron_layouts" / "fw" / "hf_dense"  # Qwen2: hidden 32, 4 heads in 2 groups of head 8, ffn 64
DIST = RUN / "global_step_3" / "actor" / "model" / "dist_ckpt"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _formula(dist: Path = DIST) -> dict:
    """W + 16/8 * B @ A per Hugging Face weight, from the dist checkpoint as torch.distributed.checkpoint reads it."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(dist)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(dist)), no_dist=True)
    base = load_file(BASE / "model.safetensors")

    def delta(mod, i):
        a, b = (state[f"decoder.layers.{mod}.adapter.{p}.weight"][i] for p in ("linear_in", "linear_out"))
        return 16 / 8 * (b.double() @ a.double())

    want = dict(base)
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = delta("self_attention.linear_qkv", i).reshape(2, 4, 8, 32)  # 2 query groups of [q, q, k, v] heads
        d = {"self_attn.q_proj.weight": qkv[:, :2].reshape(32, 32), "self_attn.k_proj.weight": qkv[:, 2].reshape(16, 32),
             "self_attn.v_proj.weight": qkv[:, 3].reshape(16, 32), "self_attn.o_proj.weight": delta("self_attention.linear_proj", i),
             "mlp.down_proj.weight": delta("mlp.linear_fc2", i)}
        fc1 = delta("mlp.linear_fc1", i)
        d["mlp.gate_proj.weight"], d["mlp.up_proj.weight"] = fc1[:64], fc1[64:]
        for name, dw in d.items():
            assert dw.abs().max() > 1e-3, name  # trained adapters
            want[p + name] = (base[p + name].double() + dw).to(base[p + name].dtype)
    return want


def test_fixture_is_verls_v2_layout():
    actor = RUN / "global_step_3" / "actor"
    manifest = json.loads((actor / "ckpt_contents.json").read_text())
    assert manifest["schema_version"] == 2 and manifest["backend"]["peft"]
    assert manifest["contents"]["peft_adapters"]["path"] == "model/dist_ckpt"
    assert (DIST / ".metadata").is_file() and not (actor / "model" / "huggingface" / "adapter").exists()


def test_merged_by_the_formula_and_as_bridge_exports_it(tmp_path):
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    out = tmp_path / "out"
    result = merge_checkpoint(RUN, out, base=BASE, lora_alpha=16)
    assert any("Megatron-Bridge PEFT" in n and "rank 8, alpha 16" in n for n in result.warnings), result.warnings
    got = read_output(out)
    want = _formula()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
    from safetensors.torch import load_file

    bridge = load_file(RUN / "expected_merged.safetensors")  # Megatron-Bridge's own merged export
    for name, tensor in bridge.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=0, msg=name)
    report = verify_merge(out, MergeOptions(checkpoint=RUN, out=out, base=BASE, lora_alpha=16))
    assert report.passed and [c.name for c in report.checks] == ["structure", "recompute", "behaviour"], [
        (c.name, c.status, c.summary) for c in report.checks]


def test_export_adapter_gives_peft_the_same_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    merge_checkpoint(RUN, out, base=BASE, lora_alpha=16, export_adapter=True)
    cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (8, 16)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / "lora_adapter")
    merged = model.merge_and_unload().state_dict()
    for name, tensor in _formula().items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_alpha_is_asked_for(tmp_path):
    refused(RUN, tmp_path / "o", "lora_alpha", "--lora-alpha", base=BASE)


def test_base_is_asked_for(tmp_path):
    refused(RUN, tmp_path / "o", "--base", lora_alpha=16)


def test_inspect_shows_the_run(tmp_path):
    (c,) = scan(RUN).candidates
    notes = " ".join(c.notes)
    assert "Megatron-Bridge PEFT run saved by verl" in notes and "--lora-alpha" in notes, notes
    assert c.needs_base and (c.lora["r"], c.lora["target_modules"]) == (8, ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"])


def test_an_incomplete_dist_checkpoint_is_still_refused(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    (run / "global_step_3" / "actor" / "model" / "dist_ckpt" / ".metadata").unlink()
    refused(run, tmp_path / "o", "model/dist_ckpt", base=BASE, lora_alpha=16)


def test_use_dist_checkpointing_still_saves_the_adapters_only(tmp_path):
    """verl's v2 save with use_dist_checkpointing=True and save_contents ["model", "hf_model"] (run_whole): its manifest
    names model/dist_ckpt as the model, but the PEFT subset replaced the model section before saving, so the dist
    checkpoint holds the adapters only; the base is asked for, not taken from it."""
    whole = FIXTURES / "verl_v2_peft" / "run_whole"
    manifest = json.loads((whole / "global_step_3" / "actor" / "ckpt_contents.json").read_text())
    assert manifest["contents"]["model"]["path"] == "model/dist_ckpt" and manifest["backend"]["use_dist_checkpointing"]
    (c,) = scan(whole).candidates
    assert c.needs_base
    refused(whole, tmp_path / "o", "--base", lora_alpha=16)
    out = tmp_path / "out"
    merge_checkpoint(whole, out, base=BASE, lora_alpha=16)
    got = read_output(out)
    for name, tensor in _formula(whole / "global_step_3" / "actor" / "model" / "dist_ckpt").items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
