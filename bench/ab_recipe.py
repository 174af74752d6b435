"""A recipe's run at two commits, back to back in the same hour, alternating: each run's wall, compress and
evaluation seconds, its profile phases and its KL, and the second commit's time over the first's per round.

This VM's speed moves by up to half between hours (the same code's awq_int4 evaluation took 97 s in one hour and
138 s in another), so a before/after taken hours apart says little; runs taken in turn, in the same hour, give a
ratio that holds. The first commit runs from a git worktree (removed afterwards), the second from this checkout (its
working tree as it is, uncommitted changes included, unless --head names a commit).

    python bench/ab_recipe.py recipes/awq_int4.yaml --base 4327db5                 # one round: base, then head
    python bench/ab_recipe.py recipes/awq_int4.yaml --base 4327db5 --rounds 2      # base, head, head, base
    python bench/ab_recipe.py recipes/awq_int4.yaml --base HEAD~1 --set eval.speed=false --out ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_once(tree: Path, recipe: str, out: Path, sets: list[str]) -> dict:
    """`compress run` of `recipe` with the code in `tree`, in its own process; what its report says."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_WAIT_POLICY="PASSIVE")
    env.setdefault("COMPRESS_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    cmd = [sys.executable, "-m", "compress", "run", recipe, "--output", str(out), "--overwrite", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` in {tree} failed:\n{done.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    models = report["eval"].get("models", report["eval"])
    scored = {n: m for n, m in models.items() if isinstance(m, dict) and m.get("kl")}
    timings = report["timings"]
    return {"wall_s": round(wall, 1), "compress_s": round(timings.get("compress") or 0.0, 1),
            "eval_s": round(timings.get("eval") or 0.0, 1),
            "phases": {p["phase"]: p["seconds"] for p in report.get("profile", {}).get("phases", [])},
            "kl": {n: m["kl"] for n, m in scored.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", help="a recipe path relative to the repository root")
    ap.add_argument("--base", required=True, help="the commit to compare against (run from a worktree)")
    ap.add_argument("--head", help="a commit for the other side (default: this checkout as it is)")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of two runs; every other round runs head first")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a recipe override for both sides")
    ap.add_argument("--out", help="write the runs and ratios here as JSON")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    base = _git("rev-parse", "--short", args.base)
    head = _git("rev-parse", "--short", args.head) if args.head else _git("rev-parse", "--short", "HEAD") + \
        ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="compress-ab-") as tmp:
        trees = {"base": Path(tmp) / "base"}
        _git("worktree", "add", "--detach", str(trees["base"]), base)
        if args.head:
            trees["head"] = Path(tmp) / "head"
            _git("worktree", "add", "--detach", str(trees["head"]), args.head)
        else:
            trees["head"] = ROOT
        try:
            for r in range(args.rounds):
                for side in (("base", "head") if r % 2 == 0 else ("head", "base")):
                    row = run_once(trees[side], args.recipe, Path(tmp) / f"{side}-{r}", args.sets)
                    row.update(side=side, round=r, commit=base if side == "base" else head)
                    runs.append(row)
                    print(f"round {r} {side} ({row['commit']}): wall {row['wall_s']} s, compress {row['compress_s']} "
                          f"s, eval {row['eval_s']} s, KL " + ", ".join(f"{n} {v:.4f}" for n, v in row["kl"].items()),
                          flush=True)
        finally:
            for side in ("base", "head"):
                if trees[side] != ROOT:
                    _git("worktree", "remove", "--force", str(trees[side]))
    ratios = []
    for r in range(args.rounds):
        pair = {row["side"]: row for row in runs if row["round"] == r}
        ratios.append({k: round(pair["head"][k] / pair["base"][k], 3)
                       for k in ("wall_s", "compress_s", "eval_s") if pair["base"].get(k)})
        print(f"round {r}: head / base " + ", ".join(f"{k} {v}" for k, v in ratios[-1].items()))
    result = {"recipe": args.recipe, "base": base, "head": head, "sets": args.sets,
              "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs, "ratios": ratios}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
