// Portable dense-linear kernel: fp32 activations, weights widened one element at a time.
#include "linear.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int Kp, int M) { return (size_t)Kp * M * sizeof(float); }

void prep(const void* x, bool x_bf16, int M, int K, int Kp, void* dst) {
  float* d = (float*)dst;
  for (int t = 0; t < M; ++t) {
    for (int k = 0; k < K; ++k)
      d[(size_t)t * Kp + k] = x_bf16 ? bf16_to_f32(((const uint16_t*)x)[(size_t)t * K + k])
                                     : ((const float*)x)[(size_t)t * K + k];
    for (int k = K; k < Kp; ++k) d[(size_t)t * Kp + k] = 0.f;
  }
}

void rows(const LinearArgs& a, const void* xp, int r0, int r1) {
  const float* X = (const float*)xp;
  float w[kKAlign];
  for (int r = r0; r < r1; ++r) {
    for (int t0 = 0; t0 < a.M; t0 += 64) {
      const int nt = a.M - t0 < 64 ? a.M - t0 : 64;
      float acc[64];
      for (int t = 0; t < nt; ++t) acc[t] = 0.f;
      for (int k0 = 0; k0 < a.K; k0 += kKAlign) {
        const int n = a.K - k0 < kKAlign ? a.K - k0 : kKAlign;
        for (int j = 0; j < n; ++j) w[j] = linear_weight(a, r, k0 + j);
        for (int t = 0; t < nt; ++t) {
          const float* x = X + (size_t)(t0 + t) * a.Kp + k0;
          float s = 0.f;
          for (int j = 0; j < n; ++j) s += w[j] * x[j];
          acc[t] += s;
        }
      }
      for (int t = 0; t < nt; ++t) linear_store(a, t0 + t, r, acc[t]);
    }
  }
}

}  // namespace

LinearKernels linear_kernels_scalar() { return {"scalar", prep_bytes, prep, rows}; }

}  // namespace tandem_cpu
