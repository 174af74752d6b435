"""Number formatting shared by the markdown reports (a missing value prints as an em dash)."""
from __future__ import annotations


def mb(n) -> str:
    return "—" if n is None else f"{n / 1e6:,.1f} MB"


def num(x, fmt: str = "{:.4f}") -> str:
    return "—" if x is None else fmt.format(x)
