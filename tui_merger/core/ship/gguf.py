"""GGUF export: a Hugging Face model folder as one ``.gguf`` file for llama.cpp, Ollama and LM Studio.

The file is written with llama.cpp's own Python library (``gguf``): its writer, its tensor-name maps
(``get_tensor_name_map``), its key names and its quantization (``gguf.quants``, bit-exact with ggml);
the k-quants (Q4_K_M and the rest), which ``gguf`` cannot write, by ``kquants.py``, byte for byte
what llama.cpp's ``llama-quantize`` writes from the same 16-bit weights, with its per-tensor mix.
What is ours is only which HF config field and tensor goes where, and that is data: one ``Family``
per model type in ``gguf_families.py`` (llama.cpp's architecture, its tensor transforms and keys).

``plan_gguf`` checks everything from ``config.json``, the tokenizer files and the safetensors headers
(no tensor data): a family, a rope scaling, a tokenizer or a tensor that a GGUF cannot express is one
sentence, and nothing is written. ``write_gguf`` then streams: one tensor at a time is read (mapped
from its file), converted and written, its pages handed back (Qwen3-MoE: one layer's experts of one
kind, stacked as llama.cpp wants them). The file goes to a hidden temporary name beside the target,
is fsynced and renamed; an error or a cancel leaves nothing behind. ``export_gguf`` does both and
records the file (path, type, size, sha256) in the folder's ``merge_manifest.json``.

gguf, numpy and torch are imported inside functions only: importing this module stays cheap.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import CancelToken, EventSink, Notice, PhaseStarted, TensorProgress, ignore_event
from tui_merger.core.io.files import fsync_path
from tui_merger.core.merge.output import check_space
from tui_merger.core.options import human_bytes
from tui_merger.core.ship import gguf_families, gguf_vl
from tui_merger.core.ship.gguf_families import REFUSED, Family
# the tokenizer (tokenizer.ggml.*) is gguf_vocab's; the split regexes stay importable here for the tests
from tui_merger.core.ship.gguf_vocab import _LLAMA3_SPLIT, _O200K_SPLIT, _QWEN2_SPLIT, add_tokenizer  # noqa: F401

TYPES = ("f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k", "q4_k_s", "q5_k_s", "q3_k_m")
# llama.cpp's k-quant file types (kquants.MIXES: which tensors get which type), written by kquants.py
K_MIXES = ("q4_k_m", "q5_k_m", "q6_k", "q4_k_s", "q5_k_s", "q3_k_m")
DEFAULT_TYPE = "f16"  # the one default of the command, the assistant and the plain flow (docs/command-line.md says why)
TYPE_WORDS = [  # (what the assistant and the plain flow offer, the type)
    ("f16 (default): 16-bit, every llama.cpp build runs it", "f16"),
    ("bf16: 16-bit, bf16 weights kept exactly", "bf16"),
    ("q8_0: 8-bit, about half the size, near-lossless", "q8_0"),
    ("q4_k_m: 4-bit k-quant (llama.cpp's mix), about a third of f16, what Ollama runs by default", "q4_k_m"),
    ("q5_k_m: 5-bit k-quant (llama.cpp's mix), closer to f16 than q4_k_m", "q5_k_m"),
    ("q6_k: 6-bit k-quant, near-lossless, a bit larger than q5_k_m", "q6_k"),
]
# model_type in config.json -> llama.cpp's architecture name (gguf.MODEL_ARCH_NAMES); the families
# themselves (transforms, keys, checks) are data in gguf_families.py
FAMILIES = {model_type: family.arch for model_type, family in gguf_families.FAMILIES.items()}
FAMILY_NAMES = gguf_families.family_names()
CANCELLED = "GGUF export cancelled; nothing was written."
_BLOCK_BYTES = 8 << 20  # source bytes read and converted at a time (a vocabulary-sized embedding is never held whole)
_EXPERT = re.compile(r"^(?P<layer>.+\.\d+\.[^.]+\.experts)\.(?P<e>\d+)\.(?P<kind>[^.]+)\.weight$")  # one expert's matrix
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_VL = "__vision_language__"  # in the config dict of a vision-language folder's language model: the folder's model_type
_SKIPPED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer older checkpoints saved; llama.cpp computes it

@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its GGUF name, the HF tensors it is made of (several: stacked experts),
    its shape (numpy order), the ggml type it is stored as and its bytes there."""

    name: str
    sources: tuple  # TensorRef, in stacking order; empty for a computed tensor
    shape: tuple[int, ...]
    qtype: int  # gguf.GGMLQuantizationType
    nbytes: int
    permute_heads: int | None = None  # Llama's q/k: rows reordered for llama.cpp's rope (heads)
    shift: float = 0.0  # added to every value (Gemma's norms, stored as 1 + w)
    rows: tuple[int, int] | None = None  # a part of the source: these rows of each matrix (packed gate/up halves)
    derive: object = None  # a function of the whole source tensor giving this one (DeepSeek's MLA k_b / v_b)
    computed: object = None  # a numpy array written as is (llama3's rope_freqs)

    @property
    def hf_name(self) -> str:
        return self.sources[0].name if self.sources else self.name


@dataclass
class GgufPlan:
    folder: Path
    out: Path
    type: str  # f16, bf16, q8_0
    arch: str  # llama.cpp's architecture name
    name: str  # general.name
    tensors: tuple[GgufTensor, ...]
    notices: tuple[str, ...]
    vocab: int
    _writer: object = field(default=None, repr=False)  # a GGUFWriter with every key and tensor info, no file yet
    _source: object = field(default=None, repr=False)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class GgufResult:
    path: Path
    type: str
    arch: str
    name: str
    size: int
    sha256: str
    tensors: int
    seconds: float
    recorded: bool  # the folder's merge_manifest.json lists it
    mmproj: Path | None = None  # a vision-language folder's vision tower beside it (gguf_mmproj.py)


def default_out(folder: Path, type_: str) -> Path:
    """MODEL_DIR/<folder name>-<TYPE>.gguf: inside the model folder, so an upload of the folder carries it."""
    folder = Path(folder).absolute()
    return folder / f"{folder.name}-{type_.upper()}.gguf"


def plan_gguf(folder: Path, type_: str = DEFAULT_TYPE, out: Path | None = None, overwrite: bool = False) -> GgufPlan:
    """Check the model folder, its config, tokenizer and tensors, and the target; write nothing.
    Raises MergeError with one sentence for anything a GGUF of it cannot say."""
    with _quiet_library_logs():
        return _plan_gguf(folder, type_, out, overwrite)


def _plan_gguf(folder: Path, type_: str, out: Path | None, overwrite: bool) -> GgufPlan:
    import gguf

    folder = Path(folder).expanduser().absolute()
    if type_ not in TYPES:
        raise MergeError(f"{type_!r} is not a GGUF type tui-merger writes; choose one of {', '.join(TYPES)}.")
    config = _read_config(folder)
    family = gguf_families.FAMILIES[config["model_type"]]
    arch = family.arch
    target = _target(folder, type_, out, overwrite)
    notices: list[str] = []
    hp = _hyperparameters(folder, config, family, notices)
    source = _open_source(folder)
    try:
        if config.get(_VL):
            source = gguf_vl.text_source(folder, source, hp["config"], notices, tuple(family.derive))
            hp["tie_word_embeddings"] = gguf_vl.tied(source, hp["tie_word_embeddings"], notices)
        tensors = _plan_tensors(folder, source, config, hp, family, type_, notices)
        writer = gguf.GGUFWriter(None, arch)
        vocab = add_tokenizer(writer, folder, hp["vocab_size"], notices)
        name = _add_general(writer, folder, type_, tensors)
        _add_hyperparameters(writer, hp, family)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, _np_float32(), t.nbytes, raw_dtype=gguf.GGMLQuantizationType(t.qtype))
        plan = GgufPlan(folder, target, type_, arch, name, tuple(tensors), tuple(notices), vocab, writer, source)
        check_space(target.parent, plan.tensor_bytes, "The GGUF", "an --out")
    except BaseException:
        source.close()
        raise
    return plan


def write_gguf(plan: GgufPlan, on_event: EventSink = ignore_event, cancel: CancelToken | None = None) -> GgufResult:
    """Stream the planned tensors into ``plan.out`` (temporary name, fsync, rename). A plan is written once.

    GGUFWriter writes the header, the metadata and the tensor infos (names, shapes, types, offsets);
    the tensor data then goes to the offsets it declared (each tensor at the writer's alignment, zero
    padding after), a row block at a time, so that no tensor is ever held whole; the sha256 is taken
    on the way."""
    from tui_merger.core.record.manifest import remember_hash

    writer, source = plan._writer, plan._source
    if writer is None:
        raise MergeError("This GGUF plan was already written; plan it again.")
    plan._writer = None
    started = time.perf_counter()
    out = plan.out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    _remove_stale(out)
    total, done_bytes = plan.tensor_bytes, 0
    on_event(PhaseStarted(
        "gguf",
        f"Writing {out.name}: {plan.arch}, {plan.type.upper()}, {len(plan.tensors)} tensors, about {human_bytes(total)}",
    ))
    for text in plan.notices:
        on_event(Notice("info", text))
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        handle = writer.fout[0]
        handle.flush()
        stream = _DataStream(handle.fileno(), handle.tell(), writer.data_alignment, tmp)
        scratch: list = []  # the read buffer, reused by every tensor
        for n, t in enumerate(plan.tensors, 1):
            _check(cancel)
            stream.begin(t)
            for piece in _pieces(t, cancel, scratch):
                stream.write(piece)
            stream.end(t)
            for ref in t.sources:
                ref.release()
            done_bytes += t.nbytes
            on_event(TensorProgress(t.name, n, len(plan.tensors), done_bytes, total))
        digest = stream.finish()
        writer.close()
        _check(cancel)
        os.replace(tmp, out)
        fsync_path(out.parent)
    except BaseException as err:
        writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise _os_error(err, out) from None
        raise
    finally:
        source.close()
    remember_hash(out, digest)
    size = out.stat().st_size
    return GgufResult(out, plan.type, plan.arch, plan.name, size, digest, len(plan.tensors),
                      time.perf_counter() - started, recorded=False)


def export_gguf(
    folder: Path,
    type_: str = DEFAULT_TYPE,
    out: Path | None = None,
    overwrite: bool = False,
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
    companion=None,
) -> GgufResult:
    """Plan, write, and record the GGUF in the folder's merge_manifest.json (when it has one). ``companion``
    (gguf_mmproj.companion: a vision-language folder's mmproj file) is called with the plan and ``overwrite``
    before anything is written and gives None or a function that writes its file once the GGUF is (its path
    goes to ``GgufResult.mmproj``)."""
    from dataclasses import replace

    on_event(PhaseStarted("plan", f"Reading {Path(folder).name}: config, tokenizer, tensor headers"))
    plan = plan_gguf(folder, type_, out, overwrite)
    after = companion(plan, overwrite) if companion is not None else None
    result = write_gguf(plan, on_event, cancel)
    if after is not None:
        result = replace(result, mmproj=after(on_event, cancel))
    try:
        recorded = record_gguf(plan.folder, result)
    except OSError as err:  # a read-only model folder, the GGUF written elsewhere: the file stands
        on_event(Notice("warning", f"The GGUF is written, but {plan.folder / 'merge_manifest.json'} could not be updated ({err.strerror or err})."))
        return replace(result, recorded=False)
    if not recorded:
        on_event(Notice("info", f"{plan.folder} has no merge_manifest.json (it was not made by tui-merger): the GGUF is not recorded there."))
    return replace(result, recorded=recorded)


def record_gguf(folder: Path, result: GgufResult) -> bool:
    """Add (or replace) the GGUF's entry in the folder's manifest; False when the folder has none."""
    from tui_merger import __version__
    from tui_merger.core.record.manifest import now_iso, read_manifest, write_manifest

    manifest = read_manifest(folder)
    if manifest is None:
        return False
    path = Path(result.path).absolute()
    shown = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    entry = {
        "path": shown,
        "size": result.size,
        "sha256": result.sha256,
        "type": result.type,
        "architecture": result.arch,
        "name": result.name,
        "made_at": now_iso(),
        "tool": {"name": "tui-merger", "version": __version__},
        "seconds": round(result.seconds, 3),
    }
    if result.mmproj is not None:  # the vision tower's file beside it (its own entry, architecture clip)
        mm = Path(result.mmproj).absolute()
        entry["mmproj"] = mm.relative_to(folder).as_posix() if mm.is_relative_to(folder) else str(mm)
    entries = [e for e in manifest.get("gguf") or [] if isinstance(e, dict) and e.get("path") != shown]
    manifest["gguf"] = entries + [entry]
    write_manifest(folder, manifest)
    return True


# -- the folder and its config ---------------------------------------------------------------------


def _read_config(folder: Path, quantized_ok: bool = False) -> dict:
    if not folder.is_dir():
        if folder.is_file():
            raise MergeError(f"{folder} is a file; give the model folder that holds it ({folder.parent}).")
        raise MergeError(f"The model folder {folder} does not exist; check the path.")
    path = folder / "config.json"
    if not path.is_file():
        if (folder / "adapter_config.json").is_file():
            raise MergeError(
                f"{folder} is a LoRA adapter, not a model; merge it into its base first (tui-merger merge), "
                "then make the GGUF of the merged folder."
            )
        raise MergeError(f"{folder} has no config.json; give a Hugging Face model folder (for example the merged one).")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        raise MergeError(f"{path} is not valid JSON; copy it again from the original model.") from None
    if not isinstance(config, dict):
        raise MergeError(f"{path} does not hold a JSON object; copy it again from the original model.")
    model_type = config.get("model_type")
    if gguf_vl.is_vl(config):  # its language model, as llama.cpp's converter writes it (the vision tower: mmproj, not ours)
        config = {**gguf_vl.text_config(folder, config, FAMILIES), _VL: model_type}
        model_type = config.get("model_type")
    if model_type in REFUSED:
        raise MergeError(f"{folder} is a {model_type} model; {REFUSED[model_type]}.")
    if model_type not in FAMILIES:
        raise MergeError(
            f"{folder} is a {model_type or 'model of unknown type'} model; GGUF export writes {FAMILY_NAMES} "
            "models (the families whose GGUF layout llama.cpp defines, listed in docs/formats.md)."
        )
    if config.get("quantization_config") and not quantized_ok:  # quantized_ok: names and shapes only (gguf_lora)
        method = (config["quantization_config"] or {}).get("quant_method", "quantized") if isinstance(config["quantization_config"], dict) else "quantized"
        raise MergeError(
            f"{folder} holds {method} weights; make the GGUF from the 16-bit model (llama.cpp quantizes from there)."
        )
    archs = config.get("architectures") or []
    if archs and not all(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
        raise MergeError(
            f"{folder} is a {', '.join(map(str, archs))}, not a language model with its output head "
            "(...ForCausalLM); llama.cpp runs causal language models."
        )
    return config


def _hyperparameters(folder: Path, raw: dict, family: Family, notices: list) -> dict:
    """The config fields a GGUF states, with transformers' own defaults (AutoConfig, local files); what
    the family's llama.cpp graph fixes and the config says otherwise is refused in one sentence."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # a config transformers cannot build: say it in one sentence
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise MergeError(f"transformers cannot read {folder / 'config.json'} ({first[:200]}); fix or replace it.") from None
    config = gguf_vl.text_hf_config(config)  # a vision-language folder: its language model's config
    if getattr(config, "is_heterogeneous", False):  # per-layer values (Gemma 4's full-attention heads): the family's keys
        config.allow_global_per_layer_attribute_access = True  # read them per layer; the common keys take the base ones

    def need(name: str):
        value = getattr(config, name, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise MergeError(f"{folder / 'config.json'} has no valid {name} ({value!r}); a GGUF must state it.")
        return value

    heads, hidden = int(need("num_attention_heads")), int(need("hidden_size"))
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    hp = {
        "context_length": int(need("max_position_embeddings")),
        "hidden_size": hidden,
        "layers": int(need("num_hidden_layers")),
        "intermediate_size": int(need("intermediate_size")),
        "heads": heads,
        "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": head_dim,
        "eps": float(need(family.eps)),
        "vocab_size": int(need("vocab_size")),
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "rope": _rope(folder, config, family, head_dim),
        "keys": _family_keys(config, family),
        "config": config,
    }
    if family.experts:
        hp["experts"] = int(need(family.experts))
        hp["experts_used"] = int(need(family.experts_used))
        if family.expert_ff:
            hp["expert_ff"] = int(need(family.expert_ff))
        if family.shared_ff:
            hp["shared_ff"] = int(need(family.shared_ff))
        norm = getattr(config, "norm_topk_prob", family.norm_topk)
        if family.norm_topk is not None and bool(norm) != family.norm_topk:
            does = "always renormalizes" if family.norm_topk else "never renormalizes"
            raise MergeError(
                f"{folder} routes with norm_topk_prob {str(bool(norm)).lower()}; llama.cpp's {family.arch} {does} the "
                "chosen experts' weights, so a GGUF of it would compute another model."
            )
    for check in family.checks:
        reason = check(config)
        if reason:
            raise MergeError(f"{folder} cannot be written as a GGUF: {reason}.")
    notices.extend(said for said in (note(config) for note in family.notes) if said)
    _sliding_window(folder, config, family, hp, notices)
    if heads % hp["kv_heads"]:
        raise MergeError(f"{folder / 'config.json'}: {heads} attention heads are not a multiple of {hp['kv_heads']} KV heads.")
    return hp


def _family_keys(config, family: Family) -> dict:
    """The family's own keys: a config field (float32, or uint32 for the counts in _UINT_KEYS) or a
    function of the config giving the typed value; None: not written."""
    out = {}
    for key, how in family.keys.items():
        if callable(how):
            value = how(config)
        else:
            value = getattr(config, how, None)
            if value is not None:
                value = int(value) if key in _UINT_KEYS else float(value)
        if value is not None:
            out[key] = value
    return out


def _sliding_window(folder: Path, config, family: Family, hp: dict, notices: list) -> None:
    """Which layers attend to a sliding window must be what llama.cpp's graph does for the family: its
    fixed pattern (``family.swa``), or none."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    sliding = [t == "sliding_attention" for t in types] if isinstance(types, (list, tuple)) else None
    swa = family.swa if family.swa_layers in (None, hp["layers"]) else None
    if "attention.sliding_window_pattern" in family.keys:  # llama.cpp reads which layers slide from the file (Gemma 4)
        return
    if swa:
        want = [i % swa < swa - 1 for i in range(hp["layers"])]
        if sliding is not None and sliding != want:
            raise MergeError(
                f"{folder} has sliding-window layers (layer_types) other than llama.cpp's {family.arch} pattern (every "
                f"{swa}th layer full attention, the others sliding); a GGUF of it would attend differently."
            )
        return
    if sliding is not None and any(sliding) or getattr(config, "use_sliding_window", False) and window:
        raise MergeError(
            f"{folder} uses sliding-window attention, which llama.cpp's {family.arch} layout does not describe; "
            "a GGUF of it would attend differently."
        )
    if sliding is None and isinstance(window, int) and 0 < window < hp["context_length"]:
        notices.append(
            f"The model attends to the last {window} tokens only (sliding_window); llama.cpp's {family.arch} layout "
            f"has no sliding window, so the GGUF computes the same up to {window} tokens and attends to all of them beyond."
        )


def _rope(folder: Path, config, family: Family, head_dim: int) -> dict:
    """{'theta', 'type', 'dim', ...}: the rope base, scaling and rotated size, from rope_parameters
    (transformers 5; per layer type for Gemma 3) or the older rope_theta + rope_scaling. A scaling
    llama.cpp cannot express is refused."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    params = dict(params)
    if isinstance(params.get("full_attention"), dict):  # one rope per layer type
        local = params.get("sliding_attention") or {}
        params = dict(params["full_attention"])
        want = ({"rope_type": "default", "rope_theta": family.swa_rope_theta} if family.swa_rope_theta is not None
                else {"rope_type": params.get("rope_type") or "default", "rope_theta": params.get("rope_theta")})
        own = "rope.freq_base_swa" in family.keys  # the sliding layers' base is a key of its own (Gemma 4; its checks say the rest)
        if local and not own and ((local.get("rope_type") or "default"), local.get("rope_theta")) != (want["rope_type"], want["rope_theta"]):
            raise MergeError(
                f"{folder} rotates its sliding-window layers with rope {local.get('rope_type')} base "
                f"{local.get('rope_theta')}; llama.cpp's {family.arch} rotates them with rope {want['rope_type']} base "
                f"{want['rope_theta']:g}, so a GGUF of it would compute another model."
            )
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise MergeError(f"{folder / 'config.json'} has no valid rope_theta ({theta!r}); a GGUF must state the rope base.")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    if partial != 1.0 and not family.partial_rotary:
        raise MergeError(f"{folder} rotates only part of each head (partial_rotary_factor); its family's GGUF layout rotates whole heads.")
    rope = {"theta": float(theta), "type": kind, "dim": int(head_dim * partial)}
    if kind == "default" or kind in family.rope_kinds:  # rope_kinds: the family's keys and tensors say the scaling
        return rope
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise MergeError(f"{folder / 'config.json'} has rope scaling {kind} without a valid factor ({factor!r}).")
    rope["factor"] = float(factor)
    original = params.get("original_max_position_embeddings")
    if kind == "linear":
        return rope
    if kind == "yarn":
        known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "partial_rotary_factor"}
        if family.yarn_mscale and params.get("mscale", 1.0) == params.get("mscale_all_dim", 1.0):
            known |= {"mscale", "mscale_all_dim"}  # llama.cpp's yarn_log_multiplier (a family key) says them
        known |= set(family.yarn_extra)
        unknown = sorted(set(params) - known)
        if any(params.get(k) is not None for k in unknown):
            raise MergeError(
                f"{folder} uses YaRN rope scaling with {', '.join(k for k in unknown if params.get(k) is not None)}, "
                "which tui-merger does not write into a GGUF yet."
            )
        rope["original"] = int(original or getattr(config, "max_position_embeddings") / factor)
        for key in ("beta_fast", "beta_slow"):
            if params.get(key) is not None:
                rope[key] = float(params[key])
        return rope
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(params.get(key), (int, float)):
                raise MergeError(f"{folder / 'config.json'} has llama3 rope scaling without {key}.")
        rope.update(low=float(params["low_freq_factor"]), high=float(params["high_freq_factor"]), original=int(original))
        return rope
    raise MergeError(
        f"{folder} uses {kind} rope scaling, which has no GGUF equivalent for its family (GGUF export writes "
        "default, linear, yarn and llama3 rope)."
    )


def _target(folder: Path, type_: str, out: Path | None, overwrite: bool) -> Path:
    target = default_out(folder, type_) if out is None else Path(out).expanduser().absolute()
    if target.is_dir():
        target = target / default_out(folder, type_).name
    if target.suffix.lower() != ".gguf":
        raise MergeError(f"{target} does not end in .gguf; name the file to write, e.g. {target.with_suffix('.gguf').name}.")
    parent = target.parent
    if not parent.is_dir():
        raise MergeError(f"The folder {parent} for the GGUF does not exist; create it or choose another --out.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MergeError(f"{parent} is not writable; choose another --out.")
    if target.exists() and not overwrite:
        raise MergeError(f"{target} exists; choose another --out, or pass --overwrite to replace it (only once the new file is complete).")
    return target


def _open_source(folder: Path):
    from tui_merger.core.io.sources import open_model

    source = open_model(folder)
    if any(not f.endswith(".safetensors") for f in source.files):
        source.close()
        raise MergeError(
            f"{folder} keeps its weights in PyTorch .bin files; GGUF export streams safetensors (merge or "
            "save the model again with save_pretrained to get them)."
        )
    return source


# -- tensors ---------------------------------------------------------------------------------------


def _plan_tensors(folder, source, config, hp, family: Family, type_, notices) -> list[GgufTensor]:
    import gguf

    arch_name = family.arch
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    allowed = set(gguf.MODEL_TENSORS[arch])
    names = gguf.get_tensor_name_map(arch, hp["layers"])
    out: list[GgufTensor] = []
    experts: dict[str, dict[int, object]] = {}  # GGUF name -> expert index -> TensorRef
    order: list[str | GgufTensor] = []
    fallback: list[str] = []
    beyond: list[str] = []  # next-token-prediction layers past num_hidden_layers (DeepSeek-V3, GLM-4.5)
    unloaded, unloaded_why = family.unloaded(hp["config"]) if family.unloaded else ((), "")
    skipped: list[str] = []  # tensors transformers does not load for this config (Gemma 4's shared-KV layers' k/v)
    for ref in source.tensors.values():
        if _SKIPPED.search(ref.name):
            continue
        layer = _LAYER.match(ref.name)
        if layer and int(layer[1]) >= hp["layers"] or ref.name.startswith(family.left_out):
            beyond.append(ref.name)
            continue
        if unloaded and ref.name.startswith(unloaded):
            skipped.append(ref.name)
            continue
        if ref.name == "lm_head.weight" and hp["tie_word_embeddings"]:
            continue  # tied: llama.cpp uses token_embd, as transformers does
        if ref.dtype not in ("float32", "float16", "bfloat16"):
            raise MergeError(f"{ref.name} in {folder} is {ref.dtype}; GGUF export reads float32, float16 and bfloat16 weights.")
        m = _EXPERT.match(ref.name)
        key = f"{m['layer']}.{m['kind']}" if m else ref.name.removesuffix(".weight").removesuffix(".bias")
        derive = next((fn for module, fn in family.derive.items() if key.endswith(f".{module}")), None)
        if derive is not None:  # one HF tensor -> GGUF tensors computed from it (DeepSeek's kv_b_proj -> k_b, v_b)
            layer = re.search(r"\.(\d+)\.", ref.name)
            for part, shape, fn in derive(hp["config"], tuple(ref.shape)):
                name = f"blk.{layer[1]}.{part}" + ("" if part.endswith((".weight", ".bias")) or part in family.bare else ".weight")
                qtype = _qtype(type_, shape, _keep_f32(family, name), name, fallback)
                order.append(GgufTensor(name, (ref,), shape, int(qtype), _nbytes(shape, qtype), derive=fn))
            continue
        split = next((parts for module, parts in family.split.items() if key.endswith(f".{module}")), None)
        if split is not None:  # one packed HF tensor -> equal parts along its rows, each a GGUF tensor of its own
            order.extend(_split(folder, ref, split, type_, fallback))
            continue
        found = names.get_type_and_name(key)
        if found is None and key.endswith("_bias"):  # e_score_correction_bias: a bias by another spelling
            found = names.get_type_and_name(key.removesuffix("_bias"))
            key = key.removesuffix("_bias") if found else key
        if found is None and m:  # a family whose per-expert names the map knows with their index
            key = ref.name.removesuffix(".weight")
            found = names.get_type_and_name(key)
            m = None
        if found is None or found[0] not in allowed:
            raise MergeError(
                f"{ref.name} in {folder} has no place in llama.cpp's {arch_name} layout; the model is not a plain "
                f"{arch_name} (extra modules?), so a GGUF of it cannot be written."
            )
        kind, base = found
        if m:
            slot = experts.setdefault(f"{base}.weight", {})
            if not slot:
                order.append(f"{base}.weight")
            slot[int(m["e"])] = ref
            continue
        suffix = ref.name[len(key):].replace("_bias", ".bias") or ".weight"  # GPT-OSS's sinks: a weight by another spelling
        permute = None
        if family.permute_qk and kind in (gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K):
            permute = hp["heads"] if kind == gguf.MODEL_TENSOR.ATTN_Q else hp["kv_heads"]
            if ref.shape[0] != permute * hp["head_dim"] or hp["head_dim"] % 2:
                raise MergeError(f"{ref.name} has {ref.shape[0]} rows, not {permute} heads of {hp['head_dim']} (config.json).")
        router = kind in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)  # kept F32, as llama.cpp does
        qtype = _qtype(type_, ref.shape, router or _keep_f32(family, base), ref.name, fallback)
        if type_ != "bf16" and type_ != "f16" and any(part in base for part in family.unquantized):
            # llama-quantize leaves it as it comes from the 16-bit conversion: bf16 weights as BF16, others F16
            qtype = gguf.GGMLQuantizationType.BF16 if ref.dtype == "bfloat16" else gguf.GGMLQuantizationType.F16
        shift = 1.0 if family.norm_plus_one and ref.name.endswith("norm.weight") else 0.0
        order.append(GgufTensor(base + suffix, (ref,), ref.shape, int(qtype), _nbytes(ref.shape, qtype), permute, shift))
    for item in order:
        if isinstance(item, GgufTensor):
            out.append(item)
            continue
        slot = experts[item]
        refs = [slot.get(e) for e in range(hp.get("experts", 0))]
        if any(r is None for r in refs) or len(slot) != len(refs):
            raise MergeError(
                f"{folder} lacks some experts of {item} (it has {sorted(slot)[:8]}, config.json says "
                f"{hp.get('experts', 0)}); the weights are incomplete: copy the whole folder again."
            )
        shapes = {r.shape for r in refs}
        if len(shapes) != 1:
            raise MergeError(f"The experts of {item} in {folder} differ in shape ({sorted(shapes)}).")
        shape = (len(refs), *refs[0].shape)
        qtype = _qtype(type_, shape, False, refs[0].name, fallback)
        out.append(GgufTensor(item, tuple(refs), shape, int(qtype), _nbytes(shape, qtype)))
    if type_ in K_MIXES:
        out = _mix_types(out, type_, arch_name, hp, notices)
    if skipped:
        notices.append(f"{len(skipped)} tensor(s) ({skipped[0]}...) are left out, as transformers does not load them: {unloaded_why}.")
    if beyond:
        where = "layers past num_hidden_layers" if _LAYER.match(beyond[0]) else "a module transformers does not load"
        notices.append(
            f"{len(beyond)} tensor(s) of {where} ({beyond[0]}...), the model's next-token-prediction "
            "layers, are left out, as transformers leaves them out: llama.cpp runs the model without them."
        )
    if fallback:
        notices.append(
            f"{len(fallback)} tensor(s) have rows that are not a multiple of 32 values ({fallback[0]}...), which "
            "Q8_0 needs: they are stored as F16, as llama.cpp's converter does."
        )
    present = {t.name: t for t in out}
    if "token_embd.weight" not in present:
        raise MergeError(f"{folder} has no model.embed_tokens.weight; the weights are incomplete.")
    rows = present["token_embd.weight"].shape[0]
    if rows != hp["vocab_size"]:
        raise MergeError(
            f"The embedding of {folder} has {rows} rows but config.json says vocab_size {hp['vocab_size']}; "
            "fix config.json (llama.cpp takes one token per row)."
        )
    if "output.weight" not in present and not hp["tie_word_embeddings"]:
        raise MergeError(f"{folder} has no lm_head.weight and config.json does not tie it to the embedding; the weights are incomplete.")
    layers = {name.split(".")[1] for name in present if name.startswith("blk.")}
    missing = [f"blk.{i}" for i in range(hp["layers"]) if str(i) not in layers]
    if missing:
        raise MergeError(f"{folder} lacks the weights of {len(missing)} layer(s) ({missing[0]}...) that config.json says it has.")
    if hp["rope"]["type"] == "llama3":
        freqs = _llama3_rope_factors(hp)
        out.insert(0, GgufTensor("rope_freqs.weight", (), freqs.shape, int(gguf.GGMLQuantizationType.F32), freqs.nbytes, computed=freqs))
    if family.computed is not None:  # tensors the converter computes from the config (Phi-3's longrope factors)
        for name, values in reversed(family.computed(hp["config"])):
            out.insert(0, GgufTensor(name, (), values.shape, int(gguf.GGMLQuantizationType.F32), values.nbytes, computed=values))
    return out


def _keep_f32(family: Family, name: str) -> bool:
    """The tensors the family's converter always stores F32 (small conv kernels)."""
    return any(part in name for part in family.keep_f32)


def _split(folder, ref, parts: tuple[str, ...], type_: str, fallback: list) -> list[GgufTensor]:
    """A packed tensor (experts, n * rows, cols) as n GGUF tensors (experts, rows, cols), in order
    (GraniteMoE's input_linear: the gate half, then the up half, as llama.cpp's converter splits it)."""
    layer = re.search(r"\.(\d+)\.", ref.name)
    if layer is None or len(ref.shape) < 2 or ref.shape[-2] % len(parts):
        raise MergeError(f"{ref.name} in {folder} cannot be split into {len(parts)} equal parts ({list(ref.shape)}); the weights do not match the family.")
    size = ref.shape[-2] // len(parts)
    shape = (*ref.shape[:-2], size, ref.shape[-1])
    out = []
    for n, part in enumerate(parts):
        qtype = _qtype(type_, shape, False, ref.name, fallback)
        out.append(GgufTensor(f"blk.{layer[1]}.{part}.weight", (ref,), shape, int(qtype), _nbytes(shape, qtype),
                              rows=(n * size, (n + 1) * size)))
    return out


def _qtype(type_: str, shape, router: bool, name: str, fallback: list):
    """How a tensor is stored: 1-D tensors (norms, biases) and the MoE router in F32, as llama.cpp does;
    the rest in the chosen type (Q8_0 needs rows of a multiple of 32 values, else F16). A k-quant mix's
    matrices are F16 here (what llama.cpp's quantizer reads) until _mix_types gives each its type."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) <= 1 or router or name.endswith(("_bias", ".bias")):  # biases, stacked per expert or not
        return T.F32
    if type_ == "bf16":
        return T.BF16
    if type_ == "q8_0":
        if shape[-1] % gguf.GGML_QUANT_SIZES[T.Q8_0][0] == 0:
            return T.Q8_0
        fallback.append(name)
    return T.F16


def _mix_types(tensors: list[GgufTensor], type_: str, arch: str, hp: dict, notices: list) -> list[GgufTensor]:
    """The k-quant mix's type of every matrix llama.cpp quantizes (kquants.tensor_types: llama.cpp's
    llama_tensor_get_type); the others keep the type planned for them."""
    from dataclasses import replace

    from tui_merger.core.ship import kquants

    experts = hp.get("experts") or hp["keys"].get("expert_count", 0)  # Gemma 4 says its experts with its own keys
    model = kquants.Model(arch, hp["layers"], experts, hp["heads"], hp["kv_heads"])
    # a (1, n) matrix is 1-D to ggml (ggml_n_dims), and llama-quantize leaves it as it is
    types, fallbacks = kquants.tensor_types([(t.name, t.shape) for t in tensors if _ggml_dims(t.shape) >= 2], type_, model)
    out = [replace(t, qtype=types[t.name], nbytes=_nbytes(t.shape, types[t.name])) if t.name in types else t
           for t in tensors]
    if fallbacks:
        import gguf

        used = sorted({gguf.GGMLQuantizationType(types[n]).name for n in fallbacks})
        notices.append(
            f"{len(fallbacks)} tensor(s) have rows that are not a multiple of 256 values ({fallbacks[0]}...), which "
            f"k-quants need: they are stored as {', '.join(used)}, as llama.cpp's quantizer does."
        )
    return out


def _ggml_dims(shape) -> int:
    """ggml_n_dims: the dimensions counted from the row, outer ones of size 1 left out."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return len(dims)


def _nbytes(shape, qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    n = 1
    for d in shape[:-1]:
        n *= d
    return n * (shape[-1] // block) * size


def _np_float32():
    import numpy as np

    return np.dtype(np.float32)


def _llama3_rope_factors(hp: dict):
    """llama3 rope scaling as llama.cpp takes it: one divisor per rotated frequency (rope_freqs), Meta's
    formula (low frequencies divided by the factor, high ones kept, a smooth ramp between)."""
    import math

    import numpy as np

    rope, dim = hp["rope"], hp["head_dim"]
    low_wavelen = rope["original"] / rope["low"]
    high_wavelen = rope["original"] / rope["high"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / rope["theta"] ** (i / dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original"] / wavelen - rope["low"]) / (rope["high"] - rope["low"])
            factors.append(1.0 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _pieces(t: GgufTensor, cancel, scratch: list):
    """The tensor's bytes as stored in the file, in order, as numpy arrays of a row block at a time.
    Source rows are read with pread into one reused buffer (no page faults on a mapping, nothing held
    once written) and converted, or written from the buffer as they are when the type is the same.
    Llama's q/k (small) are read mapped, as their rows are reordered."""
    import gguf
    import torch

    if t.computed is not None:
        yield t.computed
        return
    qtype = gguf.GGMLQuantizationType(t.qtype)
    for ref in t.sources:  # stacked experts: one expert after the other
        _check(cancel)
        raw = None if t.permute_heads or t.rows or t.derive else ref.source.raw_ranges(ref)
        if raw is None or len(raw) != 1:
            yield from _mapped_pieces(ref, qtype, t, cancel)
            continue
        fd, offset, length = raw[0]
        dtype = getattr(torch, ref.dtype)
        cols = ref.shape[-1] if ref.shape else 1
        n_rows = max(1, length // (cols * torch.empty(0, dtype=dtype).element_size()))
        row_bytes = length // n_rows
        step = max(1, _BLOCK_BYTES // row_bytes)
        if not scratch or len(scratch[0]) < step * row_bytes:  # one buffer for the whole file
            scratch[:] = [bytearray(max(step * row_bytes, _BLOCK_BYTES))]
        for start in range(0, n_rows, step):
            rows = min(step, n_rows - start)
            view = memoryview(scratch[0])[: rows * row_bytes]
            _pread_into(fd, view, offset + start * row_bytes)
            block = torch.frombuffer(view, dtype=dtype).reshape(rows, -1)
            yield _convert(block, qtype, t)
            _check(cancel)


def _mapped_pieces(ref, qtype, t: GgufTensor, cancel):
    import torch

    w = ref.load()
    if t.rows:
        w = w[..., t.rows[0]:t.rows[1], :]
    if t.derive is not None:
        w = t.derive(w)
    rows = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(-1, 1) if t.permute_heads else w.reshape(1, -1)
    order = None
    if t.permute_heads:  # HF's rotate-half order -> llama.cpp's interleaved pairs, per head
        n = t.permute_heads
        order = torch.arange(rows.shape[0]).reshape(n, 2, rows.shape[0] // n // 2).transpose(1, 2).reshape(-1)
    step = max(1, _BLOCK_BYTES // (rows.shape[1] * rows.element_size()))
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        block = rows[start:stop] if order is None else rows.index_select(0, order[start:stop])
        yield _convert(block, qtype, t)
        _check(cancel)
    ref.release()


def _pread_into(fd: int, view, offset: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise OSError(errno.EIO, "a weights file ended before its tensor did (was it changed while reading?)")
        view, offset = view[n:], offset + n


def _convert(block, qtype, t: GgufTensor):
    """One row block (a torch tensor) as the ggml type stores it (a numpy array)."""
    import gguf
    import torch

    T = gguf.GGMLQuantizationType
    if t.shift:
        block = block.to(torch.float32) + t.shift
    if qtype == T.F32:
        return block.to(torch.float32).contiguous().numpy()
    if qtype == T.BF16:
        return block.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    if qtype == T.F16:
        half = block.to(torch.float16).contiguous()
        if block.dtype != torch.float16 and torch.isinf(half).any() and not torch.isinf(block).any():
            raise MergeError(
                f"{t.hf_name} holds values beyond float16's range (±65504), which F16 cannot store; "
                "choose --type bf16 (or q8_0)."
            )
        return half.numpy()
    if qtype in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):  # ours, byte for byte llama.cpp's (kquants.py)
        from tui_merger.core.ship import kquants

        return kquants.quantize(block.to(torch.float32).numpy(), int(qtype))
    # Q8_0 and the k-quants' fallbacks (Q4_0, Q5_0, Q5_1): gguf's own quantization (bit-exact with
    # ggml's reference), on float32 rows
    return gguf.quants.quantize(block.to(torch.float32).numpy(), qtype)


class _DataStream:
    """The tensor data section of the file being written: each tensor at the offset GGUFWriter declared
    for it (aligned to ``align``, zero padding after, as GGUFWriter.write_tensor_data lays it out),
    written with pwrite at offsets of our own (no Python file buffer in between). The file's sha256 is
    taken on the way: the writer's header read back once, then every byte as it is written."""

    def __init__(self, fd: int, end_of_infos: int, align: int, path: Path) -> None:
        import hashlib

        self.fd, self.align = fd, align
        self.digest = hashlib.sha256()
        head = bytearray(end_of_infos)
        reader = os.open(path, os.O_RDONLY)  # the writer's file is open for writing only
        try:
            _pread_into(reader, memoryview(head), 0)
        finally:
            os.close(reader)
        self.digest.update(head)
        self.pos = end_of_infos
        self._zeros(self._padded(end_of_infos) - end_of_infos)  # the data section starts aligned

    def _padded(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def begin(self, t: GgufTensor) -> None:
        self.tensor_start = self.pos

    def write(self, piece) -> None:
        self._pwrite(memoryview(piece.reshape(-1).view("uint8")))

    def end(self, t: GgufTensor) -> None:
        written = self.pos - self.tensor_start
        if written != t.nbytes:  # a bug of ours, never a user's input: the offsets would be wrong
            raise RuntimeError(f"{t.name}: wrote {written} bytes, the tensor info says {t.nbytes}")
        self._zeros(self._padded(written) - written)

    def finish(self) -> str:
        os.fsync(self.fd)
        return self.digest.hexdigest()

    def _zeros(self, n: int) -> None:
        if n:
            self._pwrite(memoryview(bytes(n)))

    def _pwrite(self, view) -> None:
        self.digest.update(view)
        while len(view):
            n = os.pwrite(self.fd, view, self.pos)
            self.pos += n
            view = view[n:]


# -- metadata --------------------------------------------------------------------------------------


_UINT_KEYS = {"attention.sliding_window"}  # a family's config-field keys are float32 but these


def _add_hyperparameters(writer, hp: dict, family: Family) -> None:
    """<arch>.* keys: the common ones from the hyperparameters, then the family's own (which may
    restate a common one: DeepSeek's MLA head sizes), each key once, typed as llama.cpp reads it."""
    import gguf

    keys = {
        "context_length": hp["context_length"],
        "embedding_length": hp["hidden_size"],
        "block_count": hp["layers"],
        "feed_forward_length": hp["intermediate_size"],
        "attention.head_count": hp["heads"],
        "attention.head_count_kv": hp["kv_heads"],
        "attention.layer_norm_rms_epsilon" if family.rms_norm else "attention.layer_norm_epsilon": hp["eps"],
        "vocab_size": hp["vocab_size"],
        "rope.freq_base": hp["rope"]["theta"],
        "rope.dimension_count": hp["rope"]["dim"],
    }
    if family.head_dim_keys or hp["head_dim"] != hp["hidden_size"] // hp["heads"]:
        keys["attention.key_length"] = keys["attention.value_length"] = hp["head_dim"]
    for key, name in (("expert_count", "experts"), ("expert_used_count", "experts_used"),
                      ("expert_feed_forward_length", "expert_ff"), ("expert_shared_feed_forward_length", "shared_ff")):
        if name in hp:
            keys[key] = hp[name]
    keys.update(hp["keys"])
    for key, value in keys.items():
        name = f"{family.arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(name, value)
        elif isinstance(value, list):  # per layer (LFM2's KV heads, 0 in its convolution layers)
            writer.add_array(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_float32(name, float(value))
    rope = hp["rope"]
    if rope["type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original"])
        if "beta_fast" in rope:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if "beta_slow" in rope:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    # llama3: the divisors travel as the rope_freqs tensor (see _plan_tensors), no scaling keys


def _add_general(writer, folder: Path, type_: str, tensors) -> str:
    """general.*: the type, file type, and who the model is (llama.cpp's own Metadata heuristics over
    the model card, config.json and the folder name), named from the model card or the folder."""
    import gguf

    total = shared = expert = count = 0
    for t in tensors:
        if t.computed is not None:
            continue
        n = 1
        for d in t.shape:
            n *= d
        total += n
        if len(t.sources) > 1:
            expert += n // len(t.sources)
            count = len(t.sources)
        else:
            shared += n
    card = {}
    try:
        card = gguf.Metadata.load_model_card(folder)
    except Exception:  # a model card whose front matter is not YAML: no name from it
        pass
    name = card.get("model_name") or card.get("name")
    name = name if isinstance(name, str) and name.strip() else folder.name
    try:
        meta = gguf.Metadata.load(None, folder, name, total)
    except Exception:  # broken front matter or config: the name alone
        meta = gguf.Metadata(name=name)
    if meta.size_label is None and total:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}.get(type_) or gguf.LlamaFileType[f"MOSTLY_{type_.upper()}"]
    writer.add_file_type(int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return meta.name


# -- helpers -----------------------------------------------------------------------------------------


@contextmanager
def _quiet_library_logs():
    """gguf's readers log what llama.cpp's converter prints as it goes ("Unknown separator token ... in
    TemplateProcessing<pair>", "Adding 151387 merge(s)"); here a problem is a MergeError sentence, so
    those stay out of the user's terminal."""
    import logging

    loggers = [logging.getLogger(name) for name in ("gguf", "metadata", "transformers.integrations.heterogeneity.configuration_utils")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _remove_stale(out: Path) -> None:
    """Temporary files of earlier writes to the same target whose process is gone (kill -9, a power
    loss): nothing else would ever remove them."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except (PermissionError, OverflowError, OSError):
            pass


def _check(cancel: CancelToken | None) -> None:
    if cancel is not None and cancel.cancelled:
        raise MergeCancelled(CANCELLED)



def _os_error(err: OSError, out: Path) -> MergeError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return MergeError(
            f"The disk ran out of space while writing {out} ({err.strerror}); the partial file was removed: "
            "free some space or choose an --out on another disk, then run it again."
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MergeError(f"Permission denied while writing {out} ({err.strerror}); choose another --out.")
    return MergeError(f"Writing {out} failed: {err.strerror or err}; the partial file was removed.")
