"""Megatron-Bridge PEFT (LoRA) run of Qwen3-VL-MoE merged into the base run it names, LoRA on the experts included.

Fixture (tests/fixtures/megatron_vl/generate_vl_moe_lora.py): ``bridge_lora_qwen3_vl_moe_tp2`` was written by
Megatron-Bridge 0.3.1's own trainer checkpointing on CPU (TP 2, experts whole on both ranks: ETP 1, EP 1): LoRA with
Bridge's default targets on the model imported from ``hf_qwen3_moe`` (megatron-core's local spec: every expert its own
linear_fc1 / linear_fc2, which Bridge's targets wrap too), an adapter-only iteration whose run_config names the base
run ``bridge_qwen3_vl_moe_tp2``. References: W + alpha/r B A on the adapter tensors torch.distributed.checkpoint reads,
placed by hand in transformers' packed experts; peft's merge_and_unload of the exported adapter.

transformers 5.25's Qwen3-VL-MoE (modeling_qwen3_vl_moe.py, Qwen3VLMoeTextExperts): ``gate_up_proj`` is
[experts, 2 * moe_intermediate, hidden] and expert e computes ``linear(x, gate_up_proj[e]).chunk(2)`` = (gate, up);
``down_proj`` is [experts, hidden, moe_intermediate], ``linear(h, down_proj[e])``. ``hf_qwen3_moe`` was saved by
transformers 4.57 in the Hub release's layout (gate_up_proj [experts, hidden, 2I], down_proj [experts, I, hidden]),
which transformers 5 reads transposed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import dcp_tensors, merge_checkpoint, refused

VL = Path(__file__).resolve().parent / "fixtures" / "megatron_vl"
CASE = "bridge_lora_qwen3_vl_moe_tp2"
SCALE = 16 / 8  # the run's alpha / dim (run_config.yaml peft)
LM = "model.language_model.layers"
EXPERTS, LAYERS, HEADS, KV, HEAD_DIM = 4, 2, 4, 2, 8  # hf_qwen3_moe/config.json


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _fixtures(tmp: Path) -> Path:
    if not (VL / CASE / "iter_0000003" / ".metadata").is_file():
        pytest.skip("Megatron VL MoE LoRA fixture is not generated")
    shutil.copytree(VL, tmp / "vl", ignore=shutil.ignore_patterns("*.py"))
    return tmp / "vl"


def _file(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def _delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return SCALE * (b.double() @ a.double())


def _expected(vl: Path) -> dict:
    """The merged model in transformers 5's names and layout, by hand from the base file and the adapter tensors."""
    base = _file(vl / "hf_qwen3_moe" / "model.safetensors")
    state = dcp_tensors(vl / CASE / "iter_0000003")
    want = {k: v.double() for k, v in base.items()}
    ad = "language_model.decoder.layers.{}.adapter.linear_{}.weight"
    group = (HEADS // KV + 2) * HEAD_DIM  # megatron's fused qkv: per query group [q heads; k; v]
    q_rows = HEADS // KV * HEAD_DIM
    for i in range(LAYERS):
        a, b = (state[ad.format("self_attention.linear_qkv", p)][i] for p in ("in", "out"))
        d = _delta(a, b)
        for name, lo, hi in (("q", 0, q_rows), ("k", q_rows, q_rows + HEAD_DIM), ("v", q_rows + HEAD_DIM, group)):
            rows = torch.cat([d[g * group + lo:g * group + hi] for g in range(KV)])
            want[f"{LM}.{i}.self_attn.{name}_proj.weight"] += rows
        a, b = (state[ad.format("self_attention.linear_proj", p)][i] for p in ("in", "out"))
        want[f"{LM}.{i}.self_attn.o_proj.weight"] += _delta(a, b)
        gate_up = f"{LM}.{i}.mlp.experts.gate_up_proj"
        down = f"{LM}.{i}.mlp.experts.down_proj"
        assert base[gate_up].shape == (EXPERTS, 32, 16) and base[down].shape == (EXPERTS, 8, 32)  # 4.57's layout
        want[gate_up] = want[gate_up].transpose(1, 2).clone()  # [E, 2I, H]
        want[down] = want[down].transpose(1, 2).clone()  # [E, H, I]
        for e in range(EXPERTS):  # megatron-core's expert fc1 rows are [gate; up], as gate_up_proj[e]'s
            a, b = (state[ad.format("mlp.experts.experts.linear_fc1", p)][i, e] for p in ("in", "out"))
            want[gate_up][e] += _delta(a, b)
            a, b = (state[ad.format("mlp.experts.experts.linear_fc2", p)][i, e] for p in ("in", "out"))
            want[down][e] += _delta(a, b)
    for key in state:
        if key.startswith("vision_model.") and key.endswith(".linear_in.weight"):
            mod = key[len("vision_model."):-len(".linear_in.weight")]
            b = state[f"vision_model.{mod}.linear_out.weight"]
            want[f"model.visual.{mod}.weight"] += _delta(state[key], b)
    return {k: v.float() for k, v in want.items()}, base


def test_vl_moe_lora_merges_experts_into_packed_tensors(tmp_path):
    """Attention (fused qkv split by query group), every expert's fc1 / fc2 pair placed in its expert's slice of the
    packed gate_up_proj (gate rows first) / down_proj, and the vision tower's pairs equal the formula; the router,
    norms and embeddings are the base's bit for bit."""
    vl = _fixtures(tmp_path)
    result = merge_checkpoint(vl / CASE, tmp_path / "out")
    assert any("LoRA run" in w and "base checkpoint" in w for w in result.warnings), result.warnings
    assert any("target_parameters" in w and "packed expert tensors" in w for w in result.warnings), result.warnings
    got = read_output(tmp_path / "out")
    want, base = _expected(vl)
    assert sorted(got) == sorted(want)
    changed = 0
    worst = 0.0
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        if name in base and base[name].shape == tensor.shape and torch.equal(base[name], tensor):
            assert torch.equal(got[name], tensor), name
            continue
        changed += 1
        worst = max(worst, (got[name] - tensor).abs().max().item())
        assert torch.allclose(got[name], tensor, atol=1e-6, rtol=0), name
    # per layer q, k, v, o, gate_up_proj, down_proj; the vision tower's 8 linear layers
    assert changed == LAYERS * 6 + 8 and worst < 1e-6, (changed, worst)
    for i in range(LAYERS):  # the experts did move (not the base's, transposed)
        packed = got[f"{LM}.{i}.mlp.experts.gate_up_proj"]
        assert not torch.equal(packed, base[f"{LM}.{i}.mlp.experts.gate_up_proj"].transpose(1, 2))


def test_vl_moe_lora_export_adapter_is_what_peft_merges(tmp_path):
    """--export-adapter: a PEFT adapter with the experts' LoRA as peft's target_parameters on gate_up_proj and
    down_proj, which peft applies to transformers' model of the written base and merges (merge_and_unload) into the
    weights our merge writes."""
    vl = _fixtures(tmp_path)
    merge_checkpoint(vl / CASE, tmp_path / "merged")
    merge_checkpoint(vl / CASE, tmp_path / "export", export_adapter=True)
    import peft
    import transformers

    adapter = tmp_path / "export" / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    cls = transformers.Qwen3VLMoeForConditionalGeneration
    model = peft.PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "export", dtype=torch.float32), adapter)
    saved = _file(adapter / "adapter_model.safetensors")
    assert sum(".lora_A." in n for n, _ in model.named_parameters()) == len([k for k in saved if ".lora_A." in k])
    assert any(".mlp.experts." in k for k in saved)
    want = model.merge_and_unload().state_dict()
    got = cls.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    assert sorted(want) == sorted(got)
    base = cls.from_pretrained(vl / "hf_qwen3_moe", dtype=torch.float32).state_dict()
    assert not torch.equal(want[f"{LM}.0.mlp.experts.gate_up_proj"], base[f"{LM}.0.mlp.experts.gate_up_proj"])
    for name, tensor in want.items():
        assert torch.allclose(got[name], tensor, atol=1e-6, rtol=0), name


def test_vl_moe_lora_merge_verifies(tmp_path):
    """Verification (structure, recompute, and the merged model against peft's unmerged one layer by layer) passes."""
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    vl = _fixtures(tmp_path)
    out = tmp_path / "out"
    merge_checkpoint(vl / CASE, out)
    report = verify_merge(out, MergeOptions(checkpoint=vl / CASE, out=out))
    assert report.passed and [c.status for c in report.checks] == ["pass"] * 3, [
        (c.name, c.status, c.summary, c.details) for c in report.checks]


def test_vl_moe_lora_refused_on_a_base_without_experts(tmp_path):
    """The run with --base a dense Qwen3-VL (no experts to put the expert adapters in): one sentence, nothing
    written."""
    vl = _fixtures(tmp_path)
    refused(vl / CASE, tmp_path / "out", "4 experts", "no experts", "--base", base=vl / "hf_qwen3")


def test_vl_moe_lora_merges_from_the_command_line(tmp_path):
    """`tui-merger merge RUN --out O` in its own process (the command line imports transformers ahead in a thread,
    which once made the base read as one transformers cannot build): written (verification is the test above's)."""
    import os
    import subprocess
    import sys

    vl = _fixtures(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "tui_merger", "merge", str(vl / CASE), "--out", str(tmp_path / "out"),
                          "--no-verify"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "Merged model written" in run.stdout, run.stdout + run.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
