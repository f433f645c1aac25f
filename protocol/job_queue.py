"""Pending jobs in queue order, when they may start, and the reservation a waiting job
holds against smaller ones (SPEC.md Q3-Q5).

Queue order (Q3) is a function of signed manifest fields and the job id only, so every
member orders the same jobs the same way: higher priority first, then earlier
``created_ms``, then smaller job id. A pool's queue is its pending jobs in that order.

Estimated start (Q4) is informative: from the declared ``max_runtime_ms`` of live jobs
(ending at their placement time here plus that runtime), when the owner's quota and some
node's capacity would both let the job in. "Unknown" when a job it waits for declared no
runtime.

Reservation and backfill (Q5) are part of a member's bid rule, like its free capacity:
a member that declined the first job of the queue for want of capacity holds that
capacity for it, and bids for a job behind it only when that job cannot delay it.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.job_table import LIVE_JOB_STATES
from protocol.quota import demand

CAPACITY_REASONS = ("not_enough_gpus", "not_enough_gpu_memory", "not_enough_cpu", "not_enough_memory")


def queue_key(record) -> tuple:
    """Q3: smaller is earlier in the queue."""
    return (-record.manifest.priority, record.manifest.created_ms, record.job_id)


def pool_queue(jobs, pool: str) -> list:
    """Q3: the pending jobs of ``pool``, in queue order."""
    return sorted((r for r in jobs if r.state == "pending" and r.manifest.scheduling.pool == pool), key=queue_key)


def queue_position(jobs, record) -> tuple[int, int]:
    """(1-based position of ``record`` in its pool's queue, the queue's length); 0 if it is not pending."""
    queue = pool_queue(jobs, record.manifest.scheduling.pool)
    ids = [r.job_id for r in queue]
    return (ids.index(record.job_id) + 1 if record.job_id in ids else 0), len(queue)


def ends_ms(record) -> int | None:
    """When a live job ends at the latest, on this node's clock: placed here + declared runtime."""
    runtime = record.manifest.scheduling.max_runtime_ms
    if not runtime or record.placed_ms is None:
        return None
    return record.placed_ms + runtime


@dataclass(frozen=True)
class Room:
    """Capacity as a node counts it: whole GPUs, milli-CPU, MiB."""
    gpus: int = 0
    cpu_milli: int = 0
    mem_mib: int = 0

    @classmethod
    def of(cls, resources) -> "Room":
        return cls(resources.gpus, resources.cpu_milli, resources.mem_mib)

    def __add__(self, other: "Room") -> "Room":
        return Room(self.gpus + other.gpus, self.cpu_milli + other.cpu_milli, self.mem_mib + other.mem_mib)

    def __sub__(self, other: "Room") -> "Room":
        return Room(self.gpus - other.gpus, self.cpu_milli - other.cpu_milli, self.mem_mib - other.mem_mib)

    def holds(self, need: "Room") -> bool:
        return self.gpus >= need.gpus and self.cpu_milli >= need.cpu_milli and self.mem_mib >= need.mem_mib


def _first_fit_time(free: Room, need: Room, ending: list, now_ms: int) -> tuple[int | None, Room]:
    """When ``need`` fits in ``free`` as the ``ending`` jobs ((end ms or None, Room)) end,
    earliest first, and what is free then. (None, ...) when a job it waits for has no
    declared end, or it never fits."""
    if free.holds(need):
        return now_ms, free
    for end, room in sorted(ending, key=lambda e: (e[0] is None, e[0] or 0)):
        if end is None:
            return None, free
        free = free + room
        if free.holds(need):
            return max(end, now_ms), free
    return None, free


@dataclass(frozen=True)
class Estimate:
    start_ms: int | None   # None: unknown or never
    reason: str            # why then, or why unknown

    def as_dict(self, now_ms: int) -> dict:
        return {"start_ms": self.start_ms, "in_ms": None if self.start_ms is None else max(0, self.start_ms - now_ms),
                "reason": self.reason}


def quota_estimate(record, jobs, quotas, now_ms: int) -> Estimate:
    """Q4: when the owner's live jobs in the pool have freed enough of its quota."""
    job = record.manifest
    limit = quotas.limit(job.scheduling.pool, job.owner)
    if limit is None:
        return Estimate(now_ms, "no quota")
    need = demand(job.resources)
    if need.exceeds(limit):
        return Estimate(None, "never: the job alone is over its quota")
    held = quotas.usage(jobs, job.owner, job.scheduling.pool)
    if not (held + need).exceeds(limit):
        return Estimate(now_ms, "within quota")
    owners_jobs = sorted((r for r in jobs if r.state in LIVE_JOB_STATES and r.manifest.owner == job.owner
                          and r.manifest.scheduling.pool == job.scheduling.pool),
                         key=lambda r: (ends_ms(r) is None, ends_ms(r) or 0, r.job_id))
    for other in owners_jobs:
        end = ends_ms(other)
        if end is None:
            return Estimate(None, "unknown: job %s of the same owner and pool declared no max_runtime_ms"
                            % other.job_id.hex()[:8])
        held = held - demand(other.manifest.resources)
        if not (held + need).exceeds(limit):
            return Estimate(max(end, now_ms), "quota frees when job %s ends" % other.job_id.hex()[:8])
    return Estimate(None, "unknown")


def capacity_estimate(record, jobs, free_by_node: dict, now_ms: int) -> Estimate:
    """Q4: the earliest time some node's free capacity (``free_by_node``: node -> Room, from
    its capability vector) plus what its live jobs free as they end would hold the job."""
    need = Room.of(record.manifest.resources)
    ending_by_node: dict[bytes, list] = {}
    for other in jobs:
        if other.state in LIVE_JOB_STATES and other.primary in free_by_node:
            ending_by_node.setdefault(other.primary, []).append((ends_ms(other), Room.of(other.manifest.resources)))
    best = None
    for node, free in sorted(free_by_node.items()):
        start, _ = _first_fit_time(free, need, ending_by_node.get(node, []), now_ms)
        if start is not None and (best is None or start < best[0]):
            best = (start, node)
    if best is None:
        return Estimate(None, "unknown: no node frees enough by declared runtimes")
    if best[0] <= now_ms:
        return Estimate(now_ms, "node %s has room now" % best[1].hex()[:8])
    return Estimate(best[0], "node %s frees enough by then" % best[1].hex()[:8])


def start_estimate(record, jobs, quotas, free_by_node: dict, now_ms: int) -> Estimate:
    """Q4: the later of the quota's and the capacity's estimates; unknown if either is."""
    by_quota = quota_estimate(record, jobs, quotas, now_ms)
    by_room = capacity_estimate(record, jobs, free_by_node, now_ms)
    for estimate in (by_quota, by_room):
        if estimate.start_ms is None:
            return estimate
    return max(by_quota, by_room, key=lambda e: e.start_ms)


# --- reservations and backfill (Q5) -----------------------------------------------------------
def reservation_holder(record, jobs, me: bytes, total: Room, quota_holds=lambda other: False):
    """Q5: the job this member holds capacity for against ``record``: the first pending job
    ahead of it in queue order (any pool), with a placement running, that this member
    declined for want of capacity, that fits this member's total capacity and that its
    owner's quota does not hold back here now (``quota_holds(other)``, Q2). None: nothing
    ahead waits here."""
    mine = queue_key(record)
    # A job whose placement gave up (no instance runs it) waits for nothing: it holds nothing.
    ahead = sorted((r for r in jobs if r.state == "pending" and r.instance and queue_key(r) < mine), key=queue_key)
    for other in ahead:
        answer = other.declines.get(me)
        # A capacity decline stays on record after the quota took over as the reason (a
        # decline decided afresh into another decline is not re-sent): a job its quota holds
        # could not use the capacity, and reserving for it would hold the jobs behind it
        # until the quota frees, which may be never while they wait (a deadlock).
        if (answer is not None and answer[0] in CAPACITY_REASONS and total.holds(Room.of(other.manifest.resources))
                and not quota_holds(other)):
            return other
    return None


def backfill_error(record, holder, free: Room, allocations: list, now_ms: int) -> str | None:
    """Q5: why ``record`` may not take capacity ``holder`` waits for, or None. ``free``: this
    member's free capacity now; ``allocations``: (end ms or None, Room) of the jobs it runs.
    It may when it ends (by its declared runtime) before the holder could start here, or
    when the holder still fits at that time with ``record`` running."""
    need = Room.of(holder.manifest.resources)
    shadow_ms, free_then = _first_fit_time(free, need, allocations, now_ms)
    name = holder.job_id.hex()[:8]
    if shadow_ms is None:
        return "capacity reserved for job %s, whose start here is unknown (runtimes undeclared)" % name
    runtime = record.manifest.scheduling.max_runtime_ms
    if runtime and now_ms + runtime <= shadow_ms:
        return None
    if (free_then - Room.of(record.manifest.resources)).holds(need):
        return None
    return ("capacity reserved for job %s from %d ms; this job %s" % (
        name, shadow_ms - now_ms, "declares no max_runtime_ms" if not runtime else "runs %d ms" % runtime))

