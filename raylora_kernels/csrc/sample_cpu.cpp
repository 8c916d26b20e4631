// raylora's CPU greedy pick: the index of each row's largest logit, as torch.argmax(x, -1)
// returns it (the first of equal maxima; a row with a NaN gives its first NaN), float32.
//
//   x    [T, V]  logits, rows contiguous
//   out  [T]     int64
//
// torch's CPU argmax walks a row with a scalar index beside each compared value: about 3 ms
// for 48 rows of SmolLM2's 49,152-token vocabulary on one core here, a few percent of a
// decode step. This keeps 16 running maxima and their positions in two vectors (a strict >
// keeps the first position of a lane's maximum) and reduces them at the end of the row.
#include "simd_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

namespace raylora {

namespace {

using namespace simd;

int64_t row_argmax(const float* x, int64_t V) {
  const int64_t vec = V - V % 16;
  v16 best = splat(-std::numeric_limits<float>::infinity());
  v16 where = v16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16 pos = where, check{};
  for (int64_t i = 0; i < vec; i += 16) {
    const v16 v = load(x + i);
    const auto more = v > best;
    best = more ? v : best;
    where = more ? pos : where;
    check += v - v;  // stays 0 unless a NaN (or an infinity: a false alarm, checked below)
    pos += splat(16.f);
  }
  bool nan = hsum(check) != 0.f;
  float m = -std::numeric_limits<float>::infinity();
  int64_t arg = -1;
  for (int k = 0; k < 16 && vec > 0; ++k) {
    const int64_t j = static_cast<int64_t>(where[k]);
    if (best[k] > m || (best[k] == m && j < arg) || arg < 0) m = best[k], arg = j;
  }
  for (int64_t i = vec; i < V; ++i) {
    nan |= std::isnan(x[i]);
    if (x[i] > m || arg < 0) m = x[i], arg = i;
  }
  if (nan) {  // rare: torch.argmax counts NaN as the largest value, its first one wins
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  return arg;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(),
              "argmax_rows: float32 CPU [T, V] with contiguous rows");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (1 << 24),
              "argmax_rows: V must be positive and below 2^24 (positions are tracked as floats)");
  const int64_t T = x.size(0), V = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) op[t] = row_argmax(xp + t * ld, V);
  });
  return out;
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) { m.impl("argmax_rows", &raylora::argmax_rows); }
