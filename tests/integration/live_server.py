"""``shapeserve serve`` started for a test module: a free local port, the module's config, stopped at the end."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.server_process import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(model_dir, directory: Path, config: str) -> Iterator[ServerProcess]:
    """Serves ``model_dir`` with ``config`` (the ServeConfig's fields, YAML, under ``shapeserve:``) on a free
    port, its log in ``directory``; Ray started by the server itself, without token auth."""
    path = directory / "serve.yaml"
    path.write_text("shapeserve:\n" + "".join(f"  {line}\n" for line in config.strip().splitlines()))
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    proc = ServerProcess(
        [*cmd, "--config", str(path)],
        f"http://127.0.0.1:{port}",
        str(directory / "server.log"),
        env={"RAY_AUTH_MODE": "disabled"},
    ).start(timeout_s=180)
    try:
        yield proc
    finally:
        proc.stop()
