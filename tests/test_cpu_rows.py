"""The few-row CPU kernels (compress/kernels/cpu_rows.c): each matmul against the layer's own forward (float32
F.linear, QuantLinear's dequantize-then-matmul), a row's result independent of the rows that share the call, the
whole-block kernel against the lean loop's torch path and transformers on each lean family, speculative decoding
exact on it, and clear refusals. The kernels are built with the machine's C compiler (as a user's first call would)."""
from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from compress.measure.speculation import int4_copy
from compress.kernels import cpu_rows
from compress.kernels.cpu_rows import RowsUnavailable, has_vnni, load, rows_linear, rows_reason
from compress.serving.lean_decode import LeanStream, fuse_projections, use_rows
from compress.core.nn import QuantLinear
from compress.quantizers.rtn import quantize_rtn
from compress.core.scheme import FP8_W8A16, QuantScheme, W4A16_ASYM_G64, W8A8, W8A16
from compress.serving.speculative import generate_plain, generate_speculative

try:
    LIB = load()
except RowsUnavailable as e:  # no C compiler: the lean loop keeps torch's matmuls, and says so
    LIB, WHY = None, str(e)
needs_lib = pytest.mark.skipif(LIB is None, reason="the few-row kernels do not build here (no C compiler)")

INT4_SYM_G32 = QuantScheme(dtype="int4", granularity="group", group_size=32, symmetric=True)
INT4_SYM_CHANNEL = QuantScheme(dtype="int4", granularity="channel", group_size=None, symmetric=True)


def linear(n: int, k: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@needs_lib
@pytest.mark.parametrize("n,k,bias", [(96, 64, True), (100, 128, False), (33, 192, True), (8, 64, True)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
def test_float32_rows_equal_f_linear(n, k, bias, rows):
    layer = linear(n, k, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = rows_linear(layer, LIB)(x)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, layer(x), rtol=1e-5, atol=1e-5)


@needs_lib
@pytest.mark.parametrize("scheme", [W4A16_ASYM_G64, INT4_SYM_G32, INT4_SYM_CHANNEL, W8A16], ids=lambda s: s.name)
@pytest.mark.parametrize("n", [96, 40])
def test_quantized_rows_equal_the_layers_reference_forward(scheme, n):
    layer = linear(n, 128)
    q = QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(), scheme))
    x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(3))  # any leading shape, 10 rows
    got = rows_linear(q, LIB)(x)
    assert got.shape == (2, 5, n)
    torch.testing.assert_close(got, q(x), rtol=1e-5, atol=2e-5)


@needs_lib
@pytest.mark.parametrize("scheme", [None, W4A16_ASYM_G64, W8A16], ids=str)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(scheme):
    """What makes verification of K drafted tokens agree bit for bit with K one-token decode steps."""
    layer = linear(160, 128, seed=1)
    if scheme is not None:
        layer = QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(), scheme))
    r = rows_linear(layer, LIB)
    x = torch.randn(13, 128, generator=torch.Generator().manual_seed(4))
    together = r(x)
    alone = torch.cat([r(x[i:i + 1]) for i in range(13)])
    assert torch.equal(together, alone)
    with pytest.raises(ValueError, match="1..16 rows"):
        r(torch.randn(17, 128))


def w4a8_reference(layer: QuantLinear, x: Tensor) -> Tensor:
    """W4A8 by the definition in cpu_rows.c, in float64: x rounded per row and weight group to int8 on the step
    max|x| / 127 (half to even), integer dot products with the unsigned codes, minus the zero point times the sum of
    the rounded x, scaled by the weight's and the activation's steps."""
    qt = layer.qtensor()
    s, (n, k) = qt.scheme, qt.shape
    g = s.group_size if s.granularity == "group" else k
    scale = qt.scale.double().reshape(n, k // g)
    if qt.zero_point is None:
        u, z = qt.codes().double() - s.qmin, torch.full_like(scale, -s.qmin)
    else:
        u, z = qt.codes().double(), qt.zero_point.double().reshape(n, k // g)
    xg = x.reshape(-1, k // g, g)
    step = xg.abs().amax(-1, keepdim=True) / 127
    step = torch.where(step > 0, step, torch.ones_like(step))
    xq = torch.round(xg / step).clamp(-127, 127).double()
    dots = torch.einsum("mgi,ngi->mng", xq, u.reshape(n, k // g, g))
    y = (scale[None] * step.squeeze(-1).double()[:, None, :] * (dots - z[None] * xq.sum(-1)[:, None, :])).sum(-1)
    return y + (layer.bias.double() if layer.bias is not None else 0)


@needs_lib
@pytest.mark.skipif(LIB is None or not has_vnni(LIB), reason="the W4A8 kernel needs AVX512-VNNI")
@pytest.mark.parametrize("scheme", [W4A16_ASYM_G64, INT4_SYM_G32, INT4_SYM_CHANNEL], ids=lambda s: s.name)
@pytest.mark.parametrize("n", [96, 40])
def test_int4_with_int8_activations_equals_its_definition(scheme, n):
    layer = linear(n, 128)
    q = QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(), scheme))
    r = rows_linear(q, LIB, int8_activations=True)
    assert r.kind == "w4a8"
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(6))
    got = r(x)
    torch.testing.assert_close(got.double(), w4a8_reference(q, x), rtol=1e-5, atol=1e-5)
    rel = (got - q(x)).norm() / q(x).norm()
    assert 1e-4 < rel < 0.05  # an approximation of the W4A16 layer, and a close one
    assert torch.equal(r(x[3:4]), got[3:4])  # rows independent here too
    assert rows_linear(q, LIB).kind == "int4"  # only when asked for


def test_refusals_name_the_reason():
    assert "bfloat16" in rows_reason(nn.Linear(64, 32, dtype=torch.bfloat16))
    layer = linear(32, 64)
    assert "quantized activations" in rows_reason(QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(),
                                                                                               W8A8)))
    assert "int4 and int8 only" in rows_reason(QuantLinear.from_module(layer, quantize_rtn(layer.weight.detach(),
                                                                                            FP8_W8A16)))
    assert "not a linear" in rows_reason(nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="cannot run this layer"):
        rows_linear(nn.Linear(64, 32, dtype=torch.bfloat16), LIB)


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.raises(RowsUnavailable, match="failed"):
        load()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-written left in the cache
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("COMPRESS_CACHE", str(blocked))  # the cache cannot be a folder
    monkeypatch.delenv("CC")
    with pytest.raises(RowsUnavailable, match="COMPRESS_CACHE"):
        load()
    monkeypatch.setattr(cpu_rows, "_compiler", lambda: None)
    with pytest.raises(RowsUnavailable, match="no C compiler"):
        load()


SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {"llama": (LlamaConfig, {}), "qwen2": (Qwen2Config, {}),  # Qwen2: q/k/v biases
            "mistral": (MistralConfig, {"sliding_window": None})}


def tiny(family: str) -> nn.Module:
    cls, kw = FAMILIES[family]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cls(**{**SMALL, **kw}), attn_implementation="sdpa").eval()


@needs_lib
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fused", [False, True])
@torch.no_grad()
def test_block_kernel_equals_transformers_across_appends_and_crops(family, fused):
    model = tiny(family)
    if fused:
        fuse_projections(model)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    ref = model(ids).logits[0]
    with use_rows(model) as left:
        assert left == []
        s = LeanStream(model, max_len=64)
        assert s.c_problem is None
        a = s.forward(ids[0, :17].tolist())  # a prefill: more rows than the kernels take, the torch path
        b = s.forward(ids[0, 17:18].tolist())  # one decode step, on the block kernel
        c = s.forward(ids[0, 18:25].tolist())  # a verify step of 7 tokens ...
        s.crop(21)  # ... of which 3 were accepted
        d = s.forward(ids[0, 21:37].tolist())  # 16 rows: the most the kernels take
        e = s.forward(ids[0, 37:].tolist())
    torch.testing.assert_close(torch.cat([a, b, c[:3], d, e]), ref, rtol=1e-4, atol=1e-4)


@needs_lib
@torch.no_grad()
def test_verifying_k_tokens_is_bitwise_k_decode_steps():
    model = tiny("qwen2")
    ids = torch.randint(0, SMALL["vocab_size"], (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with use_rows(model):
        s = LeanStream(model, max_len=64)
        s.forward(ids[:20], logits="none")
        together = s.forward(ids[20:26])
        s.crop(20)
        alone = torch.cat([s.forward([t]) for t in ids[20:26]])
    assert torch.equal(together, alone)


@needs_lib
@torch.no_grad()
def test_speculative_decoding_on_the_kernels_is_exact_and_int4_drafts_run_on_them():
    target = tiny("llama")
    draft, _ = int4_copy(target, scheme=W4A16_ASYM_G64, head=W8A16, dtype=torch.float32)
    prompt = torch.randint(0, SMALL["vocab_size"], (12,), generator=torch.Generator().manual_seed(5)).tolist()
    plain_torch = generate_plain(target, prompt, 24).tokens
    with use_rows(target), use_rows(draft) as left:
        assert left == []
        assert LeanStream(draft, 64).c_problem is None
        plain = generate_plain(target, prompt, 24).tokens
        for k in (1, 4, 8):
            assert generate_speculative(target, draft, prompt, 24, k).tokens == plain
    with use_rows(target), use_rows(draft, int8_activations=True):  # a W4A8 draft where the CPU has VNNI
        assert generate_speculative(target, draft, prompt, 24, 4).tokens == plain
    assert plain == plain_torch


@needs_lib
def test_packed_copies_stay_within_half_the_free_memory(monkeypatch):
    import psutil

    model = tiny("llama")
    first = model.model.layers[0].self_attn.q_proj.weight.numel() * 4  # float32 bytes of the first linear
    free = type("Free", (), {"available": 2 * first + 8})  # room for the first packed copy only
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    with use_rows(model) as left:
        s = LeanStream(model, 32)
        assert "use_rows" in s.c_problem  # not every layer packed: the block kernel stays off
        torch.testing.assert_close(s.forward([1, 2, 3]), model(torch.tensor([[1, 2, 3]])).logits[0], rtol=1e-4,
                                   atol=1e-4)
    n_linears = sum(type(m) is nn.Linear for m in model.modules())
    assert len(left) == n_linears - 1 and all("free memory" in x for x in left)


@needs_lib
def test_blocks_the_kernel_does_not_compute_stay_on_torch():
    model = tiny("llama")
    model.config.hidden_act = "gelu"
    with use_rows(model):
        s = LeanStream(model, 32)
    assert "activation" in s.c_problem
    assert "use_rows" in LeanStream(tiny("llama"), 32).c_problem  # nothing attached
