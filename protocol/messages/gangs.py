"""The value a gang's replacement instance decides (SPEC.md GA7, GA8): a rank whose node
was evicted gets a new node that keeps the gang's topology rule, or an elastic gang
shrinks to a smaller size it allows."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol.messages.fields import ENVELOPE, record
from protocol.messages.jobs import MAX_GANG_WORKERS
from protocol.schema import Bytes, Int, Key, List, Record

GANG_REPLACE_TAG = b"gang-replace"


@record
class GangReplacement(Record):
    """GA7: rank ``rank`` of the gang ``job`` lost its node at fence ``fence - 1``; it goes
    on at ``to_node`` (whose signed vector ``capability`` shows room) with ``backups``, and
    ``survivors`` are the other ranks' nodes' signed vectors, in rank order (the topology
    check). GA8: ``to_node`` empty means the gang shrinks to ``size`` ranks instead: the
    first ``size`` surviving ranks go on, renumbered in order, the others stop."""
    job: bytes
    rank: int
    fence: int
    to_node: bytes
    capability: bytes
    survivors: tuple
    size: int
    backups: tuple
    SCHEMA: ClassVar = {"job": ENVELOPE, "rank": Int(0, MAX_GANG_WORKERS - 1), "fence": Int(),
                        "to_node": Bytes(0, 32), "capability": Bytes(0, 1 << 16),
                        "survivors": List(ENVELOPE, MAX_GANG_WORKERS), "size": Int(1, MAX_GANG_WORKERS),
                        "backups": List(Key(), 4)}

    def __post_init__(self):
        super().__post_init__()
        if len(self.to_node) not in (0, 32):
            raise ValueError("GangReplacement.to_node must be empty (a shrink) or a 32-byte key")
        if bool(self.to_node) != bool(self.capability):
            raise ValueError("GangReplacement.capability: a replacement carries its node's vector, a shrink none")
        if self.to_node in self.backups or len(set(self.backups)) != len(self.backups):
            raise ValueError("GangReplacement.backups: a backup twice, or the replacement itself")

    @property
    def shrinks(self) -> bool:
        return not self.to_node


def gang_replace_instance_id(worker_id: bytes, fence: int) -> bytes:
    """SPEC.md GA7: the one instance that decides how rank ``worker_id`` goes on at ``fence``
    (the fence its node's eviction gave it)."""
    return hashlib.sha256(GANG_REPLACE_TAG + worker_id + fence.to_bytes(8, "big")).digest()
