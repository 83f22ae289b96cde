// The integer path on AVX-512 VNNI: int8/int4 weights times int8 activations with vpdpbusd
// (64 multiply-adds per instruction, int32 sums), no widening of weights to floats.
//
// Layout (kernels.h: kQBlock, kQSuper). K is cut into super-blocks of 16 blocks of 32; in a
// super-block, 64-byte vector j holds in int32 lane l the 4 elements [32 l + 4 j, 32 l + 4 j + 4)
// of block l. Eight vpdpbusd then leave in lane l the dot product of block l alone, so one
// vcvtdq2ps and one FMA with a vector of 16 per-block scales (activation block scale times int4
// group scale) serve 16 blocks. A last partial super-block is padded with zero blocks.
//   Activations (prep, per token): s8 q [Ksb] in that layout, fp32 scales [Ksb / 32] and int32
//   block sums of q [Ksb / 32].
//   Weights (gemm, per 4 rows into scratch): u8 in that layout. vpdpbusd multiplies u8 by s8,
//   so weights are made unsigned: int4 keeps its nibble n = q + 8, int8 stores q + 128; the
//   offset comes back out through the block sums: sum (n - o) x = sum n x - o * sum x.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni (no BF16): used only when CPUID
// reports AVX512-VNNI (isa.cpp).
#include <immintrin.h>

#include "kernels.h"
#include "simd_q8.h"

namespace tandem_cpu {
namespace {

constexpr int kTileRows = 4;

struct QLayout {  // one token's prepared activations
  int Ksb, nb, nsb;
  explicit QLayout(int K) : Ksb(qsuper_pad(K)), nb(qsuper_pad(K) / kQBlock), nsb(qsuper_pad(K) / kQSuper) {}
  size_t token_bytes() const { return (size_t)Ksb + (size_t)nb * 8; }
};

// Index vectors of the 3-stage transpose of a super-block (see transpose16x8).
struct TransposeIdx {
  __m512i s1[2], s2[2], s3[2];
  TransposeIdx() {
    alignas(64) int32_t v[6][16];
    for (int L = 0; L < 16; ++L) {
      for (int q = 0; q < 2; ++q) v[q][L] = (L / 8) * 16 + ((L / 4) % 2) * 8 + 4 * q + L % 4;
      for (int h = 0; h < 2; ++h) v[2 + h][L] = (L / 8) * 16 + ((L / 2) % 4) * 4 + 2 * h + L % 2;
      for (int h = 0; h < 2; ++h) v[4 + h][L] = (L / 8) * 16 + (L % 8) * 2 + h;
    }
    for (int i = 0; i < 2; ++i) {
      s1[i] = _mm512_load_si512(v[i]);
      s2[i] = _mm512_load_si512(v[2 + i]);
      s3[i] = _mm512_load_si512(v[4 + i]);
    }
    // Each round maps a pair of vectors (X, Y) to (perm(X, f0, Y), perm(X, f1, Y)), a bijection
    // of their 32 lanes; the inverse round takes lane L of X (Y) back from where it went.
    alignas(64) int32_t u[6][16];
    for (int r = 0; r < 3; ++r)
      for (int w = 0; w < 2; ++w)
        for (int L = 0; L < 16; ++L) {
          const int src = v[2 * r + w][L];
          u[2 * r + src / 16][src % 16] = 16 * w + L;
        }
    for (int i = 0; i < 2; ++i) {
      t1[i] = _mm512_load_si512(u[i]);
      t2[i] = _mm512_load_si512(u[2 + i]);
      t3[i] = _mm512_load_si512(u[4 + i]);
    }
  }
  __m512i t1[2], t2[2], t3[2];  // the inverse rounds
};

// A[i] holds blocks 2i (lanes 0-7) and 2i + 1 (lanes 8-15) as 8 dwords each, in order; out[j]
// gets dword j of block l in lane l. A 16 x 8 dword transpose in three rounds of vpermt2d:
// 4 blocks x 4 dwords, then 8 blocks x 2 dwords, then 16 blocks x 1 dword per vector.
inline void transpose16x8(const __m512i* A, __m512i* out, const TransposeIdx& ix) {
  __m512i B[8], C[8];
  for (int i = 0; i < 8; ++i) B[i] = _mm512_permutex2var_epi32(A[i & ~1], ix.s1[i & 1], A[i | 1]);
  for (int i = 0; i < 8; ++i) {
    const int r = i / 4, s = i % 4;
    C[i] = _mm512_permutex2var_epi32(B[4 * r + s / 2], ix.s2[s & 1], B[4 * r + 2 + s / 2]);
  }
  for (int j = 0; j < 8; ++j)
    out[j] = _mm512_permutex2var_epi32(C[j / 2], ix.s3[j & 1], C[4 + j / 2]);
}

// The inverse of transpose16x8: out[j] (dword j of block l in lane l) back to A[i] (blocks 2i
// and 2i + 1, 8 dwords each, in order).
inline void untranspose16x8(const __m512i* O, __m512i* A, const TransposeIdx& ix) {
  __m512i B[8], C[8];
  for (int h = 0; h < 4; ++h) {
    C[h] = _mm512_permutex2var_epi32(O[2 * h], ix.t3[0], O[2 * h + 1]);
    C[4 + h] = _mm512_permutex2var_epi32(O[2 * h], ix.t3[1], O[2 * h + 1]);
  }
  for (int r = 0; r < 2; ++r)
    for (int h = 0; h < 2; ++h) {
      B[4 * r + h] = _mm512_permutex2var_epi32(C[4 * r + 2 * h], ix.t2[0], C[4 * r + 2 * h + 1]);
      B[4 * r + 2 + h] = _mm512_permutex2var_epi32(C[4 * r + 2 * h], ix.t2[1], C[4 * r + 2 * h + 1]);
    }
  for (int p = 0; p < 4; ++p) {
    A[2 * p] = _mm512_permutex2var_epi32(B[2 * p], ix.t1[0], B[2 * p + 1]);
    A[2 * p + 1] = _mm512_permutex2var_epi32(B[2 * p], ix.t1[1], B[2 * p + 1]);
  }
}

// Super-block s of a packed row (kernels.h: packed_at) as the 8 vectors the kernel multiplies:
// O[j] lane l = elements [32 l + 4 j, +4) of block l as u8 (int8 stays signed here; lanes of
// blocks past the row's end are zero).
inline void load_packed(const uint8_t* row, int fmt, int K, int s, __m512i* O) {
  const int m = packed_blocks(K, s);
  const __mmask16 mask = q8_first_n(m);
  if (fmt == FMT_INT8) {
    const uint8_t* p = row + (size_t)s * kQSuper;
    for (int j = 0; j < 8; ++j) O[j] = _mm512_maskz_loadu_epi32(mask, p + (size_t)j * 4 * m);
  } else {
    const uint8_t* p = row + (size_t)s * (kQSuper / 2);
    const __m512i m15 = _mm512_set1_epi8(15);
    for (int u = 0; u < 4; ++u) {
      const __m512i v = _mm512_maskz_loadu_epi32(mask, p + (size_t)u * 4 * m);
      O[u] = _mm512_and_si512(v, m15);
      O[u + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
    }
  }
}

// Rows [r0, r0 + kTileRows) of w as u8 in the VNNI layout: dst[r][Ksb]; int4 block scales into
// ws[r][nb] (zero past K).
void pack_rows(const WeightView& w, int r0, int K, const QLayout& q, const TransposeIdx& ix,
               uint8_t* dst, float* ws) {
  const int chunks = K / 64;  // valid 64-element chunks (block pairs)
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const __m256i m15 = _mm256_set1_epi8(15);
  for (int r = 0; r < kTileRows; ++r) {
    const uint8_t* row = w.data + (size_t)(r0 + r) * w.row_bytes;
    uint8_t* d = dst + (size_t)r * q.Ksb;
    for (int s = 0; s < q.nsb; ++s) {
      __m512i A[8], O[8];
      for (int i = 0; i < 8; ++i) {
        const int c = s * 8 + i;
        if (c >= chunks) {
          A[i] = _mm512_setzero_si512();
        } else if (w.fmt == FMT_INT8) {
          A[i] = _mm512_loadu_si512((const void*)(row + (size_t)c * 64));
        } else {  // low nibbles are elements 0-31 of the chunk, high nibbles 32-63
          const __m256i b = _mm256_loadu_si256((const __m256i*)(row + (size_t)c * 32));
          A[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(b, m15)),
                                    _mm256_and_si256(_mm256_srli_epi16(b, 4), m15), 1);
        }
      }
      transpose16x8(A, O, ix);
      for (int j = 0; j < 8; ++j) {
        const __m512i v = w.fmt == FMT_INT8 ? _mm512_xor_si512(O[j], flip) : O[j];
        _mm512_store_si512((void*)(d + (size_t)s * kQSuper + j * 64), v);
      }
    }
    if (w.fmt == FMT_INT4) {  // block scales: group 32 as stored, group 64 each one twice
      const int groups = K / w.group;
      const float* s = w.scales + (size_t)(r0 + r) * groups;
      float* o = ws + (size_t)r * q.nb;
      const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
      for (int sb = 0; sb < q.nsb; ++sb) {
        __m512 v;
        if (w.group == kQBlock) {
          v = _mm512_maskz_loadu_ps(q8_first_n(groups - sb * 16), s + sb * 16);
        } else {
          v = _mm512_maskz_loadu_ps(q8_first_n(groups - sb * 8), s + sb * 8);
          v = _mm512_permutexvar_ps(twice, v);
        }
        _mm512_storeu_ps(o + sb * 16, v);
      }
    }
  }
}

// NT tokens' prepared activations (vnni_prep): s8 values, block scales, block sums.
template <int NT>
struct Tokens {
  const int8_t* q[NT];
  const float* scale[NT];
  const int32_t* sum[NT];
  Tokens(const uint8_t* X, const QLayout& l) {
    for (int t = 0; t < NT; ++t) {
      const uint8_t* base = X + t * l.token_bytes();
      q[t] = (const int8_t*)base;
      scale[t] = (const float*)(base + l.Ksb);
      sum[t] = (const int32_t*)(base + l.Ksb) + l.nb;
    }
  }
};

// kTileRows rows packed into scratch (pack_rows) against NT tokens.
template <int NT, bool INT4>
void qtile(const uint8_t* Wq, const float* ws, const QLayout& q, const uint8_t* X, int r0,
           const float* rowscale, float* C, int ldc) {
  const Tokens<NT> tok(X, q);
  const int8_t* const* xq = tok.q;
  const float* const* xs = tok.scale;
  const int32_t* const* xsum = tok.sum;
  __m512 facc[kTileRows][NT];
  for (int r = 0; r < kTileRows; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  for (int s = 0; s < q.nsb; ++s) {
    __m512i acc[kTileRows][NT];
    for (int t = 0; t < NT; ++t) {
      // - offset * (sum of the block's activations): int4 nibbles carry +8, int8 +128.
      const __m512i sum = _mm512_loadu_si512((const void*)(xsum[t] + s * 16));
      const __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, INT4 ? 3 : 7));
      for (int r = 0; r < kTileRows; ++r) acc[r][t] = corr;
    }
    for (int j = 0; j < 8; ++j) {
      __m512i xv[NT];
      for (int t = 0; t < NT; ++t)
        xv[t] = _mm512_loadu_si512((const void*)(xq[t] + (size_t)s * kQSuper + j * 64));
      for (int r = 0; r < kTileRows; ++r) {
        const __m512i wv = _mm512_load_si512((const void*)(Wq + (size_t)r * q.Ksb + s * kQSuper + j * 64));
        for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv, xv[t]);
      }
    }
    __m512 xsv[NT];
    for (int t = 0; t < NT; ++t) xsv[t] = _mm512_loadu_ps(xs[t] + s * 16);
    for (int r = 0; r < kTileRows; ++r) {
      __m512 wsv = _mm512_setzero_ps();
      if (INT4) wsv = _mm512_loadu_ps(ws + (size_t)r * q.nb + s * 16);
      for (int t = 0; t < NT; ++t) {
        const __m512 sc = INT4 ? _mm512_mul_ps(xsv[t], wsv) : xsv[t];
        facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), sc, facc[r][t]);
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    const float scale = rowscale ? rowscale[r0 + r] : 1.f;
    for (int t = 0; t < NT; ++t)
      C[(size_t)t * ldc + r0 + r] = _mm512_reduce_add_ps(facc[r][t]) * scale;
  }
}

// The 16 block scales of int4 row `sr` (K / group of them) in super-block s, zero past K.
inline __m512 int4_block_scales(const float* sr, int groups, int group, int s) {
  if (group == kQBlock) return _mm512_maskz_loadu_ps(q8_first_n(groups - s * 16), sr + s * 16);
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  return _mm512_permutexvar_ps(twice, _mm512_maskz_loadu_ps(q8_first_n(groups - s * 8), sr + s * 8));
}

// kTileRows packed rows (read in place) against NT tokens.
template <int NT, bool INT4>
void qtile_packed(const WeightView& w, int r0, int K, const QLayout& q, const uint8_t* X,
                  float* C, int ldc) {
  const Tokens<NT> tok(X, q);
  const int8_t* const* xq = tok.q;
  const float* const* xs = tok.scale;
  const int32_t* const* xsum = tok.sum;
  const uint8_t* row[kTileRows];
  for (int r = 0; r < kTileRows; ++r) row[r] = w.data + (size_t)(r0 + r) * w.row_bytes;
  const int groups = INT4 ? K / w.group : 0;
  const __m512i flip = _mm512_set1_epi8((char)0x80), m15 = _mm512_set1_epi8(15);
  __m512 facc[kTileRows][NT];
  for (int r = 0; r < kTileRows; ++r)
    for (int t = 0; t < NT; ++t) facc[r][t] = _mm512_setzero_ps();
  for (int s = 0; s < q.nsb; ++s) {
    const int m = packed_blocks(K, s);
    const __mmask16 mask = q8_first_n(m);
    const size_t run = (size_t)4 * m;
    __m512i acc[kTileRows][NT];
    for (int t = 0; t < NT; ++t) {
      const __m512i sum = _mm512_loadu_si512((const void*)(xsum[t] + s * 16));
      const __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, INT4 ? 3 : 7));
      for (int r = 0; r < kTileRows; ++r) acc[r][t] = corr;
    }
    if (INT4) {
      for (int u = 0; u < 4; ++u) {
        __m512i xlo[NT], xhi[NT];
        for (int t = 0; t < NT; ++t) {
          xlo[t] = _mm512_loadu_si512((const void*)(xq[t] + (size_t)s * kQSuper + u * 64));
          xhi[t] = _mm512_loadu_si512((const void*)(xq[t] + (size_t)s * kQSuper + (u + 4) * 64));
        }
        for (int r = 0; r < kTileRows; ++r) {
          const __m512i v = _mm512_maskz_loadu_epi32(mask, row[r] + (size_t)s * (kQSuper / 2) + u * run);
          const __m512i lo = _mm512_and_si512(v, m15);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
          for (int t = 0; t < NT; ++t) {
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo, xlo[t]);
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi, xhi[t]);
          }
        }
      }
    } else {
      for (int j = 0; j < 8; ++j) {
        __m512i xv[NT];
        for (int t = 0; t < NT; ++t)
          xv[t] = _mm512_loadu_si512((const void*)(xq[t] + (size_t)s * kQSuper + j * 64));
        for (int r = 0; r < kTileRows; ++r) {
          // Lanes past the row's end load 0 and flip to 128; their activations are zero.
          const __m512i wv = _mm512_xor_si512(
              _mm512_maskz_loadu_epi32(mask, row[r] + (size_t)s * kQSuper + j * run), flip);
          for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv, xv[t]);
        }
      }
    }
    __m512 xsv[NT];
    for (int t = 0; t < NT; ++t) xsv[t] = _mm512_loadu_ps(xs[t] + s * 16);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 wsv = INT4 ? int4_block_scales(w.scales + (size_t)(r0 + r) * groups, groups,
                                                  w.group, s)
                              : _mm512_setzero_ps();
      for (int t = 0; t < NT; ++t) {
        const __m512 sc = INT4 ? _mm512_mul_ps(xsv[t], wsv) : xsv[t];
        facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), sc, facc[r][t]);
      }
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    const float scale = INT4 ? 1.f : w.scales[r0 + r];
    for (int t = 0; t < NT; ++t)
      C[(size_t)t * ldc + r0 + r] = _mm512_reduce_add_ps(facc[r][t]) * scale;
  }
}

template <bool INT4>
void gemm_packed(const WeightView& w, int R, int K, const uint8_t* X, int n, float* C, int ldc) {
  const QLayout q(K);
  const size_t tb = q.token_bytes();
  const size_t tile_bytes = kTileRows * w.row_bytes;
  for (int r0 = 0; r0 < R; r0 += kTileRows) {
    // The next rows toward L1 while these are multiplied. (A device sweep of 1-8 tiles ahead,
    // into L1 or L2, moved one layer at 1 token by less than the run-to-run noise.)
    if (r0 + kTileRows < R) {
      const char* next = (const char*)(w.data + (size_t)(r0 + kTileRows) * w.row_bytes);
      for (size_t off = 0; off < tile_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
    }
    int t = 0;
    for (; t + 2 <= n; t += 2)
      qtile_packed<2, INT4>(w, r0, K, q, X + t * tb, C + (size_t)t * ldc, ldc);
    if (t < n) qtile_packed<1, INT4>(w, r0, K, q, X + t * tb, C + (size_t)t * ldc, ldc);
  }
}

template <bool INT4>
void gemm_rows(const WeightView& w, int R, int K, const uint8_t* X, int n, float* C, int ldc,
               uint8_t* scratch) {
  static const TransposeIdx ix;
  const QLayout q(K);
  const size_t tb = q.token_bytes();
  uint8_t* Wq = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  float* ws = (float*)(Wq + (size_t)kTileRows * q.Ksb);
  const float* rowscale = INT4 ? nullptr : w.scales;
  const size_t tile_bytes = kTileRows * w.row_bytes;
  for (int r0 = 0; r0 < R; r0 += kTileRows) {
    pack_rows(w, r0, K, q, ix, Wq, ws);
    // Start reading the next rows from memory while these are multiplied.
    if (r0 + kTileRows < R) {
      const char* next = (const char*)(w.data + (size_t)(r0 + kTileRows) * w.row_bytes);
      for (size_t off = 0; off < tile_bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
    }
    int t = 0;
    for (; t + 2 <= n; t += 2)
      qtile<2, INT4>(Wq, ws, q, X + t * tb, r0, rowscale, C + (size_t)t * ldc, ldc);
    if (t < n) qtile<1, INT4>(Wq, ws, q, X + t * tb, r0, rowscale, C + (size_t)t * ldc, ldc);
  }
}

}  // namespace

size_t vnni_prep_bytes(int K, int n) { return QLayout(K).token_bytes() * n; }

size_t vnni_scratch_bytes(int R, int K) {
  (void)R;
  const QLayout q(K);
  return (size_t)kTileRows * (q.Ksb + (size_t)q.nb * 4) + 64;
}

// Per token: [Ksb] s8 q in the VNNI layout, then [nb] fp32 block scales, then [nb] int32 block
// sums; blocks past Kv are zero.
void vnni_prep(const float* const* x, int Kv, int K, int n, void* dst) {
  const QLayout q(K);
  for (int t = 0; t < n; ++t) {
    uint8_t* base = (uint8_t*)dst + t * q.token_bytes();
    float* scales = (float*)(base + q.Ksb);
    int32_t* sums = (int32_t*)(scales + q.nb);
    std::memset(base, 0, q.token_bytes());
    const float* src = x[t];
    for (int b = 0; b < q.nb && b * kQBlock < Kv; ++b) {
      alignas(16) int8_t bytes[kQBlock];
      if (!q8_block32(src + b * kQBlock, Kv - b * kQBlock, bytes, scales + b, sums + b)) continue;
      const int s = b / 16, l = b % 16;
      for (int j = 0; j < 8; ++j)
        std::memcpy(base + (size_t)s * kQSuper + j * 64 + l * 4, bytes + 4 * j, 4);
    }
  }
}

void vnni_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
               uint8_t* scratch) {
  if (w.packed) {
    if (w.fmt == FMT_INT4) gemm_packed<true>(w, R, K, (const uint8_t*)xp, n, C, ldc);
    else gemm_packed<false>(w, R, K, (const uint8_t*)xp, n, C, ldc);
    return;
  }
  if (w.fmt == FMT_INT4) gemm_rows<true>(w, R, K, (const uint8_t*)xp, n, C, ldc, scratch);
  else gemm_rows<false>(w, R, K, (const uint8_t*)xp, n, C, ldc, scratch);
}

void vnni_unpack_rows(const WeightView& w, int R, int K, uint8_t* dst) {
  static const TransposeIdx ix;
  const size_t rb = row_bytes(w.fmt, K);
  const int nsb = qsuper_pad(K) / kQSuper;
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    uint8_t* d = dst + (size_t)r * rb;
    for (int s = 0; s < nsb; ++s) {
      __m512i O[8], A[8];
      load_packed(row, w.fmt, K, s, O);
      untranspose16x8(O, A, ix);
      const int pairs = packed_blocks(K, s) / 2;  // natural 64-element chunks in this one
      for (int i = 0; i < pairs; ++i) {
        if (w.fmt == FMT_INT8) {
          _mm512_storeu_si512((void*)(d + (size_t)s * kQSuper + i * 64), A[i]);
        } else {  // elements 0-31 of the chunk to the low nibbles, 32-63 to the high ones
          const __m256i lo = _mm512_castsi512_si256(A[i]), hi = _mm512_extracti64x4_epi64(A[i], 1);
          _mm256_storeu_si256((__m256i*)(d + (size_t)s * (kQSuper / 2) + i * 32),
                              _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
        }
      }
    }
  }
}

void vnni_unpack_int4_s8(const WeightView& w, int R, int K, int8_t* dst) {
  // Per super-block: run u (16 dwords, lane l = bytes of block l) -> per block its 4 dwords
  // [u = 0..3], whose low nibbles are then elements 0-15 in order and high nibbles 16-31. A
  // 4 x 16 dword transpose (8 vpermt2d/q) and a 128-bit interleave of the two halves (8 more):
  // 16 permutes a super-block instead of the full untranspose's 24.
  alignas(64) static const int32_t kPair[2][16] = {
      {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23},
      {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}};
  alignas(64) static const int64_t kQuad[2][8] = {{0, 8, 1, 9, 2, 10, 3, 11},
                                                  {4, 12, 5, 13, 6, 14, 7, 15}};
  alignas(64) static const int64_t kHalves[2][8] = {{0, 1, 8, 9, 2, 3, 10, 11},
                                                    {4, 5, 12, 13, 6, 7, 14, 15}};
  const __m512i pair0 = _mm512_load_si512(kPair[0]), pair1 = _mm512_load_si512(kPair[1]);
  const __m512i quad0 = _mm512_load_si512(kQuad[0]), quad1 = _mm512_load_si512(kQuad[1]);
  const __m512i half0 = _mm512_load_si512(kHalves[0]), half1 = _mm512_load_si512(kHalves[1]);
  const __m512i m15 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
  const int nsb = qsuper_pad(K) / kQSuper;
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    int8_t* d = dst + (size_t)r * K;
    for (int s = 0; s < nsb; ++s) {
      const int m = packed_blocks(K, s);
      const __mmask16 mask = q8_first_n(m);
      const uint8_t* p = row + (size_t)s * (kQSuper / 2);
      __m512i U[4];
      for (int u = 0; u < 4; ++u) U[u] = _mm512_maskz_loadu_epi32(mask, p + (size_t)u * 4 * m);
      // P: (U0, U1) dword pairs per block, lanes 0-7 then 8-15; Q: (U2, U3) likewise.
      const __m512i P0 = _mm512_permutex2var_epi32(U[0], pair0, U[1]);
      const __m512i P1 = _mm512_permutex2var_epi32(U[0], pair1, U[1]);
      const __m512i Q0 = _mm512_permutex2var_epi32(U[2], pair0, U[3]);
      const __m512i Q1 = _mm512_permutex2var_epi32(U[2], pair1, U[3]);
      // V[c]: blocks 4c..4c+3, 16 bytes each (runs 0..3 in order).
      const __m512i V[4] = {_mm512_permutex2var_epi64(P0, quad0, Q0),
                            _mm512_permutex2var_epi64(P0, quad1, Q0),
                            _mm512_permutex2var_epi64(P1, quad0, Q1),
                            _mm512_permutex2var_epi64(P1, quad1, Q1)};
      for (int c = 0; c < 4 && 4 * c < m; ++c) {
        const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(V[c], m15), eight);
        const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(V[c], 4), m15), eight);
        int8_t* o = d + (size_t)s * kQSuper + c * 128;  // blocks 4c, 4c + 1 | 4c + 2, 4c + 3
        _mm512_storeu_si512((void*)o, _mm512_permutex2var_epi64(lo, half0, hi));
        if (4 * c + 2 < m) _mm512_storeu_si512((void*)(o + 64), _mm512_permutex2var_epi64(lo, half1, hi));
      }
    }
  }
}

KernelSet kernels_vnni() {
  return {"vnni", vnni_prep_bytes, vnni_prep, vnni_gemm, vnni_scratch_bytes, nullptr, true};
}

}  // namespace tandem_cpu
