"""An expert LoRA saved by peft 0.18 (``tests/fixtures/peft018``, written by peft 0.18.1 itself with
``make.py``): its packed-expert pairs read dim 1 of ``[experts, d1, d2]`` where peft 0.20+ reads dim 2
(vLLM and unsloth broke on that change). The merge equals peft 0.18.1's own ``merge_and_unload``, the
merged model gives peft 0.18.1's unmerged logits, and the verification's reference (the installed
peft cannot load that layout) gets the adapter rewritten in the installed peft's layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from factory import read_output, verification_checks
from safetensors.torch import load_file

from tui_merger.cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "peft018"


def test_a_peft_0_18_expert_lora_merges_as_peft_0_18_did(tmp_path, capsys):
    assert json.loads((FIXTURE / "adapter" / "adapter_config.json").read_text())["peft_version"] == "0.18.1"
    out = tmp_path / "merged"
    code = main(["merge", "--base", str(FIXTURE / "base"), "--adapter", str(FIXTURE / "adapter"), "--out", str(out),
                 "--plain"])
    said = capsys.readouterr()
    assert code == 0, said.out + said.err
    got, expected, base = read_output(out), read_output(FIXTURE / "peft_merged"), read_output(FIXTURE / "base")
    assert sorted(got) == sorted(expected)
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    changed = {n for n in expected if not torch.equal(expected[n], base[n])}
    assert {"model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.experts.0.down_proj.weight",
            "model.layers.1.mlp.gate.weight"} <= changed  # the square gate_up, down and the router
    saved = load_file(FIXTURE / "unmerged_logits.safetensors")
    merged = transformers.Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(saved["probe"]).logits, saved["logits"], rtol=1e-5, atol=1e-5)
    assert verification_checks(out) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_the_rewritten_adapter_runs_in_the_installed_peft_as_peft_0_18_ran_the_original(tmp_path):
    """The reference the behaviour check builds: the same adapter in the installed peft's layout, which
    that peft loads and runs to peft 0.18.1's own unmerged logits (values moved, none computed)."""
    from peft import PeftModel

    from tui_merger.core.formats.inputs import open_inputs
    from tui_merger.core.formats.peft_adapter import PeftAdapterFormat
    from tui_merger.core.options import MergeOptions

    inputs = open_inputs(MergeOptions(base=FIXTURE / "base", adapter=FIXTURE / "adapter", out=tmp_path / "x"))
    try:
        assert len(inputs.adapter.relayout) == 4  # gate_up and down of both layers; the router is 2-D
        folder = PeftAdapterFormat().reference_folder(inputs.adapter, tmp_path, "relaid")
    finally:
        inputs.close()
    saved = load_file(FIXTURE / "unmerged_logits.safetensors")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(FIXTURE / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(saved["probe"]).logits, saved["logits"], rtol=1e-5, atol=1e-5)
