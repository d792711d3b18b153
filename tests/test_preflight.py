"""Preflight: every check fires on a real bad case and stays silent on a good one; the plan is right;
--dry-run writes nothing. Bad cases are real adapters and models (peft, transformers) with one thing
changed the way users' checkpoints go wrong."""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

import pytest
from factory import qwen_config, save_adapter, save_base
from safetensors.torch import load_file, save_file

from tui_merger.cli import main as cli_main
from tui_merger.core.options import MergeOptions
from tui_merger.core.plan.preflight import make_plan, resolve_model_reference, suggest_name


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A good pair: tied Qwen2 base with a tokenizer, all-linear LoRA adapter (the demo's)."""
    from tui_merger.demo import build_demo

    return build_demo(tmp_path_factory.mktemp("pf") / "ws")


def copy(src: Path, dest: Path) -> Path:
    return Path(shutil.copytree(src, dest))


def edit(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def findings(base, adapter, out=None, **kw) -> dict:
    plan = make_plan(MergeOptions(base=base, adapter=adapter, out=out, **kw))
    return {f.id: f for f in plan.findings}


def test_a_good_pair_has_no_findings_and_a_complete_plan(demo, tmp_path):
    base, adapter = demo
    plan = make_plan(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"), today=datetime.date(2026, 11, 30))
    assert plan.findings == [] and not plan.blocked
    assert plan.tensors == 50 and plan.merged_tensors == 28 and plan.shards == 1
    assert plan.output_bytes == sum(p.stat().st_size for p in base.glob("*.safetensors")) - _header_bytes(base)
    assert plan.tokenizer_source == "base" and plan.dtype is None
    assert plan.adapter["r"] == 8 and plan.adapter["alpha"] == 16 and plan.adapter["variant"] == "lora"
    assert plan.estimated_seconds > 0
    assert json.loads(json.dumps(plan.to_dict()))["blocked"] is False  # serialisable for every front end
    assert plan.suggested_out == "base-ws-r8-20261130"


def _header_bytes(folder: Path) -> int:
    total = 0
    for p in folder.glob("*.safetensors"):
        with open(p, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_alpha_missing_warns_and_alpha_zero_blocks(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (a / "adapter_config.json").write_text(json.dumps(cfg))
    assert findings(base, a)["lora-alpha"].severity == "warning"
    edit(a / "adapter_config.json", lora_alpha=0)
    f = findings(base, a)
    assert f["lora-alpha"].severity == "error" and "inputs" not in f  # said once, by its own check


def test_rank_in_config_vs_tensors(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    edit(a / "adapter_config.json", r=4)
    f = findings(base, a)["lora-rank"]
    assert f.severity == "error" and "r=4" in f.message and "rank 8" in f.message


def test_target_names_absent_from_the_base_name_the_nearest(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    cfg = json.loads((a / "adapter_config.json").read_text())
    edit(a / "adapter_config.json", target_modules=cfg["target_modules"] + ["qproj", "c_attn"])
    f = findings(base, a)["targets"]
    assert f.severity == "warning" and "qproj (nearest: q_proj" in f.message and "c_attn" in f.message


def test_lora_pair_that_does_not_fit_the_base(demo, tmp_path):
    base, _ = demo
    other = save_base(tmp_path / "other", qwen_config(hidden_size=96, num_attention_heads=4))
    a = save_adapter(tmp_path / "a", other, target_modules=["q_proj"])
    f = findings(base, a)
    assert f["adapter-fit"].severity == "error" and "shape" in f["adapter-fit"].message


def test_tokenizer_beside_the_adapter_larger_than_the_embedding(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    tok = json.loads((base / "tokenizer.json").read_text())
    rows = json.loads((base / "config.json").read_text())["vocab_size"]
    tok["added_tokens"].append({"id": rows + 3, "content": "<|new|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (a / "tokenizer.json").write_text(json.dumps(tok))
    f = findings(base, a)["vocab"]
    assert f.severity == "error" and f"{rows + 4} tokens" in f.message and f"{rows} rows" in f.message
    shutil.copy(base / "tokenizer.json", a / "tokenizer.json")  # the same tokenizer: silent
    assert "vocab" not in findings(base, a)


def test_resized_embeddings_saved_in_the_adapter_are_info(tmp_path):
    base = save_base(tmp_path / "base", qwen_config(tie_word_embeddings=False))
    a = save_adapter(tmp_path / "a", base, resize_to=264, target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"])
    f = findings(base, a)["vocab"]
    assert f.severity == "info" and "256 -> 264" in f.message


def test_architecture_and_rope_of_the_adapters_base_config(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    config = json.loads((base / "config.json").read_text())
    (a / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "max_position_embeddings": 32768}))
    f = findings(base, a)
    assert f["rope"].severity == "warning" and "500000" in f["rope"].message
    assert "architecture" not in f
    (a / "config.json").write_text(json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    f = findings(base, a)
    assert f["architecture"].severity == "error" and "llama" in f["architecture"].message
    (a / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    assert findings(base, a)["vocab-size"].severity == "warning"
    (a / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    assert "yarn" in findings(base, a)["rope"].message
    (a / "config.json").write_text(json.dumps(config))
    assert not {"rope", "architecture", "vocab-size"} & set(findings(base, a))


def test_the_adapter_names_another_base(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    edit(a / "adapter_config.json", base_model_name_or_path="Qwen/Qwen2.5-7B-Instruct")
    f = findings(base, a)["base-name"]
    assert f.severity == "warning" and "Qwen/Qwen2.5-7B-Instruct" in f.message
    b = copy(base, tmp_path / "Qwen2.5-7B-Instruct")  # a local copy named like it: fine
    assert "base-name" not in findings(b, a)


def test_base_model_resolves_through_the_hf_cache(demo, tmp_path, monkeypatch):
    base, adapter = demo
    snap = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / "abc123"
    copy(base, snap)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_reference("Org/Tiny") == snap
    assert resolve_model_reference("Org/Missing") is None
    a = copy(adapter, tmp_path / "a")
    edit(a / "adapter_config.json", base_model_name_or_path="Org/Tiny")
    assert "base-name" not in findings(snap, a)  # the cache path names the model
    cfg = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps({**cfg, "rope_theta": 1.0}))  # the named base's config is read
    assert findings(base, a)["rope"].severity == "warning"


def test_quantized_base_is_refused(demo, tmp_path):
    base, adapter = demo
    b = copy(base, tmp_path / "b")
    edit(b / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    f = findings(b, adapter)["quantized"]
    assert f.severity == "error" and "bitsandbytes" in f.message and "16-bit" in f.fix


def test_embedding_lora_unties_a_tied_base(demo, tmp_path):
    base, _ = demo
    a = save_adapter(tmp_path / "a", base, target_modules=["embed_tokens", "q_proj"])
    f = findings(base, a)["tied"]
    assert f.severity == "warning" and "lm_head" in f.message
    assert "tied" not in findings(base, save_adapter(tmp_path / "q", base, target_modules=["q_proj"]))


def test_nan_in_the_adapter(demo, tmp_path):
    base, adapter = demo
    a = copy(adapter, tmp_path / "a")
    tensors = load_file(a / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, a / "adapter_model.safetensors")
    f = findings(base, a)["adapter-nan"]
    assert f.severity == "error" and name in f.message


def test_fp16_overflow_blocks_unless_forced(demo, tmp_path):
    base, adapter = demo
    b = copy(base, tmp_path / "b")
    tensors = load_file(b / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0 + 1e6
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    assert findings(b, adapter, dtype="fp16")["fp16-overflow"].severity == "error"
    assert findings(b, adapter, dtype="fp16", force_fp16_overflow=True)["fp16-overflow"].severity == "warning"
    assert "fp16-overflow" not in findings(base, adapter, dtype="fp16")
    assert "fp16-overflow" not in findings(b, adapter, dtype="bf16")


def test_custom_code_is_info(demo, tmp_path):
    base, adapter = demo
    b = copy(base, tmp_path / "b")
    edit(b / "config.json", auto_map={"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (b / "modeling_tiny.py").write_text("# custom model code\n")
    assert findings(b, adapter)["remote-code"].severity == "info"


def test_output_exists_and_not_enough_memory(demo, tmp_path, monkeypatch):
    import tui_merger.core.verify.checks as verify

    base, adapter = demo
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    assert findings(base, adapter, out)["output"].severity == "error"
    assert findings(base, adapter, out, overwrite=True)["output"].severity == "warning"
    monkeypatch.setattr(verify, "_available_memory", lambda: 1 << 20)
    assert findings(base, adapter)["memory"].severity == "error"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_not_enough_disk(demo, tmp_path):
    import subprocess

    base, adapter = demo
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        f = findings(base, adapter, small / "merged")["disk"]
        assert f.severity == "error" and "free" in f.message
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_no_tokenizer_warns(tmp_path):
    base = save_base(tmp_path / "base", qwen_config())
    a = save_adapter(tmp_path / "a", base, target_modules=["q_proj"])
    assert findings(base, a)["tokenizer"].severity == "warning"


def test_fsdp_checkpoint_plan(tmp_path_factory, tmp_path):
    from fsdp_factory import cached_fsdp_checkpoint, copy_fsdp_checkpoint

    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, lora=True)
    plan = make_plan(MergeOptions(checkpoint=Path(info["checkpoint_dir"]), out=tmp_path / "o", dtype="bf16"))
    assert not plan.blocked and plan.adapter["r"] == info["lora_r"] and plan.dtype == "bfloat16"
    assert plan.output_bytes > 0 and plan.merged_tensors > 0
    lost = copy_fsdp_checkpoint(info, tmp_path / "run")
    ckpt = Path(lost["checkpoint_dir"])
    for p in (ckpt / "lora_train_meta.json", ckpt / "lora_adapter" / "adapter_config.json"):
        p.unlink(missing_ok=True)
    plan = make_plan(MergeOptions(checkpoint=ckpt, out=tmp_path / "o"))
    assert plan.blocked and "--lora-alpha" in plan.findings[0].message


def test_suggested_name(tmp_path):
    opts = MergeOptions(base=tmp_path / "Qwen2.5-0.5B", adapter=tmp_path / "alpaca-lora" / "checkpoint-500", out=None)
    name = suggest_name(opts, None, {"r": 16, "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}, datetime.date(2026, 11, 30))
    assert name == "Qwen2.5-0.5B-alpaca-lora-r16-step500-20261130"  # the step of the run (issue 38 item 5)
    # issue 38 item 18: named after the base used, not the Hub model the adapter names (not here)
    opts = MergeOptions(base=tmp_path / "base", adapter=tmp_path / "alpaca-lora", out=None)
    name = suggest_name(opts, None, {"r": 16, "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}, datetime.date(2026, 11, 30))
    assert name == "base-alpaca-lora-r16-20261130"
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / ("0" * 40)  # the cache: its Hub name
    opts = MergeOptions(base=snapshot, adapter=tmp_path / "alpaca-lora", out=None)
    assert suggest_name(opts, None, {"r": 16}, datetime.date(2026, 11, 30)) == "Qwen2.5-0.5B-alpaca-lora-r16-20261130"


def test_dry_run_writes_nothing_and_exits_1_when_blocked(demo, tmp_path, capsys):
    base, adapter = demo
    out = tmp_path / "never"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "Merge plan" in text and "every check passed" in text and "r=8 alpha=16" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--dry-run"]) == 0
    assert "suggested: base-ws-r8-" in capsys.readouterr().out
    q = copy(base, tmp_path / "q")
    edit(q / "config.json", quantization_config={"quant_method": "gptq"})
    assert cli_main(["merge", "--base", str(q), "--adapter", str(adapter), "--out", str(out), "--dry-run"]) == 1
    captured = capsys.readouterr()
    assert "ERROR" in captured.out and "gptq" in captured.out and "would stop" in captured.err
    assert not out.exists()


def test_merge_stops_on_errors_before_writing(demo, tmp_path, capsys):
    base, adapter = demo
    q = copy(base, tmp_path / "q")
    edit(q / "config.json", quantization_config={"quant_method": "awq"})
    out = tmp_path / "out"
    assert cli_main(["merge", "--base", str(q), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "awq" in errors[0]
    assert not out.exists()


def test_the_plan_offers_the_output_formats_and_marks_one_the_engine_refuses(demo, tmp_path):
    """plan.output_choices (default first) is what the assistant offers; a format the engine cannot write
    for the base is the error "output-format" with the engine's sentence (the assistant keeps the one
    before); a mismatch that is not the format's stays "adapter-fit"."""
    from fp8_factory import make_fp8_release_workspace

    from tui_merger.core.plan.preflight import output_refusal

    base, adapter = demo
    plan = make_plan(MergeOptions(base=base, adapter=adapter, out=tmp_path / "o"))
    assert plan.output_choices == [("as merged (default)", None), ("FP8 128x128 blocks for serving (--quantize fp8)", "fp8")]
    assert output_refusal(plan) is None
    plan = make_plan(MergeOptions(base=base, adapter=adapter, out=tmp_path / "o", output_quantization="keep"))
    assert plan.blocked and output_refusal(plan).startswith("--keep-quantization writes FP8 (quant_method fp8)")
    small = save_base(tmp_path / "small", qwen_config())  # no Linear weight of whole 128x128 blocks
    plan = make_plan(MergeOptions(base=small, adapter=save_adapter(tmp_path / "small-lora", small), output_quantization="fp8"))
    assert "found no Linear weight of whole 128x128 blocks" in output_refusal(plan)
    plan = make_plan(MergeOptions(base=small, adapter=adapter, output_quantization="fp8"))  # shapes do not fit
    assert output_refusal(plan) is None and "adapter-fit" in {f.id for f in plan.findings}

    ws = make_fp8_release_workspace(tmp_path / "fp8")
    options = MergeOptions(base=ws / "Qwen3-tiny-FP8", adapter=ws / "qv-lora", out=tmp_path / "o")
    plan = make_plan(options)
    assert plan.base_scheme == "FP8 (e4m3), 128x128 blocks"
    assert plan.output_choices == [("bf16, a plain model (default)", None),
                                   ("FP8 (e4m3), 128x128 blocks as the base (--keep-quantization)", "keep")]
    kept = make_plan(MergeOptions(base=options.base, adapter=options.adapter, out=options.out, output_quantization="keep"))
    assert not kept.blocked and output_refusal(kept) is None and "as the base: 10 weights copied" in kept.output_format
    fp8 = make_plan(MergeOptions(base=options.base, adapter=options.adapter, out=options.out, output_quantization="fp8"))
    assert "the base is already FP8 (e4m3), 128x128 blocks" in output_refusal(fp8)


def _chattr(flag: str, path: Path) -> bool:
    import subprocess

    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.parametrize("flag", ["+i", "+a"])
def test_an_immutable_output_folder_is_refused_by_the_plan_before_anything_is_written(demo, tmp_path, capsys, flag):
    """Issue 38 item 20: an immutable (chattr +i) output folder passed every check and the merge failed
    at its very end, when the finished model is moved into place. The plan says it, in one sentence."""
    base, adapter = demo
    out = tmp_path / "out"
    out.mkdir()
    if not _chattr(flag, out):
        pytest.skip("chattr is not available here (root on a file system with inode flags)")
    try:
        found = findings(base, adapter, out)["output"]
        assert found.severity == "error"
        assert found.message == f"Cannot write in {out} (immutable or append-only: lsattr -d shows i or a), so the merged model cannot be put there."
        assert "chattr -i -a" in found.fix
        assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 1
        err = capsys.readouterr().err
        assert f"error: Cannot write in {out}" in err and err.count("error:") == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any(out.iterdir())  # nothing written
    finally:
        _chattr(f"-{flag[1]}", out)
