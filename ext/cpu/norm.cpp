#include "norm.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace tandem_cpu {
namespace {

inline float bf16_f32(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

constexpr int kLanes = 16;  // partial sums of the squares: a fixed order, vectorizable

__attribute__((target_clones("avx512f", "avx2", "default"))) void norm_row(
    const uint16_t* x, const uint16_t* delta, uint16_t* sum, const uint16_t* weight,
    uint16_t* out, int64_t dim, float eps, float* row) {
  for (int64_t d = 0; d < dim; ++d) {
    float v = bf16_f32(x[d]);
    if (delta) {
      sum[d] = f32_to_bf16(v + bf16_f32(delta[d]));
      v = bf16_f32(sum[d]);
    }
    row[d] = v;
  }
  float part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += row[d + l] * row[d + l];
  for (int l = 0; d < dim; ++d, ++l) part[l] += row[d] * row[d];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  const float r = 1.f / std::sqrt(part[0] / (float)dim + eps);
  for (d = 0; d < dim; ++d)
    out[d] = f32_to_bf16(bf16_f32(weight[d]) * bf16_f32(f32_to_bf16(row[d] * r)));
}

}  // namespace

void rms_norm_bf16(const uint16_t* x, const uint16_t* delta, uint16_t* sum,
                   const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim, float eps) {
  std::vector<float> row(dim);
  for (int64_t t = 0; t < rows; ++t)
    norm_row(x + t * dim, delta ? delta + t * dim : nullptr, delta ? sum + t * dim : nullptr,
             weight, out + t * dim, dim, eps, row.data());
}

}  // namespace tandem_cpu
