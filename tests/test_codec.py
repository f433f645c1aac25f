"""Canonical msgpack (SPEC.md 2.1, 2.3): one encoding per value, everything else rejected."""

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from protocol import codec
from protocol.errors import LocalProtocolError, RemoteProtocolError

canonical_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(canonical_values)
def test_round_trip_is_identity(value):
    data = codec.pack(value)
    assert codec.unpack(data) == value
    assert codec.pack(codec.unpack(data)) == data


def test_map_keys_are_sorted_by_utf8_bytes():
    # "Z" (0x5a) < "a" (0x61) < "é" (0xc3 0xa9) bytewise, whatever the insertion order.
    data = codec.pack({"é": 1, "a": 2, "Z": 3})
    assert data == bytes.fromhex("83") + b"\xa1Z\x03" + b"\xa1a\x02" + b"\xa2\xc3\xa9\x01"


def test_unsorted_map_keys_rejected():
    unsorted = bytes.fromhex("82") + b"\xa1b\x01" + b"\xa1a\x02"
    with pytest.raises(RemoteProtocolError, match="not canonical"):
        codec.unpack(unsorted)


@pytest.mark.parametrize("data", [
    bytes.fromhex("cc01"),              # 1 as uint8: fixint is shorter
    bytes.fromhex("cd0001"),            # 1 as uint16
    bytes.fromhex("d0ff"),              # -1 as int8: negative fixint is shorter
    bytes.fromhex("cf0000000000000005"),  # 5 as uint64
    bytes.fromhex("d90161"),            # "a" as str8: fixstr is shorter
    bytes.fromhex("dc000101"),          # [1] as array16
    bytes.fromhex("de0000"),            # {} as map16
])
def test_non_minimal_forms_rejected(data):
    with pytest.raises(RemoteProtocolError):
        codec.unpack(data)


@pytest.mark.parametrize("data", [
    msgpack.packb(1.5),                       # float64
    bytes.fromhex("ca3fc00000"),              # float32
    msgpack.packb({"x": 0.0}),                # float nested in a map
    msgpack.packb(msgpack.ExtType(1, b"x")),  # ext type
    msgpack.packb({1: 2}, strict_types=False),  # non-text map key
    bytes.fromhex("82a16101a16102"),          # duplicate key: decodes to one entry, re-encodes differently
    bytes.fromhex("a1ff"),                    # str that is not valid UTF-8
    b"",                                       # nothing at all
    bytes.fromhex("01 02".replace(" ", "")),  # trailing data after a complete value
    bytes.fromhex("c1"),                      # never-used msgpack byte
])
def test_invalid_or_non_canonical_input_rejected(data):
    with pytest.raises(RemoteProtocolError):
        codec.unpack(data)


def test_floats_refused_when_encoding():
    with pytest.raises(LocalProtocolError, match="floats"):
        codec.pack({"util": 0.5})


def test_nesting_deeper_than_cap_rejected():
    value = []
    for _ in range(codec.MAX_DEPTH + 1):
        value = [value]
    with pytest.raises(LocalProtocolError):
        codec.pack(value)
    with pytest.raises(RemoteProtocolError):
        codec.unpack(b"\x91" * 100_000 + b"\xc0")  # deep nesting within the size cap


def test_size_cap_checked_before_decoding():
    big = codec.pack(b"x" * 1000)
    with pytest.raises(RemoteProtocolError, match="over the"):
        codec.unpack(big, max_bytes=999)
    with pytest.raises(RemoteProtocolError):
        codec.unpack(b"\xc6\xff\xff\xff\xff")  # bin32 claiming 4 GiB: no allocation, clean error


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_remote_protocol_error(data):
    try:
        value = codec.unpack(data)
    except RemoteProtocolError:
        return
    assert codec.pack(value) == data  # anything accepted is exactly canonical


def _accepted_by_re_encoding(data: bytes) -> bool:
    """The decoder's acceptance rule stated the slow way: decode leniently, and accept
    iff the canonical encoder reproduces the input byte for byte."""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, max_ext_len=0)
        return codec.pack(value) == data
    except Exception:
        return False


# Values msgpack can encode but the canonical encoder may refuse or re-order: floats,
# non-text keys, maps in arbitrary insertion order, deep nesting.
loose_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=6)
    | st.binary(max_size=6) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3)
    | st.lists(st.tuples(st.text(max_size=3) | st.binary(max_size=2) | st.integers(0, 3), inner),
               max_size=3).map(dict),
    max_leaves=24,
)


@settings(max_examples=300, deadline=None)
@given(loose_values, st.binary(max_size=3), st.integers(0, 64))
def test_decoder_accepts_exactly_what_re_encoding_reproduces(value, splice, at):
    """The walk-based check in unpack must keep the rule of SPEC.md 2.1 unchanged:
    for arbitrary msgpack (and byte-level corruptions of it), unpack succeeds iff
    re-encoding canonically gives back the same bytes."""
    encoded = msgpack.packb(value, use_bin_type=True)
    for data in (encoded, encoded[:at] + splice + encoded[at + len(splice):]):
        try:
            codec.unpack(data)
            accepted = True
        except RemoteProtocolError:
            accepted = False
        assert accepted == _accepted_by_re_encoding(data), data.hex()


@pytest.mark.parametrize("levels, accepted", [(codec.MAX_DEPTH, True), (codec.MAX_DEPTH + 1, False)])
def test_depth_cap_is_the_same_for_encoder_and_decoder(levels, accepted):
    value: list = [None]
    for _ in range(levels - 1):
        value = [value]
    # ``levels`` nested lists put the innermost item at depth ``levels``.
    data = msgpack.packb(value)
    if accepted:
        assert codec.unpack(data) == value and codec.pack(value) == data
    else:
        with pytest.raises(RemoteProtocolError):
            codec.unpack(data)
        with pytest.raises(LocalProtocolError):
            codec.pack(value)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), canonical_values, max_size=4), st.text(max_size=12))
def test_signing_input_cut_from_wire_bytes_equals_re_encoded(body, kind):
    """open_envelope takes the signed part from the received bytes; it must be exactly
    what the signer signed (SPEC.md 2.2), or every verification would fail."""
    from keys.identity import SigningIdentity
    from protocol import envelope as env

    sealed = env.seal(SigningIdentity(bytes(range(32))), bytes(32), kind, body)
    data = sealed.encode()
    expected = env.signing_input(sealed.version, sealed.mesh_id, kind, body)
    assert env._signed_part(data, sealed.version, sealed.mesh_id, kind, body, sealed.signer,
                            sealed.signature) == expected
    assert env.open_envelope(data, bytes(32)) == sealed


def test_signatures_remembered_at_sealing_do_not_vouch_for_altered_envelopes():
    """seal() records its own signature as verified; a flipped signature byte or another
    signer's key on the same bytes must still be checked, and fail."""
    from keys.identity import SigningIdentity
    from protocol import envelope as env
    from protocol.caches import CoreCaches

    caches = CoreCaches()
    signer, other = SigningIdentity(bytes(range(32))), SigningIdentity(bytes(range(1, 33)))
    sealed = env.seal(signer, bytes(32), "note", {"n": 1}, caches=caches)
    assert len(caches.signatures) == 1
    assert env.open_envelope(sealed.encode(), bytes(32), caches=caches) == sealed
    flipped = bytearray(sealed.signature)
    flipped[0] ^= 1
    for forged in (env.Envelope(sealed.mesh_id, sealed.kind, sealed.body, sealed.signer, bytes(flipped)),
                   env.Envelope(sealed.mesh_id, sealed.kind, sealed.body, other.public_key, sealed.signature)):
        with pytest.raises(RemoteProtocolError, match="signature"):
            env.open_envelope(forged.encode(), bytes(32), caches=caches)
    assert len(caches.signatures) == 1


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), canonical_values, max_size=4), st.text(max_size=12))
def test_sealed_wire_bytes_equal_the_packed_envelope(body, kind):
    """seal() builds the wire form from its signing input instead of packing again; it must
    be byte for byte the canonical packing of the envelope's fields (SPEC.md 2.2)."""
    from dataclasses import replace

    from keys.identity import SigningIdentity
    from protocol import envelope as env

    sealed = env.seal(SigningIdentity(bytes(range(32))), bytes(32), kind, body)
    packed = codec.pack([sealed.version, sealed.mesh_id, kind, body, sealed.signer, sealed.signature])
    assert sealed.encode() == packed
    assert env.open_envelope(packed, bytes(32)).encode() == packed
    # An edited copy re-encodes its own fields rather than reusing the original's bytes.
    assert replace(sealed, kind=kind + "x").encode() != packed


def test_decoded_message_cache_keeps_the_mesh_check():
    """One cache entry serves lenient and strict decodes: a job signed for any mesh, decoded
    leniently first, is still refused by a strict decode of the same bytes."""
    from keys.identity import SigningIdentity
    from protocol.caches import CoreCaches
    from protocol.envelope import ANY_MESH
    from protocol.messages import Cancel, decode_message, encode_message

    caches = CoreCaches()
    mesh = bytes(range(32))
    data = encode_message(SigningIdentity(bytes(range(32))), ANY_MESH, Cancel(job_id=bytes(32), requested_ms=1))
    envelope, cancel = decode_message(data, mesh, allow_any_mesh=True, caches=caches)
    assert envelope.mesh_id == ANY_MESH and cancel.requested_ms == 1
    assert len(caches.decoded) == 1
    with pytest.raises(RemoteProtocolError, match="another mesh"):
        decode_message(data, mesh, caches=caches)
    with pytest.raises(RemoteProtocolError, match="another mesh"):
        decode_message(data, mesh)


def test_a_sealed_vote_decodes_from_the_cache_as_from_its_bytes():
    """sign_message remembers what decoding a vote's bytes gives; it must equal a real decode."""
    from keys.identity import SigningIdentity
    from protocol import messages
    from protocol.caches import CoreCaches

    mesh = bytes(range(32))
    for vote in (messages.Prevote(bytes(range(32)), 2, 1, None), messages.Precommit(bytes(32), 0, 0, bytes(32))):
        caches = CoreCaches()
        data = messages.sign_message(SigningIdentity(bytes(32)), mesh, vote, caches=caches).encode()
        assert len(caches.decoded) == 1
        cached = messages.decode_message(data, mesh, expect=type(vote), caches=caches)
        assert cached[1] is vote  # primed: the record signed, not a decode of its bytes
        decoded = messages.decode_message(data, mesh, expect=type(vote))
        assert cached == decoded and cached[1] == vote
        assert dict(cached[0].body) == dict(decoded[0].body) and cached[0].encode() == data
