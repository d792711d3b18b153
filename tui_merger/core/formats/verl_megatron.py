"""verl Megatron checkpoints -> Hugging Face names, without megatron-core.

Layouts (verl; see docs/checkpoint-formats.md section 2):

- v2 (0.9+): ``actor/model/dist_ckpt`` + ``actor/model/huggingface`` (+ ``ckpt_contents.json``); when
  ``model/huggingface`` already holds the weights (mbridge), it is a Hugging Face model to copy;
- v1 (0.4.1-0.8): ``actor/dist_ckpt`` + ``actor/huggingface``;
- legacy (<= 0.4.0): ``actor/model/mp_rank_XX[_YYY][_ZZZ]/model.pt``, a list of per-virtual-pipeline-chunk
  state dicts per tensor/pipeline/expert rank, config in ``actor/hf_config_and_tokenizer``.

A dist checkpoint is a PyTorch DCP folder read by :mod:`tui_merger.core.io.dcp`; its tensors have their
global shapes whatever the training's parallelism. The legacy rank files are reassembled into the same
form (TP shards placed by the rules Megatron splits them with, layers numbered across pipeline and
virtual-pipeline chunks). Every Hugging Face tensor is then a list of regions of those tensors (q, k
and v are row ranges of ``linear_qkv`` per KV group; gate and up the two halves of ``linear_fc1``),
read chunk by chunk when it is written.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from shlex import quote
from types import SimpleNamespace

from tui_merger.core.io.dcp import METADATA, Chunk, ChunkedTensor, ChunkStore, DcpStore, check_coverage
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.adapter import (chosen_alpha, export_peft_adapter, lora_train_meta_path, read_lora_train_meta,
                                             renamed)
from tui_merger.core.formats.megatron_lora import SHARDS_DIR, shard_files
from tui_merger.core.formats.megatron_runs import FRAMEWORKS, MEGATRON_LM_STATE
from tui_merger.core.formats.base import ALL, STEP_DIR, Candidate, Format, Found, Reference, is_dir, lora_info, step_of
from tui_merger.core.formats.verl_fsdp import _rank_files
from tui_merger.core.io.files import TOKENIZER_MARKERS, config_dtype
from tui_merger.core.io.sources import TensorRef, find_weight_files, not_a_folder

MP_RANK = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
SUPPORTED = "Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, GLM-4.5 and DeepSeek-V3"
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE"}
_ARCH_FAMILY = {
    "Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3", "Qwen2Moe": "qwen2_moe", "Qwen3Moe": "qwen3_moe",
}
# -- GLM-4.5 and DeepSeek-V3 (MoE with expert bias and shared experts; DeepSeek-V3 multi-latent attention,
# megatron_mla.py); their multi-token prediction layers: MTP_PLACES below
FAMILIES.update({"glm4_moe": "GLM-4.5", "deepseek_v3": "DeepSeek-V3"})
_ARCH_FAMILY.update({"Glm4Moe": "glm4_moe", "DeepseekV3": "deepseek_v3"})
_DEEPSEEK_MOE = ("glm4_moe", "deepseek_v3")  # routed experts from first_k_dense_replace on, shared_experts, expert bias
_MLA = ("deepseek_v3",)
# -- end GLM-4.5 / DeepSeek-V3
# Qwen3-Next (Gated DeltaNet layers, gated attention, its MTP layer): mapped by megatron_gdn on this mapper
FAMILIES["qwen3_next"] = "Qwen3-Next"
_ARCH_FAMILY["Qwen3Next"] = "qwen3_next"
_ROLES = ("actor", "critic")
BLOCK_BYTES = 16 << 20  # the largest row block converted at once


# -- finding the checkpoint ---------------------------------------------------------------------------


@dataclass
class MegatronLayout:
    kind: str  # "v1", "v2", "legacy", or "hf" (model/huggingface already holds the weights)
    folder: Path  # the actor / critic folder
    model_dir: Path  # the dist_ckpt folder, the folder of mp_rank_* folders, or the HF weights folder
    hf_dir: Path | None  # config.json (+ tokenizer)
    role: str = "actor"
    step: int | None = None
    notices: list[str] = field(default_factory=list)
    lora: "LoraRun | None" = None  # a LoRA run (Megatron-Bridge PEFT): its adapter, not the model
    run: "RunInfo | None" = None  # kind "mcore": saved by Megatron-LM, Megatron-Bridge, ms-swift or NeMo 2
    missing_base: str | None = None  # kind "mcore" without a config: why --base is needed
    config_file: Path | None = None  # the file the config was built from when it is no config.json (NeMo 2's model.yaml)


@dataclass
class LoraRun:
    """A verl Megatron LoRA run: the base weights are not in it. ``export``: the Hugging Face PEFT export
    of the adapter (``model/huggingface/adapter/``, Megatron-Bridge's), None when the run has none;
    ``shards``: where its Megatron-side adapter shards are, in words (None: none seen)."""

    export: Path | None
    shards: str | None
    shard_dir: Path | None = None  # adapter_checkpoint/ with mp_rank_*_adapter.pt files (read by megatron_lora)
    dist_dir: Path | None = None  # verl v2 + Megatron-Bridge PEFT: the adapters' dist checkpoint (model/dist_ckpt)


def _lora_run(folder: Path) -> LoraRun | None:
    """Cheap (names and the small ckpt_contents.json): whether ``folder`` is a LoRA run, and its adapter."""
    export = next(
        (d for d in (folder / "model" / "huggingface" / "adapter", folder / "huggingface" / "adapter")
         if (d / "adapter_config.json").is_file()),
        None,
    )
    shards = shard_dir = None
    if (folder / SHARDS_DIR).is_dir():
        shards = f"{SHARDS_DIR}/"
        shard_dir = folder / SHARDS_DIR if shard_files(folder / SHARDS_DIR) else None
    manifest = {}
    try:
        manifest = json.loads((folder / "ckpt_contents.json").read_text())
    except (OSError, ValueError):
        pass
    if not isinstance(manifest, dict):
        manifest = {}
    backend = manifest.get("backend") if isinstance(manifest.get("backend"), dict) else {}
    contents = manifest.get("contents") if isinstance(manifest.get("contents"), dict) else {}
    peft = bool(backend.get("peft")) or "peft_adapters" in contents or bool(manifest.get("peft_adapter_path"))
    if peft and shards is None:
        where = contents.get("peft_adapters", {}).get("path") if isinstance(contents.get("peft_adapters"), dict) else None
        shards = f"{str(where or 'model/dist_ckpt').rstrip('/')}/"
    if export is None and shards is None:
        return None
    return LoraRun(export, shards, shard_dir, _peft_dist_dir(folder, contents) if peft and shard_dir is None else None)


def _peft_dist_dir(folder: Path, contents: dict) -> Path | None:
    """issue 39: verl's v2 layout with Megatron-Bridge PEFT (megatron_checkpoint_manager.py save_checkpoint: the
    model's sharded state dict filtered to its adapters by Bridge's apply_peft_adapter_filter_to_state_dict, saved
    to model/dist_ckpt; ckpt_contents.json's contents.peft_adapters.path names it): that dist checkpoint, when it
    is one (its .metadata is there) inside the run's folder."""
    where = contents.get("peft_adapters", {}).get("path") if isinstance(contents.get("peft_adapters"), dict) else None
    rel = Path(where) if isinstance(where, str) and where else Path("model") / "dist_ckpt"
    if rel.is_absolute() or ".." in rel.parts:
        return None
    return folder / rel if (folder / rel / METADATA).is_file() else None


def lora_refusal(folder: Path, lora: LoraRun) -> str:
    """The sentence for a LoRA run with neither its Hugging Face adapter export nor verl's adapter shards."""
    if lora.shards == f"{SHARDS_DIR}/":
        return (
            f"{folder / SHARDS_DIR} holds no mp_rank_*_adapter.pt files; copy the run's whole {SHARDS_DIR}/ folder "
            "again."
        )
    # issue 39: a complete one is merged (_peft_dist_dir); here its index is missing
    return (
        f"{folder / lora.shards.rstrip('/')} holds no complete dist checkpoint of the run's Megatron-Bridge adapters (no "
        f"{METADATA}, its index) and there is no Hugging Face adapter export in model/huggingface/adapter/; copy the "
        "run's whole model/ folder again, or merge the exported adapter with --adapter and --base."
    )


def _mp_rank_dirs(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if MP_RANK.match(p.name) and p.is_dir())
    except OSError:
        return []


def _layout_here(folder: Path) -> tuple[str, Path, Path | None] | None:
    """(kind, model folder, config folder) when ``folder`` is a verl Megatron actor/critic folder."""
    model = folder / "model"
    if (model / "dist_ckpt").is_dir() or (folder / "ckpt_contents.json").is_file():
        hf = model / "huggingface"
        if hf.is_dir() and (hf / "config.json").is_file() and _has_weights(hf):
            return "hf", hf, hf
        if not hf.is_dir() and (folder / "huggingface").is_dir():
            hf = folder / "huggingface"
        return "v2", model / "dist_ckpt", hf
    if (folder / "dist_ckpt").is_dir():
        return "v1", folder / "dist_ckpt", folder / "huggingface"
    if model.is_dir() and _mp_rank_dirs(model):
        hf = folder / "hf_config_and_tokenizer"
        if not hf.is_dir() and (folder / "huggingface").is_dir():
            hf = folder / "huggingface"
        return "legacy", model, hf
    if (folder / SHARDS_DIR).is_dir() and ((folder / "huggingface").is_dir() or (folder / "transformer_config.json").is_file()):
        return "adapters", folder / SHARDS_DIR, folder / "huggingface"
    return None


def _has_weights(folder: Path) -> bool:
    try:
        return bool(find_weight_files(folder))
    except MergeError:  # a damaged index: weights were meant to be there (opening them says what is wrong)
        return True


def _step_of(path: Path) -> int | None:
    m = STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def _resolve(path: Path) -> tuple[Path | None, list[str]]:
    """The actor/critic folder a run, step, actor or dist_ckpt path points at (None: not Megatron)."""
    notices: list[str] = []
    # inside the checkpoint: actor/dist_ckpt, actor/model, actor/model/dist_ckpt
    for up in (path, path.parent, path.parent.parent):
        if up == path or path.name in ("dist_ckpt", "model", "huggingface", SHARDS_DIR):
            if _layout_here(up) and not _rank_files(up):
                if up != path:
                    notices.append(f"Reading the whole checkpoint in {up}.")
                return up, notices
    folder = path
    latest = folder / "latest_checkpointed_iteration.txt"
    if latest.is_file():
        try:
            n = int(latest.read_text().strip())
        except (OSError, ValueError):
            n = None
        if n is not None and (folder / f"global_step_{n}").is_dir():
            folder = folder / f"global_step_{n}"
    elif _step_of(folder) is None:
        try:
            steps = sorted((s, p) for p in folder.iterdir() if p.is_dir() and (s := _step_of(p)) is not None)
        except OSError:
            steps = []
        if steps:
            folder = steps[-1][1]
            notices.append(f"Using the newest checkpoint, {folder.name}.")
    if _layout_here(folder) and not _rank_files(folder):
        return folder, notices
    found = [folder / r for r in _ROLES if _layout_here(folder / r) and not _rank_files(folder / r)]
    if not found:
        return None, notices
    if len(found) > 1:
        notices.append(f"{folder} also has a critic; converting the actor (point at critic/ for it).")
    return found[0], notices


def is_megatron_checkpoint(path) -> bool:
    """Cheap (names and stat only): whether ``path`` points at a Megatron checkpoint (verl's, or one of
    the layouts of megatron_runs)."""
    from tui_merger.core.formats.megatron_runs import resolve

    try:
        if resolve(Path(path))[0] is not None:
            return True
    except MergeError:
        return True  # a Megatron save with a bad tracker file: opening it says so
    except OSError:
        return False
    try:
        return _resolve(Path(path))[0] is not None
    except (OSError, MergeError):
        return False


def find_megatron_checkpoint(path) -> MegatronLayout:
    path = Path(path)
    if not path.is_dir():
        raise not_a_folder(path, "--local_dir", "checkpoint")
    mcore = _mcore_layout(path)
    if mcore is not None:
        return mcore
    folder, notices = _resolve(path)
    if folder is None:
        latest = path / "latest_checkpointed_iteration.txt"
        try:
            n = int(latest.read_text().strip()) if latest.is_file() else None
        except (OSError, ValueError):
            raise MergeError(f"{latest} does not hold a step number; point at a global_step_N folder.") from None
        if n is not None and not (path / f"global_step_{n}").is_dir():
            raise MergeError(
                f"{latest} names step {n} but {path / f'global_step_{n}'} does not exist; point at an existing step."
            )
        raise MergeError(
            f"No verl Megatron checkpoint (dist_ckpt/, model/dist_ckpt/ or model/mp_rank_*/) under {path}; "
            "point at a run folder, a global_step_N folder or its actor/ folder."
        )
    kind, model_dir, hf_dir = _layout_here(folder)
    role = folder.name if folder.name in _ROLES else _contents_role(folder)
    step = _step_of(folder.parent) if folder.name in _ROLES else _step_of(folder)
    layout = MegatronLayout(kind, folder, model_dir, hf_dir if hf_dir and hf_dir.is_dir() else None, role, step, notices)
    if kind == "hf":
        layout.notices.append(
            f"{model_dir} already holds the model in Hugging Face format (saved by mbridge): it is copied and "
            "verified, there is nothing to convert."
        )
    else:
        layout.lora = _lora_run(folder)
        if (layout.lora is not None and layout.lora.export is None and layout.lora.shard_dir is None
                and layout.lora.dist_dir is None):
            raise MergeError(lora_refusal(folder, layout.lora))
    return layout


def _mcore_layout(path: Path) -> MegatronLayout | None:
    """A megatron-core dist checkpoint saved by Megatron-LM, Megatron-Bridge, ms-swift or NeMo 2
    (megatron_runs): the iteration folder, its dist checkpoint, and the Hugging Face config its run
    names when that is on this machine."""
    from tui_merger.core.formats.megatron_runs import check_iteration, base_sentence, iteration_of, local_base, resolve, run_info

    folder, notices = resolve(path)
    if folder is None:
        return None
    info = run_info(folder)
    check_iteration(folder, info)
    base = local_base(info, folder)
    layout = MegatronLayout("mcore", folder, info.model_dir, base, "actor", iteration_of(folder.name), notices, run=info)
    if base is None:
        layout.missing_base = base_sentence(info, folder)
    return layout


def _contents_role(folder: Path) -> str:
    try:
        role = json.loads((folder / "ckpt_contents.json").read_text()).get("role")
    except (OSError, ValueError, AttributeError):
        return "actor"
    return role if role in _ROLES else "actor"


# -- keys -------------------------------------------------------------------------------------------


def skip_key(key: str) -> bool:
    """What a model conversion never reads: optimizer state, RNG state, Transformer Engine extra state."""
    return key.startswith(("optimizer.", "optimizer/", "rng_state")) or "_extra_state" in key


def canonical(key: str) -> str:
    """The name without verl's virtual-pipeline (``model0.``) or wrapper (``module.``) prefixes."""
    return re.sub(r"^(?:model\d*\.|module\.)+", "", key)


# -- legacy mp_rank files ---------------------------------------------------------------------------

_DIM1 = ("linear_proj.weight", "linear_fc2.weight")
_DIM0 = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")
_GLU = ("linear_fc1.weight", "linear_fc1.bias")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


_EXPERT = re.compile(
    r"^(?P<pre>decoder\.layers\.\d+\.mlp\.experts\.)"
    r"(?:weight(?P<grouped>[12])|linear_fc(?P<fc>[12])\.(?P<what>weight|bias)(?P<te>\d+)"
    r"|local_experts\.(?P<local>\d+)\.(?P<rest>.+))$"
)


class LegacyStore(ChunkStore):
    """The legacy per-rank ``model.pt`` files as global tensors: TP shards placed where Megatron
    took them from (dim 1 for linear_proj / linear_fc2; dim 0 otherwise, fc1's gate and up halves
    of every rank apart), norms from TP rank 0, layers numbered across pipeline and virtual chunks,
    experts numbered across expert-parallel ranks.

    Rank folders are ``mp_rank_{tp:02d}``, then ``_{pp:03d}`` when pipeline-parallel, then
    ``_{ep:03d}`` when expert-parallel (Megatron-LM's ``get_checkpoint_name``, which verl <= 0.4.0
    copied): a second number alone is a pipeline stage unless every rank holds the embedding (only
    the first stage does), and then an expert-parallel rank. Each rank's experts, whichever module
    held them, become ``mlp.experts.local_experts.{global expert}.linear_fc{1,2}.*`` (the
    SequentialMLP names): SequentialMLP's ``local_experts.{e}``, TEGroupedMLP's
    ``linear_fc1.weight{e}``, and the legacy GroupedMLP's ``weight1`` [hidden, E_local * fc1 rows]
    / ``weight2`` [E_local * fc2 columns, hidden], which Megatron views as (E_local, hidden, rows)
    / (E_local, columns, hidden) and multiplies untransposed (``experts`` says how many experts the
    config has: the only place the grouped tensors' expert count is said)."""

    def __init__(self, model_dir: Path, experts: int | None = None, expert_ffn: int | None = None,
                 rank_file: str = "model.pt") -> None:
        self.model_dir = Path(model_dir)
        # Megatron-LM's own rank files (model_optim_rng.pt) also hold its args, optimizer and RNG state
        self.rank_file = rank_file
        self.inert = MEGATRON_LM_STATE if rank_file != "model.pt" else ()
        self.experts = experts if isinstance(experts, int) and experts > 0 else None
        self.expert_ffn = expert_ffn if isinstance(expert_ffn, int) and expert_ffn > 0 else None
        self.files = []
        self.data_files: list[str] = []
        try:
            tensors = self._assemble(self._grid())
            check_coverage(tensors, self.model_dir)
        except BaseException:
            self.close()
            raise
        super().__init__(tensors)

    def _grid(self) -> dict[tuple[int, int, int], Path]:
        """(tp, pp, ep) -> model.pt of every rank, checked complete."""
        found: dict[tuple[int, ...], Path] = {}
        for d in _mp_rank_dirs(self.model_dir):
            found[tuple(int(g) for g in MP_RANK.match(d.name).groups() if g is not None)] = d
        if len({len(k) for k in found}) > 1:
            names = sorted(d.name for d in found.values())
            raise MergeError(
                f"{self.model_dir} mixes rank folders named in different ways ({names[0]}, {names[-1]}); they come "
                "from different runs: keep the folders of one run only."
            )
        for d in found.values():
            if not (d / self.rank_file).is_file():
                raise MergeError(
                    f"{d / self.rank_file} is missing from this legacy Megatron checkpoint; copy the whole model/ folder "
                    "again."
                )
        width = len(next(iter(found)))
        if width == 3:
            grid = {k: found[k] for k in found}
        elif width == 2 and self._second_is_expert_rank(found):
            grid = {(tp, 0, ep): d for (tp, ep), d in found.items()}
        else:
            grid = {(k[0], k[1] if width == 2 else 0, 0): d for k, d in found.items()}
        tps, pps, eps = (1 + max(k[i] for k in grid) for i in range(3))
        for tp in range(tps):
            for pp in range(pps):
                for ep in range(eps):
                    if (tp, pp, ep) not in grid:
                        name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pps > 1 else "") + (f"_{ep:03d}" if eps > 1 else "")
                        what = "tensor x pipeline" + (" x expert" if eps > 1 else "")
                        size = f"{tps}x{pps}" + (f"x{eps}" if eps > 1 else "")
                        raise MergeError(
                            f"{self.model_dir / name / self.rank_file} is missing from this {size} ({what}) legacy Megatron "
                            "checkpoint; copy the whole model/ folder again."
                        )
        return {k: v / self.rank_file for k, v in grid.items()}

    def _second_is_expert_rank(self, found) -> bool:
        """mp_rank_XX_YYY: YYY is an expert-parallel rank when every rank file holds the embedding (no
        pipeline: one stage holds everything), a pipeline stage otherwise."""
        if len({k[1] for k in found}) < 2:
            return False
        from tui_merger.core.io.torch_pickle import TorchFile

        for d in found.values():
            tf = TorchFile(d / self.rank_file, self.inert)
            try:
                chunks = self._chunks(d / self.rank_file, tf.obj)
                if not chunks or "embedding.word_embeddings.weight" not in chunks[0]:
                    return False
            finally:
                tf.close()
        return True

    @staticmethod
    def _chunks(path: Path, obj) -> list[dict]:
        if isinstance(obj, dict) and "checkpoint_version" in obj:  # Megatron-LM: {"args", "model"|"model0".., ...}
            obj = {k: v for k, v in obj.items() if isinstance(k, str) and re.fullmatch(r"model\d*", k)}
            if not obj:
                raise MergeError(f"{path} holds no model state (no model key); it is not a complete Megatron-LM checkpoint.")
        if isinstance(obj, dict) and obj and all(isinstance(k, str) and re.fullmatch(r"model\d*", k) for k in obj):
            obj = [obj[k] for k in sorted(obj, key=lambda k: int(k[5:] or 0))]
        if isinstance(obj, dict):
            obj = [obj]
        if not isinstance(obj, list) or not all(isinstance(c, dict) for c in obj):
            raise MergeError(f"{path} does not hold Megatron model state dicts; it is not a verl checkpoint file.")
        return obj

    def _load(self, path: Path) -> list[dict]:
        from tui_merger.core.io.torch_pickle import TorchFile, require_names

        tf = TorchFile(path, self.inert)
        self.files.append(tf)
        self.data_files.append(str(path.relative_to(self.model_dir)))
        obj = self._chunks(path, tf.obj)
        for chunk in obj:
            require_names(path, chunk)
        return [(tf, c) for c in obj]

    def _tensors_of(self, sd: dict, ep: int, eps: int, tps: int, path: Path) -> dict:
        """A rank's tensors with its experts under global SequentialMLP names (see the class)."""
        from tui_merger.core.io.torch_pickle import Record

        out, local = {}, {}
        for key, t in sd.items():
            if skip_key(key) or not hasattr(t, "shape") or isinstance(t, Record):  # an inert record is no tensor
                continue
            m = _EXPERT.match(key)
            if m is None:
                out[key] = t
            else:
                local.setdefault(m.group("pre"), []).append((m, t))
        for pre, entries in local.items():
            numbered = [int(m.group("te") or m.group("local")) for m, _ in entries if not m.group("grouped")]
            grouped = [(m, t) for m, t in entries if m.group("grouped")]
            if grouped:
                if self.experts is None:
                    raise MergeError(
                        f"{path} holds grouped experts ({pre}weight1), whose number only the model's config says, "
                        "and the config names none (num_experts); copy the config.json saved with the checkpoint."
                    )
                if self.experts % eps:
                    raise MergeError(
                        f"The config says {self.experts} experts, which do not split over the {eps} expert-parallel "
                        f"ranks of {self.model_dir}; copy the config.json saved with the checkpoint."
                    )
            if grouped and numbered:
                raise MergeError(
                    f"{path} holds both grouped ({pre}weight1) and per-expert tensors for one layer; the file is damaged."
                )
            n_local = self.experts // eps if grouped else 1 + max(numbered)
            if numbered and sorted(set(numbered)) != list(range(n_local)):
                raise MergeError(
                    f"{path}: the experts of {pre[:-len('mlp.experts.')]} are numbered {sorted(set(numbered))[:8]}, "
                    "not from 0; the file is damaged."
                )
            for m, t in entries:
                base = f"{pre}local_experts."
                if m.group("grouped"):
                    which = m.group("grouped")
                    hidden = t.shape[0] if which == "1" else t.shape[-1]
                    rows = t.numel() // (n_local * hidden) if len(t.shape) == 2 else 0
                    want = None if self.expert_ffn is None else self.expert_ffn * (2 if which == "1" else 1) // tps
                    if len(t.shape) != 2 or not t.is_contiguous() or t.numel() % (n_local * hidden) or (
                        want is not None and rows != want
                    ):
                        raise MergeError(
                            f"{path}: {m.group(0)} of shape {list(t.shape)} does not hold {n_local} experts per rank "
                            f"(the config says {self.experts} experts over {eps} expert-parallel ranks"
                            + (f", moe_intermediate_size {self.expert_ffn}" if self.expert_ffn else "")
                            + "); copy the config.json saved with the checkpoint."
                        )
                    view = t.view(n_local, hidden, -1) if which == "1" else t.view(n_local, -1, hidden)
                    for le in range(n_local):
                        out[f"{base}{ep * n_local + le}.linear_fc{which}.weight"] = view[le].t()
                elif m.group("te"):
                    out[f"{base}{ep * n_local + int(m.group('te'))}.linear_fc{m.group('fc')}.{m.group('what')}"] = t
                else:
                    out[f"{base}{ep * n_local + int(m.group('local'))}.{m.group('rest')}"] = t
        return out

    def _assemble(self, grid) -> dict[str, ChunkedTensor]:
        tps, pps, eps = (1 + max(k[i] for k in grid) for i in range(3))
        loaded = {k: self._load(p) for k, p in sorted(grid.items())}
        vpps = {len(v) for v in loaded.values()}
        if len(vpps) != 1:
            raise MergeError(
                f"The rank files in {self.model_dir} hold different numbers of model chunks; they come from different runs."
            )
        vpp = vpps.pop()
        tensors: dict[str, ChunkedTensor] = {}
        offset = 0
        for v in range(vpp):
            for pp in range(pps):
                ranks: dict[int, list] = {}  # ep -> [(file, tensors) per TP rank]
                for ep in range(eps):
                    ranks[ep] = [
                        (tf, self._tensors_of(sd, ep, eps, tps, grid[(tp, pp, ep)]))
                        for tp in range(tps)
                        for tf, sd in [loaded[(tp, pp, ep)][v]]
                    ]
                    keys = set(ranks[ep][0][1])
                    for tp in range(1, tps):
                        if set(ranks[ep][tp][1]) != keys:
                            raise MergeError(
                                f"{grid[(tp, pp, ep)]} holds different parameters than {grid[(0, pp, ep)]}; the rank "
                                "files come from different runs."
                            )
                shared = [k for k in ranks[0][0][1] if ".mlp.experts.local_experts." not in k]
                owner = {k: 0 for k in shared}
                for ep in range(eps):
                    keys = ranks[ep][0][1]
                    if ep and {k for k in keys if ".mlp.experts.local_experts." not in k} != set(shared):
                        raise MergeError(
                            f"{grid[(0, pp, ep)]} holds different parameters than {grid[(0, pp, 0)]}; the rank files "
                            "come from different runs."
                        )
                    for k in keys:
                        if ".mlp.experts.local_experts." in k:
                            if k in owner:
                                raise MergeError(
                                    f"{k} appears in two expert-parallel ranks of {self.model_dir}; the rank files "
                                    "are inconsistent."
                                )
                            owner[k] = ep
                local_layers = sorted({int(m.group(1)) for k in owner if (m := _LAYER.match(k))})
                if local_layers and local_layers != list(range(len(local_layers))):
                    raise MergeError(
                        f"{grid[(0, pp, 0)]}: its layers are numbered {local_layers[:6]}, not from 0; the file is damaged."
                    )
                for key, ep in owner.items():
                    m = _LAYER.match(key)
                    name = f"decoder.layers.{offset + int(m.group(1))}.{m.group(2)}" if m else key
                    if name in tensors:
                        raise MergeError(
                            f"{key} appears in two pipeline chunks of {self.model_dir}; the rank files are inconsistent."
                        )
                    tensors[name] = self._place(name, [(tf, t[key]) for tf, t in ranks[ep]], grid[(0, pp, ep)])
                offset += len(local_layers)
        return tensors

    def _place(self, name: str, parts, where: Path) -> ChunkedTensor:
        tf0, t0 = parts[0]
        dtype = str(t0.dtype).removeprefix("torch.")
        shapes = {tuple(t.shape) for _, t in parts}
        if name.endswith(_GLU) and len(parts) > 1:
            halves = [t.shape[0] // 2 for _, t in parts]
            if any(t.shape[0] % 2 for _, t in parts) or len(shapes) != 1:
                raise MergeError(
                    f"{where}: the tensor-parallel shards of {name} do not split into gate and up halves; "
                    "the file is damaged."
                )
            total = sum(halves)
            rest = tuple(t0.shape[1:])
            chunks, at = [], 0
            for (tf, t), h in zip(parts, halves):
                chunks.append(self._piece(tf, t.narrow(0, 0, h), (at,) + (0,) * len(rest)))
                chunks.append(self._piece(tf, t.narrow(0, h, h), (total + at,) + (0,) * len(rest)))
                at += h
            return ChunkedTensor(name, dtype, (2 * total,) + rest, chunks)
        dim = None
        if len(parts) > 1:
            if name.endswith(_DIM1):
                dim = 1
            elif name.endswith(_DIM0) and not (name.startswith("output_layer.") and t0.shape[0] == 1):
                dim = 0  # a value head (one row) is the same on every rank
        if dim is None:
            return ChunkedTensor(name, dtype, tuple(t0.shape), [self._piece(tf0, t0, (0,) * t0.dim())])
        if any(len(s) <= dim for s in shapes) or len({s[:dim] + s[dim + 1 :] for s in shapes}) != 1:
            raise MergeError(
                f"{where}: the tensor-parallel shards of {name} have shapes {sorted(shapes)} that do not fit "
                "together; the file is damaged."
            )
        chunks, at = [], 0
        for tf, t in parts:
            chunks.append(self._piece(tf, t, tuple(at if d == dim else 0 for d in range(t.dim()))))
            at += t.shape[dim]
        shape = list(t0.shape)
        shape[dim] = at
        return ChunkedTensor(name, dtype, tuple(shape), chunks)

    @staticmethod
    def _piece(tf, t, offsets) -> Chunk:
        start = tf.offset_of(t) if t.is_contiguous() else None
        length = t.numel() * t.element_size() if start is not None else 0
        return Chunk(tuple(offsets), tuple(t.shape), tf, start or 0, length, local=t)

    def fetch(self, entry: ChunkedTensor, chunk: Chunk):
        return chunk.local

    def file_of(self, chunk: Chunk):
        return chunk.file

    def release_chunk(self, chunk: Chunk) -> None:
        if chunk.length:
            chunk.file.release(chunk.start, chunk.start + chunk.length)

    def close(self) -> None:
        if hasattr(self, "_cached"):
            super().close()
        for tf in self.files:
            tf.close()
        self.files = []


# -- mcore names -> Hugging Face names ----------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Rows ``rows`` (None: all) of ``key[index]``, written at row ``at`` of the output tensor."""

    key: str
    index: tuple[int, ...]
    rows: tuple[int, int] | None
    at: int = 0


@dataclass
class Spec:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece]
    flat: bool = False  # pieces placed in the tensor's first two dimensions as one (packed experts, megatron_vl)
    offset: float = 0.0  # added to every value read (megatron_gdn: a norm Megatron keeps zero-centered, HF not)


def _cfg(config: dict, key: str, default=None):
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if key in text and text[key] is not None:
        return text[key]
    value = config.get(key)
    return default if value is None else value


def model_family(config: dict, config_path) -> str:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for mt in (config.get("model_type"), text.get("model_type")):
        if mt in FAMILIES:
            return mt
    for arch in config.get("architectures") or []:
        m = re.match(r"^([A-Za-z0-9]+?)For[A-Z]", str(arch))
        if m and m.group(1) in _ARCH_FAMILY:
            return _ARCH_FAMILY[m.group(1)]
    named = (config.get("architectures") or [None])[0] or config.get("model_type") or "unnamed"
    if isinstance(config.get("vision_config"), dict):
        from tui_merger.core.formats.megatron_vl import SUPPORTED_VL

        raise MergeError(
            f"{config_path} describes a vision-language model ({named}); tui-merger converts Megatron checkpoints "
            f"of {SUPPORTED_VL} vision-language models only."
        )
    raise MergeError(
        f"{config_path} describes a {named} model; tui-merger converts Megatron checkpoints of {SUPPORTED} "
        "models only."
    )


# (pattern on the key after "decoder.layers.[i.]", kind, HF name after "model.layers.{i}.")
_LAYER_KEYS = [
    (r"input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight", "copy", "input_layernorm.weight"),
    (r"self_attention\.linear_qkv\.(weight|bias)", "qkv", "self_attn.{}_proj.{1}"),
    (r"self_attention\.q_layernorm\.weight", "copy", "self_attn.q_norm.weight"),
    (r"self_attention\.k_layernorm\.weight", "copy", "self_attn.k_norm.weight"),
    (r"self_attention\.linear_proj\.(weight|bias)", "copy", "self_attn.o_proj.{1}"),
    (r"pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight", "copy", "post_attention_layernorm.weight"),
    (r"mlp\.linear_fc1\.(weight|bias)", "glu", "mlp.{}_proj.{1}"),
    (r"mlp\.linear_fc2\.(weight|bias)", "copy", "mlp.down_proj.{1}"),
    (r"mlp\.router\.weight", "copy", "mlp.gate.weight"),
    (r"mlp\.router\.expert_bias", "copy", "mlp.gate.e_score_correction_bias"),  # GLM-4.5 / DeepSeek-V3
    (r"mlp\.experts\.experts\.linear_fc1\.weight", "experts_glu", "mlp.experts.{e}.{}_proj.weight"),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.weight", "glu", "mlp.experts.{1}.{}_proj.weight"),
    (r"mlp\.experts\.linear_fc1\.weight(\d+)", "glu", "mlp.experts.{1}.{}_proj.weight"),
    (r"mlp\.experts\.experts\.linear_fc2\.weight", "experts", "mlp.experts.{e}.down_proj.weight"),
    (r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", "copy", "mlp.experts.{1}.down_proj.weight"),
    (r"mlp\.experts\.linear_fc2\.weight(\d+)", "copy", "mlp.experts.{1}.down_proj.weight"),
    (r"mlp\.shared_experts\.linear_fc1\.weight", "glu", "mlp.shared_expert.{}_proj.weight"),
    (r"mlp\.shared_experts\.linear_fc2\.weight", "copy", "mlp.shared_expert.down_proj.weight"),
    (r"mlp\.shared_experts\.gate_weight", "copy", "mlp.shared_expert_gate.weight"),
]
_LAYER_PATTERNS = [(re.compile(f"(?:{p})$"), kind, name) for p, kind, name in _LAYER_KEYS]
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


_EXPERT_ID = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.|linear_fc[12]\.(?:weight|bias)(\d+)$)")


def _expert_ids(rest: str) -> list[str]:
    m = _EXPERT_ID.match(rest)
    return [g for g in m.groups() if g is not None] if m else []


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ", ".join(map(str, ids[:8]))


@dataclass
class _Mapping:
    specs: dict[str, Spec]
    notices: list[str]
    head: str | None  # the HF name the output layer got (lm_head.weight / score.weight), None: absent
    embed: str = "model.embed_tokens.weight"  # the HF name the embedding got
    config_changes: dict = field(default_factory=dict)  # config.json fields the written model needs (MTP layers)


class _Mapper:
    # what a subclass for another layer type extends (megatron_gdn): the per-layer patterns, and the kinds that are a
    # layer's attention weights (with the name said when a layer has none)
    layer_patterns = _LAYER_PATTERNS
    attention_kinds = {"qkv": "linear_qkv"}

    def __init__(self, tensors: dict[str, ChunkedTensor], config: dict, config_path: Path) -> None:
        self.tensors = tensors
        self.config = config
        self.path = config_path
        self.family = model_family(config, config_path)
        self.name = FAMILIES[self.family]
        self.layers = _cfg(config, "num_hidden_layers")
        self.heads = _cfg(config, "num_attention_heads")
        self.kv = _cfg(config, "num_key_value_heads") or self.heads
        self.hidden = _cfg(config, "hidden_size")
        for what, value in (("num_hidden_layers", self.layers), ("num_attention_heads", self.heads),
                            ("hidden_size", self.hidden), ("num_key_value_heads", self.kv)):
            if not isinstance(value, int) or value <= 0:
                raise MergeError(f"{config_path} has no valid {what}; copy the config saved with the checkpoint.")
        self.head_dim = _cfg(config, "head_dim") or self.hidden // self.heads
        if self.heads % self.kv:
            raise MergeError(
                f"{config_path} says {self.heads} attention heads in {self.kv} key-value groups, which do not divide; "
                "the config is damaged."
            )
        self.vocab = _cfg(config, "vocab_size")
        self.specs: dict[str, Spec] = {}
        self.notices: list[str] = []
        self.config_changes: dict = {}
        if self.family in _MLA:  # DeepSeek-V3: multi-latent attention's projections ahead of the common keys
            from tui_merger.core.formats.megatron_mla import MLA_LAYER_KEYS

            self.layer_patterns = [(re.compile(f"(?:{p})$"), k, n) for p, k, n in MLA_LAYER_KEYS] + list(self.layer_patterns)

    def fail(self, text: str) -> MergeError:
        return MergeError(
            f"{self.path} does not match the checkpoint: {text}; copy the config.json saved with this checkpoint "
            "(or pass --base with the model it was trained from)."
        )

    def add(self, name: str, key: str, index: tuple, shape: tuple, rows=None, pieces=None) -> None:
        entry = self.tensors[key]
        pieces = pieces or [Piece(key, tuple(index), rows)]
        self.specs[name] = Spec(tuple(shape), entry.dtype, pieces)

    # -- the whole model --------------------------------------------------------------------------
    def run(self) -> _Mapping:
        per_layer: dict[int, list] = {}
        top: dict[str, str] = {}
        mtp = []  # multi-token prediction layers (mtp_num_layers): no Hugging Face model of these families has them
        for key, entry in self.tensors.items():
            if key.startswith("mtp."):
                mtp.append(key)
                continue
            if key in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
                       "output_layer.bias"):
                top[key] = key
                continue
            m = _PER_LAYER.match(key)
            if m:
                per_layer.setdefault(int(m.group(1)), []).append((m.group(2), key, ()))
                continue
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers."):]
                n = entry.shape[0] if entry.shape else 0
                if n != self.layers:
                    raise self.fail(
                        f"it says {self.layers} layers (num_hidden_layers) but {key} holds {n}"
                    )
                for i in range(n):
                    per_layer.setdefault(i, []).append((rest, key, (i,)))
                continue
            raise MergeError(
                f"The checkpoint holds {key}, which has no counterpart in a Hugging Face {self.name} model; "
                f"tui-merger converts Megatron checkpoints of {SUPPORTED} models only."
            )
        found = sorted(per_layer)
        if found != list(range(self.layers)):
            have = f"layers 0..{found[-1]}" if found and found == list(range(len(found))) else f"layers {found[:8]}"
            raise self.fail(f"it says {self.layers} layers (num_hidden_layers) but the checkpoint holds {have}")
        if "embedding.word_embeddings.weight" not in top:
            raise MergeError(
                "The checkpoint has no embedding.word_embeddings.weight; it is incomplete (a pipeline stage is missing)."
            )
        if "decoder.final_layernorm.weight" not in top:
            raise MergeError(
                "The checkpoint has no decoder.final_layernorm.weight; it is incomplete (the last pipeline stage is "
                "missing)."
            )
        embed_key = "embedding.word_embeddings.weight"
        self._vocab_matrix("model.embed_tokens.weight", embed_key)
        self._features()
        for i in found:
            self._layer(i, per_layer[i])
        final = "decoder.final_layernorm.weight"
        self.add("model.norm.weight", final, (), self.tensors[final].shape)
        head = None
        if "output_layer.weight" in top:
            out = self.tensors["output_layer.weight"]
            if len(out.shape) == 2 and out.shape[0] == 1:
                head = "score.weight"
                self.add(head, "output_layer.weight", (), out.shape)
                if "output_layer.bias" in top:
                    self.add("score.bias", "output_layer.bias", (), self.tensors["output_layer.bias"].shape)
                else:  # transformers' TokenClassification head has a bias; this value head has none
                    self.specs["score.bias"] = Spec((1,), out.dtype, [])
                    self.notices.append("The value head has no bias; score.bias is written as 0, which is what it computes.")
            elif "output_layer.bias" in top:
                raise MergeError(
                    f"The checkpoint's output layer has a bias, which a Hugging Face {self.name} model's lm_head "
                    "does not have; tui-merger cannot convert it."
                )
            else:
                head = "lm_head.weight"
                self._vocab_matrix(head, "output_layer.weight")
        self._mtp(mtp, head)
        return _Mapping(self.specs, self.notices, head, config_changes=self.config_changes)

    def _vocab_matrix(self, name: str, key: str) -> None:
        entry = self.tensors[key]
        if len(entry.shape) != 2 or entry.shape[1] != self.hidden:
            raise self.fail(f"it says hidden_size {self.hidden} but {key} has shape {list(entry.shape)}")
        rows = entry.shape[0]
        vocab = self.vocab if isinstance(self.vocab, int) and self.vocab > 0 else rows
        if vocab > rows:
            raise self.fail(f"it says vocab_size {vocab} but {key} has only {rows} rows")
        if vocab < rows and name == "model.embed_tokens.weight":
            self.notices.append(
                f"The embedding has {rows} rows, {rows - vocab} of them Megatron's padding beyond vocab_size "
                f"{vocab}; the padding rows are left out."
            )
        self.add(name, key, (), (vocab, entry.shape[1]), rows=(0, vocab) if vocab < rows else None)

    def _features(self) -> None:
        """Which optional tensors the config implies, against what the checkpoint holds."""
        keys = " ".join(self.tensors)
        features = [  # (in the checkpoint, implied by the config, what the config says, what the tensors are)
            ("linear_qkv.bias" in keys,
             self.family in ("qwen2", "qwen2_moe") or bool(_cfg(self.config, "attention_bias", False)) and self.family not in _MLA,
             (" (q/k/v projections without biases)", " (q/k/v projections with biases)"), "linear_qkv biases"),
            ("q_layernorm" in keys and self.family not in _MLA,
             self.family in ("qwen3", "qwen3_moe") or self.family == "glm4_moe" and bool(_cfg(self.config, "use_qk_norm")),
             (" (without q/k norms)", " (with q/k norms)"), "q_layernorm/k_layernorm"),
            ("mlp.router.weight" in keys, self.family in ("qwen2_moe", "qwen3_moe") + _DEEPSEEK_MOE, ("", ""), "MoE routers"),
        ]
        if self.family in _MLA and "linear_qkv" in keys:  # DeepSeek-V3: multi-latent attention (megatron_mla.py)
            raise self.fail(f"it describes a {self.name} model (multi-latent attention) but the checkpoint has "
                            "linear_qkv (grouped-query attention)")
        for held, wanted, said, what in features:
            if held != wanted:
                raise self.fail(
                    f"it describes a {self.name} model{said[wanted]} but the checkpoint {'has' if held else 'has no'} {what}"
                )
        if "shared_experts" in keys and self.family not in ("qwen2_moe",) + _DEEPSEEK_MOE:
            raise self.fail(f"it describes a {self.name} model, which has no shared experts, but the checkpoint has them")

    # -- one layer ----------------------------------------------------------------------------------
    def _layer(self, i: int, entries, prefix: str | None = None) -> None:
        prefix = prefix or f"model.layers.{i}."
        matched = []
        for rest, key, index in entries:
            for order, (pattern, kind, name) in enumerate(self.layer_patterns):
                m = pattern.match(rest)
                if m:
                    matched.append((order, rest, key, index, kind, name, m))
                    break
            else:
                raise MergeError(
                    f"The checkpoint holds {key}, which has no counterpart in a Hugging Face {self.name} model; "
                    f"tui-merger converts Megatron checkpoints of {SUPPORTED} models only."
                )
        matched.sort(key=lambda x: (x[0], x[1].endswith("bias"), x[1]))  # weights before biases
        extra = _attention_keys(self.family)  # MLA's projections
        if not any(kind in self.attention_kinds and not rest.endswith("bias") or rest.endswith(extra)
                   for _, rest, _, _, kind, _, _ in matched):
            names = " or ".join([*self.attention_kinds.values(), *(k.rsplit(".", 2)[-2] for k in extra)])
            raise MergeError(f"Layer {i} has no attention weights ({names}) in the checkpoint; it is incomplete.")
        sparse = any(rest == "mlp.router.weight" for _, rest, *_ in matched)
        if self.family in ("qwen2_moe", "qwen3_moe") + _DEEPSEEK_MOE and sparse != self._hf_sparse(i):
            raise self.fail(
                f"layer {i} is {'an MoE' if sparse else 'a dense'} layer in the checkpoint but "
                f"{'dense' if sparse else 'MoE'} by its "
                f"{'first_k_dense_replace' if self.family in _DEEPSEEK_MOE else 'mlp_only_layers / decoder_sparse_step'}"
            )
        for _, rest, key, index, kind, name, m in matched:
            entry = self.tensors[key]
            param = entry.shape[len(index):]
            groups = [g or "" for g in m.groups()]
            hf = prefix + name.replace("{1}", groups[0] if groups else "")
            if self.family in _DEEPSEEK_MOE:  # their Hugging Face models say shared_experts, Qwen2-MoE shared_expert
                hf = hf.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
            if kind == "copy":
                self._check_copy(hf, key, param)
                self.add(hf, key, index, param)
            elif kind == "qkv":
                self._qkv(hf, key, index, param)
            elif kind == "glu":
                self._glu(hf, key, index, param)
            elif kind in ("experts", "experts_glu"):
                if not param:
                    raise MergeError(f"{key} has no expert dimension; the checkpoint is damaged.")
                n = param[0]
                want = self._experts()
                if isinstance(want, int) and want != n:
                    raise self.fail(f"it says {want} experts (num_experts) but {key} holds {n}")
                for e in range(n):
                    name_e = hf.replace("{e}", str(e))
                    if kind == "experts":
                        self._check_copy(name_e, key, param[1:])
                        self.add(name_e, key, index + (e,), param[1:])
                    else:
                        self._glu(name_e, key, index + (e,), param[1:])
            else:  # a kind of a subclass's own patterns
                self._special(kind, hf, key, index, param, m)
        ids = sorted({int(g) for _, rest, *_ in matched for g in _expert_ids(rest)})
        want = self._experts()
        if ids and isinstance(want, int) and ids != list(range(want)):
            raise self.fail(f"it says {want} experts (num_experts) but layer {i} holds experts {_ranges(ids)}")
        if self.family in _DEEPSEEK_MOE and sparse and not any(r == "mlp.router.expert_bias" for _, r, *_ in matched):
            router = next(key for _, r, key, *_ in matched if r == "mlp.router.weight")
            n = self.tensors[router].shape[-2]  # trained without an expert bias: transformers' is 0, which adds nothing
            self.specs[prefix + "mlp.gate.e_score_correction_bias"] = Spec((n,), "float32", [])
            said = "The checkpoint's routers have no expert bias (moe_router_enable_expert_bias off)"
            if not any(x.startswith(said) for x in self.notices):
                self.notices.append(f"{said}; mlp.gate.e_score_correction_bias is written as 0, which adds nothing to "
                                    "the routing scores.")

    def _special(self, kind: str, hf: str, key: str, index: tuple, param: tuple, m) -> None:
        raise AssertionError(kind)

    def _hf_sparse(self, i: int) -> bool:
        if self.family in _DEEPSEEK_MOE:  # transformers' rule: routed experts from first_k_dense_replace on
            return i >= (_cfg(self.config, "first_k_dense_replace", 0) or 0)
        if i in (_cfg(self.config, "mlp_only_layers") or []):
            return False
        step = _cfg(self.config, "decoder_sparse_step", 1) or 1
        return (self._experts() or 0) > 0 and (i + 1) % step == 0

    def _experts(self):
        """transformers 5 saves num_experts as num_local_experts."""
        return _cfg(self.config, "num_experts") or _cfg(self.config, "num_local_experts") or _cfg(self.config, "n_routed_experts")

    def _check_copy(self, hf: str, key: str, param: tuple) -> None:
        if self.family in _MLA and ".self_attn." in hf:
            return self._check_mla(hf, key, param)
        if hf.endswith("o_proj.weight") and tuple(param) != (self.hidden, self.heads * self.head_dim):
            raise self.fail(
                f"{self.heads} heads of dim {self.head_dim} and hidden_size {self.hidden} make o_proj "
                f"[{self.hidden}, {self.heads * self.head_dim}], but {key} is {list(param)} per layer"
            )
        if hf.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) and len(param) != 1:
            raise MergeError(f"{key} is not a norm weight vector (shape {list(param)}); the checkpoint is damaged.")

    def _qkv(self, hf: str, key: str, index: tuple, param: tuple) -> None:
        per = self.heads // self.kv
        d = self.head_dim
        rows = (self.heads + 2 * self.kv) * d
        if not param or param[0] != rows or (len(param) == 2 and param[1] != self.hidden):
            raise self.fail(
                f"{self.heads} attention heads and {self.kv} key-value heads of dim {d} make "
                f"[{rows}, {self.hidden}] for linear_qkv, but {key} is {list(param)} per layer"
            )
        rest = tuple(param[1:])
        group = (per + 2) * d
        q = [Piece(key, index, (g * group, g * group + per * d), g * per * d) for g in range(self.kv)]
        k = [Piece(key, index, (g * group + per * d, g * group + (per + 1) * d), g * d) for g in range(self.kv)]
        v = [Piece(key, index, (g * group + (per + 1) * d, (g + 1) * group), g * d) for g in range(self.kv)]
        for part, pieces, n in (("q", q, self.heads * d), ("k", k, self.kv * d), ("v", v, self.kv * d)):
            self.add(hf.replace("{}", part), key, index, (n,) + rest, pieces=pieces)

    def _glu(self, hf: str, key: str, index: tuple, param: tuple) -> None:
        if not param or param[0] % 2:
            raise MergeError(
                f"{key} has {param[0] if param else 0} rows, not gate and up halves; the checkpoint is damaged."
            )
        half = param[0] // 2
        if ".experts." in hf:
            want, what = _cfg(self.config, "moe_intermediate_size"), "moe_intermediate_size"
        elif ".shared_expert." in hf:
            want, what = _cfg(self.config, "shared_expert_intermediate_size"), "shared_expert_intermediate_size"
        elif ".shared_experts." in hf:  # GLM-4.5 / DeepSeek-V3: n_shared_experts experts' width, as one MLP
            want = (_cfg(self.config, "moe_intermediate_size") or 0) * (_cfg(self.config, "n_shared_experts") or 0)
            what = "moe_intermediate_size x n_shared_experts"
        else:
            want, what = _cfg(self.config, "intermediate_size"), "intermediate_size"
        if isinstance(want, int) and want != half:
            raise self.fail(f"it says {what} {want} but {key} holds gate and up halves of {half} rows")
        rest = tuple(param[1:])
        for part, r in (("gate", (0, half)), ("up", (half, 2 * half))):
            self.add(hf.replace("{}", part), key, index, (half,) + rest, rows=r)

    # -- GLM-4.5 / DeepSeek-V3: multi-latent attention's shapes (megatron_mla.py) -----------------------
    def _check_mla(self, hf: str, key: str, param: tuple) -> None:
        from tui_merger.core.formats.megatron_mla import mla_shape

        found = mla_shape(self.config, _cfg, hf)
        if found is None:
            return
        shape, fields = found
        if not shape:
            raise self.fail(f"it has no {fields} (no {hf.rsplit('.', 2)[-2]}) but the checkpoint holds {key}")
        if tuple(param) != shape:
            raise self.fail(f"its {fields} make {hf.split('.', 3)[-1]} {list(shape)}, but {key} is {list(param)} per layer")

    # -- multi-token prediction layers: where the family's Hugging Face checkpoints keep them -----------
    def _mtp(self, keys: list[str], head: str | None) -> None:
        """megatron-core's ``mtp.layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` and its decoder layer
        ``mtp.layers.{i}.transformer_layer.*`` written under the names of ``MTP_PLACES[family]`` (the embedding and
        the output layer are the main model's: written again where the family keeps its own copies)."""
        if not keys:
            return
        place = MTP_PLACES.get(self.family)
        per: dict[int, list] = {}
        for key in keys:
            m = re.match(r"^mtp\.layers\.(\d+)\.(.+)$", key)
            if place is None:
                continue
            if not m:
                raise MergeError(
                    f"The checkpoint holds {key}, which is not a multi-token prediction layer's tensor tui-merger knows; "
                    f"it converts megatron-core's mtp.layers.<i>.* of {self.name} models."
                )
            per.setdefault(int(m.group(1)), []).append((m.group(2), key))
        if place is None:
            layers = sorted({m.group(1) for k in keys if (m := re.match(r"^mtp\.layers\.(\d+)\.", k))})
            self.notices.append(
                f"The checkpoint holds {len(layers) or 'its'} multi-token prediction layer{'s' if len(layers) != 1 else ''} "
                f"(mtp.*, {len(keys)} tensors), which a Hugging Face {self.name} model has no place for: they are left "
                "out; the model predicts the next token with the weights it was trained with."
            )
            return
        found = sorted(per)
        if found != list(range(len(found))):
            raise MergeError(f"The checkpoint holds multi-token prediction layers {found[:8]}, not 0..{len(found) - 1}; "
                             "it is incomplete (a pipeline stage is missing).")
        count = place["count"]
        said = _cfg(self.config, count)
        only = place.get("only")
        if only is not None:  # the family's models have exactly this many: the config must say so, nothing is rewritten
            if not isinstance(said, int) or said < 1:
                raise MergeError(
                    f"The checkpoint holds {len(found)} multi-token prediction layer(s) (mtp.*) but {self.path} has no "
                    f"{count}; copy the config.json of the {self.name} release it was trained from."
                )
            if len(found) != only or said != only:
                raise MergeError(
                    f"The checkpoint holds multi-token prediction layers {found} and {self.path} says {count} {said}; "
                    f"tui-merger writes {self.name}'s {'one MTP layer' if only == 1 else f'{only} MTP layers'} "
                    f"(mtp_num_layers {only}) only."
                )
        elif said != len(found):
            self.config_changes[count] = len(found)
            self.notices.append(
                f"The checkpoint holds {len(found)} multi-token prediction layer{'s' if len(found) != 1 else ''} but the "
                f"config says {said or 0} ({count}); {count} is set to {len(found)}, so that the layers written are read."
            )
        for i in found:
            names = {k: v.format(i=i, n=self.layers + i) for k, v in place.items() if isinstance(v, str)}
            entries = dict(per[i])
            for part, want in (("enorm.weight", (self.hidden,)), ("hnorm.weight", (self.hidden,)),
                               ("eh_proj.weight", (self.hidden, 2 * self.hidden)),
                               ("final_layernorm.weight", (self.hidden,))):
                key = entries.pop(part, None)
                if key is None:
                    raise MergeError(f"Multi-token prediction layer {i} has no mtp.layers.{i}.{part}; the checkpoint is "
                                     "incomplete.")
                if tuple(self.tensors[key].shape) != want:
                    raise self.fail(f"hidden_size {self.hidden} makes {part.split('.')[0]} {list(want)}, but {key} is "
                                    f"{list(self.tensors[key].shape)}")
                self.add(names[part.split(".")[0]], key, (), want)
            layer = [(rest[len("transformer_layer."):], key, ()) for rest, key in entries.items()
                     if rest.startswith("transformer_layer.")]
            stray = [key for rest, key in entries.items() if not rest.startswith("transformer_layer.")]
            if stray:
                raise MergeError(f"The checkpoint holds {stray[0]}, which has no counterpart in a Hugging Face "
                                 f"{self.name} model's multi-token prediction layer; tui-merger cannot convert it.")
            self._layer(self.layers + i, layer, prefix=names["layer"])
            if "embed" in names:
                self.specs[names["embed"]] = self.specs["model.embed_tokens.weight"]
            if "head" in names:
                self.specs[names["head"]] = self.specs[head if head == "lm_head.weight" else "model.embed_tokens.weight"]
        where = place.get("where") or place["layer"].format(i=0, n=self.layers) + "*"
        self.notices.append(
            f"The checkpoint's {len(found)} multi-token prediction layer{'s are' if len(found) != 1 else ' is'} written "
            f"as {self.name} keeps {'them' if len(found) != 1 else 'it'} ({where}){place.get('note', '')}."
        )


# -- multi-token prediction layers, where each family's Hugging Face checkpoints keep them (issue 39) --------------
# Templates: {i} the MTP layer, {n} num_hidden_layers + i: "layer" (the decoder layer's prefix), "enorm", "hnorm",
# "eh_proj", "final_layernorm" (megatron-core's MTP tensors), optional "embed" / "head" (the family's own copies of
# the embedding and output layer). "count": the config field that says how many; "only": the one number the
# family's models have (the config must say it; else a differing count is rewritten); "where" and "note": what the
# notice says (default: the layer prefix). A family without an entry has no place for them: left out with a notice.
# GLM-4.5 and DeepSeek-V3 as released: one extra decoder layer model.layers.{num_hidden_layers} with enorm, hnorm,
# eh_proj, shared_head.norm, and copies of the embedding and lm_head (shared with the main model in megatron-core);
# megatron-core's final_layernorm of the MTP layer is shared_head.norm (Megatron-Bridge's GLM-4.5 mapping).
_MTP_AS_LAYER = {"count": "num_nextn_predict_layers", "layer": "model.layers.{n}.", "enorm": "model.layers.{n}.enorm.weight",
                 "hnorm": "model.layers.{n}.hnorm.weight", "eh_proj": "model.layers.{n}.eh_proj.weight",
                 "final_layernorm": "model.layers.{n}.shared_head.norm.weight",
                 "embed": "model.layers.{n}.embed_tokens.weight", "head": "model.layers.{n}.shared_head.head.weight"}
# Qwen3-Next as released (megatron_gdn maps the decoder layer): one MTP layer with its own names, mtp.fc,
# mtp.layers.0.*, mtp.norm; transformers' model does not build it (_keys_to_ignore_on_load_unexpected).
_MTP_QWEN3_NEXT = {"count": "mtp_num_hidden_layers", "only": 1, "layer": "mtp.layers.{i}.",
                   "enorm": "mtp.pre_fc_norm_embedding.weight", "hnorm": "mtp.pre_fc_norm_hidden.weight",
                   "eh_proj": "mtp.fc.weight", "final_layernorm": "mtp.norm.weight",
                   "where": "mtp.fc, mtp.layers.0.*, mtp.norm",
                   "note": "; transformers does not load it, vLLM and SGLang use it for speculative decoding"}
MTP_PLACES: dict[str, dict] = {"glm4_moe": _MTP_AS_LAYER, "deepseek_v3": _MTP_AS_LAYER, "qwen3_next": _MTP_QWEN3_NEXT}


def _attention_keys(family: str) -> tuple[str, ...]:
    """The keys (after ``decoder.layers.N.``) besides linear_qkv that say a layer has its attention weights."""
    if family in _MLA:
        from tui_merger.core.formats.megatron_mla import MLA_ATTENTION

        return MLA_ATTENTION
    return ()


# -- the tensor source ------------------------------------------------------------------------------


class MegatronSource:
    """A TensorSource of Hugging Face names over a chunk store: each tensor is read region by region
    from the chunks that hold it, which stay cached only while the tensors of their group are written."""

    def __init__(self, store: ChunkStore, specs: dict[str, Spec], folder: Path, files: list[str]) -> None:
        self.store = store
        self.specs = specs
        self.folder = folder
        self.files = files
        self.tensors = {name: TensorRef(self, "", name, s.dtype, s.shape) for name, s in specs.items()}
        self.groups = {name: {(p.key, p.index) for p in s.pieces} for name, s in specs.items()}
        users: dict = {}
        for name, groups in self.groups.items():
            for g in groups:
                users.setdefault(g, set()).add(name)
        store.users_of = users

    def load(self, ref: TensorRef):
        import torch

        out = torch.empty(ref.shape, dtype=getattr(torch, ref.dtype))
        self.load_into(ref, out)
        return out

    def load_into(self, ref: TensorRef, out) -> None:
        spec = self.specs[ref.name]
        if not spec.pieces:  # a tensor the checkpoint implies but does not store (a zero bias)
            out.zero_()
        if spec.flat:
            out = out.view((-1,) + tuple(spec.shape[2:]))
        for p in spec.pieces:
            if p.rows is None and len(spec.pieces) == 1:
                dst = out
            else:
                n = p.rows[1] - p.rows[0] if p.rows else spec.shape[0]
                dst = out.narrow(0, p.at, n)
            self.store.read_region(p.key, p.index, p.rows, dst, group=(p.key, p.index))
        if spec.offset:
            out.add_(spec.offset)

    def _views(self, ref: TensorRef, max_bytes: int | None):
        """The tensor as row views on the files, in order (None: its rows are not contiguous there)."""
        spec = self.specs.get(ref.name)
        if spec is None or not spec.pieces or not math.prod(spec.shape) or spec.offset:
            return None
        views = []
        for p in sorted(spec.pieces, key=lambda p: p.at):
            got = self.store.row_views(p.key, p.index, p.rows, max_bytes)
            if got is None:
                return None
            views += got
        return views

    def raw_ranges(self, ref: TensorRef):
        """Where the tensor's rows lie in the files, in order, when they are stored contiguously (every
        tensor but a row-parallel weight): copied in the kernel when the dtype stays."""
        views = self._views(ref, None)
        if views is None:
            return None
        from tui_merger.core.io.dcp import file_ranges

        return file_ranges(self.store, views)

    def row_blocks(self, ref: TensorRef):
        """The tensor as row blocks of at most BLOCK_BYTES (views on the files, handed back once
        written): a dtype change goes block by block, never through a whole-tensor buffer."""
        if self.specs[ref.name].flat:  # blocks of another shape than the tensor's rows: read whole
            return None
        views = self._views(ref, BLOCK_BYTES)
        if views is None:
            return None
        return [(view, lambda v=view, c=chunk: self.store.release_view(c, v)) for view, chunk in views]

    def release(self, ref: TensorRef) -> None:
        self.store.done(ref.name, self.groups.get(ref.name, ()))

    def same_rows(self, a: str, b: str, block: int = 4096) -> bool:
        """Whether two tensors hold equal values, compared ``block`` rows at a time."""
        import torch

        sa, sb = self.specs[a], self.specs[b]
        if sa.shape != sb.shape:
            return False
        (pa,), (pb,) = sa.pieces, sb.pieces
        rows = sa.shape[0]
        for r in range(0, rows, block):
            n = min(block, rows - r)
            x = torch.empty((n,) + sa.shape[1:], dtype=getattr(torch, sa.dtype))
            y = torch.empty((n,) + sb.shape[1:], dtype=getattr(torch, sb.dtype))
            self.store.read_region(pa.key, pa.index, (r, r + n), x, group=(pa.key, "cmp"))
            self.store.read_region(pb.key, pb.index, (r, r + n), y, group=(pb.key, "cmp"))
            if not torch.equal(x, y):
                self.store.drop()
                return False
        self.store.drop()
        return True

    def close(self) -> None:
        self.store.close()


# -- Inputs -----------------------------------------------------------------------------------------


def _convert(layout: MegatronLayout, config: dict, config_dir: Path, inputs, options, skip=skip_key) -> list[Path]:
    """The checkpoint's model converted to Hugging Face names as ``inputs.base`` (a MegatronSource);
    returns the files it reads."""
    from tui_merger.core.formats.megatron_vl import map_vl, vl_family

    vl = vl_family(config) is not None
    config_path = layout.config_file or config_dir / "config.json"
    if not vl:
        model_family(config, config_path)  # an unknown architecture is said before any reading
    if layout.kind == "legacy" or layout.run is not None and layout.run.legacy:
        if vl:  # their language_model.* layers would not be renumbered across pipeline stages
            raise MergeError(
                f"{layout.model_dir} holds a vision-language model in legacy per-rank files, which tui-merger does not "
                "read; save it as a dist checkpoint (torch_dist) and convert that."
            )
        if model_family(config, config_path) in _DEEPSEEK_MOE:  # GLM-4.5 / DeepSeek-V3
            raise MergeError(  # how their MLA projections and MTP layers are split across ranks is not read here
                f"{layout.model_dir} holds a {FAMILIES[model_family(config, config_path)]} model in legacy per-rank "
                "files, which tui-merger does not read; save it as a dist checkpoint (torch_dist) and convert that."
            )
        store = LegacyStore(layout.model_dir, _cfg(config, "num_experts") or _cfg(config, "num_local_experts"),
                            _cfg(config, "moe_intermediate_size"), "model_optim_rng.pt" if layout.run else "model.pt")
    else:
        if not layout.model_dir.is_dir():
            raise MergeError(f"{layout.model_dir} is missing; the checkpoint is incomplete: copy the whole folder again.")
        store = DcpStore(layout.model_dir, skip, canonical)
    inputs.closers.append(store)
    from tui_merger.core.formats.megatron_gdn import is_gdn_model, map_gdn

    if vl:
        parts = SimpleNamespace(Mapper=_Mapper, Mapping=_Mapping, Spec=Spec, Piece=Piece)
        mapping = map_vl(store.tensors, config, config_path, parts)
    elif is_gdn_model(config):  # Qwen3-Next
        parts = SimpleNamespace(Mapper=_Mapper, Mapping=_Mapping, Spec=Spec, Piece=Piece, patterns=_LAYER_PATTERNS)
        mapping = map_gdn(store.tensors, config, config_path, parts)
    else:
        mapping = _Mapper(store.tensors, config, config_path).run()
    source = MegatronSource(store, mapping.specs, layout.model_dir, list(store.data_files))
    inputs.base = source
    inputs.notices += mapping.notices
    inputs.config_changes.update(mapping.config_changes)  # e.g. num_nextn_predict_layers (MTP layers written)
    _tie(inputs, options, source, mapping)
    if isinstance(store, LegacyStore):
        return [layout.model_dir / f for f in store.data_files]
    return [layout.model_dir / METADATA] + [layout.model_dir / f for f in store.data_files]


def holds_model(dist_dir: Path) -> bool:
    """Whether a dist checkpoint holds model weights (verl's use_dist_checkpointing), not only a
    LoRA run's adapters (Megatron-Bridge's adapter-only checkpoint): its metadata names a base weight."""
    from tui_merger.core.io.dcp import read_metadata

    if not (Path(dist_dir) / METADATA).is_file():
        return False
    keys = read_metadata(dist_dir).state_dict_metadata
    return any(canonical(str(k)).endswith(("embedding.word_embeddings.weight", "linear_qkv.weight")) for k in keys)


def _skip_adapters(key: str) -> bool:
    """A LoRA run's dist checkpoint: the base weights, not the adapters (read from the shards)."""
    return skip_key(key) or ".adapter." in key


def open_megatron_inputs(options):
    """Inputs (see inputs.py) for a verl Megatron checkpoint: the converted model as a tensor source
    with Hugging Face names, no adapter, the checkpoint's config and files."""
    from tui_merger.core.formats.adapter import empty_adapter
    from tui_merger.core.io.files import FilePlan, config_dtype, plan_files, read_config
    from tui_merger.core.formats.input_types import Inputs, _value_model, paths_of
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
    from tui_merger.core.io.sources import open_model

    layout = find_megatron_checkpoint(options.checkpoint)
    if layout.lora is not None:
        if layout.lora.export is None and layout.lora.dist_dir is not None:  # issue 39: verl v2 + Bridge PEFT
            return open_verl_bridge_peft(layout, options)
        if layout.lora.export is None:
            return open_lora_shards(layout, options)
        return open_lora_export(layout, options)
    if layout.kind == "mcore" and layout.run.lora:  # Megatron-Bridge PEFT (others are refused by check_iteration)
        return open_bridge_peft(layout, options)
    nemo = None
    if layout.kind == "mcore":  # the config: --base, else the model the run names (on this machine)
        config_dir = Path(options.base) if options.base is not None else layout.hf_dir
        if config_dir is None and layout.run.framework == "nemo2":  # issue 39: built from context/model.yaml
            from tui_merger.core.formats.megatron_runs import read_yaml
            from tui_merger.core.formats.nemo2_config import MODEL_YAML, nemo2_config

            nemo = nemo2_config(layout.folder, read_yaml(layout.folder / "context" / MODEL_YAML))
            config_dir, layout.config_file = nemo.source.parent, nemo.source
            layout.notices.append(
                f"The Hugging Face config is built from {nemo.source} (NeMo's {nemo.nemo_class}) and the tokenizer "
                f"taken from {nemo.tokenizer or 'nowhere (the context holds none)'}; pass --base to use a model's own."
            )
        if config_dir is None:
            raise MergeError(layout.missing_base)
        if options.base is None and nemo is None:
            layout.notices.append(
                f"The Hugging Face config and tokenizer are taken from {config_dir}, {layout.run.source()}; pass "
                "--base to use another."
            )
    else:
        config_dir = layout.hf_dir if layout.hf_dir is not None and (layout.hf_dir / "config.json").is_file() else options.base
    if config_dir is None:
        where = "hf_config_and_tokenizer/" if layout.kind == "legacy" else "huggingface/"
        raise MergeError(
            f"{layout.folder} has no {where} folder with config.json; copy the model's config.json and tokenizer "
            "into it, or pass --base with the original model."
        )
    config = nemo.config if nemo is not None else read_config(config_dir)
    inputs = Inputs(None, empty_adapter(layout.folder), config, FilePlan(), paths_of(options))
    inputs.notices = list(layout.notices)
    try:
        if layout.kind == "hf":
            inputs.base = open_model(layout.model_dir)
            inputs.closers.append(inputs.base)
            weights = [layout.model_dir / f for f in inputs.base.files]
        else:
            weights = _convert(layout, config, config_dir, inputs, options)
        score = "score.weight" in inputs.base.tensors and inputs.base.tensors["score.weight"].shape[0] == 1
        _value_model(inputs, options, SimpleNamespace(role="critic" if score else layout.role))
        dtype = config_dtype(config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        if inputs.dtype == "float32" and options.dtype is None and layout.kind != "hf":
            inputs.notices.append(
                "The checkpoint's config says float32, so the model is written in float32 (twice the size "
                "of bf16); pass --dtype bf16 for the half-size model verl's merger writes."
            )
        if nemo is not None:  # NeMo 2: the tokenizer folder of its context, the importer's generation config
            tok = nemo.tokenizer or config_dir
            inputs.files = plan_files(tok, tok, config, options.tokenizer_from)
            if nemo.generation is not None and all(name != "generation_config.json" for _, name in inputs.files.copies):
                inputs.files.copies.append((nemo.generation, "generation_config.json"))
        else:
            inputs.files = plan_files(config_dir, config_dir, config, options.tokenizer_from)
        inputs.notices += inputs.files.notices
        inputs.read_files = weights + [layout.config_file or config_dir / "config.json"] + [src for src, _ in inputs.files.copies]
    except BaseException:
        inputs.close()
        raise
    return inputs


def lora_base_named(layout: MegatronLayout, adapter_config: dict | None) -> str | None:
    """The base model a LoRA run names: its adapter export's base_model_name_or_path, else the run's
    config's _name_or_path."""
    named = (adapter_config or {}).get("base_model_name_or_path")
    if not (isinstance(named, str) and named) and layout.hf_dir is not None:
        try:
            named = json.loads((layout.hf_dir / "config.json").read_text()).get("_name_or_path")
        except (OSError, ValueError, AttributeError):
            named = None
    return named if isinstance(named, str) and named else None


def _lora_base(layout: MegatronLayout, options, adapter_config: dict) -> Path:
    from tui_merger.core.io.hf_refs import resolve_model_reference

    if options.base is not None:
        return Path(options.base)
    named = lora_base_named(layout, adapter_config)
    found = None
    if named:
        p = Path(named).expanduser()
        near = [p] if p.is_absolute() else [d / p for d in (layout.lora.export, layout.hf_dir) if d] + [Path.cwd() / p]
        found = next((d for d in near if (d / "config.json").is_file()), None) or resolve_model_reference(named)
    if found is None:
        said = f"names {named}, which is not on this machine" if named else "names no base model"
        where = "adapter export" if layout.lora.export is not None else "config"
        raise MergeError(
            f"{layout.folder} is a Megatron LoRA run: it holds the adapter, not the base weights, and its "
            f"{where} {said}; pass --base with the model the run started from."
        )
    return found


def open_lora_export(layout: MegatronLayout, options):
    """Inputs of a verl Megatron LoRA run with its Hugging Face PEFT export (model/huggingface/adapter/):
    the base model (``--base``, else the one the export or the run's config names) with that adapter, the
    base's config, the run's tokenizer. ``--lora-alpha`` replaces a recorded alpha, and is needed when the
    export records none (peft would silently use 8)."""
    from tui_merger.core.formats.adapter import ADAPTER_WEIGHTS, adapter_from_source, empty_adapter, open_adapter
    from tui_merger.core.formats.input_types import Inputs, paths_of
    from tui_merger.core.io.files import FilePlan, plan_files, read_config, read_json_object
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
    from tui_merger.core.io.sources import TensorSource, open_model

    export = layout.lora.export
    said = read_json_object(export / "adapter_config.json", "fix or re-export the adapter")
    alpha = said.get("lora_alpha")
    if options.lora_alpha is None and not alpha:
        what = "is 0" if "lora_alpha" in said else "is not recorded"
        raise MergeError(
            f"The lora_alpha of {export / 'adapter_config.json'} {what}; pass --lora-alpha with the value used in "
            "training (the run's actor_rollout_ref.model.lora.alpha)."
        )
    base_dir = _lora_base(layout, options, said)
    base = open_model(base_dir)
    inputs = Inputs(base, empty_adapter(export), {}, FilePlan(), paths_of(options), closers=[base])
    inputs.notices = list(layout.notices)
    try:
        inputs.config = read_config(base_dir)
        if options.lora_alpha is not None and options.lora_alpha != alpha:
            files = [f for f in ADAPTER_WEIGHTS if (export / f).is_file()]
            if not files:
                raise MergeError(
                    f"{export} has adapter_config.json but no adapter_model.safetensors or adapter_model.bin; "
                    "the adapter export is incomplete: copy it again."
                )
            adapter = adapter_from_source(export, {**said, "lora_alpha": options.lora_alpha}, TensorSource(export, files[:1]))
            inputs.notices.append(
                f"lora_alpha {options.lora_alpha:g} (--lora-alpha) is used"
                + (f" instead of the {alpha} recorded in the adapter export." if alpha else ".")
            )
        else:
            adapter = open_adapter(export)
        inputs.closers.append(adapter)
        inputs.adapter = adapter
        inputs.notices.append(
            f"A Megatron LoRA run: its Hugging Face adapter export ({export}) is merged into {base_dir}"
            + (f"; the Megatron-side adapter shards ({layout.lora.shards}) are not read." if layout.lora.shards else ".")
        )
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        tokenizer_dir = layout.hf_dir if layout.hf_dir is not None else export
        inputs.files = plan_files(base_dir, tokenizer_dir, inputs.config, options.tokenizer_from)
        inputs.notices += adapter.notices + inputs.files.notices
        inputs.read_files = (
            [base_dir / f for f in base.files]
            + [base_dir / "config.json", export / "adapter_config.json"]
            + [export / f for f in adapter.source.files]
            + [src for src, _ in inputs.files.copies]
        )
    except BaseException:
        inputs.close()
        raise
    return inputs


# the config values that fix the shapes a LoRA run's adapters were trained for
_SHAPE_KEYS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "num_hidden_layers", "num_experts", "num_local_experts", "moe_intermediate_size")


def _same_shapes(run_config: dict, base_config: dict, run_path: Path, base_dir: Path) -> None:
    """A base of another shape is named in one sentence before anything is read."""
    for key in _SHAPE_KEYS:
        said, have = _cfg(run_config, key), _cfg(base_config, key)
        if said is not None and have is not None and said != have:
            raise MergeError(
                f"The run's {run_path} says {key} {said} but the base {base_dir} has {have}: the adapters were "
                "trained on another model; pass --base with the model the run started from."
            )


def open_lora_shards(layout: MegatronLayout, options):
    """Inputs of a verl Megatron LoRA run from its adapter shards (adapter_checkpoint/): the shards put
    together and named as Megatron-Bridge's Hugging Face export names them (formats/megatron_lora.py),
    merged into the base (``--base``, else the one the run's config names). The shards do not record
    lora_alpha: ``--lora-alpha`` gives it."""
    from tui_merger.core.formats.adapter import adapter_from_source
    from tui_merger.core.formats.input_types import Inputs, paths_of
    from tui_merger.core.formats.megatron_lora import KINDS, peft_config, read_shards, shard_layout, transformer_config
    from tui_merger.core.io.files import FilePlan, plan_files, read_config
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
    from tui_merger.core.io.sources import open_model

    shard_dir = layout.lora.shard_dir
    if layout.hf_dir is None or not (layout.hf_dir / "config.json").is_file():
        raise MergeError(
            f"{layout.folder} has no huggingface/config.json, which says how the adapter shards split into the "
            "model's projections; copy the run's huggingface/ folder again."
        )
    run_config = read_config(layout.hf_dir)
    shards = read_shards(shard_layout(shard_dir, transformer_config(layout.folder)), run_config)
    # verl with use_dist_checkpointing=True also saved the whole model: its own base weights
    own = options.base is None and layout.kind in ("v1", "v2") and holds_model(layout.model_dir)
    try:
        found = read_lora_train_meta(layout.folder)
        meta_path = found[1] if found else None
        where = ("lora_train_meta.json" if meta_path is None or meta_path.parent == layout.folder
                 else f"{meta_path.parent.name}/{meta_path.name}")
        alpha, said = chosen_alpha(options.lora_alpha, found[0].get("lora_alpha") if found else None, where)
        if alpha is None:
            raise MergeError(
                f"The adapter shards in {shard_dir} do not record lora_alpha, and no lora_train_meta.json does (verl "
                "keeps it in the training config, actor_rollout_ref.model.lora.alpha); pass --lora-alpha with that value."
            )
        base_dir = layout.hf_dir if own else _lora_base(layout, options, {})
        if not own:
            read_config(base_dir)  # a base without config.json is named before the shapes are compared
            _same_shapes(run_config, read_config(base_dir), layout.hf_dir / "config.json", base_dir)
    except BaseException:
        shards.source.close()
        raise
    config = peft_config(shards, alpha, lora_base_named(layout, None))
    adapter = adapter_from_source(shard_dir, config, shards.source)
    inputs = Inputs(None, adapter, {}, FilePlan(), paths_of(options), closers=[adapter])
    inputs.notices = list(layout.notices) + ([said] if said else [])
    try:
        if own:
            inputs.config = run_config
            base_files = _convert(layout, run_config, layout.hf_dir, inputs, options, _skip_adapters)
            base_dir = layout.model_dir
        else:
            base = inputs.base = open_model(base_dir)
            inputs.closers.append(base)
            inputs.config = read_config(base_dir)
            base_files = [base_dir / f for f in base.files] + [base_dir / "config.json"]
        grid = shards.layout
        parallel = ", ".join(f"{n} {w}" for n, w in (("TP", grid.tp), ("PP", grid.pp), ("EP", grid.ep)) if n == "TP" or w > 1)
        inputs.notices.append(
            f"A Megatron {KINDS[shards.kind]} run: its adapter shards ({parallel}; rank {shards.r}, alpha "
            f"{alpha:g}) are merged into "
            + (f"the base weights its own dist checkpoint holds ({base_dir}; --base merges into another)." if own
               else f"{base_dir}.")
        )
        if shards.kind == "dora":
            inputs.notices.append(
                "DoRA: the trained magnitudes are merged (Megatron-Bridge's own Hugging Face export leaves them out)."
            )
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        inputs.files = plan_files(layout.hf_dir if own else base_dir, layout.hf_dir, inputs.config, options.tokenizer_from)
        inputs.notices += shards.notices + adapter.notices + inputs.files.notices
        inputs.read_files = (
            base_files
            + [layout.hf_dir / "config.json"]
            + [shard_dir / f for f in shards.source.files]
            + [src for src, _ in inputs.files.copies]
        )
        if (layout.folder / "transformer_config.json").is_file():
            inputs.read_files.append(layout.folder / "transformer_config.json")
        if meta_path is not None and options.lora_alpha is None:
            inputs.read_files.append(meta_path)  # alpha came from it
    except BaseException:
        inputs.close()
        raise
    return inputs


def open_verl_bridge_peft(layout: MegatronLayout, options):
    """issue 39: inputs of a verl LoRA run in the v2 layout trained with Megatron-Bridge PEFT and saved without its
    Hugging Face adapter export: the adapters of model/dist_ckpt (Bridge's adapter-only dist checkpoint, read by
    megatron_lora.read_dist_adapter as for Bridge's own PEFT iterations) merged into the base (``--base``, else the
    one model/huggingface/config.json names). verl's v2 save keeps no base weight there even with
    use_dist_checkpointing (the PEFT subset replaces the model section), and does not save lora_alpha:
    ``--lora-alpha`` (or a lora_train_meta.json) gives it."""
    from tui_merger.core.formats.adapter import adapter_from_source
    from tui_merger.core.formats.input_types import Inputs, paths_of
    from tui_merger.core.formats.megatron_lora import KINDS, peft_config, read_dist_adapter
    from tui_merger.core.io.files import FilePlan, plan_files, read_config
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
    from tui_merger.core.io.sources import open_model

    dist = layout.lora.dist_dir
    if layout.hf_dir is None or not (layout.hf_dir / "config.json").is_file():
        raise MergeError(
            f"{layout.folder} has no model/huggingface/config.json, which says what model the adapters in {dist} belong "
            "to; copy the run's model/huggingface/ folder again."
        )
    run_config = read_config(layout.hf_dir)
    found = read_lora_train_meta(layout.folder)
    meta_path = found[1] if found else None
    alpha, said = chosen_alpha(options.lora_alpha, found[0].get("lora_alpha") if found else None, "lora_train_meta.json")
    if alpha is None:
        raise MergeError(
            f"The Megatron-Bridge adapters in {dist} do not record lora_alpha, and no lora_train_meta.json does (verl "
            "keeps it in the training config, actor_rollout_ref.model.lora.alpha); pass --lora-alpha with that value."
        )
    base_dir = _lora_base(layout, options, {})
    _same_shapes(run_config, read_config(base_dir), layout.hf_dir / "config.json", base_dir)
    shards = read_dist_adapter(dist, run_config)
    adapter = adapter_from_source(dist, peft_config(shards, alpha, lora_base_named(layout, None)), shards.source)
    inputs = Inputs(None, adapter, {}, FilePlan(), paths_of(options), closers=[adapter])
    inputs.notices = list(layout.notices) + ([said] if said else [])
    try:
        base = inputs.base = open_model(base_dir)
        inputs.closers.append(base)
        inputs.config = read_config(base_dir)
        base_files = [base_dir / f for f in base.files] + [base_dir / "config.json"]
        inputs.notices.append(
            f"A verl {KINDS[shards.kind]} run (Megatron-Bridge PEFT): its adapters in {dist} (rank {shards.r}, alpha "
            f"{alpha:g}) are merged into {base_dir}."
        )
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        inputs.files = plan_files(base_dir, layout.hf_dir, inputs.config, options.tokenizer_from)
        inputs.notices += shards.notices + adapter.notices + inputs.files.notices
        inputs.read_files = (base_files + [layout.hf_dir / "config.json", dist / METADATA]
                             + [dist / f for f in shards.source.files] + [src for src, _ in inputs.files.copies])
        if meta_path is not None and options.lora_alpha is None:
            inputs.read_files.append(meta_path)
    except BaseException:
        inputs.close()
        raise
    return inputs


def open_bridge_peft(layout: MegatronLayout, options):
    """Inputs of a Megatron-Bridge PEFT iteration (adapter-only dist checkpoint, the LoRA in run_config.yaml):
    its adapter (formats/megatron_lora.py read_dist_adapter, named as Bridge's Hugging Face export names it)
    merged into the base checkpoint the run names (``checkpoint.pretrained_checkpoint``, converted like any
    Megatron checkpoint) or, with ``--base`` or when that checkpoint is not here, into the Hugging Face model."""
    from tui_merger.core.formats.adapter import adapter_from_source
    from tui_merger.core.formats.input_types import Inputs, paths_of
    from tui_merger.core.formats.megatron_lora import KINDS, peft_config, read_dist_adapter
    from tui_merger.core.formats.megatron_runs import pretrained_iteration
    from tui_merger.core.io.files import FilePlan, config_dtype, plan_files, read_config
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
    from tui_merger.core.io.sources import open_model

    info = layout.run
    config_dir = Path(options.base) if options.base is not None else layout.hf_dir
    if config_dir is None:
        raise MergeError(layout.missing_base)
    config = read_config(config_dir)
    recorded = info.peft.get("alpha")
    recorded = recorded if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0 else None
    alpha = options.lora_alpha if options.lora_alpha is not None else recorded
    swift = info.framework == "ms-swift"  # issue 39: ms-swift's LoRA (args.json) read like Bridge's
    said_in, base_field = ("args.json", "mcore_model") if swift else ("run_config.yaml", "checkpoint.pretrained_checkpoint")
    if alpha is None:
        raise MergeError(
            f"The {said_in} of {layout.folder} records no positive {'lora_alpha' if swift else 'peft.alpha'}; pass "
            "--lora-alpha with the value used in training."
        )
    base_iter = pretrained_iteration(info, layout.folder) if options.base is None else None
    base_layout = None
    if base_iter is not None:
        base_layout = _mcore_layout(base_iter)
        if base_layout.run.lora:
            raise MergeError(
                f"{base_iter}, the {base_field} of {layout.folder}, is itself a PEFT run; point "
                f"{base_field} at the full model or pass --base with its Hugging Face model."
            )
    shards = read_dist_adapter(info.model_dir, config, config_dir)
    adapter = adapter_from_source(info.model_dir, peft_config(shards, alpha, info.hf_ref, info.peft.get("use_rslora")),
                                  shards.source)
    inputs = Inputs(None, adapter, {}, FilePlan(), paths_of(options), closers=[adapter])
    inputs.notices = list(layout.notices)
    if adapter.param_lora:  # a VL MoE run's packed experts (megatron_lora._vl_packed_experts): placed in the base
        from tui_merger.core.formats.hf_names import place_parameter_loras

        place_parameter_loras(adapter, config_dir, inputs.closers)
    if shards.renames:  # a VL model saved under other names than its in-memory ones (issue 39): peft wants these
        inputs.memory_adapter = adapter
        inputs.adapter = renamed(adapter, lambda n: shards.renames.get(n, n))
    try:
        inputs.config = config
        if base_layout is not None:
            base_files = _convert(base_layout, config, config_dir, inputs, options)
            into = f"the base checkpoint its {said_in} names ({base_iter}; --base merges into another)"
        else:
            base = inputs.base = open_model(config_dir)
            inputs.closers.append(base)
            base_files = [config_dir / f for f in base.files]
            why = (f"{info.pretrained} ({base_field}) is not on this machine" if info.pretrained and
                   options.base is None else "--base" if options.base is not None else f"the run names no {base_field}")
            into = f"the Hugging Face model {config_dir} ({why})"
        said = "--lora-alpha" if options.lora_alpha is not None else said_in
        kind = "LoRA" if swift else KINDS[shards.kind]
        rs = ", rsLoRA" if info.peft.get("use_rslora") else ""
        inputs.notices.append(
            f"{'An' if swift else 'A'} {info.name} {kind} run: its adapter (rank {shards.r}, alpha {alpha:g} from {said}{rs}) is "
            f"merged into {into}."
        )
        dtype = config_dtype(config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        inputs.files = plan_files(config_dir, config_dir, config, options.tokenizer_from)
        inputs.notices += shards.notices + adapter.notices + inputs.files.notices
        inputs.read_files = (base_files + [config_dir / "config.json", info.config_file]
                             + [info.model_dir / f for f in shards.source.files] + [src for src, _ in inputs.files.copies])
    except BaseException:
        inputs.close()
        raise
    return inputs


def _tie(inputs, options, source: MegatronSource, mapping: _Mapping) -> None:
    """Megatron saves no output layer when it shares the embedding: the model ties them. A real output
    layer is never dropped, whatever --tie-word-embedding says, unless it equals the embedding."""
    config = inputs.config
    tied = bool(_cfg(config, "tie_word_embeddings", False))
    head = mapping.head
    if head == "score.weight":
        return
    if head is None:
        if not tied:
            inputs.config_changes["tie_word_embeddings"] = True
            inputs.notices.append(
                "The checkpoint has no output layer (Megatron shared it with the embedding), so the model ties "
                "them: tie_word_embeddings is set to true."
            )
        return
    if tied:
        if source.same_rows(mapping.embed, head):
            del source.tensors[head]
            return
        inputs.config_changes["tie_word_embeddings"] = False
        inputs.notices.append(
            "The config ties the output layer to the embedding, but the checkpoint's output layer differs from it, "
            "so both are kept and tie_word_embeddings is set to false."
        )
    elif options.tie_word_embedding:
        inputs.notices.append(
            "--tie-word-embedding was given, but the checkpoint has its own output layer and its config is untied: "
            "lm_head.weight is kept (dropping it would change the model) and tie_word_embeddings stays false."
        )


# -- the kind ---------------------------------------------------------------------------------------

_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")
MCORE_BACKENDS = tuple(FRAMEWORKS)  # the backends of megatron_runs' layouts


class VerlMegatronFormat(Format):
    """Detect: ``dist_ckpt/`` beside ``huggingface/`` or ``transformer_config.json`` (v1);
    ``model/dist_ckpt`` or ``ckpt_contents.json`` (v2); ``model/mp_rank_*`` (legacy). Open: the DCP or
    rank files converted to Hugging Face names (``MegatronSource``). No adapter: a conversion, so no
    reference (the recompute compares every tensor with the checkpoint's)."""

    kind = "verl-megatron"
    role = "checkpoint"
    backend = "megatron"
    label = "a Megatron checkpoint"
    short = "a Megatron one"

    def detect(self, s, folder: Path, names: dict) -> Found | None:
        from tui_merger.core.formats.megatron_runs import detect_run

        mcore = detect_run(s, folder, names, self.kind)
        if mcore is not None:
            return mcore
        found = self._layout(s, folder, names)
        if found is None:
            return None
        layout, model_dir, hf = found
        role = folder.name if folder.name in ("actor", "critic") else None
        step_dir = folder.parent if role else folder
        step = step_of(step_dir.name, STEP_DIR)
        c = Candidate(
            self.kind, str(folder), step=step, run=str(step_dir.parent) if step is not None else None,
            role=role, backend=f"megatron-{layout}",
        )
        model_names = s.names(model_dir)
        if layout == "legacy":
            c.world_size = sum(1 for n in model_names if n.startswith("mp_rank_")) or None
        else:
            c.world_size = len({m.group(1) for n in model_names if (m := _DISTCP.match(n))}) or None
        hf_names = s.names(hf)
        c.dtype = config_dtype(s.json(hf / "config.json") if "config.json" in hf_names else None)
        c.tokenizer = any(m in hf_names for m in TOKENIZER_MARKERS)
        if layout == "v2" and s.weight_files(hf, hf_names):
            c.notes.append("model/huggingface holds the model in Hugging Face format (mbridge): nothing to merge.")
        lora = _lora_run(folder) if layout != "v2" or not s.weight_files(hf, hf_names) else None
        if lora is not None:
            self._lora(s, c, folder, lora)
        s.sized(c, names.values(), recursive=True)
        return Found(c, ALL)

    def _lora(self, s, c: Candidate, folder: Path, lora: LoraRun) -> None:
        """A LoRA run: r, alpha and targets from its Hugging Face adapter export (the base it names
        resolved as a PEFT adapter's is), else from verl's adapter shards; without either, what is missing."""
        if lora.export is None and lora.shard_dir is not None:
            self._shards(s, c, folder, lora)
            return
        if lora.export is None and lora.dist_dir is not None:
            self._dist_peft(s, c, folder, lora)
            return
        if lora.export is None:
            c.lora = lora_info(None)
            c.notes.append(lora_refusal(folder, lora))  # issue 39: a complete dist checkpoint is read (_dist_peft)
            return
        cfg = s.json(lora.export / "adapter_config.json", quiet_missing=False)
        _, infos = s.headers_dtype(lora.export, [n for n in s.names(lora.export) if n == "adapter_model.safetensors"])
        modules = {i.name.split(".lora_A")[0] for i in infos if ".lora_A" in i.name}
        c.lora = lora_info(cfg, len(modules) or None)
        c.needs_base = True
        c.notes.append(f"a LoRA run: its Hugging Face adapter export ({lora.export.relative_to(folder)}/) is "
                       "merged into the base model the run started from.")
        if cfg is not None and not cfg.get("lora_alpha"):
            c.notes.append("the adapter export records no lora_alpha (or 0): the merge needs --lora-alpha.")
        named = (cfg or {}).get("base_model_name_or_path")
        if not (isinstance(named, str) and named):
            named = (s.json(folder / "model" / "huggingface" / "config.json") or {}).get("_name_or_path")
        c.base_model = named if isinstance(named, str) and named else None
        if c.base_model is None:
            c.notes.append("the run names no base model: pass --base with the model it started from.")
        s.resolve_base(c, lora.export)

    def _dist_peft(self, s, c: Candidate, folder: Path, lora: LoraRun) -> None:
        """issue 39: verl's v2 layout with Megatron-Bridge PEFT, the adapters in a dist checkpoint: rank and
        targets from its index (.metadata); lora_alpha is not recorded."""
        from tui_merger.core.io.dcp import read_metadata

        try:
            keys = read_metadata(lora.dist_dir).state_dict_metadata
        except MergeError as err:
            s.problem(lora.dist_dir / METADATA, str(err))
            return
        ins = {str(k): v for k, v in keys.items() if str(k).endswith(".adapter.linear_in.weight")}
        size = next((getattr(v, "size", None) for v in ins.values()), None)
        targets = sorted({k.split(".adapter.")[0].rsplit(".", 1)[-1] for k in ins})
        c.lora = lora_info({"r": int(size[-2]) if size else None, "target_modules": targets or None})
        c.needs_base = True  # verl's v2 PEFT save keeps no base weight in model/dist_ckpt (open_verl_bridge_peft)
        c.notes.append(f"a Megatron-Bridge PEFT run saved by verl: its adapters are in {lora.dist_dir.relative_to(folder)}/ "
                       "(a dist checkpoint) and are merged into the base model the run started from.")
        meta_path = lora_train_meta_path(folder)
        alpha = ((s.json(meta_path) if meta_path is not None else None) or {}).get("lora_alpha")
        if alpha:
            c.lora["alpha"] = alpha
        else:
            c.notes.append("the adapters do not record lora_alpha (verl keeps it in its training config, "
                           "actor_rollout_ref.model.lora.alpha): the merge needs --lora-alpha.")
        hf = folder / "model" / "huggingface"
        named = (s.json(hf / "config.json") or {}).get("_name_or_path") if (hf / "config.json").is_file() else None
        c.base_model = named if isinstance(named, str) and named else None
        if c.base_model is None:
            c.notes.append("the run names no base model: pass --base with the model it started from.")
        s.resolve_base(c, hf)

    def _shards(self, s, c: Candidate, folder: Path, lora: LoraRun) -> None:
        """verl's adapter shards: the LoRA kind, rank, targets and parallel layout from the file names,
        transformer_config.json and rank 0's pickle; lora_alpha is not in them."""
        from tui_merger.core.formats.megatron_lora import KINDS, describe, transformer_config

        info = describe(lora.shard_dir, transformer_config(folder))
        c.lora = lora_info({"r": info["r"], "use_dora": info["kind"] == "dora", "target_modules": info["targets"] or None})
        own = None
        for d in (folder / "dist_ckpt", folder / "model" / "dist_ckpt"):
            try:
                own = d if own is None and holds_model(d) else own
            except MergeError as err:  # a damaged one: said when the merge opens it
                s.problem(d / METADATA, str(err))
        c.needs_base = own is None
        if info["tp"]:
            parallel = ", ".join(f"{n} {w}" for n, w in (("TP", info["tp"]), ("PP", info["pp"]), ("EP", info["ep"]),
                                                          ("VPP", info["vpp"])) if n == "TP" or (w or 1) > 1)
            c.world_size = info["tp"] * info["pp"] * info["ep"]
            what = f"a Megatron {KINDS.get(info['kind'], 'LoRA')} run ({parallel})"
            c.notes.append(f"{what}: its adapter shards in {SHARDS_DIR}/ are merged into the base model the run started "
                           "from." if not info["problem"] else f"{what}, its adapters in {SHARDS_DIR}/.")
        if info["problem"]:
            c.notes.append(info["problem"])
        meta_path = lora_train_meta_path(folder)
        meta = s.json(meta_path) if meta_path is not None else None
        alpha = (meta or {}).get("lora_alpha")
        if alpha:
            c.lora["alpha"] = alpha
            where = meta_path.name if meta_path.parent == folder else f"{meta_path.parent.name}/{meta_path.name}"
            c.notes.append(f"alpha {alpha:g}, from {where} (the adapter shards do not record it).")
            if meta.get("r") not in (None, c.lora["r"]):
                c.notes.append(f"{where} says r {meta['r']} but the adapter shards have rank {c.lora['r']}.")
        else:
            c.notes.append("the adapter shards do not record lora_alpha (nor does a lora_train_meta.json): the merge "
                           "needs --lora-alpha.")
        if own is not None:
            c.notes.append(f"{own.relative_to(folder)}/ holds the run's base weights too (use_dist_checkpointing): "
                           "the shards are merged into them unless --base names another model.")
            return
        hf = folder / "huggingface"
        named = (s.json(hf / "config.json") or {}).get("_name_or_path") if (hf / "config.json").is_file() else None
        c.base_model = named if isinstance(named, str) and named else None
        if c.base_model is None:
            c.notes.append("the run names no base model: pass --base with the model it started from.")
        s.resolve_base(c, hf)

    def _layout(self, s, folder: Path, names: dict) -> tuple[str, Path, Path] | None:
        """(layout, dist_ckpt or mp_rank folder, huggingface folder) of a verl Megatron checkpoint."""
        if is_dir(names.get("dist_ckpt")) and ("huggingface" in names or "transformer_config.json" in names):
            return "v1", folder / "dist_ckpt", folder / "huggingface"
        sub = s.names(folder / "model") if is_dir(names.get("model")) else {}
        if "dist_ckpt" in sub or "ckpt_contents.json" in names:
            return "v2", folder / "model" / "dist_ckpt", folder / "model" / "huggingface"
        if any(n.startswith("mp_rank_") for n in sub):
            return "legacy", folder / "model", folder / "hf_config_and_tokenizer"
        if is_dir(names.get(SHARDS_DIR)) and ("huggingface" in names or "transformer_config.json" in names):
            return "adapters", folder / SHARDS_DIR, folder / "huggingface"
        return None

    def recognizes(self, path: Path) -> bool:
        return is_megatron_checkpoint(path)

    def locate(self, path: Path):
        return find_megatron_checkpoint(path)

    def why_not_mergeable(self, c: Candidate) -> str | None:
        if c.backend in MCORE_BACKENDS:
            from tui_merger.core.formats.megatron_runs import check_iteration, run_info

            try:
                check_iteration(Path(c.path), run_info(Path(c.path)))
            except MergeError as err:
                return str(err)
            return None
        lora = _lora_run(Path(c.path)) if c.lora is not None else None
        if lora is not None and lora.export is None and lora.shard_dir is None and lora.dist_dir is None:
            return lora_refusal(Path(c.path), lora)
        if lora is not None and lora.export is None and lora.shard_dir is not None:
            from tui_merger.core.formats.megatron_lora import describe, transformer_config

            return describe(lora.shard_dir, transformer_config(Path(c.path)))["problem"]
        return None

    def lora_to_fit(self, path: Path):
        """A LoRA run's adapter (its Hugging Face export, else its shards named as that export names
        them; alpha set to r where none is recorded: only shapes matter here)."""
        from tui_merger.core.formats.adapter import adapter_from_source, open_adapter

        layout = find_megatron_checkpoint(path)
        if layout.lora is None:
            return None
        if layout.lora.export is not None:
            return open_adapter(layout.lora.export)
        from tui_merger.core.formats.megatron_lora import peft_config, read_shards, shard_layout, transformer_config
        from tui_merger.core.io.files import read_config

        if layout.hf_dir is None:
            return None
        if layout.lora.dist_dir is not None:  # issue 39: verl v2 + Megatron-Bridge PEFT
            from tui_merger.core.formats.megatron_lora import read_dist_adapter

            shards = read_dist_adapter(layout.lora.dist_dir, read_config(layout.hf_dir))
            try:
                return adapter_from_source(layout.lora.dist_dir, peft_config(shards, shards.r, None), shards.source)
            except BaseException:
                shards.source.close()
                raise
        shards = read_shards(shard_layout(layout.lora.shard_dir, transformer_config(layout.folder)), read_config(layout.hf_dir))
        try:
            return adapter_from_source(layout.lora.shard_dir, peft_config(shards, shards.r, None), shards.source)
        except BaseException:
            shards.source.close()
            raise

    def needs_base(self, c: Candidate) -> bool:
        if c.backend in MCORE_BACKENDS:  # the weights without a Hugging Face config (NeMo 2's built from its context)
            return not c.base_path and c.needs_base
        # a LoRA run holds the adapter, not the base (unless its dist checkpoint holds the whole model);
        # any other checkpoint holds every weight and its config
        return c.lora is not None and c.needs_base and not c.base_path

    def needs_alpha(self, c: Candidate) -> bool:
        return c.lora is not None and not c.lora.get("alpha")

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        problem = self.why_not_mergeable(c)
        if problem:
            return problem
        needed = self.needs_base(c) if c.backend in MCORE_BACKENDS else c.lora is not None and c.needs_base
        base = f" --base {base_arg}" if needed else ""
        alpha = " --lora-alpha ALPHA" if self.needs_alpha(c) else ""
        if c.backend in MCORE_BACKENDS:  # issue 39: Megatron-LM, Bridge, ms-swift, NeMo 2: their own command
            from tui_merger.core.formats.megatron_runs import next_step

            return next_step(c, path, base, alpha, out)
        return f"tui-merger merge --backend megatron --local_dir {quote(path)}{base}{alpha} --target_dir {quote(out)}"

    def open(self, options):
        return open_megatron_inputs(options)

    def reference(self, inputs, options, tmp: Path) -> Reference | None:
        if not inputs.adapter.lora:
            return None  # a conversion: the output is loaded once; the recompute compared every tensor
        # a LoRA run: peft applies the export (as read, --lora-alpha included) to the base as the merge read it
        folder = inputs.adapter.folder
        if options.lora_alpha is not None or not (folder / "adapter_config.json").is_file():  # the shards: written out
            folder = Path(tmp) / "adapter"
            export_peft_adapter(inputs.memory_adapter or inputs.adapter, folder, fsync=False)
        return Reference([(folder, None)])
