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
    assert main(["gguf", str(base), "--adapter", str(other), "--type", "f16", "--check", "none", "--plain"]) == 0
    out, _ = capsys.readouterr()
    assert f"Base GGUF {base_gguf} is already there: used as it is (--overwrite writes it again)." in out
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
