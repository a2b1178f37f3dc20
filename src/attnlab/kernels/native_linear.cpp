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
//
// W may also be stored transposed, as W^T (K, N) row-major: GPT-2's Conv1D maps keep their weights
// so, and the model reads them in place (a view of the checkpoint's mapping, never a copy). Then
//
//   y[m, n] = sum_k x[m, k] W^T[k, n] + b[n]
//
// is computed by panels of columns, one task each: a thread reads its panel's stretch of every row of
// W^T in k's order into sums kept in the core's cache. Each output's terms are added in k's order
// whatever the panel's width: the same bits on every call and at every thread count.

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

// y[m, n0:n1) = x[m, :] W^T[:, n0:n1) + b[n0:n1) for M rows of x: the panel's rows of W^T are read
// in k's order, four at a time, into sums kept in the core's cache, each output's terms added one
// after another in k's order (so the panel's width changes no bit).
template <int M, typename W>
void transposed_panel(const W* wt, const float* x, float* y, int64_t n0, int64_t n1, int64_t k_len, int64_t n_len,
                      int64_t x_stride, int64_t y_stride, const float* bias) {
  constexpr int64_t kMaxPanel = 1024;
  float sums[M][kMaxPanel];
  const int64_t width = n1 - n0;
  const int64_t w_vec = width / kLanes * kLanes;
  for (int m = 0; m < M; ++m) std::fill(sums[m], sums[m] + width, 0.0f);
  int64_t k = 0;
  for (; k + 4 <= k_len; k += 4) {
    const W* r0 = wt + k * n_len + n0;
    const W* r1 = r0 + n_len;
    const W* r2 = r1 + n_len;
    const W* r3 = r2 + n_len;
    float xs[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) xs[m][j] = x[m * x_stride + k + j];
    for (int64_t n = 0; n < w_vec; n += kLanes) {
      const vf w0 = load_weights(r0 + n), w1 = load_weights(r1 + n), w2 = load_weights(r2 + n),
               w3 = load_weights(r3 + n);
      for (int m = 0; m < M; ++m) {
        vf acc = load(sums[m] + n);
        acc += w0 * xs[m][0];
        acc += w1 * xs[m][1];
        acc += w2 * xs[m][2];
        acc += w3 * xs[m][3];
        store(sums[m] + n, acc);
      }
    }
    for (int64_t n = w_vec; n < width; ++n)
      for (int m = 0; m < M; ++m) {
        float& acc = sums[m][n];
        acc += weight_at(r0 + n) * xs[m][0];
        acc += weight_at(r1 + n) * xs[m][1];
        acc += weight_at(r2 + n) * xs[m][2];
        acc += weight_at(r3 + n) * xs[m][3];
      }
  }
  for (; k < k_len; ++k) {
    const W* row = wt + k * n_len + n0;
    for (int m = 0; m < M; ++m) {
      const float xk = x[m * x_stride + k];
      for (int64_t n = 0; n < w_vec; n += kLanes) store(sums[m] + n, load(sums[m] + n) + load_weights(row + n) * xk);
      for (int64_t n = w_vec; n < width; ++n) sums[m][n] += weight_at(row + n) * xk;
    }
  }
  for (int m = 0; m < M; ++m)
    for (int64_t n = 0; n < width; ++n) y[m * y_stride + n0 + n] = sums[m][n] + (bias ? bias[n0 + n] : 0.0f);
}

template <typename W>
void transposed_pass(const W* wt, const float* x, float* y, int64_t n0, int64_t n1, int64_t k_len, int64_t n_len,
                     int64_t x_stride, int64_t y_stride, const float* bias, int64_t rows) {
  switch (rows) {
    case 1: return transposed_panel<1, W>(wt, x, y, n0, n1, k_len, n_len, x_stride, y_stride, bias);
    case 2: return transposed_panel<2, W>(wt, x, y, n0, n1, k_len, n_len, x_stride, y_stride, bias);
    case 3: return transposed_panel<3, W>(wt, x, y, n0, n1, k_len, n_len, x_stride, y_stride, bias);
    default: return transposed_panel<4, W>(wt, x, y, n0, n1, k_len, n_len, x_stride, y_stride, bias);
  }
}

// ys (M, N) = xs (M, K) W^T + b with W^T (K, N) row-major: the columns split into panels of at most
// 1024 (a multiple of 16), at least four per thread where N allows, each panel one task.
template <typename W>
void few_rows_all_transposed(const W* wt, const float* xs, float* ys, const float* b, int64_t rows, int64_t n_len,
                             int64_t k_len, int64_t x_stride) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line: panels start and end on lines
  const int64_t wanted = 2 * std::max<int64_t>(at::get_num_threads(), 1);
  const int64_t width = std::min<int64_t>(1024, std::max<int64_t>(kLine, (n_len / wanted + kLine - 1) / kLine * kLine));
  const int64_t panels = (n_len + width - 1) / width;
  at::parallel_for(0, panels, 1, [=](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxInputRows)
        transposed_pass(wt, xs + m0 * x_stride, ys + m0 * n_len, p * width, std::min(n_len, (p + 1) * width), k_len,
                        n_len, x_stride, n_len, b, std::min<int64_t>(kMaxInputRows, rows - m0));
  });
}

}  // namespace

// x (M, K) with unit stride in K, W (N, K) contiguous or a transposed view of a contiguous (K, N), bias (N,) or
// undefined -> (M, N); all
// float32, or all bfloat16.
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: needs x (M, K) and weight (N, K)");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype && x.device().is_cpu() &&
                  weight.device().is_cpu(),
              "few_rows_linear: needs float32 or bfloat16 CPU tensors, x of W's dtype");
  // W (N, K) row-major, or W^T (K, N) row-major: W a transposed view, strides (1, N).
  const bool transposed = !weight.is_contiguous() && weight.t().is_contiguous();
  TORCH_CHECK((weight.is_contiguous() || transposed) && x.stride(1) == 1,
              "few_rows_linear: needs a weight contiguous or a transposed contiguous one, and unit stride in x's rows");
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
    if (transposed)
      few_rows_all_transposed(weight.data_ptr<float>(), xs, ys, b, rows, n_len, k_len, x_float.stride(0));
    else
      few_rows_all(weight.data_ptr<float>(), xs, ys, b, rows, n_len, k_len, x_float.stride(0));
    return y;
  }
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  if (transposed)
    few_rows_all_transposed(w, xs, ys, b, rows, n_len, k_len, x_float.stride(0));
  else
    few_rows_all(w, xs, ys, b, rows, n_len, k_len, x_float.stride(0));
  return y.to(at::kBFloat16);
}
