"""HQQ written out group by group, in the inverse-scale form of the HQQ paper and its reference solver
(W_q = round(W * s_inv + z), W_r = (W_q - z) / s_inv), with plain Python loops over groups. Independent of
compress.quantizers.hqq except for the stopping rule, which is ours (keep the best zero point).

Returns the dequantized weight [out, in] and the zero points [out, n_groups] (float64)."""
from __future__ import annotations

import torch


def naive_hqq(w: torch.Tensor, bits: int, group: int, p: float = 0.7, beta0: float = 10.0, kappa: float = 1.01,
              iters: int = 20, scale_dtype=torch.float16, round_zero: bool = False):
    w = w.double()
    n, k = w.shape
    qmax = 2 ** bits - 1
    groups = [(r, c) for r in range(n) for c in range(0, k, group)]
    s, z = {}, {}
    for r, c in groups:
        g = w[r, c:c + group]
        sc = float(((g.max() - g.min()) / qmax).to(scale_dtype))
        sc = sc if sc > 0 else 1.0
        s[r, c], z[r, c] = sc, -float(g.min()) / sc

    def deq(zeros):
        out, codes = torch.zeros_like(w), torch.zeros_like(w)
        for r, c in groups:
            g = w[r, c:c + group]
            q = torch.clamp(torch.round(g * (1.0 / s[r, c]) + zeros[r, c]), 0, qmax)
            codes[r, c:c + group] = q
            out[r, c:c + group] = (q - zeros[r, c]) * s[r, c]
        return codes, out

    beta, best, best_z = beta0, float("inf"), dict(z)
    for _ in range(iters):
        codes, w_hat = deq(z)
        err = float((w - w_hat).abs().mean())
        if err >= best:
            break
        best, best_z = err, dict(z)
        e = w - w_hat
        e = torch.sign(e) * torch.relu(e.abs() - (1.0 / beta) * e.abs().clamp(min=1e-8) ** (p - 1))
        for r, c in groups:
            z[r, c] = float((codes[r, c:c + group] - (w[r, c:c + group] - e[r, c:c + group]) / s[r, c]).mean())
        beta *= kappa
    final = {key: (round(v) if round_zero else float(torch.tensor(v).half())) for key, v in best_z.items()}
    if round_zero:
        final = {key: min(max(v, 0), qmax) for key, v in final.items()}
    _, w_hat = deq(final)
    zeros = torch.tensor([[final[r, c] for c in range(0, k, group)] for r in range(n)], dtype=torch.float64)
    return w_hat, zeros
