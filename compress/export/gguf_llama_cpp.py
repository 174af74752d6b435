"""Running a GGUF file in llama.cpp (llama-cpp-python): the model loaded with the plain CPU kernels, and its logits
for windows of token ids (what `compress verify` and the tests compare with the in-memory model).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor


@contextlib.contextmanager
def _without_extra_buffers():
    """llama-cpp-python builds its model params from llama_model_default_params(); turn off use_extra_bufts
    (weight repacking into AMX / other CPU extra buffer types). llama.cpp's AMX matmul segfaults on some
    machines (llama.cpp issue #20824, reproduced here on an AMX-capable Xeon: SIGSEGV in
    ggml_backend_amx_mul_mat) and gave wrong Q4_0 / Q4_1 results before PR #16315; the plain CPU kernels
    are the reference."""
    import llama_cpp.llama as module

    lib = module.llama_cpp
    original = lib.llama_model_default_params

    def params():
        p = original()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def load_llama_cpp(path: str | Path, n_ctx: int = 512, extra_buffers: bool = False, **kwargs):
    """A llama_cpp.Llama on `path` (one thread, quiet, logits for every position)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError("running a GGUF file needs llama-cpp-python: pip install llama-cpp-python") from exc
    kwargs = {"logits_all": True, "n_threads": 1, "n_threads_batch": 1, "verbose": False, "n_ctx": n_ctx,
              "n_batch": n_ctx, "n_ubatch": n_ctx, **kwargs}
    with contextlib.nullcontext() if extra_buffers else _without_extra_buffers():
        return llama_cpp.Llama(model_path=str(path), **kwargs)


def llama_cpp_logits(path: str | Path, windows: Tensor, n_ctx: int | None = None,
                     extra_buffers: bool = False) -> Tensor:
    """llama.cpp's logits for each window of token ids (int64 [B, T]): float32 [B, T, vocab]. The context is
    cleared between windows; no BOS is added."""
    windows = torch.as_tensor(windows)
    if windows.ndim != 2:
        raise ValueError(f"windows must be [B, T] token ids, got shape {tuple(windows.shape)}")
    b, t = windows.shape
    if n_ctx is not None and n_ctx < t:
        raise ValueError(f"n_ctx={n_ctx} is shorter than the windows ({t} tokens)")
    return torch.stack(list(iter_llama_cpp_logits(path, windows, n_ctx, extra_buffers)))


def iter_llama_cpp_logits(path: str | Path, windows: Tensor, n_ctx: int | None = None, extra_buffers: bool = False):
    """llama_cpp_logits one window at a time (float32 [T, vocab] each), the model loaded once."""
    windows = torch.as_tensor(windows)
    t = windows.shape[1]
    llm = load_llama_cpp(path, n_ctx=n_ctx or t, extra_buffers=extra_buffers)
    try:
        for row in windows.tolist():
            llm.reset()
            llm.eval(row)
            yield torch.from_numpy(np.array(llm.scores[:t], dtype=np.float32))
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
