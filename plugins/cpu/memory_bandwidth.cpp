#include "memory_bandwidth.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace precast {

double memory_bandwidth(const std::string& kind, int64_t bytes_per_array, int num_threads, int repeats) {
  const int arrays = kind == "read" ? 1 : kind == "copy" ? 2 : kind == "triad" ? 3 : 0;
  if (arrays == 0) throw std::invalid_argument("kind must be read, copy or triad");
  const int64_t n = bytes_per_array / int64_t(sizeof(float));
  ThreadPool pool(num_threads);
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  pool.parallel_for(n, [&](int64_t lo, int64_t hi) {  // first touch by the thread that will use the pages
    std::fill(a.get() + lo, a.get() + hi, 1.0f);
    std::fill(b.get() + lo, b.get() + hi, 2.0f);
    std::fill(c.get() + lo, c.get() + hi, 3.0f);
  });
  std::vector<double> sums(num_threads * 16, 0.0);  // keeps the read loop from being optimized away
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, [&](int64_t lo, int64_t hi) {
      float* pa = a.get();
      const float* pb = b.get();
      const float* pc = c.get();
      if (arrays == 1) {
        // 64 independent partial sums: the compiler vectorizes them (4 vectors of 16), so the
        // loop is bound by memory, not by the latency of one long chain of additions.
        float acc[64] = {0};
        int64_t i = lo;
        for (; i + 64 <= hi; i += 64)
          for (int j = 0; j < 64; ++j) acc[j] += pa[i + j];
        for (; i < hi; ++i) acc[0] += pa[i];
        float total = 0;
        for (float v : acc) total += v;
        sums[(lo * num_threads / std::max<int64_t>(n, 1)) * 16] += total;
      } else if (arrays == 2) {
        for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i];
      } else {
        for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + 0.5f * pc[i];
      }
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(arrays) * double(n) * sizeof(float) / seconds);
  }
  volatile double sink = 0;
  for (double s : sums) sink = sink + s;
  return best;
}

}  // namespace precast
