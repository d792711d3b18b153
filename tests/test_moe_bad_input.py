"""Bad MoE input, said in one sentence naming the module, the parameter and what was expected, with
nothing written; never the rank message for an adapter that peft itself merges. And a model is never
written with an expert missing: the experts its config declares are counted layer by layer, before
the merge (the plan) and after it (the structure check)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tui_merger.cli import main

MOE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=320, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=32)


@pytest.fixture(scope="module")
def all_linear(tmp_path_factory):
    """A Qwen3-MoE base and peft's all-linear adapter on it (experts nested, router, gate_up at rank 2r)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("moe_bad")
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**MOE)).save_pretrained(root / "base")
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)) \
        .save_pretrained(root / "adapter")
    return root / "base", root / "adapter"


def edited(adapter, tmp_path, **changes):
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    config.update(changes)
    (copy / "adapter_config.json").write_text(json.dumps(config))
    return copy


def refused(capsys, base, adapter, out) -> str:
    code = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--force"])
    said = capsys.readouterr()
    assert code != 0, said.out
    assert "Traceback" not in said.err and not out.exists()
    return " ".join(said.err.split())


def test_the_all_linear_adapter_itself_is_not_refused(all_linear, tmp_path, capsys):
    base, adapter = all_linear
    assert main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--dry-run"]) == 0
    assert "saved tensors have rank" not in capsys.readouterr().out


def test_a_target_parameter_the_model_lacks(all_linear, tmp_path, capsys):
    base, adapter = all_linear
    bad = edited(adapter, tmp_path, target_parameters=["w1", "w2", "gate.weight"])
    said = refused(capsys, base, bad, tmp_path / "out")
    assert "model.layers.0.mlp.experts: the adapter's target_parameters (w1, w2) name no parameter of this module" in said
    assert "the base has gate_up_proj, down_proj there" in said


def test_patterns_that_reach_nothing_leave_a_rank_that_does_not_fit(all_linear, tmp_path, capsys):
    """The rank pattern peft wrote for the fused gate_up (2r) edited to reach nothing: gate_up's pairs
    (rank 8 per expert) no longer fit the rank 4 the config then gives it."""
    base, adapter = all_linear
    bad = edited(adapter, tmp_path, rank_pattern={r".*\.gate_upproj": 8}, alpha_pattern={})
    said = refused(capsys, base, bad, tmp_path / "out")
    assert ("model.layers.0.mlp.experts.gate_up_proj: adapter_config.json gives this parameter rank 4 per expert "
            "(4 experts: 16 rows), but its lora_A has 32 rows; the config does not belong to these weights.") in said


def test_a_rank_that_really_does_not_match(all_linear, tmp_path, capsys):
    base, adapter = all_linear
    bad = edited(adapter, tmp_path, r=2)
    said = refused(capsys, base, bad, tmp_path / "out")
    assert "adapter_config.json says r=2 but the saved tensors have rank 4" in said  # an attention module


def holey_copy(base, dest, layer: int, expert: int):
    shutil.copytree(base, dest)
    tensors = {k: v for k, v in load_file(dest / "model.safetensors").items()
               if f".layers.{layer}.mlp.experts.{expert}." not in k}
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_a_base_missing_an_expert_is_refused_before_anything_is_written(all_linear, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    base, _ = all_linear
    holey = holey_copy(base, tmp_path / "holey", layer=1, expert=2)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "q")
    said = refused(capsys, holey, tmp_path / "q", tmp_path / "out")
    assert ("The model would be written with experts missing: model.layers.1.mlp.experts has 3 of the 4 experts "
            "the config declares (missing: expert 2); nothing was written.") in said


def test_the_structure_check_counts_the_experts(all_linear, tmp_path, capsys):
    """A merged folder from which one expert was lost, checked against the same incomplete base (so the
    plan lacks it too): only the count of experts per layer can tell, and verification fails."""
    from peft import LoraConfig, get_peft_model

    base, _ = all_linear
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(base, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "q")
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(base), "--adapter", str(tmp_path / "q"), "--out", str(out), "--no-verify"]) == 0
    holey = holey_copy(base, tmp_path / "holey", layer=0, expert=3)
    tensors = {k: v for k, v in load_file(out / "model.safetensors").items() if ".layers.0.mlp.experts.3." not in k}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    code = main(["verify", str(out), "--base", str(holey), "--adapter", str(tmp_path / "q"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code != 0
    structure = next(c for c in report["checks"] if c["name"] == "structure")
    assert structure["status"] == "fail"
    assert "model.layers.0.mlp.experts has 3 of the 4 experts the config declares (missing: expert 3)" in structure["details"]


def test_parameter_loras_a_reader_left_unplaced_are_refused_not_dropped(all_linear):
    """peft's target_parameters pairs are placed in the base's tensors by the reader that opens the inputs
    (hf_names.place_parameter_loras); a path that never placed them must not plan a merge without them."""
    import json

    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.adapter import open_adapter
    from tui_merger.core.io.sources import open_model
    from tui_merger.core.plan.plan import build_plan

    base, adapter_dir = all_linear
    adapter = open_adapter(adapter_dir)
    assert adapter.param_lora  # peft's packed-expert pairs, not yet placed
    with pytest.raises(MergeError, match=r"cannot place in this checkpoint's tensors yet; nothing was written"):
        build_plan(open_model(base), adapter, json.loads((base / "config.json").read_text()), None, 1 << 30)
