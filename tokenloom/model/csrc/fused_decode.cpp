// The fused decode step (built with gguf_kernels.cpp into one extension: tokenloom/model/gguf_kernels.py;
// the Python side is tokenloom/model/fused_decode.py).
//
// FusedDecoder runs a whole decode step (every layer, one call from Python) for a few sequences of
// one new token each: embedding row, and per layer RMSNorm -> qkv -> neox rotary + KV-cache write ->
// paged attention -> o-proj + residual -> RMSNorm -> gate/up -> SiLU*mul -> down + residual; then the
// final norm. Activations stay fp32 in reused buffers; the weights are the GGUF blocks (run by
// gguf_kernels.cpp's dot products, through gguf_quants.h) or float32 / bf16 matrices (the dense
// kernel below), so it serves quantized GGUF models and unquantized float models alike. KV caches:
// the plain head-major layout [Hkv, num_blocks, block_size, D] in float, bf16 or int8, shared with
// the rest of the runner.

#include <omp.h>
#include <pybind11/stl.h>

#include <cstring>
#include <tuple>

#include "gguf_quants.h"

namespace {

using namespace tlq;        // bf16, QAct, g_force_scalar, TLQ_AVX2; hsum8, load8f, quantize_kv_row
using namespace tlq::gguf;  // the quantized linears' entry points

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
  s = hsum8(_mm256_add_ps(acc0, acc1));
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

#if TLQ_AVX2
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
    for (int r = 0; r < NR; r++) wv[r] = load8f(w + r * K + i);
    for (int m = 0; m < MT; m++) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + i);
      for (int r = 0; r < NR; r++) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MT; m++)
    for (int r = 0; r < NR; r++) {
      float s = hsum8(acc[m][r]);
      // std::fma: one rounding in every MT x NR instantiation (a contracted `+= a * b` need not be in all).
      for (int64_t j = i; j < K; j++) s = std::fma(x[m * K + j], static_cast<float>(w[r * K + j]), s);
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

// The most parts one linear may have (q, k, v of different types; qlin_share keeps cursors per part).
constexpr int kMaxParts = 8;

// parts: (weight, GGML type, bias, packed); packed: the weight is already in the 8-row layout.
using PartSpec = std::tuple<at::Tensor, int64_t, c10::optional<at::Tensor>, bool>;

QLin make_qlin(const std::vector<PartSpec>& parts, int64_t K) {
  TORCH_CHECK(parts.size() <= static_cast<size_t>(kMaxParts), "a fused linear takes at most ", kMaxParts,
              " parts, got ", parts.size());
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

// Thread tid's first share of each packed part's tiles: before the barrier that precedes qlin_share
// (cursors: kMaxParts x nth).
void qlin_steal_init(const QLin& L, TileCursor* cursors, int tid, int nth) {
  for (size_t i = 0; i < L.parts.size(); i++)
    if (L.parts[i].packed.defined()) steal_init(cursors + i * nth, L.parts[i].packed.size(0), tid, nth);
}

// Thread tid's share of out [M, L.N] = x @ L.T + bias inside a parallel region. act holds x quantized
// when L.quantized. A packed part's tiles start as contiguous halves and a thread that ends its own
// steals from another's end (steal_run, gguf_quants.h; cursors set by qlin_steal_init); other parts
// split statically.
void qlin_share(const QLin& L, const float* x, int64_t M, const QAct& act, float* out, int tid, int nth,
                TileCursor* cursors) {
  int64_t col = 0, b, e;
  for (size_t i = 0; i < L.parts.size(); i++) {
    const Part& p = L.parts[i];
    const float* bias = p.bias ? p.bias->data_ptr<float>() : nullptr;
    if (p.packed.defined()) {
      const uint8_t* pw = p.packed.data_ptr<uint8_t>();
      float* o = out + col;
      steal_run(cursors + i * nth, tid, nth,
                [&](TileCursor& c) { run_packed_cursor(p.t, act, pw, bias, o, L.N, c); });
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
    __m256 a0 = _mm256_mul_ps(qv[0], load8f(k)), a1 = _mm256_mul_ps(qv[1], load8f(k + 8));
    for (int j = 2; j < ND; j += 2) {
      a0 = _mm256_fmadd_ps(qv[j], load8f(k + 8 * j), a0);
      a1 = _mm256_fmadd_ps(qv[j + 1], load8f(k + 8 * j + 8), a1);
    }
    scores[t] = hsum8(_mm256_add_ps(a0, a1)) * (ksc ? scale * ksc[(h * nb + table[t / bs]) * bs + t % bs] : scale);
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
  float sum = hsum8(sv);
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
    for (int j = 0; j < ND; j++) acc[j] = _mm256_fmadd_ps(w, load8f(v + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (int j = 0; j < ND; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(acc[j], inv));
}

// attend_simd for the gn query heads of kv head h that share it (GQA): q rows and o rows of the heads
// contiguous, D apart. Each head gets attend_simd's arithmetic to the bit (the same products, sums and
// exps in the same order); what changes is that a tile of kTileKeys keys' K rows, then V rows, is read
// (and converted from bf16 / fp16 / int8) once for all gn heads instead of once per head. With a
// 16-bit or int8 cache the conversion, not the memory, was the cost per key on AVX2 CPUs (Zen 1 runs
// one vcvtph2ps every two cycles); with a float cache the tile is read from L1 gn times instead of a
// long context's K/V from L2 or memory gn times.
template <int ND, typename KT>
void attend_simd_heads(const KT* kc, const KT* vc, int64_t nb, int64_t bs, const float* q, int64_t h, int gn,
                       int64_t n, const int32_t* table, float scale, std::vector<float>& buf, float* o,
                       const float* ksc, const float* vsc) {
  constexpr int64_t D = 8 * ND;
  constexpr int kTileKeys = 32;
  constexpr bool convert = !std::is_same_v<KT, float>;
  const int64_t npad = n + 8;
  buf.resize(static_cast<size_t>(gn) * npad + (convert ? kTileKeys * D : 0));
  float* scores = buf.data();
  float* tile = scores + gn * npad;  // a converted tile: kTileKeys rows of D floats
  const float* rows[kTileKeys];
  int64_t slots[kTileKeys];
  // The tile's rows of K or V as floats (pointers into the cache when it is float).
  auto load_tile = [&](const KT* cache, int64_t t0, int nk) {
    for (int j = 0; j < nk; j++) {
      const int64_t t = t0 + j;
      slots[j] = (h * nb + table[t / bs]) * bs + t % bs;
      const KT* src = cache + slots[j] * D;
      if constexpr (convert) {
        for (int c = 0; c < ND; c++) _mm256_storeu_ps(tile + j * D + 8 * c, load8f(src + 8 * c));
        rows[j] = tile + j * D;
      } else {
        rows[j] = src;
      }
    }
  };
  // Scores (and each head's running max).
  float mx[64];
  for (int g = 0; g < gn; g++) mx[g] = -INFINITY;
  for (int64_t t0 = 0; t0 < n; t0 += kTileKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kTileKeys, n - t0));
    load_tile(kc, t0, nk);
    for (int g = 0; g < gn; g++) {
      __m256 qv[ND];
      for (int j = 0; j < ND; j++) qv[j] = _mm256_loadu_ps(q + g * D + 8 * j);
      float* sg = scores + g * npad + t0;
      for (int jk = 0; jk < nk; jk++) {
        const float* k = rows[jk];
        __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), a1 = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
        for (int j = 2; j < ND; j += 2) {
          a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a0);
          a1 = _mm256_fmadd_ps(qv[j + 1], _mm256_loadu_ps(k + 8 * j + 8), a1);
        }
        sg[jk] = hsum8(_mm256_add_ps(a0, a1)) * (ksc ? scale * ksc[slots[jk]] : scale);
        mx[g] = std::max(mx[g], sg[jk]);
      }
    }
  }
  // Softmax numerators in place, each head's sum.
  float sum[64];
  for (int g = 0; g < gn; g++) {
    float* sg = scores + g * npad;
    const __m256 mv = _mm256_set1_ps(mx[g]);
    __m256 sv = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 ev = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
      _mm256_storeu_ps(sg + t, ev);
      sv = _mm256_add_ps(sv, ev);
    }
    sum[g] = hsum8(sv);
    for (; t < n; t++) {
      sg[t] = std::exp(sg[t] - mx[g]);
      sum[g] += sg[t];
    }
  }
  // Weighted sums of V, each head's accumulators carried in o between tiles.
  for (int64_t t0 = 0; t0 < n; t0 += kTileKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kTileKeys, n - t0));
    load_tile(vc, t0, nk);
    for (int g = 0; g < gn; g++) {
      __m256 acc[ND];
      for (int j = 0; j < ND; j++) acc[j] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + g * D + 8 * j);
      const float* sg = scores + g * npad + t0;
      for (int jk = 0; jk < nk; jk++) {
        const __m256 w = _mm256_set1_ps(vsc ? sg[jk] * vsc[slots[jk]] : sg[jk]);
        for (int j = 0; j < ND; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[jk] + 8 * j), acc[j]);
      }
      for (int j = 0; j < ND; j++) _mm256_storeu_ps(o + g * D + 8 * j, acc[j]);
    }
  }
  for (int g = 0; g < gn; g++) {
    const __m256 inv = _mm256_set1_ps(1.0f / sum[g]);
    float* og = o + g * D;
    for (int j = 0; j < ND; j++) _mm256_storeu_ps(og + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(og + 8 * j), inv));
  }
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
    for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8f(k + i), acc);
    s = hsum8(acc);
#endif
    for (; i < D; i++) s += q[i] * static_cast<float>(k[i]);
    return s;
  }
}

template <typename T>
inline void axpy_cache(float a, const T* v, float* o, int64_t D) {
  for (int64_t i = 0; i < D; i++) o[i] += a * static_cast<float>(v[i]);
}

class FusedDecoder {
 public:
  // embed_packed: the embedding table is in the 8-row layout (shared with a tied LM head).
  FusedDecoder(int64_t hidden, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
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
                         c->scalar_type() == at::kHalf || c->scalar_type() == at::kChar),
                    "KV caches must all be float, all bf16, all fp16 or all int8");
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
    TORCH_CHECK(!layers_.empty() && layers_[0].k_cache.defined(), "FusedDecoder: layers and KV caches not set");
    TORCH_CHECK(!scales_pending_, "FusedDecoder: int8 KV caches without their scales (set_kv_scales)");
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
    // CT: the rope tables' type (the run dtype's); KT: the caches' elements.
    const int64_t* sl = slots.data_ptr<int64_t>();
    const bool f32_rope = cos.scalar_type() == at::kFloat;
    auto with_kv = [&](auto* tc) {
      using CT = std::remove_pointer_t<decltype(tc)>;
      switch (layers_[0].k_cache.scalar_type()) {
        case at::kFloat: return run_step<CT, float>(out, B, idp, pos, sl, block_tables, cos, sin);
        case at::kBFloat16: return run_step<CT, bf16>(out, B, idp, pos, sl, block_tables, cos, sin);
        case at::kHalf: return run_step<CT, f16>(out, B, idp, pos, sl, block_tables, cos, sin);
        default: return run_step<CT, int8_t>(out, B, idp, pos, sl, block_tables, cos, sin);
      }
    };
    if (f32_rope) with_kv(static_cast<float*>(nullptr));
    else with_kv(static_cast<bf16*>(nullptr));
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
    const int max_threads = at::get_num_threads();
    if (cursors_.size() < static_cast<size_t>(kMaxParts * max_threads))
      cursors_ = std::vector<TileCursor>(kMaxParts * max_threads);
    TileCursor* cursors = cursors_.data();
#pragma omp parallel num_threads(max_threads)
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
        qlin_steal_init(L.qkv, cursors, tid, nth);
#pragma omp barrier
        qlin_share(L.qkv, x, B, act_h_, qkv, tid, nth, cursors);
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
            } else {
              store_kv_row(row + hd * D_, D_, kd);
              store_kv_row(row + (Hq_ + Hkv_ + kvh) * D_, D_, vd);
            }
          }
        }
#pragma omp barrier
        // Work items: `gc` query heads of one kv head in one row (attend_heads reads each key once for them).
        auto attend_item = [&](int64_t i, int64_t gc) {  // heads (i % (Hq_ / gc)) * gc .. + gc - 1 of row i / ...
          const int64_t per_row = Hq_ / gc, r = i / per_row, hq = (i % per_row) * gc;
          attend_heads(kc, vc, nb, bs, qkv + r * QKV + hq * D_, hq / (Hq_ / Hkv_), static_cast<int>(gc), pos[r] + 1,
                       tb + r * ld, scores, att + r * AD + hq * D_, ksc, vsc);
        };
        if (B >= 2 * nth) {
          // Many rows (a prefill chunk's, batch-invariant): whole rows handed out as threads free up. A chunk's
          // later rows attend to more keys, so contiguous shares left the first thread idle for most of the op.
          const int64_t G = Hq_ / Hkv_;
#pragma omp for schedule(dynamic, 1) nowait
          for (int64_t r = 0; r < B; r++)
            for (int64_t kvh = 0; kvh < Hkv_; kvh++) attend_item(r * Hkv_ + kvh, G);
        } else {  // a few decode rows: their (row, heads) items split evenly, so one row's heads use every thread
          const int64_t gc = heads_per_item(B, nth);
          thread_share(B * Hq_ / gc, tid, nth, b, e);
          for (int64_t i = b; i < e; i++) attend_item(i, gc);
        }
        if (L.o.quantized) {
#pragma omp barrier
          thread_share(B * AD / 32, tid, nth, b, e);
          act_att_.quantize_groups(att, AD, b, e);
        }
        qlin_steal_init(L.o, cursors, tid, nth);
#pragma omp barrier
        qlin_share(L.o, att, B, act_att_, x, tid, nth, cursors);
#pragma omp barrier
        for (int64_t r = r0; r < r1; r++) {
          float* hr = h + r * H_;
          float* xr = x + r * H_;
          for (int64_t t = 0; t < H_; t++) hr[t] += xr[t];
          rms_norm_f32(hr, L.ffn_norm.data_ptr<float>(), H_, eps_, xr);
          if (L.gate_up.quantized) act_h_.quantize_groups(x, H_, r * H_ / 32, (r + 1) * H_ / 32);
        }
        qlin_steal_init(L.gate_up, cursors, tid, nth);
#pragma omp barrier
        qlin_share(L.gate_up, x, B, act_h_, gu, tid, nth, cursors);
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
        qlin_steal_init(L.down, cursors, tid, nth);
#pragma omp barrier
        qlin_share(L.down, act, B, act_ffn_, x, tid, nth, cursors);
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

  // Query heads per attention work item of a decode step of B rows on nth threads: all G heads of a kv head
  // (each key read once for them) when that still splits evenly over the threads or leaves >= 4 items a
  // thread, else fewer (a divisor of G), down to one head an item, which always spreads a row's heads over
  // every thread. The arithmetic per head is the same whichever it is.
  int64_t heads_per_item(int64_t B, int nth) const {
    const int64_t G = Hq_ / Hkv_;
    for (int64_t gc = std::min<int64_t>(G, 64); gc > 1; gc--) {
      if (G % gc) continue;
      const int64_t items = B * Hq_ / gc;
      if (items % nth == 0 || items >= 4 * nth) return gc;
    }
    return 1;
  }

  // gn query heads (q and o rows D apart) of kv head h over their sequence's first n cached positions:
  // the grouped SIMD kernel where there is one, else attend() per head (the same numbers either way).
  template <typename KT>
  void attend_heads(const KT* kc, const KT* vc, int64_t nb, int64_t bs, const float* q, int64_t h, int gn, int64_t n,
                    const int32_t* table, std::vector<float>& scores, float* o, const float* ksc,
                    const float* vsc) const {
#if TLQ_AVX2
    if (gn > 1 && gn <= 64 && !g_force_scalar) {
      const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
      if (D_ == 64) return attend_simd_heads<8>(kc, vc, nb, bs, q, h, gn, n, table, scale, scores, o, ksc, vsc);
      if (D_ == 128) return attend_simd_heads<16>(kc, vc, nb, bs, q, h, gn, n, table, scale, scores, o, ksc, vsc);
    }
#endif
    for (int g = 0; g < gn; g++) attend(kc, vc, nb, bs, q + g * D_, h, n, table, scores, o + g * D_, ksc, vsc);
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
  std::vector<TileCursor> cursors_;  // qlin_share's work-stealing cursors: kMaxParts x threads
  bool scales_pending_ = false;  // int8 caches set, their scales not yet
  std::vector<float> h_, x_, qkv_, att_, gu_, act_;
  QAct act_h_, act_att_, act_ffn_;  // activations quantized for the linears of input H, Hq * D, I
};

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

}  // namespace

void tlq::register_fused_decode(pybind11::module& m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();  // see gguf_kernels.cpp's module
  m.def("dense_linear", &dense_linear, nogil);
  pybind11::class_<FusedDecoder>(m, "FusedDecoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, at::Tensor, int64_t, at::Tensor, bool>())
      .def("add_layer", &FusedDecoder::add_layer)
      .def("set_kv_caches", &FusedDecoder::set_kv_caches)
      .def("set_kv_scales", &FusedDecoder::set_kv_scales)
      .def("step", &FusedDecoder::step, nogil)
      .def("num_layers", &FusedDecoder::num_layers);
}
