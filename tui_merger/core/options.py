"""What a merge is asked to do (options) and what it did (result). Plain data, JSON-friendly."""

from __future__ import annotations

import re
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

    def __post_init__(self) -> None:
        for key in ("base", "adapter", "out", "checkpoint"):
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, Path(value).expanduser())
        if self.checkpoint is None and (self.base is None or self.adapter is None):
            raise MergeError("Give a base model and an adapter (--base and --adapter), or a checkpoint folder.")
        self.dtype = normalize_dtype(self.dtype)
        self.shard_size = parse_size(self.shard_size)
        if self.tokenizer_from not in ("auto", "base", "adapter"):
            raise MergeError(
                f"--tokenizer-from must be base or adapter, not '{self.tokenizer_from}'."
            )

    def to_dict(self) -> dict:
        data = asdict(self)
        for key in ("base", "adapter", "out", "checkpoint"):
            data[key] = None if data[key] is None else str(data[key])
        return data


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
