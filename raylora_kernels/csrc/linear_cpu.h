// raylora's CPU decode linear (linear_cpu.cpp), for lora_cpu.cpp's linear_lora.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

namespace raylora {

// y = x @ weight^T (+ bias): the column split where it applies, else at::linear.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias);

// Whether `linear` splits these operands (else it runs at::linear).
bool linear_splits(const at::Tensor& x, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias);

// y[:, n0:n1] = x @ weight[n0:n1]^T (+ bias[n0:n1]), one single-threaded sgemm; y [T, N] fp32.
void linear_columns(const at::Tensor& x, const at::Tensor& weight, const float* bias,
                    at::Tensor& y, int64_t n0, int64_t n1);

// Thread tid's columns [n0, n1) of N, in 16-float blocks.
std::pair<int64_t, int64_t> column_share(int64_t N, int tid, int num_threads);

}  // namespace raylora
