#include "cpu_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "check.h"

namespace precast {

CpuRunner::CpuRunner(CpuModelConfig config) : config_(std::move(config)), pool_(std::max(1, config_.num_threads)) {
  const CpuModelConfig& c = config_;
  if (c.num_layers < 1 || c.hidden_size < 1 || c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads)
    throw std::invalid_argument("inconsistent model config for the CPU runner");
  if (int(c.inv_freq.size()) != c.head_dim / 2) throw std::invalid_argument("inv_freq must have head_dim / 2 entries");
}

std::pair<int, int> CpuRunner::expected_shape(const std::string& name) const {
  const CpuModelConfig& c = config_;
  const int q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim, h = c.hidden_size;
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), std::string::npos, suffix) == 0;
  };
  if (name == "embed.weight" || name == "lm_head.weight") return {c.vocab_size, h};
  if (name == "final_norm.weight" || ends(".attn_norm.weight") || ends(".mlp_norm.weight")) return {-1, h};
  if (ends(".attn.qkv.weight")) return {q + 2 * kv, h};
  if (ends(".attn.qkv.bias")) return {-1, q + 2 * kv};
  if (ends(".attn.q_norm.weight") || ends(".attn.k_norm.weight")) return {-1, c.head_dim};
  if (ends(".attn.o.weight")) return {h, q};
  if (ends(".mlp.gate_up.weight")) return {2 * c.intermediate_size, h};
  if (ends(".mlp.down.weight")) return {h, c.intermediate_size};
  throw std::invalid_argument("unknown weight " + name);
}

void CpuRunner::set_weight(const std::string& name, const void* data, size_t nbytes) {
  PRECAST_CHECK(!finalized_, "weights are frozen after finalize()");
  const auto [rows, cols] = expected_shape(name);
  const size_t elem = rows < 0 || config_.dtype == WeightDtype::kF32 ? 4 : 2;
  const size_t want = size_t(rows < 0 ? 1 : rows) * size_t(cols) * elem;
  if (nbytes != want) throw std::invalid_argument(name + ": got " + std::to_string(nbytes) + " bytes, expected " + std::to_string(want));
  if (rows < 0) {
    const float* f = static_cast<const float*>(data);
    vectors_[name].assign(f, f + cols);
  } else {
    matrices_[name] = PackedMatrix::pack(data, config_.dtype, rows, cols);
  }
}

const PackedMatrix* CpuRunner::matrix(const std::string& name) const {
  auto it = matrices_.find(name);
  if (it == matrices_.end()) throw std::invalid_argument("missing weight " + name);
  return &it->second;
}

const float* CpuRunner::vector(const std::string& name) const {
  auto it = vectors_.find(name);
  if (it == vectors_.end()) throw std::invalid_argument("missing weight " + name);
  return it->second.data();
}

void CpuRunner::finalize() {
  const CpuModelConfig& c = config_;
  embed_ = matrix("embed.weight");
  lm_head_ = c.tie_word_embeddings ? embed_ : matrix("lm_head.weight");
  final_norm_ = vector("final_norm.weight");
  layers_.clear();
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer l;
    l.qkv = matrix(p + "attn.qkv.weight");
    l.o = matrix(p + "attn.o.weight");
    l.gate_up = matrix(p + "mlp.gate_up.weight");
    l.down = matrix(p + "mlp.down.weight");
    l.attn_norm = vector(p + "attn_norm.weight");
    l.mlp_norm = vector(p + "mlp_norm.weight");
    if (c.qkv_bias) l.qkv_bias = vector(p + "attn.qkv.bias");
    if (c.qk_norm) {
      l.q_norm = vector(p + "attn.q_norm.weight");
      l.k_norm = vector(p + "attn.k_norm.weight");
    }
    l.sliding = c.sliding_window > 0 &&
                std::find(c.sliding_window_layers.begin(), c.sliding_window_layers.end(), i) != c.sliding_window_layers.end();
    layers_.push_back(l);
  }
  finalized_ = true;
}

int64_t CpuRunner::kv_block_bytes(int tokens_per_block) const {
  return int64_t(config_.num_layers) * 2 * config_.num_kv_heads * tokens_per_block * config_.head_dim * int64_t(sizeof(float));
}

void CpuRunner::configure_kv(int num_blocks, int tokens_per_block) {
  const int64_t per_layer = int64_t(num_blocks) * config_.num_kv_heads * tokens_per_block * config_.head_dim;
  k_cache_.clear();
  v_cache_.clear();
  for (int i = 0; i < config_.num_layers; ++i) {
    k_cache_.emplace_back(new float[per_layer]);
    v_cache_.emplace_back(new float[per_layer]);
  }
  tokens_per_block_ = tokens_per_block;
}

std::vector<float> CpuRunner::forward(const Batch& batch) {
  PRECAST_CHECK(finalized_, "call finalize() after loading weights");
  PRECAST_CHECK(tokens_per_block_ > 0, "configure_kv() was not called");
  const CpuModelConfig& c = config_;
  const int T = int(batch.token_ids.size()), H = c.hidden_size, D = c.head_dim;
  const int q_size = c.num_heads * D, kv_size = c.num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
  const int inter = c.intermediate_size;
  x_.resize(size_t(T) * H);
  h_.resize(size_t(T) * H);
  qkv_.resize(size_t(T) * qkv_size);
  attn_.resize(size_t(T) * q_size);
  tmp_.resize(size_t(T) * H);
  gate_up_.resize(size_t(T) * 2 * inter);
  act_.resize(size_t(T) * inter);

  std::vector<AttentionSequence> seqs;
  std::vector<const int*> token_table(T);
  for (const BatchSequence& s : batch.sequences) {
    seqs.push_back({s.block_table.data(), s.context_len, s.num_tokens, s.token_offset});
    for (int t = 0; t < s.num_tokens; ++t) token_table[s.token_offset + t] = s.block_table.data();
  }
  for (int t = 0; t < T; ++t) {
    PRECAST_CHECK(batch.token_ids[t] >= 0 && batch.token_ids[t] < c.vocab_size, "token id out of range");
    matrix_row(*embed_, batch.token_ids[t], x_.data() + size_t(t) * H);
  }
  const float scale = 1.0f / std::sqrt(float(D));
  auto rows_parallel = [&](int n, auto&& fn) { pool_.parallel_for(n, [&](int64_t b, int64_t e) { fn(int(b), int(e - b)); }); };

  for (int li = 0; li < c.num_layers; ++li) {
    const Layer& L = layers_[li];
    PagedKvLayer cache{k_cache_[li].get(), v_cache_[li].get(), tokens_per_block_, c.num_kv_heads, D};
    rows_parallel(T, [&](int r, int n) { rms_norm(x_.data() + size_t(r) * H, L.attn_norm, n, H, c.norm_eps, h_.data() + size_t(r) * H); });
    linear(pool_, h_.data(), T, *L.qkv, L.qkv_bias, qkv_.data());
    rows_parallel(T, [&](int r0, int n) {
      for (int t = r0; t < r0 + n; ++t) {
        float* q = qkv_.data() + size_t(t) * qkv_size;
        float* k = q + q_size;
        if (c.qk_norm) {
          rms_norm(q, L.q_norm, c.num_heads, D, c.norm_eps, q);
          rms_norm(k, L.k_norm, c.num_kv_heads, D, c.norm_eps, k);
        }
        rope(q, c.num_heads, D, batch.positions[t], c.inv_freq.data(), c.attention_factor);
        rope(k, c.num_kv_heads, D, batch.positions[t], c.inv_freq.data(), c.attention_factor);
        write_kv(cache, token_table[t], batch.positions[t], k, k + kv_size);
      }
    });
    paged_attention(pool_, cache, seqs, qkv_.data(), qkv_size, c.num_heads, L.sliding ? c.sliding_window : 0, scale, attn_.data());
    linear(pool_, attn_.data(), T, *L.o, nullptr, tmp_.data());
    for (size_t i = 0; i < size_t(T) * H; ++i) x_[i] += tmp_[i];
    rows_parallel(T, [&](int r, int n) { rms_norm(x_.data() + size_t(r) * H, L.mlp_norm, n, H, c.norm_eps, h_.data() + size_t(r) * H); });
    linear(pool_, h_.data(), T, *L.gate_up, nullptr, gate_up_.data());
    rows_parallel(T, [&](int r, int n) { silu_and_mul(gate_up_.data() + size_t(r) * 2 * inter, n, inter, act_.data() + size_t(r) * inter); });
    linear(pool_, act_.data(), T, *L.down, nullptr, tmp_.data());
    for (size_t i = 0; i < size_t(T) * H; ++i) x_[i] += tmp_[i];
  }

  // Final norm and LM head only for the last token of each sampling sequence.
  std::vector<float> last;
  for (const BatchSequence& s : batch.sequences) {
    if (!s.sample) continue;
    const float* row = x_.data() + size_t(s.token_offset + s.num_tokens - 1) * H;
    last.insert(last.end(), row, row + H);
  }
  const int S = int(last.size()) / H;
  std::vector<float> normed(last.size());
  rms_norm(last.data(), final_norm_, S, H, c.norm_eps, normed.data());
  std::vector<float> logits(size_t(S) * c.vocab_size);
  linear(pool_, normed.data(), S, *lm_head_, nullptr, logits.data());
  return logits;
}

}  // namespace precast
