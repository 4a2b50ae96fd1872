"""A request's id: the one its response (``cmpl-<id>``, ``x-request-id``), its log lines and its trace carry.

The client's ``X-Request-Id`` when it sends a usable one (as vLLM takes it), else the id Ray Serve gave the
request, else a new one. The id is written into Serve's request context, which Serve's log formatter reads:
every log line written while serving the request, in this process and in the prefill replica it calls
(Serve passes the context along with a handle call), carries it as ``request_id``.

Serve takes its request id, and the ``x-request-id`` response header it adds, from the client's header as it
is, before this app runs. ``serve_http_middlewares`` (installed through Serve's
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, which ``shapeserve serve`` sets) replaces an unusable header
first, so Serve's id, its header, the response body and the logs all carry the replacement.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from ray.serve import context as serve_context
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

#: What an id may look like: short, and nothing a log line or a header could be confused by.
_USABLE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class RequestIdentity:
    #: Without the response's ``cmpl-`` / ``chatcmpl-`` prefix.
    base_id: str
    #: When the request reached the edge (wall clock, ns): its trace starts there.
    received_ns: int
    #: The client says this is a retry (``is_retry``): it keeps an appointment a 429 gave it.
    retrying: bool = False


def is_retry(request: Request) -> bool:
    """The OpenAI SDKs number their attempts in ``X-Stainless-Retry-Count`` (0 for the first); they retry a 429
    after its Retry-After."""
    count = request.headers.get("x-stainless-retry-count", "0")
    return count.isdigit() and int(count) > 0


def _new_id() -> str:
    return uuid.uuid4().hex[:24]


def request_id(request: Request) -> str:
    # Serve's id is the client's header when one was sent: an unusable header must not come back through it.
    given = request.headers.get("x-request-id", "")
    from_serve = serve_context._get_serve_request_context().request_id or ""
    base = next((i for i in (given, from_serve) if _USABLE.fullmatch(i)), None) or _new_id()
    # Private to Serve, but it is the context its log filter reads (ray.serve._private.logging_utils).
    serve_context._set_request_context(request_id=base)
    return base


class UsableRequestIdMiddleware:
    """Replaces an unusable ``x-request-id`` request header with a new id before the app (and Serve's own
    request-id middleware, inside this one) reads it. Modifies only the request's headers."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = MutableHeaders(scope=scope)
            given = headers.get("x-request-id")
            if given is not None and not _USABLE.fullmatch(given):
                headers["x-request-id"] = _new_id()
        await self.app(scope, receive, send)


#: The import path Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` takes for ``serve_http_middlewares``.
SERVE_HTTP_CALLBACK = "router.request_ids.serve_http_middlewares"


def serve_http_middlewares() -> list[Middleware]:
    """Serve's HTTP callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): the middlewares Serve puts outside
    its own, in its proxy and in a direct-ingress replica."""
    return [Middleware(UsableRequestIdMiddleware)]
