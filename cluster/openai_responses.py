"""The OpenAI-compatible response bodies, as typed models: every JSON body the server and run-batch answer is
one of these (``TypedJSONResponse`` renders them), so a body's shape is checked where it is built.

Fields OpenAI always sends (``logprobs``, ``finish_reason``, a choice's ``index``) are required, so they appear
even when null. vLLM's extension fields (``token_ids``, ``prompt_logprobs``) and the optional ones
(``tool_calls``, a delta's ``role``) appear only when given: bodies are written with ``exclude_unset``, and the
builders below give them only when the request asked for them.

The streaming hot path (``router.streaming.ChunkEncoder``) writes its chunks as bytes from a per-request
template, one small encode per engine step; its output is the ``CompletionChunk`` / ``ChatCompletionChunk``
below, byte for byte (``tests/unit/test_openai_responses.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, JsonValue
from starlette.responses import Response

if TYPE_CHECKING:
    from cluster.scores import TokenScore
    from cluster.tool_calls import ToolCall

Kind = Literal["completion", "chat"]


class _Body(BaseModel):
    # extra="forbid": a misspelt field in a builder is an error here, not a silent key on the wire.
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> bytes:
        return self.__pydantic_serializer__.to_json(self, exclude_unset=True)


def given(**fields: Any) -> dict[str, Any]:
    """The optional fields that have a value (``exclude_unset`` then writes exactly those)."""
    return {k: v for k, v in fields.items() if v is not None}


class TypedJSONResponse(Response):
    """A Starlette response whose content is a response model (written with ``exclude_unset``)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content.to_json()


# ---- errors -------------------------------------------------------------------------------


class ErrorInfo(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    error: ErrorInfo


def error_response(message: str, err_type: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code))


# ---- usage and logprobs -------------------------------------------------------------------


class PromptTokensDetails(_Body):
    cached_tokens: int


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float | None]
    #: Per position {token text: logprob} of its most likely tokens; null when the request asked for none.
    top_logprobs: list[dict[str, float] | None] | None
    #: Characters into the choice's text where each token starts.
    text_offset: list[int]


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[ChatTokenLogprob]


class PromptTokenLogprob(_Body):
    """One entry of vLLM's ``prompt_logprobs``."""

    logprob: float
    rank: int
    decoded_token: str


#: vLLM's ``prompt_logprobs``: null for the first prompt token, then per token {token id: its logprob entry}.
PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


def token_strings(tokenizer, token_ids: Sequence[int]) -> list[str]:
    """Each token's own text, as the logprobs bodies name it (a token that ends inside a multi-byte character
    decodes to U+FFFD, as in vLLM)."""
    return [tokenizer.decode([t]) for t in token_ids]


#: Per position, its most likely tokens as (text, logprob), most likely first (None: a position with none).
NamedAlternatives = Sequence[Sequence[tuple[str, float]] | None]


def alternative_strings(
    tokenizer, alternatives: Sequence[Sequence[tuple[int, float]]]
) -> list[list[tuple[str, float]]]:
    """The engine's (token id, logprob) alternatives with each token's text, decoded in one pass."""
    texts = iter(token_strings(tokenizer, [t for position in alternatives for t, _ in position]))
    return [[(next(texts), lp) for _, lp in position] for position in alternatives]


def _by_text(position: Sequence[tuple[str, float]] | None) -> dict[str, float] | None:
    """Completions' {text: logprob}: two tokens with the same text (e.g. both U+FFFD) keep the likelier one."""
    if position is None:
        return None
    named: dict[str, float] = {}
    for text, logprob in position:
        named.setdefault(text, logprob)
    return named


def logprobs_body(
    kind: Kind,
    tokens: Sequence[str],
    logprobs: Sequence[float | None],
    text_offset: int = 0,
    alternatives: NamedAlternatives | None = None,
) -> CompletionLogprobs | ChatLogprobs:
    """The ``logprobs`` of a choice (or of one stream chunk). Completions: ``text_offset`` counts characters into
    the choice's text from the given start, ``top_logprobs`` is null when no alternatives were asked. Chat: each
    token's text, logprob, UTF-8 bytes and alternatives (the same three each). ``alternatives``: per position,
    from ``alternative_strings``."""
    if kind == "completion":
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return CompletionLogprobs(
            tokens=list(tokens),
            token_logprobs=list(logprobs),
            top_logprobs=[_by_text(p) for p in alternatives] if alternatives is not None else None,
            text_offset=offsets,
        )
    positions = alternatives if alternatives is not None else [()] * len(tokens)
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=t,
                logprob=lp,
                bytes=list(t.encode("utf-8")),
                top_logprobs=[TopLogprob(token=a, logprob=alp, bytes=list(a.encode("utf-8"))) for a, alp in alts or ()],
            )
            for t, lp, alts in zip(tokens, logprobs, positions, strict=True)
        ]
    )


@dataclass(frozen=True)
class PromptEcho:
    """What a completions choice shows of its prompt with ``echo``: its text and, when the request asked for
    logprobs, its tokens' texts, logprobs (None for the first token, which nothing predicts) and alternatives."""

    text: str
    tokens: list[str]
    logprobs: list[float | None]
    alternatives: list[list[tuple[str, float]] | None]


def prompt_echo(
    tokenizer, prompt: str | list[int], prompt_ids: Sequence[int], scores: Sequence[TokenScore] | None
) -> PromptEcho:
    """``prompt``: as the request gave it (a text is echoed as sent, token ids as they decode); ``scores``: the
    engine's ``prompt_logprobs`` for tokens 1.. (None: no logprobs asked)."""
    text = prompt if isinstance(prompt, str) else tokenizer.decode(list(prompt_ids))
    if scores is None:
        return PromptEcho(text, [], [], [])
    alternatives: list[list[tuple[str, float]] | None] = [None]
    alternatives += alternative_strings(tokenizer, [s.top for s in scores])
    return PromptEcho(text, token_strings(tokenizer, prompt_ids), [None, *(s.logprob for s in scores)], alternatives)


def prompt_logprobs_body(tokenizer, prompt_ids: Sequence[int], scores: Sequence[TokenScore]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token ``{token id: {logprob, rank,
    decoded_token}}`` for the token itself and its position's alternatives."""
    positions = list(zip(prompt_ids[1:], scores, strict=True))
    named = [(token, *(alt for alt, _ in s.top)) for token, s in positions]
    texts = iter(token_strings(tokenizer, [t for ids in named for t in ids]))  # decoded in one pass
    body: PromptLogprobs = [None]
    for token, s in positions:
        entry = {str(token): PromptTokenLogprob(logprob=s.logprob, rank=s.rank, decoded_token=next(texts))}
        for rank, (alt, alt_lp) in enumerate(s.top, start=1):
            alt_text = next(texts)  # consumed even when the alternative is the token itself
            entry.setdefault(str(alt), PromptTokenLogprob(logprob=alt_lp, rank=rank, decoded_token=alt_text))
        body.append(entry)
    return body


# ---- choices ------------------------------------------------------------------------------


class FunctionCall(_Body):
    name: str
    #: The arguments as JSON text.
    arguments: str


class ToolCallBody(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall
    #: Stream deltas number their calls.
    index: int | None = None


class AssistantMessage(_Body):
    role: Literal["assistant"]
    #: Null when the message is only tool calls.
    content: str | None
    tool_calls: list[ToolCallBody] | None = None


class AssistantDelta(_Body):
    #: In a stream's first delta only, as OpenAI does.
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallBody] | None = None


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatChunkChoice(_Body):
    index: int
    delta: AssistantDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    token_ids: list[int] | None = None


@dataclass(frozen=True)
class ChoiceContent:
    """What one finished choice holds, before it is written in either API's shape. ``tokens``: the sampled
    tokens' texts (``token_strings``), with ``logprobs``; ``alternatives``: each position's most likely tokens,
    when the request asked for them; ``echo``: the prompt, put before the completion (completions' ``echo``);
    ``tool_calls``: the calls found in a chat output (its ``content`` is then what is left, null when nothing);
    ``prompt_logprobs``: vLLM's, when asked."""

    index: int
    text: str
    finish_reason: str | None
    token_ids: list[int] | None = None
    logprobs: Sequence[float | None] | None = None
    tokens: Sequence[str] | None = None
    alternatives: NamedAlternatives | None = None
    echo: PromptEcho | None = None
    tool_calls: Sequence[ToolCall] = ()
    prompt_logprobs: PromptLogprobs | None = None


def _calls(calls: Sequence[ToolCall], numbered: bool) -> list[ToolCallBody]:
    return [
        ToolCallBody(
            id=c.id,
            type="function",
            function=FunctionCall(name=c.name, arguments=c.arguments),
            **given(index=i if numbered else None),
        )
        for i, c in enumerate(calls)
    ]


def completion_choice(c: ChoiceContent) -> CompletionChoice:
    text, tokens, logprobs, alternatives = c.text, c.tokens, c.logprobs, c.alternatives
    if c.echo is not None:
        text = c.echo.text + text
        if logprobs is not None:
            tokens, logprobs = [*c.echo.tokens, *(tokens or [])], [*c.echo.logprobs, *logprobs]
            alternatives = [*c.echo.alternatives, *alternatives] if alternatives is not None else None
    lp = logprobs_body("completion", tokens or [], logprobs, 0, alternatives) if logprobs is not None else None
    assert lp is None or isinstance(lp, CompletionLogprobs)
    return CompletionChoice(
        index=c.index,
        text=text,
        logprobs=lp,
        finish_reason=c.finish_reason,
        **given(token_ids=c.token_ids, prompt_logprobs=c.prompt_logprobs),
    )


def _chat_logprobs(c: ChoiceContent) -> ChatLogprobs | None:
    if c.logprobs is None:
        return None
    lp = logprobs_body("chat", c.tokens or [], c.logprobs, 0, c.alternatives)
    assert isinstance(lp, ChatLogprobs)
    return lp


def _assistant(c: ChoiceContent, numbered_calls: bool) -> dict[str, Any]:
    """A chat choice's message (or whole-choice delta) fields: with tool calls, the content is what is left
    (null when nothing)."""
    return {
        "role": "assistant",
        "content": (c.text or None) if c.tool_calls else c.text,
        **given(tool_calls=_calls(c.tool_calls, numbered=numbered_calls) if c.tool_calls else None),
    }


def chat_choice(c: ChoiceContent) -> ChatChoice:
    return ChatChoice(
        index=c.index,
        message=AssistantMessage(**_assistant(c, numbered_calls=False)),
        logprobs=_chat_logprobs(c),
        finish_reason=c.finish_reason,
        **given(token_ids=c.token_ids),
    )


def chat_chunk_choice(c: ChoiceContent) -> ChatChunkChoice:
    """A whole choice as one stream delta (a chat stream with tools, whose calls are known only at the end;
    stream deltas number their calls)."""
    return ChatChunkChoice(
        index=c.index,
        delta=AssistantDelta(**_assistant(c, numbered_calls=True)),
        logprobs=_chat_logprobs(c),
        finish_reason=c.finish_reason,
        **given(token_ids=c.token_ids),
    )


# ---- whole responses ----------------------------------------------------------------------


class CompletionResponse(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    #: vLLM puts a chat response's prompt logprobs here: its choices share one prompt.
    prompt_logprobs: PromptLogprobs | None = None


class CompletionChunk(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    #: Present (null until the last event) when the request asked for ``stream_options.include_usage``.
    usage: Usage | None = None


class ChatCompletionChunk(_Body):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def response(
    kind: Kind, rid: str, model: str, contents: Sequence[ChoiceContent], usage: Usage
) -> CompletionResponse | ChatCompletionResponse:
    """A whole (non-streamed) response from its finished choices."""
    created = int(time.time())
    if kind == "completion":
        return CompletionResponse(
            id=rid,
            object="text_completion",
            created=created,
            model=model,
            choices=[completion_choice(c) for c in contents],
            usage=usage,
        )
    # The choices share one prompt: its logprobs go once, at the top (vLLM's place).
    prompt_logprobs = contents[0].prompt_logprobs if contents else None
    return ChatCompletionResponse(
        id=rid,
        object="chat.completion",
        created=created,
        model=model,
        choices=[chat_choice(c) for c in contents],
        usage=usage,
        **given(prompt_logprobs=prompt_logprobs),
    )


def stream_chunk(
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceContent],
    *,
    include_usage: bool,
    usage: Usage | None = None,
) -> CompletionChunk | ChatCompletionChunk:
    """One stream event's body. ``include_usage``: the request asked for usage, so every event carries it (null
    until the last, which has no choices)."""
    with_usage: dict[str, Any] = {"usage": usage} if include_usage else {}
    if kind == "completion":
        return CompletionChunk(
            id=rid,
            object="text_completion",
            created=created,
            model=model,
            choices=[completion_choice(c) for c in choices],
            **with_usage,
        )
    return ChatCompletionChunk(
        id=rid,
        object="chat.completion.chunk",
        created=created,
        model=model,
        choices=[chat_chunk_choice(c) for c in choices],
        **with_usage,
    )


# ---- the other endpoints ------------------------------------------------------------------


class ModelPermission(_Body):
    id: str
    object: Literal["model_permission"]
    created: int
    allow_create_engine: bool
    allow_sampling: bool
    allow_logprobs: bool
    allow_search_indices: bool
    allow_view: bool
    allow_fine_tuning: bool
    organization: str
    group: str | None
    is_blocking: bool


class ModelCard(_Body):
    """A model card as vLLM writes it (its benchmark client reads ``root``)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int
    permission: list[ModelPermission]


def model_card(name: str, root: str, max_model_len: int) -> ModelCard:
    permission = ModelPermission(
        id=f"modelperm-{name}",
        object="model_permission",
        created=0,
        allow_create_engine=False,
        allow_sampling=True,
        allow_logprobs=True,
        allow_search_indices=False,
        allow_view=True,
        allow_fine_tuning=False,
        organization="*",
        group=None,
        is_blocking=False,
    )
    return ModelCard(
        id=name,
        object="model",
        created=0,
        owned_by="shapeserve",
        root=root,
        parent=None,
        max_model_len=max_model_len,
        permission=[permission],
    )


class ModelList(_Body):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Body):
    prompt: str


class VersionResponse(_Body):
    version: str


class HealthResponse(_Body):
    status: Literal["ok", "unavailable"]
    #: The pools that cannot serve (when unavailable).
    missing: list[str] | None = None


# ---- run-batch ----------------------------------------------------------------------------


class BatchResponse(_Body):
    status_code: int
    request_id: str
    body: CompletionResponse | ChatCompletionResponse | ErrorResponse


class BatchLineError(_Body):
    code: str | None
    message: str


class BatchOutputLine(_Body):
    """One line of run-batch's output file (OpenAI's Batch API format)."""

    id: str
    #: As the input line gave it.
    custom_id: JsonValue
    response: BatchResponse
    error: BatchLineError | None
