"""The streamed model (one module's weights in memory at a time) computes what transformers' own
from_pretrained model computes, family by family: dense, tied, GPT-2's Conv1D, Llama, a Qwen3-MoE
whose experts are one tensor per expert on disk and packed in memory, a value model; and with the
vocabulary-sized layers computed piecewise. The reference is transformers loading the folder itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factory import gpt2_config, qwen_config, save_base

from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions
from tui_merger.core.io.sources import open_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"


def _llama(path: Path) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
    return save_base(path, cfg)


def _from_megatron(name: str, path: Path) -> Path:
    run_merge(MergeOptions(checkpoint=FIXTURES / name, out=path), fsync=False)
    return path


def _llama4(path: Path) -> Path:
    """Llama4's text model moves the probe tokens to ``embed_tokens.weight.device`` before calling the
    embedding: a weight left on the meta device there sent them to meta and both models came out zero."""
    from moe_families import build

    cls, config = build("llama4")
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    return path


MODELS = {
    "qwen2-untied": lambda p: save_base(p, qwen_config(tie_word_embeddings=False)),
    "qwen2-tied-bf16": lambda p: save_base(p, qwen_config(tie_word_embeddings=True), dtype=torch.bfloat16),
    "gpt2": lambda p: save_base(p, gpt2_config()),
    "llama": _llama,
    "qwen3-moe": lambda p: _from_megatron("qwen3moe_ep2", p),
    "qwen2-critic": lambda p: _from_megatron("qwen2_critic_tp2", p),
    "llama4": _llama4,
}


def _streamed(folder: Path, probes):
    import transformers

    from tui_merger.core.verify import behaviour
    from tui_merger.core.formats.hf_names import model_class

    config = json.loads((folder / "config.json").read_text())
    cls = model_class(config)
    source = open_model(folder)
    try:
        streamer, missing = behaviour.streamer_for_files(
            cls, transformers.AutoConfig.from_pretrained(folder), source.tensors, "model")
        assert missing == []
        logits, hidden = behaviour.run(streamer, probes)
        return cls, logits, hidden, streamer.stats
    finally:
        source.close()


@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "piecewise"])
@pytest.mark.parametrize("family", list(MODELS))
def test_streamed_model_equals_transformers_own(tmp_path, family, piecewise, monkeypatch):
    import tui_merger.core.verify.streaming as streaming

    folder = MODELS[family](tmp_path / family)
    if piecewise:  # every embedding and linear layer above 1000 values read in pieces of 700 values
        monkeypatch.setattr(streaming, "BIG_VALUES", 1000)
        monkeypatch.setattr(streaming, "BLOCK_VALUES", 700)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    probes = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    cls, logits, hidden, stats = _streamed(folder, probes)
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=probes, output_hidden_states=True)
    torch.testing.assert_close(logits, want.logits.float(), atol=1e-5, rtol=1e-5)
    assert len(hidden) == len(want.hidden_states)
    for got, expected in zip(hidden, want.hidden_states):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    whole = sum(p.numel() for p in model.parameters())
    assert 0 < stats.peak_live_values < whole / 2  # never the whole model at once


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def test_free_heap_memory_a_unit_leaves_is_handed_back():
    """A unit whose forward makes its own temporaries (peft's DoRA layer: several of a weight's size)
    leaves them free in glibc's arenas, resident; past HOARD_BYTES the streamer trims the heap. Here
    320 MB of 64 KiB blocks, written and freed (one kept above them, so that glibc cannot give the top
    back by itself), are resident until the check runs, and are not after it."""
    import ctypes

    from tui_merger.core.io import libc
    from tui_merger.core.verify import streaming

    if libc.heap_free_bytes() is None or libc.function("malloc_trim", "c_int", "c_size_t") is None:
        pytest.skip("no glibc mallinfo2 / malloc_trim here")
    c = ctypes.CDLL(None)
    c.malloc.restype = ctypes.c_void_p
    c.malloc.argtypes = [ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    size, count = 64 << 10, 5000
    blocks = [c.malloc(size) for _ in range(count)]
    keep = c.malloc(size)
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        c.free(b)
    try:
        before = _rss_anon()
        assert libc.heap_free_bytes() > streaming.HOARD_BYTES
        streaming._trim_if_hoarding()
        assert before - _rss_anon() > 200 << 20
        assert libc.heap_free_bytes() is not None
    finally:
        c.free(keep)


def test_reading_module_sources_from_two_threads_at_once_never_trips_the_parser():
    """The verification streams the merged model and the reference in two threads; both read module classes'
    source (``_reads_child_weights``), and CPython 3.11's parser run in two threads at once raised "SystemError: AST
    constructor recursion depth mismatch" (a CI failure on a Qwen2.5-VL verification). One source at a time."""
    import threading

    import torch
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    import tui_merger.core.verify.streaming as st

    classes = [c for c in vars(m).values()
               if isinstance(c, type) and c.__module__ == m.__name__ and issubclass(c, torch.nn.Module)]
    errors = []

    def work():
        for _ in range(10):
            st._SOURCES.clear()
            for cls in classes:
                module = cls.__new__(cls)
                torch.nn.Module.__init__(module)
                module.add_module("child", torch.nn.Linear(1, 1))
                try:
                    st._reads_child_weights(module)
                except SystemError as err:
                    errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
