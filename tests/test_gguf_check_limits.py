"""The GGUF check's f16/bf16 limit derived from the model's own rounding (gguf_check.ROUNDED, OWN_FACTOR):
transformers on tiny models only (CI has no llama.cpp); benchmarks/gguf_limit_check.py measures it against
llama.cpp itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from test_gguf_families import make_family
from tui_merger.core.ship.gguf_check import (
    FAILED, LIMITS, MOE_CEILING, OWN_FACTOR, PASSED, _Read, _reference, _verdict,
)


def _scaled(folder: Path, dest: Path, pattern: str, factor: float) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    for f in dest.glob("*.safetensors"):
        state = load_file(f)
        for name in state:
            if pattern in name:
                state[name] = state[name] * factor
        save_file(state, f, metadata={"format": "pt"})
    return dest


def _own(ref) -> float:
    scale = ref.logits.abs().max()
    return float(((ref.rounded - ref.logits).abs().max(-1).values / scale).max())


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return make_family(tmp_path_factory.mktemp("limits") / "llama", "llama")


def test_a_sharp_attention_model_moves_more_under_the_same_rounding(plain, tmp_path):
    """Gemma 3 (q/k norms: sharp attention scores) moves its logits more under bf16's rounding than a plain
    Llama of the same size, so its derived limit is wider; the plain model's stays at LIMITS."""
    gemma = make_family(tmp_path / "gemma3", "gemma3_text")
    own_plain, own_sharp = _own(_reference(plain, None, type_="bf16")), _own(_reference(gemma, None, type_="bf16"))
    assert 0 < own_plain < LIMITS["bf16"] / OWN_FACTOR
    assert own_sharp > 2 * own_plain, (own_sharp, own_plain)
    f16 = _reference(plain, None, type_="f16")
    assert 0 < _own(f16) < own_plain  # f16 keeps 3 more bits than bf16
    assert _reference(plain, None, type_="q8_0").rounded is None  # quantized types keep their own limits


def test_the_models_own_rounding_passes_and_a_scaled_tensor_fails(plain, tmp_path):
    """The verdict on real logits: transformers' own forward with the weights and linear inputs rounded to
    f16 (what an f16 GGUF run by llama.cpp's CPU does) passes against its own derived limit; the same model
    with one layer's gate projection scaled by 1.1 fails."""
    ref = _reference(plain, None, type_="f16")
    ids = [list(i) for i in ref.ids]
    check = _verdict(ref, _Read(ids, ref.rounded.clone()), LIMITS["f16"], "f16", "test")
    own = check.details["own_rounding_rel"]
    assert check.status == PASSED, check.summary
    assert check.details["limit"] == pytest.approx(max(LIMITS["f16"], OWN_FACTOR * own), rel=1e-2)
    assert f"own f16 rounding moves them {own:.2g}" in check.summary
    bad = _scaled(plain, tmp_path / "bad", "layers.0.mlp.gate_proj.", 1.1)
    wrong = _reference(bad, None, type_="f16").rounded
    check = _verdict(ref, _Read(ids, wrong), LIMITS["f16"], "f16", "test")
    assert check.status == FAILED, check.summary


def test_a_derived_limit_above_the_fixed_one_is_said(plain):
    """A model whose own rounding spread is over a third of LIMITS gets 3x it, and the summary says where
    the limit comes from."""
    ref = _reference(plain, None, type_="bf16")
    scale = ref.logits.abs().max()
    ref.rounded = ref.logits + (ref.rounded - ref.logits) * (LIMITS["bf16"] * scale / (ref.rounded - ref.logits).abs().max())
    have = ref.logits + (ref.rounded - ref.logits) * 2  # twice the model's own spread: 0.04 > the fixed 0.02
    check = _verdict(ref, _Read([list(i) for i in ref.ids], have), LIMITS["bf16"], "bf16", "test")
    assert check.status == PASSED and check.details["limit"] == pytest.approx(OWN_FACTOR * LIMITS["bf16"], rel=1e-2)
    assert "limit 0.06 from this model's own bf16 rounding, 3 x 0.02" in check.summary, check.summary
    check = _verdict(ref, _Read([list(i) for i in ref.ids], ref.logits + (ref.rounded - ref.logits) * 4), LIMITS["bf16"],
                     "bf16", "test")
    assert check.status == FAILED, check.summary


def test_a_mixture_of_experts_where_its_own_rounding_turns_the_router(plain):
    """Where the reference rounded to the type moves one position far (an expert choice turned, as Qwen3-Next
    bf16 seed 0 at position 40), the file is held there to that rounded reference: the same turn passes,
    said in the summary; a file that differs from both there fails."""
    ref = _reference(plain, None, type_="bf16")
    ids = [list(i) for i in ref.ids]
    k = len(ref.prompt) // 2
    ref.rounded[k] = ref.logits[k - 1]  # another position's logits: far beyond any rounding
    check = _verdict(ref, _Read(ids, ref.rounded.clone()), LIMITS["bf16"], "bf16", "test", experts=4)
    assert check.status == PASSED and check.details["positions_turned_by_own_rounding"] == 1, check.summary
    assert "where this model's own bf16 rounding turns an expert choice" in check.summary
    other = ref.rounded.clone()
    other[k] = ref.logits[k + 1]
    check = _verdict(ref, _Read(ids, other), LIMITS["bf16"], "bf16", "test", experts=4)
    assert check.status == FAILED and check.details["logits_rel"] > MOE_CEILING * LIMITS["bf16"], check.summary


def test_a_dense_model_is_held_at_its_median_position_too(plain):
    """One sharp position whose own rounding moves it by 2x LIMITS widens the limit of the largest position,
    not of every position: a file 0.03 off at every position (what a wrong tensor does) fails on its median."""
    ref = _reference(plain, None, type_="bf16")
    scale = ref.logits.abs().max()
    k = len(ref.prompt) // 2
    ref.rounded = ref.logits.clone()
    ref.rounded[k, 0] += 2 * LIMITS["bf16"] * scale
    ids = [list(i) for i in ref.ids]
    have = ref.logits.clone()
    have[:, 0] += 0.03 * scale
    check = _verdict(ref, _Read(ids, have), LIMITS["bf16"], "bf16", "test")
    assert check.details["limit"] == pytest.approx(0.12, rel=1e-2) and check.details["limit_median"] == LIMITS["bf16"]
    assert check.status == FAILED and "at the median position (limit 0.02)" in check.summary, check.summary
    have = ref.logits.clone()
    have[k, 0] += 0.03 * scale  # the same move at the sharp position alone
    assert _verdict(ref, _Read(ids, have), LIMITS["bf16"], "bf16", "test").status == PASSED
