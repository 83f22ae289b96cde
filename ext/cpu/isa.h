// Which kernel set this CPU can run.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace tandem_cpu {

struct CpuCaps {
  bool avx2 = false;    // AVX2 + FMA + F16C, OS saves YMM
  bool avx512 = false;  // F/BW/VL/VNNI/BF16, OS saves ZMM
  bool amx = false;     // AMX tile/bf16/int8 and XTILEDATA granted by the kernel
  bool vnni = false;    // AVX512 F/BW/VL/VNNI, OS saves ZMM (the integer path)
};

const CpuCaps& cpu_caps();
// Ordered from slowest to fastest: "scalar", then those the CPU and the build have.
std::vector<std::string> supported_isas();
// want: "" for the best available, or one of supported_isas(); otherwise invalid_argument.
KernelSet select_kernels(const std::string& want);
// The integer path (kernels.h: kQBlock) that goes with kernel set `isa` (a name from
// supported_isas()): "amx-int8" with "amx", "vnni" with "avx512" (the CPU has VNNI), else none
// (name null): the scalar and AVX2 sets keep widening int8/int4 weights to floats. fmt: the
// weights' format; FMT_INT8 gives the set for packed int8 rows (AMX: 16-bit activations),
// anything else the set for int4 and natural int8 rows; FMT_INT4 with group kTileQBlock4 the
// set for int4 in groups of 64 (AMX: activations in blocks of 64 on the tiles).
KernelSet select_int_kernels(const std::string& isa, int fmt, int group = 0);

}  // namespace tandem_cpu
