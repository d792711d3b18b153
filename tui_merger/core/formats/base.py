"""The protocol every checkpoint kind implements, and what detection returns.

A kind is one module in this package with one ``Format`` subclass, listed once in ``registry.py``.
Everything else (``inspect``, the merge's input opening, the command line's ``--backend`` choices, the
assistant's questions, verification's reference) asks the registry and never names a kind.

Three roles:

- ``checkpoint``: a folder that carries what a merge reads by itself (verl FSDP, verl Megatron); opened
  from ``MergeOptions.checkpoint``; ``backend`` is its ``--backend`` name.
- ``adapter``: merged into a base given with ``--base`` (a PEFT folder, a kohya-style file); opened from
  ``MergeOptions.adapters`` against the base's tensor names.
- ``model``: a complete Hugging Face model (a base; nothing to merge). Its ``open`` is the merge of a base
  with adapters.

Detection is cheap (names, ``stat``, small JSON files, safetensors headers; never tensor data): it is what
``inspect`` shows and runs over whole folders of checkpoints in milliseconds. Opening is where the work is.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

TRAINER_STEP = re.compile(r"^checkpoint-(\d+)$")
STEP_DIR = re.compile(r"^global_step_(\d+)$")
ALL = None  # "owned" value of a checkpoint that consists of its whole folder


def shown(path) -> str:
    """A path or name as printable text: bytes of non-UTF-8 names appear as ``\\xNN``."""
    return os.fspath(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def step_of(name: str, pattern) -> int | None:
    m = pattern.match(name)
    return int(m.group(1)) if m else None


def is_dir(entry) -> bool:
    return entry is not None and entry.is_dir(follow_symlinks=False)


def dominant_dtype(infos) -> str | None:
    """The dtype holding the most bytes among safetensors header entries."""
    count = Counter()
    for info in infos:
        count[info.dtype] += max(info.nbytes, 1)
    return count.most_common(1)[0][0] if count else None


def lora_info(cfg: dict | None = None, n_modules: int | None = None) -> dict:
    """LoRA settings as recorded, for ``Candidate.lora``: nothing is defaulted (a missing r or
    lora_alpha stays None)."""
    cfg = cfg or {}
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        targets = sorted(str(t) for t in targets)
    return {
        "r": cfg.get("r"),
        "alpha": cfg.get("lora_alpha"),
        "rslora": bool(cfg.get("use_rslora")),
        "dora": bool(cfg.get("use_dora")),
        "target_modules": targets,
        "rank_pattern": cfg.get("rank_pattern") or {},
        "alpha_pattern": cfg.get("alpha_pattern") or {},
        "modules_to_save": cfg.get("modules_to_save") or [],
        "n_modules": n_modules,
        # LoRA on parameters (MoE experts), listed only when there is some (older readers of --json)
        **({"target_parameters": sorted(map(str, cfg["target_parameters"]))} if cfg.get("target_parameters") else {}),
    }


@dataclass
class Candidate:
    """One checkpoint found by ``inspect``. Paths are real (usable) paths; ``to_dict`` escapes them."""

    kind: str  # what inspect shows: a Format's kind, or "trainer-checkpoint"
    path: str
    step: int | None = None
    latest: bool = False
    best: bool = False  # the run's trainer_state.json names it best_model_checkpoint
    run: str | None = None  # the folder holding this run's checkpoint-N / global_step_N folders
    role: str | None = None  # verl: actor, critic or sft
    backend: str | None = None  # fsdp1, fsdp2, fsdp (version unknown), megatron-legacy/-v1/-v2
    world_size: int | None = None
    dtype: str | None = None
    size_bytes: int = 0
    base_model: str | None = None  # the model the weights need, as recorded (None: none needed or unknown)
    base_resolves: str | None = None  # "path", "hf-cache" or "missing" (needs a download)
    base_path: str | None = None  # where it resolved
    needs_base: bool = False  # a merge needs --base (adapters, save_lora_only, kohya files)
    tokenizer: bool = False
    lora: dict | None = None  # r, alpha, rslora, dora, target_modules, rank_pattern, alpha_pattern, modules_to_save, n_modules
    notes: list[str] = field(default_factory=list)
    format: str | None = field(default=None, repr=False, compare=False)  # the Format that found it (not shown)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("format")
        for key in ("path", "run", "base_path"):
            if d[key] is not None:
                d[key] = shown(d[key])
        return d


@dataclass
class Found:
    """What a folder is: the candidate, and the entry names it consists of (``ALL``: the whole folder,
    which the scan then does not enter)."""

    candidate: Candidate
    owned: set | None = ALL


@dataclass
class Reference:
    """What verification runs as the unmerged reference: the base tensors as the merge read them
    (``inputs.base``) with these adapters applied by peft. ``config_dir``: the folder whose config.json
    builds the model (None: the merged output's own config)."""

    adapters: list  # [(folder peft can load, weight or None), ...]
    config_dir: Path | None = None


class Format:
    """One checkpoint kind. Subclasses set the class attributes and override what their role needs."""

    kind: str = ""  # the name inspect shows ("verl-fsdp")
    role: str = ""  # "checkpoint", "adapter" or "model"
    backend: str | None = None  # checkpoint kinds: the --backend name ("fsdp")
    label: str = ""  # in words, for sentences ("a verl FSDP checkpoint")
    short: str = ""  # checkpoint kinds, after "not": "an FSDP one"

    # -- detection (cheap) -------------------------------------------------------------------------
    def detect(self, scan, folder: Path, names: dict) -> Found | None:
        """``names``: the folder's entries (name -> os.DirEntry). ``scan``: the scanner's helpers
        (json, header, names, sized, resolve_base, problem; see scan.py)."""
        return None

    def detect_file(self, scan, path: Path) -> Candidate | None:
        """A loose file (not a folder) that is a checkpoint of this kind."""
        return None

    def recognizes(self, path: Path) -> bool:
        """Cheap (names and stat): whether a path the user gave is of this kind."""
        return False

    # -- the assistant -----------------------------------------------------------------------------
    def why_not_mergeable(self, c: Candidate) -> str | None:
        return None

    def needs_base(self, c: Candidate) -> bool:
        """The user must give the base model folder (it is not named, or not on this machine)."""
        return not c.base_path

    def needs_alpha(self, c: Candidate) -> bool:
        """The checkpoint records no lora_alpha: the assistant asks for the one training used."""
        return False

    def alpha_default(self, c: Candidate) -> float | None:
        """The alpha the merge uses when the user gives none (None: the merge needs one)."""
        return None

    def can_weight(self, c: Candidate) -> bool:
        """An adapter the user may weight and blend with other adapters."""
        return False

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        """What ``inspect`` suggests: the command line that merges this candidate, or one sentence
        saying why there is nothing to run. ``path`` and ``out`` as shown (to be quoted), ``base_arg``
        ready to paste."""
        raise NotImplementedError

    # -- opening ------------------------------------------------------------------------------------
    def locate(self, path: Path):
        """Checkpoint kinds: the checkpoint's layout under ``path``, or a MergeError whose sentence
        says what is missing (used when ``--backend`` names this kind)."""
        raise NotImplementedError

    def open(self, options):
        """Checkpoint kinds: everything a merge reads, as ``Inputs``."""
        raise NotImplementedError

    def open_base(self, path: Path):
        """Model kinds: the base's ``TensorSource`` (names as ``save_pretrained`` writes them)."""
        raise NotImplementedError

    def open_adapter(self, path: Path, base_names, config: dict | None = None, alpha_given: bool = False):
        """Adapter kinds: the adapter as a ``PeftAdapter``, its names those of ``base_names`` (the base's,
        whose ``config`` says which of them transformers takes for what). ``alpha_given``: the user's
        --lora-alpha replaces the recorded one next, so a recorded 0 is no refusal."""
        raise NotImplementedError

    # -- verification -------------------------------------------------------------------------------
    def reference(self, inputs, options, tmp: Path) -> Reference | None:
        """Checkpoint kinds: the unmerged reference for the behaviour check; None when there is nothing
        to compare with (a conversion: the output is loaded once and its tensors were compared with the
        checkpoint's by the recompute). Every checkpoint kind says which, explicitly."""
        raise NotImplementedError

    def reference_folder(self, adapter, tmp: Path, name: str) -> Path:
        """Adapter kinds: a folder peft can load that holds this adapter."""
        raise NotImplementedError

    # -- the base proposal -----------------------------------------------------------------------------
    def weights_to_fit(self, path: Path) -> dict | None:
        """Checkpoint kinds that hold a full model's weights without its config: {name: shape} as
        save_pretrained names them (what a proposed base must match, name for name), or None."""
        return None

    def lora_to_fit(self, path: Path):
        """Checkpoint kinds that hold a LoRA without its base: that LoRA as a ``PeftAdapter`` (its
        shapes are what a proposed base must fit; alpha need not be known), or None."""
        return None
