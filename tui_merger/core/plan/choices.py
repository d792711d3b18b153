"""From a detected checkpoint to merge options: what the interactive front ends (the TUI and the plain
flow) ask the user, and what they fill in by themselves."""

from __future__ import annotations

from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.options import MergeOptions



def _format(c):
    from tui_merger.core.formats.registry import format_of

    return format_of(c)


def why_not_mergeable(c) -> str | None:
    """None when tui-merger can merge this candidate, else one sentence why not."""
    fmt = _format(c)
    if fmt is None:
        return f"tui-merger cannot merge a {c.kind}."
    return fmt.why_not_mergeable(c)


def needs_base(c) -> bool:
    """The user must give the base model folder (it is not named, or not on this machine)."""
    return _format(c).needs_base(c)


def needs_alpha(c) -> bool:
    return _format(c).needs_alpha(c)


def can_weight(c) -> bool:
    """An adapter the user may weight and blend with other adapters (not a checkpoint's own LoRA)."""
    return _format(c).can_weight(c)


def is_checkpoint(c) -> bool:
    """A checkpoint that carries what the merge reads (opened as --checkpoint, not merged into --base)."""
    fmt = _format(c)
    return fmt is not None and fmt.role == "checkpoint"


def parse_more_adapters(text: str) -> list:
    """'a:0.3; b:0.5' -> [(a, 0.3), (b, 0.5)] (what the TUI's "more adapters" field holds)."""
    from tui_merger.core.options import parse_adapter_spec

    return [parse_adapter_spec(item.strip()) for item in (text or "").split(";") if item.strip()]


def default_out_folder(c) -> tuple[Path, str]:
    """Where the merged model goes by default, and that place in words: beside the training folder
    (the run, else the checkpoint), else (not writable there) the current folder."""
    import os

    beside = Path(c.run or c.path).parent
    if os.access(beside, os.W_OK):
        return beside, f"beside the training folder, into {beside}"
    return Path.cwd(), f"into the current folder, {Path.cwd()}, because {beside} is not writable"


def holds_files(folder: Path) -> bool:
    """A folder with something in it (merging into it needs --overwrite / "Replace")."""
    try:
        return Path(folder).is_dir() and any(Path(folder).iterdir())
    except OSError:
        return True  # unreadable: treat as taken


def free_output(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first name that is not an existing folder with
    files in it (nor a file), so a suggestion never collides with an earlier run's output."""
    path = Path(path)
    candidate, n = path, 1
    while candidate.is_file() or holds_files(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def options_for(c, *, base=None, out=None, lora_alpha=None, weight="1", more="", **write_options) -> MergeOptions:
    """MergeOptions for a candidate; ``write_options``: dtype, shard_size, tokenizer_from, overwrite.
    ``weight`` and ``more`` ('path:weight; ...') make a weighted merge of several adapters."""
    problem = why_not_mergeable(c)
    if problem:
        raise MergeError(problem)
    checkpoint = is_checkpoint(c)
    base = base or (c.base_path if not checkpoint else None)
    if checkpoint:
        return MergeOptions(checkpoint=Path(c.path), base=base, out=out, lora_alpha=lora_alpha, **write_options)
    if not base:
        raise MergeError("Say which base model the adapter was trained on (a folder with config.json).")
    from tui_merger.core.options import parse_weight

    extra = parse_more_adapters(more)
    first = (Path(c.path), parse_weight(weight, Path(c.path).name))
    if extra or first[1] != 1.0:
        return MergeOptions(base=Path(base), adapters=[first, *extra], out=out, **write_options)
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
