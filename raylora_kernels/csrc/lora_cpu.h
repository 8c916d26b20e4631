// raylora's CPU LoRA kernel (lora_cpu.cpp), for layers_cpu.cpp's decoder layers.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace raylora {

// y = x @ W^T (+ bias) on a packed weight plus each token's LoRA: the segments [3, A] (slot,
// first row, rows) of the tokens grouped by slot, a [L, S R, K] and b_t [L, R, N] the slots'
// stacked weights, widths the S slices' columns, ranks [L, S] each slot's rows (or none).
at::Tensor linear_lora_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias, const at::Tensor& a,
                              const at::Tensor& b_t, const at::Tensor& segments,
                              at::IntArrayRef widths, const std::optional<at::Tensor>& ranks);

}  // namespace raylora
