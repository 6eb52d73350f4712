// The flat CPU decoder's small ops on raw pointers (AVX2), fp32 math, rounded once to T:
// rms_norm(x [M, H], w [H], eps) = x * rsqrt(mean(x^2) + eps) * w, silu_mul(gu [M, 2I]) =
// silu(gu[:, :I]) * gu[:, I:], and decode attention (rope on one new token's q / k, its k / v into
// the paged pool, softmax(q K^T * scale) V over the row's keys). pointwise_kernels.cpp wraps them
// as torch ops; decode_step.cpp calls them inside one decode step.
#pragma once
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "simd.h"

namespace tr_native {

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

// qkv [B, width] (q heads, then k, then v), cos / ssin [B, D]; pools [P, Hkv, D] (this step's
// rotated k and v written at write_slots); out [B, Hq D]: softmax(q K^T * scale) V, fp32 math
template <typename T>
void decode_attention_rows(const T* x, int64_t b, int64_t width, const T* c, const T* sn, T* pk,
                           T* pv, const int64_t* write_slots, const int64_t* gather_slots,
                           const int64_t* kv_lens, int64_t s_max, int64_t hq, int64_t hkv,
                           int64_t d, double scale, T* o) {
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
  std::vector<float> q(b * hq * d);  // every q head rotated, fp32 (rounded to T as the module path)
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t h = 0; h < hq; ++h) {
      rope_row(x + i * width + h * d, c + i * d, sn + i * d, d, q.data() + (i * hq + h) * d);
    }
  }
  attn::decode_attention(q.data(), b, pk, pv, gather_slots, kv_lens, s_max, hq, hkv, d,
                         static_cast<float>(scale), o);
}

}  // namespace tr_native
