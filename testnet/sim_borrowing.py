"""The simulator's audit of borrowing (SPEC.md Q6), checked at each instance's first decision:
every job placed on a borrowed grant is preemptible, and a preemption stops a job of equal or
higher priority than the job it places only when it reclaims: the victim runs on borrowed
quota in the job's pool and the job holds an in-quota grant. Which jobs are borrowed is read
from the grants the members hold (every member's core, the Byzantine ones' too: a grant a
validator accepted was signed by a quota home, and the leader that carried it holds it).

Also what the quota overshoot counters leave out: a borrowed job's demand is not held against
its owner's quota (Q6), so the checker's in-quota usage excludes jobs placed borrowed.
"""

from __future__ import annotations


class BorrowingAudit:
    def __init__(self, checker, job_of_id: dict, cores) -> None:
        self.checker = checker
        self.job_of_id = job_of_id
        self.cores = cores          # () -> the live cores (honest and Byzantine)
        self.borrowed: set[bytes] = set()   # jobs placed while a borrowed grant of them was held
        self.counters = {"borrowed_placements": 0, "reclaims": 0, "borrowed_victims": 0}

    def grants_of(self, jid: bytes) -> set:
        """The kinds of grant (True: borrowed) the members hold of the job."""
        kinds = set()
        for core in self.cores():
            kept = core.bidding.scheduling.admission.granted.get(jid)
            if kept is not None:
                kinds.add(kept[0].borrowed)
        return kinds

    def placed(self, node: int, instance: bytes, jid: bytes) -> None:
        if True not in self.grants_of(jid):
            return
        self.borrowed.add(jid)
        self.counters["borrowed_placements"] += 1
        job = self.job_of_id.get(jid)
        if job is not None and not job.scheduling.preemptible:
            self.checker.fail("borrowed_not_preemptible", node, instance,
                              "job %s placed on a borrowed grant is not preemptible" % jid.hex()[:8])

    def preempted(self, node: int, instance: bytes, jid: bytes, victims) -> None:
        job = self.job_of_id.get(jid)
        if job is None:
            return
        reclaimed = 0
        for victim in victims:
            self.counters["borrowed_victims"] += True in self.grants_of(victim.job_id)
            manifest = self.job_of_id.get(victim.job_id)
            if manifest is None or manifest.priority < job.priority:
                continue   # P8: a lower-priority victim needs no reclaim
            reclaimed += 1
            if (True not in self.grants_of(victim.job_id) or manifest.scheduling.pool != job.scheduling.pool
                    or False not in self.grants_of(jid)):
                self.checker.fail("reclaim_of_in_quota_job", node, instance,
                                  "job %s (priority %d) preempted job %s (priority %d) that is not borrowed in "
                                  "its pool, or without an in-quota grant of its own" % (
                                      jid.hex()[:8], job.priority, victim.job_id.hex()[:8], manifest.priority))
        self.counters["reclaims"] += reclaimed > 0
