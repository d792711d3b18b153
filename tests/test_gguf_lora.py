"""A peft LoRA as a GGUF adapter (ship/gguf_lora.py, issue 40): the file as llama.cpp's
convert_lora_to_gguf.py lays it out, read back with gguf's own GGUFReader, against peft.

The reference is peft's merge_and_unload: the delta it adds to each weight must equal what llama.cpp
adds from the file (adapter.lora.alpha / r * lora_b @ lora_a), in llama.cpp's row order (Llama's q/k
permuted for its rope, written here from convert_hf_to_gguf's definition), under the name gguf's
TensorNameMap gives the weight. llama.cpp itself (base GGUF + this adapter against the merged model's
GGUF) runs outside CI: benchmarks/llama_cpp_lora_check.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from test_gguf import config_of, make_model  # noqa: F401
from tui_merger.core.errors import MergeError
from tui_merger.core.ship.gguf_lora import default_lora_out, export_lora_gguf


def make_adapter(base: Path, out: Path, seed=0, **lora) -> tuple[Path, dict]:
    """A peft LoRA on ``base`` with random A and B, saved; and peft's merged weights (the reference delta)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kw = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(model, LoraConfig(**{**kw, **lora}))
    peft_model.save_pretrained(out)
    merged = peft_model.merge_and_unload().state_dict()
    return out, {k: merged[k] - before[k] for k in before if k.endswith(".weight") and not torch.equal(merged[k], before[k])}


def read_lora(path: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {}
    for name, f in reader.fields.items():
        if name.startswith(("general.", "adapter.")):
            v = f.parts[f.data[0]]
            fields[name] = bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v[0].item()
    tensors = {t.name: (torch.from_numpy(t.data.copy()), t.tensor_type) for t in reader.tensors}
    return fields, tensors


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: rows reshaped (n_head, 2, rows/n_head/2) and the two middle axes swapped."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(arch_name: str, layers: int, modules) -> dict:
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    names = gguf.get_tensor_name_map(arch, layers)
    return {m: names.get_name(m.removesuffix(".weight")) + ".weight" for m in modules}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-bases")
    return {"llama": make_model(root / "llama-base", "llama", seed=2), "qwen2": make_model(root / "qwen2-base", "qwen2", seed=2)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_gguf_lora_adds_what_peft_merges(bases, tmp_path, family):
    adapter, delta = make_adapter(bases[family], tmp_path / f"{family}-lora")
    result = export_lora_gguf(bases[family], adapter)
    assert result.path == default_lora_out(adapter) == adapter / f"{family}-lora-LoRA-F32.gguf"
    fields, tensors = read_lora(result.path)
    arch = "llama" if family == "llama" else "qwen2"
    assert fields["general.architecture"] == arch and fields["general.type"] == "adapter"
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == 8.0
    config = config_of(family)
    names = gguf_names(arch, config.num_hidden_layers, delta)
    assert {n + s for n in names.values() for s in (".lora_a", ".lora_b")} == set(tensors)
    assert len(delta) == 7 * config.num_hidden_layers == result.pairs and result.rescaled == 0
    for hf, want in delta.items():
        (a, ta), (b, tb) = tensors[names[hf] + ".lora_a"], tensors[names[hf] + ".lora_b"]
        assert ta == tb == 0  # F32
        got = fields["adapter.lora.alpha"] / a.shape[0] * (b @ a)  # what llama.cpp adds
        if family == "llama" and ".q_proj." in hf:
            want = llama_permute(want, config.num_attention_heads)
        elif family == "llama" and ".k_proj." in hf:
            want = llama_permute(want, config.num_key_value_heads)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=hf)


def test_rslora_and_a_rank_pattern_are_rescaled_into_lora_b(bases, tmp_path):
    """peft's scale alpha / sqrt(r), and another rank for the v projections: llama.cpp's alpha / r times
    the rescaled lora_b gives peft's delta."""
    adapter, delta = make_adapter(bases["qwen2"], tmp_path / "rs", use_rslora=True, rank_pattern={"v_proj": 2})
    result = export_lora_gguf(bases["qwen2"], adapter)
    fields, tensors = read_lora(result.path)
    assert result.rescaled == result.pairs and result.ranks == (2, 4) and fields["adapter.lora.alpha"] == 8.0
    names = gguf_names("qwen2", config_of("qwen2").num_hidden_layers, delta)
    for hf, want in delta.items():
        a, b = tensors[names[hf] + ".lora_a"][0], tensors[names[hf] + ".lora_b"][0]
        assert a.shape[0] == (2 if ".v_proj." in hf else 4)
        torch.testing.assert_close(8.0 / a.shape[0] * (b @ a), want, rtol=1e-5, atol=1e-6, msg=hf)


def test_what_a_gguf_lora_cannot_carry_is_refused_and_nothing_written(bases, tmp_path):
    base = bases["qwen2"]
    dora, _ = make_adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(MergeError, match="DoRA adapter; a GGUF LoRA has no magnitude vector"):
        export_lora_gguf(base, dora)
    saved, _ = make_adapter(base, tmp_path / "saved", target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(MergeError, match="whole trained modules .*merge the adapter"):
        export_lora_gguf(base, saved)
    other = make_model(tmp_path / "other", "qwen2", seed=3, hidden_size=96, intermediate_size=160)
    with pytest.raises(MergeError, match="another model"):
        export_lora_gguf(other, make_adapter(base, tmp_path / "for-base", target_modules=["q_proj"])[0])
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.tmp*"))


def test_a_lora_on_a_tied_head_is_refused(tmp_path):
    base = make_model(tmp_path / "tied", "qwen2", seed=4, tie_word_embeddings=True)
    adapter, _ = make_adapter(base, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(MergeError, match="ties to its embedding; llama.cpp ignores such a LoRA"):
        export_lora_gguf(base, adapter)
    assert not (adapter / "head-LoRA-F32.gguf").exists()


def test_cli_writes_the_lora_the_base_and_a_modelfile_with_adapter(bases, tmp_path, capsys):
    from tui_merger.cli import main

    base = shutil.copytree(bases["llama"], tmp_path / "llama-base")
    adapter, _ = make_adapter(base, tmp_path / "my-lora", target_modules=["q_proj", "v_proj"])
    assert main(["gguf", str(base), "--adapter", str(adapter), "--type", "f16", "--check", "none", "--plain"]) == 0
    out, _ = capsys.readouterr()
    lora, base_gguf = adapter / "my-lora-LoRA-F32.gguf", base / "llama-base-F16.gguf"
    modelfile = adapter / "my-lora-LoRA-F32.Modelfile"
    assert f"GGUF LoRA written to {lora}\n" in out and f"Base GGUF written to {base_gguf}\n" in out
    assert "4 LoRA pairs (rank 4, alpha 8)" in out
    lines = modelfile.read_text().splitlines()
    assert f"FROM {base_gguf}" in lines and "ADAPTER ./my-lora-LoRA-F32.gguf" in lines
    assert any(line.startswith('TEMPLATE """') for line in lines)  # the base's Llama 3 chat template
    assert f"  ollama create my-lora:f16 -f {modelfile}\n" in out and f"  llama-cli -m {base_gguf} --lora {lora}\n" in out
    # again, for another adapter: the base's GGUF is there and used as it is
    other, _ = make_adapter(base, tmp_path / "other-lora", seed=1, target_modules=["k_proj"])
    stamp = base_gguf.stat().st_mtime_ns
    assert main(["gguf", str(base), "--adapter", str(other), "--type", "q8_0", "--out", str(base_gguf), "--check", "none", "--plain"]) == 0
    out, _ = capsys.readouterr()
    assert f"Base GGUF {base_gguf} is already there: used as it is (--overwrite writes it again)." in out
    assert "  ollama create other-lora:f16 -f" in out  # the tag says the GGUF's own type, not --type's
    assert base_gguf.stat().st_mtime_ns == stamp and (other / "other-lora-LoRA-F32.Modelfile").is_file()
    # an adapter saved with its own tokenizer (a chat template set for training): the Modelfile follows it
    from test_gguf import byte_level_tokenizer
    from tui_merger.core.ship.modelfile import GO_TEMPLATES

    chatml, _ = make_adapter(base, tmp_path / "chatml-lora", seed=2, target_modules=["o_proj"])
    byte_level_tokenizer("qwen").save_pretrained(chatml)  # ChatML, where the base's is Llama 3's
    assert main(["gguf", str(base), "--adapter", str(chatml), "--type", "f16", "--check", "none", "--plain"]) == 0
    text = (chatml / "chatml-lora-LoRA-F32.Modelfile").read_text()
    assert f'TEMPLATE """{GO_TEMPLATES["chatml"]}"""' in text and GO_TEMPLATES["llama3"] not in text


def test_a_lora_llama_cpp_would_not_apply_is_refused(tmp_path):
    """DeepSeek-V2's MLA: llama.cpp multiplies q and kv_a without their LoRA (measured: a LoRA there changes
    no logit), so such a file would run as if untrained; a LoRA on o_proj is written."""
    from test_gguf_families import make_family

    base = make_family(tmp_path / "dsv2", "deepseek_v2")
    adapter, _ = make_adapter(base, tmp_path / "q", target_modules=["o_proj", "kv_a_proj_with_mqa"])
    with pytest.raises(MergeError, match="deepseek2 graph does not apply a LoRA to attn_kv_a_mqa"):
        export_lora_gguf(base, adapter)
    assert not list(adapter.glob("*.gguf"))
    fine, _ = make_adapter(base, tmp_path / "o", target_modules=["o_proj"])
    assert export_lora_gguf(base, fine).pairs == 2


# -- experts (issue 40): peft's pairs on packed experts and per-expert Linear pairs, stacked as llama.cpp stacks them


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _weights(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(_safetensors(f))
    return out


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    from test_gguf_families import make_family

    return make_family(tmp_path_factory.mktemp("moe") / "qwen3-moe-base", "qwen3_moe", seed=5)


EXPERT_KINDS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def test_a_lora_on_packed_experts_and_the_router_is_stacked_per_expert_as_peft_merges_it(moe_base, tmp_path):
    """peft target_parameters on Qwen3-MoE's packed gate_up_proj / down_proj and its router: lora_a
    [experts, r, in] and lora_b [experts, out, r] per layer and kind, expert e's pair at index e. What
    llama.cpp adds for expert e (alpha / r * lora_b[e] @ lora_a[e]) is what peft's merge_and_unload changes
    in that expert's tensor as save_pretrained writes it; lora_a[e] is rows e*r.. of peft's saved lora_A."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(moe_base, dtype=torch.float32)
    params = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=params,
                                                  init_lora_weights=False))
    adapter = tmp_path / "experts-lora"
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    result = export_lora_gguf(moe_base, adapter)
    fields, tensors = read_lora(result.path)
    config = AutoConfig.from_pretrained(moe_base)
    layers, experts = config.num_hidden_layers, config.num_experts
    assert result.experts == 3 * layers and result.pairs == 5 * layers and result.ranks == (4,)
    base, merged = _weights(moe_base), _weights(tmp_path / "merged")
    alpha = fields["adapter.lora.alpha"]
    for layer in range(layers):
        for hf, kind in EXPERT_KINDS.items():
            a, b = tensors[f"blk.{layer}.{kind}.weight.lora_a"][0], tensors[f"blk.{layer}.{kind}.weight.lora_b"][0]
            assert a.shape[:2] == b.shape[:1] + b.shape[2:] == (experts, 4), (kind, a.shape, b.shape)
            for e in range(experts):
                name = f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"
                torch.testing.assert_close(alpha / 4 * (b[e] @ a[e]), merged[name] - base[name], rtol=1e-4, atol=1e-6, msg=name)
        a, b = tensors[f"blk.{layer}.ffn_gate_inp.weight.lora_a"][0], tensors[f"blk.{layer}.ffn_gate_inp.weight.lora_b"][0]
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert a.dim() == 2 and b.shape == (experts, 4)
        torch.testing.assert_close(alpha / 4 * (b @ a), merged[name] - base[name], rtol=1e-4, atol=1e-6, msg=name)
    # the raw values, read from peft's own file: down_proj's lora_A reads moe_intermediate_size columns
    saved = _safetensors(adapter / "adapter_model.safetensors")
    down_a = next(v for k, v in saved.items() if ".layers.0.mlp.experts." in k and "lora_A" in k
                  and v.shape[1] == config.moe_intermediate_size)
    a = tensors["blk.0.ffn_down_exps.weight.lora_a"][0]
    for e in range(experts):
        torch.testing.assert_close(a[e], down_a[e * 4:(e + 1) * 4], rtol=0, atol=0)


def test_per_expert_linear_loras_are_stacked_and_an_expert_without_one_is_zero(moe_base, tmp_path):
    """An adapter saved the way peft saves one per expert Linear (``experts.3.gate_proj.lora_A``, as models
    whose experts were nn.Linear modules and Megatron-Bridge's exports have it), written here with
    safetensors: each expert's pair lands at its index of the stacked tensor as saved, an expert the
    adapter does not train gets zeros, and a rank pattern's other rank is padded with zeros and rescaled."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(moe_base)
    hidden, inter, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts
    torch.manual_seed(1)
    saved, want = {}, {}
    for e in (0, 1, 3):  # expert 2 has no LoRA
        r = 2 if e == 3 else 4  # rank_pattern: expert 3's gate_proj at r 2
        a, b = torch.randn(r, hidden), torch.randn(inter, r)
        prefix = f"base_model.model.model.layers.1.mlp.experts.{e}.gate_proj"
        saved[f"{prefix}.lora_A.weight"], saved[f"{prefix}.lora_B.weight"] = a, b
        want[e] = (a, b, 8 / r)
    adapter = tmp_path / "per-expert"
    adapter.mkdir()
    save_file(saved, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"], "task_type": "CAUSAL_LM",
        "rank_pattern": {"model.layers.1.mlp.experts.3.gate_proj": 2}}))
    result = export_lora_gguf(moe_base, adapter)
    fields, tensors = read_lora(result.path)
    assert result.pairs == result.experts == 1 and result.rescaled == 1
    assert set(tensors) == {"blk.1.ffn_gate_exps.weight.lora_a", "blk.1.ffn_gate_exps.weight.lora_b"}
    a, b = tensors["blk.1.ffn_gate_exps.weight.lora_a"][0], tensors["blk.1.ffn_gate_exps.weight.lora_b"][0]
    assert a.shape == (experts, 4, hidden) and b.shape == (experts, inter, 4)
    assert not a[2].any() and not b[2].any()
    for e, (ea, eb, scale) in want.items():
        torch.testing.assert_close(fields["adapter.lora.alpha"] / 4 * (b[e] @ a[e]), scale * (eb @ ea), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[0], want[0][0], rtol=0, atol=0)
    assert not a[3][2:].any() and not b[3][:, 2:].any()  # rank 2 padded to 4 with zeros


def test_a_lora_on_a_tensor_llama_cpp_computes_from_it_is_refused(tmp_path):
    """DeepSeek's MLA kv_b_proj: llama.cpp stores k_b / v_b computed from it, so no pair of lora_a / lora_b
    says its LoRA; one sentence, nothing written."""
    from test_gguf_families import make_family

    base = make_family(tmp_path / "dsv2", "deepseek_v2")
    adapter, _ = make_adapter(base, tmp_path / "kvb", target_modules=["kv_b_proj"])
    with pytest.raises(MergeError, match=r"llama.cpp's layout stores as blk\.\d\.attn_k_b\.weight computed from it"):
        export_lora_gguf(base, adapter)
    assert not list(adapter.glob("*.gguf")) and not list(adapter.glob(".*tmp*"))


# -- the check and its record


def _with_manifest(folder: Path) -> Path:
    from tui_merger.core.record.manifest import FORMAT, write_manifest

    write_manifest(folder, {"format": FORMAT, "merged_at": "2026-12-04T20:00:00+00:00", "kind": "merge", "inputs": [],
                            "outputs": [], "base_model": None}, fsync=False)
    return folder


def test_without_llama_cpp_the_lora_is_recorded_as_not_checked(bases, tmp_path, capsys):
    """CI has no llama.cpp, and only llama.cpp applies a GGUF LoRA: the command says the file was not
    checked, and so do the manifest (gguf_lora) and the model card; with transformers' reader asked for,
    the same."""
    from tui_merger.cli import main
    from tui_merger.core.ship.gguf_check import llama_cpp_version

    base = _with_manifest(shutil.copytree(bases["qwen2"], tmp_path / "base"))
    adapter, _ = make_adapter(base, tmp_path / "my-lora", target_modules=["q_proj", "v_proj"])
    for check in (["--check", "transformers"], [] if llama_cpp_version() is None else None):
        if check is None:
            continue
        assert main(["gguf", str(base), "--adapter", str(adapter), "--type", "f16", "--plain", "--overwrite", *check]) == 0
        out, _ = capsys.readouterr()
        said = ("transformers' GGUF reader cannot apply a GGUF LoRA" if check else
                "llama.cpp's Python binding (llama_cpp) is not installed here, and only llama.cpp applies a GGUF LoRA")
        assert f"  LoRA check not checked: {said}" in out, out
        assert f"  LoRA and its check recorded in {base / 'merge_manifest.json'}" in out
        (entry,) = json.loads((base / "merge_manifest.json").read_text())["gguf_lora"]
        assert entry["path"] == str(adapter / "my-lora-LoRA-F32.gguf") and entry["base_gguf"] == "base-F16.gguf"
        assert entry["check"]["status"] == "not checked" and entry["check"]["reader"] is None
        assert entry["pairs"] == 4 and entry["ranks"] == [4] and entry["modelfile"].endswith("my-lora-LoRA-F32.Modelfile")
        card = (base / "README.md").read_text()
        line = next(x for x in card.splitlines() if "my-lora-LoRA-F32.gguf" in x)
        assert "a LoRA of the adapter `my-lora` for `base-F16.gguf`" in line and f"Check not checked: {said}" in line
        assert "PASSED" not in line and "FAILED" not in line


def test_a_lora_is_never_called_checked_without_a_check(bases, tmp_path, capsys):
    """--check none: "not checked: skipped"; a base without a manifest: nothing recorded, said; and a
    manifest entry whose check is missing or was not made reads "not checked" on the card, never PASSED."""
    from tui_merger.cli import main
    from tui_merger.core.record.card import render_model_card
    from tui_merger.core.ship.gguf_check import check_lora_gguf

    base = shutil.copytree(bases["qwen2"], tmp_path / "plain-base")
    adapter, _ = make_adapter(base, tmp_path / "a", target_modules=["o_proj"])
    assert main(["gguf", str(base), "--adapter", str(adapter), "--type", "f16", "--plain", "--check", "none"]) == 0
    out, _ = capsys.readouterr()
    assert "  LoRA check not checked: skipped (--check none).\n" in out
    lora, base_gguf = adapter / "a-LoRA-F32.gguf", base / "plain-base-F16.gguf"
    # a base without a manifest (a Hub download) is left as it is: the record goes beside the LoRA, and says so
    record = adapter / "a-LoRA-F32.json"
    assert (f"  LoRA and its check recorded in {record} ({base} has no merge_manifest.json: it was not made by "
            "tui-merger, so neither it nor its model card is changed)\n") in out
    assert not (base / "merge_manifest.json").exists() and not (base / "README.md").exists()
    saved = json.loads(record.read_text())
    assert saved["format"] == "tui-merger-gguf-lora/1" and saved["base"] == str(base) and saved["not_in_manifest"]
    assert saved["path"] == "a-LoRA-F32.gguf" and saved["base_gguf"] == str(base_gguf) and saved["modelfile"] == "a-LoRA-F32.Modelfile"
    assert saved["size"] == lora.stat().st_size and saved["pairs"] == 2 and saved["ranks"] == [4] and saved["alpha"] == 8.0
    import hashlib

    assert saved["sha256"] == hashlib.sha256(lora.read_bytes()).hexdigest()
    assert saved["check"]["status"] == "not checked" and saved["check"]["reader"] is None
    assert not list(adapter.glob(".*tmp*"))
    check = check_lora_gguf(base, adapter, base_gguf, lora, reader="transformers")
    assert check.status == "not checked" and check.reader is None and not check.passed
    for recorded in ({}, {"check": {"status": "not checked", "summary": "x"}}, {"check": {"status": "maybe"}}):
        card = render_model_card({"format": "tui-merger-manifest/1", "kind": "merge", "merged_at": "now", "out": "/x",
                                  "gguf_lora": [{"path": "a-LoRA-F32.gguf", "size": 1, "sha256": "0", **recorded}]})
        line = next(x for x in card.splitlines() if "a-LoRA-F32.gguf" in x)
        assert "Check not checked" in line and "PASSED" not in line


def test_the_base_gguf_type_is_read_from_its_header(bases, tmp_path):
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import LIMITS, gguf_type_of

    for type_ in ("f16", "q8_0"):
        path = export_gguf(bases["qwen2"], type_, tmp_path / f"b-{type_}.gguf").path
        assert gguf_type_of(path) == type_ and type_ in LIMITS


def test_an_expert_lora_in_peft_018s_layout_is_written_as_peft_018_merged_it(tmp_path):
    """peft 0.18.1 saved packed-expert LoRA the other way round (lora_A reads dim 1: the delta of expert e
    is (B_e @ A_e).T), told apart by the adapter's peft_version (tests/fixtures/peft018, made by peft 0.18.1
    itself): llama.cpp's stacked pairs add what peft 0.18.1's own merge_and_unload changed, per expert."""
    fixture = Path(__file__).parent / "fixtures" / "peft018"
    adapter = shutil.copytree(fixture / "adapter", tmp_path / "adapter")
    folder = shutil.copytree(fixture / "base", tmp_path / "base")  # routing as llama.cpp's qwen3moe routes (the weights as saved)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    result = export_lora_gguf(folder, adapter)
    fields, tensors = read_lora(result.path)
    base, merged = _weights(fixture / "base"), _weights(fixture / "peft_merged")
    alpha, checked = fields["adapter.lora.alpha"], 0
    for layer in range(config["num_hidden_layers"]):
        for hf, kind in EXPERT_KINDS.items():
            a, b = tensors[f"blk.{layer}.{kind}.weight.lora_a"][0], tensors[f"blk.{layer}.{kind}.weight.lora_b"][0]
            for e in range(config["num_local_experts"]):
                name = f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"
                torch.testing.assert_close(alpha / a.shape[1] * (b[e] @ a[e]), merged[name] - base[name], rtol=1e-3, atol=1e-5, msg=name)
                checked += 1
    assert checked == 3 * config["num_hidden_layers"] * config["num_local_experts"] and result.experts == 6


# -- derived tensors (issue 40): a base tensor llama.cpp's converter moves (rows regrouped, value heads tiled,
# experts transposed and gate / up split) gets its LoRA moved alike; the reference transforms are
# test_gguf_families' (written from convert_hf_to_gguf.py), applied to peft's own merge delta


def _alpha_b_a(fields, tensors, name):
    a, b = tensors[name + ".lora_a"][0], tensors[name + ".lora_b"][0]
    return fields["adapter.lora.alpha"] / a.shape[-2] * (b @ a)


def test_a_lora_on_qwen35_linear_attention_is_moved_as_the_converter_moves_it(tmp_path):
    """Qwen3.5 (2 key heads, 4 value heads): _LinearAttentionVReorderBase tiles the value heads of in_proj_qkv,
    in_proj_z, in_proj_a, in_proj_b (rows: lora_b's rows move) and out_proj (columns: lora_a's columns move),
    running the reorder on lora_A / lora_B; every pair adds the reordered peft delta, and the factors are
    peft's saved lora_A / lora_B moved, nothing else."""
    from safetensors.torch import load_file
    from test_gguf_families import _qwen35_linear_attention, make_family
    from transformers import AutoConfig

    base = make_family(tmp_path / "q35", "qwen3_5_text", seed=1)
    adapter, delta = make_adapter(base, tmp_path / "q35-lora")
    result = export_lora_gguf(base, adapter)
    fields, tensors = read_lora(result.path)
    config = AutoConfig.from_pretrained(base)
    assert fields["general.architecture"] == "qwen35" and result.pairs == len(delta) == len(tensors) // 2
    linear = [k for k in delta if ".linear_attn." in k]
    assert {k.split(".linear_attn.")[1] for k in linear} == {f"{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")}
    names = gguf_names("qwen35", config.num_hidden_layers, [k for k in delta if k not in linear])
    for hf, want in delta.items():
        name, want = _qwen35_linear_attention(hf, want, config) if hf in linear else (names[hf], want)
        torch.testing.assert_close(_alpha_b_a(fields, tensors, name), want, rtol=1e-5, atol=1e-6, msg=hf)
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.linear_attn."
    nk, nv, dv = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim
    tiled = torch.arange(nv * dv).reshape(nk, nv // nk, dv).permute(1, 0, 2).reshape(-1)  # the converter's _reorder_v_heads
    a, b = tensors["blk.0.ssm_out.weight.lora_a"][0], tensors["blk.0.ssm_out.weight.lora_b"][0]
    assert torch.equal(a, saved[prefix + "out_proj.lora_A.weight"][:, tiled]) and torch.equal(b, saved[prefix + "out_proj.lora_B.weight"])
    a, b = tensors["blk.0.attn_gate.weight.lora_a"][0], tensors["blk.0.attn_gate.weight.lora_b"][0]
    assert torch.equal(a, saved[prefix + "in_proj_z.lora_A.weight"]) and torch.equal(b, saved[prefix + "in_proj_z.lora_B.weight"][tiled])
    assert not torch.equal(tiled, torch.arange(nv * dv))  # the case moves something


def test_a_lora_on_qwen3_next_in_proj_qkvz_is_regrouped_into_attn_qkv_and_attn_gate(tmp_path):
    """Qwen3-Next: in_proj_qkvz's rows (per key head [q, k, v, z]) regrouped into attn_qkv and attn_gate as
    Qwen3NextModel.modify_tensors regroups the weight (its own LoRA conversion stops there: the regroup
    reshapes the row size, which its LoraTorchTensor cannot; the rows of B move all the same); in_proj_ba
    and out_proj as they are; the experts and router stacked."""
    from test_gguf_families import _qwen3_next_linear_attention, make_family
    from transformers import AutoConfig

    base = make_family(tmp_path / "q3n", "qwen3_next", seed=1)
    adapter, delta = make_adapter(base, tmp_path / "q3n-lora")
    result = export_lora_gguf(base, adapter)
    fields, tensors = read_lora(result.path)
    config = AutoConfig.from_pretrained(base)
    linear = [k for k in delta if ".linear_attn." in k]
    assert {k.split(".linear_attn.")[1] for k in linear} == {"in_proj_qkvz.weight", "in_proj_ba.weight", "out_proj.weight"}
    for hf in linear:
        for name, want in _qwen3_next_linear_attention(hf, delta[hf], config).items():
            torch.testing.assert_close(_alpha_b_a(fields, tensors, name), want, rtol=1e-5, atol=1e-6, msg=f"{hf} {name}")
    # in_proj_qkvz: two pairs; the packed experts (all-linear adds them: not in the .weight delta) stacked per layer and kind
    assert result.pairs == len(delta) + 1 + result.experts and result.experts == 3 * config.num_hidden_layers
    names = gguf_names("qwen3next", config.num_hidden_layers, [k for k in delta if k not in linear])
    for hf in names:
        torch.testing.assert_close(_alpha_b_a(fields, tensors, names[hf]), delta[hf], rtol=1e-5, atol=1e-6, msg=hf)


def test_a_gpt_oss_expert_lora_is_transposed_and_split_into_gate_and_up_per_expert(tmp_path):
    """GPT-OSS's packed experts (gate_up_proj [experts, hidden, 2 * ff], gate and up interleaved; down_proj
    [experts, ff, hidden]) as llama.cpp's converter writes them from 16-bit weights: transposed, gate the
    even rows and up the odd ones. peft target_parameters on both: for each expert, what llama.cpp adds to
    ffn_gate_exps / ffn_up_exps / ffn_down_exps is the same transform of peft's merge delta (the tensors
    save_pretrained writes). The base's experts may be 16-bit or llama.cpp's MXFP4: a LoRA is added to the
    product either way."""
    from peft import LoraConfig, get_peft_model
    from test_gguf_families import make_family
    from transformers import AutoConfig, AutoModelForCausalLM

    base = make_family(tmp_path / "oss", "gpt_oss", seed=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    adapter = tmp_path / "oss-lora"
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    result = export_lora_gguf(base, adapter)
    fields, tensors = read_lora(result.path)
    config = AutoConfig.from_pretrained(base)
    layers, experts = config.num_hidden_layers, config.num_local_experts
    assert result.experts == 3 * layers and result.pairs == 4 * layers
    before, after = _weights(base), _weights(tmp_path / "merged")
    moved = {  # the converter's GptOssModel.modify_tensors on 16-bit experts
        "gate_up_proj": lambda w: {"ffn_gate_exps": w.transpose(1, 2)[:, 0::2], "ffn_up_exps": w.transpose(1, 2)[:, 1::2]},
        "down_proj": lambda w: {"ffn_down_exps": w.transpose(1, 2)},
    }
    for layer in range(layers):
        for hf, how in moved.items():
            name = f"model.layers.{layer}.mlp.experts.{hf}"
            for kind, want in how(after[name] - before[name]).items():
                a, b = tensors[f"blk.{layer}.{kind}.weight.lora_a"][0], tensors[f"blk.{layer}.{kind}.weight.lora_b"][0]
                assert a.shape[:2] == (experts, 4) and b.shape == (experts, want.shape[1], 4)
                for e in range(experts):
                    torch.testing.assert_close(fields["adapter.lora.alpha"] / 4 * (b[e] @ a[e]), want[e], rtol=1e-4, atol=1e-6,
                                               msg=f"{name} {kind} {e}")


def test_only_a_transform_that_moves_entries_is_taken_for_one():
    """A derived tensor's LoRA is written only where the base's transform moves entries (rows, columns, a
    transpose); one that scales or combines them (w * 2, -exp(w), a sum of rows) or changes the matrix's
    rank of axes (DeepSeek's k_b) stays refused (None)."""
    from types import SimpleNamespace

    from tui_merger.core.ship.gguf import GgufTensor
    from tui_merger.core.ship.gguf_lora import _gather

    def tensor(shape, out, fn):
        return GgufTensor("blk.0.x.weight", (SimpleNamespace(name="x.weight", shape=shape),), out, 0, 0, derive=fn)

    rows, cols, transposed = _gather(tensor((6, 4), (3, 4), lambda w: w[1::2]))
    assert rows.tolist() == [1, 3, 5] and cols.tolist() == [0, 1, 2, 3] and not transposed
    # GPT-OSS's gate: out[i, j] = W[j, 2 i] per expert; rows: the source rows of the result's columns
    rows, cols, transposed = _gather(tensor((2, 6, 4), (2, 2, 6), lambda w: w.transpose(1, 2)[:, 0::2]))
    assert rows.tolist() == [0, 1, 2, 3, 4, 5] and cols.tolist() == [0, 2] and transposed
    for shape, out, fn in (((6, 4), (6, 4), lambda w: w * 2), ((6, 4), (6, 4), lambda w: -w.float().exp()),
                           ((6, 4), (3, 4), lambda w: w[0::2] + w[1::2]), ((6, 4), (2, 4, 3), lambda w: w.reshape(2, 3, 4).transpose(1, 2)),
                           ((6, 4), (6, 4), lambda w: torch.maximum(w, w.flip(0)))):  # indices in range: the random check
        assert _gather(tensor(shape, out, fn)) is None


def test_a_lora_for_gpt_oss_released_in_mxfp4_is_written_from_its_dequantized_names(tmp_path, capsys):
    """GPT-OSS as released (experts as MXFP4 *_blocks / *_scales, tests/fp8_factory.py): the adapter was trained
    on transformers' dequantizing load, and its GGUF LoRA needs the base's names and shapes only. What llama.cpp
    adds per expert is peft's merge delta on that load, moved as the converter moves the experts. The base's
    GGUF is llama.cpp's to make (MXFP4): without one given, the command says so before writing anything;
    with one (--out), the LoRA and Modelfile are written for it."""
    import transformers
    from fp8_factory import make_mxfp4_base
    from peft import LoraConfig, get_peft_model
    from test_gguf import byte_level_tokenizer
    from tui_merger.cli import main

    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
                                       num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                       vocab_size=448, max_position_embeddings=64, sliding_window=16,
                                       layer_types=["sliding_attention", "full_attention"],
                                       rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    torch.manual_seed(0)
    base = tmp_path / "gpt-oss-mxfp4"
    make_mxfp4_base(base, transformers.GptOssForCausalLM(config))
    byte_level_tokenizer("o200k").save_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                              quantization_config=transformers.Mxfp4Config(dequantize=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "dequantized")  # its 16-bit GGUF stands in for llama.cpp's MXFP4 one below
    byte_level_tokenizer("o200k").save_pretrained(tmp_path / "dequantized")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    adapter = tmp_path / "oss-lora"
    peft_model.save_pretrained(adapter)
    after = peft_model.merge_and_unload().state_dict()
    # the command: no base GGUF to use, and none it may make: one sentence, nothing written
    assert main(["gguf", str(base), "--adapter", str(adapter), "--check", "none", "--plain"]) != 0
    _, err = capsys.readouterr()
    assert f"{base} holds mxfp4 weights: tui-merger writes the LoRA for it but not its GGUF" in err
    assert not list(tmp_path.rglob("*.gguf"))
    result = export_lora_gguf(base, adapter)
    fields, tensors = read_lora(result.path)
    assert fields["general.architecture"] == "gpt-oss" and result.experts == 6 and result.pairs == 8
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.experts."
        gate_up, down = after[name + "gate_up_proj"] - before[name + "gate_up_proj"], after[name + "down_proj"] - before[name + "down_proj"]
        for kind, want in (("ffn_gate_exps", gate_up.transpose(1, 2)[:, 0::2]), ("ffn_up_exps", gate_up.transpose(1, 2)[:, 1::2]),
                           ("ffn_down_exps", down.transpose(1, 2))):
            got = _alpha_b_a(fields, tensors, f"blk.{layer}.{kind}.weight")
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{layer} {kind}")
    # with the base's GGUF given (here the dequantized model's), the LoRA and its Modelfile; the GGUF is not rewritten
    from tui_merger.core.ship.gguf import export_gguf

    given = export_gguf(tmp_path / "dequantized", "f16", tmp_path / "gpt-oss-MXFP4.gguf").path
    stamp = given.read_bytes()
    assert main(["gguf", str(base), "--adapter", str(adapter), "--out", str(given), "--check", "none", "--plain", "--overwrite"]) == 0
    out, _ = capsys.readouterr()
    assert f"Base GGUF {given} is used as it is (llama.cpp's to make: {base} holds mxfp4 weights)." in out and given.read_bytes() == stamp
    assert f"FROM {given}" in (adapter / "oss-lora-LoRA-F32.Modelfile").read_text()


def test_gemma4_expert_loras_carry_the_per_expert_scale_and_a_lora_llama_cpp_drops_is_refused(tmp_path):
    """Gemma 4's MoE scales each expert's output by router.per_expert_scale; llama.cpp stores it as
    ffn_down_exps.scale and multiplies only the base's product by it, then adds the LoRA's (llama-graph.cpp's
    build_lora_mm_id), so lora_b of expert e carries scale[e]: what llama.cpp adds, scale[e] times peft's
    delta. gate_up (ffn_gate_up_exps, no scale) as it is. A LoRA on per_layer_model_projection, which
    llama.cpp's gemma4 graph multiplies without adapters (measured: the logits with it equal the base's
    alone), is refused."""
    from peft import LoraConfig, get_peft_model
    from test_gguf_families import make_family
    from transformers import AutoModelForCausalLM

    base = make_family(tmp_path / "g4moe", "gemma4_text:moe", seed=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                                                  target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    adapter = tmp_path / "g4-lora"
    peft_model.save_pretrained(adapter)
    after = peft_model.merge_and_unload().state_dict()
    result = export_lora_gguf(base, adapter)
    fields, tensors = read_lora(result.path)
    assert result.experts == 4
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        scale = before[prefix + "router.per_expert_scale"]
        assert not torch.allclose(scale, torch.ones_like(scale))  # the case tells
        for hf, kind, factor in (("experts.gate_up_proj", "ffn_gate_up_exps", torch.ones_like(scale)), ("experts.down_proj", "ffn_down_exps", scale)):
            delta = after[prefix + hf] - before[prefix + hf]
            a, b = tensors[f"blk.{layer}.{kind}.weight.lora_a"][0], tensors[f"blk.{layer}.{kind}.weight.lora_b"][0]
            for e in range(delta.shape[0]):
                torch.testing.assert_close(fields["adapter.lora.alpha"] / 4 * (b[e] @ a[e]), factor[e] * delta[e], rtol=1e-4, atol=1e-6,
                                           msg=f"{layer} {kind} {e}")
    dense = make_family(tmp_path / "g4", "gemma4_text", seed=1)
    dropped, _ = make_adapter(dense, tmp_path / "ple", target_modules=["q_proj", "per_layer_model_projection"])
    with pytest.raises(MergeError, match="gemma4 graph does not apply a LoRA to per_layer_model_proj"):
        export_lora_gguf(dense, dropped)
    assert not list(dropped.glob("*.gguf"))
