// Rotary position embeddings applied to queries or keys in one pass, compiled with native.cpp.
//
//   RoPE(x, m) = x cos(m theta) + rotate_half(x) sin(m theta),   rotate_half([x', x'']) = [-x'', x']
//                                                                (Su et al. 2021, RoFormer, Eq. 34)
//
// PyTorch's ops take five passes over the heads for it (negate, concatenate, two products, a sum)
// and three temporaries; here each (batch, head, position) row is read once and written once.

// ATen's tensor and empty() alone, not <torch/extension.h> (pybind11 and every op): a fifth of the
// compile time. The operators are registered in native.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "native_vectors.h"

namespace {

using namespace attnlab_vectors;

// One row of d floats: out[i] = x[i] c[i] - x[i + h] s[i], out[i + h] = x[i + h] c[i + h] + x[i] s[i + h].
// Each product rounded on its own, then the sum (no fused multiply-add, which the build otherwise
// allows): the same float32 operations as PyTorch's x * cos + rotate_half(x) * sin, so the same bits
// as that formula and as Hugging Face's Llama (tests/unit/nn/test_rotary.py).
__attribute__((optimize("fp-contract=off"))) void rotate_row(const float* x, const float* c, const float* s, float* out, int64_t half) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const vf first = load(x + i), second = load(x + half + i);
    store(out + i, first * load(c + i) - second * load(s + i));
    store(out + half + i, second * load(c + half + i) + first * load(s + half + i));
  }
  for (; i < half; ++i) {
    const float first = x[i], second = x[half + i];
    out[i] = first * c[i] - second * s[i];
    out[half + i] = second * c[half + i] + first * s[half + i];
  }
}

}  // namespace

// x (B, H, T, d) with unit stride in d; cos, sin (B or 1, T, d) contiguous -> (B, H, T, d) contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "rotary: needs (B, H, T, d) with d even");
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && x.device().is_cpu() && cos.device().is_cpu() &&
                  sin.device().is_cpu(),
              "rotary: needs float32 CPU tensors");
  const int64_t batch = x.size(0), heads = x.size(1), length = x.size(2), d = x.size(3);
  TORCH_CHECK(x.stride(3) == 1, "rotary: needs unit stride in d");
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && (cos.size(0) == 1 || cos.size(0) == batch) &&
                  cos.size(1) == length && cos.size(2) == d && cos.is_contiguous() && sin.is_contiguous(),
              "rotary: needs contiguous cos and sin of shape (B or 1, T, d)");
  auto out = at::empty({batch, heads, length, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  const int64_t angle_batch = cos.size(0) == 1 ? 0 : length * d;
  const int64_t rows = batch * heads * length;
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / d), [=](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t t = row % length, h = (row / length) % heads, b = row / (length * heads);
      const int64_t angle = b * angle_batch + t * d;
      rotate_row(xp + b * sb + h * sh + t * st, cp + angle, sp + angle, op + row * d, d / 2);
    }
  });
  return out;
}
