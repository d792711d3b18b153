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


def _used(manifest: dict) -> dict | None:
    used = manifest.get("base_used")
    return used if isinstance(used, dict) else None


def hub_base(manifest: dict) -> str | None:
    """The Hub id of the base model the merge used, when that is known: a snapshot of the Hugging Face
    cache, or a local folder named like the Hub model the adapter names (a download with --local-dir).
    A manifest written before ``base_used`` was recorded: what the adapter named."""
    used = _used(manifest)
    if used is None:
        return hub_model_id(manifest.get("base_model"))
    repo = hub_model_id(used.get("repo"))
    if repo:
        return repo
    named = hub_model_id(used.get("named"))
    if named and (used.get("named_is_this") or used.get("folder") == named.split("/")[-1]):
        return named
    return None


def _name(value) -> str:
    """A model reference for the card: a Hub id as it is, a local path as its folder's name."""
    text = str(value or "")
    return text if hub_model_id(text) else (Path(text).name or text)


# names that say little alone (a trainer's checkpoint-N, verl's global_step_N/actor, "adapter"): the card
# names the folders above them too
_GENERIC = re.compile(r"^(adapter|adapters|lora|lora_adapter|lora-adapter|output|outputs|actor|critic|final|"
                      r"huggingface|checkpoint-\d+|global_step_\d+|\d+)$", re.I)


def _merged_inputs(manifest: dict) -> list[str]:
    """The adapters or the checkpoint the merge read, as the card names them: the folder's (or file's)
    name, with the folders above it while the name alone says little (``my-run/checkpoint-200``)."""
    names, inputs = [], manifest.get("inputs")
    for entry in inputs if isinstance(inputs, list) else []:
        if not isinstance(entry, dict) or entry.get("role") not in ("adapter", "checkpoint") or not entry.get("path"):
            continue
        path = Path(str(entry["path"]))
        parts = [path.name]
        while _GENERIC.match(path.name) and path.parent.name and len(parts) < 3:
            path = path.parent
            parts.insert(0, path.name)
        names.append("/".join(parts))
    return names


def _base_words(manifest: dict) -> list[str]:
    """What the adapter was merged into and why that model, without local paths."""
    used = _used(manifest)
    if used is None:
        return [f"This model is {_name(manifest.get('base_model')) or 'a base model'} with "]
    hub = hub_base(manifest)
    model = f"`{hub}`" if hub else f"the local model folder `{used.get('folder')}`"
    arch = f" ({used['architecture']})" if used.get("architecture") else ""
    named = used.get("named")
    fits = f"its architecture and weight shapes fit all {used.get('modules')} LoRA modules of the adapter"
    if used.get("named_is_this"):
        why = "the base model the adapter names."
    elif named and hub and hub == hub_model_id(named):
        why = f"a local copy of the base model the adapter names (by its folder's name); {fits}."
    elif named:
        where = "another folder" if used.get("named_found") else "not on the machine it was merged on"
        why = f"taken because {fits}; the adapter names {_name(named)} as its base, which was {where}."
    else:
        why = f"taken because {fits}; the adapter does not say which base model it was trained on."
    return [f"Base model: {model}{arch}, {why}", "", "This model is that base with "]


def _without_local_paths(text: str, manifest: dict) -> str:
    """Every local path the manifest records (inputs, options, the output) replaced by its folder's or
    file's name: the card is published, the paths mean nothing to its readers."""
    paths = {str(i.get("path")) for i in manifest.get("inputs", []) if isinstance(i, dict) and i.get("path")}
    options = manifest.get("options") if isinstance(manifest.get("options"), dict) else {}
    paths |= {str(options[k]) for k in ("base", "adapter", "out", "checkpoint") if isinstance(options.get(k), str)}
    adapters = options.get("adapters") if isinstance(options.get("adapters"), list) else []  # a damaged manifest: none
    paths |= {str(p[0]) for p in adapters if isinstance(p, list) and p and isinstance(p[0], str)}
    for key in ("out", "base_model"):
        if isinstance(manifest.get(key), str):
            paths.add(manifest[key])
    for path in sorted((p for p in paths if p.startswith(("/", "~"))), key=len, reverse=True):
        text = text.replace(path, Path(path).name or path)
    return text


def render_model_card(manifest: dict) -> str:
    base = hub_base(manifest)
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
        if manifest.get("kind") != "export-adapter":
            *before, lead = _base_words(manifest)
            lines.extend(before)
            lines.append(
                f"{lead}{'weighted LoRA adapters' if adapter.get('adapters') else 'a LoRA adapter'} merged into its "
                f"weights by tui-merger {manifest.get('tool', {}).get('version', '')}."
            )
            merged = _merged_inputs(manifest)
            if merged:
                lines.append("")
                lines.append(f"Merged {'adapters' if len(merged) > 1 else 'adapter'}: "
                             + ", ".join(f"`{name}`" for name in merged) + ".")
        else:
            lines.append("A base model and its LoRA adapter (in `lora_adapter/`), written by tui-merger.")
        lines.append("")
        lines.append("| setting | value |")
        lines.append("|---|---|")
        for key in ("r", "alpha", "variant", "target_modules", "modules_to_save"):
            value = adapter.get(key)
            if value not in (None, [], ""):
                shown = ", ".join(map(str, value)) if isinstance(value, list) else value
                if key == "alpha" and adapter.get("alpha_from"):  # not recorded by the adapter
                    shown = f"{shown} (from {adapter['alpha_from']})"
                lines.append(f"| {key} | {shown} |")
        for part in adapter.get("adapters") or []:  # a weighted merge of several adapters
            lines.append(f"| adapter | {Path(str(part.get('path'))).name} × {part.get('weight')} (r={part.get('r')}) |")
    else:
        merged = _merged_inputs(manifest)
        which = f" (`{merged[0]}`)" if merged else ""
        lines.append(f"Converted from a training checkpoint{which} by tui-merger {manifest.get('tool', {}).get('version', '')}.")
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
        summary = re.sub(r"^(passed|failed):\s*", "", str(ver.get("summary", "")))  # the verdict is said once
        lines.append(("Passed" if ver.get("passed") else "FAILED") + f": {summary}")
        lines.append("")
        for check in ver.get("checks", []):
            lines.append(f"- {check.get('name')}: {check.get('status')} — {check.get('summary', '')}")
    lines.append("")
    lines.extend(_gguf_lines(manifest))
    lines.append(f"Merged at {manifest.get('merged_at')}; inputs and output files with sha256 are in `merge_manifest.json`.")
    return _without_local_paths("\n".join(lines) + "\n", manifest)


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


def _gguf_lines(manifest: dict) -> list[str]:
    """The GGUF files made of the model (``tui-merger gguf``) and whether each was checked, as recorded."""
    entries = [e for e in manifest.get("gguf") or [] if isinstance(e, dict) and e.get("path")]
    loras = manifest.get("gguf_lora") if isinstance(manifest.get("gguf_lora"), list) else []  # ship/gguf_lora.py
    loras = [e for e in loras if isinstance(e, dict) and e.get("path")]
    if not entries and not loras:
        return []
    lines = ["## GGUF", ""]
    for e in entries:
        check = e.get("check") if isinstance(e.get("check"), dict) else None
        if check is None:
            verdict = "not checked"
        else:
            status = str(check.get("status"))
            verdict = ("not checked" if status == "not checked" else status.upper()) + f": {check.get('summary', '')}"
        modelfile = f"; Ollama: `{Path(str(e['modelfile'])).name}`" if e.get("modelfile") else ""
        lines.append(f"- `{Path(str(e['path'])).name}` ({str(e.get('type', '')).upper()}{modelfile}). Check {verdict}")
    for e in loras:  # a GGUF LoRA of an adapter for this model, checked with llama.cpp on the base's GGUF
        check = e.get("check") if isinstance(e.get("check"), dict) else None
        status = str(check.get("status")) if check else "not checked"
        verdict = ("not checked" if status not in ("passed", "failed") else status.upper()) + (f": {check.get('summary', '')}" if check else "")
        adapter = f" of the adapter `{Path(str(e['adapter'])).name}`" if e.get("adapter") else ""
        base = f" for `{Path(str(e['base_gguf'])).name}`" if e.get("base_gguf") else ""
        lines.append(f"- `{Path(str(e['path'])).name}` (a LoRA{adapter}{base}, F32; llama.cpp `--lora`, Ollama `ADAPTER`). Check {verdict}")
    lines.append("")
    return lines
