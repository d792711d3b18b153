"""Vision-language models (transformers 5 keeps Qwen2-VL / Qwen2.5-VL as ``model.language_model.*`` and
``model.visual.*`` in memory, which peft adapters carry, and writes ``model.*`` / ``visual.*``): a peft
LoRA merges into the base, and the output is what ``save_pretrained`` of peft's ``merge_and_unload``
writes: the same names, shapes and dtypes, the same values; verification runs the model class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from factory import ALL_LINEAR, read_output, verification_checks

from tui_merger.cli import main

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=320, max_position_embeddings=512)
TOKENS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
MROPE = {"type": "mrope", "mrope_section": [4, 6, 6]}


def vl_config(kind: str):
    if kind == "qwen2_vl":
        return transformers.Qwen2VLConfig(
            text_config=dict(TEXT, rope_scaling=MROPE), **TOKENS,
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2))
    if kind == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_scaling=MROPE), **TOKENS,
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[1]))
    if kind == "qwen3_vl":
        return transformers.Qwen3VLConfig(
            text_config=dict(TEXT, head_dim=32, rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                               "mrope_interleaved": True}), **TOKENS,
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                               num_position_embeddings=64, deepstack_visual_indexes=[1]))
    raise ValueError(kind)


CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def save_vl(root: Path, kind: str, dtype, targets) -> tuple[Path, Path]:
    from peft import LoraConfig, get_peft_model

    cls = getattr(transformers, CLASSES[kind])
    torch.manual_seed(0)
    cls(vl_config(kind)).to(dtype).save_pretrained(root / "base")
    (root / "base" / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    model = cls.from_pretrained(root / "base", dtype=torch.float32)
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    peft_model.save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def peft_merged(kind: str, base: Path, adapter: Path, out: Path, dtype) -> dict:
    """peft's own merge, saved by transformers (the reference for names, shapes, dtypes and values)."""
    from peft import PeftModel

    cls = getattr(transformers, CLASSES[kind])
    model = cls.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.to(dtype).save_pretrained(out)
    return read_output(out)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("targets", ["language", "vision-too"])
def test_a_vl_lora_merges_to_what_save_pretrained_writes(kind, targets, tmp_path, capsys):
    # "vision-too": the vision blocks' attention is "qkv" (and Qwen2.5-VL's MLP has gate/up/down_proj too)
    target_modules = ["q_proj", "v_proj"] if targets == "language" else [*ALL_LINEAR, "qkv"]
    base, adapter = save_vl(tmp_path, kind, torch.float32, target_modules)
    expected = peft_merged(kind, base, adapter, tmp_path / "reference", torch.float32)
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "first place it diverges" not in printed.out
    got = read_output(out)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    base_tensors = read_output(base)
    changed = {n for n in expected if not torch.equal(expected[n], base_tensors[n])}
    assert any(".visual" in n or n.startswith("visual") for n in changed) == (targets == "vision-too")
    assert json.loads((out / "config.json").read_text())["architectures"] == [CLASSES[kind]]
    assert (out / "preprocessor_config.json").is_file()
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, checks


def test_inspect_dry_run_and_a_missing_processor(tmp_path, capsys):
    base, adapter = save_vl(tmp_path, "qwen2_5_vl", torch.bfloat16, ["q_proj", "v_proj"])
    assert main(["inspect", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "vision-language model (Qwen2_5_VLForConditionalGeneration)" in shown
    assert "for a vision-language model" in shown  # the adapter, whose base resolved
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--dry-run"]) == 0
    plan = capsys.readouterr()
    assert "4 merged" in plan.out and "will not take images" not in plan.out
    assert "[transformers]" not in plan.out + plan.err
    (base / "preprocessor_config.json").unlink()
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "WARNING" in plan and "will not take images until the processor files" in plan
    assert not out.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lora_on_the_patch_embedding_convolution_merges_like_peft(tmp_path, capsys, dtype):
    """LoRA on the vision tower's patch embedding, a Conv3d (peft's all-linear reaches it): lora_A a
    Conv3d with the kernel, lora_B 1x1x1; merged as B @ A on the flattened kernel into the 5-D weight,
    as peft's merge_and_unload computes conv(A^T, B)^T."""
    base, adapter = save_vl(tmp_path, "qwen2_5_vl", dtype, ["q_proj", "patch_embed.proj"])
    expected = peft_merged("qwen2_5_vl", base, adapter, tmp_path / "reference", dtype)
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got = read_output(out)
    conv = "visual.patch_embed.proj.weight"
    assert got[conv].dim() == 5 and not torch.equal(got[conv], read_output(base)[conv])
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        # fp32: one rounding apart at most; bf16: both round W + delta once (a tie may land one step apart)
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(got[name].float(), ref.float(), **tol, msg=name)
    assert verification_checks(out)["recompute"] == "pass"




@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_assistant_merges_and_verifies_a_vl_adapter(tmp_path, monkeypatch):
    from test_tui import recheck, text, to_review, until
    from textual.widgets import Checkbox, Input

    from tui_merger.tui.app import MergeApp

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    save_vl(tmp_path / "run", "qwen2_5_vl", torch.bfloat16, ["q_proj", "v_proj"])
    app = MergeApp(tmp_path / "run")
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert "4 merged" in text(app, "#plan-text")
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        assert "No tokenizer" in text(app, "#findings")  # the tiny model has none: a warning to tick
        app.screen.query_one("#ack", Checkbox).value = True
        await pilot.pause()
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=1200)
        assert "PASSED" in text(app, "#verify-status")
    assert json.loads((out / "merge_manifest.json").read_text())["verification"]["passed"] is True
