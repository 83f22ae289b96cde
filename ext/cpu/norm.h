// RMSNorm of bf16 rows on the CPU, optionally after a residual add, in one pass per row:
// HF's LlamaRMSNorm (mean of squares in fp32, the normalized row rounded to bf16, then times
// the bf16 weight, rounded). Plain C++; knows nothing of Python, torch or models.
#pragma once

#include <cstdint>

namespace tandem_cpu {

// rows x [T][D] bf16. delta (or null): [T][D] bf16; then sum [T][D] receives x + delta
// (rounded to bf16) and that sum is normalized. out: [T][D] bf16. No output may alias an input.
void rms_norm_bf16(const uint16_t* x, const uint16_t* delta, uint16_t* sum,
                   const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim, float eps);

}  // namespace tandem_cpu
