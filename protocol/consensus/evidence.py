"""Equivocation (SPEC.md 6.10): two conflicting proposals or votes signed by one key for
one (kind, epoch, round) prove that key Byzantine.

``Equivocations`` remembers the first message of each signer per slot and turns a
conflicting second one into ``Evidence``, kept (at most MAX_EVIDENCE), with the record
to persist and the event to report. The epoch is part of the slot: one instance id may run in two
epochs (SPEC.md P2), and equivocation in either is evidence.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from protocol.envelope import Envelope
from protocol.messages import Evidence
from protocol.ready import Event, PersistRecord

MAX_EVIDENCE = 256  # evidence kept per instance; more equivocation proves nothing new


class Equivocations:
    """The first proposal or vote seen per (kind, epoch, round, signer), and the evidence kept."""

    def __init__(self, instance_id: bytes):
        self.instance_id = instance_id
        self.evidence: list[Evidence] = []
        self._first_seen: dict[tuple, tuple[Envelope, bytes | None]] = {}
        self._evidenced: set[tuple] = set()

    def observe(self, kind: str, epoch: int, round: int, envelope: Envelope, data: bytes | None,
                now_ms: int) -> tuple[str | None, tuple[PersistRecord, Event] | None]:
        """(None, None) for the first message of its slot; ("duplicate", None) for the same
        signature again; ("equivocation", outputs) for a conflicting one, where outputs are
        the new evidence's record to persist and its event, or None if this slot already
        gave evidence or MAX_EVIDENCE are kept."""
        key = (kind, epoch, round, envelope.signer)
        first = self._first_seen.get(key)
        if first is None:
            self._first_seen[key] = (envelope, data)
            return None, None
        if first[0].signature == envelope.signature:
            return "duplicate", None
        # One piece of evidence per (kind, epoch, round, signer) is enough.
        if len(self.evidence) >= MAX_EVIDENCE or key in self._evidenced:
            return "equivocation", None
        self._evidenced.add(key)
        first_data = first[1] if first[1] is not None else first[0].encode()
        second_data = data if data is not None else envelope.encode()
        evidence = Evidence(envelope.signer, first_data, second_data)
        self.evidence.append(evidence)
        record = PersistRecord("evidence", hashlib.sha256(first_data + second_data).hexdigest(), {
            "instance": self.instance_id, "kind": kind, "round": round, **evidence.to_body()})
        event = Event("evidence", now_ms, {
            "instance": self.instance_id.hex(), "offender": envelope.signer.hex(), "kind": kind, "round": round})
        return "equivocation", (record, event)

    def restore(self, values: Iterable[dict]) -> None:
        """Evidence records persisted before a restart (their ``value`` maps), up to the cap."""
        for value in values:
            if len(self.evidence) < MAX_EVIDENCE:
                self.evidence.append(Evidence(value["offender"], value["first"], value["second"]))
