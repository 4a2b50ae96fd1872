"""The model's linear layer: oneDNN on CPU, same results and state-dict names as nn.Linear."""

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.linear import Linear, linear


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_torch(dtype, tol, bias):
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
        x = x.to(dtype)
        with torch.inference_mode():
            got = layer(x)
        ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        assert got.dtype == dtype and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


def test_linear_keeps_nn_linear_state_dict_names():
    assert set(Linear(4, 2, bias=True).state_dict()) == {"weight", "bias"}
    assert linear(torch.ones(1, 2), torch.ones(3, 2)).tolist() == [[2.0, 2.0, 2.0]]
