"""Structured output in the engine: one llguidance matcher per constrained request, and the batch's mask.

Each step, the rows of constrained requests get their matcher's allowed-token bitmask (computed in Rust,
one call per row) applied to their logits in one batched op; after sampling, each matcher consumes its
token. A request whose grammar is complete stops (only EOS could follow). Requests without a constraint
cost nothing: the step looks for none and moves on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch

from cluster.config import StructuredOutput
from cluster.errors import InvalidRequestError
from cluster.grammar import PARSER_LIMITS, check_structured, grammar_for, request_field

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarFailed(InvalidRequestError):
    """The request's grammar could not go on mid-output: it hit one of llguidance's limits, or the other sampling
    settings (``min_tokens``, ``logit_bias``, ...) left no token it allows. The request's input is at fault, not
    the engine: the client gets a 400 naming ``param``."""


@dataclass
class RequestGrammar:
    """One constrained request's matcher, and the size of its tokenizer's vocabulary (its bitmask's size, which
    llguidance requires exactly: a model's logits may be wider than its tokenizer)."""

    matcher: llguidance.LLMatcher
    vocab_size: int
    #: The request field the constraint came from, for the 400 when the grammar fails mid-output.
    param: str = "response_format"


class GrammarMatchers:
    """Builds matchers for one engine's tokenizer (the tokenizer's token table is built on first use). Safe to call
    from any thread: a large grammar takes seconds to build, and llguidance drops the GIL meanwhile, so the serving
    engine builds matchers on a worker thread, not on the thread that steps (``AsyncEngine.grammar``)."""

    def __init__(self, tokenizer):
        self._hf_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()

    def matcher(self, structured: StructuredOutput, param: str | None = None) -> RequestGrammar:
        """A fresh matcher at the start of the output; InvalidRequestError (naming ``param``, by default the
        field of the constraint's kind) when the grammar cannot be used."""
        param = param or request_field(structured)
        check_structured(structured, param)
        with self._tokenizer_lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
                except Exception as e:  # noqa: BLE001 - llguidance reads a fast tokenizer's JSON only
                    raise InvalidRequestError(
                        f"structured output needs the model's fast tokenizer (tokenizer.json); this one failed: {e}",
                        "response_format",
                    ) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_for(structured), limits=PARSER_LIMITS)
        if not matcher.is_error():
            # The first mask, computed once here (it changes no state): a grammar no text satisfies (``root ::=
            # root``) compiles without complaint and fails only here, which is before the request is started, so
            # a stream gets a plain 400 too. Off the thread that steps as well: the first mask is the costliest
            # (llguidance builds the lexer states it keeps), the step's own call is then cheaper.
            matcher.compute_bitmask()
        if matcher.is_error():
            raise InvalidRequestError(_unusable(structured, param, _error_of(matcher)), param)
        return RequestGrammar(matcher, self._tokenizer.vocab_size, param)


def _unusable(structured: StructuredOutput, param: str, error: str) -> str:
    """The 400's message for a constraint that fails before its first token."""
    if error not in ("NoExtension", "NoExtensionBias"):  # e.g. one of llguidance's limits
        return f"the {param} cannot be used: {error}"
    example = " (a rule that only refers to itself, as in 'root ::= root', never ends)"
    return (
        f"the {param} matches no text at all, so no output can satisfy it"
        f"{example if structured.kind == 'grammar' else ''}; change it so that some text matches"
    )


def mask_logits(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """Sets to -inf, in place, every token row i's grammar does not allow next (rows without one untouched)."""
    constrained = [(i, g) for i, g in enumerate(grammars) if g is not None]
    if not constrained:
        return
    rows = [i for i, _ in constrained]
    vocab = constrained[0][1].vocab_size  # one tokenizer per engine
    # llguidance's 32-bit words, one bit per token. Filled through the matcher's own call, not through
    # ``llguidance.torch``: importing that module runs a ``torch.compile`` decorator, which imports the
    # compiler stack (and triton) in every engine process; the unpacking below needs no compiler.
    bitmask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32)
    for j, (_, grammar) in enumerate(constrained):
        row = bitmask[j]
        grammar.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    bits = (bitmask[:, :, None] >> _BIT_SHIFTS) & 1
    width = logits.shape[1]
    allowed = bits.reshape(len(rows), -1)[:, : min(vocab, width)].bool()
    if allowed.shape[1] < width:  # logits wider than the tokenizer: the extra ids are no tokens, never allowed
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def consume(grammar: RequestGrammar, token: int) -> bool:
    """Advances the matcher past ``token``; True when the grammar is now complete (the output must end).
    Raises ``GrammarFailed`` when it cannot go on."""
    matcher = grammar.matcher
    # A limit hit while computing this token's mask leaves the matcher in error before the token is offered.
    if matcher.is_error() or not matcher.consume_token(token):
        error = _error_of(matcher)
        hint = ""
        if "doesn't satisfy" in error:  # llguidance's words for a token outside the mask: the mask left the
            # sampler nothing, because the request's other settings excluded every token the grammar allows
            hint = "; min_tokens, logit_bias or bad words exclude every token it allows here: relax one of them"
        raise GrammarFailed(f"the {grammar.param} cannot go on: {error}{hint}", grammar.param)
    return matcher.is_stopped()


def _error_of(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error, without what a client cannot act on: the marker llguidance appends where verbose errors
    are off, and the backtrace of an assertion that failed inside it."""
    return matcher.get_error().split("<backtrace>")[0].replace("<non-verbose/>", "").strip()
