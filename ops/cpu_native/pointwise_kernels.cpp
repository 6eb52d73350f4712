// The flat CPU decoder's small ops as one pass each (AVX2), fp32 math, rounded once to x's dtype:
// rms_norm(x [M, H], w [H], eps) = x * rsqrt(mean(x^2) + eps) * w, and
// silu_mul(gu [M, 2I]) = silu(gu[:, :I]) * gu[:, I:] (the gated MLP's activation).
// Each replaces 5-10 aten ops (dtype casts, pow, mean, rsqrt, two muls) of a few us each.
// decode_attention: one new token per row, rope on its q / k, k / v written to the paged pool,
// softmax(q K^T * scale) V over the row's kv_len keys (fp32 math), instead of ~25 aten ops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {  // round to nearest even, as c10::BFloat16
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = c10::BFloat16(tmp[i]);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x, Cephes' range reduction and degree-5 polynomial (~1 ulp in fp32), as in avx_mathfun
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)),
                    _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

template <typename T, typename W>
void rms_rows(const T* x, const W* w, T* out, int64_t m, int64_t h, float eps) {
  for (int64_t i = 0; i < m; ++i) {
    const T* row = x + i * h;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= h; j += 8) {
      const __m256 v = load8(row + j);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (int64_t t = j; t < h; ++t) ss += static_cast<float>(row[t]) * static_cast<float>(row[t]);
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (j = 0; j + 8 <= h; j += 8) {
      store8(out + i * h + j, _mm256_mul_ps(_mm256_mul_ps(load8(row + j), vs), load8(w + j)));
    }
    for (int64_t t = j; t < h; ++t) {
      out[i * h + t] = T(static_cast<float>(row[t]) * scale * static_cast<float>(w[t]));
    }
  }
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t m, int64_t inner) {
  const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < m; ++i) {
    const T* g = gu + i * 2 * inner;
    const T* u = g + inner;
    int64_t j = 0;
    for (; j + 8 <= inner; j += 8) {
      const __m256 gv = load8(g + j);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, neg))));
      store8(out + i * inner + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), load8(u + j)));
    }
    for (int64_t t = j; t < inner; ++t) {
      const float gf = static_cast<float>(g[t]);
      out[i * inner + t] = T(gf / (1.0f + std::exp(-gf)) * static_cast<float>(u[t]));
    }
  }
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), op,
              ": x must be a contiguous 2-D CPU tensor; got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16; got ", x.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t m = x.size(0), h = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.size(0) == h &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "rms_norm: weight must be contiguous float32 / bfloat16 [", h, "]; got ",
              w.scalar_type(), " ", w.sizes());
  at::Tensor out = at::empty_like(x);
  const float e = static_cast<float>(eps);
  const bool w32 = w.scalar_type() == at::kFloat;
  if (x.scalar_type() == at::kFloat) {
    if (w32) rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), m, h, e);
    else rms_rows(x.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), m, h, e);
  } else {
    using B = c10::BFloat16;
    if (w32) rms_rows(x.data_ptr<B>(), w.data_ptr<float>(), out.data_ptr<B>(), m, h, e);
    else rms_rows(x.data_ptr<B>(), w.data_ptr<B>(), out.data_ptr<B>(), m, h, e);
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gate_up must have an even width; got ", gu.size(1));
  const int64_t m = gu.size(0), inner = gu.size(1) / 2;
  at::Tensor out = at::empty({m, inner}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    silu_mul_rows(gu.data_ptr<float>(), out.data_ptr<float>(), m, inner);
  } else {
    silu_mul_rows(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), m, inner);
  }
  return out;
}

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  return hsum(acc);
}

// x [D] rotated by cos / signed sin [D] (rope_tables' layout): x * cos + [x2, x1] * ssin
template <typename T>
inline void rope_row(const T* x, const T* cos, const T* ssin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float swapped = static_cast<float>(x[j < half ? j + half : j - half]);
    // rounded to the model dtype, as the module path's rotated q / k
    out[j] = static_cast<float>(T(static_cast<float>(x[j]) * static_cast<float>(cos[j]) +
                                  swapped * static_cast<float>(ssin[j])));
  }
}

template <typename T>
void decode_attention_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& ssin,
                           at::Tensor& pool_k, at::Tensor& pool_v, const int64_t* write_slots,
                           const int64_t* gather_slots, const int64_t* kv_lens, int64_t s_max,
                           int64_t hq, int64_t hkv, double scale, at::Tensor& out) {
  const int64_t b = qkv.size(0), d = pool_k.size(2), width = qkv.size(1);
  const T* x = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* sn = ssin.data_ptr<T>();
  T* pk = pool_k.data_ptr<T>();
  T* pv = pool_v.data_ptr<T>();
  std::vector<float> tmp(d);
  for (int64_t i = 0; i < b; ++i) {  // this step's k (rotated) and v into the pool
    for (int64_t h = 0; h < hkv; ++h) {
      rope_row(x + i * width + (hq + h) * d, c + i * d, sn + i * d, d, tmp.data());
      T* kd = pk + (write_slots[i] * hkv + h) * d;
      const T* v = x + i * width + (hq + hkv + h) * d;
      T* vd = pv + (write_slots[i] * hkv + h) * d;
      for (int64_t j = 0; j < d; ++j) kd[j] = T(tmp[j]), vd[j] = v[j];
    }
  }
  T* o = out.data_ptr<T>();
  const int64_t group = hq / hkv;
  at::parallel_for(0, b * hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(d), acc(d), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hq, h = task % hq, kvh = h / group, len = kv_lens[i];
      rope_row(x + i * width + h * d, c + i * d, sn + i * d, d, q.data());
      scores.resize(len);
      float best = -INFINITY;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = gather_slots[i * s_max + t];
        scores[t] = dot_row(q.data(), pk + (slot * hkv + kvh) * d, d) * static_cast<float>(scale);
        best = std::max(best, scores[t]);
      }
      float total = 0.0f;
      for (int64_t t = 0; t < len; ++t) total += (scores[t] = std::exp(scores[t] - best));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = pv + (gather_slots[i * s_max + t] * hkv + kvh) * d;
        const __m256 p = _mm256_set1_ps(scores[t]);
        for (int64_t j = 0; j < d; j += 8) {
          _mm256_storeu_ps(acc.data() + j, _mm256_fmadd_ps(p, load8(v + j), _mm256_loadu_ps(acc.data() + j)));
        }
      }
      T* dst = o + i * hq * d + h * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = T(acc[j] / total);
    }
  });
}

// qkv [B, (Hq + 2 Hkv) D] (one token per row), cos / ssin [B, D], pools [P, Hkv, D] (written),
// write_slots [B], gather_slots [B, S] (row i's keys: its first kv_lens[i]) -> [B, Hq D]
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& ssin,
                            at::Tensor pool_k, at::Tensor pool_v, const at::Tensor& write_slots,
                            const at::Tensor& gather_slots, const at::Tensor& kv_lens, int64_t hq,
                            int64_t hkv, double scale) {
  check_rows(qkv, "decode_attention");
  const int64_t b = qkv.size(0), d = pool_k.size(2);
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous() && pool_k.dim() == 3 &&
                  pool_k.size(1) == hkv && pool_k.sizes() == pool_v.sizes() &&
                  pool_k.scalar_type() == qkv.scalar_type() && d % 8 == 0 && hq % hkv == 0,
              "decode_attention: pools must be contiguous [P, ", hkv, ", D] of qkv's dtype, D % 8 == 0");
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d, "decode_attention: qkv must be [B, (Hq + 2 Hkv) D]");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == b * d &&
                  ssin.numel() == b * d && cos.scalar_type() == qkv.scalar_type() &&
                  ssin.scalar_type() == qkv.scalar_type(),
              "decode_attention: cos / sin must be contiguous [B, D] of qkv's dtype");
  for (const at::Tensor* t : {&write_slots, &gather_slots, &kv_lens}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong,
                "decode_attention: slots and lengths must be contiguous int64");
  }
  TORCH_CHECK(write_slots.numel() == b && kv_lens.numel() == b && gather_slots.numel() % b == 0,
              "decode_attention: one write slot and length per row, [B, S] gather slots");
  const int64_t s_max = gather_slots.numel() / b;
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= s_max, "decode_attention: kv_len out of range");
  }
  at::Tensor out = at::empty({b, hq * d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(qkv, cos, ssin, pool_k, pool_v, write_slots.data_ptr<int64_t>(),
                                 gather_slots.data_ptr<int64_t>(), lens, s_max, hq, hkv, scale, out);
  } else {
    decode_attention_impl<c10::BFloat16>(qkv, cos, ssin, pool_k, pool_v,
                                         write_slots.data_ptr<int64_t>(),
                                         gather_slots.data_ptr<int64_t>(), lens, s_max, hq, hkv,
                                         scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_runner_native, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor ssin, Tensor(a!) pool_k, Tensor(b!) pool_v, "
      "Tensor write_slots, Tensor gather_slots, Tensor kv_lens, int hq, int hkv, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_runner_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("decode_attention", &decode_attention);
}
