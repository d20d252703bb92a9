#include <algorithm>
#include <stdexcept>
#include <string>

#include "proposer.h"

namespace precast {

NgramProposer::NgramProposer(int min_ngram, int max_ngram) : min_ngram_(min_ngram), max_ngram_(max_ngram) {
  if (min_ngram < 1 || max_ngram < min_ngram)
    throw std::invalid_argument("n-gram sizes must satisfy 1 <= min <= max, got min " + std::to_string(min_ngram) +
                                ", max " + std::to_string(max_ngram));
}

std::vector<TokenId> NgramProposer::lookup(const std::vector<TokenId>& tokens, int min_ngram, int max_ngram,
                                           int max_draft) {
  const int len = int(tokens.size());
  for (int n = std::min(max_ngram, len - 1); n >= min_ngram; --n) {
    const TokenId* suffix = tokens.data() + len - n;
    // Latest first: an earlier occurrence of the suffix ending before the suffix itself starts.
    for (int start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + n, tokens.data() + start)) continue;
      const int from = start + n;  // <= len - 1: at least one token follows
      const int to = std::min(len, from + max_draft);
      return std::vector<TokenId>(tokens.begin() + from, tokens.begin() + to);
    }
  }
  return {};
}

std::vector<std::vector<TokenId>> NgramProposer::propose(const std::vector<DraftRequest>& requests) {
  std::vector<std::vector<TokenId>> drafts;
  drafts.reserve(requests.size());
  for (const DraftRequest& r : requests) drafts.push_back(lookup(*r.tokens, min_ngram_, max_ngram_, r.max_draft));
  return drafts;
}

}  // namespace precast
