"""The quota grant (SPEC.md Q2b): the home member of an owner's pool admits one job
against the owner's quota, and a placement of that job carries the grant."""

from __future__ import annotations

from typing import ClassVar

from protocol.messages.fields import record
from protocol.schema import Bool, Int, Key, Record, Text

QUOTA_LIMIT = 1 << 40   # a Quota's bound (5.5): a demand never exceeds it


@record
class QuotaGrant(Record):
    """``job_id`` (of ``owner``, in ``pool``, named epoch ``epoch``) may hold this demand
    under its owner's quota (or, ``borrowed``, beyond it as preemptible borrowing, Q6):
    signed by the pool's quota home for that owner (Q2b)."""
    KIND: ClassVar = "quota_grant"
    job_id: bytes
    epoch: int
    owner: bytes
    pool: str
    gpu_milli: int
    cpu_milli: int
    mem_mib: int
    # Q6: the job runs beyond its owner's quota as preemptible borrowing (counted as
    # borrowed, not against the quota; in-quota jobs of its pool may reclaim it).
    borrowed: bool = False
    SCHEMA: ClassVar = {"job_id": Key(), "epoch": Int(), "owner": Key(), "pool": Text(0, 64),
                        "gpu_milli": Int(0, QUOTA_LIMIT), "cpu_milli": Int(0, QUOTA_LIMIT),
                        "mem_mib": Int(0, QUOTA_LIMIT), "borrowed": Bool()}
    LEFT_OUT_AT_DEFAULT: ClassVar = {"borrowed": False}   # Q6: an in-quota grant keeps its bytes
