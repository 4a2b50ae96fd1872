"""The Python side of ``elementwise.cc``: the MLP's SiLU x up and the KV cache write, float32 on CPU.

Chosen when an engine starts, each checked against its torch reference first: ``silu_mul`` by
``layer_ops.choose_layer_ops``, ``write_kv`` by the torch attention backend's ``warm_up``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cluster.engine import native


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernels built for this host (see ``cluster.engine.native``). Raises KernelUnavailable."""
    lib = native.load("elementwise")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.silu_mul_f32.argtypes = [p, i64, i64, i64, p, i64, i32]
    lib.silu_mul_f32.restype = None
    lib.write_kv_f32.argtypes = [p, i64, p, i64, p, p, p, i64, i64, i64, i32]
    lib.write_kv_f32.restype = i32
    return lib


def _rows_of_floats(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"{what}: expected a float32 CPU tensor with contiguous rows, got {x.dtype} on {x.device}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up for gate_up [T, 2 x inter] (gate first, as the fused projection lays them out) -> a new
    [T, inter] tensor."""
    _rows_of_floats(gate_up, "silu_mul")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=torch.float32)
    load().silu_mul_f32(
        gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads()
    )
    return out


def supports_write_kv(key: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 on CPU, contiguous caches, and each token's [kv_heads, head_dim] rows one contiguous run."""
    return (
        key.device.type == "cpu"
        and key.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and key.stride(-1) == 1
        and key.stride(-2) == key.shape[-1]
    )


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key, value [num_tokens, kv_heads, head_dim] into the caches [num_blocks, block_size, kv_heads, head_dim] at
    ``slot_mapping`` [num_tokens] (block x block_size + offset), like ``write_kv_ref``."""
    if not (supports_write_kv(key, k_cache, v_cache) and supports_write_kv(value, k_cache, v_cache)):
        raise ValueError("write_kv: expected float32 CPU rows and contiguous caches")
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() else None
    if slots is None:
        slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = load().write_kv_f32(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        key.shape[0],
        key.shape[1] * key.shape[2],
        num_slots,
        torch.get_num_threads(),
    )
    if status != 0:
        raise IndexError(f"write_kv: a slot lies outside the cache's {num_slots} slots")
