// The AMX tile configuration block (ldtilecfg's 64-byte operand), shared by the AMX units
// (kernels_amx.cpp: bf16, kernels_amx_int8.cpp: int8). Plain data: no instruction here.
#pragma once

#include <cstdint>

namespace tandem_cpu {

struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace tandem_cpu
