// Seeing the activations a forward pass computes, without the runner knowing what for.
//
// The CPU runner calls an attached observer with every linear layer's input (named by its
// weight without ".weight", e.g. "layers.3.mlp.down"; the LM head as "lm_head" or "embed")
// and with K and V as the cache stores them ("layers.{i}.attn.k" / ".v", K after norm and
// rotation). With none attached it calls nothing and computes nothing extra.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace precast {

class ActivationObserver {
 public:
  virtual ~ActivationObserver() = default;
  // num_rows rows of `cols` values, row r at x + r * stride.
  virtual void observe(const std::string& name, const float* x, int num_rows, int cols, int64_t stride) = 0;
};

// Activation statistics of one observed tensor.
struct ChannelStats {
  int cols = 0;
  int64_t rows = 0;
  std::vector<float> amax;      // per input channel: max |x|
  std::vector<double> abs_sum;  // per input channel: sum |x|
  std::vector<float> samples;   // up to max_sample_rows rows, kept every sample_every rows
};

// The builder's calibration (quantization/calibration.py): per-channel max |x| and mean |x| of
// every observed tensor, and a bounded sample of rows for AWQ's search.
class CalibrationRecorder : public ActivationObserver {
 public:
  CalibrationRecorder(int max_sample_rows, int64_t sample_every);
  void observe(const std::string& name, const float* x, int num_rows, int cols, int64_t stride) override;
  // Hand over everything recorded so far and start afresh (calibration takes each layer's share as it goes).
  std::map<std::string, ChannelStats> take() { return std::exchange(stats_, {}); }

 private:
  int max_sample_rows_;
  int64_t sample_every_;
  std::map<std::string, ChannelStats> stats_;
};

}  // namespace precast
