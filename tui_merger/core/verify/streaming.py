"""Run a transformers model whose weights stay on disk: one module's weights in memory at a time.

The model is built by transformers on the meta device (no weights) and in fp32; accelerate's hooks
(``add_hook_to_module``, ``set_module_tensor_to_device``) put each module's tensors in place just
before its forward and take them away just after, read from our memory-mapped files, upcast into
reused fp32 buffers, and the file pages handed back. transformers' own forward runs unchanged; no
architecture is written here. Two layer types are computed piecewise instead: a vocabulary-sized
``nn.Embedding`` reads only the rows of the probe tokens, and every ``nn.Linear`` whose weight is in
the files (the output head, and the projections, also the base layer of a plain peft LoRA layer) is
applied in row blocks small enough to stay in the CPU cache: each block is upcast and multiplied
while still cached, so a pass reads the stored weights once instead of writing and re-reading an
fp32 copy of each (half the time of a pass at 3B shapes). The arithmetic is the same: a product
per block of output features.

Names: the model's parameters are named as transformers holds them in memory; the files hold the
names ``save_pretrained`` writes. The two are joined by transformers' own checkpoint conversion
rules (``get_model_conversion_mapping`` + ``rename_source_key``), the ones its ``from_pretrained``
applies, including converters that build one in-memory tensor from several on disk (packed experts).
"""

from __future__ import annotations

import copy
import math
import re
import threading
from dataclasses import dataclass

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.hf_names import BUILD_LOCK, renamer

BIG_VALUES = 1 << 25  # an embedding above this many values reads only the rows of the probe tokens
BLOCK_VALUES = 1 << 20  # values of a linear layer's weight upcast at a time (4 MiB: in the L3 cache; a 3B pass
# on one core: 2.7 s, against 3.5 s at 2^17 and 4.8 s whole, where each call's overhead or the misses dominate)


class StreamError(MergeError):
    """The model cannot be run from the files (the sentence says why)."""


@dataclass
class Weight:
    """Where one in-memory parameter comes from: a file tensor (``ref``), a converter over several
    (``convert``), or a tensor held in memory (``held``: adapter weights peft loaded)."""

    shape: tuple[int, ...]
    ref: object = None  # TensorRef
    convert: object = None  # callable -> dict[in-memory name, tensor]
    held: object = None  # torch.Tensor
    nbytes: int = 0
    key: str | None = None  # the name ``convert`` gives it (the base's name; a peft model's differs)


@dataclass
class StreamStats:
    loaded_values: int = 0
    peak_live_values: int = 0  # most parameter values materialized at one time
    units: int = 0
    live_values: int = 0


class Pool:
    """fp32 buffers reused from one module to the next: fresh multi-MB allocations cost a page fault
    per 4 KiB (upcasting a 3B model: 3.2 s fresh vs 0.6 s reused). A buffer serves any tensor that
    fits in it, so the pool holds about one unit's worth (the largest matrix), not one per shape."""

    def __init__(self) -> None:
        self._free: list = []  # flat fp32 buffers, smallest first
        self._owner: dict[int, object] = {}  # id(view handed out) -> its flat buffer

    def take(self, shape):
        import torch

        n = math.prod(shape)
        index = next((i for i, b in enumerate(self._free) if b.numel() >= n), None)
        flat = self._free.pop(index) if index is not None else torch.empty(max(n, 1), dtype=torch.float32)
        view = flat[:n].view(shape)
        self._owner[id(view)] = (flat, view)
        return view

    def give(self, tensor) -> None:
        entry = self._owner.pop(id(tensor), None)
        if entry is None:
            return
        flat = entry[0]
        self._free.append(flat)
        self._free.sort(key=lambda b: b.numel())


class Streamer:
    """Holds the weights map of one meta model and runs its forward with the weights streamed."""

    def __init__(self, model, weights: dict[str, Weight], on_unit=None, cancel=None) -> None:
        self.model = model
        self.weights = weights
        self.pool = Pool()
        self.stats = StreamStats()
        self.on_unit = on_unit or (lambda name, done, total, bytes_done, bytes_total: None)
        self._unit_bytes: dict[str, int] = {}
        self._bytes_done = 0
        self.cancel = cancel
        self._converted: dict[str, object] = {}
        self._units: list[str] = []
        self.sources: list = []  # files it reads that it owns (closed with it)
        self.text_only: str | None = None  # run through a multimodal model's language model (behaviour.run)
        self._attach()

    # -- loading -----------------------------------------------------------------------------
    def materialize(self, name: str):
        """The fp32 tensor of one parameter (a pooled buffer, or the held tensor itself)."""
        import torch

        w = self.weights[name]
        if w.held is not None:
            return w.held if w.held.dtype == torch.float32 else w.held.float()
        if w.convert is not None:
            key = w.key or name
            if key not in self._converted:
                self._converted.update(w.convert())
            value = self._converted.pop(key).float()
            if tuple(value.shape) != tuple(w.shape):
                raise StreamError(f"{name} converts to shape {list(value.shape)}, the model wants {list(w.shape)}.")
            return value
        buf = self.pool.take(w.shape)
        w.ref.prefetch()
        buf.copy_(w.ref.load())
        w.ref.release()
        return buf

    def rows(self, name: str, index):
        """Rows ``index`` of a 2-D parameter, fp32 (a vocabulary-sized embedding)."""
        w = self.weights[name]
        if w.ref is None:
            return self.materialize(name)[index]
        out = w.ref.load()[index].float()
        w.ref.release()
        return out

    def blocks(self, name: str):
        """(start, stop, fp32 rows) of a 2-D parameter, a cache-sized block at a time."""
        import torch

        w = self.weights[name]
        rows = w.shape[0]
        step = max(1, BLOCK_VALUES // max(1, math.prod(w.shape[1:])))
        if w.ref is None:
            full = self.materialize(name)
            for a in range(0, rows, step):
                yield a, min(a + step, rows), full[a : a + step]
            return
        view = w.ref.load()
        big = math.prod(w.shape) >= BIG_VALUES
        if not big:
            w.ref.prefetch()
        buf = None if view.dtype == torch.float32 else self.pool.take((min(step, rows), *w.shape[1:]))
        for a in range(0, rows, step):
            b = min(a + step, rows)
            if buf is None:  # stored in fp32: the mapped rows are used as they are
                block = view[a:b]
            else:
                block = buf[: b - a]
                block.copy_(view[a:b])
            if big:
                w.ref.release_rows(a, b)  # an output head is GBs: its pages go back block by block
            yield a, b, block
        if buf is not None:
            self.pool.give(buf)
        w.ref.release()

    def give_back(self, name: str, tensor) -> None:
        w = self.weights[name]
        if w.ref is not None and w.held is None and w.convert is None:
            self.pool.give(tensor)

    # -- hooks -------------------------------------------------------------------------------
    def _attach(self) -> None:
        from accelerate.hooks import add_hook_to_module

        names = [full for full, _ in _named_tensors(self.model)]
        units = _units(self.model)
        owned = set()
        for unit_name, unit in units:
            params = {
                (f"{unit_name}." if unit_name else "") + attr: attr
                for attr, _ in _named_tensors(unit)
            }
            params = {full: attr for full, attr in params.items() if full in self.weights and full not in owned}
            if not params:
                continue
            owned.update(params)
            piecewise = _piecewise_weight(unit, params, self.weights)
            if piecewise is not None:
                _piecewise(self, unit, piecewise, params)
            else:
                add_hook_to_module(unit, _StreamHook(self, unit_name, params))
                if _registers_parameters(unit):
                    _while_no_model_is_built(unit)
            self._units.append(unit_name)
            self._unit_bytes[unit_name] = sum(_stored_bytes(self.weights[full]) for full in params)
        missing = [n for n in names if n not in owned and n in self.weights]
        if missing:  # parameters of modules that never run their own forward (should not happen)
            raise StreamError(f"{missing[0]} belongs to no module that runs; this model cannot be streamed.")
        _stand_ins(self.model)

    def unit_done(self, name: str) -> None:
        self.stats.units += 1
        _trim_if_hoarding()
        self._bytes_done += self._unit_bytes.get(name, 0)
        self.on_unit(name, self.stats.units, len(self._units), self._bytes_done, sum(self._unit_bytes.values()))

    def check_cancel(self) -> None:
        if self.cancel is not None:
            self.cancel.raise_if_cancelled()

    def close(self) -> None:
        """Drop the buffers and the model now (hooks and model refer to each other: a cycle)."""
        self.pool = Pool()
        self.weights = {}
        self._converted.clear()
        self.model = None
        for source in self.sources:
            source.close()
        self.sources = []

    def __call__(self, *args, **kwargs):
        return self.run_module(self.model, *args, **kwargs)

    def run_module(self, module, *args, **kwargs):
        """The forward of the model or of one of its submodules (a multimodal model's language model)."""
        import torch

        self.stats.units = 0
        self._bytes_done = 0
        with torch.no_grad():
            return module(*args, **kwargs)


HOARD_BYTES = 256 << 20  # free heap memory kept past a unit before it is handed back


def _trim_if_hoarding() -> None:
    """Give the C heap's free memory back once it holds more than ``HOARD_BYTES``. Our own buffers
    are reused (``Pool``), but a unit whose forward makes its own temporaries leaves them there: peft's
    DoRA layer makes several of a weight's size per forward (W + s * B @ A, its norm), and glibc kept
    1.1-2.2 GB of them free in its threads' arenas while a 3B DoRA reference ran (RSS 1.5-2.8 GB for
    ~0.2 GB in use). Checked after every unit (mallinfo2 walks the arenas' free lists: microseconds)."""
    from tui_merger.core.io import libc

    free = libc.heap_free_bytes()
    if free is not None and free > HOARD_BYTES:
        libc.trim_heap()


def _stored_bytes(w: Weight) -> int:
    """How many bytes of the files (or of memory) one parameter's weights are, for progress."""
    if w.nbytes:
        return w.nbytes
    if w.held is not None:
        return w.held.numel() * w.held.element_size()
    return 4 * math.prod(w.shape)


def _named_tensors(module):
    """(name, tensor) of every parameter, tied ones under each of their names."""
    return list(module.named_parameters(remove_duplicate=False))


def _units(model):
    """The modules that load their weights together: peft's tuner layers whole (their forward reads
    the base layer's weight directly, e.g. DoRA's norm) unless plain LoRA, a module whose code reads
    a child's weight itself (``_reads_child_weights``) with that child, else every module with
    tensors of its own (a unit also takes the tensors below it that no earlier unit took)."""
    units = []
    inside: set[int] = set()  # ids of the modules within a tuner layer already taken whole
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if _is_tuner_layer(module) and not _plain_lora_linear(module):
            units.append((name, module))
            inside.update(id(m) for m in module.modules())
        elif _reads_child_weights(module):
            units.append((name, module))
            inside.update(id(m) for m in module.modules())
        elif any(True for _ in module.named_parameters(recurse=False)):
            units.append((name, module))
    return units


_SOURCES: dict[type, str] = {}
_SOURCE_LOCK = threading.Lock()
_CHILD_WEIGHT = re.compile(
    r"self\.(\w+)\.(?:weight|bias)\b(?!\s*\.\s*(?:device|dtype|shape|ndim|size|dim|is_\w+)\b)(?!\s*=[^=])")


def _reads_child_weights(module) -> bool:
    """Whether the module's own code uses a child's weight in a computation instead of calling the
    child (LongCat's router: ``F.linear(x, self.classifier.weight)``), so the child's weights must be
    in place while this module runs (reading only ``.device`` or ``.dtype`` does not count). Read from
    the class's source; a class without source reads nothing."""
    import inspect

    cls = type(module)
    if cls.__module__.startswith("torch.") or not any(True for _ in module.children()):
        return False
    if hasattr(module, "base_model_prefix"):  # a whole (sub)model: its layers stream on their own
        return False
    text = _SOURCES.get(cls)
    if text is None:
        # one class's source at a time: the verification streams two models in two threads, and CPython
        # 3.11's parser, run by inspect.getsource in both at once, raised "SystemError: AST constructor
        # recursion depth mismatch" (seen in CI on a Qwen2.5-VL verification)
        with _SOURCE_LOCK:
            text = _SOURCES.get(cls)
            if text is None:
                try:
                    text = inspect.getsource(cls)
                except (OSError, TypeError):
                    text = ""
                _SOURCES[cls] = text
    children = dict(module.named_children())
    return any(
        (child := children.get(m.group(1))) is not None and any(True for _ in child.parameters())
        for m in _CHILD_WEIGHT.finditer(text)
    )


def _is_tuner_layer(module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, BaseTunerLayer)


def _plain_lora_linear(module) -> bool:
    """A peft LoRA Linear without variants (DoRA ...) on an nn.Linear: its forward calls the base
    layer, lora_A and lora_B as modules and reads no weight itself, so each streams on its own."""
    import torch

    try:
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover
        return False
    return (
        type(module) is LoraLinear
        and not getattr(module, "lora_variant", None)
        and type(getattr(module, "base_layer", None)) is torch.nn.Linear
        and not getattr(module, "merged_adapters", None)
    )


def _registers_parameters(unit) -> bool:
    """peft's parameter LoRA (``ParamWrapper``, target_parameters): its forward registers a
    parametrization on the wrapped parameter (torch's ``register_parametrization`` moves the parameter
    in with ``register_parameter``) and removes it afterwards."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # pragma: no cover - older peft has no parameter LoRA
        return False
    return isinstance(unit, ParamWrapper)


def _while_no_model_is_built(unit) -> None:
    """Run ``unit``'s (hooked) forward holding ``BUILD_LOCK``. While another thread builds a meta
    model, accelerate's ``init_empty_weights`` has patched ``nn.Module.register_parameter`` for every
    thread, so the parameter a ParamWrapper registers meanwhile lands on the meta device ("unsupported
    scalarType" from its autocast over a meta tensor, or an empty weight). torch's parametrization
    cache is one global too; under the lock two such forwards never overlap either."""
    import functools

    hooked = unit.forward

    @functools.wraps(hooked)
    def forward(*args, **kwargs):
        with BUILD_LOCK:
            return hooked(*args, **kwargs)

    unit.forward = forward


def _piecewise_weight(unit, params: dict[str, str], weights: dict) -> str | None:
    """The weight's full name when ``unit`` is computed piecewise: a plain vocabulary-sized
    Embedding, or a plain Linear whose weight (and bias) are the unit's only tensors."""
    import torch

    if type(unit) not in (torch.nn.Embedding, torch.nn.Linear):
        return None
    weight = next((full for full, attr in params.items() if attr == "weight"), None)
    if weight is None:
        return None
    if isinstance(unit, torch.nn.Embedding):
        if unit.weight.numel() < BIG_VALUES or unit.max_norm is not None:
            return None
        return weight
    if weights[weight].ref is None or set(params.values()) - {"weight", "bias"} or unit.weight.dim() != 2:
        return None  # held (adapter) or converted weights: the plain hook
    if unit.bias is not None and "bias" not in params.values():
        return None
    return weight


class _StreamHook:
    """accelerate ModelHook: the unit's tensors in place for its forward, then back to meta."""

    no_grad = True

    def __init__(self, streamer: Streamer, unit_name: str, params: dict[str, str]) -> None:
        self.streamer = streamer
        self.unit_name = unit_name
        self.params = params  # full name -> attribute path inside the unit
        self.live: dict[str, object] = {}

    def init_hook(self, module):
        return module

    def detach_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        from accelerate.utils import set_module_tensor_to_device

        s = self.streamer
        s.check_cancel()
        for full, attr in self.params.items():
            value = s.materialize(full)
            self.live[full] = value
            # the fp32 value as it is: accelerate would cast it back to the dtype a held 16-bit adapter
            # weight was built with (peft then runs the layer's input in bf16: a DoRA layer 1e-3 off)
            set_module_tensor_to_device(module, attr, "cpu", value=value, dtype=value.dtype, clear_cache=False)
            s.stats.live_values += value.numel()
            s.stats.loaded_values += value.numel()
        s.stats.peak_live_values = max(s.stats.peak_live_values, s.stats.live_values)
        return args, kwargs

    def post_forward(self, module, output):
        from accelerate.utils import set_module_tensor_to_device

        s = self.streamer
        for full, attr in self.params.items():
            set_module_tensor_to_device(module, attr, "cpu", value=_stand_in(value_shape(module, attr)), clear_cache=False)
            value = self.live.pop(full)
            s.stats.live_values -= value.numel()
            s.give_back(full, value)
        s.unit_done(self.unit_name)
        return output


def _stand_in(shape):
    """What a parameter is while its module is not running: a NaN of its shape on the CPU, one value
    expanded (no memory). Model code reads ``embed_tokens.weight.device`` before calling the module
    (Llama4: ``input_ids.to(self.embed_tokens.weight.device)``); on the meta device that sent the
    probe tokens there and the model computed zeros. Anything computed from a weight outside its
    module's forward comes out NaN, which the check reports, never as a match."""
    import torch

    return torch.full((1,), float("nan")).expand(shape)


def value_shape(module, attr: str):
    owner = module.get_submodule(attr.rsplit(".", 1)[0]) if "." in attr else module
    return tuple(getattr(owner, attr.rsplit(".", 1)[-1]).shape)


def _stand_ins(model) -> None:
    """Every meta parameter of the model becomes its stand-in (``_stand_in``)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, module in model.named_modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "meta":
                set_module_tensor_to_device(module, attr, "cpu", value=_stand_in(tuple(param.shape)), clear_cache=False)


def _piecewise(streamer: Streamer, unit, weight: str, params: dict[str, str]) -> None:
    """Replace the forward of an Embedding / Linear by one that reads its weight in pieces (the same
    arithmetic: a gather of rows; a matrix product per block of output features)."""
    import types

    import torch
    import torch.nn.functional as F

    bias_name = next((full for full, attr in params.items() if attr == "bias"), None)
    has_bias = isinstance(unit, torch.nn.Linear) and unit.bias is not None and bias_name is not None
    name = weight.rsplit(".", 1)[0]

    if isinstance(unit, torch.nn.Embedding):

        def forward(self, ids):
            streamer.check_cancel()
            unique, inverse = torch.unique(ids, return_inverse=True)
            table = streamer.rows(weight, unique)
            streamer.stats.loaded_values += table.numel()
            out = F.embedding(inverse, table)
            streamer.unit_done(name)
            return out

    else:

        def forward(self, x):
            streamer.check_cancel()
            tokens = x.reshape(-1, x.shape[-1])
            # W_block @ x^T into rows of the transposed output: with a dozen probe tokens BLAS runs
            # this 1.3-1.8x faster on one core than x @ W_block^T (F.linear); the same products,
            # summed in another order (fp32 noise, far below the limits; both models run this way)
            out_t = torch.empty((self.out_features, tokens.shape[0]), dtype=x.dtype)
            bias = streamer.materialize(bias_name) if has_bias else None
            for a, b, block in streamer.blocks(weight):
                torch.mm(block, tokens.T, out=out_t[a:b])
                streamer.stats.loaded_values += block.numel()
                live = streamer.stats.live_values + block.numel() + (0 if bias is None else bias.numel())
                streamer.stats.peak_live_values = max(streamer.stats.peak_live_values, live)
            out = out_t.T.contiguous().view(*x.shape[:-1], self.out_features)
            if bias is not None:
                out = out + bias
                streamer.give_back(bias_name, bias)
            streamer.unit_done(name)
            return out

    unit.forward = types.MethodType(forward, unit)


# -- building ---------------------------------------------------------------------------------


def weights_from_files(model, tensors: dict) -> tuple[dict[str, Weight], list[str], list[str]]:
    """Join the model's in-memory parameter names to file tensors ``{on-disk name: TensorRef}``.

    Returns (weights map, in-memory names with no tensor in the files, file names the model has no
    parameter for). Tied parameters take the tensor of the name they are tied to."""
    state = {n: p for n, p in _named_tensors(model)}
    renamed = renamer(model, state)
    weights: dict[str, Weight] = {}
    groups: dict[str, list] = {}  # converter targets: in-memory name -> [(pattern, on-disk name)]
    converters: dict[str, object] = {}
    unused = []
    for disk_name in sorted(tensors, key=_natural_key):
        target, pattern, converter = renamed(disk_name)
        if target not in state:
            unused.append(disk_name)
            continue
        ref = tensors[disk_name]
        if converter is None:
            if target in weights:
                continue
            weights[target] = Weight(tuple(state[target].shape), ref=ref, nbytes=ref.nbytes)
        else:
            groups.setdefault(target, []).append((pattern, ref))
            converters[target] = converter
    built = _BuiltParameters(model, state) if groups else None
    for target, members in groups.items():
        weights[target] = Weight(
            tuple(state[target].shape),
            convert=_converter_call(converters[target], target, members, built),
            nbytes=sum(r.nbytes for _, r in members),
            key=target,
        )
    for source, target in _tied_pairs(model).items():  # lm_head.weight -> model.embed_tokens.weight
        if source not in weights and target in weights:
            weights[source] = weights[target]
    missing = [n for n in state if n not in weights]
    return weights, missing, unused


def _natural_key(name: str):
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _tied_pairs(model) -> dict[str, str]:
    tied = getattr(model, "all_tied_weights_keys", None)
    if isinstance(tied, dict):
        return {str(k): str(v) for k, v in tied.items()}
    pairs = {}
    by_id: dict[int, str] = {}
    for name, p in _named_tensors(model):
        if id(p) in by_id:
            pairs[name] = by_id[id(p)]
        else:
            by_id[id(p)] = name
    return pairs


class _BuiltParameters:
    """The model as transformers built it, for its conversion operations, which ask it for a
    parameter's shape or dtype (``get_parameter``: Qwen3-VL-MoE's ``Transpose(check_dims=True)``
    transposes packed experts only when the file's shape is not the model's). The converters run
    when a module's forward needs the weights, and by then peft may have wrapped the module (its
    parameter LoRA puts ``mlp.experts`` inside ``ParamWrapper``s, where ``mlp.experts.gate_up_proj``
    no longer resolves): so each parameter is answered, under its in-memory name, by a meta tensor
    of the shape and dtype it had when the model was built. Anything else is the model's own."""

    def __init__(self, model, state: dict) -> None:
        self._model = model
        self._built = {name: (tuple(p.shape), p.dtype) for name, p in state.items()}

    def get_parameter(self, target: str):
        import torch

        built = self._built.get(target)
        if built is None:
            return self._model.get_parameter(target)
        return torch.empty(built[0], dtype=built[1], device="meta")

    @property
    def config(self):
        return getattr(self._model, "config", None)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # not built yet (copy, pickle): no recursion through _model
            raise AttributeError(name)
        return getattr(self._model, name)


def _converter_call(converter, target: str, members: list, model):
    """A callable building ``target`` (and its siblings from the same converter) from file tensors,
    with transformers' own conversion operations (e.g. experts stacked and gate/up concatenated);
    ``model`` is the model as transformers built it (``_BuiltParameters``)."""

    def run():
        conv = copy.deepcopy(converter)
        for pattern, ref in members:
            conv.add_tensor(target, ref.name, pattern, _loader(ref))
        out = conv.convert(target, model=model, config=getattr(model, "config", None))
        for _, ref in members:
            ref.release()
        return out

    return run


def _loader(ref):
    def load():
        return ref.load().float()

    return load
