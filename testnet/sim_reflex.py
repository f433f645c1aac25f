"""Reflex rules in the simulator (``meshnode sim --reflex F``, SPEC.md R3).

That share of the jobs carries a migrate rule on GPU utilisation, or (every other one)
replica rules (SPEC.md R4: clone, reroute and decay while hot, decay away once cool,
within [service] bounds, some with min_replicas 2); every node reads its GPUs every
TELEMETRY_MS, cool except in hot spells drawn per node, so rules hold, break off and hold
again while faults are on. ``ReflexAudit`` adds the checks that no reflex action is
applied twice (an honest node applies at most one reflex move per job and fence, one
replica action per job and action number) and that replica actions keep their bounds:
never more replicas than max_replicas, never a retire below min_replicas.
All draws come from the run's workload rng, so runs without ``--reflex`` keep their worlds.
"""

from __future__ import annotations

from dataclasses import replace

from protocol.flows.move import decode_request
from protocol.messages import GpuState, Reflex, ReflexTrigger, Service, encode_message, job_id

TELEMETRY_MS = 100
HOT_UTIL_MILLI = 90_000          # a hot spell's reading: 90..95 %, jittered so each is a new vector
SIM_RULE = Reflex(signal="gpu_util", above=80, below=None, for_ms=300, zone="", action="migrate", cooldown_ms=1000)
# R4: while hot, one more replica, half the traffic to it, the original halved; once cool,
# the newest replica decays away (weight 0 retires it).
SIM_REPLICA_RULES = tuple(Reflex(signal="gpu_util", above=80, below=None, for_ms=300, zone="", action=action,
                                 cooldown_ms=1000, amount=amount)
                          for action, amount in (("clone", 1), ("reroute", 50), ("decay", 50))) + (
    Reflex(signal="gpu_util", above=None, below=20, for_ms=300, zone="", action="decay", cooldown_ms=500, amount=100),)
SIM_SERVICES = (Service(port=8080, min_replicas=1, max_replicas=3), Service(port=8080, min_replicas=2, max_replicas=3))
MAX_SPELLS = 2
REFLEX_SETTLE_MS = 1500          # after a node's last hot spell: its rule's duration and the move's vote


def add_reflexes(world, rng, per_mille: int) -> None:
    """Give that share of the world's jobs SIM_RULE or (every other one) the replica rules
    with a drawn service, signed again by their owners."""
    owners = {o.public_key: o for o in world.owners}
    for number, spec in enumerate(world.jobs):
        if rng.randrange(1000) >= per_mille:
            continue
        if number % 2 and not spec.job.gang.is_gang:
            spec.job = replace(spec.job, reflexes=SIM_REPLICA_RULES, service=rng.choice(SIM_SERVICES))
        else:
            spec.job = replace(spec.job, reflexes=(SIM_RULE,))
        spec.envelope = encode_message(owners[spec.job.owner], world.mesh_id, spec.job)
        spec.job_id = job_id(spec.job)


def hot_spells(world, rng, span_ms: int) -> dict[int, list[tuple[int, int]]]:
    """Per node, the [start, end) times its GPUs run hot."""
    spells = {}
    for node in world.nodes:
        spells[node.index] = []
        for _ in range(rng.randint(0, MAX_SPELLS)):
            start = rng.randint(0, span_ms)
            spells[node.index].append((start, start + rng.randint(150, 1500)))
    return spells


def reading(capacity, hot: bool, rng) -> tuple:
    """One telemetry reading of a node's GPUs."""
    util = HOT_UTIL_MILLI + rng.randint(0, 5000) if hot else 0
    return tuple(GpuState(index=i, model=capacity.gpu_model[:96], mem_total_mib=total, mem_used_mib=0,
                          util_milli=util, temp_milli_c=40_000, sm_clock_mhz=0, throttle_reasons=0, ecc_errors=0,
                          power_mw=0) for i, total in enumerate(capacity.gpu_mem_total_mib))


class ReflexAudit:
    """No reflex action applied twice: per node incarnation, one reflex move per (job, fence)
    and one replica action per (job, action number); replica actions within their bounds."""

    def __init__(self, mesh_id: bytes, checker) -> None:
        self.mesh_id = mesh_id
        self.checker = checker
        self.applied: set[tuple] = set()   # (node, incarnation, job id, fence)
        self.moves: set[bytes] = set()     # instances a reflex move was decided in
        self.replica_applied: set[tuple] = set()   # (node, incarnation, job id, seq)
        self.replica_actions: set[bytes] = set()   # instances a replica action was decided in

    def check(self, node, decision) -> None:
        if decision.value_kind == "replica_action":
            self.replica_actions.add(decision.instance)   # checked from its events (on_replica_events)
            return
        if decision.value_kind != "job_move":
            return
        _envelope, request = decode_request(decision.value.request, self.mesh_id)
        if not isinstance(request, ReflexTrigger):
            return
        self.moves.add(decision.instance)
        key = (node.index, node.incarnation, request.job_id, request.fence)
        if key in self.applied:
            self.checker.fail("reflex_applied_twice", node.index, decision.instance,
                              "job %s fence %d" % (request.job_id.hex()[:12], request.fence))
        self.applied.add(key)

    def on_replica_events(self, node, events) -> None:
        """R4, from the ``replica_action`` events of an honest node (one per action it applied,
        none for a stale value): one application per (job, seq) on a node incarnation; after
        it, at most max_replicas on members, and an action that retired one left at least
        min_replicas (unless a replica was dropped with its evicted node: a fill restores it)."""
        for event in events:
            if event.kind != "replica_action":
                continue
            jid, seq = bytes.fromhex(event.detail["job_id"]), event.detail["seq"]
            key = (node.index, node.incarnation, jid, seq)
            if key in self.replica_applied:
                self.checker.fail("reflex_applied_twice", node.index, None,
                                  "replica action %d of job %s" % (seq, jid.hex()[:12]))
            self.replica_applied.add(key)
            record = node.core.job_table.get(jid)
            if record is None:
                continue
            service, members = record.manifest.service, node.core.view.stakes
            running = 1 + sum(1 for r in record.replicas.values() if r.node in members)
            if running > service.max_replicas:
                self.checker.fail("replica_bounds", node.index, None, "job %s runs %d replicas, max %d"
                                  % (jid.hex()[:12], running, service.max_replicas))
            if event.detail["retired"] and not record.replicas_dropped and running < service.min_replicas:
                self.checker.fail("replica_bounds", node.index, None, "job %s retired to %d replicas, min %d"
                                  % (jid.hex()[:12], running, service.min_replicas))
