// Paged decode attention on CPU, float32: one query token per sequence against its whole cached
// context, read through the block table where it lies. Built for the host by cluster.engine.native.
//
// Decode attention reads every cached K/V byte of every running sequence once per layer and does
// little arithmetic on it: its cost is memory traffic. Work items are whole sequences (or, when there
// are too few sequences to share out, one KV head of one) spread over the calling thread's OpenMP
// team (torch's threads). An item walks its context token by token, each token's heads one run of
// memory, as the hardware prefetchers stream best (reading it head by head instead, a 1 KiB stride,
// was clearly slower once the cache was out of L3):
//   scores: each head's dot product with a token as D/W vector FMAs (W floats a vector, vec.h), kept
//           as a vector of partial sums; every W tokens one shuffle tree sums each head's W vectors
//           across lanes;
//   softmax over the whole context (a row of at most max_model_len floats per head);
//   out:    P . V token by token into per-head accumulators in L1.

#include <stdint.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>

#include "vec.h"

namespace {

using namespace shapeserve_vec;

// K elements (keys x head_dim over all items) below which a call runs on the calling thread.
constexpr int64_t SERIAL_MAX_ELEMENTS = 1 << 16;

struct Args {
  const float* query;  // [seqs, heads, D], rows q_row_stride floats apart
  int64_t q_row_stride;
  const float* k_cache;  // [blocks, block_size, kv_heads, D], contiguous
  const float* v_cache;
  const int32_t* block_tables;  // [seqs, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;  // [seqs]
  const int32_t* items;     // [n_items, 3]: sequence, first and end KV head
  int n_items;
  int heads, kv_heads, block_size;
  float scale;
  float* out;  // [seqs, heads, D], contiguous
  int max_len;
};

// The rows of W consecutive tokens (all KV heads of each) from token t0, in the cache cache.
inline int tile_rows(const Args& a, const float* cache, const int32_t* table, int len, int t0, int64_t token_stride,
                     const float** rows) {
  const int n = len - t0 < W ? len - t0 : W;
  int b = t0 / a.block_size, off = t0 % a.block_size;
  for (int i = 0; i < n; ++i) {
    rows[i] = cache + (static_cast<int64_t>(table[b]) * a.block_size + off) * token_stride;
    if (++off == a.block_size) off = 0, ++b;
  }
  return n;
}

// One item: sequence s, KV heads [h0, h1) and their query heads. Token-major: each tile of W tokens
// is read from memory once, all of the item's heads over it, so the cache is streamed in order.
template <int D>
void run_item(const Args& a, int s, int h0, int h1, float* scores, int64_t scores_stride, float* qbuf, float* acc,
              float* pbuf) {
  constexpr int NV = D / W;
  const int len = a.seq_lens[s], group = a.heads / a.kv_heads;
  const int n_heads = (h1 - h0) * group;  // query heads of the item, from query head h0 * group on
  const int64_t token_stride = static_cast<int64_t>(a.kv_heads) * D;
  const int32_t* table = a.block_tables + s * a.table_stride;
  const float* q_row = a.query + s * a.q_row_stride + h0 * group * D;
  for (int j = 0; j < n_heads * D; j += W) store(qbuf + j, load(q_row + j) * splat(a.scale));
  const float* rows[W];
  // Scores, W keys at a time, token by token (each token's heads are one run of memory): every head's
  // dot product with the token as a vector of partial sums, then each head's W summed across lanes.
  vf* part = reinterpret_cast<vf*>(pbuf);  // [n_heads][W]
  for (int t0 = 0; t0 < len; t0 += W) {
    const int n = tile_rows(a, a.k_cache, table, len, t0, token_stride, rows);
    for (int i = 0; i < W; ++i) {
      for (int h = h0; h < h1; ++h) {
        vf k[NV];
        if (i < n) {
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) k[c] = load(rows[i] + h * D + c * W);
        } else {
          for (int c = 0; c < NV; ++c) k[c] = vf{};
        }
        for (int g = 0; g < group; ++g) {
          const int j = (h - h0) * group + g;
          vf sum = {};
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) sum += load(qbuf + j * D + c * W) * k[c];
          part[j * W + i] = sum;
        }
      }
    }
    for (int j = 0; j < n_heads; ++j) store(scores + j * scores_stride + t0, sum_lanes(part + j * W));
  }
  // Softmax of each head's row, left unnormalised: the output is scaled by 1 / sum at the end.
  float inv[64];
  for (int j = 0; j < n_heads; ++j) {
    float* row = scores + j * scores_stride;
    float top = -INFINITY;
    for (int t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
    float total = 0.0f;
    int t = 0;
    for (; t + W <= len; t += W) {
      vf e = vexp(load(row + t) - splat(top));
      store(row + t, e);
      for (int l = 0; l < W; ++l) total += e[l];
    }
    for (; t < len; ++t) {
      row[t] = std::exp(row[t] - top);
      total += row[t];
    }
    inv[j] = 1.0f / total;
  }
  // P . V, token by token; the accumulators stay in L1 (all the item's heads are more than the registers).
  for (int j = 0; j < n_heads * D; j += W) store(acc + j, vf{});
  for (int t0 = 0; t0 < len; t0 += W) {
    const int n = tile_rows(a, a.v_cache, table, len, t0, token_stride, rows);
    for (int i = 0; i < n; ++i) {
      for (int h = h0; h < h1; ++h) {
        vf v[NV];
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) v[c] = load(rows[i] + h * D + c * W);
        for (int g = 0; g < group; ++g) {
          const int j = (h - h0) * group + g;
          const vf p = splat(scores[j * scores_stride + t0 + i]);
          float* o = acc + j * D;
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) store(o + c * W, load(o + c * W) + p * v[c]);
        }
      }
    }
  }
  float* out = a.out + (static_cast<int64_t>(s) * a.heads + h0 * group) * D;
  for (int j = 0; j < n_heads; ++j)
    for (int c = 0; c < NV; ++c) store(out + j * D + c * W, load(acc + j * D + c * W) * splat(inv[j]));
}

template <int D>
void worker(const Args& a, std::atomic<int>& next, std::atomic<int>& failed) {
  const int64_t len = (a.max_len + W - 1) / W * W;
  const int max_heads = a.heads;  // an item holds at most all of a sequence's query heads
  float* scores = static_cast<float*>(aligned_alloc(64, max_heads * len * sizeof(float)));
  float* qbuf = static_cast<float*>(aligned_alloc(64, max_heads * D * sizeof(float)));
  float* acc = static_cast<float*>(aligned_alloc(64, max_heads * D * sizeof(float)));
  float* pbuf = static_cast<float*>(aligned_alloc(64, max_heads * W * W * sizeof(float)));
  if (scores == nullptr || qbuf == nullptr || acc == nullptr || pbuf == nullptr) {
    failed = 1;
  } else {
    for (int k = next.fetch_add(1); k < a.n_items; k = next.fetch_add(1)) {
      const int32_t* item = a.items + 3 * k;
      run_item<D>(a, item[0], item[1], item[2], scores, len, qbuf, acc, pbuf);
    }
  }
  free(scores);
  free(qbuf);
  free(acc);
  free(pbuf);
}

}  // namespace

extern "C" {

// Returns 0; -1 if a thread's scratch memory could not be had; -2 if head_dim is not 16, 32, 48, 64,
// 80, 96, 112 or 128 or there are more than 64 query heads (out is then incomplete).
int decode_attention_f32(const float* query, int64_t q_row_stride, const float* k_cache, const float* v_cache,
                         const int32_t* block_tables, int64_t table_stride, const int32_t* seq_lens,
                         const int32_t* items, int n_items, int heads, int kv_heads, int head_dim, int block_size,
                         float scale, float* out, int max_len, int n_threads) {
  const Args a{query,   q_row_stride, k_cache, v_cache,  block_tables, table_stride, seq_lens, items,
               n_items, heads,        kv_heads, block_size, scale,     out,          max_len};
  std::atomic<int> next{0}, failed{0};
  if (head_dim % 16 != 0 || head_dim < 16 || head_dim > 128 || heads > 64) return -2;
  int64_t keys = 0;  // a small step's items run on the calling thread: a parallel region costs more
  for (int k = 0; k < n_items; ++k) keys += static_cast<int64_t>(seq_lens[items[3 * k]]) * (items[3 * k + 2] - items[3 * k + 1]);
  if (keys * head_dim < SERIAL_MAX_ELEMENTS) n_threads = 1;
  if (n_threads > n_items) n_threads = n_items;
  if (n_threads < 1) n_threads = 1;
#pragma omp parallel num_threads(n_threads)
  switch (head_dim / 16) {
    case 1: worker<16>(a, next, failed); break;
    case 2: worker<32>(a, next, failed); break;
    case 3: worker<48>(a, next, failed); break;
    case 4: worker<64>(a, next, failed); break;
    case 5: worker<80>(a, next, failed); break;
    case 6: worker<96>(a, next, failed); break;
    case 7: worker<112>(a, next, failed); break;
    default: worker<128>(a, next, failed); break;
  }
  return failed ? -1 : 0;
}

}  // extern "C"
