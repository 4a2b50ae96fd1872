"""Prefix hashing: chained hashes of full KV blocks, the key of the prefix cache.

h_i = H(h_{i-1}, tokens of block i, extra key), blake2b, so the same prompt prefix hashes the
same in every process (a router scores prefix affinity with the function a worker caches by).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key:
        h.update(extra_key.encode())
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_key: str | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids``. Pure; used by router and pool alike."""
    hashes: list[BlockHash] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        hashes.append(parent)
    return hashes
