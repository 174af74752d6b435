"""`compress report RUN_DIR...`: finished runs side by side on one page, with the accuracy / memory / speed
Pareto frontier marked, so the recipe to ship is visible at a glance.

Accuracy is the WikiText-2 perplexity of each run's compressed model (lower is better), with KL and top-1
against the original and the mean lm-eval accuracy ± its standard error where the runs have them; memory is the weight bytes as
served (float tensors at bf16); speed is the measured decode tokens/s at batch 1 and the roofline prediction
on the first accelerator of the run's report. A run is on the frontier when no other run is at least as good
on both axes of a plot and better on one.
"""
from __future__ import annotations

import json
from pathlib import Path


def load_row(run_dir: Path, model: str = "compressed") -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    m = report["eval"]["models"][model]
    roof = (m.get("roofline") or [None])[0]
    lm = report["eval"].get("lm_eval") or {}
    accs = [v for t in ((lm.get("scores") or {}).get(model) or {}).values() for k, v in t.items()
            if k == "acc" and v["stderr"] is not None]
    return {
        "run": run_dir.name if model == "compressed" else f"{model} ({run_dir.name})" if len(
            report["eval"]["models"]) <= 3 else model,
        "folder": str(run_dir), "recipe": (report.get("recipe") or {}).get("path"),
        "ppl": m.get("ppl"), "kl": m.get("kl"), "top1": m.get("top1_agreement"),
        # mean accuracy over the tasks, with the standard error of that mean (sqrt(sum se^2) / n)
        "lm_eval_acc": sum(a["value"] for a in accs) / len(accs) if accs else None,
        "lm_eval_acc_stderr": sum(a["stderr"] ** 2 for a in accs) ** 0.5 / len(accs) if accs else None,
        "lm_eval_tasks": len(accs),
        "weight_bytes": (m.get("weights") or {}).get("serving_bf16") or (m.get("weights") or {}).get("total"),
        "checkpoint_bytes": (report.get("memory") or {}).get("checkpoint_bytes") if model == "compressed" else None,
        "decode_tok_s": (m.get("speed") or {}).get("decode_tok_s"),
        "predicted_tok_s": roof["decode"][next(iter(roof["decode"]))]["tokens_per_s"] if roof else None,
        "accelerator": roof["accelerator"]["name"] if roof else None,
    }


def gather(run_dirs: list[Path]) -> list[dict]:
    """One row per evaluated model of each run (a run's `compressed` model is named after the run; a prune run
    adds its `pruned` one), plus the baseline of the first run that evaluated one."""
    rows, baseline = [], None
    for d in run_dirs:
        d = Path(d)
        if not (d / "report.json").is_file():
            raise FileNotFoundError(f"{d} has no report.json; give folders written by `compress run`")
        models = json.loads((d / "report.json").read_text())["eval"]["models"]
        rows += [load_row(d, name) for name in models if name != "baseline"]
        if baseline is None and "baseline" in models:
            baseline = load_row(d, "baseline")
            baseline["run"] = "baseline"
    return ([baseline] if baseline else []) + rows


def frontier(rows: list[dict], x: str, higher_x_better: bool, y: str = "ppl") -> list[str]:
    """Runs not dominated on (x, y); y (perplexity) is lower-better."""
    pts = [r for r in rows if r.get(x) is not None and r.get(y) is not None]

    def better_or_equal(a, b):  # a at least as good as b on both axes
        return (a[x] >= b[x] if higher_x_better else a[x] <= b[x]) and a[y] <= b[y]

    return [r["run"] for r in pts
            if not any(better_or_equal(o, r) and (o[x], o[y]) != (r[x], r[y]) for o in pts if o is not r)]


PLOTS = {  # file: (x key, x label, higher x is better)
    "pareto_memory.png": ("weight_bytes", "weights as served (MB)", False),
    "pareto_speed_measured.png": ("decode_tok_s", "measured decode tokens/s (batch 1)", True),
    "pareto_speed_predicted.png": ("predicted_tok_s", "predicted decode tokens/s (batch 1, roofline)", True),
}


def plot(rows: list[dict], x: str, label: str, higher: bool, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get(x) is not None and r.get("ppl") is not None]
    if not pts:
        return None
    scale = 1e6 if x == "weight_bytes" else 1
    on = set(frontier(rows, x, higher))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in pts:
        ax.scatter(r[x] / scale, r["ppl"], color="C3" if r["run"] in on else "C0", zorder=3)
        ax.annotate(r["run"], (r[x] / scale, r["ppl"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = sorted((r for r in pts if r["run"] in on), key=lambda r: r[x])
    ax.plot([r[x] / scale for r in front], [r["ppl"] for r in front], color="C3", linestyle="--",
            label="Pareto frontier")
    ax.set(xlabel=label, ylabel="WikiText-2 perplexity (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _acc(r: dict) -> str:
    if r.get("lm_eval_acc") is None:
        return "—"
    return f"{r['lm_eval_acc']:.3f} ± {r['lm_eval_acc_stderr']:.3f} ({r['lm_eval_tasks']} tasks)"


def render(rows: list[dict], plots: list[str]) -> str:
    def f(v, fmt):
        return "—" if v is None else fmt.format(v)

    mem_front = set(frontier(rows, "weight_bytes", False))
    lines = ["# compress report: runs side by side", "",
             "★ = on the accuracy-against-memory Pareto frontier (no other run is smaller and at least as accurate).",
             "lm-eval: mean accuracy over the tasks ± its standard error; differences between runs smaller than "
             "about two standard errors are noise.",
             "", "| run | ppl | KL | top-1 | lm-eval acc | weights | checkpoint | decode tok/s | predicted tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        star = " ★" if r["run"] in mem_front else ""
        lines.append(f"| {r['run']}{star} | {f(r['ppl'], '{:.3f}')} | {f(r['kl'], '{:.4f}')} | "
                     f"{f(r['top1'], '{:.2%}')} | {_acc(r)} | "
                     f"{f(r['weight_bytes'] and r['weight_bytes'] / 1e6, '{:,.1f} MB')} | "
                     f"{f(r['checkpoint_bytes'] and r['checkpoint_bytes'] / 1e6, '{:,.1f} MB')} | "
                     f"{f(r['decode_tok_s'], '{:,.1f}')} | "
                     f"{f(r['predicted_tok_s'], '{:,.0f}')}{' (' + r['accelerator'] + ')' if r['accelerator'] else ''} |")
    for name, (x, label, higher) in PLOTS.items():
        on = frontier(rows, x, higher)
        if on:
            lines += ["", f"Frontier, perplexity against {label}: {', '.join(on)}."]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write(run_dirs: list[Path], out: Path) -> dict:
    rows = gather(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    plots = [name for name, (x, label, higher) in PLOTS.items() if plot(rows, x, label, higher, out / name)]
    result = {"runs": rows, "frontier": {name: frontier(rows, x, higher) for name, (x, _, higher) in PLOTS.items()},
              "plots": plots}
    (out / "report.json").write_text(json.dumps(result, indent=2))
    (out / "report.md").write_text(render(rows, plots))
    return result
