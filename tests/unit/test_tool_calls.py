"""Tool calling: the parsers, the modes' 400s, and the edge through the official SDK (a stand-in decode worker
writes the model's text; tests/integration/test_cli_server.py runs forced calls on the real engine)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import httpx
import jsonschema
import openai
import pytest

from cluster.config import StructuredOutput
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.errors import InvalidRequestError
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import GenerateTask, Route, Started
from cluster.tokenizer import load_tokenizer
from cluster.tool_calls import NamedToolChoice, Tool, parse_output, tool_mode
from router.server import OpenAIServer
from tests.helpers import engine_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER)]


def test_hermes_parser_finds_calls_and_keeps_the_text_before_them():
    mode = tool_mode(TOOLS, "auto", "hermes")
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text += '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, calls = parse_output(mode, text, "hermes")
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parse_output(mode, "no call here", "hermes") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_output(mode, broken, "hermes") == (broken, [])


def test_llama3_json_parser():
    mode = tool_mode(TOOLS, "auto", "llama3_json")
    content, calls = parse_output(
        mode, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "llama3_json"
    )
    assert content is None and (calls[0].name, json.loads(calls[0].arguments)) == ("get_weather", {"city": "Rome"})
    assert parse_output(mode, "Hello there", "llama3_json") == ("Hello there", [])


def test_forced_modes_are_grammars_and_bad_choices_are_refused():
    named = tool_mode(TOOLS, NamedToolChoice.model_validate({"function": {"name": "get_weather"}}), None)
    content, calls = parse_output(named, '{"city": "Lima"}', None)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Lima"}
    required = tool_mode(TOOLS, "required", None)
    _, calls = parse_output(required, '[{"name": "get_weather", "parameters": {"city": "Kyiv"}}]', None)
    assert calls[0].name == "get_weather"
    for tools, choice, parser, message in (
        (TOOLS, "auto", None, "--tool-call-parser"),
        ([], "required", None, "needs tools"),
        (TOOLS, NamedToolChoice.model_validate({"function": {"name": "nope"}}), None, "not one of the tools"),
    ):
        with pytest.raises(InvalidRequestError, match=message) as e:
            tool_mode(tools, choice, parser)
        assert e.value.param == "tool_choice"


class TextWorker:
    """Answers with fixed text; keeps the last task (its params and prompt)."""

    replica_id = "fake"

    def __init__(self, text: str):
        self.text = text
        self.last_task: GenerateTask | None = None

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        self.last_task = task
        yield Started(Route.LOCAL, self.replica_id)
        n = len(task.prompt_token_ids)
        yield (RequestOutput(task.request_id, (5,), self.text, (), True, "stop", n, 1, 0),)

    def check_health(self) -> None:
        pass


TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %}{{ t.function.name }}: {{ t.function.description }};{% endfor %}"
    "{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<call {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def edge(demo_model, worker, **config):
    cfg = parse_serve_config({"device": "cpu", "served_model_name": "m", "chat_template": TEMPLATE, **config})
    server = OpenAIServer(cfg, str(demo_model), worker, board=None, disaggregated=False)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=server.asgi_app()), base_url="http://edge")
    return client, openai.AsyncOpenAI(base_url="http://edge/v1", api_key="x", http_client=client, max_retries=0)


def test_auto_tool_calls_through_the_sdk_streamed_and_not(demo_model):
    asyncio.run(_auto(demo_model))


async def _auto(demo_model):
    worker = TextWorker('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    client, api = edge(demo_model, worker, tool_call_parser="hermes")
    async with client:
        messages = [{"role": "user", "content": "weather in Paris?"}]
        out = await api.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        prompt = load_tokenizer(str(demo_model)).decode(worker.last_task.prompt_token_ids)
        assert "[tools]get_weather: Current weather in a city;" in prompt  # the template saw the tools
        chunks = [
            c
            async for c in await api.chat.completions.create(model="m", messages=messages, tools=[WEATHER], stream=True)
        ]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # tool_choice "none": the same text is content
        out = await api.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="none")
        assert out.choices[0].message.tool_calls is None and "<tool_call>" in out.choices[0].message.content


def test_forced_call_history_and_errors_through_the_sdk(demo_model):
    asyncio.run(_forced(demo_model))


async def _forced(demo_model):
    worker = TextWorker('{"city": "Rome"}')
    client, api = edge(demo_model, worker)  # no parser: forced calls only
    async with client:
        history = [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": "and Rome?"},
        ]
        named = {"type": "function", "function": {"name": "get_weather"}}
        out = await api.chat.completions.create(model="m", messages=history, tools=[WEATHER], tool_choice=named)
        call = out.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
        assert out.choices[0].finish_reason == "stop"  # a forced function ends as OpenAI's does
        structured = worker.last_task.params.structured
        assert structured == StructuredOutput(
            "json_schema", json.dumps(WEATHER["function"]["parameters"], sort_keys=True, separators=(",", ":"))
        )
        prompt = load_tokenizer(str(demo_model)).decode(worker.last_task.prompt_token_ids)
        assert '<call get_weather {"city": "Oslo"}>' in prompt and "[tool]sunny(for call_1)" in prompt
        await api.chat.completions.create(model="m", messages=history, tools=[WEATHER], tool_choice="required")
        assert '"minItems":1' in worker.last_task.params.structured.spec
        await api.chat.completions.create(
            model="m", messages=history, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
        )
        assert '"maxItems":1' in worker.last_task.params.structured.spec
        for kwargs, param in (
            ({"tools": [WEATHER]}, "tool_choice"),  # auto needs a parser on this server
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            (  # parameters that are no usable schema: a 400 naming tools
                {
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
                    "tool_choice": "required",
                },
                "tools",
            ),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                await api.chat.completions.create(model="m", messages=history, **kwargs)
            assert e.value.body["param"] == param, kwargs
        bad_args = [
            *history[:1],
            {
                **history[1],
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
            },
        ]
        with pytest.raises(openai.BadRequestError, match="not JSON"):
            await api.chat.completions.create(model="m", messages=bad_args)


# Parameters as pydantic's model_json_schema() writes them (here with extra="forbid"): named types under $defs,
# used through "$ref". The second tool's "Unit" (legacy "definitions") is another type under the same name.
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
            "additionalProperties": False,
            "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"],
            "title": "Forecast",
            "type": "object",
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "definitions": {"Unit": {"type": "integer", "minimum": 1, "maximum": 9}},
            "additionalProperties": False,
            "properties": {"unit": {"$ref": "#/definitions/Unit"}, "again": {"$ref": "#/properties/unit"}},
            "required": ["unit", "again"],
            "type": "object",
        },
    },
}


class EngineWorker:
    """Runs each task on a real CPU engine (random weights), so the output is what the task's grammar allows."""

    replica_id = "engine"

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        yield Started(Route.LOCAL, self.replica_id)
        out = self.engine.generate([list(task.prompt_token_ids)], task.params)[0]
        ids, n = tuple(out["token_ids"]), len(task.prompt_token_ids)
        yield (RequestOutput(task.request_id, ids, out["text"], (), True, out["finish_reason"], n, len(ids), 0),)

    def check_health(self) -> None:
        pass


def test_required_tools_with_defs_refs_give_calls_that_obey_them(demo_model):
    asyncio.run(_required_with_refs(demo_model))


async def _required_with_refs(demo_model):
    client, api = edge(demo_model, EngineWorker(LLMEngine(engine_config(demo_model, num_blocks=64))))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, ALARM)}

    def check(calls) -> str:
        (call,) = calls  # parallel_tool_calls=False: one call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        return call.function.name

    async with client:
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}
        ask |= {"tools": [FORECAST, ALARM], "tool_choice": "required", "parallel_tool_calls": False}
        names = set()
        for seed in range(4):
            out = await api.chat.completions.create(**ask, seed=seed)
            assert out.choices[0].finish_reason == "tool_calls", out.choices[0].message.content
            names.add(check(out.choices[0].message.tool_calls))
        assert names == {"get_forecast", "set_alarm"}  # each tool's own "Unit", neither the other's
        chunks = [c async for c in await api.chat.completions.create(**ask, seed=0, stream=True)]
        assert check([tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []])
        # a reference that cannot be moved with its tool: a 400 naming the tool, never a constraint that drifts
        other = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "other.json#/Unit"}}}
        with pytest.raises(openai.BadRequestError, match="tool 'f'") as e:
            await api.chat.completions.create(**(ask | {"tools": [FORECAST, other]}))
        assert e.value.body["param"] == "tools"
