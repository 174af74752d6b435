"""Pure-torch matmuls for quantized weights and activations: x [M, K] @ w [N, K]^T -> [M, N].

Each function is the plain definition of its format, and some take the integer route torch offers
(`torch._int_mm`: int8 x int8 -> int32, exact accumulation), which on this CPU beats float32 F.linear
(bench/int8_matmul.py). The fake-quantized float matmul (quantize-dequantize x and w, then F.linear) is
the oracle every other path is tested against.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from .primitives import activation_qparams, fake_quantize_activation, quantize_activation
from .scheme import ActScheme

INV_127 = 1.0 / 127.0  # int8 codes were scaled by 127 / absmax


def int_mm_ok(x2: Tensor, n: int) -> bool:
    """torch._int_mm runs on CPU for any shape; on CUDA it needs M > 16 and K, N multiples of 8."""
    if x2.device.type == "cpu":
        return True
    return x2.device.type == "cuda" and x2.shape[0] > 16 and x2.shape[1] % 8 == 0 and n % 8 == 0


def int8_matmul(xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor) -> Tensor:
    """(xq [M, K] int8 * x_scale [M, 1] or []) @ (wq [N, K] int8 * w_scale [N, 1] or [])^T, float32 [M, N].
    Integer accumulation in int32 (exact), one float multiply per output."""
    if int_mm_ok(xq, wq.shape[0]):
        acc = torch._int_mm(xq, wq.t())  # [M, N] int32; a transposed [N, K] weight is the fast layout here
    else:
        acc = xq.float() @ wq.float().t()  # exact as well: |products| < 2**24 for K < 1040
    return acc.float() * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)


def linear_fake_quant(x: Tensor, w: Tensor, act: ActScheme, input_scale: Tensor | None, bias: Tensor | None) -> Tensor:
    """The oracle: quantize-dequantize the activations, then a float matmul with the dequantized weight w."""
    return F.linear(fake_quantize_activation(x, act, input_scale), w.to(x.dtype), bias)


def linear_w8a8_int8(x: Tensor, wq: Tensor, w_scale: Tensor, act: ActScheme, input_scale: Tensor | None,
                     bias: Tensor | None) -> Tensor:
    """Symmetric int8 activations (per token, dynamic or static per tensor) x int8 weights (per channel or tensor)."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if act.dynamic:
        scale, _ = activation_qparams(x2, act)
    else:
        scale = input_scale.float()
    y = int8_matmul(quantize_activation(x2, act, scale), scale, wq, w_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0])


def outlier_columns(x2: Tensor, threshold: float) -> Tensor:
    """LLM.int8's dynamic rule (as bitsandbytes): every input feature with |x| >= threshold in any row."""
    return torch.nonzero((x2.abs() >= threshold).any(dim=0)).reshape(-1)


def linear_llm_int8(x: Tensor, wq: Tensor, w_scale: Tensor, threshold: float, cols: Tensor | None,
                    bias: Tensor | None, use_int_mm: bool = True,
                    scaling: str = "exclude_columns") -> tuple[Tensor, int]:
    """LLM.int8() mixed-precision decomposition (Dettmers et al. 2022, eq. 4):

        y = x[:, O] @ w_hat[:, O]^T  +  s_x * s_w * (Q(x[:, ~O]) @ Q(w[:, ~O])^T)

    O: outlier input features (`cols`, or chosen per batch with `outlier_columns` when None), computed in the
    activations' float dtype against the dequantized int8 weight columns (as bitsandbytes does with int8-only
    weights); the rest with per-row absmax int8 activations and per-output-channel int8 weights. The row
    absmax excludes the outlier features (scaling="exclude_columns", the paper), or only the elements at or
    above the threshold, from float16 inputs (scaling="exclude_elements", bitsandbytes' implementation).
    Returns (y, number of outlier features used).
    """
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if cols is None:
        cols = outlier_columns(x2, threshold)
    rest = x2
    if scaling == "exclude_elements":
        rest = x2.half().float()
        absmax = torch.where(rest.abs() >= threshold, 0.0, rest).abs().amax(dim=-1, keepdim=True)  # [M, 1]
        if cols.numel():
            rest = rest.clone()
            rest[:, cols] = 0
    else:
        if cols.numel():
            rest = x2.clone()
            rest[:, cols] = 0
        absmax = rest.float().abs().amax(dim=-1, keepdim=True)  # [M, 1]
    x_scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax)) * INV_127
    xq = torch.clamp(torch.round(rest.float() / x_scale), -127, 127).to(torch.int8)
    if use_int_mm:
        y = int8_matmul(xq, x_scale, wq, w_scale)
    else:  # the float oracle of the int8 part
        y = (xq.float() * x_scale) @ (wq.float() * w_scale.float().reshape(-1, 1)).t()
    if cols.numel():
        w_cols = wq[:, cols].float() * w_scale.float().reshape(-1, 1)  # [N, |O|] dequantized
        y = y + x2[:, cols].float() @ w_cols.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], wq.shape[0]), int(cols.numel())


def linear_bitsandbytes(x: Tensor, wq: Tensor, w_scale: Tensor, threshold: float, bias: Tensor | None) -> Tensor:
    """bitsandbytes' LLM.int8 matmul (`Linear8bitLt`'s path) on our int8 weight: CB = codes, SCB = row absmax.
    bitsandbytes quantizes activations from float16 and picks outlier columns per batch."""
    import bitsandbytes as bnb

    state = bnb.MatmulLtState()
    state.CB, state.SCB = wq, (w_scale.float().reshape(-1) * 127.0).contiguous()
    state.threshold, state.has_fp16_weights, state.is_training = threshold, False, False
    return bnb.matmul(x, wq, bias=None if bias is None else bias.to(x.dtype), state=state, threshold=threshold)
