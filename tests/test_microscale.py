"""Microscaling formats (NVFP4, MXFP4, MXFP8): the e2m1 grid, e4m3 and e8m0 block scales, bit for bit against
table-driven references over every representable value and every tie, and against compressed-tensors' own
functions where it has them."""
from __future__ import annotations

import math

import pytest
import torch

from compress.core import microscale as mx
from compress.core.primitives import compute_qparams, fake_quantize_activation, global_scale, quantize_affine
from compress.core.qtensor import QuantizedTensor
from compress.quantizers.rtn import quantize_rtn
from compress.core.scheme import MXFP4, MXFP4A16, MXFP8, MXFP8A16, NVFP4, NVFP4A16, W4A4_INT, ActScheme, QuantScheme

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_round_e2m1(x: float) -> float:
    """Nearest e2m1 value by brute force over the table; ties to the even index (the even mantissa); beyond 6: 6."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))
    return math.copysign(E2M1[best], x)


def e4m3_table() -> list[float]:
    """Every finite non-negative float8_e4m3fn value, by decoding the bit patterns (not by torch's cast)."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


E4M3 = e4m3_table()


def ref_round_e4m3(x: float) -> float:
    a = min(abs(x), 448.0)
    best = min(range(len(E4M3)), key=lambda i: (abs(E4M3[i] - a), i % 2))  # index parity = mantissa parity
    return math.copysign(E4M3[best], x)


def probes(values: list[float]) -> list[float]:
    """Every value, every midpoint between neighbours (the ties), the float32 neighbours of each midpoint, and
    values past the top, with both signs."""
    out = []
    for lo, hi in zip(values, values[1:]):
        mid = (lo + hi) / 2
        out += [lo, mid, float(torch.nextafter(torch.tensor(mid), torch.tensor(-1.0))),
                float(torch.nextafter(torch.tensor(mid), torch.tensor(1e9)))]
    out += [values[-1], values[-1] * 1.01, values[-1] * 7, 1e30]
    return out + [-v for v in out]


def test_e2m1_rounds_every_value_and_tie_to_nearest_even_with_saturation():
    xs = probes(E2M1)
    got = mx.round_e2m1(torch.tensor(xs)).tolist()
    assert got == [ref_round_e2m1(x) for x in xs]
    assert mx.round_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == \
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # compressed-tensors' cast_to_fp4 ties, spelled out
    assert math.isnan(float(mx.round_e2m1(torch.tensor([math.nan]))))
    assert torch.signbit(mx.round_e2m1(torch.tensor([-0.1]))).item()  # -0 keeps its sign


def test_e2m1_codes_round_trip_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    values = mx.decode_e2m1(codes)
    assert values.tolist() == E2M1 + [-v for v in E2M1]
    assert torch.equal(mx.encode_e2m1(values), codes)  # including -0 -> 0b1000


def test_nibble_packing_matches_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    torch.manual_seed(0)
    values = mx.round_e2m1(torch.randn(8, 32) * 3)
    ours = mx.pack_nibbles(mx.encode_e2m1(values))
    assert torch.equal(ours, helpers.pack_fp4_to_uint8(values))
    assert ours[0, 0] == (mx.encode_e2m1(values[0, 0:1]) | (mx.encode_e2m1(values[0, 1:2]) << 4))  # even: low
    assert torch.equal(helpers.unpack_fp4_from_uint8(ours, 8, 32, torch.float32), values)
    assert torch.equal(mx.decode_e2m1(mx.unpack_nibbles(ours)), values)


def test_e4m3_block_scale_rounds_every_value_and_tie():
    xs = probes(E4M3)
    got = mx.round_e4m3(torch.tensor(xs, dtype=torch.float64).float()).tolist()
    want = [ref_round_e4m3(float(torch.tensor(x).float())) for x in xs]
    assert got == want


def test_e8m0_codes_and_shared_exponent():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = mx.decode_e8m0(codes)
    assert [float(x) for x in v[:255]] == [2.0 ** (c - 127) for c in range(255)] and math.isnan(float(v[255]))
    assert torch.equal(mx.encode_e8m0(torch.arange(-127, 128)), torch.arange(255).to(torch.uint8))

    def ref_exponent(amax: float, mantissa: int, emax: int) -> int:
        if amax == 0:
            return -127
        m, e = math.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
        step = 2 ** (mantissa + 1)
        m = math.floor(m * step + 0.5) / step  # the block max at the element's precision (may reach 1.0)
        return max(-127, min(127, math.floor(math.log2(m * 2.0 ** e)) - emax))

    amax = [0.0, 1.0, 1.49, 1.5, 1.75, 1.76, 3.0, 5.9, 6.0, 6.5, 7.0, 7.9, 448.0, 500.0, 1e-40, 1e38] + \
        [2.0 ** k * f for k in range(-20, 20, 3) for f in (1.0, 1.2499, 1.25, 1.5, 1.874, 1.875, 1.9999)]
    for element, mant, emax in (("fp4_e2m1", 1, 2), ("fp8_e4m3", 1, 8)):
        got = mx.e8m0_exponent(torch.tensor(amax), element).tolist()
        assert got == [ref_exponent(float(torch.tensor(a)), mant, emax) for a in amax], element


def test_mx_scales_match_compressed_tensors():
    mxu = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    torch.manual_seed(0)
    amax = torch.rand(4096) * torch.logspace(-6, 6, 4096)
    for bits, element in ((4, "fp4_e2m1"), (8, "fp8_e4m3")):
        theirs = mxu.generate_mx_scales(amax, num_bits=bits).to(torch.int32)
        assert torch.equal(mx.e8m0_exponent(amax, element) + 127, theirs)


def ref_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 of a [N, K] weight, block by block with Python floats: (e2m1 values, e4m3 block scales, global)."""
    g = float(torch.tensor(448.0 * 6.0) / w.abs().max())
    n, k = w.shape
    values, scales = torch.zeros(n, k), torch.zeros(n, k // 16)
    for r in range(n):
        for b in range(k // 16):
            blk = w[r, 16 * b:16 * b + 16]
            s = max(ref_round_e4m3(float(torch.tensor(float(blk.abs().max()) / 6.0 * g).float())), 2.0 ** -9)
            scales[r, b] = s
            eff = float(torch.tensor(s) / torch.tensor(g))  # float32 division, as the format is computed
            for j in range(16):
                values[r, 16 * b + j] = ref_round_e2m1(float(torch.tensor(float(blk[j])) / torch.tensor(eff)))
    return values, scales, torch.tensor(g)


def test_nvfp4_weight_matches_blockwise_reference_and_compressed_tensors():
    torch.manual_seed(0)
    w = torch.randn(6, 64) * torch.logspace(-3, 0, 64)  # blocks of very different ranges
    w[2, :16] = 0.0  # an all-zero block
    qt = quantize_rtn(w, NVFP4A16)
    values, scales, g = ref_nvfp4(w)
    assert qt.qdata.dtype == torch.uint8 and qt.qdata.shape == (6, 32)
    assert qt.scale.dtype == torch.float8_e4m3fn and qt.global_scale.dtype == torch.float32
    assert torch.equal(qt.codes(), values)
    assert torch.equal(qt.scale.float(), scales) and torch.equal(qt.global_scale, g.float())
    torch.testing.assert_close(qt.dequantize(), values * (scales / g).repeat_interleave(16, 1), rtol=0, atol=0)
    # compressed-tensors' own quantize with our block scales and global scale picks the same e2m1 values
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs
    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    theirs = forward.quantize(x=w, scale=qt.scale.float(), zero_point=None, args=args,
                              global_scale=qt.global_scale.reshape(1))
    assert torch.equal(theirs.float(), values)


def test_mx_weights_store_e8m0_and_match_a_blockwise_reference():
    torch.manual_seed(1)
    w = torch.randn(4, 96) * torch.logspace(-2, 1, 96)
    for sch, element in ((MXFP4A16, "fp4_e2m1"), (MXFP8A16, "fp8_e4m3")):
        qt = quantize_rtn(w, sch)
        assert qt.scale.dtype == torch.uint8 and qt.global_scale is None
        blocks = w.reshape(4, 3, 32)
        scale = mx.e8m0_scale(blocks.abs().amax(-1), element)  # [4, 3] powers of two
        assert torch.equal(mx.decode_e8m0(qt.scale), scale)
        x = blocks / scale[..., None]
        want = mx.round_e2m1(x) if element == "fp4_e2m1" else x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        torch.testing.assert_close(qt.dequantize(), (want * scale[..., None]).reshape(4, 96), rtol=0, atol=0)
    assert quantize_rtn(w, MXFP8A16).qdata.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("sch", [NVFP4A16, MXFP4A16, MXFP8A16])
def test_bytes_per_weight(sch):
    """Scales included: NVFP4 4 + 8/16 = 4.5 bits (+ 32 per tensor), MXFP4 4 + 8/32 = 4.25, MXFP8 8.25."""
    w = torch.randn(128, 256)
    bits = quantize_rtn(w, sch).nbytes * 8 / w.numel()
    assert bits == pytest.approx({"fp4_e2m1": 4.0, "fp8_e4m3": 8.0}[sch.dtype] + 8 / sch.group_size
                                 + (32 / w.numel() if sch.has_global_scale else 0))


def test_micro_activations_match_blockwise_reference():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 1, 64)
    blocks16, blocks32 = x.reshape(3, 5, 4, 16), x.reshape(3, 5, 2, 32)
    # NVFP4, calibrated global scale: input_scale = amax / (448 * 6), so the global scale is its inverse
    static = torch.tensor(float(x.abs().max()) * 1.3 / (448 * 6))
    g = 1.0 / static
    s = (mx.round_e4m3(blocks16.abs().amax(-1, keepdim=True) / 6 * g).clamp(min=2.0 ** -9) / g)
    want = (mx.round_e2m1(blocks16 / s) * s).reshape(x.shape)
    torch.testing.assert_close(fake_quantize_activation(x, NVFP4.act, static), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="calibrated input_scale"):
        fake_quantize_activation(x, NVFP4.act, None)
    # MXFP4 / MXFP8: power-of-two block scales from each input
    for act, element in ((MXFP4.act, "fp4_e2m1"), (MXFP8.act, "fp8_e4m3")):
        s = mx.e8m0_scale(blocks32.abs().amax(-1, keepdim=True), element)
        v = blocks32 / s
        v = mx.round_e2m1(v) if element == "fp4_e2m1" else v.clamp(-448, 448).to(torch.float8_e4m3fn).float()
        torch.testing.assert_close(fake_quantize_activation(x, act), (v * s).reshape(x.shape), rtol=0, atol=0)


def test_int4_per_token_activations_use_seven_levels_each_side():
    x = torch.randn(4, 32)
    y = fake_quantize_activation(x, W4A4_INT.act)
    s = x.abs().amax(-1, keepdim=True) / 7
    torch.testing.assert_close(y, torch.round(x / s).clamp(-7, 7) * s, rtol=0, atol=0)


@pytest.mark.parametrize("sch", [NVFP4A16, MXFP4A16])
def test_gptq_on_the_fp4_grid_lowers_the_output_error(sch):
    from compress.quantizers.gptq import quantize_gptq

    torch.manual_seed(0)
    x = torch.randn(512, 96) @ (torch.randn(96, 96) * 0.3 + torch.eye(96))
    w = torch.randn(48, 96)
    h = 2 * x.T @ x / x.shape[0]
    rtn, gptq = quantize_rtn(w, sch), quantize_gptq(w, h, sch)
    if sch.has_global_scale:
        assert torch.equal(gptq.global_scale, rtn.global_scale)  # one per tensor, from the original weight
    assert torch.equal(mx.round_e2m1(gptq.codes()), gptq.codes())  # values stay on the grid
    def err(qt):
        return float((x @ (qt.dequantize() - w).T).pow(2).mean())
    assert err(gptq) < 0.8 * err(rtn)


def test_scheme_validation_names_the_fix():
    with pytest.raises(ValueError, match="block scales"):
        QuantScheme("fp4_e2m1", "group", 16, True, "float16")
    with pytest.raises(ValueError, match="granularity: group"):
        QuantScheme("fp4_e2m1", "channel", None, True, "e8m0")
    with pytest.raises(ValueError, match="MXFP8 uses scale_dtype e8m0"):
        QuantScheme("fp8_e4m3", "group", 16, True, "float8_e4m3")
    with pytest.raises(ValueError, match="dynamic: true"):
        ActScheme("fp4_e2m1", "group", dynamic=False, group_size=32, scale_dtype="e8m0")
    with pytest.raises(ValueError, match="granularity: group"):
        ActScheme("fp4_e2m1", "token")
    assert NVFP4.micro_name == "NVFP4" and MXFP4.micro_name == "MXFP4" and MXFP8.micro_name == "MXFP8"
    assert QuantScheme.from_dict(NVFP4.to_dict()) == NVFP4


def test_global_scale_is_taken_once_per_tensor():
    w = torch.randn(8, 64)
    g = global_scale(w, NVFP4A16)
    assert float(g) == pytest.approx(448 * 6 / float(w.abs().max()))
    assert global_scale(w, MXFP4A16) is None
    s_half, _ = compute_qparams(w[:, :32], NVFP4A16, g)  # a piece with the whole tensor's global scale
    s_all, _ = compute_qparams(w, NVFP4A16)
    assert torch.equal(s_half, s_all[:, :2])
    q = quantize_affine(w, s_all, None, NVFP4A16)
    assert QuantizedTensor.from_codes(q, s_all, None, NVFP4A16, g).scale_float().equal(s_all)
    with pytest.raises(ValueError, match="global scale"):
        QuantizedTensor.from_codes(q, s_all, None, NVFP4A16)
