#include "thread_pool.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PRECAST_PAUSE() _mm_pause()
#else
#define PRECAST_PAUSE() std::this_thread::yield()
#endif

namespace precast {
namespace {
constexpr int kSpinIterations = 200000;  // roughly a millisecond of polling before sleeping

void range_of(int64_t n, int parts, int index, int64_t& begin, int64_t& end) {
  begin = n * index / parts;
  end = n * (index + 1) / parts;
}
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  job_ = &fn;
  job_n_ = n;
  pending_.store(int(workers_.size()), std::memory_order_relaxed);
  {
    // Publishing under the mutex pairs with a worker's check-then-sleep, so no wake-up is lost.
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  if (sleeping_.load() > 0) wake_cv_.notify_all();
  int64_t begin, end;
  range_of(n, num_threads(), 0, begin, end);
  if (begin < end) fn(begin, end);
  while (pending_.load(std::memory_order_acquire) > 0) PRECAST_PAUSE();
  job_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  while (true) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < kSpinIterations) {
      PRECAST_PAUSE();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_cv_.wait(lock, [&] { return generation_.load() != seen; });
      sleeping_.fetch_sub(1);
    }
    if (stop_) return;
    seen = generation_.load(std::memory_order_acquire);
    int64_t begin, end;
    range_of(job_n_, num_threads(), index, begin, end);
    if (begin < end) (*job_)(begin, end);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace precast
