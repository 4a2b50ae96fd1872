"""Block pool: exact block ids, ref counts, eviction order; integrity after every test."""

import pytest

from cluster.engine.block_pool import BlockPool
from cluster.prefix_hash import hash_block, hash_full_blocks


@pytest.fixture
def pool():
    p = BlockPool(num_blocks=6)
    yield p
    p.check_integrity()


def test_allocate_takes_lowest_never_used_ids_first(pool):
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert [pool.ref_count(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.num_free_blocks == 1


def test_allocate_returns_none_when_short_and_changes_nothing(pool):
    pool.allocate(5)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [5]


def test_release_is_tail_first_so_prefix_tails_evict_first(pool):
    ids = pool.allocate(3)  # [0, 1, 2]
    hashes = hash_full_blocks(list(range(48)), 16)
    pool.cache_blocks(ids, hashes)
    pool.release(ids)
    # never-used 3,4,5 go first, then the freed ones tail first: 2, 1, 0
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.num_evictions == 1
    assert pool.lookup_prefix(hashes) == [0, 1]  # block 2's hash was evicted, the chain stops there


def test_prefix_hit_adds_reference_and_protects_from_eviction(pool):
    a = pool.allocate(2)
    hashes = hash_full_blocks(list(range(32)), 16)
    pool.cache_blocks(a, hashes)
    pool.release(a)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 2
    hit = pool.lookup_prefix(hashes)
    assert hit == [0, 1]
    pool.acquire_cached(hit)
    assert [pool.ref_count(i) for i in hit] == [1, 1]
    assert pool.allocate(4) == [2, 3, 4, 5]  # cached blocks in use are not evictable
    assert pool.allocate(1) is None


def test_shared_blocks_need_every_reference_released(pool):
    a = pool.allocate(1)
    pool.cache_blocks(a, hash_full_blocks(list(range(16)), 16))
    pool.acquire_cached(a)
    assert pool.ref_count(0) == 2
    pool.release(a)
    assert pool.ref_count(0) == 1 and pool.num_free_blocks == 5
    pool.release(a)
    assert pool.ref_count(0) == 0 and pool.num_free_blocks == 6


def test_double_release_is_an_error(pool):
    a = pool.allocate(1)
    pool.release(a)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a)


def test_lru_order_across_requests(pool):
    first = pool.allocate(1)
    second = pool.allocate(1)
    pool.cache_blocks(first, [hash_block(None, [1] * 16)])
    pool.cache_blocks(second, [hash_block(None, [2] * 16)])
    pool.release(first)  # freed earlier -> evicted earlier
    pool.release(second)
    assert pool.allocate(5) == [2, 3, 4, 5, 0]
    assert pool.lookup_prefix([hash_block(None, [2] * 16)]) == [1]
    assert pool.lookup_prefix([hash_block(None, [1] * 16)]) == []


def test_duplicate_hash_keeps_first_block(pool):
    h = [hash_block(None, [7] * 16)]
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks(a, h)
    pool.cache_blocks(b, h)
    assert pool.lookup_prefix(h) == a
    pool.release(b)
    assert pool.blocks[b[0]].block_hash is None


def test_chained_hash_depends_on_parent_and_extra_key():
    tokens = list(range(32))
    h = hash_full_blocks(tokens, 16)
    assert len(h) == 2 and len(hash_full_blocks(tokens[:31], 16)) == 1
    assert hash_full_blocks([99] * 16 + tokens[16:], 16)[1] != h[1]
    assert hash_full_blocks(tokens, 16, extra_key="fp8")[0] != h[0]
    assert hash_full_blocks(tokens, 16) == h  # deterministic


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(4, enable_prefix_caching=False)
    a = pool.allocate(1)
    h = [hash_block(None, [1] * 16)]
    pool.cache_blocks(a, h)
    pool.release(a)
    assert pool.lookup_prefix(h) == []
    pool.check_integrity()
