"""The engine's contract with front ends: events, cancellation, the output folder, carried files."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from factory import qwen_config, read_output, save_adapter, save_base

from tui_merger.core import (
    CancelToken,
    MergeCancelled,
    MergeError,
    MergeFinished,
    MergeOptions,
    PhaseStarted,
    TensorProgress,
)
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.merge.output import PARTIAL_TAG


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    base = save_base(root / "base", qwen_config(), dtype=torch.bfloat16)
    adapter = save_adapter(root / "adapter", base, target_modules=["q_proj", "v_proj"])
    return base, adapter


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if PARTIAL_TAG in p.name]


def test_events_describe_the_whole_merge(pair, tmp_path):
    base, adapter = pair
    events = []
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"), events.append)
    phases = [e.phase for e in events if isinstance(e, PhaseStarted)]
    assert phases == ["plan", "merge", "files", "finalize"]
    progress = [e for e in events if isinstance(e, TensorProgress)]
    assert [p.tensors_done for p in progress] == list(range(1, len(progress) + 1))
    assert progress[-1].tensors_done == progress[-1].tensors_total == result.tensors_total
    assert progress[-1].bytes_done == progress[-1].bytes_total == result.bytes_written
    # bytes reported equal the tensor bytes actually in the files
    tensors = read_output(tmp_path / "out")
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == result.bytes_written
    assert isinstance(events[-1], MergeFinished) and events[-1].result is result


def test_cancel_between_tensors_leaves_nothing(pair, tmp_path):
    base, adapter = pair
    cancel = CancelToken()
    seen = []

    def on_event(event):
        if isinstance(event, TensorProgress):
            seen.append(event.name)
            if len(seen) == 3:
                cancel.cancel()

    with pytest.raises(MergeCancelled):
        run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"), on_event, cancel)
    assert len(seen) == 3  # stopped at the next tensor boundary
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_cancel_from_another_thread(pair, tmp_path):
    """A front end cancels from its UI thread while the merge runs in a worker thread."""
    base, adapter = pair
    cancel = CancelToken()
    reached = threading.Event()
    proceed = threading.Event()
    outcome = {}

    def on_event(event):
        if isinstance(event, TensorProgress) and event.tensors_done == 2:
            reached.set()
            proceed.wait(10)

    def worker():
        try:
            run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"), on_event, cancel)
        except MergeError as err:
            outcome["error"] = err

    thread = threading.Thread(target=worker)
    thread.start()
    assert reached.wait(30)
    cancel.cancel()
    proceed.set()
    thread.join(30)
    assert isinstance(outcome.get("error"), MergeCancelled)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_overwrite_replaces_a_previous_output(pair, tmp_path):
    base, adapter = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(MergeError, match="not empty"):
        run_merge(MergeOptions(base=base, adapter=adapter, out=out))
    assert (out / "stale.txt").read_text() == "old"
    run_merge(MergeOptions(base=base, adapter=adapter, out=out, overwrite=True))
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_empty_existing_output_folder_is_used(pair, tmp_path):
    base, adapter = pair
    (tmp_path / "out").mkdir()
    run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _with_tokenizer(folder, marker):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(20)}
    vocab["[UNK]"] = 20
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", chat_template=marker)
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def tokenized_pair(tmp_path_factory):
    """Built once: both tests only read it (each merges into its own tmp_path)."""
    root = tmp_path_factory.mktemp("tokenized")
    base = save_base(root / "base", qwen_config())
    adapter = save_adapter(root / "adapter", base, target_modules=["q_proj"])
    _with_tokenizer(base, "BASE-TEMPLATE")
    _with_tokenizer(adapter, "ADAPTER-TEMPLATE")
    return base, adapter


def _template(out):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out).chat_template


def test_tokenizer_comes_from_the_adapter_by_default(tokenized_pair, tmp_path):
    base, adapter = tokenized_pair
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    assert result.tokenizer_source == "adapter"
    assert _template(tmp_path / "out") == "ADAPTER-TEMPLATE"


def test_tokenizer_from_base_on_request(tokenized_pair, tmp_path):
    base, adapter = tokenized_pair
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out", tokenizer_from="base"))
    assert result.tokenizer_source == "base"
    assert _template(tmp_path / "out") == "BASE-TEMPLATE"


def test_no_tokenizer_is_reported_not_invented(pair, tmp_path):
    base, adapter = pair
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    assert result.tokenizer_source is None
    assert any("tokenizer" in w for w in result.warnings)
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert not names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"}


def test_config_generation_config_custom_code_and_licence_are_carried(tmp_path):
    base = save_base(tmp_path / "base", qwen_config())
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=["q_proj"])
    gen = json.loads((base / "generation_config.json").read_text())
    gen["temperature"] = 0.3
    gen["do_sample"] = True
    (base / "generation_config.json").write_text(json.dumps(gen))
    config = json.loads((base / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.Tiny"}
    (base / "config.json").write_text(json.dumps(config))
    for name in ("configuration_tiny.py", "modeling_tiny.py", "helpers_tiny.py"):
        (base / name).write_text(f"# {name}\n")
    (base / "LICENSE").write_text("licence text\n")
    out = tmp_path / "out"
    run_merge(MergeOptions(base=base, adapter=adapter, out=out, dtype="bf16"))
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.3
    out_config = json.loads((out / "config.json").read_text())
    assert out_config["auto_map"] == config["auto_map"]
    assert out_config["dtype"] == "bfloat16"
    for name in ("configuration_tiny.py", "modeling_tiny.py", "helpers_tiny.py", "LICENSE"):
        assert (out / name).read_text() == (base / name).read_text()


def test_auto_map_file_missing_is_refused(tmp_path):
    base = save_base(tmp_path / "base", qwen_config())
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=["q_proj"])
    config = json.loads((base / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_gone.Gone"}
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(MergeError, match="modeling_gone.py"):
        run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_alpha_uses_peft_default_and_warns(tmp_path):
    from factory import probe_ids, reference, logits_of

    base = save_base(tmp_path / "base", qwen_config())
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=["q_proj"], lora_alpha=8)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    assert any("lora_alpha" in w for w in result.warnings)
    probe = probe_ids()
    ref_logits, _, _ = reference(base, adapter, probe=probe)
    torch.testing.assert_close(logits_of(tmp_path / "out", probe), ref_logits, atol=1e-5, rtol=0)


def test_opening_inputs_pauses_the_cycle_collector_and_gives_it_back(pair, tmp_path):
    """open_inputs runs with the cyclic GC paused (a full collection over torch's objects cost 60-100 ms
    of an FSDP open) and restores it, after success and after a refusal alike; a caller that had it
    off keeps it off."""
    import gc

    from tui_merger.core.formats.inputs import open_inputs
    from tui_merger.core.options import MergeOptions

    base, adapter = pair
    seen = []
    real = open_inputs.__globals__["_open_inputs"]

    def spy(options):
        seen.append(gc.isenabled())
        return real(options)

    open_inputs.__globals__["_open_inputs"] = spy
    try:
        assert gc.isenabled()
        open_inputs(MergeOptions(base=base, adapter=adapter)).close()
        assert gc.isenabled() and seen == [False]
        with pytest.raises(MergeError):
            open_inputs(MergeOptions(base=base, adapter=tmp_path / "missing"))
        assert gc.isenabled()
        gc.disable()
        open_inputs(MergeOptions(base=base, adapter=adapter)).close()
        assert not gc.isenabled()
    finally:
        gc.enable()
        open_inputs.__globals__["_open_inputs"] = real
