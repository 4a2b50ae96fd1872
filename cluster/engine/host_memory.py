"""glibc malloc settings for a process that runs a CPU engine.

torch has no caching allocator on the CPU: every activation is a fresh ``malloc`` and a
``free`` soon after. glibc serves large requests with their own ``mmap`` and gives them
back on free, and trims the heap top, so the next step's tensors fault their pages in
again, zero-filled, one 4 KiB page at a time. On the 2-core CI machine that made prefill
steps about 25% slower. Serving large requests from the heap and keeping freed memory
there lets each step reuse the previous step's pages; the process keeps its high-water
mark of activation memory, which a serving engine reaches on its first big step anyway.

That only holds in the main arena (the ``brk`` heap): a thread other than the main one
gets an arena of its own, whose heaps are capped at 64 MiB, so a step's large tensors are
``mmap``ed and faulted in afresh every time. A pool replica runs its engine on such a
thread; with one arena (``M_ARENA_MAX`` 1) it ran about as fast as on the main thread,
against 10-25% slower with its own arena. Arenas are chosen when a thread first
allocates, so a process that starts many threads before the engine (a Ray worker) gets
the setting from its environment (``MALLOC_ARENA_MAX=1``, ``ARENA_ENV``) instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

#: The environment a process needs for one malloc arena from its start (glibc reads it at its first malloc).
ARENA_ENV = {"MALLOC_ARENA_MAX": "1"}

# From glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
#: glibc ignores an mmap threshold above HEAP_MAX_SIZE / 2, which is 32 MiB on 64-bit.
_MAX_MMAP_THRESHOLD = 32 << 20
#: Never give the heap top back (the largest value mallopt's int argument takes).
_NO_TRIM = 2**31 - 1


def keep_freed_memory_for_reuse() -> bool:
    """Process-wide and idempotent. Returns False (and changes nothing) where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = (
        mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1
        and mallopt(_M_TRIM_THRESHOLD, _NO_TRIM) == 1
        and mallopt(_M_ARENA_MAX, 1) == 1
    )
    if not ok:
        log.debug("mallopt refused the CPU engine's allocation settings; continuing with the defaults")
    return ok


def available_memory_bytes() -> int:
    """Memory the kernel can give without swapping (``MemAvailable``: free memory plus the page cache it can drop);
    0 where the OS does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def physical_memory_bytes() -> int:
    """The machine's RAM (0 where the OS does not say: callers then treat every extra copy as too large)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux/macOS
        return 0
