"""verl Megatron LoRA runs merged straight from their adapter shards (adapter_checkpoint/mp_rank_*_adapter.pt).

The runs under fixtures/megatron_lora/ were written by Megatron-Bridge's real LoRA / CanonicalLoRA / DoRA
code on megatron-core's local spec (generate.py there: TP1, TP2, PP2, EP2 with the router, VPP), laid out
as verl saves them; beside each is Megatron-Bridge's own Hugging Face adapter export of the same weights
(``AutoBridge.save_hf_adapter`` run in the training layout), ``expected_hf_peft/``. The references:

- the merge equals peft's ``merge_and_unload`` of that export into the same base, every tensor bit for bit
  (for DoRA the export plus the trained magnitudes, placed by Megatron-Bridge's own export, which otherwise
  leaves them out);
- ``--export-adapter`` writes that export's tensors, name for name and bit for bit.

The base is a random transformers model of the run's config (what the run started from is irrelevant to the
arithmetic; its shapes are not).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output, refused_by_cli, save_base, verification_checks

from tui_merger.cli import main as cli_main

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_lora"
ALPHA = "16"  # what generate.py trained with (the shards do not record it)
MERGED = ["lora_tp1", "lora_tp2", "lora_pp2", "canonical_tp2", "dora_tp2"]
MOE = ["moe_router", "moe_ep2_router", "moe_tp2_ep2_router"]
# Measured: Megatron-Bridge 0.6.2's save_hf_adapter, run at EP2 on SequentialMLP experts, writes only expert-
# parallel rank 0's experts (0 and 1 of 4); rank 1's (2 and 3) are checked against its shard instead
# TP2 x EP2 with expert tensor parallelism 1 (experts whole on every TP rank): a rank's TP and EP numbers
# move together, so verl writes only mp_rank_00_000 and mp_rank_01_001; EP rank 1's experts are in the latter
NOT_EXPORTED = {"moe_ep2_router": {2: "mp_rank_00_001_adapter.pt", 3: "mp_rank_00_001_adapter.pt"},
                "moe_tp2_ep2_router": {2: "mp_rank_01_001_adapter.pt", 3: "mp_rank_01_001_adapter.pt"}}


def _actor(case: str) -> Path:
    return FIXTURES / case / "global_step_1" / "actor"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One fp32 base per run config, made once."""
    made = {}

    def get(case: str) -> Path:
        from transformers import AutoConfig

        if case not in made:
            config = AutoConfig.from_pretrained(_actor(case) / "huggingface")
            made[case] = save_base(tmp_path_factory.mktemp(f"base-{case}"), config)
        return made[case]

    return get


def _merge(case_or_run, out: Path, *extra) -> int:
    run = FIXTURES / case_or_run if isinstance(case_or_run, str) else case_or_run
    return cli_main(["merge", "--backend", "megatron", "--local_dir", str(run), "--target_dir", str(out), "--plain",
                     *extra])


def _reference_adapter(case: str, tmp: Path) -> Path:
    """Megatron-Bridge's export; for DoRA with the magnitudes its second export placed."""
    from safetensors.torch import load_file, save_file

    export = FIXTURES / case / "expected_hf_peft"
    magnitudes = FIXTURES / case / "expected_magnitudes.safetensors"
    if not magnitudes.is_file():
        return export
    folder = tmp / f"reference-{case}"
    shutil.copytree(export, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors.update(load_file(magnitudes))
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def _peft_merged(base: Path, adapter: Path, tmp: Path) -> dict:
    """peft's merge_and_unload, saved by transformers (the names on disk: MoE experts one by one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    model.merge_and_unload().save_pretrained(tmp / "peft-merged")
    return read_output(tmp / "peft-merged")


@pytest.mark.parametrize("case", MERGED)
def test_the_shards_merge_as_peft_merges_megatron_bridges_export(tmp_path, bases, case, capsys):
    base = bases(case)
    out = tmp_path / "merged"
    assert _merge(case, out, "--base", str(base), "--lora-alpha", ALPHA) == 0
    said = capsys.readouterr()
    # DoRA at TP2: linear_proj / linear_fc2 magnitudes differ per TP rank in the shards; rank 0's is the one
    assert ("TP rank 0's are merged" in said.out + said.err) == (case == "dora_tp2")
    want = _peft_merged(base, _reference_adapter(case, tmp_path), tmp_path)
    ours = read_output(out)
    assert set(ours) == set(want)
    changed = [k for k in ours if not torch.equal(ours[k], read_output(base)[k])]
    assert changed, "the adapter changed nothing"
    unequal = [k for k in ours if not torch.equal(ours[k], want[k])]
    assert not unequal, unequal
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def _expert_pairs(case: str) -> dict:
    """{HF module: (lora_A, lora_B)} of every expert: Megatron-Bridge's export, and for the experts it
    left out, the pair as the expert-parallel rank's shard holds it (local expert e of rank 1 is
    expert 2 + e; fc1's linear_out is [gate; up])."""
    import re

    from safetensors.torch import load_file

    export = load_file(FIXTURES / case / "expected_hf_peft" / "adapter_model.safetensors")
    pairs = {}
    for key in export:
        m = re.match(r"^base_model\.model\.(.+\.mlp\.experts\.\d+\.\w+_proj)\.lora_A\.weight$", key)
        if m:
            pairs[m.group(1)] = (export[key], export[key.replace("lora_A", "lora_B")])
    for expert, shard in NOT_EXPORTED.get(case, {}).items():
        assert not any(f"experts.{expert}." in k for k in export), "Megatron-Bridge's export now has them: use it"
        state = torch.load(_actor(case) / "adapter_checkpoint" / shard)["adapter_state_dict"]
        local = expert - 2
        for layer in range(2):
            pre = f"decoder.layers.{layer}.mlp.experts.local_experts.{local}."
            a1, b1 = state[pre + "linear_fc1.adapter.linear_in.weight"], state[pre + "linear_fc1.adapter.linear_out.weight"]
            a2, b2 = state[pre + "linear_fc2.adapter.linear_in.weight"], state[pre + "linear_fc2.adapter.linear_out.weight"]
            hf = f"model.layers.{layer}.mlp.experts.{expert}."
            half = b1.shape[0] // 2
            pairs[hf + "gate_proj"], pairs[hf + "up_proj"] = (a1, b1[:half]), (a1, b1[half:])
            pairs[hf + "down_proj"] = (a2, b2)
    return pairs


@pytest.mark.parametrize("case", MOE)
def test_moe_shards_with_router_lora_merge_as_megatron_bridge_exports_them(tmp_path, bases, case):
    """Qwen3-MoE, LoRA on attention, the router and every expert. Attention and the router are peft's
    merge of the export without its expert pairs, and each expert is W + alpha/r * B @ A of its pair,
    computed here as peft does (Megatron-Bridge's export leaves EP rank 1's experts out)."""
    from safetensors.torch import load_file, save_file

    base = bases(case)
    out = tmp_path / "merged"
    assert _merge(case, out, "--base", str(base), "--lora-alpha", ALPHA) == 0
    reference = tmp_path / "no-experts"
    shutil.copytree(FIXTURES / case / "expected_hf_peft", reference)
    tensors = load_file(reference / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".experts." not in k}, reference / "adapter_model.safetensors")
    config = json.loads((reference / "adapter_config.json").read_text())
    config["target_modules"] = [t for t in config["target_modules"] if t not in ("gate_proj", "up_proj", "down_proj")]
    (reference / "adapter_config.json").write_text(json.dumps(config))
    want = _peft_merged(base, reference, tmp_path)  # the experts come back unchanged: replaced below
    plain = read_output(base)
    pairs = _expert_pairs(case)
    assert len(pairs) == 2 * 4 * 3
    for module, (a, b) in pairs.items():
        want[f"{module}.weight"] = plain[f"{module}.weight"] + (b.float() @ a.float()) * (16 / 8)
    ours = read_output(out)
    assert set(ours) == set(want)
    assert any("mlp.gate.weight" in k and not torch.equal(ours[k], plain[k]) for k in ours)
    unequal = [k for k in ours if not torch.equal(ours[k], want[k])]
    assert not unequal, unequal
    # the behaviour check runs: its reference is peft's own load of the per-expert pairs onto the packed
    # experts (peft converts them: target_parameters, gate and up fused at 2r)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


@pytest.mark.parametrize("case", ["moe_router", "moe_ep2_router"])
def test_a_merge_missing_one_experts_lora_fails_the_behaviour_check(tmp_path, bases, case):
    """The merged model with one expert's LoRA left out (expert 2 of layer 1: at EP2 the expert-parallel
    rank Megatron-Bridge's own export leaves out) answers unlike the reference: the behaviour check
    fails, as the recompute does."""
    from safetensors.torch import load_file, save_file

    from tui_merger.core.verify.checks import verify_merge

    base = bases(case)
    out = tmp_path / "merged"
    assert _merge(case, out, "--base", str(base), "--lora-alpha", ALPHA) == 0
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    tensors, plain = load_file(bad / "model.safetensors"), read_output(base)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.2.{proj}.weight"
        assert not torch.equal(tensors[name], plain[name])
        tensors[name] = plain[name]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    report = verify_merge(bad)
    assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "fail", "behaviour": "fail"}
    assert "layer 1's output differs" in report.checks[2].details[0]


@pytest.mark.parametrize("case", MERGED + MOE)
def test_export_adapter_equals_megatron_bridges_export(tmp_path, bases, case):
    from safetensors.torch import load_file

    base = bases(case)
    out = tmp_path / "exported"
    assert _merge(case, out, "--base", str(base), "--lora-alpha", ALPHA, "--export-adapter") == 0
    ours = load_file(out / "lora_adapter" / "adapter_model.safetensors")
    want = load_file(FIXTURES / case / "expected_hf_peft" / "adapter_model.safetensors")
    magnitudes = FIXTURES / case / "expected_magnitudes.safetensors"
    if magnitudes.is_file():
        want.update(load_file(magnitudes))
    extra = {k for k in ours if any(f"experts.{e}." in k for e in NOT_EXPORTED.get(case, {}))}
    assert sorted(set(ours) - extra) == sorted(want)
    assert len(extra) == 2 * len(NOT_EXPORTED.get(case, {})) * 3 * 2  # layers x experts x projections x A/B
    for name, tensor in want.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    said = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    theirs = json.loads((FIXTURES / case / "expected_hf_peft" / "adapter_config.json").read_text())
    for key in ("peft_type", "r", "lora_alpha", "use_dora", "use_rslora", "rank_pattern"):
        assert said[key] == theirs[key], key
    assert sorted(said["target_modules"]) == sorted(theirs["target_modules"])
    assert read_output(out).keys() == read_output(base).keys()
    # verified with the exported adapter through peft, per-expert pairs too (peft converts them)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_a_run_with_virtual_pipeline_stages_says_what_verl_left_out(tmp_path, bases, capsys):
    base = bases("lora_tp1")
    args = ["merge", "--backend", "megatron", "--local_dir", str(FIXTURES / "lora_pp2_vpp2"), "--base", str(base),
            "--lora-alpha", ALPHA, "--target_dir", str(tmp_path / "merged"), "--plain"]
    refused_by_cli(capsys, tmp_path, args, ["2 virtual pipeline stages", "only the first model chunk",
                                            "Hugging Face adapter export"])


def test_inspect_describes_the_shards(tmp_path):
    from tui_merger.core.formats.registry import format_of
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import needs_base, why_not_mergeable

    seen = {}
    for case in ("lora_tp2", "lora_pp2", "canonical_tp2", "dora_tp2", "moe_ep2_router", "lora_pp2_vpp2"):
        (c,) = [c for c in scan(FIXTURES / case).candidates if c.kind == "verl-megatron"]
        seen[case] = c
        assert c.lora["r"] == 8 and c.lora["alpha"] is None and needs_base(c)
        assert any("--lora-alpha" in n for n in c.notes)
    assert any("Megatron LoRA run (TP 2)" in n for n in seen["lora_tp2"].notes)
    assert any("(TP 1, PP 2)" in n for n in seen["lora_pp2"].notes)
    assert any("Megatron CanonicalLoRA run (TP 2)" in n for n in seen["canonical_tp2"].notes)
    assert seen["canonical_tp2"].lora["target_modules"] == sorted(
        ["linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"])
    assert seen["dora_tp2"].lora["dora"] and any("Megatron DoRA run" in n for n in seen["dora_tp2"].notes)
    moe = seen["moe_ep2_router"]
    assert any("(TP 1, EP 2)" in n for n in moe.notes) and {"router", "experts"} <= set(moe.lora["target_modules"])
    assert seen["lora_pp2"].lora["target_modules"] == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    for case in ("lora_tp2", "moe_ep2_router"):
        c = seen[case]
        assert why_not_mergeable(c) is None
        step = format_of(c).next_step(c, str(FIXTURES / case), "BASE", "out")
        assert step.startswith("tui-merger merge --backend megatron") and "--lora-alpha ALPHA" in step
    vpp = seen["lora_pp2_vpp2"]
    assert "virtual pipeline stages" in (why_not_mergeable(vpp) or "")
    assert format_of(vpp).next_step(vpp, str(FIXTURES / "lora_pp2_vpp2"), "BASE", "out") == why_not_mergeable(vpp)


# -- bad input: one sentence, nothing written ------------------------------------------------------------


def _copy(case: str, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / case, run)
    return run


def _refused(capsys, tmp_path, run, base, needles, *extra):
    args = ["merge", "--backend", "megatron", "--local_dir", str(run), "--base", str(base), *extra,
            "--target_dir", str(tmp_path / "merged"), "--plain"]
    line = refused_by_cli(capsys, tmp_path, args, needles)
    assert line.count(". ") == 0, line  # one sentence
    return line


def test_a_missing_rank_file_is_named(tmp_path, bases, capsys):
    run = _copy("lora_tp2", tmp_path)
    (run / "global_step_1/actor/adapter_checkpoint/mp_rank_01_adapter.pt").unlink()
    # transformer_config.json says TP 2: the file missing is named
    _refused(capsys, tmp_path, run, bases("lora_tp2"), ["mp_rank_01_adapter.pt is missing", "copy the whole"],
             "--lora-alpha", ALPHA)


def test_a_missing_stage_file_is_named(tmp_path, bases, capsys):
    run = _copy("lora_pp2", tmp_path)
    (run / "global_step_1/actor/adapter_checkpoint/mp_rank_00_001_adapter.pt").unlink()
    _refused(capsys, tmp_path, run, bases("lora_pp2"), ["mp_rank_00_001_adapter.pt is missing", "1 tensor x 2 pipeline"],
             "--lora-alpha", ALPHA)


def test_a_missing_file_of_a_tp_and_ep_run_is_named(tmp_path, bases, capsys):
    """TP2 x EP2 with experts whole on every TP rank: verl writes mp_rank_00_000 and mp_rank_01_001 only
    (a rank's TP and EP numbers move together); without the second, EP rank 1 (and TP rank 1) is missing."""
    run = _copy("moe_tp2_ep2_router", tmp_path)
    (run / "global_step_1/actor/adapter_checkpoint/mp_rank_01_001_adapter.pt").unlink()
    _refused(capsys, tmp_path, run, bases("moe_tp2_ep2_router"),
             ["No mp_rank_*_001_adapter.pt file", "expert-parallel rank 1", "2 tensor x 2 expert"], "--lora-alpha", ALPHA)


def test_mixed_tensor_parallel_sizes_are_named(tmp_path, bases, capsys):
    run = _copy("lora_tp2", tmp_path)
    shards = run / "global_step_1/actor/adapter_checkpoint"
    shutil.copy(_actor("lora_tp1") / "adapter_checkpoint/mp_rank_00_adapter.pt", shards / "mp_rank_01_adapter.pt")
    _refused(capsys, tmp_path, run, bases("lora_tp2"), ["different tensor-parallel sizes", "keep the files of one run"],
             "--lora-alpha", ALPHA)


def test_files_of_more_ranks_than_the_run_had_are_named(tmp_path, bases, capsys):
    run = _copy("lora_tp1", tmp_path)
    shards = run / "global_step_1/actor/adapter_checkpoint"
    shutil.copy(_actor("lora_tp2") / "adapter_checkpoint/mp_rank_01_adapter.pt", shards / "mp_rank_01_adapter.pt")
    _refused(capsys, tmp_path, run, bases("lora_tp1"), ["2 ranks of tensor parallelism", "tensor_model_parallel_size 1"],
             "--lora-alpha", ALPHA)


def test_a_base_of_another_shape_is_named(tmp_path, capsys):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_actor("lora_tp1") / "huggingface")
    config.intermediate_size = 96
    other = save_base(tmp_path / "other-base", config)
    _refused(capsys, tmp_path, FIXTURES / "lora_tp1", other, ["intermediate_size 128", "has 96", "--base"],
             "--lora-alpha", ALPHA)


def test_a_truncated_shard_is_named(tmp_path, bases, capsys):
    run = _copy("lora_tp2", tmp_path)
    shard = run / "global_step_1/actor/adapter_checkpoint/mp_rank_01_adapter.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    _refused(capsys, tmp_path, run, bases("lora_tp2"), ["mp_rank_01_adapter.pt", "truncated"], "--lora-alpha", ALPHA)


def test_lora_alpha_is_asked_for(tmp_path, bases, capsys):
    _refused(capsys, tmp_path, FIXTURES / "lora_tp1", bases("lora_tp1"), ["do not record lora_alpha", "--lora-alpha"])


def test_a_pickle_that_runs_code_is_refused(tmp_path, bases, capsys):
    from factory import Evil

    run = _copy("lora_tp1", tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"adapter_state_dict": {"x": Evil(marker)}}, run / "global_step_1/actor/adapter_checkpoint/mp_rank_00_adapter.pt")
    _refused(capsys, tmp_path, run, bases("lora_tp1"), ["mp_rank_00_adapter.pt"], "--lora-alpha", ALPHA)
    assert not marker.exists()


def test_grouped_gemm_expert_adapters_are_named_not_guessed(tmp_path, bases, capsys):
    """Transformer Engine's grouped experts keep one adapter per expert-parallel rank under
    mlp.experts.linear_fc{1,2}.adapter (3-D without shared adapters). Megatron-Bridge cannot build them
    without CUDA, so this run is the real MoE shard with its experts renamed that way."""
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import why_not_mergeable

    run = _copy("moe_router", tmp_path)
    path = run / "global_step_1/actor/adapter_checkpoint/mp_rank_00_adapter.pt"
    state = torch.load(path)["adapter_state_dict"]
    grouped = {}
    for key, t in state.items():
        if ".local_experts." not in key:
            grouped[key] = t
            continue
        pre, rest = key.split(".mlp.experts.local_experts.")
        expert, rest = rest.split(".", 1)
        grouped.setdefault(f"{pre}.mlp.experts.{rest}", []).append(t)
    grouped = {k: torch.stack(v) if isinstance(v, list) else v for k, v in grouped.items()}
    torch.save({"adapter_state_dict": grouped}, path)
    line = _refused(capsys, tmp_path, run, bases("moe_router"), ["grouped-GEMM experts", "Transformer Engine",
                                                                 "Hugging Face adapter export"], "--lora-alpha", ALPHA)
    (c,) = [c for c in scan(run).candidates if c.kind == "verl-megatron"]
    assert "grouped-GEMM experts" in (why_not_mergeable(c) or "") and "grouped-GEMM" in line


def test_a_run_whose_dist_checkpoint_holds_the_model_merges_into_its_own_weights(tmp_path):
    """verl with use_dist_checkpointing=True: dist_ckpt/ holds the whole model (base and adapters, TP2).
    Without --base the shards merge into the base weights the checkpoint holds, and the result equals
    Megatron-Bridge's own merge of the same model (export_hf_weights with merge_adapter_weights, its
    lora_merge in bf16) bit for bit, and peft's fp32 merge of its adapter export into its base export,
    rounded to bf16."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fixture = FIXTURES / "lora_tp2_dist"
    out = tmp_path / "merged"
    assert _merge("lora_tp2_dist", out, "--lora-alpha", ALPHA) == 0
    ours = read_output(out)
    theirs = load_file(fixture / "expected_merged.safetensors")
    base = load_file(fixture / "expected_base" / "model.safetensors")
    assert set(ours) == set(theirs) and any(not torch.equal(theirs[k], base[k]) for k in theirs)
    unequal = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not unequal, unequal
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fixture / "expected_base", dtype=torch.float32),
                                      fixture / "expected_hf_peft")
    peft_merged = {k: v.to(torch.bfloat16) for k, v in model.merge_and_unload().state_dict().items()}
    assert all(torch.equal(ours[k], peft_merged[k]) for k in ours)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    manifest = json.loads((out / "merge_manifest.json").read_text())
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import needs_base

    (c,) = [c for c in scan(fixture).candidates if c.kind == "verl-megatron"]
    assert not needs_base(c) and any("holds the run's base weights" in n for n in c.notes)
    hashed = {f["path"] for i in manifest["inputs"] for f in i["files"]}
    assert {"global_step_1/actor/dist_ckpt/.metadata", "global_step_1/actor/adapter_checkpoint/mp_rank_01_adapter.pt"} <= hashed


def test_a_bf16_dora_peft_adapter_is_verified_in_fp32(tmp_path, bases):
    """The behaviour check runs a 16-bit DoRA adapter's layers in fp32, as peft does when it loads the
    adapter itself (it ran them in bf16: 1.9e-3 apart, a false failure). The adapter: Megatron-Bridge's
    bf16 export of the DoRA run with its magnitudes, merged as a plain PEFT adapter."""
    base = bases("dora_tp2")
    adapter = _reference_adapter("dora_tp2", tmp_path)
    out = tmp_path / "merged"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    want = _peft_merged(base, adapter, tmp_path)
    assert all(torch.equal(t, want[k]) for k, t in read_output(out).items())


def test_bases_that_fit_the_shards_are_proposed(tmp_path, bases):
    """The assistant proposes the models here whose weights the shards' LoRA pairs fit (the run names no
    base): the run's own shape, not a model of another FFN size."""
    from transformers import AutoConfig

    from tui_merger.core.plan.choices import base_candidates

    fits = bases("lora_tp2")
    config = AutoConfig.from_pretrained(_actor("lora_tp2") / "huggingface")
    config.intermediate_size = 96
    other = save_base(tmp_path / "other", config)
    proposed = base_candidates(_actor("lora_tp2"), [other, fits], cache=False)
    assert [p for p, _ in proposed] == [fits]
    assert "fits all 14 LoRA modules" in proposed[0][1]
    moe = base_candidates(_actor("moe_ep2_router"), [fits, bases("moe_router")], cache=False)
    assert [p for p, _ in moe] == [bases("moe_router")]
