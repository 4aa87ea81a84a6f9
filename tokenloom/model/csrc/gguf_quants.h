// What the GGUF kernels (gguf_kernels.cpp) and the fused decoder (fused_decode.cpp) share: the ISA
// switches (and, through cpu_common.h, the helpers cpu_kernels.cpp uses too), activation quantization (QAct: the int8 groups every quantized linear multiplies), and
// the entry points of gguf_kernels.cpp that the decoder calls. Both sources are compiled into one
// extension (tokenloom/model/gguf_kernels.py), so this header is its only interface between them.
//
// Namespaces: `tlq` holds the shared types and inline helpers; `tlq::gguf` the functions
// gguf_kernels.cpp defines for the decoder (forwarders to its internal ones: its kernels stay in an
// anonymous namespace, so the compiler keeps inlining them as before, and a call on a tlq type in
// there cannot find a second candidate in tlq by argument-dependent lookup).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

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

namespace tlq {

using namespace tlc;  // bf16, to_f, hsum8, load8f, quantize_kv_row (cpu_common.h, shared with cpu_kernels.cpp)

extern bool g_force_scalar;  // tests hold the SIMD path to the plain one (set_force_scalar)

struct TypeInfo {
  int block_elems;
  int block_bytes;
};

// ------------------------------------------------------------------------ activation quantization
// Every quantized linear multiplies int8 activations, quantized as ggml's CPU backend quantizes them
// for the weight's type (its vec_dot_type), so that the integer sums are ggml's:
//   kActQ8_0  Q8_0 / Q4_0 / Q5_0 weights (block_q8_0): per 32, q = round(x * 127 / max|x|) (half to
//             even, ggml's AVX2 quantize_row_q8_0), d = max|x| / 127 stored as fp16: the kernels
//             multiply by fp16(d), not d
//   kActQ8_1  Q4_1 / Q5_1 (block_q8_1): q and fp16(d) as kActQ8_0, and s = fp16(d * sum(q)) with d
//             unrounded (ggml's AVX2 quantize_row_q8_1)
//   kActQ8_K  the K-quants (block_q8_K, quantize_row_q8_K_ref): per 256, the element of largest |x|
//             (the first one) is max, iscale = -127 / max, q = min(127, round(iscale * x)), d = 1 /
//             iscale (a float, negative when max > 0)
// The kernels read every form through the same arrays, per group of 32: d (kActQ8_K: the
// super-block's d repeated over its eight groups, so a kernel may read it once per 256), s = the
// group's offset term (kActQ8_0 / kActQ8_K: d * sum(q); kActQ8_1 as above) and bs = the integer
// sums of q per 16 (ggml's bsums: the Q4_K mins and the Q6_K offset multiply them).
enum ActForm : int { kActQ8_0 = 0, kActQ8_1 = 1, kActQ8_K = 2 };
constexpr int kActForms = 3;

// GGML type ids of the types whose activations are not kActQ8_0 (gguf.GGMLQuantizationType).
constexpr int kTypeQ4_1 = 3, kTypeQ5_1 = 7, kTypeQ2_K = 10, kTypeQ6_K = 14;

// The activation form a weight of GGML type qtype multiplies (ggml's type_traits_cpu[].vec_dot_type).
constexpr ActForm act_form(int qtype) {
  if (qtype >= kTypeQ2_K && qtype <= kTypeQ6_K) return kActQ8_K;
  return (qtype == kTypeQ4_1 || qtype == kTypeQ5_1) ? kActQ8_1 : kActQ8_0;
}
constexpr unsigned form_bit(ActForm f) { return 1u << f; }
// Elements per quantization block of a form: its scale's span.
constexpr int64_t act_unit(ActForm f) { return f == kActQ8_K ? 256 : 32; }

// float -> fp16 -> float, rounded to nearest even (ggml's GGML_CPU_FP32_TO_FP16 on x86: vcvtps2ph).
inline float fp16_round(float v) {
#if TLQ_AVX2
  return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  return static_cast<float>(c10::Half(v));
#endif
}

#if TLQ_AVX2
// 32 floats times id, rounded to nearest even (vcvtps2dq in the default mode, as nearbyint), capped
// at 127, to int8 in q; the two per-16 sums to bs. Returns the group's integer sum.
inline int scale_round_group_avx2(const float* x, __m256 id, int8_t* q, int16_t* bs) {
  const __m256i cap = _mm256_set1_epi32(127);
  __m256i i[4];
  for (int j = 0; j < 4; j++) i[j] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), id)), cap);
  // Per 16: (lo, hi) reduced side by side in the two halves of one 128-bit vector.
  const __m256i lo = _mm256_add_epi32(i[0], i[1]), hi = _mm256_add_epi32(i[2], i[3]);
  const __m128i lo4 = _mm_add_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  const __m128i hi4 = _mm_add_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  __m128i p = _mm_hadd_epi32(lo4, hi4);  // lo0+lo1, lo2+lo3, hi0+hi1, hi2+hi3
  p = _mm_hadd_epi32(p, p);              // lo, hi, lo, hi
  bs[0] = static_cast<int16_t>(_mm_cvtsi128_si32(p));
  bs[1] = static_cast<int16_t>(_mm_extract_epi32(p, 1));
  // packs work within 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7 of the wanted order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return bs[0] + bs[1];
}

inline float amax_avx2(const float* x, int64_t n) {  // max |x| over n (a multiple of 8) floats
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

// The plain loop of scale_round_group_avx2 (any element type).
template <typename T>
int scale_round_group_plain(const T* x, float id, int8_t* q, int16_t* bs) {
  int half[2] = {0, 0};
  for (int j = 0; j < 32; j++) {
    const int qi = std::min(127, static_cast<int>(std::nearbyint(to_f(x[j]) * id)));
    q[j] = static_cast<int8_t>(qi);
    half[j / 16] += qi;
  }
  bs[0] = static_cast<int16_t>(half[0]);
  bs[1] = static_cast<int16_t>(half[1]);
  return half[0] + half[1];
}

// 32 values times id, rounded, capped, to q and bs; returns their sum. Both paths give the same
// bytes (the same float product, rounded to nearest even).
template <typename T>
int scale_round_group(const T* x, float id, int8_t* q, int16_t* bs) {
#if TLQ_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (!g_force_scalar) return scale_round_group_avx2(x, _mm256_set1_ps(id), q, bs);
#endif
  return scale_round_group_plain(x, id, q, bs);
}

// max |x| over n values (n a multiple of 8).
template <typename T>
float amax_of(const T* x, int64_t n) {
#if TLQ_AVX2
  if constexpr (std::is_same_v<T, float>)
    if (!g_force_scalar) return amax_avx2(x, n);
#endif
  float amax = 0.0f;
  for (int64_t j = 0; j < n; j++) amax = std::max(amax, std::fabs(to_f(x[j])));
  return amax;
}

// One group of 32 in kActQ8_0 / kActQ8_1 form: q, d (fp16-rounded), s, bs.
template <typename T>
void quantize_q8_0_group(const T* x, ActForm form, int8_t* q, float* d, float* s, int16_t* bs) {
  const float amax = amax_of(x, 32);
  const int sum = scale_round_group(x, amax > 0.0f ? 127.0f / amax : 0.0f, q, bs);
  const float dg = amax / 127.0f;
  *d = fp16_round(dg);
  *s = form == kActQ8_1 ? fp16_round(dg * static_cast<float>(sum)) : *d * static_cast<float>(sum);
}

// One super-block of 256 in kActQ8_K form: q, d and s per group of 32 (d repeated), bs.
template <typename T>
void quantize_q8_k_block(const T* x, int8_t* q, float* d, float* s, int16_t* bs) {
  const float amax = amax_of(x, 256);
  float max = 0.0f;  // ggml's: the first element of largest |x|, with its sign
  for (int j = 0; j < 256 && amax > 0.0f; j++)
    if (std::fabs(to_f(x[j])) == amax) {
      max = to_f(x[j]);
      break;
    }
  const float iscale = amax > 0.0f ? -127.0f / max : 0.0f;
  const float db = amax > 0.0f ? 1.0f / iscale : 0.0f;
  for (int g = 0; g < 8; g++) {
    const int sum = scale_round_group(x + 32 * g, iscale, q + 32 * g, bs + 2 * g);
    d[g] = db;
    s[g] = db * static_cast<float>(sum);
  }
}

// Units [u0, u1) of one row of K elements in form `form` (a unit: act_unit(form) elements), into
// the row's arrays (q [K], d and s [K / 32], bs [K / 16]).
template <typename T>
void quantize_act(const T* x, ActForm form, int64_t u0, int64_t u1, int8_t* q, float* d, float* s, int16_t* bs) {
  for (int64_t u = u0; u < u1; u++) {
    if (form == kActQ8_K)
      quantize_q8_k_block(x + 256 * u, q + 256 * u, d + 8 * u, s + 8 * u, bs + 16 * u);
    else
      quantize_q8_0_group(x + 32 * u, form, q + 32 * u, d + u, s + u, bs + 2 * u);
  }
}

// Activations quantized for the kernels: rows of int8 with per-32 d and s, per-16 bs, in one form.
struct QAct {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bs;
  int64_t M = 0, K = 0;
  ActForm form = kActQ8_0;

  int64_t unit() const { return act_unit(form); }

  // Sizes the buffers for [M_, K_] in form f_ without quantizing (the decoder then fills them unit by unit).
  void shape(int64_t M_, int64_t K_, ActForm f_) {
    M = M_;
    K = K_;
    form = f_;
    q.resize(M * K);
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    bs.resize(M * K / 16);
  }

  // Quantizes units [u0, u1) of the flattened [M, K / unit()] units of x (rows ldx apart).
  void quantize_units(const float* x, int64_t ldx, int64_t u0, int64_t u1) {
    const int64_t U = K / unit(), per = unit() / 32;  // units per row, groups of 32 per unit
    for (int64_t i = u0; i < u1; i++) {
      const int64_t m = i / U, u = i % U;
      quantize_act(x + m * ldx + unit() * u, form, 0, 1, q.data() + m * K + unit() * u, d.data() + per * i,
                   s.data() + per * i, bs.data() + 2 * per * i);
    }
  }

  template <typename T>
  void set(const T* x, int64_t M_, int64_t K_, int64_t ldx, ActForm f_) {
    shape(M_, K_, f_);
    TORCH_CHECK(K % unit() == 0, "activation width ", K, " is not a multiple of ", unit());
    const int64_t G = K / 32, U = K / unit();
    auto row = [&](int64_t r) {
      quantize_act(x + r * ldx, form, 0, U, q.data() + r * K, d.data() + r * G, s.data() + r * G, bs.data() + r * 2 * G);
    };
    if (M == 1) return row(0);
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; r++) row(r);
    });
  }
};

// One input's activations in every form its linears multiply (a mixed model feeds K-quant and
// Q8_0-family weights from the same input): each form quantized once per input.
struct QActSet {
  QAct by_form[kActForms];
  unsigned forms = 0;  // bit f: by_form[f] is shaped (form_bit)

  void shape(int64_t M, int64_t K, unsigned forms_) {
    forms = forms_;
    for (int f = 0; f < kActForms; f++)
      if (forms & (1u << f)) by_form[f].shape(M, K, static_cast<ActForm>(f));
  }
  const QAct& operator[](ActForm f) const { return by_form[f]; }
  // Elements per unit that covers a unit of each form in `which` (256 when a K-quant reads it).
  static int64_t unit_of(unsigned which) { return (which & form_bit(kActQ8_K)) ? 256 : 32; }
  // Quantizes, in each form of `which`, the flattened elements [e0, e1) of x (rows ldx apart, K
  // per row; e0 and e1 multiples of unit_of(which)).
  void quantize_span(const float* x, int64_t ldx, unsigned which, int64_t e0, int64_t e1) {
    for (int f = 0; f < kActForms; f++) {
      if (!(which & (1u << f))) continue;
      QAct& a = by_form[f];
      a.quantize_units(x, ldx, e0 / a.unit(), e1 / a.unit());
    }
  }
};

// gguf_kernels.cpp's entry points for the fused decoder (each the function of the same name there).
namespace gguf {
TypeInfo type_info(int t);
void dequant_block(int t, const uint8_t* b, float* y);
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K);
bool packable(int64_t qtype);
int packed_group_elems(int t);
int64_t packed_row_bytes(int t, int64_t K);
at::Tensor gguf_repack8(const at::Tensor& w, int64_t qtype, int64_t K);
void packed_row(int t, const uint8_t* pw, int64_t K, int64_t row, float* buf, float* out);
void run_quantized_range(int t, const QAct& a, const uint8_t* w, int64_t row_bytes, const float* bias, float* out,
                         int64_t ldo, int64_t n0, int64_t n1);
void run_packed_range(int t, const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo, int64_t t0,
                      int64_t t1);
}  // namespace gguf

// fused_decode.cpp's bindings (FusedDecoder, dense_linear), added to the module gguf_kernels.cpp defines.
void register_fused_decode(pybind11::module& m);

}  // namespace tlq
