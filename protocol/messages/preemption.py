"""The value a preemption instance decides (SPEC.md P8): to place one job's attempt, the
listed lower-priority preemptible jobs stop on one node and are placed afresh from
their checkpoints."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol.messages.fields import ENVELOPE, record
from protocol.messages.jobs import JobManifest, placement_attempts, placement_instance_id
from protocol.schema import Int, Key, List, Nested, Record

MAX_VICTIMS = 4    # jobs one preemption may stop (P8: a minimal set, searched up to this size)


@record
class PreemptionVictim(Record):
    """A job the node runs as primary at ``fence`` (its signed vector says so), to stop."""
    job_id: bytes
    fence: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int()}


@record
class Preemption(Record):
    """To place ``job``'s ``attempt``, stop ``victims`` on ``node`` (SPEC.md P8)."""
    job: bytes
    attempt: int
    node: bytes
    victims: tuple
    SCHEMA: ClassVar = {"job": ENVELOPE, "attempt": Int(0, 1 << 16), "node": Key(),
                        "victims": List(Nested(PreemptionVictim), MAX_VICTIMS)}

    def __post_init__(self):
        super().__post_init__()
        if not self.victims:
            raise ValueError("Preemption.victims: a preemption stops at least one job")
        ids = [v.job_id for v in self.victims]
        if ids != sorted(set(ids)):
            raise ValueError("Preemption.victims: job ids must be distinct and in ascending order")


def preemption_instance_id(placement_instance: bytes) -> bytes:
    """SPEC.md P8: the one preemption instance of a job's placement instance (its attempt)."""
    return hashlib.sha256(b"preempt" + placement_instance).digest()


def preemption_binding_error(iid: bytes, job: JobManifest, jid: bytes, attempt: int, epoch: int) -> str | None:
    """Why a preemption for ``job``'s ``attempt`` may not be decided as ``iid`` in ``epoch``."""
    if attempt >= placement_attempts(job):
        return "attempt %d is beyond the job's %d" % (attempt, placement_attempts(job))
    if iid != preemption_instance_id(placement_instance_id(jid, attempt)):
        return "instance is not this job attempt's preemption"
    if job.epoch != epoch:
        return "the job is placed in epoch %d, not %d" % (job.epoch, epoch)
    return None
