"""Mixed precision under a byte budget (stage auto_precision) on SmolLM2-135M: how well each sensitivity predicts
the measured one, and what the knapsack's choice costs against uniform schemes at equal or more bytes.

Phase 1 (`--sensitivity`): the fisher and output_error sensitivities of every planned linear to each option of the
default menu on N × 512 WikiText-2 validation tokens, and the measured KL (each layer quantized alone) on fewer
windows; Spearman rank correlations against the measured KL, pooled over (layer, option) and per option, and the
seconds each took. Phase 2 (`--runs`): `compress run` of the auto_precision recipes and their uniform baselines
through bench/awq_gptq_table.py's machinery (same protocol, same scoring loop).

    python bench/auto_precision.py --sensitivity --out bench/results/auto_precision_sensitivity.json
    python bench/auto_precision.py --drivers --out bench/results/fisher_drivers.json

`--drivers`: the fisher pass run whole-model and block by block (fisher_blocks.py), each in a fresh process on one
thread: seconds, peak RSS and the RSS before the pass, and whether the two give the same costs and the same choice.
    python bench/awq_gptq_table.py --jobs 2 --only "awq+gptq int4" "auto awq+gptq @int4 bytes" ... \
        --out bench/results/auto_precision_table.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def sensitivity(n_fisher: int, n_kl: int, threads: int, kl_blocks: list[int]) -> dict:
    from compress.arch import get_arch
    from compress.calibrate.data import TextSource, calibration_windows
    from compress.model.load import load_model
    from compress.precision.sensitivity import measure_sensitivity
    from compress.stages.auto_precision import MENU_INT8_TO_INT3  # the menu these figures were measured with
    from compress.stages.quantize import QuantizeStage, plan_quantize

    torch.set_num_threads(threads)
    loaded = load_model("default", "float32")
    model, tok = loaded.model, loaded.tokenizer
    names = [e.name for e in plan_quantize(model, get_arch(model), QuantizeStage()).quantized]
    windows = calibration_windows(TextSource("wikitext2", "validation"), tok, model, n_fisher, 512, 0)
    menu = list(MENU_INT8_TO_INT3)
    t = time.perf_counter()
    fisher = measure_sensitivity(model, windows, names, menu, "fisher")
    t_fisher = time.perf_counter() - t
    # the measured KL (one forward per layer and option) on the layers of a few blocks: the reference
    rows = [i for i, n in enumerate(names) if int(n.split(".")[2]) in kl_blocks] if kl_blocks else list(range(len(names)))
    t = time.perf_counter()
    kl = measure_sensitivity(model, windows[:n_kl], [names[i] for i in rows], menu, "kl")
    t_kl = time.perf_counter() - t
    ref = kl.costs["kl"]
    fisher.costs, fisher.nbytes = {k: c[rows] for k, c in fisher.costs.items()}, fisher.nbytes[rows]
    ok = np.isfinite(ref)
    out = {"layers": len(names), "kl_layers": [names[i] for i in rows], "options": fisher.options, "fisher_windows": n_fisher, "kl_windows": n_kl,
           "seq_len": 512, "threads": threads, "seconds": {"fisher+output_error": t_fisher, "kl": t_kl},
           "spearman_vs_kl": {}, "spearman_vs_kl_per_option": {}, "sum_over_layers": {}}
    for kind in ("fisher", "output_error"):
        c = fisher.costs[kind]
        out["spearman_vs_kl"][kind] = spearman(c[ok], ref[ok])
        out["spearman_vs_kl_per_option"][kind] = {
            o: spearman(c[:, j], ref[:, j]) for j, o in enumerate(fisher.options) if ok[:, j].all()}
        out["sum_over_layers"][kind] = {o: float(c[:, j].sum()) for j, o in enumerate(fisher.options)
                                        if ok[:, j].all()}
    out["sum_over_layers"]["kl"] = {o: float(ref[:, j].sum()) for j, o in enumerate(fisher.options) if ok[:, j].all()}
    fisher.layers = [names[i] for i in rows]
    out["table"] = {"fisher": fisher.to_dict(), "kl": kl.to_dict()}
    return out


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_driver(driver: str, error_method: str, n_windows: int, out: Path) -> None:
    """The auto_precision recipe's sensitivity pass (default menu, RTN or GPTQ errors) with one driver; the costs
    go to `out` (.npz) and the figures to stdout as JSON."""
    import resource

    from compress.arch import get_arch
    from compress.calibrate.data import TextSource, calibration_windows
    from compress.model.load import load_model
    from compress.precision.sensitivity import measure_sensitivity
    from compress.stages.auto_precision import MENU_INT8_TO_INT3  # the menu these figures were measured with
    from compress.stages.quantize import QuantizeStage, plan_quantize

    torch.set_num_threads(1)
    loaded = load_model("default", "float32")
    model, tok = loaded.model, loaded.tokenizer
    names = [e.name for e in plan_quantize(model, get_arch(model), QuantizeStage(ignore=("lm_head",))).quantized]
    source = TextSource("wikitext2", "validation")
    windows = calibration_windows(source, tok, model, n_windows + 8, 512, 0)
    before = rss_bytes()
    t = time.perf_counter()
    sens = measure_sensitivity(model, windows[:n_windows], names, list(MENU_INT8_TO_INT3), "fisher",
                               error_method=error_method, hessian_windows=windows[n_windows:], driver=driver)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    np.savez(out, fisher=sens.costs["fisher"], output_error=sens.costs["output_error"], nbytes=sens.nbytes)
    print(json.dumps({"driver": sens.driver, "error_method": error_method, "layers": len(names),
                      "windows": n_windows, "seq_len": 512, "seconds": seconds, "rss_before_bytes": before,
                      "peak_rss_bytes": peak}))


def drivers(n_windows: int, methods: list[str]) -> dict:
    from compress.precision.mixed import choose
    rows, tmp = [], Path("/tmp")
    for method in methods:
        got = {}
        for driver in ("model", "blocks"):
            npz = tmp / f"fisher_{driver}_{method}.npz"
            proc = subprocess.run([sys.executable, __file__, "--one-driver", driver, "--error-method", method,
                                   "--fisher-windows", str(n_windows), "--child-out", str(npz)], cwd=ROOT,
                                  capture_output=True, text=True, check=True)
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            got[driver] = np.load(npz)
            rows.append(row)
            print(json.dumps(row), flush=True)
        a, b = got["model"], got["blocks"]
        ok = np.isfinite(a["fisher"])
        budget = int(a["nbytes"][:, 2].sum())  # the default menu's int4 g64 column: uniform int4 g64's bytes
        rows[-1]["max_relative_difference"] = {k: float(np.max(np.abs(a[k][ok] - b[k][ok]) / np.abs(a[k][ok])))
                                               for k in ("fisher", "output_error")}
        rows[-1]["same_choice_at_int4_g64_bytes"] = choose(a["fisher"], a["nbytes"], budget) == \
            choose(b["fisher"], b["nbytes"], budget)
    return {"runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sensitivity", action="store_true")
    ap.add_argument("--drivers", action="store_true", help="the whole-model and the block-by-block fisher pass")
    ap.add_argument("--error-methods", nargs="*", default=["rtn", "gptq"])
    ap.add_argument("--one-driver", help=argparse.SUPPRESS)
    ap.add_argument("--error-method", default="rtn", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--fisher-windows", type=int, default=8)
    ap.add_argument("--kl-windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kl-blocks", type=int, nargs="*", default=[0, 10, 20, 29],
                    help="decoder blocks whose layers get the measured KL (none given: every layer; slow)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/auto_precision_sensitivity.json")
    args = ap.parse_args()
    if args.one_driver:
        return one_driver(args.one_driver, args.error_method, args.fisher_windows, args.child_out)
    if args.drivers:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        res = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "threads": 1,
               **drivers(args.fisher_windows, args.error_methods)}
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        return
    if args.sensitivity:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        res = {"date": time.strftime("%Y-%m-%d"), "commit": commit,
               **sensitivity(args.fisher_windows, args.kl_windows, args.threads, args.kl_blocks)}
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps({k: v for k, v in res.items() if k != "table"}, indent=1))


if __name__ == "__main__":
    main()
