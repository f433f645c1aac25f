"""Ed25519 identities (SPEC.md section 1): the signing primitives of protocol/signing.py,
plus making a new key, which reads the OS's randomness and so stays out of the core.

One 32-byte seed is both the node's signing key and its libp2p identity: the peer ID
is derived from the public key exactly as libp2p derives it (tests/test_keys.py).
"""

from __future__ import annotations

import nacl.signing

from protocol.signing import (PUBLIC_KEY_BYTES, SEED_BYTES, SIGNATURE_BYTES, SigningIdentity, peer_id_bytes,
                              peer_id_from_public_key, public_key_from_peer_id, short_id, verify_signature)

__all__ = ["PUBLIC_KEY_BYTES", "SEED_BYTES", "SIGNATURE_BYTES", "SigningIdentity", "generate_identity",
           "peer_id_bytes", "peer_id_from_public_key", "public_key_from_peer_id", "short_id", "verify_signature"]


def generate_identity() -> SigningIdentity:
    """A new identity from a fresh random seed (the OS's CSPRNG, through libsodium)."""
    return SigningIdentity(bytes(nacl.signing.SigningKey.generate()))
