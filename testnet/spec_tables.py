"""Generate SPEC.md's field tables and hex test vectors from the code.

The tables are rendered from each record's SCHEMA and the vectors by signing one
deterministic sample of every message kind with a fixed seed, so SPEC.md can be
regenerated instead of hand-edited, and tests/test_spec_vectors.py fails when the
two drift apart.

The samples hang together: the vector key is the only member (and the attestation
authority) of the sample genesis, whose mesh id every vector is signed for; the job is
owner-signed, every nested envelope is of the kind its field holds (NESTED_ENVELOPES),
and the consensus samples are one placement of that job in epoch 0, so the `commit`
vector verifies (`meshnode cert verify`) against the sample genesis.

    python -m testnet.spec_tables --write SPEC.md   # regenerate the generated blocks
    python -m testnet.spec_tables --check SPEC.md   # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
from functools import lru_cache
from types import SimpleNamespace

from keys.genesis import DEFAULT_PARAMS, Genesis, OwnerQuota, Pool, ProtocolParams, Quota
from keys.identity import SigningIdentity, peer_id_bytes
from keys.keystore import KDF_PROFILES, encode_keystore
from protocol import codec
from protocol.envelope import CHANNEL_AUTHENTICATED_KINDS, PROTOCOL_VERSION, seal, seal_unsigned, signing_input
from protocol.flows.epoch_change import epoch_change_instance_id
from protocol.flows.replica import REPLACEMENT_ANCHOR
from protocol.gang_placement import diameter, gang_port, gang_worker_id, pick_backups, pick_gang, topology_error
from protocol.messages import (ENVELOPE, MESSAGE_TYPES, Bid, CapabilityVector, Checkpoint, CommitCertificate,
                               Constraints, Evidence, Gang, GangPlacement, GangReplacement, GangResize, GangWorker, GpuState, Join, JobMove, Member,
                               MembershipChange, Migration, MoveRequest, OutputFile, Placement, PlacementSlot,
                               Preemption, PreemptionVictim, Proposal, PrevoteCertificate, Reflex, ReflexTrigger,
                               QuotaGrant, ReplicaAction, Resources, RoundChange, RoundSync, RunningJob, Service,
                               gang_replace_instance_id, gang_resize_instance_id, job_id, move_instance_id,
                               placement_instance_id,
                               placement_slot_id, preemption_instance_id, replica_instance_id, replica_key,
                               value_hash)
from protocol.quorum import EpochView
from protocol.quota_admission import QUOTA_HOME_TAG, grant_for, quota_home, quota_homes
from protocol.schema import Bool, Bytes, Int, List, Nested, Optional, Record, Text, TextMap
from protocol.messages import JobSignals

VECTOR_SEED = bytes(range(32))
VECTOR_EPOCH = 0          # every sample's epoch: the sample genesis' first epoch
VECTOR_ROUND = 1          # consensus samples are of round 1; the lock they carry is of round 0
VECTOR_TIME_MS = 1_700_000_000_000
# Records that appear only nested in messages or as decided values / genesis parts.
NESTED_RECORDS = (GpuState, RunningJob, JobSignals, Resources, Constraints, Placement, PlacementSlot, Migration, Member,
                  MembershipChange, ProtocolParams, Genesis, Pool, OwnerQuota, Quota, OutputFile, JobMove,
                  Preemption, PreemptionVictim, Gang, GangWorker, GangPlacement, GangReplacement, Reflex, Service,
                  ReplicaAction, GangResize)

# Which signed envelopes each ENVELOPE field holds: its SCHEMA says only "bin". Per field:
# the kind(s), then where SPEC.md says how the field's user checks them. Field tables and
# SPEC.md 3.1 are rendered from this; tests/test_spec_vectors.py checks that it names every
# ENVELOPE field of every schema and that every sample's nested envelopes are of these kinds.
NESTED_ENVELOPES = {
    (Bid, "capability"): (("cap",), "the bidder's own vector: signed by the bid's signer, `node` = that "
                                    "signer, this mesh; else the bid is invalid (P3, P4b)"),
    (Bid, "attestations"): (("attestation",), "this mesh or ANY_MESH; one that fails to verify, is not by a "
                                              "genesis authority, not about the bidder or not valid at the "
                                              "vector's `taken_ms` is ignored (P4, 5.3)"),
    (Proposal, "justification"): (("bid", "suspicion", "commit", "decline", "cap", "quota_grant"),
                                  "by `value_kind`: `placement`: the `bid`s of its primary and backups (P4d; a validator accepts at most 32), "
                                  "and in a slot mesh's late attempt-0 placement the slot's `commit` after them (P4b, "
                                  "P7c), and last, for a job whose owner has a quota in its pool, its `quota_grant` "
                                  "(exactly one, Q2c); `placement_slot`: `bid`s, at most 5 per job (P7b); `eviction`: "
                                  "`suspicion`s of the evicted node (at most 32, F5); `membership`: none (a "
                                  "validator ignores any); `preemption`: every member's `decline` and the "
                                  "candidate nodes' `cap`s (at most 64, P8b), then the job's in-quota `quota_grant` and the "
                                  "victims' borrowed ones (at most 5, Q6); `gang_replace`: the candidate members' `cap`s (at most 32, "
                                  "GA7); `gang_resize`: the same (GA9). For the other kinds one that fails "
                                  "makes the proposal invalid"),
    (Proposal, "pol_certificate"): (("prevote_cert",), "this instance, round `pol_round`, the value's hash; "
                                                       "else the proposal is invalid (6.3)"),
    (PrevoteCertificate, "prevotes"): (("prevote",), "one bad entry invalidates the certificate (6.1, 6.7)"),
    (CommitCertificate, "precommits"): (("precommit",), "one bad entry invalidates the certificate (6.1, 6.7)"),
    (RoundChange, "lock_certificate"): (("prevote_cert",), "of `locked_round` and the locked value; else the "
                                                           "round change is dropped (6.5)"),
    (RoundChange, "lock_proposal"): (("proposal",), "the locked round's proposal, signed by its leader; else the "
                                                    "round change is dropped (6.5)"),
    (RoundSync, "changes"): (("round_change",), "for the same (instance, round, epoch), distinct members; one "
                                                "bad entry drops the RoundSync (6.1, 6.5)"),
    (Evidence, "first"): (("proposal", "prevote", "precommit"),
                          "two envelopes of one of these kinds signed by `offender` for one (instance, round) "
                          "(6.10); evidence is kept locally, never accepted from a peer (4.1)"),
    (Evidence, "second"): (("proposal", "prevote", "precommit"), "as `first`"),
    (Join, "vouchers"): (("attestation", "endorsement"),
                         "an `attestation` by a genesis authority (this mesh or ANY_MESH) or `endorsement`s "
                         "by members (this mesh); others are ignored (F7)"),
    (Placement, "job"): (("job",), "this mesh or ANY_MESH, `owner` = signer (P2, P4b); in a certificate, 6.7"),
    (Preemption, "job"): (("job",), "this mesh or ANY_MESH, `owner` = signer (P8b); in a certificate, 6.7"),
    (GangPlacement, "job"): (("job",), "as Placement `job`, and the job has a `gang` of more than one "
                                       "worker (GA3)"),
    (GangReplacement, "job"): (("job",), "as GangPlacement `job` (GA7)"),
    (GangReplacement, "survivors"): (("cap",), "this mesh, one per surviving rank in rank order, signed by that "
                                               "rank's node, `node` = signer (GA7)"),
    (GangResize, "job"): (("job",), "as GangPlacement `job`, and the gang is elastic (GA9)"),
    (GangResize, "capabilities"): (("cap",), "this mesh, one per new node in `nodes` order, signed by that node, "
                                             "`node` = signer (GA9)"),
    (GangResize, "survivors"): (("cap",), "this mesh, one per rank that goes on in rank order, signed by that "
                                          "rank's node, `node` = signer (GA9)"),
    (MembershipChange, "evidence"): (("attestation", "endorsement"), "the join's vouchers (F7)"),
    (JobMove, "request"): (("move_request", "reflex_trigger"),
                           "this mesh, for this instance: a `move_request` signed by the job's owner (R2), or a "
                           "`reflex_trigger` signed by a member whose evidence proves the rule (R3)"),
    (ReflexTrigger, "evidence"): (("cap",), "this mesh, each signed by the job's primary, `node` = signer, "
                                            "consecutive seqs, each showing the rule's condition and the job "
                                            "running at `fence` (R3); for a replica action, one such chain "
                                            "per node running the job, the primary's first (R4g)"),
    (JobMove, "capability"): (("cap",), "this mesh, signed by `to_node`, `node` = `to_node`, showing room (R2)"),
    (ReplicaAction, "capabilities"): (("cap",), "this mesh, the i-th signed by the i-th of `nodes`, `node` = "
                                                "signer, showing room and healthy GPUs (R4c)"),
}

BEGIN = "<!-- BEGIN GENERATED: %s (python -m testnet.spec_tables --write SPEC.md) -->"
END = "<!-- END GENERATED: %s -->"


def vector_identity() -> SigningIdentity:
    return SigningIdentity(VECTOR_SEED)


def vector_key() -> bytes:
    return vector_identity().public_key


@lru_cache(maxsize=None)
def vector_genesis() -> Genesis:
    """One member (the vector key, which is also the attestation authority), default params."""
    return Genesis.from_body({
        "name": "test-vector-mesh", "created_ms": VECTOR_TIME_MS,
        "members": [{"public_key": vector_key(), "stake": 1, "zone": "zone-a", "labels": {"jurisdiction": "eu"},
                     "addrs": []}],
        "params": DEFAULT_PARAMS.to_body(), "authorities": [vector_key()]})


def vector_mesh_id() -> bytes:
    return vector_genesis().mesh_id


# --- deterministic sample values -------------------------------------------------------------

def _seal(kind: str, body: dict) -> bytes:
    return seal(vector_identity(), vector_mesh_id(), kind, body).encode()


def sample_value(ftype, field: str):
    """A small, valid, readable value of ``ftype`` (wire form, ready for from_body). An
    ENVELOPE field gets a placeholder here; sample_body puts the right kind in (below)."""
    if isinstance(ftype, Optional):
        return sample_value(ftype.inner, field)
    if isinstance(ftype, Int):
        wanted = VECTOR_TIME_MS if field.endswith("_ms") else VECTOR_EPOCH if field == "epoch" else 1
        return min(ftype.high, max(ftype.low, wanted))
    if isinstance(ftype, Bool):
        return False
    if ftype is ENVELOPE:  # (a proposal's `value` has an equal type, but holds no envelope)
        return b""
    if isinstance(ftype, Bytes):
        if ftype.min_len == ftype.max_len:
            return hashlib.sha256(field.encode("ascii")).digest()[:ftype.min_len]
        return b"\x01\x02\x03"
    if isinstance(ftype, Text):
        return ftype.choices[0] if ftype.choices else ("zone-a" if ftype.min_len else "")
    if isinstance(ftype, TextMap):
        return {"jurisdiction": "eu"}
    if isinstance(ftype, List):
        return [sample_value(ftype.item, field)]
    if isinstance(ftype, Nested):
        return sample_body(ftype.cls)
    raise TypeError("no sample for %r" % (ftype,))


def _generic_body(cls) -> dict:
    return {name: sample_value(ftype, name) for name, ftype in cls.SCHEMA.items()}


@lru_cache(maxsize=None)
def _job_envelope() -> bytes:
    return _seal("job", sample_body(MESSAGE_TYPES["job"]))


def sample_job_id() -> bytes:
    return job_id(MESSAGE_TYPES["job"].from_body(sample_body(MESSAGE_TYPES["job"])))


@lru_cache(maxsize=None)
def sample_decided_value() -> bytes:
    """The value of the proposal and commit samples: a Placement of the sample job."""
    return codec.pack(sample_body(Placement))


def _vote(kind: str, round: int, hash_: bytes | None) -> bytes:
    return _seal(kind, {"instance": sample_job_id(), "round": round, "epoch": VECTOR_EPOCH, "value_hash": hash_})


def _prevote_certificate(round: int) -> bytes:
    hash_ = value_hash(sample_decided_value())
    return _seal("prevote_cert", {"instance": sample_job_id(), "round": round, "epoch": VECTOR_EPOCH,
                                  "value_hash": hash_, "prevotes": [_vote("prevote", round, hash_)]})


def _proposal_body(round: int) -> dict:
    """A proposal of the sample placement; from round 1 on with its proof of lock from round 0."""
    locked = round > 0
    return {"instance": sample_job_id(), "round": round, "epoch": VECTOR_EPOCH, "value_kind": "placement",
            "value": sample_decided_value(), "justification": [_seal("bid", sample_body(Bid))],
            "pol_round": round - 1 if locked else None,
            "pol_certificate": _prevote_certificate(round - 1) if locked else None}


def _round_change_body(round: int) -> dict:
    return {"instance": sample_job_id(), "round": round, "epoch": VECTOR_EPOCH, "locked_round": round - 1,
            "lock_certificate": _prevote_certificate(round - 1),
            "lock_proposal": _seal("proposal", _proposal_body(round - 1))}


def _coherent(cls, body: dict) -> dict:
    """Make a generic sample body hang together with the others (see the module docstring)."""
    me, hash_ = vector_key(), None
    if "job_id" in body:
        body["job_id"] = sample_job_id()
    if cls is MESSAGE_TYPES["job"]:
        body.update(owner=me, name="vector-job", entrypoint="counter")  # 4.1: signed by its owner
        del body["reflexes"]   # 4.2: no reflexes, the key left out (the ReflexTrigger sample has its own)
        del body["service"]    # R4: the default service (one replica, no port), the key left out
    elif cls is Reflex:
        body.update(signal="gpu_temp", above=85, below=None, for_ms=5000, action="migrate", cooldown_ms=60_000)
        del body["amount"]     # R4: a migrate rule has no amount, the key left out
    elif cls is Service:
        body.update(port=8080, min_replicas=1, max_replicas=3)
    elif cls is ReplicaAction:
        body.update(job_id=sample_job_id(), seq=0, anchor=1, trigger=b"", nodes=[me],
                    capabilities=[_seal("cap", sample_body(CapabilityVector))], replicas=[], weights=[])
    elif cls is ReflexTrigger:
        body.update(rule=0, evidence=[_seal("cap", sample_body(CapabilityVector))])
    elif cls is CapabilityVector:
        body["node"] = me
        del body["job_signals"]   # R3a: none reported, the key left out (render_job_signals_vector has one)
    elif cls is Bid:
        body.update(instance=sample_job_id(), capability=_seal("cap", sample_body(CapabilityVector)),
                    attestations=[_seal("attestation", {"subject": me, "attributes": {"jurisdiction": "eu"},
                                                        "stake": 1, "issued_ms": VECTOR_TIME_MS - 1,
                                                        "expires_ms": VECTOR_TIME_MS + 86_400_000})])
    elif cls is Placement:
        body.update(job=_job_envelope(), primary=me, backups=[])
    elif cls is QuotaGrant:   # Q2b: the sample job's grant, by its quota home (the vector key, the only member)
        body = grant_for(MESSAGE_TYPES["job"].from_body(sample_body(MESSAGE_TYPES["job"]))).to_body()
    elif cls is Gang:
        body = Gang().to_body()   # the default: one worker, a plain job (GA1)
    elif cls is GangPlacement:
        body.update(job=_job_envelope(), backups=[])
    elif cls is GangReplacement:   # GA8's form: a shrink names no node and carries no vector
        body.update(job=_job_envelope(), to_node=b"", capability=b"", backups=[],
                    survivors=[_seal("cap", sample_body(CapabilityVector))])
    elif cls is GangResize:   # GA9's grow: one new rank on the vector key's node after one rank
        body.update(job=_job_envelope(), attempt=0, number=1, size=2, lost=b"", nodes=[me],
                    capabilities=[_seal("cap", sample_body(CapabilityVector))],
                    survivors=[_seal("cap", sample_body(CapabilityVector))])
    elif cls is Proposal:
        body = _proposal_body(VECTOR_ROUND)
    elif cls in (MESSAGE_TYPES["prevote"], MESSAGE_TYPES["precommit"]):
        hash_ = value_hash(sample_decided_value())
        body.update(instance=sample_job_id(), round=VECTOR_ROUND, value_hash=hash_)
    elif cls is PrevoteCertificate:
        body = codec.unpack(_prevote_certificate(VECTOR_ROUND))[3]
    elif cls is CommitCertificate:
        hash_ = value_hash(sample_decided_value())
        body = {"instance": sample_job_id(), "round": VECTOR_ROUND, "epoch": VECTOR_EPOCH, "value_kind": "placement",
                "value": sample_decided_value(), "precommits": [_vote("precommit", VECTOR_ROUND, hash_)]}
    elif cls is RoundChange:
        body = _round_change_body(VECTOR_ROUND)
    elif cls is RoundSync:
        body.update(instance=sample_job_id(), round=VECTOR_ROUND,
                    changes=[_seal("round_change", _round_change_body(VECTOR_ROUND))])
    elif cls is Evidence:   # one prevote for the value, another for nil: equivocation
        body.update(offender=me, first=_vote("prevote", VECTOR_ROUND, value_hash(sample_decided_value())),
                    second=_vote("prevote", VECTOR_ROUND, None))
    elif cls is Join:
        member = sample_body(Member)
        member["public_key"] = me               # F7: a join is signed by the joining key
        body.update(member=member, vouchers=[_seal("endorsement", {"candidate": me, "stake": member["stake"],
                                                                   "epoch": VECTOR_EPOCH})])
    elif cls is MembershipChange:
        body["evidence"] = [_seal("endorsement", {"candidate": body["member"]["public_key"],
                                                  "stake": body["member"]["stake"], "epoch": VECTOR_EPOCH})]
    elif cls is Member:
        body["public_key"] = me
    elif cls is MoveRequest:
        body["to_node"] = b""   # R2: the mesh picks the node
    elif cls is JobMove:
        request = {"job_id": sample_job_id(), "fence": 1, "to_node": b"", "requested_ms": VECTOR_TIME_MS}
        body.update(request=_seal("move_request", request), from_node=me, to_node=me, backups=[],
                    capability=_seal("cap", sample_body(CapabilityVector)))
    return body


def sample_body(cls) -> dict:
    body = _coherent(cls, _generic_body(cls))
    if cls is Checkpoint:
        body["state_hash"] = hashlib.sha256(body["state"]).digest()
    return body


def sample_message(kind: str) -> Record:
    cls = MESSAGE_TYPES[kind]
    return cls.from_body(sample_body(cls))


# --- rendering -------------------------------------------------------------------------------

def _field_type(cls, name: str, ftype) -> str:
    nested = NESTED_ENVELOPES.get((cls, name))
    if nested is None:
        return ftype.describe()
    kinds = " or ".join("`%s`" % k for k in nested[0])
    if isinstance(ftype, List):
        return "%s, each an envelope of kind %s (3.1)" % (ftype.describe(), kinds)
    return "%s: an envelope of kind %s (3.1)" % (ftype.describe(), kinds)


def render_field_tables() -> str:
    out = []
    for title, cls in [*((k, c) for k, c in MESSAGE_TYPES.items()),
                       *((None, c) for c in NESTED_RECORDS)]:
        heading = "kind `%s`: %s" % (title, cls.__name__) if title else "record %s" % cls.__name__
        out.append("#### %s\n\n| field | type and limits |\n| --- | --- |" % heading)
        out.extend("| `%s` | %s |" % (name, _field_type(cls, name, ftype)) for name, ftype in cls.SCHEMA.items())
        out.append("")
    return "\n".join(out).rstrip("\n")


def _record_name(cls) -> str:
    return "`%s`" % cls.KIND if getattr(cls, "KIND", None) else cls.__name__


def render_nested_envelopes() -> str:
    lines = ["| field | holds | checked |", "| --- | --- | --- |"]
    for (cls, name), (kinds, rule) in NESTED_ENVELOPES.items():
        lines.append("| %s `%s` | %s | %s |" % (_record_name(cls), name, ", ".join("`%s`" % k for k in kinds), rule))
    return "\n".join(lines)


def vector_for(kind: str) -> dict[str, str]:
    identity = vector_identity()
    body = sample_message(kind).to_body()
    if kind in CHANNEL_AUTHENTICATED_KINDS:   # no signing input, an empty signature (2.2)
        envelope = seal_unsigned(identity.public_key, vector_mesh_id(), kind, body)
        return {"kind": kind, "body": codec.pack(body).hex(), "envelope": envelope.encode().hex()}
    envelope = seal(identity, vector_mesh_id(), kind, body)
    return {
        "kind": kind,
        "body": codec.pack(body).hex(),
        "signing_input": signing_input(PROTOCOL_VERSION, vector_mesh_id(), kind, body).hex(),
        "signature": envelope.signature.hex(),
        "envelope": envelope.encode().hex(),
    }


def render_vectors() -> str:
    identity = vector_identity()
    lines = ["```", "seed: %s" % VECTOR_SEED.hex(), "public_key: %s" % identity.public_key.hex(),
             "mesh_id: %s" % vector_mesh_id().hex(), "```", ""]
    for kind in MESSAGE_TYPES:
        lines.append("```")
        lines.extend("%s: %s" % item for item in vector_for(kind).items())
        lines.extend(["```", ""])
    return "\n".join(lines).rstrip("\n")


VECTOR_EPOCH_CHANGES = (0, 1, 300)


def render_derived_ids() -> str:
    """The ids a client computes itself: mesh id (5.2), job id (4.2), value hash (6.4),
    peer id (1.2), epoch-change instance id (F4)."""
    key = vector_key()
    lines = ["```",
             "genesis: %s" % vector_genesis().encode().hex(),
             "mesh_id: %s" % vector_mesh_id().hex(),
             "job_body: %s" % codec.pack(sample_body(MESSAGE_TYPES["job"])).hex(),
             "job_id: %s" % sample_job_id().hex(),
             "value: %s" % sample_decided_value().hex(),
             "value_hash: %s" % value_hash(sample_decided_value()).hex(),
             "public_key: %s" % key.hex(),
             "peer_id_bytes: %s" % peer_id_bytes(key).hex(),
             "peer_id: %s" % vector_identity().peer_id]
    lines.extend("epoch_change_instance epoch=%d: %s" % (epoch, epoch_change_instance_id(epoch).hex())
                 for epoch in VECTOR_EPOCH_CHANGES)
    lines.append("```")
    return "\n".join(lines)


VECTOR_JOB_ID = bytes(range(32))
# (epoch, slot) pairs of the slot instance id vectors: a typical one and a negative slot.
VECTOR_SLOTS = ((0, 34_000_000_000), (3, -1))


def render_instance_ids() -> str:
    """Placement instance ids derived from a job id (P2) and from a slot (P7)."""
    lines = ["```", "job_id: %s" % VECTOR_JOB_ID.hex()]
    for attempt in (1, 2):
        lines.append("retry_instance attempt=%d: %s" % (attempt, placement_instance_id(VECTOR_JOB_ID, attempt).hex()))
    for epoch, slot in VECTOR_SLOTS:
        lines.append("slot_instance epoch=%d slot=%d: %s" % (epoch, slot, placement_slot_id(epoch, slot).hex()))
    for attempt in (0, 1):
        lines.append("preemption_instance attempt=%d: %s" % (
            attempt, preemption_instance_id(placement_instance_id(VECTOR_JOB_ID, attempt)).hex()))
    lines.append("```")
    return "\n".join(lines)


def render_move_vectors() -> str:
    """R2: the instance that may move the sample job away from fence 1, and a JobMove value
    (its owner's request and the target's vector signed by the vector key; samples only: a
    real move goes to another node than its primary)."""
    value = codec.pack(sample_body(JobMove))
    return "\n".join(["```", "job_id: %s" % sample_job_id().hex(), "fence: 1",
                      "move_instance: %s" % move_instance_id(sample_job_id(), 1).hex(),
                      "job_move_value: %s" % value.hex(), "value_hash: %s" % value_hash(value).hex(), "```"])


def render_replica_vectors() -> str:
    """R4: the instance of the sample job's first replica action noticed at vector seq 1, a
    fill adding one replica on the vector key's node (a sample only: a real replica goes to
    another node than the primary), its hash, and the ledger key of replica 1."""
    value = codec.pack(sample_body(ReplicaAction))
    return "\n".join(["```", "job_id: %s" % sample_job_id().hex(), "seq: 0", "anchor: 1",
                      "replica_instance: %s" % replica_instance_id(sample_job_id(), 0, 1).hex(),
                      "replica_action_value: %s" % value.hex(), "value_hash: %s" % value_hash(value).hex(),
                      "replica_key index=1: %s" % replica_key(sample_job_id(), 1).hex(),
                      # R4h: replica 1's end (killed: 137), as its node signs it, and the instance
                      # of the replacement it triggers at seq 0.
                      "replica_end: %s" % _seal("job_exit", {"job_id": replica_key(sample_job_id(), 1), "fence": 1,
                                                             "exit_code": 137}).hex(),
                      "replacement_instance seq=0 replica=1: %s" % replica_instance_id(
                          sample_job_id(), 0, REPLACEMENT_ANCHOR + 1).hex(), "```"])


def sample_preemption() -> Preemption:
    """P8: the sample job (attempt 0) placed by preempting two jobs on the vector key's node."""
    victims = tuple(PreemptionVictim(job_id=bytes([b]) * 32, fence=65_537) for b in (0x11, 0x22))
    return Preemption(job=_job_envelope(), attempt=0, node=vector_key(), victims=victims)


def render_preemption_vector() -> str:
    """A preemption value (P8a) as it is decided: its canonical bytes, hash and instance."""
    value = codec.pack(sample_preemption().to_body())
    return "\n".join(["```", "preemption_value: %s" % value.hex(), "value_hash: %s" % value_hash(value).hex(),
                      "instance: %s" % preemption_instance_id(placement_instance_id(sample_job_id(), 0)).hex(),
                      "```"])


VECTOR_QUOTA_POOL = "training"


def vector_quota_members() -> list[bytes]:
    """Q2b's vector membership: the vector key and three keys derived from it."""
    return sorted([vector_key()] + [hashlib.sha256(b"member %d" % i).digest() for i in (1, 2, 3)])


def render_quota_home_vector() -> str:
    """Q2b: each member's rendezvous digest for (the vector key as owner, pool 'training'),
    the home (the member of the greatest digest) and, with stake 1 each, the home and its
    deputy (the shortest prefix of the ranking holding over a third of the stake)."""
    owner, name = vector_key(), VECTOR_QUOTA_POOL.encode("utf-8")
    lines = ["```", "owner: %s" % owner.hex(), "pool: %s" % VECTOR_QUOTA_POOL]
    for member in vector_quota_members():
        digest = hashlib.sha256(QUOTA_HOME_TAG + owner + bytes([len(name)]) + name + member).digest()
        lines.append("member %s digest %s" % (member.hex(), digest.hex()))
    lines.append("home: %s" % quota_home(vector_quota_members(), owner, VECTOR_QUOTA_POOL).hex())
    view = EpochView(VECTOR_EPOCH, {member: 1 for member in vector_quota_members()})
    lines.append("homes, stake 1 each: %s" % " ".join(h.hex() for h in quota_homes(view, owner, VECTOR_QUOTA_POOL)))
    lines.append("```")
    return "\n".join(lines)


def borrowing_sample_job():
    """Q6: the sample job of 4.4 made preemptible (only a preemptible job borrows)."""
    job = MESSAGE_TYPES["job"].from_body(sample_body(MESSAGE_TYPES["job"]))
    return dataclasses.replace(job, scheduling=dataclasses.replace(job.scheduling, preemptible=True))


def render_borrowed_grant_vector() -> str:
    """Q6: the borrowed grant of the preemptible sample job, signed by the vector key."""
    job = borrowing_sample_job()
    body = grant_for(job, borrowed=True).to_body()
    envelope = seal(vector_identity(), vector_mesh_id(), "quota_grant", body)
    return "\n".join(["```", "job_body: %s" % codec.pack(job.to_body()).hex(), "job_id: %s" % job_id(job).hex(),
                      "grant_body: %s" % codec.pack(body).hex(), "envelope: %s" % envelope.encode().hex(), "```"])


VECTOR_PASSPHRASE = b"meshnode test vector"
VECTOR_SALT = bytes(range(16))
VECTOR_NONCE = bytes(range(24))


def render_keystore_vector() -> str:
    """A keystore for VECTOR_SEED, with fixed salt and nonce and the cheapest KDF limits."""
    document = encode_keystore(vector_identity(), VECTOR_PASSPHRASE, KDF_PROFILES["insecure-test"],
                               salt=VECTOR_SALT, nonce=VECTOR_NONCE)
    return "passphrase (UTF-8): `%s`\n\n```json\n%s```" % (VECTOR_PASSPHRASE.decode(), document.decode())


def render_job_signals_vector() -> str:
    """R3a: the sample vector with the sample job's reported load (12.5 requests/s, p99
    40.25 ms, 3 progress units/s), as the vector key signs it."""
    body = sample_body(CapabilityVector)
    body["job_signals"] = [{"job_id": sample_job_id(), "request_rate_milli": 12_500, "latency_p99_us": 40_250,
                            "progress_rate_milli": 3_000}]
    envelope = _seal("cap", body)
    return "\n".join(["```", "body: %s" % codec.pack(body).hex(), "envelope: %s" % envelope.hex(), "```"])


# GA2's worked example: bidders in rank order, (name, zone, rail group).
GANG_EXAMPLE = (("n0", "zone-a", "rail-1"), ("n1", "zone-b", "rail-3"), ("n2", "zone-a", "rail-2"),
                ("n3", "zone-a", "rail-1"), ("n4", "zone-b", "rail-3"), ("n5", "zone-b", "rail-3"))
GANG_EXAMPLE_CASES = (("none", (2,)), ("zone", (3,)), ("rail_group", (3,)), ("rail_group", (4, 3)),
                      ("spread_zones", (4,)), ("zone", (4,)))


def render_gang_vectors() -> str:
    """GA2's worked example (topology, sizes -> ranks, diameter, backups) and GA4/GA5's ids."""
    bidders = [SimpleNamespace(signer=name.encode(), capability=SimpleNamespace(node=name, zone=zone, rail_group=rail))
               for name, zone, rail in GANG_EXAMPLE]
    lines = ["```"]
    lines.extend("bidder %d: %s %s %s" % (i, *entry) for i, entry in enumerate(GANG_EXAMPLE))
    for topology, sizes in GANG_EXAMPLE_CASES:
        workers = pick_gang(topology, sizes, bidders)
        if workers is None:
            lines.append("%s sizes=%s: none fits" % (topology, list(sizes)))
            continue
        caps = [w.capability for w in workers]
        assert topology_error(topology, caps) is None
        lines.append("%s sizes=%s: ranks %s diameter %d backups %s" % (
            topology, list(sizes), " ".join(w.capability.node for w in workers), diameter(caps),
            " ".join(b.capability.node for b in pick_backups(workers, bidders, 2))))
    lines.append("job_id: %s" % VECTOR_JOB_ID.hex())
    for rank in (0, 1):
        worker = gang_worker_id(VECTOR_JOB_ID, rank)
        lines.append("gang_worker_id rank=%d: %s" % (rank, worker.hex()))
        lines.append("gang_port rank=%d fence=1: %d" % (rank, gang_port(worker, 1)))
    lines.append("gang_replace_instance_id rank=1 fence=2: %s" % gang_replace_instance_id(
        gang_worker_id(VECTOR_JOB_ID, 1), 2).hex())
    lines.append("```")
    return "\n".join(lines)


def render_gang_resize_vectors() -> str:
    """GA9: the instance of the sample job's resize 1 of attempt 0, and a grow value (the
    sample's: one new rank after one, both vectors the vector key's, a sample only) with its hash."""
    value = codec.pack(sample_body(GangResize))
    return "\n".join(["```", "job_id: %s" % sample_job_id().hex(), "attempt: 0", "number: 1",
                      "gang_resize_instance_id: %s" % gang_resize_instance_id(sample_job_id(), 0, 1).hex(),
                      "gang_resize_value: %s" % value.hex(), "value_hash: %s" % value_hash(value).hex(), "```"])


GENERATED = {"nested envelopes": render_nested_envelopes, "field tables": render_field_tables,
             "test vectors": render_vectors, "derived ids": render_derived_ids,
             "instance ids": render_instance_ids, "keystore vector": render_keystore_vector,
             "move vectors": render_move_vectors, "replica vectors": render_replica_vectors,
             "preemption vector": render_preemption_vector,
             "job signals vector": render_job_signals_vector,
             "gang vectors": render_gang_vectors, "quota home vector": render_quota_home_vector,
             "gang resize vectors": render_gang_resize_vectors, "borrowed grant vector": render_borrowed_grant_vector}


def generated_block(text: str, name: str) -> str:
    """The text between the markers of block ``name`` in SPEC.md."""
    begin, end = BEGIN % name, END % name
    if begin not in text or end not in text:
        raise ValueError("SPEC.md has no generated block %r" % name)
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def regenerate(text: str) -> str:
    for name, render in GENERATED.items():
        generated_block(text, name)  # both markers present
        head, rest = text.split(BEGIN % name, 1)
        tail = rest.split(END % name, 1)[1]
        text = head + BEGIN % name + "\n" + render() + "\n" + END % name + tail
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="SPEC")
    mode.add_argument("--check", metavar="SPEC")
    args = parser.parse_args(argv)
    path = args.write or args.check
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    fresh = regenerate(text)
    if args.check:
        if fresh != text:
            print("%s: generated blocks are stale; run python -m testnet.spec_tables --write %s" % (path, path))
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
