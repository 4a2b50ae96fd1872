"""The helper endpoints, served names and API key of the HTTP edge, through the official ``openai`` SDK and plain
HTTP, in process: the edge's ASGI app in front of a stand-in decode worker (the engine is tested elsewhere)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator

import httpx
import openai
import pytest

from cluster.engine.llm_engine import RequestOutput
from cluster.errors import ConfigError
from cluster.prompting import encode_chat
from cluster.scores import TokenScore
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import GenerateTask, Route, Started
from cluster.tokenizer import load_tokenizer
from router.server import OpenAIServer

KEY = "sk-test-123"


class EchoWorker:
    """Answers every request with two tokens, ids 5 and 6; keeps the last task it was given."""

    replica_id = "fake"
    last_task: GenerateTask | None = None

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        self.last_task = task
        yield Started(Route.LOCAL, self.replica_id)
        n = len(task.prompt_token_ids)
        yield (RequestOutput(task.request_id, (5,), "a", (), False, None, n, 1, 0),)
        yield (RequestOutput(task.request_id, (6,), "b", (), True, "length", n, 2, 0),)

    def check_health(self) -> None:
        pass


def edge(demo_model, worker: EchoWorker | None = None, **config) -> httpx.AsyncClient:
    cfg = parse_serve_config({"device": "cpu", **config})
    server = OpenAIServer(cfg, str(demo_model), worker or EchoWorker(), board=None, disaggregated=False)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.asgi_app()), base_url="http://edge")


def sdk(client: httpx.AsyncClient, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://edge/v1", api_key=api_key, http_client=client, max_retries=0)


def test_several_served_names_models_and_model_cards(demo_model):
    asyncio.run(_several_served_names_models_and_model_cards(demo_model))


async def _several_served_names_models_and_model_cards(demo_model):
    async with edge(demo_model, served_model_name=["llama-small", "default"]) as client:
        api = sdk(client)
        models = await api.models.list()
        assert [m.id for m in models.data] == ["llama-small", "default"]
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["root"] == str(demo_model) and card["permission"][0]["object"] == "model_permission"
        assert (await api.models.retrieve("default")).id == "default"
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve("gpt-4")
        # Answered under the name the client used; any served name works, as does the directory.
        out = await api.completions.create(model="default", prompt="hi", max_tokens=2)
        assert out.model == "default" and out.choices[0].text == "ab"
        out = await api.completions.create(model=str(demo_model), prompt="hi", max_tokens=2)
        assert out.model == "llama-small"
        with pytest.raises(openai.NotFoundError, match="this server serves 'llama-small', 'default'"):
            await api.completions.create(model="other", prompt="hi", max_tokens=2)


def test_api_key_guards_the_api_but_not_the_probes(demo_model):
    asyncio.run(_api_key_guards_the_api_but_not_the_probes(demo_model))


async def _api_key_guards_the_api_but_not_the_probes(demo_model):
    async with edge(demo_model, served_model_name="m", api_key=KEY) as client:
        with pytest.raises(openai.AuthenticationError):
            await sdk(client, "sk-wrong").completions.create(model="m", prompt="hi", max_tokens=2)
        out = await sdk(client, KEY).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert out.choices[0].message.content == "ab"
        r = await client.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"
        for probe in ("/health", "/ping", "/version", "/metrics"):
            assert (await client.get(probe)).status_code == 200, probe


def test_tokenize_and_detokenize(demo_model):
    asyncio.run(_tokenize_and_detokenize(demo_model))


async def _tokenize_and_detokenize(demo_model):
    tok = load_tokenizer(str(demo_model))
    async with edge(demo_model, served_model_name="m") as client:
        r = await client.post("/tokenize", json={"model": "m", "prompt": "Hello world", "return_token_strs": True})
        body = r.json()
        assert body["tokens"] == tok("Hello world").input_ids and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 1024 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
        plain = (await client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})).json()
        assert plain["tokens"] == tok("Hello world", add_special_tokens=False).input_ids
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat = (await client.post("/tokenize", json={"messages": messages})).json()
        assert chat["tokens"] == encode_chat(tok, messages, True)  # what /v1/chat/completions feeds the engine
        back = (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
        assert back == {"prompt": tok.decode(body["tokens"])}
        for bad, param in (
            ({"prompt": "a", "messages": messages}, None),
            ({}, None),
            ({"prompt": "\ud800"}, "prompt"),
            ({"model": "other", "prompt": "a"}, "model"),
        ):
            # json.dumps writes a lone surrogate as its \\u escape, as a client library would (httpx refuses to)
            r = await client.post("/tokenize", content=json.dumps(bad), headers={"content-type": "application/json"})
            assert r.status_code in (400, 404) and "error" in r.json(), bad
            if param:
                assert r.json()["error"]["param"] == param
        r = await client.post("/detokenize", json={"tokens": [1, 99999]})
        assert (
            r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "99999" in r.json()["error"]["message"]
        )
        assert (await client.get("/version")).json()["version"]
        assert (await client.post("/ping")).status_code == 200
        # Load balancers that probe with HEAD (AWS ALB/NLB allow it, HAProxy's default check uses it)
        assert (await client.head("/health")).status_code == 200 and (await client.head("/ping")).status_code == 200


def test_serve_flags_for_names_and_key(demo_model, monkeypatch):
    from cluster.tools.cli import build_parser
    from cluster.tools.serve_cli import config_from_args

    parse = build_parser().parse_args
    monkeypatch.delenv("SHAPESERVE_API_KEY", raising=False)
    args = parse(["serve", "--model", str(demo_model), "--served-model-name", "a", "b", "--api-key", KEY])
    config, _ = config_from_args(args)
    assert config.served_model_names == ["a", "b"] and config.model_name == "a" and config.api_key == KEY
    assert KEY not in repr(config)  # never in a log line that prints the config
    monkeypatch.setenv("SHAPESERVE_API_KEY", "from-env")
    config, _ = config_from_args(build_parser().parse_args(["serve", "--model", str(demo_model)]))
    assert config.api_key == "from-env" and config.served_model_names == [demo_model.name]


REFUSED_COMPLETION = {
    "best_of": 2,
    "suffix": "end",
    "structured_outputs": {"structural_tag": "{}"},  # vLLM's structural tags: not served
}
REFUSED_CHAT = {
    "functions": [{"name": "f", "parameters": {}}],  # the deprecated API: tools replace it
    "function_call": "auto",
}


def test_fields_that_would_change_the_output_are_refused_by_name(demo_model):
    asyncio.run(_fields_refused(demo_model))


async def _fields_refused(demo_model):
    async with edge(demo_model, served_model_name="m") as client:
        api = sdk(client)
        for field, value in REFUSED_COMPLETION.items():
            with pytest.raises(openai.BadRequestError) as e:
                await api.completions.create(model="m", prompt="hi", max_tokens=2, extra_body={field: value})
            assert e.value.body["param"] == field, field
        for field, value in REFUSED_CHAT.items():
            with pytest.raises(openai.BadRequestError) as e:
                await api.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    logprobs=True,
                    extra_body={field: value},
                )
            assert e.value.body["param"] == field, field
        history = [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "w", "arguments": "{}"}}],
            },
        ]
        # Tool-call history is accepted now (rendered by the template: tests/unit/test_tool_calls.py).
        out = await api.chat.completions.create(model="m", messages=history, max_tokens=2)
        assert out.choices[0].message.content == "ab"
        # Their neutral values ask for nothing and are accepted, as are fields no server acts on.
        neutral = {"logit_bias": {}, "min_tokens": 0, "repetition_penalty": 1.0, "min_p": 0.0, "best_of": 1}
        neutral |= {"response_format": {"type": "text"}, "tools": [], "user": "u1", "some_future_field": 1}
        out = await api.completions.create(model="m", prompt="hi", max_tokens=2, extra_body=neutral)
        assert out.choices[0].text == "ab"


SAMPLING_EXTRAS = {
    "logit_bias": {"5": -100, "17": 2.5},
    "min_tokens": 3,
    "repetition_penalty": 1.2,
    "min_p": 0.1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
}


def test_sampling_fields_reach_the_engine_and_bad_values_are_refused_by_name(demo_model):
    asyncio.run(_sampling_fields(demo_model))


async def _sampling_fields(demo_model):
    worker = EchoWorker()
    async with edge(demo_model, worker, served_model_name="m") as client:
        api = sdk(client)
        await api.completions.create(model="m", prompt="hi", max_tokens=8, extra_body=SAMPLING_EXTRAS)
        assert worker.last_task is not None
        p = worker.last_task.params
        assert (p.logit_bias, p.min_tokens, p.repetition_penalty, p.min_p) == (((5, -100.0), (17, 2.5)), 3, 1.2, 0.1)
        assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.25)
        await api.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            logit_bias={"9": 1},
            presence_penalty=1.5,
            extra_body={"min_p": 0.5},
        )
        p = worker.last_task.params
        assert (p.logit_bias, p.presence_penalty, p.min_p) == (((9, 1.0),), 1.5, 0.5)
        for field, value in (
            ("logit_bias", {"five": 1}),
            ("logit_bias", {"5": 101}),
            ("logit_bias", {"600": 1}),  # the demo vocabulary has 512 tokens
            ("min_tokens", 9),  # above max_tokens
            ("min_tokens", -1),
            ("repetition_penalty", 0),
            ("min_p", 2),
            ("presence_penalty", 3),
            ("frequency_penalty", -2.5),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                await api.completions.create(model="m", prompt="hi", max_tokens=8, extra_body={field: value})
            assert e.value.body["param"] == field, (field, value)


TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


def test_max_model_len_and_chat_template_flags(demo_model, tmp_path):
    from cluster.tools.cli import build_parser
    from cluster.tools.serve_cli import config_from_args

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    base = ["serve", "--model", str(demo_model)]
    config, _ = config_from_args(
        build_parser().parse_args([*base, "--max-model-len", "64", "--chat-template", str(template)])
    )
    assert config.max_model_len == 64 and config.chat_template == TEMPLATE
    assert config.engine_config("decode", str(demo_model)).max_model_len == 64
    with pytest.raises(ConfigError, match="longer than this model's context of 1024"):
        config_from_args(build_parser().parse_args([*base, "--max-model-len", "4096"]))
    template.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="not a chat template that renders"):
        config_from_args(build_parser().parse_args([*base, "--chat-template", str(template)]))
    asyncio.run(_edge_enforces(demo_model, config))


async def _edge_enforces(demo_model, config):
    server = OpenAIServer(config, str(demo_model), EchoWorker(), board=None, disaggregated=False)
    transport = httpx.ASGITransport(app=server.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        api = sdk(client)
        assert (await api.models.list()).data[0].model_extra["max_model_len"] == 64
        with pytest.raises(openai.BadRequestError, match="64"):  # 60 prompt tokens + 10 > 64
            await api.completions.create(model=config.model_name, prompt=list(range(4, 64)), max_tokens=10)
        messages = [{"role": "user", "content": "hi"}]
        tokens = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
        assert tokens == server.tokenizer("[user]hi>", add_special_tokens=False).input_ids  # rendered with the flag's


class LogprobWorker(EchoWorker):
    """Two tokens with their logprobs, their text as the tokenizer decodes them (one engine step each); each
    position's alternatives, when asked, are the sampled token then ids 302, 303, ... at logprob -2, -3, ..."""

    IDS, LOGPROBS = (300, 301), (-0.5, -1.5)

    def __init__(self, tokenizer):
        self.texts = [tokenizer.decode([t]) for t in self.IDS]

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        yield Started(Route.LOCAL, self.replica_id)
        n = len(task.prompt_token_ids)
        for i, (t, lp) in enumerate(zip(self.IDS, self.LOGPROBS, strict=True)):
            last = i == len(self.IDS) - 1
            lps = (lp,) if task.params.logprobs else ()
            k = task.params.top_logprobs
            top = (((t, lp), *((302 + j, -2.0 - j) for j in range(k - 1))),) if k else ()
            out = RequestOutput(
                task.request_id, (t,), self.texts[i], lps, last, "length" if last else None, n, i + 1, 0, None, top
            )
            yield (out,)


def test_logprobs_carry_token_texts_bytes_and_offsets(demo_model):
    asyncio.run(_logprobs(demo_model))


async def _logprobs(demo_model):
    tok = load_tokenizer(str(demo_model))
    worker = LogprobWorker(tok)
    t0, t1 = worker.texts
    async with edge(demo_model, worker, served_model_name="m") as client:
        api = sdk(client)
        alt = tok.decode([302])
        out = await api.completions.create(model="m", prompt="hi", max_tokens=2, logprobs=0)
        lp = out.choices[0].logprobs
        assert lp.tokens == [t0, t1] and lp.token_logprobs == [-0.5, -1.5] and lp.text_offset == [0, len(t0)]
        assert lp.top_logprobs is None  # logprobs=0: the sampled tokens only
        out = await api.completions.create(model="m", prompt="hi", max_tokens=2, logprobs=2)
        assert out.choices[0].logprobs.top_logprobs == [{t0: -0.5, alt: -2.0}, {t1: -1.5, alt: -2.0}]
        chunks = [
            c async for c in await api.completions.create(model="m", prompt="hi", max_tokens=2, logprobs=2, stream=True)
        ]
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for s in streamed for t in s.tokens] == [t0, t1]
        assert [o for s in streamed for o in s.text_offset] == [0, len(t0)]  # offsets run on across chunks
        assert [a for s in streamed for a in s.top_logprobs] == [{t0: -0.5, alt: -2.0}, {t1: -1.5, alt: -2.0}]
        messages = [{"role": "user", "content": "hi"}]
        chat = await api.chat.completions.create(model="m", messages=messages, max_tokens=2, logprobs=True)
        content = chat.choices[0].logprobs.content
        assert [(c.token, c.logprob, c.bytes, c.top_logprobs) for c in content] == [
            (t0, -0.5, list(t0.encode()), []),
            (t1, -1.5, list(t1.encode()), []),
        ]
        for stream in (False, True):
            chat = await api.chat.completions.create(
                model="m", messages=messages, max_tokens=2, logprobs=True, top_logprobs=3, stream=stream
            )
            if stream:
                content = [c async for chunk in chat for c in (chunk.choices[0].logprobs.content or [])]
            else:
                content = chat.choices[0].logprobs.content
            tops = [[(a.token, a.logprob, a.bytes) for a in c.top_logprobs] for c in content]
            a3 = tok.decode([303])
            assert tops == [
                [(t0, -0.5, list(t0.encode())), (alt, -2.0, list(alt.encode())), (a3, -3.0, list(a3.encode()))],
                [(t1, -1.5, list(t1.encode())), (alt, -2.0, list(alt.encode())), (a3, -3.0, list(a3.encode()))],
            ], stream
        with pytest.raises(openai.BadRequestError) as e:  # alternatives without logprobs: OpenAI refuses too
            await api.chat.completions.create(model="m", messages=messages, max_tokens=2, top_logprobs=2)
        assert e.value.body["param"] == "top_logprobs"
        for too_many in ({"logprobs": 21}, {"logprobs": -1}):
            with pytest.raises(openai.BadRequestError) as e:
                await api.completions.create(model="m", prompt="hi", max_tokens=2, **too_many)
            assert e.value.body["param"] == "logprobs"
        plain = await api.completions.create(model="m", prompt="hi", max_tokens=2)
        assert plain.choices[0].logprobs is None


class ScoringWorker(LogprobWorker):
    """LogprobWorker's two tokens; with ``prompt_logprobs`` the first output carries prompt token i's score as
    logprob -i, rank i, alternatives ids 400, 401, ... at -0.1, -0.2, ..."""

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        first = True
        k = task.params.prompt_logprobs
        async for item in super().generate(task):
            if first and isinstance(item, tuple) and k is not None:
                ids = task.prompt_token_ids
                scores = tuple(
                    TokenScore(-float(i), i, tuple((400 + j, -0.1 * (j + 1)) for j in range(k)))
                    for i in range(1, len(ids))
                )
                item = (dataclasses.replace(item[0], prompt_logprobs=scores),)
                first = False
            yield item


def test_echo_and_prompt_logprobs(demo_model):
    asyncio.run(_echo(demo_model))


async def _echo(demo_model):
    tok = load_tokenizer(str(demo_model))
    worker = ScoringWorker(tok)
    t0, t1 = worker.texts
    async with edge(demo_model, worker, served_model_name="m") as client:
        api = sdk(client)
        prompt = [20, 21, 22]
        plain = await api.completions.create(model="m", prompt="hello", max_tokens=2, echo=True)
        assert plain.choices[0].text == "hello" + t0 + t1 and plain.choices[0].logprobs is None
        out = await api.completions.create(model="m", prompt=prompt, max_tokens=2, echo=True, logprobs=1)
        choice = out.choices[0]
        names = [tok.decode([t]) for t in prompt]
        assert choice.text == tok.decode(prompt) + t0 + t1
        lp = choice.logprobs
        assert lp.tokens == [*names, t0, t1]
        assert lp.token_logprobs == [None, -1.0, -2.0, -0.5, -1.5]
        alt = tok.decode([400])
        assert lp.top_logprobs == [None, {alt: -0.1}, {alt: -0.1}, {t0: -0.5}, {t1: -1.5}]
        assert lp.text_offset[:3] == [0, len(names[0]), len(names[0]) + len(names[1])]
        assert (choice.model_extra or {}).get("prompt_logprobs") is None  # asked only through echo
        raw = await client.post(
            "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
        )
        body = raw.json()["choices"][0]["prompt_logprobs"]
        assert body[0] is None and body[1]["21"] == {"logprob": -1.0, "rank": 1, "decoded_token": names[1]}
        assert body[2]["401"] == {"logprob": pytest.approx(-0.2), "rank": 2, "decoded_token": tok.decode([401])}
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
        )
        chat_body = chat.json()
        # vLLM's place for it in chat: the response, not the choice
        assert chat_body["prompt_logprobs"][0] is None and "prompt_logprobs" not in chat_body["choices"][0]
        # Streamed, echo puts the prompt (and its logprobs) in the first event; joined, the events equal the
        # whole response.
        stream = await api.completions.create(model="m", prompt="hello", max_tokens=2, echo=True, stream=True)
        events = [c async for c in stream]
        assert events[0].choices[0].text.startswith("hello")
        assert "".join(c.choices[0].text for c in events) == plain.choices[0].text
        stream = await api.completions.create(
            model="m", prompt=prompt, max_tokens=2, echo=True, logprobs=1, stream=True
        )
        events = [c async for c in stream if c.choices]
        assert "".join(c.choices[0].text for c in events) == choice.text
        joined = {
            name: [x for c in events for x in getattr(c.choices[0].logprobs, name)]
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
        assert joined == {name: getattr(lp, name) for name in joined}
        # As vLLM: the prompt_logprobs body is one for the whole prompt, which no stream event carries.
        streamed = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True, "prompt_logprobs": 1}
        r = await client.post("/v1/completions", json=streamed)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


class PromptWorker(EchoWorker):
    """Answers with the prompt's first token id as text; a prompt starting with 13 fails after its first token.
    Records which requests' streams were closed (what aborts them in the engine)."""

    def __init__(self):
        self.closed: list[str] = []

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        try:
            yield Started(Route.LOCAL, self.replica_id)
            first, n = task.prompt_token_ids[0], len(task.prompt_token_ids)
            yield (RequestOutput(task.request_id, (first,), f"<{first}>", (), False, None, n, 1, 0),)
            if first == 13:
                yield (RequestOutput(task.request_id, (), "", (), True, "error", n, 1, 0, error="boom"),)
                return
            await asyncio.sleep(0.01)
            yield (RequestOutput(task.request_id, (7,), ".", (), True, "length", n, 2, 0),)
        finally:
            self.closed.append(task.request_id)


def test_several_prompts_and_n_fan_out_into_indexed_choices(demo_model):
    asyncio.run(_fan_out(demo_model))


async def _fan_out(demo_model):
    worker = PromptWorker()
    cfg = parse_serve_config({"device": "cpu", "served_model_name": "m"})
    server = OpenAIServer(cfg, str(demo_model), worker, board=None, disaggregated=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.asgi_app()), base_url="http://e") as client:
        api = sdk(client)
        out = await api.completions.create(model="m", prompt=[[10, 1], [11, 2, 3]], n=2, max_tokens=2)
        assert [(c.index, c.text) for c in out.choices] == [(0, "<10>."), (1, "<10>."), (2, "<11>."), (3, "<11>.")]
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 8)  # each prompt once, every sequence
        chat = await api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3)
        assert [c.index for c in chat.choices] == [0, 1, 2]
        stream = await api.completions.create(
            model="m", prompt=[[10], [11]], max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
        texts: dict[int, str] = {}
        usage = None
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            usage = chunk.usage or usage
        assert texts == {0: "<10>.", 1: "<11>."} and usage.completion_tokens == 4
        # One failing choice fails the response, and the other choices are ended with it (aborted in the engine).
        worker.closed.clear()
        with pytest.raises(openai.InternalServerError, match="boom"):
            await api.completions.create(model="m", prompt=[[10], [13], [11]], max_tokens=2)
        assert len(worker.closed) == 3
        worker.closed.clear()
        body = {"model": "m", "prompt": [[10], [13]], "max_tokens": 2, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            events = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]" and len(worker.closed) == 2
        assert server.admission.inflight(Route.LOCAL) == (0, 0)  # every choice's ticket came back
    # Admission sees every choice: when the class cannot take all of them, none runs and the 429 says when to retry.
    cfg = parse_serve_config(
        {"device": "cpu", "served_model_name": "m", "admission": {"local": {"max_inflight_requests": 2}}}
    )
    server = OpenAIServer(cfg, str(demo_model), PromptWorker(), board=None, disaggregated=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.asgi_app()), base_url="http://e") as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": [10], "n": 3, "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert server.admission.inflight(Route.LOCAL) == (0, 0)
        ok = await client.post("/v1/completions", json={"model": "m", "prompt": [10], "n": 2, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_tokenize_without_special_tokens_still_refuses_lone_surrogates(demo_model):
    async def run():
        async with edge(demo_model, served_model_name="m") as client:
            raw = json.dumps({"prompt": "hi \ud800", "add_special_tokens": False})
            r = await client.post("/tokenize", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    asyncio.run(run())


def test_slo_admission_refuses_with_an_appointment_that_a_retry_keeps(demo_model):
    asyncio.run(_slo_admission(demo_model))


async def _slo_admission(demo_model):
    from router.admission import TokenPace

    cfg = parse_serve_config({"device": "cpu", "served_model_name": "m", "slo": {"ttft_ms": 2000, "tpot_ms": 100}})
    server = OpenAIServer(cfg, str(demo_model), EchoWorker(), board=None, disaggregated=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.asgi_app()), base_url="http://edge") as c:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        running = server.admission.admit(Route.LOCAL, 500)  # a stream in flight ...
        server.admission.tokens_streamed(0.5)  # ... at 500 ms per token, past the 100 ms target
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert "500 ms per token, past the 100 ms target" in r.json()["error"]["message"]
        wait = int(r.headers["Retry-After"])
        assert 1 <= wait <= cfg.admission.max_retry_after_s
        # The streams are back to 90 ms per token: within the target, but not within the 75 ms a new request
        # is held to while the refused client is due back.
        server.admission.pace = TokenPace()
        server.admission.tokens_streamed(0.09)
        await asyncio.sleep(wait)
        server.admission.tokens_streamed(0.09)
        assert (await c.post("/v1/completions", json=body)).status_code == 429
        retry = await c.post("/v1/completions", json=body, headers={"X-Stainless-Retry-Count": "1"})
        assert retry.status_code == 200 and retry.json()["choices"][0]["text"] == "ab"
        server.admission.release(running)
