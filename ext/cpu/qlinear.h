// Dense linear over GGUF-packed weights for the CPU: y[M, N] = x[M, K] @ W[N, K]^T, W read in
// its own block layout (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), dequantized in registers. Each
// (row, token) sum is taken in one fixed order whatever M is, so a row's result does not depend
// on the batch it was computed in. Plain C++; knows nothing of Python, torch or models.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "helpers.h"
#include "kernels.h"

namespace tandem_cpu {

// ggml type ids (the GGUF file's own numbers), then the HF formats' serving layouts
// (models/quant/int4.py, fp8.py): int4 codes with fp16 group scales and uint8 zero points
// (GPTQ, AWQ), and e4m3 values with fp32 block scales (FP8). Those two: AVX-512 kernel only.
enum QType : int {
  QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q5_K = 13, QT_Q6_K = 14,
  QT_INT4G = 100, QT_FP8 = 101,
};

// Bytes and elements of one block of a type; 0 for a type this unit does not serve.
int qtype_block_elems(int qtype);
int qtype_block_bytes(int qtype);

struct QLinearArgs {
  int qtype = 0;
  const uint8_t* w = nullptr;  // [N][row_bytes], row_bytes = K / block_elems * block_bytes
  size_t row_bytes = 0;
  int N = 0, K = 0, M = 0;     // K: a multiple of the type's block
  void* y = nullptr;           // [M][N] fp32 or bf16
  bool y_bf16 = false;
  // QT_INT4G: scales [N][K / group] fp16, zeros [N][K / group] uint8.
  // QT_FP8: scales [ceil(N / block_rows)][scale_cols] fp32, one per block_rows x block_cols.
  const void* scales = nullptr;
  const uint8_t* zeros = nullptr;
  int group = 0, block_rows = 0, block_cols = 0, scale_cols = 0;
};

// prep: x [M][K] (fp32 or bf16) into the ISA's activation layout followed by fp32 sums of
// every 32 consecutive (converted) activations [M][K / 32] (the min terms of Q4_1 / k-quants).
struct QLinearKernels {
  const char* name;
  size_t (*prep_bytes)(int K, int M);
  void (*prep)(const void* x, bool x_bf16, int M, int K, void* dst);
  void (*rows)(const QLinearArgs& a, const void* xp, int r0, int r1);
  bool kquants = false;  // an int8 kernel that also serves Q4_K / Q5_K / Q6_K
};

static inline void qlinear_store(const QLinearArgs& a, int t, int r, float v) {
  if (a.y_bf16) ((uint16_t*)a.y)[(size_t)t * a.N + r] = f32_to_bf16(v);
  else ((float*)a.y)[(size_t)t * a.N + r] = v;
}

QLinearKernels qlinear_kernels_scalar();
#ifdef TANDEM_HAVE_AVX512
QLinearKernels qlinear_kernels_avx512();
#endif
#ifdef TANDEM_HAVE_VNNI
QLinearKernels qlinear_kernels_vnni();  // Q4_0 / Q4_1 / Q8_0 and the k-quants
#endif
void qlinear_vnni_k_rows(const QLinearArgs& a, const void* xp, int r0, int r1);  // vnni's k-quants
#ifdef TANDEM_HAVE_AVX2
QLinearKernels qlinear_kernels_avx2_int8();  // the same, without AVX-512
#endif

// Whether int8-activation kernels `k` serve `qtype`.
inline bool int8_serves(const QLinearKernels& k, int qtype) {
  if (!k.name) return false;
  if (qtype == QT_Q4_0 || qtype == QT_Q4_1 || qtype == QT_Q8_0) return true;
  return k.kquants && (qtype == QT_Q4_K || qtype == QT_Q5_K || qtype == QT_Q6_K);
}

class QLinearPool {
 public:
  // Helpers sleep as soon as a call is done (spinning between a decode step's calls took a
  // core from everything else on a shared machine), and are woken only for a call of at least
  // kHelpMinBytes of weights: a smaller one is over before a woken helper would start.
  static constexpr int kHelperSpinUs = 0;
  static constexpr size_t kHelpMinBytes = 1 << 20;
  QLinearPool(int num_threads, const std::string& isa, bool int8 = true);
  ~QLinearPool();
  void run(const QLinearArgs& a, const void* x, bool x_bf16);  // synchronous, serialized
  std::string isa() const { return kernels_.name; }
  std::string int8_isa() const { return ints_.name ? ints_.name : ""; }  // "" when none
  bool int8_serves(int qtype) const { return tandem_cpu::int8_serves(ints_, qtype); }
  int num_threads() const { return helpers_ ? helpers_->size() + 1 : 1; }

 private:
  QLinearKernels kernels_;
  QLinearKernels ints_{nullptr, nullptr, nullptr, nullptr};
  std::unique_ptr<HelperCrew> helpers_;
  std::mutex mu_;
  std::vector<uint8_t> xprep_;
};

}  // namespace tandem_cpu
