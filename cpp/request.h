// What a client asks for and what it gets back (the Executor API's data types).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace precast {

using TokenId = int32_t;
using RequestId = uint64_t;

struct SamplingParams {
  float temperature = 1.0f;         // 0: greedy
  int top_k = 0;                    // 0: off
  float top_p = 1.0f;               // 1: off
  float min_p = 0.0f;               // 0: off
  float repetition_penalty = 1.0f;  // on prompt and output tokens, HF's rule
  float presence_penalty = 0.0f;    // on output tokens, OpenAI's rule
  float frequency_penalty = 0.0f;
  std::optional<uint64_t> seed;                       // same seed, same tokens, whatever shares the batch
  int top_logprobs = -1;                              // -1: no logprobs; 0: the chosen token's; n: also the n best
  std::vector<std::pair<TokenId, float>> logit_bias;  // added to those tokens' logits (OpenAI's logit_bias)
};

struct Request {
  std::vector<TokenId> prompt;
  SamplingParams sampling;
  int max_tokens = 16;
  int min_tokens = 0;
  std::vector<TokenId> stop_token_ids;  // besides the engine's eos ids
  bool ignore_eos = false;
  bool streaming = false;
  int priority = 0;                             // higher first among waiting requests; FCFS within a priority
  std::vector<std::vector<TokenId>> bad_words;  // token sequences never generated
  uint64_t guide_id = 0;                        // nonzero: a grammar of the executor's GuidedDecoder
  int prompt_logprobs = -1;  // -1: none; 0: each prompt token's log-probability; n: also the n best at each
  bool speculative = true;   // may take proposed tokens when the executor has a proposer (false: plain decoding)
};

enum class FinishReason { kNone, kLength, kStop, kCancelled, kError };

struct TokenLogprob {
  TokenId token;
  float logprob;
};

struct Response {
  RequestId request_id = 0;
  std::vector<TokenId> new_tokens;
  std::vector<float> logprobs;                          // one per new token, when asked
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // one list per new token, when asked
  // Prompt tokens 1.. in order, as computed (prompt_logprobs); the first token has none.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<TokenLogprob>> prompt_top_logprobs;
  FinishReason finish_reason = FinishReason::kNone;
  std::string error;  // set with kError
  int num_prompt_tokens = 0;
  int num_cached_prompt_tokens = 0;  // served from the prefix cache
  // Speculative decoding so far (cumulative over the request): tokens proposed and checked, and accepted.
  int num_draft_tokens = 0;
  int num_accepted_draft_tokens = 0;
  bool finished() const { return finish_reason != FinishReason::kNone; }
};

}  // namespace precast
