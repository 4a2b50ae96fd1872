// Float vectors over GCC's vector extension, as wide as one register of the CPU -march=native
// builds for, and the few operations the kernels of this directory share.
//
// Why the width follows the CPU: the kernels keep tiles of vectors in registers. Written in 16-float
// vectors on a CPU with AVX2 only (16 registers of 8 floats), each vector took two registers, the
// tiles no longer fitted and spilled to the stack, and lane shuffles were lowered element by element:
// on an AMD EPYC with AVX2 the prefill kernel took 10x the time of the SDPA path (bench.kernels) and
// the engine's skewed-64 burst 0.55x the throughput of this build (bench.compare_engines
// --baseline-rev; docs/benchmarks.md, "Host-built kernels on a CPU with AVX2 only").
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <utility>

namespace shapeserve_vec {

#if defined(__AVX512F__)
constexpr int W = 16;     // floats per vector
constexpr int VREGS = 32; // vector registers
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int VREGS = 16;
#else  // SSE2 on x86-64, NEON on arm64 (which has 32 registers; 16 is the safe count)
constexpr int W = 4;
constexpr int VREGS = 16;
#endif

typedef float vf __attribute__((vector_size(4 * W)));
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * W)));

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

// Lane i of the result = the sum of p[i]'s lanes, for p[0..W): a transpose-and-add tree. Each level
// adds pairs of vectors chunk by chunk, halving the chunk, so after the last level lane i holds p[i]'s
// total. The masks are constants, so each shuffle is one or two permute instructions.
namespace detail {
template <int C, size_t... K>
constexpr vi chunk_mask(std::index_sequence<K...>, int shift) {
  return vi{static_cast<int32_t>(K / C * 2 * C + K % C + shift)...};
}

// Chunks of C lanes of a and b in turn (a's even chunks, then b's, each chunk's sum with its odd neighbour).
template <int C>
inline vf add_chunk_pairs(vf a, vf b) {
  constexpr vi even = chunk_mask<C>(std::make_index_sequence<W>{}, 0);
  constexpr vi odd = chunk_mask<C>(std::make_index_sequence<W>{}, C);
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

template <int C>
inline void reduce_level(vf* x, int n) {
  for (int i = 0; i < n / 2; ++i) x[i] = add_chunk_pairs<C>(x[2 * i], x[2 * i + 1]);
}
}  // namespace detail

inline vf sum_lanes(const vf* p) {
  vf x[W];
  for (int i = 0; i < W; ++i) x[i] = p[i];
  int n = W;
  if constexpr (W >= 16) detail::reduce_level<8>(x, n), n /= 2;
  if constexpr (W >= 8) detail::reduce_level<4>(x, n), n /= 2;
  detail::reduce_level<2>(x, n), n /= 2;
  detail::reduce_level<1>(x, n);
  return x[0];
}

}  // namespace shapeserve_vec
