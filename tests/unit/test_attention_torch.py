"""The torch backend's fast paths (compiled CPU decode kernel, bucketed SDPA) against the padded
references, on fresh random data with shuffled block ids."""

import os
import subprocess
import sys

import pytest
import torch

from cluster.engine.attention.base import (
    AttentionMetadata,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from cluster.engine.attention.cpu_decode import paged_decode_attention_cpu, supports
from cluster.engine.attention.native_decode import paged_decode_attention_native
from cluster.engine.attention.sdpa import GatherBuffer, length_buckets, paged_attention_sdpa
from cluster.engine.attention.torch_backend import TorchAttentionBackend

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def paged_context(seq_lens, block_size, kv_heads, head_dim, dtype, seed=0):
    """Random caches and 0-padded block tables with shuffled, non-contiguous block ids."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = ids[used : used + n]
        used += n
    return k_cache, v_cache, tables, g


DECODE_KERNELS = {"numba": paged_decode_attention_cpu, "native": paged_decode_attention_native}


@pytest.mark.parametrize("kernel", sorted(DECODE_KERNELS))
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (16, 32, 4), (32, 128, 2), (8, 64, 8), (7, 80, 2)])
@pytest.mark.parametrize("batch", ["many", "one"])  # the parallel kernel, and the serial one a single sequence takes
def test_cpu_decode_kernel_matches_reference(kernel, block_size, head_dim, group, batch):
    kv_heads = 2
    seq_lens = [1, block_size, block_size + 1, 333, 7] if batch == "many" else [333]
    k_cache, v_cache, tables, g = paged_context(seq_lens, block_size, kv_heads, head_dim, torch.float32)
    # A strided query, as sliced out of a fused qkv projection.
    query = torch.randn(len(seq_lens), kv_heads * group + 3, head_dim, generator=g)[:, 1 : 1 + kv_heads * group]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(query, k_cache, v_cache, tables, lens, scale)
    got = DECODE_KERNELS[kernel](query, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_cpu_decode_kernel_refuses_what_it_cannot_run():
    k_cache, v_cache, tables, _ = paged_context([5], 16, 2, 32, torch.bfloat16)
    query = torch.randn(1, 4, 32).bfloat16()
    assert not supports(query, k_cache)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention_cpu(query, k_cache, v_cache, tables, torch.tensor([5]), 0.1)


# Decodes, prompts without a cached prefix, chunks continuing after a prefix, and tiny prompts
# that the bucketing groups together.
RAGGED = [(1, 40), (1, 300), (1, 33), (17, 17), (90, 90), (5, 69), (40, 200), (3, 3), (4, 4), (2, 2), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_bucketed_sdpa_matches_reference(dtype, group):
    kv_heads, head_dim, block_size = 2, 32, 16
    query_lens = [q for q, _ in RAGGED]
    seq_lens = [t for _, t in RAGGED]
    k_cache, v_cache, tables, g = paged_context(seq_lens, block_size, kv_heads, head_dim, dtype, seed=group)
    query = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, starts, torch.tensor(seq_lens), scale)
    got = paged_attention_sdpa(query, k_cache, v_cache, tables, query_lens, seq_lens, scale)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("group", [1, 4])
def test_prompts_computed_whole_attend_over_the_steps_own_kv(group):
    """A lone prompt with nothing cached reads its K/V from the step's new rows, not from its blocks: with those
    blocks zeroed afterwards, the output still equals the reference's over the intact caches. Every other
    sequence (decodes, chunks after a prefix, tiny prompts sharing a call) still reads the caches."""
    from cluster.engine.attention.sdpa import _plan

    kv_heads, head_dim, block_size = 2, 32, 16
    query_lens = [q for q, _ in RAGGED]
    seq_lens = [t for _, t in RAGGED]
    k_cache, v_cache, tables, g = paged_context(seq_lens, block_size, kv_heads, head_dim, torch.float32, seed=5)
    query = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    ref = paged_prefill_attention_ref(query, k_cache, v_cache, tables, starts, torch.tensor(seq_lens), scale)
    # The step's new rows, as the model has them: each sequence's last query_len positions.
    positions = torch.cat([torch.arange(t - q, t) for q, t in zip(query_lens, seq_lens, strict=True)])
    seq_of_row = torch.repeat_interleave(torch.arange(len(RAGGED)), torch.tensor(query_lens))
    blocks = tables[seq_of_row, positions // block_size].long()
    key, value = k_cache[blocks, positions % block_size], v_cache[blocks, positions % block_size]
    overhead = 6e6 / (4 * kv_heads * group * head_dim)
    lone = [c for c in _plan(tuple(query_lens), tuple(seq_lens), block_size, overhead, query.device) if c.is_causal]
    assert lone  # (90, 90) runs alone; the short prompts share calls
    for call in lone:
        seq = int(call.seqs[0])
        k_cache[tables[seq, : call.num_blocks].long()] = 0
        v_cache[tables[seq, : call.num_blocks].long()] = 0
    got = paged_attention_sdpa(query, k_cache, v_cache, tables, query_lens, seq_lens, scale, fresh_kv=(key, value))
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_length_buckets_group_short_work_and_leave_long_prompts_alone():
    # Decodes whose contexts differ by less than a call's overhead share a call; a long decode
    # does not pad the others; each long prompt runs alone (causal); three tiny prompts share one.
    query_lens = [1, 1, 1, 1, 300, 200, 4, 3, 4]
    seq_lens = [100, 120, 110, 2000, 300, 200, 4, 3, 4]
    assert length_buckets(query_lens, seq_lens, call_overhead_pairs=1000) == [[7, 6, 8], [0, 2, 1], [5], [4], [3]]
    # With no call overhead every sequence is cheapest alone.
    assert length_buckets([1, 1], [10, 11], call_overhead_pairs=0) == [[0], [1]]
    assert length_buckets([], [], call_overhead_pairs=1000) == []


def test_gather_buffer_is_reused_until_it_must_grow():
    buf, like = GatherBuffer(), torch.empty(0)
    first = buf.take(100, like)
    assert buf.take(60, like).data_ptr() == first.data_ptr()
    grown = buf.take(1000, like)
    assert grown.numel() == 1000
    assert buf.take(10, torch.empty(0, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_runs_a_mixed_step_like_the_references(dtype):
    """Decodes first, then prefill chunks, as the model runner lays them out."""
    kv_heads, group, head_dim, block_size = 2, 2, 32, 16
    query_lens = [1, 1, 1, 20, 64]
    seq_lens = [5, 70, 16, 20, 100]
    k_cache, v_cache, tables, g = paged_context(seq_lens, block_size, kv_heads, head_dim, dtype, seed=7)
    query = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=3,
        seq_lens_list=tuple(seq_lens),
        query_lens_list=tuple(query_lens),
    )
    scale = head_dim**-0.5
    got = TorchAttentionBackend().attend(query, k_cache, v_cache, meta, scale)
    ref_decode = paged_decode_attention_ref(query[:3], k_cache, v_cache, tables[:3], meta.seq_lens[:3], scale)
    ref_prefill = paged_prefill_attention_ref(
        query[3:], k_cache, v_cache, tables[3:], starts[3:] - 3, meta.seq_lens[3:], scale
    )
    torch.testing.assert_close(got, torch.cat([ref_decode, ref_prefill]), **TOL[dtype])


def test_every_layer_of_a_step_reuses_the_steps_sdpa_plan():
    from cluster.engine.attention.sdpa import _plan

    query_lens, seq_lens = [1, 1, 30], [40, 50, 30]
    k_cache, v_cache, tables, g = paged_context(seq_lens, 16, 2, 32, torch.float32, seed=3)
    query = torch.randn(sum(query_lens), 4, 32, generator=g)
    paged_attention_sdpa(query, k_cache, v_cache, tables, query_lens, seq_lens, 0.2)
    misses = _plan.cache_info().misses
    for _ in range(3):  # the step's other layers
        paged_attention_sdpa(query, k_cache, v_cache, tables, query_lens, seq_lens, 0.2)
    assert _plan.cache_info().misses == misses


def test_warm_up_compiles_the_numba_decode_kernel_without_the_host_built_one():
    """Run where nothing has launched the kernel yet, so only warm_up can have compiled it; the host-built
    kernels are switched off, as on a host without a compiler."""
    code = (
        "import torch\n"
        "from cluster.engine.attention.torch_backend import TorchAttentionBackend\n"
        "from cluster.engine.attention.cpu_decode import _decode_parallel, _decode_serial\n"
        "assert not _decode_parallel.signatures and not _decode_serial.signatures\n"
        "cache = torch.randn(4, 16, 2, 32)\n"
        "TorchAttentionBackend().warm_up(cache, cache)\n"
        "print(len(_decode_parallel.signatures), len(_decode_serial.signatures))\n"
    )
    env = dict(os.environ, SHAPESERVE_NATIVE_KERNELS="0")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1 1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warm_up_leaves_the_caches_alone(dtype):
    k_cache, v_cache, _, _ = paged_context([40], 16, 2, 32, dtype)
    before = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().warm_up(k_cache, v_cache)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
