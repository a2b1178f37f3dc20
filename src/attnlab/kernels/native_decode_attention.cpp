// Soft attention for a decoding step: a few queries per (batch, head) against a KV cache, compiled
// with native.cpp.
//
//   o_i = sum_j softmax_j(scale q_i . k_j) v_j   over the keys j query i may see  (Vaswani et al. Eq. 1)
//
// At a decoding step each (batch, head) has one query (or a group's few, under grouped-query
// attention) against up to a context of keys. PyTorch scores that as a batched GEMM of one row per
// batch entry, whose cost per entry dwarfs its few thousand products, then a softmax and a second
// batched GEMM, each a pass of its own. Here each (batch, head) is finished in one go while its
// keys and values are in cache: scores, their softmax, and the weighted sum of values, the
// (batch, head) pairs spread over PyTorch's intra-op threads. Keys a boolean mask forbids (False)
// and, with `causal`, keys after a query's position (bottom-right aligned: query i sees keys
// j <= i + T_k - T_q) get weight 0; a query that may see no key gets the zero vector, as the
// explicit formula gives in attnlab.nn.attention.

// ATen's tensor and empty() alone, not <torch/extension.h> (pybind11 and every op): a fifth of the
// compile time. The operators are registered in native.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "native_vectors.h"

namespace {

using namespace attnlab_vectors;

struct Strides {
  int64_t b, h, t;
};

inline Strides strides_of(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

constexpr int kMaxVectors = 16;  // d_k, d_v up to 256 floats in registers or L1

// One query row: scores into `scores` (T_k floats, room for a vector past the end), softmax, and
// the weighted sum into `out` (d_v floats). NQ and NV: d_k and d_v in vectors of 16 when they are
// whole multiples of 16 up to 64 (the unrolled paths), 0 otherwise (any width, with tails).
template <int NQ, int NV>
void attend_one(const float* q, const float* k, const float* v, const bool* mask, int64_t mask_t, int64_t visible,
                int64_t d, int64_t d_v, int64_t k_t, int64_t v_t, float scale, float* scores, float* out) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  const int64_t q_vectors = NQ > 0 ? NQ : d / kLanes;
  vf qv[kMaxVectors];
  for (int64_t c = 0; c < q_vectors; ++c) qv[c] = load(q + c * kLanes) * scale;
  float top = kNone;
  for (int64_t j = 0; j < visible; ++j) {
    if (mask != nullptr && !mask[j * mask_t]) {
      scores[j] = kNone;
      continue;
    }
    const float* kj = k + j * k_t;
    vf acc = {};
    for (int64_t c = 0; c < q_vectors; ++c) acc += qv[c] * load(kj + c * kLanes);
    float s = lane_sum(acc);
    for (int64_t c = q_vectors * kLanes; c < d; ++c) s += scale * q[c] * kj[c];
    scores[j] = s;
    top = std::max(top, s);
  }
  if (top == kNone) {  // no key to attend to: the zero vector
    std::fill(out, out + d_v, 0.0f);
    return;
  }
  // exp(s - top) for 16 scores at a time; forbidden keys (-inf) get exactly 0.
  vf sums = {};
  for (int64_t j = 0; j < visible; j += kLanes) {
    const vf raw = load(scores + j);
    vf p = exp_nonpositive(raw - top);
    p = raw == kNone ? splat(0.0f) : p;
    if (j + kLanes > visible)
      for (int64_t l = visible - j; l < kLanes; ++l) p[l] = 0.0f;
    store(scores + j, p);
    sums += p;
  }
  const float inverse = 1.0f / lane_sum(sums);
  const int64_t v_vectors = NV > 0 ? NV : d_v / kLanes;
  vf acc[kMaxVectors] = {};
  for (int64_t j = 0; j < visible; ++j) {
    const float p = scores[j];
    const float* vj = v + j * v_t;
    for (int64_t c = 0; c < v_vectors; ++c) acc[c] += p * load(vj + c * kLanes);
  }
  for (int64_t c = 0; c < v_vectors; ++c) store(out + c * kLanes, acc[c] * inverse);
  for (int64_t c = v_vectors * kLanes; c < d_v; ++c) {
    float total = 0.0f;
    for (int64_t j = 0; j < visible; ++j) total += scores[j] * v[j * v_t + c];
    out[c] = total * inverse;
  }
}

using AttendOne = void (*)(const float*, const float*, const float*, const bool*, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float, float*, float*);

// The unrolled path for d_k, d_v of 16, 32 or 64; the general one for the rest.
AttendOne attend_for(int64_t d, int64_t d_v) {
  if (d == d_v) {
    if (d == 16) return attend_one<1, 1>;
    if (d == 32) return attend_one<2, 2>;
    if (d == 64) return attend_one<4, 4>;
  }
  return attend_one<0, 0>;
}

}  // namespace

// q (B, H, T_q, d), k (B, H, T_k, d), v (B, H, T_k, d_v), any strides but unit stride in the last
// dim; mask: bool, (B, H, T_q, T_k) (expanded views welcome), or undefined. Returns (B, H, T_q, d_v)
// laid out as (B, T_q, H, d_v).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& mask, bool causal, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: needs (B, H, T, d) q, k and v");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "decode_attention: needs float32 CPU tensors");
  const int64_t batch = q.size(0), heads = q.size(1), t_q = q.size(2), d = q.size(3);
  const int64_t t_k = k.size(2), d_v = v.size(3);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(1) == heads && v.size(1) == heads &&
                  k.size(3) == d && v.size(2) == t_k,
              "decode_attention: q, k and v disagree in batch, heads, keys or d_k");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: needs unit stride in d");
  TORCH_CHECK(d <= kMaxVectors * kLanes && d_v <= kMaxVectors * kLanes, "decode_attention: head widths up to 256");
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask)
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 4 && mask->size(0) == batch &&
                    mask->size(1) == heads && mask->size(2) == t_q && mask->size(3) == t_k,
                "decode_attention: needs a bool mask of shape (B, H, T_q, T_k)");
  auto out = at::empty({batch, t_q, heads, d_v}, q.options());
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v);
  const Strides sm = has_mask ? strides_of(*mask) : Strides{0, 0, 0};
  const int64_t mask_t = has_mask ? mask->stride(3) : 0;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, t_q * t_k * (d + d_v)));
  const AttendOne attend = attend_for(d, d_v);
  at::parallel_for(0, batch * heads, grain, [=](int64_t first, int64_t last) {
    std::vector<float> scores(static_cast<size_t>(t_k + kLanes));  // a whole vector past the last key
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / heads, h = pair % heads;
      for (int64_t i = 0; i < t_q; ++i) {
        const int64_t visible = causal ? std::clamp<int64_t>(i + t_k - t_q + 1, 0, t_k) : t_k;
        attend(qp + b * sq.b + h * sq.h + i * sq.t, kp + b * sk.b + h * sk.h, vp + b * sv.b + h * sv.h,
               mp == nullptr ? nullptr : mp + b * sm.b + h * sm.h + i * sm.t, mask_t, visible, d, d_v, sk.t, sv.t,
               s, scores.data(), op + ((b * t_q + i) * heads + h) * d_v);
      }
    }
  });
  return out.permute({0, 2, 1, 3});
}
