"""Configuration of the KV transfer layer (one frozen object per worker)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.errors import ConfigError

TRANSPORT_CHOICES = ("auto", "nccl", "gloo", "grpc")


@dataclass(frozen=True)
class KVTransferConfig:
    #: Data plane: ``auto`` = nccl if both KV tensors are on CUDA, else gloo if both sides have it, else grpc.
    transport: str = "auto"
    #: Address the receiver's gRPC server binds to; port 0 picks a free port.
    host: str = "127.0.0.1"
    port: int = 0
    #: Host name peers use to reach this worker (defaults to ``host``).
    advertise_host: str | None = None
    #: How long a lease may stay open before it expires (the sender then releases its source blocks;
    #: the receiver's owner sees EXPIRED and decides what to do with its own blocks).
    lease_ttl_s: float = 30.0
    #: Deadline of every control call (handshake, join, complete, abort).
    rpc_timeout_s: float = 5.0
    #: Deadline for setting up a process group between two peers.
    connect_timeout_s: float = 10.0
    #: Timeout given to gloo/NCCL at group creation: a stuck collective op errors after this.
    collective_timeout_s: float = 30.0
    #: Upper bound of one gRPC block message (whole blocks; at least one block per message).
    grpc_chunk_bytes: int = 4 << 20
    #: Upper bound of one collective send/recv (bounds the receiver's staging buffer).
    collective_chunk_bytes: int = 64 << 20
    #: How often the reaper looks for expired leases.
    reaper_interval_s: float = 0.1
    server_threads: int = 16
    #: Collective groups a receiver keeps (one per sender and backend); the least recently used is closed.
    max_peer_groups: int = 64

    def validate(self) -> KVTransferConfig:
        if self.transport not in TRANSPORT_CHOICES:
            raise ConfigError(
                f"kv transfer transport {self.transport!r} is unknown; choose one of {TRANSPORT_CHOICES}", "transport"
            )
        for name in ("lease_ttl_s", "rpc_timeout_s", "connect_timeout_s", "collective_timeout_s", "reaper_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}", name)
        for name in ("grpc_chunk_bytes", "collective_chunk_bytes", "server_threads", "max_peer_groups"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}", name)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}", "port")
        return self

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host
