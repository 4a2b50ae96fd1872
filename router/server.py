"""The HTTP edge: the OpenAI-compatible API, served by the replica that owns the request's stream.

Per request: read the body (bounded) -> validate (pydantic, 400s) -> tokenize (long text off the
event loop) -> ``plan_request`` (pure: parameters, geometry, route, or 429) -> admit -> hand the
``GenerateTask`` to the backend (the decode worker in this process) -> stream. The response is
committed only after the backend accepted the request (``Started``), so errors before that are
plain HTTP errors even for streaming requests; after it, a stream ends with an error event.
The client-side clock (TTFT, TPOT, inter-token latency, e2e, queue time) runs here.

Outputs arrive a batch per engine step and leave as one SSE event per step (``router.streaming``).
A client disconnect cancels the response, which closes the backend's generator: the request is
aborted and its blocks freed on every side. This module imports no torch: the edge can run
without the engine's code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.metadata
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from cluster.config import ModelConfig, served_context_length
from cluster.errors import ShapeserveError
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from cluster.openai_responses import (
    ChatCompletionResponse,
    ChoiceContent,
    CompletionResponse,
    DetokenizeResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    PromptEcho,
    TokenizeResponse,
    TypedJSONResponse,
    Usage,
    VersionResponse,
    alternative_strings,
    error_response,
    given,
    model_card,
    prompt_echo,
    prompt_logprobs_body,
    response,
    stream_chunk,
    token_strings,
    usage,
)
from cluster.prompting import check_text_fits, encode_chat, encode_prompt, max_chars_per_token
from cluster.serving.config import ServeConfig
from cluster.serving.messages import GenerateTask, ReplicaStats, Route, Started
from cluster.serving.metrics import RequestTiming, RouterMetrics
from cluster.serving.pool_board import board_call_timeout_s, board_stale_after_s, fresh_reports
from cluster.serving.tracing import RequestTrace
from cluster.tokenizer import load_tokenizer
from cluster.tool_calls import ToolCall, ToolMode, parse_output, template_tools
from router import choices
from router.admission import AdmissionController, PrefixEstimator, Ticket
from router.api_key import APIKeyMiddleware
from router.plan import ModelLimits, RequestPlan, plan_request, rejection, user_error
from router.request_ids import RequestIdentity, is_retry, request_id
from router.streaming import DONE, ChunkEncoder, sse_event

if TYPE_CHECKING:
    from cluster.engine.llm_engine import RequestOutput
    from cluster.scores import TokenScore

log = logging.getLogger("ray.serve")

try:
    _VERSION = importlib.metadata.version("shapeserve")
except importlib.metadata.PackageNotFoundError:  # running from a checkout that was not installed
    _VERSION = "0+unknown"

#: While clients refused earlier are due back (``RetryAppointments``), a new request is admitted against this
#: fraction of the TTFT and TPOT targets: it takes only room the returning clients would not need.
HELD_ROOM_TARGET_SCALE = 0.75

#: Prompts longer than this (characters) are tokenized on a worker thread, not on the event loop:
#: a long tokenization must not stall every other request's streaming.
TOKENIZE_INLINE_MAX_CHARS = 8192


class GenerationBackend(Protocol):
    """What the edge needs of the decode worker it fronts."""

    replica_id: str

    def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        """``Started``, then batches of outputs until the finished one; closing it aborts the request."""

    def check_health(self) -> None:
        """Raises if the engine cannot serve."""


class OpenAIServer:
    """One per decode replica. ``asgi_app()`` is what Serve serves (directly, with direct ingress)."""

    def __init__(
        self,
        config: ServeConfig,
        model_dir: str,
        backend: GenerationBackend,
        board=None,
        disaggregated: bool = True,
        tokenizer=None,
        metrics_scope: str = "replica",
    ):
        self.config = config
        self.model_dir = model_dir
        self.backend = backend
        self.board = board
        self.disaggregated = disaggregated
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        if config.chat_template is not None:  # --chat-template: replaces the tokenizer's own for every chat request
            self.tokenizer.chat_template = config.chat_template
        model = ModelConfig.from_pretrained(model_dir)
        self.limits = ModelLimits(model.vocab_size, served_context_length(model, config.max_model_len))
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        keep_slo = config.admission.admit_within_slo
        self.admission = AdmissionController(
            config.admission,
            ttft_target_s=config.slo.ttft_ms / 1000 if keep_slo else None,
            tpot_target_s=config.slo.tpot_ms / 1000 if keep_slo else None,
        )
        self.prefix = PrefixEstimator()
        self.pool_stats: list[ReplicaStats] = []
        self._stats_at = 0.0
        self._refreshing: asyncio.Task | None = None
        #: "cluster" in a serving cluster: every replica's page is the whole cluster's (``RouterMetrics``).
        self.metrics = RouterMetrics(
            config.slo, stats_source=lambda: self.pool_stats, model_name=config.model_name, scope=metrics_scope
        )
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        #: Spreads Retry-After over clients refused together (``router.plan.rejection``).
        self._retry_rng = random.Random()

    # ---- the ASGI app -------------------------------------------------------------------------

    def asgi_app(self) -> FastAPI:
        # No /docs or /openapi.json: a production endpoint does not publish its internals. No redirects to the
        # other spelling of a path either: ``TrailingSlashOptional`` serves both.
        app = FastAPI(title="shapeserve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
        app.add_exception_handler(APIError, _api_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(Exception, _internal_error)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model_card, methods=["GET"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        app.add_api_route("/version", self.version, methods=["GET"])
        # HEAD too: load balancers that probe with it (HAProxy's default check) would read a 405 as "down".
        app.add_api_route("/ping", self.health, methods=["GET", "HEAD", "POST"])  # vLLM's (and SageMaker's) probe
        app.add_api_route("/health", self.health, methods=["GET", "HEAD"])
        app.add_api_route("/metrics", self.metrics_page, methods=["GET"])
        app.add_api_route("/admin/pools", self.admin_pools, methods=["GET"])
        if self.config.api_key:
            app.add_middleware(APIKeyMiddleware, api_key=self.config.api_key)
        app.add_middleware(TrailingSlashOptional)  # outermost: the key check and the routes see one spelling
        return app

    # ---- pool state ---------------------------------------------------------------------------

    async def _refresh_pools(self) -> list[ReplicaStats]:
        if self.board is not None:
            period_s = self.config.routing_stats_period_s
            try:
                self.pool_stats = await asyncio.wait_for(self.board.snapshot.remote(), board_call_timeout_s(period_s))
            except Exception as e:  # noqa: BLE001
                # The board is away (Serve is restarting it, or its node is gone): answer from the last snapshot,
                # less what the board itself would have dropped by now, so a dead pool does not look alive.
                self.pool_stats = fresh_reports(self.pool_stats, board_stale_after_s(period_s))
                log.warning("the pool board did not answer (%r); %d replica reports kept", e, len(self.pool_stats))
        self._stats_at = time.monotonic()
        return self.pool_stats

    def _maybe_refresh(self) -> None:
        stale = time.monotonic() - self._stats_at > self.config.routing_stats_period_s
        if stale and self.board is not None and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_pools())

    def _prefill_up(self) -> bool:
        if not self.disaggregated:
            return False
        # Before the first pool report arrives, assume the prefill pool is there.
        return not self.pool_stats or any(s.pool == "prefill" and s.healthy for s in self.pool_stats)

    # ---- endpoints ----------------------------------------------------------------------------

    async def health(self) -> Response:
        missing = []
        try:
            self.backend.check_health()
        except Exception:  # noqa: BLE001
            missing.append("decode")
        if self.disaggregated:
            await self._refresh_pools()
            if not any(s.pool == "prefill" and s.healthy for s in self.pool_stats):
                missing.append("prefill")
        if missing:
            return TypedJSONResponse(HealthResponse(status="unavailable", missing=missing), status_code=503)
        return TypedJSONResponse(HealthResponse(status="ok"))

    async def metrics_page(self) -> Response:
        await self._refresh_pools()
        # The cluster scope reads every node's Ray endpoint: on a thread, so streams keep flowing meanwhile.
        page = await asyncio.to_thread(self.metrics.render) if self.metrics.reader else self.metrics.render()
        return Response(page, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def admin_pools(self) -> Response:
        if not self.config.enable_admin_api:
            raise APIError(404, "the admin API is disabled (enable_admin_api: false)", "not_found_error")
        stats = await self._refresh_pools()
        return JSONResponse({"replicas": [s.as_dict() for s in stats]})

    def _card(self, name: str) -> ModelCard:
        return model_card(name, self.model_dir, self.limits.max_model_len)

    async def models(self) -> Response:
        return TypedJSONResponse(ModelList(object="list", data=[self._card(n) for n in self.config.served_model_names]))

    async def model_card(self, model_id: str) -> Response:
        return TypedJSONResponse(self._card(self._check_model(model_id)))

    async def version(self) -> Response:
        return TypedJSONResponse(VersionResponse(version=_VERSION))

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = parse_body(await self._read_body(request), TokenizeRequest)
        if req.model is not None:
            self._check_model(req.model)
        if req.messages is not None:
            conversation = _user_errors(req.conversation)
            size = sum(len(m["content"]) for m in conversation)
            encode = lambda: encode_chat(self.tokenizer, conversation, req.add_generation_prompt)  # noqa: E731
            tokens = await self._encode(encode, size, "messages")
        else:
            text = req.prompt or ""
            encode = functools.partial(encode_prompt, self.tokenizer, text, req.add_special_tokens)
            tokens = await self._encode(encode, len(text), "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        body = TokenizeResponse(
            count=len(tokens), max_model_len=self.limits.max_model_len, tokens=tokens, **given(token_strs=strs)
        )
        return TypedJSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = parse_body(await self._read_body(request), DetokenizeRequest)
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return TypedJSONResponse(DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)))

    async def completions(self, request: Request) -> Response:
        received_ns, base_id = time.time_ns(), request_id(request)
        req: CompletionRequest = parse_body(await self._read_body(request), CompletionRequest)
        name = self._check_model(req.model)
        prompts = []
        for p in req.prompts:
            size = len(p) if isinstance(p, str) else 0
            prompts.append(await self._encode(functools.partial(encode_prompt, self.tokenizer, p), size, "prompt"))
        return await self._serve(
            "completion", req, prompts, name, RequestIdentity(base_id, received_ns, is_retry(request))
        )

    async def chat_completions(self, request: Request) -> Response:
        received_ns, base_id = time.time_ns(), request_id(request)
        req: ChatCompletionRequest = parse_body(await self._read_body(request), ChatCompletionRequest)
        name = self._check_model(req.model)
        conversation = _user_errors(req.conversation)
        tools = template_tools(_user_errors(lambda: req.tool_mode(self.config.tool_call_parser)))
        size = sum(len(m["content"]) for m in conversation) + len(json.dumps(tools) if tools else "")
        prompt = await self._encode(
            lambda: encode_chat(self.tokenizer, conversation, req.add_generation_prompt, tools), size, "messages"
        )
        return await self._serve("chat", req, [prompt], name, RequestIdentity(base_id, received_ns, is_retry(request)))

    # ---- one request --------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, read no further than ``max_request_body_bytes`` (413 past it: a huge body must not
        cost the replica its memory)."""
        limit = self.config.max_request_body_bytes
        too_large = APIError(
            413,
            f"the request body is larger than this server's limit of {limit} bytes; send a shorter prompt "
            "(the operator can raise max_request_body_bytes)",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            # The client went away mid-body: not a server error. 499, as Serve answers a client that disconnects
            # while its request runs (nobody reads it; Serve's access log and metrics count it as such).
            raise APIError(
                499, "the client disconnected before sending the whole request body", code="client_disconnected"
            ) from None
        return b"".join(chunks)

    def _check_model(self, model: str) -> str:
        """The served name a request for ``model`` is answered under (404 for a model this server does not serve)."""
        names = self.config.served_model_names
        if model in names:
            return model
        if model == self.model_dir:
            return names[0]
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(map(repr, names))}",
            "not_found_error",
            "model",
            "model_not_found",
        )

    async def _encode(self, fn: Callable[[], list[int]], num_chars: int, param: str) -> list[int]:
        """Tokenizes (or renders the chat template): text that cannot fit the context is refused first, and
        long text is tokenized off the event loop."""
        _user_errors(lambda: check_text_fits(num_chars, self.chars_per_token, self.limits.max_model_len, param))
        if num_chars <= TOKENIZE_INLINE_MAX_CHARS:
            return _user_errors(fn)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, _user_errors, fn)

    def _plan(self, kind: str, req, prompt: list[int], retrying: bool = False) -> RequestPlan:
        """The request's plan on the admission state now; the 429 when its class is full, when it would miss
        the SLO, or when the room is held for clients coming back after a 429 (``retrying``: this is one)."""
        self._maybe_refresh()
        appointments = self.admission.appointments
        now = self.admission.clock()
        if retrying:
            appointments.keep(now)
        held = not retrying and appointments.due(now)
        load = self.admission.snapshot(self._prefill_up())
        if held:  # a new request while clients come back: it gets only what they leave (a stricter target)
            load = load.stricter(HELD_ROOM_TARGET_SCALE)
        plan = plan_request(kind, req, prompt, self.limits, self.config, load, self.prefix.cached_blocks, req.priority)
        if plan.route is Route.REJECT:
            self.metrics.rejected.labels(plan.decision.route_class.value).inc()
            self.metrics.errors.labels("429").inc()
            raise rejection(plan, self.config, self._retry_rng, self.admission.appointment)
        return plan

    async def _serve(
        self, kind: str, req, prompts: list[list[int]], model_name: str, identity: RequestIdentity
    ) -> Response:
        arrival = time.monotonic()
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{identity.base_id}"
        trace = RequestTrace(
            f"/v1/{'completions' if kind == 'completion' else 'chat/completions'}",
            identity.received_ns,
            {"shapeserve.request_id": rid, "gen_ai.request.model": model_name, "shapeserve.prompts": len(prompts)},
        )
        try:
            retrying = identity.retrying
            if req.constrains_output():
                # A large grammar takes seconds to compile (llguidance drops the GIL meanwhile): on a worker thread,
                # not on this loop, where every stream of the replica would wait. The request keeps the result.
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._tokenize_pool, _user_errors, req.output_constraint)
            if len(prompts) > 1 or req.n > 1:
                return await self._serve_choices(kind, req, prompts, model_name, rid, arrival, trace, retrying)
            return await self._serve_one(kind, req, prompts[0], model_name, rid, arrival, trace, retrying)
        except BaseException as e:
            # Ends the trace of a request that failed before its runs did (a no-op once they ended it).
            trace.end(error=f"{e.status} {e.message}" if isinstance(e, APIError) else repr(e))
            raise

    async def _serve_one(
        self,
        kind: str,
        req,
        prompt: list[int],
        model_name: str,
        rid: str,
        arrival: float,
        trace: RequestTrace,
        retrying: bool,
    ) -> Response:
        admitting = time.time_ns()
        try:
            plan = self._plan(kind, req, prompt, retrying)
        except APIError as e:
            trace.admission(admitting, error=e.message)
            raise
        run = RequestRun(self, kind, req, rid, plan, arrival, model_name, trace=trace)
        trace.admission(
            admitting, {"shapeserve.route": plan.route.value, "shapeserve.cost_tokens": plan.geometry.cost_tokens}
        )
        started = await run.start()
        # (Serve adds the request's x-request-id header itself: the same id, see router.request_ids.)
        headers = {"x-shapeserve-route": started.route.value}
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
        try:
            body = await run.collect()
        except APIError as e:
            e.headers.update(headers)
            raise
        return TypedJSONResponse(body, headers=headers)

    async def _serve_choices(
        self,
        kind: str,
        req,
        prompts: list[list[int]],
        model_name: str,
        rid: str,
        arrival: float,
        trace: RequestTrace,
        retrying: bool,
    ) -> Response:
        """Several choices (a list of prompts, ``n`` > 1): one engine request each, admitted one after the other
        (the 429 of any ends those already admitted), answered as one response whose choices carry
        ``index = prompt number x n + sequence number``. With a seed, sequence j samples with seed + j."""
        if req.stream and kind == "chat" and req.tool_mode(self.config.tool_call_parser).kind != "none":
            raise APIError(400, "n > 1 with tools cannot be streamed yet; send stream false", param="n")
        runs: list[RequestRun] = []
        admitting = time.time_ns()
        try:
            for i, prompt in enumerate(prompts):
                for j in range(req.n):
                    try:
                        plan = self._plan(kind, req, prompt, retrying)
                    except APIError as e:
                        trace.admission(admitting, error=e.message)
                        raise
                    if j and plan.params.seed is not None:
                        params = dataclasses.replace(plan.params, seed=choices.sequence_seed(plan.params.seed, j))
                        plan = dataclasses.replace(plan, params=params)
                    runs.append(RequestRun(self, kind, req, rid, plan, arrival, model_name, i * req.n + j, trace))
            trace.admission(admitting, {"shapeserve.sequences": len(runs)})
            started = await choices.start_all(runs)
        except BaseException:
            await choices.end_all(runs)
            raise
        headers = {"x-shapeserve-route": ",".join(sorted({s.route.value for s in started}))}
        if req.stream:
            return StreamingResponse(choices.stream_all(runs, req.n), media_type="text/event-stream", headers=headers)
        try:
            contents = await choices.collect_all(runs)
        except APIError as e:
            e.headers.update(headers)
            raise
        body = response(kind, rid, model_name, contents, choices.total_usage(runs, req.n))  # type: ignore[arg-type]
        return TypedJSONResponse(body, headers=headers)

    def upstream_error(self, e: BaseException) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, ShapeserveError):
            return user_error(e)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            self.metrics.errors.labels("504").inc()
            return APIError(504, "the request passed its deadline", "timeout_error", code="timeout")
        log.warning("decode worker failed: %r", e)
        self.metrics.errors.labels("503").inc()
        return APIError(
            503,
            f"the decode worker could not serve the request: {type(e).__name__}",
            "server_error",
            code="unavailable",
        )


class RequestRun:
    """One admitted request: its admission ticket, its backend stream and its client-side timing.
    ``start()`` then ``sse()`` or ``collect()``; the ticket, the stream and the metrics end exactly once."""

    def __init__(
        self,
        server: OpenAIServer,
        kind: str,
        req,
        rid: str,
        plan: RequestPlan,
        arrival: float,
        model_name: str,
        index: int = 0,
        trace: RequestTrace | None = None,
    ):
        self.s = server
        self.model_name = model_name
        #: How a chat request uses tools (checked at the edge already).
        self.tool_mode = req.tool_mode(server.config.tool_call_parser) if kind == "chat" else ToolMode("none")
        #: The choice's ``index`` in the response (prompt number x n + sequence number).
        self.index = index
        self.kind = kind
        self.req = req
        self.rid = rid
        self.plan = plan
        g = plan.geometry
        self.ticket: Ticket = server.admission.admit(plan.route, g.cost_tokens, g.uncached_tokens)
        server.prefix.record(plan.block_hashes)
        self.timing = RequestTiming(arrival=arrival, route=plan.route.value)
        #: The HTTP request's trace (shared by its choices); ``None`` outside ``OpenAIServer._serve``.
        self.trace = trace
        if trace is not None:
            trace.run_started()
        task = GenerateTask(
            # Unique per choice whatever the client's X-Request-Id (clients and proxies may send one id for many
            # requests): 48 random bits, so ids of requests in flight together never meet on a decode replica.
            request_id=f"{rid}-{uuid.uuid4().hex[:12]}",
            prompt_token_ids=plan.prompt_token_ids,
            params=plan.params,
            route=plan.route,
            deadline=time.time() + server.config.timeouts.request_timeout_s,
            block_hashes=plan.block_hashes,
            trace_context=trace.context if trace is not None else (),
        )
        self.stream = server.backend.generate(task)
        self.num_output = 0
        self.num_cached = 0
        self._ended = False

    async def start(self) -> Started:
        """Waits until the backend took the request; an error here is an HTTP error (nothing committed yet)."""
        try:
            first = await anext(self.stream)
        except BaseException as e:
            await self._end("error" if not isinstance(e, asyncio.CancelledError) else "cancelled")
            if isinstance(e, (asyncio.CancelledError, APIError)):
                raise
            raise self.s.upstream_error(e) from None
        if not isinstance(first, Started):  # pragma: no cover - the backend contract
            await self._end("error")
            raise APIError(500, "the decode worker answered out of order", "server_error")
        self.timing.started = time.monotonic()
        return first

    async def batches(self) -> AsyncGenerator[Sequence[RequestOutput], None]:
        """The request's outputs a step at a time; always ends the stream, the ticket and the metrics."""
        outcome = "error"
        try:
            async for batch in self.stream:
                assert not isinstance(batch, Started)
                last = batch[-1]
                if last.error is not None and last.error_param is not None:  # its own input failed it mid-output
                    raise APIError(400, last.error, "invalid_request_error", last.error_param or None)
                if last.error is not None:  # the engine failed on this request (only this one)
                    self.s.metrics.errors.labels("500").inc()
                    raise APIError(
                        500, f"the engine failed while generating this request: {last.error}", "server_error"
                    )
                now, n = time.monotonic(), sum(len(o.new_token_ids) for o in batch)
                if self.timing.first_token is None:  # its prefill is done: it leaves its class's prefill queue
                    self.s.admission.first_token(self.ticket)
                elif self.timing.last_token is not None and n:
                    self.s.admission.tokens_streamed(now - self.timing.last_token, n)
                self.s.metrics.observe_token(self.timing, now, n)
                self.num_output = last.num_output_tokens
                self.num_cached = last.num_cached_tokens
                yield batch
                if last.finished:
                    outcome = "ok" if last.finish_reason != "abort" else "aborted"
                    return
            raise APIError(503, "the decode worker ended the stream early", "server_error")
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.s.upstream_error(e) from None
        finally:
            await self._end(outcome)

    async def _end(self, outcome: str) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            await self.stream.aclose()  # the backend's finally: abort, free the blocks
        finally:
            reached = self.timing.first_token is not None
            self.s.admission.release(self.ticket, len(self.plan.prompt_token_ids) + self.num_output, reached)
            self.s.metrics.observe_finished(self.timing, outcome, len(self.plan.prompt_token_ids))
            if self.trace is not None:
                self.trace.run_ended(outcome, self.timing.route, self.num_output)

    def _usage(self) -> Usage:
        return usage(len(self.plan.prompt_token_ids), self.num_output, self.num_cached)

    async def collect(self) -> CompletionResponse | ChatCompletionResponse:
        content = await self.collect_choice()
        return response(self.kind, self.rid, self.model_name, [content], self._usage())  # type: ignore[arg-type]

    def _echo(self, scores: Sequence[TokenScore] | None) -> PromptEcho | None:
        """Completions' ``echo``: the prompt this choice answers, with its logprobs when the request asks for
        logprobs (``scores``: the engine's, from the request's first output)."""
        if self.kind != "completion" or not self.req.echo:
            return None
        prompt = self.req.prompts[self.index // self.req.n]
        want = self.req._want_logprobs()
        return prompt_echo(self.s.tokenizer, prompt, self.plan.prompt_token_ids, (scores or ()) if want else None)

    async def collect_choice(self) -> ChoiceContent:
        """The whole choice, once the request finished (raises APIError if it failed)."""
        text: list[str] = []
        ids: list[int] = []
        lps: list[float] = []
        alternatives: list[tuple[tuple[int, float], ...]] = []
        prompt_scores = None
        finish = None
        async with aclosing(self.batches()) as batches:
            async for batch in batches:
                for out in batch:
                    text.append(out.new_text)
                    ids.extend(out.new_token_ids)
                    lps.extend(out.new_logprobs)
                    alternatives.extend(out.new_top_logprobs)
                    prompt_scores = prompt_scores or out.prompt_logprobs
                finish = batch[-1].finish_reason
        tok, want_logprobs = self.s.tokenizer, self.req._want_logprobs()
        prompt_ids = self.plan.prompt_token_ids
        content, calls = "".join(text), list[ToolCall]()
        if self.tool_mode.kind != "none":
            found, calls = parse_output(self.tool_mode, content, self.s.config.tool_call_parser)
            if calls:
                content = found or ""
                # OpenAI: "tool_calls" when the model chose to call; a forced function ends with "stop".
                finish = "tool_calls" if self.tool_mode.kind != "named" else finish
        return ChoiceContent(
            index=self.index,
            text=content,
            finish_reason=finish,
            token_ids=ids if self.req.return_token_ids else None,
            logprobs=lps if want_logprobs else None,
            tokens=token_strings(tok, ids) if want_logprobs else None,
            alternatives=alternative_strings(tok, alternatives) if self.req._top_logprobs() else None,
            echo=self._echo(prompt_scores),
            tool_calls=calls,
            prompt_logprobs=(
                prompt_logprobs_body(tok, prompt_ids, prompt_scores or ())
                if self.req.prompt_logprobs is not None
                else None
            ),
        )

    def encoder(self, created: int) -> ChunkEncoder:
        return ChunkEncoder(
            self.kind,  # type: ignore[arg-type]
            self.rid,
            self.model_name,
            created,
            logprobs=self.req._want_logprobs(),
            token_ids=self.req.return_token_ids,
            include_usage=self.req.include_usage,
            token_text=lambda ids: token_strings(self.s.tokenizer, ids),
            index=self.index,
            alternatives_text=(lambda alts: alternative_strings(self.s.tokenizer, alts))
            if self.req._top_logprobs()
            else None,
        )

    async def chunks(self, encoder: ChunkEncoder) -> AsyncGenerator[bytes, None]:
        """The request's SSE events, one per engine step (raises APIError when it fails)."""
        first = True
        async with aclosing(self.batches()) as batches:
            async for batch in batches:
                # The prompt's scores come with the request's first output.
                yield encoder.chunk(batch, self._echo(batch[0].prompt_logprobs) if first else None)
                first = False

    async def sse(self) -> AsyncIterator[bytes]:
        if self.tool_mode.kind != "none":
            async for event in self._buffered_sse():
                yield event
            return
        encoder = self.encoder(int(time.time()))
        try:
            async with aclosing(self.chunks(encoder)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except APIError as e:
            yield sse_event(e.body()) + DONE
            return
        yield (encoder.usage(self._usage()) if self.req.include_usage else b"") + DONE

    async def _buffered_sse(self) -> AsyncIterator[bytes]:
        """A chat stream with tools: calls can only be parsed from the whole output, so the choice is sent as one
        delta (content and/or tool_calls) once the output is complete."""
        try:
            content = await self.collect_choice()
        except APIError as e:
            yield sse_event(e.body()) + DONE
            return
        created, include_usage, name = int(time.time()), self.req.include_usage, self.model_name
        events = [stream_chunk("chat", self.rid, name, created, [content], include_usage=include_usage)]
        if include_usage:
            events.append(stream_chunk("chat", self.rid, name, created, [], include_usage=True, usage=self._usage()))
        yield b"".join(b"data: " + e.to_json() + b"\n\n" for e in events) + DONE


class TrailingSlashOptional:
    """Serves every route with or without one trailing slash (``/v1/completions/`` is ``/v1/completions``).
    Starlette answers the other spelling with a 307 redirect: not every client resends a POST's body to it, and its
    Location is built from the request as this server saw it (``http://`` behind a TLS-terminating proxy, where a
    client drops the Authorization header). A plain ASGI middleware: it changes the path only."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path[:-1]}
            raw = scope.get("raw_path")
            if isinstance(raw, bytes) and raw.endswith(b"/"):
                scope["raw_path"] = raw[:-1]
        await self.app(scope, receive, send)


def _user_errors(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ShapeserveError as e:
        raise user_error(e) from None


# ---- error bodies (OpenAI's shape on every error) ----------------------------------------------


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, APIError)
    return TypedJSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, StarletteHTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
    message = {
        404: f"no route {request.url.path!r}; see /v1/models, /v1/completions, /v1/chat/completions",
        405: f"{request.method} is not allowed on {request.url.path!r}",
    }.get(e.status_code, str(e.detail))
    headers = getattr(e, "headers", None)
    return TypedJSONResponse(error_response(message, kind), status_code=e.status_code, headers=headers)


async def _validation_error(request: Request, e: Exception) -> Response:
    return TypedJSONResponse(error_response(f"invalid request: {e}", "invalid_request_error"), status_code=400)


async def _internal_error(request: Request, e: Exception) -> Response:
    log.exception("unhandled error")
    return TypedJSONResponse(error_response(f"internal error: {type(e).__name__}", "server_error"), status_code=500)
