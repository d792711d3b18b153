"""Outputs written in the base's own quantized format (--keep-quantization) beyond FP8 blocks:
compressed-tensors FP8 (per tensor, output channel or block) and FP8 blocks with power-of-two (ue8m0)
scales (DeepSeek-V3.1/V3.2); and --quantize fp8 on a model whose experts are packed in one tensor (GPT-OSS).

References, never the code under test: compressed-tensors' own calculate_qparams + quantize and
transformers' own Fp8Quantize on the same bf16 merged weight (bit for bit), transformers' dequantizing
load of the kept output against the unmerged adapter through peft (logits within e4m3's rounding), and the
bytes of the base for every tensor the adapter does not touch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from fp8_factory import FP8_CONFIG, FP8_MAX, _rewrite, make_compressed_fp8_base
from safetensors.torch import load_file, save_file
from test_released_quantized import QWEN3, _dequantized_load, _disk_state, _logits_gap, _qv_adapter

from tui_merger.cli import main
from tui_merger.core.formats.dequant import DequantSource, scheme_of
from tui_merger.core.io.sources import open_model
from tui_merger.core.verify.checks import verify_merge


def _merge_plain_and_kept(base, adapter, tmp_path, capsys):
    """(dry-run text, bf16 output, kept output, what the kept merge printed)."""
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    args = ["merge", "--base", str(base), "--adapter", str(adapter)]
    assert main([*args, "--out", str(kept), "--keep-quantization", "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert main([*args, "--out", str(plain), "--plain", "--no-verify"]) == 0
    code = main([*args, "--out", str(kept), "--plain", "--keep-quantization"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    return plan, plain, kept, said.out


def _untouched_are_byte_identical(stored, got, changed):
    assert sorted(got) == sorted(stored)
    for name, value in stored.items():
        if name in changed:
            continue
        assert got[name].dtype == value.dtype and torch.equal(got[name].reshape(-1).view(torch.uint8),
                                                              value.reshape(-1).view(torch.uint8)), name


def _recompute_catches_a_flipped_byte(kept, name, tmp_path):
    """A copy of the kept output with one byte of a re-quantized weight changed fails the recompute check."""
    bad = tmp_path / "bad"
    shutil.copytree(kept, bad)
    manifest = json.loads((bad / "merge_manifest.json").read_text())
    manifest["options"]["out"] = str(bad)
    (bad / "merge_manifest.json").write_text(json.dumps(manifest))
    for path in bad.glob("*.safetensors"):
        tensors = load_file(path)
        if name in tensors:
            raw = tensors[name].view(torch.uint8).clone()
            raw.view(-1)[5] ^= 0x01  # one mantissa bit of one value
            tensors[name] = raw.view(torch.float8_e4m3fn)
            save_file(tensors, path, metadata={"format": "pt"})
    report = verify_merge(bad, behaviour=False)
    return {c.name: c.status for c in report.checks}


def _answers_verified_and_caught(kept, base, adapter, said, flip, tmp_path, kind="fp8"):
    """A kept FP8 output (``kind``: fp8 or compressed-tensors): transformers' dequantizing load gives the
    unmerged adapter's logits within e4m3's rounding (3 mantissa bits), verification passes, and one
    flipped bit of the re-quantized weight ``flip`` fails it."""
    gap, scale = _logits_gap(kept, base, adapter, kind, kind)
    assert gap < 0.1 * scale, (gap, scale)
    assert verification_checks(kept) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said
    broken = _recompute_catches_a_flipped_byte(kept, flip, tmp_path)
    assert broken["recompute"] == "fail", broken


# -- compressed-tensors FP8 --------------------------------------------------------------------------------


def _ct_reference(w, strategy):
    """compressed-tensors' own quantization of one weight: the min and max an observer takes, its
    calculate_qparams and quantize."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                            block_structure=[128, 128] if strategy == "block" else None)
    if strategy == "tensor":
        low, high = torch.aminmax(w)
    elif strategy == "channel":
        low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        tiles = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
        low, high = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    scale, zero = calculate_qparams(low, high, args)
    return quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn), scale


def _ct_base(root, strategy):
    """A compressed-tensors FP8 Qwen3 (llm-compressor's layout) with one scale per output channel, per
    tensor or per 128x128 block; the channel one is static (an input_scale per Linear) and ignores one
    k_proj (stored 16-bit, no scales), as a recipe's ignore list leaves a module."""
    base = root / f"Qwen3-tiny-FP8-{strategy}"
    torch.manual_seed(0)
    make_compressed_fp8_base(base, transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)), strategy)
    if strategy == "channel":
        path = base / "model.safetensors"
        tensors = load_file(path)
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            tensors[name[: -len("weight_scale")] + "input_scale"] = torch.tensor([0.0625], dtype=torch.bfloat16)
        ignored = "model.layers.1.self_attn.k_proj."
        tensors[ignored + "weight"] = tensors[ignored + "weight"].to(torch.bfloat16) * tensors.pop(ignored + "weight_scale")
        del tensors[ignored + "input_scale"]
        save_file(tensors, path, metadata={"format": "pt"})
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        config["quantization_config"]["ignore"] = ["lm_head", "model.layers.1.self_attn.k_proj"]
        (base / "config.json").write_text(json.dumps(config, indent=2))
    return base


@pytest.fixture(scope="module", params=["channel", "tensor", "block"])
def ct_base(request, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    return request.param, _ct_base(tmp_path_factory.mktemp(f"ct_{request.param}"), request.param)


def test_keep_quantization_writes_compressed_tensors_fp8_again(ct_base, tmp_path, capsys):
    strategy, base = ct_base
    adapter = _qv_adapter(base, tmp_path / "qv", "compressed-tensors")
    plan, plain, kept, said = _merge_plain_and_kept(base, adapter, tmp_path, capsys)
    how = {"channel": "one scale per output channel", "tensor": "one scale per tensor", "block": "128x128 blocks"}[strategy]
    assert (f"output is  compressed-tensors FP8 (e4m3), {how} as the base: 10 weights copied with their scales, "
            "4 changed by the adapter quantized again; quantization_config kept").replace(
                "10 weights", "9 weights" if strategy == "channel" else "10 weights") in plan, plan
    base_config = json.loads((base / "config.json").read_text())
    assert json.loads((kept / "config.json").read_text())["quantization_config"] == base_config["quantization_config"]
    stored, got, bf16 = read_output(base), read_output(kept), read_output(plain)
    changed = {n for n in stored if (".q_proj." in n or ".v_proj." in n) and n.endswith((".weight", ".weight_scale"))}
    _untouched_are_byte_identical(stored, got, changed)  # input_scale, the ignored lm_head: as stored
    if strategy == "channel":
        assert any(n.endswith(".input_scale") for n in got)
    for name in (n for n in changed if n.endswith(".weight")):
        q, scale = _ct_reference(bf16[name], strategy)  # the bf16 merge, quantized by compressed-tensors
        scale_name = name[: -len("weight")] + "weight_scale"
        assert got[name].dtype == torch.float8_e4m3fn
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert got[scale_name].dtype == stored[scale_name].dtype == scale.dtype
        assert got[scale_name].shape == stored[scale_name].shape
        assert torch.equal(got[scale_name].reshape(scale.shape), scale), name
    _answers_verified_and_caught(kept, base, adapter, said, "model.layers.0.self_attn.q_proj.weight", tmp_path,
                                 "compressed-tensors")


def test_an_ignored_module_changed_by_the_adapter_stays_16bit(tmp_path, capsys):
    """A module the config ignores (stored 16-bit) that the adapter changes is written merged in 16 bits,
    as the base has it; the config keeps ignoring it."""
    pytest.importorskip("compressed_tensors")
    base = _ct_base(tmp_path, "channel")
    from peft import LoraConfig, get_peft_model

    model = _dequantized_load(base, "compressed-tensors")
    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(tmp_path / "k")
    _, plain, kept, said = _merge_plain_and_kept(base, tmp_path / "k", tmp_path, capsys)
    name = "model.layers.1.self_attn.k_proj.weight"
    stored, got, bf16 = read_output(base), read_output(kept), read_output(plain)
    assert stored[name].dtype == torch.bfloat16 and name[: -len("weight")] + "weight_scale" not in got
    assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], bf16[name])
    assert json.loads((kept / "config.json").read_text())["quantization_config"]["ignore"] == [
        "lm_head", "model.layers.1.self_attn.k_proj"]
    assert verification_checks(kept) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said


# -- FP8 blocks with power-of-two scales (ue8m0: DeepSeek-V3.1/V3.2) ------------------------------------


def fp8_pow2_blocks(w, block=(128, 128)):
    """DeepSeek's ue8m0 recipe for one weight, block by block in plain loops: the scale is absmax / 448
    rounded up to a power of two (2 ** ceil(log2(.))), so nothing clips; stored in fp32."""
    w = w.float()
    rows, cols = w.shape
    grid = torch.empty(-(-rows // block[0]), -(-cols // block[1]), dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            part = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            scale = 2.0 ** torch.ceil(torch.log2(part.abs().max() / FP8_MAX))
            grid[i, j] = scale
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (
                (part / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    return q, grid


@pytest.fixture(scope="module")
def qwen3_ue8m0(tmp_path_factory):
    base = tmp_path_factory.mktemp("ue8m0") / "Qwen3-tiny-FP8-ue8m0"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(base)
    _rewrite(base, fp8_pow2_blocks, {**FP8_CONFIG, "scale_fmt": "ue8m0", "_scale": "weight_scale_inv"})
    return base


def test_an_unknown_scale_format_is_refused():
    from tui_merger.core.errors import MergeError

    with pytest.raises(MergeError, match=r"scale_fmt 'e5m2'; FP8 checkpoints store their scales as float \(fp32\) or ue8m0"):
        scheme_of({"quantization_config": {**FP8_CONFIG, "scale_fmt": "e5m2"}})
    assert scheme_of({"quantization_config": {**FP8_CONFIG, "scale_fmt": "ue8m0"}}).scale_fmt == "ue8m0"
    assert scheme_of({"quantization_config": FP8_CONFIG}).scale_fmt == "float"


def _is_pow2(t):
    mantissa, _ = torch.frexp(t.float())
    return bool((mantissa.abs() == 0.5).all())


def test_keep_quantization_keeps_power_of_two_scales(qwen3_ue8m0, tmp_path, capsys):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    base = qwen3_ue8m0
    stored = read_output(base)
    assert _is_pow2(stored["model.layers.0.mlp.up_proj.weight_scale_inv"])  # as the releases are
    config = json.loads((base / "config.json").read_text())
    source = DequantSource(open_model(base), scheme_of(config), config)  # read as any FP8-block base
    expected = _disk_state(_dequantized_load(base, "fp8"))
    assert len(source.dequantized) == 14
    for name in source.dequantized:
        assert torch.equal(source.tensors[name].load(), expected[name]), name
    adapter = _qv_adapter(base, tmp_path / "qv", "fp8")
    plan, plain, kept, said = _merge_plain_and_kept(base, adapter, tmp_path, capsys)
    assert ("output is  FP8 (e4m3), 128x128 blocks, power-of-two (ue8m0) scales as the base: 10 weights copied "
            "with their scales, 4 changed by the adapter quantized again; quantization_config kept") in plan, plan
    assert "base is    FP8 (e4m3), 128x128 blocks, power-of-two (ue8m0) scales, as released" in plan, plan
    assert json.loads((kept / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    got, bf16 = read_output(kept), read_output(plain)
    changed = {n for n in stored if ".q_proj." in n or ".v_proj." in n}
    _untouched_are_byte_identical(stored, got, changed)

    class Quantizer:  # transformers' own quantizer for ue8m0 (it stores the scales as float8_e8m0fnu)
        quantization_config = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0")

    for name in (n for n in changed if n.endswith(".weight")):
        out = Fp8Quantize(Quantizer())._quantize_one(name, bf16[name])
        inv = got[name[: -len("weight")] + "weight_scale_inv"]
        assert inv.dtype == torch.float32 and _is_pow2(inv), name
        assert torch.equal(inv, out[name[: -len("weight")] + "weight_scale_inv"].float()), name
        assert torch.equal(got[name].view(torch.uint8), out[name].view(torch.uint8)), name
    _answers_verified_and_caught(kept, base, adapter, said, "model.layers.1.self_attn.v_proj.weight", tmp_path)


def test_keep_quantization_on_fp8_with_one_scale_per_tensor(tmp_path, capsys):
    """quant_method fp8 without weight_block_size (one weight_scale_inv per tensor, stored as a scalar):
    changed weights are quantized again as transformers' Fp8Quantize does without a block size (the
    whole weight one block) and the scale keeps its stored shape; the rest is copied byte for byte."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    base = tmp_path / "Qwen3-tiny-FP8-tensor"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(base)

    def per_tensor(w):
        scale = w.float().abs().max() / FP8_MAX
        return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())

    entry = {k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"}
    _rewrite(base, per_tensor, {**entry, "weight_block_size": None, "_scale": "weight_scale_inv"})
    adapter = _qv_adapter(base, tmp_path / "qv", "fp8")
    plan, plain, kept, said = _merge_plain_and_kept(base, adapter, tmp_path, capsys)
    assert "4 changed by the adapter quantized again; quantization_config kept" in plan, plan
    stored, got, bf16 = read_output(base), read_output(kept), read_output(plain)
    changed = {n for n in stored if ".q_proj." in n or ".v_proj." in n}
    _untouched_are_byte_identical(stored, got, changed)

    class Quantizer:  # transformers' own quantizer with no block size
        quantization_config = transformers.FineGrainedFP8Config(weight_block_size=None)

    for name in (n for n in changed if n.endswith(".weight")):
        out = Fp8Quantize(Quantizer())._quantize_one(name, bf16[name])
        scale_name = name[: -len("weight")] + "weight_scale_inv"
        assert got[scale_name].shape == stored[scale_name].shape == torch.Size([]), scale_name
        assert torch.equal(got[scale_name], out[scale_name].reshape(())), name
        assert torch.equal(got[name].view(torch.uint8), out[name].view(torch.uint8)), name
    _answers_verified_and_caught(kept, base, adapter, said, "model.layers.1.self_attn.q_proj.weight", tmp_path)


# -- --quantize fp8 with packed experts (GPT-OSS) --------------------------------------------------------

GPT_OSS_128 = dict(hidden_size=128, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=320,
                   max_position_embeddings=64, sliding_window=16,
                   rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def test_quantize_fp8_leaves_packed_experts_16bit_and_says_so(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    torch.manual_seed(0)
    base = tmp_path / "gpt-oss-tiny"
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**GPT_OSS_128)).to(torch.bfloat16).save_pretrained(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(tmp_path / "adapter")
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    args = ["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter")]
    assert main([*args, "--out", str(fp8), "--dry-run", "--quantize", "fp8"]) == 0
    plan = capsys.readouterr().out
    assert ("output is  FP8 (e4m3), 128x128 blocks, weight-only: 8 Linear weights transformers' FP8 load quantizes; "
            "what it leaves alone (input_layernorm, lm_head, norm, post_attention_layernorm), embeddings and norms "
            "stay bfloat16; the 4 packed expert tensors "
            "(model.layers.0.mlp.experts.down_proj, ...) stay bfloat16 too, named in modules_to_not_convert") in plan, plan
    assert main([*args, "--out", str(plain), "--plain", "--no-verify"]) == 0
    code = main([*args, "--out", str(fp8), "--plain", "--quantize", "fp8"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    # transformers' own defaults for GPT-OSS (get_keys_to_not_convert, _keep_in_fp32_modules), then the experts
    skip = ["input_layernorm", "lm_head", "norm", "post_attention_layernorm", "model.layers.0.mlp.experts",
            "model.layers.1.mlp.experts"]
    assert config["modules_to_not_convert"] == skip
    got, bf16 = read_output(fp8), read_output(plain)
    experts = [n for n in bf16 if ".mlp.experts." in n]
    assert len(experts) == 8  # gate_up_proj, down_proj and their biases, two layers
    for name in experts:
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], bf16[name]), name
    assert sum(1 for n in got if n.endswith("weight_scale_inv")) == 8
    gap, scale = _logits_gap(fp8, base, tmp_path / "adapter", None, "fp8")
    assert gap < 0.1 * scale, (gap, scale)
    assert verification_checks(fp8) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
    # transformers' FP8 load (not dequantizing) replaces the modules it converts: GPT-OSS's experts, which
    # have biases, it cannot take, so they must be named; named, they stay as they are
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(fp8))
    with pytest.raises(AssertionError):
        replace_with_fp8_linear(model, ["lm_head"], transformers.FineGrainedFP8Config(weight_block_size=[128, 128]))
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.AutoConfig.from_pretrained(fp8))
    replace_with_fp8_linear(model, skip, transformers.FineGrainedFP8Config(weight_block_size=[128, 128]))
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "FP8Linear"


def test_quantize_fp8_writes_experts_stored_one_matrix_each_and_transformers_packs_them(tmp_path, capsys):
    """Qwen3-MoE in transformers 5 holds its experts packed but saves them one matrix per expert and
    projection: those are Linear weights, written as FP8 blocks each; transformers' FP8 load packs them
    (with their scales, into FP8Experts' gate_up_proj_scale_inv / down_proj_scale_inv)."""
    from peft import LoraConfig, get_peft_model
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    config = transformers.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                                         num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, vocab_size=320,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    base = tmp_path / "Qwen3-MoE-tiny"
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(tmp_path / "adapter")
    fp8 = tmp_path / "fp8"
    code = main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(fp8), "--plain",
                 "--quantize", "fp8"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert "packed expert" not in said.out
    got = read_output(fp8)
    experts = [n for n in got if ".mlp.experts." in n and n.endswith("_proj.weight")]
    assert len(experts) == 2 * 4 * 3
    for name in experts:
        assert got[name].dtype == torch.float8_e4m3fn and got[name[: -len("weight")] + "weight_scale_inv"].shape == (1, 1)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"]["modules_to_not_convert"] == ["lm_head"]
    # transformers reads every expert back as written, bit for bit. (The dense tests' rough end-to-end limit,
    # a tenth of the largest logit, does not hold here: with 24 more random matrices rounded to e4m3 the
    # logits move by 0.17 of 0.84, no token routed elsewhere; the behaviour check's limit counts them)
    out_config = json.loads((fp8 / "config.json").read_text())
    source = DequantSource(open_model(fp8), scheme_of(out_config), out_config)
    loaded = _disk_state(_dequantized_load(fp8, "fp8"))
    assert len(source.dequantized) == 2 * 4 + len(experts)
    for name in source.dequantized:
        assert torch.equal(source.tensors[name].load(), loaded[name]), name
    assert verification_checks(fp8) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(fp8))
    replace_with_fp8_linear(model, ["lm_head"], transformers.FineGrainedFP8Config(weight_block_size=[128, 128]))
    experts_module = model.model.layers[0].mlp.experts
    assert experts_module.gate_up_proj.dtype == torch.float8_e4m3fn
    assert tuple(experts_module.gate_up_proj_scale_inv.shape) == (4, 2, 1)
