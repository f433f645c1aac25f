"""The gang replacement flow: a rank whose node was evicted goes on elsewhere by a decision
of its own (SPEC.md GA7).

An eviction (F5) does not move a gang's rank to its first backup as it moves a job: every
member applying it takes the rank's record off its node (no primary, the fence one up,
state ``replacing``) and starts the rank's one replacement instance,
``gang_replace_instance_id(worker, fence)``, in the epoch the eviction made. Its leader
proposes a ``gang_replace`` value from signed capability vectors: the surviving ranks'
(the topology check) and the candidates' (the justification), the choice being GA7's
rule over them, which every validator recomputes. Applying it puts the rank on the
chosen node at the next fence; every node holding the rank's newest checkpoint hands it
over there, and the survivors, never stopped, are told the new peer (GA5's
``gang_peers``). When no candidate fits, an elastic gang shrinks instead by its numbered
resize instance (flows/gang_resize.py, GA8, GA9). A gang that can neither be repaired nor
shrunk has its attempt ended as a refusal ends it (GA4) when the instance gives up, and is
placed afresh.
"""

from __future__ import annotations

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.base import SharedStateFlow
from protocol.flows.move import move_rank
from protocol.gang_placement import diameter, gang_worker_id, topology_error
from protocol.job_lifecycle import HANDOFF_WAIT_MS
from protocol.messages import (MAX_BIDS_PER_PROPOSAL, CapabilityVector, GangReplacement, JobManifest,
                               decode_message, decode_value, gang_replace_instance_id, job_id, next_attempt)
from protocol.placement import capability_check, tie_break, wanted_backups
from protocol.ready import Ready

REPLACE_MAX_ROUNDS = 4   # then the gang's attempt ends (GA4): a gang never waits partial for long
MAX_PARKED_REPLACEMENTS = 256   # decided replacements held until this node applies their eviction


def replacement_rank(job: JobManifest, instance: bytes, survivors: list, candidate, old_backups) -> tuple:
    """SPEC.md GA7: smaller is better: the gang's diameter with the candidate, a backup of
    the gang first (it holds the rank's replicated checkpoint), then R2's ``move_rank``."""
    return (diameter([*survivors, candidate]), candidate.node not in old_backups,
            move_rank(job, instance, candidate.node, candidate))


def choose_replacement(job: JobManifest, instance: bytes, survivors: list, candidates, old_backups):
    """SPEC.md GA7: among the candidates' vectors, the one with room for a worker (R2's
    capability check) whose node keeps the topology rule with the survivors, best by
    ``replacement_rank``; None when none fits."""
    taken = {cap.node for cap in survivors}
    best = None
    for cap in candidates:
        if cap.node in taken or not capability_check(job, cap, {})[0]:
            continue
        if topology_error(job.gang.topology, [*survivors, cap]) is not None:
            continue
        rank = replacement_rank(job, instance, survivors, cap, old_backups)
        if best is None or rank < best[0]:
            best = (rank, cap)
    return None if best is None else best[1]


def shrink_size(job: JobManifest, world: int, survivors: list) -> int | None:
    """SPEC.md GA8: the largest size of the job below ``world`` at which its first surviving
    ranks keep the topology rule; None when there is none (a fixed-size gang never shrinks)."""
    for size in job.gang.sizes():
        if size < world and size <= len(survivors) and topology_error(job.gang.topology, survivors[:size]) is None:
            return size
    return None


class GangVectorFlow(SharedStateFlow):
    """What GA7's and GA9's flows share: nobody bids, a value is checked from the signed
    capability vectors it and its justification carry, and it binds to its instance."""
    max_justification = MAX_BIDS_PER_PROPOSAL   # the candidates' signed vectors

    def __init__(self, ctx, epochs, jobs, ledger, instances, capability, gangs, lifecycle) -> None:
        super().__init__(ctx, epochs, jobs, ledger, instances, capability)
        self.gangs = gangs
        self.lifecycle = lifecycle

    def bid_job(self, subject) -> None:
        return None   # nobody bids: the value is checked from signed vectors

    def job_ids(self, iid: bytes, subject) -> tuple:
        return (subject,)

    def validators(self, iid: bytes) -> tuple:
        return self._validator(iid), None

    def _validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.live_or_decided(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                value = decode_value(self.value_kind, value_bytes, caches=self.ctx.caches)
                problem = self.value_binding_error(iid, self.value_kind, value, view.epoch, self.ctx.mesh_id, 0,
                                                   caches=self.ctx.caches)
                if problem is not None:
                    return problem
                if len(justification) > MAX_BIDS_PER_PROPOSAL:
                    return "more than %d candidate vectors" % MAX_BIDS_PER_PROPOSAL
                candidates = [self._vector(data, view) for data in justification]
                return self.value_error(iid, value, candidates, view)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid %s proposal: %s" % (self.value_kind, exc)
        return validate

    def value_error(self, iid: bytes, value, candidates: list, view) -> str | None:
        """Why a value of this flow is refused, its justification's vectors decoded (or None).
        Raises RemoteProtocolError for a vector of the value that is not valid."""
        raise NotImplementedError

    def _vector(self, data: bytes, view) -> CapabilityVector:
        envelope, cap = decode_message(data, self.ctx.mesh_id, expect=CapabilityVector, caches=self.ctx.caches)
        if envelope.signer != cap.node or cap.node not in view.stakes:
            raise RemoteProtocolError("a capability vector not signed by its node, or of a non-member")
        return cap

    def binding_error(self, iid: bytes, value_kind: str, value, epoch: int) -> str | None:
        return self.value_binding_error(iid, value_kind, value, epoch, self.ctx.mesh_id, 0, caches=self.ctx.caches)


class GangReplaceFlow(GangVectorFlow):
    value_kind = "gang_replace"
    value_kinds = ("gang_replace",)
    max_rounds = REPLACE_MAX_ROUNDS

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.resizer = None   # flows/gang_resize.py (GA9), set by the core
        # (worker id, fence) -> (iid, value, certificate, epoch): a replacement whose
        # certificate came before the eviction that starts it (catch-up delivers, and a
        # restart replays, in arrival order), applied when that eviction is (GA7).
        self.parked: dict[tuple[bytes, int], tuple] = {}

    # --- a rank's node was evicted (GA7) ----------------------------------------------------------
    def takes(self, record) -> bool:
        """Whether an eviction leaves ``record`` to this flow: a rank of a gang's placed attempt."""
        found = self.gangs.worker_of.get(record.job_id)
        return found is not None and record.job_id in self.gangs.ranks.get(found[0], ())

    def await_replacement(self, record, evicted: bytes, view, now_ms: int, out: Ready) -> None:
        """F5 for a gang's rank: off its evicted node, fence one up, and its replacement
        instance starts in the epoch the eviction made (``view``)."""
        if record.primary == self.ctx.me:
            self.ledger.free(record.job_id)
        backups = tuple(b for b in record.backups if b != evicted)
        self.jobs.assign(record, None, backups, (), fence=record.fence + 1)
        record.state, record.migrations = "replacing", record.migrations + 1
        record.hint = "its node was evicted: the mesh decides its replacement (GA7)"
        out.events.append(self.ctx.event("gang_rank_lost", now_ms, job_id=record.job_id.hex(), node=evicted.hex(),
                                         fence=record.fence))
        # Started in the eviction's epoch; its round's leader proposes as it starts (on_awaiting_value).
        self.instances.start(gang_replace_instance_id(record.job_id, record.fence), self, record.job_id, view,
                             now_ms, out)
        parked = self.parked.pop((record.job_id, record.fence), None)
        if parked is not None:
            iid, value, certificate, epoch = parked
            self.apply(iid, "gang_replace", value, certificate, epoch, now_ms, out)

    def instance_from_proposal(self, proposal, value: GangReplacement, view, now_ms: int, out: Ready):
        """Only a node that applied the eviction runs the instance (it holds the rank as
        ``replacing`` at the value's fence); others hold the proposal until then."""
        record = self._replacing(value)
        if record is None or gang_replace_instance_id(record.job_id, record.fence) != proposal.instance:
            self.ctx.counters["gang_replace_not_ready"] += 1
            return None
        return self.instances.start(proposal.instance, self, record.job_id, view, now_ms, out)

    def _rank_record(self, value: GangReplacement):
        """This node's record of the value's rank (None: a job it does not know)."""
        try:
            _envelope, job = decode_message(value.job, self.ctx.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                            caches=self.ctx.caches)
        except RemoteProtocolError:
            return None
        return self.jobs.get(gang_worker_id(job_id(job), value.rank))

    def _replacing(self, value: GangReplacement):
        record = self._rank_record(value)
        if record is None or record.state != "replacing" or record.fence != value.fence:
            return None
        return record

    # --- the leader's value ---------------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        self._propose(inst, now_ms, out)

    def _gang_facts(self, record):
        """(gang record, the other ranks' records in rank order: the survivors)."""
        gang_id, _rank = self.gangs.worker_of[record.job_id]
        others = [self.jobs.get(wid) for wid in self.gangs.ranks.get(gang_id, ()) if wid != record.job_id]
        return self.jobs.get(gang_id), others

    def _propose(self, inst, now_ms: int, out: Ready) -> None:
        record = self.jobs.get(self.instances.role(inst.instance_id).subject)
        if record is None or record.state != "replacing":
            return
        gang, others = self._gang_facts(record)
        if any(w.primary not in inst.view.stakes for w in others):
            # Another rank's node is gone too (or not replayed out yet): no survivors to check against.
            record.hint = "another rank of the gang has no live node: the gang cannot be repaired (GA7)"
            return
        survivors = [rank_vector(self.ctx, self.capability, self.gangs, gang.job_id, w.primary, now_ms)
                     for w in others]
        if any(s is None for s in survivors):
            record.hint = "a surviving rank's node has no capability vector here yet (GA7)"
            return
        taken = {w.primary for w in others}
        candidates = [signed for signed in (self.capability.signed_vector(k, now_ms) for k in inst.view.members
                                            if k not in taken) if signed is not None][:MAX_BIDS_PER_PROPOSAL]
        job = record.manifest
        chosen = choose_replacement(job, inst.instance_id, [cap for _e, cap in survivors],
                                    [cap for _e, cap in candidates], record.backups)
        world = len(others) + 1
        if chosen is not None:
            envelope = next(e for e, cap in candidates if cap is chosen)
            value = GangReplacement(job=record.envelope, rank=self._worker_rank(record), fence=record.fence,
                                    to_node=chosen.node, capability=envelope,
                                    survivors=tuple(e for e, _cap in survivors), size=world,
                                    backups=replacement_backups(record, chosen.node, inst.view.stakes,
                                                                inst.instance_id))
        else:
            # GA8, GA9: a shrink is a numbered resize, decided by the gang's resize instance.
            shrinks = job.gang.workers == 0 and shrink_size(job, world, [cap for _e, cap in survivors]) is not None
            record.hint = "no member can replace it within topology %r: %s (GA7, GA8)" % (
                job.gang.topology, "the gang shrinks" if shrinks else "the gang cannot shrink")
            return
        justification = tuple(e for e, _cap in candidates)
        self.instances.drive(inst, inst.propose(codec.pack(value.to_body()), justification, now_ms), now_ms, out)

    def _worker_rank(self, record) -> int:
        return self.gangs.worker_of[record.job_id][1]   # its rank at placement: its worker id's (GA4)

    # --- validators (GA7) ---------------------------------------------------------------------------
    def value_error(self, iid: bytes, value: GangReplacement, candidates: list, view) -> str | None:
        if value.shrinks:
            return "a shrink is decided as a gang_resize (GA9), not by a rank's replacement"
        survivors = [self._vector(data, view) for data in value.survivors]
        target = self._vector(value.capability, view) if value.capability else None
        return self.replacement_error(iid, value, survivors, target, candidates, view)

    def replacement_error(self, iid: bytes, value: GangReplacement, survivors: list, target, candidates: list,
                          view) -> str | None:
        """SPEC.md GA7/GA8's validation, from this node's job table and the signed vectors."""
        record = self._replacing(value)
        if record is None:
            return "the rank is not waiting for a replacement at fence %d here" % value.fence
        _gang, others = self._gang_facts(record)
        if [cap.node for cap in survivors] != [w.primary for w in others]:
            return "the survivors' vectors are not the surviving ranks' nodes, in rank order"
        if len({cap.node for cap in candidates}) != len(candidates):
            return "a candidate's vector twice"
        job, world = record.manifest, len(others) + 1
        if target is not None:
            if target.node != value.to_node:
                return "the replacement carries another node's capability vector"
            broken = topology_error(job.gang.topology, [*survivors, target])
            if broken is not None:
                return broken
            candidates = [cap for cap in candidates if cap.node != target.node] + [target]
            chosen = choose_replacement(job, iid, survivors, candidates, record.backups)
            if chosen is None or chosen.node != value.to_node:
                return "the replacement does not follow from its candidates (GA7)"
            if value.size != world or tuple(value.backups) != replacement_backups(record, value.to_node,
                                                                                  view.stakes, iid):
                return "the replacement's size or backups do not follow GA7"
            return None
        return "a shrink is decided as a gang_resize (GA9), not by a rank's replacement"

    # --- applying it ----------------------------------------------------------------------------------
    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, value, epoch: int, mesh_id: bytes, slot_ms: int,
                            caches=None) -> str | None:
        """GA7: the instance is the one of the value's rank and fence, the job a gang signed
        by its owner, the size one the job allows."""
        envelope, job = decode_message(value.job, mesh_id, expect=JobManifest, allow_any_mesh=True, caches=caches)
        if envelope.signer != job.owner:
            return "a job that is not signed by its owner"
        if not job.gang.is_gang:
            return "a gang_replace of a job that is not a gang"
        if value.size not in job.gang.sizes():
            return "a gang of %d workers, which the job does not allow" % value.size
        if gang_replace_instance_id(gang_worker_id(job_id(job), value.rank), value.fence) != iid:
            return "the replacement's rank and fence are for another instance"
        return None

    def apply(self, iid: bytes, value_kind: str, value: GangReplacement, certificate: bytes, epoch: int,
              now_ms: int, out: Ready) -> None:
        record = self._replacing(value)
        if record is None:
            if not self._park_early(iid, value, certificate, epoch):
                self.ctx.counters["gang_replace_stale"] += 1   # the gang ended or moved on meanwhile
            return
        gang_id = self.gangs.worker_of[record.job_id][0]
        if value.shrinks:
            self.ctx.counters["gang_replace_shrink_refused"] += 1   # only a Byzantine quorum certifies one (GA9)
            return
        self.gangs.worker_vectors.setdefault(gang_id, {})[value.to_node] = value.capability
        self.jobs.assign(record, value.to_node, value.backups, (), fence=record.fence + 1)
        record.state, record.hint = "migrating", None
        out.events.append(self.ctx.event("gang_rank_replaced", now_ms, job_id=gang_id.hex(), rank=value.rank,
                                         worker=record.job_id.hex(), to_node=value.to_node.hex(), fence=record.fence))
        # P5 for a late replacement: an eviction of its node decided since, applied here
        # before this, leaves the rank waiting again, as on the nodes that applied this first.
        self.gangs._replay_evictions_since(record, epoch, now_ms, out)
        if record.state != "migrating":
            return
        if value.to_node == self.ctx.me:
            if (self.lifecycle.admit(record, None, now_ms, out) and not self.lifecycle.deferred
                    and not holds_lost_primarys_checkpoint(record, value.fence)):
                self.lifecycle.handoff_waits[record.job_id] = now_ms + HANDOFF_WAIT_MS   # the checkpoint comes
        else:
            self.lifecycle.hand_off_checkpoint(record, out)   # the rank's work goes on there (GA7)

    def _park_early(self, iid: bytes, value: GangReplacement, certificate: bytes, epoch: int) -> bool:
        """Hold a replacement decided for a fence this node's record of the rank has not
        reached: the eviction that starts it is not applied here yet. Without this, a node
        that got the later certificate first dropped it as stale and left the rank with no
        node, and the gang's ring never formed again (`bench gang`, BENCHMARKS.md)."""
        record = self._rank_record(value)
        if record is None or record.fence >= value.fence or len(self.parked) >= MAX_PARKED_REPLACEMENTS:
            return False
        self.parked[(record.job_id, value.fence)] = (iid, value, certificate, epoch)
        self.ctx.counters["gang_replace_parked"] += 1
        return True

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        """No replacement was decided: the gang's attempt ends (GA4), unless its resize
        instance shrinks it instead (GA8, GA9)."""
        record = self.jobs.get(subject)
        if record is not None and record.state == "replacing" and not self.resizer.replacement_gave_up(record):
            self.gangs.end_attempt(record, now_ms, out)


def rank_vector(ctx, capability, gangs, gang_id: bytes, node: bytes | None, now_ms: int):
    """(envelope, vector) of the node running a gang's rank: its newest, else the one its bid
    for the gang's placement (or its replacement) carried: the topology check reads its zone
    and rail group, which a node does not change."""
    if node is None:
        return None
    newest = capability.signed_vector(node, now_ms)
    if newest is not None:
        return newest
    data = gangs.worker_vectors.get(gang_id, {}).get(node)
    if data is None:
        return None
    return data, decode_message(data, ctx.mesh_id, expect=CapabilityVector, caches=ctx.caches)[1]


def replacement_backups(record, to_node: bytes, members, instance: bytes) -> tuple:
    """GA7: the rank's backups that are still members, less its new node, refilled to the
    job's backup count from the other members by P4's tie-break order for the instance.
    Without the refill every replacement used one backup up, and a rank replaced twice had
    none: its next node held no checkpoint and the rank (so the ring) restarted from step 0."""
    kept = [b for b in record.backups if b != to_node and b in members]
    spare = sorted((m for m in members if m != to_node and m not in kept), key=lambda m: tie_break(instance, m))
    return tuple(kept + spare[:max(0, wanted_backups(record.manifest) - len(kept))])


def holds_lost_primarys_checkpoint(record, replacing_fence: int) -> bool:
    """GA7: the replacement resumes at once only from a checkpoint of the run it replaces
    (fence ``replacing_fence - 1``); one of an older run here (a node that ran the rank
    before, was killed and came back) waits for the hand-off like a node holding none."""
    return record.checkpoint_envelope is not None and record.checkpoint_fence == replacing_fence - 1
