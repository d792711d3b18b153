"""From a detected checkpoint to merge options: what the interactive front ends (the TUI and the plain
flow) ask the user, and what they fill in by themselves."""

from __future__ import annotations

from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.options import MergeOptions

MERGEABLE = ("peft-adapter", "trainer-checkpoint", "verl-fsdp")


def why_not_mergeable(c) -> str | None:
    """None when tui-merger can merge this candidate, else one sentence why not."""
    if c.kind == "verl-megatron":
        return "Megatron checkpoints cannot be merged by tui-merger yet."
    if c.kind == "kohya-lora":
        return "kohya-style LoRA files cannot be merged by tui-merger yet."
    if c.kind == "hf-model":
        return "This is already a complete Hugging Face model: there is nothing to merge."
    if c.kind == "trainer-checkpoint" and not c.lora:
        return "This checkpoint holds full weights, already a model: there is nothing to merge."
    if c.kind not in MERGEABLE:
        return f"tui-merger cannot merge a {c.kind}."
    return None


def needs_base(c) -> bool:
    """The user must give the base model folder (it is not named, or not on this machine)."""
    if c.kind == "verl-fsdp":
        return bool(c.needs_base)
    return not c.base_path


def needs_alpha(c) -> bool:
    return c.kind == "verl-fsdp" and bool(c.lora) and not c.lora.get("alpha")


def default_out_folder(c) -> tuple[Path, str]:
    """Where the merged model goes by default, and that place in words: beside the training folder
    (the run, else the checkpoint), else (not writable there) the current folder."""
    import os

    beside = Path(c.run or c.path).parent
    if os.access(beside, os.W_OK):
        return beside, f"beside the training folder, into {beside}"
    return Path.cwd(), f"into the current folder, {Path.cwd()}, because {beside} is not writable"


def options_for(c, *, base=None, out=None, lora_alpha=None, **write_options) -> MergeOptions:
    """MergeOptions for a candidate; ``write_options``: dtype, shard_size, tokenizer_from, overwrite."""
    problem = why_not_mergeable(c)
    if problem:
        raise MergeError(problem)
    base = base or (c.base_path if c.kind != "verl-fsdp" else None)
    if c.kind == "verl-fsdp":
        return MergeOptions(checkpoint=Path(c.path), base=base, out=out, lora_alpha=lora_alpha, **write_options)
    if not base:
        raise MergeError("Say which base model the adapter was trained on (a folder with config.json).")
    return MergeOptions(base=Path(base), adapter=Path(c.path), out=out, **write_options)


def describe_candidate(c, root: Path | None = None) -> str:
    """One line: kind, path, step (latest), LoRA r/alpha."""
    path = Path(c.path)
    try:
        shown = str(path.relative_to(root)) if root else str(path)
    except ValueError:
        shown = str(path)
    parts = [c.kind, shown or "."]
    if c.step is not None:
        parts.append(f"step {c.step}" + (" (latest)" if c.latest else ""))
    if c.lora:
        alpha = c.lora.get("alpha")
        parts.append(f"LoRA r={c.lora.get('r')} alpha={'missing' if not alpha else alpha}")
    return "  ".join(parts)
