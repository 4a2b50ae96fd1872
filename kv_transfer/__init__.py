"""Moving paged KV blocks between workers: leases, msgpack wire format, gRPC control plane,
data planes (NCCL, gloo, gRPC streaming).

The decode side owns its blocks throughout: it reserves them in its own engine, then
``lease = receiver.open_lease(request_id, block_ids, first_block)`` and passes the lease to the
prefill side, which calls ``sender.send(lease, its_block_ids)`` and reports success (with the
first token) in its own result. The decode side uses the blocks only if
``receiver.outcome(lease.lease_id).state == LeaseState.COMPLETED``; on every other exit it calls
``receiver.abort(lease.lease_id)`` before touching them. See ``receiver.py`` and ``sender.py``.
"""

from kv_transfer.blocks import BlockSink, BlockSource, PagedKV, Release, blocks_shape
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
from kv_transfer.receiver_service import ReceiverService
from kv_transfer.sender import KVSender, TransferResult
from kv_transfer.transports import TRANSPORTS, choose_transport

__all__ = [
    "TRANSPORTS",
    "BlockSink",
    "BlockSource",
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
    "ReceiverService",
    "Release",
    "TransferMetrics",
    "TransferResult",
    "TransferTimeoutError",
    "TransportError",
    "WireFormatError",
    "blocks_shape",
    "choose_transport",
]
