"""The move flow: a healthy running job moved to another node by its owner's request
(SPEC.md R2).

The owner signs a ``MoveRequest`` naming the job and the fence it runs at (and, if it
wants, the node to move it to); the node it reaches checks it, broadcasts it and starts
the one instance that may move the job away from that fence, ``move_instance_id(job,
fence)``. Its leader proposes a ``JobMove``: the target (the named node, or the best by
the scoring below among the nodes whose signed capability vectors show room) with that
vector as proof, and the new backups by a fixed rule. Validators check the value against
their job table and the vector; nothing else.

Applying it moves the job like an eviction's migration (the fence goes up by one, so a
late checkpoint or exit of the old primary is refused), with one difference: the old
primary is alive. It stops the run and hands its final checkpoint, taken as it stopped,
to the new primary (``JobLifecycle.hand_over_moved``), which waits for it before it starts
(never two runs at once) and resumes from it (the work lost is what the old run did after
that checkpoint). The new primary takes the job on through the ledger (R1) or refuses it,
and the job is then placed afresh like any refused job.

A reflex rule of the manifest (R3) moves the job the same way, in the same instance: a
``ReflexTrigger`` carrying the primary's signed vectors that show the rule held stands in
for the owner's request. Any member that sees the rule hold (``notice_reflexes``) starts
the instance with its own trigger; validators check the evidence, the cooldown, and that
the target's vector does not show the condition too.
"""

from __future__ import annotations

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.base import SharedStateFlow
from protocol.job_table import FENCE_PER_ATTEMPT, TERMINAL
from protocol.messages import CapabilityVector, JobMove, MoveRequest, ReflexTrigger, decode_message, move_instance_id
from protocol.placement import capability_check, gpu_healthy, gpu_strain, healthy_fitting_gpus, tie_break
from protocol.ready import Outbound, Ready
from protocol.reflexes import condition_holds, cooldown_bounds, evidence_error, shortest_evidence

MAX_MOVE_REQUESTS = 1024      # requests held for instances not yet decided here
MOVABLE_STATES = ("placed", "running")   # the primary holds the job (a validator may not have seen it run yet)


def decode_request(data: bytes, mesh_id: bytes, caches=None):
    """(envelope, MoveRequest or ReflexTrigger): what a JobMove's ``request`` may be (R2, R3)."""
    envelope, request = decode_message(data, mesh_id, caches=caches)
    if not isinstance(request, (MoveRequest, ReflexTrigger)):
        raise RemoteProtocolError("a job_move's request must be a move_request or a reflex_trigger")
    return envelope, request


def move_backups(record, to_node: bytes, members) -> tuple:
    """R2: the job's backups stay, less the new primary; if that leaves none (the only
    backup became primary), the old primary, alive, becomes the backup."""
    kept = tuple(b for b in record.backups if b != to_node and b in members)
    if kept or not record.backups:
        return kept
    return (record.primary,) if record.primary in members else ()


def move_rank(job, iid: bytes, node: bytes, capability: CapabilityVector) -> tuple:
    """Smaller is better (SPEC.md R2, after P4): the strain of the coolest GPUs that would
    hold the job, then most free healthy GPUs, GPU memory, CPU, then the instance's tie-break."""
    states = {g.index: g for g in capability.gpus}
    strains = sorted(gpu_strain(states[i]) for i in healthy_fitting_gpus(job, capability))
    strain = max(strains[:job.resources.gpus], default=0)
    healthy_free = {g.index for g in capability.gpus if gpu_healthy(g)} & set(capability.gpus_free)
    free_mem = sum(max(0, states[i].mem_total_mib - states[i].mem_used_mib) for i in healthy_free)
    return (strain, -len(healthy_free), -free_mem, -capability.cpu_milli_free, tie_break(iid, node))


class MoveFlow(SharedStateFlow):
    value_kind = "job_move"
    value_kinds = ("job_move",)
    max_justification = 0   # the value carries its own proof: the request and the target's vector

    def __init__(self, ctx, epochs, jobs, ledger, instances, capability) -> None:
        super().__init__(ctx, epochs, jobs, ledger, instances, capability)
        self.lifecycle = None   # the JobLifecycle, set by the core: the new primary admits the job (R1)
        self.placement = None   # the PlacementFlow, set by the core: its P5 replay of evictions
        self.requests: dict[bytes, bytes] = {}   # instance -> the owner's request or a reflex trigger

    def validators(self, iid: bytes) -> tuple:
        return self._validator(iid), None

    # --- requests (SPEC.md R2) -------------------------------------------------------------------
    def request(self, data: bytes, now_ms: int) -> tuple[bytes, Ready]:
        """An owner-signed MoveRequest from a local client: checked here first, so a request
        that cannot succeed is refused with its reason (RemoteProtocolError), then broadcast."""
        envelope, request = decode_message(data, self.ctx.mesh_id, expect=MoveRequest, caches=self.ctx.caches)
        view = self.epochs.view
        error = self.request_error(envelope.signer, request, view, running=True)
        record = self.jobs.get(request.job_id)
        if error is None:
            target = self._target(record, request, view, now_ms)
            if isinstance(target, str):
                error = target
        if error is not None:
            raise RemoteProtocolError("move: %s" % error)
        out = Ready()
        out.messages.append(Outbound(None, data))
        self._start(request, data, now_ms, out)
        return request.job_id, out

    def on_move_request(self, envelope, request: MoveRequest, data: bytes, now_ms: int, out: Ready) -> None:
        if self.request_error(envelope.signer, request, self.epochs.view) is not None:
            self.ctx.counters["move_request_refused"] += 1
            return
        self._start(request, data, now_ms, out)

    def request_error(self, signer: bytes, request, view, running: bool = False) -> str | None:
        """Why the job of ``request`` (a MoveRequest or a ReflexTrigger) cannot be moved as it
        asks (None: it can). ``running``: the entry node's stricter check (it has seen the job run)."""
        record = self.jobs.get(request.job_id)
        short = request.job_id.hex()[:12]
        if record is None:
            return "unknown job %s" % short
        if isinstance(request, ReflexTrigger):
            if signer not in view.stakes:
                return "the reflex trigger is not signed by a member"
        elif signer != record.manifest.owner:
            return "only the job's owner may move it"
        if record.state not in (("running",) if running else MOVABLE_STATES):
            return "job %s is %s, not running" % (short, record.state)
        if request.fence != record.fence:
            return ("the request is for fence %d but job %s is at fence %d (it moved since: a stale or "
                    "replayed request)" % (request.fence, short, record.fence))
        if request.to_node and request.to_node == record.primary:
            return "job %s already runs on %s" % (short, request.to_node.hex()[:12])
        if request.to_node and request.to_node not in view.stakes:
            return "%s is not a member of epoch %d" % (request.to_node.hex()[:12], view.epoch)
        if isinstance(request, ReflexTrigger):
            return self.trigger_error(record, request)
        return None

    def trigger_error(self, record, trigger: ReflexTrigger) -> str | None:
        """R3: the rule exists, asks to migrate, and the trigger's evidence proves it held on
        the job's primary after the job's reflex cooldown."""
        rules = record.manifest.reflexes
        if trigger.rule >= len(rules):
            return "the job has no reflex rule %d" % trigger.rule
        rule = rules[trigger.rule]
        if rule.action != "migrate":
            return "reflex rule %d does not migrate" % trigger.rule
        return evidence_error(rule, trigger.evidence, record.primary, record.job_id, record.fence,
                              self.ctx.mesh_id, record.reflex_at, caches=self.ctx.caches)

    # --- reflexes (SPEC.md R3) -----------------------------------------------------------------
    def notice_reflexes(self, node: bytes, now_ms: int, out: Ready) -> None:
        """``node`` signed a new vector: if a reflex rule of a job it runs as primary now holds,
        start the job's move instance with a trigger of our own (once per instance)."""
        history = None
        for record in self.jobs.reflex_jobs_of(node):
            iid = move_instance_id(record.job_id, record.fence)
            if iid in self.requests or self.instances.is_done(iid) or record.state != "running":
                continue
            history = history if history is not None else self.capability.history.of(node)
            for index, rule in enumerate(record.manifest.reflexes):
                if rule.action != "migrate":
                    continue   # clone, reroute and decay are replica actions (flows/replica.py, R4)
                found = shortest_evidence(rule, history, record.job_id, record.fence,
                                          *cooldown_bounds(rule, record.reflex_at, node))
                if found is None:
                    continue
                trigger = ReflexTrigger(job_id=record.job_id, fence=record.fence, rule=index,
                                        evidence=tuple(envelope for envelope, _cap in found))
                self.ctx.counters["reflex_noticed"] += 1
                self._start(trigger, self.ctx.sign(trigger), now_ms, out)
                break

    def _start(self, request, data: bytes, now_ms: int, out: Ready) -> None:
        iid = move_instance_id(request.job_id, request.fence)
        if iid not in self.requests and len(self.requests) >= MAX_MOVE_REQUESTS:
            self.ctx.counters["move_requests_full"] += 1
            return
        self.requests[iid] = data
        inst = self.instances.start(iid, self, request.job_id, self.epochs.view, now_ms, out)
        if inst is not None and inst.awaiting_value and iid in self.instances.instances:
            self._propose(inst, now_ms, out)

    def instance_from_proposal(self, proposal, move: JobMove, view, now_ms: int, out: Ready):
        try:
            _envelope, request = decode_request(move.request, self.ctx.mesh_id, caches=self.ctx.caches)
        except RemoteProtocolError:
            self.ctx.counters["move_bad_request"] += 1
            return None
        if move_instance_id(request.job_id, request.fence) != proposal.instance:
            raise RemoteProtocolError("job_move proposal under a foreign instance id")
        if len(self.requests) < MAX_MOVE_REQUESTS:
            self.requests.setdefault(proposal.instance, move.request)   # to propose it if we lead a later round
        return self.instances.start(proposal.instance, self, request.job_id, view, now_ms, out)

    # --- the leader's value ----------------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        self._propose(inst, now_ms, out)

    def _propose(self, inst, now_ms: int, out: Ready) -> None:
        data = self.requests.get(inst.instance_id)
        if data is None:
            return
        envelope, request = decode_request(data, self.ctx.mesh_id, caches=self.ctx.caches)
        view = inst.view
        if self.request_error(envelope.signer, request, view) is not None:
            return
        record = self.jobs.get(request.job_id)
        target = self._target(record, request, view, now_ms)
        if isinstance(target, str):
            out.events.append(self.ctx.event("move_no_target", now_ms, job_id=request.job_id.hex(), why=target))
            return
        to_node, vector = target
        move = JobMove(request=data, from_node=record.primary, to_node=to_node,
                       backups=move_backups(record, to_node, view.stakes), capability=vector)
        self.instances.drive(inst, inst.propose(codec.pack(move.to_body()), (), now_ms, "job_move"), now_ms, out)

    def _target(self, record, request, view, now_ms: int):
        """(node, its signed vector): the named node if its vector shows room, else the best
        member with room by ``move_rank`` (for a reflex, one whose vector does not show the
        rule's condition too); or why there is none (a string)."""
        job = record.manifest
        iid = move_instance_id(request.job_id, request.fence)
        names = [request.to_node] if request.to_node else [k for k in view.members if k != record.primary]
        best, why = None, "no other member has room for it"
        for node in names:
            known = self.capability.signed_vector(node, now_ms)
            if known is None:
                why = "no capability vector of %s known here" % node.hex()[:12]
                continue
            ok, reason, detail = capability_check(job, known[1], {})
            if not ok:
                why = "%s has no room for it: %s (%s)" % (node.hex()[:12], reason, detail)
                continue
            unfit = self.reflex_target_error(record, request, known[1])
            if unfit is not None:
                why = "%s %s" % (node.hex()[:12], unfit)
                continue
            rank = move_rank(job, iid, node, known[1])
            if best is None or rank < best[0]:
                best = (rank, node, known[0])
        return why if best is None else (best[1], best[2])

    # --- validators -------------------------------------------------------------------------------
    def _validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                move = JobMove.from_body(codec.unpack(value_bytes))
                envelope, request = decode_request(move.request, self.ctx.mesh_id, caches=self.ctx.caches)
                cap_envelope, cap = decode_message(move.capability, self.ctx.mesh_id, expect=CapabilityVector,
                                                   caches=self.ctx.caches)
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid job_move proposal: %s" % exc
            return self.move_error(iid, move, envelope.signer, request, cap_envelope.signer, cap, view)
        return validate

    def move_error(self, iid: bytes, move: JobMove, requester: bytes, request, vector_signer: bytes,
                   cap: CapabilityVector, view) -> str | None:
        """SPEC.md R2's validation rule (and R3's for a reflex trigger), from this node's job
        table and the signed vectors."""
        if move_instance_id(request.job_id, request.fence) != iid:
            return "the move's request is for another instance"
        error = self.request_error(requester, request, view)
        if error is not None:
            return error
        record = self.jobs.get(request.job_id)
        if move.from_node != record.primary:
            return "the move does not start from the job's primary"
        if request.to_node and move.to_node != request.to_node:
            return "the move goes to another node than the owner named"
        if move.to_node == move.from_node or move.to_node not in view.stakes:
            return "the move goes to its own primary or to a non-member"
        if vector_signer != move.to_node or cap.node != move.to_node:
            return "the move carries another node's capability vector"
        ok, reason, detail = capability_check(record.manifest, cap, {})
        if not ok:
            return "the target has no room: %s (%s)" % (reason, detail)
        if tuple(move.backups) != move_backups(record, move.to_node, view.stakes):
            return "the move's backups do not follow R2"
        unfit = self.reflex_target_error(record, request, cap)
        if unfit is not None:
            return "the target %s" % unfit
        return None

    @staticmethod
    def reflex_target_error(record, request, cap: CapabilityVector) -> str | None:
        """R3: a reflex never moves a job onto a node with an unhealthy GPU or one whose vector
        shows the rule's condition too (None: the node may take it)."""
        if not isinstance(request, ReflexTrigger) or request.rule >= len(record.manifest.reflexes):
            return None
        if not all(gpu_healthy(g) for g in cap.gpus):
            return "has an unhealthy GPU"
        if condition_holds(record.manifest.reflexes[request.rule], cap):
            return "shows the reflex's condition too"
        return None

    # --- applying a decided move --------------------------------------------------------------------
    def binding_error(self, iid: bytes, value_kind: str, move, epoch: int) -> str | None:
        error = self.value_binding_error(iid, value_kind, move, epoch, self.ctx.mesh_id, 0, caches=self.ctx.caches)
        if error is not None:
            return error
        envelope, request = decode_request(move.request, self.ctx.mesh_id, caches=self.ctx.caches)
        record = self.jobs.get(request.job_id)
        if record is not None and isinstance(request, MoveRequest) and envelope.signer != record.manifest.owner:
            return "the move's request is not signed by the job's owner"
        return None

    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, move, epoch: int, mesh_id: bytes, slot_ms: int,
                            caches=None) -> str | None:
        """R2 (flows/binding.py): votes sign only the value's hash, so the instance must be the
        one its request names, and the request a valid envelope of this mesh."""
        try:
            _envelope, request = decode_request(move.request, mesh_id, caches=caches)
        except RemoteProtocolError as exc:
            return "the move's request is not valid: %s" % exc
        if move_instance_id(request.job_id, request.fence) != iid:
            return "the move's request is for another instance"
        return None

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        self.requests.pop(iid, None)
        out.events.append(self.ctx.event("move_gave_up", now_ms, job_id=subject.hex()))

    def on_dropped(self, iid: bytes) -> None:
        self.requests.pop(iid, None)

    def apply(self, iid: bytes, value_kind: str, move: JobMove, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        self.requests.pop(iid, None)
        _envelope, request = decode_request(move.request, self.ctx.mesh_id, caches=self.ctx.caches)
        record = self.jobs.get(request.job_id)
        if record is not None and record.state not in TERMINAL and self._moved_on_by_evictions(record, move, request,
                                                                                            epoch):
            self._apply_after_evictions(record, move, request, epoch, now_ms, out)
            return
        if (record is None or record.state in TERMINAL or record.fence != request.fence
                or record.primary != move.from_node):
            # The job ended, or it moved on otherwise (a refusal placed it afresh): nothing moves.
            self.ctx.counters["move_stale"] += 1
            out.events.append(self.ctx.event("move_stale", now_ms, job_id=request.job_id.hex(), fence=request.fence))
            return
        me, jid = self.ctx.me, record.job_id
        self._move_record(record, move, request, now_ms, out)
        if move.from_node == me:
            self.ledger.free(jid)   # the workload orders stop the run; its final checkpoint goes to the new primary
            self.lifecycle.moved_away(record, request.fence, now_ms, out)
        if move.to_node == me:
            record.gpus = ()   # the old primary's indices mean nothing here: the ledger picks
            # R2a: started only once the old run is known stopped (its hand-over, or its node
            # leaving the epoch), never on a timer; after a restart too (the old primary sends
            # it again while this node's vector does not show the new run).
            if self.lifecycle.admit(record, None, now_ms, out):
                self.lifecycle.await_stop(record, request.fence, move.from_node)

    def _move_record(self, record, move: JobMove, request, now_ms: int, out: Ready) -> None:
        self.jobs.assign(record, move.to_node, move.backups, fence=request.fence + 1)
        record.migrations += 1
        record.state = "migrating"
        record.moved_from = (request.fence, move.from_node)
        record.lost_work_ms = None
        why = {}
        if isinstance(request, ReflexTrigger):
            # R3: the cooldown runs from the last vector of the evidence (the decided value's).
            last = decode_message(request.evidence[-1], self.ctx.mesh_id, expect=CapabilityVector,
                                  caches=self.ctx.caches)[1]
            record.reflex_at = (move.from_node, last.taken_ms)
            rule = record.manifest.reflexes[request.rule] if request.rule < len(record.manifest.reflexes) else None
            why = {"reflex": request.rule, "signal": rule.signal if rule else "",
                   "held_ms": last.taken_ms - decode_message(request.evidence[0], self.ctx.mesh_id,
                                                             expect=CapabilityVector, caches=self.ctx.caches)[1].taken_ms}
        out.events.append(self.ctx.event("moved", now_ms, job_id=record.job_id.hex(), from_node=move.from_node.hex(),
                                         to_node=move.to_node.hex(), fence=record.fence, **why))

    def _moved_on_by_evictions(self, record, move: JobMove, request, epoch: int) -> bool:
        """R2, late move: decided in an epoch this node has left, for a job that was at
        (``from_node``, the request's fence) then and has moved on since within its attempt:
        by the evictions that ended those epochs (the only moves a later epoch brings)."""
        return (epoch < self.epochs.epoch and record.fence > request.fence
                and record.primaries.get(request.fence) == move.from_node
                and record.fence // FENCE_PER_ATTEMPT == request.fence // FENCE_PER_ATTEMPT)

    def _apply_after_evictions(self, record, move: JobMove, request, epoch: int, now_ms: int,
                               out: Ready) -> None:
        """As P5 for a late placement: the move first, then each eviction since its epoch by
        the rule F5 applied to the jobs known then, so this node ends where the nodes that
        applied the move in its epoch do."""
        me, jid = self.ctx.me, record.job_id
        held_here = record.primary == me
        self._move_record(record, move, request, now_ms, out)
        self.placement._replay_evictions_since(record, epoch, now_ms, out)   # the P5 replay, shared
        self.ctx.counters["move_after_evictions"] += 1
        if held_here and record.primary != me:
            self.ledger.free(jid)
        elif record.primary == me and not held_here:
            record.gpus = ()
            self.lifecycle.admit(record, None, now_ms, out)
