// W4A16 GEMM: out[M, N] = x[M, K] @ W^T, W[n, k] = (u[n, k] - z[k / G, n]) * s[k / G, n], u an int4 code 0..15.
// fp16 or bf16 activations / scales / output, fp32 accumulation on the tensor cores (mma.sync m16n8k16).
// A Marlin-style design (IST-DASLab/marlin, Frantar et al. 2024), written for this project:
//
//   * the weights are pre-shuffled on the host (compress/kernels/prepack.py) so that each thread fetches all
//     its mma B-fragments of one k32 x n32 tile as ONE 128-bit word, with no further shuffling;
//   * x, weights, scales and zeros stream global -> shared with cp.async (SASS LDGSTS) through a 4- to 12-deep
//     pipeline; the x tile is stored XOR-swizzled so that ldmatrix (SASS LDSM) reads it without bank conflicts;
//   * dequantization happens in registers with the "exponent trick" (one lop3 per two codes), then the
//     zero point and scale are applied per group in the activation dtype;
//   * the four warps of a block split each k-tile (warp w takes the k32 slice w of the stage's 128) and their
//     fp32 partial sums are added through shared memory at the end.
//
// Block tile: BM = 16 * MT rows of x, BN = 32 * NS columns of out (NS "strips" of 32 columns), BK = 128 per
// pipeline stage; grid = (N / BN, ceil(M / BM)). The launcher picks (MT, NS) from M: M <= 16 -> (1, 1), the
// GEMV-like case, where many narrow blocks (N / 32 of them) keep the SMs busy streaming weights; M <= 32 ->
// (2, 2); M > 32 -> (4, 2), wider blocks so that each x tile read from L2 serves 64 columns (NS = 1 when
// N % 64 != 0). M > 64 takes more blocks along y.
//
// Split-K (gridDim.z = splits > 1): when the (N / BN) x (M / BM) grid cannot fill the GPU - decode-sized M on one
// layer: 128 blocks for N = 4096, fewer than an H200's 132 SMs, each looping over all of K with 4 warps - block z
// takes k-tiles [z T, min((z + 1) T, K / 128)), T = ceil((K / 128) / splits), and writes its fp32 partial sums to
// workspace[z, M, N]; a second kernel (w4a16_reduce) adds the splits in the fixed order z = 0, 1, ... and rounds
// once to the output dtype, so the result is the same on every run (no atomics). With splits, the M <= 16 blocks
// take kSplitNS strips and a shallower pipeline (kSplitStages) so that more warps share an SM. The caller picks
// splits (compress/kernels/prepack.py: w4a16_splits) and allocates the workspace (4 * splits * M * N bytes).
//
// Supported shapes (compress_w4a16_supported; mirrored by prepack.py's w4a16_supported):
//   sm >= 80, dtype fp16 / bf16, 1 <= M <= 65535 * 64 (grid.y limit), N % 32 == 0, K % 128 == 0,
//   group_size in {32, 64, 128, -1 (= K)}, 1 <= splits <= min(K / 128, 65535). The launcher also needs x / wq /
//   scales / zeros (and the workspace, when splits > 1) 16-byte aligned and out 4-byte aligned (torch allocations
//   are), else it answers COMPRESS_UNSUPPORTED.
//
// ---------------------------------------------------------------------------------------------------------------
// Fragment layouts (PTX ISA, section "Matrix Fragments for mma.m16n8k16 with floating point type").
// With g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group), each 32-bit register holds two 16-bit
// elements, the lower-indexed one in the low half:
//   A (16 x 16, row-major): a0 = (row g,   k 2t..2t+1)   a1 = (row g+8, k 2t..2t+1)
//                           a2 = (row g,   k 2t+8..2t+9) a3 = (row g+8, k 2t+8..2t+9)
//   B (16 x 8, "col"):      b0 = (k 2t..2t+1, n g)      b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8, fp32):       c0, c1 = (row g, n 2t, 2t+1)  c2, c3 = (row g+8, n 2t, 2t+1)
// ldmatrix.m8n8.x4.b16 (PTX ISA, section "Warp-level matrix load instruction: ldmatrix"): lanes 8j..8j+7
// give the row addresses of matrix j; register j of
// lane l receives row l / 4, columns 2(l % 4), 2(l % 4) + 1 of matrix j, which is exactly the A fragment when
// matrices 0..3 are (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
//
// Weight layout (written by prepack_w4a16, read here): int32 words indexed
//     wq[((sb * (K / 32) + ks) * 32 + lane) * 4 + j]        sb = n / 32 (strip), ks = k / 32, j = 0..3
// Word j of a lane serves k16 half kh = j / 2 of the k32 slice and the n8 tiles 2 jj, 2 jj + 1 of the strip,
// jj = j % 2. Its 8 nibbles (nibble p = bits 4p..4p+3) hold, for the lane's g, t (k relative to 32 ks + 16 kh,
// n relative to 32 sb + 16 jj):
//     p = 0: (k 2t,   n g)      p = 4: (k 2t+1, n g)
//     p = 1: (k 2t+8, n g)      p = 5: (k 2t+9, n g)
//     p = 2: (k 2t,   n 8 + g)  p = 6: (k 2t+1, n 8 + g)
//     p = 3: (k 2t+8, n 8 + g)  p = 7: (k 2t+9, n 8 + g)
// because the dequantization below turns nibbles (i, i + 4) into one 2 x 16-bit register r_i (low, high half):
// r0, r1 are b0, b1 of n8 tile 2 jj and r2, r3 are b0, b1 of n8 tile 2 jj + 1. One k32 x n32 tile is 512
// contiguous bytes (32 lanes x 16 bytes) and a strip's K / 32 tiles follow each other, so one stage of one strip
// (4 k32 tiles) is 2 KiB of contiguous global memory.
// ---------------------------------------------------------------------------------------------------------------
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <algorithm>

#include "launchers.h"

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kStrip = 32;     // columns of one weight strip
constexpr int kBK = 128;       // k per pipeline stage: 4 warps x k32
constexpr int kMaxM = 65535 * 64;  // gridDim.y <= 65535 blocks of 64 rows
constexpr int kMaxGroupRows = kBK / 32;  // scale rows one stage can touch (group_size 32)

// Shared memory of one stage, in bytes: x tile, weight tiles, scale rows, zero rows.
constexpr int a_stage_bytes(int mt) { return 16 * mt * kBK * 2; }
constexpr int b_stage_bytes(int ns) { return ns * kBK * kStrip / 2; }     // 2 KiB per strip
constexpr int s_stage_bytes(int ns) { return kMaxGroupRows * kStrip * ns * 2; }
constexpr int stage_bytes(int mt, int ns) { return a_stage_bytes(mt) + b_stage_bytes(ns) + 2 * s_stage_bytes(ns); }
// cp.async pipeline depth: deeper for small M, where the kernel is a weight stream and the bytes in flight per
// SM set the bandwidth (Little's law); each choice keeps a block near 80 KB of shared memory.
constexpr int stages(int mt) { return mt == 1 ? 12 : mt == 2 ? 6 : 4; }
// Split-K blocks of M <= 16: a shallower pipeline than the unsplit 12 stages lets more blocks (warps) share an SM,
// and kSplitNS strips a block (where N allows) give each warp more independent mma per barrier. The macros exist
// for tuning builds (bench/gpu_run.sh with W4A16_VARIANTS); the defaults are the best of those measured on an H200
// (bench/results/gpu_check/w4a16_splits_variants.json: 1, 2 or 4 strips at 4 or 6 stages).
#ifndef COMPRESS_W4A16_SPLIT_STAGES
#define COMPRESS_W4A16_SPLIT_STAGES 6
#endif
#ifndef COMPRESS_W4A16_SPLIT_NS
#define COMPRESS_W4A16_SPLIT_NS 2
#endif
constexpr int kSplitStages = COMPRESS_W4A16_SPLIT_STAGES;
constexpr int kSplitNS = COMPRESS_W4A16_SPLIT_NS;
static_assert(kSplitNS == 1 || kSplitNS == 2 || kSplitNS == 4, "COMPRESS_W4A16_SPLIT_NS: 1, 2 or 4");
constexpr int kMaxSplits = 65535;  // gridDim.z
constexpr int smem_bytes(int mt, int ns, int st) { return st * stage_bytes(mt, ns); }
constexpr int smem_bytes(int mt, int ns) { return smem_bytes(mt, ns, stages(mt)); }
// The final cross-warp reduction reuses the pipeline buffers: 4 warps x (MT * 4 NS n8 tiles * 4 floats) x 32 lanes.
constexpr int reduce_bytes(int mt, int ns) { return 4 * mt * 4 * ns * 4 * 32 * 4; }
static_assert(reduce_bytes(1, kSplitNS) <= smem_bytes(1, kSplitNS, kSplitStages) &&
                  smem_bytes(1, kSplitNS, kSplitStages) <= 101376,
              "split-K blocks: reduction buffer or shared memory too large");
static_assert(reduce_bytes(1, 1) <= smem_bytes(1, 1) && reduce_bytes(2, 1) <= smem_bytes(2, 1) &&
              reduce_bytes(2, 2) <= smem_bytes(2, 2) && reduce_bytes(4, 1) <= smem_bytes(4, 1) &&
              reduce_bytes(4, 2) <= smem_bytes(4, 2), "reduction buffer must fit in the pipeline's shared memory");
// Opt-in shared memory per block: 227 KB on sm_90, 163 KB on sm_80, 99 KB (101376 bytes) on sm_86 / sm_89
// (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"). Stay under the smallest.
static_assert(smem_bytes(1, 1) <= 101376 && smem_bytes(2, 1) <= 101376 && smem_bytes(2, 2) <= 101376 &&
              smem_bytes(4, 1) <= 101376 && smem_bytes(4, 2) <= 101376, "shared memory above the sm_86 limit");

// ---- per-dtype constants of the dequantization (the "exponent trick") ----------------------------------------
// fp16: 0x6400 is 1024.0 (exponent 10, mantissa 0; the mantissa's ulp is 1), so OR-ing a code q in 0..15 into
// the low mantissa bits gives exactly 1024 + q. bf16: 0x4300 is 128.0 (exponent 7, 7 mantissa bits, ulp 1), so
// 0x4300 | q is 128 + q. Both are exact; subtracting (bias + z) then gives the integer q - z exactly, and the
// single rounding happens in the multiply by the scale (as when the dequantized weight is stored in fp16/bf16).
// Facts: IEEE 754 binary16 / bfloat16 formats; the same trick and constants (0x000f000f mask, 0x6400 / 0x4300
// exponents, lop3 0xEA) appear in IST-DASLab/marlin's dequant() and in NVIDIA FasterTransformer's
// cutlass_extensions/interleaved_numeric_conversion.h, which Marlin cites. Unlike Marlin's fp16 path (which
// masks 0x00f000f0 and rescales by 1/16 to save shifts), every nibble pair here is shifted down, so fp16 and
// bf16 share one code path and one nibble order.
template <int DT> struct Dq;
template <> struct Dq<COMPRESS_DTYPE_FP16> {
  static constexpr uint32_t kExp = 0x64006400u;   // {1024, 1024}
  static constexpr uint32_t kNegBias = 0xE400u;   // -1024
  static constexpr uint32_t kOne = 0x3C003C00u;   // {1, 1}
  static constexpr uint32_t kNegOne = 0xBC00BC00u;
  static constexpr uint32_t kNegBiasSym = 0xE408E408u;  // -(1024 + 8): symmetric z = 8
  static constexpr uint32_t kNegZero = 0x80008000u;
};
template <> struct Dq<COMPRESS_DTYPE_BF16> {
  static constexpr uint32_t kExp = 0x43004300u;   // {128, 128}
  static constexpr uint32_t kNegBias = 0xC300u;   // -128
  static constexpr uint32_t kOne = 0x3F803F80u;
  static constexpr uint32_t kNegOne = 0xBF80BF80u;
  static constexpr uint32_t kNegBiasSym = 0xC308C308u;  // -(128 + 8) = -136
  static constexpr uint32_t kNegZero = 0x80008000u;
};

// ---- small PTX wrappers (sm_80+) --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared, bypassing L1 (.cg). src_bytes = 0 copies nothing and fills the 16
// destination bytes with zeros (PTX ISA, cp.async, operand src-size): used for rows of x past M.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(src_bytes));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");  // later shared loads stay after the wait
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");  // reads shared memory written by cp.async: keep it after the wait / barrier
#endif
}

// d = (a & b) | c in one instruction. lop3's immediate is the truth table of f(0xF0, 0xCC, 0xAA)
// (PTX ISA, lop3): (0xF0 & 0xCC) | 0xAA = 0xEA.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Packed fma on two 16-bit floats: d = a * b + c, round to nearest. fma.rn.bf16x2 is sm_80+
// (PTX ISA, half precision fma);
// sub/mul.bf16x2 would need sm_90, so subtraction and multiplication are both written as fma.
template <int DT>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
#else
  d = 0;
#endif
  return d;
}

// c += a * b on the tensor cores, m16n8k16, fp32 accumulation (PTX ISA, mma.sync m16n8k16; SASS HMMA.16816.F32[.BF16]).
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

// A 16-bit value duplicated into both halves of a register (one scale / zero serves k and k + 1).
__device__ __forceinline__ uint32_t dup16(uint16_t v) { return static_cast<uint32_t>(v) * 0x00010001u; }

template <int DT>
__device__ __forceinline__ uint32_t pack_out(float lo, float hi) {
  if constexpr (DT == COMPRESS_DTYPE_FP16) {
    __half2 h = __floats2half2_rn(lo, hi);  // .x (low half) = lo
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// ---- the kernel -----------------------------------------------------------------------------------------------
// MT: m16 tiles per block (BM = 16 MT). NS: 32-column strips per block (BN = 32 NS). DT: COMPRESS_DTYPE_*.
// HAS_ZEROS: zeros tensor given (else z = 8). STAGES: cp.async pipeline depth. partial: NULL (write out) or the
// split-K workspace [gridDim.z, M, N] fp32 (write this split's sums there); tiles_per_split: k-tiles per split.
template <int MT, int NS, int STAGES, int DT, bool HAS_ZEROS>
__global__ void __launch_bounds__(kThreads)
w4a16_kernel(const uint16_t* __restrict__ x, const int4* __restrict__ wq, const uint16_t* __restrict__ scales,
             const uint16_t* __restrict__ zeros, uint16_t* __restrict__ out, float* __restrict__ partial, int M,
             int N, int K, int G, int tiles_per_split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ int4 smem[];  // int4 for 16-byte alignment
  constexpr int BM = 16 * MT;
  constexpr int BN = kStrip * NS;
  constexpr int NT = 4 * NS;      // n8 tiles per block
  constexpr int kStages = STAGES;
  constexpr int kAHalfs = BM * kBK;  // x tile of one stage, in 16-bit elements
  constexpr int kStageHalfs = stage_bytes(MT, NS) / 2;
  uint16_t* const sbase = reinterpret_cast<uint16_t*>(smem);
  // Stage slot s: [x tile | weight tiles (strip-major) | scale rows | zero rows] at sbase + s * kStageHalfs.

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int n0 = blockIdx.x * BN;
  const int m0 = blockIdx.y * BM;
  const int num_k_tiles = K / kBK;
  // This block's k-tiles: [kt_begin, kt_begin + n_tiles). A split past the end has none and writes zeros.
  const int kt_begin = blockIdx.z * tiles_per_split;
  const int n_tiles = max(0, min(num_k_tiles, kt_begin + tiles_per_split) - kt_begin);
  const int ks_total = K / 32;
  // Scale rows a stage touches: 128 / G for G = 32, 64; 1 when G >= 128 (G = 128 or G = K, both divide k0).
  const int group_rows = G >= kBK ? 1 : kBK / G;

  // Issue the cp.async copies of k-tile `kt` into stage slot `slot`.
  auto load_stage = [&](int kt, int slot) {
    uint16_t* s_a = sbase + slot * kStageHalfs;
    uint16_t* s_b = s_a + kAHalfs;
    uint16_t* s_s = s_b + b_stage_bytes(NS) / 2;
    uint16_t* s_z = s_s + s_stage_bytes(NS) / 2;
    const int k0 = kt * kBK;
    // x: BM rows x 16 chunks of 16 bytes (8 elements). Chunk c of row r goes to chunk c ^ (r & 7) of that row,
    // an XOR swizzle: the 8 rows one ldmatrix phase reads then sit in 8 different bank groups.
#pragma unroll
    for (int i = 0; i < BM * 16 / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / 16, ch = c % 16;
      const bool valid = m0 + r < M;
      const uint16_t* src = x + (static_cast<size_t>(valid ? m0 + r : 0) * K + k0 + ch * 8);
      cp_async16(s_a + r * kBK + ((ch ^ (r & 7)) * 8), src, valid ? 16 : 0);
    }
    // weights: per strip, the stage's 4 k32 tiles are 2048 contiguous bytes of wq (layout above); copied as-is,
    // strip after strip. Chunk c: strip c / 128, 16-byte chunk c % 128 of that strip's stage.
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      const int c = tid + i * kThreads;
      const int strip = blockIdx.x * NS + c / 128;
      const int4* src = wq + (static_cast<size_t>(strip) * ks_total + kt * (kBK / 32)) * 32 + c % 128;
      cp_async16(reinterpret_cast<int4*>(s_b) + c, src, 16);
    }
    // scales (and zeros): rows k0 / G .. + group_rows of [K / G, N], columns n0 .. n0 + BN - 1 (BN / 8 chunks).
    const int g0 = k0 / G;
    constexpr int kRowChunks = BN / 8;
    if (tid < kRowChunks * group_rows) {
      const int r = tid / kRowChunks, ch = tid % kRowChunks;
      cp_async16(s_s + r * BN + ch * 8, scales + static_cast<size_t>(g0 + r) * N + n0 + ch * 8, 16);
    }
    if (HAS_ZEROS && tid >= 64 && tid < 64 + kRowChunks * group_rows) {
      const int r = (tid - 64) / kRowChunks, ch = (tid - 64) % kRowChunks;
      cp_async16(s_z + r * BN + ch * 8, zeros + static_cast<size_t>(g0 + r) * N + n0 + ch * 8, 16);
    }
  };

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

  // Prologue: stages 0 .. kStages - 2 in flight. Every iteration commits one group (possibly empty) so that
  // "wait until at most kStages - 2 groups are pending" always means "k-tile kt has landed".
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) load_stage(kt_begin + s, s);
    cp_async_commit();
  }

  const int g = lane / 4;  // mma groupID
  // Scale row of this warp's k32 slice inside a stage: (32 warp) / G when G < 128, else 0. A k32 slice never
  // straddles a group (G >= 32 and slices start at multiples of 32).
  const int srow = (32 * warp * group_rows) / kBK;
  for (int it = 0; it < n_tiles; ++it) {  // it: this block's it-th k-tile, kt_begin + it
    cp_async_wait<kStages - 2>();
    __syncthreads();  // k-tile it visible to all threads; every warp is done with slot (it - 1) % kStages
    if (it + kStages - 1 < n_tiles) load_stage(kt_begin + it + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();

    const uint16_t* s_a = sbase + (it % kStages) * kStageHalfs;
    const int4* s_b = reinterpret_cast<const int4*>(s_a + kAHalfs);
    const uint16_t* s_s = s_a + kAHalfs + b_stage_bytes(NS) / 2;
    const uint16_t* s_z = s_s + s_stage_bytes(NS) / 2;

    // x fragments of both k16 halves of the warp's k32 slice: ldmatrix.x4, lane l addresses row l % 16 and
    // k-chunk (2 (2 warp + kh) + l / 16), i.e. matrices 0..3 as in the A-fragment note above.
    uint32_t a[2][MT][4];
#pragma unroll
    for (int kh = 0; kh < 2; ++kh)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = mt * 16 + (lane & 15);
        const int ch = 2 * (2 * warp + kh) + (lane >> 4);
        ldmatrix_x4(a[kh][mt], s_a + r * kBK + ((ch ^ (r & 7)) * 8));
      }

#pragma unroll
    for (int st = 0; st < NS; ++st) {
      // The lane's four words for (strip st, k32 slice warp): 16 bytes, lanes contiguous (conflict-free LDS.128).
      const int4 bq = s_b[(st * (kBK / 32) + warp) * 32 + lane];
      const uint32_t words[4] = {static_cast<uint32_t>(bq.x), static_cast<uint32_t>(bq.y),
                                 static_cast<uint32_t>(bq.z), static_cast<uint32_t>(bq.w)};
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        // Columns (block-relative) of n8 tiles 2 jj and 2 jj + 1 of strip st, for this lane: c_lo and c_lo + 8.
        const int c_lo = st * kStrip + 16 * jj + g;
        const uint32_t s_lo = dup16(s_s[srow * BN + c_lo]);
        const uint32_t s_hi = dup16(s_s[srow * BN + c_lo + 8]);
        uint32_t nb_lo, nb_hi;  // -(bias + z) per column, exact
        if constexpr (HAS_ZEROS) {
          const uint32_t z_lo = dup16(s_z[srow * BN + c_lo]);
          const uint32_t z_hi = dup16(s_z[srow * BN + c_lo + 8]);
          nb_lo = fma2<DT>(z_lo, Dq<DT>::kNegOne, dup16(Dq<DT>::kNegBias));
          nb_hi = fma2<DT>(z_hi, Dq<DT>::kNegOne, dup16(Dq<DT>::kNegBias));
        } else {
          nb_lo = nb_hi = Dq<DT>::kNegBiasSym;
        }
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {
          const uint32_t word = words[2 * kh + jj];
          // Dequantize: r_i = (nibble i | nibble i + 4 << 16) | exponent = {bias + q_i, bias + q_(i+4)}, then
          // (r_i - bias - z) * s. r0, r1 -> B fragment (b0, b1) of n8 tile 2 jj; r2, r3 -> of n8 tile 2 jj + 1.
          uint32_t r[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint32_t v = and_or(word >> (4 * i), 0x000F000Fu, Dq<DT>::kExp);
            const uint32_t nb = i < 2 ? nb_lo : nb_hi;
            const uint32_t s = i < 2 ? s_lo : s_hi;
            r[i] = fma2<DT>(fma2<DT>(v, Dq<DT>::kOne, nb), s, Dq<DT>::kNegZero);
          }
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<DT>(acc[mt][st * 4 + 2 * jj], a[kh][mt], r[0], r[1]);
            mma<DT>(acc[mt][st * 4 + 2 * jj + 1], a[kh][mt], r[2], r[3]);
          }
        }
      }
    }
  }

  // Cross-warp reduction: each warp holds partial sums over its k32 slices. Reuse the pipeline buffers.
  cp_async_wait<0>();
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [warp][MT * NT * 4][lane]
  constexpr int kIdx = MT * NT * 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(warp * kIdx + (mt * NT + nt) * 4 + i) * 32 + lane] = acc[mt][nt][i];
  __syncthreads();

  // Warp w sums and stores the (m16, n8) tiles whose index q = mt * NT + nt is w mod 4. C fragment layout:
  // c0, c1 at (row g, cols 2t, 2t + 1), c2, c3 at (row g + 8, same cols).
  const int t = lane % 4;
  for (int q = warp; q < MT * NT; q += 4) {
    const int mt = q / NT, nt = q % NT;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) v[i] += red[(w * kIdx + q * 4 + i) * 32 + lane];
    }
    const int col = n0 + nt * 8 + 2 * t;
    const int row0 = m0 + mt * 16 + g;
    if (partial != nullptr) {  // split-K: fp32 sums of this split; w4a16_reduce adds the splits and rounds
      float* p = partial + static_cast<size_t>(blockIdx.z) * M * N;
      if (row0 < M) *reinterpret_cast<float2*>(p + static_cast<size_t>(row0) * N + col) = make_float2(v[0], v[1]);
      if (row0 + 8 < M)
        *reinterpret_cast<float2*>(p + static_cast<size_t>(row0 + 8) * N + col) = make_float2(v[2], v[3]);
      continue;
    }
    if (row0 < M) *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row0) * N + col) = pack_out<DT>(v[0], v[1]);
    if (row0 + 8 < M)
      *reinterpret_cast<uint32_t*>(out + static_cast<size_t>(row0 + 8) * N + col) = pack_out<DT>(v[2], v[3]);
  }
#endif
}

// out[m, n] = round(sum over z = 0, 1, ..., splits - 1 of partial[z, m, n]), in that order; two columns a thread
// (N is even, so a pair never straddles a row; out is 4-byte aligned).
template <int DT>
__global__ void __launch_bounds__(256)
w4a16_reduce(const float* __restrict__ partial, uint16_t* __restrict__ out, int M, int N, int splits) {
  const size_t pairs = static_cast<size_t>(M) * N / 2;
  const size_t stride = static_cast<size_t>(M) * N / 2;  // one split's plane, in float2
  const float2* p = reinterpret_cast<const float2*>(partial);
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < pairs;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float2 acc = p[i];
    for (int z = 1; z < splits; ++z) {
      const float2 v = p[z * stride + i];
      acc.x += v.x;
      acc.y += v.y;
    }
    reinterpret_cast<uint32_t*>(out)[i] = pack_out<DT>(acc.x, acc.y);
  }
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// One GEMM: the tile kernel over a (N / BN, M / BM, splits) grid, then, when splits > 1, the ordered reduction of
// the workspace into out.
template <int MT, int NS, int STAGES, int DT, bool HAS_ZEROS>
int launch(const void* x, const void* wq, const void* scales, const void* zeros, void* out, float* workspace, int M,
           int N, int K, int G, int splits, cudaStream_t stream) {
  auto kernel = w4a16_kernel<MT, NS, STAGES, DT, HAS_ZEROS>;
  constexpr int smem = smem_bytes(MT, NS, STAGES);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    cudaGetLastError();  // clear it: torch's next launch check would otherwise report it against its own kernel
    return COMPRESS_LAUNCH_ERROR;
  }
  const int k_tiles = K / kBK;
  const int tiles_per_split = (k_tiles + splits - 1) / splits;
  dim3 grid(N / (kStrip * NS), (M + 16 * MT - 1) / (16 * MT), splits);
  kernel<<<grid, kThreads, smem, stream>>>(static_cast<const uint16_t*>(x), static_cast<const int4*>(wq),
                                           static_cast<const uint16_t*>(scales), static_cast<const uint16_t*>(zeros),
                                           static_cast<uint16_t*>(out), splits > 1 ? workspace : nullptr, M, N, K, G,
                                           tiles_per_split);
  if (cudaGetLastError() != cudaSuccess) return COMPRESS_LAUNCH_ERROR;
  if (splits > 1) {
    const size_t pairs = static_cast<size_t>(M) * N / 2;
    const int blocks = static_cast<int>(std::min<size_t>((pairs + 255) / 256, 65535));
    w4a16_reduce<DT><<<blocks, 256, 0, stream>>>(workspace, static_cast<uint16_t*>(out), M, N, splits);
    if (cudaGetLastError() != cudaSuccess) return COMPRESS_LAUNCH_ERROR;
  }
  return COMPRESS_OK;
}

template <int DT, bool HAS_ZEROS>
int dispatch(const void* x, const void* wq, const void* scales, const void* zeros, void* out, float* ws, int M, int N,
             int K, int G, int splits, cudaStream_t stream) {
  // (MT, NS) from M, as described at the top; mirrored by prepack.py's w4a16_config.
  if (M <= 16) {
    if (splits == 1)
      return launch<1, 1, stages(1), DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, 1, stream);
    if constexpr (kSplitNS == 4) {
      if (N % (4 * kStrip) == 0)
        return launch<1, 4, kSplitStages, DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
    }
    if constexpr (kSplitNS >= 2) {
      if (N % (2 * kStrip) == 0)
        return launch<1, 2, kSplitStages, DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
    }
    return launch<1, 1, kSplitStages, DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
  }
  const bool wide = N % (2 * kStrip) == 0;
  if (M <= 32) {
    return wide ? launch<2, 2, stages(2), DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream)
                : launch<2, 1, stages(2), DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
  }
  return wide ? launch<4, 2, stages(4), DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream)
              : launch<4, 1, stages(4), DT, HAS_ZEROS>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
}

}  // namespace

extern "C" int compress_w4a16_supported(int M, int N, int K, int group_size, int dtype, int sm) {
  if (dtype != COMPRESS_DTYPE_FP16 && dtype != COMPRESS_DTYPE_BF16) return COMPRESS_UNSUPPORTED;
  if (sm < 80) return COMPRESS_UNSUPPORTED;  // cp.async, ldmatrix, bf16 mma need Ampere
  if (M < 1 || M > kMaxM || N < kStrip || N % kStrip != 0 || K < kBK || K % kBK != 0) return COMPRESS_UNSUPPORTED;
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != -1) return COMPRESS_UNSUPPORTED;
  if (group_size > 0 && K % group_size != 0) return COMPRESS_UNSUPPORTED;
  return COMPRESS_OK;
}

extern "C" int compress_w4a16_gemm(const void* x, const void* wq, const void* scales, const void* zeros, void* out,
                                   int M, int N, int K, int group_size, int dtype, void* workspace, int splits,
                                   cudaStream_t stream) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return COMPRESS_LAUNCH_ERROR;
  if (compress_w4a16_supported(M, N, K, group_size, dtype, major * 10 + minor) != COMPRESS_OK)
    return COMPRESS_UNSUPPORTED;
  if (!aligned(x, 16) || !aligned(wq, 16) || !aligned(scales, 16) || (zeros && !aligned(zeros, 16)) ||
      !aligned(out, 4))
    return COMPRESS_UNSUPPORTED;
  if (splits < 1 || splits > K / kBK || splits > kMaxSplits || (splits > 1 && (!workspace || !aligned(workspace, 16))))
    return COMPRESS_UNSUPPORTED;
  const int G = group_size == -1 ? K : group_size;
  float* ws = static_cast<float*>(workspace);
  if (dtype == COMPRESS_DTYPE_FP16) {
    return zeros ? dispatch<COMPRESS_DTYPE_FP16, true>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream)
                 : dispatch<COMPRESS_DTYPE_FP16, false>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
  }
  return zeros ? dispatch<COMPRESS_DTYPE_BF16, true>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream)
               : dispatch<COMPRESS_DTYPE_BF16, false>(x, wq, scales, zeros, out, ws, M, N, K, G, splits, stream);
}
