"""Deliberately naive references for the 8-bit formats: fp8 rounding by table lookup, per-token int8
activations, LLM.int8's decomposition and SmoothQuant's scales, with explicit loops. compress/ never
imports this; float64 where the library's float32 rounding is not what is being checked."""
from __future__ import annotations

import math

import torch

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_table(dtype: str) -> list[tuple[float, int]]:
    """Every finite value of the format with its bit pattern, from decoding all 256 bytes."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8[dtype]).float().tolist()
    return sorted((v, b) for b, v in enumerate(values) if math.isfinite(v))


def naive_cast_fp8(xs: list[float], dtype: str) -> list[int]:
    """Bit patterns of round-to-nearest-even with saturation at the largest finite value."""
    table = fp8_table(dtype)
    top = max(v for v, _ in table)
    out = []
    for x in xs:
        x = min(max(x, -top), top)
        below = max(((v, b) for v, b in table if v <= x), key=lambda t: (t[0], -t[1] & 0x80))
        above = min(((v, b) for v, b in table if v >= x), key=lambda t: (t[0], t[1] & 0x80))
        if x - below[0] < above[0] - x:
            pick = below
        elif above[0] - x < x - below[0]:
            pick = above
        else:  # a tie (or exact): the even mantissa, i.e. the even bit pattern
            pick = below if below[1] % 2 == 0 else above
        if pick[0] == 0.0:  # zero keeps the sign of x, as a hardware cast does
            pick = (0.0, 0x80 if math.copysign(1.0, x) < 0 else 0)
        out.append(pick[1])
    return out


def naive_fp8_weight(w: torch.Tensor, dtype: str, granularity: str, block: int | None = None):
    """(values float32 [out, in] on the fp8 grid, scale per row / tile / tensor) with absmax / fp8_max scales."""
    top = max(v for v, _ in fp8_table(dtype))
    n, k = w.shape
    if granularity == "tensor":
        tiles = [(0, n, 0, k)]
    elif granularity == "channel":
        tiles = [(r, r + 1, 0, k) for r in range(n)]
    else:
        tiles = [(r, r + block, c, c + block) for r in range(0, n, block) for c in range(0, k, block)]
    values = torch.zeros(n, k)
    scales = []
    for r0, r1, c0, c1 in tiles:
        t = w[r0:r1, c0:c1].float()
        s = float(t.abs().max()) / top
        s = float(torch.tensor(s, dtype=torch.float32))
        s = s if s > 0 else 1.0
        bits = naive_cast_fp8((t / s).reshape(-1).tolist(), dtype)
        dec = torch.tensor(bits, dtype=torch.int32).to(torch.uint8).view(FP8[dtype]).float().reshape(t.shape)
        values[r0:r1, c0:c1] = dec
        scales.append(s)
    return values, scales


def naive_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: codes round(x / s) with s = absmax / 127, row by row."""
    codes = torch.zeros(x.shape, dtype=torch.int64)
    scales = torch.zeros(x.shape[0])
    for r in range(x.shape[0]):
        s = float(x[r].abs().max()) / 127.0
        s = s if s > 0 else 1.0
        scales[r] = s
        for c in range(x.shape[1]):
            codes[r, c] = max(-127, min(127, round(float(x[r, c]) / s)))
    return codes, scales


def naive_llm_int8(x: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """LLM.int8 in float64: outlier columns (|x| >= threshold anywhere) in float against the int8-dequantized
    weight columns; the rest int8 per row (absmax over non-outlier columns) x int8 per output channel."""
    x, w = x.double(), w.double()
    m, k = x.shape
    outliers = [c for c in range(k) if any(abs(float(x[r, c])) >= threshold for r in range(m))]
    w_scale = w.abs().amax(dim=1) / 127.0
    w_scale = torch.where(w_scale > 0, w_scale, torch.ones_like(w_scale))
    w_codes = torch.clamp(torch.round(w / w_scale[:, None]), -127, 127)
    w_hat = w_codes * w_scale[:, None]
    y = torch.zeros(m, w.shape[0], dtype=torch.float64)
    rest_cols = [c for c in range(k) if c not in outliers]
    for r in range(m):
        a = max((abs(float(x[r, c])) for c in rest_cols), default=0.0) / 127.0
        a = a if a > 0 else 1.0
        xq = torch.tensor([round(float(x[r, c]) / a) if c in rest_cols else 0 for c in range(k)], dtype=torch.float64)
        y[r] = (xq @ w_codes.T) * a * w_scale
        for c in outliers:
            y[r] += x[r, c] * w_hat[:, c]
    return y


def naive_smoothing_scales(x_absmax: list[float], w_absmax: list[float], alpha: float) -> list[float]:
    return [1.0 if xa == 0 else max(max(xa, 1e-5) ** alpha / max(wa, 1e-5) ** (1 - alpha), 1e-5)
            for xa, wa in zip(x_absmax, w_absmax)]
