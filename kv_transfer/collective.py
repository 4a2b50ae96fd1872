"""Two-rank ``torch.distributed`` groups between one sender and one receiver (gloo or NCCL).

Each pair gets its own process group built directly from a ``PrefixStore`` on the receiver's
``TCPStore`` (no global default group, so one worker can pair with many peers). The receiver
is rank 0, the sender rank 1. Every op runs in a daemon thread and the caller waits with a
deadline: a frozen or dead peer turns into ``TransferTimeoutError``/``TransportError`` on time,
the group is marked broken and dropped, and the stuck thread ends when the backend's own
timeout (set at group creation) fires. Ops go through a staging tensor, never straight into
the paged pool, so a late op can never write into blocks whose lease has ended (and that the
owner may have reused meanwhile).
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kv_transfer.errors import TransferTimeoutError, TransportError

log = logging.getLogger(__name__)

T = TypeVar("T")
RECEIVER_RANK, SENDER_RANK = 0, 1


def run_with_deadline(
    fn: Callable[[], T], timeout_s: float, what: str, cancelled: Callable[[], str | None] | None = None
) -> T:
    """Runs ``fn`` in a daemon thread; raises TransferTimeoutError if it has not returned in ``timeout_s``,
    TransportError as soon as ``cancelled()`` returns a reason (checked every 50 ms)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"kv-{what}", daemon=True)
    thread.start()
    end = time.monotonic() + max(0.0, timeout_s)
    while thread.is_alive() and time.monotonic() < end:
        thread.join(min(0.05, max(0.0, end - time.monotonic())) if cancelled else max(0.0, end - time.monotonic()))
        reason = cancelled() if cancelled and thread.is_alive() else None
        if reason:
            raise TransportError(f"{what} cancelled: {reason}")
    if thread.is_alive():
        raise TransferTimeoutError(f"{what} did not finish within {timeout_s:.1f}s (peer frozen or gone?)")
    if "error" in box:
        err = box["error"]
        raise TransportError(f"{what} failed: {err}") from err  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def backend_available(backend: str, device: torch.device) -> bool:
    if not dist.is_available():
        return False
    if backend == "gloo":
        return dist.is_gloo_available()
    if backend == "nccl":
        return device.type == "cuda" and dist.is_nccl_available()
    return False


def open_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(
        host, port, is_master=is_master, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


class PairGroup:
    """One two-rank process group. Serializes its ops (one transfer at a time per pair)."""

    def __init__(
        self, pair_id: str, backend: str, store: dist.Store, rank: int, device: torch.device, op_timeout_s: float
    ):
        self.pair_id = pair_id
        self.backend = backend
        self.rank = rank
        self.peer = 1 - rank
        # gloo moves host memory (a CUDA pool is staged through the CPU); NCCL moves device memory.
        self.device = torch.device("cpu") if backend == "gloo" else device
        self.lock = threading.Lock()
        self.broken = False
        self._staging: torch.Tensor | None = None
        prefixed = dist.PrefixStore(f"kvpair/{pair_id}/", store)
        timeout = datetime.timedelta(seconds=op_timeout_s)
        # Either backend's group; send/recv are the collective API both share.
        self.pg: Any
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(device)
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        else:
            raise TransportError(f"unknown collective backend {backend!r}")

    @contextmanager
    def exclusive(self, deadline: float) -> Iterator[None]:
        """Holds the group for one transfer; TransferTimeoutError if another does not finish by ``deadline``."""
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeoutError(f"{self.backend} group {self.pair_id} stayed busy past the deadline")
        try:
            yield
        finally:
            self.lock.release()

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous receive buffer of ``shape``, reused across chunks (fresh pages cost more than the copy).
        Caller holds the group (``exclusive``)."""
        numel = math.prod(shape)
        buf = self._staging
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self._staging = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def send(self, tensor: torch.Tensor, timeout_s: float, cancelled: Callable[[], str | None] | None = None) -> None:
        self._op(lambda: self.pg.send([tensor], self.peer, 0), timeout_s, "send", cancelled)

    def recv(self, tensor: torch.Tensor, timeout_s: float, cancelled: Callable[[], str | None] | None = None) -> None:
        self._op(lambda: self.pg.recv([tensor], self.peer, 0), timeout_s, "recv", cancelled)

    def _op(
        self, post: Callable[[], dist.Work], timeout_s: float, name: str, cancelled: Callable[[], str | None] | None
    ) -> None:
        if self.broken:
            raise TransportError(f"{self.backend} group {self.pair_id} is broken")

        def run() -> None:
            post().wait()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

        try:
            run_with_deadline(run, timeout_s, f"{self.backend} {name}", cancelled)
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Marks the group broken and tears it down; safe to call twice."""
        if self.broken:
            return
        self.broken = True
        self._staging = None
        try:
            if self.backend == "nccl":
                self.pg.abort()  # unblocks pending NCCL ops; gloo ops end at their timeout
        except Exception:
            log.debug("abort of group %s failed", self.pair_id, exc_info=True)


def make_group(
    pair_id: str,
    backend: str,
    store: dist.Store,
    rank: int,
    device: torch.device,
    op_timeout_s: float,
    connect_timeout_s: float,
) -> PairGroup:
    """Builds this rank's side of the pair; both ranks must call it. Bounded by ``connect_timeout_s``."""
    return run_with_deadline(
        lambda: PairGroup(pair_id, backend, store, rank, device, op_timeout_s),
        connect_timeout_s,
        f"{backend} group setup",
    )
