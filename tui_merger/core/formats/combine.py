"""Weighted merges of several LoRA adapters: W' = W + sum_i(w_i * s_i * B_i @ A_i), exactly.

Each adapter keeps its own pair: the plan gets one op per adapter touching a module, computed in fp32
and rounded once. peft's ``add_weighted_adapter(combination_type="linear")`` instead averages the A and B
matrices, whose product then carries cross terms (w_1 w_2 B_1 A_2 ...); its "cat" combination, like ours,
concatenates the ranks and is exact. The combined adapter can also be written as one PEFT adapter
(ranks concatenated, zero-padded to one rank so that no rank_pattern is needed).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tui_merger.core.formats.adapter import ADAPTER_WEIGHTS, PEFT_PREFIX, LoraModule, PeftAdapter
from tui_merger.core.errors import MergeError


def _label(path: Path) -> str:
    return Path(path).name or str(path)


def _base_name(adapter: PeftAdapter) -> str | None:
    name = adapter.config.get("base_model_name_or_path")
    if not isinstance(name, str) or not name.strip():
        return None
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _same_local_base(first: str, other: str) -> bool:
    """Two base names that differ but lead to one model here: the same folder (a symlink, a copy in the
    HF cache), or a folder whose config or cache path carries the other name."""
    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.io.hf_refs import names_of_base, resolve_model_reference

    folders = [resolve_model_reference(n) for n in (first, other)]
    if folders[0] is not None and folders[1] is not None and folders[0].resolve() == folders[1].resolve():
        return True
    for folder, name in ((folders[0], other), (folders[1], first)):
        if folder is not None and name in names_of_base(folder, json_object_or_none(folder / "config.json") or {}):
            return True
    return False


def combine_adapters(parts: list[tuple[PeftAdapter, float, Path]]) -> PeftAdapter:
    """One adapter standing for several weighted ones. A single adapter of weight 1 is returned as it is."""
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0]
    first = parts[0][0]
    for adapter, weight, path in parts:
        label = _label(path)
        if adapter.replacements or adapter.base_overrides or adapter.token_rows:
            raise MergeError(
                f"{label} saves full copies of some modules (modules_to_save, trainable tokens or a resized "
                "embedding), which cannot be weighted or added to other adapters; merge it alone first, then "
                "merge the other adapters into that result."
            )
        if adapter.use_dora or any(m.magnitude is not None for m in adapter.lora.values()):
            raise MergeError(
                f"{label} is a DoRA adapter, whose weight normalisation does not add up across adapters or "
                "scale with a weight; merge it alone (weight 1)."
            )
        if adapter.fan_in_fan_out != first.fan_in_fan_out:
            raise MergeError(
                f"{label} stores its weights transposed (fan_in_fan_out) and {_label(parts[0][2])} does not; "
                "they cannot come from the same base model."
            )
        if not adapter.lora:
            raise MergeError(f"{label} holds no LoRA weights, so a weight for it would change nothing.")
    names = [(_base_name(a), p) for a, _, p in parts]
    known = [(n, p) for n, p in names if n]
    raw = {p: a.config.get("base_model_name_or_path") for a, _, p in parts}
    for name, path in known[1:]:
        if name != known[0][0] and not _same_local_base(raw[known[0][1]], raw[path]):
            raise MergeError(
                f"{_label(known[0][1])} was trained on {known[0][0]} but {_label(path)} on {name}; a weighted "
                "merge needs adapters of one base model (if they do share it, make base_model_name_or_path "
                "agree in their adapter_config.json)."
            )

    lora: dict[str, LoraModule] = {}
    described = []
    notices: list[str] = []
    for index, (adapter, weight, path) in enumerate(parts):
        cfg = adapter.config
        described.append(
            {
                "path": str(path),
                "weight": weight,
                "r": cfg.get("r"),
                "lora_alpha": cfg.get("lora_alpha"),
                "alpha_from": adapter.alpha_from,
                "use_rslora": bool(cfg.get("use_rslora", False)),
                "target_modules": sorted({m.rsplit(".", 1)[-1] for m in adapter.lora}),
                "modules": len(adapter.lora),
            }
        )
        notices += [f"{_label(path)}: {n}" for n in adapter.notices]
        for mod, entry in adapter.lora.items():
            term = replace(entry, scale=entry.scale * weight, origin=index, terms=[])
            if mod in lora:
                lora[mod].terms.append(term)
            else:
                lora[mod] = term
    config = {
        "peft_type": "LORA",
        "combined": True,
        "adapters": described,
        "fan_in_fan_out": first.fan_in_fan_out,
        "base_model_name_or_path": first.config.get("base_model_name_or_path"),
        "task_type": first.config.get("task_type", "CAUSAL_LM"),
        "target_modules": sorted({t for d in described for t in d["target_modules"]}),
    }
    return PeftAdapter(folder=first.folder, config=config, source=None, lora=lora, notices=notices)


def overlaps(adapter: PeftAdapter) -> dict[str, list[int]]:
    """module -> indices of the adapters that change it (only for modules changed by more than one)."""
    return {
        mod: [entry.origin] + [t.origin for t in entry.terms]
        for mod, entry in adapter.lora.items()
        if entry.terms
    }


def overlap_summary(adapter: PeftAdapter) -> list[str]:
    """Lines saying which adapters touch which kinds of module, e.g. 'q_proj: A + B (24 modules)'."""
    described = adapter.config.get("adapters") or []
    labels = [_label(Path(d["path"])) for d in described]
    groups: dict[tuple[str, tuple[int, ...]], int] = {}
    for mod, entry in adapter.lora.items():
        origins = tuple(sorted({entry.origin, *(t.origin for t in entry.terms)}))
        key = (mod.rsplit(".", 1)[-1], origins)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (kind, origins), count in sorted(groups.items()):
        who = " + ".join(labels[i] if i < len(labels) else str(i) for i in origins)
        lines.append(f"{kind}: {who} ({count} module{'s' if count != 1 else ''})")
    return lines


def export_combined_adapter(adapter: PeftAdapter, dest: Path, fsync: bool = True) -> list[str]:
    """One PEFT adapter equal to the weighted sum: for each module A = [A_1; A_2; 0], B = [w_1 s_1 B_1,
    w_2 s_2 B_2, 0] in fp32, every module padded with zeros to the same rank R and lora_alpha = R, so that
    peft's scale is 1 and no rank_pattern is needed (loaders that read one r, like vLLM's, need none)."""
    import torch

    from tui_merger.core.io.safetensors_io import SafetensorsWriter

    terms = {mod: [entry, *entry.terms] for mod, entry in adapter.lora.items()}
    rank = max(sum(t.r for t in ts) for ts in terms.values())
    entries = []
    for mod, ts in terms.items():
        emb = ts[0].is_embedding
        a_ref, b_ref = (ts[0].emb_A, ts[0].emb_B) if emb else (ts[0].A, ts[0].B)
        a_key, b_key = ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A.weight", "lora_B.weight")
        entries.append((f"{PEFT_PREFIX}{mod}.{a_key}", (rank, a_ref.shape[1]), mod, "A"))
        entries.append((f"{PEFT_PREFIX}{mod}.{b_key}", (b_ref.shape[0], rank), mod, "B"))
        if any(t.B_bias is not None for t in ts):
            entries.append((f"{PEFT_PREFIX}{mod}.lora_B.bias", (b_ref.shape[0],), mod, "bias"))
    dest.mkdir(parents=True)
    writer = SafetensorsWriter(
        dest / ADAPTER_WEIGHTS[0], [(name, "float32", shape) for name, shape, _, _ in entries], early_writeback=False
    )
    try:
        for name, shape, mod, part in entries:
            out = torch.zeros(shape, dtype=torch.float32)
            at = 0
            for t in terms[mod]:
                a_ref, b_ref = (t.emb_A, t.emb_B) if t.is_embedding else (t.A, t.B)
                if part == "A":
                    out[at : at + t.r] = a_ref.load().float()
                elif part == "B":
                    out[:, at : at + t.r] = b_ref.load().float() * t.scale
                elif t.B_bias is not None:
                    out += t.B_bias.load().float() * t.scale
                at += t.r
            writer.write_tensor(name, out)
        writer.close(fsync=fsync)
    except BaseException:
        writer.abort()
        raise
    config = {
        "peft_type": "LORA",
        "task_type": adapter.config.get("task_type", "CAUSAL_LM"),
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted({mod.rsplit(".", 1)[-1] for mod in terms}),
        "use_rslora": False,
        "lora_dropout": 0.0,
        "bias": "none",
        "lora_bias": any(part == "bias" for _, _, _, part in entries),
        "fan_in_fan_out": adapter.fan_in_fan_out,
        "base_model_name_or_path": "..",
        "inference_mode": True,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [f"{dest.name}/adapter_config.json", f"{dest.name}/{ADAPTER_WEIGHTS[0]}"]


def export_adapter_folder(adapter: PeftAdapter, dest: Path, fsync: bool = True) -> list[str]:
    """The adapter as a PEFT folder: combined adapters as one exact adapter, others as they are."""
    from tui_merger.core.formats.adapter import export_peft_adapter

    if adapter.config.get("combined"):
        return export_combined_adapter(adapter, dest, fsync)
    return export_peft_adapter(adapter, dest, fsync)
