// attnlab's own CPU kernels, compiled on first use by attnlab/kernels/native.py.
//
// Two memory-bound steps of a training step that PyTorch runs on one core:
//   transpose:         the row-major transposed copy that oneDNN needs for a weight gradient G^T X;
//   scaled_keep_mask:  dropout's mask, scaled by 1 / (1 - rate), from PCG64 words drawn exactly as
//                      NumPy's PCG64.random_raw draws them (so both paths give the same masks).
// Both run on PyTorch's intra-op threads (at::parallel_for).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using u128 = unsigned __int128;

// PCG64 (XSL-RR 128/64), as NumPy's numpy/random/src/pcg64: step s -> s * MULT + inc, then output.
constexpr u128 PCG_MULT = (static_cast<u128>(0x2360ED051FC65DA4ULL) << 64) | 0x4385DF649FCCF645ULL;

inline uint64_t pcg_output(u128 state) {
  const uint64_t folded = static_cast<uint64_t>(state >> 64) ^ static_cast<uint64_t>(state);
  const unsigned rot = static_cast<unsigned>(state >> 122);
  return (folded >> rot) | (folded << ((-rot) & 63u));
}

// The state after `delta` steps (Brown, "Random number generation with arbitrary strides", 1994).
u128 pcg_advance(u128 state, u128 delta, u128 inc) {
  u128 mult = PCG_MULT, acc_mult = 1, acc_plus = 0;
  while (delta > 0) {
    if (delta & 1) {
      acc_mult *= mult;
      acc_plus = acc_plus * mult + inc;
    }
    inc = (mult + 1) * inc;
    mult *= mult;
    delta >>= 1;
  }
  return acc_mult * state + acc_plus;
}

template <typename Word>
void fill_scaled_keep_mask(float* out, int64_t count, u128 state0, u128 inc, Word threshold, float scale) {
  constexpr int64_t kWordsPerDraw = 8 / sizeof(Word);
  constexpr int kLanes = 8;  // independent streams: one lane's 128-bit multiplies form a serial chain
  const int64_t draws = (count + kWordsPerDraw - 1) / kWordsPerDraw;
  u128 lane_mult = 1, lane_inc = 0;  // kLanes steps at once: s -> s * lane_mult + lane_inc
  for (int k = 0; k < kLanes; ++k) {
    lane_inc = lane_inc * PCG_MULT + inc;
    lane_mult *= PCG_MULT;
  }
  at::parallel_for(0, draws, 16384, [=](int64_t first, int64_t last) {
    // Copies of the captures: stores through `out` could otherwise alias them and stop vectorisation.
    float* const o = out;
    const Word t = threshold;
    const float s = scale;
    u128 lane[kLanes];
    for (int k = 0; k < kLanes; ++k) lane[k] = pcg_advance(state0, static_cast<u128>(first + k + 1), inc);
    int64_t d = first;
    for (; d + kLanes <= last && (d + kLanes) * kWordsPerDraw <= count; d += kLanes) {
      uint64_t raw[kLanes];
      for (int k = 0; k < kLanes; ++k) {
        raw[k] = pcg_output(lane[k]);
        lane[k] = lane[k] * lane_mult + lane_inc;
      }
      Word words[kLanes * kWordsPerDraw];
      std::memcpy(words, raw, sizeof(raw));  // little-endian: a draw's low bits are its first word
      float* dst = o + d * kWordsPerDraw;
#pragma omp simd
      for (int64_t q = 0; q < kLanes * kWordsPerDraw; ++q) dst[q] = words[q] >= t ? s : 0.0f;
    }
    for (int k = 0; d < last; ++d, ++k) {  // the last few draws, one at a time
      const uint64_t raw = pcg_output(lane[k]);
      Word words[kWordsPerDraw];
      std::memcpy(words, &raw, sizeof(raw));
      for (int64_t q = 0; q < kWordsPerDraw && d * kWordsPerDraw + q < count; ++q)
        o[d * kWordsPerDraw + q] = words[q] >= t ? s : 0.0f;
    }
  });
}

}  // namespace

torch::Tensor transpose(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "transpose: needs a contiguous 2-D float32 CPU tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto out = torch::empty({cols, rows}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  constexpr int64_t kTile = 64, kBlock = 16;  // tiles of 64 rows per task, 16 x 16 blocks inside
  at::parallel_for(0, (rows + kTile - 1) / kTile, 1, [=](int64_t first, int64_t last) {
    const float* const s = src;
    float* const d = dst;
    for (int64_t i0 = first * kTile; i0 < std::min(last * kTile, rows); i0 += kTile)
      for (int64_t j0 = 0; j0 < cols; j0 += kTile)
        for (int64_t i = i0; i < std::min(i0 + kTile, rows); i += kBlock)
          for (int64_t j = j0; j < std::min(j0 + kTile, cols); j += kBlock) {
            const int64_t i_end = std::min(i + kBlock, rows), j_end = std::min(j + kBlock, cols);
            for (int64_t jj = j; jj < j_end; ++jj)
#pragma omp simd
              for (int64_t ii = i; ii < i_end; ++ii) d[jj * rows + ii] = s[ii * cols + jj];
          }
  });
  return out;
}

// The mask for `count` entries: scale where the signed word is >= threshold, else 0. `state` and
// `inc` are a PCG64 state as four 64-bit halves (high, low), in NumPy's bit_generator.state layout.
torch::Tensor scaled_keep_mask(int64_t count, int64_t bits, uint64_t state_hi, uint64_t state_lo, uint64_t inc_hi,
                               uint64_t inc_lo, int64_t threshold, double scale) {
  TORCH_CHECK(count >= 0, "scaled_keep_mask: count must be >= 0");
  TORCH_CHECK(bits == 16 || bits == 32, "scaled_keep_mask: bits must be 16 or 32");
  auto out = torch::empty({count}, torch::kFloat);
  const u128 state = (static_cast<u128>(state_hi) << 64) | state_lo;
  const u128 inc = (static_cast<u128>(inc_hi) << 64) | inc_lo;
  if (bits == 16) {
    fill_scaled_keep_mask<int16_t>(out.data_ptr<float>(), count, state, inc, static_cast<int16_t>(threshold),
                                   static_cast<float>(scale));
  } else {
    fill_scaled_keep_mask<int32_t>(out.data_ptr<float>(), count, state, inc, static_cast<int32_t>(threshold),
                                   static_cast<float>(scale));
  }
  return out;
}

// native_attention.cpp
std::tuple<torch::Tensor, torch::Tensor> short_attention(const torch::Tensor& q, const torch::Tensor& k,
                                                         const torch::Tensor& v, bool causal, double scale);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> short_attention_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& probs, double scale);

// native_linear.cpp
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                              const c10::optional<torch::Tensor>& bias);

// native_swiglu.cpp
torch::Tensor swiglu(const torch::Tensor& hidden);

// native_decode_attention.cpp
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const c10::optional<torch::Tensor>& mask, bool causal, double scale);

// native_rotary.cpp
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// Operators, not only Python functions, so that dispatch modes (torch.utils.flop_counter) see them.
TORCH_LIBRARY(attnlab, m) {
  m.def("short_attention(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  m.def("short_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor probs, float scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("swiglu(Tensor hidden) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(attnlab, CPU, m) {
  m.impl("short_attention", &short_attention);
  m.impl("short_attention_backward", &short_attention_backward);
  m.impl("few_rows_linear", &few_rows_linear);
  m.impl("swiglu", &swiglu);
  m.impl("rotary", &rotary);
  m.impl("decode_attention", &decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("transpose", &transpose, "A contiguous transposed copy of a 2-D float32 tensor");
  m.def("scaled_keep_mask", &scaled_keep_mask, "Dropout's scaled keep mask from PCG64 words");
}
