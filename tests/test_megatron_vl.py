"""Megatron checkpoints of vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) and of models trained with
multi-token prediction layers, converted to the Hugging Face model they were imported from.

Fixtures (tests/fixtures/megatron_vl/README.md): ``bridge_*`` were written by Megatron-Bridge 0.3.1's own trainer
checkpointing on CPU (its VL models: the language model a megatron-core GPT, the vision tower transformers' module
embedded) after ``AutoBridge.load_hf_weights`` imported ``hf_*`` (``save_pretrained``: the reference; Bridge's own
Hugging Face export was checked equal to it in the generator). ``native_*`` hold the vision tower as megatron-core's
vision transformer (mbridge's and verl's names), in verl's layout: made from ``hf_*`` by mbridge's import rules and
saved by megatron-core's ``dist_checkpointing.save`` (mbridge's model needs Transformer Engine, which does not build
on CPU).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import merge_checkpoint as _merge
from megatron_helpers import refused as _refused
from megatron_helpers import same_tensors as _equal


VL = Path(__file__).resolve().parent / "fixtures" / "megatron_vl"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _fixtures(tmp: Path) -> Path:
    """The fixtures copied (the runs name their Hugging Face model relative to the folder)."""
    if not (VL / "bridge_qwen25_vl_tp2" / "iter_0000002" / ".metadata").is_file():
        pytest.skip("Megatron VL fixtures are not generated")
    shutil.copytree(VL, tmp / "vl", ignore=shutil.ignore_patterns("*.py"))
    return tmp / "vl"


def _saved(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("case, hf", [("bridge_qwen25_vl_tp2", "hf_qwen25"), ("bridge_qwen3_vl_tp2", "hf_qwen3"),
                                      ("native_qwen25_vl", "hf_qwen25"), ("native_qwen3_vl", "hf_qwen3")])
def test_vl_checkpoint_converts_to_the_weights_it_was_made_from(tmp_path, case, hf):
    """TP 2 Megatron-Bridge saves (vision tower: transformers' module, visual.* / vision_model.*) and verl-layout
    megatron-core vision towers (fused qkv per head, [gate; up], fused norms, stacked layers): every tensor
    save_pretrained wrote comes back under its name, bit for bit, and nothing else."""
    vl = _fixtures(tmp_path)
    result = _merge(vl / case, tmp_path / "out")
    assert any("vision tower" in n for n in result.warnings), result.warnings
    _equal(read_output(tmp_path / "out"), _saved(vl / hf))


def test_qwen3_vl_moe_packed_experts(tmp_path):
    """Qwen3-VL-MoE: the language model's experts (megatron-core's per-expert fc1/fc2, TP 2) become transformers'
    packed gate_up_proj / down_proj. The reference was saved by transformers 4.57 in the Hub release's layout
    ([E, H, 2I]); transformers 5 saves [E, 2I, H]: both are read by transformers itself and compared."""
    vl = _fixtures(tmp_path)
    _merge(vl / "bridge_qwen3_vl_moe_tp2", tmp_path / "out")
    got, want = read_output(tmp_path / "out"), _saved(vl / "hf_qwen3_moe")
    assert sorted(got) == sorted(want)
    import transformers

    ours = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    ref = transformers.AutoModelForImageTextToText.from_pretrained(vl / "hf_qwen3_moe", dtype=torch.float32).state_dict()
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name
    packed = [n for n in got if n.endswith("mlp.experts.gate_up_proj")]
    assert packed and all(torch.equal(got[n], want[n].transpose(1, 2)) for n in packed)


def test_mtp_layers_are_left_out_with_a_notice(tmp_path):
    """A Qwen3 trained with one MTP layer (mtp_num_layers 1, Megatron-Bridge's save): transformers' Qwen3 has no
    place for it, so it is left out and said; the model itself equals the one imported."""
    vl = _fixtures(tmp_path)
    result = _merge(vl / "bridge_qwen3_mtp_tp2", tmp_path / "out")
    said = [n for n in result.warnings if "multi-token prediction" in n]
    assert said and "1 multi-token prediction layer (mtp.*, 12 tensors)" in said[0] and "left out" in said[0], said
    _equal(read_output(tmp_path / "out"), _saved(vl / "hf_qwen3_mtp"))


def test_vl_refusals(tmp_path):
    vl = _fixtures(tmp_path)
    # a text model's checkpoint with a vision-language config
    _refused(vl / "bridge_qwen3_mtp_tp2", tmp_path / "o1", "vision-language model (Qwen3VLForConditionalGeneration)",
             "no language_model.* tensors", base=vl / "hf_qwen3")
    # the config of another family: Qwen2.5-VL's language model has qkv biases, Qwen3-VL's none
    _refused(vl / "bridge_qwen25_vl_tp2", tmp_path / "o2", "linear_qkv biases", base=vl / "hf_qwen3")
    # a vision config that does not fit the tower: heads that do not divide its fused qkv
    cfg = vl / "native_qwen25_vl" / "global_step_1" / "actor" / "model" / "huggingface" / "config.json"
    data = json.loads(cfg.read_text())
    data["vision_config"]["num_heads"] = 5
    cfg.write_text(json.dumps(data))
    _refused(vl / "native_qwen25_vl", tmp_path / "o3", "does not match the checkpoint")


def test_tied_vl_model_has_no_output_layer(tmp_path):
    """Trained with tied embeddings (Qwen2.5-VL-3B, Qwen3-VL-2B/4B): Megatron saves no output layer, the config says
    tied; the model is written without lm_head and transformers ties it to the embedding."""
    vl = _fixtures(tmp_path)
    _merge(vl / "native_qwen3_vl_tied", tmp_path / "out")
    got, want = read_output(tmp_path / "out"), _saved(vl / "hf_qwen3")
    del want["lm_head.weight"]
    _equal(got, want)
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, want["model.language_model.embed_tokens.weight"])


@pytest.mark.parametrize("case, hf", [("bridge_qwen25_vl_tp2", "hf_qwen25"), ("bridge_qwen3_vl_tp2", "hf_qwen3")])
def test_ms_swift_vision_tower_names(case, hf):
    """ms-swift keeps transformers' vision module one level deeper (its HuggingFaceModule, ``module_mapping =
    {'model.visual': 'visual'}``: ``visual.visual.*``): Megatron-Bridge's save read under those names is placed by
    the same rule (the module's own parameter names found in transformers' model), every value where it was."""
    from types import SimpleNamespace

    from tui_merger.core.formats import verl_megatron as vm
    from tui_merger.core.formats.megatron_vl import map_vl
    from tui_merger.core.io.dcp import DcpStore

    if not (VL / case / "iter_0000002" / ".metadata").is_file():
        pytest.skip("Megatron VL fixtures are not generated")
    store = DcpStore(VL / case / "iter_0000002", vm.skip_key, vm.canonical)
    try:
        store.tensors = {("visual.visual." + k.split(".", 1)[1] if k.startswith(("visual.", "vision_model.")) else k): v
                         for k, v in store.tensors.items()}
        config = json.loads((VL / hf / "config.json").read_text())
        parts = SimpleNamespace(Mapper=vm._Mapper, Mapping=vm._Mapping, Spec=vm.Spec, Piece=vm.Piece)
        mapping = map_vl(store.tensors, config, VL / hf / "config.json", parts)
        source = vm.MegatronSource(store, mapping.specs, VL / case, list(store.data_files))
        got = {name: source.load(ref) for name, ref in source.tensors.items()}
    finally:
        store.close()
    _equal(got, _saved(VL / hf))
