"""The model's linear layer and the choice of its matmul: oneDNN where it runs, F.linear everywhere else
(the small-batch kernel beside it: test_small_matmul)."""

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


def test_packed_weights_compute_the_same_and_tied_weights_stay_plain():
    from torch import nn

    if choose_matmul(torch.float32, "cpu").pack is None:
        pytest.skip("oneDNN cannot pack weights on this CPU/build")
    choice = choose_matmul(torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    model = nn.Module()
    model.embed = nn.Embedding(10, 16)
    model.proj = Linear(16, 24)
    model.head = Linear(16, 10, bias=False)
    model.head.weight = model.embed.weight  # tied
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(5, 16, generator=g)
    want = [F.linear(x, model.proj.weight, model.proj.bias), F.linear(x, model.head.weight)]
    assert linear_module.pack_weights(model, choice.pack) == 1
    use_matmul(model, choice.fn)
    assert model.proj.weight.is_mkldnn and not model.head.weight.is_mkldnn
    with torch.inference_mode():
        torch.testing.assert_close(model.proj(x), want[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.head(x), want[1], atol=1e-4, rtol=1e-4)


def test_a_pack_that_fails_keeps_onednn_on_plain_weights():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")

    def broken_pack(weight):
        raise RuntimeError("no blocked layout here")

    choice = choose_matmul(torch.float32, "cpu", pack=broken_pack)
    assert choice.name == "onednn" and choice.pack is None
