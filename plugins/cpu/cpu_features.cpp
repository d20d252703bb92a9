#include "cpu_features.h"

#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define PRECAST_X86 1
#endif

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace precast {
namespace {

#ifdef PRECAST_X86
// XGETBV reads which register states the OS saves on context switch; a CPU may
// support AVX-512 while the OS does not, and then using it faults.
unsigned long long read_xcr0() {
  unsigned int eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

// Linux keeps AMX's 8 KB tile state off until a process asks for it; without the grant the
// first tile instruction faults.
bool request_amx_state() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
  unsigned int hw = std::thread::hardware_concurrency();
  f.logical_cores = hw == 0 ? 1 : static_cast<int>(hw);
#ifdef PRECAST_X86
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = ecx & (1u << 27);
  const bool avx = ecx & (1u << 28);
  f.fma = ecx & (1u << 12);
  f.f16c = ecx & (1u << 29);
  if (!osxsave || !avx) return f;
  const unsigned long long xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;    // SSE + AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;  // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_ymm) {
    f.fma = f.f16c = false;
    return f;
  }
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return f;
  f.avx2 = ebx & (1u << 5);
  if (os_zmm) {
    f.avx512f = ebx & (1u << 16);
    f.avx512bw = ebx & (1u << 30);
    f.avx512vl = ebx & (1u << 31);
    f.avx512_vnni = ecx & (1u << 11);
    unsigned int eax1 = 0, ebx1 = 0, ecx1 = 0, edx1 = 0;
    if (__get_cpuid_count(7, 1, &eax1, &ebx1, &ecx1, &edx1)) f.avx512_bf16 = eax1 & (1u << 5);
    const bool amx_tile = edx & (1u << 24), amx_bf16 = edx & (1u << 22);
    const bool os_tiles = (xcr0 & 0x60000) == 0x60000;  // XTILECFG + XTILEDATA
    f.amx_bf16 = amx_tile && amx_bf16 && os_tiles && f.avx512_bf16 && request_amx_state();
  }
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

std::string best_isa() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl) return "avx512";
  if (f.avx2 && f.fma) return "avx2";
  return "scalar";
}

}  // namespace precast
