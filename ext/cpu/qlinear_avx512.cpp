// AVX-512 BF16 kernel for GGUF-packed weights: each 32-value chunk's codes become exact bf16
// (128 + code by an OR, a vpermt2w table, or int8 widened), vdpbf16ps against bf16 activations, scaled by
// the chunk's fp32 scale(s); mins multiply the chunk's activation sum. fp32 accumulation.
// Compiled with the AVX-512 flags; used only when CPUID says so.
#include <immintrin.h>

#include <cmath>

#include "qlinear.h"
#include "simd_avx512.h"

namespace tandem_cpu {
namespace {

struct Tables {
  __m512i s6_lo, s6_hi;  // bf16(i - 32), i < 64
};

inline float f16(const uint8_t* p) { return _cvtsh_ss(*(const uint16_t*)p); }

// 16 bytes -> u16 lanes: the low nibbles (values 0-15), then the high ones (16-31). The
// broadcast load and per-lane shift keep it to one cross-lane op (the widening).
inline __m512i nibbles16(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL,
                                         0x0004000400040004LL, 0x0004000400040004LL, 0, 0, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shift),
                          _mm512_set1_epi16(15));
}

// u16 codes 0-127 -> bf16 of 128 + code, exactly (exponent of 128, code as the mantissa): one
// OR instead of a table lookup; the 128 * scale it adds comes off through the chunk's min.
inline __m512bh biased_bf16(__m512i codes) {
  return (__m512bh)_mm512_or_si512(codes, _mm512_set1_epi16(0x4300));
}

// Each format: block(b, T, emit) calls emit(chunk in block, bf16 codes, scale, min) per 32
// values, value = code * scale + min (scale per dpbf16 lane: lanes 0-7 hold values 0-15).
template <int QT>
struct Fmt;

template <>
struct Fmt<QT_Q4_0> {
  static constexpr int kChunks = 1, kBytes = 18;
  static constexpr bool kMin = true;
  template <class F>
  static inline void block(const uint8_t* b, const Tables&, F&& emit) {
    const float d = f16(b);  // d * (q - 8) = d * (128 + q) - 136 * d
    emit(0, biased_bf16(nibbles16(b + 2)), _mm512_set1_ps(d), -136.f * d);
  }
};

template <>
struct Fmt<QT_Q4_1> {
  static constexpr int kChunks = 1, kBytes = 20;
  static constexpr bool kMin = true;
  template <class F>
  static inline void block(const uint8_t* b, const Tables&, F&& emit) {
    const float d = f16(b);  // d * q + m = d * (128 + q) + (m - 128 * d)
    emit(0, biased_bf16(nibbles16(b + 4)), _mm512_set1_ps(d), f16(b + 2) - 128.f * d);
  }
};

template <>
struct Fmt<QT_Q8_0> {
  static constexpr int kChunks = 1, kBytes = 34;
  static constexpr bool kMin = false;
  template <class F>
  static inline void block(const uint8_t* b, const Tables&, F&& emit) {
    emit(0, int8x32_to_bf16(b + 2), _mm512_set1_ps(f16(b)), 0.f);
  }
};

inline void k_scale_min(const uint8_t* s, int* sc, int* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

template <int QT>
struct FmtK45 {
  static constexpr int kChunks = 8, kBytes = QT == QT_Q4_K ? 144 : 176;
  static constexpr bool kMin = true;
  template <class F>
  static inline void block(const uint8_t* b, const Tables& T, F&& emit) {
    const float d = f16(b), dmin = f16(b + 2);
    int sc[8], mn[8];
    k_scale_min(b + 4, sc, mn);
    const uint8_t* qs = b + (QT == QT_Q4_K ? 16 : 48);
    __m512i qh;
    if (QT == QT_Q5_K) qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 16)));
    const __m512i m4 = _mm512_set1_epi16(15), one = _mm512_set1_epi16(1);
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qs + p * 32)));
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        __m512i q = h ? _mm512_srli_epi16(v, 4) : _mm512_and_si512(v, m4);
        if (QT == QT_Q5_K)
          q = _mm512_or_si512(
              q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, j), one), 4));
        const float ds = d * (float)sc[j];
        emit(j, biased_bf16(q), _mm512_set1_ps(ds), -(dmin * (float)mn[j]) - 128.f * ds);
      }
    }
  }
};

template <>
struct Fmt<QT_Q4_K> : FmtK45<QT_Q4_K> {};
template <>
struct Fmt<QT_Q5_K> : FmtK45<QT_Q5_K> {};

template <>
struct Fmt<QT_Q6_K> {
  static constexpr int kChunks = 8, kBytes = 210;
  static constexpr bool kMin = false;
  template <class F>
  static inline void block(const uint8_t* b, const Tables& T, F&& emit) {
    const float d = f16(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
    const __m512i m4 = _mm512_set1_epi16(15), m3 = _mm512_set1_epi16(3);
    for (int h = 0; h < 2; ++h) {
      const __m512i qh =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(b + 128 + h * 32)));
      for (int half = 0; half < 2; ++half) {
        const __m512i ql = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256((const __m256i*)(b + h * 64 + half * 32)));
        for (int nib = 0; nib < 2; ++nib) {
          const int g = nib * 2 + half, j = h * 4 + g;
          const __m512i lo = nib ? _mm512_srli_epi16(ql, 4) : _mm512_and_si512(ql, m4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * g), m3);
          const __m512i q = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
          const __m512 s = _mm512_mask_blend_ps((__mmask16)0xFF00,
                                                _mm512_set1_ps(d * (float)sc[2 * j]),
                                                _mm512_set1_ps(d * (float)sc[2 * j + 1]));
          emit(j, (__m512bh)_mm512_permutex2var_epi16(T.s6_lo, q, T.s6_hi), s, 0.f);
        }
      }
    }
  }
};

size_t prep_bytes(int K, int M) { return (size_t)M * K * 2 + (size_t)M * (K / 32) * 4 + 64; }

void prep(const void* x, bool x_bf16, int M, int K, void* dst) {
  uint16_t* d = (uint16_t*)dst;
  float* sums = (float*)(d + (size_t)M * K);
  for (int t = 0; t < M; ++t) {
    uint16_t* dt = d + (size_t)t * K;
    for (int k = 0; k < K; k += 16) {
      if (x_bf16) {
        _mm256_storeu_si256((__m256i*)(dt + k),
                            _mm256_loadu_si256((const __m256i*)((const uint16_t*)x +
                                                                (size_t)t * K + k)));
      } else {
        const __m512 v = _mm512_loadu_ps((const float*)x + (size_t)t * K + k);
        _mm256_storeu_si256((__m256i*)(dt + k), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
    for (int c = 0; c < K / 32; ++c) {  // sums of the bf16 values the products use
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(dt + c * 32)));
      const __m512i w =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(dt + c * 32 + 16)));
      const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      sums[(size_t)t * (K / 32) + c] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
  }
}

// Row decoders: chunks(r, emit) calls emit(c, bf16 codes, scale, min) for every 32-value chunk
// c of weight row r, in order (value = code * scale + min, as Fmt's blocks).
template <int QT>
struct GgufRows {
  using F = Fmt<QT>;
  static constexpr bool kMin = F::kMin;
  const QLinearArgs& a;
  const Tables& T;
  template <class E>
  inline void chunks(int r, E&& emit) const {
    const uint8_t* row = a.w + (size_t)r * a.row_bytes;
    const int blocks = a.K / (F::kChunks * 32);
    for (int i = 0; i < blocks; ++i)
      F::block(row + (size_t)i * F::kBytes, T, [&](int j, __m512bh wv, __m512 sc, float mn) {
        emit(i * F::kChunks + j, wv, sc, mn);
      });
  }
};

// GPTQ/AWQ int4 (models/quant/int4.py): Q4_0's nibble order, an fp16 scale and a uint8 zero
// point per group; s * (q - z) = s * (128 + q) - s * (128 + z).
struct Int4GroupRows {
  static constexpr bool kMin = true;
  const QLinearArgs& a;
  template <class E>
  inline void chunks(int r, E&& emit) const {
    const uint8_t* row = a.w + (size_t)r * a.row_bytes;
    const int groups = a.K / a.group, per = a.group / 32;
    const uint8_t* sc = (const uint8_t*)a.scales + (size_t)r * groups * 2;
    const uint8_t* zp = a.zeros + (size_t)r * groups;
    for (int g = 0; g < groups; ++g) {
      const float d = f16(sc + 2 * g);
      const __m512 dv = _mm512_set1_ps(d);
      const float mn = -d * (128.f + (float)zp[g]);
      for (int j = 0; j < per; ++j) {
        const int c = g * per + j;
        emit(c, biased_bf16(nibbles16(row + (size_t)c * 16)), dv, mn);
      }
    }
  }
};

// 32 e4m3 bytes -> their exact bf16: normals by moving the exponent and mantissa bits into
// place (bias 7 -> 127), the 8 subnormal magnitudes from a table.
inline __m512bh e4m3x32_to_bf16(const uint8_t* p, __m512i subnormals) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 small = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i sub = _mm512_permutexvar_epi16(mag, subnormals);
  return (__m512bh)_mm512_or_si512(_mm512_mask_blend_epi16(small, normal, sub), sign);
}

// FP8 e4m3 (models/quant/fp8.py): fp32 scale per block_rows x block_cols (block_cols a
// multiple of 32, so a chunk never straddles two scales).
struct Fp8Rows {
  static constexpr bool kMin = false;
  const QLinearArgs& a;
  __m512i subnormals;
  template <class E>
  inline void chunks(int r, E&& emit) const {
    const uint8_t* row = a.w + (size_t)r * a.row_bytes;
    const float* sc = (const float*)a.scales + (size_t)(r / a.block_rows) * a.scale_cols;
    const int chunks = a.K / 32, per = a.block_cols / 32;
    for (int c = 0; c < chunks; ++c)
      emit(c, e4m3x32_to_bf16(row + (size_t)c * 32, subnormals), _mm512_set1_ps(sc[c / per]),
           0.f);
  }
};

// One weight row against tokens [t0, t0 + NT). Per token: two vector accumulators taking the
// chunks alternately, one scalar accumulator for the mins; the same order for every NT.
template <class D, int NT>
inline void row_tile(const QLinearArgs& a, const D& dec, const uint16_t* X, const float* S,
                     int r, int t0) {
  const int K = a.K, chunks = K / 32;
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[2][NT];
  float accm[NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = zero, accm[t] = 0.f;
  const uint16_t* Xt = X + (size_t)t0 * K;
  const float* St = S + (size_t)t0 * chunks;
  dec.chunks(r, [&](int c, __m512bh wv, __m512 s, float mn) {
    for (int t = 0; t < NT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(Xt + (size_t)t * K + c * 32));
      acc[c & 1][t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, wv, xv), s, acc[c & 1][t]);
      if (D::kMin) accm[t] = std::fma(mn, St[(size_t)t * chunks + c], accm[t]);
    }
  });
  for (int t = 0; t < NT; ++t)
    qlinear_store(a, t0 + t, r, _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t])) + accm[t]);
}

template <class D>
void rows_of(const QLinearArgs& a, const D& dec, const uint16_t* X, const float* S, int r0,
             int r1) {
  for (int r = r0; r < r1; ++r) {
    int t0 = 0;
    for (; t0 + 4 <= a.M; t0 += 4) row_tile<D, 4>(a, dec, X, S, r, t0);
    const int rest = a.M - t0;
    if (rest == 3) row_tile<D, 3>(a, dec, X, S, r, t0);
    else if (rest == 2) row_tile<D, 2>(a, dec, X, S, r, t0);
    else if (rest == 1) row_tile<D, 1>(a, dec, X, S, r, t0);
  }
}

template <int QT>
void rows_qt(const QLinearArgs& a, const uint16_t* X, const float* S, int r0, int r1,
             const Tables& T) {
  rows_of(a, GgufRows<QT>{a, T}, X, S, r0, r1);
}

void rows(const QLinearArgs& a, const void* xp, int r0, int r1) {
  alignas(64) uint16_t s6[64];
  for (int i = 0; i < 64; ++i) s6[i] = f32_to_bf16((float)(i - 32));
  Tables T;
  T.s6_lo = _mm512_load_si512((const void*)s6);
  T.s6_hi = _mm512_load_si512((const void*)(s6 + 32));
  const uint16_t* X = (const uint16_t*)xp;
  const float* S = (const float*)(X + (size_t)a.M * a.K);
  switch (a.qtype) {
    case QT_Q4_0: rows_qt<QT_Q4_0>(a, X, S, r0, r1, T); break;
    case QT_Q4_1: rows_qt<QT_Q4_1>(a, X, S, r0, r1, T); break;
    case QT_Q8_0: rows_qt<QT_Q8_0>(a, X, S, r0, r1, T); break;
    case QT_Q4_K: rows_qt<QT_Q4_K>(a, X, S, r0, r1, T); break;
    case QT_Q5_K: rows_qt<QT_Q5_K>(a, X, S, r0, r1, T); break;
    case QT_Q6_K: rows_qt<QT_Q6_K>(a, X, S, r0, r1, T); break;
    case QT_INT4G: rows_of(a, Int4GroupRows{a}, X, S, r0, r1); break;
    case QT_FP8: {
      alignas(64) uint16_t sub[32] = {};
      for (int i = 0; i < 8; ++i) sub[i] = f32_to_bf16(std::ldexp((float)i, -9));
      rows_of(a, Fp8Rows{a, _mm512_load_si512((const void*)sub)}, X, S, r0, r1);
      break;
    }
  }
}

}  // namespace

QLinearKernels qlinear_kernels_avx512() { return {"avx512", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
