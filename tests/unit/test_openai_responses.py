"""The typed response bodies: what they write, and the streaming encoder writing exactly the typed chunk."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from cluster.openai_responses import (
    AssistantDelta,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceContent,
    CompletionChunk,
    CompletionResponse,
    PromptEcho,
    completion_choice,
    given,
    logprobs_body,
    response,
    stream_chunk,
    usage,
)
from cluster.tool_calls import ToolCall
from router.streaming import ChunkEncoder


@dataclass(frozen=True)
class Out:
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[float, ...]
    new_top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finish_reason: str | None = None


def _text(ids):
    return [f"<{i}>" for i in ids]


def _alternatives(alts):
    return [[(f"<{t}>", lp) for t, lp in position] for position in alts]


ECHO = PromptEcho("pr", ["p", "r"], [None, -0.25], [None, [("r", -0.25), ("x", -1.0)]])


def _expected(kind, outputs, *, logprobs, token_ids, include_usage, top, first, echo, text_before):
    """The chunk as the typed model writes it (parsed JSON)."""
    ids = [t for o in outputs for t in o.new_token_ids]
    text = "".join(o.new_text for o in outputs)
    lps = [lp for o in outputs for lp in o.new_logprobs]
    alts = _alternatives([a for o in outputs for a in o.new_top_logprobs]) if top else None
    tokens = _text(ids)
    if echo is not None:
        text, tokens, lps = echo.text + text, [*echo.tokens, *tokens], [*echo.logprobs, *lps]
        alts = [*echo.alternatives, *alts] if alts is not None else None
    lp = logprobs_body(kind, tokens, lps, text_before, alts) if logprobs else None
    finish = outputs[-1].finish_reason
    envelope = {"id": "r", "created": 7, "model": "m", **({"usage": None} if include_usage else {})}
    if kind == "completion":
        content = ChoiceContent(index=2, text=text, finish_reason=finish, **given(token_ids=ids if token_ids else None))
        choice = completion_choice(content).model_copy(update={"logprobs": lp})
        body = CompletionChunk(object="text_completion", choices=[choice], **envelope)
    else:
        delta = AssistantDelta(content=text, **given(role="assistant" if first else None))
        chat_choice = ChatChunkChoice(
            index=2, delta=delta, logprobs=lp, finish_reason=finish, **given(token_ids=ids if token_ids else None)
        )
        body = ChatCompletionChunk(object="chat.completion.chunk", choices=[chat_choice], **envelope)
    return json.loads(body.to_json())


@pytest.mark.parametrize(
    "kind,logprobs,token_ids,include_usage,top",
    [
        (k, lp, ti, iu, top)
        for k, lp, ti, iu, top in itertools.product(("completion", "chat"), *[(False, True)] * 4)
        if lp or not top
    ],
)
def test_stream_encoder_writes_the_typed_chunk(kind, logprobs, token_ids, include_usage, top):
    encoder = ChunkEncoder(
        kind,
        "r",
        "m",
        7,
        logprobs=logprobs,
        token_ids=token_ids,
        include_usage=include_usage,
        token_text=_text,
        index=2,
        alternatives_text=_alternatives if top else None,
    )
    steps = [
        [Out((5,), "a\u00e9", (-0.5,), (((5, -0.5), (6, -1.5)),))],
        [Out((6,), "b", (-1.0,), (((6, -1.0), (5, -2.0)),)), Out((7,), '"c"', (-2.0,), (((7, -2.0), (8, -3.0)),))],
        [Out((9,), "", (-3.0,), (((9, -3.0), (1, -4.0)),), finish_reason="stop")],
    ]
    echo = ECHO if kind == "completion" else None
    sent = 0
    for i, outputs in enumerate(steps):
        event = encoder.chunk(outputs, echo if i == 0 else None)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        payload = event[len(b"data: ") : -2]
        model = CompletionChunk if kind == "completion" else ChatCompletionChunk
        model.model_validate_json(payload)  # extra="forbid": no key the typed chunk lacks
        expected = _expected(
            kind,
            outputs,
            logprobs=logprobs,
            token_ids=token_ids,
            include_usage=include_usage,
            top=top,
            first=i == 0,
            echo=echo if i == 0 else None,
            text_before=sent,
        )
        assert json.loads(payload) == expected
        written = expected["choices"][0]
        sent += len(written["text"] if kind == "completion" else written["delta"]["content"])
    last = encoder.usage(usage(3, 4, 1))
    body = json.loads(last[len(b"data: ") : -2])
    assert body["choices"] == [] and body["usage"]["total_tokens"] == 7
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_optional_fields_are_written_only_when_asked():
    plain = response("completion", "r", "m", [ChoiceContent(index=0, text="x", finish_reason="length")], usage(1, 1))
    written = json.loads(plain.to_json())
    assert set(written["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}  # logprobs: null, as OpenAI
    assert written["choices"][0]["logprobs"] is None and written["object"] == "text_completion"
    asked = ChoiceContent(index=0, text="x", finish_reason="stop", token_ids=[3], logprobs=[-0.5], tokens=["x"])
    chat = json.loads(response("chat", "r", "m", [asked], usage(1, 1)).to_json())
    choice = chat["choices"][0]
    assert choice["token_ids"] == [3] and choice["message"] == {"role": "assistant", "content": "x"}
    assert choice["logprobs"]["content"] == [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]
    assert "prompt_logprobs" not in chat


def test_tool_calls_null_the_empty_content_and_stream_numbered():
    calls = (ToolCall("f", '{"a":1}', "call_1"), ToolCall("g", "{}", "call_2"))
    content = ChoiceContent(index=0, text="", finish_reason="tool_calls", tool_calls=calls)
    message = json.loads(response("chat", "r", "m", [content], usage(1, 1)).to_json())["choices"][0]["message"]
    assert message["content"] is None
    function = {"name": "g", "arguments": "{}"}
    assert message["tool_calls"][1] == {"id": "call_2", "type": "function", "function": function}
    event = json.loads(stream_chunk("chat", "r", "m", 1, [content], include_usage=False).to_json())
    assert [c["index"] for c in event["choices"][0]["delta"]["tool_calls"]] == [0, 1]
    assert "usage" not in event


def test_chat_prompt_logprobs_go_at_the_top_completions_in_each_choice():
    from cluster.openai_responses import PromptTokenLogprob

    body = [None, {"5": PromptTokenLogprob(logprob=-1.0, rank=1, decoded_token="a")}]
    content = ChoiceContent(index=0, text="x", finish_reason="stop", prompt_logprobs=body)
    chat = response("chat", "r", "m", [content], usage(2, 1))
    assert isinstance(chat, ChatCompletionResponse)
    written = json.loads(chat.to_json())
    assert written["prompt_logprobs"][1]["5"]["rank"] == 1 and "prompt_logprobs" not in written["choices"][0]
    completion = response("completion", "r", "m", [content], usage(2, 1))
    assert isinstance(completion, CompletionResponse)
    assert json.loads(completion.to_json())["choices"][0]["prompt_logprobs"][0] is None


def test_bodies_refuse_a_field_they_do_not_have():
    with pytest.raises(ValidationError):
        CompletionChunk(id="r", object="text_completion", created=0, model="m", choices=[], usagee=None)  # type: ignore[call-arg]
