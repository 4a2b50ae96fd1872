// A float32 matmul for inputs of a few rows (the decode step of a few sequences), on CPU:
// out[m, j] = dot(x[m], w[j]) (+ bias[j]) over the plain [out, in] weight.
//
// At a few rows a linear layer is one pass over its weight, so its speed is the memory bandwidth it
// reaches; oneDNN's inner product costs ~20 us per call before any math and streams its blocked
// weights slowly at one row (cluster/engine/cpu_small_matmul.py has the figures). numba's kernel
// there has the same design; this one is built with the host's compiler like the other kernels of
// this directory, so an engine that finds it built loads it in milliseconds, where numba's import
// and the load of its cached kernel took ~1.5 s of a replica's start on a 2-core VM.
//
// Each thread takes a contiguous range of output columns, so it streams its rows of w once. Up to
// four input rows go through the k loop together, so each loaded weight vector feeds up to four FMAs;
// one or two rows (the common decode batches) unroll k instead, so that several independent sums, and
// as many loads of the weight row, are in flight. Reading two weight rows side by side instead (two
// columns per pass) streamed the 65 MB LM head of the bench model at ~0.77x numba's bandwidth.

#include <stdint.h>

#include "vec.h"

namespace {

using namespace shapeserve_vec;

// Below this many weight floats a call runs on the calling thread: a parallel region costs more.
constexpr int64_t PARALLEL_MIN_WEIGHTS = 1 << 15;

inline float lane_sum(vf v) {
  float total = 0.0f;
  for (int l = 0; l < W; ++l) total += v[l];
  return total;
}

// out[r * os] = dot(x[r], w) for r < R, with U independent sums per row over k.
template <int R, int U>
inline void dot_rows(const float* x, int64_t xs, const float* w, int64_t k, float* out, int64_t os) {
  vf acc[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = vf{};
  int64_t i = 0;
  for (; i + U * W <= k; i += U * W) {
    for (int u = 0; u < U; ++u) {
      vf wv = load(w + i + u * W);
      for (int r = 0; r < R; ++r) acc[u][r] += load(x + r * xs + i + u * W) * wv;
    }
  }
  for (; i + W <= k; i += W) {
    vf wv = load(w + i);
    for (int r = 0; r < R; ++r) acc[0][r] += load(x + r * xs + i) * wv;
  }
  for (int r = 0; r < R; ++r) {
    vf sum = acc[0][r];
    for (int u = 1; u < U; ++u) sum += acc[u][r];
    float total = lane_sum(sum);
    for (int64_t t = i; t < k; ++t) total += x[r * xs + t] * w[t];
    out[r * os] = total;
  }
}

// Column j of out for every row, four rows at a time.
inline void column(const float* x, int64_t rows, int64_t k, int64_t xs, const float* wj, float* out, int64_t os) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) dot_rows<4, 1>(x + m * xs, xs, wj, k, out + m * os, os);
  const float* xm = x + m * xs;
  float* om = out + m * os;
  switch (rows - m) {
    case 3: dot_rows<3, 1>(xm, xs, wj, k, om, os); break;
    case 2: dot_rows<2, 2>(xm, xs, wj, k, om, os); break;
    case 1: dot_rows<1, 4>(xm, xs, wj, k, om, os); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// out [rows, n] (rows out_stride floats apart) = x [rows, k] (rows x_stride apart) @ w[n, k]^T (rows w_stride
// apart) + bias [n] (none when null).
void small_rows_matmul_f32(const float* x, int64_t rows, int64_t k, int64_t x_stride, const float* w, int64_t n,
                           int64_t w_stride, const float* bias, float* out, int64_t out_stride, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n * k >= PARALLEL_MIN_WEIGHTS)
  for (int64_t j = 0; j < n; ++j) column(x, rows, k, x_stride, w + j * w_stride, out + j, out_stride);
  if (bias != nullptr) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < n; ++j) out[m * out_stride + j] += bias[j];
  }
}

}  // extern "C"
