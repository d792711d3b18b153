"""What a verified merge made unnecessary in a training folder, and deleting it safely.

A merge counts when its ``merge_manifest.json`` (in the output folder) names inputs inside the folder.
Merges are found from ``--merged`` folders, the user's merge history and manifests under the folder.
Nothing is offered unless one of them passed verification. Never offered: a merge's output, an input
of a merge that did not pass verification, anything outside the folder. Links are removed as links;
their targets are never touched and linked folders are never entered.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from tui_merger.core.errors import MergeError
from tui_merger.core.events import Event, EventSink, ignore_event
from tui_merger.core.record.manifest import MANIFEST_NAME, read_history, read_manifest, verification_passed

OPTIMIZER, RESUME, CHECKPOINT, MERGED_INPUTS, CACHE = (
    "optimizer", "resume-state", "checkpoint", "merged-inputs", "cache"
)
KINDS = (OPTIMIZER, RESUME, CHECKPOINT, MERGED_INPUTS, CACHE)

STEP_DIR = re.compile(r"(?:global_step_|checkpoint-)(\d+)")
CACHE_DIRS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
OPTIMIZER_FILE = re.compile(r"optim_world_size_\d+_rank_\d+\.pt|optimizer\.(?:pt|bin)|.*optim_states\.pt")
RESUME_FILE = re.compile(
    r"extra_state_world_size_\d+_rank_\d+\.pt|scheduler\.(?:pt|bin)|rng_state.*\.pth|random_states_\d+\.pkl"
)
DATALOADER_FILE = re.compile(r"data(?:_\d+)?\.pt")  # verl's dataloader state, directly in global_step_N/
OPTIMIZER_DIR = re.compile(r"optimizer_\d+")  # accelerate FSDP's sharded optimizer (a DCP folder) in checkpoint-N/


@dataclass(frozen=True)
class Merge:
    out: Path
    inputs: tuple[Path, ...]  # the folders holding the files it read, where they overlap the cleaned folder
    problem: str | None  # why it does not count as verified ("has not passed verification"); None when it does
    manifest: dict = field(repr=False, compare=False)

    @property
    def verified(self) -> bool:
        return self.problem is None


@dataclass
class CleanupItem:
    kind: str
    label: str  # relative to the cleaned folder
    paths: tuple[Path, ...]
    size: int
    reason: str
    selected_by_default: bool


@dataclass
class CleanupPlan:
    root: Path
    items: list[CleanupItem]
    protected: list[tuple[Path, str]]
    merges: list[Merge]  # the merges made from the folder
    listed: dict[Path, tuple[int, int, int]] = field(default_factory=dict)  # (st_dev, st_ino, bytes) when listed

    def default_selection(self) -> list[CleanupItem]:
        return [i for i in self.items if i.selected_by_default]


@dataclass(frozen=True)
class ItemDeleted(Event):
    item: CleanupItem
    freed: int
    error: str | None  # why (part of) it is still there; None when all of it went


def find_cleanup(path: Path, merged: Iterable[Path] = ()) -> CleanupPlan:
    """What in ``path`` the verified merges from it made unnecessary; ``merged``: merged folders the user
    named. Raises MergeError when no merge from ``path`` passed verification."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise MergeError(f"{path} is not a folder; point cleanup at a training run folder.")
    if Path.home().resolve().is_relative_to(root):
        raise MergeError(f"Refusing to clean {root}: it is / or holds your home folder; point at a training run folder.")
    scan = _Scan(root)
    merges = _find_merges(root, [Path(m).expanduser().resolve() for m in merged], scan.outputs)
    if not any(m.verified for m in merges):
        if merges:
            m = merges[0]
            raise MergeError(
                f"No merge from {root} has passed verification: the merge into {m.out} {m.problem}; run "
                f"`tui-merger verify {m.out}` first, then clean up again."
            )
        raise MergeError(
            f"Found no merge made from {root}; merge it, check the result with `tui-merger verify OUT`, then "
            "clean up again (name the merged folder with --merged OUT if it is not in your merge history)."
        )

    outputs = scan.outputs | {m.out for m in merges if _overlaps(m.out, root)}
    protected = [(out, "a merged model") for out in sorted(outputs)]
    for m in (m for m in merges if not m.verified):
        why = f"read by the merge into {m.out}, which {m.problem}; run `tui-merger verify {m.out}` first"
        protected += [(p, why) for p in m.inputs]
    return _Planner(root, scan, merges, protected).plan()


def delete_items(plan: CleanupPlan, items: list[CleanupItem], on_event: EventSink = ignore_event) -> int:
    """Delete ``items``, checking each path again just before; reports each item. Returns the bytes freed."""
    total = 0
    for item in items:
        freed, error = 0, None
        for path in item.paths:
            if not os.path.lexists(path):
                continue  # gone meanwhile, not by us
            problem = _still_safe(plan, path)
            if problem is None:
                problem = _remove(path, plan.root)
                freed += max(plan.listed[path][2] - _size(path, set()), 0)
            error = error or problem
        total += freed
        on_event(ItemDeleted(item, freed, error))
    return total


def _overlaps(a: Path, b: Path) -> bool:
    return a.is_relative_to(b) or b.is_relative_to(a)


def _real(path: Path) -> Path:
    """The path with every folder above it resolved, the last part kept (a link stays a link)."""
    return path.parent.resolve() / path.name


def _step(path: Path) -> int | None:
    m = STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _step_dir(path: Path) -> Path | None:
    return next((p for p in (path, *path.parents) if _step(p) is not None), None)


def _unit(path: Path) -> Path:
    """The checkpoint a path belongs to: its checkpoint-N / global_step_N folder, else the folder itself
    (a final save at the top of a run is not the checkpoint-N folders beside it)."""
    return _step_dir(path) or path


def _size(path: Path, seen: set) -> int:
    """Bytes under ``path`` from lstat, not following links; a hard-linked file counts once in ``seen``."""
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(path) as entries:
                return sum(_size(Path(e.path), seen) for e in list(entries))
    except OSError:
        return 0
    if st.st_nlink > 1:
        if (st.st_dev, st.st_ino) in seen:
            return 0
        seen.add((st.st_dev, st.st_ino))
    return st.st_size


class _Scan:
    """One walk of the folder, never entering a linked folder, a cache or a merged model."""

    def __init__(self, root: Path) -> None:
        self.outputs: set[Path] = set()
        self.steps: list[Path] = []
        self.caches: list[Path] = []
        self.files: list[tuple[str, Path]] = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            folder = Path(dirpath)
            dirnames.sort()
            if MANIFEST_NAME in filenames:
                self.outputs.add(folder)
                dirnames[:] = []
                continue
            for name in list(dirnames):
                if name in CACHE_DIRS:
                    self.caches.append(folder / name)
                    dirnames.remove(name)
                elif STEP_DIR.fullmatch(name):
                    self.steps.append(folder / name)
                elif OPTIMIZER_DIR.fullmatch(name) and _step_dir(folder) is not None:
                    self.files.append((OPTIMIZER, folder / name))
                    dirnames.remove(name)
            for name in sorted(filenames):
                if OPTIMIZER_FILE.fullmatch(name):
                    self.files.append((OPTIMIZER, folder / name))
                elif RESUME_FILE.fullmatch(name) or (
                    DATALOADER_FILE.fullmatch(name) and folder.name.startswith("global_step_")
                ):
                    self.files.append((RESUME, folder / name))


def _find_merges(root: Path, merged: list[Path], outputs: set[Path]) -> list[Merge]:
    """Merges made from ``root``: named with --merged, in the user's history, or found under ``root``."""
    for out in merged:
        manifest = read_manifest(out)
        if manifest is None:
            raise MergeError(f"{out} has no readable {MANIFEST_NAME}; --merged takes a folder tui-merger merged into.")
        if not _input_roots(manifest, root):
            raise MergeError(f"{out} was not merged from anything in {root}; check the --merged folder.")
    history = [
        Path(e["out"]).resolve()
        for e in read_history()
        if any(isinstance(p, str) and _overlaps(Path(p).resolve(), root) for p in e.get("inputs") or [])
    ]
    merges = []
    for out in dict.fromkeys([*merged, *history, *sorted(outputs)]):
        manifest = read_manifest(out)  # None: moved or deleted since (history), or unreadable (protected)
        inputs = _input_roots(manifest, root) if manifest else []
        if inputs:
            merges.append(Merge(out, tuple(inputs), _problem(out, manifest), manifest))
    return merges


def _inputs(manifest: dict):
    """(role, folder, [file names]) of each input of a manifest."""
    for inp in manifest.get("inputs") or []:
        if isinstance(inp, dict) and isinstance(inp.get("path"), str):
            names = [f["path"] for f in inp.get("files") or [] if isinstance(f, dict) and isinstance(f.get("path"), str)]
            yield inp.get("role"), Path(inp["path"]), names


def _input_roots(manifest: dict, root: Path) -> list[Path]:
    """For each input overlapping ``root``: the folder holding the files the merge read from it (a run
    folder given as input resolves to the global_step_N/actor folder that was read)."""
    roots = []
    for _, folder, names in _inputs(manifest):
        top = Path(os.path.commonpath([str((folder / n).parent) for n in names])) if names else folder
        top = top.resolve()
        if _overlaps(top, root) and top not in roots:
            roots.append(top)
    return roots


def _input_files(manifest: dict, root: Path) -> list[Path]:
    """Files a merge read from a checkpoint or adapter (not from its base model) inside ``root``."""
    files = []
    for role, folder, names in _inputs(manifest):
        if role != "base":
            paths = (_real(folder / n) for n in names)
            files += [p for p in paths if p.is_relative_to(root) and p != root and os.path.lexists(p)]
    return files


def _problem(out: Path, manifest: dict) -> str | None:
    """Why a merge does not count as verified, said of it ("the merge into OUT ..."), or None."""
    if not verification_passed(manifest):
        return "has not passed verification"
    for f in manifest.get("outputs") or []:
        name = f.get("path") if isinstance(f, dict) else None
        if not name:
            continue
        try:
            if (out / name).stat().st_size != f.get("size"):
                return f"has a different {name} than when it was verified"
        except OSError:
            return f"lost {name} after it was verified"
    return None


class _Planner:
    def __init__(self, root: Path, scan: _Scan, merges: list[Merge], protected: list[tuple[Path, str]]) -> None:
        self.root, self.scan, self.merges, self.protected = root, scan, merges, protected
        self.verified = [m for m in merges if m.verified]
        self.merged_roots = [p for m in self.verified for p in m.inputs]
        self.merged_units = {_unit(p) for p in self.merged_roots}
        # run folders whose own final save (not a checkpoint-N in them) was merged and verified
        self.final_merged = {p for p in self.merged_roots if _step_dir(p) is None}
        self.newest: dict[Path, Path] = {}  # folder -> its newest checkpoint that was merged and verified
        for p in self.merged_roots:
            step = _step_dir(p)
            best = self.newest.get(step.parent) if step else None
            if step and (best is None or _step(step) > _step(best)):
                self.newest[step.parent] = step
        self.seen: set = set()
        self.listed: dict[Path, tuple[int, int, int]] = {}  # every path of every item
        self.items: list[CleanupItem] = []

    def plan(self) -> CleanupPlan:
        inputs = [p for m in self.merges for p in m.inputs]
        for step in sorted(self.scan.steps, key=lambda p: (p.parent, _step(p))):
            if not any(p.is_relative_to(step) for p in inputs):  # not a checkpoint a merge read from
                self._checkpoint(step)
        # a file a verified merge read is one of its inputs whatever its name: a DeepSpeed ZeRO run's
        # optimizer files hold its fp32 master weights, not only what resuming needs
        read = {p for m in self.verified for p in _input_files(m.manifest, self.root)}
        groups: dict[tuple[str, Path], list[Path]] = {}
        for kind, path in self.scan.files:
            if path not in read:
                groups.setdefault((kind, path.parent), []).append(path)
        for (kind, folder), paths in groups.items():
            self._state(kind, folder, paths)
        for m in self.verified:
            why = f"read by the merge into {m.out}, which passed verification"
            self._add(MERGED_INPUTS, _input_files(m.manifest, self.root), why, False)
        self._add(CACHE, self.scan.caches, "cache, rebuilt when needed", True)
        return CleanupPlan(self.root, self.items, self.protected, self.merges, self.listed)

    def _checkpoint(self, step: Path) -> None:
        newest = self.newest.get(step.parent)
        if newest is None and step.parent in self.final_merged:
            where = "this folder" if step.parent == self.root else _rel(step.parent, self.root)
            why, selected = (
                f"checkpoint that was not merged; the final save of its run (at the top of {where}) was merged and "
                "verified, so it is only needed to resume training or to merge this step", False)
        elif newest is None:
            why, selected = "checkpoint that was not merged", False
        elif _step(step) < _step(newest):
            why, selected = f"checkpoint older than {newest.name}, which was merged and verified", True
        else:
            why, selected = f"checkpoint newer than the merged {newest.name}", False
        self._add(CHECKPOINT, [step], why, selected)

    def _state(self, kind: str, folder: Path, paths: list[Path]) -> None:
        what = "optimizer state" if kind == OPTIMIZER else "scheduler, RNG or data-loader state"
        step = _step_dir(folder)
        newest = self.newest.get(step.parent) if step else None
        if _unit(folder) in self.merged_units:
            why, selected = f"{what} of {_unit(folder).name}, the merged checkpoint, only needed to resume training", True
        elif step and newest and _step(step) <= _step(newest):
            why, selected = f"{what} of {step.name}, only needed to resume training", True
        else:
            where = step.name if step else folder.name
            why, selected = f"{what}; {where} was not merged and may still be needed to resume training", False
        self._add(kind, paths, why, selected)

    def _add(self, kind: str, paths: list[Path], reason: str, selected: bool) -> None:
        paths = sorted(
            p for p in set(paths)
            if not any(_overlaps(p, q) for q, _ in self.protected)
            and not any(q in self.listed for q in (p, *p.parents))  # already in an item
        )
        if not paths:
            return
        for p in paths:
            st = os.lstat(p)
            self.listed[p] = (st.st_dev, st.st_ino, _size(p, self.seen))
        size = sum(self.listed[p][2] for p in paths)
        self.items.append(CleanupItem(kind, self._label(kind, paths), tuple(paths), size, reason, selected))

    def _label(self, kind: str, paths: list[Path]) -> str:
        if len(paths) == 1:
            return _rel(paths[0], self.root)
        if kind == MERGED_INPUTS:
            common = Path(os.path.commonpath(paths))
            where = "at the top of this folder" if common == self.root else f"under {_rel(common, self.root)}"
            return f"{len(paths)} files {where}"  # not "under ./" (a user does not read "." as a folder)
        if kind == CACHE:
            return f"{len(paths)} cache folders"
        return f"{_rel(paths[0], self.root)} and {len(paths) - 1} more"


def _rel(path: Path, root: Path) -> str:
    """How a path is shown: relative to the cleaned folder, "/" after a folder, "(link)" after a link."""
    text = str(path.relative_to(root)) if path != root else "."
    if path.is_symlink():
        return text + " (link)"
    return text + "/" if path.is_dir() else text


def _still_safe(plan: CleanupPlan, path: Path) -> str | None:
    """Why ``path`` must not be deleted now (checked again just before deleting), or None."""
    where = _rel(path, plan.root) if path.is_relative_to(plan.root) else str(path)
    if not path.is_relative_to(plan.root) or path == plan.root or _real(path) != path:
        return f"{where}: skipped, a folder above it was moved or replaced by a link"
    for p, why in plan.protected:
        if _overlaps(path, p):
            return f"{where}: skipped, protected ({why})"
    st = os.lstat(path)
    if plan.listed[path][:2] != (st.st_dev, st.st_ino):
        return f"{where}: skipped, it was replaced after it was listed"
    if stat.S_ISDIR(st.st_mode) and any(MANIFEST_NAME in files for _, _, files in os.walk(path)):
        return f"{where}: skipped, it now holds a merged model"
    return None


def _remove(path: Path, root: Path) -> str | None:
    """Remove a file, a link (never its target) or a folder tree (links inside removed as links)."""
    errors: list[tuple[str, OSError]] = []
    try:
        if path.is_dir() and not path.is_symlink():
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=lambda func, p, err: errors.append((p, err)))
            else:
                shutil.rmtree(path, onerror=lambda func, p, info: errors.append((p, info[1])))
        else:
            path.unlink()
    except OSError as err:
        errors.append((str(path), err))
    if not errors:
        return None
    failed, err = Path(errors[0][0]), errors[0][1]
    where = _rel(failed, root) if failed.is_relative_to(root) else str(failed)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {err.strerror or err}{more}"
