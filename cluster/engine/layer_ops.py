"""The element-wise parts of a decoder layer, and the choice of the code that runs them.

A layer's norms, residual adds, rotary embedding and SiLU x up are written as torch ops here (the
reference, and what runs on GPUs and in bfloat16/float16) and as float32 CPU kernels that do each
in one pass instead of 2-20 torch ops, which at decode batch sizes cost more than the work: the
host-built C++ ones (``cluster.engine.native.elementwise``, on torch's own OpenMP threads) and,
where no compiler is found, numba's (``cpu_layer_kernels``). Like the matmul
(``linear.choose_matmul``), the choice is made per (dtype, device) when an engine starts, by trying
the kernels against the reference.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 like the reference implementation, then cast back.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_qk_ref_(
    qkv: torch.Tensor, positions: torch.Tensor, rotated_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    # q and k lie side by side at the start of each qkv row, so both rotate in one view.
    qk = qkv[:, : rotated_heads * head_dim].view(-1, rotated_heads, head_dim)
    c = cos[positions].unsqueeze(1).to(qkv.dtype)
    s = sin[positions].unsqueeze(1).to(qkv.dtype)
    qk.copy_(qk * c + rotate_half(qk) * s)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, intermediate] tensor fewer


@dataclass(frozen=True)
class LayerOps:
    name: str  # "native" (host-built C++) | "compiled" (numba) | "torch"
    #: rms_norm(x [T, H], weight [H], eps) -> RMSNorm(x) x weight, a new tensor.
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    #: add_rms_norm(x, residual, weight, eps) -> (RMSNorm(x + residual) x weight, x + residual); may write the sum
    #: into x (callers pass a matmul's fresh output).
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    #: rotary_qk_(qkv [T, heads x head_dim], positions [T], rotated_heads, head_dim, cos, sin): rotates the first
    #: rotated_heads heads of every row (q's then k's) in place; cos/sin: [max_positions, head_dim] float32.
    rotary_qk_: Callable[[torch.Tensor, torch.Tensor, int, int, torch.Tensor, torch.Tensor], None]
    #: silu_mul(gate_up [T, 2 x inter]) -> SiLU(gate) x up [T, inter], a new tensor (gate is the first half).
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul_ref
    #: Why the compiled kernels were not taken ("" when they were, or when none apply).
    fallback_reason: str = ""


TORCH_LAYER_OPS = LayerOps("torch", rms_norm_ref, add_rms_norm_ref, rotary_qk_ref_)


def _probe(ops: LayerOps) -> str:
    """Runs ``ops`` against the torch reference on small inputs (a decode row, a prefill block, each on both sides
    of the kernels' parallel threshold). Returns "" if they agree, else why not."""
    g = torch.Generator().manual_seed(0)
    hidden, heads, head_dim, eps = 48, 6, 8, 1e-5
    weight = torch.rand(hidden, generator=g) + 0.5
    angles = torch.outer(torch.arange(512, dtype=torch.float32), torch.rand(head_dim // 2, generator=g))
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    try:
        with torch.inference_mode():
            for rows in (1, 3, 130):
                x, residual = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)
                checks = [(ops.rms_norm(x, weight, eps), rms_norm_ref(x, weight, eps))]
                got, got_sum = ops.add_rms_norm(x.clone(), residual, weight, eps)
                want, want_sum = add_rms_norm_ref(x, residual, weight, eps)
                checks += [(got, want), (got_sum, want_sum)]
                qkv = torch.randn(rows, (heads + 2) * head_dim, generator=g)
                positions = torch.randint(0, 512, (rows,), generator=g)
                got_qkv, want_qkv = qkv.clone(), qkv.clone()
                ops.rotary_qk_(got_qkv, positions, heads, head_dim, cos, sin)
                rotary_qk_ref_(want_qkv, positions, heads, head_dim, cos, sin)
                checks.append((got_qkv, want_qkv))
                for got, want in checks:
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                        return "their results differ from the torch reference's"
    except Exception as e:  # noqa: BLE001 - numba/LLVM failures come in many types
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return ""


def _probe_silu_mul(fn: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """``fn`` against the reference on a decode row and a prefill block (a width that is no whole number of
    vectors, and inputs far out on both sides). Returns "" if they agree, else why not."""
    g = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for rows in (1, 300):
                gate_up = torch.randn(rows, 2 * 250, generator=g) * 8
                got, want = fn(gate_up), silu_mul_ref(gate_up.clone())
                if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    return "its results differ from the torch reference's"
    except Exception as e:  # noqa: BLE001 - a kernel's failures come in many types
        return f"{type(e).__name__}: {e}"
    return ""


def choose_layer_ops(dtype: torch.dtype, device: str | torch.device) -> LayerOps:
    """The element-wise ops an engine of this dtype on this device runs. For float32 on the CPU, the first set that
    builds and agrees with the torch reference: the host-built C++ kernels (``cluster.engine.native``), else
    numba's (``cpu_layer_kernels``, with SiLU x up as torch ops), else the torch ops. Never raises; a fallback's
    reason is logged once (engines call this once, at start)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return TORCH_LAYER_OPS
    from cluster.engine.native import KernelUnavailable, elementwise

    try:
        elementwise.load()
    except KernelUnavailable as e:
        why_not_native = str(e)
    else:
        native = LayerOps(
            "native", elementwise.rms_norm, elementwise.add_rms_norm, elementwise.rotary_qk_, elementwise.silu_mul
        )
        why_not_native = _probe(native) or _probe_silu_mul(native.silu_mul)
        if not why_not_native:
            return native
    log.warning("the host-built layer kernels are unavailable (%s); trying numba's", why_not_native)
    try:
        from cluster.engine import cpu_layer_kernels as kernels
    except ImportError as e:  # pragma: no cover - numba is a declared dependency
        return _fallback(f"numba cannot be imported ({e})")
    compiled = LayerOps("compiled", kernels.rms_norm, kernels.add_rms_norm, kernels.rotary_qk_)
    why_not = _probe(compiled)
    return _fallback(why_not) if why_not else compiled


def _fallback(reason: str) -> LayerOps:
    log.warning("the compiled CPU layer kernels are unavailable (%s); norms and rotary run as torch ops", reason)
    return dataclasses.replace(TORCH_LAYER_OPS, fallback_reason=reason)
