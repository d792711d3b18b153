"""Megatron-LM's own checkpoints (tests/fixtures/megatron_lm, written by Megatron-LM's
``training.checkpointing.save_checkpoint`` on CPU: see generate.py there), in the torch_dist format
(``iter_NNNNNNN/{.metadata, __*_*.distcp, common.pt, metadata.json}``) and the legacy one
(``iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt``), with ``latest_checkpointed_iteration.txt``.

The reference is the tiny Hugging Face model written by ``save_pretrained`` (``hf_dense/``, ``hf_moe/``) that
the generator put into Megatron's layout with its own code and checked with Megatron's own forward against
transformers' before saving: every converted tensor must equal it bit for bit. The runs recorded
``--tokenizer-model hf_dense`` (relative, as a user types it), which is how the Hugging Face config is found.
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
from megatron_helpers import same_tensors

from tui_merger.core.formats.registry import format_of
from tui_merger.core.formats.scan import scan

LM = Path(__file__).resolve().parent / "fixtures" / "megatron_lm"
DENSE = "GPT (2 layers, hidden 32, 4 heads in 2 query groups, SwiGLU, qkv bias, RMSNorm)"
MOE = "GPT (2 layers, hidden 32, 4 heads in 2 query groups, SwiGLU, q/k norm, RMSNorm, MoE 4 experts, top 2)"
CASES = {  # case: (reference, dtype, parallel sizes as inspect says them, format, rank folders)
    "lm_dense_tp2": ("hf_dense", "bfloat16", "common.pt: TP 2, PP 1, EP 1", "dist", 2),
    "lm_legacy_tp2": ("hf_dense", "bfloat16", "model_optim_rng.pt: TP 2, PP 1, EP 1", "legacy", 2),
    "lm_legacy_pp2": ("hf_dense", "bfloat16", "model_optim_rng.pt: TP 1, PP 2, EP 1", "legacy", 2),
    "lm_moe_ep2": ("hf_moe", "float32", "common.pt: TP 1, PP 1, EP 2", "dist", 2),
    "lm_legacy_moe_ep2": ("hf_moe", "float32", "model_optim_rng.pt: TP 1, PP 1, EP 2", "legacy", 2),
    "lm_legacy_moe_pp2ep2": ("hf_moe", "float32", "model_optim_rng.pt: TP 1, PP 2, EP 2", "legacy", 4),
    "lm_legacy_pp2vpp2": ("hf_dense4", "bfloat16", "model_optim_rng.pt: TP 1, PP 2, EP 1, VPP 2", "legacy", 2),
    "lm_dense_pp2vpp2": ("hf_dense4", "bfloat16", "common.pt: TP 1, PP 2, EP 1, VPP 2", "dist", 2),
    # expert tensor parallelism 2 (TP 1) x EP 2: 4 processes, each expert's fc1/fc2 split over 2 ranks
    "lm_moe_etp2ep2": ("hf_moe", "float32", "common.pt: TP 1, PP 1, EP 2, ETP 2", "dist", 4),
    # --ckpt-format torch_dcp (torch FSDP2 over 2 data-parallel ranks), saved with its optimizer after one step
    "lm_dcp_dp2_optim": ("hf_dense", "bfloat16", "__0_0.distcp: TP 1, PP 1, EP 1", "dcp", 2),
}
WHAT = {"legacy": "a legacy Megatron checkpoint (mp_rank_*/model_optim_rng.pt)", "dist": "a megatron-core dist",
        "dcp": "a torch.distributed.checkpoint of the whole state dict (--ckpt-format torch_dcp)"}


def _case(case: str) -> Path:
    run = LM / case
    if not (run / "latest_checkpointed_iteration.txt").is_file():
        pytest.skip(f"fixture {case} is not generated (generate.py)")
    return run


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """The Hugging Face cache these tests see: empty (nothing is found there by accident)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _equal_to(out: Path, reference: str) -> None:
    from safetensors.torch import load_file

    same_tensors(read_output(out), load_file(LM / reference / "model.safetensors"))


# -- inspect ---------------------------------------------------------------------------------------------


def test_inspect_lists_the_iterations_proposes_the_tracked_one_and_reads_the_args():
    result = scan(_case("lm_dense_tp2"))
    assert not result.problems, result.problems
    got = [(Path(c.path).name, c.step, c.latest, c.backend, c.world_size, c.dtype) for c in result.candidates]
    assert got == [("iter_0000004", 4, True, "megatron-lm", 2, "bfloat16"),
                   ("iter_0000002", 2, False, "megatron-lm", 2, "bfloat16")]
    c = result.candidates[0]
    notes = " ".join(c.notes)
    assert "saved by Megatron-LM (common.pt: TP 2, PP 1, EP 1)" in notes and f"model family: {DENSE}." in notes, notes
    # the run's --tokenizer-model names the Hugging Face model, relative to where it ran: found, no --base needed
    assert c.base_path == str(LM / "hf_dense") and not c.needs_base and not format_of(c).needs_base(c)
    assert "named by args.tokenizer_model in common.pt" in notes, notes
    step = format_of(c).next_step(c, c.path, "BASE", "out")
    assert "iter_0000004" in step and "--base" not in step, step


@pytest.mark.parametrize("case", [c for c in CASES if c != "lm_dense_tp2"])
def test_inspect_shows_each_layout(case):
    reference, dtype, sizes, kind, ranks = CASES[case]
    (c,) = scan(_case(case)).candidates
    notes = " ".join(c.notes)
    assert (Path(c.path).name, c.step, c.latest, c.world_size, c.dtype) == ("iter_0000004", 4, True, ranks, dtype)
    assert WHAT[kind] in notes and sizes in notes, notes
    family = MOE if "moe" in case else DENSE.replace("2 layers", "4 layers") if "vpp" in case else DENSE
    assert f"model family: {family}." in notes, notes
    assert c.base_path == str(LM / reference), notes


# -- conversion --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_lms_own_save_converts_to_the_weights_it_was_given(tmp_path, case):
    """Each save, its Hugging Face config taken from the model its args name: every tensor equal to
    save_pretrained's (Megatron's vocabulary padding left out), nothing else written."""
    result = _merge(_case(case), tmp_path / "out")
    assert any("named by args.tokenizer_model" in w for w in result.warnings), result.warnings
    _equal_to(tmp_path / "out", CASES[case][0])


def test_the_new_users_case_with_and_without_base(tmp_path):
    """The issue's case: ckpt/latest_checkpointed_iteration.txt naming 1 and ckpt/iter_0000001/ in torch_dist,
    moved away from the model its args name: inspect finds it and says --base is needed; merge without
    --base says why in one sentence and writes nothing; with --base it converts."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(_case("lm_dense_tp2") / "iter_0000004", ckpt / "iter_0000001")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    (c,) = scan(ckpt).candidates
    assert (Path(c.path).name, c.step, c.latest, c.backend) == ("iter_0000001", 1, True, "megatron-lm")
    assert c.needs_base and c.base_path is None and c.base_model == "hf_dense"
    assert any("names hf_dense (args.tokenizer_model), which is not on this machine" in n for n in c.notes), c.notes
    _refused(ckpt, tmp_path / "o1", "Megatron-LM", "hf_dense (args.tokenizer_model)", "--base")
    _merge(ckpt, tmp_path / "o2", base=LM / "hf_dense")
    _equal_to(tmp_path / "o2", "hf_dense")
    # a folder of that name whose config is another model's (a borrowed tokenizer): not used, said why
    other = tmp_path / "hf_dense"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
                                                   "num_attention_heads": 4}))
    (c,) = scan(ckpt).candidates
    assert c.needs_base and c.base_path is None, c.notes
    said = "but its config.json says hidden size 64 where the run's arguments say 32; pass --base"
    assert any(said in n for n in c.notes), c.notes
    _refused(ckpt, tmp_path / "o3", said)


# -- bad input --------------------------------------------------------------------------------------------


def _copy(tmp: Path, case: str) -> Path:
    run = tmp / case
    shutil.copytree(_case(case), run)
    return run


def test_an_iteration_missing_files_is_said_and_nothing_is_written(tmp_path):
    base = LM / "hf_dense"
    run = _copy(tmp_path, "lm_dense_tp2")
    (run / "iter_0000004" / "__1_0.distcp").unlink()
    _refused(run, tmp_path / "o1", "__1_0.distcp is missing", "copy", base=base)
    (run / "iter_0000004" / ".metadata").unlink()
    _refused(run, tmp_path / "o2", "has no .metadata", base=base)
    (run / "latest_checkpointed_iteration.txt").write_text("6")
    _refused(run, tmp_path / "o3", "names iter_0000006", "does not exist", base=base)
    legacy = _copy(tmp_path, "lm_legacy_tp2")
    shutil.rmtree(legacy / "iter_0000004" / "mp_rank_01")
    # the args say two tensor-parallel ranks: the missing one is named (not read as a TP 1 checkpoint)
    _refused(legacy, tmp_path / "o4", "mp_rank_01/model_optim_rng.pt is missing", "TP 2 x PP 1 x EP 1", base=base)
    pp = _copy(tmp_path, "lm_legacy_pp2")
    (pp / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt").unlink()
    _refused(pp, tmp_path / "o5", "mp_rank_00_001/model_optim_rng.pt is missing", "TP 1 x PP 2", base=base)


def test_a_layout_version_we_do_not_read_is_said_and_nothing_is_written(tmp_path):
    run = _copy(tmp_path, "lm_dense_tp2")
    meta = run / "iter_0000004" / "metadata.json"
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "sharded_backend_version": 2}))
    _refused(run, tmp_path / "o1", "torch_dist checkpoint of version 2", "--ckpt-convert-format torch")
    meta.write_text(json.dumps({**data, "sharded_backend": "zarr"}))
    _refused(run, tmp_path / "o2", "in the zarr format", "--ckpt-convert-format torch_dist")
    # Megatron-LM's legacy model classes (--use-legacy-models): other tensor names, said by its args (a rank
    # file written here as generate_state_dict writes one; Megatron-LM's own args hold its enums, not loadable here)
    import argparse

    legacy = tmp_path / "old" / "iter_0000001" / "mp_rank_00"
    legacy.mkdir(parents=True)
    args = argparse.Namespace(use_legacy_models=True, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              expert_model_parallel_size=1, num_layers=2, hidden_size=32, num_attention_heads=4)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                "model": {"language_model": {"embedding": {"word_embeddings": {"weight": torch.zeros(4, 4)}}}}},
               legacy / "model_optim_rng.pt")
    _refused(legacy.parent.parent, tmp_path / "o3", "--use-legacy-models", "--loader legacy --saver core",
             base=LM / "hf_dense")
    args.use_legacy_models = False
    torch.save({"args": args, "checkpoint_version": 2.0, "iteration": 1, "model": {}}, legacy / "model_optim_rng.pt")
    _refused(legacy.parent.parent, tmp_path / "o4", "checkpoint_version 2.0", base=LM / "hf_dense")


# -- torch_dcp, optimizer state, fsdp_dtensor ------------------------------------------------------------


def _dcp_storage(folder: Path) -> dict:
    """key -> [(file, offset, length)] as torch.distributed.checkpoint's own reader sees the folder."""
    from torch.distributed.checkpoint import FileSystemReader

    where: dict = {}
    for index, info in FileSystemReader(str(folder)).read_metadata().storage_data.items():
        where.setdefault(index.fqn, []).append((info.relative_path, info.offset, info.length))
    return where


def test_the_optimizer_state_of_a_real_save_is_never_read(tmp_path):
    """lm_dcp_dp2_optim holds what Megatron-LM's save_checkpoint wrote after one training step: Adam's exp_avg /
    exp_avg_sq and the fp32 master weights beside the model, most of the files' bytes. Every byte of every
    optimizer.* entry is overwritten with garbage: the conversion is still the save_pretrained weights bit for bit
    and verifies, so not one of those bytes was read (nor the RNG state's)."""
    from torch.distributed.checkpoint import FileSystemReader

    run = _copy(tmp_path, "lm_dcp_dp2_optim")
    it = run / "iter_0000004"
    where = _dcp_storage(it)
    optim = {k: v for k, v in where.items() if k.startswith("optimizer.")}
    assert any(k.endswith(".exp_avg_sq") for k in optim) and any("fp32_from_fp16_params" in k for k in optim), sorted(where)
    # Adam's state is a real step's: read back with torch's own reader, not zero
    meta = FileSystemReader(str(it)).read_metadata().state_dict_metadata
    state = {"optimizer.optimizer.state.0.exp_avg_sq": torch.empty(meta["optimizer.optimizer.state.0.exp_avg_sq"].size)}
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=FileSystemReader(str(it)), no_dist=True)
    assert state["optimizer.optimizer.state.0.exp_avg_sq"].abs().sum() > 0
    spoiled = 0
    total = sum(p.stat().st_size for p in it.glob("*.distcp"))
    for key, ranges in where.items():
        if key.startswith(("optimizer.", "rng_state")):
            for rel, offset, length in ranges:
                with open(it / rel, "r+b") as f:
                    f.seek(offset)
                    f.write(b"\xff" * length)
                spoiled += length if key.startswith("optimizer.") else 0
    assert spoiled > total / 2, (spoiled, total)  # the optimizer is most of the checkpoint
    from tui_merger.core.verify.checks import verify_merge
    from tui_merger.core.options import MergeOptions

    _merge(run, tmp_path / "out", base=LM / "hf_dense")
    _equal_to(tmp_path / "out", "hf_dense")
    report = verify_merge(tmp_path / "out", MergeOptions(checkpoint=run, out=tmp_path / "out", base=LM / "hf_dense"))
    assert report.passed, [(c.name, c.status, c.summary) for c in report.checks]


def test_fsdp_dtensor_is_refused_in_one_sentence(tmp_path):
    """Megatron-LM's fsdp_dtensor format (Megatron FSDP; its save and its converter did not run on a CPU: see
    generate.py) written here from its definition (checkpoint_inspector.py convert_checkpoint at core_v0.16.1:
    the model under ``model.module.``, SwiGLU's linear_fc1 split into ``weight_w`` / ``weight_v``) by
    torch.distributed.checkpoint from the torch_dcp save's own tensors: inspect and merge say it is not read."""
    import torch.distributed.checkpoint as dcp

    src = _case("lm_dcp_dp2_optim") / "iter_0000004"
    meta = dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith("model.") and hasattr(m, "size")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(src)), no_dist=True)
    out = {}
    for key, t in state.items():
        key = "model.module." + key.removeprefix("model.")
        if key.endswith("mlp.linear_fc1.weight"):
            out[key + "_w"], out[key + "_v"] = t.chunk(2)
        else:
            out[key] = t
    run = tmp_path / "lm_fsdp_dtensor"
    dcp.save(out, storage_writer=dcp.FileSystemWriter(str(run / "iter_0000004")), no_dist=True)
    (run / "latest_checkpointed_iteration.txt").write_text("4")
    said = _refused(run, tmp_path / "o", "fsdp_dtensor format", "--ckpt-convert-format torch_dist", base=LM / "hf_dense")
    (c,) = scan(run).candidates
    assert c.kind == "megatron-lm" and said in c.notes, c.notes
    assert format_of(c).next_step(c, c.path, "BASE", "out") == said


def test_legacy_format_with_expert_tensor_parallelism_is_refused(tmp_path):
    """Megatron-LM's own legacy save at ETP 2 x EP 2 with TP 1 (4 processes): its rank files are named by TP and EP
    rank only, so the 4 ranks wrote 2 files, each holding one expert-TP half of its experts. Refused in one
    sentence that says so (before, the half experts were blamed on the config), nothing written; inspect says it."""
    run = _copy(tmp_path, "lm_legacy_moe_etp2ep2")
    assert sorted(p.name for p in (run / "iter_0000004").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    said = _refused(run, tmp_path / "o", "expert tensor parallelism 2 and tensor parallelism 1", "--ckpt-format torch_dist",
                    base=LM / "hf_moe")
    (c,) = scan(_case("lm_legacy_moe_etp2ep2")).candidates
    assert said.replace(str(run), str(LM / "lm_legacy_moe_etp2ep2")) in c.notes, c.notes
