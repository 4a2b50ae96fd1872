"""Sampling: greedy, temperature, top-k, top-p, seeds, logprobs; stop conditions through the engine."""

import dataclasses
import math

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.sampler import sample
from tests.helpers import History, engine_config


def logits_row(values):
    return torch.tensor([values], dtype=torch.float32)


def test_greedy_is_argmax_and_reports_raw_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, logprobs=True)
    out = sample(logits, [p, SamplingParams(temperature=0.0)], [None, None])
    assert out.token_ids == [1, 0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert out.logprobs[1] is None


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        out = sample(logits, [p] * 16, [None] * 16)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = logits_row([4.0, 3.0, 2.0, 1.0, 0.0]).repeat(400, 1)
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 400, [None] * 400)
    assert set(out.token_ids) == {0, 1}
    # probs ~ [.64, .24, .09, ...]: top_p=0.8 keeps tokens 0 and 1 (mass before token 2 is .87 >= .8)
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 400, [None] * 400)
    assert set(out.token_ids) == {0, 1}


def test_sampling_follows_the_tempered_distribution():
    logits = logits_row([math.log(0.7), math.log(0.3)]).repeat(4000, 1)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 4000, [None] * 4000)
    share = sum(1 for t in out.token_ids if t == 0) / 4000
    assert 0.66 < share < 0.74
    hot = sample(logits, [SamplingParams(temperature=100.0)] * 4000, [None] * 4000)
    share_hot = sum(1 for t in hot.token_ids if t == 0) / 4000
    assert 0.45 < share_hot < 0.55


def test_seed_makes_a_request_reproducible_whatever_its_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[i : i + 1], [p], [torch.Generator().manual_seed(1234)]).token_ids[0] for i in range(3)]
    batch = sample(logits, [p] * 3, [torch.Generator().manual_seed(1234) for _ in range(3)]).token_ids
    assert alone == batch


def test_engine_seeded_generation_repeats_and_differs_by_seed(demo_model):
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    prompt = [[5, 6, 7, 8]]
    a = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    b = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    c = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=8, ignore_eos=True))
    assert a[0]["token_ids"] == b[0]["token_ids"] != c[0]["token_ids"]


def test_stop_token_ids_max_tokens_and_eos(demo_model):
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    prompt = [[9, 10, 11]]
    free = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert len(free["token_ids"]) == 10 and free["finish_reason"] == "length"
    stop_tok = free["token_ids"][3]
    first = free["token_ids"].index(stop_tok)
    stopped = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_tok,)))[0]
    assert stopped["token_ids"] == free["token_ids"][: first + 1] and stopped["finish_reason"] == "stop"
    # eos (id 2 in the demo model) stops unless ignore_eos
    engine.eos_token_ids = {stop_tok}
    eos = engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert eos["token_ids"] == free["token_ids"][: first + 1] and eos["finish_reason"] == "stop"
    assert engine.block_pool.num_used_blocks == 0


def test_stop_strings_truncate_text(demo_model):
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    prompt = [[20, 21, 22, 23]]
    free = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    text = free["text"]
    stop = text[5:8]
    assert len(stop) == 3
    out = engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,)))[0]
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.index(stop)]
    incl = engine.generate(
        prompt,
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True),
    )[0]
    assert incl["text"] == text[: text.index(stop) + 3]


def test_logprobs_match_a_full_forward(demo_model):
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    out = engine.generate(
        [[30, 31, 32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    )[0]
    assert len(out["logprobs"]) == 4 and all(lp <= 0 for lp in out["logprobs"])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(demo_model)
    ids = torch.tensor([[30, 31, 32] + out["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
    expected = [logp[2 + i, t].item() for i, t in enumerate(out["token_ids"])]
    assert out["logprobs"] == pytest.approx(expected, abs=1e-4)


def test_seeded_request_continues_identically_after_remote_prefill(demo_model):
    """Prefill on one engine, decode on another from transferred KV: same tokens as one engine."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    prompt = list(range(40, 60))
    local = LLMEngine(engine_config(demo_model, num_blocks=64)).generate([prompt], params)[0]["token_ids"]

    prefill = LLMEngine(engine_config(demo_model, num_blocks=64))
    # As the prefill replica does: one token, then the finished request's blocks are held for the transfer.
    prefill.add_request("r", prompt, dataclasses.replace(params, max_tokens=1), hold_kv_on_finish=True)
    first = [t for o in prefill.step() for t in o.new_token_ids]
    decode = LLMEngine(engine_config(demo_model, num_blocks=64))
    res = decode.reserve_remote_kv("r", prompt, params)
    src, dst = prefill.held_kv_blocks("r"), list(res.block_ids)
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]
    decode.complete_remote_kv("r", first[0])
    tokens = []
    while decode.has_unfinished_requests():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == local


def test_held_kv_blocks_of_a_request_still_running_are_refused(demo_model):
    """Only a finished prefill's blocks are whole: asking for a running request's is a caller's bug, not a send."""
    engine = LLMEngine(engine_config(demo_model, num_blocks=64))
    engine.add_request("r", list(range(40, 60)), SamplingParams(max_tokens=4, ignore_eos=True), hold_kv_on_finish=True)
    engine.step()  # prefilled, 3 tokens to go
    with pytest.raises(RuntimeError, match="has not finished its prefill"):
        engine.held_kv_blocks("r")
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.held_kv_blocks("r")) == 2  # 20 prompt tokens in 16-token blocks


def test_top_logprobs_are_each_rows_most_likely_tokens_under_the_raw_distribution():
    torch.manual_seed(2)
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=4),
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, logprobs=True, top_logprobs=2, logit_bias=((7, 50.0),)),
    ]
    out = sample(logits, params, [None] * 3, [History([1])] * 3)
    raw = torch.log_softmax(logits, dim=-1)
    values, ids = raw[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist() == [out.token_ids[0], *ids.tolist()[1:]]
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(values.tolist())
    assert out.top_logprobs[1] == ()
    # logit_bias forces token 7, but the alternatives (like the logprob) describe the model's own distribution
    assert out.token_ids[2] == 7 and [t for t, _ in out.top_logprobs[2]] == raw[2].topk(2).indices.tolist()
    assert out.logprobs[2] == pytest.approx(raw[2, 7].item())


def _top_p_reference(logits_row: torch.Tensor, top_p: float) -> dict[int, float]:
    """The top-p distribution by a full sort (the definition): token -> probability."""
    probs = torch.softmax(logits_row.double(), -1)
    values, order = probs.sort(descending=True)
    keep = (values.cumsum(-1) - values) < top_p
    keep[0] = True
    kept = values[keep] / values[keep].sum()
    return dict(zip(order[keep].tolist(), kept.tolist(), strict=True))


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_over_a_large_vocabulary_draws_the_exact_distribution(peaked):
    """Peaked: the cut lies among the first candidates (no sort); flat: beyond them (the full-sort fallback).
    Either way the support is the definition's and the frequencies follow its probabilities."""
    torch.manual_seed(5)
    vocab, n = 1000, 20000
    row = torch.randn(vocab) * (4.0 if peaked else 0.5)
    want = _top_p_reference(row, 0.8)
    assert (len(want) < 256) == peaked
    out = sample(row.repeat(n, 1), [SamplingParams(temperature=1.0, top_p=0.8)] * n, [None] * n)
    counts: dict[int, int] = {}
    for t in out.token_ids:
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(want)
    for token, p in sorted(want.items(), key=lambda kv: -kv[1])[:5]:
        assert abs(counts.get(token, 0) / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, token


def test_seeded_draws_continue_where_a_skipped_draw_left_off():
    """A decode worker continuing a seeded request sampled elsewhere skips exactly one draw (skip_one_draw)."""
    from cluster.engine.sampler import skip_one_draw

    torch.manual_seed(3)
    logits = torch.randn(2, 300)
    p = SamplingParams(temperature=1.0, seed=99)
    here = torch.Generator().manual_seed(99)
    both = [sample(logits[i : i + 1], [p], [here]).token_ids[0] for i in range(2)]
    there = torch.Generator().manual_seed(99)
    skip_one_draw(there)
    assert sample(logits[1:2], [p], [there]).token_ids[0] == both[1]
