"""EoRA: a low-rank repair of a layer's quantization error, fitted where the layer's inputs live.

Liu et al., "EoRA: Fine-tuning-free Compensation for Compressed LLM with Eigenspace Low-Rank Approximation"
(arXiv 2410.21271). With E = W - dequantize(Q) [out, in] and X the layer's calibration inputs [tokens, in], the
rank-r term B A minimising the output error ||(E - B A) Xᵀ||_F is the best rank-r approximation of E S, mapped back
by S⁻¹, for any S with S Sᵀ = XᵀX. The paper takes S from an eigendecomposition of XᵀX; a Cholesky factor gives the
same minimiser for a third of the work (a 11008-wide input: 0.4 s against 10 s on two cores), so we use that.

- The Hessian is damped (`damp` × its mean diagonal on the diagonal, as GPTQ does): inputs no window excited would
  otherwise make S singular, and the term would grow without bound along them.
- The top singular vectors of E S come from a full SVD where the layer is small, else from a seeded randomized
  range finder with power iterations (Halko, Martinsson and Tropp 2011): its residual within 0.2% of the optimum's
  on flat and decaying spectra (tested against the full SVD), a 4096 x 11008 layer's in two seconds.
- B = U √Σ and A = √Σ Vᵀ S⁻¹: the singular values split evenly, so neither factor is large at 16 bits.

Against the model's KL (`eora_kl_terms`, the kl_hessians stage's two sides): the error then costs
tr(E H_in Eᵀ H_out) (the Kronecker-factored Fisher), which is ||Tᵀ E S||_F² with T Tᵀ = H_out. The best rank-r term is
the top of Tᵀ E S's SVD mapped back on both sides: B = T⁻ᵀ U √Σ, A = √Σ Vᵀ S⁻¹. Each singular value squared, over
tr(H_out), is what that rank removes in one unit shared by every layer of the model (the Kronecker fit of Σ_t
(x xᵀ) ⊗ (g gᵀ) is H_in ⊗ H_out / tr(H_out)), so `allocate_ranks` can spend a parameter budget across the layers
where it removes the most.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FULL_SVD_MAX = 1 << 30  # out * in * min(out, in): a full SVD below this (a 1024² layer), the randomized one above
OVERSAMPLE, POWER_ITERS = 16, 8


def eora_terms(error: Tensor, hessian: Tensor, rank: int, damp: float = 0.01,
               seed: int = 0) -> tuple[Tensor, Tensor, float]:
    """(A [rank, in], B [out, rank], the share of the input-weighted error tr(E H Eᵀ) the term removes) for the
    quantization error `error` [out, in] and the Hessian of the layer's inputs `hessian` [in, in] (any positive
    multiple of Σ x xᵀ). float32 (float64 when `error` is: tests). `rank` above min(out, in) is capped to it."""
    dtype = torch.float64 if error.dtype == torch.float64 else torch.float32
    e = error.to(dtype)
    n_out, k = e.shape
    if hessian.shape != (k, k):
        raise ValueError(f"EoRA: the Hessian is {tuple(hessian.shape)}, the layer reads {k} inputs")
    rank = min(rank, n_out, k)
    s = damped_factor(hessian, damp, dtype)  # H = S Sᵀ, S lower triangular
    m = e @ s  # [out, in]: ||(E - L) S||_F is the output error ||(E - L) Xᵀ||_F (up to the damping)
    u, sigma, vt = _top_singular(m, rank, seed)
    total = float(m.square().sum())
    kept = float(sigma.square().sum())
    root = sigma.sqrt()
    b = u * root  # [out, r]
    c = root[:, None] * vt  # [r, in]: A S = C
    a = torch.linalg.solve_triangular(s.T, c.T, upper=True).T  # A = C S⁻¹, i.e. Sᵀ Aᵀ = Cᵀ
    return a.contiguous(), b.contiguous(), (kept / total if total > 0 else 0.0)


def damped_factor(hessian: Tensor, damp: float, dtype: torch.dtype, shrink: float = 0.0) -> Tensor:
    """The lower Cholesky factor of `hessian` with its diagonal scaled by 1 + `shrink` (toward the diagonal), then
    `damp` × its mean diagonal added (positive even where an input was never excited or an output never moved the
    loss)."""
    h = hessian.to(dtype, copy=True)
    diag = torch.diagonal(h)
    if shrink:
        diag *= 1 + shrink
    diag += damp * float(diag.mean().clamp(min=1e-12))
    return torch.linalg.cholesky(h)


@dataclass(frozen=True)
class KLWeights:
    """A layer's two KL sides as the fit weighs them, factored once: S Sᵀ = H_in and T Tᵀ = H_out (shrunk, both
    damped), and `unit` = tr(H_out) as shrunk, which puts every layer's cost in one unit."""

    s: Tensor  # [in, in] lower triangular
    t: Tensor  # [out, out] lower triangular
    unit: float


def kl_weights(h_in: Tensor, h_out: Tensor, damp: float = 0.01, output_shrink: float = 1.0) -> KLWeights:
    """The factors of the gradient-weighted input side `h_in` [in, in] and the output side `h_out` [out, out] of a
    layer's KL Hessian (the kl_hessians stage's files). `h_out` is shrunk toward its diagonal by `output_shrink`
    (GPTQConfig.output_shrink: its 16K-token estimate overfits otherwise), both sides damped by `damp`. float32
    (float64 when `h_in` is)."""
    dtype = torch.float64 if h_in.dtype == torch.float64 else torch.float32
    unit = float(torch.diagonal(h_out).sum()) * (1 + output_shrink) or 1.0
    return KLWeights(damped_factor(h_in, damp, dtype), damped_factor(h_out, damp, dtype, output_shrink), unit)


def eora_kl_terms(error: Tensor, weights: KLWeights, rank: int,
                  seed: int = 0) -> tuple[Tensor, Tensor, Tensor, float]:
    """(A [rank, in], B [out, rank], gains [rank], total) minimising tr((E - B A) H_in (E - B A)ᵀ H_out) for the
    quantization error `error` [out, in] under the layer's `weights` (kl_weights). gains[j]: the cost rank j removes,
    total: the whole error's cost, both over weights.unit (the units allocate_ranks compares across layers)."""
    s, t = weights.s, weights.t
    e = error.to(s.dtype)
    n_out, k = e.shape
    if s.shape != (k, k) or t.shape != (n_out, n_out):
        raise ValueError(f"EoRA: the KL Hessians are {tuple(t.shape)} and {tuple(s.shape)}, the layer is "
                         f"{n_out} x {k}")
    rank = min(rank, n_out, k)
    m = t.T @ e @ s  # ||Tᵀ (E - L) S||_F² is the Kronecker cost of E - L
    u, sigma, vt = _top_singular(m, rank, seed)
    total = float(m.square().sum()) / weights.unit
    root = sigma.sqrt()
    b = torch.linalg.solve_triangular(t.T, u * root, upper=True)  # Tᵀ B = U √Σ
    a = torch.linalg.solve_triangular(s.T, (root[:, None] * vt).T, upper=True).T  # A S = √Σ Vᵀ
    return a.contiguous(), b.contiguous(), sigma.square() / weights.unit, total


def kl_cost(residual: Tensor, weights: KLWeights) -> float:
    """tr(R H_in Rᵀ H_out) / unit, both sides as eora_kl_terms weighs them: what is left of a layer's error."""
    return float((weights.t.T @ residual.to(weights.s.dtype) @ weights.s).square().sum()) / weights.unit


def allocate_ranks(gains: dict[str, Tensor], costs: dict[str, int], budget: int) -> dict[str, int]:
    """Each layer's rank under a parameter `budget`: ranks are bought in decreasing gain per parameter (gains[name][j]
    the cost rank j of that layer removes, decreasing in j; costs[name] its parameters per rank, out + in) while the
    budget allows; a rank that removes nothing is left unbought. A layer's ranks are always a prefix (its gains
    decrease), and with equal costs this is the best choice of `budget // cost` ranks."""
    offers = sorted(((float(g) / costs[name], name, j) for name, gs in gains.items() for j, g in enumerate(gs)
                     if g > 0), key=lambda o: (-o[0], o[1], o[2]))
    ranks = dict.fromkeys(gains, 0)
    left = budget
    for _, name, j in offers:
        if ranks[name] == j and costs[name] <= left:
            ranks[name] += 1
            left -= costs[name]
    return ranks


def _top_singular(m: Tensor, rank: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """The `rank` largest singular triplets (U [out, r], σ [r], Vᵀ [r, in]) of m."""
    n_out, k = m.shape
    if n_out * k * min(n_out, k) <= FULL_SVD_MAX or rank + OVERSAMPLE >= min(n_out, k):
        u, sigma, vt = torch.linalg.svd(m, full_matrices=False)
        return u[:, :rank], sigma[:rank], vt[:rank]
    gen = torch.Generator(device=m.device).manual_seed(seed)
    omega = torch.randn(k, rank + OVERSAMPLE, generator=gen, device=m.device, dtype=m.dtype)
    q = torch.linalg.qr(m @ omega).Q  # [out, r + p]: an orthonormal basis of m's dominant range
    for _ in range(POWER_ITERS):  # each pass sharpens the basis toward the top singular vectors
        q = torch.linalg.qr(m.T @ q).Q
        q = torch.linalg.qr(m @ q).Q
    u_small, sigma, vt = torch.linalg.svd(q.T @ m, full_matrices=False)
    return (q @ u_small)[:, :rank], sigma[:rank], vt[:rank]
