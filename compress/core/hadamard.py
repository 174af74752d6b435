"""Hadamard matrices: H of order n (entries ±1, H Hᵀ = n I) from Sylvester's and Paley's constructions and their
Kronecker products, their factors for a fast transform, and x·Q for the randomised Hadamard Q = H·diag(signs)/√n.
The numbers only: transforms/rotation.py folds them into a model (QuaRot) or applies them at run time
(OnlineHadamard), core/trellis.py makes trellis-coded weights incoherent with them."""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor


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


def _describe(n: int) -> str:
    how = _construction(n)
    if how[0] == "kron":
        return f"{_describe(how[1])} ⊗ {_describe(how[2])}"
    return {"one": "1", "sylvester": f"Sylvester {n}", "paley1": f"Paley I {n}", "paley2": f"Paley II {n}"}[how[0]]


# ---------------------------------------------------------------- folding into a model

@torch.no_grad()
def hadamard_factors(n: int) -> tuple[list[Tensor | None], str]:
    """Factors F_1..F_k (float64, entries ±1, or None for an identity block) whose Kronecker product is a Hadamard
    matrix of order n, or block-diagonal Hadamard when none of order n can be built here (I_m ⊗ H_{2^j}, n = m·2^j:
    orthogonal, incoherent within each block of 2^j channels), and what they are. Applied one axis at a time, x·H
    costs n·Σ n_i multiply-adds per token instead of n² (QuaRot's fast Hadamard transform does the same with a
    butterfly)."""
    def split(order: int) -> list[int]:
        how = _construction(order)
        return split(how[1]) + split(how[2]) if how[0] == "kron" else [order]

    if _construction(n) is not None:
        orders = split(n)
        return [hadamard(o) for o in orders], " ⊗ ".join(_describe(o) for o in orders)
    p = n & -n  # the largest power of two dividing n
    if p < 2:
        raise ValueError(f"no Hadamard transform of order {n} can be built here (an odd order)")
    return [None, hadamard(p)], f"block-diagonal: {n // p} blocks of Sylvester {p} (no Hadamard matrix of order {n})"


@lru_cache(maxsize=32)
def _fast_parts(n: int) -> tuple[list[int], list[Tensor | None], float]:
    factors, _ = hadamard_factors(n)
    known = math.prod(1 if f is None else f.shape[0] for f in factors)
    sizes = [n // known if f is None else f.shape[0] for f in factors]
    return sizes, [None if f is None else f.float() for f in factors], known ** -0.5


def rotate_by(x: Tensor, signs: Tensor, transpose: bool = False) -> Tensor:
    """x [..., n] times Q (or Qᵀ), Q = H·diag(signs)/√n (the block's order where H is block-diagonal:
    hadamard_factors), by the Kronecker factors of H one axis at a time: n·Σ nᵢ multiply-adds per row instead of n².
    In float64 for float64 x, else float32, also under autocast (the trellis weights tune_scales trains)."""
    with torch.autocast(x.device.type, enabled=False):  # under autocast the factors' products would mix dtypes
        return _rotate_by(x, signs, transpose)


def _rotate_by(x: Tensor, signs: Tensor, transpose: bool) -> Tensor:
    n = signs.numel()
    sizes, factors, norm = _fast_parts(n)
    lead = x.shape[:-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = signs.to(dtype) * norm
    y = x.to(dtype) * s if transpose else x.to(dtype)
    y = y.reshape(*lead, *sizes)
    axis0 = len(lead)
    for i, f in enumerate(factors):
        if f is not None:
            f = f.to(y.device, dtype)
            y = torch.movedim(torch.tensordot(y, f.T if transpose else f, dims=([axis0 + i], [0])), -1, axis0 + i)
    y = y.reshape(*lead, n)
    return y if transpose else y * s


def rotated(x: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """Q_leftᵀ · x · Q_right for x [m, n] (Q of the sign vectors `left` [m], `right` [n]), by the fast transform."""
    return rotate_by(rotate_by(x, right).T, left).T
