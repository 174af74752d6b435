"""llama.cpp's 32-weight block formats: our integer codes and scales re-encoded exactly ("exact"), and float weights
quantized with llama.cpp's quantizers.

Block formats (32 weights a block, gguf-py's quants.py and ggml-quants.c):
  Q8_0  fp16 d, 32 x int8 q                      w = d * q
  Q4_0  fp16 d, 16 bytes of nibbles              w = d * (n - 8)
  Q4_1  fp16 d, fp16 m, 16 bytes of nibbles      w = d * n + m
Nibbles: byte j of a block holds element j in its low half and element j + 16 in its high half.

A quantized layer whose grid is the block format's (symmetric int4 with groups of 32 or a multiple of 32
-> Q4_0; int4 asymmetric -> Q4_1; symmetric int8 -> Q8_0; narrower grids fit too) is re-encoded from its
integer codes and scales as they are (`exact_fit`, `encode_exact`): llama.cpp then computes with the very weights
the in-memory model uses. Q4_1 stores m = -zero * scale in fp16, so m is rounded (reported). Any other weight is
quantized by `quantize_float`: llama.cpp's reference quantizer (gguf.quants.quantize) or our port of its
K-quant / Q5 quantizers (gguf_kquants.py).

For the llama architecture the rows of attn_q / attn_k are permuted per head (`permute_rows`); the permutation
moves whole output rows, so the codes and scales of a quantized layer move with their rows and the blocks along
the input stay intact.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..core.qtensor import QuantizedTensor
from .gguf_kquants import BLOCK_BYTES as KQ_BLOCK_BYTES, pack_q5_0, pack_q5_1, quantize as quantize_kquant
from .gguf_names import gguf_package

BLOCK = 32  # weights per Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 block (K-quants: super-blocks of 256, gguf_kquants.py)


def ggml_type(name: str):
    """gguf.GGMLQuantizationType of a block type name (q8_0, Q4_K, ...)."""
    return getattr(gguf_package().GGMLQuantizationType, name.upper())


def permute_rows(t: Tensor, n_head: int) -> Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute on the first (output) axis: within each head, rows
    [r0..r(d/2-1) | r(d/2)..r(d-1)] become interleaved pairs (r0, r(d/2), r1, r(d/2+1), ...)."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _per_block(t: Tensor, qt: QuantizedTensor) -> Tensor:
    """A scale / zero-point tensor as one value per 32-weight block: float32 [out, in // 32]."""
    n_out, n_in = qt.shape
    nb = n_in // BLOCK
    t = t.float()
    if qt.scheme.granularity == "group":
        return t.reshape(n_out, -1).repeat_interleave(qt.scheme.group_size // BLOCK, dim=1)
    return t.reshape(-1, 1).expand(n_out, nb) if t.numel() > 1 else t.reshape(1, 1).expand(n_out, nb)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    """float [R, nb] -> uint8 [R, nb, 2] (little-endian fp16)."""
    return np.ascontiguousarray(x.astype("<f2")).reshape(*x.shape, 1).view(np.uint8)


def _nibbles(n: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values [R, nb * 32] -> uint8 [R, nb, 16]: low half element j, high half j + 16."""
    v = n.astype(np.uint8).reshape(n.shape[0], -1, 2, BLOCK // 2)
    return v[:, :, 0, :] | (v[:, :, 1, :] << np.uint8(4))


def encode_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """int8 values [R, K] and per-block scales [R, K // 32] -> Q8_0 bytes [R, K // 32 * 34]."""
    qs = np.ascontiguousarray(q.astype(np.int8)).reshape(q.shape[0], -1, BLOCK).view(np.uint8)
    return np.concatenate([_fp16_bytes(d), qs], axis=-1).reshape(q.shape[0], -1)


def encode_q4_0(n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Nibbles n = q + 8 in [0, 15] [R, K] and scales [R, K // 32] -> Q4_0 bytes [R, K // 32 * 18]."""
    return np.concatenate([_fp16_bytes(d), _nibbles(n)], axis=-1).reshape(n.shape[0], -1)


def encode_q4_1(n: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Nibbles [R, K], scales and minimums [R, K // 32] -> Q4_1 bytes [R, K // 32 * 20]."""
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(m), _nibbles(n)], axis=-1).reshape(n.shape[0], -1)


def exact_fit(qt: QuantizedTensor, qtype: str) -> str | None:
    """Why this quantized weight cannot be re-encoded exactly as `qtype` (None: it can)."""
    s = qt.scheme
    if qtype == "f16":
        return "F16 holds float weights"
    if s.act is not None or s.is_float:
        return f"{s.name} is not an integer weight-only grid"
    if qt.shape[1] % BLOCK:
        return f"in_features={qt.shape[1]} is not a multiple of {BLOCK}"
    if s.granularity == "group" and s.group_size % BLOCK:
        return f"group_size={s.group_size} is not a multiple of {BLOCK}"
    if s.zero_point_dtype != "uint8" and qtype != "q4_1":
        return "fractional zero points (HQQ) fit Q4_1's float minimum only"
    if qtype == "q8_0" and not (s.symmetric or s.bits <= 7):
        return "asymmetric int8 codes minus their zero point span [-255, 255], beyond int8"
    if qtype == "q4_0" and not (s.symmetric and s.bits <= 4):
        return "Q4_0 holds symmetric grids of at most 4 bits"
    if qtype == "q4_1" and s.bits > 4:
        return "Q4_1 holds grids of at most 4 bits"
    if qtype == "q5_0" and not (s.symmetric and s.bits <= 5):
        return "Q5_0 holds symmetric grids of at most 5 bits"
    if qtype == "q5_1" and s.bits > 5:
        return "Q5_1 holds grids of at most 5 bits"
    if qtype in ("q4_k", "q5_k", "q6_k"):
        # a K-quant stores each 32 (Q6_K: 16) weights' scale as a 6-bit (8-bit) multiple of one fp16 value per 256
        # weights; our per-group fp16 scales (and zero points) are not on such a grid
        return f"{qtype.upper()} keeps per-256-weight double-quantized 6-bit scales; {s.name}'s scales are not on " \
               "that grid"
    return None


def encode_exact(qt: QuantizedTensor, qtype: str, n_head: int | None = None) -> tuple[np.ndarray, dict]:
    """Our codes and scales in `qtype`'s blocks, rows permuted per head when n_head is given.
    Returns the block bytes [out, nbytes] and notes (scale / minimum rounding to fp16)."""
    s = qt.scheme
    codes = qt.codes()  # int32 [out, in]: signed (symmetric) or unsigned (asymmetric)
    d = _per_block(qt.scale, qt)
    zero = None if qt.zero_point is None else _per_block(qt.zero_point, qt)
    m = None
    if qtype == "q8_0":
        vals = codes if s.symmetric else codes - zero.repeat_interleave(BLOCK, dim=1).to(torch.int32)
    elif qtype in ("q4_0", "q5_0"):
        vals = codes + (8 if qtype == "q4_0" else 16)
    else:  # q4_1 / q5_1: w = d * n + m
        if s.symmetric:
            half = 8 if qtype == "q4_1" else 16
            vals, m = codes + half, -float(half) * d
        else:
            vals, m = codes, -zero * d  # exact in float32 (a small integer times an fp16 value)
    if n_head is not None:
        vals, d = permute_rows(vals, n_head), permute_rows(d, n_head)
        m = None if m is None else permute_rows(m, n_head)
    notes = {}
    d16 = d.half().float()
    if not torch.isfinite(d16).all():
        raise ValueError("a scale overflows fp16")
    if not torch.equal(d16, d):
        notes["scale_rounded_to_fp16_max_rel"] = float(((d16 - d).abs() / d.abs().clamp(min=1e-30)).max())
    if m is not None:
        m_err = float((m.half().float() - m).abs().max())
        if m_err:
            notes["m_rounded_to_fp16_max_abs"] = m_err
    v, dn = vals.numpy(), d.numpy()
    if qtype == "q8_0":
        return encode_q8_0(v, dn), notes
    if qtype == "q4_0":
        return encode_q4_0(v, dn), notes
    if qtype == "q5_0":
        return pack_q5_0(dn.reshape(-1), v.reshape(-1, BLOCK)).reshape(v.shape[0], -1), notes
    if qtype == "q5_1":
        return pack_q5_1(dn.reshape(-1), m.numpy().reshape(-1), v.reshape(-1, BLOCK)) \
            .reshape(v.shape[0], -1), notes
    return encode_q4_1(v, dn, m.numpy()), notes


def quantize_float(w: Tensor, ggml_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's quantizer for `ggml_name` (K-quants, Q5_0, Q5_1: our port in gguf_kquants.py, with the
    importance matrix when given; Q8_0 / Q4_0 / Q4_1: gguf-py's reference quantizer), or a float cast."""
    a = w.detach().float().cpu().numpy()
    if ggml_name == "F32":
        return a.astype(np.float32)
    if ggml_name == "F16":
        return a.astype(np.float16)
    if ggml_name in KQ_BLOCK_BYTES and ggml_name != "Q8_0":
        rows = a.reshape(-1, a.shape[-1])
        return quantize_kquant(rows, ggml_name, imatrix).reshape(*a.shape[:-1], -1)
    return gguf_package().quants.quantize(a, ggml_type(ggml_name))

