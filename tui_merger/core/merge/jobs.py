"""Detached merges ("jobs"): a merge that runs in its own process session, so that closing the terminal or
the SSH connection that started it does not stop it; any terminal can follow it later.

A job is a folder ``state_dir()/jobs/ID/``:

    job.json       what to do (merge options, verify, upload), where (cwd, host), the runner's pid, start and
                   end times, the state (running, finished, failed, cancelled), exit code and result
    log.txt        everything the runner prints: plain progress lines, the result, any error
    progress.json  the current phase and its tensor progress, rewritten atomically at most every 0.5 s

The runner (``tui-merger _job-run ID``, in cli/jobs.py) records the end in job.json after its last line of
output. A job whose job.json still says running while its process is gone is reported as died (killed, or
the machine restarted): running the same merge again resumes from its finished shards.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import json_object_or_none
from tui_merger.core.events import Event, PhaseStarted, TensorProgress
from tui_merger.core.record.manifest import state_dir
from tui_merger.core.options import MergeOptions, is_finite_number

RUNNING, FINISHED, FAILED, CANCELLED, DIED = "running", "finished", "failed", "cancelled", "died"
RUNNER_COMMAND = "_job-run"  # the hidden CLI command the detached process runs
JOB_FILE, LOG_FILE, PROGRESS_FILE = "job.json", "log.txt", "progress.json"
_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")


def jobs_dir() -> Path:
    return state_dir() / "jobs"


@dataclass
class Job:
    id: str  # e.g. 20261130-075301-ab12: start time and 4 random hex digits
    state: str  # RUNNING, FINISHED, FAILED, CANCELLED; DIED when read while its process is gone
    started: float  # time.time()
    out: str  # the output folder, absolute
    request: dict  # what the runner does: options (MergeOptions.to_dict()), verify, perplexity, upload_to, public
    cwd: str  # where the merge was asked for: relative paths in the options are relative to it
    host: str
    pid: int | None = None
    ended: float | None = None
    exit_code: int | None = None  # the runner's, as `tui-merger merge` would exit
    result: dict | None = None  # {"verified": True | False | None, "message": one sentence}

    @property
    def folder(self) -> Path:
        return jobs_dir() / self.id

    @property
    def log_path(self) -> Path:
        return self.folder / LOG_FILE

    @property
    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    def progress(self) -> dict | None:
        """The latest progress.json: phase and message, then (once tensors move) done, total, bytes_done,
        bytes_total and tensor; None before the first phase."""
        data = json_object_or_none(self.folder / PROGRESS_FILE)
        if data is None or not isinstance(data.get("phase"), str):
            return None
        for key in ("done", "total", "bytes_done", "bytes_total"):
            if key in data and not (is_finite_number(data[key]) and data[key] >= 0):
                data.pop(key)  # a damaged or edited file: show the phase only
        if not data.get("bytes_total") or "bytes_done" not in data:
            data.pop("bytes_total", None)
        return data


def start_detached(
    options: MergeOptions,
    *,
    verify: bool = True,
    behaviour: bool = True,
    perplexity: Path | None = None,
    upload_to: str | None = None,
    public: bool = False,
) -> Job:
    """Start the merge in its own process session: ``tui-merger _job-run ID``, stdin from /dev/null, output
    into the job's log. Returns the running job. Check the options (preflight) before: the runner checks
    them again, but its errors only reach the log."""
    out = str(Path(options.out).absolute())
    busy = next((j for j in list_jobs() if j.state == RUNNING and j.out == out), None)
    if busy is not None:
        raise MergeError(f"Job {busy.id} is already merging into {out}; follow it with tui-merger attach {busy.id}.")
    request = {
        "options": options.to_dict(),
        "verify": verify,
        "behaviour": behaviour,
        "perplexity": None if perplexity is None else str(perplexity),
        "upload_to": upload_to,
        "public": public,
    }
    job = _create(out, request)
    try:
        with open(job.log_path, "ab") as log, open(os.devnull, "rb") as nothing:
            runner = subprocess.Popen(
                [sys.executable, "-m", "tui_merger", RUNNER_COMMAND, job.id],
                stdin=nothing,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=job.cwd,
                start_new_session=True,  # no controlling terminal: a hang-up never reaches it
            )
    except OSError as err:
        shutil.rmtree(job.folder, ignore_errors=True)
        raise MergeError(f"Could not start the background merge: {err.strerror or err}.") from None
    # reaps the runner when it ends, so that a long-lived caller (the TUI) keeps no zombie
    threading.Thread(target=runner.wait, name="tui-merger-job-reaper", daemon=True).start()
    job.pid = runner.pid
    _update(job, pid=runner.pid)
    return job


def list_jobs() -> list[Job]:
    """Every job, newest first; folders without a readable job.json are skipped."""
    try:
        names = [p.name for p in jobs_dir().iterdir() if _ID.fullmatch(p.name)]
    except OSError:
        return []
    jobs = [job for job in map(_load, names) if job is not None]
    return sorted(jobs, key=lambda j: (j.started, j.id), reverse=True)


def prune_jobs(older_than_days: float) -> list[Job]:
    """Remove the folders (job.json, log, progress) of jobs that are over — finished, failed, cancelled
    or died — and ended more than ``older_than_days`` ago. Running jobs, and jobs of another host whose
    state cannot be known here, are kept; the merged models themselves are never touched. Returns the
    jobs removed."""
    limit = time.time() - older_than_days * 86400
    removed = []
    for job in list_jobs():
        if job.state == RUNNING or (job.ended or job.started) > limit:
            continue
        try:
            shutil.rmtree(job.folder)
        except OSError as err:
            raise MergeError(f"Could not remove {job.folder}: {err.strerror or err}.") from None
        removed.append(job)
    return removed


def read_job(job_id: str) -> Job:
    job = _load(job_id) if _ID.fullmatch(job_id) else None
    if job is None:
        raise MergeError(f"There is no job {job_id}; tui-merger jobs lists them.")
    return job


def find_job(ref: str | None = None) -> Job:
    """The job ``ref`` names: its id or a unique start of one, or "latest" (the newest job). Without ``ref``:
    the newest running job, else the newest job."""
    jobs = list_jobs()
    if not jobs:
        raise MergeError("There are no detached jobs; start one with tui-merger merge ... --detach.")
    if ref is None:
        return next((j for j in jobs if j.state == RUNNING), jobs[0])
    if ref == "latest":
        return jobs[0]
    matches = [j for j in jobs if j.id.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise MergeError(f"No job id starts with {ref}; tui-merger jobs lists them.")
    raise MergeError(
        f"{len(matches)} job ids start with {ref} ({matches[0].id}, {matches[1].id}, ...); type more of the id."
    )


def follow(
    job: Job,
    on_line: Callable[[str], None],
    on_progress: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
    interval: float = 0.2,
) -> Job:
    """Hand the job's log to ``on_line`` from its first line, and each new progress.json to ``on_progress``,
    until the job ends (or dies) or ``stop`` is set. Returns the job as last read: its state says which."""
    offset, partial, progress = 0, b"", None
    while True:
        current = read_job(job.id)  # before the log: a runner that has ended has written its last line
        try:
            with open(current.log_path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        offset += len(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            on_line(line.decode(errors="replace"))
        latest = current.progress() if on_progress is not None else None
        if latest is not None and latest != progress:
            progress = latest
            on_progress(progress)
        if current.state != RUNNING or (stop is not None and stop.is_set()):
            if partial and current.state != RUNNING:
                on_line(partial.decode(errors="replace"))
            return current
        if stop is not None:
            stop.wait(interval)
        else:
            time.sleep(interval)


def finish_job(job: Job, state: str, exit_code: int, message: str, verified: bool | None = None) -> None:
    """Record how the job ended: the runner's last act."""
    _update(job, state=state, exit_code=exit_code, ended=time.time(), result={"verified": verified, "message": message})


class ProgressWriter:
    """The runner's event sink for progress.json: the current phase and its latest tensor counts, written
    at every phase change and at most every ``interval`` seconds in between (best effort: a full disk must
    not stop the merge over a progress file)."""

    def __init__(self, job: Job, interval: float = 0.5) -> None:
        self.path = job.folder / PROGRESS_FILE
        self.interval = interval
        self.state: dict = {}
        self._written = 0.0

    def __call__(self, event: Event) -> None:
        if isinstance(event, PhaseStarted):
            self.state = {"phase": event.phase, "message": event.message}
            self._write()
        elif isinstance(event, TensorProgress):
            first = "done" not in self.state
            self.state.update(
                done=event.tensors_done,
                total=event.tensors_total,
                bytes_done=event.bytes_done,
                bytes_total=event.bytes_total,
                tensor=event.name,
            )
            last = event.tensors_done == event.tensors_total
            if first or last or time.monotonic() - self._written >= self.interval:
                self._write()

    def _write(self) -> None:
        self._written = time.monotonic()
        try:
            _write_json(self.path, {**self.state, "time": time.time()})
        except OSError:
            pass


def _create(out: str, request: dict) -> Job:
    root = jobs_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:
            job_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)
            try:
                (root / job_id).mkdir()
                break
            except FileExistsError:
                continue
        job = Job(id=job_id, state=RUNNING, started=time.time(), out=out, request=request, cwd=os.getcwd(),
                  host=socket.gethostname())
        _write_json(job.folder / JOB_FILE, asdict(job))
    except OSError as err:
        raise MergeError(f"Could not create a job folder in {root}: {err.strerror or err}.") from None
    return job


def _load(job_id: str) -> Job | None:
    data = json_object_or_none(jobs_dir() / job_id / JOB_FILE)
    if data is None:
        return None
    names = {f.name for f in fields(Job)}
    try:
        job = Job(**{k: v for k, v in data.items() if k in names})
    except TypeError:  # fields missing
        return None
    # the folder is removed by prune and named by id: a record whose id is not its folder's name (edited,
    # or copied from another job) could point prune at any folder; odd types would crash the listing
    if job.id != job_id or not _well_typed(job):
        return None
    if job.state == RUNNING and not _runner_alive(job):
        job.state = DIED
        try:
            job.ended = job.log_path.stat().st_mtime  # its last sign of life
        except OSError:
            pass
    return job


def _number(value, optional: bool = False) -> bool:
    if value is None:
        return optional
    return is_finite_number(value) and abs(value) < 1e12


def _well_typed(job: Job) -> bool:
    return (
        all(isinstance(getattr(job, k), str) for k in ("id", "state", "out", "cwd", "host"))
        and _number(job.started) and _number(job.ended, optional=True)
        and isinstance(job.request, dict) and (job.result is None or isinstance(job.result, dict))
        and all(getattr(job, k) is None or type(getattr(job, k)) is int for k in ("pid", "exit_code"))
        and (job.pid is None or job.pid > 0)
    )


def _runner_alive(job: Job) -> bool:
    """Whether the job's runner still runs. On another host (a shared home) this cannot be known: assumed.
    On Linux a reused pid or a zombie does not count: the runner's command line names the job."""
    if job.host != socket.gethostname():
        return True
    if job.pid is None:
        return False
    if Path("/proc/self/cmdline").exists():
        try:
            return job.id.encode() in Path(f"/proc/{job.pid}/cmdline").read_bytes()
        except OSError:
            return False
    try:
        os.kill(job.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _update(job: Job, **changes) -> None:
    path = job.folder / JOB_FILE
    data = json_object_or_none(path) or asdict(job)
    data.update(changes)
    _write_json(path, data)



def _write_json(path: Path, data: dict) -> None:
    """Atomically (temporary file + rename): a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
