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

// Adaptive draft length for one request: per-token acceptance estimated from recent steps
// (decayed counts of accepted and rejected drafts), and the number of drafts that maximises
// expected tokens per unit of step cost, when each draft token costs `draft_token_cost` of a
// plain decode step and the i-th is kept with probability acceptance^i.
struct SpeculationState {
  double accepted = 0.0, rejected = 0.0;
  double acceptance() const { return (accepted + 1.0) / (accepted + rejected + 2.0); }
  void observe(int num_draft, int num_accepted) {
    constexpr double kDecay = 0.8;  // about the last five steps
    accepted = kDecay * accepted + num_accepted;
    rejected = kDecay * rejected + (num_accepted < num_draft ? 1.0 : 0.0);
  }
  int best_num_draft(int max_draft, double draft_token_cost) const {
    const double a = acceptance();
    int best = 1;
    double best_rate = 0.0, expected = 1.0, a_pow = 1.0;  // expected tokens with k drafts: 1 + a + ... + a^k
    for (int k = 1; k <= max_draft; ++k) {
      a_pow *= a;
      expected += a_pow;
      const double rate = expected / (1.0 + draft_token_cost * k);
      if (rate > best_rate) best_rate = rate, best = k;
    }
    return best;
  }
};

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
  std::vector<TokenId> draft;  // speculative decoding: tokens proposed to follow `tokens` in this step
  SpeculationState speculation;
  int num_draft_tokens = 0;  // drafts checked and accepted over the request's life
  int num_accepted_draft_tokens = 0;
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
  int num_tokens;  // computed this step, drafts included
  bool sample;
  int num_draft = 0;  // the last num_draft of them are the request's draft tokens, each checked this step
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
