"""A compiled float32 CPU matmul for inputs of a few rows: the decode step of a few sequences.

At decode batch sizes a linear layer reads its whole weight to compute a few output rows, so
its speed is the memory bandwidth it reaches. oneDNN's inner product (``linear.onednn_linear``)
costs ~20 us per call before any math and streams its blocked weights slowly at one row. This
kernel is a dot product per (row, output) over the plain [out, in] weight, four input rows
sharing each weight load; with it a decode step of the bench model took 0.83x the time at batch
1, 0.81x at 4 and 0.86x at 8 on the 2-core CI machine (``python -m bench.small_matmul``). From
~12 rows on, oneDNN's blocked kernels are as fast (they reuse each loaded weight across many
rows), so the engine sends only inputs of up to ``linear.SMALL_MATMUL_ROWS`` rows here
(``linear.SmallRowsMatmul``).

The output columns are split evenly over numba's threads (sized to torch's by
``numba_launch``). Compiled by numba when an engine starts and cached on disk. Engines take the
host-built kernel of the same design first (``native/small_matmul.cc``, loaded in milliseconds where
numba's import and cached load take ~1.5 s); this one serves hosts without a C++ compiler.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from cluster.engine.numba_launch import parallel_launch


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _matmul_rows(x, w, out, threads):  # pragma: no cover - compiled
    # out[m, j] = dot(x[m], w[j]). Each thread takes a contiguous range of output columns j, so it streams its
    # rows of w once; input rows go four at a time through the k loop, so one load of w[j, k] feeds four FMAs.
    # (threads comes from the caller: numba.get_num_threads() inside would keep the kernel out of numba's disk cache.)
    rows, k_dim = x.shape
    n = w.shape[0]
    rows4 = rows - rows % 4
    for t in numba.prange(threads):
        for j in range(n * t // threads, n * (t + 1) // threads):
            for m in range(0, rows4, 4):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for k in range(k_dim):
                    wk = w[j, k]
                    a0 += x[m, k] * wk
                    a1 += x[m + 1, k] * wk
                    a2 += x[m + 2, k] * wk
                    a3 += x[m + 3, k] * wk
                out[m, j] = a0
                out[m + 1, j] = a1
                out[m + 2, j] = a2
                out[m + 3, j] = a3
            for m in range(rows4, rows):
                acc = np.float32(0.0)
                for k in range(k_dim):
                    acc += x[m, k] * w[j, k]
                out[m, j] = acc


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a float32 CPU ``x`` [rows, in] and a plain ``weight`` [out, in]."""
    if x.dim() != 2 or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.stride(1) != 1:
        raise ValueError(
            f"expected 2-D float32 input and weight with contiguous rows, got {tuple(x.shape)} {x.dtype} "
            f"and {tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    with parallel_launch():
        _matmul_rows(x.contiguous().numpy(), weight.detach().numpy(), out.numpy(), numba.get_num_threads())
    if bias is not None:
        out += bias
    return out
