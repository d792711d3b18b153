"""Step 3, Merge: the merge in a worker thread (or a background job the step follows), its progress, and
Cancel, which stops it between tensors and removes the partial output."""

from __future__ import annotations

import time
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Button, Checkbox, ProgressBar, Static

from tui_merger.tui.steps.common import Done, EngineEvent, JobProgress, Step, WorkDone, escape, in_app
from tui_merger.tui.widgets import Confirm


class MergeStep(Step, Vertical):
    FIRST = "#cancel"
    BACK = "review"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self._started = 0.0
        self._job_phase: str | None = None  # a followed job's latest phase
        self._job_counts: dict | None = None  # and its merge's latest tensor counts

    def compose(self) -> ComposeResult:
        yield Static(id="merge-status")
        yield ProgressBar(show_eta=False, id="merge-progress")
        yield Static(id="merge-detail")
        yield Static(id="merge-notes")
        yield Button("Cancel the merge", variant="error", id="cancel")

    def nav(self):
        wizard = self.wizard
        return wizard.running is not None or wizard.result is not None, True, "Verify >", ""

    def start(self) -> None:
        """ "Merge >" in Review: the merge runs in a worker thread, or as a background job."""
        from tui_merger.core.events import CancelToken

        wizard = self.wizard
        wizard.result = None
        wizard.panes["try"].trial_plan = None  # a new model: Try it plans again
        wizard.cancel_token = CancelToken()
        self.query_one("#merge-status", Static).update(f"Merging into {escape(wizard.options.out)}")
        self.query_one("#merge-detail", Static).update("")
        self.query_one("#merge-notes", Static).update("")
        self.query_one("#merge-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#cancel", Button).disabled = False
        wizard.running = "merge"
        self._started = time.monotonic()
        if wizard.query_one("#detach", Checkbox).value:
            self.follow(None)
            return
        wizard.show("merge")
        wizard.merge_idle.clear()
        self._merge_worker(wizard.options, wizard.cancel_token)

    def follow(self, job) -> None:
        """The merge as a background job: started now (job None) or already running; the UI follows it."""
        import threading

        wizard = self.wizard
        wizard.result, wizard.report, wizard.job = None, None, job
        wizard.running = "merge"
        wizard.stop_following = threading.Event()
        self._job_phase, self._job_counts = None, None
        self.query_one("#merge-status", Static).update(
            "Starting a background job..." if job is None else f"Following job {job.id} into {escape(job.out)}"
        )
        self.query_one("#merge-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#cancel", Button).disabled = False
        wizard.show("merge")
        self._job_worker(wizard.options if job is None else None, job, wizard.stop_following)

    @work(thread=True, exclusive=True, group="merge", exit_on_error=False)
    def _job_worker(self, options, job, stop) -> None:
        from tui_merger.core.errors import MergeError
        from tui_merger.core.merge.jobs import follow, start_detached

        try:
            if job is None:
                job = start_detached(options)
            self.wizard.job = job
            self.post_message(JobProgress({"phase": "job", "message": f"job {job.id}: the merge keeps running if you disconnect"}))
            done = Done(follow(job, lambda line: None, lambda p: self.post_message(JobProgress(p)), stop))
        except MergeError as err:
            done = Done(error=str(err))
        self.post_message(WorkDone("job", done))

    def on_job_progress(self, message: JobProgress) -> None:
        from tui_merger.core.options import human_bytes

        p = message.progress
        bar = self.query_one("#merge-progress", ProgressBar)
        if self._job_phase == "merge" and p.get("phase") not in ("plan", "merge"):
            # the merge wrote its last tensor (the phases after it start only then); the follower polls, so
            # the job may have written its last count between two looks: show it complete, not where it was
            bar.update(total=bar.total or 1, progress=bar.total or 1)
            last = self._job_counts
            if last:
                self.query_one("#merge-detail", Static).update(
                    f"{human_bytes(last['bytes_total'])} of {human_bytes(last['bytes_total'])}   "
                    f"{last.get('total', 0)}/{last.get('total', 0)} tensors"
                )
        self._job_phase = p.get("phase")
        if p.get("phase") == "merge" and p.get("bytes_total"):
            self._job_counts = p
        if "message" in p:
            self.query_one("#merge-status", Static).update(f"[b]{escape(p.get('phase', ''))}[/b]  {escape(p['message'])}")
        if p.get("bytes_total"):
            self.query_one("#merge-progress", ProgressBar).update(total=p["bytes_total"], progress=p.get("bytes_done", 0))
            self.query_one("#merge-detail", Static).update(
                f"{human_bytes(p.get('bytes_done', 0))} of {human_bytes(p['bytes_total'])}   "
                f"{p.get('done', 0)}/{p.get('total', 0)} tensors\n[dim]{escape(p.get('tensor', ''))}[/dim]"
            )

    @work(thread=True, exclusive=True, group="merge", exit_on_error=False)
    def _merge_worker(self, options, cancel) -> None:
        from tui_merger.core.verify.checks import merge_prewarmed

        # verification follows: its recompute and the unmerged run start while the merge writes
        try:
            self.post_outcome("merge", lambda: merge_prewarmed(options, self.forward, cancel))
        finally:
            self.wizard.merge_idle.set()  # stopped: what it keeps is on disk (the app may leave now)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        wizard = self.wizard

        def answer(yes: bool | None) -> None:
            if yes and wizard.running == "merge" and wizard.job is not None and wizard.job.pid:
                import os
                import signal

                os.kill(wizard.job.pid, signal.SIGTERM)  # the job stops between tensors, keeping finished shards
                self.query_one("#cancel", Button).disabled = True
                self.query_one("#merge-status", Static).update("Stopping the background job...")
                return
            if yes and wizard.running == "merge" and wizard.cancel_token is not None:
                wizard.cancel_token.cancel()
                self.stopping()

        self.app.push_screen(
            Confirm("Cancel the merge? It stops within a second or two and its partial output is removed; if it has "
                    "already finished, the model is kept. The inputs are untouched.", "Cancel the merge", "Keep merging"),
            answer,
        )

    def on_engine_event(self, message: EngineEvent) -> None:
        from tui_merger.core.events import Notice, PhaseStarted, TensorProgress
        from tui_merger.core.options import human_bytes

        message.stop()
        ev = message.event
        stopping = self.wizard.cancel_token is not None and self.wizard.cancel_token.cancelled
        if isinstance(ev, PhaseStarted) and not stopping:  # "Stopping..." stays until the merge has stopped
            self.query_one("#merge-status", Static).update(f"[b]{ev.phase}[/b]  {escape(ev.message)}")
            if ev.phase in ("merge", "verify"):
                self.query_one("#merge-progress", ProgressBar).update(total=None, progress=0)
                self._started = time.monotonic()
        elif isinstance(ev, Notice):
            self.note(ev)
        elif isinstance(ev, TensorProgress) and self.wizard.running == "merge":
            self.query_one("#merge-progress", ProgressBar).update(total=max(ev.bytes_total, 1), progress=ev.bytes_done)
            elapsed = max(time.monotonic() - self._started, 1e-6)
            speed = ev.bytes_done / elapsed
            eta = (ev.bytes_total - ev.bytes_done) / speed if speed > 0 else 0
            self.query_one("#merge-detail", Static).update(
                f"{human_bytes(ev.bytes_done)} of {human_bytes(ev.bytes_total)}   "
                f"{ev.tensors_done}/{ev.tensors_total} tensors   {human_bytes(speed)}/s   "
                f"about {eta:.0f} s left\n[dim]{escape(ev.name)}[/dim]"
            )

    def note(self, ev) -> None:
        """A Notice of the merge or its verification, under the progress."""
        notes = self.query_one("#merge-notes", Static)
        notes.update(f"{notes.content}\n[yellow]{ev.level}:[/] {escape(ev.message)}".strip())

    def stopping(self) -> None:
        """Cancel or "Stop and quit" was answered: said at once; the merge stops after its current tensor."""
        self.query_one("#cancel", Button).disabled = True
        self.query_one("#merge-status", Static).update("[b yellow]Stopping...[/] the merge stops after the tensor it is on.")

    def done_merge(self, done: Done) -> None:
        from tui_merger.core.merge.output import left_on_disk

        wizard = self.wizard
        self.query_one("#cancel", Button).disabled = True
        status = self.query_one("#merge-status", Static)
        bar = self.query_one("#merge-progress", ProgressBar)
        if bar.total is None:
            bar.update(total=1, progress=0)  # no animation left running after a stop
        if wizard.quit_when_stopped:  # "Stop and quit": leave now; the terminal says what is on disk
            wizard.result = None if (done.cancelled or done.error) else done.value
            wizard.stopped = Path(wizard.options.out)
            self.app.exit(130 if wizard.result is None else 0)
            return
        if done.cancelled:  # read from the disk, not assumed
            status.update(f"[b yellow]Cancelled:[/] {escape(left_on_disk(wizard.options.out))}; the inputs are untouched.")
        elif done.error:
            status.update(f"[b red]The merge failed:[/] {escape(in_app(done.error))}\nGo back to Review to change something.")
        else:
            wizard.result = done.value
            wizard.refresh_nav()
            wizard.panes["verify"].start()

    def done_job(self, done: Done) -> None:
        """A followed job ended (or following stopped): its verification is read from its manifest."""
        from tui_merger.core.merge.jobs import FINISHED
        from tui_merger.core.record.manifest import read_manifest

        self.query_one("#cancel", Button).disabled = True
        status = self.query_one("#merge-status", Static)
        if done.error:
            status.update(f"[b red]The background job could not start:[/] {escape(in_app(done.error))}")
            return
        job = done.value
        message = (job.result or {}).get("message", "")
        if job.state != FINISHED:
            status.update(f"[b yellow]Job {job.id} {job.state}.[/] {escape(message)}")
            return
        manifest = read_manifest(Path(job.out)) or {}
        checks = (manifest.get("verification") or {}).get("checks") or []
        self.wizard.panes["verify"].job_verified(job, checks, message)
