"""A server under test as a process tree: start it, time it to /health, read its CPU and memory, stop it.

Used by the online benchmarks (``bench.serve_vs_offline``, ``bench/compare_vllm.sh``): whatever the
server (``shapeserve serve`` with its own Ray, ``vllm serve``), every process it starts is a
descendant of the command, so the tree is the server's whole cost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import psutil

#: How a process of the tree is reported, by the first pattern its command line contains.
GROUPS = (
    ("ServeReplica:shapeserve:DecodeWorker", "decode replica (edge + engine)"),
    ("ServeReplica:shapeserve:PrefillWorker", "prefill replica"),
    ("ServeReplica:shapeserve:PoolBoard", "pool board"),
    ("ProxyActor", "Serve proxy"),
    ("ServeController", "Serve controller"),
    ("raylet", "raylet"),
    ("gcs_server", "GCS"),
    ("dashboard", "Ray dashboard/agents"),
    ("DashboardAgent", "Ray dashboard/agents"),
    ("RuntimeEnvAgent", "Ray dashboard/agents"),
    ("monitor.py", "Ray monitors"),
    ("log_monitor", "Ray monitors"),
    ("shapeserve serve", "shapeserve CLI (driver)"),
    ("cluster.tools.cli serve", "shapeserve CLI (driver)"),
    ("vllm", "vLLM"),
)


def group_of(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "gone"
    return next((name for pattern, name in GROUPS if pattern in cmd), "other")


@dataclass
class ServerProcess:
    cmd: list[str]
    url: str
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    #: Directory the command runs in (None: this process's).
    cwd: str | None = None
    proc: subprocess.Popen | None = None
    seconds_to_health: float | None = None

    def start(self, timeout_s: float = 600.0) -> ServerProcess:
        """Starts the command and waits until ``GET {url}/health`` answers 200 (raises on timeout or exit)."""
        log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the server
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            cwd=self.cwd,
            start_new_session=True,
        )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[0]} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.seconds_to_health = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{self.cmd[0]} did not answer /health within {timeout_s:.0f} s; see {self.log_path}")

    def tree(self) -> list[psutil.Process]:
        assert self.proc is not None
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def cpu_seconds(self) -> dict[int, tuple[str, float]]:
        """pid -> (group, user + system CPU seconds so far) for every live process of the tree."""
        out = {}
        for p in self.tree():
            try:
                t = p.cpu_times()
                out[p.pid] = (group_of(p), t.user + t.system)
            except psutil.Error:
                continue
        return out

    def pss_mb(self) -> dict[str, float]:
        """Proportional set size by group, MB (shared pages split among the processes that map them)."""
        by_group: dict[str, float] = defaultdict(float)
        for p in self.tree():
            try:
                by_group[group_of(p)] += p.memory_full_info().pss / 2**20
            except psutil.Error:
                continue
        return dict(by_group)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT (a clean shutdown), then SIGKILL for whatever of the tree is left. Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = self.tree()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass


def cpu_delta(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two ``cpu_seconds()`` snapshots, by group (processes born in between count
    from zero; those that died in between are lost, which a benchmark run should not have)."""
    out: dict[str, float] = defaultdict(float)
    for pid, (group, seconds) in after.items():
        out[group] += seconds - before.get(pid, (group, 0.0))[1]
    return dict(out)


def machine_line() -> str:
    """What the machine is and what else is running on it now."""
    import platform

    model = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()
    return (
        f"{model or platform.processor()}, {os.cpu_count()} CPUs, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        "before the run"
    )
