"""The slot flow: placements batched per slot window (SPEC.md P7).

A mesh whose genesis sets ``placement_slot_ms`` > 0 decides the first placement of
every job created in the same slot window (``created_ms // placement_slot_ms``, signed
by the job's owner) with ONE consensus instance, whose value lists those placements.
One proposal, one prevote and one precommit per member then carry up to
MAX_SLOT_JOBS placements, which divides the signatures and messages per job by the
batch size: what lets 1000 members place 1000 jobs in a run of the simulator.

Which instance may place a job's first attempt follows from the job alone, so two
instances never race for it: its slot, and only after the slot was decided without it
(a late job, or one with no eligible bid in time), its own instance, whose proposal
must carry the slot's commit certificate as proof (P7c). Bids, declines and
reservations are keyed by the job as in the unbatched mesh (P3), so a bid made for
the slot still counts in the job's own instance.
"""

from __future__ import annotations

from protocol import codec
from protocol.certificate import verify_commit_certificate
from protocol.codec import MAX_FRAME_BYTES
from protocol.errors import RemoteProtocolError
from protocol.flows.base import ValueFlow
from protocol.messages import (MAX_BIDS_PER_SLOT_JOB, MAX_SLOT_JOBS, Bid, CommitCertificate, PlacementSlot,
                               decode_message, decode_value, placement_slot, placement_slot_id, slot_binding_error,
                               slot_placements)
from protocol.placement import choose_placement, select_justification
from protocol.ready import Ready

SLOT = "placement_slot"
VOTE_ENVELOPE_BYTES = 256        # one signed vote in a certificate (249 bytes measured, plus framing)
WRAPPING_MARGIN_BYTES = 160 * 1024  # a job, 32 bids and the fields around a wrapped certificate
MIN_BUDGET_BYTES = 32 * 1024


def slot_budgets(members: int) -> tuple[int, int]:
    """(value, proposal) byte budgets of a slot in an epoch of ``members`` (P7b). What later
    wraps them must fit one frame: a round change carries the proposal and a prevote
    certificate; the slot's certificate carries the value and the precommits; a left-out
    job's own proposal carries that certificate, and its round change a prevote
    certificate too. (Beyond about 1500 members only the minimum is left.)"""
    votes = members * VOTE_ENVELOPE_BYTES
    return (max(MIN_BUDGET_BYTES, MAX_FRAME_BYTES - 2 * votes - WRAPPING_MARGIN_BYTES),
            max(MIN_BUDGET_BYTES, MAX_FRAME_BYTES - votes - WRAPPING_MARGIN_BYTES))


class SlotFlow(ValueFlow):
    value_kind = SLOT
    places_jobs = True
    value_kinds = (SLOT,)
    max_justification = None     # a slot proposal carries the bids of up to MAX_SLOT_JOBS jobs (P7b)
    # SPEC.md 6.12a: a slot's rounds follow its measured decision time too, up to 8 genesis
    # timeouts: under load a slot took longer than 2 of them, and each round it timed out
    # re-sent every bid and job of the slot to the next leader.
    adapts_round_timeout = True
    adapted_timeout_max_factor = 8

    def __init__(self, ctx, epochs, jobs, ledger, instances, bidding, placement) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.instances = instances
        self.bidding = bidding
        self.placement = placement
        self.slot_ms = ctx.params.placement_slot_ms
        self.enabled = self.slot_ms > 0
        self.slot_jobs: dict[bytes, dict[bytes, None]] = {}   # slot instance -> job ids it may place
        self.short_of_bids: set[bytes] = set()                 # slots whose window closed with no job placeable

    @property
    def round_timeout_extra_ms(self) -> int:
        # A slot's leader waits one slot window before it gathers bids (P7b): its rounds
        # last that much longer, or members time out just as its decision arrives.
        return self.slot_ms

    def validators(self, sid: bytes) -> tuple:
        return self._validator(sid), None

    def bid_job(self, subject) -> None:
        return None   # bids name jobs, never a slot (P7a)

    def job_ids(self, sid: bytes, subject) -> tuple:
        return tuple(self.slot_jobs.get(sid, ()))

    def slotted(self, record) -> bool:
        """Whether the job's first placement is its slot's to decide (not decided without it yet)."""
        return (self.enabled and record.attempt == 0 and record.slot_certificate is None
                and not record.manifest.gang.is_gang)   # a gang is placed by its own instance (GA3)

    def slot_of(self, job) -> bytes:
        return placement_slot_id(job.epoch, placement_slot(job, self.slot_ms))

    def _waiting(self, sid: bytes) -> list:
        """The slot's jobs still waiting for it here, in job id order (the leader's order too)."""
        records = (self.jobs.get(jid) for jid in sorted(self.slot_jobs.get(sid, ())))
        return [r for r in records if r is not None and r.state == "pending" and self.slotted(r)]

    # --- joining a slot -------------------------------------------------------------------------
    def join(self, record, view, now_ms: int, out: Ready) -> None:
        job = record.manifest
        sid = self.slot_of(job)
        record.instance = sid
        if sid in self.instances.applied:
            # Its slot was decided without it (a placed job is not pending): its own instance now.
            certificate = self.instances.recent_certificates.get(sid)
            if certificate is None:
                record.hint = ("its slot was decided without it and this node no longer holds the slot's "
                               "certificate: its owner must sign it again")
                self.ctx.counters["slot_certificate_gone"] += 1
                return
            self._go_late(record, certificate, now_ms, out)
            return
        self.slot_jobs.setdefault(sid, {})[record.job_id] = None
        inst = self.instances.start(sid, self, (job.epoch, placement_slot(job, self.slot_ms)), view, now_ms, out)
        if inst is None:
            return
        self._send_my_bid(inst, record, now_ms, out)
        pending = self.instances.pending
        held = pending.pop(record.job_id, ())
        others = [item for item in held if not isinstance(item[1], Bid)]
        if others:  # messages of the job's own instance (P7c) wait for it
            pending[record.job_id] = others
        for envelope, message, data in held:
            if isinstance(message, Bid):  # bids that came before the job
                try:
                    self.bidding.on_bid(envelope, message, data, now_ms, out)
                except RemoteProtocolError:
                    self.ctx.counters["rejected_bid"] += 1

    def _go_late(self, record, certificate: bytes, now_ms: int, out: Ready) -> None:
        """P7c: the slot decided without the job: its first placement runs in its own instance,
        justified by the slot's certificate."""
        record.slot_certificate = certificate
        self.ctx.counters["slot_late_jobs"] += 1
        self.placement.start(record, now_ms, out)
        inst = self.instances.get(record.instance)
        if inst is not None:  # its round-0 leader may never have seen the job (P2 with bid sampling)
            self.placement.show_job_to_leader(inst, record, out)

    def instance_from_proposal(self, proposal, value: PlacementSlot, view, now_ms: int, out: Ready):
        """A proposal for a slot we have not started: its jobs come with it."""
        sid = proposal.instance
        try:
            items = slot_placements(value, self.ctx.mesh_id, caches=self.ctx.caches)
        except RemoteProtocolError:
            self.ctx.counters["slot_proposal_bad_job"] += 1
            return None
        if slot_binding_error(sid, value, items, view.epoch, self.slot_ms) is not None:
            self.ctx.counters["placement_wrong_epoch"] += 1
            return None
        for placement, job, jid in items:
            record = self.jobs.get_or_add(jid, placement.job, job, now_ms)
            if record.state == "pending" and self.slotted(record):
                record.instance = sid
                self.slot_jobs.setdefault(sid, {})[jid] = None
        return self.instances.start(sid, self, (value.epoch, value.slot), view, now_ms, out)

    # --- bids -----------------------------------------------------------------------------------
    def live_slot_of(self, jid: bytes):
        """The live slot instance that may place job ``jid`` here, or None."""
        record = self.jobs.get(jid)
        if record is None or not self.slotted(record):
            return None
        inst = self.instances.get(record.instance)
        role = self.instances.role(record.instance)
        return inst if inst is not None and role.flow is self else None

    def _send_my_bid(self, inst, record, now_ms: int, out: Ready) -> None:
        if record.state == "pending":
            self.bidding.answer_once(inst, record, record.job_id, now_ms, out)

    def on_slot_bid(self, inst, bid: Bid, data: bytes, now_ms: int, out: Ready) -> None:
        facts = self.bidding.parse_member_bid(data, bid.instance, inst.view)
        if self.bidding.hold(bid.instance, facts, data) and inst.instance_id in self.short_of_bids:
            # The window closed with no job placeable: the first eligible bid since is proposed
            # at once, rather than after the round's timeout and a round change (P7b).
            self._propose(inst, now_ms, out)

    # --- the leader's proposal --------------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        """Round 0 waits one slot window for the slot's jobs to arrive, then a bid window;
        later rounds only the bid window (their jobs and bids are here or re-sent)."""
        sid = inst.instance_id
        windows = self.bidding.windows_open
        if windows.get(sid) == inst.round:
            return
        windows[sid] = inst.round
        self.short_of_bids.discard(sid)
        wait = self.ctx.params.bid_window_ms + (self.slot_ms if inst.round == 0 else 0)
        self.instances.schedule(inst, "bid_window", now_ms + wait)
        for record in self._waiting(sid):
            self._send_my_bid(inst, record, now_ms, out)

    def on_bid_window_closed(self, inst, now_ms: int, out: Ready) -> None:
        self._propose(inst, now_ms, out)

    def _propose(self, inst, now_ms: int, out: Ready) -> None:
        """Every slot job with an eligible bid, in job id order, up to MAX_SLOT_JOBS and a
        proposal that fits a frame. A job with no eligible bid yet is left out: it is placed
        by its own instance once the slot is decided (P7c)."""
        sid = inst.instance_id
        if not inst.awaiting_value or self.bidding.windows_open.get(sid) != inst.round:
            return
        value_budget, proposal_budget = slot_budgets(len(inst.view.members))
        stakes = self.epochs.view.stakes
        items, justification, size, value_size = [], [], 0, 0
        for record in self._waiting(sid):
            held = self.bidding.held.get(record.job_id, {})
            # Members evicted since the slot's epoch are fenced: placing a job there strands it.
            live = [facts for facts, _ in held.values() if facts.signer in stakes]
            chosen = select_justification(record.manifest, record.job_id, live)
            placement = choose_placement(record.envelope, record.manifest, record.job_id, chosen,
                                         caches=self.ctx.caches)
            if placement is None:
                record.hint = "no eligible bid yet (%d bids, %d declines)" % (len(held), len(record.declines))
                continue
            # Only the primary's and the backups' bids: choose_placement over them gives the
            # same placement (the best of them first, then the rest by the same zone rule).
            bids = [held[key][1] for key in (placement.primary,) + tuple(placement.backups)]
            value_cost = len(record.envelope) + 40 * (2 + len(placement.backups))
            cost = value_cost + sum(map(len, bids))
            if (len(items) == MAX_SLOT_JOBS or value_size + value_cost > value_budget
                    or size + cost > proposal_budget):
                break
            items.append(placement)
            justification.extend(bids)
            size += cost
            value_size += value_cost
        if not items:
            # Wait for an eligible bid (on_slot_bid), or the round times out and a later
            # leader, with a doubled bid sample, tries again.
            self.short_of_bids.add(sid)
            return
        self.short_of_bids.discard(sid)
        _epoch, slot = self.instances.role(sid).subject
        value = PlacementSlot(epoch=inst.view.epoch, slot=slot, placements=tuple(items))
        self.instances.drive(inst, inst.propose(codec.pack(value.to_body()), tuple(justification), now_ms), now_ms,
                             out)

    def _validator(self, sid: bytes):
        mesh_id = self.ctx.mesh_id

        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.live_or_decided(sid)   # the one asking
            view = inst.view if inst is not None else self.epochs.view
            try:
                value = decode_value(SLOT, value_bytes, caches=self.ctx.caches)
                items = slot_placements(value, mesh_id, caches=self.ctx.caches)
                problem = slot_binding_error(sid, value, items, view.epoch, self.slot_ms)
                if problem is not None:
                    return problem
                bids_of: dict[bytes, list] = {}
                for data in justification:
                    _envelope, bid = decode_message(data, mesh_id, expect=Bid, caches=self.ctx.caches)
                    bids_of.setdefault(bid.instance, []).append(data)
                if set(bids_of) - {jid for _p, _j, jid in items}:
                    return "a bid for a job the slot does not place"
                for placement, job, jid in items:
                    bids = bids_of.get(jid, ())
                    if len(bids) > MAX_BIDS_PER_SLOT_JOB:
                        return "more than %d bids for one placement" % MAX_BIDS_PER_SLOT_JOB
                    facts = [self.bidding.parse_member_bid(data, jid, view) for data in bids]
                    if choose_placement(placement.job, job, jid, facts, caches=self.ctx.caches) != placement:
                        return "placement of job %s does not follow from its bids" % jid.hex()[:12]
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid slot proposal: %s" % exc
            return None
        return validate

    def exclusion_error(self, job, jid: bytes, certificates: list, view) -> str | None:
        """P7c: a first placement outside its slot must prove the slot decided without it."""
        if len(certificates) != 1:
            return "a job's first placement outside its slot needs the slot's commit certificate"
        try:
            cert, value_bytes = verify_commit_certificate(certificates[0], self.ctx.mesh_id, view,
                                                          caches=self.ctx.caches)
            if cert.instance != self.slot_of(job) or cert.value_kind != SLOT:
                return "the certificate is not of the job's slot"
            value = decode_value(SLOT, value_bytes, caches=self.ctx.caches)
            if any(jid == other for _p, _j, other in slot_placements(value, self.ctx.mesh_id, caches=self.ctx.caches)):
                return "the job's slot placed it"
        except RemoteProtocolError as exc:
            return "slot certificate: %s" % exc
        return None

    def split_justification(self, justification: tuple) -> tuple[list, list]:
        """(bids, commit certificates) of a placement proposal's justification."""
        bids, certificates = [], []
        for data in justification:
            _envelope, message = decode_message(data, self.ctx.mesh_id, caches=self.ctx.caches)
            (certificates if isinstance(message, CommitCertificate) else bids).append(data)
        return bids, certificates

    # --- rounds, giving up, the decision -------------------------------------------------------------
    def on_round_changed(self, inst, now_ms: int, out: Ready) -> None:
        for record in self._waiting(inst.instance_id):
            self.placement.show_job_to_leader(inst, record, out)
            self.placement.broadcast_job_after_round_zero(inst, record, out)
            self.bidding.refresh_decline(inst, record, now_ms)
            self._send_my_bid(inst, record, now_ms, out)

    def _release_bids(self, sid: bytes) -> list:
        """Forget a slot that will not decide here: its jobs' reservations, bids and window.
        Returns the job ids it held."""
        self.bidding.windows_open.pop(sid, None)
        self.short_of_bids.discard(sid)
        jids = list(self.slot_jobs.pop(sid, {}))
        for jid in jids:
            self.ledger.release(jid)
            self.bidding.mine.pop(jid, None)
            self.bidding.held.pop(jid, None)
        return jids

    def on_dropped(self, sid: bytes) -> None:
        self._release_bids(sid)
        self.ledger.release(sid)
        self.bidding.forget(sid)

    def on_gave_up(self, sid: bytes, subject, now_ms: int, out: Ready) -> None:
        for jid in self._release_bids(sid):
            record = self.jobs.get(jid)
            if record is not None and record.state == "pending" and self.slotted(record):
                record.hint = "its slot gave up after %d rounds; resubmit to retry" % self.ctx.params.max_rounds
                record.instance = b""
                out.events.append(self.ctx.event("job_gave_up", now_ms, job_id=jid.hex()))

    def binding_error(self, sid: bytes, value_kind: str, value, epoch: int) -> str | None:
        return self.value_binding_error(sid, value_kind, value, epoch, self.ctx.mesh_id, self.slot_ms,
                                        caches=self.ctx.caches)

    @staticmethod
    def value_binding_error(sid: bytes, value_kind: str, value, epoch: int, mesh_id: bytes,
                            slot_ms: int, caches=None) -> str | None:
        """SPEC P7: a slot's instance is its (epoch, slot), and it places only that slot's jobs."""
        try:
            return slot_binding_error(sid, value, slot_placements(value, mesh_id, caches=caches), epoch, slot_ms)
        except RemoteProtocolError:
            return "a job that is not signed by its owner"

    def apply(self, sid: bytes, value_kind: str, value: PlacementSlot, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        placed = set()
        for placement, _job, jid in slot_placements(value, self.ctx.mesh_id, caches=self.ctx.caches):
            placed.add(jid)
            self.placement.apply_placement(jid, placement, certificate, epoch, now_ms, out, instance=sid)
        self.bidding.windows_open.pop(sid, None)
        self.short_of_bids.discard(sid)
        for jid in self.slot_jobs.pop(sid, {}):
            record = self.jobs.get(jid)
            if jid not in placed and record is not None and record.state == "pending" and self.slotted(record):
                self._go_late(record, certificate, now_ms, out)
