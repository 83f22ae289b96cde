// Neox-style rotary embedding of bf16 heads on the CPU, in place, with torch's rounding steps
// (x * cos and rotate_half(x) * sin each rounded to bf16, then their sum), so the result is
// bitwise that of ext/attention_ref.py's rotate_neox. Plain C++; knows nothing of torch.
#pragma once

#include <cstdint>

namespace tandem_cpu {

// x: [T][H][D] bf16 with strides (token_stride, head_stride, 1) in elements; cos, sin:
// [T][D] bf16, contiguous. Rotates every head of every token in place.
void rope_neox_bf16(uint16_t* x, int64_t tokens, int64_t heads, int64_t dim,
                    int64_t token_stride, int64_t head_stride, const uint16_t* cos,
                    const uint16_t* sin);

}  // namespace tandem_cpu
