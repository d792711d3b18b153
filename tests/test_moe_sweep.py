"""Every MoE family of transformers 5 (and a few dense ones), with a LoRA made the way people make it:
peft's ``target_modules="all-linear"`` (which on most MoE families becomes attention Linears plus
``target_parameters`` on the packed experts and the router's ``gate.weight``, nested, with a rank
pattern on the fused gate_up), and with hand-picked ``target_parameters`` (the experts' parameters in
the other order, the router, per-parameter rank and alpha patterns). Through the command line:

- the merged folder holds what peft's ``merge_and_unload`` + ``save_pretrained`` write (names, shapes,
  values);
- loaded by transformers with the family's class, it gives the unmerged peft model's logits (fp32,
  relative 1e-5);
- its verification passed every check.

Each fixture (tiny fp32 base, adapter, peft's merge, the unmerged logits) is built once per session."""

from __future__ import annotations

import json

import pytest
import torch
from factory import read_output, verification_checks
from safetensors.torch import load_file
from moe_families import FAMILIES, build, forward, text_only

from tui_merger.cli import main

PROBE = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(7))
# peft cannot run these unmerged with all-linear: it wraps their router, an nn.Linear whose forward
# returns a tuple, as a LoRA Linear (its forward then fails); the hand-picked variant targets the rest
PEFT_CANNOT_RUN = {("phimoe", "all-linear"), ("llama4", "all-linear"), ("llama4_vl", "all-linear")}


def packed_parameters(model) -> tuple[str, list[str], str | None]:
    """(the first experts module, its 3-D parameters in module order, its layer's router module or
    None): what a person hand-picking target_parameters looks up in the model."""
    import torch.nn as nn

    for name, module in model.named_modules():
        params = [p for p, t in module.named_parameters(recurse=False) if t.dim() == 3]
        if params and name.endswith("experts"):
            parent = name.rsplit(".", 1)[0]
            router = None
            for child in ("gate", "router"):
                sub = getattr(model.get_submodule(parent), child, None)
                if sub is not None and not isinstance(sub, nn.Linear) and getattr(sub, "weight", None) is not None:
                    router = f"{parent}.{child}"
            return name, params, router
    return "", [], None


def lora_kwargs(model, variant: str, family: str = "") -> dict:
    if variant == "all-linear":
        return dict(r=4, lora_alpha=8, target_modules="all-linear")
    experts, params, router = packed_parameters(model)
    where = ".".join(experts.split(".")[-2:])  # "mlp.experts", "feed_forward.experts"
    targets = [f"{where}.{p}" for p in reversed(params)]  # the other order than the module's
    if router:
        targets.append(f"{'.'.join(router.split('.')[-2:])}.weight")
    last = params[-1]
    return dict(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=targets,
                rank_pattern={rf".*\.{last}": 6}, alpha_pattern={rf".*\.{last}": 3})


CASES = [(family, "all-linear") for family in FAMILIES] + [
    (family, "experts") for family, (_, kw) in FAMILIES.items()
    if any(k in {**kw, **kw.get("text_config", {})} for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                               "moe_num_experts"))]


def as_trained(peft_model, family: str) -> None:
    """A LoRA whose module the model's forward never calls (Jamba's mamba reads ``dt_proj.weight``
    itself, LongCat its router's ``classifier.weight``) gets no gradient in training and keeps peft's
    zero lora_B: so it is here too (the random init would give it a delta training never saw, which
    peft's merge applies and its unmerged forward does not)."""
    peft_model.train()
    forward(peft_model, family, PROBE).float().pow(2).mean().backward()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name and param.requires_grad and param.grad is None and "lora_B" in name:
                param.zero_()
    peft_model.zero_grad(set_to_none=True)
    peft_model.eval()


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """(family, variant) -> (base dir, adapter dir, peft's merged dir, unmerged logits or None)."""
    cache = {}

    def make(family: str, variant: str):
        if (family, variant) in cache:
            return cache[family, variant]
        from peft import LoraConfig, PeftModel, get_peft_model

        root = tmp_path_factory.mktemp(f"{family}-{variant}")
        cls, config = build(family)
        if not (root.parent / f"{family}-base").exists():
            torch.manual_seed(0)
            cls(config).save_pretrained(root.parent / f"{family}-base")
        base = root.parent / f"{family}-base"
        model = cls.from_pretrained(base, dtype=torch.float32)
        kwargs = lora_kwargs(model, variant, family)
        if variant == "experts" and not kwargs["target_parameters"]:
            pytest.skip(f"{family} keeps no packed experts in transformers 5")
        torch.manual_seed(1)
        peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **kwargs))
        if (family, variant) not in PEFT_CANNOT_RUN:
            as_trained(peft_model, family)
        peft_model.save_pretrained(root / "adapter")
        logits = None
        if (family, variant) not in PEFT_CANNOT_RUN:
            reloaded = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), root / "adapter")
            with torch.no_grad():
                logits = forward(reloaded.eval(), family, PROBE)
        fresh = PeftModel.from_pretrained(cls.from_pretrained(base, dtype=torch.float32), root / "adapter")
        fresh.merge_and_unload().save_pretrained(root / "peft")
        cache[family, variant] = base, root / "adapter", root / "peft", logits
        return cache[family, variant]

    return make


SWEEP = [pytest.param(f, v, id=f"{f}-{v}", marks=[pytest.mark.slow] if v == "experts" else []) for f, v in CASES]


@pytest.mark.parametrize("family,variant", SWEEP)
def test_family_merges_like_peft(family, variant, made, tmp_path, capsys):
    base, adapter, reference, logits = made(family, variant)
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected, base_tensors = read_output(out), read_output(reference), read_output(base)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base_tensors[n])}
    config = json.loads((adapter / "adapter_config.json").read_text())
    if config.get("target_parameters"):  # the experts were reached, not only target_modules
        modules = config["target_modules"]
        assert any(not any(f".{m}." in n for m in modules) for n in changed), sorted(changed)
    assert {n for n in got if not torch.equal(got[n], base_tensors[n])} == changed
    cls, _ = build(family)
    if logits is not None:
        merged = cls.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(forward(merged, family, PROBE), logits, rtol=1e-5, atol=1e-5)
        checks = verification_checks(out)
        assert checks == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, said.out
        # which path ran is the installed transformers' to decide (5.24 could not run Llama4's whole model on
        # text, 5.25 can): the language model alone is said when it ran, never passed off as the whole model
        alone = "the language model alone: "
        if text_only(family):
            assert f"{alone}{cls.__name__}'s own forward fails on text" in said.out, said.out
        else:
            assert alone not in said.out, said.out
    else:  # neither peft (its unmerged model) nor transformers can run it: said, never called a match
        assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "skip"}, said.out


def _random_all_linear_merged(family: str, tmp_path, capsys):
    """A tiny base of ``family`` with a random all-linear LoRA (every lora_B non-zero) made by peft, merged
    by peft (``merge_and_unload``: tmp_path/peft, the reference) and by tui-merger (tmp_path/merged):
    (what the merge printed, {name: (ours, peft's)} for every tensor), the names and shapes equal."""
    from peft import LoraConfig, PeftModel, get_peft_model

    cls, config = build(family)
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "base")
    model = cls.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(1)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)) \
        .save_pretrained(tmp_path / "adapter")
    reference = PeftModel.from_pretrained(cls.from_pretrained(tmp_path / "base", dtype=torch.float32), tmp_path / "adapter")
    reference.merge_and_unload().save_pretrained(tmp_path / "peft")
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"), "--out", str(out),
                 "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected = read_output(out), read_output(tmp_path / "peft")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        assert got[name].shape == ref.shape, name
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    return said.out, got


def test_a_convolution_lora_merges_like_peft(tmp_path, capsys):
    """peft's all-linear on GLM-4.5V also wraps the vision patch embedding, a Conv3d (lora_A a Conv3d
    with its kernel, lora_B a 1x1x1 one): its delta, peft's conv(A^T, B)^T, is merged as B @ A on the
    flattened kernels, equal to peft's merge_and_unload; every other weight too; verified."""
    _, got = _random_all_linear_merged("glm4v_moe", tmp_path, capsys)
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved["base_model.model.model.visual.patch_embed.proj.lora_A.weight"].dim() == 5
    base = read_output(tmp_path / "base")
    conv = "model.visual.patch_embed.proj.weight"
    assert got[conv].dim() == 5 and not torch.equal(got[conv], base[conv])
    assert verification_checks(tmp_path / "merged") == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def folder_of(made, family: str, folder):
    """A folder holding the family's base/ and its all-linear adapter/ (whose config names that base),
    as a person has them; and peft's merge."""
    import shutil

    base, adapter, reference, _ = made(family, "all-linear")
    shutil.copytree(base, folder / "base")
    shutil.copytree(adapter, folder / "adapter")
    config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(folder / "base")
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    return folder, reference


def test_the_plain_flow_describes_and_merges_an_all_linear_moe_adapter(made, tmp_path, monkeypatch, capsys):
    """The plain questions on a folder holding a Qwen3-MoE base and its all-linear adapter: Review says
    what the LoRA reaches (attention modules, both expert parameters with their ranks, the router),
    the merge verifies, and the files are peft's own merge."""
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from tui_merger.plain import run_plain

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    ws, reference = folder_of(made, "qwen3_moe", tmp_path / "ws")
    with create_pipe_input() as keys:
        # the adapter; the suggested output; Start; yes to the warning (no tokenizer); no prompt; Done
        keys.send_text("\r" + "\r" + "\r" + "y" + "\r" + "\x1b[A\r")
        keys.close()
        code = run_plain(ws, input=keys, output=DummyOutput())
    out = capsys.readouterr().out
    assert code == 0, out
    flat = " ".join(out.split())
    assert ("r=4 alpha=8 lora, 8 modules (k_proj, o_proj, q_proj, v_proj) + LoRA on 4 expert parameter(s) "
            "(mlp.experts.gate_up_proj r=8 alpha=16, mlp.experts.down_proj r=4 alpha=8; rank per expert) + LoRA on "
            "2 router weight(s) (mlp.gate.weight r=4 alpha=8)") in flat, out
    [merged] = [p for p in ws.iterdir() if (p / "merge_manifest.json").is_file()]
    assert verification_checks(merged) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    got, expected = read_output(merged), read_output(reference)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_assistant_describes_merges_and_verifies_an_all_linear_moe_adapter(made, tmp_path, monkeypatch):
    from test_tui import recheck, text, to_review, until
    from textual.widgets import Checkbox, Input

    from tui_merger.tui.app import MergeApp

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run, reference = folder_of(made, "deepseek_v3", tmp_path / "run")
    out = tmp_path / "merged"
    app = MergeApp(run)
    async with app.run_test(size=(120, 40)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        plan, findings = " ".join(text(app, "#plan-text").split()), " ".join(text(app, "#findings").split())
        # DeepSeek-V3: MLA projections as modules; layer 1's routed experts and its router as parameters
        assert "+ LoRA on 2 expert parameter(s) (mlp.experts.gate_up_proj r=8 alpha=16, mlp.experts.down_proj r=4 " \
               "alpha=8; rank per expert) + LoRA on 1 router weight(s) (mlp.gate.weight r=4 alpha=8)" in plan, plan
        assert "is merged into 12 per-expert tensors; LoRA on 1 router weight(s) (mlp.gate.weight r=4) is merged" in findings
        assert "saved tensors have rank" not in findings and wizard.plan.of("error") == []
        app.screen.query_one("#ack", Checkbox).value = True  # the tiny model has no tokenizer: a warning
        await pilot.pause()
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=1200)
        assert "PASSED" in text(app, "#verify-status"), text(app, "#verify-status")
    got, expected = read_output(out), read_output(reference)
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)


def test_inspect_counts_the_modules_and_names_the_parameters(made, tmp_path, capsys):
    """inspect (no base read): the all-linear adapter's attention modules are its modules (the nested
    expert pairs and the router's are not), and its parameters are named."""
    import shutil

    _, adapter, _, _ = made("qwen3_moe", "all-linear")
    shutil.copytree(adapter, tmp_path / "adapter")
    assert main(["inspect", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert ("targets k_proj, o_proj, q_proj, v_proj; parameters down_proj, gate.weight, gate_up_proj (peft "
            "target_parameters: LoRA on packed experts, rank r per expert, and on routers); 8 modules") in shown
    assert r"r per module: .*\.gate_up_proj=8" in shown


def test_a_lora_the_forward_never_calls_is_said_not_called_broken(tmp_path, capsys):
    """Jamba's mamba mixer reads ``dt_proj.weight`` itself, so peft's unmerged model never applies a LoRA
    there, while its merge_and_unload (and ours) puts it in. With a non-zero lora_B on it (not what
    training through this forward leaves), merged and unmerged differ: the behaviour check says why and
    judges nothing, never that the merge (equal to peft's) is broken."""
    said, _ = _random_all_linear_merged("jamba", tmp_path, capsys)
    assert verification_checks(tmp_path / "merged") == {"structure": "pass", "recompute": "pass", "behaviour": "skip"}, said
    assert "non-zero LoRA on model.layers.0.mamba.dt_proj" in said and "never calls" in said, said
    assert "FAIL" not in said, said
