"""Typed configuration shared by every node: model shape, KV cache, scheduler, sampling.

Frozen dataclasses: built once at the boundary (CLI flags, YAML, HTTP body) and passed
down unchanged. Cross-field rules live in ``validate()`` with messages a user understands.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from cluster.errors import ConfigError, InvalidRequestError, ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

DTYPES = ("float32", "bfloat16", "float16")

#: Integer request fields are bounded so every value can be represented where it is used
#: (int64 tensors in the sampler, a 64-bit generator seed): a larger one is a 400, never a crash.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Entries one request's ``logit_bias`` may have (each costs a scatter per step).
MAX_LOGIT_BIAS = 1024
#: The most alternatives per position a request may ask for (vLLM's default ``max_logprobs``).
MAX_TOP_LOGPROBS = 20
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face ``config.json``."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: Llama-3 style rope scaling, as a tuple of (key, value) pairs so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    #: Qwen2 puts biases on q/k/v projections; Llama and Mistral do not.
    qkv_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Reads ``path/config.json``; raises ModelLoadError naming what is missing or unsupported."""
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(
                f"model directory {str(path)!r} does not exist; pass a local Hugging Face "
                "model directory (config.json, *.safetensors, tokenizer files) or build one "
                "with `shapeserve demo-model DIR`"
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{str(path)!r} has no config.json; is it a Hugging Face model directory?")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {cfg_file}; "
                f"shapeserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        # transformers 5 writes rope settings under "rope_parameters".
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ModelLoadError(f"rope scaling type {kind!r} is not supported (supported: llama3)")
            if kind == "default":
                rope_scaling = None
        return cls(
            path=str(path),
            architecture=SUPPORTED_ARCHITECTURES[arch],
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] == "qwen2" or bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


#: Tokens per KV block where the device leaves it open (``default_block_size``).
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


def default_block_size(device: str) -> int:
    """Tokens per KV block on ``device`` (a torch device string) when the config does not say.

    On a CPU a decode reads each block of a sequence as one contiguous run, and once a server has run a while a
    sequence's blocks lie wherever the pool had them: over scattered 16-token blocks the decode attention ran
    1.55x slower than over contiguous ones, over 128-token blocks 1.08x (``python -m bench.block_layout``). vLLM's CPU
    backend defaults to 128 as well. GPU kernels read blocks in parallel; 16 keeps the last block's waste small."""
    return CPU_BLOCK_SIZE if device.split(":")[0] == "cpu" else GPU_BLOCK_SIZE


@dataclass(frozen=True)
class CacheConfig:
    #: What a direct construction gets; ``EngineConfig.build`` (every CLI and serve path) applies the device's
    #: ``default_block_size`` when no block size is given.
    block_size: int = GPU_BLOCK_SIZE
    #: Number of KV blocks in the pool. None: sized from ``kv_cache_memory_gb``.
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    #: Tokens computed per engine step, summed over requests (prefill chunks + decodes).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    #: Largest prompt chunk per request per step; None = up to the token budget.
    long_prefill_token_threshold: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    #: Torch intra-op threads; None leaves torch's default.
    num_threads: int | None = None
    #: Context length served (prompt + output); None: the model's ``max_position_embeddings``.
    max_model_len: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def build(cls, model: str, **options: Any) -> EngineConfig:
        """The one path from flags or a config file to an engine config: ``options`` name fields of this
        class, ``CacheConfig`` or ``SchedulerConfig``; a None value keeps the dataclass default. Validated."""
        groups: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "engine": {}}
        owners = {f.name: "cache" for f in fields(CacheConfig)} | {f.name: "scheduler" for f in fields(SchedulerConfig)}
        own = {f.name for f in fields(cls)} - {"model", "cache", "scheduler"}
        for name, value in options.items():
            if name not in owners and name not in own:
                raise ConfigError(f"unknown engine option {name!r}", name)
            if value is not None:
                groups[owners.get(name, "engine")][name] = value
        if "block_size" not in groups["cache"]:
            groups["cache"]["block_size"] = default_block_size(str(groups["engine"].get("device", cls.device)))
        return cls(
            model=str(model),
            cache=CacheConfig(**groups["cache"]),
            scheduler=SchedulerConfig(**groups["scheduler"]),
            **groups["engine"],
        ).validate()

    def validate(self) -> EngineConfig:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose one of {DTYPES}", "dtype")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend {self.attention_backend!r} is unknown; choose one of {ATTENTION_BACKENDS}",
                "attention_backend",
            )
        if self.cache.block_size <= 0 or self.cache.block_size & (self.cache.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.cache.block_size}", "block_size")
        if self.cache.num_blocks is not None and self.cache.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.cache.num_blocks}", "num_blocks")
        if self.scheduler.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1", "max_num_batched_tokens")
        if self.scheduler.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be >= 1", "max_num_seqs")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}", "max_model_len")
        return self

    def with_overrides(self, **kwargs: Any) -> EngineConfig:
        return replace(self, **kwargs).validate()


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output, enforced token by token (``cluster.grammar`` compiles it).

    ``kind``: ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any JSON object; ``spec``
    empty), ``regex`` (``spec``: the pattern), ``choice`` (``spec``: a JSON list of the allowed strings) or
    ``grammar`` (``spec``: a Lark or GBNF grammar)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: str = ""
    #: The request field it came from, which errors about it name (None: the usual field of its kind). Not part of
    #: its identity: ``guided_json`` and ``response_format`` with one schema are one constraint, compiled once.
    param: str | None = field(default=None, compare=False)

    @classmethod
    def from_schema(cls, schema: Any) -> StructuredOutput:
        """A JSON-schema constraint with the schema as sorted-key JSON text: equal schemas share one grammar."""
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``validate()`` raises InvalidRequestError."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 or -1 disables top-k.
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    #: With ``logprobs``: how many of each position's most likely tokens to report with theirs.
    top_logprobs: int = 0
    #: Report each prompt token's logprob (from the second on) and this many alternatives per position; None: no.
    prompt_logprobs: int | None = None
    #: Do not count or check stop strings inside the returned text (OpenAI default: excluded).
    include_stop_str_in_output: bool = False
    #: OpenAI's: subtract ``presence_penalty`` once from every token already generated, and
    #: ``frequency_penalty`` once per time it was generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: vLLM's / transformers': divide positive (multiply negative) logits of every token in the prompt or the
    #: output by this; 1 is off.
    repetition_penalty: float = 1.0
    #: EOS, ``stop_token_ids`` and stop strings cannot end the output before this many tokens.
    min_tokens: int = 0
    #: (token id, bias) pairs added to the logits before sampling; -100 bans a token, +100 forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Drop tokens whose probability is below ``min_p`` x the most likely token's; 0 is off.
    min_p: float = 0.0
    #: The output must match this (response_format / guided_*); the request stops when it is complete.
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether sampling must change this request's logits beyond temperature / top-k / top-p."""
        return self.has_penalties or self.min_tokens > 0 or bool(self.logit_bias) or self.min_p > 0.0

    def validate(self) -> SamplingParams:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or not 0 < self.max_tokens <= INT32_MAX:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer (at most {INT32_MAX}), got {self.max_tokens!r}", "max_tokens"
            )
        if not (0.0 <= self.temperature <= 100.0) or math.isnan(self.temperature):
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive integer up to {INT32_MAX}, got {self.top_k!r}", "top_k"
            )
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise InvalidRequestError(
                f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed!r}", "seed"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings", "stop")
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop strings are allowed", "stop")
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be token ids (non-negative integers)", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:  # NaN fails too
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v!r}", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2] (1 is off), got {self.repetition_penalty!r}",
                "repetition_penalty",
            )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens!r}",
                "min_tokens",
            )
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}",
                "top_logprobs",
            )
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidRequestError(
                f"prompt_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs!r}",
                "prompt_logprobs",
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: set logprobs to true", "top_logprobs")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
        for token, bias in self.logit_bias:
            if not is_int(token) or not 0 <= token <= INT32_MAX:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias!r}", "logit_bias")
        return self

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every token id the params name is in its vocabulary (a stop id past it
        could never be sampled, so it would stop nothing)."""
        check_stop_token_ids(self.stop_token_ids, vocab_size)
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})", "logit_bias"
                )


def check_stop_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Each of ``stop_token_ids`` in the vocabulary; the error names the first one outside it by index. The edge
    calls it before building the params (whose own range check names no index), the engine through ``check_vocab``
    (run-batch and other direct callers)."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"stop_token_ids[{i}] is {token}, outside the vocabulary [0, {vocab_size}); use /tokenize to find "
                "token ids",
                "stop_token_ids",
            )


def served_context_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The context the engine and the edge enforce: ``max_model_len`` when given (it may only shorten the
    model's), else the model's ``max_position_embeddings``. Raises ConfigError past the model's."""
    if max_model_len is None:
        return model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {max_model_len} is longer than this model's context of {model.max_position_embeddings} "
            "tokens (max_position_embeddings); give at most that",
            "max_model_len",
        )
    return max_model_len
