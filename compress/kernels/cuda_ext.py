"""Build and load the CUDA extension (cuda/*.cu + cuda/binding.cpp) with torch's JIT `load()`, on first use, on the
machine that runs it (an extension is tied to its torch, Python and CUDA versions; nothing compiled elsewhere is
carried). Architectures come from the visible GPU: sm_90 is built as sm_90a, because the fp8 kernel's wgmma needs
the arch-specific target (KERNELS.md). `COMPRESS_CUDA_BUILD_DIR` moves the build cache; `COMPRESS_CUDA_FLAGS` adds
nvcc flags (tuning builds, e.g. bench/w4a16_splits.py's variants: give each its own build directory).

An optional install-time build is the same call: `python -m compress.kernels.cuda_ext` builds and reports.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA_DIR = Path(__file__).parent / "cuda"
SOURCES = ("binding.cpp", "w4a16.cu", "w4a16_v2.cu", "fp8.cu", "dequant.cu")


def arch_list(capabilities: list[tuple[int, int]]) -> str:
    """TORCH_CUDA_ARCH_LIST for these compute capabilities: 9.0 becomes 9.0a (wgmma), others as they are."""
    out = []
    for major, minor in sorted(set(capabilities)):
        tag = f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
        out.append(tag)
    return ";".join(out)


@dataclass
class Extension:
    """The loaded extension (its ops are torch.ops.compress_cuda.*), or why it is not available."""
    ok: bool
    reason: str | None = None
    build_seconds: float = 0.0


def _build() -> Extension:
    if not torch.cuda.is_available():
        return Extension(False, "no CUDA device (torch.cuda.is_available() is False)")
    if torch.version.cuda is None:
        return Extension(False, "this torch build has no CUDA support")
    from torch.utils import cpp_extension
    caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list(caps)
    t0 = time.perf_counter()
    try:
        kwargs = {"build_directory": os.environ["COMPRESS_CUDA_BUILD_DIR"]} if os.environ.get("COMPRESS_CUDA_BUILD_DIR") else {}
        if kwargs:
            Path(kwargs["build_directory"]).mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name="compress_cuda", sources=[str(CUDA_DIR / s) for s in SOURCES],
                           extra_include_paths=[str(CUDA_DIR)], extra_cflags=["-O3"],  # torch's own -std (c++20 for its headers)
                           extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo",
                                              *os.environ.get("COMPRESS_CUDA_FLAGS", "").split()],
                           is_python_module=False, verbose=False, **kwargs)
    except Exception as e:  # a failed build leaves the reference path, and says why
        return Extension(False, f"building the CUDA extension failed: {str(e)[-2000:]}", time.perf_counter() - t0)
    finally:
        if old is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old
    return Extension(True, None, time.perf_counter() - t0)


_LOADED: list[Extension] = []  # the process's one build (a loaded shared library cannot be unloaded anyway)


def load() -> Extension:
    """Build (first call) and load the extension; later calls return the same result."""
    if not _LOADED:
        _LOADED.append(_build())
    return _LOADED[0]


if __name__ == "__main__":
    ext = load()
    print("built" if ext.ok else f"not built: {ext.reason}", f"({ext.build_seconds:.0f} s)")
