"""Bad input found by fuzzing a live server, through the HTTP edge in process (as test_openai_endpoints.py): each gets
an OpenAI error body naming what to change, and valid input next to it is still served."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncGenerator, Coroutine
from typing import Any

import httpx
import pytest
from ray.serve import context as serve_context
from ray.serve._private.http_util import _apply_middlewares

from cluster.config import INT64_MAX, INT64_MIN
from cluster.engine.llm_engine import RequestOutput
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import GenerateTask, Started
from router.request_ids import serve_http_middlewares
from router.server import OpenAIServer
from tests.unit.test_openai_endpoints import EchoWorker, edge

CHAT = [{"role": "user", "content": "hi"}]


class CheckingWorker(EchoWorker):
    """EchoWorker that checks each task's params as the engine does (a bad one fails the request with the engine's
    400) and keeps every task with the Serve request id its log lines would carry."""

    def __init__(self):
        self.tasks: list[GenerateTask] = []
        self.log_ids: list[str] = []

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        task.params.validate()
        self.tasks.append(task)
        self.log_ids.append(serve_context._get_serve_request_context().request_id)
        async for item in super().generate(task):
            yield item


def post(client: httpx.AsyncClient, path: str, body: dict, **kw) -> Coroutine[Any, Any, httpx.Response]:
    # json.dumps, not httpx's json=: it writes 1e308 as JSON writes it
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return client.post(path, content=json.dumps(body), headers=headers, **kw)


def assert_refused(r: httpx.Response, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize(
    "seed, n, expected",
    [
        (-5, 2, [-5, -4]),
        (INT64_MAX, 2, [INT64_MAX, INT64_MIN]),  # wraps within the signed range the engine takes
        (INT64_MIN, 3, [INT64_MIN, INT64_MIN + 1, INT64_MIN + 2]),
    ],
)
def test_any_valid_seed_with_n_choices_is_served(demo_model, seed, n, expected):
    async def run():
        worker = CheckingWorker()
        async with edge(demo_model, worker, served_model_name="m") as client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 1, "n": n, "seed": seed}
            r = await post(client, "/v1/completions", body)
            assert r.status_code == 200, r.text
            # Choice 0 samples with the client's seed (the choice an n=1 request with that seed gets): expected[0].
            assert sorted(t.params.seed for t in worker.tasks) == sorted(expected)

    asyncio.run(run())


def served_as_serve_does(app):
    """The app as Serve runs it: Serve's request context set from the request's x-request-id header (as its
    replica does), inside Serve's RequestIdMiddleware (which echoes the header), inside the middlewares of our
    HTTP callback (``router.request_ids.serve_http_middlewares``)."""

    async def replica(scope, receive, send):
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        serve_context._serve_request_context.set(serve_context._RequestContext(request_id=given))
        await app(scope, receive, send)

    return _apply_middlewares(replica, serve_http_middlewares())


@pytest.mark.parametrize("given", ['a b"<x>{}', "x" * 5000, "../../etc/passwd"])
def test_an_unusable_request_id_is_replaced_everywhere(demo_model, given):
    async def run():
        worker = CheckingWorker()
        server = OpenAIServer(
            parse_serve_config({"device": "cpu", "served_model_name": "m"}),
            str(demo_model),
            worker,
            disaggregated=False,
        )
        transport = httpx.ASGITransport(app=served_as_serve_does(server.asgi_app()))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 1}
            r = await post(client, "/v1/completions", body, headers={"x-request-id": given})
            assert r.status_code == 200
            (header,) = r.headers.get_list("x-request-id")  # one header: Serve's, carrying the replacement
            assert re.fullmatch(r"[0-9a-f]{24}", header), header
            assert r.json()["id"] == f"cmpl-{header}" and worker.log_ids == [header]
            # A usable id is kept everywhere.
            r = await post(client, "/v1/completions", body, headers={"x-request-id": "mine-1.2:3"})
            assert r.headers.get_list("x-request-id") == ["mine-1.2:3"] and r.json()["id"] == "cmpl-mine-1.2:3"
            assert worker.log_ids[-1] == "mine-1.2:3"

    asyncio.run(run())


@pytest.mark.parametrize("text, got", [(None, "null"), ({"a": 1}, "an object"), (5, "a number")])
def test_chat_text_parts_must_be_strings(demo_model, text, got):
    async def run():
        async with edge(demo_model, CheckingWorker(), served_model_name="m") as client:
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": text}]},
            ]
            for path, body in (
                ("/v1/chat/completions", {"model": "m", "messages": messages, "max_tokens": 1}),
                ("/tokenize", {"messages": messages}),
            ):
                r = await post(client, path, body)
                assert_refused(r, "messages", f"messages[1].content[1].text must be a string, got {got}")

    asyncio.run(run())


@pytest.mark.parametrize(
    "path, fields, param, message",
    [
        ("/v1/chat/completions", {"response_format": {}}, "response_format", "'response_format.type'"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages", "'messages[0].role'"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools", "'tools[0].function'"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "missing required field 'response_format.json_schema.schema'",
        ),
        ("/v1/completions", {"max_tokens": 1e308}, "max_tokens", "'max_tokens': must be an integer"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must"),
        # the output budget past the context, sent as max_completion_tokens
        ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens", "max_completion_tokens is"),
    ],
)
def test_errors_name_the_field_the_client_sent(demo_model, path, fields, param, message):
    async def run():
        async with edge(demo_model, CheckingWorker(), served_model_name="m") as client:
            base = {"model": "m", "max_tokens": 1}
            base |= {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "hi"}
            r = await post(client, path, base | fields)
            assert_refused(r, param, message)
            assert "max_tokens" not in r.json()["error"]["message"] or param == "max_tokens"

    asyncio.run(run())


def test_a_client_gone_while_sending_its_body_is_no_server_error(demo_model):
    """Content-Length 100, 10 bytes sent, then the connection closes: a 499 (as Serve answers a client that
    disconnects), no error logged."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.serve")
    logger.addHandler(handler)

    async def run():
        cfg = parse_serve_config({"device": "cpu", "served_model_name": "m"})
        app = OpenAIServer(cfg, str(demo_model), CheckingWorker(), disaggregated=False).asgi_app()
        incoming = [
            {"type": "http.request", "body": b'{"model":"', "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent: list[dict] = []

        async def receive():
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
            "client": ("127.0.0.1", 1234),
            "server": ("edge", 80),
        }
        await app(scope, receive, send)
        return sent

    try:
        sent = asyncio.run(run())
    finally:
        logger.removeHandler(handler)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert not [r for r in records if r.levelno >= logging.WARNING or "unhandled" in r.getMessage()]


@pytest.mark.parametrize(
    "path, fields, param, message",
    [
        ("/v1/completions", {"max_tokens": True}, "max_tokens", "must be an integer, not a boolean (true)"),
        ("/v1/completions", {"n": True}, "n", "must be an integer, not a boolean"),
        ("/v1/completions", {"prompt": [True, False]}, "prompt", "token ids must be integers, not booleans"),
        ("/v1/completions", {"prompt": [[5, 6], [True]]}, "prompt", "token ids must be integers, not booleans"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt", "token ids must be integers, got 1.0"),
        (
            "/v1/completions",
            {"stop_token_ids": [True]},
            "stop_token_ids",
            "'stop_token_ids[0]': Input should be a valid",
        ),
        ("/v1/chat/completions", {"max_completion_tokens": False}, "max_completion_tokens", "not a boolean (false)"),
        ("/detokenize", {"tokens": [True]}, "tokens", "'tokens[0]': Input should be a valid integer"),
        # As OpenAI: options of a stream that is not asked for
        ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        (
            "/v1/chat/completions",
            {"stream": False, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream is true",
        ),
    ],
)
def test_booleans_are_not_integers_and_stream_options_need_a_stream(demo_model, path, fields, param, message):
    async def run():
        async with edge(demo_model, CheckingWorker(), served_model_name="m") as client:
            base: dict = {"model": "m"}
            if path == "/v1/completions":
                base |= {"prompt": "hi", "max_tokens": 1}
            elif path == "/v1/chat/completions":
                base |= {"messages": CHAT, "max_tokens": 1}
            assert_refused(await post(client, path, base | fields), param, message)

    asyncio.run(run())


def test_whole_number_floats_are_still_taken_where_openai_takes_them(demo_model):
    async def run():
        worker = CheckingWorker()
        async with edge(demo_model, worker, served_model_name="m") as client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2.0, "n": 1.0, "seed": 7.0}
            assert (await post(client, "/v1/completions", body)).status_code == 200
            assert (worker.tasks[-1].params.max_tokens, worker.tasks[-1].params.seed) == (2, 7)

    asyncio.run(run())


@pytest.mark.parametrize(
    "path, ids, message",
    [
        ("/v1/completions", [1, 2, 3, 512], "stop_token_ids[3] is 512, outside the vocabulary [0, 512)"),  # was served
        ("/v1/completions", [1, 2, 3, -1], "stop_token_ids[3] is -1, outside"),
        ("/v1/chat/completions", [7, 10**30], f"stop_token_ids[1] is {10**30}, outside"),
    ],
)
def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_the_index(demo_model, path, ids, message):
    async def run():
        worker = CheckingWorker()
        async with edge(demo_model, worker, served_model_name="m") as client:
            base = {"model": "m", "max_tokens": 1}
            base |= {"messages": CHAT} if path == "/v1/chat/completions" else {"prompt": "hi"}
            assert_refused(await post(client, path, base | {"stop_token_ids": ids}), "stop_token_ids", message)
            # The vocabulary's first and last ids are served.
            assert (await post(client, path, base | {"stop_token_ids": [0, 511]})).status_code == 200
            assert [t.params.stop_token_ids for t in worker.tasks] == [(0, 511)]

    asyncio.run(run())


@pytest.mark.parametrize(
    "bias, message",
    [
        # int() read these as token ids
        ({" 12": 1}, "decimal digits only (use /tokenize to find them), got ' 12'"),
        ({"+12": 1}, "got '+12'"),
        ({"1_2": 1}, "got '1_2'"),
        ({"12\n": 1}, "got '12\\n'"),
        ({"\u0661\u0662": 1}, "decimal digits only"),  # Arabic-Indic digits
        ({"12": 1, "012": 2}, "names token 12 twice ('12' and '012'); give each token once"),  # the engine adds both
        # refused already ("must be token ids, got -1"), now saying how a key is written
        ({"-1": 1}, "decimal digits only (use /tokenize to find them), got '-1'"),
    ],
)
def test_logit_bias_keys_are_decimal_token_ids(demo_model, bias, message):
    async def run():
        worker = CheckingWorker()
        async with edge(demo_model, worker, served_model_name="m") as client:
            base = {"model": "m", "prompt": "hi", "max_tokens": 1}
            assert_refused(await post(client, "/v1/completions", base | {"logit_bias": bias}), "logit_bias", message)
            # Refused before this test, as they still are.
            for key in ("1e2", "0x10", "12.0"):
                r = await post(client, "/v1/completions", base | {"logit_bias": {key: 1}})
                assert_refused(r, "logit_bias", f"got {key!r}")
            r = await post(client, "/v1/completions", base | {"logit_bias": {"512": 1}})
            assert_refused(r, "logit_bias", "outside the vocabulary [0, 512)")
            # Token ids as decimal digits are served, leading zeros included.
            r = await post(client, "/v1/completions", base | {"logit_bias": {"0": 1, "511": -1, "007": 5}})
            assert r.status_code == 200, r.text
            assert [t.params.logit_bias for t in worker.tasks] == [((0, 1.0), (511, -1.0), (7, 5.0))]

    asyncio.run(run())


@pytest.mark.parametrize("priority", [10**30, -(10**30), INT64_MAX + 1, INT64_MIN - 1])
def test_priority_is_a_signed_64_bit_integer(demo_model, priority):
    """``priority`` took any integer; msgpack and protobuf, which would carry it past the edge, take 64 bits."""

    async def run():
        async with edge(demo_model, CheckingWorker(), served_model_name="m") as client:
            for path, base in (
                ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}),
                ("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 1}),
            ):
                r = await post(client, path, base | {"priority": priority})
                assert_refused(r, "priority", f"priority must be an integer from {INT64_MIN} to {INT64_MAX}")
                for within in (INT64_MIN, -1, 0, 1, INT64_MAX):
                    assert (await post(client, path, base | {"priority": within})).status_code == 200

    asyncio.run(run())


def test_every_route_is_served_with_a_trailing_slash(demo_model):
    """``POST /v1/completions/`` was a 307 to ``/v1/completions`` (a client that does not follow it got no answer;
    one behind a TLS-terminating proxy was sent to ``http://``)."""
    requests: list[tuple[str, str, dict | None]] = [
        ("POST", "/v1/completions/", {"model": "m", "prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/chat/completions/", {"model": "m", "messages": CHAT, "max_tokens": 1}),
        ("GET", "/v1/models/", None),  # the list, not the card of a model named ''
        ("GET", "/v1/models/m/", None),
        ("POST", "/tokenize/", {"prompt": "hi"}),
        ("GET", "/health/", None),
    ]

    async def run():
        worker = CheckingWorker()
        cfg = parse_serve_config({"device": "cpu", "served_model_name": "m", "api_key": "k"})
        app = OpenAIServer(cfg, str(demo_model), worker, disaggregated=False).asgi_app()
        v1_routes = {path for r in app.routes if (path := getattr(r, "path", "")).startswith("/v1/")}
        tried = {path.removesuffix("/").replace("/models/m", "/models/{model_id:path}") for _, path, _ in requests}
        assert v1_routes <= tried  # every /v1 route is tried below
        auth = {"authorization": "Bearer k"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
            answers = {}
            for method, path, body in requests:
                if body is None:
                    r = await client.request(method, path, headers=auth)
                else:
                    r = await post(client, path, body, headers=auth)
                assert r.status_code == 200, (path, r.status_code, r.text)
                answers[path] = r.json()
            assert len(worker.tasks) == 2
            assert answers["/v1/models/"]["data"][0]["id"] == "m" and answers["/v1/models/m/"]["id"] == "m"
            # The key is still required, and an unknown path is still a 404 with an OpenAI body: never a redirect.
            assert (await post(client, "/v1/completions/", requests[0][2] or {})).status_code == 401
            r = await client.post("/v1/nothing/", headers=auth)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"

    asyncio.run(run())
