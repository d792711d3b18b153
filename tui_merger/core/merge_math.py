"""The arithmetic of a merge, as peft defines it (see peft's LoRA ``merge``): fp32 compute, one rounding.

- linear:      W' = W + s * (B @ A)            (transposed for fan_in_fan_out)
- embedding:   E' = E + s * (B_e @ A_e)^T
- DoRA:        V = W + s * (B @ A);  W' = (m / ||V||_row) * V
- lora_bias:   b' = b + s * b_B
- token rows:  rows at the given indices are replaced
Untouched tensors never pass through here: their bytes are copied.
"""

from __future__ import annotations

from tui_merger.core.plan import BiasOp, LoraOp, OutputTensor, RowsOp

FP16_MAX = 65504.0


def _lora_delta(op: LoraOp):
    """scale * (B @ A) in fp32, laid out like the base weight (a view when transposed)."""
    a = op.A.load().float()
    b = op.B.load().float()
    delta = b @ a
    delta.mul_(op.scale)
    return delta.T if op.transpose else delta


def compute(t: OutputTensor, clamp: bool = False):
    """The output tensor, contiguous, in ``t.dtype``. ``clamp`` limits values to the fp16 range."""
    import torch

    w = t.source.load()
    out_dtype = getattr(torch, t.dtype)
    if not t.ops:
        if clamp:
            return w.float().clamp_(-FP16_MAX, FP16_MAX).to(out_dtype)
        return w.to(out_dtype).contiguous()

    acc = None  # fp32 working copy
    for op in t.ops:
        if isinstance(op, LoraOp):
            delta = _lora_delta(op)
            base = w if acc is None else acc
            if op.magnitude is None:
                acc = delta.add_(base)  # == float(W) + delta: the sum peft rounds once
            else:
                v = delta.add_(base)
                v_rows = v.T if op.transpose else v  # [out, in]
                norm = torch.linalg.norm(v_rows, dim=1)
                factor = op.magnitude.load().float() / norm
                factor = factor.view(-1, 1)
                acc = (factor.T if op.transpose else factor) * v
        elif isinstance(op, BiasOp):
            base = w if acc is None else acc
            acc = op.bias.load().float() * op.scale
            acc.add_(base)
        elif isinstance(op, RowsOp):
            if acc is None:
                acc = w.to(out_dtype, copy=True)
            index = torch.tensor(op.indices, dtype=torch.long)
            acc = acc.index_copy(0, index, op.rows.load().to(acc.dtype))
        else:  # pragma: no cover - a new op type without math is a programming error
            raise TypeError(f"unknown op {op!r}")
    if clamp:
        acc = acc.float().clamp_(-FP16_MAX, FP16_MAX)
    return acc.to(out_dtype, memory_format=torch.contiguous_format)


def fp16_overflows(result, t: OutputTensor) -> bool:
    """True when an fp16 result holds inf that its source did not: values beyond fp16's range."""
    import torch

    if result.dtype != torch.float16 or not torch.isinf(result).any():
        return False
    return not torch.isinf(t.source.load()).any()
