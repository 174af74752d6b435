"""GPTQ (v1, `checkpoint_format: gptq`) checkpoint layout of a QuantizedTensor: pure functions, no I/O.

Layout, as AutoGPTQ's `QuantLinear.pack` writes it (AutoGPTQ/AutoGPTQ, auto_gptq/nn_modules/qlinear/
qlinear_cuda_old.py, qlinear_cuda.py, qlinear_exllama.py, qlinear_triton.py) and vLLM's `GPTQLinearMethod`
(vllm/model_executor/layers/quantization/gptq.py) reads it, for a weight [N, K] with b-bit codes (b in {4, 8}),
P = 32 // b codes per int32 and group size G (G = K for per-channel, written as group_size -1):

    qweight  int32   [K // P, N]       codes packed along K: word r of column n holds k = r*P + j at bits b*j
    qzeros   int32   [K // G, N // P]  zero points packed along N: word c holds n = c*P + j at bits b*j
    scales   float16 [K // G, N]
    g_idx    int32   [K]               group of each input feature, k // G (no act-order: desc_act false)

Zero points, v1 convention: the stored field is zero - 1. AutoGPTQ's pack does `zeros -= 1` before packing, and
every v1 reader adds the 1 back (`zeros = zeros + 1` in AutoGPTQ's dequantizing forwards and in vLLM's older
torch path; vLLM's `gptq_gemm` kernels take `use_v2_format = checkpoint_format == "gptq_v2"` and add 1 otherwise;
transformers' GPTQConfig defaults `format` to "gptq", i.e. v1). So w[n, k] = (q - (stored + 1)) * s.
Consequence: a zero point of 0 (an asymmetric group with no negative weight) has no v1 encoding; it would wrap to
2**b - 1 and read back as 2**b. `gptq_tensors` refuses such a weight rather than write a wrong one.

Symmetric codes q in [-2**(b-1), 2**(b-1) - 1] are written as unsigned u = q + 2**(b-1) with zero point 2**(b-1)
(stored 2**(b-1) - 1, i.e. 0x77777777 for 4 bits), which is what AutoGPTQ's symmetric quantizer produces
(auto_gptq/quantization/quantizer.py: zero = (maxq + 1) / 2) and what vLLM's GPTQ-Marlin assumes for sym=True
(uint4b8 / uint8b128: an implicit bias of 8 / 128).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme
from .awq import common_problem, pack_int32_fields


def gptq_problem(scheme: QuantScheme, shape: tuple[int, int] | None = None) -> str | None:
    """None if a weight of `shape` ([out, in]; None checks the scheme alone) quantized with `scheme` can be
    written as a GPTQ v1 checkpoint bit for bit, else one sentence saying why not and what to change.
    (Asymmetric weights with a zero point of 0 are data-dependent and refused by `gptq_tensors`.)"""
    if scheme.act is not None:
        return common_problem(scheme, shape, "GPTQ", "W4A16 or W8A16")
    if scheme.dtype not in ("int4", "int8"):
        return (f"GPTQ checkpoints that vLLM serves are 4- or 8-bit integer weights, not {scheme.dtype}; "
                "use dtype: int4 or int8")
    if scheme.granularity not in ("group", "channel"):
        return (f"GPTQ checkpoints are per group or per output channel, not per {scheme.granularity}; "
                "set granularity: group (or channel)")
    if (why := common_problem(scheme, shape, "GPTQ", "W4A16 or W8A16")) is not None:
        return why
    if shape is not None:
        n, k = shape
        per_word = 32 // scheme.bits
        if k % per_word:
            return (f"in_features={k} is not a multiple of {per_word} ({scheme.bits}-bit codes are packed "
                    f"{per_word} per int32 along in_features); leave this layer in float")
        if n % per_word:
            return (f"out_features={n} is not a multiple of {per_word} ({scheme.bits}-bit zero points are packed "
                    f"{per_word} per int32 along out_features); leave this layer in float")
    return None


def gptq_tensors(qt: QuantizedTensor) -> dict[str, Tensor]:
    """The `qweight`, `qzeros`, `scales` and `g_idx` tensors of one GPTQ v1 linear layer (bias is the caller's)."""
    problem = gptq_problem(qt.scheme, qt.shape)
    if problem:
        raise ValueError(problem)
    bits = qt.scheme.bits
    per_word = 32 // bits
    n, k = qt.shape
    group = k if qt.scheme.granularity == "channel" else qt.scheme.group_size
    u = qt.codes() - qt.scheme.qmin  # unsigned codes in [0, 2**b - 1], int32 [N, K]
    if qt.zero_point is not None:
        zero = qt.zero_point.to(torch.int32)  # [N, K // G]
        if bool((zero == 0).any()):
            row, group = torch.nonzero(zero == 0)[0].tolist()
            raise ValueError(
                f"GPTQ v1 stores zero_point - 1, so a zero point of 0 (a group with no negative weight, first at "
                f"output row {row}, group {group}) cannot be written; quantize with symmetric: true (or export "
                "int4 weights as AWQ)")
    else:  # symmetric: q = u - 2**(b-1), so w = q * s = (u - 2**(b-1)) * s
        zero = torch.full(qt.scale.shape, -qt.scheme.qmin, dtype=torch.int32, device=u.device)
    stored_zero = zero - 1  # v1 convention (see the module docstring)
    ut = u.t().contiguous()  # [K, N]
    qweight = pack_int32_fields(ut.reshape(k // per_word, per_word, n).transpose(1, 2), bits)  # [K // P, N]
    zt = stored_zero.t().contiguous()  # [K // G, N]
    qzeros = pack_int32_fields(zt.reshape(zt.shape[0], n // per_word, per_word), bits)  # [K // G, N // P]
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": qt.scale.to(torch.float16).t().contiguous(),  # [K // G, N]
        "g_idx": (torch.arange(k, device=u.device) // group).to(torch.int32),
    }


def gptq_config(scheme: QuantScheme) -> dict:
    """`quantization_config` for config.json, with the fields AutoGPTQ (`BaseQuantizeConfig.to_dict`) and GPTQModel
    (`QuantizeConfig.to_dict`) write that loaders read: vLLM reads bits, group_size, desc_act, sym, lm_head and
    checkpoint_format (v1 vs gptq_v2 zero points); transformers reads format / checkpoint_format and sym;
    GPTQModel reads pack_dtype. Algorithm-only fields (damp_percent, true_sequential) are left out: they describe
    how the weights were searched, not how they are stored, and loaders default them."""
    problem = gptq_problem(scheme)
    if problem:
        raise ValueError(problem)
    return {
        "quant_method": "gptq",
        "bits": scheme.bits,
        "group_size": -1 if scheme.granularity == "channel" else scheme.group_size,
        "desc_act": False,
        "static_groups": False,
        "sym": scheme.symmetric,
        "lm_head": False,
        "checkpoint_format": "gptq",
        "format": "gptq",
        "pack_dtype": "int32",
    }


def gptq_dequantize(qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor, bits: int) -> Tensor:
    """Read one GPTQ v1 layer back: float32 [N, K] with w = (q - (stored zero + 1)) * s[g_idx]."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(per_word, device=qweight.device) * bits
    q = ((qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qweight.shape[1])  # [K, N]
    z = ((qzeros.to(torch.int64)[..., None] >> shifts) & mask).reshape(qzeros.shape[0], -1) + 1  # [G, N]
    g = g_idx.long()
    return ((q - z[g]).float() * scales.float()[g]).t().contiguous()
