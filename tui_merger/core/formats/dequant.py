"""Bases released quantized, with no 16-bit original: FP8 weights with a scale per block (DeepSeek-V3/R1,
Kimi-K2, Qwen3 ``-FP8``: ``quant_method: fp8``), compressed-tensors FP8 (a scale per tensor, per
output channel or per block) and MXFP4 (GPT-OSS's experts: ``*_blocks`` + ``*_scales``). People
fine-tune these on the dequantized weights (transformers' ``FineGrainedFP8Config(dequantize=True)``,
``CompressedTensorsConfig(dequantize=True)``, ``Mxfp4Config(dequantize=True)``), so the merge goes into
exactly those: ``DequantSource`` hands the plan each quantized weight dequantized, a block of rows at a
time, and hides the scales.

The arithmetic is transformers' own, so the values equal its dequantizing load bit for bit:

- ``fp8`` (``weight_scale_inv`` beside a ``float8_e4m3fn`` weight): the scale grid has one value per
  ``weight_block_size`` block (or a single value when there is no block size); each value is
  ``fp32(q) * fp32(scale)``, rounded once to the model's dtype (``config.json``'s ``dtype``, bf16 for
  every released one). A last block may be short: DeepSeek-V3's ``kv_a_proj_with_mqa`` has 576 rows and
  5 rows of scales; DeepSeek's own ``weight_dequant`` covers it with the same arithmetic (transformers
  5.24's dequantizing load derives the block from the grid instead: it refuses 576 rows, and reads 192
  rows with 2 scale rows as two blocks of 96).
- compressed-tensors FP8 (``weight_scale`` per tensor, per output channel or per block): ``q`` is cast to
  the scale's dtype and multiplied by it there (compressed-tensors' ``dequantize``), then cast to the
  model's dtype.
- MXFP4: each byte holds two e2m1 codes (the even value in the low nibble), times 2**(scale - 127) of
  its group of 32, written as transformers keeps the parameter ([experts, in, out]).

Everything is checked from the headers before anything is read: every FP8 weight has its scale, every
scale a weight, the scale grid fits the weight, the dtype is the one the format declares. Each problem
is one sentence naming the tensor and what was expected.

``quantize_fp8_blocks`` and ``quantize_compressed_fp8`` are the other direction, for outputs written
quantized (``merge/requant.py``).

No torch at import time: it is imported where tensors are touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tui_merger.core.errors import MergeError

FP8_E4M3 = "float8_e4m3fn"
FP8_E5M2 = "float8_e5m2"
SCALE_DTYPES = ("float32", "bfloat16", "float16")
# FP8 block scales stored as powers of two (scale_fmt ue8m0: a biased exponent byte, 2^(byte - 127)), as
# transformers' FineGrainedFP8Config(scale_fmt="ue8m0") stores them; read as the fp32 value they are
UE8M0 = "float8_e8m0fnu"
OUT_DTYPES = ("bfloat16", "float16", "float32")
E2M1_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_METHODS = ("nvfp4", "int4")  # read by formats/dequant_packed.py
ROW_VALUES = 1 << 22  # values dequantized at a time (a multiple of the block rows): memory stays flat
# tensors a quantized checkpoint carries beside its weights that a dequantized model has no place for
_ACTIVATION_SCALES = (".activation_scale", ".input_scale")


@dataclass(frozen=True)
class Scheme:
    """What a ``quantization_config`` this module can dequantize says."""

    method: str  # "fp8" (transformers' FineGrainedFP8), "compressed-tensors" or "mxfp4"
    scale_suffix: str  # weight_scale_inv (fp8), weight_scale (compressed-tensors), _scales (mxfp4)
    fp8_dtype: str  # the dtype the quantized weights must have (uint8 for MXFP4's packed values)
    block: tuple[int, int] | None = None  # rows x columns per scale; None: per tensor / per channel
    strategy: str = "block"  # block, tensor or channel
    scale_in_fp32: bool = True  # fp8: fp32 product; compressed-tensors: in the scale's dtype
    # modules the config leaves 16-bit, as it says (informational: which weights are quantized is read from
    # the scales beside them, as transformers reads them)
    ignored: tuple[str, ...] = field(default_factory=tuple)
    # fp8: "ue8m0" when every weight_scale_inv is a power of two (DeepSeek-V3.1/V3.2): re-quantized
    # weights get power-of-two scales too
    scale_fmt: str = "float"
    # fp8: "fp4" when the routed experts are MXFP4 (DeepSeek-V4-Flash: ``expert_dtype`` in config.json, which
    # transformers moves into the quantization_config): int8 weights, two e2m1 values a byte, one
    # power-of-two scale per 32 values
    expert_dtype: str = "fp8"

    @property
    def label(self) -> str:
        """e.g. 'FP8 (e4m3), 128x128 blocks' or 'compressed-tensors FP8 (e4m3), one scale per channel'."""
        if self.method == "mxfp4":
            return "MXFP4 (e2m1, a power-of-two scale per 32 values)"
        if self.method in PACKED_METHODS:  # NVFP4, INT4 pack-quantized: formats/dequant_packed.py
            from tui_merger.core.formats.dequant_packed import label

            return label(self)
        kind = "e4m3" if self.fp8_dtype == FP8_E4M3 else "e5m2"
        head = "FP8" if self.method == "fp8" else "compressed-tensors FP8"
        if self.block is not None:
            pow2 = ", power-of-two (ue8m0) scales" if self.scale_fmt == "ue8m0" else ""
            experts = " + MXFP4 experts (e2m1, a power-of-two scale per 32 values)" if self.expert_dtype == "fp4" else ""
            return f"{head} ({kind}), {self.block[0]}x{self.block[1]} blocks{pow2}{experts}"
        return f"{head} ({kind}), one scale per {'output channel' if self.strategy == 'channel' else 'tensor'}"

    @property
    def loader(self) -> str:
        """The transformers setting that loads the same dequantized weights."""
        if self.method == "fp8" and self.expert_dtype == "fp4":
            return 'FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0", expert_dtype="fp4")' \
                if self.scale_fmt == "ue8m0" else 'FineGrainedFP8Config(dequantize=True, expert_dtype="fp4")'
        if self.method == "fp8":
            return "FineGrainedFP8Config(dequantize=True)"
        if self.method == "mxfp4":
            return "Mxfp4Config(dequantize=True)"
        if self.method in PACKED_METHODS:
            from tui_merger.core.formats.dequant_packed import loader

            return loader(self)
        return "CompressedTensorsConfig(run_compressed=False)"


def _fp8_scheme(q: dict, config: dict | None = None) -> Scheme:
    fmt = str(q.get("fmt") or "e4m3").lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise MergeError(
            f"The base's quantization_config says fmt {fmt!r}; FP8 checkpoints of this kind store float8_e4m3fn "
            "(fmt e4m3), which is all transformers loads. Nothing was written."
        )
    block = q.get("weight_block_size")
    if block is not None:
        ok = isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block
        )
        if not ok:
            raise MergeError(
                f"The base's quantization_config has weight_block_size {block!r}; expected two positive integers "
                "such as [128, 128]. Nothing was written."
            )
        block = (int(block[0]), int(block[1]))
    scale_fmt = str(q.get("scale_fmt") or "float").lower()
    if scale_fmt not in ("float", "ue8m0"):
        raise MergeError(
            f"The base's quantization_config says scale_fmt {scale_fmt!r}; FP8 checkpoints store their scales as "
            "float (fp32) or ue8m0 (powers of two), which is all transformers loads. Nothing was written."
        )
    # DeepSeek-V4 writes expert_dtype at the top of config.json; transformers moves it into the
    # quantization_config (V4.1 ships it there)
    experts = q.get("expert_dtype", (config or {}).get("expert_dtype"))
    experts = str(experts or "fp8").lower()
    if experts not in ("fp8", "fp4"):
        raise MergeError(
            f"The base's config says expert_dtype {experts!r}; FP8 checkpoints store their experts as fp8 or fp4 "
            "(MXFP4, DeepSeek-V4), which is all transformers loads. Nothing was written."
        )
    skip = q.get("modules_to_not_convert") or ()
    return Scheme("fp8", "weight_scale_inv", FP8_E4M3, block, "block" if block else "tensor", True,
                  tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else (), scale_fmt, experts)


def _compressed_tensors_scheme(q: dict) -> Scheme | None:
    """compressed-tensors with FP8 weights in every group (format float-quantized or naive-quantized);
    None for its other schemes (integers, 4-bit floats), which are refused as before."""
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    fmt = str(q.get("format") or "")
    if fmt in ("nvfp4-pack-quantized", "pack-quantized"):  # 4-bit values packed: formats/dequant_packed.py
        return _packed_scheme(q, fmt, groups)
    if fmt not in ("float-quantized", "naive-quantized"):
        return None
    found = None
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            return None
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or weights.get("symmetric") is False:
            return None
        strategy = str(weights.get("strategy") or "tensor")
        if strategy not in ("tensor", "channel", "block"):
            return None
        block = None
        if strategy == "block":
            shape = weights.get("block_structure")
            if not (isinstance(shape, (list, tuple)) and len(shape) == 2 and all(isinstance(b, int) and b > 0 for b in shape)):
                raise MergeError(
                    f"The base's compressed-tensors config has block_structure {shape!r}; expected two positive "
                    "integers such as [128, 128]. Nothing was written."
                )
            block = (int(shape[0]), int(shape[1]))
        this = (strategy, block)
        if found is not None and found != this:
            return None  # groups with different schemes: not one this module reads
        found = this
    ignore = q.get("ignore") or ()
    return Scheme("compressed-tensors", "weight_scale", FP8_E4M3, found[1], found[0], False,
                  tuple(str(s) for s in ignore) if isinstance(ignore, (list, tuple)) else ())


def _packed_scheme(q: dict, fmt: str, groups: dict) -> Scheme | None:
    from tui_merger.core.formats import dequant_int4, dequant_nvfp4

    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    if not weights or not all(isinstance(w, dict) and w == weights[0] for w in weights):
        return None  # groups with different schemes: not one this module reads
    make = dequant_nvfp4.compressed_fields if fmt == "nvfp4-pack-quantized" else dequant_int4.fields
    return Scheme(**make(q, weights[0]))


def scheme_of(config: dict | None) -> Scheme | None:
    """The released-quantized format a model config declares that can be dequantized exactly, or None."""
    if not isinstance(config, dict):
        return None
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or "").lower()
    if method == "fp8":
        return _fp8_scheme(q, config)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(q)
    if method == "modelopt":  # NVIDIA ModelOpt: NVFP4 (formats/dequant_nvfp4.py)
        from tui_merger.core.formats.dequant_nvfp4 import modelopt_fields

        fields = modelopt_fields(q)
        return Scheme(**fields) if fields else None
    if method == "mxfp4":
        skip = q.get("modules_to_not_convert") or ()
        return Scheme("mxfp4", "_scales", "uint8", (1, 32), "mxfp4", True,
                      tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else ())
    return None


MODELOPT_FILE = "hf_quant_config.json"


def modelopt_quant_config(folder) -> dict | None:
    """What NVIDIA ModelOpt writes beside config.json (``hf_quant_config.json``: ``{"producer": {"name":
    "modelopt", ...}, "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [...]}}``)
    as a quantization_config (``quant_method: modelopt``); None when there is no such file. Releases made
    before ModelOpt also wrote the quantization_config into config.json have only this file."""
    import json
    from pathlib import Path

    path = Path(folder) / MODELOPT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        raise MergeError(f"{path} is not valid JSON, so how the weights are quantized cannot be read; copy it again "
                         "from the original model. Nothing was written.") from None
    producer = data.get("producer") if isinstance(data, dict) else None
    quantization = data.get("quantization") if isinstance(data, dict) else None
    if not isinstance(producer, dict) or str(producer.get("name")).lower() != "modelopt" or not isinstance(quantization, dict):
        return None
    return {"quant_method": "modelopt", **quantization, "producer": producer}


def scheme_for(config: dict | None, folder) -> Scheme | None:
    """``scheme_of`` the config, or, when config.json declares no quantization, of ModelOpt's
    ``hf_quant_config.json`` in ``folder``."""
    scheme = scheme_of(config)
    if scheme is not None or folder is None or (isinstance(config, dict) and "quantization_config" in config):
        return scheme
    q = modelopt_quant_config(folder)
    return scheme_of({**(config or {}), "quantization_config": q}) if q else None


def model_dtype(config: dict) -> str:
    """The dtype transformers loads the model in (``dtype: auto``): config.json's, else bf16."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for value in (config.get("dtype"), config.get("torch_dtype"), text.get("dtype"), text.get("torch_dtype")):
        name = str(value).removeprefix("torch.") if value else None
        if name in OUT_DTYPES:
            return name
    return "bfloat16"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _expected_scale_shape(scheme: Scheme, shape: tuple) -> tuple[tuple, ...]:
    """The scale shapes that fit a weight (several spellings of one value for per-tensor scales)."""
    rows, cols = shape[-2], shape[-1]
    lead = tuple(shape[:-2])
    if scheme.block is not None:
        return (lead + (_ceil(rows, scheme.block[0]), _ceil(cols, scheme.block[1])),)
    if scheme.strategy == "channel":
        return (lead + (rows, 1), lead + (rows,))
    return ((), (1,), lead + (1, 1)) if lead else ((), (1,), (1, 1))


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _mxfp4_pairs(tensors: dict) -> dict:
    """{name of the dequantized tensor: (blocks name, scales name)} of an MXFP4 checkpoint (GPT-OSS's
    experts: ``<param>_blocks`` uint8 [experts, rows, groups, 16], ``<param>_scales`` uint8 [experts,
    rows, groups]), checked from the headers."""
    pairs = {}
    for name, ref in tensors.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in tensors:
            raise MergeError(
                f"The base has the MXFP4 scales {name} but no {name[: -len('_scales')]}_blocks beside them; the "
                "checkpoint is incomplete. Nothing was written."
            )
        if not name.endswith("_blocks"):
            continue
        param = name[: -len("_blocks")]
        scales = tensors.get(param + "_scales")
        if scales is None:
            raise MergeError(
                f"{name} holds MXFP4 values but there is no {param}_scales beside it, so they cannot be recovered. "
                "Nothing was written."
            )
        if ref.dtype != "uint8" or len(ref.shape) != 4 or ref.shape[-1] != 16:
            raise MergeError(
                f"{name} is {ref.dtype} {_shape_text(ref.shape)}; MXFP4 blocks are uint8 [experts, rows, groups, 16] "
                "(two 4-bit values a byte, 32 a group). Nothing was written."
            )
        if scales.dtype != "uint8" or tuple(scales.shape) != tuple(ref.shape[:-1]):
            raise MergeError(
                f"{param}_scales is {scales.dtype} {_shape_text(scales.shape)} but {name} {_shape_text(ref.shape)} "
                f"needs uint8 {_shape_text(ref.shape[:-1])} (one exponent per 32 values). Nothing was written."
            )
        if param in tensors:
            raise MergeError(f"The base has both {param} and its MXFP4 {name}; keep one. Nothing was written.")
        pairs[param] = (name, param + "_scales")
    return pairs


def dequantize_mxfp4(blocks, scales, dtype, out=None):
    """GPT-OSS's experts as transformers' ``Mxfp4Config(dequantize=True)`` gives them: each byte's low
    nibble is the even value, an e2m1 code (sign bit 3); times 2**(scale - 127) of its group of 32; a
    few rows at a time, written transposed ([experts, in, out], the layout transformers keeps)."""
    import torch

    experts, rows, groups, half = blocks.shape
    cols = groups * half * 2
    if out is None:
        out = torch.empty(experts, cols, rows, dtype=dtype)
    lut = torch.tensor(E2M1_CODES, dtype=torch.float32)
    step = max(1, ROW_VALUES // max(cols, 1))
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            b = blocks[e, r0:r1].to(torch.int64)
            vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).reshape(r1 - r0, groups, half * 2)
            vals.mul_(torch.exp2(scales[e, r0:r1].to(torch.float32) - 127.0)[..., None])
            out[e, :, r0:r1] = vals.reshape(r1 - r0, cols).T
    return out


def fp8_scale_suffix(tensors: dict) -> str:
    """The name the FP8 block scales go by: ``weight_scale_inv`` (DeepSeek-V3's Hugging Face release and most
    others), or ``scale`` beside the weight (``W.weight`` + ``W.scale``: DeepSeek-V4's release, which
    transformers renames to ``weight_scale_inv`` as it loads, ``^(.+)\\.scale``)."""
    if any(n.endswith(".weight_scale_inv") for n in tensors):
        return "weight_scale_inv"
    if any(n.endswith(".scale") and n[: -len(".scale")] + ".weight" in tensors for n in tensors):
        return "scale"
    return "weight_scale_inv"


FP4_GROUP = 32  # MXFP4: values per power-of-two scale
FP4_PACKED = "int8"  # DeepSeek-V4's MXFP4 experts: two e2m1 codes a byte (transformers: int8 or float4_e2m1fn_x2)
FP4_SCALE_DTYPES = (UE8M0, "uint8")  # a power of two: the exponent byte, typed or raw


def _is_fp4(scheme: Scheme, dtype: str) -> bool:
    return scheme.method == "fp8" and dtype == FP4_PACKED


def _check_fp4(weight: str, w, scale: str, s, scheme: Scheme) -> None:
    """An MXFP4 expert of an FP8 checkpoint (DeepSeek-V4): int8 [rows, cols/2], its scale [rows, cols/32] in
    float8_e8m0fnu (or the exponent bytes as uint8)."""
    if scheme.expert_dtype != "fp4":
        raise MergeError(
            f"{weight} is stored in int8 (MXFP4: two 4-bit values a byte), but the base's config says expert_dtype "
            f"{scheme.expert_dtype}, so its values are not defined; expected float8_e4m3fn. Nothing was written."
        )
    if len(w.shape) < 2:
        raise MergeError(f"{weight} has shape {_shape_text(w.shape)}; a quantized weight is a matrix. Nothing was written.")
    if s.dtype not in FP4_SCALE_DTYPES:
        raise MergeError(
            f"{scale} is stored in {s.dtype}; MXFP4 expert scales are float8_e8m0fnu (ue8m0: one power of two per "
            f"{FP4_GROUP} values). Nothing was written."
        )
    rows, half = w.shape[-2], w.shape[-1]
    cols = half * 2
    want = tuple(w.shape[:-2]) + (rows, cols // FP4_GROUP)
    if cols % FP4_GROUP or tuple(s.shape) != want:
        raise MergeError(
            f"{scale} has shape {_shape_text(s.shape)} but {weight} {_shape_text(w.shape)} ({rows}x{cols} values, two a "
            f"byte) needs {_shape_text(want)} (one per {FP4_GROUP} values); the scales do not belong to this weight. "
            "Nothing was written."
        )


def check_pairs(tensors: dict, scheme: Scheme) -> tuple[dict, list[str]]:
    """{weight name: scale name} for every quantized weight, and the activation scales to drop; raises
    the one sentence for the first bad pair (a scale missing or of the wrong shape, a block size that
    does not divide the weight where the format wants it to, an FP8 dtype the format does not allow)."""
    suffix = "." + scheme.scale_suffix
    pairs = {}
    for name, ref in tensors.items():
        if name.endswith(suffix):
            weight = name[: -len(suffix)] + ".weight"
            if weight not in tensors:
                raise MergeError(
                    f"The base has the scale {name} but no weight {weight} beside it; the checkpoint is incomplete. "
                    "Nothing was written."
                )
            pairs[weight] = name
    drop = [n for n in tensors if n.endswith(_ACTIVATION_SCALES)]
    for name, ref in tensors.items():
        packed = _is_fp4(scheme, ref.dtype) and scheme.expert_dtype == "fp4"
        if (ref.dtype.startswith("float8") or packed) and name not in pairs and name.endswith(".weight"):
            raise MergeError(
                f"{name} is stored in {ref.dtype} but has no {scheme.scale_suffix} beside it, so its values cannot be "
                f"recovered; expected {name[: -len('.weight')]}.{scheme.scale_suffix}. Nothing was written."
            )
        if ref.dtype.startswith("float8") and not name.endswith((".weight", suffix)) and name not in drop:
            raise MergeError(
                f"{name} is stored in {ref.dtype}, but only weights with a {scheme.scale_suffix} can be dequantized. "
                "Nothing was written."
            )
    for weight, scale in pairs.items():
        w, s = tensors[weight], tensors[scale]
        if _is_fp4(scheme, w.dtype):
            _check_fp4(weight, w, scale, s, scheme)
            continue
        if w.dtype != scheme.fp8_dtype:
            allowed = "float8_e4m3fn (fmt e4m3)"
            if scheme.method == "fp8" and scheme.expert_dtype == "fp4":
                allowed += ", or int8 for MXFP4 experts (two 4-bit values a byte)"
            raise MergeError(
                f"{weight} is stored in {w.dtype}, but {scheme.label.split(',')[0]} weights are {allowed}. Nothing was written."
            )
        if len(w.shape) < 2:
            raise MergeError(f"{weight} has shape {_shape_text(w.shape)}; a quantized weight is a matrix. Nothing was written.")
        if s.dtype not in SCALE_DTYPES and not (s.dtype == UE8M0 and scheme.method == "fp8"):
            allowed = "float32, bfloat16, float16 or float8_e8m0fnu (ue8m0)" if scheme.method == "fp8" else \
                "float32, bfloat16 or float16"
            raise MergeError(
                f"{scale} is stored in {s.dtype}; {scheme.label.split(',')[0]} scales are {allowed}. Nothing was written."
            )
        wanted = _expected_scale_shape(scheme, tuple(w.shape))
        if tuple(s.shape) not in wanted:
            rows, cols = w.shape[-2], w.shape[-1]
            how = (f"one per {scheme.block[0]}x{scheme.block[1]} block of its {rows}x{cols} values"
                   if scheme.block else ("one per output row" if scheme.strategy == "channel" else "one value"))
            raise MergeError(
                f"{scale} has shape {_shape_text(s.shape)} but {weight} {_shape_text(w.shape)} needs "
                f"{_shape_text(wanted[0])} ({how}); the scales do not belong to this weight. Nothing was written."
            )
        if scheme.block is not None and scheme.method == "compressed-tensors":
            rows, cols = w.shape[-2], w.shape[-1]
            if rows % scheme.block[0] or cols % scheme.block[1]:
                raise MergeError(
                    f"{weight} {_shape_text(w.shape)} is not a whole number of {scheme.block[0]}x{scheme.block[1]} "
                    "blocks, which compressed-tensors' block strategy requires. Nothing was written."
                )
    return pairs, drop


def _fp4_scales(scale):
    """fp32 powers of two of MXFP4 scales: float8_e8m0fnu as the value it holds, raw uint8 as 2^(byte - 127)."""
    import torch

    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def dequantize_fp4(q, scale, dtype, out=None):
    """MXFP4 experts of an FP8 checkpoint (DeepSeek-V4): each byte of ``q`` (int8 [..., rows, cols/2]) holds
    two e2m1 codes, the even value in the low nibble; each value is ``fp32(code) * fp32(scale)`` of its group
    of 32 along the row, rounded once to ``dtype`` (transformers' ``Fp8Dequantize`` for int8 weights). A few
    rows at a time into ``out`` ([..., rows, cols])."""
    import torch

    rows, half = q.shape[-2], q.shape[-1]
    cols = half * 2
    if out is None:
        out = torch.empty(*q.shape[:-2], rows, cols, dtype=dtype)
    lut = torch.tensor(E2M1_CODES, dtype=torch.float32)
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)  # a byte's (low, high) values
    q2 = q.reshape(-1, rows, half)
    s2 = scale.reshape(-1, rows, cols // FP4_GROUP)
    o2 = out.view(-1, rows, cols)
    step = max(1, ROW_VALUES // max(cols, 1))
    for e in range(q2.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            b = q2[e, r0:r1].view(torch.uint8).to(torch.int64).reshape(-1)
            # one lookup per byte (twice as fast as a lookup per nibble)
            vals = torch.index_select(pairs, 0, b).reshape(r1 - r0, cols // FP4_GROUP, FP4_GROUP)
            vals.mul_(_fp4_scales(s2[e, r0:r1])[..., None])
            o2[e, r0:r1] = vals.reshape(r1 - r0, cols)  # one rounding to the model's dtype
    return out


def dequantize(q, scale, scheme: Scheme, dtype, out=None):
    """One weight's values as transformers' dequantizing load gives them: blocks of rows at a time into
    ``out`` (``dtype``, the weight's shape; made when None)."""
    import torch

    if q.dtype == torch.int8 and scheme.method == "fp8":  # DeepSeek-V4's MXFP4 experts
        return dequantize_fp4(q, scale, dtype, out)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype)
    rows, cols = q.shape[-2], q.shape[-1]
    q2 = q.reshape(-1, rows, cols)
    o2 = out.view(-1, rows, cols)
    work = torch.float32 if scheme.scale_in_fp32 else scale.dtype
    if scheme.block is not None:
        s = scale.reshape(-1, *scale.shape[-2:])
    elif scheme.strategy == "channel":
        s = scale.reshape(-1, rows, 1)
    else:
        s = scale.reshape(-1, 1, 1)
    s = s.to(work)
    bm = scheme.block[0] if scheme.block else 1
    step = max(bm, (ROW_VALUES // max(cols, 1)) // bm * bm)
    for e in range(q2.shape[0]):
        se = s[e if s.shape[0] > 1 else 0]
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            part = q2[e, r0:r1].to(work)
            if scheme.block is not None:
                grid = se[r0 // bm : _ceil(r1, bm)].repeat_interleave(bm, dim=0)[: r1 - r0]
                part.mul_(grid.repeat_interleave(scheme.block[1], dim=1)[:, :cols])
            elif scheme.strategy == "channel":
                part.mul_(se[r0:r1])
            else:
                part.mul_(se[0, 0])
            o2[e, r0:r1] = part  # one rounding to the model's dtype
    return out


class DequantSource:
    """A view of a base released quantized: each quantized weight reads dequantized (named and shaped as
    the weight, in the model's dtype), its scale and activation scales are hidden, the rest passes
    through as stored."""

    def __new__(cls, inner, scheme: Scheme, config: dict, dtype: str | None = None):
        if scheme.method in PACKED_METHODS:  # NVFP4, INT4 pack-quantized: their own view, same answers
            from tui_merger.core.formats.dequant_packed import PackedSource

            # in the model's dtype, as the formats' own decompressors give them (an asked --dtype is the
            # output's cast of those values)
            return PackedSource(inner, scheme, config, model_dtype(config))
        return super().__new__(cls)

    def __init__(self, inner, scheme: Scheme, config: dict, dtype: str | None = None) -> None:
        from tui_merger.core.io.sources import TensorRef

        self.inner = inner
        self.scheme = scheme
        self.folder = getattr(inner, "folder", None)
        self.files = getattr(inner, "files", [])
        # the output's dtype when one is asked for (--dtype): dequantized straight to it, rounded once (a
        # stop in the model's bf16 first rounded fp32 outputs' base weights to bf16)
        self.dtype = dtype if dtype in OUT_DTYPES else model_dtype(config)
        self.quantization_config = config.get("quantization_config")
        self.output_quantization = None  # "keep": the output in this format again (merge.requant)
        if scheme.method == "mxfp4":
            self._init_mxfp4(inner)
            return
        if scheme.method == "fp8":  # weight_scale_inv, or DeepSeek-V4's W.scale
            from dataclasses import replace

            self.scheme = scheme = replace(scheme, scale_suffix=fp8_scale_suffix(inner.tensors))
        pairs, drop = check_pairs(inner.tensors, scheme)
        self._scales = {}  # (file, name in the file) -> (weight ref, scale ref)
        hidden = set(pairs.values()) | set(drop)
        self.tensors = {}
        for name, ref in inner.tensors.items():
            if name in hidden:
                continue
            if name in pairs:
                self._scales[(ref.file, ref.name)] = (ref, inner.tensors[pairs[name]])
                shape = tuple(ref.shape)
                if _is_fp4(scheme, ref.dtype):  # two values a byte
                    shape = shape[:-1] + (shape[-1] * 2,)
                ref = TensorRef(self, ref.file, ref.name, self.dtype, shape)
            self.tensors[name] = ref
        self.dropped = sorted(drop)
        from tui_merger.core.formats.dequant_checks import check_against_config, unknown_tensors

        unknown_tensors(self.tensors, self, scheme.label)
        packed = {n: w for n in pairs if _is_fp4(scheme, (w := inner.tensors[n]).dtype)}
        check_against_config(self, config, packed)

    @property
    def output_quantization(self):
        return getattr(self, "_output_quantization", None)

    @output_quantization.setter
    def output_quantization(self, mode) -> None:
        """``keep`` (--keep-quantization) is refused where writing the base's format again is not done yet:
        DeepSeek-V4's release (MXFP4 experts, scales named ``W.scale``)."""
        scheme = getattr(self, "scheme", None)
        if mode == "keep" and scheme is not None and scheme.method == "fp8" and (
                scheme.expert_dtype == "fp4" or scheme.scale_suffix == "scale"):
            raise MergeError(
                f"--keep-quantization cannot write {scheme.label} again yet (DeepSeek-V4's layout: scales named "
                "W.scale, MXFP4 experts); leave it out for a bfloat16 output. Nothing was written."
            )
        self._output_quantization = mode

    def pair(self, ref):
        """(stored weight ref, its scale ref) of one of this source's dequantized weights, else None."""
        if ref.source is not self or self.scheme.method == "mxfp4":
            return None
        return self._scales.get((ref.file, ref.name))

    def _init_mxfp4(self, inner) -> None:
        from tui_merger.core.io.sources import TensorRef

        pairs = _mxfp4_pairs(inner.tensors)
        hidden = {n for pair in pairs.values() for n in pair}
        self._scales = {}
        self.tensors = {}
        self._names = {}
        for name, ref in inner.tensors.items():
            if name in hidden and name.endswith("_scales"):
                continue
            if name in hidden:
                param = name[: -len("_blocks")]
                experts, rows, groups, half = ref.shape
                self._scales[(ref.file, ref.name)] = (ref, inner.tensors[param + "_scales"])
                self._names[(ref.file, ref.name)] = param
                # named and shaped as the dequantized parameter ([experts, in, out]); found by the blocks' place
                self.tensors[param] = TensorRef(self, ref.file, ref.name, self.dtype, (experts, groups * half * 2, rows))
                continue
            self.tensors[name] = ref
        self.dropped = []
        from tui_merger.core.formats.dequant_checks import unknown_tensors

        unknown_tensors(self.tensors, self, self.scheme.label)

    @property
    def scale_dtypes(self) -> set[str]:
        """The dtypes the scales are stored in."""
        return {s.dtype for _, s in self._scales.values()}

    @property
    def dequantized(self) -> list[str]:
        if self.scheme.method == "mxfp4":
            return list(self._names.values())
        return [w.name for w, _ in self._scales.values()]

    def describe(self) -> dict:
        """What the manifest says about the base weights."""
        return {
            "weights": "dequantized as released",
            "format": self.scheme.label,
            "method": self.scheme.method,
            "block": list(self.scheme.block) if self.scheme.block else None,
            "strategy": self.scheme.strategy,
            "dtype": self.dtype,
            "as": self.scheme.loader,
            "tensors": len(self._scales),
        }

    def load(self, ref):
        w, s = self._scales[(ref.file, ref.name)]
        if self.scheme.method == "mxfp4":
            return dequantize_mxfp4(w.load(), s.load(), _torch_dtype(self.dtype))
        return dequantize(w.load(), s.load(), self.scheme, _torch_dtype(self.dtype))

    def load_experts(self, ref, i: int, j: int):
        """Experts [i, j) of a packed experts weight, dequantized (only those: GPT-OSS-120B's
        gate_up_proj is 4.2 GB in bf16 per layer); a weight without an experts dimension whole."""
        w, s = self._scales[(ref.file, ref.name)]
        if self.scheme.method == "mxfp4":
            out = dequantize_mxfp4(w.load()[i:j], s.load()[i:j], _torch_dtype(self.dtype))
            w.release_rows(i, j)  # the stored experts' pages go back as they are read
            s.release_rows(i, j)
            return out
        scale = s.load()
        if len(ref.shape) == 3 and scale.dim() == 3 and scale.shape[0] == ref.shape[0]:  # a scale grid per expert
            return dequantize(w.load()[i:j], scale[i:j], self.scheme, _torch_dtype(self.dtype))
        if scale.numel() == 1:  # one scale for the tensor
            return dequantize(w.load()[i:j], scale, self.scheme, _torch_dtype(self.dtype))
        return self.load(ref)[i:j]  # another layout: dequantized whole (each block again)

    def load_into(self, ref, out) -> None:
        if self.scheme.method == "mxfp4":
            w, s = self._scales[(ref.file, ref.name)]
            if out.dtype == _torch_dtype(self.dtype) and out.is_contiguous():
                dequantize_mxfp4(w.load(), s.load(), out.dtype, out=out)
            else:
                out.copy_(self.load(ref))
            return
        if out.dtype == _torch_dtype(self.dtype) and out.is_contiguous():
            w, s = self._scales[(ref.file, ref.name)]
            dequantize(w.load(), s.load(), self.scheme, out.dtype, out=out)
        else:
            out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None  # the stored bytes are FP8, not the values

    def row_blocks(self, ref):
        """A 2-D weight's dequantized values a block of rows at a time (whole blocks of the scale grid,
        about ROW_VALUES values): the engine writes an untouched one and merges a changed one block by
        block, so no weight is ever held whole (DeepSeek-V3's 18432x7168 dense MLP weights: 7 MB blocks
        instead of 264 MB in bf16 and 528 MB in fp32). MXFP4's packed experts are written transposed: whole."""
        if self.scheme.method == "mxfp4" or len(ref.shape) != 2:
            return None
        return self._row_blocks(ref)

    def _row_blocks(self, ref):
        w, s = self._scales[(ref.file, ref.name)]
        rows, cols = ref.shape
        bm = self.scheme.block[0] if self.scheme.block else 1
        if _is_fp4(self.scheme, w.dtype):  # MXFP4 experts: a scale row per weight row
            bm = 1
        step = max(bm, (ROW_VALUES // max(cols, 1)) // bm * bm)
        q, scale = w.load(), s.load()
        dtype = _torch_dtype(self.dtype)
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            if bm == 1 and _is_fp4(self.scheme, w.dtype):
                part_scale = scale[r0:r1]
            elif self.scheme.block is not None:  # the scale rows of these weight rows (whole blocks)
                part_scale = scale[r0 // bm : _ceil(r1, bm)]
            elif self.scheme.strategy == "channel":
                part_scale = scale.reshape(rows, -1)[r0:r1]
            else:
                part_scale = scale
            block = dequantize(q[r0:r1], part_scale, self.scheme, dtype)
            yield block, (lambda a=r0, b=r1: w.release_rows(a, b))
        s.release()

    def release(self, ref) -> None:
        w, s = self._scales[(ref.file, ref.name)]
        w.release()
        s.release()

    def close(self) -> None:
        pass  # the inner source is closed by its owner


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# -- writing FP8 blocks ------------------------------------------------------------------------------------

FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantize_fp8_blocks(w, block=(128, 128), pow2=False):
    """(float8_e4m3fn weight, fp32 ``weight_scale_inv`` per block) as transformers' own Fp8Quantize
    writes them (what ``save_pretrained`` of a dequantized FP8 model computes): per block, scale =
    448 / absmax (1 for an all-zero block), the stored inverse is 1 / scale, the values are
    ``clamp(fp32(w) * scale, -448, 448)`` cast to e4m3. With ``pow2`` (``scale_fmt: ue8m0``, DeepSeek-V3.1)
    the inverse is first rounded up to a power of two (``2 ** ceil(log2(inverse))``, so nothing clips)
    and the values are multiplied by its exact reciprocal, as Fp8Quantize does for ue8m0 (it stores the
    inverse as float8_e8m0fnu; the released checkpoints, and this, store the same value in fp32).
    A last short block (rows or columns not a whole number of blocks, DeepSeek-V3's 576-row
    kv_a_proj_with_mqa) takes the absmax of the values it has. A block of rows at a time: one row block
    in fp32 besides the output."""
    import torch

    rows, cols = w.shape
    bm, bn = block
    grid_rows, grid_cols = _ceil(rows, bm), _ceil(cols, bn)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    inv = torch.empty(grid_rows, grid_cols, dtype=torch.float32)
    pad = grid_cols * bn - cols
    for i in range(grid_rows):
        part = w[i * bm : (i + 1) * bm].float()
        if pad:
            part = torch.nn.functional.pad(part, (0, pad))
        tiles = part.view(part.shape[0], grid_cols, bn)
        amax = tiles.abs().amax(dim=(0, 2))
        scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
        inv[i] = 1.0 / scale
        if pow2:
            inv[i] = torch.pow(2.0, torch.ceil(torch.log2(inv[i].clamp(min=torch.finfo(torch.float32).tiny))))
            scale = 1.0 / inv[i]
        scaled = (tiles * scale[None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[i * bm : (i + 1) * bm] = scaled.view(part.shape[0], -1)[:, :cols].to(torch.float8_e4m3fn)
    return q, inv


def quantize_compressed_fp8(w, strategy: str, block, scale_dtype):
    """(float8_e4m3fn weight, ``weight_scale``) as compressed-tensors quantizes an FP8 weight (its
    ``calculate_qparams`` on the weight's min and max, then ``quantize``), all in the scale's dtype (the
    dtype of the weight it observed: bf16 for a bf16 model): per tensor, output row ([rows, 1]) or block,
    scale = absmax / 448 (0 becomes the dtype's eps), values ``clamp(w / scale, -448, 448)`` cast to e4m3.
    The block strategy needs whole blocks (checked when the base is opened)."""
    import torch

    x = w.to(scale_dtype)
    rows, cols = x.shape
    if strategy == "block":
        bm, bn = block
        tiles = x.reshape(rows // bm, bm, cols // bn, bn)
        amax = tiles.abs().amax(dim=(1, 3))
    elif strategy == "channel":
        amax = x.abs().amax(dim=1, keepdim=True)
    else:
        amax = x.abs().amax()
    scale = amax / torch.tensor(FP8_MAX, dtype=scale_dtype)
    eps = torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype)
    scale = torch.where(scale == 0, eps, scale)
    if strategy == "block":
        scaled = (tiles / scale[:, None, :, None]).reshape(rows, cols)
    else:
        scaled = x / scale
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
