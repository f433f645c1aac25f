"""Ed25519 signing and peer IDs: the pure primitives the envelope needs (SPEC.md section 1).

Signing is deterministic (RFC 8032) and verification a pure function, so both belong in
the core; making a new key (OS randomness) and storing it (files) are keys/'s business.
One 32-byte seed is both the node's signing key and its libp2p identity: py-libp2p's
Ed25519 key wraps ``nacl.signing.SigningKey(seed)``, so the peer ID computed here from
the public key equals the one libp2p derives (tests/test_keys.py checks it).
"""

from __future__ import annotations

import hashlib

import base58  # installed with libp2p; the peer-ID text form is base58btc
import nacl.exceptions
import nacl.signing

from protocol.errors import RemoteProtocolError

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
SEED_BYTES = 32


class SigningIdentity:
    """A private key. Signing is deterministic (RFC 8032), so it is safe in the pure core."""

    def __init__(self, seed: bytes):
        if len(seed) != SEED_BYTES:
            raise ValueError("an Ed25519 seed is %d bytes, got %d" % (SEED_BYTES, len(seed)))
        self.seed = bytes(seed)
        self._signing_key = nacl.signing.SigningKey(self.seed)
        self.public_key = bytes(self._signing_key.verify_key)

    def sign(self, message: bytes) -> bytes:
        return self._signing_key.sign(message).signature

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def __repr__(self) -> str:  # never print the seed
        return "SigningIdentity(%s)" % short_id(self.public_key)


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise RemoteProtocolError unless ``signature`` is ``public_key``'s over ``message``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise RemoteProtocolError("bad key or signature length")
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        raise RemoteProtocolError("bad signature") from None


def peer_id_bytes(public_key: bytes) -> bytes:
    """libp2p peer ID: identity multihash of the protobuf PublicKey{Type=Ed25519, Data=key}."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError("an Ed25519 public key is 32 bytes")
    protobuf = b"\x08\x01\x12\x20" + public_key  # field 1 varint 1 (Ed25519), field 2 len 32
    return b"\x00" + bytes([len(protobuf)]) + protobuf  # identity hash: keys <= 42 bytes are inlined


def peer_id_from_public_key(public_key: bytes) -> str:
    return base58.b58encode(peer_id_bytes(public_key)).decode("ascii")


def public_key_from_peer_id(peer_id: str) -> bytes:
    raw = base58.b58decode(peer_id)
    if len(raw) != 38 or raw[:6] != b"\x00\x24\x08\x01\x12\x20":
        raise RemoteProtocolError("not an Ed25519 peer ID: %s" % peer_id)
    return raw[6:]


def short_id(public_key: bytes) -> str:
    """A short human label for a key: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(public_key).hexdigest()[:8]
