"""verl Megatron checkpoints that must be refused with one sentence and nothing written: a missing or
hostile .metadata, truncated or damaged .distcp files, a config that does not describe the tensors,
an unknown architecture, missing legacy rank files, pickles that try to run code."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from factory import Evil, refused_by_cli


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"


def _copy(tmp_path: Path, name: str) -> Path:
    src = FIXTURES / name
    if not (src / "reference.pt").is_file():
        pytest.skip(f"fixture {name} is not generated")
    run = tmp_path / name
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("reference.pt"))
    return run


def _actor(run: Path) -> Path:
    return run / "global_step_1" / "actor"


def _dist(run: Path) -> Path:
    actor = _actor(run)
    return actor / "model" / "dist_ckpt" if (actor / "model" / "dist_ckpt").is_dir() else actor / "dist_ckpt"


def _config(run: Path) -> Path:
    actor = _actor(run)
    for sub in ("model/huggingface", "huggingface", "hf_config_and_tokenizer"):
        if (actor / sub / "config.json").is_file():
            return actor / sub / "config.json"
    raise AssertionError("no config.json")


def _edit_config(run: Path, **changes) -> None:
    path = _config(run)
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _refused(capsys, tmp_path, local_dir, *needles, backend="megatron"):
    args = ["merge", "--local_dir", str(local_dir), "--target_dir", str(tmp_path / "merged"), "--plain"]
    if backend:
        args[1:1] = ["--backend", backend]
    return refused_by_cli(capsys, tmp_path, args, needles, extra_leftover=".merged")


def _metadata(run: Path):
    """The real torch Metadata object (read with torch itself, for crafting damaged copies)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(_dist(run))).read_metadata()


def test_missing_metadata(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    (_dist(run) / ".metadata").unlink()
    _refused(capsys, tmp_path, run, ".metadata", "not a complete dist checkpoint")


def test_truncated_distcp(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    path = _dist(run) / "__1_1.distcp"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(capsys, tmp_path, run, "__1_1.distcp", "truncated")


def test_missing_distcp(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    (_dist(run) / "__0_1.distcp").unlink()
    _refused(capsys, tmp_path, run, "__0_1.distcp", "missing")


def test_damaged_chunk_inside_a_distcp(tmp_path, capsys):
    """Same size, but a chunk's archive overwritten: found when that chunk is read, before any file of
    the output is kept."""
    run = _copy(tmp_path, "qwen2_tp2")
    md = _metadata(run)
    info = next(v for k, v in md.storage_data.items() if k.fqn == "decoder.layers.mlp.linear_fc2.weight")
    path = _dist(run) / info.relative_path
    original = path.read_bytes()
    end = info.offset + info.length
    data = bytearray(original)
    data[end - 22 : end] = b"\0" * 22  # the archive's directory
    path.write_bytes(bytes(data))
    _refused(capsys, tmp_path, run, "linear_fc2.weight", "not a readable torch.save archive")
    data = bytearray(original)
    data[info.offset : info.offset + 64] = b"\0" * 64  # its start: neither an archive nor raw bytes
    path.write_bytes(bytes(data))
    _refused(capsys, tmp_path, run, "linear_fc2.weight", "damaged")


def test_chunk_missing_from_the_metadata(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    md = _metadata(run)
    meta = md.state_dict_metadata["decoder.layers.self_attention.linear_proj.weight"]
    meta.chunks = meta.chunks[:-1]
    (_dist(run) / ".metadata").write_bytes(pickle.dumps(md))
    _refused(capsys, tmp_path, run, "linear_proj.weight", "incomplete")


def test_metadata_naming_a_file_outside_the_folder(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    md = _metadata(run)
    for info in md.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    (_dist(run) / ".metadata").write_bytes(pickle.dumps(md))
    _refused(capsys, tmp_path, run, "etc/passwd", "not a file in")


def test_metadata_pickle_that_runs_code_is_refused(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    marker = tmp_path / "pwned"
    (_dist(run) / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Evil(marker)}))
    _refused(capsys, tmp_path, run, ".metadata", "system", "run code")
    assert not marker.exists()


def test_metadata_pickle_hiding_code_in_a_real_metadata_is_refused(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    marker = tmp_path / "pwned"
    md = _metadata(run)
    md.planner_data = Evil(marker)
    (_dist(run) / ".metadata").write_bytes(pickle.dumps(md))
    _refused(capsys, tmp_path, run, ".metadata", "run code")
    assert not marker.exists()


def test_config_with_other_heads(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    _edit_config(run, num_attention_heads=8)
    _refused(capsys, tmp_path, run, "config.json does not match", "8 attention heads", "linear_qkv")


def test_config_with_other_kv_heads(tmp_path, capsys):
    run = _copy(tmp_path, "qwen3_tp2_tied")
    _edit_config(run, num_key_value_heads=4)
    _refused(capsys, tmp_path, run, "config.json does not match", "4 key-value heads")


def test_config_with_other_layers(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    _edit_config(run, num_hidden_layers=3)
    _refused(capsys, tmp_path, run, "config.json does not match", "3 layers")


def test_config_with_a_larger_vocabulary(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    padded = int(torch.load(FIXTURES / "qwen2_tp2" / "reference.pt", weights_only=True)["padded_vocab_size"])
    _edit_config(run, vocab_size=padded + 1)
    _refused(capsys, tmp_path, run, f"vocab_size {padded + 1}", f"only {padded} rows")


def test_config_of_another_family(tmp_path, capsys):
    """A Qwen3 config on a Qwen2 checkpoint: the q/k/v biases and q/k norms do not fit."""
    run = _copy(tmp_path, "qwen2_tp2")
    _edit_config(run, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=16)
    _refused(capsys, tmp_path, run, "config.json does not match", "Qwen3")


def test_unknown_architecture(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    _edit_config(run, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    from tui_merger.core.formats.verl_megatron import SUPPORTED  # the families the sentence lists

    assert "Qwen3-MoE" in SUPPORTED and "Qwen3-Next" in SUPPORTED and "DeepSeek-V3" in SUPPORTED
    _refused(capsys, tmp_path, run, "GPT2LMHeadModel", f"{SUPPORTED} models only")


def test_missing_legacy_rank_file(tmp_path, capsys):
    run = _copy(tmp_path, "legacy_tp2pp2")
    shutil.rmtree(_actor(run) / "model" / "mp_rank_01_001")
    _refused(capsys, tmp_path, run, "mp_rank_01_001", "missing")


def test_legacy_rank_file_that_runs_code_is_refused(tmp_path, capsys):
    run = _copy(tmp_path, "legacy_tp2pp2")
    marker = tmp_path / "pwned"
    path = _actor(run) / "model" / "mp_rank_00_001" / "model.pt"
    chunks = torch.load(path, weights_only=True)
    chunks[0]["decoder.final_layernorm.weight"] = Evil(marker)
    torch.save(chunks, path)
    _refused(capsys, tmp_path, run, "mp_rank_00_001", "system", "run code")
    assert not marker.exists()


def test_truncated_legacy_rank_file(tmp_path, capsys):
    run = _copy(tmp_path, "legacy_tp2pp2")
    path = _actor(run) / "model" / "mp_rank_01_000" / "model.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(capsys, tmp_path, run, "mp_rank_01_000")


def test_fsdp_backend_on_a_megatron_checkpoint(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    _refused(capsys, tmp_path, run, "is a Megatron checkpoint, not an FSDP one", "--backend megatron", backend="fsdp")


def test_megatron_backend_on_an_fsdp_checkpoint(tmp_path, capsys):
    from factory import qwen_config
    from transformers import AutoModelForCausalLM

    actor = tmp_path / "global_step_1" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    qwen_config().save_pretrained(actor / "huggingface")
    torch.save(AutoModelForCausalLM.from_config(qwen_config()).state_dict(), actor / "model_world_size_1_rank_0.pt")
    _refused(capsys, tmp_path, tmp_path, "is a verl FSDP checkpoint, not a Megatron one", "--backend fsdp")


def test_megatron_backend_on_a_folder_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _refused(capsys, tmp_path, tmp_path / "empty", "No verl Megatron checkpoint")


def test_megatron_peft_adapter_is_named(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_pp2")
    (_actor(run) / "adapter_checkpoint").mkdir()
    # a LoRA run merges from its adapter shards (tests/test_megatron_shards.py): an empty folder is a bad copy
    _refused(capsys, tmp_path, run, "adapter_checkpoint holds no mp_rank_*_adapter.pt files", "copy the run's whole")


def test_a_vision_language_config_is_named_as_such(tmp_path, capsys):
    run = _copy(tmp_path, "qwen2_tp2")
    _edit_config(run, model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"],
                 vision_config={"depth": 2, "hidden_size": 32})
    # a text model's checkpoint (no language_model.* / vision tower tensors) with a Qwen2.5-VL config
    _refused(capsys, tmp_path, run, "vision-language model (Qwen2_5_VLForConditionalGeneration)",
             "no language_model.* tensors")
