// Structured outputs: the seam through which a grammar decides which tokens may come next.
//
// A request that must follow a grammar (a JSON schema, a regex, ...) carries a nonzero
// `guide_id`; the grammar state behind that id lives in the GuidedDecoder the executor
// was given (in Python: runtime/guided.py over llguidance). The executor asks for all of a
// step's masks in one call and reports all of a step's sampled tokens in one call, so an
// implementation in Python takes the GIL twice per step, not twice per request, and
// steps without guided requests never call it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "request.h"

namespace precast {

// Allowed-token bitmasks: bit (t % 32) of word t / 32 is set when token t may be sampled.
inline int mask_words(int vocab_size) { return (vocab_size + 31) / 32; }

class GuidedDecoder {
 public:
  virtual ~GuidedDecoder() = default;
  // Row i of `masks` (`words_per_row` int32 words each) gets the allowed tokens of guide_ids[i].
  // Returns one message per id: empty, or why that grammar cannot go on (the request then ends with
  // an error instead of sampling).
  virtual std::vector<std::string> fill_masks(const std::vector<uint64_t>& guide_ids, int32_t* masks,
                                              int words_per_row) = 0;
  // Each grammar consumes the token its request just produced.
  virtual void advance(const std::vector<uint64_t>& guide_ids, const std::vector<TokenId>& tokens) = 0;
};

}  // namespace precast
