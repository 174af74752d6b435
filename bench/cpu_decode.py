"""CPU decode speed of SmolLM2-135M at batch 1, one thread: fp32 and bf16 dense against int8 and int4 models
whose QuantLinears go through the dispatcher (kernels/dispatch.py), all measured in one run, interleaved, so the
ratios share the machine's state. Also the matmul alone (4096 x 4096, M = 1) for the kernels the dispatcher uses.

    python bench/cpu_decode.py            # about 8 minutes; writes bench/results/cpu_decode.json

Models: int4 g32 symmetric (GPTQ/RTN grid) and int4 g64 zero-point (AWQ/RTN grid), int8 per-channel symmetric,
all with lm_head in bf16 (SmolLM2 ties it to the embedding; the quantize stage keeps tied heads in float by
default); then int4 g64 zero-point with the head untied and quantized to int8 per channel (`tied_lm_head: untie`,
+28 MB: the embedding stays bf16); and the int4 g64 model in float32 (the CPU default dtype), whose int4 layers run
int4pack on bf16-rounded inputs.
"""
from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.arch import get_arch  # noqa: E402
from compress.measure.speed import measure_speed  # noqa: E402
from compress.kernels import cpu  # noqa: E402
from compress.kernels.dispatch import install_dispatch, plan_dispatch, summary  # noqa: E402
from compress.model.load import load_model  # noqa: E402
from compress.core.nn import QuantLinear  # noqa: E402
from compress.core.qtensor import QuantizedTensor  # noqa: E402
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize  # noqa: E402
from compress.core.scheme import scheme  # noqa: E402

OUT = ROOT / "bench" / "results" / "cpu_decode.json"
PREFILL, DECODE, ROUNDS = 128, 64, 5
QUANT = {"int8 per-channel": scheme("int8", "channel", None, True),
         "int4 g32 sym": scheme("int4", "group", 32, True),
         "int4 g64 zero-point": scheme("int4", "group", 64, False)}


def quantized(s, head=None, dtype: str = "bfloat16") -> torch.nn.Module:
    model = load_model("default", dtype=dtype).model.eval()
    stages = [QuantizeStage(scheme=s, ignore=("lm_head",))]
    if head is not None:
        stages.append(QuantizeStage(scheme=head, targets=("lm_head",), ignore=(), tied_lm_head="untie"))
    for stage in stages:
        apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    return model


def matmul_alone() -> dict:
    """4096 x 4096 at M = 1, bf16 activations: dense bf16 / fp32 F.linear against the int4 and int8 kernels."""
    gen = torch.Generator().manual_seed(0)
    n = k = 4096
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen).bfloat16()
    q4 = QuantizedTensor.from_codes(torch.randint(-8, 8, (n, k), generator=gen), torch.rand(n, k // 32) + 0.5, None,
                                    scheme("int4", "group", 32, True))
    q8 = QuantizedTensor.from_codes(torch.randint(-127, 128, (n, k), generator=gen), torch.rand(n, 1) + 0.5, None,
                                    scheme("int8", "channel", None, True))
    p4, p8 = cpu.prepare_int4pack(q4, torch.bfloat16), cpu.prepare_int8pack(q8, torch.bfloat16)
    wb, xf = w.bfloat16(), x.float()
    fns = {"bf16 F.linear": lambda: torch.nn.functional.linear(x, wb),
           "fp32 F.linear": lambda: torch.nn.functional.linear(xf, w),
           "int4pack (g32)": lambda: cpu.linear_int4pack(p4, x, None),
           "int8pack (per channel)": lambda: cpu.linear_int8pack(p8, x, None)}
    times = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            fn()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            times[name].append((time.perf_counter() - t0) / 20)
    med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    return {"shape": [n, k], "rows": 1, "us": med, "speedup_vs_bf16": {n_: med["bf16 F.linear"] / v for n_, v in med.items()}}


def main() -> None:
    torch.set_num_threads(1)
    models = {"fp32": load_model("default", dtype="float32").model.eval(),
              "bf16": load_model("default", dtype="bfloat16").model.eval()}
    for name, s in QUANT.items():
        models[name] = quantized(s)
    models["int4 g64 zero-point + int8 head"] = quantized(QUANT["int4 g64 zero-point"], QUANT["int8 per-channel"])
    models["int4 g64 zero-point, float32 model"] = quantized(QUANT["int4 g64 zero-point"], dtype="float32")
    plans = {}
    for name, m in models.items():
        if any(isinstance(q, QuantLinear) for q in m.modules()):
            report = plan_dispatch(m)
            install_dispatch(m, report)  # the speed runs below use the chosen kernels
            plans[name] = report.to_dict()
    runs = {name: [] for name in models}
    for _ in range(ROUNDS):  # interleaved: every round measures every model once
        for name, model in models.items():
            r = measure_speed(model, model.config.vocab_size, prefill_tokens=PREFILL, decode_tokens=DECODE, repeats=1)
            runs[name].append(r["decode_tok_s"])
    decode = {name: statistics.median(v) for name, v in runs.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"date": date.today().isoformat(), "commit": commit, "cpu": platform.processor() or platform.machine(),
              "threads": 1, "batch": 1, "prefill_tokens": PREFILL, "decode_tokens": DECODE, "rounds": ROUNDS,
              "decode_tok_s": decode, "decode_runs": runs,
              "vs_bf16": {name: v / decode["bf16"] for name, v in decode.items()},
              "kernels": {name: summary(m) for name, m in models.items()}, "dispatch": plans,
              "matmul_alone": matmul_alone()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print("| model | decode tok/s | vs bf16 | vs fp32 | kernel |\n|---|---:|---:|---:|---|")
    for name, v in decode.items():
        print(f"| {name} | {v:.1f} | {v / decode['bf16']:.2f}× | {v / decode['fp32']:.2f}× | {result['kernels'][name]} |")
    print("matmul alone (4096x4096, M=1):", {k: f"{v:.2f}x" for k, v in result["matmul_alone"]["speedup_vs_bf16"].items()})


if __name__ == "__main__":
    main()
