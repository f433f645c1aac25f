"""The deterministic simulator: N real MeshCores in one process (SPEC.md section 11).

One ``random.Random(seed)`` draws the world, the fault schedule, every network delay,
loss and duplication, and each core's own rng; virtual time is an integer ms clock
advanced by an event queue (heapq, ties broken by a sequence number). So a seed is a
complete, replayable description of a run.

A run has two phases (tigerbeetle VOPR style):
1. safety, ``[0, heal_ms)``: crashes and restarts (a restarted node is a fresh MeshCore
   built from the commit certificates it persisted), partitions, delay spikes, loss,
   duplication, reordering, and Byzantine nodes under 1/3 of the stake;
2. liveness, from ``heal_ms``: every fault is healed and every crashed node restarted;
   every job must then be decided at every honest node within ``liveness_bound_ms``.

The driver honours the Ready contract (protocol/ready.py): persist, then send, then
check decisions. Every decision goes through the checkers (testnet/sim_checks.py).
"""

from __future__ import annotations

import gc
import heapq
import random
import time
from dataclasses import dataclass, field, replace

from protocol.caches import CoreCaches
from protocol.certificate import verify_commit_certificate
from protocol.drain import ReadyDrain
from protocol.errors import MeshError, RemoteProtocolError
from protocol.gpu_shares import MILLI_PER_GPU
from protocol.instances import SAFETY_TABLES
from protocol.job_table import LIVE_JOB_STATES, TERMINAL
from protocol.mesh import MeshCore
from protocol.quota import Quotas, demand
from protocol.quota_admission import CANCEL_STOP_GRACE_ROUNDS
from protocol.messages import Cancel, CommitCertificate, Decline, MoveRequest, decode_message, encode_message, job_id
from protocol.ready import Ready
from testnet.byzantine import BEHAVIOURS, SLOT_BEHAVIOURS, ByzantineBehaviour
from testnet.sim_checks import DecisionChecker, NodeFacts
from testnet.sim_borrowing import BorrowingAudit
from testnet.sim_liveness import CAPACITY_WAIT, LivenessTracker
from testnet.sim_quota import QuotaBoundCheck
from testnet.sim_network import DelayModel, SimNetwork, random_partition
from testnet.sim_reflex import REFLEX_SETTLE_MS, TELEMETRY_MS, ReflexAudit, add_reflexes, hot_spells, reading
from testnet.sim_job_signals import JobSignalMoves, job_signals, use_latency_rules
from testnet.sim_world import GENESIS_MS, SIM_PARAMS, ZONES, World, build_world, with_gangs

FAULTS = ("crash", "partition", "asym", "delay", "loss", "dup", "reorder")
TICK, DELIVER, SUBMIT, CRASH, RESTART, HEAL, EXIT, CANCEL, MOVE, CHECKPOINT, TELEMETRY, GANG_KILL = range(12)
GANG_KILL_START_MS, GANG_KILL_SPACING_MS = 1500, 3500   # --gang-kills: after gangs are placed, one per spacing
GANG_KILL_DOWN_MS = 3000                                 # a killed rank node's downtime: detection is 300 ms
CHECKPOINT_MS = 100             # with --preempt, a run reports its start, then checkpoints this often
CANCEL_TRIES = 20                # an owner's client tries this many nodes before it gives the cancel up
MAX_EVENTS_QUEUED = 20_000_000   # a runaway message storm fails the run instead of eating memory
MAX_CRASHES = 8
RETRY_SUBMIT_MS = 50
# A run allocates millions of small objects that mostly live until it ends (the cores'
# state); with the default gen-0 threshold (700) the collector rescans them so often that
# it took 30% of a 1000-node run. Garbage cycles are rare here, so collect far less often.
GC_GEN0_THRESHOLD = 100_000


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 4
    jobs: int = 4
    seed: int = 0
    byzantine_milli: int = 0          # Byzantine share of the total stake, x 1000
    faults: tuple[str, ...] = FAULTS
    heartbeats: bool = True
    bid_sample: int | None = None     # MeshCore(bid_sample=K): about K members bid per job (scale runs)
    slot_ms: int = 0                  # genesis placement_slot_ms: batch first placements per slot (SPEC.md P7)
    # One CoreCaches for every simulated core (MeshCore(caches=)): a signature, certificate
    # or value one node checked is not checked again by the next. Entries are pure functions
    # of bytes, so decisions are the same either way (tests/test_caches.py); per-core tables
    # multiply the simulator's CPU by the mesh size (18x at 64 nodes), as real nodes pay it.
    shared_caches: bool = True
    tick_ms: int = 10                 # every node's core.tick period
    safety_ms: int = 1000             # faults are active in [0, safety_ms) when any are on
    submit_window_ms: int = 400       # jobs are submitted at seeded times in [0, window]
    # Stated liveness bound after healing: a few maximal round timeouts (SIM_PARAMS
    # round_timeout_max_ms = 1600) so a round that started just before the heal, with its
    # timeout already backed off, can end and the next (healed) round can decide.
    liveness_bound_ms: int = 5000
    # Workloads that end (all off by default: a job then runs until the run ends, as before).
    # ``job_ms`` > 0: a job's run lasts a drawn time in [job_ms / 2, 3 * job_ms / 2] from
    # the moment its primary's core orders it to run, then its primary's core gets
    # ``job_exited`` (a migrated or restarted run starts afresh); ``job_fail_per_mille`` of
    # those exits fail (exit code 1: the job is retried, SPEC.md P6). ``cancel_per_mille``:
    # that share of the jobs is cancelled by its owner at a drawn time after its submission.
    # All of it is drawn from its own seeded rng, so runs without keep their seeds' worlds.
    job_ms: int = 0
    job_fail_per_mille: int = 0
    cancel_per_mille: int = 0
    # That share of the jobs asks for a share of one GPU (SPEC.md P4c), some with strategy
    # ``pack``, so shares of several jobs pile onto one GPU (0: the worlds of before).
    fractional_per_mille: int = 0
    # > 0: the genesis declares the default pool with this many GPUs per owner (SPEC.md
    # 5.5, Q2), and ``reservations`` turns Q5 on; a job every honest member holds back by
    # those rules at the end is counted (``quota_held_jobs``), not a stall.
    quota_gpus: int = 0
    reservations: bool = False
    # ``move_per_mille``: that share of the jobs is moved by its owner (SPEC.md R2) at a drawn
    # time after its submission, to where the mesh picks; a run ordered then reports that
    # it started, as the node driver does (a job is moved only once it runs).
    move_per_mille: int = 0
    # ``reflex_per_mille``: that share of the jobs carries a migrate rule on GPU utilisation
    # (SPEC.md R3) and every node reads its GPUs, hot in drawn spells (testnet/sim_reflex.py).
    reflex_per_mille: int = 0
    # A preemption workload (SPEC.md P8): GPU jobs, more than fit, of mixed priorities, about
    # half preemptible (testnet/sim_world.py); with ``job_ms`` the room returns as jobs end.
    preempt: bool = False
    # ``gang_per_mille`` of the jobs are gangs (SPEC.md GA1, sim_world.with_gangs), drawn from
    # their own rng too. A gang no set of honest members fits (its size, its topology) may
    # stay pending: unplaced gangs are counted, not owed by the liveness check.
    gang_per_mille: int = 0
    # ``gang_kills``: that many times, from GANG_KILL_START_MS on, every GANG_KILL_SPACING_MS,
    # a seeded pick among the honest nodes running a gang's rank crashes for GANG_KILL_DOWN_MS
    # (long past detection, so it is evicted and the rank replaced, GA7, or the gang shrunk).
    gang_kills: int = 0

    @property
    def workloads(self) -> bool:
        """Whether jobs end in this run (exits or cancels)."""
        return self.job_ms > 0 or self.cancel_per_mille > 0 or self.move_per_mille > 0 or self.reflex_per_mille > 0

    @property
    def runs_reported(self) -> bool:
        """Whether a run ordered reports that it started, as the node driver does (moves and
        reflexes act on running jobs only)."""
        return self.move_per_mille > 0 or self.reflex_per_mille > 0

    def reproduce(self) -> str:
        line = "meshnode sim --nodes %d --jobs %d --seed %d" % (self.nodes, self.jobs, self.seed)
        if self.byzantine_milli:
            line += " --byzantine %s" % (self.byzantine_milli / 1000)
        line += " --faults %s" % (",".join(self.faults) if self.faults else "none")
        if not self.heartbeats:
            line += " --no-heartbeats"
        if self.bid_sample is not None:
            line += " --bid-sample %d" % self.bid_sample
        if self.slot_ms:
            line += " --slot-ms %d" % self.slot_ms
        if self.job_ms:
            line += " --job-ms %d" % self.job_ms
        if self.job_fail_per_mille:
            line += " --fail %s" % (self.job_fail_per_mille / 1000)
        if self.cancel_per_mille:
            line += " --cancel %s" % (self.cancel_per_mille / 1000)
        if self.fractional_per_mille:
            line += " --fractional %s" % (self.fractional_per_mille / 1000)
        if self.quota_gpus:
            line += " --quota-gpus %d" % self.quota_gpus
        if self.reservations:
            line += " --reservations"
        if self.move_per_mille:
            line += " --move %s" % (self.move_per_mille / 1000)
        if self.reflex_per_mille:
            line += " --reflex %s" % (self.reflex_per_mille / 1000)
        if self.preempt:
            line += " --preempt"
        if self.gang_per_mille:
            line += " --gangs %s" % (self.gang_per_mille / 1000)
        if self.gang_kills:
            line += " --gang-kills %d" % self.gang_kills
        return line


@dataclass
class SimNode:
    index: int
    public_key: bytes
    core: MeshCore | None = None
    up: bool = True
    incarnation: int = 0
    certificates: list = field(default_factory=list)   # persisted commit certificate bytes
    safety_records: dict = field(default_factory=dict)  # (table, key) -> persisted vote/lock/evidence
    records_of: dict = field(default_factory=dict)      # instance -> its vote and lock keys in safety_records
    evidence_offenders: set = field(default_factory=set)  # offenders in persisted evidence records
    persisted_records: int = 0
    behaviour: ByzantineBehaviour | None = None
    drain: ReadyDrain | None = None
    capability_seq_floor: int = 0   # the persisted floor a restarted core's capability seq starts at (P1)
    job_outcomes: dict = field(default_factory=dict)    # persisted exits and cancels (table ``jobs``), by key
    running: dict = field(default_factory=dict)         # job id -> WorkloadRun its core ordered and did not stop


@dataclass
class SimResult:
    config: SimConfig
    violations: list
    violation_count: int
    decisions: int                 # distinct instances decided
    placements: int                # jobs placed (a slot instance places many, SPEC.md P7)
    node_decisions: int            # decisions emitted by all nodes together
    messages: int                  # point-to-point sends (a broadcast to n-1 peers counts n-1)
    latencies_ms: list
    virtual_ms: int
    wall_s: float
    byzantine: list
    byzantine_stake: tuple
    liveness_missing: int
    decision_log_digest: str
    network: dict
    counters: dict
    # Jobs placed after the base deadline but within what SPEC 11 owes them, by the reason
    # that took longest (testnet/sim_liveness.py), and the late ones, by why they are late.
    late_reasons: dict = field(default_factory=dict)
    stalled_reasons: dict = field(default_factory=dict)

    @property
    def messages_per_decision(self) -> float:
        return self.messages / self.decisions if self.decisions else float(self.messages)

    @property
    def ok(self) -> bool:
        return self.violation_count == 0


class Simulation:
    def __init__(self, config: SimConfig, world_transform=None):
        """``world_transform(world) -> world``: another workload on the drawn world (nodes'
        capacities, jobs), as ``meshnode replay --mesh-slice`` puts a trace slice on it."""
        self.config = config
        self.rng = random.Random(config.seed)
        faulty = bool(config.faults)
        self.heal_ms = config.safety_ms if faulty else 0
        if config.gang_kills:
            self.heal_ms = max(self.heal_ms, GANG_KILL_START_MS + config.gang_kills * GANG_KILL_SPACING_MS)
        self.world: World = build_world(self.rng, config.nodes, config.jobs, config.byzantine_milli,
                                        config.submit_window_ms,
                                        replace(SIM_PARAMS, placement_slot_ms=config.slot_ms),
                                        fractional_per_mille=config.fractional_per_mille,
                                        quota_gpus=config.quota_gpus, reservations=config.reservations,
                                        preempt=config.preempt)
        self.gang_kill_rng = random.Random(config.seed * 1_000_003 + 0x4B11)   # its own: other draws unchanged
        if config.gang_per_mille:
            self.world = with_gangs(self.world, random.Random(config.seed * 1_000_003 + 0x6A46),
                                    config.gang_per_mille)
        if world_transform is not None:
            self.world = world_transform(self.world)
        self.mesh_id = self.world.mesh_id
        self.owner_of_job = {spec.job_id: spec.job.owner for spec in self.world.jobs}
        self.job_of_id = {spec.job_id: spec.job for spec in self.world.jobs}
        self.borrowing = None   # set with the checker: the borrowing audit (SPEC.md Q6)
        self.core_caches = CoreCaches() if config.shared_caches else None   # None: each core its own
        self.network = self._network(faulty)
        honest = [i for i in range(config.nodes) if i not in self.world.byzantine]
        self.honest = honest
        self.checker = DecisionChecker(self.mesh_id, [
            NodeFacts(s.identity.public_key, s.zone, s.labels, s.policy, s.capacity, s.index not in self.world.byzantine)
            for s in self.world.nodes], self._verify_certificate)
        if self.core_caches is not None:   # pure verdicts: sharing them costs the checker no independence
            self.checker.caches = self.core_caches
        self.nodes = [SimNode(s.index, s.identity.public_key) for s in self.world.nodes]
        for node in self.nodes:
            node.drain = self._new_drain(node)
        self.index_of = {node.public_key: node.index for node in self.nodes}
        self.queue: list = []
        self.seq = 0
        self.now_ms = 0
        self.messages = 0
        self.node_decisions = 0
        self.counters: dict[str, int] = {"dropped_down": 0, "crashes": 0, "restarts": 0, "resubmits": 0,
                                         "submit_refused_epoch": 0, "submit_refused_over_whole_quota": 0}
        self.honest_done: dict[bytes, int] = {}   # instance -> honest nodes that decided it
        self.complete = 0                          # placement instances decided at every honest node
        # Liveness after the heal is owed only in rounds an honest member leads: a Byzantine
        # leader can always waste its round (SPEC.md 11). Per job, the time its placement
        # spent, after the heal, in rounds a Byzantine member led: from the first honest node
        # entering such a round to the first entering a later one, at most that round's timeout.
        self.byzantine_keys = frozenset(self.nodes[i].public_key for i in self.world.byzantine)
        self.excused_ms: dict[bytes, int] = {}
        self.excused_rounds: set[tuple] = set()    # (instance, round) counted
        self.open_rounds: dict[bytes, tuple] = {}  # instance -> (round, entered ms, job id, timeout ms)
        self.longest_excuse_ms = 0                 # bound on any job's excuse, open rounds at full timeout
        self.excuse_reasons: dict[bytes, dict[str, int]] = {}   # job id -> reason -> ms excused
        self.deadline_ms = 0                       # the base liveness deadline, set when the run starts
        self.liveness = LivenessTracker(self)      # capacity waits and rounds apart (SPEC 11)
        # SPEC.md Q2f: what honest homes granted that runs stays within the quota (Q2d's bound).
        quotas = Quotas(getattr(self.world.genesis, "pools", ()))
        self.quota_bound = QuotaBoundCheck(lambda owner, pool: quotas.limit(pool, owner), CANCEL_STOP_GRACE_ROUNDS
                                           * self.world.genesis.params.round_timeout_max_ms, self.checker.fail,
                                           key_of=lambda index: self.nodes[index].public_key)
        self.witness_sides: dict[tuple, int] = {}
        self.witnessed: dict[int, set[int]] = {}
        self._cert_cache: dict[int, tuple] = {}
        self._targets: dict[tuple, list[int]] = {}
        self._decoded: dict[int, tuple] = {}
        self.epoch_views: dict[int, object] = {}    # epoch -> its EpochView, as first seen
        # Workloads that end (SimConfig.job_ms, cancel_per_mille): their own rng, so the
        # draws above (world, faults, network, cores) are the same with them or without.
        self.workload_rng = random.Random(config.seed * 1_000_003 + 0x5EED) if config.workloads else None
        self.checkpoint_seq = 0                     # the last checkpoint seq a run took (--preempt)
        self.cancelled: set[bytes] = set()          # job ids a core accepted its owner's cancel for
        self.reflex_audit = ReflexAudit(self.mesh_id, self.checker) if config.reflex_per_mille else None
        self.job_signal_moves: JobSignalMoves | None = None   # R3a: reflex moves on reported latency
        self.hot: dict[int, list] = {}
        if config.reflex_per_mille:   # the world's jobs change before any is submitted
            add_reflexes(self.world, self.workload_rng, config.reflex_per_mille)
            self.job_signal_moves = JobSignalMoves(self.mesh_id, use_latency_rules(self.world))
            self.hot = hot_spells(self.world, self.workload_rng, max(1, config.safety_ms) + 1000)
        # A run does not stop early (every job placed) before the hot spells and the moves they
        # cause are over.
        self.busy_until_ms = max([self.heal_ms] + [end + REFLEX_SETTLE_MS for spells in self.hot.values()
                                                   for _start, end in spells])
        self.placed_everywhere: set[bytes] = set()  # job ids placed at every honest node (early stop)
        self.gang_runs_started: set[tuple] = set()   # (node, incarnation, rank, fence) ordered to run (GA7)
        for index in sorted(self.world.byzantine):
            spec = self.world.nodes[index]
            behaviours = self._draw_behaviours()
            self.nodes[index].behaviour = ByzantineBehaviour(
                index, spec.identity, self.mesh_id, behaviours, random.Random(self.rng.getrandbits(64)), ZONES)

    # --- setup ----------------------------------------------------------------------------

    def _draw_behaviours(self) -> frozenset[str]:
        if 3 * self.config.byzantine_milli >= 1000:
            return frozenset({"silence"})  # withholding: the attack that stalls a mesh at >= 1/3
        active = [b for b in BEHAVIOURS if b != "silence" and self.rng.randrange(2)]
        if self.rng.randrange(6) == 0:
            active = ["silence"]
        # Drawn after the others, and only with slots: runs without keep their seeds' worlds.
        if self.config.slot_ms and active != ["silence"]:
            active += [b for b in SLOT_BEHAVIOURS if self.rng.randrange(2)]
        return frozenset(active or ["equivocate", "double_vote"])

    def _network(self, faulty: bool) -> SimNetwork:
        faults, rng, n = set(self.config.faults), self.rng, self.config.nodes
        delay = DelayModel(base_ms=1, jitter_ms=4,
                           spike_per_mille=rng.randint(10, 100) if "delay" in faults else 0,
                           spike_ms=rng.randint(50, 400))
        partitions = []
        for kind, symmetric in (("partition", True), ("asym", False)):
            if kind in faults and n >= 2:
                for _ in range(rng.randint(1, 2)):
                    start = rng.randrange(self.heal_ms)
                    end = min(self.heal_ms, start + rng.randint(100, 800))
                    partitions.append(random_partition(rng, n, start, end, symmetric))
        return SimNetwork(
            delay=delay,
            loss_per_mille=rng.randint(10, 100) if "loss" in faults else 0,
            duplicate_per_mille=rng.randint(10, 100) if "dup" in faults else 0,
            reorder_per_mille=rng.randint(50, 200) if "reorder" in faults else 0,
            reorder_ms=rng.randint(10, 100), partitions=tuple(partitions), heal_ms=self.heal_ms)

    def _new_core(self, node: SimNode) -> MeshCore:
        spec = self.world.nodes[node.index]
        return MeshCore(identity=spec.identity, genesis=self.world.genesis, policy=spec.policy,
                        capacity=spec.capacity, rng=random.Random(self.rng.getrandbits(64)),
                        now_ms=self.now_ms, history=tuple(node.certificates),
                        safety_records=tuple(node.safety_records.values()),
                        job_outcomes=tuple(node.job_outcomes.values()),
                        heartbeats=self.config.heartbeats, bid_sample=self.config.bid_sample,
                        capability_seq_floor=node.capability_seq_floor, caches=self.core_caches)

    def _verify_certificate(self, data: bytes, views: dict) -> tuple:
        """Verify against the deciding node's view of the certificate's epoch; every node must
        hold the same membership for one epoch (checked here, by digest)."""
        # Every node holds the same certificate object; identity-keyed caching (the object
        # is kept alive in the entry, so its id cannot be reused) avoids re-decoding it.
        _, certificate = self._decode_certificate(data)
        view = views.get(certificate.epoch)
        if view is None:
            raise RemoteProtocolError("deciding node has no view of epoch %d" % certificate.epoch)
        first = self.epoch_views.setdefault(view.epoch, view)
        if first.digest != view.digest:
            raise RemoteProtocolError("nodes disagree on the membership of epoch %d" % view.epoch)
        hit = self._cert_cache.get(id(data))
        if hit is not None and hit[0] is data and hit[1] == view.digest:
            return hit[2]
        result = verify_commit_certificate(data, self.mesh_id, view, caches=self.checker.caches)
        self._cert_cache[id(data)] = (data, view.digest, result)
        return result

    def _decode_certificate(self, data: bytes):
        hit = self._decoded.get(id(data))
        if hit is not None and hit[0] is data:
            return hit[1]
        decoded = decode_message(data, self.mesh_id, expect=CommitCertificate, caches=self.checker.caches)
        self._decoded[id(data)] = (data, decoded)
        return decoded

    def _schedule_faults(self) -> None:
        rng, cfg = self.rng, self.config
        if "crash" in cfg.faults:
            for _ in range(rng.randint(1, min(MAX_CRASHES, max(1, cfg.nodes // 2)))):
                victim = rng.randrange(cfg.nodes)
                down_ms = rng.randrange(self.heal_ms)
                self.push(down_ms, CRASH, victim, None)
                self.push(min(self.heal_ms, down_ms + rng.randint(20, 700)), RESTART, victim, None)
        for kill in range(cfg.gang_kills):
            self.push(GANG_KILL_START_MS + kill * GANG_KILL_SPACING_MS, GANG_KILL, -1, None)
        if self.heal_ms:
            self.push(self.heal_ms, HEAL, -1, None)

    def push(self, at_ms: int, kind: int, target: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (at_ms, self.seq, kind, target, payload))

    # --- the event loop ---------------------------------------------------------------------

    def run(self) -> SimResult:
        thresholds = gc.get_threshold()
        gc.freeze()  # the world built so far lives all run: never rescan it
        gc.set_threshold(max(thresholds[0], GC_GEN0_THRESHOLD), *thresholds[1:])
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()

    def _run(self) -> SimResult:
        started = time.perf_counter()
        cfg = self.config
        for node in self.nodes:
            node.core = self._new_core(node)
            self.push(self.rng.randrange(cfg.tick_ms), TICK, node.index, 0)
        for number, job in enumerate(self.world.jobs):
            self.push(job.submit_ms, SUBMIT, number, None)
        self._schedule_faults()
        self._schedule_cancels()
        self._schedule_moves()
        if cfg.reflex_per_mille or cfg.gang_kills:   # a gang's replacement is chosen from vectors (GA7)
            for node in self.nodes:
                self.push(self._telemetry_rng().randrange(TELEMETRY_MS), TELEMETRY, node.index, 0)
        last_submit = max((j.submit_ms for j in self.world.jobs), default=0)
        deadline_ms = self.deadline_ms = max(self.heal_ms, last_submit) + cfg.liveness_bound_ms
        total_jobs = len(self.world.jobs)
        queue = self.queue
        while queue:
            at_ms, _, kind, target, payload = heapq.heappop(queue)
            if at_ms > deadline_ms + self.longest_excuse_ms:
                break
            self.now_ms = at_ms
            if kind == DELIVER:
                self._deliver(target, payload)
            elif kind == TICK:
                self._tick(target, payload)
            elif kind == SUBMIT:
                self._submit(target)
            elif kind == CRASH:
                self._crash(target)
            elif kind == RESTART:
                self._restart(target)
            elif kind == HEAL:
                self._heal()
            elif kind == EXIT:
                self._exit(target, payload)
            elif kind == CANCEL:
                self._cancel(target, payload)
            elif kind == MOVE:
                self._move(target, payload)
            elif kind == TELEMETRY:
                self._telemetry(target)
            elif kind == CHECKPOINT:
                self._checkpoint(target, payload)
            elif kind == GANG_KILL:
                self._kill_a_rank_node()
            if self.complete >= total_jobs and at_ms >= self.busy_until_ms:
                break
            if len(queue) > MAX_EVENTS_QUEUED:
                raise RuntimeError("simulator event queue over %d: a message storm" % MAX_EVENTS_QUEUED)
        return self._finish(deadline_ms, time.perf_counter() - started)

    def _tick(self, index: int, incarnation: int) -> None:
        node = self.nodes[index]
        if not node.up or node.incarnation != incarnation:
            return  # a tick of a crashed incarnation: its timer died with it
        self._call(node, node.core.tick, self.now_ms)
        if self.config.quota_gpus:
            self.quota_bound.ticked(index, self.now_ms)
        self.push(self.now_ms + self.config.tick_ms, TICK, index, incarnation)

    def _deliver(self, dst: int, payload) -> None:
        src, data = payload
        node = self.nodes[dst]
        if not node.up:
            self.counters["dropped_down"] += 1
            return
        source = self.nodes[src].behaviour
        if source is not None and node.behaviour is None and source.conflicts:
            self._witness(src, dst, source.conflicts.get(data))
        self._call(node, node.core.step, data, self.now_ms, self.nodes[src].public_key)

    def _witness(self, src: int, dst: int, side) -> None:
        if side is None:
            return
        pair_id, half, instance = side
        if dst in self.checker.decided_at.get(instance, ()):
            # A node that has decided answers votes with its certificate and no longer
            # examines them (SPEC.md 6.8), so it cannot be expected to notice.
            return
        key = (src, pair_id, dst)
        seen = self.witness_sides.get(key, 0) | (1 << half)
        self.witness_sides[key] = seen
        if seen == 3:
            self.witnessed.setdefault(src, set()).add(dst)

    def _submit(self, number: int) -> None:
        up = [i for i in self.honest if self.nodes[i].up]
        if not up:
            self.push(self.now_ms + RETRY_SUBMIT_MS, SUBMIT, number, None)
            return
        node = self.nodes[self.rng.choice(up)]
        job = self.world.jobs[number].job
        if job.epoch > node.core.epoch or job.epoch not in node.core.views:
            # The node refuses it (SPEC.md P2): an owner would sign the job again, as a new job.
            self.counters["submit_refused_epoch"] += 1
            return
        if node.core.bidding.scheduling.quotas.never_fits_error(job) is not None:
            # Refused at submit (SPEC.md Q1: more than the owner's whole quota): it owes no placement.
            self.counters["submit_refused_over_whole_quota"] += 1
            self.cancelled.add(self.world.jobs[number].job_id)
            return
        self._call(node, node.core.submit, self.world.jobs[number].envelope, self.now_ms)

    def _call(self, node: SimNode, method, *args, **kwargs) -> None:
        """Feed one input to a core. The core must never raise on remote input (protocol/ready.py);
        if it does, that is a violation of its contract, reported like any other."""
        try:
            ready = method(*args, **kwargs)
        except MeshError as exc:
            self.checker.fail("core_error", node.index, None, "%s raised %s: %s"
                              % (method.__name__, type(exc).__name__, exc))
            return
        self._emit(node, ready)

    def _crash(self, index: int) -> None:
        node = self.nodes[index]
        if not node.up:
            return
        node.up = False
        node.incarnation += 1
        node.core = None  # everything not persisted is lost
        node.running.clear()  # and its workloads die with it
        self.counters["crashes"] += 1

    # --- workloads that end (SimConfig.job_ms, cancel_per_mille) ---------------------------------

    def _schedule_cancels(self) -> None:
        cfg, rng = self.config, self.workload_rng
        if not cfg.cancel_per_mille:
            return
        span = max(1, 2 * cfg.job_ms or self.config.liveness_bound_ms)
        for number, job in enumerate(self.world.jobs):
            if rng.randrange(1000) < cfg.cancel_per_mille:
                self.push(job.submit_ms + rng.randint(0, span), CANCEL, number, 0)

    def _cancel(self, number: int, tries: int) -> None:
        """The job's owner cancels it through an honest node that is up and knows the job
        (one that does not refuses the cancel: its client tries another a little later)."""
        spec = self.world.jobs[number]
        up = [i for i in self.honest if self.nodes[i].up]
        node = self.nodes[self.workload_rng.choice(up)] if up else None
        if node is None or node.core.job_table.get(spec.job_id) is None:
            if tries + 1 < CANCEL_TRIES:
                self.push(self.now_ms + RETRY_SUBMIT_MS, CANCEL, number, tries + 1)
            return
        owner = next(o for o in self.world.owners if o.public_key == spec.job.owner)
        request = encode_message(owner, self.mesh_id, Cancel(job_id=spec.job_id, requested_ms=GENESIS_MS + self.now_ms))
        record = node.core.job_table.get(spec.job_id)
        if record.state in TERMINAL:
            # The node refuses it (its owner hears "already ended", P6): the job keeps how it ended.
            self.counters["cancels_after_end"] = self.counters.get("cancels_after_end", 0) + 1
            return
        self.cancelled.add(spec.job_id)
        self.counters["cancels"] = self.counters.get("cancels", 0) + 1
        self._call(node, lambda: node.core.cancel(request, self.now_ms)[1])

    def _schedule_moves(self) -> None:
        cfg, rng = self.config, self.workload_rng
        if not cfg.move_per_mille:
            return
        span = max(1, cfg.safety_ms)   # while faults are on, where moves race evictions
        for number, job in enumerate(self.world.jobs):
            if rng.randrange(1000) < cfg.move_per_mille:
                self.push(job.submit_ms + rng.randint(0, span), MOVE, number, 0)

    def _move(self, number: int, tries: int) -> None:
        """The job's owner asks an honest node that is up to move it (SPEC.md R2); a node that
        refuses (it has not seen the job run, or no node has room) is tried again a little later."""
        spec = self.world.jobs[number]
        up = [i for i in self.honest if self.nodes[i].up]
        node = self.nodes[self.workload_rng.choice(up)] if up else None
        record = node.core.job_table.get(spec.job_id) if node is not None else None
        if record is None or record.state in TERMINAL:
            if record is None and tries + 1 < CANCEL_TRIES:
                self.push(self.now_ms + RETRY_SUBMIT_MS, MOVE, number, tries + 1)
            return
        owner = next(o for o in self.world.owners if o.public_key == spec.job.owner)
        request = encode_message(owner, self.mesh_id, MoveRequest(job_id=spec.job_id, fence=record.fence, to_node=b"",
                                                                  requested_ms=GENESIS_MS + self.now_ms))
        try:
            _jid, ready = node.core.request_move(request, self.now_ms)
        except RemoteProtocolError:
            self.counters["moves_refused"] = self.counters.get("moves_refused", 0) + 1
            if tries + 1 < CANCEL_TRIES:
                self.push(self.now_ms + RETRY_SUBMIT_MS, MOVE, number, tries + 1)
            return
        self.counters["moves"] = self.counters.get("moves", 0) + 1
        self._emit(node, ready)

    def _telemetry_rng(self) -> random.Random:
        """Readings draw from the workload rng; with --gang-kills alone, from the kills' own."""
        return self.workload_rng or self.gang_kill_rng

    def _telemetry(self, index: int) -> None:
        """A node reads its GPUs (SPEC.md R3 runs): hot inside its spells, cool outside; the
        jobs it runs report their load (R3a), slow inside the same spells."""
        node = self.nodes[index]
        if node.up:
            hot = any(start <= self.now_ms < end for start, end in self.hot.get(index, ()))
            gpus = reading(self.world.nodes[index].capacity, hot, self._telemetry_rng())
            # Only reflex worlds' jobs report load: a gang-kill world's draws stay its own.
            reported = job_signals(node.running, hot, self.workload_rng) if self.workload_rng else ()
            self._call(node, node.core.update_telemetry, gpus, 0, self.now_ms, job_signals=reported)
        self.push(self.now_ms + TELEMETRY_MS, TELEMETRY, index, 0)

    def _workload_orders(self, node: SimNode, decision) -> None:
        """The driver's side of a core's "run" and "stop" orders: what it runs, and when each
        run ends (SimConfig.job_ms)."""
        if decision.value_kind == "stop":
            for jid in decision.value:
                run = node.running.pop(jid, None)
                # The run is gone at once: a move's new primary may start (R2a), as the node
                # driver reports it once its process is gone.
                self._call(node, node.core.hand_over_moved, jid, run.fence if run else None, None, self.now_ms)
        elif decision.value_kind == "run":
            cfg = self.config
            for run in decision.value:
                if run.gang is not None and node.behaviour is None:
                    self._check_rank_not_restarted(node, run)
                node.running[run.job_id] = run
                if cfg.job_ms and run.replica:
                    # A service replica runs until stopped; with --fail it may crash, and a
                    # replica that fails is replaced elsewhere by decision (SPEC.md R4h).
                    if self.workload_rng.randrange(1000) < cfg.job_fail_per_mille:
                        duration = self.workload_rng.randint(cfg.job_ms // 4, cfg.job_ms)
                        self.push(self.now_ms + duration, EXIT, node.index, (node.incarnation, run.job_id, run.fence, 1))
                elif cfg.job_ms:
                    duration = self.workload_rng.randint(cfg.job_ms // 2, 3 * cfg.job_ms // 2)
                    self.push(self.now_ms + duration, EXIT, node.index, (node.incarnation, run.job_id, run.fence))
                if cfg.preempt:   # victims are chosen from running jobs' checkpoint ages (P8)
                    self.push(self.now_ms + 1, CHECKPOINT, node.index, (node.incarnation, run.job_id, run.fence, 0))
            if node.behaviour is None:
                self.checker.check_running(node.index, tuple(node.running.values()), decision.value)
                if cfg.quota_gpus:
                    self._note_quota_overshoot_running()
                    self._check_quota_bound()
            if cfg.runs_reported:
                for run in decision.value:   # it started, as the node driver reports (R2 moves running jobs)
                    self._call(node, node.core.workload_started, run.job_id, run.fence, 0, self.now_ms)

    def _check_rank_not_restarted(self, node: SimNode, run) -> None:
        """SPEC.md GA7: a gang's surviving ranks are never stopped and started again: one run
        per (rank, fence) per incarnation of an honest node (a replacement has a new fence)."""
        key = (node.index, node.incarnation, run.job_id, run.fence)
        if key in self.gang_runs_started:
            self.counters["gang_ranks_restarted"] = self.counters.get("gang_ranks_restarted", 0) + 1
            self.checker.fail("gang", node.index, None, "node %d started rank %s again at fence %d"
                              % (node.index, run.job_id.hex()[:12], run.fence))
        self.gang_runs_started.add(key)

    def _checkpoint(self, index: int, payload) -> None:
        """With --preempt: the run reports its start (``step`` 0), then a checkpoint every
        CHECKPOINT_MS (seqs from one counter, so a resumed run's are newer), while it runs."""
        incarnation, jid, fence, step = payload
        node = self.nodes[index]
        run = node.running.get(jid)
        if not node.up or node.incarnation != incarnation or run is None or run.fence != fence:
            return
        core = node.core
        record = core.job_table.get(jid)
        if (record is None or record.primary != core.me or record.fence != fence or not core.is_member()
                or record.state in TERMINAL):
            return
        if step == 0:
            self._call(node, core.workload_started, jid, fence, 0, self.now_ms)
        else:
            self.checkpoint_seq += 1
            seq = self.checkpoint_seq
            self._call(node, core.local_checkpoint, jid, seq, seq, self.now_ms, b"%d" % seq, self.now_ms)
        self.push(self.now_ms + CHECKPOINT_MS, CHECKPOINT, index, (incarnation, jid, fence, step + 1))

    def _exit(self, index: int, payload) -> None:
        incarnation, jid, fence, *crash = payload
        node = self.nodes[index]
        run = node.running.get(jid)
        if not node.up or node.incarnation != incarnation or run is None or run.fence != fence:
            return  # stopped, moved away or crashed since: that run is gone
        del node.running[jid]
        code = crash[0] if crash else 1 if self.workload_rng.randrange(1000) < self.config.job_fail_per_mille else 0
        self.counters["exits"] = self.counters.get("exits", 0) + 1
        self._call(node, node.core.job_exited, jid, code, self.now_ms)

    def _job_events(self, node: SimNode, events) -> None:
        """A job that ended at the node that holds it gives its load back in the checker; the
        replica actions an honest node applied go to the reflex audit (R4)."""
        if self.reflex_audit is not None and node.behaviour is None:
            self.reflex_audit.on_replica_events(node, events)
        ended = False
        for event in events:
            if event.kind in ("job_exited", "job_cancelled", "job_refused", "gang_worker_stopped"):
                self.checker.job_ended(node.index, bytes.fromhex(event.detail["job_id"]))
                ended = True
        if ended:
            self.liveness.note_capacity()

    def _restart(self, index: int) -> None:
        node = self.nodes[index]
        if node.up:
            return
        node.up = True
        node.core = self._new_core(node)
        self.counters["restarts"] += 1
        self.push(self.now_ms + self.rng.randrange(self.config.tick_ms), TICK, index, node.incarnation)

    def _kill_a_rank_node(self) -> None:
        """--gang-kills: crash an honest node that runs a gang's rank for GANG_KILL_DOWN_MS,
        long past detection: one whose stake with the Byzantine stake (which may stay silent)
        is under a third of the total, else no eviction could be decided without it (F4a)."""
        byzantine, total = self.world.byzantine_stake_fraction()
        running_ranks = [node.index for node in self.nodes if node.up and node.behaviour is None
                         and 3 * (byzantine + self.world.nodes[node.index].stake) < total
                         and any(run.gang is not None for run in node.running.values())]
        if running_ranks:
            self.counters["gang_kills"] = self.counters.get("gang_kills", 0) + 1
            victim = self.gang_kill_rng.choice(running_ranks)
            self._crash(victim)
            self.push(min(self.heal_ms, self.now_ms + GANG_KILL_DOWN_MS), RESTART, victim, None)

    def _heal(self) -> None:
        for node in self.nodes:
            if not node.up:
                self._restart(node.index)
        # The owners' clients retry: a job whose submission died with a crashed node
        # (before it was broadcast) would otherwise never be known to anyone.
        placed = self.checker.placement_of
        for number, job in enumerate(self.world.jobs):
            if job.job_id not in placed:
                self.counters["resubmits"] += 1
                self._submit(number)
        self.liveness.note_capacity()

    def _emit(self, node: SimNode, ready) -> None:
        """Drain one Ready batch through the node's drain (protocol/drain.py): persist, send,
        decisions; events are only read for the liveness excuses."""
        if node.behaviour is None and ready.events and self.now_ms >= self.heal_ms:
            self._excuse_byzantine_rounds(node, ready.events)
        if ready.events and self.config.quota_gpus:
            self._quota_events(node, ready.events)
        if node.behaviour is None and not (ready.persist or ready.messages or ready.decisions):
            if ready.events:
                self._job_events(node, ready.events)
            return  # most deliveries (a vote at its collector, a repeat) change nothing outside
        events = ready.events
        if node.behaviour is not None:
            ready = Ready(ready.persist, node.behaviour.rewrite(ready, self._peers(node)), ready.decisions)
        node.drain.drain(ready)
        if events:  # after its decisions: a job placed and refused in one batch ends placed elsewhere
            self._job_events(node, events)

    def _new_drain(self, node: SimNode) -> ReadyDrain:
        def send(outbound) -> None:
            if outbound:
                self._send(node, outbound)
        return ReadyDrain(persist=lambda ready: self._persist(node, ready), send=send,
                          apply=lambda decision: self._check_decision(node, decision))

    def _persist(self, node: SimNode, ready) -> None:
        """The simulated disk: what a restarted core is built from (certificates, votes, locks,
        the reservations of its bids, its exits and cancels)."""
        for record in ready.persist:
            node.persisted_records += 1
            table = record.table
            if table == "certificates":
                node.certificates.append(record.value["certificate"])
                self._forget_votes(node, record.value["instance"])
            elif table == "capability":
                node.capability_seq_floor = record.value["seq_floor"]
            elif table in SAFETY_TABLES or table == "reservations":  # reservations: R1, restored like votes
                key = (table, record.key)
                if table == "reservations" and not record.value.get("held"):
                    # Released or allocated: nothing for a restart to hold again, so off the disk.
                    node.safety_records.pop(key, None)
                    kept = node.records_of.get(record.value["instance"], [])
                    if key in kept:
                        kept.remove(key)
                        if not kept:
                            del node.records_of[record.value["instance"]]
                    continue
                node.safety_records[key] = record  # upserted by key, as on disk
                if table == "evidence":
                    node.evidence_offenders.add(record.value["offender"])
                else:
                    node.records_of.setdefault(record.value["instance"], []).append(key)
                    if table == "votes" and node.behaviour is None:
                        self.checker.check_own_vote(node.index, record.value["envelope"])
            elif table == "jobs":
                node.job_outcomes[record.key] = record.value["envelope"]  # the newest exit or cancel per job

    def _check_decision(self, node: SimNode, decision) -> None:
        if not decision.certificate:
            # A local workload order or notice (run, stop, halt ...): nothing to agree on, but
            # what an honest node runs must fit it (R1).
            if decision.value_kind in ("run", "stop"):
                self._workload_orders(node, decision)
            return
        self.node_decisions += 1
        self.checker.check_decision(node.index, decision, self.now_ms, node.core.views)
        if self.reflex_audit is not None and node.behaviour is None:
            self.reflex_audit.check(node, decision)
            self.job_signal_moves.note(decision)
        if decision.value_kind == "preemption" and node.behaviour is None and decision.value.node == node.core.me:
            self.counters["preemptions"] = self.counters.get("preemptions", 0) + 1
        if len(self.checker.decided_at.get(decision.instance, ())) == 1 and node.index in \
                self.checker.decided_at[decision.instance]:
            # Its first decision: what honest members hold changed.
            if decision.value_kind in ("placement", "placement_slot"):
                placements = (decision.value,) if decision.value_kind == "placement" else decision.value.placements
                self.liveness.placed([self.checker.job_of(p) for p in placements])
            self.liveness.note_capacity()
            if self.config.quota_gpus:
                self._audit_borrowing(node, decision)
                self._note_quota_overshoot()
        if node.behaviour is None and decision.value_kind in ("placement", "placement_slot"):
            self.liveness.decided(decision.instance)
            done = self.honest_done.get(decision.instance, 0) + 1
            self.honest_done[decision.instance] = done
            if done == len(self.honest):  # early stop only when every honest node has every job
                # A retried job (a failed exit, or a refusal: R1) is placed again, by another
                # instance: count each job once, or the run stops while a job is still pending
                # (seed 183 at 8 nodes, bid sample 3: one job placed at attempts 3 and 4).
                placements = (decision.value,) if decision.value_kind == "placement" else decision.value.placements
                fresh = {self.checker.job_of(p) for p in placements} - self.placed_everywhere
                self.placed_everywhere |= fresh
                self.complete += len(fresh)

    def _excuse_byzantine_rounds(self, node: SimNode, events) -> None:
        for event in events:
            if event.kind != "round_change":
                continue
            iid = bytes.fromhex(event.detail["instance"])
            round = event.detail["round"]
            opened = self.open_rounds.get(iid)
            if opened is not None and round > opened[0]:  # the first honest node left it
                del self.open_rounds[iid]
                self._credit(opened[2], min(opened[3], self.now_ms - opened[1]))
            role = node.core.instance_table.role(iid)
            inst = node.core.instances.get(iid)
            if inst is None or role is None or not role.flow.places_jobs:
                continue
            jids = role.flow.job_ids(iid, role.subject)
            if ((iid, round) not in self.excused_rounds and iid not in self.open_rounds
                    and bytes.fromhex(event.detail["leader"]) in self.byzantine_keys):
                self.excused_rounds.add((iid, round))
                self.open_rounds[iid] = (round, self.now_ms, jids, inst.timeout_ms(round))
                bound = max((self.excused_ms.get(jid, 0) for jid in jids), default=0) + inst.timeout_ms(round)
                self.longest_excuse_ms = max(self.longest_excuse_ms, bound)
            self.liveness.note_rounds(iid, jids)

    def _credit(self, jids: tuple, ms: int, reason: str = "byzantine_led_rounds") -> None:
        for jid in jids:
            self.excused_ms[jid] = self.excused_ms.get(jid, 0) + ms
            reasons = self.excuse_reasons.setdefault(jid, {})
            reasons[reason] = reasons.get(reason, 0) + ms
            self.longest_excuse_ms = max(self.longest_excuse_ms, self.excused_ms[jid])

    def _close_open_rounds(self) -> None:
        """At the end of the run a round still open is credited its whole timeout."""
        for _round, _entered, jids, timeout_ms in self.open_rounds.values():
            self._credit(jids, timeout_ms)
        self.open_rounds.clear()

    @staticmethod
    def _forget_votes(node: SimNode, instance: bytes) -> None:
        """A restarted core never reads the votes or lock of an instance whose certificate it
        persisted (it replays the decision instead), so the disk may drop them, as the node
        store does (meshnode/node/store.py); the simulator does it at once so that its memory
        stays flat over thousands of decisions. Evidence records stay."""
        for key in node.records_of.pop(instance, ()):
            node.safety_records.pop(key, None)

    def _peers(self, node: SimNode) -> list[bytes]:
        return [self.nodes[i].public_key for i in self._broadcast_targets(node)]

    def _broadcast_targets(self, node: SimNode) -> list[int]:
        """``Outbound(to=None)``: every other member of the sender's current epoch."""
        view = node.core.view
        cached = self._targets.get((node.index, view.digest))
        if cached is None:
            cached = [self.index_of[k] for k in view.members if k != node.public_key and k in self.index_of]
            self._targets[(node.index, view.digest)] = cached
        return cached

    def _send(self, node: SimNode, outbound) -> None:
        network, rng, push, src, now_ms = self.network, self.rng, self.push, node.index, self.now_ms
        clean = not network.faulty_at(now_ms)
        for message in outbound:
            if message.to is None:
                recipients = self._broadcast_targets(node)
            else:
                dst = self.index_of.get(message.to)
                if dst is None:
                    continue
                recipients = [dst]
            self.messages += len(recipients)
            payload = (src, message.data)
            if clean:  # the same draws and queue entries as the loop below, in bulk
                queue, seq = self.queue, self.seq
                for dst, at_ms in zip(recipients, network.clean_arrivals(len(recipients), now_ms, rng)):
                    seq += 1
                    heapq.heappush(queue, (at_ms, seq, DELIVER, dst, payload))
                self.seq = seq
                continue
            for dst in recipients:
                for at_ms in network.deliveries(src, dst, now_ms, rng):
                    push(at_ms, DELIVER, dst, payload)

    # --- results ----------------------------------------------------------------------------

    def _finish(self, deadline_ms: int, wall_s: float) -> SimResult:
        checker = self.checker
        # A job its owner cancelled owes no placement (it may have been cancelled before one).
        submitted = {job.job_id: job.submit_ms for job in self.world.jobs if job.job_id not in self.cancelled}
        deciders = self._deciders()
        unplaceable = self._unplaceable_jobs(deciders)
        quota_held = self._held_by_scheduling_rules(deciders) - unplaceable
        unplaceable |= quota_held
        gangs = frozenset(spec.job_id for spec in self.world.jobs if spec.job.gang.is_gang)
        unplaced_gangs = gangs - set(checker.placement_of)
        checker.check_gangs_running({i: tuple(self.nodes[i].running.values()) for i in self.honest
                                     if self.nodes[i].up and self.nodes[i].core is not None})
        self._close_open_rounds()
        self.liveness.close_all()
        for jid in list(self.liveness.placeable_from_ms):
            self._credit((jid,), self.liveness.capacity_excuse_ms(jid), self.liveness.wait_reason(jid))
        # BFT promises liveness only while Byzantine stake is under 1/3 of the epoch that must
        # decide; evicting honest nodes (cut off in the safety phase) can lift the Byzantine
        # share of the next epoch to 1/3 or more. Such jobs are counted apart, not hidden.
        unpromised = frozenset(jid for jid, _instance, _submitted, late, _due
                               in checker.late_jobs(submitted, deciders, deadline_ms, unplaceable | unplaced_gangs,
                                                  self.excused_ms)
                               if self._liveness_unpromised(jid, late))
        late_reasons, stalled_reasons = self._classify_late(submitted, deciders, deadline_ms,
                                                            unplaceable | unplaced_gangs | unpromised)
        missing = checker.check_liveness(submitted, deciders, deadline_ms,
                                         unplaceable | unplaced_gangs | unpromised | self.liveness.placed_unplaceable,
                                         self.excused_ms, reason_of=self._late_reason)
        checker.check_evidence(self.witnessed, self._evidence_of)
        self._check_ledgers()
        log_digest = checker.log_digest()
        if self.job_signal_moves is not None:
            self.counters["reflex_moves_job_signal"] = len(self.job_signal_moves.moves)
        if self.reflex_audit is not None:
            self.counters["reflex_moves"] = len(self.reflex_audit.moves)
            self.counters["replica_actions"] = len(self.reflex_audit.replica_actions)
        stats = self.network.stats
        return SimResult(
            config=self.config, violations=list(checker.violations), violation_count=checker.violation_count,
            decisions=len(checker.canonical), placements=len(checker.placement_of),
            node_decisions=self.node_decisions, messages=self.messages,
            latencies_ms=checker.latencies_ms(submitted, deciders), virtual_ms=self.now_ms, wall_s=wall_s,
            byzantine=sorted(self.world.byzantine), byzantine_stake=self.world.byzantine_stake_fraction(),
            liveness_missing=missing, decision_log_digest=log_digest,
            network={"sent": stats.sent, "lost": stats.dropped_loss, "partitioned": stats.dropped_partition,
                     "duplicated": stats.duplicated, "reordered": stats.reordered},
            counters=dict(self.counters, **(self.borrowing.counters if self.borrowing is not None else {}), gangs=len(gangs), gangs_placed=len(gangs) - len(unplaced_gangs),
                          gang_replacements=checker.gang_replaced, gang_resizes=checker.gang_resized,
                          gang_grows=checker.gang_grown,
                          unplaceable_jobs=len(unplaceable) - len(quota_held),
                          quota_held_jobs=len(quota_held), quota_overshoot_gpu_milli=self._quota_overshoot(deciders),
                          liveness_unpromised_jobs=len(unpromised),
                          quota_signer_over_peak_gpu_milli=self.quota_bound.peak_signer_over_gpu_milli,
                          quota_honest_granted_over_peak_gpu_milli=self.quota_bound.peak_honest_over_gpu_milli,
                          quota_honest_signers_max=self.quota_bound.peak_honest_signers,
                          byzantine_led_rounds_excused=len(self.excused_rounds)),
            late_reasons=late_reasons, stalled_reasons=stalled_reasons)

    def _classify_late(self, submitted: dict, deciders: list[int], deadline_ms: int, exempt: frozenset) -> tuple:
        """(jobs late against the base deadline but within what they are owed, by the reason
        excused longest; jobs late past it, by ``_late_reason``)."""
        checker = self.checker
        owed_nothing = self.liveness.placed_unplaceable
        still_late = {entry[0]: entry for entry in checker.late_jobs(submitted, deciders, deadline_ms,
                                                                       exempt | owed_nothing, self.excused_ms)}
        explained: dict[str, int] = {}
        stalled: dict[str, int] = {}
        for jid, *_rest in checker.late_jobs(submitted, deciders, deadline_ms, exempt):
            if jid in still_late:
                reason = self._late_reason(*still_late[jid])
                stalled[reason] = stalled.get(reason, 0) + 1
            elif jid in owed_nothing:
                reason = CAPACITY_WAIT
            else:
                reasons = self.excuse_reasons.get(jid, {})
                reason = max(reasons, key=lambda r: (reasons[r], r)) if reasons else "unexcused"
                explained[reason] = explained.get(reason, 0) + 1
        return explained, stalled

    def _late_reason(self, jid: bytes, instance, _submitted_ms: int, late: list[int], due_ms: int) -> str:
        seen = self.checker.placed_at(jid)
        in_time = any(at <= due_ms for node, at in seen.items() if node in self.honest)
        return self.liveness.late_reason(instance or jid, in_time)

    def _check_ledgers(self) -> None:
        """SPEC.md R1, at the end of the run, on every honest node that is up: its ledger holds
        an allocation for exactly the live jobs its table makes it the primary of (a job it has
        no room for is refused, not kept), within its capacity, and no reservation of an
        instance whose decision it applied (capacity lost for good)."""
        for index in self.honest:
            core = self.nodes[index].core
            if core is None:
                continue
            ledger = core.ledger
            mine = {r.job_id for r in core.job_table.mine() if r.state in LIVE_JOB_STATES}
            mine |= set(core.replicas.allocated)   # R4: the replicas it holds are its own claims
            allocated = set(ledger.allocations())
            waiting = set(core._refuse_after_sync)   # refused once the restart's sync answers
            for what, jids in (("holds the allocation of jobs it is not the primary of", allocated - mine),
                               ("is the primary of jobs it holds no allocation for", mine - allocated - waiting)):
                if jids:
                    self.checker.fail("ledger", index, None, "node %d %s: %s"
                                      % (index, what, sorted(j.hex()[:12] for j in jids)[:4]))
            gpus, cpu, mem = ledger.held_totals()
            if gpus > len(ledger.gpu_mem_total_mib) or cpu > ledger.cpu_milli or mem > ledger.mem_mib:
                self.checker.fail("ledger", index, None, "node %d ledger holds %s" % (index, ledger.held_totals()))
            over = [(gpu, milli) for gpu, milli in enumerate(ledger.held_gpu_milli()) if milli > MILLI_PER_GPU]
            if over:
                self.checker.fail("ledger", index, None, "node %d ledger holds (GPU, milli) %s" % (index, over))
            stale = [key for key, claim in ledger.reservations().items()
                     if claim.expires_ms is None and key in core.instance_table.applied]
            if stale:
                self.checker.fail("ledger", index, None, "node %d still reserves for decided instances %s"
                                  % (index, sorted(k.hex()[:12] for k in stale)[:4]))

    def _latest_view(self):
        """The newest epoch's view any honest core reached: certificates name the epoch they
        were decided in, so an eviction decided last would not show in ``epoch_views``."""
        views = [self.nodes[i].core.view for i in self.honest if self.nodes[i].core is not None]
        views += list(self.epoch_views.values())
        return max(views, key=lambda view: view.epoch) if views else None

    def _byzantine_third(self, view) -> bool:
        byzantine = {self.nodes[i].public_key for i in self.world.byzantine}
        return 3 * sum(stake for key, stake in view.stakes.items() if key in byzantine) >= view.total_stake

    def _liveness_unpromised(self, jid: bytes, late: list[int]) -> bool:
        """Whether a run that started under 1/3 Byzantine stake is at 1/3 or more in the epoch
        that must decide this job (the one it names, P2) at every node that lacks it. With
        every job naming epoch 0 this never holds; kept for worlds whose jobs name others."""
        genesis_stake, genesis_total = self.world.byzantine_stake_fraction()
        if not self.world.byzantine or 3 * genesis_stake >= genesis_total:
            return False  # a run that starts at 1/3 or more is there to show the stall
        for index in late:
            core = self.nodes[index].core
            if core is None:
                return False
            record = core.job_table.get(jid)
            view = core.views.get(record.manifest.epoch) if record is not None else None
            if view is None or not self._byzantine_third(view):   # its placement runs there (P2)
                return False
        return True

    def _deciders(self) -> list[int]:
        """Honest members of the newest epoch: an honest node the mesh evicted (it looked dead
        from a partition) is fenced and owes no decisions until it rejoins (SPEC.md 9)."""
        latest = self._latest_view()
        if latest is None:
            return list(self.honest)
        return [i for i in self.honest if self.nodes[i].public_key in latest.stakes]

    def _unplaceable_jobs(self, deciders: list[int]) -> frozenset:
        """Jobs no honest member can take any more: not a stall, but only when every honest
        member says so (its core answered the job's placement with a decline, a reason) and
        the checker's own accounting agrees (its policy, the job's constraints, or what it
        already holds rule it out). The world draws every job to fit an empty honest node,
        but that node may since have been evicted, or filled by the other jobs; a job only
        a Byzantine node could run may rightly stay pending."""
        if not deciders:
            return frozenset()
        return frozenset(spec.job_id for spec in self.world.jobs if spec.job_id not in self.checker.placement_of
                         and all(self._declined(n, spec.job_id) and not self.checker.could_host(n, spec.job)
                                 for n in deciders))

    def _held_by_scheduling_rules(self, deciders: list[int]) -> frozenset:
        """Jobs not placed that every honest member declines, those that could host them (by
        the checker's own accounting) for the owner's quota or a reservation (SPEC.md Q2,
        Q5): waiting by design, not a stall."""
        if not deciders or not (self.config.quota_gpus or self.config.reservations):
            return frozenset()
        held = set()
        for spec in self.world.jobs:
            if spec.job_id in self.checker.placement_of:
                continue
            # Over quota by every decider's table: held whether or not each declined. A job
            # waiting for its quota grant (Q2b) is not bid for at all, and its instance may
            # have given up meanwhile (seed 164: an in-quota job of its owner stays an evicted,
            # unvouched node's for good, F5, so the quota it holds never returns).
            if all(self._over_quota(n, spec.job) for n in deciders):
                held.add(spec.job_id)
                continue
            reasons = [self._decline_reason(n, spec.job_id) for n in deciders]
            if None in reasons:
                continue
            if all(reason in ("over_quota", "reserved") or not self.checker.could_host(n, spec.job)
                   for n, reason in zip(deciders, reasons)):
                held.add(spec.job_id)
        return frozenset(held)

    def _over_quota(self, index: int, job) -> bool:
        """Whether node ``index``'s job table puts ``job`` over its owner's quota (Q2; Q2b: it
        holds no grant and the admitted demand leaves no room), whatever else the node would
        answer: capacity freed there would not place it."""
        core = self.nodes[index].core
        if core is None:
            return False
        admission = core.bidding.scheduling.admission
        if admission.needs_grant(job):   # Q2b: no grant here, and its homes' count (as this node's) has no room
            record = core.job_table.get(job_id(job))
            return (record is not None and admission.waiting_for_grant(record)
                    and bool(admission.over_by(record, self.now_ms)))
        return core.bidding.scheduling.quotas.over_quota(job, core.job_table) is not None

    def _decline_reason(self, index: int, jid: bytes) -> str | None:
        core = self.nodes[index].core
        record = core.job_table.get(jid) if core is not None else None
        answer = core.bidding.mine.get(record.instance, core.bidding.mine.get(jid)) if record is not None else None
        if answer is None or answer[0] != "decline":
            return None
        return decode_message(answer[1], self.mesh_id, expect=Decline)[1].reason

    def _quota_overshoot(self, deciders: list[int]) -> int:
        """The most any owner's live jobs exceed the GPU quota at the end, in GPU thousandths,
        by any honest member's table (SPEC.md Q2 allows concurrent placements to)."""
        cores = [self.nodes[index].core for index in deciders if self.nodes[index].core is not None]
        quotas = cores[0].bidding.scheduling.quotas if cores else None
        if quotas is None or not quotas.enabled:
            return 0
        worst = 0
        for core in cores:
            table = core.job_table
            for owner in {spec.job.owner for spec in self.world.jobs}:
                limit = quotas.limit("", owner)
                if limit is not None:
                    worst = max(worst, quotas.usage(table, owner, "").gpu_milli - limit.gpu_milli)
        return worst

    def _audit_borrowing(self, node: SimNode, decision) -> None:
        """SPEC.md Q6, at an instance's first decision: borrowed placements are of preemptible
        jobs; a preemption of equal or higher priority victims is a reclaim of borrowed ones."""
        if self.borrowing is None:
            self.borrowing = BorrowingAudit(self.checker, self.job_of_id,
                                            lambda: [n.core for n in self.nodes if n.core is not None])
        if decision.value_kind in ("placement", "placement_slot"):
            placements = (decision.value,) if decision.value_kind == "placement" else decision.value.placements
            for placement in placements:
                self.borrowing.placed(node.index, decision.instance, self.checker.job_of(placement))
        elif decision.value_kind == "preemption":
            self.borrowing.preempted(node.index, decision.instance, self.checker.job_of(decision.value),
                                     decision.value.victims)

    def _note_quota_overshoot(self) -> None:
        """The most an owner's jobs on honest nodes exceed its GPU quota (SPEC.md Q2's bound),
        by the checker's truth of what each honest node holds (not a member's table, which
        a missed exit inflates), after each first decision: ``_quota_overshoot`` sees only
        the end of the run. Jobs a Byzantine member hosts run on its capacity (Q2 (c))."""
        owner_of = self.owner_of_job
        borrowed = self.borrowing.borrowed if self.borrowing is not None else ()
        held: dict[bytes, int] = {}
        for load in self.checker.loads:
            for jid, (resources, _gpus) in load.jobs.items():
                owner = owner_of.get(jid)
                if owner is not None and jid not in borrowed:   # Q6: borrowed demand is not the quota's
                    held[owner] = held.get(owner, 0) + demand(resources).gpu_milli
        over = max((gpu - self.config.quota_gpus * MILLI_PER_GPU for gpu in held.values()), default=0)
        self.counters["quota_overshoot_peak_gpu_milli"] = max(self.counters.get("quota_overshoot_peak_gpu_milli", 0),
                                                              over)

    def _note_quota_overshoot_running(self) -> None:
        """As _note_quota_overshoot, by the runs honest nodes hold (what their drivers run)
        after each "run" order: the checker's model counts a placement decided for a job
        cancelled meanwhile, which its primary never runs (R1)."""
        held: dict[bytes, int] = {}
        for node in self.nodes:
            if node.behaviour is not None or not node.up:
                continue
            for jid in node.running:
                job = self.job_of_id.get(jid)
                if job is not None and (self.borrowing is None or jid not in self.borrowing.borrowed):
                    held[job.owner] = held.get(job.owner, 0) + demand(job.resources).gpu_milli
        over = max((gpu - self.config.quota_gpus * MILLI_PER_GPU for gpu in held.values()), default=0)
        key = "quota_overshoot_running_peak_gpu_milli"
        self.counters[key] = max(self.counters.get(key, 0), over)

    def _quota_events(self, node: SimNode, events) -> None:
        """Who granted each job (any node: a Byzantine home's grants are placed too) and when
        an honest node's table showed a job cancelled (Q2e's grace), for the Q2f check."""
        granted = False
        for event in events:
            if event.kind == "quota_granted":
                if event.detail.get("borrowed"):
                    continue   # Q6: a borrowed grant counts nothing against the quota
                self.quota_bound.granted(node.index, bytes.fromhex(event.detail["job_id"]), self.now_ms)
                granted = True
            elif event.kind == "job_cancelled" and node.behaviour is None:
                self.quota_bound.cancelled(node.index, bytes.fromhex(event.detail["job_id"]), self.now_ms)
        if granted:   # a job may be granted again (a deputy, then a late home) while it runs
            self._check_quota_bound()

    def _check_quota_bound(self) -> None:
        """SPEC.md Q2f, after every run order of an honest node and every grant: the only
        moments the honest homes' running jobs grow."""
        running = {jid: self.job_of_id[jid] for node in self.nodes if node.behaviour is None and node.up
                   for jid in node.running if jid in self.job_of_id}
        self.quota_bound.check(self.now_ms, running, frozenset(self.honest))

    def _declined(self, index: int, jid: bytes) -> bool:
        """Whether node ``index`` answered the job's current placement instance with a decline
        (kept with the job's declines once that instance gave up)."""
        core = self.nodes[index].core
        record = core.job_table.get(jid) if core is not None else None
        if record is None:
            return False
        # A job's bid is kept by its placement key: its instance, or its job id in a slot (P7).
        answer = core.bidding.mine.get(record.instance, core.bidding.mine.get(jid))
        return answer[0] == "decline" if answer is not None else core.me in record.declines

    def _evidence_of(self, index: int) -> set[bytes]:
        """Offenders a node holds evidence against: persisted (survives its crashes) or live."""
        node = self.nodes[index]
        live = {item.offender for item in node.core.evidence} if node.core is not None else set()
        return node.evidence_offenders | live


def run_simulation(config: SimConfig) -> SimResult:
    return Simulation(config).run()
