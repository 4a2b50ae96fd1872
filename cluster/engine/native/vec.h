// 16-float vectors over GCC's vector extension (one AVX-512 register, two AVX2 ones, whatever
// -march=native offers), and the few operations the kernels of this directory share.
#pragma once

#include <stdint.h>

namespace shapeserve_vec {

constexpr int W = 16;  // floats per vector

typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

// exp(x): Cephes' expf polynomial after reducing by ln 2, relative error ~2e-7. x is clamped to
// [-87, 88], so very negative inputs give ~1e-38, not 0: a softmax zeroes masked entries itself.
inline vf vexp(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  x = x > splat(88.0f) ? splat(88.0f) : x;
  vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(t, vi);
  vf nf = __builtin_convertvector(n, vf);
  vi adjust = nf > t;  // truncation rounded a negative t up: take floor
  n += adjust;         // adjust is -1 where true
  nf = __builtin_convertvector(n, vf);
  vf r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  vi bits = (n + 127) << 23;
  return p * (vf)bits;  // GCC vector casts reinterpret the bits
}

}  // namespace shapeserve_vec
