"""The Python side of ``small_matmul.cc``: ``F.linear`` for float32 CPU inputs of a few rows, on plain weights.

Chosen when an engine starts, after a check against ``F.linear`` (``linear.choose_small_rows_matmul``), ahead of
numba's kernel of the same design (``cpu_small_matmul``), which stays the path of hosts without a compiler.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cluster.engine import native


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernel built for this host (see ``cluster.engine.native``). Raises KernelUnavailable."""
    lib = native.load("small_matmul")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.small_rows_matmul_f32.argtypes = [p, i64, i64, i64, p, i64, i64, p, p, i64, i32]
    lib.small_rows_matmul_f32.restype = None
    return lib


def small_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a float32 CPU ``x`` [rows, in] and a plain ``weight`` [out, in], both with
    contiguous rows. Raises KernelUnavailable where the kernel cannot be built."""
    if (
        x.dim() != 2
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or weight.stride(1) != 1
        or weight.dim() != 2
        or x.shape[1] != weight.shape[1]
        or (bias is not None and tuple(bias.shape) != (weight.shape[0],))
    ):
        raise ValueError(
            f"expected a 2-D float32 CPU input and weight with contiguous rows and equal inner sizes (and a bias of "
            f"the weight's rows), got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    b = None if bias is None else bias.detach().to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    rows, k = x.shape
    load().small_rows_matmul_f32(
        x.data_ptr(),
        rows,
        k,
        x.stride(0),
        weight.data_ptr(),
        weight.shape[0],
        weight.stride(0),
        None if b is None else b.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out
