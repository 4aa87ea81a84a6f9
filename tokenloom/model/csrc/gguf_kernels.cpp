// GGUF quantized weights, kept quantized: GEMV / small-batch GEMM and dequantization
// (built on first use by tokenloom/model/gguf_kernels.py, separately from cpu_kernels.cpp, into one
// extension with fused_decode.cpp: the fused decode step, which runs its quantized linears through
// the entry points declared in gguf_quants.h; this file's module registers it).
//
//   gguf_linear      out[M, N] = x[M, K] @ W[N, K].T (+ bias), W a GGUF tensor's raw blocks [N, row_bytes]
//   gguf_dequantize  W -> float / bf16 [N, K]   (the large-batch fallback and the loader)
//   gguf_embedding   rows `ids` of W -> float / bf16 (the embedding lookup of a quantized token_embd)
//
// Types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS,
// IQ3_XXS, IQ3_S (super-blocks of 256); block layouts as in ggml-common.h (see each `Type` below).
//
// The arithmetic is ggml's CPU backend's idea: the activations are quantized on the fly to int8 in
// groups of 32 (scale d = max|x| / 127, and s = d * sum(q) for the types with an offset), and each
// weight group of 32 meets its activation group in integer dot products (AVX2 vpmaddubsw: unsigned
// weight bytes x signed activation bytes, pairs summed to int16, then vpmaddwd to int32), scaled to
// float once per group. Every type is described as a sequence of 32-element groups, each with
//   w       32 weight integers (unsigned 0..63, or signed for Q8_0 / Q3_K / Q6_K),
//   mul     int16 multipliers for the two halves of the group (the K-quants' per-16 scales; else 1),
//   a, b    floats: group value = a * sum(mul * w * q) * d_x + b * s_x
// plus, for Q2_K alone, a per-16 integer "min" dot product. The row kernel template then handles any
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
#include <ATen/ops/from_blob.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "gguf_quants.h"
#include "iq_grids.h"

bool tlq::g_force_scalar = false;

namespace {

using namespace tlq;  // bf16, QAct, quantize_act, hsum8, g_force_scalar, TypeInfo

// How the tile kernels prefetch the weights they stream (prefetch_weights; the execution plan's choice):
// 2 = an L2 stage, then L1; 1 = the L1 stage alone; 0 = none, the hardware prefetchers alone.
int g_prefetch_stages = 2;
// The stages, read once per tile run. Atomic (relaxed): the module's setter may run on another thread.
inline int prefetch_stages() { return __atomic_load_n(&g_prefetch_stages, __ATOMIC_RELAXED); }

// Batch-invariant mode (VLLM_BATCH_INVARIANT, set by the runner from its execution plan): every kernel
// variant a row may meet sums in the same float order, so a row's result does not depend on how many
// rows run beside it. The one variant that sums otherwise is Q8_0's one-row tile (even and odd groups
// in two FMA chains, 2-3 % faster); with this set it takes the one chain the multi-row tiles take.
bool g_batch_invariant = false;
inline bool batch_invariant() { return __atomic_load_n(&g_batch_invariant, __ATOMIC_RELAXED); }

// GGML type ids (gguf.GGMLQuantizationType).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ3_XXS = 18, kIQ4_NL = 20, kIQ3_S = 21, kIQ4_XS = 23,
};

// IQ4_NL / IQ4_XS: a 4-bit index picks one of 16 non-uniform levels (ggml's kvalues_iq4nl), times the
// block's scale (IQ4_NL: d per 32; IQ4_XS: d per 256 times a six-bit scale minus 32 per 32).
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};


// ------------------------------------------------------------------------------ per-type traits
// One row per GGML type, as ggml's type_traits_cpu[]: the block's geometry, its 8-row tile's (0: the
// type has no 8-row layout) and the SIMD kernels that run it, registered once in kTypeTraits. The
// dispatchers (run_quantized_range, run_packed_range, gguf_gemm_packed) look the type up here; a
// null kernel, or g_force_scalar, means the plain C++ loop. dequant_block is the one plain
// dequantizer of every type (the oracle the tests hold the kernels to).
// Rows [n0, n1) of out = x @ W.T + bias, W in raw blocks (row_bytes per row).
using RowKernel = void (*)(const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                           int64_t ldo, int64_t n0, int64_t n1);
// 8-row tiles [t0, t1) of out = x @ W.T + bias, W in the 8-row layout.
using TileKernel = void (*)(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                            int64_t t1);
// The tiles of a cursor (TileCursor::for_each_tile, gguf_quants.h: work stealing; a fixed range
// [t0, t1) is a cursor no one steals from).
using TileRunKernel = void (*)(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                               TileCursor& cur);

struct TypeTraits {
  int type;
  int block_elems;
  int block_bytes;
  int tile_bytes;  // one 8-row tile group (8 rows x tile_elems columns), 0 without an 8-row layout
  int tile_elems;
  RowKernel rows;   // any batch over raw blocks
  TileRunKernel tile;  // a few activation rows over 8-row tiles: decode, speculative verification
  TileKernel gemm;  // prefill-sized batches over 8-row tiles
};

// The kernels, defined with the AVX2 code below.
template <int T>
void row_kernel(const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out, int64_t ldo,
                int64_t n0, int64_t n1);
template <int T>
void linear_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                         TileCursor& cur);
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

// Tile bytes: d[8] f16 (and m[8] / dmin[8]), then the quants; Q4_K's and Q5_K's six-bit scales and
// mins unpacked to bytes (1,184 per 8 x 144, 1,440 per 8 x 176), see "8-row interleaved layouts" below.
constexpr TypeTraits kTypeTraits[] = {
    {kQ4_0, 32, 18, 144, 32, TLQ_TILED(kQ4_0)},
    {kQ4_1, 32, 20, 160, 32, TLQ_TILED(kQ4_1)},
    {kQ5_0, 32, 22, 176, 32, TLQ_TILED(kQ5_0)},
    {kQ5_1, 32, 24, 192, 32, TLQ_TILED(kQ5_1)},
    {kQ8_0, 32, 34, 272, 32, TLQ_TILED(kQ8_0)},
    {kQ2_K, 256, 84, 672, 256, TLQ_TILED(kQ2_K)},
    {kQ3_K, 256, 110, 912, 256, TLQ_TILED(kQ3_K)},
    {kQ4_K, 256, 144, 1184, 256, TLQ_TILED(kQ4_K)},
    {kQ5_K, 256, 176, 1440, 256, TLQ_TILED(kQ5_K)},
    {kQ6_K, 256, 210, 1680, 256, TLQ_TILED(kQ6_K)},
    {kIQ4_NL, 32, 18, 144, 32, TLQ_TILED(kIQ4_NL)},
    {kIQ4_XS, 256, 136, 1104, 256, TLQ_TILED(kIQ4_XS)},
    // Row by row on the file's blocks (no 8-row layout: prefill-sized batches dequantize, see envs.py).
    {kIQ3_XXS, 256, 98, 0, 256, TLQ_ROWS_ONLY(kIQ3_XXS)},
    {kIQ3_S, 256, 110, 0, 256, TLQ_ROWS_ONLY(kIQ3_S)},
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

// IQ4_XS: group ib's six-bit scale (low four bits in scales_l, high two in scales_h), minus 32.
inline int iq4xs_scale(const uint8_t* b, int ib) {
  const int sh = b[2] | (b[3] << 8);
  return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
}

// IQ3_XXS: entry i of ggml's ksigns table, the eight sign bits of a seven-bit index: i with an eighth bit
// making the byte's parity even.
constexpr uint32_t iq3xxs_ksign(uint32_t i) {
  uint32_t parity = 0;
  for (int k = 0; k < 7; k++) parity ^= (i >> k) & 1;
  return i | (parity << 7);
}

// IQ3_XXS: the 32 sign bits of a group (bit e: element e negative) from its four seven-bit indices.
inline uint32_t iq3xxs_signs(uint32_t aux) {
  uint32_t bits = 0;
  for (int k = 0; k < 4; k++) bits |= iq3xxs_ksign((aux >> (7 * k)) & 127) << (8 * k);
  return bits;
}

// IQ3_S: grid index l (0..7) of group ib: eight bits in qs, the ninth in qh.
inline int iq3s_index(const uint8_t* b, int ib, int l) { return b[2 + 8 * ib + l] | (((b[66 + ib] >> l) & 1) << 8); }

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
    case kIQ4_NL: {
      const float d = h2f(b);
      nibbles32(b + 2, q);
      for (int j = 0; j < 32; j++) y[j] = d * static_cast<float>(kIQ4Levels[q[j]]);
      break;
    }
    case kIQ4_XS: {
      const float d = h2f(b);
      for (int ib = 0; ib < 8; ib++) {
        const float dl = d * static_cast<float>(iq4xs_scale(b, ib));
        nibbles32(b + 8 + 16 * ib, q);
        for (int j = 0; j < 32; j++) y[32 * ib + j] = dl * static_cast<float>(kIQ4Levels[q[j]]);
      }
      break;
    }
    case kIQ3_XXS:
    case kIQ3_S: {
      // A group of 32: eight grid points of four values, a sign per value, one scale.
      const float d = h2f(b);
      for (int ib = 0; ib < 8; ib++) {
        float db;
        uint32_t signs;
        if (t == kIQ3_XXS) {
          const uint32_t aux = u32(b + 66 + 4 * ib);
          db = d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f;
          signs = iq3xxs_signs(aux);
        } else {
          db = d * static_cast<float>(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F));
          signs = u32(b + 74 + 4 * ib);
        }
        for (int l = 0; l < 8; l++) {
          const uint32_t point = t == kIQ3_XXS ? kIQ3XXSGrid[b[2 + 8 * ib + l]] : kIQ3SGrid[iq3s_index(b, ib, l)];
          for (int j = 0; j < 4; j++) {
            const int e = 4 * l + j;
            y[32 * ib + e] = db * static_cast<float>((point >> (8 * j)) & 0xFF) * (((signs >> e) & 1) ? -1.0f : 1.0f);
          }
        }
      }
      break;
    }
    default:
      TORCH_CHECK(false, "unsupported GGML type ", t);
  }
}


TypeInfo type_info(int t) {
  const TypeTraits& tr = traits(t);
  return {tr.block_elems, tr.block_bytes};
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

inline __m256i bits_to_mask(uint32_t x) {  // byte j = 0xFF if bit j of x is set, else 0
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
  const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
}

inline __m256i bits_to_0x10(uint32_t x) {  // byte j = 0x10 if bit j of x is set, else 0
  return _mm256_and_si256(bits_to_mask(x), _mm256_set1_epi8(0x10));
}

inline __m256i negate_where(__m256i v, uint32_t signs) {  // byte j negated where bit j of signs is set
  const __m256i neg = bits_to_mask(signs);
  return _mm256_sub_epi8(_mm256_xor_si256(v, neg), neg);
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

// IQ4: 32 indices (0..15) to their signed levels, one vpshufb (the 16 levels in both 128-bit lanes).
inline __m256i iq4_levels(__m256i idx) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Levels));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), idx);
}
template <typename F>
inline void groups_iq4_nl(const uint8_t* b, F&& f) {
  f(Group{iq4_levels(nib_lo_hi(b + 2)), _mm256_set1_epi16(1), h2f(b), 0.0f, {}, 0.0f});
}
template <typename F>
inline void groups_iq4_xs(const uint8_t* b, F&& f) {
  const float d = h2f(b);
  const __m256i one = _mm256_set1_epi16(1);
  for (int ib = 0; ib < 8; ib++)
    f(Group{iq4_levels(nib_lo_hi(b + 8 + 16 * ib)), one, d * static_cast<float>(iq4xs_scale(b, ib)), 0.0f, {}, 0.0f});
}

// IQ3_XXS's sign bytes: entry i is the eight signs (+1 / -1 bytes) of ksigns[i] (see iq3xxs_signs), so a
// group's 32 signs are four loads (ggml's keven_signs_q2xs).
struct IQ3XXSSignTable {
  uint64_t v[128];
  constexpr IQ3XXSSignTable() : v() {
    for (uint32_t i = 0; i < 128; i++) {
      const uint32_t bits = iq3xxs_ksign(i);
      uint64_t bytes = 0;
      for (int k = 0; k < 8; k++) bytes |= static_cast<uint64_t>(((bits >> k) & 1) ? 0xFF : 0x01) << (8 * k);
      v[i] = bytes;
    }
  }
};
alignas(64) constexpr IQ3XXSSignTable kIQ3XXSSigns;

// IQ3_XXS / IQ3_S: eight grid points (four byte values each, in element order), their indices made in
// one vector and read back one by one (vpgatherdd is slow on many of the CPUs this runs on), then the
// signs: the weights are the grid values with their signs, for the signed dot product.
template <typename F>
inline void groups_iq3_xxs(const uint8_t* b, F&& f) {
  const float d = h2f(b);
  const __m256i one = _mm256_set1_epi16(1);
  for (int ib = 0; ib < 8; ib++) {
    const uint8_t* q = b + 2 + 8 * ib;
    const uint32_t aux = u32(b + 66 + 4 * ib);
    auto point = [&](int l) { return static_cast<int>(kIQ3XXSGrid[q[l]]); };
    const __m256i v = _mm256_set_epi32(point(7), point(6), point(5), point(4), point(3), point(2), point(1), point(0));
    auto signs8 = [&](int k) { return static_cast<long long>(kIQ3XXSSigns.v[(aux >> (7 * k)) & 127]); };
    const __m256i sg = _mm256_set_epi64x(signs8(3), signs8(2), signs8(1), signs8(0));
    f(Group{_mm256_sign_epi8(v, sg), one, d * (0.5f + static_cast<float>(aux >> 28)) * 0.5f, 0.0f, {}, 0.0f});
  }
}
template <typename F>
inline void groups_iq3_s(const uint8_t* b, F&& f) {
  const float d = h2f(b);
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i ninth = _mm256_set1_epi32(256), shifts = _mm256_set_epi32(1, 2, 3, 4, 5, 6, 7, 8);
  alignas(32) int32_t idx[8];
  for (int ib = 0; ib < 8; ib++) {
    // Index l: qs byte l, and bit l of qh moved to bit 8.
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * ib)));
    const __m256i hi = _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(b[66 + ib]), shifts), ninth);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), _mm256_or_si256(lo, hi));
    auto point = [&](int l) { return static_cast<int>(kIQ3SGrid[idx[l]]); };
    const __m256i v = _mm256_set_epi32(point(7), point(6), point(5), point(4), point(3), point(2), point(1), point(0));
    const int sc = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    f(Group{negate_where(v, u32(b + 74 + 4 * ib)), one, d * static_cast<float>(1 + 2 * sc), 0.0f, {}, 0.0f});
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
  else if constexpr (T == kIQ4_NL) groups_iq4_nl(b, f);
  else if constexpr (T == kIQ4_XS) groups_iq4_xs(b, f);
  else if constexpr (T == kIQ3_XXS) groups_iq3_xxs(b, f);
  else if constexpr (T == kIQ3_S) groups_iq3_s(b, f);
  else groups_q6_k(b, f);
}

constexpr bool is_iq4(int T) { return T == kIQ4_NL || T == kIQ4_XS; }
constexpr bool is_iq3(int T) { return T == kIQ3_XXS || T == kIQ3_S; }
constexpr bool is_signed(int T) { return T == kQ8_0 || T == kQ3_K || T == kQ6_K || is_iq4(T) || is_iq3(T); }
constexpr bool has_mul(int T) { return T == kQ2_K || T == kQ3_K || T == kQ6_K; }
constexpr bool has_b(int T) {
  return !(T == kQ8_0 || T == kQ2_K || T == kQ3_K || T == kQ6_K || is_iq4(T) || is_iq3(T));
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
  constexpr int kGroups = find_traits(T)->block_elems / 32;  // groups of 32 per block
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
          // std::fma, not `+= b * s`: the compiler may contract that into an FMA in some of the NR x MT
          // instantiations and not in others, and then a row's sum would depend on how many rows ran beside it.
          if constexpr (has_b(T)) sacc[r][m] = std::fma(G.b, xs[m][g], sacc[r][m]);
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
    for (int m = 0; m < MT; m++) out[r * MT + m] = hsum8(acc[r][m]) + sacc[r][m];
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


// ------------------------------------------------------------------- 8-row interleaved layouts
// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights repacked at load, eight rows at a time (the idea of ggml's
// "repack" CPU buffers, in our own layout). Per tile of 8 rows and group g of 32 columns:
//   Q4_0 / Q4_1:  d[8] f16 (Q4_1: then m[8] f16), then 4 x 32 bytes: vector j, byte 4r + i holds
//                 w[r][8j + i] (low nibble) and w[r][8j + 4 + i] (high nibble)
//   Q5_0 / Q5_1:  as Q4_0 / Q4_1 for the low four bits, then 32 bytes of fifth bits: byte 4r + i,
//                 bit 2j = fifth bit of w[r][8j + i], bit 2j + 1 = that of w[r][8j + 4 + i] (so the
//                 kernel's nibble vector v takes bit v of every byte)
//   Q8_0:         d[8] f16, then 8 x 32 bytes: vector j, byte 4r + i = w[r][4j + i]
//   IQ4_NL:       as Q4_0 (the nibbles are level indices, looked up by the kernels)
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

// Q4_K / Q5_K / Q6_K tiles, per super-block of 8 rows x 256 columns (then, per group g of 32 columns,
// the quants in the Q4 lane layout above):
//   Q4_K:  d[8] f16, dmin[8] f16, scale[g][r] u8 (64), min[g][r] u8 (64), then 8 x 128 bytes of nibbles
//          (the six-bit scales and mins unpacked to bytes: 1184 bytes against the file's 1152)
//   Q5_K:  Q4_K's first 160 bytes, then per group 128 bytes of nibbles and 32 bytes of fifth bits in
//          Q5_0's form (byte 4r + i, bit v = the fifth bit of nibble vector v): 1440 against 1408
//   IQ4_XS: d[8] f16, scale[g][r] i8 (the six-bit scale minus 32, 64 bytes), then 8 x 128 bytes of level
//          indices: 1104 against 1088
//   Q2_K:  d[8] f16, dmin[8] f16, then the file's scale bytes sc[s][r] (16 sub-blocks of 16: scale in the
//          low nibble, min in the high one, 128 bytes), then per group 2 x 32 bytes of bit pairs as Q3_K's
//          low pairs; the value d * scale * q - dmin * min, q in 0..3: 672 bytes, the file's
//   Q3_K:  d[8] f16, scale[s][r] i8 (16 sub-blocks of 16, minus 32), then per group 2 x 32 bytes of low bit
//          pairs (byte 4r + i of plane p holds in bits 2k, 2k + 1 the pair of nibble vector 4p + k) and 32
//          bytes of third bits (bit v: vector v's); the quants unsigned 0..7, the value q - 4: 912
//          against 880
//   Q6_K:  d[8] f16, scale[s][r] i8 (16 sub-blocks of 16, 128 bytes), then per group 128 bytes of low
//          nibbles and 2 x 32 bytes of high bit pairs: byte 4r + i of the first holds, in bits 2v and
//          2v + 1, the high pair of nibble vector v (v = 0..3), the second of v = 4..7 (same bytes
//          as the file)
constexpr int kK4Scales = 32, kK4Mins = 96, kK4Quants = 160;
constexpr int kK5GroupBytes = 160;  // Q5_K: scales and mins where Q4_K has them, groups from kK4Quants
constexpr int kK6Scales = 16, kK6Groups = 144, kK6GroupBytes = 192;
constexpr int kXSScales = 16, kXSQuants = 80;  // IQ4_XS
constexpr int kK3Scales = 16, kK3Groups = 144, kK3GroupBytes = 96;
constexpr int kK2Scales = 32, kK2Groups = 160, kK2GroupBytes = 64;
static_assert(kK3Scales == kK6Scales, "the Q3_K / Q6_K kernels read the sub-block scales at one offset");

// Q4_K / Q5_K: where group g's nibble vectors begin in a super-block tile (Q5_K's fifth bits follow them).
constexpr int k4_group_offset(int t, int g) { return kK4Quants + (t == kQ5_K ? kK5GroupBytes : 128) * g; }

// Offset of the quants in an ordinary block of a 4/5-bit type, and its fifth bits (Q5 only).
constexpr int block_qs_offset(int t) { return t == kQ4_0 || t == kIQ4_NL ? 2 : t == kQ4_1 ? 4 : t == kQ5_0 ? 6 : 8; }
constexpr int block_qh_offset(int t) { return t == kQ5_0 ? 2 : 4; }

bool packable(int64_t qtype) { return packed_tile_bytes(static_cast<int>(qtype)) > 0; }

// Four 4-bit values per row r in the Q4 lane layout: vector j, byte 4r + i = q[8j + i] | q[8j + 4 + i] << 4.
inline void put_nibbles(const int* q, int r, uint8_t* v) {
  for (int j = 0; j < 4; j++)
    for (int i = 0; i < 4; i++) v[32 * j + 4 * r + i] = static_cast<uint8_t>((q[8 * j + i] & 15) | ((q[8 * j + 4 + i] & 15) << 4));
}

// Group g's 32 values q (0..3) of row r as bit pairs: plane p's byte 4r + i holds in bits 2k, 2k + 1 the
// pair of nibble vector 4p + k (Q2_K's quants, Q3_K's low bits), vector vv holding elements 4 vv + i.
inline void put_bit_pairs(const int* q, int r, uint8_t* v) {
  for (int i = 0; i < 4; i++) {
    uint8_t p0 = 0, p1 = 0;
    for (int vv = 0; vv < 4; vv++) {
      p0 |= static_cast<uint8_t>((q[4 * vv + i] & 3) << (2 * vv));
      p1 |= static_cast<uint8_t>((q[16 + 4 * vv + i] & 3) << (2 * vv));
    }
    v[4 * r + i] = p0;
    v[32 + 4 * r + i] = p1;
  }
}

// Row r's Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS block into its super-block tile o.
void repack_k_block(int t, const uint8_t* blk, int r, uint8_t* o) {
  if (t == kQ2_K) {
    std::memcpy(o + 2 * r, blk + 80, 2);       // d
    std::memcpy(o + 16 + 2 * r, blk + 82, 2);  // dmin
    for (int sb = 0; sb < 16; sb++) o[kK2Scales + 8 * sb + r] = blk[sb];
    for (int g = 0; g < 8; g++) {
      int q[32];
      for (int l = 0; l < 32; l++) q[l] = (blk[16 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
      put_bit_pairs(q, r, o + kK2Groups + kK2GroupBytes * g);
    }
    return;
  }
  if (t == kQ3_K) {
    std::memcpy(o + 2 * r, blk + 108, 2);  // d
    int sc[16];
    k3_scales(blk + 96, sc);
    for (int sb = 0; sb < 16; sb++) o[kK3Scales + 8 * sb + r] = static_cast<uint8_t>(static_cast<int8_t>(sc[sb]));
    for (int g = 0; g < 8; g++) {
      int q[32];  // unsigned 0..7 (dequant_block's value + 4): the low pair, and the hmask bit as bit 2
      for (int l = 0; l < 32; l++) q[l] = ((blk[32 + 32 * (g / 4) + l] >> (2 * (g % 4))) & 3) | (((blk[l] >> g) & 1) << 2);
      uint8_t* v = o + kK3Groups + kK3GroupBytes * g;
      put_bit_pairs(q, r, v);
      for (int i = 0; i < 4; i++) {  // nibble vector vv holds elements 4 vv + i (see put_nibbles)
        uint8_t h = 0;
        for (int vv = 0; vv < 8; vv++) h |= static_cast<uint8_t>(((q[4 * vv + i] >> 2) & 1) << vv);
        v[64 + 4 * r + i] = h;
      }
    }
    return;
  }
  if (t == kIQ4_XS) {
    std::memcpy(o + 2 * r, blk, 2);  // d
    for (int g = 0; g < 8; g++) {
      o[kXSScales + 8 * g + r] = static_cast<uint8_t>(static_cast<int8_t>(iq4xs_scale(blk, g)));
      int q[32];
      nibbles32(blk + 8 + 16 * g, q);
      put_nibbles(q, r, o + kXSQuants + 128 * g);
    }
    return;
  }
  if (t == kQ4_K || t == kQ5_K) {
    const bool five = t == kQ5_K;
    std::memcpy(o + 2 * r, blk, 2);           // d
    std::memcpy(o + 16 + 2 * r, blk + 2, 2);  // dmin
    int sc[8], mn[8];
    k4_scales(blk + 4, sc, mn);
    const uint8_t* qh = blk + 16;  // Q5_K: bit g of byte l is the fifth bit of element l of group g
    for (int g = 0; g < 8; g++) {
      o[kK4Scales + 8 * g + r] = static_cast<uint8_t>(sc[g]);
      o[kK4Mins + 8 * g + r] = static_cast<uint8_t>(mn[g]);
      const uint8_t* qs = blk + (five ? 48 : 16) + 32 * (g / 2);
      int q[32];
      for (int l = 0; l < 32; l++) q[l] = (g % 2 == 0 ? qs[l] & 0x0F : qs[l] >> 4) | (five ? ((qh[l] >> g) & 1) << 4 : 0);
      uint8_t* v = o + k4_group_offset(t, g);
      put_nibbles(q, r, v);
      if (five)
        for (int i = 0; i < 4; i++) {  // nibble vector vv holds elements 4 vv + i (see put_nibbles)
          uint8_t bits = 0;
          for (int vv = 0; vv < 8; vv++) bits |= static_cast<uint8_t>(((q[4 * vv + i] >> 4) & 1) << vv);
          v[128 + 4 * r + i] = bits;
        }
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

// Repacked weights live in 2 MiB pages. A decode step streams every weight once, ~1 GB for a 1.5B Q4_K_M,
// and in 4 KiB pages that is ~250,000 pages a step: the TLB misses (two-level page walks in a VM) cost the
// 1.5B's single stream a fifth of its speed on this machine class (docs/performance.md, "Weights in huge
// pages"). Where transparent huge pages are on for madvised memory (the common `madvise` setting and
// `always`), the kernel backs these chunks with 2 MiB pages at first touch; elsewhere they are ordinary
// memory. Only the weights: transient buffers stay with torch's allocator (a huge-page fault for every
// step's scratch made prefill ~10 % slower when all of torch's allocations were madvised).
//
// The weights are carved out of 64 MiB chunks, one after another, so small parts (a 1.5B's q or o, ~1.3
// MiB) share pages with their neighbours and nothing is rounded up to 2 MiB. Each tensor keeps its chunk
// alive; the current chunk is held weakly, so a chunk is freed with the last weight in it (no model's
// memory outlives the model).
namespace {

constexpr size_t kHugePageBytes = size_t(2) << 20;
constexpr size_t kWeightChunkBytes = size_t(64) << 20;

// A chunk is its own anonymous mapping trimmed to a 2 MiB boundary, not malloc's: a block that size can come
// from the heap's free lists and would go back there, still resident, when its last weight goes.
struct WeightChunk {
  uint8_t* base = nullptr;
  size_t bytes;
  size_t used = 0;  // bytes handed out, each weight from a 64-byte boundary (under g_weight_chunk_mu)
  explicit WeightChunk(size_t n) : bytes(n) {
#if defined(__linux__)
    void* raw = mmap(nullptr, n + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(raw != MAP_FAILED, "out of memory for ", n, " bytes of repacked weights");
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    if (aligned > start) munmap(raw, aligned - start);  // the unaligned head and tail go back at once
    const size_t tail = start + kHugePageBytes - aligned;  // > 0: the mapping ends at start + n + 2 MiB
    munmap(reinterpret_cast<void*>(aligned + n), tail);
    base = reinterpret_cast<uint8_t*>(aligned);
#if defined(MADV_HUGEPAGE)
    madvise(base, n, MADV_HUGEPAGE);  // a hint: fails harmlessly where THP is off
#endif
#else
    base = static_cast<uint8_t*>(std::aligned_alloc(kHugePageBytes, n));
    TORCH_CHECK(base != nullptr, "out of memory for ", n, " bytes of repacked weights");
#endif
  }
  ~WeightChunk() {
#if defined(__linux__)
    munmap(base, bytes);
#else
    std::free(base);
#endif
  }
  WeightChunk(const WeightChunk&) = delete;
  WeightChunk& operator=(const WeightChunk&) = delete;
};

std::mutex g_weight_chunk_mu;
std::weak_ptr<WeightChunk> g_weight_chunk;  // the chunk new weights go to, while any weight holds it

// An uninitialised uint8 [rows, cols] tensor for repacked weights (64-byte aligned, in a huge-page chunk).
at::Tensor weight_buffer(int64_t rows, int64_t cols) {
  const size_t bytes = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  std::shared_ptr<WeightChunk> chunk;
  size_t offset = 0;
  {
    std::lock_guard<std::mutex> lock(g_weight_chunk_mu);
    chunk = g_weight_chunk.lock();
    if (!chunk || chunk->used + bytes > chunk->bytes) {
      const size_t n = std::max(kWeightChunkBytes, (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes);
      chunk = std::make_shared<WeightChunk>(n);
      g_weight_chunk = chunk;
    }
    offset = chunk->used;
    chunk->used = (offset + bytes + 63) / 64 * 64;
  }
  auto* keep = new std::shared_ptr<WeightChunk>(std::move(chunk));
  return at::from_blob((*keep)->base + offset, {rows, cols}, [keep](void*) { delete keep; },
                       at::TensorOptions().dtype(at::kByte));
}

}  // namespace

// w [N, row_bytes] (N % 8 == 0) -> [N / 8, G * tile_bytes].
at::Tensor gguf_repack8(const at::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  const int t = static_cast<int>(qtype);
  TORCH_CHECK(packable(t), "GGML type ", t, " has no 8-row layout");
  const int64_t N = w.size(0), G = K / packed_group_elems(t), rb = w.size(1), TB = packed_tile_bytes(t);
  TORCH_CHECK(N % 8 == 0, "repacking needs a multiple of 8 rows");
  at::Tensor out = weight_buffer(N / 8, G * TB);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int bb = type_info(t).block_bytes;
  if (packed_group_elems(t) == 256) {
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

// Weights stream from memory once per step, and the tile kernels prefetch them in two stages: the
// tile (or group) 2 d ahead into L2 (_MM_HINT_T1), the one d ahead into L1 (T0). The hardware
// prefetcher alone left the batch-1 decode step at half the memory bandwidth; one L1 prefetch d ahead
// (the form before) holds one of the core's few L1 fill buffers per line for a whole DRAM latency,
// which caps the lines in flight; an L2 prefetch frees its buffer at the L2, so more lines are in
// flight, and the L1 prefetch one d later finds its line in L2 (or the L3, for a model the L3
// holds, where an L2-only prefetch lost 3-6 %). Fused step, both build orders, 2-core Xeon: 0.5B
// -19 %, 1.5B -12 % under AVX2 (docs/performance.md "Weight prefetch in two stages").
// On AMD's Zen 4 each stage costs instead (measured, not explained: perf there has no hardware
// counters): the L1 stage alone made the 1.5B's fused step 0.90x the time, and no software prefetch at
// all 0.87x of that again where a core's own stream is the limit (level where the bus is). So the
// stages are the execution plan's choice (tokenloom/model/execution_plan.py, by CPU vendor;
// TOKENLOOM_GGUF_PREFETCH): g_prefetch_stages (defined with the ISA-independent globals above).
// Hints only: the outputs do not depend on them.
template <int TB>
inline void prefetch_weights(const uint8_t* p, int d, int stages) {
  // Inline asm, not _mm_prefetch: with the stage count read before the loop, GCC 12 at -O3 emitted none
  // of the guarded _mm_prefetch calls (objdump: no prefetcht0 / prefetcht1 left in the tile kernels).
  if (stages == 2)
    for (int o = 0; o < TB; o += 64) asm volatile("prefetcht1 %0" : : "m"(p[2 * d * TB + o]));
  if (stages >= 1)
    for (int o = 0; o < TB; o += 64) asm volatile("prefetcht0 %0" : : "m"(p[d * TB + o]));
}

// d: groups of the 32-element types (176-288 bytes each) and, for the K-quants, super-block tiles
// (1,184 / 1,440 / 1,680 bytes for Q4_K / Q5_K / Q6_K). For the K-quants, L2 stages 3 and 4 tiles
// ahead measured slower than 2 (and, before the L2 stage, L1 prefetches 2 and 4 tiles ahead slower than 1).
constexpr int kPrefetchGroups = 8;
constexpr int kPrefetchTilesK = 1;

// The 8 nibble vectors of 128 bytes in the Q4 lane layout: w[v] holds elements 4v..4v+3 of each row.
inline void load_nibbles(const uint8_t* v, __m256i* w) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; j++) {
    const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * j));
    w[2 * j] = _mm256_and_si256(n, lo4);
    w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(n, 4), lo4);
  }
}

// The fifth bits of a group in the Q5 lane layout (32 bytes at h32: byte 4r + i, bit v belongs to nibble
// vector v) moved to bit 4 of each w[v] (load_nibbles' output): Q5_0, Q5_1 and Q5_K.
inline void or_fifth_bits(const uint8_t* h32, __m256i* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h32));
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

// Q6_K's high bit pairs (2 x 32 bytes at h64: byte 4r + i of the first holds in bits 2v, 2v + 1 the pair of
// nibble vector v = 0..3, the second's of v = 4..7) moved to bits 4-5 of each w[v].
inline void or_high_pairs(const uint8_t* h64, __m256i* w) {
  const __m256i m3 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; half++) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h64 + 32 * half));
    __m256i* v = w + 4 * half;
    v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), m3));
    v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 2), m3));
    v[2] = _mm256_or_si256(v[2], _mm256_and_si256(h, m3));
    v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi16(h, 2), m3));
  }
}

// Two planes of bit pairs (64 bytes at v, put_bit_pairs' form) as 0..3 in w[0..7] (load_nibbles' order).
inline void load_bit_pairs(const uint8_t* v, __m256i* w) {
  const __m256i m3 = _mm256_set1_epi8(3);
  for (int p = 0; p < 2; p++) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 32 * p));
    for (int k = 0; k < 4; k++) w[4 * p + k] = _mm256_and_si256(_mm256_srli_epi16(pairs, 2 * k), m3);
  }
}

// A Q3_K tile group (96 bytes at v, see the layout above) as unsigned 0..7 in w[0..7] (load_nibbles' order).
inline void load_q3(const uint8_t* v, __m256i* w) {
  const __m256i b2 = _mm256_set1_epi8(4);
  load_bit_pairs(v, w);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 64));  // bit v of each byte: to bit 2
  w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 2), b2));
  w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 1), b2));
  w[2] = _mm256_or_si256(w[2], _mm256_and_si256(h, b2));
  for (int k = 3; k < 8; k++) w[k] = _mm256_or_si256(w[k], _mm256_and_si256(_mm256_srli_epi16(h, k - 2), b2));
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
  const int stages = prefetch_stages();
  // Q8_0's one-row form sums odd groups into accb unless batch-invariant (then as MT > 1: all in acc).
  const int64_t odd = T == kQ8_0 && MT == 1 && !batch_invariant() ? 1 : 0;
  for (int64_t g = 0; g < G; g++) {
    const uint8_t* p = tile + g * TB;
    prefetch_weights<TB>(p, kPrefetchGroups, stages);
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
      if (g & odd)
        accb[0] = _mm256_fmadd_ps(sum, sc, accb[0]);
      else
        acc[0] = _mm256_fmadd_ps(sum, sc, acc[0]);
    } else if constexpr (T == kQ8_0 || T == kIQ4_NL) {  // signed weights: |w| x (x with w's sign)
      __m256i w[8], wa[8];
      if constexpr (T == kIQ4_NL) {
        load_nibbles(p + 16, w);
        for (int j = 0; j < 8; j++) w[j] = iq4_levels(w[j]);
      } else {
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * j));
      }
      for (int j = 0; j < 8; j++) wa[j] = _mm256_sign_epi8(w[j], w[j]);
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
      if constexpr (five) or_fifth_bits(p + off + 128, w);
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

// Q4_K / Q5_K / Q6_K over their super-block tiles (NS super-blocks of 256 columns): out lanes = the 8 rows.
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
// products isum * scale stay below 2^24 (Q4_K: 32 * 15 * 127 * 63; Q5_K: 32 * 31 * 127 * 63; Q6_K:
// 2 * 16 * 32 * 127 * 128),
// so even their float conversion is exact.
template <int T, int MT>
inline void packed_tile_k(const uint8_t* tile, int64_t NS, const int8_t* const* xq, const float* const* xd,
                          const float* const* xs, const int16_t* const* xb, __m256* res) {
  constexpr int TB = packed_tile_bytes(T);
  __m256 acc[MT], accb[MT];
  for (int m = 0; m < MT; m++) acc[m] = accb[m] = _mm256_setzero_ps();
  const int stages = prefetch_stages();
  for (int64_t sb = 0; sb < NS; sb++) {
    const uint8_t* p = tile + sb * TB;
    prefetch_weights<TB>(p, kPrefetchTilesK, stages);
    __m256 sacc[MT], macc[MT];  // this super-block's sums before d (and, Q4_K / Q5_K, before dmin)
    for (int m = 0; m < MT; m++) sacc[m] = macc[m] = _mm256_setzero_ps();
    if constexpr (T == kQ4_K || T == kQ5_K) {
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
        load_nibbles(p + k4_group_offset(T, g), w);
        if constexpr (T == kQ5_K) or_fifth_bits(p + k4_group_offset(T, g) + 128, w);
        for (int m = 0; m < MT; m++) {
          const int8_t* x = xq[m] + 32 * gi;
#if TLQ_VNNI
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u4(w, x)), _mm256_mul_ps(scf, _mm256_set1_ps(xd[m][gi])),
                                    sacc[m]);
#else
          __m256i isum;
          if constexpr (T == kQ4_K) {
            // int16 sums of eight vpmaddubsw stay below 8 * 2 * 15 * 127 = 30480 (see dot_u4).
            __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(x));
            for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
            isum = _mm256_madd_epi16(s16, sc16);
          } else {
            // 5-bit quants: two chains of four, each below 4 * 2 * 31 * 127 = 31496 in int16.
            __m256i lo = _mm256_maddubs_epi16(w[0], bcast4(x)), hi = _mm256_maddubs_epi16(w[4], bcast4(x + 16));
            for (int j = 1; j < 4; j++) {
              lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
              hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[4 + j], bcast4(x + 16 + 4 * j)));
            }
            isum = _mm256_add_epi32(_mm256_madd_epi16(lo, sc16), _mm256_madd_epi16(hi, sc16));
          }
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
    } else if constexpr (T == kQ2_K) {
      // Quants 0..3 times the sub-block scale, minus the sub-block min times the activation's per-16 sum:
      // two integer sums per group and row, d and dmin once per super-block. The sums stay exact in
      // float: |scaled| <= 2 * 16 * 3 * 127 * 15 = 182880, |mins| <= 2 * 15 * 16 * 127 = 60960.
      for (int g = 0; g < 8; g++) {
        const int64_t gi = 8 * sb + g;
        auto bytes8 = [&](int sub) {
          return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK2Scales + 8 * sub)));
        };
        const __m256i b_lo = bytes8(2 * g), b_hi = bytes8(2 * g + 1), lo4 = _mm256_set1_epi32(0x0F);
        const __m256i sc_lo = _mm256_and_si256(b_lo, lo4), sc_hi = _mm256_and_si256(b_hi, lo4);
        // The two mins in the int16 halves of each lane (low: columns 0..15): one vpmaddwd with the two bsums.
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(b_lo, 4), _mm256_slli_epi32(_mm256_srli_epi32(b_hi, 4), 16));
#if !TLQ_VNNI
        const __m256i sc16_lo = _mm256_or_si256(sc_lo, _mm256_slli_epi32(sc_lo, 16));  // the scale in both halves
        const __m256i sc16_hi = _mm256_or_si256(sc_hi, _mm256_slli_epi32(sc_hi, 16));
#endif
        __m256i w[8];
        load_bit_pairs(p + kK2Groups + kK2GroupBytes * g, w);
        for (int m = 0; m < MT; m++) {
          const int8_t* x = xq[m] + 32 * gi;
          const uint32_t bs = static_cast<uint16_t>(xb[m][2 * gi]) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(xb[m][2 * gi + 1])) << 16);
#if TLQ_VNNI
          __m256i lo = dpbusd(_mm256_setzero_si256(), w[0], bcast4(x));
          __m256i hi = dpbusd(_mm256_setzero_si256(), w[4], bcast4(x + 16));
          for (int j = 1; j < 4; j++) {
            lo = dpbusd(lo, w[j], bcast4(x + 4 * j));
            hi = dpbusd(hi, w[4 + j], bcast4(x + 16 + 4 * j));
          }
          const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(lo, sc_lo), _mm256_mullo_epi32(hi, sc_hi));
#else
          // Four vpmaddubsw results of 2-bit quants stay below 4 * 2 * 3 * 127 = 3048 in int16.
          __m256i lo = _mm256_maddubs_epi16(w[0], bcast4(x)), hi = _mm256_maddubs_epi16(w[4], bcast4(x + 16));
          for (int j = 1; j < 4; j++) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[4 + j], bcast4(x + 16 + 4 * j)));
          }
          const __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(lo, sc16_lo), _mm256_madd_epi16(hi, sc16_hi));
#endif
          const __m256i imin = _mm256_madd_epi16(mn, _mm256_set1_epi32(static_cast<int>(bs)));
          const __m256 dx = _mm256_set1_ps(xd[m][gi]);
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dx, sacc[m]);
          macc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), dx, macc[m]);
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      for (int m = 0; m < MT; m++) {
        acc[m] = _mm256_fmadd_ps(sacc[m], dv, acc[m]);
        accb[m] = _mm256_fnmadd_ps(macc[m], mv, accb[m]);  // - dmin * sum(min * bsum * d_x)
      }
    } else if constexpr (T == kIQ4_XS) {  // signed levels (|w| x x with w's sign), one signed scale per group
      for (int g = 0; g < 8; g++) {
        const int64_t gi = 8 * sb + g;
        const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kXSScales + 8 * g)));
#if TLQ_VNNI
        const __m256 scf = _mm256_cvtepi32_ps(sc);
#else
        // The signed scale in both int16 halves of its lane (a blend: an OR would keep the sign bits).
        const __m256i sc16 = _mm256_blend_epi16(sc, _mm256_slli_epi32(sc, 16), 0xAA);
#endif
        __m256i w[8], wa[8];
        load_nibbles(p + kXSQuants + 128 * g, w);
        for (int j = 0; j < 8; j++) {
          w[j] = iq4_levels(w[j]);
          wa[j] = _mm256_sign_epi8(w[j], w[j]);
        }
        for (int m = 0; m < MT; m++) {
          const int8_t* x = xq[m] + 32 * gi;
          auto xs8 = [&](int j) { return _mm256_sign_epi8(bcast4(x + 4 * j), w[j]); };
#if TLQ_VNNI
          __m256i s0 = dpbusd(_mm256_setzero_si256(), wa[0], xs8(0)), s1 = dpbusd(_mm256_setzero_si256(), wa[1], xs8(1));
          for (int j = 2; j < 8; j += 2) {
            s0 = dpbusd(s0, wa[j], xs8(j));
            s1 = dpbusd(s1, wa[j + 1], xs8(j + 1));
          }
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                                    _mm256_mul_ps(scf, _mm256_set1_ps(xd[m][gi])), sacc[m]);
#else
          // One vpmaddubsw's pair sums of |level| <= 127 by |x| <= 127 stay below 2 * 127 * 127 = 32258 in
          // int16, so each is scaled on its own by vpmaddwd (|sum| <= 32 * 127 * 127 * 32 < 2^24).
          __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[0], xs8(0)), sc16);
          for (int j = 1; j < 8; j++) isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], xs8(j)), sc16));
          sacc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(xd[m][gi]), sacc[m]);
#endif
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      for (int m = 0; m < MT; m++) acc[m] = _mm256_fmadd_ps(sacc[m], dv, acc[m]);
    } else {  // Q6_K / Q3_K: quants q in 0..63 / 0..7 (the value is q - 32 / q - 4), a scale per 16 columns
      // kK3Scales == kK6Scales: the sub-block scales sit at the same offset in both tiles.
      constexpr int kOff = T == kQ6_K ? 32 : 4;
      for (int g = 0; g < 8; g++) {
        const int64_t gi = 8 * sb + g;
        auto scale8 = [&](int sub) {
          return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK6Scales + 8 * sub)));
        };
        const __m256i sc_lo = scale8(2 * g), sc_hi = scale8(2 * g + 1);
        __m256i w[8];
        if constexpr (T == kQ6_K) {
          const uint8_t* v = p + kK6Groups + kK6GroupBytes * g;
          load_nibbles(v, w);
          or_high_pairs(v + 128, w);
        } else {
          load_q3(p + kK3Groups + kK3GroupBytes * g, w);
        }
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
          lo = _mm256_mullo_epi32(_mm256_sub_epi32(lo, _mm256_set1_epi32(kOff * bs_lo)), sc_lo);
          hi = _mm256_mullo_epi32(_mm256_sub_epi32(hi, _mm256_set1_epi32(kOff * bs_hi)), sc_hi);
#else
          // Two u8 (<= 63) x s8 products per int16 lane, two such summed: <= 4 * 63 * 127 = 32004.
          auto pair = [&](int j) {
            return _mm256_add_epi16(_mm256_maddubs_epi16(w[j], bcast4(x + 4 * j)),
                                    _mm256_maddubs_epi16(w[j + 1], bcast4(x + 4 * j + 4)));
          };
          // sc * sum(q x) - sc * kOff * bs: the second as vpmaddwd of sc in both halves with kOff / 2 * bs
          // (|16 * bs| <= 16 * 16 * 127 = 32512 fits int16).
          __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(pair(0), sc16_lo), _mm256_madd_epi16(pair(2), sc16_lo));
          __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(pair(4), sc16_hi), _mm256_madd_epi16(pair(6), sc16_hi));
          lo = _mm256_sub_epi32(lo, _mm256_madd_epi16(sc16_lo, _mm256_set1_epi16(static_cast<short>(kOff / 2 * bs_lo))));
          hi = _mm256_sub_epi32(hi, _mm256_madd_epi16(sc16_hi, _mm256_set1_epi16(static_cast<short>(kOff / 2 * bs_hi))));
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
void linear_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                         TileCursor& cur) {
  const int64_t M = a.M, K = a.K, G = K / 32, TB = packed_tile_bytes(T), NG = K / packed_group_elems(T);
  // Tile outer, rows inner: a tile (8 rows x K, a few KB) stays in L1 while every group of 4
  // activation rows passes over it, so a prefill-sized M reads the weights once, not M / 4 times.
  cur.for_each_tile([&](int64_t tile) {
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
  });
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
  if (packed_group_elems(t) == 256) {
    for (int64_t sb = 0; sb < G; sb++) {
      const uint8_t* p = pw + (tile * G + sb) * TB;
      for (int r = 0; r < 8; r++) {
        const float d = h2f(p + 2 * r);
        float* o = out + r * ldo + 256 * sb;
        for (int g = 0; g < 8; g++) {
          const uint8_t* v = p + (t == kQ6_K    ? kK6Groups + kK6GroupBytes * g
                                  : t == kIQ4_XS ? kXSQuants + 128 * g
                                                 : k4_group_offset(t, g));
          for (int e = 0; e < 32; e++) {
            const int vv = e / 4, i = e % 4;  // nibble vector vv, byte 4r + i
            if (t == kQ2_K) {
              const uint8_t* w2 = p + kK2Groups + kK2GroupBytes * g;
              const int q2 = (w2[32 * (vv / 4) + 4 * r + i] >> (2 * (vv % 4))) & 3;
              const uint8_t scm = p[kK2Scales + 8 * (2 * g + e / 16) + r];
              o[32 * g + e] = d * static_cast<float>(scm & 0x0F) * q2 - h2f(p + 16 + 2 * r) * static_cast<float>(scm >> 4);
              continue;
            }
            if (t == kQ3_K) {
              const uint8_t* w3 = p + kK3Groups + kK3GroupBytes * g;
              const int q3 = ((w3[32 * (vv / 4) + 4 * r + i] >> (2 * (vv % 4))) & 3) | (((w3[64 + 4 * r + i] >> vv) & 1) << 2);
              const int8_t sc = static_cast<int8_t>(p[kK3Scales + 8 * (2 * g + e / 16) + r]);
              o[32 * g + e] = d * static_cast<float>(sc) * (q3 - 4);
              continue;
            }
            const uint8_t b = v[32 * (vv / 2) + 4 * r + i];
            int q = vv % 2 == 0 ? b & 0x0F : b >> 4;
            if (t == kIQ4_XS) {
              const int8_t sc = static_cast<int8_t>(p[kXSScales + 8 * g + r]);
              o[32 * g + e] = d * static_cast<float>(sc) * static_cast<float>(kIQ4Levels[q]);
            } else if (t != kQ6_K) {  // Q4_K / Q5_K
              if (t == kQ5_K) q |= ((v[128 + 4 * r + i] >> vv) & 1) << 4;
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
          if (t == kIQ4_NL) {
            o[8 * j + i] = d * static_cast<float>(kIQ4Levels[lo]);
            o[8 * j + 4 + i] = d * static_cast<float>(kIQ4Levels[hi]);
          } else if (has_min) {
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
  const TileRunKernel simd = traits(t).tile;
  if (simd && !g_force_scalar) {
    TileCursor all;
    all.set(t0, t1);
    return simd(a, pw, bias, out, ldo, all);
  }
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

// The tiles of `cur` (see TileCursor): the SIMD kernel's own loop, or the plain one a tile at a time.
void run_packed_cursor(int t, const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                       TileCursor& cur) {
  const TileRunKernel simd = traits(t).tile;
  if (simd && !g_force_scalar) return simd(a, pw, bias, out, ldo, cur);
  cur.for_each_tile([&](int64_t tile) { run_packed_range(t, a, pw, bias, out, ldo, tile, tile + 1); });
}

int64_t tile_grain(int64_t tiles) {
  return std::max<int64_t>(1, std::min<int64_t>(8, tiles / (4 * at::get_num_threads()) + 1));
}

// The tiles start as contiguous halves and a thread that ends its own steals from another's end
// (TileCursor, gguf_quants.h), as the fused step's linears do: on a VM's two cores, rarely equally
// fast, a static split left the faster spinning at the join (the 1.5B's 191 MB LM head is a fifth of
// its decode step).
void run_packed(int t, const QAct& a, const uint8_t* pw, int64_t tiles, const float* bias, float* out, int64_t ldo) {
  const int64_t grain = tile_grain(tiles);
  const int nth = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain));
  if (nth <= 1 || at::in_parallel_region()) {
    run_packed_range(t, a, pw, bias, out, ldo, 0, tiles);
    return;
  }
  std::vector<TileCursor> cursors(nth);
#pragma omp parallel num_threads(nth)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    steal_init(cursors.data(), tiles, tid, n);
#pragma omp barrier
    steal_run(cursors.data(), tid, n, [&](TileCursor& c) { run_packed_cursor(t, a, pw, bias, out, ldo, c); });
  }
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
// With AVX-512 VNNI a tile pair's vector j (2 x 8 rows x 4 columns) is one 64-byte register: the
// chunk holds the pair interleaved, and r8_kernel512 runs kGemm512MR activation rows per call on
// one zmm accumulator each (per 64 products one vpdpbusd and one broadcast, against two of each
// and, for signed types, two sign flips on 256-bit registers).
constexpr int kGemmChunk = 16;  // groups of 32 columns per unpacked chunk (a multiple of 8: whole K-quant super-blocks)
#ifndef TLQ_GEMM_MR
#define TLQ_GEMM_MR 2
#endif
#ifndef TLQ_GEMM_NT
#define TLQ_GEMM_NT 2
#endif
constexpr int kGemmMR = TLQ_GEMM_MR;  // activation rows per micro-kernel call
constexpr int kGemmNT = TLQ_GEMM_NT;  // tiles per micro-kernel call (1 or 2)
// The 512-bit micro-kernel (r8_kernel512): AVX-512 VNNI, tile pairs.
#if TLQ_VNNI && TLQ_GEMM_NT == 2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TLQ_GEMM512 1
#else
#define TLQ_GEMM512 0
#endif

// Activation rows per block: the block's int8 rows (rows x K bytes) within 40 % of this core's L2
// (at least 192 KB).
int64_t gemm_row_block(int64_t K) {
  static const int64_t budget = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::max<int64_t>(192 * 1024, l2 > 0 ? static_cast<int64_t>(l2) * 2 / 5 : 0);
  }();
  return std::max<int64_t>(16, std::min<int64_t>(128, (budget / K) & ~int64_t{3}));
}

#if TLQ_AVX2
// kGemmNT tiles' unpacked chunk, interleaved: group g's vector j of tile t at q + qoff(g, j, t) (the
// tiles' vectors j side by side: one 64-byte load takes a pair), the 8 rows' factors of group g and
// tile t at a + foff(g, t) (a pair's 16 side by side).
struct R8Chunk {
  alignas(64) uint8_t q[kGemmChunk * 256 * kGemmNT];
  alignas(64) float a[kGemmChunk * 8 * kGemmNT];
  alignas(64) float a2[kGemmChunk * 8 * kGemmNT];
  alignas(64) float b[kGemmChunk * 8 * kGemmNT];
  alignas(64) float b2[kGemmChunk * 8 * kGemmNT];  // Q2_K: the min of columns 16..31 (b: of 0..15)
  static constexpr int qoff(int g, int j, int t) { return 32 * ((8 * g + j) * kGemmNT + t); }
  static constexpr int foff(int g, int t) { return 8 * (g * kGemmNT + t); }
};

// Per-type knowledge of the batched GEMM, in one place.
//   kOffset     VNNI: a signed type's integers taken unsigned, w + 128 (Q8_0, IQ4_*) or the stored
//               quants before their offset of 32 / 4 (Q6_K / Q3_K). vpdpbusd sums u8 x s8 into int32
//               with no int16 step, and sum((w + o) x) - o sum(x) = sum(w x): the kernel subtracts
//               o times the activation's integer sums (bs, per 16) from each group's int32 sum, the
//               same integers as the signed form without its two sign flips per product
//   kSigned     signed integers: vpmaddubsw takes |w| and x with w's sign (the same types on AVX2)
//   kTwoScales  a per 16 columns (a for vectors 0..3, a2 for 4..7): Q2_K, Q3_K, Q6_K
//   kHasB       an s_x term (offset or min)
//   kMins16     a min per 16 columns (b, b2) meeting the activation's per-16 sums d_x * bs: Q2_K
//   kChain      vpmaddubsw results summed in int16 before vpmaddwd (AVX2): 8 for 4-bit quants
//               (< 8 * 2 * 15 * 127 = 30480), 4 for 5-bit and Q6_K (< 4 * 2 * 32 * 127 = 32512) and for
//               Q2_K / Q3_K (their two scales split a group's vectors at 4),
//               1 for Q8_0 (one product pair already reaches 2 * 128 * 127)
//   unpack      groups [g0, g0 + n) of one tile (its first byte: tp) into the chunk
template <int T>
struct R8Type {
  static constexpr bool kSignedType = T == kQ8_0 || T == kQ3_K || T == kQ6_K || is_iq4(T);
  static constexpr bool kOffset = TLQ_VNNI && kSignedType;
  static constexpr int kOffsetValue = T == kQ6_K ? 32 : T == kQ3_K ? 4 : 128;  // kOffset: bytes = w + this
  static constexpr bool kSigned = kSignedType && !kOffset;
  static constexpr bool kTwoScales = T == kQ2_K || T == kQ3_K || T == kQ6_K;
  static constexpr bool kMins16 = T == kQ2_K;
  static constexpr bool kHasB = !kSignedType && !kMins16;
  static constexpr int kChain = (T == kQ8_0 || is_iq4(T))                                                 ? 1
                                : (T == kQ5_0 || T == kQ5_1 || T == kQ5_K || kTwoScales) ? 4
                                                                                         : 8;

  // Groups [g0, g0 + n) of one tile (its first byte: tp) into slot t of the chunk.
  static void unpack(const uint8_t* tp, int64_t g0, int n, R8Chunk& c, int t) {
    constexpr int TB = packed_tile_bytes(T);
    for (int i = 0; i < n; i++) {
      const int64_t g = g0 + i;
      float* a = c.a + R8Chunk::foff(i, t);
      float* a2 = c.a2 + R8Chunk::foff(i, t);
      float* b = c.b + R8Chunk::foff(i, t);
      float* b2 = c.b2 + R8Chunk::foff(i, t);
      __m256i w[8];
      if constexpr (packed_group_elems(T) == 256) {
        const uint8_t* p = tp + (g / 8) * TB;
        const int s = static_cast<int>(g % 8);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        if constexpr (T == kQ4_K || T == kQ5_K) {
          auto bytes8 = [&](int off) {
            return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + off + 8 * s))));
          };
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
          _mm256_store_ps(a, _mm256_mul_ps(dv, bytes8(kK4Scales)));
          _mm256_store_ps(b, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(mv, bytes8(kK4Mins))));
          load_nibbles(p + k4_group_offset(T, s), w);
          if constexpr (T == kQ5_K) or_fifth_bits(p + k4_group_offset(T, s) + 128, w);
        } else if constexpr (T == kQ2_K) {
          auto bytes8 = [&](int sub) {
            return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK2Scales + 8 * sub)));
          };
          const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
          const __m256i lo4 = _mm256_set1_epi32(0x0F);
          for (int half = 0; half < 2; half++) {
            const __m256i sm = bytes8(2 * s + half);
            _mm256_store_ps(half ? a2 : a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(sm, lo4))));
            _mm256_store_ps(half ? b2 : b,
                            _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_srli_epi32(sm, 4)))));
          }
          load_bit_pairs(p + kK2Groups + kK2GroupBytes * s, w);
        } else if constexpr (T == kIQ4_XS) {
          _mm256_store_ps(a, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kXSScales + 8 * s))))));
          load_nibbles(p + kXSQuants + 128 * s, w);
          for (int j = 0; j < 8; j++) w[j] = iq4_levels(w[j]);
          if constexpr (kOffset) flip_sign_bits(w);
        } else {  // Q6_K / Q3_K: a scale per 16 (at the same offset in both tiles), quants minus 32 / 4
          auto scale8 = [&](int sub) {
            return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kK6Scales + 8 * sub)))));
          };
          _mm256_store_ps(a, scale8(2 * s));
          _mm256_store_ps(a2, scale8(2 * s + 1));
          if constexpr (T == kQ6_K) {
            const uint8_t* v = p + kK6Groups + kK6GroupBytes * s;
            load_nibbles(v, w);
            or_high_pairs(v + 128, w);
          } else {
            load_q3(p + kK3Groups + kK3GroupBytes * s, w);
          }
          if constexpr (!kOffset) {  // kOffset keeps the stored quants
            const __m256i off = _mm256_set1_epi8(kOffsetValue);
            for (int j = 0; j < 8; j++) w[j] = _mm256_sub_epi8(w[j], off);
          }
        }
      } else {
        const uint8_t* p = tp + g * TB;
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        _mm256_store_ps(a, dv);
        if constexpr (T == kQ8_0) {
          for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 + 32 * j));
          if constexpr (kOffset) flip_sign_bits(w);
        } else if constexpr (T == kIQ4_NL) {
          load_nibbles(p + 16, w);
          for (int j = 0; j < 8; j++) w[j] = iq4_levels(w[j]);
          if constexpr (kOffset) flip_sign_bits(w);
        } else {
          constexpr int off = packed_nibble_offset(T);
          constexpr bool five = packed_five_bit(T);
          load_nibbles(p + off, w);
          if constexpr (five) or_fifth_bits(p + off + 128, w);
          // Q4_1 / Q5_1: + m * s_x; Q4_0 / Q5_0: quants offset by 8 / 16, so - 8 d * s_x / - 16 d * s_x.
          _mm256_store_ps(b, packed_has_min(T) ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))
                                               : _mm256_mul_ps(dv, _mm256_set1_ps(five ? -16.0f : -8.0f)));
        }
      }
      for (int j = 0; j < 8; j++) _mm256_store_si256(reinterpret_cast<__m256i*>(c.q + R8Chunk::qoff(i, j, t)), w[j]);
    }
  }

  // kOffset's w + 128 as unsigned bytes: the sign bit flipped.
  static void flip_sign_bits(__m256i* w) {
    const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; j++) w[j] = _mm256_xor_si256(w[j], sign);
  }

  // kOffset: o sum(x) per scale, to take from the int32 sums (s: columns 0..15, or the group's 32;
  // s2: columns 16..31). bs: the activation row's per-16 integer sums at the group.
  static int offset_sum(const int16_t* bs) { return kOffsetValue * (kTwoScales ? bs[0] : bs[0] + bs[1]); }
  static int offset_sum2(const int16_t* bs) { return kOffsetValue * bs[1]; }
};

// MT activation rows x NT unpacked tiles over a chunk's n groups. acc [MT][kGemmNT][8]: the float
// sums so far (zeroed when `first`), updated. xq / xd / xs: the rows' bytes, d and s at the chunk.
template <int T, int MT, int NT>
inline void r8_kernel(const R8Chunk& c, int n, const int8_t* const* xq, const float* const* xd,
                      const float* const* xs, const int16_t* const* xb, float* acc, bool first) {
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
        w[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q + R8Chunk::qoff(g, j, t)));
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
          w[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(c.q + R8Chunk::qoff(g, j, t)));
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
    if constexpr (R::kOffset)
      for (int m = 0; m < MT; m++) {
        const __m256i o = _mm256_set1_epi32(R::offset_sum(xb[m] + 2 * g));
        for (int t = 0; t < NT; t++) s[m][t] = _mm256_sub_epi32(s[m][t], o);
        if constexpr (R::kTwoScales) {
          const __m256i o2 = _mm256_set1_epi32(R::offset_sum2(xb[m] + 2 * g));
          for (int t = 0; t < NT; t++) s2[m][t] = _mm256_sub_epi32(s2[m][t], o2);
        }
      }
    for (int m = 0; m < MT; m++) {
      const __m256 dx = _mm256_set1_ps(xd[m][g]);
      for (int t = 0; t < NT; t++) {
        const int fo = R8Chunk::foff(g, t);
        f[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][t]), _mm256_mul_ps(_mm256_load_ps(c.a + fo), dx), f[m][t]);
        if constexpr (R::kTwoScales)
          f[m][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2[m][t]), _mm256_mul_ps(_mm256_load_ps(c.a2 + fo), dx), f[m][t]);
        if constexpr (R::kHasB) f[m][t] = _mm256_fmadd_ps(_mm256_load_ps(c.b + fo), _mm256_set1_ps(xs[m][g]), f[m][t]);
        if constexpr (R::kMins16) {
          f[m][t] = _mm256_fmadd_ps(_mm256_load_ps(c.b + fo), _mm256_set1_ps(xd[m][g] * xb[m][2 * g]), f[m][t]);
          f[m][t] = _mm256_fmadd_ps(_mm256_load_ps(c.b2 + fo), _mm256_set1_ps(xd[m][g] * xb[m][2 * g + 1]), f[m][t]);
        }
      }
    }
  }
  for (int m = 0; m < MT; m++)
    for (int t = 0; t < NT; t++) _mm256_storeu_ps(acc + (m * kGemmNT + t) * 8, f[m][t]);
}

// run(std::integral_constant<int, mt>{}) for a row count mt in 1..MT known only at run time: the
// micro-kernels' row tails.
template <int MT, typename F>
inline void with_rows(int mt, F&& run) {
  if constexpr (MT == 1) {
    run(std::integral_constant<int, 1>{});
  } else {
    if (mt == MT) return run(std::integral_constant<int, MT>{});
    with_rows<MT - 1>(mt, run);
  }
}

#if TLQ_GEMM512
constexpr int kGemm512MR = 4;  // activation rows per r8_kernel512 call: 3 zmm (s, s2, f) each

// r8_kernel on a tile pair in 512-bit registers: lanes 0..7 tile 0's rows, 8..15 tile 1's. The
// same integers and the same float formula per group as r8_kernel (kOffset: no signed types here),
// so the same outputs.
template <int T, int MT>
inline void r8_kernel512(const R8Chunk& c, int n, const int8_t* const* xq, const float* const* xd,
                         const float* const* xs, const int16_t* const* xb, float* acc, bool first) {
  using R = R8Type<T>;
  static_assert(kGemmNT == 2 && !R::kSigned, "a tile pair per register, unsigned weight bytes");
  __m512 f[MT];
  for (int m = 0; m < MT; m++) f[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + m * 16);
  for (int g = 0; g < n; g++) {
    // Two int32 chains per sum (vectors j even / odd), added at the group's end: vpdpbusd's latency
    // (4-5 cycles) over MT chains alone would cap it below one a cycle. Integer sums: the same values.
    __m512i s[MT], s2[MT], t[MT], t2[MT];
    for (int m = 0; m < MT; m++) s[m] = s2[m] = t[m] = t2[m] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
      const __m512i w = _mm512_load_si512(c.q + R8Chunk::qoff(g, j, 0));
      for (int m = 0; m < MT; m++) {
        int32_t v;
        std::memcpy(&v, xq[m] + 32 * g + 4 * j, 4);
        const __m512i xv = _mm512_set1_epi32(v);
        __m512i& acc_j = R::kTwoScales && j >= 4 ? (j & 1 ? t2[m] : s2[m]) : (j & 1 ? t[m] : s[m]);
        acc_j = _mm512_dpbusd_epi32(acc_j, w, xv);
      }
    }
    for (int m = 0; m < MT; m++) {
      s[m] = _mm512_add_epi32(s[m], t[m]);
      if constexpr (R::kTwoScales) s2[m] = _mm512_add_epi32(s2[m], t2[m]);
    }
    const int fo = R8Chunk::foff(g, 0);
    const __m512 av = _mm512_load_ps(c.a + fo);
    for (int m = 0; m < MT; m++) {
      if constexpr (R::kOffset) {
        s[m] = _mm512_sub_epi32(s[m], _mm512_set1_epi32(R::offset_sum(xb[m] + 2 * g)));
        if constexpr (R::kTwoScales) s2[m] = _mm512_sub_epi32(s2[m], _mm512_set1_epi32(R::offset_sum2(xb[m] + 2 * g)));
      }
      const __m512 dx = _mm512_set1_ps(xd[m][g]);
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(av, dx), f[m]);
      if constexpr (R::kTwoScales)
        f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s2[m]), _mm512_mul_ps(_mm512_load_ps(c.a2 + fo), dx), f[m]);
      if constexpr (R::kHasB) f[m] = _mm512_fmadd_ps(_mm512_load_ps(c.b + fo), _mm512_set1_ps(xs[m][g]), f[m]);
      if constexpr (R::kMins16) {
        f[m] = _mm512_fmadd_ps(_mm512_load_ps(c.b + fo), _mm512_set1_ps(xd[m][g] * xb[m][2 * g]), f[m]);
        f[m] = _mm512_fmadd_ps(_mm512_load_ps(c.b2 + fo), _mm512_set1_ps(xd[m][g] * xb[m][2 * g + 1]), f[m]);
      }
    }
  }
  for (int m = 0; m < MT; m++) _mm512_storeu_ps(acc + m * 16, f[m]);
}

#else
constexpr int kGemm512MR = 1;
#endif

// Tiles [t0, t1) of out = x @ W.T + bias over all M rows: one thread's share.
template <int T>
void gemm_packed_range(const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                       int64_t t1) {
  const int64_t M = a.M, K = a.K, G = K / 32, tile_bytes = K / packed_group_elems(T) * packed_tile_bytes(T);
  const int64_t MB = gemm_row_block(K);
  thread_local R8Chunk chunk;
  thread_local std::vector<float> accbuf;
  accbuf.resize(MB * kGemmNT * 8);
  float* acc = accbuf.data();
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    for (int64_t tile = t0; tile < t1; tile += kGemmNT) {
      const int nt = static_cast<int>(std::min<int64_t>(kGemmNT, t1 - tile));
      for (int64_t g0 = 0; g0 < G; g0 += kGemmChunk) {
        const int n = static_cast<int>(std::min<int64_t>(kGemmChunk, G - g0));
        for (int t = 0; t < nt; t++) R8Type<T>::unpack(pw + (tile + t) * tile_bytes, g0, n, chunk, t);
#if TLQ_GEMM512
        const bool wide = nt == kGemmNT;  // a whole pair: the 512-bit kernel
        const int64_t mr = wide ? kGemm512MR : kGemmMR;
#else
        const int64_t mr = kGemmMR;
#endif
        for (int64_t m = 0; m < mb; m += mr) {
          const int mt = static_cast<int>(std::min<int64_t>(mr, mb - m));
          constexpr int kMaxMR = std::max(kGemmMR, kGemm512MR);
          const int8_t* xq[kMaxMR];
          const float* xd[kMaxMR];
          const float* xs[kMaxMR];
          const int16_t* xb[kMaxMR];
          for (int i = 0; i < mt; i++) {
            const int64_t row = m0 + m + i;
            xq[i] = a.q.data() + row * K + 32 * g0;
            xd[i] = a.d.data() + row * G + g0;
            xs[i] = a.s.data() + row * G + g0;
            xb[i] = a.bs.data() + row * 2 * G + 2 * g0;
          }
          float* ac = acc + m * kGemmNT * 8;
#if TLQ_GEMM512
          if (wide) {
            with_rows<kGemm512MR>(mt, [&](auto rows) {
              r8_kernel512<T, decltype(rows)::value>(chunk, n, xq, xd, xs, xb, ac, g0 == 0);
            });
            continue;
          }
#endif
          with_rows<kGemmMR>(mt, [&](auto rows) {
            if (nt == kGemmNT)
              r8_kernel<T, decltype(rows)::value, kGemmNT>(chunk, n, xq, xd, xs, xb, ac, g0 == 0);
            else
              r8_kernel<T, decltype(rows)::value, 1>(chunk, n, xq, xd, xs, xb, ac, g0 == 0);
          });
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


bool gguf_type_supported(int64_t qtype) {
  switch (static_cast<int>(qtype)) {
    case kQ8_0: case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1:
    case kQ2_K: case kQ3_K: case kQ4_K: case kQ5_K: case kQ6_K:
    case kIQ4_NL: case kIQ4_XS: case kIQ3_XXS: case kIQ3_S:
      return true;
    default:
      return false;
  }
}

bool has_avx2() { return TLQ_AVX2; }
bool has_vnni() { return TLQ_VNNI; }
void set_force_scalar(bool on) { g_force_scalar = on; }

}  // namespace

// The decoder's entry points (gguf_quants.h): each calls this file's function of the same name.
namespace tlq::gguf {
TypeInfo type_info(int t) { return ::type_info(t); }
void dequant_block(int t, const uint8_t* b, float* y) { ::dequant_block(t, b, y); }
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) { ::check_weight(w, qtype, K); }
bool packable(int64_t qtype) { return ::packable(qtype); }
int packed_group_elems(int t) { return ::packed_group_elems(t); }
int64_t packed_row_bytes(int t, int64_t K) { return ::packed_row_bytes(t, K); }
at::Tensor gguf_repack8(const at::Tensor& w, int64_t qtype, int64_t K) { return ::gguf_repack8(w, qtype, K); }
void packed_row(int t, const uint8_t* pw, int64_t K, int64_t row, float* buf, float* out) {
  ::packed_row(t, pw, K, row, buf, out);
}
void run_quantized_range(int t, const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                         int64_t ldo, int64_t n0, int64_t n1) {
  ::run_quantized_range(t, a, w, row_bytes, bias, out, ldo, n0, n1);
}
void run_packed_cursor(int t, const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                       TileCursor& cur) {
  ::run_packed_cursor(t, a, pw, bias, out, ldo, cur);
}
}  // namespace tlq::gguf

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
  m.def("has_wide_gemm", [] { return TLQ_GEMM512 != 0; });  // the batched GEMM's 512-bit micro-kernel
  m.def("set_batch_invariant", [](bool on) { __atomic_store_n(&g_batch_invariant, on, __ATOMIC_RELAXED); });
  m.def("batch_invariant", [] { return batch_invariant(); });
  // The tile kernels' weight prefetch: 2 stages (L2, then L1), 1 (L1 only) or 0 (none); see prefetch_weights.
  m.def("set_weight_prefetch_stages", [](int stages) {
    TORCH_CHECK(stages >= 0 && stages <= 2, "weight prefetch stages must be 0, 1 or 2, got ", stages);
    __atomic_store_n(&g_prefetch_stages, stages, __ATOMIC_RELAXED);
  });
  m.def("weight_prefetch_stages", [] { return prefetch_stages(); });
  m.def("set_force_scalar", &set_force_scalar);
  m.def("tile_steals", [] { return g_tile_steals.load(); });
  tlq::register_fused_decode(m);  // FusedDecoder, dense_linear (fused_decode.cpp)
}
