// raylora's CPU paged attention for decode tokens: each decode token's query attends to its
// sequence's keys and values where they lie in the paged KV cache (no gather, no padding, no
// mask), float32.
//
//   q        [T, H, D]      the batch's queries (rope applied); only `rows` are read
//   rows     [N] int64      the rows of q (and out) that are decode tokens
//   k_cache  [S, Hkv, D]    slot s = block * block_size + offset (engine/attention.py)
//   v_cache  [S, Hkv, D]
//   tables   [N, M] int32   each decode token's block table (padded past its context)
//   lens     [N] int32      each decode token's context length, itself included
//   out      [T, H, D]      rows `rows` are written
//
// Query head h reads KV head h / G (G = H / Hkv, HF's repeat_kv order). The work is split
// into items (token, chunk of kChunk context positions): one item computes every head's
// scores over its chunk (a cache row, all KV heads of one position, read whole: the G query
// heads of a KV head share its keys), their exponentials against the chunk's maximum and the
// weighted sums of the values; a second pass merges a token's chunks (flash-decoding's
// split). The chunks
// depend on the context length alone, so a token's output is the same bits whatever else
// is in the batch. Built with lora_cpu.cpp by kernels/cpu_kernel.py.
#include "attention_cpu.h"
#include "simd_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace raylora {

namespace {

using namespace simd;

constexpr int64_t kChunk = 256;  // context positions per work item

// Rows are read kAhead positions ahead, and an item's first kAhead rows before it starts: a
// sequence's blocks lie anywhere in the cache, and the hardware prefetcher loses the stream at
// every block boundary (measured here: 2x the attention's bandwidth with it; 8 ahead plus the
// first rows 5-10% more than 16 ahead alone, contexts 128-2,048).
constexpr int64_t kAhead = 8;

inline void prefetch_row(const float* p, int64_t row) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < row * 4; b += 64) __builtin_prefetch(c + b, 0, 2);
}

struct Geometry {
  int64_t H, Hkv, D, G, M, bs, S;
  float scale;
};

// lane i of the result = the sum of a[i]'s 16 lanes: a shuffle tree (15 adds, 30 two-source
// permutes for 16 sums, against 16 x 8 for horizontal sums one by one). Each level halves the
// lanes per input: pairs of inputs become one vector with half the lanes of each, in order.
inline v16 pair_sum(v16 x, v16 y) {
  const v16 even = __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                           26, 28, 30);
  const v16 odd = __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                          27, 29, 31);
  return even + odd;
}

inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) b[k] = pair_sum(a[2 * k], a[2 * k + 1]);
  for (int k = 0; k < 4; ++k) c[k] = pair_sum(b[2 * k], b[2 * k + 1]);
  for (int k = 0; k < 2; ++k) d[k] = pair_sum(c[2 * k], c[2 * k + 1]);
  return pair_sum(d[0], d[1]);
}

// One item: token n over context positions [t0, t1), every head. A cache row (one position:
// Hkv x D floats) is read whole, each K row once, each V row from memory once (the other KV
// heads' passes find it in L2: a chunk's V is kChunk x Hkv x D floats).
// s: scratch [H, kChunk + 16] scores, then [H x 16] partial vectors. Writes each head's
// unnormalised output acc[H][D], maximum score m[H] and exp-sum l[H].
template <int G, int DV>
void item(const Geometry& geo, const float* q, const float* kc, const float* vc,
          const int32_t* table, int64_t t0, int64_t t1, float* s, float* acc, float* m,
          float* l) {
  const int64_t D = geo.D, Hkv = geo.Hkv, H = geo.H, len = t1 - t0, row = Hkv * D;
  const int64_t ld = kChunk + 16, padded = (len + 15) / 16 * 16;
  v16* part = reinterpret_cast<v16*>(s + H * ld);  // [H][16] q . k partial vectors
  // each position's cache row offset, walking the block table (no division per position)
  int64_t at[kChunk];
  for (int64_t i = 0, blk = t0 / geo.bs, off = t0 % geo.bs; i < len; ++i) {
    at[i] = (int64_t{table[blk]} * geo.bs + off) * row;
    if (++off == geo.bs) off = 0, ++blk;
  }
  auto prefetch_position = [&](int64_t i) {  // its K and V rows
    prefetch_row(kc + at[i], row);
    prefetch_row(vc + at[i], row);
  };
  for (int64_t i = 0; i < std::min<int64_t>(kAhead, len); ++i) prefetch_position(i);
  for (int64_t i0 = 0; i0 < padded; i0 += 16) {
    for (int64_t i = i0; i < i0 + 16; ++i) {
      if (i >= len) {
        for (int64_t hg = 0; hg < H; ++hg) part[hg * 16 + (i - i0)] = v16{};
        continue;
      }
      const float* kp = kc + at[i];
      if (i + kAhead < len) prefetch_position(i + kAhead);  // V too: its pass finds it in L2
      for (int64_t h = 0; h < Hkv; ++h) {
        v16 kv[DV];
        for (int j = 0; j < DV; ++j) kv[j] = load(kp + h * D + j * 16);
        for (int g = 0; g < G; ++g) {
          const float* qh = q + (h * G + g) * D;
          v16 a = load(qh) * kv[0];
          for (int j = 1; j < DV; ++j) a += load(qh + j * 16) * kv[j];
          part[(h * G + g) * 16 + (i - i0)] = a;
        }
      }
    }
    for (int64_t hg = 0; hg < H; ++hg)
      store(s + hg * ld + i0, reduce16(part + hg * 16) * geo.scale);
  }
  for (int64_t hg = 0; hg < H; ++hg) {
    float* sh = s + hg * ld;
    v16 vmx = splat(-std::numeric_limits<float>::infinity());
    for (int64_t i = 0; i + 16 <= len; i += 16) {
      const v16 x = load(sh + i);
      vmx = x > vmx ? x : vmx;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int k = 0; k < 16; ++k) mx = std::max(mx, vmx[k]);
    for (int64_t i = len / 16 * 16; i < len; ++i) mx = std::max(mx, sh[i]);
    v16 sum = {};
    for (int64_t i = 0; i < padded; i += 16) {
      const v16 e = vexp(load(sh + i) - mx);
      store(sh + i, e);
    }
    for (int64_t i = len; i < padded; ++i) sh[i] = 0.f;  // padding (vexp clamps, not 0)
    for (int64_t i = 0; i < padded; i += 16) sum += load(sh + i);
    m[hg] = mx;
    l[hg] = hsum(sum);
  }
  for (int64_t h = 0; h < Hkv; ++h) {
    v16 o[G][DV] = {};
    for (int64_t i = 0; i < len; ++i) {
      const float* vp = vc + at[i];
      v16 vv[DV];
      for (int j = 0; j < DV; ++j) vv[j] = load(vp + h * D + j * 16);
      for (int g = 0; g < G; ++g) {
        const float p = s[(h * G + g) * ld + i];
        for (int j = 0; j < DV; ++j) o[g][j] += p * vv[j];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < DV; ++j) store(acc + (h * G + g) * D + j * 16, o[g][j]);
  }
}

using ItemFn = void (*)(const Geometry&, const float*, const float*, const float*,
                        const int32_t*, int64_t, int64_t, float*, float*, float*, float*);

template <int DV>
ItemFn pick_group(int64_t G) {
  switch (G) {
    case 1: return &item<1, DV>;
    case 2: return &item<2, DV>;
    case 3: return &item<3, DV>;
    case 4: return &item<4, DV>;
    case 5: return &item<5, DV>;
    case 6: return &item<6, DV>;
    case 7: return &item<7, DV>;
    case 8: return &item<8, DV>;
    default: return nullptr;
  }
}

ItemFn pick(int64_t G, int64_t D) {
  switch (D) {
    case 64: return pick_group<4>(G);
    case 128: return pick_group<8>(G);
    default: return nullptr;
  }
}

}  // namespace

bool decode_attention_supported(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  return num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
         pick(num_heads / num_kv_heads, head_dim) != nullptr;
}

void check_attention_operands(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& out) {
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat &&
                  v_cache.dtype() == at::kFloat && out.dtype() == at::kFloat,
              op, ": float32 only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.sizes() == q.sizes() && out.is_contiguous(),
              op, ": q and out must be contiguous [T, H, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.size(2) == q.size(2),
              op, ": k_cache and v_cache must be contiguous [S, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), op, ": CPU tensors only");
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& lens, int64_t block_size, double scale,
                            at::Tensor& out) {
  check_attention_operands("paged_decode_attention", q, k_cache, v_cache, out);
  TORCH_CHECK(rows.dtype() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows must be a contiguous int64 [N]");
  TORCH_CHECK(tables.dtype() == at::kInt && tables.dim() == 2 && tables.is_contiguous() &&
                  tables.size(0) == rows.size(0),
              "tables must be a contiguous int32 [N, M]");
  TORCH_CHECK(lens.dtype() == at::kInt && lens.dim() == 1 && lens.is_contiguous() &&
                  lens.size(0) == rows.size(0),
              "lens must be a contiguous int32 [N]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && rows.device().is_cpu() &&
                  tables.device().is_cpu() && lens.device().is_cpu(),
              "paged_decode_attention: CPU tensors only");
  Geometry geo{q.size(1), k_cache.size(1), q.size(2), 0, tables.size(1), block_size,
               k_cache.size(0), static_cast<float>(scale)};
  TORCH_CHECK(geo.Hkv > 0 && geo.H % geo.Hkv == 0, "H must be a multiple of Hkv");
  geo.G = geo.H / geo.Hkv;
  const ItemFn fn = pick(geo.G, geo.D);
  TORCH_CHECK(fn != nullptr, "paged_decode_attention: unsupported group ", geo.G, " / head_dim ",
              geo.D, " (decode_attention_supported)");
  const int64_t N = rows.size(0), T = q.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  // the items: (token, KV head, chunk); first[n] = token n's first chunk index
  std::vector<int64_t> first(N + 1, 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t len = lp[n];
    TORCH_CHECK(rp[n] >= 0 && rp[n] < T, "row ", rp[n], " out of range");
    TORCH_CHECK(len >= 1 && len <= geo.M * block_size, "context length ", len,
                " does not fit the block table");
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[n * geo.M + b] >= 0 && (tp[n * geo.M + b] + 1) * block_size <= geo.S,
                  "block ", tp[n * geo.M + b], " out of the cache");
    first[n + 1] = first[n] + (len + kChunk - 1) / kChunk;
  }
  const int64_t items = first[N];
  const int nt = omp_in_parallel() ? 1 : at::get_num_threads();
  const int64_t H = geo.H, D = geo.D;
  at::Tensor acc = at::empty({items, H, D}, q.options());
  at::Tensor ml = at::empty({items, 2, H}, q.options());
  at::Tensor scratch = at::empty({nt, H * (kChunk + 16 + 256)}, q.options());
  float* ap = acc.data_ptr<float>();
  float* mlp = ml.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel num_threads(nt)
  {
    float* s = scratch.data_ptr<float>() + omp_get_thread_num() * H * (kChunk + 16 + 256);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < items; ++c) {
      // the token this chunk belongs to (items are few: one per kChunk positions)
      const int64_t n = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
      const int64_t t0 = (c - first[n]) * kChunk, t1 = std::min<int64_t>(lp[n], t0 + kChunk);
      fn(geo, qp + rp[n] * H * D, kp, vp, tp + n * geo.M, t0, t1, s, ap + c * H * D,
         mlp + c * 2 * H, mlp + c * 2 * H + H);
    }
    // merge each token's chunks, head by head:
    // out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c
#pragma omp for schedule(static)
    for (int64_t nh = 0; nh < N * H; ++nh) {
      const int64_t n = nh / H, hg = nh % H;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t c = first[n]; c < first[n + 1]; ++c) mx = std::max(mx, mlp[c * 2 * H + hg]);
      float total = 0.f;
      float* o = op + (rp[n] * H + hg) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t c = first[n]; c < first[n + 1]; ++c) {
        const float w = std::exp(mlp[c * 2 * H + hg] - mx);
        total += w * mlp[c * 2 * H + H + hg];
        const float* a = ap + (c * H + hg) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor rows, Tensor k_cache, Tensor v_cache, "
      "Tensor tables, Tensor lens, int block_size, float scale, Tensor(a!) out) -> ()");
  m.def("decode_attention_supported(int num_heads, int num_kv_heads, int head_dim) -> bool");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("paged_decode_attention", &raylora::paged_decode_attention);
}
TORCH_LIBRARY_IMPL(raylora_cpu, CompositeExplicitAutograd, m) {
  m.impl("decode_attention_supported", &raylora::decode_attention_supported);
}
