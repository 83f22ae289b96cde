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
};

const CpuCaps& cpu_caps();
// Ordered from slowest to fastest: "scalar", then those the CPU and the build have.
std::vector<std::string> supported_isas();
// want: "" for the best available, or one of supported_isas(); otherwise invalid_argument.
KernelSet select_kernels(const std::string& want);

}  // namespace tandem_cpu
