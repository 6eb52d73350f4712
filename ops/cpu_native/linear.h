// Batch-1 (small M) linear kernels on raw pointers, out = x @ W.T (+ bias) (+ residual), AVX2 + FMA
// (linear512.h: the AVX-512 twins, chosen below where built);
// linear_kernels.cpp wraps them as torch ops, decode_step.cpp calls them inside one decode step.
//
// dense: fp32 or bf16 weights [N, K], fp32 accumulation (bf16 widened in registers, bf16_dot).
// packed dense: the same values tiled [N / 4, K / 16, 4, 16] (a row block's 4 rows chunk by chunk:
//        one sequential stream instead of 4 short ones), same sums in the same order.
// int8:  per-row int8 weights [N, Kp] (Kp = K rounded up to 32, zero columns; or tiled
//        [N / 4, Kp / 32, 4, 32] as the packed dense layout), fp32 scales [N].
// int4:  per 32 columns (llama.cpp Q4_1 order: byte j = code j | code j+16 << 4) codes
//        qs [N, K/32, 16] uint8 and fp16 scales and mins dm [N, 2, K/32] (row n's K/32 scales,
//        then its mins): w = code * scale + min.
// int8 / int4 take x quantized per 32 values (q8 blocks: d = amax / 127, q = round(x * 127 / amax),
// half to even) and multiply with integer dot products (maddubs / madd), as ggml-cpu's q8_0 and
// q4_1 x q8_1 dot products do; the scales (and min times the block sums of x) apply in fp32.
// Threads: at::parallel_for over blocks of output rows (OpenMP: built with -fopenmp). Each output
// is one thread's fixed-order sum, so results do not depend on the thread count.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear512.h"
#include "simd.h"

namespace tr_native {

constexpr int64_t kRows = 4;              // output rows per inner loop (x loads shared by them)
constexpr int64_t kBlock = 32;            // q8 block: values per activation scale
constexpr int64_t kGrainBytes = 1 << 15;  // weight bytes a thread takes at least (no tiny splits)

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// x [M, K] -> fp32 rows [M, Kp] in `out`, zero-padded past K
template <typename T>
void float_rows(const T* x, int64_t m, int64_t k, int64_t kp, std::vector<float>& out) {
  out.assign(m * kp, 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) out[i * kp + j] = to_float(x[i * k + j]);
  }
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

// Per-call buffers: x in fp32 (dense), or its q8 codes [M, Kp], d and d * sum [M, Kp / 32]
struct Scratch {
  std::vector<float> xf, d, s;
  std::vector<int8_t> q;
  int64_t kp = 0, nb = 0;
};

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, Scratch& r) {
  r.kp = (k + kBlock - 1) / kBlock * kBlock;
  r.nb = r.kp / kBlock;
  float_rows(x, m, k, r.kp, r.xf);
  r.q.resize(m * r.kp);
  r.d.resize(m * r.nb);
  r.s.resize(m * r.nb);
  for (int64_t b = 0; b < m * r.nb; ++b) {
    quantize_block(r.xf.data() + b * kBlock, r.q.data() + b * kBlock, &r.d[b], &r.s[b]);
  }
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

// bf16_dot, int8_dot and int4_dot ask for the same columns of the row block kRows rows on (run_rows'
// next block, which a thread walks in order) as they read their own: on a 2-core AVX2 Zen 3 the
// hardware prefetcher alone left the short SmolLM2 rows (576-1,536 values) at ~9 GB/s (int8) and
// ~14 (bf16) against fp32's ~22; with it ~12.5 and ~16.5 (tools/bench_cpu_native_linear.py, log
// session 27). fp32 rows (twice the bytes) measured no gain and do not prefetch; 8 rows on was
// no better. A prefetch past the matrix's end is a hint, never a fault

// bf16 weights: one 32-byte load is 16 values, lane i holding values 2i (low half) and 2i + 1;
// shifting up / masking gives both as fp32 (2 ops, no widening shuffle), times x's even / odd
// values: xrow = [x[0], x[2], .. | x[1], x[3], .. (k16 / 2 each) | x[k16:] as is], k16 = K // 16 * 16
template <int R>
inline void bf16_dot(const c10::BFloat16* w, int64_t k, const float* xrow, float* out) {
  const int64_t k16 = k / 16 * 16;
  const float *xe = xrow, *xo = xrow + k16 / 2, *xt = xrow + k16;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k16; j += 16) {
    const __m256 e = _mm256_loadu_ps(xe + j / 2), o = _mm256_loadu_ps(xo + j / 2);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + kRows) * k + j), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + j));
      a0[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), e, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), o, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = hsum(_mm256_add_ps(a0[r], a1[r]));
    for (int64_t t = k16; t < k; ++t) s += to_float(w[r * k + t]) * xt[t - k16];
    out[r] = s;
  }
}

// Packed dense (kDensePacked): row block b's 16-value chunk c of its row r at
// ((b * K / 16 + c) * 4 + r) * 16, so a block is one contiguous stream of 4 K values. The rows
// layout reads a block as 4 interleaved streams of K values (1-3 KB each for SmolLM2), which the
// 2-core AVX2 Zen 3 box streamed at ~17-23 GB/s for bf16 and ~25 for fp32 against ~26-30 packed
// (tools/bench_cpu_native_linear.py, log session 28). bf16 prefetches kPackedAhead bytes on (512
// and 2,048 measured slower, none ~7% slower); fp32 measured fastest without.
// blk: the block's first value; r0: the first of the R rows (dot<1> of a row block's tail)
constexpr int64_t kPackedAhead = 1024;

template <int R>
inline void packed_bf16_dot(const c10::BFloat16* blk, int64_t k, int64_t r0, const float* xrow,
                            float* out) {
  const float *xe = xrow, *xo = xrow + k / 2;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const c10::BFloat16* chunk = blk + j * kRows + r0 * 16;
    const char* ahead = reinterpret_cast<const char*>(chunk) + kPackedAhead;
    _mm_prefetch(ahead, _MM_HINT_T0);  // a chunk of 4 rows is 128 bytes: two lines
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    const __m256 e = _mm256_loadu_ps(xe + j / 2), o = _mm256_loadu_ps(xo + j / 2);
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + r * 16));
      a0[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), e, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), o, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

template <int R>
inline void packed_fp32_dot(const float* blk, int64_t k, int64_t r0, const float* x, float* out) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 16) {
    const float* chunk = blk + j * kRows + r0 * 16;
    const __m256 x0 = _mm256_loadu_ps(x + j), x1 = _mm256_loadu_ps(x + j + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(chunk + r * 16), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(chunk + r * 16 + 8), x1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

// x [M, K] -> rows in bf16_dot's order (even / odd values of the first K // 16 * 16, then the rest)
template <typename T>
void even_odd_rows(const T* x, int64_t m, int64_t k, std::vector<float>& out) {
  const int64_t k16 = k / 16 * 16;
  out.resize(m * k);
  for (int64_t i = 0; i < m; ++i) {
    const T* src = x + i * k;
    float* row = out.data() + i * k;
    for (int64_t j = 0; j < k16 / 2; ++j) {
      row[j] = to_float(src[2 * j]), row[k16 / 2 + j] = to_float(src[2 * j + 1]);
    }
    for (int64_t j = k16; j < k; ++j) row[j] = to_float(src[j]);
  }
}

// kFull: codes may be -128 (|w| as the unsigned operand, x's sign moved onto it: 2 ops a row);
// else |x| is shared by the rows and w takes x's sign (1 op a row; -w overflows for w = -128).
// kTiled: codes tiled [N / 4, Kp / 32, 4, 32] (a row block's 4 rows block by block: one stream,
// as the packed dense layout; w: the row block's first code plus r0 * 32 for dot<1>); else rows
// [N, Kp]. As rows it read ~34 GB/s from L3 but ~17 from DRAM (stream-bound); tiled ~18-22 from
// DRAM (log session 28). Tiled prefetches kPackedAhead bytes on
template <int R, bool kFull, bool kTiled = false>
inline void int8_dot(const int8_t* w, int64_t kp, const int8_t* xq, const float* xd, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kp / kBlock; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x| (x in -127..127)
    const __m256 dx = _mm256_broadcast_ss(xd + b);
    if (kTiled) {  // a block of 4 rows is 128 bytes: two lines
      const char* ahead = reinterpret_cast<const char*>(w + b * kRows * kBlock) + kPackedAhead;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r) {
      if (!kTiled) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + kRows) * kp + b * kBlock), _MM_HINT_T0);
      }
      const int8_t* codes = kTiled ? w + (b * kRows + r) * kBlock : w + r * kp + b * kBlock;
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      const __m256i prod = kFull ? _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv))
                                 : _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
      const __m256i dot = _mm256_madd_epi16(prod, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

inline __m256i int4_codes(const uint8_t* qs) {  // 16 bytes -> the block's 32 codes, in order
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Row r's scales d at dm + r * 2 nb, its mins right after (fp16). Per 8 blocks the scales times
// x's d are one vector (cvtph + mul) broadcast a block at a time (one permute), and the mins
// times x's block sums one fma: no scalar fp16 conversions in the loop
template <int R>
inline void int4_dot(const uint8_t* qs, const uint16_t* dm, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xs, float* out) {
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R], macc[R];
  float tail[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = macc[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const __m256 dx8 = _mm256_loadu_ps(xd + b0), sx8 = _mm256_loadu_ps(xs + b0);
    __m256 scale[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* d = dm + r * 2 * nb + b0;
      _mm_prefetch(reinterpret_cast<const char*>(d + kRows * 2 * nb), _MM_HINT_T0);
      scale[r] = _mm256_mul_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d))), dx8);
      macc[r] = _mm256_fmadd_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + nb))), sx8, macc[r]);
    }
    for (int j = 0; j < 8; j += 2) {  // blocks b and b + 1: one 32-byte load of codes a row
      const int64_t b = b0 + j;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (b + 1) * kBlock));
      // the codes' low nibbles are values 0-15 of b | of b + 1, the high ones 16-31 of each
      const __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20);
      const __m256i xhi = _mm256_permute2x128_si256(x0, x1, 0x31);
      const __m256i pair = _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
      for (int r = 0; r < R; ++r) {
        if ((j & 3) == 0) {  // one 64-byte line of codes is 4 blocks
          _mm_prefetch(reinterpret_cast<const char*>(qs + ((r + kRows) * nb + b) * 16), _MM_HINT_T0);
        }
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (r * nb + b) * 16));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        // |code * x| <= 15 * 127: a pair sums to <= 3,810 and lo + hi to <= 7,620 (no int16
        // saturation); lanes 0-3 then hold block b's 32 products, lanes 4-7 block b + 1's
        const __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
        const __m256i dot = _mm256_madd_epi16(sum16, ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_permutevar8x32_ps(scale[r], pair), acc[r]);
      }
    }
  }
  for (int64_t b = b0; b < nb; ++b) {  // the last nb % 8 blocks
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
    for (int r = 0; r < R; ++r) {
      const __m256i dot =
          _mm256_madd_epi16(_mm256_maddubs_epi16(int4_codes(qs + (r * nb + b) * 16), xv), ones);
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(dm[r * 2 * nb + b]) * xd[b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[r]);
      tail[r] += _cvtsh_ss(dm[r * 2 * nb + nb + b]) * xs[b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[r], macc[r])) + tail[r];
}

// Runs dot<R>(row, i, out[R]) over every 4-row block (dot<1> for the last N % 4 rows), adds bias
// [N] / residual [M, N] (either may be null; residual may alias out) and stores in T
template <typename T, typename Dot1, typename Dot4>
void run_rows(int64_t m, int64_t n, int64_t row_bytes, const T* bias, const T* residual, T* out,
              const Dot1& dot1, const Dot4& dot4) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, kRows * row_bytes * m));
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
          if (bias) v += to_float(bias[col]);
          if (residual) v += to_float(residual[at_out]);
          out[at_out] = T(v);
        }
      }
    }
  });
}

// kInt8Full: int8 codes that may hold -128 (int8_dot's kFull)
// kDensePacked: fp32 / bf16 tiled [N / 4, K / 16, 4, 16] (N % 4 == 0, K % 16 == 0)
// kInt8Tiled / kInt8FullTiled: int8 codes tiled [N / 4, Kp / 32, 4, 32] (int8_dot's kTiled)
enum class Kind : int64_t {
  kDense = 0, kInt8 = 1, kInt4 = 2, kInt8Full = 3, kDensePacked = 4, kInt8Tiled = 5, kInt8FullTiled = 6
};

// One linear's weight fields (pointers into tensors the caller keeps alive)
struct LinearRef {
  Kind kind;
  const void* w;    // dense: fp32 / bf16 [N, K] (packed: [N / 4, K / 16, 4, 16]); int8: codes [N, Kp]
                    // (tiled: [N / 4, Kp / 32, 4, 32]); int4: qs [N, K / 32, 16]
  const void* aux;  // int8: fp32 scales [N]; int4: fp16 dm [N, 2, K / 32]; dense: unused
  bool is_bf16;     // dense / packed dense: the weight dtype
  int64_t n, k;
};

// out [M, N] = x [M, K] @ W.T (+ bias) (+ residual), x / bias / residual / out of dtype T
template <typename T>
void linear_into(const LinearRef& lw, const T* x, int64_t m, const T* bias, const T* residual,
                 T* out, Scratch& s) {
  const int64_t n = lw.n, k = lw.k;
  if (lw.kind == Kind::kDensePacked) {  // the AVX2 kernels on either build
    if (lw.is_bf16) {
      even_odd_rows(x, m, k, s.xf);
    } else {
      float_rows(x, m, k, k, s.xf);
    }
    const float* xp = s.xf.data();
    auto rows = [&](auto* wp, auto dot1, auto dot4) {
      run_rows(
          m, n, lw.is_bf16 ? 2 * k : 4 * k, bias, residual, out,
          [&](int64_t row, int64_t i, float* o) { dot1(wp + row / kRows * kRows * k, k, row % kRows, xp + i * k, o); },
          [&](int64_t row, int64_t i, float* o) { dot4(wp + row * k, k, 0, xp + i * k, o); });
    };
    if (lw.is_bf16) {
      rows(static_cast<const c10::BFloat16*>(lw.w), packed_bf16_dot<1>, packed_bf16_dot<4>);
    } else {
      rows(static_cast<const float*>(lw.w), packed_fp32_dot<1>, packed_fp32_dot<4>);
    }
    return;
  }
#ifdef TR_AVX512
  if (lw.kind == Kind::kDense && lw.is_bf16 && std::is_same_v<T, c10::BFloat16>) {
    const c10::BFloat16* xp = reinterpret_cast<const c10::BFloat16*>(x);
    const c10::BFloat16* wp = static_cast<const c10::BFloat16*>(lw.w);
    run_rows(
        m, n, 2 * k, bias, residual, out,
        [&](int64_t row, int64_t i, float* o) { avx512::bf16_dot<1>(wp + row * k, k, xp + i * k, o); },
        [&](int64_t row, int64_t i, float* o) { avx512::bf16_dot<4>(wp + row * k, k, xp + i * k, o); });
    return;
  }
  if (lw.kind == Kind::kDense) {  // fp32 x (fp32 or bf16 weights)
    float_rows(x, m, k, k, s.xf);
    const float* xp = s.xf.data();
    auto rows = [&](auto* wp) {
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      run_rows(
          m, n, sizeof(W) * k, bias, residual, out,
          [&](int64_t row, int64_t i, float* o) { avx512::dense_dot<1>(wp + row * k, k, xp + i * k, o); },
          [&](int64_t row, int64_t i, float* o) { avx512::dense_dot<4>(wp + row * k, k, xp + i * k, o); });
    };
    if (lw.is_bf16) {
      rows(static_cast<const c10::BFloat16*>(lw.w));
    } else {
      rows(static_cast<const float*>(lw.w));
    }
    return;
  }
  namespace dots = avx512;
#else
  namespace dots = tr_native;
#endif
  if (lw.kind == Kind::kDense && lw.is_bf16) {
    even_odd_rows(x, m, k, s.xf);
    const float* xp = s.xf.data();
    const c10::BFloat16* wp = static_cast<const c10::BFloat16*>(lw.w);
    run_rows(
        m, n, 2 * k, bias, residual, out,
        [&](int64_t row, int64_t i, float* o) { bf16_dot<1>(wp + row * k, k, xp + i * k, o); },
        [&](int64_t row, int64_t i, float* o) { bf16_dot<4>(wp + row * k, k, xp + i * k, o); });
    return;
  }
  if (lw.kind == Kind::kDense) {
    float_rows(x, m, k, k, s.xf);
    const float* xp = s.xf.data();
    const float* wp = static_cast<const float*>(lw.w);
    run_rows(
        m, n, 4 * k, bias, residual, out,
        [&](int64_t row, int64_t i, float* o) { dense_dot<1>(wp + row * k, k, xp + i * k, o); },
        [&](int64_t row, int64_t i, float* o) { dense_dot<4>(wp + row * k, k, xp + i * k, o); });
    return;
  }
  quantize_rows(x, m, k, s);
  const int64_t kp = s.kp, nb = s.nb;
  const int8_t* xq = s.q.data();
  const float* xd = s.d.data();
  const float* xs = s.s.data();
  if (lw.kind != Kind::kInt4) {  // int8: rows, or tiles (the AVX2 kernel on either build)
    const int8_t* wp = static_cast<const int8_t*>(lw.w);
    const float* sp = static_cast<const float*>(lw.aux);
    auto rows = [&](auto full, auto tiles) {
      constexpr bool kFull = decltype(full)::value, kTiled = decltype(tiles)::value;
      auto dot = [&](auto r_count, const int8_t* w0, int64_t i, float* o) {
        constexpr int R = decltype(r_count)::value;
        if constexpr (kTiled) {
          int8_dot<R, kFull, true>(w0, kp, xq + i * kp, xd + i * nb, o);
        } else {
          dots::int8_dot<R, kFull>(w0, kp, xq + i * kp, xd + i * nb, o);
        }
      };
      run_rows(
          m, n, kp, bias, residual, out,
          [&](int64_t row, int64_t i, float* o) {  // tiled: the row's offset in its block's chunks
            const int8_t* w0 = kTiled ? wp + row / kRows * kRows * kp + row % kRows * kBlock
                                      : wp + row * kp;
            dot(std::integral_constant<int, 1>{}, w0, i, o);
            o[0] *= sp[row];
          },
          [&](int64_t row, int64_t i, float* o) {
            dot(std::integral_constant<int, 4>{}, wp + row * kp, i, o);
            for (int r = 0; r < 4; ++r) o[r] *= sp[row + r];
          });
    };
    const bool full = lw.kind == Kind::kInt8Full || lw.kind == Kind::kInt8FullTiled;
    const bool tiled = lw.kind == Kind::kInt8Tiled || lw.kind == Kind::kInt8FullTiled;
    if (full && tiled) {
      rows(std::true_type{}, std::true_type{});
    } else if (full) {
      rows(std::true_type{}, std::false_type{});
    } else if (tiled) {
      rows(std::false_type{}, std::true_type{});
    } else {
      rows(std::false_type{}, std::false_type{});
    }
    return;
  }
  const uint8_t* wp = static_cast<const uint8_t*>(lw.w);
  const uint16_t* dp = static_cast<const uint16_t*>(lw.aux);
  run_rows(
      m, n, nb * 20, bias, residual, out,
      [&](int64_t row, int64_t i, float* o) {
        dots::int4_dot<1>(wp + row * nb * 16, dp + row * 2 * nb, nb, xq + i * kp, xd + i * nb,
                    xs + i * nb, o);
      },
      [&](int64_t row, int64_t i, float* o) {
        dots::int4_dot<4>(wp + row * nb * 16, dp + row * 2 * nb, nb, xq + i * kp, xd + i * nb,
                    xs + i * nb, o);
      });
}

}  // namespace tr_native
