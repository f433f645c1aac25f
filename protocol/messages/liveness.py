"""Liveness, failure and checkpoints (SPEC.md 9, F1-F7): heartbeats, suspicions, the
eviction an emergency instance decides, checkpoints and their acks, and the epoch
catch-up request."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol.messages.fields import MAX_STATE_BYTES, record
from protocol.schema import Bytes, Int, Key, List, Nested, Record

SYNC_HAVE_PREFIX_BYTES = 8   # of an instance id: a sync request names what it has by these (F6d)
SYNC_HAVE_MAX = 256          # the requester's newest applied decisions it names (= MAX_DECIDED_KEPT)


# --- eviction (SPEC.md F4-F7) ------------------------------------------------------------------

@record
class Migration(Record):
    job_id: bytes
    to_node: bytes
    backups: tuple
    SCHEMA: ClassVar = {"job_id": Key(), "to_node": Key(), "backups": List(Key(), 4)}


@record
class Eviction(Record):
    """The value an emergency instance decides: fence ``node`` and move its workloads."""
    KIND: ClassVar = "eviction"
    node: bytes
    epoch: int
    migrations: tuple
    SCHEMA: ClassVar = {"node": Key(), "epoch": Int(), "migrations": List(Nested(Migration), 1024)}


# --- liveness and checkpoints --------------------------------------------------------------

@record
class Heartbeat(Record):
    KIND: ClassVar = "heartbeat"
    epoch: int
    seq: int
    sent_ms: int
    SCHEMA: ClassVar = {"epoch": Int(), "seq": Int(), "sent_ms": Int()}


@record
class Suspicion(Record):
    KIND: ClassVar = "suspicion"
    suspect: bytes
    epoch: int
    silent_ms: int
    SCHEMA: ClassVar = {"suspect": Key(), "epoch": Int(), "silent_ms": Int()}


@record
class Checkpoint(Record):
    KIND: ClassVar = "checkpoint"
    job_id: bytes
    fence: int
    seq: int
    progress: int
    taken_ms: int
    state: bytes
    state_hash: bytes
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "seq": Int(), "progress": Int(),
                        "taken_ms": Int(), "state": Bytes(0, MAX_STATE_BYTES), "state_hash": Key()}

    def __post_init__(self):
        super().__post_init__()
        if hashlib.sha256(self.state).digest() != self.state_hash:
            raise ValueError("Checkpoint.state_hash does not match state")


@record
class CheckpointAck(Record):
    KIND: ClassVar = "checkpoint_ack"
    job_id: bytes
    fence: int
    seq: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "seq": Int()}


@record
class SyncRequest(Record):
    """Ask peers for the epoch-change certificates from ``epoch`` on (a paused or rejoining node).
    ``have``: the first 8 bytes of the instance ids of the decisions the requester applied
    last (SPEC.md F6d), which the answer leaves out; left out when empty."""
    KIND: ClassVar = "sync_request"
    epoch: int
    have: tuple = ()
    SCHEMA: ClassVar = {"epoch": Int(), "have": List(Bytes(SYNC_HAVE_PREFIX_BYTES, SYNC_HAVE_PREFIX_BYTES),
                                                     SYNC_HAVE_MAX)}
    LEFT_OUT_AT_DEFAULT: ClassVar = {"have": ()}   # F6d: a request without it keeps its bytes
