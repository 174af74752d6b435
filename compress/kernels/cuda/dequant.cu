// W4A16 dequantization: the dense weight W[N, K] (row-major, fp16 or bf16) from the W4A16 GEMM's packed operands,
// W[n, k] = (u[n, k] - z[k / G, n]) * s[k / G, n], rounded once to the output dtype. For large batches (M >= 128)
// the dispatcher runs the layer as this kernel into a transient scratch buffer followed by cuBLAS (F.linear):
// the GEMM is then compute-bound and the dequantization is a fixed cost, small against it at large M.
//
// Inputs exactly as gpu.pack_w4a16 makes them for the GEMM (w4a16.cu; layout written by prepack.prepack_w4a16):
//   wq: int32 words indexed ((sb * (K / 32) + ks) * 32 + lane) * 4 + j, sb = n / 32, ks = k / 32; one k32 x n32
//       tile is 512 contiguous bytes, lane l's 16 bytes hold words j = 0..3; nibble p of word j is the code of
//           n = 32 sb + 16 (j % 2) + 8 ((p % 4) >= 2) + g,   k = 32 ks + 16 (j / 2) + 2 t + (p >= 4) + 8 (p % 2)
//       with g = l / 4, t = l % 4 (see the comment block of w4a16.cu, and prepack.py's docstring).
//   scales: [K / G, N] in the output dtype; zeros: NULL (symmetric, z = 8) or [K / G, N] in the output dtype holding
//   integers 0..15. group_size 32, 64, 128, or -1 (G = K). K is the padded K (a multiple of 128).
//
// Arithmetic: the same as the GEMM's dequantization (w4a16.cu): nibbles i and i + 4 of a word - the codes of (n, k)
// and (n, k + 1) - become one 2 x 16-bit register {bias + q} with one lop3 (the "exponent trick": exact), then
// fma(r, 1, -(bias + z)) = q - z exactly, then fma(q - z, s, -0) rounds once (round to nearest even). Since q - z
// is an integer in -15..15 and s has at most 11 significant bits, the product is exact in float32, so the result is
// bit-identical to ((u - z) * s) computed in float32 (or float64) and rounded once to the dtype: the reference of
// ops.w4a16_dequant and the tolerance of the GPU check (exact equality).
//
// Memory traffic per weight: 0.5 byte read (the int4 code) + 2 bytes written (the 16-bit weight), plus the scales
// and zeros, 2 / G bytes each per weight (1/16 byte at G = 32; they are re-read from L1/L2 by the 8 lanes and 4 warps
// that share them). The kernel is bound by memory bandwidth: a 4096 x 4096 layer moves 8 MiB in and 32 MiB out,
// ~10 us at 4 TB/s (an estimate from the bytes, not a measurement), against 137 GFLOP for its GEMM at M = 4096.
//
// Block: 128 threads (4 warps) own the output tile rows n0 .. n0 + 31 (n0 = 32 blockIdx.y) x columns k0 .. k0 + 127
// (k0 = 128 blockIdx.x). Warp w reads the k32 x n32 tile ks = 4 blockIdx.x + w with one 16-byte load per lane
// (512 coalesced bytes a warp), dequantizes its 32 codes into 16 registers of two 16-bit weights, and stores them
// into a shared-memory tile [32 rows][128 k]; after a barrier the block writes the tile out as 512 16-byte chunks,
// 16 per row, so each warp store covers two full 256-byte row segments (full 32-byte sectors, coalesced). Blocks
// along x walk one strip's k-tiles: consecutive blocks read consecutive wq bytes and extend the same rows of W.
// The shared rows are padded by 4 words (68 words = 272 bytes, still 16-byte aligned): the register stores of a
// warp (8 rows g x 4 words t) then fall on 32 distinct banks, and the 16-byte reads of 8 lanes cover one row's 128
// contiguous bytes (conflict-free). No division in the kernel: K / 32 is a shift, the group row is (32 ks) >>
// log2(G) (shift 31 for one group per channel: row 0).
//
// Supported (compress_w4a16_dequant_supported; mirrored by prepack.w4a16_dequant_supported): sm >= 80 (fma.bf16x2),
// dtype fp16 / bf16, N % 32 == 0 and 32 <= N <= 65535 * 32 (grid.y), K % 128 == 0 and K >= 128, group_size in
// {32, 64, 128, -1} dividing K. The launcher also needs wq and out 16-byte aligned and scales / zeros 2-byte aligned
// (torch allocations are), else it answers COMPRESS_UNSUPPORTED.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "launchers.h"

namespace compress_dequant {

constexpr int kThreads = 128;            // 4 warps, one k32 tile each
constexpr int kStrip = 32;               // rows of W (columns n of the GEMM) per block
constexpr int kBK = 128;                 // k per block
constexpr int kMaxStrips = 65535;        // gridDim.y
constexpr int kRowWords = kBK / 2 + 4;   // 32-bit words per shared row: 64 (128 halves) + 4 padding
constexpr int kChunksPerRow = kBK / 8;   // 16-byte chunks of one output row segment
static_assert((kRowWords * 4) % 16 == 0, "shared rows must stay 16-byte aligned for the 16-byte reads");
static_assert((kStrip * kChunksPerRow) % kThreads == 0, "the tile's chunks must split evenly over the threads");

// Per-dtype constants of the exponent trick (the same values and reasoning as Dq<> in w4a16.cu): bias + q is exact
// with the bias 1024 (fp16: 0x6400) or 128 (bf16: 0x4300), whose mantissa ulp is 1.
template <int DT> struct Dq;
template <> struct Dq<COMPRESS_DTYPE_FP16> {
  static constexpr uint32_t kExp = 0x64006400u;       // {1024, 1024}
  static constexpr uint32_t kNegBias = 0xE400u;       // -1024
  static constexpr uint32_t kOne = 0x3C003C00u;       // {1, 1}
  static constexpr uint32_t kNegOne = 0xBC00BC00u;    // {-1, -1}
  static constexpr uint32_t kNegBiasSym = 0xE408E408u;  // -(1024 + 8): symmetric z = 8
  static constexpr uint32_t kNegZero = 0x80008000u;   // {-0, -0}: x * s + (-0) == x * s, signed zeros included
};
template <> struct Dq<COMPRESS_DTYPE_BF16> {
  static constexpr uint32_t kExp = 0x43004300u;       // {128, 128}
  static constexpr uint32_t kNegBias = 0xC300u;       // -128
  static constexpr uint32_t kOne = 0x3F803F80u;
  static constexpr uint32_t kNegOne = 0xBF80BF80u;
  static constexpr uint32_t kNegBiasSym = 0xC308C308u;  // -(128 + 8) = -136
  static constexpr uint32_t kNegZero = 0x80008000u;
};

// d = (a & b) | c in one instruction (lop3 immediate (0xF0 & 0xCC) | 0xAA = 0xEA; PTX ISA, lop3).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Packed d = a * b + c on two 16-bit floats, rounded to nearest even once (fma.rn.bf16x2 is sm_80+; mul.bf16x2
// would need sm_90, so the multiply is an fma with -0).
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

// A 16-bit value in both halves of a register.
__device__ __forceinline__ uint32_t dup16(uint16_t v) { return static_cast<uint32_t>(v) * 0x00010001u; }

// The packed weight is read once: bypass L1 (ld.global.nc.L1::no_allocate), keep L1 for the scales.
__device__ __forceinline__ int4 load_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(__cvta_generic_to_global(p)));
  return v;
}

// DT: COMPRESS_DTYPE_*. HAS_ZEROS: zeros given (else z = 8). group_shift: log2(G) for G = 32, 64, 128; 31 for one
// group per channel (then (32 ks) >> 31 == 0 for every K < 2^31).
template <int DT, bool HAS_ZEROS>
__global__ void __launch_bounds__(kThreads)
w4a16_dequant_kernel(const int4* __restrict__ wq, const uint16_t* __restrict__ scales,
                     const uint16_t* __restrict__ zeros, uint16_t* __restrict__ out, int N, int K, int group_shift) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ __align__(16) uint32_t tile[kStrip * kRowWords];  // [32 rows n][64 words = 128 k] + padding
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int sb = blockIdx.y;                    // strip: rows n0 .. n0 + 31 of W
  const int n0 = sb * kStrip;
  const int ks = blockIdx.x * (kBK / 32) + warp;  // this warp's k32 slice
  const int ks_total = K >> 5;

  // One 16-byte word per lane: the lane's 32 codes of tile (sb, ks); a warp reads 512 contiguous bytes.
  const int4 v = load_stream(wq + (static_cast<size_t>(sb) * ks_total + ks) * 32 + lane);
  const uint32_t words[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y), static_cast<uint32_t>(v.z),
                             static_cast<uint32_t>(v.w)};
  // A k32 slice never straddles a group (G >= 32, slices start at multiples of 32): one scale row for the warp.
  const size_t srow = static_cast<size_t>((ks * 32) >> group_shift) * N + n0;

#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    // Rows (block-relative) c_lo = 16 jj + g (registers r0, r1) and c_lo + 8 (r2, r3).
    const int c_lo = 16 * jj + g;
    const uint32_t s_lo = dup16(scales[srow + c_lo]);
    const uint32_t s_hi = dup16(scales[srow + c_lo + 8]);
    uint32_t nb_lo, nb_hi;  // -(bias + z), exact
    if constexpr (HAS_ZEROS) {
      nb_lo = fma2<DT>(dup16(zeros[srow + c_lo]), Dq<DT>::kNegOne, dup16(Dq<DT>::kNegBias));
      nb_hi = fma2<DT>(dup16(zeros[srow + c_lo + 8]), Dq<DT>::kNegOne, dup16(Dq<DT>::kNegBias));
    } else {
      nb_lo = nb_hi = Dq<DT>::kNegBiasSym;
    }
#pragma unroll
    for (int kh = 0; kh < 2; ++kh) {
      const uint32_t word = words[2 * kh + jj];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        // r_i = {W[n, k], W[n, k + 1]}: nibbles i (low half) and i + 4 (high half), n = c_lo + 8 (i >= 2),
        // k = 32 warp + 16 kh + 2 t + 8 (i % 2) inside the block's k128.
        const uint32_t q = and_or(word >> (4 * i), 0x000F000Fu, Dq<DT>::kExp);
        const uint32_t nb = i < 2 ? nb_lo : nb_hi;
        const uint32_t s = i < 2 ? s_lo : s_hi;
        const uint32_t w = fma2<DT>(fma2<DT>(q, Dq<DT>::kOne, nb), s, Dq<DT>::kNegZero);
        const int row = c_lo + 8 * (i >> 1);
        tile[row * kRowWords + 16 * warp + 8 * kh + 4 * (i & 1) + t] = w;  // word = k / 2
      }
    }
  }
  __syncthreads();

  // Write the tile: chunk c = row * 16 + ch holds W[n0 + row, k0 + 8 ch .. + 7]. Lanes 0..15 of a warp write one
  // row's 256 contiguous bytes, lanes 16..31 the next row's.
  const size_t k0 = static_cast<size_t>(blockIdx.x) * kBK;
#pragma unroll
  for (int it = 0; it < kStrip * kChunksPerRow / kThreads; ++it) {
    const int c = tid + it * kThreads;
    const int row = c >> 4, ch = c & (kChunksPerRow - 1);
    const uint4 val = *reinterpret_cast<const uint4*>(tile + row * kRowWords + 4 * ch);
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(n0 + row) * K + k0 + 8 * ch) = val;
  }
#endif
}

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <int DT, bool HAS_ZEROS>
int launch(const void* wq, const void* scales, const void* zeros, void* out, int N, int K, int group_shift,
           cudaStream_t stream) {
  const dim3 grid(K / kBK, N / kStrip);
  w4a16_dequant_kernel<DT, HAS_ZEROS><<<grid, kThreads, 0, stream>>>(
      static_cast<const int4*>(wq), static_cast<const uint16_t*>(scales), static_cast<const uint16_t*>(zeros),
      static_cast<uint16_t*>(out), N, K, group_shift);
  return cudaGetLastError() == cudaSuccess ? COMPRESS_OK : COMPRESS_LAUNCH_ERROR;
}

}  // namespace compress_dequant

using namespace compress_dequant;

extern "C" int compress_w4a16_dequant_supported(int N, int K, int group_size, int dtype, int sm) {
  if (dtype != COMPRESS_DTYPE_FP16 && dtype != COMPRESS_DTYPE_BF16) return COMPRESS_UNSUPPORTED;
  if (sm < 80) return COMPRESS_UNSUPPORTED;  // fma.rn.bf16x2
  if (N < kStrip || N % kStrip != 0 || N / kStrip > kMaxStrips || K < kBK || K % kBK != 0) return COMPRESS_UNSUPPORTED;
  if (group_size != 32 && group_size != 64 && group_size != 128 && group_size != -1) return COMPRESS_UNSUPPORTED;
  if (group_size > 0 && K % group_size != 0) return COMPRESS_UNSUPPORTED;
  return COMPRESS_OK;
}

extern "C" int compress_w4a16_dequant(const void* wq, const void* scales, const void* zeros, void* out, int N, int K,
                                      int group_size, int dtype, cudaStream_t stream) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();  // clear it: torch's next launch check would otherwise report it against its own kernel
    return COMPRESS_LAUNCH_ERROR;
  }
  if (compress_w4a16_dequant_supported(N, K, group_size, dtype, major * 10 + minor) != COMPRESS_OK)
    return COMPRESS_UNSUPPORTED;
  if (!wq || !scales || !out || !aligned(wq, 16) || !aligned(out, 16) || !aligned(scales, 2) ||
      (zeros && !aligned(zeros, 2)))
    return COMPRESS_UNSUPPORTED;
  // log2(G) without a loop at run time: G is one of four values (checked above).
  const int shift = group_size == 32 ? 5 : group_size == 64 ? 6 : group_size == 128 ? 7 : 31;
  if (dtype == COMPRESS_DTYPE_FP16)
    return zeros ? launch<COMPRESS_DTYPE_FP16, true>(wq, scales, zeros, out, N, K, shift, stream)
                 : launch<COMPRESS_DTYPE_FP16, false>(wq, scales, zeros, out, N, K, shift, stream);
  return zeros ? launch<COMPRESS_DTYPE_BF16, true>(wq, scales, zeros, out, N, K, shift, stream)
               : launch<COMPRESS_DTYPE_BF16, false>(wq, scales, zeros, out, N, K, shift, stream);
}
