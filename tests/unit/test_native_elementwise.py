"""The host-built element-wise kernels (``cluster.engine.native.elementwise``) against their torch
references, and the torch ops kept where they cannot be built."""

import logging
import platform
from pathlib import Path

import pytest
import torch

from cluster.engine import native
from cluster.engine.attention import cpu_prefill
from cluster.engine.attention.base import write_kv_ref
from cluster.engine.attention.torch_backend import TorchAttentionBackend
from cluster.engine.layer_ops import choose_layer_ops, silu_mul_ref
from cluster.engine.native import elementwise


@pytest.fixture(autouse=True)
def _fresh_kernel_load():
    """Each test sees the kernels' ``load`` as a fresh process would; the next one reloads from the cache."""
    elementwise.load.cache_clear()
    cpu_prefill.load.cache_clear()
    yield
    elementwise.load.cache_clear()
    cpu_prefill.load.cache_clear()


def _x86_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="reads x86 CPU flags on Linux"
)
def test_the_kernels_vectors_are_one_register_of_this_cpu():
    """16-float vectors on a CPU with AVX2 only took two registers each: the kernels' register tiles spilled and
    their lane shuffles ran element by element (the engine's skewed-64 burst at 0.55x; docs/benchmarks.md)."""
    flags = _x86_flags()
    assert elementwise.vector_floats() == (16 if "avx512f" in flags else 8 if "avx" in flags else 4)


@pytest.mark.parametrize("rows,inter", [(1, 1376), (3, 250), (300, 250), (2048, 48)])
def test_silu_mul_matches_the_reference(rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 6  # far out on both sides of 0, where exp over- or underflows
    torch.testing.assert_close(elementwise.silu_mul(gate_up), silu_mul_ref(gate_up.clone()), atol=1e-5, rtol=1e-5)


def test_silu_mul_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="float32"):
        elementwise.silu_mul(torch.randn(4, 32).bfloat16())


def kv_step(tokens: int, seed: int = 0):
    """key/value as views of a fused qkv output, caches [blocks, block_size, kv_heads, head_dim], shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, 4 * 2 * 32, generator=g)
    key, value = fused[:, 128:192].view(tokens, 2, 32), fused[:, 192:].view(tokens, 2, 32)
    caches = torch.randn(2, 40, 16, 2, 32, generator=g)
    slots = torch.randperm(40 * 16, generator=g)[:tokens]
    return key, value, caches, slots


@pytest.mark.parametrize("tokens", [1, 7, 600])  # on the calling thread, and in a parallel region
def test_write_kv_matches_the_reference(tokens):
    key, value, caches, slots = kv_step(tokens)
    want = caches.clone()
    write_kv_ref(key, value, want[0], want[1], slots)
    elementwise.write_kv(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches, want)


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing():
    key, value, caches, slots = kv_step(5)
    before = caches.clone()
    slots[3] = 40 * 16
    with pytest.raises(IndexError, match="640 slots"):
        elementwise.write_kv(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches, before)


def test_the_backend_writes_kv_through_the_kernel(monkeypatch):
    calls = []
    kernel = elementwise.write_kv
    monkeypatch.setattr(elementwise, "write_kv", lambda *a: calls.append(1) or kernel(*a))
    key, value, caches, slots = kv_step(9)
    backend = TorchAttentionBackend()
    backend.warm_up(caches[0], caches[1])  # builds and checks the kernel (calls of its own)
    calls.clear()
    want = caches.clone()
    write_kv_ref(key, value, want[0], want[1], slots)
    backend.write_kv(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches, want) and calls == [1]


def test_without_a_compiler_the_torch_ops_run_and_the_log_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    with pytest.raises(native.KernelUnavailable, match="no-such-compiler"):
        native.load("elementwise")
    key, value, caches, slots = kv_step(9)
    want = caches.clone()
    write_kv_ref(key, value, want[0], want[1], slots)
    with caplog.at_level(logging.WARNING):
        ops = choose_layer_ops(torch.float32, "cpu")
        backend = TorchAttentionBackend()
        backend.write_kv(key, value, caches[0], caches[1], slots)
        backend.write_kv(key, value, caches[0], caches[1], slots)
    assert ops.name == "compiled" and ops.silu_mul is silu_mul_ref  # numba's norms, torch's SiLU x up
    assert torch.equal(caches, want)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("host-built layer kernels are unavailable" in m and "no-such-compiler" in m for m in messages) == 1
    assert sum("KV cache write is unavailable" in m and "no-such-compiler" in m for m in messages) == 1
