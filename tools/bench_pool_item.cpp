// One work item of the CPU pool's AMX kernel sets (ext/cpu): R = 64 weight rows of K times n
// tokens, as ExpertPool::run_step hands it to KernelSet::gemm, timed on one thread over `items`
// different random items (so the weights are not all in L2), best of `reps`, and checked against
// an fp32 product of the dequantized rows (relative L2 error; int formats include their
// activation quantization, ~1e-2). Builds in seconds, without the pool:
//   bash tools/bench_pool_item.sh [OTHER_EXT_CPU_DIR]      # sweep; with a dir: A/B against it
//   ./bench_pool_item K n items reps fmt [group]            # fmt 0 bf16, 1 int8, 2 int4
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels.h"

using namespace tandem_cpu;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s K n items reps fmt [group]\n", argv[0]);
    return 2;
  }
  syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
  const int K = std::atoi(argv[1]), n = std::atoi(argv[2]), items = std::atoi(argv[3]);
  const int reps = std::atoi(argv[4]), fmt = std::atoi(argv[5]);
  const int group = argc > 6 ? std::atoi(argv[6]) : 64, R = 64;
  if (K % kKAlign || n < 1 || items < 1 || reps < 1 || fmt < 0 || fmt > 2) return 2;
#ifdef BENCH_ITEM_NO_GROUP  // a tree from before kernels_amx_int8 took the group
  const KernelSet ks = fmt == FMT_BF16 ? kernels_amx() : kernels_amx_int8(fmt);
#else
  const KernelSet ks = fmt == FMT_BF16 ? kernels_amx() : kernels_amx_int8(fmt, group);
#endif
  std::mt19937 rng(1);
  const size_t rb = row_bytes(fmt, K), spr = fmt == FMT_INT4 ? K / group : 1;
  std::vector<uint8_t> W((size_t)items * R * rb);
  for (auto& b : W) b = (uint8_t)rng();
  if (fmt == FMT_BF16)  // finite values, |x| < 0.03
    for (size_t i = 1; i < W.size(); i += 2) W[i] = 0x3c + (W[i] & 1);
  std::vector<float> S((size_t)items * R * spr);
  for (auto& s : S) s = 0.01f + (float)(rng() % 100) * 1e-4f;
  std::normal_distribution<float> nd;
  std::vector<float> x((size_t)n * K);
  for (auto& v : x) v = nd(rng);
  std::vector<const float*> rows(n);
  for (int t = 0; t < n; ++t) rows[t] = x.data() + (size_t)t * K;
  std::vector<uint8_t> xp(ks.prep_bytes(K, n) + 64);
  ks.prep(rows.data(), K, K, n, xp.data());
  std::vector<uint8_t> scratch(kernel_scratch_bytes(ks, R, K) + 64);
  std::vector<float> C((size_t)n * R);
  auto view = [&](int it) {  // int rows as the pool keeps them on such CPUs: packed
    return WeightView{fmt, W.data() + (size_t)it * R * rb, rb, S.data() + (size_t)it * R * spr,
                      group, fmt != FMT_BF16};
  };
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < items; ++it) ks.gemm(view(it), R, K, xp.data(), n, C.data(), R, scratch.data());
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, dt / items);
  }
  // C holds the last item's product: check it against fp32 on the dequantized rows.
  std::vector<float> w(K);
  double err = 0, ref2 = 0;
  for (int m = 0; m < R; ++m) {
    dequant_row(view(items - 1), m, K, w.data());
    for (int t = 0; t < n; ++t) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += (double)w[k] * x[(size_t)t * K + k];
      const double d = C[(size_t)t * R + m] - ref;
      err += d * d;
      ref2 += ref * ref;
    }
  }
  const double rel = std::sqrt(err / std::max(ref2, 1e-30));
  std::printf("fmt=%d K=%d n=%d: %.2f us/item %.0f GMAC/s rel_err %.1e\n", fmt, K, n, best * 1e6,
              (double)R * n * K / best / 1e9, rel);
  return rel < 5e-2 ? 0 : 1;
}
