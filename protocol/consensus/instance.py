"""The consensus instance state machine (SPEC.md section 6); ``__init__.py`` gives the
protocol in brief and the rules that keep it honest. It delegates, with explicit inputs:
own signatures and lock to ``SafetyLog`` (6.9), votes to ``Collector`` (6.4), other
rounds to ``OtherRounds`` (6.5, 6.8), evidence to ``Equivocations`` (6.10), and the
judging of proposals and reported locks to ``checks`` (6.6).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from protocol.caches import CoreCaches
from protocol.certificate import check_commit_certificate, check_prevote_certificate
from protocol.consensus.checks import RoundProposal, Validate, judge_proposal
from protocol.consensus.collector import Collector
from protocol.consensus.evidence import Equivocations
from protocol.consensus.rounds import MAX_ROUNDS_AHEAD, OtherRounds
from protocol.consensus.safety import LockProof, SafetyLog
from protocol.envelope import Envelope
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import (VALUE_KINDS, CommitCertificate, Evidence, Precommit, Prevote, PrevoteCertificate,
                               Proposal, RoundChange, RoundSync, decode_message, sign_message, value_hash)
from protocol.quorum import EpochView
from protocol.ready import Decision, Event, Outbound, PersistRecord, Ready


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
        self.view = view
        self.identity = identity
        self.me = identity.public_key
        self.mesh_id = mesh_id
        self.caches = caches  # the core's memo tables (protocol/caches.py); None: remember nothing
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
        self.dropped: Counter = Counter()  # MeshCore replaces it with the node's one Counter
        self.messages_sent = 0   # Outbound entries emitted; a broadcast counts once
        # Another member sent a valid message here: whether it decides, or even reaches its
        # next round, may depend on this node's stake (an evicted node keeps it, SPEC F7).
        self.heard_from_others = False
        # Views of other epochs this node holds (MeshCore shares its own): messages of those
        # epochs are dropped, but checked for equivocation first.
        self.other_views: dict[int, EpochView] = {}
        self._started = False
        self._round_started_ms = now_ms
        self._safety = SafetyLog(instance_id, view.epoch)
        self._collector = Collector(instance_id, view)
        self._other_rounds = OtherRounds(instance_id=instance_id, view=view, identity=identity, mesh_id=mesh_id,
                                         value_kinds=self.validators, caches=caches)
        self._equivocations = Equivocations(instance_id)
        self.evidence: list[Evidence] = self._equivocations.evidence  # oldest first (SPEC.md 6.10)
        self._proposal: RoundProposal | None = None                     # current round's proposal
        self._polka: tuple[PrevoteCertificate, bytes] | None = None     # current round's non-nil certificate
        self._handlers = {Proposal: self._on_proposal, Prevote: self._on_vote, Precommit: self._on_vote,
                          PrevoteCertificate: self._on_prevote_certificate,
                          CommitCertificate: self._on_commit_certificate, RoundChange: self._on_round_change,
                          RoundSync: self._on_round_sync}

    # --- state ---------------------------------------------------------------------------

    @property
    def lock(self) -> LockProof | None:
        return self._safety.lock

    @property
    def locked_round(self) -> int | None:
        return None if self._safety.lock is None else self._safety.lock.round

    @property
    def locked_value(self) -> bytes | None:
        return None if self._safety.lock is None else self._safety.lock.value

    @property
    def has_signed(self) -> bool:
        """Whether this node signed a proposal or vote here: until then it is bound to nothing."""
        return self._safety.has_signed

    def latest_own_signature(self) -> bytes | None:
        """This node's newest signed proposal or vote here (what it persisted, 6.9), or None."""
        return self._safety.latest_signature()

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
        """Reload this instance's own votes, lock and decision from its persisted records, before
        ``start`` (other instances' records are ignored). The instance resumes in the highest
        round it voted in, re-sending (never re-signing) what it signed."""
        if self._started:
            raise LocalProtocolError("restore() must come before start()")
        restored = self._safety.restore(records, self.mesh_id, self.caches)
        self.round = max(self.round, restored.round)
        if restored.certificate is not None:
            self._set_decided(*restored.certificate)
        self._equivocations.restore(restored.evidence)
        self.leader = self.view.leader(self.instance_id, self.round)

    def safety_records(self) -> list[PersistRecord]:
        """Its own proposals and votes and its lock, as ``restore`` reads them, for an instance
        object that replaces this one within a run (SPEC.md 6.9; ``SafetyLog.records``)."""
        return self._safety.records()

    def start(self, now_ms: int) -> Ready:
        """Start round ``self.round``'s timer; a leader proposes (or asks for a value)."""
        if self._started:
            raise LocalProtocolError("instance already started")
        self._started = True
        self._round_started_ms = now_ms
        ready = Ready()
        if self.decision is None and self.leader == self.me:
            own = self._safety.signed("proposal", self.round)
            if own is not None:  # restarted after proposing: repeat it, never sign a second one
                self._send(None, own[1], ready)
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
            # SPEC.md 6.10: a proposal or vote of this instance in another epoch this node knows
            # counts for nothing here (one instance id runs in one epoch, P2), but two
            # conflicting ones from a member of that epoch are still equivocation.
            view = self.other_views.get(message.epoch)
            if (view is not None and envelope.signer in view.stakes and message.round < self.max_rounds
                    and handler in (self._on_proposal, self._on_vote)):
                self._is_repeat(type(message).KIND, message.round, envelope, data, now_ms, ready, message.epoch)
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
        return sign_message(self.identity, self.mesh_id, self._safety.round_change(self.round),
                            caches=self.caches).encode()

    def hold_round(self, now_ms: int, recheck_ms: int) -> None:
        """Stay in the current round (its flow has nothing for it to decide yet): its timeout
        next expires ``recheck_ms`` from now, or its full timeout if shorter, when the flow is
        asked again. Entering no round signs nothing, so holding one is always safe."""
        self._round_started_ms = now_ms + min(recheck_ms, self.timeout_ms(self.round)) - self.timeout_ms(self.round)

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
        self._collector.prune(round)
        self._other_rounds.prune(round)
        ready.events.append(Event("round_change", now_ms, {
            "instance": self.instance_id.hex(), "round": round, "reason": reason, "leader": self.leader.hex()}))
        if announce:
            change = self._safety.round_change(round)
            envelope = sign_message(self.identity, self.mesh_id, change, caches=self.caches)
            self._send_to(self.leader, envelope, change, envelope.encode(), now_ms, ready)
        if self.leader == self.me:
            self._try_propose(now_ms, ready)
        waiting = self._other_rounds.take_proposal(round)
        if waiting is not None and self.decision is None:
            self._handle_proposal(*waiting, now_ms, ready)

    def _try_propose(self, now_ms: int, ready: Ready) -> None:
        """SPEC.md 6.5: after round 0 a leader waits for round changes from a quorum, then
        re-proposes the highest lock it has seen, or asks MeshCore for a fresh value."""
        if (self.leader != self.me or self.decision is not None or self.gave_up or self.awaiting_value
                or self._safety.signed("proposal", self.round) is not None):
            return
        if self.round > 0 and not self.view.is_quorum_stake(self._other_rounds.stake(self.round)):
            return
        best = self._other_rounds.lock_to_repropose(self._safety.lock, self.round)
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
        ready.persist.append(self._safety.record_own(envelope, proposal.round, data))  # 6.9: before sending
        self.awaiting_value = False
        ready.events.append(Event("proposed", now_ms, {
            "instance": self.instance_id.hex(), "round": self.round,
            "value_hash": value_hash(value, caches=self.caches).hex(), "pol_round": pol_round}))
        self._broadcast(envelope, proposal, data, now_ms, ready)

    # --- proposals and votes (common checks done by on_message) ------------------------------

    def _on_proposal(self, envelope: Envelope, proposal: Proposal, data, now_ms: int, ready: Ready) -> None:
        if envelope.signer != self.view.leader(self.instance_id, proposal.round):
            return self._drop("not_leader", ready)
        if proposal.value_kind not in self.validators:
            return self._drop("wrong_value_kind", ready)
        if self._is_repeat("proposal", proposal.round, envelope, data, now_ms, ready):
            return
        if proposal.round < self.round:
            return self._drop("stale_round", ready)
        if proposal.round > self.round:  # SPEC.md 6.5: held until this node gets there
            self._other_rounds.hold_proposal(envelope, proposal, data)
            return self._drop("future_proposal", ready)
        self._handle_proposal(envelope, proposal, data, now_ms, ready)

    def _handle_proposal(self, envelope: Envelope, proposal: Proposal, data, now_ms: int, ready: Ready) -> None:
        """A proposal of the current round from its leader, not seen before: validate, prevote."""
        self._proposal, reason = judge_proposal(envelope, proposal, data if data is not None else envelope.encode(),
                                                lock=self._safety.lock, validate=self.validators[proposal.value_kind],
                                                instance_id=self.instance_id, view=self.view, mesh_id=self.mesh_id,
                                                caches=self.caches)
        hash_ = self._proposal.value_hash
        if reason is not None:
            ready.events.append(Event("proposal_rejected", now_ms, {
                "instance": self.instance_id.hex(), "round": self.round, "reason": reason}))
        self._send_vote(Prevote, hash_ if reason is None else None, now_ms, ready)
        self._try_lock(now_ms, ready)

    def _on_vote(self, envelope: Envelope, vote, data, now_ms: int, ready: Ready) -> None:
        kind = type(vote).KIND
        if self._is_repeat(kind, vote.round, envelope, data, now_ms, ready):
            return
        leads_round = self.view.leader(self.instance_id, vote.round) == self.me
        if not leads_round and not self.view.votes_to_every_member:
            return self._drop("not_collector", ready)
        if vote.round != self.round:
            return self._drop("stale_round" if vote.round < self.round else "future_round", ready)
        proposal = self._proposal
        cert = self._collector.add(vote, envelope.signer, data if data is not None else envelope.encode(),
                                   None if proposal is None else (proposal.value_hash, proposal.proposal))
        if cert is None:
            return
        if kind == Prevote.KIND:  # SPEC.md 6.4: the collector certifies the first quorum it sees
            ready.events.append(Event("prevote_quorum", now_ms, {
                "instance": self.instance_id.hex(), "round": vote.round,
                "value_hash": None if cert.value_hash is None else cert.value_hash.hex()}))
        cert_envelope = sign_message(self.identity, self.mesh_id, cert, caches=self.caches)
        cert_data = cert_envelope.encode()
        if not self.view.votes_to_every_member:
            self._broadcast(cert_envelope, cert, cert_data, now_ms, ready)
            return
        # SPEC.md 6.11: every member counted these votes itself, so it acts on the certificate
        # at once, as if the leader had sent it. The leader still broadcasts its commit and nil
        # prevote certificates, for members that missed votes, but after what it signs on them:
        # its precommit is on the critical path. Not a non-nil prevote certificate (6.13): every
        # member that could use it decides from the precommits or from the commit certificate.
        self._handlers[type(cert)](cert_envelope, cert, cert_data, now_ms, ready)
        if leads_round and not (kind == Prevote.KIND and cert.value_hash is not None):
            self._send(None, cert_data, ready)

    def _send_vote(self, vote_type: type, hash_: bytes | None, now_ms: int, ready: Ready) -> None:
        own = self._safety.signed(vote_type.KIND, self.round)
        if own is None:
            vote = vote_type(self.instance_id, self.round, self.view.epoch, hash_)
            envelope = sign_message(self.identity, self.mesh_id, vote, caches=self.caches)
            data = envelope.encode()
            ready.persist.append(self._safety.record_own(envelope, vote.round, data))  # 6.9: before sending
        else:  # restored: repeat exactly what was signed before the restart
            envelope, data = own
            vote = vote_type.from_body(envelope.body)
        if self.view.votes_to_every_member:  # SPEC.md 6.11
            self._broadcast(envelope, vote, data, now_ms, ready)
        else:
            self._send_to(self.leader, envelope, vote, data, now_ms, ready)

    # --- certificates ------------------------------------------------------------------------

    def _on_prevote_certificate(self, envelope: Envelope, cert: PrevoteCertificate, data, now_ms: int,
                                ready: Ready) -> None:
        if cert.round < self.round:
            return self._drop("stale_round", ready)
        if cert.round == self.round and self._polka is not None and cert.value_hash is not None:
            # Formed here from the votes (6.11), or a second copy: nothing left to learn from it.
            return self._drop("certificate_held", ready)
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
        if self._safety.lock is None or self._safety.lock.round < self.round:
            lock = LockProof(self.round, proposal.value_hash, proposal.proposal.value,
                             proposal.proposal.justification, polka[1], proposal.data, proposal.proposal.value_kind)
            ready.persist.append(self._safety.lock_on(lock))  # 6.9: before the precommit
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
        ready.persist.append(self._safety.decision_record(cert, data))
        ready.decisions.append(Decision(cert.value_kind, self.instance_id, cert.value, data))
        ready.events.append(Event("decided", now_ms, {
            "instance": self.instance_id.hex(), "round": cert.round,
            "value_hash": value_hash(cert.value, caches=self.caches).hex(), "value_kind": cert.value_kind}))

    def _set_decided(self, cert: CommitCertificate, data: bytes) -> None:
        self.decision = cert
        self.decided_value_bytes = cert.value
        self.decision_envelope = data
        self.awaiting_value = False
        self.gave_up = False
        # Nothing below can change a decided instance: free it (many instances live at once).
        # The equivocation log stays: equivocation after the decision is still evidence, and
        # it is small (one proposal and at most one vote of each kind per member and round).
        self._collector.clear()
        self._other_rounds.clear()
        self._proposal = self._polka = None

    def _answer_with_decision(self, envelope: Envelope, message, ready: Ready) -> None:
        """SPEC.md 6.8: a node still voting in a later round missed the decision; send it."""
        if (not isinstance(message, CommitCertificate) and message.round > self.decision.round
                and self._other_rounds.answer_decided(envelope.signer, message.round, self.me)):
            self._send(envelope.signer, self.decision_envelope, ready)

    # --- round changes and syncs (SPEC.md 6.5) -------------------------------------------------

    def _on_round_change(self, envelope: Envelope, change: RoundChange, data, now_ms: int, ready: Ready) -> None:
        # Rule 3: our round's leader has moved on, so our round will see no proposal: end it
        # now rather than at its timeout. One round at a time, so a Byzantine leader can cut
        # short only its own round, as its silence would.
        leader_moved_on = envelope.signer == self.leader and change.round > self.round
        if self.view.leader(self.instance_id, change.round) != self.me:
            if leader_moved_on:
                self._leader_moved_on(now_ms, ready)
                return
            return self._drop("not_collector", ready)
        if change.round < self.round or change.round == 0:
            self._send(envelope.signer, self._other_rounds.reply_to_stale(
                envelope.signer, change.round, self.round, self.me, self.round_change), ready)
            return self._drop("stale_round", ready)
        reason, before, stake = self._other_rounds.add(envelope, change,
                                                        data if data is not None else envelope.encode())
        if reason is not None:
            return self._drop(reason, ready)
        if not self.view.exceeds_one_third_stake(before) and self.view.exceeds_one_third_stake(stake):
            # Show the members still in earlier rounds that more than 1/3 has moved on.
            sync = self._other_rounds.make_sync(change.round)
            if sync is None:
                self.dropped["round_sync_too_large"] += 1  # timeouts remain
            self._send(None, sync, ready)
        if change.round > self.round:
            # More than 1/3 of the stake has moved on, at least one honest node.
            if self.view.exceeds_one_third_stake(stake):
                self._enter_round(change.round, now_ms, ready, "round_change_quorum", announce=True)
            elif leader_moved_on:
                self._leader_moved_on(now_ms, ready)
            return
        self._try_propose(now_ms, ready)

    def _leader_moved_on(self, now_ms: int, ready: Ready) -> None:
        """Rule 3: enter the next round now, but leave it when we would have had our round
        timed out: the leader (Byzantine, perhaps) chose whom it told, and the members it did
        not tell reach the next round only at their timeout; starting the round's timer now
        would leave us a round ahead of them when it ends."""
        due = self.deadline_ms
        self._enter_round(self.round + 1, now_ms, ready, "leader_moved_on", announce=True)
        if due is not None and due > now_ms and self.decision is None and not self.gave_up:
            self._round_started_ms = due

    def _on_round_sync(self, envelope: Envelope, sync: RoundSync, data, now_ms: int, ready: Ready) -> None:
        """Round changes of ``sync.round`` from more than 1/3 of the stake (so at least one
        honest member) pull this node forward; entering a later round is always safe."""
        if sync.round < self.round or (sync.round == self.round and self._round_started_ms <= now_ms):
            return self._drop("stale_round", ready)
        if not self._other_rounds.accept_sync(sync, data if data is not None else envelope.encode()):
            return self._drop("bad_round_sync", ready)
        if sync.round == self.round:
            # Rule 3 brought us here with the deadline of the round we left (later than a full
            # timeout from now); the members this sync pulls in time out a full timeout from
            # now: leave with them, or we stay a round behind them (seed 167 of the n=4 sweep).
            self._round_started_ms = now_ms
            return
        self._enter_round(sync.round, now_ms, ready, "round_sync", announce=True)

    # --- sending, evidence, drops ------------------------------------------------------------

    def _send(self, to: bytes | None, data: bytes | None, ready: Ready) -> None:
        """Send ``data`` (if any) to ``to``, or to everyone if None."""
        if data is not None:
            ready.messages.append(Outbound(to, data))
            self.messages_sent += 1

    def _send_to(self, to: bytes, envelope: Envelope, message, data: bytes, now_ms: int, ready: Ready) -> None:
        """Send to ``to``; a message to this node itself is handled here and now."""
        if to == self.me:
            self._handlers[type(message)](envelope, message, data, now_ms, ready)
        else:
            self._send(to, data, ready)

    def _broadcast(self, envelope: Envelope, message, data: bytes, now_ms: int, ready: Ready) -> None:
        """Send to every other member, and handle it here too."""
        self._send(None, data, ready)
        self._handlers[type(message)](envelope, message, data, now_ms, ready)

    def _is_repeat(self, kind: str, round: int, envelope: Envelope, data, now_ms: int, ready: Ready,
                   epoch: int | None = None) -> bool:
        """True if ``envelope`` repeats or contradicts what its signer already sent (SPEC.md 6.10)."""
        reason, outputs = self._equivocations.observe(kind, self.view.epoch if epoch is None else epoch, round,
                                                      envelope, data, now_ms)
        if reason is None:
            return False
        self._drop(reason, ready)
        if outputs is not None:
            ready.persist.append(outputs[0])
            ready.events.append(outputs[1])
        return True

    def _drop(self, reason: str, ready: Ready) -> Ready:
        self.dropped[reason] += 1
        return ready
