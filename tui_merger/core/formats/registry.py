"""The checkpoint kinds tui-merger knows, in the order detection tries them.

Adding a kind is one module in this package (a ``Format`` subclass, see ``base.py``), one line in
``FORMATS``, and its tests. ``inspect``, the merge's input opening, the command line's ``--backend``
choices and the assistant all iterate this list; none of them names a kind.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.base import Format


@dataclass(frozen=True)
class Entry:
    """One kind: what can be told without importing its module (the command line's --backend choices
    are built at every start), and where its ``Format`` lives. A test checks these against the class."""

    kind: str
    role: str
    module: str  # in tui_merger.core.formats
    name: str  # the Format subclass
    backend: str | None = None


# detection order: a folder of rank files is FSDP even when it also looks like something else
ENTRIES = (
    Entry("verl-fsdp", "checkpoint", "verl_fsdp", "VerlFsdpFormat", backend="fsdp"),
    Entry("verl-megatron", "checkpoint", "verl_megatron", "VerlMegatronFormat", backend="megatron"),
    Entry("deepspeed-zero", "checkpoint", "deepspeed_zero", "DeepSpeedZeroFormat", backend="deepspeed"),
    Entry("trainer-fsdp", "checkpoint", "trainer_fsdp", "TrainerFsdpFormat", backend="accelerate-fsdp"),
    Entry("peft-adapter", "adapter", "peft_adapter", "PeftAdapterFormat"),
    Entry("hf-model", "model", "hf_model", "HfModelFormat"),
    Entry("kohya-lora", "adapter", "kohya", "KohyaFormat"),
)
BACKENDS = tuple(e.backend for e in ENTRIES if e.backend)  # --backend's choices, besides "auto"


@lru_cache(maxsize=None)
def formats(role: str | None = None) -> tuple[Format, ...]:
    """The kinds (of one role), in detection order; their modules are imported on first use."""
    if role is not None:
        return tuple(f for f in formats() if f.role == role)
    return tuple(
        getattr(importlib.import_module(f"tui_merger.core.formats.{e.module}"), e.name)() for e in ENTRIES
    )


def format_of(candidate) -> Format | None:
    """The kind that found a candidate of ``inspect`` (None for a kind tui-merger does not know)."""
    kind = candidate.format or candidate.kind
    return next((f for f in formats() if f.kind == kind), None)


def checkpoint_format(path) -> Format:
    """The kind of a checkpoint folder the user named (cheap: names and stat). When none claims it,
    the first kind, whose opening then says in one sentence what is missing."""
    path = Path(path)
    return next((f for f in formats("checkpoint") if f.recognizes(path)), formats("checkpoint")[0])


def check_backend(path, backend: str) -> None:
    """``--backend`` against what the folder is: one sentence when they disagree; "auto" detects."""
    if backend == "auto":
        return
    path = Path(path)
    wanted = next(f for f in formats("checkpoint") if f.backend == backend)
    actual = next((f for f in formats("checkpoint") if f.recognizes(path)), None)
    if actual is wanted:
        return
    if actual is not None:
        raise MergeError(
            f"{path} is {actual.label}, not {wanted.short}; use --backend {actual.backend} (or leave --backend out)."
        )
    wanted.locate(path)  # raises its own sentence (no such folder, no checkpoint)


def open_adapter(path, base_names=None, config: dict | None = None, alpha_given=False):
    """What --adapter names (a PEFT adapter folder, the adapter_model file inside one, a kohya-style LoRA
    file), opened by its kind against ``base_names``, the base's tensor names. ``alpha_given``: a
    --lora-alpha replaces the recorded alpha next (``adapter.use_alpha``), so a recorded 0 is not refused."""
    path = Path(path)
    for fmt in formats("adapter"):
        if fmt.recognizes(path):
            return fmt.open_adapter(path, base_names, config, alpha_given=alpha_given)
    from tui_merger.core.formats.kohya import file_kind

    if path.name.endswith(".safetensors") and file_kind(path) == "peft":
        raise MergeError(
            f"{path} holds peft LoRA tensors (lora_A / lora_B) but has no adapter_config.json beside it; "
            "point --adapter at the folder peft's save_pretrained wrote, with its adapter_config.json."
        )
    raise MergeError(
        f"{path} is neither a PEFT adapter folder nor a kohya-style LoRA .safetensors file; point --adapter "
        "at the folder holding adapter_config.json, or at a .safetensors file with lora_down / lora_up tensors."
    )


def checkpoint_lora(path):
    """The LoRA a checkpoint folder holds without its base (a PeftAdapter), for proposing bases; None
    when no checkpoint kind claims the folder or it holds none."""
    path = Path(path)
    for fmt in formats("checkpoint"):
        if fmt.recognizes(path):
            return fmt.lora_to_fit(path)
    return None


def checkpoint_weights(path) -> dict | None:
    """The full weights a checkpoint folder holds without a config ({name: shape}), for proposing the
    base it was trained from; None when no checkpoint kind claims the folder or it holds none."""
    path = Path(path)
    for fmt in formats("checkpoint"):
        if fmt.recognizes(path):
            return fmt.weights_to_fit(path)
    return None


def adapter_format(path) -> Format:
    path = Path(path)
    return next(f for f in formats("adapter") if f.recognizes(path))


def model_format() -> Format:
    return formats("model")[0]
