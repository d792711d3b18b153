"""Provenance: ``merge_manifest.json`` in every output, and the user's merge history.

The manifest records what was merged (inputs with sha256), how (adapter settings, the exact
options), what came out (per-file sha256), how long it took and what verification found. Cleanup
trusts only merges whose manifest says verification passed; upload and the model card read it.

Schema (``format: tui-merger-manifest/1``)::

    {
      "format": "tui-merger-manifest/1",
      "tool": {"name": "tui-merger", "version": "0.1.0"},
      "merged_at": "2026-11-30T06:30:00+00:00",
      "kind": "merge" | "export-adapter" | "convert",
      "inputs": [{"role": "base" | "adapter" | "checkpoint", "path": "/abs/folder",
                  "files": [{"path": "rel/name", "size": 123, "sha256": "..."}]}],
      "adapter": null | {"r": 16, "alpha": 32, "variant": "lora" | "rslora" | "dora",
                         "target_modules": [...], "modules_to_save": [...], "base_model": "..."},
      "base_model": "Qwen/Qwen2.5-0.5B" | "/abs/path" | null,   (what the adapter or checkpoint names)
      "base_used": null | {"folder": "base", "repo": "ORG/NAME" | null, "named": "..." | null,
                           "named_is_this": false, "named_found": false, "modules": 28,
                           "architecture": "Qwen2ForCausalLM, 24 layers"},   (adapter merges; optional)
      "options": {...MergeOptions.to_dict()},
      "outputs": [{"path": "model.safetensors", "size": 123, "sha256": "..."}],
      "timings": {"merge_s": 1.2, "hash_s": 0.4, "verify_s": 3.1},
      "verification": null | {"passed": true, "summary": "...", "checks": [...]},
      "gguf": [{"path": "merged-Q8_0.gguf" | "/abs/file.gguf", "size": 123, "sha256": "...", "type": "q8_0",
                "architecture": "qwen2", "name": "...", "made_at": "...", "tool": {...}}]  (tui-merger gguf; optional)
      "gguf_lora": [{"path": "/abs/adapter/x-LoRA-F32.gguf", "size": 1, "sha256": "...", "type": "f32", "adapter": "/abs/adapter",
                     "base_gguf": "x-F16.gguf", "pairs": 28, "experts": 0, "ranks": [8], "alpha": 16.0, "check": {...}, ...}]
                   (tui-merger gguf --adapter, ship/gguf_lora.py; optional)
    }
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path


MANIFEST_NAME = "merge_manifest.json"
FORMAT = "tui-merger-manifest/1"
HISTORY_NAME = "history.jsonl"
_HASH_CHUNK = 8 << 20
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


def state_dir() -> Path:
    """Where tui-merger keeps its own state (history, jobs): $XDG_STATE_HOME/tui-merger."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tui-merger"


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tui-merger"


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def sha256_file(path: Path) -> str:
    """The file's sha256. Files in a Hugging Face cache snapshot are symlinks to blobs named by their
    sha256 (LFS files): that name is used as is, without reading gigabytes again."""
    path = Path(path)
    if path.is_symlink():
        target = path.resolve()
        if target.parent.name == "blobs" and _SHA256_NAME.fullmatch(target.name):
            return target.name
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_HASH_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


class InputHasher(threading.Thread):
    """Hashes a merge's input files into the hash cache while the merge runs (one thread, 8 MiB reads, no
    mapping: nothing held), so that the manifest afterwards finds them there instead of reading them all
    after the merge. A DeepSpeed checkpoint's optimizer files hold Adam's moments beside the masters: 3x
    the bytes the merge reads, hashed whole (a 1.5B ZeRO-3 run: 18.5 GB hashed after an 81 s merge).
    ``describe_files`` waits for it; ``stop`` ends it within one read."""

    _running: list = []
    _lock = threading.Lock()

    def __init__(self, paths) -> None:
        super().__init__(name="hash inputs while merging", daemon=True)
        self.paths = [Path(p) for p in dict.fromkeys(paths)]
        self._halt = threading.Event()

    def start(self) -> None:
        with InputHasher._lock:
            InputHasher._running.append(self)
        super().start()

    def run(self) -> None:
        for path in self.paths:
            if self._halt.is_set():
                return
            try:
                if path.is_symlink() and (t := path.resolve()).parent.name == "blobs" and _SHA256_NAME.fullmatch(t.name):
                    continue  # named by its sha256: nothing to read
                cache = _HashCache()
                key = cache._key(path)
                if key is None or isinstance(cache.entries.get(key), str):
                    continue
                digest = hashlib.sha256()
                with open(path, "rb", buffering=0) as f:
                    buf = bytearray(_HASH_CHUNK)
                    view = memoryview(buf)
                    while not self._halt.is_set():
                        n = f.readinto(buf)
                        if not n:
                            break
                        digest.update(view[:n])
                    else:
                        return
                if cache._key(path) == key:  # unchanged while read
                    remember_hash(path, digest.hexdigest())
            except OSError:
                continue

    def stop(self) -> None:
        self._halt.set()
        self.join()

    @classmethod
    def wait_all(cls) -> None:
        with cls._lock:
            running, cls._running = cls._running, []
        for hasher in running:
            hasher.join()


def describe_files(folder: Path, names: list[str]) -> list[dict]:
    """[{path, size, sha256}] for files relative to ``folder``, hashed on two threads (hashlib releases
    the GIL on large buffers). Large files hashed before and unchanged since (same inode, size, mtime
    and ctime) take their hash from the user's hash cache: merging several adapters into one base
    reads the base's gigabytes for hashing once."""
    from concurrent.futures import ThreadPoolExecutor

    folder = Path(folder)
    names = sorted(set(names))
    InputHasher.wait_all()  # the inputs hashed while the merge ran are in the cache then
    cache = _HashCache()
    with ThreadPoolExecutor(max_workers=2) as pool:
        hashes = list(pool.map(lambda n: cache.sha256(folder / n), names))
    cache.save()
    return [
        {"path": n, "size": (folder / n).stat().st_size, "sha256": h} for n, h in zip(names, hashes)
    ]


def remember_hash(path: Path, digest: str) -> None:
    """Put a freshly computed sha256 into the hash cache (the merge hashes finished shards for its
    journal; the manifest then finds them there, also after the output folder was renamed)."""
    key = _HashCache._key(Path(path))
    if key is not None:
        with _HASH_CACHE_LOCK:  # shards finish on several threads: no update may overwrite another
            cache = _HashCache()
            cache.entries[key] = digest
            cache.changed = True
            cache.save()


def cached_sha256(paths) -> list[str]:
    """sha256 of each file, through the user's hash cache: a file hashed before and unchanged since
    (same inode, size, mtime, ctime) is not read again."""
    cache = _HashCache()
    digests = [cache.sha256(Path(p)) for p in paths]
    with _HASH_CACHE_LOCK:
        cache.save()
    return digests


_HASH_CACHE_LOCK = threading.Lock()


class _HashCache:
    """sha256 of large files by identity (device, inode, size, mtime, ctime: a rename keeps it, any
    write changes it), in $XDG_STATE_HOME/tui-merger/hashes.json (best effort)."""

    MIN_SIZE = 1 << 20
    MAX_ENTRIES = 5000

    def __init__(self) -> None:
        self.path = state_dir() / "hashes.json"
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        self.entries: dict = data if isinstance(data, dict) else {}
        self.changed = False

    @staticmethod
    def _key(path: Path) -> str | None:
        st = path.stat()
        if st.st_size < _HashCache.MIN_SIZE:
            return None
        return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def sha256(self, path: Path) -> str:
        key = self._key(path)
        hit = self.entries.get(key) if key is not None else None
        if isinstance(hit, str):
            return hit
        digest = sha256_file(path)
        if key is not None:
            self.entries[key] = digest
            self.changed = True
        return digest

    def save(self) -> None:
        """Write the entries back, joined with what another thread or process saved since this cache
        was read (a lost entry only costs a re-read, but the merge promises none). Processes take turns
        through a lock file where the system has ``flock``."""
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(".hashes.lock"), "a") as lock:
                try:
                    import fcntl

                    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
                except (ImportError, OSError):
                    pass  # no flock (Windows, some network file systems): threads are still serialised
                try:
                    on_disk = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    on_disk = {}
                merged = on_disk if isinstance(on_disk, dict) else {}
                merged.update(self.entries)
                entries = dict(list(merged.items())[-self.MAX_ENTRIES :])
                tmp = self.path.with_name(f".hashes.json.tmp-{os.getpid()}-{threading.get_ident()}")
                tmp.write_text(json.dumps(entries))
                os.replace(tmp, self.path)
        except OSError:
            pass


def read_manifest(folder: Path) -> dict | None:
    """The manifest of a merged model folder, or None when it has none or it cannot be read."""
    path = Path(folder) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not _well_formed(data):
        return None
    return data


def _files_ok(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(f, dict) and isinstance(f.get("path"), str) and type(f.get("size")) is int
        and isinstance(f.get("sha256"), str) for f in value
    )


def _well_formed(data: dict) -> bool:
    """The schema above, as far as anything reads it: a manifest edited by hand into other types is
    treated as unreadable (cleanup then protects the folder; verify asks what it was merged from)."""
    inputs, adapter, ver = data.get("inputs", []), data.get("adapter"), data.get("verification")
    return (
        isinstance(data.get("kind", "merge"), str)
        and all(isinstance(data.get(k, {}), dict) for k in ("tool", "options", "timings"))
        and all(data.get(k) is None or isinstance(data[k], str) for k in ("merged_at", "base_model", "out"))
        and isinstance(inputs, list)
        and all(isinstance(i, dict) and isinstance(i.get("role"), str) and isinstance(i.get("path"), str)
                and _files_ok(i.get("files", [])) for i in inputs)
        and _files_ok(data.get("outputs", []))
        and _files_ok(data.get("gguf", []))
        and (adapter is None or (isinstance(adapter, dict) and isinstance(adapter.get("adapters", []), list)
                                 and all(isinstance(a, dict) for a in adapter.get("adapters", []))))
        and (ver is None or (isinstance(ver, dict) and isinstance(ver.get("passed"), bool)
                             and isinstance(ver.get("summary", ""), str) and isinstance(ver.get("checks", []), list)
                             and all(isinstance(c, dict) for c in ver.get("checks", []))))
    )


def write_manifest(folder: Path, manifest: dict, fsync: bool = True) -> None:
    """Write atomically (temporary file + rename) so a reader never sees half a manifest."""
    folder = Path(folder)
    tmp = folder / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)


def verification_passed(manifest: dict | None) -> bool:
    ver = (manifest or {}).get("verification")
    return isinstance(ver, dict) and ver.get("passed") is True


def record_history(out: Path, manifest: dict) -> None:
    """Append the merge to the user's history (used by cleanup to find merges made from a folder).
    Best effort: a read-only home must not fail a merge."""
    entry = {
        "out": str(Path(out).absolute()),
        "merged_at": manifest.get("merged_at"),
        "inputs": [i.get("path") for i in manifest.get("inputs", [])],
        "recorded": time.time(),
    }
    try:
        folder = state_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / HISTORY_NAME, "a") as f:
            f.write(json.dumps(entry) + "\n")
    except OSError:
        pass


def read_history() -> list[dict]:
    try:
        lines = (state_dir() / HISTORY_NAME).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("out"), str):
            out.append(entry)
    return out
