// Speculative decoding's proposers: they guess the next few tokens of a request cheaply, and
// one forward pass of the target model then checks every guess at once (the executor's
// verify step, cpp/executor.cpp). A guess costs a few extra rows in a pass that reads the
// weights once anyway, so each accepted token is nearly free while decoding is bound by
// memory bandwidth.
//
// Proposals are deterministic given the request's tokens (the proposal distribution is
// one-hot), which is what the sampler's acceptance rule assumes (cpp/sampler.h).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "kv_cache_manager.h"
#include "model_runner.h"
#include "request.h"

namespace precast {

struct DraftRequest {
  RequestId id = 0;
  const std::vector<TokenId>* tokens = nullptr;  // prompt + output so far; the next token follows the last
  int max_draft = 0;                             // propose at most this many tokens
};

class Proposer {
 public:
  virtual ~Proposer() = default;
  // One list of proposed tokens per request (possibly empty), at most max_draft long.
  virtual std::vector<std::vector<TokenId>> propose(const std::vector<DraftRequest>& requests) = 0;
  // The request ended: drop whatever the proposer keeps for it.
  virtual void release(RequestId) {}
};

// Prompt lookup: find the most recent earlier place where the request's last n tokens
// occurred (n from max_ngram down to min_ngram) and propose the tokens that followed there.
// Needs no model; pays off when the output repeats its context (editing given code,
// summaries quoting their text).
class NgramProposer : public Proposer {
 public:
  NgramProposer(int min_ngram, int max_ngram);
  std::vector<std::vector<TokenId>> propose(const std::vector<DraftRequest>& requests) override;
  static std::vector<TokenId> lookup(const std::vector<TokenId>& tokens, int min_ngram, int max_ngram, int max_draft);

 private:
  int min_ngram_, max_ngram_;
};

// A smaller engine with the same tokenizer proposes its greedy continuation. It runs in the
// same process on its own runner and KV pool; per request it keeps the tokens whose K/V it
// holds, so after the target accepts part of a proposal only the rest is recomputed.
class DraftModelProposer : public Proposer {
 public:
  // The runner is configured here with a KV pool of `kv_cache_bytes`; `max_seq_len` and `max_num_tokens` are
  // the draft engine's own limits (a request longer than its max_seq_len gets no proposals).
  DraftModelProposer(std::shared_ptr<ModelRunner> runner, int64_t kv_cache_bytes, int tokens_per_block, int max_seq_len,
                     int max_num_tokens);
  std::vector<std::vector<TokenId>> propose(const std::vector<DraftRequest>& requests) override;
  void release(RequestId id) override;
  int num_kv_blocks() const { return kv_->num_blocks(); }

 private:
  std::shared_ptr<ModelRunner> runner_;
  std::unique_ptr<KvCacheManager> kv_;
  int max_seq_len_, max_num_tokens_;
  std::unordered_map<RequestId, std::vector<TokenId>> cached_;  // per request: the tokens whose K/V the pool holds
};

}  // namespace precast
