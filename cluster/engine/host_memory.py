"""glibc malloc settings for a process that runs a CPU engine.

torch has no caching allocator on the CPU: every activation is a fresh ``malloc`` and a
``free`` soon after. glibc serves large requests with their own ``mmap`` and gives them
back on free, and trims the heap top, so the next step's tensors fault their pages in
again, zero-filled, one 4 KiB page at a time. On the 2-core CI machine that made prefill
steps about 25% slower. Serving large requests from the heap and keeping freed memory
there lets each step reuse the previous step's pages; the process keeps its high-water
mark of activation memory, which a serving engine reaches on its first big step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# From glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
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
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _NO_TRIM) == 1
    if not ok:
        log.debug("mallopt refused the CPU engine's allocation settings; continuing with the defaults")
    return ok
