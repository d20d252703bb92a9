// The scheduler decides which requests run in the next step, in two stages:
//   1. running requests first (FCFS), each asking for its remaining tokens (1 when
//      decoding), within the step's token budget; when KV blocks run out, the latest
//      running request is preempted (blocks freed, recomputed later) until the rest fit;
//   2. then waiting requests, by admission policy, while the budget, max_batch_size and
//      KV blocks allow; their cached prefix (if any) is skipped.
// With chunked prefill a prompt longer than the remaining budget runs in chunks over
// several steps; decodes are scheduled first, so they are never starved by prefills.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "kv_cache_manager.h"
#include "request.h"
#include "sampler.h"

namespace precast {

struct RequestState {
  RequestId id = 0;
  Request request;
  std::vector<TokenId> tokens;  // prompt, then output
  int num_prompt = 0;
  int num_computed = 0;       // tokens whose K/V are in the cache
  int num_cached_prompt = 0;  // prompt tokens served by prefix reuse at first admission
  uint64_t arrival = 0;
  bool admitted_once = false;
  int num_prompt_logprobs = 0;  // prompt positions whose next-token log-probability was reported
  SamplerState sampler;
  Response pending;  // output not yet handed to the client (all of it, for non-streaming requests)
  RequestState(RequestId id_, Request req, uint64_t arrival_, uint64_t seed)
      : id(id_), request(std::move(req)), arrival(arrival_), sampler(seed) {
    tokens = request.prompt;
    num_prompt = int(tokens.size());
  }
  int num_output() const { return int(tokens.size()) - num_prompt; }
};

struct ScheduledRequest {
  RequestState* state;
  int num_tokens;
  bool sample;
};

struct SchedulerConfig {
  int max_batch_size = 64;
  int max_num_tokens = 2048;
  bool chunked_prefill = true;
};

// Which waiting request is admitted next: higher priority first, then arrival order.
class AdmissionPolicy {
 public:
  virtual ~AdmissionPolicy() = default;
  virtual bool before(const RequestState& a, const RequestState& b) const = 0;
};

class PriorityFcfsPolicy : public AdmissionPolicy {
 public:
  bool before(const RequestState& a, const RequestState& b) const override {
    return a.request.priority != b.request.priority ? a.request.priority > b.request.priority : a.arrival < b.arrival;
  }
};

class Scheduler {
 public:
  Scheduler(SchedulerConfig config, KvCacheManager& kv, std::unique_ptr<AdmissionPolicy> policy);

  void add(std::unique_ptr<RequestState> state);
  std::vector<ScheduledRequest> schedule();
  // Remove a request wherever it is, freeing its blocks; returns it (or null if unknown).
  std::unique_ptr<RequestState> remove(RequestId id);

  int num_waiting() const { return int(waiting_.size()); }
  int num_running() const { return int(running_.size()); }
  int64_t num_preemptions() const { return preemptions_; }
  const std::vector<std::unique_ptr<RequestState>>& running() const { return running_; }
  std::vector<RequestId> waiting_ids() const {  // in admission order
    std::vector<RequestId> ids;
    for (const auto& r : waiting_) ids.push_back(r->id);
    return ids;
  }

 private:
  void preempt_last();
  SchedulerConfig config_;
  KvCacheManager& kv_;
  std::unique_ptr<AdmissionPolicy> policy_;
  std::vector<std::unique_ptr<RequestState>> running_;  // admission order
  std::deque<std::unique_ptr<RequestState>> waiting_;   // kept in policy order
  int64_t preemptions_ = 0;
};

}  // namespace precast
