"""The consensus messages (SPEC.md 6): proposals, votes, the certificates a collector
builds from them, round changes and syncs, and equivocation evidence."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol import codec
from protocol.caches import CoreCaches
from protocol.messages.fields import ENVELOPE, MAX_JUSTIFICATION, MAX_NODES, VALUE_KINDS, record
from protocol.schema import Bytes, Int, Key, List, Optional, Record, Text


@record
class Proposal(Record):
    KIND: ClassVar = "proposal"
    instance: bytes
    round: int
    epoch: int
    value_kind: str
    value: bytes
    justification: tuple
    pol_round: int | None
    pol_certificate: bytes | None
    SCHEMA: ClassVar = {
        "instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(), "value_kind": Text(choices=VALUE_KINDS),
        "value": Bytes(1, codec.MAX_FRAME_BYTES), "justification": List(ENVELOPE, MAX_JUSTIFICATION),
        "pol_round": Optional(Int(0, 1 << 20)), "pol_certificate": Optional(ENVELOPE),
    }


@record
class Prevote(Record):
    KIND: ClassVar = "prevote"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_hash": Optional(Key())}


@record
class Precommit(Record):
    KIND: ClassVar = "precommit"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    SCHEMA: ClassVar = dict(Prevote.SCHEMA)


@record
class PrevoteCertificate(Record):
    """More than 2/3 of the epoch's stake prevoted ``value_hash`` in ``round`` (a "polka")."""
    KIND: ClassVar = "prevote_cert"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    prevotes: tuple
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_hash": Optional(Key()), "prevotes": List(ENVELOPE, MAX_NODES)}


@record
class CommitCertificate(Record):
    """More than 2/3 of the epoch's stake precommitted ``value``: the decision, verifiable offline."""
    KIND: ClassVar = "commit"
    instance: bytes
    round: int
    epoch: int
    value_kind: str
    value: bytes
    precommits: tuple
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_kind": Text(choices=VALUE_KINDS), "value": Bytes(1, codec.MAX_FRAME_BYTES),
                        "precommits": List(ENVELOPE, MAX_NODES)}


@record
class RoundChange(Record):
    """Sent to the next round's leader on timeout, carrying the sender's lock (SPEC.md 6.5)."""
    KIND: ClassVar = "round_change"
    instance: bytes
    round: int
    epoch: int
    locked_round: int | None
    lock_certificate: bytes | None
    lock_proposal: bytes | None  # the signed Proposal whose value is locked: lets the new leader re-propose it
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "locked_round": Optional(Int(0, 1 << 20)), "lock_certificate": Optional(ENVELOPE),
                        "lock_proposal": Optional(ENVELOPE)}


@record
class RoundSync(Record):
    """A collector's proof that members holding more than 1/3 of the stake entered ``round``:
    their RoundChanges, so members still in earlier rounds catch up (SPEC.md 6.5)."""
    KIND: ClassVar = "round_sync"
    instance: bytes
    round: int
    epoch: int
    changes: tuple  # RoundChange envelopes for (instance, round, epoch), distinct signers
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "changes": List(ENVELOPE, MAX_NODES)}


@record
class Evidence(Record):
    """Two conflicting envelopes signed by one key: proof of equivocation."""
    KIND: ClassVar = "evidence"
    offender: bytes
    first: bytes
    second: bytes
    SCHEMA: ClassVar = {"offender": Key(), "first": ENVELOPE, "second": ENVELOPE}


def value_hash(value_bytes: bytes, *, caches: CoreCaches | None = None) -> bytes:
    """SPEC.md 6.4. Remembered in ``caches.value_hashes``: a slot's value (P7) is up to
    hundreds of KiB, and every vote, certificate and late job's proof asks for the hash
    of the same bytes."""
    table = caches.value_hashes if caches is not None else None
    if table is not None:
        hit = table.lookup(value_bytes)
        if hit is not None:
            return hit
    digest = hashlib.sha256(b"meshnode/v1/value\x00" + value_bytes).digest()
    if table is not None:
        table.remember(value_bytes, digest)
    return digest
