"""The merge assistant: one screen, six steps (Find, Review, Merge, Verify, Try it, Finish) in a ContentSwitcher.

Each step is a container in its own module (``tui/steps/``) with its widgets, handlers and workers; this
screen holds what the steps share (the checkpoint, the options, the result, which worker is busy), the
header and the navigation bar. No merge logic lives in the app: the steps scan with ``core.inspect``,
plan with ``core.preflight``, merge with ``core.engine`` and verify with ``core.provenance`` in thread
workers, and render the engine's events, posted to the UI as messages.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Button, ContentSwitcher, Footer, Static

from tui_merger.tui.steps.common import escape
from tui_merger.tui.steps.find import FindStep
from tui_merger.tui.steps.finish import FinishStep
from tui_merger.tui.steps.merge import MergeStep
from tui_merger.tui.steps.review import ReviewStep
from tui_merger.tui.steps.try_it import TryStep
from tui_merger.tui.steps.verify import VerifyStep

STEPS = ("find", "review", "merge", "verify", "try", "finish")
INDICATOR = STEPS  # the steps the header names
TITLES = {"find": "Find", "review": "Review", "merge": "Merge", "verify": "Verify", "try": "Try", "finish": "Finish"}
PANES = {"find": FindStep, "review": ReviewStep, "merge": MergeStep, "verify": VerifyStep, "try": TryStep, "finish": FinishStep}


class Wizard(Screen):
    AUTO_FOCUS = ""
    BINDINGS = [
        Binding("ctrl+n", "next", "Next", priority=True),
        Binding("ctrl+b", "back", "Back", priority=True),
        Binding("f1", "app.help", "Help"),
        Binding("ctrl+j", "follow_job", "Follow job", show=False),
    ]

    def __init__(self, root: Path, engine_hook=None, today=None) -> None:
        super().__init__()
        self.root = Path(root).absolute()
        self.engine_hook = engine_hook  # tests: called in the worker thread with every engine event
        self.today = today  # the date in suggested output names (tests fix it)
        self.step = "find"
        self.panes = {name: cls(self, id=name) for name, cls in PANES.items()}
        self.candidates = []
        self.candidate = None  # the checkpoint picked in Find
        self.plan = None  # Review's plan (core.plan.preflight), and the options it was made from
        self.options = None
        self.plan_stale = True  # a field changed since the plan was made
        self.result = None  # the merge's MergeResult
        self.report = None  # the verification's report
        self.job = None  # the background job being followed (core.jobs.Job), when the merge runs detached
        self.local_loras = []  # GGUF LoRAs Finish made of the merged adapter (run_locally.LocalLora), for the farewell
        self.stop_following = None  # set: stop following the job (it keeps running)
        self.cancel_token = None  # the merge's
        self.merge_idle = threading.Event()  # cleared while a merge runs in the app's own thread
        self.merge_idle.set()
        self.quit_when_stopped = False  # "Stop and quit": the app closes once the merge has really stopped
        self.stopped: Path | None = None  # the output of a merge stopped by "Stop and quit" (the farewell says what is left)
        self.trial_cancel = None  # Try it's
        self.running: str | None = None  # which worker is busy: bases, plan, merge, verify, trial, upload, cleanup, gguf

    @property
    def out_path(self) -> Path:
        return Path(self.result.out if self.result is not None else self.job.out)

    # -- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="title")
        with ContentSwitcher(initial="find", id="steps"):
            yield from self.panes.values()
        with Horizontal(id="nav"):
            yield Button("< Back", id="back")
            yield Static(id="nav-status")
            yield Button("Next >", variant="primary", id="next")
        yield Footer()

    def on_mount(self) -> None:
        self.rescan(self.root)
        self.show("find")
        running = self._running_job()
        if running is not None:
            self.app.notify(
                f"A merge job is running in the background ({running.id}, into {running.out}): press ctrl+j to follow it.",
                timeout=15,
            )

    def rescan(self, path: Path) -> None:
        self.panes["find"].rescan(path)

    def _running_job(self):
        from tui_merger.core.merge.jobs import RUNNING, list_jobs

        return next((j for j in list_jobs() if j.state == RUNNING), None)

    def action_follow_job(self) -> None:
        job = self._running_job()
        if job is None or self.running is not None:
            self.app.notify("No background merge job is running.", severity="warning")
            return
        self.panes["merge"].follow(job)

    # -- steps --------------------------------------------------------------------------------
    def show(self, step: str) -> None:
        self.step = step
        self.query_one("#steps", ContentSwitcher).current = step
        self._title()
        self.refresh_nav()
        self.query_one(self.panes[step].FIRST).focus()

    def _title(self) -> None:
        """tui-merger │ Find > Review > Merge > ... │ folder: the steps, the current one highlighted
        (the ones before it plain, the ones after it dim), then as much of the folder as fits."""
        now = INDICATOR.index(self.step) if self.step in INDICATOR else 0
        parts = []
        for n, step in enumerate(INDICATOR):
            name = TITLES[step]
            parts.append(f"[reverse b] {name} [/]" if n == now else name if n < now else f"[dim]{name}[/dim]")
        steps = " > ".join(parts)
        used = len("tui-merger │ ") + len(" > ".join(TITLES[s] for s in INDICATOR)) + 2 + len(" │ ") + 2
        room = max(self.app.size.width - used, 8)
        folder = str(self.root)
        if len(folder) > room:
            folder = "…" + folder[-(room - 1):]
        self.query_one("#title", Static).update(f"[b]tui-merger[/b] │ {steps} │ [dim]{escape(folder)}[/dim]")

    def on_resize(self) -> None:
        self._title()
        for pane in self.panes.values():
            pane.resized()

    def refresh_nav(self) -> None:
        back, nxt = self.query_one("#back", Button), self.query_one("#next", Button)
        back.disabled, nxt.disabled, nxt.label, status = self.panes[self.step].nav()
        nxt.display = self.step != STEPS[-1]  # Finish is the last step: no "Next >" drawn as an empty block
        nxt.tooltip = status or None
        self.query_one("#nav-status", Static).update(escape(status))
        self.refresh_bindings()  # the footer shows ^b Back / ^n Next only where they do something

    def check_action(self, action: str, parameters) -> bool | None:
        """The footer leaves out Back where it does nothing (Find, Verify, a running merge) and Next on
        Finish; ctrl+n on a disabled "Merge >" still runs, to say why."""
        try:
            if action == "back":
                return not self.query_one("#back", Button).disabled
            if action == "next":
                return self.step != STEPS[-1]
        except Exception:  # noqa: BLE001 - asked before the buttons exist
            return True
        return True

    def action_next(self) -> None:
        pane = self.panes[self.step]
        if self.query_one("#next", Button).disabled:
            pane.refused()
            return
        pane.advance()

    def action_back(self) -> None:
        if self.query_one("#back", Button).disabled:
            return
        target = self.panes[self.step].BACK
        if target:
            self.show(target)

    @on(Button.Pressed, "#next")
    def _next(self) -> None:
        self.action_next()

    @on(Button.Pressed, "#back")
    def _back(self) -> None:
        self.action_back()
