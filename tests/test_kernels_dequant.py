"""The large-batch paths of issue 44 without a GPU: the W4A16 dequantization kernel (cuda/dequant.cu) through its
op's CPU reference, a CPU replay of the kernel's index formulas, and its compile-time facts for sm_80 / sm_89 /
sm_90a; the dequantize+cuBLAS and quantize+_scaled_mm dispatcher entries on CPU (torch._scaled_mm runs on CPU).
Running the kernel itself needs a GPU (bench/gpu_check.py)."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from compress.kernels import build, gpu, ops, prepack
from compress.kernels.prepack import (DEQUANT_ROW_WORDS, emulate_w4a16_dequant, prepack_w4a16, w4a16_dequant_supported,
                                      w4a16_reference)
from compress.core.nn import QuantLinear
from compress.core.qtensor import QuantizedTensor
from compress.core.scheme import ActScheme, scheme

SOURCE = build.CUDA_DIR / "dequant.cu"
GEN = torch.Generator().manual_seed(44)


def _packed(N: int, K: int, group_size: int, asym: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    G = K if group_size == -1 else group_size
    u = torch.randint(0, 16, (N, K), generator=gen)
    scales = torch.rand(N, K // G, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (N, K // G), generator=gen).float() if asym else None
    return u, zeros, prepack_w4a16(u, scales, zeros, group_size, dtype)


def _reference_weight(u, zeros, packed) -> torch.Tensor:
    """prepack.w4a16_reference's dequantized weight (float64: identity @ W^T), rounded once to the packed dtype;
    the scales as the kernel sees them (already in the dtype)."""
    K = u.shape[1]
    wt = w4a16_reference(torch.eye(K, dtype=torch.float64), u, packed["scales"].t(), zeros, packed["group_size"])
    return wt.t().to(packed["scales"].dtype)


CASES = [(g, asym, dt) for g in (32, 64, 128, -1) for asym in (False, True) for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("group_size,asym,dtype", CASES)
def test_dequant_op_is_the_reference_weight_rounded_once(group_size, asym, dtype):
    """Bit-exact: (u - z) * s is exact in float32 (an integer -15..15 times a 16-bit scale), so one rounding to the
    dtype gives the float64 reference's rounding; the CUDA kernel's fma rounds the same exact product once."""
    N, K = 96, 256
    u, zeros, packed = _packed(N, K, group_size, asym, dtype, seed=K + group_size)
    w = ops.w4a16_dequant(packed["wq"], packed["scales"], packed["zeros"], N, K, group_size)
    assert w.dtype == dtype and w.shape == (N, K)
    assert torch.equal(w, _reference_weight(u, zeros, packed))
    # and the CPU replay of the kernel's own index formulas writes the same weight, every element once
    replay, _ = emulate_w4a16_dequant(packed["wq"], packed["scales"], packed["zeros"], N, K, group_size)
    assert not replay.isnan().any() and torch.equal(replay, w)


def test_dequant_sees_a_wrong_layout_and_wrong_scales():
    """Guard against a vacuous comparison: two swapped words, or scales of the wrong group, change the weight."""
    N, K, G = 64, 256, 64
    u, zeros, packed = _packed(N, K, G, True, torch.bfloat16)
    want = _reference_weight(u, zeros, packed)
    wq = packed["wq"].clone()
    wq[0], wq[1] = wq[1].clone(), wq[0].clone()
    assert not torch.equal(ops.w4a16_dequant(wq, packed["scales"], packed["zeros"], N, K, G), want)
    assert not torch.equal(emulate_w4a16_dequant(wq, packed["scales"], packed["zeros"], N, K, G)[0], want)
    rolled = packed["scales"].roll(1, dims=0).contiguous()
    assert not torch.equal(emulate_w4a16_dequant(packed["wq"], rolled, packed["zeros"], N, K, G)[0], want)


def test_kernel_shared_memory_stores_are_bank_conflict_free():
    """Each 32-bit shared store of a warp (8 rows g x 4 words t, rows DEQUANT_ROW_WORDS = 68 words apart) hits 32
    distinct banks; without the 4 words of padding (64-word rows) it would be 8-way conflicted."""
    N, K = 64, 256
    _, _, packed = _packed(N, K, 32, False, torch.float16)
    _, addresses = emulate_w4a16_dequant(packed["wq"], packed["scales"], None, N, K, 32)
    banks = addresses % 32
    assert (banks.sort(-1).values == torch.arange(32)).all()
    assert DEQUANT_ROW_WORDS == 68 and (DEQUANT_ROW_WORDS * 4) % 16 == 0  # rows stay 16-byte aligned for LDS.128
    unpadded = (addresses // DEQUANT_ROW_WORDS) * 64 + addresses % DEQUANT_ROW_WORDS
    assert len(torch.unique(unpadded[0, 0, 0, 0, 0, 0] % 32)) == 4


def test_replay_follows_the_cu_formulas():
    """The replay's index formulas are the ones in dequant.cu (the kernel cannot run here)."""
    text = SOURCE.read_text()
    for line in (
        "constexpr int kRowWords = kBK / 2 + 4;",
        "const int ks = blockIdx.x * (kBK / 32) + warp;",
        "wq + (static_cast<size_t>(sb) * ks_total + ks) * 32 + lane",
        "const size_t srow = static_cast<size_t>((ks * 32) >> group_shift) * N + n0;",
        "const int c_lo = 16 * jj + g;",
        "const uint32_t word = words[2 * kh + jj];",
        "const uint32_t q = and_or(word >> (4 * i), 0x000F000Fu, Dq<DT>::kExp);",
        "const int row = c_lo + 8 * (i >> 1);",
        "tile[row * kRowWords + 16 * warp + 8 * kh + 4 * (i & 1) + t] = w;",
        "const int row = c >> 4, ch = c & (kChunksPerRow - 1);",
        "tile + row * kRowWords + 4 * ch",
        "out + static_cast<size_t>(n0 + row) * K + k0 + 8 * ch",
        "const int shift = group_size == 32 ? 5 : group_size == 64 ? 6 : group_size == 128 ? 7 : 31;",
        "const dim3 grid(K / kBK, N / kStrip);",
    ):
        assert line in text, line


def test_c_and_python_rules_agree():
    text = SOURCE.read_text()
    body = re.search(r"int compress_w4a16_dequant_supported\(.*?\n}\n", text, re.S).group(0)
    assert "N < kStrip || N % kStrip != 0 || N / kStrip > kMaxStrips || K < kBK || K % kBK != 0" in body
    assert "sm < 80" in body and "constexpr int kMaxStrips = 65535;" in text
    assert "group_size != 32 && group_size != 64 && group_size != 128 && group_size != -1" in body
    assert "group_size > 0 && K % group_size != 0" in body
    assert prepack.MAX_DEQUANT_N == 65535 * 32
    assert w4a16_dequant_supported(65535 * 32, 128, -1) is None
    assert "N=2097152 is above 2097120" in w4a16_dequant_supported(65536 * 32, 128, -1)
    assert "N=100" in w4a16_dequant_supported(100, 128, 32)
    assert "K=200" in w4a16_dequant_supported(64, 200, -1)
    assert "group_size=16" in w4a16_dequant_supported(64, 128, 16)


def test_dequant_op_passes_opcheck_and_checks_inputs():
    N, K, G = 64, 256, 64
    _, _, sym = _packed(N, K, G, False, torch.float16)
    _, _, asym = _packed(N, K, G, True, torch.bfloat16)
    torch.library.opcheck(ops.w4a16_dequant, (sym["wq"], sym["scales"], None, N, K, G))
    torch.library.opcheck(ops.w4a16_dequant, (asym["wq"], asym["scales"], asym["zeros"], N, K, G))
    with pytest.raises(ValueError, match=r"scales must be \[K/G, N\] = \[4, 64\], got \(64, 4\)"):
        ops.w4a16_dequant(sym["wq"], sym["scales"].t().contiguous(), None, N, K, G)
    with pytest.raises(ValueError, match="K=200 is not a positive multiple of 128"):
        ops.w4a16_dequant(sym["wq"], sym["scales"], None, N, 200, G)
    with pytest.raises(ValueError, match="wq must be int32 with N\\*K/8 = 2048 elements, got torch.int32 with 1024"):
        ops.w4a16_dequant(sym["wq"][:1024], sym["scales"], None, N, K, G)
    with pytest.raises(ValueError, match="scales must be float16 or bfloat16"):
        ops.w4a16_dequant(sym["wq"], sym["scales"].float(), None, N, K, G)
    with pytest.raises(ValueError, match=r"zeros must be \[4, 64\] torch.bfloat16, got \(4, 64\) torch.float32"):
        ops.w4a16_dequant(asym["wq"], asym["scales"], asym["zeros"].float(), N, K, G)


# ---- the dispatcher entries, on CPU (the ops' reference paths; torch._scaled_mm runs on CPU) -----------------

def _w4_layer(n: int, k: int, g: int, asym: bool, bias: bool = True) -> QuantLinear:
    from compress.core.primitives import scale_shape
    s = scheme("int4", "channel", None, not asym) if g == -1 else scheme("int4", "group", g, not asym)
    shape = scale_shape(s, n, k)
    lo, hi = (0, 15) if asym else (s.qmin, s.qmax)
    q = torch.randint(lo, hi + 1, (n, k), generator=GEN)
    z = torch.randint(0, 16, shape, generator=GEN).float() if asym else None
    qt = QuantizedTensor.from_codes(q, torch.rand(shape, generator=GEN) + 0.5, z, s)
    return QuantLinear.from_module(torch.nn.Linear(k, n, bias=bias), qt)


@pytest.mark.parametrize("k,g,asym", [(256, 64, True), (576, 32, False), (200, -1, True)])
def test_dequant_cublas_entry_matches_the_layer(k, g, asym):
    """linear_w4a16_dequant on the W4A16 GEMM's own operands (prepare_w4a16; K = 576 and 200 zero-padded, the padding
    sliced off the weight) equals the layer's dequantize-then-matmul; the dequantized weight itself is the layer's
    weight with the scales rounded to bf16, exactly, and zeros in the padding."""
    n = 64
    layer = _w4_layer(n, k, g, asym)
    p = gpu.prepare_w4a16(layer, torch.bfloat16)
    x = torch.randn(2, 3, k, generator=GEN).bfloat16()
    bias = layer.bias.detach()
    y = gpu.linear_w4a16_dequant(p, x, bias)
    assert y.shape == (2, 3, n) and y.dtype == torch.bfloat16
    qt = layer.qtensor()
    want = x.reshape(-1, k).double() @ qt.dequantize(torch.float64).t() + bias.double()
    assert ((y.reshape(-1, n).double() - want).norm() / want.norm()).item() < 8e-3
    w = gpu.dequant_w4a16(p)
    assert w.shape == (n, p.k_padded)
    groups = 1 if g == -1 else k // g
    s = qt.scale.reshape(n, groups).bfloat16().double().repeat_interleave(k // groups, 1)
    z = 8.0 if qt.zero_point is None else qt.zero_point.double().reshape(n, groups).repeat_interleave(k // groups, 1)
    u = qt.codes().double() - (qt.scheme.qmin if qt.zero_point is None else 0)
    assert torch.equal(w[:, :k], ((u - z) * s).bfloat16())
    assert (w[:, k:] == 0).all()
    assert gpu.w4a16_dequant_reason(layer, torch.bfloat16, torch.device("cpu")) == "CUDA only (the layer is on cpu)"


def _fp8_layer(n: int, k: int, granularity: str, static: bool) -> QuantLinear:
    from compress.core.primitives import cast_fp8, compute_qparams
    act = ActScheme("fp8_e4m3", "tensor", dynamic=False) if static else ActScheme("fp8_e4m3", "token")
    s = scheme("fp8_e4m3", granularity, None, True, act=act)
    w = torch.randn(n, k, generator=GEN)
    scale, _ = compute_qparams(w, s)
    qt = QuantizedTensor.from_codes(cast_fp8(w / scale, "fp8_e4m3"), scale, None, s)
    layer = QuantLinear.from_module(torch.nn.Linear(k, n, bias=True, dtype=torch.bfloat16), qt)
    if static:  # a calibrated scale: |x| up to 5 (the test inputs' range) maps to the e4m3 maximum
        layer.input_scale.fill_(5.0 / 448)
    return layer


@pytest.mark.parametrize("k,granularity,static", [(128, "channel", False), (200, "channel", False),
                                                  (128, "tensor", False), (128, "tensor", True),
                                                  (128, "channel", True)])
def test_fp8_quantize_then_scaled_mm_entry_matches_the_layer(k, granularity, static):
    """Our per-token quantization (the op's reference path here) feeding torch._scaled_mm with rowwise scales, on our
    GEMM's operands (K = 200 zero-padded to 208): equal to our fp8 layer's path up to the bf16 output rounding, with
    and without use_fast_accum; per-tensor weight scales expanded to [1, N], static input scales to [M, 1] (per
    tensor on both sides: tensorwise)."""
    n = 64
    layer = _fp8_layer(n, k, granularity, static)
    assert (layer.input_scale is not None) == static
    x = torch.randn(6, k, generator=GEN).bfloat16()
    bias = layer.bias.detach()
    p = gpu.prepare_fp8(layer, torch.bfloat16)
    ours = gpu.linear_fp8(p, x, bias).double()
    for fast in (False, True):
        y = gpu.linear_fp8_scaled_mm(p, x, bias, use_fast_accum=fast)
        assert y.shape == (6, n) and y.dtype == torch.bfloat16
        assert ((y.double() - ours).norm() / ours.norm()).item() < 1e-2
    ref = layer(x).double()
    assert ((gpu.linear_fp8_scaled_mm(p, x, bias).double() - ref).norm() / ref.norm()).item() < 2e-2
    half = gpu.linear_fp8_scaled_mm(gpu.prepare_fp8(layer, torch.float16), x.half(), bias)
    assert half.dtype == torch.float16
    assert gpu.fp8_scaled_mm_reason(layer, torch.bfloat16, torch.device("cpu")) == "CUDA only (the layer is on cpu)"


def test_fp8_scaled_mm_entry_refuses_n_not_a_multiple_of_16(monkeypatch):
    """torch._scaled_mm's N % 16 rule on top of our fp8 layer's rules. fp8_reason itself needs a CUDA device (it asks
    for its compute capability), so it is replaced by 'accepted' here: the only mock, around what cannot run."""
    monkeypatch.setattr(gpu, "fp8_reason", lambda layer, dtype, device: None)
    assert "out_features divisible by 16 (got 40)" in gpu.fp8_scaled_mm_reason(_fp8_layer(40, 128, "channel", False),
                                                                              torch.bfloat16, torch.device("cuda"))
    assert gpu.fp8_scaled_mm_reason(_fp8_layer(48, 128, "channel", False), torch.bfloat16, torch.device("cuda")) is None


def test_cuda_registry_ranges_and_order():
    """The decode kernel is meant for M <= 16, the small-batch kernels for M <= 64, the large-batch paths for M >= 128,
    torch's own quantize + _scaled_mm for any M; the W4A16 kernels share one prepare (one packed weight per layer)."""
    k = {kern.name: kern for kern in gpu.KERNELS}
    assert list(k) == ["compress w4a16 v2 (CUDA)", "compress w4a16 (CUDA)", "compress w4a16 dequant+cuBLAS (CUDA)",
                       "torch tinygemm int4 (CUDA)", "compress fp8 w8a8 (CUDA)", "compress fp8 quantize + torch _scaled_mm (CUDA)",
                       "torch _scaled_mm fp8 (CUDA)"]
    assert k["compress w4a16 v2 (CUDA)"].rows == (1, 16)
    assert k["compress w4a16 v2 (CUDA)"].prepare is k["compress w4a16 (CUDA)"].prepare
    assert k["compress w4a16 (CUDA)"].rows == (1, 64) == k["compress fp8 w8a8 (CUDA)"].rows
    assert k["compress w4a16 dequant+cuBLAS (CUDA)"].rows == (128, None)
    assert k["compress fp8 quantize + torch _scaled_mm (CUDA)"].rows == (128, None)
    assert k["torch _scaled_mm fp8 (CUDA)"].rows is None
    assert k["compress w4a16 (CUDA)"].prepare is k["compress w4a16 dequant+cuBLAS (CUDA)"].prepare
    assert k["compress fp8 w8a8 (CUDA)"].prepare is k["compress fp8 quantize + torch _scaled_mm (CUDA)"].prepare


# ---- compile checks --------------------------------------------------------------------------------------------

N_KERNELS = 4  # 2 dtypes x (symmetric, zeros)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """dequant.cu for every shipped architecture, with torch's half-operator macros (as an extension build) and
    ptxas warnings (a spill) as errors."""
    if build.find_tool("nvcc") is None:
        pytest.skip("nvcc not found (CUDA toolkit not installed)")
    out = tmp_path_factory.mktemp("dequant")
    flags = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-D__CUDA_NO_HALF2_OPERATORS__", "-Xptxas", "-Werror,--warn-on-spills")
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {arch: pool.submit(build.compile_object, SOURCE, arch, out, flags) for arch in build.ARCHS}
        return {arch: job.result() for arch, job in jobs.items()}


@pytest.mark.parametrize("arch", list(build.ARCHS))
def test_compiles_without_spills(compiled, arch):
    _, resources = compiled[arch]
    assert len(resources) == N_KERNELS and all("w4a16_dequant_kernel" in r.name for r in resources)
    for r in resources:
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
        assert r.registers <= 64, r  # 16 blocks of 128 threads per SM need <= 32; leave room, never near 255
        assert r.smem_bytes == 32 * DEQUANT_ROW_WORDS * 4, r  # the staged tile, 8704 bytes


@pytest.mark.parametrize("arch", list(build.ARCHS))
def test_sass_reads_and_writes_16_byte_words(compiled, arch):
    """Per thread: one 16-byte streaming load of codes (L1 bypassed), 16 conflict-free 32-bit shared stores, then
    four 16-byte shared loads and four 16-byte global stores; packed 16-bit fma, no local memory, no division."""
    if build.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    obj, _ = compiled[arch]
    functions = {n: t for n, t in build.sass_functions(build.sass(obj)).items() if "w4a16_dequant_kernel" in n}
    assert len(functions) == N_KERNELS
    for name, text in functions.items():
        ops_ = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\d\s+)?([A-Z0-9_.]+)", text)]
        count = lambda prefix: sum(op.startswith(prefix) for op in ops_)  # noqa: E731
        assert count("LDG.E.NA.128") == 1, (arch, name)
        assert count("STG.E.128") == 4 and count("LDS.128") == 4, (arch, name)
        assert sum(op == "STS" for op in ops_) == 16, (arch, name)
        assert count("STG") == 4 and count("LDL") == 0 and count("STL") == 0, (arch, name)
        assert count("HFMA2") + count("HMUL2") >= 16, (arch, name)   # a packed op per two weights at least
        assert count("MUFU") == 0 and count("CALL") == 0 and count("I2F") == 0, (arch, name)
        bf16 = re.search(r"w4a16_dequant_kernelILi(\d)E", name).group(1) == "1"
        assert ("BF16_V2" in text) == bf16, (arch, name)
