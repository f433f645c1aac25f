"""Signing and decoding messages: the kind registry, ``sign_message``, ``decode_message``
(verify the envelope, parse the body strictly) and ``decode_value`` (SPEC.md 2, 4)."""

from __future__ import annotations

from protocol.signing import SigningIdentity
from protocol import codec
from protocol.caches import CoreCaches
from protocol.envelope import CHANNEL_AUTHENTICATED_KINDS, Envelope, open_envelope, seal, seal_unsigned
from protocol.errors import RemoteProtocolError
from protocol.messages.jobs import (Bid, CapabilityVector, Cancel, Decline, GangPlacement, JobExit, JobManifest,
                                    JobRefusal, Placement, PlacementSlot)
from protocol.messages.liveness import Checkpoint, CheckpointAck, Eviction, Heartbeat, Suspicion, SyncRequest
from protocol.messages.moves import JobMove, MoveRequest, ReflexTrigger, RunStopped
from protocol.messages.membership import Attestation, Endorsement, Join, Leave, MembershipChange
from protocol.messages.output import OutputData, OutputRead
from protocol.messages.gangs import GangReplacement, GangResize
from protocol.messages.preemption import Preemption
from protocol.messages.quota import QuotaGrant
from protocol.messages.replicas import ReplicaAction
from protocol.messages.votes import (CommitCertificate, Evidence, Precommit, Prevote, PrevoteCertificate, Proposal,
                                     RoundChange, RoundSync)
from protocol.schema import Record, scalars_only


MESSAGE_TYPES = {cls.KIND: cls for cls in (
    CapabilityVector, JobManifest, Bid, Decline, Proposal, Prevote, Precommit, PrevoteCertificate,
    CommitCertificate, RoundChange, RoundSync, Evidence, Heartbeat, Suspicion, Eviction, Checkpoint, CheckpointAck,
    Attestation, Endorsement, Join, Leave, Cancel, JobExit, SyncRequest, OutputRead, OutputData, JobRefusal,
    MoveRequest, ReflexTrigger, QuotaGrant, RunStopped,
)}


def sign_message(identity, mesh_id: bytes, message: Record, *, caches: CoreCaches | None = None) -> Envelope:
    """Seal ``message`` for ``mesh_id``. With ``caches``, a vote's decode is remembered too:
    what decoding its bytes would give is known (this envelope, its signature valid by
    construction, see seal, and this record, whose fields are scalars, so a decoded body
    holds the same values); a node's own vote comes back to it when it collects."""
    envelope = seal(identity, mesh_id, type(message).KIND, message.to_body(), caches=caches)
    if (caches is not None and type(message) in _PRIMED_KINDS and type(identity) is SigningIdentity
            and envelope._wire is not None):
        _remember_decoded(caches, (envelope._wire, mesh_id), (envelope, message))
    return envelope


# Votes: small and many. Bigger messages (a checkpoint's state) would only crowd the
# decode cache out.
_PRIMED_KINDS = frozenset((Prevote, Precommit))
if not all(scalars_only(cls.SCHEMA) for cls in _PRIMED_KINDS):
    raise TypeError("a vote kind gained a non-scalar field: its decode can no longer be primed")


def encode_message(identity, mesh_id: bytes, message: Record, *, caches: CoreCaches | None = None) -> bytes:
    return sign_message(identity, mesh_id, message, caches=caches).encode()


def encode_unsigned(public_key: bytes, mesh_id: bytes, message: Record) -> bytes:
    """A channel-authenticated message (a heartbeat, SPEC.md F1): no signature. A heartbeat's
    bytes are put together from its fixed parts and three integers (a node sends k of them
    every period): the same bytes as the envelope's canonical encoding, tested."""
    if type(message) is Heartbeat and len(mesh_id) == len(public_key) == 32:
        return b"".join((_ENVELOPE_PREFIX, _UNSIGNED_KEY_HEAD, mesh_id, _HEARTBEAT_KIND, b"\x83",
                         _HEARTBEAT_KEYS[0], codec.pack(message.epoch), _HEARTBEAT_KEYS[1],
                         codec.pack(message.sent_ms), _HEARTBEAT_KEYS[2], codec.pack(message.seq),
                         _UNSIGNED_KEY_HEAD, public_key, b"\xc4\x00"))
    return seal_unsigned(public_key, mesh_id, type(message).KIND, message.to_body()).encode()


HEARTBEAT_FRAME_MAX_BYTES = 256   # an unsigned heartbeat envelope is about 110 bytes


# A canonical envelope (SPEC.md 2.2) starts fixarray(6), version 1, bin8(32) mesh id, then
# its kind: so a heartbeat's first 46 bytes are fixed but for the mesh id.
_ENVELOPE_PREFIX = b"\x96\x01"                               # fixarray(6), version 1
_KIND_AT = len(_ENVELOPE_PREFIX) + len(codec.pack(bytes(32)))  # after bin8(32): byte 36
_HEARTBEAT_KIND = codec.pack(Heartbeat.KIND)


def is_heartbeat_frame(data: bytes) -> bool:
    """Whether ``data`` looks like a heartbeat envelope, read from its fixed leading bytes
    and verifying nothing (a driver steps such frames ahead of bulk ones, SPEC.md F1c; the
    core still decodes and checks them as any frame, so a frame that only looks like one
    gains nothing). No decoding: every frame a node receives passes here."""
    return (len(data) <= HEARTBEAT_FRAME_MAX_BYTES and data[:len(_ENVELOPE_PREFIX)] == _ENVELOPE_PREFIX
            and data[_KIND_AT:_KIND_AT + len(_HEARTBEAT_KIND)] == _HEARTBEAT_KIND)


_UINT_FORMATS = {0xcc: (1, 0x80), 0xcd: (2, 0x100), 0xce: (4, 0x1_0000), 0xcf: (8, 0x1_0000_0000)}
_INT_MAX = (1 << 63) - 1   # schema.Int()'s default bound, every heartbeat field's
_HEARTBEAT_KEYS = tuple(codec.pack(name) for name in sorted(Heartbeat.SCHEMA))   # epoch, sent_ms, seq
_UNSIGNED_KEY_HEAD = codec.pack(bytes(32))[:2]    # bin8, 32 bytes


def _canonical_uint(data: bytes, at: int) -> tuple[int, int]:
    """The non-negative integer msgpack encodes at ``at`` in its shortest form, and where it
    ends; (-1, at) for anything else (a negative, a longer form than needed, not an int)."""
    if at >= len(data):
        return -1, at
    first = data[at]
    if first < 0x80:
        return first, at + 1
    form = _UINT_FORMATS.get(first)
    if form is None:
        return -1, at
    size, least = form
    end = at + 1 + size
    value = int.from_bytes(data[at + 1:end], "big")
    if end > len(data) or value < least or value > _INT_MAX:
        return -1, at
    return value, end


def decode_heartbeat(data: bytes, mesh_id: bytes, sender: bytes) -> Heartbeat | None:
    """The heartbeat in ``data`` when ``data`` is, byte for byte, the canonical unsigned
    heartbeat envelope that ``sender`` makes for ``mesh_id`` (``encode_unsigned``); None
    for anything else. It accepts exactly the frames ``decode_message(data, mesh_id,
    Heartbeat, channel_sender=sender)`` accepts, with the same result, reading their fixed
    bytes and three integers instead of unpacking, re-encoding and checking a schema: a
    node reads k of them every period (SPEC F1d, issue 18)."""
    prefix_end = _KIND_AT + len(_HEARTBEAT_KIND)
    if (len(data) > HEARTBEAT_FRAME_MAX_BYTES or data[:len(_ENVELOPE_PREFIX)] != _ENVELOPE_PREFIX
            or data[len(_ENVELOPE_PREFIX):_KIND_AT] != _UNSIGNED_KEY_HEAD + mesh_id
            or data[_KIND_AT:prefix_end] != _HEARTBEAT_KIND or data[prefix_end:prefix_end + 1] != b"\x83"):
        return None
    at = prefix_end + 1
    values = []
    for key in _HEARTBEAT_KEYS:
        if data[at:at + len(key)] != key:
            return None
        value, at = _canonical_uint(data, at + len(key))
        if value < 0:
            return None
        values.append(value)
    if len(sender) != 32 or data[at:] != _UNSIGNED_KEY_HEAD + sender + b"\xc4\x00":
        return None
    epoch, sent_ms, seq = values
    return Heartbeat(epoch=epoch, seq=seq, sent_ms=sent_ms)


def decode_message(data: bytes, mesh_id: bytes, expect: type | None = None,
                   allow_any_mesh: bool = False, *, caches: CoreCaches | None = None,
                   channel_sender: bytes | None = None) -> tuple[Envelope, Record]:
    """Verify an envelope and parse its body strictly. Raises RemoteProtocolError.
    ``channel_sender``: the peer that delivered ``data`` (needed for a heartbeat, which is
    unsigned and counts only from its sender; such messages are never remembered).

    Decoding is a pure function of (bytes, mesh id) and its results are immutable, so
    ``caches.decoded`` remembers verified decodes: one node meets the same bytes many
    times (a bid in every proposal, a job in every placement, a certificate from its
    collector and again from a peer). One entry serves both ``allow_any_mesh`` settings:
    the envelope's own mesh id says whether a strict caller may have it."""
    table = caches.decoded if caches is not None else None
    key = (data, mesh_id) if table is not None and type(data) is bytes else None
    hit = table.get(key) if key is not None else None
    if hit is not None:
        table.move_to_end(key)
        if hit[0].mesh_id != mesh_id and not allow_any_mesh:
            raise RemoteProtocolError("envelope: signed for another mesh")
        if expect is not None and type(hit[1]) is not expect:
            raise RemoteProtocolError("expected a %s, got %r" % (expect.KIND, hit[0].kind))
        return hit
    envelope = open_envelope(data, mesh_id, allow_any_mesh=allow_any_mesh, caches=caches,
                             channel_sender=channel_sender)
    if envelope.kind in CHANNEL_AUTHENTICATED_KINDS:
        key = None   # valid only from its sender: a cache hit must not skip that check
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
        _remember_decoded(caches, key, decoded)
    return decoded


def _remember_decoded(caches: CoreCaches, key: tuple, decoded: tuple) -> None:
    table = caches.decoded
    if len(key[0]) > table.max_bytes // 64:
        return  # a huge message (checkpoint state) would push out hundreds of small ones
    table.remember(key, decoded)


_VALUE_TYPES = {"placement": Placement, "eviction": Eviction, "membership": MembershipChange,
                "placement_slot": PlacementSlot, "job_move": JobMove, "preemption": Preemption,
                "gang_placement": GangPlacement, "replica_action": ReplicaAction,
                "gang_replace": GangReplacement, "gang_resize": GangResize}


def decode_value(value_kind: str, data: bytes, *, caches: CoreCaches | None = None):
    """Decode the unsigned value inside a proposal or certificate. Remembered in
    ``caches.values`` like decode_message: the value is immutable and every validator
    decodes the same bytes."""
    table = caches.values if caches is not None else None
    if table is not None:
        hit = table.lookup((value_kind, data))
        if hit is not None:
            return hit
    cls = _VALUE_TYPES.get(value_kind)
    if cls is None:
        raise RemoteProtocolError("unknown value kind %r" % value_kind)
    try:
        value = cls.from_body(codec.unpack(data))
    except ValueError as exc:
        raise RemoteProtocolError(str(exc)) from None
    if table is not None:
        table.remember((value_kind, data), value)
    return value
