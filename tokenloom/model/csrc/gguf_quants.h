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
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
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
// Groups of 32: q = round(x / d), d = max|x| / 127, s = d * sum(q); bs = the integer sums of q per
// 16 (what ggml's block_q8_K calls bsums): the Q6_K tile kernel takes its quants unsigned and
// subtracts 32 * bs, instead of sign-flipping every weight vector.

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

// ------------------------------------------------------------------------ work stealing
// A parallel region's threads share a linear's 8-row tiles as contiguous halves, and a thread that
// ends its own takes the back half of what another has not begun. A static half each left the faster
// of a VM's two cores (rarely equally fast: another tenant, a late wake-up, slower memory under one
// half) spinning at every join, ~14 % of a 1.5B decode step in libgomp's spin; handing out small
// chunks from one shared counter balanced the 1.5B but made SmolLM2's step 1.46x slower (chunks
// taken alternately: both threads wrote the same output lines, neither read one stream). Here each
// thread reads one stream in one kernel call that checks the cursor's `end` before each tile.
//
// TileCursor: one thread's tiles [next, end). The owner stores `next` as it begins a tile (plain
// stores, no lock: the tile loop stays a plain loop); only a thief changes `end`, by compare-and-swap,
// so two thieves never take the same tiles. A thief leaves the owner the tile it may be on and the one
// after (x86 may still hold the owner's last `next` store in its store buffer), so no tile is begun
// twice in practice; were one ever, both would write the same bytes, since a tile is always one
// thread's whole dot products and its result does not depend on who computed it.
struct alignas(64) TileCursor {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> end{0};
  // Only while no thief can read this cursor (before the barrier that precedes its use), or by its
  // owner after its own tiles ran out (a concurrent thief then sees at most a range it cannot take).
  void set(int64_t b, int64_t e) {
    next.store(INT64_MAX / 2, std::memory_order_relaxed);  // empty while end moves
    end.store(e, std::memory_order_relaxed);
    next.store(b, std::memory_order_relaxed);
  }
  // The owner's loop: tile(i) for each of its tiles, `next` stored as each begins and `end` read
  // again before each (a thief may have lowered it).
  template <typename F>
  void for_each_tile(F&& tile) {
    for (int64_t i = next.load(std::memory_order_relaxed); i < end.load(std::memory_order_relaxed); i++) {
      next.store(i + 1, std::memory_order_relaxed);
      tile(i);
    }
  }
  // The back half of the tiles not yet begun, leaving the owner two; false when there are too few.
  bool steal_back(int64_t& b, int64_t& e) {
    int64_t hi = end.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = next.load(std::memory_order_relaxed) + 1;  // the tile after the owner's next
      if (hi - lo < 2) return false;
      const int64_t mid = hi - (hi - lo) / 2;
      if (end.compare_exchange_weak(hi, mid, std::memory_order_relaxed)) {
        b = mid;
        e = hi;
        return true;
      }
    }
  }
};

// How many ranges steal_run has stolen in this process (tests check that stealing ran).
inline std::atomic<int64_t> g_tile_steals{0};

// Thread tid's contiguous share [b, e) of n units among nth threads (the static split).
inline void thread_share(int64_t n, int tid, int nth, int64_t& b, int64_t& e) {
  const int64_t q = n / nth, r = n % nth;
  b = tid * q + std::min<int64_t>(tid, r);
  e = b + q + (tid < r ? 1 : 0);
}

// Thread tid's first share of n tiles: before a barrier that precedes steal_run on `cursors` (every
// thread's cursor is set before any thread may steal from it).
inline void steal_init(TileCursor* cursors, int64_t n, int tid, int nth) {
  int64_t b, e;
  thread_share(n, tid, nth, b, e);
  cursors[tid].set(b, e);
}

// run(cursor) runs the tiles of `cursor` (from its next, while next < end); this thread's own first,
// then ranges stolen from the others (each stolen range becomes its own cursor, so it can be stolen
// back) until none has tiles to spare.
template <typename F>
void steal_run(TileCursor* cursors, int tid, int nth, F&& run) {
  for (;;) {
    run(cursors[tid]);
    int64_t b, e;
    bool stole = false;
    for (int k = 1; k < nth && !stole; k++) stole = cursors[(tid + k) % nth].steal_back(b, e);
    if (!stole) return;
    g_tile_steals.fetch_add(1, std::memory_order_relaxed);
    cursors[tid].set(b, e);
  }
}

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
void run_packed_cursor(int t, const QAct& a, const uint8_t* pw, const float* bias, float* out, int64_t ldo,
                       TileCursor& cur);
}  // namespace gguf

// fused_decode.cpp's bindings (FusedDecoder, dense_linear), added to the module gguf_kernels.cpp defines.
void register_fused_decode(pybind11::module& m);

}  // namespace tlq
