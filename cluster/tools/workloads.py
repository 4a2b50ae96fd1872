"""Regenerates a benchmark workload from ``../shared/workloads/*.json`` (same seed -> same requests).

The format is in that folder's README: request classes with length distributions, burst or
Poisson arrivals, an optional SLO. Prompts are token ids drawn from ``[4, vocab_size)`` of the
model under test, so any server that takes token-id prompts can be measured with them.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parents[3] / "shared" / "workloads"


@dataclass(frozen=True)
class WorkloadRequest:
    index: int
    class_name: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int


def _draw(rng: random.Random, dist: dict) -> int:
    kind = dist["dist"]
    if kind == "fixed":
        return int(dist["value"])
    if kind == "uniform":
        return rng.randint(int(dist["min"]), int(dist["max"]))
    if kind == "lognormal":
        value = rng.lognormvariate(math.log(dist["median"]), dist["sigma"])
        return int(min(max(round(value), dist["min"]), dist["max"]))
    raise ValueError(f"unknown distribution {kind!r}")


def workload_path(name_or_path: str) -> Path:
    """A file path, or the name of a workload in ``../shared/workloads`` (with or without .json)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = WORKLOADS_DIR / f"{name_or_path.removesuffix('.json')}.json"
    if not named.is_file():
        known = sorted(p.stem for p in WORKLOADS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no workload file {name_or_path!r}; the named workloads are {known}")
    return named


def load_workload(
    name_or_path: str,
    vocab_size: int,
    rate_per_s: float | None = None,
    num_requests: int | None = None,
    seed: int | None = None,
) -> tuple[dict, list[WorkloadRequest]]:
    """Returns (the workload's JSON, its requests). Prompt ids are drawn from [4, vocab_size).

    ``rate_per_s`` replaces the workload's arrivals (``inf``: a burst; else Poisson at that rate) and
    ``num_requests`` its count; the prompts and lengths drawn for a given index stay the same. ``seed``
    replaces the workload's seed: the same distributions, other prompts (a repeat that a server's prefix
    cache has not seen)."""
    spec = json.loads(workload_path(name_or_path).read_text())
    if num_requests is not None:
        spec["num_requests"] = num_requests
    if seed is not None:
        spec["seed"] = seed
    if rate_per_s is not None:
        spec["arrival"] = {"kind": "burst"} if math.isinf(rate_per_s) else {"kind": "poisson", "rate_per_s": rate_per_s}
    rng = random.Random(spec["seed"])
    classes = spec["classes"]
    shared = {
        c["name"]: [rng.randrange(4, vocab_size) for _ in range(c.get("shared_prefix_tokens", 0))] for c in classes
    }
    arrival = spec["arrival"]
    gaps = random.Random(spec["seed"] + 1)
    t = 0.0
    requests = []
    for i in range(spec["num_requests"]):
        cls = rng.choices(classes, weights=[c["weight"] for c in classes])[0]
        n_prompt = _draw(rng, cls["prompt_tokens"])
        n_out = _draw(rng, cls["output_tokens"])
        prefix = shared[cls["name"]][:n_prompt]
        prompt = prefix + [rng.randrange(4, vocab_size) for _ in range(n_prompt - len(prefix))]
        if arrival["kind"] == "poisson":
            # Arrival gaps come from their own stream, so a different rate keeps the same prompts.
            t += gaps.expovariate(arrival["rate_per_s"])
        requests.append(WorkloadRequest(i, cls["name"], t, tuple(prompt), n_out))
    return spec, requests
