"""Megatron-Bridge PEFT (LoRA) runs of vision-language models merged into the base run they name.

Fixtures (tests/fixtures/megatron_vl/generate_vl_lora.py): ``bridge_lora_qwen25_vl_tp2`` / ``bridge_lora_qwen3_vl_tp2``
were written by Megatron-Bridge 0.3.1's own trainer checkpointing on CPU (TP 2): LoRA with Bridge's default targets
on the VL model imported from ``hf_qwen25`` / ``hf_qwen3``, adapter-only iterations whose run_config names the base
runs ``bridge_qwen25_vl_tp2`` / ``bridge_qwen3_vl_tp2``. On Qwen3-VL Bridge's targets also wrap the vision tower's own
``linear_fc1`` / ``linear_fc2`` (blocks, merger, deepstack merger) in its ``LinearAdapter``. References: W + alpha/r
B A on the adapter tensors read by torch.distributed.checkpoint; Bridge's own merged export
(``expected_merged.safetensors``) for the language model's split projections (q/k/v, gate/up); peft's
merge_and_unload of the exported adapter.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import dcp_tensors, merge_checkpoint, refused

VL = Path(__file__).resolve().parent / "fixtures" / "megatron_vl"
SCALE = 16 / 8  # the runs' alpha / dim (run_config.yaml peft)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _fixtures(tmp: Path) -> Path:
    if not (VL / "bridge_lora_qwen3_vl_tp2" / "iter_0000003" / ".metadata").is_file():
        pytest.skip("Megatron VL LoRA fixtures are not generated")
    shutil.copytree(VL, tmp / "vl", ignore=shutil.ignore_patterns("*.py"))
    return tmp / "vl"


def _file(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _formula(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (base.double() + SCALE * (b.double() @ a.double())).float()


@pytest.mark.parametrize("case, hf, lm", [("bridge_lora_qwen25_vl_tp2", "hf_qwen25", "model.layers"),
                                          ("bridge_lora_qwen3_vl_tp2", "hf_qwen3", "model.language_model.layers")])
def test_vl_lora_run_merges_into_its_base_run(tmp_path, case, hf, lm):
    """The language model's adapters (TP 2, fused qkv and fc1 split as Bridge exports them) merged into the base
    run the run_config names: o_proj / down_proj equal the formula on the tensors dcp reads, every language-model
    tensor equals Bridge's own merged export within 1e-6; Qwen3-VL's vision-tower pairs equal the formula (Bridge's
    export leaves them out: its tensors there are the base's); everything else is the base bit for bit."""
    vl = _fixtures(tmp_path)
    result = merge_checkpoint(vl / case, tmp_path / "out")
    assert any("LoRA run" in w and "base checkpoint" in w for w in result.warnings), result.warnings
    got, base = read_output(tmp_path / "out"), _file(vl / hf / "model.safetensors")
    bridge = _file(vl / case / "expected_merged.safetensors")
    state = dcp_tensors(vl / case / "iter_0000003")
    assert sorted(got) == sorted(base)
    for mega, proj in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
        for i in range(2):
            a, b = (state[f"language_model.decoder.layers.{mega}.adapter.linear_{p}.weight"][i] for p in ("in", "out"))
            name = f"{lm}.{i}.{proj}.weight"
            assert torch.allclose(got[name], _formula(base[name], a, b), atol=1e-6, rtol=0), name
    vision = {k[len("vision_model."):-len(".linear_in.weight")] for k in state if k.endswith(".linear_in.weight")
              and k.startswith("vision_model.")}
    assert bool(vision) == (case == "bridge_lora_qwen3_vl_tp2")
    for mod in vision:
        name = f"model.visual.{mod}.weight"
        a, b = state[f"vision_model.{mod}.linear_in.weight"], state[f"vision_model.{mod}.linear_out.weight"]
        assert torch.allclose(got[name], _formula(base[name], a, b), atol=1e-6, rtol=0), name
        assert torch.equal(bridge[name], base[name])  # Megatron-Bridge 0.3.1's export does not merge them
    merged = {f"{lm}.{i}.{p}.weight" for i in range(2) for p in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")} | {f"model.visual.{m}.weight" for m in vision}
    for name, tensor in base.items():
        if name in merged:
            assert not torch.equal(got[name], tensor), name
            if not name.startswith("model.visual."):
                assert torch.allclose(got[name], bridge[name], atol=1e-6, rtol=0), name
        else:
            assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("case, cls", [("bridge_lora_qwen25_vl_tp2", "Qwen2_5_VLForConditionalGeneration"),
                                       ("bridge_lora_qwen3_vl_tp2", "Qwen3VLForConditionalGeneration")])
def test_vl_lora_export_adapter_is_what_peft_merges(tmp_path, case, cls):
    """--export-adapter: the base and a PEFT adapter (named as transformers' model names its modules in memory:
    Qwen2.5-VL's language model is model.language_model.* there, model.* on disk; Qwen3-VL's vision tower included)
    that peft applies to transformers' model of that base and merges (merge_and_unload) into the weights our merge
    writes; peft's target matching leaves Qwen2.5-VL's vision gate/up/down_proj alone."""
    vl = _fixtures(tmp_path)
    merge_checkpoint(vl / case, tmp_path / "merged")
    merge_checkpoint(vl / case, tmp_path / "export", export_adapter=True)
    import json

    import peft
    import transformers

    adapter = tmp_path / "export" / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    model = getattr(transformers, cls).from_pretrained(tmp_path / "export", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter)
    assert sum(".lora_A." in n for n, _ in model.named_parameters()) == len(
        [k for k in _file(adapter / "adapter_model.safetensors") if ".lora_A." in k])
    want = model.merge_and_unload().state_dict()
    got = getattr(transformers, cls).from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-6, rtol=0), name


def test_vl_lora_merge_verifies(tmp_path):
    """Verification (structure against peft's target matching, recompute, and the merged model against peft's
    unmerged one, layer by layer) passes on the Qwen2.5-VL run, whose language model is renamed on disk."""
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    vl = _fixtures(tmp_path)
    out = tmp_path / "out"
    merge_checkpoint(vl / "bridge_lora_qwen25_vl_tp2", out)
    report = verify_merge(out, MergeOptions(checkpoint=vl / "bridge_lora_qwen25_vl_tp2", out=out))
    assert report.passed and [c.status for c in report.checks] == ["pass"] * 3, [
        (c.name, c.status, c.summary, c.details) for c in report.checks]


def test_vl_lora_refusal(tmp_path):
    """The Qwen3-VL run (vision LoRA on linear_fc1/linear_fc2) with --base a Qwen2.5-VL, whose vision tower has no
    such layers: one sentence, nothing written."""
    vl = _fixtures(tmp_path)
    refused(vl / "bridge_lora_qwen3_vl_tp2", tmp_path / "out", "vision tower", "no single place",
            base=vl / "hf_qwen25")
