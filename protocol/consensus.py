"""One single-decision BFT consensus instance (SPEC.md section 6).

Tendermint-style rounds with a collector: the round's leader broadcasts a Proposal,
every validator sends its Prevote to that leader only, the leader broadcasts the
quorum it gathered as a PrevoteCertificate, validators lock and send a Precommit to
the leader, and the leader broadcasts the quorum of precommits as a
CommitCertificate. That is five one-to-all or all-to-one steps, O(n) messages per
decision instead of Tendermint's O(n^2) all-to-all voting (SPEC.md 6.4).

The rules that keep this honest (each cited where it is enforced):
- a node signs at most one Proposal, Prevote and Precommit per round, and every vote
  or lock appears in ``Ready.persist`` before the message that depends on it
  (SPEC.md 6.9), so a restarted node restored from its records never double-votes;
- a locked node prevotes only its locked value, or a value carrying a prevote
  certificate from a round at or after its lock (SPEC.md 6.6);
- every input returns one ``Ready``; bad remote input is counted in ``dropped`` and
  never raises; calling ``propose`` when not ``awaiting_value`` raises
  LocalProtocolError; the instance never reads a clock.

``Decision.value`` is the raw value bytes; MeshCore decodes them with
``protocol.messages.decode_value``. Events: "awaiting_value", "proposed",
"proposal_rejected", "prevote_quorum", "locked", "decided", "round_change",
"evidence", "gave_up".
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from protocol.certificate import check_commit_certificate, check_prevote_certificate, decode_prevote_certificate
from protocol.caches import CoreCaches
from protocol.envelope import Envelope
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import (VALUE_KINDS, CommitCertificate, Evidence, Precommit, Prevote, PrevoteCertificate,
                               Proposal, RoundChange, RoundSync, decode_message, sign_message, value_hash)
from protocol.quorum import EpochView
from protocol.ready import Decision, Event, Outbound, PersistRecord, Ready

MAX_EVIDENCE = 256       # evidence kept per instance; more equivocation proves nothing new
MAX_CATCH_UP_REPLIES = 4096  # (sender, round) pairs answered with the decision (SPEC.md 6.8)
MAX_SYNC_REPLIES = 4096      # (sender, round) stale round changes answered with a RoundSync (6.5)
# How far beyond its own round a message may be (6.5). Bounds the work a far-future round
# makes a node do (the leader schedule of 6.2 is a chain over the rounds before it) and
# the round changes it keeps; honest nodes drift apart by a few rounds, not hundreds.
MAX_ROUNDS_AHEAD = 256
MAX_SYNC_ITEM_BYTES = 16 << 10  # a round change kept for a RoundSync (a lock makes it big)
MAX_FUTURE_PROPOSALS = 8        # proposals of later rounds held until this node gets there (6.5)

# validate(value, justification, proven) -> reason or None. ``proven``: the proposal carries
# a valid proof of lock, i.e. a prevote quorum accepted this value in an earlier round, so
# checks that depend on this node's local view of the moment (F5) may be skipped.
Validate = Callable[[bytes, tuple, bool], "str | None"]


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
class _RoundProposal:
    envelope: Envelope
    proposal: Proposal
    data: bytes
    value_hash: bytes
    valid: bool          # passed validate() and any POL check at this node


@dataclass
class _Tally:
    """A collector's votes of one kind in one round."""
    stake: dict = field(default_factory=dict)   # value hash (or None) -> stake
    votes: dict = field(default_factory=dict)   # value hash (or None) -> [vote envelope bytes]
    certified: bool = False


class ConsensusInstance:
    """Decides one value of ``value_kind`` for ``instance_id`` among ``view``'s members."""

    def __init__(self, *, instance_id: bytes, value_kind: str, view: EpochView, identity, mesh_id: bytes,
                 round_timeout_ms: int, round_timeout_max_ms: int, max_rounds: int, validate: Validate,
                 now_ms: int, other_kinds: dict[str, Validate] | None = None, caches: CoreCaches | None = None):
        # value kind -> its validity check. ``other_kinds``: an instance that may decide a value
        # of another kind too (SPEC.md F4: one instance per epoch decides its epoch change,
        # an eviction or a join); ``value_kind`` is what it proposes unless told otherwise.
        self.validators = {value_kind: validate, **(other_kinds or {})}
        if any(kind not in VALUE_KINDS for kind in self.validators):
            raise LocalProtocolError("unknown value kind in %r" % sorted(self.validators))
        if len(instance_id) != 32 or max_rounds < 1 or round_timeout_ms < 1 or round_timeout_max_ms < 1:
            raise LocalProtocolError("instance id must be 32 bytes; rounds and timeouts positive")
        self.instance_id = instance_id
        self.value_kind = value_kind
        self.caches = caches  # the core's memo tables (protocol/caches.py); None: remember nothing
        self.view = view
        self.identity = identity
        self.me = identity.public_key
        self.mesh_id = mesh_id
        self.round_timeout_ms = round_timeout_ms
        self.round_timeout_max_ms = round_timeout_max_ms
        self.max_rounds = max_rounds
        self.round = 0
        self.leader = view.leader(instance_id, 0)
        self.awaiting_value = False
        self.decision: CommitCertificate | None = None
        self.decided_value_bytes: bytes | None = None
        self.decision_envelope: bytes | None = None
        self.gave_up = False
        self.evidence: list[Evidence] = []
        self.dropped: Counter = Counter()
        self.messages_sent = 0   # Outbound entries emitted; a broadcast counts once
        # Another member sent a valid message here: whether it decides, or even reaches its
        # next round, may depend on this node's stake (an evicted node keeps it, SPEC F7).
        self.heard_from_others = False
        self._started = False
        self._round_started_ms = now_ms
        self._lock: LockProof | None = None
        self._own: dict[tuple[str, int], tuple[Envelope, bytes]] = {}   # (kind, round) -> own signed message
        self._proposal: _RoundProposal | None = None                    # current round's proposal
        self._polka: tuple[PrevoteCertificate, bytes] | None = None       # current round's non-nil certificate
        # (kind, epoch, round, signer) -> first; the epoch too, since one instance id may run in
        # two epochs (SPEC.md P2) and equivocation in either is evidence (6.10).
        self._first_seen: dict[tuple, tuple[Envelope, bytes | None]] = {}
        # Views of other epochs this node holds (MeshCore shares its own): messages of those
        # epochs are dropped, but checked for equivocation first.
        self.other_views: dict[int, EpochView] = {}
        self._tallies: dict[tuple[str, int], _Tally] = {}
        self._round_changes: dict[int, tuple[set, list, list]] = {}  # round -> (signers, [stake], [envelopes])
        self._round_sync: tuple[int, bytes] | None = None  # the newest RoundSync known: (round, envelope)
        self._future_proposals: dict[int, tuple] = {}  # round -> (envelope, Proposal, data), rounds ahead
        self._sync_replies: set[tuple[bytes, int]] = set()
        self._best_reported_lock: LockProof | None = None
        self._caught_up: set[tuple[bytes, int]] = set()
        self._evidenced: set[tuple] = set()
        self._handlers = {Proposal: self._on_proposal, Prevote: self._on_vote, Precommit: self._on_vote,
                          PrevoteCertificate: self._on_prevote_certificate,
                          CommitCertificate: self._on_commit_certificate, RoundChange: self._on_round_change,
                          RoundSync: self._on_round_sync}

    # --- state ---------------------------------------------------------------------------

    @property
    def locked_round(self) -> int | None:
        return None if self._lock is None else self._lock.round

    @property
    def locked_value(self) -> bytes | None:
        return None if self._lock is None else self._lock.value

    @property
    def lock(self) -> LockProof | None:
        return self._lock

    @property
    def has_signed(self) -> bool:
        """Whether this node signed a proposal or vote here: until then it is bound to nothing."""
        return bool(self._own)

    def latest_own_signature(self) -> bytes | None:
        """This node's newest signed proposal or vote here (what it persisted, 6.9), or None."""
        if not self._own:
            return None
        kind_order = {"proposal": 0, "prevote": 1, "precommit": 2}
        key = max(self._own, key=lambda k: (k[1], kind_order.get(k[0], 0)))
        return self._own[key][1]

    def timeout_ms(self, round: int) -> int:
        """SPEC.md 6.5: min(round_timeout_ms * 2**round, round_timeout_max_ms)."""
        return min(self.round_timeout_ms << min(round, 62), self.round_timeout_max_ms)

    @property
    def deadline_ms(self) -> int | None:
        """When ``tick`` next has work to do; None once decided or given up."""
        if self.decision is not None or self.gave_up:
            return None
        return self._round_started_ms + self.timeout_ms(self.round)

    # --- inputs ----------------------------------------------------------------------------

    def restore(self, records: Iterable[PersistRecord]) -> None:
        """Reload this instance's own votes, lock and decision from its persisted records.

        Call before ``start``. Records of other instances are ignored. The instance resumes
        in the highest round it voted in, re-sending (never re-signing) what it signed.
        """
        if self._started:
            raise LocalProtocolError("restore() must come before start()")
        for rec in records:
            value = rec.value
            if value.get("instance") != self.instance_id:
                continue
            if rec.table == "votes":
                envelope, message = decode_message(value["envelope"], self.mesh_id, caches=self.caches)
                if message.epoch != self.view.epoch:
                    continue  # the same instance id in another epoch is another vote count
                self.round = max(self.round, message.round)
                if isinstance(message, RoundChange):
                    continue  # no vote (an earlier version persisted epoch-move markers)
                self._own[(envelope.kind, message.round)] = (envelope, value["envelope"])
            elif rec.table == "locks":
                envelope, proposal = decode_message(value["proposal"], self.mesh_id, expect=Proposal, caches=self.caches)
                if proposal.epoch != self.view.epoch:
                    continue
                lock = LockProof(value["round"], value_hash(proposal.value, caches=self.caches), proposal.value,
                                 proposal.justification, value["certificate"], value["proposal"], proposal.value_kind)
                if self._lock is None or lock.round > self._lock.round:
                    self._lock = lock
                self.round = max(self.round, lock.round)
            elif rec.table == "certificates":
                envelope, cert = decode_message(value["certificate"], self.mesh_id, expect=CommitCertificate, caches=self.caches)
                self._set_decided(cert, value["certificate"])
            elif rec.table == "evidence" and len(self.evidence) < MAX_EVIDENCE:
                self.evidence.append(Evidence(value["offender"], value["first"], value["second"]))
        self.leader = self.view.leader(self.instance_id, self.round)

    def safety_records(self) -> list[PersistRecord]:
        """Its own proposals and votes and its lock, as ``restore`` reads them: for the
        instance object that replaces this one when MeshCore drops and later re-creates it
        within one run, as after a restart. A node never signs twice in one round (SPEC.md 6.9)."""
        epoch = self.view.epoch
        records = [PersistRecord("votes", "%s:%d:%d:%s" % (self.instance_id.hex(), epoch, round_, kind), {
            "instance": self.instance_id, "epoch": epoch, "round": round_, "kind": kind, "envelope": data})
            for (kind, round_), (_, data) in self._own.items()]
        lock = self._lock
        if lock is not None:
            records.append(PersistRecord("locks", "%s:%d" % (self.instance_id.hex(), epoch), {
                "instance": self.instance_id, "epoch": epoch, "round": lock.round, "value_hash": lock.value_hash,
                "certificate": lock.certificate, "proposal": lock.proposal}))
        return records

    def start(self, now_ms: int) -> Ready:
        """Start round ``self.round``'s timer; a leader proposes (or asks for a value)."""
        if self._started:
            raise LocalProtocolError("instance already started")
        self._started = True
        self._round_started_ms = now_ms
        ready = Ready()
        if self.decision is None and self.leader == self.me:
            own = self._own.get(("proposal", self.round))
            if own is not None:  # restarted after proposing: repeat it, never sign a second one
                ready.messages.append(Outbound(None, own[1]))
                self.messages_sent += 1
            else:
                self._try_propose(now_ms, ready)
        return ready

    def propose(self, value_bytes: bytes, justification: tuple[bytes, ...], now_ms: int,
                value_kind: str | None = None) -> Ready:
        """Propose ``value_bytes`` (of ``value_kind``, default the instance's) as this round's
        leader. Legal only while ``awaiting_value``."""
        if not self.awaiting_value:
            raise LocalProtocolError("propose() while not awaiting a value (round %d)" % self.round)
        kind = value_kind or self.value_kind
        if kind not in self.validators:
            raise LocalProtocolError("this instance decides no %r value" % kind)
        ready = Ready()
        self._send_proposal(value_bytes, tuple(justification), None, None, now_ms, ready, kind)
        return ready

    def receive(self, data: bytes, now_ms: int) -> Ready:
        """Decode and verify wire bytes, then handle them as ``on_message``. Bad bytes are counted."""
        try:
            envelope, message = decode_message(data, self.mesh_id, caches=self.caches)
        except RemoteProtocolError:
            self.dropped["undecodable"] += 1
            return Ready()
        return self.on_message(envelope, message, now_ms, data)

    def on_message(self, envelope: Envelope, message, now_ms: int, data: bytes | None = None) -> Ready:
        """Handle a signature-checked consensus message for this instance (SPEC.md 6.3-6.8).

        ``data``, the envelope's wire bytes, is optional and saves re-encoding certificates.
        """
        ready = Ready()
        handler = self._handlers.get(type(message))
        if handler is None:
            return self._drop("unexpected_kind", ready)
        if message.instance != self.instance_id:
            return self._drop("wrong_instance", ready)
        if message.epoch != self.view.epoch:
            self._check_other_epoch(envelope, message, data, now_ms, ready)
            return self._drop("wrong_epoch", ready)
        if envelope.signer not in self.view.stakes:
            return self._drop("non_member", ready)
        if envelope.signer != self.me:
            self.heard_from_others = True
        if message.round >= self.max_rounds or message.round > self.round + min(self.max_rounds, MAX_ROUNDS_AHEAD):
            return self._drop("round_too_far", ready)
        if self.decision is not None:
            if handler in (self._on_proposal, self._on_vote):
                # Deciding does not forgive: a conflicting proposal or vote that arrives
                # late is still equivocation, recorded as evidence (SPEC.md 6.10).
                self._is_repeat(type(message).KIND, message.round, envelope, data, now_ms, ready)
            self._answer_with_decision(envelope, message, ready)
            return ready
        if self.gave_up and handler != self._on_commit_certificate:
            return self._drop("gave_up", ready)
        handler(envelope, message, data, now_ms, ready)
        return ready

    def enter_round(self, round: int, now_ms: int) -> Ready:
        """Move forward to ``round`` as timeouts would, announcing it to its leader (SPEC.md 6.5).
        Always safe: entering a later round signs no vote."""
        ready = Ready()
        if self._started and self.decision is None and not self.gave_up and round > self.round:
            self._enter_round(round, now_ms, ready, "caught_up", announce=True)
        return ready

    def round_change(self) -> bytes:
        """A signed RoundChange for the current round carrying this node's lock: what it sent
        entering the round, for a peer found running this instance in another epoch."""
        lock = self._lock
        change = RoundChange(self.instance_id, self.round, self.view.epoch, lock and lock.round,
                             lock and lock.certificate, lock and lock.proposal)
        return sign_message(self.identity, self.mesh_id, change, caches=self.caches).encode()

    def tick(self, now_ms: int) -> Ready:
        """On round timeout move to the next round and tell its leader (SPEC.md 6.5)."""
        ready = Ready()
        deadline = self.deadline_ms
        if deadline is not None and now_ms >= deadline:
            self._enter_round(self.round + 1, now_ms, ready, "timeout", announce=True)
        return ready

    # --- rounds ----------------------------------------------------------------------------

    def _enter_round(self, round: int, now_ms: int, ready: Ready, reason: str, announce: bool) -> None:
        if round >= self.max_rounds:
            self.gave_up = True
            self.awaiting_value = False
            ready.events.append(Event("gave_up", now_ms, {"instance": self.instance_id.hex(), "rounds": round}))
            return
        self.round = round
        self.leader = self.view.leader(self.instance_id, round)
        self._round_started_ms = now_ms
        self.awaiting_value = False
        self._proposal = None
        self._polka = None
        # Collector state of finished rounds is useless: a round's votes count only in it.
        self._tallies = {k: t for k, t in self._tallies.items() if k[1] >= round}
        self._round_changes = {r: v for r, v in self._round_changes.items() if r >= round}
        ready.events.append(Event("round_change", now_ms, {
            "instance": self.instance_id.hex(), "round": round, "reason": reason, "leader": self.leader.hex()}))
        if announce:
            lock = self._lock
            change = RoundChange(self.instance_id, round, self.view.epoch, lock and lock.round,
                                 lock and lock.certificate, lock and lock.proposal)
            envelope = sign_message(self.identity, self.mesh_id, change, caches=self.caches)
            self._send_to(self.leader, envelope, change, envelope.encode(), now_ms, ready)
        if self.leader == self.me:
            self._try_propose(now_ms, ready)
        held = self._future_proposals
        if held:
            waiting = held.pop(round, None)
            self._future_proposals = {r: p for r, p in held.items() if r > round}
            if waiting is not None and self.decision is None:
                self._handle_proposal(*waiting, now_ms, ready)

    def _try_propose(self, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.5: after round 0 a leader waits for round changes from a quorum, then
        re-proposes the highest lock it has seen, or asks MeshCore for a fresh value."""
        if (self.leader != self.me or self.decision is not None or self.gave_up or self.awaiting_value
                or ("proposal", self.round) in self._own):
            return
        if self.round > 0:
            changes = self._round_changes.get(self.round)
            if changes is None or not self.view.is_quorum_stake(changes[1][0]):
                return
        best = self._lock
        reported = self._best_reported_lock
        if reported is not None and reported.round < self.round and (best is None or reported.round > best.round):
            best = reported
        if best is not None:
            self._send_proposal(best.value, best.justification, best.round, best.certificate, now_ms, ready,
                                best.value_kind or self.value_kind)
        else:
            self.awaiting_value = True
            ready.events.append(Event("awaiting_value", now_ms, {"instance": self.instance_id.hex(),
                                                                 "round": self.round}))

    def _send_proposal(self, value: bytes, justification: tuple, pol_round: int | None,
                       pol_certificate: bytes | None, now_ms: int, ready: Ready, value_kind: str) -> None:
        try:
            proposal = Proposal(self.instance_id, self.round, self.view.epoch, value_kind, value,
                                justification, pol_round, pol_certificate)
        except ValueError as exc:
            raise LocalProtocolError("cannot propose: %s" % exc) from None
        envelope = sign_message(self.identity, self.mesh_id, proposal, caches=self.caches)
        data = envelope.encode()
        self._record_own(envelope, proposal, data, ready)
        self.awaiting_value = False
        ready.events.append(Event("proposed", now_ms, {
            "instance": self.instance_id.hex(), "round": self.round, "value_hash": value_hash(value, caches=self.caches).hex(),
            "pol_round": pol_round}))
        self._broadcast(envelope, proposal, data, now_ms, ready)

    # --- message handlers (common checks done by on_message) --------------------------------

    def _on_proposal(self, envelope: Envelope, proposal: Proposal, data, now_ms: int, ready: Ready) -> None:
        if envelope.signer != self.view.leader(self.instance_id, proposal.round):
            return self._drop("not_leader", ready)
        if proposal.value_kind not in self.validators:
            return self._drop("wrong_value_kind", ready)
        if self._is_repeat("proposal", proposal.round, envelope, data, now_ms, ready):
            return
        if proposal.round < self.round:
            return self._drop("stale_round", ready)
        if proposal.round > self.round:
            # SPEC.md 6.5: a proposal is no evidence that anyone else is in its round (one
            # Byzantine leader of round 63 would make every node give up at once): it waits
            # until this node enters that round by its timeouts, a RoundSync or a certificate.
            self._hold_future_proposal(envelope, proposal, data)
            return self._drop("future_proposal", ready)
        self._handle_proposal(envelope, proposal, data, now_ms, ready)

    def _hold_future_proposal(self, envelope: Envelope, proposal: Proposal, data) -> None:
        held = self._future_proposals
        if proposal.round not in held and len(held) < MAX_FUTURE_PROPOSALS:
            held[proposal.round] = (envelope, proposal, data)

    def _handle_proposal(self, envelope: Envelope, proposal: Proposal, data, now_ms: int, ready: Ready) -> None:
        """A proposal of the current round from its leader, not seen before: validate, prevote."""
        hash_ = value_hash(proposal.value, caches=self.caches)
        pol_valid = False
        reason = None
        if proposal.pol_round is not None or proposal.pol_certificate is not None:
            reason = self._check_pol(proposal, hash_)
            pol_valid = reason is None
        if reason is None:
            reason = self.validators[proposal.value_kind](proposal.value, proposal.justification, pol_valid)
        data = data if data is not None else envelope.encode()
        self._proposal = _RoundProposal(envelope, proposal, data, hash_, reason is None)
        lock = self._lock
        # SPEC.md 6.6, the locking rule.
        if reason is None and not (lock is None or lock.value_hash == hash_
                                   or (pol_valid and lock.round <= proposal.pol_round)):
            reason = "locked on another value in round %d" % lock.round
        if reason is not None:
            ready.events.append(Event("proposal_rejected", now_ms, {
                "instance": self.instance_id.hex(), "round": self.round, "reason": reason}))
        self._send_vote(Prevote, hash_ if reason is None else None, now_ms, ready)
        self._try_lock(now_ms, ready)

    def _check_pol(self, proposal: Proposal, hash_: bytes) -> str | None:
        if proposal.pol_round is None or proposal.pol_certificate is None or proposal.pol_round >= proposal.round:
            return "proof of lock needs pol_round < round and a certificate"
        try:
            _, cert = decode_prevote_certificate(proposal.pol_certificate, self.mesh_id, self.view, caches=self.caches)
        except RemoteProtocolError as exc:
            return "bad proof of lock: %s" % exc
        if cert.instance != self.instance_id or cert.round != proposal.pol_round or cert.value_hash != hash_:
            return "proof of lock is for another instance, round or value"
        return None

    def _on_vote(self, envelope: Envelope, vote, data, now_ms: int, ready: Ready) -> None:
        kind = type(vote).KIND
        if self._is_repeat(kind, vote.round, envelope, data, now_ms, ready):
            return
        if self.view.leader(self.instance_id, vote.round) != self.me:
            return self._drop("not_collector", ready)
        if vote.round != self.round:
            return self._drop("stale_round" if vote.round < self.round else "future_round", ready)
        tally = self._tallies.setdefault((kind, vote.round), _Tally())
        hash_ = vote.value_hash
        stake = tally.stake.get(hash_, 0) + self.view.stakes[envelope.signer]
        tally.stake[hash_] = stake
        tally.votes.setdefault(hash_, []).append(data if data is not None else envelope.encode())
        if tally.certified or not self.view.is_quorum_stake(stake):
            return
        if kind == Prevote.KIND:  # SPEC.md 6.4: the collector certifies the first quorum it sees
            tally.certified = True
            cert = PrevoteCertificate(self.instance_id, vote.round, self.view.epoch, hash_, tuple(tally.votes[hash_]))
            ready.events.append(Event("prevote_quorum", now_ms, {
                "instance": self.instance_id.hex(), "round": vote.round,
                "value_hash": None if hash_ is None else hash_.hex()}))
        else:
            proposal = self._proposal
            if hash_ is None or proposal is None or proposal.value_hash != hash_:
                return  # honest nodes never precommit nil or a value this leader did not propose
            tally.certified = True
            cert = CommitCertificate(self.instance_id, vote.round, self.view.epoch, proposal.proposal.value_kind,
                                     proposal.proposal.value, tuple(tally.votes[hash_]))
        cert_envelope = sign_message(self.identity, self.mesh_id, cert, caches=self.caches)
        self._broadcast(cert_envelope, cert, cert_envelope.encode(), now_ms, ready)

    def _on_prevote_certificate(self, envelope: Envelope, cert: PrevoteCertificate, data, now_ms: int,
                                ready: Ready) -> None:
        if cert.round < self.round:
            return self._drop("stale_round", ready)
        try:
            check_prevote_certificate(envelope, cert, mesh_id=self.mesh_id, view=self.view, caches=self.caches)
        except RemoteProtocolError:
            return self._drop("bad_certificate", ready)
        if cert.value_hash is None:  # a quorum refused this round: no need to wait for its timeout
            self._enter_round(cert.round + 1, now_ms, ready, "nil_prevote_certificate", announce=True)
            return
        if cert.round > self.round:
            self._enter_round(cert.round, now_ms, ready, "prevote_certificate", announce=False)
            if self.gave_up:
                return
        if self._polka is not None:
            return
        self._polka = (cert, data if data is not None else envelope.encode())
        self._try_lock(now_ms, ready)

    def _try_lock(self, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.6: a valid proposal plus its round's prevote certificate -> lock, precommit."""
        proposal, polka = self._proposal, self._polka
        if proposal is None or polka is None or not proposal.valid or polka[0].value_hash != proposal.value_hash:
            return
        if self._lock is None or self._lock.round < self.round:
            lock = LockProof(self.round, proposal.value_hash, proposal.proposal.value,
                             proposal.proposal.justification, polka[1], proposal.data, proposal.proposal.value_kind)
            self._lock = lock
            # Keyed by epoch too: one instance id may run in two epochs (SPEC.md P2), and a
            # lock of one must not overwrite the other's on disk.
            ready.persist.append(PersistRecord("locks", "%s:%d" % (self.instance_id.hex(), self.view.epoch), {
                "instance": self.instance_id, "epoch": self.view.epoch, "round": lock.round,
                "value_hash": lock.value_hash,
                "certificate": lock.certificate, "proposal": lock.proposal}))
            ready.events.append(Event("locked", now_ms, {
                "instance": self.instance_id.hex(), "round": lock.round, "value_hash": lock.value_hash.hex()}))
        self._send_vote(Precommit, proposal.value_hash, now_ms, ready)

    def _on_commit_certificate(self, envelope: Envelope, cert: CommitCertificate, data, now_ms: int,
                               ready: Ready) -> None:
        if cert.value_kind not in self.validators:
            return self._drop("wrong_value_kind", ready)
        try:
            check_commit_certificate(envelope, cert, mesh_id=self.mesh_id, view=self.view, caches=self.caches)
        except RemoteProtocolError:
            return self._drop("bad_certificate", ready)
        data = data if data is not None else envelope.encode()
        self._set_decided(cert, data)
        ready.persist.append(PersistRecord("certificates", self.instance_id.hex(), {
            "instance": self.instance_id, "value_kind": cert.value_kind, "round": cert.round, "certificate": data}))
        ready.decisions.append(Decision(cert.value_kind, self.instance_id, cert.value, data))
        ready.events.append(Event("decided", now_ms, {
            "instance": self.instance_id.hex(), "round": cert.round, "value_hash": value_hash(cert.value, caches=self.caches).hex(),
            "value_kind": cert.value_kind}))

    def _set_decided(self, cert: CommitCertificate, data: bytes) -> None:
        self.decision = cert
        self.decided_value_bytes = cert.value
        self.decision_envelope = data
        self.awaiting_value = False
        self.gave_up = False
        # Nothing below can change a decided instance: free it (many instances live at once).
        # ``_first_seen`` stays: equivocation after the decision is still evidence, and it is
        # small (a non-collector sees one proposal per round; votes reach only the collector).
        self._tallies.clear()
        self._round_changes.clear()
        self._proposal = self._polka = None

    def _on_round_change(self, envelope: Envelope, change: RoundChange, data, now_ms: int, ready: Ready) -> None:
        # SPEC.md 6.5 rule 3: our round's leader has moved on, so our round will see no
        # proposal: end it now rather than at its timeout. One round at a time, so a
        # Byzantine leader can cut short only its own round, as its silence would.
        leader_moved_on = envelope.signer == self.leader and change.round > self.round
        if self.view.leader(self.instance_id, change.round) != self.me:
            if leader_moved_on:
                self._leader_moved_on(now_ms, ready)
                return
            return self._drop("not_collector", ready)
        if change.round < self.round or change.round == 0:
            self._reply_to_stale_round_change(envelope.signer, change.round, ready)
            return self._drop("stale_round", ready)
        lock = None
        if change.locked_round is not None or change.lock_certificate is not None or change.lock_proposal is not None:
            try:
                lock = self._check_reported_lock(change)
            except RemoteProtocolError:
                return self._drop("bad_lock", ready)
        signers, stake, changes = self._round_changes.setdefault(change.round, (set(), [0], []))
        if envelope.signer in signers:
            return self._drop("duplicate", ready)
        signers.add(envelope.signer)
        was_one_third = self.view.exceeds_one_third_stake(stake[0])
        stake[0] += self.view.stakes[envelope.signer]
        data = data if data is not None else envelope.encode()
        if len(data) <= MAX_SYNC_ITEM_BYTES:
            changes.append(data)
        best = self._best_reported_lock
        if lock is not None and (best is None or lock.round > best.round):
            self._best_reported_lock = lock
        if not was_one_third and self.view.exceeds_one_third_stake(stake[0]):
            self._send_round_sync(change.round, changes, now_ms, ready)
        if change.round > self.round:
            # SPEC.md 6.5: more than 1/3 of the stake has moved on, at least one honest node.
            if self.view.exceeds_one_third_stake(stake[0]):
                self._enter_round(change.round, now_ms, ready, "round_change_quorum", announce=True)
            elif leader_moved_on:
                self._leader_moved_on(now_ms, ready)
            return
        self._try_propose(now_ms, ready)

    def _leader_moved_on(self, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.5 rule 3: enter the next round now, but leave it when we would have had
        our round timed out: the leader (Byzantine, perhaps) chose whom it told, and the
        members it did not tell reach the next round only at their timeout; starting the
        round's timer now would leave us a round ahead of them when it ends."""
        due = self.deadline_ms
        self._enter_round(self.round + 1, now_ms, ready, "leader_moved_on", announce=True)
        if due is not None and due > now_ms and self.decision is None and not self.gave_up:
            self._round_started_ms = due

    def _send_round_sync(self, round: int, changes: list, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.5: round changes reach only the new round's leader, so members still in
        an earlier round (restarted, partitioned, or slower to time out) would never learn that
        others moved on, and the leader would never see the quorum it waits for. Once more than
        1/3 of the stake has moved to ``round``, the leader shows them the round changes,
        smallest first. Round changes too big to relay were not kept; if those kept hold 1/3 of
        the stake or less, or do not fit one frame, no sync is sent (timeouts remain)."""
        chosen, stake = [], 0
        for data in sorted(changes, key=len):  # only those small enough were kept
            if self.view.exceeds_one_third_stake(stake):
                break
            chosen.append(data)
            stake += self.view.stakes.get(self._signer_of(data), 0)
        try:
            if not self.view.exceeds_one_third_stake(stake):
                raise ValueError("the round changes small enough to relay hold 1/3 of the stake or less")
            envelope = sign_message(self.identity, self.mesh_id,
                                    RoundSync(self.instance_id, round, self.view.epoch, tuple(chosen)),
                                    caches=self.caches)
        except (ValueError, LocalProtocolError):  # 1/3 not reached, or over the frame cap
            self.dropped["round_sync_too_large"] += 1
            return
        data = envelope.encode()
        self._round_sync = (round, data)
        ready.messages.append(Outbound(None, data))
        self.messages_sent += 1

    def _signer_of(self, data: bytes) -> bytes:
        envelope, _ = decode_message(data, self.mesh_id, expect=RoundChange, caches=self.caches)
        return envelope.signer

    def _on_round_sync(self, envelope: Envelope, sync: RoundSync, data, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.5: round changes of ``sync.round`` from more than 1/3 of the stake (so at
        least one honest member) pull this node forward; entering a later round is always safe."""
        if sync.round <= self.round:
            return self._drop("stale_round", ready)
        signers, stake = set(), 0
        for item in sync.changes:
            try:
                change_envelope, change = decode_message(item, self.mesh_id, expect=RoundChange, caches=self.caches)
            except RemoteProtocolError:
                return self._drop("bad_round_sync", ready)
            signer = change_envelope.signer
            if ((change.instance, change.round, change.epoch) != (self.instance_id, sync.round, self.view.epoch)
                    or signer in signers or signer not in self.view.stakes):
                return self._drop("bad_round_sync", ready)
            signers.add(signer)
            stake += self.view.stakes[signer]
        if not self.view.exceeds_one_third_stake(stake):
            return self._drop("bad_round_sync", ready)
        self._round_sync = (sync.round, data if data is not None else envelope.encode())
        self._enter_round(sync.round, now_ms, ready, "round_sync", announce=True)

    def _reply_to_stale_round_change(self, to: bytes, round: int, ready: Ready) -> None:
        """SPEC.md 6.5: a member announced a round earlier than ours (to us, its leader there):
        it missed that others moved on. Send it the newest RoundSync we know, or else our own
        RoundChange for our round, which tells it its round's leader has moved on."""
        key = (to, round)
        if (self.round <= round or to == self.me or key in self._sync_replies
                or len(self._sync_replies) >= MAX_SYNC_REPLIES):
            return
        self._sync_replies.add(key)
        sync = self._round_sync
        ready.messages.append(Outbound(to, sync[1] if sync is not None and sync[0] > round else self.round_change()))
        self.messages_sent += 1

    def _check_reported_lock(self, change: RoundChange) -> LockProof:
        if change.locked_round is None or change.lock_certificate is None or change.lock_proposal is None:
            raise RemoteProtocolError("a reported lock needs its round, certificate and proposal")
        if change.locked_round >= change.round:
            raise RemoteProtocolError("a reported lock must be from an earlier round")
        _, cert = decode_prevote_certificate(change.lock_certificate, self.mesh_id, self.view, caches=self.caches)
        proposal_envelope, proposal = decode_message(change.lock_proposal, self.mesh_id, expect=Proposal, caches=self.caches)
        hash_ = value_hash(proposal.value, caches=self.caches)
        if (cert.instance != self.instance_id or cert.round != change.locked_round or cert.value_hash != hash_
                or proposal.instance != self.instance_id or proposal.round != change.locked_round
                or proposal.value_kind not in self.validators
                or proposal_envelope.signer != self.view.leader(self.instance_id, proposal.round)):
            raise RemoteProtocolError("reported lock's certificate and proposal do not match")
        return LockProof(change.locked_round, hash_, proposal.value, proposal.justification,
                         change.lock_certificate, change.lock_proposal, proposal.value_kind)

    # --- sending, evidence, drops ------------------------------------------------------------

    def _record_own(self, envelope: Envelope, message, data: bytes, ready: Ready) -> None:
        """SPEC.md 6.9: persist every proposal and vote before the message leaves."""
        self._own[(envelope.kind, message.round)] = (envelope, data)
        key = "%s:%d:%d:%s" % (self.instance_id.hex(), self.view.epoch, message.round, envelope.kind)
        ready.persist.append(PersistRecord("votes", key, {"instance": self.instance_id, "epoch": self.view.epoch,
                                                          "round": message.round, "kind": envelope.kind,
                                                          "envelope": data}))

    def _send_vote(self, vote_type: type, hash_: bytes | None, now_ms: int, ready: Ready) -> None:
        own = self._own.get((vote_type.KIND, self.round))
        if own is None:
            vote = vote_type(self.instance_id, self.round, self.view.epoch, hash_)
            envelope = sign_message(self.identity, self.mesh_id, vote, caches=self.caches)
            data = envelope.encode()
            self._record_own(envelope, vote, data, ready)
        else:  # restored: repeat exactly what was signed before the restart
            envelope, data = own
            vote = vote_type.from_body(envelope.body)
        self._send_to(self.leader, envelope, vote, data, now_ms, ready)

    def _send_to(self, to: bytes, envelope: Envelope, message, data: bytes, now_ms: int, ready: Ready) -> None:
        if to == self.me:
            self._handlers[type(message)](envelope, message, data, now_ms, ready)
        else:
            ready.messages.append(Outbound(to, data))
            self.messages_sent += 1

    def _broadcast(self, envelope: Envelope, message, data: bytes, now_ms: int, ready: Ready) -> None:
        ready.messages.append(Outbound(None, data))
        self.messages_sent += 1
        self._handlers[type(message)](envelope, message, data, now_ms, ready)

    def _answer_with_decision(self, envelope: Envelope, message, ready: Ready) -> None:
        """SPEC.md 6.8: a node still voting in a later round missed the decision; send it."""
        if isinstance(message, CommitCertificate) or message.round <= self.decision.round or envelope.signer == self.me:
            return
        key = (envelope.signer, message.round)
        if key in self._caught_up or len(self._caught_up) >= MAX_CATCH_UP_REPLIES:
            return
        self._caught_up.add(key)
        ready.messages.append(Outbound(envelope.signer, self.decision_envelope))
        self.messages_sent += 1

    def _check_other_epoch(self, envelope: Envelope, message, data, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.10: a proposal or vote of this instance in another epoch this node knows
        counts for nothing here (one instance id runs in one epoch, P2), but two conflicting
        ones from a member of that epoch are still equivocation."""
        view = self.other_views.get(message.epoch)
        if (view is not None and envelope.signer in view.stakes and message.round < self.max_rounds
                and isinstance(message, (Proposal, Prevote, Precommit))):
            self._is_repeat(type(message).KIND, message.round, envelope, data, now_ms, ready, epoch=message.epoch)

    def _is_repeat(self, kind: str, round: int, envelope: Envelope, data, now_ms: int, ready: Ready,
                   epoch: int | None = None) -> bool:
        """True if ``envelope`` repeats or contradicts what its signer already sent (SPEC.md 6.10)."""
        key = (kind, self.view.epoch if epoch is None else epoch, round, envelope.signer)
        first = self._first_seen.get(key)
        if first is None:
            self._first_seen[key] = (envelope, data)
            return False
        if first[0].signature == envelope.signature:
            self._drop("duplicate", ready)
            return True
        self._drop("equivocation", ready)
        # One piece of evidence per (kind, epoch, round, signer) is enough.
        if len(self.evidence) >= MAX_EVIDENCE or key in self._evidenced:
            return True
        self._evidenced.add(key)
        first_data = first[1] if first[1] is not None else first[0].encode()
        second_data = data if data is not None else envelope.encode()
        evidence = Evidence(envelope.signer, first_data, second_data)
        self.evidence.append(evidence)
        ready.persist.append(PersistRecord("evidence", hashlib.sha256(first_data + second_data).hexdigest(), {
            "instance": self.instance_id, "kind": kind, "round": round, **evidence.to_body()}))
        ready.events.append(Event("evidence", now_ms, {
            "instance": self.instance_id.hex(), "offender": envelope.signer.hex(), "kind": kind, "round": round}))
        return True

    def _drop(self, reason: str, ready: Ready) -> Ready:
        self.dropped[reason] += 1
        return ready
