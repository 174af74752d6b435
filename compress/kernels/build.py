"""Compile-time checks of the CUDA kernels, runnable without a GPU: nvcc builds each `.cu` for the target
architectures, ptxas reports registers / shared memory / spills, and cuobjdump lists the machine instructions,
so a test can see that the W4A16 kernel really uses tensor cores (HMMA), async copies (LDGSTS) and ldmatrix
(LDSM), and that the fp8 kernel uses Hopper's wgmma (QGMMA). Tools are found on PATH, in CUDA_HOME, or in the
`nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` wheels.
"""
from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CUDA_DIR = Path(__file__).parent / "cuda"
# (name, nvcc -gencode) for the architectures we ship: Ampere (mma.sync, cp.async, ldmatrix), Ada (fp8 mma.sync),
# Hopper with the arch-specific features (wgmma needs sm_90a; plain sm_90 rejects it).
ARCHS = {
    "sm_80": "arch=compute_80,code=sm_80",
    "sm_89": "arch=compute_89,code=sm_89",
    "sm_90a": "arch=compute_90a,code=sm_90a",
}
SASS_OPS = re.compile(r"\b(HGMMA|QGMMA|HMMA|QMMA|LDSM|LDGSTS|LDL|STL|LOP3|PRMT|F2FP|UTMALDG|SYNCS|WARPGROUP)[A-Z0-9_.]*")


def _wheel_bin(tool: str) -> str | None:
    try:
        import nvidia  # the nvidia-* wheels share this namespace package
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in Path(root).glob(f"*/bin/{tool}"):
            return str(cand)
    return None


def find_tool(tool: str) -> str | None:
    """nvcc / cuobjdump / nvdisasm: PATH, then $CUDA_HOME/bin, then /usr/local/cuda/bin, then the pip wheels."""
    found = shutil.which(tool)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / tool).exists():
            return str(Path(home) / "bin" / tool)
    return _wheel_bin(tool)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel on one architecture."""
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    smem_bytes: int


def parse_ptxas(log: str) -> list[KernelResources]:
    """Parse `nvcc -Xptxas -v` output into one record per compiled kernel (entry function)."""
    out, cur = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(\w+)'", line)
        if m:
            cur = {"name": m.group(1), "arch": m.group(2), "stack": 0, "ss": 0, "sl": 0, "regs": 0, "smem": 0}
            out.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["ss"], cur["sl"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return [KernelResources(d["name"], d["arch"], d["regs"], d["ss"], d["sl"], d["stack"], d["smem"]) for d in out]


def compile_object(source: Path, arch: str, out_dir: Path, extra: tuple[str, ...] = ()) -> tuple[Path, list[KernelResources]]:
    """nvcc -c one .cu for one architecture (a key of ARCHS); returns the object file and ptxas's report.
    Raises RuntimeError with nvcc's output on a compile error."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    obj = Path(out_dir) / f"{Path(source).stem}.{arch}.o"
    cmd = [nvcc, "-c", str(source), "-o", str(obj), "-O3", "-std=c++17", f"-gencode={ARCHS[arch]}",
           "--expt-relaxed-constexpr", "-Xptxas", "-v", "-I", str(CUDA_DIR), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source} ({arch}):\n{' '.join(cmd)}\n{proc.stderr}{proc.stdout}")
    return obj, parse_ptxas(proc.stderr + proc.stdout)


def sass(obj: Path) -> str:
    """The SASS text of an object file (cuobjdump --dump-sass; needs nvdisasm beside it or on PATH)."""
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = dict(os.environ)
    disasm = find_tool("nvdisasm")
    if disasm:
        env["PATH"] = str(Path(disasm).parent) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([tool, "--dump-sass", str(obj)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {obj}: {proc.stderr}")
    return proc.stdout


def sass_functions(text: str) -> dict[str, str]:
    """Split cuobjdump's SASS into {mangled function name: its instructions}."""
    parts = re.split(r"\n\s*Function : (\S+)\n", "\n" + text)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def instruction_counts(text: str) -> collections.Counter:
    """Counts of the instruction families that tell a fast kernel from a slow one (base opcode, e.g. HMMA)."""
    return collections.Counter(m.split(".")[0] for m in SASS_OPS.findall(text))


# ---- the static instruction count of a kernel's main loop ---------------------------------------------------------
# A weight-streaming kernel is fast only if its main loop issues fewer instructions than the memory system leaves
# issue slots for: an H200 streams ~4.3 TB/s over 132 SMs at ~1.98 GHz, ~16.5 bytes an SM a cycle, so an SM's four
# schedulers have ~248 issue slots per KB of weights (int4). The count below, read from the SASS, predicts whether a
# kernel can reach the bandwidth before any GPU runs it (issue 44: at most 180 per KB; Marlin's loop needs 173-191).
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;")
MMA_BYTES = 16 * 8 // 2  # int4 weights one m16n8k16 mma consumes for one m16 tile of rows: 64 bytes


@dataclass(frozen=True)
class LoopStats:
    """The innermost loop of a function that holds tensor-core mma instructions: its SASS span [start, end] (the
    backward branch's target and the branch), its instruction count and its mma count, and the KB of int4 weights
    one pass consumes (mma x MMA_BYTES / m16 tiles of rows, since each m16 tile repeats the mma on the same weights)."""
    start: int
    end: int
    instructions: int
    mma: int
    m_tiles: int
    ops: tuple[tuple[str, int], ...]

    @property
    def weight_kb(self) -> float:
        return self.mma * MMA_BYTES / self.m_tiles / 1024

    @property
    def per_kb(self) -> float:
        """Warp-instructions issued per KB of weights (each warp runs the loop over its own weights)."""
        return self.instructions / self.weight_kb


def sass_instructions(function_text: str) -> list[tuple[int, str]]:
    """(address, instruction text without predicate-free trailing ';') of one function's SASS."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in SASS_LINE.finditer(function_text)]


def main_loop(function_text: str, m_tiles: int = 1) -> LoopStats | None:
    """The innermost backward-branch loop that holds HMMA instructions (the main loop of a GEMM), or None."""
    ins = sass_instructions(function_text)
    best = None
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        target = int(m.group(1), 16)
        body = [t for a, t in ins if target <= a <= addr]
        mma = sum(1 for t in body if re.search(r"\bHMMA\.", t))
        if mma and (best is None or len(body) < best.instructions):
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            best = LoopStats(target, addr, len(body), mma, m_tiles, tuple(sorted(ops.items(), key=lambda kv: -kv[1])))
    return best
