"""Bids and declines (SPEC.md P3): each sampled member answers a job once per placement
key, with a bid that reserves capacity in the ledger or a decline that says why, and
sends it to the round's leader; a leader holds the verified bids it will propose from.

A placement key is the placement instance id of a job's attempt, or the job id while the
job waits for its slot (P7a): bids, declines and reservations stay keyed by job there, so
a bid made for the slot still counts in the job's own instance.
"""

from __future__ import annotations

import hashlib

from protocol.errors import RemoteProtocolError
from protocol.job_table import TERMINAL
from protocol.messages import Bid, Decline, decode_message
from protocol.placement import eligibility, pack_share_choice, parse_bid, reservable_gpu_mem_mib
from protocol.pool_scheduling import PoolScheduling
from protocol.ready import Outbound, Ready

MAX_BIDS_HELD = 128              # bids a leader holds per instance (it proposes the best 32)
MAX_DECLINERS_KEPT = 256         # per job, for "why pending"
BID_LIFETIME_ROUNDS = 8          # a restored reservation whose instance does not run here again ends after
                                 # this many maximal round timeouts (R1)


class Bidding:
    def __init__(self, ctx, epochs, jobs, ledger, capability, instances) -> None:
        self.ctx = ctx
        self.epochs = epochs
        self.jobs = jobs
        self.ledger = ledger
        self.capability = capability
        self.instances = instances
        self.slots = None   # the SlotFlow, set by the core: a bid may be for a job its slot places
        self.mine: dict[bytes, tuple[str, bytes]] = {}          # placement key -> ("bid"|"decline", envelope)
        self.held: dict[bytes, dict[bytes, tuple]] = {}         # placement key -> signer -> (BidFacts, bytes)
        self.windows_open: dict[bytes, int] = {}                # instance -> round whose bid window is open
        self.windows_extended: set[bytes] = set()               # instances whose bid window was extended once
        self.windows_closed: dict[bytes, int] = {}              # instance -> round whose last bid window closed
        self.declined: dict[bytes, dict[bytes, bytes]] = {}     # placement key -> signer -> Decline envelope
        self.sample_of: dict[bytes, tuple[int, tuple]] = {}     # instance -> (round, the members sampled in it)
        self.scheduling = PoolScheduling(ctx, epochs, jobs, ledger, self.jobs_bid_for, capability)   # quotas and reservations (Q2, Q5)

    def forget(self, key: bytes) -> None:
        """Everything held for a placement key that will not be proposed here any more:
        our answer, the bids we gathered, its bid window."""
        self.mine.pop(key, None)
        self.held.pop(key, None)
        self.windows_open.pop(key, None)
        self.windows_extended.discard(key)
        self.windows_closed.pop(key, None)
        self.declined.pop(key, None)
        self.sample_of.pop(key, None)

    def jobs_bid_for(self) -> list:
        """Records of the pending jobs this node holds a live bid for (Q2 counts them)."""
        out = []
        for key, (kind, _data) in self.mine.items():
            if kind != "bid":
                continue
            role = self.instances.role(key)
            jid = role.flow.bid_job(role.subject) if role is not None else key   # a slot's bids: by job id
            record = self.jobs.get(jid) if jid is not None else None
            if record is not None and record.state == "pending":
                out.append(record)
        return out

    def sampled(self, key: bytes, round: int, members: int, member: bytes | None = None) -> bool:
        """SPEC P3: about ``bid_sample << round`` of the ``members`` bid in ``round``. The sample
        doubles every round, so a job the first sample cannot host (all ineligible) is still
        placed once a round times out without a proposal. ``key``: the job's placement key;
        ``member``: the member asked about (default: this node)."""
        sample = None if self.ctx.bid_sample is None else self.ctx.bid_sample << min(round, 64)
        if sample is None or sample >= members:
            return True
        draw = int.from_bytes(hashlib.sha256(b"bidder" + key + (member or self.ctx.me)).digest()[:8], "big")
        return draw * members < sample << 64

    def all_answered(self, inst, held: dict, declines: dict) -> bool:
        """SPEC P4b: whether every member asked to answer in ``inst``'s round did (a bid or a
        decline): every member of its epoch, or with bid sampling (P3) every member sampled
        in the round. Without the sample rule a leader of a sampled round waited for the bid
        window each time, for answers that never come."""
        members = inst.view.members
        if self.ctx.bid_sample is None:
            return len(held) + len(declines) >= len(members)
        iid = inst.instance_id
        cached = self.sample_of.get(iid)
        if cached is None or cached[0] != inst.round:
            cached = self.sample_of[iid] = (inst.round, tuple(
                key for key in members if self.sampled(iid, inst.round, len(members), key)))
        return all(key in held or key in declines for key in cached[1])

    def send_mine(self, iid: bytes, now_ms: int, out: Ready) -> None:
        """Our answer for the placement instance ``iid``, to its current leader."""
        inst = self.instances.get(iid)
        role = self.instances.role(iid)
        record = self.jobs.get(role.subject) if role is not None else None
        if inst is not None and record is not None and record.state not in TERMINAL:
            self.answer_once(inst, record, iid, now_ms, out)

    def answer_once(self, inst, record, key: bytes, now_ms: int, out: Ready) -> None:
        """SPEC P3: a sampled member decides once per placement ``key`` (an instance, or a
        job id in a slot) whether it bids or declines, and sends that to ``inst``'s leader."""
        if self.ctx.me not in inst.view.stakes:
            return
        mine = self.mine.get(key)
        if mine is None:
            if not self.sampled(key, inst.round, len(inst.view.members)):
                return
            mine = self.make_bid_or_decline(key, inst.view.epoch, record, now_ms)
            self.mine[key] = mine
            out.events.append(self.ctx.event("bid" if mine[0] == "bid" else "declined", now_ms,
                                             instance=inst.instance_id.hex(), job_id=record.job_id.hex()))
        elif mine[0] == "bid":
            self.ledger.keep(key)   # a bid restored after a restart: its instance runs here again (R1)
        self._deliver(inst, record, mine, now_ms, out)

    def _deliver(self, inst, record, mine: tuple, now_ms: int, out: Ready) -> None:
        kind, data = mine
        me, mesh_id = self.ctx.me, self.ctx.mesh_id
        if kind == "decline":
            # To the leader (it counts answers) and the job's entry node (the owner asks it
            # "why pending"), not to everyone: a broadcast per decliner is n^2 per job.
            for target in sorted({inst.leader, record.entry} - {None, me}):
                out.messages.append(Outbound(target, data))
            envelope, decline = decode_message(data, mesh_id, expect=Decline, caches=self.ctx.caches)
            self.on_decline(envelope, decline, data, now_ms, out)
        elif inst.leader == me:
            envelope, bid = decode_message(data, mesh_id, expect=Bid, caches=self.ctx.caches)
            self.on_bid(envelope, bid, data, now_ms, out)
        else:
            grant = self.scheduling.admission.grant_of(record)
            if grant is not None:   # the leader proposes with it (Q2c): it may have missed the home's broadcast
                out.messages.append(Outbound(inst.leader, grant))
            out.messages.append(Outbound(inst.leader, data))

    def parse_member_bid(self, data: bytes, key: bytes, view):
        """parse_bid, plus SPEC.md P4: the capability vector's zone and labels must be the
        signer's member record (genesis or join), signed facts a bidder cannot lie about."""
        facts = parse_bid(data, self.ctx.mesh_id, key, view.epoch, view.stakes, self.ctx.authorities,
                          caches=self.ctx.caches)
        record = self.epochs.member_info.get(facts.signer)
        # Both label sets are canonical sorted pairs (schema TextMap): compared as they are.
        if record is not None and (facts.capability.zone != record.zone or facts.capability.labels != record.labels):
            raise RemoteProtocolError("bid's capability zone or labels contradict the member record")
        return facts

    def make_bid_or_decline(self, key: bytes, epoch: int, record, now_ms: int) -> tuple[str, bytes]:
        job = record.manifest
        cap_envelope, cap, _ = self.capability.current(now_ms)
        ok, reason, detail = eligibility(job, cap, self.ctx.policy, self.capability.own_attested)
        if ok and job.resources.gpus and self.capability.telemetry_fault:
            # Our vector holds stale readings: only we know, so only we can refuse (P3).
            ok, reason, detail = False, "node_unhealthy", "GPU telemetry failing: " + self.capability.telemetry_fault
        if ok:
            ok, reason, detail = self.scheduling.bid_check(record, now_ms)
        claim = None
        if ok:
            # Held until this node applies the instance's decision, the instance gives up or
            # is dropped here, or the job is cancelled (R1): never for a fixed time, since a
            # bid may be decided in any later round. Persisted before the bid is sent.
            # Unhealthy GPUs (and other models') read -1 MiB free, so the reservation takes
            # only healthy ones of the job's model (P4, P4c).
            claim = self.ledger.reserve(key, job.resources, free_mem_mib=reservable_gpu_mem_mib(cap, job),
                                        prefer=pack_share_choice(job, cap))
            if claim is None:
                reason, detail = "not_enough_gpus", "capacity reserved by concurrent bids"
        if claim is None:
            return "decline", self.ctx.sign(Decline(instance=key, epoch=epoch, reason=reason, detail=detail[:256]))
        bid = Bid(instance=key, epoch=epoch, capability=cap_envelope, reserved_gpus=claim.gpus,
                  rtt_us=self.capability.rtt_us, attestations=tuple(self.ctx.policy.attestations[:8]))
        return "bid", self.ctx.sign(bid)

    def refresh_decline(self, inst, record, now_ms: int, key: bytes | None = None) -> bool:
        """Capacity held by concurrent bids may be free again: decide a decline afresh. False
        when it stays a decline (repeating it adds nothing), True otherwise."""
        key = key or record.job_id
        mine = self.mine.get(key)
        if mine is None or mine[0] != "decline":
            return True
        if record.state != "pending":
            # Cancelled (or placed by another attempt) while its instance still runs here: a
            # bid now would reserve capacity for nothing until that instance ends (R1).
            return False
        fresh = self.make_bid_or_decline(key, inst.view.epoch, record, now_ms)
        if fresh[0] == "decline":
            return False
        self.mine[key] = fresh
        record.declines.pop(self.ctx.me, None)  # "why pending" no longer counts ours
        return True

    # --- answers arriving ---------------------------------------------------------------------
    def on_bid(self, envelope, bid: Bid, data: bytes, now_ms: int, out: Ready) -> None:
        inst = self.instances.get(bid.instance)
        role = self.instances.role(bid.instance) if inst is not None else None
        if role is not None and role.flow.bid_job(role.subject) is None:
            raise RemoteProtocolError("a bid names a slot or an epoch change, not a job (P7a)")
        if inst is None and self.slots.enabled:
            slot = self.slots.live_slot_of(bid.instance)   # a bid for a job its slot may place (P7)
            if slot is not None:
                self.slots.on_slot_bid(slot, bid, data, now_ms, out)
                return
        if inst is None:
            done = self.instances.decided.get(bid.instance)
            if done is not None and done.decision_envelope is not None:
                # A late bidder has not seen the decision: its bid is the cheapest catch-up cue.
                out.messages.append(Outbound(envelope.signer, done.decision_envelope))
                return
            if bid.instance in self.instances.recent_certificates:  # decided here by replay or catch-up
                self.instances.answer_applied(bid.instance, envelope.signer, -1, out)
                return
            self.instances.hold(bid.instance, envelope, bid, data)
            return
        facts = self.parse_member_bid(data, bid.instance, inst.view)
        if self.hold(role.flow.bid_job(role.subject), facts, data, key=bid.instance):
            role.flow.on_answer(inst, now_ms, out)

    def hold(self, jid: bytes, facts, data: bytes, key: bytes | None = None) -> bool:
        """Keep a verified bid for the leader's proposal, by its placement key (default: the job id)."""
        held = self.held.setdefault(key or jid, {})
        if facts.signer not in held and len(held) >= MAX_BIDS_HELD:
            self.ctx.counters["bids_full"] += 1
            return False
        held[facts.signer] = (facts, data)
        record = self.jobs.get(jid)
        if record is not None:
            record.declines.pop(facts.signer, None)  # it declined earlier, for want of free capacity
        self.declined.get(key or jid, {}).pop(facts.signer, None)
        return True

    def on_decline(self, envelope, decline: Decline, data, now_ms: int, out: Ready) -> None:
        role = self.instances.role(decline.instance)
        jid = role.flow.bid_job(role.subject) if role is not None else None
        record = self.jobs.get(jid) if jid is not None else None
        inst = self.instances.get(decline.instance)
        if inst is None and self.slots.enabled:
            inst = self.slots.live_slot_of(decline.instance)   # a decline of a job its slot may place (P7)
            record = self.jobs.get(decline.instance) if inst is not None else None
        view = inst.view if inst is not None else self.epochs.view
        if record is None or decline.epoch != view.epoch or envelope.signer not in view.stakes:
            self.ctx.counters["decline_unknown"] += 1
            return
        if envelope.signer not in record.declines and len(record.declines) < MAX_DECLINERS_KEPT:
            record.declines[envelope.signer] = (decline.reason, decline.detail)
            self.declined.setdefault(decline.instance, {})[envelope.signer] = data
        if inst is not None and inst.instance_id == decline.instance:
            self.instances.role(decline.instance).flow.on_answer(inst, now_ms, out)
