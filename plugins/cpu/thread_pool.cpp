#include "thread_pool.h"

#include <algorithm>
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
constexpr int kClockEvery = 64;            // pauses between clock reads
constexpr int64_t kChunksPerThread = 4;    // enough that a stalled thread's share is small
constexpr uint32_t kClosed = 0xffffffffu;  // chunk index: nothing may be claimed

uint64_t state_of(uint32_t generation, uint32_t next_chunk) { return (uint64_t(generation) << 32) | next_chunk; }
uint32_t generation_of(uint64_t state) { return uint32_t(state >> 32); }

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
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { work(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    state_.store(state_of(++generation_, kClosed));
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
  const auto chunks = uint32_t(std::min<int64_t>(n, kChunksPerThread * num_threads()));
  // Close the previous job (all its chunks ran: the previous call waited for them) before its
  // fields change; then publish the new job under the mutex, which pairs with a worker's
  // check-then-sleep so that no wake-up is lost.
  state_.exchange(state_of(generation_, kClosed), std::memory_order_acq_rel);
  job_.store(&fn, std::memory_order_relaxed);
  job_n_.store(n, std::memory_order_relaxed);
  job_chunks_.store(chunks, std::memory_order_relaxed);
  finished_.store(0, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state_.store(state_of(++generation_, 0), std::memory_order_release);
  }
  if (sleeping_.load() > 0) wake_cv_.notify_all();
  run_chunks(generation_);
  auto all_finished = [&] { return finished_.load(std::memory_order_acquire) == chunks; };
  if (!spin_until(all_finished)) {
    // seq_cst on caller_waiting_ and finished_ (here and in run_chunks): either the thread that
    // finishes the last chunk sees the flag and notifies, or this wait's predicate sees it done.
    std::unique_lock<std::mutex> lock(mutex_);
    caller_waiting_.store(true);
    done_cv_.wait(lock, [&] { return finished_.load() == chunks; });
    caller_waiting_.store(false);
  }
}

void ThreadPool::run_chunks(uint32_t generation) {
  while (true) {
    uint64_t state = state_.load(std::memory_order_acquire);
    if (generation_of(state) != generation) return;
    // Read after the state: if the caller has closed this job since, the claim below fails.
    const uint32_t chunks = job_chunks_.load(std::memory_order_relaxed);
    const uint32_t chunk = uint32_t(state);
    if (chunk >= chunks) return;  // all claimed (or closed)
    const int64_t n = job_n_.load(std::memory_order_relaxed);
    const auto* fn = job_.load(std::memory_order_relaxed);
    if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel)) continue;
    (*fn)(n* chunk / chunks, n * (chunk + 1) / chunks);
    if (finished_.fetch_add(1) + 1 == chunks && caller_waiting_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::work() {
  uint32_t seen = 0;
  auto published = [&] { return generation_of(state_.load(std::memory_order_acquire)) != seen; };
  while (true) {
    if (!spin_until(published)) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_cv_.wait(lock, published);
      sleeping_.fetch_sub(1);
    }
    if (stop_) return;
    seen = generation_of(state_.load(std::memory_order_acquire));
    run_chunks(seen);
  }
}

}  // namespace precast
