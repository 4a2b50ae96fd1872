"""The model's linear layers: ``nn.Linear`` whose CPU matmul runs on oneDNN.

torch sends float32 CPU matmuls to MKL, which picks its kernels by CPU vendor: on AMD
x86 CPUs it runs AVX2 code even where AVX-512 is there. oneDNN picks kernels by the
instruction sets the CPU reports, and on the 2-core AMD EPYC (Zen 5) CI machine it is
2.0-2.4x faster at every shape the engine runs (decode batches of 64 rows, prefill
chunks of 2048, the 32k-vocab head). Same float32 arithmetic, other summation order.
CUDA tensors, float16 and builds without oneDNN use ``F.linear`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_HAS_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (x: [..., in], weight: [out, in]); inference only (no autograd through oneDNN)."""
    if _HAS_ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype in _ONEDNN_DTYPES and weight.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """Same parameters and state-dict names as ``nn.Linear``; forward through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
