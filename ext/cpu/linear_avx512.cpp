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

// FMT_BF16_VNNI: weights as [N / 16][Kp / 2][16 columns][2] bf16, so one 64-byte load holds a
// K pair of 16 output columns and x's pair is broadcast: no horizontal sums. Every output
// (t, n) is one fp32 lane accumulated over the K pairs in order, whatever M and the tile
// shapes are, so a row's result does not depend on the other rows of the call.
template <int TN, int NB>
void vnni_tile(const LinearArgs& a, const uint16_t* X, int nb0, int t0) {
  const int pairs = a.Kp / 2;
  const size_t blk = a.w_row_bytes / 4;  // uint32 words per 16-column block
  const uint32_t* W = (const uint32_t*)a.w + (size_t)nb0 * blk;
  __m512 acc[TN][NB];
  for (int t = 0; t < TN; ++t)
    for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_setzero_ps();
  const uint32_t* xs[TN];
  for (int t = 0; t < TN; ++t) xs[t] = (const uint32_t*)(X + (size_t)(t0 + t) * a.Kp);
  for (int p = 0; p < pairs; ++p) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) {
      const uint32_t* src = W + j * blk + (size_t)p * 16;
      _mm_prefetch((const char*)(src + kPrefetchBytes / 4), _MM_HINT_T0);
      w[j] = (__m512bh)_mm512_loadu_si512((const void*)src);
    }
    for (int t = 0; t < TN; ++t) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xs[t][p]);
      for (int j = 0; j < NB; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], w[j], xb);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int n0 = (nb0 + j) * 16;
    const int cols = a.N - n0 < 16 ? a.N - n0 : 16;
    const __mmask16 m = (__mmask16)((1u << cols) - 1);
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(m, a.bias + n0) : _mm512_setzero_ps();
    for (int t = 0; t < TN; ++t) {
      const __m512 v = _mm512_add_ps(acc[t][j], b);
      const size_t at = (size_t)(t0 + t) * a.N + n0;
      if (a.y_bf16)
        _mm256_mask_storeu_epi16((uint16_t*)a.y + at, m, (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_mask_storeu_ps((float*)a.y + at, m, v);
    }
  }
}

template <int NB>
void vnni_tokens(const LinearArgs& a, const uint16_t* X, int nb0) {
  int t = 0;
  for (; t + 4 <= a.M; t += 4) vnni_tile<4, NB>(a, X, nb0, t);
  const int rest = a.M - t;
  if (rest == 3) vnni_tile<3, NB>(a, X, nb0, t);
  else if (rest == 2) vnni_tile<2, NB>(a, X, nb0, t);
  else if (rest == 1) vnni_tile<1, NB>(a, X, nb0, t);
}

// M >= 8: eight tokens against three column blocks (24 accumulators), fewer loads per product.
template <int NB>
void vnni_tokens8(const LinearArgs& a, const uint16_t* X, int nb0) {
  int t = 0;
  for (; t + 8 <= a.M; t += 8) vnni_tile<8, NB>(a, X, nb0, t);
  for (; t + 4 <= a.M; t += 4) vnni_tile<4, NB>(a, X, nb0, t);
  const int rest = a.M - t;
  if (rest == 3) vnni_tile<3, NB>(a, X, nb0, t);
  else if (rest == 2) vnni_tile<2, NB>(a, X, nb0, t);
  else if (rest == 1) vnni_tile<1, NB>(a, X, nb0, t);
}

void vnni_rows(const LinearArgs& a, const uint16_t* X, int r0, int r1) {
  int nb = r0 / 16;
  const int nb1 = (r1 + 15) / 16;
  if (a.M <= 2)  // weight-bound: eight column blocks (eight streams) in flight
    for (; nb + 8 <= nb1; nb += 8) vnni_tokens<8>(a, X, nb);
  if (a.M >= 8) {
    for (; nb + 3 <= nb1; nb += 3) vnni_tokens8<3>(a, X, nb);
    for (; nb + 2 <= nb1; nb += 2) vnni_tokens8<2>(a, X, nb);
    for (; nb < nb1; ++nb) vnni_tokens8<1>(a, X, nb);
    return;
  }
  for (; nb + 4 <= nb1; nb += 4) vnni_tokens<4>(a, X, nb);
  for (; nb + 2 <= nb1; nb += 2) vnni_tokens<2>(a, X, nb);
  for (; nb < nb1; ++nb) vnni_tokens<1>(a, X, nb);
}

void rows(const LinearArgs& a, const void* xp, int r0, int r1) {
  alignas(64) uint16_t tbl[32];
  for (int i = 0; i < 32; ++i) tbl[i] = f32_to_bf16((float)(i - 8));
  const __m512i table = _mm512_load_si512((const void*)tbl);
  const uint16_t* X = (const uint16_t*)xp;
  if (a.fmt == FMT_BF16_VNNI) vnni_rows(a, X, r0, r1);
  else if (a.fmt == FMT_BF16) rows_fmt<FMT_BF16>(a, X, r0, r1, table);
  else if (a.fmt == FMT_INT8) rows_fmt<FMT_INT8>(a, X, r0, r1, table);
  else rows_fmt<FMT_INT4>(a, X, r0, r1, table);
}

}  // namespace

LinearKernels linear_kernels_avx512() { return {"avx512", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
