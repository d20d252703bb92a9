#include "thread_pool.h"

namespace precast {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

static void range_of(int64_t n, int parts, int index, int64_t& begin, int64_t& end) {
  begin = n * index / parts;
  end = n * (index + 1) / parts;
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    pending_ = int(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  int64_t begin, end;
  range_of(n, num_threads(), 0, begin, end);
  if (begin < end) fn(begin, end);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
    }
    int64_t begin, end;
    range_of(n, num_threads(), index, begin, end);
    if (begin < end) (*job)(begin, end);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

}  // namespace precast
