"""The gRPC control plane: generic handlers over msgpack bytes (no generated code).

Service ``shapeserve.kv.KVTransfer``; every method takes and returns one ``wire`` message
(``PushBlocks`` takes a stream of ``BlockChunk``). Handlers get raw bytes and decode them
strictly themselves, so a malformed message is answered with a ``WireFormatError`` that names
the problem. A ``KVTransferError`` crosses as ``"<ClassName>: <message>"`` in the status
details and is re-raised as the same class on the calling side. Every client call has a deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from kv_transfer import wire
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import (
    ERRORS_BY_NAME,
    KVTransferError,
    LayoutMismatchError,
    LeaseEndedError,
    PeerUnavailableError,
    TransferTimeoutError,
    WireFormatError,
)

SERVICE = "shapeserve.kv.KVTransfer"
log = logging.getLogger(__name__)
T = TypeVar("T")

_STATUS = {
    LayoutMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    WireFormatError: grpc.StatusCode.INVALID_ARGUMENT,
    LeaseEndedError: grpc.StatusCode.ABORTED,
    TransferTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
}


#: While a call is open the server pings a quiet client every 5 s and drops it after 5 s without an
#: answer: a vanished host (no FIN) ends its stream before a long lease deadline. Not shorter: a busy
#: but healthy sender process may answer pings late.
SERVER_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]


def max_message_bytes(config: KVTransferConfig, bytes_per_block: int) -> int:
    """Largest gRPC message either side accepts: one chunk of whole blocks plus headers."""
    return max(config.grpc_chunk_bytes, bytes_per_block) + (1 << 20)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# ---- server side ------------------------------------------------------------------------


def _unary(fn: Callable[[bytes], Any]) -> grpc.RpcMethodHandler:
    def handler(request: bytes, context: grpc.ServicerContext) -> Any:
        return _answer(lambda: fn(request), context)

    return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=wire.encode)


def _stream_unary(fn: Callable[[Iterator[bytes], grpc.ServicerContext], Any]) -> grpc.RpcMethodHandler:
    def handler(requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        return _answer(lambda: fn(requests, context), context)

    return grpc.stream_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=wire.encode)


def _answer(call: Callable[[], Any], context: grpc.ServicerContext) -> Any:
    try:
        return call()
    except KVTransferError as e:
        context.abort(_STATUS.get(type(e), grpc.StatusCode.UNKNOWN), f"{type(e).__name__}: {e}")
    except Exception as e:  # a bug or a failing sink: the caller still gets a named error, the server lives
        log.exception("KV transfer handler failed")
        context.abort(grpc.StatusCode.INTERNAL, f"KVTransferError: receiver failed: {type(e).__name__}: {e}")


def start_server(
    host: str,
    port: int,
    unary: dict[str, Callable[[bytes], Any]],
    streams: dict[str, Callable[[Iterator[bytes], grpc.ServicerContext], Any]],
    *,
    threads: int,
    max_message_bytes: int,
) -> tuple[grpc.Server, int]:
    handlers = {name: _unary(fn) for name, fn in unary.items()}
    handlers.update({name: _stream_unary(fn) for name, fn in streams.items()})
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-rpc"),
        options=channel_options(max_message_bytes) + SERVER_KEEPALIVE,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise PeerUnavailableError(f"cannot bind the KV transfer server to {host}:{port}")
    server.start()
    return server, bound


# ---- client side ------------------------------------------------------------------------


def error_from_rpc(e: grpc.RpcError, what: str) -> KVTransferError:
    """Maps a failed call to the KVTransferError the peer raised, or to a timeout/unavailable error."""
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else None) or str(e)
    name, sep, msg = details.partition(": ")
    if sep and name in ERRORS_BY_NAME:
        return ERRORS_BY_NAME[name](f"{what}: {msg}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TransferTimeoutError(f"{what}: deadline exceeded (peer slow, frozen or gone)")
    return PeerUnavailableError(f"{what}: {code.name if code else 'error'}: {details}")


class Client:
    """One channel to a receiver; unary and client-streaming calls with deadlines."""

    def __init__(self, addr: str, max_message_bytes: int):
        self.addr = addr
        self.channel = grpc.insecure_channel(addr, options=channel_options(max_message_bytes))

    def call(self, method: str, msg: Any, reply: type[T], timeout_s: float) -> T:
        fn = self.channel.unary_unary(f"/{SERVICE}/{method}", request_serializer=wire.encode)
        try:
            raw = fn(msg, timeout=max(0.001, timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"{method} to {self.addr}") from None
        return wire.decode(raw, reply)

    def call_raw(self, method: str, data: bytes, timeout_s: float) -> bytes:
        """Sends pre-encoded bytes (tests use this to send malformed messages)."""
        fn = self.channel.unary_unary(f"/{SERVICE}/{method}")
        try:
            return fn(data, timeout=max(0.001, timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"{method} to {self.addr}") from None

    def stream(self, method: str, chunks: Iterator[bytes], reply: type[T], timeout_s: float) -> T:
        """Client-streaming call of pre-encoded messages."""
        fn = self.channel.stream_unary(f"/{SERVICE}/{method}")
        try:
            raw = fn(chunks, timeout=max(0.001, timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"{method} to {self.addr}") from None
        return wire.decode(raw, reply)

    def close(self) -> None:
        self.channel.close()
