"""The replica flow: clone, reroute and decay as decided values (SPEC.md R4).

A job's manifest may ask for more than one replica (``[service]`` min/max_replicas) and
hold reflex rules whose action is ``clone N``, ``reroute P%`` or ``decay P%``. Every member
watches the job's primary's signed capability vectors (as for R3's migrate); when a rule
holds for its duration, after its cooldown, within the bounds, or when the job runs fewer
replicas than its min_replicas (a *fill*), a member signs a trigger and starts the instance
``replica_instance_id(job, seq, anchor)``: ``seq`` the number of replica actions the job
has had, ``anchor`` the seq of the primary's vector it noticed at. The value carries the
trigger (the evidence, R3's check) and, for a clone or a fill, the new replicas' nodes
with the signed vectors that show their room.

One action per number: applying a value whose ``seq`` is below the job's (another instance
at the same number applied first) changes nothing (``replica_action_stale``), so a second
noticer or a re-proposal can never apply an action twice; one above it waits for its
predecessors (``parked``), so every member applies a job's actions in number order. Applying a clone adds replicas
(their nodes take them through the ledger, R1, or run nothing); a reroute or decay changes
weights, and a replica decayed to weight 0 is retired (its node frees its allocation).

A rule over a GPU signal reads every node running the job (R4g): the trigger carries one
chain of signed vectors per node (the primary's first), and the rule holds when the mean of
what each chain showed all along is beyond the threshold. A replica whose run fails, or
whose node has no room for it, is replaced on another node (R4h): its node signs the end
(a ``job_exit`` or ``job_refusal`` of the replica's key), and the decided value retires it
and adds its successor, once.
"""

from __future__ import annotations

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.base import SharedStateFlow
from protocol.flows.move import move_rank
from protocol.job_table import TERMINAL
from protocol.messages import (MAX_EVIDENCE, REPLICA_ACTIONS, CapabilityVector, JobExit, JobRefusal, ReflexTrigger, ReplicaAction, decode_message,
                               replica_instance_id, replica_key)
from protocol.placement import capability_check, gpu_healthy
from protocol.ready import Outbound, Ready
from protocol.reflexes import (chain_level, condition_holds, cooldown_bounds, mean_holds, newest_chain, reads_replicas,
                               runs_job)
from protocol.replica_evidence import primary_chain, related_reflex_at, replica_evidence_error
from protocol.replicas import (action_error, add_replica, clones_wanted, holders, replica_count, set_weights,
                               weight_changes, weights)

ACTING_STATES = ("placed", "running")   # a validator may not have seen the job run yet (as R2)
MAX_PENDING = 1024                      # replica instances held here, not yet decided
MAX_PARKED = 1024                       # decided actions held until their predecessors arrive
# R4h: a replacement's anchor is this + the ended replica's index (never a vector's seq in practice),
# so each replica's end has its own instance at each action number.
REPLACEMENT_ANCHOR = 1 << 48
# R4h: a replacement no leader can fill (no member is free of the job) gives up after this many
# rounds instead of the genesis' max_rounds (64, minutes): while open it holds the job's other actions.
REPLACEMENT_MAX_ROUNDS = 4
MAX_REPLICA_RESTARTS = 16               # replacements after failed exits, per job (a crash loop ends)


class ReplicaFlow(SharedStateFlow):
    value_kind = "replica_action"
    value_kinds = ("replica_action",)
    max_justification = 0   # the value carries its own proof: the trigger and the vectors

    def __init__(self, ctx, epochs, jobs, ledger, instances, capability) -> None:
        super().__init__(ctx, epochs, jobs, ledger, instances, capability)
        self.pending: dict[bytes, tuple] = {}   # instance -> (job id, seq, anchor, trigger bytes)
        self.noticing: dict[bytes, bytes] = {}  # job id -> the instance this node started for it
        self.allocated: dict[bytes, tuple] = {}  # replica key -> (job id, index): replicas this node holds
        self.with_replicas: set[bytes] = set()   # jobs that have had replicas beyond the primary
        self.exited_here: set[bytes] = set()     # replica keys whose workload ended here
        self.parked: dict[bytes, dict] = {}      # job id -> {seq: ReplicaAction} decided ahead of their turn here
        self.ends: dict[bytes, bytes] = {}       # replica key -> its node's signed end, until replaced (R4h)

    def validators(self, iid: bytes) -> tuple:
        return self._validator(iid), None

    # --- noticing (SPEC.md R4c) --------------------------------------------------------------------
    def notice(self, node: bytes, now_ms: int, out: Ready) -> None:
        """``node`` signed a new vector: for each running job it runs (as its primary, or a
        replica of it, R4g) with a replica's end to act on (R4h), below its min_replicas, or
        whose replica rule now holds, start the job's next action."""
        for record in self._jobs_run_by(node):
            if record.job_id in self.noticing or len(self.pending) >= MAX_PENDING:
                continue
            history = self.capability.history.of(record.primary)
            ended = self._held_end(record)
            if ended is not None:
                self._start(record, REPLACEMENT_ANCHOR + ended[0], ended[1], now_ms, out)
                continue
            if not history:
                continue
            trigger = self._trigger(record)
            if trigger is not None:   # anchored at the primary's newest vector
                self._start(record, history[-1][1].seq, trigger, now_ms, out)

    def _start(self, record, anchor: int, trigger: bytes, now_ms: int, out: Ready) -> None:
        iid = replica_instance_id(record.job_id, record.replica_seq, anchor)
        if self.instances.is_done(iid) or iid in self.pending:
            return
        self.ctx.counters["replica_noticed"] += 1
        self.noticing[record.job_id] = iid
        self.pending[iid] = (record.job_id, record.replica_seq, anchor, trigger)
        inst = self.instances.start(iid, self, record.job_id, self.epochs.view, now_ms, out)
        if inst is not None and inst.awaiting_value and iid in self.instances.instances:
            self.on_awaiting_value(inst, now_ms, out)

    # --- a replica's end (SPEC.md R4h) ----------------------------------------------------------
    def _held_end(self, record) -> tuple | None:
        """(index, signed end) of the first of the job's replicas whose end this node holds and
        whose replacement at the job's action number is not over (one that gave up is tried
        again at the next number, R4h; meanwhile the job's other actions go on)."""
        for index, replica in sorted(record.replicas.items()):
            data = self.ends.get(replica_key(record.job_id, index))
            if data is not None and not self.instances.is_done(
                    replica_instance_id(record.job_id, record.replica_seq, REPLACEMENT_ANCHOR + index)):
                return index, data
        return None

    def max_rounds_for(self, iid: bytes) -> int | None:
        held = self.pending.get(iid)
        if held is not None and held[2] >= REPLACEMENT_ANCHOR:
            return REPLACEMENT_MAX_ROUNDS
        return self.max_rounds

    def _report_end(self, record, index: int, message, now_ms: int, out: Ready) -> bytes:
        """This node's replica ``index`` ended (``message``: a JobExit or JobRefusal of its key):
        sign it, tell every member, and hold it until a replacement is decided."""
        data = self.ctx.sign(message)
        out.messages.append(Outbound(None, data))
        if len(self.ends) < MAX_PENDING:
            self.ends[message.job_id] = data
        out.events.append(self.ctx.event("replica_ended", now_ms, job_id=record.job_id.hex(), replica=index,
                                         why="exit" if isinstance(message, JobExit) else "no_room"))
        return data

    def on_replica_end(self, envelope, message, data: bytes, now_ms: int, out: Ready) -> bool:
        """A member's signed end of a replica it held (R4h): held, and the replacement's
        instance started. False: ``message`` is no replica's (a job's own exit or refusal)."""
        for record in self._replicated_jobs(with_rules=False):
            index = next((i for i in record.replicas if replica_key(record.job_id, i) == message.job_id), None)
            if index is None:
                continue
            replica = record.replicas[index]
            if (envelope.signer != replica.node or message.fence != replica.fence
                    or (isinstance(message, JobExit) and message.exit_code == 0)):
                self.ctx.counters["replica_end_refused"] += 1
                return True
            if message.job_id not in self.ends and len(self.ends) < MAX_PENDING:
                self.ends[message.job_id] = data
                if record.job_id not in self.noticing and len(self.pending) < MAX_PENDING:
                    self._start(record, REPLACEMENT_ANCHOR + index, data, now_ms, out)
            return True
        return False

    def _jobs_run_by(self, node: bytes) -> list:
        """The running jobs with reflex rules or replicas whose primary is ``node``, then those
        with a replica on ``node`` (whose rules read its vectors too, R4g)."""
        jobs = self.jobs.reflex_jobs_of(node)
        return jobs + [record for record in self._replicated_jobs() if record.primary != node
                       and any(r.node == node for r in record.replicas.values())]

    def _replicated_jobs(self, with_rules: bool = True) -> list:
        return [record for jid in sorted(self.with_replicas) if (record := self.jobs.get(jid)) is not None
                and record.state in ACTING_STATES and record.replicas and (record.manifest.reflexes or not with_rules)]

    def watches(self, node: bytes) -> bool:
        """Whether ``node``'s vectors may be evidence of a replica rule: it holds a replica of a
        running job with reflex rules (CapabilityBook keeps their history)."""
        return any(r.node == node for record in self._replicated_jobs() for r in record.replicas.values())

    def _trigger(self, record) -> bytes | None:
        """b"" for a fill, a signed ReflexTrigger for the first replica rule that holds, or None."""
        if clones_wanted(record, None):
            return b""
        histories = self.capability.history
        for index, rule in enumerate(record.manifest.reflexes):
            if rule.action not in REPLICA_ACTIONS or action_error(record, rule) is not None:
                continue
            # Every related cooldown at once (what replica_evidence_error checks one by one):
            # the longest span any asks, from the latest start any allows.
            bounds = [cooldown_bounds(rule, last, record.primary)
                      for last in related_reflex_at(record, index) or [None]]
            chains = [newest_chain(histories.of(record.primary), max(b[0] for b in bounds), max(b[1] for b in bounds),
                                   lambda cap: runs_job(cap, record.job_id, record.fence))]
            if reads_replicas(rule):
                chains += [newest_chain(histories.of(r.node), rule.for_ms, 0,
                                        lambda cap, since=r.since_seq: cap.seq > since)
                           for _i, r in sorted(record.replicas.items())]
            if None in chains or sum(len(chain) for chain in chains) > MAX_EVIDENCE:
                continue
            levels = [chain_level(rule, [cap for _e, cap in chain], record.job_id) for chain in chains]
            if levels[0] is None or not mean_holds(rule, [level for level in levels if level is not None]):
                continue
            return self.ctx.sign(ReflexTrigger(job_id=record.job_id, fence=record.fence, rule=index,
                                               evidence=tuple(envelope for chain in chains for envelope, _c in chain)))
        return None

    def instance_from_proposal(self, proposal, action: ReplicaAction, view, now_ms: int, out: Ready):
        if replica_instance_id(action.job_id, action.seq, action.anchor) != proposal.instance:
            raise RemoteProtocolError("replica_action proposal under a foreign instance id")
        if len(self.pending) >= MAX_PENDING:
            return None
        self.pending.setdefault(proposal.instance, (action.job_id, action.seq, action.anchor, action.trigger))
        return self.instances.start(proposal.instance, self, action.job_id, view, now_ms, out)

    # --- the leader's value --------------------------------------------------------------------
    def on_awaiting_value(self, inst, now_ms: int, out: Ready) -> None:
        """Propose the action for the trigger held for the instance (ours, or a proposal's)."""
        held = self.pending.get(inst.instance_id)
        if held is None:
            return
        jid, seq, anchor, trigger = held
        record = self.jobs.get(jid)
        if record is None or record.replica_seq != seq:
            return
        ended = self.ended_index(record, trigger)
        rule = self._rule(trigger)
        if trigger and rule is None and ended is None:
            return   # a replica's end whose replica is gone meanwhile (retired or dropped), or no rule
        nodes, vectors, changes = (), (), ()
        if rule is not None and rule.action != "clone":
            changes = weight_changes(record, rule)
        else:
            # A clone or fill adds its replicas; a replacement (R4h) one, in the ended one's place.
            picked = self._targets(record, rule, inst.instance_id, inst.view, now_ms, 1 if ended else None)
            if not picked:
                out.events.append(self.ctx.event("replica_no_target", now_ms, job_id=jid.hex()))
                return
            nodes, vectors = tuple(n for n, _ in picked), tuple(v for _, v in picked)
            changes = [(ended, 0)] if ended else []
        action = ReplicaAction(job_id=jid, seq=seq, anchor=anchor, trigger=trigger, nodes=nodes,
                               capabilities=vectors, replicas=tuple(i for i, _w in changes),
                               weights=tuple(w for _i, w in changes))
        self.instances.drive(inst, inst.propose(codec.pack(action.to_body()), (), now_ms, "replica_action"),
                             now_ms, out)

    def _rule(self, trigger: bytes):
        """The reflex rule a trigger names (None: a fill, a replacement, or no rule of the job)."""
        if not trigger:
            return None
        _envelope, request = decode_message(trigger, self.ctx.mesh_id, caches=self.ctx.caches)
        if not isinstance(request, ReflexTrigger):
            return None
        record = self.jobs.get(request.job_id)
        return record.manifest.reflexes[request.rule] if record and request.rule < len(record.manifest.reflexes) else None

    def ended_index(self, record, trigger: bytes) -> int | None:
        """R4h: the index of the replica whose end (a ``job_exit`` or ``job_refusal`` of its
        replica key) ``trigger`` is, if it is one of the job's replicas; else None."""
        if not trigger or record is None:
            return None
        _envelope, message = decode_message(trigger, self.ctx.mesh_id, caches=self.ctx.caches)
        if not isinstance(message, (JobExit, JobRefusal)):
            return None
        return next((i for i in record.replicas if replica_key(record.job_id, i) == message.job_id), None)

    def _targets(self, record, rule, iid: bytes, view, now_ms: int, wanted: int | None = None) -> list:
        """The best members for new replicas by R2's move_rank: not running the job already,
        room shown, healthy GPUs, and (for a reflex) not showing the rule's condition."""
        ranked = []
        taken = holders(record)
        for node in view.members:
            if node in taken:
                continue
            known = self.capability.signed_vector(node, now_ms)
            if known is None or self.target_error(record, rule, known[1]) is not None:
                continue
            ranked.append((move_rank(record.manifest, iid, node, known[1]), node, known[0]))
        ranked.sort()
        return [(node, vector) for _rank, node, vector in ranked[:wanted or clones_wanted(record, rule)]]

    @staticmethod
    def target_error(record, rule, cap: CapabilityVector) -> str | None:
        ok, reason, detail = capability_check(record.manifest, cap, {})
        if not ok:
            return "has no room: %s (%s)" % (reason, detail)
        if not all(gpu_healthy(g) for g in cap.gpus):
            return "has an unhealthy GPU"
        if rule is not None and condition_holds(rule, cap):
            return "shows the reflex's condition too"
        return None

    # --- validation (SPEC.md R4c) ------------------------------------------------------------------
    def _validator(self, iid: bytes):
        def validate(value_bytes: bytes, justification: tuple, proven: bool = False) -> str | None:
            inst = self.instances.get(iid)
            view = inst.view if inst is not None else self.epochs.view
            try:
                action = ReplicaAction.from_body(codec.unpack(value_bytes))
            except (RemoteProtocolError, ValueError) as exc:
                return "invalid replica_action proposal: %s" % exc
            return self.action_value_error(iid, action, view)
        return validate

    def action_value_error(self, iid: bytes, action: ReplicaAction, view) -> str | None:
        if replica_instance_id(action.job_id, action.seq, action.anchor) != iid:
            return "the action is for another instance"
        record = self.jobs.get(action.job_id)
        short = action.job_id.hex()[:12]
        if record is None:
            return "unknown job %s" % short
        if record.state not in ACTING_STATES:
            return "job %s is %s, not running" % (short, record.state)
        if action.seq != record.replica_seq:
            return "action %d of job %s, but it has had %d (stale)" % (action.seq, short, record.replica_seq)
        rule = None
        if action.trigger and not self._is_reflex(action.trigger):
            return self.replacement_error(record, action, view)
        if action.trigger:
            try:
                envelope, trigger = decode_message(action.trigger, self.ctx.mesh_id, expect=ReflexTrigger,
                                                   caches=self.ctx.caches)
                chain = primary_chain(trigger, self.ctx.mesh_id, self.ctx.caches)
            except RemoteProtocolError as exc:
                return "the action's trigger is not valid: %s" % exc
            if envelope.signer not in view.stakes:
                return "the trigger is not signed by a member"
            if trigger.job_id != action.job_id or trigger.fence != record.fence:
                return "the trigger is for another job or fence"
            if trigger.rule >= len(record.manifest.reflexes):
                return "the job has no reflex rule %d" % trigger.rule
            rule = record.manifest.reflexes[trigger.rule]
            if rule.action not in REPLICA_ACTIONS:
                return "reflex rule %d is not a replica action" % trigger.rule
            if not chain or chain[-1].seq != action.anchor:
                return "the trigger's last vector of the primary is not the action's anchor"
            error = replica_evidence_error(record, trigger, self.ctx.mesh_id, self.ctx.caches)
            if error is not None:
                return error
        error = action_error(record, rule)
        if error is not None:
            return error
        if rule is not None and rule.action != "clone":
            if action.nodes:
                return "a %s adds no nodes" % rule.action
            if list(zip(action.replicas, action.weights)) != weight_changes(record, rule):
                return "the weights do not follow R4d"
            return None
        if action.replicas:
            return "a clone changes no weights"
        return self.nodes_error(record, rule, action, view)

    def _is_reflex(self, trigger: bytes) -> bool:
        try:
            return isinstance(decode_message(trigger, self.ctx.mesh_id, caches=self.ctx.caches)[1], ReflexTrigger)
        except RemoteProtocolError:
            return True   # refused as a reflex trigger, with its reason

    def replacement_error(self, record, action: ReplicaAction, view) -> str | None:
        """R4h: the trigger is the signed end of one of the job's replicas (a failed exit, or a
        refusal for want of room) by the node that held it, at its fence; the value retires
        that replica and adds one other node for it, within the job's restart budget."""
        try:
            envelope, ended = decode_message(action.trigger, self.ctx.mesh_id, caches=self.ctx.caches)
        except RemoteProtocolError as exc:
            return "the action's trigger is not valid: %s" % exc
        if not isinstance(ended, (JobExit, JobRefusal)):
            return "the action's trigger is no reflex trigger, job exit or job refusal"
        index = self.ended_index(record, action.trigger)
        if index is None or list(zip(action.replicas, action.weights)) != [(index, 0)]:
            return "a replacement retires exactly the replica whose end it carries"
        replica = record.replicas[index]
        if envelope.signer != replica.node or ended.fence != replica.fence:
            return "the replica's end is not signed by its node at its fence"
        if isinstance(ended, JobExit) and ended.exit_code == 0:
            return "a replica that completed (exit 0) is not replaced"
        if action.anchor != REPLACEMENT_ANCHOR + index:
            return "a replacement's anchor is %d + its replica's index" % REPLACEMENT_ANCHOR
        if isinstance(ended, JobExit) and record.replica_restarts >= MAX_REPLICA_RESTARTS:
            return "the job's replicas were restarted %d times already" % MAX_REPLICA_RESTARTS
        return self.nodes_error(record, None, action, view, wanted=1)

    def nodes_error(self, record, rule, action: ReplicaAction, view, wanted: int | None = None) -> str | None:
        """A clone or fill: 1..clones_wanted new nodes (a replacement: one), members, distinct,
        not running the job, each with its own signed vector showing room, healthy GPUs, no condition."""
        wanted = wanted or clones_wanted(record, rule)
        if not 1 <= len(action.nodes) <= wanted:
            return "the action adds %d replicas, expected 1..%d" % (len(action.nodes), wanted)
        taken = holders(record)
        if len(set(action.nodes)) != len(action.nodes) or taken & set(action.nodes):
            return "a new replica's node runs the job already"
        for node, data in zip(action.nodes, action.capabilities):
            if node not in view.stakes:
                return "%s is not a member" % node.hex()[:12]
            try:
                envelope, cap = decode_message(data, self.ctx.mesh_id, expect=CapabilityVector, caches=self.ctx.caches)
            except RemoteProtocolError as exc:
                return "a new replica's vector is not valid: %s" % exc
            if envelope.signer != node or cap.node != node:
                return "the action carries another node's capability vector"
            unfit = self.target_error(record, rule, cap)
            if unfit is not None:
                return "%s %s" % (node.hex()[:12], unfit)
        return None

    # --- applying (SPEC.md R4d) ------------------------------------------------------------------
    @staticmethod
    def value_binding_error(iid: bytes, value_kind: str, action, epoch: int, mesh_id: bytes, slot_ms: int,
                            caches=None) -> str | None:
        """Votes sign only the value's hash: the instance must be the one the value names,
        and its trigger (if any) a valid reflex trigger of this mesh for that job, or the end
        of the replica the value retires (R4h)."""
        if replica_instance_id(action.job_id, action.seq, action.anchor) != iid:
            return "the action is for another instance"
        if action.trigger:
            try:
                trigger = decode_message(action.trigger, mesh_id, caches=caches)[1]
            except RemoteProtocolError as exc:
                return "the action's trigger is not valid: %s" % exc
            if isinstance(trigger, (JobExit, JobRefusal)):
                if len(action.replicas) != 1 or trigger.job_id != replica_key(action.job_id, action.replicas[0]):
                    return "the action's replica end is not of the replica it retires"
            elif not isinstance(trigger, ReflexTrigger) or trigger.job_id != action.job_id:
                return "the action's trigger is for another job"
        return None

    def binding_error(self, iid: bytes, value_kind: str, action, epoch: int) -> str | None:
        return self.value_binding_error(iid, value_kind, action, epoch, self.ctx.mesh_id, 0, caches=self.ctx.caches)

    def _forget(self, iid: bytes) -> None:
        held = self.pending.pop(iid, None)
        if held is not None and self.noticing.get(held[0]) == iid:
            del self.noticing[held[0]]

    def on_gave_up(self, iid: bytes, subject, now_ms: int, out: Ready) -> None:
        self._forget(iid)
        out.events.append(self.ctx.event("replica_action_gave_up", now_ms, job_id=subject.hex()))

    def on_dropped(self, iid: bytes) -> None:
        self._forget(iid)

    def apply(self, iid: bytes, value_kind: str, action: ReplicaAction, certificate: bytes, epoch: int, now_ms: int,
              out: Ready) -> None:
        self._forget(iid)
        # Instances of the same number (other noticers' anchors) can decide nothing now: this
        # node notices the job's next action without waiting for them to give up.
        for other, held in list(self.pending.items()):
            if held[0] == action.job_id and held[1] <= action.seq:
                self._forget(other)
        record = self.jobs.get(action.job_id)
        if record is None or action.seq > record.replica_seq:
            # Its predecessors (or the job itself) have not reached this node yet: applied once
            # they have, in number order, so every member ends with the same replicas.
            self._park(action)
            return
        self._apply_action(record, action, now_ms, out)
        self.apply_parked(now_ms, out)
        # The job's next action may be proven by the vectors already held (the clone,
        # reroute and decay hold on one condition): notice it now, not at the next vector (P1b).
        self.notice(record.primary, now_ms, out)

    def _park(self, action: ReplicaAction) -> None:
        if sum(len(held) for held in self.parked.values()) >= MAX_PARKED:
            self.ctx.counters["replica_actions_parked_full"] += 1
            return
        self.parked.setdefault(action.job_id, {})[action.seq] = action
        self.ctx.counters["replica_action_parked"] += 1

    def apply_parked(self, now_ms: int, out: Ready) -> None:
        """Apply each parked action whose turn came (its job known, its number the job's next)."""
        for jid in sorted(self.parked):
            record = self.jobs.get(jid)
            held = self.parked[jid]
            while record is not None and record.replica_seq in held:
                self._apply_action(record, held.pop(record.replica_seq), now_ms, out)
            if record is not None:
                for seq in [s for s in held if s < record.replica_seq]:
                    del held[seq]   # another value took that number here meanwhile
            if not held:
                del self.parked[jid]

    def _apply_action(self, record, action: ReplicaAction, now_ms: int, out: Ready) -> None:
        # Only the action number decides (every member counts the same actions in the same
        # order); the job's state may differ between members for a while, so it does not.
        if record.replica_seq != action.seq:
            self.ctx.counters["replica_action_stale"] += 1
            out.events.append(self.ctx.event("replica_action_stale", now_ms, job_id=action.job_id.hex(),
                                             seq=action.seq))
            return
        rule, detail = None, {"action": "fill"}
        trigger = decode_message(action.trigger, self.ctx.mesh_id, caches=self.ctx.caches)[1] if action.trigger else None
        if isinstance(trigger, (JobExit, JobRefusal)):
            # R4h: a replica ended (failed, or no room): one on another node takes its place.
            failed = isinstance(trigger, JobExit)
            record.replica_restarts += failed
            detail = {"action": "replace", "replaced": action.replicas[0], "why": "exit" if failed else "no_room"}
        elif trigger is not None:
            if trigger.rule >= len(record.manifest.reflexes) or not trigger.evidence:
                self.ctx.counters["replica_action_unbound"] += 1   # only a Byzantine quorum certifies one
                return
            rule = record.manifest.reflexes[trigger.rule]
            chain = primary_chain(trigger, self.ctx.mesh_id, self.ctx.caches)
            first, last = chain[0], chain[-1]
            # The primary's chain (its signer the primary then), from the value: the same at every member.
            record.replica_reflex_at[trigger.rule] = (last.node, last.taken_ms)
            detail = {"action": rule.action, "amount": rule.amount, "reflex": trigger.rule, "signal": rule.signal,
                      "held_ms": last.taken_ms - first.taken_ms}
        record.replica_seq += 1
        added = [add_replica(record, node, action.seq + 1, self._vector_seq(data))
                 for node, data in zip(action.nodes, action.capabilities)]
        if added:
            self.with_replicas.add(record.job_id)
        for index in added:
            self._take_on(record, index, now_ms, out)
        retired = set_weights(record, zip(action.replicas, action.weights))
        for index in retired:
            self.release(record.job_id, index)
        out.events.append(self.ctx.event("replica_action", now_ms, job_id=record.job_id.hex(), seq=action.seq,
                                         replicas=replica_count(record), added=added, retired=retired,
                                         to_nodes=[node.hex() for node in action.nodes],
                                         weights=[w for _i, w in sorted(weights(record).items())], **detail))

    def _vector_seq(self, data: bytes) -> int:
        return decode_message(data, self.ctx.mesh_id, expect=CapabilityVector, caches=self.ctx.caches)[1].seq

    def _take_on(self, record, index: int, now_ms: int, out: Ready) -> None:
        """R1 for a new replica on this node: its allocation, or it runs nothing here."""
        if record.replicas[index].node != self.ctx.me:
            return
        key = replica_key(record.job_id, index)
        if self.ledger.allocate_now(key, record.manifest.resources) is None:
            # No room here after all (the vector it was chosen by is older): another node takes
            # it, by decision (R4h), once the next vector of the job's primary is noticed.
            self.ctx.counters["replica_no_room"] += 1
            self._report_end(record, index, JobRefusal(job_id=key, fence=record.replicas[index].fence), now_ms, out)
            return
        self.allocated[key] = (record.job_id, index)

    def rebuild_claims(self) -> None:
        """R1 after a restart (the ledger was cleared): allocate each replica held here again,
        or hold it no more (it then runs nothing here)."""
        for key, (jid, index) in sorted(self.allocated.items()):
            record = self.jobs.get(jid)
            if record is None or self.ledger.allocate_now(key, record.manifest.resources) is None:
                del self.allocated[key]

    def release(self, jid: bytes, index: int) -> None:
        key = replica_key(jid, index)
        self.exited_here.discard(key)
        self.ends.pop(key, None)
        if self.allocated.pop(key, None) is not None:
            self.ledger.free(key)

    def drop_gone(self, now_ms: int, out: Ready) -> None:
        """R4b: a replica whose node is no longer a member (evicted or left) or is now the
        job's primary is dropped (a fill brings the job back to min_replicas); a job that
        ended drops all of its. Each is final, so the order in which members see them does
        not matter."""
        if not self.with_replicas:
            return
        members = self.epochs.view.stakes
        for jid in sorted(self.with_replicas):
            record = self.jobs.get(jid)
            if record is None or not record.replicas:
                self.with_replicas.discard(jid)
                continue
            ended = record.state in TERMINAL
            # A replica's node that became the job's primary (a move or an eviction took the
            # primary there) runs the primary instead: one run of the job per node, one port.
            gone = [i for i, r in record.replicas.items() if ended or r.node not in members or r.node == record.primary]
            for index in gone:
                del record.replicas[index]
                self.release(record.job_id, index)
            record.replicas_dropped += len(gone)
            if gone:
                out.events.append(self.ctx.event("replicas_dropped", now_ms, job_id=record.job_id.hex(),
                                                 retired=sorted(gone)))

    def exited(self, key: bytes, exit_code: int, now_ms: int, out: Ready) -> bool:
        """A replica's workload ended here (or could not start): it is not started again here.
        A failed or killed one (a non-zero code) is replaced on another node by decision
        (R4h); one that completed (0) stays down until a decay retires it or the job ends.
        False: ``key`` is no replica of ours."""
        held = self.allocated.get(key)
        if held is None:
            return False
        self.exited_here.add(key)
        jid, index = held
        out.events.append(self.ctx.event("replica_exited", now_ms, job_id=jid.hex(), replica=index,
                                         exit_code=exit_code))
        record = self.jobs.get(jid)
        if exit_code != 0 and record is not None and record.state in ACTING_STATES and index in record.replicas:
            code = exit_code if 0 < exit_code <= 255 else 255
            data = self._report_end(record, index, JobExit(job_id=key, fence=record.replicas[index].fence,
                                                           exit_code=code), now_ms, out)
            if record.job_id not in self.noticing and len(self.pending) < MAX_PENDING:
                self._start(record, REPLACEMENT_ANCHOR + index, data, now_ms, out)
        return True

    def runnable(self) -> list:
        """(key, record, index, replica, claim) of the replicas this node holds an allocation
        for and that have not exited here: what the workload orders run (R4e)."""
        rows = []
        for key, (jid, index) in sorted(self.allocated.items()):
            record = self.jobs.get(jid)
            if key not in self.exited_here and record is not None and index in record.replicas:
                rows.append((key, record, index, record.replicas[index], self.ledger.allocated(key)))
        return rows
