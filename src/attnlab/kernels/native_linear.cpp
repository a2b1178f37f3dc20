// y = x W^T + b for inputs of a few rows (a decoding step), compiled with native.cpp.
//
//   y[m, n] = sum_k x[m, k] W[n, k] + b[n]                       (the model's linear maps)
//
// With one to a few rows of x, the product does two floating-point operations per weight it reads:
// its time is the time to stream W from memory. PyTorch's matrix-vector products (MKL's and
// oneDNN's) read a row-major W on one core, at about a quarter of what two cores can stream, so a
// batch-1 decoding step waits on them. Here the rows of W are split over PyTorch's intra-op threads
// and each thread streams its rows once, front to back, against up to four rows of x at a time,
// with 16-float accumulators (GCC's vector extensions: AVX-512 where the build targets it, narrower
// registers elsewhere). Each output's sum runs in float32 in an order fixed by K alone: the same
// inputs give the same bits on every call and at every thread count.

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

constexpr int kMaxInputRows = 4;  // rows of x one pass over W takes (more: oneDNN's GEMM is faster)

// y[m, n] for m in [0, M): row n of W against M rows of x. Row n is read front to back (one
// sequential stream per thread, which the hardware prefetcher follows at the memory's full rate;
// interleaving several rows of W measured slower), into kChains accumulators per row of x, so that
// a single row of x does not wait on one chain of dependent additions.
template <int M>
inline void dot_row(const float* w_row, const float* x, float* y, int64_t n, int64_t k_len, int64_t x_stride,
                    int64_t y_stride, const float* bias) {
  constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;
  vf acc[kChains][M] = {};
  const int64_t step = kChains * kLanes;
  const int64_t k_vec = k_len / step * step;
  for (int64_t k = 0; k < k_vec; k += step)
    for (int c = 0; c < kChains; ++c) {
      const vf wv = load(w_row + k + c * kLanes);
      for (int m = 0; m < M; ++m) acc[c][m] += wv * load(x + m * x_stride + k + c * kLanes);
    }
  for (int m = 0; m < M; ++m) {
    vf sum = acc[0][m];
    for (int c = 1; c < kChains; ++c) sum += acc[c][m];
    float total = lane_sum(sum);
    for (int64_t k = k_vec; k < k_len; ++k) total += w_row[k] * x[m * x_stride + k];
    y[m * y_stride + n] = total + (bias ? bias[n] : 0.0f);
  }
}

template <int M>
void few_rows_range(const float* w, const float* x, float* y, int64_t first, int64_t last, int64_t k_len,
                    int64_t x_stride, int64_t y_stride, const float* bias) {
  for (int64_t n = first; n < last; ++n) dot_row<M>(w + n * k_len, x, y, n, k_len, x_stride, y_stride, bias);
}

void few_rows_pass(const float* w, const float* x, float* y, int64_t first, int64_t last, int64_t k_len,
                   int64_t x_stride, int64_t y_stride, const float* bias, int64_t rows) {
  switch (rows) {
    case 1: return few_rows_range<1>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    case 2: return few_rows_range<2>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    case 3: return few_rows_range<3>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    default: return few_rows_range<4>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
  }
}

}  // namespace

// x (M, K) with unit stride in K, W (N, K) contiguous, bias (N,) or undefined -> (M, N).
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: needs x (M, K) and weight (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "few_rows_linear: needs float32 CPU tensors");
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "few_rows_linear: needs a contiguous weight and unit stride in x's rows");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "few_rows_linear: needs a contiguous float32 bias of N entries");
  const int64_t rows = x.size(0), n_len = weight.size(0), k_len = weight.size(1);
  auto y = at::empty({rows, n_len}, x.options());
  const float* w = weight.data_ptr<float>();
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  // Each task streams at least 64 KiB of W: smaller shares cost more to hand out than to read.
  const int64_t grain = std::max<int64_t>(4, (16384 / std::max<int64_t>(k_len, 1) + 3) / 4 * 4);
  at::parallel_for(0, n_len, grain, [=](int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxInputRows)
      few_rows_pass(w, xs + m0 * x_stride, ys + m0 * n_len, first, last, k_len, x_stride, n_len, b,
                    std::min<int64_t>(kMaxInputRows, rows - m0));
  });
  return y;
}
