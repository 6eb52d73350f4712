// Decode attention over a paged pool (AVX2 + FMA), fp32 math: softmax(q K^T * scale) V for one
// new token per row, split into fixed chunks of keys (flash-decoding): each task takes one row's
// kv head, all the q heads that share it (GQA: each key and value row is read once for the
// group) and CHUNK keys, and leaves (max, sum of exp, exp-weighted V sum) per q head; the chunks
// are merged in key order. The split depends only on the lengths, not on the thread count, so
// results do not either. Scores for 8 keys at a time end in one horizontal-add tree (not one
// reduction per key), e^x is simd.h's exp8, and the V sum keeps 64 output values in registers.
#pragma once
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace tr_native::attn {

constexpr int64_t kChunk = 256;  // keys per task
// Below this many q.k products a step (sum of kv_lens x Hq x D) both loops run on the calling
// thread: with 2 threads their fork / join and a 3-task split cost more than they share (SmolLM2,
// 2-core EPYC, cold cache: 27 against 35 us a layer at 40 keys, level at 200, parallel ahead from
// 300; log session 30)
constexpr int64_t kSerialWork = int64_t{1} << 17;
constexpr int64_t kMaxGroup = 16;

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < d; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k + j), acc);
  return hsum(acc);
}

// 8 vectors -> one vector of their 8 horizontal sums
inline __m256 hsum8x8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[t] = q . K[slot(t)] * scale for the n keys of one chunk
template <typename T>
inline void chunk_scores(const float* q, const T* pk, const int64_t* slots, int64_t n, int64_t hkv,
                         int64_t kvh, int64_t d, float scale, float* scores) {
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const T* k[8];
    for (int u = 0; u < 8; ++u) k[u] = pk + (slots[t + u] * hkv + kvh) * d;
    __m256 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
      const __m256 qj = _mm256_loadu_ps(q + j);
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qj, load8(k[u] + j), acc[u]);
    }
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum8x8(acc), vs));
  }
  for (; t < n; ++t) scores[t] = dot_row(q, pk + (slots[t] * hkv + kvh) * d, d) * scale;
}

// scores <- e^(scores - max); returns (max, sum)
inline std::pair<float, float> chunk_softmax(float* scores, int64_t n) {
  float best = -INFINITY;
  for (int64_t t = 0; t < n; ++t) best = std::max(best, scores[t]);
  const __m256 vb = _mm256_set1_ps(best);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), vb));
    _mm256_storeu_ps(scores + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float total = hsum(vsum);
  for (; t < n; ++t) total += (scores[t] = std::exp(scores[t] - best));
  return {best, total};
}

// acc[d] = sum_t p[t] V[slot(t)], 64 columns at a time in registers
template <typename T>
inline void chunk_values(const float* p, const T* pv, const int64_t* slots, int64_t n, int64_t hkv,
                         int64_t kvh, int64_t d, float* acc) {
  int64_t j0 = 0;
  for (; j0 + 64 <= d; j0 += 64) {
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const T* v = pv + (slots[t] * hkv + kvh) * d + j0;
      const __m256 pt = _mm256_set1_ps(p[t]);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(pt, load8(v + 8 * u), a[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(acc + j0 + 8 * u, a[u]);
  }
  for (; j0 < d; j0 += 8) {  // d % 64 columns, 8 at a time
    __m256 a = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(pv + (slots[t] * hkv + kvh) * d + j0), a);
    }
    _mm256_storeu_ps(acc + j0, a);
  }
}

#ifdef TR_AVX512
// AVX-512 twins (build.py's TR_AVX512): bf16 keys dotted by vdpbf16ps with q in bf16 (exact: q
// holds model-dtype values), fp32 keys by 512-bit FMAs; values summed 16 floats a vector.
// They return false for head sizes they do not take (the AVX2 code above runs instead).
inline __m256 fold(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline bool chunk_scores512(const float* q, const T* pk, const int64_t* slots, int64_t n,
                            int64_t hkv, int64_t kvh, int64_t d, float scale, float* scores) {
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  if (d % 32 || d > 256) return false;
  alignas(64) c10::BFloat16 qb[256];
  if constexpr (kBf16) {
    for (int64_t j = 0; j < d; ++j) qb[j] = c10::BFloat16(q[j]);
  }
  const __m256 vs = _mm256_set1_ps(scale);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const T* k[8];
    for (int u = 0; u < 8; ++u) k[u] = pk + (slots[t + u] * hkv + kvh) * d;
    __m512 acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
    if constexpr (kBf16) {
      for (int64_t j = 0; j < d; j += 32) {
        const __m512bh qj = (__m512bh)_mm512_loadu_si512(qb + j);
        for (int u = 0; u < 8; ++u) {
          acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(k[u] + j), qj);
        }
      }
    } else {
      for (int64_t j = 0; j < d; j += 16) {
        const __m512 qj = _mm512_loadu_ps(q + j);
        for (int u = 0; u < 8; ++u) acc[u] = _mm512_fmadd_ps(qj, load16(k[u] + j), acc[u]);
      }
    }
    __m256 half[8];
    for (int u = 0; u < 8; ++u) half[u] = fold(acc[u]);
    _mm256_storeu_ps(scores + t, _mm256_mul_ps(hsum8x8(half), vs));
  }
  for (; t < n; ++t) scores[t] = dot_row(q, pk + (slots[t] * hkv + kvh) * d, d) * scale;
  return true;
}

template <typename T>
inline bool chunk_values512(const float* p, const T* pv, const int64_t* slots, int64_t n,
                            int64_t hkv, int64_t kvh, int64_t d, float* acc) {
  if (d % 16) return false;
  int64_t j0 = 0;
  for (; j0 + 64 <= d; j0 += 64) {
    __m512 a[4];
    for (int u = 0; u < 4; ++u) a[u] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      const T* v = pv + (slots[t] * hkv + kvh) * d + j0;
      const __m512 pt = _mm512_set1_ps(p[t]);
      for (int u = 0; u < 4; ++u) a[u] = _mm512_fmadd_ps(pt, load16(v + 16 * u), a[u]);
    }
    for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc + j0 + 16 * u, a[u]);
  }
  for (; j0 < d; j0 += 16) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(pv + (slots[t] * hkv + kvh) * d + j0), a);
    }
    _mm512_storeu_ps(acc + j0, a);
  }
  return true;
}
#endif  // TR_AVX512

// The AVX-512 kernel where it is built and takes this head size, else the AVX2 one
template <typename T>
inline void any_scores(const float* q, const T* pk, const int64_t* slots, int64_t n, int64_t hkv,
                       int64_t kvh, int64_t d, float scale, float* scores) {
#ifdef TR_AVX512
  if (chunk_scores512(q, pk, slots, n, hkv, kvh, d, scale, scores)) return;
#endif
  chunk_scores(q, pk, slots, n, hkv, kvh, d, scale, scores);
}

template <typename T>
inline void any_values(const float* p, const T* pv, const int64_t* slots, int64_t n, int64_t hkv,
                       int64_t kvh, int64_t d, float* acc) {
#ifdef TR_AVX512
  if (chunk_values512(p, pv, slots, n, hkv, kvh, d, acc)) return;
#endif
  chunk_values(p, pv, slots, n, hkv, kvh, d, acc);
}

// q [B, Hq, D] rotated fp32; pools [P, Hkv, D]; gather_slots [B, s_max]; out [B, Hq D] in T
template <typename T>
void decode_attention(const float* q, int64_t b, const T* pk, const T* pv,
                      const int64_t* gather_slots, const int64_t* kv_lens, int64_t s_max,
                      int64_t hq, int64_t hkv, int64_t d, float scale, T* out) {
  const int64_t group = hq / hkv;
  TORCH_CHECK(group <= kMaxGroup, "decode_attention: at most ", kMaxGroup, " q heads a kv head");
  std::vector<int64_t> first(b + 1, 0);  // task index of each row's first chunk (per kv head)
  for (int64_t i = 0; i < b; ++i) first[i + 1] = first[i] + (kv_lens[i] + kChunk - 1) / kChunk;
  const int64_t per_head = first[b], tasks = per_head * hkv;
  const int64_t stride = group * (d + 2);  // a task's partials: per q head [max, sum, acc[d]]
  std::vector<float> part(tasks * stride);
  int64_t keys = 0;
  for (int64_t i = 0; i < b; ++i) keys += kv_lens[i];
  const bool serial = keys * hq * d <= kSerialWork;  // grain past the range: one inline call
  at::parallel_for(0, tasks, serial ? tasks + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(kChunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t kvh = task / per_head, c = task % per_head;
      const int64_t i = std::upper_bound(first.begin(), first.end(), c) - first.begin() - 1;
      const int64_t t0 = (c - first[i]) * kChunk, n = std::min(kChunk, kv_lens[i] - t0);
      const int64_t* slots = gather_slots + i * s_max + t0;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        float* dst = part.data() + task * stride + g * (d + 2);
        any_scores(q + (i * hq + h) * d, pk, slots, n, hkv, kvh, d, scale, scores.data());
        const auto [best, total] = chunk_softmax(scores.data(), n);
        dst[0] = best, dst[1] = total;
        any_values(scores.data(), pv, slots, n, hkv, kvh, d, dst + 2);
      }
    }
  });
  // merge, in key order
  at::parallel_for(0, b * hq, serial ? b * hq + 1 : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hq, h = task % hq, kvh = h / group, g = h % group;
      const int64_t c0 = kvh * per_head + first[i], c1 = kvh * per_head + first[i + 1];
      float best = -INFINITY, total = 0.0f;
      for (int64_t c = c0; c < c1; ++c) best = std::max(best, part[c * stride + g * (d + 2)]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t c = c0; c < c1; ++c) {
        const float* src = part.data() + c * stride + g * (d + 2);
        const float w = std::exp(src[0] - best);
        total += src[1] * w;
        for (int64_t j = 0; j < d; ++j) acc[j] += src[2 + j] * w;
      }
      T* dst = out + (i * hq + h) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = T(acc[j] / total);
    }
  });
}

}  // namespace tr_native::attn
