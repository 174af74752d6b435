"""Few-row CPU matmuls for decoding (cpu_rows.c), built on first use and called through ctypes.

`load()` compiles cpu_rows.c with the system C compiler (`cc`/`gcc`, -O3 -march=native) into the compress cache
(`COMPRESS_CACHE`, default ~/.cache/compress; keyed by the source, the flags and this CPU's instruction-set flags,
so a cache shared between machines never hands one CPU another's binary) and returns the library, or raises
RowsUnavailable with the reason (no compiler, a failed build). `rows_linear(module)` prepares a layer once:
float32 nn.Linear weights, or QuantLinear int4 (any group that divides in_features, symmetric or zero-point) and
int8 per-channel symmetric weight-only, repacked into the kernels' strips of 32 output columns; it returns a
RowsLinear, or the reason it cannot (`rows_reason`). A RowsLinear computes x @ W^T + b for 1..16 rows of float32
x; more rows are the caller's to send elsewhere. With `int8_activations` an int4 layer computes W4A8 on CPUs with
AVX512-VNNI (x rounded to int8 per weight group; for speculative drafts only). `CBlock`/`c_linear` describe a
decoder block to cpu_rows.c's `compress_blocks`, which the lean decode loop calls for a whole step.

The packed copy is extra memory: a float32 layer's weights twice while both exist (the lean decode loop keeps the
packed copies only as long as its stream lives). The int4 and int8 copies are as small as the codes.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

SOURCE = Path(__file__).with_name("cpu_rows.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi")
LIBS = ("-lm",)
STRIP = 32
MAX_ROWS = 16
ENV_CC = "CC"


class RowsUnavailable(RuntimeError):
    """The few-row kernels cannot be built or loaded here (the message says why)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get(ENV_CC), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def library_path(source: Path = SOURCE) -> Path:
    from ..resources import cache_dir

    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.compress_f32_rows.argtypes = [p, p, p, p, i64, i64, i64]
    lib.compress_i4_rows.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64]
    lib.compress_i8_rows.argtypes = [p, p, p, p, p, i64, i64, i64]
    lib.compress_w4a8_rows.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64]
    lib.compress_has_vnni.argtypes = []
    lib.compress_blocks.argtypes = [p, i64, p, i64, i64, p, p, i64, i64, i64, i64, ctypes.c_float, p, i64, i64]
    for f in (lib.compress_f32_rows, lib.compress_i4_rows, lib.compress_i8_rows, lib.compress_w4a8_rows,
              lib.compress_has_vnni, lib.compress_blocks):
        f.restype = ctypes.c_int
    return lib


def build(source: Path, what: str) -> Path:
    """`source` (a C file beside this one) compiled into the cache on first use; the library's path, or
    RowsUnavailable with the reason (`what` names the kernels in it)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        raise RowsUnavailable(f"the {what} are built for x86-64 and arm64 CPUs, not {platform.machine()}")
    path = library_path(source)
    if not path.exists():
        cc = _compiler()
        if cc is None:
            raise RowsUnavailable(f"no C compiler (cc, gcc or clang on PATH, or $CC) to build the {what}; "
                                  "install one (Debian: apt install gcc)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, renamed into place
                out = Path(tmp) / path.name
                run = subprocess.run([cc, *FLAGS, str(source), "-o", str(out), *LIBS], capture_output=True, text=True)
                if run.returncode:
                    raise RowsUnavailable(f"building {source.name} with {cc} failed: {run.stderr.strip()[-800:]}")
                os.replace(out, path)
        except OSError as e:
            raise RowsUnavailable(f"cannot write the {what} into {path.parent} ({e}); point COMPRESS_CACHE "
                                  "at a writable folder") from e
    return path


def load() -> ctypes.CDLL:
    """The compiled kernels (built into the cache on first use); RowsUnavailable with the reason otherwise (no
    compiler: decode with torch's matmuls)."""
    path = build(SOURCE, "few-row kernels")
    try:
        return _declare(ctypes.CDLL(str(path)))
    except OSError as e:
        raise RowsUnavailable(f"loading {path} failed: {e}") from e


def _strips(t: Tensor, n: int) -> Tensor:
    """[N, K, ...] -> [NP / 32, K, 32, ...] with zero rows padding N up to NP."""
    pad = -n % STRIP
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, STRIP, *t.shape[1:]).transpose(1, 2).contiguous()


@dataclass
class RowsLinear:
    """A layer prepared for the few-row kernels: call it on float32 x [..., K] with 1..16 rows."""
    kind: str  # "f32" | "int4" | "int8" | "w4a8"
    lib: ctypes.CDLL
    weight: Tensor
    in_features: int
    out_features: int
    bias: Tensor | None = None
    scale: Tensor | None = None
    zero_scale: Tensor | None = None
    group: int = 0

    def __call__(self, x: Tensor) -> Tensor:
        k, n = self.in_features, self.out_features
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        m = x2.shape[0]
        y = torch.empty(m, n)
        b = self.bias.data_ptr() if self.bias is not None else None
        if self.kind == "f32":
            rc = self.lib.compress_f32_rows(x2.data_ptr(), self.weight.data_ptr(), b, y.data_ptr(), m, n, k)
        elif self.kind == "w4a8":
            rc = self.lib.compress_w4a8_rows(x2.data_ptr(), self.weight.data_ptr(), self.scale.data_ptr(),
                                             self.zero_scale.data_ptr(), b, y.data_ptr(), m, n, k, self.group)
        elif self.kind == "int4":
            rc = self.lib.compress_i4_rows(x2.data_ptr(), self.weight.data_ptr(), self.scale.data_ptr(),
                                           self.zero_scale.data_ptr(), b, y.data_ptr(), m, n, k, self.group)
        else:
            rc = self.lib.compress_i8_rows(x2.data_ptr(), self.weight.data_ptr(), self.scale.data_ptr(), b,
                                           y.data_ptr(), m, n, k)
        if rc:
            raise ValueError(f"the few-row kernels take 1..{MAX_ROWS} rows (got {m})")
        return y.reshape(*x.shape[:-1], n)


class CLinear(ctypes.Structure):
    """cpu_rows.c's Lin: a prepared layer as the block kernel reads it."""
    _fields_ = [("kind", ctypes.c_int64), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zs", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("g", ctypes.c_int64)]


class CBlock(ctypes.Structure):
    """cpu_rows.c's Block: one decoder block's norms, layers and KV-cache rows."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("q", CLinear), ("k", CLinear), ("v", CLinear), ("o", CLinear), ("gate", CLinear), ("up", CLinear),
                ("down", CLinear), ("kcache", ctypes.c_void_p), ("vcache", ctypes.c_void_p)]


KINDS = {"f32": 0, "int4": 1, "int8": 2, "w4a8": 3}


def c_linear(r: RowsLinear | None) -> CLinear:
    """The block kernel's view of a prepared layer (None: an absent one, n = 0)."""
    if r is None:
        return CLinear(0, None, None, None, None, 0, 0, 0)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return CLinear(KINDS[r.kind], r.weight.data_ptr(), ptr(r.scale), ptr(r.zero_scale), ptr(r.bias),
                   r.out_features, r.in_features, r.group)


def rows_reason(module: nn.Module) -> str | None:
    """Why `module` cannot run on the few-row kernels (None: it can)."""
    from ..core.nn import QuantLinear

    if getattr(module, "input_rotation", None) is not None:
        return "rotates its input at run time"
    if type(module) is nn.Linear:
        if module.weight.dtype != torch.float32:
            return f"float weights in {str(module.weight.dtype).replace('torch.', '')} (the kernel is float32)"
        return None if module.weight.device.type == "cpu" else "not on the CPU"
    if not isinstance(module, QuantLinear):
        return f"{type(module).__name__} is not a linear layer the kernels know"
    if getattr(module, "trellis", None) is not None:
        return "trellis codes (kernels/trellis.py decodes them)"
    s = module.scheme
    if module.qdata.device.type != "cpu":
        return "not on the CPU"
    if module.rank:
        return f"a rank-{module.rank} low-rank repair term (the kernel has no place for it)"
    if s.act is not None:
        return f"quantized activations ({s.name})"
    if s.is_float or module.global_scale is not None:
        return f"{s.dtype} weights (int4 and int8 only)"
    if s.dtype == "int4":
        if s.granularity == "group" and module.in_features % s.group_size == 0:
            return None
        if s.granularity == "channel":
            return None
        return f"int4 {s.granularity} scales with in_features {module.in_features}"
    if s.dtype == "int8":
        if s.granularity == "channel" and module.zero_point is None:
            return None
        return "int8 with groups or a zero point (per-channel symmetric only)"
    return f"{s.dtype} weights (int4 and int8 only)"


def has_vnni(lib: ctypes.CDLL) -> bool:
    """Whether the library was built with AVX512-VNNI (the int4 x int8 kernel)."""
    return bool(lib.compress_has_vnni())


def _w4a8(u: Tensor, scale: Tensor, zero_scale: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Codes u [N, K] (0..15) and per-group s, z*s [N, K / G] in the W4A8 kernel's layout (cpu_rows.c)."""
    pad = -n % 16
    if pad:
        u, scale, zero_scale = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (u, scale, zero_scale))
    s, k = u.shape[0] // 16, u.shape[1]
    v = u.reshape(s, 16, k // 8, 2, 4).permute(0, 2, 1, 4, 3)  # [S, K/8, 16 columns, 4 bytes, low/high]
    packed = (v[..., 0] | (v[..., 1] << 4)).contiguous()
    strip = lambda t: t.reshape(s, 16, -1).transpose(1, 2).contiguous()  # noqa: E731  [S, groups, 16]
    return packed, strip(scale), strip(zero_scale)


def w4a8_reason(module: nn.Module, lib: ctypes.CDLL) -> str | None:
    """Why an int4 layer cannot take the W4A8 kernel (None: it can)."""
    if not has_vnni(lib):
        return "this CPU (or the build) has no AVX512-VNNI"
    s = module.scheme
    group = s.group_size if s.granularity == "group" else module.in_features
    if module.in_features % 8 or group % 8:
        return f"in_features {module.in_features} and group {group} must be multiples of 8"
    return None


def rows_linear(module: nn.Module, lib: ctypes.CDLL, int8_activations: bool = False) -> RowsLinear:
    """`module` repacked for the few-row kernels (check rows_reason first). int8_activations: an int4 layer computes
    W4A8 where the CPU has VNNI (an approximation of its forward, for drafts), else as always."""
    problem = rows_reason(module)
    if problem:
        raise ValueError(f"the few-row kernels cannot run this layer: {problem}")
    n, k = module.out_features, module.in_features
    bias = None if module.bias is None else module.bias.detach().float().contiguous()
    if type(module) is nn.Linear:
        return RowsLinear("f32", lib, _strips(module.weight.detach(), n), k, n, bias)
    qt = module.qtensor()
    s = qt.scheme
    codes = qt.codes()  # int32 [N, K]: signed (symmetric) or unsigned (zero point)
    if s.dtype == "int8":
        return RowsLinear("int8", lib, _strips(codes.to(torch.int8), n), k, n, bias,
                          scale=_strips(qt.scale.float().reshape(n, 1), n).reshape(-1).contiguous())
    group = s.group_size if s.granularity == "group" else k
    scale = qt.scale.float().reshape(n, k // group)
    if qt.zero_point is None:  # signed codes q in qmin..qmax: u = q - qmin, z = -qmin
        u, zero = codes - s.qmin, torch.full_like(scale, float(-s.qmin))
    else:
        u, zero = codes, qt.zero_point.float().reshape(n, k // group)
    u = u.to(torch.uint8)
    if int8_activations and w4a8_reason(module, lib) is None:
        packed, sc, zsc = _w4a8(u, scale, zero * scale, n)
        return RowsLinear("w4a8", lib, packed, k, n, bias, scale=sc, zero_scale=zsc, group=group)
    u = _strips(u, n)  # [S, K, 32]
    packed = (u[..., :16] | (u[..., 16:] << 4)).contiguous()  # [S, K, 16]
    return RowsLinear("int4", lib, packed, k, n, bias, scale=_strips(scale, n), zero_scale=_strips(zero * scale, n),
                      group=group)
