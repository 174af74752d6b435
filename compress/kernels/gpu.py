"""CUDA kernels for the dispatcher: our W4A16 and fp8 ops (ops.py, built on first use by cuda_ext.py) and torch's
fp8 `_scaled_mm` (cuBLASLt). Importing this module needs no GPU; each check says why a kernel cannot run a layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from ..qtensor import QuantizedTensor
from .kernel import Kernel

FP8_MAX = 448.0


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


def prepare_w4a16(layer, dtype: torch.dtype) -> W4A16:
    qt = layer.qtensor()
    n, k = qt.shape
    u = qt.codes() - (qt.scheme.qmin if qt.zero_point is None else 0)
    g = qt.scheme.group_size if qt.scheme.granularity == "group" else -1
    groups = 1 if g == -1 else k // g
    zeros = None if qt.zero_point is None else qt.zero_point.float().reshape(n, groups)
    return pack_w4a16(u, qt.scale.float().reshape(n, groups), zeros, g, dtype, qt.qdata.device)


def _direct(x: Tensor, operand: Tensor) -> bool:
    """Call the CUDA launcher itself (ops.launch_*), skipping the custom op's dispatch and input checks, when the
    checks cannot fail: eager mode (torch.compile traces the op), x on the operands' device (the callers check its
    dtype), and the operands built and checked by this module's pack_* functions. The launchers' own C checks still
    refuse a shape they cannot run (ValueError, as the op would)."""
    return x.is_cuda and x.device == operand.device and not torch.compiler.is_compiling()


def linear_w4a16(p: W4A16, x: Tensor, bias: Tensor | None, splits: int = 0) -> Tensor:
    """The layer on the W4A16 kernel; `splits`: split-K count (0: chosen for the device, ops.w4a16_gemm)."""
    from . import ops
    x2 = x.reshape(-1, p.k)
    if p.k_padded != p.k:  # zero columns meet the zero weight columns pack_w4a16 appended
        x2 = F.pad(x2, (0, p.k_padded - p.k))
    x2 = x2.contiguous()
    # a bad splits value takes the checked op, whose message names it
    gemm = ops.launch_w4a16 if _direct(x2, p.wq) and x2.dtype == p.scales.dtype and \
        0 <= splits <= p.k_padded // 128 else ops.w4a16_gemm
    y = gemm(x2, p.wq, p.scales, p.zeros, p.n, p.group_size, splits)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], p.n)


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


KERNELS = [
    Kernel("compress w4a16 (CUDA)", w4a16_reason, prepare_w4a16, linear_w4a16),
    Kernel("compress fp8 w8a8 (CUDA)", fp8_reason, prepare_fp8, linear_fp8),
    Kernel("torch _scaled_mm fp8 (CUDA)", lambda layer, dtype, device: scaled_mm_reason(layer.qtensor(), dtype, device),
           lambda layer, dtype: prepare_scaled_mm(layer.qtensor(), dtype, layer.input_scale), linear_scaled_mm),
]
