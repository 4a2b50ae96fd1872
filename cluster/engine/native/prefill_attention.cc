// Causal prefill attention over the paged KV cache, float32, for CPUs: compiled when an engine
// starts (cluster.engine.native builds it with the host's compiler for the host's CPU),
// loaded through ctypes, called once per layer for every prefill chunk of a step.
//
// Why it exists: torch's CPU flash attention reaches ~55-65 GFLOP/s on the 2-core CI machine
// (its block matmuls go through a BLAS that runs AVX2 code on AMD CPUs), so at skewed-64's prompt
// lengths attention took ~19% of a prefill step. The two products here are written as register
// tiles over GCC vector types (W floats, one register of the host's widest: vec.h), sized so that a
// tile's accumulators and operands fit the CPU's vector registers:
//   scores = q . K^T : MR query rows x NR keys; K packed once per work item, transposed, in panels of
//                      NR keys, so each step of the D loop reads NR/W vectors in order and broadcasts
//                      MR query values for MR*NR/W FMAs;
//   out    = P . V   : MR query rows x DV vectors of output dims over V packed as [keys][D].
// A work item is (sequence, KV head, a range of query rows), packing its keys from the paged cache
// (through the block table) once for the whole group of query heads; the threads of an OpenMP team
// take items off a shared counter (the caller orders them longest first).
// Rows of a tile see keys up to their own position (causal); the score rows are exact softmax over
// the whole visible context (two passes over a row of at most max_model_len floats), not online.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <cmath>

#include "vec.h"

namespace {

using namespace shapeserve_vec;

constexpr int MR = 6;        // query rows per tile
constexpr int NR = 2 * W;    // keys per score tile: MR x 2 accumulators + 2 K vectors + 1 broadcast
// Output vectors per P.V pass: MR x DV accumulators + DV V vectors + 1 broadcast within the registers
// (4 with AVX-512's 32, 2 with AVX2's 16).
constexpr int DV = (VREGS - 1) / (MR + 1);
static_assert(MR * (NR / W) + NR / W + 1 <= VREGS, "the score tile must fit the vector registers");

struct Args {
  const float* query;      // [tokens, heads, D] rows q_row_stride floats apart
  int64_t q_row_stride;
  const float* k_cache;    // [blocks, block_size, kv_heads, D], contiguous
  const float* v_cache;
  const int32_t* block_tables;  // [seqs, table_stride]
  int64_t table_stride;
  float* out;              // [tokens, heads, D] rows out_row_stride floats apart
  int64_t out_row_stride;
  const int32_t* items;    // [n_items, 4]: sequence, kv head, first query row, end query row (of the sequence's)
  int n_items;
  const int32_t* q_start;  // [seqs]: the sequence's first row in query / out
  const int32_t* q_len;    // [seqs]
  const int32_t* seq_len;  // [seqs]: context length including this step's tokens
  int heads, kv_heads, head_dim, block_size;
  float scale;
  int max_keys;            // the longest context of any item, rounded up to NR
};

inline const float* kv_row(const float* cache, const Args& a, const int32_t* table, int key, int kv_head) {
  int64_t block = table[key / a.block_size];
  return cache + ((block * a.block_size + key % a.block_size) * a.kv_heads + kv_head) * a.head_dim;
}

// scores[i][0..n_tile) = scale * q_i . K[0..n_tile)^T for MR rows. kt holds K^T in panels of NR keys,
// [n_tile / NR][D][NR], so the D loop of a tile reads one contiguous panel.
inline void score_tile(const float* const* q, const float* kt, int n_tile, int D, float scale, float* scores,
                       int64_t scores_stride) {
  for (int j0 = 0; j0 < n_tile; j0 += NR) {
    vf acc[MR][NR / W] = {};
    const float* panel = kt + static_cast<int64_t>(j0) * D;
    for (int d = 0; d < D; ++d) {
      vf k[NR / W];
#pragma GCC unroll 8
      for (int c = 0; c < NR / W; ++c) k[c] = load(panel + d * NR + c * W);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        vf b = splat(q[i][d]);
#pragma GCC unroll 8
        for (int c = 0; c < NR / W; ++c) acc[i][c] += b * k[c];
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int c = 0; c < NR / W; ++c) store(scores + i * scores_stride + j0 + c * W, acc[i][c] * splat(scale));
  }
}

// Softmax of row[0..n) in place, zeroing row[n..n_tile); returns 1 / sum (the row is left unnormalised).
inline float softmax_row(float* row, int n, int n_tile) {
  int full = n / W * W;
  vf vmax = splat(-INFINITY);
  for (int j = 0; j < full; j += W) {
    vf x = load(row + j);
    vmax = x > vmax ? x : vmax;
  }
  float top = -INFINITY;
  for (int l = 0; l < W; ++l) top = vmax[l] > top ? vmax[l] : top;
  for (int j = full; j < n; ++j) top = row[j] > top ? row[j] : top;
  vf vsum = {};
  for (int j = 0; j < full; j += W) {
    vf e = vexp(load(row + j) - splat(top));
    store(row + j, e);
    vsum += e;
  }
  float total = 0.0f;
  for (int l = 0; l < W; ++l) total += vsum[l];
  if (full < n) {  // the last, partial vector: masked lanes become 0
    vf x = load(row + full) - splat(top);
    vf e = vexp(x);
    for (int l = 0; l < W; ++l) {
      float v = full + l < n ? e[l] : 0.0f;
      row[full + l] = v;
      total += v;
    }
    full += W;
  }
  for (int j = full; j < n_tile; ++j) row[j] = 0.0f;
  return 1.0f / total;
}

// out_i[dims] = inv_i * sum_j p[i][j] * V[j][dims] over keys [0, n), NV vectors of dims starting at d0;
// v: the keys' V rows packed [n][D].
template <int NV>
inline void pv_tile(const float* probs, int64_t probs_stride, const float* v, int n, int D, int d0,
                    const float* inv, float* const* out, int rows) {
  vf acc[MR][NV] = {};
  for (int j = 0; j < n; ++j) {
    const float* row = v + static_cast<int64_t>(j) * D + d0;
    vf vv[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) vv[c] = load(row + c * W);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      vf p = splat(probs[i * probs_stride + j]);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[i][c] += p * vv[c];
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < NV; ++c) store(out[i] + d0 + c * W, acc[i][c] * splat(inv[i]));
}

void run_item(const Args& a, const int32_t* item, float* kt, float* v, float* scores) {
  const int s = item[0], kv_head = item[1], row_begin = item[2], row_end = item[3];
  const int D = a.head_dim, group = a.heads / a.kv_heads;
  const int first_pos = a.seq_len[s] - a.q_len[s];  // position of the sequence's query row 0
  const int n_keys = first_pos + row_end;             // keys the item's last row sees
  const int padded = (n_keys + NR - 1) / NR * NR;
  const int32_t* table = a.block_tables + s * a.table_stride;
  // This KV head's keys and values, packed once for all the item's rows (and both products read them
  // in order): K^T in panels, zero past the last key so whole tiles can be read; V as [keys][D].
  for (int j = 0; j < n_keys; ++j) {
    const float* k = kv_row(a.k_cache, a, table, j, kv_head);
    float* panel = kt + static_cast<int64_t>(j / NR) * NR * D + j % NR;
    for (int d = 0; d < D; ++d) panel[d * NR] = k[d];
    memcpy(v + static_cast<int64_t>(j) * D, kv_row(a.v_cache, a, table, j, kv_head), D * sizeof(float));
  }
  for (int j = n_keys; j < padded; ++j) {
    float* panel = kt + static_cast<int64_t>(j / NR) * NR * D + j % NR;
    for (int d = 0; d < D; ++d) panel[d * NR] = 0.0f;
  }

  for (int g = 0; g < group; ++g) {
    const int head = kv_head * group + g;
    for (int r0 = row_begin; r0 < row_end; r0 += MR) {
      const int rows = row_end - r0 < MR ? row_end - r0 : MR;
      const float* q[MR];
      float* out[MR];
      for (int i = 0; i < MR; ++i) {
        int r = a.q_start[s] + r0 + (i < rows ? i : 0);  // short tiles repeat row 0, never stored
        q[i] = a.query + r * a.q_row_stride + head * D;
        out[i] = a.out + r * a.out_row_stride + head * D;
      }
      const int tile_keys = first_pos + r0 + rows;  // keys the tile's last row sees
      const int n_tile = (tile_keys + NR - 1) / NR * NR;
      score_tile(q, kt, n_tile, D, a.scale, scores, a.max_keys);
      float inv[MR];
      for (int i = 0; i < MR; ++i)
        inv[i] = softmax_row(scores + i * a.max_keys, i < rows ? first_pos + r0 + i + 1 : 0, n_tile);
      int d0 = 0;
      for (; d0 + DV * W <= D; d0 += DV * W) pv_tile<DV>(scores, a.max_keys, v, tile_keys, D, d0, inv, out, rows);
      for (; d0 < D; d0 += W) pv_tile<1>(scores, a.max_keys, v, tile_keys, D, d0, inv, out, rows);
    }
  }
}

void worker(const Args& a, std::atomic<int>& next, std::atomic<int>& failed) {
  const size_t keys = a.max_keys;
  float* kt = static_cast<float*>(aligned_alloc(64, keys * a.head_dim * sizeof(float)));
  float* v = static_cast<float*>(aligned_alloc(64, keys * a.head_dim * sizeof(float)));
  float* scores = static_cast<float*>(aligned_alloc(64, MR * keys * sizeof(float)));
  if (kt == nullptr || v == nullptr || scores == nullptr) {
    failed = 1;
  } else {
    for (int k = next.fetch_add(1); k < a.n_items; k = next.fetch_add(1)) run_item(a, a.items + 4 * k, kt, v, scores);
  }
  free(kt);
  free(v);
  free(scores);
}

}  // namespace

extern "C" {

// Returns 0, or -1 if a thread's scratch memory could not be had (out is then incomplete).
// The threads are an OpenMP team: built with -fopenmp against the libgomp.so.1 torch has loaded,
// the kernel runs on the calling thread's team, the same threads (still spinning) as the matmul
// before it, instead of starting threads that would compete with them for the cores.
int prefill_attention_f32(const float* query, int64_t q_row_stride, const float* k_cache, const float* v_cache,
                          const int32_t* block_tables, int64_t table_stride, float* out, int64_t out_row_stride,
                          const int32_t* items, int n_items, const int32_t* q_start, const int32_t* q_len,
                          const int32_t* seq_len, int heads, int kv_heads, int head_dim, int block_size,
                          float scale, int max_keys, int n_threads) {
  const Args a{query,   q_row_stride, k_cache, v_cache, block_tables, table_stride, out,       out_row_stride,
               items,   n_items,      q_start, q_len,   seq_len,      heads,        kv_heads,  head_dim,
               block_size, scale,     (max_keys + NR - 1) / NR * NR};
  std::atomic<int> next{0}, failed{0};
  if (n_threads > n_items) n_threads = n_items;
  if (n_threads < 1) n_threads = 1;
#pragma omp parallel num_threads(n_threads)
  worker(a, next, failed);
  return failed ? -1 : 0;
}

}  // extern "C"
