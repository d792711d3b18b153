"""The tensor plan: every output tensor, where its bytes come from, and what the adapter does to it.

Built from headers and the adapter config only (no tensor data is read), so every shape problem and
every unconsumed adapter key is found before anything is written.
"""

from __future__ import annotations

import math
import threading

from dataclasses import dataclass, field

from tui_merger.core.formats.adapter import LoraModule, PeftAdapter
from tui_merger.core.errors import MergeError
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES, itemsize, nbytes_of
from tui_merger.core.io.sources import TensorRef, TensorSource



@dataclass(frozen=True)
class LoraOp:
    """W += scale * (B @ A) (transposed for fan_in_fan_out and embeddings), then DoRA if magnitude."""

    module: str
    A: TensorRef
    B: TensorRef
    scale: float
    transpose: bool
    magnitude: TensorRef | None = None


@dataclass(frozen=True)
class ExpertsLoraOp:
    """Packed experts ``W[e] += scale * (B_e @ A_e)`` (peft target_parameters): lora_A holds r rows
    per expert, lora_B r columns per expert interleaved (column j*experts + e); ``transposed`` for
    experts stored [experts, in, out] (the delta is then (B_e @ A_e).T)."""

    module: str
    A: TensorRef
    B: TensorRef
    scale: float
    experts: int
    transposed: bool

    def delta(self, a, b, experts=None):
        """scale * delta in fp32 for the experts ``experts`` (a slice or index; None: all)."""
        import torch

        a = a.reshape(self.experts, -1, a.shape[-1])  # experts x r x in
        b = b.reshape(b.shape[0], -1, self.experts)  # out x r x experts
        if experts is not None:
            a, b = a[experts], b[..., experts]
        return torch.einsum("ore,eri->eio" if self.transposed else "ore,eri->eoi", b, a).mul_(self.scale)


@dataclass(frozen=True)
class BiasOp:
    """b += scale * lora_B.bias"""

    module: str
    bias: TensorRef
    scale: float


@dataclass(frozen=True)
class RowsOp:
    """Replace rows (trainable_token_indices)."""

    module: str
    indices: tuple[int, ...]
    rows: TensorRef


@dataclass
class OutputTensor:
    name: str
    source: TensorRef
    dtype: str  # output torch dtype name
    shape: tuple[int, ...]
    ops: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    @property
    def raw_copy(self) -> bool:
        """Untouched and same dtype: bytes are copied as they are."""
        return not self.ops and self.dtype == self.source.dtype

    def inputs(self) -> list[TensorRef]:
        """Every tensor read to make this one."""
        refs = [self.source]
        for op in self.ops:
            refs.extend(getattr(op, f) for f in ("A", "B", "magnitude", "bias", "rows") if getattr(op, f, None))
        return refs


@dataclass
class TensorPlan:
    tensors: list[OutputTensor]
    shards: list[tuple[str, list[OutputTensor]]]
    config_changes: dict
    merged_modules: int
    # --quantize fp8: {"skipped": [modules not whole blocks], "packed": {experts module: [its tensors]},
    # "defaults": [what transformers' FP8 load leaves alone unasked]} (merge/requant.py), for the plan's words
    quantized: dict | None = None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def embeddings_of(config: dict, names) -> "EmbeddingNames":
    """The input and output embedding weights among ``names`` (or, for one the files leave out, where
    ``save_pretrained`` would write it), as transformers sees the model ``config`` describes
    (``hf_names.embedding_names``). Only for a model transformers cannot build here (custom code) are
    the usual names taken instead (``io/names.py``), and said so by ``known``."""
    from tui_merger.core.formats.hf_names import EmbeddingNames

    if not isinstance(names, (dict, set, frozenset, list, tuple)):
        names = list(names)  # read more than once
    found = _embedding_names(config, names)
    if found.known:
        return found
    from tui_merger.core.io.names import INPUT_EMBEDDING_SUFFIXES, OUTPUT_EMBEDDING

    shapes = names if isinstance(names, dict) else {}
    text_cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab_size = config.get("vocab_size", text_cfg.get("vocab_size"))
    embeds = [n for n in names if n.endswith(INPUT_EMBEDDING_SUFFIXES) and len(_shape(shapes.get(n), 2)) == 2]
    if len(embeds) > 1 and vocab_size:
        embeds = [n for n in embeds if _shape(shapes.get(n), 2)[0] == vocab_size] or embeds
    archs = config.get("architectures") or []
    head = not archs or any(str(a).endswith(LM_HEAD_ARCHITECTURES) for a in archs)
    return EmbeddingNames(embeds[0] if embeds else None, OUTPUT_EMBEDDING if head else None, False)


def _embedding_names(config: dict, names) -> "EmbeddingNames":
    """``hf_names.embedding_names``, kept for the last few (config, names in order) asked: a merge asks
    the same of the same base 5-9 times (the plan in preflight and in the merge, its checks, the
    recompute, the verification), and each answer walks the meta model and renames every tensor name
    by transformers' rules (0.07-0.15 CPU-s at 3B). The answer depends on nothing else."""
    import json

    from tui_merger.core.formats.hf_names import embedding_names

    key = (json.dumps(config, sort_keys=True, default=str), tuple(names))
    with _EMBEDDINGS_LOCK:
        for k, found in _EMBEDDINGS:
            if k == key:
                return found
    found = embedding_names(config, names)
    with _EMBEDDINGS_LOCK:
        _EMBEDDINGS.insert(0, (key, found))
        del _EMBEDDINGS[4:]
    return found


_EMBEDDINGS: list = []
_EMBEDDINGS_LOCK = threading.Lock()


def _shape(ref, default_len: int) -> tuple:
    """The shape of a TensorRef or a shape tuple; unknown: ``default_len`` dimensions of 0."""
    if ref is None:
        return (0,) * default_len
    return tuple(getattr(ref, "shape", ref))


# for a model transformers cannot build here only: the classes that have an output embedding
LM_HEAD_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM", "ForImageTextToText")


class _Resolver:
    """Maps adapter module names onto base tensor names, tolerating a leading prefix difference
    (e.g. ``transformer.h.0`` in the adapter and ``h.0`` in an old GPT-2 checkpoint)."""

    def __init__(self, names) -> None:
        self.names = names
        self.prefixes = sorted({n.split(".", 1)[0] + "." for n in names if "." in n})

    def find(self, module: str, param: str) -> str | None:
        key = f"{module}.{param}"
        if key in self.names:
            return key
        rest = key.partition(".")[2]
        if rest in self.names:
            return rest
        for prefix in self.prefixes:
            if prefix + key in self.names:
                return prefix + key
        return None


def build_plan(
    base: TensorSource,
    adapter: PeftAdapter,
    base_config: dict,
    out_dtype: str | None,
    shard_size: int,
) -> TensorPlan:
    text_cfg = base_config.get("text_config") if isinstance(base_config.get("text_config"), dict) else {}
    vocab_size = base_config.get("vocab_size", text_cfg.get("vocab_size"))
    names: dict[str, TensorRef] = dict(base.tensors)
    order = list(names)

    # Tied embeddings: lm_head may be absent from the files; give it a virtual entry backed by the
    # input embedding so that an adapter touching only one side can be planned, and drop it again
    # if both sides end up identical.
    tie = base_config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings"))
    embeddings = embeddings_of(base_config, names)
    embed_name = embeddings.input if embeddings.input in names else None
    head_name = embeddings.output  # the output head's name in the files (or as save_pretrained writes it)
    virtual_head = False
    if embed_name and head_name and head_name not in names and tie is not False:
        names[head_name] = names[embed_name]
        order.append(head_name)
        virtual_head = True
        tie = True

    resolver = _Resolver(names)
    sources: dict[str, TensorRef] = {n: names[n] for n in order}
    ops: dict[str, list] = {n: [] for n in order}
    leftovers: list[str] = []

    def resolve(module: str, param: str, what: str) -> str:
        name = resolver.find(module, param)
        if name is None:
            leftovers.append(f"{what} for {module}")
        return name

    # 1. saved base layers (embedding layers saved with the adapter, e.g. after a vocabulary resize)
    for pname, ref in adapter.base_overrides.items():
        module, _, param = pname.rpartition(".")
        name = resolve(module, param, "saved base layer")
        if name:
            sources[name] = ref
            if tie and name == embed_name and virtual_head:
                sources[head_name] = ref  # the shared parameter itself was replaced

    # 2. modules_to_save: the trained copy replaces the base module
    for pname, ref in adapter.replacements.items():
        module, _, param = pname.rpartition(".")
        name = resolve(module, param, "modules_to_save tensor")
        if name:
            sources[name] = ref

    # 3. LoRA deltas (one op per adapter touching the module in a weighted merge)
    for mod, entry in [(m, term) for m, first in adapter.lora.items() for term in [first, *first.terms]]:
        name = resolve(mod, "weight", "LoRA pair")
        if not name:
            continue
        _check_lora_shapes(entry, sources[name], adapter.fan_in_fan_out, name)
        if entry.is_embedding:
            ops[name].append(LoraOp(mod, entry.emb_A, entry.emb_B, entry.scale, True, None))
        else:
            ops[name].append(
                LoraOp(mod, entry.A, entry.B, entry.scale, adapter.fan_in_fan_out, entry.magnitude)
            )
        if entry.B_bias is not None:
            bname = resolve(mod, "bias", "LoRA bias (lora_bias=True)")
            if bname:
                if tuple(sources[bname].shape) != tuple(entry.B_bias.shape):
                    raise _shape_error(entry.B_bias, sources[bname], bname)
                ops[bname].append(BiasOp(mod, entry.B_bias, entry.scale))

    # 3b. LoRA on packed experts kept packed on disk (peft target_parameters)
    unplaced = list(getattr(adapter, "param_lora", {}) or {})
    if unplaced:  # a reader that never placed them in the base's tensors: refused, never dropped
        raise MergeError(
            f"The adapter changes parameters ({', '.join(unplaced[:3])}{', ...' if len(unplaced) > 3 else ''}; peft's "
            "target_parameters) that tui-merger cannot place in this checkpoint's tensors yet; nothing was written. "
            "Where the run also saved a PEFT adapter folder, merge that: tui-merger merge --base BASE --adapter ADAPTER."
        )
    for pname, entry in getattr(adapter, "expert_lora", {}).items():
        module, _, param = pname.rpartition(".")
        name = resolve(module, param, "LoRA on experts")
        if name:
            ops[name].append(ExpertsLoraOp(pname, entry.A, entry.B, entry.scale, entry.experts, entry.transposed))

    # 4. trainable token rows; peft ties them to a tied output embedding as well
    for mod, (indices, ref) in adapter.token_rows.items():
        name = resolve(mod, "weight", "trainable token rows")
        if not name:
            continue
        targets = [name]
        if tie and name == embed_name and head_name in sources:
            head_mod_has_own = any(resolver.find(m, "weight") == head_name for m in adapter.token_rows if m != mod)
            if not head_mod_has_own:
                targets.append(head_name)
        for target in targets:
            rows_n, width = sources[target].shape[0], sources[target].shape[-1]
            if ref.shape[1] != width or max(indices, default=-1) >= rows_n or min(indices, default=0) < 0:
                raise MergeError(
                    f"Trainable token rows for {mod} (shape {list(ref.shape)}, indices up to "
                    f"{max(indices, default=0)}) do not fit {target} of shape {list(sources[target].shape)}; "
                    "the adapter was trained on a different model."
                )
            ops[target].append(RowsOp(mod, tuple(indices), ref))

    if leftovers:
        shown = "; ".join(leftovers[:4]) + (f" and {len(leftovers) - 4} more" if len(leftovers) > 4 else "")
        raise MergeError(
            f"The adapter targets modules the base model does not have ({shown}); nothing was written. "
            "Is the base the model the adapter was trained on?"
        )

    config_changes: dict = {}
    if virtual_head:
        head_sig = (sources[head_name].file, sources[head_name].name, tuple(ops[head_name]))
        emb_sig = (sources[embed_name].file, sources[embed_name].name, tuple(ops[embed_name]))
        if head_sig == emb_sig:
            order.remove(head_name)
        else:
            config_changes["tie_word_embeddings"] = False
    elif tie and embed_name and head_name in sources:
        changed = (sources[embed_name] is not base.tensors.get(embed_name)) or ops[embed_name]
        changed_head = (sources[head_name] is not base.tensors.get(head_name)) or ops[
            head_name
        ]
        if changed or changed_head:
            config_changes["tie_word_embeddings"] = False

    def out_dtype_for(name: str, src: TensorRef) -> str:
        if src.dtype not in FLOAT_DTYPES:
            return src.dtype
        if out_dtype:
            return out_dtype
        # replacements from the adapter (often fp32) take the dtype of the base tensor they replace
        base_ref = base.tensors.get(name) or base.tensors.get(embed_name or "")
        return base_ref.dtype if base_ref is not None and base_ref.dtype in FLOAT_DTYPES else src.dtype

    tensors = []
    for name in order:
        src = sources[name]
        tensors.append(OutputTensor(name, src, out_dtype_for(name, src), tuple(src.shape), ops[name]))
    merged = sum(1 for t in tensors if t.ops or base.tensors.get(t.name) is not t.source)

    # a resized vocabulary (modules_to_save or saved embedding layers) must reach config.json
    final = {t.name: t for t in tensors}
    if embed_name in final and vocab_size and final[embed_name].shape[0] != vocab_size:
        config_changes["vocab_size"] = final[embed_name].shape[0]
    return TensorPlan(tensors, _shard(tensors, shard_size), config_changes, merged)


def _shape_error(adapter_ref: TensorRef, base_ref: TensorRef, base_name: str) -> MergeError:
    return MergeError(
        f"Adapter tensor {adapter_ref.name} has shape {list(adapter_ref.shape)} but base tensor "
        f"{base_name} has shape {list(base_ref.shape)}; the adapter was trained on a different model "
        "(architecture or size)."
    )


def _check_lora_shapes(entry: LoraModule, base_ref: TensorRef, fan_in_fan_out: bool, name: str) -> None:
    shape = tuple(base_ref.shape)
    if len(shape) > 2 and not entry.is_embedding and not fan_in_fan_out and len(entry.A.shape) == 2:
        shape = (shape[0], math.prod(shape[1:]))  # a convolution kernel, merged as the matrix [out, in * k...]
    if len(shape) != 2:
        raise MergeError(
            f"Base tensor {name} has shape {list(shape)}; LoRA on non-matrix weights (e.g. convolutions) "
            "is not supported yet."
        )
    if entry.is_embedding:
        rows, cols = shape  # [vocab, hidden]; A: [r, vocab], B: [hidden, r]
        if entry.emb_A.shape[1] != rows:
            raise _shape_error(entry.emb_A, base_ref, name)
        if entry.emb_B.shape[0] != cols:
            raise _shape_error(entry.emb_B, base_ref, name)
        return
    out_f, in_f = (shape[1], shape[0]) if fan_in_fan_out else shape
    if entry.A.shape[1] != in_f:
        raise _shape_error(entry.A, base_ref, name)
    if entry.B.shape[0] != out_f:
        raise _shape_error(entry.B, base_ref, name)
    if entry.magnitude is not None and tuple(entry.magnitude.shape) != (out_f,):
        raise _shape_error(entry.magnitude, base_ref, name)


def shard_tensors(tensors: list[OutputTensor], shard_size: int) -> list[tuple[str, list[OutputTensor]]]:
    """The output files and the tensors in each (a plan rewritten after build_plan shards again)."""
    return _shard(tensors, shard_size)


def _place(t: OutputTensor) -> tuple[int, int]:
    """Where a tensor goes in its shard, keeping every tensor aligned to its element size: first, in plan
    order, those whose size is a multiple of 8 bytes (the offset stays a multiple of 8: a quantized
    weight's values then its scales, which one computation makes: pairs.PairSource), then the rest,
    wider dtypes first."""
    return (0, 0) if t.nbytes % 8 == 0 else (1, -itemsize(t.dtype))


def _shard(tensors: list[OutputTensor], shard_size: int) -> list[tuple[str, list[OutputTensor]]]:
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    groups = [sorted(g, key=_place) for g in groups]
    n = len(groups)
    if n == 1:
        return [("model.safetensors", groups[0])]
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]
