// A fixed pool of worker threads for data-parallel kernels.
//
// parallel_for(n, fn) splits [0, n) into up to kChunksPerThread contiguous chunks per thread
// and calls fn(begin, end) on each; the caller's thread and the workers claim chunks one at a
// time until none is left. The split depends only on n and the thread count, never on timing
// (only which thread runs a chunk does), so results are reproducible. Claiming is what keeps
// the pool fast when another process shares the cores: a thread that was descheduled holds
// up at most the one chunk it claimed, while the others take the rest.
//
// A decode step issues hundreds of small parallel loops, so waking sleeping threads each
// time (tens of microseconds) would dominate. Workers therefore spin on the job state after
// each job, and the caller on the finished count, both for a bounded time (kSpinTime) before
// they sleep on a condition variable: a thread whose partner was descheduled stops burning
// the core that partner needs and waits for it instead.
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
  void work();
  void run_chunks(uint32_t generation);  // claims and runs chunks of that job until none is left
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_cv_;  // workers sleep here for the next job
  std::condition_variable done_cv_;  // the caller sleeps here for the last chunk
  std::atomic<bool> caller_waiting_{false};
  // The job's state in one word: generation (high 32 bits) and the next chunk to claim (low 32
  // bits). The caller closes it (kClosed) before it writes the next job's fields, so a worker
  // that read a stale or half-written job cannot claim anything with it: its claim, a
  // compare-exchange on this word, fails.
  std::atomic<uint64_t> state_{0};
  uint32_t generation_ = 0;  // the caller's copy
  // The current job (written by the caller while the state is closed, read by workers after they
  // see its generation published; atomics so that a stale read is not a data race).
  std::atomic<const std::function<void(int64_t, int64_t)>*> job_{nullptr};
  std::atomic<int64_t> job_n_{0};
  std::atomic<uint32_t> job_chunks_{0};
  std::atomic<uint32_t> finished_{0};  // chunks of the current job run to the end
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace precast
