"""The float32 CPU kernels for a layer's norms, residual adds and rotary embedding (host-built C++ and numba's)
compute what the torch reference computes, at decode and prefill sizes (either side of their parallel thresholds),
and the engine takes them only where they work."""

import logging

import pytest
import torch

from cluster.engine import cpu_layer_kernels as kernels
from cluster.engine import layer_ops
from cluster.engine.layer_ops import (
    TORCH_LAYER_OPS,
    add_rms_norm_ref,
    choose_layer_ops,
    rms_norm_ref,
    rotary_qk_ref_,
)
from cluster.engine.native import elementwise

ROWS = [1, 7, kernels.PARALLEL_ROWS - 1, kernels.PARALLEL_ROWS, 300]
#: Both compiled implementations: numba's, and the host-built C++ ones (the engine's first choice).
IMPLS = {"numba": kernels, "native": elementwise}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


def _tables(positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((angles, angles), -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("rows", ROWS)
def test_norms_match_the_reference(impl, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 96, generator=g) * 3, torch.randn(rows, 96, generator=g)
    weight = torch.rand(96, generator=g) + 0.5
    torch.testing.assert_close(impl.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), rtol=1e-5, atol=1e-5)
    x_before = x.clone()
    got, got_sum = impl.add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = add_rms_norm_ref(x_before, residual, weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_sum, want_sum, rtol=1e-6, atol=1e-6)
    assert got_sum.data_ptr() == x.data_ptr()  # the sum went into x, as documented: no extra buffer


@pytest.mark.parametrize("rows", ROWS)
def test_rotary_matches_the_reference_and_leaves_v_alone(impl, rows):
    g = torch.Generator().manual_seed(100 + rows)
    q_heads, kv_heads, head_dim = 4, 2, 16
    cos, sin = _tables(2048, head_dim)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.randint(0, 2048, (rows,), generator=g)
    got, want = qkv.clone(), qkv.clone()
    impl.rotary_qk_(got, positions, q_heads + kv_heads, head_dim, cos, sin)
    rotary_qk_ref_(want, positions, q_heads + kv_heads, head_dim, cos, sin)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    v_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(got[:, v_start:], qkv[:, v_start:])


def test_rotary_works_in_place_on_a_slice_of_a_wider_buffer(impl):
    """The engine rotates the qkv matmul's output; a row-strided slice (a chunk of a bigger batch) works too."""
    cos, sin = _tables(64, 8)
    wide = torch.randn(5, 40)
    view = wide[1:4]
    want = view.clone()
    rotary_qk_ref_(want, torch.tensor([0, 5, 63]), 3, 8, cos, sin)
    impl.rotary_qk_(view, torch.tensor([0, 5, 63]), 3, 8, cos, sin)
    torch.testing.assert_close(wide[1:4], want, rtol=1e-5, atol=1e-5)


def test_kernels_refuse_a_tensor_without_contiguous_rows(impl):
    with pytest.raises(ValueError, match="contiguous rows"):
        impl.rms_norm(torch.randn(8, 4).t(), torch.ones(8), 1e-6)


def test_the_host_built_rotary_refuses_a_position_past_its_table():
    cos, sin = _tables(64, 8)
    qkv = torch.randn(2, 40)
    before = qkv.clone()
    with pytest.raises(IndexError, match="64 positions"):
        elementwise.rotary_qk_(qkv, torch.tensor([3, 64]), 3, 8, cos, sin)
    assert torch.equal(qkv, before)


def test_float32_cpu_engines_get_the_host_built_kernels():
    ops = choose_layer_ops(torch.float32, "cpu")
    assert ops.name == "native" and ops.silu_mul is elementwise.silu_mul


def off_by_a_little(x, residual, weight, eps):
    out, summed = add_rms_norm_ref(x, residual, weight, eps)
    return out * 1.001, summed


def test_numba_kernels_stand_in_where_the_host_built_ones_are_wrong(monkeypatch, caplog):
    monkeypatch.setattr(elementwise, "add_rms_norm", off_by_a_little)
    with caplog.at_level(logging.WARNING):
        chosen = choose_layer_ops(torch.float32, "cpu")
    assert chosen.name == "compiled"
    assert [r.getMessage() for r in caplog.records] == [
        "the host-built layer kernels are unavailable (their results differ from the torch reference's); trying numba's"
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_and_devices_use_torch_ops_without_probing(dtype, monkeypatch):
    monkeypatch.setattr(layer_ops, "_probe", lambda ops: pytest.fail("probed"))
    assert choose_layer_ops(dtype, "cpu") is TORCH_LAYER_OPS
    assert choose_layer_ops(torch.float32, "meta") is TORCH_LAYER_OPS


def test_a_wrong_kernel_is_not_used_and_the_reason_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(elementwise, "add_rms_norm", off_by_a_little)
    monkeypatch.setattr(kernels, "add_rms_norm", off_by_a_little)
    with caplog.at_level(logging.WARNING):
        chosen = choose_layer_ops(torch.float32, "cpu")
    assert chosen.name == "torch" and "differ" in chosen.fallback_reason
    assert [r.getMessage() for r in caplog.records].count(
        "the compiled CPU layer kernels are unavailable (their results differ from the torch reference's); "
        "norms and rotary run as torch ops"
    ) == 1
