"""The verification's checks side by side: the recompute and the behaviour check read different
things (inputs + output, block by block; the two models, layer by layer) and each runs in its own
thread with half the cores for torch (one each on 2 cores), so the cores work on two checks instead
of splitting every small operation of one. Small operations split across threads wait on each other
at every one of them, and on a busy machine (another process on a core) such a wait lasts a
scheduler tick: the recompute of a 3B model took 79 s with torch's two threads on a loaded 2-core
box and 12 s on one.

The progress of both is reported as one: each check has a share of the bytes to go through, and
the events the consumers see are the sum (one bar, never going back)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tui_merger.core.errors import MergeCancelled
from tui_merger.core.events import CancelToken, EventSink, PhaseStarted, TensorProgress
from tui_merger.core.merge.merge_math import threads_per_job  # noqa: F401 - verification's name for it


@dataclass
class _Part:
    budget: int  # bytes this check stands for in the bar
    parts: int  # passes it makes (each PhaseStarted it sends begins the next)
    part: int = -1
    fraction: float = 0.0  # of the current pass
    done: int = 0
    total: int = 0
    finished: bool = False
    expected: int = 0  # its count, as estimated before it starts (the bar's total is known from the start)

    def count(self) -> int:
        return max(self.total, self.expected)

    def value(self) -> float:
        if self.finished:
            return float(self.budget)
        whole = max(self.part, 0) + min(max(self.fraction, 0.0), 1.0)
        return self.budget * min(whole / max(self.parts, 1), 1.0)


class Shares:
    """One progress bar over several checks running at once. ``sink(name, ...)`` is the event sink a
    check reports to; its PhaseStarted events start its next pass (they are not passed on: they would
    restart the consumers' bar), its TensorProgress move its share."""

    def __init__(self, on_event: EventSink) -> None:
        self.on_event = on_event
        self._parts: dict[str, _Part] = {}
        self._lock = threading.Lock()

    def add(self, name: str, budget: int, parts: int = 1, count: int = 0) -> EventSink:
        """``count``: how many tensors (or modules) it will report, estimated, so that the total
        shown does not grow as each check reports its own ("37/39 tensors", then "40/89")."""
        self._parts[name] = _Part(max(int(budget), 1), parts, expected=max(int(count), 0))

        def sink(event) -> None:
            with self._lock:
                part = self._parts[name]
                if isinstance(event, PhaseStarted):
                    part.part += 1
                    part.fraction = 0.0
                    return
                if not isinstance(event, TensorProgress):
                    self.on_event(event)
                    return
                part.part = max(part.part, 0)
                part.fraction = event.bytes_done / event.bytes_total if event.bytes_total else 1.0
                part.done, part.total = event.tensors_done, event.tensors_total
                self._emit(event.name)

        return sink

    def finish(self, name: str) -> None:
        with self._lock:
            self._parts[name].finished = True
            self._emit(f"{name}: done")

    def _emit(self, label: str, final: bool = False) -> None:
        total_bytes = sum(p.budget for p in self._parts.values())
        done_bytes = int(sum(p.value() for p in self._parts.values()))
        total = max(sum(p.count() for p in self._parts.values()), 1)
        done = sum(p.count() if p.finished else min(p.done, p.count()) for p in self._parts.values())
        if not final:
            done, done_bytes = min(done, total - 1), min(done_bytes, total_bytes - 1)
        self.on_event(TensorProgress(label, total if final else done, total, total_bytes if final else done_bytes, total_bytes))

    def close(self) -> None:
        with self._lock:
            self._emit("checks finished", final=True)


class _Linked(CancelToken):
    """Set when it is cancelled itself or when its parent (the user's token) is."""

    def __init__(self, parent: CancelToken) -> None:
        super().__init__()
        self.parent = parent

    @property
    def cancelled(self) -> bool:
        return self._event.is_set() or self.parent.cancelled

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            raise MergeCancelled()


def run_side_by_side(jobs: dict, cancel: CancelToken) -> dict:
    """Run ``{name: job}`` each in its own thread, the cores shared out between them (torch on one
    thread in each on 2 cores); ``job(token)`` gets a
    cancel token of its own, set when ``cancel`` is, on Ctrl-C, or when another job fails. Returns
    ``{name: result}``; the first error a job raised is raised here once all have stopped."""
    import torch

    previous = torch.get_num_threads()
    threads_each = threads_per_job(len(jobs))
    local = _Linked(cancel)
    results: dict = {}
    errors: list[BaseException] = []

    def run(name, job) -> None:
        torch.set_num_threads(threads_each)
        try:
            results[name] = job(local)
        except BaseException as err:  # noqa: BLE001 - handed to the calling thread
            errors.append(err)
            local.cancel()  # the others stop at their next tensor or layer

    threads = [threading.Thread(target=run, args=item, name=f"verify {item[0]}", daemon=True) for item in jobs.items()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.1)  # Ctrl-C reaches the main thread between waits
    except BaseException:
        local.cancel()
        for t in threads:
            t.join()
        raise
    finally:
        torch.set_num_threads(previous)
    if errors:
        raise next((e for e in errors if not isinstance(e, MergeCancelled)), errors[0])
    if cancel.cancelled:
        raise MergeCancelled()
    return results
