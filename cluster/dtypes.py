"""Dtype names (what configs, layouts and the wire carry) <-> torch dtypes."""

from __future__ import annotations

import torch

_DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAME_BY_DTYPE = {v: k for k, v in _DTYPE_BY_NAME.items()}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPE_BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    return _NAME_BY_DTYPE[dtype]
