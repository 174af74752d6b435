"""Per-layer costs of GPTQ's roundings against the model's KL, on one block of the embedded model (issue 50).

Each rounding of a block's layers is scored by the sampled Fisher's exact per-token cost, Σ_t (g_tᵀ ΔW x_t)², on
held-out calibration windows (g: the gradient of the sampled log-likelihood at the layer's output, x: its input; the
quadratic term of the KL with no Kronecker approximation), relative to plain GPTQ's. The roundings use what the
kl_hessians stage computes, from other windows: the plain input Hessian, the loss-weighted one Σ |g|² x xᵀ, and the
output side Σ g gᵀ (unshrunk, and shrunk toward its diagonal as GPTQConfig.output_shrink does).

    python bench/kl_layer_costs.py 20 int3        # block 20, int3 g64 (int2: g32)
    python bench/kl_layer_costs.py 20 int3 --row-blocks   # both sides at row_block 8 ... the whole layer
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compress.calibrate.data import calibration_windows  # noqa: E402
from compress.core.scheme import scheme  # noqa: E402
from compress.model.load import load_model  # noqa: E402
from compress.precision.mixed import sample_labels  # noqa: E402
from compress.quantizers.gptq import GPTQConfig, quantize_gptq  # noqa: E402
from compress.quantizers.gptq_kron import quantize_gptq_kron  # noqa: E402
from compress.recipe import load_recipe  # noqa: E402

LAYERS = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def collect(model, names, windows, seed: int, keep: bool) -> dict:
    """Whole-model forward and backward per window with sampled labels; per layer the input Hessian, the loss-weighted
    one and the output side, and with `keep` every token's x and g."""
    gen = torch.Generator().manual_seed(seed)
    st = {n: {"hin": 0, "hw": 0, "ho": 0, "x": [], "g": []} for n in names}
    cur = {}

    def forward_hook(n):
        def f(_m, a, o):
            cur[n] = a[0].detach().reshape(-1, a[0].shape[-1]).double()
            o.register_hook(lambda g, n=n: grad(n, g))
        return f

    def grad(n, g):
        g, x, s = g.detach().reshape(-1, g.shape[-1]).double(), cur[n], st[n]
        s["hin"] = s["hin"] + x.T @ x
        s["hw"] = s["hw"] + (x * (g * g).sum(1, keepdim=True)).T @ x
        s["ho"] = s["ho"] + g.T @ g
        if keep:
            s["x"].append(x.float())
            s["g"].append(g.float())

    handles = [model.get_submodule(n).register_forward_hook(forward_hook(n)) for n in names]
    model.requires_grad_(False)
    for w in windows:
        e = model.get_input_embeddings()(w[None]).detach().requires_grad_()
        logits = model(inputs_embeds=e).logits[0]
        torch.nn.functional.cross_entropy(logits, sample_labels(logits, gen), reduction="sum").backward()
    for h in handles:
        h.remove()
    return st


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    block = int(args[0]) if args else 20
    bits = args[1] if len(args) > 1 else "int3"
    row_blocks = "--row-blocks" in sys.argv
    torch.set_num_threads(2)
    lm = load_model("default")
    model = lm.model.float().eval()
    rec = load_recipe("recipes/gptq_int4.yaml")
    win = calibration_windows(rec.calibration.source(), lm.tokenizer, model, 128, 512, 0)
    names = [f"model.layers.{block}.{n}" for n in LAYERS]
    t0 = time.time()
    fit = collect(model, names, win[:32], 0, False)  # what the roundings use
    held = collect(model, names, win[96:112], 2, True)  # what scores them
    print(f"collected in {time.time() - t0:.0f} s", flush=True)
    sch = scheme(bits, "group", 32 if bits == "int2" else 64, False)

    def cost(w, q, n) -> float:
        d = (w - q).float()
        return sum(float((((x @ d.T) * g).sum(1) ** 2).sum()) for x, g in zip(held[n]["x"], held[n]["g"]))

    for n in names:
        w = model.get_submodule(n).weight.detach().float()
        hin, hw, ho = (fit[n][k].float() for k in ("hin", "hw", "ho"))
        base = cost(w, quantize_gptq(w, hin, sch, GPTQConfig()).dequantize(), n)
        row = [n.split(".", 3)[-1], f"GPTQ cost {base:.3g}",
               f"weighted input side {cost(w, quantize_gptq(w, hw, sch, GPTQConfig()).dequantize(), n) / base:.3f}"]
        if row_blocks:
            for rb in (8, 32, 128, 512, w.shape[0]):
                t = time.perf_counter()
                q = quantize_gptq_kron(w, hw, ho, sch, GPTQConfig(row_block=rb)).dequantize()
                row.append(f"row_block {rb}: {cost(w, q, n) / base:.3f} ({time.perf_counter() - t:.1f} s)")
            print(" | ".join(row), flush=True)
            continue
        for shrink in (0.0, 1.0):
            for label, h in (("own input", hin), ("weighted input", hw)):
                q = quantize_gptq_kron(w, h, ho, sch, GPTQConfig(output_shrink=shrink)).dequantize()
                row.append(f"output side (shrink {shrink:g}) + {label} {cost(w, q, n) / base:.3f}")
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
