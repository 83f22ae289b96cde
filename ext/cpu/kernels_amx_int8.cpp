// The integer path on AMX (Sapphire Rapids and later): tdpbssd, s8 weights x s8 activations, int32
// 16 x 16 tiles, from kAmxRowScaleMinTokens tokens of one expert (kernels.h says why not fewer).
// Activations are quantized with ONE scale per token over its whole row (absmax / 127; the VNNI
// path below uses blocks of 32), so a tile needs no rescaling between K blocks: int8 weights (one
// scale per row) sum all of K in one int32 tile and are scaled once; int4 weights (one scale per
// group of 32 or 64) take one tdpbssd per group and fold its row scales into 16 fp32 accumulators
// held in registers. (The first version scaled every tile per 32-element block through memory,
// which cost several times the AMX work at 256 tokens.)
//   A (weights): row-major s8, 16 rows x kstep bytes. int8 rows are read in place; int4 rows
//     are unpacked once per work item to q - 8.
//   B (activations): per 16-token block, [K / 64][16 groups of 4][16 tokens][4] s8, then the
//     16 token scales.
// Compiled with the AVX-512 flags plus -mamx-tile -mamx-int8; used only after CPUID reports AMX
// and the kernel granted XTILEDATA (isa.cpp).
#include <immintrin.h>

#include <algorithm>

#include "amx_tiles.h"
#include "kernels.h"
#include "simd_q8.h"

namespace tandem_cpu {
namespace {

// Tile 0: C (16 x 16 int32); 4: A (16 weight rows x kstep bytes); 6: B (kstep / 4 rows of
// 16 tokens x 4 bytes). kstep = 64 (int8 rows, int4 groups of 64) or 32 (int4 groups of 32).
inline void configure_tiles(int kstep) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  cfg.colsb[0] = 64;
  cfg.rows[0] = 16;
  cfg.colsb[4] = (uint16_t)kstep;
  cfg.rows[4] = 16;
  cfg.colsb[6] = 64;
  cfg.rows[6] = (uint8_t)(kstep / 4);
  _tile_loadconfig(&cfg);
}

constexpr int kKB = 64;                   // K elements per activation block of the layout
constexpr size_t kBlockBytes = 16 * kKB;  // 16 rows (4-element groups) x 16 tokens x 4 bytes

size_t token_block_bytes(int K) { return (size_t)(K / kKB) * kBlockBytes + 16 * 4; }

size_t prep_bytes(int K, int n) {
  if (n < kAmxRowScaleMinTokens) return vnni_prep_bytes(K, n);
  return (size_t)((n + 15) / 16) * token_block_bytes(K);
}

// Token block tb: [K / 64][16][16 tokens][4] s8, then the 16 tokens' scales (fp32). One scale
// per token over its whole row (absmax / 127, q = round-half-even(x / scale)), so a tile sums
// over all of K in int32 and is scaled once; padded tokens (and all-zero rows) are zero.
// PACKED: the 4-element groups in the order of packed int8 rows (kernels.h: packed_at), so
// tdpbssd reads those rows in place (a sum over all of K does not care about the order).
template <bool PACKED>
void prep_order(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < kAmxRowScaleMinTokens) {
    vnni_prep(x, Kv, K, n, dst);
    return;
  }
  std::memset(dst, 0, prep_bytes(K, n));
  for (int t = 0; t < n; ++t) {
    uint8_t* blk = (uint8_t*)dst + (size_t)(t / 16) * token_block_bytes(K);
    float* scales = (float*)(blk + (size_t)(K / kKB) * kBlockBytes);
    const int j = t % 16;
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < Kv; k += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(q8_first_n(Kv - k), x[t] + k)));
    const float sc = _mm512_reduce_max_ps(amax) / 127.f;
    if (!(sc > 0.f)) continue;
    scales[j] = sc;
    const __m512 sv = _mm512_set1_ps(sc);
    alignas(16) int8_t q[16];
    for (int k = 0; k < Kv; k += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(q8_first_n(Kv - k), x[t] + k);
      // Division, not a reciprocal multiply: the same rounding as the torch reference.
      _mm_store_si128((__m128i*)q, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(v, sv))));
      // Elements k + 4g .. k + 4g + 3 are one 4-byte group; group d of the K order goes to
      // row d % 16 of 64-element block d / 16, i.e. byte 64 d (+ 4 per token).
      for (int g = 0; g < 4; ++g) {
        const size_t d = PACKED ? packed_word(FMT_INT8, K, k + 4 * g) : (size_t)(k / 4 + g);
        std::memcpy(blk + d * 64 + j * 4, q + 4 * g, 4);
      }
    }
  }
}

void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  prep_order<false>(x, Kv, K, n, dst);
}

// Below kAmxRowScaleMinTokens both are vnni_prep, whose layout does not depend on the
// weights' order.
void prep_packed(const float* const* x, int Kv, int K, int n, void* dst) {
  prep_order<true>(x, Kv, K, n, dst);
}

// int4 rows [0, R) as s8 (q - 8), row-major [R][K].
void unpack_int4(const WeightView& w, int R, int K, int8_t* dst) {
  const __m256i m15 = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = w.data + (size_t)r * w.row_bytes;
    int8_t* d = dst + (size_t)r * K;
    for (int c = 0; c < K / 64; ++c) {
      const __m256i b = _mm256_loadu_si256((const __m256i*)(row + c * 32));
      const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, m15), eight);
      const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m15), eight);
      _mm256_storeu_si256((__m256i*)(d + c * 64), lo);
      _mm256_storeu_si256((__m256i*)(d + c * 64 + 32), hi);
    }
  }
}

size_t scratch_bytes(int R, int K) {
  // unpacked int4 rows, two 16 x 16 staging tiles, alignment
  return (size_t)R * K + 2 * 1024 + 128 + vnni_scratch_bytes(R, K);
}

// C[token][row] for the 16 rows r0.. and the valid tokens of token block tb: v[m * 16 + j] is
// row m, token j (already fully scaled).
inline void write_block(const float* v, float* C, int ldc, int r0, int tb, int n) {
  for (int j = 0; j < 16 && tb * 16 + j < n; ++j) {
    float* c = C + (size_t)(tb * 16 + j) * ldc + r0;
    for (int m = 0; m < 16; ++m) c[m] = v[m * 16 + j];
  }
}

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t* scratch) {
  if (n < kAmxRowScaleMinTokens) {
    vnni_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  const bool int4 = w.fmt == FMT_INT4;
  uint8_t* free_scratch = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  const int8_t* W = (const int8_t*)w.data;
  size_t ldw = w.row_bytes;
  // int8 rows are read in place: packed ones against prep_packed's activations (the pool's
  // choice), whose K order is theirs. int4 rows are unpacked to s8 in the natural order.
  if (int4) {
    if (w.packed) vnni_unpack_int4_s8(w, R, K, (int8_t*)free_scratch);
    else unpack_int4(w, R, K, (int8_t*)free_scratch);
    W = (const int8_t*)free_scratch;
    ldw = (size_t)K;
    free_scratch += ((size_t)R * K + 63) & ~(size_t)63;
  }
  int32_t* tile = (int32_t*)free_scratch;       // [16][16] int32
  float* out = (float*)(free_scratch + 1024);   // [16][16] fp32
  const int kstep = int4 ? std::min(kKB, w.group) : kKB;
  const int groups = int4 ? K / w.group : 0;
  const int ntb = (n + 15) / 16;
  const size_t tbb = token_block_bytes(K);
  const uint8_t* X = (const uint8_t*)xp;
  configure_tiles(kstep);
  for (int r0 = 0; r0 < R; r0 += 16) {
    const int8_t* A = W + (size_t)r0 * ldw;
    for (int tb = 0; tb < ntb; ++tb) {
      const uint8_t* xb = X + (size_t)tb * tbb;
      const __m512 xs = _mm512_loadu_ps((const float*)(xb + (size_t)(K / kKB) * kBlockBytes));
      if (!int4) {  // int8: per-row scales, the whole of K in one int32 tile
        _tile_zero(0);
        for (int b = 0; b < K / kKB; ++b) {
          _tile_loadd(4, A + b * kKB, ldw);
          _tile_loadd(6, xb + (size_t)b * kBlockBytes, 64);
          _tile_dpbssd(0, 4, 6);
        }
        _tile_stored(0, tile, 64);
        for (int m = 0; m < 16; ++m) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(tile + m * 16)));
          _mm512_store_ps(out + m * 16,
                          _mm512_mul_ps(v, _mm512_mul_ps(xs, _mm512_set1_ps(w.scales[r0 + m]))));
        }
      } else {  // int4: one int32 tile per group, scaled by the group's row scales into fp32
        __m512 acc[16];
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
        for (int k0 = 0; k0 < K; k0 += kstep) {
          _tile_zero(0);
          _tile_loadd(4, A + k0, ldw);
          _tile_loadd(6, xb + (size_t)(k0 / kKB) * kBlockBytes + (k0 % kKB) / 4 * 64, 64);
          _tile_dpbssd(0, 4, 6);
          _tile_stored(0, tile, 64);
          const float* ws = w.scales + (size_t)r0 * groups + k0 / w.group;
#pragma GCC unroll 16
          for (int m = 0; m < 16; ++m)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void*)(tile + m * 16))),
                                     _mm512_set1_ps(ws[(size_t)m * groups]), acc[m]);
        }
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m) _mm512_store_ps(out + m * 16, _mm512_mul_ps(acc[m], xs));
      }
      write_block(out, C, ldc, r0, tb, n);
    }
  }
  _tile_release();
}

}  // namespace

KernelSet kernels_amx_int8() {
  return {"amx-int8", prep_bytes, prep, gemm, scratch_bytes, nullptr, true, prep_packed};
}

}  // namespace tandem_cpu
