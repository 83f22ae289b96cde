// AVX-512 BF16 dense-linear kernel: activations as bf16, weights as bf16 pairs (int8 widened
// exactly, int4 through a 16-entry vpermw table) and vdpbf16ps, fp32 accumulation.
// Compiled with the AVX-512 flags; used only when CPUID says so.
#include <immintrin.h>

#include "linear.h"
#include "simd_avx512.h"

namespace tandem_cpu {
namespace {

#ifndef TANDEM_LINEAR_PREFETCH
#define TANDEM_LINEAR_PREFETCH 4096
#endif
constexpr size_t kPrefetchBytes = TANDEM_LINEAR_PREFETCH;

size_t prep_bytes(int Kp, int M) { return (size_t)Kp * M * 2; }

void prep(const void* x, bool x_bf16, int M, int K, int Kp, void* dst) {
  for (int t = 0; t < M; ++t) {
    uint16_t* d = (uint16_t*)dst + (size_t)t * Kp;
    int k = 0;
    if (x_bf16) {
      const uint16_t* s = (const uint16_t*)x + (size_t)t * K;
      for (; k + 32 <= K; k += 32)
        _mm512_storeu_si512((void*)(d + k), _mm512_loadu_si512((const void*)(s + k)));
      if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        _mm512_storeu_si512((void*)(d + k), _mm512_maskz_loadu_epi16(m, s + k));
        k += 32;
      }
    } else {
      const float* s = (const float*)x + (size_t)t * K;
      for (; k + 16 <= K; k += 16)
        _mm256_storeu_si256((__m256i*)(d + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + k)));
      if (k < K) {
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        _mm256_storeu_si256((__m256i*)(d + k),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + k)));
        k += 16;
      }
    }
    for (; k < Kp; k += 16) _mm256_storeu_si256((__m256i*)(d + k), _mm256_setzero_si256());
  }
}

// 32 weights of row r from element 32 * c as bf16; int8 and int4 unscaled (exact).
template <int FMT>
inline __m512bh load32(const uint8_t* row, int c, __m512i table) {
  if (FMT == FMT_BF16) {
    return (__m512bh)_mm512_loadu_si512((const void*)(row + c * 64));
  } else if (FMT == FMT_INT8) {
    return int8x32_to_bf16(row + c * 32);
  } else {
    return (__m512bh)_mm512_permutexvar_epi16(int4x32_nibbles(row, c), table);
  }
}

// RR weight rows [r0, r0 + RR) against tokens [t0, t0 + NT).
template <int FMT, int RR, int NT>
void tile(const LinearArgs& a, const uint16_t* X, int r0, int t0, __m512i table) {
  const int Kp = a.Kp;
  const int groups = FMT == FMT_INT4 ? Kp / a.group : 0;
  const int chunks = FMT == FMT_BF16 ? a.K / 32 : Kp / 32;
  const uint8_t* rowp[RR];
  for (int r = 0; r < RR; ++r) rowp[r] = a.w + (size_t)(r0 + r) * a.w_row_bytes;
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[RR][NT];
  for (int r = 0; r < RR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = zero;
  const uint16_t* Xt = X + (size_t)t0 * Kp;
  for (int c = 0; c < chunks; ++c) {
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t)
      xv[t] = (__m512bh)_mm512_loadu_si512((const void*)(Xt + (size_t)t * Kp + c * 32));
    for (int r = 0; r < RR; ++r) {
      const __m512bh wv = load32<FMT>(rowp[r], c, table);
      if (FMT == FMT_INT4) {
        const __m512 s = _mm512_set1_ps(a.scales[(size_t)(r0 + r) * groups + (c * 32) / a.group]);
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wv, xv[t]), s, acc[r][t]);
      } else {
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
      }
    }
  }
  if (FMT == FMT_BF16 && a.K % 32) {
    // Row tail: masked so nothing past the row (or the tensor) is read.
    const int c = chunks;
    const __mmask32 m = (__mmask32)((1ull << (a.K % 32)) - 1);
    for (int r = 0; r < RR; ++r) {
      const __m512bh wv =
          (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(rowp[r] + (size_t)c * 64));
      for (int t = 0; t < NT; ++t) {
        const __m512bh xv =
            (__m512bh)_mm512_loadu_si512((const void*)(Xt + (size_t)t * Kp + c * 32));
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < RR; ++r) {
      float v = _mm512_reduce_add_ps(acc[r][t]);
      if (FMT == FMT_INT8) v *= a.scales[r0 + r];
      linear_store(a, t0 + t, r0 + r, v);
    }
}

// One row against tokens [0, NT) (M <= 2), four accumulators per token over interleaved
// chunks: the row block is then read as one sequential stream, which the hardware prefetcher
// follows better than eight rows side by side.
template <int FMT, int NT>
void row_seq(const LinearArgs& a, const uint16_t* X, int r, __m512i table) {
  const int Kp = a.Kp;
  const int groups = FMT == FMT_INT4 ? Kp / a.group : 0;
  const int chunks = FMT == FMT_BF16 ? a.K / 32 : Kp / 32;
  const uint8_t* row = a.w + (size_t)r * a.w_row_bytes;
  const float* gs = FMT == FMT_INT4 ? a.scales + (size_t)r * groups : nullptr;
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[4][NT];
  for (int u = 0; u < 4; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = zero;
  auto step = [&](int u, int c, __m512bh wv) {
    for (int t = 0; t < NT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(X + (size_t)t * Kp + c * 32));
      if (FMT == FMT_INT4)
        acc[u][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wv, xv),
                                    _mm512_set1_ps(gs[(c * 32) / a.group]), acc[u][t]);
      else
        acc[u][t] = _mm512_dpbf16_ps(acc[u][t], wv, xv);
    }
  };
  int c = 0;
  // Bytes of weights ahead of the current chunk to prefetch (a few rows of the block).
  const size_t ahead = kPrefetchBytes;
  for (; c + 4 <= chunks; c += 4) {
    const size_t at = (size_t)c * (FMT == FMT_BF16 ? 64 : FMT == FMT_INT8 ? 32 : 16);
    _mm_prefetch((const char*)(row + at + ahead), _MM_HINT_T0);
    _mm_prefetch((const char*)(row + at + ahead + 64), _MM_HINT_T0);
    if (FMT == FMT_BF16) {
      _mm_prefetch((const char*)(row + at + ahead + 128), _MM_HINT_T0);
      _mm_prefetch((const char*)(row + at + ahead + 192), _MM_HINT_T0);
    }
    for (int u = 0; u < 4; ++u) step(u, c + u, load32<FMT>(row, c + u, table));
  }
  for (; c < chunks; ++c) step(c & 3, c, load32<FMT>(row, c, table));
  if (FMT == FMT_BF16 && a.K % 32) {
    const __mmask32 m = (__mmask32)((1ull << (a.K % 32)) - 1);
    step(3, chunks, (__m512bh)_mm512_maskz_loadu_epi16(m, (const void*)(row + (size_t)chunks * 64)));
  }
  for (int t = 0; t < NT; ++t) {
    float v = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]), _mm512_add_ps(acc[2][t], acc[3][t])));
    if (FMT == FMT_INT8) v *= a.scales[r];
    linear_store(a, t, r, v);
  }
}

template <int FMT, int RR>
void row_group(const LinearArgs& a, const uint16_t* X, int r0, __m512i table) {
  int t0 = 0;
  if (RR == 8) {  // M <= 2: eight rows in flight per token
    for (; t0 + 2 <= a.M; t0 += 2) tile<FMT, RR, 2>(a, X, r0, t0, table);
    if (t0 < a.M) tile<FMT, RR, 1>(a, X, r0, t0, table);
    return;
  }
  for (; t0 + 4 <= a.M; t0 += 4) tile<FMT, RR, 4>(a, X, r0, t0, table);
  const int rest = a.M - t0;
  if (rest == 3) tile<FMT, RR, 3>(a, X, r0, t0, table);
  else if (rest == 2) tile<FMT, RR, 2>(a, X, r0, t0, table);
  else if (rest == 1) tile<FMT, RR, 1>(a, X, r0, t0, table);
}

template <int FMT>
void rows_fmt(const LinearArgs& a, const uint16_t* X, int r0, int r1, __m512i table) {
  int r = r0;
  if (a.M == 1) {
    for (; r < r1; ++r) row_seq<FMT, 1>(a, X, r, table);
    return;
  }
  if (a.M == 2) {
    for (; r < r1; ++r) row_seq<FMT, 2>(a, X, r, table);
    return;
  }
  for (; r + 4 <= r1; r += 4) row_group<FMT, 4>(a, X, r, table);
  for (; r < r1; ++r) row_group<FMT, 1>(a, X, r, table);
}

void rows(const LinearArgs& a, const void* xp, int r0, int r1) {
  alignas(64) uint16_t tbl[32];
  for (int i = 0; i < 32; ++i) tbl[i] = f32_to_bf16((float)(i - 8));
  const __m512i table = _mm512_load_si512((const void*)tbl);
  const uint16_t* X = (const uint16_t*)xp;
  if (a.fmt == FMT_BF16) rows_fmt<FMT_BF16>(a, X, r0, r1, table);
  else if (a.fmt == FMT_INT8) rows_fmt<FMT_INT8>(a, X, r0, r1, table);
  else rows_fmt<FMT_INT4>(a, X, r0, r1, table);
}

}  // namespace

LinearKernels linear_kernels_avx512() { return {"avx512", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
