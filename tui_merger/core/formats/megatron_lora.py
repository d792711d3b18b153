"""The adapter shards of a verl Megatron LoRA run as one PEFT adapter under Hugging Face names.

verl saves a Megatron LoRA run's adapters (Megatron-Bridge's LoRA, CanonicalLoRA or DoRA) as
``adapter_checkpoint/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]_adapter.pt``: ``{"adapter_state_dict": ...}``
of the first model chunk's parameters named ``*.adapter.*``, layer and expert numbers local to the
pipeline stage and expert-parallel rank. This module puts those shards together the way megatron-core
reshards them and names them as Megatron-Bridge's Hugging Face adapter export does:

- tensor parallelism: ``linear_out`` (and a DoRA ``weight_magnitude`` of a column-parallel layer) is split
  on dim 0 on every layer; ``linear_in`` on dim 0 where the base layer is column-parallel (linear_qkv,
  linear_fc1, the router), on dim 1 where it is row-parallel (linear_proj, linear_fc2); linear_fc1's rows
  are [gate; up] on every rank, so the gate halves of all ranks come first;
- pipeline stages: layer ``i`` of stage ``p`` is layer ``offset(p) + i``; expert-parallel ranks: local
  expert ``e`` of rank ``r`` is expert ``r * local + e``;
- names: ``linear_in`` is ``lora_A`` and ``linear_out`` ``lora_B`` (the merge is W + alpha/dim *
  linear_out @ linear_in, peft's); fused qkv rows are interleaved per query group ([q heads of the group;
  k; v]) and split into q/k/v_proj, fc1 into gate/up_proj, each with the same lora_A; CanonicalLoRA's
  ``adapter_q/k/v/gate/up`` are already separate; a DoRA magnitude becomes ``lora_magnitude_vector``.

Tensors are read from the shards (the restricted unpickler, mapped) when the merge asks for them.

The same naming serves the adapter-only dist checkpoints of ``read_dist_adapter``: Megatron-Bridge's PEFT
iterations (``*.adapter.linear_in/out``) and ms-swift's Megatron LoRA iterations (``*.lora_A/B.default``, peft's
LoRA on megatron-core modules; ``swift_peft`` / ``check_swift_tuner`` read its args.json), MoE experts included
where megatron-core saves them as ``mlp.experts.experts.*``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.sources import TensorRef

SHARD = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?_adapter\.pt$")
SHARDS_DIR = "adapter_checkpoint"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_PARAM = re.compile(
    r"^(?P<mod>.+?)\.adapter\.(?:(?P<sub>adapter_(?:q|k|v|gate|up))\.)?"
    r"(?P<what>linear_in\.weight|linear_out\.weight|weight_magnitude)$"
)
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])$")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")  # base layers whose input is split over TP ranks
# Megatron module (after decoder.layers.{i}.) -> (Hugging Face module after model.layers.{i}., fused parts)
_MODULES = {
    "self_attention.linear_qkv": ("self_attn.{}_proj", ("q", "k", "v")),
    "self_attention.linear_proj": ("self_attn.o_proj", None),
    "mlp.linear_fc1": ("mlp.{}_proj", ("gate", "up")),
    "mlp.linear_fc2": ("mlp.down_proj", None),
    "mlp.router": ("mlp.gate", None),
    "mlp.shared_experts.linear_fc1": ("mlp.shared_expert.{}_proj", ("gate", "up")),
    "mlp.shared_experts.linear_fc2": ("mlp.shared_expert.down_proj", None),
}
KINDS = {"lora": "LoRA", "canonical": "CanonicalLoRA", "dora": "DoRA"}
_CANONICAL = {"adapter_q": "linear_q", "adapter_k": "linear_k", "adapter_v": "linear_v", "adapter_gate": "linear_fc1_gate",
              "adapter_up": "linear_fc1_up"}


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def transformer_config(actor: Path) -> dict:
    """verl's transformer_config.json beside the shards ({} when absent or unreadable)."""
    return _json(Path(actor) / "transformer_config.json")


def _size(tconfig: dict, key: str) -> int | None:
    value = tconfig.get(key)
    return value if type(value) is int and value >= 1 else None


def shard_files(folder: Path) -> dict[tuple[int, ...], str]:
    """Cheap (names only): the rank numbers of each ``mp_rank_*_adapter.pt`` in ``folder``."""
    try:
        names = [p.name for p in Path(folder).iterdir()]
    except OSError:
        return {}
    found = {}
    for name in names:
        m = SHARD.match(name)
        if m:
            found[tuple(int(g) for g in m.groups() if g is not None)] = name
    return found


@dataclass
class ShardLayout:
    """Where each rank's shard is: ``grid[(tp, pp, ep)]``, and the sizes."""

    folder: Path
    grid: dict[tuple[int, int, int], Path]
    tp: int
    pp: int
    ep: int
    vpp: int | None
    tconfig: dict
    etp: int = 1  # expert tensor parallelism: 1, experts whole on every TP rank; else = tp

    def dense(self, tp: int, pp: int) -> tuple[int, int, int]:
        """The file whose non-expert adapters are TP rank ``tp``'s (expert-parallel ranks replicate them)."""
        return min(k for k in self.grid if k[0] == tp and k[1] == pp)

    def experts(self, tp: int, pp: int, ep: int) -> tuple[int, int, int] | None:
        """The file whose experts are EP rank ``ep``'s TP piece ``tp`` (None: not a piece of its own,
        experts are whole on every TP rank)."""
        if self.etp == 1:
            return min(k for k in self.grid if k[1] == pp and k[2] == ep) if tp == 0 else None
        return (tp, pp, ep)


def shard_layout(folder: Path, tconfig: dict) -> ShardLayout:
    """The rank grid of ``folder``, checked complete, or one sentence saying what is missing."""
    folder = Path(folder)
    found = shard_files(folder)
    if not found:
        raise MergeError(
            f"{folder} holds no mp_rank_*_adapter.pt files; copy the run's whole {SHARDS_DIR}/ folder again."
        )
    widths = {len(k) for k in found}
    if len(widths) > 1:
        names = sorted(found.values())
        raise MergeError(
            f"{folder} mixes adapter files named for different parallel layouts ({names[0]}, {names[-1]}); they "
            "come from different runs: keep the files of one run only."
        )
    width = widths.pop()
    said_pp, said_ep = _size(tconfig, "pipeline_model_parallel_size"), _size(tconfig, "expert_model_parallel_size")
    if width == 3:
        grid = {k: folder / n for k, n in found.items()}
    elif width == 2:
        second_is_ep = (said_ep or 1) > 1 and (said_pp or 1) == 1
        if said_pp is None and said_ep is None:
            raise MergeError(
                f"The adapter files in {folder} are numbered mp_rank_TT_NNN, and without the run's "
                "transformer_config.json nothing says whether NNN is a pipeline stage or an expert-parallel rank; "
                "copy transformer_config.json from the run's actor/ folder next to adapter_checkpoint/."
            )
        grid = {((k[0], 0, k[1]) if second_is_ep else (k[0], k[1], 0)): folder / n for k, n in found.items()}
    else:
        grid = {(k[0], 0, 0): folder / n for k, n in found.items()}
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
    # the sizes the files say, or transformer_config.json's where it says more (a file is then missing)
    tps, pps, eps = (max(1 + max(k[i] for k in grid), _size(tconfig, keys[i]) or 0) for i in range(3))
    # with expert tensor parallelism 1, TP and EP > 1, a rank's TP and EP numbers move together (verl
    # names files by both): every TP rank and every EP rank is in some file of each stage, not every pair
    etp = _size(tconfig, "expert_tensor_parallel_size") or tps
    paired = eps > 1 and tps > 1 and etp == 1
    for tp in range(tps):
        for pp in range(pps):
            for ep in range(eps):
                present = (any(k[0] == tp and k[1] == pp for k in grid) and any(k[1] == pp and k[2] == ep for k in grid)
                           if paired else (tp, pp, ep) in grid)
                if not present:
                    parts = [f"{tps} tensor"] + ([f"{pps} pipeline"] if pps > 1 else []) + ([f"{eps} expert"] if eps > 1 else [])
                    stage = f"_{pp:03d}" if pps > 1 else ""
                    if paired:  # some file of this TP rank, or of this EP rank, is what is missing
                        tp_missing = not any(k[0] == tp and k[1] == pp for k in grid)
                        name = f"mp_rank_{tp:02d}{stage}_*" if tp_missing else f"mp_rank_*{stage}_{ep:03d}"
                        raise MergeError(
                            f"No {name}_adapter.pt file in {folder} holds {'tensor' if tp_missing else 'expert'}-parallel "
                            f"rank {tp if tp_missing else ep}'s adapters ({' x '.join(parts)}-parallel ranks); copy the whole "
                            f"{SHARDS_DIR}/ folder again."
                        )
                    name = f"mp_rank_{tp:02d}{stage}" + (f"_{ep:03d}" if eps > 1 else "")
                    raise MergeError(
                        f"{folder / (name + '_adapter.pt')} is missing from this run's adapter shards "
                        f"({' x '.join(parts)}-parallel ranks); copy the whole {SHARDS_DIR}/ folder again."
                    )
    for key, have in zip(keys, (tps, pps, eps)):
        want = _size(tconfig, key)
        if want is not None and want != have:
            raise MergeError(
                f"{folder} holds adapter files for {have} ranks of {key.split('_model')[0]} parallelism but the "
                f"run's transformer_config.json says {key} {want}; the files come from different runs: keep the "
                "files of one run only."
            )
    vpp = _size(tconfig, "virtual_pipeline_model_parallel_size")
    return ShardLayout(folder, grid, tps, pps, eps, vpp, tconfig, etp)


def grouped_refusal(folder: Path, key: str) -> str:
    return (
        f"{folder} holds LoRA on grouped-GEMM experts ({key}), which Megatron-Bridge builds only with Transformer "
        "Engine and whose layout tui-merger cannot check without it; merge the run's Hugging Face adapter export "
        "(AutoBridge.save_hf_adapter) with --base instead."
    )


def vpp_refusal(vpp: int) -> str:
    return (
        f"This run used {vpp} virtual pipeline stages, and verl saves only the first model chunk's adapters to "
        f"{SHARDS_DIR}/, so the other chunks' layers have no adapters there; merge the run's Hugging Face adapter "
        "export (AutoBridge.save_hf_adapter) or its Megatron-Bridge dist checkpoint instead."
    )


# -- the adapter tensors --------------------------------------------------------------------------


@dataclass
class _Global:
    """One Megatron adapter parameter with global numbers: its TP pieces and how they join."""

    name: str  # global Megatron name
    pieces: list  # tensors (views on the mapped shards), TP rank order
    dim: int | None  # the dim the pieces join on; None: one piece (not split)
    glu: bool = False  # rows are [gate; up] on every rank

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.pieces[0].shape)
        if self.dim is not None:
            shape[self.dim] = sum(p.shape[self.dim] for p in self.pieces)
        return tuple(shape)

    @property
    def dtype(self) -> str:
        return str(self.pieces[0].dtype).removeprefix("torch.")

    def load(self):
        import torch

        if self.dim is None:
            return self.pieces[0].clone()
        if self.glu:
            halves = [p.chunk(2, 0) for p in self.pieces]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        return torch.cat(self.pieces, self.dim)


class ShardSource:
    """A TensorSource of PEFT adapter names over the shards (every tensor computed when loaded)."""

    def __init__(self, folder: Path, files: list[str]) -> None:
        self.folder = Path(folder)
        self.files = files
        self.tensors: dict[str, TensorRef] = {}
        self._parts: dict[str, tuple] = {}
        self._open: list = []

    def add(self, name: str, part: tuple) -> None:
        g, rows = part
        if rows is None:
            shape = g.shape
        elif isinstance(rows, list):  # row ranges joined (q/k/v of every query group)
            shape = (sum(b - a for a, b in rows),) + g.shape[1:]
        else:
            shape = (rows[1] - rows[0],) + g.shape[1:]
        self._parts[name] = part
        self.tensors[name] = TensorRef(self, "", name, g.dtype, tuple(shape))

    def load(self, ref: TensorRef):
        import torch

        g, rows = self._parts[ref.name]
        full = g.load()
        if rows is None:
            return full
        if isinstance(rows, list):
            return torch.cat([full[a:b] for a, b in rows], 0)
        return full[rows[0] : rows[1]].clone()

    def load_into(self, ref: TensorRef, out) -> None:
        out.copy_(self.load(ref))

    def release(self, ref: TensorRef) -> None:
        pass

    def close(self) -> None:
        for tf in self._open:
            tf.close()
        self._open = []


@dataclass
class ShardAdapter:
    """What the shards hold, in Hugging Face terms."""

    source: ShardSource
    kind: str  # "lora", "canonical" or "dora"
    r: int
    rank_pattern: dict
    targets: list[str]  # Megatron target modules seen (linear_qkv, linear_proj, ..., router, experts)
    layers: int
    experts: int
    layout: ShardLayout | None = None
    notices: list[str] = field(default_factory=list)
    target_regex: str | None = None  # target_modules as peft's regex (a VL model: its language model's layers only)
    renames: dict = field(default_factory=dict)  # a VL model: in-memory -> save_pretrained names, where they differ
    target_parameters: list = field(default_factory=list)  # a VL MoE model's packed experts (peft target_parameters)


def _load_shard(path: Path, source: ShardSource) -> dict:
    from tui_merger.core.io.torch_pickle import TorchFile, require_names

    tf = TorchFile(path)
    source._open.append(tf)
    obj = tf.obj
    state = obj.get("adapter_state_dict") if isinstance(obj, dict) else None
    if not isinstance(state, dict):
        raise MergeError(
            f"{path} does not hold an adapter_state_dict; it is not a verl Megatron adapter file (copy it again)."
        )
    require_names(path, state)
    out = {}
    for key, t in state.items():
        if not hasattr(t, "shape"):
            continue
        out[re.sub(r"^(?:model\d*\.|module\.)+", "", key)] = t
    return out


def _layer_counts(layout: ShardLayout, per_stage: dict[int, int], hf_layers: int | None) -> list[int]:
    """How many layers each pipeline stage holds: from transformer_config.json when it says (an even
    split, or its first/last stage sizes), else from the layers the shards number."""
    t = layout.tconfig
    total = _size(t, "num_layers") or hf_layers
    if layout.pp == 1:
        return [total if total else per_stage.get(0, 0)]
    first, last = _size(t, "num_layers_in_first_pipeline_stage"), _size(t, "num_layers_in_last_pipeline_stage")
    if total and (first or last):
        middle = layout.pp - (first is not None) - (last is not None)
        rest = total - (first or 0) - (last or 0)
        each = rest // middle if middle else 0
        counts = [each] * layout.pp
        if first:
            counts[0] = first
        if last:
            counts[-1] = last
        return counts
    if total and total % layout.pp == 0:
        return [total // layout.pp] * layout.pp
    return [per_stage.get(p, 0) for p in range(layout.pp)]


def read_shards(layout: ShardLayout, hf_config: dict) -> ShardAdapter:
    """The shards as PEFT tensors under Hugging Face names, checked against each other and against the
    run's Hugging Face config (heads, query groups and head size split the fused qkv rows)."""
    files = [str(p.relative_to(layout.folder)) for _, p in sorted(layout.grid.items())]
    source = ShardSource(layout.folder, files)
    try:
        return _read(layout, hf_config, source)
    except BaseException:
        source.close()
        raise


def _cfg(config: dict, key: str):
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get(key, config.get(key))


def _read(layout: ShardLayout, hf_config: dict, source: ShardSource) -> ShardAdapter:
    folder = layout.folder
    loaded = {k: _load_shard(p, source) for k, p in sorted(layout.grid.items())}
    hf_layers = _cfg(hf_config, "num_hidden_layers")
    hf_layers = hf_layers if type(hf_layers) is int else None
    # the keys of every TP rank must agree, with TP pieces of one size (dense adapters: each TP rank's
    # file; experts: each expert TP rank's)
    def part(key: str) -> bool:
        return ".mlp.experts." in key

    checks = []
    for pp in range(layout.pp):
        checks += [(layout.dense(tp, pp), layout.dense(0, pp), False) for tp in range(1, layout.tp)]
        if layout.etp > 1:
            checks += [(layout.experts(tp, pp, ep), layout.experts(0, pp, ep), True)
                       for ep in range(layout.ep) for tp in range(1, layout.tp)]
    for mine, first, experts in checks:
        state = {k: t for k, t in loaded[mine].items() if part(k) == experts}
        ref = {k: t for k, t in loaded[first].items() if part(k) == experts}
        a, b = layout.grid[mine].name, layout.grid[first].name
        if set(state) != set(ref):
            raise MergeError(
                f"{a} holds other adapter parameters than {b}; the files in {folder} come from different runs: "
                "keep the files of one run only."
            )
        for key, t in state.items():
            if tuple(t.shape) != tuple(ref[key].shape):
                raise MergeError(
                    f"{a} and {b} hold {key} in different shapes ({list(t.shape)} and {list(ref[key].shape)}): the "
                    "files come from runs with different tensor-parallel sizes; keep the files of one run only."
                )
    grouped = sorted({k for s in loaded.values() for k in s if re.search(r"\.mlp\.experts\.linear_fc[12]\.adapter\.", k)})
    if grouped:
        raise MergeError(grouped_refusal(folder, grouped[0]))
    # local -> global layer and expert numbers
    per_stage: dict[int, int] = {}
    for (tp, pp, ep), state in loaded.items():
        for key in state:
            m = _LAYER.match(key)
            if m:
                per_stage[pp] = max(per_stage.get(pp, 0), int(m.group(1)) + 1)
    counts = _layer_counts(layout, per_stage, hf_layers)
    for pp, n in per_stage.items():
        if n > counts[pp]:
            raise MergeError(
                f"Stage {pp}'s adapter files in {folder} number {n} layers, more than the {counts[pp]} the run's "
                "configuration gives it; the files come from different runs: keep the files of one run only."
            )
    offsets = [sum(counts[:p]) for p in range(layout.pp)]
    total = sum(counts)
    if layout.vpp and layout.vpp > 1:
        raise MergeError(vpp_refusal(layout.vpp))
    if hf_layers and total < hf_layers:
        raise MergeError(
            f"The adapter files in {folder} cover {total} layers but the run's config has {hf_layers}; verl saves only "
            "the first model chunk's adapters, so a run with virtual pipeline stages is missing the others: merge its "
            "Hugging Face adapter export instead."
        )
    local_experts: dict[tuple[int, int], int] = {}
    for (tp, pp, ep), state in loaded.items():
        for key in state:
            m = _LAYER.match(key)
            e = _LOCAL_EXPERT.match(m.group(2).split(".adapter.")[0]) if m else None
            if e:
                local_experts[(pp, int(m.group(1)))] = max(local_experts.get((pp, int(m.group(1))), 0), int(e.group(1)) + 1)
    n_local = max(local_experts.values(), default=0)
    experts = n_local * layout.ep
    want = _cfg(hf_config, "num_experts") or _cfg(hf_config, "num_local_experts")
    if experts and isinstance(want, int) and want != experts:
        raise MergeError(
            f"The adapter files in {folder} hold {n_local} experts on each of {layout.ep} expert-parallel ranks, "
            f"{experts} in all, but the run's config says {want} experts; the files come from different runs or "
            "ranks are missing: copy the whole folder again."
        )
    # gather: global Megatron name -> pieces across TP ranks, each from the file that holds it
    globals_: dict[str, _Global] = {}
    sources = []  # (tp, pp, ep, file key, experts?)
    for pp in range(layout.pp):
        sources += [(tp, pp, 0, layout.dense(tp, pp), False) for tp in range(layout.tp)]
        sources += [(tp, pp, ep, k, True) for ep in range(layout.ep) for tp in range(layout.tp)
                    if (k := layout.experts(tp, pp, ep)) is not None]
    for tp, pp, ep, file_key, experts_part in sources:
        state = {k: t for k, t in loaded[file_key].items() if part(k) == experts_part}
        for key, t in state.items():
            m = _LAYER.match(key)
            if m is None:
                raise MergeError(
                    f"{layout.grid[file_key].name} holds {key}, an adapter outside the decoder layers, which "
                    "tui-merger does not know how to merge; nothing was written."
                )
            rest = m.group(2)
            expert = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
            if expert:
                rest = f"mlp.experts.local_experts.{ep * n_local + int(expert.group(1))}.{expert.group(2)}"
            name = f"decoder.layers.{offsets[pp] + int(m.group(1))}.{rest}"
            g = globals_.get(name)
            if g is None:
                g = globals_[name] = _Global(name, [], None)
            g.pieces.append(t)
    import torch

    unequal: list[str] = []  # row-parallel DoRA magnitudes that differ between TP ranks
    for g in globals_.values():
        want = layout.etp if ".mlp.experts.local_experts." in g.name else layout.tp
        if len(g.pieces) != want:
            raise MergeError(
                f"{g.name} is held {len(g.pieces)} times by the adapter files in {folder}, not once per tensor-parallel "
                "rank; the files come from different runs or stages: keep the files of one run only."
            )
        if len(g.pieces) == 1:
            continue
        p = _PARAM.match(g.name.split(".", 3)[3])
        if p is None:
            raise MergeError(
                f"{folder} holds {g.name}, which is not a Megatron-Bridge LoRA parameter; nothing was written."
            )
        mod = p.group("mod").rsplit(".", 1)[-1]
        what = p.group("what")
        if what == "linear_in.weight":
            g.dim = 1 if mod in _ROW_PARALLEL else 0
        elif what == "linear_out.weight":
            g.dim = 0
            g.glu = mod == "linear_fc1" and p.group("sub") is None
        else:  # DoRA magnitude: split where the base layer's output is
            if mod in _ROW_PARALLEL:  # whole on every TP rank; megatron-core's checkpoint keeps rank 0's
                if not all(torch.equal(p, g.pieces[0]) for p in g.pieces[1:]):
                    unequal.append(g.name)
                g.pieces = g.pieces[:1]
            else:
                g.dim = 0
                g.glu = mod == "linear_fc1"
    shards = _name(layout, hf_config, source, globals_, total, experts)
    if unequal:
        shards.notices.append(
            f"DoRA: the magnitudes of {len(unequal)} linear_proj / linear_fc2 layers differ between tensor-parallel "
            "ranks (Megatron-Bridge starts each from the norm of its rank's slice of the weight); TP rank 0's are "
            "merged, the copy megatron-core's own checkpoint keeps."
        )
    return shards


def _name(layout, hf_config, source: ShardSource, globals_: dict, layers: int, experts: int,
          prefix: str = "base_model.model.model.layers.") -> ShardAdapter:
    heads, kv = _cfg(hf_config, "num_attention_heads"), _cfg(hf_config, "num_key_value_heads")
    kv = kv or heads
    hidden = _cfg(hf_config, "hidden_size")
    head_dim = _cfg(hf_config, "head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
    modules: dict[str, dict] = {}  # Megatron module -> {sub or None: {what: _Global}}
    for name, g in globals_.items():
        p = _PARAM.match(name)
        if p is None:
            raise MergeError(f"{layout.folder} holds {name}, which is not a Megatron-Bridge LoRA parameter; nothing was written.")
        modules.setdefault(p.group("mod"), {}).setdefault(p.group("sub"), {})[p.group("what")] = g
    kinds = set()
    targets = set()
    ranks: Counter = Counter()
    by_module: dict[str, int] = {}
    for mod, subs in sorted(modules.items()):
        m = _LAYER.match(mod)
        i, rest = int(m.group(1)), m.group(2)
        expert = _LOCAL_EXPERT.match(rest)
        if expert:
            hf_mod, parts = ("mlp.experts." + expert.group(1) + (".{}_proj" if expert.group(2) == "linear_fc1" else ".down_proj"),
                             ("gate", "up") if expert.group(2) == "linear_fc1" else None)
            targets.add("experts")
        elif rest in _MODULES:
            hf_mod, parts = _MODULES[rest]
            targets.add(rest.rsplit(".", 1)[-1] if "shared_experts" not in rest else "shared_experts")
        else:
            raise MergeError(
                f"{layout.folder} holds LoRA on decoder.layers.{i}.{rest}, which has no counterpart tui-merger knows in a "
                "Hugging Face model; nothing was written."
            )
        for sub, params in subs.items():
            if "linear_in.weight" not in params or "linear_out.weight" not in params:
                raise MergeError(
                    f"{layout.folder} holds only half of the LoRA pair of {mod}{'.' + sub if sub else ''} "
                    "(linear_in or linear_out is missing); the files are incomplete: copy them again."
                )
            A, B = params["linear_in.weight"], params["linear_out.weight"]
            mag = params.get("weight_magnitude")
            kinds.add("canonical" if sub else ("dora" if mag is not None else "lora"))
            r = A.shape[0]
            if len(A.shape) != 2 or len(B.shape) != 2 or B.shape[1] != r:
                raise MergeError(
                    f"{mod}: linear_in {list(A.shape)} and linear_out {list(B.shape)} do not make a LoRA pair; "
                    "the adapter files are damaged."
                )
            if sub:  # CanonicalLoRA: one pair per projection
                names = [(hf_mod.format(sub.removeprefix("adapter_")), None)]
            elif parts == ("q", "k", "v"):
                if not all(isinstance(x, int) and x > 0 for x in (heads, kv, head_dim)) or heads % kv:
                    raise MergeError(
                        "The run's config.json does not say num_attention_heads, num_key_value_heads and the head size, "
                        "which split the fused qkv adapter; copy the run's huggingface/config.json again."
                    )
                per = heads // kv
                group = (per + 2) * head_dim
                if B.shape[0] != kv * group:
                    raise MergeError(
                        f"{mod}'s linear_out has {B.shape[0]} rows, but the run's config ({heads} heads, {kv} key-value "
                        f"heads of {head_dim}) makes {kv * group}; the config does not belong to these adapters."
                    )
                q = [(g * group, g * group + per * head_dim) for g in range(kv)]
                k = [(g * group + per * head_dim, g * group + (per + 1) * head_dim) for g in range(kv)]
                v = [(g * group + (per + 1) * head_dim, (g + 1) * group) for g in range(kv)]
                names = [(hf_mod.format("q"), q), (hf_mod.format("k"), k), (hf_mod.format("v"), v)]
            elif parts == ("gate", "up"):
                if B.shape[0] % 2:
                    raise MergeError(f"{mod}'s linear_out has {B.shape[0]} rows, not gate and up halves; the files are damaged.")
                half = B.shape[0] // 2
                names = [(hf_mod.format("gate"), (0, half)), (hf_mod.format("up"), (half, 2 * half))]
            else:
                names = [(hf_mod, None)]
            for hf, rows in names:
                full = f"{prefix}{i}.{hf}"
                source.add(f"{full}.lora_A.weight", (A, None))
                source.add(f"{full}.lora_B.weight", (B, rows))
                if mag is not None:
                    source.add(f"{full}.lora_magnitude_vector", (mag, rows))
                ranks[r] += 1
                by_module[full.removeprefix("base_model.model.")] = r
    # CanonicalLoRA keeps plain pairs on linear_proj / linear_fc2; DoRA adds magnitudes to every pair
    kind = "canonical" if "canonical" in kinds else ("dora" if "dora" in kinds else "lora")
    if not ranks:
        raise MergeError(f"The adapter files in {layout.folder} hold no LoRA parameters; nothing to merge.")
    r = ranks.most_common(1)[0][0]
    rank_pattern = {re.escape(m): n for m, n in by_module.items() if n != r}
    return ShardAdapter(source, kind, r, rank_pattern, sorted(targets), layers, experts, layout)


def peft_config(shards: ShardAdapter, alpha, base_name: str | None, use_rslora: bool = False) -> dict:
    """adapter_config.json for the shards, as Megatron-Bridge's export writes it (``use_rslora``: ms-swift's
    --use_rslora, scale alpha / sqrt(r) as peft's)."""
    modules = sorted({n.removeprefix("base_model.model.").rsplit(".", 2)[0].rsplit(".", 1)[-1]
                      for n in shards.source.tensors if n.endswith("lora_A.weight")})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": shards.r,
        "lora_alpha": alpha,
        "rank_pattern": shards.rank_pattern,
        "alpha_pattern": {},
        "target_modules": shards.target_regex or modules,
        **({"target_parameters": shards.target_parameters} if shards.target_parameters else {}),
        "use_dora": shards.kind == "dora",
        "use_rslora": bool(use_rslora),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_name or "",
    }


def describe(folder: Path, tconfig: dict) -> dict:
    """Cheap (names, transformer_config.json, the pickle of one rank file; no tensor data): what inspect
    shows of a run's adapter shards: ``kind``, ``r``, ``targets``, ``tp``/``pp``/``ep``/``vpp`` and
    ``problem`` (the sentence that stops a merge, or None)."""
    info = {"kind": None, "r": None, "targets": [], "tp": None, "pp": None, "ep": None, "vpp": None, "problem": None}
    try:
        layout = shard_layout(folder, tconfig)
    except MergeError as err:
        info["problem"] = str(err)
        return info
    info.update(tp=layout.tp, pp=layout.pp, ep=layout.ep, vpp=layout.vpp)
    from tui_merger.core.io.torch_pickle import TorchFile

    path = layout.grid[min(layout.grid)]
    try:
        tf = TorchFile(path)
    except MergeError as err:
        info["problem"] = str(err)
        return info
    try:
        state = tf.obj.get("adapter_state_dict") if isinstance(tf.obj, dict) else None
        if not isinstance(state, dict):
            info["problem"] = f"{path} does not hold an adapter_state_dict; it is not a verl Megatron adapter file (copy it again)."
            return info
        keys = [k for k in state if isinstance(k, str)]
        targets, kind = set(), "lora"
        for key in keys:
            m = _LAYER.match(re.sub(r"^(?:model\d*\.|module\.)+", "", key))
            p = _PARAM.match(m.group(2)) if m else None
            if p is None:
                continue
            mod = p.group("mod")
            if re.match(r"^mlp\.experts\.linear_fc[12]$", mod):
                info["problem"] = grouped_refusal(folder, key)
            if p.group("sub"):  # CanonicalLoRA's targets: one per projection
                targets.add(_CANONICAL[p.group("sub")])
                kind = "canonical"
            else:
                targets.add("experts" if ".experts." in mod else ("shared_experts" if "shared_experts" in mod else mod.rsplit(".", 1)[-1]))
            if p.group("what") == "weight_magnitude" and kind == "lora":
                kind = "dora"
            if p.group("what") == "linear_in.weight" and info["r"] is None and hasattr(state[key], "shape"):
                rows = state[key].shape[0]
                # linear_in of a row-parallel layer holds the whole rank; of the others, its TP share
                info["r"] = rows if mod.rsplit(".", 1)[-1] in _ROW_PARALLEL else rows * layout.tp
        info.update(kind=kind, targets=sorted(targets))
    finally:
        tf.close()
    if layout.vpp and layout.vpp > 1 and info["problem"] is None:
        info["problem"] = vpp_refusal(layout.vpp)
    return info


# -- Megatron-Bridge's own PEFT checkpoints: an adapter-only dist checkpoint ------------------------------

_STACKED = re.compile(r"^decoder\.layers\.(?P<rest>.+\.adapter\..+)$")
# ms-swift (mcore_bridge tuners/lora.py LoraParallelLinear, peft's LoRA on megatron-core modules):
# ``{module}.lora_A.{adapter}.weight`` / ``lora_B``, the pair Megatron-Bridge calls linear_in / linear_out
_SWIFT = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
SWIFT_ADAPTER = "default"  # the adapter ms-swift trains (prepare_adapter); others (ref_adapter) are frozen copies
# LoRA on MoE experts: megatron-core saves SequentialMLP's and TEGroupedMLP's experts alike as
# ``mlp.experts.experts.linear_fc{1,2}`` with the global expert as an extra axis after the layer's (Megatron-Bridge's
# adapters on SequentialMLP experts; ms-swift's grouped lora_A/B, TEGroupedLinear with expert TP 1, the only one
# ms-swift allows: rows whole, fc1's lora_B [gate; up] as gpt_bridge stacks them)
_SEQ_EXPERTS = re.compile(r"^mlp\.experts\.experts\.(?P<fc>linear_fc[12])\.(?P<param>adapter\..+)$")


def is_adapter_key(key: str) -> bool:
    """A tensor of a PEFT dist checkpoint: Megatron-Bridge's ``*.adapter.*``, ms-swift's ``*.lora_A/B.*`` (and its
    ``*.modules_to_save.*``, which is refused when read)."""
    return (".adapter." in key or ".lora_A." in key or ".lora_B." in key or ".modules_to_save." in key) and "_extra_state" not in key


def _swift_name(key: str, dist_dir: Path) -> str | None:
    """ms-swift's name of a LoRA tensor as Megatron-Bridge's (None: another adapter than the trained one)."""
    m = _SWIFT.match(key)
    if m is None:
        raise MergeError(
            f"{dist_dir} holds {key}, which is not a LoRA A or B matrix tui-merger knows; nothing was written."
        )
    if m.group("adapter") != SWIFT_ADAPTER:
        return None
    return f"{m.group('mod')}.adapter.{'linear_in' if m.group('ab') == 'A' else 'linear_out'}.weight"


def read_dist_adapter(dist_dir: Path, hf_config: dict, config_dir: Path | None = None) -> ShardAdapter:
    """The adapter of a PEFT dist checkpoint under Hugging Face names: Megatron-Bridge's PEFT iteration (its
    trainer saves only the ``*.adapter.*`` entries of the model's sharded state dict: training/checkpointing.py
    apply_peft_adapter_filter_to_state_dict) or ms-swift's Megatron LoRA iteration (``*.lora_A/B.default.*``:
    swift/megatron/utils/megatron_lm_utils.py _filter_adapter_state_dict). megatron-core stores the layers
    stacked (``decoder.layers.X`` with the layer as dim 0; SequentialMLP experts as
    ``mlp.experts.experts.X`` with the global expert as dim 1) and joined across tensor-parallel ranks, so
    each layer's tensor is one piece; the naming is the shards' (``_name``)."""
    import torch

    from tui_merger.core.io.dcp import DcpStore

    store = DcpStore(Path(dist_dir), lambda k: not (is_adapter_key(k) or _vl_vision_key(k)),
                     lambda k: re.sub(r"^(?:model\d*\.|module\.)+", "", k))
    other_adapters: set[str] = set()
    vision: dict[str, dict] = {}  # a VL run's vision-tower LoRA pairs: module -> {linear_in / linear_out: tensor}
    vl = False
    try:
        globals_: dict[str, _Global] = {}
        layers = experts = 0
        for key, entry in sorted(store.tensors.items()):
            if _vl_vision_key(key):  # Megatron VL LoRA run (issue 39): the vision tower's pairs, read whole
                full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
                store.read_region(key, (), None, full)
                vision.setdefault(_vl_vision_module(key, dist_dir), {})[key.rsplit(".", 2)[-2]] = full
                continue
            if ".modules_to_save." in key:
                raise MergeError(
                    f"{dist_dir} holds {key}, a whole module trained beside the LoRA (modules_to_save), which "
                    "tui-merger does not merge from a Megatron checkpoint yet; nothing was written."
                )
            name = key
            swift = ".adapter." not in key
            if swift:
                name = _swift_name(key, dist_dir)
                if name is None:
                    other_adapters.add(_SWIFT.match(key).group("adapter"))
                    continue
            if name.startswith(_VL_LANGUAGE):  # a VL model's language model (issue 39)
                vl = True
                name = name[len(_VL_LANGUAGE):]
            m = _STACKED.match(name)
            if m is None or re.match(r"^\d+\.", m.group("rest")):
                raise MergeError(
                    f"{dist_dir} holds {key}, an adapter outside megatron-core's stacked decoder layers, which tui-merger "
                    "does not know how to merge; nothing was written."
                )
            rest = m.group("rest")
            seq = _SEQ_EXPERTS.match(rest)
            if ".mlp.experts." in f".{rest}" and seq is None:
                raise MergeError(
                    f"{dist_dir} holds adapters on grouped MoE experts ({key}), whose layout tui-merger does not read "
                    "yet (it reads LoRA on experts saved as megatron-core's mlp.experts.experts.*); export the adapter as a Hugging "
                    "Face PEFT adapter with the framework and merge it with --adapter and --base."
                )
            full = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
            store.read_region(key, (), None, full)
            if re.search(r"\.adapter\.adapter_(?:gate|up)\.linear_out\.weight$", name):
                full = _unswiglu(full, entry)
            if swift and re.search(r"(?:^|\.)linear_fc1\.adapter\.linear_out\.weight$", name):
                full = _swift_fc1(full, entry)
            layers = max(layers, full.shape[0])
            for i in range(full.shape[0]):
                if seq is None:
                    name = f"decoder.layers.{i}.{rest}"
                    globals_[name] = _Global(name, [full[i]], None)
                    continue
                experts = max(experts, full.shape[1])
                for e in range(full.shape[1]):
                    name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{seq.group('fc')}.{seq.group('param')}"
                    globals_[name] = _Global(name, [full[i, e]], None)
        if not globals_:
            raise MergeError(f"{dist_dir} holds no LoRA parameters (no *.adapter.* or *.lora_A/B.* entries); nothing to merge.")
    finally:
        store.close()
    want = _cfg(hf_config, "num_hidden_layers")
    if isinstance(want, int) and want != layers:
        raise MergeError(
            f"The adapters in {dist_dir} cover {layers} layers but the model's config has {want}; the adapter and the "
            "config come from different models: pass --base with the model the run started from."
        )
    said = _cfg(hf_config, "num_experts") or _cfg(hf_config, "num_local_experts")
    if experts and said != experts:
        raise MergeError(
            f"The adapters in {dist_dir} cover {experts} experts but the model's config has "
            f"{said if said else 'no experts'}; the adapter and "
            "the config come from different models: pass --base with the model the run started from."
        )
    layout = ShardLayout(Path(dist_dir), {}, 1, 1, 1, None, {})
    source = ShardSource(Path(dist_dir), [METADATA_FILE] + sorted(store.data_files))
    if vl or vision:
        shards = _vl_adapter(dist_dir, hf_config, config_dir, layout, source, globals_, layers, experts, vision)
    else:
        shards = _name(layout, hf_config, source, globals_, layers, experts)
    if other_adapters:
        shards.notices.append(
            f"{dist_dir} also holds the adapter(s) {', '.join(sorted(other_adapters))} (ms-swift's frozen reference "
            f"adapters); only the trained one, {SWIFT_ADAPTER}, is merged."
        )
    return shards


METADATA_FILE = ".metadata"


# -- LoRA runs of Megatron VL models (issue 39) -------------------------------------------------------------------
# Megatron-Bridge's VL models keep the language model under ``language_model.`` (its adapters as any text model's)
# and embed transformers' vision module under ``vision_model.`` / ``visual.``; Bridge's LoRA wraps every module its
# targets name, so the vision tower's own nn.Linear layers named ``linear_fc1`` / ``linear_fc2`` (Qwen3-VL's blocks,
# merger and deepstack mergers) get a ``LinearAdapter``: ``{module}.linear_in.weight`` [r, in] and
# ``{module}.linear_out.weight`` [out, r], whole on every rank, scaled alpha / dim like the others.
_VL_LANGUAGE = "language_model."
_VL_VISION = ("vision_model.", "visual.")
_VL_PAIR = re.compile(r"^(?:vision_model|visual)\.(?P<mod>.+)\.(?:linear_in|linear_out)\.weight$")


def _vl_vision_key(key: str) -> bool:
    return key.startswith(_VL_VISION) and "_extra_state" not in key


def _vl_vision_module(key: str, dist_dir) -> str:
    m = _VL_PAIR.match(key)
    if m is None:
        raise MergeError(
            f"{dist_dir} holds {key}, a vision-tower tensor that is not a LoRA pair (linear_in / linear_out), which "
            "tui-merger does not merge from a Megatron checkpoint; nothing was written."
        )
    return m.group("mod")


def _vl_adapter(dist_dir, hf_config, config_dir, layout, source, globals_, layers, experts, vision) -> ShardAdapter:
    """The adapter of a VL model's LoRA run: the language model's as a text model's, under the language model's
    ``save_pretrained`` names, and the vision tower's pairs under the vision module's (megatron_vl.lora_names)."""
    from tui_merger.core.formats.megatron_vl import lora_names

    if config_dir is None:
        raise MergeError(f"{dist_dir} holds a vision-language model's LoRA run; pass --base with its Hugging Face model.")
    lm_layers, vision_names, renames = lora_names(Path(config_dir), sorted(vision))
    packed = _vl_packed_experts(dist_dir, Path(config_dir), lm_layers, globals_, source)
    shards = _name(layout, hf_config, source, globals_, layers, experts, prefix="base_model.model." + lm_layers)
    if packed:
        shards.target_parameters = packed
        shards.targets = sorted(set(shards.targets) | {"experts"})
    for mod, pair in sorted(vision.items()):
        if set(pair) != {"linear_in", "linear_out"}:
            raise MergeError(
                f"{dist_dir} holds only half of the LoRA pair of the vision tower's {mod} (linear_in or linear_out is "
                "missing); the files are incomplete: copy them again."
            )
        A, B = pair["linear_in"], pair["linear_out"]
        if A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0]:
            raise MergeError(f"The vision tower's {mod}: linear_in {list(A.shape)} and linear_out {list(B.shape)} do not "
                             "make a LoRA pair; the adapter files are damaged.")
        full = "base_model.model." + vision_names[mod]
        source.add(f"{full}.lora_A.weight", (_Global(mod + ".linear_in.weight", [A], None), None))
        source.add(f"{full}.lora_B.weight", (_Global(mod + ".linear_out.weight", [B], None), None))
        if A.shape[0] != shards.r:
            shards.rank_pattern[re.escape(vision_names[mod])] = A.shape[0]
    # peft matches a list of target names anywhere (Qwen2.5-VL's vision MLP is gate/up/down_proj too): the adapted
    # modules as one regex, the language model's by their place in a layer (model.layers. on disk,
    # model.language_model.layers. in transformers 5's model), the vision tower's by their name under it
    lm = sorted({n[len("base_model.model." + lm_layers):].split(".", 1)[1].rsplit(".", 2)[0]
                 for n in source.tensors if n.startswith("base_model.model." + lm_layers) and n.endswith(".lora_A.weight")
                 and not re.search(r"\.mlp\.experts\.(?:base_layer\.)*lora_A\.weight$", n)})  # packed: parameters
    tower = sorted(vision_names[m][: -len(m) - 1].rsplit(".", 1)[-1] + "." + m for m in vision)  # visual.blocks.0...
    shards.target_regex = "|".join(
        ([r"(?:.*\.)?layers\.\d+\.(?:" + "|".join(map(re.escape, lm)) + ")"] if lm else [])
        + [r"(?:.*\.)?" + re.escape(t) for t in tower])
    shards.renames = renames
    if vision:
        shards.targets = sorted(set(shards.targets) | {"vision tower"})
        shards.notices.append(
            f"The run also trained LoRA on {len(vision)} linear layers of the vision tower ({', '.join(sorted(vision)[:3])}"
            f"{', ...' if len(vision) > 3 else ''}: Megatron-Bridge's targets name them too); they are merged as well."
        )
    return shards


_VL_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.adapter\."
                        r"(linear_in|linear_out)\.weight$")


def _vl_packed_experts(dist_dir, config_dir, lm_layers, globals_, source) -> list[str]:
    """A VL MoE model whose experts transformers keeps packed (Qwen3-VL-MoE: ``mlp.experts.gate_up_proj``
    [experts, 2 * ffn, hidden], gate rows first, ``down_proj`` [experts, hidden, ffn]): the experts' LoRA pairs
    (megatron-core's per-expert ``linear_fc1`` = [gate; up] and ``linear_fc2``) leave ``globals_`` and become peft's
    ``target_parameters`` LoRA on those parameters: lora_A [experts * r, in] (expert e's rows e * r ...), lora_B
    [out, r * experts] (expert e's column j at j * experts + e), nested in the module's parameter order. Returns the
    target_parameters ([] when the run has no expert adapters or the base keeps its experts one module each)."""
    import torch

    from tui_merger.core.formats.megatron_vl import packed_experts

    pairs: dict[tuple[int, str], dict[int, dict[str, object]]] = {}
    for name in list(globals_):
        m = _VL_EXPERT.match(name)
        if m:
            pairs.setdefault((int(m.group(1)), m.group(3)), {}).setdefault(int(m.group(2)), {})[m.group(4)] = name
    if not pairs:
        return []
    modules = packed_experts(config_dir)
    if not modules:
        return []
    params = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
    targets: dict[str, int] = {}
    for (layer, fc), by_expert in sorted(pairs.items()):
        module = f"{lm_layers}{layer}.mlp.experts"
        order = modules.get(module)
        if order is None or params[fc] not in order:
            raise MergeError(
                f"{dist_dir} holds LoRA on layer {layer}'s experts, but transformers' model for "
                f"{Path(config_dir) / 'config.json'} has no packed {params[fc]} there; pass --base with the model the run "
                "was trained from."
            )
        n = len(by_expert)
        if sorted(by_expert) != list(range(n)) or any(set(p) != {"linear_in", "linear_out"} for p in by_expert.values()):
            raise MergeError(f"{dist_dir} holds an incomplete set of expert LoRA pairs on layer {layer}'s {fc}; the "
                             "files are damaged: copy them again.")
        A = [globals_.pop(by_expert[e]["linear_in"]).load() for e in range(n)]
        B = [globals_.pop(by_expert[e]["linear_out"]).load() for e in range(n)]
        a = torch.cat(A, 0)  # [experts * r, in]
        b = torch.stack(B, -1).reshape(B[0].shape[0], -1)  # [out, r * experts]: column j * experts + e
        depth = len(order) - 1 - order.index(params[fc])  # the first parameter innermost (peft's nesting)
        key = f"base_model.model.{module}.{'base_layer.' * depth}lora_"
        source.add(key + "A.weight", (_Global(f"layers.{layer}.mlp.experts.{fc}.linear_in (packed)", [a], None), None))
        source.add(key + "B.weight", (_Global(f"layers.{layer}.mlp.experts.{fc}.linear_out (packed)", [b], None), None))
        targets[f"mlp.experts.{params[fc]}"] = order.index(params[fc])
    return sorted(targets, key=targets.get)  # the module's parameter order, as peft nests them


def _unswiglu(full, entry):
    """CanonicalLoRA's gate and up ``linear_out``: Megatron-Bridge saves them through megatron-core's
    SwiGLU factory like fc1's (peft/utils.py: every adapter of a ``linear_fc1*`` layer), which stores each
    tensor-parallel rank's rows as two halves, all first halves before all second halves. The rows are put
    back in rank order: the pieces are the chunks the checkpoint records (2 per rank)."""
    import torch

    starts = sorted({c.offsets[1] for c in entry.chunks})
    if len(starts) <= 2:  # one rank: its halves are already in order
        return full
    bounds = starts + [full.shape[1]]
    blocks = [full[:, a:b] for a, b in zip(bounds, bounds[1:])]
    tp = len(blocks) // 2
    return torch.cat([blocks[i // 2 + (i % 2) * tp] for i in range(2 * tp)], 1)


def _swift_fc1(full, entry):
    """ms-swift's linear_fc1 ``lora_B``: a TEColumnParallelLinear whose rows on each tensor-parallel rank are
    [that rank's gate rows; its up rows] (mcore_bridge gpt_bridge.py splits ``stack([gate, up])`` on dim 1), and
    whose checkpoint joins the ranks' rows one rank after the other (ms-swift applies the SwiGLU factory to the
    base layer only). The rows are put back as [all gate rows; all up rows]: the ranks are the chunks the
    checkpoint records on the row axis."""
    import torch

    axis = len(entry.shape) - 2
    starts = sorted({c.offsets[axis] for c in entry.chunks})
    if len(starts) <= 1:
        return full
    bounds = starts + [full.shape[axis]]
    halves = [full.narrow(axis, a, b - a).chunk(2, axis) for a, b in zip(bounds, bounds[1:])]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], axis)


# -- ms-swift's Megatron LoRA (swift/megatron, its layers from mcore_bridge tuners/lora.py) ---------------

SWIFT_LORA = "lora"  # the tuner_type whose adapter-only iteration this module reads


def swift_peft(args: dict) -> tuple[dict, str | None]:
    """What ms-swift's args.json records of a LoRA run (MegatronTunerMixin: lora_rank, lora_alpha,
    use_rslora, target_modules), in the keys Megatron-Bridge's run_config uses (``dim``, ``alpha``), and the
    Megatron base checkpoint it loaded (``mcore_model``; None when it started from the Hugging Face model)."""

    def num(key):
        v = args.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    alpha = num("lora_alpha")  # ms-swift's own args.json holds a float (lora_alpha: 32.0): said as 32
    if isinstance(alpha, float) and alpha.is_integer():
        alpha = int(alpha)
    peft = {"_target_": "ms-swift LoRA", "dim": num("lora_rank"), "alpha": alpha,
            "use_rslora": args.get("use_rslora") is True, "target_modules": args.get("target_modules")}
    base = args.get("mcore_model")
    return peft, base if isinstance(base, str) and base.strip() else None


def check_swift_tuner(folder: Path, info) -> None:
    """One sentence for an ms-swift PEFT run whose Megatron iteration tui-merger cannot merge."""
    tuner = info.lora.removeprefix("an ms-swift ").removesuffix(" run")
    if tuner == SWIFT_LORA:
        return
    if tuner == "lora_llm":  # LoRA on the language model, the vision tower trained whole: saved merged only
        raise MergeError(
            f"{folder} is an ms-swift lora_llm run, whose Megatron iteration holds no weights (ms-swift saves such a "
            "run only merged, in Hugging Face format, in the checkpoint-N-merged folder beside it); merge or copy "
            "that folder instead."
        )
    raise MergeError(
        f"{folder} is {info.lora}: its dist checkpoint holds the adapters only, which tui-merger does not "
        "merge for this tuner_type (it reads ms-swift's lora); export the adapter in Hugging Face PEFT format and "
        "merge it with --adapter and --base."
    )
