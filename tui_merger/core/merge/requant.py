"""Outputs written quantized: the base's own format (``--keep-quantization``: tensors the adapter does
not touch are copied byte for byte with their scales, changed ones quantized again the way that format's
own code does it: FP8 blocks as transformers' Fp8Quantize, power-of-two scales for ``scale_fmt: ue8m0``,
compressed-tensors FP8 as its calculate_qparams + quantize) and FP8 blocks for serving from any merge
(``--quantize fp8``: every weight transformers' FP8 load quantizes, in 128x128 blocks, weight-only;
what it leaves alone (the output embedding, tied weights), norms and experts packed in one tensor stay 16-bit).

``output_plan`` is ``build_plan`` plus that rewrite, so the engine, the recompute and the dry run see the
same output tensors. A re-quantized weight is two output tensors (the e4m3 values and the scale) read
from ``RequantSource`` (or ``CompressedRequantSource``), which computes the merged 16-bit weight once
(as the 16-bit output would hold it) and quantizes it for both (``pairs.PairSource``). MXFP4 (GPT-OSS's
experts) is written by ``merge/requant_mxfp4.py``.
"""

from __future__ import annotations


from tui_merger.core.errors import MergeError
from tui_merger.core.merge.pairs import PairSource
from tui_merger.core.plan.plan import OutputTensor, TensorPlan, build_plan, shard_tensors

KEEP = "keep"
FP8 = "fp8"
CHOICES = (KEEP, FP8)


def output_plan(base, adapter, config: dict, dtype, shard_size: int) -> TensorPlan:
    """The tensor plan, with the quantized output the base source was opened for (none: build_plan's)."""
    plan = build_plan(base, adapter, config, dtype, shard_size)
    mode = getattr(base, "output_quantization", None)
    if mode is None:
        return plan
    if mode == KEEP:
        tensors, changes = _keep(plan, base)
    else:
        tensors, changes = _fp8(plan, base, config)
    said = changes.pop("said", None)
    return TensorPlan(tensors, shard_tensors(tensors, shard_size), {**plan.config_changes, **changes},
                      plan.merged_modules, said)


def _keep(plan, base):
    """The base's own format: untouched weights and their scales as stored, changed ones quantized again
    the way that format's own code quantizes them. One branch per format."""
    scheme = getattr(base, "scheme", None)
    method = scheme.method if scheme is not None else None
    # power-of-two scales: ue8m0 said, or scales stored as float8_e8m0fnu (which holds nothing else)
    pow2 = method == "fp8" and (scheme.scale_fmt == "ue8m0" or "float8_e8m0fnu" in base.scale_dtypes)
    if method == "fp8" and scheme.block is not None:
        requant = RequantSource(scheme.block, pow2=pow2)
    elif method == "fp8":  # one weight_scale_inv per tensor
        requant = TensorRequantSource(pow2=pow2)
    elif method == "compressed-tensors":
        requant = CompressedRequantSource(scheme)
    elif method == "mxfp4":  # GPT-OSS's experts
        from tui_merger.core.merge.requant_mxfp4 import keep_mxfp4

        return keep_mxfp4(plan, base)
    elif method in ("nvfp4", "int4"):  # read dequantized only (docs/quantized-bases.md says why)
        name = "NVFP4" if method == "nvfp4" else "INT4 pack-quantized"
        raise MergeError(
            f"--keep-quantization cannot write {name} again yet: the base is read dequantized only; leave it out "
            "for a bfloat16 output. Nothing was written."
        )
    else:
        label = scheme.label if scheme is not None else "not quantized"
        raise MergeError(
            "--keep-quantization writes FP8 (quant_method fp8), compressed-tensors FP8 or MXFP4 again; the base "
            f"is {label}. Leave it out for a 16-bit output. Nothing was written."
        )
    out = []
    for t in plan.tensors:
        pair = base.pair(t.source) if t.source.source is base else None
        if pair is None:
            out.append(t)
        elif not t.ops:  # as stored: the e4m3 bytes and their scales
            w, s = pair
            out.append(OutputTensor(t.name, w, w.dtype, tuple(w.shape)))
            out.append(OutputTensor(_scale_name(t.name, requant.scale_suffix), s, s.dtype, tuple(s.shape)))
        else:
            out += requant.add(t, pair[1])
    for name in base.dropped:  # activation scales (a static scheme): kept with the model as stored
        ref = base.inner.tensors[name]
        out.append(OutputTensor(name, ref, ref.dtype, tuple(ref.shape)))
    return out, {"quantization_config": base.quantization_config}


def _fp8(plan, base, config: dict):
    """Every weight transformers' FP8 load would quantize (``hf_names.fp8_layout``: the modules its
    ``replace_with_fp8_linear`` replaces, as it decides them) whose rows and columns are whole 128x128
    blocks; the others are named in ``modules_to_not_convert`` (in-memory module names: what that function
    matches) beside transformers' own defaults, so that its FP8 load leaves them 16-bit."""
    from tui_merger.core.formats.dequant import FP8_BLOCK_CONFIG
    from tui_merger.core.formats.hf_names import fp8_layout

    if getattr(base, "scheme", None) is not None:
        raise MergeError(
            f"--quantize fp8 quantizes a 16-bit merge; the base is already {base.scheme.label}: use "
            "--keep-quantization to write its own format again. Nothing was written."
        )
    layout = fp8_layout(config, [t.name for t in plan.tensors])
    if layout is None:
        raise MergeError(
            f"--quantize fp8 needs transformers to build this model ({config.get('model_type') or 'no model_type'}) to "
            "learn which weights its FP8 load quantizes, and it cannot here; leave --quantize out for a 16-bit "
            "output. Nothing was written."
        )

    def whole(t) -> bool:
        return (len(t.shape) == 2 and t.dtype in ("bfloat16", "float16", "float32")
                and t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0)

    shapes = {t.name: t for t in plan.tensors}
    # an experts module is written FP8 whole or not at all (FP8Experts takes every projection's scales)
    expert_ok = {m for m in layout.converted if all(n in shapes and whole(shapes[n]) for n in layout.experts[m])}
    expert_of = {n: m for m, names in layout.experts.items() for n in names}
    requant = RequantSource((128, 128))
    out, skipped, packed = [], [], []
    for t in plan.tensors:
        module = layout.linears.get(t.name)
        owner = expert_of.get(t.name)
        if (module is not None and whole(t)) or (owner in expert_ok and t.name.endswith(".weight")):
            out += requant.add(t)
            continue
        if module is not None and module not in skipped:
            skipped.append(module)
        elif owner is not None and owner not in expert_ok and owner not in packed:
            # transformers' FP8Experts would replace the module and cannot take it (GPT-OSS: biases,
            # [experts, out, in] in one tensor; or matrices not whole blocks): left 16-bit and named
            packed.append(owner)
        out.append(t)
    if not requant.weights:
        raise MergeError("--quantize fp8 found no Linear weight of whole 128x128 blocks that transformers' FP8 load "
                         "quantizes. Nothing was written.")
    config_out = {**FP8_BLOCK_CONFIG,
                  "modules_to_not_convert": [*layout.defaults, *skipped, *packed, *layout.others]}
    packed_tensors = {m: [n for n in layout.experts[m] if n in shapes] for m in packed}
    said = {"skipped": skipped, "packed": packed_tensors, "defaults": layout.defaults, "others": layout.others}
    return out, {"quantization_config": config_out, "said": said}


def _fp8_scale_dtype(like) -> str:
    """fp32, or float8_e8m0fnu where the base stores its power-of-two (ue8m0) scales so: a re-quantized
    weight's scale in the dtype of the one it replaces (its value a power of two either way)."""
    from tui_merger.core.formats.dequant import UE8M0

    return UE8M0 if like is not None and like.dtype == UE8M0 else "float32"


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _scale_name(weight_name: str, suffix: str = "weight_scale_inv") -> str:
    return weight_name[: -len("weight")] + suffix


class RequantSource(PairSource):
    """The e4m3 values and scales of re-quantized weights: the merged 16-bit weight computed once and
    quantized in blocks, as transformers' Fp8Quantize does. ``pow2``: power-of-two scales
    (``scale_fmt: ue8m0``)."""

    computes = True  # its tensors are not copies although their dtype is the output's (behaviour.rounded_by_depth)
    scale_suffix = "weight_scale_inv"

    def __init__(self, block, pow2: bool = False) -> None:
        super().__init__()
        self.block = tuple(block)
        self.pow2 = pow2
        self.scales = {}  # 16-bit weight name -> the TensorRef of its new scale (shape and dtype)

    def _scale_shape_dtype(self, t, like) -> tuple[tuple, str]:
        rows, cols = t.shape
        return (-(-rows // self.block[0]), -(-cols // self.block[1])), _fp8_scale_dtype(like)

    def add(self, t, like=None) -> list:
        """The two output tensors of the 16-bit OutputTensor ``t`` quantized; ``like``: the base's scale
        of that weight (--keep-quantization), whose shape and dtype the new scale takes where they vary."""
        from tui_merger.core.io.sources import TensorRef

        shape, dtype = self._scale_shape_dtype(t, like)
        w = TensorRef(self, "", t.name, "float8_e4m3fn", tuple(t.shape))
        s = TensorRef(self, "", _scale_name(t.name, self.scale_suffix), dtype, shape)
        self.weights[w.name] = self.weights[s.name] = t
        self.scales[t.name] = s
        return [OutputTensor(t.name, w, w.dtype, w.shape), OutputTensor(s.name, s, s.dtype, s.shape)]

    def _quantize(self, w, scale):
        """(values, scale) of the merged weight ``w``; ``scale``: the TensorRef the scale is written as."""
        from tui_merger.core.formats.dequant import quantize_fp8_blocks

        return quantize_fp8_blocks(w, self.block, pow2=self.pow2)

    def _pair(self, ref) -> dict:
        from tui_merger.core.merge.merge_math import compute

        t = self.weights[ref.name]
        s = self.scales[t.name]
        q, scale = self._quantize(compute(t), s)
        return {t.name: q, s.name: scale.reshape(s.shape).to(_torch_dtype(s.dtype))}


class TensorRequantSource(RequantSource):
    """FP8 with one ``weight_scale_inv`` per tensor (``quant_method: fp8`` without ``weight_block_size``):
    the whole weight is one block, as transformers' Fp8Quantize takes it then; the scale keeps the shape
    the base stores it in."""

    def __init__(self, pow2: bool = False) -> None:
        super().__init__((1, 1), pow2)

    def _scale_shape_dtype(self, t, like) -> tuple[tuple, str]:
        return tuple(like.shape), _fp8_scale_dtype(like)

    def _quantize(self, w, scale):
        from tui_merger.core.formats.dequant import quantize_fp8_blocks

        return quantize_fp8_blocks(w, tuple(w.shape[-2:]), pow2=self.pow2)


class CompressedRequantSource(RequantSource):
    """compressed-tensors FP8 (``weight_scale`` per tensor, output row or block) again: the merged weight
    quantized as compressed-tensors does it, its scale in the dtype and shape the base stores that
    weight's scale in (compressed-tensors keeps the scale in the dtype of the weight it observed)."""

    scale_suffix = "weight_scale"

    def __init__(self, scheme) -> None:
        super().__init__(scheme.block or (1, 1))
        self.strategy = scheme.strategy
        self.scheme_block = scheme.block

    def _scale_shape_dtype(self, t, like) -> tuple[tuple, str]:
        return tuple(like.shape), like.dtype

    def _quantize(self, w, scale):
        import torch

        from tui_merger.core.formats.dequant import quantize_compressed_fp8

        return quantize_compressed_fp8(w, self.strategy, self.scheme_block, getattr(torch, scale.dtype))
