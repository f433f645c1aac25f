"""Strict quotas by admission (SPEC.md Q2b-Q2d): one member, the **quota home** of an
(owner, pool), admits the owner's jobs against the quota by signing a grant per job; a
placement of such a job is valid only with that grant in its justification.

Why a home and not a check at decision time: validators must agree from the proposal's
contents alone, and their job tables differ while certificates and exits are in flight
(Q2a). One member counting for the owner is a single, sequential count: it never grants
two jobs that only together exceed the quota, whatever members bid. Validators check a
signature and a hash rule, never a table.

The home counts, by its own table, the owner's live jobs in the pool plus every job of
the owner and pool it knows a grant for that is pending (granted, not placed yet, or
back to pending after a refusal or preemption: a grant is a job's for its whole life).
Deputies (the next members of the home ranking, together over a third of the stake)
grant only what their own count has had room for through a hand-over while no home
above them granted it, so a silent or withholding home delays its owners' admissions
by a hand-over instead of stalling them.
"""

from __future__ import annotations

import hashlib

from protocol.errors import RemoteProtocolError
from protocol.job_queue import queue_key
from protocol.job_table import LIVE_JOB_STATES
from protocol.messages import QuotaGrant, decode_message, job_id
from protocol.messages.quota import QUOTA_LIMIT
from protocol.preemption import fits_after
from protocol.quota import Usage, demand
from protocol.ready import Outbound, PersistRecord, Ready
from protocol.signing import short_id

QUOTA_HOME_TAG = b"meshnode quota home v1"
UNKNOWN_JOB_GRANT_ROUNDS = 8   # as a restored reservation's lifetime (R1, BID_LIFETIME_ROUNDS)
MAX_GRANTS_KEPT = 65536      # grants held for jobs; the oldest is dropped beyond (a job then waits for a re-send)
GRANT_HANDOVER_ROUNDS = 5   # a deputy of rank r grants a job its home left waiting r x this many round timeouts
GRANT_PERSIST_PREFIX = "grant-"   # the `jobs` table key of a persisted grant (beside the job's outcome row)
# A job a home counted that is then cancelled keeps counting for this many maximal round
# timeouts after the home applied the cancel: the primary runs it until the cancel reaches
# it (a partition, a loss or its restart delays that) and signs nothing when it stops (Q2e).
CANCEL_STOP_GRACE_ROUNDS = 1


def home_ranking(members, owner: bytes, pool: str) -> list:
    """Q2b: the members by their SHA-256 of (tag, owner, pool length, pool, member key),
    greatest first (rendezvous hashing: a member's rank changes only when one ranked above
    it leaves or a joiner outranks it, so grants rarely change hands)."""
    name = pool.encode("utf-8")
    prefix = QUOTA_HOME_TAG + owner + bytes([len(name)]) + name
    return sorted(members, key=lambda member: hashlib.sha256(prefix + member).digest(), reverse=True)


def quota_home(members, owner: bytes, pool: str) -> bytes:
    """Q2b: the quota home of (owner, pool) among ``members``: the first of the ranking."""
    return home_ranking(members, owner, pool)[0]


def quota_homes(view, owner: bytes, pool: str) -> tuple:
    """Q2b: the home and its deputies in ``view``: the shortest prefix of the ranking whose
    stake exceeds a third of the total, so at least one of them is honest while Byzantine
    stake is under a third (a silent home cannot stall its owners' admissions for good)."""
    homes, stake = [], 0
    for member in home_ranking(view.members, owner, pool):
        homes.append(member)
        stake += view.stakes[member]
        if 3 * stake > view.total_stake:
            break
    return tuple(homes)


def grant_for(job, borrowed: bool = False) -> QuotaGrant:
    """The grant a home signs for ``job``: its id, epoch, owner, pool and demand (Q1), and
    whether it runs on borrowed quota (Q6)."""
    need = demand(job.resources)
    return QuotaGrant(job_id=job_id(job), epoch=job.epoch, owner=job.owner, pool=job.scheduling.pool,
                      gpu_milli=need.gpu_milli, cpu_milli=need.cpu_milli, mem_mib=need.mem_mib, borrowed=borrowed)


def mismatch(grant: QuotaGrant, job) -> str | None:
    """Why ``grant`` is not one of ``job``'s (Q2b, Q6: only a preemptible job borrows)."""
    if grant != grant_for(job, grant.borrowed):
        return "not this job's (id, epoch, owner, pool and demand must match)"
    if grant.borrowed and not job.scheduling.preemptible:
        return "borrowed for a job that is not preemptible (Q6)"
    return None


def grant_error(data: bytes, job, view, mesh_id: bytes, caches=None, borrowed: bool | None = None) -> str | None:
    """Q2c, the validator's check: ``data`` is a grant for exactly ``job`` signed by a quota
    home or deputy of ``view`` (the job's epoch), borrowed only for a preemptible job (Q6),
    and, when ``borrowed`` is given, borrowed or in-quota as it says (Q6's reclaim). None
    when it is."""
    try:
        envelope, grant = decode_message(data, mesh_id, expect=QuotaGrant, caches=caches)
    except RemoteProtocolError as exc:
        return "quota grant: %s" % exc
    problem = mismatch(grant, job)
    if problem is not None:
        return "quota grant: %s" % problem
    if borrowed is not None and grant.borrowed != borrowed:
        kinds = {True: "borrowed", False: "in-quota"}
        return "quota grant: %s, expected %s" % (kinds[grant.borrowed], kinds[borrowed])
    homes = quota_homes(view, job.owner, job.scheduling.pool)
    if envelope.signer not in homes:
        return "quota grant: signed by %s, not a quota home (%s)" % (short_id(envelope.signer), ", ".join(
            short_id(home) for home in homes))
    return None


class QuotaAdmission:
    """The grants this member holds, and, for the (owner, pool)s it is a home or deputy of,
    granting."""

    def __init__(self, ctx, epochs, jobs, quotas, capability=None) -> None:
        self.ctx = ctx
        self.capability = capability   # the members' vectors: where a borrowed job has room (Q6)
        self.epochs = epochs
        self.jobs = jobs
        self.quotas = quotas
        self.grants: dict[bytes, bytes] = {}     # job id -> grant envelope (verified)
        self.granted: dict[bytes, tuple] = {}    # job id -> (QuotaGrant, when it was kept here)
        self.resent_ms: dict[bytes, int] = {}    # job id -> when this node last re-sent the job or its grant
        self.signed_here: set[bytes] = set()     # job ids whose grant this node signed (it re-sends those)
        self.room_since: dict[bytes, int] = {}   # job id -> since when a deputy's count has had room for it
        self.counted_jobs: set[bytes] = set()   # job ids counted at the last admit (live, or pending with a grant)
        # cancelled job id -> (owner, pool, demand, when the cancel applied here): counted for Q2e's grace
        self.stopping: dict[bytes, tuple] = {}
        self.checked_at_stamp = None
        self.recheck_at_ms = 0
        # A restarted member grants nothing until then: grants of the others sent while it was
        # down come again (re-sends, proposals) or are placed meanwhile, and it counts them first.
        self.quiet_until_ms = 0

    def restarted(self, now_ms: int) -> None:
        """This member restarted (it had a history): one maximal round timeout without granting,
        the period at which a home re-sends the grants of jobs still pending."""
        self.quiet_until_ms = now_ms + self.ctx.params.round_timeout_max_ms

    # --- who needs a grant, and who gives it -------------------------------------------------------
    def needs_grant(self, job) -> bool:
        """Q2b: a job whose owner's quota in its (declared) pool limits some dimension (2^40
        is no limit, 5.5). A gang keeps Q2's bid rule."""
        if not self.quotas.enabled or job.gang.is_gang or self.quotas.unknown_pool_error(job) is not None:
            return False
        limit = self.quotas.limit(job.scheduling.pool, job.owner)
        return limit is not None and min(limit.gpu_milli, limit.cpu_milli, limit.mem_mib) < QUOTA_LIMIT

    def homes_of(self, job) -> tuple:
        """The quota home and deputies of the job's owner and pool in the epoch the job names
        (empty: that epoch's view is not held here)."""
        view = self.epochs.view_for(job.epoch)
        return () if view is None else quota_homes(view, job.owner, job.scheduling.pool)

    def grant_of(self, record) -> bytes | None:
        return self.grants.get(record.job_id)

    def borrowed(self, jid: bytes) -> bool:
        """Q6: the grant held here of the job is a borrowed one (it counts nothing against
        the quota, and in-quota jobs of its pool may reclaim its capacity)."""
        kept = self.granted.get(jid)
        return kept is not None and kept[0].borrowed

    def in_quota_grant(self, jid: bytes) -> bytes | None:
        """The grant held here of the job when it is an in-quota one (Q6: it may reclaim)."""
        kept = self.granted.get(jid)
        return self.grants.get(jid) if kept is not None and not kept[0].borrowed else None

    def waiting_for_grant(self, record) -> bool:
        return self.needs_grant(record.manifest) and record.job_id not in self.grants

    def stamp(self) -> int:
        """Changes when a grant arrives (held placements are decided afresh, P3a)."""
        return len(self.grants)

    # --- grants arriving ----------------------------------------------------------------------------
    def on_grant(self, envelope, grant: QuotaGrant, data: bytes, now_ms: int, out: Ready) -> bool:
        """A grant from a peer (or restored): kept if its signer is the home of its epoch; the
        job it names is checked against it when used (Q2c). True if it is new here."""
        view = self.epochs.view_for(grant.epoch)
        if view is None:
            self.ctx.counters["quota_grant_unknown_epoch"] += 1
            return False
        if envelope.signer not in quota_homes(view, grant.owner, grant.pool):
            raise RemoteProtocolError("quota grant not signed by a quota home of its owner and pool")
        record = self.jobs.get(grant.job_id)
        if record is not None and mismatch(grant, record.manifest) is not None:
            raise RemoteProtocolError("quota grant does not match its job: %s" % mismatch(grant, record.manifest))
        if grant.job_id in self.grants:
            return False
        self._keep(grant, data, now_ms, out)
        if envelope.signer == self.ctx.me:   # its own, from its store after a restart: it re-sends it (_resend)
            self.signed_here.add(grant.job_id)
        return True

    def _keep(self, grant: QuotaGrant, data: bytes, now_ms: int, out: Ready) -> None:
        jid = grant.job_id
        if len(self.grants) >= MAX_GRANTS_KEPT:
            oldest = next(iter(self.grants))
            self.grants.pop(oldest)
            self.granted.pop(oldest, None)
        self.grants[jid] = data
        self.granted[jid] = (grant, now_ms)
        if not grant.borrowed:
            self.counted_jobs.add(jid)   # from now: a cancel of it before the next check keeps it counted too
        # Persisted (a restarted home must count the grants it gave; a member, bid with them).
        out.persist.append(PersistRecord("jobs", GRANT_PERSIST_PREFIX + jid.hex(),
                                         {"job_id": jid, "outcome": "quota_grant", "envelope": data}))

    # --- the home's count and its grants (Q2b) -------------------------------------------------------
    def counted(self, owner: bytes, pool: str, now_ms: int) -> Usage:
        """What a home counts against the quota: the owner's live jobs in the pool, its
        pending jobs there that hold a grant, and the grants it holds of jobs its table does
        not (a restart forgot the pending ones), each for UNKNOWN_JOB_GRANT_ROUNDS maximal
        round timeouts after it was kept here (a job not seen by then is presumed gone)."""
        total = Usage()
        for record in self.jobs:
            job = record.manifest
            if job.owner != owner or job.scheduling.pool != pool:
                continue
            if self.borrowed(record.job_id):
                continue   # Q6: borrowed, not held against the quota
            if record.state in LIVE_JOB_STATES or (record.state == "pending" and record.job_id in self.grants):
                total = total + demand(job.resources)
        grace_ms = CANCEL_STOP_GRACE_ROUNDS * self.ctx.params.round_timeout_max_ms
        for job_owner, job_pool, need, cancelled_ms in self.stopping.values():
            if job_owner == owner and job_pool == pool and now_ms - cancelled_ms < grace_ms:
                total = total + need
        unknown_for_ms = UNKNOWN_JOB_GRANT_ROUNDS * self.ctx.params.round_timeout_max_ms
        for jid, (grant, kept_ms) in self.granted.items():
            if (grant.owner == owner and grant.pool == pool and now_ms - kept_ms < unknown_for_ms
                    and not grant.borrowed and self.jobs.get(jid) is None):
                total = total + Usage(grant.gpu_milli, grant.cpu_milli, grant.mem_mib)
        return total

    def over_by(self, record, now_ms: int) -> list:
        """(dimension, counted, demand, limit) for each dimension the job would take its
        owner over the quota by this node's count (Q2b)."""
        job = record.manifest
        limit = self.quotas.limit(job.scheduling.pool, job.owner)
        held, asked = self.counted(job.owner, job.scheduling.pool, now_ms), demand(job.resources)
        return [(name, getattr(held, name), getattr(asked, name), cap) for name, _total, cap in (held + asked).exceeds(limit)]

    def admit(self, now_ms: int, out: Ready) -> None:
        """At a home: grant each waiting job of an (owner, pool) it is a home of that fits the
        quota by its count, in queue order (Q3), and broadcast the grant; the home at once, a
        deputy of rank r only once its count has had room for the job for r x the hand-over
        (its home did not grant it meanwhile). Also the re-sends of _resend."""
        if not self.quotas.enabled:
            return
        waiting = [r for r in self.jobs if r.state == "pending" and self.needs_grant(r.manifest)]
        self._resend(waiting, now_ms, out)
        self._note_cancels(now_ms)
        borrowers = any(r.manifest.scheduling.preemptible for r in waiting)   # only they read the vectors (Q6)
        stamp = (sum(hash((r.job_id, r.state)) for r in self.jobs) + len(self.grants) + len(self.stopping),
                 self._vectors_version() if borrowers else None)
        if (stamp == self.checked_at_stamp and now_ms < self.recheck_at_ms) or now_ms < self.quiet_until_ms:
            return
        self.checked_at_stamp, self.recheck_at_ms = stamp, 1 << 62
        handover_ms = GRANT_HANDOVER_ROUNDS * self.ctx.params.round_timeout_ms
        still_room = {}
        for record in sorted(waiting, key=queue_key):
            homes = self.homes_of(record.manifest)
            if record.job_id in self.grants or self.ctx.me not in homes:
                continue
            borrowed = bool(self.over_by(record, now_ms))
            if borrowed and not self.may_borrow(record.manifest, now_ms):
                continue
            rank = homes.index(self.ctx.me)
            if rank:
                # A deputy grants only what its own count has had room for through its whole
                # hand-over, no home above it granting meanwhile: a live home's grant comes
                # within a message delay, and a table lagging behind the home's is not
                # behind for that long (any change that leaves no room restarts the wait).
                since = still_room[record.job_id] = self.room_since.get(record.job_id, now_ms)
                if now_ms < since + rank * handover_ms:
                    self.recheck_at_ms = min(self.recheck_at_ms, since + rank * handover_ms)
                    continue
            grant = grant_for(record.manifest, borrowed)
            data = self.ctx.sign(grant)
            self._keep(grant, data, now_ms, out)
            if len(self.signed_here) >= MAX_GRANTS_KEPT:
                self.signed_here.clear()
            self.signed_here.add(record.job_id)
            out.messages.append(Outbound(None, data))
            out.events.append(self.ctx.event("quota_granted", now_ms, job_id=record.job_id.hex(), rank=rank,
                                             borrowed=borrowed))
        self.room_since = still_room
        unknown_for_ms = UNKNOWN_JOB_GRANT_ROUNDS * self.ctx.params.round_timeout_max_ms
        for jid, (_grant, kept_ms) in self.granted.items():   # a forgotten job's grant stops counting then
            if self.jobs.get(jid) is None and kept_ms + unknown_for_ms > now_ms:
                self.recheck_at_ms = min(self.recheck_at_ms, kept_ms + unknown_for_ms)
        grace_ms = CANCEL_STOP_GRACE_ROUNDS * self.ctx.params.round_timeout_max_ms
        for _owner, _pool, _need, cancelled_ms in self.stopping.values():   # a cancelled job's room returns then
            self.recheck_at_ms = min(self.recheck_at_ms, cancelled_ms + grace_ms)

    def _vectors_version(self):
        """Changes with every newer vector held here: room to borrow may have come (Q6)."""
        return None if self.capability is None else (self.capability.peers_version, self.capability.seq)

    def may_borrow(self, job, now_ms: int) -> bool:
        """Q6: a job over its owner's quota is granted as borrowed only if it is preemptible
        and some member's newest vector held here has room for it now (capacity permitting:
        a borrowed grant is the job's for its life, so one given while the mesh is full would
        keep a job borrowed that the quota might admit once it frees)."""
        if not job.scheduling.preemptible or self.capability is None:
            return False
        own = self.capability.vector
        vectors = list(self.capability.peers.values()) + ([own] if own is not None else [])
        return any(fits_after(job, cap, ()) for cap in vectors)

    def _note_cancels(self, now_ms: int) -> None:
        """Q2e: a job counted at the last check (admit runs at every tick, the only place
        grants are made) that is cancelled now keeps counting, from now, for the cancel's
        grace. Not less: a primary's vector without the run is no sign that it stopped it
        (a primary that restarted lists the run again once it re-runs it, not having heard
        the cancel; simulator seed 110). This member's own cancel stops its own run."""
        grace_ms = CANCEL_STOP_GRACE_ROUNDS * self.ctx.params.round_timeout_max_ms
        self.stopping = {jid: entry for jid, entry in self.stopping.items() if now_ms - entry[3] < grace_ms}
        counted = set()
        for record in self.jobs:
            jid = record.job_id
            if self.borrowed(jid):
                continue
            if record.state in LIVE_JOB_STATES or (record.state == "pending" and jid in self.grants):
                counted.add(jid)
            elif record.state == "cancelled" and jid in self.counted_jobs and record.primary != self.ctx.me:
                job = record.manifest
                self.stopping[jid] = (job.owner, job.scheduling.pool, demand(job.resources), now_ms)
        self.counted_jobs = counted

    def _resend(self, waiting: list, now_ms: int, out: Ready) -> None:
        """Once every maximal round timeout: the entry node re-sends a job still waiting for
        its grant to its homes, and a home re-sends each grant it signed of a job still
        pending (a lost broadcast must not hold a job for good)."""
        every_ms = self.ctx.params.round_timeout_max_ms
        for record in waiting:
            if now_ms - self.resent_ms.setdefault(record.job_id, now_ms) < every_ms:
                continue
            grant = self.grants.get(record.job_id)
            if grant is not None and record.job_id in self.signed_here:
                self.resent_ms[record.job_id] = now_ms
                out.messages.append(Outbound(None, grant))
            elif grant is None and record.entry == self.ctx.me:
                self.resent_ms[record.job_id] = now_ms
                out.messages.extend(Outbound(home, record.envelope) for home in self.homes_of(record.manifest)
                                    if home != self.ctx.me)
        if len(self.resent_ms) > MAX_GRANTS_KEPT:
            self.resent_ms.clear()

    def wait_report(self, record, now_ms: int) -> str | None:
        """For "why pending": the job waits for its grant, from which home, and which
        dimension holds it by this node's count (None: it holds its grant, or needs none)."""
        if not self.waiting_for_grant(record):
            return None
        job = record.manifest
        homes = self.homes_of(job)
        where = ("its quota home (epoch %d not held here)" % job.epoch if not homes else "quota home %s%s" % (
            short_id(homes[0]), " (deputies %s)" % ", ".join(short_id(h) for h in homes[1:]) if len(homes) > 1 else ""))
        over = self.over_by(record, now_ms)
        if not over:
            return ("waiting for a quota grant from %s (pool %r): within the quota by this node's count, so the "
                    "grant is in flight or the home is unreachable" % (where, job.scheduling.pool))
        borrow = ("preemptible, so it is granted on borrowed quota once a node has room (Q6)"
                  if job.scheduling.preemptible else "not preemptible, so it cannot borrow (Q6)")
        return "waiting for a quota grant from %s: pool %r quota: %s; %s" % (where, job.scheduling.pool, ", ".join(
            "%s %d held + %d asked > %d (over by %d)" % (name, held, asked, cap, held + asked - cap)
            for name, held, asked, cap in over), borrow)

    def borrowing_report(self, record, now_ms: int) -> str | None:
        """For "why": a job that holds a borrowed grant (Q6) runs, or waits for capacity, on
        borrowed quota; the owner's quota and its in-quota use by this node's count."""
        if not self.borrowed(record.job_id):
            return None
        job = record.manifest
        owner, pool = job.owner, job.scheduling.pool
        limit, used = self.quotas.limit(pool, owner), self.counted(owner, pool, now_ms)
        names = [name for name in ("gpu_milli", "cpu_milli", "mem_mib") if getattr(limit, name) < QUOTA_LIMIT]
        where = "pool %r: owner %s's quota %s, in use %s" % (
            pool, short_id(owner), " ".join("%s %d" % (n, getattr(limit, n)) for n in names),
            " ".join("%s %d" % (n, getattr(used, n)) for n in names))
        if record.state in LIVE_JOB_STATES:
            return "running on borrowed quota (%s): may be preempted by in-quota work" % where
        return ("waiting for capacity on borrowed quota (%s): once running, it may be preempted by in-quota work"
                % where)
