"""This machine's peaks, measured once and cached, and a run's profile held against them.

`machine_peaks` times a matmul at float32 and bfloat16 (where the device multiplies bfloat16 natively) at the thread
count the run uses, and the read bandwidth of a file written, synced and dropped from the page cache (the disk, not
memory; where the page cache cannot be dropped the figure is memory's, and the probe says so). The result is cached
in `$COMPRESS_CACHE` (default `~/.cache/compress`) under the machine's key (CPU model or GPU name, cores, threads,
torch version): the probe costs about two seconds once, nothing afterwards. `profile_section` turns a
core.profile.Profile into the report's `profile` section: each phase's seconds and share of the wall, its rate
against the peak that applies, what no phase covered, and the phase that dominated.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from ..core.nn import native_bf16
from ..core.profile import Profile
from ..resources import cache_dir
from ..threads import cpu_threads

PROBE_VERSION = 1
READ_PROBE_BYTES = 128 << 20
MATMUL_PROBE_SECONDS = 0.3
BYTE_PHASES = {"read": "read_gb_per_s"}  # phases whose bytes are held against a probed bandwidth


def _processor() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(device: str, threads: int) -> str:
    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else _processor()
    return f"{kind}|{name}|{os.cpu_count()} cores|{threads} threads|torch {torch.__version__}|v{PROBE_VERSION}"


def probe_matmul(dtype: torch.dtype, device: str = "cpu", seconds: float = MATMUL_PROBE_SECONDS) -> float:
    """GFLOP/s of a square-ish matmul at `dtype` on `device`, the best of repeated calls for about `seconds`."""
    m, n, k = (1024, 2048, 2048) if torch.device(device).type == "cpu" else (8192, 8192, 8192)
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b.T  # warm-up (allocation, kernel selection)
    sync()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        a @ b.T
        sync()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return 2 * m * n * k / best / 1e9


def _drop_cached(fd: int) -> bool:
    """Ask the kernel to drop a synced file's pages from the page cache (False where it cannot be asked)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (AttributeError, OSError):
        return False


def probe_read(folder: Path, nbytes: int = READ_PROBE_BYTES) -> tuple[float, bool]:
    """(GB/s reading a file of `nbytes` just written in `folder`, synced and dropped from the page cache; whether
    it could be dropped: if not, the figure is the page cache's)."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".read-probe-") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        dropped = _drop_cached(f.fileno())
        buf = bytearray(16 << 20)
        t = time.perf_counter()
        with open(f.name, "rb", buffering=0) as r:
            while r.readinto(buf):
                pass
        return nbytes / (time.perf_counter() - t) / 1e9, dropped


def machine_peaks(device: str = "cpu", threads: int | None = None, cache: Path | None = None) -> dict:
    """This machine's matmul rates (GFLOP/s by dtype) and read bandwidth (GB/s), from the cache or probed now."""
    threads = threads or torch.get_num_threads()
    cache = cache or cache_dir()
    key = machine_key(device, threads)
    path = cache / "machine.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return {**known[key], "key": key, "cached": True}
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16(torch.device(device).type) else [])
    with cpu_threads(threads):
        rates = {str(d).replace("torch.", ""): round(probe_matmul(d, device), 1) for d in dtypes}
    read, dropped = probe_read(cache)
    entry = {"matmul_gflop_per_s": rates, "read_gb_per_s": round(read, 3),
             "read_probe": "disk (page cache dropped)" if dropped else "page cache (could not be dropped)",
             "measured": datetime.date.today().isoformat()}
    known[key] = entry
    try:  # a cache that cannot be written costs the probe again next time, nothing else
        tmp = path.with_name(f".machine-{os.getpid()}.json")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
    return {**entry, "key": key, "cached": False}


def _peak(phase: str, work: dict, peaks: dict) -> tuple[float | None, str]:
    """(the peak this phase's work is held against, its unit)."""
    if work.get("flop"):
        return peaks["matmul_gflop_per_s"].get(work.get("dtype", "float32")), "GFLOP/s"
    if phase in BYTE_PHASES:
        return peaks.get(BYTE_PHASES[phase]), "GB/s"
    return None, "GB/s"


def profile_section(profile: Profile, peaks: dict | None = None, before: float = 0.0) -> dict:
    """The report's `profile`: wall seconds (the run's, plus `before`: the process's start-up before the run began),
    each phase's seconds, share and rate (against `peaks`, machine_peaks), overlapped work, what no phase covered."""
    seconds = dict(profile.seconds)
    if before > 0:
        seconds["startup"] = seconds.get("startup", 0.0) + before
    wall = profile.elapsed() + before
    covered = sum(seconds.values())
    rows = []
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        row = {"phase": name, "seconds": round(s, 3), "share": round(s / wall, 4) if wall else 0.0}
        work = profile.work.get(name, {})
        busy = s + profile.overlapped.get(name, 0.0)  # the work was done in both (a read ahead: mostly overlapped)
        if busy > 0 and (work.get("flop") or work.get("bytes")):
            unit = "GFLOP/s" if work.get("flop") else "GB/s"
            row["rate"] = round((work["flop"] / 1e9 if work.get("flop") else work["bytes"] / 1e9) / busy, 2)
            row["unit"] = unit
            if work.get("dtype"):
                row["dtype"] = work["dtype"]
            if peaks is not None:
                peak, _ = _peak(name, work, peaks)
                if peak:
                    row["peak"] = peak
                    row["of_peak"] = round(row["rate"] / peak, 3)
        rows.append(row)
    out = {"wall_s": round(wall, 3), "phases": rows, "unaccounted_s": round(wall - covered, 3),
           "covered": round(covered / wall, 4) if wall else 1.0,
           "dominant": rows[0]["phase"] if rows else None}
    if profile.overlapped:
        out["overlapped"] = {k: round(v, 3) for k, v in profile.overlapped.items()}
    if peaks is not None:
        out["machine"] = peaks
    return out


def profile_lines(section: dict) -> list[str]:
    """The report.md lines of a profile section."""
    if not section:
        return []
    parts = []
    for row in section["phases"]:
        if row["seconds"] < 0.05:
            continue
        text = f"{row['phase']} {row['seconds']:.1f} s ({100 * row['share']:.0f}%"
        if "rate" in row:
            text += f", {row['rate']:.3g} {row['unit']}"
            if "peak" in row:
                text += f" of a measured {row['peak']:.3g}" + (f" {row['dtype']}" if row.get("dtype") else "")
        parts.append(text + ")")
    lines = ["", f"Profile: {section['wall_s']:.1f} s wall, {100 * section['covered']:.1f}% in the phases below; "
                 f"{section['dominant']} dominated.", "", "- " + "\n- ".join(parts)]
    if section.get("overlapped"):
        lines.append("- overlapped with the above (a helper thread): " +
                     ", ".join(f"{k} {v:.1f} s" for k, v in section["overlapped"].items()))
    return lines
