"""verl's ``lora_train_meta.json`` ({"r", "lora_alpha", "task_type"}, written by its SFT trainer's checkpoint
handler into ``global_step_N/`` beside the engine's files, and by the FSDP checkpoint manager beside the rank
files) gives lora_alpha to both verl kinds: said as "alpha N, from lora_train_meta.json"; a --lora-alpha that
disagrees is used and said."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from factory import read_output
from fsdp_factory import cached_fsdp_checkpoint, copy_fsdp_checkpoint
from test_megatron_shards import FIXTURES, _merge, _peft_merged, _reference_adapter, bases  # noqa: F401

from tui_merger.cli import main as cli_main
from tui_merger.core.formats.registry import format_of
from tui_merger.core.formats.scan import scan
from tui_merger.core.plan.choices import needs_alpha
from tui_merger.core.record.manifest import read_manifest


def _with_meta(tmp_path: Path, alpha=16, r=8) -> Path:
    """The Megatron LoRA fixture (TP 2, trained at alpha 16) with the file verl's SFT handler writes."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "lora_tp2", run)
    meta = {"r": r, "lora_alpha": alpha, "task_type": "CAUSAL_LM"}
    (run / "global_step_1" / "lora_train_meta.json").write_text(json.dumps(meta, ensure_ascii=False, indent=4))
    return run


def test_megatron_shards_take_alpha_from_the_meta_file(tmp_path, bases, capsys):
    run = _with_meta(tmp_path)
    (c,) = [c for c in scan(run).candidates if c.kind == "verl-megatron"]
    assert c.lora["alpha"] == 16 and not needs_alpha(c)
    assert "alpha 16, from global_step_1/lora_train_meta.json (the adapter shards do not record it)." in c.notes
    assert "--lora-alpha" not in format_of(c).next_step(c, str(run), "BASE", "out")
    base = bases("lora_tp2")
    out = tmp_path / "merged"
    assert _merge(run, out, "--base", str(base), "--no-verify") == 0
    said = capsys.readouterr()
    assert "alpha 16, from global_step_1/lora_train_meta.json." in said.out + said.err
    want = _peft_merged(base, _reference_adapter("lora_tp2", tmp_path), tmp_path)  # Megatron-Bridge's export, alpha 16
    ours = read_output(out)
    assert [k for k in ours if not torch.equal(ours[k], want[k])] == []
    inputs = read_manifest(out)["inputs"]
    assert any(f["path"].endswith("lora_train_meta.json") for i in inputs for f in i.get("files") or [])


def test_a_disagreeing_lora_alpha_is_used_and_said(tmp_path, bases, capsys):
    run = _with_meta(tmp_path)
    base = bases("lora_tp2")
    at16, at32 = tmp_path / "at16", tmp_path / "at32"
    assert _merge(FIXTURES / "lora_tp2", at16, "--base", str(base), "--lora-alpha", "16", "--no-verify") == 0
    assert _merge(FIXTURES / "lora_tp2", at32, "--base", str(base), "--lora-alpha", "32", "--no-verify") == 0
    capsys.readouterr()
    out = tmp_path / "merged"
    assert _merge(run, out, "--base", str(base), "--lora-alpha", "32", "--no-verify") == 0
    said = capsys.readouterr()
    assert "lora_alpha 32 (--lora-alpha) is used; global_step_1/lora_train_meta.json records 16." in said.out + said.err
    ours, want = read_output(out), read_output(at32)
    assert all(torch.equal(ours[k], want[k]) for k in want)
    assert any(not torch.equal(ours[k], read_output(at16)[k]) for k in want)


def test_no_meta_file_still_asks(tmp_path, capsys):
    (c,) = [c for c in scan(FIXTURES / "lora_tp2").candidates if c.kind == "verl-megatron"]
    assert needs_alpha(c)
    code = _merge("lora_tp2", tmp_path / "out")
    assert code == 1 and "no lora_train_meta.json does" in capsys.readouterr().err


def test_verl_fsdp_reads_it_from_the_step_folder_too(tmp_path_factory, tmp_path, capsys):
    """An actor/ folder whose lora_train_meta.json lies in global_step_N/ (where the SFT handler writes it)."""
    info = copy_fsdp_checkpoint(cached_fsdp_checkpoint(tmp_path_factory, lora=True), tmp_path / "copy")
    ckpt = Path(info["checkpoint_dir"])
    step = ckpt.parent if ckpt.name in ("actor", "critic") else None
    if step is None:  # the SFT layout: the rank files are in global_step_N itself
        step = ckpt
    else:
        shutil.move(ckpt / "lora_train_meta.json", step / "lora_train_meta.json")
    (c,) = [c for c in scan(ckpt).candidates if c.kind == "verl-fsdp"]
    alpha = info["lora_alpha"]
    assert c.lora["alpha"] == alpha and not needs_alpha(c)
    where = "lora_train_meta.json" if step == ckpt else f"{step.name}/lora_train_meta.json"
    assert f"alpha {alpha:g}, from {where}." in c.notes
    out = tmp_path / "merged"
    assert cli_main(["merge", str(ckpt), "--out", str(out), "--plain", "--no-verify"]) == 0
    assert f"alpha {alpha:g}, from {where}." in capsys.readouterr().err
    # a --lora-alpha that disagrees is used, and said
    out2 = tmp_path / "merged2"
    assert cli_main(["merge", str(ckpt), "--out", str(out2), "--plain", "--no-verify", "--lora-alpha", str(alpha * 2)]) == 0
    assert f"lora_alpha {alpha * 2:g} (--lora-alpha) is used; {where} records {alpha:g}." in capsys.readouterr().err
