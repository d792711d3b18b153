"""Read ``torch.save`` files without running code from them and without torch's private classes.

A restricted unpickler: it resolves only the globals a state dict needs (tensor rebuild functions,
dtypes, storages, sizes) to our own safe implementations, and turns every class from
``torch.distributed`` (DTensor, DTensorSpec, DeviceMesh, placements, ...) into an inert record of its
constructor arguments and state. Anything else (``os.system``, arbitrary classes) is refused. Tensor
data is never copied: storages are views on the mmap'd zip members.
"""

from __future__ import annotations

import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.mapped import MappedFile

_STORAGE_DTYPES = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}
_DTYPE_NAMES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2",
}


# DeepSpeed's optimizer files pickle a few of its own classes beside the tensors; each becomes an inert
# record (an enum's value is its constructor argument, an object's fields its state). Only these names:
# any other DeepSpeed class is refused like every unknown global.
DEEPSPEED_RECORDS = frozenset({
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
})


class Record:
    """An inert stand-in for a pickled object of a class we do not import (DTensorSpec, Shard, ...)."""

    qualname = "?"
    args: tuple = ()
    kwargs: dict = {}

    def __new__(cls, *args, **kwargs):  # NEWOBJ passes constructor arguments here, not to __init__
        obj = super().__new__(cls)
        obj.args = args
        obj.kwargs = kwargs
        return obj

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["state"] = state

    @property
    def kind(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    def __repr__(self) -> str:
        return f"<{self.kind} {self.args or ''} {sorted(k for k in self.__dict__ if k not in ('args', 'kwargs'))}>"


def _record_class(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname})


class WrapperTensor(Record):
    """What a tensor subclass (DTensor) unpickles to: its global size, dtype and, once state is
    applied, ``_local_tensor`` and ``_spec``."""

    qualname = "tensor subclass"

    def __init__(self, cls, dtype, size, stride, storage_offset, layout, device, requires_grad) -> None:
        # never str(cls): a damaged pickle can put a tensor there (printing it is slow and leaks values)
        self.subclass = cls.qualname if isinstance(cls, type) and issubclass(cls, Record) else type(cls).__name__
        self.dtype = dtype
        self.size = tuple(size)


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    return WrapperTensor(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)


def _rebuild_from_type_v2(func, new_type, args, state):
    obj = func(*args)
    if isinstance(obj, Record) and state:
        obj.__setstate__(state)  # a dict, or (dict state, slots state) as torch writes it
    return obj


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    # fuzzing: a negative offset passed the upper-bound check below and the view began before its storage
    if (type(storage_offset) is not int or storage_offset < 0 or not isinstance(size, tuple) or not isinstance(stride, tuple)
            or len(size) != len(stride) or not all(type(n) is int and n >= 0 for n in size + stride)):
        raise ValueError("a tensor has a negative or malformed offset, size or stride")
    if len(size) == 0:
        return storage[storage_offset : storage_offset + 1].view(()) if storage.numel() else storage.new_empty(())
    # as_strided checks bounds against the whole mmap only: keep the view inside its own storage, as torch.load does
    if all(size) and not 0 <= storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) < storage.numel():
        raise ValueError("a tensor reaches outside its stored data")
    # the storage is a view into the mmap'd file: as_strided counts offsets from the file's start
    return storage.as_strided(tuple(size), tuple(stride), storage.storage_offset() + storage_offset)


def _rebuild_parameter(data, requires_grad, backward_hooks, *rest):
    return data


def _record_getattr(obj, name: str, path=None):
    """getattr limited to our inert record classes: a nested class becomes another record class."""
    if isinstance(obj, type) and issubclass(obj, Record) and isinstance(name, str) and name.isidentifier():
        return _record_class(f"{obj.qualname}.{name}")
    where = f"{path}: its pickle" if path else "A checkpoint pickle"  # the one-sentence error names the file
    raise MergeError(f"{where} asked for an attribute tui-merger does not allow; refusing to load it.")


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storage_loader, path: Path, inert: tuple[str, ...] = ()) -> None:
        super().__init__(file)
        self._load_storage = storage_loader
        self._path = path
        self._inert = inert

    def find_class(self, module: str, name: str):
        import torch

        full = f"{module}.{name}"
        if full == "collections.OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch._utils" and name == "_rebuild_wrapper_subclass":
            return _rebuild_wrapper_subclass
        if module == "torch._utils" and name == "_rebuild_parameter":
            return _rebuild_parameter
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if module == "torch" and name in _DTYPE_NAMES:
            return getattr(torch, name)
        if full == "torch.Size":
            return tuple
        if full == "torch.device":
            return str
        if full == "torch.serialization._get_layout":
            return str
        if full == "torch.Tensor" or full == "torch.nn.parameter.Parameter":
            return _record_class(full)
        if module.startswith("torch.distributed") or full in DEEPSPEED_RECORDS:
            return _record_class(full)
        if module.split(".")[0] in self._inert:
            # a file that also holds a trainer's state (Megatron-LM's args, numpy RNG state, ...): those
            # objects become inert records, never the real classes or functions (nothing runs)
            return _record_class(full)
        if full in ("__builtin__.getattr", "builtins.getattr"):
            # ShardedTensor pickles getattr(ShardedTensor, "ProcessGroupState"); the file is named in a refusal
            return lambda obj, name: _record_getattr(obj, name, self._path)
        raise MergeError(
            f"{self._path} contains a pickled {full}, which a checkpoint of weights never needs; "
            "tui-merger refuses to load it because unpickling it could run code."
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise MergeError(f"{self._path} has a storage reference tui-merger does not understand.")
        _, storage_type, key, _location, numel = pid[:5]
        if not isinstance(storage_type, _StorageType):
            raise MergeError(f"{self._path} uses a storage type tui-merger does not understand.")
        return self._load_storage(str(key), storage_type.dtype, int(numel))


def _check_memo_indices(data: bytes) -> None:
    """CPython's C unpickler grows its memo table to twice the largest PUT index and zeroes it: one
    LONG_BINPUT 0x7fffffff in a 13-byte pickle takes 32 GiB. A real pickle numbers its PUTs from 0.
    A minimal opcode walk (arguments skipped by their encoded sizes, nothing decoded). Runs of opcodes
    with fixed-size arguments, LONG_BINPUT with a small index among them, are skipped by one regex
    match in C (3x faster: 11 instead of 30 ms for the 8 rank files of a 0.5B model); such an index
    stays below len(data) rounded up to 64 KiB, so the memo stays O(len(data))."""
    i, n = 0, len(data)
    sizes = _opcode_table()
    skip = _run_regex(n >> 16).match if n < 1 << 24 else None
    while i < n:
        if skip is not None:
            i = skip(data, i).end()
            if i >= n:
                break
        code = data[i]
        size = sizes[code]
        i += 1
        if size is None:
            raise ValueError(f"unknown opcode {code:#x} at byte {i - 1}")
        if code == _STOP:
            return
        if size >= 0:
            if code == _LONG_BINPUT and int.from_bytes(data[i : i + 4], "little") > n:
                raise ValueError(f"memo index {int.from_bytes(data[i : i + 4], 'little')} in a {n}-byte pickle")
            i += size
        elif size in (-1, _TWO_LINES):  # up to a newline (text opcodes, PUT among them), or two
            end = data.find(b"\n", i)
            if size == _TWO_LINES and end >= 0:
                end = data.find(b"\n", end + 1)
            if end < 0:
                raise ValueError("a text argument runs past the end")
            if code == _PUT and not (data[i:end].isdigit() and int(data[i:end]) <= n):
                raise ValueError(f"memo index {data[i:end][:20]!r} in a {n}-byte pickle")
            i = end + 1
        else:  # a length prefix of -size - 1 bytes, then that many bytes
            width = -size - 1
            i += width + int.from_bytes(data[i : i + width], "little")
    raise ValueError("the pickle ends without STOP")


def _opcode_table() -> list:
    """_argument_sizes as a list indexed by the opcode byte (None: not an opcode)."""
    if not _TABLE:
        sizes = _argument_sizes()
        _TABLE.extend(sizes.get(code) for code in range(256))
    return _TABLE


_TABLE: list = []
_RUNS: dict = {}


def _run_regex(high: int):
    """A regex matching a run of opcodes whose arguments have fixed sizes (never STOP, PUT or a
    length-prefixed one), LONG_BINPUT included when its index is below (high + 1) * 64 KiB."""
    import re

    if high not in _RUNS:
        groups: dict[int, list[int]] = {}
        for code, size in _argument_sizes().items():
            if code not in (_STOP, _PUT, _LONG_BINPUT) and size >= 0:
                groups.setdefault(size, []).append(code)
        alternatives = [
            b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]" + b"." * size
            for size, codes in sorted(groups.items())
        ]
        alternatives.append(b"r..[\\x00-" + re.escape(bytes([high])) + b"]\\x00")
        _RUNS[high] = re.compile(b"(?:" + b"|".join(alternatives) + b")*", re.DOTALL)
    return _RUNS[high]


_STOP, _PUT, _LONG_BINPUT = ord("."), ord("p"), ord("r")
_TWO_LINES = -100
_SIZES: dict[int, int] = {}


def _argument_sizes() -> dict[int, int]:
    """opcode byte -> bytes of its argument (>= 0), -1 for up to a newline, _TWO_LINES for two lines,
    -(w+1) for a w-byte length prefix followed by that many bytes."""
    if not _SIZES:
        import pickletools

        for op in pickletools.opcodes:
            arg = op.arg
            if arg is None:
                size = 0
            elif arg.n >= 0:
                size = arg.n
            elif arg.n == pickletools.UP_TO_NEWLINE:
                size = _TWO_LINES if arg.name.endswith("_pair") else -1  # GLOBAL and INST: module, name
            elif arg.n == pickletools.TAKEN_FROM_ARGUMENT1:
                size = -2
            elif arg.n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
                size = -5
            elif arg.n == pickletools.TAKEN_FROM_ARGUMENT8U:
                size = -9
            else:
                continue
            _SIZES[ord(op.code)] = size
    return _SIZES


class TorchFile(MappedFile):
    """One torch.save zip file, unpickled safely; tensors are views on an mmap of the file."""

    def __init__(self, path: Path, inert: tuple[str, ...] = ()) -> None:
        """``inert``: top-level modules whose pickled objects become inert records instead of being
        refused (for files that also hold non-tensor training state)."""
        super().__init__(path)
        self._members: dict[str, tuple[int, int]] = {}
        try:
            with zipfile.ZipFile(self.path) as zf:
                infos = zf.infolist()
                pkl = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
                if len(pkl) != 1:
                    raise MergeError(f"{self.path} is not a PyTorch checkpoint (no data.pkl inside).")
                if pkl[0].compress_type != zipfile.ZIP_STORED:  # torch.save never compresses it: a zip bomb
                    raise MergeError(f"{self.path} stores its pickle compressed, which torch.save never does; refusing it.")
                prefix = pkl[0].filename[: -len("data.pkl")]
                for info in infos:
                    if info.filename.startswith(prefix + "data/"):
                        self._members[info.filename[len(prefix) + 5 :]] = (info.header_offset, info.file_size)
                        if info.compress_type != zipfile.ZIP_STORED:
                            raise MergeError(f"{self.path} stores compressed tensors; re-save it with torch.save.")
                data = zf.read(pkl[0])
        # fuzzing: a flipped name byte made zipfile raise UnicodeDecodeError, a flipped size EOFError; a
        # flipped flag asks for a password (RuntimeError) or an unknown method (NotImplementedError)
        except (zipfile.BadZipFile, ValueError, EOFError, RuntimeError, NotImplementedError, struct.error):
            raise MergeError(
                f"{self.path} is not a readable PyTorch zip checkpoint (truncated or corrupt?); copy it again."
            ) from None
        except OSError as err:
            raise MergeError(f"Cannot read {self.path}: {err.strerror or err}.") from None
        import io

        # Unpickling touches one zip entry header per tensor: with the default read-ahead each of
        # those faults read up to 8 MiB, i.e. the whole file before any work (cold cache: 1.3 s ->
        # 0.27 s for 2 GB of rank files).
        if os.path.getsize(self.path):
            self.advise("random")
        try:
            _check_memo_indices(data)
            self.obj = _Unpickler(io.BytesIO(data), self._storage, self.path, inert).load()
        except MergeError:
            self.close()
            raise
        except Exception as err:  # malformed pickle stream
            self.close()
            raise MergeError(f"{self.path} could not be unpickled ({type(err).__name__}: {err}); it may be corrupt.") from None
        if self._mmap is not None:
            self.advise("normal")
            self.release()  # the header pages

    def _data_offset(self, header_offset: int) -> int:
        head = self.mapping()[header_offset : header_offset + 30]
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise MergeError(f"{self.path} is corrupt (bad zip entry header); copy it again.")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        return header_offset + 30 + name_len + extra_len

    def _storage(self, key: str, dtype: str, numel: int):
        from tui_merger.core.io.safetensors_io import itemsize

        if key not in self._members:
            raise MergeError(f"{self.path} is missing tensor data '{key}' (truncated or corrupt?); copy it again.")
        header_offset, size = self._members[key]
        if size != numel * itemsize(dtype):
            raise MergeError(f"{self.path}: tensor data '{key}' has {size} bytes, expected {numel * itemsize(dtype)}.")
        if numel == 0:
            return self.view(dtype, 0, 0)
        start = self._data_offset(header_offset)
        if start + size > len(self.mapping()):
            raise MergeError(f"{self.path} is truncated (tensor data '{key}' runs past the end); copy it again.")
        return self.view(dtype, numel, start)


def load_state_dict(path: Path) -> tuple[TorchFile, dict]:
    """(the open file, its state dict); the dict's tensors stay valid while the file is open."""
    tf = TorchFile(path)
    obj = tf.obj
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        tf.close()
        raise MergeError(f"{path} does not hold a dictionary of tensors.")
    try:
        require_names(path, obj)
    except MergeError:
        tf.close()
        raise
    return tf, obj


def require_names(path, state: dict) -> None:
    """A state dict's keys must be parameter names. A damaged or forged pickle can key a tensor by
    another tensor or a tuple: refuse it without formatting the key (printing a tensor is slow and
    would put its values into the one-sentence error)."""
    for key in state:
        if not isinstance(key, str):
            raise MergeError(
                f"{path} holds a state dict keyed by a {type(key).__name__} instead of parameter names; "
                "the file is damaged or is not a model checkpoint."
            )
