"""ms-swift's Megatron LoRA saves (issue 39): ``<output>/checkpoint-N/{args.json, latest_checkpointed_iteration.txt,
iter_NNNNNNN/}`` whose dist checkpoint holds only the ``*.lora_A/B.default.weight`` tensors of megatron-core's
sharded state dict (TP 2 here), with their Transformer Engine ``_extra_state`` and the ``rng_state``.

The fixtures ``swift_lora_tp2`` and ``swift_full_tp2`` were written by ms-swift 4.6.0's own
``MegatronTrainer.save_checkpoint`` on CPU (tests/fixtures/ms_swift/generate_real.py: a Transformer Engine CPU shim,
no training step); the LoRA run's weights are a PEFT adapter written by peft itself (``lora_tp2/reference_adapter``,
on the base ``megatron_layouts/fw/hf_dense``) that ms-swift loaded with ``--adapters``. References: peft's
``merge_and_unload`` of that adapter, its tensors for the PEFT adapter export, and the base's own weights for the
full save. ``swift_lora_moe_ep2`` is ms-swift's own LoRA save on a Qwen3-MoE at EP 2 (generate_real.py moe), of
the LoRA weights generate.py drew (``moe_ep2/reference_lora.safetensors``) that ms-swift loaded with --adapters.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from factory import read_output
from megatron_helpers import dcp_tensors
from megatron_helpers import refused as _refused

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.scan import scan
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

FIXTURES = Path(__file__).parent / "fixtures"
SWIFT = FIXTURES / "ms_swift" / "swift_lora_tp2"  # written by ms-swift 4.6.0's own save (generate_real.py)
REFERENCE = FIXTURES / "ms_swift" / "lora_tp2" / "reference_adapter"  # written by peft; ms-swift loaded it (--adapters)
FULL = FIXTURES / "ms_swift" / "swift_full_tp2"  # ms-swift's own full-parameter save of the base
BASE = FIXTURES / "megatron_layouts" / "fw" / "hf_dense"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def _run(tmp: Path, **args) -> Path:
    """The ms-swift output folder copied, its args.json (both copies) changed by ``args``."""
    run = tmp / "megatron_output"
    shutil.copytree(SWIFT, run, symlinks=True)
    for path in (run / "args.json", run / "checkpoint-3" / "args.json"):
        said = json.loads(path.read_text())
        said.update(args)
        path.write_text(json.dumps(said))
    return run


@pytest.fixture(scope="module")
def peft_merged():
    """peft's merge_and_unload of the reference adapter (the same LoRA weights, written by peft) on the base."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, REFERENCE).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def _base_tensors() -> dict:
    from safetensors.torch import load_file

    return load_file(BASE / "model.safetensors")


def test_swift_lora_merges_like_peft(tmp_path, peft_merged):
    run = _run(tmp_path)
    result = run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=BASE), fsync=False)
    notes = " ".join(result.warnings)
    assert "Using the newest checkpoint, checkpoint-3." in notes, notes
    assert "An ms-swift LoRA run: its adapter (rank 8, alpha 32 from args.json) is merged into the Hugging Face model" in notes, notes
    got, base = read_output(tmp_path / "out"), _base_tensors()
    assert sorted(got) == sorted(base)
    changed = [k for k in base if not torch.equal(got[k], base[k])]
    assert len(changed) == 14, changed  # q, k, v, o, gate, up, down x 2 layers
    for name in base:
        assert torch.allclose(got[name], peft_merged[name], atol=2e-6, rtol=0), name


def test_swift_lora_exports_the_adapter_peft_wrote(tmp_path):
    """--export-adapter: the TP pieces put back together and split into q/k/v and gate/up are the very tensors
    peft saved before they were sharded (bit for bit); alpha and r as args.json records them."""
    from safetensors.torch import load_file

    run = _run(tmp_path)
    run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=BASE, export_adapter=True), fsync=False)
    folder = next(p.parent for p in (tmp_path / "out").rglob("adapter_config.json"))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 32, False)
    ours, want = load_file(folder / "adapter_model.safetensors"), load_file(REFERENCE / "adapter_model.safetensors")
    assert sorted(ours) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(ours[name], tensor), name


def test_inspect_shows_an_swift_lora_run_and_its_base_from_args_json(tmp_path, peft_merged):
    run = _run(tmp_path / "a")
    (c,) = scan(run).candidates
    assert (c.backend, Path(c.path).name, c.step, c.world_size, Path(c.run).name) == (
        "ms-swift", "iter_0000003", 3, 2, "megatron_output")
    notes = " ".join(c.notes)
    assert "args.json: TP 2" in notes and "An ms-swift lora run: adapters only (r 8, alpha 32)" in notes, notes
    # ms-swift records the local folder it read the model from (model_dir; here the generator's, gone): --base needed
    assert c.needs_base and "/models/Qwen2-tiny (model_dir), which is not on this machine" in notes, notes
    assert "model family: qwen2" in notes, notes
    assert (c.lora["r"], c.lora["alpha"], c.lora["rslora"], c.lora["target_modules"]) == (8, 32, False, ["all-linear"])
    # ms-swift records the local folder the model was read from (model_dir): found there, no --base needed
    run = _run(tmp_path / "b", model_dir=str(BASE.resolve()))
    (c,) = scan(run).candidates
    assert not c.needs_base and c.base_path == str(BASE.resolve()), c.notes
    run_merge(MergeOptions(checkpoint=run / "checkpoint-3", out=tmp_path / "out"), fsync=False)
    got = read_output(tmp_path / "out")
    assert all(torch.allclose(got[k], peft_merged[k], atol=2e-6, rtol=0) for k in got)


def test_swift_rslora_and_lora_alpha(tmp_path):
    """use_rslora in args.json scales by alpha / sqrt(r), as peft does; --lora-alpha replaces the recorded alpha."""
    base = _base_tensors()
    k = "model.layers.1.mlp.gate_proj.weight"
    run_merge(MergeOptions(checkpoint=_run(tmp_path / "a"), out=tmp_path / "plain", base=BASE), fsync=False)
    plain = read_output(tmp_path / "plain")[k] - base[k]
    result = run_merge(MergeOptions(checkpoint=_run(tmp_path / "b", use_rslora=True), out=tmp_path / "rs", base=BASE), fsync=False)
    assert any("rsLoRA" in n for n in result.warnings), result.warnings
    rs = read_output(tmp_path / "rs")[k] - base[k]
    assert torch.allclose(rs, plain * math.sqrt(8), atol=1e-5)
    run_merge(MergeOptions(checkpoint=_run(tmp_path / "c"), out=tmp_path / "a8", base=BASE, lora_alpha=8), fsync=False)
    assert torch.allclose(read_output(tmp_path / "a8")[k] - base[k], plain / 4, atol=1e-6)


def test_swift_full_parameter_save_converts_to_the_base_weights(tmp_path):
    """ms-swift's own full-parameter save (tuner_type full, TP 2, Transformer Engine spec: the norms as
    linear_qkv / linear_fc1 ``layer_norm_weight``, TE ``_extra_state`` and ``rng_state`` beside them): every tensor
    equals the base ms-swift loaded; inspect reads the family and sizes from args.json; the ``last-checkpoint``
    link ms-swift makes is neither a second checkpoint nor a problem, and can be named itself."""
    from safetensors.torch import load_file

    run = tmp_path / "megatron_output"
    shutil.copytree(FULL, run, symlinks=True)
    (c,) = scan(run).candidates
    notes = " ".join(c.notes)
    assert c.backend == "ms-swift" and c.step == 3 and "args.json: TP 2" in notes and "model family: qwen2" in notes, notes
    result = run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=BASE), fsync=False)
    assert result.kind == "convert"
    got, want = read_output(tmp_path / "out"), load_file(BASE / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    run_merge(MergeOptions(checkpoint=run / "last-checkpoint", out=tmp_path / "out2", base=BASE), fsync=False)
    got = read_output(tmp_path / "out2")
    assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_swift_bad_input(tmp_path):
    _refused(_run(tmp_path / "a"), tmp_path / "o1", "Qwen2-tiny (model_dir)", "--base")
    _refused(_run(tmp_path / "b", lora_alpha=None), tmp_path / "o2", "args.json", "lora_alpha", "--lora-alpha", base=BASE)
    _refused(_run(tmp_path / "c", tuner_type="lora_llm"), tmp_path / "o3", "lora_llm", "checkpoint-N-merged", base=BASE)
    _refused(_run(tmp_path / "d", tuner_type="longlora"), tmp_path / "o4", "longlora", "--adapter", base=BASE)
    # a base of another model: its layer count is not the adapter's
    other = tmp_path / "other"
    shutil.copytree(BASE, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))
    _refused(_run(tmp_path / "e"), tmp_path / "o5", "cover 2 layers", "has 3", base=other)
    # ms-swift's save with save_safetensors and no_save_optim: the iteration holds only common.pt (its
    # save_checkpoint passes no model), the weights are its Hugging Face export beside it
    run = _run(tmp_path / "g", save_safetensors=True, no_save_optim=True)
    for p in (run / "checkpoint-3" / "iter_0000003").iterdir():
        if p.name != "common.pt":
            p.unlink()
    _refused(run, tmp_path / "o7", "holds no weights", "no_save_optim", "checkpoint-3-merged", base=BASE)
    # an iteration missing one of its files
    run = _run(tmp_path / "f")
    next((run / "checkpoint-3" / "iter_0000003").glob("*.distcp")).unlink()
    with pytest.raises(MergeError):
        run_merge(MergeOptions(checkpoint=run, out=tmp_path / "o6", base=BASE), fsync=False)
    assert not (tmp_path / "o6").exists()


# -- Megatron-Bridge's LoRA on MoE experts (fixtures/megatron_layouts/fw/bridge_lora_moe_ep2, its trainer's save) --

FW = FIXTURES / "megatron_layouts" / "fw"


def test_bridge_lora_on_moe_experts_merges_by_the_formula(tmp_path):
    """Megatron-Bridge's LoRA run on the Qwen3-MoE at EP 2, the experts' linear_fc1/fc2 targeted (SequentialMLP:
    megatron-core stores them as ``mlp.experts.experts.linear_fc*`` with the global expert as an axis), merged
    into the base checkpoint its run_config.yaml names. Bridge 0.3.1's own export fails at EP 2 (see
    fixtures/megatron_layouts/README.md), so the reference is W + alpha/r * B @ A on the tensors
    torch.distributed.checkpoint reads from the iteration, with the weights the base was imported from."""
    from safetensors.torch import load_file

    fw = tmp_path / "fw"
    for case in ("bridge_lora_moe_ep2", "bridge_moe_ep2", "hf_moe"):
        shutil.copytree(FW / case, fw / case)
    result = run_merge(MergeOptions(checkpoint=fw / "bridge_lora_moe_ep2", out=tmp_path / "out"), fsync=False)
    assert any("base checkpoint its run_config.yaml names" in n and "alpha 16" in n for n in result.warnings), result.warnings
    src = fw / "bridge_lora_moe_ep2" / "iter_0000003"
    state = dcp_tensors(src)
    got, base = read_output(tmp_path / "out"), load_file(fw / "hf_moe" / "model.safetensors")
    assert sorted(got) == sorted(base)

    def delta(mod, i, e=None):
        a, b = (state[f"decoder.layers.{mod}.adapter.{p}.weight"][i] for p in ("linear_in", "linear_out"))
        if e is not None:
            a, b = a[e], b[e]
        return 16 / 8 * (b.double() @ a.double())

    want = {}
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = delta("self_attention.linear_qkv", i).reshape(2, 4, 8, 32)  # 2 query groups of [q, q, k, v] heads
        want[p + "self_attn.q_proj.weight"] = qkv[:, :2].reshape(32, 32)
        want[p + "self_attn.k_proj.weight"] = qkv[:, 2].reshape(16, 32)
        want[p + "self_attn.v_proj.weight"] = qkv[:, 3].reshape(16, 32)
        want[p + "self_attn.o_proj.weight"] = delta("self_attention.linear_proj", i)
        for e in range(4):
            fc1 = delta("mlp.experts.experts.linear_fc1", i, e)
            want[p + f"mlp.experts.{e}.gate_proj.weight"], want[p + f"mlp.experts.{e}.up_proj.weight"] = fc1[:16], fc1[16:]
            want[p + f"mlp.experts.{e}.down_proj.weight"] = delta("mlp.experts.experts.linear_fc2", i, e)
    for name, d in want.items():
        assert d.abs().max() > 1e-3, name  # trained: every expert of both EP ranks holds its own adapter
        assert torch.allclose(got[name].double(), base[name].double() + d, atol=1e-6, rtol=0), name
    assert all(torch.equal(got[k], base[k]) for k in base if k not in want)


def test_inspect_shows_bridge_lora_on_experts(tmp_path):
    fw = tmp_path / "fw"
    for case in ("bridge_lora_moe_ep2", "bridge_moe_ep2", "hf_moe"):
        shutil.copytree(FW / case, fw / case)
    (c,) = scan(fw / "bridge_lora_moe_ep2").candidates
    notes = " ".join(c.notes)
    assert "PEFT run (LoRA): adapters only (r 8, alpha 16), merged into the base checkpoint" in notes, notes
    assert "EP 2" in notes and not c.needs_base, notes
    assert (c.lora["r"], c.lora["alpha"], c.lora["target_modules"]) == (8, 16, ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"])


def test_swift_lora_into_the_mcore_model_it_names(tmp_path, peft_merged):
    """``mcore_model`` in args.json: the run started from a Megatron checkpoint (here ms-swift's own full-parameter
    save of the same base), which is converted and merged into; the Hugging Face config from ``model_dir``."""
    full = tmp_path / "full"
    shutil.copytree(FULL, full, symlinks=True)
    run = _run(tmp_path, model_dir=str(BASE.resolve()), mcore_model=str(full))
    result = run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out"), fsync=False)
    assert any("merged into the base checkpoint its args.json names" in n and "iter_0000003" in n
               for n in result.warnings), result.warnings
    got = read_output(tmp_path / "out")
    for name, tensor in peft_merged.items():
        assert torch.allclose(got[name], tensor, atol=2e-6, rtol=0), name


def _rewritten(run: Path, extra: dict) -> None:
    """The LoRA iteration rewritten by torch.distributed.checkpoint with ``extra`` tensors beside its own, as
    one process (TP 1) holds them: linear_fc1's lora_B rows [gate; up] of TP rank 0, then of rank 1, become
    [all gate; all up], the rows a TP 1 run's single rank holds."""
    import torch.distributed.checkpoint as dcp

    src = run / "checkpoint-3" / "iter_0000003"
    state = dcp_tensors(src)
    fc1 = state["decoder.layers.mlp.linear_fc1.lora_B.default.weight"]
    g0, u0, g1, u1 = fc1.chunk(4, 1)
    state["decoder.layers.mlp.linear_fc1.lora_B.default.weight"] = torch.cat([g0, g1, u0, u1], 1)
    for f in src.iterdir():
        if f.name != "common.pt" and f.name != "metadata.json":
            f.unlink()
    dcp.save({**state, **extra}, storage_writer=dcp.FileSystemWriter(str(src)), no_dist=True)


def test_swift_other_adapters_grouped_experts_and_modules_to_save(tmp_path, peft_merged):
    # ms-swift's frozen reference adapter (mcore_ref_adapter) beside the trained one: said, not merged
    run = _run(tmp_path / "a")
    _rewritten(run, {"decoder.layers.self_attention.linear_qkv.lora_A.ref_adapter.weight": torch.ones(2, 8, 32)})
    result = run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=BASE), fsync=False)
    assert any("also holds the adapter(s) ref_adapter" in n for n in result.warnings), result.warnings
    got = read_output(tmp_path / "out")
    assert all(torch.allclose(got[k], peft_merged[k], atol=2e-6, rtol=0) for k in got)
    run = _run(tmp_path / "b")
    _rewritten(run, {"decoder.layers.mlp.experts.linear_fc1.lora_A.default.weight": torch.ones(2, 4, 8, 32)})
    _refused(run, tmp_path / "o1", "grouped MoE experts", "--adapter", base=BASE)
    run = _run(tmp_path / "c")
    _rewritten(run, {"output_layer.modules_to_save.default.weight": torch.ones(64, 32)})
    _refused(run, tmp_path / "o2", "modules_to_save", base=BASE)


def test_swift_lora_on_moe_experts_at_ep2(tmp_path):
    """ms-swift 4.6.0's own LoRA save on a Qwen3-MoE (generate_real.py moe: all-linear, the attention and every
    expert, grouped GEMM: TEGroupedLinear lora_A/B saved as ``mlp.experts.experts.linear_fc*`` with the global expert
    as an axis), EP 2: the LoRA weights ms-swift loaded with --adapters (moe_ep2/reference_lora.safetensors, peft's
    names) merged by W + alpha/r B@A, every expert of both EP ranks, within 1e-6."""
    from safetensors.torch import load_file

    run = tmp_path / "megatron_output"
    shutil.copytree(FIXTURES / "ms_swift" / "swift_lora_moe_ep2", run, symlinks=True)
    (c,) = scan(run).candidates
    notes = " ".join(c.notes)
    assert c.backend == "ms-swift" and c.step == 3 and c.world_size == 2, notes
    assert "EP 2" in notes and "model family: qwen3_moe" in notes and "r 8, alpha 32" in notes, notes
    base_dir = FW / "hf_moe"
    run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=base_dir), fsync=False)
    got, base = read_output(tmp_path / "out"), load_file(base_dir / "model.safetensors")
    ref = load_file(FIXTURES / "ms_swift" / "moe_ep2" / "reference_lora.safetensors")
    assert sorted(got) == sorted(base)
    targets = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight" for k in ref}
    assert len(targets) == 2 * (4 + 4 * 3)  # q, k, v, o and 4 experts' gate, up, down in 2 layers
    for name in targets:
        m = "base_model.model." + name.removesuffix(".weight")
        d = 32 / 8 * (ref[m + ".lora_B.weight"].double() @ ref[m + ".lora_A.weight"].double())
        assert d.abs().max() > 1e-3, name
        assert torch.allclose(got[name].double(), base[name].double() + d, atol=1e-6, rtol=0), name
    assert all(torch.equal(got[k], base[k]) for k in base if k not in targets)


def test_swift_vl_full_save_converts_to_the_base_weights(tmp_path):
    """ms-swift 4.6.0's own full-parameter save of a tiny Qwen2.5-VL at TP 2 (generate_real.py vl: mcore_bridge's
    Qwen2.5-VL provider on CPU, transformers' vision module held one level deeper, ``visual.visual.*``, the text
    model under ``language_model.*``): every tensor equals the base ms-swift loaded (megatron_vl/hf_qwen25)."""
    from safetensors.torch import load_file

    run = tmp_path / "megatron_output"
    shutil.copytree(FIXTURES / "ms_swift" / "swift_vl_full_tp2", run, symlinks=True)
    (c,) = scan(run).candidates
    notes = " ".join(c.notes)
    assert c.backend == "ms-swift" and c.step == 3 and "args.json: TP 2" in notes, notes
    assert "model family: qwen2_5_vl" in notes and c.needs_base, notes  # model_dir was the generator's folder
    base_dir = FIXTURES / "megatron_vl" / "hf_qwen25"
    result = run_merge(MergeOptions(checkpoint=run, out=tmp_path / "out", base=base_dir), fsync=False)
    assert result.kind == "convert"
    assert any("the vision tower (30 tensors, transformers' own vision module, as ms-swift saves it)" in n
               for n in result.warnings), result.warnings
    got, want = read_output(tmp_path / "out"), load_file(base_dir / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert sum(k.startswith("visual.") for k in want) == 30  # the vision tower, as save_pretrained names it
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
