"""``--keep-quantization`` for MXFP4 bases (GPT-OSS: the experts stored as ``<param>_blocks`` uint8
[experts, out, in/32, 16] and ``<param>_scales`` uint8 [experts, out, in/32]; attention, router,
embeddings and norms bf16).

Experts the adapter does not touch are copied byte for byte, blocks and scales. Experts it changes
(LoRA on ``mlp.experts.gate_up_proj`` / ``down_proj``, peft's ``target_parameters``) are computed as
the bf16 output would hold them and quantized again by ``quantize_mxfp4``, into the same names and
shapes. Everything else (bf16 in the release: a merged attention projection) is written as the plain
output writes it, and ``config.json`` keeps its ``quantization_config``.

``quantize_mxfp4`` follows transformers 5.24's own quantize path (``integrations/mxfp4.py``:
``quantize_to_mxfp4`` calls triton_kernels' ``downcast_to_mxfp_torch(w, torch.uint8, axis=1)`` with its
default scale rounding, ``ROUND_UP``), written here from the rules, not from that code:

- a group is 32 consecutive values along the input dimension (the ``in`` axis of the [experts, in, out]
  parameter, the last one of the stored [experts, out, in] matrices);
- its scale is 2**ceil(log2(amax / 6)) with ``amax / 6`` computed in fp32: the power of two at or above
  it, so the group's largest value lands in (3, 6] and nothing clips (the OCP spec's
  2**(floor(log2(amax)) - 2) puts it in [4, 8) and clips what lies above 6). Stored as the biased
  exponent byte (``+ 127``); a group of zeros gets the byte 0; a scale below 2**-126 the byte 1;
- each value divided by it (exactly: a power of two) goes to the nearest e2m1 value (0, 0.5, 1, 1.5,
  2, 3, 4, 6) with ties to the even code, saturating at 6; the sign is kept, also for a value that
  rounds to zero (a negative one is code 8, ``-0``);
- two codes a byte, the even-indexed value in the low nibble.

Values already on the MXFP4 grid (an expert of the dequantized base) come back unchanged.
"""

from __future__ import annotations

from tui_merger.core.errors import MergeError
from tui_merger.core.merge.pairs import PairSource
from tui_merger.core.plan.plan import OutputTensor

GROUP = 32  # values per e8m0 scale
E2M1_MAX = 6.0
# the midpoints between neighbouring e2m1 magnitudes, and whether a value exactly there goes up (to the
# even code above: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4) or stays (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4)
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def keep_mxfp4(plan, base):
    """The plan's tensors written as the MXFP4 base stores them: untouched experts as stored (blocks and
    scales), changed ones quantized again, everything else as the plain output; quantization_config kept."""
    requant = Mxfp4RequantSource()
    out = []
    for t in plan.tensors:
        pair = _stored_pair(base, t.source)
        if pair is None:
            out.append(t)
        elif not t.ops:  # as stored: the packed codes and their exponents
            blocks, scales = pair
            out.append(OutputTensor(t.name + "_blocks", blocks, blocks.dtype, tuple(blocks.shape)))
            out.append(OutputTensor(t.name + "_scales", scales, scales.dtype, tuple(scales.shape)))
        else:
            out += requant.add(t)
    return out, {"quantization_config": base.quantization_config}


def _stored_pair(base, ref):
    """(blocks ref, scales ref) behind one of the base's dequantized experts, else None."""
    if ref.source is not base:
        return None
    return base._scales.get((ref.file, ref.name))


class Mxfp4RequantSource(PairSource):
    """The blocks and scales of re-quantized experts: the merged 16-bit parameter computed once and
    quantized for both (``pairs.PairSource`` keeps the one asked second)."""

    computes = True  # its tensors are not copies although their dtype is the output's (behaviour.rounded_by_depth)

    def add(self, t) -> list:
        from tui_merger.core.io.sources import TensorRef

        experts, cols, rows = t.shape
        if cols % GROUP:
            raise MergeError(f"{t.name} has {cols} input values per row, not a whole number of MXFP4 groups of "
                             f"{GROUP}, so it cannot be written as MXFP4 again. Nothing was written.")
        b = TensorRef(self, "", t.name + "_blocks", "uint8", (experts, rows, cols // GROUP, GROUP // 2))
        s = TensorRef(self, "", t.name + "_scales", "uint8", (experts, rows, cols // GROUP))
        self.weights[b.name] = self.weights[s.name] = t
        return [OutputTensor(b.name, b, b.dtype, b.shape), OutputTensor(s.name, s, s.dtype, s.shape)]

    def _pair(self, ref) -> dict:
        import torch

        from tui_merger.core.merge.merge_math import ExpertBlocks, Workspace, compute, row_blocks

        t = self.weights[ref.name]
        merged = row_blocks(t, Workspace())
        if not isinstance(merged, ExpertBlocks):  # not one LoRA on packed experts: merged whole
            blocks, scales = quantize_mxfp4(compute(t), t.name)
            return {t.name + "_blocks": blocks, t.name + "_scales": scales}
        experts, cols, rows = t.shape
        blocks = torch.empty(experts, rows, cols // GROUP, GROUP // 2, dtype=torch.uint8)
        scales = torch.empty(experts, rows, cols // GROUP, dtype=torch.uint8)
        for i, j, acc in merged:  # a few experts at a time, rounded as the 16-bit output holds them
            part = acc.view(j - i, *merged.inner).to(getattr(torch, t.dtype))
            blocks[i:j], scales[i:j] = quantize_mxfp4(part, t.name)
        return {t.name + "_blocks": blocks, t.name + "_scales": scales}


def quantize_mxfp4(w, name: str = "the weight"):
    """(blocks uint8 [experts, out, in/32, 16], scales uint8 [experts, out, in/32]) of ``w`` [experts, in,
    out] (GPT-OSS's experts as transformers keeps them), by the rules in this module's docstring. One
    expert and a block of its rows at a time: a few MB of fp32 beside the output."""
    import torch

    from tui_merger.core.formats.dequant import ROW_VALUES

    experts, cols, rows = w.shape
    groups = cols // GROUP
    blocks = torch.empty(experts, rows, groups, GROUP // 2, dtype=torch.uint8)
    scales = torch.empty(experts, rows, groups, dtype=torch.uint8)
    step = max(1, ROW_VALUES // max(cols, 1))
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            x = w[e, :, r0:r1].T.to(torch.float32).contiguous().view(r1 - r0, groups, GROUP)
            exponent = _scale_exponents(x.abs().amax(dim=-1), name)
            # the values in units of their scale: multiplying by a power of two is exact
            units = x * torch.exp2(127.0 - exponent.to(torch.float32))[..., None]
            magnitude = units.abs()
            codes = torch.zeros(units.shape, dtype=torch.uint8)
            for mid, tie_up in _MIDPOINTS:
                codes += (magnitude >= mid) if tie_up else (magnitude > mid)
            codes += torch.signbit(units).to(torch.uint8) << 3
            blocks[e, r0:r1] = codes[..., 0::2] | (codes[..., 1::2] << 4)
            scales[e, r0:r1] = exponent
    return blocks, scales


def _scale_exponents(amax, name: str):
    """The biased e8m0 exponent per group: that of the power of two at or above fp32(amax / 6)."""
    import torch

    if not bool(torch.isfinite(amax).all()):
        raise MergeError(f"The merged {name} holds NaN or Inf values, which MXFP4 cannot store; check the adapter's "
                         "weights.")
    bits = (amax / E2M1_MAX).view(torch.int32)  # non-negative: the sign bit is clear
    biased, mantissa = bits >> 23, bits & 0x7FFFFF
    # up to the next power of two unless already one; a subnormal quotient goes to 2**-126 (byte 1)
    return (biased + (mantissa != 0).to(torch.int32)).to(torch.uint8)
