"""Minitron on SmolLM2-135M: width (MLP, hidden, heads) against depth pruning, before and after distillation.

Runs recipes/minitron_prune_distill.yaml once per axis with `compress run` (each in its own process; skip
with --reuse to only gather finished runs), then writes bench/results/minitron.json, a Markdown table on
stdout and each run's recovery-curve PNG beside the JSON. Every run trains on WikiText-2 validation
and is evaluated on WikiText-2 test (8 windows of 2048 by the recipe's eval section).

    python bench/minitron_table.py            # about an hour on one CPU core
    python bench/minitron_table.py --reuse    # tabulate runs/minitron_* that already exist
    python bench/minitron_table.py --reuse --speed   # + decode tok/s of every saved model, one after another,
                                                     # on an otherwise idle machine (the runs' own figures
                                                     # may share the CPU with other work)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "recipes/minitron_prune_distill.yaml"
RUNS = {  # axis: (output folder, --set overrides)
    "mlp": ("runs/minitron_mlp", []),
    "depth": ("runs/minitron_depth", ["stages.0.axes=[depth]"]),
    "hidden": ("runs/minitron_hidden", ["stages.0.axes=[hidden]", "stages.0.multiple_of=16"]),
    "mlp + hidden (uniform ratio)": ("runs/minitron_mlp_hidden", ["stages.0.axes=[mlp,hidden]",
                                                                 "stages.0.multiple_of=16"]),
    "heads (keep 1 of 3 KV groups)": ("runs/minitron_heads", [
        "stages.0.params=null", "stages.0.axes=[]", "stages.0.heads=0.34", "stages.0.heads_mode=kv_group"]),
    "mlp, then AWQ int4 g64": ("runs/minitron_then_awq_int4", None),  # its own recipe
}


def run(axis: str, out: str, sets: list[str] | None) -> None:
    recipe = "recipes/minitron_then_awq_int4.yaml" if sets is None else RECIPE
    cmd = [sys.executable, "-m", "compress", "run", recipe, "--no-progress", "--overwrite", "--output", out,
           "--set", "output.save_dtype=float32"]  # the saved model is the evaluated one (standard_suite reuses it)
    for s in sets or ():
        cmd += ["--set", s]
    print(f"[{axis}] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def row(axis: str, folder: Path) -> dict:
    rep = json.loads((folder / "report.json").read_text())
    prune = next(s for s in rep["stages"] if s["stage"] == "prune")
    distill = next(s for s in rep["stages"] if s["stage"] == "distill")
    models = rep["eval"]["models"]
    base, pruned, final = models["baseline"]["ppl"], models["pruned"]["ppl"], models["compressed"]["ppl"]
    return {
        "axis": axis, "run": str(folder.relative_to(ROOT)), "shape": prune["pruned"],
        "parameters": prune["parameters_after"], "parameter_ratio": prune["parameter_ratio"],
        "checkpoint_bytes": rep["memory"]["checkpoint_bytes"],
        "ppl": {"baseline": base, "pruned": pruned, "distilled": final},
        "kl": {"pruned": models["pruned"]["kl"], "distilled": models["compressed"]["kl"]},
        "gap_closed": (pruned - final) / (pruned - base),
        "decode_tok_s": {k: models[k]["speed"]["decode_tok_s"] for k in models if "speed" in models[k]},
        "distill": {"tokens": distill["tokens"], "minutes": distill["seconds"] / 60, "steps": distill["steps"],
                    "tokens_per_s": distill["tokens_per_s"], "curve": distill["curve"]},
        "windows": rep["eval"]["protocol"]["windows"], "seq_len": rep["eval"]["protocol"]["seq_len"],
    }


def quiet_speed(folders: list[Path]) -> dict[str, dict]:
    """Batch-1 prefill/decode speed of the original and each saved model, measured one after another."""
    import torch

    sys.path.insert(0, str(ROOT))
    from compress.measure.speed import measure_speed
    from compress.model.load import load_model

    torch.set_num_threads(1)
    out = {}
    for name, source in [("baseline", "default"), *((f.name, str(f)) for f in folders)]:
        model = load_model(source).model
        out[name] = measure_speed(model, model.get_input_embeddings().weight.shape[0], 512, 32, 5, "cpu")
        print(f"[speed] {name}: decode {out[name]['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reuse", action="store_true", help="only tabulate finished runs")
    p.add_argument("--only", nargs="*", help="runs to make, by folder suffix: mlp depth hidden mlp_hidden heads "
                                             "then_awq_int4 (default: all)")
    p.add_argument("--speed", action="store_true", help="measure decode speed of the saved models one by one (those "
                                                        "without a figure in bench/results/minitron.json)")
    args = p.parse_args()
    rows = []
    for axis, (out, sets) in RUNS.items():
        if args.only and Path(out).name.removeprefix("minitron_") not in args.only:
            continue
        if not args.reuse:
            run(axis, out, sets)
        if (ROOT / out / "report.json").is_file():
            rows.append(row(axis, ROOT / out))
            png = next((ROOT / out).glob("recovery_curve_stage*.png"), None)
            if png:
                shutil.copy(png, ROOT / "bench" / "results" / f"minitron_{Path(out).name.removeprefix('minitron_')}"
                                                               f"_recovery.png")
    results = ROOT / "bench" / "results" / "minitron.json"
    earlier = {r["run"]: r["quiet_speed"] for r in json.loads(results.read_text()) if "quiet_speed" in r} \
        if results.is_file() else {}
    for r in rows:  # keep speeds measured by an earlier --speed pass
        if r["run"] in earlier:
            r["quiet_speed"] = earlier[r["run"]]
    if args.speed:  # measure the runs that have no quiet speed yet (all of them the first time)
        todo = [r for r in rows if "quiet_speed" not in r]
        speeds = quiet_speed([ROOT / r["run"] for r in todo]) if todo else {}
        for r in todo:
            r["quiet_speed"] = {"baseline": speeds["baseline"], "pruned": speeds[Path(r["run"]).name]}
    results.write_text(json.dumps(rows, indent=2))
    print("| pruned axis | shape (layers, hidden, q/kv heads, MLP) | parameters | checkpoint | ppl before distill "
          "| ppl after | gap closed | KL after | decode tok/s (base → after) | distillation |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s, d = r["shape"], r["distill"]
        speed = r["decode_tok_s"]
        if "quiet_speed" in r:
            speed = {"baseline": r["quiet_speed"]["baseline"]["decode_tok_s"],
                     "compressed": r["quiet_speed"]["pruned"]["decode_tok_s"]}
        print(f"| {r['axis']} | {s['layers']}, {s['hidden']}, {s['heads']}/{s['kv_heads']}, {s['intermediate']} | "
              f"{r['parameters'] / 1e6:.1f}M ({r['parameter_ratio']:.1%}) | {r['checkpoint_bytes'] / 1e6:.0f} MB | "
              f"{r['ppl']['pruned']:.2f} | {r['ppl']['distilled']:.2f} | {r['gap_closed']:.0%} | "
              f"{r['kl']['distilled']:.3f} | {speed.get('baseline', 0):.1f} → {speed.get('compressed', 0):.1f} | "
              f"{d['tokens']:,} tokens, {d['minutes']:.1f} min |")
    if rows:
        print(f"\nbaseline perplexity {rows[0]['ppl']['baseline']:.3f} on {rows[0]['windows']} × {rows[0]['seq_len']} "
              "WikiText-2 test tokens")


if __name__ == "__main__":
    main()
