// The executor: a loop thread that runs schedule -> batch -> forward -> sample -> respond.
//
// Clients talk to it from any thread: enqueue() validates and queues a request,
// await_responses() waits for what the loop produced, cancel() stops a request. A bad
// request is rejected (enqueue throws std::invalid_argument) or finished with an error
// response; the loop itself keeps running.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "guided_decoder.h"
#include "kv_cache_manager.h"
#include "model_runner.h"
#include "proposer.h"
#include "request.h"
#include "scheduler.h"

namespace precast {

// Speculative decoding (cpp/proposer.h): how many tokens a proposer may offer per request and step.
struct SpeculativeConfig {
  int num_draft_tokens = 0;  // at most this many per request and step; 0: off
  bool adaptive = true;      // per request, fewer drafts while few are accepted (SpeculationState)
  // A step with more decoding requests than this proposes nothing: the pass is no longer bound by reading
  // the weights, so checked drafts cost nearly as much as the tokens they might save.
  int max_draft_batch = 8;
  // One draft token's cost relative to a plain decode step: checking it adds a row to a pass that reads the weights
  // once anyway (0.05); a draft model's own step adds its share (runtime/speculative.py).
  double draft_token_cost = 0.05;
};

struct ExecutorConfig {
  int max_batch_size = 64;
  int max_num_tokens = 2048;
  int max_seq_len = 4096;
  int tokens_per_block = 32;
  int64_t kv_cache_bytes = 0;  // KV memory budget; the block count is budget / runner's block size
  bool chunked_prefill = true;
  bool prefix_reuse = true;
  bool kv_events = false;  // record prefix-cache changes for take_kv_events() (KV-aware routers)
  std::vector<TokenId> eos_token_ids;
  SpeculativeConfig speculative;
};

struct ExecutorStats {
  int64_t iterations = 0;
  int active_requests = 0;     // running (holding KV)
  int queued_requests = 0;     // waiting
  int scheduled_requests = 0;  // in the last step
  int context_requests = 0;    // of which computing prompt tokens
  int decode_requests = 0;     // of which generating
  int64_t preemptions = 0;
  int64_t prompt_tokens = 0;   // computed prompt tokens (prefix hits excluded)
  int step_prompt_tokens = 0;  // of which in the last step
  int64_t generated_tokens = 0;
  // Speculative decoding, cumulative: draft tokens checked and accepted, request-steps that checked drafts,
  // and seconds spent proposing and in forward passes that checked drafts.
  int64_t draft_tokens = 0;
  int64_t accepted_draft_tokens = 0;
  int64_t speculative_steps = 0;
  double draft_seconds = 0.0;
  double verify_seconds = 0.0;
  KvCacheStats kv;
};

class Executor {
 public:
  // `guided` serves requests with a guide_id (structured outputs); `proposer` offers draft tokens
  // (speculative decoding, config.speculative); either may be null.
  Executor(ExecutorConfig config, std::shared_ptr<ModelRunner> runner, std::shared_ptr<GuidedDecoder> guided = nullptr,
           std::shared_ptr<Proposer> proposer = nullptr);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  RequestId enqueue(Request request);
  std::vector<Response> await_responses(double timeout_seconds);
  bool cancel(RequestId id);  // false when the id is unknown or already finished
  ExecutorStats stats() const;
  // Prefix-cache changes since the last call (with config.kv_events), oldest first. At most
  // kMaxKvEvents are kept between calls; older ones are dropped and counted in `dropped`.
  std::vector<KvEvent> take_kv_events(int64_t& dropped);
  static constexpr size_t kMaxKvEvents = 1 << 20;
  void shutdown();
  // Runs on the loop thread between steps; used by tests to audit block accounting.
  void check_integrity();
  const ExecutorConfig& config() const { return config_; }
  int num_kv_blocks() const { return num_blocks_; }

 private:
  struct StepMasks {                  // the grammar masks of a step's guided sampling requests
    std::vector<int> row_of;          // per scheduled request: its mask row, or -1 when unguided or not sampling
    std::vector<uint64_t> guide_ids;  // per row
    std::vector<int32_t> words;
    std::vector<std::string> errors;  // per row: why its grammar cannot go on, or empty
    int words_per_row = 0;
  };
  struct Work {  // what clients sent since the last step
    std::vector<std::unique_ptr<RequestState>> incoming;
    std::vector<RequestId> cancels;
    bool audit = false;
  };
  void loop();
  bool wait_for_work(Work& work);  // false: shutting down
  void run_audit();
  void cancel_now(const std::vector<RequestId>& ids);
  void fail_unfinished();
  void step();
  void propose();
  void retire(RequestId id);  // a finished or cancelled request leaves the scheduler and the proposer
  Batch pack(const std::vector<ScheduledRequest>& scheduled) const;
  std::vector<float> forward(const Batch& batch, std::string& error);
  void update(const std::vector<ScheduledRequest>& scheduled, std::vector<float>& logits, const std::string& error);
  int sample_rows(RequestState& r, int num_draft, float* rows, const int32_t* allowed, const std::string& mask_error,
                  Response& resp, int& accepted);
  bool needs_prompt_logits(const RequestState& r) const;
  void record_prompt_logprobs(RequestState& r, const float* rows, int num_tokens, Response& resp);
  StepMasks guide_masks(const std::vector<ScheduledRequest>& scheduled);
  void advance_guides(const StepMasks& masks, const std::vector<TokenId>& sampled);
  bool sample_into(RequestState& r, float* logits, int vocab, const int32_t* allowed, Response& resp,
                   TokenId draft = -1);
  void finish(RequestState& r, FinishReason reason, Response& response, const std::string& error = {});
  void validate(const Request& request) const;
  void emit(std::vector<Response>&& responses);
  void refresh_stats_locked();  // caller holds mutex_

  ExecutorConfig config_;
  std::shared_ptr<ModelRunner> runner_;
  std::shared_ptr<GuidedDecoder> guided_;
  std::shared_ptr<Proposer> proposer_;
  int num_blocks_ = 0;
  std::unique_ptr<KvCacheManager> kv_;
  std::unique_ptr<Scheduler> scheduler_;

  // Shared with client threads, under mutex_.
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable response_cv_;
  std::vector<std::unique_ptr<RequestState>> incoming_;
  std::vector<RequestId> cancels_;
  std::unordered_set<RequestId> live_;  // enqueued and not yet finished
  std::vector<Response> responses_;
  std::vector<KvEvent> kv_events_;
  int64_t kv_events_dropped_ = 0;
  ExecutorStats stats_;
  bool audit_requested_ = false;
  std::string audit_error_;
  bool audit_done_ = false;
  RequestId next_id_ = 1;
  uint64_t next_arrival_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace precast
