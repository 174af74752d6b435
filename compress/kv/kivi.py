"""int8 / int4 KV cache, KIVI-style (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache"): keys quantized per channel over chunks of `group` consecutive tokens, values per token over groups of
`group` channels, both asymmetric (min/max with a zero point); the most recent tokens stay in float (the residual).

A serving cache holds the last tokens in float and, once `group` of them have left the residual window of `residual`
tokens, quantizes them as one chunk (a key channel's range is only known over several tokens: why keys need the
chunk and the float window). So when query i attends, key/value j is float when j >= group * floor((i - residual +
1) / group) (its chunk has not left the window yet) and quantized otherwise. Quantizing is deterministic and
depends only on the chunk's own tokens, so fake-quantizing from the float keys at every attention call (what
`kivi_attention` does, on a prefill of a whole window as on a decode step) is exactly what attending over such a
cache computes: one forward over a 2048-token window scores what decoding token by token from the cache would.

Memory per cached element: bits / 8 plus, for keys, a float16 scale and zero per channel per chunk and, for values,
the same per token per channel group: 4 / group bytes; the float residual adds up to residual + group - 1 tokens at
2 bytes per element, per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

KV_BITS = (8, 4)


@dataclass(frozen=True)
class KVQuant:
    """The KV-cache format. bits: 8 or 4; group: tokens per key chunk and channels per value group (divides the
    head dimension); residual: recent tokens kept in float (0: every token quantized, as a simple per-token
    scheme would)."""
    bits: int = 4
    group: int = 32
    residual: int = 128

    def __post_init__(self):
        if self.bits not in KV_BITS:
            raise ValueError(f"KV cache bits={self.bits}: use 8 or 4 (fp8 scales: the kv_cache stage's fp8_e4m3)")
        if self.group < 1:
            raise ValueError(f"KV cache group={self.group}: give a positive number of tokens / channels (e.g. 32)")
        if self.residual < 0:
            raise ValueError(f"KV cache residual={self.residual}: give 0 or more recent tokens to keep in float")

    @property
    def name(self) -> str:
        return f"int{self.bits}-kivi-g{self.group}-r{self.residual}"

    def bytes_per_element(self) -> float:
        """Quantized elements with their scales and zeros (float16): the residual window is apart (per sequence)."""
        return self.bits / 8 + 4 / self.group

    def to_dict(self) -> dict:
        return {"dtype": f"int{self.bits}", "group": self.group, "residual": self.residual}


def _wide(t: Tensor) -> Tensor:
    """t in float32, or float64 if it is."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _fake_quant(t: Tensor, bits: int, dim: int) -> Tensor:
    """Asymmetric min/max fake quantization of t with one range per slice along every axis but `dim` (reduced)."""
    qmax = 2 ** bits - 1
    lo, hi = t.amin(dim, keepdim=True), t.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).clamp_min(1e-8)
    codes = torch.round((t - lo) / scale).clamp_(0, qmax)
    return codes * scale + lo


def quantize_keys(k: Tensor, kv: KVQuant) -> Tensor:
    """k [B, H, S, D] -> per-channel fake-quantized over chunks of kv.group tokens (a last partial chunk over the
    tokens it has; under a residual window it is always float)."""
    B, H, S, D = k.shape
    pad = -S % kv.group
    x = torch.cat([k, k[:, :, -1:].expand(B, H, pad, D)], 2) if pad else k  # repeat the last token: range unchanged
    x = x.reshape(B, H, -1, kv.group, D)  # [B, H, chunks, group, D]
    return _fake_quant(_wide(x), kv.bits, 3).reshape(B, H, -1, D)[:, :, :S].to(k.dtype)


def quantize_values(v: Tensor, kv: KVQuant) -> Tensor:
    """v [B, H, S, D] -> per-token fake-quantized over groups of kv.group channels."""
    B, H, S, D = v.shape
    if D % kv.group:
        raise ValueError(f"KV cache group={kv.group} does not divide the head dimension {D}; use a divisor "
                         f"(e.g. {next(g for g in (64, 32, 16, 8, 4, 2, 1) if D % g == 0)})")
    x = v.reshape(B, H, S, D // kv.group, kv.group)
    return _fake_quant(_wide(x), kv.bits, 4).reshape(B, H, S, D).to(v.dtype)


def float_window(q_pos: Tensor, k_pos: Tensor, kv: KVQuant) -> Tensor:
    """[T, S] bool: key j is still float (in the residual, chunk not flushed) when query i attends."""
    start = torch.div(q_pos - kv.residual + 1, kv.group, rounding_mode="floor") * kv.group
    return k_pos[None, :] >= start[:, None]


def _repeat_kv(x: Tensor, n: int) -> Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def kivi_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   kv: KVQuant, scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Attention over a KIVI cache, for transformers' attention interface: query [B, Hq, T, D], key / value
    [B, Hkv, S, D] (the whole cache, float), positions assumed 0..S-1 with the T queries last (no left padding).
    Scores use the quantized key where the key is flushed and the float one in the window; so do the values.
    Returns (output [B, T, Hq, D], None) as eager attention does."""
    if kwargs.get("sliding_window") or kwargs.get("softcap") or getattr(module, "sliding_window", None):
        raise ValueError("the int KV cache emulation supports full causal attention only (no sliding window or "
                         "logit softcapping); use the fp8 kv_cache or a model without them")
    B, Hq, T, D = query.shape
    S = key.shape[2]
    n_rep = Hq // key.shape[1]
    scaling = D ** -0.5 if scaling is None else scaling
    q, k, v = _wide(query), _wide(key), _wide(value)
    kq, vq = quantize_keys(k, kv), quantize_values(v, kv)
    k, v, kq, vq = (_repeat_kv(x, n_rep) for x in (k, v, kq, vq))
    near = float_window(torch.arange(S - T, S, device=q.device), torch.arange(S, device=q.device), kv)  # [T, S]
    scores = torch.where(near, q @ k.transpose(-1, -2), q @ kq.transpose(-1, -2)) * scaling  # [B, Hq, T, S]
    allowed = torch.arange(S, device=q.device)[None, :] <= torch.arange(S - T, S, device=q.device)[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if attention_mask is not None:  # eager: additive float [B, 1, T, S]; sdpa: bool, True = attend
        m = attention_mask[..., :S]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(scores.dtype)
    p = torch.softmax(scores, -1)
    out = (p * near) @ v + (p * ~near) @ vq  # [B, Hq, T, D]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
