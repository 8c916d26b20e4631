// raylora's CPU decode forward: every decoder layer of a Llama-family model, for a batch of
// decode tokens, in one call (float32, packed weights; LoRA through lora_cpu.cpp's kernel).
//
// A decode step at small batches is dispatch-bound in Python: about 40 torch ops and a dozen
// module calls per layer, ~25 ms of a 50 ms step of SmolLM2-135M at batch 1 here, against
// ~25 ms for reading the weights (benchmarks/step_times.py --profile). Here each layer is
// eight calls from C++ (rms_norm, four packed GEMMs, the decode attention, two fused loops),
// the same kernels the Python path runs: the outputs are engine/models/llama.py's forward's
// within float rounding (the rope and silu-and-mul loops here may fuse a multiply-add that
// torch rounds twice; tests compare the two paths and both against HF).
//
//   x        [T, hidden]           embeddings of the batch's tokens (not modified)
//   cos, sin [T, D]                rope of each token's position (HF's rotate_half layout)
//   weights  6 per layer           input_layernorm, qkv (packed), o (packed),
//                                  post_attention_layernorm, gate_up (packed), down (packed)
//   biases   1 per layer           the qkv bias (Qwen2) or None
//   k_caches, v_caches             [S, Hkv, D] per layer
//   slots    [T] int64             each token's cache slot
//   tables, lens                   attention_cpu.cpp's block tables and context lengths
//   dims     [H, Hkv, D, intermediate, block_size]
//   lora, lora_ranks, segments     none for a base batch; else a, b_t (8 per layer) and ranks
//                                  (4 per layer) of qkv, o, gate_up, down, and the segments
//                                  of the tokens grouped by slot (kernels/metadata.py)
// Returns the hidden states after the last layer (before the final norm), [T, hidden].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "lora_cpu.h"
#include "packed_cpu.h"
#include "simd_cpu.h"

namespace raylora {

namespace {

constexpr int kPerLayer = 6;

// silu(x) = x / (1 + e^-x), from e = e^-|x| (<= 1, vexp's range): x / (1 + e) for x >= 0,
// x e / (1 + e) below. Within a few ulp of torch's F.silu.
inline simd::v16 vsilu(simd::v16 x) {
  using namespace simd;
  const v16 zero = splat(0.f), one = splat(1.f);
  const v16 e = vexp(x < zero ? x : -x);
  return (x < zero ? x * e : x) / (one + e);
}

// silu(gu[:, :I]) * gu[:, I:] (F.silu(gate) * up), rows of gu contiguous, any T.
at::Tensor silu_and_mul(const at::Tensor& gu, int64_t I) {
  TORCH_CHECK(gu.dtype() == at::kFloat && gu.dim() == 2 && gu.size(1) == 2 * I &&
                  gu.stride(1) == 1,
              "silu_and_mul: float32 [T, 2 * I] with contiguous rows");
  const int64_t T = gu.size(0), ld = gu.stride(0), vec = I - I % 16;
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* gate = g + t * ld;
      const float* up = gate + I;
      float* y = o + t * I;
      for (int64_t i = 0; i < vec; i += 16)
        simd::store(y + i, vsilu(simd::load(gate + i)) * simd::load(up + i));
      for (int64_t i = vec; i < I; ++i) y[i] = (gate[i] / (1.f + std::exp(-gate[i]))) * up[i];
    }
  });
  return out;
}

// HF's rope (x * cos + rotate_half(x) * sin) of one head of D values.
inline void rotate(const float* x, const float* ct, const float* st, float* y, int64_t D) {
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
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
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
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = src + t * ld;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c + t * D, s + t * D, qo + (t * H + h) * D, D);
      for (int64_t h = 0; h < Hkv; ++h)
        rotate(row + (H + h) * D, c + t * D, s + t * D, ko + (t * Hkv + h) * D, D);
    }
  });
  return {q, k};
}

}  // namespace

at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                         at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                         const at::Tensor& tables, const at::Tensor& lens, at::IntArrayRef dims,
                         double eps, double scale, at::TensorList lora,
                         const c10::List<std::optional<at::Tensor>>& lora_ranks,
                         const std::optional<at::Tensor>& segments) {
  TORCH_CHECK(dims.size() == 5, "dims must be [H, Hkv, D, intermediate, block_size]");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], I = dims[3], bs = dims[4];
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * L &&
                  static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(biases.size()) == L,
              "decode_layers: ", kPerLayer, " weights, one bias, one K and V cache per layer");
  TORCH_CHECK(x_in.dtype() == at::kFloat && x_in.dim() == 2 && cos.dtype() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x_in.size(0) &&
                  cos.size(-1) == D && sin.sizes() == cos.sizes(),
              "decode_layers: float32 x [T, hidden], contiguous cos and sin [T, D]");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.is_contiguous() && slots.size(0) == x_in.size(0),
              "decode_layers: slots must be a contiguous int64 [T]");
  const int64_t T = x_in.size(0), hidden = x_in.size(1);
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].dim() == 3 && k_caches[l].is_contiguous() &&
                    v_caches[l].sizes() == k_caches[l].sizes() && v_caches[l].is_contiguous() &&
                    k_caches[l].size(1) == Hkv && k_caches[l].size(2) == D,
                "decode_layers: caches must be contiguous [S, Hkv, D]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < k_caches[0].size(0), "slot ", sl[t], " out of the cache");
  // LoRA (segments given): a and b_t of the four linears of every layer, qkv, o, gate_up,
  // down, and their ranks; each linear is then linear_lora_packed, the base GEMM and every
  // active slot's LoRA in one call, as the Python layers' CPU backend runs it.
  const bool with_lora = segments.has_value();
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora.size()) == 8 * L &&
                             static_cast<int64_t>(lora_ranks.size()) == 4 * L),
              "decode_layers: LoRA needs a and b_t of 4 linears per layer and their ranks");
  const std::vector<std::vector<int64_t>> widths = {
      {H * D, Hkv * D, Hkv * D}, {hidden}, {I, I}, {hidden}};
  auto linear = [&](const at::Tensor& in, const at::Tensor& w, int64_t l, int j, int64_t N,
                    const std::optional<at::Tensor>& b) {
    if (!with_lora) return linear_packed(in, w, N, b);
    const int64_t k = l * 4 + j;
    return linear_lora_packed(in, w, N, b, lora[2 * k], lora[2 * k + 1], *segments, widths[j],
                              lora_ranks.get(k));
  };
  const at::Tensor rows = at::arange(T, slots.options());
  at::Tensor x = x_in.contiguous().clone();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    at::Tensor h = at::rms_norm(x, {hidden}, w[0], eps);
    const std::optional<at::Tensor> bias = biases.get(l);
    at::Tensor qkv = linear(h, w[1], l, 0, (H + 2 * Hkv) * D, bias);
    at::Tensor q = at::empty({T, H, D}, x.options());
    rope_and_cache(qkv, cos, sin, q, kc, vc, slots, H, Hkv, D);
    at::Tensor o = at::empty({T, H, D}, x.options());
    paged_decode_attention(q, rows, kc, vc, tables, lens, bs, scale, o);
    x.add_(linear(o.view({T, H * D}), w[2], l, 1, hidden, std::nullopt));
    h = at::rms_norm(x, {hidden}, w[3], eps);
    at::Tensor act = silu_and_mul(linear(h, w[4], l, 2, 2 * I, std::nullopt), I);
    x.add_(linear(act, w[5], l, 3, hidden, std::nullopt));
  }
  return x;
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor tables, Tensor lens, "
      "int[] dims, float eps, float scale, Tensor[] lora, Tensor?[] lora_ranks, "
      "Tensor? segments) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up, int intermediate) -> Tensor");
  m.def("rope_qk(Tensor qkv, Tensor cos, Tensor sin, int H, int Hkv, int D) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("decode_layers", &raylora::decode_layers);
  m.impl("silu_and_mul", &raylora::silu_and_mul);
  m.impl("rope_qk", &raylora::rope_qk);
}
