"""The base models proposed when an adapter's own base is not on this machine (``choices.base_candidates``),
and the base config shown beside the adapter's (``choices.base_config_fields``): real tiny models saved by
transformers, adapters saved by peft, a kohya file made from one, a Hugging Face cache laid out as
huggingface_hub lays it out; only configs and safetensors headers are read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factory import edit_adapter_config, gpt2_config, qwen_config, save_adapter, save_base
from safetensors.torch import load_file, save_file

from tui_merger.core.formats.scan import scan
from tui_merger.core.plan.choices import base_candidates, base_config_fields, cached_models, models_found


def kohya_file(adapter: Path, dest: Path) -> Path:
    """The adapter's pairs under kohya's names (lora_<module with . -> _>.lora_down / .lora_up)."""
    tensors = {}
    for key, value in load_file(adapter / "adapter_model.safetensors").items():
        module, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
        tensors[f"lora_{module.replace('.', '_')}.lora_{'down' if rest.startswith('A') else 'up'}.weight"] = value.contiguous()
    save_file(tensors, str(dest))
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    ws = root / "ws"
    base = save_base(ws / "base", qwen_config())
    save_base(ws / "narrow", qwen_config(hidden_size=32, num_attention_heads=2, intermediate_size=64))  # shapes differ
    save_base(ws / "deeper", qwen_config(num_hidden_layers=3))  # the adapter's modules fit this one too
    save_base(ws / "gpt", gpt2_config())  # another architecture: no q_proj at all
    lora = save_adapter(ws / "lora", base, target_modules=["q_proj", "v_proj", "down_proj"])
    edit_adapter_config(lora, base_model_name_or_path="/home/someone/models/base")  # not on this machine
    kohya_file(lora, ws / "style.safetensors")
    return ws


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_the_models_that_fit_come_first_named_like_the_adapters_base(models):
    found = models_found(scan(models).candidates)
    assert {p.name for p in found} == {"base", "narrow", "deeper", "gpt"}  # the adapter and the kohya file are not models
    proposals = base_candidates(models / "lora", found)
    assert [p.name for p, _ in proposals] == ["base", "deeper"]  # narrow's shapes and gpt's modules do not fit
    best, why = proposals[0]
    assert why == "named like the adapter's base; fits all 6 LoRA modules; Qwen2ForCausalLM, 2 layers; found in the folder"
    assert proposals[1][1] == "fits all 6 LoRA modules; Qwen2ForCausalLM, 3 layers; found in the folder"


def test_a_kohya_file_is_matched_through_each_models_module_names(models):
    proposals = base_candidates(models / "style.safetensors", models_found(scan(models).candidates))
    assert [p.name for p, _ in proposals] == ["base", "deeper"]
    assert proposals[0][1].startswith("fits all 6 LoRA modules")


def test_a_config_saved_beside_the_adapter_rules_out_other_model_types(models, tmp_path):
    lora = tmp_path / "lora"
    shutil.copytree(models / "lora", lora)
    config = json.loads((models / "gpt" / "config.json").read_text())
    (lora / "config.json").write_text(json.dumps(config))  # it says: trained on a gpt2
    assert base_candidates(lora, models_found(scan(models).candidates)) == []


def test_models_in_the_hugging_face_cache_are_proposed_after_the_folders(models, tmp_path, monkeypatch):
    """A cache laid out as huggingface_hub writes it (blobs, refs/main, snapshots/<sha>/ of links), read
    with its own scan_cache_dir, offline."""
    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-qwen"
    sha = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for n, f in enumerate(sorted((models / "base").iterdir())):
        blob = repo / "blobs" / f"blob{n}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert cached_models() == [snapshot]
    proposals = base_candidates(models / "lora", [models / "narrow"])
    assert proposals == [(snapshot, "fits all 6 LoRA modules; Qwen2ForCausalLM, 2 layers; in the Hugging Face cache")]
    assert base_candidates(models / "lora", [models / "deeper"])[0][0] == models / "deeper"  # the folder's first
    assert base_candidates(models / "lora", [], cache=False) == []


def test_the_base_config_is_shown_with_the_fields_the_adapter_side_disagrees_with(models, tmp_path):
    fields = {f.name: f for f in base_config_fields(models / "base", [models / "lora"])}
    assert [(f.name, f.value) for f in fields.values()] == [
        ("architecture", "Qwen2ForCausalLM"), ("layers", "2"), ("hidden", "64"), ("heads", "4"), ("KV heads", "2"),
        ("vocab", "256"), ("dtype", "float32"), ("rope_theta", "10000"), ("max positions", "128"),
    ]
    assert all(f.other is None for f in fields.values())
    lora = tmp_path / "lora"
    shutil.copytree(models / "lora", lora)
    config = json.loads((models / "base" / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": 500000.0}
    config["max_position_embeddings"] = 4096
    (lora / "config.json").write_text(json.dumps(config))
    fields = {f.name: f for f in base_config_fields(models / "base", [lora])}
    assert (fields["rope_theta"].other, fields["max positions"].other) == ("500000", "4096")
    assert fields["rope_theta"].where == "the adapter's base config"
    assert fields["layers"].other is None and fields["vocab"].other is None


def test_a_resized_vocabulary_saved_in_the_adapter_is_marked(models, tmp_path):
    lora = save_adapter(tmp_path / "resized", models / "base", target_modules=["q_proj"], resize_to=300,
                        modules_to_save=["embed_tokens", "lm_head"])
    vocab = next(f for f in base_config_fields(models / "base", [lora]) if f.name == "vocab")
    assert (vocab.value, vocab.other) == ("256", "300")
    assert "resized" in vocab.where
