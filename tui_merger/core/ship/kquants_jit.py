"""The k-quants of kquants.py as compiled loops (numba), one super-block after the other, as ggml's C does
them: ``quantize_row_q{3,4,5,6}_K_ref`` and the helpers they call (``make_qkx2_quants``,
``make_qx_quants``, ``make_q3_quants``, ``nearest_int``, ``GGML_FP32_TO_FP16``) in ggml/src/ggml-quants.c,
written again here from what they compute.

Same bytes as the numpy code and as ``llama-quantize``: every operation is one IEEE float32 operation in
C's order. numba types a float32 operation with a float32 as float32, but an int or a Python float
operand makes it float64, so every constant and every level is made float32 (``F(...)``) before it meets
a float. No ``fastmath``: LLVM then neither reassociates nor contracts a*b+c into a fused multiply-add
(as ggml-base is built: no -mfma). tests/test_kquants.py holds both paths to llama.cpp's own files.

Compiled once per machine and kept (numba's ``cache=True``: beside this file when that is writable, else
in the user's cache folder, ``NUMBA_CACHE_DIR`` if set); where nowhere is writable it compiles in each
process. Imported only by kquants.py, only when numba is installed and a k-quant is written.
"""

from __future__ import annotations

import numpy as np
from numba import njit

F = np.float32
_MAGIC = F(12582912.0)  # 1.5 * 2**23: ggml's nearest_int
_EPS = F(1e-15)  # GROUP_MAX_EPS


def _jit(fn=None, **kw):
    if fn is None:  # @_jit(inline="always")
        return lambda f: _jit(f, **kw)
    # error_model="numpy": a float division by zero gives inf/NaN as in C (ggml divides first and then
    # does not use such a result), not Python's ZeroDivisionError
    try:
        return njit(nogil=True, cache=True, error_model="numpy", **kw)(fn)
    except RuntimeError:  # numba found no writable cache folder: compile in each process instead
        return njit(nogil=True, error_model="numpy", **kw)(fn)


@_jit
def _nearest_int_bits(v, fb, ib):
    fb[0] = v + _MAGIC
    return np.int64((ib[0] & 0x007FFFFF) - 0x00400000)


def _nearest_int_py(v, fb, ib):
    """ggml's nearest_int: the low mantissa bits of v + 1.5*2^23 (float32); that is round half to even
    for |v| < 2^22, and the same bits trick (not a clamp) outside, NaN included. ``fb``/``ib``: a
    float32[1] and its int32 view, to read a float's bits."""
    if -F(4194304.0) < v < F(4194304.0):
        return np.int64((v + _MAGIC) - _MAGIC)  # exact: the sum is rounded once, to an integer
    return _nearest_int_bits(v, fb, ib)


_nearest_int = _jit(_nearest_int_py, inline="always")


@_jit
def _f16_bits(f, fb, ib):
    """float32 -> IEEE half bits, round to nearest even (what ggml's GGML_FP32_TO_FP16 and numpy's
    astype(float16) give), inf for overflow, NaN kept a NaN."""
    fb[0] = f
    x = np.int64(ib[0]) & 0xFFFFFFFF
    sign = (x >> 16) & 0x8000
    e = (x >> 23) & 0xFF
    m = x & 0x7FFFFF
    if e == 0xFF:
        return sign | 0x7C00 | (0x200 if m else 0)
    e16 = e - 127 + 15
    if e16 >= 31:
        return sign | 0x7C00
    if e16 <= 0:  # half subnormal or zero: m with its hidden bit, shifted right, rounded half to even
        if e16 < -10:
            return sign
        m = m | 0x800000
        shift = 14 - e16
        half = m >> shift
        rest = m & ((1 << shift) - 1)
        mid = 1 << (shift - 1)
        if rest > mid or (rest == mid and (half & 1)):
            half += 1
        return sign | half
    half = (e16 << 10) | (m >> 13)
    rest = m & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (half & 1)):
        half += 1  # a carry into the exponent is right (up to inf)
    return sign | half


@_jit
def _f16_value(h):
    """half bits -> float32 (exact)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = np.float64(m) * 2.0 ** -24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = np.float64(m + 1024) * 2.0 ** (e - 25)
    return F(-v) if h & 0x8000 else F(v)


@_jit
def _make_qkx2(x, w, nmax, rmin, rdelta, nstep, L, laux, fb, ib):
    """make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad=false):
    returns (scale, the_min); L gets the levels."""
    n = x.shape[0]
    fmax = F(nmax)
    lo = x[0]
    hi = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < lo:
            lo = x[i]
        if x[i] > hi:
            hi = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if lo > F(0):
        lo = F(0)
    if hi == lo:
        for i in range(n):
            L[i] = 0
        return F(0), -lo
    iscale = fmax / (hi - lo)
    scale = F(1) / iscale
    best = F(0)
    for i in range(n):
        l = min(max(_nearest_int(iscale * (x[i] - lo), fb, ib), 0), nmax)
        L[i] = l
        diff = scale * F(l) + lo - x[i]
        diff = diff * diff
        best += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + fmax) / (hi - lo)
        sum_l = F(0)
        sum_l2 = F(0)
        sum_xl = F(0)
        for i in range(n):
            l = min(max(_nearest_int(iscale * (x[i] - lo), fb, ib), 0), nmax)
            laux[i] = l
            fl = F(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > F(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F(0):
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            mad = F(0)
            for i in range(n):
                diff = this_scale * F(laux[i]) + this_min - x[i]
                diff = diff * diff
                mad += w[i] * diff
            if mad < best:
                for i in range(n):
                    L[i] = laux[i]
                best = mad
                scale = this_scale
                lo = this_min
    return scale, -lo


@_jit
def _q45_k(x, out, nmax, rmin, nstep, five):
    """quantize_row_q4_K_ref (five=False: nmax 15) and quantize_row_q5_K_ref (five=True: nmax 31), one
    sub-block after the other (make_qkx2_quants as ggml writes it): the exact path for any input."""
    fb = np.zeros(1, dtype=np.float32)
    ib = fb.view(np.int32)
    L = np.zeros(256, dtype=np.int64)
    laux = np.zeros(32, dtype=np.int64)
    w = np.zeros(32, dtype=np.float32)
    scales = np.zeros(8, dtype=np.float32)
    mins = np.zeros(8, dtype=np.float32)
    ls = np.zeros(8, dtype=np.int64)
    lm = np.zeros(8, dtype=np.int64)
    for b in range(x.shape[0]):
        xb = x[b]
        for j in range(8):
            xs = xb[32 * j:32 * j + 32]
            sum_x2 = F(0)
            for i in range(32):
                sum_x2 += xs[i] * xs[i]
            av_x = np.sqrt(sum_x2 / F(32))
            for i in range(32):
                w[i] = av_x + abs(xs[i])
            s, m = _make_qkx2(xs, w, nmax, rmin, F(0.1), nstep, L[32 * j:32 * j + 32], laux, fb, ib)
            scales[j] = s
            mins[j] = m
        _q45_block(xb, out[b], scales, mins, L, nmax, five, ls, lm, fb, ib)


@_jit
def _q45_block(xb, y, scales, mins, L, nmax, five, ls, lm, fb, ib):
    """The rest of quantize_row_q4_K_ref / q5_K for one super-block, from its sub-blocks' scales, mins
    and levels: 6-bit scales and mins, d and dmin, levels again against them, the bits packed."""
    max_scale = F(0)
    max_min = F(0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = F(63) / max_scale if max_scale > F(0) else F(0)
    inv_min = F(63) / max_min if max_min > F(0) else F(0)
    for j in range(8):
        ls[j] = min(_nearest_int(inv_scale * scales[j], fb, ib) & 0xFF, 63)
        lm[j] = min(_nearest_int(inv_min * mins[j], fb, ib) & 0xFF, 63)
    for j in range(4):
        y[4 + j] = ls[j] | ((ls[j + 4] >> 4) << 6)
        y[8 + j] = lm[j] | ((lm[j + 4] >> 4) << 6)
        y[12 + j] = (ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4)
    hd = _f16_bits(max_scale / F(63), fb, ib)
    hm = _f16_bits(max_min / F(63), fb, ib)
    y[0] = hd & 0xFF
    y[1] = hd >> 8
    y[2] = hm & 0xFF
    y[3] = hm >> 8
    d_all = _f16_value(hd)
    m_all = _f16_value(hm)
    for j in range(8):
        d = d_all * F(ls[j])
        if d == F(0):
            continue
        dm = m_all * F(lm[j])
        for i in range(32):
            L[32 * j + i] = min(max(_nearest_int((xb[32 * j + i] + dm) / d, fb, ib), 0), nmax)
    if five:
        for i in range(32):
            y[16 + i] = 0
        for k in range(4):
            for i in range(32):
                l1 = L[64 * k + i]
                l2 = L[64 * k + 32 + i]
                h = 0
                if l1 > 15:
                    l1 -= 16
                    h |= 1 << (2 * k)
                if l2 > 15:
                    l2 -= 16
                    h |= 2 << (2 * k)
                y[16 + i] |= h
                y[48 + 32 * k + i] = l1 | (l2 << 4)
    else:
        for k in range(4):
            for i in range(32):
                y[16 + 32 * k + i] = L[64 * k + i] | (L[64 * k + 32 + i] << 4)


@_jit(inline="always")
def _signed_max(x):
    """(the value of the largest magnitude, the first of equals; that magnitude), as make_qx_quants,
    make_q3_quants and the Q3_K / Q6_K super-block scales look for it."""
    vmax = F(0)
    amax = F(0)
    for i in range(x.shape[0]):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return vmax, amax


@_jit(inline="always")
def _qx_sums(x, iscale, nmax, L, off, store, fb, ib):
    """One pass of make_qx_quants / make_q3_quants: l = nearest_int(iscale*x) in [-nmax, nmax-1] (stored
    as l + off when ``store``); returns (sum of w*x*l, sum of w*l*l), w = x*x, in C's order."""
    sumlx = F(0)
    suml2 = F(0)
    for i in range(x.shape[0]):
        l = min(max(_nearest_int(iscale * x[i], fb, ib), -nmax), nmax - 1)
        if store:
            L[i] = l + off
        w = x[i] * x[i]
        fl = F(l)
        sumlx += w * x[i] * fl
        suml2 += w * fl * fl
    return sumlx, suml2


@_jit
def _make_qx(x, nmax, L, fb, ib):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL): the scale; L gets levels + nmax."""
    n = x.shape[0]
    vmax, amax = _signed_max(x)
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return F(0)
    fmax = F(nmax)
    sumlx, suml2 = _qx_sums(x, F(-nmax) / vmax, nmax, L, nmax, True, fb, ib)
    scale = sumlx / suml2 if suml2 != F(0) else F(0)
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        iscale = -(fmax + F(0.1) * F(k)) / vmax
        sumlx, suml2 = _qx_sums(x, iscale, nmax, L, nmax, False, fb, ib)
        if suml2 > F(0) and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + min(max(_nearest_int(iscale * x[i], fb, ib), -nmax), nmax - 1)
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@_jit
def _q6_k(x, out):
    """quantize_row_q6_K_ref: ql[128], qh[64], scales[16] (int8), d (half), one sub-block after the
    other (make_qx_quants as ggml writes it): the exact path for any input."""
    fb = np.zeros(1, dtype=np.float32)
    ib = fb.view(np.int32)
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    sc = np.zeros(16, dtype=np.int64)
    for b in range(x.shape[0]):
        xb = x[b]
        for j in range(16):
            scales[j] = _make_qx(xb[16 * j:16 * j + 16], 32, L[16 * j:16 * j + 16], fb, ib)
        _q6_block(xb, out[b], scales, L, sc, fb, ib)


@_jit
def _q6_block(xb, y, scales, L, sc, fb, ib):
    """The rest of quantize_row_q6_K_ref for one super-block from its sub-blocks' scales and levels."""
    max_scale, max_abs = _signed_max(scales)
    if max_abs < _EPS:
        for i in range(210):
            y[i] = 0
        return
    iscale = F(-128) / max_scale
    hd = _f16_bits(F(1) / iscale, fb, ib)
    y[208] = hd & 0xFF
    y[209] = hd >> 8
    for j in range(16):
        v = min(_nearest_int(iscale * scales[j], fb, ib), 127) & 0xFF
        y[192 + j] = v
        sc[j] = v - 256 if v > 127 else v
    d_all = _f16_value(hd)
    for j in range(16):
        d = d_all * F(sc[j])
        if d == F(0):
            continue
        for i in range(16):
            L[16 * j + i] = min(max(_nearest_int(xb[16 * j + i] / d, fb, ib), -32), 31) + 32
    for h in range(2):
        for i in range(32):
            q1 = L[128 * h + i]
            q2 = L[128 * h + 32 + i]
            q3 = L[128 * h + 64 + i]
            q4 = L[128 * h + 96 + i]
            y[64 * h + i] = (q1 & 0xF) | ((q3 & 0xF) << 4)
            y[64 * h + 32 + i] = (q2 & 0xF) | ((q4 & 0xF) << 4)
            y[128 + 32 * h + i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)


@_jit
def _make_q3(x, nmax, L, fb, ib):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): the scale; L gets levels + nmax."""
    n = x.shape[0]
    vmax, amax = _signed_max(x)
    if amax < _EPS:
        for i in range(n):
            L[i] = 0
        return F(0)
    sumlx, suml2 = _qx_sums(x, F(-nmax) / vmax, nmax, L, 0, True, fb, ib)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fl = F(L[i])
            slx = sumlx - w * x[i] * fl
            if slx > F(0):
                sl2 = suml2 - w * fl * fl
                new = min(max(_nearest_int(x[i] * sl2 / slx, fb, ib), -nmax), nmax - 1)
                if new != L[i]:
                    fn = F(new)
                    slx += w * x[i] * fn
                    sl2 += w * fn * fn
                    if sl2 > F(0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > F(0) else F(0)


@_jit
def _q3_k(x, out):
    """quantize_row_q3_K_ref: hmask[32], qs[64], scales[12] (6-bit, packed), d (half)."""
    fb = np.zeros(1, dtype=np.float32)
    ib = fb.view(np.int32)
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    for b in range(x.shape[0]):
        xb = x[b]
        y = out[b]
        max_scale = F(0)
        amax = F(0)
        for j in range(16):
            s = _make_q3(xb[16 * j:16 * j + 16], 4, L[16 * j:16 * j + 16], fb, ib)
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        for i in range(96, 108):
            y[i] = 0
        if max_scale != F(0):
            iscale = F(-32) / max_scale
            for j in range(16):
                l8 = _nearest_int(iscale * scales[j], fb, ib) & 0xFF  # C stores it in an int8_t first
                l8 = l8 - 256 if l8 > 127 else l8
                l = min(max(l8, -32), 31) + 32
                if j < 8:
                    y[96 + j] = l & 0xF
                else:
                    y[96 + j - 8] |= (l & 0xF) << 4
                y[96 + 8 + j % 4] |= (l >> 4) << (2 * (j // 4))
            hd = _f16_bits(F(1) / iscale, fb, ib)
        else:
            hd = 0
        y[108] = hd & 0xFF
        y[109] = hd >> 8
        d_all = _f16_value(hd)
        for j in range(16):
            if j < 8:
                s6 = np.int64(y[96 + j]) & 0xF
            else:
                s6 = np.int64(y[96 + j - 8]) >> 4
            s6 = (s6 | (((np.int64(y[96 + 8 + j % 4]) >> (2 * (j // 4))) & 3) << 4)) - 32
            d = d_all * F(s6)
            if d == F(0):
                continue
            for i in range(16):
                L[16 * j + i] = min(max(_nearest_int(xb[16 * j + i] / d, fb, ib), -4), 3) + 4
        for i in range(32):
            y[i] = 0
        for j in range(256):
            if L[j] > 3:
                y[j % 32] |= 1 << (j // 32)
                L[j] -= 4
        for h in range(2):
            for i in range(32):
                y[32 + 32 * h + i] = (L[128 * h + i] | (L[128 * h + 32 + i] << 2) | (L[128 * h + 64 + i] << 4)
                                      | (L[128 * h + 96 + i] << 6))


# -- many sub-blocks at once ------------------------------------------------------------------------------
# The same operations on G super-blocks' sub-blocks side by side: arrays (values, lanes), one lane per
# sub-block, the loop over lanes innermost, where LLVM turns it into vector instructions. A lane's sums
# still run over its values in C's order; a vector add is just many lanes' own adds at once. Rounding
# is (v + 1.5*2^23) - 1.5*2^23, which is nearest_int for |v| < 2^22; a group where any value falls
# outside that (or is NaN: a zero scale, an inf) is done again by the exact path above.

G = 8  # super-blocks side by side
_LIM = F(4194304.0)


@_jit(inline="always")
def _level(v, lo, hi):
    """nearest_int(v) by the float trick, clamped to [lo, hi], as a float; right where _outside(v) is 0."""
    return min(max((v + _MAGIC) - _MAGIC, lo), hi)


@_jit(inline="always")
def _outside(v):
    """1 where the float trick is not nearest_int (|v| >= 2^22, or NaN): the group goes to the exact path."""
    return 0 if abs(v) < _LIM else 1


@_jit(inline="always")
def _to_lanes(x, g0, gb, width, xt):
    """Super-blocks g0 .. g0+gb-1 of x as lanes: xt[i, per*b + j] is value i of sub-block j of super-block
    b (sub-blocks of xt.shape[0] values, per of them in a super-block)."""
    per = 256 // width
    for b in range(gb):
        xb = x[g0 + b]
        for j in range(per):
            for i in range(width):
                xt[i, per * b + j] = xb[width * j + i]


@_jit(inline="always")
def _lane_levels(xt, b, width, live, kis, kbase, lo, hi, off, L):
    """Super-block b's levels (of the group in xt) at the scales its lanes' searches kept: nearest_int(kis *
    (x - kbase)) in [lo, hi], plus off, into L; all 0 in a lane that is not live (ggml's early return)."""
    per = 256 // width
    for j in range(per):
        s = per * b + j
        for i in range(width):
            if live[s]:
                L[width * j + i] = np.int64(_level(kis[s] * (xt[i, s] - kbase[s]), lo, hi)) + off
            else:
                L[width * j + i] = 0


@_jit
def _q45_lanes(x, out, nmax, rmin, nstep, five):
    """Q4_K / Q5_K (as _q45_k) G super-blocks at a time: make_qkx2_quants over the lanes, then _q45_block
    per super-block; returns how many groups the exact path redid."""
    redone = 0
    fb = np.zeros(1, dtype=np.float32)
    ib = fb.view(np.int32)
    S = 8 * G
    xt = np.zeros((32, S), dtype=np.float32)
    wt = np.zeros((32, S), dtype=np.float32)
    la = np.zeros((32, S), dtype=np.float32)
    lo = np.zeros(S, dtype=np.float32)
    hi = np.zeros(S, dtype=np.float32)
    sum_w = np.zeros(S, dtype=np.float32)
    sum_x = np.zeros(S, dtype=np.float32)
    isc = np.zeros(S, dtype=np.float32)
    scale = np.zeros(S, dtype=np.float32)
    best = np.zeros(S, dtype=np.float32)
    kis = np.zeros(S, dtype=np.float32)
    kbase = np.zeros(S, dtype=np.float32)
    s_l = np.zeros(S, dtype=np.float32)
    s_l2 = np.zeros(S, dtype=np.float32)
    s_xl = np.zeros(S, dtype=np.float32)
    t_scale = np.zeros(S, dtype=np.float32)
    t_min = np.zeros(S, dtype=np.float32)
    mad = np.zeros(S, dtype=np.float32)
    live = np.zeros(S, dtype=np.bool_)
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(8, dtype=np.float32)
    mins = np.zeros(8, dtype=np.float32)
    ls = np.zeros(8, dtype=np.int64)
    lm = np.zeros(8, dtype=np.int64)
    fmax = F(nmax)
    nb = x.shape[0]
    for g0 in range(0, nb, G):
        gb = min(G, nb - g0)
        n = 8 * gb
        _to_lanes(x, g0, gb, 32, xt)
        bad = 0
        for s in range(n):
            s_l[s] = F(0)
        for i in range(32):
            xi = xt[i]
            for s in range(n):
                s_l[s] += xi[s] * xi[s]
        for s in range(n):
            s_l[s] = np.sqrt(s_l[s] / F(32))  # av_x
        for i in range(32):
            xi = xt[i]
            wi = wt[i]
            for s in range(n):
                wi[s] = s_l[s] + abs(xi[s])
        for s in range(n):
            lo[s] = xt[0, s]
            hi[s] = xt[0, s]
            sum_w[s] = wt[0, s]
            sum_x[s] = sum_w[s] * xt[0, s]
        for i in range(1, 32):
            xi = xt[i]
            wi = wt[i]
            for s in range(n):
                v = xi[s]
                lo[s] = v if v < lo[s] else lo[s]
                hi[s] = v if v > hi[s] else hi[s]
                sum_w[s] += wi[s]
                sum_x[s] += wi[s] * v
        for s in range(n):
            if lo[s] > F(0):
                lo[s] = F(0)
            live[s] = hi[s] != lo[s]
            isc[s] = fmax / (hi[s] - lo[s]) if live[s] else F(0)
            scale[s] = F(1) / isc[s] if live[s] else F(0)
            best[s] = F(0)
            kis[s] = isc[s]
            kbase[s] = lo[s]
        for i in range(32):
            xi = xt[i]
            wi = wt[i]
            for s in range(n):
                v = isc[s] * (xi[s] - lo[s])
                bad += _outside(v)
                diff = scale[s] * _level(v, F(0), fmax) + lo[s] - xi[s]
                diff = diff * diff
                best[s] += wi[s] * diff
        for step in range(nstep + 1):
            num = rmin + F(0.1) * F(step) + fmax
            for s in range(n):
                isc[s] = num / (hi[s] - lo[s]) if live[s] else F(0)
                s_l[s] = F(0)
                s_l2[s] = F(0)
                s_xl[s] = F(0)
            for i in range(32):
                xi = xt[i]
                wi = wt[i]
                lai = la[i]
                for s in range(n):
                    v = isc[s] * (xi[s] - lo[s])
                    bad += _outside(v)
                    l = _level(v, F(0), fmax)
                    lai[s] = l
                    wl = wi[s] * l
                    s_l[s] += wl
                    s_l2[s] += wl * l
                    s_xl[s] += wl * xi[s]
            for s in range(n):
                D = sum_w[s] * s_l2[s] - s_l[s] * s_l[s]
                ts = (sum_w[s] * s_xl[s] - sum_x[s] * s_l[s]) / D
                tm = (s_l2[s] * sum_x[s] - s_l[s] * s_xl[s]) / D
                if tm > F(0):
                    tm = F(0)
                    ts = s_xl[s] / s_l2[s]
                t_scale[s] = ts
                t_min[s] = tm
                mad[s] = F(0)
                s_l[s] = D  # kept for the test below
            for i in range(32):
                xi = xt[i]
                wi = wt[i]
                lai = la[i]
                for s in range(n):
                    diff = t_scale[s] * lai[s] + t_min[s] - xi[s]
                    diff = diff * diff
                    mad[s] += wi[s] * diff
            for s in range(n):
                if live[s] and s_l[s] > F(0) and mad[s] < best[s]:
                    best[s] = mad[s]
                    scale[s] = t_scale[s]
                    kis[s] = isc[s]
                    kbase[s] = lo[s]
                    lo[s] = t_min[s]
        if bad:
            _q45_k(x[g0:g0 + gb], out[g0:g0 + gb], nmax, rmin, nstep, five)
            redone += 1
            continue
        for b in range(gb):
            for j in range(8):
                s = 8 * b + j
                scales[j] = scale[s] if live[s] else F(0)
                mins[j] = -lo[s]
            _lane_levels(xt, b, 32, live, kis, kbase, F(0), fmax, 0, L)
            _q45_block(x[g0 + b], out[g0 + b], scales, mins, L, nmax, five, ls, lm, fb, ib)
    return redone


@_jit
def _qx_lane_sums(xt, n, isc, slx, sl2, lo, hi):
    """One pass of make_qx_quants over the lanes at their scales isc: levels in [lo, hi], slx = sum of
    w*x*l and sl2 = sum of w*l*l (w = x*x), each lane's in C's order; returns how many values the float
    trick could not round."""
    bad = 0
    for s in range(n):
        slx[s] = F(0)
        sl2[s] = F(0)
    for i in range(xt.shape[0]):
        xi = xt[i]
        for s in range(n):
            v = isc[s] * xi[s]
            bad += _outside(v)
            l = _level(v, lo, hi)
            w = xi[s] * xi[s]
            slx[s] += w * xi[s] * l
            sl2[s] += w * l * l
    return bad


@_jit
def _q6_lanes(x, out):
    """Q6_K (as _q6_k) G super-blocks at a time: make_qx_quants over the lanes, then _q6_block per
    super-block; returns how many groups the exact path redid."""
    redone = 0
    fb = np.zeros(1, dtype=np.float32)
    ib = fb.view(np.int32)
    S = 16 * G
    xt = np.zeros((16, S), dtype=np.float32)
    vmax = np.zeros(S, dtype=np.float32)
    amax = np.zeros(S, dtype=np.float32)
    isc = np.zeros(S, dtype=np.float32)
    kis = np.zeros(S, dtype=np.float32)
    zero = np.zeros(S, dtype=np.float32)
    slx = np.zeros(S, dtype=np.float32)
    sl2 = np.zeros(S, dtype=np.float32)
    scale = np.zeros(S, dtype=np.float32)
    best = np.zeros(S, dtype=np.float32)
    live = np.zeros(S, dtype=np.bool_)
    L = np.zeros(256, dtype=np.int64)
    scales = np.zeros(16, dtype=np.float32)
    sc = np.zeros(16, dtype=np.int64)
    nmax = 32
    fmax = F(32)
    lo_l = F(-32)
    hi_l = F(31)
    nb = x.shape[0]
    for g0 in range(0, nb, G):
        gb = min(G, nb - g0)
        n = 16 * gb
        _to_lanes(x, g0, gb, 16, xt)
        for s in range(n):
            vmax[s] = F(0)
            amax[s] = F(0)
        for i in range(16):
            xi = xt[i]
            for s in range(n):
                ax = abs(xi[s])
                if ax > amax[s]:
                    amax[s] = ax
                    vmax[s] = xi[s]
        for s in range(n):
            live[s] = not (amax[s] < _EPS)
            isc[s] = F(-nmax) / vmax[s] if live[s] else F(0)
            kis[s] = isc[s]
        bad = _qx_lane_sums(xt, n, isc, slx, sl2, lo_l, hi_l)
        for s in range(n):
            scale[s] = slx[s] / sl2[s] if sl2[s] != F(0) else F(0)
            best[s] = scale[s] * slx[s]
        for k in range(-9, 10):
            if k == 0:
                continue
            num = fmax + F(0.1) * F(k)
            for s in range(n):
                isc[s] = -num / vmax[s] if live[s] else F(0)
            bad += _qx_lane_sums(xt, n, isc, slx, sl2, lo_l, hi_l)
            for s in range(n):
                if live[s] and sl2[s] > F(0) and slx[s] * slx[s] > best[s] * sl2[s]:
                    kis[s] = isc[s]
                    scale[s] = slx[s] / sl2[s]
                    best[s] = scale[s] * slx[s]
        if bad:
            _q6_k(x[g0:g0 + gb], out[g0:g0 + gb])
            redone += 1
            continue
        for b in range(gb):
            for j in range(16):
                s = 16 * b + j
                scales[j] = scale[s] if live[s] else F(0)
            _lane_levels(xt, b, 16, live, kis, zero, lo_l, hi_l, nmax, L)
            _q6_block(x[g0 + b], out[g0 + b], scales, L, sc, fb, ib)
    return redone


# The kernels kquants.quantize calls: (float32 (B, 256) C-contiguous, uint8 (B, block bytes)) -> None, the
# bytes written into the second; the lane kernels return how many groups the exact path redid (tests).


def q4_k(x, out):
    return _q45_lanes(x, out, 15, F(-1.0), 20, False)


def q5_k(x, out):
    return _q45_lanes(x, out, 31, F(-0.5), 15, True)


def q4_k_exact(x, out):
    _q45_k(x, out, 15, F(-1.0), 20, False)


def q5_k_exact(x, out):
    _q45_k(x, out, 31, F(-0.5), 15, True)


q6_k = _q6_lanes
q6_k_exact = _q6_k
q3_k = _q3_k  # make_q3_quants changes one level at a time: one sub-block after the other only
