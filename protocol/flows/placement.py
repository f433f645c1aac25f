"""The placement flow: one job's attempt placed by its own instance (SPEC.md P2-P5).

A job arrives (from its owner or a peer), its record is created in the job table, and
its placement starts in the one epoch it names (P2). Members answer with bids or
declines (protocol/bidding.py); the round's leader proposes the placement that the
deterministic scoring (protocol/placement.py) computes from the bids it holds; every
validator recomputes it from the same bids. The decided placement sets the job's
primary, backups and fence from the certificate alone, and allocates the capacity in
the ledger of the node that runs it.

With placement slots (P7) a job's first attempt is its slot's to place (flows/slot.py);
only a job the slot decided without runs its first attempt here, with the slot's
certificate as proof (P7c).
"""

from __future__ import annotations

import dataclasses

from protocol import codec
from protocol.certificate import next_epoch_view
from protocol.errors import LocalProtocolError, RemoteProtocolError, SubmitOverloaded
from protocol.flows.base import ValueFlow
from protocol.job_queue import queue_key
from protocol.job_table import FENCE_PER_ATTEMPT, TERMINAL
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, CommitCertificate, JobManifest, Placement, QuotaGrant,
                               decode_message,
                               decode_value, job_id, placement_attempt, placement_binding_error,
                               placement_instance_id)
from protocol.placement import choose_placement, select_justification, wanted_backups
from protocol.quota_admission import grant_error
from protocol.ready import Outbound, Ready

MAX_JOBS_SHOWN = 4096           # (leader, instance) pairs we sent a job to, then forgotten
BID_WINDOW_EXTENSION = 4         # bid windows to wait once more when bids are too few for the backups


class PlacementFlow(ValueFlow):
    value_kind = "placement"
    places_jobs = True
    value_kinds = ("placement",)
    adapts_round_timeout = True
    max_justification = MAX_BIDS_PER_PROPOSAL + 2   # the bids, a slot's certificate (P7c), a quota grant (Q2c)
    gangs = None   # the GangFlow, set by the core: a gang job's attempts are its to place (GA3)

    def __init__(self, ctx, epochs, jobs, ledger, instances, bidding, apply_certificate_bytes) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.instances = instances
        self.bidding = bidding
        self.apply_certificate_bytes = apply_certificate_bytes   # the core's: a slot's certificate (P7c)
        self.slots = None          # the SlotFlow, EpochChangeFlow and JobLifecycle, set by the core
        self.epoch_changes = None
        self.lifecycle = None
        self.jobs_shown: set[tuple] = set()    # (leader, instance, job, round) we sent the job to (SPEC P3)
        # SPEC 10.5a: ids of the jobs whose entry is this node and that have not ended, so the
        # admission count on every submit reads these, not all of the table (up to MAX_JOBS).
        self._entered_here: set[bytes] = set()
        self.declines_forwarded: set[tuple] = set()   # (instance, round) whose declines we forwarded (P3a)
        # The ledger version and GPU health reconsider_held last saw: a change of either may
        # turn a decline into a bid (freed capacity, a GPU cooled down).
        self.reconsidered_at_stamp: tuple | None = None

    def bid_job(self, subject) -> bytes:
        return subject

    def job_ids(self, iid: bytes, subject) -> tuple:
        return (subject,)

    def timed_as(self, subject):
        """SPEC.md 6.12b: a late job's own attempt-0 instance (P7c) is timed as the slots are:
        it runs under the same load, and at a placement's cap (2 G) a loaded n = 16 mesh timed
        out rounds 0-2 of nearly all of them (1,419 round changes in one 27 s run)."""
        record = self.jobs.get(subject) if self.slots is not None and self.slots.enabled else None
        late = record is not None and record.attempt == 0 and record.slot_certificate is not None
        return self.slots if late else self

    def validators(self, iid: bytes) -> tuple:
        return self._validator(iid), None

    # --- jobs arriving (SPEC P2) ------------------------------------------------------------------
    def submit(self, job_envelope: bytes, now_ms: int, max_undecided: int = 0) -> Ready:
        """A signed job from a local owner: send it on (P2: broadcast, or with bid sampling
        only to those who need it) and start its placement."""
        out = Ready()
        envelope, job = decode_message(job_envelope, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                       caches=self.ctx.caches)
        if envelope.signer != job.owner:
            raise RemoteProtocolError("job is not signed by its owner")
        if max_undecided and self.jobs.get(job_id(job)) is None:
            undecided = self.undecided_submissions()
            if undecided >= max_undecided:
                raise SubmitOverloaded(undecided, max_undecided, self.retry_after_ms())
        epoch = self.epochs.epoch
        if job.epoch > epoch or self.epochs.view_for(job.epoch) is None:
            raise LocalProtocolError(
                "the job names epoch %d, which this node %s (it is at epoch %d): sign it again for the "
                "current epoch" % (job.epoch, "has not reached" if job.epoch > epoch else "no longer holds", epoch))
        quotas = self.bidding.scheduling.quotas
        pool_error = quotas.unknown_pool_error(job) or quotas.never_fits_error(job)
        if pool_error is not None:
            raise LocalProtocolError("scheduling.pool: " + pool_error)   # Q1: refused before it is sent
        self.on_job(envelope, job, job_envelope, now_ms, out, entry=self.ctx.me)
        record = self.jobs.get(job_id(job))
        out.messages[0:0] = [Outbound(to, job_envelope) for to in self._job_recipients(record)]
        return out

    def undecided_submissions(self) -> int:
        """SPEC 10.5: jobs submitted to this node (it is their entry) whose placement (or
        slot) instance is open here and undecided. A job waiting for capacity, with no
        instance open, is not counted: the mesh decided it fits nowhere yet."""
        open_instances, undecided = self.instances.instances, 0
        for jid in list(self._entered_here):
            record = self.jobs.get(jid)
            if record is None or record.state in TERMINAL:
                self._entered_here.discard(jid)   # ended or dropped: never pending again
            elif record.state == "pending" and record.instance in open_instances:
                undecided += 1
        return undecided

    def retry_after_ms(self) -> int:
        """SPEC 10.5: when a refused submitter should try again: the round timeout this node
        would give a new placement now (6.12: four times its recent decision time, between the
        genesis round_timeout_ms and twice it)."""
        return self.instances.decision_times_of(self).round_timeout_ms(self.ctx.params.round_timeout_ms)

    def _job_recipients(self, record) -> list:
        """SPEC P2: who the entry node sends a new job to. Everyone (``None``: broadcast),
        unless members bid by sample (P3): then the members sampled to bid in round 0 and
        round 0's leader. The others learn the job from the proposal or certificate that
        carries it, or from the entry node's broadcast if round 0 fails; a job broadcast to
        1000 members cost more than deciding it (BENCHMARKS.md, "Simulator scale")."""
        inst = self.instances.get(record.instance)
        if self.ctx.bid_sample is None or inst is None or inst.round > 0:
            return [None]
        me, members = self.ctx.me, inst.view.members
        chosen = [key for key in members
                  if key != me and self.bidding.sampled(record.job_id, 0, len(members), key)]
        admission = self.bidding.scheduling.admission
        homes = admission.homes_of(record.manifest) if admission.needs_grant(record.manifest) else ()
        for key in (inst.leader, *homes):   # the leader proposes; the quota homes grant it (Q2b)
            if key not in (None, me) and key not in chosen:
                chosen.append(key)
        return chosen

    def on_job(self, envelope, job: JobManifest, data: bytes, now_ms: int, out: Ready,
               entry: bytes | None = None) -> None:
        if envelope.signer != job.owner:
            self.ctx.counters["job_not_signed_by_owner"] += 1
            return
        jid = job_id(job)
        record = self.jobs.get(jid)
        if record is None:
            record = self.jobs.add(jid, data, job, now_ms)
            out.events.append(self.ctx.event("job_submitted", now_ms, job_id=jid.hex(), name=job.name))
        if record.entry is None:
            record.entry = entry
            if entry == self.ctx.me:
                self._entered_here.add(jid)
        if record.state == "pending" and record.instance not in self.instances.instances:
            # Not started yet, or its instance was dropped (an evicted node drops those only
            # it ran, F7): the job, shown again by a round's leader-to-be (P3), starts it.
            self.start(record, now_ms, out)

    def start(self, record, now_ms: int, out: Ready) -> None:
        """Start the job's placement in the one epoch it runs in (SPEC.md P2), if this node
        holds that epoch's view; a job of a later epoch waits until this node enters it."""
        if self.gangs is not None and record.manifest.gang.is_gang:
            self.gangs.start(record, now_ms, out)
            return
        epoch = record.manifest.epoch
        record.state = "pending"
        view = self.epochs.view_for(epoch)
        if view is None:
            record.instance = b""
            if epoch > self.epochs.epoch:
                record.hint = "waiting for this node to reach epoch %d" % epoch
                self.ctx.counters["job_for_future_epoch"] += 1
            else:
                record.hint = ("placed by epoch %d, whose view this node no longer holds: its owner must "
                               "sign it again for the current epoch" % epoch)
                self.ctx.counters["job_epoch_view_gone"] += 1
            return
        if self.slots.slotted(record):
            self.slots.join(record, view, now_ms, out)
            return
        iid = placement_instance_id(record.job_id, record.attempt)
        record.instance = iid
        inst = self.instances.start(iid, self, record.job_id, view, now_ms, out)
        if inst is not None:
            self.bidding.send_mine(iid, now_ms, out)

    def start_placements_of_epoch(self, epoch: int, now_ms: int, out: Ready) -> None:
        """Jobs that named an epoch this node had not reached yet start their placement now."""
        for record in list(self.jobs):
            if record.state == "pending" and not record.instance and record.manifest.epoch == epoch:
                self.start(record, now_ms, out)

    def instance_from_proposal(self, proposal, placement: Placement, view, now_ms: int, out: Ready):
        iid = proposal.instance
        envelope, job = decode_message(placement.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                       caches=self.ctx.caches)
        binding = placement_binding_error(iid, job, view.epoch)
        if binding is not None:  # one instance id, one epoch (P2): no straddling it
            self.ctx.counters["placement_wrong_epoch"] += 1
            return None
        jid = job_id(job)
        record = self.jobs.get_or_add(jid, placement.job, job, now_ms)
        slots = self.slots
        in_slot = slots.enabled and record.instance == slots.slot_of(job) and iid == jid
        if record.state in TERMINAL or (record.instance and record.instance != iid and not in_slot):
            self.ctx.counters["placement_for_other_attempt"] += 1
            return None
        if slots.enabled and iid == jid and record.slot_certificate is None:
            # P7c: only the slot's certificate leaving the job out lets its own instance run;
            # without it anyone could start one beside the live slot (and hold its bids).
            certificates = slots.split_justification(proposal.justification)[1]
            if slots.exclusion_error(job, jid, certificates, view) is not None:
                self.ctx.counters["late_placement_without_slot_certificate"] += 1
                return None
            self.apply_certificate_bytes(certificates[0], now_ms, out)  # the slot is decided here too
            record.slot_certificate = record.slot_certificate or certificates[0]
        record.instance = iid
        return self.instances.start(iid, self, jid, view, now_ms, out)

    # --- the leader's proposal (SPEC P4) --------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        iid = inst.instance_id
        if self.bidding.windows_open.get(iid) != inst.round:
            self.bidding.windows_open[iid] = inst.round
            self.instances.schedule(inst, "bid_window", now_ms + self.ctx.params.bid_window_ms)
            self.bidding.send_mine(iid, now_ms, out)
        self._maybe_propose(inst, now_ms, out, window_closed=False)

    def on_answer(self, inst, now_ms: int, out: Ready) -> None:
        # A bid after the round's last bid window closed (room freed since: an exit, a
        # preemption, P3a, P8) is proposed with at once, not when the round times out.
        closed = self.bidding.windows_closed.get(inst.instance_id) == inst.round
        self._maybe_propose(inst, now_ms, out, window_closed=closed)
        self.forward_unanimous_declines(inst, out)

    def on_bid_window_closed(self, inst, now_ms: int, out: Ready) -> None:
        self._maybe_propose(inst, now_ms, out, window_closed=True)

    def bids_wanted(self, job) -> int:
        """Bids below which a closing bid window is extended once (P4b): a primary and its backups."""
        return 1 + wanted_backups(job)

    def _gathered_bids(self, inst, now_ms: int, window_closed: bool):
        """(record, held bids, live bids) once the leader may propose: every member answered,
        or the bid window closed (SPEC P4); None while it waits."""
        iid = inst.instance_id
        bidding = self.bidding
        if not inst.awaiting_value or bidding.windows_open.get(iid) != inst.round:
            return None
        record = self.jobs.get(self.instances.role(iid).subject)
        held = bidding.held.get(iid, {})
        if record is None:
            return None
        all_answered = bidding.all_answered(inst, held, record.declines)
        if not (window_closed or all_answered):
            return None
        if (window_closed and not all_answered
                and len(held) < self.bids_wanted(record.manifest) and iid not in bidding.windows_extended):
            # Too few bids for a primary and its backups: a placement without a backup
            # cannot fail over, so wait once more before settling (SPEC.md P4b).
            bidding.windows_extended.add(iid)
            self.instances.schedule(inst, "bid_window", now_ms + BID_WINDOW_EXTENSION * self.ctx.params.bid_window_ms)
            return None
        if window_closed:
            bidding.windows_closed[iid] = inst.round
        # A placement may run in an older epoch (P2): members evicted since are fenced, and
        # placing a job on one would only strand it.
        return record, held, [facts for facts, _ in held.values() if facts.signer in self.epochs.view.stakes]

    def _maybe_propose(self, inst, now_ms: int, out: Ready, window_closed: bool) -> None:
        """Propose once every member answered, or when the bid window closed (SPEC P4)."""
        gathered = self._gathered_bids(inst, now_ms, window_closed)
        if gathered is None:
            return
        iid = inst.instance_id
        record, held, live = gathered
        chosen = select_justification(record.manifest, iid, live)
        placement = choose_placement(record.envelope, record.manifest, iid, chosen, caches=self.ctx.caches)
        if placement is None:
            record.hint = "no eligible bid yet (%d bids, %d declines)" % (len(held), len(record.declines))
            return
        while placement is not None and self._lands_on(record, iid, placement, inst.view.epoch, now_ms) not in held:
            # The evictions since the job's epoch would move it to a node that did not bid, which
            # has no room reserved for it and would refuse it (R1): propose without that primary.
            chosen = [facts for facts in chosen if facts.signer != placement.primary]
            placement = choose_placement(record.envelope, record.manifest, iid, chosen, caches=self.ctx.caches)
        if placement is None:
            record.hint = ("every bidder's placement would move to a node without a bid (evictions since the "
                           "job's epoch: %d bids, %d declines)" % (len(held), len(record.declines)))
            return
        # Only the primary's and the backups' bids (P4b): choose_placement over them gives the
        # same placement, as in a slot (P7b), and every validator decodes and verifies 1 +
        # backups bids instead of every bid (at 16 members, 13 bids: 16.6 KB per proposal).
        named = {placement.primary, *placement.backups}
        justification = tuple(held[facts.signer][1] for facts in chosen if facts.signer in named)
        if record.outcome is not None and record.attempt > 0:
            # The exit or refusal that started this attempt (P6): voters that missed it hold
            # the job as placed before and would not join the instance.
            out.messages.append(Outbound(None, record.outcome))
        if self.slots.enabled and record.attempt == 0:
            if record.slot_certificate is None:
                return  # not this instance's to place before its slot is decided (P7c)
            justification += (record.slot_certificate,)
        admission = self.bidding.scheduling.admission
        if admission.needs_grant(record.manifest):
            grant = admission.grant_of(record)
            if grant is None:   # bidders send it with their bids, the home broadcasts it (Q2c)
                record.hint = "waiting for the job's quota grant to propose (%d bids)" % len(held)
                return
            justification += (grant,)
        self.instances.drive(inst, inst.propose(codec.pack(placement.to_body()), justification, now_ms), now_ms, out)

    def _lands_on(self, record, iid: bytes, placement: Placement, epoch: int, now_ms: int) -> bytes | None:
        """The node ``placement`` leaves the job's primary once every node applies it (P5):
        its primary, moved by the evictions decided since ``epoch`` as apply_placement moves
        it, computed on a copy of the record."""
        scratch = dataclasses.replace(record, primaries=dict(record.primaries), declines=dict(record.declines),
                                      acks={}, state="placed")
        attempt = placement_attempt(iid, record.manifest)
        scratch.primary, scratch.backups = placement.primary, tuple(placement.backups)
        scratch.fence = attempt * FENCE_PER_ATTEMPT + 1
        self._replay_evictions_since(scratch, epoch, now_ms, Ready())
        return scratch.primary

    def _validator(self, iid: bytes):
        mesh_id, slots = self.ctx.mesh_id, self.slots

        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.live_or_decided(iid)   # the one asking
            view = inst.view if inst is not None else self.epochs.view
            try:
                placement = decode_value("placement", value_bytes, caches=self.ctx.caches)
                envelope, job = decode_message(placement.job, mesh_id, expect=JobManifest, allow_any_mesh=True,
                                               caches=self.ctx.caches)
                if envelope.signer != job.owner:
                    return "job not signed by its owner"
                binding = placement_binding_error(iid, job, view.epoch)
                if binding is not None:
                    return binding
                justification, grants = self._split_grants(justification)
                problem = self._grant_problem(job, grants, view)
                if problem is not None:
                    return problem
                bids, certificates = slots.split_justification(justification)
                if len(bids) > MAX_BIDS_PER_PROPOSAL:
                    return "more than %d bids" % MAX_BIDS_PER_PROPOSAL
                if slots.enabled and placement_attempt(iid, job) == 0:
                    problem = slots.exclusion_error(job, job_id(job), certificates, view)
                    if problem is not None:
                        return problem
                elif certificates:
                    return "a certificate in a placement's justification"
                facts = [self.bidding.parse_member_bid(b, iid, view) for b in bids]
                expected = choose_placement(placement.job, job, iid, facts, caches=self.ctx.caches)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid placement proposal: %s" % exc
            if expected != placement:
                return "placement does not follow from its bids"
            return None
        return validate

    def _split_grants(self, justification: tuple) -> tuple[tuple, list]:
        """(the other envelopes, the quota grants) of a placement proposal's justification."""
        rest, grants = [], []
        for data in justification:
            envelope, _message = decode_message(data, self.ctx.mesh_id, caches=self.ctx.caches)
            (grants if envelope.kind == QuotaGrant.KIND else rest).append(data)
        return tuple(rest), grants

    def _grant_problem(self, job, grants: list, view) -> str | None:
        """Q2c: a job whose owner has a quota in its pool is placed only with its home's grant,
        checked from the proposal alone; any other job carries none."""
        if not self.bidding.scheduling.admission.needs_grant(job):
            return "a quota grant for a job whose owner has no quota in its pool" if grants else None
        if len(grants) != 1:
            return "a job whose owner has a quota in pool %r needs exactly one quota grant (%d given)" % (
                job.scheduling.pool, len(grants))
        return grant_error(grants[0], job, view, self.ctx.mesh_id, caches=self.ctx.caches)

    def on_grant(self, jid: bytes, now_ms: int, out: Ready) -> None:
        """A grant arrived: the leader of the job's round may propose with it now (Q2c)."""
        record = self.jobs.get(jid)
        inst = self.instances.get(record.instance) if record is not None and record.state == "pending" else None
        role = self.instances.role(inst.instance_id) if inst is not None else None
        if role is not None and role.flow is self and inst.leader == self.ctx.me:
            self.on_answer(inst, now_ms, out)

    # --- rounds and giving up -----------------------------------------------------------------------
    def on_round_changed(self, inst, now_ms: int, out: Ready) -> None:
        """SPEC P3: bids go to the current leader, so a new round re-sends ours."""
        record = self.jobs.get(self.instances.role(inst.instance_id).subject)
        self.show_job_to_leader(inst, record, out)
        self.broadcast_job_after_round_zero(inst, record, out)
        if record is not None and not self.bidding.refresh_decline(inst, record, now_ms, key=inst.instance_id):
            return
        self.bidding.send_mine(inst.instance_id, now_ms, out)

    def round_on_hold(self, inst, now_ms: int) -> bool:
        """SPEC P3a: every member of the instance's epoch declined the job (this node holds
        their signed declines: the round's leader forwards them all once it has them), so
        no round can place it: it waits in its round, quietly, instead of changing rounds
        until it gives up. A member whose capacity frees bids then, to all (reconsider_held),
        which ends the hold everywhere, and the round's leader proposes."""
        if inst.locked_round is not None:
            return False
        record = self._pending_record(inst)
        return record is not None and all(member in record.declines for member in inst.view.members)

    def _pending_record(self, inst):
        role = self.instances.role(inst.instance_id)
        record = self.jobs.get(role.subject) if role is not None else None
        return record if record is not None and record.state == "pending" else None

    def forward_unanimous_declines(self, inst, out: Ready) -> None:
        """P3a: the round's leader, holding a decline from every member, sends them all to
        every member (once per round), so all of them hold the round alike."""
        key = (inst.instance_id, inst.round)
        if inst.leader != self.ctx.me or key in self.declines_forwarded or not self.round_on_hold(inst, 0):
            return
        if len(self.declines_forwarded) >= MAX_JOBS_SHOWN:
            self.declines_forwarded.clear()
        self.declines_forwarded.add(key)
        out.messages.extend(Outbound(None, data) for data in self.answers_forwarded(inst))

    def answers_forwarded(self, inst) -> list:
        """What a held round's leader sends every member (P3a): every decline it holds."""
        return list(self.bidding.declined.get(inst.instance_id, {}).values())

    def reconsider_due(self) -> bool:
        """Whether ``reconsider_held`` has work: capacity, health or the scheduling state
        changed since it last looked, and this node declined a placement still open (P3a:
        the tick that follows an input re-decides it, no polling)."""
        if not self.instances.instances or not any(kind == "decline" for kind, _ in self.bidding.mine.values()):
            return False
        stamp = (self.ledger.version, self.bidding.capability.health_stamp(), self.bidding.scheduling.stamp())
        return stamp != self.reconsidered_at_stamp

    def reconsider_held(self, now_ms: int, out: Ready) -> None:
        """P3a: capacity or health changed here (an exit, a cancel, a migration, a reservation
        let go, a GPU healthy again, quota freed): each undecided placement this node declined
        is decided afresh, and a bid now goes to every member (it ends their hold; the leader
        proposes with it). Not only held rounds: a round that cannot hold (a member, perhaps
        Byzantine, never declines) would otherwise decide afresh only at its round changes,
        and the room freed between two of them goes to jobs that bid first (quota freed for
        a moment is taken by the owner's newer jobs, round after round)."""
        stamp = (self.ledger.version, self.bidding.capability.health_stamp(), self.bidding.scheduling.stamp())
        if stamp == self.reconsidered_at_stamp:
            return
        self.reconsidered_at_stamp = stamp
        declined = []
        for inst in list(self.instances.instances.values()):
            role = self.instances.role(inst.instance_id)
            if role is not None and role.flow is self and inst.locked_round is None:
                record = self._pending_record(inst)
                if record is not None and self.ctx.me in record.declines:
                    declined.append((record, inst))
        # Queue order (Q3), highest priority first: freed room goes to the job that would preempt for it (P8).
        for record, inst in sorted(declined, key=lambda pair: queue_key(pair[0])):
            self.bid_again(inst, record, now_ms, out)

    def bid_again(self, inst, record, now_ms: int, out: Ready) -> bool:
        """P3a: decide this node's decline of a held placement afresh; a bid now goes to every
        member (it ends their hold; the leader proposes with it). True if it bid."""
        iid = inst.instance_id
        if self.ctx.me not in record.declines or not self.bidding.refresh_decline(inst, record, now_ms, key=iid):
            return False
        if iid not in self.bidding.mine:
            # Our decline from before a restart, forwarded back to us (P3a): we answer afresh.
            self.bidding.send_mine(iid, now_ms, out)
        mine = self.bidding.mine.get(iid)
        if mine is None or mine[0] != "bid":
            return False
        out.messages.append(Outbound(None, mine[1]))
        self.bidding.send_mine(iid, now_ms, out)
        return True

    def show_job_to_leader(self, inst, record, out: Ready) -> None:
        """SPEC P3: the job goes with our round change to a new round's leader, once per round
        (a leader shown it before it crashed has forgotten it again).
        A leader that crashed and restarted forgot the undecided instance (and an evicted one
        may have dropped it): only a proposal would bring it back, and it is that leader's
        turn to propose. From the job it runs the instance again, in the job's epoch (P2)."""
        key = (inst.leader, inst.instance_id, record.job_id if record is not None else b"", inst.round)
        if record is None or inst.leader == self.ctx.me or key in self.jobs_shown:
            return
        if len(self.jobs_shown) >= MAX_JOBS_SHOWN:
            self.jobs_shown.clear()
        self.jobs_shown.add(key)
        out.messages.append(Outbound(inst.leader, record.envelope))
        if record.outcome is not None and record.attempt > 0:
            out.messages.append(Outbound(inst.leader, record.outcome))  # why the job is pending again (P6)

    def broadcast_job_after_round_zero(self, inst, record, out: Ready) -> None:
        """P2: with bid sampling the entry node sent the job only to round 0's sample and
        leader. Once round 0 failed, every member must run the instance (a later round's
        leader waits for round changes from a quorum, 6.5; the doubled sample bids, P3),
        so the entry node and round 0's leader (should the entry have failed) broadcast the
        job, once per round (a broadcast lost to a partition is not the last)."""
        key = (None, inst.instance_id, record.job_id if record is not None else b"", inst.round)
        if (record is None or inst.round == 0 or self.ctx.bid_sample is None or key in self.jobs_shown
                or self.ctx.me not in (record.entry, inst.view.leader(inst.instance_id, 0))):
            return
        self.jobs_shown.add(key)
        out.messages.append(Outbound(None, record.envelope))

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        self.on_dropped(iid)
        record = self.jobs.get(subject)
        if record is not None and record.state == "pending":
            record.hint = "placement gave up after %d rounds; resubmit to retry" % self.ctx.params.max_rounds
            record.instance = b""
            out.events.append(self.ctx.event("job_gave_up", now_ms, job_id=record.job_id.hex()))

    def on_dropped(self, iid: bytes) -> None:
        self.ledger.release(iid)
        self.bidding.forget(iid)

    # --- a placement is decided (SPEC P5) ------------------------------------------------------------
    def binding_error(self, iid: bytes, value_kind: str, placement, epoch: int) -> str | None:
        return self.value_binding_error(iid, value_kind, placement, epoch, self.ctx.mesh_id, 0, caches=self.ctx.caches)

    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, placement, epoch: int, mesh_id: bytes,
                            slot_ms: int, caches=None) -> str | None:
        """SPEC P2: a placement's instance is its job's attempt, in the job's epoch."""
        envelope, job = decode_message(placement.job, mesh_id, expect=JobManifest, allow_any_mesh=True,
                                       caches=caches)
        if envelope.signer != job.owner:   # honest validators checked it (P4b); a forged quorum may not have
            return "a job that is not signed by its owner"
        if job.gang.is_gang:
            return "a gang is placed by a gang_placement (GA3), not a placement"
        return placement_binding_error(iid, job, epoch)

    def apply(self, iid: bytes, value_kind: str, placement, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        self.apply_placement(iid, placement, certificate, epoch, now_ms, out)

    def apply_placement(self, iid: bytes, placement: Placement, certificate: bytes, certificate_epoch: int,
                        now_ms: int, out: Ready, instance: bytes | None = None) -> None:
        """``iid``: the placement's key (its instance, or its job id in a slot ``instance``)."""
        me = self.ctx.me
        envelope, job = decode_message(placement.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                       caches=self.ctx.caches)
        jid = job_id(job)
        record = self.jobs.get_or_add(jid, placement.job, job, now_ms)
        self.bidding.forget(iid)
        attempt = placement_attempt(iid, job)  # never None: the core checked the binding
        if record.state == "cancelled" or attempt < record.attempt:
            # A late certificate of an attempt that has failed since (P6) changes nothing.
            self.ctx.counters["placement_of_earlier_attempt"] += record.state != "cancelled"
            self.ledger.release(iid)
            return
        if attempt > record.attempt:
            record.outcome = None  # a node that missed an exit or refusal learns the attempt here
            if record.primary == me:
                # It ran an earlier attempt here and missed how it ended (a refusal it did not
                # hear, then a migration here): that attempt's allocation goes (R1).
                self.ledger.free(jid)
        record.attempt = attempt
        record.instance = instance or iid
        # The fence from the certificate alone, not by counting what this node happened to
        # apply: a node that missed an attempt (or learns it late) gets the fence the others have.
        self.jobs.assign(record, placement.primary, placement.backups, placement.gpus,
                         fence=attempt * FENCE_PER_ATTEMPT + 1)
        record.state = "placed"
        record.hint = None
        record.placed_ms = now_ms
        out.events.append(self.ctx.event("placed", now_ms, job_id=jid.hex(), primary=placement.primary.hex(),
                                         fence=record.fence))
        self._replay_evictions_since(record, certificate_epoch, now_ms, out)
        # Only where the job ends up, once the evictions since moved it (R1): its primary
        # allocates it from its bid's reservation, or from what is free now, or refuses it.
        if record.primary == me and record.state not in TERMINAL:
            self.lifecycle.admit(record, iid, now_ms, out)
        else:
            self.ledger.release(iid)
            if record.state not in TERMINAL:
                self.lifecycle.hand_off_checkpoint(record, out)   # a refused job's work goes on there (R1)

    def _replay_evictions_since(self, record, epoch: int, now_ms: int, out: Ready) -> None:
        """SPEC P5: a placement runs in its job's epoch (P2), so it may be decided after later
        epoch changes were applied here. It goes through each eviction decided since its
        certificate's epoch, in order, by the rule F5 applied to the jobs known then (the
        eviction's plan, else the first live backup): every node ends with the same primary,
        backups and fence however late it learnt the placement."""
        view = self.epochs.view_for(epoch)  # held: the placement's certificate verified against it
        for ended, certificate in list(self.epochs.certificates):
            if ended < epoch:
                continue
            if view is None or ended != view.epoch or record.state in TERMINAL:
                return  # a gap in the kept history (64 changes), or nothing left to move
            _envelope, cert = decode_message(certificate, self.ctx.mesh_id, expect=CommitCertificate,
                                             caches=self.ctx.caches)
            change = decode_value(cert.value_kind, cert.value, caches=self.ctx.caches)
            # Each epoch's view from the changes themselves, not from the views this node
            # still keeps (8): a node far behind computes what one in time saw.
            view = next_epoch_view(view, cert.value_kind, change)
            if cert.value_kind == "eviction" and view is not None and record.primary == change.node:
                # Nothing is allocated yet: apply_placement admits the job where it ends up.
                self.epoch_changes.move_jobs_of_evicted([record], change, view, now_ms, out, admit=False)
