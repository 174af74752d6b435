"""Results table for the README: baseline vs RTN int8/int4 (absmax and zero-point) on SmolLM2-135M.

All models are scored in one loop over the same WikiText-2 test windows (bench/protocol.py), so KL and
top-1 agreement compare like with like. Quantized in memory from the float32 model: only the quantization differs.

    python bench/quant_table.py       # the README protocol (bench/protocol.py)
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP: idle threads must not spin
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import protocol  # noqa: E402
from compress.arch import get_arch  # noqa: E402
from compress.measure.memory import peak_rss_bytes, weight_bytes  # noqa: E402
from compress.measure.ppl import score_windows  # noqa: E402
from compress.pipeline.report import eval_windows  # noqa: E402
from compress.model.load import load_model  # noqa: E402
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize  # noqa: E402
from compress.core.scheme import scheme  # noqa: E402

CONFIGS = {
    "int8 absmax per-channel": scheme("int8", "channel", symmetric=True),
    "int8 zero-point per-channel": scheme("int8", "channel", symmetric=False),
    "int4 g64 absmax": scheme("int4", "group", 64, symmetric=True),
    "int4 g64 zero-point": scheme("int4", "group", 64, symmetric=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-windows", type=int, default=protocol.WINDOWS)
    ap.add_argument("--seq-len", type=int, default=protocol.SEQ_LEN)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for scoring")
    ap.add_argument("--out", default="bench/results/quant_table.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    base = loaded.model
    arch = get_arch(base)
    models = {"baseline (float32)": base}
    for name, sch in CONFIGS.items():
        m = copy.deepcopy(base)
        stage = QuantizeStage(method="rtn", scheme=sch)
        apply_quantize(m, plan_quantize(m, arch, stage), stage)
        models[name] = m
    windows = eval_windows(loaded.tokenizer, protocol.SPLIT, args.seq_len, args.max_windows)
    scores = score_windows(models, windows, baseline="baseline (float32)")
    rows = {}
    for name, m in models.items():
        s, w = scores[name], weight_bytes(m)
        rows[name] = {"ppl": s.ppl, "kl": s.kl, "top1_agreement": s.top1_agreement, "tokens": s.tokens,
                      "quantized_linears_over_bf16": w["quantized_over_bf16"], "weight_bytes": w["total"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"model": loaded.source, "windows": int(windows.shape[0]), "seq_len": args.seq_len,
              "split": protocol.SPLIT, "threads": args.threads, "protocol": protocol.as_dict(), "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "seconds": time.perf_counter() - t0, "peak_rss_bytes": peak_rss_bytes(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    base_ppl = rows["baseline (float32)"]["ppl"]
    print(f"| model | WikiText-2 ppl | Δ ppl | KL (nats/token) | top-1 agreement | quantized linears / bf16 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        ratio = r["quantized_linears_over_bf16"]
        print(f"| {name} | {r['ppl']:.3f} | {100 * (r['ppl'] / base_ppl - 1):+.2f}% | {r['kl']:.4f} | "
              f"{r['top1_agreement']:.2%} | {'—' if ratio is None else f'{ratio:.3f}×'} |")
    print(f"\n{result['windows']} windows × {args.seq_len} tokens, commit {commit}, {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
