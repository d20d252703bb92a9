// A fixed pool of worker threads for data-parallel kernels.
//
// parallel_for(n, fn) splits [0, n) into one contiguous range per thread and calls
// fn(begin, end) on each; the caller's thread takes the first range. Splitting depends
// only on n and the thread count, never on timing, so results are reproducible.
//
// A decode step issues hundreds of small parallel loops, so waking sleeping threads each
// time (tens of microseconds) would dominate. Workers therefore spin on an atomic job
// counter after each job, and the caller on the pending count, both for a bounded time
// (kSpinTime) before they sleep on a condition variable. The bound is what keeps the pool
// from collapsing when another process shares the cores: a thread whose partner was
// descheduled stops burning the core that partner needs and waits for it instead.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace precast {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return int(workers_.size()) + 1; }
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void work(int index);
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_cv_;  // workers sleep here for the next job
  std::condition_variable done_cv_;  // the caller sleeps here for the last worker
  std::atomic<bool> caller_waiting_{false};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace precast
