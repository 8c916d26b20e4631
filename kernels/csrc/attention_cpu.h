// raylora's CPU paged decode attention (attention_cpu.cpp), for decode_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

namespace raylora {

// out[rows] = softmax(q[rows] k^T * scale) v over each row's paged context (attention_cpu.cpp).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lens, int64_t block_size, double scale,
                            at::Tensor& out);

}  // namespace raylora
