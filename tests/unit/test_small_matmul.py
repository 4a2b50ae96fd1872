"""The compiled small-batch matmul (host-built, numba's where that cannot be built): same results as F.linear,
chosen only where it works and fits in memory, and taken only by decode-sized inputs."""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine import cpu_small_matmul
from cluster.engine import linear as linear_module
from cluster.engine.linear import (
    SMALL_MATMUL_ROWS,
    Linear,
    SmallRowsMatmul,
    choose_matmul,
    choose_small_rows_matmul,
    use_matmul,
)
from cluster.engine.native import small_matmul

small_rows_linear = small_matmul.small_rows_linear
KERNELS = {"native": small_matmul.small_rows_linear, "numba": cpu_small_matmul.small_rows_linear}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", range(1, SMALL_MATMUL_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(203, 77), (1037, 64)], ids=["small", "threaded"])
def test_kernel_matches_f_linear(kernel, rows, bias, shape):
    g = torch.Generator().manual_seed(rows)
    # Odd sizes, so no row block, vector or thread split divides them evenly (the larger one is split over
    # threads); a non-contiguous input (a column slice).
    out_dim, in_dim = shape
    weight = torch.randn(out_dim, in_dim, generator=g)
    b = torch.randn(out_dim, generator=g) if bias else None
    x = torch.randn(rows, in_dim + 13, generator=g)[:, 5 : 5 + in_dim]
    torch.testing.assert_close(KERNELS[kernel](x, weight, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_refuses_what_it_cannot_read(kernel):
    with pytest.raises(ValueError, match="float32"):
        KERNELS[kernel](torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous rows"):
        KERNELS[kernel](torch.randn(2, 8), torch.randn(8, 4).t())


def test_host_built_kernel_refuses_shapes_it_would_read_past():
    with pytest.raises(ValueError, match="inner sizes"):
        small_rows_linear(torch.randn(2, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match="bias"):
        small_rows_linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3))


def test_host_built_kernel_chosen_for_float32_cpu_only():
    assert choose_small_rows_matmul(torch.float32, "cpu") == SmallRowsMatmul(SMALL_MATMUL_ROWS, small_rows_linear)
    assert choose_small_rows_matmul(torch.bfloat16, "cpu") is None
    assert choose_small_rows_matmul(torch.float32, "meta") is None


def test_numba_kernel_where_the_host_built_one_cannot_be_built(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    small_matmul.load.cache_clear()  # as in a fresh process
    try:
        with caplog.at_level(logging.INFO):
            chosen = choose_small_rows_matmul(torch.float32, "cpu")
    finally:
        small_matmul.load.cache_clear()
    assert chosen == SmallRowsMatmul(SMALL_MATMUL_ROWS, cpu_small_matmul.small_rows_linear)
    [said] = [r.getMessage() for r in caplog.records if "small-batch matmul runs" in r.getMessage()]
    assert "numba's kernel" in said and "no-such-compiler" in said


def test_a_failing_or_wrong_kernel_is_not_used_and_says_why(caplog):
    def broken(x, weight, bias=None):
        raise RuntimeError("numba: Failed in nopython mode pipeline")

    def wrong(x, weight, bias=None):
        return F.linear(x, weight, bias) + 1e-2

    with caplog.at_level(logging.WARNING):
        assert choose_small_rows_matmul(torch.float32, "cpu", candidate=broken) is None
        assert choose_small_rows_matmul(torch.float32, "cpu", candidate=wrong) is None
    warnings = [r.getMessage() for r in caplog.records if "small-batch matmul is unavailable" in r.getMessage()]
    assert len(warnings) == 2 and "nopython" in warnings[0] and "differ" in warnings[1]


def _model(g):
    model = nn.Module()
    model.embed = nn.Embedding(10, 16)
    model.proj = Linear(16, 24)
    model.head = Linear(16, 10, bias=False)
    model.head.weight = model.embed.weight  # tied: never packed
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def test_small_inputs_take_the_kernel_on_the_plain_weight_and_large_ones_the_packed_matmul(monkeypatch):
    main = choose_matmul(torch.float32, "cpu")
    if main.pack is None:
        pytest.skip("oneDNN cannot pack weights on this CPU/build")
    g = torch.Generator().manual_seed(3)
    model = _model(g)
    calls: list[int] = []

    def counting(x, weight, bias=None):
        calls.append(x.shape[0])
        return small_rows_linear(x, weight, bias)

    small = SmallRowsMatmul(SMALL_MATMUL_ROWS, counting)
    plain = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, Linear)}
    assert linear_module.use_small_rows_matmul(model, small, will_pack=True, memory_bytes=2**40)
    linear_module.pack_weights(model, main.pack)
    use_matmul(model, main.fn)
    assert model.proj.weight.is_mkldnn and not model.proj.plain_weight.is_mkldnn
    assert model.head.plain_weight.data_ptr() == model.embed.weight.data_ptr()  # tied: no copy
    with torch.inference_mode():
        for rows in (1, SMALL_MATMUL_ROWS, SMALL_MATMUL_ROWS + 1, 100):
            x = torch.randn(rows, 16, generator=g)
            torch.testing.assert_close(model.proj(x), F.linear(x, plain["proj"], model.proj.bias), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.head(x), F.linear(x, plain["head"]), atol=1e-4, rtol=1e-4)
    assert calls == [1, 1, SMALL_MATMUL_ROWS, SMALL_MATMUL_ROWS]  # proj and head each, small inputs only


def test_off_when_the_plain_copies_would_take_too_much_memory(caplog):
    model = _model(torch.Generator().manual_seed(4))
    small = SmallRowsMatmul(SMALL_MATMUL_ROWS, small_rows_linear)
    packed_bytes = model.proj.weight.numel() * 4  # the tied head is not packed, so it costs nothing extra
    with caplog.at_level(logging.WARNING):
        assert not linear_module.use_small_rows_matmul(
            model, small, will_pack=True, memory_bytes=int(packed_bytes / linear_module.SMALL_ROWS_MEMORY_SHARE) - 1
        )
    assert model.proj.small is None and not hasattr(model.proj, "plain_weight")
    assert sum("small-batch matmul is off" in r.getMessage() for r in caplog.records) == 1
    # Without packing the kernel reads the weights the main matmul reads: no copy, so no limit.
    assert linear_module.use_small_rows_matmul(model, small, will_pack=False, memory_bytes=0)
    assert model.proj.plain_weight.data_ptr() == model.proj.weight.data_ptr()


def test_engine_decode_steps_use_the_kernel(demo_model, monkeypatch):
    from cluster.config import SamplingParams
    from cluster.engine.llm_engine import LLMEngine
    from tests.helpers import engine_config

    rows: list[int] = []
    real = small_matmul.small_rows_linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return real(x, weight, bias)

    monkeypatch.setattr(small_matmul, "small_rows_linear", spy)
    engine = LLMEngine(engine_config(demo_model))
    assert engine.small_rows_matmul
    rows.clear()  # the choice's probe
    engine.generate([[5, 6, 7] * 10], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # The 30-token prefill takes the main matmul except the LM head (it reads the last row only); decodes take
    # the kernel in every linear.
    assert rows and max(rows) == 1
