// The CPU model runner: the generic decoder of builder/spec.py over a packed batch.
//
// Weights are copied in once (set_weight / set_quantized_weight, canonical engine names),
// repacked into the kernels' panel layout and kept in the engine's dtype or quantized
// format; a quantized linear layer also quantizes its input as its recipe says (fp8
// static, nvfp4 dynamic per 16). KV lives in per-layer paged pools (float32, or E4M3 with
// per-layer scales) whose block ids the KV manager hands out. Logits are computed only
// for sequences that sample.
//
// Outside the executor, `evaluate` runs one token sequence in a KV pool of its own (the
// serving pool is never touched) for quality measurements (logits at every position) and,
// with an ActivationObserver attached; a layers_only runner (a slice of the decoder) runs
// hidden states through its layers with `evaluate_hidden`, the builder's layer-at-a-time
// calibration.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "activation_observer.h"
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
  int rotary_dim = 0;           // leading dims RoPE rotates (pairs j < rotary_dim / 2); 0: head_dim
  float attention_factor = 1.0f;
  // Sliding-window layers' RoPE when it differs (Gemma 3's local base); empty: inv_freq for every layer.
  std::vector<float> local_inv_freq;
  float local_attention_factor = 1.0f;
  Activation activation = Activation::kSilu;
  float embedding_scale = 1.0f;      // multiplies the input embeddings (Gemma: sqrt(hidden) in the engine dtype)
  bool sandwich_norms = false;       // post_attn_norm / post_mlp_norm on each block's output (Gemma 2/3)
  float attention_scale = 0.0f;      // scores = q.k * this; 0: 1 / sqrt(head_dim)
  float attn_logit_softcap = 0.0f;   // 0: none
  float final_logit_softcap = 0.0f;  // 0: none
  // Mixture of experts (ModelSpec): each layer in moe_layers routes every token to experts_per_token of num_experts
  // gated MLPs (softmax probabilities, renormalised over the chosen ones when moe_renormalize), plus a shared expert
  // scaled by sigmoid(shared_gate . x) when shared_expert_intermediate_size > 0.
  int num_experts = 0;
  int experts_per_token = 0;
  int moe_intermediate_size = 0;
  std::vector<int> moe_layers;
  bool moe_renormalize = false;
  int shared_expert_intermediate_size = 0;
  WeightDtype dtype = WeightDtype::kF32;  // matrices not quantized; vectors are float32
  bool kv_fp8 = false;                    // E4M3 KV cache with these per-layer scales
  std::vector<float> k_scales, v_scales;
  int num_threads = 1;
  // Matmul precision (runtime/precision.py). false ("weights"): matrices multiply on the chip's bf16 dot-product
  // unit (dot_unit()) where that computes the engine's own numerics: bf16 weights, fp8 / nvfp4 (operands exact in
  // bf16), int4 in a bf16 engine (inputs rounded to bf16, as a bf16 engine's activations are). true ("float32"):
  // every matrix on the exact float32 path.
  bool float32_matmuls = false;
  // A slice of the decoder, for calibration that streams the model a layer at a time: the runner
  // holds layers first_layer .. first_layer + num_layers - 1 under their engine names, no
  // embedding or LM head (final_norm.weight optional, given to the last slice), and runs
  // hidden states through them with evaluate_hidden.
  bool layers_only = false;
  int first_layer = 0;
};

// How a quantized linear layer quantizes its input.
// kFp8Dynamic: per token (row), scale = max|row| / 448, computed at run time.
enum class ActQuant { kNone, kFp8Static, kFp8Dynamic, kNvfp4Dynamic };

class CpuRunner : public ModelRunner {
 public:
  explicit CpuRunner(CpuModelConfig config);

  // Copy one tensor in. Matrices in the engine dtype, 1-D tensors float32; sizes checked.
  void set_weight(const std::string& name, const void* data, size_t nbytes);
  // A quantized matrix (its view's rows/cols must match the model) and its input's quantization.
  void set_quantized_weight(const std::string& name, const WeightView& weight, size_t values_bytes, size_t scales_bytes,
                            size_t offsets_bytes, ActQuant act, float act_scale);
  // Check that every tensor the spec needs was given; call once after the last set_weight.
  void finalize();

  int vocab_size() const override { return config_.vocab_size; }
  int64_t kv_block_bytes(int tokens_per_block) const override;
  // What the KV cache holds for blocks of this many tokens (float32, bf16 for bf16-compute engines, E4M3).
  KvElement kv_element(int tokens_per_block) const;
  void configure_kv(int num_blocks, int tokens_per_block) override;
  std::vector<float> forward(const Batch& batch) override;
  bool supports_all_logits() const override { return true; }
  const CpuModelConfig& config() const { return config_; }

  // Run `tokens` as one sequence from position 0 in the evaluation KV pool (grown as needed;
  // not concurrently with forward). Returns logits for every position [tokens, vocab] when
  // `logits` is set, else nothing.
  std::vector<float> evaluate(const std::vector<int>& tokens, bool logits);
  // A layers_only runner: run `hidden` [num_tokens, hidden_size] (one sequence from position 0,
  // the residual stream entering first_layer) through its layers in the evaluation KV pool;
  // returns the residual stream leaving them. An attached observer sees what evaluate's would
  // in these layers, and the final norm's output when the slice holds final_norm.weight.
  std::vector<float> evaluate_hidden(const float* hidden, int num_tokens);
  // Attach (or, with nullptr, detach) an observer of every later pass's activations; the
  // caller keeps it alive while attached.
  void set_observer(ActivationObserver* observer) { observer_ = observer; }

 private:
  DotUnit unit_for(WeightDtype dtype) const;  // the unit a matrix of `dtype` multiplies on (float32_matmuls)

  struct Linear {
    PackedMatrix weight;
    ActQuant act = ActQuant::kNone;
    float act_scale = 1.0f;  // fp8 static: input scale; nvfp4: input global scale; fp8 dynamic: unused
  };
  struct Layer {
    const Linear *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
    // Observer names of the linear inputs and of K / V ("layers.{i}.attn.qkv", ...), made once.
    std::string qkv_name, o_name, gate_up_name, down_name, k_name, v_name;
    const float* qkv_bias = nullptr;
    const float* attn_norm = nullptr;
    const float* mlp_norm = nullptr;
    const float* post_attn_norm = nullptr;  // sandwich_norms only
    const float* post_mlp_norm = nullptr;
    const float* q_norm = nullptr;
    const float* k_norm = nullptr;
    bool sliding = false;
    // A mixture layer (gate_up / down unset): the router, each expert's two matrices, the optional shared expert.
    const Linear* router = nullptr;
    std::vector<const Linear*> expert_gate_up, expert_down;
    std::vector<std::string> expert_gate_up_names, expert_down_names;
    const Linear *shared_gate_up = nullptr, *shared_down = nullptr, *shared_gate = nullptr;
    std::string shared_gate_up_name, shared_down_name;
  };
  // (rows, cols) of a matrix weight, or rows = -1 for a float32 vector of `cols` values.
  std::pair<int, int> expected_shape(const std::string& name) const;
  std::pair<int, int> moe_shape(const std::string& name) const;  // a mixture layer's tensors
  const Linear* matrix(const std::string& name) const;
  const float* vector(const std::string& name) const;
  // KV pools, one K and one V array per layer (float32, bf16 or E4M3 bytes). Left uninitialized on
  // purpose: a position is always written before it is read, and untouched pages cost no
  // physical memory.
  struct KvPool {
    std::vector<CacheLineBytes> k, v;
    int tokens_per_block = 0;
    int num_blocks = 0;
    KvElement element = KvElement::kFloat32;
  };
  void allocate(KvPool& pool, int num_blocks, int tokens_per_block) const;
  std::vector<float> run(const Batch& batch, bool all_logits, const KvPool& kv);
  // The decoder layers over x_ (batch.token_ids.size() rows, already embedded); leaves in x_ the
  // residual stream after the last layer.
  void run_layers(const Batch& batch, const KvPool& kv);
  // One sequence of `num_tokens` from position 0 in the evaluation KV pool (grown as needed).
  Batch evaluation_batch(int num_tokens, bool sample);
  // A mixture layer's MLP: tmp_ = mixture(h_) for T rows. Only the routed experts' weights are read: tokens are
  // grouped per expert, each expert runs once on its rows; every token sums its experts in expert order.
  void run_moe(const Layer& L, int T);
  // The name the LM head's input is observed under (the tied embedding's, when tied).
  const char* head_name() const { return config_.tie_word_embeddings ? "embed" : "lm_head"; }
  // y = linear(x) with the layer's input quantization; x is observed as `name` (unless empty) when observed.
  void apply(const Linear& l, const std::string& name, const float* x, int num_rows, const float* bias, float* y);

  // Declared first, so destroyed last, after the weights: returns the pages malloc kept for them to the
  // OS (glibc keeps freed chunks in its arenas), so a dropped LLM gives its memory back.
  struct ReleaseFreedMemory {
    ~ReleaseFreedMemory();
  } release_freed_memory_;
  CpuModelConfig config_;
  ThreadPool pool_;
  std::unordered_map<std::string, Linear> matrices_;
  std::unordered_map<std::string, std::vector<float>> vectors_;
  std::vector<Layer> layers_;
  const Linear* embed_ = nullptr;
  const Linear* lm_head_ = nullptr;
  const float* final_norm_ = nullptr;
  bool finalized_ = false;
  KvPool serving_kv_;  // configure_kv's: block ids from the executor's KV manager
  KvPool eval_kv_;     // evaluate's own
  // Work buffers, grown to the largest batch seen.
  // Cache-line aligned (kernels.h): the kernels' 64-byte loads and stores then never straddle two lines.
  AlignedVector<float> x_, h_, qkv_, attn_, tmp_, gate_up_, act_, quantized_input_, row_scales_;
  AlignedVector<float> router_logits_, expert_in_, expert_gate_up_, expert_act_, expert_y_;
  std::vector<std::vector<std::pair<int, float>>> expert_rows_;  // run_moe: per expert, its (token, weight)s
  ActivationObserver* observer_ = nullptr;                       // not owned
};

}  // namespace precast
