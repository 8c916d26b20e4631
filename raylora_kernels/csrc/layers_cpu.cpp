// raylora's CPU forward: every decoder layer of a Llama-family model, for a batch of decode
// tokens and prefill chunks in any mix, in one call (float32, packed weights; LoRA through
// lora_cpu.cpp's kernel).
//
// Through the Python layers a step is dispatch-bound at small batches (about 40 torch ops
// and a dozen module calls per layer: ~25 ms of a 50 ms step of SmolLM2-135M at batch 1
// here, against ~25 ms for reading the weights) and allocation-bound at large ones (each op's
// output a fresh tensor: a 2,048-token step's activations are 10-25 MB apiece, whose pages
// the kernel zeroes on first touch). Here each layer is a few calls from C++ into buffers
// allocated once per call: the packed GEMMs, the residual add fused with the next RMSNorm,
// rope fused with the KV cache write, the decode and prefill attention (both read the paged
// cache in place), silu-and-mul in one loop. The outputs are engine/models/llama.py's forward's
// within float rounding (the fused loops may contract a multiply-add that torch rounds twice,
// and sum squares in another order; tests compare the two paths and both against HF).
//
//   x        [T, hidden]           embeddings of the batch's tokens (not modified)
//   cos, sin [T, D]                rope of each token's position (HF's rotate_half layout)
//   weights  6 per layer           input_layernorm, qkv (packed), o (packed),
//                                  post_attention_layernorm, gate_up (packed), down (packed)
//   biases   1 per layer           the qkv bias (Qwen2) or None
//   k_caches, v_caches             [S, Hkv, D] per layer
//   slots    [T] int64             each token's cache slot
//   decode   rows [N] int64, tables [N, M] int32, lens [N] int32: the decode tokens
//            (attention_cpu.cpp), or None
//   prefill  chunks [C, 3] int64, tables [C, M'] int32: the prefill chunks
//            (prefill_attention_cpu.cpp), or None; decode rows and chunks cover the T rows
//   dims     [H, Hkv, D, intermediate, block_size]
//   lora, lora_ranks, segments     none for a base batch; else a, b_t (8 per layer) and ranks
//                                  (4 per layer) of qkv, o, gate_up, down, and the segments
//                                  of the tokens grouped by slot (kernels/metadata.py)
//   out_rows [R] int64             the rows whose hidden states are wanted, or None for all
// Returns those rows' hidden states after the last layer (before the final norm), [R, hidden].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <chrono>
#include <cmath>
#include <vector>

#include "attention_cpu.h"
#include "elementwise_cpu.h"
#include "lora_cpu.h"
#include "packed_cpu.h"
#include "simd_cpu.h"

namespace raylora {

namespace {

constexpr int kPerLayer = 6;

// Seconds forward_layers has spent per phase since layer_times() last read them: linears,
// attention, elementwise (norms, rope and the cache write, silu-and-mul). The profiler
// (benchmarks/step_profile.py) splits the one C++ call with them; a clock read costs ~20 ns,
// ten per layer.
enum Phase { kLinears, kAttention, kElementwise, kNumPhases };
std::array<double, kNumPhases> g_phase_seconds{};

class PhaseClock {
 public:
  PhaseClock() : last_(std::chrono::steady_clock::now()) {}
  void lap(Phase p) {
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[p] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  std::chrono::steady_clock::time_point last_;
};


}  // namespace

// The LoRA segments [3, A] (slot, first row, rows) of the rows `rows` (ascending) of a batch
// whose segments are `segments`, into `out`; false if rows are not ascending.
static bool rows_segments(const at::Tensor& segments, const int64_t* rows, int64_t R, at::Tensor& out) {
  for (int64_t i = 1; i < R; ++i)
    if (rows[i] <= rows[i - 1]) return false;
  const int64_t A = segments.size(1);
  const at::Tensor seg = segments.contiguous();
  const int64_t* sp = seg.data_ptr<int64_t>();
  std::vector<int64_t> slot, first, count;
  int64_t i = 0;  // rows before the current segment's first row are past
  for (int64_t a = 0; a < A; ++a) {
    const int64_t begin = sp[A + a], end = begin + sp[2 * A + a];
    while (i < R && rows[i] < begin) ++i;
    const int64_t start = i;
    while (i < R && rows[i] < end) ++i;
    if (i > start) slot.push_back(sp[a]), first.push_back(start), count.push_back(i - start);
  }
  const int64_t n = static_cast<int64_t>(slot.size());
  out = at::empty({3, n}, segments.options());
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) op[k] = slot[k], op[n + k] = first[k], op[2 * n + k] = count[k];
  return true;
}

// The prefill chunks [C, 3] (first row, tokens, first position) cut to their last query
// where that row is one of `rows`, with their block tables; left undefined (every chunk in
// full) if some row in `rows` lies inside a chunk before its last position.
static void last_query_chunks(const at::Tensor& chunks, const at::Tensor& tables, const int64_t* rows,
                       int64_t R, at::Tensor& out_chunks, at::Tensor& out_tables) {
  const int64_t C = chunks.size(0);
  const int64_t* cp = chunks.data_ptr<int64_t>();
  std::vector<int64_t> keep;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t first = cp[c * 3], last = first + cp[c * 3 + 1] - 1;
    bool wanted = false;
    for (int64_t i = 0; i < R; ++i) {
      if (rows[i] == last) wanted = true;
      else if (rows[i] >= first && rows[i] < last) return;  // an inner row: keep every chunk
    }
    if (wanted) keep.push_back(c);
  }
  const int64_t K = static_cast<int64_t>(keep.size());
  out_chunks = at::empty({K, 3}, chunks.options());
  int64_t* op = out_chunks.data_ptr<int64_t>();
  for (int64_t k = 0; k < K; ++k) {
    const int64_t* c = cp + keep[k] * 3;
    op[k * 3] = c[0] + c[1] - 1, op[k * 3 + 1] = 1, op[k * 3 + 2] = c[2] + c[1] - 1;
  }
  out_tables = tables.index_select(0, at::tensor(keep, chunks.options()));
}

// [linears, attention, elementwise] seconds forward_layers spent since the last call (then 0).
std::vector<double> layer_times() {
  std::vector<double> out(g_phase_seconds.begin(), g_phase_seconds.end());
  g_phase_seconds.fill(0.0);
  return out;
}

at::Tensor forward_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList weights,
                          const c10::List<std::optional<at::Tensor>>& biases,
                          at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots,
                          const std::optional<at::Tensor>& decode_rows,
                          const std::optional<at::Tensor>& decode_tables,
                          const std::optional<at::Tensor>& decode_lens,
                          const std::optional<at::Tensor>& prefill_chunks,
                          const std::optional<at::Tensor>& prefill_tables, at::IntArrayRef dims,
                          double eps, double scale, at::TensorList lora,
                          const c10::List<std::optional<at::Tensor>>& lora_ranks,
                          const std::optional<at::Tensor>& segments,
                          const std::optional<at::Tensor>& out_rows) {
  TORCH_CHECK(dims.size() == 5, "dims must be [H, Hkv, D, intermediate, block_size]");
  const int64_t H = dims[0], Hkv = dims[1], D = dims[2], I = dims[3], bs = dims[4];
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * L &&
                  static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(biases.size()) == L,
              "forward_layers: ", kPerLayer, " weights, one bias, one K and V cache per layer");
  TORCH_CHECK(x_in.dtype() == at::kFloat && x_in.dim() == 2 && cos.dtype() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x_in.size(0) &&
                  cos.size(-1) == D && sin.sizes() == cos.sizes(),
              "forward_layers: float32 x [T, hidden], contiguous cos and sin [T, D]");
  TORCH_CHECK(slots.dtype() == at::kLong && slots.is_contiguous() && slots.size(0) == x_in.size(0),
              "forward_layers: slots must be a contiguous int64 [T]");
  const int64_t T = x_in.size(0), hidden = x_in.size(1);
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(k_caches[l].dim() == 3 && k_caches[l].is_contiguous() &&
                    v_caches[l].sizes() == k_caches[l].sizes() && v_caches[l].is_contiguous() &&
                    k_caches[l].size(1) == Hkv && k_caches[l].size(2) == D,
                "forward_layers: caches must be contiguous [S, Hkv, D]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < k_caches[0].size(0), "slot ", sl[t], " out of the cache");
  const bool has_decode = decode_rows.has_value();
  const bool has_prefill = prefill_chunks.has_value();
  TORCH_CHECK(has_decode == (decode_tables.has_value() && decode_lens.has_value()) &&
                  has_prefill == prefill_tables.has_value(),
              "forward_layers: decode needs rows, tables and lens; prefill chunks and tables");
  // every row gets its attention from one of the two (the kernels check their own entries)
  int64_t covered = has_decode ? decode_rows->numel() : 0;
  if (has_prefill) {
    TORCH_CHECK(prefill_chunks->dtype() == at::kLong && prefill_chunks->dim() == 2 &&
                    prefill_chunks->size(1) == 3 && prefill_chunks->is_contiguous(),
                "forward_layers: prefill chunks must be a contiguous int64 [C, 3]");
    const int64_t* cp = prefill_chunks->data_ptr<int64_t>();
    for (int64_t c = 0; c < prefill_chunks->size(0); ++c) covered += cp[c * 3 + 1];
  }
  TORCH_CHECK(covered == T, "forward_layers: decode rows and prefill chunks cover ", covered,
              " of ", T, " rows");
  // LoRA (segments given): a and b_t of the four linears of every layer, qkv, o, gate_up,
  // down, and their ranks; each linear is then linear_lora_packed, the base GEMM and every
  // active slot's LoRA in one call, as the Python layers' CPU backend runs it.
  const bool with_lora = segments.has_value();
  // gate_up and silu-and-mul in one pass (packed_cpu.cpp), where no LoRA adds to gate_up between
  bool fuse_silu = !with_lora;
  for (int64_t l = 0; l < L && fuse_silu; ++l)
    fuse_silu = silu_fusable(weights[l * kPerLayer + 4], I);
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora.size()) == 8 * L &&
                             static_cast<int64_t>(lora_ranks.size()) == 4 * L),
              "forward_layers: LoRA needs a and b_t of 4 linears per layer and their ranks");
  const std::vector<std::vector<int64_t>> widths = {
      {H * D, Hkv * D, Hkv * D}, {hidden}, {I, I}, {hidden}};
  // y = the linear of `in` (into y's buffer without LoRA)
  // The last layer runs its o_proj and MLP over out_rows alone (the rows whose hidden states
  // the caller wants: the sampling ones), after attention over every row (its K and V go to
  // the cache for later tokens): at prefill 5/6 of a layer's linears, 1/36 of the step's.
  // With LoRA that needs out_rows ascending (they then keep the slot grouping), else it
  // returns every row.
  const int64_t R = out_rows.has_value() ? out_rows->numel() : T;
  bool narrow_last = out_rows.has_value() && R < T;
  at::Tensor last_segments;
  if (narrow_last) {
    TORCH_CHECK(out_rows->dtype() == at::kLong && out_rows->dim() == 1 && out_rows->is_contiguous(),
                "forward_layers: out_rows must be a contiguous int64 [R]");
    const int64_t* rp = out_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "forward_layers: out row ", rp[i], " out of ", T);
    if (with_lora) narrow_last = rows_segments(*segments, rp, R, last_segments);
  }
  // ... and, where every out row of a prefill chunk is its last one (no prompt logprobs), its
  // attention over those queries alone: each such chunk shrinks to its last position
  at::Tensor last_chunks, last_tables;
  if (narrow_last && has_prefill)
    last_query_chunks(*prefill_chunks, *prefill_tables, out_rows->data_ptr<int64_t>(), R,
                      last_chunks, last_tables);
  auto linear = [&](const at::Tensor& in, const at::Tensor& w, int64_t l, int j, int64_t N,
                    const std::optional<at::Tensor>& b, at::Tensor& y) {
    if (!with_lora) {
      linear_packed_into(in, w, check_packed(in, w, N, b), y);
      return;
    }
    const int64_t k = l * 4 + j;
    const at::Tensor& seg = narrow_last && l == L - 1 && j > 0 ? last_segments : *segments;
    y = linear_lora_packed(in, w, N, b, lora[2 * k], lora[2 * k + 1], seg, widths[j],
                           lora_ranks.get(k));
  };
  // the buffers, allocated once for every layer
  const auto f = x_in.options();
  at::Tensor x = x_in.contiguous().clone();
  at::Tensor h = at::empty({T, hidden}, f), delta = at::empty({T, hidden}, f);
  at::Tensor qkv = at::empty({T, (H + 2 * Hkv) * D}, f);
  at::Tensor q = at::empty({T, H, D}, f), o = at::empty({T, H, D}, f);
  at::Tensor gu = fuse_silu ? at::Tensor() : at::empty({T, 2 * I}, f);
  at::Tensor act = at::empty({T, I}, f);
  float* xp = x.data_ptr<float>();
  const float fe = static_cast<float>(eps);
  PhaseClock clock;
  add_rms_norm(xp, nullptr, weights[0].data_ptr<float>(), fe, h.data_ptr<float>(), T, hidden);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * kPerLayer;
    at::Tensor kc = k_caches[l], vc = v_caches[l];
    clock.lap(kElementwise);
    linear(h, w[1], l, 0, (H + 2 * Hkv) * D, biases.get(l), qkv);
    clock.lap(kLinears);
    rope_and_cache(qkv, cos, sin, q, kc, vc, slots, H, Hkv, D);
    clock.lap(kElementwise);
    if (has_prefill && last_chunks.defined() && l == L - 1) {
      if (last_chunks.size(0) > 0)
        paged_prefill_attention(q, kc, vc, last_chunks, last_tables, bs, scale, o);
    } else if (has_prefill) {
      paged_prefill_attention(q, kc, vc, *prefill_chunks, *prefill_tables, bs, scale, o);
    }
    if (has_decode)
      paged_decode_attention(q, *decode_rows, kc, vc, *decode_tables, *decode_lens, bs, scale, o);
    clock.lap(kAttention);
    at::Tensor attn = o.view({T, H * D});
    int64_t n = T;  // rows from here on
    if (narrow_last && l == L - 1) {
      attn = attn.index_select(0, *out_rows);
      x = x.index_select(0, *out_rows);
      xp = x.data_ptr<float>();
      n = R;
    }
    at::Tensor hn = h.narrow(0, 0, n), dn = delta.narrow(0, 0, n);
    at::Tensor actn = act.narrow(0, 0, n);
    linear(attn, w[2], l, 1, hidden, std::nullopt, dn);
    clock.lap(kLinears);
    add_rms_norm(xp, dn.data_ptr<float>(), w[3].data_ptr<float>(), fe, hn.data_ptr<float>(), n,
                 hidden);
    clock.lap(kElementwise);
    if (fuse_silu) {  // gate_up and silu-and-mul in one pass (the same bits)
      check_packed(hn, w[4], 2 * I, std::nullopt);
      linear_packed_silu_into(hn, w[4], I, actn);
      clock.lap(kLinears);
    } else {
      at::Tensor gun = gu.narrow(0, 0, n);
      linear(hn, w[4], l, 2, 2 * I, std::nullopt, gun);
      clock.lap(kLinears);
      silu_and_mul_into(gun, I, actn);
      clock.lap(kElementwise);
    }
    linear(actn, w[5], l, 3, hidden, std::nullopt, dn);
    clock.lap(kLinears);
    if (l + 1 < L) {  // the next layer's input norm, fused with this residual add
      add_rms_norm(xp, dn.data_ptr<float>(), weights[(l + 1) * kPerLayer].data_ptr<float>(), fe,
                   h.data_ptr<float>(), T, hidden);
    } else {
      x.add_(dn);
    }
  }
  clock.lap(kElementwise);
  // out_rows' hidden states, in out_rows' order (narrowed above, or picked now)
  if (out_rows.has_value() && !narrow_last) return x.index_select(0, *out_rows);
  return x;
}

}  // namespace raylora

TORCH_LIBRARY_FRAGMENT(raylora_cpu, m) {
  m.def(
      "forward_layers(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor? decode_rows, "
      "Tensor? decode_tables, Tensor? decode_lens, Tensor? prefill_chunks, "
      "Tensor? prefill_tables, int[] dims, float eps, float scale, Tensor[] lora, "
      "Tensor?[] lora_ranks, Tensor? segments, Tensor? out_rows) -> Tensor");
  m.def("layer_times() -> float[]");
}

TORCH_LIBRARY_IMPL(raylora_cpu, CompositeExplicitAutograd, m) {
  m.impl("layer_times", &raylora::layer_times);
}

TORCH_LIBRARY_IMPL(raylora_cpu, CPU, m) {
  m.impl("forward_layers", &raylora::forward_layers);
}
