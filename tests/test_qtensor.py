"""Bit packing against a naive bit stream, QuantizedTensor round trips, QuantLinear vs dequantize-then-matmul."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from compress.core.nn import QuantLinear, linear_weight
from compress.core.qtensor import pack_codes, unpack_codes
from compress.quantizers import quantize_rtn
from compress.core.scheme import scheme
from tests.reference.naive import naive_pack


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])  # 5 and 7: words of 40 and 56 bits
@pytest.mark.parametrize("k", [1, 7, 8, 64, 545, 576])
def test_pack_matches_naive_bitstream_and_round_trips(bits, k):
    u = torch.randint(0, 2 ** bits, (5, k))
    packed = pack_codes(u, bits)
    assert packed.dtype == torch.uint8
    for row in range(5):
        assert bytes(packed[row].tolist()) == naive_pack(u[row].tolist(), bits)
    assert torch.equal(unpack_codes(packed, bits, k).to(torch.int64), u)


def test_packed_sizes():
    u = torch.zeros(2, 576, dtype=torch.int64)
    assert pack_codes(u, 4).shape == (2, 288)
    assert pack_codes(u, 3).shape == (2, 216)
    assert pack_codes(u, 2).shape == (2, 144)
    assert pack_codes(u, 8).shape == (2, 576)
    assert pack_codes(u, 5).shape == (2, 360)
    assert pack_codes(u, 6).shape == (2, 432)
    assert pack_codes(u, 7).shape == (2, 504)


SCHEMES = [scheme("int8", "channel"), scheme("int8", "channel", symmetric=False), scheme("int4", "group", 64),
           scheme("int4", "group", 32, False), scheme("int3", "group", 64), scheme("int2", "group", 64, False),
           scheme("int8", "tensor"), scheme("int5", "group", 64, False), scheme("int6", "group", 64, False),
           scheme("int7", "channel")]


@pytest.mark.parametrize("sch", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("shape", [(830, 576), (1, 64), (192, 1536)], ids=str)
def test_quantized_tensor_round_trip(sch, shape):
    w = torch.randn(shape)
    qt = quantize_rtn(w, sch)
    assert qt.shape == shape
    codes = qt.codes()
    from compress.core.primitives import compute_qparams, quantize_affine
    scale, zero = compute_qparams(w, sch)
    assert torch.equal(codes, quantize_affine(w, scale, zero, sch).to(torch.int32))
    # dequantize() (the fast forward path) equals the generic affine map on the unpacked codes
    from compress.core.primitives import dequantize_affine
    assert torch.equal(qt.dequantize(), dequantize_affine(codes, qt.scale, qt.zero_point, sch))


@pytest.mark.parametrize("sch", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("bias", [False, True])
def test_quant_linear_equals_dequantize_then_matmul(sch, bias):
    layer = nn.Linear(576, 192, bias=bias)
    qt = quantize_rtn(layer.weight.detach(), sch)
    ql = QuantLinear.from_module(layer, qt)
    x = torch.randn(3, 5, 576)
    ref = x @ qt.dequantize().T + (layer.bias.detach() if bias else 0)
    torch.testing.assert_close(ql(x), ref, rtol=1e-5, atol=1e-5)


def test_quant_linear_from_conv1d_uses_out_in_orientation():
    conv = Conv1D(96, 64)  # GPT-2 style: weight [in=64, out=96]
    w = linear_weight(conv)
    assert w.shape == (96, 64)
    ql = QuantLinear.from_module(conv, quantize_rtn(w.detach(), scheme("int8", "channel")))
    x = torch.randn(4, 64)
    torch.testing.assert_close(ql(x), conv(x), rtol=0.02, atol=0.02)


def test_quant_linear_really_is_smaller():
    layer = nn.Linear(576, 1536, bias=False)
    bf16 = layer.weight.numel() * 2
    for sch, limit in [(scheme("int4", "group", 64), 0.3), (scheme("int4", "group", 64, False), 0.3),
                       (scheme("int8", "channel"), 0.51)]:
        ql = QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(), sch))
        held = sum(b.numel() * b.element_size() for b in ql.buffers())
        assert held / bf16 <= limit, sch.name
        assert not any(p.numel() == layer.weight.numel() for p in ql.parameters())  # no float copy kept


def test_quant_linear_state_dict_round_trip():
    layer = nn.Linear(128, 64, bias=True)
    sch = scheme("int4", "group", 32, False)
    ql = QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(), sch))
    fresh = QuantLinear(128, 64, sch, bias=True)
    fresh.load_state_dict(ql.state_dict())
    x = torch.randn(2, 128)
    assert torch.equal(fresh(x), ql(x))


def test_shape_mismatch_is_an_error():
    layer = nn.Linear(64, 32)
    with pytest.raises(ValueError, match="does not match"):
        QuantLinear.from_module(layer, quantize_rtn(torch.randn(32, 128), scheme("int8", "channel")))
