"""The signed envelope that carries every message (SPEC.md section 2).

Wire form: a canonical msgpack array ``[version, mesh_id, kind, body, signer, signature]``.
The signature covers ``SIGNATURE_DOMAIN || pack([version, mesh_id, kind, body])``: the
domain tag keeps meshnode signatures from ever being valid in another protocol, and
the mesh id keeps a message signed for one mesh from being replayed into another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from protocol.signing import SigningIdentity, verify_signature
from protocol import codec
from protocol.caches import CoreCaches
from protocol.errors import RemoteProtocolError

PROTOCOL_VERSION = 1
SIGNATURE_DOMAIN = b"meshnode/v1/sig\x00"
ANY_MESH = bytes(32)  # a job signed without a genesis at hand (SPEC.md 4.2)
# Kinds the transport's handshake authenticates (SPEC.md 2.2, F1): they travel with an
# empty signature and count only from the peer that delivered them. A heartbeat is never
# forwarded as evidence, so an Ed25519 signature on it bought nothing but CPU.
CHANNEL_AUTHENTICATED_KINDS = frozenset({"heartbeat"})


@dataclass(frozen=True)
class Envelope:
    mesh_id: bytes
    kind: str
    body: dict
    signer: bytes
    signature: bytes
    version: int = PROTOCOL_VERSION
    # The canonical wire bytes, when this envelope was sealed or opened here: encoding is a
    # pure function of the fields, and votes are encoded by every node that handles them.
    # Not an init field, so an Envelope built by hand or by ``dataclasses.replace`` re-encodes.
    _wire: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def encode(self) -> bytes:
        wire = self._wire
        if wire is None:
            wire = codec.pack([self.version, self.mesh_id, self.kind, self.body, self.signer, self.signature])
        return wire

    @property
    def digest(self) -> bytes:
        """SHA-256 of the wire bytes: the envelope's identity (dedup, replay, evidence)."""
        return hashlib.sha256(self.encode()).digest()


def signing_input(version: int, mesh_id: bytes, kind: str, body: dict) -> bytes:
    return SIGNATURE_DOMAIN + codec.pack([version, mesh_id, kind, body])


def seal(identity: SigningIdentity, mesh_id: bytes, kind: str, body: dict, *,
         caches: CoreCaches | None = None) -> Envelope:
    message = signing_input(PROTOCOL_VERSION, mesh_id, kind, body)
    signature = identity.sign(message)
    if caches is not None and type(identity) is SigningIdentity:
        # Its public key is derived from the key that just signed, so the signature is
        # valid by construction (RFC 8032); this core never needs to check it again
        # (a node's own messages come back to it).
        caches.signatures.remember((identity.public_key, hashlib.sha256(message).digest(), signature), True)
    envelope = Envelope(mesh_id, kind, body, identity.public_key, signature)
    signer = identity.public_key
    if len(signer) == 32 and len(signature) == 64:
        # The inverse of _signed_part: the wire form is the signed array with the signer
        # and signature appended (bin8 headers 0xc4 0x20 and 0xc4 0x40), no second pack.
        wire = b"\x96" + message[len(SIGNATURE_DOMAIN) + 1:] + b"\xc4\x20" + signer + b"\xc4\x40" + signature
        if len(wire) <= codec.MAX_FRAME_BYTES:
            object.__setattr__(envelope, "_wire", wire)
    return envelope


def seal_unsigned(public_key: bytes, mesh_id: bytes, kind: str, body: dict) -> Envelope:
    """An envelope of a channel-authenticated kind: ``signer`` names the sender, the
    signature is empty, and only the peer the channel authenticated as ``signer`` may
    deliver it (open_envelope's ``channel_sender``)."""
    if kind not in CHANNEL_AUTHENTICATED_KINDS:
        raise ValueError("only %s travel unsigned" % ", ".join(sorted(CHANNEL_AUTHENTICATED_KINDS)))
    return Envelope(mesh_id, kind, body, public_key, b"")


def _verify(signer: bytes, message: bytes, signature: bytes, caches: CoreCaches | None) -> None:
    """Raise RemoteProtocolError unless ``signature`` is ``signer``'s over ``message``.
    A verdict is a pure function of its inputs: ``caches.signatures`` remembers the valid
    ones, since certificates re-carry votes a node has already checked (SPEC.md 2.4).
    Keyed by the SHA-256 of the signed bytes."""
    if caches is None:
        verify_signature(signer, message, signature)
        return
    key = (signer, hashlib.sha256(message).digest(), signature)
    table = caches.signatures
    if key in table:
        table.move_to_end(key)
        return
    verify_signature(signer, message, signature)
    table.remember(key, True)


_WIRE_TAIL_BYTES = (2 + 32) + (2 + 64)  # bin8 signer (32 bytes) + bin8 signature (64 bytes)


def _signed_part(data: bytes, version: int, mesh_id: bytes, kind: str, body: dict, signer: bytes,
                 signature: bytes) -> bytes:
    """The signing input of canonical envelope bytes ``data``, cut from them instead of
    re-encoded: ``data`` is ``0x96 || v || mesh || kind || body || signer || signature``
    and canonical, so ``pack([v, mesh, kind, body])`` is ``0x94`` plus the same middle."""
    if len(signer) == 32 and len(signature) == 64:
        return SIGNATURE_DOMAIN + b"\x94" + data[1:len(data) - _WIRE_TAIL_BYTES]
    return signing_input(version, mesh_id, kind, body)  # wrong lengths: verification fails anyway


def open_envelope(data: bytes, mesh_id: bytes, max_bytes: int = codec.MAX_FRAME_BYTES,
                  allow_any_mesh: bool = False, *, caches: CoreCaches | None = None,
                  channel_sender: bytes | None = None) -> Envelope:
    """Decode and verify an envelope for ``mesh_id``. Raises RemoteProtocolError on any fault.
    ``channel_sender``: the key the transport authenticated the delivering peer as; an
    envelope of a channel-authenticated kind is accepted only unsigned and from that peer."""
    value = codec.unpack(data, max_bytes)
    data = bytes(data)
    if not isinstance(value, list) or len(value) != 6:
        raise RemoteProtocolError("envelope: expected an array of 6 items")
    version, env_mesh, kind, body, signer, signature = value
    if version != PROTOCOL_VERSION:
        raise RemoteProtocolError("envelope: unsupported version %r" % (version,))
    if not isinstance(env_mesh, bytes) or len(env_mesh) != 32:
        raise RemoteProtocolError("envelope: mesh id must be 32 bytes")
    if env_mesh != mesh_id and not (allow_any_mesh and env_mesh == ANY_MESH):
        raise RemoteProtocolError("envelope: signed for another mesh")
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise RemoteProtocolError("envelope: kind must be text and body a map")
    if not isinstance(signer, bytes) or not isinstance(signature, bytes):
        raise RemoteProtocolError("envelope: signer and signature must be bin")
    if kind in CHANNEL_AUTHENTICATED_KINDS:
        if signature != b"":
            raise RemoteProtocolError("envelope: a %s carries no signature (the channel authenticates it)" % kind)
        if channel_sender is None or signer != channel_sender:
            raise RemoteProtocolError("envelope: a %s counts only from the peer that sent it" % kind)
    else:
        message = _signed_part(data, version, env_mesh, kind, body, signer, signature)
        _verify(signer, message, signature, caches)
    envelope = Envelope(env_mesh, kind, body, signer, signature, version)
    object.__setattr__(envelope, "_wire", data)  # canonical: unpack re-encoded it to these bytes
    return envelope
