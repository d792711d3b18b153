"""A Megatron checkpoint of Qwen3-Next (Gated DeltaNet layers, gated attention, MoE with a shared expert, its MTP
layer) converted to the Hugging Face model it was imported from, the MTP layer included.

Fixture (tests/fixtures/megatron_qwen3_next/generate_qwen3_next.py): ``hf_qwen3_next/`` is a tiny Qwen3-Next written
by transformers' ``save_pretrained`` plus the ``mtp.*`` tensors as the Hub release keeps them (the reference);
Megatron-Bridge 0.3.1 imported it (its own Qwen3-Next mappings: the Gated DeltaNet in_proj merge, the conv1d split,
the gated norm's - 1, the gated q/gate interleave) into megatron-core's GPT with ``mtp_num_layers`` 1 and saved it
with its trainer checkpointing on CPU, TP 2 (``bridge_qwen3_next_tp2/``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factory import read_output
from megatron_helpers import merge_checkpoint, refused, same_tensors

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron_qwen3_next"
CASE = "bridge_qwen3_next_tp2"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _fixtures(tmp: Path) -> Path:
    """The fixtures copied (the run names its Hugging Face model relative to the folder)."""
    if not (FIXTURES / CASE / "iter_0000002" / ".metadata").is_file():
        pytest.skip("Qwen3-Next Megatron fixture is not generated")
    shutil.copytree(FIXTURES, tmp / "q", ignore=shutil.ignore_patterns("*.py"))
    return tmp / "q"


def _reference() -> dict:
    from safetensors.torch import load_file

    return load_file(FIXTURES / "hf_qwen3_next" / "model.safetensors")


def test_qwen3_next_converts_bit_for_bit_with_its_mtp_layer(tmp_path):
    """Every tensor save_pretrained wrote and every mtp.* tensor of the release's layout comes back under its name,
    bit for bit (in_proj_qkvz / in_proj_ba re-interleaved per key head, conv1d, the gated norm + 1, q_proj's
    per-head gates, experts, shared expert), nothing else; the notice says where the MTP layer went; verification
    (structure, recompute, transformers' load and forward) passes."""
    q = _fixtures(tmp_path)
    out = tmp_path / "out"
    result = merge_checkpoint(q / CASE, out)
    said = [w for w in result.warnings if "multi-token prediction" in w]
    assert said and "mtp.fc, mtp.layers.0.*, mtp.norm" in said[0], result.warnings
    want = _reference()
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.3.down_proj.weight",
            "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"} <= set(want)
    same_tensors(read_output(out), want)

    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    report = verify_merge(out, MergeOptions(checkpoint=q / CASE, out=out))
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]


def test_qwen3_next_refusals(tmp_path):
    """A config whose layer types are not the checkpoint's, and one without the release's MTP setting: one sentence
    each, nothing written."""
    q = _fixtures(tmp_path)
    swapped = tmp_path / "swapped"
    shutil.copytree(q / "hf_qwen3_next", swapped)
    config = json.loads((swapped / "config.json").read_text())
    config["layer_types"] = config["layer_types"][::-1]
    (swapped / "config.json").write_text(json.dumps(config))
    refused(q / CASE, tmp_path / "o1", "layer 0 is a Gated DeltaNet layer in the checkpoint but full_attention",
            base=swapped)

    no_mtp = tmp_path / "no_mtp"
    shutil.copytree(q / "hf_qwen3_next", no_mtp)
    config = json.loads((no_mtp / "config.json").read_text())
    del config["mtp_num_hidden_layers"]
    (no_mtp / "config.json").write_text(json.dumps(config))
    refused(q / CASE, tmp_path / "o2", "multi-token prediction", "mtp_num_hidden_layers", base=no_mtp)
