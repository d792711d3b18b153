"""Which weights the adapter must change, and by what scale, derived for the checks without the merge's
plan: peft's own functions pick the layers of the base's meta model it would wrap with the adapter's
``adapter_config.json`` (``check_target_module_exists``: target matching, ``exclude_modules``,
``layers_to_transform``; ``all-linear`` expanded by peft) and each one's rank and alpha (``get_pattern_key``
on ``rank_pattern`` / ``alpha_pattern``; the scale as its ``LoraLayer`` sets it, rsLoRA too); transformers names
each layer's weight on disk (``revert_weight_conversion``). The plan (``plan.build_plan``, which the
recompute repeats) must put a LoRA of that scale on exactly those weights: a target the plan dropped, one
it added or a wrong scale is a structure problem, whatever the recompute and the behaviour check say.

Derived for LoRA layers on one weight each (Linear, GPT-2's Conv1D, embeddings); a parameter LoRA
(``target_parameters``: packed experts, routers) and a weight that transformers stores otherwise on disk
(experts packed in memory, one matrix each on disk) are left to the recompute and the behaviour check.
"""

from __future__ import annotations

import json
from pathlib import Path


def expected_loras(config: dict, adapter, lora_alpha=None) -> dict[str, float] | None:
    """{on-disk weight name: scale} of every layer peft wraps with this adapter on the model ``config``
    describes; None when it cannot be derived here (transformers cannot build the model, peft refuses the
    config, not a LoRA)."""
    from tui_merger.core.formats.hf_names import meta_of_config

    raw = _adapter_config(adapter)
    if raw is None or str(raw.get("peft_type", "LORA")).upper() != "LORA" or raw.get("target_parameters"):
        return None
    meta = meta_of_config(config)
    if meta is None:
        return None
    try:
        import math

        import torch
        from peft import LoraConfig
        from peft.tuners.tuners_utils import _maybe_include_all_linear_layers, check_target_module_exists
        from peft.utils.other import get_pattern_key
        from transformers.core_model_loading import revert_weight_conversion

        fields = LoraConfig.__dataclass_fields__
        cfg = {k: v for k, v in raw.items() if k in fields and k not in ("base_model_name_or_path", "revision")}
        if lora_alpha is not None:  # the user's --lora-alpha takes the place of every recorded alpha
            cfg["lora_alpha"], cfg["alpha_pattern"] = lora_alpha, {}
        cfg["inference_mode"] = True
        lora = _maybe_include_all_linear_layers(LoraConfig(**cfg), meta)
        # peft's own choice of layers (inject_adapter's test: check_target_module_exists on each module
        # name, with exclude_modules, layers_to_transform and layers_pattern) and its scale for each
        # (rank and alpha patterns by get_pattern_key, then lora_alpha / r, or / sqrt(r) for rsLoRA, as its
        # LoraLayer.update_layer sets ``scaling``). Building the wrapped model itself took 3-4 s at 0.5B.
        wrapped = {}
        for name, module in meta.named_modules():
            weight = getattr(module, "weight", None)
            if not name or not isinstance(weight, torch.Tensor) or weight.dim() < 2 or list(module.children()):
                continue
            if not check_target_module_exists(lora, name):
                continue
            r = lora.rank_pattern.get(get_pattern_key(lora.rank_pattern.keys(), name), lora.r)
            alpha = lora.alpha_pattern.get(get_pattern_key(lora.alpha_pattern.keys(), name), lora.lora_alpha)
            wrapped[f"{name}.weight"] = alpha / math.sqrt(r) if lora.use_rslora else alpha / r
        disk = revert_weight_conversion(meta, {n: torch.empty((1, 1), device="meta") for n in wrapped})
        out = {n: scale for n, scale in wrapped.items() if n in disk}  # the same name in memory and on disk
        for memory in set(wrapped) - set(out):  # renamed on disk: one tensor for the one in memory
            one = revert_weight_conversion(meta, {memory: torch.empty((1, 1), device="meta")})
            if len(one) == 1:
                out[next(iter(one))] = wrapped[memory]
        return out
    except Exception:  # noqa: BLE001 - a config or model peft or transformers cannot take here
        return None


def expected_weighted(config: dict, adapter_weights, lora_alpha=None) -> dict[str, list[float]] | None:
    """{on-disk weight name: [scale of each adapter's LoRA there]} for a merge of several adapters, each
    at its weight (``adapter_weights``: [(folder, weight)]): peft's scale times the weight given, one entry
    per adapter that reaches the weight. None when any adapter's cannot be derived here."""
    from types import SimpleNamespace

    out: dict[str, list[float]] = {}
    for path, weight in adapter_weights:
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        one = expected_loras(config, SimpleNamespace(folder=folder, config=None), lora_alpha)
        if one is None:
            return None
        for name, scale in one.items():
            out.setdefault(name, []).append(scale * weight)
    return out


def _adapter_config(adapter) -> dict | None:
    """The adapter's own adapter_config.json (not the reader's copy), else the config the kind made."""
    folder = getattr(adapter, "folder", None)
    path = Path(folder) / "adapter_config.json" if folder is not None else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None
    cfg = getattr(adapter, "config", None)
    return dict(cfg) if isinstance(cfg, dict) and cfg.get("target_modules") else None


def plan_problems(plan, expected: dict | None) -> list[str]:
    """Sentences for each weight where the plan's LoRA differs from what peft applies. ``expected``:
    {name: scale} (one adapter) or {name: [scales]} (several adapters at their weights)."""
    from tui_merger.core.plan.plan import LoraOp

    if not expected:
        return []
    if any(isinstance(v, list) for v in expected.values()):
        return _weighted_problems(plan, expected, LoraOp)
    # an output quantized again: the LoRA is on the 16-bit tensor it is made from (its scale has none)
    ops = {t.name: [op for op in _merged(t).ops if type(op) is LoraOp] for t in plan.tensors
           if _merged(t).name == t.name}
    problems = []
    for name, scale in sorted(expected.items()):
        if name not in ops:
            continue  # not written under that name (a tied head, a weight the kind writes otherwise)
        if not ops[name]:
            problems.append(f"{name}: peft applies the adapter's LoRA here (scale {scale:g}) but the merge left it "
                            "unchanged")
        elif not any(abs(op.scale - scale) <= 1e-6 * abs(scale) for op in ops[name]):
            problems.append(f"{name}: merged with scale {ops[name][0].scale:g}, but peft's scale for it is {scale:g}")
    for name, found in sorted(ops.items()):
        if found and name not in expected and _plain_linear(name, expected):
            problems.append(f"{name}: the merge added a LoRA that peft's target matching does not put there")
    return problems


def _weighted_problems(plan, expected: dict, lora_op) -> list[str]:
    """plan_problems for several adapters: the plan's LoRA scales on each weight, as a multiset, equal to
    peft's scale times each adapter's weight."""
    ops = {t.name: sorted(op.scale for op in _merged(t).ops if type(op) is lora_op) for t in plan.tensors
           if _merged(t).name == t.name}
    problems = []
    for name, scales in sorted(expected.items()):
        if name not in ops:
            continue
        want, got = sorted(scales), ops[name]
        if len(want) != len(got) or any(abs(a - b) > 1e-6 * max(abs(a), 1e-12) for a, b in zip(want, got)):
            shown = ", ".join(f"{g:g}" for g in got) or "none"
            problems.append(f"{name}: merged with LoRA scale(s) {shown}, but peft's scales at the adapters' "
                            f"weights are {', '.join(f'{w:g}' for w in want)}")
    for name, found in sorted(ops.items()):
        if found and name not in expected and _plain_linear(name, expected):
            problems.append(f"{name}: the merge added a LoRA that peft's target matching does not put there")
    return problems


def _merged(t):
    """The 16-bit tensor an output quantized again is made from (its LoRA is there), else ``t``."""
    weights = getattr(t.source.source, "weights", None)
    return weights.get(t.name, t) if isinstance(weights, dict) else t


def _plain_linear(name: str, expected: dict) -> bool:
    """A weight of the kind ``expected`` covers (the same module suffix as one of its weights), so that a
    LoRA there which peft does not apply is a difference, not a layer this check leaves alone."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    return any(n.rsplit(".", 2)[-2] == leaf for n in expected)
