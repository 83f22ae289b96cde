// AVX-512 VNNI kernel for Q4_0 / Q4_1 / Q8_0 weights (the k-quants: qlinear_vnni_k.cpp) with
// int8 activations: each token's row is quantized per 32 values to int8 (simd_q8.h: scale
// absmax / 127), and a weight block's dot product is one pair of vpdpbusd, scaled once per
// block. Four blocks are decoded together with two word permutes straight from the file's
// block layout (no repacking).
// Compiled with the VNNI flags; used only when CPUID says so.
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "qlinear.h"
#include "qlinear_int8.h"
#include "simd_q8.h"

namespace tandem_cpu {
namespace {

// A non-finite activation makes its block's scale NaN, so the outputs it reaches are NaN (as
// with float activations) rather than a silently wrong number.
inline bool all_finite(const float* v) {
  const __m512 z = _mm512_setzero_ps();  // x * 0 is NaN exactly for NaN and inf
  const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(v), z),
                                 _mm512_mul_ps(_mm512_loadu_ps(v + 16), z));
  return _mm512_reduce_add_ps(t) == 0.f;
}

size_t prep_bytes(int K, int M) { return (size_t)M * q8_group_count(K) * kQ8GroupBytes + 64; }

void prep(const void* x, bool x_bf16, int M, int K, void* dst) {
  const int blocks = K / 32, groups = q8_group_count(K);
  alignas(64) float row[32];
  for (int t = 0; t < M; ++t) {
    uint8_t* base = (uint8_t*)dst + (size_t)t * groups * kQ8GroupBytes;
    std::memset(base, 0, (size_t)groups * kQ8GroupBytes);
    for (int b = 0; b < blocks; ++b) {
      const float* src;
      if (x_bf16) {
        const uint16_t* s = (const uint16_t*)x + (size_t)t * K + b * 32;
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + 16 * h)));
          _mm512_store_ps(row + 16 * h, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
        src = row;
      } else {
        src = (const float*)x + (size_t)t * K + b * 32;
      }
      uint8_t* g = base + (size_t)(b / 4) * kQ8GroupBytes;
      const int j = b % 4;
      int8_t q[32];
      float scale;
      int32_t sum;
      float* dx = (float*)(g + 128);
      float* dxs = dx + 16;
      if (!all_finite(src)) {
        for (int l = 0; l < 4; ++l) dx[4 * j + l] = dxs[4 * j + l] = NAN;
        continue;
      }
      if (!q8_block32(src, 32, q, &scale, &sum)) continue;  // all zero: the memset's zeros
      std::memcpy(g + j * 16, q, 16);
      std::memcpy(g + 64 + j * 16, q + 16, 16);
      for (int l = 0; l < 4; ++l) dx[4 * j + l] = scale, dxs[4 * j + l] = scale * (float)sum * 0.25f;
    }
  }
}

inline __mmask32 first_words(int n) {
  return n >= 32 ? ~(__mmask32)0 : n <= 0 ? (__mmask32)0 : ((__mmask32)1 << n) - 1;
}

// Load masks of a group's two 64-byte windows (and Q8_0's two windows 8 bytes later), from
// the group's valid bytes: every byte of a full group, fewer in a last, partial one.
struct GroupMasks {
  __mmask32 m0, m1, h0, h1;
  GroupMasks(int valid, int hi_offset) {
    m0 = first_words(valid / 2);
    m1 = first_words(valid / 2 - 32);
    h0 = first_words((valid - hi_offset) / 2);
    h1 = first_words((valid - hi_offset) / 2 - 32);
  }
};

// How a type's group of 4 blocks is read: two windows of 64 bytes, permuted by words into the
// codes of the blocks' first and second 16 values and into their scales.
struct GroupReader {
  int qtype = 0, block_bytes = 0, blocks = 0, full_groups = 0;
  __m512i perm_lo, perm_hi, perm_sc;  // word indices into [window 0 | window 1]
  int hi_offset = 0;                  // Q8_0: the second halves come from windows 8 bytes on
  float corr = 0.f;                   // Q4_0: -8, Q8_0: -128 (per unit of d)
  GroupMasks full, tail;

  GroupReader(int qt, int K)
      : qtype(qt), block_bytes(qtype_block_bytes(qt)), blocks(K / 32), full_groups(K / 128),
        hi_offset(qt == QT_Q8_0 ? 8 : 0),
        corr(qt == QT_Q4_0 ? -8.f : qt == QT_Q8_0 ? -128.f : 0.f),
        full(4 * qtype_block_bytes(qt), qt == QT_Q8_0 ? 8 : 0),
        tail((K / 32 % 4) * qtype_block_bytes(qt), qt == QT_Q8_0 ? 8 : 0) {
    alignas(64) uint16_t lo[32], hi[32], sc[32];
    const int qs = qt == QT_Q4_1 ? 4 : 2;
    for (int j = 0; j < 4; ++j) {
      const int b = j * block_bytes;
      for (int w = 0; w < 8; ++w) {
        lo[j * 8 + w] = (uint16_t)((b + qs) / 2 + w);
        hi[j * 8 + w] = (uint16_t)(qt == QT_Q8_0 ? (b + qs + 16 - hi_offset) / 2 + w : 0);
      }
      for (int l = 0; l < 4; ++l) {
        sc[4 * j + l] = (uint16_t)(b / 2);                                // d
        sc[16 + 4 * j + l] = (uint16_t)(qt == QT_Q4_1 ? b / 2 + 1 : 0);  // Q4_1's m
      }
    }
    perm_lo = _mm512_load_si512(lo);
    perm_hi = _mm512_load_si512(hi);
    perm_sc = _mm512_load_si512(sc);
  }

  // A group's weights: u8 codes of its blocks' first and second 16 values, the per-lane
  // scale d and the per-lane coefficient of dx * sum(q) / 4 (Q4_1: m; else corr * d).
  inline void read(const uint8_t* p, const GroupMasks& k, __m512i* q_lo, __m512i* q_hi,
                   __m512* d, __m512* c) const {
    const __m512i w0 = _mm512_maskz_loadu_epi16(k.m0, p);
    const __m512i w1 = _mm512_maskz_loadu_epi16(k.m1, p + 64);
    const __m512i scw = _mm512_permutex2var_epi16(w0, perm_sc, w1);
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(scw));
    if (qtype == QT_Q8_0) {
      const __m512i flip = _mm512_set1_epi8((char)0x80);  // s8 -> u8 = s8 + 128
      const __m512i v0 = _mm512_maskz_loadu_epi16(k.h0, p + hi_offset);
      const __m512i v1 = _mm512_maskz_loadu_epi16(k.h1, p + hi_offset + 64);
      *q_lo = _mm512_xor_si512(_mm512_permutex2var_epi16(w0, perm_lo, w1), flip);
      *q_hi = _mm512_xor_si512(_mm512_permutex2var_epi16(v0, perm_hi, v1), flip);
      *c = _mm512_mul_ps(*d, _mm512_set1_ps(corr));
      return;
    }
    const __m512i qs = _mm512_permutex2var_epi16(w0, perm_lo, w1);
    const __m512i m4 = _mm512_set1_epi8(15);
    *q_lo = _mm512_and_si512(qs, m4);
    *q_hi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), m4);
    *c = qtype == QT_Q4_1 ? _mm512_cvtph_ps(_mm512_extracti64x4_epi64(scw, 1))
                          : _mm512_mul_ps(*d, _mm512_set1_ps(corr));
  }
};

// Software prefetch of the rows this many past the tile: the hardware prefetchers alone left
// a single thread reading weights at half its stream rate.
constexpr int kPrefetchRows = 4;

// Rows [r, r + RT) against tokens [t0, t0 + NT): one accumulator per (row, token) taking each
// group's scaled integer sum, then its min / offset term; the same order whatever RT and NT.
template <int RT, int NT>
inline void tile(const QLinearArgs& a, const GroupReader& R, const uint8_t* X, int r, int t0) {
  const int groups = q8_group_count(a.K);
  const size_t tstride = (size_t)groups * kQ8GroupBytes, gbytes = (size_t)4 * R.block_bytes;
  __m512 acc[RT][NT];
  for (int i = 0; i < RT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const uint8_t* Xt = X + (size_t)t0 * tstride;
  for (int g = 0; g < groups; ++g) {
    const GroupMasks& k = g < R.full_groups ? R.full : R.tail;
    if (r + 2 * RT + kPrefetchRows <= a.N) {
      const uint8_t* ahead = a.w + (size_t)(r + RT + kPrefetchRows) * a.row_bytes + g * gbytes;
      for (int i = 0; i < RT; ++i)
        for (size_t off = 0; off < gbytes; off += 64)
          _mm_prefetch((const char*)(ahead + i * a.row_bytes + off), _MM_HINT_T0);
    }
    __m512i q_lo[RT], q_hi[RT];
    __m512 d[RT], c[RT];
    for (int i = 0; i < RT; ++i)
      R.read(a.w + (size_t)(r + i) * a.row_bytes + g * gbytes, k, &q_lo[i], &q_hi[i], &d[i], &c[i]);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* xg = Xt + t * tstride + (size_t)g * kQ8GroupBytes;
      const __m512i x_lo = _mm512_load_si512(xg), x_hi = _mm512_load_si512(xg + 64);
      const __m512 dx = _mm512_load_ps((const float*)(xg + 128));
      const __m512 dxs = _mm512_load_ps((const float*)(xg + 192));
      for (int i = 0; i < RT; ++i) {
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q_lo[i], x_lo);
        s = _mm512_dpbusd_epi32(s, q_hi[i], x_hi);
        acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d[i], dx), acc[i][t]);
        acc[i][t] = _mm512_fmadd_ps(c[i], dxs, acc[i][t]);
      }
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int t = 0; t < NT; ++t) qlinear_store(a, t0 + t, r + i, _mm512_reduce_add_ps(acc[i][t]));
}

void rows(const QLinearArgs& a, const void* xp, int r0, int r1) {
  if (qtype_block_elems(a.qtype) == 256) return qlinear_vnni_k_rows(a, xp, r0, r1);
  const GroupReader R(a.qtype, a.K);
  const uint8_t* X = (const uint8_t*)xp;
  if (a.M == 1) {  // decode: four rows share each activation load
    int r = r0;
    for (; r + 4 <= r1; r += 4) tile<4, 1>(a, R, X, r, 0);
    for (; r < r1; ++r) tile<1, 1>(a, R, X, r, 0);
    return;
  }
  for (int r = r0; r < r1; ++r) {
    int t0 = 0;
    for (; t0 + 8 <= a.M; t0 += 8) tile<1, 8>(a, R, X, r, t0);  // a row decoded once per 8
    for (; t0 + 4 <= a.M; t0 += 4) tile<1, 4>(a, R, X, r, t0);
    const int rest = a.M - t0;
    if (rest == 3) tile<1, 3>(a, R, X, r, t0);
    else if (rest == 2) tile<1, 2>(a, R, X, r, t0);
    else if (rest == 1) tile<1, 1>(a, R, X, r, t0);
  }
}

}  // namespace

QLinearKernels qlinear_kernels_vnni() { return {"vnni", prep_bytes, prep, rows, true}; }

}  // namespace tandem_cpu
