// A decoder layer's memory-bound element-wise work on CPU, float32: the norms (with the residual
// add), the rotary embedding, the MLP's activation and the KV cache write. Each is one pass over its
// rows where torch takes several ops (RMSNorm is seven, rotary about twenty, SiLU x up two), and
// small calls (decode batches) stay on the calling thread instead of starting a parallel region.

#include <stdint.h>
#include <string.h>

#include <cmath>

#include "vec.h"

namespace {

using namespace shapeserve_vec;

// Elements below which a call runs on the calling thread: a parallel region costs more than the work.
constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 16;

// sum of squares of x[0..n)
inline float sum_squares(const float* x, int64_t n) {
  vf acc = {};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    vf v = load(x + i);
    acc += v * v;
  }
  float total = 0.0f;
  for (int l = 0; l < W; ++l) total += acc[l];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// dst = weight * (x * inv), elementwise over n
inline void scale_row(const float* x, const float* weight, float inv, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(dst + i, load(weight + i) * (load(x + i) * splat(inv)));
  for (; i < n; ++i) dst[i] = weight[i] * (x[i] * inv);
}

}  // namespace

extern "C" {

// Floats per vector in this build (vec.h): 16 with AVX-512, 8 with AVX2, 4 otherwise.
int vector_floats() { return W; }

// out[r] = RMSNorm(x[r]) * weight for rows x hidden; rows x_stride / out_stride floats apart.
void rms_norm_f32(const float* x, int64_t rows, int64_t hidden, int64_t x_stride, const float* weight, float eps,
                  float* out, int64_t out_stride, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_stride;
    float inv = 1.0f / std::sqrt(sum_squares(row, hidden) / static_cast<float>(hidden) + eps);
    scale_row(row, weight, inv, hidden, out + r * out_stride);
  }
}

// x[r] += residual[r], then out[r] = RMSNorm(x[r]) * weight: x becomes the next layer's residual.
void add_rms_norm_f32(float* x, int64_t rows, int64_t hidden, int64_t x_stride, const float* residual,
                      int64_t residual_stride, const float* weight, float eps, float* out, int64_t out_stride,
                      int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * x_stride;
    const float* res = residual + r * residual_stride;
    int64_t i = 0;
    for (; i + W <= hidden; i += W) store(row + i, load(row + i) + load(res + i));
    for (; i < hidden; ++i) row[i] += res[i];
    float inv = 1.0f / std::sqrt(sum_squares(row, hidden) / static_cast<float>(hidden) + eps);
    scale_row(row, weight, inv, hidden, out + r * out_stride);
  }
}

// Rotates the first rotated_heads heads of every row of qkv (q's, then k's) in place by the angles of
// positions[r]: x * cos + rotate_half(x) * sin, where rotate_half(x) = cat(-x[half:], x[:half]).
// cos, sin: [max_positions, head_dim]. Returns 0, or -1 (rotating nothing) if a position lies
// outside [0, max_positions).
int rotary_qk_f32(float* qkv, int64_t rows, int64_t qkv_stride, const int64_t* positions, int rotated_heads,
                  int head_dim, const float* cos, const float* sin, int64_t max_positions, int n_threads) {
  for (int64_t r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= max_positions) return -1;
  const int half = head_dim / 2;
#pragma omp parallel for num_threads(n_threads) schedule(static) \
    if (rows * rotated_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + positions[r] * head_dim;
    const float* s = sin + positions[r] * head_dim;
    for (int h = 0; h < rotated_heads; ++h) {
      float* lo = qkv + r * qkv_stride + static_cast<int64_t>(h) * head_dim;
      float* hi = lo + half;
      int i = 0;
      for (; i + W <= half; i += W) {
        vf x1 = load(lo + i), x2 = load(hi + i);
        store(lo + i, x1 * load(c + i) - x2 * load(s + i));
        store(hi + i, x2 * load(c + half + i) + x1 * load(s + half + i));
      }
      for (; i < half; ++i) {
        float x1 = lo[i], x2 = hi[i];
        lo[i] = x1 * c[i] - x2 * s[i];
        hi[i] = x2 * c[half + i] + x1 * s[half + i];
      }
    }
  }
  return 0;
}

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i] for rows x inter: the fused gate/up
// projection's output in, the down projection's input out.
void silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, int64_t in_stride, float* out,
                  int64_t out_stride, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * in_stride;
    const float* up = gate + inter;
    float* o = out + r * out_stride;
    int64_t i = 0;
    for (; i + W <= inter; i += W) {
      vf x = load(gate + i);
      store(o + i, x / (splat(1.0f) + vexp(-x)) * load(up + i));
    }
    for (; i < inter; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

// k_cache[slots[t]] = key[t] and v_cache[slots[t]] = value[t], a row of row_floats each (kv_heads x
// head_dim); key/value rows lie key_stride / value_stride floats apart (views of the fused qkv).
// Returns 0, or -1 (writing nothing) if a slot lies outside [0, num_slots).
int write_kv_f32(const float* key, int64_t key_stride, const float* value, int64_t value_stride, float* k_cache,
                 float* v_cache, const int64_t* slots, int64_t tokens, int64_t row_floats, int64_t num_slots,
                 int n_threads) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return -1;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (tokens * row_floats >= PARALLEL_MIN_ELEMENTS)
  for (int64_t t = 0; t < tokens; ++t) {
    memcpy(k_cache + slots[t] * row_floats, key + t * key_stride, row_floats * sizeof(float));
    memcpy(v_cache + slots[t] * row_floats, value + t * value_stride, row_floats * sizeof(float));
  }
  return 0;
}

}  // extern "C"
