"""Plain counters for transfers; the serving layer exports them (Prometheus) from ``snapshot()``."""

from __future__ import annotations

import threading
from collections import defaultdict


class TransferMetrics:
    """Thread-safe counters keyed by (name, transport). Cheap enough to call per chunk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], float] = defaultdict(float)

    def add(self, name: str, transport: str, value: float = 1.0) -> None:
        with self._lock:
            self._counters[(name, transport)] += value

    def record_transfer(self, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        """direction: 'sent' | 'received'."""
        with self._lock:
            self._counters[(f"bytes_{direction}", transport)] += nbytes
            self._counters[(f"transfers_{direction}", transport)] += 1
            self._counters[(f"seconds_{direction}", transport)] += seconds

    def record_failure(self, transport: str, error: BaseException | str) -> None:
        kind = error if isinstance(error, str) else type(error).__name__
        self.add(f"failures_{kind}", transport)

    def get(self, name: str, transport: str = "") -> float:
        with self._lock:
            return self._counters.get((name, transport), 0.0)

    def snapshot(self) -> dict[str, float]:
        """``{"bytes_sent/grpc": ..., "leases_expired/": ...}``; does not reset."""
        with self._lock:
            return {f"{name}/{transport}": v for (name, transport), v in sorted(self._counters.items())}
