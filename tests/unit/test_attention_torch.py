"""The torch backend's fast decode path against the padded reference, on fresh random data."""

import pytest
import torch

from cluster.engine.attention import paged_decode_attention_blockwise, paged_decode_attention_ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 4])
def test_blockwise_decode_matches_padded_reference(dtype, tol, group):
    torch.manual_seed(0)
    block_size, kv_heads, head_dim, num_blocks = 16, 2, 32, 64
    seq_lens = (1, 16, 17, 100, 333)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    perm = torch.randperm(num_blocks)  # shuffled, non-contiguous block ids
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor(seq_lens), scale)
    got = paged_decode_attention_blockwise(q * scale, k_cache, v_cache, tables, seq_lens)
    assert torch.allclose(got.float(), ref.float(), atol=tol, rtol=tol)
