"""The model's linear layers, and the choice of the matmul that runs them.

torch sends float32 CPU matmuls to MKL, which picks its kernels by CPU vendor: on AMD x86
CPUs it runs AVX2 code even where AVX-512 is there. oneDNN picks kernels by the instruction
sets the CPU reports, and on an AMD EPYC (Zen 5) VM it was 2.0-2.4x faster at every shape
the engine runs. But oneDNN has no bfloat16 inner product on a CPU without AVX-512 (it
fails when the primitive is created, i.e. at the first matmul), and a torch build may lack
it entirely. So the matmul is chosen per (dtype, device) when an engine starts, by trying
it: oneDNN where it runs and agrees with ``F.linear``, ``F.linear`` everywhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.native import KernelUnavailable

log = logging.getLogger(__name__)

#: ``matmul(x, weight, bias)`` with x: [..., in], weight: [out, in] -> [..., out]; inference only.
Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

#: Dtypes where oneDNN was measured faster than MKL on CPU; float16 stays on F.linear.
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's inner product (no autograd). Raises RuntimeError where the CPU or build lacks it."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


#: Rows the packed weight layout is chosen for: decode batches of tens of rows gain 20-30% per matmul over
#: the weights as loaded (oneDNN reorders plain weights on every call); prefill-sized inputs are unaffected.
PACK_ROWS_HINT = 64


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout for ``onednn_linear`` (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)


@dataclass(frozen=True)
class MatmulChoice:
    name: str  # "onednn" | "torch"
    fn: Matmul
    #: Why the fast path was not taken ("" when it was, or when none applies).
    fallback_reason: str = ""
    #: Converts a weight once, at engine start, into the layout ``fn`` reads fastest; None: as loaded.
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None


PORTABLE = MatmulChoice("torch", F.linear)


def _probe(
    candidate: Matmul, dtype: torch.dtype, device: torch.device, pack: Callable[[torch.Tensor], torch.Tensor] | None
) -> str:
    """Runs ``candidate`` (on the weight packed by ``pack``, if given) on small inputs of the engine's kinds (a
    decode row, a prefill block, a non-contiguous slice; with and without bias) against ``F.linear``. Returns ""
    if it works, else why not."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=g).to(dtype=dtype, device=device)
    bias = torch.randn(48, generator=g).to(dtype=dtype, device=device)
    inputs = (torch.randn(1, 64, generator=g), torch.randn(40, 80, generator=g)[:, 8:72])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        with torch.inference_mode():
            used = pack(weight) if pack is not None else weight
            for x in inputs:
                x = x.to(dtype=dtype, device=device)
                for b in (None, bias):
                    got = candidate(x, used, b).float()
                    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
                    atol = tol * float(want.abs().max())
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=atol):
                        return "its results differ from F.linear's"
    except Exception as e:  # noqa: BLE001 - any failure means: not usable on this CPU/build
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return ""


def choose_matmul(
    dtype: torch.dtype,
    device: str | torch.device,
    candidate: Matmul | None = None,
    pack: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> MatmulChoice:
    """The matmul an engine of this dtype on this device runs, decided by trying ``candidate`` (oneDNN), first on
    weights packed by ``pack`` (oneDNN's blocked layout), then on plain ones.

    Never raises: a candidate that fails or disagrees falls back to ``F.linear`` and the reason
    is logged once (per call; engines call it once at start). Does not modify global state.
    """
    device = torch.device(device)
    if device.type != "cpu" or dtype not in _ONEDNN_DTYPES:
        return PORTABLE
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return _fallback(dtype, "this torch build has no oneDNN linear")
    candidate = candidate or onednn_linear  # looked up now, so a test can replace them
    pack = pack or onednn_pack
    if not _probe(candidate, dtype, device, pack):
        return MatmulChoice("onednn", candidate, pack=pack)
    why_not = _probe(candidate, dtype, device, None)
    if why_not:
        return _fallback(dtype, why_not)
    return MatmulChoice("onednn", candidate)


def _fallback(dtype: torch.dtype, reason: str) -> MatmulChoice:
    name = str(dtype).removeprefix("torch.")
    log.warning("oneDNN %s matmuls are unavailable on this CPU (%s); using torch's F.linear", name, reason)
    return MatmulChoice("torch", F.linear, reason)


#: Inputs of up to this many rows take the small-batch kernel (above: the main matmul). On the CI machine numba's
#: kernel was still ahead at 12 rows and behind at 16 (``python -m bench.small_matmul --max-rows 16 --batches
#: 8,12,16``); 8 leaves a margin for CPUs where oneDNN does better.
SMALL_MATMUL_ROWS = 8


@dataclass(frozen=True)
class SmallRowsMatmul:
    """Where inputs of up to ``max_rows`` rows go instead of the main matmul (``native.small_matmul``, else
    ``cpu_small_matmul``): ``fn`` reads the plain [out, in] weight, so a ``Linear`` whose weight is packed keeps the
    plain one beside it."""

    max_rows: int
    fn: Matmul


class Linear(nn.Linear):
    """Same parameters and state-dict names as ``nn.Linear``; forward through ``self.matmul``
    (``F.linear`` until the engine sets the one chosen for its dtype and device), or, for a 2-D input of a few
    rows, through ``small.fn`` on ``plain_weight`` where the engine set them (``use_small_rows_matmul``)."""

    matmul: Matmul = staticmethod(F.linear)
    small: SmallRowsMatmul | None = None
    plain_weight: torch.Tensor  # set together with ``small``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.small
        if small is not None and x.dim() == 2 and x.shape[0] <= small.max_rows:
            return small.fn(x, self.plain_weight, self.bias)
        return self.matmul(x, self.weight, self.bias)


def use_matmul(model: nn.Module, matmul: Matmul) -> None:
    """Makes every ``Linear`` in ``model`` run ``matmul``."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.matmul = matmul


def pack_weights(model: nn.Module, pack: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Replaces each ``Linear``'s weight by ``pack(weight)``, in place (the plain copy is freed), except weights
    shared with another module (a tied LM head: the embedding reads it as is). Returns how many were packed."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    packed = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Linear) and owners[id(module.weight)] == 1:
                module.weight = nn.Parameter(pack(module.weight.detach()), requires_grad=False)
                packed += 1
    return packed


#: The most memory the plain weights kept beside packed ones may take, as a share of the machine's: small models
#: (float32 CPU serving) keep them, a model whose linears are a sizeable share of memory runs without the kernel.
SMALL_ROWS_MEMORY_SHARE = 0.10


def choose_small_rows_matmul(
    dtype: torch.dtype, device: str | torch.device, candidate: Matmul | None = None
) -> SmallRowsMatmul | None:
    """The matmul for decode-sized inputs of an engine of this dtype on this device, for float32 on the CPU: the
    host-built kernel (``native.small_matmul``) where it builds and agrees with ``F.linear``, else numba's
    (``cpu_small_matmul``, imported only then: numba's import and its cached kernel's load took ~1.5 s of a
    replica's start), else None (every input takes the main matmul). ``candidate`` replaces both (tests).
    Never raises; why a kernel was passed over is logged once (engines call this once, at start)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    candidates = (("given", lambda: candidate),) if candidate is not None else _SMALL_ROWS_KERNELS
    why_not: list[str] = []
    for name, kernel in candidates:
        try:
            fn = kernel()
        except (ImportError, KernelUnavailable) as e:
            why_not.append(f"{name}: {e}")
            continue
        if not (failure := _probe_rows(fn, SMALL_MATMUL_ROWS)):
            if why_not:
                log.info("the small-batch matmul runs %s kernel (%s)", name, "; ".join(why_not))
            return SmallRowsMatmul(SMALL_MATMUL_ROWS, fn)
        why_not.append(f"{name}: {failure}")
    log.warning(
        "the compiled small-batch matmul is unavailable (%s); decode batches use the main matmul", "; ".join(why_not)
    )
    return None


def _native_small_rows() -> Matmul:
    from cluster.engine.native import small_matmul

    small_matmul.load()  # raises KernelUnavailable here rather than in the probe
    return small_matmul.small_rows_linear


def _numba_small_rows() -> Matmul:
    from cluster.engine import cpu_small_matmul

    return cpu_small_matmul.small_rows_linear


#: The small-batch kernels in the order an engine tries them, by the name its log gives them.
_SMALL_ROWS_KERNELS: tuple[tuple[str, Callable[[], Matmul]], ...] = (
    ("the host-built", _native_small_rows),
    ("numba's", _numba_small_rows),
)


def _probe_rows(candidate: Matmul, max_rows: int) -> str:
    """``candidate`` against ``F.linear`` on plain weights, at every row count up to ``max_rows``, with and without
    bias, on a non-contiguous input too. Returns "" if it agrees, else why not."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 72, generator=g)
    bias = torch.randn(40, generator=g)
    try:
        with torch.inference_mode():
            for rows in range(1, max_rows + 1):
                x = torch.randn(rows, 80, generator=g)[:, 4:76]
                for b in (None, bias):
                    got, want = candidate(x, weight, b), F.linear(x, weight, b)
                    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                        return "its results differ from F.linear's"
    except Exception as e:  # noqa: BLE001 - numba/LLVM failures come in many types
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return ""


def use_small_rows_matmul(model: nn.Module, small: SmallRowsMatmul, will_pack: bool, memory_bytes: int) -> bool:
    """Makes every ``Linear`` in ``model`` send inputs of up to ``small.max_rows`` rows to ``small.fn`` on its weight
    as it is now (call before ``pack_weights``, which then leaves this plain copy in place).

    When the weights will be packed, the plain copies stay in memory beside the packed ones; if they would take
    more than ``SMALL_ROWS_MEMORY_SHARE`` of ``memory_bytes``, nothing changes and it says so once. Returns whether
    the kernel is in use."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if will_pack:
        owners: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
        extra = sum(m.weight.numel() * m.weight.element_size() for m in linears if owners[id(m.weight)] == 1)
        if extra > SMALL_ROWS_MEMORY_SHARE * memory_bytes:
            log.warning(
                "the small-batch matmul is off: its plain copy of the linear weights would take %.1f GiB, more than "
                "%d%% of this machine's %.1f GiB; decode batches use the main matmul",
                extra / 2**30,
                round(SMALL_ROWS_MEMORY_SHARE * 100),
                memory_bytes / 2**30,
            )
            return False
    for module in linears:
        module.small = small
        module.plain_weight = module.weight.detach()
    return True
