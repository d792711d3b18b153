"""Bases released in NVFP4 (NVIDIA ModelOpt; compressed-tensors' nvfp4-pack-quantized) and with INT4
pack-quantized experts (Kimi-K2's format): every dequantized value equals compressed-tensors' own
decompressor's bit for bit; an adapter made by peft on those values merges as peft's merge_and_unload;
the bf16 output gives the unmerged logits and verifies PASSED; a merge dequantized with the nibbles
swapped or the global scale applied the wrong way fails verification; bad checkpoints are refused with
one sentence and nothing is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

import nvfp4_int4_factory as nf  # noqa: E402

from tui_merger.cli import main  # noqa: E402
from tui_merger.core.errors import MergeError  # noqa: E402
from tui_merger.core.formats.dequant import DequantSource, scheme_of  # noqa: E402
from tui_merger.core.io.sources import open_model  # noqa: E402
from tui_merger.core.verify.checks import verify_merge  # noqa: E402

QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, vocab_size=320, max_position_embeddings=64)
QWEN3_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2, num_experts=4,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
                 max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
PROBE = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(7))


def _reference_values(done: dict, kind: str) -> dict:
    """{weight name: compressed-tensors' dequantized value} of every quantized weight."""
    if kind == "int4":
        return {name: nf.int4_reference(parts) for name, parts in done.items()}
    return {name: nf.nvfp4_reference(parts, kind == "modelopt") for name, parts in done.items()}


def _build(root: Path, kind: str):
    """(base folder, reference dequantized folder, adapter made by peft on the reference, reference values)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = root / f"base-{kind}"
    if kind == "int4":
        done = nf.make_int4_experts_base(base, transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)))
        targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]  # the experts' per-expert Linear
    else:
        done = nf.make_nvfp4_base(base, transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)),
                                  modelopt=kind == "modelopt")
        targets = "all-linear"
    values = _reference_values(done, kind)
    ref = root / f"ref-{kind}"
    nf.write_reference(base, ref, values)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16)
    if kind == "int4":  # peft's target_parameters reach transformers 5's packed experts
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    else:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(root / f"adapter-{kind}")
    return base, ref, root / f"adapter-{kind}", values


KINDS = ["modelopt", "compressed-tensors", "int4"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp4int4")
    return {kind: _build(root, kind) for kind in KINDS}


def _source(base):
    config = json.loads((base / "config.json").read_text())
    return DequantSource(open_model(base), scheme_of(config), config)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_values_equal_compressed_tensors_bit_for_bit(kind, built):
    base, _, _, values = built[kind]
    source = _source(base)
    assert sorted(source.dequantized) == sorted(values)
    assert not any(n.endswith(("_packed", "_scale", "_scale_2", "_shape")) for n in source.tensors)
    for name, want in values.items():
        got = source.tensors[name].load()
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), name
        blocks = [b for b, release in source.row_blocks(source.tensors[name])]
        assert torch.equal(torch.cat(blocks), want), name
    if kind == "int4":
        assert len(values) == 2 * 4 * 3 and all(".experts." in n for n in values)


def _expected_merge(ref: Path, adapter: Path) -> dict:
    """peft's merge_and_unload in fp32 on the reference dequantized base, rounded once to bf16, under disk names."""
    import tempfile

    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    with tempfile.TemporaryDirectory() as tmp:
        merged.to(torch.bfloat16).save_pretrained(tmp)
        return read_output(Path(tmp))


def _unmerged_logits(ref: Path, adapter: Path):
    from peft import PeftModel

    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32),
                                      adapter).eval()
    with torch.no_grad():
        return model(PROBE).logits


@pytest.fixture(scope="module")
def merged(built, tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    outs = {}
    for kind in KINDS:
        base, _, adapter, _ = built[kind]
        out = root / kind
        code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
        assert code == 0, kind
        outs[kind] = out
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_merge_equals_peft_on_the_dequantized_base(kind, built, merged):
    base, ref, adapter, values = built[kind]
    out = merged[kind]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    got = read_output(out)
    assert not any(n.endswith(("_packed", "weight_scale", "_scale_2", "_shape", "input_scale")) for n in got)
    expected = _expected_merge(ref, adapter)
    assert set(got) == set(expected)
    changed = 0
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        torch.testing.assert_close(got[name].float(), want.float(), rtol=2 ** -8, atol=0, msg=name)
        if name in values and not torch.equal(got[name], values[name]):
            changed += 1
    assert changed >= (2 * 4 * 3 if kind == "int4" else 14)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(PROBE).logits
    unmerged = _unmerged_logits(ref, adapter)
    plain_base = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    with torch.no_grad():
        without = plain_base(PROBE).logits
    gap, moved = (logits - unmerged).abs().max().item(), (without - unmerged).abs().max().item()
    # the merged bf16 weights (one rounding) against the fp32 unmerged adapter; the adapter moved them much more
    assert gap < 0.05 * unmerged.abs().max().item() and gap < 0.2 * moved, (gap, moved)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["base_weights"]["weights"] == "dequantized as released"


def _swap_nibbles(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return (t >> 4) | ((t & 0x0F) << 4)
    b = t.contiguous().view(torch.uint8)
    return ((b >> 4) | ((b & 0x0F) << 4)).view(torch.int32)


@pytest.mark.parametrize("kind,wrong", [("modelopt", "nibbles"), ("modelopt", "global scale"),
                                        ("compressed-tensors", "nibbles"), ("int4", "nibbles")])
def test_a_wrongly_dequantized_merge_fails_verification(kind, wrong, built, merged, tmp_path):
    """The output with one weight built on the base dequantized wrongly (the nibbles of each byte swapped, or
    ModelOpt's weight_scale_2 used as compressed-tensors' global scale, i.e. divided by) FAILS."""
    base, _, _, values = built[kind]
    out = merged[kind]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    manifest = json.loads((bad / "merge_manifest.json").read_text())
    manifest["options"]["out"] = str(bad)
    (bad / "merge_manifest.json").write_text(json.dumps(manifest))
    stored = load_file(str(base / "model.safetensors"))
    name = sorted(values)[0]
    module = name[: -len(".weight")]
    parts = {k.rpartition(".")[2]: v for k, v in stored.items() if k.rpartition(".")[0] == module}
    if kind == "int4":
        parts["weight_packed"] = _swap_nibbles(parts["weight_packed"])
        wrong_value = nf.int4_reference(parts)
    elif wrong == "nibbles":
        key = "weight" if kind == "modelopt" else "weight_packed"
        parts[key] = _swap_nibbles(parts[key])
        wrong_value = nf.nvfp4_reference(parts, kind == "modelopt")
    else:
        ct = {"weight_packed": parts["weight"], "weight_scale": parts["weight_scale"],
              "weight_global_scale": parts["weight_scale_2"].reshape(1)}
        wrong_value = nf.nvfp4_reference(ct, False)
    assert not torch.equal(wrong_value, values[name])
    for path in bad.glob("*.safetensors"):
        tensors = load_file(str(path))
        if name in tensors:
            tensors[name] = (tensors[name].float() - values[name].float() + wrong_value.float()).to(torch.bfloat16)
            save_file(tensors, str(path), metadata={"format": "pt"})
    report = verify_merge(bad, behaviour=False)
    assert not report.passed
    assert {c.name: c.status for c in report.checks}["recompute"] == "fail"


@pytest.mark.parametrize("kind,label", [
    ("modelopt", "NVFP4 (e2m1, e4m3 scale per 16 values, fp32 global scale; ModelOpt), as released (14 weights)"),
    ("compressed-tensors", "NVFP4 (e2m1, e4m3 scale per 16 values, fp32 global scale; compressed-tensors), as released"),
    ("int4", "INT4 pack-quantized (symmetric 4-bit integers, 8 per int32, a scale per 32 values), as released (24 weights)"),
])
def test_dry_run_and_inspect_say_what_the_base_is(kind, label, built, tmp_path, capsys):
    base, _, adapter, _ = built[kind]
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dry-run"])
    plan = capsys.readouterr().out
    assert code == 0, plan
    assert f"base is    {label}" in plan, plan
    assert "output is  bfloat16, a plain model (quantization_config removed)" in plan
    assert main(["inspect", str(base)]) == 0
    said = capsys.readouterr().out
    assert label.split(", as released")[0] + ", as released" in said, said


def test_keep_quantization_is_refused_in_one_sentence(built, tmp_path, capsys):
    base, _, adapter, _ = built["modelopt"]
    out = tmp_path / "kept"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--keep-quantization", "--plain"])
    said = capsys.readouterr()
    assert code != 0
    assert "cannot write NVFP4 again yet" in said.out + said.err
    assert not out.exists()


def _broken_copy(base: Path, tmp_path: Path, change) -> Path:
    bad = tmp_path / "broken"
    shutil.copytree(base, bad)
    path = bad / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return bad


@pytest.mark.parametrize("kind,change,said", [
    ("modelopt", lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale":
                                     t["model.layers.0.self_attn.q_proj.weight_scale"].to(torch.bfloat16)}),
     "model.layers.0.self_attn.q_proj.weight_scale is stored in bfloat16; NVFP4 scales are float8_e4m3fn"),
    ("compressed-tensors", lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_global_scale":
                                               t["model.layers.0.self_attn.q_proj.weight_global_scale"].half()}),
     "model.layers.0.self_attn.q_proj.weight_global_scale is float16 [1]; the NVFP4 global scale is one float32 value"),
    ("modelopt", lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:, :16].contiguous()}),
     "model.layers.0.mlp.up_proj.weight_scale has shape [128, 4] but model.layers.0.mlp.up_proj.weight [128, 16]"),
    ("modelopt", lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:, :16].contiguous(),
                                     "model.layers.0.mlp.up_proj.weight_scale":
                                         t["model.layers.0.mlp.up_proj.weight_scale"][:, :2].contiguous()}),
     "model.layers.0.mlp.up_proj.weight is uint8 [128, 16], the packed values of a [128, 32] weight, but the model "
     "config.json describes has model.layers.0.mlp.up_proj.weight of shape [128, 64]"),
    ("int4", lambda t: t.update({"model.layers.1.mlp.experts.2.down_proj.weight_shape": torch.tensor([64, 256])}),
     "model.layers.1.mlp.experts.2.down_proj.weight_packed has shape [64, 8] but its weight_shape says 64x256 values"),
    ("int4", lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.weight_scale":
                                 t["model.layers.0.mlp.experts.0.up_proj.weight_scale"].to(torch.float8_e4m3fn)}),
     "model.layers.0.mlp.experts.0.up_proj.weight_scale is stored in float8_e4m3fn; pack-quantized scales are"),
])
def test_bad_input_is_one_sentence_and_nothing_is_written(kind, change, said, built, tmp_path, capsys):
    base, _, adapter, _ = built[kind]
    bad = _broken_copy(base, tmp_path, change)
    with pytest.raises(MergeError) as err:
        _source(bad)
    assert said in str(err.value) and str(err.value).endswith("Nothing was written.")
    out = tmp_path / "out"
    code = main(["merge", "--base", str(bad), "--adapter", str(adapter), "--out", str(out), "--plain"])
    text = capsys.readouterr()
    assert code != 0 and said in text.out + text.err
    assert not out.exists()


# -- experts stacked in one tensor ---------------------------------------------------------------------------

GRANITE_MOE = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=320, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64)


@pytest.fixture(scope="module")
def built3d(tmp_path_factory):
    """{flavour: (base, reference folder, adapter, reference values)} of a GraniteMoE whose experts are NVFP4
    stacked in one tensor ([experts, rows, cols/2]), LoRA by peft on attention and on the packed experts."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("nvfp4-3d")
    out = {}
    for kind in ("modelopt", "compressed-tensors"):
        torch.manual_seed(0)
        base = root / f"base-{kind}"
        done = nf.make_nvfp4_experts_base(base, transformers.GraniteMoeForCausalLM(transformers.GraniteMoeConfig(
            **GRANITE_MOE)), modelopt=kind == "modelopt")
        values = {name: (nf.nvfp4_reference_experts(parts, kind == "modelopt") if parts["weight_scale"].dim() == 3
                         else nf.nvfp4_reference(parts, kind == "modelopt")) for name, parts in done.items()}
        ref = root / f"ref-{kind}"
        nf.write_reference(base, ref, values)
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
        lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
                          target_parameters=["block_sparse_moe.experts.gate_up_proj",
                                             "block_sparse_moe.experts.down_proj"])
        get_peft_model(model, lora).save_pretrained(root / f"adapter-{kind}")
        out[kind] = (base, ref, root / f"adapter-{kind}", values)
    return out


@pytest.mark.parametrize("kind", ["modelopt", "compressed-tensors"])
def test_experts_stacked_in_one_tensor_read_merge_and_verify(kind, built3d, tmp_path):
    """Every expert of the 3-D NVFP4 tensors equals compressed-tensors' decompressor on that expert bit for bit
    (ModelOpt's through its converter); the merge equals peft's on the dequantized base and verifies PASSED."""
    base, ref, adapter, values = built3d[kind]
    source = _source(base)
    packed = [n for n in values if ".block_sparse_moe." in n]
    assert len(packed) == 4 and all(tuple(source.tensors[n].shape) == tuple(values[n].shape) for n in packed)
    assert all(values[n].dim() == 3 for n in packed)
    for name, want in values.items():
        assert torch.equal(source.tensors[name].load(), want), name
    for name in packed:
        assert torch.equal(source.load_experts(source.tensors[name], 1, 3), values[name][1:3]), name
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    assert code == 0
    got, expected = read_output(out), _expected_merge(ref, adapter)
    assert set(got) == set(expected)
    for name, want in expected.items():
        torch.testing.assert_close(got[name].float(), want.float(), rtol=2 ** -8, atol=0, msg=name)
    assert sum(not torch.equal(got[n], values[n]) for n in packed) == 4
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_a_per_expert_global_scale_of_the_wrong_count_is_one_sentence(built3d, tmp_path):
    base, _, _, _ = built3d["modelopt"]
    name = "model.layers.0.block_sparse_moe.input_linear.weight_scale_2"
    bad = _broken_copy(base, tmp_path, lambda t: t.update({name: t[name][:3].contiguous()}))
    with pytest.raises(MergeError) as err:
        _source(bad)
    assert str(err.value).startswith(f"{name} is float32 [3]; the NVFP4 global scale is one float32 value (or one "
                                      "per expert, [4])"), str(err.value)


# -- the checks dequantize with compressed-tensors, not with the merge's code ----------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_merge_whose_dequantizer_is_wrong_fails_verification(kind, built, tmp_path, monkeypatch, capsys):
    """The merge's own NVFP4 / INT4 dequantizer made wrong (the nibbles of each byte swapped): the recompute and
    the behaviour reference read the base through compressed-tensors' decompressors (verify/dequant_ref.py),
    so the merge FAILS verification (it passed when the checks read the base through the merge's own view)."""
    from tui_merger.core.formats import dequant_int4, dequant_nvfp4

    base, _, adapter, _ = built[kind]
    if kind == "int4":
        right = dequant_int4.dequantize
        monkeypatch.setattr(dequant_int4, "dequantize",
                            lambda packed, *a, **k: right(_swap_nibbles(packed.contiguous()), *a, **k))
    else:
        right = dequant_nvfp4.dequantize
        monkeypatch.setattr(dequant_nvfp4, "dequantize",
                            lambda packed, *a, **k: right(_swap_nibbles(packed.contiguous()), *a, **k))
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 4, said.out + said.err
    checks = verification_checks(out)
    assert checks["recompute"] == "fail", checks


def test_the_checks_read_packed_bases_through_compressed_tensors_and_the_definitions_agree(built, built3d):
    """``independent_base`` of an NVFP4 / INT4 view is compressed-tensors' decompressors; the definitions written
    in dequant_ref for a machine without the package give the same values bit for bit."""
    from tui_merger.core.verify import dequant_ref

    cases = [(built[k][0], built[k][3]) for k in KINDS] + [(built3d[k][0], built3d[k][3]) for k in built3d]
    for base, values in cases:
        source = _source(base)
        checked = dequant_ref.independent_base(source)
        assert isinstance(checked, dequant_ref.IndependentPacked)
        for name, want in values.items():
            assert torch.equal(checked.tensors[name].load(), want), name
        for ref in checked.tensors.values():
            if ref.source is not checked:
                continue
            v, s, t, cols = source._parts[(ref.file, ref.name)]
            v, s, t = v.load(), s.load(), t.load()
            if source.scheme.method == "int4":
                got = dequant_ref.int4_by_definition(v, s, (v.shape[0], cols), source.scheme.block[1])
            elif v.dim() == 3:
                continue  # expert by expert: the same 2-D definition
            else:
                got = dequant_ref.nvfp4_by_definition(v, s, t, source.scheme.strategy == "modelopt")
            assert torch.equal(got.to(torch.bfloat16), checked.load(ref)), ref.name


# -- ModelOpt releases with only hf_quant_config.json -----------------------------------------------------------

HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": ["lm_head"]}}


def test_a_modelopt_release_with_only_hf_quant_config_is_read(built, merged, tmp_path, capsys):
    """ModelOpt's own file beside config.json (what its export wrote before it also wrote a quantization_config
    into config.json): recognised as NVFP4, merged into the same values as with the quantization_config, said by
    inspect; the output carries neither file's quantization and says nothing was removed from config.json."""
    base, _, adapter, _ = built["modelopt"]
    only = tmp_path / "only-hf-quant-config"
    shutil.copytree(base, only)
    config = json.loads((only / "config.json").read_text())
    config.pop("quantization_config")
    (only / "config.json").write_text(json.dumps(config))
    (only / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    assert main(["inspect", str(only)]) == 0
    said = capsys.readouterr().out
    assert "NVFP4 (e2m1, e4m3 scale per 16 values, fp32 global scale; ModelOpt), as released" in said, said
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(only), "--adapter", str(adapter), "--out", str(out), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "quantization_config removed" not in plan and "without the base's hf_quant_config.json" in plan, plan
    code = main(["merge", "--base", str(only), "--adapter", str(adapter), "--out", str(out), "--plain"])
    text = capsys.readouterr()
    assert code == 0, text.out + text.err
    assert "quantization_config removed" not in text.out
    got, want = read_output(out), read_output(merged["modelopt"])
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert not (out / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    (only / "hf_quant_config.json").write_text(json.dumps({**HF_QUANT_CONFIG, "producer": {"name": "other"}}))
    code = main(["merge", "--base", str(only), "--adapter", str(adapter), "--out", str(tmp_path / "m2"), "--plain"])
    text = capsys.readouterr()
    assert code != 0 and "holds weights saved already quantized" in text.out + text.err  # not ModelOpt's: refused
