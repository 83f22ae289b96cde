// The integer path on AMX (Sapphire Rapids and later): tdpbssd, s8 weights x s8 activations, int32
// 16 x 16 tiles, from kAmxTileMinTokens tokens of one expert (VNNI below: kernels.h). Two kinds:
// - packed int8 rows (row16_*, below): 16-bit activations, one scale per token, split in two s8
//   halves, so a C tile sums a whole row of K and is scaled once (kernels.h: kRow16Levels);
// - int4 rows, and int8 rows not packed (tiles<>): activations quantized exactly as VNNI
//   quantizes them (kernels.h: kQBlock; simd_q8.h: q8_block32): one scale per token and block of
//   32 elements, so the output does not depend on which path its token count picked.
// With per-block scales a C tile may only sum products that share a scale: each tile store holds,
// per column, one 32-block's int32 sums, which are scaled into 16 fp32 accumulators held in
// registers by the 16 lanes' activation scales and, for int4, the weight group's row scales
// (int8 rows take their one scale at the end). A token block of few tokens puts several blocks
// side by side in the columns of one tile (blocks_per_tile), so one store and one rescale serve
// them all. Two C tiles alternate, and a tile is scaled kLag steps after its store.
//   A (weights): 16 rows x 64 bytes of natural s8 rows, unpacked per 16-row tile (int4 to
//     q - 8); natural int8 rows are read in place.
//   B (activations): per 16-token block, 1 KB tiles [16 rows of 4 elements][16 columns][4] s8,
//     then one 16-lane scale vector per tile store (prep below).
// Compiled with the AVX-512 flags plus -mamx-tile -mamx-int8; used only after CPUID reports AMX
// and the kernel granted XTILEDATA (isa.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "amx_tiles.h"
#include "kernels.h"
#include "simd_q8.h"

namespace tandem_cpu {
namespace {

// Tokens of one expert from which the tiles run; TANDEM_AMX_TILE_MIN_TOKENS overrides it (read
// once, when the kernel set is made) to measure the crossover with VNNI.
int tile_min_tokens = kAmxTileMinTokens;

// Every tile 16 x 64 bytes. tiles<>: 0, 1: C (16 x 16 int32); 4, 5: A (16 weight rows x 64
// bytes); 6, 7: B (16 rows of 16 columns x 4 bytes). row16_tiles: 0-3 C, 4, 5 A, 6, 7 B. Every
// tdpbssd sums one 64-element chunk of K (amx_tiles.h: configure_tiles).
constexpr int kKB = 64;          // K elements per tdpbssd
constexpr size_t kTileB = 1024;  // one B tile: 16 rows (4-element groups) x 16 columns x 4 bytes

// A token block of nt <= 16 tokens puts P blocks of 32 (the scale domain) side by side in the
// 16 columns of one C tile, nt <= 16 / P tokens each, so one tile store and one rescale serve P
// blocks: P = 1 (9-16 tokens), 2 (5-8), 4 (1-4, where K / 32 is a multiple of 4).
inline int blocks_per_tile(int nt, int nb) { return nt <= 4 && nb % 4 == 0 ? 4 : nt <= 8 ? 2 : 1; }

// B tiles of a token block: P = 1: one per 32-block b (its 8 rows of the 64-chunk; the other 8
// zero); P = 2, 4: one per 64-chunk. Then the scales, one 16-lane vector per tile store.
size_t token_block_bytes(int K, int P) {
  const int nb = K / kQBlock;
  return (size_t)(P == 1 ? nb : K / kKB) * kTileB + (size_t)(nb / P) * 16 * 4;
}

size_t prep_bytes(int K, int n) {
  if (n < tile_min_tokens) return vnni_prep_bytes(K, n);
  const int nb = K / kQBlock, full = n / 16, rest = n % 16;
  return (size_t)full * token_block_bytes(K, 1) +
         (rest ? token_block_bytes(K, blocks_per_tile(rest, nb)) : 0);
}

// Token block tb (at tb * token_block_bytes(K, 1): only the last one may be partial): token j,
// block b goes to column (b % P) * (16 / P) + j of B tile (P = 1 ? b : b / 2), rows (b % 2) * 8
// .. + 7 (elements 4 g .. 4 g + 3 of the block in row (b % 2) * 8 + g), and its scale to lane
// (b % P) * (16 / P) + j of scale vector b / P. Everything else is zero (padded tokens, all-zero
// blocks, blocks past Kv, and the other blocks' places in each column).
void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < tile_min_tokens) {
    vnni_prep(x, Kv, K, n, dst);
    return;
  }
  std::memset(dst, 0, prep_bytes(K, n));
  const int nb = K / kQBlock;
  // Block-major within a token block, so each block's 4-byte stores land in one 1 KB tile (in
  // L1) rather than all over the token block's tiles (tens of KB; token-major order spent
  // 40% of a call of 64 tokens an expert here: BENCHMARKS, session 10).
  for (int tb = 0; tb * 16 < n; ++tb) {
    const int nt = std::min(16, n - tb * 16), P = blocks_per_tile(nt, nb), T = 16 / P;
    uint8_t* blk = (uint8_t*)dst + (size_t)tb * token_block_bytes(K, 1);
    float* scales = (float*)(blk + (size_t)(P == 1 ? nb : K / kKB) * kTileB);
    for (int b = 0; b < nb && b * kQBlock < Kv; ++b) {
      uint8_t* tile0 = blk + (size_t)(P == 1 ? b : b / 2) * kTileB + (b % 2) * 8 * 64;
      for (int j = 0; j < nt; ++j) {
        alignas(16) int8_t q[kQBlock];
        int32_t sum;
        const int col = (b % P) * T + j;
        if (!q8_block32(x[tb * 16 + j] + b * kQBlock, Kv - b * kQBlock, q,
                        &scales[(b / P) * 16 + col], &sum))
          continue;
        uint8_t* tile = tile0 + col * 4;
        for (int g = 0; g < kQBlock / 4; ++g) std::memcpy(tile + g * 64, q + 4 * g, 4);
      }
    }
  }
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

// Staging buffers between a tile's store and its scaling. Token blocks of 1-15 tokens (P > 1, or
// a partial P = 1 block of few steps): the C tile of step s is stored to ring[s % kRing] and
// scaled kLag steps later, so the vector loads do not wait on a tile store just issued. Full
// P = 1 blocks: groups of 4 steps into C tiles 0-3, stored to one half of the ring and scaled
// after the next group's products are issued (kGroup below).
constexpr int kRing = 8, kLag = 3, kGroup = 4;

size_t scratch_bytes(int R, int K) {
  // R s8 rows (several token blocks: every row of the item unpacked once), the staging ring of
  // 16 x 16 int32 tiles (row16_tiles: 4 C tiles) and one fp32 block, alignment
  return (size_t)R * K + (kRing + 1) * 1024 + 128 + vnni_scratch_bytes(R, K);
}

// C[token][row] for the 16 rows r0.. and the nt tokens of token block tb: v[m * 16 + j] is
// row m, token j (already fully scaled).
inline void write_block(const float* v, float* C, int ldc, int r0, int tb, int nt) {
  for (int j = 0; j < nt; ++j) {
    float* c = C + (size_t)(tb * 16 + j) * ldc + r0;
    for (int m = 0; m < 16; ++m) c[m] = v[m * 16 + j];
  }
}

// Step s of a token block into C tile c (B tile bt): P = 1: block s (A chunk s / 2); P = 2:
// chunk s; P = 4: chunks 2 s and 2 s + 1 (A tiles 4 and 5, B tiles bt and bt2), summed in c. A
// macro: the tile intrinsics paste their tile number into the asm text, so it must be a literal.
#define TANDEM_TILE_STEP(c, bt, bt2, s)                                                     \
  do {                                                                                     \
    _tile_zero(c);                                                                         \
    const int ch_ = P == 4 ? 2 * (s) : P == 2 ? (s) : (s) / 2;                             \
    _tile_loadd(4, A + (size_t)ch_ * kKB, ldw);                                            \
    _tile_loadd(bt, xb + (size_t)(P == 1 ? (s) : ch_) * kTileB, 64);                       \
    _tile_dpbssd(c, 4, bt);                                                                \
    if (P == 4) {                                                                          \
      _tile_loadd(5, A + (size_t)(ch_ + 1) * kKB, ldw);                                    \
      _tile_loadd(bt2, xb + (size_t)(ch_ + 1) * kTileB, 64);                               \
      _tile_dpbssd(c, 5, bt2);                                                             \
    }                                                                                      \
    _tile_stored(c, ring + ((s) % kRing) * 256, 64);                                       \
  } while (0)

// acc[m] += the int32 tile at t (step s), row m, x its 16 lanes' activation scales x (int4) the
// row's weight-group scale of each lane's block. A macro, not a function or lambda: acc must
// stay in registers (the tile asm clobbers memory).
#define TANDEM_SCALE_TILE(t, s)                                                             \
  do {                                                                                     \
    const int32_t* t_ = (t);                                                               \
    const __m512 xs_ = _mm512_loadu_ps(xs + (size_t)(s) * 16);                             \
    const float* wsb_ = ws + (INT4 ? (size_t)(s) * P * kQBlock / w.group : 0);             \
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; ++m) {                                \
      const __m512 v_ = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(t_ + m * 16))); \
      __m512 s_ = xs_;                                                                     \
      if (INT4)                                                                            \
        s_ = _mm512_mul_ps(xs_, P == 1 ? _mm512_set1_ps(wsb_[(size_t)m * groups])          \
                                       : _mm512_permutexvar_ps(                            \
                                             gidx, _mm512_maskz_loadu_ps(                  \
                                                       gmask, wsb_ + (size_t)m * groups)));  \
      acc[m] = _mm512_fmadd_ps(v_, s_, acc[m]);                                            \
    }                                                                                      \
  } while (0)
#define TANDEM_SCALE_STEP(s) TANDEM_SCALE_TILE(ring + ((s) % kRing) * 256, s)

// Rows [r0, r0 + R) of w as natural s8 rows [R][K] in dst (int8 natural rows: in place).
inline const int8_t* rows_s8(const WeightView& w, int r0, int R, int K, int8_t* dst) {
  WeightView v = w;
  v.data = w.data + (size_t)r0 * w.row_bytes;
  if (w.fmt == FMT_INT4) {
    if (w.packed) vnni_unpack_int4_s8(v, R, K, dst);
    else unpack_int4(v, R, K, dst);
    return dst;
  }
  if (!w.packed) return (const int8_t*)v.data;
  vnni_unpack_rows(v, R, K, (uint8_t*)dst);
  return dst;
}

// Rows [r0, r0 + 16) (natural s8 at A, K apart or ldw for natural int8 rows) times token block tb
// into C, while pf_lines source lines of the next rows (16 rows from pf) are prefetched to L2.
template <bool INT4>
inline void tile_block(const WeightView& w, int K, const int8_t* A, size_t ldw, int r0,
                       const uint8_t* X, int n, int tb, float* C, int ldc, int32_t* ring,
                       float* out, const uint8_t* pf, size_t pf_lines) {
  const int groups = INT4 ? K / w.group : 1, nb = K / kQBlock;
  const float* ws = w.scales + (size_t)r0 * groups;
  const int nt = std::min(16, n - tb * 16), P = blocks_per_tile(nt, nb), T = 16 / P;
  const int steps = nb / P;
  const uint8_t* xb = X + (size_t)tb * token_block_bytes(K, 1);
  const float* xs = (const float*)(xb + (size_t)(P == 1 ? nb : K / kKB) * kTileB);
  // int4, P > 1: lane l takes the weight group of block l / T of the step, loaded from the
  // step's first group (P * 32 / group of them).
  alignas(64) int32_t gi[16];
  for (int l = 0; l < 16; ++l) gi[l] = INT4 ? (l / T) * kQBlock / w.group : 0;
  const __m512i gidx = _mm512_load_si512((const void*)gi);
  const __mmask16 gmask = (__mmask16)((1u << std::max(1, INT4 ? P * kQBlock / w.group : 1)) - 1);
  __m512 acc[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  const size_t pf_per_step = (pf_lines + steps - 1) / steps;
  auto prefetch_for = [&](int s, int count) {  // the next rows' lines of steps [s, s + count)
    for (size_t i = s * pf_per_step; i < std::min(pf_lines, (s + count) * pf_per_step); ++i)
      _mm_prefetch((const char*)(pf + (i % 16) * w.row_bytes + (i / 16) * 64), _MM_HINT_T1);
  };
  if (P == 1) {
    // Groups of kGroup blocks (two 64-chunks: A tiles 4 and 5) into C tiles 0-3; steps (K / 32)
    // is even, so the last group may hold 2. Group q's tiles go to ring half q % 2 and are scaled
    // once group q + 1's products are issued, which hides the products' latency behind the
    // scaling (one C tile stored right after its product waited for it: BENCHMARKS, session 16).
    for (int s = 0; s < steps; s += kGroup) {
      const bool four = s + 2 < steps;
      prefetch_for(s, kGroup);
      int32_t* rg = ring + ((s / kGroup) % 2) * kGroup * 256;
      _tile_loadd(4, A + (size_t)(s / 2) * kKB, ldw);
      _tile_loadd(6, xb + (size_t)s * kTileB, 64);
      _tile_zero(0);
      _tile_dpbssd(0, 4, 6);
      _tile_loadd(7, xb + (size_t)(s + 1) * kTileB, 64);
      _tile_zero(1);
      _tile_dpbssd(1, 4, 7);
      if (four) {
        _tile_loadd(5, A + (size_t)(s / 2 + 1) * kKB, ldw);
        _tile_loadd(6, xb + (size_t)(s + 2) * kTileB, 64);
        _tile_zero(2);
        _tile_dpbssd(2, 5, 6);
        _tile_loadd(7, xb + (size_t)(s + 3) * kTileB, 64);
        _tile_zero(3);
        _tile_dpbssd(3, 5, 7);
      }
      if (s >= kGroup) {  // the previous group: always 4 steps
        const int32_t* pg = ring + ((s / kGroup + 1) % 2) * kGroup * 256;
        for (int i = 0; i < kGroup; ++i) TANDEM_SCALE_TILE(pg + i * 256, s - kGroup + i);
      }
      _tile_stored(0, rg, 64);
      _tile_stored(1, rg + 256, 64);
      if (four) {
        _tile_stored(2, rg + 512, 64);
        _tile_stored(3, rg + 768, 64);
      }
    }
    const int last = (steps - 1) / kGroup * kGroup;
    const int32_t* lg = ring + ((last / kGroup) % 2) * kGroup * 256;
    for (int i = 0; last + i < steps; ++i) TANDEM_SCALE_TILE(lg + i * 256, last + i);
  } else {
    for (int s = 0; s < steps; s += 2) {
      prefetch_for(s, 2);
      TANDEM_TILE_STEP(0, 6, 7, s);
      if (s >= kLag) TANDEM_SCALE_STEP(s - kLag);
      if (s + 1 < steps) {
        TANDEM_TILE_STEP(1, 7, 6, s + 1);
        if (s + 1 >= kLag) TANDEM_SCALE_STEP(s + 1 - kLag);
      }
    }
    for (int s = std::max(0, steps - kLag); s < steps; ++s) TANDEM_SCALE_STEP(s);
  }
  // Lane (i * T + j) holds block i's share of token j: sum the P shares into lanes 0..T-1.
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) {
    __m512 v = acc[m];
    if (P >= 2) v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    if (P == 4) v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm512_store_ps(out + m * 16, INT4 ? v : _mm512_mul_ps(v, _mm512_set1_ps(ws[m])));
  }
  write_block(out, C, ldc, r0, tb, nt);
}

template <bool INT4>
void tiles(const WeightView& w, int R, int K, const uint8_t* X, int n, float* C, int ldc,
           int8_t* rows, int32_t* ring, float* out) {
  const int ntb = (n + 15) / 16;
  const bool natural = !INT4 && !w.packed;
  const size_t ldw = natural ? w.row_bytes : (size_t)K;
  configure_tiles();
  if (ntb == 1) {
    // One token block: r-tile by r-tile, each one's rows unpacked just before its tiles run
    // while the next r-tile's source lines are prefetched to L2 (spread over its steps), so
    // that unpack reads from cache instead of waiting on memory.
    for (int r0 = 0; r0 < R; r0 += 16) {
      const int8_t* A = rows_s8(w, r0, 16, K, rows);
      asm volatile("" ::: "memory");  // the tile loads' asm names no memory: keep the rows' stores first
      const uint8_t* pf = r0 + 16 < R ? w.data + (size_t)(r0 + 16) * w.row_bytes : nullptr;
      tile_block<INT4>(w, K, A, ldw, r0, X, n, 0, C, ldc, ring, out, pf,
                       pf ? 16 * w.row_bytes / 64 : 0);
    }
  } else {
    // Several token blocks: every row unpacked once, then token block by token block, all R
    // rows each, so a token block's activations are read from memory once per work item and
    // reused from L2 by every r-tile (r-tiles outside re-read all of the expert's activations
    // per 16 rows, from L3 once they outgrow L2).
    const int8_t* A = rows_s8(w, 0, R, K, rows);
    asm volatile("" ::: "memory");
    for (int tb = 0; tb < ntb; ++tb)
      for (int r0 = 0; r0 < R; r0 += 16)
        tile_block<INT4>(w, K, A + r0 * ldw, ldw, r0, X, n, tb, C, ldc, ring, out, nullptr, 0);
  }
  _tile_release();
}
#undef TANDEM_TILE_STEP
#undef TANDEM_SCALE_STEP
#undef TANDEM_SCALE_TILE

// ---- int4 weights in groups of 64: activations per token and 64-element block ----
// The block is the weight group, so each tdpbssd (one 64-chunk of K) yields sums that share both
// scales: one tile store and one rescale per chunk, and every product used (32-element blocks
// use half of each tdpbssd and need a store and a rescale per half; kernels.h: kTileQBlock4).
//   A (weights): natural s8 rows (nibble - 8), K apart.
//   B (activations): per 16-token block, per 64-chunk one 1 KB tile [16 rows of 4 elements][16
//     tokens][4] s8, then the scales [chunk][16 tokens] fp32 (0: an all-zero block or a padded
//     token; its q are zero).
size_t b64_block_bytes(int K) { return (size_t)(K / kKB) * (kTileB + 16 * sizeof(float)); }

size_t b64_prep_bytes(int K, int n) {
  if (n < tile_min_tokens) return vnni_prep_bytes(K, n);
  return (size_t)((n + 15) / 16) * b64_block_bytes(K);
}

// The 64 floats src[0, 64) (those at or past `valid` read as zero) as s8 q[64]: scale = absmax /
// 127, q = round-half-even(x / scale) (ext/cpu/reference.py: quantize_activations(block=64)).
// Returns false (q, scale untouched) when the block is all zero (or its scale underflows).
inline bool q8_block64(const float* src, int valid, int8_t* q, float* scale) {
  __m512 v[4];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm512_maskz_loadu_ps(q8_first_n(valid - 16 * i), src + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  const float s = _mm512_reduce_max_ps(amax) / 127.f;
  if (!(s > 0.f)) return false;
  const __m512 sv = _mm512_set1_ps(s);
  for (int i = 0; i < 4; ++i)  // division, as the reference; MXCSR default: half to even
    _mm_storeu_si128((__m128i*)(q + 16 * i),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(v[i], sv))));
  *scale = s;
  return true;
}

void b64_prep(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < tile_min_tokens) {
    vnni_prep(x, Kv, K, n, dst);
    return;
  }
  std::memset(dst, 0, b64_prep_bytes(K, n));
  const int chunks = K / kKB;
  for (int tb = 0; tb * 16 < n; ++tb) {
    const int nt = std::min(16, n - tb * 16);
    uint8_t* blk = (uint8_t*)dst + (size_t)tb * b64_block_bytes(K);
    float* scales = (float*)(blk + (size_t)chunks * kTileB);
    // Chunk-major, so each chunk's 4-byte stores land in one 1 KB tile (in L1).
    for (int c = 0; c < chunks && c * kKB < Kv; ++c) {
      uint8_t* tile = blk + (size_t)c * kTileB;
      for (int j = 0; j < nt; ++j) {
        alignas(16) int8_t q[kKB];
        if (!q8_block64(x[tb * 16 + j] + c * kKB, Kv - c * kKB, q, &scales[c * 16 + j])) continue;
        for (int g = 0; g < kKB / 4; ++g) std::memcpy(tile + g * 64 + j * 4, q + 4 * g, 4);
      }
    }
  }
}

// acc[m] += the int32 tile at t (chunk c), row m, x its 16 tokens' scales x the row's group
// scale. A macro for the reason of TANDEM_SCALE_TILE's.
#define TANDEM_SCALE64(t, c)                                                                \
  do {                                                                                     \
    const int32_t* t_ = (t);                                                               \
    const __m512 xs_ = _mm512_loadu_ps(xs + (size_t)(c) * 16);                             \
    _Pragma("GCC unroll 16") for (int m = 0; m < 16; ++m) {                                \
      const __m512 v_ = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(t_ + m * 16))); \
      const __m512 s_ = _mm512_mul_ps(xs_, _mm512_set1_ps(ws[(size_t)m * chunks + (c)]));  \
      acc[m] = _mm512_fmadd_ps(v_, s_, acc[m]);                                            \
    }                                                                                      \
  } while (0)

// Rows [r0, r0 + 16) (s8 at A, K apart) times token block tb into C, while pf_lines source lines
// of the next rows (16 rows from pf) are prefetched to L2. Chunks go in groups of 4 into C tiles
// 0-3 (A tiles 4, 5 and B tiles 6, 7 alternating); group q's tiles are stored to ring half q % 2
// and scaled once group q + 1's products are issued, so the stores do not wait on products just
// issued and the scaling overlaps the tiles' work.
inline void b64_block(const WeightView& w, int K, const int8_t* A, int r0, const uint8_t* X,
                      int n, int tb, float* C, int ldc, int32_t* ring, float* out,
                      const uint8_t* pf, size_t pf_lines) {
  const int chunks = K / kKB, nt = std::min(16, n - tb * 16);
  const size_t ldw = (size_t)K;
  const float* ws = w.scales + (size_t)r0 * chunks;
  const uint8_t* xb = X + (size_t)tb * b64_block_bytes(K);
  const float* xs = (const float*)(xb + (size_t)chunks * kTileB);
  const size_t pf_per_chunk = (pf_lines + chunks - 1) / chunks;
  __m512 acc[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  for (int c = 0; c < chunks; c += 4) {
    const int cnt = std::min(4, chunks - c);
    for (size_t i = c * pf_per_chunk; i < std::min(pf_lines, (c + 4) * pf_per_chunk); ++i)
      _mm_prefetch((const char*)(pf + (i % 16) * w.row_bytes + (i / 16) * 64), _MM_HINT_T1);
    int32_t* rg = ring + ((c / 4) % 2) * 1024;
    _tile_loadd(4, A + (size_t)c * kKB, ldw);
    _tile_loadd(6, xb + (size_t)c * kTileB, 64);
    _tile_zero(0);
    _tile_dpbssd(0, 4, 6);
    if (cnt > 1) {
      _tile_loadd(5, A + (size_t)(c + 1) * kKB, ldw);
      _tile_loadd(7, xb + (size_t)(c + 1) * kTileB, 64);
      _tile_zero(1);
      _tile_dpbssd(1, 5, 7);
    }
    if (cnt > 2) {
      _tile_loadd(4, A + (size_t)(c + 2) * kKB, ldw);
      _tile_loadd(6, xb + (size_t)(c + 2) * kTileB, 64);
      _tile_zero(2);
      _tile_dpbssd(2, 4, 6);
    }
    if (cnt > 3) {
      _tile_loadd(5, A + (size_t)(c + 3) * kKB, ldw);
      _tile_loadd(7, xb + (size_t)(c + 3) * kTileB, 64);
      _tile_zero(3);
      _tile_dpbssd(3, 5, 7);
    }
    if (c >= 4) {  // the previous group: always 4 chunks
      const int32_t* pg = ring + ((c / 4 + 1) % 2) * 1024;
      for (int i = 0; i < 4; ++i) TANDEM_SCALE64(pg + i * 256, c - 4 + i);
    }
    _tile_stored(0, rg, 64);
    if (cnt > 1) _tile_stored(1, rg + 256, 64);
    if (cnt > 2) _tile_stored(2, rg + 512, 64);
    if (cnt > 3) _tile_stored(3, rg + 768, 64);
  }
  const int last = (chunks - 1) / 4 * 4;
  const int32_t* lg = ring + ((last / 4) % 2) * 1024;
  for (int i = 0; last + i < chunks; ++i) TANDEM_SCALE64(lg + i * 256, last + i);
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) _mm512_store_ps(out + m * 16, acc[m]);
  write_block(out, C, ldc, r0, tb, nt);
}
#undef TANDEM_SCALE64

void b64_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
              uint8_t* scratch) {
  if (n < tile_min_tokens) {
    vnni_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  uint8_t* free_scratch = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t* rows = (int8_t*)free_scratch;                                 // [R][K] s8
  int32_t* ring = (int32_t*)(free_scratch + (((size_t)R * K + 63) & ~(size_t)63));
  float* out = (float*)((uint8_t*)ring + kRing * 1024);                 // [16][16] fp32
  const uint8_t* X = (const uint8_t*)xp;
  const int ntb = (n + 15) / 16;
  configure_tiles();
  if (ntb == 1) {  // as tiles<>: r-tile by r-tile, the next one's source prefetched
    for (int r0 = 0; r0 < R; r0 += 16) {
      const int8_t* A = rows_s8(w, r0, 16, K, rows);
      asm volatile("" ::: "memory");
      const uint8_t* pf = r0 + 16 < R ? w.data + (size_t)(r0 + 16) * w.row_bytes : nullptr;
      b64_block(w, K, A, r0, X, n, 0, C, ldc, ring, out, pf, pf ? 16 * w.row_bytes / 64 : 0);
    }
  } else {  // as tiles<>: every row unpacked once, then token block by token block
    const int8_t* A = rows_s8(w, 0, R, K, rows);
    asm volatile("" ::: "memory");
    for (int tb = 0; tb < ntb; ++tb)
      for (int r0 = 0; r0 < R; r0 += 16)
        b64_block(w, K, A + (size_t)r0 * K, r0, X, n, tb, C, ldc, ring, out, nullptr, 0);
  }
  _tile_release();
}

// ---- packed int8 weights: 16-bit activations, one scale per token (kernels.h: kRow16Levels) ----
// A token's q = hi * 256 + lo goes into two B tiles per 64-chunk, hi then lo, so the int32 C
// tiles sum a whole row of K with no rescale: C = 256 * C_hi + C_lo at the end, times the token's
// scale and the row's. |C_hi|, |C_lo| <= 128 * 127 * K: no overflow below K = 132,000.
// Without per-block scales the order of K is free, so the weights are read as the pool packs
// them for VNNI (kernels.h: packed_word) with no unpack, and the activations are put in that order.
//   A (weights): 16 packed rows x 64 bytes, two r-tiles (rows r0 .. r0 + 31) per pass.
//   B (activations): per 16-token block, per 64-chunk (16 packed words): the hi tile, then the lo
//     tile (1 KB each, [16 words][16 tokens][4] s8); then the 16 tokens' scales (0: a zero row).
constexpr size_t kChunk16 = 2 * kTileB;

size_t row16_block_bytes(int K) { return (size_t)(K / kKB) * kChunk16 + 16 * sizeof(float); }

size_t row16_prep_bytes(int K, int n) {
  if (n < tile_min_tokens) return vnni_prep_bytes(K, n);
  return (size_t)((n + 15) / 16) * row16_block_bytes(K);
}

void row16_prep(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < tile_min_tokens) {
    vnni_prep(x, Kv, K, n, dst);
    return;
  }
  const __m512i lim = _mm512_set1_epi32(kRow16Levels), half = _mm512_set1_epi32(128);
  const int chunks = K / kKB;
  // Per token block: the scales, then super-block by super-block (512 elements, 8 chunks, 16
  // KB), each token's elements of it, so the 4-byte stores stay in L1 (token-major order spent
  // 40% of a call of 64 tokens an expert: BENCHMARKS, session 10).
  for (int tb = 0; tb * 16 < n; ++tb) {
    const int nt = std::min(16, n - tb * 16);
    uint8_t* blk = (uint8_t*)dst + (size_t)tb * row16_block_bytes(K);
    float* scales = (float*)(blk + (size_t)chunks * kChunk16);
    for (int j = 0; j < 16; ++j) {
      float s = 0.f;
      if (j < nt) {
        __m512 amax = _mm512_setzero_ps();
        for (int k = 0; k < Kv; k += 16)
          amax = _mm512_max_ps(
              amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(q8_first_n(Kv - k), x[tb * 16 + j] + k)));
        s = _mm512_reduce_max_ps(amax) / (float)kRow16Levels;
      }
      scales[j] = s > 0.f ? s : 0.f;  // 0: an all-zero row (or a padded token), zero tiles
    }
    for (int sb = 0; sb * kQSuper < K; ++sb) {
      const int m = packed_blocks(K, sb);  // blocks of 32 in this super-block
      uint8_t* sbase = blk + (size_t)sb * (kQSuper / kKB) * kChunk16;
      std::memset(sbase, 0, (size_t)m * kQBlock / kKB * kChunk16);
      for (int j = 0; j < nt; ++j) {
        if (!(scales[j] > 0.f)) continue;
        const __m512 sv = _mm512_set1_ps(scales[j]);
        const float* xt = x[tb * 16 + j];
        for (int k = sb * kQSuper; k < std::min(Kv, sb * kQSuper + m * kQBlock); k += 16) {
          const __m512 v = _mm512_maskz_loadu_ps(q8_first_n(Kv - k), xt + k);
          // Division, not a reciprocal multiply: the same rounding as the torch reference.
          __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(v, sv));  // MXCSR default: half to even
          q = _mm512_max_epi32(_mm512_min_epi32(q, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
          const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, half), 8);
          const __m512i lo = _mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8));
          alignas(16) int8_t h[16], l[16];
          _mm_store_si128((__m128i*)h, _mm512_cvtepi32_epi8(hi));
          _mm_store_si128((__m128i*)l, _mm512_cvtepi32_epi8(lo));
          // Elements k .. k + 15: 4 groups of 4, runs (k % 32) / 4 .. + 3 of block (k % 512) /
          // 32: packed words run * m + block of the super-block (kernels.h: packed_word).
          const int word0 = ((k % kQBlock) / 4) * m + (k % kQSuper) / kQBlock;
          for (int g = 0; g < 4; ++g) {
            const int word = word0 + g * m;
            uint8_t* d = sbase + (size_t)(word / 16) * kChunk16 + (size_t)(word % 16) * 64 + j * 4;
            std::memcpy(d, h + 4 * g, 4);
            std::memcpy(d + kTileB, l + 4 * g, 4);
          }
        }
      }
    }
  }
}

// Tiles 0-3: C (rows r0 hi, r0 lo, r0 + 16 hi, r0 + 16 lo); 4, 5: A (rows r0, r0 + 16); 6, 7: B.
void row16_tiles(const WeightView& w, int R, int K, const uint8_t* X, int n, float* C, int ldc,
                 int32_t* stage, float* out) {
  const int chunks = K / kKB, ntb = (n + 15) / 16;
  const size_t tbb = row16_block_bytes(K), ldw = w.row_bytes;
  configure_tiles();
  // Token blocks outside the row pairs: a token block's activations (2 K bytes a token) are read
  // from memory once per work item and reused from L2 by the other row pair, and the item's rows
  // (R x K bytes) stay in L2 across token blocks (row pairs outside re-read all of the expert's
  // activations per 32 rows, from L3 once they outgrow L2).
  for (int tb = 0; tb < ntb; ++tb) {
    for (int r0 = 0; r0 < R; r0 += 32) {
      const int8_t* A = (const int8_t*)(w.data + (size_t)r0 * ldw);
      const int nt = std::min(16, n - tb * 16);
      const uint8_t* xb = X + (size_t)tb * tbb;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int c = 0; c < chunks; ++c) {
        prefetch_rows_l1(A, ldw, c + 1, chunks);  // kKB = 64: one line a row
        _tile_loadd(4, A + (size_t)c * kKB, ldw);
        _tile_loadd(6, xb + (size_t)c * kChunk16, 64);
        _tile_loadd(7, xb + (size_t)c * kChunk16 + kTileB, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_loadd(5, A + 16 * ldw + (size_t)c * kKB, ldw);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(0, stage, 64);
      _tile_stored(1, stage + 256, 64);
      _tile_stored(2, stage + 512, 64);
      _tile_stored(3, stage + 768, 64);
      const __m512 xs = _mm512_loadu_ps((const float*)(xb + (size_t)chunks * kChunk16));
      const __m512 k256 = _mm512_set1_ps(256.f);
      for (int half = 0; half < 2; ++half) {
        const int32_t* hi = stage + half * 512;
        const float* ws = w.scales + r0 + half * 16;
#pragma GCC unroll 4
        for (int m = 0; m < 16; ++m) {
          const __m512 vh = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(hi + m * 16)));
          const __m512 vl = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(hi + 256 + m * 16)));
          const __m512 v = _mm512_fmadd_ps(vh, k256, vl);
          _mm512_store_ps(out + m * 16, _mm512_mul_ps(v, _mm512_mul_ps(xs, _mm512_set1_ps(ws[m]))));
        }
        write_block(out, C, ldc, r0 + half * 16, tb, nt);
      }
    }
  }
  _tile_release();
}

void row16_gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
                uint8_t* scratch) {
  if (n < tile_min_tokens) {
    vnni_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  int32_t* stage = (int32_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  // 4 C tiles
  float* out = (float*)((uint8_t*)stage + 4 * 1024);                          // [16][16] fp32
  row16_tiles(w, R, K, (const uint8_t*)xp, n, C, ldc, stage, out);
}

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t* scratch) {
  if (n < tile_min_tokens) {
    vnni_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  uint8_t* free_scratch = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t* rows = (int8_t*)free_scratch;                                 // [R][K] s8
  int32_t* ring = (int32_t*)(free_scratch + (((size_t)R * K + 63) & ~(size_t)63));
  float* out = (float*)((uint8_t*)ring + kRing * 1024);                 // [16][16] fp32
  if (w.fmt == FMT_INT4) tiles<true>(w, R, K, (const uint8_t*)xp, n, C, ldc, rows, ring, out);
  else tiles<false>(w, R, K, (const uint8_t*)xp, n, C, ldc, rows, ring, out);
}

}  // namespace

KernelSet kernels_amx_int8(int fmt, int group) {
  static const int min_tokens =
      min_tokens_from_env("TANDEM_AMX_TILE_MIN_TOKENS", kAmxTileMinTokens);
  tile_min_tokens = min_tokens;
  if (fmt == FMT_INT8)  // packed int8 rows only (ExpertPool::kernels_for)
    return {"amx-int8", row16_prep_bytes, row16_prep, row16_gemm, scratch_bytes, nullptr, true,
            min_tokens};
  if (group == kTileQBlock4)
    return {"amx-int8", b64_prep_bytes, b64_prep, b64_gemm, scratch_bytes, nullptr, true,
            min_tokens};
  return {"amx-int8", prep_bytes, prep, gemm, scratch_bytes, nullptr, true, min_tokens};
}

}  // namespace tandem_cpu
