"""A request inside the engine: its tokens, how many are computed, its blocks, its status.

Only the scheduler changes a request's status, blocks and ``num_computed_tokens``; the
engine appends sampled tokens. "Prefill" and "decode" are not states: a request simply has
``num_computed_tokens`` behind ``num_tokens`` by one (decode) or by more (prefill).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.config import SamplingParams
from cluster.scores import TokenScore


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished: ``status >= FINISHED_STOPPED``.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    #: The engine failed while computing this request (it alone; the others in its step go on).
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason``."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    #: When the scheduler first gave it a step (wall clock, ``time.time()``): its queue time ends there.
    first_scheduled_at: float | None = None
    #: Keep KV blocks referenced after finishing, until ``LLMEngine.release_kv`` (prefill pool: the
    #: blocks must outlive the request until KV transfer has sent them).
    hold_kv_on_finish: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    #: Prompt tokens served from the prefix cache when first scheduled (for metrics/usage).
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: How many of ``block_ids`` are registered in the prefix cache.
    num_hashed_blocks: int = 0
    #: Chained hashes of the request's full blocks computed so far (token content only, so they
    #: stay valid across preemption).
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    #: With ``params.prompt_logprobs``: the score of prompt token i + 1 at index i, filled as prefill goes.
    prompt_scores: list[TokenScore] = field(default_factory=list)
    #: With ``params.structured``: its llguidance matcher, advanced past every output token.
    matcher: Any = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
