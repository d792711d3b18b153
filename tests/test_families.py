"""Qwen3.5 and Qwen3.5-MoE (linear-attention and full-attention layers; experts with a shared one) and GPT-OSS (experts kept packed and stored
[experts, in, out], attention sinks): a peft LoRA merges into what ``save_pretrained`` of peft's
``merge_and_unload`` writes, and verification runs each model class; in the assistant too (Qwen3.5, GPT-OSS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from factory import read_output, verification_checks
from safetensors.torch import load_file

from tui_merger.cli import main


def qwen3_5():
    return transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=320, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, full_attention_interval=2)


def qwen3_5_moe():
    return transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)


def gpt_oss():
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=320, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"])


CASES = {
    "qwen3_5-all-linear": (qwen3_5, dict(target_modules="all-linear")),
    "qwen3_5_moe-all-linear+experts": (qwen3_5_moe, dict(target_modules="all-linear", target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
    "gpt_oss-attention+experts": (gpt_oss, dict(target_modules=["q_proj", "v_proj"],
                                                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


def save_case(case: str, models: Path, reference: Path) -> tuple[Path, Path]:
    """The tiny base (models/base), a peft LoRA on it (models/adapter), and peft's own answer: its
    ``merge_and_unload`` written by ``save_pretrained`` into ``reference``."""
    from peft import LoraConfig, PeftModel, get_peft_model

    build, lora = CASES[case]
    cls, config = build()
    torch.manual_seed(0)
    cls(config).save_pretrained(models / "base")
    model = cls.from_pretrained(models / "base", dtype=torch.float32)
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora)).save_pretrained(models / "adapter")
    peft_model = cls.from_pretrained(models / "base", dtype=torch.float32)
    PeftModel.from_pretrained(peft_model, models / "adapter").merge_and_unload().save_pretrained(reference)
    return models / "base", models / "adapter"


def assert_merged_like_peft(case: str, out: Path, reference: Path, base_dir: Path) -> None:
    """The merged folder holds what peft's merge saved (names, dtypes, shapes, values), the LoRA reached
    each part of the family, and the verification recorded passed every check."""
    got, expected, base = read_output(out), read_output(reference), read_output(base_dir)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base[n])}
    if case.startswith("gpt_oss"):
        assert {n for n in changed if ".experts." in n} == {
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    else:
        assert any(".linear_attn." in n for n in changed) and any(".self_attn." in n for n in changed)
    if "moe" in case:
        assert any(".mlp.experts.3.down_proj.weight" in n for n in changed)  # each expert, on disk one by one
        assert any(".shared_expert." in n for n in changed)
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, checks


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_merges_like_peft(case, tmp_path, capsys):
    base_dir, adapter = save_case(case, tmp_path, tmp_path / "peft")
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert_merged_like_peft(case, out, tmp_path / "peft", base_dir)


@pytest.fixture
def anyio_backend():
    return "asyncio"


ASSISTANT_CASES = {"qwen3_5": "qwen3_5-all-linear", "gpt_oss": "gpt_oss-attention+experts"}


@pytest.mark.anyio
@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
async def test_the_assistant_merges_and_verifies_the_family(family, tmp_path, monkeypatch):
    """The assistant on a folder holding the tiny base and its adapter: Find picks the adapter, Review
    says what the LoRA touches (Qwen3.5: the linear-attention projections among its targets; GPT-OSS:
    the packed experts, merged packed), the merge verifies, and the files are peft's own merge."""
    from test_tui import recheck, text, to_review, until
    from textual.widgets import Checkbox, DataTable, Input

    from tui_merger.tui.app import MergeApp

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    case = ASSISTANT_CASES[family]
    base_dir, adapter = save_case(case, tmp_path / "run", tmp_path / "peft")
    saved = json.loads((adapter / "adapter_config.json").read_text())
    targets = sorted(saved["target_modules"])  # peft writes all-linear as the module names it chose
    lora_modules = {k.split(".lora_A")[0] for k in load_file(adapter / "adapter_model.safetensors") if ".lora_A" in k}
    base_tensors = read_output(base_dir)
    changed = [n for n, t in read_output(tmp_path / "peft").items() if not torch.equal(t, base_tensors[n])]
    out = tmp_path / "merged"
    app = MergeApp(tmp_path / "run")
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert wizard.candidate.kind == "peft-adapter" and Path(wizard.candidate.path).resolve() == adapter.resolve()
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        plan, findings = " ".join(text(app, "#plan-text").split()), text(app, "#findings")
        cls, config = CASES[case][0]()
        assert f"base cfg {cls.__name__}, {config.num_hidden_layers} layers, hidden {config.hidden_size}" in plan, plan
        if family == "qwen3_5":
            assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"} <= set(targets)
            assert len(lora_modules) == 2 * 8 + 2 * 7  # linear-attention layers 0, 2; full attention 1, 3
            assert f"r=4 alpha=8 lora, {len(lora_modules)} modules ({', '.join(targets)})" in plan, plan
        else:
            # q_proj and v_proj in each layer are the modules; the experts' parameters are said beside them
            assert targets == ["q_proj", "v_proj"]
            layers = CASES[case][0]()[1].num_hidden_layers
            assert (f"r=4 alpha=8 lora, {2 * layers} modules (q_proj, v_proj) + LoRA on {2 * layers} expert parameter(s) "
                    "(mlp.experts.gate_up_proj r=4 alpha=8, mlp.experts.down_proj r=4 alpha=8; rank per expert)") in plan, plan
            assert sorted(saved["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
            assert ("LoRA on 4 expert parameter(s) (mlp.experts.gate_up_proj r=4, mlp.experts.down_proj r=4; rank per "
                    "expert) is merged into 4 packed expert tensors") in findings
        assert "saved tensors have rank" not in findings
        assert wizard.plan.of("error") == [] and [f.id for f in wizard.plan.of("warning")] == ["tokenizer"], findings
        assert f"tensors ({len(changed)} merged)" in plan, plan  # the tensors peft's merge changes
        app.screen.query_one("#ack", Checkbox).value = True  # the tiny model has no tokenizer: a warning
        await pilot.pause()
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=1200)
        assert "PASSED" in text(app, "#verify-status"), text(app, "#verify-status")
        table = app.screen.query_one("#checks", DataTable)
        rows = [[str(cell) for cell in table.get_row_at(i)[:2]] for i in range(table.row_count)]
        assert rows == [["[b green]PASS[/]", name] for name in ("structure", "recompute", "behaviour")], rows
    assert json.loads((out / "merge_manifest.json").read_text())["verification"]["passed"] is True
    assert_merged_like_peft(case, out, tmp_path / "peft", base_dir)


# -- output heads under the names transformers gives them -------------------------------------------------


def deepseek_v4():
    """DeepSeek-V4 (transformers 5.25): native names on disk (``head.weight``, ``layers.N.attn.wq_a``,
    ``ffn.experts.E.w1``), hyper-connections, a sliding and a compressed-sparse attention layer, a hash-routed
    and a top-k routed MoE layer, the grouped output projection ``o_a_proj``."""
    return transformers.DeepseekV4ForCausalLM, transformers.DeepseekV4Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
        max_position_embeddings=128, num_hidden_layers=2, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, index_n_heads=2,
        index_head_dim=16, index_topk=4, hc_mult=2, qk_rope_head_dim=8, sliding_window=8)


# peft wraps o_a_proj (a Linear subclass whose forward multiplies groups) as a plain Linear, whose unmerged
# forward then fails: a person leaves it out, as here
CASES["deepseek_v4-attention+mlp"] = (deepseek_v4, dict(
    target_modules=["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"],
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
PROBE = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(7))


def _without(out: Path, name: str) -> None:
    """The merged folder with the tensor ``name`` taken out of its weight file (the index kept as it is)."""
    from safetensors.torch import save_file

    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        if name in tensors:
            del tensors[name]
            save_file(tensors, f, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} is not in {out}")


def _verify_problems(out: Path, capsys) -> tuple[int, str]:
    code = main(["verify", str(out), "--json"])
    said = capsys.readouterr().out
    report = json.loads(said[said.index("{"):])
    structure = next(c for c in report["checks"] if c["name"] == "structure")
    return code, structure["status"] + ": " + " | ".join(structure.get("details") or [])


def test_deepseek_v4_merges_like_peft_and_its_head_is_found_under_its_own_name(tmp_path, capsys):
    """DeepSeek-V4 writes its output head as ``head.weight``: the merge holds peft's tensors, gives the unmerged
    logits and verifies PASSED (it failed: "no lm_head.weight"); the head really missing fails, named as the
    files name it."""
    from peft import PeftModel

    case = "deepseek_v4-attention+mlp"
    base_dir, adapter = save_case(case, tmp_path, tmp_path / "peft")
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected, base = read_output(out), read_output(tmp_path / "peft"), read_output(base_dir)
    assert sorted(got) == sorted(expected) and "head.weight" in got and "lm_head.weight" not in got
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base[n])}
    assert any(".attn.wq_a." in n for n in changed) and any(".ffn.experts.3.w2." in n for n in changed)
    assert any(".ffn.shared_experts.w1." in n for n in changed)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
    cls, _ = deepseek_v4()
    unmerged = PeftModel.from_pretrained(cls.from_pretrained(base_dir, dtype=torch.float32), adapter).eval()
    merged = cls.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(PROBE).logits, unmerged(PROBE).logits, rtol=1e-5, atol=1e-5)

    _without(out, "head.weight")
    code, structure = _verify_problems(out, capsys)
    assert code == 4 and structure.startswith("fail"), structure
    assert "tie_word_embeddings is false but there is no head.weight: transformers would start the output head random" \
        in structure, structure


def test_a_tied_head_the_adapter_untied_fails_when_it_is_missing(tmp_path, capsys):
    """A tied Llama whose adapter changes the output head alone gets its own lm_head.weight and
    tie_word_embeddings false (verified PASSED); with that head taken out, verification fails naming it."""
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, vocab_size=320, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    assert "lm_head.weight" not in read_output(tmp_path / "base")
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["lm_head", "q_proj"])
                   ).save_pretrained(tmp_path / "adapter")
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"), "--out", str(out),
                 "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    assert "lm_head.weight" in read_output(out) and json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
    _without(out, "lm_head.weight")
    code, structure = _verify_problems(out, capsys)
    assert code == 4 and "tie_word_embeddings is false but there is no lm_head.weight" in structure, structure
