"""CPU model of the fp8 GEMM kernel's shared-memory layout (compress/kernels/cuda/fp8.cu), and its oracle.

The kernel cannot run here, so the part that is easiest to get wrong without a GPU, namely where the
loader puts each byte and where the tensor cores then read it, is modelled in plain Python with the
kernel's own formulas:

* `swizzle128` / `loader_offsets` copy the loader (`load_tile` / `swizzle128` in fp8.cu);
* `make_smem_desc` copies the wgmma matrix-descriptor packing, and `kernel_desc_a` / `kernel_desc_b` the
  descriptors the sm_90a kernel encodes;
* `wgmma_read_offset` is written independently from the PTX ISA's description of the canonical K-major
  layouts (section "Asynchronous Warpgroup Level Matrix Shared Memory Layout": core matrices of 8 rows x
  16 bytes, "Matrix Descriptor Format", "Swizzling modes"), i.e. where wgmma will read element (row, k);
* `ldmatrix_fragment_element` / `mma_fragment_a` / `mma_fragment_b` describe the sm_89 path's fragments
  (PTX ISA "ldmatrix" and "Matrix Fragments for mma.m16n8k32").

`simulate_*` functions fill a model of shared memory with element ids the way the loader does and read
them back the way the tensor cores do; a test asserts that every element arrives where it should.

`fp8_reference` is the float64 oracle for the GEMM and `fp8_supported` mirrors the C shape rules;
`fp8_layer_supported` is the rule for a layer whose K gets zero-padded to a multiple of 16 first.
"""
from __future__ import annotations

import torch
from torch import Tensor

BN = 128          # output columns per CTA
BK = 128          # K bytes per pipeline stage (one 128-byte swizzle row)
SMEM_ALIGN = 1024  # a 128B-swizzle atom: 8 rows x 128 bytes
STAGES = {90: 6, 89: 3}
WGMMA_K = 32      # k of wgmma.m64nNk32 for e4m3: 32 one-byte elements per row
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3  # descriptor bits 62-63 (PTX ISA)
E4M3_MAX = 448.0  # largest finite float8 e4m3fn (OCP 8-bit floating point specification)


# --------------------------------------------------------------------------------------------------
# Shape rules: the same checks, in the same order, with the same messages as fp8_unsupported_reason.
# --------------------------------------------------------------------------------------------------
def fp8_supported(M: int, N: int, K: int, sm: int) -> str | None:
    """None when the CUDA kernel handles this GEMM on compute capability `sm`, else why not."""
    if sm not in (89, 90):
        return "fp8 kernels need sm 89 (mma.sync e4m3) or sm 90 (wgmma)"
    if M < 1:
        return "M must be >= 1"
    if N < 8 or N % 8 != 0:
        return "N must be a positive multiple of 8"
    if K < 16 or K % 16 != 0:
        return "K must be a positive multiple of 16"
    if (N + BN - 1) // BN > 65535:
        return "N too large for the grid"
    return None


K_ALIGN = 16  # the kernel copies K in 16-byte chunks that never straddle a row's end (fp8_supported)


def fp8_padded_k(K: int) -> int:
    """K rounded up to K_ALIGN: the K a layer's fp8 weight is stored with (gpu.pack_fp8)."""
    return -(-K // K_ALIGN) * K_ALIGN


def fp8_layer_supported(N: int, K: int, sm: int) -> str | None:
    """None when a layer [N, K] runs on the kernel once K is zero-padded to fp8_padded_k(K), else why not. The
    kernel itself handles partial M, N and K tiles (zero-filled copies), so only K % 16 needs padding."""
    return fp8_supported(1, N, fp8_padded_k(K), sm)


def block_m(M: int) -> int:
    """Rows per CTA the launcher picks: 64 for small M (decode), else 128."""
    return 64 if M <= 64 else 128


def stage_bytes(bm: int) -> int:
    """Bytes of one pipeline stage: the A tile [bm x 128] followed by the B tile [128 x 128]."""
    return (bm + BN) * BK


# --------------------------------------------------------------------------------------------------
# The loader (mirrors fp8.cu: swizzle128, load_tile).
# --------------------------------------------------------------------------------------------------
def swizzle128(row: int, kb: int) -> int:
    """Byte offset of K byte kb (0..127) of tile row `row`: row * 128, 16-byte chunk kb // 16 moved to
    chunk position (kb // 16) ^ (row % 8)."""
    return row * 128 + ((((kb >> 4) ^ (row & 7))) << 4) + (kb & 15)


def loader_offsets(rows: int, threads: int) -> dict[tuple[int, int], int]:
    """{(tile row, K byte): byte offset in the tile} for every byte the loader's cp.async copies write,
    enumerated the way load_tile enumerates them (thread tid, iteration it -> chunk tid + it * threads)."""
    assert (rows * 8) % threads == 0
    out: dict[tuple[int, int], int] = {}
    for tid in range(threads):
        for it in range(rows * 8 // threads):
            i = tid + it * threads
            r, c = i >> 3, i & 7
            dst = swizzle128(r, c * 16)
            for byte in range(16):  # one 16-byte cp.async
                out[(r, c * 16 + byte)] = dst + byte
    return out


# --------------------------------------------------------------------------------------------------
# wgmma matrix descriptors (PTX ISA "Matrix Descriptor Format"; mirrors make_smem_desc in fp8.cu).
# --------------------------------------------------------------------------------------------------
def _encode(x: int) -> int:
    """matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4: 18-bit shared address in 16-byte units."""
    return (x & 0x3FFFF) >> 4


def make_smem_desc(addr: int, lbo: int, sbo: int, swizzle: int) -> int:
    """64-bit descriptor: bits 0-13 start address, 16-29 leading-dimension byte offset, 32-45 stride-dimension
    byte offset (all encoded), 49-51 base offset (0), 62-63 swizzle mode."""
    return _encode(addr) | (_encode(lbo) << 16) | (_encode(sbo) << 32) | ((swizzle & 3) << 62)


def decode_smem_desc(desc: int) -> dict[str, int]:
    """Inverse of make_smem_desc, in bytes."""
    return {
        "start": (desc & 0x3FFF) << 4,
        "lbo": ((desc >> 16) & 0x3FFF) << 4,
        "sbo": ((desc >> 32) & 0x3FFF) << 4,
        "base_offset": (desc >> 49) & 0x7,
        "swizzle": (desc >> 62) & 0x3,
    }


def kernel_desc_a(base: int, bm: int, stage: int, wg: int, kk: int) -> int:
    """The A descriptor fp8_gemm_sm90 builds for stage `stage`, warpgroup `wg`, k32 slice `kk`
    (a_base + kk * 32, LBO 16, SBO 1024, 128B swizzle)."""
    a_base = base + stage * stage_bytes(bm) + wg * 64 * BK
    return make_smem_desc(a_base + kk * WGMMA_K, 16, 1024, SWIZZLE_128B)


def kernel_desc_b(base: int, bm: int, stage: int, kk: int) -> int:
    """The B descriptor fp8_gemm_sm90 builds (the B tile follows the bm-row A tile in each stage)."""
    b_base = base + stage * stage_bytes(bm) + bm * BK
    return make_smem_desc(b_base + kk * WGMMA_K, 16, 1024, SWIZZLE_128B)


def wgmma_read_offset(desc: int, row: int, kb: int) -> int:
    """Shared address wgmma reads for byte kb (0..31) of row `row` of a K-major operand described by `desc`.

    PTX ISA canonical K-major layouts: the operand is built from core matrices of 8 rows x 16 bytes.
    * No swizzle: a core matrix is 128 contiguous bytes (row i at +16 i); core matrices adjacent along K are
      LBO apart, those adjacent along M/N are SBO apart.
    * 128B swizzle: each row is 128 bytes, 8 rows form a 1024-byte atom (8-row groups SBO apart), a k-slice
      is an offset from the start address inside the row, and the hardware then XORs address bits [4:6]
      with bits [7:9] (CUTLASS Swizzle<3,4,3>). The base-offset field (0 here) would correct for an atom
      not aligned to 1024 bytes; we model only the aligned case and refuse others.
    """
    d = decode_smem_desc(desc)
    if d["base_offset"] != 0:
        raise NotImplementedError("matrix base offset != 0 is not modelled")
    if d["swizzle"] == SWIZZLE_NONE:
        return d["start"] + (row % 8) * 16 + (row // 8) * d["sbo"] + (kb // 16) * d["lbo"] + kb % 16
    if d["swizzle"] == SWIZZLE_128B:
        assert 0 <= kb < WGMMA_K
        addr = d["start"] + (row % 8) * 128 + (row // 8) * d["sbo"] + kb
        return addr ^ (((addr >> 7) & 7) << 4)
    raise NotImplementedError("only the no-swizzle and 128B-swizzle modes are modelled")


# --------------------------------------------------------------------------------------------------
# Simulation: loader writes element ids, the tensor cores read them back.
# --------------------------------------------------------------------------------------------------
def _fill_stage(base: int, bm: int, stage: int, threads: int) -> dict[int, tuple[str, int, int]]:
    """Model of shared memory after the loader filled stage `stage`: {address: (operand, tile row, K byte)}.
    Raises if two copies land on the same byte."""
    mem: dict[int, tuple[str, int, int]] = {}
    tile_base = {"a": base + stage * stage_bytes(bm), "b": base + stage * stage_bytes(bm) + bm * BK}
    for name, rows in (("a", bm), ("b", BN)):
        for (r, kb), off in loader_offsets(rows, threads).items():
            addr = tile_base[name] + off
            if addr in mem:
                raise AssertionError(f"loader writes {mem[addr]} and {(name, r, kb)} to the same byte {addr}")
            mem[addr] = (name, r, kb)
    return mem


def simulate_wgmma(base: int, bm: int, stage: int = 0) -> list[str]:
    """Fill one stage like fp8_gemm_sm90 and read every A (64 x 32 per warpgroup) and B (128 x 32) k-slice
    through the kernel's descriptors. Returns the mismatches (empty when the layout is right)."""
    mem = _fill_stage(base, bm, stage, threads=2 * bm)
    errors = []
    for kk in range(BK // WGMMA_K):
        for wg in range(bm // 64):
            desc = kernel_desc_a(base, bm, stage, wg, kk)
            for m in range(64):
                for k in range(WGMMA_K):
                    want = ("a", wg * 64 + m, kk * WGMMA_K + k)
                    got = mem.get(wgmma_read_offset(desc, m, k))
                    if got != want:
                        errors.append(f"A wg{wg} kk{kk} ({m},{k}): read {got}, want {want}")
        desc = kernel_desc_b(base, bm, stage, kk)
        for n in range(BN):
            for k in range(WGMMA_K):
                want = ("b", n, kk * WGMMA_K + k)
                got = mem.get(wgmma_read_offset(desc, n, k))
                if got != want:
                    errors.append(f"B kk{kk} ({n},{k}): read {got}, want {want}")
    return errors


def mma_fragment_a(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, k) of the A[16 x 32] element in byte `byte` of register a{reg} of `lane` (PTX ISA "Matrix
    Fragments for mma.m16n8k32", 8-bit types): row g (+8 for a1, a3), col 4t + byte (+16 for a2, a3)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (reg & 1), 4 * t + byte + 16 * (reg >> 1)


def mma_fragment_b(lane: int, reg: int, byte: int) -> tuple[int, int]:
    """(n, k) of the B[32 x 8] element in byte `byte` of b{reg}: k = 4t + byte (+16 for b1), n = g."""
    g, t = lane // 4, lane % 4
    return g, 4 * t + byte + 16 * reg


def ldmatrix_fragment_element(addresses: list[int], lane: int, reg: int, byte: int) -> int:
    """Address whose byte lands in byte `byte` of register `reg` of `lane` after ldmatrix.m8n8.x4.b16:
    matrix reg's row lane // 4 comes from the address lanes 8 reg .. 8 reg + 7 supplied, and the lane holds
    its 32-bit word lane % 4 (PTX ISA "ldmatrix")."""
    return addresses[8 * reg + lane // 4] + 4 * (lane % 4) + byte


def simulate_mma_sm89(base: int, bm: int, stage: int = 0) -> list[str]:
    """Fill one stage like fp8_gemm_sm89 and read every fragment through the kernel's ldmatrix addresses
    (a_row / a_kb / b_row / b_kb and swizzle128 in fp8.cu). Returns the mismatches."""
    mem = _fill_stage(base, bm, stage, threads=2 * bm)
    a_tile = base + stage * stage_bytes(bm)
    b_tile = a_tile + bm * BK
    errors = []
    for warp in range(bm // 16):
        wm, wn = warp >> 2, warp & 3
        a_row = [wm * 64 + (ln & 7) + ((ln >> 3) & 1) * 8 for ln in range(32)]
        a_kb = [(ln >> 4) * 16 for ln in range(32)]
        b_row = [wn * 32 + (ln & 7) + (ln >> 4) * 8 for ln in range(32)]
        b_kb = [((ln >> 3) & 1) * 16 for ln in range(32)]
        for kk in range(BK // 32):
            for i in range(4):
                addrs = [a_tile + swizzle128(a_row[ln] + i * 16, kk * 32 + a_kb[ln]) for ln in range(32)]
                for lane in range(32):
                    for reg in range(4):
                        for byte in range(4):
                            r, k = mma_fragment_a(lane, reg, byte)
                            want = ("a", wm * 64 + i * 16 + r, kk * 32 + k)
                            got = mem.get(ldmatrix_fragment_element(addrs, lane, reg, byte))
                            if got != want:
                                errors.append(f"A warp{warp} kk{kk} i{i} lane{lane} a{reg}[{byte}]: {got} != {want}")
            for j in range(2):  # one ldmatrix.x4 covers n-tiles 2j (regs 0, 1) and 2j + 1 (regs 2, 3)
                addrs = [b_tile + swizzle128(b_row[ln] + j * 16, kk * 32 + b_kb[ln]) for ln in range(32)]
                for lane in range(32):
                    for reg in range(4):
                        for byte in range(4):
                            n, k = mma_fragment_b(lane, reg & 1, byte)
                            want = ("b", wn * 32 + (2 * j + (reg >> 1)) * 8 + n, kk * 32 + k)
                            got = mem.get(ldmatrix_fragment_element(addrs, lane, reg, byte))
                            if got != want:
                                errors.append(f"B warp{warp} kk{kk} j{j} lane{lane} r{reg}[{byte}]: {got} != {want}")
    return errors


def wgmma_accumulator_position(warp: int, lane: int, v: int) -> tuple[int, int]:
    """(row, col) of accumulator register d[v] of a wgmma .m64nN f32 D fragment (PTX ISA "Register Fragments",
    wgmma D layout), as the sm_90a epilogue assumes: row 16 warp + lane / 4 + 8 ((v / 2) % 2),
    col 8 (v / 4) + 2 (lane % 4) + v % 2."""
    return 16 * warp + lane // 4 + 8 * ((v >> 1) & 1), 8 * (v >> 2) + 2 * (lane & 3) + (v & 1)


# --------------------------------------------------------------------------------------------------
# The oracle.
# --------------------------------------------------------------------------------------------------
def fp8_reference(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor) -> Tensor:
    """out[M, N] float64 = (a[M, K] * a_scale) @ (b[N, K] * b_scale)^T with the fp8 operands dequantized
    exactly. a_scale is [M] or [1] (per row / per tensor), b_scale [N] or [1] (per column / per tensor)."""
    M, K = a.shape
    N, Kb = b.shape
    assert K == Kb, (a.shape, b.shape)
    assert a_scale.numel() in (1, M) and b_scale.numel() in (1, N)
    ad = a.to(torch.float64) * a_scale.to(torch.float64).reshape(-1, 1)
    bd = b.to(torch.float64) * b_scale.to(torch.float64).reshape(-1, 1)
    return ad @ bd.T


def fp8_quantize_rows_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """What compress_fp8_quantize_rows computes: scale[m] = max(absmax_m / 448, 1e-12) in fp32 and
    q = saturate(x / scale) rounded to nearest even, as float8_e4m3fn."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    # divide by a tensor, not a Python float: on CUDA torch computes a / scalar as a * (1 / scalar), one ulp off
    # the kernel's true division in about half the rows (aten BinaryDivTrueKernel.cu)
    scale = torch.clamp(amax / torch.full_like(amax, E4M3_MAX), min=1e-12)
    q = (xf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
