"""CPU fast paths degrade to the portable ones: an engine on a CPU without oneDNN's bfloat16 or a working
numba kernel still starts, still matches transformers, and says once why it took the slow path."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cluster.config import SamplingParams
from cluster.engine import cpu_features, cpu_layer_kernels, cpu_small_matmul
from cluster.engine import linear as linear_module
from cluster.engine.attention import cpu_decode, cpu_prefill, native_decode
from cluster.engine.attention.torch_backend import NATIVE_DECODE, NATIVE_PREFILL, NATIVE_WRITE, NUMBA_DECODE
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.native import elementwise, small_matmul
from cluster.tools.cli import main as cli_main
from tests.helpers import engine_config, random_prompts
from tests.unit.test_engine_parity import hf_greedy

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = [1, 5, 17, 33, 90]
MAX_TOKENS = 20
#: Logit gaps that 16-bit rounding can flip (the logprob tolerances of test_engine_dtypes).
NEAR_TIE = {"bfloat16": 0.05, "float16": 0.01}


def _no_primitive(*args, **kwargs):
    raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation primitive")


def _kernel_broken(*args, **kwargs):
    raise RuntimeError("numba: Failed in nopython mode pipeline")


def test_engine_without_any_fast_path_matches_transformers(demo_model, monkeypatch, caplog, tmp_path):
    """What a CPU without oneDNN linear, without numba and without a C++ compiler gets: F.linear, SDPA and torch's
    element-wise ops, same greedy tokens."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SHAPESERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    for load in (elementwise.load, cpu_prefill.load, native_decode.load, small_matmul.load):
        load.cache_clear()  # as in a fresh process (a failed load is not cached: later tests build again)
    monkeypatch.setattr(linear_module, "onednn_linear", _no_primitive)
    monkeypatch.setattr(cpu_decode, "paged_decode_attention_cpu", _kernel_broken)
    monkeypatch.setattr(cpu_layer_kernels, "add_rms_norm", _kernel_broken)
    monkeypatch.setattr(cpu_small_matmul, "small_rows_linear", _kernel_broken)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=21)
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(engine_config(demo_model))
        results = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert engine.matmul.fn is F.linear and "primitive descriptor" in engine.matmul.fallback_reason
    assert engine.backend.checked == {
        NATIVE_DECODE: False,
        NUMBA_DECODE: False,
        NATIVE_PREFILL: False,
        NATIVE_WRITE: False,
    }
    assert engine.model.layer_ops.name == "torch" and "nopython" in engine.model.layer_ops.fallback_reason
    assert not engine.small_rows_matmul
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("using torch's F.linear" in w for w in warnings) == 1
    assert sum("decodes run through SDPA" in w for w in warnings) == 1
    assert sum("norms and rotary run as torch ops" in w for w in warnings) == 1
    assert sum("small-batch matmul is unavailable" in w for w in warnings) == 1
    for kernel in ("host-built layer kernels", NATIVE_DECODE, NATIVE_PREFILL, NATIVE_WRITE):
        assert sum(kernel in w and "no-such-compiler" in w for w in warnings) == 1, kernel
    assert [r["token_ids"] for r in results] == hf_greedy(demo_model, prompts, MAX_TOKENS)


def test_engine_uses_the_fast_paths_where_they_work(demo_model):
    engine = LLMEngine(engine_config(demo_model))
    # numba's decode kernel is not even compiled: the host-built one came first.
    assert engine.backend.checked == {NATIVE_DECODE: True, NATIVE_PREFILL: True, NATIVE_WRITE: True}
    assert engine.model.layer_ops.name == "native"
    assert engine.small_rows_matmul
    if torch.backends.mkldnn.is_available():
        assert engine.matmul.name == "onednn"


def test_an_engine_with_the_host_built_kernels_starts_without_numba(demo_model):
    """numba is the fallback of hosts without a compiler: its import and cached kernels took ~1.5 s of a replica's
    start, so an engine whose host-built kernels work must not import it at all (a fresh process, as a replica)."""
    code = (
        "import sys\n"
        "from cluster.engine.llm_engine import LLMEngine\n"
        "from tests.helpers import engine_config\n"
        f"engine = LLMEngine(engine_config({str(demo_model)!r}))\n"
        "assert engine.small_rows_matmul and engine.model.layer_ops.name == 'native'\n"
        "print('numba imported' if 'numba' in sys.modules else 'no numba')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "no numba"


def _hf_next_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_run_batch_half_precision_matches_transformers_greedy(demo_model, dtype, tmp_path):
    """``shapeserve run-batch --dtype bfloat16|float16`` completes on any CPU, and its greedy tokens are
    transformers' in the same dtype; where they part, transformers itself saw a near-tie between the two."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=11)
    infile, outfile = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with infile.open("w") as f:
        for i, p in enumerate(prompts):
            body = {
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            f.write(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    argv = ["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(demo_model), "--dtype", dtype]
    assert cli_main(argv + ["--num-blocks", "128"]) == 0
    got = [json.loads(line)["response"]["body"]["choices"][0]["token_ids"] for line in outfile.read_text().splitlines()]

    hf = AutoModelForCausalLM.from_pretrained(demo_model, dtype=getattr(torch, dtype)).eval()
    exact = 0
    for prompt, tokens in zip(prompts, got, strict=False):
        assert len(tokens) == MAX_TOKENS
        # Walk transformers' greedy decode along the engine's tokens.
        for i, token in enumerate(tokens):
            logits = _hf_next_logits(hf, prompt + tokens[:i])
            best = int(logits.argmax())
            if best != token:
                margin = float(logits[best] - logits[token])
                assert margin <= NEAR_TIE[dtype], (
                    f"{dtype}: token {i} is {token}, transformers' is {best} by a margin of {margin:.4f}"
                )
                break
        else:
            exact += 1
    assert exact >= len(prompts) - 1, f"only {exact} of {len(prompts)} {dtype} outputs equal transformers' greedy"


def test_advice_on_emulated_half_precision(monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(cpu_features, "slowdown_vs_float32", lambda dtype, matmul: 5.0)
    with caplog.at_level(logging.WARNING, logger="cluster.engine.cpu_features"):
        message = cpu_features.advise_dtype(torch.bfloat16)
    assert "no native bfloat16 matmuls (no AVX512-BF16 or AMX-BF16)" in message
    assert "5.0x" in message and "--dtype float32 is faster here" in message
    assert caplog.records[0].getMessage() == message
    assert cpu_features.advise_dtype(torch.float32) == ""


def test_no_advice_where_half_precision_is_native(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16", "amx_fp16"}))
    assert cpu_features.advise_dtype(torch.bfloat16) == "" and cpu_features.advise_dtype(torch.float16) == ""
