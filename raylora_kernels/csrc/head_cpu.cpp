// raylora's greedy lm_head on the CPU: the ids torch.argmax(x @ W^T, -1) gives on the float32
// packed GEMM's logits, bit for bit, at about half its cost, from a bfloat16 screen.
//
//   x        [T, K]        float32 final hidden states, rows contiguous
//   packed   [P, K, 48]    float32: the lm_head in packed_cpu.cpp's panels (the exact logits)
//   packed16 [P, K/2, 48, 2] bfloat16: the same panels, column j's (k, k+1) pairs adjacent
//   wnorm    [P * 48]      float32: each column's L2 norm (an upper bound; padding 0)
//   out      [T]           int64
//
// 1. Screen: a[t, n] = x[t] . W[n] with both in bfloat16 (vdpbf16ps: 32 products a register,
//    2x the fp32 FMA rate, half the weight bytes). For finite x and W, the float32 logit the
//    packed GEMM computes, y[t, n], satisfies |a - y| <= eps = c * |x_t| * |W_n| + ab_t (ab_t:
//    subnormals, below; c: each bf16 rounding is within 2^-8 relative, the products are exact,
//    both sums in fp32 add gamma_2K; Cauchy-Schwarz bounds sum_k |x_k W_nk|). So n can be the
//    argmax only if
//    a + eps >= max_m (a_m - eps_m); the screen keeps, per row and panel, max(a + eps).
// 2. Exact: every panel of a row that can hold the argmax is recomputed by packed_cpu.cpp's
//    own tile (packed_panel_row: the same sums, the same bits as linear_packed), and the
//    first maximum among them is the answer: any column equal to the true maximum is in one.
// A row whose x is not finite, or so large that a logit could overflow, takes the exact
// logits of every panel and torch.argmax's rule (its first NaN, else its first maximum).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "packed_cpu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace raylora {

namespace {

constexpr int kRows = 8;  // rows per screen tile: 8 x 3 accumulators + 3 weight registers
constexpr int64_t kGroupBytes = 512 * 1024;  // panels whose tiles share an x tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// c of the bound above for a K-long dot product: (2u + u^2)(1 + g) + 2g, u = 2^-8 (bf16),
// g = gamma_2K = 2K * 2^-24 / (1 - 2K * 2^-24) (fp32 sums of the screen and of the GEMM),
// then 1% more for the roundings of eps and of a +- eps themselves.
double bound_c(int64_t K) {
  const double u = std::ldexp(1.0, -8), g0 = 2.0 * K * std::ldexp(1.0, -24);
  const double g = g0 / (1.0 - g0);
  return 1.01 * ((2 * u + u * u) * (1 + g) + 2 * g);
}

// float -> bfloat16 bits, round to nearest even (finite x: the rows screened are finite).
inline uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

#if defined(__AVX512BF16__)
// With eps = cx[t] * wnorm[p*48 + j] + ab[t]: umax[t, p] = max_j (a[t, p*48 + j] + eps) over
// the panel's real columns and lo[t] = max(lo[t], max_j (a - eps)), for M rows of bf16 pairs
// xp [M, K/2].
template <int M>
void screen_tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, const float* wn,
                 int64_t ncols, const float* cx, const float* ab, float* umax,
                 int64_t umax_stride, float* lo) {
  __m512 acc[M][3];
  for (int t = 0; t < M; ++t) acc[t][0] = acc[t][1] = acc[t][2] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    const uint16_t* w = panel + kk * 96;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    for (int t = 0; t < M; ++t) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[t * K2 + kk]));
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], s, w0);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], s, w1);
      acc[t][2] = _mm512_dpbf16_ps(acc[t][2], s, w2);
    }
  }
  if (ncols == kPanel) {  // every panel but a ragged last one
    const __m512 e0 = _mm512_loadu_ps(wn), e1 = _mm512_loadu_ps(wn + 16),
                 e2 = _mm512_loadu_ps(wn + 32);
    for (int t = 0; t < M; ++t) {
      const __m512 s = _mm512_set1_ps(cx[t]), b = _mm512_set1_ps(ab[t]);
      const __m512 d0 = _mm512_fmadd_ps(s, e0, b), d1 = _mm512_fmadd_ps(s, e1, b),
                   d2 = _mm512_fmadd_ps(s, e2, b);
      const __m512 up = _mm512_max_ps(_mm512_max_ps(_mm512_add_ps(acc[t][0], d0),
                                                    _mm512_add_ps(acc[t][1], d1)),
                                      _mm512_add_ps(acc[t][2], d2));
      const __m512 low = _mm512_max_ps(_mm512_max_ps(_mm512_sub_ps(acc[t][0], d0),
                                                     _mm512_sub_ps(acc[t][1], d1)),
                                       _mm512_sub_ps(acc[t][2], d2));
      umax[t * umax_stride] = _mm512_reduce_max_ps(up);
      lo[t] = std::max(lo[t], _mm512_reduce_max_ps(low));
    }
    return;
  }
  alignas(64) float a[kPanel];
  for (int t = 0; t < M; ++t) {
    _mm512_store_ps(a, acc[t][0]);
    _mm512_store_ps(a + 16, acc[t][1]);
    _mm512_store_ps(a + 32, acc[t][2]);
    float up = kNegInf, low = lo[t];
    for (int64_t j = 0; j < ncols; ++j) {
      const float e = cx[t] * wn[j] + ab[t];
      up = std::max(up, a[j] + e);
      low = std::max(low, a[j] - e);
    }
    umax[t * umax_stride] = up;
    lo[t] = low;
  }
}

using ScreenFn = void (*)(const uint32_t*, int64_t, const uint16_t*, const float*, int64_t,
                          const float*, const float*, float*, int64_t, float*);
constexpr ScreenFn kScreens[kRows + 1] = {
    nullptr,          &screen_tile<1>, &screen_tile<2>, &screen_tile<3>, &screen_tile<4>,
    &screen_tile<5>, &screen_tile<6>, &screen_tile<7>, &screen_tile<8>};
#endif

// torch.argmax's pick (its first NaN, else its first maximum) over the exact logits of the
// panels p with umax[p] >= lowest (every panel when umax is null: a row not screened).
int64_t exact_argmax(const float* x, int64_t K, const float* packed, int64_t P, int64_t N,
                     const float* umax, float lowest) {
  alignas(64) float y[kPanel];
  float best = kNegInf;
  int64_t arg = -1;
  for (int64_t p = 0; p < P; ++p) {
    if (umax != nullptr && umax[p] < lowest) continue;
    packed_panel_row(x, K, packed + p * K * kPanel, y);
    for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
      if (std::isnan(y[j])) return p * kPanel + j;
      if (y[j] > best || arg < 0) best = y[j], arg = p * kPanel + j;
    }
  }
  return arg;
}

}  // namespace

at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed16,
                       const at::Tensor& wnorm, int64_t N) {
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "raylora_cpu.greedy_head: this build has no AVX512-BF16");
#else
  check_packed(x, packed, N, std::nullopt);
  const int64_t T = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(K % 2 == 0, "greedy_head: K must be even, got ", K);
  TORCH_CHECK(packed16.scalar_type() == at::kBFloat16 && packed16.is_contiguous() &&
                  packed16.sizes() == at::IntArrayRef({P, K / 2, kPanel, 2}),
              "greedy_head: packed16 must be a contiguous bfloat16 [", P, ", ", K / 2, ", ",
              kPanel, ", 2] tensor, got ", packed16.sizes());
  TORCH_CHECK(wnorm.scalar_type() == at::kFloat && wnorm.is_contiguous() &&
                  wnorm.numel() == P * kPanel,
              "greedy_head: wnorm must be a contiguous float32 [", P * kPanel, "] tensor");
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  if (T == 0) return out;
  const float* xf = x.data_ptr<float>();
  const int64_t xs = x.stride(0), K2 = K / 2;
  const float* wf = packed.data_ptr<float>();
  const uint16_t* w16 = reinterpret_cast<const uint16_t*>(packed16.data_ptr());
  const float* wn = wnorm.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();

  // Per row: cx = c * |x| (a screened row), or -1 (the exact fallback); ab, an absolute
  // slack for what the relative bound leaves out: values below float's normal range, which
  // vdpbf16ps flushes to 0 (inputs and results), each off by at most 2^-126 times the
  // other factor: K * 2^-126 * (max |W_n| + |x| + 2), doubled; its bf16 pairs.
  const double c = bound_c(K);
  float wmax = 0.f;  // a NaN or infinite norm (weights not finite) screens no row
  for (int64_t n = 0; n < P * kPanel; ++n)
    wmax = std::isfinite(wn[n]) ? std::max(wmax, wn[n]) : std::numeric_limits<float>::infinity();
  std::vector<float> cx(T), ab(T);
  std::vector<uint32_t> xp(T * K2);
  for (int64_t t = 0; t < T; ++t) {
    const float* r = xf + t * xs;
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += double(r[k]) * r[k];
    const double norm = std::sqrt(ss);
    // finite, and no logit (|y| <= |x| |W_n|) or screen value near float's range
    const bool screened = std::isfinite(norm) && norm * wmax < 1e30;
    cx[t] = screened ? static_cast<float>(c * norm * (1 + 1e-6)) : -1.f;
    const double tiny = 2 * K * std::ldexp(1.0, -126) * (wmax + norm + 2);
    ab[t] = screened ? static_cast<float>(tiny) : 0.f;
    for (int64_t kk = 0; screened && kk < K2; ++kk)
      xp[t * K2 + kk] = uint32_t(to_bf16(r[2 * kk])) | (uint32_t(to_bf16(r[2 * kk + 1])) << 16);
  }

  // 1. The screen: panels split between the threads; lo per thread, merged after.
  const int nt = omp_in_parallel() ? 1 : at::get_num_threads();
  std::vector<float> umax(T * P, kNegInf), lo(static_cast<size_t>(nt) * T, kNegInf);
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (K * kPanel * 2));
#pragma omp parallel num_threads(nt)
  {
    const auto [p0, p1] = thread_share(P, omp_get_thread_num(), omp_get_num_threads());
    float* mylo = lo.data() + omp_get_thread_num() * T;
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
      const int64_t g1 = std::min(p1, g0 + group);
      for (int64_t t0 = 0; t0 < T; t0 += kRows)
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
          kScreens[std::min<int64_t>(kRows, T - t0)](
              xp.data() + t0 * K2, K2, w16 + p * K2 * kPanel * 2, wn + p * kPanel, ncols,
              cx.data() + t0, ab.data() + t0, umax.data() + t0 * P + p, P, mylo + t0);
        }
    }
  }

  // 2. Exact: per row, the panels whose best a + eps reaches the row's best a - eps.
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
  for (int64_t t = 0; t < T; ++t) {
    const float* r = xf + t * xs;
    if (cx[t] < 0) {
      op[t] = exact_argmax(r, K, wf, P, N, nullptr, kNegInf);
      continue;
    }
    float floor_ = kNegInf;
    for (int i = 0; i < nt; ++i) floor_ = std::max(floor_, lo[i * T + t]);
    op[t] = exact_argmax(r, K, wf, P, N, umax.data() + t * P, floor_);
  }
  return out;
#endif
}

// Whether this build has the bf16 screen (AVX512-BF16, -march=native where it was built).
bool greedy_head_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def("greedy_head(Tensor x, Tensor packed, Tensor packed16, Tensor wnorm, int N) -> Tensor");
  m.def("greedy_head_native() -> bool");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) { m.impl("greedy_head", &raylora::greedy_head); }
TORCH_LIBRARY_IMPL(raylora_cpu, CompositeExplicitAutograd, m) {
  m.impl("greedy_head_native", &raylora::greedy_head_native);
}
