// fp8 (e4m3) W8A8 GEMM and per-row dynamic quantization. The C interface is in launchers.h.
//
//   out[M, N] (bf16) = sa[m] * sb[n] * sum_k a[m, k] * b[n, k]     a: [M, K] e4m3, b: [N, K] e4m3, both K-major
//
// Two tensor-core paths, picked by the device's compute capability:
//   sm 90 -> fp8_gemm_sm90: Hopper warpgroup MMA, `wgmma.mma_async.m64n128k32.f32.e4m3.e4m3`, both operands read
//            straight from shared memory through matrix descriptors (SASS QGMMA). Needs the arch-specific target
//            sm_90a, so the body is guarded by __CUDA_ARCH_FEAT_SM90_ALL.
//   sm 89 -> fp8_gemm_sm89: Ada `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` (SASS QMMA), fragments loaded
//            with ldmatrix. (On sm_90a the same PTX is emulated with HMMA, so it is not used there; on sm_80 it is
//            a compile error, so the body is guarded.)
// A kernel compiled for an architecture it has no body for traps: a launch on the wrong binary fails loudly
// instead of returning garbage.
//
// Shared-memory layout (both paths, and the CPU model in compress/kernels/fp8_layout.py mirrors it):
//   A stage tile [BM rows][128 bytes of K], B stage tile [128 rows][128 bytes of K]. Row r occupies the 128 bytes at
//   r * 128; inside it the 16-byte chunk c (K bytes 16c..16c+15) is stored at chunk position c ^ (r % 8).
//   That is the PTX ISA's 128-byte swizzle ("Shared Memory Matrix Layout" / "Swizzling modes" under
//   "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Operation"): within each 1024-byte atom of 8 rows x
//   128 bytes, address bits [4:6] are XORed with bits [7:9]. It equals the canonical K-major SW128 layout only if
//   every tile starts on a 1024-byte boundary, which the kernels enforce by rounding the dynamic smem base up.
//   The same XOR makes the 8 row addresses of every ldmatrix / cp.async phase fall in 8 different 16-byte bank
//   groups, so the sm_89 path is bank-conflict free with the identical layout.
//
// Tiles and pipeline: a CTA computes a BM x 128 output tile (BM = 64 when M <= 64, else 128), K in steps of 128
// bytes. Every thread issues 16-byte cp.async copies (zero-filled past M, N and K) into a STAGES-deep ring.
// sm_89: each k-step waits for its stage, fences, barriers, issues the copy of the stage STAGES-1 ahead, computes.
// sm_90: the tensor cores run one k-step behind the issue: k-step t waits for its copies, barriers, issues the copy
// of tile t + STAGES - 2, issues its wgmma group and then waits until at most one group (its own) is pending, so
// the wgmma of step t overlaps the barrier and copy issue of step t + 1. The copy of tile t + STAGES - 2 overwrites
// the stage of tile t - 2, whose wgmma every warpgroup finished before the barrier of step t (each waited for it
// at the end of step t - 1). The first GPU run, which waited for each group at once (and ran 4 stages, 3 ahead),
// measured 0.52x torch._scaled_mm at 4096^3.
//
// Supported shapes (fp8_unsupported_reason; mirrored by fp8_supported in fp8_layout.py):
//   sm 89 or 90; M >= 1; N >= 8 and N % 8 == 0 (bf16x2 stores, 4-byte aligned rows); K >= 16 and K % 16 == 0
//   (16-byte copies never straddle K's end and rows stay 16-byte aligned); N / 128 tiles <= 65535 (grid.y).
//   At launch a and b must be 16-byte aligned and out 4-byte aligned, else COMPRESS_UNSUPPORTED.
#include "launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// A named namespace with inline functions: helpers unused by one architecture's pass raise no warnings.
namespace compress_fp8 {

inline constexpr int kBN = 128;          // output columns per CTA (wgmma N)
inline constexpr int kBK = 128;          // K bytes (= fp8 elements) per pipeline stage: one 128-byte swizzle row
inline constexpr int kStagesSm90 = 6;    // 6 x 32 KiB (BM = 128) of the 227 KiB Hopper allows; copies run 4 ahead
inline constexpr int kStagesSm89 = 3;    // 3 x 32 KiB fits Ada's 99 KiB opt-in limit
inline constexpr int kSmemAlign = 1024;  // one 128B-swizzle atom: 8 rows x 128 bytes

// ---------------------------------------------------------------------------------------------------------------
// Shape rules, shared by compress_fp8_supported and compress_fp8_gemm.
// ---------------------------------------------------------------------------------------------------------------
inline const char* fp8_unsupported_reason(int M, int N, int K, int sm) {
  if (sm != 89 && sm != 90) return "fp8 kernels need sm 89 (mma.sync e4m3) or sm 90 (wgmma)";
  if (M < 1) return "M must be >= 1";
  if (N < 8 || N % 8 != 0) return "N must be a positive multiple of 8";
  if (K < 16 || K % 16 != 0) return "K must be a positive multiple of 16";
  if ((N + kBN - 1) / kBN > 65535) return "N too large for the grid";
  return nullptr;
}

constexpr int stage_bytes(int bm) { return (bm + kBN) * kBK; }

// ---------------------------------------------------------------------------------------------------------------
// Shared helpers (all architectures that run a gemm body: sm_89 and sm_90a).
// ---------------------------------------------------------------------------------------------------------------

// Byte offset of K byte `kb` (0..127) of tile row `row` inside a stage tile: the 128B swizzle described above.
__device__ __forceinline__ uint32_t swizzle128(int row, int kb) {
  return static_cast<uint32_t>(row * 128 + ((((kb >> 4) ^ (row & 7))) << 4) + (kb & 15));
}

// cp.async.cg with a source size: src_bytes = 0 zero-fills the 16 destination bytes and reads nothing
// (PTX ISA "Data Movement and Conversion Instructions: cp.async", the optional src-size operand).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Copy rows [row0, row0 + ROWS) x K bytes [k0, k0 + 128) of a K-major [rows, K] e4m3 matrix into a swizzled
// stage tile. Chunk i = (row r = i / 8, 16-byte chunk c = i % 8). Rows >= rows and chunks >= K are zero-filled
// (K % 16 == 0, so a chunk is either wholly inside K or wholly past it).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t tile, const uint8_t* g, int row0, int rows, int K, int k0,
                                          int tid) {
  static_assert((ROWS * 8) % THREADS == 0, "chunks must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < ROWS * 8 / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int r = i >> 3, c = i & 7;
    const int kb = k0 + c * 16;
    const bool ok = (row0 + r < rows) && (kb < K);
    const uint8_t* src = ok ? g + static_cast<size_t>(row0 + r) * K + kb : g;
    cp_async16(tile + swizzle128(r, c * 16), src, ok ? 16 : 0);
  }
}

// The dynamic shared memory window rounded up to kSmemAlign (the launch adds kSmemAlign bytes of slack).
__device__ __forceinline__ uint32_t aligned_smem_base(const uint8_t* smem) {
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return (raw + kSmemAlign - 1) & ~static_cast<uint32_t>(kSmemAlign - 1);
}

// Epilogue for one pair of adjacent columns: out[row, col..col+1] = bf16(acc * sa * sb).
__device__ __forceinline__ void store_pair(__nv_bfloat16* out, int M, int N, int row, int col, float v0, float v1,
                                           const float* a_scale, int a_per_row, float sb0, float sb1) {
  if (row >= M || col >= N) return;  // N % 8 == 0 and col even: col < N implies col + 1 < N
  const float sa = a_per_row ? a_scale[row] : a_scale[0];
  __nv_bfloat162 v = __floats2bfloat162_rn(sa * sb0 * v0, sa * sb1 * v1);
  *reinterpret_cast<__nv_bfloat162*>(out + static_cast<size_t>(row) * N + col) = v;
}

// ---------------------------------------------------------------------------------------------------------------
// Hopper: wgmma.
// ---------------------------------------------------------------------------------------------------------------

// Shared-memory matrix descriptor, PTX ISA "Matrix Descriptor Format" (Asynchronous Warpgroup Level Matrix
// Shared Memory Layout, matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4):
//   bits  0-13  start address           encode(addr)
//   bits 16-29  leading dimension byte offset (LBO)  encode(lbo): distance between core matrices along K;
//               unused for swizzled K-major layouts (we put 16, i.e. field value 1, as CUTLASS does)
//   bits 32-45  stride dimension byte offset (SBO)   encode(sbo): distance between 8-row core-matrix groups
//               along M / N; 8 rows x 128 bytes = 1024 for the 128B swizzle
//   bits 49-51  matrix base offset: 0, since every swizzle atom starts 1024-byte aligned
//   bits 62-63  swizzle mode: 0 none, 1 = 128B, 2 = 64B, 3 = 32B
// Mirrored by make_smem_desc in compress/kernels/fp8_layout.py.
inline constexpr uint32_t kSwizzle128B = 1;
__host__ __device__ constexpr uint64_t make_smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t swizzle) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (static_cast<uint64_t>(swizzle & 3) << 62);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Keep the compiler from moving accumulator reads/writes across wgmma fences / waits (the registers are in
// flight while the async MMA runs). Same idea as CUTLASS's warpgroup_fence_operand.
__device__ __forceinline__ void fence_operands(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// out D[64 x 128] += A[64 x 32] * B[128 x 32]^T, both from shared memory (PTX ISA "wgmma.mma_async"; e4m3 inputs
// allow K-major operands only, hence no transpose immediates). scale-d = 1 (accumulate), imm-scale-a/b = 1.
// Accumulator fragment (PTX ISA "Register Fragments and Shared Memory Matrix Layouts", D for .m64nNk32):
// d[4 * i + 2 * h + e] holds row 16 * warp + lane / 4 + 8 * h, column 8 * i + 2 * (lane % 4) + e.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}
#endif

// One warpgroup (128 threads) per 64 rows of the BM x 128 tile; all threads load, all compute.
template <int BM>
__global__ void __launch_bounds__(BM * 2) fp8_gemm_sm90(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                                                        const float* __restrict__ a_scale,
                                                        const float* __restrict__ b_scale,
                                                        __nv_bfloat16* __restrict__ out, int M, int N, int K,
                                                        int a_per_row, int b_per_col) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int THREADS = BM * 2;
  constexpr int STAGES = kStagesSm90;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = aligned_smem_base(smem_raw);
  const int tid = threadIdx.x;
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * kBN;
  const int k_tiles = (K + kBK - 1) / kBK;
  // Stage s: A tile at s * stage_bytes, B tile right after it (BM * 128 is a multiple of 1024).
  auto a_tile = [&](int s) { return smem + s * stage_bytes(BM); };
  auto b_tile = [&](int s) { return smem + s * stage_bytes(BM) + BM * kBK; };
  auto load_stage = [&](int s, int kt) {
    load_tile<BM, THREADS>(a_tile(s), a, m0, M, K, kt * kBK, tid);
    load_tile<kBN, THREADS>(b_tile(s), b, n0, N, K, kt * kBK, tid);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();  // always commit, so the group count per step is fixed
  }

  float acc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.f;

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 3>();  // this thread's copies of tile kt have landed
    // cp.async wrote through the generic proxy; wgmma reads shared memory through the async proxy
    // (PTX ISA "Memory Consistency Model: proxies", fence.proxy.async).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();  // everyone's copies of tile kt are visible; every warpgroup's wgmma of tile kt - 2 is done
    const int next = kt + STAGES - 2;
    if (next < k_tiles) load_stage(next % STAGES, next);  // refills the stage tile kt - 2 used
    cp_async_commit();

    const int s = kt % STAGES;
    const uint32_t a_base = a_tile(s) + wg * 64 * kBK;  // this warpgroup's 64 rows: 8 atoms, 1024-aligned
    const uint32_t b_base = b_tile(s);
    fence_operands(acc);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk) {
      // k32 slice kk = bytes 32kk..32kk+31 of each 128-byte row: advance the start address by 32 bytes inside
      // the swizzle atom; the hardware applies the XOR to the full address, matching the loader.
      const uint64_t da = make_smem_desc(a_base + kk * 32, 16, 1024, kSwizzle128B);
      const uint64_t db = make_smem_desc(b_base + kk * 32, 16, 1024, kSwizzle128B);
      wgmma_m64n128k32_e4m3(acc, da, db);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // the group of tile kt - 1 is done
    fence_operands(acc);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_operands(acc);
  cp_async_wait<0>();

  const int row = m0 + wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
  for (int i = 0; i < kBN / 8; ++i) {
    const int col = n0 + i * 8 + 2 * (lane & 3);
    if (col >= N) continue;
    const float sb0 = b_per_col ? b_scale[col] : b_scale[0];
    const float sb1 = b_per_col ? b_scale[col + 1] : b_scale[0];
    store_pair(out, M, N, row, col, acc[4 * i + 0], acc[4 * i + 1], a_scale, a_per_row, sb0, sb1);
    store_pair(out, M, N, row + 8, col, acc[4 * i + 2], acc[4 * i + 3], a_scale, a_per_row, sb0, sb1);
  }
#else
  __trap();  // built without sm_90a features: never launched by compress_fp8_gemm on a matching binary
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Ada: mma.sync m16n8k32 e4m3.
// ---------------------------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define COMPRESS_FP8_SM89_BODY 1
#endif

#if defined(COMPRESS_FP8_SM89_BODY)
// ldmatrix.x4: lanes 8q..8q+7 give the row addresses of 8x16-byte matrix q; register q of lane l receives bytes
// 4(l%4)..4(l%4)+3 of row l/4 of matrix q (PTX ISA "ldmatrix").
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");  // keep the shared-memory reads after the preceding wait / barrier
}

// D[16 x 8] += A[16 x 32] * B[32 x 8], PTX ISA "Matrix Fragments for mma.m16n8k32" (8-bit types), g = lane / 4,
// t = lane % 4: a0 = A[g][4t..4t+3], a1 = A[g+8][4t..], a2 = A[g][16+4t..], a3 = A[g+8][16+4t..];
// b0 = B[4t..4t+3][g], b1 = B[16+4t..][g]; c0,c1 = D[g][2t, 2t+1], c2,c3 = D[g+8][2t, 2t+1].
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// BM / 16 warps as a (BM / 64) x 4 grid, each computing 64 x 32 (4 x 4 mma tiles).
template <int BM>
__global__ void __launch_bounds__(BM * 2) fp8_gemm_sm89(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                                                        const float* __restrict__ a_scale,
                                                        const float* __restrict__ b_scale,
                                                        __nv_bfloat16* __restrict__ out, int M, int N, int K,
                                                        int a_per_row, int b_per_col) {
#if defined(COMPRESS_FP8_SM89_BODY)
  constexpr int THREADS = BM * 2;
  constexpr int STAGES = kStagesSm89;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t smem = aligned_smem_base(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int wm = warp >> 2, wn = warp & 3;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * kBN;
  const int k_tiles = (K + kBK - 1) / kBK;
  auto a_tile = [&](int s) { return smem + s * stage_bytes(BM); };
  auto b_tile = [&](int s) { return smem + s * stage_bytes(BM) + BM * kBK; };
  auto load_stage = [&](int s, int kt) {
    load_tile<BM, THREADS>(a_tile(s), a, m0, M, K, kt * kBK, tid);
    load_tile<kBN, THREADS>(b_tile(s), b, n0, N, K, kt * kBK, tid);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  // ldmatrix row / K-byte offsets of this lane (see ldmatrix_x4 and mma_e4m3):
  //   A matrices q = 0..3 are (rows 0-7, k 0-15), (rows 8-15, k 0-15), (rows 0-7, k 16-31), (rows 8-15, k 16-31);
  //   B matrices q = 0..3 are (n 0-7, k 0-15), (n 0-7, k 16-31), (n 8-15, k 0-15), (n 8-15, k 16-31).
  const int a_row = wm * 64 + (lane & 7) + ((lane >> 3) & 1) * 8, a_kb = (lane >> 4) * 16;
  const int b_row = wn * 32 + (lane & 7) + (lane >> 4) * 8, b_kb = ((lane >> 3) & 1) * 16;

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int next = kt + STAGES - 1;
    if (next < k_tiles) load_stage(next % STAGES, next);
    cp_async_commit();

    const int s = kt % STAGES;
    const uint32_t at = a_tile(s), bt = b_tile(s);
#pragma unroll
    for (int kk = 0; kk < kBK / 32; ++kk) {
      uint32_t af[4][4], bf[2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ldmatrix_x4(af[i], at + swizzle128(a_row + i * 16, kk * 32 + a_kb));
#pragma unroll
      for (int j = 0; j < 2; ++j) ldmatrix_x4(bf[j], bt + swizzle128(b_row + j * 16, kk * 32 + b_kb));
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_e4m3(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = n0 + wn * 32 + j * 8 + 2 * (lane & 3);
    if (col >= N) continue;
    const float sb0 = b_per_col ? b_scale[col] : b_scale[0];
    const float sb1 = b_per_col ? b_scale[col + 1] : b_scale[0];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = m0 + wm * 64 + i * 16 + (lane >> 2);
      store_pair(out, M, N, row, col, acc[i][j][0], acc[i][j][1], a_scale, a_per_row, sb0, sb1);
      store_pair(out, M, N, row + 8, col, acc[i][j][2], acc[i][j][3], a_scale, a_per_row, sb0, sb1);
    }
  }
#else
  __trap();  // no sm_89 body in this build (sm_80, or sm_90a which has the wgmma kernel)
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// Per-row dynamic quantization (any architecture: cuda_fp8.h converts in software below sm_89).
// One 256-thread block per row: absmax (fmaxf, so NaNs are ignored, unlike torch's amax), then the codes.
// Mirrored by fp8_quantize_rows_reference in fp8_layout.py. Two versions with the same arithmetic:
//   fp8_quantize_rows_vec<T, CH> (K % 8 == 0, 16-byte aligned rows: every layer the kernels run, K being padded to
//     16): each thread loads its CH 16-byte chunks of the row into registers, all loads issued before the first
//     use, then writes 8 codes per chunk with one 8-byte store. CH (1, 2, 4, 8) is the smallest that holds the row
//     (256 x 8 x CH elements); rows longer than 16384 loop over the rest twice. A small CH keeps the registers, so
//     the blocks (rows) in flight per SM, high. The first GPU run measured the scalar version at 197 us for
//     4096 x 8192 bf16 (one dependent 2-byte load at a time: latency-bound), 9x its share of the bytes; a version
//     with 8 chunks for every K (93 registers, 2 blocks an SM) took 54 us there but 40 us at K = 4096.
//   fp8_quantize_rows: scalar, any K and any architecture (the vector kernel's body is built for sm 89+ only: on
//     sm_80 its software e4m3 conversion spilled).
// ---------------------------------------------------------------------------------------------------------------
inline constexpr int kQuantThreads = 256;

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// The row's scale from each thread's partial absmax: max over the block (fmaxf: NaNs ignored), then
// max(absmax / 448, 1e-12); thread 0 stores it. Every thread of the block must call it (a barrier inside).
__device__ __forceinline__ float row_scale(float amax, float* scale_out) {
  __shared__ float warp_max[kQuantThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kQuantThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  const float s = fmaxf(amax / 448.f, 1e-12f);  // 448 = largest finite e4m3 (OCP FP8 spec)
  if (threadIdx.x == 0) *scale_out = s;
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kQuantThreads) fp8_quantize_rows(const T* __restrict__ x,
                                                                   __nv_fp8_storage_t* __restrict__ q,
                                                                   float* __restrict__ scale, int K) {
  const size_t row = blockIdx.x;
  const T* xr = x + row * K;
  float amax = 0.f;
  for (int k = threadIdx.x; k < K; k += kQuantThreads) amax = fmaxf(amax, fabsf(to_float(xr[k])));
  const float s = row_scale(amax, scale + row);
  for (int k = threadIdx.x; k < K; k += kQuantThreads)  // IEEE division, round-to-nearest-even, saturate
    q[row * K + k] = __nv_cvt_float_to_fp8(to_float(xr[k]) / s, __NV_SATFINITE, __NV_E4M3);
}

inline constexpr int kQuantMaxChunks = 8;  // 16-byte chunks a thread holds at most: 256 x 8 x 8 = 16384 elements

// Element j (0..7, a compile-time constant after unrolling) of a 16-byte chunk of halves, as float: bit operations
// on the four 32-bit words (the low half first), so the chunk stays in registers (taking its address spilled it).
__device__ __forceinline__ float from_bits(uint16_t b, __half) { return __half2float(__ushort_as_half(b)); }
__device__ __forceinline__ float from_bits(uint16_t b, __nv_bfloat16) {
  return __bfloat162float(__ushort_as_bfloat16(b));
}
template <typename T>
__device__ __forceinline__ float chunk_at(const int4& v, int j) {
  const uint32_t w = j < 2 ? static_cast<uint32_t>(v.x) : j < 4 ? static_cast<uint32_t>(v.y)
                   : j < 6 ? static_cast<uint32_t>(v.z) : static_cast<uint32_t>(v.w);
  return from_bits(static_cast<uint16_t>(j % 2 ? w >> 16 : w & 0xFFFFu), T());
}

// 8 codes of one 16-byte chunk (8 halves), packed little-endian into 8 bytes.
template <typename T>
__device__ __forceinline__ uint2 quantize_chunk(const int4& v, float s) {
  uint32_t w0 = 0u, w1 = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // IEEE division, round-to-nearest-even, saturate: as the scalar kernel
    const uint32_t c = __nv_cvt_float_to_fp8(chunk_at<T>(v, j) / s, __NV_SATFINITE, __NV_E4M3);
    if (j < 4) w0 |= c << (8 * j); else w1 |= c << (8 * (j - 4));
  }
  return make_uint2(w0, w1);
}

template <typename T>
__device__ __forceinline__ float chunk_absmax(const int4& v, float amax) {
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(chunk_at<T>(v, j)));
  return amax;
}

template <typename T, int CH>
__global__ void __launch_bounds__(kQuantThreads) fp8_quantize_rows_vec(const T* __restrict__ x,
                                                                       __nv_fp8_storage_t* __restrict__ q,
                                                                       float* __restrict__ scale, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890  // fp8 layers run on sm 89+; below, the scalar kernel serves
  const size_t row = blockIdx.x;
  const int chunks = K / 8;
  const int4* xr = reinterpret_cast<const int4*>(x + row * K);
  uint2* qr = reinterpret_cast<uint2*>(q + row * K);
  int4 v[CH];
#pragma unroll
  for (int i = 0; i < CH; ++i) {  // every load in flight before the first use
    const int c = threadIdx.x + i * kQuantThreads;
    v[i] = c < chunks ? xr[c] : make_int4(0, 0, 0, 0);
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < CH; ++i) amax = chunk_absmax<T>(v[i], amax);  // zeros past the row: no change
  for (int c = threadIdx.x + CH * kQuantThreads; c < chunks; c += kQuantThreads)
    amax = chunk_absmax<T>(xr[c], amax);
  const float s = row_scale(amax, scale + row);
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int c = threadIdx.x + i * kQuantThreads;
    if (c < chunks) qr[c] = quantize_chunk<T>(v[i], s);
  }
  for (int c = threadIdx.x + CH * kQuantThreads; c < chunks; c += kQuantThreads)
    qr[c] = quantize_chunk<T>(xr[c], s);
#else
  __trap();  // never launched below sm 89 (compress_fp8_quantize_rows checks the device)
#endif
}

template <typename T>
void launch_quantize_vec(const T* x, __nv_fp8_storage_t* q, float* scale, int M, int K, cudaStream_t stream) {
  const int per_thread = (K / 8 + kQuantThreads - 1) / kQuantThreads;  // chunks a thread needs for the whole row
  if (per_thread <= 1)
    fp8_quantize_rows_vec<T, 1><<<M, kQuantThreads, 0, stream>>>(x, q, scale, K);
  else if (per_thread <= 2)
    fp8_quantize_rows_vec<T, 2><<<M, kQuantThreads, 0, stream>>>(x, q, scale, K);
  else if (per_thread <= 4)
    fp8_quantize_rows_vec<T, 4><<<M, kQuantThreads, 0, stream>>>(x, q, scale, K);
  else
    fp8_quantize_rows_vec<T, kQuantMaxChunks><<<M, kQuantThreads, 0, stream>>>(x, q, scale, K);
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------------------------
inline int device_sm(int* sm) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) !=
                                                cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return COMPRESS_LAUNCH_ERROR;
  }
  *sm = major * 10 + minor;
  return COMPRESS_OK;
}

using GemmKernel = void (*)(const uint8_t*, const uint8_t*, const float*, const float*, __nv_bfloat16*, int, int,
                            int, int, int);

inline int launch_gemm(GemmKernel kernel, int bm, int stages, const void* a, const void* b, const float* a_scale,
                const float* b_scale, void* out, int M, int N, int K, int a_per_row, int b_per_col,
                cudaStream_t stream) {
  const int smem = stages * stage_bytes(bm) + kSmemAlign;
  if (cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                           smem) != cudaSuccess) {
    cudaGetLastError();
    return COMPRESS_LAUNCH_ERROR;
  }
  const dim3 grid((M + bm - 1) / bm, (N + kBN - 1) / kBN);
  kernel<<<grid, bm * 2, smem, stream>>>(static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), a_scale,
                                         b_scale, static_cast<__nv_bfloat16*>(out), M, N, K, a_per_row, b_per_col);
  return cudaGetLastError() == cudaSuccess ? COMPRESS_OK : COMPRESS_LAUNCH_ERROR;
}

}  // namespace compress_fp8

using namespace compress_fp8;

extern "C" int compress_fp8_supported(int M, int N, int K, int sm) {
  return fp8_unsupported_reason(M, N, K, sm) == nullptr ? COMPRESS_OK : COMPRESS_UNSUPPORTED;
}

extern "C" int compress_fp8_gemm(const void* a, const void* b, const float* a_scale, const float* b_scale, void* out,
                                 int M, int N, int K, int a_per_row, int b_per_col, cudaStream_t stream) {
  int sm = 0;
  if (device_sm(&sm) != COMPRESS_OK) return COMPRESS_LAUNCH_ERROR;
  if (fp8_unsupported_reason(M, N, K, sm) != nullptr) return COMPRESS_UNSUPPORTED;
  if (!a || !b || !a_scale || !b_scale || !out) return COMPRESS_UNSUPPORTED;
  if (reinterpret_cast<uintptr_t>(a) % 16 || reinterpret_cast<uintptr_t>(b) % 16 ||
      reinterpret_cast<uintptr_t>(out) % 4)
    return COMPRESS_UNSUPPORTED;
  a_per_row = a_per_row ? 1 : 0;
  b_per_col = b_per_col ? 1 : 0;
  if (sm == 90) {
    if (M <= 64)
      return launch_gemm(fp8_gemm_sm90<64>, 64, kStagesSm90, a, b, a_scale, b_scale, out, M, N, K, a_per_row,
                         b_per_col, stream);
    return launch_gemm(fp8_gemm_sm90<128>, 128, kStagesSm90, a, b, a_scale, b_scale, out, M, N, K, a_per_row,
                       b_per_col, stream);
  }
  if (M <= 64)
    return launch_gemm(fp8_gemm_sm89<64>, 64, kStagesSm89, a, b, a_scale, b_scale, out, M, N, K, a_per_row,
                       b_per_col, stream);
  return launch_gemm(fp8_gemm_sm89<128>, 128, kStagesSm89, a, b, a_scale, b_scale, out, M, N, K, a_per_row,
                     b_per_col, stream);
}

extern "C" int compress_fp8_quantize_rows(const void* x, void* q, float* scale, int M, int K, int dtype,
                                          cudaStream_t stream) {
  if (M < 0 || K < 1 || (dtype != COMPRESS_DTYPE_FP16 && dtype != COMPRESS_DTYPE_BF16)) return COMPRESS_UNSUPPORTED;
  if (M == 0) return COMPRESS_OK;
  if (!x || !q || !scale) return COMPRESS_UNSUPPORTED;
  auto* qo = static_cast<__nv_fp8_storage_t*>(q);
  int sm = 0;
  if (device_sm(&sm) != COMPRESS_OK) return COMPRESS_LAUNCH_ERROR;
  if (sm >= 89 && K % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(q) % 8 == 0) {
    if (dtype == COMPRESS_DTYPE_FP16)
      launch_quantize_vec(static_cast<const __half*>(x), qo, scale, M, K, stream);
    else
      launch_quantize_vec(static_cast<const __nv_bfloat16*>(x), qo, scale, M, K, stream);
    return cudaGetLastError() == cudaSuccess ? COMPRESS_OK : COMPRESS_LAUNCH_ERROR;
  }
  if (dtype == COMPRESS_DTYPE_FP16)
    fp8_quantize_rows<__half><<<M, kQuantThreads, 0, stream>>>(static_cast<const __half*>(x), qo, scale, K);
  else
    fp8_quantize_rows<__nv_bfloat16><<<M, kQuantThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), qo,
                                                                       scale, K);
  return cudaGetLastError() == cudaSuccess ? COMPRESS_OK : COMPRESS_LAUNCH_ERROR;
}
