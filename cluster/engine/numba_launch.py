"""How the engine's compiled (numba) CPU kernels share numba's thread pool.

numba keeps its own thread pool, separate from torch's OpenMP threads. Its fallback
threading layer (workqueue, used where no OpenMP or TBB runtime is found) aborts the process
when two threads launch parallel kernels at once; engines in one process (tests, a pool
replica's helper threads) take turns instead. Each launch sizes the pool to torch's, so both
use the cores the engine was given.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import torch

_LAUNCH_LOCK = threading.Lock()


@contextmanager
def parallel_launch() -> Iterator[None]:
    """Hold this around every call of a ``parallel=True`` kernel."""
    with _LAUNCH_LOCK:
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
        yield
