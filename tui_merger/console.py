"""Console rendering of engine events: a rich progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time

from tui_merger.core.options import human_bytes
from tui_merger.core.events import Event, Notice, PhaseStarted, TensorProgress


class PlainProgress:
    """Line-per-step output for logs, CI and dumb terminals: at most one progress line every few
    seconds or every 10%, so logs stay readable."""

    def __init__(self, stream=None, interval: float = 5.0, words=None) -> None:
        self.stream = stream or sys.stderr
        self.words = words or (lambda text: text)  # the engine's sentences name flags; a front end may say them its way
        self.interval = interval
        self._last_time = 0.0
        self._last_decile = -1
        self._started = time.monotonic()

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def __call__(self, event: Event) -> None:
        if isinstance(event, PhaseStarted):
            self._last_decile, self._started = -1, time.monotonic()
            self._print(f"[{event.phase}] {self.words(event.message)}")
        elif isinstance(event, Notice):
            self._print(f"{event.level}: {self.words(event.message)}")
        elif isinstance(event, TensorProgress):
            frac = event.bytes_done / event.bytes_total if event.bytes_total else 1.0
            decile = int(frac * 10)
            now = time.monotonic()
            last = event.tensors_done == event.tensors_total
            if last or decile > self._last_decile or now - self._last_time >= self.interval:
                self._last_decile, self._last_time = decile, now
                rate = event.bytes_done / max(now - self._started, 1e-6)
                self._print(
                    f"  {frac:6.1%}  {event.tensors_done}/{event.tensors_total} tensors  "
                    f"{human_bytes(event.bytes_done)} / {human_bytes(event.bytes_total)}  "
                    f"{human_bytes(rate)}/s  {event.name}"
                )


class RichProgress:
    """A live bar on stderr (stdout stays free for results)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[tensor]}", style="dim"),
            console=self.console,
            transient=False,
        )
        self.task = None
        self.phase = "merge"

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, event: Event) -> None:
        if isinstance(event, PhaseStarted):
            self.task, self.phase = None, event.phase  # the next progress event starts a new bar
            self.console.print(f"[bold]{event.phase}[/bold] {event.message}", highlight=False)
        elif isinstance(event, Notice):
            style = "yellow" if event.level == "warning" else "cyan"
            self.console.print(f"[{style}]{event.level}:[/{style}] {event.message}", highlight=False)
        elif isinstance(event, TensorProgress):
            if self.task is None:
                self.task = self.progress.add_task(self.phase, total=event.bytes_total, tensor="")
            short = event.name if len(event.name) <= 40 else "..." + event.name[-37:]
            self.progress.update(self.task, completed=event.bytes_done, tensor=short)


class TrialPrinter:
    """Try it on a console: each side's answer streamed as its tokens come (``TrialToken`` carries the
    answer so far; the new part is printed), then its token count and speed. ``out`` gets the answers,
    ``err`` the loading lines (default: ``out``). Styles only on a terminal (rich decides)."""

    def __init__(self, out=None, err=None) -> None:
        from rich.console import Console

        self.out = Console(file=out or sys.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=err, highlight=False, soft_wrap=True) if err is not None else self.out
        self.shown: dict[str, str] = {}

    def __call__(self, event: Event) -> None:
        from tui_merger.core.events import TrialFinished, TrialStarted, TrialToken

        if isinstance(event, TrialStarted):
            self.err.print(f"[dim]{event.message}[/dim]")
        elif isinstance(event, TrialToken):
            self._show(event.side, event.text)
        elif isinstance(event, TrialFinished):
            self._show(event.side, event.text)
            if not event.text.strip():
                self.out.print("(no readable text)", end="", style="dim")
            n = len(event.token_ids)
            self.out.print()
            self.out.print(
                f"  {n} token{'s' * (n != 1)} in {event.seconds:.1f} s, {event.tokens_per_s:.1f} tokens/s",
                style="dim",
            )

    def _show(self, side: str, text: str) -> None:
        if side not in self.shown:
            self.out.print()
            self.out.print(f"[bold]{side}:[/bold]")
            self.shown[side] = ""
        before = self.shown[side]
        if text.startswith(before):
            self.out.print(text[len(before):], end="", markup=False)
        else:  # the decoded text changed behind the end (a character completed differently): print it again
            self.out.print()
            self.out.print(text, end="", markup=False)
        self.shown[side] = text
