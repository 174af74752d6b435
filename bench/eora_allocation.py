"""EoRA against the KL, the choices behind the eora stage's `weighting: kl` and `allocate` (issue 50), on a finished
kl_hessians + GPTQ run of the embedded model, scored on the issue-19 protocol (bench/protocol.py).

    python bench/eora_allocation.py RUN [--hessians DIR] [--rank 8] [--variants ...] [--out FILE]

RUN: a `compress run` folder of kl_hessians + GPTQ (no eora stage), e.g. bench/awq_gptq_table.py's "kl+gptq int3".
Its KL Hessians are recomputed into --hessians (default RUN.kl_hessians; the run removed its own) with the stage's
defaults: 32 × 512 WikiText-2 validation windows, seed 0, bf16 matmuls where the CPU has them. Each variant adds
terms to a fresh copy of RUN's model with the same parameter budget (`--rank` on every layer); variants:

  input            every layer rank r, fitted to the error in the KL's gradient-weighted input side only
  kl               every layer rank r, fitted in both sides (eora_kl_terms)
  global:CAP       ranks allocated over the whole model (allocate_ranks), each layer fitted up to CAP
  block:CAP        the same, each block's budget spent within the block
  shrink:S:CAP     global:CAP with the output side shrunk by S instead of 1
  rounds:N:CAP     global:CAP, then N - 1 rounds of GPTQ against the KL on W - B A at the allocated rank, the term
                   refitted, the round with the least KL cost kept per layer (what the stage's `iterations` does
                   without allocate)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402

from compress.core.nn import QuantLinear  # noqa: E402
from compress.quantizers.eora import allocate_ranks, eora_kl_terms, kl_cost, kl_weights  # noqa: E402


def kl_hessians(folder: Path, model, tokenizer) -> None:
    """The kl_hessians stage's files for every block linear, as the stage computes them by default."""
    from compress.calibrate.data import calibration_windows
    from compress.core.nn import calibration_dtype
    from compress.precision.output_hessians import output_hessians
    from compress.recipe import CalibrationSpec

    cal = CalibrationSpec()
    windows = calibration_windows(cal.source(), tokenizer, model, 32, 512, 0)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    output_hessians(model, windows, names, folder, 0, None,
                    compute_dtype=getattr(torch, calibration_dtype("auto", torch.device("cpu"))))


def fits(run: Path, hessians: Path, floats: dict, cap: int, shrink: float, flat_output: bool = False) -> dict:
    """Per layer: the float weight, both sides, and the KL fit of its error up to rank `cap` (flat_output: fitted
    with H_out = I, the gradient-weighted input side alone; its gains are then not in the KL's units)."""
    from compress.export.native import load_compressed
    from compress.quantizers.gptq_kron import load_kl_hessians

    out = {}
    for name, layer in load_compressed(run).named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        w = floats[name]
        h_out, h_in = load_kl_hessians(hessians, name, tuple(w.shape))
        error = w - layer.qtensor().dequantize(torch.float32)
        weights = kl_weights(h_in, torch.eye(len(h_out)) if flat_output else h_out,
                             output_shrink=0.0 if flat_output else shrink)
        a, b, gains, total = eora_kl_terms(error, weights, cap)
        out[name] = {"w": w, "h_in": h_in, "h_out": h_out, "weights": weights, "a": a, "b": b, "gains": gains,
                     "total": total, "cost": sum(w.shape), "scheme": layer.scheme}
    return out


def allocate(f: dict, rank: int, per_block: bool) -> dict[str, int]:
    if not per_block:
        return allocate_ranks({n: x["gains"] for n, x in f.items()}, {n: x["cost"] for n, x in f.items()},
                              rank * sum(x["cost"] for x in f.values()))
    blocks: dict[str, list[str]] = {}
    for n in f:
        blocks.setdefault(n.split(".layers.")[1].split(".")[0], []).append(n)
    ranks = {}
    for names in blocks.values():
        ranks.update(allocate_ranks({n: f[n]["gains"] for n in names}, {n: f[n]["cost"] for n in names},
                                    rank * sum(f[n]["cost"] for n in names)))
    return ranks


def alternate(model, f: dict, ranks: dict, rounds: int) -> None:
    """Rounds of GPTQ against the KL on W - B A at each layer's allocated rank, the best by KL cost kept."""
    from compress.quantizers.gptq import GPTQConfig
    from compress.quantizers.gptq_kron import quantize_gptq_kron

    layers = dict(model.named_modules())
    for name, r in ranks.items():
        if not r:
            continue
        x, layer = f[name], layers[name]
        a, b = x["a"][:r], x["b"][:, :r]
        error = x["w"] - layer.qtensor().dequantize(torch.float32)
        best = (kl_cost(error - b @ a, x["weights"]), a, b, layer.qtensor())
        for _ in range(rounds - 1):
            qt = quantize_gptq_kron(x["w"] - b @ a, x["h_in"], x["h_out"], x["scheme"], GPTQConfig(), name)
            error = x["w"] - qt.dequantize(torch.float32)
            a, b, _, _ = eora_kl_terms(error, x["weights"], r)
            if (value := kl_cost(error - b @ a, x["weights"])) < best[0]:
                best = (value, a, b, qt)
        _, a, b, qt = best
        layer.qdata, layer.scale, layer.zero_point = qt.qdata, qt.scale, qt.zero_point
        layer.set_lowrank(a.contiguous(), b.contiguous())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--hessians", type=Path)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["global:64", "block:64", "global:128", "rounds:4:64"])
    ap.add_argument("--out", type=Path, default=Path("bench/results/eora_allocation.json"))
    args = ap.parse_args()
    from compress.export.native import load_compressed
    from compress.measure.ppl import score_windows
    from compress.model.load import load_model
    from compress.pipeline.report import eval_windows
    from awq_gptq_table import linear_bits

    torch.set_num_threads(2)
    base = load_model("default")
    hessians = args.hessians or args.run.with_name(args.run.name + ".kl_hessians")
    if not (hessians / "index.json").is_file():
        t0 = time.perf_counter()
        kl_hessians(hessians, base.model, base.tokenizer)
        print(f"KL Hessians: {time.perf_counter() - t0:.0f} s", flush=True)
    floats = {n: m.weight.detach().float() for n, m in base.model.named_modules() if isinstance(m, torch.nn.Linear)}
    cache: dict[tuple, dict] = {}
    models, notes = {"baseline (float32)": base.model, "no repair": load_compressed(args.run)}, {}
    for variant in args.variants:
        kind, *rest = variant.split(":")
        shrink = float(rest.pop(0)) if kind == "shrink" else 1.0
        rounds = int(rest.pop(0)) if kind == "rounds" else 1
        cap = int(rest[0]) if rest else args.rank
        side = "input" if kind == "input" else "kl"
        key = (cap, shrink, side)
        if key not in cache:
            cache[key] = fits(args.run, hessians, floats, cap, shrink, flat_output=side == "input")
        f = cache[key]
        ranks = {n: args.rank for n in f} if kind in ("input", "kl") else allocate(f, args.rank, kind == "block")
        model = load_compressed(args.run)
        t0 = time.perf_counter()
        if rounds > 1:
            alternate(model, f, ranks, rounds)
        else:
            layers = dict(model.named_modules())
            for name, r in ranks.items():
                if r:
                    layers[name].set_lowrank(f[name]["a"][:r].contiguous(), f[name]["b"][:, :r].contiguous())
        removed = sum(float(f[n]["gains"][:r].sum()) for n, r in ranks.items()) if side == "kl" else None
        notes[variant] = {"max_rank": max(ranks.values()), "layers_without": sum(r == 0 for r in ranks.values()),
                          "predicted_kl_cost_removed": None if removed is None else
                          removed / sum(x["total"] for x in f.values()),
                          "rounds_s": time.perf_counter() - t0 if rounds > 1 else 0.0}
        models[variant] = model
        print(variant, notes[variant], flush=True)
    windows = eval_windows(base.tokenizer, protocol.SPLIT, protocol.SEQ_LEN, protocol.WINDOWS)
    scores = score_windows(models, windows, baseline="baseline (float32)")
    rows = {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement, **linear_bits(models[n]), **notes.get(n, {})}
            for n, s in scores.items()}
    for n, r in rows.items():
        print(f"{n:>24}: ppl {r['ppl']:.3f} KL {r['kl']:.4f} top-1 {r['top1']:.2%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": str(args.run), "rank": args.rank, "protocol": protocol.DESCRIPTION,
                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
