// What single AMX tile operations cost on this CPU (TSC ticks per loop iteration, data in L1),
// the numbers behind the design of ext/cpu/kernels_amx_int8.cpp (BENCHMARKS, session 9):
//   g++ -O2 -mamx-tile -mamx-int8 -mavx512f -o /tmp/amx_tile_ops tools/amx_tile_ops.cpp
//   /tmp/amx_tile_ops
// Linux only (asks the kernel for the AMX tile state first); needs a CPU with AMX.
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <chrono>
struct alignas(64) Cfg { uint8_t p, s, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) int8_t A[16 * 4096];
alignas(64) int8_t B[16 * 64 * 64];
alignas(64) int32_t Cb[4][256];
static void cfg(int acols, int brows) {
  Cfg c; memset(&c, 0, sizeof c); c.p = 1;
  for (int i = 0; i < 4; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  c.colsb[4] = c.colsb[5] = acols; c.rows[4] = c.rows[5] = 16;
  c.colsb[6] = c.colsb[7] = 64; c.rows[6] = c.rows[7] = brows;
  _tile_loadconfig(&c);
}
int main() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) {
    std::perror("arch_prctl(ARCH_REQ_XCOMP_PERM)");
    return 1;
  }
  memset(A, 1, sizeof A); memset(B, 1, sizeof B);
  const int N = 200000;
  auto t = [&](const char* name, auto f) {
    f(1000);
    auto t0 = std::chrono::steady_clock::now(); uint64_t c0 = __rdtsc();
    f(N);
    uint64_t c1 = __rdtsc(); auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / N;
    printf("%-50s %7.1f tsc/iter %7.2f ns/iter\n", name, double(c1 - c0) / N, ns);
  };
  cfg(64, 16);
  t("dp only, one C (serial)", [](int n) { for (int i = 0; i < n; ++i) _tile_dpbssd(0, 4, 6); });
  t("dp only, 4 C tiles", [](int n) { for (int i = 0; i < n; ++i) { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 6); _tile_dpbssd(2, 5, 7); _tile_dpbssd(3, 5, 7);} });
  t("load A(stride 64)+B + dp, one C", [](int n) { for (int i = 0; i < n; ++i) { _tile_loadd(4, A + (i & 15) * 1024, 64); _tile_loadd(6, B + (i & 15) * 1024, 64); _tile_dpbssd(0, 4, 6);} });
  t("load A(stride 2048)+B + dp, one C", [](int n) { for (int i = 0; i < n; ++i) { _tile_loadd(4, A + (i & 31) * 64, 2048); _tile_loadd(6, B + (i & 15) * 1024, 64); _tile_dpbssd(0, 4, 6);} });
  t("zero+load+dp+store, one C", [](int n) { for (int i = 0; i < n; ++i) { _tile_zero(0); _tile_loadd(4, A + (i & 15) * 1024, 64); _tile_loadd(6, B + (i & 15) * 1024, 64); _tile_dpbssd(0, 4, 6); _tile_stored(0, Cb[i & 3], 64);} });
  t("store only", [](int n) { for (int i = 0; i < n; ++i) _tile_stored(0, Cb[i & 3], 64); });
  t("zero only", [](int n) { for (int i = 0; i < n; ++i) _tile_zero(0); });
  t("load only (A stride 64)", [](int n) { for (int i = 0; i < n; ++i) _tile_loadd(4, A + (i & 15) * 1024, 64); });
  t("ldtilecfg+release", [](int n) { for (int i = 0; i < n; ++i) { cfg(64, 16); _tile_release(); } });
  cfg(32, 8);
  t("K32: zero+2 loads+dp+store, 2 C alternating", [](int n) { for (int i = 0; i < n; i += 2) {
    _tile_zero(0); _tile_loadd(4, A + (i & 15) * 1024, 2048); _tile_loadd(6, B + (i & 15) * 512, 64); _tile_dpbssd(0, 4, 6); _tile_stored(0, Cb[i & 3], 64);
    _tile_zero(1); _tile_loadd(5, A + (i & 15) * 1024 + 32, 2048); _tile_loadd(7, B + (i & 15) * 512 + 512, 64); _tile_dpbssd(1, 5, 7); _tile_stored(1, Cb[(i + 1) & 3], 64);} });
  _tile_release();
}
