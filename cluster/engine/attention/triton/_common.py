"""Shared by the kernels: argument checks (each failure is a ValueError naming the argument) and dot settings."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting(kernel) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1 (triton decides at decoration time)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device; got {device} and {t.device}")
    if device.type != "cuda" and not interpreting(kernel):
        raise ValueError(
            f"tensors are on {device}; the Triton kernels run on CUDA, or on CPU only when "
            "TRITON_INTERPRET=1 is set before triton is imported"
        )


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """``shape`` entries of None match any size; ints must match exactly. The last dim must be dense."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    mismatch = any(want is not None and got != want for got, want in zip(t.shape, shape, strict=False))
    if t.dim() != len(shape) or mismatch:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {want}")
    if t.dtype not in dtypes:
        names = ", ".join(_name(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {_name(t.dtype)}, expected one of: {names}")
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {tuple(t.stride())}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    names = list(tensors)
    first = tensors[names[0]].dtype
    for n in names[1:]:
        if tensors[n].dtype != first:
            raise ValueError(
                f"{names[0]} has dtype {_name(first)} but {n} has {_name(tensors[n].dtype)}; they must match"
            )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_tensor("k_cache", k_cache, (None, None, None, None), FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, tuple(k_cache.shape), (k_cache.dtype,))


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def dot_config(kernel, dtype: torch.dtype) -> dict:
    """Constexprs for ``dot`` below, to pass to a kernel launch."""
    # Triton 3.9's interpreter multiplies bf16 operands as their raw uint16 bits; upcast there.
    upcast = dtype == torch.bfloat16 and interpreting(kernel)
    # fp32 inputs would silently use TF32 on tensor cores; the fp32 path promises fp32 accuracy.
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return {"DOT_UPCAST": upcast, "DOT_PRECISION": precision}


@triton.jit
def dot(a, b, DOT_UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)
