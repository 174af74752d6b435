"""What the roofline predicts for the microscaling formats on Blackwell (B200) beside Hopper (H100 SXM): weight bytes
(codes + block scales, embeddings and head in bf16), decode tokens/s at batch 1 and 64 (1024-token bf16 KV cache)
and the time to prefill a 1024-token prompt, per weight scheme, for the embedded model and two larger shapes.

Decode at small batch is bandwidth-bound, so it follows the bytes; prefill is compute-bound, so it follows the
matmul precision: fp4 e2m1 activations (NVFP4, MXFP4) run at Blackwell's fp4 rate (9 PFLOP/s dense, twice fp8),
8-bit ones (fp8, MXFP8) at the fp8 rate, weight-only schemes at bf16. Hopper has no fp4 tensor cores: an fp4 scheme
runs at its fp8 rate there. Ceilings: datasheet bandwidth and peak (compress/serving/planner.py, compress/serving/roofline.py,
whose B200 entry cites the DGX B200 datasheet).

    python bench/microscale_roofline.py [--out bench/results/microscale_roofline.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.serving import planner as P  # noqa: E402
from compress.serving.roofline import get_accelerator  # noqa: E402

SCHEMES = ("bf16", "fp8", "mxfp8", "int4-g64", "nvfp4a16", "nvfp4", "mxfp4")  # plan.WEIGHTS names
ACCELERATORS = ("H100-SXM", "B200")
MODELS = ("default", "llama-2-13b", "qwen2.5-32b")
CONTEXT, PROMPT = 1024, 1024


def shape(name: str) -> P.ModelShape:
    if name in P.BUILTIN:
        return P.builtin_shape(name)
    from compress.model.load import load_model

    return P.shape_from_config(load_model(name, "auto", "cpu").model.config, "SmolLM2-135M (default)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "bench/results/microscale_roofline.json"))
    args = ap.parse_args()
    a, rows = P.Assumptions(), []
    for model in MODELS:
        s = shape(model)
        print(f"\n{s.name}: | scheme | bits per linear weight | weight GB | " +
              " | ".join(f"{acc}: tok/s B=1 | tok/s B=64 | prefill {PROMPT} ms" for acc in ACCELERATORS) + " |")
        for w in SCHEMES:
            row = {"model": s.name, "scheme": w,
                   "bits_per_weight": sum(n * P.bits_per_weight(P.weight_scheme(w), k) for k, n in s.linears)
                   / s.linear_params, "weight_bytes": P.weight_bytes(s, w), "accelerators": {}}
            for name in ACCELERATORS:
                acc = get_accelerator(name)
                fits = P.memory_split(s, acc, w, "bf16", a, 1, CONTEXT)["max_batch"] >= 64
                row["accelerators"][name] = {
                    "peak_tflops": P.compute_peak(acc, w) / 1e12,
                    "decode_tokens_per_s": {b: b / P.step_seconds(s, acc, w, "bf16", a, 1, b, CONTEXT) for b in (1, 64)},
                    "prefill_s": P.ttft_seconds(s, acc, w, a, 1, PROMPT), "fits_batch_64": fits}
            rows.append(row)
            cells = [f"{r['decode_tokens_per_s'][1]:,.0f} | {r['decode_tokens_per_s'][64]:,.0f}"
                     f"{'' if r['fits_batch_64'] else ' (does not fit)'} | {1e3 * r['prefill_s']:.2f}"
                     for r in row["accelerators"].values()]
            print(f"| {w} | {row['bits_per_weight']:.3f} | {row['weight_bytes'] / 1e9:.2f} | " + " | ".join(cells) + " |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    Path(args.out).write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit.strip(),
                                          "context": CONTEXT, "prompt": PROMPT, "kv": "bf16",
                                          "assumptions": "datasheet ceilings (plan.Assumptions defaults)",
                                          "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
