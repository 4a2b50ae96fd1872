"""``shapeserve serve`` started for a test module: a free local port, the module's config, stopped at the end."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess
from cluster.tools.serve_cli import RAY_METRICS_REPORT_INTERVAL_MS
from tests.helpers import free_port


@contextmanager
def live_server(model_dir, directory: Path, config: str) -> Iterator[ServerProcess]:
    """Serves ``model_dir`` with ``config`` (the ServeConfig's fields, YAML, under ``shapeserve:``) on a free
    port, its log in ``directory``; Ray started by the server itself, without token auth."""
    path = directory / "serve.yaml"
    path.write_text("shapeserve:\n" + "".join(f"  {line}\n" for line in config.strip().splitlines()))
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--ray-metrics-port", str(free_port())]  # not the default 8080: a test must not depend on it being free
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


Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Scrape:
    """``/metrics`` parsed: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(page: Scrape, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in page.items() if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def settled_scrape(url: str, timeout_s: float = 60.0) -> Scrape:
    """A scrape that has caught up with the requests already answered: the request families reach ``/metrics``
    through Ray's metrics pipeline, up to one report interval late, so two scrapes that far apart must agree."""
    interval_s = RAY_METRICS_REPORT_INTERVAL_MS / 1000 + 1.0
    end = time.monotonic() + timeout_s
    last = scrape(url)
    while time.monotonic() < end:
        time.sleep(interval_s)
        page = scrape(url)
        if {k: v for k, v in page.items() if k[0].startswith("shapeserve_requests")} == {
            k: v for k, v in last.items() if k[0].startswith("shapeserve_requests")
        } and total(page, "shapeserve_time_to_first_token_seconds_count") == total(
            last, "shapeserve_time_to_first_token_seconds_count"
        ):
            return page
        last = page
    raise AssertionError(f"/metrics did not settle within {timeout_s:.0f} s")
