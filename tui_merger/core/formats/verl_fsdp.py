"""verl FSDP checkpoints: find the rank files, read them safely, reassemble full tensors one at a time.

Layout (verl): ``<run>/latest_checkpointed_iteration.txt``, ``<run>/global_step_N/{actor,critic}/``
(the SFT trainer writes straight into ``global_step_N/``) holding ``model_world_size_W_rank_R.pt``,
``optim_...``, ``extra_state_...``, ``fsdp_config.json``, ``huggingface/`` and, for LoRA runs,
``lora_train_meta.json`` or ``lora_adapter/adapter_config.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.adapter import (adapter_from_source, check_adapter_config, chosen_alpha, empty_adapter,
                                             export_peft_adapter, lora_train_meta_path, read_lora_train_meta, renamed)
from tui_merger.core.formats.base import ALL, STEP_DIR, Candidate, Format, Found, Reference, lora_info, step_of
from tui_merger.core.formats.input_types import Inputs, _value_model, paths_of
from tui_merger.core.io.files import TOKENIZER_MARKERS, FilePlan, architecture, config_dtype, is_vision_language, plan_files, read_config
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
from tui_merger.core.options import MergeOptions
from tui_merger.core.io.sources import RenamedSource, TensorRef, not_a_folder, open_model
from tui_merger.core.io.torch_pickle import Record, TorchFile, WrapperTensor, load_state_dict

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
PEFT_PREFIX = "base_model.model."


@dataclass
class FsdpLayout:
    folder: Path  # the folder holding the rank files
    world_size: int
    rank_files: list[Path]
    role: str  # "actor", "critic" or "sft"
    step: int | None = None
    fsdp_version: int | None = None
    hf_dir: Path | None = None
    notices: list[str] = field(default_factory=list)


def _rank_files(folder: Path) -> dict[int, dict[int, Path]]:
    found: dict[int, dict[int, Path]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return found
    for p in entries:
        m = RANK_FILE.match(p.name)
        if m:
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    return found


def _step_of(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def find_fsdp_checkpoint(path: Path) -> FsdpLayout:
    """Resolve a run folder, a global_step folder or an actor/critic folder to its rank files."""
    path = Path(path)
    if not path.is_dir():
        raise not_a_folder(path, "--local_dir", "checkpoint")
    folder = path
    notices = []
    if not _rank_files(folder):
        latest = folder / "latest_checkpointed_iteration.txt"
        steps = sorted((s, p) for p in folder.iterdir() if p.is_dir() and (s := _step_of(p)) is not None)
        if latest.is_file():
            try:
                n = int(latest.read_text().strip())
            except ValueError:
                raise MergeError(f"{latest} does not hold a step number; point at a global_step_N folder.") from None
            folder = folder / f"global_step_{n}"
            if not folder.is_dir():
                raise MergeError(f"{latest} names step {n} but {folder} does not exist; point at an existing step.")
        elif steps:
            folder = steps[-1][1]
            notices.append(f"Using the newest checkpoint, {folder.name}.")
        if not _rank_files(folder):
            for role in ("actor", "critic"):
                if _rank_files(folder / role):
                    if role == "actor" and _rank_files(folder / "critic"):
                        notices.append(f"{folder} also has a critic; merging the actor (point at critic/ for it).")
                    folder = folder / role
                    break
    groups = _rank_files(folder)
    if not groups:
        raise MergeError(
            f"No verl FSDP model files (model_world_size_W_rank_R.pt) under {path}; "
            "point at a run folder, a global_step_N folder or its actor/ folder."
        )
    if len(groups) > 1:
        sizes = " and ".join(str(w) for w in sorted(groups))
        raise MergeError(
            f"{folder} mixes rank files of world sizes {sizes}; remove the files of the run that is not wanted."
        )
    (world, ranks), = groups.items()
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        names = ", ".join(f"model_world_size_{world}_rank_{r}.pt" for r in missing[:3])
        raise MergeError(f"{folder} is missing {names} of a {world}-rank checkpoint; copy the whole folder again.")
    fsdp_version = None
    cfg = folder / "fsdp_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
            if not isinstance(data, dict):
                raise ValueError("not an object")
            fsdp_version = data.get("FSDP_version")
            if data.get("world_size") not in (None, world):
                raise MergeError(
                    f"{cfg} says world_size {data.get('world_size')} but the folder has {world} rank files; "
                    "the folder mixes two runs."
                )
        except ValueError:
            notices.append(f"{cfg} is not a valid JSON object; the world size was taken from the file names.")
    role = folder.name if folder.name in ("actor", "critic") else "sft"
    step = _step_of(folder.parent if role != "sft" else folder)
    hf_dir = folder / "huggingface" if (folder / "huggingface").is_dir() else None
    return FsdpLayout(folder, world, [ranks[r] for r in range(world)], role, step, fsdp_version, hf_dir, notices)


@dataclass
class _Part:
    rank: int
    local: object  # torch tensor (view on the rank file)
    start: int | None = None  # its bytes in the rank file, when contiguous there
    end: int | None = None


@dataclass
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    dim: int | None  # concatenation dim, None for a single replicated copy
    parts: list[_Part]


def _placement_dims(value: WrapperTensor, path: Path, key: str):
    spec = value.__dict__.get("_spec")
    if not isinstance(spec, Record) or "_local_tensor" not in value.__dict__:
        raise MergeError(f"{path}: {key} is a tensor subclass without its local shard; tui-merger cannot read it.")
    damaged = MergeError(f"{path}: {key} does not record its place in the device mesh; tui-merger cannot reassemble it.")
    mesh = spec.__dict__.get("mesh")
    coords = getattr(mesh, "_coordinate_on_dim", None) if isinstance(mesh, Record) else None
    placements = spec.__dict__.get("placements") or ()
    if not isinstance(placements, (list, tuple)):
        raise damaged
    kinds = []
    for p in placements:
        if not isinstance(p, Record):
            raise damaged
        if p.kind == "Shard":
            args = p.args if isinstance(p.args, tuple) else ()  # state may have replaced anything
            dim = p.__dict__.get("dim", args[0] if args else 0)
            if type(dim) is not int:
                raise damaged
            kinds.append(("Shard", dim))
        elif p.kind == "Replicate":
            kinds.append(("Replicate", None))
        else:
            raise MergeError(f"{path}: {key} is sharded as {p.kind}, which tui-merger does not support yet.")
    if not isinstance(coords, (list, tuple)) or len(coords) != len(kinds) or not all(type(c) is int for c in coords):
        raise damaged
    return kinds, tuple(coords)


def _wrapper_meta(path, key: str, value: WrapperTensor):
    """(torch dtype, global shape) a DTensor or ShardedTensor claims, checked: a damaged pickle can put
    any object in either place."""
    import torch

    dtype, shape = value.dtype, value.size
    if not isinstance(dtype, torch.dtype) or not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise MergeError(f"{path}: {key} does not record a valid dtype and shape; the file is damaged.")
    return dtype, shape


def _local_piece(path, key: str, dtype, local):
    """A rank's local shard: a tensor of the dtype its DTensor claims."""
    import torch

    if not isinstance(local, torch.Tensor) or local.dtype != dtype:
        raise MergeError(f"{path}: a local shard of {key} is not a {str(dtype).removeprefix('torch.')} tensor; the file is damaged.")
    return local


def _check_local(path, key: str, shape: tuple, dim: int | None, local) -> None:
    """A local shard must match the global shape it claims to be part of in every dimension but the
    sharded one (all of them when the tensor is not sharded): else the pieces would not reassemble
    into that shape (a damaged or forged file)."""
    local_shape = tuple(local.shape)
    fits = len(local_shape) == len(shape) and all(
        a == b for d, (a, b) in enumerate(zip(local_shape, shape)) if d != dim
    )
    if not fits:
        raise MergeError(
            f"{path}: {key} claims the global shape {list(shape)} but a rank holds a piece of shape "
            f"{list(local_shape)}; the file is damaged."
        )


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


class FsdpSource:
    """A TensorSource over the rank files: lists full tensors from pickled metadata, loads one full
    tensor on demand by concatenating the ranks' local shards (views on the mmap'd files)."""

    def __init__(self, layout: FsdpLayout) -> None:
        self.layout = layout
        self.folder = layout.folder
        self.files: list[TorchFile] = []
        self.entries: dict[str, _Entry] = {}
        self.tensors: dict[str, TensorRef] = {}
        try:
            states = []
            for path in layout.rank_files:
                tf, state = load_state_dict(path)
                self.files.append(tf)
                states.append(state)
            self._index(states)
        except BaseException:
            self.close()
            raise

    def _index(self, states) -> None:
        first = states[0]
        if "state" in first and "param_groups" in first:
            raise MergeError(f"{self.layout.rank_files[0]} holds optimizer state, not model weights.")
        for rank, state in enumerate(states[1:], start=1):
            if set(state) != set(first):
                raise MergeError(
                    f"{self.layout.rank_files[rank]} holds different parameters than rank 0; "
                    "the rank files come from different runs."
                )
        for key, v0 in first.items():
            if isinstance(v0, WrapperTensor) and v0.subclass.endswith("ShardedTensor"):
                self.entries[key] = self._sharded_tensor(key, [s[key] for s in states])
            elif isinstance(v0, WrapperTensor):
                self.entries[key] = self._sharded(key, [s[key] for s in states])
            elif isinstance(v0, Record):
                raise MergeError(
                    f"{self.layout.rank_files[0]}: {key} is a {v0.kind}, which tui-merger cannot read yet "
                    "(only DTensor and plain tensors)."
                )
            elif _is_tensor(v0):
                dtype = str(v0.dtype).removeprefix("torch.")
                self.entries[key] = _Entry(key, dtype, tuple(v0.shape), None, [_Part(0, v0)])
            # other values (step counters, strings) are not weights
        for key, entry in self.entries.items():
            self.tensors[key] = TensorRef(self, "", key, entry.dtype, entry.shape)
            for part in entry.parts:
                local = part.local
                offset = self.files[part.rank].offset_of(local) if local.is_contiguous() else None
                if offset is not None:
                    part.start, part.end = offset, offset + local.numel() * local.element_size()

    def _sharded(self, key: str, values) -> _Entry:
        path = self.layout.rank_files[0]
        torch_dtype, shape = _wrapper_meta(path, key, values[0])
        dtype = str(torch_dtype).removeprefix("torch.")
        shard_dims = None
        chosen = []
        for rank, v in enumerate(values):
            kinds, coords = _placement_dims(v, self.layout.rank_files[rank], key)
            dims = [d for kind, d in kinds if kind == "Shard"]
            if len(set(dims)) > 1 or len(dims) > 1:
                raise MergeError(f"{path}: {key} is sharded over several mesh dimensions; not supported yet.")
            shard_dims = dims
            # a replica: any Replicate mesh coordinate other than 0 holds a copy we do not need
            if any(kind == "Replicate" and c != 0 for (kind, _), c in zip(kinds, coords)):
                continue
            order = next((c for (kind, _), c in zip(kinds, coords) if kind == "Shard"), 0)
            chosen.append((order, rank, _local_piece(self.layout.rank_files[rank], key, torch_dtype, v.__dict__["_local_tensor"])))
        chosen.sort()
        if not shard_dims:
            _check_local(path, key, shape, None, chosen[0][2])
            return _Entry(key, dtype, shape, None, [_Part(chosen[0][1], chosen[0][2])])
        dim = shard_dims[0]
        if not 0 <= dim < len(shape):
            raise MergeError(f"{path}: {key} is sharded along dim {dim} but has {len(shape)} dims; the file is damaged.")
        for _, _, t in chosen:
            _check_local(path, key, shape, dim, t)
        if [o for o, _, _ in chosen] != list(range(len(chosen))):
            raise MergeError(f"{path}: the shards of {key} do not cover the mesh; a rank file is missing or stale.")
        total = sum(t.shape[dim] for _, _, t in chosen)
        if total != shape[dim]:
            raise MergeError(
                f"{key}: the rank files hold {total} of its {shape[dim]} rows along dim {dim}; "
                "the checkpoint is incomplete."
            )
        return _Entry(key, dtype, shape, dim, [_Part(r, t) for _, r, t in chosen])

    def _sharded_tensor(self, key: str, values) -> _Entry:
        """FSDP1 without a device mesh saves ShardedTensors: each rank's local shards carry their
        offsets in the global tensor; they must tile it along one dimension."""
        path = self.layout.rank_files[0]
        torch_dtype, shape = _wrapper_meta(path, key, values[0])
        dtype = str(torch_dtype).removeprefix("torch.")
        pieces = []
        for rank, v in enumerate(values):
            state = v.__dict__.get("state")
            local_shards = state[0] if isinstance(state, tuple) and state else None
            if not isinstance(local_shards, list):
                raise MergeError(f"{self.layout.rank_files[rank]}: {key} is a ShardedTensor without local shards.")
            for shard in local_shards:
                if not isinstance(shard, Record):
                    raise MergeError(f"{path}: a shard of {key} lacks its data or offsets; the file is damaged.")
                meta = shard.__dict__.get("metadata")
                tensor = shard.__dict__.get("tensor")
                raw = getattr(meta, "shard_offsets", ()) or ()
                offsets = tuple(raw) if isinstance(raw, (list, tuple)) and all(type(o) is int for o in raw) else ()
                if tensor is None or len(offsets) != len(shape):
                    raise MergeError(f"{path}: a shard of {key} lacks its data or offsets; the file is damaged.")
                tensor = _local_piece(self.layout.rank_files[rank], key, torch_dtype, tensor)
                pieces.append((offsets, rank, tensor))
        pieces.sort(key=lambda p: p[0])
        varying = {d for d in range(len(shape)) if len({p[0][d] for p in pieces}) > 1}
        if len(varying) > 1:
            raise MergeError(f"{path}: {key} is sharded along several dimensions; not supported yet.")
        dim = varying.pop() if varying else 0
        expected = 0
        for offsets, _, tensor in pieces:
            if offsets[dim] != expected or any(offsets[d] for d in range(len(shape)) if d != dim):
                raise MergeError(f"{path}: the shards of {key} leave a gap; a rank file is missing or stale.")
            expected += tensor.shape[dim] if tensor.dim() else 1
        if shape and expected != shape[dim]:
            raise MergeError(f"{key}: the rank files hold {expected} of its {shape[dim]} rows; the checkpoint is incomplete.")
        for _, _, tensor in pieces:
            _check_local(path, key, shape, dim if len(pieces) > 1 else None, tensor)
        if len(pieces) == 1:
            return _Entry(key, dtype, shape, None, [_Part(pieces[0][1], pieces[0][2])])
        return _Entry(key, dtype, shape, dim, [_Part(r, t) for _, r, t in pieces])

    # -- TensorSource interface --------------------------------------------------------------------
    def load(self, ref: TensorRef):
        import torch

        entry = self.entries[ref.name]
        if entry.dim is None:
            return entry.parts[0].local
        return torch.cat([p.local for p in entry.parts], dim=entry.dim)

    def load_into(self, ref: TensorRef, out) -> None:
        """Copy each rank's shard straight into its slice of ``out`` (converting dtype on the way),
        so no full-size intermediate is built; each shard's pages are handed back once copied."""
        entry = self.entries[ref.name]
        if entry.dim is None:
            out.copy_(entry.parts[0].local)
            return
        offset = 0
        for part in entry.parts:
            n = part.local.shape[entry.dim]
            if n:
                out.narrow(entry.dim, offset, n).copy_(part.local)
                self.release_part(part)
            offset += n

    def raw_ranges(self, ref: TensorRef):
        """Shards along dim 0 that lie contiguously in their files are the tensor's bytes in order:
        copied in the kernel when the output keeps the dtype (fp32 checkpoints written as fp32)."""
        entry = self.entries[ref.name]
        if entry.dim not in (None, 0):
            return None
        parts = entry.parts[:1] if entry.dim is None else entry.parts
        if any(p.start is None for p in parts):
            return None
        return [(self.files[p.rank].fileno(), p.start, p.end - p.start) for p in parts if p.end > p.start]

    def row_blocks(self, ref: TensorRef):
        """The tensor as consecutive row blocks (its dim-0 shards, in order) with a callback that
        hands each block's pages back: written one by one, a converted tensor never exists whole."""
        entry = self.entries[ref.name]
        if entry.dim not in (None, 0):
            return None
        parts = entry.parts[:1] if entry.dim is None else [p for p in entry.parts if p.local.numel()]
        return [(p.local, lambda p=p: self.release_part(p)) for p in parts]

    def release_part(self, part: _Part) -> None:
        if part.start is not None:
            self.files[part.rank].release(part.start, part.end)
        else:
            self.files[part.rank].release()

    def release_key(self, key: str) -> None:
        for part in self.entries[key].parts:
            self.release_part(part)

    def release(self, ref: TensorRef) -> None:
        self.release_key(ref.name)

    def close(self) -> None:
        for tf in self.files:
            tf.close()
        self.files = []


def split_peft_keys(names) -> tuple[dict[str, str], dict[str, str]]:
    """(base name -> key, adapter key -> key) for a PeftModel's state dict; plain names pass through."""
    base, adapter = {}, {}
    for key in names:
        if ".lora_" in key:
            adapter[key] = key
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        name = re.sub(r"\.base_layer(?=\.)", "", name)  # nested wrappers too (peft's parameter LoRA on experts)
        base[name] = key
    return base, adapter


# -- the kind ------------------------------------------------------------------------------------

_PICKLED_LORA_A = re.compile(rb"([\w.]+)\.lora_(?:embedding_)?A\b")


class VerlFsdpFormat(Format):
    """Detect: ``model_world_size_W_rank_R.pt`` files (role from the folder name: actor/critic, else the
    SFT layout; step from ``global_step_N``; LoRA modules from rank 0's pickled key list, r and alpha from
    lora_train_meta.json or lora_adapter/). Open: the rank files reassembled tensor by tensor
    (``FsdpSource``), LoRA keys split off into an adapter. Reference: the base tensors as read, with the
    checkpoint's LoRA written in peft's format; a full-weights checkpoint is a conversion (no reference)."""

    kind = "verl-fsdp"
    role = "checkpoint"
    backend = "fsdp"
    label = "a verl FSDP checkpoint"
    short = "an FSDP one"

    def detect(self, s, folder: Path, names: dict) -> Found | None:
        ranks = [n for n in names if RANK_FILE.match(n)]
        if not ranks:
            return None
        role = folder.name if folder.name in ("actor", "critic") else "sft"
        step_dir = folder if role == "sft" else folder.parent
        step = step_of(step_dir.name, STEP_DIR)
        c = Candidate(
            self.kind, str(folder), step=step, run=str(step_dir.parent) if step is not None else None, role=role
        )
        by_world: dict[int, set[int]] = {}
        for name in ranks:
            m = RANK_FILE.match(name)
            by_world.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        world = max(by_world, key=lambda w: (len(by_world[w]), w))
        if len(by_world) > 1:
            sizes = " and ".join(str(w) for w in sorted(by_world))
            c.notes.append(f"mixes rank files of world sizes {sizes}: remove the files of the run that is not wanted.")
        missing = sorted(set(range(world)) - by_world[world])
        if missing:
            c.notes.append(f"rank file(s) {', '.join(map(str, missing[:5]))} of {world} are missing: the checkpoint is incomplete.")
        fsdp_cfg = s.json(folder / "fsdp_config.json")
        version = fsdp_cfg.get("FSDP_version") if fsdp_cfg else None
        c.backend = f"fsdp{version}" if version in (1, 2) else "fsdp"
        said = fsdp_cfg.get("world_size") if fsdp_cfg else None
        c.world_size = said if isinstance(said, int) and said > 0 else world
        if "fsdp_config.json" not in names:
            c.notes.append("no fsdp_config.json (verl < 0.4.1): the world size comes from the rank file names.")
        elif c.world_size != world:
            c.notes.append(f"fsdp_config.json says world size {said} but the rank files are of world size {world}.")
        hf = folder / "huggingface"
        hf_names = s.names(hf)
        config = s.json(hf / "config.json") if "config.json" in hf_names else None
        c.dtype = config_dtype(config)
        c.tokenizer = any(m in hf_names for m in TOKENIZER_MARKERS)
        if "config.json" not in hf_names:
            c.notes.append("no huggingface/config.json: the merge needs --base for the model's config.")
        elif s.weight_files(hf, hf_names):
            c.notes.append("huggingface/ also holds the full model weights: it can be used as it is.")
        keys = None
        rank0 = names.get(f"model_world_size_{world}_rank_0.pt")
        if rank0 is not None:
            keys = s.pickled_keys(Path(rank0.path))
        self._lora(s, c, folder, names, keys, config)
        if config and is_vision_language(config):
            c.notes.append(f"vision-language model ({architecture(config)}): written with the names save_pretrained uses.")
        if role == "critic":
            c.notes.append("critic (value model): the merge writes a TokenClassification model with one label.")
        s.sized(c, names.values(), recursive=True)
        return Found(c, ALL)

    def _lora(self, s, c: Candidate, folder: Path, names: dict, keys: bytes | None, config: dict | None) -> None:
        """r and alpha from lora_train_meta.json (verl >= 0.8) or lora_adapter/adapter_config.json
        (<= 0.7); the LoRA modules from the key names of rank 0. lora_alpha is never assumed."""
        meta_path = lora_train_meta_path(folder)
        meta = s.json(meta_path) if meta_path is not None else None
        exported = s.json(folder / "lora_adapter" / "adapter_config.json") if "lora_adapter" in names else None
        modules = sorted({m.group(1) for m in _PICKLED_LORA_A.finditer(keys)}) if keys else []
        if meta is None and exported is None and not modules:
            return
        lora = lora_info(exported, len(modules) or None)
        if meta is not None:
            lora["r"] = meta.get("r", lora["r"])
            lora["alpha"] = meta.get("lora_alpha", lora["alpha"])
            if lora["alpha"]:
                where = meta_path.name if meta_path.parent == folder else f"{meta_path.parent.name}/{meta_path.name}"
                c.notes.append(f"alpha {lora['alpha']:g}, from {where}.")
        if modules and not lora["target_modules"]:
            lora["target_modules"] = sorted({m.rsplit(b".", 1)[-1].decode("ascii", "replace") for m in modules})
        c.lora = lora
        if lora["alpha"] is None:
            c.notes.append("lora_alpha is not recorded in lora_train_meta.json or lora_adapter/: the merge needs --lora-alpha.")
        elif not lora["alpha"]:
            c.notes.append("lora_alpha is 0 (older verl wrote 0), so the adapter would change nothing: the merge needs --lora-alpha.")
        if modules and b".base_layer." not in keys:
            c.needs_base = True
            c.notes.append("save_lora_only: the rank files hold only the LoRA weights, so the merge needs --base.")
            base = (exported or {}).get("base_model_name_or_path") or (config or {}).get("_name_or_path")
            c.base_model = base if isinstance(base, str) and base else None
            s.resolve_base(c, folder)

    def recognizes(self, path: Path) -> bool:
        try:
            find_fsdp_checkpoint(path)
        except (OSError, MergeError):
            return False
        return True

    def locate(self, path: Path):
        return find_fsdp_checkpoint(path)

    def needs_base(self, c: Candidate) -> bool:
        return bool(c.needs_base)

    def needs_alpha(self, c: Candidate) -> bool:
        return bool(c.lora) and not c.lora.get("alpha")

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        base = f" --base {base_arg}" if c.needs_base else ""
        alpha = " --lora-alpha ALPHA" if c.lora is not None and not c.lora["alpha"] else ""
        return f"tui-merger merge {quote(path)}{base}{alpha} --out {quote(out)}"

    def open(self, options) -> Inputs:
        return _open(options)

    def reference(self, inputs, options, tmp: Path) -> Reference | None:
        if not inputs.adapter.lora:
            return None
        folder = Path(tmp) / "adapter"
        export_peft_adapter(inputs.memory_adapter or inputs.adapter, folder, fsync=False)
        return Reference([(folder, None)])


def _infer_parameters(cfg: dict, config_dir: Path, adapter_keys) -> None:
    """verl records r and lora_alpha only; peft's all-linear on an MoE model also put LoRA on parameters
    (packed experts, the router's weight: ``target_parameters``, nested pairs ``experts.base_layer.lora_A``)
    with the fused gate_up at rank and alpha 2x. Those are read back from the keys and the model: each LoRA
    under a module that is no Linear targets its 3-D parameters (or its 2-D ``weight``); ranks then come
    from the pairs' shapes, alpha in proportion (``_ranks_from_shapes``)."""
    from tui_merger.core.formats.hf_names import _meta_of

    owners = set()
    for key in adapter_keys:
        if ".lora_A" not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A")[0]
        nested = module.endswith(".base_layer")
        owners.add((re.sub(r"(\.base_layer)+$", "", module), nested))
    if not owners:
        return
    model = _meta_of(config_dir)
    if model is None:
        if any(nested for _, nested in owners):
            raise MergeError(
                "This LoRA run put LoRA on MoE expert parameters of a model transformers cannot build here, so "
                "where they lie is unknown; nothing was written."
            )
        return
    import torch

    targets = set()
    for owner, _ in sorted(owners):
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue  # said by the plan: a LoRA for a module the base lacks
        if isinstance(module, torch.nn.Linear) or hasattr(module, "base_layer"):
            continue
        where = ".".join(owner.split(".")[-2:])  # mlp.experts, mlp.gate: what a person would write
        packed = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        if packed:
            targets.update(f"{where}.{n}" for n in packed)
        elif getattr(module, "weight", None) is not None and module.weight.dim() == 2:
            targets.add(f"{where}.weight")
    if targets:
        cfg["target_parameters"] = sorted(targets)
        cfg["_ranks_from_shapes"] = True
        # the expert layout, where the shapes leave it open (square): a peft recent enough to put LoRA on
        # experts through all-linear wrote it, and the run records no version: the installed peft's
        from tui_merger.core.formats.hf_names import _installed_peft

        cfg.setdefault("peft_version", _installed_peft())


def _lora_config(folder: Path, options: MergeOptions, ranks: set[int], notices: list) -> dict:
    """r and alpha of a verl LoRA run: lora_train_meta.json (verl >= 0.8; beside the rank files or in the
    global_step_N folder above them) or lora_adapter/ (<= 0.7). --lora-alpha is used when given, and said
    when the run records another value."""
    cfg: dict = {}
    where = None
    found = read_lora_train_meta(folder)
    if found is not None:
        cfg, meta_path = found
        where = meta_path.name if meta_path.parent == folder else f"{meta_path.parent.name}/{meta_path.name}"
    else:
        path = folder / "lora_adapter" / "adapter_config.json"
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except ValueError:
                raise MergeError(f"{path} is not valid JSON; fix it or pass --lora-alpha.") from None
            if not isinstance(cfg, dict):
                raise MergeError(f"{path} does not hold a JSON object; fix it or pass --lora-alpha.")
            check_adapter_config(cfg, path)
            where = "lora_adapter/adapter_config.json"
    alpha, said = chosen_alpha(options.lora_alpha, cfg.get("lora_alpha"), where or "the checkpoint")
    if alpha is not None:
        cfg["lora_alpha"] = alpha
    if said:
        notices.append(said)
    if not cfg.get("lora_alpha"):
        said = "is 0" if "lora_alpha" in cfg else "is not recorded"
        raise MergeError(
            f"This LoRA checkpoint's lora_alpha {said} (looked in lora_train_meta.json and "
            "lora_adapter/adapter_config.json); pass --lora-alpha with the value used in training."
        )
    if "r" not in cfg and len(ranks) == 1:
        cfg["r"] = next(iter(ranks))
    cfg.setdefault("peft_type", "LORA")
    return cfg


def _disk_layout(config_dir: Path, base_map: dict):
    """transformers' save layout for this checkpoint's model, when its state dict holds names that
    save_pretrained does not write (a vision-language model's ``model.language_model.*``, packed MoE
    experts without a ``.weight`` suffix); None for the usual case, which then imports nothing."""
    if not any(".language_model." in n or n.startswith("model.visual.") or not n.endswith((".weight", ".bias"))
               for n in base_map):
        return None
    from tui_merger.core.formats.hf_names import disk_layout

    found = disk_layout(config_dir)
    return found if found is not None and (found.renames or found.groups) else None


def _open(options) -> Inputs:
    layout = find_fsdp_checkpoint(options.checkpoint)
    source = FsdpSource(layout)
    inputs = Inputs(None, empty_adapter(layout.folder), {}, FilePlan(), paths_of(options), closers=[source])
    inputs.notices = list(layout.notices)
    try:
        hf_dir = layout.hf_dir
        base_map, adapter_map = split_peft_keys(source.tensors)
        config_dir = hf_dir if hf_dir is not None else options.base  # the trained model's own config first
        if config_dir is None:
            raise MergeError(
                f"{layout.folder} has no huggingface/ folder with config.json; copy the model's config.json "
                "and tokenizer into it, or pass --base with the original model."
            )
        inputs.config = read_config(config_dir)
        names = _disk_layout(config_dir, base_map)  # in-memory names -> what save_pretrained writes
        if adapter_map:
            ranks = {source.tensors[k].shape[0] for k in adapter_map if ".lora_A" in k}
            cfg = _lora_config(layout.folder, options, ranks, inputs.notices)
            if not cfg.get("target_parameters"):
                _infer_parameters(cfg, config_dir, adapter_map)
            inputs.adapter = adapter_from_source(layout.folder, cfg, RenamedSource(source, adapter_map))
            if names is not None and names.renames:
                inputs.memory_adapter = inputs.adapter  # peft, building the reference, wants these names
                inputs.adapter = renamed(inputs.adapter, lambda n: names.renames.get(n, n))
            if inputs.adapter.param_lora:
                from tui_merger.core.formats.hf_names import place_parameter_loras

                place_parameter_loras(inputs.adapter, config_dir, inputs.closers)
        converted = None
        if names is not None:
            from tui_merger.core.formats.hf_names import ConvertedSource

            inner = {n: source.tensors[k] for n, k in base_map.items() if n in names.groups}
            converted = ConvertedSource(inner, names) if inner else None
            base_map = {names.renames.get(n, n): k for n, k in base_map.items() if n not in names.groups}
        base_only_lora = not any(k.endswith((".weight", ".bias")) for k in base_map)
        if base_only_lora:  # checkpoint.save_lora_only: the base weights are not in the files
            if options.base is None:
                raise MergeError(
                    f"{layout.folder} holds only LoRA weights (save_lora_only); pass --base with the model "
                    "the run started from."
                )
            base = open_model(options.base)
            inputs.closers.append(base)
            inputs.base = base
        else:
            inputs.base = RenamedSource(source, base_map)
            if converted is not None:  # packed experts: one tensor per expert, as save_pretrained writes
                inputs.base.tensors.update(converted.tensors)
                inputs.closers.append(converted)
        _value_model(inputs, options, layout)
        _tied(inputs, options, source, base_map)
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        if inputs.dtype == "float32" and options.dtype is None:
            inputs.notices.append(
                "The checkpoint's config says float32, so the model is written in float32 (twice the size "
                "of bf16); pass --dtype bf16 for the half-size model verl's merger writes."
            )
        files_dir = hf_dir if hf_dir is not None else config_dir
        inputs.files = plan_files(files_dir, files_dir, inputs.config, options.tokenizer_from)
        inputs.notices += inputs.files.notices
        meta = [lora_train_meta_path(layout.folder), layout.folder / "lora_adapter/adapter_config.json"]
        inputs.read_files = (
            list(layout.rank_files)
            + [config_dir / "config.json"]
            + [p for p in meta if p is not None and p.is_file()]
            + ([options.base / f for f in inputs.base.files] if base_only_lora else [])
            + [src for src, _ in inputs.files.copies]
        )
    except BaseException:
        inputs.close()
        raise
    return inputs


def _tied(inputs: Inputs, options: MergeOptions, source, base_map) -> None:
    """Tied embeddings appear twice in an FSDP state dict: write one tensor and keep the tie, unless
    the two differ, which is then said, and both are kept."""
    import torch

    from tui_merger.core.formats.hf_names import tied_pair

    names = inputs.base.tensors
    EMBED, HEAD = tied_pair(inputs.config, names)  # noqa: N806 - transformers' names for this family
    tie = bool(inputs.config.get("tie_word_embeddings")) or options.tie_word_embedding
    if not (tie and EMBED in names and HEAD in names):
        if options.tie_word_embedding and HEAD not in names:
            inputs.config_changes["tie_word_embeddings"] = True
        return
    emb = source.entries[base_map[EMBED]]
    head = source.entries[base_map[HEAD]]
    same = emb.shape == head.shape and len(emb.parts) == len(head.parts)
    for a, b in zip(emb.parts, head.parts):
        if not same:
            break
        # FSDP2 pickles the tied pair as one storage; FSDP1 as two equal ones, compared shard by shard
        shared = a.local.data_ptr() == b.local.data_ptr() and a.local.shape == b.local.shape
        same = shared or (a.local.shape == b.local.shape and torch.equal(a.local, b.local))
        source.release_part(a)  # the comparison touched these pages: hand them back
        source.release_part(b)
    if same:
        del names[HEAD]
        if not inputs.config.get("tie_word_embeddings"):
            inputs.config_changes["tie_word_embeddings"] = True
    else:
        inputs.notices.append(
            f"{HEAD} differs from the input embedding, so both are kept and "
            "tie_word_embeddings is set to false."
        )
        inputs.config_changes["tie_word_embeddings"] = False
