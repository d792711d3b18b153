"""HF Trainer checkpoints that accelerate's FSDP saved with SHARDED_STATE_DICT (tests/fixtures/trainer:
written by the real Trainer, accelerate and torch on 2 CPU processes) become the model save_pretrained
writes: every tensor equal to accelerate's own ``merge-weights`` loaded into the model and saved by
transformers (``reference.safetensors``); a LoRA run equals peft's merge_and_unload."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from safetensors.torch import load_file

from tui_merger.cli import main as cli_main
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.scan import scan
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

FIXTURES = Path(__file__).parent / "fixtures" / "trainer"
FULL = ["fsdp2_fp32", "fsdp1_fp32_tied", "fsdp2_bf16mp", "fsdp2_bf16load_tied", "fsdp1_bf16mp", "fsdp2_moe",
        "fsdp2_ramload"]


def _newest(run: str) -> Path:
    return max((FIXTURES / run).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))


def _args(run: str) -> dict:
    return json.loads((FIXTURES / run / "gen_args.json").read_text())


def _snapshot(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*")}


@pytest.mark.parametrize("run", FULL)
def test_full_fine_tune_equals_accelerates_merge(tmp_path, run):
    """Every tensor, in the config's dtype (float32 here): equal to the reference bit for bit; a tied
    run is written once (no lm_head), as save_pretrained writes it; config, generation config, tokenizer
    and chat template come from --base."""
    ckpt, base = _newest(run), FIXTURES / run / "base_model"
    before = _snapshot(FIXTURES / run)
    out = tmp_path / "out"
    result = run_merge(MergeOptions(checkpoint=ckpt, base=base, out=out))
    ours, ref = read_output(out), load_file(FIXTURES / run / "reference.safetensors")
    assert set(ours) == set(ref)
    assert ("lm_head.weight" in ours) is not _args(run)["tied"]
    if _args(run)["arch"] == "qwen3_moe":  # packed in memory (and in the DCP files), one tensor per expert on disk
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in ours
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in ours)
    for name, want in ref.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], want), name
    assert result.tensors_merged == 0
    config = json.loads((out / "config.json").read_text())
    base_config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == base_config["architectures"]
    assert bool(config.get("tie_word_embeddings")) is _args(run)["tied"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert _snapshot(FIXTURES / run) == before  # the inputs are untouched


@pytest.mark.parametrize("run", ["fsdp2_bf16mp", "fsdp2_bf16load_tied"])
def test_dtype_bf16_rounds_once(tmp_path, run):
    """--dtype bf16: the stored values rounded once (a bf16-stored run: exactly what it stored)."""
    out = tmp_path / "out"
    run_merge(MergeOptions(checkpoint=_newest(run), base=FIXTURES / run / "base_model", out=out, dtype="bfloat16"))
    ours, ref = read_output(out), load_file(FIXTURES / run / "reference.safetensors")
    for name, want in ref.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], want.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_merge_verifies_and_transformers_loads(tmp_path, capsys):
    """The command a user runs: merged, verified (structure, recompute), loaded by transformers with the
    weights of the reference; the bf16-stored run's float32 output is said."""
    from transformers import AutoModelForCausalLM

    run = "fsdp2_bf16load_tied"
    out = tmp_path / "out"
    code = cli_main(["merge", str(_newest(run)), "--base", str(FIXTURES / run / "base_model"), "--out", str(out), "--plain"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "PASS  recompute" in text.out
    assert "The checkpoint stores bfloat16; the model is written in float32" in text.err + text.out
    model = AutoModelForCausalLM.from_pretrained(out)
    ref = load_file(FIXTURES / run / "reference.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_backend_name_and_the_output_dir(tmp_path):
    """--backend accelerate-fsdp takes it; the run folder (output_dir) means its newest step."""
    from tui_merger.core.formats.registry import check_backend, checkpoint_format

    run = FIXTURES / "fsdp2_fp32"
    check_backend(_newest("fsdp2_fp32"), "accelerate-fsdp")
    with pytest.raises(MergeError, match="use --backend accelerate-fsdp"):
        check_backend(_newest("fsdp2_fp32"), "fsdp")
    fmt = checkpoint_format(run)
    layout = fmt.locate(run)
    assert layout.folder.name == "checkpoint-4"
    assert layout.notices == ["Using the newest checkpoint, checkpoint-4."]


def test_inspect_says_what_is_stored():
    """World size, dtype, step; never 'already a complete model' for a checkpoint-N with neither
    weights nor config."""
    found = {Path(c.path).name + ":" + Path(c.path).parent.name: c for c in scan(FIXTURES).candidates}
    c = found["checkpoint-4:fsdp2_fp32"]
    assert (c.kind, c.world_size, c.dtype, c.step, c.latest, c.needs_base) == ("trainer-fsdp", 2, "float32", 4, True, True)
    assert found["checkpoint-3:fsdp2_bf16load_tied"].dtype == "bfloat16"
    assert found["checkpoint-3:fsdp2_bf16mp"].dtype == "float32"
    assert any("bf16 mixed precision" in n for n in found["checkpoint-3:fsdp2_bf16mp"].notes)
    # FULL_STATE_DICT's checkpoint holds save_pretrained's model: that one is a model (see below)
    assert all(c.kind != "trainer-checkpoint" for k, c in found.items() if k != "checkpoint-3:fsdp2_full_bf16mp")
    assert found["checkpoint-3:fsdp2_moe"].world_size == 2 and found["checkpoint-3:fsdp2_ramload"].dtype == "float32"
    from tui_merger.core.plan.choices import why_not_mergeable

    assert why_not_mergeable(c) is None
    assert why_not_mergeable(found["checkpoint-3:fsdp1_lora"]).startswith("This checkpoint's pytorch_model_fsdp_0/ holds no weights")


def test_no_config_anywhere_is_one_sentence(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["merge", str(_newest("fsdp2_fp32")), "--out", str(out), "--plain"])
    err = capsys.readouterr().err
    assert code == 1
    assert "holds no config.json" in err and "pass --base with the model the run started from" in err
    assert not out.exists() and not any(tmp_path.iterdir())


def test_a_base_of_another_model_is_refused(tmp_path):
    """The qwen2 base (biases, another architecture) for a llama run: one sentence, nothing written."""
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="pass --base with the model the run started from"):
        run_merge(MergeOptions(checkpoint=_newest("fsdp2_fp32"), base=FIXTURES / "fsdp1_fp32_tied" / "base_model", out=out))
    assert not any(tmp_path.iterdir())


def test_fsdp1_lora_is_said(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="FSDP1 with a PEFT LoRA saves no weights there"):
        run_merge(MergeOptions(checkpoint=_newest("fsdp1_lora"), base=FIXTURES / "fsdp1_lora" / "base_model",
                               out=out, lora_alpha=8))
    assert not any(tmp_path.iterdir())


def test_lora_run_equals_peft(tmp_path):
    """An FSDP2 LoRA run holds only the adapter: r from the shapes, targets from the names, alpha from
    --lora-alpha; merged into --base it equals peft's merge_and_unload of the same adapter."""
    run = "fsdp2_lora"
    out = tmp_path / "out"
    result = run_merge(MergeOptions(checkpoint=_newest(run), base=FIXTURES / run / "base_model", out=out, lora_alpha=8))
    ours, ref = read_output(out), load_file(FIXTURES / run / "reference.safetensors")
    assert set(ours) == set(ref)
    assert result.tensors_merged == 4
    for name, want in ref.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)
    changed = [n for n in ref if not torch.equal(ref[n], load_file(FIXTURES / run / "base_model" / "model.safetensors")[n])]
    assert sorted(changed) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qv")


def test_lora_run_needs_alpha_and_base(tmp_path, capsys):
    run = "fsdp2_lora"
    out = tmp_path / "out"
    code = cli_main(["merge", str(_newest(run)), "--base", str(FIXTURES / run / "base_model"), "--out", str(out), "--plain"])
    assert code == 1
    assert "pass --lora-alpha with the value used in training" in capsys.readouterr().err
    code = cli_main(["merge", str(_newest(run)), "--lora-alpha", "8", "--out", str(out), "--plain"])
    assert code == 1
    assert "--base" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    c = next(c for c in scan(FIXTURES / run).candidates if c.kind == "trainer-fsdp")
    assert c.lora["r"] == 4 and c.lora["alpha"] is None and c.lora["target_modules"] == ["q_proj", "v_proj"]
    from tui_merger.core.plan.choices import needs_alpha, needs_base

    assert needs_alpha(c) and needs_base(c)


def test_damaged_checkpoint_is_one_sentence(tmp_path):
    """A rank's file missing, or a truncated one: one sentence, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "fsdp2_fp32", run)
    ckpt = run / "checkpoint-4"
    (ckpt / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="is missing; the dist checkpoint is incomplete"):
        run_merge(MergeOptions(checkpoint=ckpt, base=run / "base_model", out=out))
    shutil.copy(_newest("fsdp2_fp32") / "pytorch_model_fsdp_0" / "__1_0.distcp", ckpt / "pytorch_model_fsdp_0")
    data = ckpt / "pytorch_model_fsdp_0" / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(MergeError, match="truncated"):
        run_merge(MergeOptions(checkpoint=ckpt, base=run / "base_model", out=out))
    assert not out.exists()


def test_the_base_beside_the_run_is_proposed():
    """No config names the base: the models whose weights match the checkpoint's, name for name and shape
    for shape, are proposed, the one beside the run first; a model of another shape is not."""
    from tui_merger.core.plan.choices import base_candidates

    models = [FIXTURES / r / "base_model" for r in ("fsdp1_fp32_tied", "fsdp2_bf16load_tied", "fsdp2_fp32")]
    found = base_candidates(_newest("fsdp2_fp32"), models, cache=False)
    assert found[0] == (FIXTURES / "fsdp2_fp32" / "base_model",
                        "fits all 21 weights; LlamaForCausalLM, 2 layers; found in the folder")
    assert FIXTURES / "fsdp1_fp32_tied" / "base_model" not in [p for p, _ in found]
    lora = base_candidates(_newest("fsdp2_lora"), [FIXTURES / "fsdp2_lora" / "base_model"], cache=False)
    assert lora[0][1].startswith("fits all 4 LoRA modules")


def test_a_checkpoint_with_only_trainer_state_is_not_called_a_model(tmp_path):
    """A checkpoint-N that holds no weights at all (trainer_state.json only) says so, not "full weights"."""
    from tui_merger.core.plan.choices import why_not_mergeable

    ckpt = tmp_path / "run" / "checkpoint-7"
    ckpt.mkdir(parents=True)
    shutil.copy(_newest("fsdp2_fp32") / "trainer_state.json", ckpt)
    (c,) = scan(tmp_path).candidates
    said = why_not_mergeable(c)
    assert said == "This checkpoint has no model weights or adapter: only trainer state, so there is nothing to merge."


def test_review_says_the_world_size_and_what_is_stored():
    """The plan (Review, --dry-run) says it as inspect does: ranks, and fp32 masters under bf16 mixed precision."""
    from tui_merger.core.plan.preflight import make_plan

    run = "fsdp2_bf16mp"
    plan = make_plan(MergeOptions(checkpoint=_newest(run), base=FIXTURES / run / "base_model", out=Path("/nonexistent/out")))
    said = [f.message for f in plan.findings]
    assert ("An accelerate FSDP checkpoint (SHARDED_STATE_DICT): full weights sharded over 2 rank(s), stored in float32 "
            "(what FSDP keeps under bf16 mixed precision, or an fp32 run).") in said
    plan = make_plan(MergeOptions(checkpoint=_newest("fsdp2_bf16load_tied"), base=FIXTURES / "fsdp2_bf16load_tied" / "base_model",
                                  out=Path("/nonexistent/out")))
    assert any("stored in bfloat16 (the model was loaded in bf16)" in f.message for f in plan.findings)


def test_missing_metadata_is_one_sentence(tmp_path):
    """A save that did not finish (no .metadata): inspect says so, the merge refuses in one sentence, nothing written."""
    from tui_merger.core.plan.choices import why_not_mergeable

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "fsdp2_bf16mp", run)
    ckpt = run / "checkpoint-3"
    (ckpt / "pytorch_model_fsdp_0" / ".metadata").unlink()
    (c,) = [c for c in scan(run).candidates if c.kind == "trainer-fsdp"]
    assert why_not_mergeable(c) == ("This checkpoint's pytorch_model_fsdp_0/ has no .metadata: the save did not finish; "
                                    "use an earlier step.")
    out = tmp_path / "out"
    with pytest.raises(MergeError, match=r"has no \.metadata file, so it is not a complete dist checkpoint"):
        run_merge(MergeOptions(checkpoint=ckpt, base=run / "base_model", out=out))
    assert not out.exists()


def test_full_state_dict_checkpoint_is_the_model_it_says():
    """FULL_STATE_DICT (accelerate's default): the Trainer's checkpoint-N holds save_pretrained's model.safetensors and
    config.json beside accelerate's pytorch_model_fsdp.bin; inspect calls it a model, which transformers loads with
    the weights of pytorch_model_fsdp.bin."""
    from transformers import AutoModelForCausalLM

    from tui_merger.core.plan.choices import why_not_mergeable

    ckpt = _newest("fsdp2_full_bf16mp")
    (c,) = scan(ckpt).candidates
    assert c.kind != "trainer-fsdp"
    assert why_not_mergeable(c) == "This checkpoint holds full weights, already a model: there is nothing to merge."
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    saved = torch.load(ckpt / "pytorch_model_fsdp.bin", weights_only=True)
    state = model.state_dict()
    assert set(saved) == set(state)
    for name, want in saved.items():
        assert torch.equal(state[name], want), name


def test_full_state_dict_file_alone_is_merged(tmp_path, capsys):
    """pytorch_model_fsdp.bin with no model beside it (accelerate's save_state, or a save_model that did not
    finish): merged with --base, every tensor equal to the Trainer's own save_pretrained of the same run."""
    src = _newest("fsdp2_full_bf16mp")
    ckpt = tmp_path / "run" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    for name in ("pytorch_model_fsdp.bin", "trainer_state.json", "scheduler.pt"):
        shutil.copy(src / name, ckpt)
    (c,) = scan(tmp_path / "run").candidates
    assert c.kind == "trainer-fsdp" and c.needs_base
    assert c.dtype == "float32"
    assert ("full weights in one file (pytorch_model_fsdp.bin: FULL_STATE_DICT, gathered on rank 0), stored in float32 "
            "(what FSDP keeps under bf16 mixed precision, or an fp32 run).") in c.notes
    out = tmp_path / "out"
    base = FIXTURES / "fsdp2_full_bf16mp" / "base_model"
    code = cli_main(["merge", str(ckpt), "--base", str(base), "--out", str(out), "--plain"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "PASS  recompute" in text.out
    ours, ref = read_output(out), load_file(src / "model.safetensors")
    assert set(ours) == set(ref)
    for name, want in ref.items():
        assert ours[name].dtype == want.dtype and torch.equal(ours[name], want), name


def test_per_rank_files_are_said(tmp_path):
    """LOCAL_STATE_DICT (or SHARDED_STATE_DICT with use_dcp=False) leaves per-rank .bin files, named as accelerate's
    save_fsdp_model names them: said in one sentence, nothing written."""
    from tui_merger.core.plan.choices import why_not_mergeable

    ckpt = tmp_path / "run" / "checkpoint-5"
    ckpt.mkdir(parents=True)
    for r in (0, 1):
        (ckpt / f"pytorch_model_fsdp_0_rank{r}.bin").write_bytes(b"not read")
    shutil.copy(_newest("fsdp2_fp32") / "trainer_state.json", ckpt)
    (c,) = scan(tmp_path / "run").candidates
    assert c.kind == "trainer-fsdp" and c.world_size == 2
    said = why_not_mergeable(c)
    assert said.startswith("This checkpoint holds FSDP's per-rank files (pytorch_model_fsdp_0_rank0.bin: LOCAL_STATE_DICT")
    out = tmp_path / "out"
    with pytest.raises(MergeError, match="only FSDP itself, on the same number of processes, can load"):
        run_merge(MergeOptions(checkpoint=ckpt, base=FIXTURES / "fsdp2_fp32" / "base_model", out=out))
    assert not out.exists()


def test_plain_flow_asks_lora_alpha_for_an_fsdp_lora_run(tmp_path, monkeypatch):
    """The plain flow on an FSDP2 LoRA run: the notes say what is stored, it asks for the base and for lora_alpha
    (nothing records it, as for verl), and the merge with the answer equals peft's merge_and_unload."""
    import io

    from tui_merger.plain import run_plain

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    run = shutil.copytree(FIXTURES / "fsdp2_lora", tmp_path / "fsdp2_lora")
    ref = load_file(run / "reference.safetensors")
    (run / "reference.safetensors").unlink()
    out = io.StringIO()
    answers = ["", str(run / "base_model"), "8", "", "1", "", "4"]  # checkpoint, base, alpha, out, Start, no Try, Done
    code = run_plain(run / "checkpoint-3", input=io.StringIO("".join(a + "\n" for a in answers)), output=out, dumb=True)
    text = out.getvalue()
    assert code == 0, text
    assert "trainer-fsdp  " in text and "r=4 alpha=?" in text
    assert "holds the adapter only (4 modules, float32)" in text
    assert "lora_alpha used in training" in text
    assert "An accelerate FSDP LoRA checkpoint: the adapter's factors sharded over 2 rank(s), stored in float32." in text
    assert "Verification of " in text and ": PASSED" in text
    (merged,) = [p for p in tmp_path.iterdir() if (p / "merge_manifest.json").is_file()]
    ours = read_output(merged)
    assert set(ours) == set(ref)
    for name, want in ref.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)
