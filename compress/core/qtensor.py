"""QuantizedTensor: packed integer codes + scales, and the bit packing they use.

Packing: codes are shifted to unsigned u = q - qmin in [0, 2**b - 1] and packed along
in_features, little end first. A word of lcm(b, 8) bits holds lcm(b, 8) / b codes:
int8 -> 1 code/byte, int4 -> 2 codes/byte (low nibble first), int2 -> 4 codes/byte,
int3 -> 8 codes in 3 bytes. Rows are padded with zero codes up to a whole word.

Microscaling formats keep the layout the engines read: fp4 e2m1 codes two per byte, the even element in the low
nibble (microscale.pack_nibbles), their block scales encoded (NVFP4: float8_e4m3fn, with the fp32 `global_scale`;
MX: uint8 e8m0 exponents), MXFP8 values as float8_e4m3fn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .microscale import decode_e2m1, decode_e8m0, encode_e2m1, encode_e8m0, pack_nibbles, round_e4m3, unpack_nibbles
from .primitives import FP8_DTYPES, dequantize_affine
from .scheme import QuantScheme


def _word(bits: int) -> tuple[int, int]:
    """(codes per word, bytes per word)."""
    word_bits = math.lcm(bits, 8)
    return word_bits // bits, word_bits // 8


def _word_dtype(bits: int) -> torch.dtype:
    """int32 holds a word of up to 24 bits (int3, int6); int5's 40 and int7's 56 need int64."""
    return torch.int32 if math.lcm(bits, 8) <= 31 else torch.int64


def pack_codes(u: Tensor, bits: int) -> Tensor:
    """Pack unsigned codes [..., K] (values < 2**bits) into uint8 [..., ceil(K / cpw) * bpw]."""
    codes_per_word, bytes_per_word = _word(bits)
    k = u.shape[-1]
    if bits in (2, 4, 8):  # byte-aligned: shift and add in uint8 (the same bytes as the word path, 4x faster)
        u = torch.nn.functional.pad(u.to(torch.uint8), (0, (-k) % codes_per_word))
        u = u.reshape(*u.shape[:-1], -1, codes_per_word)  # [..., B, per_byte]
        packed = u[..., 0].clone()
        for j in range(1, codes_per_word):
            packed |= u[..., j] << (j * bits)
        return packed
    pad = (-k) % codes_per_word
    wide = _word_dtype(bits)
    u = torch.nn.functional.pad(u.to(wide), (0, pad))
    u = u.reshape(*u.shape[:-1], -1, codes_per_word)  # [..., W, cpw]
    shifts = torch.arange(codes_per_word, device=u.device, dtype=wide) * bits
    word = (u << shifts).sum(dim=-1, dtype=wide)  # [..., W]
    byte_shifts = torch.arange(bytes_per_word, device=u.device, dtype=wide) * 8
    packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., W, bpw]
    return packed.to(torch.uint8).reshape(*u.shape[:-2], -1)


def unpack_codes(packed: Tensor, bits: int, k: int) -> Tensor:
    """Inverse of pack_codes: uint8 [..., B] -> unsigned codes [..., k] (uint8 for 8/4/2 bits, else int32)."""
    if bits == 8:
        return packed[..., :k]
    if bits in (4, 2):  # byte-aligned: shift uint8 directly, this runs on every forward of a QuantLinear
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
        u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., B, per_byte]
        return u.reshape(*packed.shape[:-1], -1)[..., :k]
    codes_per_word, bytes_per_word = _word(bits)
    wide = _word_dtype(bits)
    p = packed.to(wide).reshape(*packed.shape[:-1], -1, bytes_per_word)  # [..., W, bpw]
    byte_shifts = torch.arange(bytes_per_word, device=p.device, dtype=wide) * 8
    word = (p << byte_shifts).sum(dim=-1, dtype=wide)  # [..., W]
    shifts = torch.arange(codes_per_word, device=p.device, dtype=wide) * bits
    u = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, cpw]
    return u.reshape(*p.shape[:-2], -1)[..., :k].to(torch.int32)


def _pack_rows(q: Tensor, scheme: QuantScheme, rows: int = 256) -> Tensor:
    """pack_codes of q - qmin (q: integer codes in any dtype that holds them exactly), `rows` rows at a time, so
    the int32 temporaries stay small beside a large weight (a 7B down_proj's codes are 180 MB as int32)."""
    flat = q.reshape(-1, q.shape[-1])
    as_is = q.dtype == torch.uint8 and scheme.qmin == 0  # asymmetric codes are already unsigned
    parts = [pack_codes(flat[r:r + rows] if as_is else flat[r:r + rows].to(torch.int32) - scheme.qmin, scheme.bits)
             for r in range(0, len(flat), rows)]
    return torch.cat(parts).reshape(*q.shape[:-1], -1)


def _plain_int8(scheme: QuantScheme) -> bool:
    return scheme.dtype == "int8" and scheme.symmetric


DEQUANTIZE_ROWS = 128  # rows dequantized at a time (QuantizedTensor.dequantize)
SLICED_FROM = 1 << 22  # weights of fewer elements are dequantized whole (their temporaries fit the cache anyway)


@dataclass
class QuantizedTensor:
    """A quantized [out, in] weight in one plain layout (kernel layouts come from a prepack step)."""

    # uint8 [out, packed_in]: packed unsigned codes. Two formats keep their values as they are, because that
    # is what the matmuls read: symmetric int8 (int8 [out, in] codes) and fp8 (float8 [out, in] values).
    qdata: Tensor
    scale: Tensor  # [] | [out, 1] | [out, in // group_size] | [out // B, in // B], in scheme.scale_dtype
    zero_point: Tensor | None  # scheme.zero_point_dtype (uint8; float16: fractional), shape of scale; None: symmetric
    scheme: QuantScheme
    shape: tuple[int, int]
    global_scale: Tensor | None = None  # NVFP4: fp32 [] (448 * 6 / amax); the effective scale is scale / global

    @classmethod
    def from_codes(cls, q: Tensor, scale: Tensor, zero_point: Tensor | None, scheme: QuantScheme,
                   global_scale: Tensor | None = None) -> "QuantizedTensor":
        """q and scale as compute_qparams / quantize_affine give them (the scale effective, in float)."""
        if scheme.is_micro:
            return cls._from_micro(q, scale, scheme, global_scale)
        if scheme.is_float:  # real float8 tensors, nothing to pack
            if q.dtype != FP8_DTYPES[scheme.dtype]:
                raise ValueError(f"{scheme.dtype} values must be {FP8_DTYPES[scheme.dtype]}, got {q.dtype}")
            return cls(q.contiguous(), scale.to(getattr(torch, scheme.scale_dtype)), None, scheme, tuple(q.shape))
        if _plain_int8(scheme):
            return cls(q.to(torch.int8).contiguous(), scale.to(getattr(torch, scheme.scale_dtype)), None, scheme,
                       tuple(q.shape))
        return cls(
            qdata=_pack_rows(q, scheme),
            scale=scale.to(getattr(torch, scheme.scale_dtype)),
            zero_point=None if zero_point is None else zero_point.to(getattr(torch, scheme.zero_point_dtype)),
            scheme=scheme,
            shape=tuple(q.shape),
        )

    @classmethod
    def _from_micro(cls, q: Tensor, scale: Tensor, scheme: QuantScheme, g: Tensor | None) -> "QuantizedTensor":
        if scheme.has_global_scale:
            if g is None:
                raise ValueError(f"{scheme.name}: NVFP4 needs the tensor's global scale (primitives.global_scale)")
            g = g.detach().float().reshape(()).clone()
            # the effective scale is fl(e4m3 / g); times g it is within an fp32 ulp of the e4m3 value, which the
            # e4m3 rounding recovers exactly
            stored = round_e4m3(scale.float() * g).to(torch.float8_e4m3fn)
        else:
            stored = encode_e8m0(torch.round(torch.log2(scale.float())))
        if scheme.dtype == "fp4_e2m1":
            qdata = pack_nibbles(encode_e2m1(q.float()))
        elif q.dtype == FP8_DTYPES[scheme.dtype]:
            qdata = q.contiguous()
        else:
            raise ValueError(f"{scheme.dtype} values must be {FP8_DTYPES[scheme.dtype]}, got {q.dtype}")
        return cls(qdata.contiguous(), stored.contiguous(), None, scheme, tuple(q.shape), g)

    @classmethod
    def cat_rows(cls, parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """One tensor from row slices quantized apart (same scheme, same global scale): what quantizing the whole
        gives when the scheme's scales are per row or per group of a row."""
        first = parts[0]
        if first.scheme.granularity not in ("group", "channel"):
            raise ValueError(f"cat_rows joins per-row scales; {first.scheme.granularity} scales span rows")
        return cls(torch.cat([p.qdata for p in parts]), torch.cat([p.scale for p in parts]),
                   None if first.zero_point is None else torch.cat([p.zero_point for p in parts]), first.scheme,
                   (sum(p.shape[0] for p in parts), first.shape[1]), first.global_scale)

    def scale_float(self) -> Tensor:
        """The effective float32 scale: w = code value x scale_float (block scales decoded, NVFP4's divided by the
        tensor's global scale)."""
        if self.scheme.scale_dtype == "e8m0":
            return decode_e8m0(self.scale)
        if self.scheme.has_global_scale:
            return self.scale.float() / self.global_scale.float()
        return self.scale.float()

    def codes(self) -> Tensor:
        """Signed (symmetric) or unsigned (asymmetric) integer codes, int32 [out, in]; fp8: the float8 values;
        fp4 e2m1: the values as float32."""
        if self.scheme.dtype == "fp4_e2m1":
            return decode_e2m1(unpack_nibbles(self.qdata))[:, :self.shape[1]]
        if self.scheme.is_float:
            return self.qdata
        if _plain_int8(self.scheme):
            return self.qdata.to(torch.int32)
        return unpack_codes(self.qdata, self.scheme.bits, self.shape[1]).to(torch.int32) + self.scheme.qmin

    def rows(self, start: int, stop: int) -> "QuantizedTensor":
        """Rows start:stop (views) of a tensor whose scales are per row or per group of a row (cat_rows' inverse)."""
        if self.scheme.granularity not in ("group", "channel"):
            raise ValueError(f"rows slices per-row scales; {self.scheme.granularity} scales span rows")
        stop = min(stop, self.shape[0])
        return QuantizedTensor(self.qdata[start:stop], self.scale[start:stop],
                               None if self.zero_point is None else self.zero_point[start:stop], self.scheme,
                               (stop - start, self.shape[1]), self.global_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight [out, in] in `dtype`: on the CPU, row slices at a time where the scales are per row or per
        group (a slice's temporaries stay in the cache: 0.38 s -> 0.16 s for a 7B gate_proj, bit for bit the same)."""
        rows = DEQUANTIZE_ROWS
        if self.scheme.granularity not in ("group", "channel") or self.shape[0] * self.shape[1] < SLICED_FROM or \
                self.qdata.is_cuda:
            return self._dequantize(dtype)
        out = torch.empty(self.shape, dtype=dtype, device=self.qdata.device)
        for r in range(0, self.shape[0], rows):
            out[r:r + rows] = self.rows(r, r + rows)._dequantize(dtype)
        return out

    def _dequantize(self, dtype: torch.dtype) -> Tensor:
        if self.scheme.is_micro:
            return dequantize_affine(self.codes(), self.scale_float(), None, self.scheme, dtype)
        if self.scheme.is_float or _plain_int8(self.scheme):
            return dequantize_affine(self.qdata, self.scale, None, self.scheme, dtype)
        u = unpack_codes(self.qdata, self.scheme.bits, self.shape[1])
        # Fold the symmetric offset into the zero point: w = (u - z) * s with z = -qmin for symmetric grids.
        zero = self.zero_point if self.zero_point is not None else \
            torch.full((), -self.scheme.qmin, dtype=torch.float32, device=u.device).expand(self.scale.shape)
        return dequantize_affine(u, self.scale, zero, self.scheme, dtype)

    @property
    def nbytes(self) -> int:
        tensors = [self.qdata, self.scale] + [t for t in (self.zero_point, self.global_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)
