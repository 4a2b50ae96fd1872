"""Triton kernels against the torch references in cluster/engine/attention.py.

Fresh random inputs (never zeros), outputs poisoned with NaN before each run, shuffled and
non-contiguous block ids. Cases cover each axis (block size, head dim, GQA ratio, dtype,
split-K partitioning, ragged lengths) without the full cartesian product: the interpreter
is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cluster.engine.attention import get_attention_backend
from cluster.engine.attention.base import (
    AttentionMetadata,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)
from cluster.engine.attention.torch_backend import TorchAttentionBackend
from cluster.engine.attention.triton import decode
from cluster.engine.attention.triton._common import check_device, interpreting
from cluster.engine.attention.triton.backend import TritonAttentionBackend
from cluster.engine.attention.triton.decode import (
    NARROW_TILE,
    WIDE_TILE,
    _decode_partition_kernel,
    choose_partition_size,
    paged_decode_attention,
)
from cluster.engine.attention.triton.kv_write import write_kv
from cluster.engine.attention.triton.prefill import paged_prefill_attention

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS = 2
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: dict(atol=2e-5, rtol=1e-5), F16: dict(atol=4e-3, rtol=4e-3), BF16: dict(atol=3e-2, rtol=2e-2)}


def test_runs_natively_or_interpreted():
    # A CPU run needs the interpreter; the conftest sets it before the triton kernels are imported.
    assert DEVICE == "cuda" or interpreting(_decode_partition_kernel)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, g, *, strided=False) -> torch.Tensor:
    """Random tensor; ``strided`` makes it a view with padded rows and heads (like a slice of a fused qkv)."""
    if strided:
        big = torch.randn((shape[0], shape[1] + 3, shape[2]), generator=g).to(dtype)
        return big[:, 1 : 1 + shape[1]].to(DEVICE)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _paged_context(seq_lens, block_size, head_dim, dtype, g, spare_blocks=3):
    """Random caches and block tables whose block ids are shuffled (never 0..n in order), 0-padded."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache = _randn((num_blocks, block_size, KV_HEADS, head_dim), dtype, g)
    v_cache = _randn((num_blocks, block_size, KV_HEADS, head_dim), dtype, g)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = ids[used : used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, tables.to(DEVICE)


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# ---- KV write ----


@pytest.mark.parametrize(
    "block_size,head_dim,src_dtype,cache_dtype",
    [(16, 64, F32, F32), (32, 128, BF16, BF16), (16, 128, F16, F16), (32, 64, F32, BF16)],
)
def test_write_kv_matches_reference(block_size, head_dim, src_dtype, cache_dtype):
    g = _gen(1)
    num_blocks, num_tokens = 6, 2 * block_size + 3
    k_cache = _randn((num_blocks, block_size, KV_HEADS, head_dim), cache_dtype, g)
    v_cache = _randn((num_blocks, block_size, KV_HEADS, head_dim), cache_dtype, g)
    key = _randn((num_tokens, KV_HEADS, head_dim), src_dtype, g, strided=True)
    value = _randn((num_tokens, KV_HEADS, head_dim), src_dtype, g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    write_kv(key, value, k_cache, v_cache, slots)
    # Exact: a copy (with the same rounding), and every slot not written stays as it was.
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


def test_write_kv_skips_negative_slots():
    g = _gen(2)
    k_cache = _randn((2, 16, KV_HEADS, 64), F32, g)
    v_cache = _randn((2, 16, KV_HEADS, 64), F32, g)
    before = k_cache.clone(), v_cache.clone()
    key, value = _randn((2, KV_HEADS, 64), F32, g), _randn((2, KV_HEADS, 64), F32, g)
    write_kv(key, value, k_cache, v_cache, torch.tensor([-1, 5], device=DEVICE))
    assert torch.equal(k_cache[0, 5], key[1]) and torch.equal(v_cache[0, 5], value[1])
    k_cache[0, 5], v_cache[0, 5] = before[0][0, 5], before[1][0, 5]
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ---- decode ----

# (block_size, head_dim, group, dtype, partition_size); None = the default (one partition here).
DECODE_CASES = [
    (16, 64, 1, F32, None),
    (16, 64, 4, F16, 32),
    (32, 128, 8, BF16, 32),
    (32, 64, 4, F32, 16),
    (16, 128, 8, F32, 64),
    (16, 64, 8, BF16, None),
    (32, 128, 1, F16, 16),
]


@pytest.mark.parametrize("block_size,head_dim,group,dtype,partition_size", DECODE_CASES)
def test_decode_matches_reference(block_size, head_dim, group, dtype, partition_size):
    g = _gen(10 + block_size + head_dim + group)
    # 1 token, exactly one block, one past a block boundary, a few blocks plus a tail.
    seq_lens = [1, block_size, block_size + 1, 2 * block_size + 5]
    k_cache, v_cache, tables = _paged_context(seq_lens, block_size, head_dim, dtype, g)
    query = _randn((len(seq_lens), KV_HEADS * group, head_dim), dtype, g, strided=True)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, scale)
    out = _nan_like(ref)
    paged_decode_attention(
        query, k_cache, v_cache, tables, lens, scale, max(seq_lens), out=out, partition_size=partition_size
    )
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype,partition_size", [(BF16, None), (F16, 64), (F32, 128)])
def test_decode_wide_tile_matches_reference(dtype, partition_size):
    # 64 positions per tile (what a GPU runs for 16-bit queries where it does not spill), over contexts that end
    # mid-tile, fill one, and span several partitions.
    g = _gen(77)
    seq_lens = [5, 64, 64 + 16 + 3, 3 * 64 + 40]
    k_cache, v_cache, tables = _paged_context(seq_lens, 16, 64, dtype, g)
    query = _randn((len(seq_lens), KV_HEADS * 4, 64), dtype, g, strided=True)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, 0.125)
    out = _nan_like(ref)
    paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.125, max(seq_lens), out=out, partition_size=partition_size, tile_n=64
    )
    torch.testing.assert_close(out, ref, **TOL[dtype])


class _Compiled:
    def __init__(self, n_spills: int):
        self.n_spills = n_spills


def test_decode_keeps_the_wide_tile_only_where_it_does_not_spill(monkeypatch, caplog):
    monkeypatch.setattr(decode, "_tile_for", {})
    decode._keep_tile(("fits",), WIDE_TILE, _Compiled(0))
    with caplog.at_level("INFO", logger=decode.__name__):
        decode._keep_tile(("spills",), WIDE_TILE, _Compiled(96))
    decode._keep_tile(("interpreted",), NARROW_TILE, None)  # the interpreter's launch returns no compiled kernel
    assert decode._tile_for == {("fits",): WIDE_TILE, ("spills",): NARROW_TILE, ("interpreted",): NARROW_TILE}
    assert "64 positions per tile spill 96 bytes" in caplog.text and "using 32" in caplog.text


def test_decode_tries_the_wide_tile_once_per_variant(monkeypatch):
    # A 16-bit GPU query starts at 64; the kept choice is reused, not tried again. Where the variant spilled, the
    # next launch runs 32.
    launched: list[int] = []

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, TILE_N, **kwargs):
                launched.append(TILE_N)
                return _Compiled(128 if TILE_N == WIDE_TILE else 0)

            return launch

    monkeypatch.setattr(decode, "_tile_for", {})
    monkeypatch.setattr(decode, "_decode_partition_kernel", Launcher())
    monkeypatch.setattr(decode, "check_device", lambda *a: None)
    monkeypatch.setattr(decode, "_first_tile", lambda q: WIDE_TILE)
    args = _small()
    for _ in range(3):
        paged_decode_attention(**args, scale=0.125, max_seq_len=20, partition_size=128)
    assert launched == [WIDE_TILE, NARROW_TILE, NARROW_TILE]


def test_decode_split_matches_single_partition():
    # Many partitions (including ones past a short sequence's end) merge to the one-pass result.
    g = _gen(3)
    seq_lens = [3, 100]
    k_cache, v_cache, tables = _paged_context(seq_lens, 16, 64, F32, g)
    query = _randn((2, 4, 64), F32, g)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    one = paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, 100, out=_nan_like(query))
    split = paged_decode_attention(
        query, k_cache, v_cache, tables, lens, 0.125, 100, out=_nan_like(query), partition_size=16
    )
    torch.testing.assert_close(split, one, atol=1e-5, rtol=1e-5)


def test_partition_size_fills_the_gpu_only_when_needed():
    # 64 x 8 programs already cover 132 SMs twice: the largest partitions.
    assert choose_partition_size(64, 8, 2048, 132) == 1024
    # One sequence, 8 kv heads: split 2048 positions into ~33 partitions -> 64, clamped to 128.
    assert choose_partition_size(1, 8, 2048, 132) == 128
    assert choose_partition_size(4, 8, 4096, 132) == 512  # 9 partitions of 456 -> 512
    assert choose_partition_size(8, 4, 2048, 132) == 256  # 9 partitions of 228 -> 256
    assert choose_partition_size(1, 8, 2048, None) == 1024  # CPU / interpreter


# ---- prefill ----

# (block_size, head_dim, group, dtype)
PREFILL_CASES = [
    (16, 64, 1, F32),
    (16, 128, 4, F16),
    (32, 64, 8, BF16),
    (32, 128, 4, F32),
    (16, 64, 8, F16),
    (32, 64, 1, BF16),
]


@pytest.mark.parametrize("block_size,head_dim,group,dtype", PREFILL_CASES)
def test_prefill_matches_reference(block_size, head_dim, group, dtype):
    g = _gen(20 + block_size + head_dim + group)
    bs = block_size
    # (seq_len, query_len): a 1-token prompt; exactly one block; one past a block boundary;
    # a cached prefix with a chunk crossing a boundary; a 1-token chunk after a prefix; a short chunk
    # after a 3-block prefix.
    pairs = [(1, 1), (bs, bs), (bs + 1, bs + 1), (2 * bs + 3, bs + 1), (bs + 1, 1), (3 * bs + 5, 5)]
    seq_lens = [s for s, _ in pairs]
    query_lens = [q for _, q in pairs]
    k_cache, v_cache, tables = _paged_context(seq_lens, block_size, head_dim, dtype, g)
    query = _randn((sum(query_lens), KV_HEADS * group, head_dim), dtype, g, strided=True)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, starts, lens, scale)
    out = _nan_like(ref)
    paged_prefill_attention(query, k_cache, v_cache, tables, starts, lens, scale, max(query_lens), out=out)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_prefill_long_chunk_spans_query_blocks():
    # 70 queries with group 4 take several query blocks; block_m=16 forces 4 tokens per block.
    g = _gen(4)
    seq_lens, _query_lens = [90, 7], [70, 7]
    k_cache, v_cache, tables = _paged_context(seq_lens, 16, 64, F32, g)
    query = _randn((77, 8, 64), F32, g)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 70, 77], dtype=torch.int32, device=DEVICE)
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, starts, lens, 0.125)
    out = paged_prefill_attention(
        query, k_cache, v_cache, tables, starts, lens, 0.125, 70, out=_nan_like(ref), block_m=16
    )
    torch.testing.assert_close(out, ref, **TOL[F32])


# ---- the backend ----


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_backend_matches_torch_backend_on_mixed_batch(dtype):
    """Decodes first, then prefills with cached prefixes; write_kv then attend, like one model layer."""
    g = _gen(5)
    block_size, head_dim, group = 16, 64, 4
    decode_lens = [1, 17, 40]
    prefill = [(16, 16), (35, 6), (20, 3)]  # (seq_len, query_len)
    seq_lens = decode_lens + [s for s, _ in prefill]
    query_lens = [1] * len(decode_lens) + [q for _, q in prefill]
    k_cache, v_cache, tables = _paged_context(seq_lens, block_size, head_dim, dtype, g)
    num_tokens = sum(query_lens)
    # The new tokens' slots: the last query_len positions of each sequence.
    slots = []
    for i, (s, q) in enumerate(zip(seq_lens, query_lens, strict=False)):
        for p in range(s - q, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=len(decode_lens),
        seq_lens_list=tuple(seq_lens),
        query_lens_list=tuple(query_lens),
    )
    query = _randn((num_tokens, KV_HEADS * group, head_dim), dtype, g)
    key = _randn((num_tokens, KV_HEADS, head_dim), dtype, g)
    value = _randn((num_tokens, KV_HEADS, head_dim), dtype, g)

    triton_backend = get_attention_backend("triton", DEVICE)
    assert isinstance(triton_backend, TritonAttentionBackend) and triton_backend.name == "triton"
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().write_kv(key, value, k_ref, v_ref, meta.slot_mapping)
    triton_backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    ref = TorchAttentionBackend().attend(query, k_ref, v_ref, meta, head_dim**-0.5)
    out = triton_backend.attend(query, k_cache, v_cache, meta, head_dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


# ---- wrapper validation ----


def _small(dtype=F32):
    g = _gen(6)
    k_cache, v_cache, tables = _paged_context([5, 20], 16, 64, dtype, g)
    return dict(
        query=_randn((2, 4, 64), dtype, g),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        seq_lens=torch.tensor([5, 20], dtype=torch.int32, device=DEVICE),
    )


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: a.update(query=a["query"][..., :32]), r"query has shape \[2, 4, 32\], expected \[\*, \*, 64\]"),
        (lambda a: a.update(query=a["query"][:, :3]), r"num_heads \(3\) must be a multiple"),
        (lambda a: a.update(query=a["query"].half()), "query has dtype float16 but k_cache has float32"),
        (lambda a: a.update(query=a["query"].int()), "query has dtype int32, expected one of"),
        (lambda a: a.update(block_tables=a["block_tables"].float()), "block_tables has dtype float32"),
        (lambda a: a.update(seq_lens=a["seq_lens"][:1]), r"seq_lens has shape \[1\], expected \[2\]"),
        (lambda a: a.update(v_cache=a["v_cache"][:, :8]), "v_cache has shape"),
        (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "stride 1"),
        (lambda a: a.update(partition_size=48), "partition_size must be a power of two"),
        (lambda a: a.update(tile_n=8), "tile_n must be a power of two >= 16"),
        (lambda a: a.update(max_seq_len=100), "fewer than max_seq_len 100"),
        (lambda a: a.update(out=torch.empty(2, 4, 64, dtype=F16, device=DEVICE)), "out has dtype float16"),
    ],
)
def test_decode_wrapper_rejects_bad_arguments(change, message):
    args = _small()
    args.update(scale=0.125, max_seq_len=20)
    change(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def test_prefill_wrapper_rejects_bad_arguments():
    a = _small()
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"query_start_loc has shape \[2\], expected \[3\]"):
        paged_prefill_attention(
            a["query"], a["k_cache"], a["v_cache"], a["block_tables"], starts[:2], a["seq_lens"], 1.0, 1
        )
    with pytest.raises(ValueError, match="block_tables has shape"):
        paged_prefill_attention(
            a["query"], a["k_cache"], a["v_cache"], a["block_tables"][:1], starts, a["seq_lens"], 1.0, 1
        )
    with pytest.raises(ValueError, match="max_query_len must be >= 1"):
        paged_prefill_attention(
            a["query"], a["k_cache"], a["v_cache"], a["block_tables"], starts, a["seq_lens"], 1.0, 0
        )


def test_write_kv_wrapper_rejects_bad_arguments():
    a = _small()
    key = torch.randn(3, KV_HEADS, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"key has shape \[3, 2, 32\], expected \[\*, 2, 64\]"):
        write_kv(key[..., :32], key, a["k_cache"], a["v_cache"], slots)
    with pytest.raises(ValueError, match=r"value has shape \[2, 2, 64\], expected \[3, 2, 64\]"):
        write_kv(key, key[:2], a["k_cache"], a["v_cache"], slots)
    with pytest.raises(ValueError, match="slot_mapping has dtype float32"):
        write_kv(key, key, a["k_cache"], a["v_cache"], slots.float())
    with pytest.raises(ValueError, match="v_cache has dtype float16"):
        write_kv(key, key, a["k_cache"], a["v_cache"].half(), slots)


def test_cpu_tensors_without_interpreter_are_rejected():
    # A kernel compiled for the GPU cannot take CPU tensors; the message says how to run on CPU.
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_device(object(), torch.zeros(1))


# ---- native compilation ----


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter is lenient; ptxas is not. Compiles every kernel to an sm_90 cubin, without spills."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_sm90"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 10, proc.stdout
    assert all("STACK:0" in line for line in lines), f"register spills:\n{proc.stdout}"
