"""llama.cpp's own C quantizer through ctypes: ggml_quantize_chunk from the libggml-base.so that llama-cpp-python
bundles. A reference for tests and bench/gguf_kquants.py only; the exporter never calls it (it quantizes with
gguf_kquants.py)."""
from __future__ import annotations

import ctypes
import os

import numpy as np

from .gguf_kquants import BLOCK_BYTES, BLOCK_WEIGHTS

GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_LIB = None


def _lib():
    global _LIB
    if _LIB is None:
        try:
            import llama_cpp
        except ImportError as exc:
            raise ImportError("the ggml reference quantizer needs llama-cpp-python: pip install llama-cpp-python") \
                from exc
        path = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
        lib = ctypes.CDLL(path)
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        _LIB = lib
    return _LIB


def ggml_quantize(w: np.ndarray, kind: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk(kind, w, ..., imatrix) on float32 rows w [R, K] -> bytes uint8 [R, K / block * size]."""
    lib = _lib()
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    out = np.zeros((rows, cols // BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind]), np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    lib.ggml_quantize_init(GGML_TYPES[kind])
    n = lib.ggml_quantize_chunk(GGML_TYPES[kind], w.ctypes.data, out.ctypes.data, 0, rows, cols,
                                None if qw is None else qw.ctypes.data)
    if n != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {n} bytes, expected {out.nbytes}")
    return out
