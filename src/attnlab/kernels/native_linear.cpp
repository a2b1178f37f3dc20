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
//
// W may be float32 or bfloat16 as stored. A bfloat16 is the upper half of a float32, so each
// weight is widened exactly by a 16-bit shift as it is read: the product streams half the bytes,
// and PyTorch's own bfloat16 product of a few rows (oneDNN's) measured 2-4x slower than its float32
// one on a Zen 4. The rows of x and b (a few K and N values) are widened once per call, and y is
// rounded to bfloat16 (to nearest, ties to even) once at the end.

// ATen's tensor and empty() alone, not <torch/extension.h> (pybind11 and every op): a fifth of the
// compile time. The operators are registered in native.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/to.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "native_vectors.h"

namespace {

using namespace attnlab_vectors;

constexpr int kMaxInputRows = 4;  // rows of x one pass over W takes (more: oneDNN's GEMM is faster)

// 16 weights as floats: float32 as they are, bfloat16 widened (a bfloat16 is a float32's upper half).
typedef uint16_t vh_unaligned __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2), may_alias));
typedef uint32_t vu __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vf load_weights(const float* p) { return load(p); }
inline vf load_weights(const uint16_t* p) {
  const vu wide = __builtin_convertvector(*reinterpret_cast<const vh_unaligned*>(p), vu) << 16;
  return reinterpret_cast<const vf&>(wide);
}
inline float weight_at(const float* p) { return *p; }
inline float weight_at(const uint16_t* p) {
  const uint32_t wide = static_cast<uint32_t>(*p) << 16;
  float out;
  __builtin_memcpy(&out, &wide, sizeof(out));
  return out;
}

// y[m, n] for m in [0, M): row n of W against M rows of x. Row n is read front to back (one
// sequential stream per thread, which the hardware prefetcher follows at the memory's full rate;
// interleaving several rows of W measured slower), into kChains accumulators per row of x, so that
// a single row of x does not wait on one chain of dependent additions.
template <int M, typename W>
inline void dot_row(const W* w_row, const float* x, float* y, int64_t n, int64_t k_len, int64_t x_stride,
                    int64_t y_stride, const float* bias) {
  constexpr int kChains = M == 1 ? 4 : M == 2 ? 2 : 1;
  vf acc[kChains][M] = {};
  const int64_t step = kChains * kLanes;
  const int64_t k_vec = k_len / step * step;
  for (int64_t k = 0; k < k_vec; k += step)
    for (int c = 0; c < kChains; ++c) {
      const vf wv = load_weights(w_row + k + c * kLanes);
      for (int m = 0; m < M; ++m) acc[c][m] += wv * load(x + m * x_stride + k + c * kLanes);
    }
  for (int m = 0; m < M; ++m) {
    vf sum = acc[0][m];
    for (int c = 1; c < kChains; ++c) sum += acc[c][m];
    float total = lane_sum(sum);
    for (int64_t k = k_vec; k < k_len; ++k) total += weight_at(w_row + k) * x[m * x_stride + k];
    y[m * y_stride + n] = total + (bias ? bias[n] : 0.0f);
  }
}

template <int M, typename W>
void few_rows_range(const W* w, const float* x, float* y, int64_t first, int64_t last, int64_t k_len,
                    int64_t x_stride, int64_t y_stride, const float* bias) {
  for (int64_t n = first; n < last; ++n) dot_row<M>(w + n * k_len, x, y, n, k_len, x_stride, y_stride, bias);
}

template <typename W>
void few_rows_pass(const W* w, const float* x, float* y, int64_t first, int64_t last, int64_t k_len,
                   int64_t x_stride, int64_t y_stride, const float* bias, int64_t rows) {
  switch (rows) {
    case 1: return few_rows_range<1, W>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    case 2: return few_rows_range<2, W>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    case 3: return few_rows_range<3, W>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
    default: return few_rows_range<4, W>(w, x, y, first, last, k_len, x_stride, y_stride, bias);
  }
}

template <typename W>
void few_rows_all(const W* w, const float* xs, float* ys, const float* b, int64_t rows, int64_t n_len, int64_t k_len,
                  int64_t x_stride) {
  // Each task streams at least 64 KiB of W: smaller shares cost more to hand out than to read.
  const int64_t grain = std::max<int64_t>(4, (16384 / std::max<int64_t>(k_len, 1) + 3) / 4 * 4);
  at::parallel_for(0, n_len, grain, [=](int64_t first, int64_t last) {
    for (int64_t m0 = 0; m0 < rows; m0 += kMaxInputRows)
      few_rows_pass(w, xs + m0 * x_stride, ys + m0 * n_len, first, last, k_len, x_stride, n_len, b,
                    std::min<int64_t>(kMaxInputRows, rows - m0));
  });
}

}  // namespace

// x (M, K) with unit stride in K, W (N, K) contiguous, bias (N,) or undefined -> (M, N); all
// float32, or all bfloat16.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: needs x (M, K) and weight (N, K)");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "few_rows_linear: needs float32 or bfloat16 CPU tensors, x of W's dtype");
  TORCH_CHECK(weight.is_contiguous() && x.stride(1) == 1, "few_rows_linear: needs a contiguous weight and unit stride in x's rows");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "few_rows_linear: needs a contiguous bias of N entries, of W's dtype");
  const int64_t rows = x.size(0), n_len = weight.size(0), k_len = weight.size(1);
  const bool wide = dtype == at::kFloat;
  const at::Tensor x_float = wide ? x : x.to(at::kFloat).contiguous();
  const at::Tensor b_float = has_bias ? (wide ? *bias : bias->to(at::kFloat)) : at::Tensor();
  auto y = at::empty({rows, n_len}, x_float.options());
  const float* b = has_bias ? b_float.data_ptr<float>() : nullptr;
  const float* xs = x_float.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  if (wide) {
    few_rows_all(weight.data_ptr<float>(), xs, ys, b, rows, n_len, k_len, x_float.stride(0));
    return y;
  }
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  few_rows_all(w, xs, ys, b, rows, n_len, k_len, x_float.stride(0));
  return y.to(at::kBFloat16);
}
