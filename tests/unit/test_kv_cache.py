"""The CPU KV pool: zeroed, shaped, aligned, and its memory backed when it is allocated, not by the first steps."""

import os

import pytest
import torch

from cluster.engine import kv_cache
from cluster.engine.kv_cache import allocate_kv_cache
from cluster.kv_layout import KVLayout


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_pool_is_zeroed_writable_and_shaped(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype, num_blocks=6)
    kv = allocate_kv_cache(layout)
    assert kv.shape == layout.blocks_shape(6)
    assert kv.dtype == getattr(torch, dtype) and kv.is_contiguous()
    assert kv.data_ptr() % 64 == 0  # what vectorised kernels want
    assert not kv.any()
    kv[1, 0, 3] = 1.5
    assert kv.sum().item() == 1.5 * 4 * 2 * 8


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_a_large_pool_is_backed_when_allocated():
    # The first steps must not pay the pool's page faults (python -m bench.kv_first_touch).
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32", num_blocks=1024)
    nbytes = 4 * 2 * 1024 * 16 * 4 * 64 * 4  # 128 MiB
    before = _rss_bytes()
    kv = allocate_kv_cache(layout)
    assert _rss_bytes() - before > nbytes * 0.95
    assert not kv.any()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_a_kernel_without_populate_advice_still_gets_a_backed_pool(monkeypatch):
    # Before Linux 5.14 (and off Linux) madvise cannot back the pages: one write per page does it instead.
    monkeypatch.setattr(kv_cache, "_populate_writable", lambda address, nbytes: False)
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32", num_blocks=1024)
    nbytes = 2 * 2 * 1024 * 16 * 4 * 64 * 4  # 64 MiB
    before = _rss_bytes()
    kv = kv_cache.start_kv_cache(layout).result()
    assert _rss_bytes() - before > nbytes * 0.95
    assert not kv.any()
