"""GPTQ solve time on one Llama-2-7B-shaped decoder block, before and after the speed work (issue 49, item 4).

The block's seven linears (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008), weights N(0, 0.02^2) with a few
heavier input channels, int4 group 128 with act_order (GPTQConfig defaults). Each distinct input (the attention
input q/k/v read, o's, the MLP input gate/up read, down's) gets a Hessian H = 2 X^T X / n of 8 x 256 tokens of a
low-rank-plus-noise X (rank 256 plus 5 % noise, per-channel scales over two decades; a real activation's Hessian is
as ill-conditioned and as rank-deficient below 2048 tokens).

`before`: tests/reference/gptq_plain.py, the code of the base commit: every layer factors its own fresh copy of H
(as the quantize stage did) with Cholesky, cholesky_inverse, Cholesky. `after`: compress.quantizers.gptq with the
textbook factor (fast_factor=False): one factor per distinct input (hessian_factor) and the faster column loop;
its codes are checked against `before`'s on every layer: equal but for the near ties that the compiled loop's fused
update rounds the other way (at most 0.2% of the packed bytes, quantizers/gptq_loop.py). `fast_factor`: `after` with
GPTQConfig(fast_factor=True), the cheaper factor (one Cholesky, one triangular inverse; the default since this
bench was first run, not bit for bit): the fraction of packed code bytes that differ from `before`'s is reported.
`two_workers`: `fast_factor` the way the quantize stage runs it on a CPU of more than one thread, each input's
factor and layers on one of two worker threads (threads.run_groups); one figure, the block's wall. Each variant runs `--repeats`
times; the minimum per step is reported. One process per thread count, with OMP_NUM_THREADS set before torch
starts.

    python bench/gptq_speed.py --out bench/results/gptq_speed.json
    python bench/gptq_speed.py --hidden 512 --mlp 1408 --out /tmp/x.json   # a quick smaller run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _problem(hidden: int, mlp: int, tokens: int, seed: int = 0):
    """{input name: (K, H)} and [(layer, input name, N)] of one block."""
    import torch
    g = torch.Generator().manual_seed(seed)
    inputs = {"attn_in": hidden, "attn_out": hidden, "mlp_in": hidden, "mlp_act": mlp}
    hess = {}
    for name, k in inputs.items():
        rank = min(256, k)
        x = torch.randn(tokens, rank, generator=g) @ (torch.randn(rank, k, generator=g) / rank ** 0.5)
        x += 0.05 * torch.randn(tokens, k, generator=g)
        x *= torch.exp(torch.rand(k, generator=g) * 4.6 - 2.3)  # channel scales over two decades
        hess[name] = 2 * x.T @ x / tokens
        del x
    layers = [("q_proj", "attn_in", hidden), ("k_proj", "attn_in", hidden), ("v_proj", "attn_in", hidden),
              ("o_proj", "attn_out", hidden), ("gate_proj", "mlp_in", mlp), ("up_proj", "mlp_in", mlp),
              ("down_proj", "mlp_act", hidden)]
    weights = {}
    for layer, inp, n in layers:
        w = torch.randn(n, inputs[inp], generator=g) * 0.02
        w[:, torch.randint(0, inputs[inp], (8,), generator=g)] *= 5  # a few heavier input channels
        weights[layer] = w
    return hess, layers, weights


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since t0: with one thread the CPU time is what the step costs even when other processes
    share the cores (they stretch its wall time, not its CPU time, short of memory-bandwidth contention)."""
    wall, cpu = _clock()
    return wall - t0[0], cpu - t0[1]


def _run_before(hess, layers, weights, sch, cfg):
    from tests.reference.gptq_plain import plain_gptq
    times, codes = {}, {}
    for layer, inp, _ in layers:
        t0 = _clock()
        h = hess[inp].clone()  # the stage handed each layer a fresh H/n
        codes[layer] = plain_gptq(weights[layer], h, sch, cfg, name=layer, overwrite_hessian=True).qdata
        times[layer] = _since(t0)
        del h
    return times, codes


def _run_after(hess, layers, weights, sch, cfg):
    from compress.quantizers.gptq import hessian_factor, quantize_gptq
    times, codes, factor, held = {}, {}, None, None
    for layer, inp, _ in layers:
        if held != inp:
            factor = None
            t0 = _clock()
            factor = hessian_factor(hess[inp].clone(), cfg, name=layer, overwrite=True)
            times[f"factor {inp}"] = _since(t0)
            held = inp
        t0 = _clock()
        codes[layer] = quantize_gptq(weights[layer], factor, sch, cfg, name=layer).qdata
        times[layer] = _since(t0)
    return times, codes


def _run_fast_factor(hess, layers, weights, sch, cfg):
    import dataclasses
    return _run_after(hess, layers, weights, sch, dataclasses.replace(cfg, fast_factor=True))


def _run_two_workers(hess, layers, weights, sch, cfg):
    """The quantize stage's way on a CPU of more than one thread (stages/quantize.py, threads.run_groups): each
    distinct input's factor and layers on one of two worker threads, the largest first, with the cheaper factor.
    One step: the whole block's wall and CPU time."""
    import dataclasses

    from compress.quantizers.gptq import hessian_factor, quantize_gptq
    from compress.threads import run_groups
    cfg = dataclasses.replace(cfg, fast_factor=True)
    groups: dict = {}
    for layer, inp, _ in layers:
        groups.setdefault(inp, []).append(layer)

    def work(inp):
        factor = hessian_factor(hess[inp].clone(), cfg, name=inp, overwrite=True)
        return {layer: quantize_gptq(weights[layer], factor, sch, cfg, name=layer).qdata for layer in groups[inp]}

    t0 = _clock()
    done = run_groups(list(groups), work, 2, cost=lambda inp: sum(weights[n].numel() for n in groups[inp]) *
                      hess[inp].shape[0])
    times = {"block (two workers)": _since(t0)}
    return times, {k: v for d in done for k, v in d.items()}


def _worker(args) -> dict:
    import torch
    from compress.core.scheme import scheme
    from compress.quantizers.gptq import GPTQConfig
    threads = args.threads[0]
    torch.set_num_threads(threads)
    sch, cfg = scheme("int4", "group", 128, True), GPTQConfig(fast_factor=False)
    t0 = time.perf_counter()
    hess, layers, weights = _problem(args.hidden, args.mlp, args.tokens)
    setup = time.perf_counter() - t0
    out = {"threads": threads, "setup_s": round(setup, 2)}
    ref = None
    variants = (("before", _run_before), ("after", _run_after), ("fast_factor", _run_fast_factor),
                ("two_workers", _run_two_workers))
    codes_of = {}
    for variant, fn in variants:
        if variant not in args.variants:
            continue
        best, diff = {}, None
        for _ in range(args.repeats):
            times, codes = fn(hess, layers, weights, sch, cfg)
            best = {k: tuple(map(min, v, best.get(k, v))) for k, v in times.items()}
            ref = codes if ref is None else ref
            diff = {k: float((ref[k] != codes[k]).float().mean()) for k in codes}
        codes_of[variant] = codes
        out[variant] = {"per_step_s": {k: round(v[0], 3) for k, v in best.items()},
                        "block_s": round(sum(v[0] for v in best.values()), 2),
                        "per_step_cpu_s": {k: round(v[1], 3) for k, v in best.items()},
                        "block_cpu_s": round(sum(v[1] for v in best.values()), 2)}
        if variant != args.variants[0]:  # against the first variant run (before)
            out[variant]["packed_code_bytes_differing"] = {k: round(v, 6) for k, v in diff.items()}
            if variant == "after":  # the same solve but for the fused in-block update (quantizers/gptq_loop.py)
                assert max(diff.values()) <= 0.002, f"after: codes differ from {args.variants[0]}: {diff}"
        if variant == "two_workers" and "fast_factor" in codes_of:  # the same solves, on other threads
            out[variant]["packed_code_bytes_differing_from_fast_factor"] = {
                k: round(float((codes_of["fast_factor"][k] != c).float().mean()), 6) for k, c in codes.items()}
        print(f"threads={threads} {variant}: block {out[variant]['block_s']} s (CPU {out[variant]['block_cpu_s']} s) "
              f"{out[variant]['per_step_s']}", flush=True)
    return out


def _machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    import torch
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=11008)
    ap.add_argument("--tokens", type=int, default=8 * 256)
    ap.add_argument("--blocks", type=int, default=32, help="blocks of the model, for the projection")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=["before", "after", "fast_factor", "two_workers"],
                    choices=["before", "after", "fast_factor", "two_workers"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/gptq_speed.json")
    args = ap.parse_args()
    if args.worker:
        sys.path.insert(0, str(ROOT))
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return
    runs = []
    for threads in args.threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        cmd = [sys.executable, __file__, "--worker", "--threads", str(threads), "--hidden", str(args.hidden),
               "--mlp", str(args.mlp), "--tokens", str(args.tokens), "--repeats", str(args.repeats),
               "--variants", *args.variants]
        load = os.getloadavg()[0]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        sys.stderr.write(res.stderr)
        if res.returncode:
            raise SystemExit(f"worker with {threads} threads failed (exit {res.returncode})")
        run = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        run["load_before"], run["load_after"] = round(load, 2), round(os.getloadavg()[0], 2)
        for variant in ("before", "after", "fast_factor", "two_workers"):
            if variant in run:
                run[variant]["projected_solve_s"] = round(run[variant]["block_s"] * args.blocks, 1)
                run[variant]["projected_solve_cpu_s"] = round(run[variant]["block_cpu_s"] * args.blocks, 1)
        if "fast_factor" in run and "two_workers" in run:
            run["speedup_two_workers_over_fast_factor"] = round(run["fast_factor"]["block_s"] /
                                                                run["two_workers"]["block_s"], 2)
        for variant in ("after", "fast_factor", "two_workers"):
            if "before" in run and variant in run:
                run[f"speedup_{variant}"] = round(run["before"]["block_s"] / run[variant]["block_s"], 2)
                run[f"speedup_cpu_{variant}"] = round(run["before"]["block_cpu_s"] / run[variant]["block_cpu_s"], 2)
        print(json.dumps(run), flush=True)
        runs.append(run)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "compress"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip())
    result = {"command": " ".join(["python", "bench/gptq_speed.py", *sys.argv[1:]]),
              "commit": commit + ("+dirty" if dirty else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": _machine(),
              "shape": {"hidden": args.hidden, "mlp": args.mlp, "tokens": args.tokens, "blocks": args.blocks,
                        "scheme": "int4 g128 symmetric, act_order, dampening 0.01, block_size 128"},
              "note": "min of --repeats runs per step, wall (per_step_s) and process CPU time (per_step_cpu_s: "
                      "with 1 thread the figure other processes on the shared cores stretch least); "
                      "projected_solve_s = block_s x blocks (the solves only: no forward passes, no I/O). "
                      "load_before/after: the 1-min loadavg.",
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
