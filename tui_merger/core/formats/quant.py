"""Quantized bases: say what a ``quantization_config`` means, find the 16-bit model a quantized one was
made from, refuse weights saved already quantized, and reproduce what QLoRA training saw.

A LoRA adapter is a correction to the model's real (16-bit) weights. A quantized model stores rounded
weights (4-bit or 8-bit levels with scales), so the merge must go into the original 16-bit model. QLoRA
trains the adapter against ``dequant(quant(W16))`` though; ``--qlora-base nf4`` merges into exactly
that: ``RoundTripSource`` hands the plan the round-tripped weights of the tensors bitsandbytes
quantizes, one tensor at a time, and everything else as stored.

The 4-bit round trip follows the published bitsandbytes / QLoRA algorithm (Dettmers et al. 2023):
the weight is flattened and cut into blocks of ``blocksize`` (64) values; each block is scaled by the
reciprocal of its absolute maximum (``x * (1/absmax)`` in fp32, as bitsandbytes computes it) and every
value replaced by the nearest of 16 code values (NF4: the normal-float table of the QLoRA paper; FP4:
bitsandbytes' 2-bit-exponent table), a value exactly on the fp32 midpoint of two codes taking the lower
one. Dequantizing multiplies the code by the block's absmax in fp32 and casts once to the weight's
dtype. With double quantization the absmax values are themselves stored in 8 bits: their mean is
subtracted, they are cut into blocks of 256 and each block is rounded the same way to the signed 8-bit
dynamic map (Dettmers 2015); the mean is added back after dequantizing. This equals bitsandbytes'
plain-PyTorch kernels bit for bit (tests/fixtures/make_nf4_reference.py).

Which tensors: the 2-D weights of Linear layers found by name (transformers replaces nn.Linear and
Conv1D by Linear4bit), without embeddings, output heads and ``skip`` modules. The weights are quantized
in the dtype they are stored in; bnb_4bit_compute_dtype is not applied (for bf16/fp16 bases trained with
the same compute dtype, QLoRA's usual setting, that changes nothing).

No torch at import time: it is imported where tensors are touched.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError

# the NF4 code values, as published in the QLoRA paper (appendix E), ascending
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bit) magnitudes before normalising by the largest
FP4_MAGNITUDES = (0.0, 0.0625, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0)
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256  # blocks of absmax values in double quantization
CHUNK_VALUES = 1 << 22  # values round-tripped at a time: memory stays at one output tensor + a chunk
ROUNDTRIP_TYPES = ("nf4", "fp4")
FLAG = "--qlora-base"

# tensor names that bitsandbytes / GPTQ / AWQ write instead of (or beside) a plain weight
_PACKED_SUFFIXES = {
    "bitsandbytes 4-bit": (".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4", ".absmax",
                           ".nested_absmax", ".quant_map", ".nested_quant_map"),
    "bitsandbytes 8-bit": (".SCB", ".weight_format"),
    "GPTQ/AWQ": (".qweight", ".qzeros", ".g_idx"),
    "FP8/compressed-tensors": (".weight_packed",),
}
# modules that are embeddings (never nn.Linear) or output heads (kept in 16 bits by transformers)
_EMBEDDING_LEAVES = ("wte", "wpe", "shared", "embeddings")
_HEAD_LEAVES = ("lm_head", "embed_out", "output", "output_layer", "score", "classifier", "qa_outputs", "v_head")
# GPT-2 style models store their Linear layers as Conv1D, [in, out]; transformers transposes before quantizing
_CONV1D_MODEL_TYPES = ("gpt2", "openai-gpt", "imagegpt")
_QUANT_SUFFIX = re.compile(
    r"(?:[-_.](?:unsloth[-_])?bnb[-_]?(?:4|8)bit|[-_.](?:4|8)bit|[-_.]nf4|[-_.]fp4|[-_.]int4|[-_.]int8"
    r"|[-_.]gptq(?:[-_.]int(?:4|8))?|[-_.]awq|[-_.]bnb|[-_.]fp8(?:[-_.](?:dynamic|block))?)+$",
    re.I,
)


@dataclass(frozen=True)
class QuantInfo:
    """What a quantization_config (or the --qlora-base flag) says, in a few plain fields."""

    method: str  # bitsandbytes, gptq, awq, or the config's quant_method
    bits: int | None = None
    quant_type: str | None = None  # nf4, fp4 (bitsandbytes 4-bit), int8
    blocksize: int | None = None  # values per scale: 64 for bitsandbytes 4-bit, group_size for GPTQ/AWQ
    double_quant: bool = False
    compute_dtype: str | None = None
    quant_storage: str | None = None
    skip_modules: tuple[str, ...] = ()
    explanation: str = ""  # one sentence for people: what it is, why not to merge into it

    @property
    def label(self) -> str:
        """e.g. 'bitsandbytes 4-bit NF4, double quantization'."""
        parts = [self.method]
        if self.bits:
            parts.append(f"{self.bits}-bit")
        if self.quant_type and self.quant_type != "int8":
            parts.append(self.quant_type.upper())
        text = " ".join(parts)
        if self.method == "bitsandbytes" and self.bits == 4:
            text += ", double quantization" if self.double_quant else ", no double quantization"
        elif self.blocksize and self.method != "bitsandbytes":
            text += f", groups of {self.blocksize}"
        return text

    @property
    def can_roundtrip(self) -> bool:
        return self.method == "bitsandbytes" and self.bits == 4 and self.quant_type in ROUNDTRIP_TYPES

    def flag_value(self) -> str:
        """The --qlora-base value that reproduces these settings (defaults left out)."""
        parts = []
        if self.blocksize not in (None, 64):
            parts.append(f"blocksize={self.blocksize}")
        if not self.double_quant:
            parts.append("double_quant=no")
        if self.skip_modules:
            parts.append("skip=" + "+".join(self.skip_modules))
        return str(self.quant_type) + (":" + ",".join(parts) if parts else "")

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "bits": self.bits,
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "double_quant": self.double_quant,
            "compute_dtype": self.compute_dtype,
            "skip_modules": list(self.skip_modules),
        }


def _dtype_name(value) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def _explain(method: str, bits, quant_type, blocksize, double_quant) -> str:
    tail = (
        "so these are not the model's real weights, and a LoRA adapter must be merged into the original "
        "16-bit weights the quantized model was made from."
    )
    if method == "bitsandbytes" and bits == 4:
        kind = {"nf4": "NF4", "fp4": "FP4"}.get(str(quant_type), str(quant_type).upper())
        scales = ", and the scales themselves in 8 bits" if double_quant else ""
        return (
            f"It stores its weights in bitsandbytes 4-bit {kind} (QLoRA's format): every block of "
            f"{blocksize or 64} weights is rounded to one of 16 levels times a scale{scales}, {tail}"
        )
    if method == "bitsandbytes":
        return (
            "It stores its weights in bitsandbytes 8-bit (LLM.int8): every row is rounded to 256 levels "
            f"times a scale, {tail}"
        )
    if method in ("gptq", "awq"):
        group = f"groups of {blocksize}" if blocksize and blocksize > 0 else "groups"
        return (
            f"It stores its weights as {method.upper()} {bits or 4}-bit integers in {group} with a scale "
            f"and zero point each, rounded to fit a calibration set, {tail}"
        )
    return f"It stores its weights compressed with {method}, {tail}"


def quantization_info(config: dict | None) -> QuantInfo | None:
    """The quantization a model config declares (``quantization_config``), or None for a plain model."""
    if not isinstance(config, dict):
        return None
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    load4 = bool(q.get("load_in_4bit") or q.get("_load_in_4bit"))
    load8 = bool(q.get("load_in_8bit") or q.get("_load_in_8bit"))
    method = str(q.get("quant_method") or ("bitsandbytes" if load4 or load8 else "quantized")).lower()
    bits = quant_type = blocksize = None
    double_quant = False
    skip = q.get("llm_int8_skip_modules") or q.get("modules_to_not_convert") or ()
    skip = tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else ()
    if method == "bitsandbytes":
        bits = 4 if load4 or not load8 else 8
        if bits == 4:
            quant_type = str(q.get("bnb_4bit_quant_type") or "fp4").lower()  # transformers' default is fp4
            double_quant = bool(q.get("bnb_4bit_use_double_quant"))
            blocksize = 64
        else:
            quant_type = "int8"
    else:
        raw_bits = q.get("bits", q.get("w_bit"))
        bits = int(raw_bits) if isinstance(raw_bits, (int, float)) and not isinstance(raw_bits, bool) else None
        group = q.get("group_size", q.get("q_group_size"))
        blocksize = int(group) if isinstance(group, int) and not isinstance(group, bool) else None
    return QuantInfo(
        method=method,
        bits=bits,
        quant_type=quant_type,
        blocksize=blocksize,
        double_quant=double_quant,
        compute_dtype=_dtype_name(q.get("bnb_4bit_compute_dtype")),
        quant_storage=_dtype_name(q.get("bnb_4bit_quant_storage")),
        skip_modules=skip,
        explanation=_explain(method, bits, quant_type, blocksize, double_quant),
    )


def parse_roundtrip(spec: str) -> QuantInfo:
    """``nf4`` or ``fp4``, optionally ``:blocksize=64,double_quant=yes|no,skip=name+name`` (what
    --qlora-base takes). Defaults are QLoRA's: blocksize 64, double quantization on."""
    text = str(spec).strip()
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind not in ROUNDTRIP_TYPES:
        raise MergeError(
            f"{FLAG} '{spec}' is not a bitsandbytes 4-bit type; give nf4 (what QLoRA uses) or fp4, "
            "optionally with :blocksize=64,double_quant=no."
        )
    settings = {"blocksize": 64, "double_quant": True, "skip": ()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip().lower().replace("-", "_"), value.strip()
        if not eq or key not in settings:
            raise MergeError(
                f"{FLAG}: '{item}' is not a setting; write blocksize=64, double_quant=yes|no or skip=lm_head+score."
            )
        if key == "blocksize":
            if not value.isdigit() or int(value) not in BLOCKSIZES:
                raise MergeError(f"{FLAG}: blocksize must be one of {', '.join(map(str, BLOCKSIZES))}, not '{value}'.")
            settings[key] = int(value)
        elif key == "double_quant":
            if value.lower() not in ("yes", "no", "true", "false", "1", "0", "on", "off"):
                raise MergeError(f"{FLAG}: double_quant must be yes or no, not '{value}'.")
            settings[key] = value.lower() in ("yes", "true", "1", "on")
        else:
            settings[key] = tuple(s for s in value.split("+") if s)
    return QuantInfo(
        method="bitsandbytes",
        bits=4,
        quant_type=kind,
        blocksize=settings["blocksize"],
        double_quant=settings["double_quant"],
        skip_modules=settings["skip"],
        explanation=_explain("bitsandbytes", 4, kind, settings["blocksize"], settings["double_quant"]),
    )


# -- the 16-bit origin of a quantized model ------------------------------------------------------------


def _front_matter_base(folder: Path) -> list[str]:
    """``base_model:`` of the model card's YAML front matter (a name or a list of names)."""
    try:
        text = (folder / "README.md").read_text(errors="replace")[:20000]
    except OSError:
        return []
    if not text.startswith("---"):
        return []
    head = text[3:].split("\n---", 1)[0]
    found, in_list = [], False
    for line in head.splitlines():
        m = re.match(r"^base_model\s*:\s*(.*)$", line)
        if m:
            value = m.group(1).strip().strip("'\"")
            if value:
                found.append(value)
                in_list = False
            else:
                in_list = True
            continue
        if in_list:
            item = re.match(r"^\s*-\s*(.+)$", line)
            if item:
                found.append(item.group(1).strip().strip("'\""))
            elif line.strip():
                in_list = False
    return found


def _repo_id_of(folder: Path) -> str | None:
    for part in reversed(folder.resolve().parts):  # .../models--Org--Name/snapshots/<sha>
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


def _named_origins(config: dict, folder: Path) -> list[str]:
    """Names the model gives for its origin: ``_name_or_path`` (transformers 4 wrote it) and the model
    card's ``base_model``."""
    named = config.get("_name_or_path")
    names = [named] if isinstance(named, str) and named else []
    return names + _front_matter_base(folder)


def _origin_candidates(config: dict, folder: Path) -> list[str]:
    names = _named_origins(config, folder)
    for name in (_repo_id_of(folder), folder.name):
        if name:
            stripped = _QUANT_SUFFIX.sub("", name)
            if stripped and stripped != name:
                names.append(stripped)
                if "/" not in stripped:  # a local folder named like it, beside the quantized one
                    names.append(str(folder.parent / stripped))
    return list(dict.fromkeys(names))


def origin_name(config: dict, base_path) -> str | None:
    """The name a quantized model gives for the model it was made from (local or not): a name in its
    config or card, else its Hub id without the quantization suffix (Org/Model-bnb-4bit -> Org/Model)."""
    folder = Path(base_path)
    for name in _named_origins(config, folder):
        if name not in (str(folder), folder.name) and not Path(name).is_absolute():
            return name
    repo = _repo_id_of(folder)
    stripped = _QUANT_SUFFIX.sub("", repo) if repo else None
    return stripped if stripped and stripped != repo else None


def find_unquantized_base(config: dict, base_path) -> Path | None:
    """The local 16-bit model a quantized model was made from: the name its config (``_name_or_path``),
    model card (``base_model``) or its own name without the quantization suffix gives, when that is a
    folder or in the Hugging Face cache, is not quantized itself and is the same kind of model."""
    from tui_merger.core.io.hf_refs import resolve_model_reference
    from tui_merger.core.io.sources import find_weight_files

    folder = Path(base_path)
    try:
        here = folder.resolve()
    except OSError:
        here = folder
    for name in _origin_candidates(config or {}, folder):
        path = resolve_model_reference(name)
        if path is None:
            continue
        try:
            if path.resolve() == here:
                continue
            other = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(other, dict) or quantization_info(other) is not None:
            continue
        kinds = (other.get("model_type"), (config or {}).get("model_type"))
        if all(kinds) and kinds[0] != kinds[1]:
            continue
        try:
            if not find_weight_files(path):
                continue
        except MergeError:
            continue
        if any(_packed_kind(n) for n in _header_names(path)):
            continue
        return path
    return None


def _header_names(folder: Path) -> list[str]:
    """Tensor names of a model folder from its safetensors headers (index first), without reading data."""
    from tui_merger.core.io.safetensors_io import SafetensorsFile
    from tui_merger.core.io.sources import SAFE_INDEX, find_weight_files

    index = folder / SAFE_INDEX
    if index.is_file():
        try:
            return list(json.loads(index.read_text()).get("weight_map") or {})
        except (OSError, ValueError, AttributeError):
            return []
    names = []
    for fname in find_weight_files(folder):
        if fname.endswith(".safetensors"):
            try:
                st = SafetensorsFile(folder / fname)
            except MergeError:
                continue
            try:
                names += list(st.tensors)
            finally:
                st.close()
    return names


# -- weights saved already quantized -------------------------------------------------------------------


def _packed_kind(name: str) -> str | None:
    for kind, suffixes in _PACKED_SUFFIXES.items():
        if name.endswith(suffixes):
            return kind
    return None


def packed_weights(source) -> str | None:
    """What kind of quantized storage a tensor source holds (bitsandbytes 4-bit packed uint8 weights
    with their quant_state tensors, LLM.int8 weights with SCB scales, GPTQ/AWQ qweight/qzeros), from
    tensor names and dtypes only; None for plain floating-point weights."""
    names = source.tensors
    for name in names:
        kind = _packed_kind(name)
        if kind:
            return kind
        if name.endswith((".weight_scale", ".weight_scale_inv")):  # FP8 checkpoints: only beside 8-bit weights
            weight = names.get(name.rsplit(".", 1)[0] + ".weight")
            if weight is not None and (weight.dtype.startswith("float8") or weight.dtype in ("int8", "uint8")):
                return "FP8/compressed-tensors"
    linear = [r for n, r in source.tensors.items() if n.endswith(".weight") and _is_linear_name(n[: -len(".weight")])]
    if linear and all(r.dtype in ("uint8", "int8") for r in linear):
        return "integer"
    return None


def refuse_packed(source, config: dict, base_path) -> None:
    """A base whose weight files hold quantized tensors cannot be a merge base at all: raise the sentence,
    naming the local 16-bit model when there is one."""
    kind = packed_weights(source)
    if kind is None:
        return
    info = quantization_info(config)
    what = {
        "bitsandbytes 4-bit": "packed 4-bit values in uint8 with quant_state tensors",
        "bitsandbytes 8-bit": "int8 values with SCB scales",
        "GPTQ/AWQ": "packed integers (qweight, qzeros, scales)",
        "FP8/compressed-tensors": "8-bit floats or packed integers with their scales",
        "integer": "integer values",
    }[kind]
    why = info.explanation if info else (
        "These are rounded weights, not the model's real ones, and a LoRA adapter must be merged into "
        "the original 16-bit weights."
    )
    raise MergeError(f"{base_path} holds weights saved already quantized ({kind}: {what}). {why} {origin_fix(config, base_path)}")


_UNSET = object()


def origin_fix(config: dict, base_path, found=_UNSET) -> str:
    """The sentence that says which --base to use instead of a quantized one (``found``: the result of
    find_unquantized_base when the caller has it already)."""
    if found is _UNSET:
        found = find_unquantized_base(config, base_path)
    if found is not None:
        return f"Pass --base {found} (the 16-bit model it was made from, found locally)."
    named = origin_name(config, base_path)
    if named:
        return f"Merge into the original 16-bit model it was made from ({named}): download it and pass it as --base."
    return "Merge into the original 16-bit base model (the one the quantized model was made from)."


# -- the round trip --------------------------------------------------------------------------------------


def _code4(quant_type: str):
    import torch

    if quant_type == "nf4":
        return torch.tensor(NF4_CODE, dtype=torch.float32)
    if quant_type == "fp4":
        mags = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32) / max(FP4_MAGNITUDES)
        return torch.cat([-mags.flip(0)[:-1], mags])  # ascending, one zero
    raise MergeError(f"{quant_type} is not a 4-bit type tui-merger can round-trip; use nf4 or fp4.")


_DYNAMIC = {}


def dynamic_code():
    """The signed 8-bit dynamic quantization map (Dettmers 2015) bitsandbytes uses for double
    quantization: for the decades 1e-6 .. 1, 2**i fraction values each (i = 0..6), the midpoints of an
    even split of [0.1, 1] times the decade, with both signs; plus 0 and 1; 256 values, ascending."""
    import torch

    if "signed" not in _DYNAMIC:
        values = [0.0, 1.0]
        for i in range(7):
            edges = torch.linspace(0.1, 1.0, 2**i + 1, dtype=torch.float32)
            mids = (edges[:-1] + edges[1:]) / 2.0
            decade = 10.0 ** (i - 6)
            values += (decade * mids).tolist() + (-decade * mids).tolist()
        _DYNAMIC["signed"] = torch.tensor(sorted(values), dtype=torch.float32)
    return _DYNAMIC["signed"]


def _nearest(x, code):
    """Index of the nearest code value (ties to the lower one), through the midpoints."""
    import torch

    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(x, bounds, out_int32=True)  # int32: indexing with it is ~10x faster than int64


def _block_absmax(flat, blocksize: int):
    """fp32 absmax of each block of ``blocksize`` values of a flat tensor (the last block may be short)."""
    import torch

    n = flat.numel()
    full = n - n % blocksize
    parts = []
    for start in range(0, full, CHUNK_VALUES):
        stop = min(start + CHUNK_VALUES, full)
        parts.append(flat[start:stop].view(-1, blocksize).abs().amax(dim=1).float())
    if full < n:
        parts.append(flat[full:].abs().amax().float().reshape(1))
    return torch.cat(parts)


def _blockwise(flat32, blocksize: int, code):
    """(dequantized values, absmax): blockwise absmax quantization of a flat fp32 tensor to ``code``,
    dequantized in fp32."""
    absmax = _block_absmax(flat32, blocksize)
    return _apply(flat32, blocksize, code, absmax, absmax), absmax


def _apply(flat, blocksize: int, code, absmax, scales, out=None):
    """code[nearest(x / absmax)] * scales, per block, in fp32 (cast into ``out`` when given)."""
    import torch

    n = flat.numel()
    inv = 1.0 / absmax.clamp(min=1e-38)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    step = max(blocksize, CHUNK_VALUES - CHUNK_VALUES % blocksize)
    for start in range(0, n, step):
        part = flat[start : start + step].float()
        m = part.numel()
        nb = -(-m // blocksize)
        b0 = start // blocksize
        if m % blocksize:
            part = torch.nn.functional.pad(part, (0, nb * blocksize - m))
        x = part.view(nb, blocksize).mul_(inv[b0 : b0 + nb, None]).clamp_(-1.0, 1.0)
        values = code[_nearest(x, code)].mul_(scales[b0 : b0 + nb, None])
        out[start : start + m] = values.view(-1)[:m]
    return out


def _dequantized_absmax(absmax, double_quant: bool):
    """The block scales as dequantizing sees them: as computed, or after 8-bit double quantization
    (mean subtracted, blocks of 256, the dynamic map, mean added back)."""
    if not double_quant:
        return absmax
    offset = absmax.mean()
    centred = absmax - offset
    deq, _ = _blockwise(centred, NESTED_BLOCKSIZE, dynamic_code())
    deq += offset
    return deq


def roundtrip_4bit(w, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = False, out_dtype=None):
    """``dequant(quant(w))`` as bitsandbytes 4-bit does it: blocks of ``blocksize`` values of the
    flattened tensor, absmax scaling, the nearest code value, fp32 products cast once to ``w``'s dtype
    (then to ``out_dtype``, the compute dtype, when given)."""
    import torch

    if blocksize not in BLOCKSIZES:
        raise MergeError(f"blocksize {blocksize} is not one bitsandbytes uses ({', '.join(map(str, BLOCKSIZES))}).")
    if not w.is_floating_point():
        raise MergeError(f"Only floating-point weights can be round-tripped through {quant_type}, not {w.dtype}.")
    code = _code4(quant_type)
    flat = w.reshape(-1)
    if flat.numel() == 0:
        out = w.clone()
    else:
        absmax = _block_absmax(flat, blocksize)
        scales = _dequantized_absmax(absmax, double_quant)
        out = torch.empty(flat.numel(), dtype=w.dtype)
        _apply(flat, blocksize, code, absmax, scales, out=out)
        out = out.view(w.shape)
    if out_dtype is not None and out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out


def nf4_roundtrip(w, blocksize: int = 64, double_quant: bool = False, out_dtype=None):
    """``dequant(quant(w))`` with bitsandbytes NF4: the weights QLoRA training saw."""
    return roundtrip_4bit(w, "nf4", blocksize, double_quant, out_dtype)


def fp4_roundtrip(w, blocksize: int = 64, double_quant: bool = False, out_dtype=None):
    """``dequant(quant(w))`` with bitsandbytes FP4."""
    return roundtrip_4bit(w, "fp4", blocksize, double_quant, out_dtype)


# -- which tensors bitsandbytes quantizes, and a source that round-trips them ----------------------------


def _is_linear_name(module: str) -> bool:
    """Whether a module name looks like a Linear layer bitsandbytes would replace: not an embedding,
    not an output head (transformers keeps lm_head and the model's last module in 16 bits)."""
    from tui_merger.core.io.names import INPUT_EMBEDDING_SUFFIXES

    leaf = module.rsplit(".", 1)[-1]
    if (module + ".weight").endswith(INPUT_EMBEDDING_SUFFIXES) or "embed" in leaf or leaf in _EMBEDDING_LEAVES:
        return False
    return leaf not in _HEAD_LEAVES


def _skipped(module: str, patterns) -> bool:
    """transformers' rule for modules_to_not_convert: a pattern matches from the start of the name up
    to a module boundary (also as a regex), or as a suffix."""
    for p in patterns:
        if module.endswith(p):
            return True
        try:
            if re.match(rf"(?:{p})(?=\.|$)", module):
                return True
        except re.error:
            if module == p or module.startswith(p + "."):
                return True
    return False


def quantized_tensor_names(tensors: dict, info: QuantInfo, linears: dict | None = None) -> list[str]:
    """The tensors bitsandbytes quantizes when it loads this model: the 2-D floating-point weights of the
    Linear layers transformers replaces (``linears``, from ``hf_names.quantizable_linears``: not the output
    embedding, tied weights or the last module), minus the skipped modules (matched on the module names in
    memory, as transformers matches them); biases and norms stay. Only without ``linears`` (a model
    transformers cannot build here: custom code) are Linear layers told by their usual names."""
    from tui_merger.core.io.safetensors_io import FLOAT_DTYPES

    names = []
    for name, ref in tensors.items():
        if not name.endswith(".weight") or len(ref.shape) != 2 or ref.dtype not in FLOAT_DTYPES:
            continue
        if linears is not None:
            module = linears.get(name)
            if module is not None and not _skipped(module, info.skip_modules):
                names.append(name)
            continue
        module = name[: -len(".weight")]
        if _is_linear_name(module) and not _skipped(module, info.skip_modules):
            names.append(name)
    return names


class RoundTripSource:
    """A view of a base model whose quantized tensors read as ``dequant(quant(W))`` (one tensor at a
    time, on demand) and whose other tensors pass through as stored."""

    def __init__(self, inner, info: QuantInfo, config: dict | None = None, transposed: bool | None = None,
                 linears: dict | None = None) -> None:
        from tui_merger.core.io.sources import TensorRef

        if not info.can_roundtrip:
            raise MergeError(f"{info.label} weights cannot be round-tripped; only bitsandbytes 4-bit nf4 and fp4 can.")
        self.inner = inner
        self.info = info
        self.folder = getattr(inner, "folder", None)
        self.files = getattr(inner, "files", [])
        if transposed is None:
            transposed = str((config or {}).get("model_type")) in _CONV1D_MODEL_TYPES
        self.transposed = transposed  # Conv1D weights, [in, out]: quantized as their transpose
        self._inner_refs = {}  # name in the model -> the inner source's ref
        self._by_place = {}  # (file, name in the file) -> the inner source's ref
        self.tensors = dict(inner.tensors)
        for name in quantized_tensor_names(inner.tensors, info, linears):
            ref = inner.tensors[name]
            self._inner_refs[name] = ref
            self._by_place[(ref.file, ref.name)] = ref
            self.tensors[name] = TensorRef(self, ref.file, ref.name, ref.dtype, tuple(ref.shape))

    @property
    def round_tripped(self) -> list[str]:
        return list(self._inner_refs)

    def describe(self) -> dict:
        """What the manifest says about the base weights."""
        return {
            "weights": f"{self.info.quant_type} round trip",
            "quant_type": self.info.quant_type,
            "blocksize": self.info.blocksize,
            "double_quant": self.info.double_quant,
            "skip_modules": list(self.info.skip_modules),
            "conv1d_transposed": self.transposed,
            "tensors": len(self._inner_refs),
        }

    def _inner_ref(self, ref):
        return self._by_place[(ref.file, ref.name)]

    def load(self, ref):
        inner_ref = self._inner_ref(ref)
        w = inner_ref.load()
        info = self.info
        if self.transposed:
            return roundtrip_4bit(w.T, info.quant_type, info.blocksize, info.double_quant).T.contiguous()
        return roundtrip_4bit(w, info.quant_type, info.blocksize, info.double_quant)

    def load_into(self, ref, out) -> None:
        out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None  # the stored bytes are not the values

    def row_blocks(self, ref):
        return None

    def release(self, ref) -> None:
        self._inner_ref(ref).release()

    def close(self) -> None:
        pass  # the inner source is closed by its owner
