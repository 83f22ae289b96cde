// Run-time ISA detection (CPUID + XGETBV + Linux arch_prctl for AMX) and kernel selection.
// Compiled for baseline x86-64: nothing here may use an instruction the CPU might lack.
#include "isa.h"

#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TANDEM_X86 1
#endif

namespace tandem_cpu {
namespace {

#ifdef TANDEM_X86
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((uint64_t)edx << 32) | eax;
}

// Linux keeps AMX tile data disabled until a process asks for it.
bool request_amx_permission() {
#ifdef SYS_arch_prctl
  const long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
  unsigned long bitmask = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) != 0) return false;
  return (bitmask >> XFEATURE_XTILEDATA) & 1;
#else
  return false;
#endif
}
#endif

CpuCaps probe() {
  CpuCaps caps;
#ifdef TANDEM_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return caps;
  const bool osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
  if (!osxsave) return caps;
  const uint64_t xcr0 = xgetbv0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0, a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  __cpuid_count(7, 0, a7, b7, c7, d7);
  if (a7 >= 1) __cpuid_count(7, 1, a71, b71, c71, d71);
  const bool avx2 = (b7 >> 5) & 1;
  const bool avx512f = (b7 >> 16) & 1, avx512bw = (b7 >> 30) & 1, avx512vl = (b7 >> 31) & 1;
  const bool avx512vnni = (c7 >> 11) & 1, avx512bf16 = (a71 >> 5) & 1;
  const bool amx_bf16 = (d7 >> 22) & 1, amx_tile = (d7 >> 24) & 1, amx_int8 = (d7 >> 25) & 1;
  caps.avx2 = os_avx && avx2 && fma && f16c;
  caps.avx512 = caps.avx2 && os_avx512 && avx512f && avx512bw && avx512vl && avx512vnni && avx512bf16;
  caps.vnni = os_avx512 && avx512f && avx512bw && avx512vl && avx512vnni;
  caps.amx = caps.avx512 && os_amx && amx_tile && amx_bf16 && amx_int8 && request_amx_permission();
#ifdef TANDEM_AMX_EMULATE
  // Emulated tiles (ext/cpu/amx_emulate.h; tests): the AMX units' other code is AVX-512.
  caps.amx = caps.avx512;
#endif
#endif
#ifndef TANDEM_HAVE_AVX2
  caps.avx2 = false;
#endif
#ifndef TANDEM_HAVE_AVX512
  caps.avx512 = false;
#endif
#ifndef TANDEM_HAVE_AMX
  caps.amx = false;
#endif
#ifndef TANDEM_HAVE_VNNI
  caps.vnni = false;
#endif
  return caps;
}

}  // namespace

const CpuCaps& cpu_caps() {
  static const CpuCaps caps = probe();
  return caps;
}

std::vector<std::string> supported_isas() {
  const CpuCaps& c = cpu_caps();
  std::vector<std::string> out{"scalar"};
  if (c.avx2) out.push_back("avx2");
  if (c.avx512) out.push_back("avx512");
  if (c.amx) out.push_back("amx");
  return out;
}

KernelSet select_kernels(const std::string& want) {
  const std::vector<std::string> have = supported_isas();
  std::string name = want.empty() ? have.back() : want;
  bool ok = false;
  for (const auto& h : have) ok = ok || h == name;
  if (!ok) {
    std::string list;
    for (const auto& h : have) list += (list.empty() ? "" : ", ") + h;
    throw std::invalid_argument("CPU ISA '" + name + "' is not available on this CPU or build "
                                "(available: " + list + ")");
  }
#ifdef TANDEM_HAVE_AMX
  if (name == "amx") return kernels_amx();
#endif
#ifdef TANDEM_HAVE_AVX512
  if (name == "avx512") return kernels_avx512();
#endif
#ifdef TANDEM_HAVE_AVX2
  if (name == "avx2") return kernels_avx2();
#endif
  return kernels_scalar();
}

KernelSet select_int_kernels(const std::string& isa, int fmt, int group) {
  const CpuCaps& c = cpu_caps();
  (void)c;
  (void)fmt;
  (void)group;
#ifdef TANDEM_HAVE_AMX_INT8
  if (isa == "amx" && c.amx && c.vnni) return kernels_amx_int8(fmt, group);
#endif
#ifdef TANDEM_HAVE_VNNI
  if ((isa == "amx" || isa == "avx512") && c.vnni) return kernels_vnni();
#endif
  (void)isa;
  return KernelSet{nullptr, nullptr, nullptr, nullptr};
}

}  // namespace tandem_cpu
