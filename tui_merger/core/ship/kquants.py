"""llama.cpp's k-quants (Q3_K, Q4_K, Q5_K, Q6_K) written by us, byte for byte what ``llama-quantize`` writes
without an importance matrix, and llama.cpp's per-tensor mixes (Q4_K_M and the rest).

Why our own: the ``gguf`` package cannot write k-quants, and llama.cpp's quantizer is a C++ build that a
``pipx install`` must not need. The quantizers follow ggml's reference functions (``quantize_row_q4_K_ref``
and the helpers it calls, ``make_qkx2_quants``, ``make_qx_quants``, ``make_q3_quants``, ``nearest_int``) in
ggml/src/ggml-quants.c, which ``llama-quantize`` runs when no importance matrix is given; the per-tensor
types follow ``llama_tensor_get_type`` in src/llama-quant.cpp.

Byte identity: ggml's reference code is scalar float32 C, built without fused multiply-add (ggml-base
has no -mfma) and without reassociation, so every float operation is one IEEE float32 operation in a
fixed order. We do the same operations in the same order, vectorized over many blocks at once instead
of one block after the other: sums over a block's values are accumulated value by value (``_seqsum``,
never a pairwise or tree reduction), products keep C's left-to-right grouping (``w*l*x`` is
``(w*l)*x``), constants are float32, and ``nearest_int`` is ggml's own trick (add 1.5*2^23 in float32,
read the low mantissa bits), including what it gives out of its range. Half precision is numpy's
round-to-nearest-even, as ggml's software conversion.

numpy, and numba's compiled loops of the same operations when numba is installed (kquants_jit.py);
nothing here reads or writes files.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

import numpy as np

QK_K = 256
F = np.float32
_MAGIC = F(12582912.0)  # 1.5 * 2**23
_GROUP_MAX_EPS = F(1e-15)
_COLUMNS = 8192  # sub-blocks a thread quantizes at a time: arrays of 0.5-1 MiB, near the caches, few Python steps

# ggml type ids (gguf.GGMLQuantizationType), kept here so that the rules below read as data
Q4_0, Q5_0, Q5_1, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K, F16 = 2, 6, 7, 8, 11, 12, 13, 14, 1
K_TYPES = {Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210}  # bytes per super-block of 256 values
_BLOCK = {Q4_0: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q3_K: 256, Q4_K: 256, Q5_K: 256, Q6_K: 256, F16: 1}


def quantize(rows: np.ndarray, qtype: int, threads: int | None = None, backend: str | None = None) -> np.ndarray:
    """float32 rows (..., n with n a multiple of 256) as ggml stores them in ``qtype`` (a k-quant):
    uint8 (..., n / 256 * block bytes). Chunks of super-blocks are quantized on ``threads`` threads
    (default: the cores this process may use), by numba's compiled loops (kquants_jit.py) when numba
    is installed and they are compiled, else by numpy (which releases the GIL inside each operation);
    both give the same bytes. ``backend``: "auto" (the default; the TUI_MERGER_KQUANTS environment
    variable may say "numpy" or "numba"), "numpy", or "numba" (waits for the compiled loops; an error
    if numba cannot be imported)."""
    x = np.ascontiguousarray(rows, dtype=F)
    if x.shape[-1] % QK_K:
        raise ValueError(f"rows of {x.shape[-1]} values are not a multiple of {QK_K}")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], K_TYPES[qtype]), dtype=np.uint8)
    kernel = _compiled(qtype, backend or _backend(), start=x.size >= _JIT_CALL_VALUES)
    if kernel is not None:
        chunk = _JIT_CHUNK

        def one(start: int) -> None:
            kernel(blocks[start:start + chunk], out[start:start + chunk])
    else:
        fn = {Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k}[qtype]
        chunk = _COLUMNS // (QK_K // (16 if qtype in (Q3_K, Q6_K) else 32))  # super-blocks per thread step

        def one(start: int) -> None:
            with np.errstate(all="ignore"):  # ggml divides by zero too, and then does not use the result
                out[start:start + chunk] = fn(blocks[start:start + chunk])

    starts = range(0, blocks.shape[0], chunk)
    n = min(threads or _cores(), len(starts))
    if n <= 1:
        for start in starts:
            one(start)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(n, thread_name_prefix="kquants") as pool:
            for _ in pool.map(one, starts):
                pass
    return out.reshape(*x.shape[:-1], -1)


# -- numba's compiled loops (kquants_jit.py), when numba is installed ------------------------------------
# The first k-quant tensor starts compiling (or loading from numba's cache) the loops of its type in a
# thread of its own; until they are ready, numpy quantizes, so that a first compile (12.5 s of CPU for
# Q4_K_M's two kernels) is spent beside useful work, not before it. The bytes are the same either way.
_JIT_CHUNK = 256  # super-blocks per thread step of the compiled loops
# Small work does not start a compile (numpy is done first, and a process that ends mid-compile leaves
# nothing cached): a model with this many k-quant values when planned, or a call with this many.
_JIT_MODEL_VALUES = 1 << 26
_JIT_CALL_VALUES = 1 << 22
_jit_lock = threading.Lock()
_jit_state: dict[int, object] = {}  # qtype -> threading.Thread (compiling), a kernel, or None (failed)
jit_error: str | None = None  # why the compiled loops are not used, when they are not


def _backend() -> str:
    """TUI_MERGER_KQUANTS: auto (unset), numpy or numba; anything else is refused, not ignored."""
    value = os.environ.get("TUI_MERGER_KQUANTS", "").strip().lower() or "auto"
    if value not in ("auto", "numpy", "numba"):
        from tui_merger.core.errors import MergeError

        raise MergeError(f"TUI_MERGER_KQUANTS is {value!r}, which is not a k-quant backend; set it to auto, "
                         "numpy or numba, or unset it.")
    return value


def _compiled(qtype: int, backend: str, start: bool = True):
    """The compiled kernel of ``qtype`` when it is ready (backend "numba": waits for it), else None;
    starts compiling it in a thread when ``start`` (or backend "numba") and nothing has yet."""
    if backend == "numpy":
        return None
    if backend not in ("auto", "numba"):
        raise ValueError(f"unknown k-quant backend {backend!r}: auto, numpy or numba")
    with _jit_lock:
        state = _jit_state.get(qtype, _MISSING)
        if state is _MISSING and not start and backend == "auto":
            return None
        if state is _MISSING:
            state = threading.Thread(target=_compile, args=(qtype,), name="kquants-jit", daemon=True)
            _jit_state[qtype] = state
            state.start()
    if isinstance(state, threading.Thread):
        if backend == "auto":
            return None
        state.join()
        state = _jit_state[qtype]
    if state is None and backend == "numba":
        from tui_merger.core.errors import MergeError

        raise MergeError(f"numba's k-quant loops were asked for (TUI_MERGER_KQUANTS=numba) but are not available "
                         f"({jit_error}); install numba, or unset TUI_MERGER_KQUANTS to let numpy write the same bytes.")
    return state


_MISSING = object()


def _compile(qtype: int) -> None:
    global jit_error
    try:
        import importlib

        kquants_jit = importlib.import_module("tui_merger.core.ship.kquants_jit")
        kernel = {Q3_K: kquants_jit.q3_k, Q4_K: kquants_jit.q4_k, Q5_K: kquants_jit.q5_k, Q6_K: kquants_jit.q6_k}[qtype]
        kernel(np.zeros((1, QK_K), dtype=F), np.zeros((1, K_TYPES[qtype]), dtype=np.uint8))  # compiles or loads
    except Exception as e:  # numba missing, or one that does not work with this numpy: numpy does it
        jit_error = f"{type(e).__name__}: {e}".splitlines()[0]
        kernel = None
    with _jit_lock:
        _jit_state[qtype] = kernel


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# -- ggml's helpers, vectorized over blocks ------------------------------------------------------------
# Arrays are laid out (n, S): the n values of a (sub-)block down axis 0, S blocks across, so that one
# step of C's loop over a block's values is one operation on a contiguous row of S floats.


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even through the float32 mantissa (int32 result); outside
    |v| <= 4194303 it gives what ggml's gives (the mantissa bits), not a clamp."""
    return ((v.astype(F, copy=False) + _MAGIC).view(np.int32) & 0x007FFFFF) - 0x00400000


def _seqsum(a: np.ndarray) -> np.ndarray:
    """sum over axis 0 in C's order, ((a0 + a1) + a2) + ... With two columns or more, numpy reduces a
    C-contiguous array over its first axis one row after the other (its pairwise summation only runs
    along the contiguous axis); a single column would be summed pairwise, so it is summed row by row
    here. tests/test_kquants.py holds both to the explicit loop."""
    if a.ndim == 2 and a.shape[1] >= 2 and a.flags.c_contiguous:
        return np.add.reduce(a, axis=0)
    out = a[0].copy()
    for row in a[1:]:
        np.add(out, row, out=out)
    return out


def _levels(v: np.ndarray, lo: int, hi: int, vmin: np.ndarray, vmax: np.ndarray) -> np.ndarray:
    """clamp(nearest_int(v), lo, hi) as float32, in place of v. ``vmin``/``vmax`` bound v per column
    (the caller knows them without a pass over v): when every value lies where nearest_int equals
    round-half-even (|v| < 2^22) it is np.rint, and the clamp is skipped where the bounds show it
    changes nothing; otherwise ggml's integer trick, out-of-range results included."""
    if not bool(np.all((vmin > F(-4194304)) & (vmax < F(4194304)))):  # NaN fails too
        return np.clip(_nearest_int(v), lo, hi).astype(F)
    np.rint(v, out=v)
    low, high = bool((vmin < F(lo)).any()), bool((vmax > F(hi)).any())
    if low and high:
        np.clip(v, F(lo), F(hi), out=v)
    elif low:
        np.maximum(v, F(lo), out=v)
    elif high:
        np.minimum(v, F(hi), out=v)
    return v


def _first_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, max): the largest |x| down axis 0 and the signed value where it first occurs (C's loop
    with a strict >)."""
    ax = np.abs(x)
    idx = ax.argmax(axis=0)
    cols = np.arange(x.shape[1])
    return ax[idx, cols], x[idx, cols]


def _make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants over (n, S): (scale (S,), the_min (S,), L (n, S) float32 levels).

    The levels of the best step are not copied at each step: they are a function of the step's
    iscale and min, which are kept, and computed once more at the end (the same operations)."""
    nmax_f = F(nmax)
    xlo = x.min(axis=0)
    mx = x.max(axis=0)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    mn = np.where(xlo > 0, F(0), xlo)
    flat = mx == mn
    live = ~flat
    iscale = nmax_f / (mx - mn)
    scale = F(1) / iscale
    xm = x - mn
    v = np.empty_like(x)

    def levels(iscale, base):
        np.multiply(xm, iscale, out=v)
        a, b = iscale * (xlo - base), iscale * (mx - base)  # v's bounds per column: rounding is monotone
        a, b = np.where(live, np.minimum(a, b), F(0)), np.where(live, np.maximum(a, b), F(0))
        return _levels(v, 0, nmax, a, b)

    keep_is, keep_base = iscale, mn  # what the best levels are made from
    L = levels(iscale, mn)
    diff = L * scale
    diff += mn
    diff -= x
    diff *= diff
    diff *= w
    best = _seqsum(diff)
    wl = np.empty_like(x)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + nmax_f) / (mx - mn)
        laux = levels(iscale, mn)
        np.multiply(w, laux, out=wl)
        sum_l = _seqsum(wl)
        np.multiply(wl, laux, out=diff)
        sum_l2 = _seqsum(diff)
        np.multiply(wl, x, out=diff)
        sum_xl = _seqsum(diff)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = np.where(pos, F(0), this_min)
        this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        np.multiply(laux, this_scale, out=diff)  # (this_scale*l + this_min - x)^2 * w
        diff += this_min
        diff -= x
        diff *= diff
        diff *= w
        cur = _seqsum(diff)
        take = live & (D > 0) & (cur < best)
        if take.any():
            keep_is = np.where(take, iscale, keep_is)
            keep_base = np.where(take, mn, keep_base)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
            np.subtract(x, mn, out=xm)
    np.subtract(x, keep_base, out=xm)
    L = levels(keep_is, keep_base)
    L[:, flat] = 0
    scale = np.where(flat, F(0), scale)
    return scale, -mn, L


def _make_qx(x, nmax: int):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL) over (n, S): (scale (S,), L (n, S) float32 in 0..2*nmax-1)."""
    amax, vmax = _first_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    nmax_f = F(nmax)
    xlo, xhi = x.min(axis=0), x.max(axis=0)
    w = x * x
    wx = w * x
    tmp = np.empty_like(x)

    def levels(iscale):
        a, b = iscale * xlo, iscale * xhi  # bounds of iscale * x per column (rounding is monotone)
        a, b = np.where(zero, F(0), np.minimum(a, b)), np.where(zero, F(0), np.maximum(a, b))
        return _levels(x * iscale, -nmax, nmax - 1, a, b)

    def sums(l):
        np.multiply(wx, l, out=tmp)
        slx = _seqsum(tmp)
        np.multiply(w, l, out=tmp)
        np.multiply(tmp, l, out=tmp)
        return slx, _seqsum(tmp)

    keep_is = F(-nmax) / vmax  # the levels kept are levels(keep_is): computed once, at the end
    sumlx, suml2 = sums(levels(keep_is))
    scale = np.where(suml2 != 0, sumlx / suml2, F(0))
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        iscale = -(nmax_f + F(0.1) * F(k)) / vmax
        slx, sl2 = sums(levels(iscale))
        take = (sl2 > 0) & (slx * slx > best * sl2)
        if take.any():
            keep_is = np.where(take, iscale, keep_is)
            scale = np.where(take, slx / sl2, scale)
            best = np.where(take, scale * slx, best)
    L = levels(keep_is)
    L += nmax_f
    return np.where(zero, F(0), scale), np.where(zero, F(0), L)


def _make_q3(x, nmax: int):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) over (n, S): (scale, L in 0..2*nmax-1)."""
    amax, vmax = _first_absmax(x)
    zero = amax < _GROUP_MAX_EPS
    w = x * x
    wx = w * x
    L = np.clip(_nearest_int((F(-nmax) / vmax) * x), -nmax, nmax - 1)
    Lf = L.astype(F)
    sumlx = _seqsum(wx * Lf)
    suml2 = _seqsum(w * Lf * Lf)
    for _ in range(5):
        changed = np.zeros(x.shape[1], dtype=bool)
        for i in range(x.shape[0]):
            li = Lf[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - w[i] * li * li
            new = np.clip(_nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1)
            newf = new.astype(F)
            slx2 = slx + wx[i] * newf
            sl22 = sl2 + w[i] * newf * newf
            take = (slx > 0) & (new != L[i]) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            if take.any():
                L[i] = np.where(take, new, L[i])
                Lf[i] = np.where(take, newf, li)
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
                changed |= take
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F(0))
    L = L + nmax
    L[:, zero] = 0
    return np.where(zero, F(0), scale), L


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


# -- the block formats -------------------------------------------------------------------------------


def _sub(blocks: np.ndarray, n: int) -> np.ndarray:
    """(B, 256) -> (n, B*256/n): sub-blocks of n values, one per column."""
    return np.ascontiguousarray(blocks.reshape(-1, n).T)


def _q45_k(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """What Q4_K and Q5_K share: per 32 values a scale and a min by make_qkx2_quants, both as 6-bit
    multiples of the super-block's d and dmin (half), then every value quantized again against them.
    Returns (d, dmin, packed scales (B, 12), L (B, 256) levels)."""
    B = blocks.shape[0]
    x = _sub(blocks, 32)
    av_x = np.sqrt(_seqsum(x * x) / F(32))
    w = av_x + np.abs(x)
    scales, mins, L = _make_qkx2(x, w, nmax, rmin, 0.1, nstep)
    scales, mins = scales.reshape(B, 8), mins.reshape(B, 8)
    L = np.ascontiguousarray(L.T).reshape(B, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), F(0))
    max_min = np.maximum(mins.max(axis=1), F(0))
    inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0))
    inv_min = np.where(max_min > 0, F(63) / max_min, F(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.zeros((B, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    d = _f16(max_scale / F(63))
    dmin = _f16(max_min / F(63))
    dd = d.astype(F)[:, None] * ls.astype(F)  # (B, 8)
    dm = dmin.astype(F)[:, None] * lm.astype(F)
    xs = blocks.reshape(B, 8, 32)
    again = np.clip(_nearest_int((xs + dm[:, :, None]) / dd[:, :, None]), 0, nmax).astype(F)
    L = np.where((dd != 0)[:, :, None], again, L).astype(np.uint8).reshape(B, 256)
    return d, dmin, packed, L


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin (half), scales[12], qs[128] (two 4-bit levels per byte, 32 values apart)."""
    d, dmin, packed, L = _q45_k(blocks, 15, -1.0, 20)
    B = blocks.shape[0]
    q = L.reshape(B, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(B, 128)
    return np.concatenate([d.view(np.uint8).reshape(B, 2), dmin.view(np.uint8).reshape(B, 2), packed, qs], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32] (the fifth bits), qs[128]."""
    d, dmin, packed, L = _q45_k(blocks, 31, -0.5, 15)
    B = blocks.shape[0]
    q = L.reshape(B, 4, 2, 32)
    low = q & 0xF
    high = (q >> 4).astype(np.uint8)  # (B, 4, 2, 32): 0 or 1
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # bit of pair (k, h)
    qh = np.bitwise_or.reduce((high << shifts[None, :, :, None]).reshape(B, 8, 32), axis=1)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(B, 128)
    return np.concatenate([d.view(np.uint8).reshape(B, 2), dmin.view(np.uint8).reshape(B, 2), packed, qh, qs], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128], qh[64], scales[16] (int8), d (half)."""
    B = blocks.shape[0]
    scales, L = _make_qx(_sub(blocks, 16), 32)
    scales = scales.reshape(B, 16)
    L = np.ascontiguousarray(L.T).reshape(B, 16, 16)
    max_abs, max_scale = _first_absmax(scales.T)
    zero = max_abs < _GROUP_MAX_EPS
    iscale = F(-128) / max_scale
    d = _f16(F(1) / iscale)
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    dd = d.astype(F)[:, None] * sc.astype(F)
    xs = blocks.reshape(B, 16, 16)
    again = np.clip(_nearest_int(xs / dd[:, :, None]), -32, 31) + 32
    L = np.where((dd != 0)[:, :, None], again, L).astype(np.uint8).reshape(B, 2, 4, 32)
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4), (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = np.concatenate([ql.reshape(B, 128), qh.reshape(B, 64), sc.view(np.uint8), d.view(np.uint8).reshape(B, 2)], axis=1)
    out[zero] = 0
    return out


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """block_q3_K: hmask[32] (the third bits), qs[64] (two low bits), scales[12] (6-bit, packed), d."""
    B = blocks.shape[0]
    scales, L = _make_q3(_sub(blocks, 16), 4)
    scales = scales.reshape(B, 16)
    L = np.ascontiguousarray(L.T).reshape(B, 16, 16)
    _, max_scale = _first_absmax(scales.T)
    some = max_scale != 0
    iscale = F(-32) / max_scale
    l = (np.clip(_nearest_int(iscale[:, None] * scales).astype(np.int8), -32, 31) + 32).astype(np.uint8)
    l = np.where(some[:, None], l, 0).astype(np.uint8)
    packed = np.zeros((B, 12), dtype=np.uint8)
    packed[:, 0:8] = (l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4)
    hi = (l >> 4).reshape(B, 4, 4)  # j = 4*g + r: two bits at 2*g of byte 8 + r
    packed[:, 8:12] = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    d = np.where(some, _f16(F(1) / iscale), np.float16(0))
    sc = l.astype(np.int32) - 32
    dd = d.astype(F)[:, None] * sc.astype(F)
    xs = blocks.reshape(B, 16, 16)
    again = np.clip(_nearest_int(xs / dd[:, :, None]), -4, 3) + 4
    L = np.where((dd != 0)[:, :, None], again, L).astype(np.uint8).reshape(B, 256)
    high = (L > 3).reshape(B, 8, 32)  # value j: bit j // 32 of hmask[j % 32]
    hmask = np.bitwise_or.reduce(high.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    low = (L & 3).reshape(B, 2, 4, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)).reshape(B, 64)
    return np.concatenate([hmask, qs, packed, d.view(np.uint8).reshape(B, 2)], axis=1)


# -- llama.cpp's per-tensor mixes (llama_tensor_get_type, src/llama-quant.cpp) ---------------------------


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class Mix:
    """A llama.cpp file type: its LLAMA_FTYPE id, the type most matrices get, and per tensor category
    the rules that give some of them more bits: (condition on (i, n), type), the first that holds wins.
    For attn_v (and the fused attn_qkv / attn_kv_b, which llama.cpp treats as attn_v), i counts those
    tensors in llama.cpp's order and n is their number; for ffn_down, i is the layer and n the layer
    count."""

    ftype: int
    default: int
    rules: dict  # category -> ((condition, type), ...)


def _always(i: int, n: int) -> bool:
    return True


MIXES = {
    "q3_k_m": Mix(12, Q3_K, {
        "attn_v": ((lambda i, n: i < 2, Q5_K), (_always, Q4_K)),
        "ffn_down": ((lambda i, n: i < n // 16, Q5_K), (_always, Q4_K)),
        "attn_output": ((_always, Q4_K),),
    }),
    "q4_k_s": Mix(14, Q4_K, {
        "attn_v": ((lambda i, n: i < 4, Q5_K),),
        "ffn_down": ((lambda i, n: i < n // 8, Q5_K),),
    }),
    "q4_k_m": Mix(15, Q4_K, {
        "attn_v": ((more_bits, Q6_K),),
        "ffn_down": ((more_bits, Q6_K),),
    }),
    "q5_k_s": Mix(16, Q5_K, {}),
    "q5_k_m": Mix(17, Q5_K, {
        "attn_v": ((more_bits, Q6_K),),
        "ffn_down": ((more_bits, Q6_K),),
    }),
    "q6_k": Mix(18, Q6_K, {}),
}
# With exactly 8 experts (Mixtral-like) llama.cpp spends more on attention: attn_v and attn_k Q8_0, and
# attn_output Q5_K for these mixes (instead of the rule above).
_EIGHT_EXPERTS_ATTN_OUTPUT = {"q3_k_m", "q4_k_s", "q4_k_m"}
# A row length that is not a multiple of the type's block: llama.cpp's tensor_type_fallback.
FALLBACK = {Q3_K: Q4_0, Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
# Substrings of matrices llama.cpp never quantizes (tensor_allows_quantization), besides 1-D tensors.
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
                  "ssm_conv1d", "shortconv.conv.weight", "attn_rel_b.weight", "time_mix_")
_CATEGORIES = (  # tensor_get_category: the first whose test holds
    ("attn_qkv", "attn_qkv.weight"), ("attn_kv_b", "attn_kv_b.weight"), ("attn_v", "attn_v.weight"),
    ("attn_k", "attn_k.weight"), ("attn_q", "attn_q.weight"), ("attn_output", "attn_output.weight"),
    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
)
_LAYER = re.compile(r"^blk\.(\d+)\.")


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((cat for cat, part in _CATEGORIES if part in name), "other")


def quantizable(name: str, shape) -> bool:
    """llama-quantize's test: a weight of 2 dimensions or more as ggml counts them (``ggml_n_dims``: the
    outer dimensions of size 1 do not count, so a (1, n) gate is 1-D and stays as it is)."""
    return _ggml_n_dims(shape) >= 2 and name.endswith("weight") and not any(part in name for part in _NOT_QUANTIZED)


def _ggml_n_dims(shape) -> int:
    """ggml_n_dims of a tensor of numpy/torch ``shape`` (ggml's ne is the shape reversed)."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return max(len(dims), 1)


def _layer(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """The order llama.cpp's loader walks tensors in (weight_name_comparer): by layer (-1 for the
    tensors outside layers), then by name. Its counters (the i of attn_v's rules) follow this order."""
    return sorted(names, key=lambda n: (_layer(n), n))


@dataclass(frozen=True)
class Model:
    """What llama_tensor_get_type reads of the model besides the tensors."""

    arch: str  # llama.cpp's architecture name
    n_layer: int
    n_expert: int = 0
    n_head: int = 0
    n_head_kv: int = 0

    @property
    def is_70b(self) -> bool:  # LLM_TYPE_70B, as the loaders of these architectures set it
        return self.n_layer == 80 and (self.arch == "qwen2" or (self.arch == "llama" and self.n_head != self.n_head_kv))


def tensor_types(tensors, mix_name: str, model: Model) -> tuple[dict[str, int], list[str]]:
    """{GGUF name: ggml type} for the tensors llama.cpp quantizes in this mix (others keep their type),
    and the names that fell back to another type because their rows are not a multiple of 256.
    ``tensors``: (GGUF name, shape in numpy order: the last dimension is the row)."""
    mix = MIXES[mix_name]
    shapes = {name: tuple(shape) for name, shape in tensors}
    n_attn_v = sum(1 for n in shapes if category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
    tied = "output.weight" not in shapes
    counters = {"attn_v": 0, "ffn_down": 0, "ffn_gate": 0, "ffn_up": 0}
    types: dict[str, int] = {}
    fallbacks: list[str] = []
    for name in llama_order(shapes):
        shape = shapes[name]
        if not quantizable(name, shape):
            continue
        cat = category(name)
        ncols = shape[-1]
        new = mix.default
        if cat == "output" or (tied and cat == "token_embd"):
            new = Q8_0 if model.arch == "falcon" or ncols % _BLOCK[new] else Q6_K
        elif cat == "token_embd":
            pass
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            i = counters["attn_v"]
            new = _rule(mix, "attn_v", i, n_attn_v, new)
            if model.is_70b and new in (Q3_K, Q4_K):
                new = Q5_K  # 8 heads share attn_v in the 70B: more bits for little size
            if model.n_expert == 8:
                new = Q8_0
            counters["attn_v"] += 1
        elif cat == "attn_k":
            if model.n_expert == 8:
                new = Q8_0
        elif cat == "ffn_down":
            i = _layer(name) if model.n_expert > 1 else counters["ffn_down"]
            if model.arch == "falcon" and mix_name in ("q4_k_m", "q3_k_m", "q4_k_s"):
                new = _falcon_ffn_down(mix_name, i, model.n_layer, new)
            else:
                new = _rule(mix, "ffn_down", i, model.n_layer, new)
            counters["ffn_down"] += 1
        elif cat == "attn_output":
            if model.arch != "falcon":
                if model.n_expert == 8:
                    new = Q5_K if mix_name in _EIGHT_EXPERTS_ATTN_OUTPUT else new
                else:
                    new = _rule(mix, "attn_output", 0, 0, new)
        elif cat in ("ffn_gate", "ffn_up"):
            counters[cat] += 1  # counted by llama.cpp; no rule of these mixes uses them
        if ncols % _BLOCK[new]:
            fallbacks.append(name)
            new = FALLBACK.get(new, new)
            if ncols % _BLOCK[new]:
                new = F16
        types[name] = new
    values = sum(int(np.prod(shapes[n])) for n, t in types.items() if t in K_TYPES)
    for qtype in set(types.values()) & set(K_TYPES):  # numba's loops start compiling (or loading) now,
        _compiled(qtype, _backend(), start=values >= _JIT_MODEL_VALUES)  # while the writer gets ready
    return types, fallbacks


def _rule(mix: Mix, cat: str, i: int, n: int, default: int) -> int:
    return next((t for cond, t in mix.rules.get(cat, ()) if cond(i, n)), default)


def _falcon_ffn_down(mix_name: str, i: int, n: int, default: int) -> int:
    if mix_name == "q4_k_m":
        return Q6_K if i < n // 16 else Q5_K if more_bits(i, n) else Q4_K
    if mix_name == "q3_k_m":
        return Q5_K if i < n // 16 else Q4_K if more_bits(i, n) else Q3_K
    return default  # q4_k_s: no change for Falcon
