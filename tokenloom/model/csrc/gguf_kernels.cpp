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
#include <omp.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TLQ_AVX2 1
#else
#define TLQ_AVX2 0
#endif
// VNNI (AVX512-VNNI on 256-bit registers, or AVX-VNNI): vpdpbusd in the integer dot products.
#if TLQ_AVX2 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define TLQ_VNNI 1
#else
#define TLQ_VNNI 0
#endif

namespace {

using bf16 = c10::BFloat16;

// GGML type ids (gguf.GGMLQuantizationType).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

bool g_force_scalar = false;  // tests hold the SIMD path to the plain one

// ------------------------------------------------------------------------------ per-type traits
// One row per GGML type, as ggml's type_traits_cpu[]: the block's geometry, its 8-row tile's (0: the
// type has no 8-row layout) and the SIMD kernels that run it, registered once in kTypeTraits. The
// dispatchers (run_quantized_range, run_packed_range, gguf_gemm_packed) look the type up here; a
// null kernel, or g_force_scalar, means the plain C++ loop. dequant_block is the one plain
// dequantizer of every type (the oracle the tests hold the kernels to).
struct QAct;
// Rows [n0, n1) of out = x @ W.T + bias, W in raw blocks (row_bytes per row).
using RowKernel = void (*)(const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                           int64_t ldo, int64_t n0, int64_t n1);
// 8-row tiles [t0, t1) of out = x @ W.T + bias, W in the 8-row layout.
using TileKernel = void (*)(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                            int64_t t1);

struct TypeTraits {
  int type;
  int block_elems;
  int block_bytes;
  int tile_bytes;  // one 8-row tile group (8 rows x tile_elems columns), 0 without an 8-row layout
  int tile_elems;
  RowKernel rows;   // any batch over raw blocks
  TileKernel tile;  // a few activation rows over 8-row tiles: decode, speculative verification
  TileKernel gemm;  // prefill-sized batches over 8-row tiles
};

// The kernels, defined with the AVX2 code below.
template <int T>
void row_kernel(const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo,
                int64_t n0, int64_t n1);
template <int T>
void linear_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                         int64_t t1);
template <int T>
void gemm_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                       int64_t t1);

#if TLQ_AVX2
#define TLQ_SIMD(kernel) &kernel
#else
#define TLQ_SIMD(kernel) nullptr
#endif
#define TLQ_TILED(T) TLQ_SIMD(row_kernel<T>), TLQ_SIMD(linear_packed_range<T>), TLQ_SIMD(gemm_packed_range<T>)
#define TLQ_ROWS_ONLY(T) TLQ_SIMD(row_kernel<T>), nullptr, nullptr

// Tile bytes: d[8] f16 (and m[8] / dmin[8]), then the quants; Q4_K's six-bit scales and mins
// unpacked to bytes (1,184 per 8 x 144), see "8-row interleaved layouts" below.
constexpr TypeTraits kTypeTraits[] = {
    {kQ4_0, 32, 18, 144, 32, TLQ_TILED(kQ4_0)},
    {kQ4_1, 32, 20, 160, 32, TLQ_TILED(kQ4_1)},
    {kQ5_0, 32, 22, 176, 32, TLQ_TILED(kQ5_0)},
    {kQ5_1, 32, 24, 192, 32, TLQ_TILED(kQ5_1)},
    {kQ8_0, 32, 34, 272, 32, TLQ_TILED(kQ8_0)},
    {kQ2_K, 256, 84, 0, 256, TLQ_ROWS_ONLY(kQ2_K)},
    {kQ3_K, 256, 110, 0, 256, TLQ_ROWS_ONLY(kQ3_K)},
    {kQ4_K, 256, 144, 1184, 256, TLQ_TILED(kQ4_K)},
    {kQ5_K, 256, 176, 0, 256, TLQ_ROWS_ONLY(kQ5_K)},
    {kQ6_K, 256, 210, 1680, 256, TLQ_TILED(kQ6_K)},
};
#undef TLQ_ROWS_ONLY
#undef TLQ_TILED
#undef TLQ_SIMD

constexpr const TypeTraits* find_traits(int t) {
  for (const TypeTraits& tr : kTypeTraits)
    if (tr.type == t) return &tr;
  return nullptr;
}

// The traits of type t; a type without kernels is refused with the error the Python side expects.
const TypeTraits& traits(int t) {
  const TypeTraits* tr = find_traits(t);
  TORCH_CHECK(tr != nullptr, "GGML type ", t, " has no tokenloom kernel");
  return *tr;
}

inline float h2f(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if TLQ_AVX2
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is ~10 per scale
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
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
  const TypeTraits& tr = traits(t);
  return {tr.block_elems, tr.block_bytes};
}

// ------------------------------------------------------------------------ activation quantization
// Groups of 32: q = round(x / d), d = max|x| / 127, s = d * sum(q); bs = the integer sums of q per
// 16 (what ggml's block_q8_K calls bsums): the Q6_K tile kernel takes its quants unsigned and
// subtracts 32 * bs, instead of sign-flipping every weight vector.

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }

#if TLQ_AVX2
// One group of 32 floats, quantize_act's arithmetic eight lanes at a time: the same amax, d and
// id, and vcvtps2dq rounds in the current mode as nearbyint does, so the bytes are identical. The
// decode step quantizes every linear's input (~4 per layer); the scalar loop was ~1 us of a
// single-threaded phase per call at SmolLM2's widths.
inline void quantize_group_avx2(const float* x, int8_t* q, float* d, float* s, int16_t* bs) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float dg = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i i[4];
  for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
  // Per 16: (lo, hi) reduced side by side in the two halves of one 128-bit vector.
  const __m256i lo = _mm256_add_epi32(i[0], i[1]), hi = _mm256_add_epi32(i[2], i[3]);
  const __m128i lo4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i hi4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  __m128i p = _mm_hadd_epi32(lo4, hi4);  // lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3
  p = _mm_hadd_epi32(p, p);              // lo, hi, lo, hi
  bs[0] = static_cast<int16_t>(_mm_cvtsi128_si32(p));
  bs[1] = static_cast<int16_t>(_mm_extract_epi32(p, 1));
  const int sum = bs[0] + bs[1];
  // packs work within 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7 of the wanted order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = dg;
  *s = dg * static_cast<float>(sum);
}
#endif

template <typename T>
void quantize_act(const T* x, int64_t K, int8_t* q, float* d, float* s, int16_t* bs) {
#if TLQ_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (!g_force_scalar) {
      for (int64_t g = 0; g < K / 32; g++) quantize_group_avx2(x + 32 * g, q + 32 * g, d + g, s + g, bs + 2 * g);
      return;
    }
  }
#endif
  for (int64_t g = 0; g < K / 32; g++) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; j++) {
      v[j] = to_f(x[32 * g + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    const float dg = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int half[2] = {0, 0};
    for (int j = 0; j < 32; j++) {
      const int qi = static_cast<int>(std::nearbyint(v[j] * id));
      q[32 * g + j] = static_cast<int8_t>(qi);
      half[j / 16] += qi;
    }
    d[g] = dg;
    s[g] = dg * static_cast<float>(half[0] + half[1]);
    bs[2 * g] = static_cast<int16_t>(half[0]);
    bs[2 * g + 1] = static_cast<int16_t>(half[1]);
  }
}

#if TLQ_AVX2
// ------------------------------------------------------------------------------------ AVX2 groups

// VNNI (AVX512-VNNI on 256-bit registers, or AVX-VNNI): one vpdpbusd does what vpmaddubsw +
// vpmaddwd + vpaddd do on AVX2 (four u8 x s8 products summed into each int32 lane), without the
// int16 intermediate. Every product sum below stays inside int16 on the AVX2 path (the bounds are
// noted where they are summed), so both paths give the same integers.
//
// acc + per int32 lane the sum of four u8 (u) x s8 (s) products.
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if TLQ_VNNI && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif TLQ_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

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

// NR weight rows against MT activation rows: out[r * MT + m]. NR * MT independent accumulators keep
// the float adds of consecutive groups from waiting on each other (a batch-1 GEMV takes 4 rows at
// once: one dependency chain per group would cost the fmadd latency, ~4 cycles, every group).
template <int T, int NR, int MT>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nblocks, int64_t bb, const int8_t* const* xq,
                     const float* const* xd, const float* const* xs, float* out) {
  __m256 acc[NR][MT];
  float sacc[NR][MT];
  for (int r = 0; r < NR; r++)
    for (int m = 0; m < MT; m++) {
      acc[r][m] = _mm256_setzero_ps();
      sacc[r][m] = 0.0f;
    }
  const __m256i one = _mm256_set1_epi16(1);
  constexpr int kGroups = (T == kQ2_K || T == kQ3_K || T == kQ4_K || T == kQ5_K || T == kQ6_K) ? 8 : 1;
  for (int64_t blk = 0; blk < nblocks; blk++) {
    for (int r = 0; r < NR; r++) {
      int64_t g = blk * kGroups;  // activation group index
      groups<T>(w + r * row_bytes + blk * bb, [&](const Group& G) {
        const __m256i wa = is_signed(T) ? _mm256_sign_epi8(G.w, G.w) : G.w;
        for (int m = 0; m < MT; m++) {
          const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * g));
          const __m256i xs8 = is_signed(T) ? _mm256_sign_epi8(x, G.w) : x;
          const __m256i p32 = has_mul(T) ? _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs8), G.mul)
                                         : dpbusd(_mm256_setzero_si256(), wa, xs8);
          const float dx = xd[m][g];
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(G.a * dx), acc[r][m]);
          if constexpr (has_b(T)) sacc[r][m] += G.b * xs[m][g];
          if constexpr (T == kQ2_K) {
            const __m256i pm = _mm256_madd_epi16(_mm256_maddubs_epi16(G.mn, x), one);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_set1_ps(-G.amin * dx), acc[r][m]);
          }
        }
        g++;
      });
    }
  }
  for (int r = 0; r < NR; r++)
    for (int m = 0; m < MT; m++) out[r * MT + m] = hsum(acc[r][m]) + sacc[r][m];
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
// Rows [n0, n1) of out = x @ W.T + bias, W of GGML type T (raw blocks, row_bytes per row).
template <int T>
void linear_avx2_range(const int8_t* q, const float* d, const float* s, int64_t M, int64_t K, const uint8_t* w,
                       int64_t row_bytes, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const TypeInfo ti = type_info(T);
  const int64_t nblocks = K / ti.block_elems, bb = ti.block_bytes;
  const int64_t G = K / 32;
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
    int64_t n = n0;
    float r[16];
    auto put = [&](int nr) {
      for (int j = 0; j < nr; j++) {
        const float bv = bias ? bias[n + j] : 0.0f;
        for (int i = 0; i < mt; i++) out[(m0 + i) * ldo + n + j] = r[j * mt + i] + bv;
      }
    };
    if (mt == 1) {
      for (; n + 4 <= n1; n += 4) {
        dot_rows<T, 4, 1>(w + n * row_bytes, row_bytes, nblocks, bb, xq, xd, xs, r);
        put(4);
      }
    } else if (mt == 2) {
      for (; n + 2 <= n1; n += 2) {
        dot_rows<T, 2, 2>(w + n * row_bytes, row_bytes, nblocks, bb, xq, xd, xs, r);
        put(2);
      }
    } else if (mt == 4) {
      for (; n + 2 <= n1; n += 2) {
        dot_rows<T, 2, 4>(w + n * row_bytes, row_bytes, nblocks, bb, xq, xd, xs, r);
        put(2);
      }
    }
    for (; n < n1; n++) {
      const uint8_t* wr = w + n * row_bytes;
      switch (mt) {
        case 1: dot_rows<T, 1, 1>(wr, row_bytes, nblocks, bb, xq, xd, xs, r); break;
        case 2: dot_rows<T, 1, 2>(wr, row_bytes, nblocks, bb, xq, xd, xs, r); break;
        case 3: dot_rows<T, 1, 3>(wr, row_bytes, nblocks, bb, xq, xd, xs, r); break;
        default: dot_rows<T, 1, 4>(wr, row_bytes, nblocks, bb, xq, xd, xs, r); break;
      }
      put(1);
    }
  }
}

#endif

// Activations quantized for the kernels: rows of int8 with per-32 d and s, per-16 bs (see quantize_act).
struct QAct {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bs;
  int64_t M = 0, K = 0;

  // Sizes the buffers for [M_, K_] without quantizing (the decoder then fills them group by group).
  void shape(int64_t M_, int64_t K_) {
    M = M_;
    K = K_;
    q.resize(M * K);
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    bs.resize(M * K / 16);
  }

  // Quantizes groups [g0, g1) of the flattened [M, K / 32] groups of x (rows ldx apart).
  void quantize_groups(const float* x, int64_t ldx, int64_t g0, int64_t g1) {
    const int64_t G = K / 32;
    for (int64_t i = g0; i < g1; i++) {
      const int64_t m = i / G, g = i % G;
      quantize_act(x + m * ldx + 32 * g, 32, q.data() + m * K + 32 * g, d.data() + i, s.data() + i, bs.data() + 2 * i);
    }
  }

  template <typename T>
  void set(const T* x, int64_t M_, int64_t K_, int64_t ldx) {
    M = M_;
    K = K_;
    const int64_t G = K / 32;
    q.resize(M * K);
    d.resize(M * G);
    s.resize(M * G);
    bs.resize(M * 2 * G);
    int8_t* qp = q.data();
    float* dp = d.data();
    float* sp = s.data();
    int16_t* bp = bs.data();
    if (M == 1) {
      quantize_act(x, K, qp, dp, sp, bp);
      return;
    }
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++) quantize_act(x + r * ldx, K, qp + r * K, dp + r * G, sp + r * G, bp + r * 2 * G);
    });
  }
};

// ------------------------------------------------------------------- 8-row interleaved layouts
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights repacked at load, eight rows at a time (the idea of ggml's
// "repack" CPU buffers, in our own layout). Per tile of 8 rows and group g of 32 columns:
//   Q4_0 / Q4_1:  d[8] f16 (Q4_1: then m[8] f16), then 4 x 32 bytes: vector j, byte 4r + i holds
//                 w[r][8j + i] (low nibble) and w[r][8j + 4 + i] (high nibble)
//   Q5_0 / Q5_1:  as Q4_0 / Q4_1 for the low four bits, then 32 bytes of fifth bits: byte 4r + i,
//                 bit 2j = fifth bit of w[r][8j + i], bit 2j + 1 = that of w[r][8j + 4 + i] (so the
//                 kernel's nibble vector v takes bit v of every byte)
//   Q8_0:         d[8] f16, then 8 x 32 bytes: vector j, byte 4r + i = w[r][4j + i]
// Same bytes as the file. The kernel then gets row r's partial dot product in lane r of the
// accumulator: four activation bytes are broadcast to every lane, one vpmaddubsw + add per 4
// columns for all eight rows, and the eight scales load as one vector (vcvtph2ps). About a third of
// the instructions of the row-at-a-time kernel.

// Bytes of one tile group: 8 rows x 32 columns, or 8 rows x 256 columns (one super-block) for the
// K-quants.
constexpr int packed_tile_bytes(int t) { return find_traits(t) ? find_traits(t)->tile_bytes : 0; }
constexpr int packed_group_elems(int t) { return find_traits(t) ? find_traits(t)->tile_elems : 32; }
inline int64_t packed_row_bytes(int t, int64_t K) { return K / packed_group_elems(t) * packed_tile_bytes(t); }
constexpr bool packed_has_min(int t) { return t == kQ4_1 || t == kQ5_1; }
constexpr bool packed_five_bit(int t) { return t == kQ5_0 || t == kQ5_1; }
constexpr int packed_nibble_offset(int t) { return packed_has_min(t) ? 32 : 16; }  // after d[8] (and m[8])

// Q4_K / Q6_K tiles, per super-block of 8 rows x 256 columns (then, per group g of 32 columns, the
// quants in the Q4 lane layout above):
//   Q4_K:  d[8] f16, dmin[8] f16, scale[g][r] u8 (64), min[g][r] u8 (64), then 8 x 128 bytes of nibbles
//          (the six-bit scales and mins unpacked to bytes: 1184 bytes against the file's 1152)
//   Q6_K:  d[8] f16, scale[s][r] i8 (16 sub-blocks of 16, 128 bytes), then per group 128 bytes of low
//          nibbles and 2 x 32 bytes of high bit pairs: byte 4r + i of the first holds, in bits 2v and
//          2v + 1, the high pair of nibble vector v (v = 0..3), the second of v = 4..7 (same bytes
//          as the file)
constexpr int kK4Scales = 32, kK4Mins = 96, kK4Quants = 160;
constexpr int kK6Scales = 16, kK6Groups = 144, kK6GroupBytes = 192;

// Offset of the quants in an ordinary block of a 4/5-bit type, and its fifth bits (Q5 only).
constexpr int block_qs_offset(int t) { return t == kQ4_0 ? 2 : t == kQ4_1 ? 4 : t == kQ5_0 ? 6 : 8; }
constexpr int block_qh_offset(int t) { return t == kQ5_0 ? 2 : 4; }

bool packable(int64_t qtype) { return packed_tile_bytes(static_cast<int>(qtype)) > 0; }

// Four 4-bit values per row r in the Q4 lane layout: vector j, byte 4r + i = q[8j + i] | q[8j + 4 + i] << 4.
inline void put_nibbles(const int* q, int r, uint8_t* v) {
  for (int j = 0; j < 4; j++)
    for (int i = 0; i < 4; i++) v[32 * j + 4 * r + i] = static_cast<uint8_t>((q[8 * j + i] & 15) | ((q[8 * j + 4 + i] & 15) << 4));
}

// Row r's Q4_K / Q6_K block into its super-block tile o.
void repack_k_block(int t, const uint8_t* blk, int r, uint8_t* o) {
  if (t == kQ4_K) {
    std::memcpy(o + 2 * r, blk, 2);           // d
    std::memcpy(o + 16 + 2 * r, blk + 2, 2);  // dmin
    int sc[8], mn[8];
    k4_scales(blk + 4, sc, mn);
    for (int g = 0; g < 8; g++) {
      o[kK4Scales + 8 * g + r] = static_cast<uint8_t>(sc[g]);
      o[kK4Mins + 8 * g + r] = static_cast<uint8_t>(mn[g]);
      const uint8_t* qs = blk + 16 + 32 * (g / 2);
      int q[32];
      for (int l = 0; l < 32; l++) q[l] = g % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4;
      put_nibbles(q, r, o + kK4Quants + 128 * g);
    }
    return;
  }
  // Q6_K: element e of the block as dequant_block reads it (ql, qh, 16 int8 scales, d last).
  std::memcpy(o + 2 * r, blk + 208, 2);
  for (int sb = 0; sb < 16; sb++) o[kK6Scales + 8 * sb + r] = blk[192 + sb];
  int q[256];
  for (int h = 0; h < 2; h++)
    for (int l = 0; l < 32; l++) {
      const uint8_t* L = blk + 64 * h;
      const uint8_t H = blk[128 + 32 * h + l];
      q[128 * h + l] = (L[l] & 0x0F) | ((H & 3) << 4);
      q[128 * h + l + 32] = (L[l + 32] & 0x0F) | (((H >> 2) & 3) << 4);
      q[128 * h + l + 64] = (L[l] >> 4) | (((H >> 4) & 3) << 4);
      q[128 * h + l + 96] = (L[l + 32] >> 4) | (((H >> 6) & 3) << 4);
    }
  for (int g = 0; g < 8; g++) {
    uint8_t* v = o + kK6Groups + kK6GroupBytes * g;
    const int* qg = q + 32 * g;
    put_nibbles(qg, r, v);
    for (int i = 0; i < 4; i++) {
      uint8_t h0 = 0, h1 = 0;
      for (int vv = 0; vv < 4; vv++) {  // nibble vector vv holds elements 4 vv + i (see put_nibbles)
        h0 |= static_cast<uint8_t>(((qg[4 * vv + i] >> 4) & 3) << (2 * vv));
        h1 |= static_cast<uint8_t>(((qg[16 + 4 * vv + i] >> 4) & 3) << (2 * vv));
      }
      v[128 + 4 * r + i] = h0;
      v[160 + 4 * r + i] = h1;
    }
  }
}

// w [N, row_bytes] (N % 8 == 0) -> [N / 8, G * tile_bytes].
at::Tensor gguf_repack8(const at::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int t = static_cast<int>(qtype);
  TORCH_CHECK(packable(t), "GGML type ", t, " has no 8-row layout");
  const int64_t N = w.size(0), G = K / packed_group_elems(t), rb = w.size(1), TB = packed_tile_bytes(t);
  TORCH_CHECK(N % 8 == 0, "repacking needs a multiple of 8 rows");
  at::Tensor out = at::empty({N / 8, G * TB}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int bb = type_info(t).block_bytes;
  if (t == kQ4_K || t == kQ6_K) {
    at::parallel_for(0, N / 8, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t tile = t0; tile < t1; tile++)
        for (int64_t g = 0; g < G; g++)
          for (int r = 0; r < 8; r++) repack_k_block(t, src + (tile * 8 + r) * rb + g * bb, r, dst + (tile * G + g) * TB);
    });
    return out;
  }
  at::parallel_for(0, N / 8, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; tile++)
      for (int64_t g = 0; g < G; g++) {
        uint8_t* o = dst + (tile * G + g) * TB;
        for (int r = 0; r < 8; r++) {
          const uint8_t* blk = src + (tile * 8 + r) * rb + g * bb;
          std::memcpy(o + 2 * r, blk, 2);                                  // d
          if (packed_has_min(t)) std::memcpy(o + 16 + 2 * r, blk + 2, 2);  // m
          if (t == kQ8_0) {
            for (int j = 0; j < 8; j++)
              for (int i = 0; i < 4; i++) o[16 + 32 * j + 4 * r + i] = blk[2 + 4 * j + i];
          } else {
            int q[32];
            nibbles32(blk + block_qs_offset(t), q);
            uint8_t* v = o + packed_nibble_offset(t);
            for (int j = 0; j < 4; j++)
              for (int i = 0; i < 4; i++)
                v[32 * j + 4 * r + i] = static_cast<uint8_t>(q[8 * j + i] | (q[8 * j + 4 + i] << 4));
            if (packed_five_bit(t)) {
              const uint32_t qh = u32(blk + block_qh_offset(t));
              uint8_t* h = v + 128;
              for (int i = 0; i < 4; i++) {
                uint8_t bits = 0;
                for (int j = 0; j < 4; j++)
                  bits |= static_cast<uint8_t>((((qh >> (8 * j + i)) & 1) << (2 * j)) |
                                               (((qh >> (8 * j + 4 + i)) & 1) << (2 * j + 1)));
                h[4 * r + i] = bits;
              }
            }
          }
        }
      }
  });
  return out;
}

#if TLQ_AVX2
inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

constexpr int kPrefetchGroups = 8;
// Q4_K / Q6_K: super-block tiles (1,184 / 1,680 bytes) ahead.
#ifndef TLQ_PREFETCH_TILES_K
#define TLQ_PREFETCH_TILES_K 1
#endif
constexpr int kPrefetchTilesK = TLQ_PREFETCH_TILES_K;

// The 8 nibble vectors of 128 bytes in the Q4 lane layout: w[v] holds elements 4v..4v+3 of each row.
inline void load_nibbles(const uint8_t* v, __m256i* w) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; j++) {
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * j));
    w[2 * j] = _mm256_and_si256(n, lo4);
    w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(n, 4), lo4);
  }
}

// Per row (int32 lane r): sum over the group's 32 columns of 4-bit quants w times int8 x. The int16
// sums of eight vpmaddubsw results stay below 8 * 2 * 15 * 127 = 30480.
inline __m256i dot_u4(const __m256i* w, const int8_t* x) {
#if TLQ_VNNI
  // Two chains: vpdpbusd's latency (~5 cycles) would otherwise serialize the eight.
  __m256i s0 = dpbusd(_mm256_setzero_si256(), w[0], bcast4(x));
  __m256i s1 = dpbusd(_mm256_setzero_si256(), w[1], bcast4(x + 4));
  for (int j = 2; j < 8; j += 2) {
    s0 = dpbusd(s0, w[j], bcast4(x + 4 * j));
    s1 = dpbusd(s1, w[j + 1], bcast4(x + 4 * j + 4));
  }
  return _mm256_add_epi32(s0, s1);
#else
  __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(x));
  for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
  return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}

template <int T, int MT>
inline void packed_tile(const uint8_t* tile, int64_t G, const int8_t* const* xq, const float* const* xd,
                        const float* const* xs, __m256* res) {
  constexpr int TB = packed_tile_bytes(T);
  __m256 acc[MT], accb[MT];
  for (int m = 0; m < MT; m++) acc[m] = accb[m] = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* p = tile + g * TB;
    // Weights stream from memory once per step: ask for the group kPrefetchGroups ahead (the
    // hardware prefetcher alone left the batch-1 decode step at half the memory bandwidth).
    for (int o = 0; o < TB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchGroups * TB + o), _MM_HINT_T0);
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (T == kQ8_0 && MT == 1) {
      // Batch 1: each weight vector loaded and used once, two integer chains, and the float sums of
      // even and odd groups in acc / accb (two fmadd chains): 2-3 % over the generic form below in a
      // stand-alone stream of 117 MB, which is within ~10 % of a plain read of the same bytes.
      const int8_t* x = xq[0] + 32 * g;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int j = 0; j < 8; j += 2) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * j));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 48 + 32 * j));
        s0 = dpbusd(s0, _mm256_sign_epi8(w0, w0), _mm256_sign_epi8(bcast4(x + 4 * j), w0));
        s1 = dpbusd(s1, _mm256_sign_epi8(w1, w1), _mm256_sign_epi8(bcast4(x + 4 * j + 4), w1));
      }
      const __m256 sum = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)), sc = _mm256_mul_ps(dv, _mm256_set1_ps(xd[0][g]));
      if (g & 1)
        accb[0] = _mm256_fmadd_ps(sum, sc, accb[0]);
      else
        acc[0] = _mm256_fmadd_ps(sum, sc, acc[0]);
    } else if constexpr (T == kQ8_0) {
      __m256i w[8], wa[8];
      for (int j = 0; j < 8; j++) {
        w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * j));
        wa[j] = _mm256_sign_epi8(w[j], w[j]);
      }
      for (int m = 0; m < MT; m++) {
        const int8_t* x = xq[m] + 32 * g;
        __m256i s0 = dpbusd(_mm256_setzero_si256(), wa[0], _mm256_sign_epi8(bcast4(x), w[0]));
        __m256i s1 = dpbusd(_mm256_setzero_si256(), wa[1], _mm256_sign_epi8(bcast4(x + 4), w[1]));
        for (int j = 2; j < 8; j += 2) {
          s0 = dpbusd(s0, wa[j], _mm256_sign_epi8(bcast4(x + 4 * j), w[j]));
          s1 = dpbusd(s1, wa[j + 1], _mm256_sign_epi8(bcast4(x + 4 * j + 4), w[j + 1]));
        }
        const __m256i sum = _mm256_add_epi32(s0, s1);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dv, _mm256_set1_ps(xd[m][g])), acc[m]);
      }
    } else {
      constexpr int off = packed_nibble_offset(T);
      constexpr bool five = packed_five_bit(T);
      __m256i w[8];
      load_nibbles(p + off, w);
      if constexpr (five) {  // vector v's fifth bits are bit v of each byte: move it to bit 4
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off + 128));
        const __m256i b4 = _mm256_set1_epi8(0x10);
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), b4));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), b4));
        w[4] = _mm256_or_si256(w[4], _mm256_and_si256(h, b4));
        w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), b4));
        w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), b4));
        w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), b4));
      }
      // With a min (Q4_1, Q5_1): + m * s_x; without, the quants are offset by 8 (Q4_0) or 16
      // (Q5_0): - 8 d * s_x or - 16 d * s_x.
      const __m256 bv = packed_has_min(T)
                            ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))
                            : _mm256_mul_ps(dv, _mm256_set1_ps(five ? -16.0f : -8.0f));
      for (int m = 0; m < MT; m++) {
        const int8_t* x = xq[m] + 32 * g;
        __m256i sum;
        if constexpr (five && TLQ_VNNI) {
          sum = dot_u4(w, x);
        } else if constexpr (five) {
          // Four vpmaddubsw results of 5-bit quants stay below 4 * 2 * 31 * 127 = 31496 in int16.
          __m256i lo = _mm256_maddubs_epi16(w[0], bcast4(x)), hi = _mm256_maddubs_epi16(w[4], bcast4(x + 16));
          for (int j = 1; j < 4; j++) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[4 + j], bcast4(x + 16 + 4 * j)));
          }
          sum = _mm256_add_epi32(_mm256_madd_epi16(lo, one), _mm256_madd_epi16(hi, one));
        } else {
          sum = dot_u4(w, x);
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dv, _mm256_set1_ps(xd[m][g])), acc[m]);
        accb[m] = _mm256_fmadd_ps(bv, _mm256_set1_ps(xs[m][g]), accb[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) res[m] = _mm256_add_ps(acc[m], accb[m]);
}

// Q4_K / Q6_K over their super-block tiles (NS super-blocks of 256 columns): out lanes = the 8 rows.
//
// As ggml's Q4_K x Q8_K dot, a group's integer sum is scaled by the row's integer sub-block scale in
// int32 on AVX2 (vpmaddwd with the scale as the multiplier instead of ones; with VNNI the scale is a
// float, vpmulld measured 2 % slower at four rows), and the
// super-block's d / dmin multiply once per 256 columns: per group and activation row one int ->
// float conversion and one FMA with the activation's per-32 scale remain (ggml has none, its
// activations carrying one scale per 256; ours keep one per 32, see docs/performance.md "Greedy
// agreement with llama.cpp"). Q6_K takes its quants unsigned (0..63) and subtracts 32 * (the
// activation's per-16 sum) per sub-block, instead of sign-flipping all eight vectors of a group
// and its activations per row. Both give exactly the integers the sign-trick form gave: the
// products isum * scale stay below 2^24 (Q4_K: 32 * 15 * 127 * 63; Q6_K: 2 * 16 * 32 * 127 * 128),
// so even their float conversion is exact.
template <int T, int MT>
inline void packed_tile_k(const uint8_t* tile, int64_t NS, const int8_t* const* xq, const float* const* xd,
                          const float* const* xs, const int16_t* const* xb, __m256* res) {
  constexpr int TB = packed_tile_bytes(T);
  __m256 acc[MT], accb[MT];
  for (int m = 0; m < MT; m++) acc[m] = accb[m] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < NS; sb++) {
    const uint8_t* p = tile + sb * TB;
    for (int o = 0; o < TB; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchTilesK * TB + o), _MM_HINT_T0);
    __m256 sacc[MT], macc[MT];  // this super-block's sums before d (and, Q4_K, before dmin)
    for (int m = 0; m < MT; m++) sacc[m] = macc[m] = _mm256_setzero_ps();
    if constexpr (T == kQ4_K) {
      for (int g = 0; g < 8; g++) {
        const int64_t gi = 8 * sb + g;  // activation group
        auto bytes8 = [&](int off) {
          return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + off + 8 * g)));
        };
        const __m256i sc = bytes8(kK4Scales);
        const __m256 mn = _mm256_cvtepi32_ps(bytes8(kK4Mins));
#if TLQ_VNNI
        const __m256 scf = _mm256_cvtepi32_ps(sc);  // vpmulld per row would cost two uops where this is one
#else
        const __m256i sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));  // the scale in both int16 halves
#endif
        __m256i w[8];
        load_nibbles(p + kK4Quants + 128 * g, w);
        for (int m = 0; m < MT; m++) {
          const int8_t* x = xq[m] + 32 * gi;
#if TLQ_VNNI
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u4(w, x)), _mm256_mul_ps(scf, _mm256_set1_ps(xd[m][gi])),
                                    sacc[m]);
#else
          // int16 sums of eight vpmaddubsw stay below 8 * 2 * 15 * 127 = 30480 (see dot_u4).
          __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(x));
          for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
          const __m256i isum = _mm256_madd_epi16(s16, sc16);
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(xd[m][gi]), sacc[m]);
#endif
          macc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xs[m][gi]), macc[m]);
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      for (int m = 0; m < MT; m++) {
        acc[m] = _mm256_fmadd_ps(sacc[m], dv, acc[m]);
        accb[m] = _mm256_fnmadd_ps(macc[m], mv, accb[m]);  // - dmin * sum(min * s_x)
      }
    } else {  // Q6_K: quants q in 0..63 (the value is q - 32), two scales per group (16 columns each)
      const __m256i m3 = _mm256_set1_epi8(0x30);
      for (int g = 0; g < 8; g++) {
        const int64_t gi = 8 * sb + g;
        const uint8_t* v = p + kK6Groups + kK6GroupBytes * g;
        auto scale8 = [&](int sub) {
          return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK6Scales + 8 * sub)));
        };
        const __m256i sc_lo = scale8(2 * g), sc_hi = scale8(2 * g + 1);
        const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 128));
        const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 160));
        __m256i w[8];
        load_nibbles(v, w);
        // High pair of vector vv at bits 2 vv: moved to bits 4-5.
        w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h0, 4), m3));
        w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h0, 2), m3));
        w[2] = _mm256_or_si256(w[2], _mm256_and_si256(h0, m3));
        w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(h0, 2), m3));
        w[4] = _mm256_or_si256(w[4], _mm256_and_si256(_mm256_slli_epi16(h1, 4), m3));
        w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_slli_epi16(h1, 2), m3));
        w[6] = _mm256_or_si256(w[6], _mm256_and_si256(h1, m3));
        w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h1, 2), m3));
#if !TLQ_VNNI
        // The signed scale in both int16 halves of its lane (a blend: an OR would keep the sign bits).
        const __m256i sc16_lo = _mm256_blend_epi16(sc_lo, _mm256_slli_epi32(sc_lo, 16), 0xAA);
        const __m256i sc16_hi = _mm256_blend_epi16(sc_hi, _mm256_slli_epi32(sc_hi, 16), 0xAA);
#endif
        for (int m = 0; m < MT; m++) {
          const int8_t* x = xq[m] + 32 * gi;
          const int bs_lo = xb[m][2 * gi], bs_hi = xb[m][2 * gi + 1];
#if TLQ_VNNI
          __m256i lo = dpbusd(_mm256_setzero_si256(), w[0], bcast4(x));
          __m256i hi = dpbusd(_mm256_setzero_si256(), w[4], bcast4(x + 16));
          for (int j = 1; j < 4; j++) {
            lo = dpbusd(lo, w[j], bcast4(x + 4 * j));
            hi = dpbusd(hi, w[4 + j], bcast4(x + 16 + 4 * j));
          }
          lo = _mm256_mullo_epi32(_mm256_sub_epi32(lo, _mm256_set1_epi32(32 * bs_lo)), sc_lo);
          hi = _mm256_mullo_epi32(_mm256_sub_epi32(hi, _mm256_set1_epi32(32 * bs_hi)), sc_hi);
#else
          // Two u8 (<= 63) x s8 products per int16 lane, two such summed: <= 4 * 63 * 127 = 32004.
          auto pair = [&](int j) {
            return _mm256_add_epi16(_mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)),
                                    _mm256_maddubs_epi16(w[j + 1], bcast4(x + 4 * j + 4)));
          };
          // sc * sum(q x) - sc * 32 * bs: the second as vpmaddwd of sc in both halves with 16 * bs
          // (|16 * bs| <= 16 * 16 * 127 = 32512 fits int16).
          __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(pair(0), sc16_lo), _mm256_madd_epi16(pair(2), sc16_lo));
          __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(pair(4), sc16_hi), _mm256_madd_epi16(pair(6), sc16_hi));
          lo = _mm256_sub_epi32(lo, _mm256_madd_epi16(sc16_lo, _mm256_set1_epi16(static_cast<short>(16 * bs_lo))));
          hi = _mm256_sub_epi32(hi, _mm256_madd_epi16(sc16_hi, _mm256_set1_epi16(static_cast<short>(16 * bs_hi))));
#endif
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(xd[m][gi]), sacc[m]);
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      for (int m = 0; m < MT; m++) acc[m] = _mm256_fmadd_ps(sacc[m], dv, acc[m]);
    }
  }
  for (int m = 0; m < MT; m++) res[m] = _mm256_add_ps(acc[m], accb[m]);
}

template <int T>
void linear_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                         int64_t t1) {
  const int64_t M = a.M, K = a.K, G = K / 32, TB = packed_tile_bytes(T), NG = K / packed_group_elems(T);
  // Tile outer, rows inner: a tile (8 rows x K, a few KB) stays in L1 while every group of 4
  // activation rows passes over it, so a prefill-sized M reads the weights once, not M / 4 times.
  for (int64_t tile = t0; tile < t1; tile++) {
    const uint8_t* tp = pw + tile * NG * TB;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mt = static_cast<int>(std::min<int64_t>(4, M - m0));
      const int8_t* xq[4];
      const float* xd[4];
      const float* xs[4];
      const int16_t* xb[4];
      for (int i = 0; i < mt; i++) {
        xq[i] = a.q.data() + (m0 + i) * K;
        xd[i] = a.d.data() + (m0 + i) * G;
        xs[i] = a.s.data() + (m0 + i) * G;
        xb[i] = a.bs.data() + (m0 + i) * 2 * G;
      }
      __m256 r[4];
      if constexpr (packed_group_elems(T) == 256) {
        switch (mt) {
          case 1: packed_tile_k<T, 1>(tp, NG, xq, xd, xs, xb, r); break;
          case 2: packed_tile_k<T, 2>(tp, NG, xq, xd, xs, xb, r); break;
          case 3: packed_tile_k<T, 3>(tp, NG, xq, xd, xs, xb, r); break;
          default: packed_tile_k<T, 4>(tp, NG, xq, xd, xs, xb, r); break;
        }
      } else {
        switch (mt) {
          case 1: packed_tile<T, 1>(tp, NG, xq, xd, xs, r); break;
          case 2: packed_tile<T, 2>(tp, NG, xq, xd, xs, r); break;
          case 3: packed_tile<T, 3>(tp, NG, xq, xd, xs, r); break;
          default: packed_tile<T, 4>(tp, NG, xq, xd, xs, r); break;
        }
      }
      for (int i = 0; i < mt; i++) {
        float* o = out + (m0 + i) * ldo + tile * 8;
        __m256 v = r[i];
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + tile * 8));
        _mm256_storeu_ps(o, v);
      }
    }
  }
}

#endif

#if TLQ_AVX2
template <int T>
void row_kernel(const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo,
                int64_t n0, int64_t n1) {
  linear_avx2_range<T>(a.q.data(), a.d.data(), a.s.data(), a.M, a.K, w, row_bytes, bias, out, ldo, n0, n1);
}
#endif

// Rows [n0, n1) of out[m * ldo + n] = sum_k W[n, k] x[m, k] + bias[n], W of GGML type t (raw blocks,
// row_bytes per row): one thread's share (run_quantized splits the rows; the decoder splits them itself).
void run_quantized_range(int t, const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                         int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t M = a.M, K = a.K, G = K / 32;
  const RowKernel simd = traits(t).rows;
  if (simd && !g_force_scalar) return simd(a, w, row_bytes, bias, out, ldo, n0, n1);
  std::vector<float> buf(256);
  for (int64_t n = n0; n < n1; n++)
    for (int64_t m = 0; m < M; m++) {
      float* o = out + m * ldo + n;
      dot_row_scalar(t, w + n * row_bytes, K, a.q.data() + m * K, a.d.data() + m * G, o, buf.data());
      if (bias) *o += bias[n];
    }
}

// Rows in chunks that fit L1/L2 with all M activation rows; every chunk is reused by all tokens.
int64_t row_grain(int64_t N) { return std::max<int64_t>(4, std::min<int64_t>(64, N / (4 * at::get_num_threads()) + 1)); }

void run_quantized(int t, const QAct& a, const uint8_t* w, int64_t N, int64_t row_bytes, const float* bias,
                   float* out, int64_t ldo) {
  at::parallel_for(0, N, row_grain(N), [&](int64_t n0, int64_t n1) {
    run_quantized_range(t, a, w, row_bytes, bias, out, ldo, n0, n1);
  });
}

// Tile `tile` of the 8-row layout back to 8 rows of ordinary blocks: rows [8, G * block_bytes].
void unpack_tile(int t, const uint8_t* pw, int64_t tile, int64_t G, uint8_t* rows) {
  const int64_t TB = packed_tile_bytes(t);
  const int bb = type_info(t).block_bytes;
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* p = pw + (tile * G + g) * TB;
    for (int r = 0; r < 8; r++) {
      uint8_t* blk = rows + (r * G + g) * bb;
      std::memcpy(blk, p + 2 * r, 2);
      if (t == kQ8_0) {
        for (int j = 0; j < 8; j++)
          for (int i = 0; i < 4; i++) blk[2 + 4 * j + i] = p[16 + 32 * j + 4 * r + i];
      } else {
        if (packed_has_min(t)) std::memcpy(blk + 2, p + 16 + 2 * r, 2);
        const uint8_t* v = p + packed_nibble_offset(t);
        int q[32];
        uint32_t qh = 0;
        for (int j = 0; j < 4; j++)
          for (int i = 0; i < 4; i++) {
            const uint8_t b = v[32 * j + 4 * r + i];
            q[8 * j + i] = b & 0x0F;
            q[8 * j + 4 + i] = b >> 4;
            if (packed_five_bit(t)) {
              const uint8_t h = v[128 + 4 * r + i];
              qh |= static_cast<uint32_t>((h >> (2 * j)) & 1) << (8 * j + i);
              qh |= static_cast<uint32_t>((h >> (2 * j + 1)) & 1) << (8 * j + 4 + i);
            }
          }
        uint8_t* qs = blk + block_qs_offset(t);
        for (int e = 0; e < 16; e++) qs[e] = static_cast<uint8_t>(q[e] | (q[e + 16] << 4));
        if (packed_five_bit(t)) std::memcpy(blk + block_qh_offset(t), &qh, 4);
      }
    }
  }
}

// Rows of one tile of the 8-row layout, dequantized straight from it: out[r * ldo + k] (fp32). G: the
// tile's groups (super-blocks for the K-quants). The arithmetic of dequant_block.
void dequant_tile(int t, const uint8_t* pw, int64_t tile, int64_t G, float* out, int64_t ldo) {
  const int64_t TB = packed_tile_bytes(t);
  if (t == kQ4_K || t == kQ6_K) {
    for (int64_t sb = 0; sb < G; sb++) {
      const uint8_t* p = pw + (tile * G + sb) * TB;
      for (int r = 0; r < 8; r++) {
        const float d = h2f(p + 2 * r);
        float* o = out + r * ldo + 256 * sb;
        for (int g = 0; g < 8; g++) {
          const uint8_t* v = p + (t == kQ4_K ? kK4Quants + 128 * g : kK6Groups + kK6GroupBytes * g);
          for (int e = 0; e < 32; e++) {
            const int vv = e / 4, i = e % 4;  // nibble vector vv, byte 4r + i
            const uint8_t b = v[32 * (vv / 2) + 4 * r + i];
            int q = vv % 2 == 0 ? b & 0x0F : b >> 4;
            if (t == kQ4_K) {
              const float dl = d * p[kK4Scales + 8 * g + r], ml = h2f(p + 16 + 2 * r) * p[kK4Mins + 8 * g + r];
              o[32 * g + e] = dl * q - ml;
            } else {
              const uint8_t h = v[(vv < 4 ? 128 : 160) + 4 * r + i];
              q |= ((h >> (2 * (vv % 4))) & 3) << 4;
              const int8_t sc = static_cast<int8_t>(p[kK6Scales + 8 * (2 * g + e / 16) + r]);
              o[32 * g + e] = d * static_cast<float>(sc) * (q - 32);
            }
          }
        }
      }
    }
    return;
  }
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* p = pw + (tile * G + g) * TB;
    for (int r = 0; r < 8; r++) {
      const float d = h2f(p + 2 * r);
      float* o = out + r * ldo + 32 * g;
      if (t == kQ8_0) {
        for (int j = 0; j < 8; j++)
          for (int i = 0; i < 4; i++) o[4 * j + i] = d * static_cast<int8_t>(p[16 + 32 * j + 4 * r + i]);
        continue;
      }
      // The arithmetic of dequant_block: Q4_0 d * (q - 8), Q5_0 d * (q - 16), Q4_1 / Q5_1 d * q + m.
      const bool has_min = packed_has_min(t), five = packed_five_bit(t);
      const float m = has_min ? h2f(p + 16 + 2 * r) : 0.0f;
      const uint8_t* v = p + packed_nibble_offset(t);
      const int off = has_min ? 0 : five ? 16 : 8;
      for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
          const uint8_t b = v[32 * j + 4 * r + i];
          const uint8_t h = five ? v[128 + 4 * r + i] : 0;
          const int lo = (b & 0x0F) | (((h >> (2 * j)) & 1) << 4), hi = (b >> 4) | (((h >> (2 * j + 1)) & 1) << 4);
          if (has_min) {
            o[8 * j + i] = d * lo + m;
            o[8 * j + 4 + i] = d * hi + m;
          } else {
            o[8 * j + i] = d * (lo - off);
            o[8 * j + 4 + i] = d * (hi - off);
          }
        }
    }
  }
}

// out [8 * tiles, K] (float / bf16) = the weight in the 8-row layout, dequantized.
void gguf_dequantize_packed(at::Tensor out, const at::Tensor& pw, int64_t qtype) {
  const int t = static_cast<int>(qtype);
  TORCH_CHECK(packable(t) && pw.scalar_type() == at::kByte && pw.dim() == 2 && pw.is_contiguous(), "bad packed weight");
  const int64_t K = out.size(1), G = K / packed_group_elems(t), tiles = pw.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == 8 * tiles && K % packed_group_elems(t) == 0 &&
                  pw.size(1) == packed_row_bytes(t, K), "out must be contiguous [8 * tiles, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be float or bf16");
  const uint8_t* src = pw.data_ptr<uint8_t>();
  const bool f32 = out.scalar_type() == at::kFloat;
  float* of = f32 ? out.data_ptr<float>() : nullptr;
  bf16* ob = f32 ? nullptr : out.data_ptr<bf16>();
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(f32 ? 0 : 8 * K);
    for (int64_t tile = t0; tile < t1; tile++) {
      if (f32) {
        dequant_tile(t, src, tile, G, of + tile * 8 * K, K);
      } else {
        dequant_tile(t, src, tile, G, buf.data(), K);
        bf16* o = ob + tile * 8 * K;
        for (int64_t i = 0; i < 8 * K; i++) o[i] = bf16(buf[i]);
      }
    }
  });
}

// Tiles [t0, t1) of the 8-row layout's GEMM: one thread's share. The plain C++ path reads the layout
// back row by row.
void run_packed_range(int t, const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                      int64_t t1) {
  const TileKernel simd = traits(t).tile;
  if (simd && !g_force_scalar) return simd(a, pw, bias, out, ldo, t0, t1);
  const int64_t K = a.K, G = K / 32;
  if (packed_group_elems(t) == 256) {  // K-quants: the tile's rows dequantized, dot_row_scalar's sums
    const int64_t NS = K / 256;
    std::vector<float> rows(8 * K);
    for (int64_t tile = t0; tile < t1; tile++) {
      dequant_tile(t, pw, tile, NS, rows.data(), K);
      for (int r = 0; r < 8; r++)
        for (int64_t m = 0; m < a.M; m++) {
          const int8_t* xq = a.q.data() + m * K;
          const float* xd = a.d.data() + m * G;
          double acc = 0.0;
          for (int64_t k = 0; k < K; k++) acc += static_cast<double>(rows[r * K + k]) * (xd[k / 32] * xq[k]);
          float* o = out + m * ldo + tile * 8 + r;
          *o = static_cast<float>(acc) + (bias ? bias[tile * 8 + r] : 0.0f);
        }
    }
    return;
  }
  // Unpack each tile into 8 rows of ordinary blocks, then the row kernel.
  const int bb = type_info(t).block_bytes;
  std::vector<uint8_t> rows(8 * G * bb);
  std::vector<float> buf(256);
  for (int64_t tile = t0; tile < t1; tile++) {
    unpack_tile(t, pw, tile, G, rows.data());
    for (int r = 0; r < 8; r++)
      for (int64_t m = 0; m < a.M; m++) {
        float* o = out + m * ldo + tile * 8 + r;
        dot_row_scalar(t, rows.data() + r * G * bb, K, a.q.data() + m * K, a.d.data() + m * G, o, buf.data());
        if (bias) *o += bias[tile * 8 + r];
      }
  }
}

int64_t tile_grain(int64_t tiles) {
  return std::max<int64_t>(1, std::min<int64_t>(8, tiles / (4 * at::get_num_threads()) + 1));
}

void run_packed(int t, const QAct& a, const uint8_t* pw, int64_t tiles, const float* bias, float* out, int64_t ldo) {
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    run_packed_range(t, a, pw, bias, out, ldo, t0, t1);
  });
}

// out [M, 8 * tiles] = x @ W.T + bias, W in the 8-row layout (gguf_repack8).
void gguf_linear_packed(at::Tensor out, const at::Tensor& x, const at::Tensor& pw, int64_t qtype,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be float [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = pw.size(0);
  TORCH_CHECK(packable(qtype) && K % packed_group_elems(static_cast<int>(qtype)) == 0 && pw.scalar_type() == at::kByte && pw.is_contiguous() &&
                  pw.size(1) == packed_row_bytes(static_cast<int>(qtype), K), "bad packed weight");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M &&
                  out.size(1) == 8 * tiles, "out must be float [M, 8 * tiles]");
  const float* b_ptr = bias ? bias->data_ptr<float>() : nullptr;
  thread_local QAct act;
  act.set(x.data_ptr<float>(), M, K, x.stride(0));
  run_packed(static_cast<int>(qtype), act, pw.data_ptr<uint8_t>(), tiles, b_ptr, out.data_ptr<float>(), out.stride(0));
}

// ------------------------------------------------------------- batched GEMM (prefill) over the 8-row layouts
// For M >= ~32 rows (prefill) the tile kernels above re-unpack every weight group for each 4
// activation rows and re-read all M x K activation bytes per 8-row tile. gguf_gemm_packed instead
// converts the weights on the fly, a chunk of kGemmChunk groups (32 columns each) of one or two
// tiles at a time, into "R8" int8 form in a small thread-local buffer (the idea of ik_llama.cpp's
// Q8_0_R8 tiles; nothing persistent, the memory stays the file's size):
//   q   per group 8 vectors of 32 bytes, vector j byte 4r + i = w[r][4j + i] (packed Q8_0's order,
//       and load_nibbles' output): the type's integers (unsigned 0..15 / 0..31, or signed)
//   a   per group and row the factor of the integer dot product (Q6_K: of columns 0..15; a2 16..31)
//   b   per group and row the factor of the activation group's s = d_x * sum(q_x) (offset / min)
// so every group's value is  a * d_x * sum(w * q_x) (+ a2 ...) + b * s_x,  the same integers and the
// same float formula as the tile kernels. A register-blocked micro-kernel then runs kGemmMR
// activation rows x kGemmNT tiles (16 weight rows) over the chunk: each weight vector loaded once
// for the rows, each broadcast activation word used for both tiles. The loops: activation rows in
// blocks that stay in L2 (gemm_row_block), tiles (pairs) inside, chunks of K inside that (L1), so a
// chunk is unpacked once per row block and a row block's activations are read from L2 once per tile
// pair. Threads: at::parallel_for over the tiles, as run_packed.
constexpr int kGemmChunk = 16;  // groups of 32 columns per unpacked chunk (a multiple of 8: whole K-quant super-blocks)
#ifndef TLQ_GEMM_MR
#define TLQ_GEMM_MR 2
#endif
#ifndef TLQ_GEMM_NT
#define TLQ_GEMM_NT 2
#endif
constexpr int kGemmMR = TLQ_GEMM_MR;  // activation rows per micro-kernel call
constexpr int kGemmNT = TLQ_GEMM_NT;  // tiles per micro-kernel call (1 or 2)

// Activation rows per block: the block's int8 rows (rows x K bytes) within ~192 KB of L2.
int64_t gemm_row_block(int64_t K) {
  return std::max<int64_t>(16, std::min<int64_t>(128, (192 * 1024 / K) & ~int64_t{3}));
}

#if TLQ_AVX2
struct R8Chunk {
  alignas(32) uint8_t q[kGemmChunk * 256];
  alignas(32) float a[kGemmChunk * 8];
  alignas(32) float a2[kGemmChunk * 8];
  alignas(32) float b[kGemmChunk * 8];
};

// Per-type knowledge of the batched GEMM, in one place.
//   kSigned     signed integers: vpmaddubsw takes |w| and x with w's sign (Q8_0, Q6_K)
//   kTwoScales  a per 16 columns (a for vectors 0..3, a2 for 4..7): Q6_K
//   kHasB       an s_x term (offset or min)
//   kChain      vpmaddubsw results summed in int16 before vpmaddwd (AVX2): 8 for 4-bit quants
//               (< 8 * 2 * 15 * 127 = 30480), 4 for 5-bit and Q6_K (< 4 * 2 * 32 * 127 = 32512),
//               1 for Q8_0 (one product pair already reaches 2 * 128 * 127)
//   unpack      groups [g0, g0 + n) of one tile (its first byte: tp) into the chunk
template <int T>
struct R8Type {
  static constexpr bool kSigned = T == kQ8_0 || T == kQ6_K;
  static constexpr bool kTwoScales = T == kQ6_K;
  static constexpr bool kHasB = !kSigned;
  static constexpr int kChain = T == kQ8_0 ? 1 : (T == kQ5_0 || T == kQ5_1 || T == kQ6_K) ? 4 : 8;

  static void unpack(const uint8_t* tp, int64_t g0, int n, R8Chunk& c) {
    constexpr int TB = packed_tile_bytes(T);
    for (int i = 0; i < n; i++) {
      const int64_t g = g0 + i;
      __m256i* q = reinterpret_cast<__m256i*>(c.q + 256 * i);
      float* a = c.a + 8 * i;
      float* b = c.b + 8 * i;
      __m256i w[8];
      if constexpr (T == kQ4_K || T == kQ6_K) {
        const uint8_t* p = tp + (g / 8) * TB;
        const int s = static_cast<int>(g % 8);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        if constexpr (T == kQ4_K) {
          auto bytes8 = [&](int off) {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + off + 8 * s))));
          };
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
          _mm256_store_ps(a, _mm256_mul_ps(dv, bytes8(kK4Scales)));
          _mm256_store_ps(b, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(mv, bytes8(kK4Mins))));
          load_nibbles(p + kK4Quants + 128 * s, w);
        } else {
          const uint8_t* v = p + kK6Groups + kK6GroupBytes * s;
          auto scale8 = [&](int sub) {
            return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK6Scales + 8 * sub)))));
          };
          _mm256_store_ps(a, scale8(2 * s));
          _mm256_store_ps(c.a2 + 8 * i, scale8(2 * s + 1));
          const __m256i m3 = _mm256_set1_epi8(0x30), c32 = _mm256_set1_epi8(32);
          const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 128));
          const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 160));
          load_nibbles(v, w);
          w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h0, 4), m3));
          w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h0, 2), m3));
          w[2] = _mm256_or_si256(w[2], _mm256_and_si256(h0, m3));
          w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(h0, 2), m3));
          w[4] = _mm256_or_si256(w[4], _mm256_and_si256(_mm256_slli_epi16(h1, 4), m3));
          w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_slli_epi16(h1, 2), m3));
          w[6] = _mm256_or_si256(w[6], _mm256_and_si256(h1, m3));
          w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h1, 2), m3));
          for (int j = 0; j < 8; j++) w[j] = _mm256_sub_epi8(w[j], c32);
        }
      } else {
        const uint8_t* p = tp + g * TB;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        _mm256_store_ps(a, dv);
        if constexpr (T == kQ8_0) {
          for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * j));
        } else {
          constexpr int off = packed_nibble_offset(T);
          constexpr bool five = packed_five_bit(T);
          load_nibbles(p + off, w);
          if constexpr (five) {  // vector v's fifth bits are bit v of each byte: to bit 4
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off + 128));
            const __m256i b4 = _mm256_set1_epi8(0x10);
            w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
            w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
            w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), b4));
            w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), b4));
            w[4] = _mm256_or_si256(w[4], _mm256_and_si256(h, b4));
            w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), b4));
            w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), b4));
            w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), b4));
          }
          // Q4_1 / Q5_1: + m * s_x; Q4_0 / Q5_0: quants offset by 8 / 16, so - 8 d * s_x / - 16 d * s_x.
          _mm256_store_ps(b, packed_has_min(T) ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))
                                               : _mm256_mul_ps(dv, _mm256_set1_ps(five ? -16.0f : -8.0f)));
        }
      }
      for (int j = 0; j < 8; j++) _mm256_store_si256(q + j, w[j]);
    }
  }
};

// MT activation rows x NT unpacked tiles over a chunk's n groups. acc [MT][kGemmNT][8]: the float
// sums so far (zeroed when `first`), updated. xq / xd / xs: the rows' bytes, d and s at the chunk.
template <int T, int MT, int NT>
inline void r8_kernel(const R8Chunk* c, int n, const int8_t* const* xq, const float* const* xd,
                      const float* const* xs, float* acc, bool first) {
  using R = R8Type<T>;
  __m256 f[MT][NT];
  for (int m = 0; m < MT; m++)
    for (int t = 0; t < NT; t++) f[m][t] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + (m * kGemmNT + t) * 8);
  const __m256i one = _mm256_set1_epi16(1);
  for (int g = 0; g < n; g++) {
    // s: int32 sums per (row, tile); for Q6_K s holds columns 0..15 and s2 16..31.
    __m256i s[MT][NT], s2[MT][NT];
    for (int m = 0; m < MT; m++)
      for (int t = 0; t < NT; t++) s[m][t] = s2[m][t] = _mm256_setzero_si256();
#if TLQ_VNNI
    for (int j = 0; j < 8; j++) {
      __m256i w[NT], wa[NT];
      for (int t = 0; t < NT; t++) {
        w[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c[t].q + 256 * g + 32 * j));
        wa[t] = R::kSigned ? _mm256_sign_epi8(w[t], w[t]) : w[t];
      }
      for (int m = 0; m < MT; m++) {
        const __m256i xb = bcast4(xq[m] + 32 * g + 4 * j);
        for (int t = 0; t < NT; t++) {
          const __m256i xv = R::kSigned ? _mm256_sign_epi8(xb, w[t]) : xb;
          if (R::kTwoScales && j >= 4)
            s2[m][t] = dpbusd(s2[m][t], wa[t], xv);
          else
            s[m][t] = dpbusd(s[m][t], wa[t], xv);
        }
      }
    }
#else
    for (int j0 = 0; j0 < 8; j0 += R::kChain) {
      __m256i s16[MT][NT];
      for (int j = j0; j < j0 + R::kChain; j++) {
        __m256i w[NT], wa[NT];
        for (int t = 0; t < NT; t++) {
          w[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c[t].q + 256 * g + 32 * j));
          wa[t] = R::kSigned ? _mm256_sign_epi8(w[t], w[t]) : w[t];
        }
        for (int m = 0; m < MT; m++) {
          const __m256i xb = bcast4(xq[m] + 32 * g + 4 * j);
          for (int t = 0; t < NT; t++) {
            const __m256i pr = _mm256_maddubs_epi16(wa[t], R::kSigned ? _mm256_sign_epi8(xb, w[t]) : xb);
            s16[m][t] = j == j0 ? pr : _mm256_add_epi16(s16[m][t], pr);
          }
        }
      }
      for (int m = 0; m < MT; m++)
        for (int t = 0; t < NT; t++) {
          const __m256i part = _mm256_madd_epi16(s16[m][t], one);
          if (R::kTwoScales && j0 >= 4)
            s2[m][t] = _mm256_add_epi32(s2[m][t], part);
          else
            s[m][t] = _mm256_add_epi32(s[m][t], part);
        }
    }
#endif
    for (int m = 0; m < MT; m++) {
      const __m256 dx = _mm256_set1_ps(xd[m][g]);
      for (int t = 0; t < NT; t++) {
        f[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][t]), _mm256_mul_ps(_mm256_load_ps(c[t].a + 8 * g), dx), f[m][t]);
        if constexpr (R::kTwoScales)
          f[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2[m][t]), _mm256_mul_ps(_mm256_load_ps(c[t].a2 + 8 * g), dx), f[m][t]);
        if constexpr (R::kHasB) f[m][t] = _mm256_fmadd_ps(_mm256_load_ps(c[t].b + 8 * g), _mm256_set1_ps(xs[m][g]), f[m][t]);
      }
    }
  }
  for (int m = 0; m < MT; m++)
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(acc + (m * kGemmNT + t) * 8, f[m][t]);
}

// r8_kernel for mt (1..MT) rows.
template <int T, int NT, int MT = kGemmMR>
inline void r8_rows(const R8Chunk* c, int n, int mt, const int8_t* const* xq, const float* const* xd,
                    const float* const* xs, float* acc, bool first) {
  if constexpr (MT == 1) {
    r8_kernel<T, 1, NT>(c, n, xq, xd, xs, acc, first);
  } else {
    if (mt == MT) return r8_kernel<T, MT, NT>(c, n, xq, xd, xs, acc, first);
    r8_rows<T, NT, MT - 1>(c, n, mt, xq, xd, xs, acc, first);
  }
}

// Tiles [t0, t1) of out = x @ W.T + bias over all M rows: one thread's share.
template <int T>
void gemm_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                       int64_t t1) {
  const int64_t M = a.M, K = a.K, G = K / 32, tile_bytes = K / packed_group_elems(T) * packed_tile_bytes(T);
  const int64_t MB = gemm_row_block(K);
  thread_local R8Chunk chunks[kGemmNT];
  thread_local std::vector<float> accbuf;
  accbuf.resize(MB * kGemmNT * 8);
  float* acc = accbuf.data();
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    for (int64_t tile = t0; tile < t1; tile += kGemmNT) {
      const int nt = static_cast<int>(std::min<int64_t>(kGemmNT, t1 - tile));
      for (int64_t g0 = 0; g0 < G; g0 += kGemmChunk) {
        const int n = static_cast<int>(std::min<int64_t>(kGemmChunk, G - g0));
        for (int t = 0; t < nt; t++) R8Type<T>::unpack(pw + (tile + t) * tile_bytes, g0, n, chunks[t]);
        for (int64_t m = 0; m < mb; m += kGemmMR) {
          const int mt = static_cast<int>(std::min<int64_t>(kGemmMR, mb - m));
          const int8_t* xq[kGemmMR];
          const float* xd[kGemmMR];
          const float* xs[kGemmMR];
          for (int i = 0; i < mt; i++) {
            const int64_t row = m0 + m + i;
            xq[i] = a.q.data() + row * K + 32 * g0;
            xd[i] = a.d.data() + row * G + g0;
            xs[i] = a.s.data() + row * G + g0;
          }
          float* ac = acc + m * kGemmNT * 8;
          if (nt == kGemmNT)
            r8_rows<T, kGemmNT>(chunks, n, mt, xq, xd, xs, ac, g0 == 0);
          else
            r8_rows<T, 1>(chunks, n, mt, xq, xd, xs, ac, g0 == 0);
        }
      }
      for (int64_t m = 0; m < mb; m++)
        for (int t = 0; t < nt; t++) {
          __m256 v = _mm256_loadu_ps(acc + (m * kGemmNT + t) * 8);
          if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + (tile + t) * 8));
          _mm256_storeu_ps(out + (m0 + m) * ldo + (tile + t) * 8, v);
        }
    }
  }
}
#endif

// out [M, 8 * tiles] = x @ W.T + bias, W in the 8-row layout: the batched GEMM above (the plain C++
// path: run_packed_range's, the same sums).
void gguf_gemm_packed(at::Tensor out, const at::Tensor& x, const at::Tensor& pw, int64_t qtype,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be float [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = pw.size(0);
  const int t = static_cast<int>(qtype);
  TORCH_CHECK(packable(qtype) && K % packed_group_elems(t) == 0 && pw.scalar_type() == at::kByte && pw.is_contiguous() &&
                  pw.size(1) == packed_row_bytes(t, K), "bad packed weight");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M &&
                  out.size(1) == 8 * tiles, "out must be float [M, 8 * tiles]");
  const float* b_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == 8 * tiles,
                "bias must be a contiguous float [N] tensor");
    b_ptr = bias->data_ptr<float>();
  }
  if (M == 0) return;
  thread_local QAct tl_act;
  tl_act.set(x.data_ptr<float>(), M, K, x.stride(0));
  const QAct& act = tl_act;  // the caller's: a thread_local named in the lambda would be each worker's own
  const uint8_t* w = pw.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const TileKernel gemm = traits(t).gemm;
  at::parallel_for(0, tiles, tile_grain(tiles), [&](int64_t t0, int64_t t1) {
    if (gemm && !g_force_scalar) return gemm(act, w, b_ptr, o, ldo, t0, t1);
    run_packed_range(t, act, w, b_ptr, o, ldo, t0, t1);
  });
}

// (q int8 [M, K], d [M, K / 32], s [M, K / 32], bs int16 [M, K / 16]): x float [M, K] quantized as the
// kernels see it (tests hold the SIMD quantizer to the plain loop byte for byte).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gguf_quantize_act(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "x must be contiguous float [M, K] with K a multiple of 32");
  QAct a;
  a.set(x.data_ptr<float>(), x.size(0), x.size(1), x.size(1));
  const int64_t M = x.size(0), G = x.size(1) / 32;
  at::Tensor q = at::empty({M, x.size(1)}, x.options().dtype(at::kChar)), d = at::empty({M, G}, x.options()),
             s = at::empty({M, G}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  std::memcpy(s.data_ptr<float>(), a.s.data(), a.s.size() * sizeof(float));
  at::Tensor bs = at::empty({M, 2 * G}, x.options().dtype(at::kShort));
  std::memcpy(bs.data_ptr<int16_t>(), a.bs.data(), a.bs.size() * sizeof(int16_t));
  return {q, d, s, bs};
}

// out [M, N] (float or bf16, rows may be strided) = x [M, K] @ W.T + bias.
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                 const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N,
              "out must be an [M, N] tensor with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be float or bf16");
  const float* b_ptr = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float [N] tensor");
    b_ptr = bias->data_ptr<float>();
  }
  if (M == 0) return;
  thread_local QAct act;
  thread_local std::vector<float> f32out;
  if (x.scalar_type() == at::kFloat)
    act.set(x.data_ptr<float>(), M, K, x.stride(0));
  else if (x.scalar_type() == at::kBFloat16)
    act.set(x.data_ptr<bf16>(), M, K, x.stride(0));
  else
    TORCH_CHECK(false, "x must be float or bf16");
  if (out.scalar_type() == at::kFloat) {
    run_quantized(static_cast<int>(qtype), act, w.data_ptr<uint8_t>(), N, w.size(1), b_ptr, out.data_ptr<float>(),
                  out.stride(0));
    return;
  }
  f32out.resize(M * N);
  float* o = f32out.data();
  run_quantized(static_cast<int>(qtype), act, w.data_ptr<uint8_t>(), N, w.size(1), b_ptr, o, N);
  bf16* ob = out.data_ptr<bf16>();
  const int64_t ldo = out.stride(0);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) store(ob + m * ldo + n, o[m * N + n]);
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
        if constexpr (std::is_same_v<T, float>) {
          dequant_block(t, src + b * ti.block_bytes, dst + b * ti.block_elems);
        } else {
          dequant_block(t, src + b * ti.block_bytes, buf);
          for (int e = 0; e < ti.block_elems; e++) store(dst + b * ti.block_elems + e, buf[e]);
        }
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

// Row `row` of a weight in the 8-row layout (K columns) -> out (fp32): its tile dequantized into buf
// [8 * K], then the row copied (8x the work of one row, still ~microseconds; this is what lets a
// tied embedding table and the LM head share one copy of the blocks).
inline void packed_row(int t, const uint8_t* pw, int64_t K, int64_t row, float* buf, float* out) {
  dequant_tile(t, pw, row / 8, K / packed_group_elems(t), buf, K);
  std::memcpy(out, buf + (row % 8) * K, K * sizeof(float));
}

// out [R, K] (float / bf16) = rows ids of a weight in the 8-row layout.
void gguf_embedding_packed(at::Tensor out, const at::Tensor& pw, int64_t qtype, const at::Tensor& ids) {
  const int t = static_cast<int>(qtype);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be int64 [R]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0), "out must be contiguous [R, K]");
  const int64_t K = out.size(1), N = 8 * pw.size(0);
  TORCH_CHECK(packable(t) && pw.scalar_type() == at::kByte && pw.dim() == 2 && pw.is_contiguous() &&
                  K % packed_group_elems(t) == 0 && pw.size(1) == packed_row_bytes(t, K), "bad packed weight");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out must be float or bf16");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); i++)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "token id ", idp[i], " out of range [0, ", N, ")");
  const uint8_t* src = pw.data_ptr<uint8_t>();
  at::parallel_for(0, ids.size(0), 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(8 * K), row(K);
    for (int64_t i = i0; i < i1; i++) {
      if (out.scalar_type() == at::kFloat) {
        packed_row(t, src, K, idp[i], buf.data(), out.data_ptr<float>() + i * K);
      } else {
        packed_row(t, src, K, idp[i], buf.data(), row.data());
        bf16* o = out.data_ptr<bf16>() + i * K;
        for (int64_t k = 0; k < K; k++) o[k] = bf16(row[k]);
      }
    }
  });
}

// ------------------------------------------------------------------------------ the decode stack
// GGUFDecoder runs a whole decode step (every layer, one call from Python) for a few sequences of
// one new token each: embedding row, and per layer RMSNorm -> qkv -> neox rotary + KV-cache write ->
// paged attention -> o-proj + residual -> RMSNorm -> gate/up -> SiLU*mul -> down + residual; then the
// final norm. Activations stay fp32 in reused buffers; the weights are the GGUF blocks (or fp32
// matrices, type 0, for tensors a file stores unquantized). KV caches: the plain head-major layout
// [Hkv, num_blocks, block_size, D] in float or bf16, shared with the rest of the runner.

constexpr int kDense = 0;   // part type: a float32 [N, K] matrix (GGML_TYPE_F32)
constexpr int kBF16 = 30;   // part type: a bfloat16 [N, K] matrix (GGML_TYPE_BF16)

inline bool is_float_part(int t) { return t == kDense || t == kBF16; }

struct Part {
  at::Tensor w;       // [N, row_bytes] blocks, or float / bf16 [N, K] (kDense / kBF16)
  int t;
  c10::optional<at::Tensor> bias;
  at::Tensor packed;  // the 8-row layout of w, when its type has one and N % 8 == 0
};

struct QLin {
  std::vector<Part> parts;
  int64_t N = 0, K = 0;
  bool quantized = false;  // some part multiplies quantized activations
};

inline float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#if TLQ_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

#if TLQ_AVX2
// 8 weights as floats: a float load, or bf16 -> fp32 by a 16-bit shift (bf16 is fp32's top half).
inline __m256 load8_w(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_w(const bf16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// NR weight rows (from w, K apart) against MT activation rows (x, K apart): out[m * ldo + r]. Each
// weight vector is loaded once for the MT rows; the next NR-row block is prefetched a cache line at a
// time while this one streams (the hardware prefetcher alone follows only a few of the NR streams).
template <typename W, int NR, int MT>
inline void dense_tile(const float* x, int64_t K, const W* w, const float* bias, float* out, int64_t ldo,
                       bool prefetch) {
  constexpr int64_t kLine = 64 / sizeof(W);  // elements per cache line
  __m256 acc[MT][NR];
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NR; r++) acc[m][r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= K; i += 8) {
    if (prefetch && i % kLine == 0)
      for (int r = 0; r < NR; r++) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + i), _MM_HINT_T0);
    __m256 wv[NR];
    for (int r = 0; r < NR; r++) wv[r] = load8_w(w + r * K + i);
    for (int m = 0; m < MT; m++) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + i);
      for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NR; r++) {
      float s = hsum(acc[m][r]);
      for (int64_t j = i; j < K; j++) s += x[m * K + j] * static_cast<float>(w[r * K + j]);
      out[m * ldo + r] = s + (bias ? bias[r] : 0.0f);
    }
}

// Rows [n0, n1) of a float / bf16 matrix: 4-row blocks, activation rows two at a time (4 x 2
// accumulators + 4 weight vectors + 1 activation fit AVX2's 16 registers). Only the first pass over
// a block's weights prefetches the next block; later activation rows read them from L1/L2.
template <typename W>
void dense_range_avx2(const float* x, int64_t M, int64_t K, const W* w, const float* bias, float* out, int64_t ldo,
                      int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* wn = w + n * K;
    const float* bn = bias ? bias + n : nullptr;
    const bool pf = n + 8 <= n1;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dense_tile<W, 4, 2>(x + m * K, K, wn, bn, out + m * ldo + n, ldo, pf && m == 0);
    if (m < M) dense_tile<W, 4, 1>(x + m * K, K, wn, bn, out + m * ldo + n, ldo, pf && m == 0);
  }
  for (; n < n1; n++)
    for (int64_t m = 0; m < M; m++)
      dense_tile<W, 1, 1>(x + m * K, K, w + n * K, bias ? bias + n : nullptr, out + m * ldo + n, ldo, false);
}
#endif

// Rows [n0, n1) of out[m * ldo + n] = sum_k W[n, k] x[m, k] + bias[n], W float or bf16 [N, K]: one
// thread's share (run_dense splits the rows; the decoder splits them itself).
template <typename W>
void run_dense_range(const float* x, int64_t M, int64_t K, const W* w, const float* bias, float* out, int64_t ldo,
                     int64_t n0, int64_t n1) {
#if TLQ_AVX2
  if (!g_force_scalar) return dense_range_avx2(x, M, K, w, bias, out, ldo, n0, n1);
#endif
  for (int64_t n = n0; n < n1; n++)
    for (int64_t m = 0; m < M; m++) {
      const float* xm = x + m * K;
      const W* wn = w + n * K;
      float s = 0.0f;
      for (int64_t k = 0; k < K; k++) s += xm[k] * static_cast<float>(wn[k]);
      out[m * ldo + n] = s + (bias ? bias[n] : 0.0f);
    }
}

// A float part's rows [n0, n1), by its weight type.
inline void run_float_part_range(const Part& p, const float* x, int64_t M, int64_t K, const float* bias, float* out,
                                 int64_t ldo, int64_t n0, int64_t n1) {
  if (p.t == kBF16)
    run_dense_range(x, M, K, p.w.data_ptr<bf16>(), bias, out, ldo, n0, n1);
  else
    run_dense_range(x, M, K, p.w.data_ptr<float>(), bias, out, ldo, n0, n1);
}

void run_dense(const Part& p, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* out,
               int64_t ldo) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { run_float_part_range(p, x, M, K, bias, out, ldo, n0, n1); });
}

// Thread tid's contiguous share [b, e) of n units, nth threads (the decoder's static split).
inline void thread_share(int64_t n, int tid, int nth, int64_t& b, int64_t& e) {
  const int64_t q = n / nth, r = n % nth;
  b = tid * q + std::min<int64_t>(tid, r);
  e = b + q + (tid < r ? 1 : 0);
}

// parts: (weight, GGML type, bias, packed); packed: the weight is already in the 8-row layout.
using PartSpec = std::tuple<at::Tensor, int64_t, c10::optional<at::Tensor>, bool>;

QLin make_qlin(const std::vector<PartSpec>& parts, int64_t K) {
  QLin L;
  L.K = K;
  for (const auto& [w, t, bias, is_packed] : parts) {
    if (is_packed) {
      TORCH_CHECK(packable(t) && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() &&
                      w.size(1) == packed_row_bytes(static_cast<int>(t), K), "bad packed part");
      if (bias) {
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == 8 * w.size(0),
                    "a part's bias must be a contiguous float [N] tensor");
      }
      L.parts.push_back(Part{at::Tensor(), static_cast<int>(t), bias, w});
      L.N += 8 * w.size(0);
      continue;
    }
    if (is_float_part(static_cast<int>(t))) {
      TORCH_CHECK(w.scalar_type() == (t == kBF16 ? at::kBFloat16 : at::kFloat) && w.dim() == 2 && w.is_contiguous() &&
                      w.size(1) == K, "a dense part must be a contiguous ", t == kBF16 ? "bf16" : "float", " [N, ", K,
                  "] tensor");
    } else {
      check_weight(w, t, K);
    }
    if (bias) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                  "a part's bias must be a contiguous float [N] tensor");
    }
    at::Tensor packed;
    if (!is_float_part(static_cast<int>(t)) && packable(t) && w.size(0) % 8 == 0) packed = gguf_repack8(w, t, K);
    L.parts.push_back(Part{w, static_cast<int>(t), bias, packed});
    L.N += w.size(0);
  }
  for (const auto& p : L.parts) L.quantized |= !is_float_part(p.t);
  return L;
}

// Thread tid's share of out [M, L.N] = x @ L.T + bias inside a parallel region: each part's rows (or
// tiles) split alike. act holds x quantized when L.quantized.
void qlin_share(const QLin& L, const float* x, int64_t M, const QAct& act, float* out, int tid, int nth) {
  int64_t col = 0, b, e;
  for (const auto& p : L.parts) {
    const float* bias = p.bias ? p.bias->data_ptr<float>() : nullptr;
    if (p.packed.defined()) {
      thread_share(p.packed.size(0), tid, nth, b, e);
      run_packed_range(p.t, act, p.packed.data_ptr<uint8_t>(), bias, out + col, L.N, b, e);
      col += 8 * p.packed.size(0);
    } else if (is_float_part(p.t)) {
      thread_share(p.w.size(0), tid, nth, b, e);
      run_float_part_range(p, x, M, L.K, bias, out + col, L.N, b, e);
      col += p.w.size(0);
    } else {
      thread_share(p.w.size(0), tid, nth, b, e);
      run_quantized_range(p.t, act, p.w.data_ptr<uint8_t>(), p.w.size(1), bias, out + col, L.N, b, e);
      col += p.w.size(0);
    }
  }
}

void qlin_run(const QLin& L, const float* x, int64_t M, QAct& act, float* out) {
  bool quantized = false;
  for (const auto& p : L.parts) quantized |= !is_float_part(p.t);
  if (quantized) act.set(x, M, L.K, L.K);
  int64_t col = 0;
  for (const auto& p : L.parts) {
    const float* bias = p.bias ? p.bias->data_ptr<float>() : nullptr;
    int64_t n;
    if (p.packed.defined()) {
      n = 8 * p.packed.size(0);
      run_packed(p.t, act, p.packed.data_ptr<uint8_t>(), p.packed.size(0), bias, out + col, L.N);
    } else if (is_float_part(p.t)) {
      n = p.w.size(0);
      run_dense(p, x, M, L.K, n, bias, out + col, L.N);
    } else {
      n = p.w.size(0);
      run_quantized(p.t, act, p.w.data_ptr<uint8_t>(), n, p.w.size(1), bias, out + col, L.N);
    }
    col += n;
  }
}

inline void rms_norm_f32(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0.0;
  int64_t i0 = 0;
#if TLQ_AVX2
  // Four double lanes, two chains: the one-chain scalar sum waited on the add latency per element
  // (~1 us a norm at 576, on one thread of the batch-1 step, twice a layer).
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  for (; i0 + 8 <= n; i0 += 8) {
    const __m256 v = _mm256_loadu_ps(x + i0);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  const __m256d a = _mm256_add_pd(a0, a1);
  const __m128d a2 = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
  ss = _mm_cvtsd_f64(_mm_add_sd(a2, _mm_unpackhi_pd(a2, a2)));
#endif
  for (int64_t i = i0; i < n; i++) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

#if TLQ_AVX2
// e^x, eight lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, the
// exponent built in the float's bits), within ~2 ulp of std::exp over [-87, 88]; x clamped there.
// The batch-1 step's softmax and SiLU called std::exp once per element (~15-20 cycles each).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Eight cache values as floats (bf16: the top half of a float).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const int8_t* p) {  // an int8 KV cache's values (its scales applied by the caller)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// attend() for head_dim 8 * ND: the query and the output held in registers over all positions
// (the generic loop re-read and re-wrote o [D] per position and converted bf16 one at a time), the
// softmax's exp eight scores at a time.
// int8 caches: ksc / vsc are the cache's scales [Hkv, nb, bs] (a slot's at its index): the K scale
// multiplies a score, the V scale a weight. Null for float caches.
template <int ND, typename KT>
void attend_simd(const KT* kc, const KT* vc, int64_t nb, int64_t bs, const float* q, int64_t h, int64_t n,
                 const int32_t* table, float scale, std::vector<float>& scores, float* o, const float* ksc,
                 const float* vsc) {
  constexpr int64_t D = 8 * ND;
  scores.resize(n + 8);
  __m256 qv[ND];
  for (int j = 0; j < ND; j++) qv[j] = _mm256_loadu_ps(q + 8 * j);
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; t++) {
    const KT* k = kc + ((h * nb + table[t / bs]) * bs + t % bs) * D;
    __m256 a0 = _mm256_mul_ps(qv[0], load8(k)), a1 = _mm256_mul_ps(qv[1], load8(k + 8));
    for (int j = 2; j < ND; j += 2) {
      a0 = _mm256_fmadd_ps(qv[j], load8(k + 8 * j), a0);
      a1 = _mm256_fmadd_ps(qv[j + 1], load8(k + 8 * j + 8), a1);
    }
    scores[t] = hsum(_mm256_add_ps(a0, a1)) * (ksc ? scale * ksc[(h * nb + table[t / bs]) * bs + t % bs] : scale);
    mx = std::max(mx, scores[t]);
  }
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 ev = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + t), mv));
    _mm256_storeu_ps(scores.data() + t, ev);
    sv = _mm256_add_ps(sv, ev);
  }
  float sum = hsum(sv);
  for (; t < n; t++) {
    scores[t] = std::exp(scores[t] - mx);
    sum += scores[t];
  }
  __m256 acc[ND];
  for (int j = 0; j < ND; j++) acc[j] = _mm256_setzero_ps();
  for (t = 0; t < n; t++) {
    const int64_t slot = (h * nb + table[t / bs]) * bs + t % bs;
    const KT* v = vc + slot * D;
    const __m256 w = _mm256_set1_ps(vsc ? scores[t] * vsc[slot] : scores[t]);
    for (int j = 0; j < ND; j++) acc[j] = _mm256_fmadd_ps(w, load8(v + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (int j = 0; j < ND; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], inv));
}

// a[t] = SiLU(g[t]) * u[t] for t in [0, n).
inline void silu_mul(const float* g, const float* u, float* a, int64_t n) {
  int64_t t = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; !g_force_scalar && t + 8 <= n; t += 8) {
    const __m256 gv = _mm256_loadu_ps(g + t);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(a + t, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + t)));
  }
  for (; t < n; t++) a[t] = g[t] / (1.0f + std::exp(-g[t])) * u[t];
}
#else
inline void silu_mul(const float* g, const float* u, float* a, int64_t n) {
  for (int64_t t = 0; t < n; t++) a[t] = g[t] / (1.0f + std::exp(-g[t])) * u[t];
}
#endif

template <typename T>
inline float dot_cache(const float* q, const T* k, int64_t D) {
  if constexpr (std::is_same_v<T, float>) {
    return dot_f32(q, k, D);
  } else if constexpr (std::is_same_v<T, int8_t>) {  // the caller applies the scale
    float s = 0.0f;
    for (int64_t i = 0; i < D; i++) s += q[i] * static_cast<float>(k[i]);
    return s;
  } else {
    int64_t i = 0;
    float s = 0.0f;
#if TLQ_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= D; i += 8) {
      const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + i)));
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), acc);
    }
    s = hsum(acc);
#endif
    for (; i < D; i++) s += q[i] * static_cast<float>(k[i]);
    return s;
  }
}

template <typename T>
inline void axpy_cache(float a, const T* v, float* o, int64_t D) {
  for (int64_t i = 0; i < D; i++) o[i] += a * static_cast<float>(v[i]);
}

// One (token, kv head) row into an int8 KV cache: symmetric, scale = absmax / 127, round to nearest
// even (the arithmetic of cpu_kernels.cpp's quantize_kv_row and attention.py's quantize_kv).
inline void quantize_kv_row(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; d++) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  for (int64_t d = 0; d < D; d++)
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] * inv))));
  *scale = amax / 127.0f;
}

class GGUFDecoder {
 public:
  // embed_packed: the embedding table is in the 8-row layout (shared with a tied LM head).
  GGUFDecoder(int64_t hidden, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
              double eps, at::Tensor embed, int64_t embed_type, at::Tensor final_norm, bool embed_packed)
      : H_(hidden), Hq_(num_q_heads), Hkv_(num_kv_heads), D_(head_dim), I_(intermediate),
        eps_(static_cast<float>(eps)), embed_(embed), embed_t_(static_cast<int>(embed_type)),
        embed_packed_(embed_packed), final_norm_(final_norm) {
    TORCH_CHECK(Hq_ % Hkv_ == 0 && D_ % 2 == 0, "bad head configuration");
    if (embed_packed_) {
      TORCH_CHECK(packable(embed_t_) && embed.scalar_type() == at::kByte && embed.dim() == 2 && embed.is_contiguous() &&
                      H_ % packed_group_elems(embed_t_) == 0 && embed.size(1) == packed_row_bytes(embed_t_, H_),
                  "a packed embedding must be the 8-row layout of a [V, H] weight");
    } else if (is_float_part(embed_t_)) {
      TORCH_CHECK(embed.scalar_type() == (embed_t_ == kBF16 ? at::kBFloat16 : at::kFloat) && embed.dim() == 2 &&
                      embed.is_contiguous() && embed.size(1) == H_,
                  "a dense embedding must be a contiguous float or bf16 [V, H] tensor (its part type)");
    } else {
      check_weight(embed, embed_t_, H_);
    }
    check_vec(final_norm, H_, "final_norm");
  }

  using Parts = std::vector<PartSpec>;

  void add_layer(at::Tensor attn_norm, const Parts& qkv, const Parts& o, at::Tensor ffn_norm, const Parts& gate_up,
                 const Parts& down) {
    check_vec(attn_norm, H_, "attn_norm");
    check_vec(ffn_norm, H_, "ffn_norm");
    Layer L{attn_norm, ffn_norm, make_qlin(qkv, H_), make_qlin(o, Hq_ * D_), make_qlin(gate_up, H_),
            make_qlin(down, I_), {}, {}, {}, {}};
    TORCH_CHECK(L.qkv.N == (Hq_ + 2 * Hkv_) * D_ && L.o.N == H_ && L.gate_up.N == 2 * I_ && L.down.N == H_,
                "layer ", layers_.size(), ": linear shapes do not match the configuration");
    layers_.push_back(std::move(L));
  }

  void set_kv_caches(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V cache per layer");
    for (size_t i = 0; i < k.size(); i++) {
      for (const at::Tensor* c : {&k[i], &v[i]}) {
        TORCH_CHECK(c->dim() == 4 && c->is_contiguous() && c->size(0) == Hkv_ && c->size(3) == D_,
                    "KV caches must be contiguous [Hkv, num_blocks, block_size, D]");
        TORCH_CHECK(c->scalar_type() == k[0].scalar_type() &&
                        (c->scalar_type() == at::kFloat || c->scalar_type() == at::kBFloat16 ||
                         c->scalar_type() == at::kChar),
                    "KV caches must all be float, all bf16 or all int8");
      }
      layers_[i].k_cache = k[i];
      layers_[i].v_cache = v[i];
      layers_[i].k_scale = at::Tensor();
      layers_[i].v_scale = at::Tensor();
    }
    scales_pending_ = k[0].scalar_type() == at::kChar;
  }

  // int8 caches (--kv-cache-dtype int8): each layer's float32 [Hkv, num_blocks, block_size] scales,
  // after set_kv_caches.
  void set_kv_scales(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "one K and one V scale tensor per layer");
    for (size_t i = 0; i < k.size(); i++) {
      const at::Tensor& c = layers_[i].k_cache;
      TORCH_CHECK(c.defined() && c.scalar_type() == at::kChar, "KV scales come only with int8 caches");
      for (const at::Tensor* t : {&k[i], &v[i]})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == Hkv_ &&
                        t->size(1) == c.size(1) && t->size(2) == c.size(2),
                    "KV scales must be contiguous float32 [Hkv, num_blocks, block_size]");
      layers_[i].k_scale = k[i];
      layers_[i].v_scale = v[i];
    }
    scales_pending_ = false;
  }

  // out [B, H] (float or bf16) = final-norm hidden states after the step's tokens ids [B] at positions
  // [B] (int64), their K/V written at slots [B] (int64); block_tables [B, max_blocks] int32;
  // cos/sin [P, D/2] float or bf16 (P > every position).
  //
  // The whole step is one OpenMP parallel region: every op splits its work statically over the
  // threads and a barrier separates ops that read what another thread wrote. A batch-1 step has
  // ~8 ops per layer; one fork/join per op (at::parallel_for) cost ~2-3 us each on the dev box,
  // ~0.5 ms a step for SmolLM2's 30 layers, and left the small ops (norms, SiLU, activation
  // quantization, rotary) on one thread.
  void step(at::Tensor out, const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
            const at::Tensor& block_tables, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t B = ids.numel();
    TORCH_CHECK(!layers_.empty() && layers_[0].k_cache.defined(), "GGUFDecoder: layers and KV caches not set");
    TORCH_CHECK(!scales_pending_, "GGUFDecoder: int8 KV caches without their scales (set_kv_scales)");
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slots.scalar_type() == at::kLong && ids.is_contiguous() && positions.is_contiguous() &&
                    slots.is_contiguous() && positions.numel() == B && slots.numel() == B,
                "ids, positions, slots must be contiguous int64 [B]");
    TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) == B &&
                    block_tables.stride(1) == 1, "block_tables must be int32 [B, max_blocks]");
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == B && out.size(1) == H_,
                "out must be contiguous [B, H]");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D_ / 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                    sin.is_contiguous() && sin.scalar_type() == cos.scalar_type(), "cos/sin must be [P, D/2]");
    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t vocab = embed_packed_ ? 8 * embed_.size(0) : embed_.size(0);
    const int64_t nb = layers_[0].k_cache.size(1), bs = layers_[0].k_cache.size(2);
    for (int64_t b = 0; b < B; b++) {
      TORCH_CHECK(idp[b] >= 0 && idp[b] < vocab, "token id ", idp[b], " out of range");
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "position ", pos[b], " outside the rotary table");
      TORCH_CHECK((pos[b] + bs) / bs <= block_tables.size(1), "block table too short for position ", pos[b]);
      const int64_t sl = slots.data_ptr<int64_t>()[b];
      TORCH_CHECK(sl >= 0 && sl < nb * bs, "slot ", sl, " out of range");
    }
    const int64_t QKV = (Hq_ + 2 * Hkv_) * D_;
    h_.resize(B * H_);
    x_.resize(B * H_);
    qkv_.resize(B * QKV);
    att_.resize(B * Hq_ * D_);
    gu_.resize(B * 2 * I_);
    act_.resize(B * I_);
    act_h_.shape(B, H_);
    if (Hq_ * D_ % 32 == 0) act_att_.shape(B, Hq_ * D_);
    if (I_ % 32 == 0) act_ffn_.shape(B, I_);
    const bool f32_rope = cos.scalar_type() == at::kFloat, f32_kv = layers_[0].k_cache.scalar_type() == at::kFloat;
    if (layers_[0].k_cache.scalar_type() == at::kChar) {
      if (f32_rope)
        run_step<float, int8_t>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
      else
        run_step<bf16, int8_t>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
    } else if (f32_rope && f32_kv)
      run_step<float, float>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
    else if (f32_rope)
      run_step<float, bf16>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
    else if (f32_kv)
      run_step<bf16, float>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
    else
      run_step<bf16, bf16>(out, B, idp, pos, slots.data_ptr<int64_t>(), block_tables, cos, sin);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor attn_norm, ffn_norm;
    QLin qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;
    at::Tensor k_scale, v_scale;  // int8 caches only
  };

  static void check_vec(const at::Tensor& t, int64_t n, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what,
                " must be a contiguous float [", n, "] tensor");
  }

  void embed_row(int64_t id, float* out) const {
    if (embed_packed_) {
      std::vector<float> buf(8 * H_);
      packed_row(embed_t_, embed_.data_ptr<uint8_t>(), H_, id, buf.data(), out);
      return;
    }
    if (embed_t_ == kDense) {
      std::memcpy(out, embed_.data_ptr<float>() + id * H_, H_ * sizeof(float));
      return;
    }
    if (embed_t_ == kBF16) {
      const bf16* row = embed_.data_ptr<bf16>() + id * H_;
      for (int64_t t = 0; t < H_; t++) out[t] = static_cast<float>(row[t]);
      return;
    }
    const TypeInfo ti = type_info(embed_t_);
    const uint8_t* row = embed_.data_ptr<uint8_t>() + id * embed_.size(1);
    for (int64_t b = 0; b < H_ / ti.block_elems; b++) dequant_block(embed_t_, row + b * ti.block_bytes, out + b * ti.block_elems);
  }

  // The step's ops inside one parallel region (see step()). CT: the rotary tables' type, KT: the KV
  // caches'. Rows of h_/x_ belong to one thread each (the same share in every op), so the
  // row-wise ops (residual adds, norms) need no barrier before the next op of the same rows.
  template <typename CT, typename KT>
  void run_step(at::Tensor& out, int64_t B, const int64_t* ids, const int64_t* pos, const int64_t* slots,
                const at::Tensor& tables, const at::Tensor& cos_t, const at::Tensor& sin_t) {
    const int64_t QKV = (Hq_ + 2 * Hkv_) * D_, AD = Hq_ * D_;
    const CT* cos = cos_t.data_ptr<CT>();
    const CT* sin = sin_t.data_ptr<CT>();
    const int64_t ld = tables.stride(0);
    const int32_t* tb = tables.data_ptr<int32_t>();
    float* h = h_.data();
    float* x = x_.data();
    float* qkv = qkv_.data();
    float* att = att_.data();
    float* gu = gu_.data();
    float* act = act_.data();
    const bool f32_out = out.scalar_type() == at::kFloat;
    float* out_f = f32_out ? out.data_ptr<float>() : nullptr;
    bf16* out_b = f32_out ? nullptr : out.data_ptr<bf16>();
#pragma omp parallel num_threads(at::get_num_threads())
    {
      const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
      int64_t r0, r1, b, e;
      thread_share(B, tid, nth, r0, r1);  // this thread's rows
      std::vector<float> scores;
      for (int64_t r = r0; r < r1; r++) embed_row(ids[r], h + r * H_);
      for (size_t l = 0; l < layers_.size(); l++) {
        const Layer& L = layers_[l];
        KT* kc = L.k_cache.data_ptr<KT>();
        KT* vc = L.v_cache.data_ptr<KT>();
        float* ksc = nullptr;
        float* vsc = nullptr;
        if constexpr (std::is_same_v<KT, int8_t>) {
          ksc = L.k_scale.data_ptr<float>();
          vsc = L.v_scale.data_ptr<float>();
        }
        const int64_t nb = L.k_cache.size(1), bs = L.k_cache.size(2);
        for (int64_t r = r0; r < r1; r++) {
          rms_norm_f32(h + r * H_, L.attn_norm.data_ptr<float>(), H_, eps_, x + r * H_);
          if (L.qkv.quantized) act_h_.quantize_groups(x, H_, r * H_ / 32, (r + 1) * H_ / 32);
        }
#pragma omp barrier
        qlin_share(L.qkv, x, B, act_h_, qkv, tid, nth);
#pragma omp barrier
        // Rotary on each q/k head; a k head also writes this step's K and V of its kv head.
        thread_share(B * (Hq_ + Hkv_), tid, nth, b, e);
        for (int64_t i = b; i < e; i++) {
          const int64_t r = i / (Hq_ + Hkv_), hd = i % (Hq_ + Hkv_);
          float* row = qkv + r * QKV;
          rope_head(row + hd * D_, cos + pos[r] * (D_ / 2), sin + pos[r] * (D_ / 2));
          if (hd >= Hq_) {
            const int64_t kvh = hd - Hq_;
            KT* kd = kc + (kvh * nb * bs + slots[r]) * D_;
            KT* vd = vc + (kvh * nb * bs + slots[r]) * D_;
            if constexpr (std::is_same_v<KT, int8_t>) {
              quantize_kv_row(row + hd * D_, D_, kd, ksc + kvh * nb * bs + slots[r]);
              quantize_kv_row(row + (Hq_ + Hkv_ + kvh) * D_, D_, vd, vsc + kvh * nb * bs + slots[r]);
              continue;
            }
            for (int64_t t = 0; t < D_; t++) {
              kd[t] = static_cast<KT>(row[hd * D_ + t]);
              vd[t] = static_cast<KT>(row[(Hq_ + Hkv_ + kvh) * D_ + t]);
            }
          }
        }
#pragma omp barrier
        thread_share(B * Hq_, tid, nth, b, e);
        for (int64_t i = b; i < e; i++) {
          const int64_t r = i / Hq_, hq = i % Hq_;
          attend(kc, vc, nb, bs, qkv + r * QKV + hq * D_, hq / (Hq_ / Hkv_), pos[r] + 1, tb + r * ld, scores,
                 att + r * AD + hq * D_, ksc, vsc);
        }
        if (L.o.quantized) {
#pragma omp barrier
          thread_share(B * AD / 32, tid, nth, b, e);
          act_att_.quantize_groups(att, AD, b, e);
        }
#pragma omp barrier
        qlin_share(L.o, att, B, act_att_, x, tid, nth);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++) {
          float* hr = h + r * H_;
          float* xr = x + r * H_;
          for (int64_t t = 0; t < H_; t++) hr[t] += xr[t];
          rms_norm_f32(hr, L.ffn_norm.data_ptr<float>(), H_, eps_, xr);
          if (L.gate_up.quantized) act_h_.quantize_groups(x, H_, r * H_ / 32, (r + 1) * H_ / 32);
        }
#pragma omp barrier
        qlin_share(L.gate_up, x, B, act_h_, gu, tid, nth);
#pragma omp barrier
        // SiLU(gate) * up, and the down projection's activation quantization, 32 values at a time.
        const int64_t chunks = L.down.quantized ? B * I_ / 32 : B * ((I_ + 31) / 32);
        thread_share(chunks, tid, nth, b, e);
        for (int64_t i = b; i < e; i++) {
          const int64_t per_row = chunks / B, r = i / per_row, c0 = (i % per_row) * 32;
          const float* g = gu + r * 2 * I_;
          float* a = act + r * I_;
          silu_mul(g + c0, g + I_ + c0, a + c0, std::min<int64_t>(32, I_ - c0));
        }
        if (L.down.quantized) act_ffn_.quantize_groups(act, I_, b, e);
#pragma omp barrier
        qlin_share(L.down, act, B, act_ffn_, x, tid, nth);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++)
          for (int64_t t = 0; t < H_; t++) h[r * H_ + t] += x[r * H_ + t];
      }
      for (int64_t r = r0; r < r1; r++) {
        rms_norm_f32(h + r * H_, final_norm_.data_ptr<float>(), H_, eps_, x + r * H_);
        if (f32_out)
          std::memcpy(out_f + r * H_, x + r * H_, H_ * sizeof(float));
        else
          for (int64_t t = 0; t < H_; t++) out_b[r * H_ + t] = bf16(x[r * H_ + t]);
      }
    }
  }

  // Neox rotary (rotate_half) of one head [D], in place.
  template <typename CT>
  void rope_head(float* xh, const CT* c, const CT* s) const {
    const int64_t half = D_ / 2;
    for (int64_t i = 0; i < half; i++) {
      const float x1 = xh[i], x2 = xh[i + half], ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
      xh[i] = x1 * ci - x2 * si;
      xh[i + half] = x2 * ci + x1 * si;
    }
  }

  // One query head over its sequence's first n cached positions (block table `table`) -> o [D].
  // ksc / vsc: an int8 cache's scales (see attend_simd), else null.
  template <typename KT>
  void attend(const KT* kc, const KT* vc, int64_t nb, int64_t bs, const float* q, int64_t h, int64_t n,
              const int32_t* table, std::vector<float>& scores, float* o, const float* ksc,
              const float* vsc) const {
    const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
#if TLQ_AVX2
    if (!g_force_scalar) {
      if (D_ == 64) return attend_simd<8>(kc, vc, nb, bs, q, h, n, table, scale, scores, o, ksc, vsc);
      if (D_ == 128) return attend_simd<16>(kc, vc, nb, bs, q, h, n, table, scale, scores, o, ksc, vsc);
    }
#endif
    scores.resize(n);
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; t++) {
      const int64_t slot = (h * nb + table[t / bs]) * bs + t % bs;
      const KT* k = kc + slot * D_;
      scores[t] = dot_cache(q, k, D_) * scale * (ksc ? ksc[slot] : 1.0f);
      mx = std::max(mx, scores[t]);
    }
    float sum = 0.0f;
    for (int64_t t = 0; t < n; t++) {
      scores[t] = std::exp(scores[t] - mx);
      sum += scores[t];
    }
    std::fill(o, o + D_, 0.0f);
    for (int64_t t = 0; t < n; t++) {
      const int64_t slot = (h * nb + table[t / bs]) * bs + t % bs;
      axpy_cache(vsc ? scores[t] * vsc[slot] : scores[t], vc + slot * D_, o, D_);
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < D_; d++) o[d] *= inv;
  }

  int64_t H_, Hq_, Hkv_, D_, I_;
  float eps_;
  at::Tensor embed_;
  int embed_t_;
  bool embed_packed_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  bool scales_pending_ = false;  // int8 caches set, their scales not yet
  std::vector<float> h_, x_, qkv_, att_, gu_, act_;
  QAct act_h_, act_att_, act_ffn_;  // activations quantized for the linears of input H, Hq * D, I
};

bool gguf_type_supported(int64_t qtype) {
  switch (static_cast<int>(qtype)) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1:
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K:
      return true;
    default:
      return false;
  }
}

// out [M, N] float = x [M, K] float @ w.T (+ bias), w a contiguous float or bf16 [N, K]: the dense
// kernel the decoder runs, on its own (tests; the LM-head measurement in benchmarks/kernels/fused_float_decode.py).
void dense_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w must be a contiguous float or bf16 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == K,
              "x must be a contiguous float [M, K] tensor");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == M &&
                  out.size(1) == N, "out must be a contiguous float [M, N] tensor");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous float [N] tensor");
  }
  const Part p{w, w.scalar_type() == at::kBFloat16 ? kBF16 : kDense, bias, at::Tensor()};
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    int64_t n0, n1;
    thread_share(N, omp_get_thread_num(), omp_get_num_threads(), n0, n1);
    run_float_part_range(p, xp, M, K, b, op, N, n0, n1);
  }
}

bool has_avx2() { return TLQ_AVX2; }
bool has_vnni() { return TLQ_VNNI; }
void set_force_scalar(bool on) { g_force_scalar = on; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute calls release the GIL (as torch's own ops do): under async scheduling the runner
  // runs in a worker thread, and a kernel holding the GIL for a whole decode step made the engine
  // thread's Python wait for it, then run after it, on the step's critical path (docs/async.md).
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("gguf_linear", &gguf_linear, nogil);
  m.def("gguf_quantize_act", &gguf_quantize_act, nogil);
  m.def("gguf_dequantize", &gguf_dequantize, nogil);
  m.def("gguf_repack8", &gguf_repack8);
  m.def("gguf_linear_packed", &gguf_linear_packed, nogil);
  m.def("gguf_gemm_packed", &gguf_gemm_packed, nogil);
  m.def("gguf_dequantize_packed", &gguf_dequantize_packed, nogil);
  m.def("gguf_packable", &packable);
  m.def("gguf_embedding", &gguf_embedding, nogil);
  m.def("gguf_embedding_packed", &gguf_embedding_packed, nogil);
  m.def("gguf_type_supported", &gguf_type_supported);
  m.def("has_avx2", &has_avx2);
  m.def("has_vnni", &has_vnni);
  m.def("dense_linear", &dense_linear, nogil);
  m.def("set_force_scalar", &set_force_scalar);
  pybind11::class_<GGUFDecoder>(m, "GGUFDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, int64_t, at::Tensor, bool>())
      .def("add_layer", &GGUFDecoder::add_layer)
      .def("set_kv_caches", &GGUFDecoder::set_kv_caches)
      .def("set_kv_scales", &GGUFDecoder::set_kv_scales)
      .def("step", &GGUFDecoder::step, nogil)
      .def("num_layers", &GGUFDecoder::num_layers);
}
