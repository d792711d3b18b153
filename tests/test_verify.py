"""Verification catches each planted fault (the adapter not applied, a wrong base, one layer left
unmerged, a flipped sign, a truncated shard) and passes correct merges; the manifest and the model card
record what happened. Faults are planted by rewriting real outputs with the safetensors library."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from factory import ALL_LINEAR, edit_adapter_config, load_base, qwen_config, save_adapter, save_base, small_blocks_exact
from fsdp_factory import cached_fsdp_checkpoint
from safetensors.torch import load_file, save_file

from tui_merger.cli import main as cli_main
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.record.manifest import MANIFEST_NAME, read_manifest
from tui_merger.core.options import MergeOptions
from tui_merger.core.record.provenance import finish_merge
from tui_merger.core.verify.checks import verify_merge

Q = "model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    base = save_base(root / "base", qwen_config(), dtype=torch.bfloat16)
    other = save_base(root / "other-base", qwen_config(), dtype=torch.bfloat16, seed=5)
    adapter = save_adapter(root / "adapter", base, target_modules=ALL_LINEAR)
    return base, other, adapter


def _merge(base, adapter, out, **kw):
    options = MergeOptions(base=base, adapter=adapter, out=out, **kw)
    result = run_merge(options, fsync=False)
    manifest, report = finish_merge(options, result, fsync=False)
    return options, manifest, report


def _statuses(report) -> dict:
    return {c.name: c.status for c in report.checks}


def _rewrite(out: Path, change) -> None:
    """Rewrite model.safetensors with ``change(tensors)`` applied (a planted fault)."""
    path = out / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def merged(pair, tmp_path_factory):
    base, _, adapter = pair
    out = tmp_path_factory.mktemp("merged") / "out"
    options, manifest, report = _merge(base, adapter, out)
    return options, manifest, report


def test_a_correct_merge_passes_every_check(merged):
    _, manifest, report = merged
    assert report.passed, report.to_dict()
    assert _statuses(report) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
    behaviour = report.checks[2].metrics
    assert behaviour["worst_ratio"] < 0.1  # rounding alone stays far below the limits
    said = f"The merged model answers like the adapter on the base: largest difference {behaviour['worst_ratio']:.0%} of what rounding allows"
    assert report.checks[2].summary.startswith(said + " (Qwen2ForCausalLM layer by layer: ")  # the plain sentence first
    assert len(behaviour["layers"]) == qwen_config().num_hidden_layers + 1  # every hidden state compared
    assert manifest["verification"]["passed"] is True


def test_the_progress_total_is_known_from_the_start(merged, pair, tmp_path):
    """The checks run side by side and report as one bar: its count of tensors does not grow as each
    check starts reporting ("37/39 tensors", then "40/89"), and never goes back; both when verifying a
    finished folder and right after a merge (the recompute done while writing, the reference ahead)."""
    from tui_merger.core.events import TensorProgress
    from tui_merger.core.verify.checks import merge_prewarmed

    def counts(events):
        seen = [(e.tensors_done, e.tensors_total) for e in events if isinstance(e, TensorProgress)]
        assert seen and len({total for _, total in seen}) == 1, seen
        done = [d for d, _ in seen]
        assert done == sorted(done) and done[-1] == seen[-1][1], seen

    events = []
    verify_merge(Path(merged[0].out), on_event=events.append)
    counts(events)
    base, _, adapter = pair
    options = MergeOptions(base=base, adapter=adapter, out=tmp_path / "again")
    result = merge_prewarmed(options, lambda e: None)
    events = []
    finish_merge(options, result, on_event=events.append)
    counts(events)


def _faulty_copy(merged, tmp_path, change) -> Path:
    out = Path(merged[0].out)
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    _rewrite(bad, change)
    return bad


def test_the_unmerged_run_made_while_merging_is_the_one_verification_uses(pair, tmp_path, monkeypatch):
    """The default merge runs the unmerged reference while it writes (it needs nothing the merge
    writes); verification takes that run instead of a second one, and finds what a verification run
    afterwards finds, which builds the reference itself."""
    import threading

    import tui_merger.core.verify.checks as checks

    base, _, adapter = pair
    built = []
    real = checks._reference_streamer

    def spy(*args, **kwargs):
        built.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "_reference_streamer", spy)
    out = tmp_path / "m"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    assert built == ["tui-merger-prewarm"]
    during = next(c for c in read_manifest(out)["verification"]["checks"] if c["name"] == "behaviour")
    after = verify_merge(out).checks[2]
    assert len(built) == 2 and built[1].startswith("verify ")
    assert during["status"] == after.status == "pass"
    assert during["metrics"]["layers"] == after.metrics["layers"]
    assert during["metrics"]["output_rel_diff"] == after.metrics["output_rel_diff"]


def test_the_objects_frozen_after_the_imports_are_collected_again_once_verified(pair, tmp_path, monkeypatch):
    """The default merge leaves the objects that exist once the verification's imports are done out
    of the cycle collector's passes while it merges and verifies, and hands them back after: a
    reference cycle alive then and dropped during the merge is collected once the verification is
    over (the assistant is a long-lived process), and the collector is on again."""
    import gc
    import weakref

    import tui_merger.core.verify.checks as checks

    class Node:
        pass

    cycle = Node()
    cycle.me = cycle  # garbage that only a pass of the collector finds, once dropped
    ref = weakref.ref(cycle)
    held = [cycle]
    del cycle
    frozen_during = []
    real = checks._reference_ahead

    def spy(*args, **kwargs):  # runs once the imports are done
        frozen_during.append(gc.get_freeze_count())
        held.clear()  # the cycle is frozen garbage now
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "_reference_ahead", spy)
    gc.collect()
    assert gc.get_freeze_count() == 0
    base, _, adapter = pair
    out = tmp_path / "m"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    assert frozen_during[0] > 10_000  # transformers', peft's and accelerate's objects, and the cycle
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.collect()
    assert ref() is None


def _verify_against(options, out):
    return verify_merge(out, MergeOptions(base=options.base, adapter=options.adapter, out=out))


def test_alpha_zero_merge_is_caught(merged, pair, tmp_path):
    """An adapter whose config lost lora_alpha (0, as old verl wrote) merges to the base weights."""
    base, _, adapter = pair
    lost = shutil.copytree(adapter, tmp_path / "alpha0")
    edit_adapter_config(lost, lora_alpha=0)
    out = tmp_path / "out"  # tui-merger refuses alpha 0, so merge it the way other tools do: peft
    from peft import PeftModel

    PeftModel.from_pretrained(load_base(base, torch.bfloat16), lost).merge_and_unload().save_pretrained(out)
    report = _verify_against(merged[0], out)  # against the adapter as trained
    assert _statuses(report) == {"structure": "pass", "recompute": "fail", "behaviour": "fail"}
    assert "not (or wrongly) applied" in " ".join(report.checks[1].details)
    assert "layer 0's output differs" in report.checks[2].details[0]  # the first layer it acts on


def test_dropped_adapter_is_caught(merged, pair, tmp_path):
    """The base weights written as the merged model (an adapter silently not applied)."""
    base_tensors = load_file(pair[0] / "model.safetensors")
    bad = _faulty_copy(merged, tmp_path, lambda t: t.update(base_tensors))
    report = _verify_against(merged[0], bad)
    assert _statuses(report) == {"structure": "pass", "recompute": "fail", "behaviour": "fail"}


def test_one_layer_left_unmerged_is_caught(merged, pair, tmp_path):
    base_q = load_file(pair[0] / "model.safetensors")[Q]
    bad = _faulty_copy(merged, tmp_path, lambda t: t.__setitem__(Q, base_q))
    report = _verify_against(merged[0], bad)
    recompute = report.checks[1]
    assert recompute.status == "fail"
    assert [d for d in recompute.details if "values differ" in d] == [recompute.details[0]]
    assert recompute.details[0].startswith(Q) and "not (or wrongly) applied" in recompute.details[1]
    assert "layer 1's output differs" in report.checks[2].details[0]  # the layer it is in
    assert report.checks[2].summary.startswith("The merged model does not answer like the adapter on the base: differences up to ")
    assert "times what rounding allows, from layer 1's output on (" in report.checks[2].summary


def test_a_flipped_sign_is_caught(merged, pair, tmp_path):
    base_t = load_file(pair[0] / "model.safetensors")

    def flip(t):
        for name in t:
            if name.endswith("proj.weight"):
                t[name] = (2 * base_t[name].float() - t[name].float()).to(t[name].dtype)  # W - delta

    bad = _faulty_copy(merged, tmp_path, flip)
    report = _verify_against(merged[0], bad)
    assert _statuses(report)["recompute"] == "fail"
    assert _statuses(report)["behaviour"] == "fail"


def test_a_wrong_base_is_caught(pair, merged, tmp_path):
    base, other, adapter = pair
    out = tmp_path / "from-other"
    run_merge(MergeOptions(base=other, adapter=adapter, out=out), fsync=False)
    report = verify_merge(out, MergeOptions(base=base, adapter=adapter, out=out))
    assert _statuses(report) == {"structure": "pass", "recompute": "fail", "behaviour": "fail"}


def test_a_truncated_shard_is_caught_without_a_crash(merged, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(merged[0].out, bad)
    path = bad / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1000)
    report = _verify_against(merged[0], bad)
    assert not report.passed
    assert report.checks[0].status == "fail"
    assert "truncated or corrupt" in report.checks[0].details[0]


def test_nan_in_the_output_is_caught(merged, tmp_path):
    def poison(t):
        t[Q][0, 0] = float("nan")

    report = _verify_against(merged[0], _faulty_copy(merged, tmp_path, poison))
    assert any("NaN or Inf" in d for d in report.checks[1].details)


def test_sampled_rows_still_catch_a_fault(merged, pair, tmp_path, monkeypatch):
    """Above the size limit only a sample of rows is recomputed; an unmerged layer changes every row."""
    import tui_merger.core.verify.recompute as verify

    monkeypatch.setattr(verify, "SAMPLE_LIMIT", 100)
    monkeypatch.setattr(verify, "FULL_RANK", 1)  # the adapter's rank 4 counts as high
    monkeypatch.setattr(verify, "SAMPLE_ROWS", 4)
    good = _verify_against(merged[0], Path(merged[0].out))
    assert good.checks[1].status == "pass" and good.checks[1].metrics["sampled_tensors"] > 0
    assert "random rows" in good.checks[1].summary
    base_q = load_file(pair[0] / "model.safetensors")[Q]
    bad = _faulty_copy(merged, tmp_path, lambda t: t.__setitem__(Q, base_q))
    assert _verify_against(merged[0], bad).checks[1].status == "fail"


def test_manifest_records_inputs_outputs_and_settings(merged, pair):
    options, manifest, _ = merged
    base, _, adapter = pair
    on_disk = read_manifest(options.out)
    assert on_disk == manifest
    roles = {i["role"]: i for i in manifest["inputs"]}
    assert set(roles) == {"base", "adapter"}
    for role, folder in (("base", base), ("adapter", adapter)):
        for entry in roles[role]["files"]:
            data = (folder / entry["path"]).read_bytes()
            assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
    names = {e["path"] for e in roles["adapter"]["files"]}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    outputs = {e["path"]: e["sha256"] for e in manifest["outputs"]}
    for name, digest in outputs.items():
        assert hashlib.sha256((Path(options.out) / name).read_bytes()).hexdigest() == digest
    assert "model.safetensors" in outputs and "config.json" in outputs
    assert manifest["adapter"]["r"] == 4 and manifest["adapter"]["alpha"] == 8
    assert manifest["adapter"]["variant"] == "lora"
    assert sorted(manifest["adapter"]["target_modules"]) == sorted(ALL_LINEAR)
    assert manifest["options"]["base"] == str(base)
    assert manifest["timings"]["merge_s"] > 0 and manifest["timings"]["verify_s"] > 0


def test_model_card_front_matter_and_summary(merged):
    from tui_merger.core.record.card import render_model_card

    options, manifest, _ = merged
    card = (Path(options.out) / "README.md").read_text()
    front = card.split("---")[1]
    assert "library_name: transformers" in front and "- lora" in front
    assert "base_model" not in front  # a local folder is not a Hub id; the Hub would refuse it
    assert f"Base model: the local model folder `{options.base.name}`" in card  # but the text says what was merged
    assert str(options.base.parent) not in card  # by its folder's name: no local paths in a published card
    assert "Passed: structure, recompute, behaviour" in card and "| alpha | 8 |" in card
    hub_card = render_model_card({**manifest, "base_model": "Qwen/Qwen2.5-0.5B", "base_used": None})  # an older manifest
    front = hub_card.split("---")[1]
    assert 'base_model: "Qwen/Qwen2.5-0.5B"' in front and "base_model_relation: finetune" in front
    exported = render_model_card({**manifest, "base_model": "Qwen/Qwen2.5-0.5B", "base_used": None, "kind": "export-adapter"})
    assert "base_model_relation: adapter" in exported and "library_name: peft" in exported


def test_an_existing_readme_is_kept(pair, tmp_path):
    from tui_merger.core.record.card import write_model_card

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "README.md").write_text("my own card\n")
    assert not write_model_card(folder, {"kind": "merge"})
    assert (folder / "README.md").read_text() == "my own card\n"
    assert write_model_card(folder, {"kind": "merge"}, overwrite=True)
    assert "tui-merger" in (folder / "README.md").read_text()


def test_export_adapter_output_verifies(pair, tmp_path):
    base, _, adapter = pair
    _, manifest, report = _merge(base, adapter, tmp_path / "exported", export_adapter=True)
    assert report.passed


@pytest.mark.parametrize(
    "opts, dtype",
    [
        (dict(lora=True), None),
        (dict(lora=True), "bf16"),  # every weight rounded from the fp32 checkpoint, not only merged ones
        (dict(critic=True), None),  # one output per token: compared by relative difference, not KL
        (dict(tied=True), "bf16"),
    ],
    ids=["lora-fp32", "lora-bf16", "critic", "tied-bf16"],
)
def test_fsdp_checkpoints_verify_against_their_own_weights(tmp_path_factory, tmp_path, opts, dtype):
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, **opts)
    options = MergeOptions(checkpoint=Path(info["checkpoint_dir"]), out=tmp_path / "out", dtype=dtype)
    result = run_merge(options, fsync=False)
    manifest, report = finish_merge(options, result, fsync=False)
    assert _statuses(report) == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, report.to_dict()
    assert manifest["inputs"][0]["role"] == "checkpoint"
    assert any(f["path"].startswith("model_world_size_") for f in manifest["inputs"][0]["files"])
    assert manifest["kind"] == ("merge" if opts.get("lora") else "convert")
    if opts.get("critic"):
        assert "no second model is built" in report.checks[2].summary  # a conversion: loaded once
    if opts.get("lora") and dtype is None:
        # the same model verified against the independent reference base + adapter folders
        ref = verify_merge(
            options.out,
            MergeOptions(base=Path(info["reference_base"]), adapter=Path(info["reference_adapter"]), out=options.out, dtype=result_dtype(options.out)),
        )
        assert ref.checks[2].status == "pass", ref.to_dict()


def test_a_wrong_value_in_a_checkpoint_converted_to_bf16_is_found(tmp_path_factory, tmp_path):
    """Every weight of an fp32 FSDP checkpoint rounded to bf16: one value sign-flipped in the output
    (a weight no adapter touches) fails the recompute, which rounds the checkpoint's rank shards a
    block of rows at a time, and names the tensor and the count."""
    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, tied=True)
    options = MergeOptions(checkpoint=Path(info["checkpoint_dir"]), out=tmp_path / "out", dtype="bf16")
    run_merge(options, fsync=False)
    assert _statuses(verify_merge(options.out, options, behaviour=False)) == {"structure": "pass", "recompute": "pass"}
    name = "model.layers.1.mlp.down_proj.weight"

    def flip(tensors):
        w = tensors[name]
        i = int(w.float().abs().argmax())
        w.view(-1)[i] = -w.view(-1)[i]

    _rewrite(options.out, flip)
    recompute = verify_merge(options.out, options, behaviour=False).checks[1]
    assert recompute.status == "fail"
    assert recompute.details[0].startswith(f"{name}: 1 of ") and "differ from the checkpoint" in recompute.details[0]


def result_dtype(out: Path) -> str:
    return json.loads((out / "config.json").read_text())["dtype"]


def test_verify_cli_reads_the_manifest_and_sets_the_exit_code(merged, pair, tmp_path, capsys):
    options = merged[0]
    assert cli_main(["verify", str(options.out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True
    base_q = load_file(pair[0] / "model.safetensors")[Q]
    bad = _faulty_copy(merged, tmp_path, lambda t: t.__setitem__(Q, base_q))
    assert cli_main(["verify", str(bad)]) == 4
    text = capsys.readouterr().out
    assert "FAILED" in text and "Do not ship it" in text
    assert read_manifest(bad)["verification"]["passed"] is False


def test_verify_without_manifest_asks_for_the_inputs(merged, tmp_path, capsys):
    bad = tmp_path / "copy"
    shutil.copytree(merged[0].out, bad)
    (bad / MANIFEST_NAME).unlink()
    assert cli_main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "no readable merge_manifest.json" in err and "--base and --adapter" in err
    assert cli_main(["verify", str(bad), "--base", str(merged[0].base), "--adapter", str(merged[0].adapter), "--no-behaviour"]) == 0
    assert "not recorded" in capsys.readouterr().err


def test_verify_keeps_a_hand_written_card_unless_asked(merged, tmp_path):
    folder = shutil.copytree(merged[0].out, tmp_path / "copy")
    (folder / "README.md").write_text("my card\n")
    assert cli_main(["verify", str(folder), "--no-behaviour"]) == 0
    assert (folder / "README.md").read_text() == "my card\n"
    assert cli_main(["verify", str(folder), "--no-behaviour", "--rewrite-card"]) == 0
    assert "## Verification" in (folder / "README.md").read_text()


def test_perplexity_on_a_text_file(tmp_path, capsys):
    from tui_merger.demo import build_demo

    base, adapter = build_demo(tmp_path / "ws")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    code = cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "m"), "--plain", "--perplexity", str(text)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS  perplexity" in out
    ver = read_manifest(tmp_path / "m")["verification"]
    ppl = next(c for c in ver["checks"] if c["name"] == "perplexity")["metrics"]
    assert abs(ppl["merged"] - ppl["reference"]) < 0.5 and ppl["tokens"] > 100


def test_the_behaviour_check_holds_at_most_two_layers_of_weights(merged, monkeypatch):
    """Counted by torch, not by the streaming code: at every module call and at every torch
    function call (a TorchFunctionMode) the parameter values present (held in memory) in the
    running models are summed, plus the weight tensors the call itself is given (its tensor arguments
    after the input; a layer computed piecewise passes its weight block by block to torch.mm)."""
    from torch.overrides import TorchFunctionMode

    import tui_merger.core.verify.streaming as streaming

    models, peak = [], [0]
    original_call = streaming.Streamer.__call__

    def held(p) -> bool:  # its values in memory: not on meta, not a stand-in (one NaN expanded to its shape)
        return p.device.type != "meta" and p.untyped_storage().nbytes() >= p.numel() * p.element_size()

    def present() -> int:
        return sum(p.numel() for m in models for p in m.parameters() if held(p) and "lora_" not in _name_of(m, p))

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.nn.functional.linear, torch.nn.functional.embedding, torch.mm):
                weights = args[:1] if func is torch.mm else args[1:]  # mm(weight block, tokens^T)
                given = sum(a.numel() for a in weights if isinstance(a, torch.Tensor) and a.dim() >= 1)
                peak[0] = max(peak[0], present() + given)
            return func(*args, **(kwargs or {}))

    def call(self, *args, **kwargs):
        models.append(self.model)
        with Count():
            return original_call(self, *args, **kwargs)

    def count(module, args):
        peak[0] = max(peak[0], present())

    monkeypatch.setattr(streaming.Streamer, "__call__", call)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        report = _verify_against(merged[0], Path(merged[0].out))
    finally:
        handle.remove()
    assert report.checks[2].status == "pass"
    cfg = qwen_config()
    tensors = load_file(Path(merged[0].out) / "model.safetensors")
    layer = sum(v.numel() for k, v in tensors.items() if k.startswith("model.layers.0."))
    largest = max([layer] + [v.numel() for k, v in tensors.items() if ".layers." not in k])
    assert 0 < peak[0] <= 2 * largest, (peak[0], largest)
    whole = sum(v.numel() for v in tensors.values())
    assert peak[0] < whole / 2 and cfg.num_hidden_layers >= 2


def test_the_unmerged_reference_holds_no_adapter_weight_in_memory(pair):
    """A plain LoRA's weights stream from the adapter file like the base's (peft builds its layers on
    the meta device); the reference still equals peft's own: see the behaviour checks above."""
    import transformers

    from tui_merger.core.formats.hf_names import model_class
    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour

    base, _, adapter = pair
    config = json.loads((base / "config.json").read_text())
    source = open_model(base)
    try:
        streamer, missing = behaviour.streamer_with_adapter(
            model_class(config), transformers.AutoConfig.from_pretrained(base), source.tensors, [(adapter, None)], "reference")
        lora = {n: w for n, w in streamer.weights.items() if ".lora_" in n}
        assert missing == [] and len(lora) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
        assert all(w.held is None and w.ref is not None for w in lora.values())
        # no parameter holds its values between passes (each is a one-value stand-in)
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in streamer.model.parameters())
        streamer.close()
    finally:
        source.close()


def _name_of(model, param) -> str:
    return next((n for n, p in model.named_parameters() if p is param), "")


def test_hash_cache_reuses_unchanged_files_and_notices_changes(tmp_path):
    from tui_merger.core.record.manifest import describe_files

    folder = tmp_path / "f"
    folder.mkdir()
    big = folder / "big.bin"
    big.write_bytes(b"a" * (2 << 20))
    first = describe_files(folder, ["big.bin"])[0]["sha256"]
    assert first == hashlib.sha256(big.read_bytes()).hexdigest()
    cache = json.loads((tmp_path / "state" / "tui-merger" / "hashes.json").read_text())
    st = big.stat()
    assert cache[f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"] == first
    with open(big, "r+b") as f:  # same size, new content: a new ctime, so hashed again
        f.write(b"b")
    again = describe_files(folder, ["big.bin"])[0]["sha256"]
    assert again == hashlib.sha256(big.read_bytes()).hexdigest() != first


def test_merge_no_behaviour_skips_loading_the_models(pair, tmp_path, capsys):
    base, _, adapter = pair
    out = tmp_path / "quick"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", "--no-behaviour"]) == 0
    said = capsys.readouterr().out
    assert "PASS  recompute" in said and "  behaviour:" not in said
    assert [c["name"] for c in read_manifest(out)["verification"]["checks"]] == ["structure", "recompute"]


def test_merging_again_into_an_unverified_output_verifies_it_or_says_how_to_check_it(pair, tmp_path, capsys):
    base, other, adapter = pair
    out = tmp_path / "stopped"
    options = MergeOptions(base=base, adapter=adapter, out=out)
    run_merge(options, fsync=False)  # stopped before recording and verifying (a kill -9)
    assert (out / ".tui-merger-unverified.json").is_file()
    # another merge into it is refused, with the way to check what is there
    assert cli_main(["merge", "--base", str(other), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 1
    err = capsys.readouterr().err
    assert "never verified" in err and f"tui-merger verify {out}" in err
    # the same merge again keeps the model and verifies it
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 0
    said = capsys.readouterr()
    assert "kept and verified now" in said.out + said.err and "PASS  behaviour" in said.out
    assert read_manifest(out)["verification"]["passed"] is True


@pytest.mark.parametrize("edit", ["options-of-wrong-type", "verification-not-an-object"])
def test_verify_with_an_edited_manifest_asks_for_the_inputs(merged, tmp_path, capsys, edit):
    """A manifest edited by hand into other types: one sentence that asks for the inputs, no traceback
    (before, a string as verification crashed the model card, a string as an option crashed later)."""
    bad = tmp_path / "copy"
    shutil.copytree(merged[0].out, bad)
    manifest = json.loads((bad / MANIFEST_NAME).read_text())
    if edit == "options-of-wrong-type":
        manifest["options"]["shard_size"] = [5]
        said = "The option shard_size is [5], not a size"
    else:
        manifest["verification"] = "passed"
        said = "no readable merge_manifest.json"
    (bad / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert cli_main(["verify", str(bad)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and said in lines[0] and "--base and --adapter" in lines[0] and "Traceback" not in err, err


def test_cancel_stops_the_behaviour_check_between_layers(merged):
    """Cancel (the TUI's button, Ctrl-C in the CLI) is checked before every module's weights are read."""
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken, TensorProgress

    options = merged[0]
    cancel = CancelToken()
    seen = []

    def on_event(event):
        if isinstance(event, TensorProgress) and event.name.startswith("merged model: "):
            seen.append(event.name)
            cancel.cancel()  # after the first module of the merged model has run

    with pytest.raises(MergeCancelled):
        verify_merge(Path(options.out), MergeOptions(base=options.base, adapter=options.adapter, out=options.out),
                     on_event=on_event, cancel=cancel)
    assert len(seen) == 1


def test_custom_model_code_skips_the_behaviour_check_and_says_not_fully_verified(merged, tmp_path, capsys):
    """An architecture that is not a transformers class (custom code, which tui-merger never runs): the
    behaviour check is skipped with its reason, the report says so, and the files and tensors still count."""
    folder = shutil.copytree(merged[0].out, tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["TinyCustomForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    options = merged[0]
    report = verify_merge(folder, MergeOptions(base=options.base, adapter=options.adapter, out=folder))
    assert _statuses(report) == {"structure": "pass", "recompute": "pass", "behaviour": "skip"}
    assert "custom code" in report.checks[2].summary
    assert report.passed and "not fully verified (behaviour skipped)" in report.summary
    assert cli_main(["verify", str(folder), "--base", str(options.base), "--adapter", str(options.adapter)]) == 0
    said = capsys.readouterr().out
    assert "SKIP  behaviour" in said and "Not fully verified: the behaviour check did not run" in said


# -- the recompute made while the merge writes ------------------------------------------------------


def _spy_checks(monkeypatch) -> list:
    """(thread name, tensor name) of every tensor the recompute checks."""
    import threading

    import tui_merger.core.verify.recompute as recompute

    seen = []
    real = recompute._check_tensor

    def spy(t, ref, clamp):
        seen.append((threading.current_thread().name, t.name))
        return real(t, ref, clamp)

    monkeypatch.setattr(recompute, "_check_tensor", spy)
    return seen


def _recompute_check(out: Path) -> dict:
    return next(c for c in read_manifest(out)["verification"]["checks"] if c["name"] == "recompute")


def test_every_tensor_is_recomputed_while_the_merge_writes_it(pair, tmp_path, monkeypatch):
    """The default merge recomputes each tensor on its own thread as soon as the engine has written
    it; verification reuses those results (once each) and recomputes nothing again."""
    seen = _spy_checks(monkeypatch)
    base, _, adapter = pair
    out = tmp_path / "m"
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", "--shard-size", "100KB"]
    assert cli_main(args) == 0
    check = _recompute_check(out)
    tensors = check["metrics"]["tensors"]
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert check["status"] == "pass" and check["metrics"]["checked_while_writing"] == tensors
    assert sorted(name for _, name in seen) == sorted({name for _, name in seen})  # none twice
    assert len(seen) == tensors and {thread for thread, _ in seen} == {"tui-merger-recompute"}


def test_a_wrong_tensor_the_engine_writes_is_caught_while_it_writes(pair, tmp_path, monkeypatch, capsys):
    """An engine bug (a merged tensor with the adapter's sign flipped) is found by the recompute made
    during the merge, which reads the bytes back from the shard, and the merge is not called verified."""
    import tui_merger.core.merge.engine as engine
    import tui_merger.core.merge.merge_math as merge_math

    seen = _spy_checks(monkeypatch)
    real = engine.compute
    real_blocks = merge_math.RowBlocks.__iter__

    def wrong(t, **kw):  # a tensor computed whole
        tensor = real(t, **kw)
        if t.name == Q:
            base_q = t.source.load().to(tensor.dtype)
            tensor = (2 * base_q.float() - tensor.float()).to(tensor.dtype)
        return tensor

    def wrong_blocks(self):  # a tensor streamed to its shard a block of rows at a time
        for i, j, acc in real_blocks(self):
            if self.t.name == Q:
                acc.mul_(-1).add_(self.w[i:j].float(), alpha=2)
            yield i, j, acc

    monkeypatch.setattr(engine, "compute", wrong)
    monkeypatch.setattr(merge_math.RowBlocks, "__iter__", wrong_blocks)
    base, _, adapter = pair
    out = tmp_path / "m"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) == 4  # verification failed
    capsys.readouterr()
    check = _recompute_check(out)
    assert check["status"] == "fail" and check["details"][0].startswith(Q + ":")
    assert ("tui-merger-recompute", Q) in seen and [name for _, name in seen].count(Q) == 1


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_shard_changed_after_it_was_checked_is_recomputed(pair, tmp_path, how):
    """A result made while writing counts only for the very file it read: a shard edited in place
    (same inode, new mtime) or replaced by another file is recomputed, and the planted fault found."""
    from tui_merger.core.verify.checks import prewarming

    base, _, adapter = pair
    options = MergeOptions(base=base, adapter=adapter, out=tmp_path / "m")
    run_merge(options, prewarming(options, lambda event: None, behaviour=False), fsync=False)
    path = Path(options.out) / "model.safetensors"
    if how == "in place":
        raw = path.read_bytes()
        header = 8 + int.from_bytes(raw[:8], "little")
        start = json.loads(raw[8:header])[Q]["data_offsets"][0]
        with open(path, "r+b") as f:  # the sign bit of Q's first value
            f.seek(header + start + 1)
            f.write(bytes([raw[header + start + 1] ^ 0x80]))
    else:
        _rewrite(Path(options.out), lambda t: t.__setitem__(Q, -t[Q]))
    report = verify_merge(Path(options.out), options, behaviour=False)
    recompute = report.checks[1]
    assert recompute.status == "fail" and recompute.details[0].startswith(Q + ":")
    assert recompute.metrics["checked_while_writing"] == 0


def test_a_cancelled_merge_leaves_no_recompute_running(pair, tmp_path):
    """Cancel during the merge: the partial output is removed, and the recompute thread, which held
    the partial shards open, stops and closes them (their space is given back)."""
    import threading
    import time

    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken, TensorProgress
    from tui_merger.core.verify.checks import prewarming

    base, _, adapter = pair
    options = MergeOptions(base=base, adapter=adapter, out=tmp_path / "m", shard_size="200KB")
    cancel = CancelToken()
    partial = set()

    def on_event(event):
        if isinstance(event, TensorProgress) and event.tensors_done == 12:
            for shard in (tmp_path / ".m.tui-merger-partial").glob("*.safetensors"):
                st = shard.stat()
                partial.add((st.st_dev, st.st_ino))
            cancel.cancel()

    with pytest.raises(MergeCancelled):
        run_merge(options, prewarming(options, on_event, behaviour=False), cancel, fsync=False)
    assert not (tmp_path / "m").exists()
    deadline = time.monotonic() + 10
    while any(t.name == "tui-merger-recompute" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(t.name == "tui-merger-recompute" for t in threading.enumerate())
    fds = Path("/proc/self/fd")
    assert partial
    if fds.is_dir():  # no descriptor of the removed partial shards is left open (their space is back)
        held = set()
        for fd in fds.iterdir():
            try:
                st = fd.stat()
                held.add((st.st_dev, st.st_ino))
            except OSError:
                pass
        assert not partial & held


def test_the_shards_are_hashed_while_they_are_written(pair, tmp_path, monkeypatch):
    """The manifest's sha256 of every shard is the file's (hashlib over the bytes on disk), and no
    shard is read again to hash it after it was written: the digest is taken while writing."""
    import hashlib

    import tui_merger.core.merge.journal as journal
    import tui_merger.core.record.manifest as manifest

    monkeypatch.setattr(manifest._HashCache, "MIN_SIZE", 0)  # the tiny shards are cached like big ones
    read_again = []
    for module in (journal, manifest):
        real = module.sha256_file

        def spy(path, real=real):
            read_again.append(Path(path).name)
            return real(path)

        monkeypatch.setattr(module, "sha256_file", spy)
    base, _, adapter = pair
    out = tmp_path / "m"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain",
                     "--shard-size", "100KB", "--no-verify"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    recorded = {f["path"]: f["sha256"] for f in read_manifest(out)["outputs"]}
    for name in shards:
        assert recorded[name] == hashlib.sha256((out / name).read_bytes()).hexdigest(), name
    assert not [name for name in read_again if name in shards]



def test_a_failed_merge_leaves_nothing_reading_its_inputs(pair, tmp_path, monkeypatch, capsys):
    """When the merge fails part way, the threads started for its verification (the recompute
    made while writing, the unmerged reference's run) are stopped and waited for before the error is
    said: the user may now replace an input, and a file truncated under a mapping that a thread
    still reads kills the process (SIGBUS)."""
    import threading

    import tui_merger.core.merge.engine as engine
    from tui_merger.core.errors import MergeError

    count = []

    def failing(real):
        def call(t, *args, **kw):  # the 8th tensor computed, whole (compute) or streamed (row_blocks)
            count.append(t.name)
            if len(count) == 8:
                raise MergeError("planted: this input cannot be read")
            return real(t, *args, **kw)

        return call

    monkeypatch.setattr(engine, "compute", failing(engine.compute))
    monkeypatch.setattr(engine, "row_blocks", failing(engine.row_blocks))
    base, _, adapter = pair
    out = tmp_path / "m"
    assert cli_main(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain"]) != 0
    assert "planted: this input cannot be read" in capsys.readouterr().err
    alive = [t.name for t in threading.enumerate() if t.name in ("tui-merger-recompute", "tui-merger-prewarm")]
    assert alive == [] and not out.exists()
    import gc

    assert gc.get_freeze_count() == 0 and gc.isenabled()  # what was frozen for the verification is not left so


def test_a_tensor_read_while_writing_stays_readable_after_its_range_is_closed(tmp_path):
    """torch.frombuffer holds no buffer export, so closing an mmap under a live tensor unmaps its
    memory (a crash on the next read); MappedRange.close hands the pages back and leaves the
    unmapping to the last view."""
    import os

    from tui_merger.core.io.mapped import MappedRange

    path = tmp_path / "data.bin"
    values = torch.arange(5000, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = MappedRange(fd, 4096, 4 * 1000)
        view = mapped.view("float32", (1000,))
        mapped.close()
        assert torch.equal(view.clone(), values[1024:2024])
    finally:
        os.close(fd)


def test_a_tensor_viewed_from_a_mapped_file_stays_readable_after_the_file_is_closed(tmp_path):
    """The same for whole-file mappings (every TensorSource's): a tensor still in use when its
    source is closed (a module's weight, a cached view) must read its values, not crash the process.
    Run in a child process, since the failure is a segfault."""
    import subprocess
    import sys

    path = tmp_path / "data.bin"
    torch.arange(5000, dtype=torch.float32).numpy().tofile(path)
    script = (
        "import torch, sys\n"
        "from tui_merger.core.io.mapped import MappedFile\n"
        f"m = MappedFile({str(path)!r})\n"
        "view = m.view('float32', 1000, 4096)\n"
        "m.close()\n"
        "assert torch.equal(view.clone(), torch.arange(1024, 2024, dtype=torch.float32))\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_mapped_pages_are_populated_and_handed_back_without_holding_the_gil(tmp_path):
    """populate() maps a range in one call and release() drops it, through libc's madvise (ctypes
    lets the merge's other threads run meanwhile; mmap.madvise held the GIL for the whole call)."""
    from tui_merger.core.io import mapped

    def rss_file() -> int:
        text = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in text.splitlines() if line.startswith("RssFile:"))) << 10

    size = 64 << 20
    path = tmp_path / "pages.bin"
    path.write_bytes(b"\x01" * size)
    assert mapped._libc_madvise() is not None  # Linux: the ctypes path is the one taken
    m = mapped.MappedFile(path)
    try:
        m.view("uint8", 1, 0)  # the mapping exists, nothing of it read yet
        before = rss_file()
        m.populate(0, size)
        populated = rss_file()
        assert populated - before > size // 2
        m.release()
        m.flush()
        assert populated - rss_file() > size // 2
    finally:
        m.close()


def _recompute_blocks(tmp_path, monkeypatch, base_dtype=torch.float32, block_values=None, **adapter_kw):
    """Merge, then verify with the recompute only, spying on its blocks: [(rows, slow)] where slow
    means the block was not the output's bits at once (it took the tolerance path)."""
    from tui_merger.core.verify import recompute

    base = save_base(tmp_path / "base", config=qwen_config(), dtype=base_dtype)
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=ALL_LINEAR, **adapter_kw)
    options = MergeOptions(base=base, adapter=adapter, out=tmp_path / "out")
    run_merge(options, fsync=False)
    if block_values is not None:
        monkeypatch.setattr(recompute, "BLOCK_VALUES", block_values)
    blocks = []
    checked = recompute._compare

    def counting(got, want, magnitude=None):
        blocks.append((got.shape[0], not recompute._bits_equal(got, want.to(got.dtype))))
        return checked(got, want, magnitude)

    monkeypatch.setattr(recompute, "_compare", counting)
    report = verify_merge(options.out, options, behaviour=False)
    assert _statuses(report) == {"structure": "pass", "recompute": "pass"}
    return blocks


def test_a_scale_that_is_no_power_of_two_is_recomputed_in_the_merges_order(tmp_path, monkeypatch):
    """lora_alpha / r = 1.5: the recompute multiplies B @ A by the scale and then adds W, as peft
    and the merge do, so every block equals the output's bits at once. Fused into one addmm, about
    one value in a thousand landed one unit apart and each such block took the slow tolerance path
    (a 3B merge's verification 2x slower); the check passed either way, so this counts those blocks."""
    blocks = _recompute_blocks(tmp_path, monkeypatch, torch.bfloat16, r=8, lora_alpha=12)
    assert [b for b in blocks if b[1]] == []


def test_no_row_is_recomputed_alone(tmp_path, monkeypatch):
    """The recompute never makes a block of one row where a tensor has more: BLAS computes a one-row
    product with its matrix-vector kernel, whose sums land an fp32 unit off the whole-matrix product
    the merge (and peft) took, and every such row went down the slow tolerance path. fp32 weights
    show every difference; blocks of 3 rows leave one of a 64-row weight over."""
    blocks = _recompute_blocks(tmp_path, monkeypatch, block_values=3 * 64)
    if small_blocks_exact():  # else this CPU's BLAS computes 2-3 row blocks with another kernel anyway
        assert [b for b in blocks if b[1]] == []
    rows = [b[0] for b in blocks]
    assert 3 in rows and 4 in rows and 1 not in rows  # the row left over joined the last block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_finiteness_test_agrees_with_isfinite(dtype):
    """The recompute's test for NaN and Inf (a sum first, the exact test when the sum is not finite)
    against torch.isfinite: one bad value anywhere, of either sign, is found; finite values whose
    sum overflows are not called bad."""
    from tui_merger.core.verify.recompute import _finite

    big = torch.finfo(dtype).max
    x = torch.randn(4097).to(dtype)
    cases = [x, torch.full((1000,), big, dtype=dtype), torch.tensor([big, -big, big], dtype=dtype)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 2048, 4096):
            y = x.clone()
            y[where] = bad
            cases.append(y)
    y = torch.full((1000,), big, dtype=dtype)
    y[500] = float("-inf")  # a sum of +inf and -inf: NaN, still not finite
    cases.append(y)
    for case in cases:
        assert _finite(case) == bool(torch.isfinite(case).all())


def test_the_dora_reference_takes_b_times_a_without_peft_identity_matrix(tmp_path):
    """The reference's DoRA layers get B @ A as the product of the two weights instead of peft's run
    of lora_A and lora_B over an identity as wide as the layer's input (484 MB for a 3B down_proj):
    every one of them uses it, and it equals peft's own ``get_lora_weight`` on the same weights."""
    import transformers
    from peft.tuners.lora.dora import DoraLinearLayer

    from tui_merger.core.formats.hf_names import model_class
    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour

    base = save_base(tmp_path / "base", config=qwen_config())
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=["q_proj", "down_proj"], use_dora=True)
    config = json.loads((base / "config.json").read_text())
    source = open_model(base)
    try:
        streamer, _ = behaviour.streamer_with_adapter(
            model_class(config), transformers.AutoConfig.from_pretrained(base), source.tensors, [(adapter, None)], "reference")
        doras = [(n, m) for n, m in streamer.model.named_modules() if type(m) is DoraLinearLayer]
        assert len(doras) == 2 * 2
        for name, dora in doras:
            assert "get_lora_weight" in vars(dora), name
            lora = streamer.model.get_submodule(name.rsplit(".lora_magnitude_vector", 1)[0])
            a, b = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
            g = torch.Generator().manual_seed(len(name))
            a.weight = torch.nn.Parameter(torch.randn(lora.r["default"], lora.in_features, generator=g))
            b.weight = torch.nn.Parameter(torch.randn(lora.out_features, lora.r["default"], generator=g))
            with torch.no_grad():
                ours = dora.get_lora_weight(lora_A=a, lora_B=b, adapter_name="default")
                peft = DoraLinearLayer.get_lora_weight(dora, lora_A=a, lora_B=b, adapter_name="default")
            torch.testing.assert_close(ours, peft, rtol=1e-6, atol=1e-6)
        streamer.close()
    finally:
        source.close()


def test_the_plan_states_a_longer_verification_for_dora(tmp_path, monkeypatch):
    """The plan's verification estimate counts the reference's DoRA layers (peft's DoRA forward takes
    W + s * B @ A and its norm whole; 3B, all linear kinds: 29-32 s against 12 s for plain LoRA):
    the same base and targets with DoRA are stated as longer, by the cost per value of the DoRA'd
    weights (made large here: a tiny model's weights cost milliseconds, below the plan's rounding)."""
    from tui_merger.core.plan.preflight import make_plan
    from tui_merger.core.verify import behaviour

    monkeypatch.setattr(behaviour, "DORA_S_PER_VALUE", 1e-3)
    base = save_base(tmp_path / "base", config=qwen_config())
    plans = {}
    for dora in (False, True):
        adapter = save_adapter(tmp_path / f"adapter-{dora}", base, target_modules=["q_proj", "down_proj"], use_dora=dora)
        plans[dora] = make_plan(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    dora_values = sum(load_base(base).get_submodule(f"model.layers.{i}.{m}").weight.numel()
                      for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj"))
    extra = plans[True].verify_seconds - plans[False].verify_seconds
    assert extra > 1 and extra == pytest.approx(behaviour.DORA_S_PER_VALUE * dora_values, abs=0.11)
    assert plans[True].verify_bytes >= plans[False].verify_bytes


def test_shards_finishing_at_once_all_keep_their_hash(tmp_path, monkeypatch):
    """Each finished shard's digest goes into the hash cache from its own thread, and from other
    processes too: none may overwrite another's entry (a lost one made the manifest read a shard again)."""
    import multiprocessing
    import threading

    import tui_merger.core.record.manifest as manifest

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # seen by the other processes too
    files = []
    for i in range(24):
        files.append(tmp_path / f"shard-{i}")
        files[-1].write_bytes(bytes([i]) * manifest._HashCache.MIN_SIZE)  # cached: large enough
    threads = [threading.Thread(target=manifest.remember_hash, args=(f, f"digest-{f.name}")) for f in files[:16]]
    others = [multiprocessing.get_context("spawn").Process(target=manifest.remember_hash, args=(f, f"digest-{f.name}"))
              for f in files[16:]]
    for t in threads + others:
        t.start()
    for t in threads + others:
        t.join()
    cache = manifest._HashCache()
    assert sorted(cache.entries.get(cache._key(f)) for f in files) == sorted(f"digest-{f.name}" for f in files)
