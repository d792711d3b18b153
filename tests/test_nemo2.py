"""NeMo 2 checkpoints written by NeMo itself (tests/fixtures/megatron_layouts/nemo2_*, made by generate_nemo2.py:
NeMo 2.7.3's own HF importer ``llm.import_ckpt`` -> ``nemo_save`` on CPU).

The reference of each is the tiny Hugging Face model NeMo imported, as ``save_pretrained`` wrote it (``hf/``):
converting NeMo's ``weights/`` back must give exactly those tensors, bit for bit. Without --base the Hugging
Face config is built from ``context/model.yaml`` (issue 39): the fields that decide the weights and the
forward must equal those of ``hf/config.json``, and the converted model's logits those of the reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import merge_checkpoint, refused, same_tensors

from tui_merger.core.formats.scan import scan

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_layouts"
SAVED = FIXTURES / "nemo2_saved"  # Llama (LlamaConfig)
CKPT, HF = SAVED / "nemo2", SAVED / "hf"
CASES = {"llama": SAVED, "llama31": FIXTURES / "nemo2_llama31", "qwen2": FIXTURES / "nemo2_qwen2"}
# the config fields that decide the weights' shapes and the forward (the rest is generation or training detail)
FIELDS = ("model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "vocab_size", "tie_word_embeddings",
          "hidden_act", "attention_bias", "mlp_bias", "use_sliding_window", "num_experts", "num_experts_per_tok",
          "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "dtype")


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _config_fields(folder: Path) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    return {k: getattr(cfg, k, None) for k in FIELDS}


def _logits(folder: Path, length: int = 24):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    probe = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(39))
    with torch.no_grad():
        return model(probe).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_fixture_is_nemos_own_save(case):
    """What NeMo's save wrote: the dist checkpoint under weights/, the io context under context/."""
    ckpt = CASES[case] / "nemo2"
    assert (ckpt / "weights" / ".metadata").is_file() and (ckpt / "weights" / "metadata.json").is_file()
    assert (ckpt / "context" / "io.json").is_file() and (ckpt / "context" / "nemo_tokenizer" / "tokenizer.json").is_file()
    assert f"nemo.collections.llm.gpt.model.{case[:5] if case != 'llama31' else 'llama'}." in (
        ckpt / "context" / "model.yaml").read_text()


def test_inspect_detects_nemo2_and_its_config():
    (c,) = scan(CKPT).candidates
    assert c.backend == "nemo2" and not c.needs_base and c.tokenizer
    assert any("LlamaModel" in n for n in c.notes)
    assert any("built from context/model.yaml (NeMo's LlamaConfig)" in n for n in c.notes), c.notes


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_without_base_equals_the_imported_model(tmp_path, case):
    """No --base: the config from context/model.yaml, the tokenizer from context/nemo_tokenizer; the weights bit
    for bit, the config's fields and the logits those of the model NeMo imported."""
    from tui_merger.core.verify.checks import verify_merge
    from tui_merger.core.options import MergeOptions

    top = CASES[case]
    out = tmp_path / "out"
    result = merge_checkpoint(top / "nemo2", out)
    assert any("built from" in n and "model.yaml" in n for n in result.warnings), result.warnings
    assert top / "nemo2" / "context" / "model.yaml" in result.input_files
    report = verify_merge(out, MergeOptions(checkpoint=top / "nemo2", out=out))
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]
    want = read_output(top / "hf")
    same_tensors(read_output(out), want)
    assert not torch.equal(want["model.norm.weight"], torch.ones_like(want["model.norm.weight"]))
    assert _config_fields(out) == _config_fields(top / "hf")
    assert (out / "tokenizer.json").read_bytes() == (top / "nemo2" / "context" / "nemo_tokenizer" / "tokenizer.json").read_bytes()
    assert torch.equal(_logits(out), _logits(top / "hf"))


def test_llama31_rope_scaling_is_carried_over(tmp_path):
    """Llama31Config records the rope factors; without them the logits differ (so the test can fail): over 120
    positions only the slowest frequencies are scaled (by 1/4), a small but real difference."""
    import json

    out = tmp_path / "out"
    merge_checkpoint(CASES["llama31"] / "nemo2", out)
    cfg = json.loads((out / "config.json").read_text())
    scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 4.0, scaling
    plain = tmp_path / "plain"
    shutil.copytree(out, plain)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": scaling["rope_theta"]}
    cfg.pop("rope_scaling", None)
    (plain / "config.json").write_text(json.dumps(cfg))
    assert torch.equal(_logits(out, 120), _logits(CASES["llama31"] / "hf", 120))
    assert not torch.equal(_logits(plain, 120), _logits(out, 120))


def test_qwen2_keeps_its_qkv_biases(tmp_path):
    out = tmp_path / "out"
    merge_checkpoint(CASES["qwen2"] / "nemo2", out)
    got = read_output(out)
    assert got["model.layers.1.self_attn.k_proj.bias"].abs().sum() > 0


def _edited_context(tmp_path: Path, edit) -> Path:
    ckpt = tmp_path / "nemo2"
    shutil.copytree(CKPT, ckpt)
    path = ckpt / "context" / "model.yaml"
    path.write_text(edit(path.read_text()))
    return ckpt


def test_refused_when_the_context_lacks_a_field(tmp_path):
    ckpt = _edited_context(tmp_path, lambda t: t.replace("  hidden_size: 64\n", ""))
    refused(ckpt, tmp_path / "o", "NeMo 2", "hidden_size", "--base")
    # with --base the user's model gives the config, and the conversion goes on
    out = tmp_path / "with-base"
    merge_checkpoint(ckpt, out, base=HF)
    same_tensors(read_output(out), read_output(HF))


def test_refused_when_the_config_class_is_unknown(tmp_path):
    ckpt = _edited_context(tmp_path, lambda t: t.replace("nemo.collections.llm.gpt.model.llama.LlamaConfig",
                                                         "nemo.collections.llm.gpt.model.mistral.MistralConfig7B"))
    message = refused(ckpt, tmp_path / "o", "MistralConfig7B", "--base")
    (c,) = scan(ckpt).candidates
    assert c.needs_base and message in c.notes


def test_refused_when_the_context_contradicts_the_family(tmp_path):
    ckpt = _edited_context(tmp_path, lambda t: t.replace("  add_qkv_bias: false\n", "  add_qkv_bias: true\n"))
    refused(ckpt, tmp_path / "o", "add_qkv_bias", "--base")


def test_merge_with_base_equals_the_imported_hf_weights_and_verifies(tmp_path):
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    out = tmp_path / "out"
    options = MergeOptions(checkpoint=CKPT, out=out, base=HF)  # what `merge CKPT --base HF --out O` runs
    merge_checkpoint(CKPT, out, base=HF)
    report = verify_merge(out, options)
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]
    assert [c.name for c in report.checks] == ["structure", "recompute", "behaviour"]
    ours, want = read_output(out), read_output(HF)
    assert len(want) == 21
    same_tensors(ours, want)


def test_qwen3_moe_config_from_nemos_own_context():
    """NeMo's Qwen3 importer on a Qwen3-MoE (generate_nemo2.py qwen3_moe): only its context/model.yaml and the
    imported model's config.json are kept. The weights are not a fixture: on megatron-core's local spec the
    importer maps the experts to Transformer Engine's grouped names only ("No matches found for source key:
    **.mlp.experts.*.down_proj.weight"), so NeMo's checkpoint holds initial experts, not the model's (every other
    tensor converted bit for bit when tried), and 128 experts (the importer passes no expert count) made it 1.7 MB."""
    from transformers import AutoConfig

    from tui_merger.core.formats.megatron_runs import read_yaml
    from tui_merger.core.formats.nemo2_config import nemo2_config

    top = FIXTURES / "nemo2_qwen3_moe"
    built = nemo2_config(top / "nemo2", read_yaml(top / "nemo2" / "context" / "model.yaml"))
    assert built.nemo_class == "Qwen3MoEConfig"
    cfg = AutoConfig.for_model(built.config["model_type"], **{k: v for k, v in built.config.items() if k != "model_type"})
    ours = {k: getattr(cfg, k, None) for k in FIELDS}
    want = _config_fields(top / "hf")
    assert ours == want
    assert (ours["num_experts"], ours["num_experts_per_tok"], ours["moe_intermediate_size"], ours["head_dim"]) == (128, 8, 2, 128)
