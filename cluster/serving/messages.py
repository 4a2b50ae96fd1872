"""The small immutable messages that cross Serve deployments (router -> decode -> prefill).

Frozen dataclasses, pickled by Ray. Every task carries a deadline (wall-clock seconds,
``time.time()`` based, so it means the same on every node).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from cluster.config import SamplingParams


@dataclass(frozen=True)
class GenerateTask:
    """Router -> decode replica: run this request to completion and stream its tokens."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    route: str  # "local" | "remote"
    deadline: float
    #: Chained hashes of the prompt's full blocks (prefix affinity for the prefill choice).
    block_hashes: tuple[bytes, ...] = ()

    def time_left(self) -> float:
        return self.deadline - time.time()


@dataclass(frozen=True)
class Started:
    """First item of a decode stream: the request is in the engine (queue time ends here)."""

    route: str
    replica_id: str


@dataclass(frozen=True)
class PrefillTask:
    """Decode replica -> prefill replica: prefill this prompt and hand its KV to the lease."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    #: Leading blocks the decode side already holds (its prefix-cache hits): not sent.
    skip_blocks: int
    deadline: float
    block_hashes: tuple[bytes, ...] = ()
    #: 0 for the first try; a retry's request router avoids replicas that already had this request.
    attempt: int = 0
    #: kv_transfer lease descriptor when the data plane is kv_transfer; None: return KV in the result.
    lease: Any = None


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int
    first_logprob: float | None
    replica_id: str
    num_blocks_sent: int
    num_bytes: int
    #: The KV of blocks [skip_blocks:] when moved as a Ray object: [layers, 2, n, block_size, kv_heads, head_dim].
    kv: Any = None
