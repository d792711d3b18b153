"""The TUI face of issue 32's item 1, driven with Textual's pilot at 80x24: run again in a folder where a
merge was made, Review proposes the base model, not the merged one; typing the merged model as the base
shows the one-sentence error under Checks and "Merge >" stays disabled, so nothing is written."""

from __future__ import annotations

import pytest
from textual.widgets import Button, Input
from test_merged_twice import demo, merged, merged_once, private_state, ws  # noqa: F401 (fixtures)
from test_tui import text, to_review, until

from tui_merger.tui.app import MergeApp

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def settled(wizard) -> bool:
    return wizard.plan is not None and wizard.running is None and not wizard.plan_stale


async def test_review_proposes_the_base_not_the_merged_model_and_refuses_the_merged_one(ws):  # noqa: F811
    before = sorted(p.name for p in ws.iterdir())
    app = MergeApp(ws)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        await until(pilot, lambda: settled(wizard), "the plan")
        assert wizard.candidate.path == str(ws / "my-adapter")
        base = app.screen.query_one("#base", Input)
        assert base.value == str(ws / "base")
        assert [p for p, _ in wizard.panes["review"]._proposals] == [ws / "base"]  # the merged model is not among them
        assert merged(ws).name not in text(app, "#base-note")
        assert not wizard.plan.blocked

        base.focus()
        base.value = str(merged(ws))  # the user types the merged model anyway
        await pilot.press("enter")
        await until(pilot, lambda: settled(wizard) and wizard.options.base == merged(ws), "the new plan")
        assert [f.id for f in wizard.plan.of("error")] == ["merged-twice"]
        findings = " ".join(text(app, "#findings").split())
        assert f"{merged(ws)} already has the adapter {ws / 'my-adapter'} merged into it" in findings
        assert "give it weight 2 there" in findings
        nxt = app.screen.query_one("#next", Button)
        assert nxt.disabled and str(nxt.label) == "Merge >"
        await pilot.press("ctrl+n")  # nothing happens but the reason
        await pilot.pause(0.2)
        assert wizard.step == "review" and wizard.result is None
    assert sorted(p.name for p in ws.iterdir()) == before
