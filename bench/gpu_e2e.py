"""The kernels inside a model on a GPU: quantize random-weight Llama and Qwen2 models with compress, plan the
dispatch on the GPU (every candidate timed per layer and batch size against the dense bf16 layer), install it, and
check every layer's output, on the inputs the model itself gives it, against the layer's reference path
(dequantize-then-matmul); the logits' difference is recorded too, but random weights amplify per-layer rounding
differences many times over (the first GPU run: 1.9e-2 for W4A16, 9.6e-2 for FP8_DYNAMIC, whose single layers
agree to about 3e-3 on the CPU), so the per-layer error is the check.

    python bench/gpu_e2e.py --out DIR      # on a GPU: about a minute
    python bench/gpu_e2e.py --dry-run      # CPU: tiny widths, the CPU kernels (tests/test_gpu_check.py runs it)

Schemes: W4A16 (int4, group 128, zero points: the W4A16 kernel, split-K at small batch) and FP8_DYNAMIC (e4m3
per-channel weights, per-token activations: our quantize + fp8 GEMM, or torch._scaled_mm). Writes gpu_e2e.json:
per model and scheme, the worst per-layer relative error (and which layer), the logits' relative error, the kernel
chosen per batch size and its speed against the dense layer (dispatch.plan_dispatch's own timings: eager calls,
host-synchronized), and exits non-zero when a layer's error exceeds its bound.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress.arch import get_arch  # noqa: E402
from compress.kernels.dispatch import install_dispatch, plan_dispatch, summary  # noqa: E402
from compress.core.scheme import FP8_DYNAMIC, W4A16  # noqa: E402
from compress.stages.quantize import QuantizeStage, apply_quantize, plan_quantize  # noqa: E402
from dataclasses import replace  # noqa: E402

# Llama-3-8B-like widths at 2 layers (the kernels' model shapes), and Qwen2 with its q/k/v bias
CONFIGS = {
    "llama": lambda d: transformers.LlamaConfig(hidden_size=d, intermediate_size=int(d * 3.5), num_hidden_layers=2,
                                                num_attention_heads=d // 128, num_key_value_heads=max(1, d // 512),
                                                vocab_size=4096, max_position_embeddings=512),
    "qwen2": lambda d: transformers.Qwen2Config(hidden_size=d, intermediate_size=d * 3, num_hidden_layers=2,
                                                num_attention_heads=d // 128, num_key_value_heads=max(1, d // 512),
                                                vocab_size=4096, max_position_embeddings=512),
}
SCHEMES = {"W4A16 g128 asym": replace(W4A16, symmetric=False), "FP8_DYNAMIC": FP8_DYNAMIC}
# per layer, relative (||y - ref|| / ||ref||): the kernels' own bounds (gpu_check: 5e-3 W4A16 bf16, 1e-2 fp8) plus
# the reference path's bf16 rounding of the dequantized weight and, for fp8, of the fake-quantized activation
BOUND = {"W4A16 g128 asym": 1e-2, "FP8_DYNAMIC": 2e-2}


def layer_errors(model, ids) -> dict[str, float]:
    """Each QuantLinear's output on its dispatched kernel against its reference path, on the inputs this forward
    gives it (a hook runs the layer again with the dispatch removed)."""
    from compress.core.nn import QuantLinear
    errors, hooks = {}, []

    busy = set()  # the reference call below runs the hooks too

    def hook(name):
        def fn(module, args, out):
            if name in busy:
                return
            busy.add(name)
            saved, module.dispatch = module.dispatch, None
            try:
                ref = module(args[0]).double()
            finally:
                module.dispatch, _ = saved, busy.discard(name)
            errors[name] = ((out.double() - ref).norm() / ref.norm()).item()
        return fn

    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return errors


def one(family: str, width: int, name: str, device: torch.device, batch_sizes) -> dict:
    torch.manual_seed(0)
    config = CONFIGS[family](width)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    stage = QuantizeStage(scheme=SCHEMES[name], ignore=("lm_head",))
    apply_quantize(model, plan_quantize(model, get_arch(model), stage), stage)
    model.to(device)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        ref = model(ids).logits.double()
        report = plan_dispatch(model, batch_sizes=batch_sizes, repeats=10)
        install_dispatch(model, report)
        got = model(ids).logits.double()
        errors = layer_errors(model, ids)
    rel = ((got - ref).norm() / ref.norm()).item()
    worst = max(errors, key=errors.get)
    rows = [{"shape": list(r.shape), "rows": r.rows, "choice": r.choice, "vs_dense": r.vs_dense,
             "times_us": r.times_us, "dense_us": r.dense_us} for r in report.rows]
    print(f"{family} d={width} {name}: worst layer rel err {errors[worst]:.1e} ({worst}); logits rel err {rel:.1e}")
    print(summary(model))
    for r in rows:
        print(f"  {r['shape']} rows={r['rows']}: {r['choice']} {r['vs_dense']:.2f}x dense")
    return {"family": family, "width": width, "scheme": name, "worst_layer": worst,
            "worst_layer_rel_err": errors[worst], "layer_rel_err": errors, "logits_rel_err": rel,
            "ok": errors[worst] < BOUND[name], "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny widths (a check of the script)")
    ap.add_argument("--out", help="output folder (default $OUT, else bench/results)")
    args = ap.parse_args(argv)
    if args.dry_run:
        device, width, batch_sizes, schemes = torch.device("cpu"), 256, (1,), list(SCHEMES)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
            return 2
        device, width, batch_sizes, schemes = torch.device("cuda", 0), 4096, (1, 16, 64, 512), list(SCHEMES)
    results = [one(f, width, s, device, batch_sizes) for f in CONFIGS for s in schemes]
    out = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    env = {"date": date.today().isoformat(), "torch": torch.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"}
    (out / "gpu_e2e.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
