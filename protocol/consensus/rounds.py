"""What an instance keeps about rounds other than its current one (SPEC.md 6.5, 6.8):
how members move into a later round together when a round fails, and how members left
in other rounds catch up.

A member whose round times out (or whose leader moved on) sends a RoundChange, carrying
its lock, to the next round's leader only. That leader counts them by stake: a quorum
lets it propose, re-proposing the best lock reported (6.6). Members still in earlier
rounds (restarted, partitioned, slower to time out) would never learn that others moved
on, so once more than 1/3 of the stake has moved to its round the leader broadcasts the
round changes it holds as a RoundSync, and a member announcing a round already left
behind is answered with the newest RoundSync known. A proposal of a later round waits
until this node gets there; a member still voting in a later round after the decision
is sent the decision (6.8).

``OtherRounds`` keeps this per instance. Its inputs are the messages and the instance's
round; its outputs are stakes, locks, held proposals and the envelope bytes to send; it
never enters a round itself (the instance does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Container

from protocol.caches import CoreCaches
from protocol.consensus.checks import reported_lock
from protocol.consensus.safety import LockProof
from protocol.envelope import Envelope
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import Proposal, RoundChange, RoundSync, decode_message, sign_message
from protocol.quorum import EpochView

# How far beyond its own round a message may be. Bounds the work a far-future round makes
# a node do (the leader schedule of 6.2 is a chain over the rounds before it) and the
# round changes it keeps; honest nodes drift apart by a few rounds, not hundreds.
MAX_ROUNDS_AHEAD = 256
MAX_SYNC_REPLIES = 4096         # (sender, round) stale round changes answered with a RoundSync
MAX_SYNC_ITEM_BYTES = 16 << 10  # a round change kept for a RoundSync (a lock makes it big)
MAX_FUTURE_PROPOSALS = 8        # proposals of later rounds held until this node gets there
MAX_CATCH_UP_REPLIES = 4096     # (sender, round) pairs answered with the decision (6.8)


@dataclass
class _Announced:
    """The round changes announcing one round."""
    signers: set = field(default_factory=set)
    stake: int = 0
    relayable: list = field(default_factory=list)  # envelope bytes small enough for a RoundSync


class OtherRounds:
    """One instance's round changes received as a round's leader, its RoundSyncs, the
    proposals of later rounds it holds, and its replies to members in other rounds."""

    def __init__(self, *, instance_id: bytes, view: EpochView, identity, mesh_id: bytes,
                 value_kinds: Container[str], caches: CoreCaches | None = None):
        self.instance_id = instance_id
        self.view = view
        self.identity = identity
        self.mesh_id = mesh_id
        self.value_kinds = value_kinds
        self.caches = caches
        self._announced: dict[int, _Announced] = {}
        self.best_reported_lock: LockProof | None = None  # highest-round valid lock a round change reported
        self.latest_sync: tuple[int, bytes] | None = None  # the newest RoundSync known: (round, envelope)
        self._sync_replies: set[tuple[bytes, int]] = set()
        self._future_proposals: dict[int, tuple] = {}  # round -> (envelope, Proposal, data)
        self._caught_up: set[tuple[bytes, int]] = set()

    def add(self, envelope: Envelope, change: RoundChange, data: bytes) -> tuple[str | None, int, int]:
        """Count a round change sent to this node as the leader of ``change.round``. Returns
        (drop reason or None, stake that had announced the round before, stake now)."""
        lock = None
        if change.locked_round is not None or change.lock_certificate is not None or change.lock_proposal is not None:
            try:
                lock = reported_lock(change, instance_id=self.instance_id, view=self.view, mesh_id=self.mesh_id,
                                     value_kinds=self.value_kinds, caches=self.caches)
            except RemoteProtocolError:
                return "bad_lock", 0, 0
        announced = self._announced.setdefault(change.round, _Announced())
        if envelope.signer in announced.signers:
            return "duplicate", announced.stake, announced.stake
        announced.signers.add(envelope.signer)
        before = announced.stake
        announced.stake += self.view.stakes[envelope.signer]
        if len(data) <= MAX_SYNC_ITEM_BYTES:
            announced.relayable.append(data)
        best = self.best_reported_lock
        if lock is not None and (best is None or lock.round > best.round):
            self.best_reported_lock = lock
        return None, before, announced.stake

    def lock_to_repropose(self, own: LockProof | None, round: int) -> LockProof | None:
        """What the leader of ``round`` re-proposes: the highest lock, its own or one reported
        by a round change to ``round`` from an earlier round; None: a fresh value (6.5, 6.6)."""
        reported = self.best_reported_lock
        if reported is not None and reported.round < round and (own is None or reported.round > own.round):
            return reported
        return own

    def stake(self, round: int) -> int:
        """The stake whose round changes to ``round`` reached this node (0 if none)."""
        announced = self._announced.get(round)
        return 0 if announced is None else announced.stake

    def make_sync(self, round: int) -> bytes | None:
        """A signed RoundSync of the round changes to ``round``, smallest first, just enough to
        hold more than 1/3 of the stake; None if those small enough to relay hold 1/3 or less,
        or do not fit one frame."""
        announced = self._announced.get(round)
        chosen, stake = [], 0
        for data in sorted(announced.relayable if announced is not None else (), key=len):
            if self.view.exceeds_one_third_stake(stake):
                break
            chosen.append(data)
            envelope, _ = decode_message(data, self.mesh_id, expect=RoundChange, caches=self.caches)
            stake += self.view.stakes.get(envelope.signer, 0)
        if not self.view.exceeds_one_third_stake(stake):
            return None
        try:
            envelope = sign_message(self.identity, self.mesh_id,
                                    RoundSync(self.instance_id, round, self.view.epoch, tuple(chosen)),
                                    caches=self.caches)
        except (ValueError, LocalProtocolError):  # over the frame cap
            return None
        data = envelope.encode()
        self.latest_sync = (round, data)
        return data

    def accept_sync(self, sync: RoundSync, data: bytes) -> bool:
        """Whether ``sync`` carries round changes of this instance, its round and epoch from
        distinct members holding more than 1/3 of the stake (so at least one honest member);
        if so it is the newest RoundSync known."""
        signers, stake = set(), 0
        for item in sync.changes:
            try:
                change_envelope, change = decode_message(item, self.mesh_id, expect=RoundChange, caches=self.caches)
            except RemoteProtocolError:
                return False
            signer = change_envelope.signer
            if ((change.instance, change.round, change.epoch) != (self.instance_id, sync.round, self.view.epoch)
                    or signer in signers or signer not in self.view.stakes):
                return False
            signers.add(signer)
            stake += self.view.stakes[signer]
        if not self.view.exceeds_one_third_stake(stake):
            return False
        self.latest_sync = (sync.round, data)
        return True

    def reply_to_stale(self, to: bytes, round: int, my_round: int, me: bytes,
                       own_round_change: Callable[[], bytes]) -> bytes | None:
        """What to answer a member that announced ``round``, earlier than ``my_round``, to this
        node as its leader there: it missed that others moved on. The newest RoundSync known,
        or else this node's own RoundChange for its round (which tells it its round's leader
        has moved on); None once answered, or for this node itself."""
        key = (to, round)
        if my_round <= round or to == me or key in self._sync_replies or len(self._sync_replies) >= MAX_SYNC_REPLIES:
            return None
        self._sync_replies.add(key)
        sync = self.latest_sync
        return sync[1] if sync is not None and sync[0] > round else own_round_change()

    def hold_proposal(self, envelope: Envelope, proposal: Proposal, data: bytes | None) -> None:
        """A proposal of a later round is no evidence that anyone else is in that round (one
        Byzantine leader of round 63 would make every node give up at once): it waits until
        this node enters that round by its timeouts, a RoundSync or a certificate."""
        held = self._future_proposals
        if proposal.round not in held and len(held) < MAX_FUTURE_PROPOSALS:
            held[proposal.round] = (envelope, proposal, data)

    def take_proposal(self, round: int) -> tuple | None:
        """Entering ``round``: its held proposal (envelope, Proposal, data), if any; proposals
        of earlier rounds are dropped."""
        held = self._future_proposals
        if not held:
            return None
        waiting = held.pop(round, None)
        self._future_proposals = {r: p for r, p in held.items() if r > round}
        return waiting

    def answer_decided(self, to: bytes, round: int, me: bytes) -> bool:
        """Whether to send the decision to ``to``, still voting in ``round`` (later than the
        decision's): once per (member, round), and not to this node itself (6.8)."""
        key = (to, round)
        if to == me or key in self._caught_up or len(self._caught_up) >= MAX_CATCH_UP_REPLIES:
            return False
        self._caught_up.add(key)
        return True

    def prune(self, round: int) -> None:
        """Forget round changes to rounds before ``round``."""
        self._announced = {r: a for r, a in self._announced.items() if r >= round}

    def clear(self) -> None:
        self._announced.clear()
