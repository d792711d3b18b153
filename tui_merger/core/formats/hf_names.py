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

from tui_merger.core.io.sources import DerivedSource


def model_class(config: dict):
    import transformers

    archs = config.get("architectures") or []
    if archs:
        return getattr(transformers, str(archs[0]), None)
    # no architectures in config.json (old or hand-written configs): a causal LM when its type is one
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    # a vision-language model's (transformers 4.57 wrote its architectures into text_config only)
    name = (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
            or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(str(config.get("model_type"))))
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
    # The command line imports transformers' model code ahead in a thread (plan/preflight.import_ahead): a
    # first transformers.AutoConfig while that thread is inside transformers.models.auto raised AttributeError,
    # and the base read as "cannot build". Importing the module itself waits for the other thread.
    import transformers.models.auto  # noqa: F401

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


class _DerivedSource(DerivedSource):
    """A source whose tensors are computed from other sources' tensors, kept until handed out; its
    pieces go with the tensor they came from."""

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
    """Small tensors that are parts of others (a LoRA factor's rows or strided columns, perhaps
    transposed): each part is cut from its parent, which is read once and kept until each of its
    parts was handed out."""

    def __init__(self) -> None:
        self.tensors: dict = {}
        self._parts: dict[str, tuple] = {}  # name -> (parent ref, row slice, column slice, transposed)
        self._children: dict[int, set] = {}
        self._cache: dict[int, object] = {}
        self._served: dict[int, set] = {}

    def add(self, name: str, parent, rows: slice, columns: slice = slice(None), transpose: bool = False):
        """The part ``parent[rows, columns]`` (``.T`` with ``transpose``) under ``name``."""
        from tui_merger.core.io.sources import TensorRef

        shape = (len(range(*rows.indices(parent.shape[0]))), len(range(*columns.indices(parent.shape[1]))))
        ref = TensorRef(self, "", name, parent.dtype, shape[::-1] if transpose else shape)
        self.tensors[name] = ref
        self._parts[name] = (parent, rows, columns, transpose)
        self._children.setdefault(id(parent), set()).add(name)
        return ref

    def load(self, ref):
        with _DERIVED_LOCK:  # the recompute and the reference pass read side by side
            parent, rows, columns, transpose = self._parts[ref.name]
            key = id(parent)
            whole = self._cache.get(key)
            if whole is None:
                whole = self._cache[key] = parent.load()
                parent.release()
                self._served[key] = set()
            part = whole[rows, columns]
            self._served[key].add(ref.name)
            if self._served[key] >= self._children[key]:
                del self._cache[key], self._served[key]
            return (part.T if transpose else part).contiguous()


def _installed_peft() -> str:
    try:
        from importlib.metadata import version

        return version("peft")
    except Exception:  # noqa: BLE001 - no peft: the newest layout
        return "99.0"


def _layout_y(entry, shape, name: str, adapter_config: dict, transposed_module: bool, strict: bool = True) -> bool:
    """How a parameter LoRA on packed experts ``[experts, d1, d2]`` was saved. Layout X (peft >= 0.20
    on experts stored [experts, out, in]; 0.19 where the module says ``is_transposed``): lora_A reads
    d2, lora_B writes d1, the delta of expert e is ``B_e @ A_e``. Layout Y (peft >= 0.20 on experts
    stored [experts, in, out], as GPT-OSS keeps them; peft <= 0.18 on every 3-D parameter; 0.19 unless
    the module says ``is_transposed``): lora_A reads d1, the delta is ``(B_e @ A_e).T``. The shapes
    tell unless d1 == d2; then peft's version does (the code of each version, against the
    ``is_transposed`` of the transformers installed here)."""
    from tui_merger.core.errors import MergeError

    _, d1, d2 = shape
    x = entry.A.shape[1] == d2 and entry.B.shape[0] == d1
    y = entry.A.shape[1] == d1 and entry.B.shape[0] == d2
    if (x and y) or not strict:  # not strict: the layout this version of peft makes, whatever the shapes
        version = _version_tuple(adapter_config.get("peft_version"))
        if version < (0, 19):
            return True
        if version < (0, 20):
            return not transposed_module
        return transposed_module
    if not (x or y):
        raise MergeError(
            f"{name}: its LoRA pair (lora_A {list(entry.A.shape)}, lora_B {list(entry.B.shape)}) does not fit "
            f"the parameter's shape {list(shape)}; is the base the model the adapter was trained on?"
        )
    return y


def _version_tuple(text) -> tuple:
    """``"0.21.2"`` -> (0, 21); no version recorded (peft before it wrote one): (0, 0)."""
    import re

    m = re.match(r"(\d+)\.(\d+)", str(text or ""))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _fits(entry, shape, r_of) -> bool:
    """Whether a LoRA pair can belong to a parameter of this shape (either expert layout)."""
    if len(shape) == 2:
        return entry.A.shape[1] == shape[1] and entry.B.shape[0] == shape[0]
    if len(shape) == 3:
        dims = {(shape[2], shape[1]), (shape[1], shape[2])}
        return (entry.A.shape[1], entry.B.shape[0]) in dims and entry.A.shape[0] == r_of * shape[0]
    return False


def _rank_of(config: dict, entry, name: str, state: dict):
    """(r, alpha, scale) of the LoRA on parameter ``name``: as the adapter config gives them, or, for a
    checkpoint that records only r and lora_alpha (verl's lora_train_meta.json, ``_ranks_from_shapes``),
    r from the pair's shape and alpha in proportion, as peft's all-linear sets them (the fused gate_up
    at 2r with 2 alpha). Returns just r when asked through ``_placed``."""
    return _rank_alpha(config, entry, name, state)[0]


def _rank_alpha(config: dict, entry, name: str, state: dict) -> tuple:
    from tui_merger.core.formats.adapter import param_rank

    if not config.get("_ranks_from_shapes"):
        return param_rank(config, name)
    shape = state[name].shape
    experts = shape[0] if len(shape) == 3 else 1
    r = entry.A.shape[0] // experts if entry.A.shape[0] % experts == 0 else 0
    base_r, (_, base_alpha, _) = int(config.get("r") or 8), param_rank(config, name)
    alpha = base_alpha * r / base_r
    if r == 0:
        return 0, alpha, 0.0
    import math

    return r, alpha, (alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r)


def _placed(model, state: dict, entry, config: dict) -> str:
    """The parameter a parameter-LoRA pair changes. peft wraps the targeted parameters of one module
    in the module's parameter order, the first innermost: the pair at nesting depth d belongs to the
    (k - 1 - d)-th of the k targeted ones. When the shapes single out another parameter, the shapes win."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.adapter import param_rank

    depth, params = entry.candidates
    owner = entry.module
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        raise MergeError(
            f"The adapter holds a LoRA for {owner}, which the base model does not have; "
            "is the base the model the adapter was trained on?"
        ) from None
    order = [n for n, _ in module.named_parameters(recurse=False) if n in params]
    if len(order) <= depth:
        wanted = ", ".join(params)
        raise MergeError(
            f"{owner}: the adapter's target_parameters ({wanted}) name "
            + (f"{len(order)} parameter(s) of this module ({', '.join(order)})" if order else "no parameter of this module")
            + f" but it holds {depth + 1} nested LoRA pair(s) for it; the base has "
            f"{', '.join(n for n, _ in module.named_parameters(recurse=False)) or 'no parameters'} there. "
            "Is the base the model the adapter was trained on?"
        )
    fits = [p for p in order if _fits(entry, state[f"{owner}.{p}"].shape, _rank_of(config, entry, f"{owner}.{p}", state))]
    chosen = fits[0] if len(fits) == 1 else order[len(order) - 1 - depth]
    return f"{owner}.{chosen}"


def expert_loras(layout: DiskLayout, adapter, sliced: SlicedSource) -> dict:
    """peft ``target_parameters`` LoRA (packed experts, routers) as ordinary LoRA on the tensors
    ``save_pretrained`` writes: {on-disk module: LoraModule}. Packed experts kept packed on disk go to
    ``adapter.expert_lora`` (one op on the packed tensor). peft's delta for expert e of a packed
    parameter is ``B_e @ A_e`` (or its transpose, ``_layout_y``) with ``A_e`` rows e*r..(e+1)*r of
    lora_A and ``B_e`` every experts-th column of lora_B from e; which rows of it each on-disk tensor
    takes is found by converting an index tensor with transformers' own reverse conversion. A 2-D
    parameter (a router's ``gate.weight``) is an ordinary LoRA: ``B @ A``."""
    import torch

    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.adapter import LoraModule, param_rank

    state = layout.model.state_dict()
    out = {}
    placed = {}
    for entry in adapter.param_lora.values():
        name = _placed(layout.model, state, entry, adapter.config)
        if name in placed:
            raise MergeError(f"The adapter holds two LoRA pairs for {name}; the adapter file is inconsistent.")
        placed[name] = entry
    for name, entry in placed.items():
        entry.module = name
        param = state[name]
        entry.r, entry.alpha, entry.scale = _rank_alpha(adapter.config, entry, name, state)
        if adapter.config.get("_ranks_from_shapes") and entry.r:  # said to peft, for the reference
            import re

            adapter.config.setdefault("rank_pattern", {})[re.escape(name)] = entry.r
            adapter.config.setdefault("alpha_pattern", {})[re.escape(name)] = entry.alpha
        experts = entry.experts = param.shape[0] if param.dim() == 3 else 1
        if param.dim() not in (2, 3):
            raise MergeError(f"{name}: LoRA on a parameter of {param.dim()} dimensions is not supported (peft takes 2 and 3).")
        if entry.A.shape[0] != entry.r * experts:
            per = f" per expert ({experts} experts: {entry.r * experts} rows)" if experts > 1 else ""
            raise MergeError(
                f"{name}: adapter_config.json gives this parameter rank {entry.r}{per}, but its lora_A has "
                f"{entry.A.shape[0]} rows; the config does not belong to these weights."
            )
        pieces = layout.convert(name, torch.empty(tuple(param.shape), device="meta"))  # names only
        if param.dim() == 2:
            if not _fits(entry, param.shape, entry.r):
                raise MergeError(
                    f"{name}: its LoRA pair (lora_A {list(entry.A.shape)}, lora_B {list(entry.B.shape)}) does not fit "
                    f"the parameter's shape {list(param.shape)}; is the base the model the adapter was trained on?"
                )
            (disk,) = pieces
            if not disk.endswith(".weight"):
                raise MergeError(f"{name}: LoRA on a 2-D parameter saved as {disk} is not supported yet.")
            mod = disk.removesuffix(".weight")
            out[mod] = LoraModule(mod, A=entry.A, B=entry.B, r=entry.r, alpha=entry.alpha, scale=entry.scale)
            continue
        module = layout.model.get_submodule(name.rsplit(".", 1)[0])
        transposed_module = bool(getattr(module, "is_transposed", False))
        y = _layout_y(entry, param.shape, name, adapter.config, transposed_module)
        if y != _layout_y(entry, param.shape, name, {"peft_version": _installed_peft()}, transposed_module, strict=False):
            adapter.relayout[entry.A.name] = (entry.B.name, experts)  # the peft here reads the other layout
        _, d1, _ = param.shape
        index = torch.arange(experts * d1, dtype=torch.float64).reshape(experts, d1, 1)
        converted = layout.convert(name, index)
        if len(pieces) == 1 and tuple(next(iter(pieces.values())).shape) == tuple(param.shape):
            # kept packed on disk (perhaps renamed: GraniteMoE's input_linear.weight): one op on it
            ((disk, rows),) = converted.items()
            if disk != name and not torch.equal(rows, index):  # renamed: the rows must stay where they are
                raise MergeError(f"{name}: transformers saves these experts in a layout tui-merger cannot merge LoRA into yet.")
            entry.transposed = y
            adapter.expert_lora[disk] = entry
            continue
        for disk, rows in converted.items():
            flat = rows.flatten().long()
            expert, start = divmod(int(flat[0]), d1)
            stop = start + flat.numel()
            if rows.dim() != 2 or rows.shape[1] != 1 or not torch.equal(flat, torch.arange(flat[0], flat[0] + flat.numel())) \
                    or stop > d1:
                raise MergeError(f"{name}: transformers saves these experts in a layout tui-merger cannot merge LoRA into yet.")
            mod = disk.removesuffix(".weight")
            a_rows = slice(expert * entry.r, (expert + 1) * entry.r)
            b_cols = slice(expert, None, experts)
            if y:  # delta_e[start:stop] = A_e[:, start:stop].T @ B_e.T
                a = sliced.add(f"{mod}.lora_A", entry.B, slice(None), b_cols, transpose=True)
                b = sliced.add(f"{mod}.lora_B", entry.A, a_rows, slice(start, stop), transpose=True)
            else:  # delta_e[start:stop] = B_e[start:stop] @ A_e
                a = sliced.add(f"{mod}.lora_A", entry.A, a_rows)
                b = sliced.add(f"{mod}.lora_B", entry.B, slice(start, stop), b_cols)
            out[mod] = LoraModule(mod, A=a, B=b, r=entry.r, alpha=entry.alpha, scale=entry.scale)
    return out


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERT = None


def _declares_experts(config: dict) -> bool:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return any(isinstance(c.get(k), int) and c.get(k) > 1 for c in (config, text) for k in _EXPERT_KEYS)


def meta_of_config(config: dict):
    """The model transformers builds for the config.json contents ``config``, on the meta device (the
    last few are kept: the plan, preflight and verification ask about the same config); None when it
    cannot build one here (custom code, an unknown architecture). Its remarks on the config stay quiet."""
    import json

    key = json.dumps(config, sort_keys=True, default=str)
    with _CACHE_LOCK:  # not BUILD_LOCK: a reference model being built elsewhere would hold this back
        for k, model in _META_BY_CONFIG:
            if k == key:
                return model
    try:
        import transformers
        import transformers.models.auto  # noqa: F401 - waits for the command line's import-ahead thread (_meta_of)

        cls = model_class(config)
        if cls is None:
            model = None
        else:
            config_cls = transformers.AutoConfig.for_model(str(config.get("model_type"))).__class__
            logging = transformers.utils.logging
            verbosity = logging.get_verbosity()
            logging.set_verbosity_error()
            try:
                model = meta_model(cls, config_cls.from_dict(json.loads(key)))
            finally:
                logging.set_verbosity(verbosity)
    except Exception:  # noqa: BLE001 - custom code, a config transformers cannot build
        model = None
    with _CACHE_LOCK:
        _META_BY_CONFIG.insert(0, (key, model))
        del _META_BY_CONFIG[4:]
    return model


_META_BY_CONFIG: list = []
_CACHE_LOCK = threading.Lock()


def expected_experts(config: dict) -> dict[str, tuple]:
    """{experts module on disk: ("split", number of experts) or ("packed", tensor name, experts)} for a
    model config that declares experts, from the model transformers builds for it on the meta device
    and the names ``save_pretrained`` gives its tensors; {} for a model without experts or one
    transformers cannot build here."""
    import re

    if not _declares_experts(config):
        return {}
    model = meta_of_config(config)
    if model is None:
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        split = re.compile(r"^(.*\.experts)\.(\d+)\.")
        out: dict[str, tuple] = {}
        for name, tensor in model.state_dict().items():
            if ".experts" not in name:
                continue
            for disk, t in revert_weight_conversion(model, {name: tensor}).items():
                m = split.match(disk)
                if m:
                    kind, count = out.get(m.group(1), ("split", 0))
                    out[m.group(1)] = ("split", max(count, int(m.group(2)) + 1))
                elif t.dim() == 3:
                    out[disk] = ("packed", disk, t.shape[0])
        return out
    except Exception:  # noqa: BLE001 - rules this model cannot take: nothing to count
        return {}


class EmbeddingNames:
    """The model's input and output embedding weights under the names its files give them, as
    transformers sees them: the modules ``get_input_embeddings()`` / ``get_output_embeddings()`` return
    in the model it builds for the config, their weights translated to on-disk names by its loading
    rules (the name among the files that loads into that parameter, or, for one the files leave out,
    the name ``save_pretrained`` writes). ``output`` is None for a model class with no output
    embedding (a classifier, a reward model); ``known`` is False when transformers cannot build the
    model here (custom code): then nothing is known and both are None."""

    def __init__(self, input: str | None, output: str | None, known: bool) -> None:
        self.input = input
        self.output = output
        self.known = known

    def __repr__(self) -> str:
        return f"EmbeddingNames(input={self.input!r}, output={self.output!r}, known={self.known})"


UNKNOWN_EMBEDDINGS = EmbeddingNames(None, None, False)


def embedding_names(config: dict, names=()) -> EmbeddingNames:
    """The input and output embedding weights of the model ``config`` describes, named as in ``names``
    (the tensors a base or an output holds) where one of them loads into that parameter."""
    model = meta_of_config(config)
    if model is None:
        return UNKNOWN_EMBEDDINGS
    try:
        modules = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        try:
            inp = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            inp = None
        out = model.get_output_embeddings()
        memory = [f"{modules[id(m)]}.weight" if m is not None and id(m) in modules else None for m in (inp, out)]
        state = dict(model.state_dict(keep_vars=True))
        for name in memory:
            if name is not None and name not in state:  # a tied head: the state lists the shared one once
                state[name] = state.get(memory[0] or "", None)
        rename = renamer(model, state)
        loaded = {}
        present = names if isinstance(names, (dict, set, frozenset)) else set(names)
        for name in memory:  # the name save_pretrained writes, where the files hold it: no search
            saved = _saved_name(model, name, state) if name is not None else None
            if saved in present and rename(saved)[0] == name:
                loaded[name] = saved
        if any(name is not None and name not in loaded for name in memory):  # older names, or a tied head
            for disk in names:
                target = rename(disk)[0]
                if target in memory and target not in loaded:
                    loaded[target] = disk
        found = []
        for name in memory:
            if name is None:
                found.append(None)
            elif name in loaded:
                found.append(loaded[name])
            else:
                found.append(_saved_name(model, name, state))
        return EmbeddingNames(found[0], found[1], True)
    except Exception:  # noqa: BLE001 - a model whose embeddings transformers cannot tell
        return UNKNOWN_EMBEDDINGS


def tied_pair(config: dict, names) -> tuple[str, str]:
    """(input embedding, output head) weight names among ``names`` as transformers names them for the
    model ``config`` describes (``embedding_names``); for a model it cannot build here (custom code) the
    usual Llama-style names, the only case where a name is assumed."""
    found = embedding_names(config, names)
    if found.known and found.input and found.output:
        return found.input, found.output
    return "model.embed_tokens.weight", "lm_head.weight"


def quantizable_linears(config: dict, names) -> dict[str, str] | None:
    """{on-disk weight name: in-memory module name} of the Linear layers (and GPT-2's Conv1D) among
    ``names`` that transformers' quantizers replace (bitsandbytes' ``replace_with_bnb_linear``): every such
    module but those ``get_keys_to_not_convert`` keeps (tied weights, the output embedding, the module of
    the last parameter). None when transformers cannot build the model here."""
    model = meta_of_config(config)
    if model is None:
        return None
    try:
        import torch.nn as nn
        from transformers.pytorch_utils import Conv1D
        from transformers.quantizers.base import get_keys_to_not_convert

        keep = set(get_keys_to_not_convert(model))
        linears = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and n not in keep}
        state = dict(model.state_dict(keep_vars=True))
        rename = renamer(model, state)
        out = {}
        for disk in names:
            if not disk.endswith(".weight"):
                continue
            target, _pattern, converter = rename(disk)
            module = target.removesuffix(".weight")
            if converter is None and target.endswith(".weight") and module in linears:
                out[disk] = module
        return out
    except Exception:  # noqa: BLE001 - rules this model cannot take
        return None


class Fp8Layout:
    """What transformers' FP8 load (``replace_with_fp8_linear``) does with a model, in on-disk names:
    ``linears`` {disk weight: in-memory module} of the modules it makes ``FP8Linear`` (exactly
    ``nn.Linear``); ``experts`` {in-memory module: [disk tensors]} of those it makes ``FP8Experts`` (its own
    rule: a module named ``*.experts``), with ``converted`` the ones whose disk tensors are matrices that
    its loading rules pack (one matrix per expert and projection on disk); ``others`` the modules it would
    replace otherwise (a grouped Linear: ``FP8GroupedLinear``); subclasses of ``nn.Linear`` it leaves alone
(Falcon's ``FalconLinear``), as it does; ``defaults`` the modules it leaves alone unasked
    (``get_keys_to_not_convert``: the output embedding, tied weights, the last module; plus the model's
    ``_keep_in_fp32_modules``)."""

    def __init__(self, linears, experts, converted, others, defaults) -> None:
        self.linears, self.experts, self.converted = linears, experts, converted
        self.others, self.defaults = others, defaults


def fp8_layout(config: dict, names) -> Fp8Layout | None:
    """transformers' own answer to "which modules does an FP8 checkpoint of this model quantize"
    (``Fp8Layout``), for the tensors ``names`` as the files name them. None when transformers cannot
    build the model here."""
    model = meta_of_config(config)
    if model is None:
        return None
    try:
        import torch.nn as nn
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module

        defaults = sorted(set(get_keys_to_not_convert(model)) | set(getattr(model, "_keep_in_fp32_modules", None) or ()))
        linears, experts, others = set(), set(), []
        for name, module in model.named_modules():
            if not name or not should_convert_module(name, defaults):
                continue
            if name.endswith(".experts"):  # replace_with_fp8_linear's own test for FP8Experts
                experts.add(name)
            elif type(module) is nn.Linear:
                linears.add(name)
            elif isinstance(module, nn.Linear) and "GroupedLinear" in type(module).__name__:
                others.append(name)  # its FP8GroupedLinear, which we do not write
        state = dict(model.state_dict(keep_vars=True))
        rename = renamer(model, state)
        out, by_experts, converted = {}, {}, set(experts)
        for disk in names:
            target, _pattern, converter = rename(disk)
            owner = next((e for e in experts if target.startswith(e + ".")), None)
            if owner is not None:
                by_experts.setdefault(owner, []).append(disk)
                if converter is None:  # stored packed as in memory (GPT-OSS): not matrices we write
                    converted.discard(owner)
            elif converter is None and target.endswith(".weight") and target[: -len(".weight")] in linears:
                out[disk] = target[: -len(".weight")]
        return Fp8Layout(out, by_experts, converted & set(by_experts), others, defaults)
    except Exception:  # noqa: BLE001 - rules this model cannot take
        return None


def _saved_name(model, name: str, state: dict) -> str:
    """The name ``save_pretrained`` writes the in-memory parameter ``name`` under."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion

    param = state.get(name)
    shape = tuple(param.shape) if param is not None else (1, 1)
    out = revert_weight_conversion(model, {name: torch.empty(shape, device="meta")})
    return next(iter(out)) if len(out) == 1 else name


def expert_gaps(config: dict, shapes: dict) -> list[str]:
    """Sentences naming each experts module of the config whose experts are not all among ``shapes``
    ({tensor name: shape}, what is or will be written): the silent corruption of a model missing an
    expert (a lost shard, an expert-parallel rank not gathered)."""
    expected = expected_experts(config)
    if not expected:
        return []
    gaps = _expert_gaps(expected, shapes)
    # files that leave out the base model's prefix (DeepSeek-V4's release: ``layers.N...``, which transformers
    # loads as ``model.layers.N...``) are counted under save_pretrained's names, when that is what makes
    # them fit (Llama 4's base_model_prefix is not the prefix its files carry)
    model = meta_of_config(config) if gaps else None
    prefix = getattr(model, "base_model_prefix", "") if model is not None else ""
    if prefix and not any(n.startswith(prefix + ".") for n in shapes):
        prefixed = _expert_gaps(expected, {f"{prefix}.{n}": v for n, v in shapes.items()})
        if len(prefixed) < len(gaps):
            return prefixed
    return gaps


def _expert_gaps(expected: dict, shapes: dict) -> list[str]:
    import re

    split = re.compile(r"^(.*\.experts)\.(\d+)\.")
    have: dict[str, set] = {}
    for name in shapes:
        m = split.match(name)
        if m:
            have.setdefault(m.group(1), set()).add(int(m.group(2)))
    gaps = []
    for module, spec in sorted(expected.items()):
        if spec[0] == "split":
            got = have.get(module, set())
            missing = sorted(set(range(spec[1])) - got)
            if missing:
                shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                gaps.append(f"{module} has {spec[1] - len(missing)} of the {spec[1]} experts the config declares "
                            f"(missing: expert {shown})")
        else:
            shape = shapes.get(spec[1])
            blocks = shapes.get(spec[1] + "_blocks")
            if shape is None and blocks is not None and len(blocks) == 4:  # MXFP4 (GPT-OSS): [experts, out, groups, 16]
                shape = (blocks[0], blocks[2] * blocks[3] * 2, blocks[1])
            if shape is None:
                gaps.append(f"{spec[1]} (the packed experts) is missing")
            elif len(shape) != 3 or shape[0] != spec[2]:
                gaps.append(f"{spec[1]} holds {shape[0] if shape else 0} experts, the config declares {spec[2]}")
    return gaps


def place_parameter_loras(adapter, base_dir, closers: list) -> None:
    """peft target_parameters LoRA (packed experts, routers) placed in the base whose config.json lies in
    ``base_dir``: LoRA on each tensor ``save_pretrained`` writes, the notice saying what it reached."""
    from tui_merger.core.errors import MergeError

    layout = disk_layout(base_dir)
    if layout is None:
        raise MergeError(
            f"The adapter changes parameters ({', '.join(list(adapter.param_lora)[:3])}) of a model transformers "
            "cannot build here, so where they lie in the base is unknown; nothing was written."
        )
    sliced = SlicedSource()
    closers.append(sliced)
    placed = list(adapter.param_lora.values())
    loras = expert_loras(layout, adapter, sliced)
    experts = [e for e in placed if e.experts > 1]
    others = [e for e in placed if e.experts <= 1]  # 2-D parameters: routers
    slices = len(loras) - len(others)
    packed = len(adapter.expert_lora)
    said = []
    if experts:
        said.append(
            f"LoRA on {len(experts)} expert parameter(s) ({_by_suffix(experts)}; rank per expert) is merged into "
            + (f"{slices} per-expert tensors" if slices else "")
            + (" and " if slices and packed else "")
            + (f"{packed} packed expert tensors" if packed else "")
        )
    if others:
        said.append(f"LoRA on {len(others)} router weight(s) ({_by_suffix(others)}) is merged into them")
    adapter.notices.append("peft target_parameters: " + "; ".join(said) + ".")
    adapter.expert_parameters = sorted(e.module for e in placed)
    adapter.parameter_ranks = {e.module: (e.r, e.alpha, e.experts) for e in placed}
    adapter.expert_slices = set(loras)
    adapter.lora.update(loras)
    adapter.param_lora = {}


def _by_suffix(entries) -> str:
    """``mlp.experts.gate_up_proj r=16, mlp.experts.down_proj r=8``: each parameter kind once, with its rank."""
    from tui_merger.core.formats.adapter import parameter_kinds

    return ", ".join(f"{tail} r={r}" for tail, (r, _alpha, _n) in parameter_kinds(
        {e.module: (e.r, e.alpha, e.experts) for e in entries}).items())
