"""Wire format: every message round-trips; anything malformed or truncated is refused by name."""

from __future__ import annotations

import msgpack
import pytest
import torch

from cluster.kv_layout import KVLayout
from kv_transfer import wire
from kv_transfer.errors import WireFormatError

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16", num_blocks=16)


def _payload(dtype=torch.bfloat16) -> wire.TensorPayload:
    return wire.TensorPayload.from_tensor(torch.randn(2, 2, 3, 4, 2, 8).to(dtype))


MESSAGES = [
    wire.Handshake("s1", LAYOUT, ("gloo", "grpc")),
    wire.HandshakeReply("r1", LAYOUT, ("grpc",), ""),
    wire.BlockChunk("l1", 0, _payload()),
    wire.PushReply("l1", 3),
    wire.JoinGroup("p1", "gloo", "s1"),
    wire.JoinGroupReply("p1"),
    wire.CollectivePush("l1", "p1", (2, 1)),
    wire.CompleteLease("l1"),
    wire.AbortLease("l1", "client went away"),
    wire.LeaseStatus("l1", "ABORTED", "why"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert wire.decode(wire.encode(msg), type(msg)) == msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_payload_bit_exact(dtype):
    t = torch.randn(2, 2, 3, 4, 2, 8).to(dtype)
    t[0, 0, 0, 0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")]).to(dtype)
    back = wire.decode(wire.encode(wire.BlockChunk("l", 0, wire.TensorPayload.from_tensor(t))), wire.BlockChunk)
    out = back.blocks.to_tensor()
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))  # bytes, so NaN compares too


def _envelope(t: str, m, v=wire.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb({"v": v, "t": t, "m": m}, use_bin_type=True)


def _chunk_fields(**over):
    p = _payload()
    fields = {"lease_id": "l1", "start": 0, "blocks": {"dtype": p.dtype, "shape": list(p.shape), "data": p.data}}
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    "data, expect",
    [
        (b"", "not a msgpack message"),
        (b"\xc1\x00\x01", "not a msgpack message"),
        (wire.encode(wire.PushReply("l1", 3))[:-2], "truncated"),
        (wire.encode(wire.PushReply("l1", 3)) + b"\x00", "not a msgpack message"),
        (msgpack.packb([1, 2, 3]), "expected a map with keys v, t, m"),
        (_envelope("push_reply", {"lease_id": "l1", "num_blocks": 3}, v=99), "protocol version 99"),
        (_envelope("push_reply", {"lease_id": "l1", "num_blocks": 3}, v=1), "protocol version 1 is not supported"),
        (_envelope("no_such", {}), "unknown message type 'no_such'"),
        (_envelope("open_lease", {"request_id": "r", "num_blocks": 1}), "unknown message type 'open_lease'"),
        (_envelope("complete_lease", {"lease_id": "l1", "first_token_id": 3}), "unexpected fields ['first_token_id']"),
        (_envelope("push_reply", {"lease_id": "l1"}), "missing fields ['num_blocks']"),
        (_envelope("push_reply", {"lease_id": "l1", "num_blocks": 3, "x": 1}), "unexpected fields ['x']"),
        (_envelope("push_reply", {"lease_id": "l1", "num_blocks": True}), "num_blocks: expected an integer"),
        (_envelope("push_reply", {"lease_id": 7, "num_blocks": 3}), "lease_id: expected str"),
        (_envelope("collective_push", {"lease_id": "l", "pair_id": "p", "chunk_blocks": [1, "2"]}), "chunk_blocks[1]"),
        (
            _envelope(
                "block_chunk",
                _chunk_fields(blocks={"dtype": "bfloat16", "shape": [2, 2, 3, 4, 2, 8], "data": b"\0" * 10}),
            ),
            "need 1536",
        ),
        (
            _envelope("block_chunk", _chunk_fields(blocks={"dtype": "int8", "shape": [1], "data": b"\0"})),
            "not a KV dtype",
        ),
        (
            _envelope("block_chunk", _chunk_fields(blocks={"dtype": "float32", "shape": [-1, 4], "data": b""})),
            "negative",
        ),
        (_envelope("block_chunk", _chunk_fields(blocks="raw")), "blocks: expected a map"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(data, expect):
    with pytest.raises(WireFormatError) as info:
        wire.decode(data)
    assert expect in str(info.value)


def test_truncated_block_chunk_is_refused():
    good = wire.encode(wire.BlockChunk("l1", 0, _payload()))
    for cut in (1, 7, len(good) // 2, len(good) - 1):
        with pytest.raises(WireFormatError):
            wire.decode(good[:cut])


def test_wrong_message_type_for_the_call():
    with pytest.raises(WireFormatError, match="expected a block_chunk message, got push_reply"):
        wire.decode(wire.encode(wire.PushReply("l", 1)), wire.BlockChunk)


def test_encode_rejects_non_messages():
    with pytest.raises(TypeError):
        wire.encode({"t": "push_reply"})
