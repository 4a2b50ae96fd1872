"""Small builders that keep tests short."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from cluster.engine.request import Request

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@dataclass
class History:
    """A request's tokens so far, as the sampler's penalties and min_tokens read them."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def make_request(
    request_id: str = "r0", num_prompt_tokens: int = 8, max_tokens: int = 16, prompt=None, **params
) -> Request:
    prompt = list(prompt) if prompt is not None else list(range(10, 10 + num_prompt_tokens))
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)
    )


def engine_config(
    model, *, block_size=16, num_blocks=256, budget=2048, max_seqs=64, prefix=True, chunk=None, **kw
) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=chunk
        ),
        **kw,
    )


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def disable_ray_token_auth() -> Callable[[], None]:
    """Test clusters run without Ray's token auth (Ray >= 2.5x turns it on); returns what restores the variable."""
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"

    def restore() -> None:
        if before is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = before

    return restore


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port for a test server to listen on, free now, from 20000 up to the kernel's ephemeral range.

    Not a port the kernel hands out (binding port 0): released, such a port can be taken again by any outgoing
    connection of the Ray processes a test starts before its server binds it (a CI run failed so: "Failed to bind
    to address"). Below the ephemeral range nothing is handed out, and above 20000 Ray's worker ports end."""
    rng = random.Random()  # seeded by the OS: sessions side by side pick apart
    for _ in range(500):
        port = rng.randrange(20000, _ephemeral_ports_start())
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and the ephemeral range")
