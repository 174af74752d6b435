"""Data-parallel calibration on this machine: GPTQ on the embedded model, one process against two (torchrun, gloo).

The same recipe three ways, each in a fresh process with nothing else running: one process on one thread, one
process on two threads, and `torchrun --nproc-per-node 2 -m compress run` with one thread per process (each takes
every 2nd calibration window; Hessians all-reduced before each block's GPTQ, compress/calibrate/distributed.py). Wall time,
the run's own timings, and whether the results agree (perplexity, block errors). Results go to
bench/results/data_parallel.json.

    python bench/data_parallel.py [--n-samples 32] [--seq-len 512]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(mode: str, threads: int, out: Path, overrides: list[str]) -> dict:
    args = ["run", "recipes/gptq_int4.yaml", "--no-progress", "--output", str(out)] + \
        [a for o in overrides + [f"calibration.threads={threads}", f"eval.threads={threads}",
                                 f"model.threads={threads}"] for a in ("--set", o)]
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
               "-m", "compress"] + args
    else:
        cmd = [sys.executable, "-m", "compress"] + args
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    row = {"mode": mode, "threads_per_process": threads, "exit": proc.returncode, "wall_s": round(wall, 1),
           "command": " ".join(cmd[1:])}
    if proc.returncode != 0:
        row["stderr_tail"] = proc.stderr[-2000:]
        return row
    report = json.loads((out / "report.json").read_text())
    row.update(timings=report["timings"], ppl=report["eval"]["models"]["compressed"]["ppl"],
               block_errors=report.get("block_errors"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--work", default="/tmp/compress-dp")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    overrides = [f"calibration.n_samples={args.n_samples}", f"calibration.seq_len={args.seq_len}",
                 "eval.max_windows=2", "eval.seq_len=512", "eval.speed=false", "output.overwrite=true",
                 "model.stream=never"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows = []
    for mode, threads in (("one process", 1), ("one process", 2), ("torchrun", 1)):
        row = run(mode, threads, work / f"{mode.replace(' ', '-')}-{threads}", overrides)
        print(json.dumps({k: v for k, v in row.items() if k != "block_errors"}), flush=True)
        rows.append(row)
    ok = [r for r in rows if r["exit"] == 0]
    base = next((r for r in ok if r["mode"] == "one process" and r["threads_per_process"] == 1), None)
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": f"{os.cpu_count()} CPU cores",
              "recipe": "recipes/gptq_int4.yaml on the embedded model (in memory)", "overrides": overrides,
              "rows": rows}
    if base is not None:
        result["wall_over_one_process_one_thread"] = {f"{r['mode']} x{r['threads_per_process']}":
                                                      round(r["wall_s"] / base["wall_s"], 3) for r in ok}
        result["same_ppl_as_one_process"] = {f"{r['mode']} x{r['threads_per_process']}":
                                             abs(r["ppl"] / base["ppl"] - 1) for r in ok}
    path = ROOT / "bench" / "results" / "data_parallel.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
