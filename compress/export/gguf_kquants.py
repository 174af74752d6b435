"""llama.cpp's K-quant super-blocks (Q4_K, Q5_K, Q6_K) and the 32-weight Q5_0 / Q5_1 blocks llama-quantize falls
back to: the byte layouts (pack_* / unpack_*), and llama.cpp's reference quantizers for them, with or without an
importance matrix (per-column mean x^2 of the layer's inputs, llama.cpp's imatrix).

Written from ggml/src/ggml-quants.c (ggml-org/llama.cpp @ 01243c58, the functions named in each docstring) and
ggml-common.h's block structs; numpy float32 throughout. Sums over a block are taken in the C loop's order
(np.cumsum is sequential), so the bytes match ggml_quantize_chunk's where the C compiler does not fuse a
multiply-add; tests/test_gguf_kquants.py measures how often they match.

Layouts (QK_K = 256 weights a super-block):
  Q4_K  fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of nibbles
        w = d * sc[j] * q - dmin * m[j]                                                       144 bytes
  Q5_K  as Q4_K plus 32 bytes of fifth bits (qh) before the nibbles, q in [0, 31]               176 bytes
  Q6_K  128 bytes low nibbles (ql), 64 bytes of 2-bit highs (qh), 16 int8 scales, fp16 d
        w = d * sc[j] * (q - 32), 16 sub-blocks of 16                                          210 bytes
  Q5_0  fp16 d, 4 bytes qh, 16 bytes nibbles, w = d * (q - 16)                                  22 bytes / 32
  Q5_1  fp16 d, fp16 m, 4 bytes qh, 16 bytes nibbles, w = d * q + m                              24 bytes / 32
"""
from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}
BLOCK_WEIGHTS = {"Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32}
GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c: a group whose |x| max is below this is all zero
F32 = np.float32


def _sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in index order, in float32 (the C loops' `s += ...`)."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def _rint(a: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even (the 1.5 * 2^23 trick), as int32."""
    return np.rint(a).astype(np.int32)


def _fp16(a) -> np.ndarray:
    return np.asarray(a, dtype=F32).astype(np.float16)


# ---------------------------------------------------------------- the C helpers, vectorised over blocks

def make_qkx_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """make_qkx2_quants / make_qkx3_quants (same arithmetic for finite inputs): an asymmetric fit
    x ~ scale * L - the_min, L in [0, nmax], by a grid of nstep + 1 inverse scales around nmax / (max - min), each
    followed by the weighted least-squares (scale, min) of its L. x, w: float32 [..., n].
    Returns (scale [...], the_min [...] >= 0, L uint8 [..., n]). As in C, the min found so far moves the next
    grid point (both `x - min` and `max - min` use it)."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    mn = np.minimum(x.min(-1), F32(0))
    mx = x.max(-1)
    sum_w = _sum(w)
    sum_x = _sum(w * x)
    flat = mx <= mn
    span = np.where(flat, F32(1), mx - mn)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    L = np.clip(_rint(iscale[..., None] * (x - mn[..., None])), 0, nmax)
    diff = scale[..., None] * L.astype(F32) + mn[..., None] - x
    best = _sum(w * (diff * diff))
    for step in range(nstep + 1):
        span = np.where(flat, F32(1), mx - mn)
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / span
        la = np.clip(_rint(iscale[..., None] * (x - mn[..., None])), 0, nmax)
        lf = la.astype(F32)
        sum_l = _sum(w * lf)
        sum_l2 = _sum(w * lf * lf)
        sum_xl = _sum(w * lf * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = this_min > 0
        this_min = np.where(pos, F32(0), this_min)
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
        diff = this_scale[..., None] * lf + this_min[..., None] - x
        cur = _sum(w * (diff * diff))
        better = ok & (cur < best) & ~flat
        L = np.where(better[..., None], la, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    L = np.where(flat[..., None], 0, L)
    scale = np.where(flat, F32(0), scale)
    return scale.astype(F32), (-mn).astype(F32), L.astype(np.uint8)


def make_qx_quants(x: np.ndarray, nmax: int, qw: np.ndarray | None = None):
    """make_qx_quants with rmse_type 1: a symmetric fit x ~ scale * (L - nmax), L in [0, 2 nmax - 1], best of 19
    inverse scales -(nmax + 0.1 k) / max (max: the element of largest |x|, first one on ties), weights qw or x^2.
    Returns (scale [...], L uint8 [..., n]); an all-zero group gives scale 0 and L = 0."""
    x = np.asarray(x, F32)
    w = x * x if qw is None else np.asarray(qw, F32)
    idx = np.abs(x).argmax(-1)
    amax_v = np.take_along_axis(x, idx[..., None], -1)[..., 0]
    zero = np.abs(amax_v) < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), amax_v)

    def fit(iscale):
        l = np.clip(_rint(iscale[..., None] * x), -nmax, nmax - 1)
        lf = l.astype(F32)
        return l, _sum(w * x * lf), _sum(w * lf * lf)

    iscale = F32(-nmax) / mx
    l, sumlx, suml2 = fit(iscale)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    L = l + nmax
    for k in range(-9, 10):
        if k == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(k)) / mx
        l, sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[..., None], l + nmax, L)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    L = np.where(zero[..., None], 0, L)
    scale = np.where(zero, F32(0), scale)
    return scale.astype(F32), L.astype(np.uint8)


def make_qp_quants(x: np.ndarray, nmax: int, qw: np.ndarray):
    """make_qp_quants: x >= 0 (sub-block scales or mins) ~ scale * L, L in [0, nmax], weighted by qw; used by the
    imatrix paths of Q4_K / Q5_K to put the 8 sub-block scales on the 6-bit grid. Returns (scale, L uint8)."""
    x = np.asarray(x, F32)
    qw = np.asarray(qw, F32)
    mx = x.max(-1)
    zero = mx < GROUP_MAX_EPS
    mxs = np.where(zero, F32(1), mx)
    iscale = F32(nmax) / mxs
    L = _rint(iscale[..., None] * x)  # not clamped on this first pass (as in C)
    s0 = F32(1) / iscale
    diff = x - s0[..., None] * L.astype(F32)
    best = _sum(qw * diff * diff)
    for k in range(-4, 5):
        if k == 0:
            continue
        isc = (F32(0.1) * F32(k) + F32(nmax)) / mxs
        sc = F32(1) / isc
        l = np.minimum(_rint(isc[..., None] * x), nmax)
        diff = x - sc[..., None] * l.astype(F32)
        mse = _sum(qw * diff * diff)
        better = mse < best
        best = np.where(better, mse, best)
        iscale = np.where(better, isc, iscale)
    L = np.minimum(_rint(iscale[..., None] * x), nmax)
    lf = L.astype(F32)
    sumlx = _sum(qw * x * lf)
    suml2 = _sum(qw * lf * lf)
    n = x.shape[-1]
    for _ in range(5):  # coordinate descent on one L at a time, in index order
        changed = np.zeros(x.shape[:-1], bool)
        for i in range(n):
            wi, xi, li = qw[..., i], x[..., i], L[..., i].astype(F32)
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                new_l = np.minimum(_rint(np.where(ok, xi * sl2 / np.where(ok, slx, F32(1)), F32(0))), nmax)
            cand = ok & (new_l != L[..., i])
            nf = new_l.astype(F32)
            slx2 = slx + wi * xi * nf
            sl22 = sl2 + wi * nf * nf
            take = cand & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[..., i] = np.where(take, new_l, L[..., i])
            sumlx = np.where(take, slx2, sumlx)
            suml2 = np.where(take, sl22, suml2)
            changed |= take
        if not changed.any():
            break
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero[..., None], 0, L)
    return np.where(zero, F32(0), scale).astype(F32), L.astype(np.uint8)


# ---------------------------------------------------------------- byte layouts

def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [N, 8] -> the 12 packed bytes [N, 12] (get_scale_min_k4's inverse)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.zeros(sc.shape[:-1] + (12,), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out


def _unscales_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 0xF) | ((b[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _h16(a) -> np.ndarray:
    return _fp16(a).reshape(-1, 1).view(np.uint8)


def pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """d, dmin [N] (rounded to fp16 here), sc, m [N, 8] in [0, 63], q [N, 256] in [0, 15] -> bytes [N, 144].
    Nibbles: byte l of each 32-byte run holds element 64 c + l low and 64 c + 32 + l high."""
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # [N, chunk, half, l]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([_h16(d), _h16(dmin), _scales_k4(sc, m), qs], -1)


def pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    """As pack_q4_k with q in [0, 31]: bit 4 of element 64 c + l goes to qh[l] bit 2c, of 64 c + 32 + l to 2c+1."""
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    lo = q & 0xF
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 8, 32)  # [N, 2c + half, l]
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for bit in range(8):
        qh |= hi[:, bit] << bit
    return np.concatenate([_h16(d), _h16(dmin), _scales_k4(sc, m), qh, qs], -1)


def pack_q6_k(d, sc, q) -> np.ndarray:
    """d [N], sc int8 [N, 16], q [N, 256] in [0, 63] -> bytes [N, 210]. Per 128-weight half h, l < 32: ql[64h + l]
    = q[l] | q[l+64] << 4, ql[64h + 32 + l] = q[l+32] | q[l+96] << 4, qh[32h + l] = the four 2-bit highs."""
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [N, half, quarter, l]
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], -1).reshape(-1, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _h16(d)], -1)


def _qh32(q: np.ndarray) -> np.ndarray:
    """Fifth bits of 32 values [N, 32] -> little-endian uint32 as 4 bytes [N, 4]."""
    bits = (q >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=-1).astype("<u4").reshape(-1, 1).view(np.uint8)


def _nib16(q: np.ndarray) -> np.ndarray:
    return ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).astype(np.uint8)


def pack_q5_0(d, q) -> np.ndarray:
    """d [N], q [N, 32] in [0, 31] -> bytes [N, 22]."""
    q = q.astype(np.uint8)
    return np.concatenate([_h16(d), _qh32(q), _nib16(q)], -1)


def pack_q5_1(d, m, q) -> np.ndarray:
    """d, m [N], q [N, 32] in [0, 31] -> bytes [N, 24]."""
    q = q.astype(np.uint8)
    return np.concatenate([_h16(d), _h16(m), _qh32(q), _nib16(q)], -1)


def unpack(raw: np.ndarray, kind: str) -> dict:
    """The fields of `kind` blocks (bytes [N, BLOCK_BYTES]); inverse of the pack_* functions."""
    b = np.ascontiguousarray(raw, np.uint8).reshape(-1, BLOCK_BYTES[kind])
    f16 = lambda s: b[:, s].copy().view(np.float16)[:, 0].astype(F32)  # noqa: E731
    if kind in ("Q4_K", "Q5_K"):
        sc, m = _unscales_k4(b[:, 4:16])
        qs = b[:, -128:].reshape(-1, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], 2).reshape(-1, 256)
        if kind == "Q5_K":
            qh = b[:, 16:48]
            hi = np.stack([(qh >> bit) & 1 for bit in range(8)], 1).reshape(-1, 256)
            q = q | (hi << 4)
        return {"d": f16(slice(0, 2)), "dmin": f16(slice(2, 4)), "sc": sc, "m": m, "q": q}
    if kind == "Q6_K":
        ql = b[:, :128].reshape(-1, 2, 2, 32)  # [N, half, 0/32, l]
        qh = b[:, 128:192].reshape(-1, 2, 32)
        lo = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], 2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)
        q = (lo | (hi << 4)).reshape(-1, 256)
        return {"d": f16(slice(208, 210)), "sc": b[:, 192:208].view(np.int8), "q": q}
    if kind in ("Q5_0", "Q5_1"):
        off = 2 if kind == "Q5_0" else 4
        qh = b[:, off:off + 4].copy().view("<u4")[:, 0]
        nib = b[:, off + 4:]
        q = np.concatenate([nib & 0xF, nib >> 4], -1) | ((((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
                                                          .astype(np.uint8)) << 4)
        out = {"d": f16(slice(0, 2)), "q": q}
        if kind == "Q5_1":
            out["m"] = f16(slice(2, 4))
        return out
    raise ValueError(f"unpack: unknown block kind {kind!r}; known: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1")


def dequantize(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """Our decoder (ggml-quants.c's dequantize_row_*, same float32 operation order): bytes -> float32 `shape`."""
    f = unpack(raw, kind)
    if kind in ("Q4_K", "Q5_K"):
        d = (f["d"][:, None] * f["sc"].astype(F32))[:, :, None]  # [N, 8, 1]
        dm = (f["dmin"][:, None] * f["m"].astype(F32))[:, :, None]
        w = d * f["q"].reshape(-1, 8, 32).astype(F32) - dm
    elif kind == "Q6_K":
        d = (f["d"][:, None] * f["sc"].astype(F32))[:, :, None]  # [N, 16, 1]
        w = d * (f["q"].reshape(-1, 16, 16).astype(np.int32) - 32).astype(F32)
    elif kind == "Q5_0":
        w = f["d"][:, None] * (f["q"].astype(np.int32) - 16).astype(F32)
    else:
        w = f["d"][:, None] * f["q"].astype(F32) + f["m"][:, None]
    return w.reshape(shape)


# ---------------------------------------------------------------- llama.cpp's quantizers

def _requant(x, d, dm, sc, m, L, nmax):
    """Second pass of quantize_row_q{4,5}_K: each weight rounded to the stored (fp16, 6-bit) scales; sub-blocks
    whose scale is 0 keep the first pass's L."""
    dd = (d[:, None] * sc.astype(F32))  # [N, 8]
    mm = (dm[:, None] * m.astype(F32))
    ok = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l = np.clip(_rint((x + mm[..., None]) / np.where(ok, dd, F32(1))[..., None]), 0, nmax)
    return np.where(ok[..., None], l, L.astype(np.int32))


def _quantize_qk_asym(x: np.ndarray, qw: np.ndarray | None, kind: str) -> np.ndarray:
    """quantize_row_q4_K_ref / _q5_K_ref (qw None) and quantize_row_q4_K_impl / _q5_K_impl (with qw).
    x, qw: float32 [N, 256] super-blocks."""
    nmax = 15 if kind == "Q4_K" else 31
    xs = x.reshape(-1, 8, 32)
    if qw is None:
        av_x = np.sqrt(_sum(xs * xs) / F32(32))
        w = av_x[..., None] + np.abs(xs)
        rmin, nstep = (-1.0, 20) if kind == "Q4_K" else (-0.5, 15)
        scales, mins, L = make_qkx_quants(xs, w, nmax, rmin, 0.1, nstep)
        max_scale = np.maximum(scales.max(-1), F32(0))
        max_min = np.maximum(mins.max(-1), F32(0))
        with np.errstate(divide="ignore"):
            inv_s = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
            inv_m = np.where(max_min > 0, F32(63) / max_min, F32(0))
        ls = np.minimum(_rint(inv_s[:, None] * scales) & 0xFF, 63)  # uint8_t ls = nearest_int(...)
        lm = np.minimum(_rint(inv_m[:, None] * mins) & 0xFF, 63)
        d, dmin = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    else:
        qws = np.asarray(qw, F32).reshape(-1, 8, 32)
        sigma2 = F32(2) * _sum(x * x) / F32(QK_K)
        w = qws * np.sqrt(sigma2[:, None, None] + xs * xs)
        sw = _sum(w)
        scales, mins, L = make_qkx_quants(xs, w, nmax, -0.9, 0.05, 36)
        d_block, ls = make_qp_quants(scales, 63, sw)
        m_block, lm = make_qp_quants(mins, 63, sw)
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
        d, dmin = _fp16(d_block), _fp16(m_block)
    q = _requant(xs, d.astype(F32), dmin.astype(F32), ls, lm, L, nmax).reshape(-1, QK_K)
    pack = pack_q4_k if kind == "Q4_K" else pack_q5_k
    return pack(d, dmin, ls, lm, q)


def _quantize_q6_k(x: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    """quantize_row_q6_K_ref (qw None: weights x^2) / quantize_row_q6_K_impl (the imatrix itself as weights)."""
    xs = x.reshape(-1, 16, 16)
    scales, L = make_qx_quants(xs, 32, None if qw is None else np.asarray(qw, F32).reshape(-1, 16, 16))
    idx = np.abs(scales).argmax(-1)
    max_scale = np.take_along_axis(scales, idx[:, None], -1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d = _fp16(F32(1) / iscale)
    sc = np.minimum(_rint(iscale[:, None] * scales), 127).astype(np.int8)
    dd = d.astype(F32)[:, None] * sc.astype(F32)
    ok = dd != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l = np.clip(_rint(xs / np.where(ok, dd, F32(1))[..., None]), -32, 31) + 32
    q = np.where(ok[..., None], l, L.astype(np.int32)).reshape(-1, QK_K)
    out = pack_q6_k(d, sc, q)
    out[zero] = 0  # memset(&y[i], 0, ...)
    return out


def _quantize_q5_small(x: np.ndarray, qw: np.ndarray | None, kind: str, row_sigma2: np.ndarray) -> np.ndarray:
    """quantize_row_q5_0_impl / q5_1_impl (with qw; sigma2 is the whole row's mean x^2) or the _ref versions."""
    xb = x.reshape(-1, 32)
    if qw is None:
        if kind == "Q5_0":  # quantize_row_q5_0_ref: d = max / -16 (max: the element of largest |x|)
            idx = np.abs(xb).argmax(-1)
            mx = np.take_along_axis(xb, idx[:, None], -1)[:, 0]
            d = mx / F32(-16)
            with np.errstate(divide="ignore"):
                inv = np.where(d != 0, F32(1) / d, F32(0))
            q = np.minimum(np.trunc(xb * inv[:, None] + F32(16.5)).astype(np.int8).astype(np.int32), 31)
            return pack_q5_0(d, q)
        mn, mx = xb.min(-1), xb.max(-1)  # quantize_row_q5_1_ref
        d = (mx - mn) / F32(31)
        with np.errstate(divide="ignore"):
            inv = np.where(d != 0, F32(1) / d, F32(0))
        q = np.trunc((xb - mn[:, None]) * inv[:, None] + F32(0.5)).astype(np.uint8)
        return pack_q5_1(d, mn, q)
    w = np.asarray(qw, F32).reshape(-1, 32) * np.sqrt(row_sigma2[:, None] + xb * xb)
    if kind == "Q5_0":
        d, L = make_qx_quants(xb, 16, w)
        return pack_q5_0(d, L)
    d, the_min, L = make_qkx_quants(xb, w, 31, -0.9, 0.05, 36)
    return pack_q5_1(d, -the_min, L)


def quantize(w: np.ndarray, kind: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's quantizer for `kind` (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), as ggml_quantize_chunk runs it: rows of
    float32 w [R, K] -> block bytes uint8 [R, K / block * BLOCK_BYTES]. imatrix: float32 [K] importance per input
    column (mean x^2 of the layer's inputs) or None for the plain reference quantizer."""
    w = np.ascontiguousarray(w, F32)
    if w.ndim != 2:
        raise ValueError(f"quantize: weights must be 2-D [rows, columns], got shape {w.shape}")
    if kind not in BLOCK_BYTES or kind == "Q8_0":
        raise ValueError(f"quantize: unknown kind {kind!r}; choose Q4_K, Q5_K, Q6_K, Q5_0 or Q5_1 (Q8_0: gguf.quants)")
    rows, cols = w.shape
    blk = BLOCK_WEIGHTS[kind]
    if cols % blk:
        raise ValueError(f"quantize: rows of {cols} weights are not a whole number of {kind} blocks ({blk}); "
                         "use a type with 32-weight blocks (llama.cpp falls back to Q5_0 / Q5_1 / Q8_0)")
    qw = None
    if imatrix is not None:
        imatrix = np.asarray(imatrix, F32).reshape(-1)
        if imatrix.shape[0] != cols:
            raise ValueError(f"quantize: imatrix has {imatrix.shape[0]} values for rows of {cols} columns")
        qw = np.broadcast_to(imatrix, w.shape).reshape(-1, blk)
    x = w.reshape(-1, blk)
    if kind in ("Q4_K", "Q5_K"):
        out = _quantize_qk_asym(x, qw, kind)
    elif kind == "Q6_K":
        out = _quantize_q6_k(x, qw)
    else:
        sigma2 = _sum(w * w) / F32(cols)  # quantize_row_q5_{0,1}_impl: the row's mean square
        out = _quantize_q5_small(x, qw, kind, np.repeat(sigma2, cols // blk))
    return out.reshape(rows, -1)
