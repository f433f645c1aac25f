"""The job table: what this node knows of every job (SPEC.md 7, P1-P6).

One ``JobRecord`` per job id, created when the job (or a proposal or certificate that
carries it) first arrives, and changed only by the flows that apply decided values
(protocol/flows/), checkpoints, exits and cancels (protocol/job_lifecycle.py). Every
member derives the same primary, backups and fence from the same certificates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.messages import REPLICA_WEIGHT, JobManifest

TERMINAL = ("completed", "failed", "cancelled")
LIVE_JOB_STATES = ("placed", "running", "migrating")
MAX_JOBS = 1 << 16               # job records kept; the oldest terminal ones go first
FENCE_PER_ATTEMPT = 1 << 16      # attempt a's placement sets fence a * 2^16 + 1; each migration adds 1
MAX_FENCES_REMEMBERED = 32       # per job: which node was primary at each of its newest fences (P6)
MAX_RECENT_OUTCOMES = 64         # exits, refusals and cancels re-sent by sync answers (F6)

# The fields that say whether and how this node runs a job (JobTable.mine, workload_orders.py).
# Assigning one names the record's job id to its table (as adding or dropping a record does),
# and what reads only these fields of this node's jobs recounts just the jobs named
# (``JobTable.mine_version``, ``take_changes``; issue 18: the workload orders scanned every
# job a node is primary of after every input, 27% of a 4-node slot bench's busiest node, and
# then after any job's change anywhere).
WATCHED_FIELDS = frozenset(("state", "primary", "fence", "gpus", "attempt", "checkpoint_fence"))


@dataclass
class JobRecord:
    job_id: bytes
    envelope: bytes
    manifest: JobManifest
    submitted_ms: int
    state: str = "pending"
    attempt: int = 0
    instance: bytes = b""
    primary: bytes | None = None
    backups: tuple = ()
    gpus: tuple = ()
    fence: int = 0
    migrations: int = 0
    declines: dict = field(default_factory=dict)   # signer -> (reason, detail)
    last_checkpoint_seq: int | None = None
    last_checkpoint_taken_ms: int | None = None
    acks: dict = field(default_factory=dict)       # backup -> newest acked seq
    exit_code: int | None = None
    hint: str | None = None
    entry: bytes | None = None                     # the node the owner submitted it to (hears declines)
    # The newest checkpoint this node knows of, for display only: (seq, when it was taken on
    # this node's clock). Backups learn it from the checkpoints themselves, everyone else
    # from the primary's capability vectors (SPEC P1); never used to accept a checkpoint.
    known_checkpoint: tuple | None = None
    # P7c: the commit certificate of the job's slot, decided without it: its first placement
    # runs in its own instance then, and every proposal there carries this as proof.
    slot_certificate: bytes | None = None
    # fence -> the node that was primary at that fence (the newest MAX_FENCES_REMEMBERED):
    # an exit that arrives after the job moved on is checked against the primary it had
    # then (P6), so a member that applied an eviction before the exit still takes it.
    primaries: dict = field(default_factory=dict)
    # At most how much work the job's last migration lost, in ms (P6): measured by the node
    # it moved to, as (when it last heard the old primary + one heartbeat period) - (when the
    # checkpoint it resumes from arrived), on its clock; every member learns it from that
    # node's vector (P1).
    lost_work_ms: int | None = None
    # The exit or refusal envelope that ended the attempt before this one (P6): a leader
    # shows it with the job, so nodes that missed it join the new attempt's instance.
    outcome: bytes | None = None
    # The newest checkpoint envelope this node took or accepted, as signed, and its fence:
    # after a refusal it is handed to the job's next primary (R1, "Resuming after a
    # refusal"). Memory only: a restart forgets it (the run then starts without it).
    checkpoint_envelope: bytes | None = None
    checkpoint_fence: int | None = None
    # When this node applied the job's newest placement, on its clock: with the declared
    # max_runtime_ms, when the job ends at the latest (SPEC.md Q4, Q5).
    placed_ms: int | None = None
    # (fence, node): the job's last owner-requested move (R2) took it from ``node``, its
    # primary at ``fence``; that node's final checkpoint at ``fence`` is handed to the new one.
    moved_from: tuple | None = None
    # R3: (the node it moved off, the taken_ms of the last evidence vector) of the job's last
    # reflex move (None: none yet), from the decided value, so every member checks a
    # reflex's cooldown alike. The time is that node's clock: nodes' clocks differ.
    reflex_at: tuple | None = None
    # (job id, fence): a decided preemption (P8) named this job at that fence, to make room
    # for that job. It was preempted once its attempt ended (its node refused it).
    preempted_by: tuple | None = None
    # R4: the replicas beyond the primary (index >= 1 -> protocol/replicas.py Replica), the
    # primary's endpoint weight, the number of replica actions applied (the next action's
    # ``seq``), the next replica index, and per reflex rule (index) the (node, taken_ms) of
    # the last evidence vector of its last replica action (its cooldown, as ``reflex_at``).
    replicas: dict = field(default_factory=dict)
    primary_weight: int = REPLICA_WEIGHT
    replica_seq: int = 0
    next_replica: int = 1
    replica_reflex_at: dict = field(default_factory=dict)
    replicas_dropped: int = 0   # replicas dropped with their node or the job's end (R4b), not by an action
    replica_restarts: int = 0   # replicas replaced after a failed exit (R4h), bounded per job

    def __setattr__(self, name: str, value) -> None:
        if name in WATCHED_FIELDS:
            touched = self.__dict__.get("_touched")   # set by JobTable.add: its table's set
            if touched is not None:
                touched.add(self.job_id)
        object.__setattr__(self, name, value)

    def preempted_by_job(self) -> bytes | None:
        """The job this one was last preempted for, if its preempted attempt has ended."""
        if self.preempted_by is None or self.attempt <= self.preempted_by[1] // FENCE_PER_ATTEMPT:
            return None
        return self.preempted_by[0]

    def as_dict(self) -> dict:
        grouped: dict[str, list] = {}
        for signer, (reason, _detail) in self.declines.items():
            grouped.setdefault(reason, []).append(signer)
        return {"job_id": self.job_id, "name": self.manifest.name, "owner": self.manifest.owner,
                "state": self.state, "primary": self.primary, "backups": self.backups, "gpus": self.gpus,
                "fence": self.fence, "attempt": self.attempt, "instance": self.instance,
                "last_checkpoint_seq": self.last_checkpoint_seq,
                "last_checkpoint_taken_ms": self.last_checkpoint_taken_ms, "migrations": self.migrations,
                "declines": grouped, "submitted_ms": self.submitted_ms, "exit_code": self.exit_code,
                "hint": self.hint, "manifest": self.manifest, "known_checkpoint": self.known_checkpoint,
                "lost_work_ms": self.lost_work_ms, "preempted_by": self.preempted_by_job()}


class JobTable:
    """Job records by job id, bounded: past MAX_JOBS the oldest finished ones are dropped."""

    def __init__(self, me: bytes) -> None:
        self.me = me
        self.records: dict[bytes, JobRecord] = {}
        # The envelopes of the newest exits, refusals and cancels this node accepted, oldest
        # first: a sync answer re-sends them (F6), so a member that was down or cut off when
        # one was broadcast learns it.
        self.recent_outcomes: deque = deque(maxlen=MAX_RECENT_OUTCOMES)
        self._reflex_jobs: set[bytes] = set()   # jobs whose manifests hold reflex rules (R3)
        # Which jobs are this node's, kept up to date from the ids whose watched fields were
        # assigned (or whose records came or went) since the last look: the work per input is
        # what changed in it, not the table (issue 18: every node rescanned its jobs whenever
        # any job anywhere changed, 5% of a node's CPU per placement with 600 jobs).
        self._touched: set[bytes] = set()
        self._mine_ids: set[bytes] = set()
        self._mine: list[JobRecord] = []         # mine()'s answer, by job id, unless _mine_stale
        self._mine_stale = False
        self._mine_version = 0
        self._feeds: list[set[bytes]] = []       # each reader's ids that bumped _mine_version (take_changes)

    def assign(self, record: JobRecord, primary: bytes | None, backups: tuple, gpus: tuple | None = None,
               fence: int | None = None) -> None:
        """Set the job's primary and backups (and GPUs and fence, when given): the only way
        they change."""
        record.primary, record.backups = primary, tuple(backups)
        if gpus is not None:
            record.gpus = gpus
        if fence is not None:
            record.fence = fence
            if primary is not None:
                self.remember_primary(record, fence, primary)
        if primary == self.me:
            self._touched.add(record.job_id)   # made primary again with the same fields: still a change

    @staticmethod
    def remember_primary(record: JobRecord, fence: int, primary: bytes) -> None:
        record.primaries[fence] = primary
        while len(record.primaries) > MAX_FENCES_REMEMBERED:
            del record.primaries[min(record.primaries)]

    def note_outcome(self, data: bytes) -> None:
        if data not in self.recent_outcomes:
            self.recent_outcomes.append(data)

    def _settle(self) -> None:
        """Take in the touched ids: which are this node's now, and whether any of its jobs changed."""
        if not self._touched:
            return
        me, records, mine_ids = self.me, self.records, self._mine_ids
        for jid in self._touched:
            record = records.get(jid)
            if record is not None and record.primary == me:
                if jid not in mine_ids:
                    mine_ids.add(jid)
                    self._mine_stale = True
                self._mine_version += 1
                for feed in self._feeds:
                    feed.add(jid)
            elif jid in mine_ids:
                mine_ids.discard(jid)
                self._mine_stale = True
                self._mine_version += 1
                for feed in self._feeds:
                    feed.add(jid)
        self._touched.clear()

    def may_have_mine(self) -> bool:
        """False only when this node is certainly the primary of no job (the common case)."""
        self._settle()
        return bool(self._mine_ids)

    def mine_version(self) -> int:
        """A number that changes whenever mine()'s answer or a watched field of one of its
        records may have (read by what recounts only then: the workload orders, the vector)."""
        self._settle()
        return self._mine_version

    def changes_feed(self) -> set[bytes]:
        """A reader's feed for ``take_changes``: it starts with this node's jobs now."""
        self._settle()
        feed = set(self._mine_ids)
        self._feeds.append(feed)
        return feed

    def take_changes(self, feed: set[bytes]) -> set[bytes]:
        """The ids of this node's jobs (now or before) whose watched fields changed, or that
        came or went, since ``feed`` was last taken (readers that recount only those: the
        workload orders, the vector's running list)."""
        self._settle()
        changed = set(feed)
        feed.clear()
        return changed

    def mine(self) -> list[JobRecord]:
        """Records of the jobs this node is primary of now, in any state (a fresh list)."""
        self._settle()
        if self._mine_stale:
            self._mine = [self.records[jid] for jid in sorted(self._mine_ids)]
            self._mine_stale = False
        return list(self._mine)

    def get(self, jid: bytes) -> JobRecord | None:
        return self.records.get(jid)

    def __iter__(self):
        return iter(self.records.values())

    def __len__(self) -> int:
        return len(self.records)

    def add(self, jid: bytes, data: bytes, job: JobManifest, now_ms: int) -> JobRecord:
        if len(self.records) >= MAX_JOBS:
            for old in [k for k, r in self.records.items() if r.state in TERMINAL][:1024]:
                del self.records[old]
                self._touched.add(old)
                self._reflex_jobs.discard(old)
        record = JobRecord(jid, data, job, now_ms)
        object.__setattr__(record, "_touched", self._touched)
        if jid in self._mine_ids:
            self._mine_stale = True   # mine() held the record this one replaces
        self.records[jid] = record
        self._touched.add(jid)
        if job.reflexes or job.service.min_replicas > 1:   # R3, R4: watched as their primary's vectors come
            self._reflex_jobs.add(jid)
        return record

    def get_or_add(self, jid: bytes, data: bytes, job: JobManifest, now_ms: int) -> JobRecord:
        return self.records.get(jid) or self.add(jid, data, job, now_ms)

    def live_jobs_of(self, node: bytes) -> tuple:
        """Ids of the jobs ``node`` is primary of and that have not ended."""
        return tuple(r.job_id for r in self.records.values() if r.primary == node and r.state in LIVE_JOB_STATES)

    def reflex_jobs_of(self, node: bytes) -> list[JobRecord]:
        """The running jobs ``node`` is primary of whose manifests hold reflex rules (R3) or
        more than one replica at least (R4)."""
        if not self._reflex_jobs:
            return []
        return [r for jid in sorted(self._reflex_jobs) if (r := self.records.get(jid)) is not None
                and r.primary == node and r.state == "running"]

    def running_on(self, node: bytes) -> list[JobRecord]:
        return [r for r in self.records.values() if r.primary == node and r.state == "running"]
