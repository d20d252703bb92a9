#include "executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>
#include <utility>

#include "check.h"

namespace precast {

Executor::Executor(ExecutorConfig config, std::shared_ptr<ModelRunner> runner, std::shared_ptr<GuidedDecoder> guided,
                   std::shared_ptr<Proposer> proposer)
    : config_(std::move(config)),
      runner_(std::move(runner)),
      guided_(std::move(guided)),
      proposer_(std::move(proposer)) {
  if (!runner_) throw std::invalid_argument("Executor needs a model runner");
  const SpeculativeConfig& spec = config_.speculative;
  if (spec.num_draft_tokens < 0 || spec.num_draft_tokens > 64)
    throw std::invalid_argument("num_draft_tokens must be between 0 and 64, got " +
                                std::to_string(spec.num_draft_tokens));
  if (spec.num_draft_tokens > 0 && !proposer_)
    throw std::invalid_argument("num_draft_tokens is set but no proposer was given (speculative decoding needs one)");
  if (proposer_ && spec.num_draft_tokens > 0 && !runner_->supports_all_logits())
    throw std::invalid_argument(
        "speculative decoding checks every draft token's logits in one pass, which this backend does not return "
        "(use the CPU backend, or turn speculation off)");
  if (spec.max_draft_batch < 1 || !(spec.draft_token_cost >= 0.0))
    throw std::invalid_argument("max_draft_batch must be >= 1 and draft_token_cost >= 0");
  int tokens_per_block = config_.tokens_per_block;
  if (runner_->slot_mode()) {
    // One block per request, holding a whole sequence; no prefix reuse possible.
    tokens_per_block = config_.max_seq_len;
    config_.prefix_reuse = false;
  }
  const int64_t block_bytes = runner_->kv_block_bytes(tokens_per_block);
  num_blocks_ = int(std::min<int64_t>(config_.kv_cache_bytes / std::max<int64_t>(block_bytes, 1), 1 << 30));
  if (runner_->slot_mode()) num_blocks_ = std::min(num_blocks_, config_.max_batch_size);
  if (num_blocks_ < 1) {
    throw std::invalid_argument("the KV cache budget (" + std::to_string(config_.kv_cache_bytes) +
                                " bytes) is smaller than one KV block (" + std::to_string(block_bytes) +
                                " bytes); give the cache more memory");
  }
  runner_->configure_kv(num_blocks_, tokens_per_block);
  kv_ = std::make_unique<KvCacheManager>(num_blocks_, tokens_per_block, config_.prefix_reuse);
  kv_->record_events(config_.kv_events);
  SchedulerConfig sc{config_.max_batch_size, config_.max_num_tokens, config_.chunked_prefill};
  scheduler_ = std::make_unique<Scheduler>(sc, *kv_, std::make_unique<PriorityFcfsPolicy>());
  stats_.kv = kv_->stats();
  thread_ = std::thread([this] { loop(); });
}

Executor::~Executor() { shutdown(); }

void Executor::validate(const Request& r) const {
  const int vocab = runner_->vocab_size();
  const int n = int(r.prompt.size());
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (n == 0) fail("the prompt is empty; give at least one token");
  for (TokenId t : r.prompt)
    if (t < 0 || t >= vocab)
      fail("prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
  if (n >= config_.max_seq_len)
    fail("the prompt has " + std::to_string(n) + " tokens; this engine's max_seq_len is " +
         std::to_string(config_.max_seq_len) + " (prompt plus output), so at most " +
         std::to_string(config_.max_seq_len - 1) + " prompt tokens fit");
  if (r.max_tokens < 1) fail("max_tokens must be at least 1, got " + std::to_string(r.max_tokens));
  if (n + r.max_tokens > config_.max_seq_len)
    fail("prompt (" + std::to_string(n) + " tokens) + max_tokens (" + std::to_string(r.max_tokens) +
         ") exceeds max_seq_len (" + std::to_string(config_.max_seq_len) + "); lower max_tokens to at most " +
         std::to_string(config_.max_seq_len - n));
  if (r.min_tokens < 0 || r.min_tokens > r.max_tokens) fail("min_tokens must be between 0 and max_tokens");
  const SamplingParams& s = r.sampling;
  if (!(s.temperature >= 0.0f)) fail("temperature must be >= 0");
  if (s.top_k < 0) fail("top_k must be >= 0 (0 disables it)");
  if (!(s.top_p > 0.0f && s.top_p <= 1.0f)) fail("top_p must be in (0, 1]");
  if (!(s.min_p >= 0.0f && s.min_p <= 1.0f)) fail("min_p must be in [0, 1]");
  if (!(s.repetition_penalty > 0.0f)) fail("repetition_penalty must be > 0");
  if (!(s.presence_penalty >= -2.0f && s.presence_penalty <= 2.0f)) fail("presence_penalty must be in [-2, 2]");
  if (!(s.frequency_penalty >= -2.0f && s.frequency_penalty <= 2.0f)) fail("frequency_penalty must be in [-2, 2]");
  if (s.top_logprobs > 20) fail("top_logprobs must be at most 20");
  for (const auto& [t, bias] : s.logit_bias) {
    if (t < 0 || t >= vocab) fail("logit_bias token id " + std::to_string(t) + " is outside the vocabulary");
    if (!std::isfinite(bias)) fail("logit_bias values must be finite numbers");
  }
  if (r.guide_id != 0 && !guided_) fail("this executor has no guided decoder for structured outputs");
  if (r.prompt_logprobs > 20) fail("prompt_logprobs must be at most 20");
  if (r.prompt_logprobs >= 0 && !runner_->supports_all_logits())
    fail(
        "prompt log-probabilities need every prompt position's logits, which this backend does not return (use the "
        "CPU backend)");
  for (TokenId t : r.stop_token_ids)
    if (t < 0 || t >= vocab) fail("stop token id " + std::to_string(t) + " is outside the vocabulary");
  for (const auto& w : r.bad_words)
    for (TokenId t : w)
      if (t < 0 || t >= vocab) fail("bad word token id " + std::to_string(t) + " is outside the vocabulary");
  if (!config_.chunked_prefill && n > config_.max_num_tokens)
    fail("the prompt has " + std::to_string(n) + " tokens but a step holds " + std::to_string(config_.max_num_tokens) +
         " and chunked prefill is off");
  const int need = kv_->blocks_needed(n + r.max_tokens);
  if (need > num_blocks_)
    fail("this request needs " + std::to_string(need) + " KV blocks (prompt + max_tokens) but the whole cache has " +
         std::to_string(num_blocks_) + "; give the KV cache more memory or ask for fewer tokens");
}

RequestId Executor::enqueue(Request request) {
  validate(request);
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_) throw std::runtime_error("the executor has been shut down");
  const RequestId id = next_id_++;
  const uint64_t seed = request.sampling.seed ? *request.sampling.seed : std::random_device{}() ^ (uint64_t(id) << 32);
  incoming_.push_back(std::make_unique<RequestState>(id, std::move(request), next_arrival_++, seed));
  live_.insert(id);
  work_cv_.notify_one();
  return id;
}

bool Executor::cancel(RequestId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!live_.count(id)) return false;
  cancels_.push_back(id);
  work_cv_.notify_one();
  return true;
}

std::vector<Response> Executor::await_responses(double timeout_seconds) {
  std::unique_lock<std::mutex> lock(mutex_);
  response_cv_.wait_for(lock, std::chrono::duration<double>(std::max(0.0, timeout_seconds)),
                        [&] { return !responses_.empty() || stop_; });
  std::vector<Response> out;
  out.swap(responses_);
  return out;
}

ExecutorStats Executor::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Executor::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  work_cv_.notify_all();
  response_cv_.notify_all();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

void Executor::check_integrity() {
  std::unique_lock<std::mutex> lock(mutex_);
  audit_requested_ = true;
  audit_done_ = false;
  work_cv_.notify_one();
  response_cv_.wait(lock, [&] { return audit_done_ || stop_; });
  if (!audit_error_.empty()) {
    std::string e;
    e.swap(audit_error_);
    throw InvariantError(e);
  }
}

void Executor::emit(std::vector<Response>&& responses) {
  if (responses.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& r : responses) {
    if (r.finished()) live_.erase(r.request_id);
    responses_.push_back(std::move(r));
  }
  response_cv_.notify_all();
}

void Executor::finish(RequestState& r, FinishReason reason, Response& response, const std::string& error) {
  response.finish_reason = reason;
  response.error = error;
  response.num_draft_tokens = r.num_draft_tokens;
  response.num_accepted_draft_tokens = r.num_accepted_draft_tokens;
  response.num_prompt_tokens = r.num_prompt;
  response.num_cached_prompt_tokens = r.num_cached_prompt;
}

std::vector<KvEvent> Executor::take_kv_events(int64_t& dropped) {
  std::lock_guard<std::mutex> lock(mutex_);
  dropped = std::exchange(kv_events_dropped_, 0);
  return std::exchange(kv_events_, {});
}

void Executor::refresh_stats_locked() {
  stats_.active_requests = scheduler_->num_running();
  stats_.queued_requests = scheduler_->num_waiting();
  stats_.preemptions = scheduler_->num_preemptions();
  stats_.kv = kv_->stats();
  if (config_.kv_events) {  // handed to clients here, under the lock: the KV manager is the loop thread's
    for (KvEvent& e : kv_->take_events()) kv_events_.push_back(std::move(e));
    if (kv_events_.size() > kMaxKvEvents) {
      const size_t extra = kv_events_.size() - kMaxKvEvents;
      kv_events_.erase(kv_events_.begin(), kv_events_.begin() + int64_t(extra));
      kv_events_dropped_ += int64_t(extra);
    }
  }
}

// The loop: wait for work, take what clients sent (requests, cancels, an audit), run one step.
void Executor::loop() {
  Work work;
  while (wait_for_work(work)) {
    if (work.audit) run_audit();
    for (auto& r : work.incoming) scheduler_->add(std::move(r));
    cancel_now(work.cancels);
    if (scheduler_->num_running() + scheduler_->num_waiting() > 0) step();
  }
  fail_unfinished();
}

bool Executor::wait_for_work(Work& work) {
  std::unique_lock<std::mutex> lock(mutex_);
  work_cv_.wait(lock, [&] {
    return stop_ || audit_requested_ || !incoming_.empty() || !cancels_.empty() || scheduler_->num_running() > 0 ||
           scheduler_->num_waiting() > 0;
  });
  if (stop_) return false;
  work.incoming.clear();
  work.cancels.clear();
  work.incoming.swap(incoming_);
  work.cancels.swap(cancels_);
  work.audit = std::exchange(audit_requested_, false);
  return true;
}

void Executor::run_audit() {
  std::string error;
  try {
    kv_->check_integrity();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  audit_error_ = error;
  audit_done_ = true;
  response_cv_.notify_all();
}

void Executor::cancel_now(const std::vector<RequestId>& ids) {
  std::vector<Response> cancelled;
  for (RequestId id : ids) {
    if (auto r = scheduler_->remove(id)) {
      r->pending.request_id = id;
      finish(*r, FinishReason::kCancelled, r->pending);
      if (proposer_) proposer_->release(id);
      cancelled.push_back(std::move(r->pending));
    }
  }
  if (cancelled.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    refresh_stats_locked();
  }
  emit(std::move(cancelled));
}

// Shutting down: every unfinished request ends with an error response.
void Executor::fail_unfinished() {
  std::vector<Response> rest;
  for (RequestId id : std::vector<RequestId>(live_.begin(), live_.end())) {
    Response resp;
    resp.request_id = id;
    resp.finish_reason = FinishReason::kError;
    resp.error = "the executor shut down";
    rest.push_back(std::move(resp));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& r : rest) responses_.push_back(std::move(r));
  live_.clear();
  response_cv_.notify_all();
}

namespace {
// A NaN or Inf in a row would make sampling pick token 0 with NaN log-probs, silently.
bool all_finite(const float* x, int n) {
  float sum = 0.0f;  // NaN and Inf propagate; one pass the compiler vectorizes
  for (int i = 0; i < n; ++i) sum += x[i] * 0.0f;
  return sum == 0.0f;
}
}  // namespace

// Samples the request's next token from its logits row and appends it; with a draft token, the sampler's
// acceptance rule decides (returns whether the draft was kept). Ends the request at a stop or the length.
bool Executor::sample_into(RequestState& r, float* logits, int vocab, const int32_t* allowed, Response& resp,
                           TokenId draft) {
  const Request& q = r.request;
  std::vector<TokenId> banned;
  if (r.num_output() < q.min_tokens) {  // stop tokens may not end the output yet
    banned = q.stop_token_ids;
    if (!q.ignore_eos) banned.insert(banned.end(), config_.eos_token_ids.begin(), config_.eos_token_ids.end());
  }
  SampleResult sr =
      sample_token(logits, vocab, q.sampling, r.tokens, r.num_output(), q.bad_words, banned, allowed, r.sampler, draft);
  if (sr.token < 0) {
    finish(r, FinishReason::kError, resp,
           "no token may come next: the request's grammar" + std::string(banned.empty() ? "" : ", min_tokens") +
               ", bad_words and logit_bias leave none (an output format that needs the end of text before "
               "min_tokens, or bans what the format requires)");
    return false;
  }
  r.tokens.push_back(sr.token);
  resp.new_tokens.push_back(sr.token);
  if (q.sampling.top_logprobs >= 0) {
    resp.logprobs.push_back(sr.logprob);
    resp.top_logprobs.push_back(std::move(sr.top));
  }
  const auto& eos = config_.eos_token_ids;
  const bool is_stop = std::count(q.stop_token_ids.begin(), q.stop_token_ids.end(), sr.token) ||
                       (!q.ignore_eos && std::count(eos.begin(), eos.end(), sr.token));
  if (is_stop && r.num_output() >= q.min_tokens) {
    finish(r, FinishReason::kStop, resp);
  } else if (r.num_output() >= q.max_tokens || int(r.tokens.size()) >= config_.max_seq_len) {
    finish(r, FinishReason::kLength, resp);
  }
  return sr.accepted_draft;
}

// One step: pack the scheduled requests into a batch, run the model, update every request from its logits.
void Executor::step() {
  propose();
  const std::vector<ScheduledRequest> scheduled = scheduler_->schedule();
  if (scheduled.empty()) {
    // Nothing fits although requests wait: only possible when a waiting request can
    // never fit, which validate() rules out; wait briefly rather than spin.
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return;
  }
  const Batch batch = pack(scheduled);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  std::vector<float> logits = forward(batch, error);  // the sampler edits its rows in place
  const bool checks_drafts =
      std::any_of(scheduled.begin(), scheduled.end(), [](const ScheduledRequest& s) { return s.num_draft > 0; });
  if (checks_drafts) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.verify_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  update(scheduled, logits, error);
}

// Speculative decoding: each running request that decodes (one token to compute) and may speculate gets
// draft tokens from the proposer; the scheduler fits them into the step. Nothing is proposed when the step
// would decode more than max_draft_batch requests, and a proposer that fails proposes nothing.
void Executor::propose() {
  const SpeculativeConfig& spec = config_.speculative;
  if (!proposer_ || spec.num_draft_tokens < 1) return;
  std::vector<DraftRequest> wanted;
  std::vector<RequestState*> states;
  int decoding = 0;
  for (const auto& state : scheduler_->running()) {
    RequestState& r = *state;
    r.draft.clear();
    if (r.num_computed + 1 != int(r.tokens.size())) continue;  // prefilling
    ++decoding;
    if (!r.request.speculative || r.request.guide_id != 0) continue;  // a grammar would have to check each draft
    int k = spec.adaptive ? r.speculation.best_num_draft(spec.num_draft_tokens, spec.draft_token_cost)
                          : spec.num_draft_tokens;
    // The bonus token after the drafts counts too: stay within max_tokens and max_seq_len.
    k = std::min({k, r.request.max_tokens - r.num_output() - 1, config_.max_seq_len - int(r.tokens.size()) - 1});
    if (k < 1) continue;
    wanted.push_back({r.id, &r.tokens, k});
    states.push_back(&r);
  }
  if (wanted.empty() || decoding > spec.max_draft_batch) return;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<TokenId>> drafts;
  try {
    drafts = proposer_->propose(wanted);
  } catch (const std::exception&) {
    drafts.clear();  // decoding goes on without drafts
  }
  const int vocab = runner_->vocab_size();
  for (size_t i = 0; i < drafts.size() && i < states.size(); ++i) {
    std::vector<TokenId>& d = drafts[i];
    // A draft model's vocabulary may be larger than the target's: its tokens past ours end the draft.
    const auto bad = std::find_if(d.begin(), d.end(), [&](TokenId t) { return t < 0 || t >= vocab; });
    d.erase(bad, d.end());
    if (int(d.size()) > wanted[i].max_draft) d.resize(wanted[i].max_draft);
    states[i]->draft = std::move(d);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.draft_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Executor::retire(RequestId id) {
  scheduler_->remove(id);
  if (proposer_) proposer_->release(id);
}

Batch Executor::pack(const std::vector<ScheduledRequest>& scheduled) const {
  Batch batch;
  for (const ScheduledRequest& s : scheduled) {
    const RequestState& r = *s.state;
    BatchSequence seq;
    seq.request_id = r.id;
    seq.context_len = r.num_computed;
    seq.num_tokens = s.num_tokens;
    seq.token_offset = int(batch.token_ids.size());
    seq.sample = s.sample;
    seq.all_logits = needs_prompt_logits(r) || s.num_draft > 0;  // with drafts: a row to check each
    seq.block_table = kv_->block_table(r.id);
    const int num_real = s.num_tokens - s.num_draft;
    for (int i = 0; i < s.num_tokens; ++i) {
      batch.token_ids.push_back(i < num_real ? r.tokens[r.num_computed + i] : r.draft[i - num_real]);
      batch.positions.push_back(r.num_computed + i);
    }
    batch.sequences.push_back(std::move(seq));
  }
  return batch;
}

std::vector<float> Executor::forward(const Batch& batch, std::string& error) {
  try {
    std::vector<float> logits = runner_->forward(batch);
    PRECAST_CHECK(logits.size() == size_t(batch.num_logit_rows()) * runner_->vocab_size(),
                  "runner returned " << logits.size() << " logits");
    return logits;
  } catch (const std::exception& e) {
    error = std::string("model runner failed: ") + e.what();  // every request of the step ends with it
    return {};
  }
}

// Each request: its computed tokens committed to the KV cache, a token sampled where it samples, a response
// emitted when it streams or finishes; finished ones leave the scheduler.
void Executor::update(const std::vector<ScheduledRequest>& scheduled, std::vector<float>& logits,
                      const std::string& error) {
  std::vector<Response> responses;
  std::vector<RequestId> finished;
  const int vocab = runner_->vocab_size();
  int row = 0, num_context = 0;
  int64_t prompt_tokens = 0, generated = 0, draft_tokens = 0, accepted_drafts = 0, speculative_steps = 0;
  const StepMasks masks = error.empty() ? guide_masks(scheduled) : StepMasks{};
  std::vector<TokenId> guided_tokens(masks.guide_ids.size(), -1);  // per mask row: the token sampled
  for (size_t i = 0; i < scheduled.size(); ++i) {
    const ScheduledRequest& s = scheduled[i];
    RequestState& r = *s.state;
    const int mask_row = masks.row_of.empty() ? -1 : masks.row_of[i];
    Response& resp = r.pending;
    resp.request_id = r.id;
    num_context += r.num_computed < r.num_prompt;
    if (!error.empty()) {
      finish(r, FinishReason::kError, resp, error);
    } else {
      prompt_tokens += std::max(0, std::min(r.num_prompt, r.num_computed + s.num_tokens) - r.num_computed);
      const bool prompt_rows = needs_prompt_logits(r);  // as pack() saw it
      if (prompt_rows) record_prompt_logprobs(r, logits.data() + int64_t(row) * vocab, s.num_tokens, resp);
      row += prompt_rows || s.num_draft > 0 ? s.num_tokens : int(s.sample);
      r.num_computed += s.num_tokens - s.num_draft;  // a draft token's K/V counts once the token is accepted
      int step_accepted = 0;
      if (s.sample) {
        const int32_t* allowed = mask_row >= 0 ? masks.words.data() + int64_t(mask_row) * masks.words_per_row : nullptr;
        const std::string no_error;
        const std::string& mask_error = mask_row >= 0 ? masks.errors[mask_row] : no_error;
        float* rows = logits.data() + int64_t(row - 1 - s.num_draft) * vocab;
        const int emitted = sample_rows(r, s.num_draft, rows, allowed, mask_error, resp, step_accepted);
        generated += emitted;
        if (mask_row >= 0 && emitted > 0 && resp.finish_reason != FinishReason::kError)
          guided_tokens[mask_row] = r.tokens.back();
      }
      if (s.num_draft > 0) {
        r.speculation.observe(s.num_draft, step_accepted);
        r.num_draft_tokens += s.num_draft;
        r.num_accepted_draft_tokens += step_accepted;
        draft_tokens += s.num_draft;
        accepted_drafts += step_accepted;
        speculative_steps += 1;
      }
      kv_->commit(r.id, r.tokens, r.num_computed);
      if (s.num_draft > 0 && !resp.finished()) kv_->truncate(r.id, int(r.tokens.size()));
      if (!s.sample) continue;
    }
    if (resp.finished()) finished.push_back(r.id);
    resp.num_draft_tokens = r.num_draft_tokens;
    resp.num_accepted_draft_tokens = r.num_accepted_draft_tokens;
    if (r.request.streaming || resp.finished()) {
      responses.push_back(std::move(resp));
      resp = Response();
    }
  }
  advance_guides(masks, guided_tokens);
  for (RequestId id : finished) retire(id);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.iterations += 1;
    stats_.scheduled_requests = int(scheduled.size());
    stats_.context_requests = num_context;
    stats_.decode_requests = int(scheduled.size()) - num_context;
    stats_.prompt_tokens += prompt_tokens;
    stats_.step_prompt_tokens = int(prompt_tokens);
    stats_.generated_tokens += generated;
    stats_.draft_tokens += draft_tokens;
    stats_.accepted_draft_tokens += accepted_drafts;
    stats_.speculative_steps += speculative_steps;
    refresh_stats_locked();
  }
  emit(std::move(responses));
}

// A sampling request's rows: the last one, or with drafts one per draft plus the bonus row after them. Row j
// checks draft j; each accepted draft's K/V becomes valid (num_computed) and makes the next row valid; the first
// rejection ends the run with the token the sampler drew instead, and the bonus row samples freely. Returns the
// tokens emitted; `accepted` counts the drafts kept.
int Executor::sample_rows(RequestState& r, int num_draft, float* rows, const int32_t* allowed,
                          const std::string& mask_error, Response& resp, int& accepted) {
  const int vocab = runner_->vocab_size();
  int emitted = 0;
  for (int j = 0; j <= num_draft; ++j) {
    float* row_logits = rows + int64_t(j) * vocab;
    if (!all_finite(row_logits, vocab)) {
      finish(r, FinishReason::kError, resp,
             "the model produced non-finite logits (NaN or Inf) at position " + std::to_string(r.num_computed) +
                 "; the engine's weights or its float16 range may be at fault: check it with `precast inspect`, "
                 "rebuild it (float16 overflows: --dtype bfloat16)");
      break;
    }
    if (!mask_error.empty()) {
      finish(r, FinishReason::kError, resp, "structured output: " + mask_error);
      break;
    }
    emitted += 1;
    const bool kept = sample_into(r, row_logits, vocab, allowed, resp, j < num_draft ? r.draft[j] : -1);
    accepted += kept;
    if (!kept || resp.finished()) break;
    r.num_computed += 1;
  }
  return emitted;
}

// Whether this step must return logits for every token of the request's chunk: prompt positions whose
// next-token log-probability is still to be reported.
bool Executor::needs_prompt_logits(const RequestState& r) const {
  const int last = r.num_prompt - 1;  // the last prompt position predicts an output token, not a prompt token
  return r.request.prompt_logprobs >= 0 && r.num_prompt_logprobs < last && r.num_computed < last;
}

// Rows [0, num_tokens) of `rows` are positions num_computed.. of the request: row p scores prompt token p + 1.
// Positions reported before a preemption are not reported again when they are recomputed.
void Executor::record_prompt_logprobs(RequestState& r, const float* rows, int num_tokens, Response& resp) {
  const int vocab = runner_->vocab_size();
  for (int k = 0; k < num_tokens; ++k) {
    const int p = r.num_computed + k;
    if (p + 1 >= r.num_prompt) break;
    if (p < r.num_prompt_logprobs) continue;
    SampleResult s = score_token(rows + int64_t(k) * vocab, vocab, r.tokens[p + 1], r.request.prompt_logprobs);
    resp.prompt_logprobs.push_back(s.logprob);
    resp.prompt_top_logprobs.push_back(std::move(s.top));
    r.num_prompt_logprobs = p + 1;
  }
}

// One call for the masks of every guided request that samples in this step (none: no call).
Executor::StepMasks Executor::guide_masks(const std::vector<ScheduledRequest>& scheduled) {
  StepMasks masks;
  for (const ScheduledRequest& s : scheduled) {
    const bool guided = s.sample && s.state->request.guide_id != 0;
    masks.row_of.push_back(guided ? int(masks.guide_ids.size()) : -1);
    if (guided) masks.guide_ids.push_back(s.state->request.guide_id);
  }
  const size_t rows = masks.guide_ids.size();
  if (rows == 0) return StepMasks{};
  masks.words_per_row = mask_words(runner_->vocab_size());
  masks.words.assign(rows * masks.words_per_row, 0);  // a row left unfilled allows nothing
  try {
    masks.errors = guided_->fill_masks(masks.guide_ids, masks.words.data(), masks.words_per_row);
    PRECAST_CHECK(masks.errors.size() == rows, "fill_masks returned " << masks.errors.size() << " messages");
  } catch (const std::exception& e) {
    masks.errors.assign(rows, std::string("the grammar failed: ") + e.what());
  }
  return masks;
}

// Each guided request that produced a token this step: its grammar consumes it (one call).
void Executor::advance_guides(const StepMasks& masks, const std::vector<TokenId>& sampled) {
  std::vector<uint64_t> ids;
  std::vector<TokenId> tokens;
  for (size_t i = 0; i < sampled.size(); ++i) {
    if (sampled[i] < 0) continue;
    ids.push_back(masks.guide_ids[i]);
    tokens.push_back(sampled[i]);
  }
  if (ids.empty()) return;
  try {
    guided_->advance(ids, tokens);
  } catch (const std::exception&) {
    // A grammar that failed to advance says so at its next mask (fill_masks); a finished request is done.
  }
}

}  // namespace precast
