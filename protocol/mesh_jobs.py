"""MeshCore's job flows: bidding, placement, checkpoints, exits, cancels
(SPEC.md section 7, rules P1-P6). A mixin of protocol.mesh.MeshCore;
it only uses state MeshCore.__init__ creates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from protocol import codec
from protocol.certificate import next_epoch_view
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, MAX_RUNNING_LISTED, Bid, Cancel, CapabilityVector, Checkpoint,
                               CheckpointAck, CommitCertificate, Decline, GpuState, JobExit, JobManifest, Placement,
                               RunningJob,
                               decode_message, decode_value, encode_message, job_id, placement_attempt,
                               placement_binding_error, placement_instance_id)
from protocol.placement import (attested_attributes, choose_placement, eligibility, gpu_free_mem_mib, parse_bid,
                                select_justification, wanted_backups)
from protocol.ready import Outbound, PersistRecord, Ready

TERMINAL = ("completed", "failed", "cancelled")
MAX_JOBS = 1 << 16               # job records kept; the oldest terminal ones go first
MAX_JOBS_SHOWN = 4096           # (leader, instance) pairs we sent a job to, then forgotten
MAX_BIDS_HELD = 128              # bids a leader holds per instance (it proposes the best 32)
MAX_DECLINERS_KEPT = 256         # per job, for "why pending"
CAPABILITY_REFRESH_MS = 1000     # re-sign and broadcast the capability vector at least this often
BID_WINDOW_EXTENSION = 4         # bid windows to wait once more when bids are too few for the backups
BID_LIFETIME_ROUNDS = 8          # a reservation outlives this many maximal round timeouts
FENCE_PER_ATTEMPT = 1 << 16      # attempt a's placement sets fence a * 2^16 + 1; each migration adds 1


@dataclass
class JobRecord:
    job_id: bytes
    envelope: bytes
    manifest: JobManifest
    submitted_ms: int
    state: str = "pending"
    attempt: int = 0
    instance: bytes = b""
    primary: bytes | None = None
    backups: tuple = ()
    gpus: tuple = ()
    fence: int = 0
    migrations: int = 0
    declines: dict = field(default_factory=dict)   # signer -> (reason, detail)
    last_checkpoint_seq: int | None = None
    last_checkpoint_taken_ms: int | None = None
    acks: dict = field(default_factory=dict)       # backup -> newest acked seq
    exit_code: int | None = None
    hint: str | None = None
    entry: bytes | None = None                     # the node the owner submitted it to (hears declines)
    # The newest checkpoint this node knows of, for display only: (seq, when it was taken on
    # this node's clock). Backups learn it from the checkpoints themselves, everyone else
    # from the primary's capability vectors (SPEC P1); never used to accept a checkpoint.
    known_checkpoint: tuple | None = None
    # P7c: the commit certificate of the job's slot, decided without it: its first placement
    # runs in its own instance then, and every proposal there carries this as proof.
    slot_certificate: bytes | None = None

    def as_dict(self) -> dict:
        grouped: dict[str, list] = {}
        for signer, (reason, _detail) in self.declines.items():
            grouped.setdefault(reason, []).append(signer)
        return {"job_id": self.job_id, "name": self.manifest.name, "owner": self.manifest.owner,
                "state": self.state, "primary": self.primary, "backups": self.backups, "gpus": self.gpus,
                "fence": self.fence, "attempt": self.attempt, "instance": self.instance,
                "last_checkpoint_seq": self.last_checkpoint_seq,
                "last_checkpoint_taken_ms": self.last_checkpoint_taken_ms, "migrations": self.migrations,
                "declines": grouped, "submitted_ms": self.submitted_ms, "exit_code": self.exit_code,
                "hint": self.hint, "manifest": self.manifest, "known_checkpoint": self.known_checkpoint}


class JobFlows:
    def _init_jobs(self) -> None:
        self.job_records: dict[bytes, JobRecord] = {}
        self.my_bids: dict[bytes, tuple[str, bytes]] = {}        # instance -> ("bid"|"decline", envelope)
        self.bids_held: dict[bytes, dict[bytes, tuple]] = {}     # instance -> signer -> (BidFacts, bytes)
        self.windows_open: dict[bytes, int] = {}                 # instance -> round whose window is open
        self.windows_extended: set[bytes] = set()                # instances whose bid window was extended once
        self.capability_envelope: bytes | None = None
        self.capability: CapabilityVector | None = None
        self.capability_key: tuple | None = None
        self.capability_broadcast_ms: int | None = None
        self.capability_seq = 0
        self.telemetry_gpus: tuple = ()
        self.telemetry_simulated = False
        self.rtt_us = 0
        self.peer_capabilities: dict[bytes, CapabilityVector] = {}
        self.own_attested = dict(attested_attributes(self.policy.attestations, self.me, self.mesh_id,
                                                     self.authorities, 0))

    # --- read-only views --------------------------------------------------------------------------
    def jobs(self) -> list[dict]:
        return [record.as_dict() for record in self.job_records.values()]

    def job_view(self, jid: bytes) -> dict | None:
        record = self.job_records.get(jid)
        return None if record is None else record.as_dict()

    def _capability_summary(self, key: bytes) -> dict | None:
        cap = self.capability if key == self.me else self.peer_capabilities.get(key)
        if cap is None:
            return None
        return {"seq": cap.seq, "taken_ms": cap.taken_ms, "zone": cap.zone, "gpus": len(cap.gpus),
                "gpus_free": list(cap.gpus_free), "cpu_milli_free": cap.cpu_milli_free,
                "mem_mib_free": cap.mem_mib_free, "simulated": cap.simulated,
                "gpu_models": sorted({g.model for g in cap.gpus})}

    # --- capability vectors (SPEC P1) ---------------------------------------------------------------
    def _gpu_states(self) -> tuple:
        if self.telemetry_gpus:
            return self.telemetry_gpus
        return tuple(GpuState(index=i, model=self.capacity.gpu_model[:96], mem_total_mib=total, mem_used_mib=0,
                              util_milli=0, temp_milli_c=0, sm_clock_mhz=0, throttle_reasons=0, ecc_errors=0,
                              power_mw=0) for i, total in enumerate(self.capacity.gpu_mem_total_mib))

    def _current_capability(self, now_ms: int) -> tuple[bytes, CapabilityVector, bool]:
        """This node's signed capability vector for what is free now; re-signed only when the
        facts changed (bids carry it, so most bids reuse one signature)."""
        gpus = self._gpu_states()
        running = tuple((r.job_id, r.fence) for r in self.job_records.values()
                        if r.primary == self.me and r.state == "running")
        key = (self.epoch, gpus, self.telemetry_simulated, running, self.book.free_gpus(),
               self.book.free_cpu_milli(), self.book.free_mem_mib())
        if self.capability_envelope is not None and key == self.capability_key:
            return self.capability_envelope, self.capability, False
        self.capability_seq += 1
        # Zone and labels come from our member record when we have one: peers reject a bid
        # whose vector contradicts it (SPEC.md P4), so a node.toml typo must not silence us.
        record = self.member_info.get(self.me)
        zone, labels = (record.zone, tuple(record.labels)) if record is not None else (self.policy.zone,
                                                                                      self.policy.labels)
        cap = CapabilityVector(node=self.me, epoch=self.epoch, seq=self.capability_seq, taken_ms=now_ms,
                               zone=zone, rail_group=self.capacity.rail_group[:64], gpus=gpus,
                               gpus_free=self.book.free_gpus(), cpu_milli_free=max(0, self.book.free_cpu_milli()),
                               mem_mib_free=max(0, self.book.free_mem_mib()), labels=labels,
                               simulated=self.telemetry_simulated or not self.telemetry_gpus,
                               running=self._running_report(now_ms))
        self.capability_envelope = encode_message(self.identity, self.mesh_id, cap)
        self.capability, self.capability_key = cap, key
        return self.capability_envelope, cap, True

    def _running_report(self, now_ms: int) -> tuple:
        """The jobs this node runs as primary, newest checkpoint's age included (SPEC P1)."""
        running = []
        for record in self.job_records.values():
            if record.primary == self.me and record.state == "running" and len(running) < MAX_RUNNING_LISTED:
                seq, at_ms = record.known_checkpoint or (0, now_ms)
                running.append(RunningJob(job_id=record.job_id, fence=record.fence, checkpoint_seq=seq,
                                          checkpoint_age_ms=max(0, now_ms - at_ms)))
        return tuple(running)

    def update_telemetry(self, gpus: tuple, rtt_us: int, now_ms: int, *, simulated: bool = False) -> Ready:
        """New GPU readings and mean RTT: broadcast the signed vector if it changed, or every
        CAPABILITY_REFRESH_MS so peers' views stay fresh. ``simulated``: the readings come from
        a declared profile, not a GPU (peers and owners must be able to tell)."""
        out = Ready()
        self.telemetry_gpus = tuple(gpus)
        self.telemetry_simulated = bool(simulated)
        self.rtt_us = max(0, int(rtt_us))
        envelope, _cap, changed = self._current_capability(now_ms)
        stale = self.capability_broadcast_ms is None or now_ms - self.capability_broadcast_ms >= CAPABILITY_REFRESH_MS
        if (changed or stale) and self.is_member():
            if not changed:
                self.capability_envelope = None  # force a fresh taken_ms and seq
                envelope, _cap, _ = self._current_capability(now_ms)
            self.capability_broadcast_ms = now_ms
            out.messages.append(Outbound(None, envelope))
        return out

    def _on_capability(self, envelope, cap: CapabilityVector, data, now_ms: int, out: Ready) -> None:
        if envelope.signer not in self.view.stakes or cap.node != envelope.signer:
            self.counters["capability_not_member"] += 1
            return
        known = self.peer_capabilities.get(envelope.signer)
        if known is None or cap.seq > known.seq:
            self.peer_capabilities[envelope.signer] = cap
            self._learn_running(envelope.signer, cap, now_ms)

    def _learn_running(self, signer: bytes, cap: CapabilityVector, now_ms: int) -> None:
        """A primary's report that it runs a job: every member can show the job running and
        its checkpoint age, not only the backups that hold the checkpoints (display only)."""
        for report in cap.running:
            record = self.job_records.get(report.job_id)
            if record is None or record.primary != signer or record.fence != report.fence:
                continue  # a report from a fenced primary, or about a job we do not know
            if record.state == "placed":
                record.state = "running"
            if report.checkpoint_seq and (record.known_checkpoint is None
                                          or report.checkpoint_seq > record.known_checkpoint[0]):
                record.known_checkpoint = (report.checkpoint_seq, now_ms - report.checkpoint_age_ms)

    # --- jobs arriving (SPEC P2) ------------------------------------------------------------------
    def submit(self, job_envelope: bytes, now_ms: int) -> Ready:
        """A signed job from a local owner: send it on (P2: broadcast, or with bid sampling
        only to those who need it) and start its placement."""
        out = Ready()
        envelope, job = decode_message(job_envelope, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
        if envelope.signer != job.owner:
            raise RemoteProtocolError("job is not signed by its owner")
        if job.epoch > self.epoch or self._view_for(job.epoch) is None:
            raise LocalProtocolError(
                "the job names epoch %d, which this node %s (it is at epoch %d): sign it again for the "
                "current epoch" % (job.epoch, "has not reached" if job.epoch > self.epoch else "no longer holds",
                                   self.epoch))
        self._on_job(envelope, job, job_envelope, now_ms, out, entry=self.me)
        record = self.job_records[job_id(job)]
        out.messages[0:0] = [Outbound(to, job_envelope) for to in self._job_recipients(record)]
        return out

    def _job_recipients(self, record: JobRecord) -> list:
        """SPEC P2: who the entry node sends a new job to. Everyone (``None``: broadcast),
        unless members bid by sample (P3): then the members sampled to bid in round 0 and
        round 0's leader. The others learn the job from the proposal or certificate that
        carries it, or from the entry node's broadcast if round 0 fails; a job broadcast to
        1000 members cost more than deciding it (BENCHMARKS.md, "Simulator scale")."""
        inst = self.instances.get(record.instance)
        if self.bid_sample is None or inst is None or inst.round > 0:
            return [None]
        members = inst.view.members
        chosen = [key for key in members if key != self.me and self._sampled(record.job_id, 0, len(members), key)]
        if inst.leader != self.me and inst.leader not in chosen:
            chosen.append(inst.leader)
        return chosen

    def _on_job(self, envelope, job: JobManifest, data: bytes, now_ms: int, out: Ready,
                entry: bytes | None = None) -> None:
        if envelope.signer != job.owner:
            self.counters["job_not_signed_by_owner"] += 1
            return
        jid = job_id(job)
        record = self.job_records.get(jid)
        if record is None:
            record = self._new_job_record(jid, data, job, now_ms)
            out.events.append(self._event("job_submitted", now_ms, job_id=jid.hex(), name=job.name))
        if record.entry is None:
            record.entry = entry
        if record.state == "pending" and record.instance not in self.instances:
            # Not started yet, or its instance was dropped (an evicted node drops those only
            # it ran, F7): the job, shown again by a round's leader-to-be (P3), starts it.
            self._start_placement(record, now_ms, out)

    def _new_job_record(self, jid: bytes, data: bytes, job: JobManifest, now_ms: int) -> JobRecord:
        if len(self.job_records) >= MAX_JOBS:
            for old in [k for k, r in self.job_records.items() if r.state in TERMINAL][:1024]:
                del self.job_records[old]
        record = JobRecord(jid, data, job, now_ms)
        self.job_records[jid] = record
        return record

    def _start_placement(self, record: JobRecord, now_ms: int, out: Ready) -> None:
        """Start the job's placement in the one epoch it runs in (SPEC.md P2), if this node
        holds that epoch's view; a job of a later epoch waits until this node enters it."""
        epoch = record.manifest.epoch
        record.state = "pending"
        view = self._view_for(epoch)
        if view is None:
            record.instance = b""
            if epoch > self.epoch:
                record.hint = "waiting for this node to reach epoch %d" % epoch
                self.counters["job_for_future_epoch"] += 1
            else:
                record.hint = ("placed by epoch %d, whose view this node no longer holds: its owner must "
                               "sign it again for the current epoch" % epoch)
                self.counters["job_epoch_view_gone"] += 1
            return
        if self._slotted(record):
            self._join_slot(record, view, now_ms, out)
            return
        iid = placement_instance_id(record.job_id, record.attempt)
        record.instance = iid
        inst = self._start_instance(iid, "placement", view, ("placement", record.job_id),
                                    self._placement_validator(iid), now_ms, out)
        if inst is not None:
            self._send_my_bid(iid, now_ms, out)

    def _start_placements_of_epoch(self, epoch: int, now_ms: int, out: Ready) -> None:
        """Jobs that named an epoch this node had not reached yet start their placement now."""
        for record in list(self.job_records.values()):
            if record.state == "pending" and not record.instance and record.manifest.epoch == epoch:
                self._start_placement(record, now_ms, out)

    def _placement_instance_from_value(self, iid: bytes, placement: Placement, view, now_ms: int, out: Ready,
                                       justification: tuple = ()):
        envelope, job = decode_message(placement.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
        binding = placement_binding_error(iid, job, view.epoch)
        if binding is not None:  # one instance id, one epoch (P2): no straddling it
            self.counters["placement_wrong_epoch"] += 1
            return None
        jid = job_id(job)
        record = self.job_records.get(jid) or self._new_job_record(jid, placement.job, job, now_ms)
        in_slot = self.slot_ms > 0 and record.instance == self._slot_of(job) and iid == jid
        if record.state in TERMINAL or (record.instance and record.instance != iid and not in_slot):
            self.counters["placement_for_other_attempt"] += 1
            return None
        if self.slot_ms > 0 and iid == jid and record.slot_certificate is None:
            # P7c: only the slot's certificate leaving the job out lets its own instance run;
            # without it anyone could start one beside the live slot (and hold its bids).
            certificates = self._split_justification(justification)[1]
            if self._slot_exclusion_error(job, jid, certificates, view) is not None:
                self.counters["late_placement_without_slot_certificate"] += 1
                return None
            self._apply_certificate_bytes(certificates[0], now_ms, out)  # the slot is decided here too
            record.slot_certificate = record.slot_certificate or certificates[0]
        record.instance = iid
        return self._start_instance(iid, "placement", view, ("placement", jid), self._placement_validator(iid),
                                    now_ms, out)

    # --- bids and declines (SPEC P3) ----------------------------------------------------------------
    def _sampled(self, iid: bytes, round: int, members: int, key: bytes | None = None) -> bool:
        """SPEC P3: about ``bid_sample << round`` of the ``members`` bid in ``round``. The sample
        doubles every round, so a job the first sample cannot host (all ineligible) is still
        placed once a round times out without a proposal. ``iid``: the job's placement key;
        ``key``: the member asked about (default: this node)."""
        sample = None if self.bid_sample is None else self.bid_sample << min(round, 64)
        if sample is None or sample >= members:
            return True
        draw = int.from_bytes(hashlib.sha256(b"bidder" + iid + (key or self.me)).digest()[:8], "big")
        return draw * members < sample << 64

    def _send_my_bid(self, iid: bytes, now_ms: int, out: Ready) -> None:
        inst = self.instances.get(iid)
        record = self.job_records.get(self.instance_meta.get(iid, (None, b""))[1])
        if inst is not None and record is not None and record.state not in TERMINAL:
            self._bid_once(inst, record, iid, now_ms, out)

    def _bid_once(self, inst, record: JobRecord, key: bytes, now_ms: int, out: Ready) -> None:
        """SPEC P3: a sampled member decides once per placement ``key`` (an instance, or a
        job id in a slot) whether it bids or declines, and sends that to ``inst``'s leader."""
        if self.me not in inst.view.stakes:
            return
        mine = self.my_bids.get(key)
        if mine is None:
            if not self._sampled(key, inst.round, len(inst.view.members)):
                return
            mine = self._make_bid_or_decline(key, inst.view.epoch, record, now_ms)
            self.my_bids[key] = mine
            out.events.append(self._event("bid" if mine[0] == "bid" else "declined", now_ms,
                                          instance=inst.instance_id.hex(), job_id=record.job_id.hex()))
        self._deliver_bid(inst, record, mine, now_ms, out)

    def _deliver_bid(self, inst, record: JobRecord, mine: tuple, now_ms: int, out: Ready) -> None:
        kind, data = mine
        if kind == "decline":
            # To the leader (it counts answers) and the job's entry node (the owner asks it
            # "why pending"), not to everyone: a broadcast per decliner is n^2 per job.
            for target in sorted({inst.leader, record.entry} - {None, self.me}):
                out.messages.append(Outbound(target, data))
            envelope, decline = decode_message(data, self.mesh_id, expect=Decline)
            self._on_decline(envelope, decline, data, now_ms, out)
        elif inst.leader == self.me:
            envelope, bid = decode_message(data, self.mesh_id, expect=Bid)
            self._on_bid(envelope, bid, data, now_ms, out)
        else:
            out.messages.append(Outbound(inst.leader, data))

    def _parse_member_bid(self, data: bytes, iid: bytes, view):
        """parse_bid, plus SPEC.md P4: the capability vector's zone and labels must be the
        signer's member record (genesis or join), signed facts a bidder cannot lie about."""
        facts = parse_bid(data, self.mesh_id, iid, view.epoch, view.stakes, self.authorities)
        record = self.member_info.get(facts.signer)
        # Both label sets are canonical sorted pairs (schema TextMap): compared as they are.
        if record is not None and (facts.capability.zone != record.zone or facts.capability.labels != record.labels):
            raise RemoteProtocolError("bid's capability zone or labels contradict the member record")
        return facts

    def _make_bid_or_decline(self, iid: bytes, epoch: int, record: JobRecord, now_ms: int) -> tuple[str, bytes]:
        job = record.manifest
        cap_envelope, cap, _ = self._current_capability(now_ms)
        ok, reason, detail = eligibility(job, cap, self.policy, self.own_attested)
        claim = None
        if ok:
            lifetime = BID_LIFETIME_ROUNDS * self.params.round_timeout_max_ms
            claim = self.book.reserve(iid, job.resources, now_ms + lifetime, gpu_free_mem_mib(cap))
            if claim is None:
                reason, detail = "not_enough_gpus", "capacity reserved by concurrent bids"
        if claim is None:
            decline = Decline(instance=iid, epoch=epoch, reason=reason, detail=detail[:256])
            return "decline", encode_message(self.identity, self.mesh_id, decline)
        bid = Bid(instance=iid, epoch=epoch, capability=cap_envelope, reserved_gpus=claim.gpus,
                  rtt_us=self.rtt_us, attestations=tuple(self.policy.attestations[:8]))
        return "bid", encode_message(self.identity, self.mesh_id, bid)

    def _on_bid(self, envelope, bid: Bid, data: bytes, now_ms: int, out: Ready) -> None:
        inst = self.instances.get(bid.instance)
        if inst is not None and self.instance_meta.get(bid.instance, ("?",))[0] == "placement_slot":
            raise RemoteProtocolError("a bid names a slot, not a job (P7a)")
        if inst is None and self.slot_ms > 0:
            slot = self._live_slot_of(bid.instance)   # a bid for a job its slot may place (P7)
            if slot is not None:
                self._on_slot_bid(slot, bid, data, now_ms, out)
                return
        if inst is None:
            done = self.decided.get(bid.instance)
            if done is not None and done.decision_envelope is not None:
                # A late bidder has not seen the decision: its bid is the cheapest catch-up cue.
                out.messages.append(Outbound(envelope.signer, done.decision_envelope))
                return
            if bid.instance in self.recent_certificates:  # decided here by replay or catch-up
                self._answer_applied(bid.instance, envelope.signer, -1, out)
                return
            self._hold(bid.instance, envelope, bid, data)
            return
        facts = self._parse_member_bid(data, bid.instance, inst.view)
        if self._hold_bid(self.instance_meta.get(bid.instance, (None, b""))[1], facts, data, key=bid.instance):
            self._maybe_propose_placement(inst, now_ms, out, window_closed=False)

    def _hold_bid(self, jid: bytes, facts, data: bytes, key: bytes | None = None) -> bool:
        """Keep a verified bid for the leader's proposal, by its placement key (default: the job id)."""
        held = self.bids_held.setdefault(key or jid, {})
        if facts.signer not in held and len(held) >= MAX_BIDS_HELD:
            self.counters["bids_full"] += 1
            return False
        held[facts.signer] = (facts, data)
        record = self.job_records.get(jid)
        if record is not None:
            record.declines.pop(facts.signer, None)  # it declined earlier, for want of free capacity
        return True

    def _on_decline(self, envelope, decline: Decline, data, now_ms: int, out: Ready) -> None:
        meta = self.instance_meta.get(decline.instance)
        record = self.job_records.get(meta[1]) if meta and meta[0] == "placement" else None
        inst = self.instances.get(decline.instance)
        if inst is None and self.slot_ms > 0:
            inst = self._live_slot_of(decline.instance)   # a decline of a job its slot may place (P7)
            record = self.job_records.get(decline.instance) if inst is not None else None
        view = inst.view if inst is not None else self.view
        if record is None or decline.epoch != view.epoch or envelope.signer not in view.stakes:
            self.counters["decline_unknown"] += 1
            return
        if envelope.signer not in record.declines and len(record.declines) < MAX_DECLINERS_KEPT:
            record.declines[envelope.signer] = (decline.reason, decline.detail)
        if inst is not None and inst.instance_id == decline.instance:
            self._maybe_propose_placement(inst, now_ms, out, window_closed=False)

    # --- the leader's proposal (SPEC P4) --------------------------------------------------------------
    def _on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        meta = self.instance_meta.get(inst.instance_id, ("?",))
        if meta[0] == "placement_slot":
            self._open_slot_window(inst, now_ms, out)
            return
        if meta[0] != "placement":
            self._propose_epoch_change(inst, meta, now_ms, out)
            return
        if self.windows_open.get(inst.instance_id) != inst.round:
            self.windows_open[inst.instance_id] = inst.round
            self._schedule(inst, "bid_window", now_ms + self.params.bid_window_ms)
            self._send_my_bid(inst.instance_id, now_ms, out)
        self._maybe_propose_placement(inst, now_ms, out, window_closed=False)

    def _bid_window_closed(self, iid: bytes, now_ms: int, out: Ready) -> None:
        inst = self.instances.get(iid)
        if inst is not None and self.instance_meta.get(iid, ("?",))[0] == "placement_slot":
            self._propose_slot(inst, now_ms, out)
        elif inst is not None:
            self._maybe_propose_placement(inst, now_ms, out, window_closed=True)

    def _maybe_propose_placement(self, inst, now_ms: int, out: Ready, window_closed: bool) -> None:
        """Propose once every member answered, or when the bid window closed (SPEC P4)."""
        iid = inst.instance_id
        if not inst.awaiting_value or self.windows_open.get(iid) != inst.round:
            return
        record = self.job_records.get(self.instance_meta[iid][1])
        held = self.bids_held.get(iid, {})
        answered = len(held) + (len(record.declines) if record else 0)
        if record is None or not (window_closed or answered >= len(inst.view.members)):
            return
        if (window_closed and answered < len(inst.view.members)
                and len(held) < 1 + wanted_backups(record.manifest) and iid not in self.windows_extended):
            # Too few bids for a primary and its backups: a placement without a backup
            # cannot fail over, so wait once more before settling (SPEC.md 8.4).
            self.windows_extended.add(iid)
            self._schedule(inst, "bid_window", now_ms + BID_WINDOW_EXTENSION * self.params.bid_window_ms)
            return
        # A placement may run in an older epoch (P2): members evicted since are fenced, and
        # placing a job on one would only strand it.
        live = [facts for facts, _ in held.values() if facts.signer in self.view.stakes]
        chosen = select_justification(record.manifest, iid, live)
        placement = choose_placement(record.envelope, record.manifest, iid, chosen)
        if placement is None:
            record.hint = "no eligible bid yet (%d bids, %d declines)" % (len(held), len(record.declines))
            return
        justification = tuple(held[facts.signer][1] for facts in chosen)
        if self.slot_ms > 0 and record.attempt == 0:
            if record.slot_certificate is None:
                return  # not this instance's to place before its slot is decided (P7c)
            justification += (record.slot_certificate,)
        self._drive(inst, inst.propose(codec.pack(placement.to_body()), justification, now_ms), now_ms, out)

    def _placement_validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid) or self.decided.get(iid)   # the one asking
            view = inst.view if inst is not None else self.view
            try:
                placement = decode_value("placement", value_bytes)
                envelope, job = decode_message(placement.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
                if envelope.signer != job.owner:
                    return "job not signed by its owner"
                binding = placement_binding_error(iid, job, view.epoch)
                if binding is not None:
                    return binding
                bids, certificates = self._split_justification(justification)
                if len(bids) > MAX_BIDS_PER_PROPOSAL:
                    return "more than %d bids" % MAX_BIDS_PER_PROPOSAL
                if self.slot_ms > 0 and placement_attempt(iid, job) == 0:
                    problem = self._slot_exclusion_error(job, job_id(job), certificates, view)
                    if problem is not None:
                        return problem
                elif certificates:
                    return "a certificate in a placement's justification"
                facts = [self._parse_member_bid(b, iid, view) for b in bids]
                expected = choose_placement(placement.job, job, iid, facts)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid placement proposal: %s" % exc
            if expected != placement:
                return "placement does not follow from its bids"
            return None
        return validate

    def _on_round_changed(self, inst, now_ms: int, out: Ready) -> None:
        """SPEC P3: bids go to the current leader, so a new round re-sends ours."""
        meta = self.instance_meta.get(inst.instance_id, ("?",))
        if meta[0] == "placement_slot":
            self._on_slot_round_changed(inst, now_ms, out)
            return
        if meta[0] != "placement":
            return
        record = self.job_records.get(meta[1])
        self._show_job_to_leader(inst, record, out)
        self._broadcast_job_after_round_zero(inst, record, out)
        if record is not None and not self._refresh_decline(inst, record, now_ms, key=inst.instance_id):
            return
        self._send_my_bid(inst.instance_id, now_ms, out)

    def _refresh_decline(self, inst, record: JobRecord, now_ms: int, key: bytes | None = None) -> bool:
        """Capacity held by concurrent bids may be free again: decide a decline afresh. False
        when it stays a decline (repeating it adds nothing), True otherwise."""
        key = key or record.job_id
        mine = self.my_bids.get(key)
        if mine is None or mine[0] != "decline":
            return True
        fresh = self._make_bid_or_decline(key, inst.view.epoch, record, now_ms)
        if fresh[0] == "decline":
            return False
        self.my_bids[key] = fresh
        record.declines.pop(self.me, None)  # "why pending" no longer counts ours
        return True

    def _show_job_to_leader(self, inst, record, out: Ready) -> None:
        """SPEC P3: the job goes with our round change to a new round's leader, once per round
        (a leader shown it before it crashed has forgotten it again).
        A leader that crashed and restarted forgot the undecided instance (and an evicted one
        may have dropped it): only a proposal would bring it back, and it is that leader's
        turn to propose. From the job it runs the instance again, in the job's epoch (P2)."""
        key = (inst.leader, inst.instance_id, record.job_id if record is not None else b"", inst.round)
        if record is None or inst.leader == self.me or key in self.jobs_shown:
            return
        if len(self.jobs_shown) >= MAX_JOBS_SHOWN:
            self.jobs_shown.clear()
        self.jobs_shown.add(key)
        out.messages.append(Outbound(inst.leader, record.envelope))

    def _broadcast_job_after_round_zero(self, inst, record, out: Ready) -> None:
        """P2: with bid sampling the entry node sent the job only to round 0's sample and
        leader. Once round 0 failed, every member must run the instance (a later round's
        leader waits for round changes from a quorum, 6.5; the doubled sample bids, P3),
        so the entry node and round 0's leader (should the entry have failed) broadcast the
        job, once per round (a broadcast lost to a partition is not the last)."""
        key = (None, inst.instance_id, record.job_id if record is not None else b"", inst.round)
        if (record is None or inst.round == 0 or self.bid_sample is None or key in self.jobs_shown
                or self.me not in (record.entry, inst.view.leader(inst.instance_id, 0))):
            return
        self.jobs_shown.add(key)
        out.messages.append(Outbound(None, record.envelope))

    def _instance_gave_up(self, iid: bytes, meta: tuple, now_ms: int, out: Ready) -> None:
        if meta[0] == "placement_slot":
            self._slot_gave_up(iid, now_ms, out)
            return
        self.book.release(iid)
        self.my_bids.pop(iid, None)
        self.bids_held.pop(iid, None)
        self.windows_open.pop(iid, None)
        self.windows_extended.discard(iid)
        record = self.job_records.get(meta[1]) if meta[0] == "placement" else None
        if record is not None and record.state == "pending":
            record.hint = "placement gave up after %d rounds; resubmit to retry" % self.params.max_rounds
            record.instance = b""
            out.events.append(self._event("job_gave_up", now_ms, job_id=record.job_id.hex()))

    # --- a placement is decided (SPEC P5) ------------------------------------------------------------
    def _apply_placement(self, iid: bytes, placement: Placement, certificate: bytes, certificate_epoch: int,
                         now_ms: int, out: Ready, instance: bytes | None = None) -> None:
        """``iid``: the placement's key (its instance, or its job id in a slot ``instance``)."""
        envelope, job = decode_message(placement.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True)
        jid = job_id(job)
        record = self.job_records.get(jid) or self._new_job_record(jid, placement.job, job, now_ms)
        self.my_bids.pop(iid, None)
        self.bids_held.pop(iid, None)
        self.windows_open.pop(iid, None)
        self.windows_extended.discard(iid)
        attempt = placement_attempt(iid, job)  # never None: _apply_certified checked the binding
        if record.state == "cancelled" or attempt < record.attempt:
            # A late certificate of an attempt that has failed since (P6) changes nothing.
            self.counters["placement_of_earlier_attempt"] += record.state != "cancelled"
            self.book.release(iid)
            return
        record.attempt = attempt  # a node that missed an exit learns the attempt here
        record.instance = instance or iid
        record.primary, record.backups, record.gpus = placement.primary, placement.backups, placement.gpus
        # From the certificate alone, not by counting what this node happened to apply: a
        # node that missed an attempt (or learns it late) gets the fence the others have.
        record.fence = attempt * FENCE_PER_ATTEMPT + 1
        record.state = "placed"
        record.hint = None
        if placement.primary == self.me:
            claim = self.book.allocate(iid, jid) or self.book.allocate_now(jid, job.resources, prefer=placement.gpus)
            if claim is None:
                out.events.append(self._event("capacity_short", now_ms, job_id=jid.hex()))
        else:
            self.book.release(iid)
        out.events.append(self._event("placed", now_ms, job_id=jid.hex(), primary=placement.primary.hex(),
                                      fence=record.fence))
        self._replay_evictions_since(record, certificate_epoch, now_ms, out)

    def _replay_evictions_since(self, record: JobRecord, epoch: int, now_ms: int, out: Ready) -> None:
        """SPEC P5: a placement runs in its job's epoch (P2), so it may be decided after later
        epoch changes were applied here. It goes through each eviction decided since its
        certificate's epoch, in order, by the rule F5 applied to the jobs known then (the
        eviction's plan, else the first live backup): every node ends with the same primary,
        backups and fence however late it learnt the placement."""
        view = self._view_for(epoch)  # held: the placement's certificate verified against it
        for ended, certificate in list(self.epoch_certificates):
            if ended < epoch:
                continue
            if view is None or ended != view.epoch or record.state in TERMINAL:
                return  # a gap in the kept history (64 changes), or nothing left to move
            _envelope, cert = decode_message(certificate, self.mesh_id, expect=CommitCertificate)
            change = decode_value(cert.value_kind, cert.value)
            # Each epoch's view from the changes themselves, not from the views this node
            # still keeps (8): a node far behind computes what one in time saw.
            view = next_epoch_view(view, cert.value_kind, change)
            if cert.value_kind == "eviction" and view is not None and record.primary == change.node:
                if change.node == self.me:
                    self.book.free(record.job_id)
                self._move_jobs_of_evicted([record], change, view, now_ms, out)

    # --- workloads, checkpoints, exits (SPEC P6) -------------------------------------------------------
    def _my_job(self, jid: bytes) -> JobRecord:
        record = self.job_records.get(jid)
        if record is None or record.primary != self.me or record.state in TERMINAL or not self.is_member():
            raise LocalProtocolError("this node is not the primary of job %s" % jid.hex()[:12])
        return record

    def workload_started(self, jid: bytes, fence: int, from_seq: int, now_ms: int) -> Ready:
        out = Ready()
        record = self.job_records.get(jid)
        if record is not None and record.primary == self.me and record.fence == fence:
            record.state = "running"
            out.events.append(self._event("job_started", now_ms, job_id=jid.hex(), fence=fence, from_seq=from_seq))
        return out

    def local_checkpoint(self, jid: bytes, seq: int, progress: int, taken_ms: int, state: bytes,
                         now_ms: int) -> Ready:
        """The primary's workload took a checkpoint: persist it, stream it to the backups."""
        record = self._my_job(jid)
        checkpoint = Checkpoint(job_id=jid, fence=record.fence, seq=seq, progress=progress, taken_ms=taken_ms,
                                state=state, state_hash=hashlib.sha256(state).digest())
        out = Ready()
        out.persist.append(self._checkpoint_record(checkpoint, self.me))
        data = encode_message(self.identity, self.mesh_id, checkpoint)
        for backup in record.backups:
            if backup in self.view.stakes:
                out.messages.append(Outbound(backup, data))
        record.state = "running"
        record.last_checkpoint_seq, record.last_checkpoint_taken_ms = seq, taken_ms
        record.known_checkpoint = (seq, now_ms)
        return out

    @staticmethod
    def _checkpoint_record(checkpoint: Checkpoint, origin: bytes) -> PersistRecord:
        return PersistRecord("checkpoints", "%s:%d" % (checkpoint.job_id.hex(), checkpoint.seq), {
            "job_id": checkpoint.job_id, "fence": checkpoint.fence, "seq": checkpoint.seq,
            "progress": checkpoint.progress, "taken_ms": checkpoint.taken_ms, "state": checkpoint.state,
            "state_hash": checkpoint.state_hash, "origin": origin})

    def _on_checkpoint(self, envelope, checkpoint: Checkpoint, data, now_ms: int, out: Ready) -> None:
        record = self.job_records.get(checkpoint.job_id)
        if record is None:
            self.counters["checkpoint_unknown_job"] += 1
            return
        if envelope.signer != record.primary or checkpoint.fence < record.fence:
            self.counters["checkpoint_stale_fence"] += 1  # SPEC P6: a fenced primary is ignored
            out.events.append(self._event("checkpoint_refused", now_ms, job_id=checkpoint.job_id.hex(),
                                          signer=envelope.signer.hex(), fence=checkpoint.fence))
            return
        if checkpoint.fence > record.fence:
            self.counters["checkpoint_future_fence"] += 1
            return
        if record.last_checkpoint_seq is not None and checkpoint.seq <= record.last_checkpoint_seq:
            self.counters["checkpoint_old_seq"] += 1
            return
        record.last_checkpoint_seq, record.last_checkpoint_taken_ms = checkpoint.seq, checkpoint.taken_ms
        record.known_checkpoint = (checkpoint.seq, now_ms)
        if record.state in ("placed", "migrating"):
            record.state = "running"
        out.persist.append(self._checkpoint_record(checkpoint, envelope.signer))
        ack = CheckpointAck(job_id=checkpoint.job_id, fence=checkpoint.fence, seq=checkpoint.seq)
        out.messages.append(Outbound(envelope.signer, encode_message(self.identity, self.mesh_id, ack)))

    def _on_checkpoint_ack(self, envelope, ack: CheckpointAck, data, now_ms: int, out: Ready) -> None:
        record = self.job_records.get(ack.job_id)
        if record is None or record.primary != self.me or ack.fence != record.fence or envelope.signer not in record.backups:
            self.counters["ack_unexpected"] += 1
            return
        record.acks[envelope.signer] = max(ack.seq, record.acks.get(envelope.signer, 0))

    def job_exited(self, jid: bytes, exit_code: int, now_ms: int) -> Ready:
        """The workload exited here. A fenced ex-primary's exit changes nothing (an event says so)."""
        out = Ready()
        record = self.job_records.get(jid)
        if record is None or record.primary != self.me or record.state in TERMINAL:
            out.events.append(self._event("exit_ignored", now_ms, job_id=jid.hex(), exit_code=exit_code))
            return out
        code = exit_code if 0 <= exit_code <= 255 else 255
        message = JobExit(job_id=jid, fence=record.fence, exit_code=code)
        data = encode_message(self.identity, self.mesh_id, message)
        out.messages.append(Outbound(None, data))
        self._persist_outcome(jid, "exit", data, out)
        self._finish_job(record, code, now_ms, out)
        return out

    def _on_job_exit(self, envelope, message: JobExit, data, now_ms: int, out: Ready) -> None:
        record = self.job_records.get(message.job_id)
        if record is None or envelope.signer != record.primary or message.fence != record.fence:
            self.counters["job_exit_stale"] += 1
            return
        if record.state not in TERMINAL:
            self._persist_outcome(record.job_id, "exit", data, out)
            self._finish_job(record, message.exit_code, now_ms, out)

    def _finish_job(self, record: JobRecord, code: int, now_ms: int, out: Ready) -> None:
        self.book.free(record.job_id)
        record.exit_code = code
        if code == 0:
            record.state = "completed"
        elif record.attempt < record.manifest.max_retries:
            record.attempt += 1  # SPEC P6: a failed job is placed afresh, by a new instance
            record.primary, record.backups, record.gpus = None, (), ()
            record.declines.clear()
            self._start_placement(record, now_ms, out)
        else:
            record.state = "failed"
        out.events.append(self._event("job_exited", now_ms, job_id=record.job_id.hex(), exit_code=code,
                                      state=record.state, attempt=record.attempt))

    def cancel(self, request: bytes, now_ms: int) -> tuple[bytes, Ready]:
        """An owner-signed Cancel envelope: stop and forget the job everywhere."""
        out = Ready()
        envelope, message = decode_message(request, self.mesh_id, expect=Cancel)
        record = self.job_records.get(message.job_id)
        if record is None:
            raise RemoteProtocolError("cancel: unknown job %s" % message.job_id.hex()[:12])
        if envelope.signer != record.manifest.owner:
            raise RemoteProtocolError("cancel: only the job's owner may cancel it")
        out.messages.append(Outbound(None, request))
        self._persist_outcome(record.job_id, "cancel", request, out)
        self._apply_cancel(record, now_ms, out)
        return message.job_id, out

    def _on_cancel(self, envelope, message: Cancel, data, now_ms: int, out: Ready) -> None:
        record = self.job_records.get(message.job_id)
        if record is None or envelope.signer != record.manifest.owner:
            self.counters["cancel_refused"] += 1
            return
        if record.state not in TERMINAL:
            self._persist_outcome(record.job_id, "cancel", data, out)
        self._apply_cancel(record, now_ms, out)

    @staticmethod
    def _persist_outcome(jid: bytes, kind: str, data: bytes, out: Ready) -> None:
        """SPEC.md 6.9: exits and cancels are no certificates, so a restart would forget them
        (a completed job would be resumed); the newest per job is kept and replayed."""
        out.persist.append(PersistRecord("jobs", jid.hex(), {"job_id": jid, "outcome": kind, "envelope": data}))

    def _replay_outcomes(self, envelopes, now_ms: int) -> None:
        """After the certificates: each job's last accepted exit or cancel, through the same
        checks as when it arrived (the current primary at the current fence; the owner)."""
        for data in envelopes:
            try:
                envelope, message = decode_message(data, self.mesh_id)
                if isinstance(message, JobExit):
                    self._on_job_exit(envelope, message, data, now_ms, Ready())
                elif isinstance(message, Cancel):
                    self._on_cancel(envelope, message, data, now_ms, Ready())
                else:
                    self.counters["bad_job_outcome"] += 1
            except RemoteProtocolError:
                self.counters["bad_job_outcome"] += 1

    def _apply_cancel(self, record: JobRecord, now_ms: int, out: Ready) -> None:
        if record.state in TERMINAL:
            return
        if record.instance:
            self.book.release(record.instance)
        self.book.release(record.job_id)  # a slot's bid reserves by job (P7a)
        was_mine = record.primary == self.me
        self.book.free(record.job_id)
        record.state = "cancelled"
        if was_mine:
            out.decisions.append(self._local_decision("cancel", (record.job_id,)))
        out.events.append(self._event("job_cancelled", now_ms, job_id=record.job_id.hex()))
