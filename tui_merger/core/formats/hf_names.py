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

import threading
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


BUILD_LOCK = threading.RLock()  # held while a meta model is built: accelerate's init_empty_weights
# patches torch.nn.Module for every thread, so a module built meanwhile elsewhere would be empty too


def meta_model(cls, config):
    """``cls`` built from ``config`` on the meta device, in fp32, buffers real (rotary tables)."""
    import torch
    from accelerate import init_empty_weights

    with BUILD_LOCK, init_empty_weights(include_buffers=False):
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




def _meta_of(config_dir: Path):
    """The model whose config.json lies in ``config_dir``, built on the meta device (the last one is
    kept: a merge asks for names and then for the layout of the same base); None when transformers
    cannot build it (custom code, an unknown architecture). Its remarks on the config stay quiet."""
    import json

    import transformers

    config_path = Path(config_dir) / "config.json"
    try:
        key = (str(config_path.resolve()), config_path.stat().st_mtime_ns)
    except OSError:
        return None
    if _META and _META[0] == key:
        return _META[1]
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        cls = model_class(json.loads(config_path.read_text()))
        model = meta_model(cls, transformers.AutoConfig.from_pretrained(config_dir)) if cls is not None else None
    except Exception:  # noqa: BLE001 - custom code, a config transformers cannot build: no translation
        model = None
    finally:
        logging.set_verbosity(verbosity)
    _META[:] = [key, model]
    return model


_META: list = []


def memory_to_disk(config_dir: Path, disk_names) -> dict[str, str]:
    """{in-memory parameter name: on-disk name} for the on-disk tensor names ``disk_names`` of the model
    whose config.json lies in ``config_dir``, by transformers' own loading rules (so a base saved with
    older names is met where it is). Names only renamed (not converted, like packed experts) are
    listed; an architecture transformers cannot build gives {}."""
    model = _meta_of(config_dir)
    if model is None:
        return {}
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
    cannot build or convert it: names are then kept as they are."""
    model = _meta_of(config_dir)
    if model is None:
        return None
    try:
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
    except Exception:  # noqa: BLE001 - rules this model cannot take: names as they are
        return None
    return DiskLayout(model, renames, groups)


_DERIVED_LOCK = threading.RLock()


class _DerivedSource:
    """A source whose tensors are computed from other sources' tensors: loaded whole, never copied as
    raw file bytes nor in row blocks; its pieces go with the tensor they came from."""

    folder = None
    files: list[str] = []

    def load(self, ref):
        raise NotImplementedError

    def load_into(self, ref, out) -> None:
        out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None

    def row_blocks(self, ref):
        return None

    def release(self, ref) -> None:
        pass

    def close(self) -> None:
        self._cache.clear()


class ConvertedSource(_DerivedSource):
    """On-disk tensors made from in-memory ones that transformers splits when saving (packed experts
    -> one tensor per expert). Loading one converts its whole group once and hands out the pieces;
    the group is dropped when each piece was handed out (a second pass converts it again)."""

    def __init__(self, inner: dict, layout: DiskLayout) -> None:
        from tui_merger.core.io.sources import TensorRef

        self.layout = layout
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
        with _DERIVED_LOCK:  # the recompute and the reference pass read side by side
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


class SlicedSource(_DerivedSource):
    """Small tensors that are parts of others (a LoRA factor's rows or strided columns): each part
    is cut from its parent, which is read once and kept until each of its parts was handed out."""

    def __init__(self) -> None:
        self.tensors: dict = {}
        self._parts: dict[str, tuple] = {}  # name -> (parent ref, rows, columns)
        self._children: dict[int, set] = {}
        self._cache: dict[int, object] = {}
        self._served: dict[int, set] = {}

    def add(self, name: str, parent, rows: tuple[int, int], columns: tuple[int, int] | None = None):
        """``rows``: (start, stop); ``columns``: (first, step), every step-th column from first."""
        from tui_merger.core.io.sources import TensorRef

        n_rows = rows[1] - rows[0]
        n_cols = parent.shape[1] if columns is None else len(range(columns[0], parent.shape[1], columns[1]))
        ref = TensorRef(self, "", name, parent.dtype, (n_rows, n_cols))
        self.tensors[name] = ref
        self._parts[name] = (parent, rows, columns)
        self._children.setdefault(id(parent), set()).add(name)
        return ref

    def load(self, ref):
        with _DERIVED_LOCK:  # the recompute and the reference pass read side by side
            parent, rows, columns = self._parts[ref.name]
            key = id(parent)
            whole = self._cache.get(key)
            if whole is None:
                whole = self._cache[key] = parent.load()
                parent.release()
                self._served[key] = set()
            part = whole[rows[0]:rows[1]]
            if columns is not None:
                part = part[:, columns[0]::columns[1]]
            self._served[key].add(ref.name)
            if self._served[key] >= self._children[key]:
                del self._cache[key], self._served[key]
            return part.contiguous()


def _placed(model, state: dict, entry) -> str:
    """The parameter a parameter-LoRA pair changes: the one of its module's targeted parameters whose
    shape fits the pair; when several fit, by peft's nesting (module parameter order, first innermost)."""
    from tui_merger.core.errors import MergeError

    depth, params = entry.candidates
    owner = entry.module
    module = model.get_submodule(owner)
    transposed = bool(getattr(module, "is_transposed", False))
    order = [n for n, _ in module.named_parameters(recurse=False) if n in params]
    if len(order) <= depth:
        raise MergeError(f"{owner}: the adapter's LoRA pairs do not fit the parameters {', '.join(params)} of the base.")
    fits = []
    for pname in order:
        shape = state[f"{owner}.{pname}"].shape
        if len(shape) == 3:
            d_out, d_in = (shape[2], shape[1]) if transposed else (shape[1], shape[2])
            if entry.A.shape[1] == d_in and entry.B.shape[0] == d_out:
                fits.append(pname)
    chosen = fits[0] if len(fits) == 1 else order[len(order) - 1 - depth]
    return f"{owner}.{chosen}"


def expert_loras(layout: DiskLayout, adapter, sliced: SlicedSource) -> dict:
    """peft ``target_parameters`` LoRA on packed experts as ordinary LoRA on the tensors
    ``save_pretrained`` writes: {on-disk module: LoraModule}. peft's delta for expert e of a packed
    ``[experts, out, in]`` parameter is ``B_e @ A_e`` with ``A_e`` rows e*r..(e+1)*r of lora_A and
    ``B_e`` every experts-th column of lora_B from e; which rows of it each on-disk tensor takes is
    found by converting an index tensor with transformers' own reverse conversion."""
    import torch

    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.adapter import LoraModule

    state = layout.model.state_dict()
    out = {}
    placed = {}
    for entry in adapter.param_lora.values():
        name = _placed(layout.model, state, entry)
        if name in placed:
            raise MergeError(f"The adapter holds two LoRA pairs for {name}; the adapter file is inconsistent.")
        placed[name] = entry
    for name, entry in placed.items():
        entry.module = name
        packed = state.get(name)
        if packed is None:
            raise MergeError(f"The adapter changes the parameter {name}, which the base model does not have.")
        module = layout.model.get_submodule(name.rsplit(".", 1)[0])
        experts = entry.A.shape[0] // entry.r
        transposed = bool(getattr(module, "is_transposed", False))  # [experts, in, out] (GPT-OSS)
        if packed.dim() != 3 or packed.shape[0] != experts:
            raise MergeError(
                f"{name}: LoRA on a parameter of shape {list(packed.shape)} ({experts} experts of rank {entry.r}) "
                "is not supported yet; only packed experts are."
            )
        _, d_out, d_in = packed.shape
        if transposed:
            d_out, d_in = d_in, d_out
        if entry.A.shape[1] != d_in or entry.B.shape[0] != d_out:
            raise MergeError(
                f"{name}: its LoRA pair (lora_A {list(entry.A.shape)}, lora_B {list(entry.B.shape)}) does not fit "
                f"the parameter's shape {list(packed.shape)}; is the base the model the adapter was trained on?"
            )
        pieces = layout.convert(name, torch.empty(tuple(packed.shape), device="meta"))  # names only
        if list(pieces) == [name]:  # kept packed on disk too: one op on the packed tensor
            entry.experts, entry.transposed = experts, transposed
            adapter.expert_lora[name] = entry
            continue
        if transposed:
            raise MergeError(
                f"{name}: experts stored [experts, in, out] and split on saving are not supported yet."
            )
        index = torch.arange(experts * d_out, dtype=torch.float64).reshape(experts, d_out, 1)
        pieces = layout.convert(name, index)
        for disk, rows in pieces.items():
            flat = rows.flatten().long()
            expert, start = divmod(int(flat[0]), d_out)
            stop = start + flat.numel()
            if rows.dim() != 2 or rows.shape[1] != 1 or not torch.equal(flat, torch.arange(flat[0], flat[0] + flat.numel())) \
                    or stop > d_out:
                raise MergeError(f"{name}: transformers saves these experts in a layout tui-merger cannot merge LoRA into yet.")
            mod = disk.removesuffix(".weight")
            a = sliced.add(f"{mod}.lora_A", entry.A, (expert * entry.r, (expert + 1) * entry.r))
            b = sliced.add(f"{mod}.lora_B", entry.B, (start, stop), (expert, experts))
            out[mod] = LoraModule(mod, A=a, B=b, r=entry.r, alpha=entry.alpha, scale=entry.scale)
    return out
