// raylora's CPU LoRA kernel for decode-shaped batches: the shrink and the expand of one packed
// linear in one pass over each active adapter's weights, added into the base layer's output.
//
//   y[t, cols_s] += (x[t] @ a[slot]^T)[rows_s] @ b_t[slot][:, cols_s]   for each slice s
//
// for every token t of every active slot (tokens grouped by slot: slot i owns rows
// starts[i] .. starts[i] + counts[i] of x and y). Decode with many adapters is bound by reading
// the adapters' weights; this reads each weight once, with the slot's few
// tokens in registers, where torch's batched GEMM streams the expand's weights at about half
// the memory bandwidth (docs/benchmarks.md). The weights are float32 or bfloat16 (the engine's
// lora_dtype; bf16 halves the bytes read, widened to fp32 in registers, fp32 math); x and y are
// float32. linear_lora runs the base layer's GEMM first, in the same call. Built at run time by
// kernels/cpu_kernel.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include "linear_cpu.h"
#include "lora_cpu.h"
#include "packed_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
typedef uint16_t h16 __attribute__((vector_size(32)));  // 16 bfloat16 bit patterns
typedef uint32_t u16 __attribute__((vector_size(64)));
inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
// bfloat16 is the top half of a float32: widen each to 32 bits and shift it up.
inline v16 load(const at::BFloat16* p) {
  h16 h;
  std::memcpy(&h, p, sizeof h);
  const u16 w = __builtin_convertvector(h, u16) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline float scalar(float w) { return w; }
inline float scalar(at::BFloat16 w) { return static_cast<float>(w); }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline float hsum(v16 v) { float s = 0; for (int k = 0; k < 16; ++k) s += v[k]; return s; }
constexpr int kTok = 4;  // tokens per pass over a weight row

// buf[t * SR + r] = dot(a_slot[r], x[t0 + t]) for the slot's n tokens and rows r of
// [r0, r1) (one slice's rows up to the adapter's rank).
template <typename W>
void shrink(const W* a_slot, int64_t SR, int64_t r0, int64_t r1, int64_t H, const float* x,
            int64_t x_stride, int64_t t0, int64_t n, float* buf) {
  for (int64_t tb = 0; tb < n; tb += kTok) {
    const int nt = static_cast<int>(std::min<int64_t>(kTok, n - tb));
    const float* xr[kTok];
    for (int t = 0; t < nt; ++t) xr[t] = x + (t0 + tb + t) * x_stride;
    for (int64_t r = r0; r < r1; ++r) {
      const W* row = a_slot + r * H;
      v16 acc[kTok] = {};
      float tail[kTok] = {};
      int64_t h = 0;
      for (; h + 16 <= H; h += 16) {
        const v16 w = load(row + h);
        for (int t = 0; t < nt; ++t) acc[t] += w * load(xr[t] + h);
      }
      for (; h < H; ++h)
        for (int t = 0; t < nt; ++t) tail[t] += scalar(row[h]) * xr[t][h];
      for (int t = 0; t < nt; ++t) buf[(tb + t) * SR + r] = hsum(acc[t]) + tail[t];
    }
  }
}

// y[t0 + t, offs[s]:offs[s+1]] += sum_{r < rk[s]} buf[t * SR + s * R + r] * bt_slot[r, offs[s]:offs[s+1]]
// Column block by column block: each token's 16 outputs stay in a register while the R rows'
// weights for that block stream in (R short interleaved streams through the slot's [R, H_out]
// block), so y is loaded and stored once per block instead of once per rank row. The sum runs
// over r in order, as a row-by-row axpy would.
template <typename W>
void expand_add(const W* bt_slot, const int64_t* rk, int64_t H_out,
                const std::vector<int64_t>& offs, const float* buf, int64_t SR, int64_t R,
                float* y, int64_t y_stride, int64_t t0, int64_t n) {
  const int64_t S = static_cast<int64_t>(offs.size()) - 1;
  for (int64_t tb = 0; tb < n; tb += kTok) {
    const int nt = static_cast<int>(std::min<int64_t>(kTok, n - tb));
    float* yr[kTok];
    for (int t = 0; t < nt; ++t) yr[t] = y + (t0 + tb + t) * y_stride;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t rs = rk[s];
      if (rs == 0) continue;
      const float* cf[kTok];
      for (int t = 0; t < nt; ++t) cf[t] = buf + (tb + t) * SR + s * R;
      int64_t c = offs[s];
      for (; c + 16 <= offs[s + 1]; c += 16) {
        v16 acc[kTok];
        for (int t = 0; t < nt; ++t) acc[t] = load(yr[t] + c);
        for (int64_t r = 0; r < rs; ++r) {
          const v16 w = load(bt_slot + r * H_out + c);
          for (int t = 0; t < nt; ++t) acc[t] += cf[t][r] * w;
        }
        for (int t = 0; t < nt; ++t) store(yr[t] + c, acc[t]);
      }
      for (; c < offs[s + 1]; ++c)
        for (int t = 0; t < nt; ++t) {
          float v = yr[t][c];
          for (int64_t r = 0; r < rs; ++r) v += cf[t][r] * scalar(bt_slot[r * H_out + c]);
          yr[t][c] = v;
        }
    }
  }
}

// One call's operands, checked (lora_add's contract) before any thread starts.
// ranks: [L, S], the rows of each slot's slices that hold weights (an adapter's rank, 0 for
// a slice it does not target; the rows past it are zero), or null for all R rows. Rows past a
// slice's rank are neither read nor added: a rank-8 adapter on q and v only, in slots sized
// for rank 16 on seven modules, reads a tenth of the bytes.
struct LoRACall {
  const float* x;
  int64_t x_stride;
  const void* a;
  const void* b_t;
  bool bf16;
  const int64_t *slot, *start, *count, *ranks;
  int64_t A, SR, H, R, H_out;
  std::vector<int64_t> offs, full_ranks;
  float* y;
  int64_t y_stride;
};

LoRACall check(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
               const at::Tensor& segments, at::IntArrayRef widths,
               const std::optional<at::Tensor>& ranks, at::Tensor& y) {
  TORCH_CHECK(x.dtype() == at::kFloat && y.dtype() == at::kFloat,
              "raylora_cpu.lora_add: x and y must be float32");
  TORCH_CHECK(a.dtype() == b_t.dtype() && (a.dtype() == at::kFloat || a.dtype() == at::kBFloat16),
              "raylora_cpu.lora_add: a and b_t must both be float32 or both bfloat16");
  TORCH_CHECK(x.device().is_cpu() && a.device().is_cpu() && b_t.device().is_cpu() &&
                  y.device().is_cpu() && segments.device().is_cpu(),
              "raylora_cpu.lora_add: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1,
              "x and y must be [T, H] with contiguous rows");
  TORCH_CHECK(a.dim() == 3 && b_t.dim() == 3 && a.is_contiguous() && b_t.is_contiguous(),
              "a [L, S*R, H_in] and b_t [L, R, H_out] must be contiguous");
  TORCH_CHECK(segments.dtype() == at::kLong && segments.dim() == 2 && segments.size(0) == 3 &&
                  segments.is_contiguous(),
              "segments must be int64 [3, A]: slot, first row, row count");
  LoRACall c;
  const int64_t L = a.size(0), S = static_cast<int64_t>(widths.size());
  c.SR = a.size(1), c.H = a.size(2), c.R = b_t.size(1), c.H_out = b_t.size(2);
  TORCH_CHECK(b_t.size(0) == L && S >= 1 && c.SR == S * c.R && x.size(1) == c.H &&
                  y.size(1) == c.H_out,
              "shapes do not match: x ", x.sizes(), " a ", a.sizes(), " b_t ", b_t.sizes(),
              " y ", y.sizes(), " slices ", S);
  c.offs.assign(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) c.offs[s + 1] = c.offs[s] + widths[s];
  TORCH_CHECK(c.offs[S] == c.H_out, "slice widths must sum to H_out");
  c.A = segments.size(1);
  c.slot = segments.data_ptr<int64_t>();
  c.start = c.slot + c.A;
  c.count = c.start + c.A;
  for (int64_t i = 0; i < c.A; ++i)
    TORCH_CHECK(c.slot[i] >= 0 && c.slot[i] < L && c.start[i] >= 0 && c.count[i] >= 0 &&
                    c.start[i] + c.count[i] <= std::min(x.size(0), y.size(0)),
                "segment ", i, " out of range");
  c.ranks = nullptr;
  if (ranks.has_value()) {
    const at::Tensor& rt = *ranks;
    TORCH_CHECK(rt.dtype() == at::kLong && rt.device().is_cpu() && rt.is_contiguous() &&
                    rt.dim() == 2 && rt.size(0) == L && rt.size(1) == S,
                "ranks must be a contiguous int64 CPU tensor [L=", L, ", S=", S, "], got ",
                rt.sizes());
    c.ranks = rt.data_ptr<int64_t>();
    for (int64_t i = 0; i < L * S; ++i)
      TORCH_CHECK(c.ranks[i] >= 0 && c.ranks[i] <= c.R, "ranks must lie in [0, ", c.R,
                  "], got ", c.ranks[i]);
  }
  c.full_ranks.assign(S, c.R);
  c.x = x.data_ptr<float>(), c.x_stride = x.stride(0);
  c.bf16 = a.dtype() == at::kBFloat16;
  c.a = a.data_ptr(), c.b_t = b_t.data_ptr();
  c.y = y.data_ptr<float>(), c.y_stride = y.stride(0);
  return c;
}

// The active slots [begin, end) of a checked call: for each, its A rows, then its B^T block,
// each weight read once.
template <typename W>
void run_slots(const LoRACall& c, int64_t begin, int64_t end) {
  const W* ap = static_cast<const W*>(c.a);
  const W* bp = static_cast<const W*>(c.b_t);
  const int64_t S = static_cast<int64_t>(c.offs.size()) - 1;
  std::vector<float> buf;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t* rk = c.ranks != nullptr ? c.ranks + c.slot[i] * S : c.full_ranks.data();
    if (c.count[i] == 0 || std::all_of(rk, rk + S, [](int64_t r) { return r == 0; })) continue;
    buf.assign(c.count[i] * c.SR, 0.f);
    for (int64_t s = 0; s < S; ++s)
      shrink(ap + c.slot[i] * c.SR * c.H, c.SR, s * c.R, s * c.R + rk[s], c.H, c.x, c.x_stride,
             c.start[i], c.count[i], buf.data());
    expand_add(bp + c.slot[i] * c.R * c.H_out, rk, c.H_out, c.offs, buf.data(), c.SR, c.R, c.y,
               c.y_stride, c.start[i], c.count[i]);
  }
}

void run_slots(const LoRACall& c, int64_t begin, int64_t end) {
  if (c.bf16)
    run_slots<at::BFloat16>(c, begin, end);
  else
    run_slots<float>(c, begin, end);
}

void lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b_t,
              const at::Tensor& segments, at::IntArrayRef widths,
              const std::optional<at::Tensor>& ranks, at::Tensor& y) {
  const LoRACall c = check(x, a, b_t, segments, widths, ranks, y);
  at::parallel_for(0, c.A, 1, [&](int64_t begin, int64_t end) { run_slots(c, begin, end); });
}

// One OpenMP region: each thread its share of the base GEMM (gemm(tid, num_threads)), a
// barrier, then its share of the slots (about 2 ms a step less than two regions, measured in
// the model; docs/benchmarks.md).
template <typename Gemm>
void gemm_then_slots(const LoRACall& c, Gemm gemm) {
  const int nt = omp_in_parallel() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    gemm(tid, n);
#pragma omp barrier
    const auto [begin, end] = raylora::thread_share(c.A, tid, n);  // as parallel_for splits
    run_slots(c, begin, end);
  }
}

// The base layer and its LoRA in one call. One call from Python per LoRA linear instead of
// two: in a decode step a call's fixed cost (Python, the dispatcher, caches cold after the
// GEMM) is tens of microseconds, and a step has 120 of them (docs/benchmarks.md). Where the
// decode GEMM splits (linear_cpu.cpp), both run in one region (gemm_then_slots); else
// at::linear, then lora_add.
at::Tensor linear_lora(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, const at::Tensor& a,
                       const at::Tensor& b_t, const at::Tensor& segments, at::IntArrayRef widths,
                       const std::optional<at::Tensor>& ranks) {
  if (!raylora::linear_splits(x, weight, bias)) {
    at::Tensor y = at::linear(x, weight, bias);
    lora_add(x, a, b_t, segments, widths, ranks, y);
    return y;
  }
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  const LoRACall c = check(x, a, b_t, segments, widths, ranks, y);
  const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  gemm_then_slots(c, [&](int tid, int n) {
    const auto [n0, n1] = raylora::column_share(weight.size(0), tid, n);
    raylora::linear_columns(x, weight, b, y, n0, n1);
  });
  return y;
}

}  // namespace

namespace raylora {

// linear_lora on a packed weight (packed_cpu.cpp: the model's linears once loaded on the CPU).
at::Tensor linear_lora_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                              const std::optional<at::Tensor>& bias, const at::Tensor& a,
                              const at::Tensor& b_t, const at::Tensor& segments,
                              at::IntArrayRef widths, const std::optional<at::Tensor>& ranks) {
  const float* b = raylora::check_packed(x, packed, N, bias);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  const LoRACall c = check(x, a, b_t, segments, widths, ranks, y);
  gemm_then_slots(c, [&](int tid, int n) {
    const auto [p0, p1] = raylora::thread_share(packed.size(0), tid, n);
    raylora::packed_panels(x, packed, b, y, p0, p1);
  });
  return y;
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def("lora_add(Tensor x, Tensor a, Tensor b_t, Tensor segments, int[] widths, Tensor? ranks, "
        "Tensor(a!) y) -> ()");
  m.def("linear_lora(Tensor x, Tensor weight, Tensor? bias, Tensor a, Tensor b_t, Tensor segments, "
        "int[] widths, Tensor? ranks) -> Tensor");
  m.def("linear_lora_packed(Tensor x, Tensor packed, int N, Tensor? bias, Tensor a, Tensor b_t, "
        "Tensor segments, int[] widths, Tensor? ranks) -> Tensor");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("lora_add", &lora_add);
  m.impl("linear_lora", &linear_lora);
  m.impl("linear_lora_packed", &raylora::linear_lora_packed);
}
