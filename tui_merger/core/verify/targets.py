"""Which weights the adapter must change, and by what scale, derived for the checks without the merge's
plan: peft itself wraps the layers of the base's meta model (``inject_adapter_in_model`` with the
adapter's ``adapter_config.json``: its own target matching, ``exclude_modules``, ``layers_to_transform``,
``rank_pattern`` / ``alpha_pattern``, rsLoRA) and says each wrapped layer's ``scaling``; transformers names
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
    import copy

    from tui_merger.core.formats.hf_names import meta_of_config

    raw = _adapter_config(adapter)
    if raw is None or str(raw.get("peft_type", "LORA")).upper() != "LORA" or raw.get("target_parameters"):
        return None
    meta = meta_of_config(config)
    if meta is None:
        return None
    try:
        import torch
        from peft import LoraConfig, inject_adapter_in_model
        from peft.tuners.lora import LoraLayer
        from transformers.core_model_loading import revert_weight_conversion

        fields = LoraConfig.__dataclass_fields__
        cfg = {k: v for k, v in raw.items() if k in fields and k not in ("base_model_name_or_path", "revision")}
        if lora_alpha is not None:  # the user's --lora-alpha takes the place of every recorded alpha
            cfg["lora_alpha"], cfg["alpha_pattern"] = lora_alpha, {}
        cfg["inference_mode"] = True
        model = copy.deepcopy(meta)
        # not low_cpu_mem_usage: that patches torch's module creation for every thread while it runs (the
        # behaviour check builds its models meanwhile); the small LoRA factors are made, then put on meta
        inject_adapter_in_model(LoraConfig(**cfg), model)
        wrapped = {}
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and "default" in getattr(module, "scaling", {}):
                base = module.get_base_layer()
                weight = getattr(base, "weight", None)
                if weight is not None and weight.dim() >= 2 and not hasattr(module, "parameter_name"):
                    wrapped[f"{name.replace('.base_layer', '')}.weight"] = float(module.scaling["default"])
        out = {}
        for memory, scale in wrapped.items():
            disk = revert_weight_conversion(meta, {memory: torch.empty((1, 1), device="meta")})
            if len(disk) == 1:  # one tensor on disk for the one in memory
                out[next(iter(disk))] = scale
        return out
    except Exception:  # noqa: BLE001 - a config or model peft or transformers cannot take here
        return None


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


def plan_problems(plan, expected: dict[str, float] | None) -> list[str]:
    """Sentences for each weight where the plan's LoRA differs from what peft applies."""
    from tui_merger.core.plan.plan import LoraOp

    if not expected:
        return []
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


def _merged(t):
    """The 16-bit tensor an output quantized again is made from (its LoRA is there), else ``t``."""
    weights = getattr(t.source.source, "weights", None)
    return weights.get(t.name, t) if isinstance(weights, dict) else t


def _plain_linear(name: str, expected: dict) -> bool:
    """A weight of the kind ``expected`` covers (the same module suffix as one of its weights), so that a
    LoRA there which peft does not apply is a difference, not a layer this check leaves alone."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    return any(n.rsplit(".", 2)[-2] == leaf for n in expected)
