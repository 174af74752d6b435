// W4A16 decode GEMM, version 2: out[M, N] = x[M, K] @ W^T for 1 <= M <= 16 (decode batches), on the SAME operands
// as w4a16.cu (weights packed by compress/kernels/prepack.py's prepack_w4a16, scales / zeros [K / G, N] in the
// activation dtype), so a layer prepared once runs on either kernel. Version 1 stays for M > 16.
//
// Why a second kernel (issue 44): version 1's M <= 16 main loop issues about 275 warp-instructions per KB of weights
// (read from its SASS); streaming weights at an H200's bandwidth leaves an SM about 248 issue slots per KB, so it is
// issue-bound, not memory-bound. Version 2 is built to issue far fewer (tests/test_kernels_w4a16_v2.py reads the
// count from cuobjdump and holds it to <= 180 in CI):
//
//   * each warp owns one 32-column strip of the output and streams that strip's weights for the block's k-range by
//     itself, straight into registers (16-byte loads, a ring of kDepth stages of k64 = 1 KB a warp, statically
//     unrolled, so no ring index is ever computed at run time and no barrier runs in the loop: warps never share
//     weights). The loads carry an L2 evict-first policy: weights are read once per call;
//   * x is copied to shared memory ONCE per block (only its M real rows, not 16), for the block's whole k-range;
//     ldmatrix reads it with row addresses of rows >= M clamped to row M - 1 (their outputs are never stored);
//   * dequantization is one lop3 (+ one shift) per two codes: the B fragment is {bias + q} exactly (the "exponent
//     trick", as in version 1), and the zero point and scale are applied AFTER the mma, once per group, in fp32:
//         sum_k x_k (q_k - z) s = s * (sum_k x_k (bias + q_k) - (bias + z) * sum_k x_k)
//     with zx = sum_k x_k per row and group computed once per block from shared memory. Per KB of weights (group
//     128): 56 shifts / lop3s, 16 mma, 2 loads, 4 ldmatrix and 16 fp32 fma for the fold, against version 1's 120
//     instructions of dequantization alone. Accuracy: the tensor core's products are exact and its fp32 sums lose
//     about 2^-23 of (bias + 8) * |zx|, far under the bf16 / fp16 output rounding (checked against the float64
//     oracle by bench/gpu_check.py; emulated on the CPU by compress/kernels/w4a16_v2.py);
//   * split-K is reduced inside the same launch: each block writes its fp32 partial sums to the workspace, the last
//     block of a column tile to arrive (an atomic ticket per tile) adds the splits in the fixed order z = 0, 1, ...,
//     rounds once and resets the ticket to 0, so the result is deterministic and the launch can be replayed in a
//     CUDA graph; one launch instead of two;
//   * on sm_90 the kernel can be launched with programmatic dependent launch (`pdl`): it starts streaming its weights
//     (which no earlier kernel writes) before the previous kernel in the stream has finished, waits
//     (griddepcontrol.wait) before touching x, the workspace, the tickets or out, and lets the next kernel start
//     once its main loop is done (griddepcontrol.launch_dependents).
//
// Block: 256 threads = 8 warps = 8 strips (256 columns); grid = (ceil(N / 256), splits). Split z takes k32 tiles
// [z T, min((z + 1) T, K / 32)), T a multiple of 4 (k128), so every quantization group (<= 128) lies whole in one
// split and, because the register ring covers 2 kDepth k32 tiles (kDepth even: a multiple of 4), at a fixed place in
// the unrolled ring. Shared memory: x [M][T * 32] halves (16-byte chunks XOR-swizzled by row, so the 8 rows one
// ldmatrix phase reads fall in 8 bank groups) and zx [M][groups in the range] floats.
//
// Supported (compress_w4a16_v2_supported; mirrored by compress/kernels/w4a16_v2.py): sm >= 80, fp16 / bf16,
// 1 <= M <= 16, N % 32 == 0, K % 128 == 0, group_size in {32, 64, 128, -1 (= K)}, K % group_size == 0, and the
// split's x and zx within kMaxSmem bytes of shared memory (the caller's split count sees to it). The caller gives a
// workspace of splits * M * N floats (splits > 1) and a zeroed int32 ticket array of at least ceil(N / 256)
// entries, which every launch leaves zeroed again; launches that share tickets must not run concurrently (one
// stream, as a decode loop does).
//
// Weight layout (prepack.py; w4a16.cu's header has the derivation): int32 words
//     wq[((sb * (K / 32) + ks) * 32 + lane) * 4 + j]       sb = n / 32 (strip), ks = k / 32, j = 0..3
// word j serves k16 half kh = j / 2 and n8 tiles 2 jj, 2 jj + 1 of the strip (jj = j % 2); its nibbles i and i + 4
// land, after `lop3(word >> 4 i, 0x000F000F, exp)`, in the low / high half of mma B register r_i: r0, r1 are
// (b0, b1) of n8 tile 2 jj, r2, r3 of n8 tile 2 jj + 1. Fragment layouts: PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"; C fragment: c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g + 8, same).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "launchers.h"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kStrip = 32;                  // output columns of one warp
constexpr int kBlockN = kStrip * kWarps;    // output columns of one block
constexpr int kMaxRows = 16;                // one m16 tile
constexpr int kSplitTiles = 4;              // a split's k-range is a multiple of 4 k32 tiles (k128)
// Register ring depth in k64 stages (1 KB of weights a warp each). Even, so that the ring covers a multiple of 4
// k32 tiles and every group boundary sits at a static place in the unrolled loop. The macro is for tuning builds.
#ifndef COMPRESS_W4A16V2_DEPTH
#define COMPRESS_W4A16V2_DEPTH 4
#endif
constexpr int kDepth = COMPRESS_W4A16V2_DEPTH;
static_assert(kDepth >= 2 && kDepth % 2 == 0, "COMPRESS_W4A16V2_DEPTH: an even number >= 2");
// Dynamic shared memory a block may use for x and zx: two blocks fit an SM on sm_80 / sm_90 (163 / 227 KB), and
// one on sm_86 / sm_89 (99 KB).
constexpr int kMaxSmem = 96 * 1024;

// ---- per-dtype constants of the exponent trick (see w4a16.cu): OR-ing a code q into the low mantissa bits of
// kExp gives exactly kBias + q ----------------------------------------------------------------------------------
template <int DT> struct Dq;
template <> struct Dq<COMPRESS_DTYPE_FP16> {
  static constexpr uint32_t kExp = 0x64006400u;  // {1024, 1024}
  static constexpr float kBias = 1024.f;
};
template <> struct Dq<COMPRESS_DTYPE_BF16> {
  static constexpr uint32_t kExp = 0x43004300u;  // {128, 128}
  static constexpr float kBias = 128.f;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// L2 evict-first policy for data read once (PTX ISA: createpolicy; ld ... .L2::cache_hint).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t p = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
#endif
  return p;
}

// 16 bytes of weights: not kept in L1, evict-first in L2. A plain (coherent) load, not the read-only path: ptxas
// hoists griddepcontrol.wait above every ld.global.nc of a kernel (an .nc load may not see the previous grid's
// writes), which would leave nothing to overlap with the previous kernel; plain loads stay before the wait.
__device__ __forceinline__ uint4 load_stream(const uint4* src, uint64_t policy) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(src), "l"(policy));
#endif
  return v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// d = (a & b) | c in one instruction (lop3 truth table 0xEA = (0xF0 & 0xCC) | 0xAA).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// c += a * b on the tensor cores, m16n8k16, fp32 accumulation.
template <int DT>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// c = a * b (no accumulator input: the first mma of a quantization group starts its sums afresh).
template <int DT>
__device__ __forceinline__ void mma_first(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const float z = 0.f;
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%10,%10,%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%10,%10,%10};\n"
                 : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(z));
  }
#endif
}

// Two 16-bit floats of one 32-bit word, as fp32 (low half first).
template <int DT>
__device__ __forceinline__ float2 to_float2(uint32_t v) {
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  } else {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
  }
}

template <int DT>
__device__ __forceinline__ uint32_t pack_out(float lo, float hi) {
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // no-op when not launched as a dependent
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The lane's scale (and bias + zero) for its 8 columns of one group: columns 8 nt + 2 t + {0, 1} of the strip,
// nt = 0..3, i.e. four 32-bit loads of adjacent pairs from row `group` of [K / G, N].
template <int DT, bool HAS_ZEROS>
__device__ __forceinline__ void load_group(const uint16_t* __restrict__ scales, const uint16_t* __restrict__ zeros,
                                           int group, int N, int col0, float (&s)[8], float (&b)[8]) {
  const size_t row = static_cast<size_t>(group) * N + col0;  // group: rows past `scales` (a static number)
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const float2 sv = to_float2<DT>(__ldg(reinterpret_cast<const uint32_t*>(scales + row + 8 * nt)));
    s[2 * nt] = sv.x;
    s[2 * nt + 1] = sv.y;
    if constexpr (HAS_ZEROS) {
      const float2 zv = to_float2<DT>(__ldg(reinterpret_cast<const uint32_t*>(zeros + row + 8 * nt)));
      b[2 * nt] = Dq<DT>::kBias + zv.x;
      b[2 * nt + 1] = Dq<DT>::kBias + zv.y;
    } else {
      b[2 * nt] = b[2 * nt + 1] = Dq<DT>::kBias + 8.f;  // symmetric: z = 8
    }
  }
}

// acc += s * (tmp - b * zx) for the lane's 16 accumulators (rows g, g + 8; 8 columns). tmp is not cleared: the
// next group's first mma overwrites it (mma_first).
__device__ __forceinline__ void fold(float (&acc)[4][4], float (&tmp)[4][4], const float (&s)[8], const float (&b)[8],
                                     float zx_lo, float zx_hi) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = 2 * nt + (i & 1);
      const float v = fmaf(-b[c], i < 2 ? zx_lo : zx_hi, tmp[nt][i]);
      acc[nt][i] = fmaf(s[c], v, acc[nt][i]);
    }
}

// ---- the kernel -----------------------------------------------------------------------------------------------
// GT: k32 tiles per quantization group (1, 2, 4 for G = 32, 64, 128) or 0 for one group per output channel (G = K).
// tiles_per_split: T above (k32 tiles, a multiple of 4). ws / tickets: split-K workspace and tickets (splits > 1).
template <int DT, bool HAS_ZEROS, int GT>
__global__ void __launch_bounds__(kThreads, 2)
w4a16_v2_kernel(const uint16_t* __restrict__ x, const uint4* __restrict__ wq, const uint16_t* __restrict__ scales,
                const uint16_t* __restrict__ zeros, uint16_t* __restrict__ out, float* __restrict__ ws,
                int* __restrict__ tickets, int M, int N, int K, int tiles_per_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ int s_ticket;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int sb = blockIdx.x * kWarps + warp;         // this warp's strip
  const bool active = sb < N / kStrip;               // the last column tile may hold fewer than 8 strips
  const int k_tiles = K / 32;
  const int kt0 = blockIdx.y * tiles_per_split;
  const int nt = max(0, min(k_tiles, kt0 + tiles_per_split) - kt0);  // k32 tiles of this split: a multiple of 4
  const int n_stages = nt / 2;                                         // k64 stages

  // 1. Weights that no earlier kernel writes: start the ring before waiting for the previous kernel (PDL).
  const uint64_t policy = evict_first_policy();
  const uint4* pw = wq + (static_cast<size_t>(active ? sb : 0) * k_tiles + kt0) * 32 + lane;
  uint4 ring[kDepth][2];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) {
    if (active && d < n_stages) {
      ring[d][0] = load_stream(pw + (2 * d) * 32, policy);
      ring[d][1] = load_stream(pw + (2 * d + 1) * 32, policy);
    }
  }
  grid_dependency_wait();

  // 2. x rows 0..M-1, columns [32 kt0, 32 (kt0 + nt)), into shared memory: row r's 16-byte chunk c at c ^ (r & 7).
  const int row_halves = nt * 32;
  const int row_chunks = nt * 4;  // a multiple of 16: the XOR stays inside the row
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem);
  for (int c = threadIdx.x; c < M * row_chunks; c += kThreads) {
    const int r = c / row_chunks, ch = c % row_chunks;
    const uint4 v = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(r) * K + kt0 * 32 + ch * 8);
    *reinterpret_cast<uint4*>(xs + r * row_halves + ((ch ^ (r & 7)) * 8)) = v;
  }
  __syncthreads();

  // 3. zx[r][gi] = sum of row r of x over the range's group gi (fp32, a fixed order: lanes' strided chunks, then a
  //    butterfly): one (row, group) pair per warp at a time.
  const int group_tiles = GT > 0 ? GT : nt;
  const int n_groups = nt / group_tiles;
  float* zx = reinterpret_cast<float*>(smem + ((M * row_halves * 2 + 15) & ~15));
  for (int p = warp; p < M * n_groups; p += kWarps) {
    const int r = p / n_groups, gi = p % n_groups;
    float sum = 0.f;
    for (int ch = gi * group_tiles * 4 + lane; ch < (gi + 1) * group_tiles * 4; ch += 32) {
      const uint4 v = *reinterpret_cast<const uint4*>(xs + r * row_halves + ((ch ^ (r & 7)) * 8));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = to_float2<DT>(w[i]);
        sum += f.x + f.y;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
    if (lane == 0) zx[r * n_groups + gi] = sum;
  }
  __syncthreads();

  // 4. The main loop: per k64 stage, 2 k32 tiles x 2 k16 halves x 4 n8 tiles = 16 mma. Every address inside the
  //    unrolled ring is a register plus a constant: the ring's pointers advance once per ring.
  float acc[4][4], tmp[4][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[a][i] = tmp[a][i] = 0.f;
  const int col0 = sb * kStrip + 2 * t;  // the lane's first column; its others: + 8 nt (+ 1)
  const int zr_lo = min(g, M - 1), zr_hi = min(g + 8, M - 1);  // rows >= M: any finite row (never stored)
  const float* zx_lo = zx + zr_lo * n_groups;
  const float* zx_hi = zx + zr_hi * n_groups;
  // ldmatrix: lane l gives row (l & 15) (clamped) and chunk 2 j + (l >> 4) of k16 step j of a stage; stage st of
  // the range is 128 bytes further along the row, and (8 st + c) ^ r7 = 8 st + (c ^ r7) for c, r7 < 8.
  const int xr = min(lane & 15, M - 1);
  const uint32_t x_row = smem_addr(xs + xr * row_halves);
  uint32_t x_at[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) x_at[j] = x_row + (((2 * j + (lane >> 4)) ^ (xr & 7)) * 16);
  const uint4* p_next = pw + 2 * kDepth * 32;  // the stage kDepth ahead of the ring's first
  // the lane's scales (and zeros) of the ring's first group: row kt0 / GT of [K / G, N]
  const uint16_t* s_row = scales + static_cast<size_t>(GT > 0 ? kt0 / GT : 0) * N;
  const uint16_t* z_row = HAS_ZEROS ? zeros + static_cast<size_t>(GT > 0 ? kt0 / GT : 0) * N : nullptr;
  constexpr int kRingGroups = GT > 0 ? 2 * kDepth / GT : 0;  // groups per ring
  float s[8], b[8];
  if (GT == 0 && active) load_group<DT, HAS_ZEROS>(s_row, z_row, 0, N, col0, s, b);

  if (active) {
    for (int base = 0; base < n_stages; base += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if (base + d >= n_stages) break;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k32 tile 2 (base + d) + h of the range
          const int tile = 2 * d + h;  // its place in the ring: static
          const bool first = GT > 0 && tile % GT == 0;
          if (first) load_group<DT, HAS_ZEROS>(s_row, z_row, tile / GT, N, col0, s, b);
          uint32_t a[2][4];
          ldmatrix_x4(a[0], x_at[2 * h] + d * 128);
          ldmatrix_x4(a[1], x_at[2 * h + 1] + d * 128);
          const uint4 q = ring[d][h];
          const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
          for (int kh = 0; kh < 2; ++kh)
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const uint32_t word = words[2 * kh + jj];
              uint32_t r[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) r[i] = and_or(word >> (4 * i), 0x000F000Fu, Dq<DT>::kExp);
              if (first && kh == 0) {
                mma_first<DT>(tmp[2 * jj], a[kh], r[0], r[1]);
                mma_first<DT>(tmp[2 * jj + 1], a[kh], r[2], r[3]);
              } else {
                mma<DT>(tmp[2 * jj], a[kh], r[0], r[1]);
                mma<DT>(tmp[2 * jj + 1], a[kh], r[2], r[3]);
              }
            }
          if (GT > 0 && (tile + 1) % GT == 0)
            fold(acc, tmp, s, b, zx_lo[tile / GT], zx_hi[tile / GT]);
        }
        if (base + d + kDepth < n_stages) {  // refill this ring slot kDepth stages ahead
          ring[d][0] = load_stream(p_next + d * 64, policy);
          ring[d][1] = load_stream(p_next + d * 64 + 32, policy);
        }
      }
      p_next += kDepth * 64;
#pragma unroll
      for (int j = 0; j < 4; ++j) x_at[j] += kDepth * 128;
      if (GT > 0) {
        s_row += static_cast<size_t>(kRingGroups) * N;
        if (HAS_ZEROS) z_row += static_cast<size_t>(kRingGroups) * N;
        zx_lo += kRingGroups;
        zx_hi += kRingGroups;
      }
    }
    if (GT == 0) fold(acc, tmp, s, b, zx_lo[0], zx_hi[0]);
  }
  launch_dependents();

  // 5. Store: one split -> round and write out; else the fp32 partials, and the last block of the tile reduces.
  const int splits = gridDim.y;
  if (active) {
#pragma unroll
    for (int n8 = 0; n8 < 4; ++n8) {
      const int col = col0 + 8 * n8;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = g + 8 * half;
        if (row >= M) continue;
        const float lo = acc[n8][2 * half], hi = acc[n8][2 * half + 1];
        if (splits == 1) {
          *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row) * N + col) = pack_out<DT>(lo, hi);
        } else {
          float* p = ws + (static_cast<size_t>(blockIdx.y) * M + row) * N + col;
          __stcg(reinterpret_cast<float2*>(p), make_float2(lo, hi));
        }
      }
    }
  }
  if (splits == 1) return;
  __threadfence();  // this thread's partials are visible device-wide before the block takes its ticket
  __syncthreads();
  if (threadIdx.x == 0) s_ticket = atomicAdd(tickets + blockIdx.x, 1);
  __syncthreads();
  if (s_ticket != splits - 1) return;
  __threadfence();  // the other splits' partials, published before their tickets, are visible from here
  const int n0 = blockIdx.x * kBlockN;
  const int pairs = min(kBlockN, N - n0) / 2;  // column pairs of this tile (N is even)
  for (int i = threadIdx.x; i < M * pairs; i += kThreads) {
    const int row = i / pairs, col = n0 + 2 * (i % pairs);
    float2 sum = __ldcg(reinterpret_cast<const float2*>(ws + static_cast<size_t>(row) * N + col));
    for (int z = 1; z < splits; ++z) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(ws + (static_cast<size_t>(z) * M + row) * N + col));
      sum.x += v.x;
      sum.y += v.y;
    }
    *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row) * N + col) = pack_out<DT>(sum.x, sum.y);
  }
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;  // every other block of the tile has taken its ticket
#endif
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Shared memory of a split of `tiles` k32 tiles: x (M rows) and zx (M x groups floats, 16-byte aligned start).
int smem_bytes(int M, int tiles, int group_tiles) {
  const int x_bytes = (M * tiles * 32 * 2 + 15) & ~15;
  return x_bytes + M * (tiles / group_tiles) * 4;
}

template <int DT, bool HAS_ZEROS, int GT>
int launch(const void* x, const void* wq, const void* scales, const void* zeros, void* out, float* ws, int* tickets,
           int M, int N, int K, int tiles_per_split, int splits, int pdl, cudaStream_t stream) {
  auto kernel = w4a16_v2_kernel<DT, HAS_ZEROS, GT>;
  // The shared-memory limit is raised once per device (a repeated or racing raise is harmless).
  static unsigned long long raised = 0;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return COMPRESS_LAUNCH_ERROR;
  if (dev >= 64 || !(raised >> dev & 1ull)) {
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem) != cudaSuccess) {
      cudaGetLastError();
      return COMPRESS_LAUNCH_ERROR;
    }
    if (dev < 64) raised |= 1ull << dev;
  }
  const int smem = smem_bytes(M, tiles_per_split, GT > 0 ? GT : tiles_per_split);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((N + kBlockN - 1) / kBlockN, splits, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<const uint16_t*>(x),
                                             static_cast<const uint4*>(wq), static_cast<const uint16_t*>(scales),
                                             static_cast<const uint16_t*>(zeros), static_cast<uint16_t*>(out), ws,
                                             tickets, M, N, K, tiles_per_split);
  if (err != cudaSuccess || cudaGetLastError() != cudaSuccess) return COMPRESS_LAUNCH_ERROR;
  return COMPRESS_OK;
}

template <int DT, bool HAS_ZEROS>
int dispatch(const void* x, const void* wq, const void* scales, const void* zeros, void* out, float* ws, int* tickets,
             int M, int N, int K, int G, int tiles_per_split, int splits, int pdl, cudaStream_t stream) {
  switch (G == K ? 0 : G / 32) {  // a group of K (one per channel) runs as GT = 0, whatever K is
    case 1:
      return launch<DT, HAS_ZEROS, 1>(x, wq, scales, zeros, out, ws, tickets, M, N, K, tiles_per_split, splits, pdl,
                                      stream);
    case 2:
      return launch<DT, HAS_ZEROS, 2>(x, wq, scales, zeros, out, ws, tickets, M, N, K, tiles_per_split, splits, pdl,
                                      stream);
    case 4:
      return launch<DT, HAS_ZEROS, 4>(x, wq, scales, zeros, out, ws, tickets, M, N, K, tiles_per_split, splits, pdl,
                                      stream);
    default:
      return launch<DT, HAS_ZEROS, 0>(x, wq, scales, zeros, out, ws, tickets, M, N, K, tiles_per_split, splits, pdl,
                                      stream);
  }
}

}  // namespace

extern "C" int compress_w4a16_v2_tiles_per_split(int K, int splits) {
  const int k128 = K / 128;
  if (splits < 1 || splits > k128) return -1;
  return ((k128 + splits - 1) / splits) * kSplitTiles;
}

extern "C" int compress_w4a16_v2_supported(int M, int N, int K, int group_size, int splits, int dtype, int sm) {
  if (dtype != COMPRESS_DTYPE_FP16 && dtype != COMPRESS_DTYPE_BF16) return COMPRESS_UNSUPPORTED;
  if (sm < 80) return COMPRESS_UNSUPPORTED;
  if (M < 1 || M > kMaxRows || N < kStrip || N % kStrip != 0 || K < 128 || K % 128 != 0) return COMPRESS_UNSUPPORTED;
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != -1) return COMPRESS_UNSUPPORTED;
  if (group_size > 0 && K % group_size != 0) return COMPRESS_UNSUPPORTED;
  const int tiles = compress_w4a16_v2_tiles_per_split(K, splits);
  if (tiles < 0 || splits > 65535) return COMPRESS_UNSUPPORTED;
  const int group_tiles = (group_size == -1 || group_size == K) ? tiles : group_size / 32;
  if (smem_bytes(M, tiles, group_tiles) > kMaxSmem) return COMPRESS_UNSUPPORTED;
  return COMPRESS_OK;
}

extern "C" int compress_w4a16_v2_gemm(const void* x, const void* wq, const void* scales, const void* zeros, void* out,
                                      int M, int N, int K, int group_size, int dtype, void* workspace, int* tickets,
                                      int splits, int pdl, cudaStream_t stream) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return COMPRESS_LAUNCH_ERROR;
  const int sm = major * 10 + minor;
  if (compress_w4a16_v2_supported(M, N, K, group_size, splits, dtype, sm) != COMPRESS_OK) return COMPRESS_UNSUPPORTED;
  if (!aligned(x, 16) || !aligned(wq, 16) || !aligned(scales, 4) || (zeros && !aligned(zeros, 4)) || !aligned(out, 4))
    return COMPRESS_UNSUPPORTED;
  const int tiles = compress_w4a16_v2_tiles_per_split(K, splits);
  const int used = (K / 32 + tiles - 1) / tiles;  // splits that get k-tiles (the last blocks of a rounded-up T
  //                                                  would otherwise have none and still take tickets)
  if (used > 1 && (!workspace || !aligned(workspace, 16) || !tickets)) return COMPRESS_UNSUPPORTED;
  const int G = group_size == -1 ? K : group_size;
  float* ws = static_cast<float*>(workspace);
  pdl = pdl && sm >= 90;
  if (dtype == COMPRESS_DTYPE_FP16) {
    return zeros ? dispatch<COMPRESS_DTYPE_FP16, true>(x, wq, scales, zeros, out, ws, tickets, M, N, K, G, tiles, used,
                                                       pdl, stream)
                 : dispatch<COMPRESS_DTYPE_FP16, false>(x, wq, scales, zeros, out, ws, tickets, M, N, K, G, tiles,
                                                        used, pdl, stream);
  }
  return zeros ? dispatch<COMPRESS_DTYPE_BF16, true>(x, wq, scales, zeros, out, ws, tickets, M, N, K, G, tiles, used,
                                                     pdl, stream)
               : dispatch<COMPRESS_DTYPE_BF16, false>(x, wq, scales, zeros, out, ws, tickets, M, N, K, G, tiles, used,
                                                      pdl, stream);
}
