"""The plain flow on an 80-column terminal (issue 32, item 10): its lines break between words ("abo / ut
1 s" was the terminal cutting them), continuation lines are indented under their text, menu lines are
wrapped rather than cut, and nothing is lost; a file or a pipe gets the lines whole. The dumb flow on
the demo's model and adapter, up to Review."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from factory import edit_adapter_config

from tui_merger.plain import run_plain, wrap_line, wrap_title

WIDTH = 80


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("COLUMNS", str(WIDTH))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    from tui_merger.demo import build_demo

    base, _ = build_demo(tmp_path_factory.mktemp("wrap") / "ws")
    return base.parent


@pytest.fixture
def ws(demo, tmp_path) -> Path:
    ws = tmp_path / "a-folder-with-a-rather-long-name" / "ws"
    shutil.copytree(demo / "base", ws / "base")
    shutil.copytree(demo / "adapter", ws / "adapter")
    edit_adapter_config(ws / "adapter", base_model_name_or_path=str(ws / "base"))
    return ws


def transcript(ws: Path, out) -> str:
    answers = io.StringIO("1\n\n10\n")  # the adapter, the output folder, Quit at Review
    assert run_plain(ws, input=answers, output=out, dumb=True) == 0, out.getvalue()
    return out.getvalue()


def test_lines_break_between_words_on_a_terminal_and_stay_whole_in_a_file(ws):
    wrapped = transcript(ws, Terminal())
    whole = transcript(ws, io.StringIO())
    assert " ".join(wrapped.split()) == " ".join(whole.split())  # the same words, nothing lost or split
    long_lines = [line for line in whole.splitlines() if len(line) >= WIDTH]
    assert any(line.startswith("  verify ") for line in long_lines)  # the plan's lines are wider than 80
    for line in wrapped.splitlines():
        assert len(line) < WIDTH or " " not in line.strip(), line  # only a single long word (a path) is wider
    lines = wrapped.splitlines()
    verify = next(i for i, line in enumerate(lines) if line.startswith("  verify "))
    assert lines[verify + 1].startswith(" " * 13) and not lines[verify + 1].startswith(" " * 14)  # under the text
    assert "Change the output folder (now" in wrapped  # the menu line wrapped, not cut


def test_wrapping_keeps_words_and_indents_under_the_label():
    line = "  verify     about 2 s and 558.44 MB of memory (every value recomputed; the models run layer by layer)"
    assert wrap_line(line, 79) == [
        "  verify     about 2 s and 558.44 MB of memory (every value recomputed; the",
        "             models run layer by layer)",
    ]
    assert wrap_line("short", 79) == ["short"]
    title = "Free space in the training folder (up to 12.40 GB can go): optimizer states and older checkpoints"
    assert wrap_title(title, 60) == (
        "Free space in the training folder (up to 12.40 GB can go):\n    optimizer states and older checkpoints"
    )
    many = "word " * 2000  # no label and no double space: linear, not a regular expression's backtracking
    assert len(wrap_line(many.strip(), 79)) > 100
