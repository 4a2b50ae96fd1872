"""A request's id: the one its response (``cmpl-<id>``, ``x-request-id``), its log lines and its trace carry.

The client's ``X-Request-Id`` when it sends a usable one (as vLLM takes it), else the id Ray Serve gave the
request, else a new one. The id is written into Serve's request context, which Serve's log formatter reads:
every log line written while serving the request, in this process and in the prefill replica it calls
(Serve passes the context along with a handle call), carries it as ``request_id``.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from ray.serve import context as serve_context
from starlette.requests import Request

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


def request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    if _USABLE.fullmatch(given):
        base = given
    else:
        base = serve_context._get_serve_request_context().request_id or uuid.uuid4().hex[:24]
    # Private to Serve, but it is the context its log filter reads (ray.serve._private.logging_utils).
    serve_context._set_request_context(request_id=base)
    return base
