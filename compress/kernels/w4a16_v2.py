"""The host side of the W4A16 decode kernel, version 2 (cuda/w4a16_v2.cu), in pure torch on the CPU.

Version 2 runs the same operands as version 1 (prepack.prepack_w4a16's layout) for 1 <= M <= 16. This module mirrors
its C rules (`w4a16_v2_supported`, `tiles_per_split`, `smem_bytes`), chooses its split count for a GPU
(`w4a16_v2_splits`), and replays the kernel on the CPU (`emulate_w4a16_v2_gemm`) with the .cu's index formulas:
the block's x copy into shared memory (M rows, 16-byte chunks XOR-swizzled by row) and the ldmatrix reads with rows
clamped to M - 1, each warp's strip and k-range, the register ring's static group positions and advancing row
pointers, the B fragments {bias + q} straight from the packed words, the mma fragment layouts, the per-group fold
acc += s (tmp - (bias + z) zx) with zx the block's per-row group sums of x, and split-K's ordered fp32 reduction
by the last block of a column tile. The kernel cannot run here; its emulation is checked against the float64
oracle (prepack.w4a16_reference) by tests/test_kernels_w4a16_v2.py, and the kernel itself by bench/gpu_check.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .prepack import GROUP_SIZES, _mma_m16n8k16

WARPS = 8            # kWarps: one 32-column strip a warp
STRIP = 32           # kStrip
BLOCK_N = WARPS * STRIP
MAX_ROWS = 16        # kMaxRows: one m16 tile
SPLIT_TILES = 4      # kSplitTiles: a split's k-range is a multiple of 4 k32 tiles (k128)
DEPTH = 4            # kDepth: k64 stages (1 KB a warp) in the register ring
MAX_SMEM = 96 * 1024  # kMaxSmem
BIAS = {torch.float16: 1024.0, torch.bfloat16: 128.0}  # Dq<DT>::kBias: exp | q = bias + q exactly
BLOCKS_PER_SM = 2    # __launch_bounds__(256, 2): at most 128 registers a thread, two blocks an SM


def tiles_per_split(K: int, splits: int) -> int:
    """k32 tiles of each split (compress_w4a16_v2_tiles_per_split): ceil((K / 128) / splits) k128 steps."""
    k128 = K // 128
    if not 1 <= splits <= k128:
        raise ValueError(f"splits={splits} must be in 1..K/128 = {k128}")
    return -(-k128 // splits) * SPLIT_TILES


def used_splits(K: int, splits: int) -> int:
    """Splits that get k-tiles once the range is rounded up (the kernel's grid.y)."""
    t = tiles_per_split(K, splits)
    return -(-(K // 32) // t)


def group_tiles(K: int, group_size: int, tiles: int) -> int:
    """k32 tiles per quantization group inside a split (GT), or the split's whole range for one group per channel."""
    return tiles if group_size in (-1, K) else group_size // 32


def smem_bytes(M: int, tiles: int, gtiles: int) -> int:
    """Dynamic shared memory of a block (smem_bytes in the .cu): x [M][32 tiles] halves (rounded up to 16 bytes),
    then zx [M][tiles / gtiles] floats."""
    return ((M * tiles * 32 * 2 + 15) & ~15) + M * (tiles // gtiles) * 4


def w4a16_v2_supported(M: int, N: int, K: int, group_size: int, splits: int = 1) -> str | None:
    """None when version 2 takes the GEMM, else why not (compress_w4a16_v2_supported, which also needs sm >= 80 and
    fp16 / bf16)."""
    if not 1 <= M <= MAX_ROWS:
        return f"M={M} is outside 1..{MAX_ROWS} (the decode kernel holds one m16 tile of rows; version 1 takes more)"
    if N < STRIP or N % STRIP:
        return f"N={N} is not a positive multiple of {STRIP} (one warp's strip)"
    if K < 128 or K % 128:
        return f"K={K} is not a positive multiple of 128"
    if group_size not in GROUP_SIZES:
        return f"group_size={group_size} is not one of {GROUP_SIZES} (-1: one group per output channel)"
    if group_size > 0 and K % group_size:
        return f"K={K} is not a multiple of group_size={group_size}"
    if not 1 <= splits <= min(K // 128, 65535):
        return f"splits={splits} must be in 1..K/128 = {K // 128}"
    t = tiles_per_split(K, splits)
    need = smem_bytes(M, t, group_tiles(K, group_size, t))
    if need > MAX_SMEM:
        return (f"a split of {t * 32} columns of x needs {need} bytes of shared memory at M={M} (at most {MAX_SMEM}): "
                "use more splits")
    return None


def w4a16_v2_splits(M: int, N: int, K: int, group_size: int, sms: int, smem_per_sm: int) -> int:
    """Split-K count for version 2 on a GPU with `sms` multiprocessors of `smem_per_sm` bytes of shared memory.

    One wave: the ceil(N / 256) column tiles are split along K into as many copies as BLOCKS_PER_SM blocks per SM
    hold (a second, partial wave would leave SMs idle at the end), at most K / 128 and so that the fp32 partial sums
    (written and read back: 8 splits M N bytes) stay within the weight bytes (N K / 2). Then more splits where a
    split's x would not fit two blocks' shared memory an SM (or the kernel's cap). Returns the splits that get k-tiles
    (used_splits), 1 for none."""
    k128 = K // 128
    n_tiles = -(-N // BLOCK_N)
    splits = max(1, (sms * BLOCKS_PER_SM) // n_tiles)
    splits = max(1, min(splits, k128, K // (16 * M)))
    budget = min(MAX_SMEM, smem_per_sm // BLOCKS_PER_SM - 1024)
    while splits < k128:
        t = tiles_per_split(K, splits)
        if smem_bytes(M, t, group_tiles(K, group_size, t)) <= budget:
            break
        splits += 1
    return used_splits(K, splits)


def _shared_x(x16: Tensor, kt0: int, nt: int) -> Tensor:
    """Step 2: x rows 0..M-1 of the split's nt k32 tiles into shared memory, flat in halves: row r's 16-byte chunk ch
    at ch ^ (r & 7). NaN where the kernel writes nothing."""
    M = x16.shape[0]
    row_halves, row_chunks = nt * 32, nt * 4
    xs = torch.full((M * row_halves,), float("nan"), dtype=x16.dtype)
    for c in range(M * row_chunks):
        r, ch = c // row_chunks, c % row_chunks
        dst = r * row_halves + (ch ^ (r & 7)) * 8
        xs[dst:dst + 8] = x16[r, kt0 * 32 + ch * 8: kt0 * 32 + ch * 8 + 8]
    return xs


def _group_sums(xs: Tensor, M: int, nt: int, GT: int) -> Tensor:
    """Step 3: zx[r * n_groups + gi], row r's sum over the range's group gi (the group's chunks, read through the
    swizzle), in float32."""
    row_halves, gtl = nt * 32, (GT if GT > 0 else nt)
    n_groups = nt // gtl
    zx = torch.zeros(M * n_groups)
    for p in range(M * n_groups):
        r, gi = p // n_groups, p % n_groups
        ch = torch.arange(gi * gtl * 4, (gi + 1) * gtl * 4)
        idx = (r * row_halves + (ch ^ (r & 7)) * 8).view(-1, 1) + torch.arange(8)
        zx[p] = xs[idx].float().sum()
    return zx


def _store_partial(partial: Tensor, acc: Tensor, sbc: Tensor, active: Tensor) -> None:
    """Step 5: a split's partial sums (rows < M of the C fragments) into its workspace slice [M, N]."""
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    M = partial.shape[0]
    for n8 in range(4):
        for i in range(4):
            row = g + 8 * (i // 2)
            col = (sbc.unsqueeze(-1) * STRIP + 8 * n8 + 2 * t + (i & 1))                # [block, warp, lane]
            keep = (row < M).view(1, 1, -1) & active.unsqueeze(-1)
            partial[row.expand_as(col)[keep], col[keep]] = acc[:, :, n8, i][keep]


def emulate_w4a16_v2_gemm(x: Tensor, packed: dict, splits: int = 1) -> Tensor:
    """Replay w4a16_v2_kernel on the CPU with the .cu's index formulas (see the module docstring). x [M, K] in the
    packed dtype, packed from prepack.prepack_w4a16; `splits` as the launcher takes it. Returns out [M, N] in the
    packed dtype (NaN where the kernel would write nothing). Python loops over splits, stages and k16 steps, vectorised
    over blocks, warps and lanes: for small test shapes."""
    N, K, group_size = packed["N"], packed["K"], packed["group_size"]
    scales, zeros = packed["scales"], packed["zeros"]
    dtype = scales.dtype
    M = x.shape[0]
    why = w4a16_v2_supported(M, N, K, group_size, splits)
    if why:
        raise ValueError(why)
    if x.shape[1] != K:
        raise ValueError(f"x has K={x.shape[1]}, the packed weight K={K}")
    T = tiles_per_split(K, splits)
    grid_y = used_splits(K, splits)
    G = K if group_size == -1 else group_size
    GT = 0 if G == K else G // 32
    k_tiles = K // 32
    n_blocks = -(-N // BLOCK_N)
    strips = N // STRIP
    bias = BIAS[dtype]
    words = (packed["wq"].to(torch.int64) & 0xFFFFFFFF).view(-1, 4)    # [strip, k32 tile, lane] x 4 words, flat
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    sb = torch.arange(n_blocks).view(-1, 1) * WARPS + torch.arange(WARPS)  # [block, warp] -> strip
    active = sb < strips
    sbc = torch.where(active, sb, 0)
    x16 = x.to(dtype)
    partial = torch.zeros(grid_y, M, N, dtype=torch.float32)             # the workspace
    col0 = sbc.unsqueeze(-1) * STRIP + 2 * t                            # [block, warp, lane]
    for z in range(grid_y):                                              # blockIdx.y
        kt0 = z * T
        nt = max(0, min(k_tiles, kt0 + T) - kt0)
        n_stages = nt // 2
        row_halves = nt * 32
        xs = _shared_x(x16, kt0, nt)                                     # 2.
        n_groups = nt // (GT if GT > 0 else nt)
        zx = _group_sums(xs, M, nt, GT)                                  # 3.
        # 4. the main loop, every block and warp at once
        acc = torch.zeros(n_blocks, WARPS, 4, 4, 32)                     # [block, warp, n8 tile, c reg, lane]
        tmp = torch.zeros_like(acc)
        zr_lo, zr_hi = torch.clamp(g, max=M - 1), torch.clamp(g + 8, max=M - 1)
        xr = torch.clamp(lane & 15, max=M - 1)
        x_at = [xr * row_halves * 2 + (((2 * j + (lane >> 4)) ^ (xr & 7)) * 16) for j in range(4)]  # bytes
        s_row = (kt0 // GT if GT > 0 else 0)                             # scale row pointer, in rows
        zx_off = 0
        s = b = None

        def load_group(row):
            cols = col0[..., None, None] + 8 * torch.arange(4).view(4, 1) + torch.arange(2)   # [block, warp, lane, 4, 2]
            sv = scales[row][cols.reshape(-1)].float().view(*cols.shape)          # [block, warp, lane, nt, 2]
            bv = torch.full_like(sv, bias + 8.0) if zeros is None else \
                bias + zeros[row][cols.reshape(-1)].float().view(*cols.shape)
            return sv, bv

        def fold(gi):
            lo, hi = zx[zr_lo * n_groups + gi], zx[zr_hi * n_groups + gi]          # [32] each
            for n8 in range(4):
                for i in range(4):
                    c = i & 1
                    zv = lo if i < 2 else hi
                    v = tmp[:, :, n8, i] - b[..., n8, c] * zv
                    acc[:, :, n8, i] += s[..., n8, c] * v

        if GT == 0:
            s, b = load_group(0)
        base = 0
        while base < n_stages:
            for d in range(DEPTH):
                st = base + d
                if st >= n_stages:
                    break
                for h in range(2):
                    tile = 2 * d + h
                    first = GT > 0 and tile % GT == 0
                    if first:
                        s, b = load_group(s_row + tile // GT)
                    a = []
                    for kh in range(2):      # ldmatrix.x4 at x_at[2 h + kh] + 128 d (+ the ring's advance)
                        addr = (x_at[2 * h + kh] + 128 * st) // 2                    # halves
                        rows8 = xs[addr.view(-1, 1) + torch.arange(8)]                # [32 lanes, 8]
                        a.append([torch.stack([rows8[8 * jm + g, 2 * t], rows8[8 * jm + g, 2 * t + 1]], -1)
                                  for jm in range(4)])
                    # the lane's 16 bytes of k32 tile kt0 + 2 st + h of its strip
                    q = words[((sbc * k_tiles + kt0 + 2 * st + h) * 32).unsqueeze(-1) + lane]  # [block, warp, 32, 4]
                    for kh in range(2):
                        for jj in range(2):
                            word = q[..., 2 * kh + jj]
                            regs = []
                            for i in range(4):
                                v = (word >> (4 * i)) & 0x000F000F                       # lop3: exp | nibble pair
                                regs.append(torch.stack([(v & 0xF).float() + bias,
                                                         ((v >> 16) & 0xF).float() + bias], -1).to(dtype))
                            for pair, (r0, r1) in enumerate(((0, 1), (2, 3))):
                                target = tmp[:, :, 2 * jj + pair]
                                if first and kh == 0:
                                    target.zero_()                                       # mma_first
                                _mma_m16n8k16(target, a[kh], regs[r0], regs[r1])
                    if GT > 0 and (tile + 1) % GT == 0:
                        fold(zx_off + tile // GT)
            base += DEPTH
            if GT > 0:
                s_row += 2 * DEPTH // GT
                zx_off += 2 * DEPTH // GT
        if GT == 0:
            fold(0)
        _store_partial(partial[z], acc, sbc, active)                     # 5.
    out = torch.full((M, N), float("nan"), dtype=dtype)
    total = partial[0].clone()
    for z in range(1, grid_y):                                         # the last block's ordered reduction
        total += partial[z]
    out[:, :strips * STRIP] = total[:, :strips * STRIP].to(dtype)
    return out
