"""A replica serving HTTP itself (Serve's direct ingress) must get its port back after a crash.

Serve 2.60 binds a direct-ingress replica's port without ``SO_REUSEADDR``. When a replica dies with client
connections open, the kernel keeps them in TIME_WAIT on that port for a minute, so its replacement's bind fails
with EADDRINUSE; Serve then concludes another program owns the port and blocks it for good, and every later
replica fails with ``NoAvailablePortError``: the server never answers again (found by ``bench/soak.py``, tested
in ``tests/integration/test_cli_server.py``). ``SO_REUSEADDR`` lets a listening socket bind over TIME_WAIT
connections (it does not let two live listeners share the port: that is ``SO_REUSEPORT``, left off).

``allow_rebind_after_crash()`` runs in the replica's process, before Serve starts its HTTP server there: it makes
Serve's socket set ``SO_REUSEADDR`` only. Idempotent; a no-op where Serve's internals differ (checked, logged).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

log = logging.getLogger("ray.serve")

_MARK = "_shapeserve_reuseaddr"


def _reuse_address_only(sock: socket.socket) -> bool:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return True


def allow_rebind_after_crash() -> bool:
    """Returns True when Serve's direct-ingress server will bind with ``SO_REUSEADDR`` in this process."""
    try:
        from ray.serve._private import http_util, replica
    except ImportError:  # pragma: no cover - a Serve without these modules
        return False
    start = getattr(replica, "start_asgi_http_server", None)
    if start is None or not hasattr(http_util, "set_socket_reuse_port"):
        log.warning("Serve's direct-ingress internals changed: a crashed replica may not get its port back")
        return False
    if getattr(start, _MARK, False):
        return True

    async def start_with_reuse_address(*args: Any, **kwargs: Any):
        kwargs["enable_so_reuseport"] = True  # the hook where Serve configures the socket before binding...
        return await start(*args, **kwargs)

    setattr(start_with_reuse_address, _MARK, True)
    http_util.set_socket_reuse_port = _reuse_address_only  # ...which here sets SO_REUSEADDR and nothing else
    replica.start_asgi_http_server = start_with_reuse_address
    return True
