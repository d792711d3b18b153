"""The output folder: written in a hidden temporary folder beside it, renamed into place at the end.

An interrupted merge therefore never leaves a folder that looks like a finished model, and an
``--overwrite`` swaps the old folder out only once the new one is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import fsync_path
from tui_merger.core.options import human_bytes

PARTIAL_TAG = ".tui-merger-partial"
LOCK_TAG = ".tui-merger.lock"
# in a finished output until its verification is recorded: what it was merged from (a fingerprint),
# so that the same command run again after an interruption verifies it instead of refusing
PENDING_NAME = ".tui-merger-unverified.json"


class UnverifiedOutput(MergeError):
    """The output holds a finished merge whose verification never ran (``fingerprint``: of its inputs)."""

    def __init__(self, message: str, fingerprint: str | None) -> None:
        super().__init__(message)
        self.fingerprint = fingerprint


def pending_fingerprint(out: Path) -> str | None:
    """The fingerprint in a finished output's pending marker (None: no marker or unreadable)."""
    try:
        data = json.loads((Path(out) / PENDING_NAME).read_text())
    except (OSError, ValueError):
        return None
    value = data.get("fingerprint") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def check_target(out: Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse outputs that would clobber data; raises MergeError with the reason."""
    out_r = out.resolve()
    for src in inputs:
        src_r = src.resolve()
        if out_r == src_r or src_r.is_relative_to(out_r):
            raise MergeError(
                f"The output {out} {'is' if out_r == src_r else 'contains'} the input {src}; "
                "choose another output folder so that no input is overwritten."
            )
    if out.exists() and not out.is_dir():
        raise MergeError(f"{out} exists and is a file; choose a folder path for the output.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        from tui_merger.core.record.manifest import read_manifest

        manifest = read_manifest(out)
        pending = pending_fingerprint(out)
        if pending is not None or (manifest is not None and manifest.get("verification") is None):
            raise UnverifiedOutput(
                f"The output folder {out} already holds a merged model that was never verified (was the merge "
                f"stopped after writing it?); check it with tui-merger verify {out}, or pass --overwrite to merge again.",
                pending,
            )
        raise MergeError(
            f"The output folder {out} exists and is not empty; choose another folder or pass --overwrite."
        )


def check_space(parent: Path, needed: int, what: str = "The merged model", where: str = "an output") -> None:
    """Refuse, in one sentence, to write ``needed`` bytes (plus a margin) where they do not fit."""
    free = shutil.disk_usage(parent).free
    margin = max(64 << 20, needed // 100)
    if free < needed + margin:
        raise MergeError(
            f"{what} needs {human_bytes(needed + margin)} of free space ({human_bytes(needed)} of "
            f"weights plus a {human_bytes(margin)} margin) but {parent} has {human_bytes(free)} free; "
            f"free some space or choose {where} on another disk."
        )


class OutputFolder:
    """The hidden partial folder beside the output (``.NAME.tui-merger-partial``). Its name is fixed so
    that an interrupted merge can be resumed; the output lock keeps two merges out of it."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out).absolute()
        self.parent = self.out.parent
        self.tmp = self.parent / f".{self.out.name}{PARTIAL_TAG}"
        self._made: list[Path] = []  # parent folders we created, removed again on abort

    def make_parents(self) -> None:
        missing = []
        path = self.parent
        while not path.exists() and path != path.parent:
            missing.append(path)
            path = path.parent
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self._made.append(folder)
        except OSError as err:
            self.remove_parents()
            raise MergeError(
                f"Cannot write in {self.parent} ({err.strerror}); choose an output folder you can write to."
            ) from None

    def create(self) -> Path:
        """The partial folder, as an interrupted merge left it, or new (call with the lock held)."""
        try:
            self.tmp.mkdir(exist_ok=True)
        except OSError as err:
            self.remove_parents()
            raise MergeError(
                f"Cannot write in {self.parent} ({err.strerror}); choose an output folder you can write to."
            ) from None
        return self.tmp

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.remove_parents()

    def remove_parents(self) -> None:
        for folder in reversed(self._made):
            try:
                folder.rmdir()
            except OSError:
                break
        self._made.clear()

    def finalize(self, fsync: bool = True) -> None:
        if fsync:  # every file and folder durable before the rename makes them look finished
            for path in sorted(self.tmp.rglob("*"), reverse=True):
                fsync_path(path)
            fsync_path(self.tmp)
        old = None
        if self.out.exists():
            if self.out.is_dir() and not any(self.out.iterdir()):
                self.out.rmdir()
            else:  # --overwrite was given (checked before): swap, then delete the old folder
                old = self.parent / f".{self.out.name}.tui-merger-old-{uuid.uuid4().hex[:8]}"
                os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if fsync:
            fsync_path(self.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


class OutputLock:
    """One merge at a time per output: a lock file beside it (``.NAME.tui-merger.lock``) holding the
    owner's pid, host and start time. A lock left by a process that is gone (on this host) is stale and
    taken over; ``acquire`` returns a notice saying so."""

    def __init__(self, out: Path) -> None:
        out = Path(out).absolute()
        self.path = out.parent / f".{out.name}{LOCK_TAG}"
        self.out = out
        self.held = False

    def acquire(self) -> str | None:
        notice = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and _alive(owner):
                    raise MergeError(
                        f"Another merge (pid {owner.get('pid')} on {owner.get('host')}, started "
                        f"{owner.get('started', 'earlier')}) is writing {self.out}; wait for it to finish or "
                        f"stop it. If no merge is running there, delete {self.path}."
                    ) from None
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                who = f" (pid {owner.get('pid')})" if owner else ""
                notice = f"Took over a stale lock on {self.out} left by a merge that is no longer running{who}."
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            self.held = True
            return notice
        raise MergeError(f"Could not lock {self.out} ({self.path} keeps changing); try again.")

    def _owner(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None  # half-written or unreadable: treated as stale
        return data if isinstance(data, dict) else None

    def release(self) -> None:
        if self.held:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False


def _alive(owner: dict) -> bool:
    """Whether the lock's owner still runs. On another host this cannot be known: assume it does."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """A process that has ended but was not reaped yet (a killed detached job whose parent, often a
    container's init, has not collected it): it holds nothing and writes nothing."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS): as before
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]



def left_on_disk(out: Path) -> str:
    """What a stopped merge left for ``out``, read from the disk now (never assumed): one clause for
    "Interrupted: ...". Ctrl-C twice, a stop during the last shard's rename or during verification
    each leave something else, and the user must know what to delete or run."""
    from shlex import quote

    from tui_merger.core.merge.journal import JOURNAL_NAME
    from tui_merger.core.record.manifest import read_manifest

    out = Path(out).absolute()
    partial = out.parent / f".{out.name}{PARTIAL_TAG}"
    if partial.is_dir():
        try:
            shards = json.loads((partial / JOURNAL_NAME).read_text()).get("shards") or {}
        except (OSError, ValueError, AttributeError):
            shards = {}
        size = sum(p.stat().st_size for p in partial.iterdir() if p.is_file() and not p.is_symlink())
        finished = f"{len(shards)} finished shard(s) journaled" if shards else "no finished shard yet"
        return (f"the partial output {partial} is kept ({finished}, {human_bytes(size)}): run the same merge "
                "again to resume from it, or delete that folder")
    if out.is_dir() and (out / "config.json").is_file():
        manifest = read_manifest(out)
        verification = (manifest or {}).get("verification")
        if pending_fingerprint(out) is None and verification:
            state = "passed" if verification.get("passed") else "FAILED"
            return f"the merged model in {out} is complete and its verification {state}"
        return (f"the merged model in {out} is complete but not verified: run the same merge again to verify it "
                f"(or tui-merger verify {quote(str(out))})")
    return f"nothing of the merge is left on disk (no {out.name}, no partial folder)"
