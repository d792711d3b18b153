"""MoE experts as Megatron MoE runs usually store them: grouped GEMM (``moe_grouped_gemm=True``) and
expert-parallel legacy rank folders, in checkpoints written by megatron-core 0.16.1 itself on CPU
(tests/fixtures/megatron/generate.py; README.md there says how):

- ``qwen3moe_grouped_tp2ep2``: a v2 dist checkpoint saved from megatron-core's GroupedMLP (TP2 x EP2).
  GroupedMLP's sharded state dict uses SequentialMLP's keys (``mlp.experts.experts.linear_fc1.weight``
  [layers, experts, rows, hidden]), so the dist checkpoint reads as before;
- ``legacy_moe_grouped_tp2ep2``: the same weights as verl <= 0.4.0 saved them, a plain ``state_dict()``
  per rank in ``mp_rank_{tp:02d}_{ep:03d}`` (no pipeline): GroupedMLP's ``mlp.experts.weight1``
  [hidden, E_local x 2F/tp] / ``weight2`` [E_local x F/tp, hidden];
- ``legacy_moe_pp2ep2``: SequentialMLP rank files in ``mp_rank_{tp:02d}_{pp:03d}_{ep:03d}``, whose
  ``local_experts.{e}`` count from 0 on every expert-parallel rank.

The reference is megatron-core's own: one process loads the saved dist checkpoint (for the legacy
cases, a dist checkpoint the same ranks saved of the same weights) into a TP1/EP1 SequentialMLP model
with ``dist_checkpointing.load`` and runs its forward; ``expected`` holds experts 1 and 2 of the last
layer (the last expert of EP rank 0 and the first of EP rank 1) as that model holds them. GroupedMLP's
own forward cannot run here (it needs the CUDA ``grouped_gemm`` kernels and bf16).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from test_megatron import _case, _reference
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"
CASES = ("qwen3moe_grouped_tp2ep2", "legacy_moe_grouped_tp2ep2", "legacy_moe_pp2ep2")
REL_TOL = 1e-4  # as tests/test_megatron.py: fp32 reduction order only


def _logits(out: Path, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    top = tmp_path_factory.mktemp("grouped")
    done = {}
    for name in CASES:
        if (FIXTURES / name / "reference.pt").is_file():
            out = top / name
            done[name] = (out, run_merge(MergeOptions(checkpoint=FIXTURES / name, out=out), fsync=False))
    return done


@pytest.mark.parametrize("name", CASES)
def test_logits_and_experts_equal_megatrons(converted, name):
    _case(name)
    out, result = converted[name]
    ref = _reference(name)
    got, want = _logits(out, ref["input_ids"]), ref["logits"]
    diff = (got - want).abs().max().item()
    assert diff <= REL_TOL * want.abs().max().item(), f"{name}: max |logit diff| {diff:.3g}"
    assert result.kind == "convert"
    ours = read_output(out)
    experts = [k for k in ref["expected"] if ".mlp.experts." in k]
    assert len(experts) == 6  # experts 1 and 2: gate, up, down
    for key, tensor in ref["expected"].items():
        if key.endswith("[:8]"):
            assert torch.equal(ours[key[:-4]][:8], tensor), key
        elif key.endswith("[-8:]"):
            assert torch.equal(ours[key[:-5]][-8:], tensor), key
        else:
            assert torch.equal(ours[key], tensor), key  # copied exactly, experts included
    assert len([k for k in ours if ".mlp.experts." in k]) == 2 * 4 * 3


def test_grouped_rank_files_and_dist_checkpoint_give_the_same_model(converted):
    """The legacy GroupedMLP rank files and the dist checkpoint of the same weights (same seeds) convert to
    bit-equal models: weight1/weight2 are cut per expert exactly as megatron's sharded state dict does."""
    for name in CASES[:2]:
        _case(name)
    a, b = read_output(converted[CASES[0]][0]), read_output(converted[CASES[1]][0])
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", CASES)
def test_swapping_two_experts_would_not_match(converted, tmp_path, name):
    """Negative control: experts 1 and 2 (held by different expert-parallel ranks) exchanged in every layer of
    the converted files move the logits far beyond the tolerance, so a numbering mistake cannot pass."""
    _case(name)
    out, _ = converted[name]
    bad = tmp_path / "swapped"
    shutil.copytree(out, bad)
    state = load_file(bad / "model.safetensors")
    for key in [k for k in state if ".mlp.experts.1." in k]:
        other = key.replace(".mlp.experts.1.", ".mlp.experts.2.")
        state[key], state[other] = state[other], state[key]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    ref = _reference(name)
    diff = (_logits(bad, ref["input_ids"]) - ref["logits"]).abs().max().item()
    assert diff > 100 * REL_TOL * ref["logits"].abs().max().item(), diff


@pytest.mark.parametrize("name", CASES[1:])
def test_verify_passes(converted, name):
    from tui_merger.core.verify.checks import verify_merge

    _case(name)
    out, _ = converted[name]
    report = verify_merge(out, MergeOptions(checkpoint=FIXTURES / name, out=out))
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]


def test_inspect_offers_the_expert_parallel_legacy_run():
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import why_not_mergeable

    for name in CASES[1:]:
        _case(name)
        (c,) = [c for c in scan(FIXTURES / name).candidates if c.kind == "verl-megatron"]
        assert c.backend == "megatron-legacy" and c.world_size == 4
        assert why_not_mergeable(c) is None


# -- bad input: one sentence, nothing written ----------------------------------------------------------


def _copy(tmp_path: Path, name: str) -> Path:
    _case(name)
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run, ignore=shutil.ignore_patterns("reference.pt"))
    return run


def _refused(capsys, tmp_path, run, *needles):
    from factory import refused_by_cli

    args = ["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(tmp_path / "merged"),
            "--plain"]
    return refused_by_cli(capsys, tmp_path, args, needles, extra_leftover=".merged")


def _model_dir(run: Path) -> Path:
    return run / "global_step_1" / "actor" / "model"


def _config(run: Path) -> Path:
    return run / "global_step_1" / "actor" / "hf_config_and_tokenizer" / "config.json"


def test_missing_expert_parallel_rank(tmp_path, capsys):
    run = _copy(tmp_path, "legacy_moe_pp2ep2")
    shutil.rmtree(_model_dir(run) / "mp_rank_00_001_001")
    _refused(capsys, tmp_path, run, "mp_rank_00_001_001", "missing", "1x2x2 (tensor x pipeline x expert)")


def test_grouped_experts_with_a_config_of_another_expert_count(tmp_path, capsys):
    import json

    run = _copy(tmp_path, "legacy_moe_grouped_tp2ep2")
    cfg = json.loads(_config(run).read_text())
    cfg["num_experts"] = cfg["num_local_experts"] = 8
    _config(run).write_text(json.dumps(cfg))
    _refused(capsys, tmp_path, run, "experts.weight1", "does not hold 4 experts per rank", "8 experts over 2")


def test_sequential_experts_with_a_config_of_another_expert_count(tmp_path, capsys):
    import json

    run = _copy(tmp_path, "legacy_moe_pp2ep2")
    cfg = json.loads(_config(run).read_text())
    cfg["num_experts"] = cfg["num_local_experts"] = 6
    _config(run).write_text(json.dumps(cfg))
    _refused(capsys, tmp_path, run, "6 experts", "holds experts 0..3")


def test_rank_folders_named_two_ways(tmp_path, capsys):
    run = _copy(tmp_path, "legacy_moe_grouped_tp2ep2")
    (_model_dir(run) / "mp_rank_01_001").rename(_model_dir(run) / "mp_rank_01_000_001")
    _refused(capsys, tmp_path, run, "named in different ways", "different runs")


def test_an_expert_rank_from_another_run(tmp_path, capsys):
    """An expert-parallel rank whose replicated (non-expert) parameters are not the others': refused."""
    run = _copy(tmp_path, "legacy_moe_grouped_tp2ep2")
    for tp in range(2):
        path = _model_dir(run) / f"mp_rank_{tp:02d}_001" / "model.pt"
        chunks = torch.load(path, weights_only=True)
        del chunks[0]["decoder.layers.1.self_attention.q_layernorm.weight"]
        torch.save(chunks, path)
    _refused(capsys, tmp_path, run, "mp_rank_00_001", "different parameters", "mp_rank_00_000")
