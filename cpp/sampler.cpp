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

void apply_penalties(float* logits, const SamplingParams& p, const std::vector<TokenId>& context, int num_output) {
  if (p.repetition_penalty != 1.0f) {
    std::vector<TokenId> seen(context.begin(), context.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (TokenId t : seen) logits[t] = logits[t] > 0 ? logits[t] / p.repetition_penalty : logits[t] * p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<TokenId, int> counts;
    for (auto it = context.end() - num_output; it != context.end(); ++it) ++counts[*it];
    for (const auto& [t, c] : counts) logits[t] -= p.presence_penalty + p.frequency_penalty * float(c);
  }
}

}  // namespace

SampleResult sample_token(float* logits, int vocab, const SamplingParams& p, const std::vector<TokenId>& context,
                          int num_output, const std::vector<std::vector<TokenId>>& bad_words,
                          const std::vector<TokenId>& banned_now, SamplerState& state) {
  SampleResult result;
  std::vector<float> logprobs;
  if (p.top_logprobs >= 0) log_softmax(logits, vocab, logprobs);

  ban_bad_words(logits, vocab, context, bad_words);
  for (TokenId t : banned_now)
    if (t >= 0 && t < vocab) logits[t] = kNegInf;
  apply_penalties(logits, p, context, num_output);

  if (p.temperature <= 0.0f) {
    // Greedy: the first maximum, so ties break the same way every time.
    result.token = TokenId(std::max_element(logits, logits + vocab) - logits);
  } else {
    // Candidates sorted by logit (index breaks ties), then truncated by top-k / top-p / min-p.
    std::vector<int> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    const int k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
    auto by_logit = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit);
    order.resize(k);
    std::vector<double> probs(k);
    const double mx = logits[order[0]] / p.temperature;
    double sum = 0.0;
    for (int i = 0; i < k; ++i) sum += probs[i] = std::exp(double(logits[order[i]]) / p.temperature - mx);
    int keep = k;
    if (p.top_p < 1.0f) {
      double cum = 0.0;
      for (int i = 0; i < k; ++i) {
        cum += probs[i] / sum;
        if (cum >= p.top_p) {
          keep = i + 1;
          break;
        }
      }
    }
    if (p.min_p > 0.0f) {
      const double floor = probs[0] * p.min_p;
      int i = 1;
      while (i < keep && probs[i] >= floor) ++i;
      keep = i;
    }
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    double kept = std::accumulate(probs.begin(), probs.begin() + keep, 0.0);
    double r = uniform(state.rng) * kept;
    int chosen = keep - 1;
    for (int i = 0; i < keep; ++i) {
      r -= probs[i];
      if (r < 0) {
        chosen = i;
        break;
      }
    }
    result.token = order[chosen];
  }

  if (p.top_logprobs >= 0) {
    result.logprob = logprobs[result.token];
    const int n = std::min(p.top_logprobs, vocab);
    std::vector<int> idx(vocab);
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                      [&](int a, int b) { return logprobs[a] > logprobs[b] || (logprobs[a] == logprobs[b] && a < b); });
    for (int i = 0; i < n; ++i) result.top.push_back({idx[i], logprobs[idx[i]]});
  }
  return result;
}

}  // namespace precast
