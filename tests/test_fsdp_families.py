"""verl FSDP checkpoints of today's model families, written by torch.distributed (gloo, CPU) from
transformers 5 models: a vision-language model (Qwen2.5-VL: ``model.language_model.*`` and
``model.visual.*`` in the state dict), MoE models (Qwen3-MoE: experts packed as
``mlp.experts.gate_up_proj`` / ``down_proj``, split on saving; GPT-OSS: kept packed), Qwen3.5
(linear-attention layers) and Qwen3.5-MoE (both, with a gated shared expert), and the other MoE families
verl trains through FSDP (Mixtral, Qwen2-MoE, DeepSeek-V3, GLM-4.5, OLMoE; the slow half: Qwen3-Next,
DeepSeek-V2, dots1, ERNIE-4.5-MoE, Hunyuan-MoE, FlexOlmo, MiniMax-M2, GraniteMoE, DeepSeek-V3.2, GLM-MoE-DSA,
GraniteMoE-hybrid), full weights and LoRA
(all-linear: the experts and the router through target_parameters where peft reaches them). The output is what
``save_pretrained`` writes for the trained model: the same tensor names (experts one by one), shapes,
dtypes and values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factory import read_output, verification_checks
from fsdp_factory import make_cached

from tui_merger.cli import main


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    return make_cached(tmp_path_factory)


def merge(capsys, checkpoint: str, out: Path) -> str:
    code = main(["merge", checkpoint, "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    return said.out + said.err


# more MoE families verl's FSDP path trains (any HF model): full weights and LoRA, one fixture each; the
# first five are the issue's, the others the slow half (CI runs them)
MORE_MOE = ["mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "olmoe"]
EXTRA_MOE = ["qwen3_next", "deepseek_v2", "dots1", "ernie4_5_moe", "hunyuan_v1_moe", "flex_olmo", "minimax_m2", "granitemoe",
             "deepseek_v32", "glm_moe_dsa", "granitemoehybrid"]
# not MiniMax: transformers 5.24's lightning attention mixes fp32 and bf16, so its bf16 FSDP training step fails
ALL_MOE = MORE_MOE + [pytest.param(f, marks=pytest.mark.slow) for f in EXTRA_MOE]


def _layer(i: int, mlp: str = "mlp", router: str = "gate.weight") -> tuple:
    return f"model.layers.{i}.{mlp}.experts", f"model.layers.{i}.{mlp}.{router}"


# where save_pretrained writes the first MoE layer's experts (one by one, or packed) and its router
# (DeepSeek and GLM-4.5 start with a dense layer; Mixtral's and MiniMax-M2's experts are w1/w2/w3)
MOE_ON_DISK = {
    **{f: _layer(0, "block_sparse_moe") for f in ("mixtral", "minimax_m2")},
    **{f: _layer(0) for f in ("qwen2_moe", "olmoe", "qwen3_next", "flex_olmo")},
    **{f: _layer(1) for f in ("deepseek_v3", "glm4_moe", "deepseek_v2", "dots1", "ernie4_5_moe", "deepseek_v32",
                              "glm_moe_dsa")},
    "hunyuan_v1_moe": _layer(0, router="gate.wg.weight"),
    **{f: ("model.layers.0.block_sparse_moe.input_linear.weight", "model.layers.0.block_sparse_moe.router.layer.weight")
       for f in ("granitemoe", "granitemoehybrid")},
}
# peft's all-linear reaches neither their experts nor their router
NOT_REACHED = {"qwen2_moe", "granitemoe", "granitemoehybrid"}


def _experts(family: str, names) -> list[str]:
    where, _ = MOE_ON_DISK[family]
    if where.endswith(".weight"):  # kept packed: GraniteMoE's input_linear / output_linear
        return [where, where.replace("input_linear", "output_linear")]  # GraniteMoE(Hybrid)
    return [n for n in names if n.startswith(where + ".")]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_moe", "qwen3_5", "gpt_oss", "qwen3_5_moe"] + ALL_MOE)
def test_full_weights_come_out_as_save_pretrained_writes_them(fsdp_checkpoint, family, tmp_path, capsys):
    info = fsdp_checkpoint(family=family)
    out = tmp_path / "merged"
    merge(capsys, info["checkpoint_dir"], out)
    got, expected = read_output(out), read_output(Path(info["reference_hf"]))
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and torch.equal(got[name], ref), name
    if family in MOE_ON_DISK:  # every expert written, as save_pretrained splits (or keeps) them
        experts = _experts(family, got)
        assert len(experts) == (2 if family.startswith("granitemoe") else 4 * 3) and all(n in got for n in experts), sorted(got)
    if family in ("qwen3_moe", "qwen3_5_moe"):
        assert any(".mlp.experts.3.gate_proj.weight" in n for n in got)
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in got)
    elif family == "qwen2_5_vl":
        assert any(n.startswith("visual.") for n in got) and not any(".language_model." in n for n in got)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_5", "qwen3_5_moe", "qwen3_moe"] + ALL_MOE)
def test_a_lora_run_merges_like_peft(fsdp_checkpoint, family, tmp_path, capsys):
    import transformers
    from peft import PeftModel

    info = fsdp_checkpoint(family=family, lora=True)
    out = tmp_path / "merged"
    merge(capsys, info["checkpoint_dir"], out)
    model = getattr(transformers, info["architecture"]).from_pretrained(info["reference_base"], dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(model, info["reference_adapter"]).merge_and_unload()
    peft_merged.save_pretrained(tmp_path / "peft")
    got, expected = read_output(out), read_output(tmp_path / "peft")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    if family == "qwen3_moe":
        # all-linear on Qwen3-MoE also puts LoRA on the packed experts (gate_up at 2r) and the router's
        # gate.weight (peft's target_parameters); verl's lora_train_meta.json records only r and alpha:
        # which parameters and their ranks are read back from the keys, the model and the pairs' shapes
        assert "target_parameters" not in json.loads(
            (Path(info["checkpoint_dir"]) / "lora_train_meta.json").read_text())
        saved = json.loads((Path(info["reference_adapter"]) / "adapter_config.json").read_text())
        assert sorted(saved["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"]
        base = read_output(Path(info["reference_base"]))
        for name in ("model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight",
                     "model.layers.1.mlp.gate.weight"):
            assert not torch.equal(got[name], base[name]), name
    if family in MOE_ON_DISK:
        saved = json.loads((Path(info["reference_adapter"]) / "adapter_config.json").read_text())
        base = read_output(Path(info["reference_base"]))
        experts, (_, router) = _experts(family, got), MOE_ON_DISK[family]
        assert len(experts) == (2 if family.startswith("granitemoe") else 4 * 3), experts
        if family in NOT_REACHED:  # the experts come out as the trained base's
            assert not saved.get("target_parameters")
            assert all(torch.equal(got[n], base[n]) for n in experts)
        else:  # LoRA on every expert (gate_up at 2r, read back from the pairs' shapes) and on the router
            assert sorted(saved["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"]
            assert all(not torch.equal(got[n], base[n]) for n in experts), experts
            assert not torch.equal(got[router], base[router]), router
        if family == "qwen2_moe":  # the shared expert and its gate are Linears: reached
            assert not torch.equal(got["model.layers.0.mlp.shared_expert_gate.weight"],
                                   base["model.layers.0.mlp.shared_expert_gate.weight"])
    if family == "qwen3_5_moe":
        # verl's target_modules="all-linear" reaches nn.Linear modules only: the shared expert and its
        # gate, not the packed experts (parameters of Qwen3_5MoeExperts) nor the router; those come out
        # as the trained base's, one tensor per expert
        targets = json.loads((Path(info["reference_adapter"]) / "adapter_config.json").read_text())["target_modules"]
        assert any(t.endswith("mlp.shared_expert_gate") for t in targets)
        assert not any(".experts" in t or t.endswith("mlp.gate") for t in targets)
        base = read_output(Path(info["reference_base"]))
        experts = [n for n in got if ".mlp.experts." in n]
        assert len(experts) == 2 * 4 * 3 and all(torch.equal(got[n], base[n]) for n in experts)
        assert not torch.equal(got["model.layers.0.mlp.shared_expert_gate.weight"],
                               base["model.layers.0.mlp.shared_expert_gate.weight"])


def test_qwen3_5_moe_goes_through_inspect_and_dry_run(fsdp_checkpoint, tmp_path, capsys):
    full, lora = fsdp_checkpoint(family="qwen3_5_moe"), fsdp_checkpoint(family="qwen3_5_moe", lora=True)
    written = len(read_output(Path(full["reference_hf"])))  # what save_pretrained writes: experts one by one
    assert written == 56
    assert main(["inspect", lora["run_dir"]]) == 0
    shown = capsys.readouterr().out
    assert "verl-fsdp" in shown and "r 8, alpha 16" in shown and "17 modules" in shown, shown
    for info, merged in ((full, 0), (lora, 17)):
        out = tmp_path / f"m{merged}"
        assert main(["merge", info["checkpoint_dir"], "--out", str(out), "--dry-run"]) == 0
        plan = capsys.readouterr().out
        what = f"{merged} merged" if merged else "converted, no adapter to merge"  # a conversion says so (issue 32)
        assert f"writes     {written} tensors ({what})" in plan, plan
        assert not out.exists()


def test_inspect_and_dry_run_show_the_family(fsdp_checkpoint, tmp_path, capsys):
    info = fsdp_checkpoint(family="qwen2_5_vl")
    assert main(["inspect", info["run_dir"]]) == 0
    assert "vision-language model (Qwen2_5_VLForConditionalGeneration)" in capsys.readouterr().out
    info = fsdp_checkpoint(family="qwen3_moe")
    assert main(["merge", info["checkpoint_dir"], "--out", str(tmp_path / "m"), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "45 tensors" in plan or "writes     45" in plan, plan


def test_an_exported_vl_adapter_loads_in_peft_as_peft_saves_it(fsdp_checkpoint, tmp_path, capsys):
    """--export-adapter of a VL LoRA run: the base is written as save_pretrained writes it and the
    adapter with the names peft itself saves (the in-memory ones), so peft loads it onto that base;
    its merge equals peft's merge of the run's own adapter, and verification passes."""
    import transformers
    from peft import PeftModel

    from tui_merger.core.merge.engine import ADAPTER_DIR

    info = fsdp_checkpoint(family="qwen2_5_vl", lora=True)
    out = tmp_path / "merged"
    code = main(["merge", info["checkpoint_dir"], "--out", str(out), "--plain", "--export-adapter"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    exported = out / ADAPTER_DIR
    assert any(".language_model." in k for k in read_output(exported))
    base = read_output(Path(info["reference_base"]))
    written = read_output(out)
    assert sorted(written) == sorted(base) and all(torch.equal(written[k], base[k]) for k in base)
    cls = getattr(transformers, info["architecture"])

    def merged_with(adapter, where):
        model = cls.from_pretrained(out, dtype=torch.float32)
        PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(where)
        return read_output(where)

    got, expected = merged_with(exported, tmp_path / "ours"), merged_with(info["reference_adapter"], tmp_path / "theirs")
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
