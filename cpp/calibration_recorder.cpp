#include <algorithm>
#include <cmath>

#include "activation_observer.h"

namespace precast {

CalibrationRecorder::CalibrationRecorder(int max_sample_rows, int64_t sample_every)
    : max_sample_rows_(std::max(0, max_sample_rows)), sample_every_(std::max<int64_t>(1, sample_every)) {}

void CalibrationRecorder::observe(const std::string& name, const float* x, int num_rows, int cols, int64_t stride) {
  ChannelStats& s = stats_[name];
  if (s.cols == 0) {
    s.cols = cols;
    s.amax.assign(cols, 0.0f);
    s.abs_sum.assign(cols, 0.0);
  }
  for (int r = 0; r < num_rows; ++r, ++s.rows) {
    const float* row = x + int64_t(r) * stride;
    for (int i = 0; i < cols; ++i) {
      s.amax[i] = std::max(s.amax[i], std::fabs(row[i]));
      s.abs_sum[i] += std::fabs(row[i]);
    }
    if (s.rows % sample_every_ == 0 && int64_t(s.samples.size()) < int64_t(max_sample_rows_) * cols)
      s.samples.insert(s.samples.end(), row, row + cols);
  }
}

}  // namespace precast
