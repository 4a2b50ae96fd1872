"""The Python side of ``elementwise.cc``: a layer's norms, rotary, SiLU x up and KV cache write, float32 on CPU.

Chosen when an engine starts, each checked against its torch reference first: the layer ops by
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
    f32 = ctypes.c_float
    lib.rms_norm_f32.argtypes = [p, i64, i64, i64, p, f32, p, i64, i32]
    lib.rms_norm_f32.restype = None
    lib.add_rms_norm_f32.argtypes = [p, i64, i64, i64, p, i64, p, f32, p, i64, i32]
    lib.add_rms_norm_f32.restype = None
    lib.rotary_qk_f32.argtypes = [p, i64, i64, p, i32, i32, p, p, i64, i32]
    lib.rotary_qk_f32.restype = i32
    lib.vector_floats.argtypes = []
    lib.vector_floats.restype = i32
    return lib


def vector_floats() -> int:
    """Floats per vector the kernels were built with: one register of the host's widest (16 with AVX-512, 8 with
    AVX2, 4 otherwise). Raises KernelUnavailable."""
    return load().vector_floats()


def _rows_of_floats(x: torch.Tensor, what: str) -> None:
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"{what}: expected a float32 CPU tensor with contiguous rows, got {x.dtype} on {x.device}")


def _contiguous_floats(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"{what}: expected a float32 CPU tensor, got {x.dtype} on {x.device}")
    return x.detach().contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) x weight, row by row: x [T, H] -> a new [T, H]."""
    _rows_of_floats(x, "rms_norm")
    w = _contiguous_floats(weight, "rms_norm weight")
    out = torch.empty(x.shape, dtype=torch.float32)
    rows, hidden = x.shape
    load().rms_norm_f32(
        x.data_ptr(), rows, hidden, x.stride(0), w.data_ptr(), eps, out.data_ptr(), hidden, torch.get_num_threads()
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) x weight, x + residual). Writes the sum into ``x`` and returns it as the second
    value: pass an ``x`` nothing else reads (a matmul's fresh output)."""
    _rows_of_floats(x, "add_rms_norm")
    _rows_of_floats(residual, "add_rms_norm residual")
    w = _contiguous_floats(weight, "add_rms_norm weight")
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} is not x's {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.float32)
    rows, hidden = x.shape
    load().add_rms_norm_f32(
        x.data_ptr(),
        rows,
        hidden,
        x.stride(0),
        residual.data_ptr(),
        residual.stride(0),
        w.data_ptr(),
        eps,
        out.data_ptr(),
        hidden,
        torch.get_num_threads(),
    )
    return out, x


def rotary_qk_(
    qkv: torch.Tensor, positions: torch.Tensor, rotated_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates the first ``rotated_heads`` heads of each row of ``qkv`` [T, heads x head_dim] (q's, then k's) in
    place by the angles of ``positions`` [T]; cos, sin: [max_positions, head_dim] float32."""
    _rows_of_floats(qkv, "rotary_qk_")
    if qkv.shape[1] < rotated_heads * head_dim or head_dim % 2:
        raise ValueError(f"rotary_qk_: {rotated_heads} heads of {head_dim} do not fit rows of {qkv.shape[1]}")
    cos, sin = _contiguous_floats(cos, "rotary_qk_ cos"), _contiguous_floats(sin, "rotary_qk_ sin")
    if cos.shape != sin.shape or cos.shape[-1] != head_dim:
        raise ValueError(f"rotary_qk_: cos/sin must be [max_positions, {head_dim}]")
    pos = positions.to(torch.int64).contiguous()
    status = load().rotary_qk_f32(
        qkv.data_ptr(),
        qkv.shape[0],
        qkv.stride(0),
        pos.data_ptr(),
        rotated_heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        torch.get_num_threads(),
    )
    if status != 0:
        raise IndexError(f"rotary_qk_: a position lies outside the table's {cos.shape[0]} positions")


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
