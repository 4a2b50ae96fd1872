"""Kernel tests run natively on CUDA and under the Triton interpreter on CPU.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test
module imports ``cluster.engine.attention.triton``. It only changes how Triton launches kernels; the torch
backend never imports triton, so its tests are unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
