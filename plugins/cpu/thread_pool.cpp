#include "thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PRECAST_PAUSE() _mm_pause()
#else
#define PRECAST_PAUSE() std::this_thread::yield()
#endif

namespace precast {
namespace {
// How long a thread polls before it sleeps: longer than the gaps between one decode step's
// parallel loops (microseconds), short enough that a contended core is given up quickly.
constexpr auto kSpinTime = std::chrono::microseconds(500);
constexpr int kClockEvery = 64;  // pauses between clock reads

// Polls `done` until it is true or kSpinTime has passed; returns its last value.
template <typename Done>
bool spin_until(const Done& done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
  for (int i = 1;; ++i) {
    if (done()) return true;
    PRECAST_PAUSE();
    if (i % kClockEvery == 0 && std::chrono::steady_clock::now() > deadline) return done();
  }
}

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
  if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    // seq_cst on caller_waiting_ and pending_ (here and in work): either the last worker sees the
    // flag and notifies, or this wait's predicate sees the count at zero; no wake-up is lost.
    std::unique_lock<std::mutex> lock(mutex_);
    caller_waiting_.store(true);
    done_cv_.wait(lock, [&] { return pending_.load() == 0; });
    caller_waiting_.store(false);
  }
  job_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  while (true) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
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
    if (pending_.fetch_sub(1) == 1 && caller_waiting_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_cv_.notify_one();
    }
  }
}

}  // namespace precast
