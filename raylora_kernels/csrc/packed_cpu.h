// raylora's packed-weight CPU GEMM (packed_cpu.cpp), for lora_cpu.cpp's linear_lora_packed and
// layers_cpu.cpp's decoder layers.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace raylora {

constexpr int64_t kPanel = 48;  // output columns per panel: three AVX-512 registers

// Checks linear_packed's operands (x [T, K] float32 rows contiguous; packed [P, K, kPanel]
// float32 contiguous with (P - 1) * kPanel < N <= P * kPanel; bias float32 [N] or none) and
// returns the bias pointer (null for none).
const float* check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                          const std::optional<at::Tensor>& bias);

// y[:, panels p0..p1) = x @ W^T (+ bias) for a checked call; y [T, N] float32, rows contiguous.
void packed_panels(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                   at::Tensor& y, int64_t p0, int64_t p1);

// y = x @ W^T (+ bias) for a checked call, into y [T, N] (rows contiguous), the panels split
// between the threads.
void linear_packed_into(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                        at::Tensor& y);

// y = x @ W^T (+ bias) on a packed weight, the panels split between the threads.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias);

// Whether linear_packed_silu_into takes this gate_up weight: 2 I columns, I a whole number
// of panels (the up half starts on a panel).
bool silu_fusable(const at::Tensor& packed, int64_t I);

// act [T, I] = silu(x @ W[:I]^T) * (x @ W[I:]^T) for a gate_up weight packed whole
// (silu_fusable), x [T, K] checked as for linear_packed: gate_up and silu-and-mul in one pass,
// the same bits as linear_packed_into then silu_and_mul_into.
void linear_packed_silu_into(const at::Tensor& x, const at::Tensor& packed, int64_t I,
                             at::Tensor& act);

// out[0..kPanel) = one row x [K] times one panel [K, kPanel]: the same sums, in the same order,
// as every tile of packed_panels (so the same bits as linear_packed's for that row).
void packed_panel_row(const float* x, int64_t K, const float* panel, float* out);

// Thread tid's contiguous share [begin, end) of count items (panels, LoRA slots).
std::pair<int64_t, int64_t> thread_share(int64_t count, int tid, int num_threads);

}  // namespace raylora
