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


class DiskLayout:
    """How a model's in-memory tensors become the tensors ``save_pretrained`` writes: ``renames``
    (in-memory name -> on-disk name, where they differ) and ``groups`` (in-memory name -> {on-disk
    name: shape} for tensors transformers splits on saving, e.g. packed MoE experts). Read from a meta
    model by transformers' own ``revert_weight_conversion``, one tensor at a time; no data read."""

    def __init__(self, model, renames: dict[str, str], groups: dict[str, dict[str, tuple]]) -> None:
        self.model = model
        self.renames = renames
        self.groups = groups

    def convert(self, name: str, tensor) -> dict:
        """{on-disk name: tensor} for one in-memory tensor, by transformers' reverse conversion."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, {name: tensor})


def disk_layout(config_dir: Path) -> DiskLayout | None:
    """The layout for the model whose config.json lies in ``config_dir``; None when transformers
    cannot build it (custom code, an unknown architecture): names are then kept as they are."""
    import json

    import transformers

    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        cls = model_class(json.loads((Path(config_dir) / "config.json").read_text()))
        if cls is None:
            return None
        model = meta_model(cls, transformers.AutoConfig.from_pretrained(config_dir))
        from transformers.core_model_loading import revert_weight_conversion

        renames, groups = {}, {}
        for name, tensor in model.state_dict().items():
            out = revert_weight_conversion(model, {name: tensor})
            if len(out) == 1:
                (disk,) = out
                if disk != name:
                    renames[name] = disk
            elif out:
                groups[name] = {disk: tuple(t.shape) for disk, t in out.items()}
    except Exception:  # noqa: BLE001 - a model transformers cannot build or convert: names as they are
        return None
    finally:
        logging.set_verbosity(verbosity)
    return DiskLayout(model, renames, groups)


class ConvertedSource:
    """On-disk tensors made from in-memory ones that transformers splits when saving (packed experts
    -> one tensor per expert). Loading one converts its whole group once and hands out the pieces;
    the group is dropped when each piece was handed out (a second pass converts it again)."""

    def __init__(self, inner: dict, layout: DiskLayout) -> None:
        from tui_merger.core.io.sources import TensorRef

        self.layout = layout
        self.folder = None
        self.files: list[str] = []
        self.tensors = {}
        self._group_of: dict[str, str] = {}
        self._inner = inner  # in-memory name -> TensorRef of the tensor it is made from
        self._cache: dict[str, dict] = {}
        self._served: dict[str, set] = {}
        for name, ref in inner.items():
            for disk, shape in layout.groups[name].items():
                self.tensors[disk] = TensorRef(self, "", disk, ref.dtype, shape)
                self._group_of[disk] = name

    def load(self, ref):
        group = self._group_of[ref.name]
        pieces = self._cache.get(group)
        if pieces is None:
            source = self._inner[group]
            pieces = self._cache[group] = {k: v.contiguous() for k, v in self.layout.convert(group, source.load()).items()}
            source.release()
            self._served[group] = set()
        tensor = pieces[ref.name]
        served = self._served[group]
        served.add(ref.name)
        if len(served) == len(pieces):
            del self._cache[group], self._served[group]
        return tensor

    def load_into(self, ref, out) -> None:
        out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None

    def row_blocks(self, ref):
        return None

    def release(self, ref) -> None:
        pass  # the pieces go with their group

    def close(self) -> None:
        self._cache.clear()
