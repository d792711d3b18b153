"""The recompute check: every output tensor against an independent fp32 recomputation from the
inputs (``_Recompute``, run by verification), and the same check made while the merge writes
(``WhileWriting``: each tensor as soon as its bytes are in its shard, on one core, results kept
for the verification that follows)."""

from __future__ import annotations

import math
import os
import queue
import threading
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io import libc
from tui_merger.core.events import CancelToken, EventSink, TensorProgress
from tui_merger.core.verify.report import Check

SAMPLE_LIMIT = 1 << 24  # values in a tensor above which adapters of rank > FULL_RANK are sampled
FULL_RANK = 256  # summed LoRA rank up to which every row is recomputed (the product costs less than the read)
SAMPLE_ROWS = 64
BLOCK_VALUES = 1 << 18  # values recomputed at a time: a block stays in the CPU cache
PROBE_SEED = 20261130
_MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}


def _sample_rows(name: str, n_rows: int):
    import torch

    g = torch.Generator().manual_seed(PROBE_SEED + sum(name.encode()))
    return torch.randperm(n_rows, generator=g)[: min(SAMPLE_ROWS, n_rows)].sort().values


class _Recomputation:
    """fp32 recomputation of one output tensor from its inputs, independent of the engine's fast
    paths: float(W) + s * (B @ A) per op, in order, as peft defines the merge. The inputs are read
    once; ``rows`` (a slice or an index tensor) gives any part of the result."""

    def __init__(self, t) -> None:
        from tui_merger.core.plan.plan import BiasOp, ExpertsLoraOp, LoraOp

        from tui_merger.core.verify.dequant_ref import independent_ref

        self.t = t
        # a base released quantized is dequantized by the format's own code here, not by the merge's
        self.source = source = independent_ref(t.source)
        load = getattr(source.source, "load_experts", None)
        if load is not None and len(t.ops) == 1 and isinstance(t.ops[0], ExpertsLoraOp):
            # packed experts of a base released quantized: dequantized a block of experts at a time
            self._experts, self.w = (lambda rows: load(source, rows.start, rows.stop)), None
        else:
            self._experts, self.w = None, source.load()
        self.ops = []
        for op in t.ops:
            if isinstance(op, ExpertsLoraOp):
                self.ops.append((op, op.A.load().float(), op.B.load().float(), None))
            elif isinstance(op, LoraOp):
                mag = op.magnitude.load().float().reshape(-1) if op.magnitude is not None else None
                self.ops.append((op, op.A.load().float(), op.B.load().float(), mag))
            elif isinstance(op, BiasOp):
                self.ops.append((op, op.bias.load().float(), None, None))
            else:
                self.ops.append((op, op.rows.load().float(), None, None))
        plain = len(self.ops) == 1 and type(self.ops[0][0]) is LoraOp and self.ops[0][3] is None
        plain = plain and not self.ops[0][0].transpose and self.w is not None and self.w.dim() == 2
        self._plain = (self.ops[0][0], self.ops[0][1], self.ops[0][2]) if plain else None

    def rows(self, rows):
        """The recomputation of ``rows`` in fp32. The result of a row slice of a plain LoRA (the
        common case) lives in the thread's scratch buffer, which the next call reuses (``_scratch``)."""
        import torch

        from tui_merger.core.plan.plan import BiasOp, ExpertsLoraOp, LoraOp

        if isinstance(rows, slice) and self._plain is not None:
            op, a, b = self._plain
            n = len(range(*rows.indices(self.w.shape[0])))
            acc = _scratch(torch.float32, (n, self.w.shape[1]), "recomputed")
            acc.copy_(self.w[rows])
            if _exact_scale(op.scale):
                return acc.addmm_(b[rows], a, alpha=op.scale)  # float(W) + s * (B @ A), as torch.addmm
            delta = torch.mm(b[rows], a, out=_scratch(torch.float32, tuple(acc.shape), "delta"))
            return acc.add_(delta.mul_(op.scale))
        acc = self._base(rows).float()
        if self.w is not None and acc.data_ptr() == self.w.data_ptr():
            acc = acc.clone()  # fp32 input: never write into the memory-mapped file
        kernel = None
        if acc.dim() > 2 and any(type(op) is LoraOp for op, *_ in self.ops):
            kernel, acc = acc.shape, acc.reshape(acc.shape[0], -1)  # a convolution kernel as a matrix
        for op, x, y, mag in self.ops:
            if isinstance(op, ExpertsLoraOp):  # rows are experts here
                acc = acc + op.delta(x, y, rows)
            elif isinstance(op, LoraOp):
                a, b = x, y
                if op.transpose:
                    v = acc + (b @ (a if rows is None else a[:, rows])).T * op.scale
                elif _exact_scale(op.scale):  # one fused pass: acc + s * (B @ A)
                    v = torch.addmm(acc, b if rows is None else b[rows], a, alpha=op.scale)
                else:
                    v = acc + ((b if rows is None else b[rows]) @ a) * op.scale
                if mag is not None:
                    v_rows = v.T if op.transpose else v
                    m = mag[rows] if rows is not None and not op.transpose else mag
                    factor = (m / torch.linalg.vector_norm(v_rows, dim=1)).view(-1, 1)
                    v = factor.T * v if op.transpose else factor * v
                acc = v
            elif isinstance(op, BiasOp):
                acc = acc + x * op.scale
            else:
                index = torch.arange(self.w.shape[0])[rows] if rows is not None else None
                for j, target in enumerate(op.indices):
                    if index is None:
                        acc[target] = x[j]
                    else:
                        hit = (index == target).nonzero()
                        if len(hit):
                            acc[hit[0, 0]] = x[j]
        return acc if kernel is None else acc.reshape(kernel)

    def _base(self, rows):
        """The base's values of ``rows`` (all for None)."""
        if self.w is None:
            return self.source.load() if not isinstance(rows, slice) else self._experts(rows)
        return self.w if rows is None else self.w[rows]

    def magnitude(self, rows):
        """What fp32 rounding of the recomputation scales with, per value: |W| + sum of s * (|B| @ |A|)
        of the LoRA ops, times (terms + 2) (the classic bound of a dot product's rounding error)."""
        from tui_merger.core.plan.plan import ExpertsLoraOp, LoraOp

        mag = self._base(rows).float().abs()
        terms = 0
        for op, a, b, _ in self.ops:
            if isinstance(op, ExpertsLoraOp):
                mag = mag + abs(op.delta(a.abs(), b.abs(), rows))
                terms += a.shape[0] // op.experts
            elif isinstance(op, LoraOp) and (len(self.t.shape) == 2 or not op.transpose):
                a, b = a.abs(), b.abs()
                if op.transpose:
                    delta = (b @ (a if rows is None else a[:, rows])).T
                else:
                    delta = (b if rows is None else b[rows]) @ a
                mag = mag + (delta * abs(op.scale)).reshape(mag.shape)  # a convolution kernel: its shape
                terms += a.shape[0]
        return mag * (terms + 2)

    def release(self) -> None:
        for ref in self.t.inputs():
            ref.release()


def _exact_scale(scale: float) -> bool:
    """Scaling by ``scale`` is exact in floating point (a power of two): s * (B @ A) fused into one
    addmm gives the same bits as the product, then the scaling, then the sum. Any other scale is
    applied in that order, as peft does: fused, 1 in 100-1000 values landed one unit apart, each
    block with one then took the slow path of ``_mismatches`` (a 3B merge with lora_alpha 24, r 16:
    verification 2x slower)."""
    from tui_merger.core.merge.merge_math import _power_of_two

    return _power_of_two(scale)


def _sampled(t) -> bool:
    """Whether only a sample of rows is recomputed: a product of high-rank adapters costs more than
    reading the tensor (every row is recomputed up to a summed rank of FULL_RANK)."""
    from tui_merger.core.plan.plan import BiasOp, LoraOp

    if len(t.shape) < 2 or math.prod(t.shape) <= SAMPLE_LIMIT:
        return False
    if any(isinstance(op, BiasOp) or (isinstance(op, LoraOp) and op.magnitude is not None and op.transpose) for op in t.ops):
        return False  # needs whole columns
    rank = sum(op.A.shape[0] for op in t.ops if isinstance(op, LoraOp))
    return rank > FULL_RANK


def _whole(t) -> bool:
    """DoRA on a transposed (fan_in_fan_out) weight normalises columns: recomputed in one piece."""
    from tui_merger.core.plan.plan import LoraOp

    return any(isinstance(op, LoraOp) and op.magnitude is not None and op.transpose for op in t.ops)


def _bits_equal(a, b) -> bool:
    """Same bytes: memcmp where both are contiguous CPU tensors of one dtype (15x faster than
    torch.equal on 2^18 bf16 values, which was a third of the recompute's time at 3B shapes),
    else torch.equal on integer views."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return torch.equal(a, b)
    if a.is_contiguous() and b.is_contiguous() and a.device.type == b.device.type == "cpu" and _memcmp():
        if not a.numel():
            return True
        return _memcmp()(a.data_ptr(), b.data_ptr(), a.numel() * a.element_size()) == 0
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if ints is None or not a.is_contiguous() or not b.is_contiguous():
        return torch.equal(a, b)
    return torch.equal(a.view(ints), b.view(ints))


def _memcmp():
    """The C library's memcmp (None where there is none to load)."""
    return libc.function("memcmp", "c_int", "c_void_p", "c_void_p", "c_size_t")


def _mismatches(got, want, magnitude=None, scratch=None) -> int:
    """Elements of ``got`` further from ``want`` (fp32) than rounding explains: one unit in the last
    place of got's dtype, or, where terms nearly cancel, the fp32 rounding of the sum (2^-24 of
    ``magnitude()``: the engine may add in another order or block the product otherwise). Equal
    elements, the common case, cost one comparison. ``scratch``: where to round want to got's dtype
    (a ``_scratch`` buffer) instead of a fresh tensor."""
    import torch

    rounded = want.to(got.dtype) if scratch is None else scratch.copy_(want)
    if _bits_equal(got, rounded):
        return 0
    differ = got != rounded
    g, w = got[differ].float(), rounded[differ].float()
    bits = _MANTISSA_BITS.get(str(got.dtype).removeprefix("torch."))
    if bits is None:
        return int(differ.sum())
    _, exp = torch.frexp(w)
    ulp = torch.ldexp(torch.ones_like(w), exp - 1 - bits)
    tiny = 2.0**-24 if got.dtype == torch.float16 else 2.0**-126
    tol = torch.clamp(ulp, min=tiny) * (4 if got.dtype == torch.float32 else 1)  # fp32 sums differ in order
    if magnitude is not None:
        tol = torch.maximum(tol, magnitude()[differ] * 2.0**-24)
    return int(((g - w).abs() > tol).sum())


def _compare(got, want, magnitude=None) -> tuple[int, bool]:
    """(``_mismatches(got, want)``, whether got holds no NaN or Inf) for a block of a recomputed
    tensor. In the common case got's bytes are want rounded to got's dtype, just written to the
    thread's scratch buffer and still in the cache, and the test for NaN and Inf reads those
    instead of got's memory (aminmax over a 3B model's output: ~1 CPU-second)."""
    rounded = _scratch(got.dtype, tuple(want.shape), "rounded").copy_(want)
    if _bits_equal(got, rounded):
        return 0, _finite(rounded)
    return _mismatches(got, want, magnitude, rounded), _finite(got)


def _converted_mismatches(got, piece, clamp: bool) -> tuple[int, float]:
    """(values of ``got`` not ``piece`` converted to got's dtype, their largest difference), a block
    of rows at a time, rounded into the thread's scratch buffer: a whole piece converted at once was
    a fresh tensor of up to 70 MB per rank shard of a 0.5B embedding."""
    bad, diff = 0, 0.0
    for rows in _row_blocks(tuple(piece.shape), BLOCK_VALUES * 4) if piece.dim() else [None]:
        want = piece if rows is None else piece[rows]
        g = got if rows is None else got[rows]
        if clamp:
            want = want.float().clamp(-65504.0, 65504.0)
        n = _mismatches(g, want, scratch=_scratch(g.dtype, tuple(want.shape), "rounded") if want.dim() else None)
        if n:
            bad += n
            diff = max(diff, (g.float() - want.float()).abs().max().item())
    return bad, diff


_SCRATCH = threading.local()


def _scratch(dtype, shape: tuple, use: str):
    """A tensor of ``shape`` over this thread's buffer for ``use`` (grown when too small, else
    reused): the recompute's blocks in fresh tensors made glibc hand their memory back and fault it
    in again for every block, a third of its CPU time at 3B shapes (on a VM that returns freed memory
    to its host). Valid until the thread's next call for the same use."""
    import torch

    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    numel = math.prod(shape)
    flat = buffers.get((use, dtype))
    if flat is None or flat.numel() < numel:
        flat = buffers[(use, dtype)] = torch.empty(max(numel, 1), dtype=dtype)
    return flat[:numel].view(shape)


def _row_blocks(shape, values: int | None = None):
    """Row slices of about ``values`` values each (None for a 0-d tensor), none of a single row where
    the tensor has more (``merge_math.row_spans``: BLAS computes a one-row product with another
    kernel, whose sums land an fp32 unit off the whole-matrix product's, and such a row took the
    tolerance path)."""
    from tui_merger.core.merge.merge_math import row_spans

    if not shape:
        return [None]
    row = max(1, math.prod(shape[1:]))
    step = max(2, (BLOCK_VALUES if values is None else values) // row)
    return [slice(i, j) for i, j in row_spans(shape[0], step)] or [slice(0, 0)]


def _finite(x) -> bool:
    """No NaN or Inf: min and max propagate both (50x faster than isfinite on bf16). A bf16 or fp32
    tensor is summed first: a NaN or an Inf anywhere makes the sum NaN or Inf, so a finite sum
    proves every value finite, and a sum that is not (also finite values overflowing it) takes the
    exact test. The sum is 2.6x faster than aminmax on a block in the cache and 1.5x on one in
    memory (fp16 sums overflow too soon to be worth it)."""
    import torch

    if not x.is_floating_point() or not x.numel():
        return True
    if x.element_size() == 1:  # FP8 (no aminmax for it): its values are exact in fp32
        x = x.float()
    if x.dtype in (torch.bfloat16, torch.float32) and math.isfinite(x.sum().item()):
        return True
    low, high = torch.aminmax(x)
    return math.isfinite(low.item()) and math.isfinite(high.item())


class _Recompute:
    """Every output tensor against its recomputation, a cache-sized block of rows at a time: the
    output is read through memory maps whose pages are handed back after each tensor, so memory
    stays at a few blocks whatever the model's size. The tensors are a queue that any number of
    threads take from (``work``); ``check()`` sums up what they found."""

    def __init__(self, out: Path, plan, files: dict, on_event: EventSink, clamp: bool = False,
                 early: "WhileWriting | None" = None, key: str = "") -> None:
        import threading

        from tui_merger.core.io.sources import TensorSource

        self.plan, self.files, self.on_event, self.clamp = plan, files, on_event, clamp
        self.total = len(plan.tensors)
        self.total_bytes = sum(t.nbytes for t in plan.tensors)
        self.done, self.done_bytes = 0, 0
        self.found: dict[int, tuple] = {}  # index -> (problem, sampled, nonfinite, unchanged)
        self.unreadable: str | None = None
        self._next = 0
        self._lock = threading.Lock()
        try:
            self.stored = TensorSource(out, sorted(set(files.values())))
        except MergeError as err:  # the library read the headers; ours is stricter
            self.stored = None
            self.unreadable = f"the weight files cannot be read for recomputation: {err}"
        # checked while the merge wrote them, in these very files
        self.reused = early.results_for(out, key, self.stored) if early is not None and self.stored is not None else {}

    @property
    def remaining(self) -> int:
        """Tensors left to recompute (none were checked while the merge wrote them)."""
        if self.stored is None:
            return 0
        return sum(1 for t in self.plan.tensors if t.name in self.files and t.name not in self.reused)

    def work(self, cancel: CancelToken, until=None) -> None:
        """Check tensors from the queue until it is empty, or ``until`` (a threading.Event) is set
        (several threads may call this)."""
        while (until is None or not until.is_set()) and self.work_one(cancel):
            pass

    def work_one(self, cancel: CancelToken) -> bool:
        """Check the next tensor of the queue; False when it was empty."""
        if self.stored is None:
            return False
        cancel.raise_if_cancelled()
        with self._lock:
            i = self._next
            self._next += 1
        if i >= self.total:
            return False
        t = self.plan.tensors[i]
        if t.name in self.files:
            reused = self.reused.get(t.name)
            self.found[i] = reused if reused is not None else _check_tensor(t, self.stored.tensors[t.name], self.clamp)
        with self._lock:
            self.done += 1
            self.done_bytes += t.nbytes
            progress = TensorProgress(t.name, min(self.done, self.total), self.total, self.done_bytes, self.total_bytes)
        self.on_event(progress)
        return True

    def close(self) -> None:
        if self.stored is not None:
            self.stored.close()
        libc.trim_heap()

    def check(self) -> Check:
        if self.unreadable:
            return Check("recompute", "fail", self.unreadable)
        found = [self.found[i] for i in sorted(self.found)]
        problems = [f[0] for f in found if f[0]]
        sampled = [f[1] for f in found if f[1]]
        nonfinite = [f[2] for f in found if f[2]]
        unchanged = [f[3] for f in found if f[3]]
        total = self.total
        details = problems[:50] + [f"{n}: holds NaN or Inf" for n in nonfinite[:20]]
        if unchanged:
            details.append(
                f"{len(unchanged)} tensor(s) the adapter changes hold the base's values unchanged ({unchanged[0]}, ...): "
                "the adapter looks not (or wrongly) applied"
            )
        metrics = {"tensors": total, "sampled_tensors": len(sampled), "sample_rows": SAMPLE_ROWS, "full_rank": FULL_RANK,
                   "unchanged_by_adapter": len(unchanged),
                   "checked_while_writing": sum(1 for t in self.plan.tensors if t.name in self.reused)}
        if problems or nonfinite:
            return Check("recompute", "fail", f"{len(problems) + len(nonfinite)} of {total} tensors are wrong", details, metrics)
        how = (
            f"; {len(sampled)} tensors of adapters above rank {FULL_RANK} on {SAMPLE_ROWS} random rows each"
            if sampled else ", every value"
        )
        return Check("recompute", "pass", f"all {total} tensors equal the recomputation from the inputs{how}", [], metrics)


def _check_tensor(t, ref, clamp: bool) -> tuple:
    """(problem or None, name if sampled, name if NaN/Inf, name if the adapter left it unchanged)."""
    problem = sampled = unchanged = None
    # a recomputed tensor is read a block of rows at a time, each block's pages mapped in one call and
    # handed back after it (a 70B model's MLP weight and its output are 470 MB each)
    by_rows = bool(t.ops) and not _sampled(t) and not t.raw_copy and not _whole(t) and bool(t.shape)
    from tui_merger.core.verify.dequant_ref import independent_ref

    # a base released quantized: dequantized by the format's own code; a checkpoint's tensor in its
    # shards: a source that reads them two ways gives the check its own
    source = independent_ref(t.source)
    pieces = None if t.ops else getattr(source.source, "check_blocks", source.source.row_blocks)(source)
    if not _sampled(t) and not t.raw_copy and pieces is None:  # read whole: mapped in one call
        for x in t.inputs()[1:] if by_rows else (ref, *t.inputs()):
            x.prefetch()
    got_all = ref.load()
    finite = True
    if pieces is not None:  # a checkpoint's tensor in its shards: one shard (and its output rows) at a time
        bad, diff, start = 0, 0.0, 0
        for piece, release in pieces:
            stop = start + (piece.shape[0] if piece.dim() else 1)
            if piece.dim():  # never the whole output tensor mapped (a 3B embedding is 622 MB in bf16)
                ref.prefetch_rows(start, stop)
            got = got_all[start:stop] if piece.dim() else got_all
            finite = finite and _finite(got)
            if piece.dtype != got.dtype or clamp:  # converted (fp32 training weights -> bf16)
                n, d = _converted_mismatches(got, piece, clamp)
            else:
                n = 0 if _bits_equal(got, piece) else 1
                d = (got.float() - piece.float()).abs().max().item() if n else 0.0
            bad, diff = bad + n, max(diff, d)
            release()
            ref.release_rows(start, stop)
            start = stop
        if bad or start != (t.shape[0] if t.shape else 1):
            problem = f"{t.name}: {bad} of {math.prod(t.shape)} values differ from the checkpoint (max {diff:.3g})"
    elif t.raw_copy:  # compared a block at a time, each block's pages handed back (an embedding is GBs)
        src = source.load()
        equal = True
        for rows in _row_blocks(t.shape, BLOCK_VALUES * 16):
            got = got_all if rows is None else got_all[rows]
            finite = finite and _finite(got)
            equal = equal and _bits_equal(got, src if rows is None else src[rows])
            if rows is not None:
                ref.release_rows(rows.start, rows.stop)
                t.source.release_rows(rows.start, rows.stop)
        if not equal:
            what = ("the merged weight quantized again" if getattr(t.source.source, "computes", False)
                    else "the input it was copied from")
            problem = f"{t.name}: differs from {what}"
        for x in t.inputs():
            x.release()
    else:
        r = _Recomputation(t)
        bad, diff = 0, 0.0
        if _sampled(t):
            sampled = t.name
            blocks = [_sample_rows(t.name, t.shape[0])]
        else:
            blocks = [None] if _whole(t) else _row_blocks(t.shape)
        for rows in blocks:
            if by_rows:
                ref.prefetch_rows(rows.start, rows.stop)
                t.source.prefetch_rows(rows.start, rows.stop)
            got = got_all if rows is None else got_all[rows]
            want = r.rows(rows)
            if clamp:  # --force: values beyond fp16's range were clamped on purpose
                want = want.clamp(-65504.0, 65504.0)
            n, block_finite = _compare(got, want, lambda: r.magnitude(rows))
            finite = finite and block_finite
            if n:
                bad += n
                diff = max(diff, (got.float() - want.to(got.dtype).float()).abs().max().item())
            if by_rows:
                ref.release_rows(rows.start, rows.stop)
                t.source.release_rows(rows.start, rows.stop)
        r.release()
        if bad:
            problem = f"{t.name}: {bad} of {math.prod(t.shape)} values differ from the recomputation (max {diff:.3g})"
            if t.ops and _bits_equal(got_all, source.load().to(got_all.dtype).contiguous()):
                unchanged = t.name
    del got_all
    ref.release()
    return problem, sampled, None if finite else t.name, unchanged


# -- while the merge writes ---------------------------------------------------------------------


class _Shard:
    """A shard the merge is writing, as the checks see it: its own descriptor and parsed header."""

    def __init__(self, path: str) -> None:
        from tui_merger.core.io.safetensors_io import SafetensorsFile

        self.path = Path(path)
        header = SafetensorsFile(self.path, growing=True)
        self.tensors = header.tensors
        header.close()
        self.fd = os.open(self.path, os.O_RDONLY)
        self.written = 0
        self.final: tuple | None = None  # (device, inode, size, mtime) once every tensor is in

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def file_identity(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _WrittenRef:
    """One tensor of a shard being written, with the interface ``_check_tensor`` reads through."""

    def __init__(self, shard: _Shard, info) -> None:
        from tui_merger.core.io.mapped import MappedRange

        self.name, self.dtype, self.shape = info.name, info.dtype, info.shape
        self._range = MappedRange(shard.fd, info.start, info.nbytes)
        self._row = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0

    def prefetch(self) -> None:
        self._range.populate()

    def prefetch_rows(self, start: int, stop: int) -> None:
        self._range.populate(start * self._row, stop * self._row)

    def load(self):
        return self._range.view(self.dtype, self.shape)

    def release_rows(self, start: int, stop: int) -> None:
        self._range.release(start * self._row, stop * self._row)

    def release(self) -> None:
        self._range.close()


def writing_key(options) -> str:
    """What the recompute depends on: the options (the inputs, dtype, shards)."""
    import json
    from dataclasses import asdict

    return json.dumps(asdict(options), sort_keys=True, default=str)


class WhileWriting:
    """The recompute of each tensor as soon as the merge has written it (``TensorWritten``), on one
    thread while the merge writes the next: the output's bytes come from the page cache the writer
    has just filled, the inputs' from the merge's own reads. Verification takes a tensor's result
    only from the very file that was checked (same device, inode, size and modification time as
    when the merge had written all of it, the tensor at the same place); it recomputes the rest.

    The thread opens the inputs and builds the plan itself, as verification does, and stops when
    the merge ends (its partial files removed), when verification takes the results, or when told."""

    def __init__(self, options) -> None:
        self.key = writing_key(options)
        self.options = options
        self.found: dict[str, tuple] = {}  # name -> (result of _check_tensor, shard file name, start, end)
        self.final: dict[str, tuple] = {}  # shard file name -> identity when every tensor was written
        self._shards: dict[str, _Shard] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # called by the merge's event sink, on the merge's thread
    def written(self, path: str, name: str) -> None:
        if self._stop.is_set() or (self._thread is not None and not self._thread.is_alive()):
            return
        shard = self._shards.get(path)
        try:
            if shard is None:
                with self._lock:
                    shard = self._shards[path] = _Shard(path)
            shard.written += 1
            if shard.written == len(shard.tensors):  # every write has returned: the file is final
                shard.final = file_identity(os.fstat(shard.fd))
                self.final[shard.path.name] = shard.final
        except (OSError, MergeError, TypeError):  # (TypeError: closed as the thread stopped) verification recomputes it
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tui-merger-recompute", daemon=True)
            self._thread.start()
        self._jobs.put((shard, name))

    def merge_ended(self) -> None:
        """No more tensors come: the thread finishes its queue, then closes what it opened."""
        self._jobs.put(None)
        if self._thread is None:
            self._close()

    def take(self) -> "WhileWriting":
        """Stop after the tensor being checked (verification recomputes the rest) and wait."""
        self._stop.set()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join()
        self._close()
        return self

    def _close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.close()

    def _run(self) -> None:
        import torch

        from tui_merger.core.formats.adapter import empty_adapter
        from tui_merger.core.formats.inputs import open_inputs
        from tui_merger.core.merge.requant import output_plan
        from tui_merger.core.verify.parallel import threads_per_job

        torch.set_num_threads(threads_per_job(2))  # the merge keeps the other half of the cores
        inputs = None
        try:
            options = self.options
            inputs = open_inputs(options)
            adapter = empty_adapter(inputs.adapter.folder) if options.export_adapter else inputs.adapter
            plan = output_plan(inputs.base, adapter, {**inputs.config, **inputs.config_changes},
                              options.dtype or inputs.dtype, options.shard_size)
            clamp = options.force_fp16_overflow and any(t.dtype == "float16" for t in plan.tensors)
            planned = {t.name: t for t in plan.tensors}
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=0.5)
                except queue.Empty:
                    if any(s.fd is not None and os.fstat(s.fd).st_nlink == 0 for s in self._shards.values()):
                        return  # the merge stopped and removed its partial folder
                    continue
                if job is None:
                    return
                shard, name = job
                t, info = planned.get(name), shard.tensors.get(name)
                if t is None or info is None or info.dtype != t.dtype or tuple(info.shape) != tuple(t.shape):
                    continue  # verification's structure check says what is wrong
                result = _check_tensor(t, _WrittenRef(shard, info), clamp)
                self.found[name] = (result, shard.path.name, info.start, info.end)
        except BaseException as err:  # noqa: BLE001 - verification recomputes everything itself
            self.error = err
        finally:
            self._close()  # verification reads the finished files itself; a stopped merge's space goes back
            if inputs is not None:
                inputs.close()
            libc.trim_heap()

    def results_for(self, out: Path, key: str, stored) -> dict[str, tuple]:
        """The results verification may use for ``out``: name -> result of ``_check_tensor``."""
        if key != self.key or self.error is not None:
            return {}
        same = {}
        for fname, identity in self.final.items():
            try:
                same[fname] = file_identity(os.stat(out / fname)) == identity
            except OSError:
                same[fname] = False
        usable = {}
        for name, (result, fname, start, end) in self.found.items():
            if same.get(fname) and stored is not None and stored.place(name) == (fname, start, end):
                usable[name] = result
        return usable
