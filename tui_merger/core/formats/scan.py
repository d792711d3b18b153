"""``tui-merger inspect``: find the checkpoints under a folder and say what each one is.

Reads names, ``stat`` results, small JSON files, safetensors headers and the key list (``data.pkl``)
of one verl rank file per checkpoint; never tensor data (kohya ``.alpha`` scalars aside: a few bytes
each). Imports nothing heavy, so it answers in milliseconds on a folder of 7B checkpoints.

Detection rules, checked in this order for every folder down to ``max_depth`` levels below PATH:

- ``model_world_size_W_rank_R.pt`` files: a verl FSDP checkpoint (role from the folder name:
  actor/critic, else the SFT layout; step from ``global_step_N``);
- ``dist_ckpt/`` beside ``huggingface/`` or ``transformer_config.json``: verl Megatron v1;
  ``model/dist_ckpt`` or ``ckpt_contents.json``: v2; ``model/mp_rank_*``: legacy;
- ``adapter_config.json``: a PEFT adapter (a trainer checkpoint when the folder is ``checkpoint-N``);
- ``checkpoint-N`` with weights or ``trainer_state.json``: a trainer checkpoint with full weights;
- ``config.json`` with weights: a Hugging Face model;
- any other ``.safetensors`` file whose header has ``lora_down``/``lora_up`` keys: a kohya-style LoRA.

Checkpoints of one run (``checkpoint-N``/``global_step_N`` folders with the same parent) are listed
together, newest step first; the one ``latest_checkpointed_iteration.txt`` names (else the highest
step) is marked latest. Anything unreadable becomes an :class:`EntryProblem` and the scan goes on.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
import time
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tui_merger.core.formats.peft_adapter import ADAPTER_WEIGHTS
from tui_merger.core.ship.cleanup import OPTIMIZER_FILE
from tui_merger.core.io.hf_refs import cached_snapshot, hub_cache
from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import TOKENIZER_MARKERS, config_dtype
from tui_merger.core.formats.verl_fsdp import RANK_FILE, STEP_DIR
from tui_merger.core.options import common_and_exceptions, human_bytes, plain_number
from tui_merger.core.io.safetensors_io import SafetensorsFile
from tui_merger.core.formats.hf_model import BIN_INDEX, SAFE_INDEX

KINDS = ("peft-adapter", "trainer-checkpoint", "verl-fsdp", "verl-megatron", "hf-model", "kohya-lora")
TRAINER_STEP = re.compile(r"^checkpoint-(\d+)$")
LATEST_FILE = "latest_checkpointed_iteration.txt"
# never entered below PATH: version control, caches and environments of other tools
SKIP_DIRS = frozenset({
    ".git", ".hg", ".svn", "__pycache__", "node_modules", ".cache", ".venv", "venv", ".tox",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", ".Trash",
})
MAX_JSON = 16 << 20  # config files are kilobytes; anything this big is not one
MAX_PICKLE = 64 << 20
_ALL = None  # "owned" value of a checkpoint that consists of its whole folder
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp$")
_LORA_A = re.compile(r"^(.+)\.lora_(?:embedding_)?A\b")
_PICKLED_LORA_A = re.compile(rb"([\w.]+)\.lora_(?:embedding_)?A\b")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")
_SCALAR = {"float32": "<f", "float64": "<d", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h", "int8": "<b", "uint8": "<B"}
_ROLE_ORDER = {"actor": 0, "critic": 1, "sft": 2}


def shown(path) -> str:
    """A path or name as printable text: bytes of non-UTF-8 names appear as ``\\xNN``."""
    return os.fspath(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class Candidate:
    """One checkpoint found by :func:`scan`. Paths are real (usable) paths; ``to_dict`` escapes them."""

    kind: str  # one of KINDS
    path: str
    step: int | None = None
    latest: bool = False
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

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("path", "run", "base_path"):
            if d[key] is not None:
                d[key] = shown(d[key])
        return d


@dataclass
class EntryProblem:
    path: str
    message: str  # one sentence, to follow the path ("is not valid JSON (...); fix or re-save it.")

    def to_dict(self) -> dict:
        return {"path": shown(self.path), "message": self.message}


@dataclass
class ScanResult:
    root: str
    candidates: list[Candidate]
    problems: list[EntryProblem]
    too_deep: int = 0  # folders not entered because they lie deeper than max_depth
    max_depth: int = 4
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "root": shown(self.root),
            "candidates": [c.to_dict() for c in self.candidates],
            "problems": [p.to_dict() for p in self.problems],
            "too_deep": self.too_deep,
            "max_depth": self.max_depth,
            "seconds": round(self.seconds, 4),
        }


def scan(path, max_depth: int = 4) -> ScanResult:
    """Every checkpoint under ``path`` (a folder, or a single kohya LoRA file), at most ``max_depth``
    folder levels down, with what could not be read. Raises MergeError only when ``path`` itself is
    missing or is neither a folder nor a file."""
    t0 = time.perf_counter()
    if max_depth < 0:
        raise MergeError("The depth must be 0 or more.")
    root = Path(os.path.abspath(os.fspath(path)))
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise MergeError(f"{shown(root)} does not exist; check the path.") from None
    except OSError as err:
        raise MergeError(f"Cannot look at {shown(root)}: {_reason(err)}.") from None
    scanner = _Scanner(root, max_depth)
    if stat.S_ISDIR(st.st_mode):
        scanner.visit(root, 0)
    elif stat.S_ISREG(st.st_mode):
        scanner.single_file(root)
    else:
        raise MergeError(f"{shown(root)} is neither a folder nor a regular file; point inspect at a folder.")
    result = scanner.result()
    result.seconds = time.perf_counter() - t0
    return result


def _reason(err: OSError) -> str:
    return err.strerror or str(err)


def _step(name: str, pattern) -> int | None:
    m = pattern.match(name)
    return int(m.group(1)) if m else None


def _is_dir(entry) -> bool:
    return entry is not None and entry.is_dir(follow_symlinks=False)


def _dominant_dtype(infos) -> str | None:
    """The dtype holding the most bytes among header entries."""
    count = Counter()
    for info in infos:
        count[info.dtype] += max(info.nbytes, 1)
    return count.most_common(1)[0][0] if count else None


def _kohya_target(module: str) -> str:
    """The module kind of a kohya name: the part after its last layer index
    (``lora_unet_..._attentions_0_proj_in`` -> ``proj_in``, ``lora_te_..._layers_0_mlp_fc1`` -> ``mlp_fc1``)."""
    return re.split(r"_\d+_", module.removeprefix("lora_"))[-1]


def _lora_info(cfg: dict | None = None, n_modules: int | None = None) -> dict:
    """LoRA settings as recorded: nothing is defaulted (a missing r or lora_alpha stays None)."""
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
    }


class _Scanner:
    def __init__(self, root: Path, max_depth: int) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.max_depth = max_depth
        self.candidates: list[Candidate] = []
        self.problems: dict[str, EntryProblem] = {}  # by path: one problem per entry
        self.too_deep = 0
        self._snapshots: dict[str, Path | None] = {}

    # -- bookkeeping ----------------------------------------------------------------------------
    def problem(self, path, message: str) -> None:
        key = os.fspath(path)
        self.problems.setdefault(key, EntryProblem(key, shown(message)))

    def bad_entry(self, path, err: OSError) -> None:
        """An entry that stat or open failed on: a link loop, a broken link, or unreadable."""
        if err.errno == errno.ELOOP:
            self.problem(path, "is a symbolic link loop; it was not followed.")
        elif err.errno == errno.ENOENT and os.path.islink(path):
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            self.problem(path, f"is a broken symbolic link (to {shown(target)}); it was skipped.")
        else:
            self.problem(path, f"cannot be read ({_reason(err)}); it was skipped.")

    def result(self) -> ScanResult:
        self._mark_latest()
        self.candidates.sort(key=_order)
        problems = sorted(self.problems.values(), key=lambda p: p.path)
        return ScanResult(str(self.root), self.candidates, problems, self.too_deep, self.max_depth)

    # -- walking --------------------------------------------------------------------------------
    def listing(self, folder: Path) -> list[os.DirEntry] | None:
        try:
            with os.scandir(folder) as it:
                return sorted(it, key=lambda e: e.name)
        except OSError as err:
            self.bad_entry(folder, err)
            return None

    def names(self, folder: Path) -> dict[str, os.DirEntry]:
        """The entries of a folder that is part of a checkpoint (quietly empty when absent)."""
        if not folder.is_dir():
            return {}
        return {e.name: e for e in self.listing(folder) or ()}

    def visit(self, folder: Path, depth: int) -> None:
        entries = self.listing(folder)
        if entries is None:
            return
        names = {e.name: e for e in entries}
        found, owned = self.classify(folder, names)
        if found is not None:
            self.candidates.append(found)
            if owned is _ALL:
                return
        for e in entries:
            if e.name in owned:
                continue
            try:
                if e.is_symlink():
                    self.link(e, found is None)
                elif e.is_dir(follow_symlinks=False):
                    if e.name in SKIP_DIRS:
                        continue
                    if depth >= self.max_depth:
                        self.too_deep += 1
                        continue
                    self.visit(Path(e.path), depth + 1)
                elif e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False):
                    self.loose_safetensors(Path(e.path))
            except OSError as err:
                self.bad_entry(e.path, err)

    def link(self, e: os.DirEntry, check_files: bool) -> None:
        """Links are never followed into folders: a loop or a broken link is reported, a link to a
        folder outside PATH is mentioned, one inside PATH is listed where it really is."""
        try:
            st = os.stat(e.path)
        except OSError as err:
            self.bad_entry(e.path, err)
            return
        if stat.S_ISDIR(st.st_mode):
            target = os.path.realpath(e.path)
            here = os.path.realpath(os.path.dirname(e.path))
            if here == target or here.startswith(target + os.sep):
                self.problem(e.path, f"is a symbolic link to its own parent folder {shown(target)} (a loop); it was not followed.")
            elif target != self.real_root and not target.startswith(self.real_root + os.sep):
                self.problem(e.path, f"links to {shown(target)}, outside the scanned folder; it was not followed (inspect that folder itself).")
        elif check_files and e.name.endswith(".safetensors") and stat.S_ISREG(st.st_mode):
            self.loose_safetensors(Path(e.path))

    def single_file(self, path: Path) -> None:
        if path.name.endswith(".safetensors") and self.loose_safetensors(path):
            return
        if str(path) not in self.problems:
            self.problem(path, "is not a kohya-style LoRA file; inspect looks for checkpoints in folders.")

    def classify(self, folder: Path, names: dict) -> tuple[Candidate | None, set | None]:
        """(the checkpoint this folder is, the names it consists of: _ALL when the whole folder)."""
        ranks = [n for n in names if RANK_FILE.match(n)]
        if ranks:
            return self.verl_fsdp(folder, names, ranks), _ALL
        megatron = self.megatron_layout(folder, names)
        if megatron:
            return self.verl_megatron(folder, names, *megatron), _ALL
        step = _step(folder.name, TRAINER_STEP)
        if "adapter_config.json" in names:
            return self.adapter(folder, names, step), _ALL if step is not None else {"adapter_config.json", *ADAPTER_WEIGHTS}
        weights = self.weight_files(folder, names)
        if step is not None and (weights or "trainer_state.json" in names):
            return self.full_model(folder, names, weights, step), _ALL
        if "config.json" in names and weights:
            return self.full_model(folder, names, weights, None), {*weights, SAFE_INDEX, BIN_INDEX}
        return None, set()

    # -- pieces ---------------------------------------------------------------------------------
    def regular(self, path: Path, quiet_missing: bool = False) -> os.stat_result | None:
        """stat of a file about to be read; None (and a problem) when it is not a regular file."""
        try:
            st = os.stat(path)
        except OSError as err:
            if not (quiet_missing and err.errno == errno.ENOENT and not os.path.islink(path)):
                self.bad_entry(path, err)
            return None
        if not stat.S_ISREG(st.st_mode):
            self.problem(path, "is not a regular file (a FIFO, device or folder); it was not read.")
            return None
        return st

    def json(self, path: Path, quiet_missing: bool = True) -> dict | None:
        st = self.regular(path, quiet_missing)
        if st is None:
            return None
        if st.st_size > MAX_JSON:
            self.problem(path, f"is {human_bytes(st.st_size)}, too large to be a config file; it was not read.")
            return None
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read())
        except OSError as err:
            self.bad_entry(path, err)
            return None
        except ValueError as err:
            self.problem(path, f"is not valid JSON ({err}); fix or re-save it.")
            return None
        if not isinstance(data, dict):
            self.problem(path, "does not hold a JSON object; fix or re-save it.")
            return None
        return self._typed(path, data)

    def _typed(self, path: Path, data: dict) -> dict:
        """Fields of the wrong type (a damaged or hand-edited file) are said once and left out, so
        that what is shown never depends on them; the merge refuses the file with the same words."""
        from tui_merger.core.formats.peft_adapter import adapter_config_problems
        from tui_merger.core.io.files import config_type_problems, without_problems

        if path.name == "config.json":
            problems = config_type_problems(data)
        elif path.name in ("adapter_config.json", "lora_train_meta.json"):
            problems = adapter_config_problems(data)
        else:
            return data
        if problems:
            self.problem(path, f"has {'; '.join(problems.values())}; the merge would refuse it, so fix or re-save it.")
        return without_problems(data, problems)

    def header(self, path: Path) -> SafetensorsFile | None:
        if self.regular(path) is None:
            return None
        try:
            return SafetensorsFile(path)
        except MergeError as err:
            message = str(err)
            self.problem(path, message[len(str(path)):].lstrip() if message.startswith(str(path)) else message)
            return None

    def headers_dtype(self, folder: Path, files) -> tuple[str | None, list]:
        """(dominant dtype, every header entry) of the safetensors files among ``files``."""
        infos = []
        for name in files:
            if name.endswith(".safetensors"):
                st = self.header(folder / name)
                if st is not None:
                    infos.extend(st.tensors.values())
        return _dominant_dtype(infos), infos

    def weight_files(self, folder: Path, names: dict) -> list[str]:
        """The weight files of a model folder as the merge would pick them (safetensors first)."""
        for index in (SAFE_INDEX, BIN_INDEX):
            if index in names:
                data = self.json(folder / index)
                weight_map = data.get("weight_map") if data else None
                if isinstance(weight_map, dict):
                    return sorted({str(v) for v in weight_map.values()})
                if data is not None:
                    self.problem(folder / index, "has no weight_map; the weights it indexes are unknown.")
                return []
        if "model.safetensors" in names:
            return ["model.safetensors"]
        shards = [n for n in names if n.endswith(".safetensors") and not n.startswith("adapter_")]
        if shards:
            return shards
        return ["pytorch_model.bin"] if "pytorch_model.bin" in names else []

    def size(self, entries, recursive: bool, optimizer: bool = False, seen: set | None = None) -> tuple[int, int]:
        """(bytes, optimizer bytes) of the files among ``entries`` (and below, when recursive): apparent
        sizes from stat, file links followed, folder links not, hard links counted once."""
        seen = set() if seen is None else seen
        total = optim = 0
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if recursive:
                        sub = self.listing(Path(e.path)) or ()
                        t, o = self.size(sub, True, optimizer or e.name == "optimizer", seen)
                        total, optim = total + t, optim + o
                    continue
                st = e.stat()
            except OSError as err:
                self.bad_entry(e.path, err)
                continue
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                continue
            if st.st_nlink > 1:
                seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            if optimizer or OPTIMIZER_FILE.fullmatch(e.name):
                optim += st.st_size
        return total, optim

    def sized(self, c: Candidate, entries, recursive: bool) -> None:
        c.size_bytes, optim = self.size(entries, recursive)
        if optim:
            c.notes.append(f"optimizer state present: {human_bytes(optim)}.")

    def resolve_base(self, c: Candidate, near: Path) -> None:
        """Where the base model named by the checkpoint is on this machine, if anywhere."""
        ref = c.base_model
        if not ref:
            return
        p = Path(ref).expanduser()
        for folder in [p] if p.is_absolute() else [near / p, Path.cwd() / p]:
            if (folder / "config.json").is_file():
                c.base_resolves, c.base_path = "path", os.path.normpath(folder)
                return
        if _REPO_ID.fullmatch(ref) and "--" not in ref and ".." not in ref:
            snapshot = self.snapshot(ref)
            if snapshot is not None:
                c.base_resolves, c.base_path = "hf-cache", str(snapshot)
                return
            c.base_resolves = "missing"
            c.notes.append(
                f"base model {ref} is neither a local folder nor in the Hugging Face cache ({shown(hub_cache())}): "
                f"it would need a download, which tui-merger never does (huggingface-cli download {ref}, then --base)."
            )
        else:
            c.base_resolves = "missing"
            c.notes.append(f"base model folder {ref} does not exist here; pass --base with the model it was trained on.")

    def snapshot(self, repo_id: str) -> Path | None:
        if repo_id not in self._snapshots:
            self._snapshots[repo_id] = cached_snapshot(repo_id)
        return self._snapshots[repo_id]

    # -- kinds ----------------------------------------------------------------------------------
    def adapter(self, folder: Path, names: dict, step: int | None) -> Candidate:
        c = Candidate(
            "trainer-checkpoint" if step is not None else "peft-adapter",
            str(folder), step=step, run=str(folder.parent) if step is not None else None, needs_base=True,
        )
        cfg = self.json(folder / "adapter_config.json", quiet_missing=False)
        weights = next((w for w in ADAPTER_WEIGHTS if w in names), None)
        n_modules = None
        if weights is None:
            c.notes.append("no adapter_model.safetensors or adapter_model.bin: the adapter weights are missing.")
        elif weights.endswith(".safetensors"):
            c.dtype, infos = self.headers_dtype(folder, [weights])
            n_modules = len({m.group(1) for i in infos if (m := _LORA_A.match(i.name))}) if infos else None
        if cfg is not None:
            peft_type = str(cfg.get("peft_type", "LORA")).upper()
            if peft_type == "LORA":
                c.lora = _lora_info(cfg, n_modules)
                if c.lora["alpha"] is None:
                    c.notes.append("adapter_config.json has no lora_alpha: peft, and the merge, would use 8.")
                elif not c.lora["alpha"]:
                    c.notes.append("lora_alpha is 0, so the adapter changes nothing: set the training value (the merge refuses 0).")
            else:
                c.notes.append(f"a {peft_type} adapter: tui-merger merges LoRA adapters only.")
            base = cfg.get("base_model_name_or_path")
            c.base_model = base if isinstance(base, str) and base else None
            if c.base_model is None:
                c.notes.append("adapter_config.json names no base model: pass --base with the model it was trained on.")
            self.resolve_base(c, folder)
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        self.sized(c, names.values(), recursive=step is not None)
        return c

    def full_model(self, folder: Path, names: dict, weights: list[str], step: int | None) -> Candidate:
        kind = "trainer-checkpoint" if step is not None else "hf-model"
        c = Candidate(kind, str(folder), step=step, run=str(folder.parent) if step is not None else None)
        config = self.json(folder / "config.json")
        present = [w for w in weights if w in names]
        header_dtype, _ = self.headers_dtype(folder, present)
        said_dtype = config_dtype(config)
        c.dtype = header_dtype or said_dtype
        if header_dtype and said_dtype and header_dtype != said_dtype:
            c.notes.append(f"config.json says {said_dtype} but the weights are stored in {header_dtype}.")
        missing = [w for w in weights if w not in names]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            c.notes.append(f"the weight index names missing files ({', '.join(missing[:3])}{more}): the weights are incomplete.")
        if not weights:
            zero = "zero_to_fp32.py" in names or any(n.startswith("global_step") for n in names)
            c.notes.append(
                "no model weights: only DeepSpeed ZeRO shards (run its zero_to_fp32.py to get them)."
                if zero else "no model weights or adapter: only trainer state."
            )
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        self.sized(c, names.values(), recursive=step is not None)
        return c

    def verl_fsdp(self, folder: Path, names: dict, ranks: list[str]) -> Candidate:
        role = folder.name if folder.name in ("actor", "critic") else "sft"
        step_dir = folder if role == "sft" else folder.parent
        step = _step(step_dir.name, STEP_DIR)
        c = Candidate(
            "verl-fsdp", str(folder), step=step, run=str(step_dir.parent) if step is not None else None, role=role
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
        fsdp_cfg = self.json(folder / "fsdp_config.json")
        version = fsdp_cfg.get("FSDP_version") if fsdp_cfg else None
        c.backend = f"fsdp{version}" if version in (1, 2) else "fsdp"
        said = fsdp_cfg.get("world_size") if fsdp_cfg else None
        c.world_size = said if isinstance(said, int) and said > 0 else world
        if "fsdp_config.json" not in names:
            c.notes.append("no fsdp_config.json (verl < 0.4.1): the world size comes from the rank file names.")
        elif c.world_size != world:
            c.notes.append(f"fsdp_config.json says world size {said} but the rank files are of world size {world}.")
        hf = folder / "huggingface"
        hf_names = self.names(hf)
        config = self.json(hf / "config.json") if "config.json" in hf_names else None
        c.dtype = config_dtype(config)
        c.tokenizer = any(m in hf_names for m in TOKENIZER_MARKERS)
        if "config.json" not in hf_names:
            c.notes.append("no huggingface/config.json: the merge needs --base for the model's config.")
        elif self.weight_files(hf, hf_names):
            c.notes.append("huggingface/ also holds the full model weights: it can be used as it is.")
        keys = None
        rank0 = names.get(f"model_world_size_{world}_rank_0.pt")
        if rank0 is not None:
            keys = self.pickled_keys(Path(rank0.path))
        self.verl_lora(c, folder, names, keys, config)
        if role == "critic":
            c.notes.append("critic (value model): the merge writes a TokenClassification model with one label.")
        self.sized(c, names.values(), recursive=True)
        return c

    def pickled_keys(self, path: Path) -> bytes | None:
        """The pickle of a torch.save archive (its key names and tensor metadata, no tensor data)."""
        if self.regular(path) is None:
            return None
        try:
            with zipfile.ZipFile(path) as z:
                info = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
                if info is not None and info.file_size <= MAX_PICKLE:
                    return z.read(info)
        except (OSError, EOFError, ValueError, NotImplementedError, zipfile.BadZipFile):
            pass
        self.problem(path, "is not a readable torch.save archive (truncated, or still being written?); its keys were not checked.")
        return None

    def verl_lora(self, c: Candidate, folder: Path, names: dict, keys: bytes | None, config: dict | None) -> None:
        """r and alpha from lora_train_meta.json (verl >= 0.8) or lora_adapter/adapter_config.json
        (<= 0.7); the LoRA modules from the key names of rank 0. lora_alpha is never assumed."""
        meta = self.json(folder / "lora_train_meta.json") if "lora_train_meta.json" in names else None
        exported = self.json(folder / "lora_adapter" / "adapter_config.json") if "lora_adapter" in names else None
        modules = sorted({m.group(1) for m in _PICKLED_LORA_A.finditer(keys)}) if keys else []
        if meta is None and exported is None and not modules:
            return
        lora = _lora_info(exported, len(modules) or None)
        if meta is not None:
            lora["r"] = meta.get("r", lora["r"])
            lora["alpha"] = meta.get("lora_alpha", lora["alpha"])
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
            self.resolve_base(c, folder)

    def megatron_layout(self, folder: Path, names: dict) -> tuple[str, Path, Path] | None:
        """(layout, dist_ckpt or mp_rank folder, huggingface folder) of a verl Megatron checkpoint."""
        if _is_dir(names.get("dist_ckpt")) and ("huggingface" in names or "transformer_config.json" in names):
            return "v1", folder / "dist_ckpt", folder / "huggingface"
        sub = self.names(folder / "model") if _is_dir(names.get("model")) else {}
        if "dist_ckpt" in sub or "ckpt_contents.json" in names:
            return "v2", folder / "model" / "dist_ckpt", folder / "model" / "huggingface"
        if any(n.startswith("mp_rank_") for n in sub):
            return "legacy", folder / "model", folder / "hf_config_and_tokenizer"
        return None

    def verl_megatron(self, folder: Path, names: dict, layout: str, model_dir: Path, hf: Path) -> Candidate:
        role = folder.name if folder.name in ("actor", "critic") else None
        step_dir = folder.parent if role else folder
        step = _step(step_dir.name, STEP_DIR)
        c = Candidate(
            "verl-megatron", str(folder), step=step, run=str(step_dir.parent) if step is not None else None,
            role=role, backend=f"megatron-{layout}",
        )
        model_names = self.names(model_dir)
        if layout == "legacy":
            c.world_size = sum(1 for n in model_names if n.startswith("mp_rank_")) or None
        else:
            c.world_size = len({m.group(1) for n in model_names if (m := _DISTCP.match(n))}) or None
        hf_names = self.names(hf)
        c.dtype = config_dtype(self.json(hf / "config.json") if "config.json" in hf_names else None)
        c.tokenizer = any(m in hf_names for m in TOKENIZER_MARKERS)
        if layout == "v2" and self.weight_files(hf, hf_names):
            c.notes.append("model/huggingface holds the model in Hugging Face format (mbridge): nothing to merge.")
        if _is_dir(names.get("adapter_checkpoint")):
            c.notes.append("holds a Megatron PEFT adapter (adapter_checkpoint/), which tui-merger cannot merge yet.")
        self.sized(c, names.values(), recursive=True)
        return c

    def loose_safetensors(self, path: Path) -> bool:
        """A kohya-style LoRA file is listed; other loose safetensors files are not checkpoints."""
        st = self.header(path)
        if st is None:
            return False
        downs, ups, alphas, dora = {}, set(), {}, False
        for name, info in st.tensors.items():
            if name.endswith(".lora_down.weight"):
                downs[name[: -len(".lora_down.weight")]] = info
            elif name.endswith(".lora_up.weight"):
                ups.add(name[: -len(".lora_up.weight")])
            elif name.endswith(".alpha"):
                alphas[name[: -len(".alpha")]] = info
            dora = dora or "dora_scale" in name
        if not downs and not ups:
            return False
        c = Candidate("kohya-lora", str(path), needs_base=True)
        c.dtype = _dominant_dtype(i for n, i in st.tensors.items() if ".lora_" in n)
        ranks = {m: i.shape[0] for m, i in downs.items() if len(i.shape) >= 2}
        r, rank_pattern = common_and_exceptions(ranks)
        alpha, alpha_pattern = common_and_exceptions(self.scalars(path, {m: alphas[m] for m in downs if m in alphas}))
        c.lora = {
            "r": r, "alpha": alpha, "rslora": False, "dora": dora,
            "target_modules": sorted({_kohya_target(m) for m in downs}),
            "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
            "modules_to_save": [], "n_modules": len(downs),
        }
        if alpha is None:
            c.notes.append("no .alpha entries: kohya's scripts then use alpha = rank.")
        unpaired = set(downs) ^ ups
        if unpaired:
            c.notes.append(f"{len(unpaired)} module(s) have only one of lora_down/lora_up: the file is incomplete.")
        base = st.metadata.get("ss_sd_model_name") or st.metadata.get("ss_base_model_version")
        c.base_model = base if isinstance(base, str) and base else None
        self.resolve_base(c, path.parent)
        try:
            c.size_bytes = os.stat(path).st_size
        except OSError as err:
            self.bad_entry(path, err)
        self.candidates.append(c)
        return True

    def scalars(self, path: Path, infos: dict) -> dict:
        """The values of 0-d (or one-element) tensors, read from their few bytes."""
        values = {}
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as err:
            self.bad_entry(path, err)
            return values
        try:
            for key, info in infos.items():
                if info.numel != 1:
                    continue
                raw = os.pread(fd, info.nbytes, info.start)
                if info.dtype == "bfloat16":
                    (value,) = struct.unpack("<f", b"\0\0" + raw)
                elif info.dtype in _SCALAR:
                    (value,) = struct.unpack(_SCALAR[info.dtype], raw)
                else:
                    continue
                values[key] = plain_number(round(float(value), 6))
        except (OSError, struct.error) as err:
            self.problem(path, f"its alpha values cannot be read ({err}).")
        finally:
            os.close(fd)
        return values

    # -- latest ---------------------------------------------------------------------------------
    def _mark_latest(self) -> None:
        runs: dict[str, list[Candidate]] = {}
        for c in self.candidates:
            if c.run is not None and c.step is not None:
                runs.setdefault(c.run, []).append(c)
        for run, group in runs.items():
            steps = {c.step for c in group}
            mark = max(steps)
            named = self.latest_named(Path(run) / LATEST_FILE)
            if named is not None:
                if named in steps:
                    mark = named
                else:
                    self.problem(
                        Path(run) / LATEST_FILE,
                        f"names step {named}, which is not in the folder; the highest step, {mark}, is marked latest instead.",
                    )
            for c in group:
                c.latest = c.step == mark

    def latest_named(self, path: Path) -> int | None:
        if self.regular(path, quiet_missing=True) is None:
            return None
        try:
            with open(path, "rb") as f:
                text = f.read(64).decode("ascii").strip()
            return int(text)
        except OSError as err:
            self.bad_entry(path, err)
        except ValueError:
            self.problem(path, "does not hold a step number; the highest step is marked latest instead.")
        return None


def _order(c: Candidate):
    """Runs and single checkpoints by path; in a run the final output (no step) first, then newest step first."""
    group = c.run if c.run is not None else c.path
    step = -1 if c.step is None else c.step
    return (group, c.step is not None, -step, _ROLE_ORDER.get(c.role, 3), c.path)
