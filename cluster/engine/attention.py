"""Attention over the paged KV cache: the backend interface, its metadata, and the torch backend.

The torch backend is the CPU default and the oracle every other backend (Triton) is tested
against. A backend does two things per layer: write this step's new K/V into their slots,
then attend each query token to its sequence's cached context (prefix + this step's tokens).

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
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatters key/value [num_tokens, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads, head_dim]."""

    def attend(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape. Does not modify the caches."""


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


def paged_decode_attention_blockwise(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_list: tuple[int, ...],
) -> torch.Tensor:
    """Decode attention without padding to the longest context (the CPU default's fast path).

    Gathers only the blocks each sequence uses, runs one small matmul per block against its
    sequence's query, and combines blocks with a segment softmax. Returns [num_seqs, num_heads, head_dim]
    *unscaled by 1/sqrt(d)*: callers pass ``query`` already scaled.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // kv_heads
    device = query.device
    blocks_per_seq = [-(-n // block_size) for n in seq_lens_list]
    counts = torch.tensor(blocks_per_seq, device=device)
    seq_of_block = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts)  # [NB]
    first = torch.cumsum(counts, 0) - counts
    block_index = torch.arange(int(counts.sum()), device=device) - first[seq_of_block]  # block's index in its sequence
    block_ids = block_tables[seq_of_block, block_index].long()
    compute = torch.float32
    # index_select is several times faster than advanced indexing for whole-block gathers on CPU.
    k = torch.index_select(k_cache, 0, block_ids).to(compute)  # [NB, bs, Hkv, D]
    v = torch.index_select(v_cache, 0, block_ids).to(compute)
    num_gathered = block_ids.shape[0]
    q = query.to(compute).view(num_seqs, kv_heads * group, head_dim)[seq_of_block]  # [NB, Hkv*G, D]
    # A gathered block is a contiguous [bs*Hkv, D] matrix. Multiplying it against every head and
    # keeping the matching-head diagonal costs Hkv x the flops of per-head matmuls but avoids
    # copying permuted K/V, which dominated the time on CPU.
    all_heads = torch.bmm(q, k.view(num_gathered, block_size * kv_heads, head_dim).transpose(1, 2))
    scores = torch.diagonal(all_heads.view(num_gathered, kv_heads, group, block_size, kv_heads), dim1=1, dim2=4)
    scores = scores.permute(0, 3, 1, 2)  # [NB, Hkv, G, bs]
    # Only a sequence's last block can be partly filled.
    pos = block_index[:, None] * block_size + torch.arange(block_size, device=device)[None, :]
    seq_lens = torch.tensor(seq_lens_list, device=device)
    scores = scores.masked_fill((pos >= seq_lens[seq_of_block][:, None])[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1)  # [NB, Hkv, G]
    seq_max = torch.full((num_seqs, kv_heads, group), float("-inf"), device=device)
    seq_max.scatter_reduce_(0, seq_of_block[:, None, None].expand_as(block_max), block_max, reduce="amax")
    probs = torch.exp(scores - seq_max[seq_of_block][..., None])  # [NB, Hkv, G, bs]
    denom = torch.zeros(num_seqs, kv_heads, group, device=device).index_add_(0, seq_of_block, probs.sum(-1))
    # Block-diagonal probabilities (zero across heads) against the contiguous V block.
    probs_all = torch.zeros(num_gathered, kv_heads, group, block_size, kv_heads, device=device)
    torch.diagonal(probs_all, dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 1))
    partial = torch.bmm(
        probs_all.view(num_gathered, kv_heads * group, block_size * kv_heads),
        v.view(num_gathered, block_size * kv_heads, head_dim),
    ).view(num_gathered, kv_heads, group, head_dim)
    out = torch.zeros(num_seqs, kv_heads, group, head_dim, device=device).index_add_(0, seq_of_block, partial)
    return (out / denom[..., None]).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


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
    num_seqs = seq_lens.shape[0]
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


class TorchAttentionBackend:
    """Reference backend, the CPU default: batched torch ops, no per-sequence Python loops."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        outputs = []
        if nd:
            seq_lens = meta.seq_lens_list[:nd] if meta.seq_lens_list else tuple(meta.seq_lens[:nd].tolist())
            outputs.append(
                paged_decode_attention_blockwise(query[:nd] * scale, k_cache, v_cache, meta.block_tables[:nd], seq_lens)
            )
        if meta.num_prefills:
            pre_lens = meta.seq_lens_list[nd:] if meta.seq_lens_list else None
            outputs.append(
                paged_prefill_attention_ref(
                    query[nd:],
                    k_cache,
                    v_cache,
                    meta.block_tables[nd:],
                    meta.query_start_loc[nd:] - nd,
                    meta.seq_lens[nd:],
                    scale,
                    meta.query_lens_list[nd:] if meta.query_lens_list else None,
                    max(pre_lens) if pre_lens else None,
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


_BACKENDS: dict[str, type] = {"torch": TorchAttentionBackend}


def register_backend(name: str, cls: type) -> None:
    _BACKENDS[name] = cls


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """``auto`` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if str(device).startswith("cuda") else "torch"
    if name == "triton" and "triton" not in _BACKENDS:
        # Imported lazily: triton is optional on CPU-only hosts.
        from cluster.kernels import backend as _triton_backend  # noqa: F401  (registers itself)
    return _BACKENDS[name]()
