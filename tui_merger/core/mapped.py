"""A read-only memory-mapped file whose pages can be handed back to the OS after use."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

RELEASE_MARGIN = 2 << 20


class MappedFile:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        self._base_ptr: int | None = None

    def fileno(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def mapping(self) -> mmap.mmap:
        if self._mmap is None:
            self._mmap = mmap.mmap(self.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmap

    def view(self, dtype: str, numel: int, offset: int):
        """A zero-copy torch tensor over bytes of the file (read-only memory: never write to it)."""
        import warnings

        import torch

        if numel == 0:
            return torch.empty(0, dtype=getattr(torch, dtype))
        with warnings.catch_warnings():  # frombuffer warns about read-only buffers
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.mapping(), dtype=getattr(torch, dtype), count=numel, offset=offset)

    def offset_of(self, tensor) -> int | None:
        """Where a view made by ``view`` starts in the file (None when it is not one)."""
        if self._mmap is None or not len(self._mmap):
            return None
        offset = tensor.data_ptr() - self._base()
        return offset if 0 <= offset <= len(self._mmap) else None

    def _base(self) -> int:
        import warnings

        import torch

        if self._base_ptr is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                self._base_ptr = torch.frombuffer(self.mapping(), dtype=torch.uint8, count=1).data_ptr()
        return self._base_ptr

    def advise(self, advice: str) -> None:
        """'random' while scattered small reads (no read-ahead), 'normal' afterwards."""
        flag = getattr(mmap, f"MADV_{advice.upper()}", None)
        if flag is not None:
            try:
                self.mapping().madvise(flag)
            except (OSError, ValueError):
                pass

    def release(self, start: int = 0, end: int | None = None) -> None:
        """Drop mapped pages of [start, end) from this process (the page cache keeps them).

        The range is widened by 2 MiB on each side: a page fault maps cached neighbour pages too
        (fault-around, large folios), and releasing only a tensor's own pages let memory creep up by
        ~25 MB per GB of model. Dropping a neighbour's pages only costs a minor fault later."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        size = len(self._mmap)
        end = size if end is None else end
        start = max(0, (start // RELEASE_MARGIN - 1) * RELEASE_MARGIN)
        end = min(size, (-(-end // RELEASE_MARGIN) + 1) * RELEASE_MARGIN)
        if end > start:
            try:
                self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # a view is still alive somewhere; the GC will unmap it
                pass
            self._mmap = None
            self._base_ptr = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
