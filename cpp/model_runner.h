// The model runner seam: one forward pass over a packed batch.
//
// The batch is packed without padding: the tokens of every scheduled sequence one after
// another. For sequence s, tokens [token_offset, token_offset + num_tokens) sit at
// positions [context_len, context_len + num_tokens); their K/V go into the sequence's
// block table at those positions, and attention reads positions [0, context_len +
// num_tokens). A sequence with `sample` set needs logits for its last token; one with
// `all_logits` set needs them for every token of the step (prompt log-probabilities).
//
// The runner owns KV storage (sized by configure_kv); the KV manager owns block ids.
#pragma once

#include <cstdint>
#include <vector>

#include "request.h"

namespace precast {

struct BatchSequence {
  RequestId request_id = 0;
  int context_len = 0;      // tokens whose K/V are already in the cache
  int num_tokens = 0;       // tokens computed this step
  int token_offset = 0;     // first of them in Batch::token_ids
  bool sample = false;      // produce a logits row for the last token
  bool all_logits = false;  // produce a logits row for every token of the step (the last is the sampling row)
  std::vector<int> block_table;
  int num_logit_rows() const { return all_logits ? num_tokens : int(sample); }
};

struct Batch {
  std::vector<TokenId> token_ids;
  std::vector<int32_t> positions;
  std::vector<BatchSequence> sequences;
  int num_sampling() const {
    int n = 0;
    for (const auto& s : sequences) n += s.sample;
    return n;
  }
  int num_logit_rows() const {
    int n = 0;
    for (const auto& s : sequences) n += s.num_logit_rows();
    return n;
  }
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual int vocab_size() const = 0;
  // Bytes one KV block of `tokens_per_block` tokens takes across all layers (K and V).
  virtual int64_t kv_block_bytes(int tokens_per_block) const = 0;
  // Allocate KV storage for `num_blocks` blocks. Called once before the first forward.
  virtual void configure_kv(int num_blocks, int tokens_per_block) = 0;
  // Slot mode: one contiguous region of max_seq_len tokens per running request (a block
  // of max_seq_len tokens), as TensorRT's linear KV-cache update needs; no prefix reuse.
  virtual bool slot_mode() const { return false; }
  // Logits [batch.num_logit_rows(), vocab_size()], row-major, rows in sequence order.
  virtual std::vector<float> forward(const Batch& batch) = 0;
  // Whether forward honours BatchSequence::all_logits (requests with prompt_logprobs need it).
  virtual bool supports_all_logits() const { return false; }
};

}  // namespace precast
