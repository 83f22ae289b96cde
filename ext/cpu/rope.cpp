#include "rope.h"

#include <cstring>

#include "kernels.h"

namespace tandem_cpu {
namespace {

inline float bf16_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t round_bf16(float f) { return f32_to_bf16(f); }

__attribute__((target_clones("avx512f", "avx2", "default"))) void rotate_head(
    uint16_t* x, int64_t dim, const uint16_t* cos, const uint16_t* sin) {
  const int64_t half = dim / 2;
  float lo[512], hi[512];  // the head's two halves before rotation (dim <= 1024)
  for (int64_t d = 0; d < half; ++d) lo[d] = bf16_f32(x[d]), hi[d] = bf16_f32(x[d + half]);
  for (int64_t d = 0; d < half; ++d) {
    const float a = bf16_f32(round_bf16(lo[d] * bf16_f32(cos[d])));
    const float b = bf16_f32(round_bf16(-hi[d] * bf16_f32(sin[d])));
    x[d] = round_bf16(a + b);
    const float c = bf16_f32(round_bf16(hi[d] * bf16_f32(cos[d + half])));
    const float e = bf16_f32(round_bf16(lo[d] * bf16_f32(sin[d + half])));
    x[d + half] = round_bf16(c + e);
  }
}

}  // namespace

void rope_neox_bf16(uint16_t* x, int64_t tokens, int64_t heads, int64_t dim,
                    int64_t token_stride, int64_t head_stride, const uint16_t* cos,
                    const uint16_t* sin) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(x + t * token_stride + h * head_stride, dim, cos + t * dim, sin + t * dim);
}

}  // namespace tandem_cpu
