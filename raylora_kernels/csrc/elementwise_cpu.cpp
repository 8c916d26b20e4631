// raylora's CPU elementwise passes of a decoder layer, float32: silu-and-mul, the residual add
// fused with RMSNorm, rope fused with the KV cache write (layers_cpu.cpp's forward), and rope
// of q and k for the Python layers (prefill and LoRA batches off the fused path). Each is one
// pass over its rows, vectorised in 16 lanes (simd_cpu.h), where torch makes 2-8 passes and as
// many temporaries. Built with lora_cpu.cpp by kernels/cpu_kernel.py.
#include "elementwise_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "simd_cpu.h"

namespace raylora {

namespace {

// Rows per thread of the elementwise loops: at decode's few rows a parallel region costs more
// than the loop (measured: add_rms_norm took ~130 us a call at 64 x 576 split in four), so
// they split only past 2^18 elements.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (1 << 18) / row_elems); }

// out = silu(gu[:, :I]) * gu[:, I:] (F.silu(gate) * up), rows of gu contiguous, any T;
// out [T, I] contiguous.
}  // namespace

void silu_and_mul_into(const at::Tensor& gu, int64_t I, at::Tensor& out) {
  const int64_t T = gu.size(0), ld = gu.stride(0), vec = I - I % 16;
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* gate = g + t * ld;
      const float* up = gate + I;
      float* y = o + t * I;
      for (int64_t i = 0; i < vec; i += 16)
        simd::store(y + i, simd::vsilu(simd::load(gate + i)) * simd::load(up + i));
      for (int64_t i = vec; i < I; ++i) y[i] = (gate[i] / (1.f + std::exp(-gate[i]))) * up[i];
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& gu, int64_t I) {
  TORCH_CHECK(gu.dtype() == at::kFloat && gu.dim() == 2 && gu.size(1) == 2 * I &&
                  gu.stride(1) == 1,
              "silu_and_mul: float32 [T, 2 * I] with contiguous rows");
  at::Tensor out = at::empty({gu.size(0), I}, gu.options());
  silu_and_mul_into(gu, I, out);
  return out;
}

// x += delta (unless delta is null), then h = RMSNorm(x) * w, row by row: torch's
// x * rsqrt(mean(x^2) + eps) * w with the squares summed in 16 lanes. x, delta, h [T, n]
// contiguous.
void add_rms_norm(float* x, const float* delta, const float* w, float eps, float* h, int64_t T,
                  int64_t n) {
  const int64_t vec = n - n % 16;
  at::parallel_for(0, T, grain(n), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* xr = x + t * n;
      simd::v16 acc{};
      float tail = 0.f;
      if (delta != nullptr) {
        const float* dr = delta + t * n;
        for (int64_t i = 0; i < vec; i += 16) {
          const simd::v16 v = simd::load(xr + i) + simd::load(dr + i);
          simd::store(xr + i, v);
          acc += v * v;
        }
        for (int64_t i = vec; i < n; ++i) xr[i] += dr[i], tail += xr[i] * xr[i];
      } else {
        for (int64_t i = 0; i < vec; i += 16) {
          const simd::v16 v = simd::load(xr + i);
          acc += v * v;
        }
        for (int64_t i = vec; i < n; ++i) tail += xr[i] * xr[i];
      }
      const float inv = 1.f / std::sqrt((simd::hsum(acc) + tail) / static_cast<float>(n) + eps);
      float* hr = h + t * n;
      for (int64_t i = 0; i < vec; i += 16)
        simd::store(hr + i, (simd::load(xr + i) * simd::splat(inv)) * simd::load(w + i));
      for (int64_t i = vec; i < n; ++i) hr[i] = (xr[i] * inv) * w[i];
    }
  });
}

// HF's rope (x * cos + rotate_half(x) * sin) of one head of D values.
static inline void rotate(const float* x, const float* ct, const float* st, float* y, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * ct[i] + (-x[i + half]) * st[i];
  for (int64_t i = half; i < D; ++i) y[i] = x[i] * ct[i] + x[i - half] * st[i];
}

// q_out[t] = rope(qkv[t, :H*D]); the cache slot of token t gets rope(k) and v.
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& q_out, at::Tensor& k_cache, at::Tensor& v_cache,
                    const at::Tensor& slots, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t T = qkv.size(0), width = qkv.size(1);
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  float* qo = q_out.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, T, grain(width), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = src + t * width;
      const float* ct = c + t * D;
      const float* st = s + t * D;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, ct, st, qo + (t * H + h) * D, D);
      float* kd = kc + sl[t] * Hkv * D;
      float* vd = vc + sl[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) rotate(row + (H + h) * D, ct, st, kd + h * D, D);
      std::copy(row + (H + Hkv) * D, row + (H + 2 * Hkv) * D, vd);
    }
  });
}

// The prefill (Python layers) form of rope_and_cache: rope'd q [T, H, D] and k [T, Hkv, D]
// from the packed qkv [T, (H + 2 Hkv) D] (rows contiguous), one pass, no temporaries.
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t H, int64_t Hkv,
                                           int64_t D) {
  TORCH_CHECK(qkv.dtype() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) >= (H + 2 * Hkv) * D,
              "rope_qk: float32 qkv [T, (H + 2 Hkv) D] with contiguous rows");
  const int64_t T = qkv.size(0), ld = qkv.stride(0);
  TORCH_CHECK(cos.dtype() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == T && cos.size(-1) == D && sin.sizes() == cos.sizes(),
              "rope_qk: contiguous float32 cos and sin [T, D]");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  at::Tensor k = at::empty({T, Hkv, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* qo = q.data_ptr<float>();
  float* ko = k.data_ptr<float>();
  at::parallel_for(0, T, grain(ld), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = src + t * ld;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c + t * D, s + t * D, qo + (t * H + h) * D, D);
      for (int64_t h = 0; h < Hkv; ++h)
        rotate(row + (H + h) * D, c + t * D, s + t * D, ko + (t * Hkv + h) * D, D);
    }
  });
  return {q, k};
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def("silu_and_mul(Tensor gate_up, int intermediate) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv, int D) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("silu_and_mul", &raylora::silu_and_mul);
  m.impl("rope_qk", &raylora::rope_qk);
}
