"""Compiled float32 CPU kernels for a decoder layer's element-wise parts.

Between its four matmuls, a decoder layer written with torch ops runs dozens of small ops
(RMSNorm is seven, rotary about twenty), each a pass over memory and a dispatch through torch,
a fixed cost per step that shows at decode batch sizes (``python -m bench.layer_ops``: these
kernels take ~1.5 ms off a 12.5 ms decode step at batch 1). Each kernel does one group in one
pass:

- ``add_rms_norm``: the residual add and the next RMSNorm (``rms_norm`` without the add);
- ``rotary_qk_``: rotary embedding of q and k, in place in the fused qkv output.

SiLU(gate) x up stays with torch: numba's ``exp`` has no vector form here, and a compiled
version was 2x slower than torch's ops at decode sizes.

Small inputs (decode batches) run on the calling thread: a parallel launch costs more than
the work. Prefill-sized inputs split their rows over numba's pool (``numba_launch``).
Compiled by numba when an engine starts and cached on disk. The torch reference of each is
in ``cluster.engine.layer_ops``; ``layer_ops.choose_layer_ops`` checks them against it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from cluster.engine.numba_launch import parallel_launch

#: Rows from which a kernel splits its rows over numba's threads (below: one thread, no launch).
PARALLEL_ROWS = 64


# ---- RMSNorm (with the residual add) -------------------------------------------------------------


@numba.njit(fastmath=True, cache=True, inline="always")
def _norm_row(src, weight, eps, dst):  # pragma: no cover - compiled
    n = src.shape[0]
    acc = np.float32(0.0)
    for i in range(n):
        acc += src[i] * src[i]
    inv = np.float32(1.0) / np.sqrt(acc / np.float32(n) + eps)
    for i in range(n):
        dst[i] = weight[i] * (src[i] * inv)


@numba.njit(fastmath=True, cache=True, inline="always")
def _add_norm_row(x, residual, weight, eps, dst):  # pragma: no cover - compiled
    # x += residual, then dst = RMSNorm(x): x becomes the next residual.
    n = x.shape[0]
    acc = np.float32(0.0)
    for i in range(n):
        s = x[i] + residual[i]
        x[i] = s
        acc += s * s
    inv = np.float32(1.0) / np.sqrt(acc / np.float32(n) + eps)
    for i in range(n):
        dst[i] = weight[i] * (x[i] * inv)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _norm_serial(x, weight, eps, out):  # pragma: no cover - compiled
    for r in range(x.shape[0]):
        _norm_row(x[r], weight, eps, out[r])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _norm_parallel(x, weight, eps, out):  # pragma: no cover - compiled
    for r in numba.prange(x.shape[0]):
        _norm_row(x[r], weight, eps, out[r])


@numba.njit(fastmath=True, cache=True, nogil=True)
def _add_norm_serial(x, residual, weight, eps, out):  # pragma: no cover - compiled
    for r in range(x.shape[0]):
        _add_norm_row(x[r], residual[r], weight, eps, out[r])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _add_norm_parallel(x, residual, weight, eps, out):  # pragma: no cover - compiled
    for r in numba.prange(x.shape[0]):
        _add_norm_row(x[r], residual[r], weight, eps, out[r])


# ---- rotary embedding ----------------------------------------------------------------------------


@numba.njit(fastmath=True, cache=True, inline="always")
def _rotary_row(row, rotated_heads, head_dim, cos, sin):  # pragma: no cover - compiled
    # row: one token's qkv output; its first `rotated_heads` heads are q's and k's. Same arithmetic as
    # q * cos + rotate_half(q) * sin, where rotate_half(x) = cat(-x[half:], x[:half]).
    half = head_dim // 2
    for h in range(rotated_heads):
        base = h * head_dim
        for i in range(half):
            x1 = row[base + i]
            x2 = row[base + half + i]
            row[base + i] = x1 * cos[i] - x2 * sin[i]
            row[base + half + i] = x2 * cos[half + i] + x1 * sin[half + i]


@numba.njit(fastmath=True, cache=True, nogil=True)
def _rotary_serial(qkv, positions, rotated_heads, head_dim, cos, sin):  # pragma: no cover - compiled
    for t in range(qkv.shape[0]):
        p = positions[t]
        _rotary_row(qkv[t], rotated_heads, head_dim, cos[p], sin[p])


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _rotary_parallel(qkv, positions, rotated_heads, head_dim, cos, sin):  # pragma: no cover - compiled
    for t in numba.prange(qkv.shape[0]):
        p = positions[t]
        _rotary_row(qkv[t], rotated_heads, head_dim, cos[p], sin[p])


# ---- torch-facing wrappers -----------------------------------------------------------------------


def _launch(serial, parallel, rows: int, *args) -> None:
    """Runs ``parallel`` over numba's pool for prefill-sized inputs, else ``serial`` on this thread."""
    if rows >= PARALLEL_ROWS:
        with parallel_launch():
            parallel(*args)
    else:
        serial(*args)


def _rows(x: torch.Tensor) -> np.ndarray:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a 2-D float32 CPU tensor with contiguous rows, got shape {tuple(x.shape)}")
    return x.numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) x weight, row by row: x [T, H] -> new [T, H]."""
    out = torch.empty_like(x)
    _launch(_norm_serial, _norm_parallel, x.shape[0], _rows(x), weight.detach().numpy(), np.float32(eps), out.numpy())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x + residual) x weight, x + residual). Writes the sum into ``x`` and returns it as the
    second value: pass an ``x`` nothing else reads (a matmul's fresh output)."""
    out = torch.empty_like(x)
    args = (_rows(x), _rows(residual), weight.detach().numpy(), np.float32(eps), out.numpy())
    _launch(_add_norm_serial, _add_norm_parallel, x.shape[0], *args)
    return out, x


def rotary_qk_(
    qkv: torch.Tensor, positions: torch.Tensor, rotated_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates the first ``rotated_heads`` heads of each row of ``qkv`` [T, heads x head_dim] (q's, then
    k's) in place by the angles of ``positions`` [T]; cos, sin: [max_positions, head_dim] float32."""
    args = (_rows(qkv), positions.numpy(), rotated_heads, head_dim, cos.numpy(), sin.numpy())
    _launch(_rotary_serial, _rotary_parallel, qkv.shape[0], *args)
