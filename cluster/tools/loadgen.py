"""``shapeserve bench``: load from a workload file against any OpenAI-compatible server.

Its only input about the server is a base URL, so the same run measures shapeserve and
``vllm serve`` alike. Requests are ``/v1/completions`` with token-id prompts from the workload
(``cluster.tools.workloads``), streamed with usage, ``ignore_eos`` and greedy sampling, sent at the
workload's arrival times (a burst, or Poisson; ``--rate`` overrides). Reports, per class and in
all: TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99, request and output-token throughput,
goodput under the workload's SLO, and errors by status. Writes the report as JSON and, with
``--plot-dir``, PNG plots (latency CDFs per class, throughput over time).

Timing follows ``vllm bench serve``: TTFT is the time to the first streamed chunk that carries
text; ITL is the gap between chunks that carry text; TPOT is (e2e - TTFT) / (output tokens - 1)
per request, with output tokens from the server's usage report.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cluster.tools.workloads import WorkloadRequest, load_workload

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds, from the run's start)."""

    index: int
    class_name: str
    prompt_tokens: int
    expected_output_tokens: int
    sent_at: float = 0.0
    status: int = 0
    error: str = ""
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    #: Times (from the run's start) at which chunks with text arrived, and how many tokens each added.
    chunk_times: list[float] = field(default_factory=list)
    #: Per 429 the request got: seconds from sending it to the answer (then, with retries, it waited the
    #: Retry-After and was sent again).
    rejections: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)  # type: ignore[operator]


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys([*(f"p{p}" for p in PERCENTILES), "mean"], None)
    ordered = sorted(values)

    def pick(p: float) -> float:
        # Nearest-rank on the sorted values (what numpy's "inverted_cdf" gives).
        return ordered[max(0, min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1))]

    out: dict[str, float | None] = {f"p{p}": pick(p) for p in PERCENTILES}
    out["mean"] = statistics.fmean(ordered)
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: dict | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_status": dict(Counter(str(r.status or "connection") for r in records if not r.ok)),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": percentiles([gap for r in ok for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "rejected_429": sum(len(r.rejections) for r in records),
        "reject_latency_s": percentiles([t for r in records for t in r.rejections]),
    }
    # Retries: every 429 but a request's last one was followed by a retry after its Retry-After.
    retries = sum(len(r.rejections) - (r.status == 429) for r in records)
    summary["retries"] = retries
    summary["retries_succeeded"] = sum(1 for r in records if r.rejections and r.ok) / retries if retries else None
    if slo:
        good = [r for r in ok if meets_slo(r, slo)]
        summary["slo"] = slo
        summary["good_requests"] = len(good)
        summary["goodput"] = len(good) / duration_s if duration_s else 0.0
        summary["slo_attainment"] = len(good) / len(records) if records else 0.0
    return summary


def goodput_until(records: list[RequestRecord], end_s: float, slo: dict) -> float:
    """Requests within the SLO per second that finished in the run's first ``end_s`` seconds (the window in
    which load was offered, without the tail of late retries)."""
    good = [r for r in records if r.ok and meets_slo(r, slo) and r.chunk_times and r.chunk_times[-1] <= end_s]
    return len(good) / end_s if end_s > 0 else 0.0


def meets_slo(r: RequestRecord, slo: dict) -> bool:
    if r.ttft is None or r.ttft * 1000 > slo.get("ttft_ms", math.inf):
        return False
    tpot = r.tpot
    return tpot is None or tpot * 1000 <= slo.get("tpot_ms", math.inf)


# ---- the client ---------------------------------------------------------------------------


async def send_one(
    session,
    url: str,
    model: str,
    req: WorkloadRequest,
    rec: RequestRecord,
    t0: float,
    temperature: float = 0.0,
    retries_after_429: int = 0,
) -> None:
    """Sends ``req`` and records what came back; a 429 is sent again after its Retry-After, up to
    ``retries_after_429`` times (the record keeps the last attempt's outcome)."""
    for attempt in range(retries_after_429 + 1):
        retry_after = await _send_once(session, url, model, req, rec, t0, temperature, attempt)
        if retry_after is None or attempt == retries_after_429:
            return
        await asyncio.sleep(retry_after)


async def _send_once(
    session,
    url: str,
    model: str,
    req: WorkloadRequest,
    rec: RequestRecord,
    t0: float,
    temperature: float,
    attempt: int = 0,
) -> float | None:
    """One attempt; returns the Retry-After seconds when it was answered 429, else None. Retries say so as the
    OpenAI SDKs do (``X-Stainless-Retry-Count``)."""
    body = {
        "model": model,
        "prompt": list(req.prompt_token_ids),
        "max_tokens": req.output_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    if not rec.rejections:
        rec.sent_at = start - t0
    last = start
    try:
        async with session.post(url, json=body, headers={"X-Stainless-Retry-Count": str(attempt)}) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.text())[:500]
                if resp.status == 429:
                    rec.rejections.append(time.perf_counter() - start)
                    return float(resp.headers.get("Retry-After", "1"))
                return None
            rec.error = ""
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    now = time.perf_counter()
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:]
                        if payload == b"[DONE]":
                            continue
                        msg = json.loads(payload)
                        if "error" in msg:
                            rec.error = str(msg["error"].get("message", msg["error"]))[:500]
                            continue
                        if msg.get("usage"):
                            rec.output_tokens = msg["usage"]["completion_tokens"]
                        if any(c.get("text") for c in msg.get("choices", [])):
                            if rec.ttft is None:
                                rec.ttft = now - start
                            else:
                                rec.itl.append(now - last)
                            last = now
                            rec.chunk_times.append(now - t0)
            rec.e2e = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a connection failure is a result to report, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:500]
    return None


async def run_load(
    base_url: str,
    model: str,
    requests: list[WorkloadRequest],
    timeout_s: float,
    progress: bool = True,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    retries_after_429: int = 0,
) -> tuple[list[RequestRecord], float]:
    import aiohttp
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + "/completions"
    records = [RequestRecord(r.index, r.class_name, len(r.prompt_token_ids), r.output_tokens) for r in requests]
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(req: WorkloadRequest, rec: RequestRecord) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with limit:
                await send_one(session, url, model, req, rec, t0, temperature, retries_after_429)
            bar.update(1)
            bar.set_postfix(ok=sum(r.ok for r in records), tok=sum(r.output_tokens for r in records))

        await asyncio.gather(*(one(r, rec) for r, rec in zip(requests, records, strict=False)))
        duration = time.perf_counter() - t0
    bar.close()
    return records, duration


async def discover_model(base_url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(base_url.rstrip("/") + "/models") as resp:
        data = await resp.json()
    return data["data"][0]["id"]


# ---- report ---------------------------------------------------------------------------------


def report(records: list[RequestRecord], duration_s: float, spec: dict) -> dict[str, Any]:
    slo = spec.get("slo")
    by_class = {
        name: summarize([r for r in records if r.class_name == name], duration_s, slo)
        for name in sorted({r.class_name for r in records})
    }
    return {"workload": spec.get("name"), "all": summarize(records, duration_s, slo), "by_class": by_class}


def format_report(result: dict[str, Any]) -> str:
    lines = []
    sections = [("all", result["all"])]
    if len(result["by_class"]) > 1:
        sections += [(f"class {name}", s) for name, s in result["by_class"].items()]
    for name, s in sections:
        lines.append(
            f"[{name}] {s['completed']}/{s['requests']} ok in {s['duration_s']:.1f} s: "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s"
            + (f", goodput {s['goodput']:.2f} req/s ({s['slo_attainment']:.0%} within SLO)" if "goodput" in s else "")
        )
        for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            v = s[metric]
            if v["p50"] is None:
                continue
            cells = "  ".join(f"{k} {v[k] * 1000:8.1f}" for k in ("mean", "p50", "p90", "p99"))
            lines.append(f"    {metric[:-2]:>5} ms  {cells}")
        if s["errors_by_status"]:
            lines.append(f"    errors by status: {s['errors_by_status']}")
        if s["rejected_429"]:
            p99 = s["reject_latency_s"]["p99"]
            retried = f"{s['retries_succeeded']:.0%}" if s["retries_succeeded"] is not None else "-"
            lines.append(
                f"    429s: {s['rejected_429']} answered in p99 {p99 * 1000:.1f} ms; {s['retries']} retries "
                f"after Retry-After, {retried} of them served"
            )
    return "\n".join(lines)


def write_plots(records: list[RequestRecord], duration_s: float, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    classes = sorted({r.class_name for r in ok})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    metrics = [
        ("TTFT", lambda r: [r.ttft]),
        ("TPOT", lambda r: [r.tpot]),
        ("ITL", lambda r: r.itl),
        ("end-to-end", lambda r: [r.e2e]),
    ]
    for ax, (title, get) in zip(axes, metrics, strict=False):
        for name in classes:
            values = sorted(v * 1000 for r in ok if r.class_name == name for v in get(r) if v is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend()
    fig.tight_layout()
    cdf = directory / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = max(duration_s / 60, 0.5)
    bins = [i * width for i in range(int(duration_s / width) + 2)]
    chunk_times = [t for r in ok for t in r.chunk_times]
    ax.hist(chunk_times, bins=bins, weights=[1 / width] * len(chunk_times), label="streamed chunks/s")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("chunks / s")
    ax.set_title("Streaming throughput over time")
    fig.tight_layout()
    over_time = directory / "throughput_over_time.png"
    fig.savefig(over_time, dpi=100)
    plt.close(fig)
    return [cdf, over_time]


# ---- CLI ------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--workload", default="skewed-64", help="a workload file, or a name in ../shared/workloads")
    p.add_argument("--vocab-size", type=int, required=True, help="the served model's vocabulary size (prompt ids)")
    p.add_argument("--model", default=None, help="model name to send (default: the first in /v1/models)")
    p.add_argument(
        "--rate", type=float, default=None, help="requests/s, Poisson (inf: all at once); default: the workload's"
    )
    p.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    p.add_argument("--seed", type=int, default=None, help="override the workload's seed (same shapes, new prompts)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--output-json", default=None, help="write the report (and every request's record) here")
    p.add_argument("--plot-dir", default=None, help="write latency CDFs and throughput over time as PNG here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sent with every request (default 0, greedy; vllm bench serve now leaves it to the server: 1.0)",
    )
    p.add_argument(
        "--retries-after-429",
        type=int,
        default=0,
        help="send a request answered 429 again after its Retry-After, up to this many times (default 0)",
    )


def _prepare_outputs(output_json: str | None, plot_dir: str | None) -> None:
    """Makes the report's and the plots' directories and checks they can be written, so that a bad path is said
    before the load runs, not after minutes of it (when the measurements would be lost)."""
    if plot_dir and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot-dir needs matplotlib: pip install 'shapeserve[bench]' (or leave out --plot-dir)")
    for flag, directory in (
        ("--output-json", Path(output_json).parent if output_json else None),
        ("--plot-dir", Path(plot_dir) if plot_dir else None),
    ):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(
                f"{flag}: cannot create {directory} ({e.strerror}); give a path in a writable directory"
            ) from e
        if not os.access(directory, os.W_OK):
            raise SystemExit(f"{flag}: {directory} is not writable; give a path in a writable directory")
    if output_json and Path(output_json).is_dir():
        raise SystemExit(f"--output-json: {output_json} is a directory; give a file name")


def run(args: argparse.Namespace) -> int:
    _prepare_outputs(args.output_json, args.plot_dir)
    spec, requests = load_workload(args.workload, args.vocab_size, args.rate, args.num_requests, args.seed)
    model = args.model or asyncio.run(discover_model(args.base_url))
    records, duration = asyncio.run(
        run_load(
            args.base_url,
            model,
            requests,
            args.timeout,
            not args.no_progress,
            args.max_concurrency,
            args.temperature,
            args.retries_after_429,
        )
    )
    result = report(records, duration, spec)
    result["base_url"] = args.base_url
    result["model"] = model
    result["rate"] = args.rate
    print(format_report(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({**result, "records": [asdict(r) for r in records]}, indent=1))
    if args.plot_dir:
        for path in write_plots(records, duration, Path(args.plot_dir)):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(r.ok for r in records) else 1
