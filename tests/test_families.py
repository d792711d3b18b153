"""Qwen3.5 and Qwen3.5-MoE (linear-attention and full-attention layers; experts with a shared one) and GPT-OSS (experts kept packed and stored
[experts, in, out], attention sinks): a peft LoRA merges into what ``save_pretrained`` of peft's
``merge_and_unload`` writes, and verification runs each model class."""

from __future__ import annotations


import pytest
import torch
import transformers
from factory import read_output, verification_checks

from tui_merger.cli import main


def qwen3_5():
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=320, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, full_attention_interval=2)


def qwen3_5_moe():
    return transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)


def gpt_oss():
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=320, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"])


CASES = {
    "qwen3_5-all-linear": (qwen3_5, dict(target_modules="all-linear")),
    "qwen3_5_moe-all-linear+experts": (qwen3_5_moe, dict(target_modules="all-linear", target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    "gpt_oss-attention+experts": (gpt_oss, dict(target_modules=["q_proj", "v_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_merges_like_peft(case, tmp_path, capsys):
    from peft import LoraConfig, PeftModel, get_peft_model

    build, lora = CASES[case]
    cls, config = build()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "base")
    model = cls.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora)).save_pretrained(tmp_path / "adapter")
    reference = cls.from_pretrained(tmp_path / "base", dtype=torch.float32)
    PeftModel.from_pretrained(reference, tmp_path / "adapter").merge_and_unload().save_pretrained(tmp_path / "peft")

    out = tmp_path / "merged"
    code = main(["merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected, base = read_output(out), read_output(tmp_path / "peft"), read_output(tmp_path / "base")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base[n])}
    if case.startswith("gpt_oss"):
        assert {n for n in changed if ".experts." in n} == {
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    else:
        assert any(".linear_attn." in n for n in changed) and any(".self_attn." in n for n in changed)
    if "moe" in case:
        assert any(".mlp.experts.3.down_proj.weight" in n for n in changed)  # each expert, on disk one by one
        assert any(".shared_expert." in n for n in changed)
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, checks
