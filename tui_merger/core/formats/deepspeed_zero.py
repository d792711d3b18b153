"""DeepSpeed ZeRO checkpoints: what HF Trainer (and LLaMA-Factory, axolotl, TRL... on top of it) leaves in
``checkpoint-N/`` when DeepSpeed shards the training, read without DeepSpeed.

Layout (DeepSpeed 0.19): ``checkpoint-N/latest`` names the tag folder (``global_stepN``) that holds
- ZeRO-1/2: ``mp_rank_00_model_states.pt`` (``module``: the 16-bit weights; ``param_shapes``: one ordered
  name -> shape dict per optimizer group; ``frozen_param_fragments``: frozen parameters, whole, 16-bit;
  ``shared_params``: ties such as ``lm_head.weight`` -> ``model.embed_tokens.weight``; ``buffer_names``) and
  per rank ``[bf16_|fp16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` whose ``single_partition_of_fp32_groups``
  are that rank's equal slice of each group's flat fp32 master vector: the ranks' slices concatenated hold the
  group's parameters back to back, in ``param_shapes`` order (``param_alignment_paddings`` after each when
  recorded), padded at the end; a parameter may straddle ranks.
- ZeRO-3: per rank ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (``module`` holds empty placeholders;
  frozen parameters are partitioned like the others) and the optimizer files, whose ``fp32_flat_groups``
  hold, for every parameter in ``param_shapes`` order (the groups' dicts flattened), that rank's
  ``ceil(numel / world)`` slice, the last rank's padded.
The 16-bit weights of a ZeRO-3 run are saved nowhere (unless stage3_gather_16bit_weights_on_model_save): the
fp32 master copies in the optimizer files are the model. The optimizer files pickle DeepSpeed classes
(``ZeroStageEnum``, ``LossScaler``, ``fragment_address``): the restricted unpickler turns them into inert
records; DeepSpeed is never imported.

Detect: a folder whose ``latest`` names a tag folder with ZeRO files (or the tag folder itself), from
names, small JSON files and model_states' pickle (read by a stub unpickler that builds no tensors). A
LoRA run's ``checkpoint-N`` holds the Trainer's own ``adapter_model.safetensors``: the PEFT adapter kind
takes it. Open: ``ZeroSource``, one output tensor at a time from views on the mmap'd files. Reference:
none (a conversion: the recompute compares every value with the shards).
"""

from __future__ import annotations

import math
import pickle
import re
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from shlex import quote

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.adapter import empty_adapter
from tui_merger.core.formats.base import ALL, TRAINER_STEP, Candidate, Format, Found, step_of
from tui_merger.core.formats.input_types import Inputs, paths_of
from tui_merger.core.io.files import TOKENIZER_MARKERS, FilePlan, config_dtype, plan_files, read_config
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
from tui_merger.core.io.sources import TensorRef, not_a_folder

LATEST = "latest"
Z3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
Z12_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# DeepSpeed's names (runtime/engine.py: _get_optimizer_ckpt_name, _get_expert_ckpt_name; runtime/pipe/module.py:
# ckpt_layer_path): expp_rank_E_mp_rank_MM_optim_states.pt, [layer_L_]expert_E_mp_rank_MM_model_states.pt,
# layer_LL[-model_MM...]-model_states.pt
EXPERT = re.compile(r"^(?:expp_rank_\d+_|(?:layer_\d+_)?expert_\d+_).*\.pt$")
PIPELINE = re.compile(r"^layer_\d+(?:-[\w]+)*-model_states\.pt$")
TAG_STEP = re.compile(r"^global_step(\d+)$")
MAX_PICKLE = 64 << 20
_LORA = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\b")


def _is_zero_name(name: str) -> bool:
    return bool(Z3_MODEL.match(name) or Z12_MODEL.match(name) or OPTIM.match(name))


def _listing(folder: Path) -> list[str]:
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def _read_tag(latest: Path) -> str:
    try:
        tag = latest.read_bytes()[:256].decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        tag = ""
    if not tag or "/" in tag or tag in (".", ".."):
        raise MergeError(f"{latest} does not name a tag folder (it should hold e.g. global_step100); point at the global_stepN folder itself.")
    return tag


@dataclass
class ZeroLayout:
    checkpoint: Path  # the folder the user named (checkpoint-N, or the tag folder itself)
    folder: Path  # the tag folder holding the rank files
    stage: int  # 3 by the file names, else 2 (1 or 2: the optimizer files say which)
    model_files: list[Path]  # ZeRO-3: one per rank; ZeRO-1/2: mp_rank_00_model_states.pt
    optim_files: list[Path]  # one per rank, in rank order
    notices: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.optim_files)

    @property
    def step(self) -> int | None:
        return step_of(self.folder.name, TAG_STEP)


def find_zero_checkpoint(path: Path) -> ZeroLayout:
    """A checkpoint-N folder (its ``latest`` names the tag), or the tag folder itself, resolved to its
    rank files; a sentence for every layout it does not read."""
    path = Path(path)
    if not path.is_dir():
        raise not_a_folder(path, "CHECKPOINT", "checkpoint")
    notices = []
    latest = path / LATEST
    if latest.is_file() and not any(_is_zero_name(n) for n in _listing(path)):
        tag = _read_tag(latest)
        folder = path / tag
        if not folder.is_dir():
            raise MergeError(
                f"{latest} names the tag {tag}, but {folder} does not exist; copy that folder too, or point at "
                "the global_stepN folder that is there."
            )
    elif any(_is_zero_name(n) for n in _listing(path)):
        folder = path
    else:
        tags = sorted((s, p) for p in _dirs(path) if (s := step_of(p.name, TAG_STEP)) is not None
                      and any(_is_zero_name(n) for n in _listing(p)))
        if (path / "latest_universal").is_file() or (path / "zero").is_dir():
            raise _universal(path)
        if not tags:
            raise MergeError(
                f"No DeepSpeed ZeRO files (*_model_states.pt and *_optim_states.pt) under {path}; point at a "
                "checkpoint-N folder (with its latest file) or at its global_stepN folder."
            )
        folder = tags[-1][1]
        notices.append(f"{path} has no latest file; using the newest tag, {folder.name}.")
    names = _listing(folder)
    if (folder / "zero").is_dir():  # a ZeRO checkpoint beside its universal copy is still read
        raise _universal(folder)
    if any(EXPERT.match(n) for n in names):
        raise MergeError(
            f"{folder} holds expert-parallel DeepSpeed files (expp_rank_* / *_expert_*), which tui-merger does "
            f"not read; {_CONSOLIDATE}"
        )
    if any(PIPELINE.match(n) for n in names):
        raise MergeError(
            f"{folder} holds pipeline-parallel DeepSpeed files (layer_NN-model_states.pt), which tui-merger does "
            f"not read; {_CONSOLIDATE}"
        )
    z3, z12, optim, prefixes, mp = {}, {}, {}, set(), set()
    for n in names:
        if m := Z3_MODEL.match(n):
            z3[int(m.group(1))] = folder / n
            mp.add(int(m.group(2)))
        elif m := Z12_MODEL.match(n):
            z12[int(m.group(1))] = folder / n
            mp.add(int(m.group(1)))
        elif m := OPTIM.match(n):
            optim[int(m.group(2))] = folder / n
            prefixes.add(m.group(1) or "")
            mp.add(int(m.group(3)))
    if mp - {0}:
        raise MergeError(
            f"{folder} holds tensor-parallel DeepSpeed files (mp_rank_01 and up), which tui-merger does not read; "
            f"{_CONSOLIDATE}"
        )
    if len(prefixes) > 1:
        raise MergeError(
            f"{folder} mixes optimizer files of different precisions ({', '.join(sorted(p or 'fp32 ' for p in prefixes))}); "
            "remove the files of the run that is not wanted."
        )
    if not optim:
        raise MergeError(
            f"{folder} has no optimizer files (*_optim_states.pt); under ZeRO the weights are kept in them: copy "
            "the whole checkpoint folder again."
        )
    world = max(optim) + 1
    missing = sorted(set(range(world)) - set(optim))
    if missing:
        prefix = next(iter(prefixes))
        shown = ", ".join(f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in missing[:3])
        raise MergeError(f"{folder} is missing {shown} of a {world}-rank checkpoint; copy the whole folder again.")
    if z3:
        absent = sorted(set(range(world)) - set(z3))
        if absent or len(z3) != world:
            which = ", ".join(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (absent or sorted(set(z3) - set(range(world))))[:3])
            raise MergeError(
                f"{folder} has {world} optimizer files but its model states do not match them ({which}); copy the "
                "whole folder again."
            )
        return ZeroLayout(path, folder, 3, [z3[r] for r in range(world)], [optim[r] for r in range(world)], notices)
    if 0 not in z12:
        raise MergeError(f"{folder} has no mp_rank_00_model_states.pt (nor zero_pp_rank_0_mp_rank_00_model_states.pt); copy the whole folder again.")
    return ZeroLayout(path, folder, 2, [z12[0]], [optim[r] for r in range(world)], notices)


_CONSOLIDATE = ("load it in DeepSpeed with the layout it was trained with and save the whole model "
                "(engine.save_16bit_model, or the Trainer's save_model), then use that folder.")


def _dirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


def _universal(folder: Path) -> MergeError:
    return MergeError(
        f"{folder} is a DeepSpeed universal checkpoint (made by ds_to_universal.py), which tui-merger does not "
        "read; merge the ZeRO checkpoint it was made from (the checkpoint-N folder with its global_stepN files)."
    )


# -- reading the files ------------------------------------------------------------------------------


def _int(value) -> int | None:
    """An int as pickled, or DeepSpeed's ZeroStageEnum(2) as a record of its constructor argument."""
    if type(value) is int:
        return value
    args = getattr(value, "args", None)
    if isinstance(args, tuple) and len(args) == 1 and type(args[0]) is int:
        return args[0]
    return None


def _shape(value) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and all(type(n) is int and n >= 0 for n in value):
        return tuple(value)
    return None


@dataclass
class _Param:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list  # 1-D tensor views whose concatenation is the tensor's values, in order
    kind: str  # "trainable", "frozen" or "buffer"
    where: tuple = ()  # independent coordinates for ``ZeroSource.load`` (see there)


def _cut(segments: list, start: int, length: int) -> list:
    """The views covering values [start, start + length) of the concatenation of 1-D ``segments``."""
    out, pos = [], 0
    for seg in segments:
        n = seg.numel()
        if length and start < pos + n:
            a = max(start - pos, 0)
            take = min(n - a, length)
            out.append(seg[a : a + take])
            start, length = start + take, length - take
        pos += n
        if not length:
            break
    if length:
        raise IndexError("past the end")
    return out


class ZeroSource:
    """A TensorSource over a ZeRO checkpoint: every parameter listed from the pickled metadata, loaded on
    demand from views on the mmap'd rank files. The merge reads a tensor through ``load_into`` /
    ``raw_ranges`` (pieces cut from the concatenated partitions by ``_cut``); ``load``, which the recompute
    uses, gathers it independently (ZeRO-1/2: the per-rank ``param_slice_mappings`` DeepSpeed records;
    ZeRO-3: the ranks' slices located by their own arithmetic)."""

    def __init__(self, layout: ZeroLayout) -> None:
        from tui_merger.core.io.torch_pickle import TorchFile

        self.layout = layout
        self.folder = layout.folder
        self.files: list = []
        self.entries: dict[str, _Param] = {}
        self.tensors: dict[str, TensorRef] = {}
        self.shared: dict[str, str] = {}
        self.stage = layout.stage
        self.ds_version = None
        self._released_in = None
        try:
            models = [self._open(TorchFile, p) for p in layout.model_files]
            optims = [self._open(TorchFile, p) for p in layout.optim_files]
            self._index(models, optims)
        except BaseException:
            self.close()
            raise

    def _open(self, cls, path: Path):
        tf = cls(path)
        self.files.append(tf)
        return tf

    # -- index -------------------------------------------------------------------------------------
    def _index(self, models, optims) -> None:
        import torch

        layout = self.layout
        states = []
        for tf in models:
            obj = tf.obj
            if not isinstance(obj, dict) or not isinstance(obj.get("param_shapes"), list) or "module" not in obj:
                raise MergeError(f"{tf.path} is not a DeepSpeed model states file (no module or param_shapes); copy it again.")
            states.append(obj)
        first = states[0]
        self.ds_version = first.get("ds_version") if isinstance(first.get("ds_version"), str) else None
        groups_key = "fp32_flat_groups" if layout.stage == 3 else "single_partition_of_fp32_groups"
        osds, groups = [], []
        for tf in optims:
            osd = tf.obj.get("optimizer_state_dict") if isinstance(tf.obj, dict) else None
            if isinstance(osd, dict) and "zero_stage" not in osd and layout.stage != 3 and groups_key in osd:
                # DeepSpeed's BF16_Optimizer (bf16 with ZeRO-1 and fp32 gradient accumulation) saves ZeRO-1's
                # partitions and slice mappings but records no stage (zero_to_fp32 refuses it for that)
                osd = {**osd, "zero_stage": 1}
            if not isinstance(osd, dict) or "zero_stage" not in osd:
                raise MergeError(f"{tf.path} is not a DeepSpeed ZeRO optimizer file (no zero_stage); copy it again.")
            stage = _int(osd["zero_stage"])
            if stage not in (1, 2, 3) or (stage == 3) != (layout.stage == 3):
                raise MergeError(
                    f"{tf.path} says ZeRO stage {stage} but the folder's model states are those of a "
                    f"{'ZeRO-3' if layout.stage == 3 else 'ZeRO-1/2'} run; the folder mixes two runs."
                )
            count = osd.get("partition_count")
            counts = [count] if type(count) is int else count if isinstance(count, list) else None
            if not counts or not all(type(c) is int for c in counts):
                raise MergeError(f"{tf.path} records no partition_count; the file is damaged.")
            if max(counts) != len(optims):
                raise MergeError(
                    f"{tf.path} says the run had {max(counts)} ranks (partition_count) but {layout.folder} holds "
                    f"{len(optims)} optimizer files; copy the missing rank files, or remove those of another run."
                )
            g = osd.get(groups_key)
            if not isinstance(g, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in g):
                raise MergeError(f"{tf.path} has no {groups_key} (the fp32 master weights); the file is damaged.")
            if any(t.dtype != torch.float32 for t in g):
                raise MergeError(f"{tf.path}: the master weights are not float32; tui-merger does not read this kind of ZeRO file.")
            osds.append(osd)
            groups.append(g)
        self.stage = _int(osds[0]["zero_stage"])
        if len({len(g) for g in groups}) != 1:
            raise MergeError(f"The optimizer files in {layout.folder} hold different numbers of parameter groups; the folder mixes two runs.")
        world = len(optims)
        shapes = []
        for group in first["param_shapes"]:
            if not isinstance(group, dict):
                raise MergeError(f"{models[0].path}: param_shapes is damaged.")
            shapes.append({str(k): _shape(v) for k, v in group.items()})
        if any(s is None for group in shapes for s in group.values()):
            raise MergeError(f"{models[0].path}: param_shapes holds something that is not a shape; the file is damaged.")
        if layout.stage == 3:
            self._index_zero3(shapes, groups, world, optims)
        else:
            self._index_zero12(shapes, groups, world, optims, osds)
        self._index_frozen(states, models, world)
        buffers = first.get("buffer_names") or []
        module = first["module"]
        for name in buffers:
            t = module.get(name) if isinstance(module, dict) and isinstance(name, str) else None
            if isinstance(t, torch.Tensor) and name not in self.entries:
                self._add(_Param(name, _dtype(t), tuple(t.shape), [t.reshape(-1)] if t.numel() else [], "buffer"))
        shared = first.get("shared_params") or {}
        if isinstance(shared, dict):
            for alias, target in shared.items():
                if isinstance(alias, str) and isinstance(target, str) and target in self.entries and alias not in self.entries:
                    self.shared[alias] = target
                    src = self.entries[target]
                    self._add(_Param(alias, src.dtype, src.shape, src.pieces, src.kind, src.where))
        for entry in self.entries.values():
            self.tensors[entry.name] = TensorRef(self, "", entry.name, entry.dtype, entry.shape)

    def _add(self, entry: _Param) -> None:
        if entry.name in self.entries:
            raise MergeError(f"{self.layout.folder}: {entry.name} is listed twice in the model states; the file is damaged.")
        self.entries[entry.name] = entry

    def _index_zero12(self, shapes, groups, world, optims, osds) -> None:
        if len(shapes) != len(groups[0]):
            raise MergeError(
                f"{self.layout.model_files[0]} lists {len(shapes)} parameter groups but the optimizer files hold "
                f"{len(groups[0])}; the folder mixes two runs."
            )
        paddings = osds[0].get("param_alignment_paddings")
        mappings = [o.get("param_slice_mappings") for o in osds]
        for g, group in enumerate(shapes):
            parts = [groups[r][g] for r in range(world)]
            # each rank's equal share of the group, saved without the padding its group_paddings records
            # (only the last rank's share is padded)
            padded = {p.numel() + _padding(o, g) for p, o in zip(parts, osds)}
            if len(padded) != 1:
                raise MergeError(
                    f"The ranks' partitions of parameter group {g} differ in size in {self.layout.folder}; the "
                    "rank files come from different runs."
                )
            total = sum(p.numel() for p in parts)
            pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
            if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)):
                raise MergeError(f"{optims[0].path}: param_alignment_paddings does not match param_shapes; the file is damaged.")
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                if offset + numel > total:
                    raise _short(self.layout.folder, name)
                where = ("mapped", g, tuple(m[g].get(name) if _mapping_ok(m, g) else None for m in mappings))
                self._add(_Param(name, "float32", shape, _cut(parts, offset, numel), "trainable", where))
                offset += numel + (int(pads[i]) if pads is not None else 0)
            align = 2 * world
            if math.ceil(offset / align) * align != math.ceil(total / align) * align:
                raise MergeError(
                    f"Parameter group {g} in {self.layout.folder} holds {total} values but its parameters take "
                    f"{offset}; the model states and the optimizer files come from different runs."
                )

    def _index_zero3(self, shapes, groups, world, optims) -> None:
        flat = {k: v for group in shapes for k, v in group.items()}
        per_rank = sum(t.numel() for t in groups[0])
        if any(sum(t.numel() for t in g) != per_rank for g in groups):
            raise MergeError(f"The ranks' fp32 partitions in {self.layout.folder} differ in size; the rank files come from different runs.")
        offset = 0
        for name, shape in flat.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > per_rank:
                raise _short(self.layout.folder, name)
            pieces = []
            for r in range(world):
                pieces += _cut(groups[r], offset, part)
            self._add(_Param(name, "float32", shape, _trim(pieces, numel), "trainable", ("ranks", offset)))
            offset += part
        if offset != per_rank:
            raise MergeError(
                f"The optimizer files in {self.layout.folder} hold {per_rank} values per rank but the parameters "
                f"take {offset}; the model states and the optimizer files come from different runs."
            )
        self._groups = groups

    def _index_frozen(self, states, models, world) -> None:
        import torch

        frozen = states[0].get("frozen_param_shapes") or {}
        if not isinstance(frozen, dict):
            return
        for name, shape in frozen.items():
            shape = _shape(shape)
            if not isinstance(name, str) or shape is None:
                raise MergeError(f"{models[0].path}: frozen_param_shapes is damaged.")
            numel = math.prod(shape)
            frags = []
            for r, state in enumerate(states):
                t = (state.get("frozen_param_fragments") or {}).get(name)
                if not isinstance(t, torch.Tensor):
                    raise MergeError(
                        f"{models[r].path} lists the frozen parameter {name} but holds no values for it; "
                        "the file is damaged."
                    )
                frags.append(t.reshape(-1))
            if self.layout.stage != 3:
                frags = frags[:1]  # ZeRO-1/2 keep frozen parameters whole on rank 0
            if sum(f.numel() for f in frags) < numel:
                raise _short(self.layout.folder, name)
            self._add(_Param(name, _dtype(frags[0]), shape, _trim(frags, numel), "frozen", ("frozen",)))

    # -- TensorSource interface -------------------------------------------------------------------
    def load_into(self, ref: TensorRef, out) -> None:
        """Copy each piece into its place in ``out`` (converting dtype on the way); pages handed back."""
        flat = out.view(-1)
        pos = 0
        for piece in self.entries[ref.name].pieces:
            n = piece.numel()
            flat[pos : pos + n].copy_(piece)
            pos += n
        self.release(ref)

    def raw_ranges(self, ref: TensorRef):
        """The pieces' bytes in their files, when each lies contiguously there (fp32 written as fp32)."""
        ranges = []
        for piece in self.entries[ref.name].pieces:
            place = self._place(piece)
            if place is None:
                return None
            tf, start = place
            ranges.append((tf.fileno(), start, piece.numel() * piece.element_size()))
        return [r for r in ranges if r[2]]

    def row_blocks(self, ref: TensorRef):
        """The tensor as consecutive blocks of whole rows (views on the files, a row that straddles two
        pieces copied), each piece's pages handed back once used: the merge never holds it whole."""
        entry = self.entries[ref.name]
        return _row_aligned(entry.pieces, entry.shape, self._release_piece)

    def check_blocks(self, ref: TensorRef):
        """The same rows gathered independently of ``row_blocks``' pieces (what the recompute compares
        the output with): ZeRO-1/2 from each rank's ``param_slice_mappings``, ZeRO-3 from each rank's
        slice located by ``_rank_slice``, frozen parameters and buffers as stored."""
        entry = self.entries[self.shared.get(ref.name, ref.name)]
        numel = math.prod(entry.shape)
        where = entry.where
        if where and where[0] == "mapped" and all(a is not None for a in where[2]):
            parts = []
            for r, address in enumerate(where[2]):
                count, start = _address(address)
                if count:
                    parts.append(self._rank_group(r, where[1])[start : start + count])
        elif where and where[0] == "ranks":
            size = -(-numel // self.layout.world_size)
            parts, left = [], numel
            for r in range(self.layout.world_size):
                piece = self._rank_slice(r, where[1], size)[: max(left, 0)]
                left -= piece.numel()
                if piece.numel():
                    parts.append(piece)
        else:
            parts = list(entry.pieces)
        if sum(p.numel() for p in parts) != numel:
            raise MergeError(f"{ref.name}: the rank files hold {sum(p.numel() for p in parts)} of its {numel} values; the checkpoint is incomplete.")
        return _row_aligned(parts, entry.shape, self._release_piece)

    def _release_piece(self, piece) -> None:
        place = self._place(piece)
        if place is not None:
            tf, start = place
            tf.release(start, start + piece.numel() * piece.element_size())
            # a file batches the ranges it hands back (up to 16 MiB): moving on to another rank's file,
            # the last one's batch goes back at once, or each of the world's files would keep one
            last, self._released_in = self._released_in, tf
            if last is not None and last is not tf:
                last.flush()

    def load(self, ref: TensorRef):
        """The whole tensor, gathered independently of the pieces the merge copies (see the class)."""
        import torch

        entry = self.entries[self.shared.get(ref.name, ref.name)]
        numel = math.prod(entry.shape)
        if entry.where and entry.where[0] == "mapped" and all(a is not None for a in entry.where[2]):
            parts = []
            for r, address in enumerate(entry.where[2]):
                count, start = _address(address)
                if count:
                    parts.append(self._rank_group(r, entry.where[1])[start : start + count])
            values = torch.cat(parts) if parts else torch.empty(0)
        elif entry.where and entry.where[0] == "ranks":
            size = -(-numel // self.layout.world_size)
            parts = [self._rank_slice(r, entry.where[1], size) for r in range(self.layout.world_size)]
            values = torch.cat(parts)[:numel]
        else:
            values = torch.cat(entry.pieces) if entry.pieces else torch.empty(0, dtype=getattr(torch, entry.dtype))
        if values.numel() != numel:
            raise MergeError(f"{ref.name}: the rank files hold {values.numel()} of its {numel} values; the checkpoint is incomplete.")
        return values.view(entry.shape)

    def _rank_group(self, rank: int, g: int):
        tf = self.files[len(self.layout.model_files) + rank]
        return tf.obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][g]

    def _rank_slice(self, rank: int, start: int, size: int):
        """Values [start, start + size) of a rank's fp32 groups laid end to end, found by the groups'
        starting offsets (bisect) rather than by walking them."""
        import torch

        groups = self._groups[rank]
        starts = list(accumulate((t.numel() for t in groups), initial=0))
        out, at, end = [], start, start + size
        while at < end:
            g = bisect_right(starts, at) - 1
            stop = min(end, starts[g + 1])
            out.append(groups[g][at - starts[g] : stop - starts[g]])
            at = stop
        return torch.cat(out) if len(out) > 1 else out[0]

    def _place(self, piece):
        for tf in self.files:
            start = tf.offset_of(piece) if piece.is_contiguous() else None
            if start is not None:
                return tf, start
        return None

    def release(self, ref: TensorRef) -> None:
        for piece in self.entries[ref.name].pieces:
            self._release_piece(piece)

    def close(self) -> None:
        for tf in self.files:
            tf.close()
        self.files = []


def _padding(osd: dict, g: int) -> int:
    pads = osd.get("group_paddings")
    pad = pads[g] if isinstance(pads, list) and g < len(pads) else 0
    return pad if type(pad) is int and pad >= 0 else 0


def _mapping_ok(m, g) -> bool:
    return isinstance(m, list) and g < len(m) and isinstance(m[g], dict)


def _address(address) -> tuple[int, int]:
    """DeepSpeed's fragment_address(numel, start) record: (numel, start)."""
    d = getattr(address, "__dict__", {})
    numel, start = d.get("numel"), d.get("start")
    if type(numel) is not int or type(start) is not int:
        raise MergeError("A param_slice_mappings entry of the optimizer files is damaged.")
    return numel, start


BLOCK_BYTES = 16 << 20  # the most a block of ``_row_aligned`` holds (at least one row)


def _row_aligned(pieces: list, shape: tuple, release) -> list:
    """[(block of whole rows of ``shape``, release)] from 1-D ``pieces`` laid end to end: each piece's
    whole rows as views of at most ``BLOCK_BYTES`` (each handing back its own pages with ``release``),
    a row cut between two pieces joined in a small copy. A piece is a rank's share, which grows with
    the model (a 3B embedding in 8 ranks: 155 MB of fp32); its blocks do not, so neither does what the
    merge and the recompute hold of a tensor at a time."""
    import torch

    if not shape:
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return [(flat.view(()), lambda: [release(p) for p in pieces])]
    row = math.prod(shape[1:])
    blocks, carry = [], None
    for piece in pieces:
        if row == 0:
            break
        if carry is not None:
            take = piece[: row - carry.numel()]
            carry = torch.cat([carry, take])
            if carry.numel() == row:
                blocks.append((carry.view(1, *shape[1:]), lambda take=take: release(take)))
                carry = None
            piece = piece[take.numel() :]
        whole = piece.numel() // row * row
        step = max(1, BLOCK_BYTES // max(1, row * piece.element_size())) * row
        # a piece holding no whole row still comes as an empty block: its pages are handed back in turn
        for k in range(0, max(whole, 1), step):
            part = piece[k : min(k + step, whole)]
            blocks.append((part.view(-1, *shape[1:]), lambda part=part: release(part)))
        if piece.numel() > whole:
            carry = piece[whole:].clone()
            release(piece[whole:])
    if carry is not None:
        raise MergeError("A tensor's pieces in the rank files do not end on a whole row; the checkpoint is damaged.")
    if row == 0 or not blocks:
        blocks.append((torch.empty((0, *shape[1:]), dtype=pieces[0].dtype if pieces else torch.float32), lambda: None))
    return blocks


def _trim(pieces: list, numel: int) -> list:
    """The leading ``numel`` values of ``pieces`` (ZeRO-3's last slice carries padding)."""
    out, left = [], numel
    for p in pieces:
        if not left:
            break
        take = min(left, p.numel())
        out.append(p[:take])
        left -= take
    return out


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _short(folder: Path, name: str) -> MergeError:
    return MergeError(
        f"The optimizer files in {folder} end before {name}; they are truncated or come from another run: "
        "copy the whole checkpoint folder again."
    )


# -- detection without torch ---------------------------------------------------------------------


class _Stub:
    """What every class in model_states' pickle becomes for detection (tensors, sizes, enums)."""

    def __init__(self, *args, **kwargs) -> None:
        self.args = args

    def __setstate__(self, state) -> None:
        self.state = state


class _Dict(dict):
    """An OrderedDict as pickled (a module's state dict also carries attributes: ``_metadata``)."""

    def __setstate__(self, state) -> None:
        pass


class _Peek(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if f"{module}.{name}" == "collections.OrderedDict":
            return _Dict
        if f"{module}.{name}" == "torch.Size":
            return lambda *a: tuple(a[0]) if a else ()
        if module.startswith(("torch", "deepspeed", "collections")):
            return _Stub
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return None


def peek_model_states(data: bytes) -> dict | None:
    """model_states' pickle as plain objects (tensors are stubs, nothing read from the file's data)."""
    import io

    from tui_merger.core.io.torch_pickle import _check_memo_indices

    try:
        _check_memo_indices(data)
        obj = _Peek(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - a damaged pickle: detection says it cannot tell
        return None
    return obj if isinstance(obj, dict) else None


def _tag_folder(folder: Path, names: dict) -> tuple[Path | None, str | None]:
    """(the tag folder, a problem) of a checkpoint-N folder, or of a tag folder itself."""
    if any(_is_zero_name(n) for n in names):
        return folder, None
    tags = sorted((n, name) for name in names if (n := step_of(name, TAG_STEP)) is not None
                  and any(_is_zero_name(x) for x in _listing(folder / name)))
    if LATEST not in names or not (folder / LATEST).is_file() or (folder / LATEST).is_symlink():
        # no latest file: the newest tag folder holding ZeRO files
        return (folder / tags[-1][1], None) if tags else (None, None)
    zero = bool(tags) or "zero_to_fp32.py" in names  # a latest file of some other tool is none of ours
    try:
        tag = _read_tag(folder / LATEST)
    except MergeError as err:
        return None, (str(err) if zero else None)
    tag_dir = folder / tag
    if not tag_dir.is_dir():
        return None, (f"latest names the tag {tag}, but {tag} is not there: the checkpoint cannot be read." if zero else None)
    if not any(_is_zero_name(n) for n in _listing(tag_dir)) and not (tag_dir / "zero").is_dir():
        return None, None
    return tag_dir, None


def zero_files_note(folder: Path, names: dict) -> str | None:
    """What inspect says of a PEFT adapter folder with DeepSpeed ZeRO files beside it (a LoRA run's
    checkpoint-N under DeepSpeed), or None."""
    tag_dir, _ = _tag_folder(folder, names)
    if tag_dir is None or tag_dir == folder:
        return None
    return (f"DeepSpeed ZeRO files beside it ({tag_dir.name}/) hold this run's optimizer state; the adapter the "
            "Trainer saved (adapter_model.safetensors) is what the merge takes.")


class DeepSpeedZeroFormat(Format):
    """Detect: ``latest`` naming a tag folder with ZeRO rank files (or that folder itself), except where the
    Trainer saved a PEFT adapter beside them (that adapter is what the merge takes). Open: ``ZeroSource``.
    Reference: None (a conversion)."""

    kind = "deepspeed-zero"
    role = "checkpoint"
    backend = "deepspeed"
    label = "a DeepSpeed ZeRO checkpoint"
    short = "a DeepSpeed ZeRO one"

    def detect(self, s, folder: Path, names: dict) -> Found | None:
        if "adapter_config.json" in names:
            return None  # a LoRA run's checkpoint-N: the Trainer's adapter file is what the merge takes
        tag_dir, problem = _tag_folder(folder, names)
        if tag_dir is None and problem is None:
            return None
        own = tag_dir == folder
        ckpt = folder.parent if own and (folder.parent / LATEST).is_file() else folder
        step = step_of(ckpt.name, TRAINER_STEP)
        c = Candidate(self.kind, str(folder), step=step, run=str(ckpt.parent) if step is not None and not own else None)
        if problem is not None:
            c.notes.append(problem)
            s.sized(c, names.values(), recursive=True)
            return Found(c, ALL)
        tag_names = names if own else s.names(tag_dir)
        if step is None:
            c.step = step_of(tag_dir.name, TAG_STEP)
        self._describe(s, c, ckpt, tag_dir, tag_names, names if not own else s.names(ckpt))
        s.sized(c, names.values(), recursive=True)
        if c.notes and c.notes[-1].startswith("optimizer state present: "):  # under ZeRO they are the weights
            size = c.notes.pop().removeprefix("optimizer state present: ").rstrip(".")
            c.notes.append(f"optimizer files: {size}, the fp32 master weights and Adam's moments (not only resume state).")
        return Found(c, ALL)

    def _describe(self, s, c: Candidate, ckpt: Path, tag_dir: Path, tag_names: dict, ckpt_names: dict) -> None:
        z3 = sorted(n for n in tag_names if Z3_MODEL.match(n))
        optim = sorted(n for n in tag_names if OPTIM.match(n))
        if "zero" in tag_names:
            c.notes.append("a DeepSpeed universal checkpoint (ds_to_universal.py), which tui-merger does not read: merge the ZeRO checkpoint it was made from.")
        if any(EXPERT.match(n) for n in tag_names):
            c.notes.append("expert-parallel files (expp_rank_*): tui-merger does not read this layout yet.")
        stage = 3 if z3 else 2
        model_file = z3[0] if z3 else "mp_rank_00_model_states.pt"
        states = None
        if model_file in tag_names:
            data = s.pickled_keys(tag_dir / model_file)
            states = peek_model_states(data) if data is not None else None
        ds_config = states.get("ds_config") if states and isinstance(states.get("ds_config"), dict) else {}
        zero = ds_config.get("zero_optimization") if isinstance(ds_config.get("zero_optimization"), dict) else {}
        said_stage = zero.get("stage")
        if stage == 2 and said_stage in (1, 2):
            stage = said_stage
        c.backend = f"zero{stage}" if stage != 2 or said_stage == 2 else "zero1/2"
        ranks = {int(OPTIM.match(n).group(2)) for n in optim}
        world = states.get("dp_world_size") if states else None
        c.world_size = world if type(world) is int and world > 0 else (max(ranks) + 1 if ranks else None)
        if ranks and c.world_size and sorted(ranks) != list(range(c.world_size)):
            missing = sorted(set(range(c.world_size)) - ranks)
            c.notes.append(f"optimizer file(s) of rank {', '.join(map(str, missing[:5]))} of {c.world_size} are missing: the checkpoint is incomplete.")
        if not optim:
            c.notes.append("no optimizer files (*_optim_states.pt): under ZeRO the weights are kept in them, so this checkpoint cannot be merged.")
        training = ("bf16" if any(n.startswith("bf16_") for n in optim) or _enabled(ds_config, "bf16")
                    else "fp16" if any(n.startswith("fp16_") for n in optim) or _enabled(ds_config, "fp16") else "fp32")
        config = s.json(ckpt / "config.json") if "config.json" in ckpt_names else None
        c.dtype = config_dtype(config) or {"bf16": "bfloat16", "fp16": "float16"}.get(training, "float32")
        c.tokenizer = any(m in ckpt_names for m in TOKENIZER_MARKERS)
        version = f", deepspeed {states['ds_version']}" if states and isinstance(states.get("ds_version"), str) else ""
        c.notes.append(
            f"DeepSpeed ZeRO-{stage if c.backend != 'zero1/2' else '1/2'}, {c.world_size} ranks, {training} training{version}: "
            "the weights are the fp32 master copies in the optimizer files; the merge writes them as a model."
        )
        state = s.json(ckpt / "trainer_state.json") if "trainer_state.json" in ckpt_names else None
        tag_step = step_of(tag_dir.name, TAG_STEP)
        said = (f"{LATEST} names {tag_dir.name}" if tag_dir != ckpt and LATEST in ckpt_names
                else f"no {LATEST} file: {tag_dir.name}, the newest tag" if tag_dir != ckpt else f"tag {tag_dir.name}")
        step = state.get("global_step") if state is not None else None
        if type(step) is int:
            said += f"; trainer_state.json: global_step {step}"
        steps = {n for n in (c.step, tag_step, step if type(step) is int else None) if n is not None}
        c.notes.append(f"step {c.step}: {said}." if len(steps) <= 1 else
                       f"the steps disagree: the folder says {c.step}, {said}; the weights are those of {tag_dir.name}.")
        if state is not None:
            best = state.get("best_model_checkpoint")
            if isinstance(best, str) and best:
                c.notes.append(f"trainer_state.json marks {best} as the best checkpoint.")
        if states:
            frozen = states.get("frozen_param_shapes")
            if isinstance(frozen, dict) and frozen:
                c.notes.append(f"{len(frozen)} frozen parameter(s), kept in 16-bit only: written as stored.")
            names = [n for g in states.get("param_shapes") or [] if isinstance(g, dict) for n in g]
            if any(_LORA.search(str(n)) for n in names):
                c.notes.append("the DeepSpeed files hold LoRA weights but no adapter_config.json is beside them: the merge cannot tell the LoRA settings.")
        weights = s.weight_files(ckpt, ckpt_names) if "config.json" in ckpt_names else []
        if weights and all(w in ckpt_names for w in weights):
            saved, _ = s.headers_dtype(ckpt, weights)
            if saved == "float32":
                c.notes.append(
                    f"{', '.join(weights)} beside it is the model the Trainer saved, in float32, usable as it is; "
                    "the fp32 master weights in the optimizer files are the same values."
                )
            else:
                c.notes.append(
                    f"{', '.join(weights)} beside it is the {saved or '16-bit'} model the Trainer saved, usable as it is (a model, "
                    "not only a checkpoint); the fp32 master weights are there too: --dtype fp32 writes them, as zero_to_fp32 does."
                )
        elif stage == 3:
            c.notes.append("no 16-bit copy of the weights was saved (stage3_gather_16bit_weights_on_model_save was off).")
        else:
            c.notes.append("no copy of the weights was saved beside the DeepSpeed files: the fp32 masters are the only one.")
        if "config.json" not in ckpt_names:
            c.needs_base = True
            c.notes.append("no config.json: the merge needs --base with the model the run started from (for its config and tokenizer).")
        elif not c.tokenizer:
            c.notes.append("no tokenizer saved with it: pass --base with the model the run started from to copy its tokenizer.")

    def recognizes(self, path: Path) -> bool:
        path = Path(path)
        if not path.is_dir() or (path / "adapter_config.json").is_file():
            return False
        names = {n: None for n in _listing(path)}
        tag_dir, problem = _tag_folder(path, names)
        return tag_dir is not None or problem is not None

    def locate(self, path: Path):
        return find_zero_checkpoint(path)

    def why_not_mergeable(self, c: Candidate) -> str | None:
        for note in c.notes:
            if any(w in note for w in ("cannot be read", "cannot be merged", "does not read", "cannot tell", "incomplete")):
                return f"This DeepSpeed checkpoint cannot be merged: {note}"
        return None

    def needs_base(self, c: Candidate) -> bool:
        return bool(c.needs_base)

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        problem = self.why_not_mergeable(c)
        if problem:
            return problem
        base = f" --base {base_arg}" if c.needs_base else ""
        masters = " --dtype fp32" if any("--dtype fp32 writes them" in n for n in c.notes) else ""
        return f"tui-merger merge {quote(path)}{base}{masters} --out {quote(out)}"

    def open(self, options) -> Inputs:
        return _open(options)

    def reference(self, inputs, options, tmp: Path):
        return None  # a conversion: the recompute compared every value with the shards


def _enabled(ds_config: dict, key: str) -> bool:
    section = ds_config.get(key)
    return isinstance(section, dict) and section.get("enabled") in (True, "auto")


def _open(options) -> Inputs:
    layout = find_zero_checkpoint(options.checkpoint)
    ckpt = layout.folder.parent if layout.checkpoint == layout.folder and (layout.folder.parent / LATEST).is_file() else layout.checkpoint
    source = ZeroSource(layout)
    inputs = Inputs(None, empty_adapter(layout.folder), {}, FilePlan(), paths_of(options), closers=[source])
    inputs.notices = list(layout.notices)
    try:
        lora = [n for n in source.tensors if _LORA.search(n)]
        if lora:
            beside = " (the adapter_model.safetensors the Trainer saved beside it)" if (ckpt / "adapter_model.safetensors").is_file() else ""
            raise MergeError(
                f"{layout.folder} holds LoRA weights ({lora[0]}, ...) without their adapter_config.json; merge the "
                f"PEFT adapter folder of this run{beside} into its base with --base MODEL --adapter FOLDER."
            )
        has_config = (ckpt / "config.json").is_file()
        config_dir = ckpt if has_config else options.base
        if config_dir is None:
            raise MergeError(
                f"{ckpt} has no config.json; pass --base with the model the run started from (its config and "
                "tokenizer are used)."
            )
        inputs.config = read_config(config_dir)
        names = dict.fromkeys(source.tensors)
        tie = bool(inputs.config.get("tie_word_embeddings"))
        for alias in source.shared:
            if tie:
                del names[alias]  # save_pretrained writes a tied weight once
        renames, converted = _disk_names(config_dir, names, source)
        from tui_merger.core.io.sources import RenamedSource

        inputs.base = RenamedSource(source, {renames.get(n, n): n for n in names if n not in converted})
        if converted:
            from tui_merger.core.formats.hf_names import ConvertedSource

            conv = ConvertedSource({n: source.tensors[n] for n in converted}, converted.layout)
            inputs.base.tensors.update(conv.tensors)
            inputs.closers.append(conv)
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        saved = _saved_copy(ckpt)
        if saved is not None and saved[1] in ("bfloat16", "float16") and (options.dtype or inputs.dtype) != "float32":
            inputs.notices.append(
                f"{ckpt} also holds the {saved[1]} model the Trainer saved ({saved[0]}); this merge writes the fp32 "
                "master weights rounded once, as that copy was; --dtype fp32 keeps them in full."
            )
        tok_dir = ckpt if any((ckpt / m).is_file() for m in TOKENIZER_MARKERS) or options.base is None else options.base
        base_dir = options.base if options.base is not None else ckpt
        inputs.files = plan_files(base_dir, tok_dir if tok_dir != base_dir else ckpt, inputs.config, options.tokenizer_from)
        gen = ckpt / "generation_config.json"
        if gen.is_file():  # the trained model's own generation config first
            inputs.files.copies = [(gen, n) if n == "generation_config.json" else (src, n) for src, n in inputs.files.copies]
            if all(n != "generation_config.json" for _, n in inputs.files.copies):
                inputs.files.copies.append((gen, "generation_config.json"))
        inputs.notices += inputs.files.notices
        inputs.read_files = (
            list(layout.model_files) + list(layout.optim_files) + [config_dir / "config.json"]
            + [src for src, _ in inputs.files.copies]
        )
    except BaseException:
        inputs.close()
        raise
    return inputs


def _saved_copy(ckpt: Path) -> tuple[str, str | None] | None:
    """(file, dtype) of the model the Trainer saved beside the DeepSpeed files, from its header; None if none."""
    from tui_merger.core.formats.base import dominant_dtype
    from tui_merger.core.io.safetensors_io import SafetensorsFile

    if (ckpt / "model.safetensors.index.json").is_file():
        return "model.safetensors.index.json", None
    if not (ckpt / "model.safetensors").is_file():
        return None
    try:
        st = SafetensorsFile(ckpt / "model.safetensors")
    except MergeError:
        return "model.safetensors", None
    try:
        return "model.safetensors", dominant_dtype(list(st.tensors.values()))
    finally:
        st.close()


def _disk_names(config_dir: Path, names: dict, source: ZeroSource):
    """(renames, converted) by transformers' own save layout, where the in-memory names differ from what
    save_pretrained writes (a vision-language model's ``model.language_model.*``, packed MoE experts);
    the usual case imports nothing."""
    if not any(".language_model." in n or n.startswith("model.visual.") or not n.endswith((".weight", ".bias"))
               for n in names):
        return {}, {}
    from tui_merger.core.formats.hf_names import disk_layout

    found = disk_layout(config_dir)
    if found is None or not (found.renames or found.groups):
        return {}, {}

    class _Converted(dict):
        layout = found

    converted = _Converted((n, None) for n in names if n in found.groups)
    return found.renames, converted
