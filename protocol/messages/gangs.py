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
GANG_RESIZE_TAG = b"gang-resize"
# A rank's index (its worker id's, GA4) is its place at placement, or for a rank a grow added
# (GA9) the next index the attempt had not used: fresh ids, so no grown rank is ever mistaken
# for an earlier run (its checkpoints, its port). An attempt uses at most this many.
MAX_GANG_RANK_INDEX = 256
MAX_GANG_RESIZES = 1 << 16   # resize numbers of one attempt (GA9)


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
    SCHEMA: ClassVar = {"job": ENVELOPE, "rank": Int(0, MAX_GANG_RANK_INDEX - 1), "fence": Int(),
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


@record
class GangResize(Record):
    """GA9: resize number ``number`` of the gang ``job``'s placed attempt ``attempt``. A shrink
    (GA8) names the rank that lost its node (``lost``, its worker id): the first ``size`` of
    the other ranks go on, renumbered in order, and ``survivors`` are their nodes' signed
    vectors. A grow (``lost`` empty) adds ranks on ``nodes``, whose signed vectors
    ``capabilities`` show room, after the ranks whose nodes' vectors are ``survivors``."""
    job: bytes
    attempt: int
    number: int
    size: int
    lost: bytes
    nodes: tuple
    capabilities: tuple
    survivors: tuple
    SCHEMA: ClassVar = {"job": ENVELOPE, "attempt": Int(0, 0xFFFF), "number": Int(0, MAX_GANG_RESIZES - 1),
                        "size": Int(1, MAX_GANG_WORKERS), "lost": Bytes(0, 32),
                        "nodes": List(Key(), MAX_GANG_WORKERS), "capabilities": List(ENVELOPE, MAX_GANG_WORKERS),
                        "survivors": List(ENVELOPE, MAX_GANG_WORKERS)}

    def __post_init__(self):
        super().__post_init__()
        if len(self.lost) not in (0, 32):
            raise ValueError("GangResize.lost must be empty (a grow) or a 32-byte worker id")
        if self.lost and (self.nodes or self.capabilities):
            raise ValueError("GangResize: a shrink adds no nodes")
        if not self.lost and (not self.nodes or len(self.capabilities) != len(self.nodes)):
            raise ValueError("GangResize: a grow adds at least one node, each with its vector")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("GangResize.nodes: a node twice")
        if len(self.survivors) + len(self.nodes) != self.size and not self.lost:
            raise ValueError("GangResize.size: a grow's size is its survivors plus its new nodes")

    @property
    def shrinks(self) -> bool:
        return bool(self.lost)


def gang_resize_instance_id(gang_id: bytes, attempt: int, number: int) -> bytes:
    """SPEC.md GA9: the one instance that decides resize ``number`` of the gang's ``attempt``."""
    return hashlib.sha256(GANG_RESIZE_TAG + gang_id + attempt.to_bytes(4, "big") + number.to_bytes(4, "big")).digest()
