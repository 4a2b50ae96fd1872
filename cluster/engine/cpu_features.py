"""What the running CPU does fast, for the start-up advice on 16-bit dtypes.

bfloat16 and float16 matmuls only run at full speed on CPUs with native instructions for them
(AVX512-BF16 or AMX for bfloat16, AVX512-FP16 or AMX-FP16 for float16). Elsewhere they are
emulated through float32 and were ~5x slower than float32 itself on a 2-core AVX2 EPYC, so an
engine started with such a dtype on such a CPU says so and, when a quick measurement agrees,
suggests ``--dtype float32``.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: /proc/cpuinfo flags that mean a dtype's matmuls run natively.
NATIVE_FLAGS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where /proc/cpuinfo is not readable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_native(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU runs ``dtype`` matmuls natively (float32 always does)."""
    wanted = NATIVE_FLAGS.get(dtype)
    if wanted is None:
        return True
    return any(f in (cpu_flags() if flags is None else flags) for f in wanted)


def slowdown_vs_float32(
    dtype: torch.dtype, matmul=F.linear, rows: int = 64, size: int = 512, repeats: int = 3
) -> float:
    """Measured time of a ``dtype`` matmul / the same float32 matmul (best of ``repeats``; ~50 ms)."""
    g = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(rows, size, generator=g), torch.randn(size, size, generator=g)

    def best(x: torch.Tensor, w: torch.Tensor) -> float:
        times = []
        with torch.inference_mode():
            matmul(x, w, None)  # first call: primitive creation, page faults
            for _ in range(repeats):
                t0 = time.perf_counter()
                matmul(x, w, None)
                times.append(time.perf_counter() - t0)
        return min(times)

    return best(x32.to(dtype), w32.to(dtype)) / max(best(x32, w32), 1e-9)


def advise_dtype(dtype: torch.dtype, matmul=F.linear) -> str:
    """Logs (once per call, at engine start) when ``dtype`` runs emulated on this CPU; returns the message
    ("" when there is nothing to say)."""
    if dtype not in NATIVE_FLAGS or has_native(dtype):
        return ""
    name = str(dtype).removeprefix("torch.")
    native = " or ".join(f.upper().replace("_", "-") for f in NATIVE_FLAGS[dtype])
    ratio = slowdown_vs_float32(dtype, matmul)
    message = (
        f"this CPU has no native {name} matmuls (no {native}): they run emulated, {ratio:.1f}x the time of float32"
    )
    if ratio > 1.2:
        message += "; --dtype float32 is faster here (it takes twice the memory)"
    log.warning(message)
    return message
