"""Structured output in the engine: one llguidance matcher per constrained request, and the batch's mask.

Each step, the rows of constrained requests get their matcher's allowed-token bitmask (computed in Rust,
one call per row) applied to their logits in one batched op; after sampling, each matcher consumes its
token. A request whose grammar is complete stops (only EOS could follow). Requests without a constraint
cost nothing: the step looks for none and moves on.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from cluster.config import StructuredOutput
from cluster.errors import InvalidRequestError
from cluster.grammar import check_structured, grammar_for

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarMatchers:
    """Builds matchers for one engine's tokenizer (the tokenizer's token table is built on first use)."""

    def __init__(self, tokenizer):
        self._hf_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output; InvalidRequestError when the grammar cannot be used."""
        check_structured(structured)
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
            except Exception as e:  # noqa: BLE001 - llguidance reads a fast tokenizer's JSON only
                raise InvalidRequestError(
                    f"structured output needs the model's fast tokenizer (tokenizer.json); this one failed: {e}",
                    "response_format",
                ) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_for(structured))
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be used: {matcher.get_error()}", "response_format")
        return matcher


def mask_logits(logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> None:
    """Sets to -inf, in place, every token row i's matcher does not allow next (rows without one untouched)."""
    constrained_rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
    if not constrained_rows:
        return
    rows = [i for i, _ in constrained_rows]
    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for j, (_, matcher) in enumerate(constrained_rows):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, j)
    # Unpacked here rather than with llguidance's torch.compile'd kernel: no compiler at serving time.
    bits = (bitmask[:, :, None] >> _BIT_SHIFTS) & 1
    allowed = bits.reshape(len(rows), -1)[:, : logits.shape[1]].bool()
    if allowed.shape[1] < logits.shape[1]:  # logits wider than the bitmask: the extra ids are not tokens
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def consume(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Advances ``matcher`` past ``token``; True when the grammar is now complete (the output must end)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar matcher refused token {token}: {matcher.get_error()}")
    return matcher.is_stopped()
