#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

namespace precast {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// log-softmax of `x` into `out` (max-subtracted, double accumulation for a stable sum).
void log_softmax(const float* x, int n, std::vector<float>& out) {
  out.resize(n);
  float mx = *std::max_element(x, x + n);
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += std::exp(double(x[i] - mx));
  const float lse = mx + float(std::log(sum));
  for (int i = 0; i < n; ++i) out[i] = x[i] - lse;
}

void ban_bad_words(float* logits, int vocab, const std::vector<TokenId>& context,
                   const std::vector<std::vector<TokenId>>& bad_words) {
  for (const auto& word : bad_words) {
    if (word.empty()) continue;
    const size_t prefix = word.size() - 1;
    if (prefix > context.size()) continue;
    if (std::equal(word.begin(), word.end() - 1, context.end() - prefix)) {
      TokenId t = word.back();
      if (t >= 0 && t < vocab) logits[t] = kNegInf;
    }
  }
}

void keep_allowed(float* logits, int vocab, const int32_t* allowed) {
  for (int t = 0; t < vocab; ++t)
    if (!((uint32_t(allowed[t >> 5]) >> (t & 31)) & 1u)) logits[t] = kNegInf;
}

void apply_penalties(float* logits, const SamplingParams& p, const std::vector<TokenId>& context, int num_output) {
  if (p.repetition_penalty != 1.0f) {
    std::vector<TokenId> seen(context.begin(), context.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (TokenId t : seen)
      logits[t] = logits[t] > 0 ? logits[t] / p.repetition_penalty : logits[t] * p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<TokenId, int> counts;
    for (auto it = context.end() - num_output; it != context.end(); ++it) ++counts[*it];
    for (const auto& [t, c] : counts) logits[t] -= p.presence_penalty + p.frequency_penalty * float(c);
  }
}

// The tokens a draw may pick and their weights: softmax(logits / temperature) unnormalised,
// truncated by top-k, top-p and min-p to the first `keep` of `order`. Untruncated, `order` is
// empty and every token is a candidate in index order (one pass, nothing sorted); truncated,
// only as many of the most likely tokens are sorted as the truncation needs (64, then 1024,
// ... until they cover top_p), never the whole vocabulary for nothing.
struct Candidates {
  std::vector<double> w;  // per token; banned tokens (-inf) weigh 0
  std::vector<int> order;
  int keep = 0;
  double mass = 0.0;  // the candidates' total weight
  bool truncated() const { return !order.empty(); }
  double weight_of(int token) const {
    if (!truncated()) return w[token];
    for (int i = 0; i < keep; ++i)
      if (order[i] == token) return w[token];
    return 0.0;
  }
};

Candidates candidates(const float* logits, int vocab, const SamplingParams& p) {
  Candidates c;
  const float mx = *std::max_element(logits, logits + vocab);
  const double inv_t = 1.0 / p.temperature;
  c.w.resize(vocab);
  double total = 0.0;
  for (int i = 0; i < vocab; ++i) total += c.w[i] = std::exp((double(logits[i]) - mx) * inv_t);
  const bool truncated = (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.0f || p.min_p > 0.0f;
  if (!truncated) {
    c.keep = vocab;
    c.mass = total;
    return c;
  }
  const std::vector<double>& w = c.w;
  // Tokens at least min_p times as likely as the best (whose weight is 1) stay candidates:
  // they are the first `min_p_count` in descending order.
  int min_p_count = vocab;
  if (p.min_p > 0.0f) {
    min_p_count = 0;
    for (int i = 0; i < vocab; ++i) min_p_count += w[i] >= p.min_p;
  }
  std::vector<int>& order = c.order;
  order.resize(vocab);
  std::iota(order.begin(), order.end(), 0);
  auto by_weight = [&](int a, int b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  auto sort_prefix = [&](int m) { std::partial_sort(order.begin(), order.begin() + m, order.end(), by_weight); };

  int keep;  // candidates kept, the first `keep` of `order`
  if (p.top_k > 0 && p.top_k < vocab) {
    keep = p.top_k;
    sort_prefix(keep);
  } else {
    keep = std::min(vocab, p.top_p < 1.0f ? 64 : min_p_count);
    sort_prefix(keep);
  }
  if (p.top_p < 1.0f) {
    // top-p is relative to the mass left after top-k.
    double mass = 0.0;
    if (p.top_k > 0 && p.top_k < vocab) {
      for (int i = 0; i < keep; ++i) mass += w[order[i]];
    } else {
      mass = total;
    }
    const double target = p.top_p * mass;
    for (int limit = keep;;) {
      double cum = 0.0;
      int i = 0;
      for (; i < limit; ++i) {
        cum += w[order[i]];
        if (cum >= target) break;
      }
      if (i < limit) {
        keep = i + 1;
        break;
      }
      if (limit == vocab || (p.top_k > 0 && p.top_k < vocab)) {
        keep = limit;
        break;
      }
      limit = std::min(vocab, limit * 16);  // not enough sorted yet: sort a longer prefix
      sort_prefix(limit);
    }
  }
  c.keep = std::max(1, std::min(keep, min_p_count));
  for (int i = 0; i < c.keep; ++i) c.mass += w[order[i]];
  return c;
}

// One draw from the candidates in proportion to their weights, `excluded` (if >= 0) left out.
TokenId draw(const Candidates& c, SamplerState& state, TokenId excluded = -1) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const double mass = c.mass - (excluded >= 0 ? c.weight_of(excluded) : 0.0);
  double r = uniform(state.rng) * mass;
  int last = -1;
  for (int i = 0; i < c.keep; ++i) {
    const int t = c.truncated() ? c.order[i] : i;
    if (t == excluded || c.w[t] <= 0) continue;
    last = t;
    r -= c.w[t];
    if (r < 0) return t;
  }
  return last;  // rounding left r a hair above zero
}

// `token` with its log-probability and the `top` best of `logprobs` (ties: lower id first).
SampleResult scored(const std::vector<float>& logprobs, TokenId token, int top) {
  SampleResult result;
  result.token = token;
  result.logprob = logprobs[token];
  const int vocab = int(logprobs.size());
  const int n = std::max(0, std::min(top, vocab));
  if (n == 0) return result;
  std::vector<int> idx(vocab);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                    [&](int a, int b) { return logprobs[a] > logprobs[b] || (logprobs[a] == logprobs[b] && a < b); });
  for (int i = 0; i < n; ++i) result.top.push_back({idx[i], logprobs[idx[i]]});
  return result;
}

}  // namespace

SampleResult score_token(const float* logits, int vocab, TokenId token, int top) {
  std::vector<float> logprobs;
  log_softmax(logits, vocab, logprobs);
  return scored(logprobs, token, top);
}

SampleResult sample_token(float* logits, int vocab, const SamplingParams& p, const std::vector<TokenId>& context,
                          int num_output, const std::vector<std::vector<TokenId>>& bad_words,
                          const std::vector<TokenId>& banned_now, const int32_t* allowed, SamplerState& state,
                          TokenId draft) {
  SampleResult result;
  std::vector<float> logprobs;
  if (p.top_logprobs >= 0) log_softmax(logits, vocab, logprobs);

  if (allowed) keep_allowed(logits, vocab, allowed);
  ban_bad_words(logits, vocab, context, bad_words);
  for (TokenId t : banned_now)
    if (t >= 0 && t < vocab) logits[t] = kNegInf;
  for (const auto& [t, bias] : p.logit_bias)
    if (t >= 0 && t < vocab) logits[t] += bias;
  apply_penalties(logits, p, context, num_output);
  if (*std::max_element(logits, logits + vocab) == kNegInf) return result;  // nothing may be sampled

  if (p.temperature <= 0.0f) {
    // Greedy: the first maximum, so ties break the same way every time.
    result.token = TokenId(std::max_element(logits, logits + vocab) - logits);
  } else if (draft < 0) {
    result.token = draw(candidates(logits, vocab, p), state);
  } else {
    // Speculative decoding's rule (Leviathan et al. 2023; Chen et al. 2023) for a draft proposed
    // deterministically, i.e. from a one-hot q: keep it with probability min(1, p(d) / q(d)) = p(d),
    // else draw from max(0, p - q) renormalised, which is p without d. Either way the token is
    // distributed as p, the distribution plain sampling draws from.
    const Candidates c = candidates(logits, vocab, p);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    const double p_draft = c.weight_of(draft) / c.mass;
    result.token = uniform(state.rng) < p_draft ? draft : draw(c, state, draft);
    if (result.token < 0) result.token = draft;  // only the draft had weight (p_draft rounded below 1)
  }
  result.accepted_draft = draft >= 0 && result.token == draft;

  if (p.top_logprobs >= 0) {
    const TokenId token = result.token;
    const bool accepted = result.accepted_draft;
    result = scored(logprobs, token, p.top_logprobs);
    result.accepted_draft = accepted;
  }
  return result;
}

}  // namespace precast
