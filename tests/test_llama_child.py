"""llama.cpp's side of the GGUF and mmproj checks runs in a child process (core/ship/llama_child.py): llama.cpp aborts
its process on a failed assert, and that must not end tui-merger.

CI has no llama.cpp, so the child is made to stop where llama.cpp would (TUI_MERGER_TEST_LLAMA_ABORT: it writes the
message on its C stderr and calls abort(), as ggml_abort does): a real child process, killed by a real SIGABRT; the
test proves the parent survives and the verdict is the one sentence with llama.cpp's message.
"""

from __future__ import annotations

import importlib.util
import json
import signal

import pytest

from tui_merger.core.ship import gguf_check
from tui_merger.core.ship.llama_child import LlamaStopped, run

ASSERT = "/src/llama.cpp/ggml/src/ggml-cpu/ops.cpp:5555: GGML_ASSERT(sect_dims <= ne0) failed"
HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None


def test_a_child_aborted_by_llama_cpp_is_one_failed_sentence_and_the_app_lives(tmp_path, monkeypatch):
    """check_gguf on a real tiny model and its real GGUF; the child aborts where llama.cpp runs the file: FAILED, said
    as llama.cpp's stop with its assert, and this process goes on (it is the one asserting here)."""
    from test_gguf_families import make_family

    from tui_merger.core.ship.gguf import export_gguf

    folder = make_family(tmp_path / "m", "qwen2")
    made = export_gguf(folder, "f16", tmp_path / "m.gguf")
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.0-test")  # CI has none: the child stops before its import
    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_ABORT", ASSERT)
    verdict = gguf_check.check_gguf(folder, made.path, "f16", reader="llama.cpp")
    assert verdict.status == gguf_check.FAILED and verdict.reader == "llama.cpp (llama-cpp-python 0.0-test)"
    assert verdict.summary == ("llama.cpp stopped while running m.gguf (ops.cpp:5555: GGML_ASSERT(sect_dims <= ne0) failed, "
                               "SIGABRT): llama.cpp cannot run this file."), verdict.summary
    assert verdict.line().startswith("FAILED: llama.cpp stopped")


def test_a_child_killed_from_outside_says_nothing_of_the_file(tmp_path, monkeypatch):
    """SIGKILL (the system's out-of-memory killer) is not llama.cpp's verdict on the file: not checked, said why."""
    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_ABORT", "SIGKILL")
    with pytest.raises(LlamaStopped) as stop:
        run({"kind": "text"})
    assert not stop.value.crashed and stop.value.why == "SIGKILL"
    ref = gguf_check._Reference(texts=["a"], ids=[[1]], special=[True], prompt=[1, 2], logits=None, add_bos=False)
    said, reader = gguf_check._with_llama_cpp(tmp_path / "m.gguf", ref)
    assert reader is None and said == "the llama.cpp process running m.gguf ended before it answered (SIGKILL).", said


def test_the_image_check_stops_in_the_child_too(tmp_path, monkeypatch):
    """The mmproj check's libmtmd part runs in the child: its abort reaches the caller as LlamaStopped, with the
    message without the source's folders, and the sentence check_mmproj gives."""
    import numpy as np

    from tui_merger.core.ship.gguf_mmproj import _llama_cpp_image

    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_ABORT", "/tmp/pip-x/tools/mtmd/clip.cpp:4509: Failed to get tensor window_mask")
    with pytest.raises(LlamaStopped) as stop:
        _llama_cpp_image(tmp_path / "t.gguf", tmp_path / "mmproj-t-F16.gguf", np.zeros((4, 4, 3), dtype=np.uint8))
    assert stop.value.crashed and stop.value.why == "clip.cpp:4509: Failed to get tensor window_mask, SIGABRT"
    assert stop.value.sentence("encoding an image with mmproj-t-F16.gguf") == (
        "llama.cpp stopped while encoding an image with mmproj-t-F16.gguf (clip.cpp:4509: Failed to get tensor "
        "window_mask, SIGABRT): llama.cpp cannot run this file.")


@pytest.mark.skipif(HAS_LLAMA, reason="llama_cpp is installed here")
def test_without_llama_cpp_the_child_says_it_does_not_import(tmp_path):
    out, arrays = run({"kind": "text"})
    assert out["error"] == "import" and "llama_cpp" in out["message"] and arrays == {}


def test_qwen25vl_tower_without_window_attention_gets_the_text_gguf_and_a_sentence(tmp_path):
    """Root cause of llama.cpp's abort in clip_encode (clip.cpp: "Failed to get tensor window_mask"): a Qwen2.5-VL tower
    whose every block attends fully (fullatt_block_indexes [0]: window pattern 1) leaves llama.cpp's window mask out of
    its graph, and setting that input aborts. The mmproj is refused in one sentence; the text GGUF is written."""
    from test_gguf_vl_text import make_vl

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_mmproj import companion

    vl = make_vl(tmp_path / "vl", "qwen2_5_vl")  # its tower: one block, fullatt_block_indexes [0]
    assert json.loads((vl / "config.json").read_text())["vision_config"]["fullatt_block_indexes"] == [0]
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    events = []
    result = export_gguf(vl, "f16", tmp_path / "x.gguf", on_event=events.append, companion=companion)
    assert result.path.is_file() and result.mmproj is None and not list(tmp_path.glob("mmproj-*"))
    said = [e.message for e in events if isinstance(e, Notice) and "The mmproj file is not written" in e.message]
    assert said == ["The mmproj file is not written: every block of its vision tower attends fully (fullatt_block_indexes "
                    "[0]), and llama.cpp's qwen2.5vl tower stops on a tower without window-attention blocks."], said


def test_signals_llama_cpp_stops_itself_with_are_crashes():
    from tui_merger.core.ship.llama_child import _CRASHES

    assert signal.SIGABRT in _CRASHES and signal.SIGSEGV in _CRASHES and signal.SIGKILL not in _CRASHES


def _children() -> list[int]:
    """This process's llama_child processes still in the process table (a zombie included)."""
    import os
    from pathlib import Path

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"tui_merger.core.ship.llama_child" in cmdline:
            found.append(int(proc.name))
    return found


def _cancel_once_the_child_runs(cancel) -> dict:
    """A thread that sets ``cancel`` as soon as a llama_child child of this process exists; when, in its dict."""
    import threading
    import time

    when = {}

    def watch() -> None:
        for _ in range(600):
            if _children():
                time.sleep(0.3)  # running: inside "llama.cpp"
                when["cancel"] = time.monotonic()
                cancel.cancel()
                return
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()
    return when


def test_a_stop_ends_a_running_child_within_a_second(monkeypatch):
    """The child runs as long as a large llama.cpp run (it sleeps 30 s and ignores SIGTERM, as llama.cpp's C code
    does not answer it): the user's Stop ends it (SIGTERM, then SIGKILL) and reaches the caller as the engine's
    MergeCancelled within about a second; no child is left, not even a zombie."""
    import time

    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken

    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_SLEEP", "30")
    cancel = CancelToken()
    when = _cancel_once_the_child_runs(cancel)
    start = time.monotonic()
    with pytest.raises(MergeCancelled):
        run({"kind": "text"}, cancel=cancel)
    ended = time.monotonic()
    assert "cancel" in when and ended - when["cancel"] < 1.0, (ended - when["cancel"], ended - start)
    assert not _children()


def test_a_stop_during_the_llama_cpp_check_says_the_gguf_is_complete_and_not_checked(tmp_path, monkeypatch):
    """make_local on a real tiny model: Stop while llama.cpp's child runs the written GGUF. The child is ended within
    a second, the sentence says the file was written but is not checked (not the merge's "nothing was written"),
    the file is whole (llama.cpp's gguf library reads every tensor) and nothing is recorded as checked."""
    import time

    import gguf

    from test_gguf_families import make_family

    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken
    from tui_merger.core.ship.run_locally import make_local

    folder = make_family(tmp_path / "m", "qwen2")
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.0-test")  # CI has none: the child sleeps before its import
    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_SLEEP", "30")
    cancel = CancelToken()
    when = _cancel_once_the_child_runs(cancel)
    out = tmp_path / "m-F16.gguf"
    with pytest.raises(MergeCancelled) as stop:
        make_local(folder, "f16", out, check="llama.cpp", cancel=cancel)
    ended = time.monotonic()
    assert "cancel" in when and ended - when["cancel"] < 1.0, ended - when["cancel"]
    assert str(stop.value) == f"Stopped during the check: {out.absolute()} was written but is not checked.", str(stop.value)
    assert not _children()
    reader = gguf.GGUFReader(out)
    assert len(reader.tensors) > 0 and all(t.data.nbytes == t.n_bytes for t in reader.tensors)


def test_a_stop_after_the_mmproj_check_keeps_its_verdict_in_the_sentence(tmp_path, monkeypatch):
    """A Gemma 3 VL folder (as test_gguf_mmproj makes one): the mmproj's check has its verdict (here "not checked":
    no libmtmd), then Stop while llama.cpp's child runs the language model's GGUF; the sentence says the GGUF is not
    checked and the mmproj's check as it was, not "nothing was written"; the child is gone."""
    from test_gguf_vl_text import make_vl

    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken
    from tui_merger.core.ship.run_locally import make_local

    vl = make_vl(tmp_path / "vl", "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (vl / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    if HAS_LLAMA:
        pytest.skip("with llama.cpp here the mmproj's own check runs the child first")
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.0-test")  # the mmproj's: its mtmd binding does not import
    monkeypatch.setenv("TUI_MERGER_TEST_LLAMA_SLEEP", "30")
    cancel = CancelToken()
    when = _cancel_once_the_child_runs(cancel)
    with pytest.raises(MergeCancelled) as stop:
        make_local(vl, "f16", tmp_path / "vl-F16.gguf", check="llama.cpp", cancel=cancel)
    assert "cancel" in when
    assert str(stop.value) == (f"Stopped during the check: {tmp_path / 'vl-F16.gguf'} was written but is not checked "
                               "(mmproj-vl-F16.gguf beside it: mmproj check not checked)."), str(stop.value)
    assert (tmp_path / "mmproj-vl-F16.gguf").is_file() and not _children()
