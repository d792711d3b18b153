"""Outputs written quantized (``--keep-quantization``, ``--quantize fp8``) as the recompute check expects
them, quantized by code the merge does not use, so that a wrong quantization in the merge
(``formats/dequant.quantize_fp8_blocks``, ``quantize_compressed_fp8``, ``merge/requant_mxfp4``) shows as a
difference instead of being repeated on both sides of the comparison:

- FP8 blocks or one scale per tensor (``quant_method: fp8``, also ``scale_fmt: ue8m0``): transformers' own
  ``Fp8Quantize`` (``integrations/finegrained_fp8.py``, what ``save_pretrained`` of a model loaded with
  ``FineGrainedFP8Config`` writes). It takes whole blocks only; a last short block (DeepSeek-V3's 576-row
  ``kv_a_proj_with_mqa``) is padded with zeros to a whole one first, which leaves every block's absmax, so
  its scale, and every value as they are;
- compressed-tensors FP8: the ``compressed_tensors`` package's ``calculate_qparams`` + ``quantize`` (an
  optional dependency; without it, the format's definition written here on its own);
- MXFP4 (GPT-OSS's experts): the OCP microscaling format with transformers' rounding of the scale (up to
  the power of two at or above amax / 6), written here on its own: nearest e2m1 value by distance to each
  grid point, not by the merge's thresholds.

The merged 16-bit weight that is quantized is the merge's (``merge_math.compute``), checked first against
the recompute's own fp32 recomputation (``recompute._Recomputation``) within its rounding, then quantized
here and compared bit for bit with what the files hold.
"""

from __future__ import annotations

import threading
import weakref

_LOCK = threading.Lock()
_KEPT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pair source -> {output name: expected}

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def is_requantized(t) -> bool:
    """An output tensor made by quantizing a merged weight again (one of a pair: values or scales)."""
    from tui_merger.core.merge.pairs import PairSource

    return isinstance(t.source.source, PairSource)


def expected(t, merged_problem):
    """(the tensor ``t`` must hold, or None, a sentence when the merged weight itself is wrong).
    ``merged_problem(t16, merged)``: the recompute's own check of the merged 16-bit weight (a sentence, or
    None)."""
    src = t.source.source
    with _LOCK:
        kept = _KEPT.setdefault(src, {})
        if t.name in kept:
            return kept.pop(t.name), None
    t16 = src.weights[t.name]
    pair, problem = _expected_pair(src, t16, merged_problem)
    if problem is not None:
        return None, problem
    with _LOCK:
        for name, tensor in pair.items():
            if name != t.name:
                kept[name] = tensor
    return pair[t.name], None


def _expected_pair(src, t16, merged_problem):
    from tui_merger.core.merge.merge_math import compute

    merged = compute(t16)
    problem = merged_problem(t16, merged)
    if problem is not None:
        return None, problem
    return _quantized(src, t16, merged), None


def _quantized(src, t16, merged) -> dict:
    """{output name: tensor} of the two outputs (values, scales) ``merged`` is written as."""
    import torch

    from tui_merger.core.merge.requant import CompressedRequantSource, TensorRequantSource

    if hasattr(src, "scales"):  # an FP8 pair: the weight's name, and its scale's
        scale_ref = src.scales[t16.name]
        if isinstance(src, CompressedRequantSource):
            q, s = compressed_fp8(merged, src.strategy, src.scheme_block, getattr(torch, scale_ref.dtype))
        else:
            block = None if isinstance(src, TensorRequantSource) else src.block
            q, s = fp8(merged, block, src.pow2)
        return {t16.name: q, scale_ref.name: s.reshape(scale_ref.shape).to(getattr(torch, scale_ref.dtype))}
    blocks, scales = mxfp4(merged)
    return {t16.name + "_blocks": blocks, t16.name + "_scales": scales}


def fp8(w, block, pow2: bool):
    """(e4m3 values, fp32 or e8m0 inverse scales) of the 2-D ``w`` as transformers' ``Fp8Quantize`` writes
    them; ``block`` None: one scale for the tensor."""
    import types

    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    rows, cols = w.shape
    if block is None:
        block = (rows, cols)
    bm, bn = block
    pad_r, pad_c = -rows % bm, -cols % bn
    x = torch.nn.functional.pad(w, (0, pad_c, 0, pad_r)) if pad_r or pad_c else w
    config = types.SimpleNamespace(weight_block_size=[bm, bn], scale_fmt="ue8m0" if pow2 else "float")
    out = Fp8Quantize(types.SimpleNamespace(quantization_config=config))._quantize_one("w.weight", x)
    q, inv = out["w.weight"], out["w.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn, "transformers' Fp8Quantize left the weight as it was"
    return q[:rows, :cols].contiguous(), inv


def compressed_fp8(w, strategy: str, block, scale_dtype):
    """(e4m3 values, scale) of ``w`` as compressed-tensors quantizes an FP8 weight: the min and max its
    observer takes, its ``calculate_qparams`` and ``quantize``, in the scale's dtype."""
    import torch

    w = w.to(scale_dtype)
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import quantize
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError:
        quantize = None
    if strategy == "tensor":
        low, high = torch.aminmax(w)
    elif strategy == "channel":
        low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        br, bc = block
        tiles = w.reshape(w.shape[0] // br, br, w.shape[1] // bc, bc)
        low, high = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    if quantize is not None:
        args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                                block_structure=list(block) if strategy == "block" else None)
        scale, zero = calculate_qparams(low, high, args)
        return quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn), scale
    # the definition: scale = max(|min|, |max|) / 448 (0 -> the dtype's eps), values clamp(w / scale) in e4m3
    fmax = torch.finfo(torch.float8_e4m3fn).max
    amax = torch.maximum(low.abs(), high.abs())
    scale = amax / fmax
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)
    if strategy == "block":
        br, bc = block
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    else:
        full = scale
    return torch.clamp(w / full, -fmax, fmax).to(torch.float8_e4m3fn), scale


def mxfp4(w):
    """(blocks uint8 [experts, out, in/32, 16], scales uint8 [experts, out, in/32]) of GPT-OSS's experts
    ``w`` [experts, in, out]: per 32 values along ``in``, the scale 2**e with e the smallest integer such
    that amax / 6 <= 2**e (transformers' rounding up: nothing clips), stored as e + 127 (0 for a group of
    zeros); each value / 2**e to the nearest e2m1 magnitude (ties: the even code), its sign kept (-0 too);
    two codes a byte, the first in the low nibble."""
    import torch

    experts, cols, rows = w.shape
    x = w.to(torch.float32).transpose(1, 2).reshape(experts, rows, cols // 32, 32)
    amax = x.abs().amax(dim=-1)
    target = amax / 6.0
    mant, exp = torch.frexp(target)  # target = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)  # an exact power of two stays
    e = torch.clamp(e, min=-126)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    scale_byte = (e + 127).to(torch.uint8)
    units = x / torch.pow(2.0, e.clamp(min=-126).to(torch.float32))[..., None]
    grid = torch.tensor(E2M1)
    dist = (units.abs()[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # among the grid points at that distance, the even code (ties), which is the first even index there
    ties = dist == best
    even = ties & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(dim=-1), even.to(torch.uint8).argmax(dim=-1), ties.to(torch.uint8).argmax(dim=-1))
    code = code.to(torch.uint8) | (torch.signbit(units).to(torch.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), scale_byte.contiguous()
