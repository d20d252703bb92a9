#include "cpu_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif

#include "check.h"
#include "cpu/bf16_gemm.h"
#include "cpu/quantize.h"

namespace precast {

CpuRunner::CpuRunner(CpuModelConfig config) : config_(std::move(config)), pool_(std::max(1, config_.num_threads)) {
  const CpuModelConfig& c = config_;
  if (c.num_layers < 1 || c.hidden_size < 1 || c.num_heads < 1 || c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads)
    throw std::invalid_argument("inconsistent model config for the CPU runner");
  if (c.first_layer < 0 || (c.first_layer > 0 && !c.layers_only))
    throw std::invalid_argument("first_layer is for layers_only runners and cannot be negative");
  if (int(c.inv_freq.size()) != c.head_dim / 2) throw std::invalid_argument("inv_freq must have head_dim / 2 entries");
  if (!c.local_inv_freq.empty() && int(c.local_inv_freq.size()) != c.head_dim / 2)
    throw std::invalid_argument("local_inv_freq must be empty or have head_dim / 2 entries");
  if (c.attention_scale < 0 || c.attn_logit_softcap < 0 || c.final_logit_softcap < 0 || !(c.embedding_scale > 0))
    throw std::invalid_argument("attention scale, soft caps and embedding scale cannot be negative");
  if (c.num_experts > 0 && (c.experts_per_token < 1 || c.experts_per_token > c.num_experts ||
                            c.moe_intermediate_size < 1 || c.moe_layers.empty()))
    throw std::invalid_argument(
        "a mixture of experts needs 1 <= experts_per_token <= num_experts, an expert size and layers");
  if (c.num_experts == 0 && !c.moe_layers.empty()) throw std::invalid_argument("moe_layers need num_experts > 0");
  if (config_.rotary_dim == 0) config_.rotary_dim = c.head_dim;  // configs that predate partial rotary
  if (c.rotary_dim % 2 || c.rotary_dim < 0 || c.rotary_dim > c.head_dim)
    throw std::invalid_argument("rotary_dim must be even and at most head_dim");
  if (c.kv_fp8 && (int(c.k_scales.size()) != c.num_layers || int(c.v_scales.size()) != c.num_layers))
    throw std::invalid_argument("an fp8 KV cache needs one K and one V scale per layer");
  for (size_t i = 0; i < c.k_scales.size() && c.kv_fp8; ++i)
    if (!(c.k_scales[i] > 0 && c.v_scales[i] > 0 && std::isfinite(c.k_scales[i]) && std::isfinite(c.v_scales[i])))
      throw std::invalid_argument("fp8 KV cache scales must be finite and positive");
}

std::pair<int, int> CpuRunner::moe_shape(const std::string& name) const {
  const CpuModelConfig& c = config_;
  const int h = c.hidden_size, mi = c.moe_intermediate_size, si = c.shared_expert_intermediate_size;
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), std::string::npos, suffix) == 0;
  };
  if (c.num_experts > 0) {
    if (ends(".moe.router.weight")) return {c.num_experts, h};
    const std::string experts = ".moe.experts.";
    const size_t at = name.find(experts);
    if (at != std::string::npos) {
      const int e = std::atoi(name.c_str() + at + experts.size());
      if (e >= 0 && e < c.num_experts) {
        if (ends(".gate_up.weight")) return {2 * mi, h};
        if (ends(".down.weight")) return {h, mi};
      }
    }
    if (si > 0 && ends(".moe.shared.gate_up.weight")) return {2 * si, h};
    if (si > 0 && ends(".moe.shared.down.weight")) return {h, si};
    if (si > 0 && ends(".moe.shared_gate.weight")) return {1, h};
  }
  throw std::invalid_argument("unknown weight " + name);
}

std::pair<int, int> CpuRunner::expected_shape(const std::string& name) const {
  const CpuModelConfig& c = config_;
  const int q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim, h = c.hidden_size;
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), std::string::npos, suffix) == 0;
  };
  if (name == "embed.weight" || name == "lm_head.weight") return {c.vocab_size, h};
  if (name == "final_norm.weight" || ends(".attn_norm.weight") || ends(".mlp_norm.weight")) return {-1, h};
  if (c.sandwich_norms && (ends(".post_attn_norm.weight") || ends(".post_mlp_norm.weight"))) return {-1, h};
  if (ends(".attn.qkv.weight")) return {q + 2 * kv, h};
  if (ends(".attn.qkv.bias")) return {-1, q + 2 * kv};
  if (ends(".attn.q_norm.weight") || ends(".attn.k_norm.weight")) return {-1, c.head_dim};
  if (ends(".attn.o.weight")) return {h, q};
  if (name.find(".moe.") != std::string::npos) return moe_shape(name);
  if (ends(".mlp.gate_up.weight")) return {2 * c.intermediate_size, h};
  if (ends(".mlp.down.weight")) return {h, c.intermediate_size};
  throw std::invalid_argument("unknown weight " + name);
}

namespace {
// No NaN or Inf among `count` values: float32 by arithmetic (both propagate through x * 0), 16-bit
// formats by their exponent bits (all ones: Inf or NaN). One pass each, which the compiler vectorizes.
bool all_finite(const void* data, WeightDtype dtype, size_t count) {
  if (dtype == WeightDtype::kF32) {
    const float* x = static_cast<const float*>(data);
    float sum = 0.0f;
    for (size_t i = 0; i < count; ++i) sum += x[i] * 0.0f;
    return sum == 0.0f;
  }
  const uint16_t exponent = dtype == WeightDtype::kBF16 ? 0x7F80 : 0x7C00;
  const uint16_t* x = static_cast<const uint16_t*>(data);
  uint16_t bad = 0;
  for (size_t i = 0; i < count; ++i) bad |= uint16_t((x[i] & exponent) == exponent);
  return !bad;
}
}  // namespace

void CpuRunner::set_weight(const std::string& name, const void* data, size_t nbytes) {
  PRECAST_CHECK(!finalized_, "weights are frozen after finalize()");
  const auto [rows, cols] = expected_shape(name);
  const size_t elem = rows < 0 || config_.dtype == WeightDtype::kF32 ? 4 : 2;
  const size_t want = size_t(rows < 0 ? 1 : rows) * size_t(cols) * elem;
  if (nbytes != want)
    throw std::invalid_argument(name + ": got " + std::to_string(nbytes) + " bytes, expected " + std::to_string(want));
  // An engine damaged since its build (NaN or Inf in a weight) is refused here rather than
  // generating token 0 with NaN log-probs.
  if (!all_finite(data, rows < 0 ? WeightDtype::kF32 : config_.dtype, want / elem))
    throw std::invalid_argument(name + " holds NaN or Inf; the engine is damaged, rebuild it");
  if (rows < 0) {
    const float* f = static_cast<const float*>(data);
    vectors_[name].assign(f, f + cols);
  } else {
    matrices_[name] = Linear{PackedMatrix::pack(WeightView{config_.dtype, rows, cols, data}, unit_for(config_.dtype))};
  }
}

void CpuRunner::set_quantized_weight(const std::string& name, const WeightView& w, size_t values_bytes,
                                     size_t scales_bytes, size_t offsets_bytes, ActQuant act, float act_scale) {
  PRECAST_CHECK(!finalized_, "weights are frozen after finalize()");
  const auto [rows, cols] = expected_shape(name);
  if (rows < 0 || w.rows != rows || w.cols != cols)
    throw std::invalid_argument(name + ": shape " + std::to_string(w.rows) + "x" + std::to_string(w.cols) +
                                " does not match the model");
  check_weight_view(name, w, values_bytes, scales_bytes, offsets_bytes);
  if (!(std::isfinite(w.scale) && w.scale > 0) || !(std::isfinite(act_scale) && act_scale > 0))
    throw std::invalid_argument(name + ": scales must be finite and positive");
  if (act == ActQuant::kNvfp4Dynamic && cols % kNvfp4Block)
    throw std::invalid_argument(name + ": nvfp4 activations need an input size that is a multiple of 16");
  matrices_[name] = Linear{PackedMatrix::pack(w, unit_for(w.dtype)), act, act_scale};
}

DotUnit CpuRunner::unit_for(WeightDtype dtype) const {
  if (config_.float32_matmuls) return DotUnit::kFloat32;
  // An int4 layer's inputs are rounded to bf16 on the unit: a float32 engine keeps float32 ones.
  if (dtype == WeightDtype::kINT4 && config_.dtype != WeightDtype::kBF16) return DotUnit::kFloat32;
  return dot_unit();
}

const CpuRunner::Linear* CpuRunner::matrix(const std::string& name) const {
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
  if (c.layers_only) {
    final_norm_ = vectors_.count("final_norm.weight") ? vector("final_norm.weight") : nullptr;
  } else {
    embed_ = matrix("embed.weight");
    lm_head_ = c.tie_word_embeddings ? embed_ : matrix("lm_head.weight");
    final_norm_ = vector("final_norm.weight");
  }
  layers_.clear();
  for (int li = 0; li < c.num_layers; ++li) {
    const int i = c.first_layer + li;  // the layer's index in the whole model: its names, its window
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer l;
    l.qkv_name = p + "attn.qkv";
    l.o_name = p + "attn.o";
    l.gate_up_name = p + "mlp.gate_up";
    l.down_name = p + "mlp.down";
    l.k_name = p + "attn.k";
    l.v_name = p + "attn.v";
    l.qkv = matrix(p + "attn.qkv.weight");
    l.o = matrix(p + "attn.o.weight");
    if (std::find(c.moe_layers.begin(), c.moe_layers.end(), i) != c.moe_layers.end()) {
      l.router = matrix(p + "moe.router.weight");
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string x = p + "moe.experts." + std::to_string(e) + ".";
        l.expert_gate_up.push_back(matrix(x + "gate_up.weight"));
        l.expert_down.push_back(matrix(x + "down.weight"));
        l.expert_gate_up_names.push_back(x + "gate_up");
        l.expert_down_names.push_back(x + "down");
      }
      if (c.shared_expert_intermediate_size > 0) {
        l.shared_gate_up = matrix(p + "moe.shared.gate_up.weight");
        l.shared_down = matrix(p + "moe.shared.down.weight");
        l.shared_gate = matrix(p + "moe.shared_gate.weight");
        l.shared_gate_up_name = p + "moe.shared.gate_up";
        l.shared_down_name = p + "moe.shared.down";
      }
    } else {
      l.gate_up = matrix(p + "mlp.gate_up.weight");
      l.down = matrix(p + "mlp.down.weight");
    }
    l.attn_norm = vector(p + "attn_norm.weight");
    l.mlp_norm = vector(p + "mlp_norm.weight");
    if (c.sandwich_norms) {
      l.post_attn_norm = vector(p + "post_attn_norm.weight");
      l.post_mlp_norm = vector(p + "post_mlp_norm.weight");
    }
    if (c.qkv_bias) l.qkv_bias = vector(p + "attn.qkv.bias");
    if (c.qk_norm) {
      l.q_norm = vector(p + "attn.q_norm.weight");
      l.k_norm = vector(p + "attn.k_norm.weight");
    }
    l.sliding = c.sliding_window > 0 && std::find(c.sliding_window_layers.begin(), c.sliding_window_layers.end(), i) !=
                                            c.sliding_window_layers.end();
    layers_.push_back(l);
  }
  finalized_ = true;
}

CpuRunner::ReleaseFreedMemory::~ReleaseFreedMemory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

KvElement CpuRunner::kv_element(int tokens_per_block) const {
  if (config_.kv_fp8) return KvElement::kE4M3;
  // An engine whose matrices multiply on a bf16 unit keeps its KV in bf16 too, as HF's bf16 models
  // do, and attends on that unit; float32 matmuls keep the float32 cache and attention.
  const bool bf16_compute = config_.dtype == WeightDtype::kBF16 && !config_.float32_matmuls;
  if (bf16_compute && bf16_kv_supported(tokens_per_block, config_.head_dim)) return KvElement::kBf16;
  return KvElement::kFloat32;
}

int64_t CpuRunner::kv_block_bytes(int tokens_per_block) const {
  const int64_t element = kv_element_bytes(kv_element(tokens_per_block));
  return int64_t(config_.num_layers) * 2 * config_.num_kv_heads * tokens_per_block * config_.head_dim * element;
}

void CpuRunner::allocate(KvPool& pool, int num_blocks, int tokens_per_block) const {
  const int64_t per_layer = kv_block_bytes(tokens_per_block) / (2 * config_.num_layers) * num_blocks;
  pool.k.clear();
  pool.v.clear();
  for (int i = 0; i < config_.num_layers; ++i) {
    pool.k.push_back(uninitialized_bytes(per_layer));
    pool.v.push_back(uninitialized_bytes(per_layer));
  }
  pool.tokens_per_block = tokens_per_block;
  pool.element = kv_element(tokens_per_block);
  pool.num_blocks = num_blocks;
}

void CpuRunner::configure_kv(int num_blocks, int tokens_per_block) {
  allocate(serving_kv_, num_blocks, tokens_per_block);
}

void CpuRunner::apply(const Linear& l, const std::string& name, const float* x, int num_rows, const float* bias,
                      float* y) {
  const int cols = l.weight.cols;
  if (observer_ && !name.empty()) observer_->observe(name, x, num_rows, cols, cols);
  float input_scale = 1.0f;
  const float* row_scales = nullptr;
  if (l.act != ActQuant::kNone) {
    quantized_input_.resize(size_t(num_rows) * cols);
    float* q = quantized_input_.data();
    // A bf16 dot-product unit takes the codes (exact in bf16) and applies the scales to the outputs.
    const bool codes = l.weight.dot != DotUnit::kFloat32;
    if (l.act == ActQuant::kFp8Dynamic) {
      // Each row (token) on its own scale: the same whatever else is in the batch.
      row_scales_.resize(size_t(num_rows));
      fp8_dynamic_scales(x, num_rows, cols, row_scales_.data());
      for (int r = 0; r < num_rows; ++r) {
        const int64_t at = int64_t(r) * cols;
        (codes ? fp8_codes : fake_quant_fp8)(x + at, cols, row_scales_[size_t(r)], q + at);
      }
      if (codes) row_scales = row_scales_.data();
    } else {
      if (l.act == ActQuant::kFp8Static)
        (codes ? fp8_codes : fake_quant_fp8)(x, int64_t(num_rows) * cols, l.act_scale, q);
      else
        (codes ? nvfp4_codes : fake_quant_nvfp4)(x, num_rows, cols, l.act_scale, q);
      if (codes) input_scale = l.act_scale;
    }
    x = q;
  }
  linear(pool_, x, num_rows, l.weight, bias, y, input_scale, row_scales);
}

Batch CpuRunner::evaluation_batch(int num_tokens, bool sample) {
  const int B = 32;
  const int blocks = (num_tokens + B - 1) / B;
  if (eval_kv_.num_blocks < blocks) allocate(eval_kv_, blocks, B);
  Batch batch;
  batch.token_ids.assign(num_tokens, 0);
  for (int t = 0; t < num_tokens; ++t) batch.positions.push_back(t);
  BatchSequence seq;
  seq.num_tokens = num_tokens;
  seq.sample = sample;
  for (int b = 0; b < blocks; ++b) seq.block_table.push_back(b);
  batch.sequences.push_back(seq);
  return batch;
}

std::vector<float> CpuRunner::evaluate(const std::vector<int>& tokens, bool logits) {
  PRECAST_CHECK(finalized_, "call finalize() after loading weights");
  PRECAST_CHECK(!config_.layers_only, "a layers_only runner has no embedding: use evaluate_hidden");
  if (tokens.empty()) return {};
  Batch batch = evaluation_batch(int(tokens.size()), logits);
  batch.token_ids = tokens;
  return run(batch, logits, eval_kv_);
}

std::vector<float> CpuRunner::evaluate_hidden(const float* hidden, int num_tokens) {
  PRECAST_CHECK(finalized_, "call finalize() after loading weights");
  PRECAST_CHECK(config_.layers_only, "evaluate_hidden needs a layers_only runner");
  if (num_tokens <= 0) return {};
  const int H = config_.hidden_size;
  const Batch batch = evaluation_batch(num_tokens, false);
  x_.assign(hidden, hidden + size_t(num_tokens) * H);
  run_layers(batch, eval_kv_);
  if (observer_ && final_norm_) {
    std::vector<float> normed(x_.size());
    rms_norm(x_.data(), final_norm_, num_tokens, H, config_.norm_eps, normed.data());
    observer_->observe(head_name(), normed.data(), num_tokens, H, H);
  }
  return std::vector<float>(x_.begin(), x_.end());
}

std::vector<float> CpuRunner::forward(const Batch& batch) {
  PRECAST_CHECK(serving_kv_.num_blocks > 0, "configure_kv() was not called");
  PRECAST_CHECK(!config_.layers_only, "a layers_only runner cannot serve");
  return run(batch, false, serving_kv_);
}

std::vector<float> CpuRunner::run(const Batch& batch, bool all_logits, const KvPool& kv) {
  PRECAST_CHECK(finalized_, "call finalize() after loading weights");
  const CpuModelConfig& c = config_;
  const int T = int(batch.token_ids.size()), H = c.hidden_size;
  x_.resize(size_t(T) * H);
  for (int t = 0; t < T; ++t) {
    PRECAST_CHECK(batch.token_ids[t] >= 0 && batch.token_ids[t] < c.vocab_size, "token id out of range");
    float* row = x_.data() + size_t(t) * H;
    matrix_row(embed_->weight, batch.token_ids[t], row);
    if (c.embedding_scale != 1.0f)
      for (int i = 0; i < H; ++i) row[i] *= c.embedding_scale;
  }
  run_layers(batch, kv);

  // Final norm and LM head only for the last token of each sampling sequence (every
  // token of them with all_logits or the sequence's own all_logits; every token's norm when observed).
  std::vector<float> rows;
  for (const BatchSequence& s : batch.sequences) {
    if (!s.sample && !s.all_logits && !observer_) continue;
    const bool every = all_logits || s.all_logits || observer_;
    const int first = every ? s.token_offset : s.token_offset + s.num_tokens - 1;
    rows.insert(rows.end(), x_.data() + size_t(first) * H, x_.data() + size_t(s.token_offset + s.num_tokens) * H);
  }
  const int S = int(rows.size()) / H;
  std::vector<float> normed(rows.size());
  rms_norm(rows.data(), final_norm_, S, H, c.norm_eps, normed.data());
  if (observer_) {
    observer_->observe(head_name(), normed.data(), S, H, H);
    if (!all_logits) return {};  // observed runs without logits (calibration) stop here
  }
  std::vector<float> logits(size_t(S) * c.vocab_size);
  static const std::string kObservedAbove;
  apply(*lm_head_, kObservedAbove, normed.data(), S, nullptr, logits.data());
  if (c.final_logit_softcap > 0) soft_cap(logits.data(), int64_t(logits.size()), c.final_logit_softcap);
  return logits;
}

void CpuRunner::run_layers(const Batch& batch, const KvPool& kv) {
  const CpuModelConfig& c = config_;
  const int T = int(batch.token_ids.size()), H = c.hidden_size, D = c.head_dim;
  const int q_size = c.num_heads * D, kv_size = c.num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
  const int inter = c.intermediate_size;
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
  const float scale = c.attention_scale > 0 ? c.attention_scale : 1.0f / std::sqrt(float(D));
  auto rows_parallel = [&](int n, auto&& fn) {
    pool_.parallel_for(n, [&](int64_t b, int64_t e) { fn(int(b), int(e - b)); });
  };

  // Residual adds ride along with the next norm, split over rows like it: x += tmp, then h = norm(x).
  auto add_then_norm = [&](bool add, const float* weight) {
    rows_parallel(T, [&](int r, int n) {
      float* x = x_.data() + size_t(r) * H;
      if (add)
        for (size_t i = 0; i < size_t(n) * H; ++i) x[i] += tmp_[size_t(r) * H + i];
      if (weight) rms_norm(x, weight, n, H, c.norm_eps, h_.data() + size_t(r) * H);
    });
  };
  // Sandwich norms: a block's output (in tmp_) normed in place before its residual add.
  auto post_norm = [&](const float* weight) {
    if (!weight) return;
    rows_parallel(T, [&](int r, int n) {
      float* y = tmp_.data() + size_t(r) * H;
      rms_norm(y, weight, n, H, c.norm_eps, y);
    });
  };
  bool mlp_pending = false;  // tmp_ holds the previous layer's MLP output, not yet added to x_
  for (int li = 0; li < c.num_layers; ++li) {
    const Layer& L = layers_[li];
    PagedKvLayer cache{kv.k[li].get(),
                       kv.v[li].get(),
                       kv.tokens_per_block,
                       c.num_kv_heads,
                       D,
                       kv.element,
                       c.kv_fp8 ? c.k_scales[li] : 1.0f,
                       c.kv_fp8 ? c.v_scales[li] : 1.0f};
    const bool local_rope = L.sliding && !c.local_inv_freq.empty();
    const float* inv_freq = local_rope ? c.local_inv_freq.data() : c.inv_freq.data();
    const float attention_factor = local_rope ? c.local_attention_factor : c.attention_factor;
    add_then_norm(mlp_pending, L.attn_norm);
    apply(*L.qkv, L.qkv_name, h_.data(), T, L.qkv_bias, qkv_.data());
    rows_parallel(T, [&](int r0, int n) {
      for (int t = r0; t < r0 + n; ++t) {
        float* q = qkv_.data() + size_t(t) * qkv_size;
        float* k = q + q_size;
        if (c.qk_norm) {
          rms_norm(q, L.q_norm, c.num_heads, D, c.norm_eps, q);
          rms_norm(k, L.k_norm, c.num_kv_heads, D, c.norm_eps, k);
        }
        rope(q, c.num_heads, D, c.rotary_dim / 2, batch.positions[t], inv_freq, attention_factor);
        rope(k, c.num_kv_heads, D, c.rotary_dim / 2, batch.positions[t], inv_freq, attention_factor);
        write_kv(cache, token_table[t], batch.positions[t], k, k + kv_size);
      }
    });
    if (observer_) {  // K after norm and rotation, V: what the cache stores
      observer_->observe(L.k_name, qkv_.data() + q_size, T, kv_size, qkv_size);
      observer_->observe(L.v_name, qkv_.data() + q_size + kv_size, T, kv_size, qkv_size);
    }
    paged_attention(pool_, cache, seqs, qkv_.data(), qkv_size, c.num_heads, L.sliding ? c.sliding_window : 0, scale,
                    c.attn_logit_softcap, attn_.data());
    apply(*L.o, L.o_name, attn_.data(), T, nullptr, tmp_.data());
    post_norm(L.post_attn_norm);
    add_then_norm(true, L.mlp_norm);
    if (L.router) {
      run_moe(L, T);
    } else {
      apply(*L.gate_up, L.gate_up_name, h_.data(), T, nullptr, gate_up_.data());
      rows_parallel(T, [&](int r, int n) {
        gated_activation(gate_up_.data() + size_t(r) * 2 * inter, n, inter, c.activation,
                         act_.data() + size_t(r) * inter);
      });
      apply(*L.down, L.down_name, act_.data(), T, nullptr, tmp_.data());
    }
    post_norm(L.post_mlp_norm);
    mlp_pending = true;
  }
  if (mlp_pending) add_then_norm(true, nullptr);
}

void CpuRunner::run_moe(const Layer& L, int T) {
  const CpuModelConfig& c = config_;
  const int E = c.num_experts, K = c.experts_per_token, H = c.hidden_size, MI = c.moe_intermediate_size;
  router_logits_.resize(size_t(T) * E);
  apply(*L.router, std::string(), h_.data(), T, nullptr, router_logits_.data());  // never quantized, not observed

  // Routing, per token: softmax over every expert in float32, the K most probable (ties: the lower expert), their
  // probabilities renormalised when the family does; each listed with its expert as (token, weight).
  expert_rows_.resize(E);
  for (auto& rows : expert_rows_) rows.clear();  // keeps their capacity from step to step
  std::vector<int> order(E);
  std::vector<float> probs(E);
  for (int t = 0; t < T; ++t) {
    const float* z = router_logits_.data() + size_t(t) * E;
    const float top = *std::max_element(z, z + E);
    float sum = 0.0f;
    for (int e = 0; e < E; ++e) sum += (probs[e] = std::exp(z[e] - top));
    for (int e = 0; e < E; ++e) probs[e] /= sum;
    for (int e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [&](int a, int b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
    float chosen = 0.0f;
    for (int k = 0; k < K; ++k) chosen += probs[order[k]];
    for (int k = 0; k < K; ++k)
      expert_rows_[order[k]].push_back({t, c.moe_renormalize ? probs[order[k]] / chosen : probs[order[k]]});
  }

  // Each routed expert once, over its tokens' rows (the others' weights are never read), in expert order, each
  // token adding output x weight as it goes: every token sums its experts in expert order, as transformers does.
  std::fill(tmp_.begin(), tmp_.begin() + size_t(T) * H, 0.0f);
  for (int e = 0; e < E; ++e) {
    const std::vector<std::pair<int, float>>& rows = expert_rows_[e];
    const int n = int(rows.size());
    if (n == 0) continue;
    expert_in_.resize(size_t(n) * H);
    expert_gate_up_.resize(size_t(n) * 2 * MI);
    expert_act_.resize(size_t(n) * MI);
    expert_y_.resize(size_t(n) * H);
    for (int j = 0; j < n; ++j)
      std::memcpy(expert_in_.data() + size_t(j) * H, h_.data() + size_t(rows[j].first) * H, sizeof(float) * H);
    apply(*L.expert_gate_up[e], L.expert_gate_up_names[e], expert_in_.data(), n, nullptr, expert_gate_up_.data());
    gated_activation(expert_gate_up_.data(), n, MI, c.activation, expert_act_.data());
    apply(*L.expert_down[e], L.expert_down_names[e], expert_act_.data(), n, nullptr, expert_y_.data());
    for (int j = 0; j < n; ++j) {
      const auto [t, w] = rows[j];
      const float* o = expert_y_.data() + size_t(j) * H;
      float* y = tmp_.data() + size_t(t) * H;
      for (int i = 0; i < H; ++i) y[i] += o[i] * w;
    }
  }
  if (!L.shared_gate_up) return;
  // The shared expert on every token, scaled by sigmoid(shared_gate . x).
  const int SI = c.shared_expert_intermediate_size;
  expert_gate_up_.resize(size_t(T) * 2 * SI);
  expert_act_.resize(size_t(T) * SI);
  expert_y_.resize(size_t(T) * H);
  std::vector<float> gate(T);
  apply(*L.shared_gate_up, L.shared_gate_up_name, h_.data(), T, nullptr, expert_gate_up_.data());
  gated_activation(expert_gate_up_.data(), T, SI, c.activation, expert_act_.data());
  apply(*L.shared_down, L.shared_down_name, expert_act_.data(), T, nullptr, expert_y_.data());
  apply(*L.shared_gate, std::string(), h_.data(), T, nullptr, gate.data());
  for (int t = 0; t < T; ++t) {
    const float g = 1.0f / (1.0f + std::exp(-gate[t]));
    const float* o = expert_y_.data() + size_t(t) * H;
    float* y = tmp_.data() + size_t(t) * H;
    for (int i = 0; i < H; ++i) y[i] += g * o[i];
  }
}

}  // namespace precast
