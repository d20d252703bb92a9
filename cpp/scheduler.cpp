#include "scheduler.h"

#include <algorithm>

#include "check.h"

namespace precast {

Scheduler::Scheduler(SchedulerConfig config, KvCacheManager& kv, std::unique_ptr<AdmissionPolicy> policy)
    : config_(config), kv_(kv), policy_(std::move(policy)) {}

void Scheduler::add(std::unique_ptr<RequestState> state) {
  auto pos = std::upper_bound(waiting_.begin(), waiting_.end(), state,
                              [&](const auto& a, const auto& b) { return policy_->before(*a, *b); });
  waiting_.insert(pos, std::move(state));
}

void Scheduler::preempt_last() {
  // Recompute-style preemption: drop the KV, keep the tokens; the request re-enters the
  // waiting queue (ahead of later arrivals by the policy) and resumes where it stopped.
  std::unique_ptr<RequestState> victim = std::move(running_.back());
  running_.pop_back();
  kv_.free(victim->id);
  victim->num_computed = 0;
  victim->draft.clear();
  ++preemptions_;
  add(std::move(victim));
}

std::vector<ScheduledRequest> Scheduler::schedule() {
  std::vector<ScheduledRequest> out;
  int budget = config_.max_num_tokens;

  // Stage 1: running requests, oldest first. A preempted request is always the newest,
  // so the loop index stays valid.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    RequestState& r = *running_[i];
    int n = int(r.tokens.size()) - r.num_computed;
    PRECAST_CHECK(n >= 1, "running request " << r.id << " has nothing to compute");
    if (n > budget) {
      if (!config_.chunked_prefill) break;
      n = budget;
    }
    // Draft tokens (speculative decoding) ride along where the budget and the KV blocks allow; they are
    // dropped before anyone is preempted for them.
    int num_draft = std::min(int(r.draft.size()), budget - n);
    bool fits = kv_.allocate(r.id, r.num_computed + n + num_draft);
    if (!fits && num_draft > 0) {
      num_draft = 0;
      fits = kv_.allocate(r.id, r.num_computed + n);
    }
    if (!fits) {
      r.draft.clear();
      if (running_.size() - 1 == i) {  // r itself is the newest: preempt it and stop
        preempt_last();
        break;
      }
      preempt_last();
      continue;  // retry r with the freed blocks
    }
    r.draft.resize(num_draft);
    out.push_back({&r, n + num_draft, r.num_computed + n == int(r.tokens.size()), num_draft});
    budget -= n + num_draft;
    ++i;
  }

  // Stage 2: admit waiting requests while everything fits.
  while (!waiting_.empty() && budget > 0 && int(running_.size()) < config_.max_batch_size) {
    RequestState& r = *waiting_.front();
    // Prompt log-probabilities need every prompt position computed: such a request reuses no prefix.
    const int cached = kv_.match_prefix(r.id, r.tokens, /*reuse=*/r.request.prompt_logprobs < 0);
    int n = int(r.tokens.size()) - cached;
    if (n > budget && !config_.chunked_prefill) {
      kv_.free(r.id);
      break;
    }
    n = std::min(n, budget);
    if (!kv_.allocate(r.id, cached + n)) {
      kv_.free(r.id);
      break;
    }
    r.num_computed = cached;
    if (!r.admitted_once) {  // statistics count a request once, not each retry or re-admission
      r.num_cached_prompt = cached;
      kv_.count_prefix_lookup(int(r.tokens.size()), cached);
    }
    r.admitted_once = true;
    out.push_back({&r, n, cached + n == int(r.tokens.size())});
    budget -= n;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  return out;
}

std::unique_ptr<RequestState> Scheduler::remove(RequestId id) {
  kv_.free(id);
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id == id) {
      auto state = std::move(*it);
      running_.erase(it);
      return state;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if ((*it)->id == id) {
      auto state = std::move(*it);
      waiting_.erase(it);
      return state;
    }
  }
  return nullptr;
}

}  // namespace precast
