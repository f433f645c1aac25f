"""Every message kind of the meshnode protocol (SPEC.md section 4).

Each class is a frozen record whose SCHEMA is the normative field list: names, types
and limits. ``KIND`` is the envelope kind string. Integers carry milli-units where a
fraction is needed (``util_milli`` = percent x 1000), never floats. Nested signed
messages (bids in a proposal, votes in a certificate) travel as the exact envelope
bytes their signer produced, so anyone can re-verify them offline.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from keys.identity import SigningIdentity
from protocol import codec
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import RemoteProtocolError
from protocol.schema import (Bool, Bytes, Int, Key, List, Nested, Optional, Record, Text, TextMap,
                             check_schema_matches_fields, scalars_only)

MAX_NODES = 4096          # members of one mesh epoch
MAX_BIDS_PER_PROPOSAL = 32  # justification kept O(1) per voter (SPEC.md 6.3)
MAX_SLOT_JOBS = 128         # placements one slot decides (SPEC.md P7)
MAX_BIDS_PER_SLOT_JOB = 5   # a slot proposal carries the bids of each primary and its <= 4 backups
MAX_JUSTIFICATION = MAX_SLOT_JOBS * MAX_BIDS_PER_SLOT_JOB
MAX_STATE_BYTES = 900 * 1024  # checkpoint state; leaves room in the 1 MiB frame
STRATEGIES = ("latency", "throughput", "sovereign")
DECLINE_REASONS = ("owner_not_allowed", "entrypoint_not_allowed", "not_enough_gpus",
                   "not_enough_gpu_memory", "not_enough_cpu", "not_enough_memory",
                   "zone_not_allowed", "labels_missing", "attestation_missing",
                   "node_unhealthy", "fenced")
VALUE_KINDS = ("placement", "eviction", "membership", "placement_slot")
ENVELOPE = Bytes(1, codec.MAX_FRAME_BYTES)  # a nested signed envelope, as its wire bytes
MILLI_PERCENT = Int(0, 100_000)


def record(cls):
    """Class decorator: frozen dataclass + schema/field consistency check."""
    cls = dataclass(frozen=True)(cls)
    check_schema_matches_fields(cls)
    return cls


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
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "checkpoint_seq": Int(),
                        "checkpoint_age_ms": Int(0, 1 << 40)}


MAX_RUNNING_LISTED = 64


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
    SCHEMA: ClassVar = {
        "node": Key(), "epoch": Int(), "seq": Int(), "taken_ms": Int(), "zone": Text(1, 64),
        "rail_group": Text(0, 64), "gpus": List(Nested(GpuState), 64), "gpus_free": List(Int(0, 63), 64),
        "cpu_milli_free": Int(), "mem_mib_free": Int(), "labels": TextMap(), "simulated": Bool(),
        "running": List(Nested(RunningJob), MAX_RUNNING_LISTED),
    }


# --- jobs -----------------------------------------------------------------------------------

@record
class Resources(Record):
    gpus: int
    gpu_mem_mib: int
    cpu_milli: int
    mem_mib: int
    SCHEMA: ClassVar = {"gpus": Int(0, 64), "gpu_mem_mib": Int(0, 1 << 24),
                        "cpu_milli": Int(0, 1 << 20), "mem_mib": Int(0, 1 << 24)}


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
    SCHEMA: ClassVar = {
        "owner": Key(), "name": Text(1, 64), "nonce": Int(), "entrypoint": Text(1, 64),
        "args": List(Text(0, 1024), 64), "resources": Nested(Resources),
        "strategy": Text(choices=STRATEGIES), "constraints": Nested(Constraints),
        "priority": Int(0, 1000), "backups": Int(0, 4), "max_retries": Int(0, 16), "created_ms": Int(),
        "epoch": Int(),
    }


MAX_JOB_IDS_KEPT = 1 << 14
_job_ids: OrderedDict[int, tuple] = OrderedDict()  # id(manifest) -> (manifest, its job id)


def job_id(job: JobManifest) -> bytes:
    """A job's id: SHA-256 of its canonical body. Equal manifests are one job (nonce to differ).
    Remembered by the manifest object (decoding caches it, so every node holds the same one):
    hashing a manifest's fields for a dict key cost more than the digest itself. An entry
    keeps its manifest alive, so no id is reused while the entry exists."""
    hit = _job_ids.get(id(job))
    if hit is not None and hit[0] is job:
        return hit[1]
    digest = hashlib.sha256(codec.pack(job.to_body())).digest()
    if len(_job_ids) >= MAX_JOB_IDS_KEPT:
        _job_ids.popitem(last=False)
    _job_ids[id(job)] = (job, digest)
    return digest


def placement_instance_id(jid: bytes, attempt: int) -> bytes:
    """SPEC.md P2: the placement instance of a job's ``attempt`` (0 is the job id itself).
    Every attempt runs in the epoch the job names (inside the job id), and in no other."""
    if attempt == 0:
        return jid
    return hashlib.sha256(b"retry" + jid + attempt.to_bytes(2, "big")).digest()


def placement_attempt(iid: bytes, job: JobManifest) -> int | None:
    """Which attempt of ``job`` instance ``iid`` places, or None if it is none of them."""
    jid = job_id(job)
    return next((a for a in range(job.max_retries + 1) if placement_instance_id(jid, a) == iid), None)


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


@lru_cache(maxsize=4096)
def placement_slot_id(epoch: int, slot: int) -> bytes:
    """SPEC.md P7: the instance that places the jobs of ``slot`` named for ``epoch``."""
    return hashlib.sha256(b"slot" + epoch.to_bytes(8, "big") + slot.to_bytes(8, "big", signed=True)).digest()


# --- consensus: bids, proposals, votes, certificates -----------------------------------------

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


@record
class Migration(Record):
    job_id: bytes
    to_node: bytes
    backups: tuple
    SCHEMA: ClassVar = {"job_id": Key(), "to_node": Key(), "backups": List(Key(), 4)}


@record
class Eviction(Record):
    """The value an emergency instance decides: fence ``node`` and move its workloads."""
    KIND: ClassVar = "eviction"
    node: bytes
    epoch: int
    migrations: tuple
    SCHEMA: ClassVar = {"node": Key(), "epoch": Int(), "migrations": List(Nested(Migration), 1024)}


@record
class Member(Record):
    public_key: bytes
    stake: int
    zone: str
    labels: tuple
    addrs: tuple
    SCHEMA: ClassVar = {"public_key": Key(), "stake": Int(1, 1 << 48), "zone": Text(1, 64),
                        "labels": TextMap(), "addrs": List(Text(1, 256), 8)}


@record
class MembershipChange(Record):
    """The value a membership instance decides; ``epoch`` is the epoch it creates."""
    change: str
    member: Member
    epoch: int
    evidence: tuple
    SCHEMA: ClassVar = {"change": Text(choices=("join", "leave")), "member": Nested(Member),
                        "epoch": Int(), "evidence": List(ENVELOPE, 16)}


@record
class Proposal(Record):
    KIND: ClassVar = "proposal"
    instance: bytes
    round: int
    epoch: int
    value_kind: str
    value: bytes
    justification: tuple
    pol_round: int | None
    pol_certificate: bytes | None
    SCHEMA: ClassVar = {
        "instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(), "value_kind": Text(choices=VALUE_KINDS),
        "value": Bytes(1, codec.MAX_FRAME_BYTES), "justification": List(ENVELOPE, MAX_JUSTIFICATION),
        "pol_round": Optional(Int(0, 1 << 20)), "pol_certificate": Optional(ENVELOPE),
    }


@record
class Prevote(Record):
    KIND: ClassVar = "prevote"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_hash": Optional(Key())}


@record
class Precommit(Record):
    KIND: ClassVar = "precommit"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    SCHEMA: ClassVar = dict(Prevote.SCHEMA)


@record
class PrevoteCertificate(Record):
    """More than 2/3 of the epoch's stake prevoted ``value_hash`` in ``round`` (a "polka")."""
    KIND: ClassVar = "prevote_cert"
    instance: bytes
    round: int
    epoch: int
    value_hash: bytes | None
    prevotes: tuple
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_hash": Optional(Key()), "prevotes": List(ENVELOPE, MAX_NODES)}


@record
class CommitCertificate(Record):
    """More than 2/3 of the epoch's stake precommitted ``value``: the decision, verifiable offline."""
    KIND: ClassVar = "commit"
    instance: bytes
    round: int
    epoch: int
    value_kind: str
    value: bytes
    precommits: tuple
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "value_kind": Text(choices=VALUE_KINDS), "value": Bytes(1, codec.MAX_FRAME_BYTES),
                        "precommits": List(ENVELOPE, MAX_NODES)}


@record
class RoundChange(Record):
    """Sent to the next round's leader on timeout, carrying the sender's lock (SPEC.md 6.5)."""
    KIND: ClassVar = "round_change"
    instance: bytes
    round: int
    epoch: int
    locked_round: int | None
    lock_certificate: bytes | None
    lock_proposal: bytes | None  # the signed Proposal whose value is locked: lets the new leader re-propose it
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "locked_round": Optional(Int(0, 1 << 20)), "lock_certificate": Optional(ENVELOPE),
                        "lock_proposal": Optional(ENVELOPE)}


@record
class RoundSync(Record):
    """A collector's proof that members holding more than 1/3 of the stake entered ``round``:
    their RoundChanges, so members still in earlier rounds catch up (SPEC.md 6.5)."""
    KIND: ClassVar = "round_sync"
    instance: bytes
    round: int
    epoch: int
    changes: tuple  # RoundChange envelopes for (instance, round, epoch), distinct signers
    SCHEMA: ClassVar = {"instance": Key(), "round": Int(0, 1 << 20), "epoch": Int(),
                        "changes": List(ENVELOPE, MAX_NODES)}


@record
class Evidence(Record):
    """Two conflicting envelopes signed by one key: proof of equivocation."""
    KIND: ClassVar = "evidence"
    offender: bytes
    first: bytes
    second: bytes
    SCHEMA: ClassVar = {"offender": Key(), "first": ENVELOPE, "second": ENVELOPE}


# --- liveness, failure, checkpoints ---------------------------------------------------------

@record
class Heartbeat(Record):
    KIND: ClassVar = "heartbeat"
    epoch: int
    seq: int
    sent_ms: int
    SCHEMA: ClassVar = {"epoch": Int(), "seq": Int(), "sent_ms": Int()}


@record
class Suspicion(Record):
    KIND: ClassVar = "suspicion"
    suspect: bytes
    epoch: int
    silent_ms: int
    SCHEMA: ClassVar = {"suspect": Key(), "epoch": Int(), "silent_ms": Int()}


@record
class Checkpoint(Record):
    KIND: ClassVar = "checkpoint"
    job_id: bytes
    fence: int
    seq: int
    progress: int
    taken_ms: int
    state: bytes
    state_hash: bytes
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "seq": Int(), "progress": Int(),
                        "taken_ms": Int(), "state": Bytes(0, MAX_STATE_BYTES), "state_hash": Key()}

    def __post_init__(self):
        super().__post_init__()
        if hashlib.sha256(self.state).digest() != self.state_hash:
            raise ValueError("Checkpoint.state_hash does not match state")


@record
class CheckpointAck(Record):
    KIND: ClassVar = "checkpoint_ack"
    job_id: bytes
    fence: int
    seq: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "seq": Int()}


# --- membership -----------------------------------------------------------------------------

@record
class Attestation(Record):
    """An attestation authority's statement about a key: attributes and, optionally, stake."""
    KIND: ClassVar = "attestation"
    subject: bytes
    attributes: tuple
    stake: int
    issued_ms: int
    expires_ms: int
    SCHEMA: ClassVar = {"subject": Key(), "attributes": TextMap(), "stake": Int(0, 1 << 48),
                        "issued_ms": Int(), "expires_ms": Int()}


@record
class Endorsement(Record):
    """A member vouching stake for a joining key (SPEC.md 7.2)."""
    KIND: ClassVar = "endorsement"
    candidate: bytes
    stake: int
    epoch: int
    SCHEMA: ClassVar = {"candidate": Key(), "stake": Int(1, 1 << 48), "epoch": Int()}


@record
class Join(Record):
    KIND: ClassVar = "join"
    member: Member
    epoch: int
    vouchers: tuple
    SCHEMA: ClassVar = {"member": Nested(Member), "epoch": Int(), "vouchers": List(ENVELOPE, 16)}


@record
class Leave(Record):
    KIND: ClassVar = "leave"
    epoch: int
    SCHEMA: ClassVar = {"epoch": Int()}


# --- job lifecycle and catch-up (SPEC.md 9.5-9.7, SPEC.md section 7) ----------

@record
class Cancel(Record):
    """The job's owner asks the mesh to stop and forget a job. Only the owner's signature counts."""
    KIND: ClassVar = "cancel"
    job_id: bytes
    requested_ms: int
    SCHEMA: ClassVar = {"job_id": Key(), "requested_ms": Int()}


@record
class JobExit(Record):
    """The job's primary reports that its workload exited (0: completed, else failed)."""
    KIND: ClassVar = "job_exit"
    job_id: bytes
    fence: int
    exit_code: int
    SCHEMA: ClassVar = {"job_id": Key(), "fence": Int(), "exit_code": Int(0, 255)}


@record
class SyncRequest(Record):
    """Ask peers for the epoch-change certificates from ``epoch`` on (a paused or rejoining node)."""
    KIND: ClassVar = "sync_request"
    epoch: int
    SCHEMA: ClassVar = {"epoch": Int()}


MESSAGE_TYPES = {cls.KIND: cls for cls in (
    CapabilityVector, JobManifest, Bid, Decline, Proposal, Prevote, Precommit, PrevoteCertificate,
    CommitCertificate, RoundChange, RoundSync, Evidence, Heartbeat, Suspicion, Eviction, Checkpoint, CheckpointAck,
    Attestation, Endorsement, Join, Leave, Cancel, JobExit, SyncRequest,
)}


def sign_message(identity, mesh_id: bytes, message: Record) -> Envelope:
    envelope = seal(identity, mesh_id, type(message).KIND, message.to_body())
    if type(message) in _PRIMED_KINDS and type(identity) is SigningIdentity and envelope._wire is not None:
        # What decoding these bytes would give is known: this envelope (its signature valid
        # by construction, see seal) and this record (its fields are scalars, so the decoded
        # body holds the same values). A vote is decoded by its collector and, in the
        # simulator, by the checker: remembering it here saves both a full decode.
        _remember_decoded((envelope._wire, mesh_id), (envelope, message))
    return envelope


# Votes: small, many, and decoded by another node of the same process in the simulator.
# Bigger messages (a checkpoint's state) would only crowd the decode cache out.
_PRIMED_KINDS = frozenset((Prevote, Precommit))
if not all(scalars_only(cls.SCHEMA) for cls in _PRIMED_KINDS):
    raise TypeError("a vote kind gained a non-scalar field: its decode can no longer be primed")


def encode_message(identity, mesh_id: bytes, message: Record) -> bytes:
    return sign_message(identity, mesh_id, message).encode()


# Decoding is a pure function of (bytes, mesh id) and its results are immutable, so
# verified decodes are remembered: one node meets the same bytes many times (a bid in
# every proposal, a job in every placement) and the simulator delivers one broadcast to
# every node of its process. One entry serves both ``allow_any_mesh`` settings: the
# envelope's own mesh id says whether a strict caller may have it. Least recently used
# goes first, so a broadcast still being delivered outlives the many one-shot votes that
# arrive meanwhile. Bounded by entries and by the bytes held.
MAX_DECODED_KEPT = 1 << 16   # ~1 KiB each decoded: a 1000-node decision has 2000 votes
MAX_DECODED_BYTES = 64 << 20
_decoded: OrderedDict[tuple, tuple] = OrderedDict()  # popitem(last=False) is O(1), unlike a dict's
_decoded_bytes = 0


def decode_message(data: bytes, mesh_id: bytes, expect: type | None = None,
                   allow_any_mesh: bool = False) -> tuple[Envelope, Record]:
    """Verify an envelope and parse its body strictly. Raises RemoteProtocolError."""
    key = (data, mesh_id) if type(data) is bytes else None
    hit = _decoded.get(key) if key is not None else None
    if hit is not None:
        _decoded.move_to_end(key)
        if hit[0].mesh_id != mesh_id and not allow_any_mesh:
            raise RemoteProtocolError("envelope: signed for another mesh")
        if expect is not None and type(hit[1]) is not expect:
            raise RemoteProtocolError("expected a %s, got %r" % (expect.KIND, hit[0].kind))
        return hit
    envelope = open_envelope(data, mesh_id, allow_any_mesh=allow_any_mesh)
    cls = MESSAGE_TYPES.get(envelope.kind)
    if cls is None:
        raise RemoteProtocolError("unknown message kind %r" % envelope.kind)
    if expect is not None and cls is not expect:
        raise RemoteProtocolError("expected a %s, got %r" % (expect.KIND, envelope.kind))
    try:
        decoded = envelope, cls.from_body(envelope.body)
    except ValueError as exc:  # a record's own cross-field check (e.g. checkpoint hash)
        raise RemoteProtocolError(str(exc)) from None
    if key is not None:
        _remember_decoded(key, decoded)
    return decoded


def _remember_decoded(key: tuple, decoded: tuple) -> None:
    global _decoded_bytes
    size = len(key[0])
    if size > MAX_DECODED_BYTES // 64:
        return  # a huge message (checkpoint state) would push out hundreds of small ones
    while _decoded and (len(_decoded) >= MAX_DECODED_KEPT or _decoded_bytes + size > MAX_DECODED_BYTES):
        oldest, _ = _decoded.popitem(last=False)
        _decoded_bytes -= len(oldest[0])
    _decoded[key] = decoded
    _decoded_bytes += size


@lru_cache(maxsize=4096)
def decode_value(value_kind: str, data: bytes):
    """Decode the unsigned value inside a proposal or certificate. Cached like
    decode_message: the value is immutable and every validator decodes the same bytes."""
    cls = {"placement": Placement, "eviction": Eviction, "membership": MembershipChange,
           "placement_slot": PlacementSlot}.get(value_kind)
    if cls is None:
        raise RemoteProtocolError("unknown value kind %r" % value_kind)
    try:
        return cls.from_body(codec.unpack(data))
    except ValueError as exc:
        raise RemoteProtocolError(str(exc)) from None


MAX_SLOT_VALUES_KEPT = 256
_slot_items: OrderedDict[tuple, tuple] = OrderedDict()  # (id(value), mesh id) -> (value, items)


def slot_placements(value: PlacementSlot, mesh_id: bytes) -> list[tuple]:
    """(placement, job, job id) of every placement a slot value lists; raises
    RemoteProtocolError unless every job is a valid job signed by its owner. Remembered by
    value object (decode_value caches it): validating, binding and applying a slot all ask."""
    key = (id(value), mesh_id)
    hit = _slot_items.get(key)
    if hit is not None and hit[0] is value:
        return hit[1]
    items = _slot_placements(value, mesh_id)
    if len(_slot_items) >= MAX_SLOT_VALUES_KEPT:
        _slot_items.popitem(last=False)
    _slot_items[key] = (value, items)
    return items


def _slot_placements(value: PlacementSlot, mesh_id: bytes) -> list[tuple]:
    items = []
    for placement in value.placements:
        envelope, job = decode_message(placement.job, mesh_id, expect=JobManifest, allow_any_mesh=True)
        if envelope.signer != job.owner:
            raise RemoteProtocolError("a slot places a job not signed by its owner")
        items.append((placement, job, job_id(job)))
    return items


def slot_binding_error(iid: bytes, value: PlacementSlot, items: list, epoch: int, slot_ms: int) -> str | None:
    """SPEC.md P7: why ``value`` may not be decided by instance ``iid`` in ``epoch``, or None."""
    if slot_ms <= 0:
        return "this mesh does not place jobs in slots"
    if value.epoch != epoch or placement_slot_id(value.epoch, value.slot) != iid:
        return "instance is not the slot of epoch %d the value names" % epoch
    seen = set()
    for _placement, job, jid in items:
        if job.epoch != epoch or placement_slot(job, slot_ms) != value.slot:
            return "job %s is not one of this slot's" % jid.hex()[:12]
        if jid in seen:
            return "job %s is placed twice" % jid.hex()[:12]
        seen.add(jid)
    return None


@lru_cache(maxsize=1024)
def value_hash(value_bytes: bytes) -> bytes:
    """SPEC.md 6.4. Remembered: a slot's value (P7) is up to hundreds of KiB, and every
    vote, certificate and late job's proof asks for the hash of the same bytes."""
    return hashlib.sha256(b"meshnode/v1/value\x00" + value_bytes).digest()
