"""kohya-style LoRA files: one ``.safetensors`` file with ``<flat>.lora_down.weight`` [r, in],
``<flat>.lora_up.weight`` [out, r] and an optional ``<flat>.alpha`` per module, where ``<flat>`` is
the module path with every ``.`` turned into ``_`` behind a prefix (``lora_unet_``, ``lora_te1_``,
``lora_transformer_``, plain ``lora_``, ...).

The ``_`` is ambiguous (``mlp.down_proj`` and ``mlp_down.proj`` flatten alike), so names are mapped
back through the base model's own module names; a name that fits several modules, or none, is an
error. The result is an ordinary :class:`PeftAdapter` (LoRA tensors renamed to peft's keys, scale
alpha / rank, alpha = rank where the file has none), which the plan and the engine merge like any
adapter and ``export_peft_adapter`` writes as a PEFT adapter folder.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from shlex import quote

from tui_merger.core.formats.adapter import (
    PEFT_PREFIX,
    PeftAdapter,
    adapter_from_source,
    export_peft_adapter,
)
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.base import Candidate, Format, dominant_dtype
from tui_merger.core.io.sources import RenamedSource
from tui_merger.core.io.names import INPUT_EMBEDDING_SUFFIXES, OUTPUT_EMBEDDING
from tui_merger.core.options import common_and_exceptions, plain_number
from tui_merger.core.io.safetensors_io import SafetensorsFile
from tui_merger.core.io.sources import TensorSource

# longest first: "lora_te1_" must be tried before "lora_te_" and plain "lora_"
PREFIXES = ("lora_transformer_", "lora_unet_", "lora_te1_", "lora_te2_", "lora_te3_", "lora_te_", "lora_")
DOWN, UP, ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"
# (marker in a key, what it is): kohya / LyCORIS variants that are not a plain low-rank pair
UNSUPPORTED = (
    (".hada_", "LoHa (hada_ tensors)"),
    (".lokr_", "LoKr (lokr_ tensors)"),
    (".dora_scale", "DoRA (dora_scale tensors)"),
    (".lora_mid.", "LoCon with a Tucker mid layer (lora_mid tensors)"),
    (".oft_", "OFT (oft_ tensors)"),
    (".diff", "full-difference (diff tensors)"),
    (".w_norm", "norm-layer (w_norm tensors)"),
    (".b_norm", "norm-layer (b_norm tensors)"),
)
_SHOWN = 4


def _shown(names, n: int = _SHOWN) -> str:
    names = list(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def file_kind(path: Path) -> str | None:
    """What a loose ``.safetensors`` file holds, from its header: "kohya" (lora_down/lora_up or a
    kohya variant such as LoHa, which open_kohya then refuses by name), "peft" (lora_A/lora_B keys),
    or None."""
    header = SafetensorsFile(Path(path))
    try:
        names = list(header.tensors)
    finally:
        header.close()
    if any(n.endswith((DOWN, UP)) or any(m in n for m, _ in UNSUPPORTED[:3]) for n in names):
        return "kohya"
    if any(".lora_A." in n for n in names):
        return "peft"
    return None


class _FileView(RenamedSource):
    """The kohya file's LoRA tensors under peft's key names; owns (and closes) the file."""

    def __init__(self, inner: TensorSource, mapping: dict[str, str]) -> None:
        super().__init__(inner, mapping)
        self.files = inner.files

    def close(self) -> None:
        self.inner.close()


def module_names(base_names, config: dict | None = None) -> list[str]:
    """The base's module paths that own a weight (``model.layers.0.mlp.down_proj``), plus the output
    head when the files leave it out because it is tied to the input embedding (the plan decides): named
    as transformers names it for the model ``config`` describes (``plan.embeddings_of``: DeepSeek-V4's
    ``head``, a VL model's ``lm_head``); only without a config, or for a model transformers cannot build
    here, the usual ``lm_head``. (``plan.embeddings_of`` asks the same of a later stage.)"""
    from tui_merger.core.formats.hf_names import embedding_names

    found = embedding_names(config, set(base_names)) if config else None
    base_names = set(base_names)
    names = {n.rpartition(".")[0] for n in base_names if n.endswith(".weight") and "." in n}
    if found is not None and found.known:
        head, has_input = found.output, found.input is not None and found.input in base_names
    else:
        head, has_input = OUTPUT_EMBEDDING, any(n.endswith(INPUT_EMBEDDING_SUFFIXES) for n in base_names)
    if head is not None and head not in base_names and has_input:
        names.add(head.rpartition(".")[0])
    return sorted(names)


def match_modules(flats, base_names, config: dict | None = None) -> dict[str, str]:
    """{kohya flat name: base module path}. A flat name matches a module when, after a kohya prefix,
    it equals the module path with ``.`` turned into ``_``; failing that, when it equals the path
    without some of its leading parts (a LoRA trained on an inner model, e.g. ``layers_0_...`` for
    ``model.layers.0...``). Raises MergeError for names that match several modules or none."""
    modules = module_names(base_names, config)
    exact: dict[str, list[str]] = {}
    tails: dict[str, list[str]] = {}
    for mod in modules:
        parts = mod.split(".")
        exact.setdefault("_".join(parts), []).append(mod)
        for i in range(1, len(parts)):
            tails.setdefault("_".join(parts[i:]), []).append(mod)
    found: dict[str, str] = {}
    ambiguous: dict[str, list[str]] = {}
    unmatched: list[str] = []
    for flat in flats:
        rests = [flat[len(p):] for p in PREFIXES if flat.startswith(p) and len(flat) > len(p)] or [flat]
        candidates = list(dict.fromkeys(m for r in rests for m in exact.get(r, ())))
        if not candidates:
            candidates = list(dict.fromkeys(m for r in rests for m in tails.get(r, ())))
        if len(candidates) == 1:
            found[flat] = candidates[0]
        elif candidates:
            ambiguous[flat] = candidates
        else:
            unmatched.append(flat)
    if unmatched:
        raise MergeError(
            f"{len(unmatched)} of the {len(unmatched) + len(found) + len(ambiguous)} LoRA modules in the kohya "
            f"file match no module of the base ({_shown(sorted(unmatched))}), so the base is probably not the "
            "model the LoRA was trained on; nothing was written."
        )
    if ambiguous:
        flat, candidates = next(iter(sorted(ambiguous.items())))
        more = f" ({len(ambiguous) - 1} more names are ambiguous too)" if len(ambiguous) > 1 else ""
        raise MergeError(
            f"The kohya name {flat} fits several modules of the base ({', '.join(candidates)}), because kohya "
            f"writes every '.' as '_', so tui-merger cannot tell which one was trained{more}; nothing was written."
        )
    taken: dict[str, str] = {}
    for flat, mod in found.items():
        if mod in taken:
            raise MergeError(
                f"The kohya names {taken[mod]} and {flat} both map onto the module {mod} of the base; "
                "the file holds two LoRAs for one module, which tui-merger does not merge."
            )
        taken[mod] = flat
    return found


def _refuse_variants(path: Path, names) -> None:
    for marker, what in UNSUPPORTED:
        hit = next((n for n in names if marker in n), None)
        if hit is not None:
            raise MergeError(
                f"{path.name} is a {what} file ({hit}), a kohya variant tui-merger does not merge; "
                "only plain LoRA files (lora_down / lora_up / alpha) are supported."
            )


def _pairs(path: Path, source: TensorSource) -> tuple[dict, dict, dict]:
    """(downs, ups, alphas) by flat name, with every structural problem refused in one sentence."""
    names = list(source.tensors)
    _refuse_variants(path, names)
    downs, ups, alphas, other = {}, {}, {}, []
    for name, ref in source.tensors.items():
        if name.endswith(DOWN):
            downs[name[: -len(DOWN)]] = ref
        elif name.endswith(UP):
            ups[name[: -len(UP)]] = ref
        elif name.endswith(ALPHA):
            alphas[name[: -len(ALPHA)]] = ref
        else:
            other.append(name)
    if other:
        raise MergeError(
            f"{path.name} holds tensors that are not kohya LoRA tensors ({_shown(other)}); tui-merger merges "
            "only lora_down / lora_up / alpha, so nothing was written."
        )
    if not downs and not ups:
        raise MergeError(f"{path.name} holds no lora_down / lora_up tensors, so it is not a kohya-style LoRA file.")
    no_up, no_down = sorted(set(downs) - set(ups)), sorted(set(ups) - set(downs))
    stray = sorted(set(alphas) - set(downs) - set(ups))
    if no_up or no_down or stray:
        half, names = ("lora_up", no_up) if no_up else ("lora_down", no_down) if no_down else ("lora_down/lora_up", stray)
        raise MergeError(
            f"{path.name} has no {half} for {_shown(names)}, so the file is incomplete (a LoRA module needs both "
            "lora_down and lora_up); nothing was written."
        )
    for flat, down in downs.items():
        up = ups[flat]
        if len(down.shape) != 2 or len(up.shape) != 2:
            raise MergeError(
                f"{flat} is a convolution LoRA (lora_down {list(down.shape)}, lora_up {list(up.shape)}), which tui-merger does not "
                "merge; only LoRA on linear layers (2-D lora_down / lora_up) is supported."
            )
        if down.shape[0] != up.shape[1]:
            raise MergeError(
                f"{flat}: lora_down has rank {down.shape[0]} but lora_up has rank {up.shape[1]}, so the file "
                "is inconsistent; nothing was written."
            )
    return downs, ups, alphas


def _alpha(flat: str, ref, rank: int, notices: list) -> float:
    if ref is None:
        return rank
    if len(ref.shape) > 1 or (ref.shape and ref.shape[0] != 1):
        raise MergeError(f"{flat}.alpha has shape {list(ref.shape)} instead of one number; the file is damaged.")
    value = float(ref.load().reshape(()).item())
    ref.release()
    if not math.isfinite(value):  # fuzzing: a NaN alpha merged into a model of NaNs without a word
        raise MergeError(f"{flat}.alpha is {value}, not a finite number; the file is damaged.")
    if value == 0:  # kohya's own loader treats alpha 0 as "alpha = rank"
        notices.append(f"{flat}.alpha is 0; using alpha = rank ({rank}) as kohya's scripts do.")
        return rank
    return plain_number(value)


def open_kohya(path: Path, base_names, config: dict | None = None) -> PeftAdapter:
    """A kohya-style LoRA file as a PeftAdapter whose module names are the base's (``base_names``:
    the base's tensor names, e.g. ``model.layers.0.self_attn.q_proj.weight``)."""
    path = Path(path)
    source = TensorSource(path.parent, [path.name])
    try:
        downs, ups, alphas = _pairs(path, source)
        modules = match_modules(sorted(downs), base_names, config)
        notices: list[str] = []
        if not alphas:
            notices.append(f"{path.name} has no .alpha entries; using alpha = rank (scale 1) as kohya's scripts do.")
        ranks, alpha_of, mapping = {}, {}, {}
        for flat, mod in modules.items():
            ranks[mod] = downs[flat].shape[0]
            alpha_of[mod] = _alpha(flat, alphas.get(flat), ranks[mod], notices)
            mapping[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = downs[flat].name
            mapping[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = ups[flat].name
        r, rank_pattern = common_and_exceptions(ranks)
        alpha, alpha_pattern = common_and_exceptions(alpha_of)
        config = {
            "peft_type": "LORA",
            "r": r,
            "lora_alpha": alpha,
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules.values()}),
            "use_rslora": False,
            "use_dora": False,
            "fan_in_fan_out": False,
            "bias": "none",
            "base_model_name_or_path": None,
        }
        adapter = adapter_from_source(path, config, _FileView(source, mapping))
        for mod, entry in adapter.lora.items():  # the config must say what the file says, for peft too
            if (entry.r, entry.alpha) != (ranks[mod], alpha_of[mod]):
                raise MergeError(
                    f"{mod}: rank/alpha patterns resolve to r={entry.r}, alpha={entry.alpha} instead of "
                    f"r={ranks[mod]}, alpha={alpha_of[mod]}; module names this similar cannot be described "
                    "to peft, so nothing was written."
                )
        adapter.notices.extend(notices)
        adapter.per_module_alpha = True
        adapter.alpha_notices = list(notices)  # said about alphas the file lacks: gone with --lora-alpha
        if not alphas:
            adapter.alpha_from = "kohya's default"
    except BaseException:
        source.close()
        raise
    return adapter


def kohya_to_peft(path: Path, base_names, dest: Path, base_model: str | None = None, fsync: bool = True,
                  config: dict | None = None) -> list[str]:
    """Convert a kohya-style LoRA file into a PEFT adapter folder ``dest`` (adapter_config.json +
    adapter_model.safetensors with peft's key names) that ``PeftModel.from_pretrained`` loads. Written
    beside ``dest`` and renamed into place, so ``dest`` appears only when complete. Returns the files
    written (relative to dest's parent)."""
    import json

    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise MergeError(f"{dest} already exists; choose a new folder for the PEFT adapter.")
    adapter = open_kohya(path, base_names, config)
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tui-merger-partial", dir=dest.parent))
        written = export_peft_adapter(adapter, tmp / dest.name, fsync=fsync)
        cfg_path = tmp / dest.name / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = base_model  # export writes "..", meant for lora_adapter/ in a model
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        os.rename(tmp / dest.name, dest)
    finally:
        adapter.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return written


def _target(module: str) -> str:
    """The module kind of a kohya name: the part after its last layer index
    (``lora_unet_..._attentions_0_proj_in`` -> ``proj_in``, ``lora_te_..._layers_0_mlp_fc1`` -> ``mlp_fc1``)."""
    return re.split(r"_\d+_", module.removeprefix("lora_"))[-1]


class KohyaFormat(Format):
    """Detect: a loose ``.safetensors`` file with kohya LoRA keys (ranks from the headers, alphas from
    their few bytes). Open: ``open_kohya`` against the base's names. Reference: the same adapter written
    in peft's format, which peft then loads."""

    kind = "kohya-lora"
    role = "adapter"
    label = "a kohya-style LoRA file"

    def detect_file(self, s, path: Path) -> Candidate | None:
        """A ``.safetensors`` file whose header has lora_down / lora_up keys."""
        st = s.header(path)
        if st is None:
            return None
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
            return None
        c = Candidate(self.kind, str(path), needs_base=True)
        c.dtype = dominant_dtype(i for n, i in st.tensors.items() if ".lora_" in n)
        ranks = {m: i.shape[0] for m, i in downs.items() if len(i.shape) >= 2}
        r, rank_pattern = common_and_exceptions(ranks)
        alpha, alpha_pattern = common_and_exceptions(s.scalars(path, {m: alphas[m] for m in downs if m in alphas}))
        c.lora = {
            "r": r, "alpha": alpha, "rslora": False, "dora": dora,
            "target_modules": sorted({_target(m) for m in downs}),
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
        s.resolve_base(c, path.parent)
        try:
            c.size_bytes = os.stat(path).st_size
        except OSError as err:
            s.bad_entry(path, err)
        return c

    def recognizes(self, path: Path) -> bool:
        return path.is_file() and path.name.endswith(".safetensors") and file_kind(path) == "kohya"

    def can_weight(self, c: Candidate) -> bool:
        return True

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        return f"tui-merger merge --base {base_arg} --adapter {quote(path)} --out {quote(out)}"

    def open_adapter(self, path: Path, base_names, config: dict | None = None, alpha_given: bool = False):  # kohya: alpha 0 means alpha = rank
        if base_names is None:
            raise MergeError(
                f"{path} is a kohya-style LoRA file, whose module names can only be read against the base "
                "model; give the base model as well."
            )
        return open_kohya(path, base_names, config)

    def reference_folder(self, adapter, tmp: Path, name: str) -> Path:
        folder = Path(tmp) / name
        export_peft_adapter(adapter, folder, fsync=False)
        return folder
