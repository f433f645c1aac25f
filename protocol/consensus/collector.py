"""The votes a node collects as the leader ("collector") of a round (SPEC.md 6.4).

Votes go to the round's leader only: it counts the prevotes and precommits of its round
by value and, at the first quorum, the instance broadcasts them as a certificate: O(n)
messages per decision instead of all-to-all voting. A ``Collector`` keeps the counts
per (kind, round) for the rounds not yet over and builds the certificates; it signs and
sends nothing itself. In an epoch of at most 4 members every member collects (SPEC.md
6.11): votes go to everyone, and each builds the certificates from what it counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.messages import CommitCertificate, Precommit, Prevote, PrevoteCertificate, Proposal
from protocol.quorum import EpochView


@dataclass
class _Tally:
    """A collector's votes of one kind in one round."""
    stake: dict = field(default_factory=dict)   # value hash (or None) -> stake
    votes: dict = field(default_factory=dict)   # value hash (or None) -> [vote envelope bytes]
    certified: bool = False


class Collector:
    """Votes sent to this node as a round's leader (or as any member, 6.11), per (kind, round)."""

    def __init__(self, instance_id: bytes, view: EpochView):
        self.instance_id = instance_id
        self.view = view
        self._tallies: dict[tuple[str, int], _Tally] = {}

    def add(self, vote: Prevote | Precommit, signer: bytes, data: bytes,
            proposed: tuple[bytes, Proposal] | None) -> PrevoteCertificate | CommitCertificate | None:
        """Count a member's vote (the caller drops repeats and other rounds' votes). Returns the
        certificate of the first quorum for one value hash: any prevote quorum, nil included;
        a precommit quorum only for ``proposed``, this round's (value hash, proposal), since
        honest nodes never precommit nil or a value this leader did not propose."""
        kind = type(vote).KIND
        tally = self._tallies.setdefault((kind, vote.round), _Tally())
        hash_ = vote.value_hash
        stake = tally.stake.get(hash_, 0) + self.view.stakes[signer]
        tally.stake[hash_] = stake
        tally.votes.setdefault(hash_, []).append(data)
        if tally.certified or not self.view.is_quorum_stake(stake):
            return None
        if kind == Prevote.KIND:
            tally.certified = True
            return PrevoteCertificate(self.instance_id, vote.round, self.view.epoch, hash_, tuple(tally.votes[hash_]))
        if hash_ is None or proposed is None or proposed[0] != hash_:
            return None
        tally.certified = True
        proposal = proposed[1]
        return CommitCertificate(self.instance_id, vote.round, self.view.epoch, proposal.value_kind, proposal.value,
                                 tuple(tally.votes[hash_]))

    def prune(self, round: int) -> None:
        """Forget rounds before ``round``: a round's votes count only in it."""
        self._tallies = {k: t for k, t in self._tallies.items() if k[1] >= round}

    def clear(self) -> None:
        """Decided: nothing collected can change the instance any more."""
        self._tallies.clear()
