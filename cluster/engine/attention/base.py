"""Attention over the paged KV cache: the backend interface, its metadata and the torch references.

The ``*_ref`` functions are plain padded torch: the oracle every backend (the torch backend's
fast paths, the Triton kernels) is tested against.
A backend does two things per layer: write this step's new K/V into their slots, then attend
each query token to its sequence's cached context (prefix + this step's tokens).

Batch order contract (built by the model runner): sequences that decode one token come
first, then sequences that prefill a chunk. Tokens of sequence i are
``query[query_start_loc[i]:query_start_loc[i+1]]``; the last ``query_len`` positions of
its ``seq_len`` context are the queries (causal within the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    # slot_mapping: [num_tokens] int64, slot of each new token = block_id * block_size + offset
    slot_mapping: torch.Tensor
    # query_start_loc: [num_seqs + 1] int32, cumulative query lengths
    query_start_loc: torch.Tensor
    # seq_lens: [num_seqs] int32, context length of each sequence including this step's tokens
    seq_lens: torch.Tensor
    # block_tables: [num_seqs, max_blocks] int32, padded with 0 past each sequence's blocks
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    #: The first ``num_decodes`` sequences have query_len == 1 and own the first ``num_decodes`` tokens.
    num_decodes: int
    #: Host-side copies, so backends can size work without a device sync.
    seq_lens_list: tuple[int, ...] = ()
    query_lens_list: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


class AttentionBackend(Protocol):
    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatters key/value [num_tokens, kv_heads, head_dim] into the caches
        [num_blocks, block_size, kv_heads, head_dim]."""

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape. Does not modify the caches.
        key, value: this step's new rows [num_tokens, kv_heads, head_dim], already in the caches; a backend may
        read them instead of the caches for a sequence whose whole context this step computes."""

    def warm_up(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Compiles now what the first step would otherwise compile (called once when the engine
        starts, so no request waits for it). Does not modify the caches."""


# ---- torch reference implementations (functional, so kernels can be tested against them) ----


def write_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    # key, value: [num_tokens, kv_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, kv_heads, head_dim] -> [num_seqs, max_blocks * block_size, kv_heads, head_dim]
    block_size = cache.shape[1]
    max_blocks = -(-max_seq_len // block_size)
    table = block_tables[:, :max_blocks].long()
    ctx = torch.index_select(cache, 0, table.reshape(-1)).view(table.shape[0], max_blocks, *cache.shape[1:])
    return ctx.flatten(1, 2)


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence. query [num_seqs, num_heads, head_dim] -> same shape."""
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    k = _gather_context(k_cache, block_tables, max_seq_len)  # [S, T, Hkv, D]
    v = _gather_context(v_cache, block_tables, max_seq_len)
    compute = torch.float32 if query.dtype != torch.float32 else query.dtype
    q = query.view(num_seqs, kv_heads, group, head_dim).to(compute)
    # scores: [S, Hkv, G, T]
    scores = torch.matmul(q, k.permute(0, 2, 3, 1).to(compute)) * scale
    positions = torch.arange(k.shape[1], device=query.device)
    invalid = positions[None, :] >= seq_lens[:, None]  # [S, T]
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).to(compute))  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    query_lens: tuple[int, ...] | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Ragged query chunks, causal within each chunk, attending to each sequence's cached prefix.

    query [num_tokens, num_heads, head_dim] -> same shape. Sequence i's queries are the last
    ``query_len_i`` positions of its ``seq_lens[i]`` context.
    """
    num_tokens, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if query_lens is None:
        query_lens = tuple((query_start_loc[1:] - query_start_loc[:-1]).tolist())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_q = max(query_lens)
    device = query.device
    k = _gather_context(k_cache, block_tables, max_seq_len)  # [S, T, Hkv, D]
    v = _gather_context(v_cache, block_tables, max_seq_len)

    # Pad ragged queries to [S, max_q] with a flat index; padded rows read token 0 and are dropped.
    qlens = torch.tensor(query_lens, device=device)
    row = torch.arange(max_q, device=device)
    valid_q = row[None, :] < qlens[:, None]  # [S, Q]
    flat_idx = (query_start_loc[:-1, None].long() + row[None, :]).masked_fill(~valid_q, 0)
    compute = torch.float32 if query.dtype != torch.float32 else query.dtype
    q = query[flat_idx].to(compute)  # [S, Q, H, D]

    # Query row r of sequence i sits at absolute position seq_len - q_len + r; it sees keys <= that.
    q_pos = (seq_lens - qlens)[:, None] + row[None, :]  # [S, Q]
    k_pos = torch.arange(k.shape[1], device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, T]
    allowed &= valid_q[:, :, None]
    # Padded query rows attend to position 0 only, so softmax stays finite; they are dropped below.
    allowed[:, :, 0] |= ~valid_q
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # [S, H, Q, D]
        k.transpose(1, 2).to(compute),  # [S, Hkv, T, D]
        v.transpose(1, 2).to(compute),
        attn_mask=allowed[:, None, :, :],
        scale=scale,
        enable_gqa=num_heads != kv_heads,
    ).transpose(1, 2)  # [S, Q, H, D]
    return out[valid_q].to(query.dtype)
