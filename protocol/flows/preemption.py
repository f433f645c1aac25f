"""The preemption flow: to place a job no member has room for, stop lower-priority
preemptible jobs on one node (SPEC.md P8).

When a job's placement round is on hold (P3a: every member declined it) and the job has
a priority above 0, each member that finds a victim set by the rule (protocol/preemption.py)
in the signed vectors it holds starts the job attempt's one preemption instance. Its
leader proposes the rule's value with every member's decline and the candidate nodes'
vectors as justification; validators recompute it from those.

Applying it changes the victims only through their node N, so every member sees one
order of events per victim (its exit, or its preemption): N, if the job still waits and
still has its decline, frees the victims' capacity in its ledger, bids for the job with
it (the held round ends, the job is placed by its own instance, P3a), and then refuses
each victim (R1: a signed ``job_refusal`` at its fence). Every node places a refused job
afresh, and its next primary resumes it from the checkpoint handed over by the nodes
that hold it. A victim that ended or moved meanwhile is skipped; a job placed meanwhile
preempts nothing.

Reclaim (SPEC.md Q6): a job holding an in-quota grant may preempt, whatever its priority,
jobs of its pool running on borrowed quota. The proposal then carries the job's grant and
the victims' borrowed grants, so validators read who is borrowed from signed grants.
"""

from __future__ import annotations

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.base import SharedStateFlow
from protocol.job_lifecycle import FINAL_CHECKPOINT_WAIT_MS
from protocol.job_table import FENCE_PER_ATTEMPT, LIVE_JOB_STATES
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, MAX_VICTIMS, CapabilityVector, Decline, JobManifest,
                               QuotaGrant, decode_message, decode_value, job_id, placement_instance_id,
                               preemption_binding_error, preemption_instance_id)
from protocol.preemption import CAPACITY_DECLINES, Quota, choose_preemption
from protocol.quota_admission import grant_error
from protocol.ready import Outbound, Ready

SCAN_MS = 50   # how often a member looks for held placements it could preempt for (P8b)


class PreemptionFlow(SharedStateFlow):
    value_kind = "preemption"
    value_kinds = ("preemption",)
    # Every member's decline, the candidate nodes' vectors (P8: meshes of at most 32), and
    # the job's in-quota grant and its victims' borrowed grants (Q6).
    max_justification = 2 * MAX_BIDS_PER_PROPOSAL + 1 + MAX_VICTIMS

    def __init__(self, ctx, epochs, jobs, ledger, instances, bidding, capability, placement, lifecycle) -> None:
        super().__init__(ctx, epochs, jobs, ledger, instances, capability)
        self.bidding = bidding
        self.placement = placement
        self.lifecycle = lifecycle
        self.next_scan_ms = 0
        self.looked_at: dict[bytes, tuple] = {}   # held placement instance -> (round, vectors) last looked at
        self.live: set[bytes] = set()             # preemption instances running here (a leader may retry)

    def bid_job(self, subject) -> None:
        return None   # nobody bids on a preemption

    def job_ids(self, iid: bytes, subject) -> tuple:
        return (subject[0],)

    def validators(self, iid: bytes) -> tuple:
        return self._validator(iid), None

    # --- when a preemption starts --------------------------------------------------------------
    def next_scan_ms_if_needed(self) -> int | None:
        """When ``consider`` next looks (None: nothing for it to look at until an input)."""
        return self.next_scan_ms if self.live or self.bidding.declined else None

    def consider(self, now_ms: int, out: Ready) -> None:
        """Tick, every SCAN_MS: start the preemption instance of each held placement (P3a) of a
        job with a priority above 0 for which the rule finds victims here (looked at again
        only when the round or a vector changed), and let a leader still awaiting a value
        for one try again (a vector it lacked may have come). Only placements this node
        holds a decline of every member for are looked at: most nodes hold none."""
        if now_ms < self.next_scan_ms:
            return
        self.next_scan_ms = now_ms + SCAN_MS
        for iid in list(self.live):
            inst = self.instances.get(iid)
            if inst is None:
                self.live.discard(iid)
            elif inst.awaiting_value:
                self.on_awaiting_value(inst, now_ms, out)
        stamp_of_vectors = (self.capability.peers_version, self.capability.seq)
        looked_at, self.looked_at = self.looked_at, {}
        for piid, declines in list(self.bidding.declined.items()):
            inst = self.instances.get(piid)
            if inst is None or len(declines) < len(inst.view.members):
                continue
            role = self.instances.role(piid)
            record = self.jobs.get(role.subject) if role is not None and role.flow is self.placement else None
            if (record is None or (record.manifest.priority == 0 and self.admission.in_quota_grant(record.job_id) is None)
                    or not self.placement.round_on_hold(inst, now_ms)):
                continue   # priority 0 preempts nothing, unless in quota it reclaims borrowed capacity (Q6)
            stamp = self.looked_at[piid] = (inst.round, stamp_of_vectors)
            iid = preemption_instance_id(piid)
            if looked_at.get(piid) == stamp or self.instances.is_done(iid):
                continue
            if self._proposal_value(inst, record, now_ms) is not None:
                # Every member gets the declines too: the preemption's leader proposes from
                # them, and a member that lacked one holds the round (P3a) only with them.
                out.messages.extend(Outbound(None, data) for data in declines.values())
                self._start(iid, (record.job_id, piid), inst.view, now_ms, out)

    def _start(self, iid: bytes, subject: tuple, view, now_ms: int, out: Ready):
        inst = self.instances.start(iid, self, subject, view, now_ms, out)
        if inst is not None and inst.decision is None:
            self.live.add(iid)
        return inst

    def _proposal_value(self, placement_inst, record, now_ms: int):
        """(Preemption, justification) by the rule over what this node holds, or None."""
        piid = placement_inst.instance_id
        view = placement_inst.view
        declines = self.bidding.declined.get(piid, {})
        if len(view.members) > MAX_BIDS_PER_PROPOSAL or any(m not in declines for m in view.members):
            return None
        decliners = {m for m in view.members if record.declines.get(m, ("",))[0] in CAPACITY_DECLINES}
        envelopes = dict(self.capability.peer_envelopes)
        envelopes[self.ctx.me] = self.capability.current(now_ms)[0]
        vectors, chosen_envelopes = {}, []
        for node in sorted(decliners & set(envelopes)):
            _envelope, cap = decode_message(envelopes[node], self.ctx.mesh_id, expect=CapabilityVector,
                                            caches=self.ctx.caches)
            if cap.epoch == view.epoch:
                vectors[node] = cap
                chosen_envelopes.append(envelopes[node])
        admission = self.admission
        own_grant = admission.in_quota_grant(record.job_id)   # Q6: in quota, it may reclaim
        borrowed = frozenset(r.job_id for cap in vectors.values() for r in cap.running if admission.borrowed(r.job_id))
        value = choose_preemption(record.envelope, record.manifest, record.attempt, vectors, decliners,
                                  self._manifest_of, Quota(own_grant is not None, borrowed))
        if value is None:
            return None
        grants = ((own_grant,) if own_grant is not None else ()) + tuple(
            admission.grants[v.job_id] for v in value.victims if v.job_id in borrowed)
        justification = tuple(declines[m] for m in sorted(view.members)) + tuple(chosen_envelopes) + grants
        return value, justification

    @property
    def admission(self):
        """The quota grants this member holds (Q2b, Q6)."""
        return self.bidding.scheduling.admission

    def _manifest_of(self, jid: bytes):
        record = self.jobs.get(jid)
        return record.manifest if record is not None else None

    def instance_from_proposal(self, proposal, value, view, now_ms: int, out: Ready):
        _envelope, job = decode_message(value.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                        caches=self.ctx.caches)
        jid = job_id(job)
        if preemption_binding_error(proposal.instance, job, jid, value.attempt, view.epoch) is not None:
            self.ctx.counters["preemption_unbound"] += 1
            return None
        piid = placement_instance_id(jid, value.attempt)
        return self._start(proposal.instance, (jid, piid), view, now_ms, out)

    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        jid, piid = self.instances.role(inst.instance_id).subject
        record = self.jobs.get(jid)
        placement_inst = self.instances.get(piid)
        if record is None or record.state != "pending" or record.instance != piid or placement_inst is None:
            return
        found = self._proposal_value(placement_inst, record, now_ms)
        if found is not None:
            value, justification = found
            self.instances.drive(inst, inst.propose(codec.pack(value.to_body()), justification, now_ms), now_ms, out)

    # --- validation (SPEC P8) --------------------------------------------------------------------
    def _validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.live_or_decided(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                value = decode_value("preemption", value_bytes, caches=self.ctx.caches)
                envelope, job = decode_message(value.job, self.ctx.mesh_id, expect=JobManifest,
                                               allow_any_mesh=True, caches=self.ctx.caches)
                if envelope.signer != job.owner:
                    return "job not signed by its owner"
                jid = job_id(job)
                binding = preemption_binding_error(iid, job, jid, value.attempt, view.epoch)
                if binding is not None:
                    return binding
                piid = placement_instance_id(jid, value.attempt)
                record = self.jobs.get(jid)
                if record is None or record.state != "pending" or record.instance != piid:
                    return "the job's attempt %d is not waiting to be placed here" % value.attempt
                declines, vectors, grants = self._parse_justification(justification, piid, view)
                missing = [m for m in view.members if m not in declines]
                if missing:
                    return "no decline from %d of the %d members" % (len(missing), len(view.members))
                quota = self._quota_from_grants(grants, job, jid, value)
                if isinstance(quota, str):
                    return quota
                decliners = {m for m, d in declines.items() if d.reason in CAPACITY_DECLINES}
                expected = choose_preemption(value.job, job, value.attempt, vectors, decliners, self._manifest_of,
                                             quota)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid preemption proposal: %s" % exc
            if expected != value:
                return "preemption does not follow the victim rule (P8)"
            return None
        return validate

    def _quota_from_grants(self, grants: dict, job, jid: bytes, value) -> Quota | str:
        """Q6: the justification's grants are the job's own, in quota (it reclaims), and
        borrowed grants of named victims (those are borrowed), each checked as Q2c checks a
        placement's (a victim's manifest from this node's table, as P8b reads it)."""
        victims = {v.job_id for v in value.victims}
        for grant_job, data in grants.items():
            manifest = job if grant_job == jid else self._manifest_of(grant_job) if grant_job in victims else None
            if manifest is None:
                return "a quota grant of a job that is neither the preempting job nor a known victim"
            view = self.epochs.view_for(manifest.epoch)
            problem = "its epoch's view is not held here" if view is None else grant_error(
                data, manifest, view, self.ctx.mesh_id, self.ctx.caches, borrowed=grant_job != jid)
            if problem is not None:
                return problem
        return Quota(jid in grants, frozenset(grants) - {jid})

    def _parse_justification(self, justification: tuple, piid: bytes, view) -> tuple[dict, dict, dict]:
        """P8: declines of the job's placement instance and capability vectors, each of a
        member, for the instance's epoch, at most one of each kind per member; Q6: quota
        grants, at most one per job (checked by _quota_from_grants)."""
        declines, vectors, grants = {}, {}, {}
        for data in justification:
            envelope, message = decode_message(data, self.ctx.mesh_id, caches=self.ctx.caches)
            signer = envelope.signer
            if isinstance(message, QuotaGrant):   # signed by a quota home: checked against its job
                if message.job_id in grants:
                    raise RemoteProtocolError("a second quota grant of one job")
                grants[message.job_id] = data
                continue
            if signer not in view.stakes:
                raise RemoteProtocolError("a justification signed by a non-member")
            if isinstance(message, Decline):
                if message.instance != piid or message.epoch != view.epoch or signer in declines:
                    raise RemoteProtocolError("a decline of another instance or epoch, or a second one")
                declines[signer] = message
            elif isinstance(message, CapabilityVector):
                if message.node != signer or message.epoch != view.epoch or signer in vectors:
                    raise RemoteProtocolError("a vector of another node or epoch, or a second one")
                vectors[signer] = message
            else:
                raise RemoteProtocolError("a %s in a preemption's justification" % envelope.kind)
        return declines, vectors, grants

    # --- a preemption is decided (SPEC P8) -------------------------------------------------------
    def binding_error(self, iid: bytes, value_kind: str, value, epoch: int) -> str | None:
        return self.value_binding_error(iid, value_kind, value, epoch, self.ctx.mesh_id, 0, caches=self.ctx.caches)

    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, value, epoch: int, mesh_id: bytes, slot_ms: int,
                            caches=None) -> str | None:
        """SPEC 6.7: a preemption's instance is its job attempt's, in the job's epoch."""
        envelope, job = decode_message(value.job, mesh_id, expect=JobManifest, allow_any_mesh=True, caches=caches)
        if envelope.signer != job.owner:
            return "a job that is not signed by its owner"
        return preemption_binding_error(iid, job, job_id(job), value.attempt, epoch)

    def apply(self, iid: bytes, value_kind: str, value, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        _envelope, job = decode_message(value.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                        caches=self.ctx.caches)
        jid = job_id(job)
        out.events.append(self.ctx.event("preemption_decided", now_ms, job_id=jid.hex(), node=value.node.hex(),
                                         victims=[v.job_id.hex() for v in value.victims]))
        victims = []
        for victim in value.victims:
            record = self.jobs.get(victim.job_id)
            if (record is not None and record.primary == value.node and record.fence == victim.fence
                    and record.state in LIVE_JOB_STATES):
                record.preempted_by = (jid, victim.fence)   # for `why`: shown once its attempt ended
                victims.append(record)
        if value.node == self.ctx.me and not self.lifecycle.deferred:   # never while replaying history
            self._preempt_here(jid, placement_instance_id(jid, value.attempt), victims, now_ms, out)

    def _preempt_here(self, jid: bytes, piid: bytes, victims: list, now_ms: int, out: Ready) -> None:
        """This node is N: free the victims, bid for the job with what they held, then refuse
        them (in that order: the refusals start the victims' new attempts, whose bids here
        must not take the room first)."""
        record = self.jobs.get(jid)
        placement_inst = self.instances.get(piid)
        mine = self.bidding.mine.get(piid)
        if (record is None or record.state != "pending" or record.instance != piid or placement_inst is None
                or mine is None or mine[0] != "decline" or not victims):
            self.ctx.counters["preemption_moot"] += 1
            out.events.append(self.ctx.event("preemption_moot", now_ms, job_id=jid.hex()))
            return
        for victim in victims:
            self.ledger.free(victim.job_id)
        self.placement.bid_again(placement_inst, record, now_ms, out)
        for victim in victims:
            # On this node's clock (a checkpoint's taken_ms is the workload's): since it took it.
            lost = None if victim.known_checkpoint is None else max(0, now_ms - victim.known_checkpoint[1])
            fence = victim.fence
            self.ctx.counters["jobs_preempted"] += 1
            # Its final checkpoint, read as its run stops, is handed over (P8d).
            self.lifecycle.preempted_here[victim.job_id] = (fence, now_ms + FINAL_CHECKPOINT_WAIT_MS)
            self.lifecycle.refuse(victim, now_ms, out)
            out.events.append(self.ctx.event("job_preempted", now_ms, job_id=victim.job_id.hex(), by=jid.hex(),
                                             fence=fence, attempt=fence // FENCE_PER_ATTEMPT,
                                             checkpoint_seq=victim.last_checkpoint_seq, lost_work_ms=lost))
