// Batch-1 (small M) CPU linear kernels, out = x @ W.T (+ bias) (+ residual), AVX2 + FMA.
//
// dense: fp32 or bf16 weights [N, K], fp32 accumulation (bf16 widened in registers).
// int8:  per-row int8 weights [N, Kp] (Kp = K rounded up to 32, zero columns), fp32 scales [N].
// int4:  per 32 columns (llama.cpp Q4_1 order: byte j = code j | code j+16 << 4) codes
//        qs [N, K/32, 16] uint8 and (scale, min) dm [N, K/32, 2] fp16: w = code * scale + min.
// int8 / int4 take x quantized per 32 values (q8 blocks: d = amax / 127, q = round(x * 127 / amax),
// half to even) and multiply with integer dot products (maddubs / madd), as ggml-cpu's q8_0 and
// q4_1 x q8_1 dot products do; the scales (and min times the block sums of x) apply in fp32.
// Threads: at::parallel_for over blocks of output rows (OpenMP: built with -fopenmp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kRows = 4;          // output rows per inner loop (x loads shared by them)
constexpr int64_t kBlock = 32;        // q8 block: values per activation scale
constexpr int64_t kGrainBytes = 1 << 15;  // weight bytes a thread takes at least (no tiny splits)

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32: the 16 bits shifted up
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// x [M, K] (fp32 or bf16) -> fp32 rows [M, Kp], zero-padded past K
std::vector<float> float_rows(const at::Tensor& x, int64_t kp) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> out(m * kp, 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    float* row = out.data() + i * kp;
    if (x.scalar_type() == at::kFloat) {
      std::copy_n(x.data_ptr<float>() + i * k, k, row);
    } else {
      const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + i * k;
      for (int64_t j = 0; j < k; ++j) row[j] = static_cast<float>(src[j]);
    }
  }
  return out;
}

// One q8 block: 32 floats -> 32 int8 codes, d, and d * sum(codes)
inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float max_abs = _mm_cvtss_f32(m4);
  const float d = max_abs / 127.0f;
  const float inv = max_abs != 0.0f ? 127.0f / max_abs : 0.0f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_hadd_epi32(t, t);
  t = _mm_hadd_epi32(t, t);
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(t));
}

struct Q8Rows {  // x quantized: codes [M, Kp], d and d * sum [M, Kp / 32]
  std::vector<int8_t> q;
  std::vector<float> d, s;
  int64_t kp, nb;
};

Q8Rows quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0);
  Q8Rows r;
  r.kp = (x.size(1) + kBlock - 1) / kBlock * kBlock;
  r.nb = r.kp / kBlock;
  std::vector<float> xf = float_rows(x, r.kp);
  r.q.resize(m * r.kp);
  r.d.resize(m * r.nb);
  r.s.resize(m * r.nb);
  for (int64_t b = 0; b < m * r.nb; ++b) {
    quantize_block(xf.data() + b * kBlock, r.q.data() + b * kBlock, &r.d[b], &r.s[b]);
  }
  return r;
}

template <int R, typename W>
inline void dense_dot(const W* w, int64_t k, const float* x, float* out) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(load8(w + r * k + j), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(load8(w + r * k + j + 8), x1, a1[r]);
    }
  }
  for (; j + 8 <= k; j += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + j);
    for (int r = 0; r < R; ++r) a0[r] = _mm256_fmadd_ps(load8(w + r * k + j), x0, a0[r]);
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t t = j; t < k; ++t) s += to_float(w[r * k + t]) * x[t];
    out[r] = s;
  }
}

template <int R>
inline void int8_dot(const int8_t* w, int64_t kp, const int8_t* xq, const float* xd, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kp / kBlock; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x| (x in -127..127)
    const __m256 dx = _mm256_broadcast_ss(xd + b);
    for (int r = 0; r < R; ++r) {
      const __m256i wv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * kp + b * kBlock));
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int R>
inline void int4_dot(const uint8_t* qs, const uint16_t* dm, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xs, float* out) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256 dx = _mm256_broadcast_ss(xd + b);
    const float sx = xs[b];
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * nb + b;
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + at * 16));
      const __m256i wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dm[2 * at])), dx);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      mins[r] += _cvtsh_ss(dm[2 * at + 1]) * sx;
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + mins[r];
}

void check_x(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous 2-D CPU tensor [M, K]; got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x dtype must be float32 or bfloat16; got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, op, ": x has K=", x.size(1), ", the weight takes K=", k);
}

void check_extra(const std::optional<at::Tensor>& t, const at::Tensor& x, at::IntArrayRef shape,
                 const char* name) {
  if (!t) return;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->sizes() == shape,
              name, ": must be contiguous, of x's dtype ", x.scalar_type(), " and shape ", shape,
              "; got ", t->scalar_type(), " ", t->sizes());
}

// Runs dot(R, n, m, out[R]) over every row block, then adds bias / residual and stores in x's dtype
template <typename Dot1, typename Dot4>
at::Tensor run_rows(const at::Tensor& x, int64_t n, int64_t row_bytes,
                    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                    const Dot1& dot1, const Dot4& dot4) {
  const int64_t m = x.size(0);
  check_extra(bias, x, {n}, "bias");
  check_extra(residual, x, {m, n}, "residual");
  at::Tensor out = at::empty({m, n}, x.options());
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, kRows * row_bytes * m));
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  const void* bp = bias ? bias->data_ptr() : nullptr;
  const void* rp = residual ? residual->data_ptr() : nullptr;
  void* op = out.data_ptr();
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    float acc[kRows];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kRows, rows = std::min(kRows, n - n0);
      for (int64_t i = 0; i < m; ++i) {
        if (rows == kRows) {
          dot4(n0, i, acc);
        } else {
          for (int64_t r = 0; r < rows; ++r) dot1(n0 + r, i, acc + r);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t col = n0 + r, at_out = i * n + col;
          float v = acc[r];
          if (is_bf16) {
            if (bp) v += static_cast<float>(static_cast<const c10::BFloat16*>(bp)[col]);
            if (rp) v += static_cast<float>(static_cast<const c10::BFloat16*>(rp)[at_out]);
            static_cast<c10::BFloat16*>(op)[at_out] = c10::BFloat16(v);
          } else {
            if (bp) v += static_cast<const float*>(bp)[col];
            if (rp) v += static_cast<const float*>(rp)[at_out];
            static_cast<float*>(op)[at_out] = v;
          }
        }
      }
    }
  });
  return out;
}

template <typename W>
at::Tensor dense_impl(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual) {
  const int64_t n = w.size(0), k = w.size(1);
  std::vector<float> xf = float_rows(x, k);
  const W* wp = w.data_ptr<W>();
  const float* xp = xf.data();
  return run_rows(
      x, n, k * sizeof(W), bias, residual,
      [&](int64_t row, int64_t i, float* out) { dense_dot<1>(wp + row * k, k, xp + i * k, out); },
      [&](int64_t row, int64_t i, float* out) { dense_dot<4>(wp + row * k, k, xp + i * k, out); });
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dense_linear: weight must be contiguous [N, K]");
  check_x(x, w.size(1), "dense_linear");
  if (w.scalar_type() == at::kFloat) return dense_impl<float>(x, w, bias, residual);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16,
              "dense_linear: weight dtype must be float32 or bfloat16; got ", w.scalar_type());
  return dense_impl<c10::BFloat16>(x, w, bias, residual);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scales,
                       int64_t k, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& residual) {
  const int64_t n = qw.size(0), kp = qw.size(1);
  TORCH_CHECK(qw.dim() == 2 && qw.is_contiguous() && qw.scalar_type() == at::kChar &&
                  kp == (k + kBlock - 1) / kBlock * kBlock,
              "int8_linear: qweight must be contiguous int8 [N, ceil(K / 32) * 32]; got ",
              qw.sizes(), " for K=", k);
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == n,
              "int8_linear: scales must be float32 [N]");
  check_x(x, k, "int8_linear");
  const Q8Rows q = quantize_rows(x);
  const int8_t* wp = qw.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  return run_rows(
      x, n, kp, bias, residual,
      [&](int64_t row, int64_t i, float* out) {
        int8_dot<1>(wp + row * kp, kp, q.q.data() + i * kp, q.d.data() + i * q.nb, out);
        out[0] *= sp[row];
      },
      [&](int64_t row, int64_t i, float* out) {
        int8_dot<4>(wp + row * kp, kp, q.q.data() + i * kp, q.d.data() + i * q.nb, out);
        for (int r = 0; r < 4; ++r) out[r] *= sp[row + r];
      });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& dm,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == 16 && qs.is_contiguous() && qs.scalar_type() == at::kByte,
              "int4_linear: qs must be contiguous uint8 [N, K / 32, 16]; got ", qs.sizes());
  const int64_t n = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(dm.is_contiguous() && dm.scalar_type() == at::kHalf &&
                  dm.sizes() == at::IntArrayRef({n, nb, 2}),
              "int4_linear: dm must be contiguous float16 [N, K / 32, 2]; got ", dm.sizes());
  check_x(x, nb * kBlock, "int4_linear");
  const Q8Rows q = quantize_rows(x);
  const uint8_t* wp = qs.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(dm.data_ptr());
  auto dot = [&](auto rows_tag, int64_t row, int64_t i, float* out) {
    constexpr int R = decltype(rows_tag)::value;
    int4_dot<R>(wp + row * nb * 16, dp + row * nb * 2, nb, q.q.data() + i * q.kp,
                q.d.data() + i * nb, q.s.data() + i * nb, out);
  };
  return run_rows(
      x, n, nb * 20, bias, residual,
      [&](int64_t row, int64_t i, float* out) { dot(std::integral_constant<int, 1>{}, row, i, out); },
      [&](int64_t row, int64_t i, float* out) { dot(std::integral_constant<int, 4>{}, row, i, out); });
}

// x [M, K] -> (codes int8 [M, Kp], d [M, Kp / 32], d * sum(codes) [M, Kp / 32]): the tests' view
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x) {
  check_x(x, x.size(1), "quantize_q8");
  const Q8Rows q = quantize_rows(x);
  const int64_t m = x.size(0);
  at::Tensor codes = at::empty({m, q.kp}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, q.nb}, x.options().dtype(at::kFloat));
  at::Tensor s = at::empty({m, q.nb}, x.options().dtype(at::kFloat));
  std::copy(q.q.begin(), q.q.end(), codes.data_ptr<int8_t>());
  std::copy(q.d.begin(), q.d.end(), d.data_ptr<float>());
  std::copy(q.s.begin(), q.s.end(), s.data_ptr<float>());
  return {codes, d, s};
}

}  // namespace

TORCH_LIBRARY(torch_runner_native, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qw, Tensor scales, int k, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qs, Tensor dm, Tensor? bias, Tensor? residual) -> Tensor");
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) {
  m.impl("dense_linear", &dense_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("quantize_q8", &quantize_q8);
}
