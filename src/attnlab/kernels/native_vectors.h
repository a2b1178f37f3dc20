// The 16-float vectors attnlab's kernels compute with (GCC's vector extensions: one AVX-512
// register where the build targets it, two or four narrower ones elsewhere), and the few
// operations on them that several kernels share.

#pragma once

#include <cstdint>

namespace attnlab_vectors {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef float vf_unaligned __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));

typedef float vf8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vf4 __attribute__((vector_size(4 * sizeof(float))));

inline vf splat(float x) { return (vf){} + x; }
inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf x) { *reinterpret_cast<vf_unaligned*>(p) = x; }

// The sum of a vector's lanes, by halves (a serial sum would be a chain of 16 dependent adds).
inline float lane_sum(vf v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (Cephes' expf polynomial, about 1 ulp): 2^n e^r with n = round(x / ln 2).
// Arguments below -87 give exp(-87) ~ 1.6e-38 rather than less: nothing next to a softmax's sum >= 1.
inline vf exp_nonpositive(vf x) {
  const vf low = splat(-87.0f);
  x = x < low ? low : x;
  const vf round_magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting rounds to an integer
  const vf n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 in two parts, the first exact
  vf y = r * 1.9875691500E-4f + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * (r * r) + r + 1.0f;
  const vi exponent = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * reinterpret_cast<const vf&>(exponent);
}

}  // namespace attnlab_vectors
