"""``shapeserve serve`` as a user starts it: the decode replica serves HTTP on --port itself (direct ingress),
with a prefill pool (disaggregation on), driven over real HTTP and by ``shapeserve bench``.

Greedy outputs over HTTP equal run-batch's on the same model, LOCAL and REMOTE, streamed and not; a client
that goes away frees its blocks; ``shapeserve bench`` counts what the server's metrics count.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from cluster.tools.cli import main as cli_main
from tests.integration.live_server import live_server, settled_scrape, total
from tests.integration.otlp_collector import OTLPCollector

pytestmark = pytest.mark.slow

SHORT = [[5 + i, 17, 33, 80] for i in range(4)]  # 4 tokens: LOCAL
# 90 tokens: REMOTE. Each prompt is sent once: a repeat finds its blocks cached and prefills locally.
LONG = [[4 + (seed * 131 + i * 17) % 500 for i in range(90)] for seed in range(4)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def otlp():
    """Where the server's processes export their request traces (the server runs with tracing on)."""
    collector = OTLPCollector().start()
    try:
        yield collector
    finally:
        collector.stop()


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory, otlp):
    # SLO admission off: it refuses by the prefill rate it measures, so on a busy CI machine it refused 2 of
    # test_bench_counts_match_the_server_metrics's 10 requests. Admission has tests of its own.
    config = f"""
device: cpu
served_model_name: demo
disaggregation: 'on'
admission: {{admit_within_slo: false}}
classifier: {{local_max_uncached_tokens: 32}}
decode: {{num_blocks: 256}}
prefill: {{num_blocks: 256}}
tracing: {{otlp_endpoint: '{otlp.endpoint}'}}
"""
    with live_server(demo_model, tmp_path_factory.mktemp("cli-server"), config) as proc:
        yield proc


def run_batch(demo_model, tmp, bodies: list[dict]) -> list[dict]:
    """run-batch's choice for each completions body (the offline reference)."""
    tmp.mkdir(parents=True, exist_ok=True)
    infile, outfile = tmp / "in.jsonl", tmp / "out.jsonl"
    with infile.open("w") as f:
        for i, b in enumerate(bodies):
            line = {"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": {**b, "model": "demo"}}
            f.write(json.dumps(line) + "\n")
    cmd = [
        "run-batch",
        "-i",
        str(infile),
        "-o",
        str(outfile),
        "--model",
        str(demo_model),
        "--served-model-name",
        "demo",
    ]
    assert cli_main(cmd) == 0
    records = [json.loads(line)["response"] for line in outfile.read_text().splitlines()]
    assert all(r["status_code"] == 200 for r in records), records
    return [r["body"]["choices"][0] for r in records]


@pytest.fixture(scope="module")
def run_batch_tokens(demo_model, tmp_path_factory):
    """run-batch's greedy tokens for SHORT + LONG."""
    choices = run_batch(demo_model, tmp_path_factory.mktemp("run-batch"), [body(p) for p in SHORT + LONG])
    return [c["token_ids"] for c in choices]


def body(prompt, **extra):
    return {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def streamed_tokens(url: str, prompt) -> tuple[str, list[int]]:
    ids = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body(prompt, stream=True), timeout=120) as resp:
        assert resp.status_code == 200
        route = resp.headers["x-shapeserve-route"]
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return route, ids


def test_the_decode_replica_serves_the_port_itself(server):
    """No proxy between the client and the replica: the listening socket belongs to the decode replica."""
    import psutil

    port = int(server.url.rsplit(":", 1)[1])
    owners = {
        p.cmdline()[0]
        for p in server.tree()
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert owners and all("DecodeWorker" in name for name in owners), owners


def test_a_burst_is_served_not_dropped_by_serve(server, demo_model):
    """A load test's burst (skewed-64's 64 requests at once, streamed, prompts cut to the demo model): each one
    is served or, if admission says so, a 429; Serve never drops one. A queue limit on the replica that serves
    the port (Serve's ``max_queued_requests``) answered 42 of such a burst "503 Request dropped due to
    backpressure" on the bench model."""
    import asyncio

    from cluster.tools.loadgen import run_load
    from cluster.tools.workloads import WorkloadRequest, load_workload

    _, shapes = load_workload("skewed-64", 512, float("inf"), 64, seed=1001)
    burst = [WorkloadRequest(r.index, r.class_name, 0.0, r.prompt_token_ids[:400], 32) for r in shapes]
    records, _ = asyncio.run(run_load(f"{server.url}/v1", "demo", burst, 120, False))
    statuses = sorted(r.status for r in records)
    assert set(statuses) <= {200, 429} and statuses.count(200) > 0, statuses


def test_greedy_http_equals_run_batch_local_and_remote_stream_and_not(server, run_batch_tokens):
    for i, (prompt, want) in enumerate(zip(SHORT + LONG, run_batch_tokens, strict=True)):
        expected_route = "local" if len(prompt) <= 32 else "remote"
        if i % 2 == 0:
            resp = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=120)
            assert resp.status_code == 200, resp.text
            route, ids = resp.headers["x-shapeserve-route"], resp.json()["choices"][0]["token_ids"]
        else:
            route, ids = streamed_tokens(server.url, prompt)
        assert (route, ids) == (expected_route, want), f"prompt {i}"


def test_request_id_reaches_the_replica_logs_of_both_pools(server):
    """The client's X-Request-Id names the response, and Serve's log lines of the request carry it on the decode
    replica and on the prefill replica it called."""
    import glob
    import os
    import uuid

    rid = f"logcheck-{uuid.uuid4().hex[:12]}"
    prompt = [4 + (i * 29) % 500 for i in range(90)]  # not sent by any other test: REMOTE
    resp = httpx.post(f"{server.url}/v1/completions", json=body(prompt), headers={"x-request-id": rid}, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-shapeserve-route"] == "remote", resp.text
    assert resp.json()["id"] == f"cmpl-{rid}" and resp.headers.get_list("x-request-id") == [rid]
    found: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not {"DecodeWorker", "PrefillWorker"} <= found:
        for path in glob.glob("/tmp/ray/session_*/logs/serve/replica_*.log"):
            if os.path.getmtime(path) > time.time() - 600 and rid in open(path, errors="replace").read():
                found |= {name for name in ("DecodeWorker", "PrefillWorker") if name in os.path.basename(path)}
        time.sleep(0.5)
    assert found == {"DecodeWorker", "PrefillWorker"}, found


def test_remote_request_is_one_trace_across_the_processes(server, otlp):
    """Exported over OTLP by the decode and the prefill replica processes: one trace, each span under the right
    parent, the prefill replica's spans under the decode replica's attempt."""
    import uuid

    rid = f"trace-{uuid.uuid4().hex[:12]}"
    prompt = [4 + (i * 41) % 500 for i in range(90)]  # not sent by any other test: REMOTE
    resp = httpx.post(f"{server.url}/v1/completions", json=body(prompt), headers={"x-request-id": rid}, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-shapeserve-route"] == "remote", resp.text
    want = {"shapeserve.admission", "shapeserve.queue", "shapeserve.remote_prefill", "shapeserve.decode"}
    deadline = time.monotonic() + 30  # the processes export in batches, every few seconds
    while True:
        roots = [s for s in otlp.spans() if s.attributes.get("shapeserve.request_id") == f"cmpl-{rid}"]
        trace = [s for s in otlp.spans() if roots and s.trace_id == roots[0].trace_id]
        if len(trace) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    (root,) = roots
    assert root.parent_span_id == "" and root.attributes["shapeserve.route"] == "remote"

    def children(parent):
        return sorted((s for s in trace if s.parent_span_id == parent.span_id), key=lambda s: s.start_ns)

    under_root = children(root)
    assert {s.name for s in under_root} == want, [s.name for s in trace]
    (attempt,) = [s for s in under_root if s.name == "shapeserve.remote_prefill"]
    on_prefill = children(attempt)
    assert [s.name for s in on_prefill] == ["shapeserve.queue", "shapeserve.prefill", "shapeserve.kv_transfer"]
    assert {s.resource["shapeserve.role"] for s in [root, *under_root]} == {"decode"}
    assert {s.resource["shapeserve.role"] for s in on_prefill} == {"prefill"}
    assert on_prefill[0].resource["process.pid"] != root.resource["process.pid"]  # two processes, one trace
    assert len(trace) == 1 + len(under_root) + len(on_prefill)


def pools(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/pools", timeout=30).json()["replicas"]


def test_client_disconnect_frees_every_block(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body([7] * 200, stream=True, max_tokens=600), timeout=60
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
    # leaving the block closed the connection mid-stream
    end = time.monotonic() + 20
    while time.monotonic() < end:
        reps = pools(server.url)
        if len(reps) == 2 and all(r["kv_blocks_used"] == 0 and r["active_requests"] == 0 for r in reps):
            break
        time.sleep(0.25)
    assert all(r["kv_blocks_used"] == 0 and r["active_requests"] == 0 for r in reps), reps


def test_bench_counts_match_the_server_metrics(server, tmp_path):
    workload = tmp_path / "small.json"
    workload.write_text(
        json.dumps(
            {
                "name": "small",
                "seed": 5,
                "num_requests": 10,
                "arrival": {"kind": "burst"},
                "classes": [
                    {
                        "name": "chat",
                        "weight": 0.7,
                        "prompt_tokens": {"dist": "uniform", "min": 8, "max": 30},
                        "output_tokens": {"dist": "uniform", "min": 4, "max": 10},
                    },
                    {
                        "name": "doc",
                        "weight": 0.3,
                        "prompt_tokens": {"dist": "uniform", "min": 60, "max": 120},
                        "output_tokens": {"dist": "fixed", "value": 6},
                    },
                ],
                "ignore_eos": True,
                "slo": {"ttft_ms": 60000, "tpot_ms": 60000},
            }
        )
    )
    # The same counts under vLLM's names too, for dashboards built for vLLM.
    names = ("vllm:request_success_total", "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count")
    before = settled_scrape(server.url)
    report = tmp_path / "reports" / "report.json"  # a directory the bench makes
    argv = ["bench", "--base-url", f"{server.url}/v1", "--workload", str(workload), "--vocab-size", "512"]
    assert cli_main([*argv, "--output-json", str(report), "--plot-dir", str(tmp_path / "plots"), "--no-progress"]) == 0
    result = json.loads(report.read_text())
    assert result["all"]["completed"] == result["all"]["requests"] == 10 and result["all"]["failed"] == 0
    assert set(result["by_class"]) == {"chat", "doc"}
    assert result["all"]["good_requests"] == 10
    after = settled_scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert moved("shapeserve_requests_total", outcome="ok") == 10
    tokens = moved("shapeserve_generation_tokens_total")
    assert tokens == result["all"]["output_tokens"] == sum(r["expected_output_tokens"] for r in result["records"])
    vllm = {name: moved(name) for name in names}
    assert vllm == {
        "vllm:request_success_total": 10,
        "vllm:generation_tokens_total": tokens,
        "vllm:e2e_request_latency_seconds_count": 10,
    }
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "throughput_over_time.png").stat().st_size > 0


def test_every_series_the_grafana_dashboard_charts_is_in_the_scrape(server):
    # After the traffic of the tests above (LOCAL and REMOTE requests, so transfer counters exist too).
    from tests.unit.test_grafana_dashboard import dashboard_metrics

    scraped = {name for name, _ in settled_scrape(server.url)}
    charted = dashboard_metrics()
    assert charted and charted <= scraped, sorted(charted - scraped)


def test_n_and_several_prompts_on_the_engine(server, run_batch_tokens):
    """n=3 at temperature 0 gives three copies of the n=1 output; at temperature 1 they differ; with a seed the
    choices are reproducible; a list of prompts gives each prompt's own greedy output."""
    url = f"{server.url}/v1/completions"
    greedy = {**body(SHORT[0]), "n": 3}
    choices = httpx.post(url, json=greedy, timeout=120).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["token_ids"] == run_batch_tokens[0] for c in choices)
    sampled = {**body(SHORT[0]), "n": 3, "temperature": 1.0}
    texts = [tuple(c["token_ids"]) for c in httpx.post(url, json=sampled, timeout=120).json()["choices"]]
    assert len(set(texts)) > 1
    seeded = {**sampled, "seed": 11}
    first = [c["token_ids"] for c in httpx.post(url, json=seeded, timeout=120).json()["choices"]]
    again = [c["token_ids"] for c in httpx.post(url, json=seeded, timeout=120).json()["choices"]]
    assert first == again and len({tuple(t) for t in first}) > 1
    several = {**body([SHORT[1], LONG[1]]), "n": 1}
    resp = httpx.post(url, json=several, timeout=120)
    got = [c["token_ids"] for c in resp.json()["choices"]]
    assert got == [run_batch_tokens[1], run_batch_tokens[len(SHORT) + 1]]
    assert resp.json()["usage"]["prompt_tokens"] == len(SHORT[1]) + len(LONG[1])


def test_sampling_fields_over_http_equal_run_batch_local_and_remote(server, demo_model, tmp_path):
    """logit_bias, min_tokens, the penalties, min_p and top logprobs through the openai SDK give run-batch's
    tokens (and logprobs) on both routes (on REMOTE the prefill replica samples the first token, so it must apply
    them too), and each has its effect: banned tokens never appear; min_tokens holds back the stop id the request
    would otherwise stop on; the greedy token leads its position's alternatives."""
    import openai

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    # Prompts this module sends nowhere else: a prompt sent before would find its blocks cached and go LOCAL.
    prompts = [[7 + i, 19, 35, 82] for i in range(5)] + [
        [5 + (s * 37 + i * 11) % 500 for i in range(90)] for s in range(5)
    ]
    plain = [c["token_ids"] for c in run_batch(demo_model, tmp_path / "plain", [body(p) for p in prompts])]

    def extra(case: int, plain_tokens: list[int]) -> dict:
        return [
            {"logit_bias": {str(t): -100 for t in set(plain_tokens)}},
            {"stop_token_ids": [plain_tokens[0]], "ignore_eos": False, "min_tokens": 4},
            {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
            {"temperature": 1.0, "seed": 5, "min_p": 0.2},
            {"logprobs": 3},
        ][case]

    cases = [(p, extra(i % 5, plain[i])) for i, p in enumerate(prompts)]
    want = run_batch(demo_model, tmp_path / "with-params", [body(p, **e) for p, e in cases])
    for (prompt, e), plain_tokens, want_choice in zip(cases, plain, want, strict=True):
        fields = {**body(prompt, **e)}
        temperature, max_tokens = fields.pop("temperature"), fields.pop("max_tokens")
        del fields["model"], fields["prompt"]
        raw = api.completions.with_raw_response.create(
            model="demo", prompt=prompt, max_tokens=max_tokens, temperature=temperature, extra_body=fields
        )
        assert raw.headers["x-shapeserve-route"] == ("local" if len(prompt) <= 32 else "remote")
        choice = json.loads(raw.text)["choices"][0]
        got = choice["token_ids"]
        assert got == want_choice["token_ids"], e
        if "logit_bias" in e:
            assert not set(got) & set(plain_tokens)
        if "min_tokens" in e:  # without it the output would end at its first token
            assert len(got) > 4 and plain_tokens[0] not in got[:4]
        if "logprobs" in e:
            lp, offline = choice["logprobs"], want_choice["logprobs"]
            assert lp["tokens"] == offline["tokens"]
            assert lp["token_logprobs"] == pytest.approx(offline["token_logprobs"], abs=1e-4)
            for position, offline_position, token, token_lp in zip(
                lp["top_logprobs"], offline["top_logprobs"], lp["tokens"], lp["token_logprobs"], strict=True
            ):
                assert position.keys() == offline_position.keys() and 1 <= len(position) <= 3
                assert list(position.values()) == pytest.approx(list(offline_position.values()), abs=1e-4)
                assert max(position, key=position.get) == token and position[token] == pytest.approx(token_lp)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, demo_model):
    """How lm-eval scores a continuation: echo + logprobs + max_tokens 1. A prompt long enough to go REMOTE is
    prefilled on the decode replica (that is where its logits are), and every prompt token's logprob matches
    transformers' on the same weights."""
    import openai
    import torch
    import transformers

    prompt = [9 + (i * 53) % 500 for i in range(90)]  # sent nowhere else
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = api.completions.with_raw_response.create(
        model="demo", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    assert raw.headers["x-shapeserve-route"] == "local"
    lp = raw.parse().choices[0].logprobs
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(demo_model), torch_dtype=torch.float32)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    expected = [want[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-3)


def test_structured_output_through_the_sdk_on_both_routes(server):
    """response_format json_schema (chat and completions) validates on LOCAL and REMOTE prompts (REMOTE: the
    prefill replica's first token is constrained too, and the decode replica's matcher continues after it);
    guided_choice answers one of the choices; a bad schema is a 400 naming response_format; a named function and
    tool_choice "required" give calls whose arguments validate against the function's parameters."""
    import jsonschema
    import openai

    from bench.schemas import random_schema

    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(11)
    for i in range(4):
        schema = random_schema(rng)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        prompt = [11 + i, 21, 37, 84] if i % 2 == 0 else [6 + (i * 41 + j * 13) % 500 for j in range(90)]
        raw = api.completions.with_raw_response.create(
            model="demo", prompt=prompt, max_tokens=150, temperature=0, extra_body={"response_format": fmt}
        )
        assert raw.headers["x-shapeserve-route"] == ("local" if i % 2 == 0 else "remote")
        choice = raw.parse().choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), schema)
    chat = api.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=20,
        extra_body={"guided_choice": ["alpha", "beta gamma"]},
    )
    assert chat.choices[0].message.content in ("alpha", "beta gamma")
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frob"}}},
        )
    assert e.value.body["param"] == "response_format"
    # Forced tool calls on the engine: the arguments are grammar-constrained to the function's parameters.
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
    messages = [{"role": "user", "content": "weather?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        out = api.chat.completions.create(
            model="demo",
            messages=messages,
            tools=[weather],
            tool_choice=choice,
            parallel_tool_calls=False,  # "required" then allows one call: a random model would list calls forever
            max_tokens=100,
            temperature=0,
        )
        calls = out.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather", out
        jsonschema.validate(json.loads(calls[0].function.arguments), weather["function"]["parameters"])


def test_fuzzed_requests_get_no_5xx_and_leave_the_server_exact(server):
    # Hostile bodies on both endpoints (bench/fuzz_http.py runs more): every answer is an allowed status with an
    # OpenAI error body, streams end with [DONE], and afterwards the server is healthy and a fixed greedy probe
    # gives the same tokens as before.
    from hypothesis import HealthCheck, given, settings

    from bench.fuzz_http import check_exchange, probe, request_bodies

    statuses: dict[int, int] = {}
    with httpx.Client() as client:
        before = probe(client, server.url, "demo")

        @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(request_bodies("demo", 512))
        def fuzz(exchange):
            status = check_exchange(client, server.url, *exchange)
            statuses[status] = statuses.get(status, 0) + 1

        fuzz()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert probe(client, server.url, "demo") == before
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 50, statuses  # both kinds were exercised


def test_killed_decode_replica_gets_its_port_back(server, run_batch_tokens):
    # Kept last: it kills the replica that serves the port itself, with streams in flight. Their connections stay
    # in TIME_WAIT on the port when the replacement binds it; that used to make Serve block the port for good, so
    # the server never answered again (cluster/serving/direct_ingress.py). Now the replacement serves it.
    import asyncio
    import os
    import signal

    replicas = httpx.get(f"{server.url}/admin/pools", timeout=10).json()["replicas"]
    decode_pid = next(r["pid"] for r in replicas if r["pool"] == "decode")

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        long = body([5 + i, 17], max_tokens=300, stream=True)
        try:
            async with client.stream("POST", f"{server.url}/v1/completions", json=long) as resp:
                async for _ in resp.aiter_lines():
                    pass
        except httpx.HTTPError:
            pass  # cut by the kill

    async def kill_mid_stream() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            streams = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(1.0)
            os.kill(decode_pid, signal.SIGKILL)
            await asyncio.gather(*streams)

    asyncio.run(kill_mid_stream())
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        raise AssertionError("the decode replica never served its port again after a crash")
    recovered = httpx.post(f"{server.url}/v1/completions", json=body(SHORT[0]), timeout=120)
    assert recovered.json()["choices"][0]["token_ids"] == run_batch_tokens[0]
