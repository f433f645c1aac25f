"""The scheduling rules a member applies to its own bids, from the genesis's pools and
reservations switch (SPEC.md Q1-Q5, Q2b-Q2c): a job whose owner has a quota is declined
``over_quota`` until its quota home granted it (Q2b; a gang: while over its owner's quota
by this member's count, Q2); with reservations on, a job that would delay the first job
waiting here for capacity is declined ``reserved``. The reservation rule is a per-member
bid rule, like free capacity; the quota is checked by validators through the grant (Q2c).

Also what "why pending" reports beyond the declines: the job's queue position, what
holds it and an estimated start (Q3, Q4).
"""

from __future__ import annotations

from protocol.job_queue import (Room, backfill_error, ends_ms, queue_position, reservation_holder,
                                start_estimate)
from protocol.job_table import LIVE_JOB_STATES
from protocol.quota import Quotas
from protocol.quota_admission import QuotaAdmission


class PoolScheduling:
    def __init__(self, ctx, epochs, jobs, ledger, jobs_bid_for=lambda: (), capability=None) -> None:
        self.ctx = ctx
        self.jobs = jobs
        self.ledger = ledger
        self.jobs_bid_for = jobs_bid_for   # the pending jobs this member holds a bid for (Q2)
        self.quotas = Quotas(getattr(ctx.genesis, "pools", ()))
        self.reservations = bool(getattr(ctx.genesis, "reservations", False))
        self.admission = QuotaAdmission(ctx, epochs, jobs, self.quotas, capability)   # quota homes and grants (Q2b)

    @property
    def enabled(self) -> bool:
        return self.quotas.enabled or self.reservations

    def bid_check(self, record, now_ms: int) -> tuple[bool, str | None, str]:
        """Q2 then Q5, for a job that passed the policy and capability checks (P3)."""
        if not self.enabled:
            return True, None, ""
        problem = self._quota_problem(record, now_ms)
        if problem is not None:
            reason = "unknown_pool" if self.quotas.unknown_pool_error(record.manifest) else "over_quota"
            return False, reason, problem
        if self.reservations:
            holder = reservation_holder(record, self.jobs, self.ctx.me, self._total(),
                                        quota_holds=lambda held: self._quota_holds(held, now_ms))
            if holder is not None:
                problem = backfill_error(record, holder, self._free(), self._running(), now_ms)
                if problem is not None:
                    return False, "reserved", problem
        return True, None, ""

    def _quota_problem(self, record, now_ms: int) -> str | None:
        """Why the quota holds the job here now: no grant yet (Q2b), or, for a job that needs
        none (a gang), Q2's count; None when it does not."""
        if self.admission.needs_grant(record.manifest):
            return self.admission.wait_report(record, now_ms)   # granted: capacity alone decides the bid (Q2c)
        return self.quotas.over_quota(record.manifest, self.jobs, bid_for=self.jobs_bid_for())

    def _quota_holds(self, record, now_ms: int) -> bool:
        """Q2 or Q2b at this member now, for a job that would hold capacity here (Q5)."""
        return self.quotas.enabled and self._quota_problem(record, now_ms) is not None

    def stamp(self):
        """What the bid rules read besides the ledger: which jobs are pending or live here.
        A change makes held placements be decided afresh (P3a). None when the rules are off."""
        if not self.enabled:
            return None
        return self.admission.stamp() + sum(hash((r.job_id, r.state, r.instance)) for r in self.jobs
                                            if r.state == "pending" or r.state in LIVE_JOB_STATES)

    def _total(self) -> Room:
        ledger = self.ledger
        return Room(len(ledger.gpu_mem_total_mib), ledger.cpu_milli, ledger.mem_mib)

    def _free(self) -> Room:
        ledger = self.ledger
        return Room(len(ledger.free_gpus()), ledger.free_cpu_milli(), ledger.free_mem_mib())

    def _running(self) -> list:
        """(end ms or None, Room) of each job allocated here (allocations are keyed by job id)."""
        out = []
        for key, claim in self.ledger.allocations().items():
            record = self.jobs.get(key)
            out.append((ends_ms(record) if record is not None else None,
                        Room(len(claim.gpus), claim.cpu_milli, claim.mem_mib)))
        return out

    def pending_report(self, record, free_by_node: dict, now_ms: int) -> dict:
        """Q4, for "why pending": the job's pool, its place in the pool's queue, the quota
        that holds it (if any), and its estimated start. ``free_by_node``: node -> Room from
        the capability vectors this node holds."""
        job = record.manifest
        position, length = queue_position(self.jobs, record)
        pool = job.scheduling.pool
        quota_problem = self._quota_problem(record, now_ms) if self.quotas.enabled else None
        estimate = start_estimate(record, self.jobs, self.quotas, free_by_node, now_ms)
        ahead_higher = sum(1 for r in self.jobs if r.state == "pending" and r.manifest.scheduling.pool == pool
                           and r.manifest.priority > job.priority)
        return {"pool": pool, "position": position, "queue_length": length, "quota": quota_problem,
                "ahead_with_higher_priority": ahead_higher, "estimate": estimate.as_dict(now_ms)}
