"""QuantScheme: the numeric format of a quantized weight, and named presets.

A scheme says only *what* the stored numbers are (bit width, grid, granularity). How the
numbers are chosen (RTN, AWQ, GPTQ) is an algorithm knob and lives in the stage config.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
SCALE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight format.

    granularity  scale shape for a weight [out, in]
    -----------  ------------------------------------
    tensor       []                (one scale)
    channel      [out, 1]          (one per output row)
    group        [out, in // group_size]

    symmetric=True is absmax scaling: q = round(w / s), s = absmax / (2**(b-1) - 1),
    codes in [-2**(b-1), 2**(b-1) - 1]. symmetric=False is zero-point (min/max) scaling:
    q = round(w / s) + z, s = (max - min) / (2**b - 1), codes in [0, 2**b - 1]; the range
    always contains 0 so that zero weights stay exact.
    """

    dtype: Literal["int8", "int4", "int3", "int2"] = "int4"
    granularity: Literal["tensor", "channel", "group"] = "group"
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"

    def __post_init__(self):
        if self.dtype not in BITS:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(BITS)}")
        if self.granularity not in ("tensor", "channel", "group"):
            raise ValueError(f"granularity={self.granularity!r}; use 'tensor', 'channel' or 'group'")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r}; use one of {list(SCALE_DTYPES)}")
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
                raise ValueError(f"granularity='group' needs an integer group_size >= 2, got {self.group_size!r}"
                                 " (common: 32, 64, 128)")
        elif self.group_size is not None:
            # A group size with another granularity is almost always a typo in a recipe: refuse it.
            raise ValueError(f"group_size={self.group_size} only applies to granularity='group' "
                             f"(got granularity={self.granularity!r}); remove group_size or set granularity: group")

    @property
    def bits(self) -> int:
        return BITS[self.dtype]

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2 ** self.bits - 1

    @property
    def name(self) -> str:
        gran = {"tensor": "tensor", "channel": "channel"}.get(self.granularity, f"g{self.group_size}")
        return f"{self.dtype}-{gran}-{'sym' if self.symmetric else 'asym'}"

    def to_dict(self) -> dict:
        return asdict(self)


def scheme(dtype: str, granularity: str = "group", group_size: int | None = 128, symmetric: bool = True,
           scale_dtype: str = "float16") -> QuantScheme:
    """Build a scheme, dropping group_size when the granularity is not 'group'."""
    return QuantScheme(dtype, granularity, group_size if granularity == "group" else None, symmetric, scale_dtype)


def replace_granularity(s: QuantScheme, granularity: str, group_size: int | None = None) -> QuantScheme:
    """The same format with another granularity (e.g. one group seen as a channel)."""
    return replace(s, granularity=granularity, group_size=group_size if granularity == "group" else None)


# Presets. Names follow compressed-tensors where one exists, so vLLM docs apply.
W4A16 = QuantScheme("int4", "group", 128, True)
W4A16_G64 = replace(W4A16, group_size=64)  # SmolLM2-135M: 576 % 128 != 0
W4A16_ASYM_G64 = replace(W4A16_G64, symmetric=False)
W8A16 = QuantScheme("int8", "channel", None, True)
W8A16_ASYM = replace(W8A16, symmetric=False)
W3A16_G64 = QuantScheme("int3", "group", 64, True)

PRESETS: dict[str, QuantScheme] = {
    "W4A16": W4A16,
    "W4A16_G64": W4A16_G64,
    "W4A16_ASYM_G64": W4A16_ASYM_G64,
    "W8A16": W8A16,
    "W8A16_ASYM": W8A16_ASYM,
    "W3A16_G64": W3A16_G64,
}


def get_preset(name: str) -> QuantScheme:
    if name not in PRESETS:
        raise ValueError(f"unknown scheme preset {name!r}; known presets: {sorted(PRESETS)} "
                         "(or give a mapping: {dtype: int4, granularity: group, group_size: 64, symmetric: true})")
    return PRESETS[name]
