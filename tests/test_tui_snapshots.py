"""Snapshots of every step at 80x24 (look at snapshot_report.html before accepting a new baseline with
--snapshot-update). The workspace lives at a fixed path and the date is fixed, so the pictures only
change when the screens do; times shown on screen are set to fixed values before the picture."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path

import pytest

from tui_merger.tui.app import MergeApp

WORKSPACE = Path("/tmp/tui-merger-snapshots/ws")
TODAY = datetime.date(2026, 11, 30)
SIZE = (80, 24)


@pytest.fixture(scope="module")
def workspace():
    from tui_merger.demo import build_demo

    shutil.rmtree(WORKSPACE.parent, ignore_errors=True)
    build_demo(WORKSPACE)
    yield WORKSPACE
    shutil.rmtree(WORKSPACE.parent, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no user themes, no saved theme
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


async def until(pilot, condition, tries: int = 1200):
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("timed out")


async def review(pilot):
    wizard = pilot.app.wizard
    await until(pilot, lambda: wizard.candidate is not None)
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.plan is not None and wizard.running is None and not wizard.plan_stale)


async def merged(pilot):
    wizard = pilot.app.wizard
    shutil.rmtree(WORKSPACE / "base-ws-r8-20261130", ignore_errors=True)
    await review(pilot)
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.step == "verify" and wizard.running is None)
    wizard.report.seconds = 1.0  # fixed times for a stable picture
    wizard.result.seconds = 1.0
    wizard.show_report()
    await pilot.pause()


def app() -> MergeApp:
    return MergeApp(WORKSPACE, today=TODAY)


def test_find(snap_compare, workspace):
    async def ready(pilot):
        await until(pilot, lambda: pilot.app.wizard.candidate is not None)

    assert snap_compare(app(), terminal_size=SIZE, run_before=ready)


def test_review(snap_compare, workspace):
    assert snap_compare(app(), terminal_size=SIZE, run_before=review)


def test_merge_failed(snap_compare, workspace):
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

    assert snap_compare(app(), terminal_size=SIZE, run_before=failed)


def test_verify(snap_compare, workspace):
    assert snap_compare(app(), terminal_size=SIZE, run_before=merged)


def test_finish(snap_compare, workspace):
    async def finish(pilot):
        await merged(pilot)
        await pilot.press("ctrl+n")
        await pilot.pause()

    assert snap_compare(app(), terminal_size=SIZE, run_before=finish)


def test_help(snap_compare, workspace):
    assert snap_compare(app(), terminal_size=SIZE, press=["f1"])
