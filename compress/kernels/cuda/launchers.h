// The C interface of compress's CUDA kernels: raw pointers and a stream, no torch headers.
// Every launcher returns COMPRESS_OK, or COMPRESS_UNSUPPORTED for a shape / dtype / device it does not
// handle (the caller then takes the reference path and reports it), or COMPRESS_LAUNCH_ERROR.
#pragma once
#include <cuda_runtime.h>

#define COMPRESS_OK 0
#define COMPRESS_UNSUPPORTED 1
#define COMPRESS_LAUNCH_ERROR 2

#define COMPRESS_DTYPE_FP16 0
#define COMPRESS_DTYPE_BF16 1

#ifdef __cplusplus
extern "C" {
#endif

// W4A16: out[M, N] = x[M, K] @ W^T, W[n, k] = (u[n, k] - z[k / G, n]) * s[k / G, n].
//   x, out: row-major, dtype (fp16 or bf16). wq: int4 codes u in the kernel layout written by
//   compress/kernels/prepack.py (prepack_w4a16). scales: [K / G, N] in dtype. zeros: NULL (symmetric,
//   z = 8) or [K / G, N] in dtype holding integers 0..15. group_size: 32, 64, 128, or -1 for one group
//   per output channel (G = K). splits: k-ranges computed by separate blocks (split-K), 1 <= splits <= K / 128;
//   when splits > 1, workspace holds splits * M * N floats (16-byte aligned), else it may be NULL.
int compress_w4a16_supported(int M, int N, int K, int group_size, int dtype, int sm);
int compress_w4a16_gemm(const void* x, const void* wq, const void* scales, const void* zeros, void* out,
                        int M, int N, int K, int group_size, int dtype, void* workspace, int splits,
                        cudaStream_t stream);

// W4A16 decode kernel, version 2 (w4a16_v2.cu): the same operands and result as compress_w4a16_gemm, for
//   1 <= M <= 16. splits: k-ranges of 128 * tiles_per_split / 4 columns (1 <= splits <= K / 128); when more than one
//   split gets k-tiles, workspace holds splits * M * N floats and tickets at least ceil(N / 256) int32 zeros, which
//   the launch leaves zeroed. pdl: launch as a programmatic dependent of the previous kernel in the stream (sm_90).
int compress_w4a16_v2_tiles_per_split(int K, int splits);
int compress_w4a16_v2_supported(int M, int N, int K, int group_size, int splits, int dtype, int sm);
int compress_w4a16_v2_gemm(const void* x, const void* wq, const void* scales, const void* zeros, void* out,
                           int M, int N, int K, int group_size, int dtype, void* workspace, int* tickets, int splits,
                           int pdl, cudaStream_t stream);

// fp8 W8A8: out[M, N] (bf16) = (a[M, K] * sa) @ (b[N, K] * sb)^T, a and b float8 e4m3, fp32 accumulation.
//   a_scale: fp32 [M] when a_per_row, else [1]; b_scale: fp32 [N] when b_per_col, else [1].
//   sm 90 runs the wgmma kernel (built for sm_90a), sm 89 the mma.sync e4m3 kernel.
int compress_fp8_supported(int M, int N, int K, int sm);
int compress_fp8_gemm(const void* a, const void* b, const float* a_scale, const float* b_scale, void* out,
                      int M, int N, int K, int a_per_row, int b_per_col, cudaStream_t stream);
// Dynamic per-token quantization: x[M, K] (dtype) -> q[M, K] e4m3, scale[M] fp32 = max(absmax / 448, 1e-12),
// q = saturate(x / scale) rounded to nearest even.
int compress_fp8_quantize_rows(const void* x, void* q, float* scale, int M, int K, int dtype, cudaStream_t stream);

// ---- W4A16 dequantization (dequant.cu): the large-batch path, dequantize into scratch then cuBLAS ----
// out[N, K] (row-major, dtype) = (u - z) * s rounded once, from the W4A16 GEMM's operands (wq, scales, zeros as
//   compress_w4a16_gemm takes them; zeros NULL: z = 8). out: a caller-provided buffer of N * K elements, 16-byte
//   aligned. Supported: sm >= 80, dtype fp16 / bf16, N % 32 == 0 and N <= 65535 * 32, K % 128 == 0,
//   group_size in {32, 64, 128, -1} dividing K.
int compress_w4a16_dequant_supported(int N, int K, int group_size, int dtype, int sm);
int compress_w4a16_dequant(const void* wq, const void* scales, const void* zeros, void* out, int N, int K,
                           int group_size, int dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
