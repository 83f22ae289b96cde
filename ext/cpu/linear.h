// Dense linear for small M (decode) on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
// Each call splits W's rows among the caller and a few pinned worker threads, so every weight
// byte is streamed once and dotted against all M activation rows (converted once per call).
// Plain C++: pointers in, no Python and no torch. Knows nothing about experts or models.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels.h"
#include "workers.h"

namespace tandem_cpu {

// Weights, read in place (never copied):
//   bf16: [N][K] uint16, row stride K (no padding; torch's own bf16 tensor).
//   int8: [N][Kp] int8, scales [N] fp32: value = q * scale (Kp = K rounded up to 64, zeros).
//   int4: [N][Kp / 2] bytes, scales [N][Kp / group] fp32, the expert pool's nibble layout
//         (kernels.h): value = (nibble - 8) * scale.
//   bf16 VNNI (AVX-512 and AMX only): [ceil(N / 16)][Kp / 2][16][2] uint16, zeros past N and
//         K; w_row_bytes is the stride of one 16-column block (Kp * 32). Each output is summed
//         over K in the same order for every M, so a row's result is independent of the batch
//         (the AMX kernel's order is its own: its sums may differ from AVX-512's in the last
//         bits, never with M).
constexpr int FMT_BF16_VNNI = 3;

struct LinearArgs {
  int fmt = FMT_BF16;
  const uint8_t* w = nullptr;
  size_t w_row_bytes = 0;
  const float* scales = nullptr;
  int group = 0;
  int N = 0, K = 0, Kp = 0;  // Kp: K rounded up to kKAlign
  int M = 0;
  const float* bias = nullptr;  // [N] fp32 or null
  void* y = nullptr;            // [M][N] fp32 or bf16
  bool y_bf16 = false;
};

// Per ISA:
//   prep_bytes(Kp, M): bytes for the prepared activations.
//   prep(x, x_bf16, M, K, Kp, dst): x [M][K] (fp32 or bf16) into the ISA's layout, zero past K.
//   rows(a, xp, r0, r1): y[t][r] for r in [r0, r1), every t < M.
struct LinearKernels {
  const char* name;
  size_t (*prep_bytes)(int Kp, int M);
  void (*prep)(const void* x, bool x_bf16, int M, int K, int Kp, void* dst);
  void (*rows)(const LinearArgs& a, const void* xp, int r0, int r1);
};

static inline float linear_weight(const LinearArgs& a, int r, int k) {
  const uint8_t* row = a.w + (size_t)r * a.w_row_bytes;
  if (a.fmt == FMT_BF16) return bf16_to_f32(((const uint16_t*)row)[k]);
  if (a.fmt == FMT_INT8) return (float)((const int8_t*)row)[k] * a.scales[r];
  const int c = k / 64, j = k % 64;
  const uint8_t b = row[c * 32 + (j & 31)];
  const int q = (j < 32 ? (b & 15) : (b >> 4)) - 8;
  return (float)q * a.scales[(size_t)r * (a.Kp / a.group) + k / a.group];
}

static inline void linear_store(const LinearArgs& a, int t, int r, float v) {
  if (a.bias) v += a.bias[r];
  if (a.y_bf16) ((uint16_t*)a.y)[(size_t)t * a.N + r] = f32_to_bf16(v);
  else ((float*)a.y)[(size_t)t * a.N + r] = v;
}

LinearKernels linear_kernels_scalar();
#ifdef TANDEM_HAVE_AVX2
LinearKernels linear_kernels_avx2();
#endif
#ifdef TANDEM_HAVE_AVX512
LinearKernels linear_kernels_avx512();
#endif
#ifdef TANDEM_HAVE_AMX
// bf16 VNNI weights through AMX tiles (every M, batch-invariant); other formats: AVX-512.
LinearKernels linear_kernels_amx();
#endif

class LinearPool {
 public:
  // num_threads: threads computing a call, the caller included (>= 1); the other
  // num_threads - 1 are pinned workers that spin briefly after a call, then sleep. Calls of
  // fewer than parallel_min_rows rows run on the caller alone. Which thread computes a column
  // never changes its result.
  LinearPool(int num_threads, const std::string& isa, int parallel_min_rows = 1);
  ~LinearPool();
  // Synchronous; x [M][K] fp32 or bf16. Calls from several threads are serialized.
  void run(const LinearArgs& a, const void* x, bool x_bf16);
  std::string isa() const { return kernels_.name; }
  int num_threads() const { return workers_ ? workers_->size() + 1 : 1; }

 private:
  void work(const LinearArgs& a, const void* xp, int blocks, int block_rows);

  LinearKernels kernels_;
  std::unique_ptr<Workers> workers_;
  int parallel_min_rows_ = 1;
  std::mutex mu_;
  std::vector<uint8_t> xprep_;
  std::atomic<int> next_{0};
};

}  // namespace tandem_cpu
