// AVX2 kernel for Q4_0 / Q4_1 / Q8_0 and the k-quants with int8 activations (the layout of
// qlinear_int8.h), for CPUs without AVX-512 VNNI: one block at a time, `vpmaddubsw` then
// `vpmaddwd` for the integer dot product (Q8_0's signed codes through the sign trick, so no
// pair sum can saturate), one fp32 scale per block. Compiled with the AVX2 flags; used only
// when CPUID says so.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "qlinear.h"
#include "qlinear_int8.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int K, int M) { return (size_t)M * q8_group_count(K) * kQ8GroupBytes + 64; }

// Per 32 values: scale = absmax / 127, q = round-half-even(x / scale) (ext/cpu/reference.py's
// quantize_activations); an all-zero block stays zero.
void prep(const void* x, bool x_bf16, int M, int K, void* dst) {
  const int blocks = K / 32, groups = q8_group_count(K);
  for (int t = 0; t < M; ++t) {
    uint8_t* base = (uint8_t*)dst + (size_t)t * groups * kQ8GroupBytes;
    std::memset(base, 0, (size_t)groups * kQ8GroupBytes);
    for (int b = 0; b < blocks; ++b) {
      float v[32], amax = 0.f;
      bool finite = true;
      for (int i = 0; i < 32; ++i) {
        const size_t at = (size_t)t * K + b * 32 + i;
        v[i] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[at]) : ((const float*)x)[at];
        amax = std::fmax(amax, std::fabs(v[i]));
        finite = finite && std::isfinite(v[i]);
      }
      uint8_t* g = base + (size_t)(b / 4) * kQ8GroupBytes;
      const int j = b % 4;
      if (!finite) {  // NaN scale: the outputs it reaches are NaN, as with float activations
        for (int l = 0; l < 4; ++l) ((float*)(g + 128))[4 * j + l] = ((float*)(g + 192))[4 * j + l] = NAN;
        continue;
      }
      const float scale = amax / 127.f;
      if (!(scale > 0.f)) continue;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = (int)std::nearbyint(v[i] / scale);  // default rounding: half to even
        sum += q;
        g[(i < 16 ? 0 : 64) + j * 16 + (i & 15)] = (uint8_t)(int8_t)q;
      }
      float* dx = (float*)(g + 128);
      for (int l = 0; l < 4; ++l) dx[4 * j + l] = scale, dx[16 + 4 * j + l] = scale * (float)sum * 0.25f;
    }
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One weight row against one token: per block an integer dot product of the block's 32
// codes (first 16 values, then last 16) with the token's, scaled by d * dx; the min / offset
// terms summed apart.
float dot_row(int qt, const uint8_t* row, const uint8_t* X, int blocks) {
  const int bytes = qtype_block_bytes(qt);
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  float accm = 0.f;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + (size_t)b * bytes;
    const uint8_t* g = X + (size_t)(b / 4) * kQ8GroupBytes;
    const int j = b % 4;
    const __m256i xv = _mm256_loadu2_m128i((const __m128i*)(g + 64 + j * 16),
                                           (const __m128i*)(g + j * 16));
    const float dx = ((const float*)(g + 128))[4 * j];
    const float dxs4 = ((const float*)(g + 192))[4 * j] * 4.f;  // dx * sum(q)
    const float d = f16(blk);
    __m256i prod;
    float c;
    if (qt == QT_Q8_0) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 2));
      // |w| * (x with w's sign): each pair sum at most 2 * 128 * 127, no saturation
      prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
      c = 0.f;
    } else {
      const __m128i q = _mm_loadu_si128((const __m128i*)(blk + (qt == QT_Q4_1 ? 4 : 2)));
      const __m256i w = _mm256_and_si256(
          _mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);  // [low nibbles | high nibbles]
      prod = _mm256_maddubs_epi16(w, xv);
      c = qt == QT_Q4_1 ? f16(blk + 2) : -8.f * d;
    }
    const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
    acc = _mm256_fmadd_ps(s, _mm256_set1_ps(d * dx), acc);
    accm = std::fma(c, dxs4, accm);
  }
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2))) + accm;
}

inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

// The same for the k-quants, per 32-value sub-block j of each 256-value super-block: its
// codes as u8 (first 16 values, then last 16, as the activations lie). Q4_K / Q5_K: scale
// d * sc and min dmin * m (6 bits each); Q6_K: code - 32 through the sign trick, each 16
// values' int8 scale on its half of the lanes.
float dot_row_k(int qt, const uint8_t* row, const uint8_t* X, int blocks) {
  const int bytes = qtype_block_bytes(qt);
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  float accm = 0.f;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* sb = row + (size_t)(b / 8) * bytes;
    const int j = b % 8;
    const uint8_t* g = X + (size_t)(b / 4) * kQ8GroupBytes;
    const int gj = b % 4;
    const __m256i xv = _mm256_loadu2_m128i((const __m128i*)(g + 64 + gj * 16),
                                           (const __m128i*)(g + gj * 16));
    const float dx = ((const float*)(g + 128))[4 * gj];
    const float dxs4 = ((const float*)(g + 192))[4 * gj] * 4.f;  // dx * sum(q)
    if (qt == QT_Q6_K) {
      const int h = j / 4, k = j % 4;
      const __m256i ql = _mm256_loadu_si256((const __m256i*)(sb + 64 * h + (k & 1) * 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 128 + 32 * h));
      const __m128i nib_shift = _mm_cvtsi32_si128(4 * (k >> 1));
      const __m256i nib = _mm256_and_si256(_mm256_srl_epi16(ql, nib_shift), m4);
      const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), m3);
      const __m256i w = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(hi, 4)),
                                        _mm256_set1_epi8(32));
      const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
      const float d = f16(sb + 208) * dx;
      const __m256 sc = _mm256_set_m128(_mm_set1_ps(d * (float)(int8_t)sb[192 + 2 * j + 1]),
                                        _mm_set1_ps(d * (float)(int8_t)sb[192 + 2 * j]));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones)), sc, acc);
      continue;
    }
    const uint8_t* s = sb + 4;
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    const uint8_t* qs = sb + (qt == QT_Q4_K ? 16 : 48) + (j / 2) * 32;
    const __m256i q = _mm256_loadu_si256((const __m256i*)qs);
    __m256i w = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (j & 1))), m4);
    if (qt == QT_Q5_K) {
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(sb + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), one);
      w = _mm256_or_si256(w, _mm256_slli_epi16(bit, 4));
    }
    const __m256 s32 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones));
    acc = _mm256_fmadd_ps(s32, _mm256_set1_ps(f16(sb) * (float)sc * dx), acc);
    accm = std::fma(-f16(sb + 2) * (float)mn, dxs4, accm);
  }
  return hsum8(acc) + accm;
}

void rows(const QLinearArgs& a, const void* xp, int r0, int r1) {
  const int blocks = a.K / 32;
  const size_t tstride = (size_t)q8_group_count(a.K) * kQ8GroupBytes;
  const bool k = qtype_block_elems(a.qtype) == 256;
  for (int r = r0; r < r1; ++r)
    for (int t = 0; t < a.M; ++t) {
      const uint8_t* w = a.w + (size_t)r * a.row_bytes;
      const uint8_t* x = (const uint8_t*)xp + t * tstride;
      qlinear_store(a, t, r, k ? dot_row_k(a.qtype, w, x, blocks) : dot_row(a.qtype, w, x, blocks));
    }
}

}  // namespace

QLinearKernels qlinear_kernels_avx2_int8() { return {"avx2-int8", prep_bytes, prep, rows, true}; }

}  // namespace tandem_cpu
