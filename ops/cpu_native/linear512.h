// AVX-512 twins of linear.h's row dot products, built when the CPU has AVX-512 BW / VL / VNNI /
// BF16 (build.py defines TR_AVX512 then): 64-byte vectors, bf16 pairs through vdpbf16ps and the
// int8 / int4 block dot products through vpdpbusd (u8 x s8 -> int32, one instruction where AVX2
// needs maddubs + madd). Same math, same per-output fixed order (per row, independent of threads);
// only the fp32 summation order differs from the AVX2 kernels.
#pragma once
#ifdef TR_AVX512
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace tr_native::avx512 {

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

// fp32 x times fp32 or bf16 weight rows (bf16 widened in registers); tail by masked loads
template <int R, typename W>
inline void dense_dot(const W* w, int64_t k, const float* x, float* out) {
  auto wload = [](const W* p, __mmask16 m) {
    if constexpr (std::is_same_v<W, float>) {
      return _mm512_maskz_loadu_ps(m, p);
    } else {
      const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
  };
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= k; j += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + j), x1 = _mm512_loadu_ps(x + j + 16);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(wload(w + r * k + j, 0xFFFF), x0, a0[r]);
      a1[r] = _mm512_fmadd_ps(wload(w + r * k + j + 16, 0xFFFF), x1, a1[r]);
    }
  }
  for (; j < k; j += 16) {
    const __mmask16 m = k - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (k - j)) - 1);
    const __m512 x0 = _mm512_maskz_loadu_ps(m, x + j);
    for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(wload(w + r * k + j, m), x0, a0[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// bf16 x times bf16 weight rows: vdpbf16ps multiplies 32 pairs (products exact in fp32)
template <int R>
inline void bf16_dot(const c10::BFloat16* w, int64_t k, const c10::BFloat16* x, float* out) {
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 64 <= k; j += 64) {
    const __m512bh x0 = (__m512bh)load64(x + j), x1 = (__m512bh)load64(x + j + 32);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)load64(w + r * k + j), x0);
      a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)load64(w + r * k + j + 32), x1);
    }
  }
  for (; j < k; j += 32) {
    const __mmask32 m = k - j >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << (k - j)) - 1);
    const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(m, x + j);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * k + j), x0);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}

// Two q8 blocks' scales as one vector: lanes 0-7 d[b], 8-15 d[b + 1] (the int32 lanes of a
// vpdpbusd over 64 bytes hold block b's sums in 0-7 and block b + 1's in 8-15)
inline __m512 pair_scale(float d0, float d1) {
  return _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
}

// int8 codes [kp] per row; an odd last block runs with its upper 32 bytes masked to zero.
// kFull: codes may be -128 (|w| unsigned, x takes w's sign); else |x| unsigned, w takes x's sign
template <int R, bool kFull>
inline void int8_dot(const int8_t* w, int64_t kp, const int8_t* xq, const float* xd, float* out) {
  const int64_t nb = kp / 32;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 2) {
    const bool two = b + 1 < nb;
    const __mmask64 m = two ? ~0ull : 0xFFFFFFFFull;
    const __m512i xv = _mm512_maskz_loadu_epi8(m, xq + b * 32);
    const __m512 dx = pair_scale(xd[b], two ? xd[b + 1] : 0.0f);
    const __mmask64 xneg = _mm512_movepi8_mask(xv);
    const __m512i ax = _mm512_abs_epi8(xv);
    for (int r = 0; r < R; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi8(m, w + r * kp + b * 32);
      __m512i dot;
      if constexpr (kFull) {
        const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);
        dot = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sx);
      } else {
        dot = _mm512_dpbusd_epi32(zero, ax, _mm512_mask_sub_epi8(wv, xneg, zero, wv));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

// int4 (linear.h's Q4_1 layout). Two blocks' 32 bytes -> one vector of codes ordered [block b
// codes 0-15, b+1 0-15, b 16-31, b+1 16-31] (low nibbles, then high); x's two blocks are put in
// the same order once (a 128-bit lane shuffle) for all rows. vpdpbusd's int32 lanes 0-3 / 8-11
// then hold block b's sums and 4-7 / 12-15 block b + 1's; each row's 8 block scales (times x's d)
// are one vector per 8 blocks, spread to that lane pattern by one permute a pair.
template <int R>
inline void int4_dot(const uint8_t* qs, const uint16_t* dm, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xs, float* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R];
  __m256 macc[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    macc[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const __m256 dx8 = _mm256_loadu_ps(xd + b0), sx8 = _mm256_loadu_ps(xs + b0);
    __m512 scale[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* d = dm + r * 2 * nb + b0;
      scale[r] = _mm512_castps256_ps512(_mm256_mul_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))), dx8));
      macc[r] = _mm256_fmadd_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + nb))), sx8, macc[r]);
    }
    for (int j = 0; j < 8; j += 2) {
      const int64_t b = b0 + j;
      const __m512i x2 = load64(xq + b * 32);
      const __m512i xv = _mm512_shuffle_i64x2(x2, x2, _MM_SHUFFLE(3, 1, 2, 0));
      const __m512i lane = _mm512_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1, j, j, j, j,
                                             j + 1, j + 1, j + 1, j + 1);
      for (int r = 0; r < R; ++r) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (r * nb + b) * 16));
        const __m512i codes = _mm512_and_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1), low);
        const __m512i dot = _mm512_dpbusd_epi32(zero, codes, xv);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lane, scale[r]),
                                 acc[r]);
      }
    }
  }
  for (int64_t b = b0; b < nb; ++b) {  // the last nb % 8 blocks, one at a time (256-bit)
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    for (int r = 0; r < R; ++r) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (r * nb + b) * 16));
      const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                             _mm256_set1_epi8(0x0F));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xv);
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(dm[r * 2 * nb + b]) * xd[b]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, macc[r]);
      tail[r] += _cvtsh_ss(dm[r * 2 * nb + nb + b]) * xs[b];
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = _mm512_reduce_add_ps(acc[r]) + hsum(macc[r]) + tail[r];
  }
}

}  // namespace tr_native::avx512
#endif  // TR_AVX512
