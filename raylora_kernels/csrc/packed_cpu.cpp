// raylora's CPU GEMM on packed weights: y = x @ W^T (+ bias), float32, with W stored once, at
// model load, in panels of kPanel output columns: packed[p, k, j] = W[p * kPanel + j, k]
// (kernels/packed_weight.py packs it; the last panel is zero-padded).
//
// Each panel is read as one contiguous stream, kPanel floats per k, and multiplied into the
// outputs of kRows tokens held in 24 AVX-512 registers (a kRows x kPanel tile, broadcasting one
// x value per token and k). BLAS repacks the weight on every call, which at decode's few rows
// is most of the work: at SmolLM2-135M's shapes and 32 rows the 120 layer linears take about
// 35 ms here against 63 ms for the column-split sgemm (linear_cpu.cpp), the lm_head 9.4
// against 20.3 ms (benchmarks/cpu_linear.py, docs/benchmarks.md). Every token's sum runs over k in order, whatever the batch, its place
// in it or the thread split: a token's output is the same bits in any batch.
//
// The panels are split between the OpenMP threads. Built with lora_cpu.cpp by
// kernels/cpu_kernel.py.
#include "packed_cpu.h"
#include "simd_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace raylora {

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
constexpr int kRows = 8;  // tokens per tile: 8 x 3 accumulators + 3 weight registers
// Panels whose tiles share an x tile (packed_panels): about a quarter of L2, so that the
// group being computed and the next one, prefetched meanwhile, both stay in it.
constexpr int64_t kGroupBytes = 256 * 1024;
constexpr int64_t kAhead = 24;  // k steps a full tile prefetches its own panel ahead
constexpr int64_t kLine = 64;   // bytes per cache line (the prefetches' unit)

// y[t, n0 + j] = sum_k x[t, k] * panel[k, j] (+ bias[n0 + j]) for t < M, j < ncols.
// Meanwhile it prefetches pf_lines cache lines from pf into L2, spread over its blocks of kB
// k steps (packed_panels: the next group's weights), and a full tile its own panel kAhead k
// steps ahead into L1. Why: at decode the weights stream from DRAM, and the hardware
// prefetcher alone leaves the tile waiting on them; measured with 30 layers' weights (424 MB)
// here, the linears of 16 rows took 29 -> 23 ms, 32 rows 44 -> 40 ms, 8 rows -10%. Tiles of
// fewer rows (measured at 1 and 4, memory-bound) were slower with their own prefetch: the
// hardware's suffices there. The schedule is checked once a block, not every k step: the
// per-step check cost 4-8% of prefill's GEMM (2,048 x 960 x 576: 190 -> 200 GFLOP/s).
// With gate (the fused gate_up: this is an up panel, gate [M, kPanel] the same rows' gate
// panel's outputs, no bias, ncols = kPanel), y[t, n0 + j] = silu(gate[t, j]) * the sum:
// silu-and-mul's bits (the same simd::vsilu), without writing gate_up out and reading it back.
template <int M>
void tile(const float* x, int64_t x_stride, int64_t K, const float* panel, const float* bias,
          float* y, int64_t y_stride, int64_t n0, int64_t ncols, const float* gate,
          const char* pf, int64_t pf_lines) {
  v16 acc[M][3] = {};
  constexpr int64_t kB = 8;  // k steps per block: the prefetch schedule is checked once a block
  const int64_t blocks = (K + kB - 1) / kB, per_b = (pf_lines + blocks - 1) / blocks;
  for (int64_t k0 = 0, b = 0; k0 < K; k0 += kB, ++b) {
    for (int64_t i = b * per_b, i1 = std::min(pf_lines, (b + 1) * per_b); i < i1; ++i)
      __builtin_prefetch(pf + i * kLine, 0, 2);
    const int64_t k1 = std::min(K, k0 + kB);
    for (int64_t k = k0; k < k1; ++k) {
      const float* w = panel + k * kPanel;
      if constexpr (M == kRows) {  // a panel row is 48 floats: three cache lines
        __builtin_prefetch(w + kAhead * kPanel, 0, 3);
        __builtin_prefetch(w + kAhead * kPanel + 16, 0, 3);
        __builtin_prefetch(w + kAhead * kPanel + 32, 0, 3);
      }
      const v16 w0 = load(w), w1 = load(w + 16), w2 = load(w + 32);
      for (int t = 0; t < M; ++t) {
        const float s = x[t * x_stride + k];
        acc[t][0] += s * w0;
        acc[t][1] += s * w1;
        acc[t][2] += s * w2;
      }
    }
  }
  if (gate != nullptr) {
    for (int t = 0; t < M; ++t)
      for (int v = 0; v < 3; ++v)
        store(y + t * y_stride + n0 + v * 16,
              simd::vsilu(load(gate + t * kPanel + v * 16)) * acc[t][v]);
    return;
  }
  float out[kPanel];
  for (int t = 0; t < M; ++t) {
    store(out, acc[t][0]);
    store(out + 16, acc[t][1]);
    store(out + 32, acc[t][2]);
    if (bias != nullptr)
      for (int64_t j = 0; j < ncols; ++j) out[j] += bias[n0 + j];
    std::memcpy(y + t * y_stride + n0, out, ncols * sizeof(float));
  }
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*,
                        int64_t, int64_t, int64_t, const float*, const char*, int64_t);
constexpr TileFn kTiles[kRows + 1] = {nullptr,  &tile<1>, &tile<2>, &tile<3>, &tile<4>,
                                      &tile<5>, &tile<6>, &tile<7>, &tile<8>};

}  // namespace

const float* check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                          const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dtype() == at::kFloat && packed.dtype() == at::kFloat && x.device().is_cpu() &&
                  packed.device().is_cpu(),
              "raylora_cpu.linear_packed: float32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, K] with contiguous rows, got ",
              x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed must be a contiguous [P, K, ", kPanel, "] tensor, got ", packed.sizes());
  TORCH_CHECK(x.size(1) == packed.size(1), "x has ", x.size(1), " features, the weight ",
              packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel, "N=", N,
              " does not fit ", packed.size(0), " panels of ", kPanel);
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->dtype() == at::kFloat && bias->device().is_cpu() && bias->dim() == 1 &&
                  bias->size(0) == N && bias->is_contiguous(),
              "bias must be a contiguous float32 [", N, "] tensor, got ", bias->sizes());
  return bias->data_ptr<float>();
}

namespace {

// y = x @ W^T over panels [p0, p1) (up_off 0), or, fused, act[:, panel p] = silu(x @ gate
// panel p) * (x @ up panel p + up_off) for gate panels p in [p0, p1) (y is then act [T, N]).
// A few panels at a time (kGroupBytes), each tile of x rows going through all of them while
// it is in L1: x (2,048 x 576 floats = 4.7 MB at prefill) is then read from L3 once per group
// of panels, not once per panel. With two tiles of rows or more, the tiles after the first
// (which reads the group from memory) prefetch the next group of this thread's panels between
// them: its first tile then finds it in L2, and the weights' DRAM stream overlaps the
// arithmetic.
void walk_panels(const float* xp, int64_t xs, int64_t T, int64_t K, const float* wp,
                 const float* bias, float* yp, int64_t N, int64_t p0, int64_t p1,
                 int64_t up_off) {
  const int64_t panel = K * kPanel, per = up_off > 0 ? 2 : 1;  // panels a step computes
  const int64_t group =
      std::max<int64_t>(1, kGroupBytes / (per * panel * int64_t{sizeof(float)}));
  const int64_t ntiles = (T + kRows - 1) / kRows;
  float gate[kRows * kPanel];  // the fused form's gate tile
  for (int64_t g0 = p0; g0 < p1; g0 += group) {
    const int64_t g1 = std::min(p1, g0 + group), next_end = std::min(p1, g1 + group);
    const char* next = reinterpret_cast<const char*>(wp + g1 * panel);
    const char* next_up = reinterpret_cast<const char*>(wp + (g1 + up_off) * panel);
    const int64_t lines =
        ntiles > 1 ? (next_end - g1) * panel * int64_t{sizeof(float)} / kLine : 0;
    const int64_t calls = (ntiles - 1) * (g1 - g0);  // the tiles that share them out
    int64_t call = 0;
    for (int64_t t0 = 0; t0 < T; t0 += kRows) {
      const TileFn fn = kTiles[std::min<int64_t>(kRows, T - t0)];
      const float* xt = xp + t0 * xs;
      for (int64_t p = g0; p < g1; ++p) {
        const int64_t n0 = p * kPanel, ncols = std::min<int64_t>(kPanel, N - n0);
        int64_t b = 0, e = 0;
        if (t0 > 0 && lines > 0) b = lines * call / calls, e = lines * (call + 1) / calls, ++call;
        if (up_off == 0) {
          fn(xt, xs, K, wp + p * panel, bias, yp + t0 * N, N, n0, ncols, nullptr,
             next + b * kLine, e - b);
        } else {
          fn(xt, xs, K, wp + p * panel, nullptr, gate, kPanel, 0, kPanel, nullptr,
             next + b * kLine, e - b);
          fn(xt, xs, K, wp + (p + up_off) * panel, nullptr, yp + t0 * N, N, n0, kPanel, gate,
             next_up + b * kLine, e - b);
        }
      }
    }
  }
}

// walk_panels over P panels (the gate panels, fused), split between the OpenMP threads;
// y [T, N] with contiguous rows
void walk_threads(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                  at::Tensor& y, int64_t P, int64_t up_off) {
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int nt = omp_in_parallel() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(nt)
  {
    const auto [p0, p1] = thread_share(P, omp_get_thread_num(), omp_get_num_threads());
    walk_panels(xp, x.stride(0), x.size(0), x.size(1), wp, bias, yp, y.size(1), p0, p1, up_off);
  }
}

}  // namespace

void packed_panels(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                   at::Tensor& y, int64_t p0, int64_t p1) {
  walk_panels(x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1), packed.data_ptr<float>(),
              bias, y.data_ptr<float>(), y.size(1), p0, p1, 0);
}

bool silu_fusable(const at::Tensor& packed, int64_t I) {
  return packed.dim() == 3 && I % kPanel == 0 && packed.size(0) * kPanel == 2 * I;
}

void linear_packed_silu_into(const at::Tensor& x, const at::Tensor& packed, int64_t I,
                             at::Tensor& act) {
  TORCH_CHECK(silu_fusable(packed, I) && act.size(1) == I && act.is_contiguous() &&
                  act.size(0) == x.size(0),
              "linear_packed_silu: gate_up of 2 x ", I, " columns in whole panels into [T, ", I,
              "]");
  walk_threads(x, packed, nullptr, act, I / kPanel, I / kPanel);
}

void packed_panel_row(const float* x, int64_t K, const float* panel, float* out) {
  tile<1>(x, K, K, panel, nullptr, out, kPanel, 0, kPanel, nullptr, nullptr, 0);
}

std::pair<int64_t, int64_t> thread_share(int64_t count, int tid, int num_threads) {
  const int64_t per = (count + num_threads - 1) / num_threads;
  const int64_t begin = std::min<int64_t>(count, tid * per);
  return {begin, std::min<int64_t>(count, begin + per)};
}

void linear_packed_into(const at::Tensor& x, const at::Tensor& packed, const float* bias,
                        at::Tensor& y) {
  walk_threads(x, packed, bias, y, packed.size(0), 0);
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias) {
  const float* b = check_packed(x, packed, N, bias);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  linear_packed_into(x, packed, b, y);
  return y;
}

at::Tensor linear_packed_silu(const at::Tensor& x, const at::Tensor& packed, int64_t I) {
  check_packed(x, packed, 2 * I, std::nullopt);
  at::Tensor act = at::empty({x.size(0), I}, x.options());
  linear_packed_silu_into(x, packed, I, act);
  return act;
}

// Whether this build has AVX-512 (-march=native on the machine that built it). The tile keeps
// 27 vectors of 16 floats live: 27 of AVX-512's 32 registers, but without AVX-512 each is two
// 256-bit halves and most would spill, so the engine packs only where this is true (measured
// only on AVX-512).
bool packed_native() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def("linear_packed(Tensor x, Tensor packed, int N, Tensor? bias) -> Tensor");
  m.def("linear_packed_silu(Tensor x, Tensor packed, int intermediate) -> Tensor");
  m.def("packed_native() -> bool");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("linear_packed", &raylora::linear_packed);
  m.impl("linear_packed_silu", &raylora::linear_packed_silu);
}
TORCH_LIBRARY_IMPL(raylora_cpu, CompositeExplicitAutograd, m) {
  m.impl("packed_native", &raylora::packed_native);
}
