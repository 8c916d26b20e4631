// raylora's CPU elementwise passes (elementwise_cpu.cpp), for layers_cpu.cpp's forward.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace raylora {

// out [T, I] = silu(gu[:, :I]) * gu[:, I:]; gu [T, 2 I] float32 with contiguous rows.
void silu_and_mul_into(const at::Tensor& gu, int64_t I, at::Tensor& out);
at::Tensor silu_and_mul(const at::Tensor& gu, int64_t I);

// x += delta (unless delta is null), then h = RMSNorm(x) * w, rows of n floats, contiguous.
void add_rms_norm(float* x, const float* delta, const float* w, float eps, float* h, int64_t T,
                  int64_t n);

// q_out [T, H, D] = rope(q part of qkv); the cache slot slots[t] of k_cache / v_cache
// ([S, Hkv, D]) gets rope(k) and v of token t. cos, sin [T, D].
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& q_out, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slots, int64_t H, int64_t Hkv, int64_t D);

// rope'd q [T, H, D] and k [T, Hkv, D] from the packed qkv [T, (H + 2 Hkv) D].
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t H, int64_t Hkv,
                                           int64_t D);

}  // namespace raylora
