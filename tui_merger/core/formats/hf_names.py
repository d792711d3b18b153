"""Names as transformers keeps a model in memory and as ``save_pretrained`` writes it to disk.

transformers 5 holds some models under other names than their checkpoints use: Qwen2-VL / Qwen2.5-VL /
Qwen3-VL keep the language model as ``model.language_model.*`` and the vision tower as
``model.visual.*`` but write ``model.*`` and ``visual.*``; MoE models hold their experts packed. peft
adapters and verl FSDP checkpoints carry the in-memory names; tui-merger writes what ``save_pretrained``
writes. The translation is transformers' own (``get_model_conversion_mapping`` + ``rename_source_key``:
the rules its ``from_pretrained`` applies), read from a model built on the meta device; nothing here is
a table of ours. transformers is imported only when a translation is needed.
"""

from __future__ import annotations

from pathlib import Path


def model_class(config: dict):
    import transformers

    archs = config.get("architectures") or []
    if archs:
        return getattr(transformers, str(archs[0]), None)
    # no architectures in config.json (old or hand-written configs): a causal LM when its type is one
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def meta_model(cls, config):
    """``cls`` built from ``config`` on the meta device, in fp32, buffers real (rotary tables)."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=torch.float32)
    model.eval()
    return model


def renamer(model, state: dict):
    """on-disk name -> (in-memory name, converter source pattern, converter or None), by the rules
    transformers' from_pretrained applies; without them (older transformers) names only change by
    the base model prefix."""
    prefix = getattr(model, "base_model_prefix", "") or None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
    except Exception:  # transformers without conversion rules, or rules this model cannot take
        mapping = None
    if mapping is None:

        def plain(name: str):
            if name in state:
                return name, None, None
            if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in state:
                return name[len(prefix) + 1 :], None, None
            if prefix and f"{prefix}.{name}" in state:
                return f"{prefix}.{name}", None, None
            return name, None, None

        return plain
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}

    def rename(name: str):
        target, pattern = rename_source_key(name, renamings, converters, prefix, state)
        if target not in state and name in state:
            target, pattern = rename_source_key(name, [], [], prefix, state)
        return target, pattern, (by_pattern.get(pattern) if pattern is not None else None)

    return rename




def memory_to_disk(config_dir: Path, disk_names) -> dict[str, str]:
    """{in-memory parameter name: on-disk name} for the on-disk tensor names ``disk_names`` of the model
    whose config.json lies in ``config_dir``, by transformers' own loading rules. Names only renamed
    (not converted, like packed experts) are listed; an unknown architecture gives {}."""
    import json

    import transformers

    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its remarks on the config are not the user's business here
    try:
        config_dict = json.loads((Path(config_dir) / "config.json").read_text())
        cls = model_class(config_dict)
        if cls is None:
            return {}
        config = transformers.AutoConfig.from_pretrained(config_dir)
        model = meta_model(cls, config)
    except Exception:  # noqa: BLE001 - custom code, a config transformers cannot build: no translation
        return {}
    finally:
        logging.set_verbosity(verbosity)
    state = dict(model.state_dict(keep_vars=True))
    rename = renamer(model, state)
    out = {}
    for name in disk_names:
        target, _pattern, converter = rename(name)
        if converter is None and target in state and target != name:
            out.setdefault(target, name)
    return out
