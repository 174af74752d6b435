"""Weight quantizers: pure functions (weight, stats, scheme, cfg) -> QuantizedTensor."""
from __future__ import annotations

from typing import Callable

from .gptq import quantize_gptq
from .rtn import quantize_rtn

# name -> function(weight [out, in], scheme, ...) -> QuantizedTensor. GPTQ also takes the input Hessian.
QUANTIZERS: dict[str, Callable] = {"rtn": quantize_rtn, "gptq": quantize_gptq}


def get_quantizer(name: str) -> Callable:
    if name not in QUANTIZERS:
        raise ValueError(f"unknown quantization method {name!r}; known: {sorted(QUANTIZERS)}")
    return QUANTIZERS[name]
