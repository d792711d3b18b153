"""Resume: the journal of an output being written, kept in its hidden partial folder.

A merge interrupted by Ctrl-C, SIGTERM, SIGHUP, kill -9, a power loss or a full disk leaves the
shards it had finished in ``.NAME.tui-merger-partial/`` with this journal: the fingerprint of the
merge (inputs' identity, the options that shape the output, the shard layout) and, per finished
shard, its size and sha256. Running the same merge again keeps the shards that still match and
writes only the rest; a different fingerprint (changed inputs or options) starts over.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger import __version__
from tui_merger.core.record.manifest import cached_sha256, remember_hash, sha256_file

_HASH_CHUNK = 8 << 20

JOURNAL_NAME = ".tui-merger-journal.json"
_SHAPING = ("base", "adapter", "checkpoint", "dtype", "shard_size", "force_fp16_overflow", "lora_alpha",
            "is_value_model", "tie_word_embedding", "export_adapter", "base_roundtrip", "adapters")


def fingerprint(options, read_files, plan) -> str:
    """What must be equal for finished shards to be reused."""
    stats = []
    for path in sorted({str(p) for p in read_files}):
        st = os.stat(path)
        stats.append((path, st.st_size, st.st_mtime_ns, st.st_ino))
    opts = options.to_dict()
    opts["adapters"] = [[str(p), w] for p, w in options.adapter_weights()]  # --adapter A is the list [A, 1]
    data = {
        "tool": __version__,
        "options": {k: opts.get(k) for k in _SHAPING},
        "inputs": stats,
        "shards": [(name, [(t.name, t.dtype, list(t.shape)) for t in tensors]) for name, tensors in plan.shards],
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Resumable:
    """What running a merge now would keep of its partial folder: ``state`` is "none" (no partial
    folder, or an empty one), "match" (the same inputs and options: ``kept`` shards still match their
    recorded size and sha256) or "mismatch" (another merge's, or unreadable: it is replaced)."""

    state: str
    kept: list[str] = field(default_factory=list)
    kept_bytes: int = 0


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _intact(folder: Path, shards) -> dict[str, dict]:
    """The journaled shards whose file still has the recorded size and sha256 (hashes through the
    user's hash cache: the merge that wrote a shard put its hash there, so checking it again is free)."""
    candidates = {}
    for name, entry in (shards if isinstance(shards, dict) else {}).items():
        path = folder / name
        if isinstance(entry, dict) and os.sep not in name and path.is_file() and not path.is_symlink() \
                and path.stat().st_size == entry.get("size"):
            candidates[name] = entry
    digests = cached_sha256([folder / n for n in candidates])
    return {n: e for (n, e), d in zip(candidates.items(), digests) if d == e.get("sha256")}


def resumable(folder: Path, print_: str) -> Resumable:
    """Read only: the check ``Journal.resume`` makes, for the free-space check and the plan shown
    before a merge (``--dry-run``, the Review step, the plain flow, detached jobs)."""
    folder = Path(folder)
    try:
        present = folder.is_dir() and any(os.scandir(folder))
    except OSError:
        present = False
    if not present:
        return Resumable("none")
    data = _read(folder / JOURNAL_NAME)
    if data is None or data.get("fingerprint") != print_:
        return Resumable("mismatch")
    kept = _intact(folder, data.get("shards"))
    return Resumable("match", sorted(kept), sum((folder / n).stat().st_size for n in kept))


class Journal:
    def __init__(self, folder: Path, print_: str, fsync: bool = True) -> None:
        self.folder = Path(folder)
        self.path = self.folder / JOURNAL_NAME
        self.fingerprint = print_
        self.fsync = fsync
        self.shards: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def resume(self) -> tuple[list[str], str | None]:
        """The finished shards that can be kept, and a notice for the user (None: a fresh start).
        Anything in the folder that cannot be kept is removed."""
        data = _read(self.path)
        kept, notice = [], None
        if data is not None and data.get("fingerprint") == self.fingerprint:
            self.shards.update(_intact(self.folder, data.get("shards")))
            kept = list(self.shards)
            notice = (
                f"Resuming an interrupted merge: {len(kept)} finished shard(s) kept, checked against the journal."
                if kept else None
            )
        elif data is not None:
            notice = "The inputs or options changed since the interrupted merge, so it starts over."
        for entry in os.scandir(self.folder):  # everything not kept goes: partial shards, old files
            if entry.name not in self.shards:
                if entry.is_dir(follow_symlinks=False):
                    import shutil

                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
        self._save()
        return kept, notice

    def finished(self, name: str, digest: str | None = None) -> None:
        """A shard is complete (closed and synced): record it, hashed in the background unless its
        ``digest`` was taken while it was written (``ShardHasher``)."""

        def work() -> None:
            path = self.folder / name
            known = digest or sha256_file(path)
            remember_hash(path, known)  # the manifest takes it from there
            with self._lock:
                self.shards[name] = {"size": path.stat().st_size, "sha256": known}
                self._save()

        thread = threading.Thread(target=work, name=f"hash {name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def wait(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    @property
    def kept(self) -> int:
        with self._lock:
            return len(self.shards)

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"fingerprint": self.fingerprint, "shards": self.shards}, f)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.wait()
        for p in (self.path, self.path.with_name(self.path.name + ".tmp")):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


class ShardHasher(threading.Thread):
    """The sha256 of a shard while it is written. Its byte ranges (the header, then each tensor as
    it is done, in any order: merged tensors and copies come from two threads) are handed in with
    ``add``; the thread hashes the complete prefix, reading it back from the page cache the writer
    has just filled, so the digest is there when the shard is closed instead of costing a second
    pass over the file afterwards (the journal and the manifest take it from there)."""

    def __init__(self, path: Path, size: int) -> None:
        super().__init__(name=f"hash {Path(path).name} while writing", daemon=True)
        self.size = size
        self._fd = os.open(path, os.O_RDONLY)
        self._ranges: dict[int, int] = {}  # start -> end, done but not hashed yet
        self._next = 0
        self._closing = False
        self._stop_now = False
        self._cond = threading.Condition()
        self._sha = hashlib.sha256()

    def add(self, start: int, end: int) -> None:
        if end > start:
            with self._cond:
                self._ranges[start] = end
                self._cond.notify()

    def run(self) -> None:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        try:
            while True:
                with self._cond:
                    while self._next not in self._ranges and not self._stop_now and not self._closing:
                        self._cond.wait()
                    if self._stop_now or self._next not in self._ranges:
                        return
                    start, end = self._next, self._ranges.pop(self._next)
                while start < end:
                    n = os.preadv(self._fd, [view[: min(len(buf), end - start)]], start)
                    if n <= 0:
                        return
                    self._sha.update(view[:n])
                    start += n
                self._next = end
        except OSError:
            return

    def digest(self) -> str | None:
        """Once every range was added: the hex digest (None if the shard was not hashed whole)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self.join()
        os.close(self._fd)
        return self._sha.hexdigest() if self._next == self.size else None

    def abort(self) -> None:
        with self._cond:
            self._stop_now = True
            self._cond.notify()
        self.join()
        os.close(self._fd)
