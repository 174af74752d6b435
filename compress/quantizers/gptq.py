"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize columns one at a time and push each
column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's reconstruction loss ||W X - W' X||^2 (H = 2 X X^T / n).

Lazy batch updates: columns are processed in blocks of `block_size`; inside a block the update is
applied column by column, and the accumulated block error is propagated to the rest at once.
Groups: without act_order, a group's scale/zero point are computed when its first column is
reached, from the weights as updated so far (as in the reference implementation). With act_order,
columns are visited in order of decreasing Hessian diagonal but the group parameters are fixed
up front from the original weights ("static groups"), so the stored layout stays the standard
contiguous-group format and loaders need no g_idx permutation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.primitives import FP8_DTYPES, cast_float, compute_qparams, global_scale, group_view, shrink_range
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme, replace_granularity
from .gptq_loop import compiled_integer_block


@dataclass(frozen=True)
class GPTQConfig:
    dampening: float = 0.01  # fraction of the mean Hessian diagonal added to the diagonal
    block_size: int = 128  # columns per lazy-update block
    # visit columns by decreasing Hessian diagonal (static groups: the standard layout, no g_idx). On by default:
    # chosen on WikiText-2 validation (bench/validation_defaults.py), GPTQ int4 g64 KL 0.228 -> 0.143 and
    # AWQ+GPTQ 0.104 -> 0.097 on SmolLM2-135M; without it GPTQ did worse than round-to-nearest on some layers
    act_order: bool = True
    # the inverse-Hessian factor as J chol(J H J)^-1 J: half the factorisation work (a 7B down_proj: ~7 s instead of
    # ~14.5 s on one CPU thread), not bit for bit. On by default: on the embedded model (recipes/gptq_int4.yaml)
    # KL is 0.1378 with it, 0.1355 with the textbook float32 factor and 0.1371 with the textbook factor computed in
    # float64 (the most exact of the three): the spread is the factor's rounding, not a loss (false: the textbook
    # factor, the solves before issue 49 but for gptq_loop.py's fused update on fixed integer grids)
    fast_factor: bool = True
    # a folder of each layer's two sides of the whole model's KL Hessian (the kl_hessians stage writes it; one
    # `<layer>.safetensors` per layer; quantizers/gptq_kron.py). Empty: plain GPTQ, the layer's own output error
    output_hessians: str = ""
    # which sides of the KL Hessian the rounding uses (output_hessians only): "input", the input Hessian with each
    # token weighted by the loss's gradient at the layer's output, |g|²; "output", the layer's own input Hessian and
    # the output side Σ g gᵀ, which carries each block of rows' error to the rows not yet quantized; "both"
    kl_sides: str = "both"
    row_block: int = 32  # rows quantized together between two output-side error feedbacks
    # the output side's dampening, as a share of its mean diagonal: more than the input side's, because at 2 bits the
    # full feedback pushes more error onto later rows than their grid can absorb (on random correlated problems,
    # int2: 0.01 -> 1.1-1.7x GPTQ's Kronecker cost, 0.1 -> 0.7-0.8x, 0.3 -> 0.64-0.66x)
    output_dampening: float = 0.1
    # the output side's off-diagonal shrunk toward its diagonal, H + shrink · diag(H): its estimate from a few
    # thousand sampled labels is noisy, and the feedback fits the noise (SmolLM2 block 5, int3, held-out Fisher cost
    # against GPTQ's: v_proj 1.05x unshrunk, 0.89x with 1; up_proj 0.99x -> 0.87x)
    output_shrink: float = 1.0

    def __post_init__(self):
        if not 0 <= self.dampening < 1:
            raise ValueError(f"dampening must be in [0, 1), got {self.dampening} (typical: 0.01)")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size} (typical: 128)")
        if self.kl_sides not in ("input", "output", "both"):
            raise ValueError(f"kl_sides must be input, output or both, got {self.kl_sides!r}")
        if self.output_shrink < 0:
            raise ValueError(f"output_shrink must be >= 0, got {self.output_shrink} (typical: 1)")
        if not 0 <= self.output_dampening < 10:
            raise ValueError(f"output_dampening must be in [0, 10), got {self.output_dampening} (typical: 0.1)")
        if self.row_block < 1:
            raise ValueError(f"row_block must be >= 1, got {self.row_block} (typical: 32)")


class SingularHessianError(ValueError):
    pass


def gptq_problem(scheme: QuantScheme) -> str | None:
    """Why GPTQ cannot produce `scheme` (None: it can)."""
    if scheme.granularity == "block":
        return ("GPTQ quantizes column by column and cannot keep 128x128 block scales; use granularity: channel or "
                "tensor, or method: rtn")
    if scheme.zero_point_dtype != "uint8":
        return "GPTQ rounds onto an integer grid; fractional zero points (zero_point_dtype: float16) are HQQ's"
    return None


def quantize_gptq_layer(w: Tensor, scheme: QuantScheme, options: GPTQConfig, inputs) -> QuantizedTensor:
    """The registry's signature: the Hessian comes from the layer's calibration inputs (layer_factor)."""
    return quantize_gptq(w, layer_factor(w, options, inputs), scheme, options, name=inputs.name, clip=inputs.clip)


def layer_factor(w: Tensor, options: GPTQConfig, inputs) -> "HessianFactor":
    """The factor of the layer's input Hessian from its calibration inputs (a fresh tensor each call, so the solve
    may overwrite it). Where the caller gives a `shared` slot (the quantize stage, across one block's layers), layers
    that read one input (q/k/v, gate/up: one InputStats, the same divisor) and have the same dampening and act_order
    reuse one factor instead of each factoring its own copy of H."""
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    if inputs.shared is None:
        return hessian_factor(inputs.hessian("GPTQ"), options, dtype, name=inputs.name, overwrite=True)
    return _shared_factor(inputs.shared, options, dtype, inputs)


def _shared_factor(slot: dict, options: GPTQConfig, dtype: torch.dtype, inputs) -> "HessianFactor":
    """The factor in `slot` when it was made from the same statistics, divisor and options, else a new one, which
    replaces it there. The slot holds one factor at a time (the old one is let go before the next is made), so a
    block's solve memory stays that of one layer's (the memory plan's "GPTQ solve")."""
    key = (inputs.stats, inputs.divisor, _factor_options(options), dtype)
    held = slot.pop("gptq", None)
    if held is not None and _same_source(held[0], key):
        slot["gptq"] = held
        return held[1]
    del held  # the old factor is let go before the next one is made
    factor = hessian_factor(inputs.hessian("GPTQ"), options, dtype, name=inputs.name, overwrite=True)
    slot["gptq"] = (key, factor)
    return factor


def _same_source(a: tuple, b: tuple) -> bool:
    """The same InputStats object, equal divisors (or none), the same factor options and dtype."""
    (stats_a, div_a, *opts_a), (stats_b, div_b, *opts_b) = a, b
    same_divisor = div_a is div_b or (div_a is not None and div_b is not None and torch.equal(div_a, div_b))
    return stats_a is stats_b and same_divisor and opts_a == opts_b


@dataclass(frozen=True)
class HessianFactor:
    """What GPTQ's solve takes from the Hessian alone (hessian_factor), for any number of layers that share it:
    the inputs that never fire (`dead`: their weight columns are zeroed per layer), the act_order column order
    (`perm`, None without act_order) and the upper Cholesky factor of the dampened, permuted H^-1 (`u` [K, K])."""

    u: Tensor
    dead: Tensor
    perm: Tensor | None
    options: tuple  # _factor_options of the GPTQConfig it was made with

    def check(self, cfg: GPTQConfig, dtype: torch.dtype, k: int, name: str) -> None:
        if self.options != _factor_options(cfg) or self.u.dtype != dtype or self.u.shape[0] != k:
            raise ValueError(f"{name}: the Hessian factor was made with (dampening, act_order, fast_factor) = "
                             f"{self.options}, {self.u.dtype}, {self.u.shape[0]} inputs; this layer has "
                             f"{_factor_options(cfg)}, {dtype}, {k} inputs. Make the factor with this layer's "
                             "options (hessian_factor) or pass the Hessian itself.")


def _factor_options(cfg: GPTQConfig) -> tuple:
    """The options a factor depends on (not block_size)."""
    return cfg.dampening, cfg.act_order, cfg.fast_factor


def hessian_factor(hessian: Tensor, cfg: GPTQConfig = GPTQConfig(), dtype: torch.dtype = torch.float32,
                   name: str = "layer", overwrite: bool = False) -> HessianFactor:
    """The layer-independent part of the GPTQ solve: dead inputs, dampening, act_order permutation and the
    inverse-Hessian factor, in `dtype`. Memory: one [K, K] matrix (none beyond `hessian` with `overwrite`, which
    lets it work in the caller's Hessian)."""
    H = hessian.detach()
    if not (overwrite and H.dtype == dtype and H.is_contiguous()):
        H = H.to(dtype, copy=True).contiguous()  # [K, K]
    dead = torch.diag(H) == 0  # inputs that never fire: their weights cannot matter
    H[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else None
    if perm is not None:
        _permute_columns_(H, perm)
        _permute_rows_(H, perm)
    u = _inverse_hessian_factor(H, cfg.dampening, name, fast=cfg.fast_factor)
    return HessianFactor(u, dead, perm, _factor_options(cfg))


def _inverse_hessian_factor(h: Tensor, dampening: float, name: str, fast: bool = False) -> Tensor:
    """Upper Cholesky factor U of H^-1 (U^T U = H^-1) after dampening (the GPTQ 'Hinv' rows), computed in `h`'s own
    buffer: no second [K, K] matrix (for a 7B model's down_proj, K = 11008, each is 485 MB); the factor returned
    is a view of it. LAPACK works in place on a column-major matrix, and H is symmetric, so its transpose view is
    that matrix.

    Textbook (default): Cholesky, cholesky_inverse, Cholesky. `fast` (GPTQConfig.fast_factor): U = J L^-1 J, where
    J reverses the index order and L is the lower Cholesky factor of J H J: one Cholesky and one triangular
    inverse, half the work (one CPU thread, K = 4096: 0.50 s against 1.05 s; K = 11008: ~7 s against ~14.5 s).
    Its temporaries: a copy of a [K/2, K/2] diagonal block (solve_triangular copies a strided matrix) and
    [K/2, 1024] pieces, a quarter of H at most, less than the [N, K] weight the solve makes after the factor (the
    memory plan's "GPTQ solve"). Not bit for bit the textbook form. Measured in float32 against the float64
    textbook factor, largest error / largest entry: K = 256, 6-8e-6 (textbook 5-7e-6); K = 1024, 6-8e-5
    (4-6e-5); K = 4096, 8e-5 (6e-5); the embedded model's down_proj (K = 1536, real Hessians) 1.3-4.0e-5
    (0.35-3.2e-5). Codes: 0-0.35 % of the packed int4 bytes differ from the textbook factor's on random problems,
    0-0.05 % of the codes on the embedded model's down_proj; its GPTQ int4 KL 0.1355 -> 0.1378 (recipes/
    gptq_int4.yaml; tests/test_gptq_fast.py bounds both factors against float64)."""
    damp = dampening * torch.mean(torch.diag(h))
    h.diagonal().add_(damp)  # = h + damp * I, without the identity matrix
    if fast:
        _rotate_half_turn_(h)  # J H J
    ht = h.T
    info = torch.empty((), dtype=torch.int32, device=h.device)  # an out= tensor lives where the matrix does
    torch.linalg.cholesky_ex(ht, out=(ht, info))
    if int(info) != 0:
        raise SingularHessianError(
            f"{name}: the Hessian is not positive definite even after dampening {dampening:g} of its mean "
            f"diagonal. Raise the stage's `options.dampening` (e.g. 0.1), give more calibration samples, or check the "
            "calibration inputs for NaN/inf.")
    if not fast:
        torch.cholesky_inverse(ht, out=ht)  # H^-1
        return torch.linalg.cholesky(ht, upper=True, out=ht)
    _invert_lower_(ht)  # L^-1
    _rotate_half_turn_(h)  # J L^-1 J, in the transpose view
    return ht


def _invert_lower_(t: Tensor, leaf: int = 128, chunk: int = 1024) -> None:
    """A lower triangular matrix replaced by its inverse, in place: [[A, 0], [C, D]]^-1 = [[A^-1, 0],
    [-D^-1 C A^-1, D^-1]], C first (by triangular solves with A and D, `chunk` columns or rows at a time: the
    temporaries are [K/2, chunk] and the copies solve_triangular may make of a strided D), then A and D in turn."""
    n = t.shape[0]
    if n <= leaf:
        t.copy_(torch.linalg.solve_triangular(t, torch.eye(n, dtype=t.dtype, device=t.device), upper=False))
        return
    n1 = n // 2 if n <= 2 * leaf else (n // 2 + leaf - 1) // leaf * leaf
    a, c, d = t[:n1, :n1], t[n1:, :n1], t[n1:, n1:]
    for c0 in range(0, n1, chunk):
        c[:, c0:c0 + chunk] = torch.linalg.solve_triangular(d, c[:, c0:c0 + chunk], upper=False)
    for r0 in range(0, n - n1, chunk):
        c[r0:r0 + chunk] = torch.linalg.solve_triangular(a, c[r0:r0 + chunk], upper=False, left=False).neg_()
    _invert_lower_(a, leaf, chunk)
    _invert_lower_(d, leaf, chunk)


def _rotate_half_turn_(t: Tensor, rows: int = 256) -> None:
    """t[i, j] = t[K-1-i, K-1-j] (J t J) in place, `rows` rows at a time."""
    k = t.shape[0]
    for r in range(0, k // 2, rows):
        r2 = min(r + rows, k // 2)
        top = t[r:r2].clone()
        t[r:r2] = t[k - r2:k - r].flip(0, 1)
        t[k - r2:k - r] = top.flip(0, 1)
    if k % 2:
        t[k // 2] = t[k // 2].flip(0)


def _permute_columns_(t: Tensor, perm: Tensor, rows: int = 256) -> None:
    """t[:, :] = t[:, perm] in place, a few rows at a time (a copy of `rows` rows, not of t)."""
    for r in range(0, t.shape[0], rows):
        t[r:r + rows] = t[r:r + rows, perm]


def _permute_rows_(t: Tensor, perm: Tensor) -> None:
    """t[:] = t[perm] in place, following the permutation's cycles (one row of extra memory)."""
    order = perm.tolist()
    done = bytearray(len(order))
    for first in range(len(order)):
        if done[first]:
            continue
        done[first] = 1
        if order[first] == first:
            continue
        saved, j = t[first].clone(), first
        while order[j] != first:
            t[j] = t[order[j]]
            j = order[j]
            done[j] = 1
        t[j] = saved


def _column_qparams(w_cols: Tensor, scheme: QuantScheme, gscale: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-row scale/zero point [N] of a slice [N, G] (one group); microscaling block scales with the weight's
    global scale (NVFP4)."""
    if scheme.is_micro:
        return compute_qparams(w_cols, scheme, gscale)[0][:, 0], None
    scale, zero = compute_qparams(w_cols, replace_granularity(scheme, "channel"))
    return scale[:, 0], None if zero is None else zero[:, 0]


def quantize_gptq(w: Tensor, hessian: Tensor | HessianFactor, scheme: QuantScheme, cfg: GPTQConfig = GPTQConfig(),
                  name: str = "layer", overwrite_hessian: bool = False, clip: Tensor | None = None,
                  gscale: Tensor | None = None) -> QuantizedTensor:
    """GPTQ-quantize a [out, in] weight given the Hessian [in, in] of its inputs, or its factor (hessian_factor,
    made with the same dampening and act_order: layers that read one input share it).

    `clip` [rows, groups] (AWQ's clipping search, handed over with clip_to: grid): each group's grid is that of its
    range shrunk by the factor (primitives.shrink_range), while the weights stay unclamped: a weight beyond the grid
    rounds to its end, and GPTQ carries that error, like any rounding error, to the columns not yet quantized
    (clamping the weights first would make the clipped values GPTQ's target, an error it can never repair).

    Computes in float64 when `w` is float64 (tests), float32 otherwise. Memory beyond the inputs: one [K, K] matrix
    (none with `overwrite_hessian`, which lets the solve work in the caller's Hessian, nor with a factor) and one
    [N, K] matrix, which holds the weights being updated and, column by column, the codes that replace them.
    `gscale`: NVFP4's global scale when `w` is a slice of rows of the tensor it belongs to (default: `w`'s own).
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    n_rows, k = w.shape
    group_view(w.detach(), scheme)  # raises if the group size does not divide in_features
    if scheme.granularity == "block":
        raise ValueError(f"{name}: GPTQ quantizes column by column; 128x128 blocks are not supported, use "
                         "granularity: channel (or method: rtn)")
    factor = hessian if isinstance(hessian, HessianFactor) else \
        hessian_factor(hessian, cfg, dtype, name, overwrite=overwrite_hessian)  # before W: its temporaries
    del hessian
    factor.check(cfg, dtype, k, name)
    W = w.detach().to(dtype, copy=True).contiguous()  # [N, K]
    W[:, factor.dead] = 0.0

    g = scheme.group_size if scheme.granularity == "group" else None
    static = scheme.granularity != "group" or cfg.act_order
    if gscale is None:
        gscale = global_scale(W, scheme)  # NVFP4: one per tensor, from the original weights
    if static:  # parameters from the original weights, in the original column order
        scale_full, zero_full = compute_qparams(W if clip is None else shrink_range(W, clip, scheme), scheme, gscale)
        scale_tab = _table(scale_full, scheme, n_rows).to(dtype)  # [N or 1, groups]: one column per group
        zero_tab = None if zero_full is None else _table(zero_full, scheme, n_rows).to(dtype)
        group_of = torch.arange(k) // g if g else torch.zeros(k, dtype=torch.long)  # weight column -> table column

    perm = factor.perm
    if perm is not None:
        _permute_columns_(W, perm)
        group_of = group_of[perm.cpu()]
    h_inv = factor.u
    del factor
    if static:
        _static_columns(W, h_inv, scheme, cfg.block_size, scale_tab, zero_tab, group_of.to(W.device))
        scale, zero = scale_full, zero_full
    else:
        scale, zero = _dynamic_columns(W, h_inv, scheme, cfg.block_size, g, clip, gscale)
    del h_inv  # the [K, K] buffer is free before the codes are packed (unless a caller shares it)
    codes = W  # integer codes (or float8 values) held in the working dtype, exactly
    if perm is not None:
        _permute_columns_(codes, torch.argsort(perm))
    if scheme.dtype == "fp4_e2m1":
        return QuantizedTensor.from_codes(codes.float(), scale.float(), None, scheme, gscale)
    if scheme.is_float:
        return QuantizedTensor.from_codes(codes.to(FP8_DTYPES[scheme.dtype]), scale.float(), None, scheme, gscale)
    return QuantizedTensor.from_codes(codes, scale.float(), None if zero is None else zero.float(), scheme)


# The column loop. Each lazy-update block of columns is worked on transposed (Wt [B, N]: a column is a contiguous
# row), and each column's error is written straight into its row of the block's error matrix. Every element goes
# through the same float operations, in the same order, as the plain form (W[:, j:i2] -= err[:, None] *
# h_inv[j, j:i2]; the lazy update err_block @ h_inv[i1:i2, i2:] on the same [N, B] layout), so the codes and scales
# are bit for bit those of that form (tests/test_gptq_fast.py checks against it, tests/reference/gptq_plain.py),
# except on fixed integer grids (act_order, channel, tensor), whose block loop is gptq_loop.py's compiled one with
# the in-block update fused (one rounding instead of two; tests/test_gptq_loop.py bounds the difference).

def _update_buffer(W: Tensor, block_size: int) -> Tensor:
    """Room for the largest lazy update, [N, K - block_size], allocated once: a fresh product per block costs
    page faults on every block (a third of the update's time on one CPU thread), and the first one is this big."""
    return torch.empty(W.shape[0] * max(W.shape[1] - block_size, 0), dtype=W.dtype, device=W.device)


def _lazy_update(W: Tensor, et: Tensor, h_inv: Tensor, i1: int, i2: int, buf: Tensor) -> None:
    """W[:, i2:] -= err_block @ h_inv[i1:i2, i2:], the block's errors [N, B] carried to the remaining columns."""
    m = W.shape[1] - i2
    if m == 0:
        return
    out = buf[:W.shape[0] * m].view(W.shape[0], m)
    torch.matmul(et.T.contiguous(), h_inv[i1:i2, i2:], out=out)
    W[:, i2:] -= out


def _quantize_column(col: Tensor, s: Tensor, z: Tensor | None, scheme: QuantScheme, err: Tensor, d: Tensor) -> Tensor:
    """The code of one column (on its grid s, z) and, into `err`, (col - dequantized) / d."""
    if scheme.is_float:  # fp8 / fp4: the nearest value of the float grid (saturating), not an integer
        q = cast_float(col / s, scheme.dtype).to(col.dtype)
        deq = q * s
    else:
        q = torch.round(col / s)
        if z is not None:
            q += z
        q.clamp_(scheme.qmin, scheme.qmax)
        deq = (q - z) * s if z is not None else q * s
    torch.sub(col, deq, out=err)
    err.div_(d)
    return q


def _static_columns(W: Tensor, h_inv: Tensor, scheme: QuantScheme, block_size: int, scale_tab: Tensor,
                    zero_tab: Tensor | None, group_of: Tensor) -> None:
    """GPTQ's column loop on grids fixed up front (act_order, channel, tensor): W's columns become their codes."""
    n_rows, k = W.shape
    buf = _update_buffer(W, block_size)
    loop = None if scheme.is_float else compiled_integer_block()
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        wt = W[:, i1:i2].T.contiguous()  # [B, N]
        et = torch.empty_like(wt)  # the block's errors, one row per column
        cols = group_of[i1:i2]
        s_t = scale_tab[:, cols].T.contiguous()  # [B, N or 1]: each column's grid
        z_t = None if zero_tab is None else zero_tab[:, cols].T.contiguous()
        hb = h_inv[i1:i2, i1:i2]
        if loop is not None:  # the loop below compiled, its in-block update fused (gptq_loop.py)
            loop(wt, et, s_t, z_t, hb, float(scheme.qmin), float(scheme.qmax))
        else:
            for jj in range(i2 - i1):
                q = _quantize_column(wt[jj], s_t[jj], None if z_t is None else z_t[jj], scheme, et[jj], hb[jj, jj])
                if jj + 1 < i2 - i1:
                    wt[jj + 1:] -= hb[jj, jj + 1:, None] * et[jj]
                wt[jj] = q  # column j is final: its slot now holds the code
        W[:, i1:i2] = wt.T
        _lazy_update(W, et, h_inv, i1, i2, buf)


def _dynamic_columns(W: Tensor, h_inv: Tensor, scheme: QuantScheme, block_size: int, g: int, clip: Tensor | None,
                     gscale: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """GPTQ's column loop with each group's grid taken when its first column is reached, from the weights as
    updated so far (groups without act_order). Returns the groups' scale and zero point [N, groups]."""
    n_rows, k = W.shape
    dtype = W.dtype
    scale_g = torch.zeros(n_rows, k // g, dtype=dtype, device=W.device)
    zero_g = None if scheme.symmetric else torch.zeros_like(scale_g)
    buf = _update_buffer(W, block_size)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        wt = W[:, i1:i2].T.contiguous()  # [B, N]
        et = torch.empty_like(wt)
        hb = h_inv[i1:i2, i1:i2]
        for jj in range(i2 - i1):
            j = i1 + jj
            t = j // g
            if j % g == 0:  # first column of a group: parameters from the weights as updated so far
                cols = wt[jj:jj + g].T if j + g <= i2 else torch.cat([wt[jj:].T, W[:, i2:j + g]], dim=1)
                if clip is not None:
                    cols = shrink_range(cols, clip[:, t], replace_granularity(scheme, "channel")).to(dtype)
                s_new, z_new = _column_qparams(cols, scheme, gscale)
                scale_g[:, t] = s_new
                if zero_g is not None:
                    zero_g[:, t] = z_new
            q = _quantize_column(wt[jj], scale_g[:, t], None if zero_g is None else zero_g[:, t], scheme, et[jj],
                                 hb[jj, jj])
            if jj + 1 < i2 - i1:
                wt[jj + 1:] -= hb[jj, jj + 1:, None] * et[jj]
            wt[jj] = q
        W[:, i1:i2] = wt.T
        _lazy_update(W, et, h_inv, i1, i2, buf)
    return scale_g, zero_g


def _table(p: Tensor, scheme: QuantScheme, n_rows: int) -> Tensor:
    """Per-group (or per-channel / per-tensor) parameters as a table with one column per group, in float32 (the
    precision the stored scales keep)."""
    if scheme.granularity == "tensor":
        return p.reshape(1, 1).float()
    if scheme.granularity == "channel":
        return p.reshape(n_rows, 1).float()
    return p.float()
