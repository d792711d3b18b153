"""Bases released quantized (FP8 blocks as DeepSeek-V3 and Qwen3-FP8 ship them, compressed-tensors FP8):
the dequantized weights equal transformers' own dequantizing load bit for bit; an adapter made by peft
on that load merges as peft merges it there; the output is a plain bf16 model that transformers loads
without a quantization config and that gives the unmerged adapter's logits; bad checkpoints are refused
with one sentence and nothing is written."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from fp8_factory import (fp8_blocks, make_compressed_fp8_base, make_fp8_block_base, make_fp8_ue8m0_base,
                         make_mxfp4_base)
from safetensors.torch import load_file, save_file

from tui_merger.cli import main
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.dequant import DequantSource, Scheme, dequantize, scheme_of
from tui_merger.core.io.sources import open_model
from tui_merger.core.verify.checks import verify_merge

QWEN3 = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, vocab_size=320, max_position_embeddings=64)
# kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim = 96 rows and kv_b_proj 32 columns: one short
# block each, as DeepSeek-V3's 576-row kv_a_proj_with_mqa ends in one. Every other dimension is a whole
# number of blocks: for more than one short-ended block transformers 5.24's loader is no reference (see
# test_short_last_blocks_follow_the_block_grid)
DEEPSEEK_V3 = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
                   first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                   num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=128,
                   kv_lora_rank=32, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, vocab_size=320,
                   max_position_embeddings=64)
PROBE = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(7))


def _quantization_config(kind):
    """transformers' dequantizing config for the format ``kind``."""
    if kind == "compressed-tensors":
        return transformers.CompressedTensorsConfig(dequantize=True)
    if kind == "mxfp4":
        return transformers.Mxfp4Config(dequantize=True)
    if kind == "fp8-ue8m0":
        return transformers.FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0")
    return transformers.FineGrainedFP8Config(dequantize=True)


def _dequantized_load(folder, kind):
    """transformers' own dequantizing load (the reference for every dequantized value)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=_quantization_config(kind))
    return model.eval()


def _build(root, name, cls, config, make, kind, targets="all-linear"):
    """A base released quantized, and a LoRA made by peft on transformers' dequantized load of it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = root / name
    make(base, cls(config))
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    get_peft_model(_dequantized_load(base, kind), lora).save_pretrained(root / f"{name}-adapter")
    return base, root / f"{name}-adapter"


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_fp8")
    return _build(root, "Qwen3-tiny-FP8", transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3),
                  make_fp8_block_base, "fp8")


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_fp8")
    return _build(root, "DeepSeek-V3-tiny", transformers.DeepseekV3ForCausalLM,
                  transformers.DeepseekV3Config(**DEEPSEEK_V3), make_fp8_block_base, "fp8")


@pytest.fixture(scope="module")
def qwen3_ct(tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("qwen3_ct")
    return _build(root, "Qwen3-tiny-FP8-Dynamic", transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3),
                  make_compressed_fp8_base, "compressed-tensors")


GPT_OSS = dict(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320, max_position_embeddings=64,
               sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """GPT-OSS as released: experts in MXFP4, attention bf16; the LoRA on the attention projections (LoRA
    on the experts, peft's target_parameters, goes with the MoE adapters' issue)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    return _build(root, "gpt-oss-tiny", transformers.GptOssForCausalLM, transformers.GptOssConfig(**GPT_OSS),
                  make_mxfp4_base, "mxfp4", ["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def qwen3_ue8m0(tmp_path_factory):
    """Qwen3 FP8 blocks with power-of-two scales stored as float8_e8m0fnu (DeepSeek-V3.1/V3.2's scale_fmt ue8m0)."""
    root = tmp_path_factory.mktemp("qwen3_ue8m0")
    return _build(root, "Qwen3-tiny-FP8-ue8m0", transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3),
                  make_fp8_ue8m0_base, "fp8-ue8m0")


@pytest.fixture(scope="module")
def deepseek_ue8m0(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_ue8m0")
    return _build(root, "DeepSeek-V3.1-tiny", transformers.DeepseekV3ForCausalLM,
                  transformers.DeepseekV3Config(**DEEPSEEK_V3), make_fp8_ue8m0_base, "fp8-ue8m0")


CASES = {"qwen3-fp8": ("qwen3_fp8", "fp8"), "deepseek_v3-fp8": ("deepseek_fp8", "fp8"),
         "qwen3-fp8-ue8m0": ("qwen3_ue8m0", "fp8-ue8m0"), "deepseek_v3-fp8-ue8m0": ("deepseek_ue8m0", "fp8-ue8m0"),
         "qwen3-compressed-tensors": ("qwen3_ct", "compressed-tensors"), "gpt_oss-mxfp4": ("gpt_oss_mxfp4", "mxfp4")}


def _case(request, case):
    fixture, kind = CASES[case]
    base, adapter = request.getfixturevalue(fixture)
    return base, adapter, kind


def _disk_state(model) -> dict:
    """A loaded model's weights under the names save_pretrained writes (per-expert tensors on disk)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return read_output(Path(tmp))


@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_weights_equal_transformers_load_bit_for_bit(case, request):
    base, _, kind = _case(request, case)
    config = json.loads((base / "config.json").read_text())
    source = DequantSource(open_model(base), scheme_of(config), config)
    expected = _disk_state(_dequantized_load(base, kind))
    assert source.dequantized and not any(n.endswith(("_scale_inv", "_scale", "_scales", "_blocks")) for n in source.tensors)
    for name in source.dequantized:
        got = source.tensors[name].load()
        want = expected[name]
        assert got.dtype == want.dtype == torch.bfloat16, name
        assert torch.equal(got, want), name
    if kind == "mxfp4":  # every expert tensor, [experts, in, out] as transformers keeps them
        assert sorted(source.dequantized) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                                    for p in ("gate_up_proj", "down_proj"))
    if kind == "fp8":  # MLA projections, the short block and the experts are among them
        names = set(source.dequantized)
        assert any("kv_a_proj_with_mqa" in n for n in names) == (case == "deepseek_v3-fp8")
        assert any(".experts.3." in n for n in names) == (case == "deepseek_v3-fp8")


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft_on_the_dequantized_load(case, request, tmp_path, capsys):
    from peft import PeftModel

    base, adapter, kind = _case(request, case)
    loaded = _dequantized_load(base, kind)
    base_state = _disk_state(loaded)
    # the unmerged adapter on the dequantized weights, run in fp32 (so that only the merge's one rounding
    # of W + delta to bf16 separates it from the merged model run the same way)
    peft_model = PeftModel.from_pretrained(_dequantized_load(base, kind).float(), adapter).eval()
    with torch.no_grad():
        unmerged = peft_model(PROBE).logits.float()
    # peft's merge in fp32 on the dequantized weights, rounded once to the model's dtype
    merged_ref = PeftModel.from_pretrained(_dequantized_load(base, kind).float(), adapter).merge_and_unload()
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() and v.dtype == torch.float32 else v
                for k, v in _disk_state(merged_ref).items()}
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert "config.json: quantization_config removed" in said.out
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    got = read_output(out)
    assert not any(v.dtype.is_floating_point and v.element_size() == 1 for v in got.values())
    assert not any(n.endswith(("weight_scale_inv", "weight_scale", "_scales", "_blocks")) for n in got)
    changed = []
    for name, want in expected.items():
        if name not in got:
            continue
        assert got[name].shape == want.shape, name
        if got[name].dtype == torch.bfloat16 and want.dtype == torch.bfloat16:
            # both add the fp32 delta to the same bf16 weights and round once: equal, or one step apart on a tie
            torch.testing.assert_close(got[name].float(), want.float(), rtol=2 ** -8, atol=0, msg=name)
            if not torch.equal(got[name], base_state[name]):
                changed.append(name)
    assert len(changed) >= 8
    if case == "deepseek_v3-fp8":  # peft's all-linear reaches the FP8 experts and the router (main's MoE work)
        assert len([n for n in changed if ".experts." in n]) == 12 and "model.layers.1.mlp.gate.weight" in changed
    # transformers loads the output plainly and it gives the unmerged adapter's logits
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(PROBE).logits
    scale = unmerged.abs().max().item()
    print(case, (logits - unmerged).abs().max().item() / scale)
    assert (logits - unmerged).abs().max().item() < 0.02 * scale
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["base_weights"]["weights"] == "dequantized as released"


def test_dry_run_names_the_base_format_and_the_output(qwen3_fp8, tmp_path, capsys):
    base, adapter = qwen3_fp8
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dry-run"])
    plan = capsys.readouterr().out
    assert code == 0, plan
    assert "base is    FP8 (e4m3), 128x128 blocks, as released (14 weights); merged into its dequantized weights" in plan
    assert "output is  bfloat16, a plain model (quantization_config removed)" in plan
    assert "FineGrainedFP8Config(dequantize=True)" in plan
    assert "not the model's real weights" not in plan
    assert not (tmp_path / "m").exists()


def test_inspect_names_the_format(qwen3_fp8, capsys):
    base, _ = qwen3_fp8
    assert main(["inspect", str(base)]) == 0
    said = capsys.readouterr().out
    assert "FP8 (e4m3), 128x128 blocks, as released" in said, said


# -- the arithmetic where transformers 5.24 cannot be the reference -----------------------------------


def test_short_last_blocks_follow_the_block_grid():
    """A weight of 192 rows has scale rows for rows 0-127 and 128-191 (the declared 128x128 blocks, as
    DeepSeek's own weight_dequant reads its 576-row kv_a_proj_with_mqa). transformers 5.24's loader
    derives the block from the grid instead (192 / 2 = 96 rows per scale: wrong values, silently) and
    refuses 576 rows (not a multiple of 5), so the reference is the definition itself, block by block."""
    torch.manual_seed(3)
    w = torch.randn(192, 200) * 0.02
    q, grid = fp8_blocks(w)
    assert grid.shape == (2, 2)
    got = dequantize(q, grid, Scheme("fp8", "weight_scale_inv", "float8_e4m3fn", (128, 128)), torch.bfloat16)
    want = torch.empty(192, 200, dtype=torch.bfloat16)
    for i in range(2):
        for j in range(2):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            want[rows, cols] = (q[rows, cols].float() * grid[i, j]).to(torch.bfloat16)
    assert torch.equal(got, want)


# -- bad input -----------------------------------------------------------------------------------------


def _broken_copy(base, tmp_path, edit):
    folder = tmp_path / "broken"
    shutil.copytree(base, folder)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("edit,needles", [
    (lambda t: t.pop(NAME[:-6] + "weight_scale_inv"),
     [NAME, "float8_e4m3fn", "no weight_scale_inv", "model.layers.0.mlp.down_proj.weight_scale_inv"]),
    (lambda t: t.update({NAME[:-6] + "weight_scale_inv": torch.ones(3, 3)}),
     ["model.layers.0.mlp.down_proj.weight_scale_inv has shape [3, 3]", "[256, 384] needs [2, 3]", "128x128 block"]),
    (lambda t: t.update({NAME: t[NAME].float().to(torch.float8_e5m2)}),
     [NAME, "float8_e5m2", "float8_e4m3fn"]),
    (lambda t: t.update({NAME[:-6] + "weight_scale_inv": t[NAME[:-6] + "weight_scale_inv"].to(torch.float8_e4m3fn)}),
     ["weight_scale_inv is stored in float8_e4m3fn", "float32, bfloat16, float16 or float8_e8m0fnu (ue8m0)"]),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight_scale_inv": torch.ones(1, 1)}),
     ["model.layers.0.mlp.extra.weight_scale_inv", "no weight model.layers.0.mlp.extra.weight"]),
], ids=["scale-missing", "scale-shape", "e5m2", "scale-dtype", "scale-alone"])
def test_bad_fp8_checkpoints_are_refused_with_one_sentence(qwen3_fp8, tmp_path, capsys, edit, needles):
    base, adapter = qwen3_fp8
    text = _refused(base, adapter, edit, tmp_path, capsys, needles)
    assert "Nothing was written" in text


def test_bad_block_size_in_the_config_is_refused():
    with pytest.raises(MergeError, match=r"weight_block_size \[128\]; expected two positive integers"):
        scheme_of({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})
    with pytest.raises(MergeError, match="fmt 'e5m2'"):
        scheme_of({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})


MX = "model.layers.0.mlp.experts.down_proj"


@pytest.mark.parametrize("edit,needles", [
    (lambda t: t.pop(MX + "_scales"), [MX + "_blocks holds MXFP4 values", "no " + MX + "_scales"]),
    (lambda t: t.update({MX + "_scales": t[MX + "_scales"][:, :, :1].contiguous()}),
     [MX + "_scales is uint8 [4, 64, 1]", "needs uint8 [4, 64, 2]"]),
], ids=["scales-missing", "scales-shape"])
def test_bad_mxfp4_checkpoints_are_refused_with_one_sentence(gpt_oss_mxfp4, tmp_path, capsys, edit, needles):
    base, adapter = gpt_oss_mxfp4
    _refused(base, adapter, edit, tmp_path, capsys, needles)


def test_a_16bit_original_beside_the_fp8_release_is_the_other_choice(qwen3_fp8, tmp_path, capsys):
    """Qwen3-8B beside Qwen3-8B-FP8: merging into the FP8 release names the original as the other
    choice; merging the same adapter (it names the FP8 model) into the original says what differs."""
    base, adapter = qwen3_fp8
    fp8 = tmp_path / "Qwen3-tiny-FP8"
    shutil.copytree(base, fp8)
    original = tmp_path / "Qwen3-tiny"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(original)
    named = tmp_path / "adapter"
    shutil.copytree(adapter, named)
    config = json.loads((named / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(fp8)}))

    assert main(["merge", "--base", str(fp8), "--adapter", str(named), "--out", str(tmp_path / "a"), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert f"A 16-bit model it was made from is on this machine ({original})" in plan, plan
    assert f"To merge into the 16-bit weights instead, pass --base {original}." in plan

    assert main(["merge", "--base", str(original), "--adapter", str(named), "--out", str(tmp_path / "b"), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert f"The adapter was trained on {fp8}, released as FP8 (e4m3), 128x128 blocks" in plan, plan
    assert f"To merge into the weights training saw, pass --base {fp8}." in plan
    assert "base-name" not in plan and "but the base given is" not in plan


# -- outputs written quantized ---------------------------------------------------------------------------


def _fp8_quantize(w):
    """transformers' own Fp8Quantize (what save_pretrained of a dequantized FP8 model writes)."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class Quantizer:
        quantization_config = transformers.FineGrainedFP8Config(weight_block_size=[128, 128])

    out = Fp8Quantize(Quantizer())._quantize_one("x.weight", w)
    return out["x.weight"], out["x.weight_scale_inv"]


def _qv_adapter(base, folder, kind="fp8"):
    from peft import LoraConfig, get_peft_model

    model = _dequantized_load(base, kind) if kind else transformers.AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(folder)
    return folder


def _logits_gap(out, base, adapter, kind, load_kind):
    """(max |logits of the output loaded by transformers - the unmerged adapter's|, max |unmerged|), fp32."""
    from peft import PeftModel

    loaded = _dequantized_load(base, kind) if kind else transformers.AutoModelForCausalLM.from_pretrained(base)
    unmerged = PeftModel.from_pretrained(loaded.float(), adapter).eval()
    merged = (_dequantized_load(out, load_kind) if load_kind else transformers.AutoModelForCausalLM.from_pretrained(out))
    with torch.no_grad():
        want = unmerged(PROBE).logits
        got = merged.float()(PROBE).logits
    return (got - want).abs().max().item(), want.abs().max().item()


def test_keep_quantization_copies_untouched_weights_and_quantizes_changed_ones_again(qwen3_fp8, tmp_path, capsys):
    base, _ = qwen3_fp8
    adapter = _qv_adapter(base, tmp_path / "qv")
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(kept), "--keep-quantization",
                 "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert ("output is  FP8 (e4m3), 128x128 blocks as the base: 10 weights copied with their scales, 4 changed by "
            "the adapter quantized again; quantization_config kept") in plan, plan
    assert "the output is written in the same format again (--keep-quantization)" in plan
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(plain), "--plain", "--no-verify"]) == 0
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(kept), "--plain", "--keep-quantization"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    base_config = json.loads((base / "config.json").read_text())
    assert json.loads((kept / "config.json").read_text())["quantization_config"] == base_config["quantization_config"]
    stored, got, bf16 = read_output(base), read_output(kept), read_output(plain)
    assert sorted(got) == sorted(stored)
    changed = {n for n in stored if ".q_proj." in n or ".v_proj." in n}
    for name, value in stored.items():
        if name in changed:
            continue
        assert got[name].dtype == value.dtype and torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name
    for name in (n for n in changed if n.endswith(".weight")):
        q, inv = _fp8_quantize(bf16[name])  # the bf16 merge, quantized by transformers' own code
        assert got[name].dtype == torch.float8_e4m3fn
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(got[name[: -len("weight")] + "weight_scale_inv"], inv), name
    gap, scale = _logits_gap(kept, base, adapter, "fp8", "fp8")
    assert gap < 0.1 * scale, (gap, scale)  # e4m3 keeps 3 mantissa bits
    checks = verification_checks(kept)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out


def test_quantize_fp8_writes_any_merge_as_fp8_blocks(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = tmp_path / "Qwen3-tiny"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), lora).save_pretrained(tmp_path / "adapter")
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    args = ["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter")]
    assert main([*args, "--out", str(plain), "--plain", "--no-verify"]) == 0
    assert main([*args, "--out", str(fp8), "--dry-run", "--quantize", "fp8"]) == 0
    plan = capsys.readouterr().out
    assert ("output is  FP8 (e4m3), 128x128 blocks, weight-only: 14 Linear weights transformers' FP8 load quantizes; "
            "what it leaves alone (lm_head), embeddings and norms stay bfloat16") in plan, plan
    code = main([*args, "--out", str(fp8), "--plain", "--quantize", "fp8"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    config = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128] and config["fmt"] == "e4m3"
    got, bf16 = read_output(fp8), read_output(plain)
    linear = [n for n in bf16 if n.endswith("_proj.weight")]
    assert len(linear) == 14
    for name in linear:
        q, inv = _fp8_quantize(bf16[name])
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(got[name[: -len("weight")] + "weight_scale_inv"], inv), name
    for name in set(bf16) - set(linear):  # embeddings, norms: 16-bit as the plain merge
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], bf16[name]), name
    gap, scale = _logits_gap(fp8, base, tmp_path / "adapter", None, "fp8")
    assert gap < 0.1 * scale, (gap, scale)
    checks = verification_checks(fp8)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out


def test_quantized_outputs_that_cannot_be_written_are_refused(qwen3_fp8, tmp_path, capsys):
    torch.manual_seed(0)
    plain = tmp_path / "Qwen3-tiny"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(plain)
    for base, adapter, flag, needle in (
        (plain, _qv_adapter(plain, tmp_path / "qv", kind=None), ["--keep-quantization"],
         "--keep-quantization writes FP8 (quant_method fp8), compressed-tensors FP8 or MXFP4 again; the base is "
         "not quantized"),
        (*qwen3_fp8, ["--quantize", "fp8"], "--quantize fp8 quantizes a 16-bit merge; the base is already FP8 (e4m3), 128x128 blocks: use --keep-quantization"),
    ):
        out = tmp_path / "out"
        code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", *flag])
        said = capsys.readouterr()
        assert code != 0 and needle in said.out + said.err, said.out + said.err
        assert not out.exists()


@pytest.mark.parametrize("case,attention", [("deepseek_v3-fp8", "q_a_proj"), ("gpt_oss-mxfp4", "q_proj")])
def test_lora_on_the_experts_of_a_quantized_moe_merges_like_peft(case, attention, request, tmp_path, capsys):
    """LoRA on the routed experts (peft target_parameters, chosen by hand; peft's all-linear spelling is the
    MoE adapters' issue): DeepSeek-V3's FP8 experts, one FP8 tensor per expert and projection on disk, and
    GPT-OSS's MXFP4 experts, packed; both merge as peft merges on transformers' dequantized load."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base, _, kind = _case(request, case)
    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[attention], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(_dequantized_load(base, kind), lora).save_pretrained(tmp_path / "adapter")
    merged_ref = PeftModel.from_pretrained(_dequantized_load(base, kind).float(), tmp_path / "adapter").merge_and_unload()
    expected = _disk_state(merged_ref)
    before = _disk_state(_dequantized_load(base, kind))
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got = read_output(out)
    experts = [n for n in got if ".experts." in n and not n.endswith("_bias") and not torch.equal(got[n], before[n])]
    assert len(experts) == (12 if kind == "fp8" else 4), experts  # every expert's projections (layer 1 / both layers)
    for name in experts + [n for n in got if attention in n]:
        want = expected[name].to(got[name].dtype)
        torch.testing.assert_close(got[name].float(), want.float(), rtol=2 ** -8, atol=0, msg=name)
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out


def test_weights_are_dequantized_a_block_of_rows_at_a_time(qwen3_fp8, monkeypatch):
    """The engine reads a dequantized weight in blocks of rows (whole blocks of the scale grid); with
    blocks of 128 rows a 384-row weight comes in three, and together they are the whole weight."""
    from tui_merger.core.formats import dequant

    base, _ = qwen3_fp8
    config = json.loads((base / "config.json").read_text())
    source = DequantSource(open_model(base), scheme_of(config), config)
    ref = source.tensors["model.layers.0.mlp.gate_proj.weight"]
    monkeypatch.setattr(dequant, "ROW_VALUES", 128 * 256)
    blocks = []
    for block, release in source.row_blocks(ref):
        blocks.append(block.clone())
        release()
    assert [b.shape[0] for b in blocks] == [128, 128, 128]
    assert torch.equal(torch.cat(blocks), ref.load())


@pytest.fixture(scope="module")
def fp8_with_tokenizer(tmp_path_factory):
    """A Qwen3 FP8-block base with a tokenizer, and a peft LoRA on its dequantized load."""
    from peft import LoraConfig, get_peft_model
    from test_gguf import byte_level_tokenizer, config_of

    root = tmp_path_factory.mktemp("fp8_tok")
    base = root / "Qwen3-tok-FP8"
    torch.manual_seed(0)
    make_fp8_block_base(base, transformers.AutoModelForCausalLM.from_config(config_of("qwen3")))
    byte_level_tokenizer("qwen").save_pretrained(base)
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(_dequantized_load(base, "fp8"), lora).save_pretrained(root / "adapter")
    return base, root / "adapter"


def test_the_bf16_output_of_an_fp8_base_exports_to_gguf(fp8_with_tokenizer, tmp_path, capsys):
    """The default output is a plain model: tui-merger gguf writes it, and transformers' GGUF reader gives
    back every weight of the merged folder bit for bit."""
    from test_gguf import load_gguf, load_hf

    base, adapter = fp8_with_tokenizer
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    gguf = tmp_path / "gguf" / "model.gguf"
    gguf.parent.mkdir()
    code = main(["gguf", str(out), "--type", "bf16", "--out", str(gguf), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    want, got = load_hf(out).state_dict(), load_gguf(gguf).state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_try_it_on_a_kept_fp8_output_says_what_it_needs_and_runs_it(fp8_with_tokenizer, tmp_path, capsys):
    """Try it on an output kept in FP8 (and on the FP8 base beside it): the plan says both run dequantized
    and counts their 16-bit size; run layer by layer from the files (too little memory), they answer as
    transformers' dequantizing load of the same folders does."""
    from tui_merger.core.ship.trial import plan_trial, run_trial

    base, adapter = fp8_with_tokenizer
    out = tmp_path / "kept"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain",
                 "--keep-quantization"]) == 0
    capsys.readouterr()
    plan = plan_trial(out, available=1)  # too little memory: each side runs layer by layer from its files
    text = " ".join(plan.notes)
    assert "The merged model is stored as FP8 (e4m3), 128x128 blocks; it runs dequantized to bfloat16" in text, text
    assert "The base model is stored as FP8 (e4m3), 128x128 blocks" in text, text
    values = sum(p.numel() for p in _dequantized_load(out, "fp8").parameters())
    assert plan.sides[0].memory_bytes >= 2 * values  # the bf16 size, not the FP8 files'
    answers = run_trial(plan, "hello there", max_new_tokens=4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    enc = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    for answer, folder in zip(answers, (out, base)):  # layer by layer runs in fp32: so does the reference
        model = _dequantized_load(folder, "fp8").float()
        want = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert answer.token_ids == want[0, enc["input_ids"].shape[1]:].tolist(), answer.label
    fits = plan_trial(out)  # enough memory: transformers loads it (on a CPU it dequantizes FP8 itself)
    assert fits.fits and fits.dtype == "bfloat16"
    merged = run_trial(fits, "hello there", max_new_tokens=4)[0]
    want = _dequantized_load(out, "fp8").generate(**enc, max_new_tokens=4, do_sample=False,
                                                 pad_token_id=tokenizer.pad_token_id)
    assert merged.token_ids == want[0, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("strategy", ["tensor", "block"])
def test_compressed_tensors_per_tensor_and_per_block_scales_equal_transformers_load(strategy, tmp_path):
    """compressed-tensors' other FP8 strategies (the channel one is the merge fixture above): every
    dequantized weight equals transformers' dequantizing load bit for bit."""
    pytest.importorskip("compressed_tensors")
    base = tmp_path / f"Qwen3-tiny-FP8-{strategy}"
    torch.manual_seed(0)
    make_compressed_fp8_base(base, transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)), strategy)
    config = json.loads((base / "config.json").read_text())
    scheme = scheme_of(config)
    assert scheme.strategy == strategy and scheme.block == ((128, 128) if strategy == "block" else None)
    source = DequantSource(open_model(base), scheme, config)
    expected = _disk_state(_dequantized_load(base, "compressed-tensors"))
    assert len(source.dequantized) == 14
    for name in source.dequantized:
        assert torch.equal(source.tensors[name].load(), expected[name]), name


def test_fp8_with_one_scale_per_tensor_equals_transformers_load(tmp_path):
    """quant_method fp8 without weight_block_size: one weight_scale_inv per tensor."""
    from fp8_factory import FP8_CONFIG, _rewrite

    base = tmp_path / "Qwen3-tiny-FP8-tensor"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16).save_pretrained(base)

    def per_tensor(w):
        scale = w.float().abs().max() / 448.0
        return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(())

    config_entry = {k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"}
    _rewrite(base, per_tensor, {**config_entry, "weight_block_size": None, "_scale": "weight_scale_inv"})
    config = json.loads((base / "config.json").read_text())
    source = DequantSource(open_model(base), scheme_of(config), config)
    expected = _disk_state(_dequantized_load(base, "fp8"))
    assert len(source.dequantized) == 14 and source.scheme.strategy == "tensor"
    for name in source.dequantized:
        assert torch.equal(source.tensors[name].load(), expected[name]), name


def _refused(base, adapter, edit, tmp_path, capsys, needles) -> str:
    """Merge into a copy of ``base`` broken by ``edit``: refused, every needle said, nothing written."""
    broken = _broken_copy(base, tmp_path, edit)
    out = tmp_path / "out"
    code = main(["merge", "--base", str(broken), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    text = said.out + said.err
    assert code != 0
    for needle in needles:
        assert needle in text, (needle, text)
    assert not out.exists()
    return text


def test_packed_mxfp4_experts_are_merged_a_few_experts_at_a_time(gpt_oss_mxfp4, tmp_path, capsys, monkeypatch):
    """GPT-OSS's packed experts with a LoRA on them (peft target_parameters) are dequantized, merged and
    recomputed a few experts at a time, never whole (GPT-OSS-120B's gate_up_proj is 4.2 GB in bf16 per
    layer): with blocks of two of the four experts, the merge and its verification read every expert
    weight in two blocks and never whole, and the output is still peft's merge."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from tui_merger.core.merge import merge_math
    from tui_merger.core.verify import recompute

    base, _ = gpt_oss_mxfp4
    torch.manual_seed(4)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(_dequantized_load(base, "mxfp4"), lora).save_pretrained(tmp_path / "adapter")
    expected = _disk_state(PeftModel.from_pretrained(_dequantized_load(base, "mxfp4").float(),
                                                     tmp_path / "adapter").merge_and_unload())
    whole, spans = [], []

    def recording(real):
        def load(self, ref):
            whole.append(ref.name)
            return real(self, ref)
        return load

    def recording_experts(real):
        def load_experts(self, ref, i, j):
            spans.append((ref.name, i, j))
            return real(self, ref, i, j)
        return load_experts

    monkeypatch.setattr(DequantSource, "load", recording(DequantSource.load))
    monkeypatch.setattr(DequantSource, "load_experts", recording_experts(DequantSource.load_experts))
    monkeypatch.setattr(merge_math, "BLOCK_VALUES", 64 * 128 * 2 // 16)  # two experts of gate_up_proj a block
    monkeypatch.setattr(recompute, "BLOCK_VALUES", 64 * 128 * 2)
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--out", str(out), "--plain",
                 "--no-verify"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert not [n for n in whole if "experts" in n], whole
    gate_up = sorted((i, j) for name, i, j in spans if name == "model.layers.0.mlp.experts.gate_up_proj_blocks")
    assert gate_up == [(0, 2), (2, 4)], spans
    got = read_output(out)
    for name in (n for n in got if ".experts." in n and not n.endswith("_bias")):
        torch.testing.assert_close(got[name].float(), expected[name].to(got[name].dtype).float(), rtol=2 ** -8, atol=0,
                                   msg=name)
    spans.clear()
    # verification dequantizes with the format's own code (verify/dequant_ref.py), a few experts at a time too
    from tui_merger.core.verify.dequant_ref import IndependentDequant

    monkeypatch.setattr(IndependentDequant, "load", recording(IndependentDequant.load))
    monkeypatch.setattr(IndependentDequant, "load_experts", recording_experts(IndependentDequant.load_experts))
    report = verify_merge(out, behaviour=False)
    assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "pass"}
    assert not [n for n in whole if "experts" in n], whole
    assert {(i, j) for name, i, j in spans if name.endswith("gate_up_proj_blocks")} == {(0, 2), (2, 4)}, spans


def _experts_adapter(base, folder):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(_dequantized_load(base, "mxfp4"), lora).save_pretrained(folder)
    return folder


def test_packed_experts_are_not_refused_for_memory_they_no_longer_take(gpt_oss_mxfp4, tmp_path, capsys, monkeypatch):
    """The plan's memory check counts a block of experts for packed experts merged a few at a time, not
    the whole parameter three times in fp32 (GPT-OSS-120B's gate_up_proj alone would be 25 GB): with
    memory for a block but not for the whole, the merge goes ahead; with less, it is refused."""
    from tui_merger.core.merge import merge_math
    from tui_merger.core.verify import checks

    base, _ = gpt_oss_mxfp4
    adapter = _experts_adapter(base, tmp_path / "adapter")
    monkeypatch.setattr(merge_math, "BLOCK_VALUES", 1024)  # blocks of three of the four experts at most
    whole = 4 * 64 * 128 * 4 * 3  # gate_up_proj [4, 64, 128] in fp32, three times
    block = 3 * 64 * 128 * 4 * 3
    for available, ok in (((400 << 20) + (block + whole) // 2, True), ((400 << 20) + block // 2, False)):
        monkeypatch.setattr(checks, "_available_memory", lambda available=available: available)
        code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "out"),
                     "--dry-run"])
        said = capsys.readouterr()
        assert (code == 0) == ok, said.out + said.err
        assert ("Merging needs about" in said.out + said.err) != ok, said.out + said.err


def test_the_behaviour_check_says_when_packed_experts_need_more_memory_than_there_is(gpt_oss_mxfp4, tmp_path, capsys,
                                                                                      monkeypatch):
    """The behaviour check runs a packed experts parameter whole in fp32, in the merged model and the
    reference at once; when that does not fit in the memory available it is skipped with the numbers,
    instead of the process being killed, and structure and recompute still pass."""
    from tui_merger.core.verify import behaviour, checks

    base, _ = gpt_oss_mxfp4
    adapter = _experts_adapter(base, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain",
                 "--no-verify"]) == 0
    monkeypatch.setattr(checks, "_available_memory", lambda: behaviour.BASE_MEMORY)  # less than it needs
    report = verify_merge(out)
    found = {c.name: c for c in report.checks}
    assert {n: c.status for n, c in found.items()} == {"structure": "pass", "recompute": "pass", "behaviour": "skip"}
    assert "mlp.experts.gate_up_proj" in found["behaviour"].summary and "of memory" in found["behaviour"].summary
    monkeypatch.setattr(checks, "_available_memory", lambda: None)  # unknown: it runs
    assert {c.name: c.status for c in verify_merge(out).checks}["behaviour"] == "pass"


# -- the checks dequantize with the formats' own code, not the merge's ------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_the_checks_dequantize_by_the_formats_own_code_as_transformers_loads(case, request):
    """What the recompute and the behaviour check's reference read (verify/dequant_ref.py: transformers'
    FP8 and MXFP4 functions, compressed-tensors' dequantize) equals transformers' dequantizing load bit for
    bit, in bf16 and, for --dtype fp32, in fp32 (dequantized straight to fp32, no bf16 stop)."""
    from tui_merger.core.verify.dequant_ref import independent_base

    base, _, kind = _case(request, case)
    config = json.loads((base / "config.json").read_text())
    for dtype in ("bfloat16", "float32"):
        view = DequantSource(open_model(base), scheme_of(config), config, None if dtype == "bfloat16" else dtype)
        checked = independent_base(view)
        assert checked is not view and sorted(checked.tensors) == sorted(view.tensors)
        loaded = _dequantized_load(base, kind) if dtype == "bfloat16" else _dequantized_load_as(base, kind, torch.float32)
        expected = _disk_state(loaded)
        for name in view.dequantized:
            want = expected[name]
            assert want.dtype == getattr(torch, dtype), name
            assert torch.equal(checked.tensors[name].load(), want), name
            assert torch.equal(view.tensors[name].load(), want), name  # the merge's own, as well


def _dequantized_load_as(folder, kind, dtype):
    """transformers' dequantizing load in ``dtype``."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=_quantization_config(kind), dtype=dtype).eval()


def test_an_fp32_output_of_an_fp8_base_is_dequantized_straight_to_fp32(qwen3_fp8, tmp_path, capsys):
    """--dtype fp32 on an FP8 base: every weight is peft's fp32 merge on transformers' fp32 dequantized load
    (before, the base weights were rounded to bf16 first: 2.4e-4 off), and verification passes."""
    from peft import PeftModel

    base, adapter = qwen3_fp8
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--dtype", "fp32", "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    merged = PeftModel.from_pretrained(_dequantized_load_as(base, "fp8", torch.float32), adapter).merge_and_unload()
    expected, got = _disk_state(merged), read_output(out)
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype == torch.float32, name
        torch.testing.assert_close(got[name], want, rtol=2 ** -20, atol=1e-7, msg=name)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out


@pytest.mark.parametrize("wrong", ["bf16-stop", "scale-off-by-one-block"])
def test_a_wrongly_dequantized_merge_fails_verification(wrong, qwen3_fp8, tmp_path, monkeypatch, capsys):
    """The merge's dequantizer made wrong (the old bf16 stop on the way to fp32; each weight's scales
    shifted by one block row) gives a merge the verifier calls FAILED: it dequantizes with the format's own
    code, not the merge's."""
    import tui_merger.core.formats.dequant as dequant

    real = dequant.dequantize

    def bad(q, scale, scheme, dtype, out=None):
        if wrong == "bf16-stop":
            values = real(q, scale, scheme, torch.bfloat16).to(dtype)
        else:
            values = real(q, torch.roll(scale, 1, dims=0) if scale.dim() == 2 and scale.shape[0] > 1 else scale * 2,
                          scheme, dtype)
        if out is None:
            return values
        out.copy_(values)
        return out

    monkeypatch.setattr(dequant, "dequantize", bad)
    base, adapter = qwen3_fp8
    out = tmp_path / "merged"
    dtype = ["--dtype", "fp32"] if wrong == "bf16-stop" else []
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), *dtype, "--plain"])
    said = capsys.readouterr()
    assert code == 4, said.out + said.err
    checks = verification_checks(out)
    assert checks["recompute"] == "fail" and checks["behaviour"] == "fail", said.out


def test_keep_quantization_on_ue8m0_scales_stored_as_e8m0_writes_them_so_again(qwen3_ue8m0, tmp_path, capsys):
    """An FP8 base whose power-of-two scales are stored as float8_e8m0fnu (read: it was called "not a valid
    safetensors file" before) kept in its format: untouched weights and scales byte for byte, changed ones
    as transformers' Fp8Quantize with scale_fmt="ue8m0" writes them (the scale as float8_e8m0fnu), and
    transformers' dequantizing load of the output gives the unmerged adapter's logits within e4m3's rounding."""
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class Quantizer:
        quantization_config = transformers.FineGrainedFP8Config(weight_block_size=[128, 128], scale_fmt="ue8m0")

    base, _ = qwen3_ue8m0
    stored = read_output(base)
    assert {v.dtype for n, v in stored.items() if n.endswith("weight_scale_inv")} == {torch.float8_e8m0fnu}
    adapter = _qv_adapter(base, tmp_path / "qv", "fp8-ue8m0")
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(plain), "--plain", "--no-verify"]) == 0
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(kept), "--plain", "--keep-quantization"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, bf16 = read_output(kept), read_output(plain)
    assert sorted(got) == sorted(stored)
    changed = {n for n in stored if ".q_proj." in n or ".v_proj." in n}
    for name, value in stored.items():
        if name not in changed:
            assert got[name].dtype == value.dtype and torch.equal(got[name].view(torch.uint8), value.view(torch.uint8)), name
    for name in (n for n in changed if n.endswith(".weight")):
        out = Fp8Quantize(Quantizer())._quantize_one("x.weight", bf16[name])
        scale = name[: -len("weight")] + "weight_scale_inv"
        assert got[scale].dtype == out["x.weight_scale_inv"].dtype == torch.float8_e8m0fnu, name
        assert torch.equal(got[name].view(torch.uint8), out["x.weight"].view(torch.uint8)), name
        assert torch.equal(got[scale].view(torch.uint8), out["x.weight_scale_inv"].view(torch.uint8)), name
    gap, scale = _logits_gap(kept, base, adapter, "fp8-ue8m0", "fp8-ue8m0")
    assert gap < 0.1 * scale, (gap, scale)
    assert verification_checks(kept) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
