"""Moving a healthy running job (SPEC.md R2, R3): the owner's signed request, the reflex
trigger that stands in for it when a manifest's rule fired, and the value a move
instance decides."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol.messages.fields import ENVELOPE, record
from protocol.schema import Bytes, Int, Key, List, Record

MOVE_INSTANCE_TAG = b"job-move"
MAX_REFLEXES = 8          # reflex rules one manifest may hold (SPEC.md 4.2)
MAX_EVIDENCE = 64         # signed vectors one reflex trigger may carry (R3)


@record
class MoveRequest(Record):
    """The job's owner asks the mesh to move its running job from the primary it has at
    ``fence`` to ``to_node`` (empty: a node the mesh picks). Only the owner's signature
    counts; naming the fence makes a replayed request stale once the job has moved."""
    KIND: ClassVar = "move_request"
    job_id: bytes
    fence: int
    to_node: bytes
    requested_ms: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "to_node": Bytes(0, 32), "requested_ms": Int()}

    def __post_init__(self):
        super().__post_init__()
        if len(self.to_node) not in (0, 32):
            raise ValueError("MoveRequest.to_node must be empty or a 32-byte key")


@record
class RunStopped(Record):
    """R2a: a move took the job off the signer, its primary at ``fence``, and that run has
    stopped: the new primary may start once it holds the run's checkpoint ``seq`` (the last
    one the signer handed over; 0: none) or a newer one."""
    KIND: ClassVar = "run_stopped"
    job_id: bytes
    fence: int
    seq: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "seq": Int()}


@record
class ReflexTrigger(Record):
    """R3: rule ``rule`` of the job's manifest held on its primary at ``fence``; ``evidence``
    is the primary's own signed capability vectors, consecutive by seq, that show it. It
    stands where an owner's MoveRequest stands in a JobMove; its signer (any member) adds
    no trust: validators check the evidence."""
    KIND: ClassVar = "reflex_trigger"
    job_id: bytes
    fence: int
    rule: int
    evidence: tuple
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "rule": Int(0, MAX_REFLEXES - 1),
                        "evidence": List(ENVELOPE, MAX_EVIDENCE)}

    @property
    def to_node(self) -> bytes:
        return b""   # a reflex names no target: the mesh picks one (R3), as for a request naming none


@record
class JobMove(Record):
    """The value a move instance decides (R2): the job of ``request`` (an owner's
    MoveRequest, or a ReflexTrigger, R3) leaves ``from_node``
    (its primary at the request's fence) for ``to_node``, whose signed capability vector
    ``capability`` shows room for it, with ``backups`` as its new backups."""
    KIND: ClassVar = "job_move"
    request: bytes
    from_node: bytes
    to_node: bytes
    backups: tuple
    capability: bytes
    SCHEMA: ClassVar = {"request": ENVELOPE, "from_node": Key(), "to_node": Key(), "backups": List(Key(), 4),
                        "capability": ENVELOPE}


def move_instance_id(job_id: bytes, fence: int) -> bytes:
    """R2: the one instance that may move ``job_id`` away from its primary at ``fence``."""
    return hashlib.sha256(MOVE_INSTANCE_TAG + job_id + fence.to_bytes(8, "big")).digest()
