"""Quantized bases: the NF4/FP4 round trip equals bitsandbytes' own (a committed fixture, see
fixtures/make_nf4_reference.py) and a plain loop-and-argmin implementation written here; --qlora-base
merges into dequant(quant(W)) for exactly the tensors bitsandbytes quantizes; quantized bases are
explained and refused, with the local 16-bit model they were made from named; the findings fire and
stay silent where they should."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import gpt2_config, qwen_config, read_output, save_adapter, save_base
from safetensors.torch import load_file, save_file

from tui_merger.cli import build_parser
from tui_merger.cli import main as cli_main
from tui_merger.core.formats import quant
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.errors import MergeError
from tui_merger.core.options import MergeOptions
from tui_merger.core.plan.preflight import make_plan
from tui_merger.core.record.provenance import finish_merge
from tui_merger.core.formats.quant import (
    QuantInfo,
    RoundTripSource,
    find_unquantized_base,
    nf4_roundtrip,
    parse_roundtrip,
    quantization_info,
    roundtrip_4bit,
)
from tui_merger.core.io.sources import open_model
from tui_merger.core.verify.checks import verify_merge

FIXTURE = Path(__file__).parent / "fixtures" / "nf4_reference.safetensors"
BNB_NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
           "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}


@pytest.fixture(scope="module")
def ref():
    return load_file(str(FIXTURE))


# -- an independent NF4 / FP4, written the plain way ----------------------------------------------


def nearest(y, code):
    """Index of the nearest code value to each of ``y`` (fp32), by argmin over exact (fp64) distances;
    a value exactly on a threshold bitsandbytes compares with (the fp32 midpoint of two neighbouring
    codes) takes the lower code, as ``x > threshold`` does."""
    idx = (y.double().view(-1, 1) - code.double().view(1, -1)).abs().argmin(dim=1)
    thresholds = (code[:-1] + code[1:]) / 2
    for k, t in enumerate(thresholds.tolist()):
        idx[y == t] = k
    return idx


def slow_roundtrip(w, code, blocksize=64, double_quant=False, dyn=None):
    """Block by block: absmax; each value times 1/absmax (bitsandbytes multiplies by the reciprocal);
    the nearest code value; code * absmax in fp32, cast once. Double quantization: the absmax values
    minus their mean, in blocks of 256, to the nearest value of the 8-bit dynamic map, times that
    block's absmax, plus the mean."""
    code = code.unique()  # ascending; FP4's +0 and -0 are one value
    x = w.reshape(-1).float()
    n = x.numel()
    starts = list(range(0, n, blocksize))
    absmax = torch.stack([x[i : i + blocksize].abs().max() for i in starts])
    scales = absmax
    if double_quant:
        offset = absmax.mean()
        centred = absmax - offset
        scales = torch.empty_like(absmax)
        for j in range(0, len(centred), 256):
            part = centred[j : j + 256]
            m = part.abs().max()
            idx = nearest(part * (1.0 / m), dyn)
            scales[j : j + 256] = dyn[idx] * m + offset
    out = torch.empty(n)
    for b, i in enumerate(starts):
        part = x[i : i + blocksize]
        y = part * (1.0 / absmax[b]) if absmax[b] > 0 else torch.zeros_like(part)
        out[i : i + blocksize] = code[nearest(y.clamp(-1, 1), code)] * scales[b]
    return out.to(w.dtype).view(w.shape)


def same_bits(a, b) -> bool:
    """Equal values and dtypes (+0 and -0 count as equal: both dequantize a zero code)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- the round trip ------------------------------------------------------------------------------


def test_round_trip_equals_bitsandbytes_bit_for_bit(ref):
    cases = sorted(k for k in ref if k.count(".") == 1 and not k.endswith(".w"))
    assert len(cases) == 14
    for key in cases:
        case, kind = key.split(".")
        w = ref[f"{case}.w"]
        got = roundtrip_4bit(w, kind.split("_")[0], 64, kind.endswith("_dq"))
        assert same_bits(got, ref[key]), (key, int((got != ref[key]).sum()))


def test_code_tables_are_bitsandbytes(ref):
    assert torch.equal(quant.dynamic_code(), ref["dynamic_map"])
    assert torch.equal(quant._code4("nf4"), ref["nf4_code"])
    assert torch.equal(quant._code4("fp4"), ref["fp4_code"].unique())  # ours has one zero, sorted


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 5), (33, 70), (129, 131)])
def test_round_trip_equals_a_plain_implementation(ref, dtype, shape):
    g = torch.Generator().manual_seed(1000 * shape[0] + shape[1] + {torch.float16: 1, torch.bfloat16: 2}.get(dtype, 3))
    w = (torch.randn(shape, generator=g) * 0.02 * torch.logspace(-1, 1, shape[0]).view(-1, 1)).to(dtype)
    for kind in ("nf4", "fp4"):
        code = ref[f"{kind}_code"]
        for dq in (False, True):
            want = slow_roundtrip(w, code, 64, dq, ref["dynamic_map"])
            assert same_bits(roundtrip_4bit(w, kind, 64, dq), want), (kind, dq)
    want = slow_roundtrip(w, ref["nf4_code"], 128, True, ref["dynamic_map"])
    assert same_bits(nf4_roundtrip(w, blocksize=128, double_quant=True), want)


def test_zero_blocks_outliers_chunks_and_out_dtype(ref, monkeypatch):
    w = torch.randn(10, 100) * 0.01
    w.view(-1)[64:128] = 0.0
    w.view(-1)[300] = 40.0
    w = w.bfloat16()
    want = slow_roundtrip(w, ref["nf4_code"], 64, True, ref["dynamic_map"])
    assert same_bits(nf4_roundtrip(w, double_quant=True), want)
    assert (nf4_roundtrip(w).view(-1)[64:128] == 0).all()
    monkeypatch.setattr(quant, "CHUNK_VALUES", 192)  # many chunks, the last one short
    assert same_bits(nf4_roundtrip(w, double_quant=True), want)
    assert nf4_roundtrip(w, out_dtype=torch.float32).dtype == torch.float32
    assert same_bits(nf4_roundtrip(torch.empty(0, 3, dtype=torch.bfloat16)), torch.empty(0, 3, dtype=torch.bfloat16))


def test_round_trip_refuses_what_it_cannot_do():
    with pytest.raises(MergeError, match="blocksize 100"):
        nf4_roundtrip(torch.ones(64), blocksize=100)
    with pytest.raises(MergeError, match="Only floating-point"):
        nf4_roundtrip(torch.ones(64, dtype=torch.int8))
    with pytest.raises(MergeError, match="int4 is not a 4-bit type"):
        roundtrip_4bit(torch.ones(64), "int4")


# -- settings --------------------------------------------------------------------------------------


def test_parse_roundtrip_defaults_and_settings():
    info = parse_roundtrip("nf4")
    assert (info.quant_type, info.blocksize, info.double_quant, info.skip_modules) == ("nf4", 64, True, ())
    assert info.can_roundtrip and info.flag_value() == "nf4"
    info = parse_roundtrip("NF4:blocksize=128, double_quant=no,skip=mlp.gate+score")
    assert (info.blocksize, info.double_quant, info.skip_modules) == (128, False, ("mlp.gate", "score"))
    assert parse_roundtrip(info.flag_value()) == info
    assert parse_roundtrip("fp4").quant_type == "fp4"
    for bad, said in [
        ("int4", "not a bitsandbytes 4-bit type"),
        ("nf4:blocksize=100", "blocksize must be one of"),
        ("nf4:double_quant=maybe", "double_quant must be yes or no"),
        ("nf4:group=64", "is not a setting"),
    ]:
        with pytest.raises(MergeError, match=said):
            parse_roundtrip(bad)
    with pytest.raises(MergeError, match="not a bitsandbytes 4-bit type"):
        MergeOptions(base="b", adapter="a", base_roundtrip="gptq")
    with pytest.raises(MergeError, match="not with a checkpoint"):
        MergeOptions(checkpoint="c", base_roundtrip="nf4")


def test_quantization_info_reads_every_kind():
    assert quantization_info({"model_type": "qwen2"}) is None
    assert quantization_info({"quantization_config": "nonsense"}) is None
    info = quantization_info({"quantization_config": {**BNB_NF4, "bnb_4bit_compute_dtype": "torch.bfloat16",
                                                      "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["visual"]}})
    assert (info.method, info.bits, info.quant_type, info.double_quant, info.blocksize) == ("bitsandbytes", 4, "nf4", True, 64)
    assert info.compute_dtype == "bfloat16" and info.quant_storage == "uint8" and info.skip_modules == ("visual",)
    assert info.can_roundtrip and info.flag_value() == "nf4:skip=visual"
    assert "4-bit NF4" in info.explanation and "16-bit" in info.explanation and info.explanation.endswith(".")
    fp4 = quantization_info({"quantization_config": {"load_in_4bit": True}})  # transformers' default type is fp4
    assert (fp4.method, fp4.quant_type, fp4.double_quant) == ("bitsandbytes", "fp4", False)
    assert fp4.flag_value() == "fp4:double_quant=no"
    int8 = quantization_info({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})
    assert int8.bits == 8 and not int8.can_roundtrip and "8-bit" in int8.explanation
    gptq = quantization_info({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}})
    assert (gptq.bits, gptq.blocksize) == (4, 128) and "GPTQ" in gptq.explanation and not gptq.can_roundtrip
    awq = quantization_info({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64}})
    assert (awq.bits, awq.blocksize) == (4, 64) and "AWQ" in awq.label.upper()
    other = quantization_info({"quantization_config": {"quant_method": "fp8"}})
    assert other.method == "fp8" and "fp8" in other.explanation


# -- which tensors, and the source ---------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {
        "qwen": save_base(root / "qwen", qwen_config(tie_word_embeddings=False), dtype=torch.bfloat16),
        "tied": save_base(root / "tied", qwen_config(), dtype=torch.float16),
        "gpt2": save_base(root / "gpt2", gpt2_config()),
    }


def test_the_source_round_trips_exactly_the_linear_weights(models, ref):
    base = open_model(models["qwen"])
    try:
        src = RoundTripSource(base, parse_roundtrip("nf4"), {"model_type": "qwen2"})
        linear = {n for n in base.tensors if n.endswith("proj.weight")}
        assert set(src.round_tripped) == linear and len(linear) == 14
        for name, r in src.tensors.items():
            if name in linear:
                assert r.source is src and src.raw_ranges(r) is None and src.row_blocks(r) is None
                w = base.tensors[name].load()
                assert same_bits(r.load(), slow_roundtrip(w, ref["nf4_code"], 64, True, ref["dynamic_map"]))
                out = torch.empty(r.shape)
                r.load_into(out)
                assert torch.equal(out, r.load().float())
                r.release()
            else:  # embeddings, lm_head, norms, biases: the base's own refs
                assert r is base.tensors[name]
        # transformers' modules_to_not_convert rule: from the start to a module boundary, or a suffix
        skipping = RoundTripSource(base, parse_roundtrip("nf4:skip=down_proj+layers.1.self_attn.q_proj+model.layers.0.mlp"))
        assert not any("down_proj" in n or "layers.0.mlp" in n for n in skipping.round_tripped)
        assert "model.layers.1.self_attn.q_proj.weight" not in skipping.round_tripped
        assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"} <= set(skipping.round_tripped)
        assert len(RoundTripSource(base, parse_roundtrip("nf4:skip=mlp.gate+mlp")).round_tripped) == 14  # neither matches
        described = src.describe()
        assert described["weights"] == "nf4 round trip" and described["tensors"] == 14 and described["double_quant"]
        with pytest.raises(MergeError, match="cannot be round-tripped"):
            RoundTripSource(base, quantization_info({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    finally:
        base.close()


def test_tied_embeddings_and_gpt2_conv1d(models, ref):
    base = open_model(models["tied"])
    try:
        src = RoundTripSource(base, parse_roundtrip("nf4"), {"model_type": "qwen2"})
        assert len(src.round_tripped) == 14
        assert "model.embed_tokens.weight" not in src.round_tripped and "lm_head.weight" not in src.round_tripped
    finally:
        base.close()
    base = open_model(models["gpt2"])
    try:
        src = RoundTripSource(base, parse_roundtrip("nf4:double_quant=no"), {"model_type": "gpt2"})
        assert src.transposed and len(src.round_tripped) == 8  # c_attn, c_proj, c_fc, mlp.c_proj x 2
        assert not any("wte" in n or "wpe" in n or "ln_" in n for n in src.round_tripped)
        name = "transformer.h.0.attn.c_attn.weight"  # stored [in, out]: transformers quantizes its transpose
        w = base.tensors[name].load()
        assert same_bits(src.tensors[name].load(), slow_roundtrip(w.T, ref["nf4_code"]).T.contiguous())
    finally:
        base.close()


# -- merging with --qlora-base ---------------------------------------------------------------------


def _lora(adapter: Path) -> dict:
    """module -> (A, B) of a peft adapter folder."""
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    pairs = {}
    for key, value in tensors.items():
        if ".lora_A." in key:
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            pairs[module] = (value, tensors[key.replace(".lora_A.", ".lora_B.")])
    return pairs


@pytest.mark.parametrize("case", ["qwen-bf16", "gpt2-fp32"])
def test_merge_into_the_round_trip(models, ref, tmp_path, case):
    gpt2 = case.startswith("gpt2")
    base = models["gpt2" if gpt2 else "qwen"]
    targets = ["c_attn", "c_fc"] if gpt2 else ["q_proj", "v_proj", "down_proj"]
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=targets, r=4, lora_alpha=6, fan_in_fan_out=gpt2)
    out = tmp_path / "out"
    options = MergeOptions(base=base, adapter=adapter, out=out, base_roundtrip="nf4")
    result = run_merge(options, fsync=False)
    manifest, report = finish_merge(options, result, fsync=False)
    assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, report.to_dict()
    assert manifest["base_weights"] == {
        "weights": "nf4 round trip", "quant_type": "nf4", "blocksize": 64, "double_quant": True,
        "skip_modules": [], "conv1d_transposed": gpt2, "tensors": 8 if gpt2 else 14,
    }
    assert manifest["options"]["base_roundtrip"] == "nf4"

    merged, stored = read_output(out), load_file(str(base / "model.safetensors"))
    lora, s = _lora(adapter), 6 / 4

    def rt(w):
        return slow_roundtrip(w.T, ref["nf4_code"], 64, True, ref["dynamic_map"]).T if gpt2 else slow_roundtrip(
            w, ref["nf4_code"], 64, True, ref["dynamic_map"])

    quantized = [n for n in stored if n.endswith(".weight") and stored[n].dim() == 2 and "wte" not in n
                 and "wpe" not in n and "embed" not in n and "lm_head" not in n]
    assert len(quantized) == (8 if gpt2 else 14)
    touched = 0
    for name, w in stored.items():
        module = name.removesuffix(".weight")
        if name in quantized:
            want = rt(w).float()
            key = next((m for m in lora if m.endswith(module.removeprefix("transformer."))), None)
            if key is not None:
                a, b = lora[key]
                delta = (b.float() @ a.float()) * s
                want = want + (delta.T if gpt2 else delta)
                touched += 1
            assert same_bits(merged[name], want.to(w.dtype)), name
        else:  # embeddings, lm_head, norms, biases: byte-identical
            assert same_bits(merged[name], w), name
    assert touched == (4 if gpt2 else 6)

    # the recompute check reads the round trip: against the plain base the same output is wrong
    plain = verify_merge(out, MergeOptions(base=base, adapter=adapter, out=out), behaviour=False)
    assert {c.name: c.status for c in plain.checks}["recompute"] == "fail"


def test_cli_flag_and_its_help(models, tmp_path, capsys):
    help_text = build_parser()._subparsers._group_actions[0].choices["merge"].format_help()  # noqa: SLF001
    assert "--qlora-base QUANT" in help_text and "dequant(quant(W))" in help_text
    base = models["qwen"]
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=["q_proj"])
    out = tmp_path / "out"
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out)]
    assert cli_main(args + ["--qlora-base", "int4", "--plain"]) == 1
    assert "--qlora-base 'int4' is not a bitsandbytes 4-bit type" in capsys.readouterr().err and not out.exists()
    assert cli_main(args + ["--qlora-base", "nf4:double_quant=no", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "INFO    The adapter is merged into 14 Linear weights" in text and "no double quantization" in text
    assert not out.exists()


# -- quantized bases: explained, refused, the 16-bit origin found ------------------------------------


def _copy(src: Path, dest: Path, **config_changes) -> Path:
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config_changes)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def save_packed(src: Path, dest: Path, **config_changes) -> Path:
    """A checkpoint laid out as bitsandbytes saves a 4-bit model: each Linear weight packed two values
    per uint8 byte ([n/2, 1]) beside its absmax, quant_map and quant_state tensors."""
    _copy(src, dest, **config_changes)
    tensors = load_file(str(dest / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        n = tensors[name].numel()
        tensors[name] = torch.zeros(n // 2, 1, dtype=torch.uint8)
        tensors[name + ".absmax"] = torch.ones(-(-n // 64))
        tensors[name + ".quant_map"] = torch.tensor(quant.NF4_CODE)
        tensors[name + ".quant_state.bitsandbytes__nf4"] = torch.zeros(160, dtype=torch.uint8)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def _findings(base, adapter, **kw) -> dict:
    return {f.id: f for f in make_plan(MergeOptions(base=base, adapter=adapter, **kw)).findings}


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return models["qwen"], save_adapter(root / "adapter", models["qwen"], target_modules=["q_proj", "v_proj"])


def test_a_quantized_base_is_explained_and_its_local_origin_named(pair, tmp_path, monkeypatch):
    base, adapter = pair
    assert "quantized" not in _findings(base, adapter)  # silent on a 16-bit base
    q = _copy(base, tmp_path / "q", quantization_config=BNB_NF4)
    f = _findings(q, adapter)["quantized"]
    assert f.severity == "error"
    assert f.message.startswith("The base model is quantized (bitsandbytes). It stores its weights in bitsandbytes 4-bit NF4")
    assert "16-bit" in f.fix and "--qlora-base nf4" in f.fix and "--base" not in f.fix  # nothing names its origin
    named = _copy(base, tmp_path / "named", quantization_config=BNB_NF4, _name_or_path=str(base))
    f = _findings(named, adapter)["quantized"]
    assert f.fix.startswith(f"Pass --base {base} (the 16-bit model it was made from, found locally).")
    remote = _copy(base, tmp_path / "remote", quantization_config=BNB_NF4, _name_or_path="Org/Missing-7B")
    assert "(Org/Missing-7B): download it and pass it as --base" in _findings(remote, adapter)["quantized"].fix
    # the Hugging Face cache: Org/Tiny-bnb-4bit was made from Org/Tiny (the name without its suffix)
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    plain = shutil.copytree(base, hub / "models--Org--Tiny" / "snapshots" / "abc")
    cached = _copy(base, hub / "models--Org--Tiny-bnb-4bit" / "snapshots" / "def", quantization_config=BNB_NF4)
    assert find_unquantized_base(json.loads((cached / "config.json").read_text()), cached) == plain
    assert f"Pass --base {plain} " in _findings(cached, adapter)["quantized"].fix
    alone = _copy(base, hub / "models--unsloth--Foo-bnb-4bit" / "snapshots" / "abc", quantization_config=BNB_NF4)
    assert "(unsloth/Foo): download it and pass it as --base" in _findings(alone, adapter)["quantized"].fix
    gptq = _copy(base, tmp_path / "gptq", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    f = _findings(gptq, adapter)["quantized"]
    assert "(gptq). It stores its weights as GPTQ 4-bit" in f.message and "--qlora-base" not in f.fix


def test_find_unquantized_base_by_card_and_sibling_and_not_a_wrong_one(pair, tmp_path):
    base, _ = pair
    sibling = shutil.copytree(base, tmp_path / "Tiny")
    q = _copy(base, tmp_path / "Tiny-4bit", quantization_config=BNB_NF4)
    assert find_unquantized_base(json.loads((q / "config.json").read_text()), q) == sibling
    carded = _copy(base, tmp_path / "carded", quantization_config=BNB_NF4)
    (carded / "README.md").write_text(f"---\nbase_model:\n  - {base}\nlibrary_name: transformers\n---\n# a card\n")
    assert find_unquantized_base(json.loads((carded / "config.json").read_text()), carded) == base
    quantized_origin = _copy(base, tmp_path / "also-quantized", quantization_config=BNB_NF4)
    cfg = {"_name_or_path": str(quantized_origin), "model_type": "qwen2"}
    assert find_unquantized_base(cfg, tmp_path / "x") is None  # its origin is quantized too
    assert find_unquantized_base({"_name_or_path": str(base), "model_type": "llama"}, tmp_path / "x") is None


def test_a_packed_checkpoint_is_refused_and_nothing_is_written(pair, tmp_path):
    base, adapter = pair
    packed = save_packed(base, tmp_path / "packed", quantization_config=BNB_NF4, _name_or_path=str(base))
    f = _findings(packed, adapter, out=tmp_path / "out")["inputs"]
    assert f.severity == "error" and "holds weights saved already quantized (bitsandbytes 4-bit" in f.message
    assert f"Pass --base {base} (the 16-bit model it was made from, found locally)." in f.message
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(MergeError, match="saved already quantized"):
        run_merge(MergeOptions(base=packed, adapter=adapter, out=out), fsync=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()
    bare = save_packed(base, tmp_path / "bare")  # no quantization_config at all: the tensors say it
    with pytest.raises(MergeError, match="saved already quantized"):
        run_merge(MergeOptions(base=bare, adapter=adapter, out=out), fsync=False)
    gptq = _copy(base, tmp_path / "gptq-packed")
    tensors = load_file(str(gptq / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(8, 64, dtype=torch.int32)
    save_file(tensors, str(gptq / "model.safetensors"))
    assert cli_main(["merge", "--base", str(gptq), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 1
    assert not out.exists()


def test_a_quantized_config_stops_the_cli_before_writing(pair, tmp_path, capsys):
    base, adapter = pair
    q = _copy(base, tmp_path / "q", quantization_config=BNB_NF4, _name_or_path=str(base))
    out = tmp_path / "out"
    assert cli_main(["merge", "--base", str(q), "--adapter", str(adapter), "--out", str(out), "--qlora-base", "nf4", "--plain"]) == 1
    err = capsys.readouterr().err
    assert "error: The base model is quantized (bitsandbytes)." in err and f"Pass --base {base}" in err
    assert not out.exists()


def test_an_adapter_trained_on_a_quantized_model_suggests_the_round_trip(pair, tmp_path, monkeypatch):
    base, adapter = pair
    f = _findings(base, adapter)
    assert not {"qlora", "qlora-base", "qlora-settings"} & set(f)  # a plain pair: silent
    a = shutil.copytree(adapter, tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "unsloth/tiny-bnb-4bit"}))
    f = _findings(base, a)["qlora"]  # not local: known by its name, QLoRA's defaults offered
    assert f.severity == "info" and "unsloth/tiny-bnb-4bit" in f.message and "16-bit weights" in f.message
    assert f.fix == "To merge into the rounded weights training saw instead, add --qlora-base nf4."
    # local: the quantized model's own settings
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    _copy(base, hub / "models--Org--Tiny-4bit" / "snapshots" / "abc",
          quantization_config={**BNB_NF4, "bnb_4bit_use_double_quant": False})
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "Org/Tiny-4bit"}))
    f = _findings(base, a)
    assert "--qlora-base nf4:double_quant=no" in f["qlora"].fix and "qlora-base" not in f
    # the flag given: said as info; settings that differ from the named model's: a warning
    f = _findings(base, a, base_roundtrip="nf4")
    assert f["qlora-base"].severity == "info" and "14 Linear weights" in f["qlora-base"].message and "qlora" not in f
    assert f["qlora-settings"].severity == "warning" and f["qlora-settings"].fix.startswith("Use --qlora-base nf4:double_quant=no")
    assert "qlora-settings" not in _findings(base, a, base_roundtrip="nf4:double_quant=no")
    # a GPTQ model named: merging into 16-bit weights is all there is; nothing to offer
    _copy(base, hub / "models--Org--Tiny-GPTQ" / "snapshots" / "abc", quantization_config={"quant_method": "gptq", "bits": 4})
    (a / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "Org/Tiny-GPTQ"}))
    assert "qlora" not in _findings(base, a)
    # nothing bitsandbytes would quantize: the flag does nothing, said as a warning
    f = _findings(base, adapter, base_roundtrip="nf4:skip=model")
    assert f["qlora-base"].severity == "warning" and "nothing is round-tripped" in f["qlora-base"].message


def test_quant_info_is_plain_data():
    info = QuantInfo("gptq", 4, None, 128, explanation="x")
    assert info.label == "gptq 4-bit, groups of 128" and info.to_dict()["blocksize"] == 128


def test_packed_kinds_from_names_and_dtypes():
    from types import SimpleNamespace

    from tui_merger.core.io.sources import TensorRef

    def source(**tensors):
        return SimpleNamespace(tensors={n: TensorRef(None, "f", n, d, (4, 4)) for n, d in tensors.items()})

    plain = {"model.layers.0.mlp.up_proj.weight": "bfloat16", "model.norm.weight": "bfloat16"}
    assert quant.packed_weights(source(**plain)) is None
    assert quant.packed_weights(source(**plain, **{"model.layers.0.mlp.up_proj.SCB": "float32"})) == "bitsandbytes 8-bit"
    fp8 = {"model.layers.0.mlp.up_proj.weight": "float8_e4m3fn", "model.layers.0.mlp.up_proj.weight_scale_inv": "float32"}
    assert quant.packed_weights(source(**fp8)) == "FP8/compressed-tensors"
    scaled = {**plain, "model.layers.0.mlp.up_proj.weight_scale": "float32"}  # a scale beside a 16-bit weight
    assert quant.packed_weights(source(**scaled)) is None
    assert quant.packed_weights(source(**{"model.layers.0.mlp.up_proj.weight": "int8"})) == "integer"
