"""Membership (SPEC.md 5, 7): members, the membership change a membership instance
decides, attestations, endorsements, joins and leaves."""

from __future__ import annotations

from typing import ClassVar

from protocol.messages.fields import ENVELOPE, record
from protocol.schema import Int, Key, List, Nested, Record, Text, TextMap


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
    """A member vouching stake for a joining key (SPEC.md F7)."""
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
