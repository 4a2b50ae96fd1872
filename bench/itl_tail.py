"""Where a run's inter-token latency tail comes from: the stalls the streams saw together, and what ended them.

    python -m bench.itl_tail RUN.json [RUN.json ...] [--min-gap-ms 120] [--top 20]

Reads what ``shapeserve bench --output-json`` writes (``bench/compare_vllm.sh`` keeps one such file per server and
workload in its output directory), so it reads a vLLM run as well as ours. A step that prefills a prompt beside
running decodes holds every stream's next token until it ends: the streams see one long gap each, all ending
together. This groups the gaps longer than ``--min-gap-ms`` by when they ended (within 30 ms of each other) and
names the prompts whose first token arrived then (the prompts the stalling step prefilled). Prints, per stall,
when it ended, its longest gap, how many streams saw it and those prompts' lengths; then, over the stalls that
ended exactly one prompt's prefill, the gap per prompt token (min / median / max): for the same workload and seed,
two servers' prefill steps under load side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

#: Gaps (and first tokens) ending within this many seconds of each other belong to one stall.
SAME_STALL_S = 0.03


@dataclass(frozen=True)
class Stall:
    #: When the gaps ended, seconds from the run's start (the earliest end in the group).
    ended_at: float
    longest_gap_s: float
    streams: int
    #: Prompt lengths of the requests whose first token came as the stall ended.
    prefilled: tuple[int, ...]


def find_stalls(records: list[dict], min_gap_s: float) -> list[Stall]:
    ends: list[tuple[float, float]] = []
    for r in records:
        times = r.get("chunk_times") or []
        ends += [(b, b - a) for a, b in zip(times, times[1:], strict=False) if b - a > min_gap_s]
    firsts = [
        (r["sent_at"] + r["ttft"], r["prompt_tokens"]) for r in records if r.get("status") == 200 and r.get("ttft")
    ]
    groups: list[list[tuple[float, float]]] = []
    for end, gap in sorted(ends):
        if groups and end - groups[-1][0][0] < SAME_STALL_S:
            groups[-1].append((end, gap))
        else:
            groups.append([(end, gap)])
    stalls = []
    for group in groups:
        start, last = group[0][0], group[-1][0]
        prefilled = tuple(p for t, p in firsts if start - SAME_STALL_S < t < last + SAME_STALL_S)
        stalls.append(Stall(start, max(g for _, g in group), len(group), prefilled))
    return stalls


def per_prompt_token_ms(stalls: list[Stall]) -> list[float]:
    """Gap per prompt token of the stalls that ended exactly one prompt's prefill."""
    return [s.longest_gap_s * 1000 / s.prefilled[0] for s in stalls if len(s.prefilled) == 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="JSON files written by shapeserve bench --output-json")
    ap.add_argument("--min-gap-ms", type=float, default=120.0, help="gaps longer than this count (default 120)")
    ap.add_argument("--top", type=int, default=20, help="print the longest this many stalls of each run")
    args = ap.parse_args(argv)
    for path in args.runs:
        try:
            records = json.loads(Path(path).read_text())["records"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{path}: not a shapeserve bench --output-json file ({e})") from e
        stalls = find_stalls(records, args.min_gap_ms / 1000)
        print(f"{path}: {len(stalls)} stalls over {args.min_gap_ms:g} ms")
        for s in sorted(stalls, key=lambda s: -s.longest_gap_s)[: args.top]:
            prompts = ", ".join(map(str, s.prefilled)) or "none"
            print(
                f"  ended at {s.ended_at:7.2f} s  longest gap {s.longest_gap_s * 1000:6.0f} ms  "
                f"{s.streams:3d} streams  first tokens of prompts: {prompts}"
            )
        per_token = per_prompt_token_ms(stalls)
        if per_token:
            lo, mid, hi = min(per_token), statistics.median(per_token), max(per_token)
            print(
                f"  gap per prompt token, stalls ending one prompt's prefill ({len(per_token)}): "
                f"{lo:.3f} / {mid:.3f} / {hi:.3f} ms (min / median / max)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
