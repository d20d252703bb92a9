#include "memory_bandwidth.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "thread_pool.h"

namespace precast {
namespace {

// The sum of a[lo, hi) with as many loads in flight as the core allows: 8 independent 16-lane
// accumulators (512 bytes per iteration), so the loop is bound by memory, never by the latency of
// the additions. Fewer (the compiler's 4 from a 64-float loop) left a Zen 5 core at half its stream
// rate: 35 GB/s for two threads where torch.sum read 65.
float sum_range(const float* a, int64_t lo, int64_t hi) {
  int64_t i = lo;
  float total = 0.0f;
#if defined(__AVX512F__)
  __m512 acc[8];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (; i + 128 <= hi; i += 128)
    for (int k = 0; k < 8; ++k) acc[k] = _mm512_add_ps(acc[k], _mm512_loadu_ps(a + i + 16 * k));
  for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_ps(acc[0], acc[k]);
  total = _mm512_reduce_add_ps(acc[0]);
#else
  float acc[128] = {0};  // the compiler vectorizes this into as many vector accumulators as it has registers
  for (; i + 128 <= hi; i += 128)
    for (int j = 0; j < 128; ++j) acc[j] += a[i + j];
  for (float v : acc) total += v;
#endif
  for (; i < hi; ++i) total += a[i];
  return total;
}

}  // namespace

double memory_bandwidth(const std::string& kind, int64_t bytes_per_array, int num_threads, int repeats) {
  const int arrays = kind == "read" ? 1 : kind == "copy" ? 2 : kind == "triad" ? 3 : 0;
  if (arrays == 0) throw std::invalid_argument("kind must be read, copy or triad");
  const int64_t n = bytes_per_array / int64_t(sizeof(float));
  ThreadPool pool(num_threads);
  std::unique_ptr<float[]> a(new float[n]), b(new float[n]), c(new float[n]);
  pool.parallel_for(n, [&](int64_t lo, int64_t hi) {  // pages touched before any pass is timed
    std::fill(a.get() + lo, a.get() + hi, 1.0f);
    std::fill(b.get() + lo, b.get() + hi, 2.0f);
    std::fill(c.get() + lo, c.get() + hi, 3.0f);
  });
  std::atomic<int64_t> sink{0};  // keeps the read loop from being optimized away
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.parallel_for(n, [&](int64_t lo, int64_t hi) {
      float* pa = a.get();
      const float* pb = b.get();
      const float* pc = c.get();
      if (arrays == 1) {
        sink.fetch_add(int64_t(sum_range(pa, lo, hi)), std::memory_order_relaxed);
      } else if (arrays == 2) {
        for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i];
      } else {
        for (int64_t i = lo; i < hi; ++i) pa[i] = pb[i] + 0.5f * pc[i];
      }
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(arrays) * double(n) * sizeof(float) / seconds);
  }
  return sink.load() < 0 ? 0.0 : best;  // never negative: the sums are of positive numbers
}

}  // namespace precast
