// Soft attention for short sequences, one (batch, head) at a time, compiled with native.cpp.
//
//   S = scale Q K^T,   P = softmax(S) row-wise (causal: keys after the query's position get 0),
//   O = P V                                                       (Vaswani et al. §3.2.1, Eq. 1)
//
// and its backward, from the probabilities P the forward keeps:
//
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(P * dP)),   dQ = scale dS K,   dK = scale dS^T Q.
//
// Scores and probabilities are held transposed (S^T = scale K Q^T: a key per row, a query per
// column), so each softmax is taken down a column, 16 queries at a time, with lane-wise maxima and
// sums and no reductions across lanes.
//
// PyTorch's CPU flash kernel works through blocks of 32 queries with a GEMM call per block; for
// heads of d_k = 32 over 64 keys those calls are too small to run near the FMA units' rate. Here one
// (batch, head) is done at a time, its scores in cache (64 x 64 floats, 16 KiB, for those heads):
// each product is a register-tiled loop over 16-float vectors (GCC's vector extensions: AVX-512
// where the build targets it, narrower registers elsewhere), and the (batch, head) pairs are spread
// over PyTorch's intra-op threads.

// ATen's tensor and empty() alone, not <torch/extension.h> (pybind11 and every op): a fifth of the
// compile time. The operators are registered in native.cpp.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "native_vectors.h"

namespace {

using namespace attnlab_vectors;

constexpr int64_t kMaxKeys = 256;
constexpr int64_t kMaxHeadDim = 256;

inline int64_t round_up(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

inline vi lane_index() {
  vi index;
  for (int l = 0; l < kLanes; ++l) index[l] = l;
  return index;
}

// C[m, n] = alpha sum_k A(m, k) B[k, n] for an MR x (NV * 16) tile: A read one scalar at a time
// through strides (so transposed operands need no copy), B row-major with rows of 16-float vectors.
// Only the first `columns` columns of C are written.
template <int MR, int NV>
inline void tile(int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb, float* c,
                 int64_t ldc, int64_t columns, float alpha) {
  vf acc[MR][NV] = {};
  for (int64_t k = 0; k < depth; ++k) {
    vf bk[NV];
    for (int v = 0; v < NV; ++v) bk[v] = load(b + k * ldb + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const float am = a[m * a_row + k * a_col];
      for (int v = 0; v < NV; ++v) acc[m][v] += am * bk[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const vf out = acc[m][v] * alpha;
      const int64_t first = v * kLanes;
      if (first + kLanes <= columns) {
        store(c + m * ldc + first, out);
      } else if (first < columns) {  // through memory, so that the accumulators stay in registers
        float part[kLanes];
        store(part, out);
        std::memcpy(c + m * ldc + first, part, (columns - first) * sizeof(float));
      }
    }
}

template <int MR>
inline void tile_row(int nv, int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t ldb,
                     float* c, int64_t ldc, int64_t columns, float alpha) {
  switch (nv) {
    case 1: tile<MR, 1>(depth, a, a_row, a_col, b, ldb, c, ldc, columns, alpha); break;
    case 2: tile<MR, 2>(depth, a, a_row, a_col, b, ldb, c, ldc, columns, alpha); break;
    case 3: tile<MR, 3>(depth, a, a_row, a_col, b, ldb, c, ldc, columns, alpha); break;
    default: tile<MR, 4>(depth, a, a_row, a_col, b, ldb, c, ldc, columns, alpha); break;
  }
}

// C (rows x columns) = alpha A B, A (rows x depth) through strides, B (depth x round_up(columns)).
// Tiles of up to 24 accumulators (of the 32 AVX-512 registers): 6 rows x 4 vectors, 12 x 2, 24 x 1.
void matmul(int64_t rows, int64_t columns, int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b,
            int64_t ldb, float* c, int64_t ldc, float alpha) {
  constexpr int kVectors = 4;
  for (int64_t n = 0; n < columns; n += kVectors * kLanes) {
    const int nv = static_cast<int>(std::min<int64_t>(kVectors, (columns - n + kLanes - 1) / kLanes));
    const int64_t cols = std::min<int64_t>(columns - n, kVectors * kLanes);
    const float* bn = b + n;
    float* cn = c + n;
    int64_t m = 0;
    auto rows_of = [&](auto tile_rows) {  // as many tiles of tile_rows rows as fit
      constexpr int mr = decltype(tile_rows)::value;
      for (; m + mr <= rows; m += mr)
        tile_row<mr>(nv, depth, a + m * a_row, a_row, a_col, bn, ldb, cn + m * ldc, ldc, cols, alpha);
    };
    if (nv <= 2) rows_of(std::integral_constant<int, 12>{});
    rows_of(std::integral_constant<int, 6>{});
    rows_of(std::integral_constant<int, 4>{});
    rows_of(std::integral_constant<int, 2>{});
    rows_of(std::integral_constant<int, 1>{});
  }
}

// Swaps the off-diagonal S x S blocks of every 2S x 2S block of a 16 x 16 tile held as 16 rows.
// The four stages S = 8, 4, 2, 1 transpose the tile ([[A, B], [C, D]]^T = [[A^T, C^T], [B^T, D^T]]).
// Of a pair of rows (i, i + S), row i takes lane l - S of row i + S where bit S of l is set; row
// i + S takes lane l + S of row i where it is clear. Shuffle indices >= 16 pick from the second row.
#define ATTNLAB_LOW(S, l) (((l) & (S)) ? kLanes + (l) - (S) : (l))
#define ATTNLAB_HIGH(S, l) (((l) & (S)) ? kLanes + (l) : (l) + (S))
#define ATTNLAB_LANES(F, S)                                                                              \
  F(S, 0), F(S, 1), F(S, 2), F(S, 3), F(S, 4), F(S, 5), F(S, 6), F(S, 7), F(S, 8), F(S, 9), F(S, 10), \
      F(S, 11), F(S, 12), F(S, 13), F(S, 14), F(S, 15)

template <int S>
inline void swap_blocks(vf* rows) {
  for (int i = 0; i < kLanes; ++i) {
    if (i & S) continue;
    const vf a = rows[i], b = rows[i + S];
#if defined(__clang__) || __GNUC__ >= 12  // __builtin_shufflevector: clang, and GCC from 12
    rows[i] = __builtin_shufflevector(a, b, ATTNLAB_LANES(ATTNLAB_LOW, S));
    rows[i + S] = __builtin_shufflevector(a, b, ATTNLAB_LANES(ATTNLAB_HIGH, S));
#else
    const vi low = {ATTNLAB_LANES(ATTNLAB_LOW, S)}, high = {ATTNLAB_LANES(ATTNLAB_HIGH, S)};
    rows[i] = __builtin_shuffle(a, b, low);
    rows[i + S] = __builtin_shuffle(a, b, high);
#endif
  }
}

#undef ATTNLAB_LANES
#undef ATTNLAB_HIGH
#undef ATTNLAB_LOW

// A strided (rows x width) view, transposed into a row-major (width x ld) buffer, zeros after
// `rows` (ld a multiple of 16 and >= rows), 16 x 16 tiles at a time: whole rows are read, where a
// column walk would touch a cache line per row, lines that rows of a power-of-two stride map to a
// few L1 sets for.
void copy_transposed(const float* src, int64_t row_stride, int64_t rows, int64_t width, float* dst, int64_t ld) {
  for (int64_t r0 = 0; r0 < ld; r0 += kLanes)
    for (int64_t c0 = 0; c0 < width; c0 += kLanes) {
      const int64_t columns = std::min<int64_t>(kLanes, width - c0);
      vf tile[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        tile[i] = (vf){};
        if (r0 + i >= rows) continue;
        const float* row = src + (r0 + i) * row_stride + c0;
        if (columns == kLanes) {
          tile[i] = load(row);
        } else {
          for (int64_t c = 0; c < columns; ++c) tile[i][c] = row[c];
        }
      }
      swap_blocks<8>(tile);
      swap_blocks<4>(tile);
      swap_blocks<2>(tile);
      swap_blocks<1>(tile);
      for (int64_t c = 0; c < columns; ++c) store(dst + (c0 + c) * ld + r0, tile[c]);
    }
}

// A B operand of matmul: the strided (rows x width) view itself where its rows hold whole vectors
// (width a multiple of 16, so no vector load runs past the tensor's end), else a zero-padded copy.
struct Operand {
  const float* data;
  int64_t ld;
};

Operand padded(const float* src, int64_t row_stride, int64_t rows, int64_t width, std::vector<float>& buffer) {
  if (width % kLanes == 0) return {src, row_stride};
  const int64_t ld = round_up(width);
  buffer.resize(rows * ld);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(buffer.data() + r * ld, src + r * row_stride, width * sizeof(float));
    std::fill(buffer.data() + r * ld + width, buffer.data() + (r + 1) * ld, 0.0f);
  }
  return {buffer.data(), ld};
}

// Lanes (queries first .. first + 15) that may see key j: all, or (causal, bottom-right aligned)
// the queries i with j <= i + T_k - T_q.
inline vi lanes_seeing(int64_t j, int64_t first, int64_t t_q, int64_t t_k, bool causal) {
  const vi query = lane_index() + static_cast<int32_t>(first);
  return causal ? query >= static_cast<int32_t>(j - (t_k - t_q)) : query >= 0;  // else every lane
}

// Causal, bottom-right aligned: query i sees the keys j <= i + T_k - T_q. The keys that any of the
// queries first .. first + count - 1 sees are those before this bound.
inline int64_t keys_seen_by(int64_t first, int64_t count, int64_t t_q, int64_t t_k, bool causal) {
  return causal ? std::min(t_k, first + count + (t_k - t_q)) : t_k;
}

// S^T (T_k x ld) -> P^T in place: each column's softmax over its keys, 0 where a causal query may
// not see the key. Causal, a block of 16 columns reads only the keys one of its queries sees (the
// scores of the others may never have been computed) and writes 0 for the rest.
void softmax_columns(float* scores, int64_t t_k, int64_t t_q, int64_t ld, bool causal) {
  const vf minus_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t first = 0; first < ld; first += kLanes) {
    float* column = scores + first;
    const int64_t seen = keys_seen_by(first, kLanes, t_q, t_k, causal);
    vf best = minus_inf;
    for (int64_t j = 0; j < seen; ++j) {
      const vf s = load(column + j * ld);
      best = (lanes_seeing(j, first, t_q, t_k, causal) & (s > best)) ? s : best;
    }
    vf total = {};
    for (int64_t j = 0; j < seen; ++j) {
      const vf e = exp_nonpositive(load(column + j * ld) - best);
      const vf kept = lanes_seeing(j, first, t_q, t_k, causal) ? e : (vf){};
      store(column + j * ld, kept);
      total += kept;
    }
    const vf inverse = 1.0f / total;
    for (int64_t j = 0; j < seen; ++j) store(column + j * ld, load(column + j * ld) * inverse);
    for (int64_t j = seen; j < t_k; ++j) store(column + j * ld, (vf){});
  }
}

// Rows of keys (of S^T) and of queries (of O) taken together where causality lets whole blocks be
// skipped: a multiple of every tile height matmul uses.
constexpr int64_t kCausalBlock = 24;

// S^T = alpha K Q^T (T_k x ld), Q^T given as (d_k x ld). Causal, each block of keys is scored only
// against the columns of queries from the first one that sees one of them (rounded down to 16).
void key_scores(int64_t t_k, int64_t t_q, int64_t ld, int64_t d_k, const float* keys, int64_t key_row,
                const float* queries_t, float* scores, float alpha, bool causal) {
  if (!causal) {
    matmul(t_k, ld, d_k, keys, key_row, 1, queries_t, ld, scores, ld, alpha);
    return;
  }
  for (int64_t j0 = 0; j0 < t_k; j0 += kCausalBlock) {
    const int64_t rows = std::min(kCausalBlock, t_k - j0);
    const int64_t c0 = std::max<int64_t>(0, j0 - (t_k - t_q)) / kLanes * kLanes;  // < ld: j0 - (t_k - t_q) < t_q
    matmul(rows, ld - c0, d_k, keys + j0 * key_row, key_row, 1, queries_t + c0, ld, scores + j0 * ld + c0, ld, alpha);
  }
}

// O = P V (T_q x d_v) from P^T (T_k x ld). Causal, each block of queries sums only over the keys
// it sees (P^T is 0 after them).
void attend_values(int64_t t_q, int64_t t_k, int64_t ld, int64_t d_v, const float* probs_t, const float* values,
                   int64_t values_ld, float* out, int64_t out_row, bool causal) {
  if (!causal) {
    matmul(t_q, d_v, t_k, probs_t, 1, ld, values, values_ld, out, out_row, 1.0f);
    return;
  }
  for (int64_t i0 = 0; i0 < t_q; i0 += kCausalBlock) {
    const int64_t rows = std::min(kCausalBlock, t_q - i0);
    const int64_t depth = keys_seen_by(i0, rows, t_q, t_k, causal);
    matmul(rows, d_v, depth, probs_t + i0, 1, ld, values, values_ld, out + i0 * out_row, out_row, 1.0f);
  }
}

// dP^T (T_k x ld) -> dS^T = scale P^T * (dP^T - D) in place, D a column's sum of P^T * dP^T.
void softmax_backward_columns(const float* probs, float* grad, int64_t t_k, int64_t ld, float scale) {
  for (int64_t first = 0; first < ld; first += kLanes) {
    vf dot = {};
    for (int64_t j = 0; j < t_k; ++j) dot += load(probs + j * ld + first) * load(grad + j * ld + first);
    for (int64_t j = 0; j < t_k; ++j) {
      float* g = grad + j * ld + first;
      store(g, load(probs + j * ld + first) * (load(g) - dot) * scale);
    }
  }
}

// A (B, H, T, d) float tensor's data and strides: const float for the inputs, float for the outputs.
template <typename Float>
struct Heads {
  Float* data;
  int64_t batch, head, row;
  explicit Heads(const at::Tensor& t)
      : data(t.data_ptr<float>()), batch(t.stride(0)), head(t.stride(1)), row(t.stride(2)) {}
  Float* at(int64_t b, int64_t h) const { return data + b * batch + h * head; }
  // The (rows x width) rows of the (batch x head) pair `bh`, asked for ahead of their use: rows of
  // one head lie a whole row of the projection apart (3 KiB for 8 heads of 32), too far apart for
  // the hardware prefetcher.
  void prefetch(int64_t bh, int64_t heads, int64_t rows, int64_t width) const {
    const float* first = at(bh / heads, bh % heads);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; c += 64 / sizeof(float)) __builtin_prefetch(first + r * row + c);
  }
};

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(3) == 1,
                "short_attention: q, k and v must be (B, H, T, d) float32 CPU tensors with unit stride in d");
  }
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1),
              "short_attention: q, k and v need the same B and H");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(2) == k.size(2), "short_attention: q, k, v shapes disagree");
  // The message is one literal: TORCH_CHECK formats other arguments into a std::string for libc10,
  // and that crashed (SIGSEGV) in an extension built on a GPU machine (gcc 13.3, torch 2.11), where
  // a literal message raised as it should.
  static_assert(kMaxKeys == 256 && kMaxHeadDim == 256, "the message below states the limits");
  TORCH_CHECK(k.size(2) >= 1 && k.size(2) <= kMaxKeys && q.size(3) <= kMaxHeadDim && v.size(3) <= kMaxHeadDim,
              "short_attention: at most 256 keys and head widths up to 256");
}

// (B, H, T, d) laid out as (B, T, H, d): the layout the heads' concatenation reads without a copy.
at::Tensor empty_heads(int64_t b, int64_t h, int64_t t, int64_t d, const at::TensorOptions& options) {
  return at::empty({b, t, h, d}, options).permute({0, 2, 1, 3});
}

}  // namespace

// Forward: the output (B, H, T_q, d_v) and P^T (B, H, T_k, round_up(T_q)), kept for the backward.
std::tuple<at::Tensor, at::Tensor> short_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   bool causal, double scale) {
  check_inputs(q, k, v);
  const int64_t batch = q.size(0), heads = q.size(1), t_q = q.size(2), t_k = k.size(2), d_k = q.size(3),
                d_v = v.size(3);
  TORCH_CHECK(!causal || t_k >= t_q, "short_attention: causal needs T_k >= T_q");
  const int64_t ld = round_up(t_q);
  auto out = empty_heads(batch, heads, t_q, d_v, q.options());
  auto probs = at::empty({batch, heads, t_k, ld}, q.options());
  const Heads<const float> qs(q), ks(k), vs(v);
  const Heads<float> os(out);
  float* const probs_data = probs.data_ptr<float>();
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, batch * heads, 1, [=](int64_t first, int64_t last) {
    std::vector<float> queries_t(d_k * ld), value_copy;
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      float* p = probs_data + bh * t_k * ld;
      if (bh + 1 < last) {
        qs.prefetch(bh + 1, heads, t_q, d_k);
        ks.prefetch(bh + 1, heads, t_k, d_k);
        vs.prefetch(bh + 1, heads, t_k, d_v);
      }
      copy_transposed(qs.at(b, h), qs.row, t_q, d_k, queries_t.data(), ld);
      key_scores(t_k, t_q, ld, d_k, ks.at(b, h), ks.row, queries_t.data(), p, alpha, causal);  // S^T = scale K Q^T
      softmax_columns(p, t_k, t_q, ld, causal);
      const Operand values = padded(vs.at(b, h), vs.row, t_k, d_v, value_copy);
      attend_values(t_q, t_k, ld, d_v, p, values.data, values.ld, os.at(b, h), os.row, causal);  // O = P V
    }
  });
  return {out, probs};
}

// Backward: dQ, dK, dV from dO and the forward's P^T, which is already 0 where a causal query may
// not see a key (so the backward needs no mask of its own).
std::tuple<at::Tensor, at::Tensor, at::Tensor> short_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& probs, double scale) {
  check_inputs(q, k, v);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.scalar_type() == at::kFloat && grad_out.stride(3) == 1 &&
                  grad_out.sizes() == at::IntArrayRef({q.size(0), q.size(1), q.size(2), v.size(3)}),
              "short_attention_backward: grad_out must be (B, H, T_q, d_v) float32 with unit stride in d");
  const int64_t batch = q.size(0), heads = q.size(1), t_q = q.size(2), t_k = k.size(2), d_k = q.size(3),
                d_v = v.size(3);
  const int64_t ld = round_up(t_q);
  TORCH_CHECK(probs.is_contiguous() && probs.sizes() == at::IntArrayRef({batch, heads, t_k, ld}),
              "short_attention_backward: probs must be the forward's");
  auto grad_q = empty_heads(batch, heads, t_q, d_k, q.options());
  auto grad_k = empty_heads(batch, heads, t_k, d_k, q.options());
  auto grad_v = empty_heads(batch, heads, t_k, d_v, q.options());
  const Heads<const float> gs(grad_out), qs(q), ks(k), vs(v);
  const Heads<float> gqs(grad_q), gks(grad_k), gvs(grad_v);
  const float* const probs_data = probs.data_ptr<float>();
  const float alpha = static_cast<float>(scale);
  at::parallel_for(0, batch * heads, 1, [=](int64_t first, int64_t last) {
    std::vector<float> grad_t(d_v * ld), grad_scores(t_k * ld), grad_copy, query_copy, key_copy;
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* p = probs_data + bh * t_k * ld;
      float* ds = grad_scores.data();
      if (bh + 1 < last) {
        gs.prefetch(bh + 1, heads, t_q, d_v);
        qs.prefetch(bh + 1, heads, t_q, d_k);
        ks.prefetch(bh + 1, heads, t_k, d_k);
        vs.prefetch(bh + 1, heads, t_k, d_v);
      }
      const Operand grad_rows = padded(gs.at(b, h), gs.row, t_q, d_v, grad_copy);
      const Operand queries = padded(qs.at(b, h), qs.row, t_q, d_k, query_copy);
      const Operand keys = padded(ks.at(b, h), ks.row, t_k, d_k, key_copy);
      // dV = P^T dO.
      matmul(t_k, d_v, t_q, p, ld, 1, grad_rows.data, grad_rows.ld, gvs.at(b, h), gvs.row, 1.0f);
      // dP^T = V dO^T, then dS^T in place.
      copy_transposed(gs.at(b, h), gs.row, t_q, d_v, grad_t.data(), ld);
      matmul(t_k, ld, d_v, vs.at(b, h), vs.row, 1, grad_t.data(), ld, ds, ld, 1.0f);
      softmax_backward_columns(p, ds, t_k, ld, alpha);
      // dQ = dS K, A(m = i, k = j) = dS^T[j, i];  dK = dS^T Q.
      matmul(t_q, d_k, t_k, ds, 1, ld, keys.data, keys.ld, gqs.at(b, h), gqs.row, 1.0f);
      matmul(t_k, d_k, t_q, ds, ld, 1, queries.data, queries.ld, gks.at(b, h), gks.row, 1.0f);
    }
  });
  return {grad_q, grad_k, grad_v};
}
