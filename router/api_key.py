"""API-key check at the edge: a plain ASGI middleware (no per-request task or body wrapping, unlike Starlette's
``BaseHTTPMiddleware``, so streams pass through untouched).

With a key configured, requests to the protected paths need ``Authorization: Bearer <key>``; anything else gets
401 with an OpenAI error body and ``WWW-Authenticate: Bearer``. Probes and scrapes (/health, /ping, /version,
/metrics) stay open, as in vLLM, so load balancers and Prometheus need no secret.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/admin/")

_BODY = json.dumps(
    {
        "error": {
            "message": "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_BODY)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _BODY})

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)  # constant time: no key guessing by timing
        return False
