// What the host CPU can execute. Kernels choose their code path from this at run
// time, so one build of precast._C runs on any x86-64 (and elsewhere, scalar only).
#pragma once

#include <string>

namespace precast {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512_vnni = false;
  bool avx512_bf16 = false;
  // AMX tiles with BF16 dot products, and the OS let this process use them (Linux asks each
  // process to request the tile state with arch_prctl before its first tile instruction).
  bool amx_bf16 = false;
  int logical_cores = 1;
};

// Detected once (cpuid + OS support for the wider registers), then cached.
const CpuFeatures& cpu_features();

// The widest vector instruction set that precast kernels will use on this host:
// "avx512", "avx2" or "scalar".
std::string best_isa();

}  // namespace precast
