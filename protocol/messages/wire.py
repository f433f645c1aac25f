"""Signing and decoding messages: the kind registry, ``sign_message``, ``decode_message``
(verify the envelope, parse the body strictly) and ``decode_value`` (SPEC.md 2, 4)."""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

from keys.identity import SigningIdentity
from protocol import codec
from protocol.envelope import Envelope, open_envelope, seal
from protocol.errors import RemoteProtocolError
from protocol.messages.jobs import (Bid, CapabilityVector, Cancel, Decline, JobExit, JobManifest, Placement,
                                    PlacementSlot)
from protocol.messages.liveness import Checkpoint, CheckpointAck, Eviction, Heartbeat, Suspicion, SyncRequest
from protocol.messages.membership import Attestation, Endorsement, Join, Leave, MembershipChange
from protocol.messages.votes import (CommitCertificate, Evidence, Precommit, Prevote, PrevoteCertificate, Proposal,
                                     RoundChange, RoundSync)
from protocol.schema import Record, scalars_only


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
