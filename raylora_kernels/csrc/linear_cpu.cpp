// raylora's CPU linear for decode-sized batches: y = x @ weight^T (+ bias), float32, the output
// columns split between the OpenMP threads, each running one single-threaded BLAS sgemm on its
// columns (a thread reads its half of the weight, once).
//
// At few rows (decode: one per sequence) torch's F.linear hands the whole product to MKL's
// own threading, which this CPU runs 1.04-1.95x slower than the column split on the layer
// shapes of SmolLM2-135M at 1-128 rows, and the gap is largest where decode lives (1.2-1.4x at
// 32 rows; docs/benchmarks.md). The sums are BLAS's, so the result is the same kernel's.
//
// Used where it can be: float32, rows contiguous, weight contiguous, at most kMaxRows rows, a
// BLAS sgemm_ linked into torch (MKL on x86 Linux wheels) and not already inside a parallel
// region; otherwise at::linear. Built with lora_cpu.cpp by kernels/cpu_kernel.py.
#include "linear_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

// Fortran BLAS, exported by libtorch_cpu where torch links MKL; weak, so a torch without it
// loads this library and takes the at::linear path.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace raylora {

namespace {
constexpr int64_t kMaxRows = 128;  // measured faster than F.linear up to here
}  // namespace

bool linear_splits(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias) {
  const bool bias_ok = !bias.has_value() || !bias->defined() ||
                       (bias->dtype() == at::kFloat && bias->is_contiguous() &&
                        bias->dim() == 1 && bias->size(0) == weight.size(0));
  return sgemm_ != nullptr && at::hasMKL() && !omp_in_parallel() && x.device().is_cpu() &&
         x.dim() == 2 && x.dtype() == at::kFloat && weight.dtype() == at::kFloat &&
         weight.dim() == 2 && weight.is_contiguous() && x.size(1) == weight.size(1) &&
         x.stride(1) == 1 && x.size(0) >= 1 && x.size(0) <= kMaxRows && bias_ok &&
         x.size(1) < (int64_t{1} << 31) && weight.size(0) < (int64_t{1} << 31);
}

void linear_columns(const at::Tensor& x, const at::Tensor& weight, const float* bias,
                    at::Tensor& y, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  const int64_t T = x.size(0), K = x.size(1), N = weight.size(0);
  float* yp = y.data_ptr<float>();
  if (bias != nullptr)
    for (int64_t t = 0; t < T; ++t) std::memcpy(yp + t * N + n0, bias + n0, (n1 - n0) * 4);
  // column-major view: y^T [N, T] = weight [N, K] (row-major, i.e. transposed) x^T [K, T]
  const int m = static_cast<int>(n1 - n0), n = static_cast<int>(T), k = static_cast<int>(K);
  const int lda = static_cast<int>(K), ldb = static_cast<int>(x.stride(0)),
            ldc = static_cast<int>(N);
  const float one = 1.f, beta = bias != nullptr ? 1.f : 0.f;
  sgemm_("T", "N", &m, &n, &k, &one, weight.data_ptr<float>() + n0 * K, &lda,
         x.data_ptr<float>(), &ldb, &beta, yp + n0, &ldc);
}

std::pair<int64_t, int64_t> column_share(int64_t N, int tid, int num_threads) {
  const int64_t per = ((N + num_threads - 1) / num_threads + 15) / 16 * 16;  // 16-float blocks
  const int64_t n0 = std::min<int64_t>(N, tid * per);
  return {n0, std::min<int64_t>(N, n0 + per)};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  if (!linear_splits(x, weight, bias)) return at::linear(x, weight, bias);
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  const int nt = at::get_num_threads();
#pragma omp parallel num_threads(nt)
  {
    const auto [n0, n1] = column_share(weight.size(0), omp_get_thread_num(), omp_get_num_threads());
    linear_columns(x, weight, b, y, n0, n1);
  }
  return y;
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) { m.impl("linear", &raylora::linear); }
