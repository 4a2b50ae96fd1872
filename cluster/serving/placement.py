"""How the pools share a cluster's CPUs and GPUs: a pure decision, logged at start-up with its reason.

On a GPU cluster every pool replica takes a GPU and the pools are separate (disaggregated).
On a CPU cluster, the engine's matmuls use every core they are given, and a prefill pool that
sits idle between long prompts would hold cores the decode engine needs: below
``min_cpus_to_disaggregate`` CPUs (config), one engine per decode replica prefills and decodes
(colocated) and gets all the CPUs; above it, the prefill pool gets a quarter of them. A replica's
torch threads follow its CPUs (Ray would otherwise leave a 1-CPU replica one thread).
Explicit ``num_cpus`` / ``num_threads`` / ``disaggregation`` in the config always win; a pool pinned to
node types by custom ``resources`` takes 1 CPU per replica unless its ``num_cpus`` says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.serving.config import PoolConfig, ServeConfig

#: Share of a CPU cluster's cores the prefill pool gets by default when the pools are split.
PREFILL_CPU_SHARE = 0.25


@dataclass(frozen=True)
class PoolPlacement:
    num_cpus: float
    num_gpus: float
    #: Torch threads of each replica's engine.
    num_threads: int


@dataclass(frozen=True)
class Placement:
    decode: PoolPlacement
    #: None: no prefill pool (colocated).
    prefill: PoolPlacement | None
    reason: str

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


def place_pools(config: ServeConfig, cluster_cpus: float, cluster_gpus: float) -> Placement:
    """Where the pools go on a cluster with these resources (Ray's ``cluster_resources()``)."""
    if cluster_gpus > 0:
        disaggregated = config.disaggregation != "off"
        why = f"{cluster_gpus:g} GPUs: one GPU per pool replica" + (
            "" if disaggregated else ", no prefill pool (disaggregation: off)"
        )
        decode = _pool(config.decode, default_cpus=1.0, num_gpus=1.0)
        prefill = _pool(config.prefill, default_cpus=1.0, num_gpus=1.0) if disaggregated else None
        return Placement(decode, prefill, why)

    cpus = max(1.0, cluster_cpus)
    if config.disaggregation == "off":
        disaggregated, why = False, "disaggregation: off"
    elif config.disaggregation == "on":
        disaggregated, why = True, "disaggregation: on"
    elif cpus < config.min_cpus_to_disaggregate:
        disaggregated = False
        why = (
            f"{cpus:g} CPUs and no GPU: a separate prefill pool would idle on cores the decode engine needs "
            f"(it pays from {config.min_cpus_to_disaggregate} CPUs; disaggregation: auto)"
        )
    else:
        disaggregated, why = True, f"{cpus:g} CPUs: prefill pool gets {PREFILL_CPU_SHARE:.0%} of them"
    if not disaggregated:
        decode = _pool(config.decode, default_cpus=cpus / config.decode.num_replicas, num_gpus=0.0)
        return Placement(decode, None, f"colocated: each decode replica prefills too ({why})")
    prefill_cpus = max(1.0, math.floor(cpus * PREFILL_CPU_SHARE))
    decode_cpus = max(1.0, cpus - prefill_cpus)
    prefill = _pool(config.prefill, default_cpus=prefill_cpus / config.prefill.num_replicas, num_gpus=0.0)
    decode = _pool(config.decode, default_cpus=decode_cpus / config.decode.num_replicas, num_gpus=0.0)
    return Placement(decode, prefill, f"disaggregated ({why})")


def _pool(pool: PoolConfig, default_cpus: float, num_gpus: float) -> PoolPlacement:
    # A pool pinned to node types (custom resources) cannot be sized from the whole cluster's CPUs.
    cpus = pool.num_cpus if pool.num_cpus is not None else (1.0 if pool.resources else default_cpus)
    gpus = pool.num_gpus if pool.num_gpus is not None else num_gpus
    threads = pool.num_threads or max(1, math.floor(cpus))
    return PoolPlacement(cpus, gpus, threads)


def describe(placement: Placement) -> str:
    """One line for the start-up log."""

    def pool(name: str, p: PoolPlacement) -> str:
        return f"{name}: {p.num_cpus:g} CPUs, {p.num_gpus:g} GPUs, {p.num_threads} threads per replica"

    parts = [pool("decode", placement.decode)]
    if placement.prefill is not None:
        parts.append(pool("prefill", placement.prefill))
    return f"pools: {placement.reason}; " + "; ".join(parts)
