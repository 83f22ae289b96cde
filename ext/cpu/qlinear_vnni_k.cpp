// AVX-512 VNNI kernel for the k-quants (Q4_K, Q5_K, Q6_K) on the int8 activations of
// qlinear_vnni.cpp (qlinear_int8.h's layout: a super-block of 256 values is two of its groups).
// The codes are decoded from the file's super-block layout in registers, the 6-bit (Q4_K,
// Q5_K) or int8 (Q6_K) sub-block scales applied per lane. Compiled with the VNNI flags.
#include <immintrin.h>

#include <cstring>

#include "qlinear.h"
#include "qlinear_int8.h"

namespace tandem_cpu {
namespace {

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Q4_K / Q5_K: the 12 scale bytes as sc[0..8) then m[0..8), 6 bits each (in registers: byte
// stores read back as a vector stalled store forwarding once per row and group).
inline __m128i scales_mins(const uint8_t* s) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
  const uint32_t sc_hi = (c & lo4) | (((a >> 6) & lo2) << 4);
  const uint32_t m_hi = ((c >> 4) & lo4) | (((b >> 6) & lo2) << 4);
  return _mm_set_epi32((int)m_hi, (int)(b & lo6), (int)sc_hi, (int)(a & lo6));
}

// Byte shuffles that spread 16 per-sub-block bytes over the 16 dword lanes of a group
// (lanes 4j..4j+3: the group's 32-block j). idx(f) gives lane 4j+l the byte f(j).
template <typename F>
inline __m128i spread(F f) {
  alignas(16) uint8_t c[16];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 4; ++l) c[4 * j + l] = (uint8_t)f(j);
  return _mm_load_si128((const __m128i*)c);
}

struct KConsts {
  __m128i sc[2], mn[2];     // Q4_K / Q5_K: group h's sub-block scale / min per lane
  __m128i s6lo[2], s6hi[2];  // Q6_K: group h's scale of the first / last 16 of each block
  __m512i qh_bit[2];         // Q5_K: group h's high-bit mask per byte (bit 4h + j in lane j)
  KConsts() {
    for (int h = 0; h < 2; ++h) {
      sc[h] = spread([h](int j) { return 4 * h + j; });
      mn[h] = spread([h](int j) { return 8 + 4 * h + j; });
      s6lo[h] = spread([h](int j) { return 8 * h + 2 * j; });
      s6hi[h] = spread([h](int j) { return 8 * h + 2 * j + 1; });
      alignas(64) uint8_t b[64];
      for (int i = 0; i < 64; ++i) b[i] = (uint8_t)(1u << (4 * h + i / 16));
      qh_bit[h] = _mm512_load_si512(b);
    }
  }
};

// One row's group h (values 128h..128h+127) of a super-block, decoded: u8 codes of its
// blocks' first and second 16 values (qlinear_int8.h's order) and their scales.
struct KGroup {
  __m512i q_lo, q_hi;
  __m512 d;           // Q4_K / Q5_K: d * sc per lane; Q6_K: d
  __m512 c;           // Q4_K / Q5_K: -dmin * m per lane
  __m512i s_lo, s_hi;  // Q6_K: int scales of the first / last 16 values per lane
};

template <int QT>
inline void read_group(const uint8_t* b, int h, const KConsts& kc, KGroup* g) {
  const __m512i m4 = _mm512_set1_epi8(15);
  if (QT == QT_Q6_K) {
    // 32-block j of the half: j = 0, 1: low nibbles of ql[0..32), ql[32..64); j = 2, 3: their
    // high nibbles; qh bits 2j, 2j + 1 on top; code - 32 is the value.
    const __m512i ql = _mm512_loadu_si512(b + 64 * h);
    const __m512i a = _mm512_shuffle_i64x2(ql, ql, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i c = _mm512_shuffle_i64x2(ql, ql, _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i shift = _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0);  // 2j per 128-bit lane j
    const __m512i sh16 = _mm512_or_si512(shift, _mm512_slli_epi64(shift, 16));
    const __m512i sh = _mm512_or_si512(sh16, _mm512_slli_epi64(sh16, 32));
    const __m512i m3 = _mm512_set1_epi8(3);
    const uint8_t* qh = b + 128 + 32 * h;
    const __m512i qh_lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)qh));
    const __m512i qh_hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(qh + 16)));
    const __m512i hb_lo = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh_lo, sh), m3), 4);
    const __m512i hb_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh_hi, sh), m3), 4);
    const __m512i n_lo = _mm512_mask_blend_epi64(
        0xF0, _mm512_and_si512(a, m4), _mm512_and_si512(_mm512_srli_epi16(a, 4), m4));
    const __m512i n_hi = _mm512_mask_blend_epi64(
        0xF0, _mm512_and_si512(c, m4), _mm512_and_si512(_mm512_srli_epi16(c, 4), m4));
    g->q_lo = _mm512_or_si512(n_lo, hb_lo);
    g->q_hi = _mm512_or_si512(n_hi, hb_hi);
    const __m128i s = _mm_loadu_si128((const __m128i*)(b + 192));
    g->s_lo = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(s, kc.s6lo[h]));
    g->s_hi = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(s, kc.s6hi[h]));
    g->d = _mm512_set1_ps(f16_at(b + 208));
    return;
  }
  // Q4_K / Q5_K: 64 values per 32 code bytes, low nibbles first; group h = qs[64h, 64h + 64).
  const uint8_t* qs = b + (QT == QT_Q4_K ? 16 : 48) + 64 * h;
  const __m512i q = _mm512_loadu_si512(qs);
  const __m512i a = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(2, 2, 0, 0));
  const __m512i c = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 3, 1, 1));
  g->q_lo = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(a, m4),
                                    _mm512_and_si512(_mm512_srli_epi16(a, 4), m4));
  g->q_hi = _mm512_mask_blend_epi64(0xCC, _mm512_and_si512(c, m4),
                                    _mm512_and_si512(_mm512_srli_epi16(c, 4), m4));
  if (QT == QT_Q5_K) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    const __m512i qh_lo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 16)));
    const __m512i qh_hi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(b + 32)));
    g->q_lo = _mm512_mask_add_epi8(g->q_lo, _mm512_test_epi8_mask(qh_lo, kc.qh_bit[h]), g->q_lo,
                                   sixteen);
    g->q_hi = _mm512_mask_add_epi8(g->q_hi, _mm512_test_epi8_mask(qh_hi, kc.qh_bit[h]), g->q_hi,
                                   sixteen);
  }
  const __m128i sm = scales_mins(b + 4);
  const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(sm, kc.sc[h])));
  const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(sm, kc.mn[h])));
  g->d = _mm512_mul_ps(_mm512_set1_ps(f16_at(b)), sc);
  g->c = _mm512_mul_ps(_mm512_set1_ps(-f16_at(b + 2)), mn);
}

constexpr int kPrefetchRows = 4;

// Rows [r, r + RT) against tokens [t0, t0 + NT), one accumulator per (row, token) in the same
// group order whatever RT and NT (a row's result does not depend on its batch).
template <int QT, int RT, int NT>
inline void tile(const QLinearArgs& a, const KConsts& kc, const uint8_t* X, int r, int t0) {
  const int groups = q8_group_count(a.K), supers = a.K / 256;
  const size_t tstride = (size_t)groups * kQ8GroupBytes, sbytes = qtype_block_bytes(QT);
  __m512 acc[RT][NT];
  for (int i = 0; i < RT; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const uint8_t* Xt = X + (size_t)t0 * tstride;
  const __m512i k32 = _mm512_set1_epi8(32);
  for (int s = 0; s < supers; ++s) {
    if (r + 2 * RT + kPrefetchRows <= a.N) {
      const uint8_t* ahead = a.w + (size_t)(r + RT + kPrefetchRows) * a.row_bytes + s * sbytes;
      for (int i = 0; i < RT; ++i)
        for (size_t off = 0; off < sbytes; off += 64)
          _mm_prefetch((const char*)(ahead + i * a.row_bytes + off), _MM_HINT_T0);
    }
    for (int h = 0; h < 2; ++h) {
      KGroup w[RT];
      for (int i = 0; i < RT; ++i)
        read_group<QT>(a.w + (size_t)(r + i) * a.row_bytes + s * sbytes, h, kc, &w[i]);
      for (int t = 0; t < NT; ++t) {
        const uint8_t* xg = Xt + t * tstride + (size_t)(2 * s + h) * kQ8GroupBytes;
        const __m512i x_lo = _mm512_load_si512(xg), x_hi = _mm512_load_si512(xg + 64);
        const __m512 dx = _mm512_load_ps((const float*)(xg + 128));
        if (QT == QT_Q6_K) {
          const __m512i o_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32, x_lo);
          const __m512i o_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32, x_hi);
          for (int i = 0; i < RT; ++i) {
            const __m512i p_lo = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i].q_lo, x_lo), o_lo);
            const __m512i p_hi = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i].q_hi, x_hi), o_hi);
            const __m512i p = _mm512_add_epi32(_mm512_mullo_epi32(p_lo, w[i].s_lo),
                                               _mm512_mullo_epi32(p_hi, w[i].s_hi));
            acc[i][t] =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w[i].d, dx), acc[i][t]);
          }
          continue;
        }
        const __m512 dxs = _mm512_load_ps((const float*)(xg + 192));
        for (int i = 0; i < RT; ++i) {
          __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[i].q_lo, x_lo);
          p = _mm512_dpbusd_epi32(p, w[i].q_hi, x_hi);
          acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(w[i].d, dx), acc[i][t]);
          acc[i][t] = _mm512_fmadd_ps(w[i].c, dxs, acc[i][t]);
        }
      }
    }
  }
  for (int i = 0; i < RT; ++i)
    for (int t = 0; t < NT; ++t) qlinear_store(a, t0 + t, r + i, _mm512_reduce_add_ps(acc[i][t]));
}

template <int QT>
void rows_of(const QLinearArgs& a, const uint8_t* X, int r0, int r1) {
  static const KConsts kc;
  if (a.M == 1) {  // decode: four rows share each activation load
    int r = r0;
    for (; r + 4 <= r1; r += 4) tile<QT, 4, 1>(a, kc, X, r, 0);
    for (; r < r1; ++r) tile<QT, 1, 1>(a, kc, X, r, 0);
    return;
  }
  for (int r = r0; r < r1; ++r) {
    int t0 = 0;
    for (; t0 + 8 <= a.M; t0 += 8) tile<QT, 1, 8>(a, kc, X, r, t0);
    for (; t0 + 4 <= a.M; t0 += 4) tile<QT, 1, 4>(a, kc, X, r, t0);
    const int rest = a.M - t0;
    if (rest == 3) tile<QT, 1, 3>(a, kc, X, r, t0);
    else if (rest == 2) tile<QT, 1, 2>(a, kc, X, r, t0);
    else if (rest == 1) tile<QT, 1, 1>(a, kc, X, r, t0);
  }
}

}  // namespace

void qlinear_vnni_k_rows(const QLinearArgs& a, const void* xp, int r0, int r1) {
  const uint8_t* X = (const uint8_t*)xp;
  if (a.qtype == QT_Q4_K) rows_of<QT_Q4_K>(a, X, r0, r1);
  else if (a.qtype == QT_Q5_K) rows_of<QT_Q5_K>(a, X, r0, r1);
  else rows_of<QT_Q6_K>(a, X, r0, r1);
}

}  // namespace tandem_cpu
