// AVX2 + FMA kernels: weights widened to fp32 in registers, fp32 activations, fp32 FMA.
// Compiled with -mavx2 -mfma -mf16c; called only when CPUID says the CPU has them.
#include <immintrin.h>

#include "kernels.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int K, int n) { return (size_t)K * n * sizeof(float); }

void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  float* d = (float*)dst;
  for (int t = 0; t < n; ++t) {
    std::memcpy(d + (size_t)t * K, x[t], sizeof(float) * Kv);
    std::memset(d + (size_t)t * K + Kv, 0, sizeof(float) * (K - Kv));
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 weights of row r starting at element 32 * c, as 4 x 8 floats (int8 unscaled).
template <int FMT>
inline void load32(const WeightView& w, int r, int c, int groups, __m256 out[4]) {
  const uint8_t* row = w.data + (size_t)r * w.row_bytes;
  if (FMT == FMT_BF16) {
    const __m128i* p = (const __m128i*)(row + c * 64);
    for (int s = 0; s < 4; ++s)
      out[s] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + s)), 16));
  } else if (FMT == FMT_INT8) {
    const uint8_t* p = row + c * 32;
    for (int s = 0; s < 4; ++s)
      out[s] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * s))));
  } else {
    // Chunk c is the low (c even) or high (c odd) nibbles of the 32 bytes of 64-chunk c / 2.
    const __m256i b = _mm256_loadu_si256((const __m256i*)(row + (c / 2) * 32));
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i q8 = (c & 1) ? _mm256_and_si256(_mm256_srli_epi16(b, 4), m) : _mm256_and_si256(b, m);
    const __m128i lo = _mm256_castsi256_si128(q8), hi = _mm256_extracti128_si256(q8, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256 scale = _mm256_set1_ps(w.scales[(size_t)r * groups + (c * 32) / w.group]);
    for (int s = 0; s < 4; ++s) {
      const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[s]), eight);
      out[s] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale);
    }
  }
}

// Four weight rows against NT tokens.
template <int FMT, int NT>
void tile(const WeightView& w, int r0, int K, const float* X, float* C, int ldc) {
  const int groups = FMT == FMT_INT4 ? K / w.group : 0;
  __m256 acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int c = 0; c < K / 32; ++c) {
    for (int r = 0; r < 4; ++r) {
      __m256 wv[4];
      load32<FMT>(w, r0 + r, c, groups, wv);
      for (int t = 0; t < NT; ++t) {
        const float* x = X + (size_t)t * K + c * 32;
        for (int s = 0; s < 4; ++s)
          acc[r][t] = _mm256_fmadd_ps(wv[s], _mm256_loadu_ps(x + 8 * s), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < 4; ++r) {
    const float scale = FMT == FMT_INT8 ? w.scales[r0 + r] : 1.f;
    for (int t = 0; t < NT; ++t) C[(size_t)t * ldc + r0 + r] = hsum(acc[r][t]) * scale;
  }
}

template <int FMT>
void gemm_fmt(const WeightView& w, int R, int K, const float* X, int n, float* C, int ldc) {
  int t0 = 0;
  for (; t0 + 3 <= n; t0 += 3)
    for (int r0 = 0; r0 < R; r0 += 4)
      tile<FMT, 3>(w, r0, K, X + (size_t)t0 * K, C + (size_t)t0 * ldc, ldc);
  const int rest = n - t0;
  for (int r0 = 0; r0 < R && rest > 0; r0 += 4) {
    if (rest == 2) tile<FMT, 2>(w, r0, K, X + (size_t)t0 * K, C + (size_t)t0 * ldc, ldc);
    else tile<FMT, 1>(w, r0, K, X + (size_t)t0 * K, C + (size_t)t0 * ldc, ldc);
  }
}

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t*) {
  const float* X = (const float*)xp;
  if (w.fmt == FMT_BF16) gemm_fmt<FMT_BF16>(w, R, K, X, n, C, ldc);
  else if (w.fmt == FMT_INT8) gemm_fmt<FMT_INT8>(w, R, K, X, n, C, ldc);
  else gemm_fmt<FMT_INT4>(w, R, K, X, n, C, ldc);
}

}  // namespace

KernelSet kernels_avx2() { return {"avx2", prep_bytes, prep, gemm}; }

}  // namespace tandem_cpu
