"""verl Megatron checkpoints written by megatron-core itself (tests/fixtures/megatron, made by its
generate.py) convert to Hugging Face models whose logits equal megatron's own forward pass.

Tolerance: |logits - megatron's| <= 1e-4 x max|megatron logit|. Both sides compute in fp32 with the
same weights (the conversion copies values exactly); what remains is the order of fp32 reductions in
two implementations (megatron's attention/MLP vs transformers' eager ones): measured 4.5e-8 to 2.4e-7
here (logit scale 0.17-1.55), so the tolerance leaves room for other CPUs' kernels while staying three
orders below what a mapping mistake does: the negative control (k and v swapped in the converted files)
moves the logits by 0.12-0.56 in every case.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from factory import read_output
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from tui_merger.cli import main as cli_main
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"
ROOT = Path(__file__).resolve().parents[1]
# case -> (layout, what it covers)
CASES = {
    "qwen2_tp2": "v2, tensor parallel 2, qkv bias",
    "qwen2_pp2": "v1 (dist_ckpt + rng_state in one archive), pipeline parallel 2",
    "qwen2_tp2pp2": "v2, TP2 x PP2",
    "qwen2_pp2vpp2": "v2, PP2 x virtual pipeline 2",
    "qwen3_tp2_tied": "v2, TP2, q/k norms, tied embeddings",
    "qwen3moe_ep2": "v2, Qwen3-MoE, expert parallel 2",
    "qwen2moe_shared_ep2": "v2, Qwen2-MoE with a gated shared expert, EP2",
    "legacy_tp2pp2": "legacy mp_rank files, TP2 x PP2",
    "qwen2_critic_tp2": "v2, critic (value model), TP2",
}
REL_TOL = 1e-4


def _case(name: str) -> Path:
    path = FIXTURES / name
    if not (path / "reference.pt").is_file():
        pytest.skip(f"fixture {name} is not generated (tests/fixtures/megatron/generate.py --case {name})")
    return path


def _reference(name: str) -> dict:
    return torch.load(FIXTURES / name / "reference.pt", weights_only=True)


def _model(out: Path, critic: bool):
    cls = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    return cls.from_pretrained(out, dtype=torch.float32).eval()


def _logits(out: Path, ids, critic: bool):
    with torch.no_grad():
        return _model(out, critic)(ids).logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each case converted once with the real pipeline (run folder given, as users do)."""
    top = tmp_path_factory.mktemp("megatron")
    done = {}
    for name in CASES:
        if (FIXTURES / name / "reference.pt").is_file():
            out = top / name
            done[name] = (out, run_merge(MergeOptions(checkpoint=FIXTURES / name, out=out), fsync=False))
    return done


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_megatrons_own_forward(converted, name):
    _case(name)
    out, result = converted[name]
    ref = _reference(name)
    critic = "critic" in name
    got = _logits(out, ref["input_ids"], critic)
    want = ref["logits"]
    assert got.shape == want.shape
    atol = REL_TOL * want.abs().max().item()
    diff = (got - want).abs().max().item()
    assert diff <= atol, f"{name}: max |logit diff| {diff:.3g} > {atol:.3g}"
    assert result.kind == "convert" and result.tensors_merged == 0
    # the values that need no q/k/v or gate/up mapping are copied exactly
    ours = read_output(out)
    for key, tensor in ref["expected"].items():
        if key.endswith("[:8]"):
            assert torch.equal(ours[key[:-4]][:8], tensor), key
        elif key.endswith("[-8:]"):
            assert torch.equal(ours[key[:-5]][-8:], tensor), key
        else:
            assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("name", list(CASES))
def test_swapping_k_and_v_would_not_match(converted, tmp_path, name):
    """The negative control: the comparison above can fail. k and v of every layer exchanged in the
    converted files (same shapes, so the model still loads) move the logits far beyond the tolerance."""
    _case(name)
    out, _ = converted[name]
    bad = tmp_path / "swapped"
    shutil.copytree(out, bad)
    state = load_file(bad / "model.safetensors")
    for key in [k for k in state if k.endswith("self_attn.k_proj.weight")]:
        v = key.replace("k_proj", "v_proj")
        state[key], state[v] = state[v], state[key]
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    ref = _reference(name)
    diff = (_logits(bad, ref["input_ids"], "critic" in name) - ref["logits"]).abs().max().item()
    assert diff > 100 * REL_TOL * ref["logits"].abs().max().item(), diff
    from tui_merger.core.verify.checks import verify_merge

    report = verify_merge(bad, MergeOptions(checkpoint=FIXTURES / name, out=bad))  # and verification says so
    assert not report.passed and report.checks[1].status == "fail"
    assert any("k_proj" in d for d in report.checks[1].details)


@pytest.mark.parametrize("name", list(CASES))
def test_verify_passes_on_every_result(converted, name):
    from tui_merger.core.verify.checks import verify_merge

    _case(name)
    out, _ = converted[name]
    report = verify_merge(out, MergeOptions(checkpoint=FIXTURES / name, out=out))
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]
    assert [c.name for c in report.checks] == ["structure", "recompute", "behaviour"]


def test_hugging_face_names_and_config(converted):
    """Names transformers and vLLM load (per-expert MoE weights, never verl's experts.down_proj.weight0),
    the padded vocabulary cut to the config's, ties and value heads as the model class wants them."""
    for name, (out, result) in converted.items():
        ours = read_output(out)
        config = json.loads((out / "config.json").read_text())
        ref = _reference(name)
        vocab = int(ref["hf_vocab_size"])
        assert ours["model.embed_tokens.weight"].shape[0] == vocab == config["vocab_size"], name
        assert int(ref["padded_vocab_size"]) > vocab  # Megatron padded it: the padding rows are cut
        assert any("padding" in w and str(int(ref["padded_vocab_size"])) in w for w in result.warnings), name
        assert not [k for k in ours if not k.startswith(("model.", "lm_head.", "score."))], name
        assert not [k for k in ours if k.rsplit(".", 1)[-1].startswith("weight") and k[-1].isdigit()], name
        if "moe" in name:
            for e in range(4):
                for proj in ("gate", "up", "down"):
                    assert ours[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"].dim() == 2
            assert ours["model.layers.0.mlp.gate.weight"].shape == (4, 64)
        if "qwen2moe" in name:
            assert ours["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
            shared = config["shared_expert_intermediate_size"]
            assert ours["model.layers.0.mlp.shared_expert.down_proj.weight"].shape == (64, shared)
            assert ours["model.layers.0.mlp.shared_expert.gate_proj.weight"].shape == (shared, 64)
        if "tied" in name:
            assert "lm_head.weight" not in ours and config["tie_word_embeddings"] is True
        elif "critic" in name:
            assert ours["score.weight"].shape == (1, 64) and "lm_head.weight" not in ours
            assert torch.equal(ours["score.bias"], torch.zeros(1))  # Megatron's value head has no bias
            assert config["architectures"] == ["Qwen2ForTokenClassification"] and len(config["id2label"]) == 1
        else:
            assert ours["lm_head.weight"].shape == (vocab, 64) and config["tie_word_embeddings"] is False
        gen = FIXTURES / name / "global_step_1"
        if list(gen.rglob("generation_config.json")):
            assert json.loads((out / "generation_config.json").read_text())["top_k"] == 20  # copied, not rebuilt


def test_every_chunk_is_decoded_once(converted):
    """q, k and v (and gate and up) come from the same chunks: the one-group cache reads them once."""
    from tui_merger.core.formats.inputs import open_inputs

    name = next(n for n in ("qwen2_tp2pp2", "qwen2_tp2") if n in converted)
    inputs = open_inputs(MergeOptions(checkpoint=FIXTURES / name, out=Path("unused")))
    try:
        store = inputs.base.store
        for ref in inputs.base.tensors.values():
            ref.load()
            ref.release()
        chunks = sum(len(t.chunks) for t in store.tensors.values())
        assert store.decoded == chunks
        assert store._group is None  # the last group was handed back once its tensors were done
    finally:
        inputs.close()


def test_llama_through_a_plain_torch_dcp_checkpoint(tmp_path):
    """No megatron-core Llama fixture: a Llama model (8 heads in 2 KV groups, tied embeddings) written in
    mcore's names and layout (per-layer keys this time) with plain torch DCP converts back to its own
    weights exactly, and transformers gives the same logits."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in hf:
        if k.endswith("norm.weight"):
            hf[k] += 0.1 * torch.randn_like(hf[k])
    model.load_state_dict(hf)
    sd = {"embedding.word_embeddings.weight": torch.cat([hf["model.embed_tokens.weight"], torch.zeros(32, 64)]),
          "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    for i in range(2):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"].view(2, 4 * 8, 64)
        k = hf[p + "self_attn.k_proj.weight"].view(2, 8, 64)
        v = hf[p + "self_attn.v_proj.weight"].view(2, 8, 64)
        sd[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, 64)
        sd[m + "self_attention.linear_qkv.layer_norm_weight"] = hf[p + "input_layernorm.weight"]
        sd[m + "self_attention.linear_proj.weight"] = hf[p + "self_attn.o_proj.weight"]
        sd[m + "mlp.linear_fc1.layer_norm_weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[m + "mlp.linear_fc1.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
        sd[m + "mlp.linear_fc2.weight"] = hf[p + "mlp.down_proj.weight"]
    actor = tmp_path / "global_step_2" / "actor"
    cfg.save_pretrained(actor / "model" / "huggingface")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**sd, "decoder.layers.0.self_attention.linear_qkv._extra_state": b"te"},
                 checkpoint_id=str(actor / "model" / "dist_ckpt"), no_dist=True)
    out = tmp_path / "out"
    run_merge(MergeOptions(checkpoint=tmp_path, out=out), fsync=False)
    ours = read_output(out)
    assert set(ours) == set(hf) - {"lm_head.weight"}
    assert all(torch.equal(ours[k], hf[k]) for k in ours)
    ids = torch.tensor([[1, 5, 9, 50, 95, 3]])
    with torch.no_grad():
        torch.testing.assert_close(_logits(out, ids, False), model(ids).logits, atol=1e-6, rtol=0)


def test_legacy_virtual_pipeline_chunks_are_numbered_across_stages(converted, tmp_path):
    """Legacy rank files with two virtual-pipeline chunks per stage (re-cut from the TP2 x PP2 fixture:
    chunk v of stage p holds global layer v * 2 + p, each numbered 0 in its chunk) convert to the same
    model as the original files."""
    name = "legacy_tp2pp2"
    _case(name)
    src = FIXTURES / name / "global_step_1" / "actor"
    run = tmp_path / "run"
    actor = run / "global_step_1" / "actor"
    shutil.copytree(src / "hf_config_and_tokenizer", actor / "hf_config_and_tokenizer")
    for tp in range(2):
        layers, top = {}, {}
        for pp in range(2):
            (chunk,) = torch.load(src / "model" / f"mp_rank_{tp:02d}_{pp:03d}" / "model.pt", weights_only=True)
            for key, value in chunk.items():
                parts = key.split(".")
                if parts[:2] == ["decoder", "layers"]:
                    layers.setdefault(pp * 2 + int(parts[2]), {})[".".join(parts[3:])] = value
                else:
                    top[key] = value
        for pp in range(2):
            chunks = []
            for v in range(2):
                sd = {f"decoder.layers.0.{k}": t for k, t in layers[v * 2 + pp].items()}
                if (v, pp) == (0, 0):
                    sd["embedding.word_embeddings.weight"] = top["embedding.word_embeddings.weight"]
                if (v, pp) == (1, 1):
                    sd.update({k: t for k, t in top.items() if not k.startswith("embedding.")})
                chunks.append(sd)
            folder = actor / "model" / f"mp_rank_{tp:02d}_{pp:03d}"
            folder.mkdir(parents=True)
            torch.save(chunks, folder / "model.pt")
    out = tmp_path / "out"
    run_merge(MergeOptions(checkpoint=run, out=out), fsync=False)
    ours, want = read_output(out), read_output(converted[name][0])
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want)


@pytest.mark.parametrize("where", ["run", "step", "actor", "dist_ckpt"])
def test_run_step_actor_or_dist_ckpt_folder(where):
    from tui_merger.core.formats.inputs import open_inputs

    run = _case("qwen2_tp2pp2")
    path = {
        "run": run,
        "step": run / "global_step_1",
        "actor": run / "global_step_1" / "actor",
        "dist_ckpt": run / "global_step_1" / "actor" / "model" / "dist_ckpt",
    }[where]
    inputs = open_inputs(MergeOptions(checkpoint=path, out=Path("unused")))
    try:
        assert "model.layers.1.self_attn.q_proj.weight" in inputs.base.tensors
        assert inputs.base.tensors["model.layers.1.self_attn.q_proj.weight"].shape == (64, 64)
    finally:
        inputs.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_other_dtype_is_the_fp32_conversion_rounded_once(converted, tmp_path, dtype):
    """fp32 -> fp32 copies the stored rows in the kernel; bf16 converts them in row blocks; fp16 goes
    through whole tensors (its overflow check): each path gives the exact conversion, rounded once."""
    name = "qwen2_tp2pp2"
    _case(name)
    out = tmp_path / dtype
    run_merge(MergeOptions(checkpoint=FIXTURES / name, out=out, dtype=dtype), fsync=False)
    ours, fp32 = read_output(out), read_output(converted[name][0])
    assert set(ours) == set(fp32)
    want = getattr(torch, dtype)
    for key, tensor in fp32.items():
        assert ours[key].dtype == want and torch.equal(ours[key], tensor.to(want)), key
    assert json.loads((out / "config.json").read_text())["dtype"] == dtype


def test_tie_word_embedding_never_drops_a_real_output_layer(converted, tmp_path):
    name = "qwen2_tp2"
    _case(name)
    out = tmp_path / "tied"
    result = run_merge(MergeOptions(checkpoint=FIXTURES / name, out=out, tie_word_embedding=True), fsync=False)
    ours = read_output(out)
    assert torch.equal(ours["lm_head.weight"], read_output(converted[name][0])["lm_head.weight"])
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert any("--tie-word-embedding" in w and "kept" in w for w in result.warnings)


def test_a_tied_config_with_a_different_output_layer_keeps_both(converted, tmp_path):
    """The config says tied but the checkpoint's output layer is its own (compared block by block): both
    are written and the tie is undone, instead of silently using the embedding as the output layer."""
    name = "qwen2_tp2"
    _case(name)
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / name, run, ignore=shutil.ignore_patterns("reference.pt"))
    cfg_path = run / "global_step_1" / "actor" / "model" / "huggingface" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    out = tmp_path / "out"
    result = run_merge(MergeOptions(checkpoint=run, out=out), fsync=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert any("differs" in w for w in result.warnings)
    ours, want = read_output(out), read_output(converted[name][0])
    assert torch.equal(ours["lm_head.weight"], want["lm_head.weight"])


def test_is_value_model_on_an_actor_is_refused(tmp_path, capsys):
    run = _case("qwen2_tp2")
    out = tmp_path / "v"
    code = cli_main(["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(out),
                     "--is-value-model", "--plain"])
    assert code == 1 and "score.weight" in capsys.readouterr().err and not out.exists()


def test_hf_weights_in_model_huggingface_are_copied(converted, tmp_path):
    """mbridge saves plain HF safetensors in model/huggingface: copied and verified, nothing to convert."""
    from tui_merger.core.verify.checks import verify_merge

    src, _ = converted["qwen2_tp2"] if "qwen2_tp2" in converted else pytest.skip("no qwen2_tp2 fixture")
    actor = tmp_path / "run" / "global_step_1" / "actor"
    shutil.copytree(FIXTURES / "qwen2_tp2" / "global_step_1" / "actor", actor)
    shutil.rmtree(actor / "model" / "dist_ckpt")
    shutil.copy(src / "model.safetensors", actor / "model" / "huggingface" / "model.safetensors")
    out = tmp_path / "copied"
    result = run_merge(MergeOptions(checkpoint=tmp_path / "run", out=out), fsync=False)
    assert any("nothing to convert" in w for w in result.warnings)
    ours, want = read_output(out), read_output(src)
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want)
    assert verify_merge(out, MergeOptions(checkpoint=tmp_path / "run", out=out)).passed


def test_verl_command_line_in_a_subprocess(tmp_path):
    """verl's flags as users type them, through the console entry point (verification is checked
    above, case by case, so it is left out here to keep the test fast)."""
    run = _case("qwen3_tp2_tied")
    out = tmp_path / "merged"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tui_merger", "merge", "--backend", "megatron", "--local_dir", str(run),
         "--target_dir", str(out), "--tie-word-embedding", "--trust-remote-code", "--use_cpu_initialization",
         "--plain", "--no-verify"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Merged model written to" in proc.stdout and "not verified" in proc.stdout
    ref = _reference("qwen3_tp2_tied")
    diff = (_logits(out, ref["input_ids"], False) - ref["logits"]).abs().max().item()
    assert diff <= REL_TOL * ref["logits"].abs().max().item()


def test_test_command_against_a_reference(converted, tmp_path, capsys):
    """``tui-merger test --backend megatron`` (verl's model_merger test): a reference model made from
    the converted weights matches; one that differs in one tensor is reported."""
    name = "qwen2_tp2pp2"
    _case(name)
    ref_dir = tmp_path / "reference"
    shutil.copytree(converted[name][0], ref_dir)
    args = ["test", "--backend", "megatron", "--local_dir", str(FIXTURES / name), "--test_hf_dir", str(ref_dir)]
    assert cli_main(args) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "matches" in said and "logits match" in said
    state = load_file(ref_dir / "model.safetensors")
    state["model.layers.1.self_attn.k_proj.weight"] = state["model.layers.1.self_attn.v_proj.weight"].clone()
    save_file(state, ref_dir / "model.safetensors", metadata={"format": "pt"})
    assert cli_main(args) == 1
    err = capsys.readouterr().err
    assert "model.layers.1.self_attn.k_proj.weight" in err and "1 difference" in err


def test_inspect_and_the_assistant_offer_megatron_checkpoints():
    from tui_merger.core.plan.choices import needs_base, options_for, why_not_mergeable
    from tui_merger.core.formats.scan import scan

    _case("qwen2_tp2")
    found = [c for c in scan(FIXTURES).candidates if c.kind == "verl-megatron"]
    assert found
    for c in found:
        assert why_not_mergeable(c) is None and not needs_base(c)
        assert not any("cannot merge" in n for n in c.notes)
        options = options_for(c, out=Path("/tmp/unused"))
        assert options.checkpoint == Path(c.path) and options.base is None
