"""Read-only, lazy tensor sources shared by every checkpoint kind. A source lists tensors from headers (no data read) and loads one
tensor on demand. Safetensors are mmap'd; ``.bin`` files go through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.safetensors_io import SafetensorsFile, nbytes_of


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor lives: a file and the name inside it, plus what its header says."""

    source: "TensorSource"
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    def load(self):
        return self.source.load(self)

    def load_into(self, out) -> None:
        """Fill ``out`` (this tensor's shape, any dtype) without an intermediate full copy."""
        self.source.load_into(self, out)

    def release(self) -> None:
        self.source.release(self)

    def release_rows(self, start: int, stop: int) -> None:
        """Hand back the pages of some rows (sources that are not mapped files: nothing to do)."""
        release_rows = getattr(self.source, "release_rows", None)
        if release_rows is not None:
            release_rows(self, start, stop)

    def prefetch_rows(self, start: int, stop: int) -> None:
        """About to read rows [start, stop): map their bytes at once (mapped files only)."""
        prefetch_rows = getattr(self.source, "prefetch_rows", None)
        if prefetch_rows is not None:
            prefetch_rows(self, start, stop)

    def prefetch(self) -> None:
        """About to be read whole: map its bytes at once (a no-op for sources that are not mapped files)."""
        prefetch = getattr(self.source, "prefetch", None)
        if prefetch is not None:
            prefetch(self)


class TensorSource:
    """A set of weight files in one folder."""

    def __init__(self, folder: Path, files: list[str]) -> None:
        self.folder = Path(folder)
        self.files = files
        self.tensors: dict[str, TensorRef] = {}
        self._st: dict[str, SafetensorsFile] = {}
        self._bin: dict[str, dict] = {}
        for fname in files:
            self._index_file(fname)

    def _index_file(self, fname: str) -> None:
        path = self.folder / fname
        if not path.is_file():
            raise MergeError(
                f"{path} is missing; the weights in {self.folder} are incomplete: copy the whole folder again."
            )
        if fname.endswith(".safetensors"):
            st = SafetensorsFile(path)
            self._st[fname] = st
            # in file order, so that reading and copying run forward through each file
            for name, info in sorted(st.tensors.items(), key=lambda kv: kv[1].start):
                self._add(TensorRef(self, fname, name, info.dtype, info.shape))
        else:
            for name, tensor in self._load_bin(fname).items():
                dtype = str(tensor.dtype).removeprefix("torch.")
                self._add(TensorRef(self, fname, name, dtype, tuple(tensor.shape)))

    def _add(self, ref: TensorRef) -> None:
        if ref.name in self.tensors:
            raise MergeError(
                f"Tensor {ref.name} appears in both {self.tensors[ref.name].file} and {ref.file} "
                f"in {self.folder}; remove the stale file."
            )
        self.tensors[ref.name] = ref

    def _load_bin(self, fname: str) -> dict:
        if fname not in self._bin:
            import zipfile

            import torch

            path = self.folder / fname
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except Exception as err:  # a damaged file can make torch.load raise anything; no code runs here
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise MergeError(
                    f"{path} could not be read as a PyTorch weights file ({first[:200]}); "
                    "it may be truncated, corrupt, or need code to load, which tui-merger never runs."
                ) from None
            if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
                state = state["state_dict"]
            if not isinstance(state, dict):
                raise MergeError(f"{path} does not hold a dictionary of tensors.")
            from tui_merger.core.io.torch_pickle import require_names

            require_names(path, state)
            tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            self._bin[fname] = tensors
        return self._bin[fname]

    # -- data ----------------------------------------------------------------------------------
    def load(self, ref: TensorRef):
        if ref.file in self._st:
            return self._st[ref.file].tensor(ref.name)
        return self._load_bin(ref.file)[ref.name]

    def load_into(self, ref: TensorRef, out) -> None:
        out.copy_(self.load(ref))

    def row_blocks(self, ref: TensorRef):
        """[(row block, release)] for sources that hold a tensor in pieces; None: load it whole."""
        return None

    def raw_ranges(self, ref: TensorRef) -> list[tuple[int, int, int]] | None:
        """[(fd, offset, length)] when the tensor's bytes can be copied as they are, else None."""
        st = self._st.get(ref.file)
        if st is None:
            return None
        info = st.tensors[ref.name]
        return [(st.fileno(), info.start, info.nbytes)]

    def place(self, name: str) -> tuple[str, int, int] | None:
        """(file, first byte, end) of a tensor in a safetensors file, else None."""
        ref = self.tensors.get(name)
        st = self._st.get(ref.file) if ref is not None else None
        if st is None:
            return None
        info = st.tensors[name]
        return ref.file, info.start, info.end

    def prefetch(self, ref: TensorRef) -> None:
        st = self._st.get(ref.file)
        if st is not None:
            st.prefetch_tensor(ref.name)

    def _rows(self, ref: TensorRef, start: int, stop: int):
        """(file, first byte, end) of rows [start, stop) of a tensor in a safetensors file, else None."""
        st = self._st.get(ref.file)
        if st is None or not ref.shape:
            return None
        info = st.tensors[ref.name]
        row = info.nbytes // max(1, ref.shape[0])
        return st, info.start + start * row, info.start + stop * row

    def prefetch_rows(self, ref: TensorRef, start: int, stop: int) -> None:
        span = self._rows(ref, start, stop)
        if span is not None:
            span[0].populate(span[1], span[2])

    def release_rows(self, ref: TensorRef, start: int, stop: int) -> None:
        """Hand back the pages of rows [start, stop) of a tensor read in row blocks."""
        span = self._rows(ref, start, stop)
        if span is not None:
            span[0].release(span[1], span[2])

    def release(self, ref: TensorRef) -> None:
        st = self._st.get(ref.file)
        if st is not None:
            st.release_tensor(ref.name)

    def close(self) -> None:
        for st in self._st.values():
            st.close()
        self._bin.clear()


SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def _index_files(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
        files = list(dict.fromkeys(data["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise MergeError(f"{path} is not a valid weights index; copy it again from the original model.") from None
    for name in files:  # plain file names in the model folder: never a path out of it
        if not isinstance(name, str) or not name or len(name) > 255 or Path(name).name != name or name in (".", ".."):
            raise MergeError(
                f"{path} names {name!r} as a weights file, which is not a file name in that folder; "
                "the index is damaged: copy it again from the original model."
            )
    return files


def find_weight_files(folder: Path) -> list[str]:
    """The weight files of a Hugging Face model folder, safetensors preferred."""
    if (folder / SAFE_INDEX).is_file():
        return _index_files(folder / SAFE_INDEX)
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    shards = sorted(p.name for p in folder.glob("*.safetensors") if not p.name.startswith("adapter_"))
    if shards:
        _check_shard_set(folder, shards)
        return shards
    if (folder / BIN_INDEX).is_file():
        return _index_files(folder / BIN_INDEX)
    if (folder / "pytorch_model.bin").is_file():
        return ["pytorch_model.bin"]
    return []


_SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")


def _check_shard_set(folder: Path, shards: list[str]) -> None:
    """Without an index, shard names like model-00002-of-00003 still say how many there must be."""
    counts = {}
    for name in shards:
        m = _SHARD_NAME.search(name)
        if m:
            counts.setdefault((name[: m.start()], int(m.group(2))), set()).add(int(m.group(1)))
    for (stem, total), present in counts.items():
        missing = sorted(set(range(1, total + 1)) - present)
        if missing:
            width = len(_SHARD_NAME.search(shards[0]).group(2))
            names = ", ".join(f"{stem}-{i:0{width}d}-of-{total:0{width}d}.safetensors" for i in missing[:3])
            raise MergeError(
                f"{folder} is missing shard(s) {names} (and has no index file); "
                "the weights are incomplete: copy the whole folder again."
            )


def not_a_folder(path: Path, flag: str, what: str) -> MergeError:
    if path.is_file():
        return MergeError(f"{path} is a file; {flag} wants the {what} folder that holds it ({path.parent}).")
    return MergeError(f"The {what} folder {path} does not exist; check the path.")


def open_model(folder: Path) -> TensorSource:
    folder = Path(folder)
    if not folder.is_dir():
        raise not_a_folder(folder, "--base", "base model")
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise MergeError(
            f"{folder} is a LoRA adapter, not a base model; pass the full model it was trained on as the base."
        )
    files = find_weight_files(folder)
    if not files:
        raise MergeError(
            f"No model weights (*.safetensors or pytorch_model.bin) in {folder}; "
            "point the base at a Hugging Face model folder."
        )
    return TensorSource(folder, files)


class RenamedSource:
    """A view of another source under other names (PEFT keys -> plain model names)."""

    def __init__(self, inner, mapping: dict[str, str]) -> None:
        self.inner = inner
        self.folder = getattr(inner, "folder", None)
        self.tensors = {new: inner.tensors[old] for new, old in mapping.items()}

    def load(self, ref):
        return self.inner.load(ref)

    def load_into(self, ref, out) -> None:
        self.inner.load_into(ref, out)

    def raw_ranges(self, ref):
        return self.inner.raw_ranges(ref)

    def row_blocks(self, ref):
        return self.inner.row_blocks(ref)

    def check_blocks(self, ref):
        """What the recompute reads: the inner source's own reading for checks where it has one."""
        return getattr(self.inner, "check_blocks", self.inner.row_blocks)(ref)

    def release(self, ref) -> None:
        self.inner.release(ref)

    def close(self) -> None:
        pass  # the inner source is closed by its owner


class DerivedSource:
    """A source whose tensors are computed from other tensors (``load``): loaded whole, never copied as
    raw file bytes nor read in row blocks; no files of its own."""

    folder = None
    files: list[str] = []

    def load(self, ref):
        raise NotImplementedError

    def load_into(self, ref, out) -> None:
        out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None

    def row_blocks(self, ref):
        return None

    def release(self, ref) -> None:
        pass

    def close(self) -> None:
        pass


class _Flattened(DerivedSource):
    """Tensors seen as matrices [first dim, everything else] (a convolution kernel as a matrix): loaded
    from the tensor they view, as a reshaped view of it."""

    def __init__(self) -> None:
        self.tensors: dict = {}
        self._parent: dict = {}

    def load(self, ref):
        return self._parent[ref.name].load().reshape(ref.shape)

    def release(self, ref) -> None:
        self._parent[ref.name].release()


def flattened(ref: TensorRef) -> TensorRef:
    """``ref`` as a matrix [shape[0], prod(shape[1:])] (its own view source: nothing kept after the merge)."""
    import math

    view = _Flattened()
    out = TensorRef(view, "", ref.name, ref.dtype, (ref.shape[0], math.prod(ref.shape[1:])))
    view.tensors[ref.name] = out
    view._parent[ref.name] = ref
    return out
