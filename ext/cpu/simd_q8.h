// The activation quantizer of the integer path (kernels.h: kQBlock), shared by the VNNI and
// the AMX int8 units so both see the same integers. Include only from units compiled with
// AVX-512 F/BW; `static`, like simd_avx512.h, so no unit's copy is merged into another's.
#pragma once

#include <immintrin.h>

#include <cstdint>

static inline __mmask16 q8_first_n(int v) {
  return v >= 16 ? (__mmask16)0xffff : v <= 0 ? (__mmask16)0 : (__mmask16)((1u << v) - 1);
}

// The 32 floats src[0, 32) (those at or past `valid` read as zero) as s8 q[32] with
// x ~= q * *scale: scale = absmax / 127, q = round-half-even(x / scale). *sum = sum of q.
// Returns false (q, scale, sum untouched) when the block is all zero (or its scale underflows).
static inline bool q8_block32(const float* src, int valid, int8_t* q, float* scale, int32_t* sum) {
  const __m512 a = _mm512_maskz_loadu_ps(q8_first_n(valid), src);
  const __m512 c = _mm512_maskz_loadu_ps(q8_first_n(valid - 16), src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
  const float s = amax / 127.f;
  if (!(s > 0.f)) return false;
  const __m512 sv = _mm512_set1_ps(s);
  // Division, not a reciprocal multiply: the same rounding as the torch reference.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, sv));  // MXCSR default: half to even
  const __m512i qc = _mm512_cvtps_epi32(_mm512_div_ps(c, sv));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qc));
  *scale = s;
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
  return true;
}
