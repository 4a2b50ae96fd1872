"""The OpenAI-compatible requests: bodies validated once here (pydantic) and turned into the engine's frozen
``SamplingParams``; nothing past the edge sees a dict. Unknown fields are ignored (clients send many); a known
one that the server cannot honour (``best_of``, ``suffix``) is a 400 naming it. The responses are
``cluster.openai_responses``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.config import INT64_MAX, INT64_MIN, MAX_TOP_LOGPROBS, SamplingParams, StructuredOutput
from cluster.errors import InvalidRequestError
from cluster.grammar import check_structured
from cluster.openai_responses import ErrorResponse, error_response
from cluster.tool_calls import NamedToolChoice, Tool, ToolChoice, ToolMode, constraint, tool_mode

#: Most choices one request may ask for: ``n`` x the number of prompts (each is a sequence in the engine).
MAX_CHOICES = 64


def _refuse_bool(v: Any) -> Any:
    # pydantic's lax mode reads JSON true as 1; a boolean where a count belongs is a client bug to report, not a 1.
    if isinstance(v, bool):
        raise ValueError(f"must be an integer, not a boolean ({str(v).lower()})")
    return v


#: An integer field: a boolean is refused, a whole-number float (``2.0``) is still taken, as OpenAI does.
Integer = Annotated[int, BeforeValidator(_refuse_bool)]
#: A token id: an integer as JSON writes one, nothing converted (not ``true``, ``5.0`` or ``"5"``).
TokenId = StrictInt


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object with the schema under "schema"')
        return self


class StructuredOutputsParams(BaseModel):
    """vLLM's newer ``structured_outputs`` object: the same constraints as the ``guided_*`` fields."""

    model_config = ConfigDict(extra="forbid")  # e.g. structural_tag: not served, so a 400 rather than ignored
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    def constraints(self) -> list[StructuredOutput]:
        found = []
        if self.json_ is not None:
            try:
                schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            except ValueError:
                raise InvalidRequestError(
                    "structured_outputs.json must be a JSON schema", "structured_outputs"
                ) from None
            found.append(StructuredOutput.from_schema(schema))
        if self.regex is not None:
            found.append(StructuredOutput("regex", self.regex))
        if self.choice is not None:
            found.append(StructuredOutput("choice", json.dumps(self.choice)))
        if self.grammar is not None:
            found.append(StructuredOutput("grammar", self.grammar))
        if self.json_object:
            found.append(StructuredOutput("json_object"))
        return found


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


#: Field -> the values that ask for nothing (and so are accepted) of the fields refused by ``_CommonRequest``.
_NOT_YET_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "functions": ([],),  # the pre-tools function calling
    "function_call": ("none",),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "continue_final_message": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "truncate_prompt_tokens": (),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "modalities": (["text"],),
    "audio": (),
}


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    _constraint: StructuredOutput | None = PrivateAttr(default=None)
    _constraint_checked: bool = PrivateAttr(default=False)

    model: str
    max_tokens: Integer | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: Integer = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Integer | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # shapeserve extensions
    top_k: Integer = 0
    ignore_eos: bool = False
    return_token_ids: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: Integer = 0
    # Sampling extensions of vLLM's (and OpenAI's logit_bias), applied in the engine's batched sampler.
    logit_bias: dict[str, float] | None = None
    min_tokens: Integer = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    #: vLLM's: each prompt token's logprob (from the second on) with this many alternatives per position.
    prompt_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Structured output: OpenAI's response_format, or one of vLLM's guided_* extras (at most one constraint).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)
    structured_outputs: StructuredOutputsParams | None = None
    # Fields of the OpenAI API and vLLM's extensions that change the output and are not implemented yet: a request
    # that sets one to anything but its neutral value is refused with a 400 naming it, never silently ignored.
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    modalities: Any = None
    audio: Any = None

    @field_validator(*_NOT_YET_NEUTRAL)
    @classmethod
    def _refuse_what_would_be_ignored(cls, v: Any, info: ValidationInfo) -> Any:
        name = str(info.field_name)
        if v is not None and v not in _NOT_YET_NEUTRAL[name]:
            raise ValueError(
                f"{name} is not supported by this server yet; remove it (ignoring it would change the "
                "output you asked for)"
            )
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        # As vLLM: the prompt's logprobs are one body for the whole prompt, which no stream event carries.
        # (A streamed completions ``echo`` with ``logprobs`` does carry the prompt's, in its first event.)
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true; send stream false")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_only_streamed(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM: options for a stream that will not happen are the client's mistake, not a no-op.
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true; remove it or set stream true")
        return v

    @field_validator("priority")
    @classmethod
    def _priority_bounded(cls, v: int) -> int:
        # Only compared at admission today (it crosses no process), but an int64 wherever a priority is carried
        # (msgpack, protobuf, vLLM's scheduler): bounded at the edge, so no later use of it can overflow.
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"priority must be an integer from {INT64_MIN} to {INT64_MAX} (64-bit), got {v}")
        return v

    @field_validator("n")
    @classmethod
    def _choices_bounded(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_field(self) -> str:
        """The field the client gave the output budget in (errors about it name that one)."""
        return "max_tokens"

    def _want_logprobs(self) -> bool:
        return False

    def _top_logprobs(self) -> int:
        return 0

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _structured(self) -> StructuredOutput | None:
        """The one output constraint the request sets (InvalidRequestError when it sets several)."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            found.append(("response_format", StructuredOutput.from_schema(rf.json_schema.json_schema)))
        if self.guided_json is not None:
            schema = self.guided_json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise InvalidRequestError("guided_json must be a JSON schema (an object)", "guided_json") from None
            found.append(("guided_json", StructuredOutput.from_schema(schema)))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput("choice", json.dumps(self.guided_choice))))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        if self.structured_outputs is not None:
            found += [("structured_outputs", s) for s in self.structured_outputs.constraints()]
        if len(found) > 1:
            fields = list(dict.fromkeys(name for name, _ in found))
            if len(fields) == 1:
                message = f"{fields[0]} sets {len(found)} constraints on the output; send one of them"
            else:
                message = f"{' and '.join(fields)} each constrain the output; send one of them"
            raise InvalidRequestError(message, found[1][0])
        if not found:
            return None
        name, structured = found[0]
        structured = dataclasses.replace(structured, param=name)  # the engine's errors name it too
        check_structured(structured, name)  # the 400 names the field the client sent
        return structured

    def constrains_output(self) -> bool:
        """Whether a field asks for an output constraint (cheap: nothing is compiled)."""
        fields = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar, self.structured_outputs)
        return self.response_format is not None or any(f is not None for f in fields)

    def output_constraint(self) -> StructuredOutput | None:
        """The one output constraint the request sets, compiled and checked (InvalidRequestError naming its field).
        Kept once checked: the edge checks it on a worker thread, and ``sampling_params`` on the event loop must not
        compile it again (the compile cache holds a few specs only)."""
        if not self._constraint_checked:
            self._constraint = self._structured()
            self._constraint_checked = True
        return self._constraint

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's params; raises InvalidRequestError naming the bad field."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self._max_tokens()
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self._want_logprobs(),
            top_logprobs=self._top_logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            structured=self.output_constraint(),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            min_p=self.min_p,
        ).validate()


#: A ``logit_bias`` key: a token id in decimal digits, nothing else. ``int()`` alone also reads " 12", "+12", "1_2"
#: and other scripts' digits, which no client means as a token id.
_TOKEN_ID_KEY = re.compile(r"[0-9]+")


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as the engine's pairs; a key that is not a token id is a 400, and so are two
    keys naming one token ("12" and "012": the engine would add both biases)."""
    keys: dict[int, str] = {}
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidRequestError(
                f"logit_bias keys must be token ids written as decimal digits only (use /tokenize to find them), "
                f"got {key!r}",
                "logit_bias",
            )
        token = int(key)
        if token in keys:
            raise InvalidRequestError(
                f"logit_bias names token {token} twice ({keys[token]!r} and {key!r}); give each token once",
                "logit_bias",
            )
        keys[token] = key
        pairs.append((token, value))
    return tuple(pairs)


class CompletionRequest(_CommonRequest):
    #: A text or token ids, or a list of them (one choice per prompt, x ``n``); a list of one is unwrapped.
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    #: Completions' logprobs: the number of alternatives per position (0: the sampled token's logprob only).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this server yet; remove it")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        tokens = [t for p in v for t in (p if isinstance(p, list) else [p])] if isinstance(v, list) else []
        if any(isinstance(t, bool) for t in tokens):  # said here: the union's own error would ask for a string
            raise ValueError("token ids must be integers, not booleans")
        floats = [t for t in tokens if isinstance(t, float)]
        if floats:
            raise ValueError(f"token ids must be integers, got {floats[0]!r}")
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request; send more as separate requests")
            if any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
                raise ValueError("no prompt of the list may be empty")
        elif isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @model_validator(mode="after")
    def _total_choices_bounded(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one for a plain prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]  # type: ignore[list-item]

    def _want_logprobs(self) -> bool:
        return self.logprobs is not None

    def _top_logprobs(self) -> int:
        return self.logprobs or 0

    def _prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the prompt too, with the same number of alternatives."""
        if self.echo and self.logprobs is not None:
            return max(self.prompt_logprobs or 0, self.logprobs)
        return self.prompt_logprobs


#: The roles OpenAI's chat API defines; anything else is refused before it reaches a chat template.
ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    #: JSON text, as OpenAI sends it (a client may send an object).
    arguments: str | dict[str, Any] = "{}"


class _MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: ChatRole
    content: str | list[dict[str, Any]] | None = None
    #: An assistant turn's calls (tool-call history), passed to the chat template.
    tool_calls: list[_MessageToolCall] | None = None
    #: A ``tool`` turn: which call it answers.
    tool_call_id: str | None = None
    name: str | None = None

    def text(self, path: str = "content") -> str:
        """The content as one text; ValueError naming the part (``path``: where the content is, for the message)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for k, part in enumerate(self.content):
            if part.get("type") != "text":
                raise ValueError(f"{path}[{k}]: content part type {part.get('type')!r} is not supported (text only)")
            text = part.get("text")
            if not isinstance(text, str):  # str() would put "None" or a dict's repr into the prompt
                got = _json_type(text) if "text" in part else "nothing"
                raise ValueError(f"{path}[{k}].text must be a string, got {got}")
            parts.append(text)
        return "".join(parts)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, as a client wrote it."""
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "an array",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: role and text, and for tool-call history an assistant turn's
    ``tool_calls`` (arguments as an object: templates write them with ``tojson``) and a tool turn's
    ``tool_call_id``; InvalidRequestError for a content part that is not text."""
    try:
        return [_template_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    except ValueError as e:
        raise InvalidRequestError(str(e), "messages") from None


def _template_message(m: ChatMessage, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text(f"{path}.content")}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c.function)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _args(function: _CalledFunction) -> Any:
    if isinstance(function.arguments, dict):
        return function.arguments
    try:
        return json.loads(function.arguments)
    except ValueError:
        raise ValueError(
            f"the arguments of the call to {function.name!r} in messages are not JSON: {function.arguments!r}"
        ) from None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Integer | None = None
    logprobs: bool = False
    top_logprobs: Integer | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def tool_mode(self, parser: str | None) -> ToolMode:
        """How this request uses tools with the server's ``--tool-call-parser`` (InvalidRequestError when it
        cannot be served)."""
        return tool_mode(self.tools, self.tool_choice, parser, self.parallel_tool_calls)

    def constrains_output(self) -> bool:
        return super().constrains_output() or self._forces_tool_call()

    def _forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def _structured(self) -> StructuredOutput | None:
        own = super()._structured()
        forced = self._forces_tool_call()
        if not forced:
            return own
        if own is not None:
            raise InvalidRequestError("tool_choice already constrains the output; drop response_format", "tool_choice")
        forced_output = constraint(self.tool_mode(None))
        if forced_output is not None:
            forced_output = dataclasses.replace(forced_output, param="tools")
        check_structured(forced_output, "tools")  # a function's parameters that are no usable schema
        return forced_output

    def _want_logprobs(self) -> bool:
        return self.logprobs

    def _top_logprobs(self) -> int:
        return self.top_logprobs or 0

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages or [])


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt`` (text) or chat ``messages`` (rendered with the chat template)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, v: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if v is not None and not v:
            raise ValueError("give at least one message")
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) and 'messages' (a chat)")
        return self

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages or [])


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


# ---- errors ---------------------------------------------------------------------------


class APIError(Exception):
    """An error answered at the edge with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return error_response(self.message, self.err_type, self.param, self.code)


#: What pydantic puts in an error's ``loc`` for the member of a union it tried (``str``, ``list[int]``,
#: ``NamedToolChoice``, ``literal[...]``): never a field a client wrote (this API's fields are snake_case).
_UNION_MEMBER = re.compile(r"str|int|float|bool|none|[A-Z].*|.*[^A-Za-z0-9_].*")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``loc`` as the client wrote the field: ``messages[0].role``, ``response_format.json_schema.schema``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _UNION_MEMBER.fullmatch(part):
            path += f".{part}" if path else part
    return path


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400: ``param`` is the top-level field, the message names the exact one
    (``tools[0].function``: the top-level field alone would point at one the client did send)."""
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    path = _field_path(err["loc"]) or param
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"].startswith("int_parsing") and not isinstance(err["input"], str):
        # pydantic says "Unable to parse input string" of a number too large (1e308) for an integer.
        msg = f"must be an integer, got {err['input']!r}"
    if err["type"] == "missing":
        msg = f"missing required field {path!r}"
    elif path is not None:
        msg = f"invalid value for {path!r}: {msg}"
    else:
        msg = f"invalid request: {msg}"
    return APIError(400, msg, "invalid_request_error", param, err["type"])


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Bytes -> validated request model; APIError(400) on malformed JSON or bad fields."""
    too_deep = APIError(
        400, "request body is nested too deeply; no field of this API nests that far", code="invalid_json"
    )
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None
    except RecursionError:
        raise too_deep from None
