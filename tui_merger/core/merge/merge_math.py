"""The arithmetic of a merge, as peft defines it (see peft's LoRA ``merge``): fp32 compute, one rounding.

- linear:      W' = W + s * (B @ A)            (transposed for fan_in_fan_out)
- embedding:   E' = E + s * (B_e @ A_e)^T
- DoRA:        V = W + s * (B @ A);  W' = (m / ||V||_row) * V
- lora_bias:   b' = b + s * b_B
- token rows:  rows at the given indices are replaced
Untouched tensors only pass through here to change dtype; otherwise their bytes are copied.
"""

from __future__ import annotations

import math

from tui_merger.core.plan.plan import BiasOp, ExpertsLoraOp, LoraOp, OutputTensor, RowsOp

FP16_MAX = 65504.0


def threads_per_job(jobs: int) -> int:
    """torch threads for each of ``jobs`` running at once: the cores shared out (one each on 2 cores)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(jobs, 1))


def _lora_delta(op: LoraOp):
    """scale * (B @ A) in fp32, laid out like the base weight (a view when transposed)."""
    a = op.A.load().float()
    b = op.B.load().float()
    delta = b @ a
    delta.mul_(op.scale)
    return delta.T if op.transpose else delta


def _power_of_two(x: float) -> bool:
    mantissa, _ = math.frexp(x)
    return x > 0 and mantissa == 0.5


class Workspace:
    """Reusable scratch buffers. Fresh multi-MB allocations cost page faults on every tensor (they
    doubled the merge time); reusing two buffers sized to the largest merged tensor avoids that and
    keeps memory bounded by one tensor, whatever the model size."""

    def __init__(self) -> None:
        self._buffers: dict[str, object] = {}
        self._partner: Workspace | None = None

    def partner(self) -> "Workspace":
        """A second workspace kept with this one (the writer's other turn)."""
        if self._partner is None:
            self._partner = Workspace()
        return self._partner

    def get(self, key: str, shape, dtype):
        import torch

        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[key] = buf
        return buf[:nbytes].view(dtype).view(shape)


def _fast_linear(t: OutputTensor, ws: Workspace, clamp: bool):
    """The common case, one plain LoRA on a matrix: W' = round(float(W) + s * (B @ A)) computed in
    reused buffers. When s is a power of two it is folded into B (exact: scaling by 2^k commutes with
    rounding, barring fp32 subnormal products below 1e-38), so one addmm does the product and the
    sum; else mm, mul and add as peft does. addmm adds W after summing the products, as peft's
    separate add does; the tests compare with peft bit for bit on the machine's own BLAS. The engine
    takes the common 16-bit case from a mapped file a block of rows at a time instead (``row_blocks``),
    never whole."""
    import torch

    out_dtype = getattr(torch, t.dtype)
    op = t.ops[0]
    a = op.A.load().float()
    b = op.B.load().float()
    acc = ws.get("acc", t.source.shape, torch.float32)
    t.source.load_into(acc)
    if _power_of_two(op.scale):
        acc.addmm_(b * op.scale, a)
    else:
        delta = ws.get("delta", t.source.shape, torch.float32)
        torch.mm(b, a, out=delta)
        delta.mul_(op.scale)
        acc.add_(delta)
    if clamp:
        acc.clamp_(-FP16_MAX, FP16_MAX)
    if out_dtype == torch.float32:
        return acc
    out = ws.get("out", t.source.shape, out_dtype)
    out.copy_(acc)
    return out


BLOCK_VALUES = 1 << 18  # fp32 values computed at a time by the blocked path (1 MiB: stays in cache)


def _mapped(ref) -> bool:
    """The tensor is a zero-copy view of a safetensors file (a base model's weight)."""
    place = getattr(ref.source, "place", None)
    return place is not None and place(ref.name) is not None


def block_rows(cols: int) -> int:
    """Rows of a ``cols``-wide weight that the blocked path computes at a time (at least two)."""
    import torch

    return max(2, BLOCK_VALUES * torch.get_num_threads() // max(cols, 1))


def row_spans(rows: int, step: int):
    """``(i, j)`` row ranges of ``step`` rows covering ``rows``, none of one row unless ``rows`` is 1:
    the last block, when one row would be left, takes it (``step + 1`` rows). A one-row product goes
    through BLAS's matrix-vector kernel, which sums in another order than the matrix-matrix kernel
    that peft's whole-tensor ``B @ A`` takes: a 3B model's 2048x11008 down_proj, 23 rows a block,
    got its last row one fp32 unit off peft's."""
    ends = list(range(step, rows, step)) + [rows]
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:
        del ends[-2]
    start = 0
    for end in ends:
        yield start, end
        start = end


class RowBlocks:
    """``row_blocks``' iterator: ``(first row, end row, fp32 block)`` of W + s * (B @ A), a
    cache-sized block of rows at a time (``row_spans``: ``step`` rows each, the last one shorter or
    one longer). The block is a reused buffer, valid until the next one is asked for. With a DoRA
    ``magnitude`` m, each row of V = W + s * (B @ A) is then scaled by m / ||row of V||, as peft's
    merge does: a Linear's weight norm is taken per output row, so rows need no other rows."""

    def __init__(self, t: OutputTensor, a, b, ws: Workspace, scale: float | None, magnitude=None,
                 segments=None) -> None:
        import torch

        self.t = t
        self.a, self.b, self.scale, self.magnitude = a, b, scale, magnitude
        if segments is None:  # the weight's rows in one mapped tensor
            self.w = t.source.load()
            self.shape = tuple(self.w.shape)
            self.segments = [(self.w, None)]
        else:  # consecutive row blocks of a tensor held in pieces (a verl FSDP checkpoint's rank shards)
            self.w = None
            self.shape = tuple(t.source.shape)
            self.segments = segments
        self._current = (self.w, 0)
        rows, cols = self.shape
        self.step = block_rows(cols)
        most = min(self.step + 1, rows)  # see row_spans
        self.block = ws.get("block32", (most, cols), torch.float32)
        self.delta = ws.get("delta32", (most, cols), torch.float32) if scale is not None else None

    def source_rows(self, i: int, j: int):
        """Rows [i, j) of the source weight, for the block just yielded."""
        w, start = self._current
        return w[i - start : j - start]

    def __iter__(self):
        import torch

        a, b = self.a, self.b
        start = 0
        for w, release in self.segments:
            self._current = (w, start)
            for i, j in row_spans(w.shape[0], self.step) if w.shape[0] else ():
                acc = self.block[: j - i]
                acc.copy_(w[i:j])
                rows = slice(start + i, start + j)
                if self.scale is None:
                    acc.addmm_(b[rows], a)
                else:
                    d = self.delta[: j - i]
                    torch.mm(b[rows], a, out=d)
                    d.mul_(self.scale)
                    acc.add_(d)
                if self.magnitude is not None:
                    norm = torch.linalg.norm(acc, dim=1)
                    acc.mul_((self.magnitude[rows] / norm).view(-1, 1))
                yield start + i, start + j, acc
            if release is not None:
                release()
            start += w.shape[0]
        if start != self.shape[0]:
            raise RuntimeError(f"{self.t.name}: its pieces hold {start} of {self.shape[0]} rows")


class ExpertBlocks:
    """``row_blocks``' iterator for experts packed in one tensor ([experts, ...], peft
    ``target_parameters``: one ``ExpertsLoraOp``): ``(first expert, end expert, fp32 block)`` of
    W[e] + s * (B_e @ A_e), a few experts at a time (``row_spans``: at least two, so the product takes
    the batched kernel the whole-tensor pass takes), each block flattened to [experts, values per
    expert] in the output's byte order. The base is read a few experts at a time too (``load_experts``
    of a base released quantized: GPT-OSS's MXFP4 experts dequantized only where needed): GPT-OSS-120B's
    gate_up_proj is 4.2 GB in bf16 per layer, and 8.5 GB more in fp32 as one delta."""

    def __init__(self, t: OutputTensor, op, ws: Workspace) -> None:
        import torch

        self.t, self.op = t, op
        self.a, self.b = op.A.load().float(), op.B.load().float()
        shape = tuple(t.source.shape)
        per = math.prod(shape[1:])
        self.inner = shape[1:]
        self.shape = (shape[0], per)
        self.step = _expert_step(per)
        most = min(self.step + 1, shape[0])
        self.block = ws.get("experts32", (most, per), torch.float32)
        self._load = getattr(t.source.source, "load_experts", None)
        self.w = None if self._load is not None else t.source.load()  # mapped: a view, read as it goes
        self._current = None

    def source_rows(self, i: int, j: int):
        """The base's experts [i, j), flattened as the block just yielded."""
        return self._current.reshape(j - i, -1)

    def __iter__(self):
        for i, j in row_spans(self.shape[0], self.step):
            w = self._load(self.t.source, i, j) if self.w is None else self.w[i:j]
            self._current = w
            acc = self.block[: j - i]
            acc.copy_(w.reshape(j - i, -1))
            acc.add_(self.op.delta(self.a, self.b, slice(i, j)).reshape(j - i, -1))
            yield i, j, acc
            if self.w is not None:
                self.t.source.release_rows(i, j)  # a mapped file's pages of these experts go back


def experts_streamed(t: OutputTensor) -> bool:
    """``row_blocks`` merges ``t`` a few experts at a time (``ExpertBlocks``)."""
    return (len(t.ops) == 1 and isinstance(t.ops[0], ExpertsLoraOp) and len(t.source.shape) == 3
            and t.source.dtype in ("bfloat16", "float16", "float32"))


def _expert_step(per: int) -> int:
    """Experts ``ExpertBlocks`` computes at a time, ``per`` values each (``row_spans`` may add one)."""
    return max(2, BLOCK_VALUES * 16 // max(per, 1))


def expert_block_values(shape) -> int:
    """Values of the largest block ``ExpertBlocks`` computes for a packed experts tensor of ``shape``."""
    per = math.prod(shape[1:])
    return min(_expert_step(per) + 1, shape[0]) * per


def row_blocks(t: OutputTensor, ws: Workspace) -> RowBlocks | ExpertBlocks | None:
    """The merged values of a plain LoRA'd 2-D weight read from a mapped file (any output dtype: an
    fp32 one is copied from the block into the writer's piece instead of rounded),
    a block of rows at a time (``RowBlocks``); None when ``t`` is not such a tensor. Each row is W +
    the same rank-r dot product as a whole-tensor pass (bit for bit), but the fp32 values never
    leave the cache and only one block of them is held (a 3B model's 11008x2048 MLP weights: 1 MiB
    instead of 90 MiB; without the power-of-two fold, 1 MiB instead of 180 MiB), and one core does
    it 5x faster than whole-tensor passes. A power-of-two scale is folded into B (one addmm); any
    other scale: mm, mul and add, as peft does. DoRA (not on a transposed, fan_in_fan_out weight,
    whose norm runs over columns) takes mm, mul and add whatever its scale, as peft's merge does,
    then its per-row factor (a 70B model's 28672x8192 MLP weight: 1 MiB blocks instead of two fp32
    buffers of 940 MB in each of the writer's two workspaces)."""
    if not math.prod(t.source.shape):
        return None
    if experts_streamed(t):
        return ExpertBlocks(t, t.ops[0], ws)
    if len(t.source.shape) != 2:
        return None
    op = _row_lora(t)
    if op is None:
        return None
    segments = None
    if not _mapped(t.source):  # rows in pieces (verl FSDP rank shards), or none to read block by block (.bin)
        segments = t.source.source.row_blocks(t.source)
        if not segments:
            return None
    a = op.A.load().float()
    b = op.B.load().float()
    if op.magnitude is not None:  # DoRA
        return RowBlocks(t, a, b, ws, op.scale, op.magnitude.load().float().reshape(-1), segments)
    if _power_of_two(op.scale):
        return RowBlocks(t, a, b * op.scale, ws, None, segments=segments)
    return RowBlocks(t, a, b, ws, op.scale, segments=segments)


def _row_lora(t: OutputTensor) -> LoraOp | None:
    """The one LoRA op (plain or DoRA) of a float weight stored as [out, in], not transposed
    (fan_in_fan_out), whose rows can be merged without the others; else None."""
    if len(t.ops) != 1 or not isinstance(t.ops[0], LoraOp):
        return None
    op = t.ops[0]
    if len(t.source.shape) != 2:  # a convolution kernel: the whole-tensor path
        return None
    return None if op.transpose or t.source.dtype not in ("bfloat16", "float16", "float32") else op


def _is_fast(t: OutputTensor) -> bool:
    op = _row_lora(t)
    return op is not None and op.magnitude is None


def compute(t: OutputTensor, clamp: bool = False, ws: Workspace | None = None):
    """The output tensor, contiguous, in ``t.dtype``. ``clamp`` limits values to the fp16 range.

    With a workspace the result may live in its buffers: write it out before the next call."""
    import torch

    if ws is not None and _is_fast(t):
        return _fast_linear(t, ws, clamp)
    out_dtype = getattr(torch, t.dtype)
    if not t.ops and not clamp:  # a dtype change or a reassembled checkpoint tensor
        out = ws.get("out", t.source.shape, out_dtype) if ws is not None else torch.empty(t.source.shape, dtype=out_dtype)
        t.source.load_into(out)
        return out
    w = t.source.load()
    if not t.ops:
        return w.float().clamp_(-FP16_MAX, FP16_MAX).to(out_dtype)

    acc = None  # fp32 working copy
    for op in t.ops:
        if isinstance(op, LoraOp):
            delta = _lora_delta(op)
            base = w if acc is None else acc
            if delta.dim() != base.dim():  # a convolution kernel merged as a matrix
                delta = delta.reshape(base.shape)
            if op.magnitude is None:
                acc = delta.add_(base)  # == float(W) + delta: the sum peft rounds once
            else:
                v = delta.add_(base)
                v_rows = v.T if op.transpose else v  # [out, in]
                norm = torch.linalg.norm(v_rows, dim=1)
                factor = op.magnitude.load().float() / norm
                factor = factor.view(-1, 1)
                acc = (factor.T if op.transpose else factor) * v
        elif isinstance(op, ExpertsLoraOp):
            base = w if acc is None else acc
            acc = op.delta(op.A.load().float(), op.B.load().float()).add_(base)
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
