"""The HTTP ingress: OpenAI-compatible API, classification, admission, streaming.

Per request: validate the body (pydantic, 400s) -> tokenize -> check the context window ->
classify by geometry (LOCAL / REMOTE / REJECT = 429 + Retry-After) -> admit -> stream from
a decode replica (chosen by Serve's ``DecodeRequestRouter``). The response is committed
only after the decode replica accepted the request, so errors before that are plain HTTP
errors even for streaming requests; after it, a stream ends with an error event. The
client-side clock (TTFT, TPOT, inter-token latency, e2e, queue time) runs here.
A client disconnect cancels the handler, which cancels the decode call (and through it the
prefill call): every side frees the request's blocks.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from cluster.config import ModelConfig
from cluster.prefix_hash import hash_full_blocks
from cluster.engine.llm_engine import RequestOutput
from cluster.tokenizer import load_tokenizer
from cluster.errors import ShapeserveError
from cluster.serving.metrics import ReplicaStats, RequestTiming, RouterMetrics
from cluster.prompting import check_text_fits, encode_chat, encode_prompt, max_chars_per_token
from cluster.serving.config import ServeConfig
from cluster.serving.messages import GenerateTask, Started
from router.admission import AdmissionController, PrefixEstimator
from router.classifier import RequestGeometry, Route, classify
from cluster.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    completion_choice,
    error_body,
    new_id,
    parse_body,
    response_envelope,
    sse,
    usage,
)

log = logging.getLogger("ray.serve")

#: Prompts longer than this (characters) are tokenized on a worker thread, not on the event loop:
#: a long tokenization must not stall every other request's streaming.
TOKENIZE_INLINE_MAX_CHARS = 8192

app = FastAPI(title="shapeserve")


@app.exception_handler(APIError)
async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


def _user_error(e: ShapeserveError) -> APIError:
    return APIError(e.http_status, e.message, e.error_type, e.param)


def _cause(e: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers (RayTaskError keeps it as ``cause``)."""
    return getattr(e, "cause", None) or e


class _Run:
    """One admitted request's stream from the decode replica to the client."""

    def __init__(self, router: "Router", kind, req, rid, prompt, gen, ticket, timing: RequestTiming, first):
        self.r = router
        self.kind = kind
        self.req = req
        self.rid = rid
        self.prompt = prompt
        self.gen = gen
        self.ticket = ticket
        self.timing = timing
        self.first = first
        self.model = router.config.model_name
        self.num_output = 0
        self.num_cached = 0
        self.done = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every RequestOutput of the request; always cancels the decode call and returns the budget."""
        outcome = "error"
        try:
            pending = [self.first]
            while True:
                item = pending.pop() if pending else await self.gen.__anext__()
                if isinstance(item, Started):
                    self.timing.started = self.timing.started or time.monotonic()
                    continue
                if item.error is not None:  # the engine failed on this request (only this one)
                    self.r.metrics.errors.labels("500").inc()
                    raise APIError(
                        500, f"the engine failed while generating this request: {item.error}", "server_error"
                    )
                self.r.metrics.observe_token(self.timing, time.monotonic(), len(item.new_token_ids))
                self.num_output = item.num_output_tokens
                self.num_cached = item.num_cached_tokens
                yield item
                if item.finished:
                    outcome = "ok" if item.finish_reason != "abort" else "aborted"
                    self.done = True
                    return
        except StopAsyncIteration:
            outcome = "error"
            raise APIError(503, "the decode replica ended the stream early", "server_error") from None
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.r._upstream_error(_cause(e)) from None
        finally:
            if not self.done:
                self.gen.cancel()
            self.r.admission.release(self.ticket, len(self.prompt) + self.num_output)
            self.r.metrics.observe_finished(self.timing, outcome, len(self.prompt))

    def _usage(self) -> dict[str, Any]:
        return usage(len(self.prompt), self.num_output, self.num_cached)

    async def collect(self) -> dict[str, Any]:
        text, ids, lps, finish = [], [], [], None
        async with aclosing(self.outputs()) as outputs:
            async for out in outputs:
                text.append(out.new_text)
                ids.extend(out.new_token_ids)
                lps.extend(out.new_logprobs)
                finish = out.finish_reason
        body = response_envelope(self.kind, self.rid, self.model, stream=False)
        want_lp = self.req._want_logprobs()
        body["choices"] = [
            completion_choice(
                self.kind,
                "".join(text),
                finish,
                ids if self.req.return_token_ids else None,
                lps if want_lp else None,
                False,
            )
        ]
        body["usage"] = self._usage()
        return body

    async def sse(self) -> AsyncIterator[bytes]:
        want_lp = self.req._want_logprobs()
        try:
            async with aclosing(self.outputs()) as outputs:
                async for out in outputs:
                    chunk = response_envelope(self.kind, self.rid, self.model, stream=True)
                    chunk["choices"] = [
                        completion_choice(
                            self.kind,
                            out.new_text,
                            out.finish_reason,
                            list(out.new_token_ids) if self.req.return_token_ids else None,
                            list(out.new_logprobs) if want_lp else None,
                            True,
                        )
                    ]
                    if self.req.include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
        except APIError as e:
            yield sse(e.body())
            yield sse("[DONE]")
            return
        if self.req.include_usage:
            chunk = response_envelope(self.kind, self.rid, self.model, stream=True)
            chunk["choices"] = []
            chunk["usage"] = self._usage()
            yield sse(chunk)
        yield sse("[DONE]")


@serve.ingress(app)
class Router:
    def __init__(self, config: ServeConfig, model_dir: str, decode, board):
        self.config = config
        self.model_dir = model_dir
        self.decode = decode
        self.board = board
        self.tokenizer = load_tokenizer(model_dir)
        self.max_model_len = ModelConfig.from_pretrained(model_dir).max_position_embeddings
        self.vocab_size = ModelConfig.from_pretrained(model_dir).vocab_size
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.admission = AdmissionController(config.admission)
        self.prefix = PrefixEstimator()
        self._pool_stats: list[ReplicaStats] = []
        self._stats_at = 0.0
        self._refreshing: asyncio.Task | None = None
        self.metrics = RouterMetrics(config.slo, stats_source=lambda: self._pool_stats)

    # ---- pool state -------------------------------------------------------------------------

    async def _refresh_pools(self) -> list[ReplicaStats]:
        self._pool_stats = await self.board.snapshot.remote()
        self._stats_at = time.monotonic()
        return self._pool_stats

    def _maybe_refresh(self) -> None:
        stale = time.monotonic() - self._stats_at > self.config.routing_stats_period_s
        if stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_pools())

    def _pool_ready(self, pool: str) -> bool:
        return any(s.pool == pool and s.healthy for s in self._pool_stats)

    # ---- endpoints --------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        await self._refresh_pools()
        missing = [p for p in ("prefill", "decode") if not self._pool_ready(p)]
        if missing:
            return JSONResponse({"status": "unavailable", "missing": missing}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        await self._refresh_pools()
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/admin/pools")
    async def pools(self) -> Response:
        if not self.config.enable_admin_api:
            raise APIError(404, "the admin API is disabled (enable_admin_api: false)", "not_found_error")
        stats = await self._refresh_pools()
        return JSONResponse({"replicas": [s.as_dict() for s in stats]})

    @app.get("/v1/models")
    async def models(self) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "shapeserve",
                        "max_model_len": self.max_model_len,
                    }
                ],
            }
        )

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_body(await self._read_body(request), CompletionRequest)
        self._check_model(req.model)
        size = len(req.prompt) if isinstance(req.prompt, str) else 0
        prompt = await self._encode(lambda: encode_prompt(self.tokenizer, req.prompt), size, "prompt")
        return await self._generate("completion", req, prompt, default_max_tokens=16)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_body(await self._read_body(request), ChatCompletionRequest)
        self._check_model(req.model)
        conversation = self._encode_now(req.conversation)
        size = sum(len(m["content"]) for m in conversation)
        prompt = await self._encode(
            lambda: encode_chat(self.tokenizer, conversation, req.add_generation_prompt), size, "messages"
        )
        return await self._generate("chat", req, prompt, default_max_tokens=max(1, self.max_model_len - len(prompt)))

    # ---- one request ------------------------------------------------------------------------

    async def _read_body(self, request: Request) -> bytes:
        """The body, read no further than ``max_request_body_bytes`` (413 past it: a huge body must not
        cost the router its memory)."""
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
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, model: str) -> None:
        if model not in (self.config.model_name, self.model_dir):
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.config.model_name!r}",
                "not_found_error",
                "model",
                "model_not_found",
            )

    @staticmethod
    def _encode_now(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ShapeserveError as e:
            raise _user_error(e) from None

    async def _encode(self, fn: Callable[[], list[int]], num_chars: int, param: str) -> list[int]:
        """Tokenizes (or renders the chat template): text that cannot fit the context is refused first, and
        long text is tokenized off the event loop."""
        self._encode_now(lambda: check_text_fits(num_chars, self.chars_per_token, self.max_model_len, param))
        if num_chars <= TOKENIZE_INLINE_MAX_CHARS:
            return self._encode_now(fn)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self._encode_now, fn)

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        n = len(prompt)
        if n == 0:
            raise APIError(400, "the prompt is empty; send at least one token", param="prompt")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        if n + max_tokens > self.max_model_len:
            raise APIError(
                400,
                f"this model's context is {self.max_model_len} tokens, but the prompt has {n} tokens and "
                f"max_tokens is {max_tokens} ({n + max_tokens} in total); shorten the prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )

    async def _generate(self, kind: str, req, prompt: list[int], default_max_tokens: int) -> Response:
        arrival = time.monotonic()
        try:
            params = req.sampling_params(default_max_tokens)
        except ShapeserveError as e:
            raise _user_error(e) from None
        self._check_prompt(prompt, params.max_tokens)
        self._maybe_refresh()

        bs = self.config.block_size
        hashes = hash_full_blocks(prompt, bs)
        geometry = RequestGeometry(
            len(prompt), self.prefix.cached_blocks(hashes) * bs, params.max_tokens, self.config.dtype, req.priority
        )
        # Before the first pool report arrives, assume the prefill pool is there.
        prefill_up = self._pool_ready("prefill") or not self._pool_stats
        decision = classify(
            geometry, self.config.classifier, self.config.admission, self.admission.snapshot(prefill_up)
        )
        if decision.route is Route.REJECT:
            self.metrics.rejected.labels(decision.route_class.value).inc()
            self.metrics.errors.labels("429").inc()
            raise APIError(
                429,
                f"server is at capacity for {decision.route_class.value} requests ({decision.reason}); "
                f"retry after {decision.retry_after_s} s",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(decision.retry_after_s)},
            )
        ticket = self.admission.admit(decision.route, geometry.cost_tokens)
        self.prefix.record(hashes)
        route = decision.route.value
        rid = new_id("cmpl" if kind == "completion" else "chatcmpl")
        task = GenerateTask(
            request_id=f"{rid}-{uuid.uuid4().hex[:6]}",
            prompt_token_ids=tuple(prompt),
            params=params,
            route=route,
            deadline=time.time() + self.config.timeouts.request_timeout_s,
            block_hashes=tuple(hashes),
        )
        timing = RequestTiming(arrival=arrival, route=route)
        gen = self.decode.options(stream=True).generate.remote(task)
        try:
            first = await gen.__anext__()
        except BaseException as e:  # noqa: BLE001
            gen.cancel()
            self.admission.release(ticket, 0)
            self.metrics.observe_finished(timing, "error", len(prompt))
            raise self._upstream_error(_cause(e)) from None
        if isinstance(first, Started):
            timing.started = time.monotonic()
            # The route the decode replica took: a REMOTE request that found no room for a lease
            # prefills locally. (A later fallback after a failed prefill shows in the pool metrics.)
            timing.route = route = first.route
        headers = {"x-shapeserve-route": route}
        run = _Run(self, kind, req, rid, prompt, gen, ticket, timing, first)
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream", headers=headers)
        try:
            body = await run.collect()
        except APIError as e:
            e.headers.update(headers)
            raise
        return JSONResponse(body, headers=headers)

    def _upstream_error(self, e: BaseException) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, ShapeserveError):
            return _user_error(e)
        if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
            self.metrics.errors.labels("504").inc()
            return APIError(504, "the request passed its deadline", "timeout_error", code="timeout")
        if isinstance(e, asyncio.CancelledError):
            raise e
        log.warning("decode call failed: %r", e)
        self.metrics.errors.labels("503").inc()
        return APIError(
            503, f"no decode replica could serve the request: {type(e).__name__}", "server_error", code="unavailable"
        )
