"""Capability vectors (SPEC.md P1): this node's own, signed afresh only when its facts
change, and the newest one of every peer.

A bid carries its bidder's vector, so most bids reuse one signature. Peers' vectors also
report which jobs they run as primary and how old the newest checkpoint is, which lets
every member show a job running, not only the backups that hold its checkpoints.
"""

from __future__ import annotations

from protocol.messages import MAX_RUNNING_LISTED, CapabilityVector, GpuState, JobSignals, RunningJob
from protocol.placement import attested_attributes, gpu_healthy
from protocol.ready import Outbound, PersistRecord, Ready
from protocol.reflexes import Readings, VectorHistory, condition_holds, cooldown_bounds, holding_run

# Unchanged, the vector is re-signed and broadcast this often: peers' copies are display
# state (P1), and a refresh every second cost every node n - 1 signed messages out and in per
# second while idle (BENCHMARKS.md, issue 18). What placement and Q4 read (free resources,
# jobs running, epoch, GPU health) goes out as soon as it changes.
CAPABILITY_REFRESH_MS = 10_000
# ... but every second while this node runs a job: its vectors are then evidence others
# read -- a reflex's condition held for its duration (R3), the checkpoint age that picks a
# preemption's victims (P8) -- and an idle mesh still pays the 10 s rate only.
CAPABILITY_REFRESH_BUSY_MS = 1000
# While a job with reflex rules runs here its GPUs are read this often (P1b): a rule's
# condition is then seen within this long of its start, and the vector completing its
# evidence within this long of the rule's duration, where a 1 s reading cadence added up to
# 1 s to both. Only a reading that changes a broadcast fact, crosses a rule's threshold or
# completes a duration is signed: drift between crossings sends nothing.
REFLEX_READING_MS = 100
RUNNING_REPORT_GAP_MS = 100      # a change of the jobs running here is broadcast at most this often
# Peers keep a vector only if its seq is higher than the one they hold (P1), so a restarted
# node must not count from 0 again: it persists a floor this far ahead of what it signs,
# and a restart starts from the floor (one write per this many vectors, not one each).
SEQ_BLOCK = 1024


class CapabilityBook:
    def __init__(self, ctx, epochs, jobs, ledger, seq_floor: int = 0) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self._running: tuple = ()                     # _running_here()'s answer, sorted by job id
        self._running_fences: dict[bytes, int] = {}   # ... as a map, kept from the jobs that changed
        self._jobs_changed = jobs.changes_feed()
        self.ledger = ledger
        self.envelope: bytes | None = None          # our newest signed vector
        self.vector: CapabilityVector | None = None
        self.facts: tuple | None = None              # what it was signed for
        self.broadcast_ms: int | None = None
        self.broadcast_facts: tuple | None = None    # _broadcast_facts() when it was last broadcast
        self.seq = max(0, seq_floor)     # the last seq that may have been signed before a restart
        self.seq_persisted = self.seq    # what a restart would start from
        self.telemetry_gpus: tuple = ()
        self.telemetry_simulated = False
        # Why the last GPU reading failed ("" while readings succeed): the vector keeps the last
        # good readings, stale, and this node declines GPU jobs `node_unhealthy` (SPEC.md P3).
        self.telemetry_fault = ""
        self.job_signals: dict[bytes, JobSignals] = {}   # the load each job here last reported (R3a)
        self.rtt_us = 0
        self.peers: dict[bytes, CapabilityVector] = {}
        self.peer_envelopes: dict[bytes, bytes] = {}   # the same vectors as signed: proofs in move (R2) and preemption (P8) values
        self.unsent = False   # our newest vector was signed for a move value (R2) and not broadcast yet
        self.history = VectorHistory()   # every member's newest vectors: a reflex's evidence (R3)
        self.watches = lambda node: False   # set by the core: a replica's node, read by replica rules (R4g)
        self.peers_version = 0                         # bumps with every newer peer vector kept
        self.own_attested = dict(attested_attributes(ctx.policy.attestations, ctx.me, ctx.mesh_id,
                                                     ctx.authorities, 0, caches=ctx.caches))

    def summary(self, key: bytes) -> dict | None:
        cap = self.vector if key == self.ctx.me else self.peers.get(key)
        if cap is None:
            return None
        return {"seq": cap.seq, "taken_ms": cap.taken_ms, "zone": cap.zone, "gpus": len(cap.gpus),
                "gpus_free": list(cap.gpus_free), "gpu_milli_free": list(cap.gpu_milli_free),
                "cpu_milli_free": cap.cpu_milli_free,
                "mem_mib_free": cap.mem_mib_free, "simulated": cap.simulated,
                "gpu_models": sorted({g.model for g in cap.gpus})}

    def signed_vector(self, key: bytes, now_ms: int) -> tuple[bytes, CapabilityVector] | None:
        """The newest signed vector of ``key`` (this node's own, current), as (envelope, vector).
        Our own, when signed anew for it, goes out with the next Ready (broadcast_if_running_changed):
        what it says (the jobs running here above all) would otherwise reach peers only at
        the next refresh, since a change already signed is not broadcast again."""
        if key == self.ctx.me:
            envelope, cap, signed = self.current(now_ms)
            self.unsent = self.unsent or signed
            return envelope, cap
        cap = self.peers.get(key)
        return None if cap is None else (self.peer_envelopes[key], cap)

    def _gpu_states(self) -> tuple:
        if self.telemetry_gpus:
            return self.telemetry_gpus
        capacity = self.ctx.capacity
        return tuple(GpuState(index=i, model=capacity.gpu_model[:96], mem_total_mib=total, mem_used_mib=0,
                              util_milli=0, temp_milli_c=0, sm_clock_mhz=0, throttle_reasons=0, ecc_errors=0,
                              power_mw=0) for i, total in enumerate(capacity.gpu_mem_total_mib))

    def current(self, now_ms: int) -> tuple[bytes, CapabilityVector, bool]:
        """This node's signed capability vector for what is free now; re-signed only when the
        facts changed. Returns (envelope, vector, whether it was signed just now)."""
        me, ledger = self.ctx.me, self.ledger
        gpus = self._gpu_states()
        running = self._running_here()
        job_signals = self._job_signals_here(running)
        facts = (self.epochs.epoch, gpus, self.telemetry_simulated, running, ledger.gpu_milli_free(),
                 ledger.free_cpu_milli(), ledger.free_mem_mib(), job_signals)
        if self.envelope is not None and facts == self.facts:
            return self.envelope, self.vector, False
        self.seq += 1
        # Zone and labels come from our member record when we have one: peers reject a bid
        # whose vector contradicts it (SPEC.md P4), so a node.toml typo must not silence us.
        record = self.epochs.member_info.get(me)
        policy = self.ctx.policy
        zone, labels = (record.zone, tuple(record.labels)) if record is not None else (policy.zone, policy.labels)
        cap = CapabilityVector(node=me, epoch=self.epochs.epoch, seq=self.seq, taken_ms=now_ms,
                               zone=zone, rail_group=self.ctx.capacity.rail_group[:64], gpus=gpus,
                               gpus_free=ledger.free_gpus(), cpu_milli_free=max(0, ledger.free_cpu_milli()),
                               mem_mib_free=max(0, ledger.free_mem_mib()), labels=labels,
                               simulated=self.telemetry_simulated or not self.telemetry_gpus,
                               running=self._running_report(now_ms), gpu_milli_free=ledger.gpu_milli_free(),
                               job_signals=job_signals)
        self.envelope = self.ctx.sign(cap)
        self.vector, self.facts = cap, facts
        if (running and self.jobs.reflex_jobs_of(me)) or self.watches(me):
            self.history.add(me, self.envelope, cap)
        return self.envelope, cap, True

    def _rules_here(self) -> list:
        """(job record, rule index, rule) of the reflex rules of the jobs running here as primary."""
        return [(r, i, rule) for r in self.jobs.mine() if r.state == "running"
                for i, rule in enumerate(r.manifest.reflexes)]

    def _conditions(self, readings: Readings) -> tuple:
        """Which of the rules here ``readings`` show: a change is a threshold crossing (P1b)."""
        return tuple(condition_holds(rule, readings, r.job_id) for r, _i, rule in self._rules_here())

    def _evidence_completes(self, now_ms: int) -> bool:
        """P1b: a vector signed now would complete a rule's evidence (its duration, or the span
        and start a cooldown asks, R3/R4c) that our newest vector does not complete."""
        history = self.history.of(self.ctx.me)
        if not history or self.vector is None or history[-1][1].seq != self.vector.seq:
            return False
        newest_ms = history[-1][1].taken_ms
        for record, _index, rule in self._rules_here():
            run = holding_run(rule, history, record.job_id, record.fence)
            if not run:
                continue
            # The flows ask the bounds of one last reflex or of several (R3, R4c): each alone,
            # and all at once, so every due moment gets its vector.
            lasts = [None] + [last for last in (record.reflex_at, *record.replica_reflex_at.values()) if last]
            bounds = [cooldown_bounds(rule, last, self.ctx.me) for last in lasts]
            bounds.append((max(b[0] for b in bounds), max(b[1] for b in bounds)))   # several at once (R4c)
            for span_ms, not_before_ms in bounds:
                start = next((taken for taken in run if taken >= not_before_ms), None)
                if start is None and not_before_ms <= now_ms:
                    return True   # the cooldown is over: a vector now starts the evidence
                if start is not None and newest_ms < start + span_ms <= now_ms:
                    return True
            if now_ms - newest_ms >= rule.for_ms:
                return True   # still holding: a member that missed a vector has new evidence a duration on
        return False

    def reading_period_ms(self, default_ms: int) -> int:
        """How often the node should read its GPUs: REFLEX_READING_MS while a job with reflex
        rules runs here as primary (P1b), else ``default_ms``."""
        if self.jobs.may_have_mine() and self._rules_here():
            return min(default_ms, REFLEX_READING_MS)
        return default_ms

    def _job_signals_here(self, running: tuple) -> tuple:
        """The reports of the jobs the vector lists running (R3a: only those may carry one)."""
        listed = {job_id for job_id, _fence in running[:MAX_RUNNING_LISTED]}
        return tuple(self.job_signals[j] for j in sorted(listed) if j in self.job_signals)

    def seq_floor_record(self) -> PersistRecord | None:
        """Once the vectors signed reach the persisted floor, a new floor SEQ_BLOCK ahead (to
        persist with the batch that sends them: the drain persists before it sends)."""
        if self.seq <= self.seq_persisted:
            return None   # nothing signed beyond what a restart starts from
        self.seq_persisted = self.seq + SEQ_BLOCK
        return PersistRecord("capability", "seq_floor", {"seq_floor": self.seq_persisted})

    def _running_report(self, now_ms: int) -> tuple:
        """The jobs this node runs as primary, newest checkpoint's age included (SPEC P1)."""
        running = []
        for record in [r for r in self.jobs.mine() if r.state == "running"][:MAX_RUNNING_LISTED]:
            seq, at_ms = record.known_checkpoint or (0, now_ms)
            running.append(RunningJob(job_id=record.job_id, fence=record.fence, checkpoint_seq=seq,
                                      checkpoint_age_ms=max(0, now_ms - at_ms),
                                      lost_work_ms=record.lost_work_ms or 0))
        return tuple(running)

    def health_stamp(self) -> tuple:
        """What this node's GPU health rests on (telemetry failing, each GPU healthy or not): a
        change re-decides the held placements it declined (SPEC.md P3a)."""
        return bool(self.telemetry_fault), tuple(gpu_healthy(g) for g in self.telemetry_gpus)

    def update_telemetry(self, gpus: tuple, rtt_us: int, now_ms: int, *, simulated: bool = False,
                         fault: str = "", job_signals: tuple = ()) -> Ready:
        """New GPU readings and mean RTT: broadcast the signed vector if a broadcast fact
        changed since the last broadcast, or every CAPABILITY_REFRESH_MS so peers' views of
        the readings stay fresh. ``fault``: why reading the GPUs
        failed this time; ``gpus`` is then ignored and the last good readings stay.
        ``job_signals``: JobSignals of the jobs running here that reported load (R3a); a job
        not in it reported none lately."""
        out = Ready()
        if fault and not self.telemetry_fault:
            out.events.append(self.ctx.event("telemetry_failed", now_ms, reason=fault[:200]))
        elif self.telemetry_fault and not fault:
            out.events.append(self.ctx.event("telemetry_recovered", now_ms))
        self.telemetry_fault = fault[:200]
        signed_readings = (self.telemetry_gpus, self.telemetry_simulated, self.job_signals)
        if not fault:
            self.telemetry_gpus = tuple(gpus)
        self.telemetry_simulated = bool(simulated)
        self.job_signals = {s.job_id: s for s in job_signals}
        self.rtt_us = max(0, int(rtt_us))
        broadcast_facts = self._broadcast_facts()
        # Compared with what was last broadcast, not last signed: a bid may have signed the change.
        material = broadcast_facts != self.broadcast_facts
        busy = broadcast_facts[2] or self.watches(self.ctx.me)   # jobs, or a replica a rule reads (R4g), run here
        refresh_ms = CAPABILITY_REFRESH_BUSY_MS if busy else CAPABILITY_REFRESH_MS
        stale = self.broadcast_ms is None or now_ms - self.broadcast_ms >= refresh_ms
        reflexes_here = broadcast_facts[-1] is not None
        due = reflexes_here and self._evidence_completes(now_ms)
        if reflexes_here and not (material or stale or due):
            # P1b: a reading that crosses no threshold is not signed (a vector signed and not
            # broadcast would break the evidence chain); the next one that matters carries it.
            self.telemetry_gpus, self.telemetry_simulated, self.job_signals = signed_readings
            return out
        envelope, _cap, changed = self.current(now_ms)
        if (material or stale or due) and self.epochs.is_member():
            if not (changed or material):
                self.envelope = None  # a refresh: a fresh taken_ms and seq
                envelope, _cap, _ = self.current(now_ms)
            self._note_broadcast(now_ms, broadcast_facts)
            out.messages.append(Outbound(None, envelope))
        return out

    def _broadcast_facts(self) -> tuple:
        """The facts whose change is broadcast at once (P1): all those the vector is signed
        for, except the GPU readings' drift (utilisation, temperature, clocks, power), which
        changes at nearly every reading on real GPUs; their health counts."""
        gpus = self._gpu_states()
        ledger = self.ledger
        # A job with reflex rules runs here: its evidence is the chain of vectors that show its
        # rules' conditions (R3), so a reading that crosses a rule's threshold goes out at once
        # (P1b); the drift between crossings waits for the refresh. A replica's node is read by
        # the mean over the job's replicas (R4g), which no one node's crossing shows: its
        # drift goes out at once.
        readings = None
        if self.watches(self.ctx.me):
            readings = (gpus, self._job_signals_here(self._running_here()))
        elif self.jobs.may_have_mine() and self._rules_here():
            record = self.epochs.member_info.get(self.ctx.me)
            zone = record.zone if record is not None else self.ctx.policy.zone
            readings = self._conditions(Readings(zone, gpus, self._job_signals_here(self._running_here())))
        return (self.epochs.epoch, self.telemetry_simulated, self._running_here(), ledger.gpu_milli_free(),
                ledger.free_cpu_milli(), ledger.free_mem_mib(), len(gpus), self.health_stamp(), readings)

    def _note_broadcast(self, now_ms: int, broadcast_facts: tuple | None = None) -> None:
        self.broadcast_ms = now_ms
        self.broadcast_facts = broadcast_facts if broadcast_facts is not None else self._broadcast_facts()

    def _running_here(self) -> tuple:
        """(job id, fence) of the jobs running here as primary, by job id; asked after every
        input, so only the jobs of this node that changed are looked at (JobTable.take_changes)."""
        changed = self.jobs.take_changes(self._jobs_changed)
        if changed:
            fences, me = self._running_fences, self.jobs.me
            for jid in changed:
                record = self.jobs.get(jid)
                if record is not None and record.primary == me and record.state == "running":
                    fences[jid] = record.fence
                else:
                    fences.pop(jid, None)
            self._running = tuple(sorted(fences.items()))
        return self._running

    def shows_running(self, node: bytes, jid: bytes, fence: int) -> bool:
        """Whether ``node``'s newest vector held here lists job ``jid`` running at ``fence`` (R2a)."""
        cap = self.vector if node == self.ctx.me else self.peers.get(node)
        return cap is not None and any(r.job_id == jid and r.fence == fence for r in cap.running)

    def relearn_running(self) -> None:
        """After a decision moved or placed jobs: a primary's vector that arrived before it
        (it already runs a job this node only now knows it has) counts now, not at its next."""
        for signer, cap in self.peers.items():
            for report in cap.running:
                record = self.jobs.get(report.job_id)
                if (record is not None and record.primary == signer and record.fence == report.fence
                        and record.state in ("placed", "migrating")):
                    record.state = "running"

    def broadcast_if_running_changed(self, now_ms: int, out: Ready) -> None:
        """P1: the jobs this node runs as primary changed (one started, moved away or ended):
        its vector goes out now, at most every RUNNING_REPORT_GAP_MS, not at the next
        telemetry reading, so every member shows a job running (not `migrating`) within
        moments of its primary."""
        if self.unsent and self.epochs.is_member():
            self.unsent = False
            self.broadcast_ms = now_ms
            out.messages.append(Outbound(None, self.envelope))
            return
        if self.facts is None or not self.epochs.is_member() or not self.jobs.may_have_mine():
            return
        running = self._running_here()
        if running == self.facts[3] or (self.broadcast_ms is not None
                                        and now_ms - self.broadcast_ms < RUNNING_REPORT_GAP_MS):
            return
        envelope, _cap, _ = self.current(now_ms)
        self._note_broadcast(now_ms)
        out.messages.append(Outbound(None, envelope))

    def send_newest_to(self, peer: bytes, out: Ready) -> None:
        """SPEC F6a: a member that asks for a sync (a restart, a heal, anti-entropy) may have
        missed our last broadcast vector, which a busy node refreshes only every second or
        two: while it lists jobs we run, our newest signed vector goes to it now, so it shows
        them running (not `migrating`) at once."""
        if (self.vector is not None and self.vector.running and self.epochs.is_member()
                and peer in self.epochs.view.stakes):
            out.messages.append(Outbound(peer, self.envelope))

    def on_capability(self, envelope, cap: CapabilityVector, data, now_ms: int, out: Ready) -> None:
        if envelope.signer not in self.epochs.view.stakes or cap.node != envelope.signer:
            self.ctx.counters["capability_not_member"] += 1
            return
        known = self.peers.get(envelope.signer)
        if known is None or cap.seq > known.seq:
            self.peers[envelope.signer] = cap
            self.peer_envelopes[envelope.signer] = data
            if (cap.running and self.jobs.reflex_jobs_of(envelope.signer)) or self.watches(envelope.signer):
                self.history.add(envelope.signer, data, cap)
            self.peers_version += 1
            self._learn_running(envelope.signer, cap, now_ms)

    def _learn_running(self, signer: bytes, cap: CapabilityVector, now_ms: int) -> None:
        """A primary's report that it runs a job: every member can show the job running and
        its checkpoint age, not only the backups that hold the checkpoints (display only)."""
        for report in cap.running:
            record = self.jobs.get(report.job_id)
            if record is None or record.primary != signer or record.fence != report.fence:
                continue  # a report from a fenced primary, or about a job we do not know
            if record.state in ("placed", "migrating"):   # its primary runs it at this fence
                record.state = "running"
            if record.migrations and report.lost_work_ms:
                record.lost_work_ms = report.lost_work_ms
            if report.checkpoint_seq and (record.known_checkpoint is None
                                          or report.checkpoint_seq > record.known_checkpoint[0]):
                record.known_checkpoint = (report.checkpoint_seq, now_ms - report.checkpoint_age_ms)
