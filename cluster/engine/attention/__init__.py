"""Attention backends over the paged KV cache, found by name.

``BACKENDS`` maps a name to the import path of its class, imported only when chosen: a CPU host
never imports triton, and no module registers itself on import.
"""

from __future__ import annotations

import importlib

from cluster.engine.attention.base import AttentionBackend, AttentionMetadata

BACKENDS: dict[str, str] = {
    "torch": "cluster.engine.attention.torch_backend:TorchAttentionBackend",
    "triton": "cluster.engine.attention.triton.backend:TritonAttentionBackend",
}


def resolve_backend_name(name: str, device: str) -> str:
    """``auto`` is triton on CUDA and torch elsewhere."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    return name


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    name = resolve_backend_name(name, device)
    module_name, _, class_name = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend", "resolve_backend_name"]
