"""The whole engine with attention_backend="triton" generates the same greedy tokens as "torch"."""

from __future__ import annotations

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.attention.triton.backend import TritonAttentionBackend
from cluster.engine.llm_engine import LLMEngine
from tests.helpers import engine_config, random_prompts

pytestmark = pytest.mark.kernels

# 1 token, exactly one block, one past a boundary, several blocks; repeats hit the prefix cache.
PROMPT_LENGTHS = [1, 5, 16, 17, 40]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Natively on a GPU (both engines on CUDA), else the Triton interpreter on CPU (tests/kernels/conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _generate(path, backend, prompts):
    # A budget of 24 tokens chunks the longer prompts, so steps mix decodes with prefill
    # chunks that attend to their own cached prefix.
    engine = LLMEngine(
        engine_config(path, block_size=16, num_blocks=64, budget=24, attention_backend=backend, device=DEVICE)
    )
    batches = []
    attend = engine.backend.attend

    def spy(query, k_cache, v_cache, meta, scale, **new_kv):
        batches.append((meta.num_decodes, meta.num_prefills))
        return attend(query, k_cache, v_cache, meta, scale, **new_kv)

    engine.backend.attend = spy
    tokens = [r["token_ids"] for r in engine.generate(prompts, PARAMS)]
    return engine, tokens, batches


@pytest.mark.parametrize("name", ["default", "llama3-gqa-tied"])
def test_triton_engine_matches_torch_engine(name, model_factory):
    path = model_factory(name)
    prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=7)
    prompts += prompts[2:]  # duplicates reuse cached blocks

    _, expected, _ = _generate(path, "torch", prompts)
    engine, got, batches = _generate(path, "triton", prompts)

    assert isinstance(engine.backend, TritonAttentionBackend)
    assert got == expected
    assert any(d and p for d, p in batches), "no step mixed decodes with prefills"
    assert engine.block_pool.num_cache_hits > 0
