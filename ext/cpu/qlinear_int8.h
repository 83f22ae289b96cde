// The int8-activation layout shared by the integer qlinear kernels (Q4_0 / Q4_1 / Q8_0):
// per token, per group of 4 weight blocks (128 activations), kQ8GroupBytes bytes:
//   [0, 64)    int8: the first 16 quantized values of blocks 0..3 (16 each, in block order)
//   [64, 128)  int8: their last 16 values
//   [128, 192) fp32 x16: block j's scale in lanes 4j..4j+3
//   [192, 256) fp32 x16: block j's scale * sum of its int8 values / 4, same lanes
// A block past K (the last group's padding) is all zeros.
#pragma once

namespace tandem_cpu {

constexpr int kQ8GroupBytes = 256;

inline int q8_group_count(int K) { return (K / 32 + 3) / 4; }

}  // namespace tandem_cpu
