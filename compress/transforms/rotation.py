"""Rotating the residual stream (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456; SpinQuant's R1, Liu et al. 2024,
arXiv:2405.16406), folded into the weights so that the float model computes the same function.

With Q orthogonal [d, d] and the residual stream x of every token carried as x·Q instead of x:
- the embedding table becomes E·Q (every token's vector enters rotated);
- a linear that reads the residual through a norm (q/k/v, gate/up, lm_head) takes the norm's gain g into its columns
  first (W·diag(g), the norm's gain then 1), then W·Q: (xQ)(WQ)ᵀ = xWᵀ;
- a linear that writes into the residual (o_proj, down_proj) becomes Qᵀ·W (and its bias b·Q): its output is rotated;
- RMSNorm without its gain commutes with Q: ‖xQ‖ = ‖x‖.
So the rotation needs RMS norms (a LayerNorm subtracts the mean, which a rotation does not preserve) and nothing
between a block's output projections and the residual (Gemma 2's post-norms have gains there). The rotated weights
are spread over every input channel: a channel with outliers no longer dominates a group's range, which is what
low-bit weight quantization gains. Nothing is needed at run time: every checkpoint format holds the result.

The online Hadamard (QuaRot's, SpinQuant's R4; below): the MLP's intermediate channels, the input of down_proj,
pass through a nonlinearity, so no rotation folds through them; instead down_proj's weight becomes W·Q and x·Q is
computed at run time before it (OnlineHadamard, a forward pre-hook). Its weight and activations are then quantized
in the rotated basis. Only a runtime that applies the transform can run it: the compress checkpoint does, the
export formats refuse it (their loaders do not).

Q is a randomised Hadamard matrix H·diag(±1)/√d (QuaRot's choice: cheap, and maximally incoherent) where one of
order d can be built here (Sylvester for 2^k, Paley I for q + 1 with q a prime ≡ 3 mod 4, Paley II for 2(q + 1) with
q a prime ≡ 1 mod 4, and Kronecker products of those: 576 = 36 · 16, 1536 = 12 · 128, 4096 = 2^12); otherwise, or
with kind: orthogonal, a random orthogonal matrix (SpinQuant's starting point, QR of a Gaussian matrix).
"""
from __future__ import annotations


import torch
from torch import Tensor, nn

from ..core.hadamard import _construction, _describe, hadamard, hadamard_factors  # noqa: F401 (re-exported)
from ..core.nn import attach_input_rotation


def random_rotation(n: int, kind: str = "hadamard", seed: int = 0) -> tuple[Tensor, str]:
    """An orthogonal [n, n] float64 matrix and what it is: H·diag(±1)/√n with random signs (kind hadamard, where a
    Hadamard matrix of order n can be built), else a random orthogonal matrix (QR of a Gaussian matrix)."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n) if kind == "hadamard" else None
    if h is not None:
        signs = torch.randint(0, 2, (n,), generator=g).double() * 2 - 1
        return h * signs[None, :] / n ** 0.5, f"randomised Hadamard of order {n} ({_describe(n)})"
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]  # a uniformly distributed orthogonal matrix
    why = "" if kind == "orthogonal" else f"; no Hadamard matrix of order {n} can be built here"
    return q, f"random orthogonal of order {n}{why}"


def fold_gain_into(norm: nn.Module, readers: list[nn.Linear], offset: float) -> None:
    """Move the norm's per-channel gain (weight + offset: Gemma's norms compute x·(1 + weight)) into the columns of
    the linears that read its output, leaving the norm's gain 1."""
    gain = norm.weight.double() + offset
    for lin in readers:
        lin.weight.copy_((lin.weight.double() * gain[None, :]).to(lin.weight.dtype))
    norm.weight.fill_(1.0 - offset)


@torch.no_grad()
def rotate_input(lin: nn.Linear, q: Tensor) -> None:
    """A linear that reads the rotated residual: W -> W·Q."""
    lin.weight.copy_((lin.weight.double() @ q).to(lin.weight.dtype))


@torch.no_grad()
def rotate_output(lin: nn.Linear, q: Tensor) -> None:
    """A linear that writes into the rotated residual: W -> Qᵀ·W, b -> b·Q."""
    lin.weight.copy_((q.T @ lin.weight.double()).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() @ q).to(lin.bias.dtype))


def rotation_problem(model: nn.Module, arch) -> str | None:
    """Why the residual stream of `model` cannot be rotated (None: it can)."""
    entry = arch.rotate
    if entry is None:
        return (f"no rotation entry for model_type {arch.family!r}: add the linears that write into its residual "
                "stream to its FAMILIES entry in compress/arch/tables.py (rotate=)")
    if isinstance(entry, str):
        return entry
    return None


@torch.no_grad()
def rotate_model(model: nn.Module, arch, kind: str = "hadamard", seed: int = 0) -> dict:
    """Rotate the residual stream of `model` in place (see the module docstring); the float function is unchanged.
    Returns what was done, for the report."""
    from ..arch import get_module
    from ..arch.paths import is_tied, untie_lm_head

    if (why := rotation_problem(model, arch)) is not None:
        raise ValueError(f"cannot rotate this model: {why}")
    embed = model.get_input_embeddings()
    d = embed.weight.shape[1]
    q, what = random_rotation(d, kind, seed)
    untied = is_tied(model, arch.lm_head)
    if untied:  # the head gets the final norm's gain: it can no longer share the embedding's matrix
        untie_lm_head(model, arch.lm_head)
    embed.weight.copy_((embed.weight.double() @ q).to(embed.weight.dtype))
    readers = [(prev, balance) for prev, balance, _ in arch.awq if prev in arch.norms]
    folded, rotated = 0, 0
    for block in arch.block_list(model):
        for prev, balance in readers:
            norm, lins = get_module(block, prev), [get_module(block, n) for n in balance]
            _check_norm(norm, prev)
            fold_gain_into(norm, lins, arch.norm_offset)
            folded += 1
            for lin in lins:
                rotate_input(lin, q)
                rotated += 1
        for name in arch.rotate:
            rotate_output(get_module(block, name), q)
            rotated += 1
    final, head = get_module(model, arch.final_norm), get_module(model, arch.lm_head)
    _check_norm(final, arch.final_norm)
    fold_gain_into(final, [head], arch.norm_offset)
    rotate_input(head, q)
    return {"rotation": what, "hidden": d, "kind": kind, "seed": seed, "norms_folded": folded + 1,
            "linears_rotated": rotated + 1, "untied_lm_head": untied,
            "untied_bytes": head.weight.numel() * head.weight.element_size() if untied else 0}


def _check_norm(norm: nn.Module, name: str) -> None:
    if getattr(norm, "bias", None) is not None or not isinstance(getattr(norm, "weight", None), Tensor):
        raise ValueError(f"{name} ({type(norm).__name__}) is not an RMS norm with a gain only; the rotation cannot "
                         "pass through it")


# ---------------------------------------------------------------- the online Hadamard on the MLP's down projection

class OnlineHadamard(nn.Module):
    """x -> x·Q with Q = H·diag(signs)/√n (the randomised Hadamard of random_rotation), computed at run time on the
    input of one linear whose weight holds W·Q (fold_online_hadamard): the product is unchanged, and the linear's
    input, its activation outliers spread over all channels, is what its weight and activation quantizers see.
    `signs` is the state (saved with the checkpoint); the factors are rebuilt from the order, not saved."""

    def __init__(self, n: int, signs: Tensor | None = None, seed: int = 0):
        super().__init__()
        if signs is None:
            g = torch.Generator().manual_seed(seed)
            signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
        self.n = n
        factors, self.what = hadamard_factors(n)
        self.register_buffer("signs", signs.float().reshape(n))
        known = 1
        for f in factors:
            known *= 1 if f is None else f.shape[0]
        self.sizes = [n // known if f is None else f.shape[0] for f in factors]
        self.norm = known ** -0.5  # the Hadamard part's order: n, or a block's order when block-diagonal
        for i, f in enumerate(factors):
            self.register_buffer(f"factor{i}", None if f is None else f.float(), persistent=False)
        self.n_factors = len(factors)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        y = x.float() if dtype in (torch.bfloat16, torch.float16) else x
        lead = y.shape[:-1]
        y = y.reshape(*lead, *self.sizes)
        axis0 = len(lead)
        for i in range(self.n_factors):
            f = getattr(self, f"factor{i}")
            if f is not None:
                y = torch.movedim(torch.tensordot(y, f.to(y.dtype), dims=([axis0 + i], [0])), -1, axis0 + i)
        y = y.reshape(*lead, self.n) * (self.signs.to(y.dtype) * self.norm)
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"n={self.n}, {self.what}"


def online_rotations(model: nn.Module) -> dict[str, OnlineHadamard]:
    """Every linear of `model` that rotates its input at run time, by name."""
    return {n: m.input_rotation for n, m in model.named_modules() if isinstance(getattr(m, "input_rotation", None),
                                                                                OnlineHadamard)}


def online_rotation_problem(model: nn.Module, runtime: str) -> str | None:
    """Why `runtime` cannot run this model (its online Hadamard), or None."""
    found = online_rotations(model)
    if not found:
        return None
    return (f"{len(found)} linears ({next(iter(found))}, ...) rotate their input by an online Hadamard at run time "
            f"(rotate.online_hadamard: true), which {runtime} does not apply; without it their weights compute "
            "garbage. Use rotate.online_hadamard: false (the residual rotation alone is folded into the weights and "
            "every format holds it), or keep the compress checkpoint (OUTPUT/model: `compress eval` and `compress "
            "verify` run it)")


@torch.no_grad()
def fold_online_hadamard(linear: nn.Linear, seed: int) -> OnlineHadamard:
    """W -> W·Q, and Q applied to the input at run time: y = (xQ)(WQ)ᵀ = xWᵀ. The fold goes through the same fast
    transform, row by row in float64 (no n × n matrix is built)."""
    if type(linear) is not nn.Linear:
        raise ValueError(f"the online Hadamard needs an nn.Linear, got {type(linear).__name__}")
    rot = OnlineHadamard(linear.in_features, seed=seed).to(linear.weight.device)
    w = linear.weight
    folded = rot.double()(w.double())
    rot.float()
    w.copy_(folded.to(w.dtype))
    attach_input_rotation(linear, rot)
    return rot


def mlp_out_name(arch) -> str | None:
    """The linear that reads the MLP's intermediate activations (where QuaRot and SpinQuant's R4 put the online
    Hadamard), from the family's pruning entry."""
    return (arch.prune or {}).get("mlp_out")


@torch.no_grad()
def rotate_mlp_inputs(model: nn.Module, arch, seed: int = 0) -> dict:
    """An online Hadamard on every block's down projection input (fold_online_hadamard), one sign pattern per
    block (seed + block index)."""
    from ..arch import get_module

    name = mlp_out_name(arch)
    if name is None:
        raise ValueError(f"no MLP output linear for model_type {arch.family!r} (its FAMILIES entry's prune= "
                         "mlp_out, compress/arch/tables.py): the online Hadamard does not know where to go")
    what = None
    for i, block in enumerate(arch.block_list(model)):
        what = fold_online_hadamard(get_module(block, name), seed + 1 + i).what
    return {"online_hadamard": name, "online_order": get_module(arch.block_list(model)[0], name).in_features,
            "online_transform": what}
