"""Regenerates a benchmark workload from ../shared/workloads/*.json (same seed -> same requests)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "shared" / "workloads"


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


def load_workload(name_or_path: str, vocab_size: int) -> tuple[dict, list[WorkloadRequest]]:
    """Returns (the workload's JSON, its requests). Prompt ids are drawn from [4, vocab_size)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = WORKLOADS_DIR / f"{name_or_path.removesuffix('.json')}.json"
    spec = json.loads(path.read_text())
    rng = random.Random(spec["seed"])
    classes = spec["classes"]
    shared = {
        c["name"]: [rng.randrange(4, vocab_size) for _ in range(c.get("shared_prefix_tokens", 0))] for c in classes
    }
    arrival = spec["arrival"]
    t = 0.0
    requests = []
    for i in range(spec["num_requests"]):
        cls = rng.choices(classes, weights=[c["weight"] for c in classes])[0]
        n_prompt = _draw(rng, cls["prompt_tokens"])
        n_out = _draw(rng, cls["output_tokens"])
        prefix = shared[cls["name"]][:n_prompt]
        prompt = prefix + [rng.randrange(4, vocab_size) for _ in range(n_prompt - len(prefix))]
        if arrival["kind"] == "poisson":
            t += rng.expovariate(arrival["rate_per_s"])
        requests.append(WorkloadRequest(i, cls["name"], t, tuple(prompt), n_out))
    return spec, requests
