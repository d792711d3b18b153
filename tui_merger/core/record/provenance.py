"""After a merge: hash inputs and outputs, write ``merge_manifest.json`` and the model card, and note the
merge in the user's history. Verification results are added to the same manifest when they exist."""

from __future__ import annotations

import time
from pathlib import Path

from tui_merger import __version__
from tui_merger.core.record.card import write_model_card
from tui_merger.core.record.manifest import (
    FORMAT,
    MANIFEST_NAME,
    describe_files,
    now_iso,
    read_manifest,
    record_history,
    write_manifest,
)
from tui_merger.core.options import MergeOptions, MergeResult
from tui_merger.core.merge.output import PENDING_NAME


def _group_inputs(options: MergeOptions, files: list[Path]) -> list[dict]:
    roles = [(r, p) for r, p in (("checkpoint", options.checkpoint), ("base", options.base), ("adapter", options.adapter)) if p]
    roles += [("adapter", p) for p, _ in options.adapters[1:]]  # the other adapters of a weighted merge
    roles = [(r, Path(p).parent if Path(p).is_file() else p) for r, p in roles]  # a kohya file: its folder + name
    groups: dict[tuple[str, Path], list[str]] = {(r, Path(p).absolute()): [] for r, p in roles}
    for f in files:
        f = Path(f).absolute()
        for (role, folder), names in groups.items():
            if f.is_relative_to(folder):
                names.append(str(f.relative_to(folder)))
                break
        else:
            groups.setdefault(("other", f.parent), []).append(f.name)
    return [
        {"role": role, "path": str(folder), "files": describe_files(folder, [n for n in names if (folder / n).is_file()])}
        for (role, folder), names in groups.items()
    ]


def build_manifest(options: MergeOptions, result: MergeResult) -> dict:
    started = time.perf_counter()
    out = Path(result.out)
    inputs = _group_inputs(options, result.input_files)
    outputs = describe_files(out, [f for f in result.files if f != MANIFEST_NAME and f != "README.md"])
    return {
        "format": FORMAT,
        "tool": {"name": "tui-merger", "version": __version__},
        "merged_at": now_iso(),
        "kind": result.kind,
        "inputs": inputs,
        "adapter": result.adapter_info,
        "base_model": result.base_model,
        "base_used": result.base_used,  # which base and why that one (the card says it without local paths)
        "base_weights": result.base_weights,  # as stored, or the --qlora-base round trip with its settings
        "options": options.to_dict(),
        "config_changes": result.config_changes,
        "warnings": result.warnings,
        "outputs": outputs,
        "timings": {"merge_s": round(result.seconds, 3), "hash_s": round(time.perf_counter() - started, 3)},
        "verification": None,
    }


def record_merge(options: MergeOptions, result: MergeResult, fsync: bool = True) -> dict:
    """Write the manifest and the model card into the finished output; returns the manifest."""
    manifest = build_manifest(options, result)
    write_manifest(result.out, manifest, fsync=fsync)
    write_model_card(result.out, manifest)
    record_history(result.out, manifest)
    return manifest


def record_verification(out: Path, verification: dict, fsync: bool = True, overwrite_card: bool = False) -> dict | None:
    """Store a verification report in the output's manifest and refresh the model card (a README.md
    tui-merger did not write is replaced only with ``overwrite_card``)."""
    manifest = read_manifest(out)
    if manifest is None:
        return None
    manifest["verification"] = verification
    manifest.setdefault("timings", {})["verify_s"] = verification.get("seconds")
    write_manifest(out, manifest, fsync=fsync)
    write_model_card(out, manifest, overwrite=overwrite_card)
    return manifest


def finish_merge(
    options: MergeOptions,
    result: MergeResult,
    *,
    verify: bool = True,
    behaviour: bool = True,
    perplexity_text: Path | None = None,
    on_event=None,
    cancel=None,
    fsync: bool = True,
):
    """What follows every merge: the manifest and model card, then verification (recorded in both).
    Returns (manifest, VerifyReport or None)."""
    from tui_merger.core.events import PhaseStarted, ignore_event
    from tui_merger.core.verify.checks import verify_merge

    on_event = on_event or ignore_event
    manifest = read_manifest(result.out) if result.kept_earlier else None
    if manifest is None or manifest.get("verification") is not None:
        on_event(PhaseStarted("record", "Hashing inputs and outputs into merge_manifest.json"))
        manifest = record_merge(options, result, fsync=fsync)
    for name in ("README.md", MANIFEST_NAME):
        if (Path(result.out) / name).is_file() and name not in result.files:
            result.files = sorted(result.files + [name])
    if not verify:
        (Path(result.out) / PENDING_NAME).unlink(missing_ok=True)  # recorded as not verified, by choice
        return manifest, None
    report = verify_merge(
        result.out, options, behaviour=behaviour, perplexity_text=perplexity_text, on_event=on_event, cancel=cancel
    )
    manifest = record_verification(result.out, report.to_dict(), fsync=fsync) or manifest
    (Path(result.out) / PENDING_NAME).unlink(missing_ok=True)  # verified: a later run of it is refused
    return manifest, report
