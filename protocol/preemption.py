"""The victim rule of a preemption (SPEC.md P8), a pure function of signed data.

A job every member declined for want of capacity may be placed by stopping lower-priority
preemptible jobs on one node. The leader picks the node and the victims by this rule from
the members' signed capability vectors (each lists the jobs its signer runs, with the age
of their newest checkpoint) and the victims' owner-signed manifests; every validator runs
it again over the same justification and prevotes for the proposal only if it gets the
same value. Preferring the youngest checkpoints is preferring the least lost work: a
victim resumes, on whichever node places it next, from its newest checkpoint.

The fit is counted from the vector alone (free + the victims' resources), so it may be
wrong when the vector is stale; that costs a useless preemption, never an overcommit:
the preempted node frees the victims in its ledger, then bids for the job like any
member, and the job is placed only through that bid (P3-P5, R1).

Reclaim (SPEC.md Q6): a job holding an in-quota grant may also stop jobs of its pool that
run on borrowed quota, whatever their priority, and borrowed victims go first. Which jobs
are borrowed, and whether the job is in quota, is read from the grants the proposal
carries (signed by quota homes), so validators decide it from the proposal alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from protocol.job_table import FENCE_PER_ATTEMPT
from protocol.messages import (MAX_REFUSALS, MAX_VICTIMS, CapabilityVector, JobManifest, Preemption,
                               PreemptionVictim, Resources)

# Declines that say "no room now" (P3); any other reason (policy, zone, health) means the
# node could not take the job even empty, so preempting there would place nothing.
CAPACITY_DECLINES = ("not_enough_gpus", "not_enough_gpu_memory", "not_enough_cpu", "not_enough_memory")
MAX_CANDIDATES = 16   # per node, the youngest checkpoints first: at most 2,516 victim sets are tried


@dataclass(frozen=True)
class Candidate:
    job_id: bytes
    fence: int
    checkpoint_age_ms: int
    resources: Resources
    borrowed: bool = False   # Q6: it runs on borrowed quota (a borrowed grant is in the proposal)


@dataclass(frozen=True)
class Quota:
    """What Q6 reads from the grants a preemption proposal carries: whether the job holds an
    in-quota grant (it may reclaim), and the victims holding a borrowed one."""
    reclaims: bool = False
    borrowed: frozenset = frozenset()


NO_QUOTA = Quota()


def may_be_preempted(job: JobManifest, victim: JobManifest, fence: int, borrowed: bool = False,
                     reclaims: bool = False) -> bool:
    """A victim must be preemptible, of strictly lower priority (or, Q6, borrowed in the job's
    pool while the job is in quota: reclaimed whatever its priority), and have a refusal
    left (R1: a preemption ends its attempt as a refusal does; one beyond MAX_REFUSALS
    would count as a failure)."""
    attempt = fence // FENCE_PER_ATTEMPT
    reclaimable = reclaims and borrowed and victim.scheduling.pool == job.scheduling.pool
    return (victim.scheduling.preemptible and (victim.priority < job.priority or reclaimable)
            and attempt // (victim.max_retries + 1) < MAX_REFUSALS)


def victim_candidates(job: JobManifest, cap: CapabilityVector, manifest_of, quota: Quota = NO_QUOTA) -> list[Candidate]:
    """The jobs ``cap`` lists that may be preempted for ``job``: borrowed ones first (Q6),
    then least lost work (checkpoint age, then job id), at most MAX_CANDIDATES.
    ``manifest_of(job_id)``: the job's manifest, or None when unknown (then it is no candidate)."""
    found: dict[bytes, Candidate] = {}
    for report in cap.running:
        victim = manifest_of(report.job_id)
        borrowed = report.job_id in quota.borrowed
        if (report.job_id in found or victim is None
                or not may_be_preempted(job, victim, report.fence, borrowed, quota.reclaims)):
            continue
        found[report.job_id] = Candidate(report.job_id, report.fence, report.checkpoint_age_ms, victim.resources,
                                         borrowed)
    return sorted(found.values(), key=lambda c: (not c.borrowed, c.checkpoint_age_ms, c.job_id))[:MAX_CANDIDATES]


def in_quota_count(victims) -> int:
    """Q6's ordering step: how many victims run in quota (borrowed victims go first)."""
    return sum(1 for v in victims if not v.borrowed)


def fits_after(job: JobManifest, cap: CapabilityVector, victims) -> bool:
    """Whether ``job`` fits on the vector's node once ``victims`` are gone: every GPU there
    of the job's model (if it names one) and memory, and enough whole GPUs, CPU and memory
    free or held by the victims. A GPU share (``gpu_milli``) frees no whole GPU."""
    res = job.resources
    if res.gpus:
        if any(g.mem_total_mib < res.gpu_mem_mib or (res.gpu_model and g.model != res.gpu_model)
               for g in cap.gpus):
            return False
        whole = len(set(cap.gpus_free)) + sum(v.resources.gpus for v in victims if not v.resources.gpu_milli)
        if whole < res.gpus:
            return False
    return (cap.cpu_milli_free + sum(v.resources.cpu_milli for v in victims) >= res.cpu_milli
            and cap.mem_mib_free + sum(v.resources.mem_mib for v in victims) >= res.mem_mib)


def choose_victims(job: JobManifest, cap: CapabilityVector, manifest_of,
                   quota: Quota = NO_QUOTA) -> tuple[Candidate, ...] | None:
    """The rule on one node: None if the job fits without preempting or no set of at most
    MAX_VICTIMS candidates makes room; else the smallest such set, among those the one with
    the fewest in-quota victims (Q6), then the least total checkpoint age, then the lowest
    sorted job ids; in job id order."""
    if fits_after(job, cap, ()):
        return None
    candidates = victim_candidates(job, cap, manifest_of, quota)
    for size in range(1, MAX_VICTIMS + 1):
        best = None
        for chosen in combinations(candidates, size):
            if fits_after(job, cap, chosen):
                key = (in_quota_count(chosen), sum(c.checkpoint_age_ms for c in chosen), sorted(c.job_id for c in chosen))
                if best is None or key < best[0]:
                    best = (key, chosen)
        if best is not None:
            return tuple(sorted(best[1], key=lambda c: c.job_id))
    return None


def choose_preemption(job_envelope: bytes, job: JobManifest, attempt: int, vectors: dict,
                      capacity_decliners, manifest_of, quota: Quota = NO_QUOTA) -> Preemption | None:
    """The rule over nodes: of the vectors (node key -> CapabilityVector) of members that
    declined the job for capacity, the node whose victim set is smallest, then has the
    fewest in-quota victims (Q6), then loses the least checkpoint age in total, then has
    the lowest key."""
    best = None
    for node in sorted(vectors):
        if node not in capacity_decliners:
            continue
        victims = choose_victims(job, vectors[node], manifest_of, quota)
        if victims is None:
            continue
        key = (len(victims), in_quota_count(victims), sum(v.checkpoint_age_ms for v in victims), node)
        if best is None or key < best[0]:
            best = (key, node, victims)
    if best is None:
        return None
    _key, node, victims = best
    return Preemption(job=job_envelope, attempt=attempt, node=node,
                      victims=tuple(PreemptionVictim(job_id=v.job_id, fence=v.fence) for v in victims))
