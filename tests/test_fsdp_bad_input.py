"""verl FSDP checkpoints that must be refused with one sentence and nothing written: a pickle that
tries to run code, truncated rank files, missing or mixed ranks, optimizer state given as the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from factory import Evil, qwen_config, refused_by_cli

from tui_merger.cli import main as cli_main


def _actor(tmp_path: Path, files: dict[str, object]) -> Path:
    actor = tmp_path / "global_step_3" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    qwen_config().save_pretrained(actor / "huggingface")
    for name, obj in files.items():
        torch.save(obj, actor / name)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    return actor


def _state():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_config(qwen_config()).state_dict().items()}


def _refused(capsys, tmp_path, local_dir, *needles):
    args = ["merge", "--backend", "fsdp", "--local_dir", str(local_dir), "--target_dir", str(tmp_path / "merged"), "--plain"]
    return refused_by_cli(capsys, tmp_path, args, needles)


def test_a_pickle_that_runs_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "pwned"
    state = _state()
    state["model.norm.weight"] = Evil(marker)
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": state})
    _refused(capsys, tmp_path, actor, "model_world_size_1_rank_0.pt", "system", "run code")
    assert not marker.exists()


def test_truncated_rank_file(tmp_path, capsys):
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": _state()})
    path = actor / "model_world_size_1_rank_0.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(capsys, tmp_path, actor, "model_world_size_1_rank_0.pt")


def test_missing_rank_file(tmp_path, capsys):
    _actor(tmp_path, {"model_world_size_2_rank_0.pt": _state()})
    _refused(capsys, tmp_path, tmp_path, "model_world_size_2_rank_1.pt", "missing")


def test_rank_files_of_two_world_sizes(tmp_path, capsys):
    state = _state()
    files = {f"model_world_size_2_rank_{r}.pt": state for r in range(2)}
    files.update({f"model_world_size_1_rank_{r}.pt": state for r in range(1)})
    actor = _actor(tmp_path, files)
    _refused(capsys, tmp_path, actor, "world sizes 1 and 2")


def test_optimizer_state_given_as_the_model(tmp_path, capsys):
    optim = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 1e-5, "params": [0]}]}
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": optim})
    _refused(capsys, tmp_path, actor, "optimizer state")


def test_fsdp_config_disagrees_with_the_files(tmp_path, capsys):
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": _state()})
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    _refused(capsys, tmp_path, actor, "world_size 4")


def test_megatron_checkpoint_is_named_not_misread(tmp_path, capsys):
    (tmp_path / "actor" / "dist_ckpt").mkdir(parents=True)
    _refused(capsys, tmp_path, tmp_path / "actor", "Megatron")


def test_single_rank_checkpoint_with_plain_tensors(tmp_path):
    """World size 1 (FSDP1 NO_SHARD) holds plain tensors: converted exactly, in the config's dtype."""
    from factory import read_output

    state = _state()
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": state})
    cfg = json.loads((actor / "huggingface" / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (actor / "huggingface" / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "merged"
    assert cli_main(["merge", str(tmp_path), "--out", str(out), "--plain"]) == 0
    ours = read_output(out)
    assert set(ours) == set(state)
    for name, tensor in state.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], tensor.to(torch.bfloat16)), name


class _Getattr:
    def __reduce__(self):
        return (getattr, ("a string", "upper"))


def test_getattr_on_anything_but_a_record_is_refused(tmp_path, capsys):
    """ShardedTensor pickles need getattr(ShardedTensor, "ProcessGroupState"); getattr on any other
    object (the usual first step of a pickle exploit) is refused."""
    state = _state()
    state["model.norm.weight"] = _Getattr()
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": state})
    _refused(capsys, tmp_path, actor, "refusing")


def test_a_state_dict_keyed_by_a_tensor_is_refused_without_printing_it(tmp_path, capsys):
    """A damaged pickle can key a weight by a tensor (found by the fuzzer): before, the tensor became a
    "parameter name" and error messages printed its values."""
    state = _state()
    state[torch.full((3,), 7.0)] = torch.ones(2)
    actor = _actor(tmp_path, {"model_world_size_1_rank_0.pt": state})
    line = _refused(capsys, tmp_path, actor, "model_world_size_1_rank_0.pt", "keyed by a Tensor")
    assert "7." not in line

