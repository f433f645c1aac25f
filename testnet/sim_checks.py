"""Invariant checkers of the simulator (SPEC.md section 11, "Checkers").

They run on every Decision any node emits, against one canonical history that spans
crashes and restarts, in the style of tigerbeetle's VOPR:

- agreement: one instance never decides two different values, at any node, ever;
- certificate: every decision carries a commit certificate that verifies offline
  against the epoch view it names (SPEC.md 6.4) and certifies exactly the value decided;
- validity: a placement names a job its owner signed, a primary and backups that are
  members, the job's resources and constraints hold at the primary, an honest primary's
  sovereignty policy admits the job, and no honest node is ever over-committed;
- liveness (after the run): every job decided at every honest node within the bound, but
  for a job no honest member can take any more (``Simulation._unplaceable_jobs``);
- evidence (after the run): every key that showed two conflicting signed messages to one
  honest node appears in that node's evidence;
- own votes: an honest node signs at most one proposal, prevote and precommit per
  (instance, epoch, round), across all its crashes and restarts (SPEC.md 6.9).

A checker never raises on a bad decision: it records a Violation, so a run reports all
of them and a test can assert that a deliberately broken input is caught.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

from keys.identity import short_id
from protocol.caches import CoreCaches
from protocol.errors import RemoteProtocolError
from protocol.gang_placement import gang_worker_id, topology_error
from protocol.gpu_shares import MILLI_PER_GPU
from protocol.job_table import FENCE_PER_ATTEMPT
from protocol.messages import (MAX_GANG_RANK_INDEX, Eviction, GangPlacement, GangReplacement, GangResize, JobManifest, JobMove,
                               MembershipChange,
                               Placement, PlacementSlot, decode_message, decode_value, job_id, placement_attempt,
                               value_hash)
from protocol.policy import LocalCapacity, NodePolicy
from protocol.ready import Decision
from testnet.sim_world import owner_and_constraints_fit

MAX_VIOLATIONS_KEPT = 200  # a broken run can produce millions; keep the first ones and the count


@dataclass(frozen=True)
class Violation:
    check: str          # agreement | certificate | validity | overcommit | ledger | liveness | evidence | own_votes | quota (SPEC Q2f)
    node: int | None    # simulator index of the node whose output broke the rule
    instance: str       # hex instance id ("" when not about one instance)
    detail: str

    def line(self) -> str:
        where = "node %s" % self.node if self.node is not None else "mesh"
        return "%s: %s %s: %s" % (self.check, where, self.instance[:16], self.detail)


@dataclass
class NodeFacts:
    """What the simulator knows to be true about a node (not what it claims)."""
    public_key: bytes
    zone: str
    labels: tuple
    policy: NodePolicy
    capacity: LocalCapacity
    honest: bool


def milli_each(resources) -> int:
    """The thousandths a job holds on each GPU it runs on (SPEC.md P4c)."""
    return resources.gpu_milli or MILLI_PER_GPU


@dataclass
class _Load:
    cpu_milli: int = 0
    mem_mib: int = 0
    gpu_milli: dict = field(default_factory=dict)    # gpu index -> thousandths committed (SPEC.md P4c)
    jobs: dict = field(default_factory=dict)         # job id -> (Resources, gpus)


class _TrueFacts:
    """A node's true zone and rail group, as topology_error reads a capability vector."""

    def __init__(self, facts: NodeFacts):
        self.node, self.zone, self.rail_group = facts.public_key, facts.zone, facts.capacity.rail_group


class DecisionChecker:
    """Holds the canonical history; ``check_decision`` is called for every Decision."""

    def __init__(self, mesh_id: bytes, facts: list[NodeFacts],
                 verify_certificate: Callable[[bytes, object], tuple]):
        # verify_certificate(certificate_bytes, views) -> (CommitCertificate, value_bytes);
        # it raises RemoteProtocolError when the certificate does not verify.
        self.mesh_id = mesh_id
        self.facts = facts
        self.index_of = {f.public_key: i for i, f in enumerate(facts)}
        self.verify_certificate = verify_certificate
        # The checker's own memo tables: it is an observer, not a core, and shares none with them.
        self.caches = CoreCaches()
        self.canonical: dict[bytes, tuple[str, bytes]] = {}   # instance -> (kind, value hash)
        self.decided_at: dict[bytes, dict[int, int]] = {}     # instance -> node -> first ms
        self.placement_of: dict[bytes, bytes] = {}            # job id -> instance that placed its newest attempt
        self.first_placement_of: dict[bytes, bytes] = {}      # job id -> instance that placed it first (liveness)
        self.placing_instances: dict[bytes, list] = {}        # job id -> every instance that placed an attempt
        self.attempt_of: dict[bytes, int] = {}                # job id -> newest attempt placed
        self.loads = [_Load() for _ in facts]
        self.job_home: dict[bytes, int] = {}                  # job id -> node holding it now
        self.job_backups: dict[bytes, tuple] = {}             # job id -> its backups (node indices) now
        self.job_resources: dict[bytes, object] = {}          # job id -> its Resources
        self.members = set(range(len(facts)))                 # after the evictions and joins decided so far
        self.plans: dict[int, dict] = {}                      # evicted node -> job id -> (target, backups)
        self.gang_attempt: dict[bytes, tuple] = {}            # gang job id -> (newest attempt placed, world size)
        self.gang_active: dict[bytes, list] = {}              # gang job id -> its ranks' worker ids now (GA8)
        self.gang_of_rank: dict[bytes, bytes] = {}            # worker id -> its gang's job id
        self.gang_next_index: dict[bytes, int] = {}          # gang job id -> its attempt's next rank index (GA9)
        self.gang_replaced = self.gang_resized = self.gang_grown = 0   # replacements (GA7), shrinks (GA8), grows (GA9)
        self.violations: list[Violation] = []
        self.violation_count = 0
        # The decision log, (ms, node, kind, instance hex, value hash hex) per decision, kept as
        # the running SHA-256 of its repr (a million decisions would not fit in memory).
        self.log_entries = 0
        self._log_hash = hashlib.sha256(b"[")
        self.signed: dict[tuple, bytes] = {}   # (node, instance, epoch, round, kind) -> envelope's SHA-256

    # --- recording -------------------------------------------------------------------------

    def fail(self, check: str, node: int | None, instance: bytes | None, detail: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append(Violation(check, node, instance.hex() if instance else "", detail))

    def check_own_vote(self, node: int, envelope: bytes) -> None:
        """An honest node persisted a proposal or vote it is about to send (table ``votes``).
        Ed25519 signatures are deterministic, so signing the same message again gives the
        same bytes: different bytes for one slot are two different messages."""
        _, vote = decode_message(envelope, self.mesh_id, caches=self.caches)
        slot = (node, vote.instance, vote.epoch, vote.round, type(vote).KIND)
        digest = hashlib.sha256(envelope).digest()
        first = self.signed.setdefault(slot, digest)
        if first != digest:
            self.fail("own_votes", node, vote.instance, "signed two different %ss in epoch %d round %d"
                      % (type(vote).KIND, vote.epoch, vote.round))

    def check_decision(self, node: int, decision: Decision, now_ms: int, views=None) -> None:
        """``views``: the deciding node's epoch views, passed through to verify_certificate."""
        instance = decision.instance
        try:
            certificate, value_bytes = self.verify_certificate(decision.certificate, views)
        except RemoteProtocolError as exc:
            self.fail("certificate", node, instance, "certificate does not verify: %s" % exc)
            return
        if certificate.instance != instance or certificate.value_kind != decision.value_kind:
            self.fail("certificate", node, instance, "certificate is for another instance or kind")
            return
        try:
            decided_value = decode_value(decision.value_kind, value_bytes, caches=self.caches)
        except RemoteProtocolError as exc:
            self.fail("certificate", node, instance, "certified value does not decode: %s" % exc)
            return
        if decided_value != decision.value:
            self.fail("certificate", node, instance, "decision value differs from the certified value")
        digest = value_hash(value_bytes, caches=self.caches)
        self._log((now_ms, node, decision.value_kind, instance.hex(), digest.hex()))
        seen_at = self.decided_at.setdefault(instance, {})
        if node in seen_at:
            # A node re-emitting a decision (after a restart) is fine if it is the same value.
            if self.canonical[instance][1] != digest:
                self.fail("agreement", node, instance, "node changed its own decision")
            return
        seen_at[node] = now_ms
        first = self.canonical.get(instance)
        if first is None:
            self.canonical[instance] = (decision.value_kind, digest)
            self._apply_first(node, instance, decided_value)
        elif first != (decision.value_kind, digest):
            self.fail("agreement", node, instance, "decided %s, another node decided %s"
                      % (digest.hex()[:12], first[1].hex()[:12]))

    def _log(self, entry: tuple) -> None:
        self._log_hash.update((", " if self.log_entries else "").encode() + repr(entry).encode())
        self.log_entries += 1

    def log_digest(self) -> str:
        """SHA-256 hex of ``repr`` of the list of every logged decision, in order."""
        final = self._log_hash.copy()
        final.update(b"]")
        return final.hexdigest()

    # --- validity ---------------------------------------------------------------------------

    def _apply_first(self, node: int, instance: bytes, value) -> None:
        """Validity and capacity are checked once per instance, on its first decision."""
        if isinstance(value, Placement):
            self._check_placement(node, instance, value)
        elif isinstance(value, GangPlacement):
            self._check_gang(node, instance, value)
        elif isinstance(value, PlacementSlot):
            for placement in value.placements:
                self._check_placement(node, instance, placement)
        elif isinstance(value, Eviction):
            self._apply_eviction(node, instance, value)
        elif isinstance(value, GangReplacement):
            self._check_gang_replace(node, instance, value)
        elif isinstance(value, GangResize):
            self._check_gang_resize(node, instance, value)
        elif isinstance(value, JobMove):
            self._apply_job_move(value)
        elif isinstance(value, MembershipChange) and value.change == "join":
            joined = self.index_of.get(value.member.public_key)
            if joined is not None:
                self.members.add(joined)

    def _placed_job(self, node: int, instance: bytes, envelope: bytes) -> JobManifest | None:
        """The job a decided value places, or None (a violation) if it is no valid signed job."""
        try:
            return decode_message(envelope, self.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                  caches=self.caches)[1]
        except RemoteProtocolError as exc:
            self.fail("validity", node, instance, "placed job is not a valid signed job: %s" % exc)
            return None

    def _check_placement(self, node: int, instance: bytes, placement: Placement) -> None:
        job = self._placed_job(node, instance, placement.job)
        if job is None:
            return
        jid = job_id(job)
        if job.gang.is_gang:
            self.fail("validity", node, instance, "gang %s decided as one placement, not a gang_placement"
                      % jid.hex()[:12])
            return
        if jid in self.placement_of and self.placement_of[jid] != instance:
            # A failed job is placed afresh by its next attempt's instance (SPEC.md P6); two
            # instances placing one attempt (a slot and the job's own) are a violation.
            earlier = self.attempt_of.get(jid)
            attempt = placement_attempt(instance, job)
            if earlier is None or attempt is None or attempt <= earlier:
                self.fail("validity", node, instance, "job %s placed by two instances" % jid.hex()[:12])
                return
            self._unload(jid)  # the attempt before it ended (its exit was not seen where it ran)
            self.attempt_of[jid] = attempt
        else:
            self.first_placement_of.setdefault(jid, instance)
            self.attempt_of.setdefault(jid, placement_attempt(instance, job) or 0)
        self.placement_of[jid] = instance
        self.placing_instances.setdefault(jid, []).append(instance)
        primary = self.index_of.get(placement.primary)
        backups = [self.index_of.get(b) for b in placement.backups]
        if primary is None or None in backups:
            self.fail("validity", node, instance, "placement names a non-member")
            return
        if primary in backups or len(set(backups)) != len(backups):
            self.fail("validity", node, instance, "primary repeated among backups")
        if len(backups) > job.backups:
            self.fail("validity", node, instance, "%d backups for a job asking %d" % (len(backups), job.backups))
        if len(placement.gpus) != job.resources.gpus or len(set(placement.gpus)) != len(placement.gpus):
            self.fail("validity", node, instance, "gpus %s do not match the job's %d"
                      % (placement.gpus, job.resources.gpus))
        facts = self.facts[primary]
        # Membership attributes are signed in the genesis, so even a Byzantine primary
        # cannot fake them: every voter checks them (SPEC.md 6.3, sovereign strategy).
        if job.constraints.zones and facts.zone not in job.constraints.zones:
            self.fail("validity", node, instance, "primary %s in zone %s, job wants %s"
                      % (short_id(facts.public_key), facts.zone, list(job.constraints.zones)))
        labels = dict(facts.labels)
        for key, wanted in job.constraints.labels:
            if labels.get(key) != wanted:
                self.fail("validity", node, instance, "primary lacks label %s=%s" % (key, wanted))
        self.job_home[jid] = primary
        self.job_backups[jid] = tuple(backups)
        self.job_resources[jid] = job.resources
        if primary not in self.members:
            # Decided in its job's epoch after its primary's eviction: every node moves it as
            # that eviction moved the jobs it knew (SPEC.md P5); the load goes with it.
            planned = self.plans.get(primary, {}).get(jid)
            if planned is not None:
                self.job_backups[jid] = planned[1]
                self._move(jid, primary, planned[0])
            else:
                self._move_to_first_live_backup(jid, primary)
        if not facts.honest:
            return  # its policy and capacity are whatever it claims; nothing more is checkable
        policy = facts.policy
        if policy.allowed_owners is not None and job.owner not in policy.allowed_owners:
            self.fail("validity", node, instance, "honest primary's policy refuses this owner")
        if job.entrypoint not in policy.allowed_entrypoints:
            self.fail("validity", node, instance, "honest primary's policy refuses entrypoint %s" % job.entrypoint)
        if self.job_home[jid] == primary:
            gpu_count = len(facts.capacity.gpu_mem_total_mib)
            for index in placement.gpus:
                if index >= gpu_count:
                    self.fail("validity", node, instance, "honest primary %d has no GPU %d" % (primary, index))
            self._commit(primary, jid, job.resources, tuple(placement.gpus))

    def _check_gang(self, node: int, instance: bytes, gang: GangPlacement) -> None:
        """SPEC.md GA1-GA4: one decision places every rank of one attempt, never again by
        another instance of that attempt (no two placements of one rank), at a size the job
        allows, on distinct members that keep the topology rule by their true zone and rail group."""
        job = self._placed_job(node, instance, gang.job)
        if job is None:
            return
        jid = job_id(job)
        attempt = placement_attempt(instance, job)
        if not job.gang.is_gang or attempt is None or len(gang.workers) not in job.gang.sizes():
            self.fail("validity", node, instance, "gang_placement of %s: not a gang, not its attempt, or a size "
                      "it does not allow (%d workers)" % (jid.hex()[:12], len(gang.workers)))
            return
        earlier = self.gang_attempt.get(jid)
        if earlier is not None:
            if attempt <= earlier[0]:
                self.fail("gang", node, instance, "ranks of gang %s placed by two instances of attempt %d"
                          % (jid.hex()[:12], attempt))
                return
            for rank in range(earlier[1]):   # the attempt before ended (a refusal or a failure)
                self._unload(gang_worker_id(jid, rank))
            for wid in self.gang_active.get(jid, ()):
                self._unload(wid)   # ranks renumbered by a shrink, too
        self.gang_attempt[jid] = (attempt, len(gang.workers))
        self.gang_next_index[jid] = len(gang.workers)
        self.gang_active[jid] = [gang_worker_id(jid, rank) for rank in range(len(gang.workers))]
        self.gang_of_rank.update((wid, jid) for wid in self.gang_active[jid])
        self.first_placement_of.setdefault(jid, instance)
        self.placement_of[jid] = instance
        self.placing_instances.setdefault(jid, []).append(instance)
        holders = [self.index_of.get(w.node) for w in gang.workers]
        if None in holders or any(self.index_of.get(b) is None for b in gang.backups):
            self.fail("validity", node, instance, "gang placement names a non-member")
            return
        broken = topology_error(job.gang.topology, [_TrueFacts(self.facts[h]) for h in holders])
        if broken is not None:
            self.fail("gang", node, instance, "gang %s breaks its topology: %s" % (jid.hex()[:12], broken))
        for rank, holder in enumerate(holders):
            facts = self.facts[holder]
            if facts.honest and not owner_and_constraints_fit(job, facts.policy, facts.zone, facts.labels):
                self.fail("validity", node, instance, "honest node %d may not run rank %d of gang %s"
                          % (holder, rank, jid.hex()[:12]))
            wid = gang_worker_id(jid, rank)
            self.job_backups[wid] = tuple(self.index_of.get(b) for b in gang.backups)
            self.job_resources[wid] = job.resources
            if holder in self.members:   # else evicted since: the rank waits for its replacement (GA7)
                self._commit(holder, wid, job.resources, tuple(gang.workers[rank].gpus))

    def _check_gang_replace(self, node: int, instance: bytes, value: GangReplacement) -> None:
        """SPEC.md GA7, GA8: a lost rank of the gang's newest attempt goes to one member that
        runs no other rank of it and keeps the topology rule with the survivors by their true
        facts; a shrink leaves a size the job allows (within [min, max], a multiple), below
        the one before, with the kept ranks keeping the rule. A value for an attempt that has
        ended since changes nothing (every node finds the rank no longer waiting)."""
        job = self._placed_job(node, instance, value.job)
        if job is None:
            return
        jid = job_id(job)
        wid = gang_worker_id(jid, value.rank)
        active = self.gang_active.get(jid, [])
        if wid not in active or value.fence // FENCE_PER_ATTEMPT != self.gang_attempt[jid][0]:
            return
        survivors = [w for w in active if w != wid]
        homes = [self.job_home.get(w) for w in survivors]
        self._unload(wid)
        if value.shrinks:
            self.fail("gang", node, instance, "gang %s shrunk by a gang_replace, not by its numbered resize (GA9)"
                      % jid.hex()[:12])
            return
        self.gang_replaced += 1
        target = self.index_of.get(value.to_node)
        if target is None or target in homes:
            self.fail("gang", node, instance, "rank %d of gang %s replaced on an unknown node or on a node running "
                      "another rank" % (value.rank, jid.hex()[:12]))
            return
        placed = [h for h in homes if h is not None] + [target]
        broken = topology_error(job.gang.topology, [_TrueFacts(self.facts[h]) for h in placed])
        if broken is not None and len(placed) == len(active):
            self.fail("gang", node, instance, "gang %s repaired against its topology: %s" % (jid.hex()[:12], broken))
        self.job_backups[wid] = tuple(self.index_of.get(b) for b in value.backups)
        if target in self.members:   # else evicted since the value's epoch: the rank waits again (P5, GA7)
            self._commit(target, wid, job.resources, self._least_loaded_gpus(target, job.resources.gpus))

    def _check_gang_resize(self, node: int, instance: bytes, value: GangResize) -> None:
        """SPEC.md GA8, GA9, in number order (a number's instance starts only once the number
        before it was applied, so first decisions come in that order): a shrink leaves a size
        the job allows below the one before, the kept ranks keeping the rule; a grow adds
        ranks on members running no rank of the gang, up to a size the job allows, the whole
        gang keeping the rule by the nodes' true zone and rail group. A resize of an ended
        attempt changes nothing."""
        job = self._placed_job(node, instance, value.job)
        if job is None:
            return
        jid = job_id(job)
        if jid not in self.gang_attempt or value.attempt != self.gang_attempt[jid][0]:
            return
        active = self.gang_active.get(jid, [])
        sizes = job.gang.sizes()
        if value.shrinks:
            if value.lost not in active:
                return   # its rank was left out already: the number changes nothing (GA9)
            self.gang_resized += 1
            survivors = [w for w in active if w != value.lost]
            homes = [self.job_home.get(w) for w in survivors]
            if value.size not in sizes or value.size >= len(active):
                self.fail("gang", node, instance, "gang %s shrunk to %d workers from %d (sizes %s)"
                          % (jid.hex()[:12], value.size, len(active), list(sizes)))
            for dropped in [value.lost, *survivors[value.size:]]:
                self._unload(dropped)
            self.gang_active[jid] = survivors[:value.size]
            kept = [h for h in homes[:value.size] if h is not None]
            broken = topology_error(job.gang.topology, [_TrueFacts(self.facts[h]) for h in kept])
            if broken is not None and len(kept) == value.size:
                self.fail("gang", node, instance, "gang %s shrunk against its topology: %s" % (jid.hex()[:12], broken))
            return
        if value.size != len(active) + len(value.nodes):
            return   # not the gang this number stands at: every node leaves it unapplied (GA9)
        self.gang_grown += 1
        homes = [self.job_home.get(w) for w in active]
        targets = [self.index_of.get(n) for n in value.nodes]
        if value.size not in sizes or None in targets or set(targets) & set(homes):
            self.fail("gang", node, instance, "gang %s grown to %d workers (sizes %s) onto an unknown node or a node "
                      "running another rank" % (jid.hex()[:12], value.size, list(sizes)))
            return
        placed = [h for h in homes if h is not None] + targets
        broken = topology_error(job.gang.topology, [_TrueFacts(self.facts[h]) for h in placed])
        if broken is not None and len(placed) == value.size:
            self.fail("gang", node, instance, "gang %s grown against its topology: %s" % (jid.hex()[:12], broken))
        for target in targets:
            wid = gang_worker_id(jid, self.gang_next_index[jid])
            self.gang_next_index[jid] += 1
            active.append(wid)
            self.gang_of_rank[wid] = jid
            self.job_resources[wid] = job.resources
            if target in self.members:
                self._commit(target, wid, job.resources, self._least_loaded_gpus(target, job.resources.gpus))
        self.gang_active[jid] = active

    def check_gangs_running(self, runs_by_node: dict) -> None:
        """At the end of a run (SPEC.md GA4): no rank of a gang's ended attempt still runs on
        an honest node, and no rank runs on two honest nodes at once."""
        where: dict[bytes, int] = {}
        newest = {wid: (jid, self.gang_attempt[jid][0]) for jid, wids in self.gang_active.items() for wid in wids}
        stale = {gang_worker_id(jid, rank): jid for jid in self.gang_attempt for rank in range(MAX_GANG_RANK_INDEX)}
        for node, runs in sorted(runs_by_node.items()):
            for run in runs:
                wid = run.job_id
                if wid in stale and wid not in newest:
                    self.fail("gang", node, None, "node %d runs a rank the gang's newest attempt does not have"
                              % node)
                if wid in newest and run.fence // FENCE_PER_ATTEMPT != newest[wid][1]:
                    self.fail("gang", node, None, "node %d runs a rank of gang %s's ended attempt %d"
                              % (node, newest[wid][0].hex()[:12], run.fence // FENCE_PER_ATTEMPT))
                if wid in newest and where.setdefault(wid, node) != node:
                    self.fail("gang", node, None, "a rank of gang %s runs on nodes %d and %d"
                              % (newest[wid][0].hex()[:12], where[wid], node))

    def _commit(self, holder: int, jid: bytes, resources, gpus: tuple) -> None:
        """The load a decision puts on ``holder``: what ``could_host`` counts. Whether an
        honest node is over-committed is judged on what it runs (``check_running``): a
        placement or migration it has no room for it refuses (SPEC.md R1)."""
        facts = self.facts[holder]
        self.job_home[jid] = holder
        if not facts.honest:
            return
        load = self.loads[holder]
        load.jobs[jid] = (resources, gpus)
        load.cpu_milli += resources.cpu_milli
        load.mem_mib += resources.mem_mib
        for index in gpus:
            load.gpu_milli[index] = load.gpu_milli.get(index, 0) + milli_each(resources)

    def check_running(self, node: int, runs: tuple, started: tuple) -> None:
        """No over-commit (SPEC.md R1), on what an honest node's core orders its driver to
        run, the truth of what it holds: after every "run" order (``started``), the workloads
        it runs (``runs``, every WorkloadRun not stopped, exited or lost in a crash since)
        fit its true capacity: CPU and memory sums, on each GPU the workloads' thousandths at
        most 1000 (a whole GPU holds 1000, a share its ``gpu_milli``: SPEC.md P4c), every GPU
        one that exists, with the memory and the count the job asks for."""
        capacity = self.facts[node].capacity
        gpu_totals = capacity.gpu_mem_total_mib
        where = started[0].job_id if started else None
        held: dict[int, list[bytes]] = {}
        held_milli: dict[int, int] = {}
        for run in runs:
            resources = run.manifest.resources
            if len(run.gpus) != resources.gpus:
                self.fail("overcommit", node, where, "node %d runs job %s on %d GPUs, it asks for %d"
                          % (node, run.job_id.hex()[:12], len(run.gpus), resources.gpus))
            for index in run.gpus:
                if index >= len(gpu_totals) or gpu_totals[index] < resources.gpu_mem_mib:
                    self.fail("overcommit", node, where, "node %d runs job %s on GPU %d, which it lacks"
                              % (node, run.job_id.hex()[:12], index))
                    continue
                held.setdefault(index, []).append(run.job_id)
                held_milli[index] = held_milli.get(index, 0) + milli_each(resources)
        for index, milli in sorted(held_milli.items()):
            if milli > MILLI_PER_GPU:
                self.fail("overcommit", node, where, "node %d runs jobs %s on GPU %d: %d of 1000 milli"
                          % (node, " and ".join(j.hex()[:12] for j in held[index]), index, milli))
        cpu = sum(run.manifest.resources.cpu_milli for run in runs)
        mem = sum(run.manifest.resources.mem_mib for run in runs)
        if cpu > capacity.cpu_milli:
            self.fail("overcommit", node, where, "node %d runs %d jobs, cpu %d of %d milli"
                      % (node, len(runs), cpu, capacity.cpu_milli))
        if mem > capacity.mem_mib:
            self.fail("overcommit", node, where, "node %d runs %d jobs, memory %d of %d MiB"
                      % (node, len(runs), mem, capacity.mem_mib))

    def job_of(self, placement: Placement) -> bytes:
        _, job = decode_message(placement.job, self.mesh_id, expect=JobManifest, allow_any_mesh=True,
                                caches=self.caches)
        return job_id(job)

    def job_ended(self, holder: int, jid: bytes) -> None:
        """The node holding the job saw it end (its exit, or its owner's cancel): the load goes."""
        if self.job_home.get(jid) == holder:
            self._unload(jid)

    def _unload(self, jid: bytes) -> None:
        holder = self.job_home.pop(jid, None)
        old = self.loads[holder].jobs.pop(jid, None) if holder is not None else None
        if old is None:
            return
        resources, gpus = old
        load = self.loads[holder]
        load.cpu_milli -= resources.cpu_milli
        load.mem_mib -= resources.mem_mib
        for index in gpus:
            load.gpu_milli[index] = load.gpu_milli.get(index, 0) - milli_each(resources)

    def _apply_eviction(self, node: int, instance: bytes, eviction: Eviction) -> None:
        evicted = self.index_of.get(eviction.node)
        if evicted is None:
            self.fail("validity", node, instance, "eviction of a non-member")
            return
        self.members.discard(evicted)
        planned = set()
        plan = self.plans.setdefault(evicted, {})
        for migration in eviction.migrations:
            target = self.index_of.get(migration.to_node)
            if target is None or target == evicted:
                self.fail("validity", node, instance, "migration to a non-member or to the evicted node")
                continue
            if migration.job_id in self.gang_of_rank:
                continue   # GA7: a plan never moves a gang's rank (the node applying it ignores it)
            planned.add(migration.job_id)
            plan[migration.job_id] = (target, tuple(self.index_of.get(b) for b in migration.backups))
            if self.job_home.get(migration.job_id) != evicted:
                continue  # not a job this history placed on the evicted node: nothing to move
            self.job_backups[migration.job_id] = tuple(self.index_of.get(b) for b in migration.backups)
            self._move(migration.job_id, evicted, target)
        for jid in [j for j, home in self.job_home.items() if home == evicted and j not in planned]:
            if jid in self.gang_of_rank and jid in self.gang_active.get(self.gang_of_rank[jid], ()):
                self._unload(jid)   # GA7: a gang's rank waits for its replacement, decided on its own
                continue
            self._move_to_first_live_backup(jid, evicted)

    def _move_to_first_live_backup(self, jid: bytes, gone: int) -> None:
        """SPEC.md F5 for a job its eviction's plan did not name (and P5 for a placement decided
        after its primary's eviction): the first backup still a member takes it."""
        live = [b for b in self.job_backups.get(jid, ()) if b in self.members and b != gone]
        if live:
            self.job_backups[jid] = tuple(b for b in live[1:])
            self._move(jid, gone, live[0])

    def _apply_job_move(self, move: JobMove) -> None:
        """An owner's move (SPEC.md R2): the load goes with the job when it is still where the
        move takes it from (nodes where an eviction moved it first apply nothing)."""
        _envelope, request = decode_message(move.request, self.mesh_id, caches=self.caches)
        source, target = self.index_of.get(move.from_node), self.index_of.get(move.to_node)
        if source is None or target is None or self.job_home.get(request.job_id) != source:
            return
        self.job_backups[request.job_id] = tuple(self.index_of[b] for b in move.backups if b in self.index_of)
        self._move(request.job_id, source, target)

    def _move(self, jid: bytes, evicted: int, target: int) -> None:
        """Move a job's load from ``evicted`` to ``target``, which takes it on or refuses it
        (R1: a refusal takes the load off it again, ``job_ended``)."""
        old = self.loads[evicted].jobs.pop(jid, None)
        resources = self.job_resources.get(jid)
        if old is not None:
            resources, gpus = old
            load = self.loads[evicted]
            load.cpu_milli -= resources.cpu_milli
            load.mem_mib -= resources.mem_mib
            for index in gpus:
                load.gpu_milli[index] = load.gpu_milli.get(index, 0) - milli_each(resources)
        if resources is None:
            self.job_home[jid] = target
            return
        # The new primary picks its own GPUs on arrival (SPEC.md R1); the evicted node's
        # indices mean nothing there. Charge its least loaded GPUs, as allocate_now does.
        arrival = self._least_loaded_gpus(target, resources.gpus)
        self._commit(target, jid, resources, arrival)

    def _least_loaded_gpus(self, holder: int, count: int) -> tuple:
        used = self.loads[holder].gpu_milli
        indices = range(len(self.facts[holder].capacity.gpu_mem_total_mib))
        chosen = sorted(indices, key=lambda i: (used.get(i, 0), i))[:count]
        # Too few GPUs: indices past the end (the target refuses such a job, R1).
        return tuple(chosen) + tuple(range(len(indices), len(indices) + count - len(chosen)))

    # --- end-of-run checks ---------------------------------------------------------------

    def could_host(self, holder: int, job: JobManifest) -> bool:
        """Whether honest node ``holder`` could take ``job`` now, by what the simulator knows
        to be true (not what any node claims): its policy, its member facts, and the capacity
        left by the placements this history committed to it (whole GPUs, SPEC.md R1)."""
        facts = self.facts[holder]
        policy, resources = facts.policy, job.resources
        if job.entrypoint not in policy.allowed_entrypoints:
            return False
        if not owner_and_constraints_fit(job, policy, facts.zone, facts.labels):
            return False
        load, capacity = self.loads[holder], facts.capacity
        if resources.gpus and resources.gpu_model and resources.gpu_model != capacity.gpu_model:
            return False   # a node of another GPU model never could (trace slices name models)
        free_gpus = [i for i, total in enumerate(capacity.gpu_mem_total_mib)
                     if load.gpu_milli.get(i, 0) + milli_each(resources) <= MILLI_PER_GPU
                     and total >= resources.gpu_mem_mib]
        return (len(free_gpus) >= resources.gpus and load.cpu_milli + resources.cpu_milli <= capacity.cpu_milli
                and load.mem_mib + resources.mem_mib <= capacity.mem_mib)

    def late_jobs(self, jobs: dict[bytes, int], deciders: list[int], deadline_ms: int,
                  unplaceable: frozenset = frozenset(), excused_ms: dict | None = None) -> list[tuple]:
        """(job id, instance or None, submit ms, late nodes, deadline) for every job (id -> submit
        ms) not placed at every node in ``deciders`` by ``deadline_ms`` plus its ``excused_ms``
        (time its placement spent in rounds a Byzantine member led), the ``unplaceable`` aside."""
        late_jobs = []
        for jid, submitted_ms in jobs.items():
            if jid in unplaceable:
                continue
            due_ms = deadline_ms + (excused_ms or {}).get(jid, 0)
            instance = self.first_placement_of.get(jid)
            seen = self.placed_at(jid)
            late = [n for n in deciders if seen.get(n, due_ms + 1) > due_ms]
            if late:
                late_jobs.append((jid, instance, submitted_ms, late, due_ms))
        return late_jobs

    def placed_at(self, jid: bytes) -> dict[int, int]:
        """node -> when it first decided a placement of the job, of any attempt: a node that
        learnt a retry's placement first refuses the older attempt's certificate
        (``placement_of_earlier_attempt``) and rightly never decides that instance."""
        seen: dict[int, int] = {}
        for instance in self.placing_instances.get(jid, ()):
            for node, at_ms in self.decided_at.get(instance, {}).items():
                seen[node] = min(at_ms, seen.get(node, at_ms))
        return seen

    def check_liveness(self, jobs: dict[bytes, int], deciders: list[int], deadline_ms: int,
                       unplaceable: frozenset = frozenset(), excused_ms: dict | None = None,
                       reason_of: Callable[..., str] | None = None) -> int:
        """Every job (id -> submit ms) placed at every node in ``deciders`` by ``deadline_ms``
        plus its ``excused_ms``, except the ``unplaceable`` ones no honest member can take.

        Returns how many (job, node) pairs were missing; each missing job is one violation.
        ``reason_of(job id, instance, submit ms, late nodes, due ms)`` names why, in its detail.
        """
        missing_pairs = 0
        for entry in self.late_jobs(jobs, deciders, deadline_ms, unplaceable, excused_ms):
            jid, instance, submitted_ms, late, due_ms = entry
            missing_pairs += len(late)
            reason = " (%s)" % reason_of(*entry) if reason_of is not None else ""
            self.fail("liveness", late[0], instance or jid, "job submitted at %d ms not decided at %d of "
                      "%d honest nodes by %d ms%s" % (submitted_ms, len(late), len(deciders), due_ms, reason))
        return missing_pairs

    def check_evidence(self, witnessed: dict[int, set[int]], evidence_of: Callable[[int], set[bytes]]) -> None:
        """``witnessed``: offender -> honest nodes that received two of its conflicting messages."""
        for offender, witnesses in sorted(witnessed.items()):
            offender_key = self.facts[offender].public_key
            holders = [w for w in sorted(witnesses) if offender_key in evidence_of(w)]
            if not holders:
                self.fail("evidence", offender, None, "equivocation seen by honest nodes %s but recorded by none"
                          % sorted(witnesses)[:8])

    def latencies_ms(self, jobs: dict[bytes, int], deciders: list[int]) -> list[int]:
        """Per decided job: submit -> commit certificate held by every node in ``deciders``."""
        out = []
        for jid, submitted_ms in jobs.items():
            seen = self.decided_at.get(self.first_placement_of.get(jid), {})
            if deciders and all(n in seen for n in deciders):
                out.append(max(seen[n] for n in deciders) - submitted_ms)
        return out
