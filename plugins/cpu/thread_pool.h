// A fixed pool of worker threads for data-parallel kernels.
//
// parallel_for(n, fn) splits [0, n) into one contiguous range per thread and calls
// fn(begin, end) on each; the caller's thread takes the first range. Splitting depends
// only on n and the thread count, never on timing, so results are reproducible.
//
// A decode step issues hundreds of small parallel loops, so waking sleeping threads each
// time (tens of microseconds) would dominate. Workers therefore spin briefly on an atomic
// job counter after each job and only then sleep on a condition variable.
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
  std::condition_variable wake_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace precast
