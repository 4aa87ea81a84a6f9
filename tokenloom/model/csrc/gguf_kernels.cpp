// GGUF quantized weights, kept quantized: GEMV / small-batch GEMM and dequantization
// (built on first use by tokenloom/model/gguf_kernels.py, separately from cpu_kernels.cpp).
//
//   gguf_linear      out[M, N] = x[M, K] @ W[N, K].T (+ bias), W a GGUF tensor's raw blocks [N, row_bytes]
//   gguf_dequantize  W -> float / bf16 [N, K]   (the large-batch fallback and the loader)
//   gguf_embedding   rows `ids` of W -> float / bf16 (the embedding lookup of a quantized token_embd)
//
// Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks
// of 256); block layouts as in ggml-common.h (see each `Type` below).
//
// The arithmetic is ggml's CPU backend's idea: the activations are quantized on the fly to int8 in
// groups of 32 (scale d = max|x| / 127, and s = d * sum(q) for the types with an offset), and each
// weight group of 32 meets its activation group in integer dot products (AVX2 vpmaddubsw: unsigned
// weight bytes x signed activation bytes, pairs summed to int16, then vpmaddwd to int32), scaled to
// float once per group. Every type is described as a sequence of 32-element groups, each with
//   w       32 weight integers (unsigned 0..63, or signed for Q8_0 / Q3_K / Q6_K),
//   mul     int16 multipliers for the two halves of the group (the K-quants' per-16 scales; else 1),
//   a, b    floats: group value = a * sum(mul * w * q) * d_x + b * s_x
// plus, for Q2_K alone, a per-16 integer "min" dot product. The kernel template then handles any
// number of tokens, four at a time, each weight group unpacked once for all four.
//
// Without AVX2/FMA/F16C the same functions run plain C++ (dequantize a block, dot with the
// dequantized activation groups): slower, same results up to float summation order.
// Threads: at::parallel_for over output rows (torch's OpenMP pool).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TLQ_AVX2 1
#else
#define TLQ_AVX2 0
#endif

namespace {

using bf16 = c10::BFloat16;

// GGML type ids (gguf.GGMLQuantizationType).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

bool g_force_scalar = false;  // tests hold the SIMD path to the plain one

inline float h2f(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// --------------------------------------------------------------------------- scalar block decoding
// Each writes the block's float values (exactly gguf.quants.dequantize's arithmetic, fp32).

inline void nibbles32(const uint8_t* qs, int* out) {  // element j: low nibble of qs[j], j + 16: high
  for (int j = 0; j < 16; j++) {
    out[j] = qs[j] & 0x0F;
    out[j + 16] = qs[j] >> 4;
  }
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes.
inline void k4_scales(const uint8_t* q, int* sc, int* mn) {
  for (int j = 0; j < 8; j++) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

// Q3_K: 16 six-bit scales (minus 32) packed in 12 bytes.
inline void k3_scales(const uint8_t* s, int* sc) {
  for (int j = 0; j < 16; j++) {
    const int lo = j < 8 ? (s[j] & 0x0F) : (s[j - 8] >> 4);
    const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    sc[j] = (lo | (hi << 4)) - 32;
  }
}

void dequant_block(int t, const uint8_t* b, float* y) {
  int q[32];
  switch (t) {
    case kQ8_0: {
      const float d = h2f(b);
      for (int j = 0; j < 32; j++) y[j] = d * static_cast<int8_t>(b[2 + j]);
      break;
    }
    case kQ4_0: {
      const float d = h2f(b);
      nibbles32(b + 2, q);
      for (int j = 0; j < 32; j++) y[j] = d * (q[j] - 8);
      break;
    }
    case kQ4_1: {
      const float d = h2f(b), m = h2f(b + 2);
      nibbles32(b + 4, q);
      for (int j = 0; j < 32; j++) y[j] = d * q[j] + m;
      break;
    }
    case kQ5_0: {
      const float d = h2f(b);
      const uint32_t qh = u32(b + 2);
      nibbles32(b + 6, q);
      for (int j = 0; j < 32; j++) y[j] = d * ((q[j] | static_cast<int>(((qh >> j) & 1) << 4)) - 16);
      break;
    }
    case kQ5_1: {
      const float d = h2f(b), m = h2f(b + 2);
      const uint32_t qh = u32(b + 4);
      nibbles32(b + 8, q);
      for (int j = 0; j < 32; j++) y[j] = d * (q[j] | (((qh >> j) & 1) << 4)) + m;
      break;
    }
    case kQ2_K: {
      const uint8_t* sc = b;
      const uint8_t* qs = b + 16;
      const float d = h2f(b + 80), dmin = h2f(b + 82);
      for (int e = 0; e < 256; e++) {
        const int h = e / 128, s = (e % 128) / 32, l = e % 32;
        const int v = (qs[32 * h + l] >> (2 * s)) & 3;
        const uint8_t scm = sc[e / 16];
        y[e] = d * static_cast<float>(scm & 0x0F) * v - dmin * static_cast<float>(scm >> 4);
      }
      break;
    }
    case kQ3_K: {
      const uint8_t* hm = b;
      const uint8_t* qs = b + 32;
      int sc[16];
      k3_scales(b + 96, sc);
      const float d = h2f(b + 108);
      for (int e = 0; e < 256; e++) {
        const int g = e / 32, l = e % 32;
        const int ql = (qs[32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
        const int v = ql - (((hm[l] >> g) & 1) ? 0 : 4);
        y[e] = d * static_cast<float>(sc[e / 16]) * v;
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = h2f(b), dmin = h2f(b + 2);
      int sc[8], mn[8];
      k4_scales(b + 4, sc, mn);
      const bool five = t == kQ5_K;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int g = 0; g < 8; g++) {
        const float dl = d * sc[g], ml = dmin * mn[g];
        for (int l = 0; l < 32; l++) {
          int v = (g % 2 == 0) ? (qs[32 * (g / 2) + l] & 0x0F) : (qs[32 * (g / 2) + l] >> 4);
          if (five) v |= ((qh[l] >> g) & 1) << 4;
          y[32 * g + l] = dl * v - ml;
        }
      }
      break;
    }
    case kQ6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = h2f(b + 208);
      for (int h = 0; h < 2; h++) {
        for (int l = 0; l < 32; l++) {
          const uint8_t* L = ql + 64 * h;
          const uint8_t H = qh[32 * h + l];
          const int v0 = ((L[l] & 0x0F) | ((H & 3) << 4)) - 32;
          const int v1 = ((L[l + 32] & 0x0F) | (((H >> 2) & 3) << 4)) - 32;
          const int v2 = ((L[l] >> 4) | (((H >> 4) & 3) << 4)) - 32;
          const int v3 = ((L[l + 32] >> 4) | (((H >> 6) & 3) << 4)) - 32;
          const int is = 8 * h + l / 16;
          float* o = y + 128 * h;
          o[l] = d * static_cast<float>(sc[is]) * v0;
          o[l + 32] = d * static_cast<float>(sc[is + 2]) * v1;
          o[l + 64] = d * static_cast<float>(sc[is + 4]) * v2;
          o[l + 96] = d * static_cast<float>(sc[is + 6]) * v3;
        }
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported GGML type ", t);
  }
}

struct TypeInfo {
  int block_elems;
  int block_bytes;
};

TypeInfo type_info(int t) {
  switch (t) {
    case kQ8_0: return {32, 34};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "GGML type ", t, " has no tokenloom kernel");
  }
  return {0, 0};
}

// ------------------------------------------------------------------------ activation quantization
// Groups of 32: q = round(x / d), d = max|x| / 127, s = d * sum(q).

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }

template <typename T>
void quantize_act(const T* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t g = 0; g < K / 32; g++) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; j++) {
      v[j] = to_f(x[32 * g + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float dg = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      const int qi = static_cast<int>(std::nearbyint(v[j] * id));
      q[32 * g + j] = static_cast<int8_t>(qi);
      sum += qi;
    }
    d[g] = dg;
    s[g] = dg * static_cast<float>(sum);
  }
}

#if TLQ_AVX2
// ------------------------------------------------------------------------------------ AVX2 groups

inline __m256i nib_lo_hi(const uint8_t* qs) {  // 16 bytes -> 32 nibbles (low ones first)
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

inline __m256i bits_to_0x10(uint32_t x) {  // byte j = 0x10 if bit j of x is set, else 0
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
  return _mm256_and_si256(on, _mm256_set1_epi8(0x10));
}

inline __m256i mask_bit(__m256i bytes, int bit) {  // 0xFF where (byte >> bit) & 1
  const __m256i m = _mm256_set1_epi8(static_cast<char>(1 << bit));
  return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, m), m);
}

inline __m256i pair16(int lo, int hi) {  // int16 multipliers: lo for elements 0..15, hi for 16..31
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi)), _mm_set1_epi16(static_cast<short>(lo)));
}

struct Group {
  __m256i w;    // 32 weight bytes
  __m256i mul;  // int16 multipliers per half (ones when the group has one scale)
  float a, b;   // value = a * d_x * sum(mul * w * q) + b * s_x
  __m256i mn;   // Q2_K only: per-16 mins as bytes ...
  float amin;   // ... and their float factor (value -= amin * d_x * sum(mn * q))
};

template <typename F>
inline void groups_q8_0(const uint8_t* b, F&& f) {
  const __m256i one = _mm256_set1_epi16(1);
  const float d = h2f(b);
  f(Group{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), one, d, 0.0f, {}, 0.0f});
}
template <typename F>
inline void groups_q4_0(const uint8_t* b, F&& f) {
  const float d = h2f(b);
  f(Group{nib_lo_hi(b + 2), _mm256_set1_epi16(1), d, -8.0f * d, {}, 0.0f});
}
template <typename F>
inline void groups_q4_1(const uint8_t* b, F&& f) {
  f(Group{nib_lo_hi(b + 4), _mm256_set1_epi16(1), h2f(b), h2f(b + 2), {}, 0.0f});
}
template <typename F>
inline void groups_q5_0(const uint8_t* b, F&& f) {
  const float d = h2f(b);
  const __m256i w = _mm256_or_si256(nib_lo_hi(b + 6), bits_to_0x10(u32(b + 2)));
  f(Group{w, _mm256_set1_epi16(1), d, -16.0f * d, {}, 0.0f});
}
template <typename F>
inline void groups_q5_1(const uint8_t* b, F&& f) {
  const __m256i w = _mm256_or_si256(nib_lo_hi(b + 8), bits_to_0x10(u32(b + 4)));
  f(Group{w, _mm256_set1_epi16(1), h2f(b), h2f(b + 2), {}, 0.0f});
}
template <typename F>
inline void groups_q4_k(const uint8_t* b, F&& f) {
  const float d = h2f(b), dmin = h2f(b + 2);
  int sc[8], mn[8];
  k4_scales(b + 4, sc, mn);
  const __m256i one = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; j++) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j));
    f(Group{_mm256_and_si256(q, lo4), one, d * sc[2 * j], -dmin * mn[2 * j], {}, 0.0f});
    f(Group{_mm256_and_si256(_mm256_srli_epi16(q, 4), lo4), one, d * sc[2 * j + 1], -dmin * mn[2 * j + 1], {}, 0.0f});
  }
}
template <typename F>
inline void groups_q5_k(const uint8_t* b, F&& f) {
  const float d = h2f(b), dmin = h2f(b + 2);
  int sc[8], mn[8];
  k4_scales(b + 4, sc, mn);
  const __m256i one = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0F), x10 = _mm256_set1_epi8(0x10);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  for (int j = 0; j < 4; j++) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * j));
    const __m256i w0 = _mm256_or_si256(_mm256_and_si256(q, lo4), _mm256_and_si256(mask_bit(qh, 2 * j), x10));
    const __m256i w1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), lo4),
                                       _mm256_and_si256(mask_bit(qh, 2 * j + 1), x10));
    f(Group{w0, one, d * sc[2 * j], -dmin * mn[2 * j], {}, 0.0f});
    f(Group{w1, one, d * sc[2 * j + 1], -dmin * mn[2 * j + 1], {}, 0.0f});
  }
}
template <typename F>
inline void groups_q6_k(const uint8_t* b, F&& f) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
  const __m256i lo4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; h++) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const int8_t* s = sc + 8 * h;
    auto hi2 = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, shift), m3), 4); };
    const __m256i w0 = _mm256_or_si256(_mm256_and_si256(l0, lo4), hi2(0));
    const __m256i w1 = _mm256_or_si256(_mm256_and_si256(l1, lo4), hi2(2));
    const __m256i w2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), lo4), hi2(4));
    const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), lo4), hi2(6));
    f(Group{_mm256_sub_epi8(w0, c32), pair16(s[0], s[1]), d, 0.0f, {}, 0.0f});
    f(Group{_mm256_sub_epi8(w1, c32), pair16(s[2], s[3]), d, 0.0f, {}, 0.0f});
    f(Group{_mm256_sub_epi8(w2, c32), pair16(s[4], s[5]), d, 0.0f, {}, 0.0f});
    f(Group{_mm256_sub_epi8(w3, c32), pair16(s[6], s[7]), d, 0.0f, {}, 0.0f});
  }
}
template <typename F>
inline void groups_q3_k(const uint8_t* b, F&& f) {
  int sc[16];
  k3_scales(b + 96, sc);
  const float d = h2f(b + 108);
  const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i m3 = _mm256_set1_epi8(3), c4 = _mm256_set1_epi8(4);
  for (int h = 0; h < 2; h++) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 + 32 * h));
    for (int s = 0; s < 4; s++) {
      const int g = 4 * h + s;
      const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), m3);
      const __m256i w = _mm256_sub_epi8(ql, _mm256_andnot_si256(mask_bit(hm, g), c4));
      f(Group{w, pair16(sc[2 * g], sc[2 * g + 1]), d, 0.0f, {}, 0.0f});
    }
  }
}
template <typename F>
inline void groups_q2_k(const uint8_t* b, F&& f) {
  const uint8_t* sc = b;
  const float d = h2f(b + 80), dmin = h2f(b + 82);
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int h = 0; h < 2; h++) {
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * h));
    for (int s = 0; s < 4; s++) {
      const int g = 4 * h + s;
      const uint8_t s0 = sc[2 * g], s1 = sc[2 * g + 1];
      const __m256i mn = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(s1 >> 4)),
                                           _mm_set1_epi8(static_cast<char>(s0 >> 4)));
      f(Group{_mm256_and_si256(_mm256_srli_epi16(qs, 2 * s), m3), pair16(s0 & 0x0F, s1 & 0x0F), d, 0.0f, mn, dmin});
    }
  }
}

// Calls f(group) for every 32-element group of one block, in element order.
template <int T, typename F>
inline void groups(const uint8_t* b, F&& f) {
  if constexpr (T == kQ8_0) groups_q8_0(b, f);
  else if constexpr (T == kQ4_0) groups_q4_0(b, f);
  else if constexpr (T == kQ4_1) groups_q4_1(b, f);
  else if constexpr (T == kQ5_0) groups_q5_0(b, f);
  else if constexpr (T == kQ5_1) groups_q5_1(b, f);
  else if constexpr (T == kQ2_K) groups_q2_k(b, f);
  else if constexpr (T == kQ3_K) groups_q3_k(b, f);
  else if constexpr (T == kQ4_K) groups_q4_k(b, f);
  else if constexpr (T == kQ5_K) groups_q5_k(b, f);
  else groups_q6_k(b, f);
}

constexpr bool is_signed(int T) { return T == kQ8_0 || T == kQ3_K || T == kQ6_K; }
constexpr bool has_mul(int T) { return T == kQ2_K || T == kQ3_K || T == kQ6_K; }
constexpr bool has_b(int T) { return !(T == kQ8_0 || T == kQ2_K || T == kQ3_K || T == kQ6_K); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row against MT activation rows: out[m] = sum over the row's groups.
template <int T, int MT>
inline void dot_row(const uint8_t* w, int64_t nblocks, int64_t bb, const int8_t* const* xq, const float* const* xd,
                    const float* const* xs, float* out) {
  __m256 acc[MT];
  float sacc[MT];
  for (int m = 0; m < MT; m++) {
    acc[m] = _mm256_setzero_ps();
    sacc[m] = 0.0f;
  }
  const __m256i one = _mm256_set1_epi16(1);
  int64_t g = 0;  // activation group index
  for (int64_t blk = 0; blk < nblocks; blk++) {
    groups<T>(w + blk * bb, [&](const Group& G) {
      const __m256i wa = is_signed(T) ? _mm256_sign_epi8(G.w, G.w) : G.w;
      for (int m = 0; m < MT; m++) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * g));
        const __m256i xs8 = is_signed(T) ? _mm256_sign_epi8(x, G.w) : x;
        const __m256i p16 = _mm256_maddubs_epi16(wa, xs8);
        const __m256i p32 = _mm256_madd_epi16(p16, has_mul(T) ? G.mul : one);
        const float dx = xd[m][g];
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(G.a * dx), acc[m]);
        if constexpr (has_b(T)) sacc[m] += G.b * xs[m][g];
        if constexpr (T == kQ2_K) {
          const __m256i pm = _mm256_madd_epi16(_mm256_maddubs_epi16(G.mn, x), one);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(-G.amin * dx), acc[m]);
        }
      }
      g++;
    });
  }
  for (int m = 0; m < MT; m++) out[m] = hsum(acc[m]) + sacc[m];
}
#endif  // TLQ_AVX2

// Plain C++: dequantize the row's blocks and dot them with the dequantized activation groups.
void dot_row_scalar(int t, const uint8_t* w, int64_t K, const int8_t* xq, const float* xd, float* out,
                    float* buf) {
  const TypeInfo ti = type_info(t);
  const int64_t nb = K / ti.block_elems;
  double acc = 0.0;
  for (int64_t b = 0; b < nb; b++) {
    dequant_block(t, w + b * ti.block_bytes, buf);
    for (int e = 0; e < ti.block_elems; e++) {
      const int64_t k = b * ti.block_elems + e;
      acc += static_cast<double>(buf[e]) * (xd[k / 32] * xq[k]);
    }
  }
  *out = static_cast<float>(acc);
}

template <typename T>
inline void store(T* p, float v) {
  *p = static_cast<T>(v);
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "weight must be a contiguous uint8 [N, row_bytes] tensor of GGUF blocks");
  const TypeInfo ti = type_info(static_cast<int>(qtype));
  TORCH_CHECK(K > 0 && K % ti.block_elems == 0, "in_features ", K, " is not a multiple of the block size ",
              ti.block_elems);
  TORCH_CHECK(w.size(1) == K / ti.block_elems * ti.block_bytes, "weight rows hold ", w.size(1),
              " bytes, expected ", K / ti.block_elems * ti.block_bytes, " for K = ", K);
}

#if TLQ_AVX2
template <int T>
void linear_avx2(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K, const uint8_t* w,
                 int64_t N, int64_t row_bytes, const float* bias, float* out) {
  const TypeInfo ti = type_info(T);
  const int64_t nblocks = K / ti.block_elems, bb = ti.block_bytes;
  const int64_t G = K / 32;
  // Rows in chunks that fit L1/L2 with all M activation rows; every chunk is reused by all tokens.
  const int64_t grain = std::max<int64_t>(4, std::min<int64_t>(64, N / (4 * at::get_num_threads()) + 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mt = static_cast<int>(std::min<int64_t>(4, M - m0));
      const int8_t* xq[4];
      const float* xd[4];
      const float* xs[4];
      for (int i = 0; i < mt; i++) {
        xq[i] = q + (m0 + i) * K;
        xd[i] = d + (m0 + i) * G;
        xs[i] = s + (m0 + i) * G;
      }
      for (int64_t n = n0; n < n1; n++) {
        const uint8_t* wr = w + n * row_bytes;
        float r[4];
        switch (mt) {
          case 1: dot_row<T, 1>(wr, nblocks, bb, xq, xd, xs, r); break;
          case 2: dot_row<T, 2>(wr, nblocks, bb, xq, xd, xs, r); break;
          case 3: dot_row<T, 3>(wr, nblocks, bb, xq, xd, xs, r); break;
          default: dot_row<T, 4>(wr, nblocks, bb, xq, xd, xs, r); break;
        }
        const float bv = bias ? bias[n] : 0.0f;
        for (int i = 0; i < mt; i++) out[(m0 + i) * N + n] = r[i] + bv;
      }
    }
  });
}
#endif

// out [M, N] (float or bf16) = x [M, K] @ W.T + bias.
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "out must be a contiguous [M, N] tensor");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be float or bf16");
  const float* b_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float [N] tensor");
    b_ptr = bias->data_ptr<float>();
  }
  if (M == 0) return;
  const int64_t G = K / 32;
  // Quantized activations (thread-local scratch: no allocation per call at batch 1).
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> ds, f32out;
  q.resize(M * K);
  ds.resize(2 * M * G);
  // Raw pointers: inside the parallel regions a thread_local name would mean the worker's own copy.
  int8_t* qp = q.data();
  float* d = ds.data();
  float* s = ds.data() + M * G;
  AT_DISPATCH_SWITCH(x.scalar_type(), "gguf_linear",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++)
          quantize_act(x.data_ptr<float>() + r * x.stride(0), K, qp + r * K, d + r * G, s + r * G);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++)
          quantize_act(x.data_ptr<bf16>() + r * x.stride(0), K, qp + r * K, d + r * G, s + r * G);
      });
    }));
  float* o;
  if (out.scalar_type() == at::kFloat) {
    o = out.data_ptr<float>();
  } else {
    f32out.resize(M * N);
    o = f32out.data();
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  const int t = static_cast<int>(qtype);
  bool done = false;
#if TLQ_AVX2
  if (!g_force_scalar) {
    done = true;
    switch (t) {
      case kQ8_0: linear_avx2<kQ8_0>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ4_0: linear_avx2<kQ4_0>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ4_1: linear_avx2<kQ4_1>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ5_0: linear_avx2<kQ5_0>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ5_1: linear_avx2<kQ5_1>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ2_K: linear_avx2<kQ2_K>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ3_K: linear_avx2<kQ3_K>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ4_K: linear_avx2<kQ4_K>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ5_K: linear_avx2<kQ5_K>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      case kQ6_K: linear_avx2<kQ6_K>(qp, d, s, M, K, wp, N, rb, b_ptr, o); break;
      default: done = false;
    }
  }
#endif
  if (!done) {
    at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
      std::vector<float> buf(256);
      for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
          dot_row_scalar(t, wp + n * rb, K, qp + m * K, d + m * G, o + m * N + n, buf.data());
          if (b_ptr) o[m * N + n] += b_ptr[n];
        }
    });
  }
  if (out.scalar_type() == at::kBFloat16) {
    bf16* ob = out.data_ptr<bf16>();
    at::parallel_for(0, M * N, 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; i++) store(ob + i, o[i]);
    });
  }
}

template <typename T>
void dequant_rows(const uint8_t* w, int t, int64_t row_bytes, int64_t K, const int64_t* rows, int64_t R, T* out) {
  const TypeInfo ti = type_info(t);
  const int64_t nb = K / ti.block_elems;
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    float buf[256];
    for (int64_t r = r0; r < r1; r++) {
      const uint8_t* src = w + (rows ? rows[r] : r) * row_bytes;
      T* dst = out + r * K;
      for (int64_t b = 0; b < nb; b++) {
        dequant_block(t, src + b * ti.block_bytes, buf);
        for (int e = 0; e < ti.block_elems; e++) store(dst + b * ti.block_elems + e, buf[e]);
      }
    }
  });
}

// out [N, K] float / bf16 = the dequantized weight.
void gguf_dequantize(at::Tensor out, const at::Tensor& w, int64_t qtype) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == w.size(0), "out must be contiguous [N, K]");
  check_weight(w, qtype, out.size(1));
  const int t = static_cast<int>(qtype);
  if (out.scalar_type() == at::kFloat)
    dequant_rows(w.data_ptr<uint8_t>(), t, w.size(1), out.size(1), nullptr, out.size(0), out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16)
    dequant_rows(w.data_ptr<uint8_t>(), t, w.size(1), out.size(1), nullptr, out.size(0), out.data_ptr<bf16>());
  else
    TORCH_CHECK(false, "out must be float or bf16");
}

// out [R, K] = rows `ids` (int64 [R]) of the dequantized weight.
void gguf_embedding(at::Tensor out, const at::Tensor& w, int64_t qtype, const at::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be int64 [R]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0), "out must be contiguous [R, K]");
  check_weight(w, qtype, out.size(1));
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); i++)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < w.size(0), "token id ", idp[i], " out of range [0, ", w.size(0), ")");
  const int t = static_cast<int>(qtype);
  if (out.scalar_type() == at::kFloat)
    dequant_rows(w.data_ptr<uint8_t>(), t, w.size(1), out.size(1), idp, ids.size(0), out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16)
    dequant_rows(w.data_ptr<uint8_t>(), t, w.size(1), out.size(1), idp, ids.size(0), out.data_ptr<bf16>());
  else
    TORCH_CHECK(false, "out must be float or bf16");
}

bool gguf_type_supported(int64_t qtype) {
  switch (static_cast<int>(qtype)) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1:
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K:
      return true;
    default:
      return false;
  }
}

bool has_avx2() { return TLQ_AVX2; }
void set_force_scalar(bool on) { g_force_scalar = on; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_linear", &gguf_linear);
  m.def("gguf_dequantize", &gguf_dequantize);
  m.def("gguf_embedding", &gguf_embedding);
  m.def("gguf_type_supported", &gguf_type_supported);
  m.def("has_avx2", &has_avx2);
  m.def("set_force_scalar", &set_force_scalar);
}
