// SwiGLU's gate, SiLU(gate) * up, in one pass, compiled with native.cpp.
//
//   h = SiLU(g) * u = g sigmoid(g) * u,     [g, u] = [x W_gate, x W_up]   (Shazeer 2020, Eq. 6)
//
// PyTorch forms SiLU(g) as a tensor of its own and then multiplies it by u: two passes over the
// (rows, d_ff) activations and a third tensor of their size. Here each row's gate and value halves
// are read once and h written once, with sigmoid from one exponential of a non-positive argument
// (so it never overflows): with t = exp(-|g|), sigmoid(g) = 1 / (1 + t) for g >= 0, t / (1 + t) below.

// ATen's tensor and empty() alone, not <torch/extension.h> (pybind11 and every op): a fifth of the
// compile time. The operators are registered in native.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "native_vectors.h"

namespace {

using namespace attnlab_vectors;

inline float silu_times(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

void swiglu_row(const float* gate, const float* up, float* out, int64_t width) {
  int64_t j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    const vf g = load(gate + j);
    const vf t = exp_nonpositive(g < 0 ? g : -g);  // exp(-|g|)
    const vf sigmoid = (g < 0 ? t : splat(1.0f)) / (t + 1.0f);
    store(out + j, g * sigmoid * load(up + j));
  }
  for (; j < width; ++j) out[j] = silu_times(gate[j], up[j]);
}

}  // namespace

// hidden (R, 2 d_ff), rows of unit stride, [gate | up] side by side -> (R, d_ff).
at::Tensor swiglu(const at::Tensor& hidden) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) % 2 == 0, "swiglu: needs (rows, 2 d_ff)");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.device().is_cpu(), "swiglu: needs a float32 CPU tensor");
  TORCH_CHECK(hidden.stride(1) == 1, "swiglu: needs unit stride along a row");
  const int64_t rows = hidden.size(0), width = hidden.size(1) / 2, row_stride = hidden.stride(0);
  auto out = at::empty({rows, width}, hidden.options());
  const float* in = hidden.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [=](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) swiglu_row(in + r * row_stride, in + r * row_stride + width, o + r * width, width);
  });
  return out;
}
