"""Read PyTorch DCP folders (``torch.distributed.checkpoint``, what Megatron's ``torch_dist`` writes)
without torch.distributed: no process group, no megatron-core, no GPU, and no code from the files.

A DCP folder holds ``.metadata`` (a pickle: every key's global shape, dtype and chunks, and where
each chunk's bytes lie: ``(relative_path, offset, length)``) and ``__{rank}_{i}.distcp`` files. With
torch's default writer each tensor chunk is a complete ``torch.save`` archive at that byte range
(``torch/distributed/checkpoint/filesystem.py``, ``_write_item``); the safetensors format stores the
raw bytes instead. Both are read here as zero-copy views on an mmap of the ``.distcp`` file, so a
reader holds only the pages of the chunks it is copying, handed back once copied.

``.metadata`` is unpickled by the project's restricted unpickler (``torch_pickle``): the checkpoint
metadata classes become inert records, plain containers and dtypes pass, anything else is refused.
"""

from __future__ import annotations

import io
import math
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.mapped import MappedFile
from tui_merger.core.io.torch_pickle import _DTYPE_NAMES, Record, _check_memo_indices, _record_class, _Unpickler

METADATA = ".metadata"
MAX_METADATA = 1 << 30  # a 1 TB model's metadata is tens of MB
MAX_CHUNK_PICKLE = 1 << 20  # the pickle of one torch.save'd tensor is a few hundred bytes
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}
_ZIP_MAGIC = b"PK\x03\x04"
_PLAIN_NAME = re.compile(r"^[\w.-]+$")
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")
_TORCH_PLAIN = {"torch.Size": tuple, "torch.device": str, "torch.serialization._get_layout": str,
                "collections.OrderedDict": dict}


@dataclass
class Chunk:
    """One stored piece of a tensor: where it sits in the global tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: object = None  # DCP: the .distcp file name; legacy: the rank file it comes from
    start: int = 0  # DCP: byte range in the file
    length: int = 0
    local: object = None  # legacy: the tensor itself (a view on the mmap'd rank file)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class ChunkedTensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


def _int(value, what: str, path: Path) -> int:
    if type(value) is not int or value < 0:  # noqa: E721 (bool is not a size)
        raise MergeError(f"{path} is damaged ({what} is {value!r}, not a size); copy the checkpoint again.")
    return value


def _ints(value, what: str, path: Path) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise MergeError(f"{path} is damaged ({what} is not a shape); copy the checkpoint again.")
    return tuple(_int(v, what, path) for v in value)


class _MetadataUnpickler(_Unpickler):
    """torch_pickle's unpickler (DCP classes become inert records) plus the few plain classes a
    ``.metadata`` names: ``pathlib`` paths (the checkpoint id) become strings."""

    def __init__(self, file, path: Path) -> None:
        super().__init__(file, self._no_storage, path)

    def _no_storage(self, *args):
        raise MergeError(f"{self._path} holds tensor data, which DCP metadata never does; refusing it.")

    def find_class(self, module: str, name: str):
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return lambda *parts: "/".join(str(p) for p in parts)
        if module.startswith("torch.distributed") and not module.startswith("torch.distributed.checkpoint"):
            raise MergeError(
                f"{self._path} contains a pickled {module}.{name}, which DCP metadata never needs; "
                "tui-merger refuses to load it because unpickling it could run code."
            )
        # without importing torch (inspect reads metadata in milliseconds): a dtype is its name
        if module == "torch" and name in _DTYPE_NAMES:
            return name
        if f"{module}.{name}" in _TORCH_PLAIN:
            return _TORCH_PLAIN[f"{module}.{name}"]
        if module.startswith("torch.distributed.checkpoint"):
            return _record_class(f"{module}.{name}")
        return super().find_class(module, name)


def _field(obj, name: str, index: int | None = None):
    """A field of an unpickled dataclass record (its __dict__), or of its tuple state."""
    d = getattr(obj, "__dict__", {})
    if name in d:
        return d[name]
    state = d.get("state")
    if index is not None and isinstance(state, tuple) and len(state) > index:
        return state[index]
    return None


def read_metadata(folder: Path) -> dict:
    """The ``.metadata`` pickle, safely: the record of torch's ``Metadata``."""
    path = Path(folder) / METADATA
    if not path.is_file():
        raise MergeError(
            f"{folder} has no {METADATA} file, so it is not a complete dist checkpoint (the save may not have "
            "finished); copy the whole folder again or use an earlier step."
        )
    try:
        size = path.stat().st_size
        if size > MAX_METADATA:
            raise MergeError(f"{path} is {size} bytes, far more than checkpoint metadata; refusing it.")
        data = path.read_bytes()
    except OSError as err:
        raise MergeError(f"Cannot read {path}: {err.strerror or err}.") from None
    try:
        _check_memo_indices(data)
        md = _MetadataUnpickler(io.BytesIO(data), path).load()
    except MergeError:
        raise
    except Exception as err:  # a truncated or corrupt pickle stream
        raise MergeError(
            f"{path} could not be read ({type(err).__name__}: {str(err)[:120]}); it is truncated or corrupt: "
            "copy the checkpoint again."
        ) from None
    if not isinstance(md, Record) or not isinstance(_field(md, "state_dict_metadata"), dict):
        raise MergeError(f"{path} does not hold DCP checkpoint metadata; copy the checkpoint again.")
    return md


def index_checkpoint(folder: Path, skip) -> tuple[dict[str, ChunkedTensor], list[str]]:
    """Every tensor key of a DCP folder (those ``skip(key)`` rejects left out) with its chunks and
    their byte ranges, checked against the files: (tensors, the .distcp files they use)."""
    folder = Path(folder)
    path = folder / METADATA
    md = read_metadata(folder)
    storage = _field(md, "storage_data")
    if not isinstance(storage, dict):
        raise MergeError(f"{path} lists no storage locations; it is damaged: copy the checkpoint again.")
    where: dict[tuple[str, tuple[int, ...]], object] = {}
    for index, info in storage.items():
        fqn = _field(index, "fqn", 0)
        offset = _field(index, "offset", 1)
        if isinstance(fqn, str) and offset is not None:
            where[(fqn, tuple(offset) if isinstance(offset, (tuple, list)) else offset)] = info
    tensors: dict[str, ChunkedTensor] = {}
    sizes: dict[str, int] = {}
    for key, meta in _field(md, "state_dict_metadata").items():
        if not isinstance(key, str):
            raise MergeError(f"{path} has a key that is not a name; it is damaged: copy the checkpoint again.")
        if skip(key) or not hasattr(meta, "__dict__") or _field(meta, "chunks") is None:
            continue  # optimizer / rng / extra state, or bytes (BytesStorageMetadata)
        shape = _ints(_field(meta, "size"), f"the shape of {key}", path)
        dtype = _field(_field(meta, "properties"), "dtype", 0)
        dtype = str(dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise MergeError(f"{path}: {key} has dtype {dtype}, which tui-merger cannot read.")
        entry = ChunkedTensor(key, dtype, shape)
        for c in _field(meta, "chunks") or ():
            offsets = _ints(_field(c, "offsets"), f"a chunk offset of {key}", path)
            csizes = _ints(_field(c, "sizes"), f"a chunk size of {key}", path)
            if len(offsets) != len(shape) or len(csizes) != len(shape) or any(
                o + s > n for o, s, n in zip(offsets, csizes, shape)
            ):
                raise MergeError(f"{path}: a chunk of {key} lies outside its shape {list(shape)}; the file is damaged.")
            info = where.get((key, offsets))
            if info is None:
                raise MergeError(f"{path} does not say where a chunk of {key} is stored; the file is damaged.")
            rel = _field(info, "relative_path", 0)
            start = _int(_field(info, "offset", 1), f"the offset of {key}", path)
            length = _int(_field(info, "length", 2), f"the length of {key}", path)
            if _field(info, "transform_descriptors", 3):
                raise MergeError(
                    f"{path}: {key} is stored compressed or transformed ({_field(info, 'transform_descriptors', 3)}), "
                    "which tui-merger cannot read yet."
                )
            if not isinstance(rel, str) or not _PLAIN_NAME.match(rel) or rel in (".", ".."):
                raise MergeError(f"{path} names {rel!r} as a data file, which is not a file in {folder}; it is damaged.")
            if rel not in sizes:
                try:
                    sizes[rel] = (folder / rel).stat().st_size
                except OSError:
                    raise MergeError(
                        f"{folder / rel} is missing; the dist checkpoint is incomplete: copy the whole folder again."
                    ) from None
            if start + length > sizes[rel]:
                raise MergeError(
                    f"{folder / rel} is truncated: it has {sizes[rel]} bytes but {key} is stored up to byte "
                    f"{start + length}; copy the checkpoint again."
                )
            entry.chunks.append(Chunk(offsets, csizes, rel, start, length))
        tensors[key] = entry
    return tensors, sorted(sizes)


def check_coverage(tensors: dict[str, ChunkedTensor], where) -> None:
    """Every value of every tensor is stored once: the chunks' sizes add up to the global shape."""
    for key, entry in tensors.items():
        covered = sum(c.numel for c in entry.chunks)
        if covered != math.prod(entry.shape):
            raise MergeError(
                f"{where}: the chunks of {key} hold {covered} of its {math.prod(entry.shape)} values; "
                "the checkpoint is incomplete (a rank's data is missing): copy the whole folder again."
            )


class _Window(io.RawIOBase):
    """A read-only file object over bytes [start, start+length) of an mmap (zipfile reads a chunk's
    archive through it, touching only its headers)."""

    def __init__(self, mm, start: int, length: int) -> None:
        super().__init__()
        self.mm, self.start, self.length, self.pos = mm, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        a = self.start + self.pos
        b[:n] = self.mm[a : a + n]
        self.pos += n
        return n


class ChunkStore:
    """Reads regions of chunked tensors into caller buffers, chunk by chunk; keeps the chunks of one
    group (one key at one layer: q, k and v come from the same chunks) until the group is done."""

    def __init__(self, tensors: dict[str, ChunkedTensor]) -> None:
        self.tensors = tensors
        self._group = None
        self._cached: dict[int, object] = {}
        self._users: set = set()
        self._done: set = set()
        self.users_of: dict = {}  # group -> names that read it (filled by the owner)
        self.decoded = 0  # chunks decoded so far (tests check the cache works)

    # -- implemented by the stores ---------------------------------------------------------------
    def fetch(self, entry: ChunkedTensor, chunk: Chunk):
        raise NotImplementedError

    def release_chunk(self, chunk: Chunk) -> None:
        pass

    # -- regions ---------------------------------------------------------------------------------
    def read_region(self, key: str, index: tuple[int, ...], rows: tuple[int, int] | None, out, group=None) -> None:
        """Copy ``tensor[index][rows[0]:rows[1]]`` (``index`` fixes the leading dims; no rows: all) into
        ``out``, converting dtype on the way."""
        entry = self.tensors[key]
        shape = entry.shape
        lo = list(index)
        hi = [i + 1 for i in index]
        d = len(index)
        if d < len(shape):
            r0, r1 = rows if rows is not None else (0, shape[d])
            lo.append(r0)
            hi.append(r1)
        lo += [0] * (len(shape) - len(lo))
        hi += list(shape[len(hi):])
        if any(x >= y for x, y in zip(lo, hi)):
            return  # nothing to read (an empty tensor)
        dst = out[(None,) * len(index)] if index else out
        self._enter(group if group is not None else (key, tuple(index)))
        copied = 0
        for chunk in entry.chunks:
            a = [max(x, o) for x, o in zip(lo, chunk.offsets)]
            b = [min(y, o + s) for y, o, s in zip(hi, chunk.offsets, chunk.sizes)]
            if any(x >= y for x, y in zip(a, b)):
                continue
            data = self._chunk(entry, chunk)
            src = data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, chunk.offsets))]
            dst[tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))].copy_(src)
            copied += math.prod(y - x for x, y in zip(a, b))
            if len(self._users) <= 1:  # no other tensor reads this group: its pages go at once
                self._cached.pop(id(chunk), None)
                self.release_chunk(chunk)
        if copied != math.prod(y - x for x, y in zip(lo, hi)):  # pragma: no cover - coverage is checked on open
            raise MergeError(f"{key}: the checkpoint does not hold all of the values asked for; it is incomplete.")

    def file_of(self, chunk: Chunk):
        """The MappedFile a chunk's views point into."""
        raise NotImplementedError

    def row_views(self, key: str, index: tuple[int, ...], rows: tuple[int, int] | None, max_bytes: int | None = None):
        """``tensor[index][rows[0]:rows[1]]`` as zero-copy views on the files, in row order, each of at
        most ``max_bytes`` (whole rows): [(view, chunk)]. None when a chunk splits the rows (a
        row-parallel weight's columns), so that rows are not contiguous in any file."""
        entry = self.tensors[key]
        shape = entry.shape
        d = len(index)
        if d >= len(shape):
            return None
        r0, r1 = rows if rows is not None else (0, shape[d])
        found = []
        for chunk in entry.chunks:
            if any(not o <= i < o + s for i, o, s in zip(index, chunk.offsets, chunk.sizes)):
                continue
            a, b = max(r0, chunk.offsets[d]), min(r1, chunk.offsets[d] + chunk.sizes[d])
            if a >= b:
                continue
            if chunk.offsets[d + 1 :] != (0,) * (len(shape) - d - 1) or chunk.sizes[d + 1 :] != shape[d + 1 :]:
                return None
            found.append((a, b, chunk))
        found.sort(key=lambda x: x[0])
        views = []
        for a, b, chunk in found:
            data = self._decode(entry, chunk)
            part = data[tuple(i - o for i, o in zip(index, chunk.offsets))][a - chunk.offsets[d] : b - chunk.offsets[d]]
            row_bytes = max(1, part[0].numel() * part.element_size()) if len(part) else 1
            step = len(part) if max_bytes is None else max(1, max_bytes // row_bytes)
            for r in range(0, len(part), step):
                views.append((part[r : r + step], chunk))
        return views

    def release_view(self, chunk: Chunk, view) -> None:
        """Hand back the pages of a view made by row_views (once written)."""
        f = self.file_of(chunk)
        start = f.offset_of(view)
        if start is not None:
            f.release(start, start + view.numel() * view.element_size())

    def _decode(self, entry: ChunkedTensor, chunk: Chunk):
        """One stored chunk as a tensor, its shape checked against the index."""
        data = self.fetch(entry, chunk)
        self.decoded += 1
        if tuple(data.shape) != chunk.sizes:
            raise MergeError(
                f"{entry.key}: a stored chunk has shape {list(data.shape)} where the index says "
                f"{list(chunk.sizes)}; the checkpoint is damaged: copy it again."
            )
        return data

    def _chunk(self, entry: ChunkedTensor, chunk: Chunk):
        cached = self._cached.get(id(chunk))
        if cached is not None:
            return cached[0]
        data = self._decode(entry, chunk)
        self._cached[id(chunk)] = (data, chunk)
        return data

    def _enter(self, group) -> None:
        if group != self._group:
            self.drop()
            self._group = group
            self._users = set(self.users_of.get(group, ()))
            self._done = set()

    def done(self, name: str, groups) -> None:
        """``name`` was written: once every name reading the cached group is, its chunks go."""
        if self._group in groups:
            self._done.add(name)
            if self._done >= self._users:
                self.drop()

    def drop(self) -> None:
        for _, chunk in self._cached.values():
            self.release_chunk(chunk)
        self._cached = {}
        self._group = None

    def close(self) -> None:
        self.drop()


class DcpStore(ChunkStore):
    """Chunks of a DCP folder, decoded from mmap'd ``.distcp`` files."""

    def __init__(self, folder: Path, skip, canonical=None) -> None:
        """``skip(key)``: keys to leave out; ``canonical(key)``: the name a key is known by (keys that
        share one, e.g. the virtual-pipeline chunks ``model0.x`` and ``model1.x``, are one tensor)."""
        self.folder = Path(folder)
        stored, self.data_files = index_checkpoint(self.folder, skip)
        tensors: dict[str, ChunkedTensor] = {}
        for key, entry in stored.items():
            name = canonical(key) if canonical else key
            seen = tensors.get(name)
            if seen is None:
                tensors[name] = ChunkedTensor(name, entry.dtype, entry.shape, list(entry.chunks))
            elif (seen.dtype, seen.shape) != (entry.dtype, entry.shape):
                raise MergeError(
                    f"{self.folder / METADATA}: {key} has shape {list(entry.shape)} ({entry.dtype}) but another "
                    f"model chunk stores it as {list(seen.shape)} ({seen.dtype}); the checkpoint is inconsistent."
                )
            else:
                seen.chunks.extend(entry.chunks)
        check_coverage(tensors, self.folder / METADATA)
        super().__init__(tensors)
        self._files: dict[str, MappedFile] = {}

    def file(self, rel: str) -> MappedFile:
        f = self._files.get(rel)
        if f is None:
            f = self._files[rel] = MappedFile(self.folder / rel)
        return f

    def file_of(self, chunk: Chunk) -> MappedFile:
        return self.file(chunk.file)

    def fetch(self, entry: ChunkedTensor, chunk: Chunk):
        f = self.file(chunk.file)
        path = f.path
        mm = f.mapping()
        head = mm[chunk.start : chunk.start + 4]
        if head != _ZIP_MAGIC:  # the safetensors format: the raw bytes
            from tui_merger.core.io.safetensors_io import itemsize

            if chunk.length != chunk.numel * itemsize(entry.dtype):
                raise MergeError(
                    f"{path}: the bytes of {entry.key} at {chunk.start} are neither a torch.save archive nor raw "
                    "data of its size; the checkpoint is damaged: copy it again."
                )
            return mapped_view(f, entry.dtype, chunk.numel, chunk.start).view(chunk.sizes)
        return _load_archive(f, chunk, entry)

    def release_chunk(self, chunk: Chunk) -> None:
        f = self._files.get(chunk.file)
        if f is not None:
            f.release(chunk.start, chunk.start + chunk.length)

    def close(self) -> None:
        super().close()
        for f in self._files.values():
            f.flush()
            f.close()
        self._files = {}


def mapped_view(f: MappedFile, dtype: str, numel: int, offset: int):
    """A zero-copy tensor over bytes of a mapped file, also where they do not start at a multiple of
    the element size (torch.save archives inside a .distcp file start anywhere): MappedFile.view
    copies those, which cost a copy of every such chunk."""
    import warnings

    import torch

    torch_dtype = getattr(torch, dtype)
    if numel == 0 or offset % torch_dtype.itemsize == 0:
        return f.view(dtype, numel, offset)
    raw = memoryview(f.mapping())[offset : offset + numel * torch_dtype.itemsize]
    with warnings.catch_warnings():  # a read-only buffer: never written to
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch_dtype)


def _load_archive(f: MappedFile, chunk: Chunk, entry: ChunkedTensor):
    """One torch.save archive inside a .distcp file: its pickle through the restricted unpickler,
    its storage a view on the mapping."""
    from tui_merger.core.io.safetensors_io import itemsize

    path = f.path
    mm = f.mapping()
    damaged = MergeError(
        f"{path}: the stored chunk of {entry.key} at byte {chunk.start} is not a readable torch.save archive; "
        "the file is truncated or corrupt: copy the checkpoint again."
    )
    try:
        with zipfile.ZipFile(_Window(mm, chunk.start, chunk.length)) as zf:
            infos = zf.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if len(pkl) != 1 or pkl[0].compress_type != zipfile.ZIP_STORED or pkl[0].file_size > MAX_CHUNK_PICKLE:
                raise damaged
            prefix = pkl[0].filename[: -len("data.pkl")]
            members = {}
            for info in infos:
                if info.filename.startswith(prefix + "data/"):
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise damaged
                    members[info.filename[len(prefix) + 5 :]] = (info.header_offset, info.file_size)
            data = zf.read(pkl[0])
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, KeyError, struct.error):
        raise damaged from None

    def storage(key: str, dtype: str, numel: int):
        if key not in members:
            raise damaged
        header, size = members[key]
        if size != numel * itemsize(dtype):
            raise damaged
        if numel == 0:
            return f.view(dtype, 0, 0)
        local = mm[chunk.start + header : chunk.start + header + 30]
        if len(local) < 30 or local[:4] != _ZIP_MAGIC:
            raise damaged
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = header + 30 + name_len + extra_len
        if start + size > chunk.length:
            raise damaged
        return mapped_view(f, dtype, numel, chunk.start + start)

    try:
        _check_memo_indices(data)
        tensor = _Unpickler(io.BytesIO(data), storage, path).load()
    except MergeError:
        raise
    except Exception:
        raise damaged from None
    if not hasattr(tensor, "shape") or str(getattr(tensor, "dtype", "")).removeprefix("torch.") != entry.dtype:
        raise MergeError(
            f"{path}: the stored chunk of {entry.key} is not a {entry.dtype} tensor; the checkpoint is damaged."
        )
    return tensor


BLOCK_BYTES = 16 << 20  # the largest row block converted at once


class DcpSource:
    """A TensorSource over a DCP folder whose keys are whole tensors under other names (accelerate's
    FSDP checkpoints: ``model.`` + the Hugging Face name): ``names`` maps each name given to its key.
    Each tensor is read chunk by chunk into its output (rank slices are rows), its pages handed back
    once copied."""

    def __init__(self, store: DcpStore, names: dict[str, str]) -> None:
        from tui_merger.core.io.sources import TensorRef

        self.store = store
        self.folder = store.folder
        self.files = list(store.data_files)
        self.keys = dict(names)
        self.tensors = {
            name: TensorRef(self, "", name, store.tensors[key].dtype, store.tensors[key].shape)
            for name, key in self.keys.items()
        }
        store.users_of = {(key, ()): {name} for name, key in self.keys.items()}

    def load(self, ref):
        import torch

        out = torch.empty(ref.shape, dtype=getattr(torch, ref.dtype))
        self.load_into(ref, out)
        return out

    def load_into(self, ref, out) -> None:
        key = self.keys[ref.name]
        self.store.read_region(key, (), None, out, group=(key, ()))

    def _views(self, ref, max_bytes: int | None):
        if not ref.shape or not math.prod(ref.shape):
            return None
        return self.store.row_views(self.keys[ref.name], (), None, max_bytes)

    def raw_ranges(self, ref):
        """The tensor's bytes in order, when its chunks hold whole rows (FSDP shards dim 0): copied in
        the kernel when the output keeps the dtype."""
        views = self._views(ref, None)
        if views is None:
            return None
        return file_ranges(self.store, views)

    def row_blocks(self, ref):
        """The tensor as row blocks (views on the files, handed back once written)."""
        views = self._views(ref, BLOCK_BYTES)
        if views is None:
            return None
        return [(view, lambda v=view, c=chunk: self.store.release_view(c, v)) for view, chunk in views]

    def release(self, ref) -> None:
        key = self.keys.get(ref.name)
        if key is not None:
            self.store.done(ref.name, {(key, ())})

    def same_values(self, a: str, b: str) -> bool:
        """Whether two tensors hold equal values (tied embeddings stored twice), compared a block of
        rows at a time (an embedding is never held whole)."""
        import torch

        ra, rb = self.tensors[a], self.tensors[b]
        if (ra.shape, ra.dtype) != (rb.shape, rb.dtype) or not ra.shape:
            return False
        rows = ra.shape[0]
        row_bytes = max(1, ra.nbytes // max(rows, 1))
        block = max(1, BLOCK_BYTES // row_bytes)
        try:
            for r in range(0, rows, block):
                n = min(block, rows - r)
                x = torch.empty((n,) + tuple(ra.shape[1:]), dtype=getattr(torch, ra.dtype))
                y = torch.empty_like(x)
                self.store.read_region(self.keys[a], (), (r, r + n), x, group=(self.keys[a], "cmp"))
                self.store.read_region(self.keys[b], (), (r, r + n), y, group=(self.keys[b], "cmp"))
                if not torch.equal(x, y):
                    return False
            return True
        finally:
            self.store.drop()

    def close(self) -> None:
        self.store.close()


def file_ranges(store, views):
    """[(fd, offset, bytes)] of (view, chunk) pairs on ``store``'s mapped files, in order, or None when a
    view is not one contiguous run of its file (the caller then copies through memory)."""
    ranges = []
    for view, chunk in views:
        f = store.file_of(chunk)
        start = f.offset_of(view) if view.is_contiguous() else None
        if start is None:
            return None
        ranges.append((f.fileno(), start, view.numel() * view.element_size()))
    return ranges
