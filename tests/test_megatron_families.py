"""GLM-4.5 (glm4_moe) and DeepSeek-V3 (deepseek_v3, multi-latent attention) Megatron checkpoints with one
multi-token-prediction layer, written by Megatron-Bridge 0.3.1's own save on CPU (TP 2 and EP 2) after
``AutoBridge.load_hf_weights`` imported ``hf_*`` (``save_pretrained`` + the MTP layer where the released checkpoints
keep it: ``model.layers.{num_hidden_layers}.*``; tests/fixtures/megatron_families/generate_families.py). The
conversion must give back every tensor of ``hf_*``, MTP layer included, bit for bit."""

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

FAMILIES = Path(__file__).resolve().parent / "fixtures" / "megatron_families"
CASES = [("bridge_glm45_tp2", "hf_glm45"), ("bridge_glm45_ep2", "hf_glm45"), ("bridge_dsv3_tp2", "hf_dsv3"),
         ("bridge_dsv3_ep2", "hf_dsv3")]


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _fixtures(tmp: Path, *cases: str) -> Path:
    """The runs and their Hugging Face folders copied (a run names its model relative to the folder)."""
    for case in cases:
        if not (FAMILIES / case / "iter_0000002" / ".metadata").is_file():
            pytest.skip(f"{case} is not generated")
    folder = tmp / "families"
    names = set(cases) | {hf for c, hf in CASES if c in cases}
    shutil.copytree(FAMILIES, folder, ignore=lambda d, items: [i for i in items if d == str(FAMILIES) and i not in names])
    return folder


def _saved(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("case, hf", CASES)
def test_checkpoint_converts_to_the_weights_it_was_made_from(tmp_path, case, hf):
    """Every tensor of the reference, the MTP layer's included (enorm, hnorm, eh_proj, shared_head.norm, its decoder
    layer with experts, and the embedding / lm_head copies the releases keep in it), bit for bit, nothing else."""
    folder = _fixtures(tmp_path, case)
    result = _merge(folder / case, tmp_path / "out")
    said = [n for n in result.warnings if "multi-token prediction" in n]
    assert said and "1 multi-token prediction layer is written" in said[0] and "(model.layers.2.*)" in said[0], said
    got, want = read_output(tmp_path / "out"), _saved(folder / hf)
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.shared_head.head.weight",
            "model.layers.2.mlp.experts.3.down_proj.weight", "model.layers.2.mlp.gate.e_score_correction_bias"} <= set(got)
    _equal(got, want)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("case", ["bridge_glm45_tp2", "bridge_dsv3_ep2"])
def test_verify_passes(tmp_path, case):
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    folder = _fixtures(tmp_path, case)
    _merge(folder / case, tmp_path / "out")
    report = verify_merge(tmp_path / "out", MergeOptions(checkpoint=folder / case, out=tmp_path / "out"))
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]


def test_config_without_the_mtp_count_gets_it(tmp_path):
    """A config that does not say num_nextn_predict_layers: the layer is written and the count set, so that readers
    that build it (vLLM's MTP) find it; said."""
    folder = _fixtures(tmp_path, "bridge_glm45_tp2")
    cfg = folder / "hf_glm45" / "config.json"
    data = json.loads(cfg.read_text())
    del data["num_nextn_predict_layers"]
    cfg.write_text(json.dumps(data))
    result = _merge(folder / "bridge_glm45_tp2", tmp_path / "out")
    assert result.config_changes.get("num_nextn_predict_layers") == 1
    assert any("num_nextn_predict_layers is set to 1" in n for n in result.warnings), result.warnings
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    _equal(read_output(tmp_path / "out"), _saved(folder / "hf_glm45"))


def _resave(iteration: Path, change) -> None:
    """The dist checkpoint read and written again by torch.distributed.checkpoint, with ``change`` applied."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = iteration.parent / "whole.pt"
    dcp_to_torch_save(iteration, whole)
    state = torch.load(whole, weights_only=False)
    change(state)
    for f in list(iteration.glob("*.distcp")) + [iteration / ".metadata"]:
        f.unlink()
    dcp.save(state, checkpoint_id=iteration, no_dist=True)


def test_refusals(tmp_path):
    folder = _fixtures(tmp_path, "bridge_glm45_tp2", "bridge_dsv3_tp2")
    # an MTP layer whose eh_proj is not [hidden, 2 x hidden]: one sentence, nothing written
    glm = folder / "bridge_glm45_tp2"
    _resave(glm / "iter_0000002", lambda s: s.update({"mtp.layers.0.eh_proj.weight": s["mtp.layers.0.eh_proj.weight"][:, :32]}))
    _refused(glm, tmp_path / "o1", "eh_proj [32, 64]", "mtp.layers.0.eh_proj.weight is [32, 32]")
    # a DeepSeek-V3 config whose multi-latent attention does not fit the checkpoint (kv_lora_rank)
    cfg = folder / "hf_dsv3" / "config.json"
    data = json.loads(cfg.read_text())
    data["kv_lora_rank"] = 4
    cfg.write_text(json.dumps(data))
    _refused(folder / "bridge_dsv3_tp2", tmp_path / "o2", "does not match the checkpoint", "kv_lora_rank")


def test_legacy_rank_files_are_refused(tmp_path):
    """Legacy per-rank files (mp_rank_*) of these families: how their MLA projections and MTP layers are split across
    tensor-parallel ranks is not read from such files, so they are refused rather than joined by guess."""
    folder = _fixtures(tmp_path, "bridge_glm45_tp2")
    legacy = Path(__file__).resolve().parent / "fixtures" / "megatron" / "legacy_tp2pp2"
    shutil.copytree(legacy, tmp_path / "legacy")
    for cfg in (tmp_path / "legacy").rglob("hf_config_and_tokenizer"):
        shutil.rmtree(cfg)
    _refused(tmp_path / "legacy", tmp_path / "o", "GLM-4.5 model in legacy per-rank files", "torch_dist",
             base=folder / "hf_glm45")


def test_routers_without_expert_bias(tmp_path):
    """A run without the router's expert bias (moe_router_enable_expert_bias off): transformers' GLM-4.5 has one, so
    it is written as 0 (what adding nothing to the scores is), said once; every other tensor as imported."""
    folder = _fixtures(tmp_path, "bridge_glm45_tp2")
    run = folder / "bridge_glm45_tp2"
    _resave(run / "iter_0000002", lambda s: [s.pop(k) for k in list(s) if k.endswith("router.expert_bias")])
    result = _merge(run, tmp_path / "out")
    said = [n for n in result.warnings if "no expert bias" in n]
    assert len(said) == 1 and "written as 0" in said[0], result.warnings
    got, want = read_output(tmp_path / "out"), _saved(folder / "hf_glm45")
    for name in [n for n in want if n.endswith("e_score_correction_bias")]:
        assert torch.equal(got.pop(name), torch.zeros_like(want.pop(name))), name
    _equal(got, want)
