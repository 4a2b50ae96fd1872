"""Attention over the paged KV cache: the backend interface, its metadata, the torch references
and the torch backend.

The ``*_ref`` functions are plain padded torch: the oracle every backend (the torch backend's
fast paths, the Triton kernels) is tested against. The torch backend is the CPU default.
A backend does two things per layer: write this step's new K/V into their slots, then attend
each query token to its sequence's cached context (prefix + this step's tokens).

Batch order contract (built by the model runner): sequences that decode one token come
first, then sequences that prefill a chunk. Tokens of sequence i are
``query[query_start_loc[i]:query_start_loc[i+1]]``; the last ``query_len`` positions of
its ``seq_len`` context are the queries (causal within the chunk).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cluster.engine.sdpa_attention import GatherBuffer, paged_attention_sdpa

log = logging.getLogger(__name__)

try:  # numba compiles the CPU decode kernel; without it, decodes run through SDPA too.
    from cluster.engine import cpu_decode as _cpu_decode

    _CPU_DECODE_UNAVAILABLE = ""
except ImportError as _e:  # pragma: no cover - numba is a declared dependency
    _cpu_decode = None
    _CPU_DECODE_UNAVAILABLE = f"numba cannot be imported ({_e})"


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
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_dim] -> output of the same shape. Does not modify the caches."""

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


def probe_cpu_decode_kernel() -> str:
    """Compiles the float32 CPU decode kernel (or loads it from numba's disk cache) and checks it against
    the reference on fresh random inputs. Returns "" if it can be used, else why not."""
    if _cpu_decode is None:
        return _CPU_DECODE_UNAVAILABLE
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 16, 2, 32, generator=g).unbind(0)  # [blocks, block_size, kv_heads, dim]
    query = torch.randn(2, 4, 32, generator=g)
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    try:
        got = _cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, 0.2)
    except Exception as e:  # noqa: BLE001 - numba/LLVM failures come in many types
        return f"{type(e).__name__}: {e}"
    want = paged_decode_attention_ref(query, k_cache, v_cache, tables, seq_lens, 0.2)
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        return f"its output differs from the reference by {float((got - want).abs().max()):.2e}"
    return ""


class TorchAttentionBackend:
    """The CPU default, with no per-request loops: float32 decodes go to the compiled paged decode
    kernel (``cpu_decode``) where it compiles and checks out, everything else to fused SDPA over
    length buckets (``sdpa_attention``)."""

    name = "torch"

    def __init__(self) -> None:
        self._gather_buffer = GatherBuffer()
        #: None until probed (at warm_up, or at the first float32 CPU decode).
        self._decode_kernel_ok: bool | None = None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def warm_up(self, k_cache, v_cache) -> None:
        # Compiling the decode kernel takes ~7 s the first time (then it loads from numba's on-disk
        # cache in ~0.3 s): pay it at start-up, where a failure also degrades to SDPA before any request.
        query = torch.zeros(1, k_cache.shape[2], k_cache.shape[3], dtype=k_cache.dtype, device=k_cache.device)
        self._uses_decode_kernel(query, k_cache)

    def _uses_decode_kernel(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if _cpu_decode is None or not _cpu_decode.supports(query, k_cache):
            return False
        if self._decode_kernel_ok is None:
            why_not = probe_cpu_decode_kernel()
            if why_not:
                log.warning("the compiled CPU decode kernel is unavailable (%s); decodes run through SDPA", why_not)
            self._decode_kernel_ok = not why_not
        return self._decode_kernel_ok

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        query_lens = meta.query_lens_list or tuple((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist())
        seq_lens = meta.seq_lens_list or tuple(meta.seq_lens.tolist())
        nd = meta.num_decodes if self._uses_decode_kernel(query, k_cache) else 0
        if nd == 0:
            return paged_attention_sdpa(
                query, k_cache, v_cache, meta.block_tables, query_lens, seq_lens, scale, buffer=self._gather_buffer
            )
        out = torch.empty_like(query)
        out[:nd] = _cpu_decode.paged_decode_attention_cpu(
            query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
        )
        if nd < meta.num_seqs:
            out[nd:] = paged_attention_sdpa(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                query_lens[nd:],
                seq_lens[nd:],
                scale,
                buffer=self._gather_buffer,
            )
        return out


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
