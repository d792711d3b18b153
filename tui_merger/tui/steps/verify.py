"""Step 4, Verify: the merged model read back, recomputed and compared with the unmerged one (a worker);
the checks in a table whose summaries wrap, the highlighted check's details under it."""

from __future__ import annotations

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, ProgressBar, Static

from tui_merger.tui.steps.common import Done, EngineEvent, Step, escape, in_app


class VerifyStep(Step, Vertical):
    FIRST = "#checks"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self._check_rows: list = []  # the table's rows (status, name, summary), refilled on resize

    def compose(self) -> ComposeResult:
        yield Static(id="verify-status")
        yield ProgressBar(show_eta=False, id="verify-progress")
        yield DataTable(id="checks", cursor_type="row")
        yield Static(id="check-detail")

    def nav(self):
        wizard = self.wizard
        return True, wizard.running is not None or (wizard.result is None and wizard.job is None), "Try it >", ""

    def advance(self) -> None:
        self.wizard.panes["try"].enter()

    def resized(self) -> None:
        if self.wizard.step == "verify":
            self.fill_checks(self._check_rows)

    def start(self) -> None:
        wizard = self.wizard
        wizard.report = None
        self.fill_checks([])
        wizard.running = "verify"
        wizard.show("verify")
        self._verify_worker(wizard.options, wizard.result)

    @work(thread=True, exclusive=True, group="verify", exit_on_error=False)
    def _verify_worker(self, options, result) -> None:
        from tui_merger.core.record.provenance import finish_merge

        self.post_outcome("verify", lambda: finish_merge(options, result, on_event=self.forward)[1])

    def on_engine_event(self, message: EngineEvent) -> None:
        from tui_merger.core.events import Notice, PhaseStarted, TensorProgress

        message.stop()
        ev = message.event
        if isinstance(ev, PhaseStarted):
            self.query_one("#verify-status", Static).update(f"[b]{ev.phase}[/b]  {escape(ev.message)}")
            if ev.phase in ("merge", "verify"):
                self.query_one("#verify-progress", ProgressBar).update(total=None, progress=0)
        elif isinstance(ev, Notice):
            self.wizard.panes["merge"].note(ev)
        elif isinstance(ev, TensorProgress) and self.wizard.running == "verify":
            self.query_one("#verify-progress", ProgressBar).update(total=max(ev.bytes_total, 1), progress=ev.bytes_done)

    def done_verify(self, done: Done) -> None:
        wizard = self.wizard
        if done.error:
            self.query_one("#verify-status", Static).update(f"[b red]Verification could not run:[/] {escape(in_app(done.error))}")
            wizard.report = None
        else:
            wizard.report = done.value
            self.show_report()

    def job_verified(self, job, checks: list[dict], message: str) -> None:
        """A background job finished: its checks as its manifest records them."""
        self.fill_checks([(str(c.get("status", "")).upper(), c.get("name", ""), c.get("summary", "")) for c in checks])
        verified = (job.result or {}).get("verified")
        verdict = {  # as the foreground merge says it (the job's message says the same in other words)
            True: "verification [b green]PASSED[/]",
            False: "verification [b red]FAILED: the model does not match its inputs[/]",
        }.get(verified, escape(message))
        self.query_one("#verify-status", Static).update(f"Job {job.id}: {verdict}" + ("" if verdict.endswith(".") else "."))
        self.query_one("#verify-progress", ProgressBar).update(total=1, progress=1)
        self.wizard.show("verify")

    def show_report(self) -> None:
        report = self.wizard.report
        self.fill_checks([(c.status.upper(), c.name, c.summary) for c in report.checks])
        verdict = "[b green]PASSED[/]" if report.passed else "[b red]FAILED: the model does not match its inputs[/]"
        self.query_one("#verify-status", Static).update(f"Verification {verdict} ({report.seconds:.1f} s)")
        self.query_one("#verify-progress", ProgressBar).update(total=1, progress=1)

    def fill_checks(self, rows) -> None:
        """The checks table, its summaries wrapped in the width left by the other columns (not cut)."""
        from rich.text import Text

        self._check_rows = list(rows)
        table = self.query_one("#checks", DataTable)
        row = table.cursor_row
        table.clear(columns=True)
        widths = [max([len(r[i]) for r in rows] + [len(label)]) for i, label in enumerate(("result", "check"))]
        width = self.app.size.width - 2 * 1 - 2 * table.cell_padding * 3 - sum(widths) - 2  # steps' padding, scrollbar
        table.add_column("result", width=widths[0])
        table.add_column("check", width=widths[1])
        table.add_column("summary", width=max(width, 20))
        for status, name, summary in rows:
            colour = {"PASS": "green", "FAIL": "red"}.get(status, "yellow")
            table.add_row(f"[b {colour}]{escape(status)}[/]", name, Text(summary, end=""), height=None)
        if rows:
            table.move_cursor(row=min(row, len(rows) - 1))

    @on(DataTable.RowHighlighted, "#checks")
    def _check_detail(self, event: DataTable.RowHighlighted) -> None:
        report = self.wizard.report
        if report is None or event.cursor_row >= len(report.checks):
            return
        check = report.checks[event.cursor_row]
        lines = [f"[b]{check.name}[/b]: {escape(check.summary)}"] + [f"  {escape(d)}" for d in check.details[:8]]
        self.query_one("#check-detail", Static).update("\n".join(lines))
