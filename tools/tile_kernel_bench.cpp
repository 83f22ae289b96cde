// One thread, one AMX int8 kernel call at a time (ext/cpu/kernels_amx_int8.cpp): TSC ticks per
// 64-row work item, per weight format and token count, with the rows hot (one item, in L1/L2)
// or streamed (a 256 MB buffer). Builds against the pool's sources; needs a CPU with AMX:
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512bf16 \
//     -mavx512vnni -mamx-tile -mamx-int8 -DTANDEM_HAVE_VNNI -DTANDEM_HAVE_AMX_INT8 \
//     -o /tmp/tile_kernel_bench tools/tile_kernel_bench.cpp ext/cpu/kernels_amx_int8.cpp \
//     ext/cpu/kernels_vnni.cpp && /tmp/tile_kernel_bench
#include <sys/syscall.h>
#include <unistd.h>
#include <x86intrin.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../ext/cpu/kernels.h"

using namespace tandem_cpu;

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) {
    std::perror("arch_prctl");
    return 1;
  }
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int R = kRowBlock, group = 32;
  for (int K : {2048, 768}) {
    for (int fmt : {FMT_INT8, FMT_INT4}) {
      const KernelSet ks = kernels_amx_int8(fmt);
      const size_t rb = fmt == FMT_INT8 ? (size_t)K : (size_t)K / 2;
      const int spr = fmt == FMT_INT8 ? 1 : K / group;
      const size_t item = (size_t)R * rb, big = (size_t)256 << 20;
      const size_t items = big / item;
      std::vector<uint8_t> w(items * item);
      for (size_t i = 0; i < w.size(); ++i) w[i] = (uint8_t)rng();
      std::vector<float> scales((size_t)R * spr, 0.01f);
      std::vector<uint8_t> scratch(ks.scratch_bytes(R, K) + 4096);
      for (int n : {8, 16, 32, 64}) {
        std::vector<std::vector<float>> xs(n, std::vector<float>(K));
        std::vector<const float*> xp(n);
        for (int t = 0; t < n; ++t) {
          for (float& v : xs[t]) v = u(rng);
          xp[t] = xs[t].data();
        }
        std::vector<uint8_t> prep(ks.prep_bytes(K, n) + 64);
        ks.prep(xp.data(), K, K, n, prep.data());
        std::vector<float> C((size_t)n * R);
        for (int hot = 1; hot >= 0; --hot) {
          const int calls = hot ? 2000 : (int)items;
          for (int i = 0; i < 50; ++i)
            ks.gemm({fmt, w.data(), rb, scales.data(), group, true}, R, K, prep.data(), n, C.data(),
                    R, scratch.data());
          const uint64_t t0 = __rdtsc();
          for (int i = 0; i < calls; ++i) {
            const uint8_t* d = w.data() + (hot ? 0 : (size_t)i * item);
            ks.gemm({fmt, d, rb, scales.data(), group, true}, R, K, prep.data(), n, C.data(), R,
                    scratch.data());
          }
          const double tk = double(__rdtsc() - t0) / calls;
          std::printf("K %4d %s n %2d %-6s %8.0f ticks/item  %6.2f ticks per 16x64 tdpbssd-equivalent"
                      "  %5.2f GB/s at 2.1 GHz\n",
                      K, fmt == FMT_INT8 ? "int8" : "int4", n, hot ? "hot" : "stream", tk,
                      tk / ((R / 16.0) * (K / 64.0) * ((n + 15) / 16)), item / (tk / 2.1));
        }
      }
    }
  }
  return 0;
}
