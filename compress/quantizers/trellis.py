"""Trellis codes chosen against the layer's output error: incoherence, then BlockLDLQ with a Viterbi tile quantizer
(QTIP, Tseng et al. 2024, arXiv:2406.11235; the format is core/trellis.py).

For a layer W [m, n] with input Hessian H:
1. Incoherence: W̃ = Q_outᵀ W Q_in and H̃ = Q_inᵀ H Q_in, with Q randomised Hadamard transforms (signs drawn from
   the options' seed and the layer's name), so that W̃'s entries look Gaussian and no column of H̃ dominates.
2. One float16 scale per row: the row's RMS, so a row's entries are near unit variance, the codebook's.
3. BlockLDLQ: GPTQ's loop over blocks of `tile` columns. Each block's tiles are the walks Viterbi finds nearest
   (kernels/trellis.c), and the block's error E is pushed onto the columns not yet coded: W̃[:, rest] -= E U_bb⁻¹
   U_b,rest, with U the upper Cholesky factor of H̃⁻¹ (for one-column blocks this is GPTQ's update, tested).
4. Each row's scale refitted to its codes (least squares against H̃; `refit_scales`).
With a kl_hessians stage before (`output_hessians`), H is the loss-weighted input side of the layer's KL Hessian, and
the rows are coded one tile row at a time, each tile row's error carried to the rows still to come through the
rotated output side Q_outᵀ H_out Q_out (gptq_kron's row feedback).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.scheme import QuantScheme
from ..core.hadamard import rotated
from ..core.trellis import TrellisFormat, TrellisTensor, codebook, pack_tiles, to_tiles, trellis_scheme, walk_states


@dataclass(frozen=True)
class TrellisOptions:
    """state_bits: L, the trellis's memory (12: ~0.6 ms per 256 weights on one CPU core; each +2 is 4x the encoding
    time, and 16 leaves 10-14% less error than 12; at most 16). refit_scales: each row's scale refitted to its codes. tile: the side of a tile (T = tile² weights per walk; the layer's
    dimensions must be multiples of it). damp: added to H's diagonal, as a fraction of its mean (GPTQ's). seed:
    the Hadamard signs' seed (each layer's also depends on its name)."""

    state_bits: int = 12
    tile: int = 16
    damp: float = 0.01
    seed: int = 0
    refit_scales: bool = True
    # against the whole model's KL (a `kl_hessians` stage before the quantize stage writes this folder, as for GPTQ):
    # the LDLQ column loop takes the loss-weighted input side, and each block of `tile` rows' error is carried to the
    # rows not yet coded through the output side (GPTQ's row feedback, quantizers/gptq_kron.py); kl_sides, the output
    # side's dampening and shrinkage as GPTQConfig's
    output_hessians: str = ""
    kl_sides: str = "both"
    output_dampening: float = 0.1
    output_shrink: float = 1.0

    def __post_init__(self):
        if self.kl_sides not in ("input", "output", "both"):
            raise ValueError(f"kl_sides must be input, output or both, got {self.kl_sides!r}")
        if self.output_shrink < 0 or not 0 <= self.damp < 1 or self.output_dampening < 0:
            raise ValueError("trellis: damp must be in [0, 1), output_dampening and output_shrink >= 0")


def trellis_problem(scheme: QuantScheme) -> str | None:
    if scheme.act is not None:
        return "trellis codes are weight-only; remove the scheme's act"
    if scheme.dtype not in ("int2", "int3", "int4"):
        return f"trellis codes spend 2, 3 or 4 bits per weight; set the scheme's dtype to int2, int3 or int4 " \
               f"(got {scheme.dtype})"
    if scheme.granularity != "channel" or not scheme.symmetric:
        return "trellis codes keep one scale per row: set granularity: channel (no group_size) and symmetric: true"
    return None


def trellis_format(scheme: QuantScheme, options: TrellisOptions) -> TrellisFormat:
    """The stored format of a layer of `scheme` coded with `options`."""
    return TrellisFormat(bits=scheme.bits, state_bits=options.state_bits, tile=options.tile)


def layer_signs(name: str, seed: int, m: int, n: int) -> tuple[Tensor, Tensor]:
    """(signs_in [n], signs_out [m]) int8 ±1 for layer `name`."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    draw = lambda k: (torch.randint(0, 2, (k,), generator=g) * 2 - 1).to(torch.int8)  # noqa: E731
    return draw(n), draw(m)


def damped_inverse_factor(h: Tensor, damp: float, name: str = "layer") -> Tensor:
    """U, upper triangular, with Uᵀ U = (H + damp·mean(diag H)·I)⁻¹ (GPTQ's factor, float64, textbook form); dead
    inputs (zero diagonal) count as 1."""
    from .gptq import _inverse_hessian_factor

    h = h.double().clone()
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    return _inverse_hessian_factor(h, damp, name)


def feedback_maps(u: Tensor, block: int) -> list[Tensor]:
    """For each block of `block` columns, U_bb⁻¹ U_b,rest: what its error times, pushed onto the later columns."""
    u = u.double()
    n = u.shape[0]
    return [torch.linalg.solve_triangular(u[j:j + block, j:j + block], u[j:j + block, j + block:], upper=True)
            for j in range(0, n, block)]


def block_ldlq(w: Tensor, u: Tensor, block: int, quantize_block, maps: list[Tensor] | None = None) -> Tensor:
    """BlockLDLQ: the columns of w [m, n] coded `block` at a time by quantize_block(x [m, block], j) -> q, each block's
    error pushed onto the later columns through u (damped_inverse_factor; `maps`: its feedback_maps, when several row
    blocks share them). Returns the coded weight [m, n]."""
    maps = feedback_maps(u, block) if maps is None else maps
    w = w.double().clone()
    m, n = w.shape
    q = torch.empty_like(w)
    for j in range(0, n, block):
        b = slice(j, j + block)
        q[:, b] = quantize_block(w[:, b].float(), j // block).double()
        if j + block < n:
            w[:, j + block:] -= (w[:, b] - q[:, b]) @ maps[j // block]
    return q.float()


def kl_sides(options: TrellisOptions, inputs, shape: tuple[int, int]) -> tuple[Tensor, Tensor | None]:
    """(the input side the column loop uses, the output side for the row feedback or None), as options say."""
    if not options.output_hessians:
        return inputs.hessian("trellis codes"), None
    from .gptq_kron import layer_kl_sides

    h_out, h_in, _own = layer_kl_sides(options.output_hessians, inputs, shape)
    return (inputs.hessian("trellis codes") if options.kl_sides == "output" else h_in,
            None if options.kl_sides == "input" else h_out)


def output_side_factor(h_out: Tensor, options: TrellisOptions) -> Tensor:
    """U, upper, with Uᵀ U = H_out⁻¹ after GPTQ's output-side shrinkage and dampening (gptq_kron.output_factor), rows
    in place."""
    from .gptq import GPTQConfig
    from .gptq_kron import output_factor

    cfg = GPTQConfig(act_order=False, output_dampening=options.output_dampening, output_shrink=options.output_shrink)
    return output_factor(h_out, cfg, torch.float64, "trellis")[0]


def quantize_trellis(w: Tensor, scheme: QuantScheme, options: TrellisOptions, inputs) -> TrellisTensor:
    """The trellis code of w [out, in] against the layer's input Hessian (inputs: a quantizers.LayerInputs)."""
    from ..kernels.trellis import viterbi

    fmt = trellis_format(scheme, options)
    m, n = w.shape
    t = fmt.tile
    if m % t or n % t:
        raise ValueError(f"{inputs.name}: a {m} x {n} weight is not whole {t} x {t} trellis tiles; add the layer to "
                         f"`ignore:` or pick a tile that divides both ({t} does not)")
    h, h_out = kl_sides(options, inputs, (m, n))
    signs_in, signs_out = layer_signs(inputs.name, options.seed, m, n)
    wr = rotated(w.double().cpu(), signs_out, signs_in)  # W̃ = Q_outᵀ W Q_in
    hr = rotated(h.double().cpu(), signs_in, signs_in)  # H̃ = Q_inᵀ H Q_in
    scale = wr.pow(2).mean(dim=1, keepdim=True).sqrt().clamp_min(1e-8).to(torch.float16)
    s = scale.double()
    cb = codebook(fmt)
    start = torch.empty(m // t, n // t, dtype=torch.int32)
    steps = torch.empty(m // t, n // t, fmt.steps - 1, dtype=torch.uint8)
    maps = feedback_maps(damped_inverse_factor(hr, options.damp, inputs.name), t)
    # rows in blocks of one tile row between two output-side feedbacks (all rows at once without an output side)
    rows = m if h_out is None else t
    u_out = None if h_out is None else output_side_factor(rotated(h_out.double().cpu(), signs_out, signs_out), options)
    targets, c = wr.clone(), torch.empty_like(wr)
    for r1 in range(0, m, rows):
        r2 = r1 + rows

        def code_block(x: Tensor, j: int) -> Tensor:  # x [rows, t]: tiles (i, j) of this row block, each row by row
            st, sp, _ = viterbi(to_tiles(x, t), fmt, cb)
            start[r1 // t:r2 // t, j], steps[r1 // t:r2 // t, j] = st, sp
            return cb[walk_states(st, sp.to(torch.int64), fmt)].reshape(rows, t)

        c[r1:r2] = block_ldlq(targets[r1:r2] / s[r1:r2], None, t, code_block, maps).double()
        if u_out is not None and r2 < m:  # this row block's error, carried to the rows still to come
            err = targets[r1:r2] - s[r1:r2] * c[r1:r2]
            shift = torch.linalg.solve_triangular(u_out[r1:r2, r1:r2].T, err, upper=False)
            targets[r2:] -= u_out[r1:r2, r2:].T @ shift
    if options.refit_scales:  # each row's scale refitted to its codes: min over s of (w - s c) H (w - s c)ᵀ
        ch = c @ hr
        best = (wr * ch).sum(dim=1, keepdim=True) / (c * ch).sum(dim=1, keepdim=True).clamp_min(1e-30)
        scale = torch.where(best > 0, best, s).to(torch.float16)
    qdata = pack_tiles(start.reshape(-1), steps.reshape(-1, fmt.steps - 1), fmt).to(w.device)
    return TrellisTensor(qdata, scale.to(w.device), None, trellis_scheme(fmt), (m, n), None, fmt,
                         signs_in.to(w.device), signs_out.to(w.device))
