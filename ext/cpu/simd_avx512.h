// AVX-512 BF16 helpers shared by the expert kernels and the dense linear kernels. Include only
// from translation units compiled with the AVX-512 BF16 flags (kernels_avx512.cpp,
// linear_avx512.cpp); nothing here is dispatched on its own. `static`: each unit keeps its own
// copy, so the linker never merges code built for one ISA into another unit.
#pragma once

#include <immintrin.h>

#include <cstdint>

// 32 int8 weights as bf16, unscaled: every int8 value is exact in bf16.
static inline __m512bh int8x32_to_bf16(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)p);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The 32 nibbles of 32-weight chunk c of a packed int4 row, as u16 lanes 0..15: chunk c is
// the low (c even) or high (c odd) nibbles of the 32 bytes of 64-weight chunk c / 2.
static inline __m512i int4x32_nibbles(const uint8_t* row, int c) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(row + (c / 2) * 32)));
  return (c & 1) ? _mm512_srli_epi16(v, 4) : _mm512_and_si512(v, _mm512_set1_epi16(15));
}
