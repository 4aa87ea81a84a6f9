// The LoRA product of all of a step's adapter groups in one call per linear (compiled on first use by
// tokenloom/model/lora_kernels.py; called from tokenloom/lora/punica.py).
//
//   lora_shrink_expand   for every adapter row i (of group g):  y[row_i] += B_g (A_g x[row_i])
//
// Decode steps hold a few rows per adapter, scattered over the batch. In torch each group of each
// target linear is six small ops (gather, cast, shrink, expand, cast, scatter-add), ~60 us per group
// per linear at decode sizes, mostly per-op cost; here a linear is one call over all groups. Prefill
// groups gain too: no zero blocks multiplied, no delta tensor written and re-read.
// Weights come in the kernel's layout (LoRALinear.set_slot): A [R, in] and B^T [R, out] in float32,
// and for each rank column the span of output columns where B is non-zero (B of a fused linear is
// block-diagonal: q's ranks touch q's columns only), so the expand skips the zero blocks.
// Math in float32; each y element is read once and rounded once per rank segment (once for the
// usual rank <= 8 per module). Threads: at::parallel_for over tasks of up to 64 rows of one group
// (torch's OpenMP pool).

// Slim includes (not torch/extension.h), as cpu_kernels.cpp: a faster first-use compile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TL_AVX512 1
#else
#define TL_AVX512 0
#endif

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }
template <typename T> inline T from_f(float v) { return static_cast<T>(v); }

struct Group {
  const float* a;        // [rank, in]
  const float* b_t;      // [rank, out]
  const int64_t* spans;  // [rank, 2]: output columns [lo, hi) where B's column is non-zero
  int64_t rank;
};

template <typename T> inline void load_row(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}
#if TL_AVX512
// bf16 rows convert 16 at a time (element by element they cost more than the LoRA arithmetic).
template <> inline void load_row<bf16>(float* dst, const bf16* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}
#endif

// The shrink takes a task's rows kBlock at a time, so each A element read serves kBlock rows.
constexpr int kBlock = 4;

// t[j * rank + r] = A[r, :] . x_j for the block's rows j < kBlock (x_j float32, [in]; a short block
// repeats its last row, whose results are then not stored).
inline void shrink(float* t, const float* a, int64_t rank, const float* const* x, int64_t in) {
  int64_t r = 0;
#if TL_AVX512
  for (; r + 4 <= rank; r += 4) {  // a 4-rank x 4-row tile: 16 independent FMA chains
    __m512 s[4][kBlock];
    for (auto& row : s)
      for (auto& v : row) v = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= in; k += 16) {
      __m512 xv[kBlock];
      for (int j = 0; j < kBlock; ++j) xv[j] = _mm512_loadu_ps(x[j] + k);
      for (int i = 0; i < 4; ++i) {
        const __m512 av = _mm512_loadu_ps(a + (r + i) * in + k);
        for (int j = 0; j < kBlock; ++j) s[i][j] = _mm512_fmadd_ps(av, xv[j], s[i][j]);
      }
    }
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < kBlock; ++j) {
        float v = _mm512_reduce_add_ps(s[i][j]);
        for (int64_t kk = k; kk < in; ++kk) v += a[(r + i) * in + kk] * x[j][kk];
        t[j * rank + r + i] = v;
      }
  }
#endif
  for (; r < rank; ++r)
    for (int j = 0; j < kBlock; ++j) {
      const float* ar = a + r * in;
      float v = 0.f;
      for (int64_t k = 0; k < in; ++k) v += ar[k] * x[j][k];
      t[j * rank + r] = v;
    }
}

#if TL_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {  // round to nearest even, as c10's conversion (finite values)
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

// y[row_i, lo:hi] += sum_r B^T[r, lo:hi] * t[i * rank + r] for ranks r0 <= r < r1 (one segment: ranks
// with the same span), over the task's rows. The B^T chunk of up to 8 ranks x 32 columns stays in
// registers while the rows stream by, so B is read once per task, not once per row.
template <typename TY>
void expand(TY* y, int64_t y_pitch, const int64_t* rows, int64_t n, const float* b_t, int64_t out, const float* t,
            int64_t rank, int64_t r0, int64_t r1, int64_t lo, int64_t hi) {
  for (int64_t rs = r0; rs < r1; rs += 8) {
    const int64_t re = std::min<int64_t>(rs + 8, r1), nr = re - rs;
    int64_t o = lo;
#if TL_AVX512
    for (; o + 32 <= hi; o += 32) {
      __m512 b0[8], b1[8];
      for (int64_t r = 0; r < nr; ++r) {
        b0[r] = _mm512_loadu_ps(b_t + (rs + r) * out + o);
        b1[r] = _mm512_loadu_ps(b_t + (rs + r) * out + o + 16);
      }
      for (int64_t i = 0; i < n; ++i) {
        TY* yr = y + rows[i] * y_pitch + o;
        const float* ti = t + i * rank + rs;
        __m512 v0 = load16(yr), v1 = load16(yr + 16);
        for (int64_t r = 0; r < nr; ++r) {
          const __m512 tv = _mm512_set1_ps(ti[r]);
          v0 = _mm512_fmadd_ps(b0[r], tv, v0);
          v1 = _mm512_fmadd_ps(b1[r], tv, v1);
        }
        store16(yr, v0);
        store16(yr + 16, v1);
      }
    }
#endif
    for (int64_t i = 0; i < n; ++i) {  // the columns left (all of them without AVX-512)
      TY* yr = y + rows[i] * y_pitch;
      for (int64_t c = o; c < hi; ++c) {
        float v = to_f(yr[c]);
        for (int64_t r = rs; r < re; ++r) v += b_t[r * out + c] * t[i * rank + r];
        yr[c] = from_f<TY>(v);
      }
    }
  }
}

// Rows per task: the unit of threading, and how many rows share one read of B.
constexpr int64_t kTaskRows = 64;

struct Task {
  int64_t group, first, count;  // rows[first, first + count) of one group
};

template <typename TX, typename TY>
void run(TY* y, int64_t y_pitch, const TX* x, int64_t x_pitch, int64_t in, int64_t out, const int64_t* rows,
         const std::vector<Task>& tasks, const std::vector<Group>& groups, int64_t max_rank) {
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk((kTaskRows + kBlock) * max_rank), xf(kBlock * in);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const Group& g = groups[task.group];
      const int64_t* task_rows = rows + task.first;
      for (int64_t b = 0; b < task.count; b += kBlock) {  // t = A x, kBlock rows at a time
        const int64_t nb = std::min<int64_t>(kBlock, task.count - b);
        const float* xs[kBlock];
        for (int j = 0; j < kBlock; ++j) xs[j] = xf.data() + std::min<int64_t>(j, nb - 1) * in;
        for (int64_t j = 0; j < nb; ++j) load_row(xf.data() + j * in, x + task_rows[b + j] * x_pitch, in);
        shrink(shrunk.data() + b * g.rank, g.a, g.rank, xs, in);  // a short block's extra rows land past
      }                                                           // the task's, in the buffer's slack
      for (int64_t r0 = 0; r0 < g.rank;) {  // y += B t, segment by segment
        const int64_t lo = g.spans[2 * r0], hi = g.spans[2 * r0 + 1];
        int64_t r1 = r0 + 1;
        while (r1 < g.rank && g.spans[2 * r1] == lo && g.spans[2 * r1 + 1] == hi) ++r1;
        expand(y, y_pitch, task_rows, task.count, g.b_t, out, shrunk.data(), g.rank, r0, r1, lo, hi);
        r0 = r1;
      }
    }
  });
}

// y [T, out] and x [T, in] (float32 or bfloat16, unit column stride); rows int64 [n]: the adapter
// rows, group by group; group_start int64 [G + 1]; a / b_t / spans: one per group (an empty a: the
// group's adapter does not target this linear).
void lora_shrink_expand(at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& group_start,
                        const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b_t,
                        const std::vector<at::Tensor>& spans) {
  const int64_t num_groups = group_start.size(0) - 1;
  if (static_cast<int64_t>(a.size()) != num_groups || static_cast<int64_t>(b_t.size()) != num_groups ||
      static_cast<int64_t>(spans.size()) != num_groups)
    throw std::invalid_argument("lora_shrink_expand: one A, B and span table per group");
  if (x.stride(1) != 1 || y.stride(1) != 1 || rows.scalar_type() != at::kLong ||
      group_start.scalar_type() != at::kLong || !rows.is_contiguous() || !group_start.is_contiguous())
    throw std::invalid_argument("lora_shrink_expand: unit column strides and contiguous int64 indices");
  const int64_t in = x.size(1), out = y.size(1);
  const int64_t* gs = group_start.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  if (gs[0] != 0 || gs[num_groups] != rows.size(0) || x.size(0) != y.size(0))
    throw std::invalid_argument("lora_shrink_expand: group_start runs from 0 to the number of rows; x, y: the same rows");
  for (int64_t g = 0; g < num_groups; ++g)
    if (gs[g + 1] < gs[g]) throw std::invalid_argument("lora_shrink_expand: group_start decreases");
  for (int64_t i = 0; i < rows.size(0); ++i)
    if (r[i] < 0 || r[i] >= y.size(0)) throw std::invalid_argument("lora_shrink_expand: a row outside y");
  std::vector<Group> groups(num_groups);
  std::vector<Task> tasks;
  int64_t max_rank = 1;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t rank = a[g].numel() == 0 ? 0 : a[g].size(0);
    if (rank > 0 && (a[g].scalar_type() != at::kFloat || b_t[g].scalar_type() != at::kFloat ||
                     !a[g].is_contiguous() || !b_t[g].is_contiguous() || a[g].size(1) != in ||
                     b_t[g].size(0) != rank || b_t[g].size(1) != out || spans[g].size(0) != rank ||
                     spans[g].scalar_type() != at::kLong || !spans[g].is_contiguous()))
      throw std::invalid_argument("lora_shrink_expand: a group's A [R, in], B^T [R, out] (float32), spans [R, 2]");
    if (rank > 0) {
      const int64_t* sp = spans[g].data_ptr<int64_t>();
      for (int64_t k = 0; k < rank; ++k)
        if (sp[2 * k] < 0 || sp[2 * k] > sp[2 * k + 1] || sp[2 * k + 1] > out)
          throw std::invalid_argument("lora_shrink_expand: a span outside y's columns");
    }
    groups[g] = {rank ? a[g].data_ptr<float>() : nullptr, rank ? b_t[g].data_ptr<float>() : nullptr,
                 rank ? spans[g].data_ptr<int64_t>() : nullptr, rank};
    max_rank = std::max(max_rank, rank);
    if (rank > 0)
      for (int64_t i = gs[g]; i < gs[g + 1]; i += kTaskRows)
        tasks.push_back({g, i, std::min<int64_t>(kTaskRows, gs[g + 1] - i)});
  }
  const bool x_bf16 = x.scalar_type() == at::kBFloat16, y_bf16 = y.scalar_type() == at::kBFloat16;
  if ((!x_bf16 && x.scalar_type() != at::kFloat) || (!y_bf16 && y.scalar_type() != at::kFloat))
    throw std::invalid_argument("lora_shrink_expand: x and y are float32 or bfloat16");
  bf16* yb = y_bf16 ? reinterpret_cast<bf16*>(y.data_ptr()) : nullptr;
  float* yf = y_bf16 ? nullptr : y.data_ptr<float>();
  const bf16* xb = x_bf16 ? reinterpret_cast<const bf16*>(x.data_ptr()) : nullptr;
  const float* xf = x_bf16 ? nullptr : x.data_ptr<float>();
  if (x_bf16 && y_bf16) run(yb, y.stride(0), xb, x.stride(0), in, out, r, tasks, groups, max_rank);
  else if (x_bf16) run(yf, y.stride(0), xb, x.stride(0), in, out, r, tasks, groups, max_rank);
  else if (y_bf16) run(yb, y.stride(0), xf, x.stride(0), in, out, r, tasks, groups, max_rank);
  else run(yf, y.stride(0), xf, x.stride(0), in, out, r, tasks, groups, max_rank);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("lora_shrink_expand", &lora_shrink_expand, nogil);
}
