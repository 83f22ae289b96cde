// What the AMX units (kernels_amx.cpp: bf16, kernels_amx_int8.cpp: int8) share: the tile
// configuration block (ldtilecfg's 64-byte operand), the configurations they load, the L1
// prefetch of their weight rows and the reading of their token thresholds from the environment.
// Included only by those units, which build with the AMX flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#ifdef TANDEM_AMX_EMULATE
#include "amx_emulate.h"  // tests on CPUs without AMX (ext/cpu/build.py)
#endif

namespace tandem_cpu {

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// ldtilecfg of the whole 64-byte block. GCC's _tile_loadconfig declares its operand as one
// pointer-sized object, so the compiler may treat the stores of colsb/rows as dead and drop them
// (seen with GCC 12: an all-zero colsb, and ldtilecfg faults with #GP on real AMX); here the
// operand is the block itself. The emulator keeps its own definition.
static inline void load_tile_config(const AmxTileConfig& cfg) {
#ifdef TANDEM_AMX_EMULATE
  _tile_loadconfig(&cfg);
#else
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
#endif
}

// The bf16 unit's configuration for token blocks of w0 and w1 tokens (1-16): C tiles 0 and 2
// and B tile 6 are w0 tokens wide (4 * w0 bytes a row), C tiles 1 and 3 and B tile 7 w1; the A
// tiles 4-5 16 rows x 64 bytes. Narrow blocks let an expert with few tokens load only its own
// tokens' columns (kernels_amx.cpp).
static inline void configure_tiles_n(int w0, int w1) {
  AmxTileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    const int w = t == 0 || t == 2 || t == 6 ? w0 : t == 1 || t == 3 || t == 7 ? w1 : 16;
    cfg.colsb[t] = (uint16_t)(4 * w);
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}

// All 8 tiles 16 rows x 64 bytes (the int8 unit's one configuration).
static inline void configure_tiles() { configure_tiles_n(16, 16); }

// Chunk c (64 bytes of each row) of the 32 rows from a0 (ldw apart) to L1, one chunk ahead of
// their tile loads, which otherwise wait on L2 or memory line by line. (Software prefetches of
// the next rows to L2 cost 10-25% against the hardware's own streaming: tools/amx_stream_bench.cpp,
// BENCHMARKS session 11.) Nothing past the last chunk.
static inline void prefetch_rows_l1(const void* a0, size_t ldw, int c, int chunks) {
  if (c >= chunks) return;
  for (int r = 0; r < 32; ++r)
    _mm_prefetch((const char*)a0 + r * ldw + (size_t)c * 64, _MM_HINT_T0);
}

// Tokens an expert from which a unit's tiles run: the positive int in env `name`, else
// `fallback` (ext/cpu/pool.py refuses a bad value before any pool starts).
static inline int min_tokens_from_env(const char* name, int fallback) {
  const char* v = std::getenv(name);
  const int t = v ? std::atoi(v) : 0;
  return t > 0 ? t : fallback;
}

}  // namespace tandem_cpu
