"""Authority attestations (SPEC.md section 5.3).

An attestation authority (a key listed in the genesis ``authorities``) signs an
``Attestation`` envelope about a subject key: attested attributes (for sovereign
placement: "jurisdiction" = "eu", ...) and optionally stake it vouches for. Nodes
carry these envelopes in their bids; every voter re-checks them with
:func:`verify_attestation`, so a node cannot claim an attribute nobody attested.
"""

from __future__ import annotations

from protocol.envelope import ANY_MESH
from protocol.errors import RemoteProtocolError
from protocol.messages import Attestation, decode_message, encode_message


def issue_attestation(authority, subject: bytes, attributes: dict[str, str], stake: int,
                      issued_ms: int, expires_ms: int, mesh_id: bytes = ANY_MESH) -> bytes:
    """Sign an attestation; with the default ANY_MESH it is valid in every mesh that trusts the authority."""
    if expires_ms <= issued_ms:
        raise ValueError("an attestation must expire after it is issued")
    statement = Attestation(subject=subject, attributes=tuple(sorted(attributes.items())), stake=stake,
                            issued_ms=issued_ms, expires_ms=expires_ms)
    return encode_message(authority, mesh_id, statement)


def verify_attestation(data: bytes, mesh_id: bytes, authorities, now_ms: int,
                       subject: bytes | None = None) -> Attestation:
    """Check an attestation envelope for use in ``mesh_id`` at ``now_ms``. Raises RemoteProtocolError.

    Valid means: signed by one of ``authorities`` (for this mesh or ANY_MESH), about
    ``subject`` when given, and ``issued_ms <= now_ms < expires_ms``.
    """
    envelope, statement = decode_message(data, mesh_id, expect=Attestation, allow_any_mesh=True)
    if envelope.signer not in set(authorities):
        raise RemoteProtocolError("attestation: signer is not an authority of this mesh")
    if subject is not None and statement.subject != subject:
        raise RemoteProtocolError("attestation: about another key")
    if not statement.issued_ms <= now_ms < statement.expires_ms:
        raise RemoteProtocolError("attestation: not valid at %d (valid %d..%d)"
                                  % (now_ms, statement.issued_ms, statement.expires_ms))
    return statement


def attested_attributes(attestations, mesh_id: bytes, authorities, now_ms: int,
                        subject: bytes) -> dict[str, str]:
    """Merge the attributes of every valid attestation about ``subject``; invalid ones are skipped.

    Two authorities that disagree on one attribute leave it out, so a voter never
    picks a side (SPEC.md 5.3).
    """
    merged: dict[str, str] = {}
    conflicting: set[str] = set()
    for data in attestations:
        try:
            statement = verify_attestation(data, mesh_id, authorities, now_ms, subject)
        except RemoteProtocolError:
            continue
        for key, value in statement.attributes:
            if merged.get(key, value) != value:
                conflicting.add(key)
            merged[key] = value
    return {k: v for k, v in merged.items() if k not in conflicting}
