"""Deliberately naive reference quantizers: explicit loops over rows and groups, scalar math.

compress/ never imports this. Arithmetic is float32 like the library (so codes match exactly);
the loops and per-element rounding are written out independently of compress/core/primitives.py.
"""
from __future__ import annotations

import torch


def _groups(in_features: int, granularity: str, group_size: int | None):
    if granularity == "group":
        return [(g * group_size, (g + 1) * group_size) for g in range(in_features // group_size)]
    return [(0, in_features)]


def _cast_scale(x: float, scale_dtype: str) -> float:
    s = float(torch.tensor(x, dtype=torch.float32).to(getattr(torch, scale_dtype)).float())
    return s if s > 0 else 1.0


def naive_quantize(w: torch.Tensor, bits: int, granularity: str, group_size: int | None, symmetric: bool,
                   scale_dtype: str = "float16"):
    """Return (codes int64 [out, in], scale float32 [out, n_groups] or [1, 1], zero float32 or None)."""
    w = w.float()
    out_features, in_features = w.shape
    if symmetric:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        qmin, qmax = 0, 2 ** bits - 1
    if granularity == "tensor":
        rows = [w.reshape(1, -1)]
        spans = [(0, out_features * in_features)]
    else:
        rows = [w[r:r + 1] for r in range(out_features)]
        spans = _groups(in_features, granularity, group_size)
    codes = torch.zeros(len(rows), rows[0].shape[1], dtype=torch.int64)
    scales = torch.zeros(len(rows), len(spans))
    zeros = torch.zeros(len(rows), len(spans)) if not symmetric else None
    for r, row in enumerate(rows):
        for g, (a, b) in enumerate(spans):
            vals = row[0, a:b]
            if symmetric:
                absmax = torch.tensor(max(abs(float(v)) for v in vals), dtype=torch.float32)
                scale = _cast_scale(float(absmax / qmax), scale_dtype)
                zero = 0.0
            else:
                lo = torch.tensor(min(min(float(v) for v in vals), 0.0), dtype=torch.float32)
                hi = torch.tensor(max(max(float(v) for v in vals), 0.0), dtype=torch.float32)
                scale = _cast_scale(float((hi - lo) / (qmax - qmin)), scale_dtype)
                zero = float(min(max(torch.round(-lo / torch.tensor(scale, dtype=torch.float32)), qmin), qmax))
                zeros[r, g] = zero
            scales[r, g] = scale
            for j in range(a, b):
                q = torch.round(vals[j - a] / torch.tensor(scale, dtype=torch.float32)) + zero
                codes[r, j] = int(min(max(float(q), qmin), qmax))
    return codes.reshape(out_features, in_features), scales, zeros


def naive_dequantize(codes, scales, zeros, granularity: str, group_size: int | None):
    out_features, in_features = codes.shape
    flat = granularity == "tensor"
    c = codes.reshape(1, -1) if flat else codes
    spans = [(0, c.shape[1])] if granularity != "group" else _groups(in_features, granularity, group_size)
    w = torch.zeros(c.shape, dtype=torch.float32)
    for r in range(c.shape[0]):
        for g, (a, b) in enumerate(spans):
            z = 0.0 if zeros is None else float(zeros[r, g])
            for j in range(a, b):
                w[r, j] = (float(c[r, j]) - z) * float(scales[r, g])
    return w.reshape(out_features, in_features)


def naive_pack(u: list[int], bits: int) -> bytes:
    """Little-endian bit stream of one row of unsigned codes, padded with zero bits to whole words of lcm(bits, 8)."""
    import math

    word_bits = math.lcm(bits, 8)
    per_word = word_bits // bits
    u = list(u) + [0] * ((-len(u)) % per_word)
    out = bytearray()
    for w0 in range(0, len(u), per_word):
        word = 0
        for i, v in enumerate(u[w0:w0 + per_word]):
            word |= v << (bits * i)
        out += word.to_bytes(word_bits // 8, "little")
    return bytes(out)
