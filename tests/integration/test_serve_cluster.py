"""The serving cluster end to end: a real Ray cluster with separate prefill and decode nodes,
real HTTP on 127.0.0.1, the tiny demo model. One cluster for the whole module.

Greedy outputs through HTTP equal the offline engine's for LOCAL and REMOTE routes; the
official openai client works; bad input gets OpenAI error bodies without disturbing a
running request; overload is a 429 with Retry-After; a killed prefill replica and a client
disconnect leave no KV block in use on either pool.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.helpers import disable_ray_token_auth, free_port

pytestmark = pytest.mark.slow

SHORT = ["Hello", "The quick brown fox", "Numbers: 1 2 3"]  # <= 32 tokens: LOCAL
LOCAL_MAX = 32


def long_prompt(seed: int, n: int = 80) -> list[int]:
    """A distinct token-id prompt longer than LOCAL_MAX (so it routes REMOTE)."""
    return [4 + (seed * 131 + i * 17) % 500 for i in range(n)]


LONG = [long_prompt(s) for s in (1, 2, 3)]


@pytest.fixture(scope="module")
def ray_cluster():
    """Three nodes on this machine: a head (Serve's controller and proxy, the pool board), one node that only
    prefill replicas fit on, one that only decode replicas fit on."""
    restore_auth = disable_ray_token_auth()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        # Ray's metrics pipeline carries /metrics's request families: a report a second, not Ray's 10 s.
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    cluster.add_node(num_cpus=1, resources={"prefill": 1})
    cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        restore_auth()


@pytest.fixture(scope="module")
def server(demo_model, ray_cluster):
    from ray import serve

    from cluster.app import APP_NAME, build_app
    from cluster.serving.config import parse_serve_config

    port = free_port()
    pool = {"num_cpus": 0, "num_gpus": 0, "num_blocks": 256, "num_threads": 1, "max_num_batched_tokens": 512}
    config = parse_serve_config(
        {
            "device": "cpu",
            "host": "127.0.0.1",
            "port": port,
            "kv_transfer_host": "127.0.0.1",
            # small prefill chunks: a long prompt takes many prefill steps (the kill test lands mid-prefill)
            "prefill": {**pool, "resources": {"prefill": 1}, "max_num_batched_tokens": 64},
            "decode": {**pool, "resources": {"decode": 1}},
            "classifier": {"local_max_uncached_tokens": LOCAL_MAX},
            # The faults here must cost latency only: admission by the SLO (tests/integration/test_overload.py)
            # would rightly refuse some of these long prompts while a pool is down.
            "admission": {"remote": {"max_inflight_requests": 6}, "admit_within_slo": False},
            "timeouts": {"prefill_timeout_s": 5.0, "max_prefill_attempts": 2, "request_timeout_s": 120.0},
        }
    )
    try:
        # One proxy, on the head: the nodes share this machine, so proxies on every node would share the port
        # (SO_REUSEPORT), and losing a node would drop the connections its proxy held, which is not what is tested.
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build_app(config, str(demo_model)), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(f"{url}/health").status_code == 200, 60, "pools healthy")
        yield url
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def offline(demo_model):
    """Greedy reference outputs from the offline engine on the same model."""
    from cluster.config import CacheConfig, EngineConfig, SamplingParams
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(demo_model), cache=CacheConfig(num_blocks=256)))

    def run(prompts: list, max_tokens: int) -> list[list[int]]:
        from cluster.prompting import encode_prompt

        ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [r["token_ids"] for r in engine.generate(ids, params)]

    run.tokenizer = engine.tokenizer
    return run


def _wait(cond, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < end:
        try:
            last = cond()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def pools(url: str) -> dict[str, list[dict]]:
    reps = httpx.get(f"{url}/admin/pools").json()["replicas"]
    return {p: [r for r in reps if r["pool"] == p] for p in ("prefill", "decode")}


def live_boards() -> list[dict]:
    """The live PoolBoard actors, from the GCS's actor table (ray.util.state would need the dashboard, which this
    cluster does not run)."""
    import ray

    actors = ray._private.state.actors().values()
    return [a for a in actors if a["ActorClassName"].endswith(":PoolBoard") and a["State"] == "ALIVE"]


def assert_no_blocks_in_use(url: str, timeout_s: float = 15.0):
    """Both pools settle at zero used KV blocks and zero live requests, with an intact block pool."""

    def idle():
        p = pools(url)
        reps = p["prefill"] + p["decode"]
        fresh = all(r["reported_at"] > started for r in reps)
        ok = (
            p["prefill"]
            and p["decode"]
            and fresh
            and all(r["kv_blocks_used"] == 0 and r["active_requests"] == 0 and r["integrity_ok"] for r in reps)
        )
        return ok and p

    started = time.time()
    return _wait(idle, timeout_s, "no KV blocks in use on either pool")


def complete(url: str, prompt, max_tokens: int, **extra) -> httpx.Response:
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


# ---- tests ------------------------------------------------------------------------------------


def test_greedy_parity_local_and_remote(server, offline):
    prompts = SHORT + LONG
    expected = offline(prompts, 12)

    async def send_all():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "demo", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            return await asyncio.gather(
                *(c.post(f"{server}/v1/completions", json={**body, "prompt": p}) for p in prompts)
            )

    responses = asyncio.run(send_all())
    for prompt, resp, want in zip(prompts, responses, expected, strict=False):
        assert resp.status_code == 200, resp.text
        route = "local" if isinstance(prompt, str) else "remote"
        assert resp.headers["x-shapeserve-route"] == route
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == want, f"{route} output differs from the offline engine"
        assert resp.json()["usage"]["completion_tokens"] == 12
    _wait(lambda: sum(r["transfers"] for r in pools(server)["decode"]) >= len(LONG), 10, "transfers reported")
    # transport "auto" on CPU: kv_transfer's gloo data plane (gRPC control plane, leases)
    _wait(lambda: pools(server)["prefill"][0]["last_transport"], 10, "prefill transfers reported")
    assert pools(server)["prefill"][0]["last_transport"] == "gloo"

    # The request families come through Ray's metrics pipeline from the decode node's agent (one report late).
    def request_families() -> str | None:
        text = httpx.get(f"{server}/metrics").text
        remote_ttft = 'shapeserve_time_to_first_token_seconds_count{route="remote"}' in text
        return text if remote_ttft and 'shapeserve_requests_total{outcome="ok",route="local"}' in text else None

    metrics = _wait(request_families, 15, "request families on /metrics")
    assert "shapeserve_pool_kv_blocks_used" in metrics and "shapeserve_kv_transfer_bytes_total" in metrics
    assert_no_blocks_in_use(server)


def test_openai_client_completions_and_chat(server, offline):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["demo"]
    n_prompt = len(offline.tokenizer("Hello there").input_ids)

    r = client.completions.create(
        model="demo", prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)
    assert r.choices[0].finish_reason == "length"

    chunks = list(
        client.completions.create(
            model="demo",
            prompt="Hello there",
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == n_prompt

    messages = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    chat_ids = offline.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n_chat = len(offline.tokenizer(chat_ids, add_special_tokens=False).input_ids)
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (n_chat, 4)
    assert c.choices[0].message.role == "assistant"
    stream = list(
        client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(s.choices[0].delta.content or "" for s in stream if s.choices) == c.choices[0].message.content
    assert stream[-1].usage.completion_tokens == 4

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_bad_input_errors_leave_running_request_alone(server, offline):
    want = offline([LONG[0]], 60)[0]
    result = {}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {
                "model": "demo",
                "prompt": LONG[0],
                "max_tokens": 60,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
            }
            async with c.stream("POST", f"{server}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                ids, bad_done = [], False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    if not bad_done:  # mid-stream: a burst of bad requests
                        bad_done = True
                        result["bad"] = await asyncio.gather(
                            c.post(
                                f"{server}/v1/completions",
                                content=b"{nope",
                                headers={"content-type": "application/json"},
                            ),
                            c.post(f"{server}/v1/completions", json={"model": "demo"}),
                            c.post(
                                f"{server}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 2000}
                            ),
                            c.post(f"{server}/v1/completions", json={"model": "gpt-x", "prompt": "x"}),
                            c.post(f"{server}/v1/completions", json={"model": "demo", "prompt": "x", "top_p": 7}),
                        )
                result["ids"] = ids

    asyncio.run(main())
    statuses = [r.status_code for r in result["bad"]]
    assert statuses == [400, 400, 400, 404, 400]
    for r in result["bad"]:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert [r.json()["error"]["param"] for r in result["bad"]] == [None, "prompt", "max_tokens", "model", "top_p"]
    assert result["ids"] == want


def test_overload_is_429_with_retry_after(server):
    # remote budget is 6 in-flight requests per router: 10 at once must see some 429s.
    async def burst():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "demo", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(
                *(c.post(f"{server}/v1/completions", json={**body, "prompt": long_prompt(100 + i)}) for i in range(10))
            )

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 6 and 429 in codes, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert_no_blocks_in_use(server)


def test_client_disconnect_frees_blocks_on_both_pools(server):
    body = {
        "model": "demo",
        "prompt": long_prompt(7, 200),
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server}/v1/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["x-shapeserve-route"] == "remote"
        lines = resp.iter_lines()
        for _ in range(10):
            next(lines)
        _wait(lambda: any(r["kv_blocks_used"] > 0 for r in pools(server)["decode"]), 10, "decode blocks in use")
        # leaving the block closes the connection mid-stream
    p = assert_no_blocks_in_use(server)
    assert all(r["running"] == 0 and r["waiting"] == 0 for r in p["decode"])


def test_killed_prefill_replica_every_request_completes(server, offline):
    prompts = [long_prompt(200 + i, 900) for i in range(3)] + [long_prompt(203)]
    expected = offline(prompts, 30)
    prefill_pid = pools(server)["prefill"][0]["pid"]

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "demo", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            tasks = [
                asyncio.create_task(c.post(f"{server}/v1/completions", json={**body, "prompt": p})) for p in prompts[:3]
            ]
            await asyncio.sleep(0.1)  # 3 x 900 prompt tokens at 64 per prefill step: still prefilling
            os.kill(prefill_pid, signal.SIGKILL)
            tasks += [
                asyncio.create_task(c.post(f"{server}/v1/completions", json={**body, "prompt": p})) for p in prompts[3:]
            ]
            return await asyncio.gather(*tasks)

    responses = asyncio.run(main())
    for resp, want in zip(responses, expected, strict=False):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == want
    # Serve restarts the replica; afterwards nothing is held anywhere.
    _wait(lambda: httpx.get(f"{server}/health").status_code == 200, 60, "prefill pool back")
    _wait(lambda: any(r["pid"] != prefill_pid for r in pools(server)["prefill"]), 60, "new prefill replica")
    p = assert_no_blocks_in_use(server, timeout_s=20)
    decode = p["decode"][0]
    assert decode["transfer_failures"] >= 1  # prefills in flight on the killed replica failed...
    assert decode["local_fallbacks"] + decode["prefill_retries"] >= 1  # ...and were retried or prefilled locally


def post_all(url: str, prompts: list, max_tokens: int, fault, after_s: float) -> list[httpx.Response]:
    """The prompts sent at once, ``fault()`` called ``after_s`` later while they are in flight; their answers."""

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            tasks = [
                asyncio.create_task(
                    c.post(f"{url}/v1/completions", json={**body, "prompt": p, "return_token_ids": True})
                )
                for p in prompts
            ]
            await asyncio.sleep(after_s)
            await asyncio.to_thread(fault)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_prefill_replica_stopped_mid_request_costs_latency_only(server, offline):
    """SIGSTOP freezes the prefill replica (a hung process: nothing crashes, so Ray reports nothing) while REMOTE
    prompts are in its engine or in the push of their KV: the decode side's deadline passes, each request is
    prefilled locally and completes exactly. Once the replica runs again its leases have ended, it releases what
    it held, and no block is in use on either pool."""
    prompts = [long_prompt(300 + i, 900) for i in range(3)]
    expected = offline(prompts, 20)
    prefill_pid = pools(server)["prefill"][0]["pid"]
    before = pools(server)["decode"][0]
    t0 = time.monotonic()
    try:
        responses = post_all(server, prompts, 20, lambda: os.kill(prefill_pid, signal.SIGSTOP), 0.05)
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    took = time.monotonic() - t0
    for resp, want in zip(responses, expected, strict=True):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == want
    assert took < 60  # two 5 s deadlines and a local prefill, not a hang
    _wait(lambda: httpx.get(f"{server}/health").status_code == 200, 60, "prefill pool healthy again")
    p = assert_no_blocks_in_use(server, timeout_s=30)
    decode = p["decode"][0]
    assert decode["transfer_failures"] > before["transfer_failures"]
    assert decode["local_fallbacks"] > before["local_fallbacks"]
    print(f"prefill replica stopped mid-request: 3 requests complete in {took:.1f} s")


def test_lost_prefill_node_requests_complete_and_a_new_node_takes_the_pool(server, offline, ray_cluster):
    """The whole prefill node goes (its raylet and every process on it killed): REMOTE requests in flight there
    complete through a local prefill; when a node that can host the pool joins, Serve starts the prefill replica
    there and REMOTE requests go to it again, within a bound."""
    node = next(n for n in ray_cluster.list_all_nodes() if "prefill" in (n._ray_params.resources or {}))
    # The pool board lives on the head node (cluster.app.BOARD_ACTOR_OPTIONS), never on a worker node that can go.
    assert [b["Address"]["NodeID"] for b in live_boards()] == [ray_cluster.head_node.node_id]
    prompts = [long_prompt(400 + i, 900) for i in range(3)]
    expected = offline(prompts, 20)
    before = pools(server)["decode"][0]
    prefill_pid = pools(server)["prefill"][0]["pid"]

    def lose_the_node() -> None:
        # Frozen first, so the prompts are still in its hands when the node goes, however fast it prefills (a
        # faster prefill replica once finished all three before the removal, which takes a few hundred ms: the node's
        # processes are killed one by one, the frozen replica among them).
        os.kill(prefill_pid, signal.SIGSTOP)
        ray_cluster.remove_node(node, allow_graceful=False)

    t0 = time.monotonic()
    responses = post_all(server, prompts, 20, lose_the_node, 0.0)
    for resp, want in zip(responses, expected, strict=True):
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == want
    in_flight_s = time.monotonic() - t0

    # (The counters come with the decode replica's next report. The pool board may have lived on the removed node:
    # then Serve starts it elsewhere, ~10 s here, and it lists no decode replica until that one reports again.)
    def fell_back() -> bool:
        decode = pools(server)["decode"]
        return bool(decode) and decode[0]["local_fallbacks"] > before["local_fallbacks"]

    _wait(fell_back, 60, "local prefills")

    t1 = time.monotonic()
    ray_cluster.add_node(num_cpus=1, resources={"prefill": 1})
    _wait(lambda: httpx.get(f"{server}/health").status_code == 200, 120, "a prefill replica on the new node")
    want = offline([long_prompt(410)], 8)[0]

    def served_remote():
        resp = complete(server, long_prompt(410), 8)
        return resp.status_code == 200 and resp.headers["x-shapeserve-route"] == "remote" and resp

    resp = _wait(served_remote, 60, "a REMOTE request served by the new prefill replica")
    assert resp.json()["choices"][0]["token_ids"] == want
    back_s = time.monotonic() - t1
    assert back_s < 150
    assert_no_blocks_in_use(server, timeout_s=30)
    print(
        f"prefill node lost: in-flight requests done in {in_flight_s:.1f} s; "
        f"REMOTE again {back_s:.1f} s after a node joined"
    )


def test_hostile_numbers_are_400s_and_the_engine_keeps_streaming(server, offline):
    """A top_k or seed past 64 bits used to overflow the engine's batch tensors and kill the decode loop
    for every user; now it is a 400 naming the field, and a sampled stream running beside it finishes."""
    sampled = {"model": "demo", "prompt": "Hello", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "seed": 5}
    result = {}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            body = {**sampled, "stream": True, "ignore_eos": True, "return_token_ids": True}
            async with c.stream("POST", f"{server}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                ids, fired = [], False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    if not fired:
                        fired = True
                        result["bad"] = await asyncio.gather(
                            c.post(f"{server}/v1/completions", json={**sampled, "top_k": 2**64}),
                            c.post(f"{server}/v1/completions", json={**sampled, "seed": 2**64}),
                            c.post(f"{server}/v1/completions", json={**sampled, "max_tokens": 2**64}),
                            c.post(f"{server}/v1/completions", json={**sampled, "top_k": 2**31 - 1, "max_tokens": 3}),
                        )
                result["ids"] = ids

    asyncio.run(main())
    assert [r.status_code for r in result["bad"]] == [400, 400, 400, 200]
    assert [r.json()["error"]["param"] for r in result["bad"][:3]] == ["top_k", "seed", "max_tokens"]
    assert len(result["ids"]) == 40
    assert complete(server, "Hello", 8).json()["choices"][0]["token_ids"] == offline(["Hello"], 8)[0]


def test_oversized_and_malformed_bodies_are_refused_before_parsing(server, offline):
    big = json.dumps({"model": "demo", "prompt": "x" * (5 << 20), "max_tokens": 1}).encode()
    headers = {"content-type": "application/json"}
    declared = httpx.post(f"{server}/v1/completions", content=big, headers=headers, timeout=60)
    # Without Content-Length (chunked), the router stops reading at the limit.
    chunked = httpx.post(
        f"{server}/v1/completions", content=(big[i : i + 65536] for i in range(0, len(big), 65536)), headers=headers
    )
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "4194304 bytes" in r.json()["error"]["message"]

    too_long = httpx.post(f"{server}/v1/completions", json={"model": "demo", "prompt": "ab " * 1_000_000}, timeout=60)
    assert too_long.status_code == 400 and "characters" in too_long.json()["error"]["message"]

    nested = b'{"model": "demo", "prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    surrogate_prompt = b'{"model": "demo", "prompt": "hi \\ud800", "max_tokens": 2}'
    surrogate_chat = b'{"model": "demo", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    for path, raw, param in [
        ("completions", nested, None),
        ("completions", surrogate_prompt, "prompt"),
        ("chat/completions", surrogate_chat, "messages"),
    ]:
        r = httpx.post(f"{server}/v1/{path}", content=raw, headers=headers, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200
    assert complete(server, "Hello", 8).json()["choices"][0]["token_ids"] == offline(["Hello"], 8)[0]


def test_killed_pool_board_every_replica_reports_again(server):
    """The pool board's process killed (Serve starts another): /health keeps answering meanwhile, and every
    replica's stats are back on /admin/pools within a bound. (A killed process fails the calls in flight to it at
    once; a call that never returns, as one to a node that went silent can, is tests/unit/test_board_outage.py's.)"""

    def board_pid() -> int | None:
        boards = live_boards()
        return boards[0]["Pid"] if boards else None

    pid = board_pid()
    assert pid
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    t0 = time.monotonic()
    assert httpx.get(f"{server}/health", timeout=30).status_code in (200, 503)  # an answer, not a hang
    assert time.monotonic() - t0 < 10

    def reported_again():
        p = pools(server)
        reps = p["prefill"] + p["decode"]
        return p["prefill"] and p["decode"] and all(r["reported_at"] > killed_at for r in reps) and p

    _wait(reported_again, 60, "every replica's report on the restarted board")
    assert board_pid() not in (None, pid)
    _wait(lambda: httpx.get(f"{server}/health").status_code == 200, 30, "healthy with the new board")
    print(f"pool board killed: every replica reported again after {time.monotonic() - t0:.1f} s")


def test_killed_decode_replica_ends_its_streams_cleanly_and_the_pool_recovers(server, offline):
    """Kept last: it kills the module's decode replica. A stream that already sent tokens ends promptly (an error
    event or a closed stream, never a hang), what it sent is a prefix of the right output, and once Serve has
    restarted the replica new requests succeed and no block is held anywhere."""
    want = offline(["Hello"], 200)[0]
    decode_pid = pools(server)["decode"][0]["pid"]
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    got: list[int] = []
    events: list[str] = []
    t_kill = None
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True, "return_token_ids": True}, timeout=60
    ) as resp:
        assert resp.status_code == 200
        try:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if line == "data: [DONE]":
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    break
                got += data["choices"][0].get("token_ids") or []
                if got and t_kill is None:
                    os.kill(decode_pid, signal.SIGKILL)
                    t_kill = time.monotonic()
        except httpx.HTTPError:
            pass  # the proxy closed the stream: also a clean end for the client
    assert t_kill is not None and time.monotonic() - t_kill < 30  # ended promptly, no hang
    assert got and got == want[: len(got)] and len(got) < len(want)  # a prefix, never corrupt text
    assert events[-1] != "data: [DONE]"  # not passed off as a complete answer
    t0 = time.monotonic()
    _wait(lambda: httpx.get(f"{server}/health").status_code == 200, 120, "decode pool back")
    _wait(lambda: any(r["pid"] != decode_pid for r in pools(server)["decode"]), 60, "new decode replica")
    assert complete(server, "Hello", 8).json()["choices"][0]["token_ids"] == want[:8]
    recovered_s = time.monotonic() - t0
    assert recovered_s < 120
    assert_no_blocks_in_use(server, timeout_s=20)
    print(
        f"decode replica killed after {len(got)} tokens; last event {events[-1][:120]!r}; "
        f"serving again after {recovered_s:.1f} s"
    )
