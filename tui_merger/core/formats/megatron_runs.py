"""Where megatron-core dist checkpoints lie when verl did not save them (a helper of the verl Megatron
kind, not a kind): Megatron-LM, Megatron-Bridge, ms-swift and NeMo 2 all save the same megatron-core
``torch_dist`` checkpoint (``.metadata``, ``__{rank}_{i}.distcp``, ``common.pt``, ``metadata.json``),
which ``verl_megatron``'s reader converts; only the folders around it and the run configuration
beside it differ (docs/formats.md, "Megatron checkpoints saved outside verl", says what each writes
and the source file it was read from):

- Megatron-LM: ``<save>/latest_checkpointed_iteration.txt`` ("N" or "release") and
  ``<save>/iter_{N:07d}/`` (or ``release/``) holding the dist checkpoint; its arguments are pickled in
  ``common.pt`` (read with inert records: TP/PP/EP/VPP, dtype, a Hugging Face tokenizer). The legacy ``torch`` format puts ``mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt``
  in the iteration folder instead: read by verl_megatron's LegacyStore, the args, optimizer and RNG
  state in them unpickled as inert records.
  ``--ckpt-format torch_dcp`` (torch FSDP2) saves the whole state dict with ``torch.distributed.checkpoint`` instead:
  ``.metadata`` and ``.distcp`` files only, the args a pickled bytes item (read the same way); ``fsdp_dtensor``
  (Megatron FSDP) is refused.
- Megatron-Bridge: the same folders, plus ``iter_{N:07d}/run_config.yaml`` (``yaml.safe_dump`` of its
  ConfigContainer) and ``train_state.pt`` (and ``latest_train_state.pt`` beside the tracker file).
- ms-swift (``megatron sft``/``pt``): ``<output>/checkpoint-{N}/`` holding ``args.json``,
  ``latest_checkpointed_iteration.txt`` and ``iter_{N:07d}/`` (ms-swift 3: ``args.json`` beside
  ``iter_*`` in the output folder itself).
- NeMo 2: a checkpoint folder holding ``weights/`` (the dist checkpoint, keys under ``module.``) and
  ``context/`` (``io.json``, ``model.yaml``).

What is read here is names, ``stat`` and small text files (YAML through ``yaml.safe_load``, whose
loader builds plain values only; any tag is read as a plain value). Nothing a checkpoint holds runs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError

LATEST = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^iter_(\d{7,})$")
RELEASE = "release"
RUN_CONFIG = "run_config.yaml"  # Megatron-Bridge: training/utils/checkpoint_utils.py CONFIG_FILE
ARGS_JSON = "args.json"  # ms-swift: arguments/base_args/base_args.py save_args
DCP_METADATA = ".metadata"
TORCH_DIST_VERSIONS = (1,)  # megatron-core's torch_dist sharded_backend_version (dist_checkpointing/strategies/torch.py)
LEGACY_FILE = "model_optim_rng.pt"
_PLAIN_FILE = re.compile(r"^__\d+_\d+\.distcp$")
_MP_RANK = re.compile(r"^mp_rank_\d{2}(?:_\d{3})?(?:_\d{3})?$")
HF_EXPORT = "hf/"  # Megatron-Bridge's checkpoint.also_save_hf_checkpoint (checkpointing.py HF_WEIGHTS_SUBDIR)
MAX_TEXT = 4 << 20  # run configurations are kilobytes
MAX_COMMON = 16 << 20  # common.pt: args and small training state
# what Megatron-LM's model_optim_rng.pt / common.pt hold besides tensors (its args, numpy RNG state,
# enums): unpickled as inert records (torch_pickle), never constructed
MEGATRON_LM_STATE = ("argparse", "numpy", "_codecs", "megatron", "transformer_engine", "_io", "io", "enum", "signal")

BRIDGE_PEFT = ("LoRA", "CanonicalLoRA", "DoRA")  # megatron.bridge.peft classes megatron_lora reads
FRAMEWORKS = {"megatron-lm": "Megatron-LM", "megatron-bridge": "Megatron-Bridge", "ms-swift": "ms-swift", "nemo2": "NeMo 2"}
# what inspect, the plain flow and the Find step head such a checkpoint with (Candidate.kind: what is shown; the
# Format that reads it stays verl_megatron's, Candidate.format): the framework that saved it, not verl
SHOWN_KINDS = {"megatron-lm": "megatron-lm", "megatron-bridge": "megatron-bridge", "ms-swift": "ms-swift-megatron",
               "nemo2": "nemo2"}


def iteration_of(name: str) -> int | None:
    """The iteration an ``iter_NNNNNNN`` folder holds; 0 for ``release`` (Megatron-LM's number for it)."""
    if name == RELEASE:
        return 0
    m = ITER_DIR.match(name)
    return int(m.group(1)) if m else None


def iteration_name(n: int | str) -> str:
    return RELEASE if n == RELEASE else f"iter_{int(n):07d}"


def _names(folder: Path) -> set[str]:
    try:
        return {p.name for p in folder.iterdir()}
    except OSError:
        return set()


def is_nemo2(folder: Path, names: set[str] | None = None) -> bool:
    names = _names(folder) if names is None else names
    return "weights" in names and "context" in names and (folder / "weights").is_dir() and (folder / "context").is_dir()


def is_iteration(folder: Path) -> bool:
    """An ``iter_NNNNNNN`` / ``release`` folder (whatever it holds: an empty one is named when opened)."""
    return iteration_of(folder.name) is not None and folder.is_dir()


def iterations(run: Path) -> list[tuple[int, Path]]:
    """The iteration folders of a save folder, oldest first (``release`` as 0)."""
    try:
        found = [(n, p) for p in run.iterdir() if (n := iteration_of(p.name)) is not None and p.is_dir()]
    except OSError:
        return []
    return sorted(found)


def read_latest(run: Path) -> int | str | None:
    """What ``latest_checkpointed_iteration.txt`` names: a number, "release", or None (no file).
    A file that holds neither is said in one sentence."""
    path = run / LATEST
    if not path.is_file():
        return None
    try:
        text = path.read_bytes()[:64].decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise MergeError(
            f"{path} holds neither an iteration number nor \"release\"; point at an iter_NNNNNNN folder."
        ) from None


def is_run(folder: Path) -> bool:
    """A Megatron save folder: iteration folders, or the tracker file naming one (cheap)."""
    return bool(iterations(folder)) or ((folder / LATEST).is_file() and not _verl_steps(folder))


_SWIFT_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def _swift_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """ms-swift's output folder: its checkpoint-N folders that hold Megatron iterations, oldest first."""
    try:
        found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _SWIFT_CHECKPOINT.match(p.name))
                 and p.is_dir() and iterations(p)]
    except OSError:
        return []
    return sorted(found)


def _verl_steps(folder: Path) -> bool:
    try:
        return any(p.name.startswith("global_step_") for p in folder.iterdir())
    except OSError:
        return False


def resolve(path: Path) -> tuple[Path | None, list[str]]:
    """The iteration folder (or NeMo 2 checkpoint folder) that ``path`` names: itself, the one its
    tracker file names, else its newest. None when ``path`` is no Megatron save of these layouts.
    A tracker file naming a missing iteration, or a bad tracker file, is a MergeError."""
    notices: list[str] = []
    if is_iteration(path) or is_nemo2(path):
        return path, notices
    if path.name in ("weights", "context") and is_nemo2(path.parent):
        notices.append(f"Reading the whole NeMo 2 checkpoint in {path.parent}.")
        return path.parent, notices
    if iteration_of(path.parent.name) is not None and _MP_RANK.match(path.name):
        notices.append(f"Reading the whole checkpoint in {path.parent}.")
        return path.parent, notices
    if not is_run(path):
        swift = _swift_checkpoints(path)
        if not swift:
            return None, notices
        folder, more = resolve(swift[-1][1])
        notices.append(f"Using the newest checkpoint, {swift[-1][1].name}.")
        return folder, notices + more
    named = read_latest(path)
    if named is not None:
        folder = path / iteration_name(named)
        if not folder.is_dir():
            if not iterations(path):  # nothing says which trainer wrote it: verl names its steps global_step_N
                raise MergeError(
                    f"{path / LATEST} names {named}, but {path} holds neither {iteration_name(named)} (Megatron) nor "
                    f"global_step_{named} (verl); point at an existing checkpoint folder."
                )
            raise MergeError(
                f"{path / LATEST} names {iteration_name(named)} but {folder} does not exist; point at an existing "
                "iter_NNNNNNN folder."
            )
        return folder, notices
    found = iterations(path)
    if not found:
        return None, notices
    notices.append(f"Using the newest checkpoint, {found[-1][1].name}.")
    return found[-1][1], notices


# -- what a checkpoint records about its run ---------------------------------------------------------


@dataclass
class RunInfo:
    """What the files around a dist checkpoint say: the framework, the dist checkpoint folder, the run
    configuration read (None when there is none), the Hugging Face model it names and where that
    was said, the parallel sizes and dtype recorded."""

    framework: str  # a key of FRAMEWORKS
    model_dir: Path  # the dist checkpoint folder
    config_file: Path | None = None
    hf_ref: str | None = None
    hf_field: str | None = None  # where hf_ref was read ("model.hf_model_id")
    refs: list = field(default_factory=list)  # every (field, model) recorded, in the framework's order
    parallel: dict = field(default_factory=dict)  # tp, pp, ep, vpp (recorded ones only)
    dtype: str | None = None
    lora: str | None = None  # a PEFT run, in words (its checkpoint holds adapters only)
    peft: dict = field(default_factory=dict)  # Megatron-Bridge: run_config's peft section (alpha, dim, _target_)
    pretrained: str | None = None  # Megatron-Bridge: checkpoint.pretrained_checkpoint (a PEFT run's base)
    legacy: bool = False  # the legacy torch format (mp_rank_*/model_optim_rng.pt)
    family: str | None = None  # Megatron-LM: the model its args describe, in words
    args: dict = field(default_factory=dict)  # Megatron-LM: its pickled arguments (plain values)
    version: float | None = None  # Megatron-LM: the checkpoint_version beside them
    unlike: str | None = None  # Megatron-LM: how the model its args name differs from the args, in words
    ckpt_format: str | None = None  # Megatron-LM: "torch_dcp" / "fsdp_dtensor" when not torch_dist or torch

    @property
    def name(self) -> str:
        return FRAMEWORKS[self.framework]

    def source(self) -> str:
        """Where the Hugging Face model used was recorded, in words."""
        if self.hf_field == HF_EXPORT:
            return "the Hugging Face export Megatron-Bridge saved beside the iteration (also_save_hf_checkpoint)"
        return f"named by {self.hf_field} in {self.config_file.name}"


def _text(path: Path) -> str | None:
    try:
        if not path.is_file() or path.stat().st_size > MAX_TEXT:
            return None
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def read_yaml(path: Path) -> dict | None:
    """A YAML mapping read with PyYAML's safe loader (a dependency of transformers): plain values only;
    a tagged node (``!!python/...``) is read as the plain value under the tag, never constructed."""
    text = _text(path)
    if text is None:
        return None
    import yaml

    class _Plain(yaml.SafeLoader):
        pass

    def _untagged(loader, suffix, node):
        if isinstance(node, yaml.MappingNode):
            return loader.construct_mapping(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node, deep=True)
        return loader.construct_scalar(node)

    _Plain.add_multi_constructor("!", _untagged)
    _Plain.add_multi_constructor("tag:", _untagged)
    try:
        data = yaml.load(text, Loader=_Plain)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def read_json(path: Path) -> dict | None:
    text = _text(path)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _sizes(d: dict) -> dict:
    keys = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
            "ep": "expert_model_parallel_size", "vpp": "virtual_pipeline_model_parallel_size"}
    sizes = {k: v for k, key in keys.items() if (v := _int(d.get(key))) is not None}
    etp = _int(d.get("expert_tensor_parallel_size"))  # the experts' own TP (megatron-core's default: TP's)
    if etp is not None and etp != sizes.get("tp", 1):
        sizes["etp"] = etp
    return sizes


def _dtype(d: dict) -> str | None:
    for key in ("params_dtype", "torch_dtype", "dtype"):
        v = d.get(key)
        if isinstance(v, dict):  # Megatron's YAML representer: {_target_: torch.bfloat16, _call_: false}
            v = v.get("_target_")
        if isinstance(v, str) and v:
            return v.removeprefix("torch.")
    if d.get("bf16") is True:
        return "bfloat16"
    if d.get("fp16") is True:
        return "float16"
    return None


def _str(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def run_info(folder: Path) -> RunInfo:
    """What the iteration folder (or NeMo 2 checkpoint folder) ``folder`` is and what its run recorded."""
    return _first_ref(_run_info(folder))


def _run_info(folder: Path) -> RunInfo:
    """What the iteration folder (or NeMo 2 checkpoint folder) ``folder`` is and what its run recorded."""
    names = _names(folder)
    if is_nemo2(folder, names):
        info = RunInfo("nemo2", folder / "weights")
        model = read_yaml(folder / "context" / "model.yaml")
        if model is not None:
            info.config_file = folder / "context" / "model.yaml"
            config = model.get("config") if isinstance(model.get("config"), dict) else {}
            info.dtype = _dtype(config)
            tok = model.get("tokenizer") if isinstance(model.get("tokenizer"), dict) else {}
            name = _str(tok.get("pretrained_model_name"))
            if name:
                info.hf_ref, info.hf_field = name, "tokenizer.pretrained_model_name"
        return info
    legacy = not (DCP_METADATA in names) and any(_MP_RANK.match(n) for n in names)
    run = folder.parent
    if RUN_CONFIG in names:
        info = RunInfo("megatron-bridge", folder, folder / RUN_CONFIG, legacy=legacy)
        cfg = read_yaml(folder / RUN_CONFIG) or {}
        model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
        ckpt = cfg.get("checkpoint") if isinstance(cfg.get("checkpoint"), dict) else {}
        extra = model.get("extra_checkpoint_metadata") if isinstance(model.get("extra_checkpoint_metadata"), dict) else {}
        # Megatron-Bridge's own order (checkpointing.py _resolve_hf_source; checkpoint_utils.py get_hf_model_id_from_checkpoint)
        for where, value in (("checkpoint.hf_source_path", ckpt.get("hf_source_path")),
                             ("model.extra_checkpoint_metadata.hf_model_id", extra.get("hf_model_id")),
                             ("model.hf_model_id", model.get("hf_model_id"))):
            if _str(value) and value not in (v for _, v in info.refs):
                info.refs.append((where, value))
        if (folder / "hf" / "config.json").is_file():  # checkpoint.also_save_hf_checkpoint: the model in HF format
            info.refs.insert(0, (HF_EXPORT, str(folder / "hf")))
        info.parallel = _sizes(model)
        info.dtype = _dtype(model)
        if cfg.get("peft"):
            peft = cfg["peft"]
            target = peft.get("_target_", "") if isinstance(peft, dict) else ""
            info.lora = f"a Megatron-Bridge PEFT run ({str(target).rsplit('.', 1)[-1] or 'LoRA'})"
            info.peft = peft if isinstance(peft, dict) else {}
            info.pretrained = _str(ckpt.get("pretrained_checkpoint"))
        return info
    args_file = next((d / ARGS_JSON for d in (run, folder) if (d / ARGS_JSON).is_file()), None)
    if args_file is not None:
        info = RunInfo("ms-swift", folder, args_file, legacy=legacy)
        args = read_json(args_file) or {}
        # the local folder the model was loaded from first (model_dir), then what the user named (model)
        for where in ("model_dir", "model"):
            if _str(args.get(where)) and args[where] not in (v for _, v in info.refs):
                info.refs.append((where, args[where]))
        info.parallel = _sizes(args)
        info.dtype = _dtype(args)
        tuner = args.get("tuner_type") or args.get("train_type")
        if isinstance(tuner, str) and tuner != "full":
            info.lora = f"an ms-swift {tuner} run"
            # issue 39 (megatron_lora reads ms-swift's LoRA): rank, alpha, rsLoRA and its base checkpoint
            from tui_merger.core.formats.megatron_lora import swift_peft

            info.peft, info.pretrained = swift_peft(args)
        return info
    info = RunInfo("megatron-lm", folder, legacy=legacy)
    # the arguments: in common.pt (torch_dist), else in every rank file (the legacy format; its pickle only is read),
    # else (torch_dcp / fsdp_dtensor: torch.distributed.checkpoint.save of the whole state dict) a bytes item
    dcp = not legacy and DCP_METADATA in names and "common.pt" not in names and "metadata.json" not in names
    where = folder / "common.pt" if not legacy else next(
        (folder / n / LEGACY_FILE for n in sorted(names) if _MP_RANK.match(n) and (folder / n / LEGACY_FILE).is_file()), None)
    if dcp:
        from tui_merger.core.io.dcp import read_metadata

        try:
            md = read_metadata(folder)  # (a bad one is said when the checkpoint is read)
        except MergeError:
            md = None
        args, info.version, where = _dcp_args(folder, md)
        info.ckpt_format = _dcp_format(md, args)
    else:
        args, info.version = _megatron_lm_args(where, limit=None if legacy else MAX_COMMON) if where is not None else (None, None)
    if args is not None:
        info.config_file, info.args = where, args
        info.parallel = _sizes(args)
        info.dtype = _dtype(args)
        info.family = _args_family(args)
        # --tokenizer-model with a Hugging Face tokenizer: often the model's folder or hub id
        tok = args.get("tokenizer_model")
        if args.get("tokenizer_type") == "HuggingFaceTokenizer" and _str(tok):
            info.refs.append(("args.tokenizer_model", tok))
    return info


def _megatron_lm_args(path: Path, limit: int | None = MAX_COMMON, value: bool = False) -> tuple[dict | None, float | None]:
    """The arguments Megatron-LM pickled into a dist checkpoint's common.pt (or a legacy rank file's
    model_optim_rng.pt: only its pickle is read, not its tensors), as plain values (the
    ``argparse.Namespace`` is an inert record: its fields are read, nothing is constructed), and the
    ``checkpoint_version`` saved with them."""
    from tui_merger.core.io.torch_pickle import Record, TorchFile

    try:
        if not path.is_file() or limit is not None and path.stat().st_size > limit:
            return None, None
        tf = TorchFile(path, MEGATRON_LM_STATE)
    except (OSError, MergeError):
        return None, None
    try:
        if value:  # one value of a torch_dcp checkpoint: the args, or the version
            args, version = tf.obj, tf.obj
        else:
            args = tf.obj.get("args") if isinstance(tf.obj, dict) else None
            version = tf.obj.get("checkpoint_version") if isinstance(tf.obj, dict) else None
        version = version if isinstance(version, (int, float)) and not isinstance(version, bool) else None
        if not isinstance(args, Record):
            return None, version
        fields = {k: v for k, v in vars(args).items() if k not in ("args", "kwargs") and isinstance(k, str)}
        return {k: (str(v) if type(v).__module__ == "torch" else v) for k, v in fields.items()
                if v is None or isinstance(v, (str, int, float, bool)) or type(v).__module__ == "torch"}, version
    finally:
        tf.close()


def _dcp_args(folder: Path, md) -> tuple[dict | None, float | None, Path | None]:
    """Megatron-LM's arguments in a torch_dcp / fsdp_dtensor checkpoint: ``torch.distributed.checkpoint.save``
    writes each non-tensor value (``args``, ``checkpoint_version``) as a ``torch.save`` archive at the byte range
    ``.metadata`` names; those archives (kilobytes) are read as common.pt is. (args, version, the .distcp file)."""
    import tempfile

    from tui_merger.core.io.dcp import _field

    storage = _field(md, "storage_data") if md is not None else None
    where = {_field(index, "fqn", 0): info for index, info in storage.items()} if isinstance(storage, dict) else {}
    found: dict = {}
    with tempfile.TemporaryDirectory(prefix="tui-merger-args-") as tmp:
        for fqn in ("args", "checkpoint_version"):
            info = where.get(fqn)
            rel, start, length = (_field(info, n, i) for i, n in enumerate(("relative_path", "offset", "length")))
            if not (isinstance(rel, str) and _PLAIN_FILE.match(rel) and isinstance(start, int) and isinstance(length, int)
                    and 0 < length <= MAX_COMMON):
                continue
            try:
                with open(folder / rel, "rb") as f:
                    f.seek(start)
                    (Path(tmp) / fqn).write_bytes(f.read(length))
            except OSError:
                continue
            found[fqn] = (rel, _megatron_lm_args(Path(tmp) / fqn, value=True))
    if "args" not in found:
        return None, None, None
    rel, (args, _) = found["args"]
    version = found.get("checkpoint_version", (None, (None, None)))[1][1]
    return args, version, folder / rel


def _dcp_format(md, args: dict | None) -> str:
    """torch_dcp, or fsdp_dtensor (Megatron FSDP): its arguments say so, or its keys do (Megatron-LM's
    preprocess_fsdp_dtensor_state_dict and tools/checkpoint/checkpoint_inspector.py split SwiGLU's
    linear_fc1 into ``weight_w`` / ``weight_v`` and keep the model under ``model.module.``)."""
    from tui_merger.core.io.dcp import _field

    if (args or {}).get("ckpt_format") == "fsdp_dtensor" or (args or {}).get("use_megatron_fsdp"):
        return "fsdp_dtensor"
    keys = (_field(md, "state_dict_metadata") or {}) if md is not None else {}
    split = re.compile(r"\.linear_fc1\.(?:weight|bias)\d*_[wv]$")
    if any(isinstance(k, str) and (k.startswith("model.module.") or split.search(k)) for k in keys):
        return "fsdp_dtensor"
    return "torch_dcp"


def _args_family(args: dict) -> str | None:
    """The model Megatron-LM's arguments describe, in words (its args name no Hugging Face family)."""
    layers, hidden, heads = (_int(args.get(k)) for k in ("num_layers", "hidden_size", "num_attention_heads"))
    if not (layers and hidden and heads):
        return None
    groups = _int(args.get("num_query_groups")) if args.get("group_query_attention") else None
    parts = [f"{layers} layers", f"hidden {hidden}", f"{heads} heads" + (f" in {groups} query groups" if groups else "")]
    if args.get("multi_latent_attention"):
        parts.append("multi-latent attention")
    parts += [w for k, w in (("swiglu", "SwiGLU"), ("add_qkv_bias", "qkv bias"), ("qk_layernorm", "q/k norm")) if args.get(k)]
    if _str(args.get("normalization")):
        parts.append(args["normalization"])
    experts = _int(args.get("num_experts"))
    if experts:
        parts.append(f"MoE {experts} experts, top {args.get('moe_router_topk')}")
    if _int(args.get("mtp_num_layers")):
        parts.append(f"{args['mtp_num_layers']} MTP layer(s)")
    return "GPT (" + ", ".join(parts) + ")"


def _first_ref(info: RunInfo) -> RunInfo:
    if info.refs and info.hf_ref is None:
        info.hf_field, info.hf_ref = info.refs[0]
    return info


def base_sentence(info: RunInfo, folder: Path) -> str:
    """Why --base is needed for a checkpoint whose Hugging Face config is not on this machine."""
    if info.hf_ref and info.framework == "nemo2":
        return (
            f"{folder} is a NeMo 2 checkpoint: its weights have no Hugging Face config.json, and its "
            f"{info.config_file.name} names only the tokenizer ({info.hf_ref}); pass --base with the Hugging Face "
            "model the run started from (its config.json and tokenizer are used)."
        )
    if info.unlike:
        return (
            f"{folder} is a {info.name} checkpoint whose {info.config_file.name} names {info.hf_ref} ({info.hf_field}), "
            f"but {info.unlike}; pass --base with the Hugging Face model the run started from (its config.json and "
            "tokenizer are used)."
        )
    if info.refs:
        named = " and ".join(f"{v} ({f})" for f, v in info.refs)
        which = "which is not" if len(info.refs) == 1 else "neither of which is"
        return (
            f"{folder} is a {info.name} checkpoint whose {info.config_file.name} names {named}, {which} on this "
            "machine; pass --base with that model's folder (its config.json and tokenizer are used; tui-merger "
            "never downloads)."
        )
    said = f" and its {info.config_file.name} names no Hugging Face model" if info.config_file else ""
    return (
        f"{folder} is a {info.name} checkpoint: it holds no Hugging Face config.json{said}; pass --base with the "
        "Hugging Face model the run started from (its config.json and tokenizer are used)."
    )


def local_base(info: RunInfo, folder: Path) -> Path | None:
    """The folder with config.json that the run names, when it is on this machine (a path, relative
    ones tried beside the checkpoint too, or a Hub id in the Hugging Face cache)."""
    from tui_merger.core.io.hf_refs import resolve_model_reference

    if info.framework == "nemo2":
        return None
    for where, ref in info.refs:
        p = Path(ref).expanduser()
        found = None
        if not p.is_absolute():
            found = next((near / p for near in (folder, folder.parent, folder.parent.parent)
                          if (near / p / "config.json").is_file()), None)
        found = found or resolve_model_reference(ref)
        if found is not None and info.framework == "megatron-lm" and info.args:
            info.unlike = _unlike_args(info.args, found / "config.json")
            if info.unlike:  # a tokenizer borrowed from another model: its config is not this model's
                info.hf_field, info.hf_ref = where, ref
                return None
        if found is not None:
            info.hf_field, info.hf_ref = where, ref
            return found
    return None


def _unlike_args(args: dict, config_json: Path) -> str | None:
    """How the Hugging Face config a Megatron-LM run names differs from the model its args describe
    (layers, hidden size, heads), in words; None when they agree or cannot be compared."""
    cfg = read_json(config_json) or {}
    cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key, arg, what in (("num_hidden_layers", "num_layers", "layers"), ("hidden_size", "hidden_size", "hidden size"),
                           ("num_attention_heads", "num_attention_heads", "attention heads")):
        theirs, ours = _int(cfg.get(key)), _int(args.get(arg))
        if theirs and ours and theirs != ours:
            return f"its config.json says {what} {theirs} where the run's arguments say {ours}"
    return None


def _missing_rank(folder: Path, info: RunInfo) -> str | None:
    """The first legacy rank folder the run's arguments say was written and is not here (Megatron-LM's
    get_checkpoint_name: ``mp_rank_{tp:02d}``, ``_{pp:03d}`` when pipeline-parallel, ``_{ep:03d}`` when
    expert-parallel); None when the arguments are unknown or every one is here."""
    if not info.args:
        return None
    tp, pp, ep = (info.parallel.get(k, 1) for k in ("tp", "pp", "ep"))
    expected = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                for t in range(tp) for p in range(pp) for e in range(ep)]
    present = {n for n in _names(folder) if _MP_RANK.match(n)}
    if not present <= set(expected):  # folders the arguments do not explain: the rank files say what they are
        return None
    return next((n for n in expected if not (folder / n / LEGACY_FILE).is_file()), None)


def check_iteration(folder: Path, info: RunInfo) -> None:
    """One sentence for an iteration folder that cannot be converted: nothing in it, the legacy format,
    a PEFT run's adapter-only checkpoint that is not Megatron-Bridge's (read by megatron_lora)."""
    if info.lora and info.framework == "ms-swift":  # issue 39: megatron_lora reads ms-swift's LoRA
        from tui_merger.core.formats.megatron_lora import check_swift_tuner

        check_swift_tuner(folder, info)
    elif info.lora and info.framework == "megatron-bridge":
        peft = str(info.peft.get("_target_", "")).rsplit(".", 1)[-1]
        if peft not in BRIDGE_PEFT:
            raise MergeError(
                f"{folder} is a Megatron-Bridge PEFT run of {peft or 'a kind its run_config.yaml does not name'}, which "
                f"tui-merger does not merge (it reads {', '.join(BRIDGE_PEFT)}); export the adapter with Megatron-Bridge's "
                "AutoBridge.save_hf_adapter and merge it with --adapter and --base."
            )
    elif info.lora:
        raise MergeError(
            f"{folder} is {info.lora}: its dist checkpoint holds the adapters only, which tui-merger does not "
            "merge yet; export the adapter in Hugging Face PEFT format and merge it with --adapter and --base."
        )
    if info.args.get("use_legacy_models"):
        raise MergeError(
            f"{folder} was saved from Megatron-LM's legacy model classes (--use-legacy-models), whose tensor names "
            "tui-merger does not read; convert it to megatron-core first (Megatron-LM's tools/checkpoint/convert.py "
            "--loader legacy --saver core) and convert that."
        )
    if info.version is not None and info.version < 3:
        raise MergeError(
            f"{folder} is a Megatron-LM checkpoint of checkpoint_version {info.version}, whose query/key/value order "
            "tui-merger does not read (it reads version 3, megatron-core's); load it in Megatron-LM and save it again."
        )
    if info.legacy and info.parallel.get("etp", info.parallel.get("tp", 1)) != info.parallel.get("tp", 1):
        raise MergeError(
            f"{folder} is a Megatron-LM checkpoint in the legacy torch format saved with expert tensor parallelism "
            f"{info.parallel['etp']} and tensor parallelism {info.parallel.get('tp', 1)}: that format names its rank "
            "files by TP and EP rank only, so the expert tensor-parallel ranks wrote over each other's file and each "
            "expert is only partly in it; save the run again with --ckpt-format torch_dist and convert that."
        )
    if info.legacy:
        missing = _missing_rank(folder, info)
        if missing is not None:
            tp, pp, ep = (info.parallel.get(k, 1) for k in ("tp", "pp", "ep"))
            raise MergeError(
                f"{folder / missing / LEGACY_FILE} is missing: the run's arguments say TP {tp} x PP {pp} x EP {ep}, "
                f"{tp * pp * ep} rank folders; copy the whole {folder.name} folder again."
            )
        return  # the rank files themselves are checked when they are read (LegacyStore)
    if info.ckpt_format == "fsdp_dtensor":
        raise MergeError(
            f"{folder} is a Megatron-LM checkpoint in the fsdp_dtensor format (Megatron FSDP: linear_fc1 saved as "
            "weight_w / weight_v under model.module.), which tui-merger does not read; load it in Megatron-LM with "
            "--ckpt-convert-format torch_dist --ckpt-convert-save DIR and convert what that saves."
        )
    meta = read_json(info.model_dir / "metadata.json") or {}
    backend, version = meta.get("sharded_backend"), meta.get("sharded_backend_version")
    if isinstance(backend, str) and backend != "torch_dist":
        raise MergeError(
            f"{info.model_dir} is a megatron-core dist checkpoint in the {backend} format (its metadata.json), which "
            "tui-merger does not read; save it as torch_dist (Megatron-LM: --ckpt-convert-format torch_dist "
            "--ckpt-convert-save DIR) and convert that."
        )
    if backend == "torch_dist" and version not in (None, *TORCH_DIST_VERSIONS):
        raise MergeError(
            f"{info.model_dir} is a megatron-core torch_dist checkpoint of version {version} (its metadata.json), which "
            f"tui-merger does not read (it reads version {', '.join(map(str, TORCH_DIST_VERSIONS))}); save it in the "
            "legacy format (Megatron-LM: --ckpt-convert-format torch --ckpt-convert-save DIR) and convert that."
        )
    said = read_json(info.config_file) or {} if info.framework == "ms-swift" and info.config_file else {}
    if (not (info.model_dir / DCP_METADATA).is_file() and said.get("save_safetensors") is True
            and said.get("no_save_optim") is True):
        # issue 39: ms-swift's save_checkpoint passes no model to save_mcore_checkpoint then (only common.pt)
        raise MergeError(
            f"{info.model_dir} holds no weights: ms-swift saves none in its Megatron iteration when save_safetensors "
            f"and no_save_optim are both set (args.json); its weights are the Hugging Face files it wrote in "
            f"{info.model_dir.parent} (with merge_lora, the merged model in {info.model_dir.parent.name}-merged), so "
            "point tui-merger at those (an adapter with --adapter and --base)."
        )
    if not (info.model_dir / DCP_METADATA).is_file():
        raise MergeError(
            f"{info.model_dir} has no {DCP_METADATA} file (the dist checkpoint's index), so it holds no complete "
            "checkpoint; copy the whole folder again or point at another iteration."
        )


# -- inspect -------------------------------------------------------------------------------------------

_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")


def detect_run(s, folder: Path, names: dict, kind: str):
    """inspect: an iteration folder (or NeMo 2 checkpoint folder) of these layouts as a Candidate of the
    format ``kind``, shown as the framework that saved it (``SHOWN_KINDS``): its step and run (the save folder, whose tracker file marks the latest), the framework
    (as the backend), the parallel sizes, dtype and Hugging Face model its run recorded, and that
    model resolved on this machine like a PEFT adapter's base. None when it is none of them."""
    from tui_merger.core.formats.base import ALL, Candidate, Found, lora_info

    nemo = "weights" in names and "context" in names and is_nemo2(folder, set(names))
    step = iteration_of(folder.name)
    if not nemo and step is None:
        return None
    info = run_info(folder)
    c = Candidate(SHOWN_KINDS[info.framework], str(folder), backend=info.framework, format=kind)
    if step is not None and folder.name != RELEASE:
        c.run, c.step = str(folder.parent), step
        if info.framework == "ms-swift" and _SWIFT_CHECKPOINT.match(folder.parent.name):
            c.run = str(folder.parent.parent)  # one iteration per checkpoint-N: the run is the output folder
    elif step is not None:  # release/: no step; latest when the tracker file says so
        try:
            c.latest = read_latest(folder.parent) == RELEASE
        except MergeError as err:
            s.problem(folder.parent / LATEST, str(err).removeprefix(str(folder.parent / LATEST)).strip())
        c.notes.append("the release checkpoint (Megatron-LM loads it without optimizer or RNG state).")
    dcp = s.names(info.model_dir) if info.model_dir != folder else names
    if info.legacy:
        c.world_size = sum(1 for n in names if _MP_RANK.match(n)) or None
    else:
        c.world_size = len({m.group(1) for n in dcp if (m := _DISTCP.match(n))}) or None
    c.dtype = info.dtype or _stored_dtype(s, info.model_dir)
    parallel = ", ".join(f"{k.upper()} {v}" for k, v in info.parallel.items())
    what = (f"a legacy Megatron checkpoint (mp_rank_*/{LEGACY_FILE}) saved by {info.name}" if info.legacy
            else f"a torch.distributed.checkpoint of the whole state dict (--ckpt-format {info.ckpt_format}) saved by "
            f"{info.name}" if info.ckpt_format else f"a megatron-core dist checkpoint saved by {info.name}")
    if info.config_file is not None:
        what += f" ({info.config_file.name}" + (f": {parallel})" if parallel else ")")
    c.notes.append(what + ".")
    try:
        check_iteration(folder, info)
        if info.lora:
            alpha = info.peft.get("alpha")
            here = pretrained_iteration(info, folder)
            base = (f"the base checkpoint {here}" if here is not None else
                    f"the Hugging Face model (its base checkpoint {info.pretrained} is not on this machine)"
                    if info.pretrained else "the Hugging Face model")
            c.notes.append(f"{info.lora[0].upper()}{info.lora[1:]}: adapters only (r {info.peft.get('dim')}, alpha {alpha}), "
                           f"merged into {base}.")
            # issue 39: the LoRA as inspect shows any adapter's (r, alpha, rsLoRA/DoRA, the targets the run names)
            c.lora = lora_info({"r": info.peft.get("dim"), "lora_alpha": alpha, "use_rslora": info.peft.get("use_rslora"),
                                "use_dora": str(info.peft.get("_target_", "")).endswith("DoRA"),
                                "target_modules": info.peft.get("target_modules")})
    except MergeError as err:
        c.notes.append(str(err))
    if info.legacy or (info.model_dir / DCP_METADATA).is_file():
        family = _family(info)
        if family:
            c.notes.append(f"model family: {family}.")
    tokenizer = folder / "tokenizer"  # Megatron-Bridge's save_tokenizer_assets
    c.tokenizer = tokenizer.is_dir()
    found = local_base(info, folder)
    c.needs_base = found is None
    c.base_model = info.hf_ref if info.framework != "nemo2" and not info.unlike else None
    if found is not None:
        c.base_path = str(found)
        c.base_resolves = "hf-cache" if any(part.startswith("models--") for part in found.parts) else "path"
        c.notes.append(f"its Hugging Face config: {found}, {info.source()}.")
    elif info.framework == "nemo2":  # issue 39: the config built from context/model.yaml (nemo2_config)
        from tui_merger.core.formats.nemo2_config import inspect_sentence

        c.needs_base, sentence = inspect_sentence(folder, read_yaml(folder / "context" / "model.yaml"))
        c.notes.append(sentence)
        c.tokenizer = c.tokenizer or (folder / "context" / "nemo_tokenizer").is_dir()
    else:
        c.base_resolves = "missing" if c.base_model else None
        c.notes.append(base_sentence(info, folder))
    s.sized(c, names.values(), recursive=True)
    return Found(c, ALL)


def next_step(c, path: str, base: str, alpha: str, out: str) -> str:
    """The command inspect suggests for one of these checkpoints: the plain merge of the iteration folder
    (the layout is detected: verl's ``--backend megatron --local_dir`` is for verl's own layouts)."""
    from shlex import quote

    return f"tui-merger merge {quote(path)}{base}{alpha} --out {quote(out)}"


def _family(info: RunInfo) -> str | None:
    """The model family a run configuration records (Megatron-Bridge's provider class, ms-swift's
    model_type, NeMo 2's model class), in its own words."""
    if info.config_file is None:
        return None
    if info.framework == "megatron-lm":
        return info.family
    if info.framework == "ms-swift":
        v = (read_json(info.config_file) or {}).get("model_type")
        return v if isinstance(v, str) and v else None
    data = read_yaml(info.config_file) or {}
    target = data.get("_target_") if info.framework == "nemo2" else (data.get("model") or {}).get("_target_") if isinstance(data.get("model"), dict) else None
    return str(target).rsplit(".", 1)[-1] if isinstance(target, str) and target else None


def _stored_dtype(s, model_dir: Path) -> str | None:
    """The dtype of the word embedding as the dist checkpoint's index (``.metadata``) records it."""
    from tui_merger.core.io.dcp import read_metadata

    if not (model_dir / DCP_METADATA).is_file():
        return None
    try:
        meta = read_metadata(model_dir).state_dict_metadata
    except MergeError as err:
        s.problem(model_dir / DCP_METADATA, str(err))
        return None
    for key, value in meta.items():
        if str(key).endswith("embedding.word_embeddings.weight"):
            props = getattr(value, "properties", None)  # an inert record: its pickled state, dtype first
            dtype = getattr(props, "dtype", None)
            state = getattr(props, "state", None)
            if dtype is None and isinstance(state, tuple) and state:
                dtype = state[0]
            return str(dtype).removeprefix("torch.") if dtype is not None else None
    return None


def pretrained_iteration(info: RunInfo, folder: Path) -> Path | None:
    """The iteration folder of the base checkpoint a Megatron-Bridge PEFT run names
    (``checkpoint.pretrained_checkpoint``), when it is on this machine: the path as written, else relative
    to the run's folders (a run records the path its user typed)."""
    if not info.pretrained:
        return None
    p = Path(info.pretrained).expanduser()
    tries = [p] if p.is_absolute() else [near / p for near in (folder, folder.parent, folder.parent.parent, Path.cwd())]
    for t in tries:
        if t.is_dir():
            found, _ = resolve(t)
            if found is not None:
                return found
    return None
