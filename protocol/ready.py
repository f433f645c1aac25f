"""The output contract of the protocol core (STYLE.md: etcd raft's Ready).

Every input to ``protocol.mesh.MeshCore`` (``step``, ``tick``, ``submit``,
``local_checkpoint`` ...) returns one ``Ready`` batch. The driver handles it in
this order, and only then feeds the next input:

1. ``persist``: write every record durably (SQLite) BEFORE sending anything, because
   the messages may promise what the records say (a vote, a lock, an ack).
2. ``messages``: send each to its recipient (``to=None``: every other member of the
   current epoch). Sending is best effort; the protocol tolerates loss.
3. ``decisions``: in order. Certified ones need no more from the driver than storing; the
   workload orders ("stop", then "run": protocol/workload_orders.py) are executed as given.
4. ``events``: log them and publish them to control-API subscribers.

protocol/drain.py is the one implementation of this order, used by every driver: an input
fed to the core while a batch is drained (a started workload's report) is queued behind it.

The core never blocks, never reads a clock and never raises on bad remote input
(it counts it); a LocalProtocolError means the driver broke this contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Outbound:
    to: bytes | None  # recipient public key; None = broadcast to all other current members
    data: bytes       # an encoded signed envelope, ready for the wire


@dataclass(frozen=True)
class PersistRecord:
    table: str        # "certificates", "votes", "locks", "evidence", "checkpoints", "membership", ...
    key: str          # primary key within the table (hex ids)
    value: dict[str, Any]  # canonical-encodable columns


@dataclass(frozen=True)
class Decision:
    # Certified: "placement" | "placement_slot" | "eviction" | "membership" (value: the
    # decoded Placement | PlacementSlot | Eviction | MembershipChange). Local, uncertified
    # (certificate b"", instance NO_INSTANCE, value: job ids): "halt" | "resume" | "stop" | "cancel".
    value_kind: str
    instance: bytes
    value: Any
    certificate: bytes    # encoded signed CommitCertificate envelope (verifiable offline)


@dataclass(frozen=True)
class Event:
    kind: str             # short machine name: "job_submitted", "bid", "declined", "decided", ...
    at_ms: int
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ready:
    persist: list[PersistRecord] = field(default_factory=list)
    messages: list[Outbound] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def extend(self, other: "Ready") -> "Ready":
        self.persist.extend(other.persist)
        self.messages.extend(other.messages)
        self.decisions.extend(other.decisions)
        self.events.extend(other.events)
        return self

    def __bool__(self) -> bool:
        return bool(self.persist or self.messages or self.decisions or self.events)


NO_INSTANCE = bytes(32)  # the instance field of local, uncertified decisions


def local_decision(kind: str, job_ids: tuple) -> Decision:
    """An uncertified decision about this node's own workloads: "halt", "resume", "stop",
    "cancel" (protocol/mesh.py lists what each means to the driver)."""
    return Decision(kind, NO_INSTANCE, tuple(job_ids), b"")
