"""What every part of one node's core shares and never changes after start: who the node
is, which mesh it is in, its policy and capacity, its injected randomness, and the one
Counter of drop reasons (SPEC.md 2.4: bad remote input is dropped and counted).

The mutable state the parts share is not here: it lives in explicit objects that the
core hands to each part (protocol/epochs.py, job_table.py, ledger.py, liveness.py,
instances.py), so a reader of a part sees from its constructor what it touches.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from protocol.caches import CoreCaches
from protocol.messages import encode_message, encode_unsigned
from protocol.policy import LocalCapacity, NodePolicy
from protocol.ready import Event


@dataclass
class NodeContext:
    identity: object                 # a protocol.signing.SigningIdentity: signs what this node sends
    genesis: object                  # keys.genesis.Genesis: the mesh's founding document
    policy: NodePolicy
    capacity: LocalCapacity
    rng: random.Random
    heartbeats: bool = True          # False: no heartbeats, detection or self-fencing (scale runs)
    bid_sample: int | None = None    # about this many members bid per job (P3), None: all
    counters: Counter = field(default_factory=Counter)
    caches: CoreCaches = field(default_factory=CoreCaches)   # this core's own memo tables

    def __post_init__(self) -> None:
        self.me: bytes = self.identity.public_key
        self.mesh_id: bytes = self.genesis.mesh_id
        self.params = self.genesis.params
        self.authorities = tuple(self.genesis.authorities)

    def sign(self, message) -> bytes:
        """``message`` in a signed envelope of this mesh, ready for the wire."""
        return encode_message(self.identity, self.mesh_id, message, caches=self.caches)

    def unsigned(self, message) -> bytes:
        """``message`` (a channel-authenticated kind: a heartbeat) with no signature (SPEC.md F1)."""
        return encode_unsigned(self.me, self.mesh_id, message)

    @staticmethod
    def event(kind: str, now_ms: int, **detail) -> Event:
        return Event(kind, now_ms, detail)
