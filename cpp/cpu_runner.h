// The CPU model runner: the generic decoder of builder/spec.py over a packed batch.
//
// Weights are copied in once (set_weight, canonical engine names), repacked into the
// kernels' panel layout and kept in the engine's dtype; KV lives in per-layer paged float32 pools whose block ids the KV
// manager hands out. Logits are computed only for sequences that sample.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu/kernels.h"
#include "cpu/paged_attention.h"
#include "cpu/thread_pool.h"
#include "model_runner.h"

namespace precast {

struct CpuModelConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float norm_eps = 1e-6f;
  bool qkv_bias = false;
  bool qk_norm = false;
  int sliding_window = 0;                  // 0: none
  std::vector<int> sliding_window_layers;  // layers using the window
  bool tie_word_embeddings = false;
  std::vector<float> inv_freq;  // head_dim / 2 rotary inverse frequencies
  float attention_factor = 1.0f;
  WeightDtype dtype = WeightDtype::kF32;  // matrices; vectors are float32
  int num_threads = 1;
};

class CpuRunner : public ModelRunner {
 public:
  explicit CpuRunner(CpuModelConfig config);

  // Copy one tensor in. Matrices in the engine dtype, 1-D tensors float32; sizes checked.
  void set_weight(const std::string& name, const void* data, size_t nbytes);
  // Check that every tensor the spec needs was given; call once after the last set_weight.
  void finalize();

  int vocab_size() const override { return config_.vocab_size; }
  int64_t kv_block_bytes(int tokens_per_block) const override;
  void configure_kv(int num_blocks, int tokens_per_block) override;
  std::vector<float> forward(const Batch& batch) override;
  const CpuModelConfig& config() const { return config_; }

 private:
  struct Layer {
    const PackedMatrix *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
    const float* qkv_bias = nullptr;
    const float* attn_norm = nullptr;
    const float* mlp_norm = nullptr;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    bool sliding = false;
  };
  // (rows, cols) of a matrix weight, or rows = -1 for a float32 vector of `cols` values.
  std::pair<int, int> expected_shape(const std::string& name) const;
  const PackedMatrix* matrix(const std::string& name) const;
  const float* vector(const std::string& name) const;

  CpuModelConfig config_;
  ThreadPool pool_;
  std::unordered_map<std::string, PackedMatrix> matrices_;
  std::unordered_map<std::string, std::vector<float>> vectors_;
  std::vector<Layer> layers_;
  const PackedMatrix* embed_ = nullptr;
  const PackedMatrix* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  bool finalized_ = false;
  // KV pools, one K and one V per layer. Left uninitialized on purpose: a position is
  // always written before it is read, and untouched pages cost no physical memory.
  std::vector<std::unique_ptr<float[]>> k_cache_, v_cache_;
  int tokens_per_block_ = 0;
  // Work buffers, grown to the largest batch seen.
  std::vector<float> x_, h_, qkv_, attn_, tmp_, gate_up_, act_;
};

}  // namespace precast
