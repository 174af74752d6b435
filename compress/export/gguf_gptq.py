"""GPTQ onto llama.cpp's block grids: the codes of a GGUF tensor chosen by GPTQ (Frantar et al. 2022) instead of
rounding to nearest, with the grid (block scales, mins, 6-bit sub-block scales) that llama.cpp's imatrix
quantizer picks for the float weights (gguf_kquants.quantize with imatrix = the Hessian's diagonal).

The grid is fixed up front ("static groups"), so columns may be visited in act order (decreasing Hessian
diagonal); each column's codes are the nearest grid points of the weights as GPTQ has updated them, and its
rounding error is pushed onto the columns not yet quantized through the inverse Hessian's Cholesky factor.
The bytes are the grid's fields with the new codes; llama.cpp decodes them to exactly the weights this solve
scored (dequantize(bytes) == its w_hat, bit for bit).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .gguf_kquants import (BLOCK_WEIGHTS, pack_q4_k, pack_q5_0, pack_q5_1, pack_q5_k, pack_q6_k,
                           quantize as quantize_kquant, unpack)

DAMPENING = 0.01  # fraction of the mean Hessian diagonal added to it (GPTQ's default)
BLOCK_COLUMNS = 128  # lazy-update block


def _grid(w: np.ndarray, kind: str, imatrix: np.ndarray):
    """The block grid llama.cpp's quantizer picks for w [R, K]: per element scale s, offset o and code range
    [lo, hi] (w_hat = s * c - o, as the decoder computes it), the RTN codes c, and a function packing codes."""
    rows, cols = w.shape
    if kind == "Q8_0":  # quantize_row_q8_0_ref: d = amax / 127 (llama.cpp ignores the imatrix for Q8_0)
        import gguf
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
        d = raw[:, :2].copy().view(np.float16)[:, 0].astype(np.float32)
        c = raw[:, 2:].copy().view(np.int8).astype(np.int32)
        s = np.repeat(d[:, None], 32, 1)

        def pack(codes):
            return np.concatenate([raw[:, :2], codes.astype(np.int8).view(np.uint8)], -1)

        return s, np.zeros_like(s), -128, 127, c, pack
    raw = quantize_kquant(w, kind, imatrix)
    f = unpack(raw, kind)
    n = f["q"].shape[0]
    if kind in ("Q4_K", "Q5_K"):
        s = np.repeat(f["d"][:, None] * f["sc"].astype(np.float32), 32, 1)  # [n, 256]
        o = np.repeat(f["dmin"][:, None] * f["m"].astype(np.float32), 32, 1)
        pk = pack_q4_k if kind == "Q4_K" else pack_q5_k
        return s, o, 0, 15 if kind == "Q4_K" else 31, f["q"].astype(np.int32), \
            lambda c: pk(f["d"], f["dmin"], f["sc"], f["m"], c)
    if kind == "Q6_K":
        s = np.repeat(f["d"][:, None] * f["sc"].astype(np.float32), 16, 1)
        return s, np.zeros_like(s), -32, 31, f["q"].astype(np.int32) - 32, \
            lambda c: pack_q6_k(f["d"], f["sc"], c + 32)
    s = np.repeat(f["d"][:, None], 32, 1)
    if kind == "Q5_0":
        return s, np.zeros_like(s), -16, 15, f["q"].astype(np.int32) - 16, lambda c: pack_q5_0(f["d"], c + 16)
    o = np.repeat(-f["m"][:, None], 32, 1)  # Q5_1: w = d * q + m
    return s, o, 0, 31, f["q"].astype(np.int32), lambda c: pack_q5_1(f["d"], f["m"], c)


def _inverse_factor(h: Tensor) -> Tensor:
    """Upper Cholesky factor of H^-1 (after dampening), as GPTQ uses it."""
    h = h.clone()
    h.diagonal().add_(DAMPENING * float(h.diagonal().mean()))
    lower = torch.linalg.cholesky(h)
    return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)


def quantize_gptq_gguf(w: Tensor, hessian: Tensor, kind: str, imatrix: np.ndarray | None = None,
                       act_order: bool = True) -> np.ndarray:
    """GPTQ codes on llama.cpp's `kind` grid for float weights w [R, K] and the Hessian of their inputs
    H [K, K] (any positive multiple of X^T X). Returns the block bytes [R, K / block * size]."""
    w32 = w.detach().float().cpu().numpy()
    rows, cols = w32.shape
    h = hessian.detach().to(torch.float64).cpu().clone()
    if h.shape != (cols, cols):
        raise ValueError(f"hessian of shape {tuple(h.shape)} for weights of {cols} columns")
    imatrix = np.diag(h.numpy()).astype(np.float32) if imatrix is None else imatrix
    blk = BLOCK_WEIGHTS[kind]
    s, o, lo, hi, c0, pack = _grid(w32, kind, imatrix)
    S = torch.from_numpy(s.reshape(rows, cols))  # [R, K] scale of each weight's block
    O = torch.from_numpy(o.reshape(rows, cols))
    C0 = torch.from_numpy(c0.reshape(rows, cols))
    W = torch.from_numpy(w32.copy())  # [R, K], updated in place
    dead = torch.diag(h) == 0  # inputs never seen: their weights cannot matter
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(cols)
    W, S, O, C0 = W[:, perm], S[:, perm], O[:, perm], C0[:, perm]
    U = _inverse_factor(h[perm][:, perm]).float()  # [K, K]
    codes = torch.empty(rows, cols, dtype=torch.int32)
    for i1 in range(0, cols, BLOCK_COLUMNS):
        i2 = min(i1 + BLOCK_COLUMNS, cols)
        err_block = torch.zeros(rows, i2 - i1)
        for j in range(i1, i2):
            col, sj, oj = W[:, j], S[:, j], O[:, j]
            live = sj != 0
            q = torch.where(live, torch.round((col + oj) / torch.where(live, sj, torch.ones_like(sj))), C0[:, j]
                            .float()).clamp(lo, hi)
            w_hat = sj * q - oj  # what llama.cpp decodes (float32, the decoder's operation order)
            err = (col - w_hat) / U[j, j]
            W[:, j:i2] -= err[:, None] * U[j, j:i2][None, :]
            codes[:, j] = q.to(torch.int32)
            err_block[:, j - i1] = err
        W[:, i2:] -= err_block @ U[i1:i2, i2:]
    codes = codes[:, torch.argsort(perm)].numpy().reshape(-1, blk)
    return pack(codes).reshape(rows, -1)
