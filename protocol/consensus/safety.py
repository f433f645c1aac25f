"""What one consensus instance must never forget (SPEC.md 6.9): the proposals and votes it
signed, and the value it is locked on (6.6).

A node signs at most one Proposal, Prevote and Precommit per round. ``SafetyLog`` keeps
them, and ``record_own`` and ``lock_on`` return the record that must reach
``Ready.persist`` before the message that depends on it leaves. After a restart,
``restore`` reads those records back, so the instance re-sends what it signed and never
signs a second, different message for a round it already voted in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from protocol.caches import CoreCaches
from protocol.envelope import Envelope
from protocol.messages import CommitCertificate, Proposal, RoundChange, decode_message, value_hash
from protocol.ready import PersistRecord

# Newest signature first within a round: a proposal, then the prevote, then the precommit.
_KIND_ORDER = {"proposal": 0, "prevote": 1, "precommit": 2}


@dataclass(frozen=True)
class LockProof:
    """A value this node may re-propose or stay locked on, with what proves it (SPEC.md 6.6)."""
    round: int
    value_hash: bytes
    value: bytes
    justification: tuple
    certificate: bytes   # encoded PrevoteCertificate envelope for value_hash in ``round``
    proposal: bytes      # encoded Proposal envelope of ``round`` carrying ``value``
    value_kind: str = ""  # the proposal's kind ("": the instance's own value_kind)


@dataclass
class Restored:
    """What ``SafetyLog.restore`` read that the log itself does not keep."""
    round: int                                              # highest round voted or locked in
    certificate: tuple[CommitCertificate, bytes] | None     # the decision, with its envelope
    evidence: list[dict]                                    # evidence record values, in order


class SafetyLog:
    """One instance's own signed proposals and votes, and its lock, in one epoch."""

    def __init__(self, instance_id: bytes, epoch: int):
        self.instance_id = instance_id
        self.epoch = epoch
        self.own: dict[tuple[str, int], tuple[Envelope, bytes]] = {}  # (kind, round) -> signed envelope
        self.lock: LockProof | None = None

    def signed(self, kind: str, round: int) -> tuple[Envelope, bytes] | None:
        """What this node signed of ``kind`` in ``round``: (envelope, its bytes), or None."""
        return self.own.get((kind, round))

    @property
    def has_signed(self) -> bool:
        return bool(self.own)

    def latest_signature(self) -> bytes | None:
        """The newest signed proposal or vote (highest round, then the later phase), or None."""
        if not self.own:
            return None
        key = max(self.own, key=lambda k: (k[1], _KIND_ORDER.get(k[0], 0)))
        return self.own[key][1]

    def record_own(self, envelope: Envelope, round: int, data: bytes) -> PersistRecord:
        """Keep a proposal or vote this node just signed; returns the record to persist first."""
        self.own[(envelope.kind, round)] = (envelope, data)
        return self._vote_record(envelope.kind, round, data)

    def lock_on(self, lock: LockProof) -> PersistRecord:
        """Lock on ``lock``; returns the record to persist before the precommit it allows."""
        self.lock = lock
        return self._lock_record(lock)

    def round_change(self, round: int) -> RoundChange:
        """The RoundChange to ``round`` this node sends, reporting its lock (SPEC.md 6.5)."""
        lock = self.lock
        return RoundChange(self.instance_id, round, self.epoch, lock and lock.round, lock and lock.certificate,
                           lock and lock.proposal)

    def records(self) -> list[PersistRecord]:
        """Every own proposal and vote and the lock, as ``restore`` reads them: for the instance
        object that replaces this one when MeshCore drops and later re-creates it within one
        run, as after a restart."""
        records = [self._vote_record(kind, round_, data) for (kind, round_), (_, data) in self.own.items()]
        if self.lock is not None:
            records.append(self._lock_record(self.lock))
        return records

    def decision_record(self, cert: CommitCertificate, data: bytes) -> PersistRecord:
        """The record of the decision, ``data`` being the certificate's envelope bytes."""
        return PersistRecord("certificates", self.instance_id.hex(), {
            "instance": self.instance_id, "value_kind": cert.value_kind, "round": cert.round, "certificate": data})

    def _vote_record(self, kind: str, round: int, data: bytes) -> PersistRecord:
        key = "%s:%d:%d:%s" % (self.instance_id.hex(), self.epoch, round, kind)
        return PersistRecord("votes", key, {"instance": self.instance_id, "epoch": self.epoch, "round": round,
                                            "kind": kind, "envelope": data})

    def _lock_record(self, lock: LockProof) -> PersistRecord:
        # Keyed by epoch too: one instance id may run in two epochs (SPEC.md P2), and a lock
        # of one must not overwrite the other's on disk.
        return PersistRecord("locks", "%s:%d" % (self.instance_id.hex(), self.epoch), {
            "instance": self.instance_id, "epoch": self.epoch, "round": lock.round, "value_hash": lock.value_hash,
            "certificate": lock.certificate, "proposal": lock.proposal})

    def restore(self, records: Iterable[PersistRecord], mesh_id: bytes,
                caches: CoreCaches | None = None) -> Restored:
        """Reload own votes and the lock from persisted records; records of other instances
        (and of this instance id in other epochs) are ignored. Returns the rest they hold."""
        restored = Restored(0, None, [])
        for rec in records:
            value = rec.value
            if value.get("instance") != self.instance_id:
                continue
            if rec.table == "votes":
                envelope, message = decode_message(value["envelope"], mesh_id, caches=caches)
                if message.epoch != self.epoch:
                    continue  # the same instance id in another epoch is another vote count
                restored.round = max(restored.round, message.round)
                if isinstance(message, RoundChange):
                    continue  # no vote (an earlier version persisted epoch-move markers)
                self.own[(envelope.kind, message.round)] = (envelope, value["envelope"])
            elif rec.table == "locks":
                envelope, proposal = decode_message(value["proposal"], mesh_id, expect=Proposal, caches=caches)
                if proposal.epoch != self.epoch:
                    continue
                lock = LockProof(value["round"], value_hash(proposal.value, caches=caches), proposal.value,
                                 proposal.justification, value["certificate"], value["proposal"], proposal.value_kind)
                if self.lock is None or lock.round > self.lock.round:
                    self.lock = lock
                restored.round = max(restored.round, lock.round)
            elif rec.table == "certificates":
                envelope, cert = decode_message(value["certificate"], mesh_id, expect=CommitCertificate,
                                                caches=caches)
                restored.certificate = (cert, value["certificate"])
            elif rec.table == "evidence":
                restored.evidence.append(value)
        return restored
