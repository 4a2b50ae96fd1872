"""The CPU prefill attention kernel (``cpu_prefill``, C++ built for this host) against the padded
reference, and how the torch backend degrades when the kernel cannot be built or is switched off."""

import logging

import pytest
import torch

from cluster.engine import native
from cluster.engine.attention import cpu_prefill
from cluster.engine.attention.base import AttentionMetadata, paged_prefill_attention_ref
from cluster.engine.attention.cpu_kernel_checks import check_prefill
from cluster.engine.attention.torch_backend import TorchAttentionBackend
from tests.unit.test_attention_torch import paged_context

# Prompts with nothing cached (one of them longer than a work item's rows), chunks continuing after a
# cached prefix, decodes, and lengths that end mid-tile and mid-block.
SEQUENCES = [(300, 300), (1, 40), (17, 17), (5, 69), (40, 200), (3, 3), (1, 1), (70, 70)]


@pytest.fixture(autouse=True)
def _fresh_kernel_load():
    """Each test sees ``load`` as a fresh process would; the next one reloads from the build cache."""
    cpu_prefill.load.cache_clear()
    yield
    cpu_prefill.load.cache_clear()


def fused_query(num_tokens: int, heads: int, kv_heads: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """q as the model slices it out of a fused qkv projection: rows (heads + 2 kv_heads) x head_dim apart."""
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    return qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)


@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 2), (128, 128, 1), (7, 80, 4), (16, 32, 8)])
def test_kernel_matches_the_reference(block_size, head_dim, group):
    query_lens, seq_lens = zip(*SEQUENCES, strict=True)
    kv_heads = 2
    k_cache, v_cache, tables, g = paged_context(seq_lens, block_size, kv_heads, head_dim, torch.float32, seed=5)
    query = fused_query(sum(query_lens), kv_heads * group, kv_heads, head_dim, g)
    starts = torch.tensor((0, *query_lens)).cumsum(0).to(torch.int32)
    scale = head_dim**-0.5
    got = cpu_prefill.prefill_attention_cpu(query, k_cache, v_cache, tables, query_lens, seq_lens, scale)
    want = paged_prefill_attention_ref(
        query, k_cache, v_cache, tables, starts, torch.tensor(seq_lens, dtype=torch.int32), scale, query_lens
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.is_contiguous()


def test_kernel_refuses_what_it_cannot_run():
    k_cache, v_cache, _, _ = paged_context([5], 16, 2, 32, torch.float32)
    assert cpu_prefill.supports(torch.randn(5, 4, 32), k_cache, v_cache)
    assert not cpu_prefill.supports(torch.randn(5, 4, 32).bfloat16(), k_cache.bfloat16(), v_cache.bfloat16())
    k24, v24, _, _ = paged_context([5], 16, 2, 24, torch.float32)
    assert not cpu_prefill.supports(torch.randn(5, 4, 24), k24, v24)  # not a whole number of vectors
    assert not cpu_prefill.supports(torch.randn(5, 4, 32), k_cache.transpose(1, 2), v_cache)


def prefill_step(seed: int = 9):
    query_lens, seq_lens = (20, 64), (20, 100)
    k_cache, v_cache, tables, g = paged_context(seq_lens, 16, 2, 32, torch.float32, seed=seed)
    query = torch.randn(sum(query_lens), 4, 32, generator=g)
    starts = torch.tensor((0, *query_lens)).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=0,
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    want = paged_prefill_attention_ref(query, k_cache, v_cache, tables, starts, meta.seq_lens, 0.2, query_lens)
    return query, k_cache, v_cache, meta, want


def test_the_backend_uses_the_kernel_for_float32_prefills(monkeypatch):
    calls = []
    kernel = cpu_prefill.prefill_attention_cpu
    monkeypatch.setattr(cpu_prefill, "prefill_attention_cpu", lambda *a: calls.append(1) or kernel(*a))
    query, k_cache, v_cache, meta, want = prefill_step()
    backend = TorchAttentionBackend()
    backend.warm_up(k_cache, v_cache)  # builds and checks the kernel (one call of its own)
    calls.clear()
    got = backend.attend(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert calls == [1]  # the step's two prompts in one call


def test_without_a_compiler_prefills_run_through_sdpa_and_the_log_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert "no-such-compiler" in check_prefill()
    cpu_prefill.load.cache_clear()
    query, k_cache, v_cache, meta, want = prefill_step()
    backend = TorchAttentionBackend()
    with caplog.at_level(logging.WARNING, logger="cluster.engine.attention.torch_backend"):
        got = backend.attend(query, k_cache, v_cache, meta, 0.2)
        backend.attend(query, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if "prefill attention kernel is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-compiler" in warnings[0]


def test_an_unwritable_kernel_cache_keeps_sdpa(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(blocker / "kernels"))  # a directory under a file
    assert "cannot write the kernel cache" in check_prefill()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.SWITCH_ENV, "0")
    assert f"{native.SWITCH_ENV}=0 turns them off" in check_prefill()


def test_the_build_is_cached_per_host_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(tmp_path))
    cpu_prefill.load()
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    mtime = built[0].stat().st_mtime_ns
    cpu_prefill.load.cache_clear()
    cpu_prefill.load()  # as the next process would: found, not rebuilt
    assert list(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == mtime
