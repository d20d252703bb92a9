// STREAM-like memory bandwidth probes: the hardware limit that batch-1 decode (which
// streams every weight once per token) is measured against in benchmarks/compare_cpu.py.
#pragma once

#include <cstdint>
#include <string>

namespace precast {

// Best bytes/s over `repeats` passes of `kind` on arrays of `bytes_per_array` bytes each:
//   "read"   s += a[i]                 (bytes counted: 1 array)
//   "copy"   a[i] = b[i]               (2 arrays)
//   "triad"  a[i] = b[i] + q * c[i]    (3 arrays)
// split over `num_threads` threads (chunks claimed as in every parallel loop).
double memory_bandwidth(const std::string& kind, int64_t bytes_per_array, int num_threads, int repeats);

}  // namespace precast
