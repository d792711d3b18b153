"""Snapshots of every step at 80x24 and 120x40 (look at snapshot_report.html before accepting a new
baseline with --snapshot-update, and at the pictures: rsvg-convert -o x.png file.svg). The workspace lives at a fixed path and the date is fixed, so the pictures only
change when the screens do; times shown on screen are set to fixed values before the picture."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest

from tui_merger.tui.app import MergeApp

WORKSPACE = Path("/tmp/tui-merger-snapshots/ws")
TODAY = datetime.date(2026, 11, 30)
SIZES = pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])


@pytest.fixture(scope="module")
def workspace():
    """The fixed folder the pictures show, held under a lock: two test runs on one machine (several
    worktrees) would otherwise delete each other's workspace mid-test."""
    import fcntl

    from tui_merger.demo import build_demo

    with open(WORKSPACE.parent.with_name(WORKSPACE.parent.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(WORKSPACE.parent, ignore_errors=True)
        build_demo(WORKSPACE)
        yield WORKSPACE
        shutil.rmtree(WORKSPACE.parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user themes, no saved theme
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # no base proposed from the machine's cache


@pytest.fixture(scope="module")
def unresolved(workspace):
    """The demo's base and adapter in a folder whose adapter_config.json names a base that is not here."""
    import json

    ws = WORKSPACE.parent / "unresolved"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "adapter", ws / "lora")
    cfg = json.loads((ws / "lora" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "/home/someone/models/Qwen2-tiny"
    (ws / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    return ws


async def until(pilot, condition, tries: int = 1200):
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("timed out")


async def review(pilot):
    from textual.widgets import Input

    wizard = pilot.app.wizard
    await until(pilot, lambda: wizard.candidate is not None)
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.plan is not None and wizard.running is None and not wizard.plan_stale)
    for field in pilot.app.screen.query(Input):  # Review focuses a field: a blinking cursor differs run to run
        field.cursor_blink = False
    await pilot.pause()


async def merged(pilot):
    wizard = pilot.app.wizard
    shutil.rmtree(WORKSPACE / "base-ws-r8-20261130", ignore_errors=True)
    await review(pilot)
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.step == "verify" and wizard.running is None)
    wizard.report.seconds = 1.0  # fixed times for a stable picture
    wizard.result.seconds = 1.0
    wizard.panes["verify"].show_report()
    await pilot.pause()


def app() -> MergeApp:
    return MergeApp(WORKSPACE, today=TODAY)


@SIZES
def test_find(snap_compare, workspace, size):
    async def ready(pilot):
        await until(pilot, lambda: pilot.app.wizard.candidate is not None)

    assert snap_compare(app(), terminal_size=size, run_before=ready)


@SIZES
def test_review(snap_compare, workspace, size):
    assert snap_compare(app(), terminal_size=size, run_before=review)


@SIZES
def test_merge_failed(snap_compare, workspace, size):
    async def failed(pilot):
        wizard = pilot.app.wizard
        await review(pilot)
        weights = WORKSPACE / "base" / "model.safetensors"
        moved = WORKSPACE.parent / "moved.safetensors"
        shutil.move(weights, moved)
        try:
            await pilot.press("ctrl+n")
            await until(pilot, lambda: wizard.running is None and wizard.step == "merge")
        finally:
            shutil.move(moved, weights)
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=failed)


@SIZES
def test_verify(snap_compare, workspace, size):
    assert snap_compare(app(), terminal_size=size, run_before=merged)


@SIZES
def test_finish(snap_compare, workspace, size):
    async def finish(pilot):
        await merged(pilot)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it, skipped
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=finish)


@SIZES
def test_help(snap_compare, workspace, size):
    assert snap_compare(app(), terminal_size=size, press=["f1"])


@SIZES
def test_review_blocked_scrolled(snap_compare, workspace, size):
    """An error, the form scrolled to its end: the checks stay in sight below it."""

    async def blocked(pilot):
        from textual.widgets import Input

        wizard = pilot.app.wizard
        await review(pilot)
        taken = WORKSPACE / "base"  # a folder with files: the merge would need "Replace"
        pilot.app.screen.query_one("#out", Input).value = str(taken)
        pilot.app.screen.query_one("#out", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: wizard.running is None and not wizard.plan_stale)
        pilot.app.screen.query_one("#review-form").scroll_end(animate=False)
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=blocked)


@SIZES
def test_review_output_format(snap_compare, workspace, size):
    """The output format's choices, opened with the keyboard: they fit at 80 columns."""

    async def opened(pilot):
        from textual.widgets import Select

        await review(pilot)
        select = pilot.app.screen.query_one("#output-format", Select)
        select.focus()
        await pilot.press("enter")
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=opened)


@SIZES
def test_review_proposed_base(snap_compare, unresolved, size):
    """The adapter's base is not here: the model of the folder that fits is proposed."""
    assert snap_compare(MergeApp(unresolved, today=TODAY), terminal_size=size, run_before=review)


@SIZES
def test_try_it(snap_compare, workspace, size):
    """Both answers, side by side at 120 columns and stacked at 80; the machine's free memory and the
    speeds are set to fixed values before the picture."""
    import dataclasses
    import re

    from textual.widgets import Input

    async def tried(pilot):
        wizard = pilot.app.wizard
        await merged(pilot)
        await pilot.press("ctrl+n")
        trial = wizard.panes["try"]
        await until(pilot, lambda: trial.trial_plan is not None)
        trial.try_tokens = 12
        pilot.app.screen.query_one("#prompt", Input).value = "the adapter"
        await pilot.click("#ask")
        await until(pilot, lambda: wizard.running is None and len(trial.trial_answers) == 2)
        plan = trial.trial_plan
        plan.notes[0] = re.sub(r"; .* is available", "; 16 GB is available", plan.notes[0])
        trial.show_trial_plan()
        for label, answer in trial.trial_answers.items():
            trial.trial_answers[label] = dataclasses.replace(answer, seconds=0.5, tokens_per_s=24.0)
            trial.show_answer(label)
        prompt = pilot.app.screen.query_one("#prompt", Input)
        prompt.cursor_blink = False  # a blinking cursor would make the picture differ from run to run
        prompt.focus()
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=tried)


@SIZES
def test_cleanup_dialog(snap_compare, workspace, size):
    """Finish > Clean up...: each item's whole paths (wrapped, not cut), its size, and the selected total."""

    async def cleanup(pilot):
        await merged(pilot)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it, skipped
        await pilot.click("#cleanup")
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=cleanup)


@SIZES
def test_run_locally_dialog(snap_compare, workspace, size):
    """Finish > Run it locally...: Q4_K_M preselected, the file's size and time said before anything is written."""
    from textual.widgets import Input

    async def run_locally(pilot):
        await merged(pilot)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it, skipped
        await pilot.click("#gguf")
        await pilot.pause()
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=run_locally)


@SIZES
def test_run_locally_dialog_with_the_gguf_lora(snap_compare, workspace, size):
    """Finish > Run it locally... after a LoRA merge, "Also write the adapter as a GGUF LoRA" ticked: the LoRA's
    and the base GGUF's paths and sizes, the time, and whether llama.cpp checks them, said before anything is
    written; the dialog scrolled to its end so that the button is in sight."""
    from textual.widgets import Input

    async def ticked(pilot):
        await merged(pilot)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it, skipped
        await pilot.click("#gguf")
        await pilot.pause()
        for field in pilot.app.screen.query(Input):
            field.cursor_blink = False
        await pilot.click("#gguf-lora")
        await pilot.pause()
        await pilot.pause()

    assert snap_compare(app(), terminal_size=size, run_before=ticked)


@SIZES
def test_find_broken_config(snap_compare, workspace, size):
    """An adapter whose adapter_config.json is not JSON: marked in the list, the reason under it."""
    ws = WORKSPACE.parent / "broken"
    if not ws.exists():
        shutil.copytree(workspace / "base", ws / "base")
        shutil.copytree(workspace / "adapter", ws / "adapter")
        (ws / "adapter" / "adapter_config.json").write_text('{"r": 8,')

    async def broken(pilot):
        wizard = pilot.app.wizard
        await pilot.pause()
        [n] = [n for n, c in enumerate(wizard.candidates) if c.path.endswith("adapter")]
        pilot.app.screen.query_one("#candidates").highlighted = n
        await pilot.pause()

    assert snap_compare(MergeApp(ws, today=TODAY), terminal_size=size, run_before=broken)
