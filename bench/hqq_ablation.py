"""Why HQQ int3 loses to round-to-nearest on SmolLM2-135M although its weight error is lower in every layer:
RTN int3 g64 everywhere, then HQQ for one projection type at a time, scored on the same windows (in memory), plus
each method's weight MSE summed over the decoder's linear layers.

    python bench/hqq_ablation.py        # 2 x 512 WikiText-2 test tokens (a diagnostic, not the README protocol)
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

from compress.arch import get_arch, get_module, set_module  # noqa: E402
from compress.measure.ppl import score_windows  # noqa: E402
from compress.pipeline.report import eval_windows  # noqa: E402
from compress.model.load import load_model  # noqa: E402
from compress.core.nn import QuantLinear, is_linear  # noqa: E402
from compress.quantizers import quantize_rtn  # noqa: E402
from compress.quantizers.hqq import quantize_hqq  # noqa: E402
from compress.core.scheme import QuantScheme  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default="bench/results/hqq_ablation.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("default")
    base = loaded.model
    blocks = get_arch(base).blocks
    linears = [n for n, m in base.named_modules() if n.startswith(blocks + ".") and is_linear(m)]
    hqq = QuantScheme(f"int{args.bits}", "group", 64, False, zero_point_dtype="float16")
    rtn = QuantScheme(f"int{args.bits}", "group", 64, False)
    mse = {"rtn": 0.0, "hqq": 0.0}
    codes = {}
    for name in linears:
        w = get_module(base, name).weight.detach()
        codes[name] = {"rtn": quantize_rtn(w, rtn), "hqq": quantize_hqq(w, hqq)}
        for k, qt in codes[name].items():
            mse[k] += float((w - qt.dequantize()).pow(2).sum())

    def model_with(hqq_for: str | None) -> torch.nn.Module:
        model = copy.deepcopy(base)
        for name in linears:
            use = "hqq" if hqq_for == "all" or (hqq_for and name.endswith(hqq_for)) else "rtn"
            set_module(model, name, QuantLinear.from_module(get_module(model, name), codes[name][use]))
        return model

    models = {"baseline": base, "rtn everywhere": model_with(None), "hqq everywhere": model_with("all")}
    models.update({f"rtn, hqq for {p}": model_with(p) for p in PROJECTIONS})
    windows = eval_windows(loaded.tokenizer, "test", args.seq_len, args.windows)
    scores = score_windows(models, windows, baseline="baseline")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "bits": args.bits, "group_size": 64,
              "windows": args.windows, "seq_len": args.seq_len, "weight_sq_error_sum": mse,
              "scores": {n: {"ppl": s.ppl, "kl": s.kl, "top1": s.top1_agreement} for n, s in scores.items()}}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"weight squared error, summed over {len(linears)} layers: rtn {mse['rtn']:.4g}, hqq {mse['hqq']:.4g}")
    print("| model | ppl | KL | top-1 |\n|---|---:|---:|---:|")
    for n, s in scores.items():
        print(f"| {n} | {s.ppl:.3f} | {s.kl:.4f} | {s.top1_agreement:.2%} |")


if __name__ == "__main__":
    main()
