"""Trellis-coded weights (QTIP-style, Tseng et al. 2024, arXiv:2406.11235): the format, its storage and its decode.

A weight matrix W [m, n] is stored as W = Q_out · diag(scale) · C · Q_inᵀ, where Q_out, Q_in are randomised Hadamard
transforms (their ±1 signs stored), `scale` one float16 per row, and C [m, n] the decoded trellis codes: C is cut
into tiles of tile × tile weights, and each tile's T = tile² values, row by row, are the walk of a bit-shift trellis
of L state bits: s_t = ((s_{t-1} << k) | b_t) mod 2^L, value cb[s_t]. Each step spends k bits (the format's bits per
weight); a tile also stores its first state s_0 (16 bits), so a tile costs 16 + (T - 1)·k bits.

The codebook is computed, not stored: cb[s] is the sum of the four bytes of (a·s + b) mod 2^32, centred and
normalised (QTIP's "1MAD": an Irwin-Hall sum of four near-uniform bytes, close to a unit Gaussian, which is what the
Hadamard transforms make a weight matrix's entries look like). The encoder (quantizers/trellis.py) finds the walk
nearest each tile (Viterbi, kernels/trellis.c) inside an LDLQ / GPTQ loop over 16-column blocks.

`TrellisTensor` is a QuantizedTensor whose qdata holds the tiles' bytes; `TrellisLinear` is the QuantLinear that
holds one: every part of compress that sizes, caches or dequantizes a QuantLinear handles it through `qtensor()`,
and every exporter except compress's own checkpoint refuses it (no engine reads these codes).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .hadamard import rotate_by
from .nn import QuantLinear, linear_shape
from .qtensor import QuantizedTensor, pack_codes, unpack_codes
from .scheme import QuantScheme

LCG_A, LCG_B = 34038481, 76625530  # QTIP's 1MAD constants
_BYTE_SUM_STD = math.sqrt(4 * (256 ** 2 - 1) / 12)  # the sum of four uniform bytes: mean 510, this std
START_BYTES = 2  # s_0 of a tile, little end first


@dataclass(frozen=True)
class TrellisFormat:
    """bits: k, the bits each weight costs (2, 3 or 4); state_bits: L, the trellis's memory (more: closer to the
    Gaussian rate-distortion bound, 2^L work per weight to encode; at most 16, the stored start state's width);
    tile: the tile side (T = tile² weights per walk, the unit of the LDLQ blocks)."""

    bits: int = 2
    state_bits: int = 12
    tile: int = 16

    def __post_init__(self):
        for name in ("bits", "state_bits", "tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"trellis {name} must be an integer, got {v!r}")
        if self.bits not in (2, 3, 4):
            raise ValueError(f"trellis bits={self.bits}: 2, 3 or 4 bits per weight")
        if not self.bits < self.state_bits <= 16:
            raise ValueError(f"trellis state_bits={self.state_bits}: more than bits ({self.bits}) and at most 16 "
                             "(12 encodes fast on a CPU; 16 is QTIP's)")
        if not 2 <= self.tile <= 64:
            raise ValueError(f"trellis tile={self.tile}: between 2 and 64 (16: 256 weights per walk)")

    @property
    def steps(self) -> int:
        """T: the weights of one tile (one walk)."""
        return self.tile * self.tile

    @property
    def tile_bytes(self) -> int:
        """Bytes of one stored tile: the start state, then T - 1 steps of `bits` bits."""
        return START_BYTES + math.ceil((self.steps - 1) * self.bits / 8)

    @property
    def bits_per_weight(self) -> float:
        """What a weight costs in the tiles alone (the row scales and signs come on top)."""
        return 8 * self.tile_bytes / self.steps

    @property
    def name(self) -> str:
        return f"int{self.bits}-trellis-L{self.state_bits}-t{self.tile}"

    def to_dict(self) -> dict:
        return asdict(self)


@functools.lru_cache(maxsize=8)
def _codebook(state_bits: int) -> Tensor:
    s = torch.arange(1 << state_bits, dtype=torch.int64)
    x = (s * LCG_A + LCG_B) % (1 << 32)
    total = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return ((total.double() - 510.0) / _BYTE_SUM_STD).float()


def codebook(fmt: TrellisFormat, device=None) -> Tensor:
    """cb [2^L] float32: the value of every trellis state."""
    cb = _codebook(fmt.state_bits)
    return cb if device is None else cb.to(device)


def pack_tiles(start: Tensor, steps: Tensor, fmt: TrellisFormat) -> Tensor:
    """start [S] (states < 2^L) and steps [S, T - 1] (k-bit choices) -> uint8 [S, tile_bytes]."""
    s0 = start.to(torch.int64)
    head = torch.stack([s0 & 0xFF, (s0 >> 8) & 0xFF], dim=1).to(torch.uint8)
    return torch.cat([head, pack_codes(steps.to(torch.uint8), fmt.bits)], dim=1).contiguous()


def unpack_tiles(qdata: Tensor, fmt: TrellisFormat) -> tuple[Tensor, Tensor]:
    """pack_tiles' inverse: (start int64 [S], steps int64 [S, T - 1])."""
    start = qdata[:, 0].to(torch.int64) | (qdata[:, 1].to(torch.int64) << 8)
    steps = unpack_codes(qdata[:, START_BYTES:], fmt.bits, fmt.steps - 1).to(torch.int64)
    return start, steps


def walk_states(start: Tensor, steps: Tensor, fmt: TrellisFormat) -> Tensor:
    """The states of every tile's walk, int64 [S, T], computed for all steps at once (any device): s_t is the last L
    bits of the stream s_0, b_1, ..., b_t, so it is the sum of the last P = ⌈L / k⌉ k-bit chunks of that stream, each
    shifted into place (s_0 written as P chunks of its own), masked to L bits."""
    k, mask = fmt.bits, (1 << fmt.state_bits) - 1
    p = -(-fmt.state_bits // k)
    s0 = start.to(torch.int64)[:, None]
    chunks = torch.cat([(s0 >> (k * (p - 1 - j))) & ((1 << k) - 1) for j in range(p)], dim=1)
    stream = torch.cat([chunks, steps.to(torch.int64)], dim=1)  # [S, P + T - 1]
    t = fmt.steps
    states = torch.zeros(start.shape[0], t, dtype=torch.int64, device=start.device)
    for i in range(p):  # chunk P - 1 + t - i lands i * k bits up in s_t
        states |= stream[:, p - 1 - i:p - 1 - i + t] << (i * k)
    return states & mask


def to_tiles(w: Tensor, tile: int) -> Tensor:
    """[m, n] -> [m/tile · n/tile, tile²]: tiles in row-major order, each one's weights row by row."""
    m, n = w.shape
    return w.reshape(m // tile, tile, n // tile, tile).permute(0, 2, 1, 3).reshape(-1, tile * tile)


def from_tiles(t: Tensor, m: int, n: int, tile: int) -> Tensor:
    """to_tiles' inverse."""
    return t.reshape(m // tile, n // tile, tile, tile).permute(0, 2, 1, 3).reshape(m, n)


def trellis_scheme(fmt: TrellisFormat) -> QuantScheme:
    """The QuantScheme a trellis layer reports (its bits per weight, one float16 scale per row)."""
    return QuantScheme(dtype=f"int{fmt.bits}", granularity="channel", group_size=None, symmetric=True)


@dataclass
class TrellisTensor(QuantizedTensor):
    """A trellis-coded weight: qdata uint8 [tiles, fmt.tile_bytes], scale float16 [m, 1], the Hadamard signs int8
    (signs_in [n], signs_out [m]); `scheme` is trellis_scheme(fmt)."""

    fmt: TrellisFormat | None = None
    signs_in: Tensor | None = None
    signs_out: Tensor | None = None
    unscaled: Tensor | None = None  # C · Q_inᵀ float32 [m, n], kept by decoded_walks (the walks decoded once)

    def __post_init__(self):
        if self.fmt is None or self.signs_in is None or self.signs_out is None:
            raise ValueError("a TrellisTensor needs its format and both Hadamard sign vectors")
        m, n = self.shape
        t = self.fmt.tile
        if m % t or n % t:
            raise ValueError(f"a {m} x {n} weight is not whole {t} x {t} trellis tiles")
        if tuple(self.qdata.shape) != ((m // t) * (n // t), self.fmt.tile_bytes):
            raise ValueError(f"trellis codes {tuple(self.qdata.shape)} do not fit a {m} x {n} weight in "
                             f"{self.fmt}")

    def walks(self) -> Tensor:
        """C: the decoded walks, float32 [m, n] (the rotated weight before its row scales)."""
        start, steps = unpack_tiles(self.qdata, self.fmt)
        values = codebook(self.fmt, self.qdata.device)[walk_states(start, steps, self.fmt)]
        return from_tiles(values, *self.shape, self.fmt.tile)

    def decoded(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """diag(scale) · C: the weight in the rotated basis, [m, n]."""
        return (self.walks() * self.scale.float()).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """W = Q_out · diag(scale) C · Q_inᵀ, both rotations by the fast transform (the first one kept, with the
        decoded walks, where decoded_walks holds C · Q_inᵀ: the same weight up to float32 rounding)."""
        if self.unscaled is not None:
            right = self.unscaled * self.scale.float()  # diag(scale) (C Q_inᵀ)
        else:
            right = rotate_by(self.decoded(), self.signs_in, transpose=True)  # (diag(scale) C) Q_inᵀ
        return rotate_by(right.T, self.signs_out, transpose=True).T.contiguous().to(dtype)

    def codes(self) -> Tensor:
        raise ValueError("trellis codes are walks of a trellis, not integer codes on a grid: only compress's own "
                         "checkpoint and its decode read them")

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        raise ValueError("a trellis-coded weight is rotated across its rows: it cannot be sliced by rows")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qdata, self.scale, self.signs_in, self.signs_out))


class TrellisLinear(QuantLinear):
    """A QuantLinear whose weight is a TrellisTensor: dequantize+matmul in forward (the QuantLinear path); the
    dispatcher's `trellis rows` kernel (kernels/trellis.py) decodes the tiles as it reads them, for 1..16 rows on
    the CPU."""

    def __init__(self, in_features: int, out_features: int, fmt: TrellisFormat, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        t = fmt.tile
        if in_features % t or out_features % t:
            raise ValueError(f"a {out_features} x {in_features} layer is not whole {t} x {t} trellis tiles")
        super().__init__(in_features, out_features, trellis_scheme(fmt), bias=bias, dtype=dtype, device="meta")
        if bias and device != "meta":
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        self.trellis = fmt
        tiles = (out_features // t) * (in_features // t)
        self.qdata = torch.zeros(tiles, fmt.tile_bytes, dtype=torch.uint8, device=device)
        self.scale = torch.ones(out_features, 1, dtype=torch.float16, device=device)
        self.register_buffer("signs_in", torch.ones(in_features, dtype=torch.int8, device=device))
        self.register_buffer("signs_out", torch.ones(out_features, dtype=torch.int8, device=device))
        self._unscaled: Tensor | None = None  # set only inside decoded_walks()

    @classmethod
    def from_module(cls, module, qt: TrellisTensor) -> "TrellisLinear":
        out_features, in_features = linear_shape(module)
        if qt.shape != (out_features, in_features):
            raise ValueError(f"trellis shape {qt.shape} does not match the layer's {(out_features, in_features)}")
        layer = cls(in_features, out_features, qt.fmt, bias=False, device="meta")
        layer.qdata, layer.scale, layer.signs_in, layer.signs_out = qt.qdata, qt.scale, qt.signs_in, qt.signs_out
        if module.bias is not None:
            layer.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
        return layer

    def qtensor(self) -> TrellisTensor:
        return TrellisTensor(self.qdata, self.scale, None, self.scheme, (self.out_features, self.in_features), None,
                             self.trellis, self.signs_in, self.signs_out, self._unscaled)

    @property
    def kernel(self) -> str:
        return "trellis: decode+matmul"

    def extra_repr(self) -> str:
        f = self.trellis
        rank = f", rank={self.rank}" if self.rank else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, trellis k={f.bits} "
                f"L={f.state_bits} tile={f.tile}{rank}")


@contextlib.contextmanager
def decoded_walks(layers: list[TrellisLinear]):
    """Within the block each of `layers` keeps C · Q_inᵀ (float32, its walks decoded and rotated once), so that a
    dequantization is a row scaling and the output rotation: for training the row scales, which change while the
    walks do not (distill/scale_tuning.py; one float32 copy of each weight, what the training's dequantized weights
    hold anyway). Dropped on exit."""
    try:
        for layer in layers:
            layer._unscaled = rotate_by(layer.qtensor().walks(), layer.signs_in, transpose=True)
        yield
    finally:
        for layer in layers:
            layer._unscaled = None
