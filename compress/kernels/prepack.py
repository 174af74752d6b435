"""Packing for the W4A16 CUDA kernel (compress/kernels/cuda/w4a16.cu), in pure torch on the codes' own device.

`prepack_w4a16` shuffles int4 codes into the kernel's layout, so that each GPU thread loads all the mma
B-fragments of one k32 x n32 tile as one 128-bit word. `emulate_w4a16_codes` replays, on the CPU, how the
kernel reads that layout (block / stage / warp / lane / word / register indices, with the .cu's formulas) and
where each decoded code lands in the mma: the CPU test of the layout logic, since the kernel cannot run here.
`emulate_w4a16_gemm` replays the whole kernel (x tile, scales, reduction, stores) the same way.
`w4a16_supported` mirrors the C function `compress_w4a16_supported`, `w4a16_config` the launcher's tile choice,
and `w4a16_reference` is the float64 oracle the kernel is checked against. `pad_k_w4a16` zero-pads a layer whose
K is not a multiple of the k-tile (SmolLM2-135M: K = 576) so that the kernel runs it; `w4a16_layer_supported`
is the rule for such layers.

The layout (see the comment block at the top of w4a16.cu; fragment layouts from the PTX ISA, "Matrix fragments
for mma.m16n8k16 with floating point type"): int32 words indexed

    wq[((sb * (K // 32) + ks) * 32 + lane) * 4 + j]      sb = n // 32, ks = k // 32, lane = 4 * g + t, j = 0..3

and nibble p (bits 4p..4p+3) of word j holds the code of

    n = 32 sb + 16 (j % 2) + 8 ((p % 4) >= 2) + g,      k = 32 ks + 16 (j // 2) + 2 t + (p >= 4) + 8 (p % 2).
"""
from __future__ import annotations

import torch
from torch import Tensor

STRIP = 32  # columns of one weight strip; a block takes NS = 1 or 2 strips
BK = 128    # k per pipeline stage (4 warps x k32)
THREADS = 128
WARPS = THREADS // 32
GROUP_SIZES = (32, 64, 128, -1)
MAX_M = 65535 * 64


def w4a16_supported(M: int, N: int, K: int, group_size: int) -> str | None:
    """None when the kernel handles the shape, else the reason (the same rules as compress_w4a16_supported
    in w4a16.cu, which also requires sm >= 80 and dtype fp16 / bf16)."""
    if M < 1 or M > MAX_M:
        return f"M={M} is outside 1..{MAX_M} (gridDim.y <= 65535 blocks of 64 rows)"
    if N < STRIP or N % STRIP:
        return (f"N={N} is not a positive multiple of {STRIP} (the W4A16 kernel's n-strip); "
                "this layer takes the reference path")
    if K < BK or K % BK:
        return (f"K={K} is not a positive multiple of {BK} (the W4A16 kernel's k-tile); "
                "this layer takes the reference path")
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} is not one of {GROUP_SIZES} (-1: one group per output channel)"
    if group_size > 0 and K % group_size:
        return f"K={K} is not a multiple of group_size={group_size}"
    return None


MAX_DEQUANT_N = 65535 * STRIP  # dequant.cu: gridDim.y <= 65535 strips


def w4a16_dequant_supported(N: int, K: int, group_size: int) -> str | None:
    """None when the dequantization kernel (cuda/dequant.cu) takes a packed weight [N, K] (K the padded K), else the
    reason: the GEMM's layout rules (any M) and N <= MAX_DEQUANT_N (the same rules as compress_w4a16_dequant_supported,
    which also requires sm >= 80 and dtype fp16 / bf16)."""
    if N > MAX_DEQUANT_N:
        return f"N={N} is above {MAX_DEQUANT_N} (the dequantization kernel's grid: 65535 strips of 32 rows)"
    return w4a16_supported(1, N, K, group_size)


def padded_k(K: int) -> int:
    """K rounded up to the kernel's k-tile BK: the K a layer is packed with (pad_k_w4a16)."""
    return -(-K // BK) * BK


def w4a16_layer_supported(N: int, K: int, group_size: int) -> str | None:
    """None when a layer's weight [N, K] can run on the kernel once K is zero-padded to padded_k(K), else why not.

    Padding appends whole groups (every accepted group size divides BK, so a K that is a multiple of the group
    size stays one after padding, and no real group is split); a K the group size does not divide is refused."""
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} is not one of {GROUP_SIZES} (-1: one group per output channel)"
    if group_size > 0 and K % group_size:
        return f"K={K} is not a multiple of group_size={group_size}"
    if group_size > 0 and padded_k(K) % group_size:  # unreachable while GROUP_SIZES divide BK; kept as the rule
        return f"padding K={K} to {padded_k(K)} would split a group of {group_size}"
    return w4a16_supported(1, N, padded_k(K), group_size)


def pad_k_w4a16(u: Tensor, scales: Tensor, zeros: Tensor | None,
                group_size: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Zero-pad codes u [N, K] to [N, padded_k(K)] so that every padded weight dequantizes to exactly 0.

    Grouped scales: the padding is whole new groups of code 8 with zero point 8 (implicit when symmetric) and
    scale 0, so w = (8 - 8) * 0. One group per channel (group_size -1, where the kernel's group is the padded K):
    the padded codes take the row's own zero point (8 when symmetric), so w = (z - z) * s. The activation's
    padded columns are zeros too (gpu.linear_w4a16), so the output is unchanged. Returns (u, scales, zeros)
    in prepack_w4a16's orientation; the inputs themselves when K needs no padding."""
    N, K = u.shape
    pad = padded_k(K) - K
    if pad == 0:
        return u, scales, zeros
    if group_size == -1:
        fill = torch.full((N, 1), 8, dtype=u.dtype, device=u.device) if zeros is None else \
            zeros.reshape(N, 1).round().to(u.dtype)
        return torch.cat([u, fill.expand(N, pad)], dim=1), scales, zeros
    new_groups = pad // group_size
    u = torch.cat([u, torch.full((N, pad), 8, dtype=u.dtype, device=u.device)], dim=1)
    scales = torch.cat([scales, scales.new_zeros(N, new_groups)], dim=1)
    zeros = None if zeros is None else torch.cat([zeros, zeros.new_full((N, new_groups), 8)], dim=1)
    return u, scales, zeros


def w4a16_config(M: int, N: int, split: bool = False) -> tuple[int, int]:
    """(MT, NS): m16 tiles and 32-column strips per block, as the launcher (dispatch in w4a16.cu) picks them;
    `split`: split-K (splits > 1), whose M <= 16 blocks take up to SPLIT_NS strips."""
    if M <= 16:
        if split:
            return 1, next(ns for ns in (4, 2, 1) if ns <= SPLIT_NS and N % (ns * STRIP) == 0)
        return 1, 1
    ns = 2 if N % (2 * STRIP) == 0 else 1
    return (2 if M <= 32 else 4), ns


# Pipeline depth per m16-tile count, and the split-K blocks' (stages(mt) and kSplitStages in w4a16.cu).
STAGES = {1: 12, 2: 6, 4: 4}
SPLIT_STAGES = 6
SPLIT_NS = 2  # kSplitNS: strips of an M <= 16 split-K block
MIN_SPLIT_TILES = 4  # k-tiles a split gets at least: a shorter split spends more on its pipeline fill than it saves


def w4a16_smem(mt: int, ns: int, stages: int) -> int:
    """Dynamic shared memory of one block, in bytes (smem_bytes in w4a16.cu): per stage the x tile, the weight
    strips and the scale and zero rows."""
    return stages * (16 * mt * BK * 2 + ns * BK * STRIP // 2 + 2 * (BK // 32) * STRIP * ns * 2)


def w4a16_splits(M: int, N: int, K: int, sms: int, smem_per_sm: int) -> int:
    """Split-K count for out[M, N] = x[M, K] @ W^T on a GPU with `sms` multiprocessors of `smem_per_sm` bytes of
    shared memory: the (N / BN) x (M / BM) tiles are split along K into as many copies as one wave of resident
    blocks holds (rounded down: a second, partial wave cost more than it saved on an H200), and into 2 when the
    grid fills at most 3/4 of a wave. Bounded so that each split keeps MIN_SPLIT_TILES k-tiles and the fp32
    partial sums (written and read back: 8 * splits * M * N bytes) stay within the weight bytes (N * K / 2):
    split-K is for decode-sized M, where the kernel streams weights with too few warps. Returns 1 (no split) when
    the grid already fills the GPU. K is the padded K (a multiple of 128). Measured: bench/w4a16_splits.py."""
    mt, ns = w4a16_config(M, N, split=True)
    blocks = (N // (STRIP * ns)) * -(-M // (16 * mt))
    k_tiles = K // BK
    stages = SPLIT_STAGES if mt == 1 else STAGES[mt]
    wave = max(1, smem_per_sm // (w4a16_smem(mt, ns, stages) + 1024)) * sms  # 1 KB reserved per block
    splits = wave // blocks if wave // blocks >= 2 else (2 if 4 * blocks <= 3 * wave else 1)
    splits = min(splits, k_tiles // MIN_SPLIT_TILES, K // (16 * M))
    if splits < 2:
        return 1
    per_split = -(-k_tiles // splits)
    return -(-k_tiles // per_split)  # no split left without k-tiles


def prepack_w4a16(u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int, dtype: torch.dtype) -> dict:
    """Pack int4 codes u [N, K] (0..15) for the kernel.

    scales: [N, K // G] (G = K when group_size == -1); zeros: None (symmetric, z = 8) or [N, K // G] integers
    0..15. Returns {"wq": int32 [N * K // 8] in the kernel layout, "scales": [K // G, N] dtype contiguous,
    "zeros": [K // G, N] dtype or None, "N", "K", "group_size"}. Raises ValueError on a shape / value the
    kernel does not handle, naming the offending values.
    """
    if u.dim() != 2:
        raise ValueError(f"u must be [N, K], got shape {tuple(u.shape)}")
    if u.dtype.is_floating_point or u.dtype == torch.bool:
        raise ValueError(f"u must hold integer codes, got dtype {u.dtype}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype={dtype} is not supported (float16 or bfloat16)")
    N, K = u.shape
    reason = w4a16_supported(1, N, K, group_size)
    if reason:
        raise ValueError(reason)
    if u.numel() and (int(u.min()) < 0 or int(u.max()) > 15):
        raise ValueError(f"codes must be in 0..15, got min {int(u.min())} max {int(u.max())}")
    G = K if group_size == -1 else group_size
    if tuple(scales.shape) != (N, K // G):
        raise ValueError(f"scales must be [N, K // G] = [{N}, {K // G}], got {tuple(scales.shape)}")
    if zeros is not None:
        if tuple(zeros.shape) != (N, K // G):
            raise ValueError(f"zeros must be [N, K // G] = [{N}, {K // G}], got {tuple(zeros.shape)}")
        zf = zeros.double()
        if bool((zf != zf.round()).any()) or float(zf.min()) < 0 or float(zf.max()) > 15:
            raise ValueError(f"zeros must be integers 0..15, got min {float(zf.min())} max {float(zf.max())}")

    return {
        "wq": shuffle_w4a16(u),
        "scales": scales.t().to(dtype).contiguous(),
        "zeros": None if zeros is None else zeros.t().to(dtype).contiguous(),
        "N": N,
        "K": K,
        "group_size": group_size,
    }


def shuffle_w4a16(u: Tensor) -> Tensor:
    """The layout of the module docstring, on u's own device (a GPU packs an 8B model's codes in about a second;
    through the CPU it took minutes): int32 [N * K // 8]. The nibble (n, k) formula is a permutation of u's
    dimensions, n = 32 sb + 16 jn + 8 pn + g and k = 32 ks + 16 jk + 8 pk + 2 t + pb with j = 2 jk + jn,
    p = 4 pb + 2 pn + pk and lane = 4 g + t, so it is a view and one permute, no gather. No checks (prepack_w4a16
    makes them)."""
    N, K = u.shape
    codes = u.to(torch.int64).reshape(N // STRIP, 2, 2, 8, K // 32, 2, 2, 4, 2)  # sb jn pn g | ks jk pk t pb
    codes = codes.permute(0, 4, 3, 7, 5, 1, 8, 2, 6)  # sb ks g t | jk jn | pb pn pk
    codes = codes.reshape(N // STRIP, K // 32, 32, 4, 8)
    words = (codes << (4 * torch.arange(8, device=u.device))).sum(-1)  # 8 nibbles -> one 32-bit value (as int64)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).reshape(-1).contiguous()


def emulate_w4a16_codes(wq: Tensor, N: int, K: int, ns: int = 1) -> Tensor:
    """Replay how w4a16_kernel reads `wq` and return the code each mma uses at (n, k), as int64 [N, K].

    Mirrors the .cu step by step for blocks of `ns` strips (the kernel's NS): block bx copies stage kt with
    cp.async (thread tid copies 16-byte chunks c = tid + 128 i, i < NS, from int4 offset
    ((bx NS + c / 128) * K/32 + kt * 4) * 32 + c % 128 to shared chunk c); warp w reads, for strip st, the int4
    at shared chunk (st * 4 + w) * 32 + lane (its k32 slice); word j = 2 kh + jj serves k16 half kh and n8 tiles
    2 jj, 2 jj + 1 of the strip (block tiles st * 4 + 2 jj (+1)); register r_i of a word is
    lop3(word >> 4i, 0x000F000F, exp): low half nibble i, high half nibble i + 4; r0, r1 are (b0, b1) of the first
    tile, r2, r3 of the second; b_r's low / high half is B row (k) 2t + 8r / 2t + 8r + 1, column (n) g.
    """
    reason = w4a16_supported(1, N, K, -1)
    if reason:
        raise ValueError(reason)
    if ns not in (1, 2) or N % (STRIP * ns):
        raise ValueError(f"ns={ns} must be 1 or 2 and divide N / 32 = {N // STRIP}")
    if wq.numel() != N * K // 8:
        raise ValueError(f"wq has {wq.numel()} words, expected N * K / 8 = {N * K // 8}")
    chunks = (wq.to(torch.int64) & 0xFFFFFFFF).view(-1, 4)   # int4 granularity (what cp.async / LDS.128 move)
    out = torch.full((N, K), -1, dtype=torch.int64)
    BN = STRIP * ns
    # Every block (blockIdx.x = bx) and every pipeline k-tile kt at once: leading broadcast dims [NB, KT, 1].
    bx = torch.arange(N // BN).view(-1, 1, 1)
    kt = torch.arange(K // BK).view(1, -1, 1)
    c = (torch.arange(THREADS).view(-1, 1) + THREADS * torch.arange(ns)).reshape(-1)   # chunks of thread tid
    smem = torch.empty(N // BN, K // BK, THREADS * ns, 4, dtype=torch.int64)
    smem[:, :, c] = chunks[((bx * ns + c // 128) * (K // 32) + kt * (BK // 32)) * 32 + c % 128]
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    for warp in range(WARPS):
        for st in range(ns):
            bq = smem[:, :, (st * (BK // 32) + warp) * 32 + lane]   # [NB, KT, 32 lanes, 4 words]
            for jj in range(2):
                for kh in range(2):
                    word = bq[..., 2 * kh + jj]
                    for i in range(4):
                        v = (word >> (4 * i)) & 0x000F000F   # the lop3's AND; its OR only adds the exponent
                        lo, hi = v & 0xF, (v >> 16) & 0xF    # (exp | lo) - bias = lo, likewise hi
                        nt = st * 4 + 2 * jj + (i >= 2)      # r0, r1 -> tile 2 jj; r2, r3 -> tile 2 jj + 1
                        breg = i % 2                         # b0 or b1 of that tile's B fragment
                        n = (bx * BN + nt * 8 + g).expand_as(lo)   # B column g of n8 tile nt
                        k = (kt * BK + 32 * warp + 16 * kh + 2 * t + 8 * breg).expand_as(lo)  # rows 2t + 8 breg (+1)
                        out[n, k] = lo
                        out[n, k + 1] = hi
    return out


DEQUANT_ROW_WORDS = 128 // 2 + 4  # dequant.cu kRowWords: a shared row of 128 halves as 32-bit words, + 4 padding


def emulate_w4a16_dequant(wq: Tensor, scales: Tensor, zeros: Tensor | None, N: int, K: int,
                          group_size: int) -> tuple[Tensor, Tensor]:
    """Replay cuda/dequant.cu on the CPU with its index formulas: grid (K / 128, N / 32) of 128 threads; warp w of
    block (bx, by) loads int4 (by * K/32 + 4 bx + w) * 32 + lane, turns nibbles (i, i + 4) of word j = 2 kh + jj
    into the pair {W[n, k], W[n, k + 1]}, row 16 jj + g + 8 (i >= 2), stored at shared word
    row * 68 + 16 w + 8 kh + 4 (i % 2) + t (scale row (32 ks) >> log2 G); then thread tid writes chunks
    c = tid + 128 it (row c >> 4, chunk c & 15: shared words row * 68 + 4 ch .. + 3) to
    W[32 by + row, 128 bx + 8 ch ..].
    Values: (q - z) * s in float32 rounded once to scales' dtype (the fma's single rounding). Returns W [N, K] in that
    dtype and the shared-memory word addresses of every store, [blocks..., warps, jj, kh, i, lanes] (a test checks
    that the 32 lanes of each store hit 32 distinct banks)."""
    reason = w4a16_dequant_supported(N, K, group_size)
    if reason:
        raise ValueError(reason)
    dtype = scales.dtype
    shift = {32: 5, 64: 6, 128: 7, -1: 31}[group_size]
    chunks = (wq.to(torch.int64) & 0xFFFFFFFF).view(-1, 4)
    bx = torch.arange(K // BK).view(-1, 1, 1, 1)          # [BX, 1, 1, 1]
    by = torch.arange(N // STRIP).view(1, -1, 1, 1)        # [1, BY, 1, 1]
    warp = torch.arange(WARPS).view(1, 1, -1, 1)
    lane = torch.arange(32).view(1, 1, 1, -1)
    g, t = lane // 4, lane % 4
    ks = bx * (BK // 32) + warp
    words = chunks[(by * (K // 32) + ks) * 32 + lane]      # [BX, BY, W, 32, 4]
    srow = (ks * 32) >> shift                              # [BX, 1, W, 1]
    tile = torch.zeros(K // BK, N // STRIP, STRIP * DEQUANT_ROW_WORDS, 2, dtype=dtype)
    addresses = torch.empty(K // BK, N // STRIP, WARPS, 2, 2, 4, 32, dtype=torch.int64)
    for jj in range(2):
        for kh in range(2):
            word = words[..., 2 * kh + jj]
            for i in range(4):
                row = 16 * jj + g + 8 * (i >= 2)                               # [1, 1, 1, 32]
                col = (by * STRIP + row).expand(K // BK, -1, WARPS, -1)        # n
                r = srow.expand_as(col)
                s = scales[r, col].float()
                z = torch.full_like(s, 8.0) if zeros is None else zeros[r, col].float()
                pair = torch.stack([((word >> (4 * i + sh)) & 0xF).float() for sh in (0, 16)], -1)
                val = ((pair - z[..., None]) * s[..., None]).to(dtype)         # one rounding
                addr = row * DEQUANT_ROW_WORDS + 16 * warp + 8 * kh + 4 * (i % 2) + t
                addr = addr.expand(K // BK, N // STRIP, -1, -1)
                addresses[:, :, :, jj, kh, i] = addr
                tile[bx, by, addr] = val
    out = torch.full((N, K), float("nan"), dtype=dtype)
    tid = torch.arange(THREADS)
    for it in range(STRIP * (BK // 8) // THREADS):
        c = tid + it * THREADS
        row, ch = c >> 4, c & 15
        src = tile[:, :, (row * DEQUANT_ROW_WORDS + 4 * ch).view(-1, 1) + torch.arange(4)]  # [BX, BY, 128, 4 words, 2]
        n = (torch.arange(N // STRIP).view(1, -1, 1) * STRIP + row).expand(K // BK, -1, -1)
        k = (torch.arange(K // BK).view(-1, 1, 1) * BK + 8 * ch).expand(-1, N // STRIP, -1)
        for e in range(8):
            out[n, k + e] = src[..., e // 2, e % 2]
    return out, addresses


def _mma_m16n8k16(acc: Tensor, a: list[Tensor], b0: Tensor, b1: Tensor) -> None:
    """acc [..., 4, 32 lanes] += A @ B with A, B given as mma fragments (PTX ISA, "Matrix fragments for
    mma.m16n8k16 with floating point type"): a[r] [32, 2] (a0 = row g, k 2t..; a1 = row g+8; a2 = row g, k 2t+8..;
    a3 = row g+8, k 2t+8..), b0 / b1 [..., 32, 2] (k 2t.. / 2t+8.., column g). C: c0, c1 = row g, cols 2t, 2t+1;
    c2, c3 = row g+8."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    A = torch.zeros(16, 16)
    for r, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
        A[row, col] = a[r][:, 0].float()
        A[row, col + 1] = a[r][:, 1].float()
    B = torch.zeros(*b0.shape[:-2], 16, 8)
    for breg, frag in enumerate((b0, b1)):
        B[..., 2 * t + 8 * breg, g] = frag[..., 0].float()
        B[..., 2 * t + 8 * breg + 1, g] = frag[..., 1].float()
    D = A @ B                                            # [..., 16, 8]; fp16 / bf16 products are exact in fp32
    for i in range(4):
        acc[..., i, :] += D[..., g + 8 * (i // 2), 2 * t + (i % 2)]


def emulate_w4a16_gemm(x: Tensor, packed: dict, splits: int = 1) -> Tensor:
    """Replay the whole w4a16_kernel on the CPU, with the .cu's index formulas and the launcher's (MT, NS): the
    swizzled cp.async copy of x and its ldmatrix reads, the weight and scale / zero copies, the dequantization
    (exact (bias + q) - (bias + z), then one rounding in the multiply by the scale), the mma fragment layouts, the
    cross-warp reduction, split-K (`splits` k-ranges of ceil(K / 128 / splits) tiles, fp32 partial sums added in
    split order, as w4a16_reduce does) and the C-fragment stores. Returns out [M, N] in the packed dtype (NaN where
    the kernel would write nothing). Slow (Python loops over stages and warps): for small test shapes."""
    N, K, group_size = packed["N"], packed["K"], packed["group_size"]
    scales, zeros = packed["scales"], packed["zeros"]
    dtype = scales.dtype
    M = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"x has K={x.shape[1]}, the packed weight K={K}")
    G = K if group_size == -1 else group_size
    MT, NS = w4a16_config(M, N, splits > 1)
    BM, BN, NT = 16 * MT, STRIP * NS, 4 * NS
    if not 1 <= splits <= K // BK:
        raise ValueError(f"splits={splits} must be in 1..{K // BK} (K / {BK})")
    per_split = -(-(K // BK) // splits)
    group_rows = 1 if G >= BK else BK // G
    NB = N // BN
    x16 = x.to(dtype)
    chunks = (packed["wq"].to(torch.int64) & 0xFFFFFFFF).view(-1, 4)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    bx = torch.arange(NB).view(-1, 1)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    for by in range((M + BM - 1) // BM):                 # blockIdx.y (blockIdx.x = bx, vectorised)
        m0 = by * BM
        total = None
        for bz in range(splits):                         # blockIdx.z: split-K ranges
            acc = torch.zeros(NB, WARPS, MT, NT, 4, 32)      # [block, warp, mt, nt, c-register, lane]
            for kt in range(bz * per_split, min(K // BK, (bz + 1) * per_split)):  # this split's k-tiles
                k0 = kt * BK
                # x: chunk c -> row r = c // 16, chunk ch = c % 16, stored at chunk ch ^ (r & 7); rows >= M zero-filled.
                s_a = torch.zeros(BM * BK, dtype=dtype)
                c = torch.arange(BM * 16)
                r, ch = c // 16, c % 16
                valid = (m0 + r) < M
                for e in range(8):
                    src = x16[torch.where(valid, m0 + r, 0), k0 + ch * 8 + e]
                    s_a[r * BK + (ch ^ (r & 7)) * 8 + e] = torch.where(valid, src, torch.zeros((), dtype=dtype))
                # weights: chunk c (< 128 NS) of strip bx * NS + c // 128,
                # from int4 offset (strip * K/32 + kt * 4) * 32 + c % 128.
                c = torch.arange(128 * NS)
                s_b = chunks[((bx * NS + c // 128) * (K // 32) + kt * (BK // 32)) * 32 + c % 128]   # [NB, 128 NS, 4]
                # scales / zeros: rows k0 / G + r (r < group_rows), columns n0 + 0 .. BN - 1.
                rows = (k0 // G + torch.arange(group_rows)).view(1, -1, 1)
                cols = (bx * BN).view(-1, 1, 1) + torch.arange(BN).view(1, 1, -1)
                s_s = scales[rows, cols].reshape(NB, -1)     # [NB, group_rows * BN]
                s_z = None if zeros is None else zeros[rows, cols].reshape(NB, -1)
                for warp in range(WARPS):
                    srow = (32 * warp * group_rows) // BK
                    a = [[None] * MT for _ in range(2)]
                    for kh in range(2):  # ldmatrix.x4: lane l -> row l % 16, chunk 2(2w + kh) + l / 16
                        for mt in range(MT):
                            r = mt * 16 + (lane & 15)
                            chk = 2 * (2 * warp + kh) + (lane >> 4)
                            rows8 = s_a[(r * BK + (chk ^ (r & 7)) * 8).view(-1, 1) + torch.arange(8)]   # [32, 8]
                            # register jm of lane l: row l / 4 of matrix jm (addressed by lane 8 jm + l / 4),
                            # columns 2(l % 4), 2(l % 4) + 1
                            a[kh][mt] = [torch.stack([rows8[8 * jm + g, 2 * t], rows8[8 * jm + g, 2 * t + 1]], -1)
                                         for jm in range(4)]
                    for st in range(NS):
                        bq = s_b[:, (st * (BK // 32) + warp) * 32 + lane]   # [NB, 32, 4]
                        for jj in range(2):
                            c_lo = st * STRIP + 16 * jj + g
                            for kh in range(2):
                                word = bq[..., 2 * kh + jj]
                                regs = []
                                for i in range(4):
                                    col = srow * BN + c_lo + 8 * (i // 2)      # s_lo for r0, r1; s_hi for r2, r3
                                    s = s_s[:, col].float()
                                    z = torch.full_like(s, 8.0) if s_z is None else s_z[:, col].float()
                                    v = (word >> (4 * i)) & 0x000F000F
                                    # exact (bias + q) - (bias + z)
                                    halves = [((v >> sh) & 0xF).float() - z for sh in (0, 16)]
                                    regs.append(torch.stack([(hv * s).to(dtype) for hv in halves], -1))  # one rounding
                                for mt in range(MT):
                                    _mma_m16n8k16(acc[:, warp, mt, st * 4 + 2 * jj], a[kh][mt], regs[0], regs[1])
                                    _mma_m16n8k16(acc[:, warp, mt, st * 4 + 2 * jj + 1], a[kh][mt], regs[2], regs[3])
            part = acc.sum(1)                            # the cross-warp reduction through shared memory
            total = part if total is None else total + part  # w4a16_reduce: fp32, splits in order
        for warp in range(WARPS):
            for q in range(warp, MT * NT, 4):
                mt, nt = q // NT, q % NT
                for i in range(4):
                    row = m0 + mt * 16 + g + 8 * (i // 2)
                    colv = bx * BN + nt * 8 + 2 * t + i % 2            # [NB, 32]
                    keep = row < M
                    out[row[keep].expand(NB, -1), colv[:, keep]] = total[:, mt, nt, i][:, keep].to(dtype)
    return out


def w4a16_reference(x: Tensor, u: Tensor, scales: Tensor, zeros: Tensor | None, group_size: int) -> Tensor:
    """float64 oracle: x [M, K] @ W^T with W[n, k] = (u[n, k] - z[n, k // G]) * s[n, k // G], z = 8 when zeros
    is None. scales / zeros in the caller's [N, K // G] orientation (before prepack). Returns float64 [M, N]."""
    N, K = u.shape
    G = K if group_size == -1 else group_size
    s = scales.double().repeat_interleave(G, dim=1)      # [N, K]
    z = torch.full_like(s, 8.0) if zeros is None else zeros.double().repeat_interleave(G, dim=1)
    w = (u.double() - z) * s
    return x.double() @ w.t()
