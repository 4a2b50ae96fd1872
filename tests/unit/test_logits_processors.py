"""logit_bias, min_tokens, min_p and the penalties: batched, checked against transformers' own processors, and
through the engine (min_tokens holds back EOS, stop ids and stop strings)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.logits_processors import process_logits
from cluster.engine.sampler import sample
from cluster.errors import InvalidRequestError
from tests.helpers import History, engine_config

VOCAB = 40


def test_a_batch_that_asks_for_nothing_is_returned_untouched():
    logits = torch.randn(3, VOCAB)
    plain = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0), SamplingParams()]
    assert process_logits(logits, plain, [History([1])] * 3, [2]) is logits


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    histories = [History([3, 4, 4, 9], [9, 11]), History([30], [])]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    got = process_logits(logits, params, histories, [])
    for row, (h, p) in enumerate(zip(histories, params, strict=True)):
        ids = torch.tensor([h.prompt_token_ids + h.output_token_ids])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[row : row + 1].clone())
        torch.testing.assert_close(got[row : row + 1], want)


def test_presence_and_frequency_penalties_count_only_the_output():
    logits = torch.zeros(1, VOCAB)
    history = History(prompt_token_ids=[7, 7, 7], output_token_ids=[5, 5, 5, 8])
    got = process_logits(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [history], [])[0]
    assert got[5].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert got[8].item() == pytest.approx(-(0.5 + 0.25))
    assert got[7].item() == 0.0  # in the prompt only: OpenAI's penalties look at generated tokens
    assert (got[[i for i in range(VOCAB) if i not in (5, 8)]] == 0).all()


def test_logit_bias_bans_and_forces_tokens_in_its_own_row_only():
    logits = torch.zeros(3, VOCAB)
    logits[:, 4] = 10.0  # every row's favourite
    params = [
        SamplingParams(temperature=0.0, logit_bias=((4, -100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)),
        SamplingParams(temperature=0.0),
    ]
    assert sample(logits, params, [None] * 3, [History([1])] * 3).token_ids[1:] == [17, 4]
    hot = [SamplingParams(temperature=1.0, logit_bias=((4, -100.0),))] * 200
    assert 4 not in sample(logits[:1].repeat(200, 1), hot, [None] * 200, [History([1])] * 200).token_ids


def test_min_tokens_holds_back_eos_and_the_requests_stop_ids_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 50.0  # EOS is by far the most likely
    logits[:, 9] = 40.0  # then the request's stop id
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(9,))] * 2
    histories = [History([1], [20, 21]), History([1], [20, 21, 22])]  # 2 < 3 generated; 3 generated
    assert sample(logits, params, [None] * 2, histories, stop_token_ids=[2]).token_ids == [0, 2]


def test_min_p_keeps_the_support_transformers_keeps():
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB) * 2
    warped = MinPLogitsWarper(min_p=0.2)(torch.tensor([[1]]), logits.clone() / 0.8)
    support = set(torch.nonzero(warped[0] > float("-inf")).flatten().tolist())
    assert 1 < len(support) < VOCAB
    params = [SamplingParams(temperature=0.8, min_p=0.2)] * 3000
    drawn = set(sample(logits.repeat(3000, 1), params, [None] * 3000, [History([1])] * 3000).token_ids)
    assert drawn <= support and len(drawn) == len(support)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(min_tokens=20, max_tokens=10), "min_tokens"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(params, param):
    with pytest.raises(InvalidRequestError) as e:
        params.validate()
    assert e.value.param == param


def test_engine_min_tokens_delays_eos_stop_ids_and_stop_strings(demo_model):
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    first = free["token_ids"][0]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first,)))[0]
    assert (stopped["token_ids"], stopped["finish_reason"]) == ([first], "stop")
    held = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(first,), min_tokens=5)
    )[0]
    assert len(held["token_ids"]) > 5 and first not in held["token_ids"][:5]
    # A stop string found in the first min_tokens tokens' text does not end the output either.
    text = engine.tokenizer.decode(free["token_ids"][:2])
    at_once = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=(text,))
    assert len(engine.generate([prompt], at_once)[0]["token_ids"]) <= 2
    later = engine.generate([prompt], replace(at_once, min_tokens=6))[0]
    assert len(later["token_ids"]) > 6
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("x", prompt, SamplingParams(logit_bias=((10**6, 1.0),)))


def test_prompt_logprobs_match_transformers_across_chunks_and_preemptions(demo_model):
    """Every prompt token's logprob (from the second on) as transformers scores the same model, with a prompt
    prefilled in chunks, never from the prefix cache, and again after preemptions; ranks and alternatives agree
    with the same distribution."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(demo_model), torch_dtype=torch.float32)
    prompt = [5 + (i * 37) % 500 for i in range(70)]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = LLMEngine(engine_config(demo_model, num_blocks=64, budget=32, chunk=32))  # 3 chunks
    engine.generate([prompt[:40]], SamplingParams(max_tokens=1))  # its blocks are cached: they must not be used
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    scores = engine.generate([prompt], params)[0]["prompt_logprobs"]
    assert len(scores) == len(prompt) - 1
    for i, s in enumerate(scores):
        row, token = want[i], prompt[i + 1]
        assert s.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert s.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in s.top] == row.topk(3).indices.tolist()
    assert engine.generate([prompt], replace(params, prompt_logprobs=None))[0]["prompt_logprobs"] is None
    # Blocks for about one request at a time: the two preempt each other and compute their prompts again.
    tight = LLMEngine(engine_config(demo_model, num_blocks=9, budget=32, chunk=32))
    other = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    again = tight.generate([prompt[:30], prompt], [other, replace(params, max_tokens=40)])[1]["prompt_logprobs"]
    assert tight.scheduler.num_preemptions > 0
    assert [s.logprob for s in again] == pytest.approx([s.logprob for s in scores], abs=1e-5)
