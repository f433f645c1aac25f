"""The gang resize flow: an elastic gang shrinks (GA8) and grows back (GA9) by numbered
decisions, one instance per resize number of the gang's placed attempt.

A shrink and a grow decided at the same time by two instances would be applied in
different orders at different members, and the members' gangs would differ (a grow
appends ranks a shrink then drops, or not). So every resize of an attempt is decided by
``gang_resize_instance_id(gang, attempt, number)``: at most one value per number, and each
member applies them strictly in number order, holding one decided ahead of its turn
(``parked``) as replica actions do (flows/replica.py). Every member starts the instance of
the next number as it applies the previous one (or the placement, for number 0), in that
decision's epoch, so all run it in one epoch; it waits in its round (no round changes, no
messages) until some member sees a resize to make: a rank whose node was evicted that no
member can replace (a shrink), or, with every rank on a node, members whose signed vectors
show room for more ranks up to the gang's largest size (a grow). Validators recompute both
from the signed vectors the value and its justification carry.
"""

from __future__ import annotations

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.gang_replace import GangVectorFlow, choose_replacement, rank_vector, shrink_size
from protocol.flows.move import move_rank
from protocol.gang_placement import diameter, topology_error
from protocol.job_table import TERMINAL
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, MAX_GANG_RANK_INDEX, GangResize, JobManifest,
                               decode_message, gang_replace_instance_id, gang_resize_instance_id, job_id)
from protocol.placement import capability_check
from protocol.ready import Ready

# A resize instance waits in its round while nobody has a resize to make, so it never runs
# out of rounds in the gang's normal life; a number given up could never be decided again.
RESIZE_MAX_ROUNDS = 1000
MAX_PARKED_RESIZES = 256
RANK_STATES = ("placed", "running", "migrating")   # a rank on a node (not waiting for one)


def choose_grow(job: JobManifest, instance: bytes, survivors: list, candidates, next_index: int):
    """SPEC.md GA9: the largest size of the job above the gang's (``survivors``: its ranks'
    vectors, rank order) that candidates fill: walking the candidates with room for a worker
    (R2's check) by (the gang's diameter with it, R2's move_rank), each taken while the rule
    can still hold at that size; the first size filled whose whole set keeps the topology
    rule. Returns (size, the new ranks' vectors in order) or None."""
    world, topology = len(survivors), job.gang.topology
    taken = {cap.node for cap in survivors}
    fitting, seen = [], set()
    for cap in candidates:
        if cap.node in taken or cap.node in seen or not capability_check(job, cap, {})[0]:
            continue
        seen.add(cap.node)
        fitting.append(((diameter([*survivors, cap]), move_rank(job, instance, cap.node, cap)), cap))
    fitting.sort(key=lambda item: item[0])
    for size in job.gang.sizes():
        if size <= world:
            break
        if next_index + size - world > MAX_GANG_RANK_INDEX:
            continue
        chosen = []
        for _key, cap in fitting:
            if len(chosen) == size - world:
                break
            trial = [*survivors, *chosen, cap]
            if topology == "spread_zones":
                fits = sum(c.zone == cap.zone for c in trial) <= (size + 1) // 2
            else:
                fits = topology_error(topology, trial) is None
            if fits:
                chosen.append(cap)
        if len(chosen) == size - world and topology_error(topology, [*survivors, *chosen]) is None:
            return size, chosen
    return None


class GangResizeFlow(GangVectorFlow):
    value_kind = "gang_resize"
    value_kinds = ("gang_resize",)
    max_rounds = RESIZE_MAX_ROUNDS

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.open: dict[bytes, bytes] = {}            # gang id -> the instance of its next resize number
        self.parked: dict[tuple, tuple] = {}          # (gang id, attempt, number) -> (value, epoch)
        self.unrepaired: set[bytes] = set()           # ranks whose replacement instance gave up here (GA7)
        self.deferred_open: set[bytes] = set()        # gangs whose next number waits for the restart to end

    # --- the instance of the next number ------------------------------------------------------------
    def opened(self, gang_id: bytes, now_ms: int, out: Ready) -> None:
        """The gang's attempt was placed or resized here: apply a resize decided early for the
        next number, else start that number's instance (an elastic gang only)."""
        while True:
            state = self.gangs.attempts.get(gang_id)
            if state is None:
                return
            parked = self.parked.pop((gang_id, state.attempt, state.number), None)
            if parked is None:
                break
            self._apply(gang_id, *parked, now_ms, out)
        gang = self.jobs.get(gang_id)
        if gang is None or gang.state != "placed" or gang.manifest.gang.workers != 0:
            return   # not an elastic gang, or its attempt ended meanwhile (a refusal as a grow applied)
        if self.lifecycle.deferred:
            # A restart replays the history before it restores the votes this node signed
            # (6.9): started now, the instance would sign afresh what it signed before the
            # restart, maybe another value (`meshnode sim --seed 86 ... --gang-kills 2`: an
            # honest node signed two proposals). It starts on this node's next input instead.
            self.deferred_open.add(gang_id)
            return
        view = self.epochs.view_for(state.epoch)
        if view is None:
            return
        iid = gang_resize_instance_id(gang_id, state.attempt, state.number)
        self.open[gang_id] = iid
        self.instances.start(iid, self, gang_id, view, now_ms, out)

    def close(self, gang_id: bytes) -> None:
        """The gang's attempt ended: its open resize instance decides nothing any more."""
        iid = self.open.pop(gang_id, None)
        if iid is not None and self.instances.get(iid) is not None:
            self.instances.forget(iid)

    def instance_from_proposal(self, proposal, value: GangResize, view, now_ms: int, out: Ready):
        """A node that did not start the instance (it restarted since) runs it once its gang
        stands at the value's attempt and number."""
        gang_id = self._gang_id(value)
        state = self.gangs.attempts.get(gang_id) if gang_id is not None else None
        if state is None or (state.attempt, state.number) != (value.attempt, value.number):
            self.ctx.counters["gang_resize_not_ready"] += 1
            return None
        self.open[gang_id] = proposal.instance
        return self.instances.start(proposal.instance, self, gang_id, view, now_ms, out)

    def _gang_id(self, value: GangResize) -> bytes | None:
        try:
            return job_id(decode_message(value.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                         caches=self.ctx.caches)[1])
        except RemoteProtocolError:
            return None

    # --- what this node would propose -----------------------------------------------------------------
    def _facts(self, gang_id: bytes, iid: bytes):
        """(gang record, its attempt state, its ranks' records) while ``iid`` is its open number."""
        gang, state = self.jobs.get(gang_id), self.gangs.attempts.get(gang_id)
        if gang is None or state is None or gang.state != "placed":
            return None
        if gang_resize_instance_id(gang_id, state.attempt, state.number) != iid:
            return None
        return gang, state, self.gangs.worker_records(gang_id)

    def _resize(self, iid: bytes, gang_id: bytes, view, now_ms: int):
        """(value, justification) this node would propose now, or None (nothing to resize)."""
        facts = self._facts(gang_id, iid)
        if facts is None:
            return None
        gang, state, ranks = facts
        job = gang.manifest
        lost = next((w for w in ranks if w is not None and w.state == "replacing"), None)
        others = [w for w in ranks if w is not lost]
        # The instance runs in an older epoch (its number's): a node evicted since is no
        # candidate (a rank put there would only wait for a replacement again, and again).
        current = self.epochs.view.stakes
        if any(w is None or w.primary is None or w.primary not in view.stakes or w.primary not in current or
               (lost is None and w.state not in RANK_STATES) for w in others):
            return None
        survivors = [rank_vector(self.ctx, self.capability, self.gangs, gang_id, w.primary, now_ms) for w in others]
        if any(s is None for s in survivors):
            return None
        taken = {w.primary for w in others}
        candidates = [signed for signed in (self.capability.signed_vector(k, now_ms) for k in view.members
                                            if k not in taken and k in current)
                      if signed is not None][:MAX_BIDS_PER_PROPOSAL]
        caps = [cap for _e, cap in survivors]
        if lost is not None:
            # GA8: only once no member can replace the rank (GA7 decides that replacement),
            # or its replacement instance gave up here (it then carries no candidates).
            if lost.job_id in self.unrepaired:
                candidates = []
            elif choose_replacement(job, gang_replace_instance_id(lost.job_id, lost.fence), caps,
                                    [cap for _e, cap in candidates], lost.backups) is not None:
                return None
            size = shrink_size(job, len(ranks), caps)
            if size is None:
                return None
            value = GangResize(job=gang.envelope, attempt=state.attempt, number=state.number, size=size,
                               lost=lost.job_id, nodes=(), capabilities=(),
                               survivors=tuple(e for e, _cap in survivors))
            return value, tuple(e for e, _cap in candidates)
        grow = choose_grow(job, iid, caps, [cap for _e, cap in candidates], state.next_index)
        if grow is None:
            return None
        size, chosen = grow
        envelope_of = {cap.node: e for e, cap in candidates}
        value = GangResize(job=gang.envelope, attempt=state.attempt, number=state.number, size=size, lost=b"",
                           nodes=tuple(cap.node for cap in chosen),
                           capabilities=tuple(envelope_of[cap.node] for cap in chosen),
                           survivors=tuple(e for e, _cap in survivors))
        return value, tuple(e for e, _cap in candidates)

    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        found = self._resize(inst.instance_id, self.instances.role(inst.instance_id).subject, inst.view, now_ms)
        if found is not None:
            value, justification = found
            self.instances.drive(inst, inst.propose(codec.pack(value.to_body()), justification, now_ms), now_ms, out)

    def round_on_hold(self, inst, now_ms: int) -> bool:
        """Nothing to resize as this node sees it (and no lock here): no round change."""
        if inst.locked_round is not None:
            return False
        return self._resize(inst.instance_id, self.instances.role(inst.instance_id).subject, inst.view,
                            now_ms) is None

    def notice(self, now_ms: int, out: Ready) -> None:
        """A member's vector or a rank's state changed: the leader of an open number's round
        that has not proposed yet proposes if it now has a resize to make. After a restart,
        the instances of the numbers the replay reached start here, their votes restored."""
        if self.deferred_open and not self.lifecycle.deferred:
            for gang_id in sorted(self.deferred_open):
                self.opened(gang_id, now_ms, out)
            self.deferred_open.clear()
        for gang_id, iid in list(self.open.items()):
            inst = self.instances.get(iid)
            if inst is not None and inst.awaiting_value:
                self.on_awaiting_value(inst, now_ms, out)

    def replacement_gave_up(self, record) -> bool:
        """GA7's instance for ``record`` gave up: True when this flow shrinks the gang instead
        (an elastic gang whose resize instance runs here), so its attempt does not end."""
        gang_id = self.gangs.worker_of[record.job_id][0]
        if gang_id not in self.open or self.instances.get(self.open[gang_id]) is None:
            return False
        self.unrepaired.add(record.job_id)
        return True

    # --- validation (GA8, GA9) ----------------------------------------------------------------------
    def value_error(self, iid: bytes, value: GangResize, candidates: list, view) -> str | None:
        survivors = [self._vector(data, view) for data in value.survivors]
        added = [self._vector(data, view) for data in value.capabilities]
        return self.resize_error(iid, value, survivors, added, candidates)

    def resize_error(self, iid: bytes, value: GangResize, survivors: list, added: list, candidates: list):
        gang_id = self._gang_id(value)
        facts = self._facts(gang_id, iid) if gang_id is not None else None
        if facts is None:
            return "the gang does not stand at resize %d of attempt %d here" % (value.number, value.attempt)
        gang, state, ranks = facts
        job = gang.manifest
        if len({cap.node for cap in candidates}) != len(candidates):
            return "a candidate's vector twice"
        if value.shrinks:
            lost = self.jobs.get(value.lost)
            if lost is None or lost.job_id not in self.gangs.ranks.get(gang_id, ()) or lost.state != "replacing":
                return "the shrink's rank is not waiting for a replacement here"
            others = [w for w in ranks if w is not lost]
            if [cap.node for cap in survivors] != [w.primary for w in others]:
                return "the survivors' vectors are not the other ranks' nodes, in rank order"
            if choose_replacement(job, gang_replace_instance_id(lost.job_id, lost.fence), survivors, candidates,
                                  lost.backups) is not None:
                return "a shrink while a candidate fits (GA8)"
            if value.size != shrink_size(job, len(ranks), survivors):
                return "a shrink to %d, not the largest size the gang's rule allows (GA8)" % value.size
            return None
        if [cap.node for cap in survivors] != [w.primary for w in ranks] or any(
                w.state not in RANK_STATES for w in ranks):
            return "a grow while a rank has no node, or survivors that are not the ranks' nodes in order (GA9)"
        if [cap.node for cap in added] != list(value.nodes):
            return "the grow carries another node's capability vector"
        gone = [node for node in value.nodes if node not in self.epochs.view.stakes]
        if gone:
            return "a grow onto %s, evicted since the instance's epoch" % gone[0].hex()[:12]
        for cap in added:
            if not capability_check(job, cap, {})[0]:
                return "new rank's node %s has no room for a worker" % cap.node.hex()[:12]
        broken = topology_error(job.gang.topology, [*survivors, *added])
        if broken is not None:
            return broken
        pool = [cap for cap in candidates if cap.node not in value.nodes] + added
        grow = choose_grow(job, iid, survivors, pool, state.next_index)
        if grow is None or grow[0] != value.size or [cap.node for cap in grow[1]] != list(value.nodes):
            return "the grow does not follow from its candidates (GA9)"
        return None

    # --- applying it (in number order) ----------------------------------------------------------------
    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, value, epoch: int, mesh_id: bytes, slot_ms: int,
                            caches=None) -> str | None:
        """GA9: the instance is the value's gang, attempt and number; the job a gang signed by
        its owner; the size one the job allows."""
        envelope, job = decode_message(value.job, mesh_id, expect=JobManifest, allow_any_mesh=True, caches=caches)
        if envelope.signer != job.owner:
            return "a job that is not signed by its owner"
        if not job.gang.is_gang or job.gang.workers != 0:
            return "a gang_resize of a job that is not an elastic gang"
        if value.size not in job.gang.sizes():
            return "a gang of %d workers, which the job does not allow" % value.size
        if gang_resize_instance_id(job_id(job), value.attempt, value.number) != iid:
            return "the resize's gang, attempt and number are for another instance"
        return None

    def apply(self, iid: bytes, value_kind: str, value: GangResize, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        gang_id = self._gang_id(value)
        state = self.gangs.attempts.get(gang_id)
        if state is None or (value.attempt, value.number) > (state.attempt, state.number):
            # Its attempt's placement or an earlier number has not reached this node: held
            # until it has, so every member applies one attempt's resizes in number order.
            if len(self.parked) < MAX_PARKED_RESIZES:
                self.parked[(gang_id, value.attempt, value.number)] = (value, epoch)
                self.ctx.counters["gang_resize_parked"] += 1
            return
        if (value.attempt, value.number) != (state.attempt, state.number):
            self.ctx.counters["gang_resize_stale"] += 1   # an ended attempt's
            return
        self._apply(gang_id, value, epoch, now_ms, out)
        self.opened(gang_id, now_ms, out)

    def _apply(self, gang_id: bytes, value: GangResize, epoch: int, now_ms: int, out: Ready) -> None:
        """Resize ``value.number`` of the gang: whatever the rank records say now, the number
        is used up, so every member counts the same resizes (a shrink whose rank a grow or an
        earlier shrink left out changes nothing else)."""
        state = self.gangs.attempts[gang_id]
        state.number, state.epoch = value.number + 1, epoch
        self.open.pop(gang_id, None)
        ranks = self.gangs.ranks.get(gang_id, ())
        if value.shrinks:
            lost = self.jobs.get(value.lost)
            self.unrepaired.discard(value.lost)
            if lost is not None and value.lost in ranks and value.size < len(ranks):
                self.gangs.shrink(gang_id, lost, value.size, now_ms, out)
            else:
                self.ctx.counters["gang_resize_noop"] += 1
            return
        if value.size != len(ranks) + len(value.nodes):
            self.ctx.counters["gang_resize_noop"] += 1
            return
        for w in self.gangs.grow(gang_id, value.nodes, value.capabilities, epoch, now_ms, out):
            if w.primary == self.ctx.me and w.state not in TERMINAL:
                if not self.lifecycle.admit(w, None, now_ms, out):   # R1: a refusal ends the attempt (GA4)
                    break

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        """A number that ran out of rounds: a rank still waiting for a node ends the attempt
        (GA4), as GA7's give-up does for a gang that cannot shrink."""
        if self.open.get(subject) == iid:
            del self.open[subject]
        for w in self.gangs.worker_records(subject):
            if w is not None and w.state == "replacing":
                self.gangs.end_attempt(w, now_ms, out)
                return
