"""Paged attention for the torch backend through ``scaled_dot_product_attention``, in length buckets.

The CPU's fused SDPA kernel (flash attention over strided K/V) is far faster than composing
matmul + softmax, but it wants rectangular batches, and a step's sequences are ragged: a
decode is one query against its whole context, a prefill chunk many queries. Padding all of
them to the longest multiplies the work on long-tailed batches; one call per sequence pays
~80 us of call overhead per sequence and layer. So sequences are sorted by size and grouped
while a group's padded work costs less than running its members apart (``length_buckets``):
short decodes and short prompts share calls, a long prompt runs alone (and then causally,
skipping the masked half). Each group is one SDPA call over K/V gathered block by block, except
a lone prompt with nothing cached: its whole context is this step's own K/V, which the caller can
pass (``fresh_kv``), so it attends over those rows where they lie, with no gather of its blocks
and no index/scatter of its query and output rows (``python -m bench.compare_engines`` times such
prompts in its ``--mixed`` rows).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: What one SDPA call costs before any attention math (gather, mask, dispatch), in FLOPs of
#: attention math: ~80 us per call at ~80 GFLOP/s, measured on the 2-core CI machine.
CALL_OVERHEAD_FLOPS = 6e6


def _solo_pairs(q: int, t: int) -> float:
    """Query-key pairs one call computes for a sequence alone: a prompt with no cached prefix
    runs as plain causal attention, which skips the masked upper half."""
    return q * t / 2 if 1 < q == t else q * t


def length_buckets(query_lens: list[int], seq_lens: list[int], call_overhead_pairs: float) -> list[list[int]]:
    """Groups sequence indices into SDPA calls; deterministic for the same input.

    Greedy over sequences sorted by (context, query) length: a sequence joins the current group
    when the group's padded work (members x longest query x longest context) grows by less
    than running the sequence alone would cost (its own pairs + one call's overhead).
    """
    order = sorted(range(len(seq_lens)), key=lambda i: (seq_lens[i], query_lens[i]))
    buckets: list[list[int]] = []
    members: list[int] = []
    max_q = max_t = 0
    for i in order:
        q, t = query_lens[i], seq_lens[i]
        if members:
            cost_now = _solo_pairs(max_q, max_t) if len(members) == 1 else len(members) * max_q * max_t
            cost_joined = (len(members) + 1) * max(max_q, q) * max(max_t, t)
            if cost_joined - cost_now > _solo_pairs(q, t) + call_overhead_pairs:
                buckets.append(members)
                members, max_q, max_t = [], 0, 0
        members.append(i)
        max_q, max_t = max(max_q, q), max(max_t, t)
    if members:
        buckets.append(members)
    return buckets


class GatherBuffer:
    """Reused destination for gathered K/V blocks.

    A fresh multi-MB tensor per layer and group would fault its pages in on every call (glibc
    maps large allocations afresh); one buffer, grown to the largest need, is written over.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def take(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``like``'s dtype and device, valid until the next ``take``."""
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


def _gather_kv(k_cache, v_cache, block_tables, num_blocks: int, buffer: GatherBuffer):
    # caches: [num_blocks_total, block_size, kv_heads, head_dim]; block_tables: [B, >= num_blocks]
    # -> k, v: [B, kv_heads, num_blocks * block_size, head_dim], strided views of the gathered blocks
    table = block_tables[:, :num_blocks].reshape(-1).long()
    shape = (table.shape[0], *k_cache.shape[1:])
    numel = math.prod(shape)
    flat = buffer.take(2 * numel, k_cache)
    k = torch.index_select(k_cache, 0, table, out=flat[:numel].view(shape))
    v = torch.index_select(v_cache, 0, table, out=flat[numel:].view(shape))
    seq_shape = (block_tables.shape[0], num_blocks * k_cache.shape[1], *k_cache.shape[2:])
    return k.view(seq_shape).transpose(1, 2), v.view(seq_shape).transpose(1, 2)


def _causal_mask(q_lens, t_lens, max_q: int, max_t: int, device) -> torch.Tensor:
    """[B, 1, max_q, max_t] bool: query row r of sequence b (at position t_b - q_b + r) sees keys <= it.

    Rows past a sequence's queries (padding, dropped afterwards) see at least key 0, so their
    softmax stays finite; a real row never sees a key past its sequence's context."""
    first = torch.tensor([t - q for q, t in zip(q_lens, t_lens, strict=False)], device=device)
    q_pos = first[:, None] + torch.arange(max_q, device=device)[None, :]
    allowed = torch.arange(max_t, device=device)[None, None, :] <= q_pos[:, :, None]
    return allowed[:, None]


@dataclass(frozen=True)
class _SDPACall:
    """One SDPA call of a step: which sequences, and the index tensors and mask it needs."""

    seqs: torch.Tensor  # [B] rows of the block table
    num_blocks: int  # blocks gathered per sequence
    max_q: int
    max_t: int
    #: Token index of every (sequence, query row) [B, max_q], and which of them are real queries.
    rows: torch.Tensor
    valid: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool
    #: Index of the first query row of the call's first sequence in the step's flat batch.
    first_row: int


@functools.lru_cache(maxsize=4)
def _plan(
    query_lens: tuple[int, ...], seq_lens: tuple[int, ...], block_size: int, overhead_pairs: float, device
) -> tuple[_SDPACall, ...]:
    """The step's SDPA calls. Every layer of a step has the same lengths, so the plan is built
    once per step (the cache) rather than once per layer."""
    starts = [0] * len(query_lens)
    for i in range(1, len(query_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]
    calls = []
    for bucket in length_buckets(list(query_lens), list(seq_lens), overhead_pairs):
        q_lens = [query_lens[i] for i in bucket]
        t_lens = [seq_lens[i] for i in bucket]
        max_q, max_t = max(q_lens), max(t_lens)
        offsets = torch.arange(max_q, device=device)
        rows = torch.tensor([starts[i] for i in bucket], device=device)[:, None] + offsets[None, :]
        valid = offsets[None, :] < torch.tensor(q_lens, device=device)[:, None]
        # Alone, a decode or a prompt without cached prefix needs no mask (the latter is plain causal).
        plain = len(bucket) == 1 and max_q in (1, max_t)
        calls.append(
            _SDPACall(
                seqs=torch.tensor(bucket, device=device),
                num_blocks=-(-max_t // block_size),
                max_q=max_q,
                max_t=max_t,
                rows=rows.masked_fill(~valid, 0),
                valid=valid,
                mask=None if plain else _causal_mask(q_lens, t_lens, max_q, max_t, device),
                is_causal=plain and max_q > 1,
                first_row=starts[bucket[0]],
            )
        )
    return tuple(calls)


def paged_attention_sdpa(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: tuple[int, ...] | list[int],
    seq_lens: tuple[int, ...] | list[int],
    scale: float,
    buffer: GatherBuffer | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Ragged causal attention over the paged cache, for decodes and prefill chunks alike.

    query: [num_tokens, num_heads, head_dim], sequence i's ``query_lens[i]`` tokens contiguous
    and in order; they are the last positions of its ``seq_lens[i]`` context, whose K/V (this
    step's included) are already in the caches [num_blocks, block_size, kv_heads, head_dim].
    block_tables: [num_seqs, max_blocks] int32. Returns the shape of ``query``.
    ``fresh_kv``: this step's new (key, value) rows [num_tokens, kv_heads, head_dim], in ``query``'s order (the
    ones just written to the caches); given, a prompt computed whole in this step reads its K/V from them.
    Does not modify the caches.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    buffer = buffer or GatherBuffer()
    gqa = num_heads != kv_heads
    overhead_pairs = CALL_OVERHEAD_FLOPS / (4 * num_heads * head_dim)  # QK^T and PV, a multiply-add each
    out = torch.empty_like(query)
    for call in _plan(tuple(query_lens), tuple(seq_lens), block_size, overhead_pairs, query.device):
        if call.is_causal and fresh_kv is not None:  # a lone prompt with nothing cached: rows [a, b) are all of it
            a, b = call.first_row, call.first_row + call.max_q
            q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, *fresh_kv))  # [1, heads, T, D] views
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            out[a:b] = o[0].transpose(0, 1)
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[call.seqs], call.num_blocks, buffer)
        k, v = k[:, :, : call.max_t], v[:, :, : call.max_t]  # [B, Hkv, T, D]
        q = query[call.rows].transpose(1, 2)  # [B, H, Q, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=call.mask, is_causal=call.is_causal, scale=scale, enable_gqa=gqa
        )
        out[call.rows[call.valid]] = o.transpose(1, 2)[call.valid]
    return out
