"""Moving paged KV blocks between workers: leases, msgpack wire format, gRPC control plane,
data planes (NCCL, gloo, gRPC streaming). See ``receiver.py`` and ``sender.py`` for the flow."""

from kv_transfer.blocks import (
    BlockReserver,
    BlockSink,
    BlockSource,
    EngineReserver,
    PagedKV,
    PoolReserver,
    Reservation,
    engine_release,
    pool_release,
)
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseEndedError,
    PeerUnavailableError,
    TransferTimeoutError,
    TransportError,
    WireFormatError,
)
from kv_transfer.lease import Lease, LeaseOutcome, LeaseState, LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, TransferResult
from kv_transfer.transports import TRANSPORTS, choose_transport

__all__ = [
    "TRANSPORTS",
    "BlockReserver",
    "BlockSink",
    "BlockSource",
    "EngineReserver",
    "KVReceiver",
    "KVSender",
    "KVTransferConfig",
    "KVTransferError",
    "LayoutMismatchError",
    "Lease",
    "LeaseEndedError",
    "LeaseOutcome",
    "LeaseState",
    "LeaseTable",
    "PagedKV",
    "PeerUnavailableError",
    "PoolReserver",
    "Reservation",
    "TransferMetrics",
    "TransferResult",
    "TransferTimeoutError",
    "TransportError",
    "WireFormatError",
    "choose_transport",
    "engine_release",
    "pool_release",
]
