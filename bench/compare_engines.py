"""shapeserve's engine against vLLM's, in process, without any server: where a serving gap comes from.

    .venv/bin/python -m bench.compare_engines [--vllm-python ~/.cache/shapeserve-bench/vllm-venv/bin/python]
        [--baseline-rev REV] [--without-vllm]
        [--batches 1,8,16,64] [--mixed 16x256,16x1024] [--prefill-parts 256,1024] [--rate 2] [--seed 1002]
        [--repeats 2]

``bench/compare_vllm.sh`` compares the two servers end to end; this compares their engines alone, each
driven by a loop calling its ``step()`` (vLLM: ``LLMEngine`` in process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the tuned environment of ../shared/notes/vllm-cpu.md), on the bench model in float32, greedy:

- decode step time at each batch size (every sequence 256 tokens in), median of 20 steps;
- the step that prefills a new prompt beside running decodes (``--mixed``), median over 8 prompts;
- what a lone prompt's prefill step is made of (``--prefill-parts``): its wall time (median over 8 prompts),
  and, from ``torch.profiler`` over 4 more, the milliseconds per step inside the matmul ops (shapeserve's
  oneDNN linear, vLLM's ``onednn_mm``), inside the attention ops (torch's SDPA; vLLM's own CPU attention
  kernel; shapeserve's host-built prefill kernel, labelled with a ``record_function`` range) and the rest of
  the profiled step's wall time (norms, rotary, activation, KV writes, sampling, Python: shapeserve's numba and
  element-wise C++ kernels are no torch ops, so they land there);
- skewed-64 with Poisson arrivals at ``--rate`` (the same requests ``shapeserve bench`` sends for that seed),
  each request added when its arrival time has passed: mean TPOT, median TTFT, output tokens/s.

Each engine runs in a process of its own (the vLLM one in the vLLM virtualenv that compare_vllm.sh builds),
one after the other with ``--rest-s`` idle between, the order reversed every other repeat. Prints both
sides and the shapeserve / vLLM ratios, min / median / max over the repeats. ``--baseline-rev`` adds a third
side, the shapeserve engine of a git revision (so an engine change is measured against its parent in the
same run), and ``--without-vllm`` leaves vLLM out (ratios are then to the revision). The server comparison's
figures minus these are what the serving path (HTTP, streaming, the server's other processes) costs
each server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cluster.tools.workloads import load_workload, workload_path  # stdlib only: the vLLM virtualenv imports it too

REPO = Path(__file__).resolve().parent.parent

MODEL_DIR = REPO / ".bench-models/llama-512h-8l"
VOCAB_SIZE = 32000
CONTEXT = 256
#: The context both engines are built for (the bench model's): a prompt and its one output token must fit.
MAX_MODEL_LEN = 2048
DECODE_STEPS = 20
MIXED_PROMPTS = 8
PROFILED_PROMPTS = 4
#: Op names (torch.profiler keys) by part of a prefill step, matched as substrings, for either engine.
MATMUL_OPS = ("linear", "onednn_mm", "addmm", "aten::mm")
ATTENTION_OPS = ("scaled_dot_product", "cpu_attention", "paged_attention", "shapeserve::prefill_attention")
#: The workload's name, or the file a worker is given (a revision's worktree has no ../shared beside it).
WORKLOAD = "skewed-64"


class _Driver:
    """The few engine calls the measurements need, over either engine."""

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        raise NotImplementedError

    def step(self) -> list[tuple[str, int]]:
        """One engine step -> (request id, output tokens so far) for every request it produced tokens for."""
        raise NotImplementedError

    def busy(self) -> bool:
        raise NotImplementedError

    def prefilling(self) -> bool:
        """Whether some request still has prompt tokens to compute."""
        raise NotImplementedError


class _ShapeserveDriver(_Driver):
    def __init__(self) -> None:
        import torch

        from bench.engine_throughput import greedy, make_engine

        torch.set_num_threads(len(os.sched_getaffinity(0)))

        class Args:
            threads = len(os.sched_getaffinity(0))
            kv_tokens = 65536
            max_num_batched_tokens = 2048

        _, warm = load_workload(WORKLOAD, VOCAB_SIZE, num_requests=2)
        self.greedy = greedy
        self.engine = make_engine(MODEL_DIR, Args, warm)
        _label_native_attention_for_the_profiler()
        self.counts: dict[str, int] = {}

    def add(self, request_id, prompt, max_tokens):
        self.engine.add_request(request_id, prompt, self.greedy(max_tokens))

    def step(self):
        out = []
        for o in self.engine.step():
            self.counts[o.request_id] = self.counts.get(o.request_id, 0) + len(o.new_token_ids)
            out.append((o.request_id, self.counts[o.request_id]))
        return out

    def busy(self):
        return self.engine.has_unfinished_requests()

    def prefilling(self):
        return any(r.num_computed_tokens < r.num_prompt_tokens for r in self.engine.requests.values())


def _label_native_attention_for_the_profiler() -> None:
    """The host-built prefill kernel is no torch op: a ``record_function`` range gives ``--prefill-parts`` its time
    as attention. Revisions without the kernel have nothing to label."""
    try:
        from cluster.engine.attention import cpu_prefill
    except ImportError:
        return
    import torch

    kernel = cpu_prefill.prefill_attention_cpu

    def labelled(*args):
        with torch.profiler.record_function("shapeserve::prefill_attention"):
            return kernel(*args)

    cpu_prefill.prefill_attention_cpu = labelled


class _VllmDriver(_Driver):
    def __init__(self) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = LLM(model=str(MODEL_DIR), dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0)
        self.engine = self.llm.llm_engine
        self.params = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        self.prompt = lambda ids: TokensPrompt(prompt_token_ids=ids)
        self.pending_prefill: set[str] = set()
        self.llm.generate([self.prompt(list(range(100, 140)))], self.params(4), use_tqdm=False)  # warm-up

    def add(self, request_id, prompt, max_tokens):
        self.engine.add_request(request_id, self.prompt(prompt), self.params(max_tokens))
        self.pending_prefill.add(request_id)

    def step(self):
        out = []
        for o in self.engine.step():
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if n:
                self.pending_prefill.discard(o.request_id)
            out.append((o.request_id, n))
        return out

    def busy(self):
        return self.engine.has_unfinished_requests()

    def prefilling(self):
        return bool(self.pending_prefill)


def decode_step_ms(driver: _Driver, batch: int, rng: random.Random, tag: str, context: int = CONTEXT) -> float:
    for i in range(batch):
        driver.add(f"{tag}-{i}", [rng.randrange(100, VOCAB_SIZE) for _ in range(context)], DECODE_STEPS + 6)
    while driver.prefilling():
        driver.step()
    driver.step()
    times = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        driver.step()
        times.append(time.perf_counter() - start)
    while driver.busy():
        driver.step()
    return statistics.median(times) * 1e3


def mixed_step_ms(
    driver: _Driver, batch: int, prompt_len: int, rng: random.Random, tag: str, context: int = CONTEXT
) -> float:
    """The step that computes a new ``prompt_len``-token prompt beside ``batch`` running decodes (what every arrival
    costs the requests already decoding), median over MIXED_PROMPTS prompts. Each prompt asks for one token, so it
    leaves with its prefill step and the batch stays at ``batch`` decodes."""
    steps = MIXED_PROMPTS * 2 + 6
    for i in range(batch):
        driver.add(f"{tag}-{i}", [rng.randrange(100, VOCAB_SIZE) for _ in range(context)], steps)
    while driver.prefilling():
        driver.step()
    driver.step()
    times = []
    for k in range(MIXED_PROMPTS):
        driver.add(f"{tag}-p{k}", [rng.randrange(100, VOCAB_SIZE) for _ in range(prompt_len)], 1)
        start = time.perf_counter()
        driver.step()
        times.append(time.perf_counter() - start)
        driver.step()  # a decode-only step between arrivals, as in a served stream
    while driver.busy():
        driver.step()
    return statistics.median(times) * 1e3


#: ``poisson_run``'s keys printed under names of their own (kept since earlier runs: their rows compare across runs).
RUN_HEADLINE = ("mean_tpot_ms", "median_ttft_ms", "output_tok_s")


def poisson_run(driver: _Driver, rate: float, seed: int) -> dict:
    _, requests = load_workload(WORKLOAD, VOCAB_SIZE, rate_per_s=rate, seed=seed)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    produced: dict[str, int] = {}
    prefill_steps: list[float] = []
    decode_steps: list[float] = []
    decode_batch: list[int] = []
    start = time.perf_counter()
    i = 0
    while i < len(requests) or driver.busy():
        now = time.perf_counter() - start
        while i < len(requests) and requests[i].arrival_s <= now:
            r = requests[i]
            driver.add(f"p{r.index}", list(r.prompt_token_ids), r.output_tokens)
            i += 1
        if not driver.busy():
            time.sleep(max(0.0, requests[i].arrival_s - now))
            continue
        # Which steps compute prompt tokens, and how long each kind takes: the two engines may reach the same
        # TPOT by different mixes (fewer, larger prefill chunks; faster decode-only steps).
        prefilling = driver.prefilling()
        step_start = time.perf_counter()
        outputs = driver.step()
        t = time.perf_counter() - start
        (prefill_steps if prefilling else decode_steps).append(time.perf_counter() - step_start)
        decoded = 0
        for rid, n in outputs:
            if n > 0:
                decoded += rid in first
                first.setdefault(rid, t)
                last[rid] = t
                produced[rid] = n
        if not prefilling:
            decode_batch.append(decoded)
    wall = time.perf_counter() - start
    tpot = [(last[r] - first[r]) / (produced[r] - 1) for r in first if produced[r] > 1]
    ttft = [first[f"p{r.index}"] - r.arrival_s for r in requests]
    return {
        "mean_tpot_ms": statistics.mean(tpot) * 1e3,
        "median_ttft_ms": statistics.median(ttft) * 1e3,
        "output_tok_s": sum(produced.values()) / wall,
        "steps with prompt tokens": len(prefill_steps),
        "prompt-token step mean, ms": statistics.mean(prefill_steps or [0.0]) * 1e3,
        "prompt-token steps, % of wall": 100 * sum(prefill_steps) / wall,
        "decode-only steps": len(decode_steps),
        "decode-only step mean, ms": statistics.mean(decode_steps or [0.0]) * 1e3,
        "decode-only step mean batch": statistics.mean(decode_batch or [0]),
    }


def prefill_parts_ms(driver: _Driver, prompt_len: int, rng: random.Random, tag: str) -> dict[str, float]:
    """A lone ``prompt_len``-token prompt's prefill step (one output token, so the step is all of it): wall time
    unprofiled, then matmul / attention / rest per step from ``torch.profiler``'s self CPU time of the ops."""
    from torch.profiler import profile

    def one(k: int) -> float:
        driver.add(f"{tag}-{k}", [rng.randrange(100, VOCAB_SIZE) for _ in range(prompt_len)], 1)
        start = time.perf_counter()
        while driver.busy():
            driver.step()
        return time.perf_counter() - start

    wall = statistics.median(one(k) for k in range(MIXED_PROMPTS))
    with profile() as prof:
        profiled_s = sum(one(MIXED_PROMPTS + k) for k in range(PROFILED_PROMPTS))
    matmul_us = attention_us = 0.0
    for event in prof.key_averages():
        if any(op in event.key for op in MATMUL_OPS):
            matmul_us += event.self_cpu_time_total
        elif any(op in event.key for op in ATTENTION_OPS):
            attention_us += event.self_cpu_time_total
    matmul, attention = matmul_us / 1e3 / PROFILED_PROMPTS, attention_us / 1e3 / PROFILED_PROMPTS
    return {
        f"{prompt_len}-token prompt alone, ms": wall * 1e3,
        f"  {prompt_len}: in matmul ops, ms": matmul,
        f"  {prompt_len}: in attention ops, ms": attention,
        f"  {prompt_len}: the rest, ms": profiled_s * 1e3 / PROFILED_PROMPTS - matmul - attention,
    }


def worker(
    side: str,
    batches: list[int],
    mixed: list[tuple[int, int]],
    parts: list[int],
    rate: float,
    seed: int,
    context: int = CONTEXT,
) -> dict:
    driver = _VllmDriver() if side == "vllm" else _ShapeserveDriver()
    rng = random.Random(seed)
    at = "" if context == CONTEXT else f", context {context}"
    result = {f"decode step ms, batch {b}{at}": decode_step_ms(driver, b, rng, f"d{b}", context) for b in batches}
    for b, p in mixed:
        result[f"{b} decodes{at} + {p}-token prompt, ms"] = mixed_step_ms(driver, b, p, rng, f"m{b}x{p}", context)
    for p in parts:
        result.update(prefill_parts_ms(driver, p, rng, f"pp{p}"))
    if rate > 0:
        run = poisson_run(driver, rate, seed)
        result[f"rate={rate:g}: mean TPOT ms"] = run["mean_tpot_ms"]
        result[f"rate={rate:g}: median TTFT ms"] = run["median_ttft_ms"]
        result[f"rate={rate:g}: output tok/s"] = run["output_tok_s"]
        result.update({f"rate={rate:g}: {k}": v for k, v in run.items() if k not in RUN_HEADLINE})
    return result


def _vllm_env(vllm_python: str) -> dict[str, str]:
    env = dict(os.environ)
    cores = len(os.sched_getaffinity(0))
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if Path(p).is_file()]
    iomp = Path(vllm_python).resolve().parent.parent / "lib/libiomp5.so"
    if iomp.is_file():
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache/shapeserve-bench/vllm-venv/bin/python"))
    ap.add_argument("--batches", default="1,8,16,64", help="decode batch sizes to time ('' for none)")
    ap.add_argument(
        "--mixed",
        default="16x256,16x1024",
        help="BxP,...: time the step that prefills a P-token prompt beside B running decodes ('' for none)",
    )
    ap.add_argument(
        "--prefill-parts",
        default="",
        help="P,...: profile a lone P-token prompt's prefill step into matmul / attention / the rest ('' for none)",
    )
    ap.add_argument("--rate", type=float, default=2.0, help="the Poisson run's requests/s (0: no Poisson run)")
    ap.add_argument(
        "--context",
        type=int,
        default=CONTEXT,
        help="prompt tokens of each running decode in --batches and --mixed (a served batch carries longer ones)",
    )
    ap.add_argument("--seed", type=int, default=1002)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--rest-s",
        type=float,
        default=60.0,
        help="idle seconds before each run after the first (this VM runs slower right after vLLM's runs: the "
        "shapeserve engine's TPOT at 2 req/s read 24.5 ms right after one and 21.6 ms after a rest)",
    )
    ap.add_argument(
        "--baseline-rev",
        help="also run the shapeserve engine of this git revision (a worktree, as bench.serve_ab makes), in the same "
        "alternating order, and print each side's ratio to it",
    )
    ap.add_argument("--without-vllm", action="store_true", help="only shapeserve here against --baseline-rev")
    ap.add_argument("--worker", choices=["vllm", "shapeserve"], help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    mixed = [(int(b), int(p)) for b, p in (m.split("x") for m in args.mixed.split(",") if m)]
    parts = [int(p) for p in args.prefill_parts.split(",") if p]
    # Refused here, not by the first engine minutes into the run.
    too_long = [p for p in parts + [p for _, p in mixed] if p >= MAX_MODEL_LEN]
    if too_long:
        raise SystemExit(f"prompts of {too_long} tokens leave no room for an output in {MAX_MODEL_LEN}: use fewer")
    if args.context + DECODE_STEPS + 6 > MAX_MODEL_LEN:
        raise SystemExit(
            f"--context {args.context} leaves no room for the {DECODE_STEPS + 6} tokens each running decode "
            f"generates in {MAX_MODEL_LEN}: use at most {MAX_MODEL_LEN - DECODE_STEPS - 6}"
        )
    if args.worker:
        global WORKLOAD
        WORKLOAD = args.workload_file or WORKLOAD
        result = worker(args.worker, batches, mixed, parts, args.rate, args.seed, args.context)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not (MODEL_DIR / "config.json").is_file():
        raise SystemExit(f"no model at {MODEL_DIR}: run bench/compare_vllm.sh (or python -m bench.engine_throughput)")
    sides = ([] if args.without_vllm else ["vllm"]) + ["shapeserve"] + (["baseline"] if args.baseline_rev else [])
    if len(sides) < 2:
        raise SystemExit("nothing to compare: --without-vllm needs --baseline-rev")
    here = Path(__file__).resolve()
    commands = {
        # As a module from the repository root: run as a script, bench/ would come first on sys.path and its
        # kernels.py would shadow the `kernels` package vLLM imports.
        "vllm": ([args.vllm_python, "-m", "bench.compare_engines"], REPO, _vllm_env(args.vllm_python)),
        "shapeserve": ([sys.executable, "-m", "bench.compare_engines"], REPO, dict(os.environ)),
    }
    labels = {"vllm": "vLLM", "shapeserve": "shapeserve"}
    if args.baseline_rev:
        # This file's worker over the revision's engine: the revision's tree comes first on sys.path, so `cluster`
        # and `bench.engine_throughput` are its own (this worker may measure what the revision's did not).
        from bench.serve_ab import source_tree

        tree = source_tree(args.baseline_rev)
        env = dict(os.environ, PYTHONPATH=str(tree))
        commands["baseline"] = ([sys.executable, str(here)], tree, env)
        labels["baseline"] = f"shapeserve@{args.baseline_rev}"[:24]
    results: dict[str, list[dict]] = {side: [] for side in sides}
    runs = 0
    for repeat in range(args.repeats):
        for side in sides if repeat % 2 == 0 else sides[::-1]:
            if runs:
                time.sleep(args.rest_s)
            runs += 1
            prefix, cwd, env = commands[side]
            cmd = [*prefix, "--worker", "vllm" if side == "vllm" else "shapeserve", "--batches", args.batches]
            cmd += ["--mixed", args.mixed, "--prefill-parts", args.prefill_parts]
            cmd += ["--rate", str(args.rate), "--seed", str(args.seed), "--context", str(args.context)]
            cmd += ["--workload-file", str(workload_path(WORKLOAD))]
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"the {labels[side]} engine run failed (exit {proc.returncode})")
            results[side].append(json.loads(line.removeprefix("RESULT ")))
            print(f"  repeat {repeat + 1}/{args.repeats}: {labels[side]} done", file=sys.stderr, flush=True)
    print(f"{args.repeats} repeats, orders alternating; min / median / max; ratios of the medians")
    base = sides[0] if sides[0] == "vllm" else "baseline"
    ratio_sides = [s for s in sides if s != base]
    ratio_names = [f"{s[:5]}/{base[:5]}" for s in ratio_sides]
    width = max(34, *(len(k) for k in results[sides[0]][0]))
    print(f"{'':<{width}}" + "".join(f" {labels[s]:>24}" for s in sides) + "".join(f" {n:>12}" for n in ratio_names))
    for key in results[sides[0]][0]:
        values = {s: [r[key] for r in results[s]] for s in sides}
        med = {s: statistics.median(v) for s, v in values.items()}
        cells = "".join(f" {min(v):7.1f} {med[s]:7.1f} {max(v):7.1f}" for s, v in values.items())
        ratios = "".join(f" {med[s] / med[base]:11.2f}x" for s in ratio_sides)
        print(f"{key:<{width}}{cells}{ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
