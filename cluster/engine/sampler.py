"""Token sampling for a batch of requests in one pass.

First the per-request logits processors (logit_bias, min_tokens, penalties: see
``logits_processors``). Then greedy rows take the argmax. Random rows apply temperature, min_p,
then top-k and top-p on one sorted copy of the logits, then sample with the exponential-race
trick (argmax(p / q), q ~ Exp(1)), which equals drawing from p and lets requests with a seed use
their own generator for q while the rest share one batched draw.
Logprobs are of the chosen token under the model's raw distribution (before any processing or
temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.config import SamplingParams
from cluster.engine.logits_processors import TokenHistory, process_logits
from cluster.scores import Alternatives, TokenScore


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    #: Logprob of each chosen token, or None where the request did not ask for logprobs.
    logprobs: list[float | None]
    #: Each row's ``top_logprobs`` most likely tokens, () where the request asked for none.
    top_logprobs: list[Alternatives]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[TokenHistory] = (),
    stop_token_ids: Sequence[int] = (),
) -> SamplerOutput:
    """logits: [batch, vocab] float32, one row per request. Does not modify ``logits``.

    ``histories``: each row's tokens so far, needed when a request uses penalties or min_tokens;
    ``stop_token_ids``: the model's EOS ids, which min_tokens holds back."""
    batch, vocab = logits.shape
    processed = process_logits(logits, params, histories, stop_token_ids)
    greedy = [p.greedy for p in params]
    if all(greedy):
        chosen = processed.argmax(dim=-1)
    else:
        chosen = _sample_random(processed, params, generators, greedy)
    token_ids = chosen.tolist()
    logprobs: list[float | None] = [None] * batch
    top: list[Alternatives] = [()] * batch
    wants = [i for i, p in enumerate(params) if p.logprobs]
    if wants:
        rows = torch.tensor(wants)
        all_lps = torch.log_softmax(logits[rows], dim=-1)
        lp = all_lps.gather(1, chosen[rows, None]).squeeze(1).tolist()
        for i, v in zip(wants, lp, strict=True):
            logprobs[i] = v
        k = max(params[i].top_logprobs for i in wants)
        if k:
            # One top-k for every row that asked, at the largest k asked; each row keeps its own k.
            values, ids = all_lps.topk(min(k, vocab), dim=-1)
            for i, row_values, row_ids in zip(wants, values.tolist(), ids.tolist(), strict=True):
                n = params[i].top_logprobs
                top[i] = tuple(zip(row_ids[:n], row_values[:n], strict=True))
    return SamplerOutput(token_ids, logprobs, top)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenScore]:
    """logits [n, vocab] (row i predicts ``targets[i]``) -> each target's logprob and rank under the raw
    distribution, with ``num_top`` alternatives per row."""
    lps = torch.log_softmax(logits, dim=-1)
    chosen = lps.gather(1, targets[:, None])
    ranks = ((lps > chosen).sum(dim=-1) + 1).tolist()
    if num_top:
        values, ids = lps.topk(min(num_top, lps.shape[1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [()] * len(ranks)
    return [TokenScore(lp, r, t) for lp, r, t in zip(chosen.squeeze(1).tolist(), ranks, tops, strict=True)]


def skip_one_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advances a request's generator past one sampling step, as if ``sample`` had drawn from it
    (a decode worker continuing a seeded request whose first token was sampled elsewhere)."""
    torch.empty(vocab_size).exponential_(generator=generator)


def _sample_random(logits, params, generators, greedy) -> torch.Tensor:
    batch, vocab = logits.shape
    temps = torch.tensor(
        [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], dtype=torch.float32
    )
    scaled = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        # p < min_p x p_max  <=>  logit < logit_max + log(min_p); log(0) = -inf drops nothing.
        log_min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).log()
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=-1, keepdim=True) + log_min_p[:, None], float("-inf"))
    # A top_k above the vocabulary keeps every token (and must not overflow the int64 tensor below).
    top_ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        scaled = _apply_top_k_top_p(scaled, torch.tensor(top_ks), torch.tensor(top_ps, dtype=torch.float32))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    if any(greedy):
        sampled = torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled)
    return sampled


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf every logit outside each row's top-k and top-p set; always keeps the best token."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
