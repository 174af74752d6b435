"""Weight quantizers: pure functions (weight, stats, scheme, cfg) -> QuantizedTensor."""
from __future__ import annotations

from typing import Callable

from .rtn import quantize_rtn

QUANTIZERS: dict[str, Callable] = {"rtn": quantize_rtn}


def get_quantizer(name: str) -> Callable:
    if name not in QUANTIZERS:
        raise ValueError(f"unknown quantization method {name!r}; known: {sorted(QUANTIZERS)}")
    return QUANTIZERS[name]
