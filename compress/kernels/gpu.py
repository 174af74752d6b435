"""CUDA kernels for the dispatcher: our W4A16 and fp8 ops (ops.py, built on first use by cuda_ext.py), torch's
fp8 `_scaled_mm` (cuBLASLt) and torch's int4 `_weight_int4pack_mm` (tinygemm, the W4A16 baseline). Importing this
module needs no GPU; each check says why a kernel cannot run a layer.

Each family has a small-batch kernel and a large-batch path, declared by the Kernel's `rows` (the dispatcher
measures them all; the ranges decide where it does not):
  * W4A16: our GEMM (M <= 64: a weight stream, where reading 4-bit weights is the win) and, for M >= 128, our
    dequantization kernel into a transient scratch followed by cuBLAS (`linear_w4a16_dequant`), where the GEMM is
    compute-bound and a tensor-core library GEMM beats ours;
  * fp8 W8A8: our quantize + our GEMM (M <= 64) and, for M >= 128, our per-token quantize kernel feeding torch's
    `_scaled_mm` (`linear_fp8_scaled_mm`); torch's own quantization + `_scaled_mm` stays a candidate at any size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from ..core.qtensor import QuantizedTensor
from .kernel import Kernel

FP8_MAX = 448.0
# Row ranges (Kernel.rows): the small-batch kernels and the large-batch paths. A bucket of M 65..127 is measured, or
# (unmeasured) given the kernel whose range is nearest; above the largest bucket, the large-batch path
# (dispatch.plan_dispatch).
SMALL_M = (1, 64)
LARGE_M = (128, None)
DECODE_M = (1, 16)  # the W4A16 decode kernel (version 2)
# torch._scaled_mm's use_fast_accum in linear_fp8_scaled_mm. False: the library's precise fp8 accumulation (partial
# sums promoted to fp32); True: the tensor cores' own faster, less exact accumulation (worse at large K). A run-time
# argument too: bench/gpu_check.py times both.
SCALED_MM_FAST_ACCUM = False


def _fp8_act_reason(qt: QuantizedTensor) -> str | None:
    s = qt.scheme
    act = s.act
    if s.dtype != "fp8_e4m3" or act is None or act.dtype != "fp8_e4m3":
        return f"fp8 e4m3 weights and activations only (scheme {s.name})"
    if s.granularity not in ("channel", "tensor"):
        return f"per-channel or per-tensor fp8 weight scales only (got {s.granularity})"
    return None


def scaled_mm_reason(qt: QuantizedTensor, dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"CUDA only (the layer is on {device.type}; torch's CPU _scaled_mm is ~40x slower than float32)"
    why = _fp8_act_reason(qt)
    if why:
        return why
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 tensor cores need sm_89 or newer"
    n, k = qt.shape
    if n % 16 or k % 16:
        return f"_scaled_mm needs in/out features divisible by 16 (got {k}, {n})"
    return None


@dataclass
class ScaledMM:
    weight_t: Tensor  # [K, N] float8, column-major (the transpose of a contiguous [N, K])
    scale_b: Tensor  # [1, N] float32 (or [] per tensor, broadcast to [1, N])
    input_scale: Tensor | None  # static per-tensor activation scale, else dynamic per token
    out_dtype: torch.dtype


def prepare_scaled_mm(qt: QuantizedTensor, dtype: torch.dtype, input_scale: Tensor | None = None) -> ScaledMM:
    n = qt.shape[0]
    scale = qt.scale.float().reshape(-1)
    scale = scale.expand(n) if scale.numel() == 1 else scale
    return ScaledMM(qt.qdata.t(), scale.reshape(1, n).contiguous(), input_scale, dtype)


def quantize_rows_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token e4m3 quantization: scale = max(absmax / 448, 1e-12), q = saturate(x / scale)."""
    scale = (x2.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x2.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def linear_scaled_mm(p: ScaledMM, x: Tensor, bias: Tensor | None) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if p.input_scale is not None:
        sa = p.input_scale.float().reshape(1, 1)
        xq = (x2.float() / sa).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        sa = sa.expand(x2.shape[0], 1).contiguous()
    else:
        xq, sa = quantize_rows_fp8(x2)
    y = torch._scaled_mm(xq, p.weight_t, scale_a=sa, scale_b=p.scale_b, out_dtype=p.out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.weight_t.shape[1])


def _extension_reason() -> str | None:
    """Why our CUDA extension is unavailable (its build failed), or None; callers have checked the device."""
    from . import cuda_ext
    ext = cuda_ext.load()
    return None if ext.ok else ext.reason


def w4a16_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    from .prepack import w4a16_layer_supported
    if device.type != "cuda":
        return f"CUDA only (the layer is on {device.type})"
    s = layer.scheme
    if s.dtype != "int4" or s.act is not None:
        return f"int4 weight-only only (scheme {s.name})"
    if s.granularity not in ("group", "channel"):
        return f"group or per-channel scales only (got {s.granularity})"
    if s.zero_point_dtype != "uint8":
        return "integer zero points only (prepack takes codes 0..15); fractional ones run on the reference path"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"float16 / bfloat16 activations only (got {dtype})"
    # K is zero-padded to the kernel's k-tile at prepare time (pack_w4a16), so K = 576 layers run too
    why = w4a16_layer_supported(layer.out_features, layer.in_features,
                                s.group_size if s.granularity == "group" else -1)
    if why:
        return why
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs sm_80 or newer (mma.sync bf16, cp.async)"
    return _extension_reason()


@dataclass
class W4A16:
    wq: Tensor  # int32 [N * k_padded / 8], the kernel layout (prepack.prepack_w4a16)
    scales: Tensor  # [k_padded / G, N] in the activation dtype
    zeros: Tensor | None
    n: int
    group_size: int
    k: int  # the layer's in_features
    k_padded: int  # k rounded up to the kernel's k-tile; linear_w4a16 pads x with zeros to it


def pack_w4a16(u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, dtype: torch.dtype,
               device: torch.device | str | None = None) -> W4A16:
    """Kernel operands for unsigned codes u [N, K] (0..15; w = (u - z) * s, z = 8 when zeros is None) with scales /
    zeros [N, K // G] (G = K for group_size -1). A K that is not a multiple of the kernel's k-tile is zero-padded
    (prepack.pad_k_w4a16: the padded weights dequantize to exactly 0). Raises ValueError naming the rule when
    the kernel cannot take the layer even padded."""
    from .prepack import pad_k_w4a16, prepack_w4a16, w4a16_layer_supported
    n, k = u.shape
    why = w4a16_layer_supported(n, k, group_size)
    if why:
        raise ValueError(f"W4A16 kernel: {why}")
    dev = u.device if device is None else device
    # packed where the codes are (a GPU packs an 8B model in seconds), then moved once
    u, scales, zeros = pad_k_w4a16(u, scales.float().to(u.device),
                                   None if zeros is None else zeros.float().to(u.device), group_size)
    p = prepack_w4a16(u, scales, zeros, group_size, dtype)
    return W4A16(p["wq"].to(dev), p["scales"].to(dev), None if p["zeros"] is None else p["zeros"].to(dev), n,
                 group_size, k, u.shape[1])


def _int4_operands(layer) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """A group / channel int4 layer as (u [N, K] unsigned codes 0..15, scales [N, groups], zero points [N, groups]
    or None (z = 8), group_size (-1: per channel)), w = (u - z) * s."""
    qt = layer.qtensor()
    n, k = qt.shape
    u = qt.codes() - (qt.scheme.qmin if qt.zero_point is None else 0)
    g = qt.scheme.group_size if qt.scheme.granularity == "group" else -1
    groups = 1 if g == -1 else k // g
    zeros = None if qt.zero_point is None else qt.zero_point.float().reshape(n, groups)
    return u, qt.scale.float().reshape(n, groups), zeros, g


def prepare_w4a16(layer, dtype: torch.dtype) -> W4A16:
    u, scales, zeros, g = _int4_operands(layer)
    return pack_w4a16(u, scales, zeros, g, dtype, layer.qtensor().qdata.device)


def _direct(x: Tensor, operand: Tensor) -> bool:
    """Call the CUDA launcher itself (ops.launch_*), skipping the custom op's dispatch and input checks, when the
    checks cannot fail: eager mode (torch.compile traces the op), x on the operands' device (the callers check its
    dtype), and the operands built and checked by this module's pack_* functions. The launchers' own C checks still
    refuse a shape they cannot run (ValueError, as the op would)."""
    return x.is_cuda and x.device == operand.device and not torch.compiler.is_compiling()


def linear_w4a16(p: W4A16, x: Tensor, bias: Tensor | None, splits: int = 0) -> Tensor:
    """The layer on the W4A16 kernel; `splits`: split-K count (0: chosen for the device, ops.w4a16_gemm)."""
    from . import ops
    return _packed_linear(p, x.reshape(-1, p.k), x.shape, bias, splits, ops.launch_w4a16, ops.w4a16_gemm)


def _packed_linear(p: W4A16, x2: Tensor, shape, bias: Tensor | None, splits: int, launch, checked) -> Tensor:
    """x2 [M, K] through a W4A16 kernel: `launch` directly where the operands are already right, else the checked
    op (a bad splits value takes it too, and its message names the problem); out [*shape[:-1], N]."""
    if p.k_padded != p.k:  # zero columns meet the zero weight columns pack_w4a16 appended
        x2 = F.pad(x2, (0, p.k_padded - p.k))
    x2 = x2.contiguous()
    gemm = launch if _direct(x2, p.wq) and x2.dtype == p.scales.dtype and 0 <= splits <= p.k_padded // 128 \
        else checked
    y = gemm(x2, p.wq, p.scales, p.zeros, p.n, p.group_size, splits)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*shape[:-1], p.n)


V2_ENV = "COMPRESS_W4A16_V2"  # "1": offer the decode kernel to the dispatcher (bench/gpu_check.py sets it)


def w4a16_v2_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    """Version 2 takes version 1's layers. Until bench/gpu_check.py has passed it on a GPU it runs only when asked
    for: a kernel no GPU has checked must not be chosen for being fast."""
    import os
    if os.environ.get(V2_ENV, "0") != "1":
        return (f"the W4A16 decode kernel (version 2) has not yet been checked on a GPU; set {V2_ENV}=1 to offer it "
                "(bench/gpu_check.py checks it)")
    return w4a16_reason(layer, dtype, device)


def linear_w4a16_v2(p: W4A16, x: Tensor, bias: Tensor | None, splits: int = 0) -> Tensor:
    """The layer on the W4A16 decode kernel (version 2) for up to 16 rows, and on version 1 beyond: the same
    operands (pack_w4a16) serve both, so the layer needs no second copy of its weights."""
    from . import ops
    from .w4a16_v2 import MAX_ROWS
    x2 = x.reshape(-1, p.k)
    if x2.shape[0] > MAX_ROWS:
        return linear_w4a16(p, x, bias)
    return _packed_linear(p, x2, x.shape, bias, splits, ops.launch_w4a16_v2, ops.w4a16_gemm_v2)


# ---- W4A16, large batches: dequantize into scratch, then cuBLAS ------------------------------------------------
def w4a16_dequant_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    """The W4A16 GEMM's rules (same operands), plus the dequantization kernel's grid limit on N."""
    from .prepack import padded_k, w4a16_dequant_supported
    why = w4a16_reason(layer, dtype, device)
    if why:
        return why
    s = layer.scheme
    return w4a16_dequant_supported(layer.out_features, padded_k(layer.in_features),
                                   s.group_size if s.granularity == "group" else -1)


def dequant_w4a16(p: W4A16, out: Tensor | None = None) -> Tensor:
    """The layer's dense weight [N, k_padded] in the activation dtype, W = (u - z) * s rounded once: the checked op
    (ops.w4a16_dequant: the CUDA kernel on CUDA, the bit-identical reference elsewhere), or with `out` (a
    contiguous [N, k_padded] buffer of that dtype on the operands' CUDA device) the kernel writing into it."""
    from . import ops
    if out is not None:
        return ops.launch_w4a16_dequant(p.wq, p.scales, p.zeros, p.n, p.k_padded, p.group_size, out)
    return ops.w4a16_dequant(p.wq, p.scales, p.zeros, p.n, p.k_padded, p.group_size)


def linear_w4a16_dequant(p: W4A16, x: Tensor, bias: Tensor | None) -> Tensor:
    """The layer as dequantize-then-cuBLAS: our kernel writes the dense weight into a scratch tensor, F.linear
    (cuBLAS) multiplies. The scratch is allocated per call from torch's caching allocator and dropped on return:
    transient, never kept on the layer; the allocator keeps the block cached, so a model's peak memory grows by one
    dense weight of its largest such layer (N x k_padded x 2 bytes), not by the dense model. A padded K is sliced
    off the weight (a strided view cuBLAS reads with its leading dimension, no copy), so x is not padded."""
    from . import ops
    dequant = ops.launch_w4a16_dequant if _direct(x, p.wq) else ops.w4a16_dequant
    w = dequant(p.wq, p.scales, p.zeros, p.n, p.k_padded, p.group_size)
    if p.k_padded != p.k:
        w = w[:, :p.k]
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    from .fp8_layout import fp8_layer_supported
    if device.type != "cuda":
        return f"CUDA only (the layer is on {device.type})"
    why = _fp8_act_reason(layer.qtensor())
    if why:
        return why
    if dtype not in (torch.float16, torch.bfloat16):
        return f"float16 / bfloat16 activations only (got {dtype})"
    major, minor = torch.cuda.get_device_capability(device)
    # K is zero-padded to a multiple of 16 at prepare time (pack_fp8)
    why = fp8_layer_supported(layer.out_features, layer.in_features, major * 10 + minor)
    if why:
        return why
    return _extension_reason()


@dataclass
class FP8:
    weight: Tensor  # [N, k_padded] e4m3
    scale: Tensor  # float32 [N] or [1]
    input_scale: Tensor | None
    out_dtype: torch.dtype
    k: int  # the layer's in_features; linear_fp8 pads x with zeros to weight.shape[1]


def pack_fp8(weight: Tensor, scale: Tensor, input_scale: Tensor | None, out_dtype: torch.dtype) -> FP8:
    """Kernel operands for an e4m3 weight [N, K] with float32 scales [N] or [1]. K is zero-padded to a multiple of
    16 (fp8_layout.fp8_padded_k): zero weights and zero activations add nothing to the output."""
    from .fp8_layout import fp8_padded_k
    n, k = weight.shape
    pad = fp8_padded_k(k) - k
    w = weight.contiguous()
    if pad:  # pad the bytes (e4m3 0x00 is +0.0): needs no float8 kernel on any device
        w = F.pad(w.view(torch.uint8), (0, pad)).view(weight.dtype)
    return FP8(w, scale.float().reshape(-1).contiguous(),
               None if input_scale is None else input_scale.float().reshape(1), out_dtype, k)


def prepare_fp8(layer, dtype: torch.dtype) -> FP8:
    qt = layer.qtensor()
    return pack_fp8(qt.qdata, qt.scale, layer.input_scale, dtype)


def linear_fp8(p: FP8, x: Tensor, bias: Tensor | None) -> Tensor:
    from . import ops
    x2 = x.reshape(-1, p.k)
    if p.weight.shape[1] != p.k:  # zero columns: they change neither the row absmax nor the sum
        x2 = F.pad(x2, (0, p.weight.shape[1] - p.k))
    x2 = x2.contiguous()
    direct = _direct(x2, p.weight) and x2.dtype in (torch.float16, torch.bfloat16)
    if p.input_scale is not None:
        xq, sa = (x2.float() / p.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), p.input_scale
    else:
        xq, sa = (ops.launch_fp8_quantize_rows if direct else ops.fp8_quantize_rows)(x2)
    y = (ops.launch_fp8_gemm if direct else ops.fp8_gemm)(xq, p.weight, sa, p.scale).to(p.out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.weight.shape[0])


# ---- fp8 W8A8, large batches: our per-token quantize kernel feeding torch._scaled_mm --------------------------
def fp8_scaled_mm_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    """Our fp8 layer's rules (our quantize kernel, K padded to 16 by pack_fp8), plus torch._scaled_mm's: N a multiple
    of 16 (mat2 [K, N] column-major with K and N divisible by 16; rowwise scales fp32 [M, 1] and [1, N]; bf16 output,
    which torch's CUTLASS rowwise path (sm_89, or cuBLAS before 12.9) requires)."""
    why = fp8_reason(layer, dtype, device)
    if why:
        return why
    if layer.out_features % 16:
        return f"torch._scaled_mm needs out_features divisible by 16 (got {layer.out_features})"
    return None


def linear_fp8_scaled_mm(p: FP8, x: Tensor, bias: Tensor | None, use_fast_accum: bool = SCALED_MM_FAST_ACCUM) -> Tensor:
    """The W8A8 layer as our per-token quantize kernel (ops.launch_fp8_quantize_rows) feeding torch._scaled_mm, on
    our GEMM's operands (pack_fp8 / prepare_fp8: the same state, prepared once per layer; weight [N, k_padded] e4m3
    row-major, whose .t() is the column-major b _scaled_mm takes). Scales: rowwise, scale_a [M, 1] and scale_b [1, N]
    float32 (a per-tensor weight scale is expanded per call; a static input scale quantizes x with torch ops as
    linear_fp8 does and is expanded to [M, 1]), or per tensor on both sides when the weight scale and a static input
    scale both are. Output bf16 (torch's CUTLASS rowwise path takes nothing else), cast to the layer's dtype."""
    from . import ops
    x2 = x.reshape(-1, p.k)
    n, kp = p.weight.shape
    if kp != p.k:  # zero columns: they change neither the row absmax nor the sum
        x2 = F.pad(x2, (0, kp - p.k))
    x2 = x2.contiguous()
    per_tensor_w = p.scale.numel() == 1 and n > 1
    if p.input_scale is not None:
        xq = (x2.float() / p.input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if per_tensor_w:
            sa, sb = p.input_scale.reshape(()), p.scale.reshape(())
        else:
            sa, sb = p.input_scale.reshape(1, 1).expand(x2.shape[0], 1).contiguous(), p.scale.reshape(1, n)
    else:
        direct = _direct(x2, p.weight) and x2.dtype in (torch.float16, torch.bfloat16)
        xq, sa = (ops.launch_fp8_quantize_rows if direct else ops.fp8_quantize_rows)(x2)
        sa = sa.reshape(-1, 1)
        sb = p.scale.expand(n).reshape(1, n).contiguous() if per_tensor_w else p.scale.reshape(1, n)
    y = torch._scaled_mm(xq, p.weight.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                         use_fast_accum=use_fast_accum)
    if p.out_dtype != torch.bfloat16:
        y = y.to(p.out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)


# torch's tinygemm (aten/src/ATen/native/cuda/int4mm.cu, as in torch 2.5 to 2.11+): bf16 activations only, groups of
# 32 / 64 / 128 / 256, the weight repacked once by `_convert_weight_to_int4pack` from uint8 [N, K / 2] (code 2j in
# the high nibble of byte j) into [N / 8, K / (16 * inner k-tiles), 32, inner k-tiles / 2] int32; 8 inner k-tiles
# (K % 128 == 0) is what gpt-fast and torchao use. Dequantization: w = (u - 8) * scale + zero, fp32 accumulation.
TINYGEMM_GROUPS = (256, 128, 64, 32)
TINYGEMM_INNER_K_TILES = 8


def tinygemm_group(k: int, group_size: int) -> int | None:
    """The tinygemm group size that expresses these scales exactly: the layer's own, or for one scale per output
    channel (group_size -1) the largest accepted one dividing K, the scale repeated; None if there is none."""
    if group_size == -1:
        return next((g for g in TINYGEMM_GROUPS if k % g == 0), None)
    return group_size if group_size in TINYGEMM_GROUPS and k % group_size == 0 else None


def tinygemm_supported(n: int, k: int, group_size: int) -> str | None:
    """Why tinygemm cannot take an N x K int4 weight of this group size, or None."""
    if n % 8:
        return f"N={n} is not a multiple of 8 (tinygemm's n-tile)"
    if k % (16 * TINYGEMM_INNER_K_TILES):
        return f"K={k} is not a multiple of {16 * TINYGEMM_INNER_K_TILES} (tinygemm's {TINYGEMM_INNER_K_TILES} " \
               "inner k-tiles of 16)"
    if tinygemm_group(k, group_size) is None:
        return f"group_size={group_size}: tinygemm takes groups of {'/'.join(map(str, TINYGEMM_GROUPS[::-1]))} " \
               f"dividing K={k}"
    return None


def tinygemm_reason(layer, dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"CUDA only (the layer is on {device.type}; torch's CPU int4pack kernels are dispatch.py's)"
    s = layer.scheme
    if s.dtype != "int4" or s.act is not None:
        return f"int4 weight-only only (scheme {s.name})"
    if s.granularity not in ("group", "channel"):
        return f"group or per-channel scales only (got {s.granularity})"
    if dtype != torch.bfloat16:
        return f"bfloat16 activations only (torch's CUDA tinygemm; got {dtype})"
    why = tinygemm_supported(layer.out_features, layer.in_features,
                             s.group_size if s.granularity == "group" else -1)
    if why:
        return why
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs sm_80 or newer (tinygemm's bf16 mma)"
    return _tinygemm_probe(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _tinygemm_probe(device_index: int) -> str | None:
    """tinygemm_runs on this CUDA device, once per device and process."""
    return tinygemm_runs(torch.device("cuda", device_index))


def tinygemm_runs(dev: torch.device) -> str | None:
    """Why torch's tinygemm does not run on `dev` (its ops are private: a torch build may lack or change them), from
    one tiny pack and call; None if it runs and computes what it should. A layer it cannot run then stays off it
    instead of failing in the dispatcher's prepare step."""
    even = torch.arange(128) % 2 == 0
    try:
        p = pack_tinygemm(torch.where(even, 10, 8).repeat(16, 1), torch.ones(16, 1), None, 128, dev)
        y = linear_tinygemm(p, even.to(device=dev, dtype=torch.bfloat16).reshape(1, 128), None)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return f"torch's tinygemm does not run here: {type(e).__name__}: {str(e)[:200]}"
    if not bool((y == 128).all()):  # 64 even columns of (10 - 8) * 1; odd ones (8 - 8) * 0: a nibble swap gives 0
        return "torch's tinygemm gave a wrong result on a probe (a changed operand layout?)"
    return None


@dataclass
class Tinygemm:
    weight: Tensor  # int32, torch's tiled layout (CUDA: [N / 8, K / 128, 32, 4]; CPU: the _for_cpu op's own)
    scale_zeros: Tensor  # bf16 [K / G, N, 2]: (scale, zero) of w = (u - 8) * scale + zero
    group_size: int  # tinygemm's group (a per-channel scale is repeated over groups of this size)
    n: int


def tinygemm_nibbles(u: Tensor) -> Tensor:
    """Codes u [N, K] (0..15) as the uint8 [N, K / 2] `_convert_weight_to_int4pack` takes on CUDA: code 2j in the
    high nibble of byte j, code 2j + 1 in the low one (int4mm.cu's packing comment; torchao and gpt-fast pack so)."""
    return ((u[:, ::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()


def pack_tinygemm(u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int,
                  device: torch.device | str | None = None) -> Tinygemm:
    """tinygemm's operands for unsigned codes u [N, K] (0..15) with scales / zero points [N, K // G] (w = (u - z) * s;
    zeros None: z = 8; G = K for group_size -1), on `device` (default: u's). On CUDA the weight goes through
    `_convert_weight_to_int4pack`; on any other device through its CPU twin `_convert_weight_to_int4pack_for_cpu`
    (int32 codes; it needs N % 16), whose scale/zero operand is the same, so the CPU checks the operands. Raises
    ValueError naming the rule when tinygemm cannot take the weight."""
    from .cpu import int4pack_scales_and_zeros
    n, k = u.shape
    why = tinygemm_supported(n, k, group_size)
    if why:
        raise ValueError(f"tinygemm: {why}")
    dev = torch.device(device) if device is not None else u.device
    g = tinygemm_group(k, group_size)
    reps = k // g // scales.shape[1]  # 1, or the groups one channel scale spans
    sz = int4pack_scales_and_zeros(scales.cpu(), None if zeros is None else zeros.cpu(), reps, torch.bfloat16)
    u = u.to(dev)
    if dev.type == "cuda":
        weight = torch.ops.aten._convert_weight_to_int4pack(tinygemm_nibbles(u.to(torch.int32)),
                                                            TINYGEMM_INNER_K_TILES)
    else:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), 2)
    return Tinygemm(weight, sz.to(dev), g, n)


def prepare_tinygemm(layer, dtype: torch.dtype) -> Tinygemm:
    u, scales, zeros, g = _int4_operands(layer)
    return pack_tinygemm(u, scales, zeros, g, layer.qtensor().qdata.device)


def linear_tinygemm(p: Tinygemm, x: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T (+ bias) on torch's tinygemm; x bf16 (the CPU twin runs off CUDA)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    mm = torch.ops.aten._weight_int4pack_mm if x2.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    y = mm(x2, p.weight, p.group_size, p.scale_zeros)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.n)


# In the order plan_dispatch(measure=False) prefers them within their row ranges.
KERNELS = [
    Kernel("compress w4a16 v2 (CUDA)", w4a16_v2_reason, prepare_w4a16, linear_w4a16_v2, DECODE_M),
    Kernel("compress w4a16 (CUDA)", w4a16_reason, prepare_w4a16, linear_w4a16, SMALL_M),
    Kernel("compress w4a16 dequant+cuBLAS (CUDA)", w4a16_dequant_reason, prepare_w4a16, linear_w4a16_dequant, LARGE_M),
    Kernel("torch tinygemm int4 (CUDA)", tinygemm_reason, prepare_tinygemm, linear_tinygemm),
    Kernel("compress fp8 w8a8 (CUDA)", fp8_reason, prepare_fp8, linear_fp8, SMALL_M),
    Kernel("compress fp8 quantize + torch _scaled_mm (CUDA)", fp8_scaled_mm_reason, prepare_fp8, linear_fp8_scaled_mm,
           LARGE_M),
    Kernel("torch _scaled_mm fp8 (CUDA)", lambda layer, dtype, device: scaled_mm_reason(layer.qtensor(), dtype, device),
           lambda layer, dtype: prepare_scaled_mm(layer.qtensor(), dtype, layer.input_scale), linear_scaled_mm),
]
