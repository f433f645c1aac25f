"""Pools and per-owner quotas (SPEC.md 5.5, Q1-Q3): how much one owner's live jobs may
hold in a pool, counted from the job table.

The pools and quotas are the genesis's (every member holds the same bytes). What an
owner holds in a pool is counted from this member's job table: the jobs of that owner
and pool whose placement this member applied and that have not ended (states placed,
running, migrating). Certificates, exits, refusals, cancels and evictions change those
states identically everywhere, so members converge on the same usage; while their
tables differ (a certificate or an exit not heard yet) they may answer differently,
which only changes who bids (Q2): no vote depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.gpu_shares import MILLI_PER_GPU
from protocol.job_table import LIVE_JOB_STATES

DEFAULT_POOL = ""


@dataclass(frozen=True)
class Usage:
    """Resources in the units quotas count: GPU thousandths, milli-CPU, MiB."""
    gpu_milli: int = 0
    cpu_milli: int = 0
    mem_mib: int = 0

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.gpu_milli + other.gpu_milli, self.cpu_milli + other.cpu_milli, self.mem_mib + other.mem_mib)

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(self.gpu_milli - other.gpu_milli, self.cpu_milli - other.cpu_milli, self.mem_mib - other.mem_mib)

    def exceeds(self, limit) -> list[tuple[str, int, int]]:
        """(dimension, this, limit) for each dimension above ``limit`` (a Quota or a Usage)."""
        return [(name, getattr(self, name), getattr(limit, name)) for name in ("gpu_milli", "cpu_milli", "mem_mib")
                if getattr(self, name) > getattr(limit, name)]


def demand(resources) -> Usage:
    """Q1: what a job counts against its quota: 1000 per whole GPU, or its GPU share."""
    gpu = resources.gpu_milli if resources.gpu_milli else resources.gpus * MILLI_PER_GPU
    return Usage(gpu, resources.cpu_milli, resources.mem_mib)


class Quotas:
    """The genesis's pools, by name. With none declared every job is in the one default
    pool, without a limit, and nothing here costs anything."""

    def __init__(self, pools=()) -> None:
        self.pools = {pool.name: pool for pool in pools}
        self.limits = {(pool.name, entry.owner): entry.quota for pool in pools for entry in pool.owners}

    @property
    def enabled(self) -> bool:
        return bool(self.pools)

    def unknown_pool_error(self, job) -> str | None:
        """Q1: a job names the default pool, or one the genesis declares."""
        name = job.scheduling.pool
        if name == DEFAULT_POOL or name in self.pools:
            return None
        known = ", ".join(repr(n) for n in sorted(self.pools) if n) or "none"
        return "unknown pool %r (the mesh's pools: %s)" % (name, known)

    def never_fits_error(self, job) -> str | None:
        """Q1: a job that asks more than its owner's whole quota could never be placed."""
        limit = self.limit(job.scheduling.pool, job.owner)
        over = demand(job.resources).exceeds(limit) if limit is not None else []
        if not over:
            return None
        return "the job asks more than its owner's whole quota in pool %r: %s" % (job.scheduling.pool, ", ".join(
            "%s %d > %d" % entry for entry in over))

    def limit(self, pool: str, owner: bytes):
        """The owner's quota in ``pool``, or None for no limit (the default pool when the
        genesis does not list it)."""
        declared = self.pools.get(pool)
        if declared is None:
            return None
        return self.limits.get((pool, owner), declared.default)

    @staticmethod
    def usage(jobs, owner: bytes, pool: str) -> Usage:
        """Q1: what ``owner``'s live jobs in ``pool`` hold, by this member's job table."""
        total = Usage()
        for record in jobs:
            job = record.manifest
            if record.state in LIVE_JOB_STATES and job.owner == owner and job.scheduling.pool == pool:
                total = total + demand(job.resources)
        return total

    def over_quota(self, job, jobs, bid_for=()) -> str | None:
        """Q2: why ``job`` may not be placed now under its owner's quota, or None. Names the
        pool, each dimension over, and by how much. ``bid_for``: the records of the pending
        jobs this member holds a bid for, counted as held too (so one member never bids for
        two jobs that only together exceed the quota)."""
        problem = self.unknown_pool_error(job)
        if problem is not None:
            return problem
        pool = job.scheduling.pool
        limit = self.limit(pool, job.owner)
        if limit is None:
            return None
        held = self.usage(jobs, job.owner, pool)
        bids = [other for other in bid_for if other.manifest.owner == job.owner
                and other.manifest.scheduling.pool == pool and other.manifest != job]
        for other in bids:
            held = held + demand(other.manifest.resources)
        over = (held + demand(job.resources)).exceeds(limit)
        if not over:
            return None
        return "pool %r quota: %s%s" % (pool, ", ".join(
            "%s %d held + %d asked > %d (over by %d)" % (name, getattr(held, name), getattr(demand(job.resources), name),
                                                          cap, total - cap) for name, total, cap in over),
            "; held counts %d job(s) this node bid for" % len(bids) if bids else "")
