"""GPTQ against the whole model's loss (issue 50, item 2): rounding with a Kronecker-factored Hessian of the model's
KL divergence, H ≈ H_out ⊗ H_in, instead of the layer's own output error (H_in alone).

A layer's weight error ΔW costs, to second order, tr(ΔW H_in ΔWᵀ H_out): H_in = Σ x xᵀ over the layer's inputs (what
GPTQ uses), H_out = Σ g gᵀ over the gradients of the model's sampled log-likelihood at the layer's outputs (the
output side of the Fisher, which is the KL's Hessian at the original weights; the kl_hessians stage computes it,
precision/output_hessians.py). Plain GPTQ takes H_out = I: every row alone. YAQA (Tseng et al., 2025,
arXiv:2505.22988) rounds against both sides; this is the same objective by GPTQ's own machinery:

- The LDL factor of H_out ⊗ H_in, in row-major order, is the Kronecker product of the two sides' factors, so the
  sequential (LDLQ) rounding of every weight is: rows in turn, each row's target shifted by the rows before it, then
  the row rounded by GPTQ's column loop with H_in. Given the rows already rounded (deviations X_done from their
  targets), the best continuous rows still to come move by -H_rest⁻¹ H_rest,done X_done (H_in cancels): the
  column-wise update GPTQ makes across columns, made across rows with the upper Cholesky factor U of H_out⁻¹:
  T_rest -= U_done,restᵀ U_done,done⁻ᵀ (T_done - Ŵ_done).
- Rows go in blocks of `row_block` (GPTQConfig.row_block): a block's rows are rounded together by one GPTQ column
  loop (vectorised across them) and do not feed one another; the feedback between blocks is exact. row_block 1 is
  the whole sequential rounding (tested against GPTQ on the flattened weight with the Kronecker Hessian); larger
  blocks trade a little of it for speed (the column loop runs once per block).
- Rows go in decreasing H_out diagonal with act_order (GPTQ's column rule, applied to rows), and are put back.

Any scalar grid GPTQ rounds onto (int2-int8, fp8, NVFP4 with one global scale) whose scales are per row or per
group of a row; a scale shared across rows (granularity: tensor) is refused.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from ..core.primitives import global_scale
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme
from .gptq import (GPTQConfig, HessianFactor, _inverse_hessian_factor, _permute_columns_, _permute_rows_,
        hessian_factor, layer_factor, quantize_gptq)

KEY_OUT, KEY_IN = "output", "input"  # the two sides' names in each layer's file


def output_hessian_path(folder: str | Path, name: str) -> Path:
    """Where layer `name`'s output-side Hessian lives in a kl_hessians folder."""
    return Path(folder) / f"{name}.safetensors"


def load_kl_hessians(folder: str | Path, name: str, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Layer `name`'s two sides (H_out [out, out], the gradient-weighted H_in [in, in]) from `folder`
    (GPTQConfig.output_hessians), checked against the layer's [out, in] `shape`."""
    path = output_hessian_path(folder, name)
    if not path.is_file():
        raise FileNotFoundError(f"{name}: no KL Hessians at {path}. GPTQ's `output_hessians` folder is written by a "
                                "`- stage: kl_hessians` right before the quantize stage; add that stage, or remove "
                                "`output_hessians` for plain GPTQ.")
    t = load_file(str(path))
    h_out, h_in = t[KEY_OUT], t[KEY_IN]
    if tuple(h_out.shape) != (shape[0],) * 2 or tuple(h_in.shape) != (shape[1],) * 2:
        raise ValueError(f"{name}: the KL Hessians at {path} are {tuple(h_out.shape)} and {tuple(h_in.shape)}, the "
                         f"layer is {tuple(shape)}; they were computed for another model (rerun the kl_hessians stage)")
    return h_out, h_in


def output_factor(h_out: Tensor, cfg: GPTQConfig, dtype: torch.dtype, name: str) -> tuple[Tensor, Tensor | None]:
    """(U, perm): the upper Cholesky factor of H_out⁻¹ (its diagonal scaled by 1 + cfg.output_shrink, then dampened by
    cfg.output_dampening) over the rows in the order `perm` (decreasing
    diagonal with act_order, else None: as they are). Outputs whose gradient is always zero get a unit diagonal."""
    H = h_out.detach().to(dtype, copy=True).contiguous()
    H.diagonal().mul_(1 + cfg.output_shrink)  # toward the diagonal (GPTQConfig.output_shrink)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else None
    if perm is not None:
        _permute_columns_(H, perm)
        _permute_rows_(H, perm)
    return _inverse_hessian_factor(H, cfg.output_dampening, f"{name} (output side)", fast=cfg.fast_factor), perm


def kron_problem(scheme: QuantScheme) -> str | None:
    """Why the output-side feedback cannot round onto `scheme` (None: it can)."""
    if scheme.granularity not in ("group", "channel"):
        return (f"granularity {scheme.granularity} shares a scale across rows, and the output-side feedback rounds "
                "rows in blocks; use granularity: channel or group")
    return None


def as_scaled(h_out: Tensor, h_in: Tensor, out_divisor: Tensor | None,
              in_divisor: Tensor | None) -> tuple[Tensor, Tensor]:
    """Both sides as the layer is now, where a smoothing stage has scaled it since they were measured: inputs divided
    by d (weights times d) make H_in / (d dᵀ); outputs divided by s (rows of W divided by s) make the loss's gradient
    there s·g, so H_out ∘ (s sᵀ). The Kronecker cost of a weight error is the same in either coordinates."""
    if out_divisor is not None:
        s = out_divisor.to(h_out)
        h_out = h_out * s[:, None] * s[None, :]
    if in_divisor is not None:
        d = in_divisor.to(h_in)
        h_in = h_in / (d[:, None] * d[None, :])
    return h_out, h_in


def missed_inputs(h_in: Tensor, inputs) -> bool:
    """Whether the kl_hessians pass's windows left an input channel silent that the calibration pass saw (a MoE
    expert few of its tokens reached): its weights would be zeroed as dead, so the layer's own input Hessian is used."""
    if inputs.stats is None:
        return False
    silent = torch.diag(h_in) == 0
    return bool(silent.any()) and bool((torch.diag(inputs.hessian("GPTQ"))[silent.to(h_in.device)] > 0).any())


def layer_kl_sides(folder: str | Path, inputs, shape: tuple[int, int]) -> tuple[Tensor, Tensor, bool]:
    """(H_out, H_in, own) of layer `inputs.name` [out, in] = `shape` from a kl_hessians folder, in the layer's
    coordinates now (as_scaled). own: the file's input side was replaced by the layer's own calibration Hessian scaled
    to the file's trace (missed_inputs: a MoE expert the kl pass's windows barely reached), so its cost stays in the
    KL's units."""
    h_out, h_in = load_kl_hessians(folder, inputs.name, shape)
    h_out, h_in = as_scaled(h_out, h_in, inputs.out_divisor, inputs.divisor)
    if not missed_inputs(h_in, inputs):
        return h_out, h_in, False
    own = inputs.hessian("EoRA").to(h_in)
    return h_out, own * (float(h_in.diagonal().sum()) / max(float(own.diagonal().sum()), 1e-30)), True


def quantize_gptq_kron_layer(w: Tensor, scheme: QuantScheme, options: GPTQConfig, inputs) -> QuantizedTensor:
    """The registry's signature (method gptq with options.output_hessians): the sides options.kl_sides names from the
    layer's file, the layer's own input Hessian (its calibration inputs) where the input side is not one of them."""
    h_out, h_in = load_kl_hessians(options.output_hessians, inputs.name, tuple(w.shape))
    h_out, h_in = as_scaled(h_out, h_in, inputs.out_divisor, inputs.divisor)
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    weighted = options.kl_sides != "output" and not missed_inputs(h_in, inputs)
    factor = hessian_factor(h_in, options, dtype, inputs.name, overwrite=True) if weighted else \
        layer_factor(w, options, inputs)
    if options.kl_sides == "input":
        return quantize_gptq(w, factor, scheme, options, name=inputs.name, clip=inputs.clip)
    return quantize_gptq_kron(w, factor, h_out, scheme, options, name=inputs.name, clip=inputs.clip)


def quantize_gptq_kron(w: Tensor, hessian: Tensor | HessianFactor, h_out: Tensor, scheme: QuantScheme,
                       cfg: GPTQConfig = GPTQConfig(), name: str = "layer",
                       clip: Tensor | None = None) -> QuantizedTensor:
    """GPTQ-quantize `w` [out, in] against tr(ΔW H_in ΔWᵀ H_out): `hessian` is H_in [in, in] (or its factor), `h_out`
    [out, in]'s output side [out, out]. `clip` [rows, groups]: AWQ's grid clipping, as quantize_gptq takes it.
    Memory beyond quantize_gptq's: H_out's factor [out, out] and the targets [out, in]."""
    if (why := kron_problem(scheme)) is not None:
        raise ValueError(f"{name}: {why}")
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    n_rows = w.shape[0]
    factor = hessian if isinstance(hessian, HessianFactor) else hessian_factor(hessian, cfg, dtype, name)
    u, perm = output_factor(h_out, cfg, dtype, name)
    targets = w.detach().to(dtype, copy=True).contiguous()
    gscale = global_scale(targets, scheme)  # NVFP4: one per tensor, from the original weights
    if perm is not None:
        targets = targets[perm]
        clip = None if clip is None else clip[perm.to(clip.device)]
    live = ~factor.dead.to(targets.device)  # errors in inputs that never fire cost nothing and carry nothing
    parts = []
    for r1 in range(0, n_rows, cfg.row_block):
        r2 = min(r1 + cfg.row_block, n_rows)
        part = quantize_gptq(targets[r1:r2], factor, scheme, cfg, name, clip=None if clip is None else clip[r1:r2],
                             gscale=gscale)
        parts.append(part)
        if r2 < n_rows:
            err = (targets[r1:r2] - part.dequantize(dtype)) * live
            shift = torch.linalg.solve_triangular(u[r1:r2, r1:r2].T, err, upper=False)
            targets[r2:] -= u[r1:r2, r2:].T @ shift
    out = QuantizedTensor.cat_rows(parts)
    if perm is None:
        return out
    back = torch.argsort(perm).to(out.qdata.device)
    return QuantizedTensor(out.qdata[back].contiguous(), out.scale[back].contiguous(),
                           None if out.zero_point is None else out.zero_point[back].contiguous(), out.scheme,
                           out.shape, out.global_scale)


__all__ = ["KEY_IN", "KEY_OUT", "as_scaled", "kron_problem", "layer_kl_sides", "load_kl_hessians", "missed_inputs",
           "output_factor", "output_hessian_path", "quantize_gptq_kron", "quantize_gptq_kron_layer"]
