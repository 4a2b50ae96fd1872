"""The ``triton`` attention backend: the Triton kernels behind the engine's AttentionBackend protocol.

Found through ``cluster.engine.attention.BACKENDS`` and imported only when chosen, so CPU-only
hosts need no triton.
"""

from __future__ import annotations

import torch

from cluster.engine.attention.base import AttentionMetadata
from cluster.engine.attention.triton.decode import paged_decode_attention
from cluster.engine.attention.triton.kv_write import write_kv
from cluster.engine.attention.triton.prefill import paged_prefill_attention


class TritonAttentionBackend:
    """Decodes go to the split-K decode kernel, prefill chunks to the varlen prefill kernel."""

    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        # key, value: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def warm_up(self, k_cache, v_cache) -> None:
        """Nothing ahead of time: Triton compiles each kernel variant at its first launch."""

    def attend(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, key=None, value=None
    ) -> torch.Tensor:
        # key/value (this step's new rows) go unused: the kernels read every sequence's context from the caches.
        # query: [num_tokens, num_heads, head_dim] -> out: same shape; does not modify the caches
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            # Host-side lengths size the split without a device sync; max_seq_len is a safe upper bound.
            max_len = max(meta.seq_lens_list[:nd]) if meta.seq_lens_list else meta.max_seq_len
            paged_decode_attention(
                query[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                max_len,
                out=out[:nd],
            )
        if meta.num_prefills:
            max_q = max(meta.query_lens_list[nd:]) if meta.query_lens_list else meta.max_query_len
            paged_prefill_attention(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:],  # offsets start at nd; the kernel reads them relative to it
                meta.seq_lens[nd:],
                scale,
                max_q,
                out=out[nd:],
            )
        return out
