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

Q is a randomised Hadamard matrix H·diag(±1)/√d (QuaRot's choice: cheap, and maximally incoherent) where one of
order d can be built here (Sylvester for 2^k, Paley I for q + 1 with q a prime ≡ 3 mod 4, Paley II for 2(q + 1) with
q a prime ≡ 1 mod 4, and Kronecker products of those: 576 = 36 · 16, 1536 = 12 · 128, 4096 = 2^12); otherwise, or
with kind: orthogonal, a random orthogonal matrix (SpinQuant's starting point, QR of a Gaussian matrix).
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor, nn


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> Tensor:
    """Q[i, j] = χ(i - j) for q prime, χ the quadratic character mod q (0, 1 on squares, -1 otherwise)."""
    chi = -torch.ones(q, dtype=torch.float64)
    chi[(torch.arange(q, dtype=torch.int64) ** 2) % q] = 1.0
    chi[0] = 0.0
    i = torch.arange(q)
    return chi[(i[:, None] - i[None, :]) % q]


def _paley1(q: int) -> Tensor:
    """Order q + 1 (q prime, q ≡ 3 mod 4): I + [[0, 1ᵀ], [-1, Q]]."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return torch.eye(q + 1, dtype=torch.float64) + s


def _paley2(q: int) -> Tensor:
    """Order 2(q + 1) (q prime, q ≡ 1 mod 4): [[0, 1ᵀ], [1, Q]] with 0 -> [[1, -1], [-1, -1]], ±1 -> ±[[1, 1], [1, -1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron((c == 0).double(), zero)


def _paley(n: int) -> tuple | None:
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return ("paley1", n - 1)
    if n % 2 == 0 and _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return ("paley2", n // 2 - 1)
    return None


@lru_cache(maxsize=None)
def _construction(n: int) -> tuple | None:
    """How to build a Hadamard matrix of order n from the constructions above, or None: a power of two; else the
    smallest Paley order m with n / m a power of two (kron with Sylvester); else Paley of order n; else a product."""
    if n == 1:
        return ("one",)
    if n & (n - 1) == 0:
        return ("sylvester", n)
    if n % 4:
        return None
    m = n
    while m % 2 == 0:
        m //= 2
    while m < n:
        m *= 2
        if m > 2 and m % 4 == 0 and _paley(m):
            return ("kron", m, n // m) if m < n else _paley(m)
    for a in range(4, int(n ** 0.5) + 1, 4):
        if n % a == 0 and _construction(a) and _construction(n // a):
            return ("kron", a, n // a)
    return None


def hadamard(n: int) -> Tensor | None:
    """A Hadamard matrix of order n (entries ±1, H Hᵀ = n I), float64; None when none can be built here."""
    how = _construction(n)
    if how is None:
        return None
    if how[0] == "one":
        return torch.ones(1, 1, dtype=torch.float64)
    if how[0] == "sylvester":
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h
    if how[0] == "paley1":
        return _paley1(how[1])
    if how[0] == "paley2":
        return _paley2(how[1])
    return torch.kron(hadamard(how[1]), hadamard(how[2]))


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


def _describe(n: int) -> str:
    how = _construction(n)
    if how[0] == "kron":
        return f"{_describe(how[1])} ⊗ {_describe(how[2])}"
    return {"one": "1", "sylvester": f"Sylvester {n}", "paley1": f"Paley I {n}", "paley2": f"Paley II {n}"}[how[0]]


# ---------------------------------------------------------------- folding into a model

@torch.no_grad()
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
    from .arch.tables import ROTATE_TABLE

    entry = ROTATE_TABLE.get(arch.family)
    if entry is None:
        return (f"no rotation entry for model_type {arch.family!r}: add the linears that write into its residual "
                "stream to ROTATE_TABLE in compress/arch/tables.py")
    if isinstance(entry, str):
        return entry
    return None


@torch.no_grad()
def rotate_model(model: nn.Module, arch, kind: str = "hadamard", seed: int = 0) -> dict:
    """Rotate the residual stream of `model` in place (see the module docstring); the float function is unchanged.
    Returns what was done, for the report."""
    from .arch import get_module
    from .arch.tables import ROTATE_TABLE
    from .stages.quantize import _is_tied, untie_lm_head

    if (why := rotation_problem(model, arch)) is not None:
        raise ValueError(f"cannot rotate this model: {why}")
    embed = model.get_input_embeddings()
    d = embed.weight.shape[1]
    q, what = random_rotation(d, kind, seed)
    untied = _is_tied(model, arch.lm_head)
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
        for name in ROTATE_TABLE[arch.family]:
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
