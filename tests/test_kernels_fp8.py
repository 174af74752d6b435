"""fp8 GEMM kernel (compress/kernels/cuda/fp8.cu) without a GPU: the CPU layout model, the oracle, the shape
rules, and compile-time checks of the SASS each architecture gets."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from compress.kernels import build
from compress.kernels import fp8_layout as L

FP8_CU = build.CUDA_DIR / "fp8.cu"
SOURCE = FP8_CU.read_text()


# ------------------------------------------------------------------------------------------------
# Layout model: loader placement == where the tensor cores read.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bm", [64, 128])
def test_wgmma_reads_what_the_loader_wrote(bm):
    # base 5 * 1024: what aligned_smem_base yields; stage 1 checks the per-stage offsets too
    assert L.simulate_wgmma(base=5 * 1024, bm=bm, stage=1) == []
    assert L.simulate_wgmma(base=0, bm=bm, stage=L.STAGES[90] - 1) == []


def test_wgmma_model_catches_a_misaligned_swizzle_atom():
    # The 128B swizzle XORs absolute address bits: a tile not on a 1024-byte boundary is read scrambled.
    # (This is why the kernel rounds its dynamic shared memory base up to 1024.)
    errors = L.simulate_wgmma(base=5 * 1024 + 512, bm=64)
    assert len(errors) > 1000


def test_wgmma_model_catches_a_wrong_swizzle_mode(monkeypatch):
    real = L.make_smem_desc
    no_swizzle = lambda addr, lbo, sbo, swizzle: real(addr, 16, 128, L.SWIZZLE_NONE)  # noqa: E731
    monkeypatch.setattr(L, "make_smem_desc", no_swizzle)
    assert len(L.simulate_wgmma(base=0, bm=64)) > 1000


def test_no_swizzle_canonical_layout_follows_core_matrices():
    # no swizzle: 8 x 16-byte core matrices; LBO steps along K, SBO along M/N (PTX ISA canonical layout)
    desc = L.make_smem_desc(2048, lbo=256, sbo=512, swizzle=L.SWIZZLE_NONE)
    assert L.wgmma_read_offset(desc, 0, 0) == 2048
    assert L.wgmma_read_offset(desc, 3, 5) == 2048 + 3 * 16 + 5
    assert L.wgmma_read_offset(desc, 0, 16) == 2048 + 256
    assert L.wgmma_read_offset(desc, 9, 17) == 2048 + 512 + 16 + 256 + 1


def test_loader_writes_every_byte_once_inside_its_tile():
    for rows, threads in ((64, 128), (128, 256)):
        offs = L.loader_offsets(rows, threads)
        assert len(offs) == rows * L.BK
        assert sorted(offs.values()) == list(range(rows * L.BK))
        # the swizzle is a permutation of 16-byte chunks within each 128-byte row
        for (r, kb), off in offs.items():
            assert off // 128 == r and off % 16 == kb % 16


@pytest.mark.parametrize("bm", [64, 128])
def test_sm89_ldmatrix_fragments_read_what_the_loader_wrote(bm):
    assert L.simulate_mma_sm89(base=0, bm=bm, stage=L.STAGES[89] - 1) == []


def test_wgmma_accumulator_positions_cover_the_tile_once():
    seen = {L.wgmma_accumulator_position(w, lane, v) for w in range(4) for lane in range(32) for v in range(64)}
    assert len(seen) == 4 * 32 * 64 and seen == {(r, c) for r in range(64) for c in range(128)}
    # warp 1, lane 5 (g = 1, t = 1), v = 6 (n-block 1, h = 1, e = 0): row 16 + 1 + 8, col 8 + 2
    assert L.wgmma_accumulator_position(1, 5, 6) == (25, 10)


def test_epilogue_in_source_matches_accumulator_model():
    # the sm_90a epilogue stores acc[4i], acc[4i+1] at row, col..col+1 and acc[4i+2], acc[4i+3] at row + 8
    assert "const int row = m0 + wg * 64 + warp * 16 + (lane >> 2);" in SOURCE
    assert "const int col = n0 + i * 8 + 2 * (lane & 3);" in SOURCE
    assert "acc[4 * i + 0], acc[4 * i + 1]" in SOURCE and "row + 8, col, acc[4 * i + 2], acc[4 * i + 3]" in SOURCE
    for i in range(16):
        for lane in range(32):
            assert L.wgmma_accumulator_position(2, lane, 4 * i) == (32 + lane // 4, i * 8 + 2 * (lane & 3))
            assert L.wgmma_accumulator_position(2, lane, 4 * i + 3) == (40 + lane // 4, i * 8 + 2 * (lane & 3) + 1)


# ------------------------------------------------------------------------------------------------
# Descriptor packing (PTX ISA "Matrix Descriptor Format") and that the .cu encodes the same.
# ------------------------------------------------------------------------------------------------
def test_make_smem_desc_bit_fields():
    desc = L.make_smem_desc(0x1400, 16, 1024, L.SWIZZLE_128B)
    # start 0x1400 >> 4 = 0x140 in bits 0-13; LBO 16 >> 4 = 1 at bit 16; SBO 1024 >> 4 = 64 at bit 32; 1 at bit 62
    assert desc == 0x140 | (1 << 16) | (64 << 32) | (1 << 62) == 0x4000_0040_0001_0140
    assert L.decode_smem_desc(desc) == {"start": 0x1400, "lbo": 16, "sbo": 1024, "base_offset": 0, "swizzle": 1}
    assert L.make_smem_desc(0x3FFF0, 0, 0, 0) == 0x3FFF  # 18-bit address, 14-bit field
    assert L.make_smem_desc(0x40010, 0, 0, 0) == 0x1  # bits above 18 are dropped
    assert L.make_smem_desc(0, 0, 0, L.SWIZZLE_32B) == 3 << 62


def test_cuda_descriptor_matches_python_mirror():
    body = re.search(r"constexpr uint64_t make_smem_desc\([^)]*\) \{(.*?)\n\}", SOURCE, re.S).group(1)
    assert "(addr & 0x3FFFF) >> 4" in body and "(lbo & 0x3FFFF) >> 4) << 16" in body
    assert "(sbo & 0x3FFFF) >> 4) << 32" in body and "(swizzle & 3) << 62" in body
    assert re.search(r"kSwizzle128B = 1;", SOURCE)
    assert "make_smem_desc(a_base + kk * 32, 16, 1024, kSwizzle128B)" in SOURCE
    assert "make_smem_desc(b_base + kk * 32, 16, 1024, kSwizzle128B)" in SOURCE
    assert "row * 128 + ((((kb >> 4) ^ (row & 7))) << 4) + (kb & 15)" in SOURCE  # swizzle128


def test_cuda_addressing_matches_python_mirror():
    # the formulas simulate_wgmma / simulate_mma_sm89 copy; a change in the kernel must be made in the model too
    for line in (
        "const int r = i >> 3, c = i & 7;",
        "cp_async16(tile + swizzle128(r, c * 16), src, ok ? 16 : 0);",
        "auto a_tile = [&](int s) { return smem + s * stage_bytes(BM); };",
        "auto b_tile = [&](int s) { return smem + s * stage_bytes(BM) + BM * kBK; };",
        "const uint32_t a_base = a_tile(s) + wg * 64 * kBK;",
        "const int a_row = wm * 64 + (lane & 7) + ((lane >> 3) & 1) * 8, a_kb = (lane >> 4) * 16;",
        "const int b_row = wn * 32 + (lane & 7) + (lane >> 4) * 8, b_kb = ((lane >> 3) & 1) * 16;",
        "ldmatrix_x4(af[i], at + swizzle128(a_row + i * 16, kk * 32 + a_kb));",
        "ldmatrix_x4(bf[j], bt + swizzle128(b_row + j * 16, kk * 32 + b_kb));",
        "mma_e4m3(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);",
        "constexpr int stage_bytes(int bm) { return (bm + kBN) * kBK; }",
    ):
        assert line in SOURCE, line


# ------------------------------------------------------------------------------------------------
# Shape rules.
# ------------------------------------------------------------------------------------------------
def test_fp8_supported_rules():
    assert L.fp8_supported(1, 4096, 4096, 90) is None
    assert L.fp8_supported(77, 8, 16, 89) is None
    assert "sm 89" in L.fp8_supported(128, 128, 128, 80)
    assert "sm 89" in L.fp8_supported(128, 128, 128, 100)
    assert L.fp8_supported(0, 128, 128, 90) == "M must be >= 1"
    assert L.fp8_supported(1, 100, 128, 90) == "N must be a positive multiple of 8"
    assert L.fp8_supported(1, 0, 128, 90) == "N must be a positive multiple of 8"
    assert L.fp8_supported(1, 128, 136, 90) == "K must be a positive multiple of 16"
    assert L.fp8_supported(1, 128, 0, 89) == "K must be a positive multiple of 16"
    assert L.fp8_supported(1, 65536 * 128, 128, 90) == "N too large for the grid"
    assert L.block_m(64) == 64 and L.block_m(65) == 128


def test_layer_rule_pads_k_to_16():
    """A layer's K is zero-padded to a multiple of 16 (the kernel's 16-byte copies); partial M, N and K tiles need
    nothing, the kernel zero-fills them."""
    assert [L.fp8_padded_k(k) for k in (1, 16, 200, 576)] == [16, 16, 208, 576]
    assert L.fp8_supported(1, 64, 200, 90) == "K must be a positive multiple of 16"
    assert L.fp8_layer_supported(64, 200, 90) is None and L.fp8_layer_supported(576, 576, 89) is None
    assert L.fp8_layer_supported(100, 576, 90) == "N must be a positive multiple of 8"
    assert "sm 89" in L.fp8_layer_supported(64, 576, 80)


def test_shape_rules_mirror_the_c_source():
    body = re.search(r"fp8_unsupported_reason\(int M, int N, int K, int sm\) \{(.*?)\n\}", SOURCE, re.S).group(1)
    c_messages = re.findall(r'return "([^"]+)";', body)
    py_messages = [L.fp8_supported(128, 128, 128, 80), L.fp8_supported(0, 128, 128, 90),
                   L.fp8_supported(1, 7, 128, 90), L.fp8_supported(1, 128, 8, 90),
                   L.fp8_supported(1, 65536 * 128, 128, 90)]
    assert c_messages == py_messages
    assert re.search(r"kBN = 128;", SOURCE) and re.search(r"kBK = 128;", SOURCE)
    assert re.search(r"kStagesSm90 = %d;" % L.STAGES[90], SOURCE)
    assert re.search(r"kStagesSm89 = %d;" % L.STAGES[89], SOURCE)


# ------------------------------------------------------------------------------------------------
# The oracle.
# ------------------------------------------------------------------------------------------------
def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("per_row,per_col", [(True, True), (False, False), (True, False)])
def test_reference_against_plain_float(per_row, per_col):
    M, N, K = 5, 24, 48
    a, b = _fp8((M, K), 0), _fp8((N, K), 1)
    g = torch.Generator().manual_seed(2)
    sa = torch.rand(M if per_row else 1, generator=g) + 0.01
    sb = torch.rand(N if per_col else 1, generator=g) + 0.01
    out = L.fp8_reference(a, b, sa, sb)
    assert out.dtype == torch.float64 and out.shape == (M, N)
    for m, n in ((0, 0), (4, 23), (2, 11)):
        want = sum(float(a[m, k].float()) * float(b[n, k].float()) for k in range(K))
        want *= float(sa[m if per_row else 0]) * float(sb[n if per_col else 0])
        assert out[m, n].item() == pytest.approx(want, rel=1e-12)
    full = (a.float() * sa.reshape(-1, 1)) @ (b.float() * sb.reshape(-1, 1)).T
    torch.testing.assert_close(out.float(), full, rtol=1e-5, atol=1e-3)


def test_quantize_rows_reference():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 64, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0
    q, s = L.fp8_quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s[2].item() == pytest.approx(1e-12) and (q[2].float() == 0).all()
    absmax = x.float().abs().amax(1)
    torch.testing.assert_close(s[[0, 1, 3]], absmax[[0, 1, 3]] / 448)
    assert (q.float().abs().amax(1)[[0, 1, 3]] == 448).all()  # the absmax element maps to +-448 exactly
    # dequantized values are within half an e4m3 ulp (3 mantissa bits: 2**-4 relative) of x
    err = (q.float() * s[:, None] - x.float()).abs()
    assert (err <= x.float().abs() * 2**-4 + s[:, None] * 2**-9 + 1e-30).all()


# ------------------------------------------------------------------------------------------------
# Compile checks: one build per architecture per session.
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if build.find_tool("nvcc") is None:
        pytest.skip("nvcc not found (install the CUDA toolkit or set CUDA_HOME)")
    out = tmp_path_factory.mktemp("fp8_build")
    # -Werror: a ptxas warning (e.g. wgmma serialized, or a spill with --warn-on-spills) fails the build
    extra = ("-Xptxas", "-Werror,--warn-on-spills")
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = {arch: pool.submit(build.compile_object, FP8_CU, arch, out, extra) for arch in build.ARCHS}
        return {arch: job.result() for arch, job in jobs.items()}


@pytest.fixture(scope="module")
def sass_by_arch(built):
    if build.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    return {arch: build.sass_functions(build.sass(obj)) for arch, (obj, _) in built.items()}


def _kernels(functions: dict[str, str], name: str) -> dict[str, str]:
    found = {k: v for k, v in functions.items() if name in k}
    assert found, f"no {name} kernel in {list(functions)}"
    return found


def test_every_kernel_compiles_without_spills(built):
    for arch, (_, resources) in built.items():
        names = {r.name for r in resources}
        # 2 x sm90 gemm, 2 x sm89 gemm, quantize: 2 scalar + 2 x 4 vector (chunks a thread 1, 2, 4, 8)
        assert len(resources) == 14, (arch, names)
        for r in resources:
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0, r
            assert r.registers <= 255, r


def test_sm90a_uses_wgmma(sass_by_arch):
    fns = sass_by_arch["sm_90a"]
    for name, body in _kernels(fns, "fp8_gemm_sm90").items():
        counts = build.instruction_counts(body)
        assert counts["QGMMA"] >= 4, (name, counts)  # four k32 slices per 128-byte stage
        assert counts["LDGSTS"] > 0 and counts["HMMA"] == 0 and counts["QMMA"] == 0, (name, counts)
        qgmma = len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3\b", body))
        depbar = len(re.findall(r"WARPGROUP\.DEPBAR", body))
        assert qgmma == counts["QGMMA"] and depbar < qgmma, (qgmma, depbar)  # not serialized one by one
    for name, body in fns.items():
        counts = build.instruction_counts(body)
        assert counts["LDL"] == 0 and counts["STL"] == 0, (name, counts)


def test_sm89_uses_fp8_mma(sass_by_arch):
    fns = sass_by_arch["sm_89"]
    for name, body in _kernels(fns, "fp8_gemm_sm89").items():
        counts = build.instruction_counts(body)
        assert counts["QMMA"] >= 64 and counts["LDSM"] > 0 and counts["LDGSTS"] > 0, (name, counts)
        assert counts["HMMA"] == 0, (name, counts)
    for name, body in fns.items():
        counts = build.instruction_counts(body)
        assert counts["LDL"] == 0 and counts["STL"] == 0, (name, counts)


def test_sm80_build_has_stub_gemms_and_a_quantizer(sass_by_arch):
    fns = sass_by_arch["sm_80"]
    for name, body in _kernels(fns, "fp8_gemm").items():
        counts = build.instruction_counts(body)
        assert counts["QMMA"] == counts["QGMMA"] == counts["HMMA"] == 0, (name, counts)
        assert "BPT.TRAP" in body, name  # a wrong-binary launch fails loudly
    assert len(_kernels(fns, "fp8_quantize_rows")) == 10  # scalar + 4 vector (their sm_80 bodies trap), x 2 dtypes
