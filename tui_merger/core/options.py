"""What a merge is asked to do (options) and what it did (result). Plain data, JSON-friendly."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError

DEFAULT_SHARD_SIZE = 5_000_000_000  # "5GB", as transformers counts it

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "f32": "float32",
    "float32": "float32",
    "float": "float32",
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def human_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as disk tools and the Hub count)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover


def python_command() -> str:
    """The Python tui-merger runs in, as a command that works from any folder: its full path (after a pipx
    install, `python` is another Python, without transformers)."""
    import shlex
    import sys

    return shlex.quote(sys.executable or "python")


def parse_size(text: str | int) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524288000, 1024 -> 1024."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise MergeError(f"'{text}' is not a size; write it like 5GB, 500MB or 2GiB.")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise MergeError(f"The shard size must be positive, got {text}.")
    return value


def normalize_dtype(text: str | None) -> str | None:
    if text is None:
        return None
    dtype = DTYPE_ALIASES.get(str(text).lower())
    if dtype is None:
        raise MergeError(f"'{text}' is not an output dtype; choose bf16, fp16 or fp32.")
    return dtype


@dataclass
class MergeOptions:
    base: Path | None = None  # a Hugging Face model folder
    adapter: Path | None = None  # a PEFT adapter folder
    out: Path | None = None
    dtype: str | None = None  # None: the base's (each tensor's own; a checkpoint's saved config)
    shard_size: int = DEFAULT_SHARD_SIZE
    tokenizer_from: str = "auto"  # auto | base | adapter
    overwrite: bool = False
    force_fp16_overflow: bool = False  # clamp instead of refusing
    checkpoint: Path | None = None  # a verl FSDP checkpoint (run, global_step_N or actor folder)
    lora_alpha: float | None = None  # for checkpoints that do not record it
    is_value_model: bool = False
    tie_word_embedding: bool = False
    export_adapter: bool = False  # write the base and a PEFT adapter folder instead of merging
    base_roundtrip: str | None = None  # "nf4[:blocksize=64,double_quant=no]": merge into dequant(quant(W)), as QLoRA saw it
    output_quantization: str | None = None  # "keep": the base's own FP8 blocks again; "fp8": FP8 blocks from any merge
    # weighted merge: [(adapter, weight), ...]; the first is also ``adapter``. Empty: ``adapter`` with weight 1.
    adapters: list = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_types(self)
        for key in ("base", "adapter", "out", "checkpoint"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, Path(value).expanduser())
        self.adapters = [_adapter_spec(item) for item in self.adapters]
        if self.adapters and self.adapter is None:
            self.adapter = self.adapters[0][0]
        elif self.adapters and self.adapters[0][0] != self.adapter:
            raise MergeError("Give the adapters either as --adapter options or as a list, not both.")
        if len({path.resolve() for path, _ in self.adapters}) < len(self.adapters):
            raise MergeError("The same adapter is given twice; give each adapter once with its weight.")
        if self.checkpoint is None and (self.base is None or self.adapter is None):
            raise MergeError("Give a base model and an adapter (--base and --adapter), or a checkpoint folder.")
        self.dtype = normalize_dtype(self.dtype)
        self.shard_size = parse_size(self.shard_size)
        if self.base_roundtrip is not None:
            from tui_merger.core.formats.quant import parse_roundtrip

            parse_roundtrip(self.base_roundtrip)  # a bad value is said now, in one sentence
            if self.checkpoint is not None:
                raise MergeError("--qlora-base works with --base and --adapter, not with a checkpoint folder.")
        if self.output_quantization not in (None, "keep", "fp8"):
            raise MergeError(
                f"The output quantization must be keep (--keep-quantization) or fp8 (--quantize fp8), not "
                f"'{self.output_quantization}'."
            )
        if self.output_quantization is not None and (self.checkpoint is not None or self.export_adapter):
            raise MergeError("--keep-quantization and --quantize fp8 work with --base and --adapter merges only.")
        if self.tokenizer_from not in ("auto", "base", "adapter"):
            raise MergeError(
                f"--tokenizer-from must be base or adapter, not '{self.tokenizer_from}'."
            )

    @property
    def weighted(self) -> bool:
        """More than one adapter, or one with a weight other than 1."""
        return len(self.adapters) > 1 or any(w != 1.0 for _, w in self.adapters)

    def adapter_weights(self) -> list[tuple[Path, float]]:
        """Every adapter with its weight (an unweighted merge: the one adapter, weight 1)."""
        if self.adapters:
            return list(self.adapters)
        return [(self.adapter, 1.0)] if self.adapter is not None else []

    def to_dict(self) -> dict:
        data = asdict(self)
        for key in ("base", "adapter", "out", "checkpoint"):
            data[key] = None if data[key] is None else str(data[key])
        data["adapters"] = [[str(p), w] for p, w in self.adapters]
        return data


def is_finite_number(value) -> bool:
    """A JSON number that is a real value: an int or float (not a bool), not NaN or infinite."""
    import math

    return type(value) in (int, float) and math.isfinite(value)


_PATHLIKE = (str, Path)
_OPTION_TYPES = {  # field -> (accepts, what it should be); options also come from JSON (manifests, job requests)
    "base": (lambda v: v is None or isinstance(v, _PATHLIKE), "a folder path"),
    "adapter": (lambda v: v is None or isinstance(v, _PATHLIKE), "a path"),
    "out": (lambda v: v is None or isinstance(v, _PATHLIKE), "a folder path"),
    "checkpoint": (lambda v: v is None or isinstance(v, _PATHLIKE), "a folder path"),
    "dtype": (lambda v: v is None or isinstance(v, str), "a dtype name"),
    "shard_size": (lambda v: isinstance(v, str) or (type(v) is int and v > 0), "a size such as 5GB"),
    "tokenizer_from": (lambda v: isinstance(v, str), "auto, base or adapter"),
    "overwrite": (lambda v: isinstance(v, bool), "true or false"),
    "force_fp16_overflow": (lambda v: isinstance(v, bool), "true or false"),
    "is_value_model": (lambda v: isinstance(v, bool), "true or false"),
    "tie_word_embedding": (lambda v: isinstance(v, bool), "true or false"),
    "export_adapter": (lambda v: isinstance(v, bool), "true or false"),
    "lora_alpha": (lambda v: v is None or is_finite_number(v), "a finite number"),
    "base_roundtrip": (lambda v: v is None or isinstance(v, str), "a setting such as nf4"),
    "output_quantization": (lambda v: v is None or isinstance(v, str), "keep or fp8"),
    "adapters": (lambda v: isinstance(v, list) and all(
        isinstance(i, _PATHLIKE) or (isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[0], _PATHLIKE)
                                     and (isinstance(i[1], str) or is_finite_number(i[1])))
        for i in v), "a list of [path, weight] pairs"),
}


def check_option_types(values: dict) -> None:
    """Options as JSON holds them (a manifest, a job request): each present one of the right type."""
    import json

    for key, (ok, what) in _OPTION_TYPES.items():
        if key in values and not ok(values[key]):
            shown = json.dumps(values[key], default=str)[:40]
            raise MergeError(f"The option {key} is {shown}, not {what}.")


def _check_types(options) -> None:
    check_option_types({key: getattr(options, key) for key in _OPTION_TYPES})


def _adapter_spec(item) -> tuple[Path, float]:
    if isinstance(item, (str, Path)):
        return parse_adapter_spec(str(item))
    path, weight = item
    return Path(path).expanduser(), parse_weight(weight, str(path))


def parse_weight(value, where: str) -> float:
    import math

    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise MergeError(f"The weight of {where} is '{value}', not a number; write it like ADAPTER:0.7.") from None
    if not math.isfinite(weight):
        raise MergeError(f"The weight of {where} must be a finite number, not {value}.")
    if weight == 0:
        raise MergeError(f"A weight of 0 leaves {where} out of the merge; remove that --adapter instead.")
    return weight


def parse_adapter_spec(text: str) -> tuple[Path, float]:
    """'path/to/adapter:0.7' -> (path, 0.7); a plain path has weight 1. A path that exists as given
    (even with a colon in its name) is taken as a path."""
    path = Path(text).expanduser()
    head, sep, tail = text.rpartition(":")
    if not sep or path.exists() or not head:
        return path, 1.0
    try:
        float(tail)
    except ValueError:
        if Path(head).expanduser().exists():  # ADAPTER:WEIGHT with a weight that is not a number
            parse_weight(tail, head)
        return path, 1.0  # a colon that is part of the name
    return Path(head).expanduser(), parse_weight(tail, head)


@dataclass
class MergeResult:
    out: Path
    files: list[str] = field(default_factory=list)  # every file written, relative to out
    shards: list[str] = field(default_factory=list)
    tensors_total: int = 0
    tensors_merged: int = 0  # tensors changed by the adapter
    bytes_written: int = 0
    seconds: float = 0.0
    tokenizer_source: str | None = None  # "adapter", "base" or None (no tokenizer found)
    config_changes: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # provenance, filled by the engine for the manifest
    kind: str = "merge"  # "merge", "convert" (a checkpoint without LoRA) or "export-adapter"
    input_files: list[Path] = field(default_factory=list)
    adapter_info: dict | None = None  # r, alpha, variant, target_modules, modules_to_save
    base_model: str | None = None  # what the adapter / checkpoint says its base is
    base_used: dict | None = None  # the base folder's name / Hub id, what the adapter names, why this one (engine.base_used)
    base_weights: dict | None = None  # which base weights: as stored, or the --qlora-base round trip and its settings
    kept_earlier: bool = False  # the output of an earlier run of the same merge, stopped before verification

    def tensors_text(self) -> str:
        """'50 tensors (28 changed by the adapter)', as the front ends say it."""
        if self.kind == "convert":
            return f"{self.tensors_total} tensors (converted from the checkpoint, no adapter)"
        several = len((self.adapter_info or {}).get("adapters") or []) > 1
        return f"{self.tensors_total} tensors ({self.tensors_merged} changed by the adapter{'s' if several else ''})"


def plain_number(value):
    """2.0 -> 2 (how ranks and alphas are shown and stored), other values unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def common_and_exceptions(values: dict) -> tuple[object, dict]:
    """(the most common value, {key: value} for the keys that differ from it)."""
    if not values:
        return None, {}
    common = Counter(values.values()).most_common(1)[0][0]
    return common, {k: v for k, v in values.items() if v != common}
