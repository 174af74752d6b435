"""AWQ (GEMM) checkpoint layout of a QuantizedTensor: pure functions, no I/O.

Layout, as AutoAWQ's `WQLinear_GEMM.from_linear` (casper-hansen/AutoAWQ, awq/modules/linear/gemm.py) writes it
and vLLM reads it (vllm/model_executor/layers/quantization/awq.py `AWQLinearMethod.create_weights`, awq_triton.py
`awq_dequantize_kernel`), for a linear layer with weight [N, K] (out_features, in_features) and group size G:

    qweight  int32   [K, N // 8]       8 unsigned 4-bit codes of one input row, along N, per int32
    qzeros   int32   [K // G, N // 8]  the groups' zero points, packed the same way
    scales   float16 [K // G, N]

Within each int32 the 4-bit field i (bits 4i..4i+3) holds output column 8*j + AWQ_ORDER[i], with
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (AutoAWQ's `order_map`); readers undo it with the inverse permutation
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7] (vLLM awq_triton.py, AutoAWQ awq/utils/packing_utils.py).
The weight is w[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n] (vLLM `awq_dequantize_kernel`; AutoAWQ
`dequantize_gemm`): zero points are stored as they are, with no offset.

Symmetric int4 codes q in [-8, 7] are written as unsigned q + 8 with zero point 8, which dequantizes to the
same numbers exactly, so both grids export bit for bit (with `zero_point: true`, which every AWQ GEMM loader
reads the qzeros of).

What is checked here is the format. vLLM's CUDA kernels add their own shape rules that this module does not
enforce: `awq_gemm` (csrc/quantization/awq/gemm_kernels.cu) needs N % 64 == 0, G % 32 == 0 and N % G == 0; the
Triton path takes G in {32, 64, 128} (or G == K); AWQ-Marlin takes G in {-1, 32, 64, 128} and N % 64 == 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme

PACK = 8  # 4-bit codes per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds column AWQ_ORDER[i] of its 8 columns
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of the 8 sits in field AWQ_REVERSE_ORDER[c]


def fractional_zero_problem(scheme: QuantScheme, fmt: str) -> str | None:
    """Formats that store integer zero points (AWQ, GPTQ, compressed-tensors) cannot hold HQQ's fractional ones."""
    if scheme.zero_point_dtype == "uint8":
        return None
    return (f"{fmt} checkpoints store integer zero points, and this scheme's are fractional (zero_point_dtype: "
            "float16, HQQ); set zero_point_dtype: uint8 (HQQ then rounds them) or export `dense`")


def common_problem(scheme: QuantScheme, shape: tuple[int, int] | None, fmt: str, example: str) -> str | None:
    """What AWQ and GPTQ checkpoints both refuse: quantized activations, non-float16 scales (they would not
    export bit for bit), and a group size that does not divide in_features."""
    if scheme.act is not None:
        return (f"{fmt} checkpoints are weight-only, but {scheme.name} also quantizes activations; "
                f"use a weight-only scheme (act: null) such as {example}")
    if (why := fractional_zero_problem(scheme, fmt)) is not None:
        return why
    if scheme.scale_dtype != "float16":
        return (f"{fmt} checkpoints store float16 scales and this scheme's are {scheme.scale_dtype}, which would not "
                "export bit for bit; set scheme.scale_dtype: float16")
    if shape is not None and scheme.granularity == "group" and shape[1] % scheme.group_size:
        return (f"in_features={shape[1]} is not divisible by group_size={scheme.group_size}; pick a group_size "
                "that divides it (e.g. 64 for 576)")
    return None


def awq_problem(scheme: QuantScheme, shape: tuple[int, int] | None = None) -> str | None:
    """None if a weight of `shape` ([out, in]; None checks the scheme alone) quantized with `scheme` can be
    written as an AWQ GEMM checkpoint bit for bit, else one sentence saying why not and what to change."""
    if scheme.act is not None:
        return common_problem(scheme, shape, "AWQ", "W4A16_G64")
    if scheme.dtype != "int4":
        return (f"AWQ GEMM checkpoints hold 4-bit integer weights only, not {scheme.dtype}; use dtype: int4 "
                "(8-bit weights can be exported as GPTQ instead)")
    if scheme.granularity != "group":
        return (f"AWQ checkpoints are group-quantized, not per {scheme.granularity}; set granularity: group with "
                "group_size 32, 64 or 128 (vLLM's AWQ GEMM kernel needs out_features % group_size == 0, so "
                "per-channel AWQ (group_size -1) does not load there)")
    if (why := common_problem(scheme, shape, "AWQ", "W4A16_G64")) is not None:
        return why
    if shape is not None:
        n, k = shape
        if n % PACK:
            return (f"out_features={n} is not a multiple of {PACK} (AWQ packs 8 output columns per int32); "
                    "leave this layer in float (modules_to_not_convert)")
    return None


def pack_int32_fields(u: Tensor, bits: int) -> Tensor:
    """u [..., 32 // bits] (values < 2**bits) -> int32 [...]: field i at bits [bits*i, bits*(i+1))."""
    shifts = torch.arange(u.shape[-1], device=u.device, dtype=torch.int64) * bits
    word = (u.to(torch.int64) << shifts).sum(dim=-1)  # exact in int64: < 2**32
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)  # same 32 bits, signed


def _pack_awq(x: Tensor) -> Tensor:
    """x [R, N] unsigned 4-bit values -> int32 [R, N // 8] in AWQ's interleaved order."""
    r, n = x.shape
    grouped = x.reshape(r, n // PACK, PACK)[..., list(AWQ_ORDER)]  # field i <- column AWQ_ORDER[i]
    return pack_int32_fields(grouped, 4)


def awq_tensors(qt: QuantizedTensor) -> dict[str, Tensor]:
    """The `qweight`, `qzeros` and `scales` tensors of one AWQ GEMM linear layer (bias is the caller's)."""
    problem = awq_problem(qt.scheme, qt.shape)
    if problem:
        raise ValueError(problem)
    n, k = qt.shape
    u = qt.codes() - qt.scheme.qmin  # unsigned codes in [0, 15], int32 [N, K]
    if qt.zero_point is not None:
        zero = qt.zero_point.to(torch.int32)  # [N, K // G]
    else:  # symmetric: q = u - 8, so w = q * s = (u - 8) * s
        zero = torch.full(qt.scale.shape, -qt.scheme.qmin, dtype=torch.int32, device=u.device)
    return {
        "qweight": _pack_awq(u.t().contiguous()),  # [K, N // 8]
        "qzeros": _pack_awq(zero.t().contiguous()),  # [K // G, N // 8]
        "scales": qt.scale.to(torch.float16).t().contiguous(),  # [K // G, N]
    }


def awq_config(scheme: QuantScheme, modules_to_not_convert: list[str] | None = None) -> dict:
    """`quantization_config` for config.json, as AutoAWQ's `AwqConfig.to_transformers_dict` writes it
    (awq/models/_config.py) and transformers' `AwqConfig` / vLLM's `AWQConfig.from_config` read it.
    `modules_to_not_convert`: names of linear layers left in float (vLLM skips a layer whose name contains one)."""
    problem = awq_problem(scheme)
    if problem:
        raise ValueError(problem)
    return {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": scheme.group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": list(modules_to_not_convert) if modules_to_not_convert else None,
    }


def awq_dequantize(qweight: Tensor, qzeros: Tensor, scales: Tensor) -> Tensor:
    """Read one AWQ GEMM layer back: float32 [N, K] with w = (q - z) * s (vLLM's awq_dequantize_triton)."""
    def unpack(x: Tensor) -> Tensor:  # int32 [R, C] -> [R, 8 C] in column order
        fields = (x.to(torch.int64)[..., None] >> (torch.arange(PACK, device=x.device) * 4)) & 0xF  # [R, C, 8]
        inverse = [AWQ_ORDER.index(j) for j in range(PACK)]  # column j sits in field AWQ_ORDER.index(j)
        return fields[..., inverse].reshape(x.shape[0], -1)
    q, z = unpack(qweight), unpack(qzeros)  # [K, N], [K / G, N]
    group = q.shape[0] // z.shape[0]
    w = (q - z.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)
    return w.t().contiguous()
