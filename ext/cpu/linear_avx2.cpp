// AVX2 + FMA dense-linear kernel: fp32 activations, weights widened to fp32 eight at a time.
// Compiled with -mavx2 -mfma -mf16c; used only when CPUID says so.
#include <immintrin.h>

#include "linear.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int Kp, int M) { return (size_t)Kp * M * sizeof(float); }

void prep(const void* x, bool x_bf16, int M, int K, int Kp, void* dst) {
  float* d = (float*)dst;
  for (int t = 0; t < M; ++t) {
    for (int k = 0; k < K; ++k)
      d[(size_t)t * Kp + k] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[(size_t)t * K + k])
                                     : ((const float*)x)[(size_t)t * K + k];
    for (int k = K; k < Kp; ++k) d[(size_t)t * Kp + k] = 0.f;
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight weights of a row from element k (a multiple of 8; int8 unscaled, int4 scaled).
template <int FMT>
inline __m256 load8(const LinearArgs& a, const uint8_t* row, const float* gscale, int k) {
  if (FMT == FMT_BF16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(row + 2 * (size_t)k))), 16));
  } else if (FMT == FMT_INT8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + k))));
  } else {
    const int c = k / 64, j = k % 64;
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + c * 32 + (j & 31))));
    const __m256i q = j < 32 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))),
                         _mm256_set1_ps(gscale[k / a.group]));
  }
}

// Four rows [r0, r0 + 4) (or one) against tokens [t0, t0 + NT).
template <int FMT, int RR, int NT>
void tile(const LinearArgs& a, const float* X, int r0, int t0) {
  const int Kp = a.Kp;
  const int kv = FMT == FMT_BF16 ? a.K / 8 * 8 : Kp;  // vector part; bf16 rows end at K
  const uint8_t* rowp[RR];
  const float* gs[RR];
  for (int r = 0; r < RR; ++r) {
    rowp[r] = a.w + (size_t)(r0 + r) * a.w_row_bytes;
    gs[r] = FMT == FMT_INT4 ? a.scales + (size_t)(r0 + r) * (Kp / a.group) : nullptr;
  }
  __m256 acc[RR][NT];
  for (int r = 0; r < RR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  const float* Xt = X + (size_t)t0 * Kp;
  for (int k = 0; k < kv; k += 8) {
    __m256 wv[RR];
    for (int r = 0; r < RR; ++r) wv[r] = load8<FMT>(a, rowp[r], gs[r], k);
    for (int t = 0; t < NT; ++t) {
      const __m256 xv = _mm256_loadu_ps(Xt + (size_t)t * Kp + k);
      for (int r = 0; r < RR; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < RR; ++r) {
      float v = hsum(acc[r][t]);
      for (int k = kv; k < a.K; ++k) v += linear_weight(a, r0 + r, k) * Xt[(size_t)t * Kp + k];
      if (FMT == FMT_INT8) v *= a.scales[r0 + r];
      linear_store(a, t0 + t, r0 + r, v);
    }
}

template <int FMT, int RR>
void row_group(const LinearArgs& a, const float* X, int r0) {
  int t0 = 0;
  for (; t0 + 2 <= a.M; t0 += 2) tile<FMT, RR, 2>(a, X, r0, t0);
  if (t0 < a.M) tile<FMT, RR, 1>(a, X, r0, t0);
}

template <int FMT>
void rows_fmt(const LinearArgs& a, const float* X, int r0, int r1) {
  int r = r0;
  for (; r + 4 <= r1; r += 4) row_group<FMT, 4>(a, X, r);
  for (; r < r1; ++r) row_group<FMT, 1>(a, X, r);
}

void rows(const LinearArgs& a, const void* xp, int r0, int r1) {
  const float* X = (const float*)xp;
  if (a.fmt == FMT_BF16) rows_fmt<FMT_BF16>(a, X, r0, r1);
  else if (a.fmt == FMT_INT8) rows_fmt<FMT_INT8>(a, X, r0, r1);
  else rows_fmt<FMT_INT4>(a, X, r0, r1);
}

}  // namespace

LinearKernels linear_kernels_avx2() { return {"avx2", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
