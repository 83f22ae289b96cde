// Software AMX for testing the AMX units on CPUs without it (build with TANDEM_CPU_AMX_EMULATE=1:
// ext/cpu/build.py). Replaces the tile intrinsics the units use with plain C++ on per-thread
// tile registers, with the hardware's shape rules checked: a tile op whose operands' rows and
// column bytes do not fit each other aborts, as the hardware would fault or compute garbage.
// Included by amx_tiles.h after <immintrin.h> (whose include guard keeps the real macros from
// coming back). Slow (scalar); never in a normal build.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tandem_cpu {
namespace amx_emu {

struct State {
  uint8_t tile[8][16][64];
  int colsb[8] = {}, rows[8] = {};
  bool configured = false;
};
inline thread_local State st;

[[noreturn]] inline void fail(const char* what, int t) {
  std::fprintf(stderr, "emulated AMX: %s (tile %d)\n", what, t);
  std::abort();
}

inline void check_tile(int t) {
  if (!st.configured) fail("tile op before ldtilecfg", t);
  if (t < 0 || t > 7 || st.rows[t] == 0) fail("tile not configured", t);
}

inline void loadconfig(const void* p) {
  const uint8_t* c = (const uint8_t*)p;
  if (c[0] != 1) fail("palette must be 1", -1);
  for (int t = 0; t < 8; ++t) {
    uint16_t cb;
    std::memcpy(&cb, c + 16 + 2 * t, 2);
    st.colsb[t] = cb;
    st.rows[t] = c[48 + t];
    if (st.colsb[t] > 64 || st.rows[t] > 16 || (st.rows[t] == 0) != (st.colsb[t] == 0))
      fail("bad tile shape in the configuration", t);
  }
  std::memset(st.tile, 0, sizeof(st.tile));  // ldtilecfg zeroes the tiles
  st.configured = true;
}

inline void release() {
  st.configured = false;
  std::memset(st.tile, 0, sizeof(st.tile));
}

inline void loadd(int t, const void* base, long stride) {
  check_tile(t);
  for (int r = 0; r < st.rows[t]; ++r)
    std::memcpy(st.tile[t][r], (const uint8_t*)base + r * stride, st.colsb[t]);
}

inline void stored(int t, void* base, long stride) {
  check_tile(t);
  for (int r = 0; r < st.rows[t]; ++r)
    std::memcpy((uint8_t*)base + r * stride, st.tile[t][r], st.colsb[t]);
}

inline void zero(int t) {
  check_tile(t);
  std::memset(st.tile[t], 0, sizeof(st.tile[t]));
}

// C[m][n] (4 bytes) += sum over the 4-byte groups p of A's row m and B's row p at column n.
inline void check_dp(int c, int a, int b) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  if (st.rows[a] != st.rows[c] || st.colsb[b] != st.colsb[c] || st.colsb[a] / 4 != st.rows[b])
    fail("operand shapes do not match", c);
}

inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  check_dp(c, a, b);
  for (int m = 0; m < st.rows[c]; ++m)
    for (int n = 0; n < st.colsb[c] / 4; ++n) {
      float acc;
      std::memcpy(&acc, &st.tile[c][m][4 * n], 4);
      for (int p = 0; p < st.colsb[a] / 4; ++p) {
        const uint8_t* x = &st.tile[a][m][4 * p];
        const uint8_t* y = &st.tile[b][p][4 * n];
        acc += bf16(x) * bf16(y) + bf16(x + 2) * bf16(y + 2);
      }
      std::memcpy(&st.tile[c][m][4 * n], &acc, 4);
    }
}

inline void dpbssd(int c, int a, int b) {
  check_dp(c, a, b);
  for (int m = 0; m < st.rows[c]; ++m)
    for (int n = 0; n < st.colsb[c] / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &st.tile[c][m][4 * n], 4);
      for (int p = 0; p < st.colsb[a] / 4; ++p)
        for (int i = 0; i < 4; ++i)
          acc += (int32_t)(int8_t)st.tile[a][m][4 * p + i] * (int8_t)st.tile[b][p][4 * n + i];
      std::memcpy(&st.tile[c][m][4 * n], &acc, 4);
    }
}

}  // namespace amx_emu
}  // namespace tandem_cpu

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#define _tile_loadconfig(p) ::tandem_cpu::amx_emu::loadconfig(p)
#define _tile_release() ::tandem_cpu::amx_emu::release()
#define _tile_loadd(t, base, stride) ::tandem_cpu::amx_emu::loadd(t, base, (long)(stride))
#define _tile_stored(t, base, stride) ::tandem_cpu::amx_emu::stored(t, base, (long)(stride))
#define _tile_zero(t) ::tandem_cpu::amx_emu::zero(t)
#define _tile_dpbf16ps(c, a, b) ::tandem_cpu::amx_emu::dpbf16ps(c, a, b)
#define _tile_dpbssd(c, a, b) ::tandem_cpu::amx_emu::dpbssd(c, a, b)
