"""The output folder: written in a hidden temporary folder beside it, renamed into place at the end.

An interrupted merge therefore never leaves a folder that looks like a finished model, and an
``--overwrite`` swaps the old folder out only once the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.options import human_bytes

PARTIAL_TAG = ".tui-merger-partial-"


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
        raise MergeError(
            f"The output folder {out} exists and is not empty; choose another folder or pass --overwrite."
        )


def check_space(parent: Path, needed: int) -> None:
    free = shutil.disk_usage(parent).free
    margin = max(64 << 20, needed // 100)
    if free < needed + margin:
        raise MergeError(
            f"The merged model needs {human_bytes(needed + margin)} of free space ({human_bytes(needed)} of "
            f"weights plus a {human_bytes(margin)} margin) but {parent} has {human_bytes(free)} free; "
            "free some space or choose an output on another disk."
        )


class OutputFolder:
    def __init__(self, out: Path) -> None:
        self.out = Path(out).absolute()
        self.parent = self.out.parent
        self.tmp = self.parent / f".{self.out.name}{PARTIAL_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._made: list[Path] = []  # parent folders we created, removed again on abort

    def existing_ancestor(self) -> Path:
        path = self.parent
        while not path.exists() and path != path.parent:
            path = path.parent
        return path

    def create(self) -> Path:
        missing = []
        path = self.parent
        while not path.exists() and path != path.parent:
            missing.append(path)
            path = path.parent
        try:
            for folder in reversed(missing):
                folder.mkdir()
                self._made.append(folder)
            self.tmp.mkdir()
        except OSError as err:
            self.abort()
            raise MergeError(
                f"Cannot write in {self.parent} ({err.strerror}); choose an output folder you can write to."
            ) from None
        return self.tmp

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        for folder in reversed(self._made):
            try:
                folder.rmdir()
            except OSError:
                break
        self._made.clear()

    def finalize(self, fsync: bool = True) -> None:
        if fsync:  # every file and folder durable before the rename makes them look finished
            for path in sorted(self.tmp.rglob("*"), reverse=True):
                _fsync_path(path)
            _fsync_path(self.tmp)
        old = None
        if self.out.exists():
            if self.out.is_dir() and not any(self.out.iterdir()):
                self.out.rmdir()
            else:  # --overwrite was given (checked before): swap, then delete the old folder
                old = self.parent / f".{self.out.name}.tui-merger-old-{uuid.uuid4().hex[:8]}"
                os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if fsync:
            _fsync_path(self.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
