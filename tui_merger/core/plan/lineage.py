"""What a model folder already has merged into it, read from its ``merge_manifest.json``.

A folder tui-merger wrote records its inputs: the base it started from, each adapter (path, files with
sha256) or the checkpoint whose LoRA went into the weights. Such a folder is never proposed as the base
of an adapter, and merging an adapter into a model that already holds it is refused: the adapter's change
would be applied twice, and verification (which compares with that same model plus the adapter) could not
see it. The manifests of the bases it was made from are followed too (a model merged from a merged model).
Reads small JSON files, and hashes an adapter's weights only when a recorded file has their very size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError

_MAX_DEPTH = 8  # bases of bases followed at most this far (a manifest cannot name itself forever)


@dataclass
class Merged:
    """An adapter (or a checkpoint's LoRA) that a model folder's weights hold."""

    path: Path  # as the manifest records it (absolute)
    files: list  # [{path, size, sha256}] as recorded
    role: str  # "adapter" or "checkpoint"
    model: Path  # the folder whose manifest records it
    made_from: Path | None  # the base that merge started from, as recorded (None: a checkpoint's own)


def _manifest(folder: Path) -> dict | None:
    from tui_merger.core.record.manifest import read_manifest

    return read_manifest(folder)


def records_adapter(folder) -> bool:
    """The folder's manifest records an adapter or a checkpoint's LoRA among its inputs: a model made
    by merging (or an export beside its adapter), never to be proposed as the base of an adapter."""
    manifest = _manifest(Path(folder))
    if manifest is None:
        return False
    if manifest.get("adapter"):
        return True
    return any(i.get("role") == "adapter" for i in manifest.get("inputs", []))


def merged_into(folder) -> list[Merged]:
    """Every adapter merged into the weights of ``folder``, and of the bases it was made from."""
    found: list[Merged] = []
    seen: set[str] = set()
    todo = [Path(folder)]
    while todo and len(seen) < _MAX_DEPTH:
        model = todo.pop()
        key = os.path.realpath(model)
        if key in seen:
            continue
        seen.add(key)
        manifest = _manifest(model)
        if manifest is None:
            continue
        inputs = manifest.get("inputs", [])
        made_from = next((Path(i["path"]) for i in inputs if i.get("role") == "base"), None)
        if manifest.get("kind", "merge") == "merge":  # an export keeps the base as it was; a conversion has no LoRA
            for i in inputs:
                if i.get("role") in ("adapter", "checkpoint") and (i["role"] == "adapter" or manifest.get("adapter")):
                    found.append(Merged(Path(i["path"]), i.get("files", []), i["role"], model, made_from))
        if made_from is not None:
            todo.append(made_from)
    return found


def _weight_files(adapter: Path) -> list[Path]:
    """The files that carry an adapter's weights: a kohya-style file itself, or a PEFT folder's."""
    if adapter.is_file():
        return [adapter]
    return [p for p in (adapter / "adapter_model.safetensors", adapter / "adapter_model.bin") if p.is_file()]


def _same_adapter(adapter: Path, merged: Merged) -> bool:
    """The adapter is the one recorded: the same place (or inside the checkpoint recorded), or weights
    with the same sha256 (a copy of it elsewhere)."""
    here = Path(os.path.realpath(adapter))
    recorded = Path(os.path.realpath(merged.path))
    if merged.role == "checkpoint":
        return here == recorded or here.is_relative_to(recorded)  # the LoRA a checkpoint saved beside its shards
    if here == recorded or (adapter.is_file() and here.parent == recorded
                            and any(f.get("path") == adapter.name for f in merged.files)):
        return True
    weights = _weight_files(adapter)
    sizes = {}
    for f in merged.files:
        if str(f.get("path", "")).endswith((".safetensors", ".bin")):
            sizes.setdefault(f.get("size"), set()).add(f.get("sha256"))
    candidates = [w for w in weights if w.stat().st_size in sizes]
    if not candidates:
        return False
    from tui_merger.core.record.manifest import cached_sha256

    return any(digest in sizes[w.stat().st_size] for w, digest in zip(candidates, cached_sha256(candidates)))


def already_holds(base, adapter) -> Merged | None:
    """The record saying that ``base`` already holds ``adapter`` merged into its weights, or None."""
    adapter = Path(adapter)
    try:
        for merged in merged_into(base):
            if _same_adapter(adapter, merged):
                return merged
    except OSError:
        return None  # an adapter that cannot be read: opening it says what is wrong
    return None


def merged_twice(base, adapter) -> tuple[str, str] | None:
    """(what is wrong, what to do) when ``adapter`` is already merged into ``base``, else None."""
    merged = already_holds(base, adapter)
    if merged is None:
        return None
    from tui_merger.core.formats.base import shown

    name = shown(adapter)
    where = "" if Path(merged.model) == Path(base) else f" (through {shown(merged.model)}, which it was made from)"
    message = (
        f"{shown(base)} already has the adapter {name} merged into it{where}, as its merge_manifest.json "
        "records, so merging it again would apply the adapter twice."
    )
    origin = merged.made_from
    into = f"the model it was made from, {shown(origin)}" if origin is not None else "the base model it was trained on"
    fix = (
        f"Merge the adapter into {into}; to apply its change twice on purpose, give it weight 2 there "
        f"(--adapter {name}:2)."
    )
    return message, fix


def refuse_merged_twice(options) -> None:
    """Raise the sentence when an adapter of ``options`` is already merged into its base (``--force``
    does not change this: it is not a warning)."""
    if options.base is None or options.checkpoint is not None:
        return
    for path, _ in options.adapter_weights():
        said = merged_twice(options.base, path)
        if said is not None:
            raise MergeError(" ".join(said))
