// Thin torch binding of the CUDA launchers (launchers.h): input checks, raw pointers, the caller's stream.
// It includes no CUDA headers of torch (c10/cuda): the stream arrives as an integer from Python
// (torch.cuda.current_stream().cuda_stream), so this file also compiles against a CPU-only torch, which the
// CPU test suite uses as a compile check. The ops are called from compress/kernels/ops.py, which registers the
// public `compress::` ops (reference CPU path, fake/meta functions for torch.compile).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <optional>
#include "launchers.h"

namespace {

int dtype_code(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return COMPRESS_DTYPE_FP16;
  if (t.scalar_type() == at::kBFloat16) return COMPRESS_DTYPE_BF16;
  TORCH_CHECK(false, "compress: activations must be float16 or bfloat16, got ", t.scalar_type());
  return -1;
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "compress: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), "compress: ", name, " must be contiguous (shape ", t.sizes(), ", strides ",
              t.strides(), ")");
}

int64_t w4a16_gemm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                   const std::optional<at::Tensor>& zeros, at::Tensor& out, const std::optional<at::Tensor>& workspace,
                   int64_t group_size, int64_t splits, int64_t stream) {
  check_cuda(x, "x"); check_cuda(wq, "wq"); check_cuda(scales, "scales"); check_cuda(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "compress: x and out must be 2-D, got ", x.sizes(), " and ", out.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "compress: out has ", out.size(0), " rows, x has ", M);
  TORCH_CHECK(wq.scalar_type() == at::kInt && wq.numel() * 8 == N * K, "compress: wq must be int32 with N*K/8 = ",
              N * K / 8, " elements, got ", wq.scalar_type(), " with ", wq.numel());
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "compress: scales and out must have x's dtype ", x.scalar_type());
  const void* zp = nullptr;
  if (zeros.has_value()) {
    check_cuda(*zeros, "zeros");
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->scalar_type() == x.scalar_type(),
                "compress: zeros must match scales (", scales.sizes(), ", ", x.scalar_type(), ")");
    zp = zeros->data_ptr();
  }
  void* ws = nullptr;
  if (splits > 1) {
    TORCH_CHECK(workspace.has_value(), "compress: splits = ", splits, " needs a workspace");
    check_cuda(*workspace, "workspace");
    TORCH_CHECK(workspace->scalar_type() == at::kFloat && workspace->numel() >= splits * M * N,
                "compress: the workspace must be float32 with at least splits * M * N = ", splits * M * N,
                " elements, got ", workspace->scalar_type(), " with ", workspace->numel());
    ws = workspace->data_ptr();
  }
  return compress_w4a16_gemm(x.data_ptr(), wq.data_ptr(), scales.data_ptr(), zp, out.data_ptr(), (int)M, (int)N,
                             (int)K, (int)group_size, dtype_code(x), ws, (int)splits,
                             reinterpret_cast<cudaStream_t>(stream));
}

// ---- W4A16 version 2 (w4a16_v2.cu): the same operands; tickets: int32 zeros, at least ceil(N / 256) ----------------
int64_t w4a16_v2_gemm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& scales,
                      const std::optional<at::Tensor>& zeros, at::Tensor& out,
                      const std::optional<at::Tensor>& workspace, const std::optional<at::Tensor>& tickets,
                      int64_t group_size, int64_t splits, int64_t pdl, int64_t stream) {
  check_cuda(x, "x"); check_cuda(wq, "wq"); check_cuda(scales, "scales"); check_cuda(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "compress: x and out must be 2-D, got ", x.sizes(), " and ", out.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M, "compress: out has ", out.size(0), " rows, x has ", M);
  TORCH_CHECK(wq.scalar_type() == at::kInt && wq.numel() * 8 == N * K, "compress: wq must be int32 with N*K/8 = ",
              N * K / 8, " elements, got ", wq.scalar_type(), " with ", wq.numel());
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "compress: scales and out must have x's dtype ", x.scalar_type());
  const void* zp = nullptr;
  if (zeros.has_value()) {
    check_cuda(*zeros, "zeros");
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->scalar_type() == x.scalar_type(),
                "compress: zeros must match scales (", scales.sizes(), ", ", x.scalar_type(), ")");
    zp = zeros->data_ptr();
  }
  void* ws = nullptr;
  int* tk = nullptr;
  if (splits > 1) {
    TORCH_CHECK(workspace.has_value() && tickets.has_value(), "compress: splits = ", splits,
                " needs a workspace and tickets");
    check_cuda(*workspace, "workspace"); check_cuda(*tickets, "tickets");
    TORCH_CHECK(workspace->scalar_type() == at::kFloat && workspace->numel() >= splits * M * N,
                "compress: the workspace must be float32 with at least splits * M * N = ", splits * M * N,
                " elements, got ", workspace->scalar_type(), " with ", workspace->numel());
    TORCH_CHECK(tickets->scalar_type() == at::kInt && tickets->numel() >= (N + 255) / 256,
                "compress: tickets must be int32 with at least ceil(N / 256) = ", (N + 255) / 256, " elements");
    ws = workspace->data_ptr();
    tk = tickets->data_ptr<int>();
  }
  return compress_w4a16_v2_gemm(x.data_ptr(), wq.data_ptr(), scales.data_ptr(), zp, out.data_ptr(), (int)M, (int)N,
                                (int)K, (int)group_size, dtype_code(x), ws, tk, (int)splits, (int)pdl,
                                reinterpret_cast<cudaStream_t>(stream));
}

int64_t w4a16_v2_supported(int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t splits, int64_t dtype,
                           int64_t sm) {
  return compress_w4a16_v2_supported((int)M, (int)N, (int)K, (int)group_size, (int)splits, (int)dtype, (int)sm);
}

int64_t fp8_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_scale, const at::Tensor& b_scale,
                 at::Tensor& out, int64_t stream) {
  check_cuda(a, "a"); check_cuda(b, "b"); check_cuda(a_scale, "a_scale"); check_cuda(b_scale, "b_scale");
  check_cuda(out, "out");
  TORCH_CHECK(a.scalar_type() == at::kFloat8_e4m3fn && b.scalar_type() == at::kFloat8_e4m3fn,
              "compress: a and b must be float8_e4m3fn, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "compress: a [M, K] and b [N, K] needed, got ",
              a.sizes(), " and ", b.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && b_scale.scalar_type() == at::kFloat,
              "compress: scales must be float32");
  TORCH_CHECK(a_scale.numel() == 1 || a_scale.numel() == M, "compress: a_scale has ", a_scale.numel(),
              " elements; 1 or M = ", M);
  TORCH_CHECK(b_scale.numel() == 1 || b_scale.numel() == N, "compress: b_scale has ", b_scale.numel(),
              " elements; 1 or N = ", N);
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.size(0) == M && out.size(1) == N,
              "compress: out must be bfloat16 [", M, ", ", N, "]");
  return compress_fp8_gemm(a.data_ptr(), b.data_ptr(), a_scale.data_ptr<float>(), b_scale.data_ptr<float>(),
                           out.data_ptr(), (int)M, (int)N, (int)K, a_scale.numel() == M && M > 1,
                           b_scale.numel() == N && N > 1, reinterpret_cast<cudaStream_t>(stream));
}

int64_t fp8_quantize_rows(const at::Tensor& x, at::Tensor& q, at::Tensor& scale, int64_t stream) {
  check_cuda(x, "x"); check_cuda(q, "q"); check_cuda(scale, "scale");
  TORCH_CHECK(x.dim() == 2 && q.sizes() == x.sizes() && q.scalar_type() == at::kFloat8_e4m3fn,
              "compress: q must be float8_e4m3fn shaped like x ", x.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == x.size(0), "compress: scale must be float32 [",
              x.size(0), "]");
  return compress_fp8_quantize_rows(x.data_ptr(), q.data_ptr(), scale.data_ptr<float>(), (int)x.size(0),
                                    (int)x.size(1), dtype_code(x), reinterpret_cast<cudaStream_t>(stream));
}

int64_t w4a16_supported(int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t dtype, int64_t sm) {
  return compress_w4a16_supported((int)M, (int)N, (int)K, (int)group_size, (int)dtype, (int)sm);
}

int64_t fp8_supported(int64_t M, int64_t N, int64_t K, int64_t sm) {
  return compress_fp8_supported((int)M, (int)N, (int)K, (int)sm);
}

// ---- begin: W4A16 dequantization (dequant.cu; issue 44 item 3) ----------------------------------------------------
int64_t w4a16_dequant(const at::Tensor& wq, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                      at::Tensor& out, int64_t group_size, int64_t stream) {
  check_cuda(wq, "wq"); check_cuda(scales, "scales"); check_cuda(out, "out");
  TORCH_CHECK(out.dim() == 2, "compress: out must be [N, K], got ", out.sizes());
  const int64_t N = out.size(0), K = out.size(1);
  TORCH_CHECK(wq.scalar_type() == at::kInt && wq.numel() * 8 == N * K, "compress: wq must be int32 with N*K/8 = ",
              N * K / 8, " elements, got ", wq.scalar_type(), " with ", wq.numel());
  TORCH_CHECK(scales.scalar_type() == out.scalar_type(), "compress: scales must have out's dtype ", out.scalar_type(),
              ", got ", scales.scalar_type());
  const int64_t groups = group_size > 0 ? K / group_size : 1;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == groups && scales.size(1) == N,
              "compress: scales must be [K / G, N] = [", groups, ", ", N, "], got ", scales.sizes());
  const void* zp = nullptr;
  if (zeros.has_value()) {
    check_cuda(*zeros, "zeros");
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->scalar_type() == out.scalar_type(),
                "compress: zeros must match scales (", scales.sizes(), ", ", out.scalar_type(), ")");
    zp = zeros->data_ptr();
  }
  return compress_w4a16_dequant(wq.data_ptr(), scales.data_ptr(), zp, out.data_ptr(), (int)N, (int)K,
                                (int)group_size, dtype_code(out), reinterpret_cast<cudaStream_t>(stream));
}

int64_t w4a16_dequant_supported(int64_t N, int64_t K, int64_t group_size, int64_t dtype, int64_t sm) {
  return compress_w4a16_dequant_supported((int)N, (int)K, (int)group_size, (int)dtype, (int)sm);
}
// ---- end: W4A16 dequantization --------------------------------------------------------------------------------------

}  // namespace

TORCH_LIBRARY(compress_cuda, m) {
  m.def("w4a16_gemm(Tensor x, Tensor wq, Tensor scales, Tensor? zeros, Tensor(a!) out, Tensor(b!)? workspace, "
        "int group_size, int splits, int stream) -> int",
        &w4a16_gemm);
  m.def("w4a16_v2_gemm(Tensor x, Tensor wq, Tensor scales, Tensor? zeros, Tensor(a!) out, Tensor(b!)? workspace, "
        "Tensor(c!)? tickets, int group_size, int splits, int pdl, int stream) -> int",
        &w4a16_v2_gemm);
  m.def("w4a16_v2_supported(int M, int N, int K, int group_size, int splits, int dtype, int sm) -> int",
        &w4a16_v2_supported);
  m.def("fp8_gemm(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, Tensor(a!) out, int stream) -> int", &fp8_gemm);
  m.def("fp8_quantize_rows(Tensor x, Tensor(a!) q, Tensor(b!) scale, int stream) -> int", &fp8_quantize_rows);
  m.def("w4a16_supported(int M, int N, int K, int group_size, int dtype, int sm) -> int", &w4a16_supported);
  m.def("fp8_supported(int M, int N, int K, int sm) -> int", &fp8_supported);
  // ---- begin: W4A16 dequantization (dequant.cu; issue 44 item 3) ----
  m.def("w4a16_dequant(Tensor wq, Tensor scales, Tensor? zeros, Tensor(a!) out, int group_size, int stream) -> int",
        &w4a16_dequant);
  m.def("w4a16_dequant_supported(int N, int K, int group_size, int dtype, int sm) -> int", &w4a16_dequant_supported);
  // ---- end: W4A16 dequantization ----
}
