"""The msgpack wire format: typed message dataclasses <-> bytes, decoded strictly.

Every message is one msgpack map ``{"v": PROTOCOL_VERSION, "t": <type tag>, "m": {<fields>}}``.
Decoding checks the envelope, the exact field set, every field's type, and for tensors that
``len(data) == prod(shape) * itemsize`` - a malformed or truncated message raises
``WireFormatError`` naming what is wrong, before anything acts on it. Tensors travel as raw
bytes + dtype name + shape (``TensorPayload``); no pickle anywhere.
"""

from __future__ import annotations

import math
import types
import typing
import warnings
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

import msgpack
import torch

from cluster.dtypes import dtype_name, torch_dtype
from cluster.kv_layout import KVLayout
from kv_transfer.errors import WireFormatError

#: 2: no OpenLease (leases are opened only by the receiver's owner), CompleteLease without a token.
PROTOCOL_VERSION = 2

T = TypeVar("T")


@dataclass(frozen=True)
class TensorPayload:
    """A tensor as raw little-endian bytes. ``to_tensor`` shares the buffer (read-only) - copy before mutating.
    ``from_tensor`` shares the tensor's memory (no copy until msgpack packs it): encode before reusing it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> TensorPayload:
        t = t.detach().to("cpu").contiguous()
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy().data) if t.numel() else b""
        return cls(dtype_name(t.dtype), tuple(t.shape), data)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize

    def validate(self) -> TensorPayload:
        try:
            torch_dtype(self.dtype)
        except KeyError:
            raise WireFormatError(f"tensor dtype {self.dtype!r} is not a KV dtype") from None
        if any(d < 0 for d in self.shape):
            raise WireFormatError(f"tensor shape {list(self.shape)} has a negative dimension")
        if len(self.data) != self.nbytes:
            raise WireFormatError(
                f"tensor data is {len(self.data)} bytes but dtype {self.dtype} and shape {list(self.shape)} "
                f"need {self.nbytes} (truncated or padded message)"
            )
        return self

    def to_tensor(self) -> torch.Tensor:
        dtype = torch_dtype(self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        with warnings.catch_warnings():  # bytes are read-only; callers copy (scatter) before mutating
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.data, dtype=torch.uint8)
        return flat.view(dtype).view(self.shape)


# ---- messages (tag -> dataclass) --------------------------------------------------------


@dataclass(frozen=True)
class Handshake:
    sender_id: str
    layout: KVLayout
    #: Transports the sender can use with its KV tensor, best first.
    transports: tuple[str, ...]


@dataclass(frozen=True)
class HandshakeReply:
    receiver_id: str
    layout: KVLayout
    transports: tuple[str, ...]
    #: ``host:port`` of the receiver's TCPStore for collective groups ("" if it has none).
    store_addr: str


@dataclass(frozen=True)
class BlockChunk:
    """Whole blocks ``[num_layers, 2, n, block_size, kv_heads, head_dim]`` for lease positions start..start+n."""

    lease_id: str
    start: int
    blocks: TensorPayload


@dataclass(frozen=True)
class PushReply:
    lease_id: str
    num_blocks: int


@dataclass(frozen=True)
class JoinGroup:
    pair_id: str
    backend: str
    sender_id: str


@dataclass(frozen=True)
class JoinGroupReply:
    pair_id: str


@dataclass(frozen=True)
class CollectivePush:
    """Announces collective sends for a lease: one op per entry of ``chunk_blocks`` (blocks per op), in order."""

    lease_id: str
    pair_id: str
    chunk_blocks: tuple[int, ...]


@dataclass(frozen=True)
class CompleteLease:
    """Every block was sent: the receiver completes the lease if it has them all (else aborts it)."""

    lease_id: str


@dataclass(frozen=True)
class AbortLease:
    lease_id: str
    reason: str


@dataclass(frozen=True)
class LeaseStatus:
    lease_id: str
    #: LeaseState name: ACTIVE | COMPLETED | ABORTED | EXPIRED | UNKNOWN
    state: str
    reason: str


MESSAGES: dict[str, type] = {
    "handshake": Handshake,
    "handshake_reply": HandshakeReply,
    "block_chunk": BlockChunk,
    "push_reply": PushReply,
    "join_group": JoinGroup,
    "join_group_reply": JoinGroupReply,
    "collective_push": CollectivePush,
    "complete_lease": CompleteLease,
    "abort_lease": AbortLease,
    "lease_status": LeaseStatus,
}
_TAGS = {cls: tag for tag, cls in MESSAGES.items()}
_NESTED = (KVLayout, TensorPayload)
_HINTS: dict[type, dict[str, Any]] = {cls: typing.get_type_hints(cls) for cls in (*MESSAGES.values(), *_NESTED)}

#: Largest message we unpack (one chunk plus headers); the gRPC layer bounds it too.
MAX_MESSAGE_BYTES = 1 << 30


# ---- encode -----------------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_to_wire(v) for v in value]
    return value


def encode(msg: Any) -> bytes:
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a KV transfer message")
    return msgpack.packb({"v": PROTOCOL_VERSION, "t": tag, "m": _to_wire(msg)}, use_bin_type=True)


# ---- decode -----------------------------------------------------------------------------


def decode(data: bytes, expect: type[T] | None = None) -> T:
    """Bytes -> message. Raises WireFormatError on anything but a well-formed message (of type ``expect``)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES} byte limit")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, FormatError ...)
        raise WireFormatError(f"not a msgpack message ({type(e).__name__}: {e}); truncated or corrupt") from None
    if not isinstance(raw, dict) or set(raw) != {"v", "t", "m"}:
        raise WireFormatError("not a KV transfer message: expected a map with keys v, t, m")
    if raw["v"] != PROTOCOL_VERSION:
        raise WireFormatError(f"protocol version {raw['v']!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    cls = MESSAGES.get(raw["t"]) if isinstance(raw["t"], str) else None
    if cls is None:
        raise WireFormatError(f"unknown message type {raw['t']!r}")
    if expect is not None and cls is not expect:
        raise WireFormatError(f"expected a {_TAGS[expect]} message, got {raw['t']}")
    return _from_wire(raw["m"], cls, raw["t"])


def _from_wire(value: Any, hint: Any, path: str) -> Any:
    if hint == bytes | memoryview:  # we send views; we receive bytes
        hint = bytes
    if isinstance(hint, type) and hint in _HINTS:
        return _dataclass_from_wire(value, hint, path)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_wire(value, inner, path)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise WireFormatError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_from_wire(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireFormatError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireFormatError(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    if hint in (str, bool, bytes):
        if not isinstance(value, hint):
            raise WireFormatError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    raise TypeError(f"no wire rule for {hint!r} at {path}")  # a bug in a message definition


def _dataclass_from_wire(value: Any, cls: type, path: str) -> Any:
    if not isinstance(value, dict):
        raise WireFormatError(f"{path}: expected a map, got {type(value).__name__}")
    hints = _HINTS[cls]
    missing = [n for n in hints if n not in value]
    extra = [k for k in value if k not in hints]
    if missing or extra:
        raise WireFormatError(f"{path}: missing fields {missing}, unexpected fields {extra}")
    obj = cls(**{name: _from_wire(value[name], hint, f"{path}.{name}") for name, hint in hints.items()})
    if isinstance(obj, TensorPayload):
        obj.validate()
    return obj
