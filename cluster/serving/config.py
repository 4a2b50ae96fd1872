"""The serving cluster's configuration: one pydantic ``ServeConfig``, loaded from YAML at the edge.

Validated once (field types, ranges, cross-field rules in one validator) into a frozen
object that is passed to ``build_app`` and bound into every deployment unchanged. Engine
configs for each pool are derived from it (``engine_config(pool)``), so the engine itself
never sees pydantic.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.config import DTYPES, EngineConfig, default_block_size
from cluster.errors import ConfigError


def cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build, read from its package version ("2.13.0+cpu") without
    importing it. Every config load resolves the device, and ``shapeserve serve`` loads one before Ray starts:
    importing torch there added ~2 s to its start on a 2-core VM, for an answer the version label already gives.
    False where the label does not say (CUDA and ROCm wheels, or no label): the caller asks torch itself."""
    try:
        return importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AutoscalingThresholds(_Frozen):
    """Thresholds the custom autoscaling policies in ``cluster/serving/autoscaling.py`` read."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    #: prefill: queued prefill tokens one replica should carry; scale to queued / this.
    target_queued_prefill_tokens_per_replica: int = Field(4096, ge=1)
    #: decode: scale up above this KV block use (0..1), down below ``kv_usage_scale_down``.
    kv_usage_scale_up: float = Field(0.8, gt=0, le=1)
    kv_usage_scale_down: float = Field(0.3, ge=0, lt=1)
    #: decode: running sequences one replica should carry.
    target_running_seqs_per_replica: int = Field(64, ge=1)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    #: decode: KV use and running sequences are read as their peak over this many seconds (Serve's look-back
    #: mean would average a short spike away).
    spike_window_s: float = Field(5.0, gt=0)
    #: prefill: how far ahead the queue is predicted from its trend (a replica asked for now serves about this
    #: much later) until a prefill replica reports its measured start-up (worker process start to the end of
    #: its ``__init__``), which replaces it.
    replica_startup_s: float = Field(20.0, ge=0)
    #: prefill: the measured start-up is used within [min, max]. It starts at the replica's process, so what comes
    #: before (scheduling, a new node's start) is not in it: raise the min where new replicas wait for a node. A
    #: process Ray started long before it was given the replica would read as a very long start-up: the max.
    min_replica_startup_s: float = Field(0.0, ge=0)
    max_replica_startup_s: float = Field(120.0, ge=0)
    #: prefill: the window the queue's trend is fitted over.
    trend_window_s: float = Field(10.0, gt=0)
    #: How often each replica samples its load and pushes the samples to Serve's controller (Serve's default
    #: push, every 10 s, leaves a decision up to 10 s behind the load); set in the replica's environment.
    metrics_push_interval_s: float = Field(1.0, gt=0)


class PoolRatioConfig(_Frozen):
    """The prefill:decode replica ratio the application-level policy keeps (``cluster.serving.pool_ratio``): the
    prefill replicas the observed class mix needs per decode replica, within a band."""

    #: The ratio the mix needs is bounded to [min, max] prefill replicas per decode replica, whatever it measures.
    min_prefill_per_decode: float = Field(0.1, ge=0)
    max_prefill_per_decode: float = Field(4.0, gt=0)
    #: The band around the needed ratio r is [r / (1 + band), r x (1 + band)]; it moves only when a measured ratio
    #: falls outside it, so a noisy mix does not move replicas.
    band: float = Field(0.25, gt=0, le=4)
    #: The window the class mix and the prefill replicas' throughput are measured over (seconds).
    mix_window_s: float = Field(30.0, gt=0)


class PoolConfig(_Frozen):
    """One pool (prefill or decode): its replicas, placement and engine budgets.

    Engine knobs left unset take the engine's defaults (``cluster.config``), the same defaults the
    CLI's engine flags have."""

    num_replicas: int = Field(1, ge=1)
    #: Custom Ray resources each replica needs, e.g. ``{"prefill": 1}`` to land on prefill nodes.
    resources: dict[str, float] = Field(default_factory=dict)
    #: CPUs each replica reserves; None: decided from the node (``cluster.serving.placement``).
    num_cpus: float | None = Field(None, ge=0)
    #: GPUs per replica; None: one where the cluster has GPUs, none otherwise.
    num_gpus: float | None = Field(None, ge=0)
    #: Requests a replica accepts at once (Serve's ``max_ongoing_requests``).
    max_ongoing_requests: int = Field(256, ge=1)
    #: Requests Serve's proxy holds for the pool while no replica can take one (all dead, restarting or full):
    #: beyond this many a request is answered 503 with Retry-After at once instead of waiting for a replica
    #: (Serve's ``max_queued_requests``). None: 64 for the decode pool, the one HTTP reaches; unbounded for the
    #: prefill pool, whose caller (a decode replica) has its own deadline and falls back to a local prefill.
    max_queued_requests: int | None = Field(None, ge=1)
    #: The Retry-After of those 503s: about how long a replica takes to come back.
    unavailable_retry_after_s: float = Field(10.0, ge=0)
    num_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    long_prefill_token_threshold: int | None = Field(None, ge=1)
    #: Torch threads per replica; None: as many as the replica's CPUs.
    num_threads: int | None = Field(None, ge=1)
    autoscaling: AutoscalingThresholds | None = None


class ClassifierConfig(_Frozen):
    """Thresholds of the geometry classifier (``router/classifier.py``)."""

    #: Requests with at most this many uncached prompt tokens prefill on their decode replica.
    local_max_uncached_tokens: int = Field(64, ge=0)
    #: Priority >= this may use ``priority_headroom`` beyond the class budget.
    high_priority: int = 1
    priority_headroom: float = Field(0.25, ge=0)
    #: KV formats the prefill pool can hand over; another format always prefills locally.
    remote_kv_formats: tuple[str, ...] = ("float32", "bfloat16", "float16")


class ClassBudget(_Frozen):
    """Admission budget of one route class, per router replica."""

    max_inflight_requests: int = Field(64, ge=1)
    #: Sum over admitted requests of prompt_tokens + max_tokens.
    max_inflight_tokens: int = Field(65536, ge=1)


class AdmissionConfig(_Frozen):
    local: ClassBudget = ClassBudget()
    remote: ClassBudget = ClassBudget()
    #: Retry-After bounds (seconds).
    min_retry_after_s: int = Field(1, ge=1)
    max_retry_after_s: int = Field(60, ge=1)
    #: Retry-After is drawn from [wait, wait x (1 + this)] (the class's predicted wait), so that clients refused
    #: together do not retry together.
    retry_after_jitter: float = Field(0.5, ge=0, le=4)
    #: Throughput assumed before any request finished (tokens/s per class).
    initial_tokens_per_s: float = Field(200.0, gt=0)
    #: Admit only what the SLO predicts can be served in time (``router.admission``): a request whose predicted
    #: time to first token is past ``slo.ttft_ms`` (the prompt tokens waiting ahead of it in its class over the
    #: class's measured prefill rate), or any new request while the streams run slower than ``slo.tpot_ms``,
    #: is a 429. False: the class budgets alone.
    admit_within_slo: bool = True


class TimeoutConfig(_Frozen):
    #: Whole request, arrival to last token.
    request_timeout_s: float = Field(300.0, gt=0)
    #: One prefill attempt on a prefill replica, including the KV push (the lease deadline).
    prefill_timeout_s: float = Field(30.0, gt=0)
    #: A lease outlives its prefill attempt by this much, so the prefill side's deadline always ends first.
    lease_margin_s: float = Field(2.0, gt=0)
    #: Attempts on prefill replicas before the decode replica prefills locally.
    max_prefill_attempts: int = Field(2, ge=1)
    #: Waiting for free KV blocks to reserve for a remote prefill before prefilling locally.
    reserve_timeout_s: float = Field(5.0, ge=0)

    @property
    def lease_ttl_s(self) -> float:
        """How long a KV transfer lease lives: one prefill attempt plus a margin."""
        return self.prefill_timeout_s + self.lease_margin_s


class SLOConfig(_Frozen):
    """Targets for goodput: a request counts as good when it meets both."""

    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(200.0, gt=0)


class TracingConfig(_Frozen):
    """OpenTelemetry request traces (``cluster.serving.tracing``): off until ``otlp_endpoint`` is set."""

    #: An OTLP/gRPC collector, e.g. ``http://otel-collector:4317``; every replica process exports its spans there.
    otlp_endpoint: str | None = None
    #: The traces' ``service.name``.
    service_name: str = "shapeserve"
    #: Fraction of requests traced (decided at the edge; the other processes follow the edge's decision).
    sample_ratio: float = Field(1.0, ge=0, le=1)


class ServeConfig(_Frozen):
    #: Local Hugging Face model directory; None: the built-in demo model (built into a cache dir).
    model: str | None = None
    #: Name(s) clients pass as ``model`` (the first is the one responses and metrics carry); defaults to the
    #: model directory's name.
    served_model_name: str | list[str] | None = None
    #: Clients must send ``Authorization: Bearer <api_key>`` on /v1/*, /tokenize, /detokenize and /admin/* (401
    #: otherwise); /health, /ping, /version and /metrics stay open. None: no key. Prefer the SHAPESERVE_API_KEY
    #: environment variable of ``shapeserve serve`` to writing it in a file.
    api_key: str | None = Field(None, repr=False, min_length=1)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    #: Context length served (prompt + output), at most the model's; None: the model's.
    max_model_len: int | None = Field(None, ge=1)
    #: A Jinja chat template (the text) used instead of the tokenizer's own; ``--chat-template FILE`` reads it.
    chat_template: str | None = None
    #: How tool calls are found in the model's text for ``tool_choice: "auto"`` (the format its family was trained
    #: on); None: only ``required`` and named functions (grammar-enforced) are served.
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    device: Literal["cpu", "cuda", "auto"] = "auto"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    #: Tokens per KV block; None: the device's default (``cluster.config.default_block_size``: 128 on a CPU, 16 on a
    #: GPU), fixed when the config is validated so that every process of a cluster hashes prefixes alike.
    block_size: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    classifier: ClassifierConfig = ClassifierConfig()
    admission: AdmissionConfig = AdmissionConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    slo: SLOConfig = SLOConfig()
    tracing: TracingConfig = TracingConfig()
    #: Keep the prefill:decode replica ratio near what the class mix needs (both pools autoscaled); applied by
    #: the application-level policy of a Serve config (``deploy/serve-app.yaml``), not by ``shapeserve serve``.
    pool_ratio: PoolRatioConfig | None = None
    #: KV data plane of kv_transfer (leases + gRPC control plane); auto picks the fastest both sides support.
    transport: Literal["auto", "grpc", "gloo", "nccl"] = "auto"
    #: Separate prefill pool: "on", "off" (the decode replicas prefill everything themselves), or "auto":
    #: off on a CPU cluster smaller than ``min_cpus_to_disaggregate`` (see ``cluster.serving.placement``).
    disaggregation: Literal["auto", "on", "off"] = "auto"
    min_cpus_to_disaggregate: int = Field(4, ge=1)
    #: Address the decode replicas' kv_transfer gRPC service binds to; None: the node's IP.
    kv_transfer_host: str | None = None
    #: How often replicas report routing stats to Serve's request routers.
    routing_stats_period_s: float = Field(0.5, gt=0)
    #: Largest HTTP request body the router reads; a larger one is a 413 before anything is parsed.
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    #: Expose ``/admin/pools`` (block counts, integrity) for tests and operators.
    enable_admin_api: bool = True

    @model_validator(mode="after")
    def _cross_field(self) -> ServeConfig:
        # Each message starts with the key it is about (``config_problems`` reports it as the key).
        size = self.block_size if self.block_size is not None else default_block_size(self.resolved_device())
        if size & (size - 1):
            raise ValueError(f"block_size: must be a power of two, got {size}")
        object.__setattr__(self, "block_size", size)  # frozen model: fixed here, before anyone reads it
        if self.dtype not in DTYPES:  # pragma: no cover - Literal already checks
            raise ValueError(f"dtype: must be one of {DTYPES}")
        for name in ("prefill", "decode"):
            pool: PoolConfig = getattr(self, name)
            a = pool.autoscaling
            if a is not None and a.min_replicas > a.max_replicas:
                raise ValueError(
                    f"{name}.autoscaling.min_replicas: {a.min_replicas} is above max_replicas {a.max_replicas}"
                )
            if a is not None and a.min_replica_startup_s > a.max_replica_startup_s:
                raise ValueError(
                    f"{name}.autoscaling.min_replica_startup_s: {a.min_replica_startup_s} is above "
                    f"max_replica_startup_s {a.max_replica_startup_s}"
                )
            if a is not None and a.kv_usage_scale_down >= a.kv_usage_scale_up:
                raise ValueError(
                    f"{name}.autoscaling.kv_usage_scale_down: {a.kv_usage_scale_down} must be below "
                    f"kv_usage_scale_up {a.kv_usage_scale_up}"
                )
        r = self.pool_ratio
        if r is not None and (self.prefill.autoscaling is None or self.decode.autoscaling is None):
            raise ValueError("pool_ratio: needs both pools autoscaled (prefill.autoscaling and decode.autoscaling)")
        if r is not None and r.min_prefill_per_decode > r.max_prefill_per_decode:
            raise ValueError(
                f"pool_ratio.min_prefill_per_decode: {r.min_prefill_per_decode} is above max_prefill_per_decode "
                f"{r.max_prefill_per_decode}"
            )
        names = self.served_model_name
        if isinstance(names, list) and (not names or any(not n for n in names)):
            raise ValueError("served_model_name: give one or more non-empty names")
        if names == "":
            raise ValueError("served_model_name: give a non-empty name")
        if self.admission.min_retry_after_s > self.admission.max_retry_after_s:
            raise ValueError("admission.min_retry_after_s: must not exceed admission.max_retry_after_s")
        return self

    # ---- derived ---------------------------------------------------------------------

    @property
    def served_model_names(self) -> list[str]:
        """Every name the model is served under, the primary one first."""
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        if self.served_model_name:
            return list(self.served_model_name)
        return [Path(self.model).name if self.model else "demo"]

    @property
    def model_name(self) -> str:
        """The primary served name (responses, metrics' ``model_name``)."""
        return self.served_model_names[0]

    @property
    def block_tokens(self) -> int:
        """Tokens per KV block: ``block_size``, which validation has fixed (the device's default when unset)."""
        assert self.block_size is not None, "set by the validator"
        return self.block_size

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        if cpu_only_torch():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def engine_config(
        self, pool: Literal["prefill", "decode"], model_dir: str, num_threads: int | None = None
    ) -> EngineConfig:
        """The engine config of one pool's replica (plain frozen dataclass, validated). ``num_threads`` is the
        placement's choice when the pool config leaves it unset."""
        p: PoolConfig = getattr(self, pool)
        return EngineConfig.build(
            model_dir,
            dtype=self.dtype,
            device=self.resolved_device(),
            attention_backend=self.attention_backend,
            num_threads=p.num_threads or num_threads,
            max_model_len=self.max_model_len,
            block_size=self.block_tokens,
            num_blocks=p.num_blocks,
            kv_cache_memory_gb=p.kv_cache_memory_gb,
            enable_prefix_caching=self.enable_prefix_caching,
            max_num_batched_tokens=p.max_num_batched_tokens,
            max_num_seqs=p.max_num_seqs,
            long_prefill_token_threshold=p.long_prefill_token_threshold,
        )

    def with_overrides(self, **kwargs) -> ServeConfig:
        """A copy with top-level fields replaced (None values are ignored), validated again."""
        data = self.model_dump()
        if "block_size" not in self.model_fields_set:
            del data["block_size"]  # the device's default, which follows an overridden device
        data.update({k: v for k, v in kwargs.items() if v is not None})
        return parse_serve_config(data)


def config_problems(error: ValidationError) -> list[tuple[str, str]]:
    """(dotted key, what is wrong) for every error of a ServeConfig validation."""
    problems = []
    for err in error.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not key and ": " in msg:  # a cross-field rule: its message starts with the key
            key, msg = msg.split(": ", 1)
        problems.append((key or "(top level)", msg))
    return problems


def parse_serve_config(data: dict | None, source: str = "config") -> ServeConfig:
    """Validates a mapping; raises ConfigError naming the field and what to change."""
    try:
        return ServeConfig.model_validate(data or {})
    except ValidationError as e:
        where, msg = config_problems(e)[0]
        raise ConfigError(f"{source}: {where}: {msg}", where) from None


def load_serve_config(path: str | Path | None) -> ServeConfig:
    """Reads a ServeConfig YAML (or defaults when ``path`` is None)."""
    if path is None:
        return ServeConfig()
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    # A Serve-style file may nest ours under "shapeserve:".
    if raw and "shapeserve" in raw and isinstance(raw["shapeserve"], dict):
        raw = raw["shapeserve"]
    return parse_serve_config(raw, str(path))


def serve_config_from_app_args(args: dict, prefix: str = "args") -> ServeConfig:
    """The ServeConfig ``cluster.app:app_builder`` builds from a Serve config's ``args``: ``config`` (a
    ServeConfig file; the defaults without it) and ``overrides`` (top-level fields). Raises ConfigError naming
    the key (``prefix.config``, ``prefix.overrides.FIELD``); relative paths are read from the current directory,
    as ``serve run`` does."""
    unknown = sorted(set(args) - {"config", "overrides"})
    if unknown:
        key = f"{prefix}.{unknown[0]}"
        raise ConfigError(f"{key}: unknown argument; the builder takes 'config' and 'overrides'", key)
    config_path = args.get("config")
    overrides = args.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError(f"{prefix}.overrides: expected a mapping of ServeConfig fields", f"{prefix}.overrides")
    if config_path is not None and not isinstance(config_path, str):
        raise ConfigError(f"{prefix}.config: expected the path of a ServeConfig YAML file", f"{prefix}.config")
    config = load_serve_config(config_path)  # its errors name the file and the key in it
    if not overrides:
        return config
    source = f"{prefix}.overrides"
    try:
        return parse_serve_config({**config.model_dump(), **overrides}, source)
    except ConfigError as e:
        key = f"{source}.{e.param}"
        raise ConfigError(f"{key}: {e.message.removeprefix(f'{source}: {e.param}: ')}", key) from None
