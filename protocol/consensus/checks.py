"""Checks of what other members' messages carry (SPEC.md 6.3, 6.5, 6.6). Each is a
function of the message and of what the instance knows (its id, its epoch's view, its
lock, the value kinds it decides); none changes any state.

- a proposal: its proof of lock, its value's validity, and the locking rule (6.6);
- a round change's reported lock: the certificate and the proposal of the value its
  sender is locked on, which the next round's leader re-proposes (6.5, 6.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container

from protocol.caches import CoreCaches
from protocol.certificate import decode_prevote_certificate
from protocol.consensus.safety import LockProof
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.messages import Proposal, RoundChange, decode_message, value_hash
from protocol.quorum import EpochView


# validate(value, justification, proven) -> reason or None. ``proven``: the proposal carries
# a valid proof of lock, i.e. a prevote quorum accepted this value in an earlier round, so
# checks that depend on this node's local view of the moment (F5) may be skipped.
Validate = Callable[[bytes, tuple, bool], "str | None"]


@dataclass
class RoundProposal:
    """A proposal of the current round from its leader, as this node judged it."""
    envelope: Envelope
    proposal: Proposal
    data: bytes
    value_hash: bytes
    valid: bool          # passed validate() and any proof-of-lock check at this node


def judge_proposal(envelope: Envelope, proposal: Proposal, data: bytes, *, lock: LockProof | None,
                   validate: Validate, instance_id: bytes, view: EpochView, mesh_id: bytes,
                   caches: CoreCaches | None = None) -> tuple[RoundProposal, str | None]:
    """The proposal judged, and why this node prevotes nil on it (None: prevote its value).
    Valid: its proof of lock, if it has one, holds, and ``validate`` accepts the value. A
    valid value is still refused while locked on another one, unless the proof of lock is
    from the lock's round or later (6.6, the locking rule)."""
    hash_ = value_hash(proposal.value, caches=caches)
    pol_valid = False
    reason = None
    if proposal.pol_round is not None or proposal.pol_certificate is not None:
        reason = proof_of_lock_error(proposal, hash_, instance_id=instance_id, view=view, mesh_id=mesh_id,
                                     caches=caches)
        pol_valid = reason is None
    if reason is None:
        reason = validate(proposal.value, proposal.justification, pol_valid)
    judged = RoundProposal(envelope, proposal, data, hash_, reason is None)
    if reason is None and not (lock is None or lock.value_hash == hash_
                               or (pol_valid and lock.round <= proposal.pol_round)):
        reason = "locked on another value in round %d" % lock.round
    return judged, reason


def proof_of_lock_error(proposal: Proposal, hash_: bytes, *, instance_id: bytes, view: EpochView, mesh_id: bytes,
                        caches: CoreCaches | None = None) -> str | None:
    """Why ``proposal``'s proof of lock (pol_round, pol_certificate) does not hold for its
    value ``hash_``, or None if it does (SPEC.md 6.6)."""
    if proposal.pol_round is None or proposal.pol_certificate is None or proposal.pol_round >= proposal.round:
        return "proof of lock needs pol_round < round and a certificate"
    try:
        _, cert = decode_prevote_certificate(proposal.pol_certificate, mesh_id, view, caches=caches)
    except RemoteProtocolError as exc:
        return "bad proof of lock: %s" % exc
    if cert.instance != instance_id or cert.round != proposal.pol_round or cert.value_hash != hash_:
        return "proof of lock is for another instance, round or value"
    return None


def reported_lock(change: RoundChange, *, instance_id: bytes, view: EpochView, mesh_id: bytes,
                  value_kinds: Container[str], caches: CoreCaches | None = None) -> LockProof:
    """The lock a round change reports, checked: its prevote certificate and the proposal it
    certifies, both of this instance and of the locked round, the proposal signed by that
    round's leader and of a kind this instance decides. Raises RemoteProtocolError."""
    if change.locked_round is None or change.lock_certificate is None or change.lock_proposal is None:
        raise RemoteProtocolError("a reported lock needs its round, certificate and proposal")
    if change.locked_round >= change.round:
        raise RemoteProtocolError("a reported lock must be from an earlier round")
    _, cert = decode_prevote_certificate(change.lock_certificate, mesh_id, view, caches=caches)
    proposal_envelope, proposal = decode_message(change.lock_proposal, mesh_id, expect=Proposal, caches=caches)
    hash_ = value_hash(proposal.value, caches=caches)
    if (cert.instance != instance_id or cert.round != change.locked_round or cert.value_hash != hash_
            or proposal.instance != instance_id or proposal.round != change.locked_round
            or proposal.value_kind not in value_kinds
            or proposal_envelope.signer != view.leader(instance_id, proposal.round)):
        raise RemoteProtocolError("reported lock's certificate and proposal do not match")
    return LockProof(change.locked_round, hash_, proposal.value, proposal.justification,
                     change.lock_certificate, change.lock_proposal, proposal.value_kind)
