"""QuantLinear: a linear layer that keeps packed quantized weights in memory.

Weight-only schemes compute by dequantize-then-matmul. Schemes with quantized activations (W8A8,
fp8, LLM.int8) quantize the input on the fly or with a calibrated `input_scale`; symmetric int8 runs
through torch's int8 matmul, everything else through the fake-quantized reference (kernels/reference.py).
transformers' GPT-2 `Conv1D` stores its weight as [in, out]; `linear_weight` returns the
[out, in] view so every linear-like module is handled one way.
"""
from __future__ import annotations

import functools

import contextlib
import importlib.util

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from . import reference as ref
from .primitives import FP8_DTYPES, scale_shape
from .qtensor import QuantizedTensor
from .scheme import QuantScheme

LINEAR_TYPES = (nn.Linear, Conv1D)


@functools.lru_cache(maxsize=None)
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo); elsewhere torch
    emulates bf16 matmuls, 7x slower than float32 on an AVX2 EPYC (2048x576x1536: 2.24 s vs 0.33 s, measured)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device_type: str) -> bool:
    """Whether bfloat16 matmuls on this device type are native (CUDA; a CPU with bf16 instructions)."""
    return device_type == "cuda" or (device_type == "cpu" and cpu_has_bf16())


def calibration_dtype(setting: str, device) -> str:
    """The dtype of the calibration's matmuls: `calibration.dtype`, with auto resolved for this machine (bfloat16
    where native_bf16, else float32). The calibration pass and the kl_hessians pass both compute in it."""
    if setting != "auto":
        return setting
    return "bfloat16" if native_bf16(str(device).split(":")[0]) else "float32"


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


def int8_path(scheme: QuantScheme) -> bool:
    """Symmetric int8 weights (per channel or tensor) meeting symmetric int8 activations: torch's int8 matmul."""
    act = scheme.act
    return (act is not None and act.dtype == "int8" and act.symmetric and scheme.dtype == "int8"
            and scheme.symmetric and scheme.granularity in ("channel", "tensor"))


def kernel_for(scheme: QuantScheme) -> str:
    """The reference matmul path of a QuantLinear of this scheme (named in the report and `compress inspect`);
    kernels/dispatch.py may route some batch sizes to faster kernels."""
    act = scheme.act
    if scheme.micro_name is not None or (act is not None and act.granularity == "group"):
        # no CPU kernel reads these; Blackwell's tensor cores (NVFP4, MX) do, and the layout is theirs
        what = scheme.micro_name or scheme.name
        return f"{what}: dequantize+matmul" if act is None else f"{what}: fake-quantized reference (block-scaled)"
    if act is None:
        return "dequantize+matmul"
    if act.outlier_threshold is not None:
        return "llm.int8: int8 _int_mm + float outlier features"
    return "int8 _int_mm" if int8_path(scheme) else "fake-quantized reference"


class QuantLinear(nn.Module):
    """y = x @ dequantize(W)^T + b, with W held as a QuantizedTensor's buffers."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        # the empty layer's buffers are made where they will live: packing a 7B layer's zero codes on the CPU took
        # 0.1-0.5 s (int4) and 4.6 s (NVFP4) per layer, for a layer on the GPU or a skeleton on the meta device
        codes = torch.zeros(out_features, in_features, dtype=torch.int32, device=device)
        if scheme.dtype in FP8_DTYPES:
            codes = codes.to(FP8_DTYPES[scheme.dtype])
        elif scheme.is_float:  # fp4 e2m1 values come as float32
            codes = codes.float()
        shape = scale_shape(scheme, out_features, in_features)
        empty = QuantizedTensor.from_codes(
            codes, torch.ones(shape, device=device), None if scheme.symmetric else torch.zeros(shape, device=device),
            scheme, torch.ones((), device=device) if scheme.has_global_scale else None)
        self.register_buffer("qdata", empty.qdata.to(device))
        self.register_buffer("scale", empty.scale.to(device))
        self.register_buffer("zero_point", None if empty.zero_point is None else empty.zero_point.to(device))
        # NVFP4's fp32 tensor scale (compressed-tensors' weight_global_scale; ModelOpt stores its reciprocal)
        self.register_buffer("global_scale", empty.global_scale)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        act = scheme.act
        # static activation scale (calibrated), and LLM.int8's calibrated outlier input features
        self.register_buffer("input_scale", torch.ones((), device=device) if act and not act.dynamic else None)
        static_cols = act is not None and act.outlier_threshold is not None and act.outliers == "static"
        self.register_buffer("outlier_cols", torch.zeros(0, dtype=torch.int64, device=device) if static_cols else None)
        # LLM.int8 dynamic mode: forwards seen, outlier features used in total, and the most in one forward
        self.outlier_counts = {"forwards": 0, "total": 0, "max": 0}
        self._weight_cache: Tensor | None = None  # set only inside cached_dequantize()
        self.dispatch = None  # a kernels.dispatch.LayerDispatch once plan_dispatch has run; None: reference path
        # a low-rank repair of the quantization error (the eora stage): y += (x A^T) B^T, A [rank, in], B [out, rank],
        # float tensors like the bias (saved at the run's save dtype; a LoRA adapter beside the other exports)
        self.lora_a: nn.Parameter | None = None
        self.lora_b: nn.Parameter | None = None

    @classmethod
    def from_module(cls, module: nn.Module, qt: QuantizedTensor) -> "QuantLinear":
        out_features, in_features = linear_shape(module)
        if qt.shape != (out_features, in_features):
            raise ValueError(f"quantized shape {qt.shape} does not match the layer's {(out_features, in_features)}")
        ref = linear_weight(module)
        # built on the meta device, then given qt's buffers: no placeholder codes packed only to be replaced (0.1-0.5 s
        # per 7B layer at int4: a third of a round-to-nearest run's solves)
        layer = cls(in_features, out_features, qt.scheme, bias=False, dtype=ref.dtype, device="meta")
        layer.qdata, layer.scale, layer.zero_point = qt.qdata, qt.scale, qt.zero_point
        if qt.global_scale is not None or layer.global_scale is not None:
            layer.global_scale = qt.global_scale if qt.global_scale is not None else \
                torch.ones((), device=ref.device)
        if layer.input_scale is not None:
            layer.input_scale = torch.ones((), device=ref.device)
        if layer.outlier_cols is not None:
            layer.outlier_cols = torch.zeros(0, dtype=torch.int64, device=ref.device)
        if module.bias is not None:
            layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        return layer

    def set_lowrank(self, a: Tensor | None, b: Tensor | None) -> None:
        """Add the low-rank term (x A^T) B^T to this layer's output (None, None: remove it)."""
        if (a is None) != (b is None):
            raise ValueError("a low-rank term needs both A and B")
        if a is not None and (a.shape[1] != self.in_features or b.shape[0] != self.out_features
                              or a.shape[0] != b.shape[1]):
            raise ValueError(f"low-rank term A {tuple(a.shape)}, B {tuple(b.shape)} does not fit a "
                             f"{self.out_features} x {self.in_features} layer")
        self.lora_a = None if a is None else nn.Parameter(a, requires_grad=False)
        self.lora_b = None if b is None else nn.Parameter(b, requires_grad=False)

    @property
    def rank(self) -> int:
        """The rank of the low-rank repair term (0: none)."""
        return 0 if self.lora_a is None else self.lora_a.shape[0]

    def qtensor(self) -> QuantizedTensor:
        return QuantizedTensor(self.qdata, self.scale, self.zero_point, self.scheme,
                               (self.out_features, self.in_features), self.global_scale)

    @property
    def parallel_unsafe(self) -> bool:
        """Whether two threads must not run this layer's forward at once (calibrate/deferred.py): it counts its
        LLM.int8 outliers in place, or runs a dispatch plan's kernels (which may keep work buffers in their states)."""
        act = self.scheme.act
        return self.dispatch is not None or (act is not None and act.outlier_threshold is not None and
                                             self.outlier_cols is None)

    @property
    def kernel(self) -> str:
        """The matmul path this layer's forward takes (per batch size once a dispatch plan is installed)."""
        if self.dispatch is not None:
            return self.dispatch.describe().replace("reference", f"reference {kernel_for(self.scheme)}")
        return kernel_for(self.scheme)

    def forward(self, x: Tensor) -> Tensor:
        y = self._quantized_forward(x)
        if self.lora_a is None:
            return y
        a, b = (self.lora_a, self.lora_b) if torch.is_autocast_enabled(x.device.type) else \
            (self.lora_a.to(x.dtype), self.lora_b.to(x.dtype))
        return y + nn.functional.linear(nn.functional.linear(x, a), b)  # float inputs, as a LoRA adapter runs

    def _quantized_forward(self, x: Tensor) -> Tensor:
        act, bias = self.scheme.act, self.bias
        w = self._weight_cache
        d = self.dispatch
        if d is not None and w is None and x.dtype == d.dtype:
            if d.only is not None:
                return d.only[0](d.only[1], x, bias)
            name = d.choose(x.numel() // x.shape[-1])
            if name in d.states:
                return d.kernels[name].run(d.states[name], x, bias)
        if act is not None and act.outlier_threshold is not None:
            cols = self.outlier_cols
            if x.is_cuda and cols is None and act.outlier_scaling == "exclude_elements" and \
                    importlib.util.find_spec("bitsandbytes") is not None:
                # bitsandbytes' Linear8bitLt path on our int8 weight (same codes and row scales); tested
                # against ours on CPU, where bitsandbytes also runs.
                return ref.linear_bitsandbytes(x, self.qdata, self.scale, act.outlier_threshold, bias)
            y, n = ref.linear_llm_int8(x, self.qdata, self.scale, act.outlier_threshold, cols, bias,
                                       scaling=act.outlier_scaling)
            if cols is None:
                c = self.outlier_counts
                c["forwards"], c["total"], c["max"] = c["forwards"] + 1, c["total"] + n, max(c["max"], n)
            return y
        if act is not None and w is None and int8_path(self.scheme):
            return ref.linear_w8a8_int8(x, self.qdata, self.scale, act, self.input_scale, bias)
        if w is None or (w.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type)):
            w = self.qtensor().dequantize(x.dtype)  # [N, K]; under autocast the matmul casts both operands
        bias = None if bias is None else bias.to(x.dtype)
        if act is not None:
            return ref.linear_fake_quant(x, w, act, self.input_scale, bias)
        return nn.functional.linear(x, w, bias)

    def extra_repr(self) -> str:
        rank = f", rank={self.rank}" if self.rank else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}{rank}"



@contextlib.contextmanager
def cached_dequantize(module: nn.Module, dtype: torch.dtype = torch.float32, weight_only: bool = False):
    """Dequantize the QuantLinears under `module` once for a burst of forwards (the calibration runner
    pushes every sample through a block), instead of once per call; the float copies go away on exit.
    `weight_only`: only the layers whose activations stay float, whose forward is then bit for bit what it is
    uncached (a layer that quantizes its activations takes its integer-matmul path only uncached). A layer already
    cached at `dtype` (an enclosing cached_dequantize) is left as it is; one cached at another dtype gets its
    earlier copy back on exit."""
    saved = []
    try:
        for m in module.modules():
            if not isinstance(m, QuantLinear) or (weight_only and m.scheme.act is not None):
                continue
            if m._weight_cache is not None and m._weight_cache.dtype == dtype:
                continue
            saved.append((m, m._weight_cache))
            m._weight_cache = m.qtensor().dequantize(dtype)
        yield
    finally:
        for m, earlier in saved:
            m._weight_cache = earlier


def free_bytes(device: torch.device) -> int:
    """Bytes free on `device`: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil
    return psutil.virtual_memory().available


def dequantized_if_room(model: nn.Module, dtype: torch.dtype, free: int | None = None):
    """cached_dequantize(model, dtype, weight_only=True) where the dequantized copies take at most half the memory
    free on the model's device (`free`: bytes, measured when None), else nothing: for a burst of forwards that are
    not a speed measurement (the evaluation's perplexity windows and greedy samples). Decoding a sample token by token
    through an uncached layer dequantizes its whole weight for every token (3.5x the float model's time for a
    SmolLM2-135M int4 sample); the cached forward is bit for bit the same. A dispatch plan's kernels are bypassed while
    a layer is cached, so the speed runs go outside this."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m.scheme.act is None]
    if not layers:
        return contextlib.nullcontext()
    need = sum(m.out_features * m.in_features for m in layers) * torch.empty(0, dtype=dtype).element_size()
    free = free_bytes(layers[0].qdata.device) if free is None else free
    return cached_dequantize(model, dtype, weight_only=True) if need <= free // 2 else contextlib.nullcontext()


def cast_linear_weights(model: nn.Module, dtype: torch.dtype, free: int | None = None) -> list[tuple]:
    """(module, its weight, the weight cast to `dtype`) for each float linear layer (nn.Linear, Conv1D) of `model`
    whose weight is wider than `dtype`, where the copies take at most half the memory free on the weights' device
    (`free`: bytes, measured when None); else []. For a frozen model that runs under autocast to `dtype` many times
    (distillation's teacher): autocast casts a weight that does not require gradients again at every call (on the
    embedded model's teacher, 1.55 -> 1.29 s a forward of 4 × 512 tokens on the AMX Xeon), and a matmul on the cast
    copy is the same bit for bit. Swap them in with `swapped_weights`."""
    width = torch.empty(0, dtype=dtype).element_size()
    layers = [m for m in model.modules() if isinstance(m, LINEAR_TYPES) and m.weight.is_floating_point()
              and m.weight.element_size() > width and not m.weight.is_meta]
    if not layers:
        return []
    need = sum(m.weight.numel() for m in layers) * width
    free = free_bytes(layers[0].weight.device) if free is None else free
    if need > free // 2:
        return []
    return [(m, m.weight, nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)) for m in layers]


@contextlib.contextmanager
def swapped_weights(casts: list[tuple]):
    """Within the block each module of `casts` (cast_linear_weights) holds its cast weight; its own comes back on exit
    (a weight tied to an embedding is untied only while inside)."""
    for m, _, cast in casts:
        m._parameters["weight"] = cast
    try:
        yield
    finally:
        for m, weight, _ in casts:
            m._parameters["weight"] = weight


def _rotate_input_hook(module: nn.Module, args: tuple):
    return (module.input_rotation(args[0]), *args[1:])


_rotate_input_hook.thread_safe = True  # a function of its input alone: a block's windows may run on worker threads


def attach_input_rotation(linear: nn.Module, rotation: nn.Module) -> None:
    """Make `linear` rotate its input at run time (a forward pre-hook, run before any other, so that observers and
    quantizers see the rotated input). arch.set_module carries it over to a module that replaces this one."""
    if getattr(linear, "input_rotation", None) is not None:
        raise ValueError(f"{type(linear).__name__} already rotates its input")
    linear.input_rotation = rotation
    linear.register_forward_pre_hook(_rotate_input_hook, prepend=True)
