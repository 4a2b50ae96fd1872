// A decoder layer's memory-bound element-wise work on CPU, float32: the MLP's activation and the
// KV cache write. Each is one pass over its rows where torch takes several (SiLU into a new tensor,
// then the multiply; index_copy_ through TensorIterator), and small calls (decode batches) stay on
// the calling thread instead of starting a parallel region.

#include <stdint.h>
#include <string.h>

#include <cmath>

#include "vec.h"

namespace {

using namespace shapeserve_vec;

// Elements below which a call runs on the calling thread: a parallel region costs more than the work.
constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 16;

}  // namespace

extern "C" {

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
