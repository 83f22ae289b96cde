// AMX-BF16 dense-linear kernel for the batch-invariant "bf16_vnni" weights: the tokens are the
// A operand (16 rows x 32 k, read in place from the prepared [M][Kp] bf16 activations), the
// weights the B operand (the VNNI layout's 16 k pairs x 16 columns is one 1 KB tile), and each
// C tile holds up to 16 tokens x 16 columns in fp32. Every output is accumulated from zero over
// the K chunks in order by tdpbf16ps, whatever M is and wherever its token sits in a tile (a
// lone decode row is a tile of one row), so a row's result does not depend on the batch.
// Other weight formats run the AVX-512 kernel. Compiled with the AMX flags; used only after
// CPUID reports AMX and the kernel granted XTILEDATA (isa.cpp).
#include <immintrin.h>

#include <cstring>

#include "amx_tiles.h"
#include "linear.h"

namespace tandem_cpu {

LinearKernels linear_kernels_avx512();  // linear.h declares it only for units built with defines

namespace {

// Tiles: C 0-1 (token block 0, column blocks 0-1), C 2-3 (token block 1), A 4-5 (token blocks
// 0 and 1, m0 and m1 rows), B 6-7 (column blocks 0 and 1).
void configure(int m0, int m1) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  const int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = (uint8_t)rows[t];
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// C tile c (m rows: tokens t0.., 16 columns from block nb) + bias -> y.
void store(const LinearArgs& a, int c, int t0, int m, int nb) {
  alignas(64) float tmp[16 * 16];
  if (c == 0) _tile_stored(0, tmp, 64);
  else if (c == 1) _tile_stored(1, tmp, 64);
  else if (c == 2) _tile_stored(2, tmp, 64);
  else _tile_stored(3, tmp, 64);
  const int n0 = nb * 16;
  const int cols = a.N - n0 < 16 ? a.N - n0 : 16;
  const __mmask16 mask = (__mmask16)((1u << cols) - 1);
  const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
  for (int t = 0; t < m; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(tmp + t * 16), b);
    const size_t at = (size_t)(t0 + t) * a.N + n0;
    if (a.y_bf16)
      _mm256_mask_storeu_epi16((uint16_t*)a.y + at, mask, (__m256i)_mm512_cvtneps_pbh(v));
    else
      _mm512_mask_storeu_ps((float*)a.y + at, mask, v);
  }
}

// TB token blocks (tokens t0.., m0 then m1 rows) against CB column blocks from nb.
template <int TB, int CB>
void block(const LinearArgs& a, const uint16_t* X, int t0, int m0, int m1, int nb) {
  const int chunks = a.Kp / 32;
  const size_t ldx = (size_t)a.Kp * 2;
  const uint8_t* x0 = (const uint8_t*)(X + (size_t)t0 * a.Kp);
  const uint8_t* x1 = x0 + 16 * ldx;
  const uint8_t* w0 = a.w + (size_t)nb * a.w_row_bytes;
  const uint8_t* w1 = w0 + a.w_row_bytes;
  _tile_zero(0);
  if (CB == 2) _tile_zero(1);
  if (TB == 2) _tile_zero(2);
  if (TB == 2 && CB == 2) _tile_zero(3);
  for (int c = 0; c < chunks; ++c) {
    _tile_loadd(4, x0 + (size_t)c * 64, ldx);
    if (TB == 2) _tile_loadd(5, x1 + (size_t)c * 64, ldx);
    _tile_loadd(6, w0 + (size_t)c * 1024, 64);
    if (CB == 2) _tile_loadd(7, w1 + (size_t)c * 1024, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if (TB == 2) _tile_dpbf16ps(2, 5, 6);
    if (TB == 2 && CB == 2) _tile_dpbf16ps(3, 5, 7);
  }
  store(a, 0, t0, m0, nb);
  if (CB == 2) store(a, 1, t0, m0, nb + 1);
  if (TB == 2) store(a, 2, t0 + 16, m1, nb);
  if (TB == 2 && CB == 2) store(a, 3, t0 + 16, m1, nb + 1);
}

void amx_rows(const LinearArgs& a, const uint16_t* X, int r0, int r1) {
  const int nb1 = (r1 + 15) / 16;
  int cfg0 = -1, cfg1 = -1;
  for (int nb = r0 / 16; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    for (int t = 0; t < a.M; t += 32) {
      const int m0 = a.M - t < 16 ? a.M - t : 16;
      const int rest = a.M - t - 16;
      const int m1 = rest <= 0 ? 0 : rest < 16 ? rest : 16;
      if (m0 != cfg0 || m1 != cfg1) {
        configure(m0, m1 ? m1 : m0);  // unused tiles get a valid shape
        cfg0 = m0, cfg1 = m1;
      }
      if (m1 && two) block<2, 2>(a, X, t, m0, m1, nb);
      else if (m1) block<2, 1>(a, X, t, m0, m1, nb);
      else if (two) block<1, 2>(a, X, t, m0, 0, nb);
      else block<1, 1>(a, X, t, m0, 0, nb);
    }
  }
  _tile_release();
}

LinearKernels avx512;

void rows(const LinearArgs& a, const void* xp, int r0, int r1) {
  if (a.fmt == FMT_BF16_VNNI) amx_rows(a, (const uint16_t*)xp, r0, r1);
  else avx512.rows(a, xp, r0, r1);
}

}  // namespace

// The AVX-512 set's activation layout ([M][Kp] bf16, zeros past K) is the A tiles' own.
LinearKernels linear_kernels_amx() {
  avx512 = linear_kernels_avx512();
  return {"amx", avx512.prep_bytes, avx512.prep, rows};
}

}  // namespace tandem_cpu
