// Portable kernels: plain C++, compiled for baseline x86-64 (or any other CPU).
#include "kernels.h"

namespace tandem_cpu {
namespace {

size_t prep_bytes(int K, int n) { return (size_t)K * n * sizeof(float); }

void prep(const float* const* x, int Kv, int K, int n, void* dst) {
  float* d = (float*)dst;
  for (int t = 0; t < n; ++t) {
    std::memcpy(d + (size_t)t * K, x[t], sizeof(float) * Kv);
    std::memset(d + (size_t)t * K + Kv, 0, sizeof(float) * (K - Kv));
  }
}

void gemm(const WeightView& w, int R, int K, const void* xp, int n, float* C, int ldc,
          uint8_t* scratch) {
  const float* X = (const float*)xp;
  float* row = (float*)scratch;
  for (int r = 0; r < R; ++r) {
    dequant_row(w, r, K, row);
    for (int t = 0; t < n; ++t) {
      const float* x = X + (size_t)t * K;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int k = 0; k < K; k += 4) {
        s0 += row[k] * x[k];
        s1 += row[k + 1] * x[k + 1];
        s2 += row[k + 2] * x[k + 2];
        s3 += row[k + 3] * x[k + 3];
      }
      C[(size_t)t * ldc + r] = (s0 + s1) + (s2 + s3);
    }
  }
}

}  // namespace

KernelSet kernels_scalar() { return {"scalar", prep_bytes, prep, gemm}; }

}  // namespace tandem_cpu
