// AMX kernels (Sapphire Rapids and later): tdpbf16ps on 16x16 fp32 tiles.
//
// The weight rows are the A operand, loaded straight from the row-major bf16 layout (16 rows x
// 32 elements per tile); the tokens are the B operand, packed once per expert and phase into
// the VNNI pair layout [token block][k chunk][16 k pairs][w tokens][2], blocks of w = 16 tokens
// but the last, which holds the rest (1-16): an expert with 3 tokens stores, and its tiles load,
// 3 token columns, not 16 of which 13 are zeros. Each C tile is 16 weight rows x w tokens.
// int8/int4 rows are widened to bf16 once per work item.
// Below kAmxMinTokens tokens (kernels.h; 1 by default) the AVX-512 kernel runs instead.
// Compiled with the AVX-512 flags plus -mamx-tile -mamx-bf16 -mamx-int8; used only after CPUID
// reports AMX and the kernel granted XTILEDATA through arch_prctl.
#include <immintrin.h>

#include <algorithm>

#include "amx_tiles.h"
#include "kernels.h"

namespace tandem_cpu {
namespace {

// Tiles 0-3: C, 4-5: A (weights), 6-7: B (tokens) (amx_tiles.h: configure_tiles_n).

// Tokens an expert from which the tiles run: kAmxMinTokens, or TANDEM_AMX_BF16_MIN_TOKENS (read
// once, when the first pool picks its kernels).
int min_tokens = kAmxMinTokens;

size_t prep_bytes(int K, int n) { return (size_t)K * n * 2; }

// Tokens in block b of n tokens (16 but the last).
inline int block_width(int n, int b) { return n - 16 * b < 16 ? n - 16 * b : 16; }

void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  if (n < min_tokens) {
    kernels_avx512().prep(x, Kv, K, n, dst);
    return;
  }
  const int nb = (n + 15) / 16, kcs = K / 32;
  // Element (token t = 16 b + j, k) goes to block b (16 * K * 2 bytes apart), chunk k / 32 of it
  // (64 w bytes apart, w = the block's tokens), then [(k % 32) / 2][j][k % 2]. Chunk by chunk
  // within a block, so each chunk's 4-byte stores land in one small block (in L1) rather than
  // all over the token block (the int8 preps gained 13-20% from the same order: BENCHMARKS,
  // session 10).
  alignas(64) uint16_t row[32];
  for (int b = 0; b < nb; ++b) {
    const int w = block_width(n, b);
    uint32_t* blk = (uint32_t*)((uint8_t*)dst + (size_t)b * 16 * K * 2);
    for (int c = 0; c < kcs; ++c) {
      const int k0 = c * 32, va = Kv - k0, vb = Kv - k0 - 16;
      uint32_t* out = blk + (size_t)c * 16 * w;
      for (int j = 0; j < w; ++j) {
        const float* src = x[b * 16 + j];
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        if (va > 0) lo = _mm512_maskz_loadu_ps(va >= 16 ? 0xffff : (__mmask16)((1u << va) - 1), src + k0);
        if (vb > 0) hi = _mm512_maskz_loadu_ps(vb >= 16 ? 0xffff : (__mmask16)((1u << vb) - 1), src + k0 + 16);
        _mm512_store_si512((void*)row, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        // 16 pairs (32-bit words) scattered with a stride of w words.
        const uint32_t* pairs = (const uint32_t*)row;
        for (int p = 0; p < 16; ++p) out[p * w + j] = pairs[p];
      }
    }
  }
}

// add: C += the tile (a later K segment's share), else C = the tile.
void store_tile(float* tmp, float* C, int ldc, int r0, int t0, int n, const float* rowscale,
                bool add) {
  // tmp[m][j]: weight row r0 + m, token t0 + j.
  for (int j = 0; j < 16 && t0 + j < n; ++j) {
    float* c = C + (size_t)(t0 + j) * ldc + r0;
    for (int m = 0; m < 16; ++m) {
      const float v = tmp[m * 16 + j] * (rowscale ? rowscale[r0 + m] : 1.f);
      c[m] = add ? c[m] + v : v;
    }
  }
}

// Chunks of 32 K a segment: with several token blocks, K is cut so that a segment of the item's
// rows (R x 2 x 32 x this bytes: 512 KB for 64 rows) stays in L2 while every token block passes
// over it; the segments' shares are summed in C.
constexpr int kSegChunks = 128;

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t* scratch) {
  if (n < min_tokens) {
    avx512_gemm(w, R, K, xp, n, C, ldc, scratch);
    return;
  }
  const uint8_t* W = w.data;
  size_t ldw = w.row_bytes;
  const float* rowscale = w.fmt == FMT_INT8 ? w.scales : nullptr;
  uint8_t* free_scratch = scratch;
  if (w.fmt != FMT_BF16) {
    avx512_dequant_bf16(w, R, K, (uint16_t*)scratch);
    W = scratch;
    ldw = (size_t)K * 2;
    free_scratch += (size_t)R * K * 2;
  }
  float* tmp = (float*)(((uintptr_t)free_scratch + 63) & ~(uintptr_t)63);  // 4 x [16][16]
  const uint8_t* X = (const uint8_t*)xp;
  const int nb = (n + 15) / 16, kcs = K / 32;
  const size_t xblock = (size_t)kcs * 1024;  // bytes per full 16-token block
  // Tile widths in tokens (amx_tiles.h: configure_tiles_n), reloaded only when they change:
  // a narrow last block, or its single-block tail, needs its own.
  int cw0 = 0, cw1 = 0;
  auto widths = [&](int w0, int w1) {
    if (w0 == cw0 && w1 == cw1) return;
    configure_tiles_n(w0, w1);
    cw0 = w0;
    cw1 = w1;
  };
  // Token-block pairs outside the row pairs: a pair's activations (64 K bytes) are read from
  // memory once per work item and reused from L2 by every row pair, and the item's rows stay in
  // L2 across token blocks (row pairs outside re-read all of the expert's activations per 32
  // rows, from L3 once they outgrow L2).
  const int seg = nb > 1 ? kSegChunks : kcs;
  for (int c0 = 0; c0 < kcs; c0 += seg) {
    const int c1 = std::min(kcs, c0 + seg);
    const bool add = c0 > 0;
    int b = 0;
    for (; b + 2 <= nb; b += 2) {
      const int w1 = block_width(n, b + 1);  // block b is full (a block follows it)
      widths(16, w1);
      const uint8_t* x0 = X + (size_t)b * xblock;
      const uint8_t* x1 = x0 + xblock;
      for (int r0 = 0; r0 < R; r0 += 32) {
        const uint8_t* a0 = W + (size_t)r0 * ldw;
        const uint8_t* a1 = a0 + 16 * ldw;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = c0; c < c1; ++c) {
          prefetch_rows_l1(a0, ldw, c + 1, c1);
          _tile_loadd(4, a0 + c * 64, ldw);
          _tile_loadd(5, a1 + c * 64, ldw);
          _tile_loadd(6, x0 + (size_t)c * 1024, 64);
          _tile_loadd(7, x1 + (size_t)c * 64 * w1, 4 * w1);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, tmp, 64);
        _tile_stored(1, tmp + 256, 64);
        _tile_stored(2, tmp + 512, 64);
        _tile_stored(3, tmp + 768, 64);
        store_tile(tmp, C, ldc, r0, b * 16, n, rowscale, add);
        store_tile(tmp + 256, C, ldc, r0, b * 16 + 16, n, rowscale, add);
        store_tile(tmp + 512, C, ldc, r0 + 16, b * 16, n, rowscale, add);
        store_tile(tmp + 768, C, ldc, r0 + 16, b * 16 + 16, n, rowscale, add);
      }
    }
    if (b < nb) {
      const int w0 = block_width(n, b);
      widths(w0, cw1 ? cw1 : 16);  // tiles 1, 3 and 7 unused here: keep their width
      const uint8_t* x0 = X + (size_t)b * xblock;
      for (int r0 = 0; r0 < R; r0 += 32) {
        const uint8_t* a0 = W + (size_t)r0 * ldw;
        const uint8_t* a1 = a0 + 16 * ldw;
        _tile_zero(0);
        _tile_zero(2);
        for (int c = c0; c < c1; ++c) {
          prefetch_rows_l1(a0, ldw, c + 1, c1);
          _tile_loadd(4, a0 + c * 64, ldw);
          _tile_loadd(5, a1 + c * 64, ldw);
          _tile_loadd(6, x0 + (size_t)c * 64 * w0, 4 * w0);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
        }
        _tile_stored(0, tmp, 64);
        _tile_stored(2, tmp + 512, 64);
        store_tile(tmp, C, ldc, r0, b * 16, n, rowscale, add);
        store_tile(tmp + 512, C, ldc, r0 + 16, b * 16, n, rowscale, add);
      }
    }
  }
  _tile_release();
}

}  // namespace

KernelSet kernels_amx() {
  static const int from_env = min_tokens_from_env("TANDEM_AMX_BF16_MIN_TOKENS", kAmxMinTokens);
  min_tokens = from_env;
  return {"amx", prep_bytes, prep, gemm, nullptr, avx512_silu_mul};
}

}  // namespace tandem_cpu
