"""verl FSDP checkpoints written by torch.distributed itself (tests/fsdp_factory.py) are reassembled
exactly: compared with the full state dict the library gathered before saving, and, for LoRA runs,
with the logits of the unmerged PeftModel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import assert_same_or_one_unit, logits_of, read_output
from fsdp_factory import cached_fsdp_checkpoint

from tui_merger.cli import main as cli_main
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

CONFIGS = {
    "fsdp1-w1": dict(fsdp_version=1, world_size=1),
    "fsdp1-w2": dict(fsdp_version=1, world_size=2),
    "fsdp1-w4": dict(fsdp_version=1, world_size=4),
    "fsdp2-w1": dict(fsdp_version=2, world_size=1),
    "fsdp2-w2": dict(fsdp_version=2, world_size=2),
    "fsdp2-w4": dict(fsdp_version=2, world_size=4),
    "fsdp2-hsdp": dict(fsdp_version=2, hsdp=True),
    "fsdp1-hsdp": dict(fsdp_version=1, hsdp=True),
    "fsdp2-shard-dim1": dict(fsdp_version=2, world_size=2, shard_dim1=True),
    "fsdp2-buffers": dict(fsdp_version=2, world_size=2, buffer=True),
    "no-fsdp-config": dict(fsdp_version=2, world_size=2, write_fsdp_config=False),
    "sft-layout": dict(fsdp_version=2, world_size=2, sft_layout=True),
    "fsdp1-sharded-tensor-w2": dict(fsdp_version=1, world_size=2, sharded_tensor=True),
    "fsdp1-sharded-tensor-w4": dict(fsdp_version=1, world_size=4, sharded_tensor=True),
}


def _reference(info) -> dict:
    from safetensors.torch import load_file

    return load_file(info["reference"])


@pytest.mark.parametrize("case", list(CONFIGS))
def test_checkpoint_reassembles_exactly(tmp_path_factory, tmp_path, case):
    info = cached_fsdp_checkpoint(tmp_path_factory, **CONFIGS[case])
    out = tmp_path / "merged"
    result = run_merge(MergeOptions(checkpoint=info["run_dir"], out=out))
    ours = read_output(out)
    ref = _reference(info)
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype == torch.float32
        assert torch.equal(ours[name], tensor), name  # fp32 master weights: exact
    assert result.tensors_merged == 0
    # the folder is a model transformers loads, with the checkpoint's tokenizer and generation config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])
    assert len(AutoTokenizer.from_pretrained(out)) == info["tokenizer_size"]
    assert (out / "generation_config.json").is_file()


def test_tied_embeddings_are_written_once(tmp_path_factory, tmp_path):
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, tied=True)
    out = tmp_path / "merged"
    run_merge(MergeOptions(checkpoint=info["checkpoint_dir"], out=out))
    ours = read_output(out)
    ref = _reference(info)
    assert "lm_head.weight" not in ours
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert torch.equal(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_critic_becomes_a_token_classification_model(tmp_path_factory, tmp_path, fsdp_version):
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=fsdp_version, world_size=2, critic=True)
    out = tmp_path / "merged"
    run_merge(MergeOptions(checkpoint=info["run_dir"], out=out))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"]
    ref = _reference(info)
    ours = read_output(out)
    assert set(ours) == set(ref)
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(out)
    assert model.config.num_labels == 1
    assert torch.equal(model.score.weight, ref["score.weight"])
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1)


@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_lora_checkpoint_is_merged_into_the_weights(tmp_path_factory, tmp_path, fsdp_version):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=fsdp_version, world_size=2, lora=True)
    out = tmp_path / "merged"
    result = run_merge(MergeOptions(checkpoint=info["checkpoint_dir"], out=out))
    assert result.tensors_merged > 0
    ours = read_output(out)
    assert not [k for k in ours if "lora" in k or "base_layer" in k or k.startswith("base_model")]
    probe = torch.tensor([[5, 17, 300, 999, 42, 7]])
    base = AutoModelForCausalLM.from_pretrained(info["reference_base"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, info["reference_adapter"]).eval()
    with torch.no_grad():
        expected = peft_model(probe).logits
    torch.testing.assert_close(logits_of(out, probe), expected, atol=1e-5, rtol=0)


def test_lora_alpha_missing_is_an_error_not_a_default(tmp_path_factory, tmp_path, capsys):
    from fsdp_factory import copy_fsdp_checkpoint

    info = copy_fsdp_checkpoint(cached_fsdp_checkpoint(tmp_path_factory, lora=True), tmp_path / "copy")
    ckpt = Path(info["checkpoint_dir"])
    (ckpt / "lora_train_meta.json").unlink()
    out = tmp_path / "merged"
    code = cli_main(["merge", str(ckpt), "--out", str(out), "--plain"])
    err = capsys.readouterr().err
    assert code == 1 and "--lora-alpha" in err and not out.exists()
    # NaN or infinity would poison every merged weight: refused by the command line itself
    for bad in ("nan", "inf"):
        with pytest.raises(SystemExit) as exit_:
            cli_main(["merge", str(ckpt), "--out", str(out), "--lora-alpha", bad, "--plain"])
        assert exit_.value.code == 2 and "not a finite number" in capsys.readouterr().err and not out.exists()
    # with the alpha given, it merges
    alpha = str(info["lora_alpha"])
    assert cli_main(["merge", str(ckpt), "--out", str(out), "--lora-alpha", alpha, "--plain"]) == 0


def test_verl_command_line_and_test_command(tmp_path_factory, tmp_path, capsys):
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2)
    out = tmp_path / "merged"
    code = cli_main(
        ["merge", "--backend", "fsdp", "--local_dir", info["checkpoint_dir"], "--target_dir", str(out),
         "--trust-remote-code", "--plain"]
    )
    assert code == 0, capsys.readouterr().err
    # a reference model folder made from the library's own gathered weights
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    shutil.copy(info["reference"], ref_dir / "model.safetensors")
    shutil.copy(Path(info["hf_dir"]) / "config.json", ref_dir / "config.json")
    args = ["test", "--backend", "fsdp", "--local_dir", info["checkpoint_dir"], "--test_hf_dir", str(ref_dir)]
    assert cli_main(args) == 0
    said = capsys.readouterr().out
    assert "matches" in said and "logits match the unmerged model" in said
    # a reference that differs in one tensor is reported
    from safetensors.torch import load_file, save_file

    state = load_file(ref_dir / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 0.5
    save_file(state, ref_dir / "model.safetensors", metadata={"format": "pt"})
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert "model.norm.weight" in err and "1 difference" in err


def test_export_adapter_writes_base_and_a_peft_adapter(tmp_path_factory, tmp_path):
    """--export-adapter keeps the LoRA apart: the base weights plus lora_adapter/ that peft loads and
    that behaves like the training run's unmerged model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, lora=True)
    out = tmp_path / "exported"
    assert cli_main(["merge", info["checkpoint_dir"], "--out", str(out), "--export-adapter", "--plain"]) == 0
    ours = read_output(out)
    ref_base = read_output(Path(info["reference_base"]))
    assert set(ours) == set(ref_base)
    for name in ours:
        assert torch.equal(ours[name], ref_base[name].to(ours[name].dtype)), name
    probe = torch.tensor([[5, 17, 300, 999, 42, 7]])
    ours_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / "lora_adapter")
    ref_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(info["reference_base"], dtype=torch.float32), info["reference_adapter"]
    )
    with torch.no_grad():
        torch.testing.assert_close(ours_model(probe).logits, ref_model(probe).logits, atol=1e-5, rtol=0)


def test_alpha_from_an_old_lora_adapter_folder(tmp_path_factory, tmp_path, capsys):
    """verl <= 0.7 recorded alpha in lora_adapter/adapter_config.json, and some versions wrote 0 there,
    which silently disables the adapter: that must be an error, and a real alpha must be used."""
    from fsdp_factory import copy_fsdp_checkpoint

    info = copy_fsdp_checkpoint(cached_fsdp_checkpoint(tmp_path_factory, lora=True), tmp_path / "copy")
    ckpt = Path(info["checkpoint_dir"])
    meta = json.loads((ckpt / "lora_train_meta.json").read_text())
    (ckpt / "lora_train_meta.json").unlink()
    (ckpt / "lora_adapter").mkdir()
    cfg_path = ckpt / "lora_adapter" / "adapter_config.json"
    cfg_path.write_text(json.dumps({"peft_type": "LORA", "r": meta["r"], "lora_alpha": 0}))
    out = tmp_path / "merged"
    assert cli_main(["merge", str(ckpt), "--out", str(out), "--plain"]) == 1
    assert "lora_alpha is 0" in capsys.readouterr().err and not out.exists()
    cfg_path.write_text(json.dumps({"peft_type": "LORA", "r": meta["r"], "lora_alpha": meta["lora_alpha"]}))
    assert cli_main(["merge", str(ckpt), "--out", str(out), "--plain"]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = torch.tensor([[5, 17, 300, 999]])
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(info["reference_base"], dtype=torch.float32), info["reference_adapter"])
    with torch.no_grad():
        torch.testing.assert_close(logits_of(out, probe), ref(probe).logits, atol=1e-5, rtol=0)


def test_save_lora_only_checkpoint_needs_and_uses_the_base(tmp_path_factory, tmp_path, capsys):
    """checkpoint.save_lora_only keeps only the LoRA tensors (DTensors re-saved by torch): the merge
    asks for the base model, then merges onto it."""
    import torch.distributed.tensor  # noqa: F401  (torch.load of DTensors needs it)

    from fsdp_factory import copy_fsdp_checkpoint

    info = copy_fsdp_checkpoint(cached_fsdp_checkpoint(tmp_path_factory, lora=True), tmp_path / "copy")
    for path in info["model_files"]:
        state = torch.load(path, map_location="cpu", weights_only=True)
        torch.save({k: v for k, v in state.items() if ".lora_" in k}, path)
    ckpt = info["checkpoint_dir"]
    out = tmp_path / "merged"
    assert cli_main(["merge", ckpt, "--out", str(out), "--plain"]) == 1
    assert "--base" in capsys.readouterr().err and not out.exists()
    assert cli_main(["merge", ckpt, "--base", info["reference_base"], "--out", str(out), "--plain"]) == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = torch.tensor([[5, 17, 300, 999]])
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(info["reference_base"], dtype=torch.float32), info["reference_adapter"])
    with torch.no_grad():
        torch.testing.assert_close(logits_of(out, probe, dtype=torch.float32), ref(probe).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "case", ["fsdp1-w4", "fsdp2-w4", "fsdp2-hsdp", "fsdp2-shard-dim1", "fsdp2-buffers", "fsdp1-sharded-tensor-w4"]
)
def test_checkpoint_written_in_bf16(tmp_path_factory, tmp_path, case):
    """A dtype change goes shard by shard (cast into a small buffer, written at its place) instead of
    through the fp32 copy path; the result is the reference rounded once."""
    info = cached_fsdp_checkpoint(tmp_path_factory, **CONFIGS[case])
    out = tmp_path / "merged"
    run_merge(MergeOptions(checkpoint=info["run_dir"], out=out, dtype="bf16"))
    ours = read_output(out)
    ref = _reference(info)
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(ours[name], expected), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("case", ["fsdp1-w4", "fsdp2-w4"])
def test_a_converted_tensor_is_written_in_pieces(tmp_path_factory, tmp_path, monkeypatch, case):
    """Rank shards cast to bf16 go to the writer thread in pieces of CHUNK_BYTES (here 1000 bytes:
    several per shard, the last of each shard shorter), never a whole shard in one buffer: the
    output is the reference rounded once, every tensor arrives in order, and no buffer the merge
    takes is as large as the largest rank shard."""
    from tui_merger.core.io.safetensors_io import SafetensorsWriter
    from tui_merger.core.merge import engine, merge_math

    monkeypatch.setattr(engine, "CHUNK_BYTES", 1000)
    buffers, pieces = [], {}
    real_get, real_part = merge_math.Workspace.get, SafetensorsWriter.write_part

    def get(self, key, shape, dtype):
        buf = real_get(self, key, shape, dtype)
        buffers.append(buf.numel() * buf.element_size())
        return buf

    def write_part(self, name, nbytes, pos, part, last):
        pieces.setdefault(name, []).append((pos, part.numel() * part.element_size(), last))
        return real_part(self, name, nbytes, pos, part, last)

    monkeypatch.setattr(merge_math.Workspace, "get", get)
    monkeypatch.setattr(SafetensorsWriter, "write_part", write_part)
    info = cached_fsdp_checkpoint(tmp_path_factory, **CONFIGS[case])
    out = tmp_path / "merged"
    run_merge(MergeOptions(checkpoint=info["run_dir"], out=out, dtype="bf16"))
    ours, ref = read_output(out), _reference(info)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor.to(torch.bfloat16)), name
    embed = "model.embed_tokens.weight"
    assert len(pieces[embed]) > 4 * 4  # every rank shard of the embedding in several pieces
    for name, parts in pieces.items():
        assert [p[0] for p in parts] == [sum(q[1] for q in parts[:i]) for i in range(len(parts))], name
        assert [p[2] for p in parts] == [False] * (len(parts) - 1) + [True], name
        assert sum(p[1] for p in parts) == ours[name].numel() * 2, name
    assert max(buffers) <= 1000 < ours[embed].numel() * 2 // 4  # a piece, not a quarter of the embedding


def test_lora_merged_weights_stream_from_the_rank_shards(tmp_path_factory, tmp_path, monkeypatch):
    """A LoRA'd weight of an FSDP checkpoint is merged a block of rows at a time from its rank shards
    (each shard's pages handed back after it) and written in pieces, never held whole; the result is
    peft's merge of the weights saved before sharding, bit for bit (rounded once to the output dtype)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tui_merger.core.merge import engine, merge_math

    monkeypatch.setattr(merge_math, "block_rows", lambda cols: max(2, 3 * 64 // cols))
    monkeypatch.setattr(engine, "CHUNK_BYTES", 1000)
    segmented = []
    real_init = merge_math.RowBlocks.__init__

    def init(self, t, *args, **kw):
        real_init(self, t, *args, **kw)
        segmented.append((t.name, len(self.segments), self.w is None))

    monkeypatch.setattr(merge_math.RowBlocks, "__init__", init)
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, lora=True)
    out = tmp_path / "merged"
    result = run_merge(MergeOptions(checkpoint=info["checkpoint_dir"], out=out))
    assert len(segmented) == result.tensors_merged > 0
    assert all(n == 2 and pieces for _, n, pieces in segmented)  # both ranks' rows, no whole tensor
    base = AutoModelForCausalLM.from_pretrained(info["reference_base"], dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, info["reference_adapter"]).merge_and_unload().state_dict()
    ours = read_output(out)
    for name, _, _ in segmented:
        want = merged[name].to(ours[name].dtype)
        assert_same_or_one_unit(ours[name], want, name)
