"""Request tracing and request ids, through the HTTP edge in front of a real decode worker and a real prefill
worker (one process; the prefill task crosses a pickle boundary, as Ray sends it, so the only link between
the two sides' spans is the context the message carries)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import re
from types import SimpleNamespace

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from ray.serve._private.logging_utils import ServeContextFilter

from cluster.serving import tracing
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import GenerateTask
from router.server import OpenAIServer
from tests.unit.test_remote_prefill import PROMPT, FakePrefillHandle, FakeResponse, assert_idle, make_pair


class AcrossProcesses(FakePrefillHandle):
    """The prefill call as Ray makes it: the task pickled and unpickled on the way."""

    def __init__(self, worker):
        super().__init__(worker)
        self.prefill = SimpleNamespace(remote=lambda task: FakeResponse(self._call(pickle.loads(pickle.dumps(task)))))


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)


async def _served(demo_model, requests):
    """Runs ``requests(client)`` against an edge over a decode worker with a prefill pool; returns its result."""
    prefill, decode, _ = await make_pair(demo_model, "grpc")
    decode.prefill = AcrossProcesses(prefill)
    config = decode.config.model_copy(update={"served_model_name": "m"})
    server = OpenAIServer(config, str(demo_model), decode, board=None, disaggregated=True)
    transport = httpx.ASGITransport(app=server.asgi_app())
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            result = await requests(client)
        await assert_idle(prefill, decode)
        return result
    finally:
        decode.shutdown()
        prefill.shutdown()


def _post(client, prompt, request_id=None, **extra):
    headers = {"x-request-id": request_id} if request_id else {}
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body, headers=headers)


def test_remote_request_is_one_trace_across_the_pools(demo_model, spans):
    async def requests(client):
        return await _post(client, PROMPT, "trace-me-1")

    r = asyncio.run(_served(demo_model, requests))
    assert r.status_code == 200 and r.headers["x-shapeserve-route"] == "remote"
    assert r.json()["id"] == "cmpl-trace-me-1"
    finished = spans.get_finished_spans()
    assert len({s.context.trace_id for s in finished}) == 1  # one trace
    by_id = {s.context.span_id: s for s in finished}
    root = next(s for s in finished if s.parent is None)
    assert root.name == "shapeserve.request /v1/completions"
    assert root.attributes["shapeserve.request_id"] == "cmpl-trace-me-1"
    assert root.attributes["shapeserve.route"] == "remote" and root.attributes["shapeserve.output_tokens"] == 4

    def children(parent, name=None):
        return [s for s in finished if s.parent is not None and s.parent.span_id == parent.context.span_id]

    under_root = sorted(children(root), key=lambda s: s.start_time)
    assert [s.name for s in under_root] == [
        "shapeserve.admission",
        "shapeserve.queue",
        "shapeserve.remote_prefill",
        "shapeserve.decode",
    ]
    admission, waited, remote, decode = under_root
    assert waited.attributes["shapeserve.waited_for"] == "kv_blocks"
    assert decode.attributes["shapeserve.output_tokens"] == 4 and decode.attributes["shapeserve.finish_reason"]
    # The prefill replica's spans hang under the decode side's attempt, linked only through the PrefillTask.
    on_prefill = sorted(children(remote), key=lambda s: s.start_time)
    assert [s.name for s in on_prefill] == ["shapeserve.queue", "shapeserve.prefill", "shapeserve.kv_transfer"]
    assert on_prefill[1].attributes["shapeserve.prompt_tokens"] == len(PROMPT)
    assert on_prefill[2].attributes["shapeserve.kv_transport"] == "grpc"
    assert on_prefill[2].attributes["shapeserve.kv_bytes"] > 0
    # Spans nest in time: each inside its parent, and the request's stages in order.
    for s in finished:
        if s.parent is not None:
            parent = by_id[s.parent.span_id]
            assert parent.start_time <= s.start_time and s.end_time <= parent.end_time, (s.name, parent.name)
    assert admission.end_time <= remote.start_time and on_prefill[2].end_time <= decode.start_time
    assert all(s.status.is_ok for s in finished)


def test_local_request_spans_its_queue_prefill_and_decode(demo_model, spans):
    async def requests(client):
        return await _post(client, PROMPT[:8])

    r = asyncio.run(_served(demo_model, requests))
    assert r.headers["x-shapeserve-route"] == "local"
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.parent is None)
    names = sorted((s.name for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id))
    assert names == ["shapeserve.admission", "shapeserve.decode", "shapeserve.prefill", "shapeserve.queue"]
    queue = next(s for s in finished if s.name == "shapeserve.queue")
    prefill = next(s for s in finished if s.name == "shapeserve.prefill")
    assert queue.attributes["shapeserve.waited_for"] == "engine_step" and queue.end_time == prefill.start_time
    # the request id is a new one when the client sends none (or an unusable one)
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", r.json()["id"])


def test_refused_and_unsampled_requests(demo_model, spans):
    async def requests(client):
        bad = await _post(client, PROMPT, "too many", max_tokens=10**6)  # 400 at planning; an unusable id
        return bad

    r = asyncio.run(_served(demo_model, requests))
    assert r.status_code == 400
    (root,) = [s for s in spans.get_finished_spans() if s.parent is None]
    assert not root.status.is_ok and "400" in root.status.description
    # Not sampled at the edge: no process records anything, and no context travels.
    spans.clear()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.use_provider(provider)
    assert asyncio.run(_served(demo_model, lambda c: _post(c, PROMPT))).status_code == 200
    assert spans.get_finished_spans() == ()


def test_tracing_off_sends_no_context(demo_model):
    tasks: list[GenerateTask] = []

    async def requests(client):
        return await _post(client, PROMPT)

    async def main():
        prefill, decode, _ = await make_pair(demo_model, "grpc")
        generate = decode.generate
        decode.generate = lambda task: (tasks.append(task), generate(task))[1]
        config = decode.config.model_copy(update={"served_model_name": "m"})
        server = OpenAIServer(config, str(demo_model), decode, board=None, disaggregated=True)
        try:
            transport = httpx.ASGITransport(app=server.asgi_app())
            async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
                return await requests(client)
        finally:
            decode.shutdown()
            prefill.shutdown()

    assert not tracing.enabled()
    assert asyncio.run(main()).status_code == 200
    assert tasks and tasks[0].trace_context == ()


def test_request_id_is_in_the_log_lines_of_the_request(demo_model):
    """Serve's own log filter (the one its replicas' log handlers run) finds the request's id."""

    class Failing:
        replica_id = "r"

        def generate(self, task):
            async def stream():
                raise RuntimeError("engine gone")
                yield  # pragma: no cover

            return stream()

        def check_health(self):
            pass

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.addFilter(ServeContextFilter())
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)

    async def main():
        config = parse_serve_config({"device": "cpu", "served_model_name": "m"})
        server = OpenAIServer(config, str(demo_model), Failing(), disaggregated=False)
        transport = httpx.ASGITransport(app=server.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await _post(client, "hello", "find-me-7")

    try:
        r = asyncio.run(main())
    finally:
        logger.removeHandler(handler)
    assert r.status_code == 503
    failed = [rec for rec in records if "decode worker failed" in rec.getMessage()]
    assert failed and all(getattr(rec, "request_id", None) == "find-me-7" for rec in failed)


def test_several_choices_share_one_trace_that_ends_with_the_last(demo_model, spans):
    async def requests(client):
        return await _post(client, PROMPT[:8], "two-of-them", n=2, temperature=1.0, seed=3)

    r = asyncio.run(_served(demo_model, requests))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finished = spans.get_finished_spans()
    (root,) = [s for s in finished if s.parent is None]
    under_root = [s.name for s in finished if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert sorted(under_root) == sorted(
        ["shapeserve.admission"] + ["shapeserve.queue", "shapeserve.prefill", "shapeserve.decode"] * 2
    )
    assert root.end_time >= max(s.end_time for s in finished if s.name == "shapeserve.decode")
    assert root.attributes["shapeserve.output_tokens"] == 8 and root.status.is_ok  # both choices' tokens
