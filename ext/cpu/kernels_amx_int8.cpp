// The integer path on AMX (Sapphire Rapids and later): tdpbssd, s8 weights x s8 activations,
// int32 16 x 16 tiles. Same quantization as the VNNI path (simd_q8.h: activations per token and
// block of 32, one fp32 scale each), so the two give the same integers; only the layout differs:
//   A (weights): row-major s8, 16 rows x 32 bytes (one block) per tile. int8 rows are read in
//     place (they are already s8); int4 rows are unpacked once per work item to q - 8.
//   B (activations): per 16-token block and K block, 8 rows (4-element groups) x 16 tokens x 4
//     bytes (the VNNI pair layout for bytes), then the block's 16 token scales [16] fp32.
// A block's products are summed in int32 by one tdpbssd, then each C tile is scaled by the
// token scales (columns) and the int4 group scale (rows) and added into fp32 sums. Below
// kAmxMinTokens tokens the VNNI kernels run instead (prep and gemm alike).
// Compiled with the AVX-512 flags plus -mamx-tile -mamx-int8; used only after CPUID reports AMX
// and the kernel granted XTILEDATA (isa.cpp).
#include <immintrin.h>

#include "kernels.h"
#include "simd_q8.h"

namespace tandem_cpu {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (16 x 16 int32), 4-5: A (16 rows x 32 bytes), 6-7: B (8 rows x 64 bytes).
inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 4; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  for (int i = 4; i < 6; ++i) {
    cfg.colsb[i] = kQBlock;
    cfg.rows[i] = 16;
  }
  for (int i = 6; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = kQBlock / 4;
  }
  _tile_loadconfig(&cfg);
}

constexpr size_t kBlockBytes = 16 * kQBlock;  // one B tile: 16 tokens x 32 bytes

size_t token_block_bytes(int K) { return (size_t)(K / kQBlock) * (kBlockBytes + 16 * 4); }

size_t prep_bytes(int K, int n) {
  if (n < kAmxMinTokens) return vnni_prep_bytes(K, n);
  return (size_t)((n + 15) / 16) * token_block_bytes(K);
}

// Token block tb: [nkb][8][16][4] s8, then [nkb][16] fp32 scales; padded tokens are zero.
void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < kAmxMinTokens) {
    vnni_prep(x, Kv, K, n, dst);
    return;
  }
  const int nkb = K / kQBlock;
  std::memset(dst, 0, prep_bytes(K, n));
  for (int t = 0; t < n; ++t) {
    uint8_t* blk = (uint8_t*)dst + (size_t)(t / 16) * token_block_bytes(K);
    float* scales = (float*)(blk + (size_t)nkb * kBlockBytes);
    const int j = t % 16;
    for (int b = 0; b < nkb && b * kQBlock < Kv; ++b) {
      alignas(16) int8_t q[kQBlock];
      int32_t sum;
      if (!q8_block32(x[t] + b * kQBlock, Kv - b * kQBlock, q, scales + b * 16 + j, &sum)) continue;
      for (int g = 0; g < kQBlock / 4; ++g)
        std::memcpy(blk + (size_t)b * kBlockBytes + g * 64 + j * 4, q + 4 * g, 4);
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

size_t scratch_bytes(int R, int K) {
  // unpacked int4 rows, fp32 sums [32 rows][32 tokens], 4 int32 C tiles, alignment
  return (size_t)R * K + 32 * 32 * 4 + 4 * 1024 + 128 + vnni_scratch_bytes(R, K);
}

// C tile (16 weight rows x 16 tokens, int32) into the fp32 sums acc[16][ld]:
// acc[m][j] += tile[m][j] * xs[j] * (ws ? ws[m * ws_stride] : 1).
inline void scale_add(const int32_t* tile, const float* xs, const float* ws, size_t ws_stride,
                      float* acc, int ld) {
  const __m512 xv = _mm512_loadu_ps(xs);
  for (int m = 0; m < 16; ++m) {
    const __m512 sc = ws ? _mm512_mul_ps(xv, _mm512_set1_ps(ws[m * ws_stride])) : xv;
    float* a = acc + m * ld;
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(tile + m * 16)));
    _mm512_storeu_ps(a, _mm512_fmadd_ps(v, sc, _mm512_loadu_ps(a)));
  }
}

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t* scratch) {
  if (n < kAmxMinTokens) {
    vnni_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  const bool int4 = w.fmt == FMT_INT4;
  uint8_t* free_scratch = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  const int8_t* W = (const int8_t*)w.data;
  size_t ldw = w.row_bytes;
  if (int4) {
    unpack_int4(w, R, K, (int8_t*)free_scratch);
    W = (const int8_t*)free_scratch;
    ldw = (size_t)K;
    free_scratch += ((size_t)R * K + 63) & ~(size_t)63;
  }
  float* acc = (float*)free_scratch;                      // [32 rows][32 tokens]
  int32_t* tiles = (int32_t*)(free_scratch + 32 * 32 * 4);  // 4 x [16][16]
  const int groups = int4 ? K / w.group : 0, per = int4 ? w.group / kQBlock : 1;
  const int nkb = K / kQBlock, ntb = (n + 15) / 16;
  const size_t tbb = token_block_bytes(K);
  const uint8_t* X = (const uint8_t*)xp;
  configure_tiles();
  for (int r0 = 0; r0 < R; r0 += 32) {
    for (int tb = 0; tb < ntb; tb += 2) {
      const bool two = tb + 1 < ntb;
      const uint8_t* x0 = X + (size_t)tb * tbb;
      const uint8_t* x1 = two ? x0 + tbb : x0;
      const float* xs0 = (const float*)(x0 + (size_t)nkb * kBlockBytes);
      const float* xs1 = (const float*)(x1 + (size_t)nkb * kBlockBytes);
      std::memset(acc, 0, 32 * 32 * 4);
      for (int b = 0; b < nkb; ++b) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, W + (size_t)r0 * ldw + b * kQBlock, ldw);
        _tile_loadd(5, W + (size_t)(r0 + 16) * ldw + b * kQBlock, ldw);
        _tile_loadd(6, x0 + (size_t)b * kBlockBytes, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
        if (two) {
          _tile_loadd(7, x1 + (size_t)b * kBlockBytes, 64);
          _tile_dpbssd(1, 4, 7);
          _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, tiles, 64);
        _tile_stored(2, tiles + 512, 64);
        if (two) {
          _tile_stored(1, tiles + 256, 64);
          _tile_stored(3, tiles + 768, 64);
        }
        // int4: the group scale of rows r0 + m at block b; int8: the row scale comes last.
        const float* ws0 = int4 ? w.scales + (size_t)r0 * groups + b / per : nullptr;
        const float* ws1 = int4 ? ws0 + (size_t)16 * groups : nullptr;
        scale_add(tiles, xs0 + b * 16, ws0, groups, acc, 32);
        scale_add(tiles + 512, xs0 + b * 16, ws1, groups, acc + 16 * 32, 32);
        if (two) {
          scale_add(tiles + 256, xs1 + b * 16, ws0, groups, acc + 16, 32);
          scale_add(tiles + 768, xs1 + b * 16, ws1, groups, acc + 16 * 32 + 16, 32);
        }
      }
      for (int j = 0; j < (two ? 32 : 16) && tb * 16 + j < n; ++j) {
        float* c = C + (size_t)(tb * 16 + j) * ldc + r0;
        for (int m = 0; m < 32; ++m) c[m] = acc[m * 32 + j] * (int4 ? 1.f : w.scales[r0 + m]);
      }
    }
  }
  _tile_release();
}

}  // namespace

KernelSet kernels_amx_int8() { return {"amx-int8", prep_bytes, prep, gemm, scratch_bytes}; }

}  // namespace tandem_cpu
