"""How the model scored tokens: the plain, torch-free values the engine reports and the HTTP edge renders."""

from __future__ import annotations

from dataclasses import dataclass

#: A position's most likely tokens and their logprobs, most likely first.
Alternatives = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class TokenScore:
    """How the model scored a given token at one position (a prompt token, for ``prompt_logprobs``)."""

    logprob: float
    #: 1 + how many tokens the model found likelier.
    rank: int
    #: The position's most likely tokens, when asked.
    top: Alternatives = ()
