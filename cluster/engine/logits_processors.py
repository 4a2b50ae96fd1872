"""Per-request changes to a batch's logits before sampling: logit_bias, min_tokens and the penalties.

Batched: each feature gathers the rows that use it and changes them with one indexed tensor
operation for the whole batch, never a tensor operation per request. A batch in which no request
uses any of them costs one ``any`` over the params and returns the logits untouched, so requests
that do not ask pay nothing.

The order is vLLM's: logit_bias and min_tokens first, then the penalties on the biased scores;
temperature, min_p, top-k and top-p follow in the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import Protocol

import torch

from cluster.config import SamplingParams


class TokenHistory(Protocol):
    """What the penalties and min_tokens read of a request (``cluster.engine.request.Request`` is one)."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    stop_token_ids: Sequence[int],
) -> torch.Tensor:
    """``logits`` [batch, vocab] itself when no request processes its logits, else a changed copy.

    ``histories[i]``: row i's tokens so far; ``stop_token_ids``: the model's EOS ids (min_tokens bans them
    together with each request's own ``stop_token_ids``)."""
    if not any(p.processes_logits for p in params):
        return logits
    logits = logits.clone()
    _add_logit_bias(logits, params)
    _ban_stops_before_min_tokens(logits, params, histories, stop_token_ids)
    _apply_penalties(logits, params, histories)
    return logits


def _add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return
    rows, tokens, biases = zip(*entries, strict=True)
    logits.index_put_((torch.tensor(rows), torch.tensor(tokens)), torch.tensor(biases, dtype=logits.dtype), True)


def _ban_stops_before_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    stop_token_ids: Sequence[int],
) -> None:
    vocab = logits.shape[1]
    banned = [
        (row, token)
        for row, (p, h) in enumerate(zip(params, histories, strict=True))
        if len(h.output_token_ids) < p.min_tokens
        for token in chain(stop_token_ids, p.stop_token_ids)
        if token < vocab  # a stop id past the model's vocabulary can never be sampled anyway
    ]
    if banned:
        rows, tokens = zip(*banned, strict=True)
        logits[torch.tensor(rows), torch.tensor(tokens)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]) -> None:
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    counts = _token_counts([histories[i].output_token_ids for i in rows], vocab)
    scores = logits[rows]
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], dtype=logits.dtype)[:, None]
    if (repetition != 1.0).any():
        # transformers' rule, over the prompt and the output: shrink a seen token's score towards "unlikely".
        seen = (counts > 0) | (_token_counts([histories[i].prompt_token_ids for i in rows], vocab) > 0)
        penalized = torch.where(scores > 0, scores / repetition, scores * repetition)
        scores = torch.where(seen, penalized, scores)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], dtype=logits.dtype)[:, None]
    presence = torch.tensor([params[i].presence_penalty for i in rows], dtype=logits.dtype)[:, None]
    scores -= frequency * counts + presence * (counts > 0)
    logits[rows] = scores


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] float: how many times each row's list holds each token (one scatter)."""
    lengths = torch.tensor([len(t) for t in token_lists])
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    counts = torch.zeros(len(token_lists), vocab)
    counts.index_put_((row_of, flat), torch.ones(len(flat)), accumulate=True)
    return counts
