// A fixed pool of worker threads for data-parallel kernels.
//
// parallel_for(n, fn) splits [0, n) into one contiguous range per thread and calls
// fn(begin, end) on each; the caller's thread takes the first range. Splitting depends
// only on n and the thread count, never on timing, so results are reproducible.
#pragma once

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
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace precast
