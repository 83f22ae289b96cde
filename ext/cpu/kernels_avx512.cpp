// AVX-512 kernels: bf16 activations, weights turned into bf16 pairs in registers and
// multiplied with vdpbf16ps (32 multiply-adds per instruction). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx512vnni; used only when CPUID says so.
#include <immintrin.h>

#include "kernels.h"
#include "simd_avx512.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int K, int n) { return (size_t)K * n * 2; }

// fp32 -> bf16 (round to nearest even), zero past Kv.
inline void to_bf16(const float* src, int Kv, int K, uint16_t* dst) {
  int k = 0;
  for (; k + 16 <= Kv; k += 16)
    _mm256_storeu_si256((__m256i*)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
  if (k < Kv) {
    const __mmask16 m = (__mmask16)((1u << (Kv - k)) - 1);
    _mm256_storeu_si256((__m256i*)(dst + k),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + k)));
    k += 16;
  }
  for (; k < K; k += 16) _mm256_storeu_si256((__m256i*)(dst + k), _mm256_setzero_si256());
}

void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  uint16_t* d = (uint16_t*)dst;
  for (int t = 0; t < n; ++t) to_bf16(x[t], Kv, K, d + (size_t)t * K);
}

// 32 weights of row r from element 32 * c as bf16 (int8 unscaled: exact in bf16).
template <int FMT>
inline __m512bh load32(const WeightView& w, int r, int c, int groups) {
  const uint8_t* row = w.data + (size_t)r * w.row_bytes;
  if (FMT == FMT_BF16) {
    return (__m512bh)_mm512_loadu_si512((const void*)(row + c * 64));
  } else if (FMT == FMT_INT8) {
    return int8x32_to_bf16(row + c * 32);
  } else {
    const __m512i q = int4x32_nibbles(row, c);
    const __m512i eight = _mm512_set1_epi32(8);
    const __m512 scale = _mm512_set1_ps(w.scales[(size_t)r * groups + (c * 32) / w.group]);
    const __m512 lo = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q)), eight));
    const __m512 hi = _mm512_cvtepi32_ps(
        _mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1)), eight));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale), _mm512_mul_ps(lo, scale));
  }
}

// int4 rows against NT tokens, one 64-element chunk at a time: nibbles become bf16 (q - 8)
// through a 16-entry table (vpermw), dot products per group, then one FMA with the group scale.
template <int NT>
void tile_int4(const WeightView& w, int r0, int K, const uint16_t* X, __m512i table, float* C,
               int ldc) {
  const int groups = K / w.group;
  const bool g32 = w.group == 32;
  const __m512i m15 = _mm512_set1_epi16(15);
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = zero;
  for (int c = 0; c < K / 64; ++c) {
    __m512bh x0[NT], x1[NT];
    for (int t = 0; t < NT; ++t) {
      x0[t] = (__m512bh)_mm512_loadu_si512((const void*)(X + (size_t)t * K + c * 64));
      x1[t] = (__m512bh)_mm512_loadu_si512((const void*)(X + (size_t)t * K + c * 64 + 32));
    }
    for (int r = 0; r < 4; ++r) {
      const uint8_t* row = w.data + (size_t)(r0 + r) * w.row_bytes;
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(row + c * 32)));
      const __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, m15), table);
      const __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      const float* s = w.scales + (size_t)(r0 + r) * groups;
      if (g32) {
        const __m512 s0 = _mm512_set1_ps(s[2 * c]), s1 = _mm512_set1_ps(s[2 * c + 1]);
        for (int t = 0; t < NT; ++t) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wlo, x0[t]), s0, acc[r][t]);
          acc[r][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, whi, x1[t]), s1, acc[r][t]);
        }
      } else {
        const __m512 s0 = _mm512_set1_ps(s[(c * 64) / w.group]);
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm512_fmadd_ps(
              _mm512_dpbf16_ps(_mm512_dpbf16_ps(zero, wlo, x0[t]), whi, x1[t]), s0, acc[r][t]);
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) C[(size_t)t * ldc + r0 + r] = _mm512_reduce_add_ps(acc[r][t]);
}

void gemm_int4(const WeightView& w, int R, int K, const uint16_t* X, int n, float* C, int ldc) {
  alignas(64) uint16_t tbl[32];
  for (int i = 0; i < 32; ++i) tbl[i] = f32_to_bf16((float)(i - 8));
  const __m512i table = _mm512_load_si512((const void*)tbl);
  int t0 = 0;
  for (; t0 + 4 <= n; t0 += 4)
    for (int r0 = 0; r0 < R; r0 += 4)
      tile_int4<4>(w, r0, K, X + (size_t)t0 * K, table, C + (size_t)t0 * ldc, ldc);
  for (; t0 < n; t0 += 2) {
    for (int r0 = 0; r0 < R; r0 += 4) {
      if (n - t0 >= 2) tile_int4<2>(w, r0, K, X + (size_t)t0 * K, table, C + (size_t)t0 * ldc, ldc);
      else tile_int4<1>(w, r0, K, X + (size_t)t0 * K, table, C + (size_t)t0 * ldc, ldc);
    }
  }
}

// Four weight rows against NT tokens. rowscale: per-row factor or null.
template <int FMT, int NT>
void tile(const WeightView& w, int r0, int K, const uint16_t* X, const float* rowscale, float* C,
          int ldc) {
  const int groups = FMT == FMT_INT4 ? K / w.group : 0;
  __m512 acc[4][NT];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int c = 0; c < K / 32; ++c) {
    __m512bh xv[NT];
    for (int t = 0; t < NT; ++t)
      xv[t] = (__m512bh)_mm512_loadu_si512((const void*)(X + (size_t)t * K + c * 32));
    for (int r = 0; r < 4; ++r) {
      const __m512bh wv = load32<FMT>(w, r0 + r, c, groups);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, xv[t]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    const float scale = rowscale ? rowscale[r0 + r] : 1.f;
    for (int t = 0; t < NT; ++t)
      C[(size_t)t * ldc + r0 + r] = _mm512_reduce_add_ps(acc[r][t]) * scale;
  }
}

template <int FMT>
void gemm_fmt(const WeightView& w, int R, int K, const uint16_t* X, int n, const float* rowscale,
              float* C, int ldc) {
  int t0 = 0;
  for (; t0 + 4 <= n; t0 += 4)
    for (int r0 = 0; r0 < R; r0 += 4)
      tile<FMT, 4>(w, r0, K, X + (size_t)t0 * K, rowscale, C + (size_t)t0 * ldc, ldc);
  const int rest = n - t0;
  if (rest == 0) return;
  const uint16_t* Xt = X + (size_t)t0 * K;
  float* Ct = C + (size_t)t0 * ldc;
  for (int r0 = 0; r0 < R; r0 += 4) {
    if (rest == 3) tile<FMT, 3>(w, r0, K, Xt, rowscale, Ct, ldc);
    else if (rest == 2) tile<FMT, 2>(w, r0, K, Xt, rowscale, Ct, ldc);
    else tile<FMT, 1>(w, r0, K, Xt, rowscale, Ct, ldc);
  }
}

}  // namespace

void avx512_dequant_bf16(const WeightView& w, int R, int K, uint16_t* dst) {
  const int groups = w.fmt == FMT_INT4 ? K / w.group : 0;
  for (int r = 0; r < R; ++r) {
    uint16_t* d = dst + (size_t)r * K;
    for (int c = 0; c < K / 32; ++c) {
      __m512bh v;
      if (w.fmt == FMT_BF16) v = load32<FMT_BF16>(w, r, c, groups);
      else if (w.fmt == FMT_INT8) v = load32<FMT_INT8>(w, r, c, groups);
      else v = load32<FMT_INT4>(w, r, c, groups);
      _mm512_storeu_si512((void*)(d + c * 32), (__m512i)v);
    }
  }
}

void avx512_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
                 uint8_t* scratch) {
  const uint16_t* X = (const uint16_t*)xp;
  const float* rowscale = w.fmt == FMT_INT8 ? w.scales : nullptr;
  if (w.fmt == FMT_BF16) {
    gemm_fmt<FMT_BF16>(w, R, K, X, n, nullptr, C, ldc);
  } else if (w.fmt == FMT_INT4) {
    // Always the nibble tiles, never widened rows: those round (q - 8) * scale to bf16, so a
    // token's result changed with the number of tokens its expert got (batch-dependent).
    gemm_int4(w, R, K, X, n, C, ldc);
  } else if (n > 4) {
    // int8: widen the rows once (q is exact in bf16, the row scale comes after), bf16 tiles.
    uint16_t* wb = (uint16_t*)scratch;
    avx512_dequant_bf16(w, R, K, wb);
    const WeightView v{FMT_BF16, (const uint8_t*)wb, (size_t)K * 2, nullptr, 0};
    gemm_fmt<FMT_BF16>(v, R, K, X, n, rowscale, C, ldc);
  } else {
    gemm_fmt<FMT_INT8>(w, R, K, X, n, rowscale, C, ldc);
  }
}

namespace {
// e^x for x in float range (clamped), by 2^(x log2 e) = 2^n * e^(f ln 2), |f| <= 1/2.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 g = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
}  // namespace

void avx512_silu_mul(const float* gate, const float* up, float* dst, int n) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 u = _mm512_maskz_loadu_ps(m, up + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
  }
}

KernelSet kernels_avx512() {
  return {"avx512", prep_bytes, prep, avx512_gemm, nullptr, avx512_silu_mul};
}

}  // namespace tandem_cpu
