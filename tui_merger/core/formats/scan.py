"""``tui-merger inspect``: find the checkpoints under a folder and say what each one is.

Reads names, ``stat`` results, small JSON files, safetensors headers and the key list (``data.pkl``)
of one verl rank file per checkpoint; never tensor data (kohya ``.alpha`` scalars aside: a few bytes
each). Imports nothing heavy, so it answers in milliseconds on a folder of 7B checkpoints.

Every folder down to ``max_depth`` levels below PATH is offered to the kinds in ``registry.ENTRIES``, in
order; the first whose ``detect`` answers owns it (each kind's module documents its rules). Loose
``.safetensors`` files are offered to ``detect_file`` (kohya-style LoRA files).

Checkpoints of one run (``checkpoint-N``/``global_step_N`` folders with the same parent) are listed
together, newest step first; the one ``latest_checkpointed_iteration.txt`` names (else the highest
step) is marked latest. Anything unreadable becomes an :class:`EntryProblem` and the scan goes on.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.ship.cleanup import OPTIMIZER_DIR, OPTIMIZER_FILE
from tui_merger.core.io.hf_refs import cached_snapshot, hf_command, hub_cache, is_repo_id
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.base import Candidate, dominant_dtype, shown
from tui_merger.core.formats.registry import formats
from tui_merger.core.options import human_bytes, plain_number
from tui_merger.core.io.safetensors_io import SafetensorsFile
from tui_merger.core.io.sources import BIN_INDEX, SAFE_INDEX

LATEST_FILE = "latest_checkpointed_iteration.txt"
# never entered below PATH: version control, caches and environments of other tools
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", "node_modules", ".cache", ".venv", "venv", ".tox",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".Trash",
})
MAX_JSON = 16 << 20  # config files are kilobytes; anything this big is not one
MAX_PICKLE = 64 << 20
_SCALAR = {"float32": "<f", "float64": "<d", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B"}
_ROLE_ORDER = {"actor": 0, "critic": 1, "sft": 2}


@dataclass
class EntryProblem:
    path: str
    message: str  # one sentence, to follow the path ("is not valid JSON (...); fix or re-save it.")

    def to_dict(self) -> dict:
        return {"path": shown(self.path), "message": self.message}


@dataclass
class ScanResult:
    root: str
    candidates: list[Candidate]
    problems: list[EntryProblem]
    too_deep: int = 0  # folders not entered because they lie deeper than max_depth
    max_depth: int = 4
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "root": shown(self.root),
            "candidates": [c.to_dict() for c in self.candidates],
            "problems": [p.to_dict() for p in self.problems],
            "too_deep": self.too_deep,
            "max_depth": self.max_depth,
            "seconds": round(self.seconds, 4),
        }


def scan(path, max_depth: int = 4) -> ScanResult:
    """Every checkpoint under ``path`` (a folder, or a single kohya LoRA file), at most ``max_depth``
    folder levels down, with what could not be read. Raises MergeError only when ``path`` itself is
    missing or is neither a folder nor a file."""
    t0 = time.perf_counter()
    if max_depth < 0:
        raise MergeError("The depth must be 0 or more.")
    root = Path(os.path.abspath(os.fspath(path)))
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise MergeError(f"{shown(root)} does not exist; check the path.") from None
    except OSError as err:
        raise MergeError(f"Cannot look at {shown(root)}: {_reason(err)}.") from None
    scanner = _Scanner(root, max_depth)
    if stat.S_ISDIR(st.st_mode):
        scanner.visit(root, 0)
    elif stat.S_ISREG(st.st_mode):
        scanner.single_file(root)
    else:
        raise MergeError(f"{shown(root)} is neither a folder nor a regular file; point inspect at a folder.")
    result = scanner.result()
    result.seconds = time.perf_counter() - t0
    return result


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


class _Scanner:
    def __init__(self, root: Path, max_depth: int) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.max_depth = max_depth
        self.candidates: list[Candidate] = []
        self.problems: dict[str, EntryProblem] = {}  # by path: one problem per entry
        self.too_deep = 0
        self._snapshots: dict[str, Path | None] = {}

    # -- bookkeeping ----------------------------------------------------------------------------
    def problem(self, path, message: str) -> None:
        key = os.fspath(path)
        self.problems.setdefault(key, EntryProblem(key, shown(message)))

    def bad_entry(self, path, err: OSError) -> None:
        """An entry that stat or open failed on: a link loop, a broken link, or unreadable."""
        if err.errno == errno.ELOOP:
            self.problem(path, "is a symbolic link loop; it was not followed.")
        elif err.errno == errno.ENOENT and os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            self.problem(path, f"is a broken symbolic link (to {shown(target)}); it was skipped.")
        else:
            self.problem(path, f"cannot be read ({_reason(err)}); it was skipped.")

    def result(self) -> ScanResult:
        self._mark_latest()
        self.candidates.sort(key=_order)
        problems = sorted(self.problems.values(), key=lambda p: p.path)
        return ScanResult(str(self.root), self.candidates, problems, self.too_deep, self.max_depth)

    # -- walking --------------------------------------------------------------------------------
    def listing(self, folder: Path) -> list[os.DirEntry] | None:
        try:
            with os.scandir(folder) as it:
                return sorted(it, key=lambda e: e.name)
        except OSError as err:
            self.bad_entry(folder, err)
            return None

    def names(self, folder: Path) -> dict[str, os.DirEntry]:
        """The entries of a folder that is part of a checkpoint (quietly empty when absent)."""
        if not folder.is_dir():
            return {}
        return {e.name: e for e in self.listing(folder) or ()}

    def visit(self, folder: Path, depth: int) -> None:
        entries = self.listing(folder)
        if entries is None:
            return
        names = {e.name: e for e in entries}
        found, owned = self.classify(folder, names)
        if found is not None:
            self.candidates.append(found)
            if owned is None:
                return
        for e in entries:
            if e.name in owned:
                continue
            try:
                if e.is_symlink():
                    self.link(e, found is None)
                elif e.is_dir(follow_symlinks=False):
                    if e.name in SKIP_DIRS:
                        continue
                    if depth >= self.max_depth:
                        self.too_deep += 1
                        continue
                    self.visit(Path(e.path), depth + 1)
                elif e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False):
                    self.loose_safetensors(Path(e.path))
            except OSError as err:
                self.bad_entry(e.path, err)

    def link(self, e: os.DirEntry, check_files: bool) -> None:
        """Links are never followed into folders: a loop or a broken link is reported, a link to a
        folder outside PATH is mentioned, one inside PATH is listed where it really is."""
        try:
            st = os.stat(e.path)
        except OSError as err:
            self.bad_entry(e.path, err)
            return
        if stat.S_ISDIR(st.st_mode):
            target = os.path.realpath(e.path)
            here = os.path.realpath(os.path.dirname(e.path))
            if here == target or here.startswith(target + os.sep):
                self.problem(e.path, f"is a symbolic link to its own parent folder {shown(target)} (a loop); it was not followed.")
            elif target != self.real_root and not target.startswith(self.real_root + os.sep):
                self.problem(e.path, f"links to {shown(target)}, outside the scanned folder; it was not followed (inspect that folder itself).")
        elif check_files and e.name.endswith(".safetensors") and stat.S_ISREG(st.st_mode):
            self.loose_safetensors(Path(e.path))

    def single_file(self, path: Path) -> None:
        if path.name.endswith(".safetensors") and self.loose_safetensors(path):
            return
        if str(path) not in self.problems:
            self.problem(path, "is not a kohya-style LoRA file; inspect looks for checkpoints in folders.")

    def classify(self, folder: Path, names: dict) -> tuple[Candidate | None, set | None]:
        """(the checkpoint this folder is, the names it consists of: None when the whole folder)."""
        for fmt in formats():
            found = fmt.detect(self, folder, names)
            if found is not None:
                found.candidate.format = fmt.kind
                return found.candidate, found.owned
        return None, set()

    def loose_safetensors(self, path: Path) -> bool:
        """A loose ``.safetensors`` file that some kind lists (a kohya-style LoRA file); others are not
        checkpoints."""
        for fmt in formats():
            c = fmt.detect_file(self, path)
            if c is not None:
                c.format = fmt.kind
                self.candidates.append(c)
                return True
        return False

    # -- pieces ---------------------------------------------------------------------------------
    def regular(self, path: Path, quiet_missing: bool = False) -> os.stat_result | None:
        """stat of a file about to be read; None (and a problem) when it is not a regular file."""
        try:
            st = os.stat(path)
        except OSError as err:
            if not (quiet_missing and err.errno == errno.ENOENT and not os.path.islink(path)):
                self.bad_entry(path, err)
            return None
        if not stat.S_ISREG(st.st_mode):
            self.problem(path, "is not a regular file (a FIFO, device or folder); it was not read.")
            return None
        return st

    def json(self, path: Path, quiet_missing: bool = True) -> dict | None:
        st = self.regular(path, quiet_missing)
        if st is None:
            return None
        if st.st_size > MAX_JSON:
            self.problem(path, f"is {human_bytes(st.st_size)}, too large to be a config file; it was not read.")
            return None
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except OSError as err:
            self.bad_entry(path, err)
            return None
        except ValueError as err:
            self.problem(path, f"is not valid JSON ({err}); fix or re-save it.")
            return None
        if not isinstance(data, dict):
            self.problem(path, "does not hold a JSON object; fix or re-save it.")
            return None
        return self._typed(path, data)

    def _typed(self, path: Path, data: dict) -> dict:
        """Fields of the wrong type (a damaged or hand-edited file) are said once and left out, so
        that what is shown never depends on them; the merge refuses the file with the same words."""
        from tui_merger.core.formats.adapter import adapter_config_problems
        from tui_merger.core.io.files import config_type_problems, without_problems

        if path.name == "config.json":
            problems = config_type_problems(data)
        elif path.name in ("adapter_config.json", "lora_train_meta.json"):
            problems = adapter_config_problems(data)
        else:
            return data
        if problems:
            self.problem(path, f"has {'; '.join(problems.values())}; the merge would refuse it, so fix or re-save it.")
        return without_problems(data, problems)

    def header(self, path: Path) -> SafetensorsFile | None:
        if self.regular(path) is None:
            return None
        try:
            return SafetensorsFile(path)
        except MergeError as err:
            message = str(err)
            self.problem(path, message[len(str(path)):].lstrip() if message.startswith(str(path)) else message)
            return None

    def headers_dtype(self, folder: Path, files) -> tuple[str | None, list]:
        """(dominant dtype, every header entry) of the safetensors files among ``files``."""
        infos = []
        for name in files:
            if name.endswith(".safetensors"):
                st = self.header(folder / name)
                if st is not None:
                    infos.extend(st.tensors.values())
        return dominant_dtype(infos), infos

    def weight_files(self, folder: Path, names: dict) -> list[str]:
        """The weight files of a model folder as the merge would pick them (safetensors first)."""
        for index in (SAFE_INDEX, BIN_INDEX):
            if index in names:
                data = self.json(folder / index)
                weight_map = data.get("weight_map") if data else None
                if isinstance(weight_map, dict):
                    return sorted({str(v) for v in weight_map.values()})
                if data is not None:
                    self.problem(folder / index, "has no weight_map; the weights it indexes are unknown.")
                return []
        if "model.safetensors" in names:
            return ["model.safetensors"]
        shards = [n for n in names if n.endswith(".safetensors") and not n.startswith("adapter_")]
        if shards:
            return shards
        return ["pytorch_model.bin"] if "pytorch_model.bin" in names else []

    def size(self, entries, recursive: bool, optimizer: bool = False, seen: set | None = None) -> tuple[int, int]:
        """(bytes, optimizer bytes) of the files among ``entries`` (and below, when recursive): apparent
        sizes from stat, file links followed, folder links not, hard links counted once."""
        seen = set() if seen is None else seen
        total = optim = 0
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        sub = self.listing(Path(e.path)) or ()
                        t, o = self.size(sub, True, optimizer or e.name == "optimizer" or OPTIMIZER_DIR.fullmatch(e.name) is not None, seen)
                        total, optim = total + t, optim + o
                    continue
                st = e.stat()
            except OSError as err:
                self.bad_entry(e.path, err)
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            if st.st_nlink > 1:
                seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            if optimizer or OPTIMIZER_FILE.fullmatch(e.name):
                optim += st.st_size
        return total, optim

    def sized(self, c: Candidate, entries, recursive: bool) -> None:
        c.size_bytes, optim = self.size(entries, recursive)
        if optim:
            c.notes.append(f"optimizer state present: {human_bytes(optim)}.")

    def resolve_base(self, c: Candidate, near: Path) -> None:
        """Where the base model named by the checkpoint is on this machine, if anywhere."""
        ref = c.base_model
        if not ref:
            return
        p = Path(ref).expanduser()
        for folder in [p] if p.is_absolute() else [near / p, Path.cwd() / p]:
            if (folder / "config.json").is_file():
                c.base_resolves, c.base_path = "path", os.path.normpath(folder)
                return
        if is_repo_id(ref):
            snapshot = self.snapshot(ref)
            if snapshot is not None:
                c.base_resolves, c.base_path = "hf-cache", str(snapshot)
                return
            c.base_resolves = "missing"
            c.notes.append(
                f"base model {ref} is neither a local folder nor in the Hugging Face cache ({shown(hub_cache())}): "
                f"it would need a download, which tui-merger never does: `{hf_command()} download {ref}` puts it in that cache, "
                "where tui-merger finds it."
            )
        else:
            c.base_resolves = "missing"
            c.notes.append(f"base model folder {ref} does not exist here; pass --base with the model it was trained on.")

    def snapshot(self, repo_id: str) -> Path | None:
        if repo_id not in self._snapshots:
            self._snapshots[repo_id] = cached_snapshot(repo_id)
        return self._snapshots[repo_id]




    def pickled_keys(self, path: Path) -> bytes | None:
        """The pickle of a torch.save archive (its key names and tensor metadata, no tensor data)."""
        if self.regular(path) is None:
            return None
        try:
            with zipfile.ZipFile(path) as z:
                info = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
                if info is not None and info.file_size <= MAX_PICKLE:
                    return z.read(info)
        except (OSError, EOFError, ValueError, NotImplementedError, zipfile.BadZipFile):
            pass
        self.problem(path, "is not a readable torch.save archive (truncated, or still being written?); its keys were not checked.")
        return None





    def scalars(self, path: Path, infos: dict) -> dict:
        """The values of 0-d (or one-element) tensors, read from their few bytes."""
        values = {}
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            self.bad_entry(path, err)
            return values
        try:
            for key, info in infos.items():
                if info.numel != 1:
                    continue
                raw = os.pread(fd, info.nbytes, info.start)
                if info.dtype == "bfloat16":
                    (value,) = struct.unpack("<f", b"\0\0" + raw)
                elif info.dtype in _SCALAR:
                    (value,) = struct.unpack(_SCALAR[info.dtype], raw)
                else:
                    continue
                values[key] = plain_number(round(float(value), 6))
        except (OSError, struct.error) as err:
            self.problem(path, f"its alpha values cannot be read ({err}).")
        finally:
            os.close(fd)
        return values

    # -- latest ---------------------------------------------------------------------------------
    def _mark_latest(self) -> None:
        runs: dict[str, list[Candidate]] = {}
        for c in self.candidates:
            if c.run is not None and c.step is not None:
                runs.setdefault(c.run, []).append(c)
        for run, group in runs.items():
            steps = {c.step for c in group}
            mark = max(steps)
            named = self.latest_named(Path(run) / LATEST_FILE)
            if named == "release":  # Megatron's tracker naming its release/ folder (listed on its own)
                for c in group:
                    c.latest = False
                continue
            if named is not None:
                if named in steps:
                    mark = named
                else:
                    self.problem(
                        Path(run) / LATEST_FILE,
                        f"names step {named}, which is not in the folder; the highest step, {mark}, is marked latest instead.",
                    )
            for c in group:
                c.latest = c.step == mark
            self._mark_best(Path(run), group)

    def _mark_best(self, run: Path, group: list[Candidate]) -> None:
        """The checkpoint HF Trainer's ``best_model_checkpoint`` names (read from the newest
        trainer_state.json of the run: each checkpoint-N keeps the state as of its step). The path it
        records is where the run was written; the folder name is what is matched, so a moved or copied
        run still gets its mark."""
        states = sorted((c.step, Path(c.path) / "trainer_state.json") for c in group)
        for _, path in reversed(states):
            if self.regular(path, quiet_missing=True) is None:
                continue
            state = self.json(path)
            named = state.get("best_model_checkpoint") if state else None
            if isinstance(named, str) and named:
                name = Path(named.rstrip("/\\")).name
                for c in group:
                    c.best = Path(c.path).name == name
            return

    def latest_named(self, path: Path) -> int | str | None:
        if self.regular(path, quiet_missing=True) is None:
            return None
        try:
            with open(path, "rb") as f:
                text = f.read(64).decode("ascii").strip()
            return "release" if text == "release" else int(text)
        except OSError as err:
            self.bad_entry(path, err)
        except ValueError:
            self.problem(path, "does not hold a step number; the highest step is marked latest instead.")
        return None


def _order(c: Candidate):
    """Runs and single checkpoints by path; in a run the final output (no step) first, then newest step first."""
    group = c.run if c.run is not None else c.path
    step = -1 if c.step is None else c.step
    return (group, c.step is not None, -step, _ROLE_ORDER.get(c.role, 3), c.path)
