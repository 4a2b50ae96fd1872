"""Half-precision engines (bfloat16, float16) against transformers in the same dtype.

Greedy tokens can legitimately part ways in 16-bit arithmetic, so the engine's own tokens are
fed to transformers and the logprob of each one is compared: prefill (SDPA) and every decode
step (bucketed SDPA; the compiled kernel is float32-only) have to track the reference.
"""

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from tests.helpers import engine_config, random_prompts

TOLERANCE = {"bfloat16": 0.05, "float16": 0.01}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_logprobs_track_transformers(demo_model, dtype):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(3, [5, 40, 70], 512, seed=4)
    engine = LLMEngine(engine_config(demo_model, dtype=dtype, budget=64))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)
    results = engine.generate(prompts, params)

    hf = AutoModelForCausalLM.from_pretrained(demo_model, dtype=getattr(torch, dtype)).eval()
    for prompt, result in zip(prompts, results, strict=False):
        tokens = result["token_ids"]
        assert len(tokens) == 8 and len(result["logprobs"]) == 8
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        got = torch.tensor(result["logprobs"])
        assert torch.allclose(got, expected, atol=TOLERANCE[dtype]), f"{dtype}: {got} vs {expected}"
