// raylora's CPU paged attention: decode (attention_cpu.cpp) and prefill chunks
// (prefill_attention_cpu.cpp), for layers_cpu.cpp.
#pragma once

#include <ATen/ATen.h>

namespace raylora {

// The checks both attention kernels make: q, out [T, H, D] and the caches [S, Hkv, D], float32,
// contiguous, on the CPU, D agreeing. `op` names the caller in the messages.
void check_attention_operands(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& out);

// out[rows] = softmax(q[rows] k^T * scale) v over each row's paged context (attention_cpu.cpp).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lens, int64_t block_size, double scale,
                            at::Tensor& out);

// out[chunk rows] = causal softmax(q k^T * scale) v of each prefill chunk over its paged
// context (prefill_attention_cpu.cpp); chunks [C, 3] = (first row, tokens, first position).
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& chunks,
                             const at::Tensor& tables, int64_t block_size, double scale,
                             at::Tensor& out);

}  // namespace raylora
