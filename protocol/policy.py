"""A node operator's sovereignty policy and capacity, as the protocol core sees them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodePolicy:
    allowed_owners: frozenset[bytes] | None = None   # None: any owner key may place jobs here
    allowed_entrypoints: frozenset[str] = frozenset({"counter", "train", "allreduce"})
    zone: str = "zone-a"
    labels: tuple[tuple[str, str], ...] = ()
    attestations: tuple[bytes, ...] = ()             # authority-signed Attestation envelopes for this node


@dataclass(frozen=True)
class LocalCapacity:
    """What this node can offer right now, from telemetry (NVML or a simulated profile)."""
    gpu_mem_total_mib: tuple[int, ...] = ()          # one entry per GPU, by index
    cpu_milli: int = 8000
    mem_mib: int = 32768
    gpu_model: str = "sim"
    rail_group: str = ""
    extra: dict = field(default_factory=dict)
