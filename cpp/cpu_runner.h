// The CPU model runner: the generic decoder of builder/spec.py over a packed batch.
//
// Weights are copied in once (set_weight / set_quantized_weight, canonical engine names),
// repacked into the kernels' panel layout and kept in the engine's dtype or quantized
// format; a quantized linear layer also quantizes its input as its recipe says (fp8
// static, nvfp4 dynamic per 16). KV lives in per-layer paged pools (float32, or E4M3 with
// per-layer scales) whose block ids the KV manager hands out. Logits are computed only
// for sequences that sample.
//
// Outside the executor, `evaluate` runs one token sequence for the builder's calibration
// (recording activation statistics) and for quality measurements (logits at every position).
#pragma once

#include <cstdint>
#include <map>
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
  WeightDtype dtype = WeightDtype::kF32;  // matrices not quantized; vectors are float32
  bool kv_fp8 = false;                    // E4M3 KV cache with these per-layer scales
  std::vector<float> k_scales, v_scales;
  int num_threads = 1;
};

// How a quantized linear layer quantizes its input.
enum class ActQuant { kNone, kFp8Static, kNvfp4Dynamic };

// Activation statistics of one linear layer's input (or of K / V), gathered by `evaluate`
// while calibration is on.
struct ChannelStats {
  int cols = 0;
  int64_t rows = 0;
  std::vector<float> amax;      // per input channel: max |x|
  std::vector<double> abs_sum;  // per input channel: sum |x|
  std::vector<float> samples;   // up to max_sample_rows rows, kept every sample_every rows
};

class CpuRunner : public ModelRunner {
 public:
  explicit CpuRunner(CpuModelConfig config);

  // Copy one tensor in. Matrices in the engine dtype, 1-D tensors float32; sizes checked.
  void set_weight(const std::string& name, const void* data, size_t nbytes);
  // A quantized matrix (its view's rows/cols must match the model) and its input's quantization.
  void set_quantized_weight(const std::string& name, const WeightView& weight, size_t values_bytes, size_t scales_bytes,
                            ActQuant act, float act_scale);
  // Check that every tensor the spec needs was given; call once after the last set_weight.
  void finalize();

  int vocab_size() const override { return config_.vocab_size; }
  int64_t kv_block_bytes(int tokens_per_block) const override;
  void configure_kv(int num_blocks, int tokens_per_block) override;
  std::vector<float> forward(const Batch& batch) override;
  const CpuModelConfig& config() const { return config_; }

  // Run `tokens` as one sequence from position 0 (standalone use: never while an executor
  // drives this runner; it reconfigures the KV pool when too small). Returns logits for
  // every position [tokens, vocab] when `logits` is set, else nothing.
  std::vector<float> evaluate(const std::vector<int>& tokens, bool logits);
  // Record activation statistics during later `evaluate` calls (linear inputs by weight
  // name without ".weight", and "layers.{i}.attn.k" / ".v" for K and V).
  void start_calibration(int max_sample_rows, int64_t sample_every);
  const std::map<std::string, ChannelStats>& calibration() const { return calibration_; }

 private:
  struct Linear {
    PackedMatrix weight;
    ActQuant act = ActQuant::kNone;
    float act_scale = 1.0f;  // fp8: input scale; nvfp4: input global scale
  };
  struct Layer {
    const Linear *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
    std::string prefix;  // "layers.{i}."
    const float* qkv_bias = nullptr;
    const float* attn_norm = nullptr;
    const float* mlp_norm = nullptr;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    bool sliding = false;
  };
  // (rows, cols) of a matrix weight, or rows = -1 for a float32 vector of `cols` values.
  std::pair<int, int> expected_shape(const std::string& name) const;
  const Linear* matrix(const std::string& name) const;
  const float* vector(const std::string& name) const;
  std::vector<float> run(const Batch& batch, bool all_logits);
  // y = linear(x) with the layer's input quantization; records x under `name` (unless empty) when calibrating.
  void apply(const Linear& l, const std::string& name, const float* x, int num_rows, const float* bias, float* y);
  void observe(const std::string& name, const float* x, int num_rows, int cols, int64_t stride);

  CpuModelConfig config_;
  ThreadPool pool_;
  std::unordered_map<std::string, Linear> matrices_;
  std::unordered_map<std::string, std::vector<float>> vectors_;
  std::vector<Layer> layers_;
  const Linear* embed_ = nullptr;
  const Linear* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  bool finalized_ = false;
  // KV pools, one K and one V per layer (float32 or E4M3 bytes). Left uninitialized on
  // purpose: a position is always written before it is read, and untouched pages cost no
  // physical memory.
  std::vector<std::unique_ptr<uint8_t[]>> k_cache_, v_cache_;
  int tokens_per_block_ = 0;
  int num_kv_blocks_ = 0;
  // Work buffers, grown to the largest batch seen.
  std::vector<float> x_, h_, qkv_, attn_, tmp_, gate_up_, act_, quantized_input_;
  // Calibration (off unless start_calibration was called).
  bool calibrating_ = false;
  int max_sample_rows_ = 0;
  int64_t sample_every_ = 1;
  std::map<std::string, ChannelStats> calibration_;
};

}  // namespace precast
