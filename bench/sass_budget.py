"""The static instruction budget of the W4A16 kernels' main loops, read from their machine code without a GPU.

    python bench/sass_budget.py --out bench/results/sass_budget.json

Compiles w4a16.cu (version 1) and w4a16_v2.cu (the decode kernel) for sm_90a with nvcc, disassembles them with
cuobjdump, finds each kernel's main loop (the innermost loop holding mma instructions, compress.kernels.build.
main_loop) and counts warp-instructions per KB of int4 weights it consumes. An H200 streaming weights at ~4.3 TB/s
over 132 SMs at ~1.98 GHz leaves each SM ~248 issue slots per KB; issue 44 holds the decode loop to <= 180 (CI:
tests/test_kernels_w4a16_v2.py). Writes a json of every kernel and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.kernels import build  # noqa: E402

FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
         "-D__CUDA_NO_HALF2_OPERATORS__")
V1 = re.compile(r"w4a16_kernelILi(\d)ELi(\d)ELi(\d+)ELi(\d)ELb(\d)E")
V2 = re.compile(r"w4a16_v2_kernelILi(\d)ELb(\d)ELi(\d)E")
DTYPE = {0: "fp16", 1: "bf16"}
GROUP = {0: "per channel", 1: "32", 2: "64", 4: "128"}


def rows(arch: str = "sm_90a") -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in ("w4a16.cu", "w4a16_v2.cu"):
            obj, _ = build.compile_object(build.CUDA_DIR / source, arch, Path(tmp), FLAGS)
            for name, text in build.sass_functions(build.sass(obj)).items():
                m1, m2 = V1.search(name), V2.search(name)
                if m1:
                    mt, ns, stages, dt, zeros = map(int, m1.groups())
                    kernel = {"kernel": "v1", "tile": f"MT {mt} NS {ns} stages {stages}", "dtype": DTYPE[dt],
                              "zeros": bool(zeros), "group": "any (in-register scale)"}
                elif m2:
                    dt, zeros, gt = map(int, m2.groups())
                    mt = 1
                    kernel = {"kernel": "v2", "tile": "8 warps x 1 strip, ring 4 x k64", "dtype": DTYPE[dt],
                              "zeros": bool(zeros), "group": GROUP[gt]}
                else:
                    continue
                loop = build.main_loop(text, mt)
                out.append({**kernel, "m_tiles": mt, "loop_instructions": loop.instructions, "loop_mma": loop.mma,
                            "per_kb": round(loop.per_kb, 1), "ops": dict(loop.ops[:8])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="json file to write")
    args = ap.parse_args(argv)
    table = rows()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    nvcc = subprocess.run([build.find_tool("nvcc"), "--version"], capture_output=True, text=True).stdout.split("\n")
    result = {"date": date.today().isoformat(), "commit": commit, "arch": "sm_90a",
              "nvcc": next((line for line in nvcc if "release" in line), ""), "rows": table}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("| kernel | tile | dtype | zeros | group | loop instr. | mma | per KB |")
    print("|---|---|---|---|---|---:|---:|---:|")
    for r in sorted(table, key=lambda r: (r["kernel"], r["m_tiles"], r["dtype"], r["zeros"], r["group"], r["tile"])):
        if r["kernel"] == "v1" and r["m_tiles"] != 1:
            continue  # M > 16 tilings: more rows per weight byte, not the decode loop
        print(f"| {r['kernel']} | {r['tile']} | {r['dtype']} | {'yes' if r['zeros'] else 'no'} | {r['group']} | "
              f"{r['loop_instructions']} | {r['loop_mma']} | {r['per_kb']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
