// 16-lane float vectors (GCC vector extensions: AVX-512 registers under -march=native), the
// vectorised e^x that attention_cpu.cpp's softmax shares, and silu (elementwise_cpu.cpp's
// silu-and-mul and packed_cpu.cpp's fused gate_up epilogue: the same bits in both).
#pragma once

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace raylora {
namespace simd {

typedef float v16 __attribute__((vector_size(64)));
typedef int vi16 __attribute__((vector_size(64)));
inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
inline v16 splat(float x) { return v16{} + x; }

inline float hsum(v16 v) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof m);
  return _mm512_reduce_add_ps(m);
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
#endif
}

// e^x for x <= 0 (scores minus their maximum): Cephes' expf, 2^n times a degree-6
// polynomial of the remainder, within 2 ulp of std::exp; below -87.3 it returns ~1e-38.
inline v16 vexp(v16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  const v16 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  v16 fn = x * splat(1.44269504088896341f) + magic;
  const vi16 n = (vi16)fn - (vi16)magic;
  fn -= magic;
  v16 r = x - fn * splat(0.693359375f);
  r -= fn * splat(-2.12194440e-4f);
  v16 p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.f);
  const vi16 scale = (n + 127) << 23;
  return p * (v16)scale;
}

// silu(x) = x / (1 + e^-x), from e = e^-|x| (<= 1, vexp's range): x / (1 + e) for x >= 0,
// x e / (1 + e) below. Within a few ulp of torch's F.silu.
inline v16 vsilu(v16 x) {
  const v16 zero = splat(0.f), one = splat(1.f);
  const v16 e = vexp(x < zero ? x : -x);
  return (x < zero ? x * e : x) / (one + e);
}

}  // namespace simd
}  // namespace raylora
