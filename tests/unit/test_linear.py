"""The model's linear layer and the choice of its matmul: oneDNN where it runs, F.linear everywhere else."""

import logging

import pytest
import torch
import torch.nn.functional as F

from cluster.engine import linear as linear_module
from cluster.engine.linear import Linear, choose_matmul, use_matmul

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 1e-2)]


def _layer_outputs(dtype, bias, matmul):
    g = torch.Generator().manual_seed(0)
    # Decode-sized and prefill-sized rows, and a non-contiguous input (a slice of a wider tensor).
    inputs = (
        torch.randn(3, 64, generator=g),
        torch.randn(300, 64, generator=g),
        torch.randn(40, 80, generator=g)[:, 8:72],
    )
    for x in inputs:
        layer = Linear(64, 48, bias=bias)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(48, 64, generator=g))
            if bias:
                layer.bias.copy_(torch.randn(48, generator=g))
        layer = layer.to(dtype)
        use_matmul(layer, matmul)
        x = x.to(dtype)
        with torch.inference_mode():
            got = layer(x)
        ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        yield got, ref


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_chosen_matmul_matches_torch(dtype, tol, bias):
    """Whatever this CPU supports (oneDNN or the fallback), the layer computes F.linear."""
    for got, ref in _layer_outputs(dtype, bias, choose_matmul(dtype, "cpu").fn):
        assert got.dtype == dtype and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def _no_primitive(*args, **kwargs):
    raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation primitive")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failing_onednn_falls_back_to_f_linear_and_says_why(dtype, caplog):
    with caplog.at_level(logging.WARNING, logger="cluster.engine.linear"):
        choice = choose_matmul(dtype, "cpu", candidate=_no_primitive)
    assert choice.name == "torch" and choice.fn is F.linear
    assert "could not create a primitive descriptor" in choice.fallback_reason
    assert len(caplog.records) == 1 and "using torch's F.linear" in caplog.text


def test_a_wrong_onednn_is_not_used():
    choice = choose_matmul(torch.float32, "cpu", candidate=lambda x, w, b: F.linear(x, w, b) + 1)
    assert choice.name == "torch" and "differ" in choice.fallback_reason


def test_float16_and_other_devices_use_f_linear_without_probing():
    assert choose_matmul(torch.float16, "cpu", candidate=_no_primitive).fn is F.linear
    assert choose_matmul(torch.float32, "meta", candidate=_no_primitive).fn is F.linear


def test_onednn_is_chosen_where_it_works():
    """oneDNN's float32 inner product runs on every x86-64 CPU torch supports."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    assert choose_matmul(torch.float32, "cpu").name == "onednn"


def test_linear_keeps_nn_linear_state_dict_names():
    assert set(Linear(4, 2, bias=True).state_dict()) == {"weight", "bias"}
    layer = Linear(2, 3, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    assert layer(torch.ones(1, 2)).tolist() == [[2.0, 2.0, 2.0]]
    assert linear_module.Linear.matmul is F.linear  # the default before an engine chooses
