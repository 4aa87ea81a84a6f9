// CPU kernels for tokenloom's decoder (compiled on first use by tokenloom/model/kernels.py).
//
//   paged_attention      causal attention of a whole step (decodes and prefill chunks) straight from
//                        the paged, head-major KV cache via the block tables: no gather copy.
//   rms_norm             out = x / rms(x) * w                         (fp32 math, one rounding)
//   fused_add_rms_norm   residual += x; x = residual / rms(residual) * w
//   silu_and_mul         out = silu(gate) * up, gate_up = [gate | up]
//   rotary_and_cache     neox rotary on the q and k heads of the fused qkv rows (in place), then
//                        k and v written to their KV-cache slots
//   argmax_rows          greedy sampling: row-wise argmax of the logits (fp32 or bf16)
//   skinny_linear        fp32 x @ w.T for a few rows, each weight row read once (verification rows)
//   quantize_rows, rms_norm_quant, dequant*   the int8 (W8A8) GEMMs' prologues and epilogues
//   int8_gemm            the W8A8 GEMM itself (exact int32) on CPUs without VNNI / AMX-INT8
//
// KV layouts: "plain" [Hkv, num_blocks, block_size, D] (the torch path's), and for bf16 with
// AVX512-BF16 the "packed" one (same tensor shape, elements reordered within each block; see
// attend_packed), which the runner uses whenever packed_layout_supported() says so.
//
// Element types: float and bfloat16, fp32 accumulation everywhere; KV caches also hold bf16 or fp16
// under either (--kv-cache-dtype bfloat16 / float16: converted as they are read) or int8 with scales.
// The AVX-512 paths need AVX512F/BW/VL (the bf16 dot products use AVX512-BF16 when the CPU has it);
// other CPUs, and head sizes that are not a multiple of 16 (fp32) / 32 (bf16), take plain C++ loops.
// Threads: at::parallel_for (torch's OpenMP pool, torch.get_num_threads()).

// Slim includes (not torch/extension.h): the first-use compile takes ~10 s instead of ~30 s.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_common.h"  // TL_AVX512, TL_AVX2, to_f, hsum8, load8f, quantize_kv_row

namespace {

using namespace tlc;
template <typename T> inline T from_f(float x);
template <> inline float from_f<float>(float x) { return x; }
template <> inline bf16 from_f<bf16>(float x) { return bf16(x); }  // round to nearest even

// Tests set this to hold the SIMD attention path to the plain loops.
bool g_force_scalar = false;
// How many K blocks ahead a decode prefetches (tuning knob, see set_prefetch_blocks).
int g_prefetch_blocks = 1;

// A row of zeros that padded key slots point at (covers head_dim <= 512 in either dtype).
alignas(64) const float kZeros[512] = {};

#if TL_AVX512
// ------------------------------------------------------------------------------ AVX-512 helpers

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256i to_bf16_bits(__m512 v) {
  // Round to nearest even, NaN kept quiet: what c10::BFloat16(float) does.
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(v)); }

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// exp(x) for x <= 88.7: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor (rel. err ~1e-7).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Sixteen vectors -> one vector of their horizontal sums: lane i = sum(v[i]).
inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int j = 0; j < 8; j++)
    t[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; j++) {
    __m512d a = _mm512_castps_pd(t[2 * j]), b = _mm512_castps_pd(t[2 * j + 1]);
    u[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // u[j]: 128-bit lane L holds the lane-L partial sums of vectors 4j..4j+3.
  __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Partial dot product of q and k (D elements) in the lanes of one vector.
template <int D_>
inline __m512 dot_lanes(const float* q, const float* k, int D) {
  const int n = D_ ? D_ : D;
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int j = 16; j < n; j += 16) acc = _mm512_fmadd_ps(load16(q + j), load16(k + j), acc);
  return acc;
}
// q and k of different types (a 16-bit cache under a float32 or bf16 run): both converted to fp32.
template <int D_, typename T, typename KT>
inline __m512 dot_lanes(const T* q, const KT* k, int D) {
  const int n = D_ ? D_ : D;
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int j = 16; j < n; j += 16) acc = _mm512_fmadd_ps(load16(q + j), load16(k + j), acc);
  return acc;
}
template <int D_>
inline __m512 dot_lanes(const bf16* q, const bf16* k, int D) {
  const int n = D_ ? D_ : D;
#ifdef __AVX512BF16__
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 32) {
    __m512i a = _mm512_loadu_si512(q + j), b = _mm512_loadu_si512(k + j);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
  return acc;
#else
  __m512 acc = _mm512_mul_ps(load16(q), load16(k));
  for (int j = 16; j < n; j += 16) acc = _mm512_fmadd_ps(load16(q + j), load16(k + j), acc);
  return acc;
#endif
}
#endif  // TL_AVX512

// ------------------------------------------------------------------------------ paged attention

// T: q and out; KT: the caches' elements (T, or int8_t with scales).
template <typename T, typename KT = T>
struct AttnArgs {
  const T* q;             // row r, head h at q + r * q_row_stride + h * D
  int64_t q_row_stride;
  const KT* k_cache;      // [Hkv, num_blocks, block_size, D] contiguous
  const KT* v_cache;
  int64_t head_stride;    // num_blocks * block_size * D
  const int32_t* block_tables;  // [S, bt_stride]
  int64_t bt_stride;
  T* out;                 // row r, head h at out + r * out_row_stride + h * D
  int64_t out_row_stride;
  int block_size, D, Hq, Hkv;
  float scale;
  // int8 caches: [Hkv, num_blocks, block_size] float32 scales (a slot's at its index); else null.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t scale_head_stride = 0;  // num_blocks * block_size
};

// Slot offsets (in elements, relative to a head's base) of tokens 0..n-1 of one sequence.
inline void token_offsets(const int32_t* table, int block_size, int D, int n, int64_t* offs) {
  int t = 0;
  for (int b = 0; t < n; b++) {
    int64_t base = static_cast<int64_t>(table[b]) * block_size * D;
    for (int o = 0; o < block_size && t < n; o++, t++) offs[t] = base + static_cast<int64_t>(o) * D;
  }
}

// One query row against keys 0..n-1, for the G query heads of kv head `kvh`: exact two-pass softmax
// over a score buffer (each K and V row is read once per row), fp32 throughout.
template <typename T, typename KT>
void attend_scalar(const AttnArgs<T, KT>& a, int64_t row, int kvh, int n, const int64_t* offs, float* scores) {
  const int D = a.D, G = a.Hq / a.Hkv;
  const KT* kb = a.k_cache + kvh * a.head_stride;
  const KT* vb = a.v_cache + kvh * a.head_stride;
  // int8: a token's scale is at its slot (offs / D); the K scale multiplies its score, the V scale its weight.
  const float* ks = a.k_scale ? a.k_scale + kvh * a.scale_head_stride : nullptr;
  const float* vs = a.v_scale ? a.v_scale + kvh * a.scale_head_stride : nullptr;
  std::vector<float> acc(D);
  for (int g = 0; g < G; g++) {
    const int h = kvh * G + g;
    const T* q = a.q + row * a.q_row_stride + static_cast<int64_t>(h) * D;
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) {
      const KT* k = kb + offs[t];
      float s = 0.f;
      for (int d = 0; d < D; d++) s += to_f(q[d]) * to_f(k[d]);
      scores[t] = s * a.scale * (ks ? ks[offs[t] / D] : 1.f);
      mx = std::max(mx, scores[t]);
    }
    float sum = 0.f;
    for (int t = 0; t < n; t++) {
      scores[t] = std::exp(scores[t] - mx);
      sum += scores[t];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int t = 0; t < n; t++) {
      const KT* v = vb + offs[t];
      const float w = scores[t] * (vs ? vs[offs[t] / D] : 1.f);
      for (int d = 0; d < D; d++) acc[d] += w * to_f(v[d]);
    }
    T* o = a.out + row * a.out_row_stride + static_cast<int64_t>(h) * D;
    for (int d = 0; d < D; d++) o[d] = from_f<T>(acc[d] / sum);
  }
}

#if TL_AVX512
template <typename T, typename KT, int D_>
void attend_avx512(const AttnArgs<T, KT>& a, int64_t row, int kvh, int n, const int64_t* offs, float* scores) {
  const int D = D_ ? D_ : a.D;
  const int G = a.Hq / a.Hkv;
  const int npad = (n + 15) & ~15;
  const KT* kb = a.k_cache + kvh * a.head_stride;
  const KT* vb = a.v_cache + kvh * a.head_stride;
  const KT* zero = reinterpret_cast<const KT*>(kZeros);
  constexpr bool q8 = std::is_same<KT, int8_t>::value;
  const float* ks = q8 ? a.k_scale + kvh * a.scale_head_stride : nullptr;
  const float* vs = q8 ? a.v_scale + kvh * a.scale_head_stride : nullptr;
  const T* qrow = a.q + row * a.q_row_stride + static_cast<int64_t>(kvh) * G * D;
  const __m512 scale = _mm512_set1_ps(a.scale);

  // Scores: sixteen keys at a time, reduced together.
  if constexpr (q8) {
    // int8: the G query heads converted to fp32 once, and each tile of sixteen keys once for all G
    // heads (converting inside the dot products redid both per head and key); the keys' scales
    // multiply the reduced scores (padding: scale 0, masked below anyway). The same products and
    // sums as converting in place, in fewer instructions.
    thread_local std::vector<float> qf, kf;
    qf.resize(static_cast<size_t>(G) * D);
    kf.resize(static_cast<size_t>(16) * D);
    for (int g = 0; g < G; g++)
      for (int d = 0; d < D; d += 16) _mm512_storeu_ps(qf.data() + g * D + d, load16(qrow + g * D + d));
    for (int c0 = 0; c0 < n; c0 += 16) {
      const float* kr[16];
      alignas(64) float sk[16];
      for (int i = 0; i < 16; i++) {
        if (c0 + i >= n) {
          kr[i] = kZeros;
          sk[i] = 0.f;
          continue;
        }
        const KT* src = kb + offs[c0 + i];
        float* dst = kf.data() + static_cast<size_t>(i) * D;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
        kr[i] = dst;
        sk[i] = ks[offs[c0 + i] / D];
      }
      const __m512 kscale = _mm512_mul_ps(scale, _mm512_load_ps(sk));
      for (int g = 0; g < G; g++) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = dot_lanes<D_>(qf.data() + g * D, kr[i], D);
        _mm512_storeu_ps(scores + g * npad + c0, _mm512_mul_ps(reduce16(acc), kscale));
      }
    }
  } else {
    for (int c0 = 0; c0 < n; c0 += 16) {
      const KT* kp[16];
      for (int i = 0; i < 16; i++) kp[i] = c0 + i < n ? kb + offs[c0 + i] : zero;
      for (int g = 0; g < G; g++) {
        const T* q = qrow + g * D;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = dot_lanes<D_>(q, kp[i], D);
        _mm512_storeu_ps(scores + g * npad + c0, _mm512_mul_ps(reduce16(acc), scale));
      }
    }
  }
  // Softmax numerators in place; keep 1 / sum per head.
  float inv_sum[64];
  for (int g = 0; g < G; g++) {
    float* s = scores + g * npad;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - t), s + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
      __mmask16 k = tail_mask(n - t);
      __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m)));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // Weighted sum of V, a tile of heads at a time (HT heads x NC vectors of accumulators).
  constexpr int NC = D_ ? D_ / 16 : 32;
  constexpr int HT = NC >= 16 ? 1 : 16 / NC;
  const int nc = D / 16;
  for (int g0 = 0; g0 < G; g0 += HT) {
    const int nh = std::min(HT, G - g0);
    __m512 acc[HT][NC];
    for (int h = 0; h < HT; h++)
      for (int c = 0; c < NC; c++) acc[h][c] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
      const KT* v = vb + offs[t];
      const float vscale = q8 ? vs[offs[t] / D] : 1.f;  // int8: folded into the token's weight
      __m512 vv[NC];
      for (int c = 0; c < NC; c++)
        if (c < nc) vv[c] = load16(v + 16 * c);
      for (int h = 0; h < HT; h++) {
        if (h >= nh) break;
        const __m512 p = _mm512_set1_ps(q8 ? scores[(g0 + h) * npad + t] * vscale : scores[(g0 + h) * npad + t]);
        for (int c = 0; c < NC; c++)
          if (c < nc) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
      }
    }
    for (int h = 0; h < nh; h++) {
      const int head = kvh * G + g0 + h;
      T* o = a.out + row * a.out_row_stride + static_cast<int64_t>(head) * D;
      const __m512 inv = _mm512_set1_ps(inv_sum[g0 + h]);
      for (int c = 0; c < nc; c++) store16(o + 16 * c, _mm512_mul_ps(acc[h][c], inv));
    }
  }
}
#endif

// Rows of one sequence handled together (prefill chunks): each K/V chunk is loaded once for all
// of them. Scratch buffers hold kTileRows * G score rows.
constexpr int kTileRows = 4;
constexpr int kMaxCombos = 12;  // (row, head) score rows per packed_scores call: 24 accumulators

#if TL_AVX512 && defined(__AVX512BF16__)
#define TL_PACKED 1
// The "packed" bf16 KV layout (block_size % 16 == 0, D % 32 == 0), per kv head and block:
//   K as [D/2][block_size][2]: for a pair of dims, 16 consecutive keys fill one vector, so a key's
//     scores come out of dot-product instructions in the lanes (no horizontal reductions);
//   V as [block_size/2][D][2]: two consecutive tokens interleaved per dim, so probabilities x V is
//     one AVX512-BF16 dot product per pair of tokens.
// Probabilities are rounded to bf16 for the P x V products (as the torch path does); scores,
// softmax and accumulation stay fp32.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Scores of sixteen keys (one block's chunk, dim pair p at kp + 2 p bs) for NH heads: out[h][0..15].
template <int NH>
inline void packed_scores(const bf16* kp, int bs, int pairs, const int32_t* const* qd, float* const* out,
                          __m512 scale) {
  __m512 acc0[NH], acc1[NH];
  for (int h = 0; h < NH; h++) acc0[h] = acc1[h] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; p += 2) {
    const __m512i k0 = _mm512_loadu_si512(kp + static_cast<int64_t>(p) * 2 * bs);
    const __m512i k1 = _mm512_loadu_si512(kp + static_cast<int64_t>(p + 1) * 2 * bs);
    for (int h = 0; h < NH; h++) {
      acc0[h] = _mm512_dpbf16_ps(acc0[h], (__m512bh)_mm512_set1_epi32(qd[h][p]), (__m512bh)k0);
      acc1[h] = _mm512_dpbf16_ps(acc1[h], (__m512bh)_mm512_set1_epi32(qd[h][p + 1]), (__m512bh)k1);
    }
  }
  for (int h = 0; h < NH; h++) _mm512_storeu_ps(out[h], _mm512_mul_ps(_mm512_add_ps(acc0[h], acc1[h]), scale));
}

// out[h] = sum over tokens of p[h][t] v[t] / sum[h], for NH heads; V packed per block as [bs/2][D][2],
// probabilities as bf16 pairs (pp[h][i] = tokens 2i, 2i+1). NC: accumulators per head (D / 16).
template <int NH, int NC>
inline void packed_pv(const bf16* vb, const int32_t* table, int64_t block_elems, int bs, int n, int D,
                      const int32_t* const* pp, const float* inv_sum, bf16* const* out) {
  const int nc = D / 16;
  __m512 acc[NH][NC];
  for (int h = 0; h < NH; h++)
    for (int c = 0; c < NC; c++) acc[h][c] = _mm512_setzero_ps();
  for (int t0 = 0, b = 0; t0 < n; t0 += bs, b++) {
    const bf16* vblock = vb + table[b] * block_elems;
    const int pairs = (std::min(bs, n - t0) + 1) / 2;
    for (int i = 0; i < pairs; i++) {
      const bf16* v = vblock + static_cast<int64_t>(i) * 2 * D;
      __m512i vv[NC];
      for (int c = 0; c < NC; c++)
        if (c < nc) vv[c] = _mm512_loadu_si512(v + 32 * c);
      if (t0 + 2 * i + 1 >= n) {  // odd count: the pair's second token is an unwritten slot (weight 0,
        const __m512i even = _mm512_set1_epi32(0xFFFF);  // but maybe NaN garbage: 0 x NaN = NaN)
        for (int c = 0; c < NC; c++)
          if (c < nc) vv[c] = _mm512_and_si512(vv[c], even);
      }
      const int pi = t0 / 2 + i;
      for (int h = 0; h < NH; h++) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pp[h][pi]);
        for (int c = 0; c < NC; c++)
          if (c < nc) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], p, (__m512bh)vv[c]);
      }
    }
  }
  // acc[h][c] lanes: dims 16c .. 16c+15 in order (each dword of vv[c] is one dim's token pair).
  for (int h = 0; h < NH; h++) {
    const __m512 inv = _mm512_set1_ps(inv_sum[h]);
    for (int c = 0; c < nc; c++) store16(out[h] + 16 * c, _mm512_mul_ps(acc[h][c], inv));
  }
}

template <int N>
inline void packed_scores_n(int nh, const bf16* kp, int bs, int pairs, const int32_t* const* qd, float* const* out,
                            __m512 scale) {
  if constexpr (N > 1) {
    if (nh < N) return packed_scores_n<N - 1>(nh, kp, bs, pairs, qd, out, scale);
  }
  packed_scores<N>(kp, bs, pairs, qd, out, scale);
}

// Rows row0 .. row0 + nrows - 1 of one sequence (row i sees keys 0 .. n0 + i - 1), the G query
// heads of kv head `kvh`, over the packed layout (see above).
template <int D_>
void attend_packed(const AttnArgs<bf16>& a, int64_t row0, int nrows, int kvh, int n0, const int32_t* table,
                   float* scores, uint16_t* probs, bool prefetch) {
  const int D = D_ ? D_ : a.D;
  const int bs = a.block_size;
  const int G = a.Hq / a.Hkv;
  const int combos = nrows * G;  // score row c: row c / G, head c % G
  const int n = n0 + nrows - 1;  // keys of the last row
  const int npad = (n + 15) & ~15;
  const int64_t block_elems = static_cast<int64_t>(bs) * D;
  const bf16* kb = a.k_cache + kvh * a.head_stride;
  const bf16* vb = a.v_cache + kvh * a.head_stride;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int nblocks = (n + bs - 1) / bs;
  auto q_of = [&](int c) {
    return reinterpret_cast<const int32_t*>(a.q + (row0 + c / G) * a.q_row_stride +
                                            static_cast<int64_t>(kvh * G + c % G) * D);
  };

  // Scores, sixteen keys (within one block) at a time, up to kMaxCombos score rows at a time.
  // Decodes (whose K/V come from memory; a prefill chunk's rows find them in L2) prefetch, entering
  // a block, the next block's K and this block's V (read again by the P x V pass below).
  for (int c0 = 0; c0 < n; c0 += 16) {
    const int b = c0 / bs, off = c0 - b * bs;
    if (prefetch && off == 0) {
      const int ahead = g_prefetch_blocks;
      for (int d = b == 0 ? 0 : ahead; d <= ahead && b + d < nblocks; d++)
        prefetch_bytes(kb + table[b + d] * block_elems, block_elems * 2);
      prefetch_bytes(vb + table[b] * block_elems, block_elems * 2);
    }
    const bf16* kp = kb + table[b] * block_elems + 2 * off;
    for (int g0 = 0; g0 < combos; g0 += kMaxCombos) {
      const int nh = std::min(kMaxCombos, combos - g0);
      const int32_t* qd[kMaxCombos];
      float* out[kMaxCombos];
      for (int h = 0; h < nh; h++) {
        qd[h] = q_of(g0 + h);
        out[h] = scores + (g0 + h) * npad + c0;
      }
      packed_scores_n<kMaxCombos>(nh, kp, bs, D / 2, qd, out, scale);
    }
  }
  // Softmax numerators, rounded to bf16 (zero past each row's keys); 1 / (sum of the rounded values).
  float inv_sum[kTileRows * 64];
  for (int c = 0; c < combos; c++) {
    const int nc_keys = n0 + c / G;
    const float* s = scores + c * npad;
    uint16_t* pb = probs + c * npad;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < nc_keys; t += 16)
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(nc_keys - t), s + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < npad; t += 16) {
      const __mmask16 k = t < nc_keys ? tail_mask(nc_keys - t) : __mmask16(0);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m)));
      const __m256i eb = to_bf16_bits(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + t), eb);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
    }
    inv_sum[c] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // P x V over the last row's keys (earlier rows' extra weights are zero), HT score rows at a time.
  constexpr int NC = D_ ? D_ / 16 : 32;
  constexpr int HT = NC >= 16 ? 1 : 16 / NC;
  for (int g0 = 0; g0 < combos; g0 += HT) {
    const int nh = std::min(HT, combos - g0);
    const int32_t* pp[4];
    bf16* out[4];
    for (int h = 0; h < nh; h++) {
      const int c = g0 + h;
      pp[h] = reinterpret_cast<const int32_t*>(probs + c * npad);
      out[h] = a.out + (row0 + c / G) * a.out_row_stride + static_cast<int64_t>(kvh * G + c % G) * D;
    }
    const float* inv = inv_sum + g0;
    if constexpr (HT >= 4) {
      if (nh == 4) { packed_pv<4, NC>(vb, table, block_elems, bs, n, D, pp, inv, out); continue; }
      if (nh == 3) { packed_pv<3, NC>(vb, table, block_elems, bs, n, D, pp, inv, out); continue; }
    }
    if constexpr (HT >= 2) {
      if (nh == 2) { packed_pv<2, NC>(vb, table, block_elems, bs, n, D, pp, inv, out); continue; }
    }
    packed_pv<1, NC>(vb, table, block_elems, bs, n, D, pp, inv, out);
  }
}
#else
#define TL_PACKED 0
#endif

// Plain-loop attention over the packed layout (tests; CPUs without AVX512-BF16 never use the layout).
void attend_packed_scalar(const AttnArgs<bf16>& a, int64_t row, int kvh, int n, const int32_t* table,
                          float* scores) {
  const int D = a.D, bs = a.block_size, G = a.Hq / a.Hkv;
  const int64_t block_elems = static_cast<int64_t>(bs) * D;
  const bf16* kb = a.k_cache + kvh * a.head_stride;
  const bf16* vb = a.v_cache + kvh * a.head_stride;
  std::vector<float> acc(D);
  for (int g = 0; g < G; g++) {
    const int h = kvh * G + g;
    const bf16* q = a.q + row * a.q_row_stride + static_cast<int64_t>(h) * D;
    float mx = -INFINITY;
    for (int t = 0; t < n; t++) {
      const bf16* blk = kb + table[t / bs] * block_elems;
      const int off = t % bs;
      float s = 0.f;
      for (int d = 0; d < D; d++) s += to_f(q[d]) * to_f(blk[((d / 2) * bs + off) * 2 + d % 2]);
      scores[t] = s * a.scale;
      mx = std::max(mx, scores[t]);
    }
    float sum = 0.f;
    for (int t = 0; t < n; t++) {
      scores[t] = to_f(bf16(std::exp(scores[t] - mx)));
      sum += scores[t];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int t = 0; t < n; t++) {
      const bf16* blk = vb + table[t / bs] * block_elems;
      const int off = t % bs;
      for (int d = 0; d < D; d++) acc[d] += scores[t] * to_f(blk[((off / 2) * D + d) * 2 + off % 2]);
    }
    bf16* o = a.out + row * a.out_row_stride + static_cast<int64_t>(h) * D;
    for (int d = 0; d < D; d++) o[d] = bf16(acc[d] / sum);
  }
}

// Query rows per tile of a prefill chunk in the tiled kernel (x G query heads; x2 when G <= 4). Outside the
// AVX2 block: the tiling below names it whatever the ISA (isa_check caught a build without AVX2 failing).
constexpr int kFlashRows = 16;

#if TL_AVX2
// ------------------------------------------------------------------------------ tiled (flash) attention, AVX2
// A tile of query rows of one sequence x one kv head, against its keys 16 at a time (a "key tile",
// whatever the block size: each key's row is found through the block table), with an online
// softmax (running max and sum per query row), so K and V are each read once per tile of rows
// instead of once per row, and no score row longer than 16 is ever stored. The tile's M = rows x G
// query vectors (the G query heads of the kv head share every K/V load: GQA) are the rows of two
// small GEMMs per key tile: S[M x 16] = Q K^T against the key tile transposed to [D][16] fp32,
// then O[M x D] = alpha O + P V. fp32 throughout (bf16 K/V converted once per key tile).
constexpr int kFlashKeys = 32;      // keys per key tile (a multiple of 16)

inline __m256 exp8(__m256 x) {
  // exp(x), x <= 0 here (scores minus their running max); clamped so 2^n stays a normal float.
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
// dst[d * 16 + j] = rows[j][d] for 8 rows (j = j0 .. j0 + 7) and 8 dims (d = d0 .. d0 + 7).
template <typename T>
inline void transpose8(const T* const* rows, int d0, float* dst) {
  __m256 r[8];
  for (int j = 0; j < 8; j++) r[j] = load8f(rows[j] + d0);
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst + 0 * kFlashKeys, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * kFlashKeys, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * kFlashKeys, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * kFlashKeys, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * kFlashKeys, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * kFlashKeys, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * kFlashKeys, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * kFlashKeys, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// S[r][0..15] = q_r . k_j for R query vectors (q rows at q + r * D, fp32, already scaled) against
// the transposed key tile kt [D][16].
template <int R>
inline void flash_qk(const float* q, const float* kt, int D, float* s) {  // kt, s: at the tile's 16-key half
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int d = 0; d < D; d++) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kFlashKeys), k1 = _mm256_loadu_ps(kt + d * kFlashKeys + 8);
    for (int r = 0; r < R; r++) {
      const __m256 qv = _mm256_broadcast_ss(q + r * D + d);
      a0[r] = _mm256_fmadd_ps(qv, k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(qv, k1, a1[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(s + r * kFlashKeys, a0[r]);
    _mm256_storeu_ps(s + r * kFlashKeys + 8, a1[r]);
  }
}

// O[r][d0 .. d0 + 15] = alpha[r] O[r][...] + sum_{j < nk} P[r][j] V[j][...] for R query vectors.
template <int R, typename T>
inline void flash_pv(float* o, const float* p, const float* alpha, const T* const* v, int nk, int D, int d0) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; r++) {
    const __m256 al = _mm256_broadcast_ss(alpha + r);
    a0[r] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * D + d0));
    a1[r] = _mm256_mul_ps(al, _mm256_loadu_ps(o + r * D + d0 + 8));
  }
  for (int j = 0; j < nk; j++) {
    const __m256 v0 = load8f(v[j] + d0), v1 = load8f(v[j] + d0 + 8);
    for (int r = 0; r < R; r++) {
      const __m256 pv = _mm256_broadcast_ss(p + r * kFlashKeys + j);
      a0[r] = _mm256_fmadd_ps(pv, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(pv, v1, a1[r]);
    }
  }
  for (int r = 0; r < R; r++) {
    _mm256_storeu_ps(o + r * D + d0, a0[r]);
    _mm256_storeu_ps(o + r * D + d0 + 8, a1[r]);
  }
}
// The same for 8 dims (D % 16 == 8: the last 8).
template <int R, typename T>
inline void flash_pv8(float* o, const float* p, const float* alpha, const T* const* v, int nk, int D, int d0) {
  __m256 a0[R];
  for (int r = 0; r < R; r++) a0[r] = _mm256_mul_ps(_mm256_broadcast_ss(alpha + r), _mm256_loadu_ps(o + r * D + d0));
  for (int j = 0; j < nk; j++) {
    const __m256 v0 = load8f(v[j] + d0);
    for (int r = 0; r < R; r++) a0[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + r * kFlashKeys + j), v0, a0[r]);
  }
  for (int r = 0; r < R; r++) _mm256_storeu_ps(o + r * D + d0, a0[r]);
}

// Per-thread scratch of the tiled kernel.
struct FlashScratch {
  std::vector<float> q, o, s, m, l, alpha, kt;
  std::vector<float> vf;  // bf16 / int8 V tile converted to fp32 (int8: times its scales)
  std::vector<float> kf;  // int8 K tile dequantized to fp32 rows before the transpose
  void reserve(int max_m, int D) {
    kf.resize(static_cast<size_t>(D) * kFlashKeys);
    q.resize(static_cast<size_t>(max_m) * D);
    o.resize(static_cast<size_t>(max_m) * D);
    s.resize(static_cast<size_t>(max_m) * kFlashKeys);
    m.resize(max_m);
    l.resize(max_m);
    alpha.resize(max_m);
    kt.resize(static_cast<size_t>(D) * kFlashKeys);
    vf.resize(static_cast<size_t>(D) * kFlashKeys);
  }
};

// Rows row0 .. row0 + nrows - 1 of one sequence (row i at position pos0 + i sees keys
// max(0, pos0 + i - window + 1) .. pos0 + i; window <= 0: no window), the G query heads of kv head
// `kvh`. Query vector r of the tile: row r / G, head kvh * G + r % G. D % 8 == 0.
template <typename T, typename KT>
void attend_flash(const AttnArgs<T, KT>& a, int64_t row0, int nrows, int kvh, int pos0, const int32_t* table,
                  int window, FlashScratch& sc) {
  const int D = a.D, G = a.Hq / a.Hkv, bs = a.block_size;
  const int M = nrows * G;
  const int64_t block_elems = static_cast<int64_t>(bs) * D;
  const KT* kb = a.k_cache + kvh * a.head_stride;
  const KT* vb = a.v_cache + kvh * a.head_stride;
  const KT* zero = reinterpret_cast<const KT*>(kZeros);
  // int8 caches: each key tile's rows are dequantized (times their scales) once, for all M query vectors.
  constexpr bool q8 = std::is_same<KT, int8_t>::value;
  const float* ks = q8 ? a.k_scale + kvh * a.scale_head_stride : nullptr;
  const float* vs = q8 ? a.v_scale + kvh * a.scale_head_stride : nullptr;
  float* q = sc.q.data();
  float* o = sc.o.data();
  float* s = sc.s.data();
  float* mx = sc.m.data();
  float* l = sc.l.data();
  float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();
  // Scaled fp32 queries; O, running max and sum reset.
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int r = 0; r < M; r++) {
    const T* src = a.q + (row0 + r / G) * a.q_row_stride + static_cast<int64_t>(kvh * G + r % G) * D;
    for (int d = 0; d < D; d += 8) _mm256_storeu_ps(q + r * D + d, _mm256_mul_ps(load8f(src + d), scale));
    mx[r] = -INFINITY;
    l[r] = 0.f;
  }
  std::fill(o, o + static_cast<size_t>(M) * D, 0.f);
  const int last = pos0 + nrows - 1;  // the last row's position: keys 0 .. last are written
  int first_key = window > 0 ? std::max(0, pos0 - window + 1) : 0;
  first_key -= first_key % kFlashKeys;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const KT* krow[kFlashKeys];
  const float* kfrow[kFlashKeys];
  for (int t0 = first_key; t0 <= last; t0 += kFlashKeys) {
    const int nk = std::min(kFlashKeys, last + 1 - t0);  // keys of this tile that were written
    for (int j = 0; j < kFlashKeys; j++) {
      const int t = t0 + j;
      krow[j] = j < nk ? kb + table[t / bs] * block_elems + static_cast<int64_t>(t % bs) * D : zero;
    }
    if constexpr (q8) {
      for (int j = 0; j < kFlashKeys; j++) {
        if (j >= nk) {
          kfrow[j] = kZeros;
          continue;
        }
        const int t = t0 + j;
        const __m256 sv = _mm256_set1_ps(ks[static_cast<int64_t>(table[t / bs]) * bs + t % bs]);
        float* dst = sc.kf.data() + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8f(krow[j] + d), sv));
        kfrow[j] = dst;
      }
      for (int d0 = 0; d0 < D; d0 += 8)
        for (int j0 = 0; j0 < kFlashKeys; j0 += 8) transpose8(kfrow + j0, d0, kt + d0 * kFlashKeys + j0);
    } else {
      for (int d0 = 0; d0 < D; d0 += 8)
        for (int j0 = 0; j0 < kFlashKeys; j0 += 8) transpose8(krow + j0, d0, kt + d0 * kFlashKeys + j0);
    }
    // S = Q K^T, four query vectors x sixteen keys at a time.
    for (int h = 0; h < kFlashKeys; h += 16) {
      int r = 0;
      for (; r + 4 <= M; r += 4) flash_qk<4>(q + r * D, kt + h, D, s + r * kFlashKeys + h);
      switch (M - r) {
        case 3: flash_qk<3>(q + r * D, kt + h, D, s + r * kFlashKeys + h); break;
        case 2: flash_qk<2>(q + r * D, kt + h, D, s + r * kFlashKeys + h); break;
        case 1: flash_qk<1>(q + r * D, kt + h, D, s + r * kFlashKeys + h); break;
        default: break;
      }
    }
    // Online softmax: mask, new running max, P = exp(S - max) (0 where masked), alpha = exp(old - new).
    // Only tiles reaching past the first row's position (or before its window) need the mask.
    const bool masked = t0 + kFlashKeys - 1 > pos0 || (window > 0 && t0 <= last - window);
    constexpr int NV = kFlashKeys / 8;
    __m256i key[NV];
    for (int c = 0; c < NV; c++) key[c] = _mm256_add_epi32(lane, _mm256_set1_epi32(t0 + 8 * c));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int rr = 0; rr < M; rr++) {
      float* sr = s + rr * kFlashKeys;
      __m256 sv[NV], ok[NV];
      if (masked) {
        const int p = pos0 + rr / G;
        const __m256i hi = _mm256_set1_epi32(p + 1);
        const __m256i lo = _mm256_set1_epi32(window > 0 ? p - window : -1);
        for (int c = 0; c < NV; c++) {
          ok[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, key[c]), _mm256_cmpgt_epi32(key[c], lo)));
          sv[c] = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sr + 8 * c), ok[c]);
        }
      } else {
        for (int c = 0; c < NV; c++) sv[c] = _mm256_loadu_ps(sr + 8 * c);
      }
      __m256 vmax = sv[0];
      for (int c = 1; c < NV; c++) vmax = _mm256_max_ps(vmax, sv[c]);
      const float tile_max = hmax8(vmax);
      const float m_old = mx[rr];
      if (tile_max == -INFINITY) {  // nothing visible in this tile for this row
        for (int c = 0; c < NV; c++) _mm256_storeu_ps(sr + 8 * c, _mm256_setzero_ps());
        alpha[rr] = 1.f;
        continue;
      }
      const float m_new = std::max(m_old, tile_max);
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < NV; c++) {
        __m256 e = exp8(_mm256_sub_ps(sv[c], mv));
        if (masked) e = _mm256_and_ps(e, ok[c]);
        _mm256_storeu_ps(sr + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float al = m_new == m_old ? 1.f : m_old == -INFINITY ? 0.f : std::exp(m_old - m_new);
      alpha[rr] = al;
      l[rr] = l[rr] * al + hsum8(sum);
      mx[rr] = m_new;
    }
    // O = alpha O + P V over the written keys (unwritten slots may hold NaN: never touched).
    const float* vrow[kFlashKeys];
    for (int j = 0; j < nk; j++) {
      const int t = t0 + j;
      const KT* v = vb + table[t / bs] * block_elems + static_cast<int64_t>(t % bs) * D;
      if constexpr (std::is_same<KT, float>::value) {
        vrow[j] = v;
      } else if constexpr (q8) {  // dequantized once per key tile
        const __m256 sv = _mm256_set1_ps(vs[static_cast<int64_t>(table[t / bs]) * bs + t % bs]);
        float* vf = sc.vf.data() + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vf + d, _mm256_mul_ps(load8f(v + d), sv));
        vrow[j] = vf;
      } else {  // bf16: converted once per key tile, not once per four query vectors
        float* vf = sc.vf.data() + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(vf + d, load8f(v + d));
        vrow[j] = vf;
      }
    }
    for (int r = 0; r < M; r += 4) {
      const int R = std::min(4, M - r);
      float* orow = o + r * D;
      const float* prow = s + r * kFlashKeys;
      int d0 = 0;
      for (; d0 + 16 <= D; d0 += 16) {
        switch (R) {
          case 4: flash_pv<4>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          case 3: flash_pv<3>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          case 2: flash_pv<2>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          default: flash_pv<1>(orow, prow, alpha + r, vrow, nk, D, d0); break;
        }
      }
      if (d0 < D) {
        switch (R) {
          case 4: flash_pv8<4>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          case 3: flash_pv8<3>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          case 2: flash_pv8<2>(orow, prow, alpha + r, vrow, nk, D, d0); break;
          default: flash_pv8<1>(orow, prow, alpha + r, vrow, nk, D, d0); break;
        }
      }
    }
  }
  for (int r = 0; r < M; r++) {
    T* dst = a.out + (row0 + r / G) * a.out_row_stride + static_cast<int64_t>(kvh * G + r % G) * D;
    const float inv = 1.0f / l[r];
    for (int d = 0; d < D; d++) dst[d] = from_f<T>(o[r * D + d] * inv);
  }
}
#endif  // TL_AVX2

bool packed_layout_supported(int64_t block_size, int64_t head_dim) {
  return TL_PACKED && block_size % 16 == 0 && head_dim % 32 == 0 && head_dim <= 512;
}

template <typename T, typename KT>
void paged_attention_impl(const AttnArgs<T, KT>& a, const int32_t* q_start, const int32_t* pos_start,
                          int64_t num_seqs, bool packed) {
  // Work items: (a tile of rows of one sequence) x (kv head). Packed layout: kTileRows rows per
  // tile; plain layout with AVX2: the tiled kernel (attend_flash), kFlashRows rows of a prefill
  // chunk per tile; otherwise one row per tile.
  const int G = a.Hq / a.Hkv;
  bool flash = false;
#if TL_AVX2
  flash = !packed && !g_force_scalar && a.D % 8 == 0 && a.D <= 512;
#endif
  // Tiled kernel: each tile streams its rows' keys once, so larger tiles read K/V less often (a long
  // context's K/V outgrow L2); ~100 query vectors per tile keep Q and O in L2.
  const int tile = packed ? kTileRows : flash ? (G <= 4 ? 2 * kFlashRows : kFlashRows) : 1;
  struct Tile {
    int32_t row0, nrows, seq, n0;  // n0: keys of the first row
  };
  std::vector<Tile> tiles;
  tiles.reserve(q_start[num_seqs]);
  int max_ctx = 0;
  for (int64_t s = 0; s < num_seqs; s++) {
    for (int32_t r = q_start[s]; r < q_start[s + 1]; r += tile) {
      const int32_t nr = std::min<int32_t>(tile, q_start[s + 1] - r);
      tiles.push_back({r, nr, static_cast<int32_t>(s), pos_start[s] + (r - q_start[s]) + 1});
      max_ctx = std::max(max_ctx, tiles.back().n0 + nr - 1);
    }
  }
  const int64_t items = static_cast<int64_t>(tiles.size()) * a.Hkv;
  bool simd = false;
#if TL_AVX512
  simd = !g_force_scalar && a.D % (std::is_same<T, bf16>::value ? 32 : 16) == 0 && a.D <= 512 && G <= 64;
#endif
  std::atomic<int64_t> next{0};
  // One task per thread, items handed out dynamically: contexts differ, so static chunks would not balance.
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#if TL_AVX2
    FlashScratch fs;
    if (flash) fs.reserve(tile * G, a.D);
#endif
    // Rows left to the per-row kernels (all of them without the tiled one; decodes on AVX-512).
    const bool per_row = !flash || TL_AVX512;
    std::vector<float> scores(per_row ? static_cast<size_t>(tile) * G * ((max_ctx + 15) & ~15) + 16 : 0);
    std::vector<uint16_t> probs(packed ? scores.size() : 0);
    std::vector<int64_t> offs(packed || !per_row ? 0 : max_ctx);
    int64_t cached_seq = -1;
    int cached_n = 0;
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= items) break;
      const Tile& tl = tiles[i / a.Hkv];
      const int kvh = static_cast<int>(i % a.Hkv);
      const int32_t* table = a.block_tables + static_cast<int64_t>(tl.seq) * a.bt_stride;
#if TL_AVX2
      if (flash && (tl.nrows > 1 || !TL_AVX512)) {  // AVX-512 CPUs keep their decode kernel
        attend_flash<T, KT>(a, tl.row0, tl.nrows, kvh, tl.n0 - 1, table, 0, fs);
        continue;
      }
#endif
      if constexpr (std::is_same<T, bf16>::value && std::is_same<KT, bf16>::value) {
        if (packed) {
#if TL_PACKED
          if (!g_force_scalar) {
            const bool single = q_start[tl.seq + 1] - q_start[tl.seq] == 1;
            if (a.D == 64) attend_packed<64>(a, tl.row0, tl.nrows, kvh, tl.n0, table, scores.data(), probs.data(), single);
            else if (a.D == 128) attend_packed<128>(a, tl.row0, tl.nrows, kvh, tl.n0, table, scores.data(), probs.data(), single);
            else attend_packed<0>(a, tl.row0, tl.nrows, kvh, tl.n0, table, scores.data(), probs.data(), single);
            continue;
          }
#endif
          for (int r = 0; r < tl.nrows; r++) attend_packed_scalar(a, tl.row0 + r, kvh, tl.n0 + r, table, scores.data());
          continue;
        }
      }
      const int64_t row = tl.row0;
      const int n = tl.n0;
      if (tl.seq != cached_seq || n > cached_n) {  // rows of one sequence come in order: extend the offsets
        token_offsets(table, a.block_size, a.D, n, offs.data());
        cached_seq = tl.seq;
        cached_n = n;
      }
#if TL_AVX512
      if (simd) {
        if (a.D == 64) attend_avx512<T, KT, 64>(a, row, kvh, n, offs.data(), scores.data());
        else if (a.D == 128) attend_avx512<T, KT, 128>(a, row, kvh, n, offs.data(), scores.data());
        else attend_avx512<T, KT, 0>(a, row, kvh, n, offs.data(), scores.data());
        continue;
      }
#endif
      attend_scalar<T, KT>(a, row, kvh, n, offs.data(), scores.data());
    }
  });
}

// int8 caches (--kv-cache-dtype int8) come with k_scale / v_scale, float32 [Hkv, num_blocks, block_size].
void check_kv_scales(const at::Tensor& k_cache, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  if (k_cache.scalar_type() != at::kChar) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "KV scales come only with int8 caches");
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "int8 KV caches need their k_scale and v_scale");
  for (const at::Tensor* sc : {&*k_scale, &*v_scale})
    TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) && sc->size(2) == k_cache.size(2),
                "KV scales must be contiguous float32 [Hkv, num_blocks, block_size]");
}

// Calls f(T*, KT*) (null pointers, as type tags) for q's dtype T (the run dtype: float or bf16) and the
// caches' element type KT: the run dtype itself, a 16-bit cache under either run dtype (bf16, fp16:
// --kv-cache-dtype bfloat16 / float16), or int8 (with scales).
template <typename F>
void dispatch_q_kv(at::ScalarType q_type, at::ScalarType kv_type, const char* what, F&& f) {
  auto with_q = [&](auto* tq) {
    using T = std::remove_pointer_t<decltype(tq)>;
    switch (kv_type) {
      case at::kFloat:
        if constexpr (std::is_same_v<T, float>) return f(tq, static_cast<float*>(nullptr));
        break;
      case at::kBFloat16: return f(tq, static_cast<bf16*>(nullptr));
      case at::kHalf: return f(tq, static_cast<f16*>(nullptr));
      case at::kChar: return f(tq, static_cast<int8_t*>(nullptr));
      default: break;
    }
    TORCH_CHECK(false, what, ": KV caches must be of the run dtype, bfloat16, float16 or int8, got ", kv_type,
                " under ", q_type);
  };
  if (q_type == at::kFloat) with_q(static_cast<float*>(nullptr));
  else if (q_type == at::kBFloat16) with_q(static_cast<bf16*>(nullptr));
  else TORCH_CHECK(false, what, ": q must be float32 or bfloat16, got ", q_type);
}

// out: [T, Hq * D]; q: [T, >= Hq * D] rows (e.g. the fused qkv), heads contiguous from column 0;
// caches: [Hkv, num_blocks, block_size, D] of q's dtype, bf16, fp16 or int8; block_tables [S, max_blocks]
// int32; q_start [S + 1] int32 (rows of sequence s: q_start[s] .. q_start[s+1]-1); pos_start [S] int32
// (position of each sequence's first row: row j of s sees keys 0 .. pos_start[s] + j).
// int8 caches (--kv-cache-dtype int8) come with k_scale / v_scale, float32 [Hkv, num_blocks, block_size].
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& q_start, const at::Tensor& pos_start,
                     double scale, bool packed, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes(), "caches must be contiguous [Hkv, num_blocks, block_size, D]");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "q and out must share a dtype, and the K and V caches theirs");
  check_kv_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 2 && q.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "q and out must be 2-D rows");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && q_start.scalar_type() == at::kInt &&
              pos_start.scalar_type() == at::kInt, "block_tables, q_start and pos_start must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && q_start.is_contiguous() &&
              pos_start.is_contiguous(), "index tensors must be contiguous");
  const int64_t S = pos_start.numel();
  TORCH_CHECK(q_start.numel() == S + 1 && block_tables.size(0) >= S, "q_start must have S + 1 entries");
  const int Hkv = k_cache.size(0), bs = k_cache.size(2), D = k_cache.size(3);
  const int Hq = out.size(1) / D;
  TORCH_CHECK(Hq * D == out.size(1) && Hq % Hkv == 0 && q.size(1) >= Hq * D, "head counts do not match");
  TORCH_CHECK(!packed || (q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && bs % 16 == 0 &&
                          D % 32 == 0 && D <= 512 && Hq / Hkv <= 64),
              "the packed KV layout needs bf16 q and caches, block_size % 16 == 0, D % 32 == 0");
  const int32_t* qs = q_start.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[S] <= q.size(0) && qs[S] <= out.size(0), "q_start out of range");
  const float* ks = q8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = q8 ? v_scale->data_ptr<float>() : nullptr;
  const int64_t sstride = q8 ? k_scale->stride(0) : 0;
  dispatch_q_kv(q.scalar_type(), k_cache.scalar_type(), "paged_attention", [&](auto* tq, auto* tk) {
    using T = std::remove_pointer_t<decltype(tq)>;
    using KT = std::remove_pointer_t<decltype(tk)>;
    AttnArgs<T, KT> a{q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<KT>(), v_cache.data_ptr<KT>(),
                      k_cache.stride(0), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                      out.data_ptr<T>(), out.stride(0), bs, D, Hq, Hkv, static_cast<float>(scale), ks, vs, sstride};
    paged_attention_impl(a, qs, pos_start.data_ptr<int32_t>(), S, packed);
  });
}

// ------------------------------------------------------------------------------ RMSNorm

template <typename T>
float sum_squares(const T* x, int64_t n) {
#if TL_AVX512
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = load16(x + i, tail_mask(n - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float s = 0.f;
  for (int64_t i = 0; i < n; i++) s += to_f(x[i]) * to_f(x[i]);
  return s;
#endif
}

template <typename T, typename W>
void scale_row(const T* x, const W* w, T* out, int64_t n, float inv) {
#if TL_AVX512
  const __m512 s = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i, m), s), load16(w + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; i++) out[i] = from_f<T>(to_f(x[i]) * inv * to_f(w[i]));
#endif
}

template <typename T>
void add_into(T* residual, const T* x, int64_t n) {
#if TL_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    store16(residual + i, _mm512_add_ps(load16(residual + i, m), load16(x + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; i++) residual[i] = from_f<T>(to_f(residual[i]) + to_f(x[i]));
#endif
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1) &&
              w.scalar_type() == x.scalar_type(), "expected rows [T, H] and a weight [H] of the same dtype");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1 && out.scalar_type() == x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_SWITCH(x.scalar_type(), "rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          const float* xr = x.data_ptr<float>() + r * x.stride(0);
          float inv = 1.0f / std::sqrt(sum_squares(xr, H) / H + static_cast<float>(eps));
          scale_row(xr, w.data_ptr<float>(), out.data_ptr<float>() + r * out.stride(0), H, inv);
        }
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          const bf16* xr = x.data_ptr<bf16>() + r * x.stride(0);
          float inv = 1.0f / std::sqrt(sum_squares(xr, H) / H + static_cast<float>(eps));
          scale_row(xr, w.data_ptr<bf16>(), out.data_ptr<bf16>() + r * out.stride(0), H, inv);
        }
      });
    }));
}

// residual += x (rounded to the dtype, as an in-place torch add); x = rms_norm(residual) * w.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type());
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_SWITCH(x.scalar_type(), "fused_add_rms_norm",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          float* xr = x.data_ptr<float>() + r * x.stride(0);
          float* rr = residual.data_ptr<float>() + r * residual.stride(0);
          add_into(rr, xr, H);
          float inv = 1.0f / std::sqrt(sum_squares(rr, H) / H + static_cast<float>(eps));
          scale_row(rr, w.data_ptr<float>(), xr, H, inv);
        }
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          bf16* xr = x.data_ptr<bf16>() + r * x.stride(0);
          bf16* rr = residual.data_ptr<bf16>() + r * residual.stride(0);
          add_into(rr, xr, H);
          float inv = 1.0f / std::sqrt(sum_squares(rr, H) / H + static_cast<float>(eps));
          scale_row(rr, w.data_ptr<bf16>(), xr, H, inv);
        }
      });
    }));
}

// ------------------------------------------------------------------------------ SiLU and mul

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#if TL_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = tail_mask(n - i);
    __m512 x = load16(g + i, m);
    // x / (1 + e^-x): reciprocal estimate + one Newton step (~1 ulp; vdivps costs ~3x more here).
    const __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    __m512 s = _mm512_mul_ps(x, r);
    store16(o + i, _mm512_mul_ps(s, load16(u + i, m)), m);
  }
#else
  for (int64_t i = 0; i < n; i++) {
    float x = to_f(g[i]);
    o[i] = from_f<T>(x / (1.0f + std::exp(-x)) * to_f(u[i]));
  }
#endif
}

void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 &&
              gate_up.size(1) == 2 * out.size(1) && gate_up.size(0) == out.size(0) &&
              out.scalar_type() == gate_up.scalar_type(), "expected out [T, I] and gate_up [T, 2I]");
  const int64_t T = out.size(0), I = out.size(1);
  AT_DISPATCH_SWITCH(out.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          const float* g = gate_up.data_ptr<float>() + r * gate_up.stride(0);
          silu_mul_row(g, g + I, out.data_ptr<float>() + r * out.stride(0), I);
        }
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
          const bf16* g = gate_up.data_ptr<bf16>() + r * gate_up.stride(0);
          silu_mul_row(g, g + I, out.data_ptr<bf16>() + r * out.stride(0), I);
        }
      });
    }));
}

// ------------------------------------------------------------------------------ rotary + KV write

template <typename T>
void rotate_head(T* x, const T* cos, const T* sin, int half) {
#if TL_AVX512
  for (int i = 0; i < half; i += 16) {
    __mmask16 m = tail_mask(half - i);
    __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
    __m512 c = load16(cos + i, m), s = load16(sin + i, m);
    store16(x + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), m);
    store16(x + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), m);
  }
#else
  for (int i = 0; i < half; i++) {
    float x1 = to_f(x[i]), x2 = to_f(x[half + i]), c = to_f(cos[i]), s = to_f(sin[i]);
    x[i] = from_f<T>(x1 * c - x2 * s);
    x[half + i] = from_f<T>(x2 * c + x1 * s);
  }
#endif
}

// KT: the caches' elements (T, a 16-bit type, or int8_t with scales).
template <typename T, typename KT>
void rotary_and_cache_impl(T* qkv, int64_t row_stride, int64_t T_, const int64_t* positions, const T* cos,
                           const T* sin, int Hq, int Hkv, int D, KT* kc, KT* vc, int64_t head_stride,
                           const int64_t* slots, int block_size, bool packed, float* ks = nullptr,
                           float* vs = nullptr, int64_t sstride = 0) {
  // int8 caches: each k / v head row quantized with its scale (quantize_kv_row); 16-bit caches under
  // another run dtype: each value rounded to the cache's type (store_kv_row).
  const int half = D / 2;
  at::parallel_for(0, T_, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; t++) {
      T* row = qkv + t * row_stride;
      const T* c = cos + positions[t] * half;
      const T* s = sin + positions[t] * half;
      for (int h = 0; h < Hq + Hkv; h++) rotate_head(row + static_cast<int64_t>(h) * D, c, s, half);
      if (slots == nullptr || slots[t] < 0) continue;
      if constexpr (std::is_same_v<T, bf16> && std::is_same_v<KT, bf16>) {
        if (packed) {  // see attend_packed: K [D/2][bs][2], V [bs/2][D][2] per block (2-byte elements)
          const int64_t blk = slots[t] / block_size, off = slots[t] % block_size;
          for (int h = 0; h < Hkv; h++) {
            const int64_t base = h * head_stride + blk * block_size * D;
            const uint32_t* k = reinterpret_cast<const uint32_t*>(row + static_cast<int64_t>(Hq + h) * D);
            uint32_t* kdst = reinterpret_cast<uint32_t*>(kc + base) + off;
            for (int p = 0; p < D / 2; p++) kdst[static_cast<int64_t>(p) * block_size] = k[p];
            const T* v = row + static_cast<int64_t>(Hq + Hkv + h) * D;
            T* vdst = vc + base + (off / 2) * 2 * D + (off % 2);
            for (int d = 0; d < D; d++) vdst[2 * d] = v[d];
          }
          continue;
        }
      }
      for (int h = 0; h < Hkv; h++) {
        const T* k = row + static_cast<int64_t>(Hq + h) * D;
        const T* v = row + static_cast<int64_t>(Hq + Hkv + h) * D;
        if constexpr (std::is_same_v<KT, int8_t>) {
          const int64_t slot = h * sstride + slots[t];
          quantize_kv_row(k, D, kc + slot * D, ks + slot);
          quantize_kv_row(v, D, vc + slot * D, vs + slot);
        } else {
          store_kv_row(k, D, kc + h * head_stride + slots[t] * D);
          store_kv_row(v, D, vc + h * head_stride + slots[t] * D);
        }
      }
    }
  });
}

// qkv: [T, (Hq + 2 Hkv) * D] rows (q heads, k heads, v heads); cos/sin: [P, D / 2] tables in qkv's
// dtype; positions, slot_mapping: [T] int64. Rotates q and k in place, then writes k and v to the
// caches ([Hkv, num_blocks, block_size, D], of qkv's dtype, bf16, fp16 or int8) at their slots.
// int8 caches (--kv-cache-dtype int8): k_scale / v_scale [Hkv, num_blocks, block_size] float32 take
// each written row's scale.
void rotary_and_cache(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t num_q_heads, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                      bool packed, const c10::optional<at::Tensor>& k_scale,
                      const c10::optional<at::Tensor>& v_scale) {
  const int Hkv = k_cache.size(0), D = k_cache.size(3);
  const int Hq = static_cast<int>(num_q_heads);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (Hq + 2 * Hkv) * D, "qkv shape");
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == D / 2 &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rope tables");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches");
  check_kv_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == qkv.size(0) &&
              slot_mapping.numel() == qkv.size(0), "positions and slot_mapping: [T] int64");
  TORCH_CHECK(!packed || (qkv.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                          k_cache.size(2) % 16 == 0 && D % 32 == 0),
              "the packed KV layout needs bf16 qkv and caches, block_size % 16 == 0, D % 32 == 0");
  const int64_t T_ = qkv.size(0);
  const int bs = k_cache.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t max_slot = k_cache.size(1) * k_cache.size(2);
  for (int64_t t = 0; t < T_; t++) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position out of the rope table");
    TORCH_CHECK(slots[t] < max_slot, "slot out of the cache");
  }
  float* ks = q8 ? k_scale->data_ptr<float>() : nullptr;
  float* vs = q8 ? v_scale->data_ptr<float>() : nullptr;
  const int64_t sstride = q8 ? k_scale->stride(0) : 0;
  dispatch_q_kv(qkv.scalar_type(), k_cache.scalar_type(), "rotary_and_cache", [&](auto* tq, auto* tk) {
    using T = std::remove_pointer_t<decltype(tq)>;
    using KT = std::remove_pointer_t<decltype(tk)>;
    rotary_and_cache_impl<T, KT>(qkv.data_ptr<T>(), qkv.stride(0), T_, pos, cos.data_ptr<T>(), sin.data_ptr<T>(), Hq,
                                 Hkv, D, k_cache.data_ptr<KT>(), v_cache.data_ptr<KT>(), k_cache.stride(0), slots, bs,
                                 packed, ks, vs, sstride);
  });
}

// ------------------------------------------------------------------------------ greedy argmax

// Row-wise argmax (first index of the maximum, as torch.argmax), or -1 for a row holding a NaN
// (the caller falls back to torch for those). torch's bf16 argmax is ~10x slower than this scan.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#if TL_AVX512
  __m512 mx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = load16(x + i, m);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    mx = _mm512_mask_max_ps(mx, m, mx, v);
  }
  if (nan) return -1;
  const float best = _mm512_reduce_max_ps(mx);
  const __m512 b = _mm512_set1_ps(best);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail_mask(n - i), load16(x + i, tail_mask(n - i)), b, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return -1;
#else
  int64_t arg = 0;
  float best = to_f(x[0]);
  for (int64_t i = 0; i < n; i++) {
    const float v = to_f(x[i]);
    if (std::isnan(v)) return -1;
    if (v > best) best = v, arg = i;
  }
  return arg;
#endif
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "expected [S, V] rows");
  const int64_t S = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty({S}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_SWITCH(logits.scalar_type(), "argmax_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const float* x = logits.data_ptr<float>();
      at::parallel_for(0, S, 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) o[r] = argmax_row(x + r * logits.stride(0), V);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const bf16* x = logits.data_ptr<bf16>();
      at::parallel_for(0, S, 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) o[r] = argmax_row(x + r * logits.stride(0), V);
      });
    }));
  return out;
}

// ------------------------------------------------------------------------------ int8 W8A8

// The int8 path (tokenloom/model/quant.py): weights int8 per output channel, activations int8 per
// row, both symmetric (scale = max|v| / 127, q = round-half-even(v * 127 / max|v|)); the GEMM is
// torch._int_mm (oneDNN, AVX512-VNNI) into int32, and these kernels are its prologues/epilogues:
//   quantize_rows                 x -> (q, s)
//   rms_norm_quant                (q, s) = quantize(x / rms(x) * w)            (first layer)
//   dequant                       out = acc * sx * sw (+ bias), rounded to out's dtype
//   dequant_add_rms_norm_quant    residual += dequant(acc); (q, s) = quantize(norm(residual) * w)
//   dequant_silu_mul_quant        (q, s) = quantize(silu(g) * u), [g | u] = dequant(acc)
// Normalized and activated rows are quantized from fp32 (never rounded to bf16 in between).

// float and bfloat16 (the run dtypes); scalar_t names the type inside.
#define TL_DISPATCH_F32_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// max |x|, or NaN if x holds one (as torch's amax): the NaN then reaches the row's scale and the
// logits, where the runner's NaN handling sees it, instead of vanishing into a finite scale.
float absmax_row(const float* x, int64_t n) {
#if TL_AVX512
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 t = tail_mask(n - i);
    const __m512 v = load16(x + i, t);
    nan |= _mm512_mask_cmp_ps_mask(t, v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m);
#else
  float m = 0.f;
  for (int64_t i = 0; i < n; i++) {
    if (std::isnan(x[i])) return std::numeric_limits<float>::quiet_NaN();
    m = std::max(m, std::fabs(x[i]));
  }
  return m;
#endif
}

// q = round(x * 127 / max|x|), s = max|x| / 127 (an all-zero row: q = 0, s = 0).
void quantize_row(const float* x, int64_t n, int8_t* q, float* s) {
  const float amax = absmax_row(x, n);
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  *s = amax / 127.0f;
#if TL_AVX512
  const __m512 vi = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i, m), vi));  // MXCSR: nearest even
    r = _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(r));
  }
#else
  for (int64_t i = 0; i < n; i++) {
    const float r = std::nearbyint(x[i] * inv);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
#endif
}

// out[c] = float(acc[c]) * sx * sw[c] (+ bias[c]), fp32.
void dequant_row(const int32_t* acc, float sx, const float* sw, const float* bias, float* out, int64_t n) {
#if TL_AVX512
  const __m512 vs = _mm512_set1_ps(sx);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + i)), vs),
                             _mm512_maskz_loadu_ps(m, sw + i));
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + i));
    _mm512_mask_storeu_ps(out + i, m, v);
  }
#else
  for (int64_t i = 0; i < n; i++) out[i] = static_cast<float>(acc[i]) * sx * sw[i] + (bias ? bias[i] : 0.f);
#endif
}

template <typename T>
void load_row_f32(const T* x, float* out, int64_t n) {
#if TL_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, load16(x + i, m));
  }
#else
  for (int64_t i = 0; i < n; i++) out[i] = to_f(x[i]);
#endif
}

template <typename T>
void store_row(const float* x, T* out, int64_t n) {
#if TL_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16(out + i, _mm512_maskz_loadu_ps(m, x + i), m);
  }
#else
  for (int64_t i = 0; i < n; i++) out[i] = from_f<T>(x[i]);
#endif
}

// A per-thread fp32 row buffer for the fused epilogues.
float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

void check_quant_out(const at::Tensor& q, const at::Tensor& s, int64_t T, int64_t K) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(0) == T && q.size(1) == K && q.stride(1) == 1,
              "expected q int8 [", T, ", ", K, "]");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == T, "expected s float32 [", T, "]");
}

void check_acc(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.stride(1) == 1, "expected acc int32 [T, N]");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == acc.size(0), "expected sx float32 [T]");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == acc.size(1), "expected sw float32 [N]");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == acc.size(1),
                        "expected bias float32 [N]");
}

void quantize_rows(at::Tensor q, at::Tensor s, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "expected rows [T, K]");
  const int64_t T = x.size(0), K = x.size(1);
  check_quant_out(q, s, T, K);
  AT_DISPATCH_SWITCH(x.scalar_type(), "quantize_rows",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++)
          quantize_row(x.data_ptr<float>() + r * x.stride(0), K, q.data_ptr<int8_t>() + r * q.stride(0),
                       s.data_ptr<float>() + r);
      });
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
        float* buf = scratch(K);
        for (int64_t r = b; r < e; r++) {
          load_row_f32(x.data_ptr<bf16>() + r * x.stride(0), buf, K);
          quantize_row(buf, K, q.data_ptr<int8_t>() + r * q.stride(0), s.data_ptr<float>() + r);
        }
      });
    }));
}

template <typename T>
void norm_quant_row(const T* x, const T* w, int64_t H, double eps, float* buf, int8_t* q, float* s) {
  load_row_f32(x, buf, H);
  const float inv = 1.0f / std::sqrt(sum_squares(buf, H) / H + static_cast<float>(eps));
  scale_row(buf, w, buf, H, inv);
  quantize_row(buf, H, q, s);
}

// residual = round(residual + round(d)), rounding to T (a no-op for float).
template <typename T>
void add_rounded(T* residual, const float* d, int64_t n) {
#if TL_AVX512
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    __m512 v = load16(d + i, m);
    if constexpr (std::is_same_v<T, bf16>)
      v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
    store16(residual + i, _mm512_add_ps(load16(residual + i, m), v), m);
  }
#else
  for (int64_t i = 0; i < n; i++) residual[i] = from_f<T>(to_f(residual[i]) + to_f(from_f<T>(d[i])));
#endif
}

void rms_norm_quant(at::Tensor q, at::Tensor s, const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t T = x.size(0), H = x.size(1);
  check_quant_out(q, s, T, H);
  TL_DISPATCH_F32_BF16(x.scalar_type(), "rms_norm_quant", [&] {
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      float* buf = scratch(H);
      for (int64_t r = b; r < e; r++)
        norm_quant_row(x.data_ptr<scalar_t>() + r * x.stride(0), w.data_ptr<scalar_t>(), H, eps, buf,
                       q.data_ptr<int8_t>() + r * q.stride(0), s.data_ptr<float>() + r);
    });
  });
}

void dequant(at::Tensor out, const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
             const c10::optional<at::Tensor>& bias) {
  check_acc(acc, sx, sw, bias);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.sizes() == acc.sizes(), "expected out [T, N]");
  const int64_t T = acc.size(0), N = acc.size(1);
  const float* b_ptr = bias ? bias->data_ptr<float>() : nullptr;
  TL_DISPATCH_F32_BF16(out.scalar_type(), "dequant", [&] {
    at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
      float* buf = scratch(N);
      for (int64_t r = b; r < e; r++) {
        dequant_row(acc.data_ptr<int32_t>() + r * acc.stride(0), sx.data_ptr<float>()[r], sw.data_ptr<float>(),
                    b_ptr, buf, N);
        store_row(buf, out.data_ptr<scalar_t>() + r * out.stride(0), N);
      }
    });
  });
}

// residual += dequant(acc) (rounded to the residual's dtype first, as the bf16 path's o/down
// output is); then (q, s) = quantize(rms_norm(residual) * w).
void dequant_add_rms_norm_quant(at::Tensor q, at::Tensor s, const at::Tensor& acc, const at::Tensor& sx,
                                const at::Tensor& sw, const c10::optional<at::Tensor>& bias, at::Tensor residual,
                                const at::Tensor& w, double eps) {
  check_acc(acc, sx, sw, bias);
  check_rows(residual, w);
  const int64_t T = acc.size(0), H = acc.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == H, "residual must be [T, H] like acc");
  check_quant_out(q, s, T, H);
  const float* b_ptr = bias ? bias->data_ptr<float>() : nullptr;
  TL_DISPATCH_F32_BF16(residual.scalar_type(), "dequant_add_rms_norm_quant", [&] {
    at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      float* buf = scratch(H);
      for (int64_t r = b; r < e; r++) {
        scalar_t* rr = residual.data_ptr<scalar_t>() + r * residual.stride(0);
        dequant_row(acc.data_ptr<int32_t>() + r * acc.stride(0), sx.data_ptr<float>()[r], sw.data_ptr<float>(),
                    b_ptr, buf, H);
        add_rounded(rr, buf, H);
        norm_quant_row(rr, w.data_ptr<scalar_t>(), H, eps, buf, q.data_ptr<int8_t>() + r * q.stride(0),
                       s.data_ptr<float>() + r);
      }
    });
  });
}

// (q, s) = quantize(silu(g) * u), [g | u] = dequant(acc) in fp32.
void dequant_silu_mul_quant(at::Tensor q, at::Tensor s, const at::Tensor& acc, const at::Tensor& sx,
                            const at::Tensor& sw, const c10::optional<at::Tensor>& bias) {
  check_acc(acc, sx, sw, bias);
  TORCH_CHECK(acc.size(1) % 2 == 0, "acc must be [T, 2I]");
  const int64_t T = acc.size(0), I = acc.size(1) / 2;
  check_quant_out(q, s, T, I);
  const float* b_ptr = bias ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    float* buf = scratch(3 * I);
    for (int64_t r = b; r < e; r++) {
      dequant_row(acc.data_ptr<int32_t>() + r * acc.stride(0), sx.data_ptr<float>()[r], sw.data_ptr<float>(),
                  b_ptr, buf, 2 * I);
      silu_mul_row(buf, buf + I, buf + 2 * I, I);
      quantize_row(buf + 2 * I, I, q.data_ptr<int8_t>() + r * q.stride(0), s.data_ptr<float>() + r);
    }
  });
}

bool has_avx512() { return TL_AVX512; }

// ------------------------------------------------------------------------------ int8 GEMM (no VNNI)

// int8_gemm: acc[t, n] = sum_k x[t, k] * w[k, n], exact int32, for the W8A8 layers on CPUs without
// VNNI or AMX-INT8, where oneDNN's int8 GEMM (torch._int_mm) runs ~0.7 GMAC/s (AVX2 Zen 1: slower than
// its float32 GEMM by ~20x) and saturates full-range weights. The weights are packed once
// (int8_pack_weight in quant.py): [N/8][K/4][8][4], each 32 bytes eight output channels' four
// consecutive k, so that vpmaddubsw pairs neighbouring k of one channel. vpmaddubsw multiplies
// unsigned by signed bytes; |x| (<= 127, the quantizer clamps) times sign(x) * w (|w| <= 127) gives
// the same products, and a pair sums to at most 2 * 127 * 127 = 32258 < 32767: never saturates, so
// the sums are exactly _int_mm's (the tokens do not depend on which GEMM ran).
template <int MR>
void int8_block(const int8_t* x, int64_t K, const int8_t* wp, int32_t* acc, int64_t N, int64_t nb0, int64_t nb1) {
  const int64_t K4 = K / 4;
  for (int64_t nb = nb0; nb < nb1; nb++) {
    const int8_t* w = wp + nb * K4 * 32;
#if TL_AVX2
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sum[MR];
    for (int r = 0; r < MR; r++) sum[r] = _mm256_setzero_si256();
    for (int64_t kb = 0; kb < K4; kb++) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 32));
      for (int r = 0; r < MR; r++) {
        int32_t four;
        std::memcpy(&four, x + r * K + kb * 4, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb), _mm256_sign_epi8(wv, xb));
        sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(prod, ones));
      }
    }
    for (int r = 0; r < MR; r++)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * N + nb * 8), sum[r]);
#else
    for (int r = 0; r < MR; r++)
      for (int c = 0; c < 8; c++) {
        int32_t total = 0;
        for (int64_t kb = 0; kb < K4; kb++)
          for (int j = 0; j < 4; j++) total += int32_t(x[r * K + kb * 4 + j]) * int32_t(w[kb * 32 + c * 4 + j]);
        acc[r * N + nb * 8 + c] = total;
      }
#endif
  }
}

void int8_gemm(at::Tensor acc, const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.scalar_type() == at::kChar && x.dim() == 2 && x.is_contiguous(), "int8_gemm: x int8 [T, K]");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(wp.scalar_type() == at::kChar && wp.is_contiguous() && wp.dim() == 4 && wp.size(1) * 4 == K &&
              wp.size(2) == 8 && wp.size(3) == 4, "int8_gemm: packed weight int8 [N/8, K/4, 8, 4]");
  const int64_t N = wp.size(0) * 8;
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.size(0) == T && acc.size(1) == N,
              "int8_gemm: acc int32 [T, N]");
  const int8_t* xp = x.data_ptr<int8_t>();
  const int8_t* w = wp.data_ptr<int8_t>();
  int32_t* out = acc.data_ptr<int32_t>();
  // Four rows share each weight load; threads split the output channels, so every row's sums are the
  // same whatever the thread count.
  at::parallel_for(0, N / 8, 4, [&](int64_t b, int64_t e) {
    int64_t r = 0;
    for (; r + 4 <= T; r += 4) int8_block<4>(xp + r * K, K, w, out + r * N, N, b, e);
    switch (T - r) {
      case 3: int8_block<3>(xp + r * K, K, w, out + r * N, N, b, e); break;
      case 2: int8_block<2>(xp + r * K, K, w, out + r * N, N, b, e); break;
      case 1: int8_block<1>(xp + r * K, K, w, out + r * N, N, b, e); break;
      default: break;
    }
  });
}

// ------------------------------------------------------------------------------ skinny fp32 GEMM

// skinny_linear: out[m, :] = x[m, :] @ w.T (+ bias) for a few rows, fp32 (tokenloom/model/linear.py
// uses it for 2..16 rows: speculative decoding's verification rows, small decode batches). Each
// weight row is read once for up to 8 input rows, so while the weights stream from memory a step
// with a handful of rows costs about what one row does; the BLAS skinny-GEMM path costs ~m times
// one row here (AVX2). The dot products run in the same order whatever the number of rows.
template <int M>
void skinny_rows(const float* x, const float* w, const float* bias, float* out, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n++) {
    const float* wr = w + n * K;
    float sums[M];
    int64_t k = 0;
#if TL_AVX2
    __m256 acc[M];
    for (int r = 0; r < M; r++) acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wr + k);
      for (int r = 0; r < M; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r]);
    }
    for (int r = 0; r < M; r++) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      s = _mm_hadd_ps(s, s);
      s = _mm_hadd_ps(s, s);
      sums[r] = _mm_cvtss_f32(s);
    }
#else
    for (int r = 0; r < M; r++) sums[r] = 0.f;
#endif
    for (; k < K; k++)
      for (int r = 0; r < M; r++) sums[r] += x[r * K + k] * wr[k];
    for (int r = 0; r < M; r++) out[r * N + n] = sums[r] + (bias ? bias[n] : 0.f);
  }
}

template <int M>
void skinny_block(const float* x, const float* w, const float* bias, float* out, int64_t K, int64_t N) {
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) { skinny_rows<M>(x, w, bias, out, K, N, b, e); });
}

void skinny_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "skinny_linear: fp32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.is_contiguous() && w.is_contiguous() &&
              out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == w.size(0), "skinny_linear: shapes");
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "skinny_linear: bias");
    bp = bias->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t m = std::min<int64_t>(8, rows - r0);
    // Row block r0 of the output is a [m, N] matrix with row stride N.
    const float* xb = xp + r0 * K;
    float* ob = op + r0 * N;
    switch (m) {
      case 1: skinny_block<1>(xb, wp, bp, ob, K, N); break;
      case 2: skinny_block<2>(xb, wp, bp, ob, K, N); break;
      case 3: skinny_block<3>(xb, wp, bp, ob, K, N); break;
      case 4: skinny_block<4>(xb, wp, bp, ob, K, N); break;
      case 5: skinny_block<5>(xb, wp, bp, ob, K, N); break;
      case 6: skinny_block<6>(xb, wp, bp, ob, K, N); break;
      case 7: skinny_block<7>(xb, wp, bp, ob, K, N); break;
      default: skinny_block<8>(xb, wp, bp, ob, K, N); break;
    }
  }
}

void set_force_scalar(bool on) { g_force_scalar = on; }
void set_prefetch_blocks(int64_t n) { g_prefetch_blocks = static_cast<int>(n); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute calls release the GIL (as torch's own ops do), so the engine thread's Python runs
  // beside them under async scheduling instead of waiting for each kernel (docs/async.md).
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  using pybind11::arg;  // the int8 caches' scales are optional: callers of float caches pass neither
  m.def("paged_attention", &paged_attention, nogil, arg("out"), arg("q"), arg("k_cache"), arg("v_cache"),
        arg("block_tables"), arg("q_start"), arg("pos_start"), arg("scale"), arg("packed"),
        arg("k_scale") = pybind11::none(), arg("v_scale") = pybind11::none());
  m.def("rms_norm", &rms_norm, nogil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, nogil);
  m.def("silu_and_mul", &silu_and_mul, nogil);
  m.def("rotary_and_cache", &rotary_and_cache, nogil, arg("qkv"), arg("positions"), arg("cos"), arg("sin"),
        arg("num_q_heads"), arg("k_cache"), arg("v_cache"), arg("slot_mapping"), arg("packed"),
        arg("k_scale") = pybind11::none(), arg("v_scale") = pybind11::none());
  m.def("argmax_rows", &argmax_rows, nogil);
  m.def("skinny_linear", &skinny_linear, nogil);
  m.def("quantize_rows", &quantize_rows, nogil);
  m.def("rms_norm_quant", &rms_norm_quant, nogil);
  m.def("dequant", &dequant, nogil);
  m.def("dequant_add_rms_norm_quant", &dequant_add_rms_norm_quant, nogil);
  m.def("dequant_silu_mul_quant", &dequant_silu_mul_quant, nogil);
  m.def("int8_gemm", &int8_gemm, nogil, arg("acc"), arg("x"), arg("wp"));
  m.def("has_avx512", &has_avx512);
  m.def("packed_layout_supported", &packed_layout_supported);
  m.def("set_force_scalar", &set_force_scalar);
  m.def("set_prefetch_blocks", &set_prefetch_blocks);
}
