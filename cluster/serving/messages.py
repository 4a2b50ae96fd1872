"""The typed, frozen messages that cross process boundaries (edge -> decode -> prefill, replicas -> board).

Pickled by Ray; no dicts with free-form keys. Every task carries a deadline (wall-clock seconds,
``time.time()`` based, so it means the same on every node).
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from cluster.config import SamplingParams

if TYPE_CHECKING:  # the edge imports these messages and must not import torch (kv_transfer does)
    from kv_transfer.lease import Lease


class Route(str, enum.Enum):
    """Where a request's prompt is prefilled (or that it is refused now)."""

    LOCAL = "local"  # on its decode replica
    REMOTE = "remote"  # on a prefill replica, KV pushed to the decode replica
    REJECT = "reject"  # 429 + Retry-After


@dataclass(frozen=True)
class GenerateTask:
    """Edge -> decode worker: run this request to completion and stream its outputs."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    route: Route
    deadline: float
    #: Chained hashes of the prompt's full blocks (prefix affinity for the prefill choice).
    block_hashes: tuple[bytes, ...] = ()
    #: W3C trace-context headers of the edge's span (``cluster.serving.tracing``); () when not traced.
    trace_context: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.route is Route.REJECT:
            raise ValueError("a rejected request is never sent to a decode worker")

    def time_left(self) -> float:
        return self.deadline - time.time()


@dataclass(frozen=True)
class Started:
    """First item of a decode stream: the request is in the engine (queue time ends here)."""

    route: Route
    replica_id: str


@dataclass(frozen=True)
class PrefillTask:
    """Decode replica -> prefill replica: prefill this prompt and push its KV into ``lease``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    deadline: float
    #: Destination blocks on the decode replica; ``lease.first_block`` leading blocks are its own
    #: prefix-cache hits and are not sent.
    lease: Lease
    block_hashes: tuple[bytes, ...] = ()
    #: 0 for the first try; a retry's request router avoids replicas that already had this request.
    attempt: int = 0
    #: W3C trace-context headers of the decode replica's ``shapeserve.remote_prefill`` span; () when not traced.
    trace_context: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PrefillResult:
    """The first token (it travels only here) and what the KV push cost."""

    request_id: str
    first_token_id: int
    first_logprob: float | None
    replica_id: str
    num_blocks_sent: int
    num_bytes: int
    transport: str
    #: The first position's most likely (token id, logprob) pairs, when the request asked for ``top_logprobs``.
    first_top_logprobs: tuple[tuple[int, float], ...] = ()


# ---- stats replicas report -----------------------------------------------------------------


@dataclass(frozen=True)
class BatchGeometry:
    """Shape of the running batch after one step (what the memory system sees)."""

    num_seqs: int = 0
    num_tokens: int = 0
    #: Share of this step's tokens that were prompt (prefill) tokens.
    prefill_fraction: float = 0.0
    #: Coefficient of variation and max/min ratio of the running sequences' lengths.
    length_cv: float = 0.0
    max_min_ratio: float = 0.0
    kv_footprint_bytes: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A pool engine's state (plain numbers; may be one step stale). Counters are cumulative."""

    running: int = 0
    #: Waiting to run, including requests waiting for remote KV.
    waiting: int = 0
    waiting_for_remote_kv: int = 0
    held_kv_requests: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_dtype: str = ""
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    #: Wall seconds the engine thread spent inside steps (busy time), and its CPU seconds there.
    step_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    queued_prefill_tokens: int = 0
    active_requests: int = 0
    geometry: BatchGeometry = BatchGeometry()

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class TransferCounters:
    """KV transfers of one replica since it started (decode side receives, prefill side sends)."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    #: Data plane of the last transfer ("gloo", "grpc", "nccl"; "" before the first).
    last_transport: str = ""
    prefill_retries: int = 0
    local_fallbacks: int = 0


@dataclass(frozen=True)
class ReplicaStats:
    """One pool replica's report to the pool board."""

    pool: str  # "prefill" | "decode"
    replica_id: str
    reported_at: float = field(default_factory=time.time)
    healthy: bool = True
    pid: int = 0
    #: Block pool ``check_integrity()`` at the last report (checked only for pools of <= 16384 blocks).
    integrity_ok: bool | None = None
    engine: EngineStats = EngineStats()
    transfers: TransferCounters = TransferCounters()

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    def as_dict(self) -> dict[str, Any]:
        """Flat JSON for the admin API (``/admin/pools``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("engine", "transfers")}
        d.update({f.name: getattr(self.engine, f.name) for f in fields(self.engine) if f.name != "geometry"})
        d["geometry"] = asdict(self.engine.geometry)
        d.update(asdict(self.transfers))
        d["kv_usage"] = self.kv_usage
        return d


# ---- what Serve's request routers and autoscaler read (Serve carries them as dicts) -----------


@dataclass(frozen=True)
class DecodeRoutingStats:
    kv_blocks_free: int = 1 << 30
    kv_blocks_total: int = 1
    running: int = 0
    waiting: int = 0
    batch_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> DecodeRoutingStats:
        """Serve's copy of ``as_dict()``; empty (a replica that has not reported yet) gives the defaults."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


@dataclass(frozen=True)
class PrefillRoutingStats:
    queued_prefill_tokens: int = 0
    kv_blocks_free: int = 1 << 30
    running: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> PrefillRoutingStats:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})


class _AutoscalingSample:
    """A replica's sample for Serve's ``record_autoscaling_stats``: every field a float, by name."""

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class PrefillAutoscalingStats(_AutoscalingSample):
    """A prefill replica's sample for the autoscaling policies (``cluster.serving.autoscaling``)."""

    queued_prefill_tokens: float = 0.0
    #: Counters since the replica started: prompt tokens it prefilled and its engine's busy seconds (their rates'
    #: quotient over a window is the replica's throughput).
    prompt_tokens: float = 0.0
    busy_s: float = 0.0
    #: Seconds from the replica's process start to the end of its start-up (measured once; 0: not measured).
    startup_s: float = 0.0


@dataclass(frozen=True)
class DecodeAutoscalingStats(_AutoscalingSample):
    """A decode replica's sample for the autoscaling policies (``cluster.serving.autoscaling``)."""

    kv_usage: float = 0.0
    running_seqs: float = 0.0
    #: Counter since the replica started: prompt tokens of the REMOTE requests it handed to the prefill pool.
    remote_prompt_tokens: float = 0.0
