"""MoE experts in transformers 5: Qwen3-MoE holds its experts packed (``mlp.experts.gate_up_proj``
[experts, 2 x intermediate, hidden], ``down_proj`` [experts, hidden, intermediate]) and writes one tensor
per expert. A peft LoRA on those parameters (``target_parameters``, rank r per expert) merges exactly as
peft's ``merge_and_unload`` computes it, into the tensors ``save_pretrained`` writes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from factory import read_output, verification_checks

from tui_merger.cli import main

MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=320, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=32)


def save_moe(root, dtype, target_parameters, r=4):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE)).to(dtype).save_pretrained(root / "base")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    torch.manual_seed(1)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj"], target_parameters=target_parameters,
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def peft_merged(base, adapter, out, dtype) -> dict:
    from peft import PeftModel

    model = transformers.Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().to(dtype).save_pretrained(out)
    return read_output(out)


@pytest.mark.parametrize("targets", [
    ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"],  # the other nesting order
    ["mlp.experts.gate_up_proj"],
], ids=["gate_up+down", "down+gate_up", "gate_up"])
def test_target_parameters_lora_on_experts_merges_like_peft(targets, tmp_path, capsys):
    base, adapter = save_moe(tmp_path, torch.float32, targets)
    expected = peft_merged(base, adapter, tmp_path / "reference", torch.float32)
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got = read_output(out)
    assert sorted(got) == sorted(expected)
    base_tensors = read_output(base)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base_tensors[n])}
    kinds = {n.rsplit(".", 2)[-2] for n in changed if ".experts." in n}
    assert kinds == ({"gate_proj", "up_proj", "down_proj"} if len(targets) == 2 else {"gate_proj", "up_proj"})
    assert len([n for n in changed if ".experts." in n]) == 2 * 4 * len(kinds)  # every expert of both layers
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, checks


def test_dry_run_reports_expert_lora_and_no_rank_mismatch(tmp_path, capsys):
    base, adapter = save_moe(tmp_path, torch.bfloat16, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dry-run"])
    plan = capsys.readouterr().out
    assert code == 0, plan
    assert "saved tensors have rank" not in plan
    assert ("peft target_parameters: LoRA on 4 expert parameter(s) (mlp.experts.gate_up_proj r=4, "
            "mlp.experts.down_proj r=4; rank per expert) is merged into 24 per-expert tensors.") in plan
    # the LoRA line counts the q_proj modules, not the experts' slices, and names the parameters
    lora = next(line for line in plan.splitlines() if line.strip().startswith("LoRA "))
    assert "r=4 alpha=8 lora, 2 modules (q_proj) + " in lora, lora  # q_proj in both layers (the 24 expert slices are not modules)
    assert ("+ LoRA on 4 expert parameter(s) (mlp.experts.gate_up_proj r=4 alpha=8, mlp.experts.down_proj r=4 alpha=8; "
            "rank per expert)") in lora


def test_bf16_experts_round_like_peft(tmp_path, capsys):
    base, adapter = save_moe(tmp_path, torch.bfloat16, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    expected = peft_merged(base, adapter, tmp_path / "reference", torch.bfloat16)
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    capsys.readouterr()
    got = read_output(out)
    for name, ref in expected.items():
        assert got[name].dtype == torch.bfloat16, name
        # both compute W + s*B@A in fp32 and round once: equal, or one bf16 step apart where the sum ties
        torch.testing.assert_close(got[name].float(), ref.float(), rtol=2 ** -7, atol=1e-6, msg=name)


VL_MOE_EXPERTS = "model.language_model.layers.{}.mlp.experts.{}"


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory):
    """A Qwen3-VL-MoE base (experts packed on disk too) and a peft adapter on q_proj and on the packed
    experts (target_parameters)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("vl_moe")
    text = dict(MOE, rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True})
    text.pop("num_experts_per_tok")
    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(text, num_experts_per_tok=2, decoder_sparse_step=1),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[1]),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
    cls = transformers.Qwen3VLMoeForConditionalGeneration
    torch.manual_seed(0)
    cls(config).save_pretrained(root / "base")
    torch.manual_seed(1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(cls.from_pretrained(root / "base", dtype=torch.float32), lora).save_pretrained(root / "adapter")
    return cls, root / "base", root / "adapter"


def test_a_vl_moe_with_experts_packed_on_disk_merges_like_peft(vl_moe, tmp_path, capsys):
    """Qwen3-VL-MoE keeps its experts packed in its checkpoints too: the LoRA goes into the packed
    tensor, as peft's own merge computes it, and the behaviour check runs peft's parameter LoRA
    (ParamWrapper over the experts) layer by layer as the unmerged reference."""
    from peft import PeftModel

    cls, base_dir, adapter = vl_moe
    reference = PeftModel.from_pretrained(cls.from_pretrained(base_dir, dtype=torch.float32), adapter)
    reference.merge_and_unload().save_pretrained(tmp_path / "peft")
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected, base = read_output(out), read_output(tmp_path / "peft"), read_output(base_dir)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    for layer in (0, 1):
        for param in ("gate_up_proj", "down_proj"):
            name = VL_MOE_EXPERTS.format(layer, param)
            assert not torch.equal(got[name], base[name]), name
    checks = verification_checks(out)
    assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out + said.err


def test_a_vl_moe_expert_delta_with_its_sign_flipped_is_caught(vl_moe, tmp_path, capsys):
    """The planted fault: in the merged file every packed expert tensor holds W - delta instead of
    W + delta, everything else right. Only the unmerged reference's experts (peft's ParamWrapper) can
    tell: the behaviour check fails and names the first layer, where the experts first act."""
    from safetensors.torch import load_file, save_file

    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify.checks import verify_merge

    cls, base_dir, adapter = vl_moe
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    capsys.readouterr()
    base = read_output(base_dir)
    path = out / "model.safetensors"
    tensors = load_file(path)
    flipped = [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert len(flipped) == 4
    for name in flipped:
        tensors[name] = (2 * base[name].float() - tensors[name].float()).to(tensors[name].dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    report = verify_merge(out, MergeOptions(base=base_dir, adapter=adapter, out=out))
    statuses = {c.name: c.status for c in report.checks}
    behaviour = next(c for c in report.checks if c.name == "behaviour")
    assert statuses == {"structure": "pass", "recompute": "fail", "behaviour": "fail"}, behaviour
    assert "layer 0's output differs" in behaviour.details[0], behaviour.details


def test_expert_lora_runs_layer_by_layer_while_another_thread_builds_a_model(tmp_path):
    """Verification builds the merged model on the meta device in one thread while the unmerged
    reference runs in another. accelerate's init_empty_weights patches nn.Module.register_parameter
    for every thread meanwhile, and peft's ParamWrapper registers a parametrization (a parameter) on
    the experts each forward: unguarded, the experts' weight lands on the meta device ("unsupported
    scalarType") in every pass. The reference must give the same logits with the builds going on."""
    import threading

    from tui_merger.core.formats.hf_names import meta_model
    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour as bh

    base_dir, adapter = save_moe(tmp_path, torch.float32, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    config = transformers.AutoConfig.from_pretrained(base_dir)
    cls = transformers.Qwen3MoeForCausalLM
    base = open_model(base_dir)
    probes = torch.tensor([[1, 2, 3, 4, 5, 6]])
    try:
        streamer, missing = bh.streamer_with_adapter(cls, config, base.tensors, [(str(adapter), None)], "reference")
        assert missing == []
        alone, _ = bh.run(streamer, probes)
        stop = threading.Event()

        def build():
            while not stop.is_set():
                meta_model(cls, config)

        builder = threading.Thread(target=build, daemon=True)
        builder.start()
        try:
            during = [bh.run(streamer, probes)[0] for _ in range(10)]
        finally:
            stop.set()
            builder.join()
        assert all(torch.equal(logits, alone) for logits in during)
        streamer.close()
    finally:
        base.close()


def test_inspect_shows_the_expert_parameters(tmp_path, capsys):
    save_moe(tmp_path, torch.bfloat16, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert main(["inspect", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert ("parameters mlp.experts.down_proj, mlp.experts.gate_up_proj (peft target_parameters: LoRA on packed "
            "experts, rank r per expert, and on routers)") in shown
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    adapter = next(c for c in found["candidates"] if c["kind"] == "peft-adapter")
    assert adapter["lora"]["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_assistant_shows_and_merges_expert_lora(tmp_path, monkeypatch):
    from test_tui import recheck, text, to_review, until
    from textual.widgets import Checkbox, Input

    from tui_merger.tui.app import MergeApp

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "run").mkdir()
    save_moe(tmp_path / "run", torch.bfloat16, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    app = MergeApp(tmp_path / "run")
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.wizard.candidate is not None, "a candidate")
        assert "LoRA on experts (mlp.experts.down_proj, mlp.experts.gate_up_proj)" in text(app, "#path-status")
        wizard = await to_review(pilot, app)
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        findings = text(app, "#findings")
        assert "expert parameter(s) (mlp.experts.gate_up_proj r=4, mlp.experts.down_proj r=4; rank per expert) is merged into 24 per-expert tensors" in findings
        assert "saved tensors have rank" not in findings
        app.screen.query_one("#ack", Checkbox).value = True  # the tiny model has no tokenizer: a warning
        await pilot.pause()
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=1200)
        assert "PASSED" in text(app, "#verify-status")
