"""Errors of a KV transfer. Every one ends the transfer it belongs to; none is fatal to the process.

They cross the gRPC boundary by name (``"LayoutMismatchError: ..."`` in the status details) so the
other side re-raises the same class with the peer's message.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class: a transfer failed; its lease has ended (or never began) and the sender's source blocks
    are released. The receiver's blocks were never anyone's but its owner's."""


class LayoutMismatchError(KVTransferError):
    """The two sides' ``KVLayout`` differ; the message names the field. Nothing was sent."""


class WireFormatError(KVTransferError):
    """A message that is not a well-formed shapeserve KV message (malformed, truncated, wrong shape)."""


class LeaseEndedError(KVTransferError):
    """The lease was already completed, aborted or expired (or is unknown to this side)."""


class TransferTimeoutError(KVTransferError):
    """A wait ran past its deadline (peer frozen, slow or gone)."""


class PeerUnavailableError(KVTransferError):
    """The peer cannot be reached or went away mid-transfer."""


class TransportError(KVTransferError):
    """The data plane failed (collective op error, transport not supported by both sides)."""


class StaleGroupError(TransportError):
    """The receiver no longer has the sender's collective group (evicted, broken, restarted): rejoin."""


ERRORS_BY_NAME: dict[str, type[KVTransferError]] = {
    cls.__name__: cls
    for cls in (
        KVTransferError,
        LayoutMismatchError,
        WireFormatError,
        LeaseEndedError,
        TransferTimeoutError,
        PeerUnavailableError,
        TransportError,
        StaleGroupError,
    )
}
