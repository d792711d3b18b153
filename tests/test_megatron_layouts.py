"""megatron-core dist checkpoints saved outside verl: Megatron-LM's, Megatron-Bridge's and ms-swift's
``iter_NNNNNNN`` folders with their tracker file, NeMo 2's ``weights/`` + ``context/``.

The payload is megatron-core's own dist checkpoint (tests/fixtures/megatron, written by megatron-core
0.16.1), the same files every framework writes; each test lays it out the way the framework's save
function does (tests/fixtures/megatron_layouts/README.md, with the source lines) beside the small run
configuration that framework writes. The verl layout of the same payload is tested against
megatron-core's own forward in test_megatron.py; here each layout must convert to exactly the same
tensors.
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
from megatron_helpers import dcp_tensors, same_tensors

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.registry import checkpoint_format, format_of
from tui_merger.core.formats.scan import scan
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

MEGATRON = Path(__file__).resolve().parent / "fixtures" / "megatron"
LAYOUTS = Path(__file__).resolve().parent / "fixtures" / "megatron_layouts"
HUB_ID = "Qwen/Qwen2-0.5B"  # what the hand-written run configurations name (not on this machine)


def _payload(case: str) -> tuple[Path, Path]:
    """(the dist checkpoint, the Hugging Face config folder) of a verl v2 fixture."""
    actor = MEGATRON / case / "global_step_1" / "actor"
    if not (actor / "model" / "dist_ckpt" / ".metadata").is_file():
        pytest.skip(f"fixture {case} is not generated")
    return actor / "model" / "dist_ckpt", actor / "model" / "huggingface"


def _iteration(folder: Path, case: str = "qwen2_tp2") -> Path:
    shutil.copytree(_payload(case)[0], folder)
    return folder


def _base(tmp: Path, case: str = "qwen2_tp2") -> Path:
    base = tmp / "hf-base"
    shutil.copytree(_payload(case)[1], base)
    return base


def _megatron_lm(tmp: Path, iters=(1, 2), latest="2", case: str = "qwen2_tp2") -> Path:
    """Megatron-LM's save folder (training/checkpointing.py: get_checkpoint_name, the tracker file)."""
    ckpt = tmp / "ckpt"
    for n in iters:
        _iteration(ckpt / (n if isinstance(n, str) else f"iter_{n:07d}"), case)
    ckpt.mkdir(parents=True, exist_ok=True)
    if latest is not None:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(latest)
    return ckpt


def _megatron_lm_common(iteration: Path, **args) -> None:
    """common.pt as megatron-core's save_common writes it (dist_checkpointing/strategies/common.py:20-29,
    torch.save of the non-sharded part of Megatron-LM's generate_state_dict: args, version, iteration, the
    scheduler's and RNG-free state)."""
    import argparse

    values = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                  virtual_pipeline_model_parallel_size=None, params_dtype=torch.bfloat16, ckpt_format="torch_dist",
                  tokenizer_type="GPT2BPETokenizer", tokenizer_model=None)
    values.update(args)
    torch.save({"args": argparse.Namespace(**values), "checkpoint_version": 3.0, "iteration": 1,
                "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 1}, "num_floating_point_operations_so_far": 0},
               iteration / "common.pt")


def _megatron_lm_legacy(tmp: Path, case: str) -> Path:
    """Megatron-LM's legacy torch format (training/checkpointing.py: get_checkpoint_name with its
    mp_rank_XX[_YYY][_ZZZ] folders, generate_state_dict's {"args", "checkpoint_version", "iteration",
    "model" | "model0".., "optimizer", "opt_param_scheduler", "rng_state", ...}), written by torch.save from
    the state dicts megatron-core wrote for the verl legacy fixture of the same ranks."""
    import argparse
    import random

    import numpy as np

    src = MEGATRON / case / "global_step_1" / "actor" / "model"
    ckpt = tmp / "ckpt"
    for rank in sorted(p for p in src.iterdir() if p.name.startswith("mp_rank_")):
        chunks = torch.load(rank / "model.pt", weights_only=True)
        models = {"model": chunks[0]} if len(chunks) == 1 else {f"model{i}": c for i, c in enumerate(chunks)}
        args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, params_dtype=torch.float32,
                                  ckpt_format="torch", save="/runs/ckpt", iteration=1)
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 1, **models,
                 "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 1}, "rng_state": [rng],
                 "num_floating_point_operations_so_far": 0}
        (ckpt / "iter_0000001" / rank.name).mkdir(parents=True)
        torch.save(state, ckpt / "iter_0000001" / rank.name / "model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    return ckpt


def _bridge(tmp: Path, hf_model_id: str) -> Path:
    ckpt = _megatron_lm(tmp, iters=(1,), latest="1")
    text = (LAYOUTS / "megatron_bridge" / "run_config.yaml").read_text().replace(HUB_ID, hf_model_id)
    (ckpt / "iter_0000001" / "run_config.yaml").write_text(text)
    return ckpt


def _swift(tmp: Path, model_dir: str, case: str = "qwen2_tp2", **changes) -> Path:
    """ms-swift's checkpoint-N folder (megatron/trainers/base.py save_checkpoint, save_mcore_checkpoint)."""
    out = tmp / "megatron_output" / "v0-20260101-000000"
    checkpoint = out / "checkpoint-1"
    _iteration(checkpoint / "iter_0000001", case)
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("1")
    args = json.loads((LAYOUTS / "ms_swift" / "args.json").read_text())
    args.update(model_dir=model_dir, **changes)
    (out / "args.json").write_text(json.dumps(args))
    shutil.copy(out / "args.json", checkpoint / "args.json")
    return checkpoint


def test_swift_output_folder_proposes_the_newest_checkpoint(tmp_path):
    first = _swift(tmp_path, "/nowhere/Qwen2-0.5B")
    out = first.parent
    second = out / "checkpoint-3"
    _iteration(second / "iter_0000003")
    (second / "latest_checkpointed_iteration.txt").write_text("3")
    shutil.copy(first / "args.json", second / "args.json")
    cands = scan(out).candidates
    assert [(c.step, c.latest, c.run) for c in cands] == [(3, True, str(out)), (1, False, str(out))]
    base = _base(tmp_path)
    inputs = checkpoint_format(out).open(MergeOptions(checkpoint=out, out=tmp_path / "x", base=base))
    inputs.close()
    assert "Using the newest checkpoint, checkpoint-3." in inputs.notices
    assert all(str(second / "iter_0000003") in str(f) for f in inputs.read_files if str(f).endswith(".distcp"))


def test_swift_model_dir_elsewhere_falls_back_to_model(tmp_path, verl_converted):
    base = _base(tmp_path)
    checkpoint = _swift(tmp_path, "/root/.cache/modelscope/hub/models/Qwen/Qwen2-0.5B", model=str(base))
    (c,) = scan(checkpoint).candidates
    assert c.base_path == str(base) and not format_of(c).needs_base(c)
    _merge(checkpoint, tmp_path / "out")
    _same_tensors(tmp_path / "out", verl_converted("qwen2_tp2"))
    nowhere = _swift(tmp_path / "n", "/root/.cache/modelscope/hub/models/Qwen/Qwen2-0.5B")
    message = _refused(nowhere, tmp_path / "o", "(model_dir) and Qwen/Qwen2-0.5B (model), neither of which")
    assert "--base" in message


def _nemo2(tmp: Path) -> Path:
    folder = tmp / "checkpoints" / "default--reduced_train_loss=1.0-epoch=0-step=1"
    _iteration(folder / "weights")
    shutil.copytree(LAYOUTS / "nemo2" / "context", folder / "context")
    return folder


def _same_tensors(a: Path, b: Path) -> None:
    same_tensors(read_output(a), read_output(b))


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """The Hugging Face cache these tests see: empty unless a test puts a model there."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture(scope="module")
def verl_converted(tmp_path_factory):
    """The verl layout of each payload, converted once (tested against megatron's forward elsewhere)."""
    done = {}

    def get(case: str) -> Path:
        if case not in done:
            out = tmp_path_factory.mktemp("verl") / case
            run_merge(MergeOptions(checkpoint=MEGATRON / case / "global_step_1" / "actor", out=out), fsync=False)
            done[case] = out
        return done[case]

    return get


# -- inspect -------------------------------------------------------------------------------------------


def test_inspect_lists_megatron_lm_iterations_and_proposes_the_tracked_one(tmp_path):
    ckpt = _megatron_lm(tmp_path, iters=(1, 2, 3), latest="2")
    result = scan(ckpt)
    assert not result.problems
    got = [(Path(c.path).name, c.step, c.latest, c.backend, c.world_size, c.dtype) for c in result.candidates]
    assert got == [
        ("iter_0000003", 3, False, "megatron-lm", 2, "float32"),
        ("iter_0000002", 2, True, "megatron-lm", 2, "float32"),
        ("iter_0000001", 1, False, "megatron-lm", 2, "float32"),
    ]
    c = result.candidates[1]
    assert c.needs_base and c.base_path is None
    step = format_of(c).next_step(c, c.path, "BASE", "out")
    assert "--base BASE" in step and "iter_0000002" in step


def test_inspect_reads_megatron_lms_args_and_its_hugging_face_tokenizer(tmp_path, verl_converted):
    base = _base(tmp_path)
    ckpt = _megatron_lm(tmp_path, iters=(1,), latest="1")
    _megatron_lm_common(ckpt / "iter_0000001", tensor_model_parallel_size=2, expert_model_parallel_size=4,
                        tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(base))
    (c,) = scan(ckpt).candidates
    assert c.dtype == "bfloat16" and any("common.pt: TP 2, PP 1, EP 4)" in n for n in c.notes), c.notes
    assert c.base_path == str(base) and not format_of(c).needs_base(c)
    _merge(ckpt, tmp_path / "out")  # the config from the tokenizer's folder, said so
    _same_tensors(tmp_path / "out", verl_converted("qwen2_tp2"))
    _megatron_lm_common(ckpt / "iter_0000001")  # a tokenizer that names no model: --base is needed
    (c,) = scan(ckpt).candidates
    assert c.needs_base and c.base_path is None and c.dtype == "bfloat16"


def test_inspect_newest_without_tracker_and_release(tmp_path):
    ckpt = _megatron_lm(tmp_path, iters=(1, 20), latest=None)
    assert [c.latest for c in scan(ckpt).candidates] == [True, False]  # the highest step
    other = _megatron_lm(tmp_path / "rel", iters=("release", 5), latest="release")
    result = scan(other)
    assert not result.problems
    assert [(Path(c.path).name, c.step, c.latest) for c in result.candidates] == [
        ("iter_0000005", 5, False), ("release", None, True)]
    (other / "latest_checkpointed_iteration.txt").write_text("5")
    assert [c.latest for c in scan(other).candidates] == [True, False]


def test_inspect_shows_what_the_run_configuration_records(tmp_path):
    base = _base(tmp_path)
    (c,) = scan(_bridge(tmp_path / "b", str(base))).candidates
    assert c.backend == "megatron-bridge" and c.dtype == "float32" and c.base_path == str(base)
    assert not format_of(c).needs_base(c)
    assert any("TP 2, PP 1, EP 1" in n for n in c.notes) and any("Qwen2ModelProvider" in n for n in c.notes)
    (c,) = scan(_swift(tmp_path / "s", "/nowhere/Qwen2-0.5B", case="qwen3moe_ep2", expert_model_parallel_size=2,
                       tensor_model_parallel_size=1, model_type="qwen3_moe")).candidates
    assert c.backend == "ms-swift" and c.step == 1 and c.latest
    assert any("TP 1, PP 1, EP 2" in n for n in c.notes) and any("qwen3_moe" in n for n in c.notes)
    assert c.base_resolves == "missing" and format_of(c).needs_base(c)
    (c,) = scan(_nemo2(tmp_path / "n")).candidates
    assert c.backend == "nemo2" and c.needs_base and any("Qwen2Model" in n for n in c.notes)


# -- the conversion equals the verl layout's -------------------------------------------------------------


@pytest.mark.parametrize("case", ["qwen2_tp2", "qwen3moe_ep2"])
def test_megatron_lm_layout_converts_like_the_verl_layout(tmp_path, verl_converted, case):
    ckpt = _megatron_lm(tmp_path, iters=(1, 2), latest="2", case=case)
    shutil.rmtree(ckpt / "iter_0000001")  # the run folder is given: the tracked iteration is read
    result = _merge(ckpt, tmp_path / "out", base=_base(tmp_path, case))
    assert result.kind == "convert"
    _same_tensors(tmp_path / "out", verl_converted(case))


@pytest.mark.parametrize("case", ["legacy_tp2pp2", "legacy_moe_pp2ep2"])
def test_megatron_lm_legacy_format_converts_like_verls_legacy_layout(tmp_path, verl_converted, case):
    if not (MEGATRON / case / "reference.pt").is_file():
        pytest.skip(f"fixture {case} is not generated")
    ckpt = _megatron_lm_legacy(tmp_path, case)
    (c,) = scan(ckpt).candidates
    assert c.backend == "megatron-lm" and c.latest and c.world_size == 4
    assert any("legacy Megatron checkpoint" in n for n in c.notes)
    base = tmp_path / "hf-base"
    shutil.copytree(MEGATRON / case / "global_step_1" / "actor" / "hf_config_and_tokenizer", base)
    _merge(ckpt, tmp_path / "out", base=base)
    _same_tensors(tmp_path / "out", verl_converted(case))


def test_bridge_base_from_run_config(tmp_path, verl_converted):
    base = _base(tmp_path)
    ckpt = _bridge(tmp_path, str(base))
    inputs = checkpoint_format(ckpt).open(MergeOptions(checkpoint=ckpt, out=tmp_path / "x"))
    inputs.close()
    assert f"The Hugging Face config and tokenizer are taken from {base}, named by model.hf_model_id in run_config.yaml; " \
        "pass --base to use another." in inputs.notices
    _merge(ckpt, tmp_path / "out")  # no --base: the model run_config.yaml names
    _same_tensors(tmp_path / "out", verl_converted("qwen2_tp2"))


def test_bridge_hf_export_beside_the_iteration_gives_the_config(tmp_path, verl_converted):
    ckpt = _bridge(tmp_path, HUB_ID)  # checkpoint.also_save_hf_checkpoint: iter_N/hf/ (checkpointing.py:905-908)
    shutil.copytree(_payload("qwen2_tp2")[1], ckpt / "iter_0000001" / "hf")
    (c,) = scan(ckpt).candidates
    assert c.base_path == str(ckpt / "iter_0000001" / "hf") and not format_of(c).needs_base(c)
    _merge(ckpt, tmp_path / "out")
    _same_tensors(tmp_path / "out", verl_converted("qwen2_tp2"))


def test_bridge_hub_id_found_in_the_hugging_face_cache(tmp_path, verl_converted):
    snapshot = tmp_path / "hub" / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / "abc123"
    shutil.copytree(_payload("qwen2_tp2")[1], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    ckpt = _bridge(tmp_path, HUB_ID)
    (c,) = scan(ckpt).candidates
    assert c.base_model == HUB_ID and c.base_path == str(snapshot) and c.base_resolves == "hf-cache"
    _merge(ckpt, tmp_path / "out")
    _same_tensors(tmp_path / "out", verl_converted("qwen2_tp2"))


def test_swift_base_from_args_json_and_nemo2_with_base(tmp_path, verl_converted):
    base = _base(tmp_path)
    _merge(_swift(tmp_path, str(base)), tmp_path / "swift")
    _same_tensors(tmp_path / "swift", verl_converted("qwen2_tp2"))
    _merge(_nemo2(tmp_path), tmp_path / "nemo", base=base)
    _same_tensors(tmp_path / "nemo", verl_converted("qwen2_tp2"))


# -- bad input: one sentence, nothing written ------------------------------------------------------------


def test_refusals(tmp_path):
    base = _base(tmp_path)
    ckpt = _megatron_lm(tmp_path, iters=(1,), latest="5")
    _refused(ckpt, tmp_path / "o1", "names iter_0000005", "does not exist", base=base)
    ckpt = _megatron_lm(tmp_path / "none", iters=(), latest="7")
    _refused(ckpt, tmp_path / "o1", "neither iter_0000007 (Megatron) nor global_step_7 (verl)", base=base)
    ckpt = _megatron_lm(tmp_path / "empty", iters=(), latest="1")
    (ckpt / "iter_0000001").mkdir()
    _refused(ckpt, tmp_path / "o2", "has no .metadata", base=base)
    (ckpt / "iter_0000001" / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    _refused(ckpt, tmp_path / "o2", "in the zarr format", "--ckpt-convert-format torch_dist", base=base)
    _refused(_bridge(tmp_path / "hub", HUB_ID), tmp_path / "o3", HUB_ID, "model.hf_model_id", "--base")
    _refused(_megatron_lm(tmp_path / "nobase", iters=(1,), latest="1"), tmp_path / "o4", "Megatron-LM", "--base")
    # issue 39: the config is built from context/model.yaml; this abridged one lacks a field it needs
    _refused(_nemo2(tmp_path / "nemo"), tmp_path / "o5", "NeMo 2", "records no vocab_size", "--base")
    legacy = tmp_path / "legacy" / "iter_0000001" / "mp_rank_00"
    legacy.mkdir(parents=True)
    _refused(legacy.parent, tmp_path / "o6", "mp_rank_00/model_optim_rng.pt is missing", base=base)
    import numpy as np

    # an object of an inert module where a tensor belongs is no tensor: said, never used
    torch.save({"checkpoint_version": 3.0, "model": {"embedding.word_embeddings.weight": np.zeros((4, 4))}},
               legacy / "model_optim_rng.pt")
    with pytest.raises(MergeError):
        _merge(legacy.parent, tmp_path / "o6", base=base)
    assert not (tmp_path / "o6").exists()
    torch.save({"checkpoint_version": 3.0, "iteration": 1, "hook": print}, legacy / "model_optim_rng.pt")
    _refused(legacy.parent, tmp_path / "o6", "print, which a checkpoint of weights never needs", "refuses to load it", base=base)
    peft = _bridge(tmp_path / "peft", str(base))
    cfg = peft / "iter_0000001" / "run_config.yaml"
    cfg.write_text(cfg.read_text().replace("peft: null", "peft:\n  _target_: megatron.bridge.peft.lora.LoRA\n  dim: 8"))
    _refused(peft, tmp_path / "o7", "records no positive peft.alpha", "--lora-alpha")
    cfg.write_text(cfg.read_text().replace("  dim: 8", "  dim: 8\n  alpha: 16"))
    _refused(peft, tmp_path / "o7", "holds no LoRA parameters")


# -- Megatron-Bridge's own saves (fixtures/megatron_layouts/fw, written by its trainer's save_checkpoint) -------

FW = LAYOUTS / "fw"


def _fw(tmp: Path) -> Path:
    """The fixtures folder copied (the runs name their Hugging Face model and base checkpoint relative to it)."""
    if not (FW / "bridge_dense_tp2" / "iter_0000003" / ".metadata").is_file():
        pytest.skip("Megatron-Bridge fixtures are not generated")
    shutil.copytree(FW, tmp / "fw")
    return tmp / "fw"


def _file_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("case, hf", [("bridge_dense_tp2", "hf_dense"), ("bridge_moe_ep2", "hf_moe")])
def test_bridge_own_save_converts_to_the_weights_it_imported(tmp_path, case, hf):
    """Megatron-Bridge imported a save_pretrained model (AutoBridge.load_hf_weights) and saved it with its
    trainer's checkpointing (TP 2; Qwen3-MoE at EP 2): the run names that model (model.hf_model_id), so no
    --base is needed, and every tensor comes back equal to the one save_pretrained wrote."""
    fw = _fw(tmp_path)
    result = _merge(fw / case, tmp_path / "out")
    assert any("model.hf_model_id" in n for n in result.warnings), result.warnings
    got, want = read_output(tmp_path / "out"), _file_tensors(fw / hf / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_inspect_shows_a_bridge_own_save(tmp_path):
    fw = _fw(tmp_path)
    result = scan(fw / "bridge_moe_ep2")
    (c,) = [c for c in result.candidates if c.backend == "megatron-bridge"]
    assert (Path(c.path).name, c.step, c.world_size) == ("iter_0000003", 3, 2)
    notes = " ".join(c.notes)
    assert "EP 2" in notes and "GPTModelProvider" in notes and not c.needs_base, notes
    (c,) = scan(fw / "bridge_lora_tp2").candidates
    assert "PEFT run (LoRA): adapters only (r 8, alpha 16), merged into the base checkpoint" in " ".join(c.notes), c.notes


@pytest.mark.parametrize("case", ["bridge_lora_tp2", "bridge_canonical_tp2"])
def test_bridge_peft_run_merges_like_bridges_own_export(tmp_path, case):
    """A Megatron-Bridge PEFT iteration (adapter-only, TP 2; LoRA and CanonicalLoRA) merged into the base
    checkpoint its run_config.yaml names equals Megatron-Bridge's own merged Hugging Face export
    (export_hf_weights with merge_adapter_weights) of the same in-memory model, every tensor."""
    fw = _fw(tmp_path)
    result = _merge(fw / case, tmp_path / "out")
    assert any("base checkpoint its run_config.yaml names" in n and "alpha 16" in n for n in result.warnings), result.warnings
    got, want = read_output(tmp_path / "out"), _file_tensors(fw / case / "expected_merged.safetensors")
    assert sorted(got) == sorted(want)
    base = _file_tensors(fw / "hf_dense" / "model.safetensors")
    assert sum(not torch.equal(want[k], base[k]) for k in want) == 14  # q, k, v, o, gate, up, down x 2 layers
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_bridge_peft_without_its_base_checkpoint_uses_the_hf_model_and_alpha_is_honoured(tmp_path):
    fw = _fw(tmp_path)
    shutil.rmtree(fw / "bridge_dense_tp2")  # the pretrained_checkpoint is gone: the imported HF model is the base
    result = _merge(fw / "bridge_lora_tp2", tmp_path / "out")
    assert any("bridge_dense_tp2 (checkpoint.pretrained_checkpoint) is not on this machine" in n for n in result.warnings)
    want = _file_tensors(fw / "bridge_lora_tp2" / "expected_merged.safetensors")
    got = read_output(tmp_path / "out")
    assert all(torch.equal(got[k], want[k]) for k in want)
    run_merge(MergeOptions(checkpoint=fw / "bridge_lora_tp2", out=tmp_path / "a8", lora_alpha=8), fsync=False)
    half = read_output(tmp_path / "a8")
    base = _file_tensors(fw / "hf_dense" / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(half[k] - base[k], (want[k] - base[k]) / 2, atol=1e-6)


def test_bridge_bad_input(tmp_path):
    fw = _fw(tmp_path)
    # an iteration folder missing one of its files: named, nothing written
    broken = tmp_path / "broken"
    shutil.copytree(fw / "bridge_dense_tp2", broken / "bridge_dense_tp2")
    shutil.copytree(fw / "hf_dense", broken / "hf_dense")
    (broken / "bridge_dense_tp2" / "iter_0000003" / "__1_0.distcp").unlink()
    with pytest.raises(MergeError) as err:
        _merge(broken / "bridge_dense_tp2", tmp_path / "o1")
    assert "__1_0.distcp" in str(err.value) and not (tmp_path / "o1").exists()
    # a PEFT run whose Hugging Face model and base checkpoint are both elsewhere
    alone = tmp_path / "alone"
    shutil.copytree(fw / "bridge_lora_tp2", alone / "bridge_lora_tp2")
    _refused(alone / "bridge_lora_tp2", tmp_path / "o2", "hf_dense (model.hf_model_id)", "--base")
    # a PEFT method tui-merger does not read
    cfg = fw / "bridge_lora_tp2" / "iter_0000003" / "run_config.yaml"
    cfg.write_text(cfg.read_text().replace("megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.ia3.IA3"))
    _refused(fw / "bridge_lora_tp2", tmp_path / "o3", "PEFT run of IA3", "save_hf_adapter")


def test_nemo2_weights_under_module_prefix(tmp_path):
    """NeMo 2 keeps the model under ``module.`` in weights/ (its MegatronParallel wrapper): the same dist
    checkpoint rewritten by torch.distributed.checkpoint with every key prefixed converts to the same tensors."""
    import torch.distributed.checkpoint as dcp

    fw = _fw(tmp_path)
    src = fw / "bridge_dense_tp2" / "iter_0000003"
    state = dcp_tensors(src)
    ckpt = tmp_path / "nemo" / "checkpoints" / "step=3"
    dcp.save({f"module.{k}": t for k, t in state.items()}, storage_writer=dcp.FileSystemWriter(str(ckpt / "weights")),
             no_dist=True)
    shutil.copytree(LAYOUTS / "nemo2" / "context", ckpt / "context")
    _merge(ckpt, tmp_path / "out", base=fw / "hf_dense")
    got, want = read_output(tmp_path / "out"), _file_tensors(fw / "hf_dense" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_bridge_dora_run_merges_with_its_magnitudes(tmp_path):
    """DoRA: Megatron-Bridge 0.3.1's own merged export (expected_merged.safetensors) leaves the magnitudes out
    (it equals the plain LoRA merge), so the reference is DoRA's formula (peft's: m * (W + s BA) / ||W + s BA||
    per output row) on the tensors torch.distributed.checkpoint reads from the iteration, for the projections
    that need no splitting (o_proj, down_proj)."""

    fw = _fw(tmp_path)
    src = fw / "bridge_dora_tp2" / "iter_0000003"
    _merge(fw / "bridge_dora_tp2", tmp_path / "out")
    got, base = read_output(tmp_path / "out"), _file_tensors(fw / "hf_dense" / "model.safetensors")
    lora_only = _file_tensors(fw / "bridge_dora_tp2" / "expected_merged.safetensors")
    state = dcp_tensors(src)
    for mega, hf in (("self_attention.linear_proj", "self_attn.o_proj"), ("mlp.linear_fc2", "mlp.down_proj")):
        for i in range(2):
            a, b, m = (state[f"decoder.layers.{mega}.adapter.{p}"][i] for p in ("linear_in.weight", "linear_out.weight", "weight_magnitude"))
            w = base[f"model.layers.{i}.{hf}.weight"].double() + 16 / 8 * (b.double() @ a.double())
            want = (m.double()[:, None] * w / w.norm(dim=1, keepdim=True)).float()
            assert torch.allclose(got[f"model.layers.{i}.{hf}.weight"], want, atol=1e-6, rtol=0), (i, hf)
    changed = [k for k in base if not torch.equal(got[k], base[k])]
    assert len(changed) == 14 and all(not torch.equal(got[k], lora_only[k]) for k in changed)
