"""Progress events: the only channel from the engine to a front end (TUI, plain prompts, CLI)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from tui_merger.core.errors import MergeCancelled

if TYPE_CHECKING:
    from tui_merger.core.options import MergeResult


@dataclass(frozen=True)
class Event:
    """Base class of everything the engine reports."""


@dataclass(frozen=True)
class PhaseStarted(Event):
    phase: str  # "plan", "merge", "files", "finalize"
    message: str


@dataclass(frozen=True)
class TensorProgress(Event):
    name: str  # the tensor just written
    tensors_done: int
    tensors_total: int
    bytes_done: int
    bytes_total: int


@dataclass(frozen=True)
class TensorWritten(Event):
    """A tensor's bytes are in the shard being written (its header went first, so every tensor's
    place is fixed): a check may read them now, while the merge writes the next ones. Front ends
    may ignore it; TensorProgress follows."""

    path: str  # the shard file, in the partial output folder
    name: str


@dataclass(frozen=True)
class Notice(Event):
    level: str  # "info" or "warning"
    message: str


@dataclass(frozen=True)
class MergeFinished(Event):
    result: MergeResult


EventSink = Callable[[Event], None]


def ignore_event(event: Event) -> None:
    """The default sink."""


class CancelToken:
    """Thread-safe cancellation flag; the engine checks it between tensors."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.interrupted = False  # stopped as Ctrl-C stops a merge: the finished shards are kept for a resume

    def cancel(self) -> None:
        """The user cancels: the partial output is removed."""
        self._event.set()

    def interrupt(self) -> None:
        """Stopped from outside, as Ctrl-C, SIGTERM or SIGHUP stop the command line's merge (the assistant's
        terminal went away): the finished shards are kept, and the same merge run again resumes."""
        self.interrupted = True
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self) -> None:
        if self._event.is_set():
            err = MergeCancelled()
            err.interrupted = self.interrupted
            raise err


# -- Try it (core/ship/trial.py): the models answering a prompt ---------------------------------------


@dataclass(frozen=True)
class TrialStarted(Event):
    side: str  # the side's label: "merged model", "base model", "unmerged adapter"
    message: str  # "Loading the merged model from ... (bfloat16)"


@dataclass(frozen=True)
class TrialToken(Event):
    side: str
    text: str  # the answer so far, decoded
    tokens: int  # tokens generated so far
    tokens_per_s: float  # since generation started (the prompt's processing included)


@dataclass(frozen=True)
class TrialFinished(Event):
    side: str
    text: str  # the whole answer, decoded
    token_ids: tuple[int, ...]  # the answer's tokens (the prompt's left out)
    seconds: float  # generation time (loading left out)
    tokens_per_s: float
