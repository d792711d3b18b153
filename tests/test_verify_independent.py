"""Names asked of transformers, and checks that do not share code with what they check (issue 41, items 1
and 3).

- ``--quantize fp8`` quantizes what transformers' own FP8 load quantizes (its ``replace_with_fp8_linear``
  and ``get_keys_to_not_convert``), whatever the family names its layers: BLOOM keeps them under
  ``transformer.h.N`` (we looked for ``.layers.N.`` and refused: "found no Linear weight").
- The recompute of an output quantized again (``--keep-quantization``, ``--quantize fp8``) quantizes with
  other code than the merge's (``verify/requant_ref.py``): a bug put into the merge's quantizer is caught
  (before, both sides called the same quantizer and verification PASSED).

References, never the code under test: transformers' dequantizing FP8 load against the unmerged adapter
through peft, transformers' own Fp8Quantize on the bf16 merge, the safetensors library's reading."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from test_keep_mxfp4 import _expert_adapter
from test_released_quantized import (_fp8_quantize, _logits_gap, _qv_adapter, deepseek_ue8m0,  # noqa: F401 - fixtures
                                     gpt_oss_mxfp4, qwen3_ct, qwen3_fp8)

from tui_merger.cli import main


def _bloom(root):
    """A tiny BLOOM (tied embeddings, layers under ``transformer.h.N``) whose attention and MLP matrices
    are whole 128x128 blocks, and a LoRA made by peft on it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=128, n_layer=2, n_head=2, vocab_size=320, bos_token_id=1,
                                      eos_token_id=2)
    base = root / "bloom-tiny"
    transformers.BloomForCausalLM(config).to(torch.bfloat16).save_pretrained(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "dense_4h_to_h"], init_lora_weights=False)
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(root / "adapter")
    return base, root / "adapter"


def test_quantize_fp8_asks_transformers_which_weights_on_a_family_without_model_layers(tmp_path, capsys):
    base, adapter = _bloom(tmp_path)
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    args = ["merge", "--base", str(base), "--adapter", str(adapter)]
    assert main([*args, "--out", str(plain), "--plain", "--no-verify"]) == 0
    code = main([*args, "--out", str(fp8), "--plain", "--quantize", "fp8"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    # transformers' own defaults for this model: the output embedding and the tied input embedding
    assert config["modules_to_not_convert"] == ["lm_head", "transformer.word_embeddings"]
    got, bf16 = read_output(fp8), read_output(plain)
    linears = [n for n in bf16 if n.startswith("transformer.h.") and n.endswith(("query_key_value.weight", "dense.weight",
                                                                                  "dense_h_to_4h.weight", "dense_4h_to_h.weight"))]
    assert len(linears) == 8
    for name in linears:  # the bf16 merge quantized by transformers' own Fp8Quantize, bit for bit
        q, inv = _fp8_quantize(bf16[name])
        assert got[name].dtype == torch.float8_e4m3fn and torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(got[name[: -len("weight")] + "weight_scale_inv"], inv), name
    assert got["transformer.word_embeddings.weight"].dtype == torch.bfloat16
    gap, scale = _logits_gap(fp8, base, adapter, None, "fp8")
    assert gap < 0.1 * scale, (gap, scale)
    assert verification_checks(fp8) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out


# -- a bug in the merge's quantizer is caught by the recompute ---------------------------------------------


def _one_bit_off(quantize):
    """``quantize`` with one mantissa bit of its first value flipped: a wrong quantization too small for the
    behaviour check (within the format's rounding), which only an independent recompute sees."""

    def buggy(*args, **kwargs):
        q, scale = quantize(*args, **kwargs)
        q = q.clone()
        q.view(torch.uint8).view(-1)[0] ^= 0x01
        return q, scale

    return buggy


def _merge_kept(base, adapter, out, capsys, *flags):
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain",
                 "--keep-quantization", *flags])
    said = capsys.readouterr()
    return code, said.out + said.err


@pytest.mark.parametrize("fixture,kind,where", [
    ("qwen3_fp8", "fp8", "tui_merger.core.formats.dequant.quantize_fp8_blocks"),
    ("deepseek_ue8m0", "fp8-ue8m0", "tui_merger.core.formats.dequant.quantize_fp8_blocks"),
    ("qwen3_ct", "compressed-tensors", "tui_merger.core.formats.dequant.quantize_compressed_fp8"),
])
def test_a_bug_in_the_merges_fp8_quantizer_fails_verification(fixture, kind, where, request, tmp_path, capsys,
                                                               monkeypatch):
    base, adapter = request.getfixturevalue(fixture)
    if fixture != "deepseek_ue8m0":  # its own adapter (all-linear) changes kv_a_proj_with_mqa: a short last block
        adapter = _qv_adapter(base, tmp_path / "qv", kind)
    code, said = _merge_kept(base, adapter, tmp_path / "good", capsys)
    assert code == 0 and verification_checks(tmp_path / "good")["recompute"] == "pass", said
    module, name = where.rsplit(".", 1)
    monkeypatch.setattr(module + "." + name, _one_bit_off(getattr(__import__(module, fromlist=[name]), name)))
    code, said = _merge_kept(base, adapter, tmp_path / "bad", capsys)
    assert code == 4, said
    assert verification_checks(tmp_path / "bad")["recompute"] == "fail", said
    assert "differs from the merged weight quantized again by the format's own rules (1 of " in said, said


def test_a_bug_in_the_merges_mxfp4_quantizer_fails_verification(gpt_oss_mxfp4, tmp_path, capsys, monkeypatch):
    import tui_merger.core.merge.requant_mxfp4 as requant_mxfp4

    base, _ = gpt_oss_mxfp4
    adapter = _expert_adapter(base, tmp_path / "adapter")
    monkeypatch.setattr(requant_mxfp4, "quantize_mxfp4", _one_bit_off(requant_mxfp4.quantize_mxfp4))
    code, said = _merge_kept(base, adapter, tmp_path / "bad", capsys)
    assert code == 4, said
    assert verification_checks(tmp_path / "bad")["recompute"] == "fail", said
    assert "_blocks: differs from the merged weight quantized again by the format's own rules" in said, said


# -- a plan error is caught: what must change is derived by peft, not by the merge's plan ------------------


def _qwen3_lora(root, **lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, vocab_size=320, max_position_embeddings=64)
    base = root / "qwen3-tiny"
    transformers.Qwen3ForCausalLM(config).save_pretrained(base)
    torch.manual_seed(1)
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                   LoraConfig(init_lora_weights=False, **lora)).save_pretrained(root / "adapter")
    return base, root / "adapter"


@pytest.mark.parametrize("bug", ["dropped", "scale"])
def test_a_plan_bug_fails_verification_by_peft_s_own_target_matching(bug, tmp_path, capsys, monkeypatch):
    """A target dropped from the plan, or a wrong scale (rsLoRA's alpha/sqrt(r) taken as alpha/r), put into the
    merge's plan: the recompute shares the plan, so it agrees with the wrong merge (PASS); peft's own wrapping
    of the meta model does not, and the structure check fails naming the weight."""
    import dataclasses

    import tui_merger.core.merge.requant as requant
    import tui_merger.core.plan.plan as plan_module

    base, adapter = _qwen3_lora(tmp_path, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "down_proj"],
                                exclude_modules=["model.layers.1.mlp.down_proj"])
    good = tmp_path / "good"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(good), "--plain"]) == 0
    assert verification_checks(good) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    original = plan_module.build_plan

    def buggy(*args, **kwargs):
        plan = original(*args, **kwargs)
        for t in plan.tensors:
            if t.name == "model.layers.0.mlp.down_proj.weight":
                t.ops[:] = [] if bug == "dropped" else [dataclasses.replace(t.ops[0], scale=8 / 4)]
        return plan

    monkeypatch.setattr(plan_module, "build_plan", buggy)
    monkeypatch.setattr(requant, "build_plan", buggy)
    bad = tmp_path / "bad"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(bad), "--plain"])
    said = capsys.readouterr().out
    assert code == 4, said
    checks = verification_checks(bad)
    assert checks["recompute"] == "pass" and checks["structure"] == "fail", said  # the recompute repeats the plan
    if bug == "dropped":
        assert "model.layers.0.mlp.down_proj.weight: peft applies the adapter's LoRA here (scale 4) but the merge left " \
               "it unchanged" in said, said
    else:
        assert "model.layers.0.mlp.down_proj.weight: merged with scale 2, but peft's scale for it is 4" in said, said


# -- kohya: the tied output head is named as transformers names it ------------------------------------------


def test_a_kohya_lora_on_a_tied_head_finds_it_under_the_family_s_own_name(tmp_path):
    """A DeepSeek-V4 with tied embeddings writes no output head; its head is ``head`` (transformers' rules),
    not ``lm_head``: a kohya LoRA on it matched no module before ("match no module of the base")."""
    from safetensors.torch import save_file
    from test_families import deepseek_v4

    from tui_merger.core.formats.kohya import module_names, open_kohya
    from tui_merger.core.io.sources import open_model

    cls, config = deepseek_v4()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "base")
    base = open_model(tmp_path / "base")
    saved = json.loads((tmp_path / "base" / "config.json").read_text())
    try:
        assert "head.weight" not in base.tensors and "lm_head.weight" not in base.tensors
        modules = module_names(base.tensors, saved)
        assert "head" in modules and "lm_head" not in modules
        save_file({"lora_unet_head.lora_down.weight": torch.randn(4, 64), "lora_unet_head.lora_up.weight": torch.randn(320, 4),
                   "lora_unet_head.alpha": torch.tensor(8.0)}, str(tmp_path / "kohya.safetensors"))
        adapter = open_kohya(tmp_path / "kohya.safetensors", base.tensors, saved)
        assert list(adapter.lora) == ["head"], list(adapter.lora)
        adapter.close()
    finally:
        base.close()


def test_a_resized_embedding_saved_by_the_adapter_is_found_under_the_family_s_own_name(tmp_path):
    """Mamba's input embedding is ``backbone.embeddings``, none of the usual names: the adapter's saved,
    resized embedding (modules_to_save) was not found, so Review did not say the vocabulary differs."""
    from safetensors.torch import save_file

    from tui_merger.core.plan.choices import _saved_embedding_rows

    config = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=320, state_size=8).to_dict()
    config["architectures"] = ["MambaForCausalLM"]
    save_file({"base_model.model.backbone.embeddings.weight": torch.zeros(330, 64),
               "base_model.model.backbone.layers.0.mixer.in_proj.lora_A.weight": torch.zeros(4, 64)},
              str(tmp_path / "adapter_model.safetensors"))
    assert _saved_embedding_rows(tmp_path, config) == 330


def test_a_weighted_merge_whose_plan_drops_an_adapter_s_weight_fails_verification(tmp_path, capsys, monkeypatch):
    """Two adapters at weights 0.5 and 0.25: the target check expects peft's scale times each weight on each
    weight it reaches (a correct merge PASSES); a plan that forgets one adapter's weight fails structure."""
    import dataclasses

    import tui_merger.core.merge.requant as requant
    import tui_merger.core.plan.plan as plan_module

    base, first = _qwen3_lora(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    from factory import save_adapter

    second = save_adapter(tmp_path / "second", base, seed=3, target_modules=["q_proj"], r=2, lora_alpha=2)
    args = ["merge", "--base", str(base), "--adapter", f"{first}:0.5", "--adapter", f"{second}:0.25", "--plain"]
    good = tmp_path / "good"
    assert main([*args, "--out", str(good)]) == 0, capsys.readouterr().out
    assert verification_checks(good) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    original = plan_module.build_plan

    def buggy(*a, **k):
        plan = original(*a, **k)
        for t in plan.tensors:
            if t.name == "model.layers.0.mlp.down_proj.weight":
                t.ops[:] = [dataclasses.replace(t.ops[0], scale=t.ops[0].scale * 2)]  # weight 0.5 forgotten
        return plan

    monkeypatch.setattr(plan_module, "build_plan", buggy)
    monkeypatch.setattr(requant, "build_plan", buggy)
    bad = tmp_path / "bad"
    code = main([*args, "--out", str(bad)])
    said = capsys.readouterr().out
    assert code == 4, said
    checks = verification_checks(bad)
    assert checks["recompute"] == "pass" and checks["structure"] == "fail", said
    assert "model.layers.0.mlp.down_proj.weight: merged with LoRA scale(s) 2, but peft's scales at the adapters' " \
           "weights are 1" in said, said
