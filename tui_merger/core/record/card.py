"""The model card (README.md) of a merged model, made from its manifest.

Front matter the Hub reads (base_model, base_model_relation, library_name, tags), then what was
merged and how, and the verification summary. A README.md that tui-merger did not write is never
replaced unless asked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tui_merger.core.record.manifest import read_manifest

CARD_NAME = "README.md"
MARKER = "<!-- model card written by tui-merger from merge_manifest.json; remove this line to keep your edits -->"


def _relation(manifest: dict) -> str:
    kind = manifest.get("kind")
    if kind == "export-adapter":
        return "adapter"
    adapters = [i for i in manifest.get("inputs", []) if i.get("role") == "adapter"]
    return "merge" if len(adapters) > 1 else "finetune"


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_model_id(name) -> str | None:
    """``name`` when it is a Hub model id (ORG/NAME), else None: a local path in base_model would be
    refused by the Hub's metadata check and means nothing to readers."""
    text = str(name or "")
    if not _REPO_ID.fullmatch(text) or text.startswith(".") or Path(text).expanduser().exists():
        return None
    return text


def _yaml_str(value: str) -> str:
    return json.dumps(str(value))  # a JSON string is a valid YAML scalar


def render_model_card(manifest: dict) -> str:
    base = hub_model_id(manifest.get("base_model"))
    adapter = manifest.get("adapter") or {}
    lines = ["---"]
    if base:
        lines.append(f"base_model: {_yaml_str(base)}")
        lines.append(f"base_model_relation: {_relation(manifest)}")
    lines.append("library_name: " + ("peft" if manifest.get("kind") == "export-adapter" else "transformers"))
    tags = ["tui-merger", "merge"]
    if adapter:
        tags.append(str(adapter.get("variant") or "lora"))
    lines.append("tags:")
    lines.extend(f"- {t}" for t in tags)
    lines.append("---")
    lines.append(MARKER)
    lines.append("")
    title = Path(str(manifest.get("out") or "merged-model")).name
    lines.append(f"# {title}")
    lines.append("")
    if adapter:
        lines.append(
            f"This model is {manifest.get('base_model') or 'a base model'} with "
            f"{'weighted LoRA adapters' if adapter.get('adapters') else 'a LoRA adapter'} merged into its weights by "
            f"tui-merger {manifest.get('tool', {}).get('version', '')}."
            if manifest.get("kind") != "export-adapter"
            else "A base model and its LoRA adapter (in `lora_adapter/`), written by tui-merger."
        )
        lines.append("")
        lines.append("| setting | value |")
        lines.append("|---|---|")
        for key in ("r", "alpha", "variant", "target_modules", "modules_to_save"):
            value = adapter.get(key)
            if value not in (None, [], ""):
                shown = ", ".join(map(str, value)) if isinstance(value, list) else value
                lines.append(f"| {key} | {shown} |")
        for part in adapter.get("adapters") or []:  # a weighted merge of several adapters
            lines.append(f"| adapter | {Path(str(part.get('path'))).name} × {part.get('weight')} (r={part.get('r')}) |")
    else:
        lines.append(f"Converted from a training checkpoint by tui-merger {manifest.get('tool', {}).get('version', '')}.")
    lines.append("")
    options = manifest.get("options") or {}
    if options.get("dtype"):
        lines.append(f"Weights are stored in {options['dtype']}.")
        lines.append("")
    lines.append("## Verification")
    lines.append("")
    ver = manifest.get("verification")
    if not isinstance(ver, dict):
        lines.append("Not verified yet: run `tui-merger verify` on this folder.")
    else:
        lines.append(("Passed" if ver.get("passed") else "FAILED") + f": {ver.get('summary', '')}")
        lines.append("")
        for check in ver.get("checks", []):
            lines.append(f"- {check.get('name')}: {check.get('status')} — {check.get('summary', '')}")
    lines.append("")
    lines.append(f"Merged at {manifest.get('merged_at')}; inputs and output files with sha256 are in `merge_manifest.json`.")
    return "\n".join(lines) + "\n"


def is_ours(path: Path) -> bool:
    try:
        return MARKER in path.read_text(errors="replace")
    except OSError:
        return False


def write_model_card(folder: Path, manifest: dict, overwrite: bool = False) -> bool:
    """Write README.md from the manifest; keeps a README.md someone else wrote unless ``overwrite``.
    Returns whether the card was written."""
    path = Path(folder) / CARD_NAME
    if path.exists() and not overwrite and not is_ours(path):
        return False
    text = render_model_card({**manifest, "out": str(folder)})
    path.write_text(text)
    return True


def ensure_model_card(folder: Path) -> Path | None:
    """A README.md for upload: the existing one, else one made from the manifest, else None."""
    path = Path(folder) / CARD_NAME
    if path.is_file():
        return path
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    write_model_card(folder, manifest)
    return path
