"""The instance table: every consensus instance of one node, from start to retirement
(SPEC.md 6, 6.8, 6.9), and the timers that drive them.

Each instance runs for one flow (protocol/flows/) and one subject of that flow (a job id,
a slot, an epoch): the pair is the instance's ``InstanceRole``, and the table asks the
flow, never a kind string, what to do when the instance awaits a value, changes round,
closes a bid window, gives up or is dropped. Decisions go to the ``apply_decision``
callback the core gives it (protocol/mesh.py), which checks and applies them.

Safety across restarts and re-creations: an instance dropped or given up keeps what it
signed (``restored_votes``), and a new object for the same id resumes from it, exactly as
after a restart, so it never signs a second proposal or vote for a round.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Callable, NamedTuple

from protocol.consensus import ConsensusInstance
from protocol.errors import RemoteProtocolError
from protocol.messages import Bid
from protocol.quorum import EpochView
from protocol.ready import Outbound, PersistRecord, Ready

MAX_ACTIVE_INSTANCES = 8192      # undecided instances at once; a job beyond it waits for a resubmit
# A held round (a flow with nothing to decide, ValueFlow.round_on_hold) is asked again this
# often: once the hold ends, the round times out then and the next one starts as usual.
HOLD_RECHECK_MS = 500
MAX_DECIDED_KEPT = 256           # decided instances kept to answer stragglers (SPEC.md 6.8)
MAX_PENDING_INSTANCES = 512      # instances we hold early messages for
MAX_PENDING_PER_INSTANCE = 64
MAX_APPLIED_KEPT = 1 << 16       # instance ids whose decision we applied
MAX_CATCH_UP_REPLIES = 4096      # (peer, instance, round) answered with an applied certificate, then forgotten
MAX_EVIDENCE_KEPT = 256
SAFETY_TABLES = ("votes", "locks", "evidence")   # what ConsensusInstance.restore reads back
# SPEC.md 6.12, the adapted round timeout: 4 times the 90th percentile of the last 32
# decisions (each timed from the start of the round that decided), never under the genesis
# round_timeout_ms nor over the flow's cap: twice it for a placement (4 times lengthened the
# recovery of a placement whose round-0 leader failed: BENCHMARKS.md, "Fewer hops"), 8 times
# for a slot (6.12a: a loaded n = 16 mesh took over a second per slot, and slots that timed
# out at 220 ms re-ran every round of every slot, issue 18).
DECISION_TIME_SAMPLES = 32
DECISION_TIME_FACTOR = 4
ADAPTED_TIMEOUT_MAX_FACTOR = 2


class DecisionTimes:
    """How long this node's round-0 decisions of adapting flows took, creation to decision:
    a round timeout shorter than a loaded mesh's normal decision time only starts rounds
    that cannot finish either (each round change costs a message to every leader-to-be)."""

    def __init__(self) -> None:
        self.samples: deque[int] = deque(maxlen=DECISION_TIME_SAMPLES)

    def add(self, elapsed_ms: int) -> None:
        self.samples.append(max(0, elapsed_ms))

    def round_timeout_ms(self, genesis_timeout_ms: int, max_factor: int = ADAPTED_TIMEOUT_MAX_FACTOR) -> int:
        if not self.samples:
            return genesis_timeout_ms
        ordered = sorted(self.samples)
        p90 = ordered[-(-9 * len(ordered) // 10) - 1]   # nearest rank: ceil(0.9 n)
        adapted = max(genesis_timeout_ms, DECISION_TIME_FACTOR * p90)
        return min(adapted, max_factor * genesis_timeout_ms)


class InstanceRole(NamedTuple):
    flow: object      # the ValueFlow that runs it (protocol/flows/base.py)
    subject: object   # what it decides, in that flow's terms: a job id, (epoch, slot), None


class InstanceTable:
    def __init__(self, ctx, epochs, apply_decision: Callable, deliver_held: Callable, safety_records=()) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.apply_decision = apply_decision   # (kind, iid, value bytes, certificate, epoch, now_ms, out) -> bool
        # (envelope, message, data, now_ms, out): a message held for an instance, once it runs
        self.deliver_held = deliver_held
        self.instances: dict[bytes, ConsensusInstance] = {}
        self.decided: OrderedDict[bytes, ConsensusInstance] = OrderedDict()
        self.applied: OrderedDict[bytes, None] = OrderedDict()   # instances whose decision we applied
        self.recent_certificates: OrderedDict[bytes, bytes] = OrderedDict()  # applied instance -> certificate
        self.roles: dict[bytes, InstanceRole] = {}
        self.round_entered_ms: dict[bytes, int] = {}  # live instance -> when it entered its round here
        self.decision_times: dict[str, DecisionTimes] = {}   # per adapting flow's value kind (6.12)
        self.rounds: dict[bytes, int] = {}       # the round each live instance was last seen in
        self.pending: OrderedDict[bytes, list] = OrderedDict()   # early messages for unknown instances
        self.timers: list[tuple[int, int, str, bytes]] = []      # (due_ms, seq, what, instance)
        self.timer_seq = 0
        self.restored_votes: dict[bytes, list[PersistRecord]] = {}  # undecided instance -> its records
        self.catch_up_sent: set[tuple] = set()      # (peer, instance, round) answered with a certificate
        self.evidence: list = []
        self.evidence_log: list[dict] = []
        self.safety_records = list(safety_records)

    def restore_safety_records(self) -> None:
        """After the history replay: the persisted votes of instances still undecided."""
        for record in self.safety_records:
            iid = record.value.get("instance")
            if record.table in SAFETY_TABLES and isinstance(iid, bytes) and iid not in self.applied:
                self.restored_votes.setdefault(iid, []).append(record)
        self.safety_records = []

    def get(self, iid: bytes) -> ConsensusInstance | None:
        return self.instances.get(iid)

    def live_or_decided(self, iid: bytes) -> ConsensusInstance | None:
        return self.instances.get(iid) or self.decided.get(iid)

    def role(self, iid: bytes) -> InstanceRole | None:
        return self.roles.get(iid)

    def is_done(self, iid: bytes) -> bool:
        return iid in self.instances or iid in self.decided or iid in self.applied

    # --- timers --------------------------------------------------------------------------------
    def schedule(self, inst: ConsensusInstance, what: str = "deadline", due_ms: int | None = None) -> None:
        due = inst.deadline_ms if due_ms is None else due_ms
        if due is not None:
            self.timer_seq += 1
            heapq.heappush(self.timers, (due, self.timer_seq, what, inst.instance_id))

    def run_timers(self, now_ms: int, out: Ready) -> None:
        while self.timers and self.timers[0][0] <= now_ms:
            _, _, what, iid = heapq.heappop(self.timers)
            inst = self.instances.get(iid)
            if inst is None:
                continue
            if what == "deadline":
                deadline = inst.deadline_ms
                if deadline is not None and deadline <= now_ms and self.roles[iid].flow.round_on_hold(inst, now_ms):
                    inst.hold_round(now_ms, HOLD_RECHECK_MS)
                    self.schedule(inst)
                elif deadline is not None and deadline <= now_ms:
                    self.drive(inst, inst.tick(now_ms), now_ms, out)
                else:
                    self.schedule(inst)
            else:  # "bid_window"
                self.roles[iid].flow.on_bid_window_closed(inst, now_ms, out)

    def next_timer_ms(self) -> int | None:
        """The earliest timer (a stale one, of an instance gone, only costs an early tick)."""
        return self.timers[0][0] if self.timers else None

    def prune_timers(self) -> None:
        if len(self.timers) > 4 * (len(self.instances) + 64):  # lazy heap: drop stale entries
            self.timers = [t for t in self.timers if t[3] in self.instances]
            heapq.heapify(self.timers)

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self, iid: bytes, flow, subject, view: EpochView, now_ms: int, out: Ready) -> ConsensusInstance | None:
        """Create and start the instance ``iid`` of ``flow`` deciding ``subject`` (None when it
        ran here before, or too many run), then hand it the messages held for it."""
        if self.is_done(iid):
            return self.instances.get(iid)
        if len(self.instances) >= MAX_ACTIVE_INSTANCES:
            self.ctx.counters["too_many_instances"] += 1
            return None
        restored = self.restored_votes.get(iid)
        if any(r.value.get("epoch", view.epoch) != view.epoch for r in restored or ()):
            # One instance id runs in one epoch (SPEC.md P2, F4): records of another epoch are
            # not ours to resume here, and voting afresh beside them could sign twice.
            self.ctx.counters["records_of_another_epoch"] += 1
            return None
        params = self.ctx.params
        validate, other_kinds = flow.validators(iid)
        round_timeout_ms = params.round_timeout_ms
        timing = flow.timed_as(subject)
        if timing.adapts_round_timeout:
            round_timeout_ms = self.decision_times_of(timing).round_timeout_ms(round_timeout_ms,
                                                                               timing.adapted_timeout_max_factor)
        inst = ConsensusInstance(instance_id=iid, value_kind=flow.value_kind, view=view, identity=self.ctx.identity,
                                 mesh_id=self.ctx.mesh_id,
                                 round_timeout_ms=round_timeout_ms + flow.round_timeout_extra_ms,
                                 round_timeout_max_ms=params.round_timeout_max_ms,
                                 max_rounds=flow.max_rounds_for(iid) or params.max_rounds, validate=validate, now_ms=now_ms,
                                 other_kinds=other_kinds, caches=self.ctx.caches)
        inst.dropped = self.ctx.counters  # one Counter of drop reasons for the whole node
        inst.other_views = self.epochs.views  # other epochs' equivocation is evidence too (SPEC.md 6.10)
        if restored:
            try:
                inst.restore(restored)
            except RemoteProtocolError:
                self.ctx.counters["bad_safety_record"] += 1
        self.instances[iid] = inst
        self.roles[iid] = InstanceRole(flow, subject)
        self.round_entered_ms[iid] = now_ms
        self.rounds[iid] = inst.round
        self.drive(inst, inst.start(now_ms), now_ms, out)
        for envelope, message, data in self.pending.pop(iid, ()):
            if isinstance(message, Bid) or iid in self.instances:  # as if it arrived now
                self.deliver_held(envelope, message, data, now_ms, out)
        return self.instances.get(iid, inst)

    def decision_times_of(self, flow) -> DecisionTimes:
        return self.decision_times.setdefault(flow.value_kind, DecisionTimes())

    def drive(self, inst: ConsensusInstance, ready: Ready, now_ms: int, out: Ready) -> None:
        """Fold an instance's output into ``out``: apply decisions, let the flow follow round
        changes and requests for a value, keep timers and evidence."""
        iid = inst.instance_id
        out.persist.extend(ready.persist)
        if inst.view.epoch == self.epochs.epoch:
            out.messages.extend(ready.messages)
        else:
            out.messages.extend(self._to_epoch_members(inst.view, ready.messages))
        for event in ready.events:
            out.events.append(event)
            if event.kind == "evidence" and inst.evidence:
                self._remember_evidence(inst.evidence[-1], event)
        if inst.decision is not None and self.instances.get(iid) is inst:
            # Before applying: applying a slot starts its late jobs' instances, timed by these
            # samples (6.12b), and a mesh's first slot would otherwise leave them at G.
            self._sample_decision_time(inst, now_ms)
        for decision in ready.decisions:
            self.apply_decision(decision.value_kind, iid, decision.value, decision.certificate, inst.view.epoch,
                                now_ms, out)
        if inst.decision is not None or inst.gave_up:
            self.retire(inst, now_ms, out)
            return
        flow = self.roles[iid].flow
        if inst.round != self.rounds.get(iid):
            self.rounds[iid] = inst.round
            self.round_entered_ms[iid] = now_ms
            flow.on_round_changed(inst, now_ms, out)
        if inst.awaiting_value:
            flow.on_awaiting_value(inst, now_ms, out)
        self.schedule(inst)

    def _to_epoch_members(self, view: EpochView, messages: list) -> list:
        """An instance of an older epoch (a placement that names it, P2; an evicted node's kept
        one, F7) broadcasts to that epoch's members and the current ones: ``Outbound(to=None)``
        reaches only the current epoch's, a member the epoch change removed may hold the stake
        the instance needs for a quorum, and one admitted since must learn the decision."""
        members = sorted((set(view.members) | set(self.epochs.view.members)) - {self.ctx.me})
        routed = []
        for message in messages:
            if message.to is None:
                routed.extend(Outbound(key, message.data) for key in members)
            else:
                routed.append(message)
        return routed

    def forget(self, iid: bytes) -> None:
        """Drop an undecided instance object, keeping what it signed: should the instance be
        started again in this run (a proposal or held message for it), the new object resumes
        from these records exactly as after a restart, and never signs a second proposal or
        vote for a round (the 10,000-seed sweep caught one: seed 7105)."""
        inst = self.instances.pop(iid)
        records = inst.safety_records()
        if records:
            self._keep_safety_records(iid, records)
        self.roles.pop(iid, None)
        self.rounds.pop(iid, None)
        self.round_entered_ms.pop(iid, None)

    def _keep_safety_records(self, iid: bytes, records: list) -> None:
        """Add to what a re-created instance restores, upserted by (table, key) as on disk: a
        later lock replaces the earlier one, and an instance dropped and re-created again and
        again does not pile up copies of its votes."""
        kept = {(r.table, r.key): r for r in self.restored_votes.get(iid, ())}
        kept.update(((r.table, r.key), r) for r in records)
        self.restored_votes[iid] = list(kept.values())

    def _sample_decision_time(self, inst: ConsensusInstance, now_ms: int) -> None:
        """SPEC.md 6.12, 6.12a: a decision in the round this node was in is a sample of its flow's
        decision time (6.12b: of the flow it is timed as)."""
        role = self.roles[inst.instance_id]
        timing = role.flow.timed_as(role.subject)
        if timing.adapts_round_timeout and inst.decision.round == inst.round:
            # Timed from the start of the round that decided (round 0: the creation): under
            # load most slots decided in a later round, so round-0 samples alone never came.
            self.decision_times_of(timing).add(now_ms - self.round_entered_ms.get(inst.instance_id, now_ms))

    def retire(self, inst: ConsensusInstance, now_ms: int, out: Ready) -> None:
        iid = inst.instance_id
        if self.instances.pop(iid, None) is None:
            return
        self.rounds.pop(iid, None)
        role = self.roles.pop(iid)
        self.round_entered_ms.pop(iid, None)
        if inst.gave_up and inst.decision is None:
            # Undecided: should it be created again once it left `decided` (a proposal, a
            # resubmit), it must resume from what it signed, as after a restart (SPEC.md 6.9).
            self._keep_safety_records(iid, inst.safety_records())
            role.flow.on_gave_up(iid, role.subject, now_ms, out)
        else:
            self.restored_votes.pop(iid, None)  # a decided instance is never voted in again
        self.decided[iid] = inst
        while len(self.decided) > MAX_DECIDED_KEPT:
            self.decided.popitem(last=False)

    def drop_all_but(self, keep: bytes) -> None:
        """An evicted node drops the open instances only it runs: they would only time out
        and broadcast round changes. It keeps those other members take part in: they run in
        an epoch where its stake still counts, and without its votes and round changes the
        rest may hold no quorum there (the 10,000-seed sweep stalled on exactly that)."""
        for iid in [i for i in self.instances if i != keep]:
            inst = self.instances[iid]
            if self.ctx.me in inst.view.stakes and inst.heard_from_others:
                continue
            flow = self.roles[iid].flow
            self.forget(iid)
            flow.on_dropped(iid)

    def skip_round(self, inst: ConsensusInstance, now_ms: int, out: Ready) -> None:
        """Enter the instance's next round (always safe: it signs nothing, SPEC F4)."""
        if inst.decision is None and not inst.gave_up and self.instances.get(inst.instance_id) is inst:
            self.drive(inst, inst.enter_round(inst.round + 1, now_ms), now_ms, out)

    # --- decided instances and early messages ----------------------------------------------------
    def mark_applied(self, iid: bytes, certificate: bytes) -> None:
        self.applied[iid] = None
        while len(self.applied) > MAX_APPLIED_KEPT:
            self.applied.popitem(last=False)
        self.recent_certificates[iid] = certificate
        while len(self.recent_certificates) > MAX_DECIDED_KEPT:
            self.recent_certificates.popitem(last=False)

    def answer_applied(self, iid: bytes, peer: bytes, round: int, out: Ready) -> None:
        """SPEC.md 6.8 for a decision applied without a live instance (replayed after a restart,
        learnt by catch-up or sync): a peer still voting on it gets the certificate, once per
        (peer, instance, round), instead of silence."""
        certificate = self.recent_certificates.get(iid)
        key = (peer, iid, round)
        if certificate is None or peer == self.ctx.me or key in self.catch_up_sent:
            return
        if len(self.catch_up_sent) >= MAX_CATCH_UP_REPLIES:
            self.catch_up_sent.clear()
        self.catch_up_sent.add(key)
        out.messages.append(Outbound(peer, certificate))

    def hold(self, iid: bytes, envelope, message, data: bytes) -> None:
        """Keep an early message until its instance exists (the job, suspicion or join that
        creates it may arrive after a faster peer's vote or bid)."""
        if iid in self.applied:
            self.ctx.counters["already_decided"] += 1
            return
        held = self.pending.get(iid)
        if held is None:
            if len(self.pending) >= MAX_PENDING_INSTANCES:
                self.pending.popitem(last=False)
                self.ctx.counters["pending_evicted"] += 1
            held = self.pending[iid] = []
        if len(held) >= MAX_PENDING_PER_INSTANCE:
            self.ctx.counters["pending_full"] += 1
            return
        held.append((envelope, message, data))

    def _remember_evidence(self, evidence, event) -> None:
        if len(self.evidence) < MAX_EVIDENCE_KEPT:
            self.evidence.append(evidence)
            self.evidence_log.append({"offender": evidence.offender, "kind": event.detail.get("kind", ""),
                                      "at_ms": event.at_ms})
