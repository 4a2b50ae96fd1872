"""The CPU engine's malloc settings: freed activation memory is kept for the next step."""

import ctypes
import ctypes.util
import platform

import pytest
import torch

from cluster.engine.host_memory import keep_freed_memory_for_reuse


class _MallInfo2(ctypes.Structure):
    _FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS.split()]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_freed_activation_memory_stays_in_the_heap_for_the_next_step():
    assert keep_freed_memory_for_reuse() is True
    assert keep_freed_memory_for_reuse() is True  # idempotent
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    size = 24 << 20  # a prefill step's MLP activation: 2048 tokens x 2752 floats is 22.5 MiB
    mapped_before = libc.mallinfo2().hblkhd
    t = torch.empty(size // 4).fill_(1.0)
    assert libc.mallinfo2().hblkhd == mapped_before, "served by its own mmap, so freeing it unmaps it"
    del t
    assert libc.mallinfo2().fordblks >= size, "freed memory was returned to the OS instead of kept for reuse"
