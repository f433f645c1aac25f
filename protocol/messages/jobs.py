"""Jobs and what places them (SPEC.md 4, 8, P2, P7): capability vectors, manifests and
their ids, bids and declines, and the placement values a placement or slot instance decides.
Also the owner's and the primary's job lifecycle messages (SPEC.md 9.5-9.7)."""

from __future__ import annotations

import hashlib
from typing import ClassVar

from protocol import codec
from protocol.gpu_shares import MILLI_PER_GPU
from protocol.messages.fields import (DECLINE_REASONS, ENVELOPE, MAX_SLOT_JOBS, MILLI_PERCENT, STRATEGIES,
                                      record)
from protocol.errors import RemoteProtocolError
from protocol.messages.moves import MAX_REFLEXES
from protocol.messages.replicas import MAX_REPLICAS, Service
from protocol.schema import Bool, Int, Key, List, Nested, Optional, Record, Text, TextMap


# --- capability vectors ---------------------------------------------------------------------

@record
class GpuState(Record):
    index: int
    model: str
    mem_total_mib: int
    mem_used_mib: int
    util_milli: int
    temp_milli_c: int
    sm_clock_mhz: int
    throttle_reasons: int
    ecc_errors: int
    power_mw: int
    SCHEMA: ClassVar = {
        "index": Int(0, 63), "model": Text(0, 96), "mem_total_mib": Int(0, 1 << 24),
        "mem_used_mib": Int(0, 1 << 24), "util_milli": MILLI_PERCENT, "temp_milli_c": Int(0, 200_000),
        "sm_clock_mhz": Int(0, 100_000), "throttle_reasons": Int(0, (1 << 64) - 1),
        "ecc_errors": Int(0, (1 << 63) - 1), "power_mw": Int(0, 10_000_000),
    }


@record
class RunningJob(Record):
    """A job the signer runs as primary, so every member -- not only the backups that receive
    its checkpoints -- can show it running and how old its newest checkpoint is."""
    job_id: bytes
    fence: int
    checkpoint_seq: int          # 0: no checkpoint yet
    checkpoint_age_ms: int       # the vector's taken_ms minus the checkpoint's (signer's clock)
    lost_work_ms: int            # the work its last migration lost, as the signer measured it (P6); 0: none
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "checkpoint_seq": Int(),
                        "checkpoint_age_ms": Int(0, 1 << 40), "lost_work_ms": Int(0, 1 << 40)}


MAX_RUNNING_LISTED = 64
# Signals a job reports about itself (R3a), which a reflex rule may name as it names a GPU signal.
JOB_REFLEX_SIGNALS = ("request_rate", "request_latency_ms", "progress_rate")


@record
class JobSignals(Record):
    """A job's own load as its workload last reported it through the SDK (SPEC.md 9.4
    SIGNALS, R3a), carried in its primary's signed vector so reflex rules can read it.
    Integers in thousandths: requests per second, milliseconds, progress units per second."""
    job_id: bytes
    request_rate_milli: int
    latency_p99_us: int
    progress_rate_milli: int
    SCHEMA: ClassVar = {"job_id": Key(), "request_rate_milli": Int(0, 1 << 40), "latency_p99_us": Int(0, 1 << 40),
                        "progress_rate_milli": Int(0, 1 << 40)}


@record
class CapabilityVector(Record):
    KIND: ClassVar = "cap"
    node: bytes
    epoch: int
    seq: int
    taken_ms: int
    zone: str
    rail_group: str
    gpus: tuple
    gpus_free: tuple
    cpu_milli_free: int
    mem_mib_free: int
    labels: tuple
    simulated: bool
    running: tuple
    # Free thousandths of GPU index i at position i (SPEC.md P1, P4c): what a share may use.
    # Empty: GPU i has 1000 free if it is in ``gpus_free``, else none.
    gpu_milli_free: tuple = ()
    # The load each job running here reported (R3a): absent from the body when empty, so a
    # vector without it encodes as before the field existed.
    job_signals: tuple = ()
    SCHEMA: ClassVar = {
        "node": Key(), "epoch": Int(), "seq": Int(), "taken_ms": Int(), "zone": Text(1, 64),
        "rail_group": Text(0, 64), "gpus": List(Nested(GpuState), 64), "gpus_free": List(Int(0, 63), 64),
        "cpu_milli_free": Int(), "mem_mib_free": Int(), "labels": TextMap(), "simulated": Bool(),
        "running": List(Nested(RunningJob), MAX_RUNNING_LISTED),
        "gpu_milli_free": List(Int(0, MILLI_PER_GPU), 64),
        "job_signals": List(Nested(JobSignals), MAX_RUNNING_LISTED),
    }

    LEFT_OUT_AT_DEFAULT: ClassVar = {"job_signals": ()}   # R3a: a vector without reports as before

    @classmethod
    def from_body(cls, body, where: str | None = None):
        cap = super().from_body(body, where)
        # Checked here, not in __post_init__: that would validate every field of every decoded
        # vector twice (Record.from_body calls an overridden __post_init__ after its own checks).
        reported = [s.job_id for s in cap.job_signals]
        if len(set(reported)) != len(reported) or not {r.job_id for r in cap.running}.issuperset(reported):
            raise RemoteProtocolError("%s.job_signals: each job at most once, and only jobs listed in running"
                                      % (where or cls.__name__))
        return cap


# --- jobs -----------------------------------------------------------------------------------

@record
class Resources(Record):
    gpus: int
    gpu_mem_mib: int
    cpu_milli: int
    mem_mib: int
    # A share of one GPU in thousandths (GPU sharing, as the Alibaba trace's tasks ask):
    # 0 means whole GPUs (``gpus`` of them); 1..999 asks that share of exactly one GPU.
    gpu_milli: int = 0
    gpu_model: str = ""   # the GPU model every GPU of the job must be ("" = any model)
    SCHEMA: ClassVar = {"gpus": Int(0, 64), "gpu_mem_mib": Int(0, 1 << 24),
                        "cpu_milli": Int(0, 1 << 20), "mem_mib": Int(0, 1 << 24),
                        "gpu_milli": Int(0, MILLI_PER_GPU - 1), "gpu_model": Text(0, 96)}

    def __post_init__(self):
        super().__post_init__()
        if self.gpu_milli and self.gpus != 1:
            raise ValueError("Resources: gpu_milli %d is a share of one GPU, so gpus must be 1, not %d"
                             % (self.gpu_milli, self.gpus))


@record
class Scheduling(Record):
    """How the mesh's scheduler treats a job beyond where it may run (SPEC.md 4.2)."""
    pool: str = ""             # the pool whose quota it counts against ("" = the default pool)
    preemptible: bool = False  # whether a higher-priority job may preempt it
    max_runtime_ms: int = 0    # the owner's bound on its run time (0 = none declared)
    SCHEMA: ClassVar = {"pool": Text(0, 64), "preemptible": Bool(), "max_runtime_ms": Int(0, 1 << 40)}


REFLEX_SIGNALS = ("gpu_util", "gpu_temp", "gpu_mem", "throttle", "ecc_errors")
REFLEX_ACTIONS = ("migrate", "clone", "reroute", "decay")
REPLICA_ACTIONS = ("clone", "reroute", "decay")   # decided as replica actions (R4), not moves
# R4: the bounds of a rule's ``amount`` per action: replicas to add, or a percentage.
REFLEX_AMOUNTS = {"migrate": (0, 0), "clone": (1, MAX_REPLICAS - 1), "reroute": (1, 100), "decay": (1, 100)}


@record
class Reflex(Record):
    """A manifest's reflex rule (SPEC.md 4.2, R3): when ``signal`` on the primary's GPUs is
    above ``above`` (or below ``below``) for ``for_ms``, in zone ``zone`` ("" = any), the
    mesh takes ``action``, then no other reflex action on the job for ``cooldown_ms``.
    Units: gpu_util and gpu_mem in percent, gpu_temp in degrees C, throttle 1 while a
    protective throttle reason is set, ecc_errors a count. ``amount`` (R4): the replicas a
    clone adds, the percentage a reroute moves or a decay takes; 0 for migrate, and then
    left out of the body (so rules written before replicas keep their bytes)."""
    signal: str
    above: int | None
    below: int | None
    for_ms: int
    zone: str
    action: str
    cooldown_ms: int
    amount: int = 0
    SCHEMA: ClassVar = {"signal": Text(choices=REFLEX_SIGNALS + JOB_REFLEX_SIGNALS), "above": Optional(Int(0, 1 << 40)),
                        "below": Optional(Int(0, 1 << 40)), "for_ms": Int(0, 3_600_000), "zone": Text(0, 64),
                        "action": Text(choices=REFLEX_ACTIONS), "cooldown_ms": Int(0, 1 << 40),
                        "amount": Int(0, 100)}

    def __post_init__(self):
        super().__post_init__()
        if (self.above is None) == (self.below is None):
            raise ValueError("Reflex: exactly one of above and below must be set")
        low, high = REFLEX_AMOUNTS[self.action]
        if not low <= self.amount <= high:
            raise ValueError("Reflex: amount %d for action %r, expected %d..%d" % (self.amount, self.action, low, high))

    LEFT_OUT_AT_DEFAULT: ClassVar = {"amount": 0}   # R4: migrate rules keep their bytes


GANG_TOPOLOGIES = ("none", "zone", "rail_group", "spread_zones")
MAX_GANG_WORKERS = 16   # + 4 backups: one gang's bids fit one proposal (MAX_BIDS_PER_PROPOSAL)


@record
class Gang(Record):
    """A job of several workers placed all together or not at all (SPEC.md 4.2, GA1-GA4).

    ``workers`` = N: exactly N workers. ``workers`` = 0: elastic, any multiple of
    ``multiple_of`` in [``min_workers``, ``max_workers``], the largest that fits. Every
    worker asks the job's ``[resources]``. The default, one worker, is a plain job."""
    workers: int = 1
    min_workers: int = 0
    max_workers: int = 0
    multiple_of: int = 1
    topology: str = "none"
    SCHEMA: ClassVar = {"workers": Int(0, MAX_GANG_WORKERS), "min_workers": Int(0, MAX_GANG_WORKERS),
                        "max_workers": Int(0, MAX_GANG_WORKERS), "multiple_of": Int(1, MAX_GANG_WORKERS),
                        "topology": Text(choices=GANG_TOPOLOGIES)}

    def __post_init__(self):
        super().__post_init__()
        if self.workers:
            if self.min_workers or self.max_workers or self.multiple_of != 1:
                raise ValueError("Gang: min_workers, max_workers and multiple_of are for an elastic gang "
                                 "(workers = 0), not one of %d workers" % self.workers)
        elif not 1 <= self.min_workers <= self.max_workers:
            raise ValueError("Gang: an elastic gang (workers = 0) needs 1 <= min_workers <= max_workers, got %d..%d"
                             % (self.min_workers, self.max_workers))
        elif not self.sizes():
            raise ValueError("Gang: no multiple of multiple_of %d lies in min_workers..max_workers (%d..%d)"
                             % (self.multiple_of, self.min_workers, self.max_workers))

    def sizes(self) -> tuple:
        """The gang sizes it may run at, largest (preferred) first (SPEC.md GA2)."""
        if self.workers:
            return (self.workers,)
        return tuple(n for n in range(self.max_workers, self.min_workers - 1, -1) if n % self.multiple_of == 0)

    @property
    def is_gang(self) -> bool:
        return self.workers != 1


@record
class Constraints(Record):
    zones: tuple
    labels: tuple
    attested: tuple
    SCHEMA: ClassVar = {"zones": List(Text(1, 64), 16), "labels": TextMap(), "attested": TextMap()}


@record
class JobManifest(Record):
    KIND: ClassVar = "job"
    owner: bytes
    name: str
    nonce: int
    entrypoint: str
    args: tuple
    resources: Resources
    strategy: str
    constraints: Constraints
    priority: int
    backups: int
    max_retries: int
    created_ms: int
    epoch: int          # the mesh epoch whose members place it (SPEC.md P2): its owner signs it
    scheduling: Scheduling = Scheduling()
    gang: Gang = Gang()
    reflexes: tuple = ()   # absent from the body when empty (SPEC.md 4.2): older job ids stay
    service: Service = Service()   # absent from the body when the default (R4): older job ids stay
    SCHEMA: ClassVar = {
        "owner": Key(), "name": Text(1, 64), "nonce": Int(), "entrypoint": Text(1, 64),
        "args": List(Text(0, 1024), 64), "resources": Nested(Resources),
        "strategy": Text(choices=STRATEGIES), "constraints": Nested(Constraints),
        "priority": Int(0, 1000), "backups": Int(0, 4), "max_retries": Int(0, 16), "created_ms": Int(),
        "epoch": Int(), "scheduling": Nested(Scheduling), "gang": Nested(Gang),
        "reflexes": List(Nested(Reflex), MAX_REFLEXES), "service": Nested(Service),
    }

    # One canonical body per manifest, so one job id: manifests without reflexes or a service
    # keep the bytes (and ids) they had before those fields existed.
    LEFT_OUT_AT_DEFAULT: ClassVar = {"reflexes": (), "service": Service()}


def job_id(job: JobManifest) -> bytes:
    """A job's id: SHA-256 of its canonical body. Equal manifests are one job (nonce to differ).
    Remembered on the manifest object itself (it is immutable, so the id cannot go stale,
    and the memo dies with it): hashing a manifest's fields for a dict key cost more than
    the digest itself."""
    digest = job.__dict__.get("_job_id")
    if digest is None:
        digest = hashlib.sha256(codec.pack(job.to_body())).digest()
        object.__setattr__(job, "_job_id", digest)
    return digest


def placement_instance_id(jid: bytes, attempt: int) -> bytes:
    """SPEC.md P2: the placement instance of a job's ``attempt`` (0 is the job id itself).
    Every attempt runs in the epoch the job names (inside the job id), and in no other."""
    if attempt == 0:
        return jid
    return hashlib.sha256(b"retry" + jid + attempt.to_bytes(2, "big")).digest()


# SPEC.md R1, P6: a primary with no room for a job refuses it, and the job is placed afresh
# without using up one of its retries, at most this many times (then a refusal counts as
# a failure). Attempt numbers count both: attempt = failures + (max_retries + 1) * refusals,
# so every node reads both from a placement's instance id alone.
MAX_REFUSALS = 8


def placement_attempts(job: JobManifest) -> int:
    """How many attempts (placement instances) ``job`` may have: retries and refusals."""
    return (job.max_retries + 1) * (MAX_REFUSALS + 1)


def attempt_failures(attempt: int, job: JobManifest) -> int:
    """The failed exits before ``attempt`` (the retries it used up)."""
    return attempt % (job.max_retries + 1)


def next_attempt(attempt: int, job: JobManifest, refused: bool) -> int | None:
    """The attempt after ``attempt`` ended by a failed exit or, ``refused``, by its primary's
    refusal (SPEC.md P6, R1); None when the job has none left (it failed)."""
    span = job.max_retries + 1
    if refused and attempt // span < MAX_REFUSALS:
        return attempt + span
    if attempt % span + 1 < span:
        return attempt + 1
    return None


def placement_attempt(iid: bytes, job: JobManifest) -> int | None:
    """Which attempt of ``job`` instance ``iid`` places, or None if it is none of them."""
    jid = job_id(job)
    if iid == jid:
        return 0
    return next((a for a in range(1, placement_attempts(job)) if placement_instance_id(jid, a) == iid), None)


def placement_binding_error(iid: bytes, job: JobManifest, epoch: int) -> str | None:
    """Why a placement of ``job`` may not be decided as instance ``iid`` in ``epoch``, or None."""
    if placement_attempt(iid, job) is None:
        return "instance is not this job's placement"
    if job.epoch != epoch:
        return "the job is placed in epoch %d, not %d" % (job.epoch, epoch)
    return None


def placement_slot(job: JobManifest, slot_ms: int) -> int | None:
    """SPEC.md P7: the slot a job's first attempt is placed in when the mesh batches
    placements (``slot_ms`` > 0): its owner-signed creation time, in ``slot_ms`` windows."""
    return job.created_ms // slot_ms if slot_ms > 0 else None


def placement_slot_id(epoch: int, slot: int) -> bytes:
    """SPEC.md P7: the instance that places the jobs of ``slot`` named for ``epoch``. Not
    remembered: one SHA-256 of 20 bytes costs about what a cache lookup does."""
    return hashlib.sha256(b"slot" + epoch.to_bytes(8, "big") + slot.to_bytes(8, "big", signed=True)).digest()


# --- bids and placement values ---------------------------------------------------------------

@record
class Bid(Record):
    KIND: ClassVar = "bid"
    instance: bytes
    epoch: int
    capability: bytes
    reserved_gpus: tuple
    rtt_us: int
    attestations: tuple
    SCHEMA: ClassVar = {
        "instance": Key(), "epoch": Int(), "capability": ENVELOPE, "reserved_gpus": List(Int(0, 63), 64),
        "rtt_us": Int(), "attestations": List(ENVELOPE, 8),
    }


@record
class Decline(Record):
    KIND: ClassVar = "decline"
    instance: bytes
    epoch: int
    reason: str
    detail: str
    SCHEMA: ClassVar = {"instance": Key(), "epoch": Int(), "reason": Text(choices=DECLINE_REASONS),
                        "detail": Text(0, 256)}


@record
class Placement(Record):
    """The value a placement instance decides."""
    job: bytes
    primary: bytes
    backups: tuple
    gpus: tuple
    SCHEMA: ClassVar = {"job": ENVELOPE, "primary": Key(), "backups": List(Key(), 4),
                        "gpus": List(Int(0, 63), 64)}


@record
class GangWorker(Record):
    """One rank of a gang placement: the node that runs it and the GPUs its bid reserved."""
    node: bytes
    gpus: tuple
    SCHEMA: ClassVar = {"node": Key(), "gpus": List(Int(0, 63), 64)}


@record
class GangPlacement(Record):
    """The value a gang's placement instance decides (SPEC.md GA3): every worker at once,
    ``workers[r]`` running rank r, and the backups the gang's workers fail over to."""
    job: bytes
    workers: tuple
    backups: tuple
    SCHEMA: ClassVar = {"job": ENVELOPE, "workers": List(Nested(GangWorker), MAX_GANG_WORKERS),
                        "backups": List(Key(), 4)}

    def __post_init__(self):
        super().__post_init__()
        nodes = [w.node for w in self.workers]
        if not nodes:
            raise ValueError("GangPlacement.workers: a gang placement places at least one worker")
        if len(set(nodes)) != len(nodes):
            raise ValueError("GangPlacement.workers: two ranks on one node")
        if set(nodes) & set(self.backups) or len(set(self.backups)) != len(self.backups):
            raise ValueError("GangPlacement.backups: a backup twice, or one that runs a rank")


@record
class PlacementSlot(Record):
    """The value a slot instance decides (SPEC.md P7): the first placement of each job in it."""
    epoch: int
    slot: int
    placements: tuple
    SCHEMA: ClassVar = {"epoch": Int(), "slot": Int(), "placements": List(Nested(Placement), MAX_SLOT_JOBS)}

    def __post_init__(self):
        super().__post_init__()
        if not self.placements:
            raise ValueError("PlacementSlot.placements: a slot decides at least one placement")


# --- job lifecycle (SPEC.md 9.5-9.7) ----------------------------------------------------------

@record
class Cancel(Record):
    """The job's owner asks the mesh to stop and forget a job. Only the owner's signature counts."""
    KIND: ClassVar = "cancel"
    job_id: bytes
    requested_ms: int
    SCHEMA: ClassVar = {"job_id": Key(), "requested_ms": Int()}


@record
class JobRefusal(Record):
    """The job's primary has no room for it (SPEC.md R1): it does not run it, and the job is
    placed afresh (P6). Only the current primary's, at the current fence, counts."""
    KIND: ClassVar = "job_refusal"
    job_id: bytes
    fence: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int()}


@record
class JobExit(Record):
    """The job's primary reports that its workload exited (0: completed, else failed)."""
    KIND: ClassVar = "job_exit"
    job_id: bytes
    fence: int
    exit_code: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "exit_code": Int(0, 255)}
