"""QuantLinear: a linear layer that keeps packed quantized weights in memory.

It computes by dequantize-then-matmul (the reference path); faster kernels plug in later.
transformers' GPT-2 `Conv1D` stores its weight as [in, out]; `linear_weight` returns the
[out, in] view so every linear-like module is handled one way.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

import contextlib

from .primitives import scale_shape
from .qtensor import QuantizedTensor
from .scheme import QuantScheme

LINEAR_TYPES = (nn.Linear, Conv1D)


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, LINEAR_TYPES) or isinstance(module, QuantLinear)


def linear_weight(module: nn.Module) -> Tensor:
    """The weight of a linear-like module as [out_features, in_features]."""
    if isinstance(module, Conv1D):
        return module.weight.t()
    return module.weight


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features)."""
    if isinstance(module, QuantLinear):
        return module.out_features, module.in_features
    w = linear_weight(module)
    return w.shape[0], w.shape[1]


class QuantLinear(nn.Module):
    """y = x @ dequantize(W)^T + b, with W held as a QuantizedTensor's buffers."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        empty = QuantizedTensor.from_codes(
            torch.zeros(out_features, in_features, dtype=torch.int32),
            torch.ones(scale_shape(scheme, out_features, in_features)),
            None if scheme.symmetric else torch.zeros(scale_shape(scheme, out_features, in_features)),
            scheme)
        self.register_buffer("qdata", empty.qdata.to(device))
        self.register_buffer("scale", empty.scale.to(device))
        self.register_buffer("zero_point", None if empty.zero_point is None else empty.zero_point.to(device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self._weight_cache: Tensor | None = None  # set only inside cached_dequantize()

    @classmethod
    def from_module(cls, module: nn.Module, qt: QuantizedTensor) -> "QuantLinear":
        out_features, in_features = linear_shape(module)
        if qt.shape != (out_features, in_features):
            raise ValueError(f"quantized shape {qt.shape} does not match the layer's {(out_features, in_features)}")
        ref = linear_weight(module)
        layer = cls(in_features, out_features, qt.scheme, bias=module.bias is not None, dtype=ref.dtype,
                    device=ref.device)
        layer.qdata, layer.scale, layer.zero_point = qt.qdata, qt.scale, qt.zero_point
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        return layer

    def qtensor(self) -> QuantizedTensor:
        return QuantizedTensor(self.qdata, self.scale, self.zero_point, self.scheme,
                               (self.out_features, self.in_features))

    def forward(self, x: Tensor) -> Tensor:
        w = self._weight_cache
        if w is None or w.dtype != x.dtype:
            w = self.qtensor().dequantize(x.dtype)  # [N, K]
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"



@contextlib.contextmanager
def cached_dequantize(module: nn.Module, dtype: torch.dtype = torch.float32):
    """Dequantize the QuantLinears under `module` once for a burst of forwards (the calibration runner
    pushes every sample through a block), instead of once per call; the float copies go away on exit."""
    layers = [m for m in module.modules() if isinstance(m, QuantLinear)]
    try:
        for m in layers:
            m._weight_cache = m.qtensor().dequantize(dtype)
        yield
    finally:
        for m in layers:
            m._weight_cache = None
