"""Greedy output is token-for-token what transformers generates, whatever the scheduling."""

import json

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.cli import main as cli_main
from tests.conftest import PARITY_SPECS
from tests.helpers import engine_config, random_prompts

MAX_TOKENS = 20
# 1 token up to several blocks of 16, including exactly one block and one past a boundary.
PROMPT_LENGTHS = [1, 5, 16, 17, 33, 64, 90]


def hf_greedy(model_dir, prompts, max_tokens=MAX_TOKENS):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for p in prompts:
        gen = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_tokens,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(model_factory):
    """name -> (model_dir, prompts, transformers' greedy tokens)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = model_factory(name)
            prompts = random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, 512, seed=hash(name) % 1000)
            cache[name] = (path, prompts, hf_greedy(path, prompts))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(PARITY_SPECS))
def test_run_batch_matches_transformers_greedy(name, reference, tmp_path):
    path, prompts, expected = reference(name)
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
            f.write(
                json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
            )
    assert (
        cli_main(["run-batch", "-i", str(infile), "-o", str(outfile), "--model", str(path), "--num-blocks", "128"]) == 0
    )
    records = [json.loads(line) for line in outfile.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [f"req-{i}" for i in range(len(prompts))]
    for rec, p, exp in zip(records, prompts, expected, strict=False):
        choice = rec["response"]["body"]["choices"][0]
        assert choice["token_ids"] == exp, f"prompt of {len(p)} tokens diverged"
        assert choice["finish_reason"] == "length"
        assert rec["response"]["body"]["usage"]["prompt_tokens"] == len(p)
        assert rec["response"]["body"]["usage"]["completion_tokens"] == MAX_TOKENS


def _run(engine, prompts, add_midway=False):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if not add_midway:
        res = [r["token_ids"] for r in engine.generate(prompts, params)]
    else:
        tokens = {i: [] for i in range(len(prompts))}
        half = len(prompts) // 2
        for i in range(half):
            engine.add_request(str(i), prompts[i], params)
        steps = 0
        while engine.has_unfinished_requests() or steps < 3:
            steps += 1
            if steps == 3:  # the rest arrive while the first half is mid-prefill / decoding
                for i in range(half, len(prompts)):
                    engine.add_request(str(i), prompts[i], params)
            for out in engine.step():
                tokens[int(out.request_id)].extend(out.new_token_ids)
        res = [tokens[i] for i in range(len(prompts))]
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_used_blocks == 0
    return res


@pytest.mark.parametrize(
    "variant",
    ["chunk16", "chunk64", "unlimited", "tiny-pool-preempts", "no-prefix-cache", "midway"],
)
def test_same_tokens_whatever_the_scheduling(variant, reference):
    path, prompts, expected = reference("llama-mha-untied")
    # Repeat prompts so prefix caching has something to hit.
    prompts2, expected2 = prompts + prompts[4:], expected + expected[4:]
    kw = dict(num_blocks=256, budget=4096)
    if variant == "chunk16":
        kw |= dict(budget=16)
    elif variant == "chunk64":
        kw |= dict(budget=64)
    elif variant == "tiny-pool-preempts":
        kw |= dict(num_blocks=14, budget=4096)
    elif variant == "no-prefix-cache":
        kw |= dict(prefix=False)
    engine = LLMEngine(engine_config(path, **kw))
    assert _run(engine, prompts2, add_midway=variant == "midway") == expected2
    if variant == "tiny-pool-preempts":
        assert engine.scheduler.num_preemptions > 0
    if variant in ("midway", "chunk16"):  # duplicates arrive after the originals are cached
        assert engine.block_pool.num_cache_hits > 0
    if variant == "no-prefix-cache":
        assert engine.block_pool.num_cache_hits == 0


def test_n_copies_of_a_prompt_compute_it_once_and_match_a_lone_run(demo_model):
    """What the edge does for n > 1 (n engine requests with one prompt): one computes the prompt, the others take
    its blocks from the prefix cache, and every copy's greedy tokens equal a lone request's."""
    prompt = random_prompts(1, [70], 512, seed=4)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    lone = LLMEngine(engine_config(demo_model, num_blocks=64)).generate([prompt], params)[0]["token_ids"]
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    for i in range(3):
        engine.add_request(f"c{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"c{i}": [] for i in range(3)}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert all(t == lone for t in tokens.values())
    assert sorted(cached.values()) == [0, 64, 64]  # 4 of the prompt's 4 full blocks from the cache
