// raylora's CPU paged attention for prefill chunks: each chunk's queries attend causally to
// their sequence's keys and values where they lie in the paged KV cache (the cached prefix and
// the chunk itself, written to the cache before this runs), float32, flash-attention style
// (no score matrix, no mask tensor, no gather).
//
//   q        [T, H, D]      the batch's queries (rope applied)
//   k_cache  [S, Hkv, D]    slot s = block * block_size + offset (engine/attention.py)
//   v_cache  [S, Hkv, D]
//   chunks   [C, 3] int64   each chunk's first row in q, its tokens, its first position
//   tables   [C, M] int32   each chunk's block table (covering position + tokens)
//   out      [T, H, D]      the chunks' rows are written
//
// Query position p of a chunk attends to positions 0..p. The work is split into items
// (chunk, KV head, block of query positions) whose rows are the block's positions times the
// G = H / Hkv query heads of that KV head: R rows, at most kRows. Everything in an item runs
// along those rows, 16 to a vector, so nothing is transposed per key and the softmax needs
// no horizontal sums:
//   Qt  [D, R]   the queries, scaled by scale x log2(e) (the softmax in base 2: vexp2),
//                transposed once per item
//   St  [Bk, R]  scores of a block of Bk keys: St[j] = sum_d K[j, d] * Qt[d] (K's elements
//                broadcast straight from the cache rows)
//   Ot  [D, R]   the output, rescaled by 2^(m_old - m_new) per row as the maximum moves,
//                Ot[d] += sum_j V[j, d] * Pt[j] (V's elements broadcast likewise)
// and the rows' maxima m and sums l as vectors. Keys past a row's position are masked
// (score -inf, weight 0). A row's output depends only on its own query and context: the
// same bits whatever else is in the batch or the item. Built with lora_cpu.cpp by
// kernels/cpu_kernel.py.
#include "attention_cpu.h"
#include "simd_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace raylora {

namespace {

using namespace simd;

constexpr int kMaxRowVecs = 6;              // rows of an item: at most 6 x 16 = 96
constexpr int kRows = 16 * kMaxRowVecs;
constexpr int kBk = 64;                     // keys per block (32 and 128: slower)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t H, Hkv, D, G, M, bs, S, row;  // row: floats per cache row (Hkv * D)
  float scale;
};

struct Item {
  int64_t chunk, head, q0, nq;  // query positions [q0, q0 + nq) of the chunk (0-based in it)
  int64_t cost;                 // rows x keys, to hand out the long items first
};

// one vbroadcastss (splat's 0 + x adds first); AVX-512 builds only (prefill_attention_supported)
inline v16 bcast(float x) {
#if defined(__AVX512F__)
  return (v16)_mm512_set1_ps(x);
#else
  return splat(x);
#endif
}

// 2^x (x <= 0; -inf and anything below -150 give 0): the scores are in base 2 (the queries
// carry log2(e)), so no range reduction by ln 2: round, a degree-6 polynomial of the
// remainder in [-0.5, 0.5] (Cephes' exp2f, within 2 ulp), and vscalefps for the 2^n, which
// also takes the huge negative n to 0. 10 operations against the 18 of vexp and its mask.
inline v16 vexp2(v16 x) {
#if defined(__AVX512F__)
  x = x > splat(-200.f) ? x : splat(-200.f);  // -inf: roundscale would give r = NaN
  __m512 xm;
  std::memcpy(&xm, &x, sizeof xm);
  const __m512 fn = _mm512_roundscale_ps(xm, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  v16 n;
  std::memcpy(&n, &fn, sizeof n);
  const v16 r = x - n;
  v16 p = splat(1.535336188319500e-4f);
  p = p * r + splat(1.339887440266574e-3f);
  p = p * r + splat(9.618437357674640e-3f);
  p = p * r + splat(5.550332471162809e-2f);
  p = p * r + splat(2.402264791363012e-1f);
  p = p * r + splat(6.931472028550421e-1f);
  p = p * r + splat(1.f);
  __m512 pm;
  std::memcpy(&pm, &p, sizeof pm);
  const __m512 y = _mm512_scalef_ps(pm, fn);
  v16 out;
  std::memcpy(&out, &y, sizeof out);
  return out;
#else
  const v16 e = vexp(x * splat(0.693147180559945309f));
  return x == splat(kNegInf) ? v16{} : e;
#endif
}

// St[j, :] = sum_d K[j, d] * Qt[d, :] for the first nk8 (a multiple of 8) keys of kp (rows of
// D floats, h's part):
// 8 keys against RV <= 3 row vectors at a time, so each d loads RV vectors for 8 x RV FMAs
// (AVX-512 loads, one a cycle on Zen 4, would otherwise bound it as much as the FMAs).
template <int RV>
void scores(const float* const* kp, const float* Qt, int64_t D, int nk8, float* St) {
  constexpr int KT = 8;
  for (int j0 = 0; j0 < nk8; j0 += KT) {
    v16 acc[KT][RV] = {};
    for (int64_t d = 0; d < D; ++d) {
      v16 qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = load(Qt + d * kRows + v * 16);
      for (int j = 0; j < KT; ++j) {
        const v16 k = bcast(kp[j0 + j][d]);
        for (int v = 0; v < RV; ++v) acc[j][v] += k * qv[v];
      }
    }
    for (int j = 0; j < KT; ++j)
      for (int v = 0; v < RV; ++v) store(St + (j0 + j) * kRows + v * 16, acc[j][v]);
  }
}

// Ot[d, :] = Ot[d, :] * alpha + sum_j V[j, d] * Pt[j, :] over nk keys, 8 rows of d against
// RV <= 3 row vectors at a time (D is a multiple of 8).
template <int RV>
void values(const float* const* vp, int nk, const float* Pt, const v16* alpha, int64_t D,
            float* Ot) {
  constexpr int DT = 8;
  for (int64_t d0 = 0; d0 < D; d0 += DT) {
    v16 acc[DT][RV];
    for (int d = 0; d < DT; ++d)
      for (int v = 0; v < RV; ++v) acc[d][v] = load(Ot + (d0 + d) * kRows + v * 16) * alpha[v];
    for (int j = 0; j < nk; ++j) {
      v16 pv[RV];
      for (int v = 0; v < RV; ++v) pv[v] = load(Pt + j * kRows + v * 16);
      for (int d = 0; d < DT; ++d) {
        const v16 x = bcast(vp[j][d0 + d]);
        for (int v = 0; v < RV; ++v) acc[d][v] += x * pv[v];
      }
    }
    for (int d = 0; d < DT; ++d)
      for (int v = 0; v < RV; ++v) store(Ot + (d0 + d) * kRows + v * 16, acc[d][v]);
  }
}

// The two products over RV row vectors, in groups of at most 3 (the register tiles above).
template <int RV>
void scores_all(const float* const* kp, const float* Qt, int64_t D, int nk8, float* St) {
  if constexpr (RV > 3) {
    scores<3>(kp, Qt, D, nk8, St);
    scores<RV - 3>(kp, Qt + 48, D, nk8, St + 48);
  } else {
    scores<RV>(kp, Qt, D, nk8, St);
  }
}

template <int RV>
void values_all(const float* const* vp, int nk, const float* Pt, const v16* alpha, int64_t D,
                float* Ot) {
  if constexpr (RV > 3) {
    values<3>(vp, nk, Pt, alpha, D, Ot);
    values<RV - 3>(vp, nk, Pt + 48, alpha + 3, D, Ot + 48);
  } else {
    values<RV>(vp, nk, Pt, alpha, D, Ot);
  }
}

// Scratch of one thread: Qt, Ot [D, kRows]; St [kBk, kRows]; a zero key row.
struct Scratch {
  float *qt, *ot, *st, *zero;
};

template <int RV>
void run_item(const Geometry& g, const Item& it, const int64_t* chunks, const int32_t* tables,
              const float* q, const float* kc, const float* vc, float* out, const Scratch& w) {
  const int64_t D = g.D, G = g.G, H = g.H;
  const int64_t row0 = chunks[it.chunk * 3], start = chunks[it.chunk * 3 + 2];
  const int32_t* table = tables + it.chunk * g.M;
  const int64_t R = it.nq * G;
  const float scale2 = g.scale * 1.44269504088896341f;  // scores in base 2: see vexp2
  // Qt[d, r] = q[row0 + q0 + i, h G + g, d] * scale for r = i G + g; padding rows 0
  for (int64_t d = 0; d < D; ++d)
    for (int64_t r = R; r < RV * 16; ++r) w.qt[d * kRows + r] = 0.f;
  for (int64_t i = 0; i < it.nq; ++i)
    for (int64_t gg = 0; gg < G; ++gg) {
      const float* src = q + ((row0 + it.q0 + i) * H + it.head * G + gg) * D;
      const int64_t r = i * G + gg;
      for (int64_t d = 0; d < D; ++d) w.qt[d * kRows + r] = src[d] * scale2;
    }
  for (int64_t d = 0; d < D; ++d)
    for (int v = 0; v < RV; ++v) store(w.ot + d * kRows + v * 16, v16{});
  // each row's position (padding rows: the last one, so they never see an empty context)
  v16 pos[RV], m[RV], l[RV];
  for (int v = 0; v < RV; ++v) {
    for (int k = 0; k < 16; ++k) {
      const int64_t r = std::min<int64_t>(v * 16 + k, R - 1);
      pos[v][k] = static_cast<float>(start + it.q0 + r / G);
    }
    m[v] = splat(kNegInf);
    l[v] = v16{};
  }
  const int64_t first_pos = start + it.q0, end = start + it.q0 + it.nq;  // keys [0, end)
  const float* kp[kBk];
  const float* vp[kBk];
  for (int64_t t0 = 0; t0 < end; t0 += kBk) {
    const int nk = static_cast<int>(std::min<int64_t>(kBk, end - t0));
    int64_t blk = t0 / g.bs, off = t0 % g.bs;
    for (int j = 0; j < kBk; ++j) {
      if (j < nk) {
        const int64_t at = (int64_t{table[blk]} * g.bs + off) * g.row + it.head * D;
        kp[j] = kc + at;
        vp[j] = vc + at;
        if (++off == g.bs) off = 0, ++blk;
      } else {
        kp[j] = vp[j] = w.zero;
      }
    }
    // the last block: its keys rounded up to the 8 of a score tile (the zero keys past the
    // context are masked below), not all kBk: a short prompt's items are mostly last blocks
    const int nk8 = (nk + 7) & ~7;
    scores_all<RV>(kp, w.qt, D, nk8, w.st);
    // keys past a row's position: -inf, only where the block reaches past the first row's
    v16 bmax[RV];
    for (int v = 0; v < RV; ++v) bmax[v] = splat(kNegInf);
    if (t0 + nk8 - 1 > first_pos) {
      for (int j = 0; j < nk8; ++j) {
        const v16 tj = splat(static_cast<float>(t0 + j));
        for (int v = 0; v < RV; ++v) {
          v16 s = load(w.st + j * kRows + v * 16);
          s = tj > pos[v] ? splat(kNegInf) : s;
          store(w.st + j * kRows + v * 16, s);
          bmax[v] = s > bmax[v] ? s : bmax[v];
        }
      }
    } else {
      for (int j = 0; j < nk8; ++j)
        for (int v = 0; v < RV; ++v) {
          const v16 s = load(w.st + j * kRows + v * 16);
          bmax[v] = s > bmax[v] ? s : bmax[v];
        }
    }
    v16 alpha[RV];
    for (int v = 0; v < RV; ++v) {
      const v16 mn = bmax[v] > m[v] ? bmax[v] : m[v];
      alpha[v] = vexp2(m[v] - mn);  // m is -inf before the first block only: alpha 0
      m[v] = mn;
      l[v] *= alpha[v];
    }
    for (int j = 0; j < nk; ++j) {
      for (int v = 0; v < RV; ++v) {
        const v16 p = vexp2(load(w.st + j * kRows + v * 16) - m[v]);  // masked: 0
        store(w.st + j * kRows + v * 16, p);
        l[v] += p;
      }
    }
    values_all<RV>(vp, nk, w.st, alpha, D, w.ot);
  }
  for (int64_t i = 0; i < it.nq; ++i)
    for (int64_t gg = 0; gg < G; ++gg) {
      const int64_t r = i * G + gg;
      const float inv = 1.f / l[r / 16][r % 16];
      float* dst = out + ((row0 + it.q0 + i) * H + it.head * G + gg) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = w.ot[d * kRows + r] * inv;
    }
}

using ItemFn = void (*)(const Geometry&, const Item&, const int64_t*, const int32_t*,
                        const float*, const float*, const float*, float*, const Scratch&);
constexpr ItemFn kItems[kMaxRowVecs + 1] = {nullptr,      &run_item<1>, &run_item<2>,
                                            &run_item<3>, &run_item<4>, &run_item<5>,
                                            &run_item<6>};

}  // namespace

bool prefill_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
         num_heads / num_kv_heads <= kRows && head_dim % 8 == 0 && head_dim <= 256;
}

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& chunks,
                             const at::Tensor& tables, int64_t block_size, double scale,
                             at::Tensor& out) {
  check_attention_operands("paged_prefill_attention", q, k_cache, v_cache, out);
  TORCH_CHECK(chunks.dtype() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 3 &&
                  chunks.is_contiguous(),
              "chunks must be a contiguous int64 [C, 3] (first row, tokens, first position)");
  TORCH_CHECK(tables.dtype() == at::kInt && tables.dim() == 2 && tables.is_contiguous() &&
                  tables.size(0) == chunks.size(0),
              "tables must be a contiguous int32 [C, M]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && chunks.device().is_cpu() &&
                  tables.device().is_cpu(),
              "paged_prefill_attention: CPU tensors only");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  Geometry g{q.size(1), k_cache.size(1), q.size(2), 0,      tables.size(1),
             block_size, k_cache.size(0), 0,         static_cast<float>(scale)};
  TORCH_CHECK(prefill_attention_supported(g.H, g.Hkv, g.D),
              "paged_prefill_attention: unsupported heads ", g.H, " / ", g.Hkv, ", head_dim ",
              g.D);
  g.G = g.H / g.Hkv;
  g.row = g.Hkv * g.D;
  const int64_t C = chunks.size(0), T = q.size(0);
  const int64_t* cp = chunks.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  // query positions per item: as many as fit kRows rows with G heads each
  const int64_t bq = std::max<int64_t>(1, kRows / g.G);
  std::vector<Item> items;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t row0 = cp[c * 3], n = cp[c * 3 + 1], start = cp[c * 3 + 2];
    TORCH_CHECK(row0 >= 0 && n >= 1 && start >= 0 && row0 + n <= T, "chunk ", c,
                ": rows [", row0, ", ", row0 + n, ") out of q's ", T);
    const int64_t ctx = start + n;
    TORCH_CHECK(ctx <= g.M * block_size, "chunk ", c, ": context ", ctx,
                " does not fit the block table");
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[c * g.M + b] >= 0 && (tp[c * g.M + b] + 1) * block_size <= g.S, "block ",
                  tp[c * g.M + b], " out of the cache");
    for (int64_t h = 0; h < g.Hkv; ++h)
      for (int64_t q0 = 0; q0 < n; q0 += bq) {
        const int64_t nq = std::min(bq, n - q0);
        items.push_back({c, h, q0, nq, nq * (start + q0 + nq)});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int nt = omp_in_parallel() ? 1 : at::get_num_threads();
  const int64_t per_thread = (2 * g.D + kBk) * kRows + g.D;
  at::Tensor scratch = at::zeros({nt, per_thread}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nt)
  {
    float* base = scratch.data_ptr<float>() + omp_get_thread_num() * per_thread;
    const Scratch w{base, base + g.D * kRows, base + 2 * g.D * kRows,
                    base + (2 * g.D + kBk) * kRows};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const Item& it = items[i];
      const int rv = static_cast<int>((it.nq * g.G + 15) / 16);
      kItems[rv](g, it, cp, tp, qp, kp, vp, op, w);
    }
  }
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor chunks, "
      "Tensor tables, int block_size, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_supported(int num_heads, int num_kv_heads, int head_dim) -> bool");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("paged_prefill_attention", &raylora::paged_prefill_attention);
}
TORCH_LIBRARY_IMPL(raylora_cpu, CompositeExplicitAutograd, m) {
  m.impl("prefill_attention_supported", &raylora::prefill_attention_supported);
}
