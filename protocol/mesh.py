"""MeshCore: one node's whole protocol state machine (SPEC.md section 7).

The node driver (meshnode/node.py, trio + libp2p) and the simulator (testnet/sim.py)
drive the same class. It has no IO: raw envelope bytes, ``now_ms`` ints and an
injected ``random.Random`` go in; one ``Ready`` batch comes out of every call, handled
as protocol/ready.py says (persist, send, decisions, events).

It owns the consensus instances (protocol/consensus.py) of four kinds of value and
routes every message to them or to the flows in mesh_jobs.py (placement, checkpoints,
job lifecycle), mesh_slots.py (placements batched per slot, P7) and mesh_failover.py
(heartbeats, suspicion, eviction, epochs, joins).

Bad remote input never raises: it is dropped and counted in ``self.counters`` under a
short reason (the consensus instances count into the same Counter).

Decisions: certified ones carry a decoded Placement / PlacementSlot / Eviction /
MembershipChange and the commit certificate. Four local, uncertified kinds
(``certificate == b""``) tell the driver what to do with workloads: "halt" (value
``()``: this node stalled past the detection bound, stop everything until caught up),
"resume" (value: job ids to restart from their newest checkpoint), "stop" and "cancel"
(value: job ids to stop here).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter, OrderedDict
from typing import Iterable

from protocol.certificate import verify_commit_certificate
from protocol.consensus import ConsensusInstance
from protocol.errors import RemoteProtocolError
from protocol.failure_detector import FailureDetector
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, Bid, Cancel, CapabilityVector, Checkpoint, CheckpointAck,
                               CommitCertificate, Decline, Heartbeat, JobExit, JobManifest, Join, Precommit, Prevote,
                               PrevoteCertificate, Proposal, RoundChange, RoundSync, Suspicion, SyncRequest,
                               decode_message, decode_value, placement_binding_error, slot_binding_error,
                               slot_placements)
from protocol.mesh_failover import FailoverFlows
from protocol.mesh_jobs import JobFlows
from protocol.mesh_slots import SlotFlows
from protocol.policy import LocalCapacity, NodePolicy
from protocol.quorum import EpochView
from protocol.ready import Decision, Event, Outbound, PersistRecord, Ready
from protocol.reservations import Reservations

CONSENSUS_KINDS = (Proposal, Prevote, Precommit, PrevoteCertificate, CommitCertificate, RoundChange, RoundSync)
MAX_ACTIVE_INSTANCES = 8192      # undecided instances at once; a job beyond it waits for a resubmit
MAX_DECIDED_KEPT = 256           # decided instances kept to answer stragglers (SPEC.md 6.8)
MAX_PENDING_INSTANCES = 512      # instances we hold early messages for
MAX_PENDING_PER_INSTANCE = 64
MAX_VIEWS_KEPT = 8               # epoch views kept for in-flight instances of older epochs
NO_INSTANCE = bytes(32)          # the instance field of local, uncertified decisions
SAFETY_TABLES = ("votes", "locks", "evidence")   # what ConsensusInstance.restore reads back
MAX_CATCH_UP_REPLIES = 4096      # (peer, instance, round) answered with an applied certificate, then forgotten


class MeshCore(JobFlows, SlotFlows, FailoverFlows):
    def __init__(self, *, identity, genesis, policy: NodePolicy, capacity: LocalCapacity, rng: random.Random,
                 now_ms: int, history: Iterable[bytes] = (), safety_records: Iterable[PersistRecord] = (),
                 job_outcomes: Iterable[bytes] = (), heartbeats: bool = True, bid_sample: int | None = None,
                 min_silence_ms: int | None = None):
        """``history``: the commit certificates this node persisted; ``safety_records``: its
        persisted ``votes``, ``locks`` and ``evidence`` records (SPEC.md 6.9), restored into an
        instance whenever it is created again, so a restarted node never votes against itself;
        ``job_outcomes``: the exit or cancel envelopes it persisted (table ``jobs``), replayed
        after the certificates.
        ``heartbeats=False`` turns heartbeats, failure detection and self-fencing off (the
        simulator's scale runs). ``bid_sample=K``: only about K members (chosen by hash of the
        instance and key, so every node agrees) bid on each job instead of all of them.
        ``min_silence_ms``: the failure detector's hiccup floor (default: the detection bound
        minus one heartbeat period, SPEC.md F2)."""
        self.identity = identity
        self.me = identity.public_key
        self.genesis = genesis
        self.mesh_id = genesis.mesh_id
        self.params = genesis.params
        self.authorities = tuple(genesis.authorities)
        self.policy = policy
        self.capacity = capacity
        self.rng = rng
        self.heartbeats = heartbeats
        self.bid_sample = bid_sample
        self.counters: Counter = Counter()
        self.view = EpochView.from_genesis(genesis)
        self.views: dict[int, EpochView] = {self.view.epoch: self.view}
        self.member_info = {m.public_key: m for m in genesis.members}
        self.detector = FailureDetector(heartbeat_ms=self.params.heartbeat_ms,
                                        detection_bound_ms=self.params.detection_bound_ms,
                                        min_silence_ms=min_silence_ms)
        # Members are watched from their first heartbeat on, not from our start: nodes of a
        # mesh start seconds apart, and one that never came up holds no workload (it never
        # bid), so suspecting it would only evict a slow starter (SPEC.md 8.1).
        self.book = Reservations(capacity.gpu_mem_total_mib, capacity.cpu_milli, capacity.mem_mib)
        self.instances: dict[bytes, ConsensusInstance] = {}
        self.decided: OrderedDict[bytes, ConsensusInstance] = OrderedDict()
        self.applied: OrderedDict[bytes, None] = OrderedDict()   # instances whose decision we applied
        self.instance_meta: dict[bytes, tuple] = {}  # instance -> ("placement", job_id) | ("epoch_change",)
        self.instance_round: dict[bytes, int] = {}
        self.pending: OrderedDict[bytes, list] = OrderedDict()   # early messages for unknown instances
        self.timers: list[tuple[int, int, str, bytes]] = []      # (due_ms, seq, what, instance)
        self.timer_seq = 0
        self.evidence: list = []
        self.evidence_log: list[dict] = []
        self.restored_votes: dict[bytes, list[PersistRecord]] = {}  # undecided instance -> its records
        self.jobs_shown: set[tuple] = set()          # (leader, instance, round) we sent the job to (SPEC P3)
        self.recent_certificates: OrderedDict[bytes, bytes] = OrderedDict()  # applied instance -> certificate
        self.catch_up_sent: set[tuple] = set()      # (peer, instance, round) answered with a certificate
        self._init_jobs()
        self._init_slots()
        self._init_failover(now_ms)
        self._replay(history, now_ms)
        self._replay_outcomes(job_outcomes, now_ms)
        for record in safety_records:
            iid = record.value.get("instance")
            if record.table in SAFETY_TABLES and isinstance(iid, bytes) and iid not in self.applied:
                self.restored_votes.setdefault(iid, []).append(record)

    # --- small views --------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.view.epoch

    def is_member(self) -> bool:
        return self.me in self.view.stakes

    def member_records(self) -> list:
        return [self.member_info[key] for key in self.view.members if key in self.member_info]

    def broadcast_targets(self) -> list[bytes]:
        """Who ``Outbound(to=None)`` means: every other member of the current epoch."""
        return [key for key in self.view.members if key != self.me]

    def members(self) -> list[dict]:
        out = []
        for key in self.view.members:
            info = self.member_info.get(key)
            if key == self.me:
                health = "self"
            elif self.heartbeats and self.detector.is_suspected(key, self.last_tick_ms):
                health = "suspected"
            else:
                health = "alive"
            out.append({"key": key, "stake": self.view.stakes[key], "zone": info.zone if info else "",
                        "labels": dict(info.labels) if info else {}, "health": health,
                        "suspected_by": len(self.suspicions.get(key, ())),
                        "capability": self._capability_summary(key)})
        return out

    def consensus_view(self) -> dict:
        rows = []
        for iid, inst in list(self.instances.items()) + list(self.decided.items())[-64:]:
            rows.append({"instance": iid, "kind": inst.value_kind, "round": inst.round, "leader": inst.leader,
                         "decided": inst.decision is not None, "gave_up": inst.gave_up})
        return {"instances": rows, "certificates": len(self.applied), "evidence": list(self.evidence_log)}

    # --- inputs -------------------------------------------------------------------------------
    def step(self, data: bytes, now_ms: int, sender: bytes | None = None) -> Ready:
        """One message from a peer. Never raises on bad input: drops and counts it.
        ``sender``: the key of the peer that delivered it, where the transport knows it (a
        job's first deliverer is its entry node, the one that hears its declines, SPEC P3)."""
        out = Ready()
        try:
            envelope, message = decode_message(data, self.mesh_id, allow_any_mesh=True)
        except RemoteProtocolError:
            self.counters["undecodable"] += 1
            return out
        if envelope.mesh_id != self.mesh_id and not isinstance(message, JobManifest):
            self.counters["any_mesh_not_a_job"] += 1
            return out
        handler = self._handlers.get(type(message))
        if handler is None:
            self.counters["unexpected_kind"] += 1
            return out
        try:
            if type(message) is JobManifest:
                self._on_job(envelope, message, data, now_ms, out, entry=sender)
            else:
                handler(envelope, message, data, now_ms, out)
        except RemoteProtocolError:
            self.counters["rejected_" + envelope.kind] += 1
        return out

    @property
    def _handlers(self) -> dict:
        table = self.__dict__.get("_handler_table")  # built once: step() asks on every message
        if table is None:
            table = self.__dict__["_handler_table"] = self._handler_table_new()
        return table

    def _handler_table_new(self) -> dict:
        return {Proposal: self._on_consensus, Prevote: self._on_consensus, Precommit: self._on_consensus,
                PrevoteCertificate: self._on_consensus, CommitCertificate: self._on_consensus,
                RoundChange: self._on_consensus, RoundSync: self._on_consensus, JobManifest: self._on_job,
                Bid: self._on_bid, Decline: self._on_decline, Checkpoint: self._on_checkpoint,
                CheckpointAck: self._on_checkpoint_ack,
                JobExit: self._on_job_exit, Cancel: self._on_cancel, CapabilityVector: self._on_capability,
                Heartbeat: self._on_heartbeat, Suspicion: self._on_suspicion, SyncRequest: self._on_sync_request,
                Join: self._on_join}

    def tick(self, now_ms: int) -> Ready:
        out = Ready()
        self._tick_failover(now_ms, out)
        while self.timers and self.timers[0][0] <= now_ms:
            _, _, what, iid = heapq.heappop(self.timers)
            inst = self.instances.get(iid)
            if inst is None:
                continue
            if what == "deadline":
                deadline = inst.deadline_ms
                if deadline is not None and deadline <= now_ms:
                    self._drive(inst, inst.tick(now_ms), now_ms, out)
                else:
                    self._schedule(inst)
            else:  # "bid_window"
                self._bid_window_closed(iid, now_ms, out)
        for key in self.book.expire(now_ms):
            out.events.append(self._event("reservation_expired", now_ms, instance=key.hex()))
        if len(self.timers) > 4 * (len(self.instances) + 64):  # lazy heap: drop stale entries
            self.timers = [t for t in self.timers if t[3] in self.instances]
            heapq.heapify(self.timers)
        return out

    # --- consensus instances ------------------------------------------------------------------
    def _schedule(self, inst: ConsensusInstance, what: str = "deadline", due_ms: int | None = None) -> None:
        due = inst.deadline_ms if due_ms is None else due_ms
        if due is not None:
            self.timer_seq += 1
            heapq.heappush(self.timers, (due, self.timer_seq, what, inst.instance_id))

    def _view_for(self, epoch: int) -> EpochView | None:
        return self.views.get(epoch)

    def _start_instance(self, iid: bytes, kind: str, view: EpochView, meta: tuple, validate, now_ms: int,
                        out: Ready, other_kinds: dict | None = None,
                        max_rounds: int | None = None) -> ConsensusInstance | None:
        if iid in self.instances or iid in self.decided or iid in self.applied:
            return self.instances.get(iid)
        if len(self.instances) >= MAX_ACTIVE_INSTANCES:
            self.counters["too_many_instances"] += 1
            return None
        restored = self.restored_votes.get(iid)
        if any(r.value.get("epoch", view.epoch) != view.epoch for r in restored or ()):
            # One instance id runs in one epoch (SPEC.md P2, F4): records of another epoch are
            # not ours to resume here, and voting afresh beside them could sign twice.
            self.counters["records_of_another_epoch"] += 1
            return None
        # A slot's leader waits one slot window before it gathers bids (P7b): its rounds
        # last that much longer, or members time out just as its decision arrives.
        timeout_ms = self.params.round_timeout_ms + (self.params.placement_slot_ms if kind == "placement_slot" else 0)
        inst = ConsensusInstance(instance_id=iid, value_kind=kind, view=view, identity=self.identity,
                                 mesh_id=self.mesh_id, round_timeout_ms=timeout_ms,
                                 round_timeout_max_ms=self.params.round_timeout_max_ms,
                                 max_rounds=max_rounds or self.params.max_rounds, validate=validate, now_ms=now_ms,
                                 other_kinds=other_kinds)
        inst.dropped = self.counters  # one Counter of drop reasons for the whole node
        inst.other_views = self.views  # other epochs' equivocation is evidence too (SPEC.md 6.10)
        if restored:
            try:
                inst.restore(restored)
            except RemoteProtocolError:
                self.counters["bad_safety_record"] += 1
        self.instances[iid] = inst
        self.instance_meta[iid] = meta
        self.instance_round[iid] = inst.round
        self._drive(inst, inst.start(now_ms), now_ms, out)
        for envelope, message, data in self.pending.pop(iid, ()):
            if isinstance(message, Bid):
                try:
                    self._on_bid(envelope, message, data, now_ms, out)
                except RemoteProtocolError:
                    # A held bid is remote input checked only now (e.g. one for an older
                    # epoch): it is dropped like any bad bid, never raised to our caller.
                    self.counters["rejected_bid"] += 1
            elif iid in self.instances:  # as if it arrived now (it may show another epoch's choice)
                self._on_consensus(envelope, message, data, now_ms, out)
        return self.instances.get(iid, inst)

    def _drive(self, inst: ConsensusInstance, ready: Ready, now_ms: int, out: Ready) -> None:
        """Fold an instance's output into ``out``: decode and apply decisions, follow round
        changes (re-send bids), answer requests for a value, keep timers and evidence."""
        iid = inst.instance_id
        out.persist.extend(ready.persist)
        if inst.view.epoch == self.view.epoch:
            out.messages.extend(ready.messages)
        else:
            out.messages.extend(self._to_epoch_members(inst.view, ready.messages))
        for event in ready.events:
            out.events.append(event)
            if event.kind == "evidence" and inst.evidence:
                self._remember_evidence(inst.evidence[-1], event)
        for decision in ready.decisions:
            self._apply_certified(decision.value_kind, iid, decision.value, decision.certificate, inst.view.epoch,
                                  now_ms, out)
        if inst.decision is not None or inst.gave_up:
            self._retire(inst, now_ms, out)
            return
        if inst.round != self.instance_round.get(iid):
            self.instance_round[iid] = inst.round
            self._on_round_changed(inst, now_ms, out)
        if inst.awaiting_value:
            self._on_awaiting_value(inst, now_ms, out)
        self._schedule(inst)

    def _to_epoch_members(self, view: EpochView, messages: list) -> list:
        """An instance of an older epoch (a placement that names it, P2; an evicted node's kept
        one, F7) broadcasts to that epoch's members and the current ones: ``Outbound(to=None)``
        reaches only the current epoch's, a member the epoch change removed may hold the stake
        the instance needs for a quorum, and one admitted since must learn the decision."""
        members = sorted((set(view.members) | set(self.view.members)) - {self.me})
        routed = []
        for message in messages:
            if message.to is None:
                routed.extend(Outbound(key, message.data) for key in members)
            else:
                routed.append(message)
        return routed

    def _forget_instance(self, iid: bytes) -> None:
        """Drop an undecided instance object, keeping what it signed: should the instance be
        started again in this run (a proposal or held message for it), the new object resumes
        from these records exactly as after a restart, and never signs a second proposal or
        vote for a round (the 10,000-seed sweep caught one: seed 7105)."""
        inst = self.instances.pop(iid)
        records = inst.safety_records()
        if records:
            self._keep_safety_records(iid, records)

    def _keep_safety_records(self, iid: bytes, records: list) -> None:
        """Add to what a re-created instance restores, upserted by (table, key) as on disk: a
        later lock replaces the earlier one, and an instance dropped and re-created again and
        again does not pile up copies of its votes."""
        kept = {(r.table, r.key): r for r in self.restored_votes.get(iid, ())}
        kept.update(((r.table, r.key), r) for r in records)
        self.restored_votes[iid] = list(kept.values())

    def _retire(self, inst: ConsensusInstance, now_ms: int, out: Ready) -> None:
        iid = inst.instance_id
        if self.instances.pop(iid, None) is None:
            return
        self.instance_round.pop(iid, None)
        meta = self.instance_meta.pop(iid, ("?",))
        if inst.gave_up and inst.decision is None:
            # Undecided: should it be created again once it left `decided` (a proposal, a
            # resubmit), it must resume from what it signed, as after a restart (SPEC.md 6.9).
            self._keep_safety_records(iid, inst.safety_records())
            self._instance_gave_up(iid, meta, now_ms, out)
        else:
            self.restored_votes.pop(iid, None)  # a decided instance is never voted in again
        self.decided[iid] = inst
        while len(self.decided) > MAX_DECIDED_KEPT:
            self.decided.popitem(last=False)

    def _on_consensus(self, envelope, message, data, now_ms: int, out: Ready) -> None:
        iid = message.instance
        if (isinstance(message, Proposal) and message.value_kind != "placement_slot"
                and len(message.justification) > MAX_BIDS_PER_PROPOSAL + 1):
            raise RemoteProtocolError("only a slot proposal carries more than %d bids (P7b)" % MAX_BIDS_PER_PROPOSAL)
        inst = self.instances.get(iid) or self.decided.get(iid)
        if inst is None and isinstance(message, Proposal):
            inst = self._instance_from_proposal(message, now_ms, out)
        if isinstance(message, CommitCertificate) and inst is None:
            # No instance here: a certificate valid for its own epoch is the decision.
            self._apply_certificate_bytes(data, now_ms, out)
            return
        if inst is None:
            self._answer_applied(iid, envelope.signer, message.round, out)
            self._hold(iid, envelope, message, data)
            return
        self._drive(inst, inst.on_message(envelope, message, now_ms, data), now_ms, out)

    def _answer_applied(self, iid: bytes, peer: bytes, round: int, out: Ready) -> None:
        """SPEC.md 6.8 for a decision applied without a live instance (replayed after a restart,
        learnt by catch-up or sync): a peer still voting on it gets the certificate, once per
        (peer, instance, round), instead of silence."""
        certificate = self.recent_certificates.get(iid)
        key = (peer, iid, round)
        if certificate is None or peer == self.me or key in self.catch_up_sent:
            return
        if len(self.catch_up_sent) >= MAX_CATCH_UP_REPLIES:
            self.catch_up_sent.clear()
        self.catch_up_sent.add(key)
        out.messages.append(Outbound(peer, certificate))

    def _hold(self, iid: bytes, envelope, message, data: bytes) -> None:
        """Keep an early message until its instance exists (the job, suspicion or join that
        creates it may arrive after a faster peer's vote or bid)."""
        if iid in self.applied:
            self.counters["already_decided"] += 1
            return
        held = self.pending.get(iid)
        if held is None:
            if len(self.pending) >= MAX_PENDING_INSTANCES:
                self.pending.popitem(last=False)
                self.counters["pending_evicted"] += 1
            held = self.pending[iid] = []
        if len(held) >= MAX_PENDING_PER_INSTANCE:
            self.counters["pending_full"] += 1
            return
        held.append((envelope, message, data))

    def _instance_from_proposal(self, proposal: Proposal, now_ms: int, out: Ready):
        """A proposal for an instance we have not started carries all we need to validate it."""
        view = self._view_for(proposal.epoch)
        if view is None:
            self.counters["unknown_epoch"] += 1
            return None
        value = decode_value(proposal.value_kind, proposal.value)
        if proposal.value_kind == "placement":
            return self._placement_instance_from_value(proposal.instance, value, view, now_ms, out,
                                                       proposal.justification)
        if proposal.value_kind == "placement_slot":
            return self._slot_instance_from_value(proposal.instance, value, view, now_ms, out)
        if proposal.value_kind == "eviction":
            return self._eviction_instance_from_value(proposal.instance, value, view, now_ms, out)
        return self._membership_instance_from_value(proposal.instance, value, view, now_ms, out)

    def _apply_certificate_bytes(self, data: bytes, now_ms: int, out: Ready, persist: bool = True) -> bool:
        """Apply a commit certificate that arrived without a live instance (catch-up, sync,
        replay). Returns False if its epoch is not known yet (the caller may retry later)."""
        envelope, cert = decode_message(data, self.mesh_id, expect=CommitCertificate)
        if cert.instance in self.applied:
            self.counters["already_decided"] += 1
            return True
        view = self._view_for(cert.epoch)
        if view is None:
            if cert.epoch > self.epoch:
                self._hold_future_certificate(cert.epoch, envelope.signer, data)
                return False
            self.counters["unknown_epoch"] += 1
            return True
        verify_commit_certificate(data, self.mesh_id, view)
        if persist:
            out.persist.append(self._certificate_record(cert, data))
        if not self._apply_certified(cert.value_kind, cert.instance, cert.value, data, cert.epoch, now_ms, out):
            return True
        inst = self.instances.get(cert.instance)
        if inst is not None:  # our own instance lagged behind: it is decided now
            self._drive(inst, inst.on_message(envelope, cert, now_ms, data), now_ms, Ready())
        return True

    @staticmethod
    def _certificate_record(cert: CommitCertificate, data: bytes) -> PersistRecord:
        return PersistRecord("certificates", cert.instance.hex(), {
            "instance": cert.instance, "value_kind": cert.value_kind, "round": cert.round, "certificate": data})

    def _apply_certified(self, value_kind: str, iid: bytes, value_bytes: bytes, certificate: bytes, epoch: int,
                         now_ms: int, out: Ready) -> bool:
        """Apply a decision of ``epoch``; False if it was refused (or applied before)."""
        if iid in self.applied:
            return False
        value = decode_value(value_kind, value_bytes)
        if value_kind == "placement":
            _envelope, job = decode_message(value.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
            if placement_binding_error(iid, job, epoch) is not None:
                # Only a quorum with more than a third of Byzantine stake signs one (every
                # honest voter checks it, P4b): it places nothing (P2, one epoch per instance).
                self.counters["placement_certificate_wrong_epoch"] += 1
                return False
        elif value_kind == "placement_slot":
            try:
                problem = slot_binding_error(iid, value, slot_placements(value, self.mesh_id), epoch, self.slot_ms)
            except RemoteProtocolError:
                problem = "a job that is not signed by its owner"
            if problem is not None:  # as above: only a Byzantine quorum certifies one (P7)
                self.counters["placement_certificate_wrong_epoch"] += 1
                return False
        self.applied[iid] = None
        while len(self.applied) > 1 << 16:
            self.applied.popitem(last=False)
        self.recent_certificates[iid] = certificate
        while len(self.recent_certificates) > MAX_DECIDED_KEPT:
            self.recent_certificates.popitem(last=False)
        if value_kind == "placement":
            self._apply_placement(iid, value, certificate, epoch, now_ms, out)
        elif value_kind == "placement_slot":
            self._apply_slot(iid, value, certificate, epoch, now_ms, out)
        elif value_kind == "eviction":
            self._apply_eviction(iid, value, certificate, now_ms, out)
        else:
            self._apply_membership(iid, value, certificate, now_ms, out)
        out.decisions.append(Decision(value_kind, iid, value, certificate))
        return True

    def _replay(self, history: Iterable[bytes], now_ms: int) -> None:
        """Rebuild epochs, placements and fences from persisted certificates (in any order:
        a certificate whose epoch is not reached yet is retried after the others)."""
        waiting = list(history)
        while waiting:
            progress, later = False, []
            for data in waiting:
                try:
                    if self._apply_certificate_bytes(data, now_ms, Ready(), persist=False):
                        progress = True
                    else:
                        later.append(data)
                except RemoteProtocolError:
                    self.counters["bad_history"] += 1
            if not progress:
                break
            waiting = later
        self.future_certificates.clear()
        self.pending.clear()

    def _remember_evidence(self, evidence, event) -> None:
        if len(self.evidence) < 256:
            self.evidence.append(evidence)
            self.evidence_log.append({"offender": evidence.offender, "kind": event.detail.get("kind", ""),
                                      "at_ms": event.at_ms})

    @staticmethod
    def _event(kind: str, now_ms: int, **detail) -> Event:
        return Event(kind, now_ms, detail)

    def _local_decision(self, kind: str, job_ids: tuple) -> Decision:
        return Decision(kind, NO_INSTANCE, tuple(job_ids), b"")

