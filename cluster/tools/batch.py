"""Offline batch inference in the OpenAI Batch file format (``shapeserve run-batch``).

Input: one JSON object per line, ``{"custom_id", "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}``. Output: one line per input line, in input order,
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``.
Every line runs through one engine with continuous batching. A line that cannot be parsed
or validated gets an error record; the other lines still run.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from pydantic import BaseModel

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.errors import ShapeserveError
from cluster.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from cluster.openai_responses import (
    BatchLineError,
    BatchOutputLine,
    BatchResponse,
    ChoiceContent,
    PromptEcho,
    PromptLogprobs,
    alternative_strings,
    error_response,
    new_id,
    prompt_echo,
    prompt_logprobs_body,
    response,
    token_strings,
    usage,
)
from cluster.prompting import encode_chat, encode_prompt
from cluster.scores import TokenScore
from cluster.tool_calls import ToolCall, ToolMode, parse_output, template_tools

_ENDPOINTS: dict[str, tuple[Literal["completion", "chat"], type[BaseModel]]] = {
    "/v1/completions": ("completion", CompletionRequest),
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
}


@dataclass
class _Line:
    index: int
    custom_id: Any
    kind: Literal["completion", "chat"] = "completion"
    request: BaseModel | None = None
    return_token_ids: bool = False
    want_logprobs: bool = False
    error: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    #: The sampled tokens' texts, for the logprobs body (filled when the line asked for logprobs).
    token_texts: list[str] = field(default_factory=list)
    want_alternatives: bool = False
    #: Per position, its most likely (token id, logprob) pairs, when the line asked for them ...
    alternatives: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    #: ... and the same with the tokens' texts, for the logprobs body.
    named_alternatives: list[list[tuple[str, float]]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    #: The engine's ``prompt_logprobs`` (when the line asked for them, or for echo with logprobs).
    prompt_scores: tuple[TokenScore, ...] = ()
    #: What the choice shows of the prompt: echoed text and tokens, vLLM's ``prompt_logprobs`` body.
    echo: PromptEcho | None = None
    prompt_logprobs_body: PromptLogprobs | None = None
    tool_mode: ToolMode = ToolMode("none")
    tool_call_parser: str | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


def _error(status: int, code: str, message: str) -> dict[str, Any]:
    return {"status_code": status, "code": code, "message": message}


def _parse_line(
    index: int, raw: str, engine: LLMEngine, model_name: str, tool_call_parser: str | None = None
) -> tuple[_Line, list[int], SamplingParams | None]:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return (
            _Line(index, None, error=_error(400, "invalid_json", f"line {index + 1} is not valid JSON: {e}")),
            [],
            None,
        )
    if not isinstance(obj, dict):
        return _Line(index, None, error=_error(400, "invalid_json", f"line {index + 1} is not a JSON object")), [], None
    line = _Line(index, obj.get("custom_id"))
    url, method, body = obj.get("url"), obj.get("method", "POST"), obj.get("body")
    if url not in _ENDPOINTS:
        line.error = _error(400, "invalid_url", f"url {url!r} is not supported; use one of {sorted(_ENDPOINTS)}")
        return line, [], None
    if method != "POST":
        line.error = _error(400, "invalid_method", f"method {method!r} is not supported; use POST")
        return line, [], None
    if not isinstance(body, dict):
        line.error = _error(400, "invalid_body", "body must be a JSON object")
        return line, [], None
    line.kind, model_cls = _ENDPOINTS[url]
    model = body.get("model", model_name)
    if model not in (model_name, str(engine.config.model)):
        line.error = _error(
            404, "model_not_found", f"the model {model!r} does not exist; this run serves {model_name!r}"
        )
        return line, [], None
    try:
        req = parse_body(json.dumps({**body, "model": model_name}).encode(), model_cls)
        if req.n > 1 or (isinstance(req, CompletionRequest) and len(req.prompts) > 1):
            # The server fans these out into several choices; a batch line is one sequence, so it says so.
            raise APIError(400, "run-batch takes one prompt and n=1 per line; write one line per choice", param="n")
        if isinstance(req, ChatCompletionRequest):
            line.tool_mode = req.tool_mode(tool_call_parser)
            tools = template_tools(line.tool_mode)
            prompt_ids = encode_chat(engine.tokenizer, req.conversation(), req.add_generation_prompt, tools)
        else:
            prompt_ids = encode_prompt(engine.tokenizer, req.prompt)
        default_max = max(1, engine.max_model_len - len(prompt_ids))
        params = req.sampling_params(
            default_max_tokens=min(16, default_max) if line.kind == "completion" else default_max
        )
        engine.check_request(prompt_ids, params)
    except APIError as e:
        line.error = _error(e.status, e.code or e.err_type, e.message)
        return line, [], None
    except ShapeserveError as e:
        line.error = _error(e.http_status, e.error_type, e.message)
        return line, [], None
    line.request = req
    line.return_token_ids = req.return_token_ids
    line.want_logprobs = params.logprobs
    line.want_alternatives = params.top_logprobs > 0
    line.num_prompt_tokens = len(prompt_ids)
    line.prompt_ids = prompt_ids
    return line, prompt_ids, params


def _record(line: _Line, model_name: str) -> BatchOutputLine:
    rid = f"batch_req_{uuid.uuid4().hex[:24]}"
    if line.error is not None:
        status, code, message = line.error["status_code"], line.error["code"], line.error["message"]
        err_type = "server_error" if status >= 500 else "invalid_request_error"
        return BatchOutputLine(
            id=rid,
            custom_id=line.custom_id,
            response=BatchResponse(
                status_code=status, request_id=rid, body=error_response(message, err_type, code=code)
            ),
            error=BatchLineError(code=code, message=message),
        )
    text, finish, calls = line.text, line.finish_reason, list[ToolCall]()
    if line.tool_mode.kind != "none":
        content, calls = parse_output(line.tool_mode, line.text, line.tool_call_parser)
        if calls:  # as the server answers: see router.server.RequestRun.collect_choice
            text = content or ""
            finish = "tool_calls" if line.tool_mode.kind != "named" else finish
    choice = ChoiceContent(
        index=0,
        text=text,
        finish_reason=finish,
        token_ids=line.token_ids if line.return_token_ids else None,
        logprobs=line.logprobs if line.want_logprobs else None,
        tokens=line.token_texts if line.want_logprobs else None,
        alternatives=line.named_alternatives,
        echo=line.echo,
        tool_calls=calls,
        prompt_logprobs=line.prompt_logprobs_body,
    )
    rid_body = new_id("cmpl" if line.kind == "completion" else "chatcmpl")
    body = response(
        line.kind,
        rid_body,
        model_name,
        [choice],
        usage(line.num_prompt_tokens, len(line.token_ids), line.num_cached_tokens),
    )
    return BatchOutputLine(
        id=rid,
        custom_id=line.custom_id,
        response=BatchResponse(status_code=200, request_id=rid, body=body),
        error=None,
    )


def run_batch(
    engine: LLMEngine,
    infile: TextIO,
    outfile: TextIO,
    model_name: str,
    progress: bool = False,
    tool_call_parser: str | None = None,
) -> tuple[int, int]:
    """Runs every line of ``infile``; writes records to ``outfile`` in input order. Returns (ok, failed).
    ``progress``: a progress bar on stderr (requests done, output tokens/s, ETA); ``tool_call_parser``: as
    ``shapeserve serve --tool-call-parser``."""
    from tqdm.auto import tqdm

    lines: list[_Line] = []
    for index, raw in enumerate(infile):
        if not raw.strip():
            continue
        line, prompt_ids, params = _parse_line(index, raw, engine, model_name, tool_call_parser)
        line.tool_call_parser = tool_call_parser
        lines.append(line)
        if params is not None:
            engine.add_request(str(index), prompt_ids, params)
    by_index = {str(line.index): line for line in lines}
    bar = tqdm(total=len(lines), desc="run-batch", unit="req", disable=not progress, file=sys.stderr)
    bar.update(sum(1 for line in lines if line.error is not None))  # refused lines are done
    tokens, t0 = 0, time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            line = by_index[out.request_id]
            line.token_ids.extend(out.new_token_ids)
            tokens += len(out.new_token_ids)
            line.text += out.new_text
            line.logprobs.extend(out.new_logprobs)
            line.alternatives.extend(out.new_top_logprobs)
            line.prompt_scores = out.prompt_logprobs or line.prompt_scores
            line.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                line.finish_reason = out.finish_reason
                bar.update(1)
                if out.error is not None:
                    line.error = _error(500, "engine_error", f"the engine failed on this request: {out.error}")
        if progress:
            bar.set_postfix_str(f"{tokens / max(time.monotonic() - t0, 1e-9):.0f} output tok/s", refresh=False)
    bar.close()
    for line in lines:
        if line.want_logprobs:
            line.token_texts = token_strings(engine.tokenizer, line.token_ids)
        if line.want_alternatives:
            line.named_alternatives = alternative_strings(engine.tokenizer, line.alternatives)
        req = line.request
        if isinstance(req, CompletionRequest) and req.echo:
            scores = line.prompt_scores if line.want_logprobs else None
            line.echo = prompt_echo(engine.tokenizer, req.prompts[0], line.prompt_ids, scores)
        if isinstance(req, (CompletionRequest, ChatCompletionRequest)) and req.prompt_logprobs is not None:
            line.prompt_logprobs_body = prompt_logprobs_body(engine.tokenizer, line.prompt_ids, line.prompt_scores)
    for line in lines:
        outfile.write(_record(line, model_name).to_json().decode() + "\n")
    failed = sum(1 for line in lines if line.error is not None)
    return len(lines) - failed, failed
