"""Prevote and commit certificates: checking that a quorum of stake signed one vote (SPEC.md 6.7).

A certificate is the collector's signed envelope carrying the exact vote envelopes
the voters signed, so anyone holding the epoch's membership can re-check it offline:
every vote's signature, instance, round, epoch and value hash, distinct member
signers, and more than 2/3 of the stake. The collector's own signature adds nothing
to the proof; it only names who assembled it.

Given a core's ``caches``, verdicts are remembered in ``caches.certificate_verdicts``,
keyed by the certificate envelope's (signer, signature) and the membership digest: a
node that re-receives the certificate every other member also received checks its votes
once. Keying on the signature is sound because the caller has verified the envelope,
and an Ed25519 signature binds its signed bytes.
"""

from __future__ import annotations

from protocol.caches import CoreCaches
from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.messages import (CommitCertificate, Precommit, Prevote, PrevoteCertificate, decode_message,
                               decode_value, value_hash)
from protocol.quorum import EpochView

def check_votes(votes: tuple, vote_type: type, *, mesh_id: bytes, view: EpochView, instance: bytes,
                round: int, expected_hash: bytes | None, caches: CoreCaches | None = None) -> int:
    """Check a certificate's vote envelopes; return their total stake. RemoteProtocolError otherwise.

    Each vote must be a validly signed ``vote_type`` for exactly (instance, round, view.epoch,
    expected_hash), from a distinct member; the total must be a quorum.
    """
    seen: set[bytes] = set()
    stake = 0
    for index, data in enumerate(votes):
        envelope, vote = decode_message(data, mesh_id, expect=vote_type, caches=caches)
        if (vote.instance != instance or vote.round != round or vote.epoch != view.epoch
                or vote.value_hash != expected_hash):
            raise RemoteProtocolError("certificate vote %d is for another instance, round, epoch or value" % index)
        signer = envelope.signer
        if signer in seen:
            raise RemoteProtocolError("certificate vote %d repeats a signer" % index)
        member_stake = view.stakes.get(signer)
        if member_stake is None:
            raise RemoteProtocolError("certificate vote %d is signed by a non-member" % index)
        seen.add(signer)
        stake += member_stake
    if not view.is_quorum_stake(stake):
        raise RemoteProtocolError("certificate holds %d of %d stake, not more than 2/3" % (stake, view.total_stake))
    return stake


def check_prevote_certificate(envelope: Envelope, cert: PrevoteCertificate, *, mesh_id: bytes,
                              view: EpochView, caches: CoreCaches | None = None) -> None:
    """Check a verified PrevoteCertificate envelope's contents (quorum of matching prevotes)."""
    _check_certificate_votes(envelope, cert, cert.prevotes, Prevote, cert.value_hash, mesh_id=mesh_id, view=view,
                             caches=caches)


def check_commit_certificate(envelope: Envelope, cert: CommitCertificate, *, mesh_id: bytes,
                             view: EpochView, caches: CoreCaches | None = None) -> None:
    """Check a verified CommitCertificate envelope's contents (quorum of precommits for its value)."""
    _check_certificate_votes(envelope, cert, cert.precommits, Precommit, value_hash(cert.value, caches=caches),
                             mesh_id=mesh_id, view=view, caches=caches)


def _check_certificate_votes(envelope: Envelope, cert, votes, vote_type, expected_hash: bytes | None, *,
                             mesh_id: bytes, view: EpochView, caches: CoreCaches | None) -> None:
    """The epoch, then the votes, once per (view, certificate signature) when ``caches`` is
    given: a certificate is re-broadcast to everyone, and its quorum check is the costly part."""
    kind = "prevote" if vote_type is Prevote else "commit"
    if cert.epoch != view.epoch:
        raise RemoteProtocolError("%s certificate for epoch %d, view is %d" % (kind, cert.epoch, view.epoch))
    table = caches.certificate_verdicts if caches is not None else None
    if table is not None:
        key = (view.digest, mesh_id, envelope.signer, envelope.signature)
        if key in table:
            table.move_to_end(key)
            return
    check_votes(votes, vote_type, mesh_id=mesh_id, view=view, instance=cert.instance,
                round=cert.round, expected_hash=expected_hash, caches=caches)
    if table is not None:
        table.remember(key, True)


def decode_prevote_certificate(data: bytes, mesh_id: bytes, view: EpochView, *,
                               caches: CoreCaches | None = None) -> tuple[Envelope, PrevoteCertificate]:
    """Open, verify and check encoded PrevoteCertificate envelope bytes."""
    envelope, cert = decode_message(data, mesh_id, expect=PrevoteCertificate, caches=caches)
    check_prevote_certificate(envelope, cert, mesh_id=mesh_id, view=view, caches=caches)
    return envelope, cert


def verify_commit_certificate(data: bytes, mesh_id: bytes, view: EpochView, *,
                              caches: CoreCaches | None = None) -> tuple[CommitCertificate, bytes]:
    """Offline check of an encoded CommitCertificate envelope against ``view`` (SPEC.md 6.7).

    Returns (certificate, value bytes). Raises RemoteProtocolError naming the first fault.
    """
    envelope, cert = decode_message(data, mesh_id, expect=CommitCertificate, caches=caches)
    check_commit_certificate(envelope, cert, mesh_id=mesh_id, view=view, caches=caches)
    return cert, cert.value


def next_epoch_view(view: EpochView, value_kind: str, value) -> EpochView | None:
    """The view a decided epoch change of ``view``'s epoch creates (SPEC.md F5, F7), or None
    if ``value`` is no change of that epoch: an eviction removes its node, a join adds its
    member with the stake the membership instance decided."""
    stakes = dict(view.stakes)
    if value_kind == "eviction" and value.epoch == view.epoch and value.node in stakes:
        del stakes[value.node]
        return EpochView(view.epoch + 1, stakes)
    if value_kind == "membership" and value.epoch == view.epoch + 1 and value.change == "join":
        stakes[value.member.public_key] = value.member.stake
        return EpochView(value.epoch, stakes)
    return None


def epoch_views_from_history(genesis_view: EpochView, mesh_id: bytes, certificates, *,
                             caches: CoreCaches | None = None) -> dict[int, EpochView]:
    """Every epoch's view, rebuilt offline from the genesis view and the epoch changes' commit
    certificates (any order; certificates of other kinds, or of epochs the history does not
    reach, are ignored). Each change is verified against the view of the epoch it decided in.
    Raises RemoteProtocolError for an epoch-change certificate that does not verify."""
    changes: dict[int, list] = {}
    for data in certificates:
        _envelope, cert = decode_message(data, mesh_id, expect=CommitCertificate, caches=caches)
        if cert.value_kind in ("eviction", "membership"):
            changes.setdefault(cert.epoch, []).append((data, cert))
    views = {genesis_view.epoch: genesis_view}
    view = genesis_view
    while view.epoch in changes:
        following, problem = None, None
        for data, cert in changes.pop(view.epoch):  # the first of the epoch's that holds
            try:
                verify_commit_certificate(data, mesh_id, view, caches=caches)
            except RemoteProtocolError as exc:
                problem = exc
                continue
            following = next_epoch_view(view, cert.value_kind, decode_value(cert.value_kind, cert.value,
                                                                            caches=caches))
            if following is not None:
                break
            problem = RemoteProtocolError("the epoch %d change certificate decides no change of that epoch"
                                          % view.epoch)
        if following is None:
            raise problem
        views[following.epoch] = view = following
    return views
