#include <algorithm>
#include <stdexcept>
#include <string>

#include "check.h"
#include "proposer.h"

namespace precast {

DraftModelProposer::DraftModelProposer(std::shared_ptr<ModelRunner> runner, int64_t kv_cache_bytes,
                                       int tokens_per_block, int max_seq_len, int max_num_tokens)
    : runner_(std::move(runner)), max_seq_len_(max_seq_len), max_num_tokens_(max_num_tokens) {
  if (!runner_) throw std::invalid_argument("a draft model proposer needs a model runner");
  if (runner_->slot_mode()) throw std::invalid_argument("the draft model must run on a paged-KV backend (cpu)");
  if (max_num_tokens < 1) throw std::invalid_argument("max_num_tokens must be at least 1");
  const int64_t block_bytes = std::max<int64_t>(runner_->kv_block_bytes(tokens_per_block), 1);
  const int num_blocks = int(std::min<int64_t>(kv_cache_bytes / block_bytes, 1 << 30));
  if (num_blocks < 1)
    throw std::invalid_argument("the draft model's KV budget (" + std::to_string(kv_cache_bytes) +
                                " bytes) is smaller than one of its KV blocks (" + std::to_string(block_bytes) + ")");
  runner_->configure_kv(num_blocks, tokens_per_block);
  kv_ = std::make_unique<KvCacheManager>(num_blocks, tokens_per_block, /*enable_prefix_reuse=*/false);
}

void DraftModelProposer::release(RequestId id) {
  kv_->free(id);
  cached_.erase(id);
}

std::vector<std::vector<TokenId>> DraftModelProposer::propose(const std::vector<DraftRequest>& requests) {
  struct Job {
    size_t index;                  // into requests (and the result)
    std::vector<TokenId> seq;      // the request's tokens, then the draft so far
    std::vector<TokenId>* cached;  // tokens whose K/V the pool holds: always a prefix of seq
    int max_draft;
  };
  const int vocab = runner_->vocab_size();
  std::vector<std::vector<TokenId>> drafts(requests.size());
  std::vector<Job> jobs;
  for (size_t i = 0; i < requests.size(); ++i) {
    const DraftRequest& r = requests[i];
    if (r.max_draft < 1 || r.tokens->empty()) continue;
    const std::vector<TokenId>& tokens = *r.tokens;
    std::vector<TokenId>& cached = cached_[r.id];
    // Keep the K/V of the common prefix (what the target accepted), leaving at least the last token to run.
    const size_t common =
        std::mismatch(cached.begin(), cached.end(), tokens.begin(), tokens.end()).first - cached.begin();
    cached.resize(std::min(common, tokens.size() - 1));
    // K/V is written for every input: the tokens not cached yet and all drafts but the last.
    const int needed = int(tokens.size()) + r.max_draft - 1;
    // Past the draft's own limits, or a token its (possibly smaller, padded) vocabulary lacks: no proposal.
    const bool foreign =
        std::any_of(tokens.begin() + cached.size(), tokens.end(), [&](TokenId t) { return t < 0 || t >= vocab; });
    if (needed > max_seq_len_ || foreign) {
      release(r.id);
      continue;
    }
    if (!kv_->allocate(r.id, needed)) {
      // Make room by forgetting requests that are not drafting now (finished ones are released already;
      // these are prefilling, preempted or over the batch limit), then give up on this one for this step.
      std::vector<RequestId> idle;
      for (const auto& [id, c] : cached_) {
        const bool drafting =
            std::any_of(requests.begin(), requests.end(), [&](const DraftRequest& q) { return q.id == id; });
        if (!drafting) idle.push_back(id);
      }
      for (RequestId id : idle) release(id);
      if (!kv_->allocate(r.id, needed)) {
        release(r.id);
        continue;
      }
    }
    jobs.push_back({i, tokens, &cached_[r.id], r.max_draft});
  }
  // Rounds of one forward pass each: a request first catches up on the tokens its cache lacks (chunked by
  // max_num_tokens), then drafts one token per round from its last row's argmax.
  while (true) {
    Batch batch;
    std::vector<Job*> in_batch;
    int budget = max_num_tokens_;
    for (Job& job : jobs) {
      const int pending = int(job.seq.size() - job.cached->size());
      if (pending == 0 || budget == 0) continue;
      const int n = std::min(pending, budget);
      BatchSequence s;
      s.request_id = requests[job.index].id;
      s.context_len = int(job.cached->size());
      s.num_tokens = n;
      s.token_offset = int(batch.token_ids.size());
      s.sample = n == pending;
      s.block_table = kv_->block_table(s.request_id);
      for (int k = 0; k < n; ++k) {
        batch.token_ids.push_back(job.seq[s.context_len + k]);
        batch.positions.push_back(s.context_len + k);
      }
      batch.sequences.push_back(std::move(s));
      in_batch.push_back(&job);
      budget -= n;
    }
    if (in_batch.empty()) break;
    const std::vector<float> logits = runner_->forward(batch);
    PRECAST_CHECK(logits.size() == size_t(batch.num_logit_rows()) * vocab, "draft runner returned " << logits.size());
    int row = 0;
    for (size_t b = 0; b < in_batch.size(); ++b) {
      Job& job = *in_batch[b];
      const BatchSequence& s = batch.sequences[b];
      job.cached->insert(job.cached->end(), job.seq.begin() + s.context_len,
                         job.seq.begin() + s.context_len + s.num_tokens);
      if (!s.sample) continue;
      const float* r = logits.data() + int64_t(row++) * vocab;
      const TokenId next = TokenId(std::max_element(r, r + vocab) - r);
      std::vector<TokenId>& draft = drafts[job.index];
      draft.push_back(next);
      if (int(draft.size()) < job.max_draft) job.seq.push_back(next);  // the last draft is never an input
    }
  }
  return drafts;
}

}  // namespace precast
