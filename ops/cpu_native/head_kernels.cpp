// An fp32 lm_head held as two 16-bit planes of its packed tiles (torch.ops.torch_runner_native.*):
// hi = each weight's top 16 bits (a bf16, the fp32 value truncated), lo = its low 16 bits, both
// [N / 4, K / 16, 4, 16] (linear.h's packed layout), so the fp32 weight costs the same bytes.
//   split_linear   the exact fp32 product, reading both planes (the weight rebuilt in registers)
//   split_greedy   the greedy pick of that product without reading lo for most rows: the bf16
//                  product from hi alone (half the bytes), a per-row error bound, and the exact
//                  product only for the rows the bound cannot rule out
// Why: batch-1 greedy decode of the default model (SmolLM2, 49,152 x 576 tied head) spends ~4 of
// ~21 ms a step streaming the fp32 head; the bound leaves 1-10 candidate rows (log session 31).
//
// The bound: for row j, w = hi + rest exactly, so |x.w - x.hi| <= |x|_2 |rest_j|_2 (Cauchy-Schwarz),
// and each computed fp32 dot product is within gamma_K |x|_2 |w_j|_2 of its exact value (any
// summation order, FMA or not). err[j] >= |rest_j|_2 + 2 gamma_K |w_j|_2 (split_head.py computes
// it, rounded up): exact_j lies within |x|_2 err[j] of approx_j. The greedy row j* has exact_j* =
// max exact >= max_i (approx_i - |x| err_i) = L, so every row with approx_j + |x| err_j >= L is
// recomputed exactly (the same dot as split_linear: the same bits) and the first maximum wins.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "linear.h"

namespace {

using tr_native::kRows;
using tr_native::LinearRef;

// Row r0..r0+R of a row block: hi / lo chunks of 16 as packed_bf16_dot reads them (lane i holds
// values 2i and 2i + 1), rebuilt to fp32 bit for bit: even = hi << 16 | lo & 0xFFFF, odd = hi &
// 0xFFFF0000 | lo >> 16; times x in even / odd order (linear.h even_odd_rows)
template <int R>
inline void packed_split_dot(const uint16_t* hi, const uint16_t* lo, int64_t k, int64_t r0,
                             const float* xrow, float* out) {
  const float *xe = xrow, *xo = xrow + k / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const int64_t at = j * kRows + r0 * 16;
    const __m256 e = _mm256_loadu_ps(xe + j / 2), o = _mm256_loadu_ps(xo + j / 2);
    for (int r = 0; r < R; ++r) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + at + r * 16));
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + at + r * 16));
      const __m256i even = _mm256_or_si256(_mm256_slli_epi32(h, 16), _mm256_and_si256(l, low));
      const __m256i odd = _mm256_or_si256(_mm256_and_si256(h, high), _mm256_srli_epi32(l, 16));
      a0[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(even), e, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(odd), o, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = tr_native::hsum(_mm256_add_ps(a0[r], a1[r]));
}

// A 4-row block rebuilt to fp32, [K / 16][4 rows][the 8 even values | the 8 odd ones] (the
// planes' order), as packed_split_dot's registers hold them
inline void rebuild(const uint16_t* hi, const uint16_t* lo, int64_t k, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256i low = _mm256_set1_epi32(0xFFFF);
  for (int64_t v = 0; v < k * kRows; v += 16) {  // chunk by chunk, row by row: the planes' order
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + v));
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v),
                        _mm256_or_si256(_mm256_slli_epi32(h, 16), _mm256_and_si256(l, low)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v + 8),
                        _mm256_or_si256(_mm256_and_si256(h, high), _mm256_srli_epi32(l, 16)));
  }
}

// packed_split_dot<R>'s sums over a rebuilt block (the same vectors, the same order: the same bits)
template <int R>
inline void eo_dot(const float* rebuilt, int64_t k, const float* xrow, float* out) {
  const float *xe = xrow, *xo = xrow + k / 2;
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const __m256 e = _mm256_loadu_ps(xe + j / 2), o = _mm256_loadu_ps(xo + j / 2);
    for (int r = 0; r < R; ++r) {
      const float* src = rebuilt + (j / 16 * R + r) * 16;
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(src), e, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(src + 8), o, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = tr_native::hsum(_mm256_add_ps(a0[r], a1[r]));
}

struct Planes {
  const uint16_t *hi, *lo;
  int64_t n, k;
};

Planes check_planes(const at::Tensor& hi, const at::Tensor& lo, const char* op) {
  TORCH_CHECK(hi.dim() == 4 && hi.size(2) == kRows && hi.size(3) == 16 && hi.is_contiguous() &&
                  hi.scalar_type() == at::kBFloat16,
              op, ": hi must be contiguous bf16 [N / 4, K / 16, 4, 16]; got ", hi.scalar_type(), " ",
              hi.sizes());
  TORCH_CHECK(lo.sizes() == hi.sizes() && lo.is_contiguous() && lo.scalar_type() == at::kShort, op,
              ": lo must be contiguous int16 of hi's shape ", hi.sizes(), "; got ", lo.scalar_type(),
              " ", lo.sizes());
  return {reinterpret_cast<const uint16_t*>(hi.data_ptr()), reinterpret_cast<const uint16_t*>(lo.data_ptr()),
          hi.size(0) * kRows, hi.size(1) * 16};
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == at::kFloat,
              op, ": x must be a contiguous fp32 CPU tensor [M, K]; got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == k, op, ": x has K=", x.size(1), ", the weight takes K=", k);
}

// out [M, N] = x @ W.T (+ bias) (+ residual), fp32
at::Tensor split_linear(const at::Tensor& x, const at::Tensor& hi, const at::Tensor& lo,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  const Planes p = check_planes(hi, lo, "split_linear");
  check_x(x, p.k, "split_linear");
  const int64_t m = x.size(0), n = p.n, k = p.k;
  for (const auto* t : {&bias, &residual}) {
    TORCH_CHECK(!*t || ((*t)->is_contiguous() && (*t)->scalar_type() == at::kFloat &&
                        (*t)->numel() == (t == &bias ? n : m * n)),
                "split_linear: bias must be fp32 [N], residual fp32 [M, N]");
  }
  at::Tensor out = at::empty({m, n}, x.options());
  std::vector<float> xf;
  tr_native::even_odd_rows(x.data_ptr<float>(), m, k, xf);
  const float* xp = xf.data();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // as linear.h's run_rows over 4-row blocks (N % 4 == 0 here). Several rows: each block is
  // rebuilt once into fp32 and every row multiplies that (rebuilding per row cost 1.6x the fp32
  // tiles' time at M = 16; now 1.05-1.15x at M = 2-16, equal at M = 1; log session 31)
  const int64_t grain = std::max<int64_t>(1, tr_native::kGrainBytes / (kRows * 4 * k * m));
  at::parallel_for(0, n / kRows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> rebuilt(m > 1 ? kRows * k : 0);
    float acc[kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t at = blk * kRows * k;
      for (int64_t i = 0; i < m; ++i) {
        if (m == 1) {
          packed_split_dot<4>(p.hi + at, p.lo + at, k, 0, xp, acc);
        } else {
          if (i == 0) rebuild(p.hi + at, p.lo + at, k, rebuilt.data());
          eo_dot<4>(rebuilt.data(), k, xp + i * k, acc);
        }
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t col = blk * kRows + r, at_out = i * n + col;
          float v = acc[r];
          if (bp) v += bp[col];
          if (rp) v += rp[at_out];
          op[at_out] = v;
        }
      }
    }
  });
  return out;
}

// One row's pick (split_greedy): x its fp32 values, xeo the same in even / odd order, a its
// approximate (hi plane) logits; -1 where the bound cannot decide
int64_t pick_row(const Planes& p, const float* x, const float* xeo, const float* a, const float* e,
                 int64_t vocab, double wmax) {
  double norm = 0.0;
  for (int64_t t = 0; t < p.k; ++t) norm += static_cast<double>(x[t]) * x[t];
  norm = std::sqrt(norm) * (1.0 + 1e-12);  // the double sum's own rounding, covered
  if (!std::isfinite(norm) || norm * wmax * 1.01 >= FLT_MAX) return -1;
  double floor = -INFINITY;  // L: max of the lower bounds
  bool finite = true;
  for (int64_t j = 0; j < vocab; ++j) {
    finite = finite && std::isfinite(a[j]);
    floor = std::max(floor, a[j] - norm * e[j] - 1e-30);  // 1e-30: underflowed products
  }
  if (!finite) return -1;
  float best = -INFINITY;
  int64_t best_at = -1;
  for (int64_t j = 0; j < vocab; ++j) {
    if (a[j] + norm * e[j] + 1e-30 < floor) continue;
    const int64_t at = j / kRows * kRows * p.k;
    float exact;
    packed_split_dot<1>(p.hi + at, p.lo + at, p.k, j % kRows, xeo, &exact);
    if (exact > best) best = exact, best_at = j;  // strict: the first maximum
  }
  return best_at;
}

// Per row of x [M, K]: the first index of the maximum of the first `vocab` columns of
// split_linear(x, hi, lo), decided from hi where err [N] allows (the top comment). ok [M] is false
// where the bound could not decide (x or an approximate value not finite, or |x| |w_j| near
// FLT_MAX, where an exact value might not be finite): that row's id is meaningless and the
// caller computes its logits. wmax: max_j |w_j|_2.
std::tuple<at::Tensor, at::Tensor> split_greedy(const at::Tensor& x, const at::Tensor& hi,
                                                const at::Tensor& lo, const at::Tensor& err,
                                                int64_t vocab, double wmax) {
  const Planes p = check_planes(hi, lo, "split_greedy");
  check_x(x, p.k, "split_greedy");
  const int64_t m = x.size(0), n = p.n, k = p.k;
  TORCH_CHECK(err.is_contiguous() && err.scalar_type() == at::kFloat && err.numel() == n,
              "split_greedy: err must be contiguous fp32 [N]");
  TORCH_CHECK(vocab >= 1 && vocab <= n, "split_greedy: vocab must be in [1, N=", n, "]; got ", vocab);
  const LinearRef approx_ref{tr_native::Kind::kDensePacked, hi.data_ptr(), nullptr, true, n, k};
  at::Tensor approx = at::empty({m, n}, x.options());
  tr_native::Scratch scratch;
  tr_native::linear_into<float>(approx_ref, x.data_ptr<float>(), m, nullptr, nullptr,
                                approx.data_ptr<float>(), scratch);
  std::vector<float> xf;
  tr_native::even_odd_rows(x.data_ptr<float>(), m, k, xf);
  at::Tensor ids = at::zeros({m}, x.options().dtype(at::kLong));
  at::Tensor ok = at::zeros({m}, x.options().dtype(at::kBool));
  int64_t* id = ids.data_ptr<int64_t>();
  bool* is_ok = ok.data_ptr<bool>();
  const float *xp = x.data_ptr<float>(), *ap = approx.data_ptr<float>();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {  // rows apart (m = 1: inline)
    for (int64_t i = begin; i < end; ++i) {
      id[i] = pick_row(p, xp + i * k, xf.data() + i * k, ap + i * n, err.data_ptr<float>(), vocab, wmax);
      is_ok[i] = id[i] >= 0;
    }
  });
  return {ids, ok};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_runner_native, m) {
  m.def("split_linear(Tensor x, Tensor hi, Tensor lo, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("split_greedy(Tensor x, Tensor hi, Tensor lo, Tensor err, int vocab, float wmax) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) {
  m.impl("split_linear", &split_linear);
  m.impl("split_greedy", &split_greedy);
}
