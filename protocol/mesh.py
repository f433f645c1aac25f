"""MeshCore: one node's whole protocol state machine (SPEC.md section 7).

The node driver (meshnode/) and the simulator (testnet/sim.py) drive the same class.
It has no IO: raw envelope bytes, ``now_ms`` ints and an injected ``random.Random`` go
in; one ``Ready`` batch comes out of every call, handled as protocol/ready.py says
(persist, send, decisions, events).

This file keeps routing and the public inputs; the parts it wires together each live in
their own file and see only what their constructor is given:

    state     epochs.py (membership and views), job_table.py, ledger.py (capacity),
              instances.py (consensus instances and their timers)
    flows     flows/placement.py, flows/slot.py, flows/epoch_change.py, flows/move.py,
              flows/preemption.py, flows/gang.py: one per kind of decided value, found through
              flows/base.py's FlowRegistry
    the rest  bidding.py (bids, declines), capability.py (capability vectors),
              liveness.py (heartbeats, suspicion, self-fencing, sync), joins.py,
              job_lifecycle.py (checkpoints, exits, cancels)

Bad remote input never raises: it is dropped and counted in ``counters`` under a short
reason (the consensus instances count into the same Counter).

Decisions: certified ones carry a decoded Placement / PlacementSlot / Eviction /
MembershipChange / JobMove and the commit certificate. Local, uncertified ones
(``certificate == b""``) are about this node's workloads. Two are orders, and the
driver acts on nothing else (workload_orders.py): "stop" (value: job ids) and "run"
(value: ``WorkloadRun`` items). Three say why, for logs and tools: "halt" (value ``()``:
this node stalled past the detection bound; its workloads stop until it caught up),
"resume" (value: the job ids it may run again) and "cancel" (value: job ids cancelled).
"""

from __future__ import annotations

import random
from typing import Iterable

from protocol.bidding import BID_LIFETIME_ROUNDS, Bidding
from protocol.caches import CoreCaches
from protocol.capability import CapabilityBook
from protocol.certificate import verify_commit_certificate
from protocol.context import NodeContext
from protocol.epochs import Epochs
from protocol.errors import RemoteProtocolError
from protocol.flows.base import FlowRegistry
from protocol.flows.epoch_change import EpochChangeFlow
from protocol.flows.move import MoveFlow
from protocol.flows.replica import ReplicaFlow
from protocol.flows.gang import GangFlow
from protocol.flows.gang_replace import GangReplaceFlow
from protocol.flows.gang_resize import GangResizeFlow
from protocol.flows.placement import PlacementFlow
from protocol.flows.preemption import PreemptionFlow
from protocol.flows.slot import SlotFlow
from protocol.instances import InstanceTable
from protocol.job_lifecycle import JobLifecycle
from protocol.job_queue import Room
from protocol.job_table import LIVE_JOB_STATES, JobTable
from protocol.joins import Joins
from protocol.ledger import ResourceLedger
from protocol.liveness import Liveness
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, Bid, Cancel, CapabilityVector, Checkpoint, CheckpointAck,
                               CommitCertificate, Decline, Heartbeat, JobExit, JobManifest, JobRefusal, Join,
                               MoveRequest, Precommit, Prevote, PrevoteCertificate, Proposal, RoundChange, RoundSync,
                               QuotaGrant, Resources, RunStopped, Suspicion, SyncRequest, decode_heartbeat,
                               decode_message, decode_value)
from protocol.policy import LocalCapacity, NodePolicy
from protocol.ready import Decision, PersistRecord, Ready
from protocol.replicas import endpoint_table
from protocol.workload_orders import WorkloadOrders


class MeshCore:
    def __init__(self, *, identity, genesis, policy: NodePolicy, capacity: LocalCapacity, rng: random.Random,
                 now_ms: int, history: Iterable[bytes] = (), safety_records: Iterable[PersistRecord] = (),
                 job_outcomes: Iterable[bytes] = (), heartbeats: bool = True, bid_sample: int | None = None,
                 min_silence_ms: int | None = None, capability_seq_floor: int = 0,
                 caches: CoreCaches | None = None):
        """``history``: the commit certificates this node persisted; ``safety_records``: its
        persisted ``votes``, ``locks`` and ``evidence`` records (SPEC.md 6.9), restored into an
        instance whenever it is created again, so a restarted node never votes against itself;
        ``job_outcomes``: the exit or cancel envelopes it persisted (table ``jobs``), replayed
        after the certificates.
        ``heartbeats=False`` turns heartbeats, failure detection and self-fencing off (the
        simulator's scale runs). ``bid_sample=K``: only about K members (chosen by hash of the
        instance and key, so every node agrees) bid on each job instead of all of them;
        default: the genesis ``bid_sample`` (SPEC.md 5.6; 0 there: every member bids).
        ``min_silence_ms``: the failure detector's hiccup floor (default: the detection bound
        minus one heartbeat period, SPEC.md F2). ``capability_seq_floor``: the persisted
        ``capability`` record's ``seq_floor``, so a restart never rewinds the seq peers compare (P1).
        ``caches``: the memo tables (protocol/caches.py) this core uses; default: its own. A
        driver running many cores may hand them one, deliberately (the simulator does, so a
        signature one simulated node verified is not verified again by the next: every entry
        is a pure function of bytes, so this changes the cost, never a decision)."""
        if bid_sample is None:
            bid_sample = genesis.bid_sample or None
        ctx = self.ctx = NodeContext(identity=identity, genesis=genesis, policy=policy, capacity=capacity, rng=rng,
                                     heartbeats=heartbeats, bid_sample=bid_sample, caches=caches or CoreCaches())
        self.identity, self.me, self.mesh_id, self.genesis = identity, ctx.me, ctx.mesh_id, genesis
        self.params, self.counters = ctx.params, ctx.counters
        # Shared state, each an explicit object handed to the parts that use it.
        self.epochs = epochs = Epochs(genesis, ctx.me, ctx.counters)
        self.job_table = jobs = JobTable(ctx.me)
        self.ledger = ledger = ResourceLedger(capacity.gpu_mem_total_mib, capacity.cpu_milli, capacity.mem_mib,
                                              capacity.gpu_model)
        self.instance_table = instances = InstanceTable(ctx, epochs, self._apply_certified, self._deliver_held,
                                                        safety_records)
        # The parts, then the links between them that run both ways.
        self.capability = capability = CapabilityBook(ctx, epochs, jobs, ledger, capability_seq_floor)
        self.bidding = bidding = Bidding(ctx, epochs, jobs, ledger, capability, instances)
        self.liveness = liveness = Liveness(ctx, epochs, jobs, instances, now_ms, min_silence_ms)
        self.joins = joins = Joins(ctx, epochs)
        self.placement = placement = PlacementFlow(ctx, epochs, jobs, ledger, instances, bidding,
                                                   self._apply_certificate_bytes)
        self.gangs = gangs = GangFlow(ctx, epochs, jobs, ledger, instances, bidding, self._apply_certificate_bytes)
        self.slots = slots = SlotFlow(ctx, epochs, jobs, ledger, instances, bidding, placement)
        self.epoch_changes = epoch_changes = EpochChangeFlow(ctx, epochs, jobs, ledger, instances, liveness, joins,
                                                             self._apply_certificate_bytes)
        self.lifecycle = lifecycle = JobLifecycle(ctx, epochs, jobs, ledger, placement)
        self.moves = moves = MoveFlow(ctx, epochs, jobs, ledger, instances, capability)
        self.orders = WorkloadOrders(epochs, jobs, liveness, ledger, lifecycle.handoff_waits, gangs.rank_of,
                                     lifecycle.stop_waits)
        lifecycle.ordered = self.orders.ordered   # R2a: whether a moved job's run may still go on here
        lifecycle.seen_running = capability.shows_running
        bidding.slots = placement.slots = gangs.slots = slots
        placement.epoch_changes = gangs.epoch_changes = epoch_changes
        placement.lifecycle = epoch_changes.lifecycle = moves.lifecycle = gangs.lifecycle = lifecycle
        placement.gangs = lifecycle.gangs = gangs
        epoch_changes.placement = moves.placement = placement
        liveness.epoch_changes = joins.epoch_changes = epoch_changes
        liveness.joins = joins
        self.preemptions = preemptions = PreemptionFlow(ctx, epochs, jobs, ledger, instances, bidding, capability,
                                                        placement, lifecycle)
        self.replicas = replicas = ReplicaFlow(ctx, epochs, jobs, ledger, instances, capability)
        self.orders.replicas = replicas
        capability.watches = replicas.watches
        self.gang_ranks = gang_ranks = GangReplaceFlow(ctx, epochs, jobs, ledger, instances, capability, gangs,
                                                       lifecycle)
        epoch_changes.gang_ranks = gang_ranks
        self.gang_resizes = gang_resizes = GangResizeFlow(ctx, epochs, jobs, ledger, instances, capability, gangs,
                                                          lifecycle)
        gangs.resizer = gang_ranks.resizer = gang_resizes
        epochs.views_needed = gangs.epochs_needed
        self.flows = FlowRegistry((placement, slots, epoch_changes, moves, preemptions, gangs, replicas, gang_ranks,
                                   gang_resizes))
        self._handlers = {
            Proposal: self._on_consensus, Prevote: self._on_consensus, Precommit: self._on_consensus,
            PrevoteCertificate: self._on_consensus, CommitCertificate: self._on_consensus,
            RoundChange: self._on_consensus, RoundSync: self._on_consensus, JobManifest: placement.on_job,
            Bid: bidding.on_bid, Decline: bidding.on_decline, Checkpoint: lifecycle.on_checkpoint,
            CheckpointAck: lifecycle.on_checkpoint_ack, JobExit: self._on_job_end, Cancel: lifecycle.on_cancel,
            JobRefusal: self._on_job_end, MoveRequest: moves.on_move_request, RunStopped: lifecycle.on_run_stopped,
            CapabilityVector: self._on_capability, Heartbeat: liveness.on_heartbeat,
            Suspicion: liveness.on_suspicion, SyncRequest: self._on_sync_request, Join: joins.on_join,
            QuotaGrant: self._on_quota_grant}
        safety_records = tuple(safety_records)
        # The history and outcomes set the job table; the ledger is rebuilt from the final
        # table (R1), never from the states in between (a job that exited, its room re-used).
        lifecycle.deferred = True
        self._replay(history, now_ms)
        # Before the outcomes: a failed exit replayed starts its job's next placement instance,
        # which must resume from the votes it signed before the restart (6.9), not sign anew
        # (an honest leader proposed twice in one round: `meshnode sim --seed 1068 ... --fail 0.2`).
        instances.restore_safety_records()
        lifecycle.replay_outcomes(self._restore_quota_grants(job_outcomes, now_ms), now_ms)
        if self.instance_table.applied:
            self.bidding.scheduling.admission.restarted(now_ms)   # Q2b: hears the grants in flight first
        lifecycle.deferred = False
        self._refuse_after_sync: list[bytes] = []
        self._rebuild_ledger([r for r in safety_records if r.table == "reservations"], now_ms)

    # --- views --------------------------------------------------------------------------------
    @property
    def policy(self) -> NodePolicy:
        return self.ctx.policy

    @policy.setter
    def policy(self, policy: NodePolicy) -> None:
        """An operator's new local policy (SPEC P3): later bids and declines follow it."""
        self.ctx.policy = policy

    @property
    def view(self):
        return self.epochs.view

    @property
    def views(self) -> dict:
        return self.epochs.views

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def member_info(self) -> dict:
        return self.epochs.member_info

    @property
    def instances(self) -> dict:
        """Undecided consensus instances by id."""
        return self.instance_table.instances

    @property
    def decided(self):
        return self.instance_table.decided

    @property
    def evidence(self) -> list:
        return self.instance_table.evidence

    @property
    def halted(self) -> bool:
        return self.liveness.halted

    @property
    def detector(self):
        return self.liveness.detector

    @property
    def last_tick_ms(self) -> int:
        return self.liveness.last_tick_ms

    @property
    def evicted_at_epoch(self) -> int | None:
        return self.joins.evicted_at_epoch

    def is_member(self) -> bool:
        return self.epochs.is_member()

    def member_records(self) -> list:
        return self.epochs.member_records()

    def broadcast_targets(self) -> list[bytes]:
        return self.epochs.broadcast_targets()

    def jobs(self) -> list[dict]:
        return [self.gangs.annotate(record.as_dict()) for record in self.job_table]

    def job_view(self, jid: bytes) -> dict | None:
        record = self.job_table.get(jid)
        return None if record is None else self.gangs.annotate(record.as_dict())

    def endpoints(self, jid: bytes, address_of) -> list[dict] | None:
        """SPEC.md R4e: the job's endpoint table (None: unknown job); ``address_of(node)``
        gives a node's address (the driver knows the members' multiaddrs)."""
        record = self.job_table.get(jid)
        return None if record is None else endpoint_table(record, address_of)

    def pending_report(self, jid: bytes, now_ms: int) -> dict | None:
        """SPEC.md Q4: a job's pool, queue position, holding quota and estimated start, from
        this node's job table and the capability vectors it holds."""
        record = self.job_table.get(jid)
        if record is None:
            return None
        vectors = dict(self.capability.peers)
        if self.capability.vector is not None:
            vectors[self.me] = self.capability.vector
        free = {key: Room(len(cap.gpus_free), cap.cpu_milli_free, cap.mem_mib_free) for key, cap in vectors.items()
                if key in self.view.stakes}
        return self.bidding.scheduling.pending_report(record, free, now_ms)

    def borrowing_report(self, jid: bytes, now_ms: int) -> str | None:
        """SPEC.md Q6: for "why", that the job runs (or waits) on borrowed quota, and whose."""
        record = self.job_table.get(jid)
        return None if record is None else self.bidding.scheduling.admission.borrowing_report(record, now_ms)

    def members(self) -> list[dict]:
        out = []
        suspicions = self.liveness.suspicions
        for key in self.view.members:
            info = self.member_info.get(key)
            health = "self" if key == self.me else "suspected" if self.liveness.is_suspected(key) else "alive"
            out.append({"key": key, "stake": self.view.stakes[key], "zone": info.zone if info else "",
                        "labels": dict(info.labels) if info else {}, "health": health,
                        "suspected_by": len(suspicions.get(key, ())),
                        "capability": self.capability.summary(key)})
        return out

    def consensus_view(self) -> dict:
        rows = []
        table = self.instance_table
        for iid, inst in list(table.instances.items()) + list(table.decided.items())[-64:]:
            # The kind decided (an epoch change decides an eviction or a join), and whether this
            # node applied it: a decided value it refused (F5: an old epoch's change) changed nothing.
            decided = inst.decision is not None
            rows.append({"instance": iid, "kind": inst.decision.value_kind if decided else inst.value_kind,
                         "round": inst.round, "leader": inst.leader, "decided": decided,
                         "applied": iid in table.applied, "gave_up": inst.gave_up})
        return {"instances": rows, "certificates": len(table.applied), "evidence": list(table.evidence_log)}

    # --- inputs -------------------------------------------------------------------------------
    def step(self, data: bytes, now_ms: int, sender: bytes | None = None) -> Ready:
        """One message from a peer. Never raises on bad input: drops and counts it.
        ``sender``: the key of the peer that delivered it, where the transport knows it (a
        job's first deliverer is its entry node, the one that hears its declines, SPEC P3)."""
        out = Ready()
        try:
            envelope, message = decode_message(data, self.mesh_id, allow_any_mesh=True, caches=self.ctx.caches,
                                               channel_sender=sender)
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
                handler(envelope, message, data, now_ms, out, entry=sender)
            else:
                handler(envelope, message, data, now_ms, out)
        except RemoteProtocolError:
            self.counters["rejected_" + envelope.kind] += 1
        return self._with_orders(out)

    def take_heartbeat(self, data: bytes, now_ms: int, sender: bytes) -> bool:
        """A heartbeat frame taken where the transport reads it (SPEC F1d): True when it only
        fed the failure detector, so there is no Ready and no input to drain; False, with
        nothing done, for any other frame or a heartbeat that may have more effect (the
        driver then ``step``s it, which also counts a bad one)."""
        beat = decode_heartbeat(data, self.mesh_id, sender)
        return beat is not None and self.liveness.take_quiet_heartbeat(sender, beat, now_ms)

    def _with_orders(self, out: Ready) -> Ready:
        """Every input's Ready ends with the workload orders it implies (workload_orders.py),
        the reservations it made or dropped (R1: persisted before its bids are sent) and,
        when the capability seq passed its persisted floor, the new floor."""
        if self.replicas.parked:   # R4d: a job learnt after its replica actions were decided
            self.replicas.apply_parked(self.liveness.last_tick_ms, out)
        self.replicas.drop_gone(self.liveness.last_tick_ms, out)   # R4b: before the orders it changes
        self.orders.reconcile(out)
        self.capability.broadcast_if_running_changed(self.liveness.last_tick_ms, out)
        for key, claim in self.ledger.take_journal():
            mine = self.bidding.mine.get(key) if claim is not None else None
            out.persist.append(self._reservation_record(key, claim, mine[1] if mine and mine[0] == "bid" else None))
        floor = self.capability.seq_floor_record()
        if floor is not None:
            out.persist.append(floor)
        return out

    def tick(self, now_ms: int) -> Ready:
        out = Ready()
        self.liveness.tick(now_ms, out)
        self.instance_table.run_timers(now_ms, out)
        self.bidding.scheduling.admission.admit(now_ms, out)   # Q2b: before held bids are decided afresh
        self.placement.reconsider_held(now_ms, out)
        self.preemptions.consider(now_ms, out)
        self.gangs.reconsider_held(now_ms, out)
        for key in self.ledger.expire(now_ms):
            self.bidding.mine.pop(key, None)   # its bid holds nothing any more: never re-sent
            out.events.append(self.ctx.event("reservation_expired", now_ms, instance=key.hex()))
        if self._refuse_after_sync and not self.liveness.startup_sync_due and not self.liveness.halted:
            self._refuse_unfit_after_restart(now_ms, out)
        if self.lifecycle.own_outcomes_replayed and not self.liveness.startup_sync_due:
            self.lifecycle.resend_own_outcomes(out)   # 6.9a
        self.lifecycle.end_handoff_waits(now_ms, out)
        self.lifecycle.end_stop_waits(now_ms, out)
        self.lifecycle.resend_handovers(now_ms, out)
        self.instance_table.prune_timers()
        return self._with_orders(out)

    def next_tick_ms(self, now_ms: int) -> int:
        """When ``tick`` next has work (SPEC F3a), for a driver that ticks only then (issue 18:
        a 5 ms loop was most of an idle node's CPU, and 12.8% of a placing one's): the earliest
        deadline of its timers (liveness's, the consensus instances' round timeouts and bid
        windows, a restored reservation's expiry, a hand-off awaited, the preemption scan), or
        ``now_ms`` when an input left work for the tick (capacity changed under a placement
        this node declined, P3a; jobs to refuse once the restart sync answered). A later call,
        after any other input, may answer earlier: the driver asks again after each input."""
        liveness = self.liveness
        if self._refuse_after_sync and not liveness.startup_sync_due and not liveness.halted:
            return now_ms
        if (self.placement.reconsider_due() or self.gangs.reconsider_due()
                or self.lifecycle.stop_wait_ended()):
            return now_ms
        due = liveness.next_due_ms(now_ms)
        for deadline in (self.instance_table.next_timer_ms(), self.ledger.next_expiry_ms(),
                         self.lifecycle.next_wait_ms(), self.lifecycle.next_resend_ms(),   # R2a
                         self.preemptions.next_scan_ms_if_needed()):
            if deadline is not None:
                due = min(due, deadline)
        return max(now_ms, due)

    def submit(self, job_envelope: bytes, now_ms: int, max_undecided: int = 0) -> Ready:
        """A signed job from a local owner (SPEC P2); refused with SubmitOverloaded while
        ``max_undecided`` (> 0) jobs submitted here are undecided (SPEC 10.5)."""
        return self._with_orders(self.placement.submit(job_envelope, now_ms, max_undecided))

    def cancel(self, request: bytes, now_ms: int) -> tuple[bytes, Ready]:
        """An owner-signed Cancel envelope: stop and forget the job everywhere."""
        jid, out = self.lifecycle.cancel(request, now_ms)
        return jid, self._with_orders(out)

    def request_move(self, request: bytes, now_ms: int) -> tuple[bytes, Ready]:
        """An owner-signed MoveRequest envelope (SPEC.md R2): refused with its reason
        (RemoteProtocolError) when the move cannot happen, else broadcast and decided."""
        jid, out = self.moves.request(request, now_ms)
        return jid, self._with_orders(out)

    def hand_over_moved(self, jid: bytes, fence: int, final: tuple | None, now_ms: int) -> Ready:
        """The driver stopped the run of ``jid`` under ``fence`` (``final``: the state it read
        as it stopped): if a move took the job away, its final checkpoint goes to the new primary."""
        return self._with_orders(self.lifecycle.hand_over_moved(jid, fence, final, now_ms))

    def update_telemetry(self, gpus: tuple, rtt_us: int, now_ms: int, *, simulated: bool = False,
                         fault: str = "", job_signals: tuple = ()) -> Ready:
        """GPU readings (or, with ``fault``, why they failed: the last good ones stay), mean RTT,
        and the load the jobs running here reported (JobSignals, R3a)."""
        out = self.capability.update_telemetry(gpus, rtt_us, now_ms, simulated=simulated, fault=fault,
                                               job_signals=job_signals)
        self.moves.notice_reflexes(self.me, now_ms, out)   # R3: the primary may notice its own
        self.replicas.notice(self.me, now_ms, out)         # R4
        self.gang_resizes.notice(now_ms, out)              # GA9
        return self._with_orders(out)

    def _on_quota_grant(self, envelope, grant, data, now_ms: int, out: Ready) -> None:
        """Q2b: a quota home's grant; the job's leader may propose with it (Q2c)."""
        if self.bidding.scheduling.admission.on_grant(envelope, grant, data, now_ms, out):
            self.placement.on_grant(grant.job_id, now_ms, out)

    def _restore_quota_grants(self, job_outcomes: Iterable[bytes], now_ms: int) -> list[bytes]:
        """The persisted grants (kept beside the outcomes in table ``jobs``) taken back; the
        other outcomes returned for the lifecycle to replay."""
        others = []
        for data in job_outcomes:
            try:
                envelope, message = decode_message(data, self.mesh_id, caches=self.ctx.caches)
            except RemoteProtocolError:
                others.append(data)   # counted as a bad outcome there
                continue
            if isinstance(message, QuotaGrant):
                try:
                    self.bidding.scheduling.admission.on_grant(envelope, message, data, now_ms, Ready())
                except RemoteProtocolError:
                    self.counters["bad_job_outcome"] += 1
            else:
                others.append(data)
        return others

    def _on_capability(self, envelope, cap, data, now_ms: int, out: Ready) -> None:
        self.capability.on_capability(envelope, cap, data, now_ms, out)
        self.lifecycle.on_vector(envelope.signer, now_ms)   # R2a: a new primary waiting again
        self.moves.notice_reflexes(envelope.signer, now_ms, out)   # R3
        self.replicas.notice(envelope.signer, now_ms, out)         # R4
        self.gang_resizes.notice(now_ms, out)                      # GA9

    def _on_sync_request(self, envelope, request, data, now_ms: int, out: Ready) -> None:
        self.liveness.on_sync_request(envelope, request, data, now_ms, out)
        self.capability.send_newest_to(envelope.signer, out)   # F6a
        self.lifecycle.on_vector(envelope.signer, now_ms, syncing=True)   # R2b: a restarted new primary

    def _on_job_end(self, envelope, message, data, now_ms: int, out: Ready) -> None:
        """A job_exit or job_refusal: of a replica (its key, R4h), or of a job (P6, R1)."""
        if self.replicas.on_replica_end(envelope, message, data, now_ms, out):
            return
        handler = self.lifecycle.on_job_exit if isinstance(message, JobExit) else self.lifecycle.on_job_refusal
        handler(envelope, message, data, now_ms, out)

    def workload_started(self, jid: bytes, fence: int, from_seq: int, now_ms: int) -> Ready:
        return self._with_orders(self.lifecycle.workload_started(jid, fence, from_seq, now_ms))

    def local_checkpoint(self, jid: bytes, seq: int, progress: int, taken_ms: int, state: bytes,
                         now_ms: int) -> Ready:
        return self._with_orders(self.lifecycle.local_checkpoint(jid, seq, progress, taken_ms, state, now_ms))

    def job_exited(self, jid: bytes, exit_code: int, now_ms: int) -> Ready:
        """The workload ran out here (or could not start: the driver reports 127)."""
        self.orders.exited(jid)
        out = Ready()
        if self.replicas.exited(jid, exit_code, now_ms, out):   # R4: a replica's run, not a job's
            return self._with_orders(out)
        return self._with_orders(self.lifecycle.job_exited(jid, exit_code, now_ms))

    def request_join(self, bootstrap_key: bytes, now_ms: int) -> Ready:
        return self.joins.request_join(bootstrap_key, now_ms)

    # --- consensus messages -------------------------------------------------------------------
    def _on_consensus(self, envelope, message, data, now_ms: int, out: Ready) -> None:
        iid = message.instance
        table = self.instance_table
        if isinstance(message, Proposal):
            flow = self.flows.get(message.value_kind)
            limit = flow.max_justification if flow is not None else MAX_BIDS_PER_PROPOSAL + 1
            if limit is not None and len(message.justification) > limit:
                raise RemoteProtocolError("only a slot proposal carries more than %d bids (P7b)"
                                          % MAX_BIDS_PER_PROPOSAL)
        inst = table.live_or_decided(iid)
        if inst is None and isinstance(message, Proposal):
            inst = self._instance_from_proposal(message, now_ms, out)
        if isinstance(message, CommitCertificate) and inst is None:
            # No instance here: a certificate valid for its own epoch is the decision.
            self._apply_certificate_bytes(data, now_ms, out)
            return
        if inst is None:
            table.answer_applied(iid, envelope.signer, message.round, out)
            table.hold(iid, envelope, message, data)
            return
        table.drive(inst, inst.on_message(envelope, message, now_ms, data), now_ms, out)

    def _deliver_held(self, envelope, message, data, now_ms: int, out: Ready) -> None:
        """A message held for an instance that now runs, as if it arrived now."""
        if isinstance(message, Bid):
            try:
                self.bidding.on_bid(envelope, message, data, now_ms, out)
            except RemoteProtocolError:
                # A held bid is remote input checked only now (e.g. one for an older
                # epoch): it is dropped like any bad bid, never raised to our caller.
                self.counters["rejected_bid"] += 1
        else:
            self._on_consensus(envelope, message, data, now_ms, out)

    def _instance_from_proposal(self, proposal: Proposal, now_ms: int, out: Ready):
        """A proposal for an instance we have not started carries all we need to validate it."""
        view = self.epochs.view_for(proposal.epoch)
        if view is None:
            self.counters["unknown_epoch"] += 1
            return None
        value = decode_value(proposal.value_kind, proposal.value, caches=self.ctx.caches)
        return self.flows[proposal.value_kind].instance_from_proposal(proposal, value, view, now_ms, out)

    # --- decisions ----------------------------------------------------------------------------
    def _apply_certificate_bytes(self, data: bytes, now_ms: int, out: Ready, persist: bool = True) -> bool:
        """Apply a commit certificate that arrived without a live instance (catch-up, sync,
        replay). Returns False if its epoch is not known yet (the caller may retry later)."""
        envelope, cert = decode_message(data, self.mesh_id, expect=CommitCertificate, caches=self.ctx.caches)
        table = self.instance_table
        if cert.instance in table.applied:
            self.counters["already_decided"] += 1
            return True
        view = self.epochs.view_for(cert.epoch)
        if view is None:
            if cert.epoch > self.epoch:
                self.epochs.hold_future_certificate(cert.epoch, envelope.signer, data)
                return False
            self.counters["unknown_epoch"] += 1
            return True
        verify_commit_certificate(data, self.mesh_id, view, caches=self.ctx.caches)
        position = len(out.persist)
        if not self._apply_certified(cert.value_kind, cert.instance, cert.value, data, cert.epoch, now_ms, out):
            return True   # refused: not even persisted, or a restart would replay (and store) a forgery
        if persist:   # first, before what applying it persisted (a restart replays it first)
            out.persist.insert(position, self._certificate_record(cert, data))
        inst = table.get(cert.instance)
        if inst is not None:  # our own instance lagged behind: it is decided now
            table.drive(inst, inst.on_message(envelope, cert, now_ms, data), now_ms, Ready())
        return True

    @staticmethod
    def _certificate_record(cert: CommitCertificate, data: bytes) -> PersistRecord:
        return PersistRecord("certificates", cert.instance.hex(), {
            "instance": cert.instance, "value_kind": cert.value_kind, "round": cert.round, "certificate": data})

    def _apply_certified(self, value_kind: str, iid: bytes, value_bytes: bytes, certificate: bytes, epoch: int,
                         now_ms: int, out: Ready) -> bool:
        """Apply a decision of ``epoch``; False if it was refused (or applied before)."""
        table = self.instance_table
        if iid in table.applied:
            return False
        value = decode_value(value_kind, value_bytes, caches=self.ctx.caches)
        flow = self.flows[value_kind]
        if flow.binding_error(iid, value_kind, value, epoch) is not None:
            # Only a quorum with more than a third of Byzantine stake signs one (every honest
            # voter checks it, P4b, P7), or a relabelled certificate (flows/binding.py): it
            # changes nothing (P2, one epoch per instance; F4, one change per epoch).
            self.counters["placement_certificate_wrong_epoch" if flow.places_jobs
                          else "epoch_change_certificate_unbound"] += 1
            return False
        table.mark_applied(iid, certificate)
        flow.apply(iid, value_kind, value, certificate, epoch, now_ms, out)
        if value_kind != "membership":
            self.capability.relearn_running()
        out.decisions.append(Decision(value_kind, iid, value, certificate))
        return True

    # --- the ledger after a restart (SPEC.md R1) ---------------------------------------------------
    @staticmethod
    def _reservation_record(key: bytes, claim, bid: bytes | None) -> PersistRecord:
        """A bid's reservation (``held`` 1) and the bid, or its end (``held`` 0: released or
        allocated). A restarted node re-sends that same bid: one made afresh could not name
        the GPUs its own reservation holds (P4: they are not free in its vector)."""
        if claim is None:
            return PersistRecord("reservations", key.hex(), {"instance": key, "held": 0})
        return PersistRecord("reservations", key.hex(), {
            "instance": key, "held": 1, "gpus": list(claim.gpus), "gpu_mem_mib": claim.gpu_mem_mib,
            "gpu_milli": claim.gpu_milli, "cpu_milli": claim.cpu_milli, "mem_mib": claim.mem_mib, "bid": bid or b""})

    def _rebuild_ledger(self, reservations: list, now_ms: int) -> None:
        """R1 after a restart: allocate every live job this node is the primary of (on the
        GPUs it held), then hold again what its persisted bids reserved and no decision it
        knows of has settled. A bid whose instance does not run here again within its lifetime
        is released then (its deadline); a job that no longer fits is refused once the
        restart's sync has answered (``tick``): the node never runs it."""
        ledger, jobs, bidding = self.ledger, self.job_table, self.bidding
        ledger.clear()
        for record in jobs.mine():
            if record.state not in LIVE_JOB_STATES:
                continue
            claim = ledger.allocate_now(record.job_id, record.manifest.resources, prefer=tuple(record.gpus))
            if claim is None:
                self._refuse_after_sync.append(record.job_id)
            else:
                record.gpus = claim.gpus
        self.replicas.rebuild_claims()   # R4: the replicas it holds, after its primaries
        deadline = now_ms + BID_LIFETIME_ROUNDS * self.params.round_timeout_max_ms
        applied, gone = self.instance_table.applied, []
        for persisted in reservations:
            value = persisted.value
            key = value.get("instance")
            if not isinstance(key, bytes) or not value.get("held") or key in applied:
                continue
            record = jobs.get(key)   # a job id: a first attempt's (or its slot's) bid
            if record is not None and record.state != "pending":
                gone.append(key)
                continue
            gpus = tuple(value.get("gpus") or ())
            gpu_milli = value.get("gpu_milli") or 0   # absent in a row written before shares: whole GPUs
            wanted = Resources(gpus=len(gpus), gpu_mem_mib=value.get("gpu_mem_mib", 0),
                               cpu_milli=value.get("cpu_milli", 0), mem_mib=value.get("mem_mib", 0),
                               gpu_milli=gpu_milli if len(gpus) == 1 else 0)
            if ledger.reserve(key, wanted, expires_ms=deadline, prefer=gpus) is None:
                gone.append(key)
            elif value.get("bid"):
                bidding.mine[key] = ("bid", value["bid"])
        # Bids a replayed retry made before the rebuild hold nothing now: made afresh when asked.
        for key, (kind, _data) in list(bidding.mine.items()):
            if kind == "bid" and ledger.reserved(key) is None:
                del bidding.mine[key]
        ledger.take_journal()   # what it holds again is on disk already (bid included)
        ledger.journal.extend((key, None) for key in gone)

    def _refuse_unfit_after_restart(self, now_ms: int, out: Ready) -> None:
        for jid in self._refuse_after_sync:
            record = self.job_table.get(jid)
            if (record is not None and record.primary == self.me and record.state in LIVE_JOB_STATES
                    and self.ledger.allocated(jid) is None):
                self.lifecycle.admit(record, None, now_ms, out)   # room now, or it is refused
        self._refuse_after_sync = []

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
        self.epochs.future_certificates.clear()
        self.instance_table.pending.clear()
