"""DeepSeek-V4 as released: FP8 dense layers with float8_e8m0fnu (ue8m0) block scales named ``W.scale`` and
routed experts in MXFP4 (int8, two e2m1 codes a byte, a ue8m0 scale per 32 values), one checkpoint
(tests/quant_v4_factory.py writes it from the format's definition). Every dequantized value equals
transformers' own dequantizing load bit for bit; a LoRA made by peft on that load merges as peft's
merge_and_unload; the output gives the unmerged logits and verifies PASSED; a merge dequantized wrongly FAILS;
bad checkpoints get one sentence naming the tensor and nothing is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import quant_v4_factory as v4
import torch
import transformers
from factory import read_output, verification_checks
from safetensors.torch import load_file, save_file

from tui_merger.cli import main
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.dequant import DequantSource, scheme_of
from tui_merger.core.io.sources import open_model
from tui_merger.core.verify.checks import verify_merge

PROBE = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(7))
LABEL = ("FP8 (e4m3), 32x32 blocks, power-of-two (ue8m0) scales + MXFP4 experts (e2m1, a power-of-two scale per "
         "32 values)")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(base, reference folder, its tensors, quantized names, adapter made by peft on transformers' load)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("v4q")
    base, ref = root / "base", root / "ref"
    quantized = v4.make_base(base)
    values = v4.reference_folder(base, ref)
    torch.manual_seed(1)
    model = v4.dequantized_load(base, torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                      target_modules=["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(model, lora).save_pretrained(root / "adapter")
    return base, ref, values, quantized, root / "adapter"


@pytest.fixture(scope="module")
def merged(built, tmp_path_factory):
    base, _, _, _, adapter = built
    out = tmp_path_factory.mktemp("v4out") / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    assert code == 0
    return out


def _source(base: Path):
    config = json.loads((base / "config.json").read_text())
    return DequantSource(open_model(base), scheme_of(config), config)


def test_every_dequantized_value_equals_transformers_load(built):
    base, _, values, quantized, _ = built
    source = _source(base)
    assert source.scheme.label == LABEL and source.scheme.scale_suffix == "scale"
    assert sorted(source.dequantized) == sorted(quantized)
    assert len(quantized) == 2 * (4 + 3 + 4 * 3)  # per layer: 4 attention, 3 shared expert, 4 experts x 3
    assert sorted(source.tensors) == sorted(values)  # the scales hidden, nothing else
    for name, want in values.items():
        got = source.tensors[name].load()
        if name in quantized:
            assert got.dtype == want.dtype == torch.bfloat16, name
        assert torch.equal(got.float(), want.float()), name  # hc_* are kept fp32 by transformers: values equal
    for name in quantized:  # merged and written a few rows at a time: the same values
        blocks = [b for b, _ in source.row_blocks(source.tensors[name])]
        assert torch.equal(torch.cat(blocks), values[name]), name
    experts = [n for n in quantized if ".ffn.experts." in n]
    assert len(experts) == 24 and all(source.inner.tensors[n].dtype == "int8" for n in experts)


def test_merge_equals_peft_gives_the_unmerged_logits_and_verifies(built, merged):
    from peft import PeftModel

    base, ref, values, _, adapter = built
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config
    got = read_output(merged)
    assert not any(n.endswith(".scale") for n in got)
    unmerged = PeftModel.from_pretrained(v4.dequantized_load(base, torch.float32), adapter).eval()
    with torch.no_grad():
        want_logits = unmerged(PROBE).logits
    expected = unmerged.merge_and_unload()
    expected.to(torch.bfloat16).save_pretrained(ref.parent / "peft")
    expected = read_output(ref.parent / "peft")
    assert set(got) == set(expected)
    changed = 0
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        torch.testing.assert_close(got[name].float(), want.float(), rtol=2 ** -8, atol=0, msg=name)  # one bf16 step
        changed += not torch.equal(got[name].float(), values[name].float())
    assert changed >= 30
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        logits, without = model(PROBE).logits, plain(PROBE).logits
    gap, moved = (logits - want_logits).abs().max().item(), (without - want_logits).abs().max().item()
    assert gap < 0.2 * moved, (gap, moved)  # the bf16 rounding of the merged weights, against the adapter's effect
    assert verification_checks(merged) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    manifest = json.loads((merged / "merge_manifest.json").read_text())
    assert manifest["base_weights"]["format"] == LABEL


def test_the_release_names_merge_to_the_same_model(built, merged, tmp_path, capsys):
    """The release's own names (``layers.N.attn.wq_a.weight``, ``embed.weight``: no ``model.`` prefix, which
    transformers and vLLM add as they load): the same adapter merges, verifies PASSED, keeps those names, and
    transformers loads every parameter equal to the merge of the save_pretrained-named base."""
    _, _, _, _, adapter = built
    base = tmp_path / "release"
    quantized = v4.make_base(base, release_names=True)
    assert "layers.0.ffn.experts.0.w1.weight" in quantized and "layers.0.ffn.experts.0.w1.scale" in read_output(base)
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    said = capsys.readouterr().out
    # peft's target names (q_a_proj) are the model's in memory; the files say wq_a: no false "no LoRA" warning
    assert "target_modules names modules the base does not have" not in said, said
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    got = read_output(out)
    assert "embed.weight" in got and "layers.1.ffn.experts.3.w2.weight" in got and not any(".scale" in n for n in got)
    mine = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    other = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).state_dict()
    assert sorted(mine) == sorted(other) and all(torch.equal(mine[k], other[k]) for k in other)


def _swap_nibbles(t: torch.Tensor) -> torch.Tensor:
    b = t.contiguous().view(torch.uint8)
    return ((b >> 4) | ((b & 0x0F) << 4)).view(torch.int8)


@pytest.mark.parametrize("wrong", ["nibbles", "scale"])
def test_a_wrongly_dequantized_merge_fails_verification(wrong, built, merged, tmp_path):
    """One expert weight of the output built on the base dequantized wrongly (the nibbles of each byte swapped,
    or its ue8m0 scales read one power of two off): the recompute, which dequantizes with transformers' own
    code, FAILS."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    base, _, values, _, _ = built
    bad = tmp_path / "bad"
    shutil.copytree(merged, bad)
    manifest = json.loads((bad / "merge_manifest.json").read_text())
    manifest["options"]["out"] = str(bad)
    (bad / "merge_manifest.json").write_text(json.dumps(manifest))
    stored = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.ffn.experts.2.w3.weight"
    q, s = stored[name], stored[name[: -len(".weight")] + ".scale"]
    if wrong == "nibbles":
        q = _swap_nibbles(q)
    else:
        s = (s.to(torch.float32) * 2).to(torch.float8_e8m0fnu)
    wrong_value = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.bfloat16)
    assert not torch.equal(wrong_value, values[name])
    tensors = load_file(str(bad / "model.safetensors"))
    tensors[name] = (tensors[name].float() - values[name].float() + wrong_value.float()).to(torch.bfloat16)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    report = verify_merge(bad, behaviour=False)
    assert not report.passed
    assert {c.name: c.status for c in report.checks}["recompute"] == "fail"


def test_dry_run_and_inspect_say_what_the_base_is(built, tmp_path, capsys):
    base, _, _, _, adapter = built
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dry-run"])
    plan = capsys.readouterr().out
    assert code == 0, plan
    assert f"base is    {LABEL}, as released (38 weights)" in plan, plan
    assert "output is  bfloat16, a plain model (quantization_config removed)" in plan
    assert main(["inspect", str(base)]) == 0
    said = capsys.readouterr().out
    assert f"{LABEL}, as released" in said and 'expert_dtype="fp4"' in said, said


def test_keep_quantization_is_refused_in_one_sentence(built, tmp_path, capsys):
    base, _, _, _, adapter = built
    out = tmp_path / "kept"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--keep-quantization",
                 "--plain"])
    said = capsys.readouterr()
    assert code != 0 and "--keep-quantization cannot write FP8 (e4m3)" in said.out + said.err
    assert not out.exists()


EXPERT = "model.layers.0.ffn.experts.1.w2"
DENSE = "model.layers.1.attn.wq_a"


@pytest.mark.parametrize("change,said", [
    (lambda t, c: t.update({f"{EXPERT}.scale": t[f"{EXPERT}.scale"].to(torch.float32).to(torch.bfloat16)}),
     f"{EXPERT}.scale is stored in bfloat16; MXFP4 expert scales are float8_e8m0fnu"),
    (lambda t, c: t.update({f"{DENSE}.scale": t[f"{DENSE}.scale"].to(torch.float32).to(torch.float8_e4m3fn)}),
     f"{DENSE}.scale is stored in float8_e4m3fn; FP8 (e4m3) scales are float32, bfloat16, float16 or float8_e8m0fnu"),
    (lambda t, c: t.update({f"{EXPERT}.weight": t[f"{EXPERT}.weight"][:, :16].contiguous()}),
     f"{EXPERT}.scale has shape [64, 2] but {EXPERT}.weight [64, 16] (64x32 values, two a byte) needs [64, 1]"),
    (lambda t, c: t.update({f"{EXPERT}.weight": t[f"{EXPERT}.weight"][:, :16].contiguous(),
                            f"{EXPERT}.scale": t[f"{EXPERT}.scale"][:, :1].contiguous()}),
     f"{EXPERT}.weight is int8 [64, 16], the packed values of a [64, 32] weight, but the model config.json describes "
     f"has {EXPERT}.weight of shape [64, 64]; the packed values do not fit the config"),
    (lambda t, c: c.update({"expert_dtype": "fp8"}),
     "model.layers.0.ffn.experts.0.w1.weight is stored in int8 (MXFP4: two 4-bit values a byte), but the base's config says expert_dtype fp8"),
    (lambda t, c: t.update({"model.layers.0.attn.wo_a.weight": t["model.layers.0.attn.wo_a.weight"].to(torch.int8)}),
     "model.layers.0.attn.wo_a.weight is stored in int8 but has no scale beside it"),
    (lambda t, c: t.update({"model.layers.0.attn.wo_a.weight_packed": torch.zeros(32, 4, dtype=torch.int32)}),
     "model.layers.0.attn.wo_a.weight_packed (int32 [32, 4]) is of no format the base's quantization_config declares"),
])
def test_bad_input_is_one_sentence_and_nothing_is_written(change, said, built, tmp_path, capsys):
    base, _, _, _, adapter = built
    bad = tmp_path / "broken"
    shutil.copytree(base, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    config = json.loads((bad / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(MergeError) as err:
        _source(bad)
    assert said in str(err.value) and str(err.value).endswith("Nothing was written."), str(err.value)
    out = tmp_path / "out"
    code = main(["merge", "--base", str(bad), "--adapter", str(adapter), "--out", str(out), "--plain"])
    text = capsys.readouterr()
    assert code != 0 and said in text.out + text.err
    assert not out.exists()
