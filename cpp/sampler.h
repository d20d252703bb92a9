// Turns one request's logits row into its next token.
//
// Order of operations (each optional): keep only the tokens a grammar allows (structured
// outputs) -> ban bad-word completions and (before min_tokens) stop tokens -> logit bias ->
// repetition penalty (HF: divide positive / multiply negative logits of
// every seen token) -> presence and frequency penalties (OpenAI: subtract, output tokens
// only) -> greedy argmax when temperature == 0, else temperature, top-k, top-p, min-p and
// a draw from the request's own generator. Logprobs are log-softmax of the raw logits.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "request.h"

namespace precast {

struct SamplerState {
  std::mt19937_64 rng;  // per request: the same seed draws the same tokens in any batch
  explicit SamplerState(uint64_t seed) : rng(seed) {}
};

struct SampleResult {
  TokenId token = -1;  // -1: no token was allowed (the grammar, bans and biases left none)
  float logprob = 0.0f;
  std::vector<TokenLogprob> top;
  bool accepted_draft = false;  // the token is the draft that was offered
};

// The log-probability of `token` under raw `logits` (log-softmax), and the `top` most likely tokens
// (none when top <= 0): what logprobs report for sampled and for prompt tokens.
SampleResult score_token(const float* logits, int vocab_size, TokenId token, int top);

// `context` is prompt + output so far; `num_output` how many of its last tokens are output.
// `banned_now` lists tokens that may not be produced at this step (stop tokens before
// min_tokens). `allowed`, when given, is a grammar's bitmask (guided_decoder.h). `logits` is
// modified in place.
//
// `draft` >= 0 (speculative decoding): a token a proposer offered for this position. Greedy
// keeps it only if it is the argmax; sampling keeps it or draws a replacement by the
// rejection rule, so the token returned is distributed exactly as without a draft.
SampleResult sample_token(float* logits, int vocab_size, const SamplingParams& params,
                          const std::vector<TokenId>& context, int num_output,
                          const std::vector<std::vector<TokenId>>& bad_words, const std::vector<TokenId>& banned_now,
                          const int32_t* allowed, SamplerState& state, TokenId draft = -1);

}  // namespace precast
