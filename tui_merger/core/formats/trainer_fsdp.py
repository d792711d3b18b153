"""HF Trainer checkpoints that accelerate's FSDP saved with ``SHARDED_STATE_DICT``.

Layout (transformers' ``Trainer._save_optimizer_and_scheduler`` -> accelerate's ``save_fsdp_model``):
``<output_dir>/checkpoint-N/pytorch_model_fsdp_0/`` (torch.distributed.checkpoint: ``.metadata`` and
``__R_0.distcp`` per rank; keys ``model.`` + the Hugging Face name), ``optimizer_0/``, ``scheduler.pt``,
``rng_state_R.pth``, ``trainer_state.json``. No config.json and no tokenizer: ``save_model`` writes
nothing under SHARDED_STATE_DICT, so the config comes from ``--base``, the model the run started from.

A full fine-tune stores every weight (float32 under bf16 mixed precision: FSDP keeps float32 parameters;
bfloat16 when the model was loaded in bf16). A PEFT LoRA run stores the adapter only (``adapter_only``):
``model.base_model.model.<module>.lora_A.weight``, no adapter_config.json: r comes from the shapes, the
targets from the names, lora_alpha from ``--lora-alpha``. FSDP1 + PEFT saves an empty folder
(accelerate hands the wrapped model to peft's ``get_peft_model_state_dict``): said, refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.adapter import adapter_from_source, empty_adapter, export_peft_adapter
from tui_merger.core.formats.base import ALL, TRAINER_STEP, Candidate, Format, Found, Reference, lora_info, step_of
from tui_merger.core.formats.input_types import Inputs, paths_of
from tui_merger.core.io.files import TOKENIZER_MARKERS, FilePlan, config_dtype, plan_files, read_config
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
from tui_merger.core.io.sources import not_a_folder, open_model

MODEL_DIR = "pytorch_model_fsdp_0"
FULL_FILE = "pytorch_model_fsdp.bin"  # FULL_STATE_DICT: rank 0's torch.save of the whole state dict
_RANK_FILE = re.compile(r"^pytorch_model_fsdp(?:_\d+)?_rank(\d+)\.bin$")  # LOCAL_STATE_DICT, or use_dcp=False
OPTIM_DIR = "optimizer_0"
PREFIX = "model."  # accelerate saves {"model": state_dict}
PEFT_PREFIX = "base_model.model."
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")
_LORA = re.compile(r"^(.+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")
_RANK_FILES = (
    "{folder} holds FSDP's per-rank files ({example}: LOCAL_STATE_DICT, or SHARDED_STATE_DICT saved with "
    "use_dcp=False), which only FSDP itself, on the same number of processes, can load; tui-merger cannot read "
    "them: load the checkpoint in the run's own setup and save it with state_dict_type SHARDED_STATE_DICT or "
    "FULL_STATE_DICT."
)
_STORED = {"float32": "float32 (what FSDP keeps under bf16 mixed precision, or an fp32 run)",
           "bfloat16": "bfloat16 (the model was loaded in bf16)"}
_EMPTY_FSDP1_LORA = (
    "{folder} holds no weights: FSDP1 with a PEFT LoRA saves no weights there (accelerate hands the wrapped model to "
    "peft, which finds no adapter in it), so this checkpoint cannot be merged; use FSDP2 (fsdp_version 2), or "
    "save the adapter with the model's save_pretrained after training."
)


@dataclass
class TrainerFsdpLayout:
    folder: Path  # checkpoint-N
    model_dir: Path | None  # its pytorch_model_fsdp_0/ (SHARDED_STATE_DICT)
    step: int | None
    notices: list[str] = field(default_factory=list)
    full_file: Path | None = None  # its pytorch_model_fsdp.bin (FULL_STATE_DICT), when there is no DCP folder


def _model_dir(folder: Path) -> Path | None:
    d = folder / MODEL_DIR
    return d if d.is_dir() else None


def _saved(folder: Path) -> bool:
    """Whether a folder holds an accelerate FSDP model save of any state dict type."""
    try:
        return _model_dir(folder) is not None or (folder / FULL_FILE).is_file() or any(
            _RANK_FILE.match(p.name) for p in folder.iterdir())
    except OSError:
        return False


def find_trainer_fsdp(path: Path) -> TrainerFsdpLayout:
    """A checkpoint-N folder (or its pytorch_model_fsdp_0/, or the output_dir holding checkpoint-N
    folders: its newest step) to the DCP folder that holds the model."""
    path = Path(path)
    if not path.is_dir():
        raise not_a_folder(path, "output_dir", "checkpoint")
    notices = []
    if path.name == MODEL_DIR and (path / ".metadata").exists():
        path = path.parent
    folder = path
    if not _saved(folder):
        steps = sorted(
            (s, p) for p in folder.iterdir() if (s := step_of(p.name, TRAINER_STEP)) is not None and _saved(p)
        )
        if steps:
            folder = steps[-1][1]
            notices.append(f"Using the newest checkpoint, {folder.name}.")
    model_dir = _model_dir(folder)
    step = step_of(folder.name, TRAINER_STEP)
    if model_dir is None and (folder / FULL_FILE).is_file():
        return TrainerFsdpLayout(folder, None, step, notices, full_file=folder / FULL_FILE)
    if model_dir is None:
        ranked = sorted(p.name for p in folder.iterdir() if _RANK_FILE.match(p.name))
        if ranked:
            raise MergeError(_RANK_FILES.format(folder=folder, example=ranked[0]))
        raise MergeError(
            f"No accelerate FSDP model save ({MODEL_DIR}/ or {FULL_FILE}) under {path}; point at a checkpoint-N "
            "folder that an HF Trainer run with FSDP wrote."
        )
    return TrainerFsdpLayout(folder, model_dir, step, notices)


def _empty(model_dir: Path) -> bool:
    """A save that holds no tensor (FSDP1 + PEFT): its .metadata lists none."""
    from tui_merger.core.io.dcp import read_metadata

    try:
        md = read_metadata(model_dir)
    except MergeError:
        return False  # said when it is opened
    return not any(hasattr(m, "__dict__") and "chunks" in m.__dict__ for m in md.state_dict_metadata.values())


def split_keys(keys) -> tuple[dict[str, str], dict[str, str]]:
    """(Hugging Face name -> key of a full weight, adapter name -> key of a LoRA factor): the ``model.``
    prefix dropped; a PEFT model's names unwrapped."""
    base, adapter = {}, {}
    for key in keys:
        if not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX):]
        if ".lora_" in name:
            adapter[name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name] = key
            continue
        name = name.removeprefix(PEFT_PREFIX)
        base[re.sub(r"\.base_layer(?=\.)", "", name)] = key
    return base, adapter


def _lora_shapes(adapter_keys: dict, shapes: dict) -> tuple[dict[str, int], list[str]]:
    """{module: r} from the lora_A shapes, and the target names (the modules' last parts)."""
    ranks = {}
    for name, key in adapter_keys.items():
        m = _LORA.match(name)
        if m and m.group(2) == "A" and len(shapes.get(key, ())) == 2:
            ranks[m.group(1).removeprefix(PEFT_PREFIX)] = shapes[key][0]
    return ranks, sorted({m.rsplit(".", 1)[-1] for m in ranks})


def _config_dir(folder: Path, base: Path | None) -> tuple[Path | None, str]:
    """Where the model's config.json is: the checkpoint itself (some Trainer versions), the run folder
    (a final full save at the top of output_dir), else --base. (folder, in words)."""
    if (folder / "config.json").is_file():
        return folder, "the checkpoint"
    run = folder.parent
    if step_of(folder.name, TRAINER_STEP) is not None and (run / "config.json").is_file():
        return run, f"the run folder {run}"
    if base is not None:
        return Path(base), "--base"
    return None, ""


def _trainer_step(folder: Path) -> int | None:
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if type(step) is int else None


class TrainerFsdpFormat(Format):
    """Detect: a folder holding ``pytorch_model_fsdp_0/`` (its ``.metadata`` read: the keys, shapes and
    dtypes, the ranks from the ``.distcp`` names; the step from ``trainer_state.json``). Open: the DCP
    folder through ``io.dcp`` one tensor at a time, ``model.`` dropped; a LoRA run's factors become an
    adapter merged into ``--base``. Reference: a full fine-tune is a conversion (no reference); a LoRA run's
    adapter is written in peft's format and applied to the base by peft."""

    kind = "trainer-fsdp"
    role = "checkpoint"
    backend = "accelerate-fsdp"
    label = "an HF Trainer FSDP checkpoint (accelerate, SHARDED_STATE_DICT)"
    short = "an accelerate FSDP one"

    # -- detection ----------------------------------------------------------------------------------
    def detect(self, s, folder: Path, names: dict) -> Found | None:
        entry = names.get(MODEL_DIR)
        ranked = sorted(n for n in names if _RANK_FILE.match(n))
        full = FULL_FILE in names and not s.weight_files(folder, names)  # beside save_model's model: that model is it
        if (entry is None or not entry.is_dir(follow_symlinks=False)) and not full and not ranked:
            return None
        step = step_of(folder.name, TRAINER_STEP)
        c = Candidate(self.kind, str(folder), step=step, run=str(folder.parent) if step is not None else None)
        said = _trainer_step(folder) if "trainer_state.json" in names else None
        if said is not None and step is not None and said != step:
            c.notes.append(f"trainer_state.json says global step {said}, the folder name step {step}.")
        if step is None and said is not None:
            c.step = said
        if entry is None or not entry.is_dir(follow_symlinks=False):
            return self._detect_files(s, c, folder, names, ranked)
        model_dir = folder / MODEL_DIR
        listing = s.names(model_dir)
        ranks = {int(m.group(1)) for n in listing if (m := _DISTCP.match(n))}
        c.world_size = max(ranks) + 1 if ranks else None
        if ranks and len(ranks) != max(ranks) + 1:
            c.notes.append(f"{MODEL_DIR}/ lacks the files of rank(s) {sorted(set(range(max(ranks) + 1)) - ranks)[:5]}: the checkpoint is incomplete.")
        c.backend = "fsdp"
        config_dir, where = _config_dir(folder, None)
        config = s.json(config_dir / "config.json") if config_dir is not None else None
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        if ".metadata" not in listing:
            c.notes.append(f"{MODEL_DIR}/ has no .metadata: the save did not finish; use an earlier step.")
            s.sized(c, names.values(), recursive=True)
            return Found(c, ALL)
        stored = self._stored(s, model_dir)
        if stored == {}:
            c.notes.append(_EMPTY_FSDP1_LORA.format(folder=f"{MODEL_DIR}/"))
            s.sized(c, names.values(), recursive=True)
            return Found(c, ALL)
        stored = stored or {}
        base, adapter = split_keys(stored)
        if stored:
            by_dtype: dict[str, int] = {}
            for key, (dtype, shape, nbytes) in stored.items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
            c.dtype = max(by_dtype, key=by_dtype.get)
        if adapter and not any(k.endswith(".weight") for k in base):
            ranks_of, targets = _lora_shapes(adapter, {k: v[1] for k, v in stored.items()})
            c.lora = lora_info({"r": next(iter(set(ranks_of.values()))) if len(set(ranks_of.values())) == 1 else None,
                                "target_modules": targets}, len(ranks_of))
            c.lora["alpha"] = None
            c.needs_base = True
            c.notes.append(
                f"a LoRA run: {MODEL_DIR}/ holds the adapter only ({len(ranks_of)} modules, {c.dtype}); the merge "
                "needs --base (the model the run started from) and --lora-alpha (no adapter_config.json records it)."
            )
        else:
            what = _STORED.get(c.dtype, c.dtype or "?")
            c.notes.append(f"full weights, sharded over {c.world_size} rank(s), stored in {what}.")
            _config_note(c, config is not None, where, " (the Trainer writes none with FSDP sharded state)")
        s.sized(c, names.values(), recursive=True)
        return Found(c, ALL)

    def _detect_files(self, s, c: Candidate, folder: Path, names: dict, ranked: list) -> Found:
        """FULL_STATE_DICT's pytorch_model_fsdp.bin without a model beside it (accelerate's save_state, or a
        Trainer run whose save_model did not finish), or per-rank files it cannot read."""
        c.backend = "fsdp"
        if ranked:
            ranks = {int(m.group(1)) for n in ranked if (m := _RANK_FILE.match(n))}
            c.world_size = max(ranks) + 1
            c.notes.append(_RANK_FILES.format(folder="this checkpoint", example=ranked[0]).removeprefix("this checkpoint "))
            s.sized(c, names.values(), recursive=True)
            return Found(c, ALL)
        keys = s.pickled_keys(folder / FULL_FILE)
        config_dir, where = _config_dir(folder, None)
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        if keys is not None and b".lora_" in keys:
            c.notes.append(f"{FULL_FILE} holds a LoRA adapter's tensors only (FULL_STATE_DICT saves the adapter); "
                           "merge the adapter folder the Trainer saved with it (adapter_model.safetensors), which "
                           "records its r and alpha.")
        else:
            # the storages' classes in the pickle say the dtype (each tensor names one; no tensor data read)
            counts = {d: keys.count(f"{st}Storage".encode()) for d, st in (
                ("float32", "Float"), ("bfloat16", "BFloat16"), ("float16", "Half"))} if keys else {}
            c.dtype = max(counts, key=counts.get) if counts and max(counts.values()) else None
            what = f", stored in {_STORED.get(c.dtype, c.dtype)}" if c.dtype else ""
            c.notes.append(f"full weights in one file ({FULL_FILE}: FULL_STATE_DICT, gathered on rank 0){what}.")
            _config_note(c, config_dir is not None, where)
        s.sized(c, names.values(), recursive=True)
        return Found(c, ALL)

    def _stored(self, s, model_dir: Path) -> dict:
        """key -> (dtype, shape, bytes) of the tensors the DCP .metadata lists (read by the restricted
        unpickler); None when it does not read (said as a problem)."""
        from tui_merger.core.io.dcp import read_metadata
        from tui_merger.core.io.safetensors_io import nbytes_of

        try:
            md = read_metadata(model_dir)
        except MergeError as err:
            s.problem(model_dir / ".metadata", str(err).removeprefix(str(model_dir / ".metadata")).lstrip() or str(err))
            return None
        out = {}
        for key, meta in (getattr(md, "state_dict_metadata", None) or {}).items():
            d = getattr(meta, "__dict__", {})
            size, props = d.get("size"), d.get("properties")
            dtype = str(getattr(props, "dtype", None) or (getattr(props, "state", None) or (None,))[0]).removeprefix("torch.")
            if isinstance(key, str) and isinstance(size, (tuple, list)) and "chunks" in d:
                shape = tuple(int(n) for n in size)
                try:
                    out[key] = (dtype, shape, nbytes_of(dtype, shape))
                except (KeyError, ValueError):
                    out[key] = (dtype, shape, 0)
        return out

    def recognizes(self, path: Path) -> bool:
        """An FSDP save of any state dict type here (or in a checkpoint-N below): one that cannot be read
        is still this kind, so that opening it says why."""
        path = Path(path)
        try:
            if not path.is_dir():
                return False
            if path.name == MODEL_DIR and (path / ".metadata").exists():
                return True
            return _saved(path) or any(step_of(p.name, TRAINER_STEP) is not None and _saved(p) for p in path.iterdir())
        except OSError:
            return False

    def locate(self, path: Path):
        return find_trainer_fsdp(path)

    # -- the assistant --------------------------------------------------------------------------------
    def why_not_mergeable(self, c: Candidate) -> str | None:
        for note in c.notes:
            if note.startswith(f"{MODEL_DIR}/ holds no weights") or note.startswith(f"{MODEL_DIR}/ has no .metadata"):
                return f"This checkpoint's {note}"
            if note.startswith("holds FSDP's per-rank files"):
                return f"This checkpoint {note}"
            if note.startswith(f"{FULL_FILE} holds a LoRA adapter"):
                return f"This checkpoint's {note}"
        return None

    def needs_base(self, c: Candidate) -> bool:
        return bool(c.needs_base)

    def needs_alpha(self, c: Candidate) -> bool:
        return bool(c.lora) and not c.lora.get("alpha")

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        problem = self.why_not_mergeable(c)
        if problem:
            return problem
        base = f" --base {base_arg}" if c.needs_base else ""
        alpha = " --lora-alpha ALPHA" if self.needs_alpha(c) else ""
        return f"tui-merger merge {quote(path)}{base}{alpha} --out {quote(out)}"

    # -- opening --------------------------------------------------------------------------------------
    def open(self, options) -> Inputs:
        return _open(options)

    def reference(self, inputs, options, tmp: Path) -> Reference | None:
        if not inputs.adapter.lora:
            return None  # a conversion: the recompute compared every tensor with the checkpoint's
        folder = Path(tmp) / "adapter"
        export_peft_adapter(inputs.adapter, folder, fsync=False)
        return Reference([(folder, None)])

    def weights_to_fit(self, path: Path) -> dict | None:
        """A full fine-tune's weights and shapes (from .metadata), when no config comes with them."""
        try:
            layout = find_trainer_fsdp(path)
        except (OSError, MergeError):
            return None
        if _config_dir(layout.folder, None)[0] is not None:
            return None
        from tui_merger.core.io.dcp import read_metadata

        try:
            md = read_metadata(layout.model_dir)
        except MergeError:
            return None
        shapes = {k: tuple(m.__dict__["size"]) for k, m in md.state_dict_metadata.items()
                  if isinstance(k, str) and hasattr(m, "__dict__") and "chunks" in m.__dict__}
        base, adapter = split_keys(shapes)
        if adapter or not base:
            return None
        return {name: shapes[key] for name, key in base.items()}

    def lora_to_fit(self, path: Path):
        """A LoRA run's adapter (alpha unknown: 1), for proposing the base it fits."""
        try:
            layout = find_trainer_fsdp(path)
        except (OSError, MergeError):
            return None
        if _empty(layout.model_dir):
            return None
        from tui_merger.core.io.dcp import DcpSource, DcpStore

        try:
            store = DcpStore(layout.model_dir, lambda k: not k.startswith(PREFIX))
        except MergeError:
            return None
        base, adapter = split_keys(store.tensors)
        if not adapter or any(k.endswith(".weight") for k in base):
            store.close()
            return None
        source = DcpSource(store, adapter)
        ranks, targets = _lora_shapes(adapter, {k: t.shape for k, t in store.tensors.items()})
        cfg = {"peft_type": "LORA", "r": max(ranks.values()), "lora_alpha": 1, "target_modules": targets,
               "rank_pattern": _rank_pattern(ranks)}
        return adapter_from_source(layout.folder, cfg, source)


def _rank_pattern(ranks: dict[str, int]) -> dict:
    common = max(set(ranks.values()), key=list(ranks.values()).count) if ranks else None
    return {m: r for m, r in ranks.items() if r != common}


def _no_config(layout: TrainerFsdpLayout) -> MergeError:
    return MergeError(
        f"{layout.folder} holds no config.json (HF Trainer writes none for FSDP sharded checkpoints); pass "
        "--base with the model the run started from, for its config and tokenizer."
    )


def _open(options) -> Inputs:
    from tui_merger.core.io.dcp import DcpSource, DcpStore

    layout = find_trainer_fsdp(options.checkpoint)
    if layout.full_file is not None:
        return _open_full_file(options, layout)
    if _empty(layout.model_dir):
        raise MergeError(_EMPTY_FSDP1_LORA.format(folder=layout.model_dir))
    inputs = Inputs(None, empty_adapter(layout.folder), {}, FilePlan(), paths_of(options))
    inputs.notices = list(layout.notices)
    try:
        store = DcpStore(layout.model_dir, lambda k: not k.startswith(PREFIX))
        inputs.closers.append(store)
        base_map, adapter_map = split_keys(store.tensors)
        lora_only = bool(adapter_map) and not any(k.endswith(".weight") for k in base_map)
        config_dir = _read_config(inputs, layout, options)
        world = len({m.group(1) for f in store.data_files if (m := _DISTCP.match(f))})
        if lora_only:
            _lora(inputs, options, layout, store, adapter_map)
            stored = {store.tensors[k].dtype for k in adapter_map.values()}
            inputs.infos.append(f"An accelerate FSDP LoRA checkpoint: the adapter's factors sharded over {world} "
                                f"rank(s), stored in {', '.join(sorted(stored))}.")
        else:
            if adapter_map:
                raise MergeError(
                    f"{layout.model_dir} holds full weights and LoRA factors together, which HF Trainer does not "
                    "write; tui-merger cannot tell which to merge."
                )
            shapes = {n: tuple(store.tensors[k].shape) for n, k in base_map.items()}
            _full_weights(inputs, options, layout, config_dir, shapes,
                          lambda mapping: DcpSource(store, {new: base_map[old] for new, old in mapping.items()}))
            stored = {store.tensors[k].dtype for k in base_map.values()}
            inputs.infos.append(f"An accelerate FSDP checkpoint (SHARDED_STATE_DICT): full weights sharded over "
                                f"{world} rank(s), stored in {' and '.join(_STORED.get(d, d) for d in sorted(stored))}.")
        _files(inputs, options, layout, config_dir, [layout.model_dir / ".metadata"]
               + [layout.model_dir / f for f in store.data_files], lora_only)
    except BaseException:
        inputs.close()
        raise
    return inputs


def _read_config(inputs, layout: TrainerFsdpLayout, options) -> Path:
    """The model's config.json (--base's, else the one found for the checkpoint) read into ``inputs``, a notice saying
    where it came from when not from --base; its folder."""
    config_dir, where = _config_dir(layout.folder, options.base)
    if config_dir is None:
        raise _no_config(layout)
    inputs.config = read_config(config_dir)
    if where != "--base":
        inputs.notices.append(f"The model's config.json comes from {where}.")
    return config_dir


def _open_full_file(options, layout: TrainerFsdpLayout) -> Inputs:
    """FULL_STATE_DICT: rank 0's torch.save of the whole state dict (in-memory names, no prefix), read
    by mmap through torch's weights-only loader, one tensor at a time."""
    from tui_merger.core.io.sources import RenamedSource, TensorSource

    inputs = Inputs(None, empty_adapter(layout.folder), {}, FilePlan(), paths_of(options))
    inputs.notices = list(layout.notices)
    try:
        config_dir = _read_config(inputs, layout, options)
        whole = TensorSource(layout.folder, [FULL_FILE])
        inputs.closers.append(whole)
        if any(".lora_" in n for n in whole.tensors):
            raise MergeError(
                f"{layout.full_file} holds a LoRA adapter's tensors only (FULL_STATE_DICT saves the adapter); merge "
                "the adapter folder the Trainer saved with it (adapter_model.safetensors), which records its r and alpha."
            )
        shapes = {n: tuple(r.shape) for n, r in whole.tensors.items()}
        _full_weights(inputs, options, layout, config_dir, shapes, lambda mapping: RenamedSource(whole, mapping))
        stored = {r.dtype for r in whole.tensors.values()}
        inputs.infos.append(f"An accelerate FSDP checkpoint (FULL_STATE_DICT, {FULL_FILE}): full weights gathered "
                            f"on rank 0, stored in {' and '.join(_STORED.get(d, d) for d in sorted(stored))}.")
        _files(inputs, options, layout, config_dir, [layout.full_file], False)
    except BaseException:
        inputs.close()
        raise
    return inputs


def _full_weights(inputs: Inputs, options, layout: TrainerFsdpLayout, config_dir: Path, shapes: dict, view) -> None:
    """A full fine-tune's weights (in-memory names -> shapes; ``view({name: in-memory name})`` gives a
    source under the names given) as save_pretrained writes them, in the config's dtype."""
    _check_names(shapes, config_dir, layout)
    names = _disk_layout(config_dir, shapes)  # in-memory names -> what save_pretrained writes
    grouped = {}
    mapping = {n: n for n in shapes}
    if names is not None:
        grouped = {n: n for n in shapes if n in names.groups}
        mapping = {names.renames.get(n, n): n for n in shapes if n not in names.groups}
    source = view(mapping)
    inputs.base = source
    if grouped:  # packed experts: one tensor per expert, as save_pretrained writes them
        from tui_merger.core.formats.hf_names import ConvertedSource

        packed = view(grouped)
        converted = ConvertedSource(dict(packed.tensors), names)
        source.tensors.update(converted.tensors)
        inputs.closers.append(converted)
    _tied(inputs, options, source)
    stored = {t.dtype for t in source.tensors.values()}
    dtype = config_dtype(inputs.config)
    inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
    if options.dtype is None and inputs.dtype and stored and inputs.dtype not in stored:
        kept = ", ".join(sorted(stored))
        inputs.notices.append(
            f"The checkpoint stores {kept}; the model is written in {inputs.dtype}, the config's dtype "
            "(pass --dtype to choose another)."
        )


def _files(inputs: Inputs, options, layout: TrainerFsdpLayout, config_dir: Path, weights: list, lora_only: bool) -> None:
    # a tokenizer the checkpoint holds (a Trainer given one saves it beside a full save) first
    inputs.files = plan_files(config_dir, layout.folder, inputs.config, options.tokenizer_from)
    inputs.notices += inputs.files.notices
    inputs.read_files = (
        list(weights)
        + [config_dir / "config.json"]
        + ([Path(options.base) / f for f in inputs.base.files] if lora_only else [])
        + [src for src, _ in inputs.files.copies]
    )


def _disk_layout(config_dir: Path, base_map: dict):
    """transformers' save layout, when the state dict holds names save_pretrained does not write (a
    vision-language model's ``model.language_model.*``, packed MoE experts); None for the usual case."""
    if not any(".language_model." in n or n.startswith("model.visual.") or not n.endswith((".weight", ".bias"))
               for n in base_map):
        return None
    from tui_merger.core.formats.hf_names import disk_layout

    found = disk_layout(config_dir)
    return found if found is not None and (found.renames or found.groups) else None


def _check_names(shapes: dict, config_dir: Path, layout: TrainerFsdpLayout) -> None:
    """The checkpoint's weights (in-memory names -> shapes, as FSDP saved them) against the model the
    config builds on the meta device: a --base of another model is said before anything is written."""
    from tui_merger.core.formats.hf_names import _meta_of

    model = _meta_of(config_dir)
    if model is None:
        return
    want = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    for name, shape in shapes.items():
        if name in want and shape != want[name]:
            raise MergeError(
                f"{layout.folder}: {name} has shape {list(shape)} but the config in {config_dir} makes it "
                f"{list(want[name])}; pass --base with the model the run started from."
            )
    missing = [n for n in want if n not in shapes and n != HEAD]
    unknown = [n for n in shapes if n not in want]
    if missing:
        raise MergeError(
            f"{layout.folder} lacks {', '.join(missing[:3])}, which the config in {config_dir} needs; pass --base "
            "with the model the run started from."
        )
    if unknown:
        raise MergeError(
            f"{layout.folder} holds {', '.join(unknown[:3])}, which the model of the config in {config_dir} has no "
            "place for; pass --base with the model the run started from."
        )


def _tied(inputs: Inputs, options, source) -> None:
    """Tied embeddings are stored twice (once per name): one tensor is written and the tie kept, as
    save_pretrained does, unless the two differ, which is then said, and both are kept."""
    names = source.tensors
    tie = bool(inputs.config.get("tie_word_embeddings")) or options.tie_word_embedding
    if not (tie and EMBED in names and HEAD in names):
        if options.tie_word_embedding and HEAD not in names:
            inputs.config_changes["tie_word_embeddings"] = True
        return
    if _same_values(source, EMBED, HEAD):
        del names[HEAD]
        if not inputs.config.get("tie_word_embeddings"):
            inputs.config_changes["tie_word_embeddings"] = True
    else:
        inputs.notices.append(
            "lm_head.weight differs from the input embedding, so both are kept and tie_word_embeddings is set to false."
        )
        inputs.config_changes["tie_word_embeddings"] = False


def _same_values(source, a: str, b: str) -> bool:
    if hasattr(source, "same_values"):
        return source.same_values(a, b)
    import torch  # a source of whole tensors (FULL_STATE_DICT's file, mapped): compared a block of rows at a time

    ra, rb = source.tensors[a], source.tensors[b]
    if (ra.shape, ra.dtype) != (rb.shape, rb.dtype) or not ra.shape:
        return False
    x, y = ra.load(), rb.load()
    step = max(1, (16 << 20) // max(1, ra.nbytes // ra.shape[0]))
    return all(torch.equal(x[r : r + step], y[r : r + step]) for r in range(0, ra.shape[0], step))


def _lora(inputs: Inputs, options, layout: TrainerFsdpLayout, store, adapter_map: dict) -> None:
    """A LoRA run: the adapter's factors from the DCP folder, its base from --base."""
    from tui_merger.core.io.dcp import DcpSource

    if options.base is None:
        raise MergeError(
            f"{layout.model_dir} holds only a LoRA adapter; pass --base with the model the run started from "
            "(and --lora-alpha with the lora_alpha used in training)."
        )
    if options.lora_alpha is None:
        raise MergeError(
            f"{layout.model_dir} holds a LoRA adapter but no adapter_config.json records its lora_alpha; pass "
            "--lora-alpha with the value used in training."
        )
    ranks, targets = _lora_shapes(adapter_map, {k: t.shape for k, t in store.tensors.items()})
    common = max(set(ranks.values()), key=list(ranks.values()).count)
    cfg = {"peft_type": "LORA", "r": common, "lora_alpha": options.lora_alpha, "target_modules": targets,
           "rank_pattern": _rank_pattern(ranks), "base_model_name_or_path": str(options.base)}
    inputs.adapter = adapter_from_source(layout.folder, cfg, DcpSource(store, adapter_map))
    inputs.infos.append(  # information, not a warning; the front ends say "from your answer" for the flag
        f"LoRA r={common} (from the shapes) on {', '.join(targets)}, lora_alpha {options.lora_alpha:g}, from --lora-alpha."
    )
    base = open_model(options.base)
    inputs.closers.append(base)
    inputs.base = base
    dtype = config_dtype(inputs.config)
    inputs.dtype = dtype if dtype in FLOAT_DTYPES else None


def _config_note(c: Candidate, found: bool, where: str, why: str = "") -> None:
    """inspect's line on the checkpoint's config: where it comes from, or that the merge needs --base."""
    if found:
        c.notes.append(f"config.json from {where}.")
    else:
        c.needs_base = True
        c.notes.append(f"no config.json{why}: the merge needs --base, the model the run started from, for its "
                       "config and tokenizer.")
