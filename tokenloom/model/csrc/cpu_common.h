// Helpers both CPU extensions compile from one copy: cpu_kernels.cpp (the per-op kernels,
// tokenloom/model/kernels.py) and the fused decoder (fused_decode.cpp, built with gguf_kernels.cpp by
// tokenloom/model/gguf_kernels.py): the ISA switches, element conversions (float, bf16, fp16), eight-lane
// AVX2 loads and sums, the int8 KV cache's row quantizer and the 16-bit caches' row writer. Every
// function here is integer work, conversions, adds or a single multiply, so it rounds the same under
// both extensions' flags (cpu_kernels.cpp is built with -ffp-contract=off, the GGUF extension is not).
//
// Deliberately NOT shared, because the two sides differ in layout or in numerics and the fused
// step's tokens and logprobs must stay what they are:
//   RMSNorm    fused: sum of squares in double (four lanes, two chains) over fp32 rows;
//              cpu_kernels: fp32 fmadd over float / bf16 rows (AVX-512), the torch path's numbers.
//   exp        fused: exp256, Cephes' expf clamped to [-87, 88], for its softmax and SiLU;
//              cpu_kernels: exp8 (x <= 0 only, degree-6) in the flash softmax, exp16 in AVX-512.
//   rotary     fused: on fp32 activations with float or bf16 tables, a * b - c * d that the GGUF
//              build may contract to an FMA; cpu_kernels: in place on float / bf16 qkv rows, AVX-512
//              fmsub, no contraction. One source would round differently in the two builds.
//   attention  fused: two passes (scores, then softmax-weighted V) per query head, the heads of a kv head
//              reading each key tile together;
//              cpu_kernels: flash tiles over several rows and heads, the packed bf16 layout.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TL_AVX512 1
#else
#define TL_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TL_AVX2 1
#else
#define TL_AVX2 0
#endif

namespace tlc {

using bf16 = c10::BFloat16;
using f16 = c10::Half;  // a --kv-cache-dtype float16 cache's elements (IEEE binary16)

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
inline float to_f(f16 x) { return static_cast<float>(x); }  // exact
inline float to_f(int8_t x) { return static_cast<float>(x); }  // an int8 KV cache's value (times its scale)

#if TL_AVX2
// The sum of eight lanes: halves, then pairs, then the last two (this order, always: the callers'
// results depend on it).
inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Eight values as floats: a float load; bf16 by a 16-bit shift (bf16 is fp32's top half); int8 (an
// int8 KV cache's values, its scales applied by the caller) converted exactly.
inline __m256 load8f(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8f(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8f(const bf16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// fp16 (a float16 KV cache): F16C, on every AVX2 CPU; the exact conversion either way.
inline __m256 load8f(const f16* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; i++) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}
#endif

// Copy one row of K or V into a float / bf16 / fp16 cache: a plain copy where the types match, else each
// value rounded to nearest even (c10's conversions). int8 rows are quantized with a scale instead
// (quantize_kv_row).
template <typename T, typename KT>
inline void store_kv_row(const T* x, int64_t D, KT* dst) {
  static_assert(!std::is_same_v<KT, int8_t>, "int8 KV rows go through quantize_kv_row");
  if constexpr (std::is_same_v<T, KT>) {
    std::copy(x, x + D, dst);
  } else {
    for (int64_t d = 0; d < D; d++) dst[d] = KT(to_f(x[d]));
  }
}

// ------------------------------------------------------------------------------ int8 KV cache
// --kv-cache-dtype int8: each (token, kv head) row of K or V is stored as D int8 values q and one
// float32 scale s = absmax / 127 (symmetric, round to nearest even), value = q * s. Scales live in
// their own [Hkv, num_blocks, block_size] tensors, so a slot's scale is at the slot's index. The
// readers fold the scales into the scores (K) and the probabilities (V) instead of dequantizing rows
// where they can. The torch path (attention.py, quantize_kv / dequantize) does the same arithmetic.
template <typename T>
inline void quantize_kv_row(const T* x, int D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int d = 0; d < D; d++) amax = std::max(amax, std::fabs(to_f(x[d])));
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  for (int d = 0; d < D; d++) {
    const float r = std::nearbyint(to_f(x[d]) * inv);  // the default rounding mode: to nearest even
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  *scale = amax / 127.0f;
}

}  // namespace tlc
