// precast._C: the Python face of the C++ runtime and the CPU kernels.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <optional>
#include <tuple>

#include "check.h"
#include "cpu/bf16_gemm.h"
#include "cpu/cpu_features.h"
#include "cpu/int8_gemm.h"
#include "cpu/memory_bandwidth.h"
#include "cpu/quantize.h"
#include "cpu_runner.h"
#include "executor.h"
#include "guided_decoder.h"
#include "kv_cache_manager.h"
#include "model_runner.h"
#include "proposer.h"
#include "sampler.h"

namespace py = pybind11;
using namespace precast;

namespace {

// Lets runners written in Python (the TensorRT runner) plug into the executor. The
// executor's loop thread holds no GIL; the override takes it for the call.
class PyModelRunner : public ModelRunner, public py::trampoline_self_life_support {
 public:
  using ModelRunner::ModelRunner;
  int vocab_size() const override { PYBIND11_OVERRIDE_PURE(int, ModelRunner, vocab_size); }
  int64_t kv_block_bytes(int tokens_per_block) const override {
    PYBIND11_OVERRIDE_PURE(int64_t, ModelRunner, kv_block_bytes, tokens_per_block);
  }
  void configure_kv(int num_blocks, int tokens_per_block) override {
    PYBIND11_OVERRIDE_PURE(void, ModelRunner, configure_kv, num_blocks, tokens_per_block);
  }
  bool slot_mode() const override { PYBIND11_OVERRIDE(bool, ModelRunner, slot_mode); }
  bool supports_all_logits() const override { PYBIND11_OVERRIDE(bool, ModelRunner, supports_all_logits); }
  std::vector<float> forward(const Batch& batch) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const ModelRunner*>(this), "forward");
    if (!override) throw std::runtime_error("ModelRunner.forward is not implemented");
    py::array_t<float> logits = py::array_t<float, py::array::c_style | py::array::forcecast>(override(batch));
    return std::vector<float>(logits.data(), logits.data() + logits.size());
  }
};

// Lets structured outputs' grammars (runtime/guided.py, Python over llguidance) plug into the
// executor: the masks are handed to Python as a [rows, words] int32 view of the executor's buffer.
class PyGuidedDecoder : public GuidedDecoder, public py::trampoline_self_life_support {
 public:
  using GuidedDecoder::GuidedDecoder;
  std::vector<std::string> fill_masks(const std::vector<uint64_t>& guide_ids, int32_t* masks,
                                      int words_per_row) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const GuidedDecoder*>(this), "fill_masks");
    if (!override) throw std::runtime_error("GuidedDecoder.fill_masks is not implemented");
    const py::ssize_t rows = py::ssize_t(guide_ids.size());
    py::array_t<int32_t> view({rows, py::ssize_t(words_per_row)}, masks, py::capsule(masks, [](void*) {}));
    return override(guide_ids, view).cast<std::vector<std::string>>();
  }
  void advance(const std::vector<uint64_t>& guide_ids, const std::vector<TokenId>& tokens) override {
    PYBIND11_OVERRIDE_PURE(void, GuidedDecoder, advance, guide_ids, tokens);
  }
};

// Lets proposers written in Python (tests' scripted drafts) plug into the executor.
class PyProposer : public Proposer, public py::trampoline_self_life_support {
 public:
  using Proposer::Proposer;
  std::vector<std::vector<TokenId>> propose(const std::vector<DraftRequest>& requests) override {
    py::gil_scoped_acquire gil;
    py::function override = py::get_override(static_cast<const Proposer*>(this), "propose");
    if (!override) throw std::runtime_error("Proposer.propose is not implemented");
    py::list args;  // (request id, tokens so far, max draft tokens)
    for (const DraftRequest& r : requests) args.append(py::make_tuple(r.id, *r.tokens, r.max_draft));
    return override(args).cast<std::vector<std::vector<TokenId>>>();
  }
  void release(RequestId id) override { PYBIND11_OVERRIDE(void, Proposer, release, id); }
};

// Top log-probabilities as Python (token, logprob) tuples, one list per position.
std::vector<std::vector<std::pair<TokenId, float>>> as_pairs(const std::vector<std::vector<TokenLogprob>>& positions) {
  std::vector<std::vector<std::pair<TokenId, float>>> out;
  for (const auto& step : positions) {
    out.emplace_back();
    for (const auto& t : step) out.back().emplace_back(t.token, t.logprob);
  }
  return out;
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  return py::array_t<T>(py::ssize_t(v.size()), v.data());
}

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A 4-bit helper's arguments: a weight w [rows, cols], one value per column (`per_column`, named `what`), and
// groups of group_size columns.
void check_4bit_weight(const FloatArray& w, const FloatArray& per_column, int group_size, const char* what) {
  if (w.ndim() != 2 || per_column.ndim() != 1 || per_column.shape(0) != w.shape(1))
    throw std::invalid_argument(std::string("w must be [rows, cols] and ") + what + " [cols]");
  if (group_size <= 0 || w.shape(1) % group_size)
    throw std::invalid_argument("group_size must divide the number of columns");
}

// fn(row_begin, row_end) over `rows` rows on num_threads threads, without the GIL.
template <typename Fn>
void over_rows(int64_t rows, int num_threads, Fn&& fn) {
  py::gil_scoped_release release;
  ThreadPool pool(std::max(1, num_threads));
  pool.parallel_for(rows, fn);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "precast C++ runtime and CPU kernels";
  m.attr("__version__") = PRECAST_VERSION;
  py::register_exception<InvariantError>(m, "InvariantError", PyExc_RuntimeError);

  m.def(
      "cpu_features",
      [] {
        const CpuFeatures& f = cpu_features();
        py::dict d;
        d["avx2"] = f.avx2;
        d["fma"] = f.fma;
        d["f16c"] = f.f16c;
        d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw;
        d["avx512vl"] = f.avx512vl;
        d["avx512_vnni"] = f.avx512_vnni;
        d["avx512_bf16"] = f.avx512_bf16;
        d["amx_bf16"] = f.amx_bf16;
        d["logical_cores"] = f.logical_cores;
        return d;
      },
      "Instruction sets this CPU and OS support, as detected by cpuid/xgetbv.");
  m.def(
      "dot_unit", [] { return dot_unit_name(dot_unit()); },
      "The unit bf16 / fp8 / nvfp4 / int4 layers multiply on in this process: 'amx', 'avx512_bf16' or 'float32' "
      "(PRECAST_CPU_DOT picks one).");
  m.def(
      "dot_units",
      [] {
        py::list units;
        for (DotUnit u : {DotUnit::kAmx, DotUnit::kAvx512Bf16, DotUnit::kFloat32})
          if (dot_unit_available(u)) units.append(dot_unit_name(u));
        return units;
      },
      "The dot-product units this host and build can use.");
  m.def(
      "int4_multiplies_in_int8", [](const std::string& unit) { return int4_multiplies_in_int8(parse_dot_unit(unit)); },
      py::arg("unit"),
      "Whether int4 matrices on this unit multiply in int8 (AVX512-VNNI; activations quantized per row and group).");
  m.def("best_isa", &best_isa, "The widest instruction set this host supports: 'avx512', 'avx2' or 'scalar'.");
  m.def(
      "compiled_isa",
      [] {
#if defined(__AVX512F__) && defined(__AVX512BW__)
        return std::string("avx512");
#else
        return std::string("scalar");
#endif
      },
      "The instruction set precast's CPU kernels were compiled for.");

  py::class_<SamplingParams>(m, "SamplingParams")
      .def(py::init<>())
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("min_p", &SamplingParams::min_p)
      .def_readwrite("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_readwrite("presence_penalty", &SamplingParams::presence_penalty)
      .def_readwrite("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("top_logprobs", &SamplingParams::top_logprobs)
      .def_readwrite("logit_bias", &SamplingParams::logit_bias);

  py::class_<Request>(m, "Request")
      .def(py::init<>())
      .def_readwrite("prompt", &Request::prompt)
      .def_readwrite("sampling", &Request::sampling)
      .def_readwrite("max_tokens", &Request::max_tokens)
      .def_readwrite("min_tokens", &Request::min_tokens)
      .def_readwrite("stop_token_ids", &Request::stop_token_ids)
      .def_readwrite("ignore_eos", &Request::ignore_eos)
      .def_readwrite("streaming", &Request::streaming)
      .def_readwrite("priority", &Request::priority)
      .def_readwrite("bad_words", &Request::bad_words)
      .def_readwrite("guide_id", &Request::guide_id)
      .def_readwrite("prompt_logprobs", &Request::prompt_logprobs)
      .def_readwrite("speculative", &Request::speculative);

  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("LENGTH", FinishReason::kLength)
      .value("STOP", FinishReason::kStop)
      .value("CANCELLED", FinishReason::kCancelled)
      .value("ERROR", FinishReason::kError);

  py::class_<Response>(m, "Response")
      .def_readonly("request_id", &Response::request_id)
      .def_readonly("new_tokens", &Response::new_tokens)
      .def_readonly("logprobs", &Response::logprobs)
      .def_property_readonly("top_logprobs", [](const Response& r) { return as_pairs(r.top_logprobs); })
      .def_readonly("prompt_logprobs", &Response::prompt_logprobs)
      .def_property_readonly("prompt_top_logprobs", [](const Response& r) { return as_pairs(r.prompt_top_logprobs); })
      .def_readonly("finish_reason", &Response::finish_reason)
      .def_readonly("error", &Response::error)
      .def_readonly("num_prompt_tokens", &Response::num_prompt_tokens)
      .def_readonly("num_cached_prompt_tokens", &Response::num_cached_prompt_tokens)
      .def_readonly("num_draft_tokens", &Response::num_draft_tokens)
      .def_readonly("num_accepted_draft_tokens", &Response::num_accepted_draft_tokens)
      .def_property_readonly("finished", &Response::finished);

  py::class_<KvCacheStats>(m, "KvCacheStats")
      .def_readonly("max_blocks", &KvCacheStats::max_blocks)
      .def_readonly("free_blocks", &KvCacheStats::free_blocks)
      .def_readonly("used_blocks", &KvCacheStats::used_blocks)
      .def_readonly("cached_blocks", &KvCacheStats::cached_blocks)
      .def_readonly("reused_blocks", &KvCacheStats::reused_blocks)
      .def_readonly("prefix_query_tokens", &KvCacheStats::prefix_query_tokens)
      .def_readonly("prefix_hit_tokens", &KvCacheStats::prefix_hit_tokens)
      .def_readonly("tokens_per_block", &KvCacheStats::tokens_per_block)
      .def_property_readonly("hit_rate", &KvCacheStats::hit_rate);

  py::class_<ExecutorStats>(m, "ExecutorStats")
      .def_readonly("iterations", &ExecutorStats::iterations)
      .def_readonly("active_requests", &ExecutorStats::active_requests)
      .def_readonly("queued_requests", &ExecutorStats::queued_requests)
      .def_readonly("scheduled_requests", &ExecutorStats::scheduled_requests)
      .def_readonly("context_requests", &ExecutorStats::context_requests)
      .def_readonly("decode_requests", &ExecutorStats::decode_requests)
      .def_readonly("preemptions", &ExecutorStats::preemptions)
      .def_readonly("prompt_tokens", &ExecutorStats::prompt_tokens)
      .def_readonly("step_prompt_tokens", &ExecutorStats::step_prompt_tokens)
      .def_readonly("generated_tokens", &ExecutorStats::generated_tokens)
      .def_readonly("draft_tokens", &ExecutorStats::draft_tokens)
      .def_readonly("accepted_draft_tokens", &ExecutorStats::accepted_draft_tokens)
      .def_readonly("speculative_steps", &ExecutorStats::speculative_steps)
      .def_readonly("draft_seconds", &ExecutorStats::draft_seconds)
      .def_readonly("verify_seconds", &ExecutorStats::verify_seconds)
      .def_readonly("kv", &ExecutorStats::kv);

  py::class_<SpeculativeConfig>(m, "SpeculativeConfig")
      .def(py::init<>())
      .def_readwrite("num_draft_tokens", &SpeculativeConfig::num_draft_tokens)
      .def_readwrite("adaptive", &SpeculativeConfig::adaptive)
      .def_readwrite("max_draft_batch", &SpeculativeConfig::max_draft_batch)
      .def_readwrite("draft_token_cost", &SpeculativeConfig::draft_token_cost);

  py::class_<ExecutorConfig>(m, "ExecutorConfig")
      .def(py::init<>())
      .def_readwrite("max_batch_size", &ExecutorConfig::max_batch_size)
      .def_readwrite("max_num_tokens", &ExecutorConfig::max_num_tokens)
      .def_readwrite("max_seq_len", &ExecutorConfig::max_seq_len)
      .def_readwrite("tokens_per_block", &ExecutorConfig::tokens_per_block)
      .def_readwrite("kv_cache_bytes", &ExecutorConfig::kv_cache_bytes)
      .def_readwrite("chunked_prefill", &ExecutorConfig::chunked_prefill)
      .def_readwrite("prefix_reuse", &ExecutorConfig::prefix_reuse)
      .def_readwrite("kv_events", &ExecutorConfig::kv_events)
      .def_readwrite("eos_token_ids", &ExecutorConfig::eos_token_ids)
      .def_readwrite("speculative", &ExecutorConfig::speculative);

  py::class_<BatchSequence>(m, "BatchSequence")
      .def_readonly("request_id", &BatchSequence::request_id)
      .def_readonly("context_len", &BatchSequence::context_len)
      .def_readonly("num_tokens", &BatchSequence::num_tokens)
      .def_readonly("token_offset", &BatchSequence::token_offset)
      .def_readonly("sample", &BatchSequence::sample)
      .def_readonly("all_logits", &BatchSequence::all_logits)
      .def_readonly("block_table", &BatchSequence::block_table);

  py::class_<Batch>(m, "Batch")
      .def_property_readonly("token_ids", [](const Batch& b) { return to_numpy(b.token_ids); })
      .def_property_readonly("positions", [](const Batch& b) { return to_numpy(b.positions); })
      .def_readonly("sequences", &Batch::sequences)
      .def("num_sampling", &Batch::num_sampling)
      .def("num_logit_rows", &Batch::num_logit_rows);

  py::class_<ModelRunner, PyModelRunner, py::smart_holder>(m, "ModelRunner")
      .def(py::init<>())
      .def("vocab_size", &ModelRunner::vocab_size)
      .def("kv_block_bytes", &ModelRunner::kv_block_bytes)
      .def("configure_kv", &ModelRunner::configure_kv)
      .def("slot_mode", &ModelRunner::slot_mode)
      .def("supports_all_logits", &ModelRunner::supports_all_logits)
      .def("forward", [](ModelRunner& r, const Batch& b) {
        std::vector<float> logits;
        {
          py::gil_scoped_release release;
          logits = r.forward(b);
        }
        return to_numpy(logits);
      });

  py::enum_<WeightDtype>(m, "WeightDtype")
      .value("F32", WeightDtype::kF32)
      .value("BF16", WeightDtype::kBF16)
      .value("F16", WeightDtype::kF16)
      .value("FP8", WeightDtype::kFP8)
      .value("NVFP4", WeightDtype::kNVFP4)
      .value("INT4", WeightDtype::kINT4);

  py::enum_<ActQuant>(m, "ActQuant")
      .value("NONE", ActQuant::kNone)
      .value("FP8_STATIC", ActQuant::kFp8Static)
      .value("FP8_DYNAMIC", ActQuant::kFp8Dynamic)
      .value("NVFP4_DYNAMIC", ActQuant::kNvfp4Dynamic);

  py::enum_<Activation>(m, "Activation").value("SILU", Activation::kSilu).value("GELU_TANH", Activation::kGeluTanh);

  py::class_<CpuModelConfig>(m, "CpuModelConfig")
      .def(py::init<>())
      .def_readwrite("vocab_size", &CpuModelConfig::vocab_size)
      .def_readwrite("hidden_size", &CpuModelConfig::hidden_size)
      .def_readwrite("intermediate_size", &CpuModelConfig::intermediate_size)
      .def_readwrite("num_layers", &CpuModelConfig::num_layers)
      .def_readwrite("num_heads", &CpuModelConfig::num_heads)
      .def_readwrite("num_kv_heads", &CpuModelConfig::num_kv_heads)
      .def_readwrite("head_dim", &CpuModelConfig::head_dim)
      .def_readwrite("norm_eps", &CpuModelConfig::norm_eps)
      .def_readwrite("qkv_bias", &CpuModelConfig::qkv_bias)
      .def_readwrite("qk_norm", &CpuModelConfig::qk_norm)
      .def_readwrite("sliding_window", &CpuModelConfig::sliding_window)
      .def_readwrite("sliding_window_layers", &CpuModelConfig::sliding_window_layers)
      .def_readwrite("tie_word_embeddings", &CpuModelConfig::tie_word_embeddings)
      .def_readwrite("inv_freq", &CpuModelConfig::inv_freq)
      .def_readwrite("rotary_dim", &CpuModelConfig::rotary_dim)
      .def_readwrite("attention_factor", &CpuModelConfig::attention_factor)
      .def_readwrite("local_inv_freq", &CpuModelConfig::local_inv_freq)
      .def_readwrite("local_attention_factor", &CpuModelConfig::local_attention_factor)
      .def_readwrite("activation", &CpuModelConfig::activation)
      .def_readwrite("embedding_scale", &CpuModelConfig::embedding_scale)
      .def_readwrite("sandwich_norms", &CpuModelConfig::sandwich_norms)
      .def_readwrite("attention_scale", &CpuModelConfig::attention_scale)
      .def_readwrite("attn_logit_softcap", &CpuModelConfig::attn_logit_softcap)
      .def_readwrite("final_logit_softcap", &CpuModelConfig::final_logit_softcap)
      .def_readwrite("num_experts", &CpuModelConfig::num_experts)
      .def_readwrite("experts_per_token", &CpuModelConfig::experts_per_token)
      .def_readwrite("moe_intermediate_size", &CpuModelConfig::moe_intermediate_size)
      .def_readwrite("moe_layers", &CpuModelConfig::moe_layers)
      .def_readwrite("moe_renormalize", &CpuModelConfig::moe_renormalize)
      .def_readwrite("shared_expert_intermediate_size", &CpuModelConfig::shared_expert_intermediate_size)
      .def_readwrite("dtype", &CpuModelConfig::dtype)
      .def_readwrite("kv_fp8", &CpuModelConfig::kv_fp8)
      .def_readwrite("k_scales", &CpuModelConfig::k_scales)
      .def_readwrite("v_scales", &CpuModelConfig::v_scales)
      .def_readwrite("num_threads", &CpuModelConfig::num_threads)
      .def_readwrite("float32_matmuls", &CpuModelConfig::float32_matmuls)
      .def_readwrite("layers_only", &CpuModelConfig::layers_only)
      .def_readwrite("first_layer", &CpuModelConfig::first_layer);

  py::class_<CpuRunner, ModelRunner, py::smart_holder>(m, "CpuRunner")
      .def(py::init<CpuModelConfig>())
      .def("set_weight",
           [](CpuRunner& r, const std::string& name, py::buffer data) {
             py::buffer_info info = data.request();
             // Strides must be C-contiguous: the bytes are copied as they lie.
             py::ssize_t expect = info.itemsize;
             for (int d = int(info.ndim) - 1; d >= 0; --d) {
               if (info.shape[d] > 1 && info.strides[d] != expect)
                 throw std::invalid_argument(name + ": weight must be C-contiguous");
               expect *= info.shape[d];
             }
             r.set_weight(name, info.ptr, size_t(info.size) * size_t(info.itemsize));
           })
      .def(
          "set_quantized_weight",
          [](CpuRunner& r, const std::string& name, WeightDtype dtype, int rows, int cols,
             py::array_t<uint8_t, py::array::c_style> values, std::optional<py::array> group_scales, int group_size,
             float scale, ActQuant act, float act_scale, std::optional<FloatArray> group_offsets) {
            WeightView w{dtype, rows, cols, values.data(), nullptr, group_size, scale};
            size_t scales_bytes = 0;
            if (group_scales) {
              if (!(group_scales->flags() & py::array::c_style))
                throw std::invalid_argument(name + ": scales must be C-contiguous");
              w.group_scales = group_scales->data();
              scales_bytes = size_t(group_scales->nbytes());
            }
            if (group_offsets) w.group_offsets = group_offsets->data();
            r.set_quantized_weight(name, w, size_t(values.nbytes()), scales_bytes,
                                   group_offsets ? size_t(group_offsets->nbytes()) : 0, act, act_scale);
          },
          py::arg("name"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("values"),
          py::arg("group_scales"), py::arg("group_size"), py::arg("scale"), py::arg("act"), py::arg("act_scale"),
          py::arg("group_offsets") = py::none(),
          "A quantized matrix in the engine's stored layout (kernels.h, WeightView) and its input quantization; "
          "group_offsets: asymmetric int4's float32 [rows, groups].")
      .def("finalize", &CpuRunner::finalize)
      .def(
          "kv_dtype",
          [](const CpuRunner& r, int tokens_per_block) {
            const KvElement e = r.kv_element(tokens_per_block);
            return std::string(e == KvElement::kBf16 ? "bfloat16" : e == KvElement::kE4M3 ? "fp8" : "float32");
          },
          py::arg("tokens_per_block"), "What the KV cache holds for blocks of this many tokens.")
      .def(
          "evaluate",
          [](CpuRunner& r, const std::vector<int>& tokens, bool logits) {
            std::vector<float> out;
            {
              py::gil_scoped_release release;
              out = r.evaluate(tokens, logits);
            }
            py::array_t<float> a = to_numpy(out);
            return logits ? a.reshape({py::ssize_t(tokens.size()), py::ssize_t(r.vocab_size())}) : a;
          },
          py::arg("tokens"), py::arg("logits") = true,
          "Run one token sequence from position 0 (not while an executor uses this runner); logits [tokens, vocab].")
      .def(
          "evaluate_hidden",
          [](CpuRunner& r, py::array_t<float, py::array::c_style | py::array::forcecast> hidden) {
            const int H = r.config().hidden_size;
            if (hidden.ndim() != 2 || hidden.shape(1) != H)
              throw std::invalid_argument("hidden must be [num_tokens, " + std::to_string(H) + "] float32");
            const int T = int(hidden.shape(0));
            std::vector<float> out;
            {
              py::gil_scoped_release release;
              out = r.evaluate_hidden(hidden.data(), T);
            }
            return to_numpy(out).reshape({py::ssize_t(T), py::ssize_t(H)});
          },
          py::arg("hidden"),
          "A layers_only runner: the residual stream [tokens, hidden] entering its first layer -> leaving its last.")
      .def("set_observer", &CpuRunner::set_observer, py::arg("observer").none(true), py::keep_alive<1, 2>(),
           "Attach an ActivationObserver (e.g. a CalibrationRecorder) to every later pass, or None to detach.");

  py::class_<ActivationObserver>(m, "ActivationObserver");
  py::class_<CalibrationRecorder, ActivationObserver>(m, "CalibrationRecorder")
      .def(py::init<int, int64_t>(), py::arg("max_sample_rows") = 0, py::arg("sample_every") = 1)
      .def(
          "take_stats",
          [](CalibrationRecorder& recorder) {
            std::map<std::string, ChannelStats> taken = recorder.take();
            py::dict out;
            while (!taken.empty()) {  // each entry freed once copied: no second copy of every sample
              auto node = taken.extract(taken.begin());
              const ChannelStats& s = node.mapped();
              py::dict d;
              d["rows"] = s.rows;
              d["amax"] = to_numpy(s.amax);
              std::vector<float> mean(s.abs_sum.size());
              for (size_t i = 0; i < mean.size(); ++i) mean[i] = s.rows ? float(s.abs_sum[i] / double(s.rows)) : 0.0f;
              d["mean_abs"] = to_numpy(mean);
              d["samples"] = to_numpy(s.samples).reshape(
                  {py::ssize_t(s.samples.size() / std::max(1, s.cols)), py::ssize_t(s.cols)});
              out[py::str(node.key())] = d;
            }
            return out;
          },
          "Every observed tensor's rows, amax, mean_abs and samples so far, by name; the recorder starts afresh.");

  m.def("memory_bandwidth", &memory_bandwidth, py::arg("kind"), py::arg("bytes_per_array") = int64_t(256) << 20,
        py::arg("num_threads") = 1, py::arg("repeats") = 5, py::call_guard<py::gil_scoped_release>(),
        "Best bytes/s of a STREAM-like 'read', 'copy' or 'triad' pass (benchmarks: the decode speed limit).");
  m.def(
      "round_to_e4m3",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        std::vector<float> out(x.size());
        for (py::ssize_t i = 0; i < x.size(); ++i) out[i] = round_to_e4m3(x.data()[i]);
        return to_numpy(out);
      },
      "Nearest E4M3 values (for tests).");
  m.def(
      "round_to_e2m1",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        std::vector<float> out(x.size());
        for (py::ssize_t i = 0; i < x.size(); ++i) out[i] = round_to_e2m1(x.data()[i]);
        return to_numpy(out);
      },
      "Nearest E2M1 values (for tests).");
  m.def(
      "e4m3_bits",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        std::vector<uint8_t> out(x.size());
        for (py::ssize_t i = 0; i < x.size(); ++i) out[i] = e4m3_bits(round_to_e4m3(x.data()[i]));
        return py::array_t<uint8_t>(py::ssize_t(out.size()), out.data());
      },
      "E4M3 encodings of the nearest E4M3 values (for tests).");
  m.def(
      "fake_quant_fp8",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, float scale) {
        py::array_t<float> out(x.request().shape);
        fake_quant_fp8(x.data(), x.size(), scale, out.mutable_data());
        return out;
      },
      "fp8 static activation quantization, returned dequantized (for tests).");
  m.def(
      "int4_round_trip_scaled",
      [](FloatArray w, FloatArray s, int group_size, int num_threads, bool asymmetric) {
        check_4bit_weight(w, s, group_size, "s");
        const int cols = int(w.shape(1));
        py::array_t<float> out(w.request().shape);
        const float *wp = w.data(), *sp = s.data();
        float* op = out.mutable_data();
        over_rows(w.shape(0), num_threads, [&](int64_t begin, int64_t end) {
          int4_round_trip_scaled(wp, sp, begin, end, cols, group_size, asymmetric, op);
        });
        return out;
      },
      py::arg("w"), py::arg("s"), py::arg("group_size"), py::arg("num_threads") = 1, py::arg("asymmetric") = false,
      "dequantize(int4(w * s)) / s per group of columns (AWQ's search; quantization/awq.py).");
  m.def(
      "int4_search_scales",
      [](FloatArray w, FloatArray importance, int group_size, int num_threads) {
        check_4bit_weight(w, importance, group_size, "importance");
        const int cols = int(w.shape(1));
        py::array_t<float> out({int64_t(w.shape(0)), int64_t(cols / group_size)});
        const float *wp = w.data(), *ap = importance.data();
        float* op = out.mutable_data();
        over_rows(w.shape(0), num_threads,
                  [&](int64_t begin, int64_t end) { int4_search_scales(wp, ap, begin, end, cols, group_size, op); });
        return out;
      },
      py::arg("w"), py::arg("importance"), py::arg("group_size"), py::arg("num_threads") = 1,
      "int4 group scales minimising the importance-weighted error (int4_awq's scale search; quantization/awq.py).");
  m.def(
      "int4_search_scales_offsets",
      [](FloatArray w, FloatArray importance, int group_size, int num_threads) {
        check_4bit_weight(w, importance, group_size, "importance");
        const int cols = int(w.shape(1));
        py::array_t<float> scales({int64_t(w.shape(0)), int64_t(cols / group_size)});
        py::array_t<float> offsets({int64_t(w.shape(0)), int64_t(cols / group_size)});
        const float *wp = w.data(), *ap = importance.data();
        float *sp = scales.mutable_data(), *op = offsets.mutable_data();
        over_rows(w.shape(0), num_threads, [&](int64_t begin, int64_t end) {
          int4_search_scales_offsets(wp, ap, begin, end, cols, group_size, sp, op);
        });
        return py::make_tuple(scales, offsets);
      },
      py::arg("w"), py::arg("importance"), py::arg("group_size"), py::arg("num_threads") = 1,
      "Asymmetric int4 (group scales, group offsets) minimising the importance-weighted error (quantization/awq.py).");
  m.def(
      "nvfp4_search_block_scales",
      [](FloatArray w, FloatArray importance, float global_scale, int num_threads) {
        check_4bit_weight(w, importance, kNvfp4Block, "importance");
        if (!(std::isfinite(global_scale) && global_scale > 0))
          throw std::invalid_argument("global_scale must be finite and positive");
        const int cols = int(w.shape(1));
        py::array_t<float> out({int64_t(w.shape(0)), int64_t(cols / kNvfp4Block)});
        const float *wp = w.data(), *ap = importance.data();
        float* op = out.mutable_data();
        over_rows(w.shape(0), num_threads, [&](int64_t begin, int64_t end) {
          nvfp4_search_block_scales(wp, ap, global_scale, begin, end, cols, op);
        });
        return out;
      },
      py::arg("w"), py::arg("importance"), py::arg("global_scale"), py::arg("num_threads") = 1,
      "nvfp4 block scales (E4M3 values) minimising the importance-weighted error (quantization/awq.py).");
  m.def(
      "fake_quant_nvfp4",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, float global_scale) {
        if (x.ndim() != 2 || x.shape(1) % kNvfp4Block)
          throw std::invalid_argument("x must be [rows, cols], cols a multiple of 16");
        py::array_t<float> out(x.request().shape);
        fake_quant_nvfp4(x.data(), int(x.shape(0)), int(x.shape(1)), global_scale, out.mutable_data());
        return out;
      },
      "nvfp4 dynamic activation quantization, returned dequantized (for tests).");
  m.def(
      "linear",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x, WeightDtype dtype, int rows, int cols,
         py::array_t<uint8_t, py::array::c_style> values, std::optional<py::array> group_scales, int group_size,
         float scale, int num_threads, int repeats, const std::string& dot, std::optional<FloatArray> group_offsets) {
        WeightView w{dtype,
                     rows,
                     cols,
                     values.data(),
                     group_scales ? group_scales->data() : nullptr,
                     group_size,
                     scale,
                     group_offsets ? group_offsets->data() : nullptr};
        if (dtype != WeightDtype::kF32 && dtype != WeightDtype::kBF16 && dtype != WeightDtype::kF16)
          check_weight_view("weight", w, size_t(values.nbytes()), group_scales ? size_t(group_scales->nbytes()) : 0,
                            group_offsets ? size_t(group_offsets->nbytes()) : 0);
        else if (values.nbytes() != py::ssize_t(weight_values_bytes(dtype, rows, cols)))
          throw std::invalid_argument("wrong number of value bytes");
        if (x.ndim() != 2 || x.shape(1) != cols) throw std::invalid_argument("x must be [n, cols]");
        PackedMatrix m = PackedMatrix::pack(w, parse_dot_unit(dot));
        ThreadPool pool(num_threads);
        py::array_t<float> y({x.shape(0), py::ssize_t(rows)});
        const int n = int(x.shape(0));
        const float* xd = x.data();
        float* yd = y.mutable_data();
        py::gil_scoped_release release;
        if (repeats >= 0) {
          linear(pool, xd, n, m, nullptr, yd);
          py::gil_scoped_acquire acquire;
          return py::object(y);
        }
        // repeats = -N (benchmarks): one warm-up call (the pool's threads start cold), then the mean seconds of N
        // calls.
        linear(pool, xd, n, m, nullptr, yd);
        const auto start = std::chrono::steady_clock::now();
        for (int r = 0; r < -repeats; ++r) linear(pool, xd, n, m, nullptr, yd);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / -repeats;
        py::gil_scoped_acquire acquire;
        return py::object(py::make_tuple(y, seconds));
      },
      py::arg("x"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("values"),
      py::arg("group_scales") = py::none(), py::arg("group_size") = 0, py::arg("scale") = 1.0f,
      py::arg("num_threads") = 1, py::arg("repeats") = 1, py::arg("dot") = "auto",
      py::arg("group_offsets") = py::none(),
      "y = x @ W.T for a weight in the engine's stored layout (kernel tests); repeats=-N returns (y, mean seconds of N "
      "multiplies after a warm-up, packing excluded), for benchmarks/gemm_cpu.py.");

  py::class_<GuidedDecoder, PyGuidedDecoder, py::smart_holder>(m, "GuidedDecoder").def(py::init<>());

  py::class_<Proposer, PyProposer, py::smart_holder>(m, "Proposer")
      .def(py::init<>())
      .def("release", &Proposer::release);
  py::class_<NgramProposer, Proposer, py::smart_holder>(m, "NgramProposer")
      .def(py::init<int, int>(), py::arg("min_ngram"), py::arg("max_ngram"))
      .def_static("lookup", &NgramProposer::lookup, py::arg("tokens"), py::arg("min_ngram"), py::arg("max_ngram"),
                  py::arg("max_draft"), "The proposal for one token sequence (tests).");
  py::class_<DraftModelProposer, Proposer, py::smart_holder>(m, "DraftModelProposer")
      .def(py::init<std::shared_ptr<ModelRunner>, int64_t, int, int, int>(), py::arg("runner"),
           py::arg("kv_cache_bytes"), py::arg("tokens_per_block"), py::arg("max_seq_len"), py::arg("max_num_tokens"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_kv_blocks", &DraftModelProposer::num_kv_blocks);

  py::class_<Executor, py::smart_holder>(m, "Executor")
      .def(py::init<ExecutorConfig, std::shared_ptr<ModelRunner>, std::shared_ptr<GuidedDecoder>,
                    std::shared_ptr<Proposer>>(),
           py::arg("config"), py::arg("runner"), py::arg("guided") = nullptr, py::arg("proposer") = nullptr,
           py::call_guard<py::gil_scoped_release>())
      .def("enqueue", &Executor::enqueue)
      .def("await_responses", &Executor::await_responses, py::arg("timeout") = 0.1,
           py::call_guard<py::gil_scoped_release>())
      .def("cancel", &Executor::cancel)
      .def("stats", &Executor::stats)
      .def("shutdown", &Executor::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("check_integrity", &Executor::check_integrity, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("num_kv_blocks", &Executor::num_kv_blocks)
      .def(
          "take_kv_events",
          [](Executor& e) {
            int64_t dropped = 0;
            std::vector<KvEvent> events;
            {
              py::gil_scoped_release release;
              events = e.take_kv_events(dropped);
            }
            py::list out;
            for (const KvEvent& ev : events)
              out.append(py::make_tuple(ev.stored, ev.hash,
                                        ev.has_parent ? py::object(py::int_(ev.parent_hash)) : py::none(), ev.tokens));
            return py::make_tuple(out, dropped);
          },
          "Prefix-cache changes since the last call: ([(stored, hash, parent hash or None, token ids)], dropped).");

  // The scheduler with its own KV manager, driven step by step from Python (tests of its invariants):
  // advance() does what the executor does with a step's result (tokens computed, blocks committed, one
  // sampled token appended where the request samples).
  struct SchedulerHarness {
    KvCacheManager kv;
    Scheduler scheduler;
    uint64_t next_arrival = 0;
    SchedulerHarness(int num_blocks, int tokens_per_block, int max_batch_size, int max_num_tokens, bool chunked_prefill,
                     bool prefix_reuse)
        : kv(num_blocks, tokens_per_block, prefix_reuse),
          scheduler(SchedulerConfig{max_batch_size, max_num_tokens, chunked_prefill}, kv,
                    std::make_unique<PriorityFcfsPolicy>()) {}
  };
  py::class_<SchedulerHarness>(m, "Scheduler")
      .def(py::init<int, int, int, int, bool, bool>(), py::arg("num_blocks"), py::arg("tokens_per_block"),
           py::arg("max_batch_size"), py::arg("max_num_tokens"), py::arg("chunked_prefill") = true,
           py::arg("prefix_reuse") = true)
      .def(
          "add",
          [](SchedulerHarness& h, RequestId id, std::vector<TokenId> prompt, int max_tokens, int priority) {
            Request r;
            r.prompt = std::move(prompt);
            r.max_tokens = max_tokens;
            r.priority = priority;
            h.scheduler.add(std::make_unique<RequestState>(id, std::move(r), h.next_arrival++, 0));
          },
          py::arg("id"), py::arg("prompt"), py::arg("max_tokens"), py::arg("priority") = 0)
      .def("schedule",
           [](SchedulerHarness& h) {
             std::vector<std::tuple<RequestId, int, bool>> out;
             for (const ScheduledRequest& s : h.scheduler.schedule())
               out.emplace_back(s.state->id, s.num_tokens, s.sample);
             return out;
           })
      .def("advance",
           [](SchedulerHarness& h, const std::vector<std::tuple<RequestId, int, bool>>& scheduled, TokenId sampled) {
             for (const auto& [id, num_tokens, sample] : scheduled) {
               for (const auto& r : h.scheduler.running()) {
                 if (r->id != id) continue;
                 r->num_computed += num_tokens;
                 h.kv.commit(id, r->tokens, r->num_computed);
                 if (sample) r->tokens.push_back(sampled);
               }
             }
           })
      .def("remove", [](SchedulerHarness& h, RequestId id) { return h.scheduler.remove(id) != nullptr; })
      .def("running",
           [](const SchedulerHarness& h) {
             std::vector<RequestId> ids;
             for (const auto& r : h.scheduler.running()) ids.push_back(r->id);
             return ids;
           })
      .def("waiting", [](const SchedulerHarness& h) { return h.scheduler.waiting_ids(); })
      .def("num_tokens",
           [](const SchedulerHarness& h, RequestId id) {
             for (const auto& r : h.scheduler.running())
               if (r->id == id) return int(r->tokens.size());
             return -1;
           })
      .def_property_readonly("num_preemptions", [](const SchedulerHarness& h) { return h.scheduler.num_preemptions(); })
      .def("kv_stats", [](const SchedulerHarness& h) { return h.kv.stats(); })
      .def("check_integrity", [](const SchedulerHarness& h) { h.kv.check_integrity(); });

  py::class_<KvCacheManager>(m, "KvCacheManager")
      .def(py::init<int, int, bool>(), py::arg("num_blocks"), py::arg("tokens_per_block"),
           py::arg("prefix_reuse") = true)
      .def("match_prefix", &KvCacheManager::match_prefix, py::arg("id"), py::arg("tokens"), py::arg("reuse") = true)
      .def("count_prefix_lookup", &KvCacheManager::count_prefix_lookup)
      .def("allocate", &KvCacheManager::allocate)
      .def("commit", &KvCacheManager::commit)
      .def("free", &KvCacheManager::free)
      .def("truncate", &KvCacheManager::truncate)
      .def("block_table", &KvCacheManager::block_table)
      .def("has_request", &KvCacheManager::has_request)
      .def("num_allocatable_blocks", &KvCacheManager::num_allocatable_blocks)
      .def("stats", &KvCacheManager::stats)
      .def("check_integrity", &KvCacheManager::check_integrity);

  m.def(
      "sample_token",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, const SamplingParams& params,
         const std::vector<TokenId>& context, int num_output, const std::vector<std::vector<TokenId>>& bad_words,
         const std::vector<TokenId>& banned, uint64_t seed, std::optional<py::array_t<int32_t>> allowed) {
        std::vector<float> row(logits.data(), logits.data() + logits.size());
        SamplerState state(seed);
        const int32_t* mask = nullptr;
        if (allowed) {
          PRECAST_CHECK(allowed->size() == mask_words(int(row.size())), "the mask needs one bit per token");
          mask = allowed->data();
        }
        SampleResult r =
            sample_token(row.data(), int(row.size()), params, context, num_output, bad_words, banned, mask, state);
        std::vector<std::pair<TokenId, float>> top;
        for (const auto& t : r.top) top.emplace_back(t.token, t.logprob);
        return py::make_tuple(r.token, r.logprob, top);
      },
      py::arg("logits"), py::arg("params"), py::arg("context"), py::arg("num_output"), py::arg("bad_words"),
      py::arg("banned"), py::arg("seed"), py::arg("allowed") = py::none(),
      "One sampler step on a logits row (for tests): returns (token, logprob, top logprobs); token -1 when "
      "nothing may be sampled.");
}
