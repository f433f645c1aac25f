"""Every message kind (SPEC.md 2.2-2.4, 4.1): round trip, and every corruption -> RemoteProtocolError.

Bodies are generated from each kind's SCHEMA, so a new field or kind is covered
without editing this file. Only RemoteProtocolError may escape a decoder: any other
exception type fails the test.
"""

import hashlib

import pytest
from hypothesis import given, settings, strategies as st

from keys.identity import SigningIdentity
from protocol import codec
from protocol.envelope import ANY_MESH, CHANNEL_AUTHENTICATED_KINDS, Envelope, seal
from protocol.errors import RemoteProtocolError
from protocol.messages import (MESSAGE_TYPES, REFLEX_AMOUNTS, CapabilityVector, Checkpoint, Gang, JobManifest,
                               MoveRequest, Reflex, Resources, Service, decode_message, encode_message,
                               encode_unsigned, is_heartbeat_frame)
from protocol.schema import Bool, Bytes, Int, List, Nested, Optional, Text, TextMap

SIGNER = SigningIdentity(bytes(range(32)))
OTHER = SigningIdentity(bytes(range(1, 33)))
MESH_ID = hashlib.sha256(b"property-test-mesh").digest()
OTHER_MESH_ID = hashlib.sha256(b"another-mesh").digest()
KINDS = sorted(MESSAGE_TYPES)
FAST = settings(max_examples=50, deadline=None)
PER_KIND = settings(max_examples=20, deadline=None)  # x 20 kinds


def _text(ftype: Text):
    if ftype.choices:
        return st.sampled_from(ftype.choices)
    return st.text(max_size=min(ftype.max_len, 12)).filter(
        lambda s: ftype.min_len <= len(s.encode("utf-8")) <= ftype.max_len)


def strategy_for(ftype):
    """A hypothesis strategy for valid wire values of a schema field type (small sizes)."""
    if isinstance(ftype, Int):
        return st.integers(ftype.low, ftype.high)
    if isinstance(ftype, Bool):
        return st.booleans()
    if isinstance(ftype, Bytes):
        return st.binary(min_size=ftype.min_len, max_size=max(ftype.min_len, min(ftype.max_len, 48)))
    if isinstance(ftype, Text):
        return _text(ftype)
    if isinstance(ftype, Optional):
        return st.none() | strategy_for(ftype.inner)
    if isinstance(ftype, List):
        return st.lists(strategy_for(ftype.item), max_size=min(ftype.max_items, 3))
    if isinstance(ftype, TextMap):
        return st.dictionaries(_text(Text(1, 64)), _text(Text(0, 256)), max_size=3)
    if isinstance(ftype, Nested):
        return body_strategy(ftype.cls)
    raise TypeError("no strategy for %r" % (ftype,))


def body_strategy(cls):
    body = st.fixed_dictionaries({name: strategy_for(ftype) for name, ftype in cls.SCHEMA.items()})
    if cls is Checkpoint:  # cross-field rule, SPEC.md 4.1
        body = body.map(lambda b: {**b, "state_hash": hashlib.sha256(b["state"]).digest()})
    if cls is Resources:  # cross-field rule, SPEC.md 4.1: a GPU share is a share of one GPU
        body = body.map(lambda b: {**b, "gpus": 1} if b["gpu_milli"] else b)
    if cls is JobManifest:  # SPEC.md 4.2: no reflex rules (the default service) is the key left out
        body = body.map(lambda b: {k: v for k, v in b.items() if not (k == "reflexes" and not v)
                                   and not (k == "service" and v == Service().to_body())})
    if cls is Service:  # cross-field rule, SPEC.md R4: min_replicas <= max_replicas
        body = body.map(lambda b: {**b, "min_replicas": min(b["min_replicas"], b["max_replicas"])})
    if cls is Reflex:  # cross-field rules, SPEC.md 4.2, R4: one of above and below; the action's amount
        body = body.map(lambda b: _coherent_reflex(
            {**b, "below": None} if b["above"] is not None else {**b, "below": b["below"] or 0}))
    if cls is CapabilityVector:  # SPEC.md R3a: signals only of running jobs, once each; none: left out
        body = body.map(_coherent_job_signals)
    if cls is MoveRequest:  # cross-field rule, SPEC.md R2: no target, or a 32-byte key
        body = body.map(lambda b: {**b, "to_node": b["to_node"].ljust(32, b"\x01") if b["to_node"] else b""})
    if cls is Gang:  # cross-field rules, SPEC.md GA1: a fixed size, or an elastic range with a size in it
        body = body.map(_coherent_gang)
    if cls.LEFT_OUT_AT_DEFAULT:  # a field at its default is left out, not sent (e.g. QuotaGrant.borrowed, Q6)
        body = body.map(lambda b: _left_out_at_default(cls, b))
    return body


def _left_out_at_default(cls, b: dict) -> dict:
    defaults = {name: cls.SCHEMA[name].encode(value) for name, value in cls.LEFT_OUT_AT_DEFAULT.items()}
    return {k: v for k, v in b.items() if not (k in defaults and v == defaults[k])}


def _coherent_reflex(b: dict) -> dict:
    low, high = REFLEX_AMOUNTS[b["action"]]
    amount = min(max(b["amount"], low), high)
    return {**b, "amount": amount} if amount else {k: v for k, v in b.items() if k != "amount"}


def _coherent_job_signals(b: dict) -> dict:
    running = list(dict.fromkeys(r["job_id"] for r in b["running"]))
    signals = [{**signal, "job_id": jid} for signal, jid in zip(b["job_signals"], running)]
    return {**b, "job_signals": signals} if signals else {k: v for k, v in b.items() if k != "job_signals"}


def _coherent_gang(b: dict) -> dict:
    if b["workers"]:
        return {**b, "min_workers": 0, "max_workers": 0, "multiple_of": 1}
    low = max(1, min(b["min_workers"], b["max_workers"]))
    return {**b, "min_workers": low, "max_workers": max(low, b["min_workers"], b["max_workers"]), "multiple_of": 1}


def message_strategy():
    return st.sampled_from(KINDS).flatmap(
        lambda kind: body_strategy(MESSAGE_TYPES[kind]).map(lambda body: MESSAGE_TYPES[kind].from_body(body)))


def assert_rejected(data: bytes, mesh_id: bytes = MESH_ID) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(data, mesh_id)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_round_trips(kind):
    @PER_KIND
    @given(body_strategy(MESSAGE_TYPES[kind]))
    def check(body):
        message = MESSAGE_TYPES[kind].from_body(body)
        if kind in CHANNEL_AUTHENTICATED_KINDS:   # unsigned; valid from its signer's channel only (2.2)
            data = encode_unsigned(SIGNER.public_key, MESH_ID, message)
            envelope, decoded = decode_message(data, MESH_ID, channel_sender=SIGNER.public_key)
            assert encode_unsigned(SIGNER.public_key, MESH_ID, decoded) == data
            assert_rejected(data)
        else:
            data = encode_message(SIGNER, MESH_ID, message)
            envelope, decoded = decode_message(data, MESH_ID)
            assert encode_message(SIGNER, MESH_ID, decoded) == data  # deterministic signing, one encoding
        assert decoded == message
        assert envelope.kind == kind and envelope.signer == SIGNER.public_key
    check()


@FAST
@given(message_strategy(), st.data())
def test_any_changed_byte_rejected(message, data):
    wire = bytearray(encode_message(SIGNER, MESH_ID, message))
    index = data.draw(st.integers(0, len(wire) - 1))
    wire[index] ^= data.draw(st.integers(1, 255))
    assert_rejected(bytes(wire))


@FAST
@given(message_strategy(), st.data())
def test_truncation_and_extension_rejected(message, data):
    wire = encode_message(SIGNER, MESH_ID, message)
    assert_rejected(wire[:data.draw(st.integers(0, len(wire) - 1))])
    assert_rejected(wire + data.draw(st.binary(min_size=1, max_size=8)))


@FAST
@given(message_strategy(), st.sampled_from([MESH_ID, ANY_MESH]))
def test_heartbeat_frames_are_told_from_their_leading_bytes(message, mesh_id):
    """F1c reads a frame's kind from its fixed leading bytes, never decoding: it must agree
    with the decoded kind for every kind of envelope."""
    kind = type(message).KIND
    if kind in CHANNEL_AUTHENTICATED_KINDS:
        data = encode_unsigned(SIGNER.public_key, mesh_id, message)
    else:
        data = encode_message(SIGNER, mesh_id, message)
    assert is_heartbeat_frame(data) == (kind == "heartbeat")
    assert not is_heartbeat_frame(data[:30])


@FAST
@given(message_strategy())
def test_wrong_mesh_rejected(message):
    wire = encode_message(SIGNER, MESH_ID, message)
    assert_rejected(wire, OTHER_MESH_ID)
    # Only jobs and attestations may be signed for ANY_MESH, and only when the receiver allows it.
    assert_rejected(encode_message(SIGNER, ANY_MESH, message))


@FAST
@given(message_strategy())
def test_wrong_signer_or_signature_rejected(message):
    envelope = seal(SIGNER, MESH_ID, type(message).KIND, message.to_body())
    forged_signer = Envelope(envelope.mesh_id, envelope.kind, envelope.body, OTHER.public_key, envelope.signature)
    assert_rejected(forged_signer.encode())
    other_signature = seal(OTHER, MESH_ID, envelope.kind, envelope.body).signature
    assert_rejected(Envelope(envelope.mesh_id, envelope.kind, envelope.body, envelope.signer,
                             other_signature).encode())


@FAST
@given(message_strategy())
def test_unknown_or_missing_field_rejected_even_when_signed(message):
    body = message.to_body()
    extra = seal(SIGNER, MESH_ID, type(message).KIND, {**body, "zz_unknown": 1}).encode()
    assert_rejected(extra)
    missing = dict(body)
    missing.pop(sorted(missing)[0])
    assert_rejected(seal(SIGNER, MESH_ID, type(message).KIND, missing).encode())


def test_unknown_kind_rejected():
    assert_rejected(seal(SIGNER, MESH_ID, "no_such_kind", {}).encode())


def test_oversized_input_rejected_before_decoding():
    assert_rejected(b"\x00" * (codec.MAX_FRAME_BYTES + 1))


def test_signed_checkpoint_with_wrong_state_hash_rejected():
    # SPEC.md 4.1 cross-field rule: a correctly signed but inconsistent record is still bad input.
    body = {"job_id": bytes(32), "fence": 0, "seq": 1, "progress": 0, "taken_ms": 0,
            "state": b"state", "state_hash": hashlib.sha256(b"other").digest()}
    assert_rejected(seal(SIGNER, MESH_ID, "checkpoint", body).encode())


@FAST
@given(message_strategy(), st.binary(max_size=64))
def test_random_garbage_in_a_signed_body_is_rejected_cleanly(message, garbage):
    body = message.to_body()
    name = sorted(body)[-1]
    wire = seal(SIGNER, MESH_ID, type(message).KIND, {**body, name: garbage}).encode()
    try:
        decode_message(wire, MESH_ID)
    except RemoteProtocolError:
        pass  # the only exception type a decoder may raise
