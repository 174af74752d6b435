"""AutoRound / SignRound (Cheng et al., 2023, arXiv:2309.05516; Intel's auto-round): learn, per decoder block, how
each weight rounds and how far each group's range is clipped, by signed gradient descent on the block's output
error against the float block.

For a weight W [out, in] in groups of g, with the round-to-nearest parameters of the scheme (min/max or absmax):

    lo = min(W_g, 0) · β,  hi = max(W_g, 0) · α          (asymmetric; symmetric: absmax · α)
    s  = (hi - lo) / (qmax - qmin)  (stored precision),  z = round(-lo / s)
    Ŵ  = (clamp(round(W / s + V) + z, qmin, qmax) - z) · s

V ∈ [-0.5, 0.5] (one per weight) moves a weight to the other neighbour of the grid; α, β ∈ [0, 1] (one per group)
clip the range. At V = 0, α = β = 1 this is exactly `quantize_rtn`. The gradient passes `round` straight through
(round(x) = x + (round(x) - x).detach()). Each step takes `batch_size` calibration windows of the block's inputs x,
loss = mean over the windows of mean((block_Ŵ(x) - block_W(x))²), and moves every parameter by -lr_t · sign(grad)
(SignSGD), lr_t = lr · (1 - t / iters) (linear decay to 0), then clamps V and α, β to their ranges. The parameters
of the step with the lowest loss are kept (auto-round's default; `best: false` keeps the last).

The block's inputs are the outputs of the blocks already quantized (the runner's stream of activations, as GPTQ
uses it). The target (`target:`) is either the float block on those same inputs (`block`, the default) or, as
auto-round's default does, the float model's own output at the block (`model`: a second stream of activations
carried through the float blocks beside the pass's, so each block also learns to undo the error of the blocks
before it; one more float forward per block and one more set of activations held). Symmetric schemes keep this
project's grid (absmax / qmax, codes in [qmin, qmax]), not auto-round's "full range" one, so the result is an
ordinary symmetric checkpoint.

Against the model's loss (issue 50, item 2; `output_hessians`, written by a `kl_hessians` stage before): the block's
error is weighed by the Fisher of the whole model's output at the block's output, G = Σ_t g_t g_tᵀ (g the gradient
of the sampled log-likelihood at the block's output, labels sampled from the model; precision/output_hessians.py),
the Kronecker-factored second-order term of the KL to the original model, Σ_t Δy_tᵀ G Δy_t, instead of |Δy_t|²:

    loss = mean over the windows' tokens of Δy_t M Δy_tᵀ / hidden,  M = G / mean(diag G) + kl_dampening · I

(BRECQ, Li et al., 2021, weighs block outputs by the diagonal of the same Fisher, per token; a token's gradient is
not known for the calibration windows the tuning draws, so here the tokens share one hidden × hidden G.) At
M = I it is the plain loss; SignSGD reads only the gradient's signs, so M's scale does not matter.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from ..arch import get_module, set_module
from ..calibrate.blockwise import _first
from ..core.primitives import group_view, scale_shape, ungroup
from ..core.qtensor import QuantizedTensor
from ..core.scheme import QuantScheme
from ..kernels.cpu_quant import autoround_round, sign_step_rows
from ..threads import ordered_map, window_workers

V_RANGE = 0.5  # a weight may round to either neighbour on the grid, nothing further
CLIP_RANGE = (0.0, 1.0)  # α, β only shrink the range (auto-round's bounds)
DEFAULT_LR = 5e-3  # the paper's 1 / 200, the largest default step size
TARGETS = ("block", "model")  # AutoRoundOptions.target


@dataclass(frozen=True)
class AutoRoundOptions:
    """AutoRound's settings (`options:` of a `method: autoround` quantize stage). The defaults are the paper's."""

    iters: int = 200  # SignSGD steps per block
    # step size of V; 0 = min(5e-3, 1 / iters): the paper's 1 / iters at 200 steps and above, and 5e-3 below, where
    # 1 / iters was worse on validation (docs/results.md, "AutoRound faster")
    lr: float = 0.0
    minmax_lr: float = 0.0  # step size of the clipping α, β; 0 = lr
    batch_size: int = 8  # calibration windows per step (drawn without replacement, epoch by epoch)
    minmax_tuning: bool = True  # learn the per-group clipping α, β (false: only the rounding V)
    best: bool = True  # keep the parameters of the step with the lowest loss (false: those after the last step)
    seed: int = 0  # the order in which windows are drawn
    # where the rounding starts: "rtn" (the paper: round to nearest of the float weight) or "gptq" (GPTQ's solution
    # for each layer, from the pass's input Hessians; AutoRound then tunes its rounding and clipping from there)
    init: str = "rtn"
    # the kl_hessians stage's folder (set by that stage, not by hand): the block's error weighed by the Fisher of the
    # model's output at the block's output (the module docstring); "" = plain mean squared error
    output_hessians: str = ""
    kl_dampening: float = 0.01  # M's identity part, as a fraction of G's mean diagonal (output_hessians only)
    # what the block's output is tuned towards: "block" (the float block on the compressed model's inputs) or "model"
    # (the float model's own activations at the block's output, auto-round's default; the module docstring)
    target: str = "block"

    def __post_init__(self):
        if self.iters < 0:
            raise ValueError(f"autoround iters must be >= 0 (the paper uses 200; 0 = round to nearest), got "
                             f"{self.iters}")
        if self.lr < 0 or self.minmax_lr < 0:
            raise ValueError(f"autoround lr and minmax_lr must be >= 0 (0 = min(5e-3, 1 / iters)), got {self.lr}, "
                             f"{self.minmax_lr}")
        if self.batch_size < 1:
            raise ValueError(f"autoround batch_size must be >= 1 (the paper uses 8), got {self.batch_size}")
        if self.init not in ("rtn", "gptq"):
            raise ValueError(f"autoround init {self.init!r}: use rtn (round to nearest, the paper's) or gptq")
        if self.target not in TARGETS:
            raise ValueError(f"autoround target {self.target!r}: use block (the float block on the compressed "
                             f"model's inputs) or model (the float model's own activations, auto-round's default)")
        if not self.kl_dampening >= 0:
            raise ValueError(f"autoround kl_dampening must be >= 0 (a fraction of the Fisher's mean diagonal added "
                             f"as identity; 0.01 is the default), got {self.kl_dampening}")

    @property
    def step_size(self) -> float:
        return self.lr or (min(DEFAULT_LR, 1.0 / self.iters) if self.iters else 0.0)

    @property
    def clip_step_size(self) -> float:
        return self.minmax_lr or self.step_size


def autoround_problem(scheme: QuantScheme) -> str | None:
    """Why AutoRound cannot produce `scheme` (None: it can)."""
    if scheme.is_float:
        return f"AutoRound learns rounding on an integer grid; {scheme.dtype} rounds to a float grid (use rtn or gptq)"
    if scheme.granularity not in ("group", "channel", "tensor"):
        return f"AutoRound works per group, channel or tensor, not per {scheme.granularity}"
    if scheme.zero_point_dtype != "uint8":
        return "AutoRound keeps integer zero points; fractional ones (zero_point_dtype: float16) are HQQ's"
    if scheme.act is not None:
        return ("AutoRound's loss does not simulate quantized activations; for a scheme with `act:` use method: gptq "
                "or rtn (or tune the weights weight-only)")
    return None


KEY_BLOCK = "output"  # the block-output Fisher's name in its file


def block_fisher_path(folder: str | Path, prefix: str) -> Path:
    """Where the Fisher at the output of the decoder block `prefix` ("model.layers.5") lives in a kl_hessians folder
    (beside the layers' files, which are named by a layer inside the block: no clash)."""
    return Path(folder) / f"{prefix}.safetensors"


def block_metric(folder: str | Path, prefix: str, hidden: int, dampening: float) -> Tensor:
    """M = G / mean(diag G) + dampening · I [hidden, hidden] (float32) for the block `prefix`, from the kl_hessians
    folder `folder` (the module docstring). Clear errors for a missing file or one of another model."""
    path = block_fisher_path(folder, prefix)
    if not path.is_file():
        raise FileNotFoundError(f"{prefix}: no block-output Fisher at {path}. AutoRound's `output_hessians` folder is "
                                "written by a `- stage: kl_hessians` right before the quantize stage; add that stage, "
                                "or remove `output_hessians` for the plain loss.")
    g = load_file(str(path))[KEY_BLOCK].float()
    if tuple(g.shape) != (hidden, hidden):
        raise ValueError(f"{prefix}: the block-output Fisher at {path} is {tuple(g.shape)}, the block's output has "
                         f"{hidden} features; it was computed for another model (rerun the kl_hessians stage)")
    mean = float(g.diagonal().mean())
    if not mean > 0:
        raise ValueError(f"{prefix}: the block-output Fisher at {path} is zero (no gradient reached the block's "
                         "output); rerun the kl_hessians stage")
    m = g / mean
    m.diagonal().add_(dampening)
    return m


def quantize_autoround_layer(w: Tensor, scheme: QuantScheme, options: AutoRoundOptions, inputs) -> QuantizedTensor:
    """The registry's per-layer signature. AutoRound tunes a decoder block at a time inside the calibration pass
    (`tune_block`); a layer outside the blocks has no block to tune against."""
    raise ValueError(f"{inputs.name}: AutoRound tunes the layers of a decoder block against the block's float "
                     "output, and this layer is outside the decoder blocks. Add it to `ignore:` or quantize it in a "
                     "separate stage with method: rtn.")


# ---------------------------------------------------------------- the rounding function and its parameters

def round_ste(x: Tensor) -> Tensor:
    """round(x) forward, identity backward (straight-through)."""
    return x + (torch.round(x) - x).detach()


@dataclass
class Rounding:
    """The learned parameters of one weight: V [out, in] and the clipping α (hi), β (lo) per group, float32."""

    v: Tensor
    alpha: Tensor
    beta: Tensor

    @classmethod
    def start(cls, w: Tensor, scheme: QuantScheme) -> "Rounding":
        n_groups = group_view(w, scheme).shape[:-1]
        return cls(torch.zeros(w.shape, dtype=torch.float32, device=w.device),
                   torch.ones(n_groups, dtype=torch.float32, device=w.device),
                   torch.ones(n_groups, dtype=torch.float32, device=w.device))

    def tensors(self, minmax: bool) -> list[Tensor]:
        return [self.v, self.alpha, self.beta] if minmax else [self.v]

    def copy(self) -> "Rounding":
        return Rounding(self.v.detach().clone(), self.alpha.detach().clone(), self.beta.detach().clone())


def qparams(w: Tensor, scheme: QuantScheme, r: Rounding) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point [groups] of `w` (as group_view's leading dims) with the clipping α, β applied;
    differentiable in α, β. At α = β = 1 these equal primitives.compute_qparams exactly."""
    wg = group_view(w.float(), scheme)
    if scheme.symmetric:
        scale = wg.abs().amax(dim=-1) * r.alpha / scheme.qmax
        lo = None
    else:
        lo = wg.amin(dim=-1).clamp(max=0.0) * r.beta
        hi = wg.amax(dim=-1).clamp(min=0.0) * r.alpha
        scale = (hi - lo) / (scheme.qmax - scheme.qmin)
    stored = scale.to(getattr(torch, scheme.scale_dtype)).float()
    scale = scale + (stored - scale).detach()  # the stored precision, gradient straight through
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if lo is None:
        return scale, None
    return scale, torch.clamp(round_ste(-lo / scale), scheme.qmin, scheme.qmax)


def fake_quant(w: Tensor, scheme: QuantScheme, r: Rounding, start: Tensor | None = None) -> Tensor:
    """Ŵ [out, in] (float32): the weight as the codes with rounding offsets V and clipping α, β dequantize. The grid
    (scale, zero point) comes from `w`; the values rounded onto it are `start` (default `w`): GPTQ's solution on
    that same grid for `init: gptq`, so that V = 0 gives GPTQ's codes exactly."""
    scale, zero = qparams(w, scheme, r)
    wg, vg = group_view((w if start is None else start).float(), scheme), group_view(r.v, scheme)
    s = scale[..., None]
    q = round_ste(wg / s + vg)
    if zero is not None:
        q = q + zero[..., None]
    q = torch.clamp(q, scheme.qmin, scheme.qmax)
    deq = (q - zero[..., None]) * s if zero is not None else q * s
    return ungroup(deq, tuple(w.shape), scheme)


@dataclass(frozen=True)
class RoundingGrid:
    """What the rounding of one weight needs that does not change while it is tuned: the weight and the values to
    round (`start`, default the weight) in groups [rows, groups, G], float32, and each group's range at α = β = 1
    (asymmetric: min ∧ 0 and max ∨ 0; symmetric: absmax)."""

    scheme: QuantScheme
    shape: tuple[int, int]
    values: Tensor
    lo: Tensor | None
    hi: Tensor

    @classmethod
    def of(cls, w: Tensor, scheme: QuantScheme, start: Tensor | None = None) -> "RoundingGrid":
        wg = group_view(w.float(), scheme)
        values = wg if start is None else group_view(start.float(), scheme)
        if scheme.symmetric:
            return cls(scheme, tuple(w.shape), values, None, wg.abs().amax(dim=-1))
        return cls(scheme, tuple(w.shape), values, wg.amin(dim=-1).clamp(max=0.0), wg.amax(dim=-1).clamp(min=0.0))


@dataclass
class _Saved:
    """What rounding_forward keeps for rounding_backward: the scale and where it was positive, the clipped low end
    and where the zero point was inside its range (asymmetric), where the codes were inside [qmin, qmax] (1.0 or
    0.0: float masks, because this CPU build multiplies by a bool mask 10× slower than by a float one), and
    (q - z) - [inside]·u/s, the weight-sized factor of the scale's gradient."""

    scale: Tensor
    positive: Tensor
    lo: Tensor | None
    zero_inside: Tensor | None
    inside: Tensor
    ds_factor: Tensor


def _group_params(grid: RoundingGrid, r: Rounding):
    """rounding_forward's per-group part: (scale, where the stored scale was positive, the clipped low end, where the
    zero point was inside its range, the zero point); the last three None when symmetric."""
    sch = grid.scheme
    if sch.symmetric:
        lo, raw = None, grid.hi * r.alpha / sch.qmax
    else:
        lo = grid.lo * r.beta
        raw = (grid.hi * r.alpha - lo) / (sch.qmax - sch.qmin)
    stored = raw.to(getattr(torch, sch.scale_dtype)).float()
    positive = stored > 0
    scale = torch.where(positive, stored, torch.ones_like(stored))
    zero = zero_inside = None
    if lo is not None:
        zr = torch.round(-lo / scale)
        zero_inside = (zr >= sch.qmin) & (zr <= sch.qmax)
        zero = torch.clamp(zr, sch.qmin, sch.qmax)
    return scale, positive, lo, zero_inside, zero


@torch.no_grad()
def rounding_forward(grid: RoundingGrid, r: Rounding) -> tuple[Tensor, _Saved]:
    """`fake_quant(w, scheme, r, start)` computed directly (the same operations in the same order, so the same
    values), and what its straight-through gradient needs: one pass over the weight, not autograd's dozen
    weight-sized temporaries."""
    sch = grid.scheme
    scale, positive, lo, zero_inside, zero = _group_params(grid, r)
    s = scale[..., None]
    x = grid.values / s
    q = torch.round(x + group_view(r.v, sch))
    if zero is not None:
        q += zero[..., None]
    clamped = torch.clamp(q, sch.qmin, sch.qmax)
    inside = q.sub_(clamped).abs_().neg_().add_(1.0).clamp_(min=0.0)  # the codes are integers: 1 inside, 0 outside
    if zero is not None:
        clamped -= zero[..., None]
    deq = ungroup(clamped * s, grid.shape, sch)
    return deq, _Saved(scale, positive, lo, zero_inside, inside, clamped.sub_(x.mul_(inside)))


@torch.no_grad()
def rounded_weight(grid: RoundingGrid, r: Rounding, dtype: torch.dtype) -> tuple[Tensor, _Saved]:
    """rounding_forward's weight cast to `dtype`, and its _Saved: on a CPU in one C pass over the weight on every
    thread (kernels/cpu_quant.c; the same bits, tested), where the scheme's groups are rows of the weight's own
    layout (group, channel, tensor) and the dtype is float32 or bfloat16; else rounding_forward's torch operations."""
    sch = grid.scheme
    if grid.values.device.type == "cpu" and sch.granularity != "block" and dtype in (torch.float32, torch.bfloat16):
        scale, positive, lo, zero_inside, zero = _group_params(grid, r)
        done = autoround_round(grid.values, group_view(r.v, sch), scale, zero, sch.qmin, sch.qmax, dtype,
                               torch.get_num_threads())
        if done is not None:
            hat, inside, ds_factor = done
            return hat.view(grid.shape), _Saved(scale, positive, lo, zero_inside, inside, ds_factor)
    deq, saved = rounding_forward(grid, r)
    return deq.to(dtype), saved


@torch.no_grad()
def rounding_backward(grid: RoundingGrid, saved: _Saved, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of V, α and β given the gradient `grad` [out, in] of the rounded weight: autograd's through
    `fake_quant` (straight-through round and stored-precision cast, clamp passing the gradient inside its range
    inclusive), written out. With Ŵ = (q - z)·s, q = clamp(round(u/s + V) + z), per group:
    dV = G·s·[q inside]; ds = Σ G·((q - z) - [inside]·u / s) + dz·[z inside]·lo / s²,
    dz = -s·Σ G·[q outside]; d lo = -dz·[z inside] / s; s = (hi - lo) / (qmax - qmin) (symmetric: absmax·α / qmax),
    hi = (max ∨ 0)·α, lo = (min ∧ 0)·β."""
    sch = grid.scheme
    g = group_view(grad.float(), sch)
    s = saved.scale
    g_in = g * saved.inside
    ds = torch.linalg.vecdot(g, saved.ds_factor)
    if saved.lo is None:
        dv = ungroup(g_in.mul_(s[..., None]), grid.shape, sch)
        return dv, ds * saved.positive * grid.hi / sch.qmax, None
    dz = (g_in.sum(-1) - g.sum(-1)) * s * saved.zero_inside  # before g_in becomes dV in place
    dv = ungroup(g_in.mul_(s[..., None]), grid.shape, sch)
    ds = ds + dz * saved.lo / (s * s)
    ds = ds * saved.positive / (sch.qmax - sch.qmin)
    return dv, ds * grid.hi, (-dz / s - ds) * grid.lo


@torch.no_grad()
def finish(w: Tensor, scheme: QuantScheme, r: Rounding, start: Tensor | None = None) -> QuantizedTensor:
    """The codes, scale and zero point that `fake_quant(w, scheme, r, start)` dequantizes from, packed."""
    scale, zero = qparams(w, scheme, r)
    wg, vg = group_view((w if start is None else start).float(), scheme), group_view(r.v, scheme)
    q = torch.round(wg / scale[..., None] + vg)
    if zero is not None:
        q = q + zero[..., None]
    q = torch.clamp(q, scheme.qmin, scheme.qmax)
    shape = scale_shape(scheme, *w.shape)
    return QuantizedTensor.from_codes(ungroup(q, tuple(w.shape), scheme), scale.reshape(shape),
                                      None if zero is None else zero.reshape(shape), scheme)


@torch.no_grad()
def sign_step(r: Rounding, lr: float, clip_lr: float, minmax: bool) -> None:
    """One SignSGD step on the gradients the last backward left, then the parameters back into their ranges;
    the gradients are cleared."""
    if r.v.grad is not None:  # None: the layer saw no input in this step (an expert no token was routed to)
        if not sign_step_rows(r.v, r.v.grad, lr, V_RANGE, torch.get_num_threads()):  # one C pass on a CPU
            r.v -= lr * torch.sign(r.v.grad)
            r.v.clamp_(-V_RANGE, V_RANGE)
    if minmax:
        for p in (r.alpha, r.beta):
            if p.grad is not None:
                p -= clip_lr * torch.sign(p.grad)
                p.clamp_(*CLIP_RANGE)
    for p in r.tensors(True):
        p.grad = None


# ---------------------------------------------------------------- tuning a block

class _Rounded(nn.Module):
    """A linear layer whose weight, for the duration of the tuning, is the rounded weight of the current step
    (`hat`: rounding_forward's result as a leaf tensor; the step's windows' gradients for it are added up and the
    rounding's backward runs once per step, not once per window)."""

    def __init__(self, original: nn.Module, grid: RoundingGrid, rounding: Rounding):
        super().__init__()
        self.original, self.grid, self.rounding = original, grid, rounding
        self.bias = original.bias
        self.hat: Tensor | None = None
        self.saved: _Saved | None = None

    def round(self, dtype: torch.dtype) -> Tensor:
        """This step's rounded weight from the current V, α, β, in `dtype` (the dtype the block's matmuls compute
        in: cast once a step, not once a window and back): the leaf the windows' gradients are taken for."""
        hat, self.saved = rounded_weight(self.grid, self.rounding, dtype)
        self.hat = hat.requires_grad_(True)
        return self.hat

    def backward(self, grad: Tensor | None, minmax: bool) -> None:
        """The gradients of V (and α, β) from the step's gradient of the rounded weight (None: the layer saw no
        input this step, an expert no token was routed to)."""
        if grad is not None:
            dv, da, db = rounding_backward(self.grid, self.saved, grad)
            self.rounding.v.grad = dv
            if minmax:
                self.rounding.alpha.grad, self.rounding.beta.grad = da, db
        self.hat, self.saved = None, None

    def forward(self, x: Tensor) -> Tensor:
        w = self.hat if torch.is_autocast_enabled(x.device.type) else self.hat.to(x.dtype)  # autocast: as cast
        return nn.functional.linear(x, w, self.bias)


def error_loss(d: Tensor, metric: Tensor | None) -> Tensor:
    """The block's loss on one window's output error d [..., hidden]: mean(d²), or with `metric` M,
    mean over tokens of d M dᵀ / hidden (equal to mean(d²) at M = I)."""
    if metric is None:
        return d.pow(2).mean()
    return (d @ metric).mul_(d).mean()


@dataclass
class BlockSamples:
    """What the calibration pass showed one block: its inputs (hidden states and keyword arguments, per window)
    and its float outputs on them (the targets)."""

    hidden: list[Tensor]
    kwargs: list[dict]
    target: list[Tensor]


@contextlib.contextmanager
def _swapped(block: nn.Module, layers: dict[str, nn.Module]):
    """The block with `layers` (block-relative name -> module) in place of its own, restored on exit."""
    originals = {name: get_module(block, name) for name in layers}
    try:
        for name, m in layers.items():
            set_module(block, name, m)
        yield
    finally:
        for name, m in originals.items():
            set_module(block, name, m)


def tuning_workers(batch_size: int, device: str, threads: int) -> int:
    """How many of a step's windows are computed at once (threads.window_workers): two on a CPU of more than one
    thread. A window's forward and backward are many small operations that a second torch thread barely speeds up
    (0.205 -> 0.176 s a step of 2 windows on the 2-core EPYC), while two windows at once take little more than one
    (0.124 s). Each worker holds a window's activations and a gradient of the block's weights (the memory plan
    counts both)."""
    return window_workers(device, threads, batch_size)


def tune_block(block: nn.Module, weights: dict[str, Tensor], scheme: QuantScheme, options: AutoRoundOptions,
               samples: BlockSamples, compute_dtype: torch.dtype | None = None,
               schemes: dict[str, QuantScheme] | None = None,
               starts: dict[str, Tensor] | None = None,
               metric: Tensor | None = None) -> tuple[dict[str, QuantizedTensor], dict]:
    """Tune the rounding of the linears `weights` (block-relative name -> [out, in] float weight) of `block`
    jointly, against `samples.target`. Returns the quantized layers and a record (loss before and after, the step
    kept, seconds). `compute_dtype` (bfloat16): the block's matmuls run under autocast in it, as the pass's
    forwards do; the parameters, the rounding and the loss stay float32. `schemes` overrides the scheme per layer.
    `starts` (name -> [out, in]): the values to round instead of the weight itself, on the weight's grid (GPTQ's
    solution: `init: gptq`). `metric` [hidden, hidden] (block_metric): each token's output error weighed by it,
    Δy M Δyᵀ, instead of |Δy|² (against the model's loss). The block's own parameters are not changed (the caller
    replaces the layers with the returned ones)."""
    starts = starts or {}
    t0 = time.perf_counter()
    schemes = {name: (schemes or {}).get(name, scheme) for name in weights}
    rounding = {name: Rounding.start(w, schemes[name]) for name, w in weights.items()}
    wrapped = {name: _Rounded(get_module(block, name), RoundingGrid.of(w.detach(), schemes[name],
                                                                       starts.get(name)), rounding[name])
               for name, w in weights.items()}
    n = len(samples.hidden)
    gen = torch.Generator().manual_seed(options.seed)
    order: list[int] = []
    device = samples.hidden[0].device
    cast = compute_dtype is not None and compute_dtype != samples.hidden[0].dtype
    frozen = [p for p in block.parameters() if p.requires_grad]
    workers = tuning_workers(options.batch_size, device.type, torch.get_num_threads())
    matmul_dtype = compute_dtype if cast else samples.hidden[0].dtype

    def window_grad(i: int, leaves: list[Tensor], windows: int) -> tuple[float, tuple]:
        """Window i's loss (over `windows`) and its gradient for each of `leaves` (None where it did not reach)."""
        with torch.autocast(device_type=device.type, dtype=compute_dtype) if cast else contextlib.nullcontext():
            out = _first(block(samples.hidden[i], **samples.kwargs[i]))
        loss = error_loss(out.float() - samples.target[i].float(), metric) / windows
        return float(loss.detach()), torch.autograd.grad(loss, leaves, allow_unused=True)

    def step_grads(idx: list[int]) -> tuple[float, list]:
        """The step's loss and its gradient for each layer's rounded weight, the windows' added in the windows'
        order (so the same on any number of workers)."""
        leaves = [m.round(matmul_dtype) for m in wrapped.values()]
        total, grads = 0.0, [None] * len(leaves)
        for loss, found in ordered_map(idx, lambda i: window_grad(i, leaves, len(idx)), workers):
            total += loss
            # summed in float32: a 16-bit window gradient is exact in it, as autocast's cast back used to give it
            grads = [a if b is None else b.float() if a is None else a.add_(b) for a, b in zip(grads, found)]
        return total, grads

    lr, clip_lr = options.step_size, options.clip_step_size
    best_loss, best, first_loss, last_loss, kept = math.inf, None, None, None, 0
    try:
        for p in frozen:
            p.requires_grad_(False)
        with _swapped(block, wrapped), torch.enable_grad():
            for step in range(options.iters):
                if len(order) < options.batch_size:
                    order += torch.randperm(n, generator=gen).tolist()
                idx, order = order[:options.batch_size], order[options.batch_size:]
                loss, grads = step_grads(idx)
                for m, grad in zip(wrapped.values(), grads):
                    m.backward(grad, options.minmax_tuning)
                first_loss = loss if first_loss is None else first_loss
                if options.best and loss < best_loss:
                    best_loss, best, kept = loss, {k: r.copy() for k, r in rounding.items()}, step
                last_loss = loss
                decay = 1 - step / options.iters  # linear decay to 0
                for r in rounding.values():
                    sign_step(r, lr * decay, clip_lr * decay, options.minmax_tuning)
        if options.best and best is not None:
            rounding = best
        else:
            kept = options.iters
    finally:
        for p in frozen:
            p.requires_grad_(True)
    out = {name: finish(weights[name], schemes[name], rounding[name], starts.get(name)) for name in weights}
    record = {"iters": options.iters, "first_loss": first_loss, "last_loss": last_loss,
              "kept_step": kept, "kept_loss": best_loss if options.best and best is not None else last_loss,
              "seconds": round(time.perf_counter() - t0, 2)}
    return out, record
