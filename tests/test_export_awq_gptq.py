"""AWQ- and GPTQ-format weight layouts, checked bit for bit against unpackers written here from the formats'
published readers (not from compress.export):

AWQ  (vLLM awq_triton.py `awq_dequantize_kernel`, AutoAWQ awq/utils/packing_utils.py `dequantize_gemm`):
     qweight [K, N/8] int32; field i (bits 4i..4i+3) of word j holds column 8j + AWQ_ORDER[i],
     AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [K/G, N/8] the same way; w = (q - z) * s.
GPTQ (vLLM gptq.py, AutoGPTQ qlinear_cuda_old.py forward, checkpoint_format "gptq" = v1):
     qweight [K*b/32, N] int32, packed along K; qzeros [K/G, N*b/32], packed along N, storing zero - 1;
     w = (q - (z + 1)) * s, with the group of input k given by g_idx[k].
"""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AwqConfig, GPTQConfig

from compress.export.awq import awq_config, awq_problem, awq_tensors
from compress.export.gptq import gptq_config, gptq_problem, gptq_tensors
from compress.core.qtensor import QuantizedTensor
from compress.quantizers.rtn import quantize_rtn
from compress.core.scheme import FP8, FP8_DYNAMIC, FP8_W8A16, W8A8, W8A16, scheme

SPEC_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ------------------------------------------------------------------ independent unpackers (from the spec)

def _field(words: torch.Tensor, i: int, bits: int) -> torch.Tensor:
    """Field i of every int32 word as a non-negative int64 (the sign bit is just bit 31)."""
    return (words.to(torch.int64) >> (bits * i)) & ((1 << bits) - 1)


def unpack_awq(qweight, qzeros, scales) -> torch.Tensor:
    """AWQ GEMM tensors -> float32 weight [N, K]."""
    k, words = qweight.shape
    n = words * 8
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for i in range(8):  # field i holds column 8j + SPEC_AWQ_ORDER[i] of word j
        q[:, SPEC_AWQ_ORDER[i]::8] = _field(qweight, i, 4)
        z[:, SPEC_AWQ_ORDER[i]::8] = _field(qzeros, i, 4)
    group = k // scales.shape[0]
    rows = torch.arange(k) // group
    w = (q.float() - z[rows].float()) * scales[rows].float()  # [K, N]
    return w.t()


def unpack_gptq(qweight, qzeros, scales, g_idx, bits) -> torch.Tensor:
    """GPTQ v1 tensors -> float32 weight [N, K]."""
    per = 32 // bits
    k = qweight.shape[0] * per
    n = qweight.shape[1]
    q = torch.empty(k, n, dtype=torch.int64)
    z = torch.empty(qzeros.shape[0], n, dtype=torch.int64)
    for j in range(per):  # row r of qweight holds inputs r*per + j; column c of qzeros holds outputs c*per + j
        q[j::per, :] = _field(qweight, j, bits)
        z[:, j::per] = _field(qzeros, j, bits)
    z = z + 1  # v1: the stored field is zero - 1
    g = g_idx.long()
    w = (q.float() - z[g].float()) * scales[g].float()  # [K, N]
    return w.t()


def _one_sentence(msg: str) -> bool:
    return "\n" not in msg and not re.search(r"[.!?] [A-Z]", msg) and not msg.endswith(".")


def _rtn(sch, n, k, seed=0):
    torch.manual_seed(seed)
    return quantize_rtn(torch.randn(n, k) * 0.05, sch)


# ------------------------------------------------------------------ AWQ

AWQ_CASES = [  # (scheme, N, K)
    (scheme("int4", "group", 32, symmetric=False), 96, 576),
    (scheme("int4", "group", 64, symmetric=False), 200, 576),
    (scheme("int4", "group", 128, symmetric=False), 96, 384),
    (scheme("int4", "group", 64, symmetric=True), 200, 256),
]


@pytest.mark.parametrize("sch,n,k", AWQ_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_awq_bit_exact(sch, n, k):
    qt = _rtn(sch, n, k)
    assert awq_problem(sch, (n, k)) is None
    t = awq_tensors(qt)
    g = sch.group_size
    assert set(t) == {"qweight", "qzeros", "scales"}
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k, n // 8)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (k // g, n // 8)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (k // g, n)
    assert all(v.is_contiguous() for v in t.values())
    w = unpack_awq(t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(w, qt.dequantize(torch.float32))
    if sch.symmetric:  # zero point 8 everywhere: 0x88888888
        assert (t["qzeros"] == torch.tensor(0x88888888 - 2 ** 32, dtype=torch.int32)).all()


def test_awq_golden_word():
    """N=K=G=8, asymmetric: output row n has code n everywhere and zero point 8 + n. Field i of a word holds
    column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7, so the word reads 0x75316420 and the zeros word 0xFDB9ECA8."""
    sch = scheme("int4", "group", 8, symmetric=False)
    codes = torch.arange(8).repeat_interleave(8).reshape(8, 8)  # codes[n, k] = n
    zero = (8 + torch.arange(8)).reshape(8, 1)
    scale = torch.full((8, 1), 0.5)
    qt = QuantizedTensor.from_codes(codes, scale, zero, sch)
    t = awq_tensors(qt)
    assert t["qweight"].shape == (8, 1)
    assert (t["qweight"] == 0x75316420).all()
    assert t["qzeros"].tolist() == [[0xFDB9ECA8 - 2 ** 32]]
    assert torch.equal(unpack_awq(t["qweight"], t["qzeros"], t["scales"]), qt.dequantize(torch.float32))


def test_awq_config():
    cfg = awq_config(scheme("int4", "group", 64, symmetric=False))
    assert cfg == {"quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4, "version": "gemm",
                   "modules_to_not_convert": None}
    cfg = awq_config(scheme("int4", "group", 128), modules_to_not_convert=["lm_head"])
    assert cfg["modules_to_not_convert"] == ["lm_head"] and cfg["group_size"] == 128
    hf = AwqConfig.from_dict(cfg)  # transformers parses it
    assert (hf.bits, hf.group_size, hf.zero_point, hf.format) == (4, 128, True, "gemm")
    with pytest.raises(ValueError, match="int4"):
        awq_config(scheme("int8", "channel"))


AWQ_REFUSED = [  # (scheme, shape, a word the message must contain)
    (scheme("int3", "group", 64), (96, 256), "int4"),
    (scheme("int8", "group", 64), (96, 256), "int4"),
    (W8A16, (96, 256), "int4"),
    (scheme("int4", "group", 64, scale_dtype="bfloat16"), (96, 256), "scale_dtype: float16"),
    (scheme("int4", "group", 64, scale_dtype="float32"), (96, 256), "scale_dtype: float16"),
    (scheme("int4", "group", 64), (96, 288), "divisible"),
    (scheme("int4", "group", 64), (100, 256), "multiple of 8"),
    (scheme("int4", "channel"), (96, 256), "granularity: group"),
    (scheme("int4", "tensor"), (96, 256), "granularity: group"),
    (W8A8, (96, 256), "weight-only"),
    (FP8, (96, 256), "weight-only"),
    (FP8_DYNAMIC, (96, 256), "weight-only"),
    (FP8_W8A16, (96, 256), "int4"),
]


@pytest.mark.parametrize("sch,shape,word", AWQ_REFUSED, ids=lambda c: getattr(c, "name", str(c)))
def test_awq_refuses(sch, shape, word):
    msg = awq_problem(sch, shape)
    assert isinstance(msg, str) and word in msg and _one_sentence(msg)


def test_awq_tensors_refuse_with_the_problem():
    qt = _rtn(scheme("int4", "group", 64, scale_dtype="bfloat16"), 96, 256)
    with pytest.raises(ValueError, match="scale_dtype: float16"):
        awq_tensors(qt)


# ------------------------------------------------------------------ GPTQ

GPTQ_CASES = [  # (scheme, N, K)
    (scheme("int4", "group", 32, symmetric=True), 96, 576),
    (scheme("int4", "group", 32, symmetric=False), 200, 256),
    (scheme("int4", "group", 128, symmetric=True), 200, 384),
    (scheme("int4", "group", 128, symmetric=False), 96, 256),
    (scheme("int4", "channel", symmetric=True), 96, 576),
    (scheme("int4", "channel", symmetric=False), 200, 384),
    (scheme("int8", "group", 64, symmetric=False), 200, 576),
    (scheme("int8", "group", 64, symmetric=True), 96, 384),
    (scheme("int8", "channel", symmetric=True), 200, 576),
    (scheme("int8", "channel", symmetric=False), 96, 256),
]


@pytest.mark.parametrize("sch,n,k", GPTQ_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_gptq_bit_exact(sch, n, k):
    qt = _rtn(sch, n, k)
    assert gptq_problem(sch, (n, k)) is None
    t = gptq_tensors(qt)
    bits = sch.bits
    groups = 1 if sch.granularity == "channel" else k // sch.group_size
    assert set(t) == {"qweight", "qzeros", "scales", "g_idx"}
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (k * bits // 32, n)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (groups, n * bits // 32)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (groups, n)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (k,)
    assert all(v.is_contiguous() for v in t.values())
    gsize = k if sch.granularity == "channel" else sch.group_size
    assert t["g_idx"].tolist() == [i // gsize for i in range(k)]
    w = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits)
    assert torch.equal(w, qt.dequantize(torch.float32))
    if sch.symmetric:  # zero 2**(b-1), stored minus one: 0x77777777 / 0x7F7F7F7F
        word = 0x77777777 if bits == 4 else 0x7F7F7F7F
        assert (t["qzeros"] == word).all()


def test_gptq_golden_words():
    """int4, N=K=G=8, asymmetric: every row has codes 15 - k along K and row n has zero point n + 1. Packing along
    K, field k is 15 - k: 0x89ABCDEF; the zeros store n (= zero - 1) in field n: 0x76543210."""
    sch = scheme("int4", "group", 8, symmetric=False)
    codes = (15 - torch.arange(8)).repeat(8, 1)  # codes[n, k] = 15 - k
    zero = (1 + torch.arange(8)).reshape(8, 1)
    qt = QuantizedTensor.from_codes(codes, torch.full((8, 1), 0.25), zero, sch)
    t = gptq_tensors(qt)
    assert t["qweight"].shape == (1, 8) and (t["qweight"] == 0x89ABCDEF - 2 ** 32).all()
    assert t["qzeros"].tolist() == [[0x76543210]]
    assert t["g_idx"].tolist() == [0] * 8
    assert torch.equal(unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4),
                       qt.dequantize(torch.float32))


def test_gptq_golden_int8():
    """int8 symmetric, N=4, K=4, channel: codes [-128, -1, 0, 127] -> u = q + 128 = [0, 127, 128, 255] along K:
    0xFF807F00; zero 128 stored as 127 in each byte: 0x7F7F7F7F."""
    sch = scheme("int8", "channel", symmetric=True)
    codes = torch.tensor([-128, -1, 0, 127]).repeat(4, 1)
    qt = QuantizedTensor.from_codes(codes, torch.full((4, 1), 0.125), None, sch)
    t = gptq_tensors(qt)
    assert t["qweight"].tolist() == [[0xFF807F00 - 2 ** 32] * 4]
    assert t["qzeros"].tolist() == [[0x7F7F7F7F]]
    assert torch.equal(unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 8),
                       qt.dequantize(torch.float32))


def test_gptq_refuses_zero_point_zero():
    """A group with no negative weight has zero point 0, which GPTQ v1 (zero - 1) cannot store."""
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 0.05
    w[3, :32] = w[3, :32].abs() + 0.01  # row 3, group 0: all positive -> zero point 0
    qt = quantize_rtn(w, scheme("int4", "group", 32, symmetric=False))
    assert int(qt.zero_point[3, 0]) == 0
    with pytest.raises(ValueError, match="zero point of 0"):
        gptq_tensors(qt)


def test_gptq_config():
    cfg = gptq_config(scheme("int4", "group", 128))
    assert cfg == {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "static_groups": False,
                   "sym": True, "lm_head": False, "checkpoint_format": "gptq", "format": "gptq",
                   "pack_dtype": "int32"}
    cfg = gptq_config(scheme("int8", "channel", symmetric=False))
    assert (cfg["bits"], cfg["group_size"], cfg["sym"]) == (8, -1, False)
    hf = GPTQConfig.from_dict(cfg)  # transformers parses it as v1
    assert (hf.bits, hf.group_size, hf.sym, hf.desc_act, hf.format) == (8, -1, False, False, "gptq")
    with pytest.raises(ValueError, match="4- or 8-bit"):
        gptq_config(scheme("int3", "group", 64))


GPTQ_REFUSED = [
    (scheme("int3", "group", 64), (96, 256), "4- or 8-bit"),
    (scheme("int2", "group", 64), (96, 256), "4- or 8-bit"),
    (scheme("int4", "group", 64, scale_dtype="bfloat16"), (96, 256), "scale_dtype: float16"),
    (scheme("int8", "channel", scale_dtype="float32"), (96, 256), "scale_dtype: float16"),
    (scheme("int4", "group", 64), (96, 288), "divisible"),
    (scheme("int4", "channel"), (96, 260), "multiple of 8"),
    (scheme("int8", "channel"), (96, 258), "multiple of 4"),
    (scheme("int4", "group", 64), (100, 256), "multiple of 8"),
    (scheme("int4", "tensor"), (96, 256), "granularity: group"),
    (W8A8, (96, 256), "weight-only"),
    (FP8, (96, 256), "weight-only"),
    (FP8_DYNAMIC, (96, 256), "weight-only"),
    (FP8_W8A16, (96, 256), "4- or 8-bit"),
]


@pytest.mark.parametrize("sch,shape,word", GPTQ_REFUSED, ids=lambda c: getattr(c, "name", str(c)))
def test_gptq_refuses(sch, shape, word):
    msg = gptq_problem(sch, shape)
    assert isinstance(msg, str) and word in msg and _one_sentence(msg)


def test_presets_that_export():
    assert gptq_problem(W8A16, (96, 256)) is None  # int8 per channel, float16 scales
    assert awq_problem(scheme("int4", "group", 64, symmetric=False), (96, 576)) is None
