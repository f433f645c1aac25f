"""The node-mode simulator: real ``Node`` drivers over simulated IO (SPEC.md section 11).

``testnet/sim.py`` drives bare MeshCores; this one runs the real trio driver
(meshnode/node/driver.py) the way tigerbeetle's VOPR runs the real replica over simulated
IO: N ``Node`` objects on a ``MemoryNetwork`` under trio's ``MockClock`` (autojump: a
virtual second costs what its work costs), with their real SQLite stores in a temporary
testnet directory and a simulated workload runner, ``SimRunner``, in place of the
subprocess one. So the whole path decision -> run order -> runner -> checkpoint ->
replication -> eviction -> resume runs as it does in ``meshnode run``.

One ``random.Random(seed)`` draws the mesh (keys: ``launcher.create_testnet(rng=...)``),
the jobs, the fault schedule and each core's rng; trio's scheduler is seeded and made
deterministic, and nodes start with the clock held still, so a seed replays the same run,
in this process or another.

Faults (a modest set, one episode at a time, in ``[fault_start_ms, heal_ms)``):
``crash`` cancels a node's task (its data directory survives) and starts a new ``Node``
on the same directory later; ``partition`` cuts a group of nodes off from the rest
(``MemoryNetwork.cut``) and heals it later; ``move`` (only when named) has the owner ask
a live member to move a running job elsewhere (SPEC.md R2). From ``heal_ms`` on,
nothing fails.

Checks (each failure is a ``Violation``, as in testnet/sim_checks.py; SPEC.md 11 "Node
mode" states them in full):

- ``double_run``: two runs R1 (node A, fence f1) and R2 (node B != A, fence f2 > f1) of
  one job may overlap in virtual time only if R1 started first and A could not exchange
  messages with B (cut off: it cannot know it is fenced, and its checkpoints are refused,
  SPEC.md 9.6); R1 stops within ``detection_bound_ms`` of the first moment it can. Two
  runs under one fence on two nodes never overlap. A crashed primary's run ends at the
  crash.
- ``resume``: a run resumes from the newest checkpoint its node holds for the job (seq
  and progress), and the state it is given decodes to that progress.
- ``lost_work``: per resume, (progress of the run it continues at the first moment,
  after the restored checkpoint, at which the resuming node could no longer hear it) -
  (restored progress) is at most ``checkpoint_ms + unit_ms`` (a checkpoint period, and
  one unit because progress counts whole units).
- ``liveness``: once faults heal, every job is completed by a run that did all its units
  and every node is a member again, within the bound.
- ``agreement``: at the end every member holds every job completed by its newest exit.
- ``rerun_after_exit``: no run starts after the job's exit on a node the exit reached.

Failures that SPEC.md 7 "Known limits" describes (exits are messages, sent once) are
counted apart as known limits, not violations: ``missed_exit``, ``rerun_after_exit`` on
a node the exit did not reach, ``stale_exit``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import logging
import math
import os
import random
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import trio
import trio.testing

from keys.genesis import DEFAULT_PARAMS
from keys.identity import SigningIdentity
from keys.keystore import load_identity
from meshnode.net.memory_transport import MEMORY_ADDR_PREFIX, MemoryNetwork, MemoryTransport
from meshnode.node.driver import Node
from meshnode.node.runner import RunningWorkload
from meshnode.workload.builtin import BUILTIN_KINDS
from protocol.errors import LocalProtocolError, MeshError
from protocol.job_table import LIVE_JOB_STATES
from protocol.messages import Constraints, JobManifest, MoveRequest, Resources, encode_message
from testnet import launcher
from testnet.sim_checks import MAX_VIOLATIONS_KEPT, Violation

NODE_FAULTS = ("crash", "partition")
# Asked for by name only (``--faults crash,partition,move``): not a fault but an owner's
# move of a running job (SPEC.md R2), drawn between the faults.
NODE_FAULT_KINDS = NODE_FAULTS + ("move",)
SIM_STATE = struct.Struct(">4sQQQQ")   # magic, progress, fence, seq, node: what a checkpoint holds
SIM_STATE_MAGIC = b"SIM1"
POLL_MS = 50                           # how often the end phase looks for completed jobs
SETTLE_MS = 500                        # after the last job completes: exits and syncs spread
# Once healed, every member shows each job with the same state, primary and fence this long
# after the last decision or exit anywhere (issue 15: "one truth about each job").
AGREEMENT_MS = 1000


def now_ms() -> int:
    """Virtual milliseconds; MockClock deadlines are float seconds, so round, not truncate."""
    return round(trio.current_time() * 1000)


# --- the simulated workload runner ----------------------------------------------------------------

def parse_work(entrypoint: str, args: list[str]) -> tuple[int, int]:
    """(units, unit_ms) of a counter (``--units``, ``--unit-ms``) or train (``--steps``) job."""
    units, unit_ms = None, 1
    for flag, value in zip(args, args[1:]):
        if flag in ("--units", "--steps"):
            units = int(value)
        elif flag == "--unit-ms":
            unit_ms = max(1, int(value))
    if units is None or units < 0:
        raise LocalProtocolError("a simulated %s job needs --units (or --steps)" % entrypoint)
    return units, unit_ms


@dataclass
class RunRecord:
    """One run of one job on one node, as the simulated runner saw it."""
    job: str                   # job id, hex
    node: int
    incarnation: int           # the node's start count: a restart is a new incarnation
    fence: int
    start_ms: int
    start_progress: int
    restore_seq: int | None    # None: started from scratch
    restore_origin: tuple | None  # (node, fence) that took the restored checkpoint
    held: tuple | None         # (fence, seq, progress) newest checkpoint the node held at start
    units: int
    unit_ms: int
    end_ms: int | None = None
    end_progress: int | None = None
    end: str = "running"       # exit | stopped | killed | running
    checkpoints: int = 0
    last_checkpoint: tuple | None = None   # (seq, progress, taken_ms)
    exit_reached: tuple = ()   # nodes its exit could reach: members its node broadcast to, not cut off
    gpus: tuple = ()           # the GPU indices its node ran it on
    # (node, fence, progress): the newest checkpoint of the job each other running node held at start
    checkpoint_holders: tuple = ()

    def progress_at(self, at_ms: int) -> int:
        """The work this run had done at ``at_ms`` (its model: one unit per unit_ms)."""
        stop = at_ms if self.end_ms is None else min(at_ms, self.end_ms)
        return min(self.units, self.start_progress + max(0, stop - self.start_ms) // self.unit_ms)


class _SimJob:
    def __init__(self, info: RunningWorkload, record: RunRecord):
        self.info = info
        self.record = record
        self.stopping = False
        self.wake = trio.Event()


class SimRunner:
    """``WorkloadRunner``'s interface (meshnode/node/runner.py) in virtual time, in process.

    A started job does one unit of work per ``unit_ms`` of virtual time from the progress it
    was restored to; every ``checkpoint_ms`` (absolute grid from its start) it offers a
    checkpoint whose state encodes its progress; after its declared units it offers a last
    checkpoint and exits 0. ``stop`` ends it with no further callback; cancelling ``serve``
    (the node crashed) ends every job. ``ignore_restore`` is a deliberately broken runner
    that starts every job from scratch (the checkers must catch it).
    """

    def __init__(self, data_dir, checkpoint_ms: int, on_checkpoint, on_exit, *, commands=None,
                 allowed_entrypoints=None, node: int = 0, incarnation: int = 0, recorder=None,
                 ignore_restore: bool = False):
        if checkpoint_ms < 1:
            raise LocalProtocolError("checkpoint_ms must be at least 1")
        self.data_dir = os.path.abspath(os.fspath(data_dir))
        self.checkpoint_ms = checkpoint_ms
        self._on_checkpoint = on_checkpoint
        self._on_exit = on_exit
        self._commands = dict(commands or {})
        self._allowed = allowed_entrypoints
        self.node = node
        self.incarnation = incarnation
        self.recorder = recorder
        self.ignore_restore = ignore_restore
        self._jobs: dict[bytes, _SimJob] = {}
        self._nursery: trio.Nursery | None = None
        self._next_pid = 1000
        # job id -> (request_rate_milli, latency_p99_us, progress_rate_milli): the load its
        # workload reports (SPEC.md 9.4a), as a test or scenario sets it.
        self.reported_signals: dict[bytes, tuple] = {}

    def fresh_signals(self, max_age_s: float) -> dict[bytes, tuple]:
        return {job_id: signals for job_id, signals in self.reported_signals.items() if job_id in self._jobs}

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for job in list(self._jobs.values()):   # the node is gone: so are its workloads
                    self._end(job, "killed")

    async def start(self, job_id: bytes, entrypoint: str, args: list[str], gpus: list[int],
                    restore: tuple[bytes, int, int] | None, fence: int, extra_env: dict | None = None) -> int:
        if self._nursery is None:
            raise LocalProtocolError("SimRunner.start before serve() is running")
        if job_id in self._jobs:
            raise LocalProtocolError("job %s is already running here" % job_id.hex())
        if self._allowed is not None and entrypoint not in self._allowed:
            raise LocalProtocolError("entrypoint %r is not allowed on this node" % entrypoint)
        if entrypoint not in BUILTIN_KINDS and entrypoint not in self._commands:
            raise LocalProtocolError("entrypoint %r is unknown" % entrypoint)
        units, unit_ms = parse_work(entrypoint, args)
        state, progress, seq = restore if restore is not None else (b"", 0, 0)
        origin = None
        if restore is not None:
            magic, state_progress, state_fence, _state_seq, state_node = SIM_STATE.unpack(state)
            origin = (state_node, state_fence)
            if magic != SIM_STATE_MAGIC or state_progress != progress:
                raise LocalProtocolError("restore state does not match its progress")
        if self.ignore_restore:
            progress, seq = 0, 0
        self._next_pid += 1
        info = RunningWorkload(job_id=job_id, entrypoint=entrypoint, argv=list(args), pid=self._next_pid,
                               fence=fence, gpus=tuple(gpus), started_ms=now_ms(), seq=seq, progress=progress)
        record = RunRecord(job=job_id.hex(), node=self.node, incarnation=self.incarnation, fence=fence,
                           start_ms=now_ms(), start_progress=progress,
                           restore_seq=None if restore is None else restore[2], restore_origin=origin,
                           held=None, units=units, unit_ms=unit_ms, gpus=tuple(gpus))
        job = _SimJob(info, record)
        self._jobs[job_id] = job
        if self.recorder is not None:
            self.recorder.started(self, record, restore)
        self._nursery.start_soon(self._run, job)
        return info.pid

    async def stop(self, job_id: bytes) -> int | None:
        job = self._jobs.get(job_id)
        if job is None:
            return None
        self._end(job, "stopped")
        return -9

    async def stop_for_handover(self, job_id: bytes) -> tuple | None:
        """``stop``, and the state it had reached since its last checkpoint (runner.py)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        self._end(job, "stopped")
        info, record = job.info, job.record
        if record.end_progress == record.start_progress and info.last_taken_ms is None:
            return None   # it offered nothing yet
        info.seq += 1
        info.progress, info.last_taken_ms = record.end_progress, record.end_ms
        record.checkpoints += 1
        record.last_checkpoint = (info.seq, record.end_progress, record.end_ms)
        state = SIM_STATE.pack(SIM_STATE_MAGIC, record.end_progress, info.fence, info.seq, self.node)
        return info.seq, record.end_progress, record.end_ms, state

    def workdir(self, job_id: bytes) -> str:
        return os.path.join(self.data_dir, "workloads", job_id.hex())

    def running(self) -> dict[bytes, dict]:
        return {job_id: job.info.summary() for job_id, job in self._jobs.items()}

    def jobs_info(self) -> list[RunningWorkload]:
        return [job.info for job in self._jobs.values()]

    def _end(self, job: _SimJob, how: str) -> None:
        if job.stopping:
            return
        job.stopping = True
        job.wake.set()
        self._jobs.pop(job.info.job_id, None)
        record = job.record
        record.end_ms = now_ms()
        record.end_progress = record.progress_at(record.end_ms)
        record.end = how

    async def _run(self, job: _SimJob) -> None:
        record, period = job.record, self.checkpoint_ms
        done_ms = record.start_ms + (record.units - record.start_progress) * record.unit_ms
        next_tick = record.start_ms + period
        last_offered = record.start_progress
        while True:
            deadline = min(next_tick, done_ms)
            with trio.move_on_at(deadline / 1000):
                await job.wake.wait()
            if job.stopping:
                return
            if deadline == next_tick:
                next_tick += period
            progress = record.progress_at(deadline)
            if progress != last_offered:   # the slot holds a new state (runner.py _take_checkpoint)
                last_offered = progress
                await self._checkpoint(job, progress, deadline)
                if job.stopping:           # stopped from inside the callback (the node was fenced)
                    return
            if deadline == done_ms:
                self._jobs.pop(job.info.job_id, None)
                job.stopping = True
                record.end_ms, record.end_progress, record.end = deadline, progress, "exit"
                if self.recorder is not None:
                    self.recorder.exiting(self, record)
                await self._on_exit(job.info.job_id, 0)
                return

    async def _checkpoint(self, job: _SimJob, progress: int, taken_ms: int) -> None:
        info, record = job.info, job.record
        info.seq += 1
        info.progress = progress
        info.last_taken_ms = taken_ms
        record.checkpoints += 1
        record.last_checkpoint = (info.seq, progress, taken_ms)
        state = SIM_STATE.pack(SIM_STATE_MAGIC, progress, info.fence, info.seq, self.node)
        await self._on_checkpoint(info.job_id, info.seq, progress, taken_ms, state)


# --- the simulation -------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeSimConfig:
    nodes: int = 4
    jobs: int = 4
    seed: int = 0
    faults: tuple[str, ...] = NODE_FAULTS
    fault_start_ms: int = 600         # the first fault episode starts here or later
    heal_ms: int = 4000               # every fault is healed and every node up from here
    submit_window_ms: tuple = (100, 600)
    unit_ms: int = 10
    delay_ms: int = 1                 # one-way delay of every frame (virtual); see DelayedTransport
    units: tuple = (150, 400)         # a job's declared work, in units (1.5-4 s at 10 ms)
    episode_ms: tuple = (50, 1200)    # how long one crash or partition lasts
    gap_ms: tuple = (100, 700)        # quiet time between two episodes
    liveness_bound_ms: int = 8000     # after heal_ms plus the longest job's work
    broken_runner: str | None = None  # "ignore_restore": a runner the checkers must catch
    # Every job asks for these resources with this strategy instead of drawn ones (tests:
    # shares of one GPU, SPEC.md P4c); None: drawn as always.
    job_resources: Resources | None = None
    job_strategy: str = "throughput"
    # Scripted faults instead of drawn ones (tests): (at_ms, kind, target, duration_ms), in
    # time order; target is a node index, a tuple of them (partition), or "primary" or
    # "backup": the primary or first backup of the first job submitted, as the
    # lowest-numbered live member sees it then.
    script: tuple = ()
    bid_sample: int = 0               # the genesis bid_sample (SPEC.md 5.6; 0: every member bids)

    def reproduce(self) -> str:
        cli = NodeSimConfig(nodes=self.nodes, jobs=self.jobs, seed=self.seed, faults=self.faults,
                            bid_sample=self.bid_sample)
        if self != cli:   # options the command line does not offer
            return 'python -c "from testnet.sim_nodes import *; run_config(%r)"' % (self,)
        return "meshnode sim --driver node --nodes %d --jobs %d --seed %d --faults %s%s" % (
            self.nodes, self.jobs, self.seed, ",".join(self.faults) if self.faults else "none",
            " --bid-sample %d" % self.bid_sample if self.bid_sample else "")


@dataclass
class Episode:
    kind: str          # crash | partition | move
    nodes: tuple       # the crashed node, or the group cut off from the rest (move: ())
    start_ms: int
    end_ms: int


@dataclass
class NodeSimResult:
    config: NodeSimConfig
    violations: list
    violation_count: int
    known_limits: list             # failures SPEC.md 7 "Known limits" describes (not violations)
    known_limits_count: dict
    runs: list
    episodes: list
    decisions: int
    failovers: int
    resumes: int
    lost_work_ms: list
    fenced_overlap_ms: list
    completed_ms: dict
    virtual_ms: int
    wall_s: float
    final_epoch: int
    counters: dict
    deterministic_scheduling: bool

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def to_json(self) -> dict:
        lost = sorted(self.lost_work_ms)
        return {
            "seed": self.config.seed, "nodes": self.config.nodes, "jobs": self.config.jobs,
            "faults": list(self.config.faults), "ok": self.ok, "violation_count": self.violation_count,
            "violations": [v.line() for v in self.violations],
            "known_limits": [v.line() for v in self.known_limits], "known_limits_count": self.known_limits_count,
            "runs": [asdict(r) for r in self.runs], "episodes": [asdict(e) for e in self.episodes],
            "decisions": self.decisions, "failovers": self.failovers, "resumes": self.resumes,
            "lost_work_ms": {"max": lost[-1] if lost else None, "p99": percentile(lost, 0.99),
                             "values": lost},
            "fenced_overlap_ms_max": max(self.fenced_overlap_ms, default=0),
            "completed_ms": self.completed_ms, "virtual_ms": self.virtual_ms, "wall_s": round(self.wall_s, 3),
            "final_epoch": self.final_epoch, "counters": self.counters,
            "deterministic_scheduling": self.deterministic_scheduling,
            "reproduce": "reproduce with seed=%d: %s" % (self.config.seed, self.config.reproduce()),
        }

    def digest(self) -> str:
        """A digest of what happened (runs and checks), to show a seed replays."""
        import hashlib
        body = json.dumps([[asdict(r) for r in self.runs], [v.line() for v in self.violations],
                           self.decisions, self.final_epoch], sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


def percentile(ordered: list, fraction: float):
    """Nearest rank, of an already sorted list."""
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * round(fraction * 1000) // 1000))
    return ordered[rank - 1]


class DelayedTransport:
    """A ``MemoryTransport`` whose frames arrive ``delay_s`` of virtual time after ``send``
    (per-peer order kept: one queue, one constant delay). With no delay at all, a protocol
    exchange that answers itself (a round rejected by every validator, then the next one
    at once) would run forever at one virtual instant; the memory network has no delay."""

    def __init__(self, inner: MemoryTransport, delay_s: float):
        self.inner = inner
        self.delay_s = delay_s
        self._queue_send, self._queue = trio.open_memory_channel(math.inf)

    def __getattr__(self, name):
        return getattr(self.inner, name)   # incoming, peers, rtt_us, connect, listen_addrs, counters

    async def send(self, peer_key: bytes, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.send_nowait(peer_key, data)

    def send_nowait(self, peer_key: bytes, data: bytes) -> None:
        self._queue_send.send_nowait((trio.current_time() + self.delay_s, peer_key, data))

    async def pump(self) -> None:
        async for at, peer_key, data in self._queue:
            await trio.sleep_until(at)
            await self.inner.send(peer_key, data)   # a cut made meanwhile drops it, as on a wire


def memory_transport_factory(network: MemoryNetwork, delay_ms: int = 0):
    """Node's transport factory: the genesis' TCP addresses are dialled on the memory
    network, and every frame takes ``delay_ms`` (virtual) to arrive."""
    @contextlib.asynccontextmanager
    async def factory(seed: bytes, _listen):
        transport = network.transport(SigningIdentity(seed).public_key)

        async def connect(peer_key: bytes, _addr: str, defer_to_peer_ms: int = 0) -> None:
            await MemoryTransport.connect(transport, peer_key, MEMORY_ADDR_PREFIX + peer_key.hex(), defer_to_peer_ms)
        transport.connect = connect
        async with transport:
            if not delay_ms:
                yield transport
                return
            delayed = DelayedTransport(transport, delay_ms / 1000)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(delayed.pump)
                yield delayed
                nursery.cancel_scope.cancel()
    return factory


@contextlib.contextmanager
def deterministic_trio(seed: int):
    """Seed trio's scheduler and make its batch order depend on task creation order only,
    as trio's own Hypothesis plugin does (trio/_core/_run.py); without it the deadline
    heap breaks ties by id() and a run is not replayable. Yields whether it could."""
    run_module = getattr(getattr(trio, "_core", None), "_run", None)
    if not all(hasattr(run_module, name) for name in ("_r", "_ALLOW_DETERMINISTIC_SCHEDULING")):
        yield False
        return
    saved = (run_module._ALLOW_DETERMINISTIC_SCHEDULING, run_module._r.getstate())
    run_module._ALLOW_DETERMINISTIC_SCHEDULING = True
    run_module._r.seed(seed)
    try:
        yield True
    finally:
        run_module._ALLOW_DETERMINISTIC_SCHEDULING, state = saved
        run_module._r.setstate(state)


class _WarningCounter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = record.msg.split(":")[0] if isinstance(record.msg, str) else str(record.msg)
        self.counts[key] = self.counts.get(key, 0) + 1


class RunChecks:
    """The checks on runs (module docstring): fed the runs a simulation recorded and its
    fault episodes; they record Violations (and known limits), never raise."""

    def __init__(self, episodes: list, checkpoint_ms: int, detection_bound_ms: int, delay_ms: int = 0):
        self.episodes = episodes
        self.checkpoint_ms = checkpoint_ms
        self.delay_ms = delay_ms
        self.detection_bound_ms = detection_bound_ms
        self.violations: list[Violation] = []
        self.violation_count = 0
        self.known_limits: list[Violation] = []
        self.known_limits_count: dict[str, int] = {}
        self.lost_work_ms: list[int] = []
        self.fenced_overlap_ms: list[int] = []
        self.failovers = self.resumes = 0

    def check_runs(self, runs: list[RunRecord]) -> None:
        """double_run and lost_work over every job's runs (each run ended or given an end)."""
        by_job: dict[str, list[RunRecord]] = {}
        for run in runs:
            by_job.setdefault(run.job, []).append(run)
        for job, job_runs in by_job.items():
            self.check_double_runs(job, job_runs)
            for run in job_runs:
                self.check_lost_work(job, run, job_runs, self.lost_work_bound_ms(run.unit_ms))

    def lost_work_bound_ms(self, unit_ms: int) -> int:
        """A checkpoint period, one unit (progress counts whole units) and one delivery (the
        newest checkpoint may die in flight with its sender)."""
        return self.checkpoint_ms + unit_ms + self.delay_ms

    def violate(self, check: str, node: int | None, job: str, detail: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append(Violation(check, node, job, detail))

    def known_limit(self, check: str, node: int | None, job: str, detail: str) -> None:
        """A failure that SPEC.md 7 "Known limits" describes: counted and shown, not a violation."""
        self.known_limits_count[check] = self.known_limits_count.get(check, 0) + 1
        if len(self.known_limits) < MAX_VIOLATIONS_KEPT:
            self.known_limits.append(Violation(check, node, job, detail))

    def separated(self, a: int, b: int, at_ms: int) -> bool:
        """Whether b could not hear a at ``at_ms`` (either was down, or a cut lay between them)."""
        for ep in self.episodes:
            if ep.start_ms <= at_ms < ep.end_ms:
                if ep.kind == "crash" and (a in ep.nodes or b in ep.nodes):
                    return True
                if ep.kind == "partition" and (a in ep.nodes) != (b in ep.nodes):
                    return True
        return False

    def first_heard_ms(self, a: int, b: int, from_ms: int) -> int:
        """The first time from ``from_ms`` on at which a and b can exchange messages."""
        at = from_ms
        for ep in sorted(self.episodes, key=lambda e: e.start_ms):
            if ep.start_ms <= at < ep.end_ms and self.separated(a, b, at):
                at = ep.end_ms
        return at

    def first_unheard_ms(self, a: int, b: int, from_ms: int, until_ms: int) -> int:
        """The first time in [from_ms, until_ms] at which a and b cannot exchange messages."""
        for ep in sorted(self.episodes, key=lambda e: e.start_ms):
            if ep.end_ms <= from_ms or ep.start_ms >= until_ms:
                continue
            at = max(from_ms, ep.start_ms)
            if self.separated(a, b, at):
                return at
        return until_ms

    def missed_exit(self, node: int, exits: list[RunRecord]) -> RunRecord | None:
        """An exit of the job that could not reach ``node`` when it was broadcast (exits are
        messages, sent once to the members of the moment: SPEC.md 7 Known limits), or None."""
        return next((r for r in exits if r.node != node and node not in r.exit_reached), None)

    def check_double_runs(self, job: str, runs: list[RunRecord]) -> None:
        """A run under an older fence never starts after a newer one started elsewhere, and
        stops within detection_bound_ms of the first moment its node can hear the newer run's."""
        grace = self.detection_bound_ms
        for r1 in runs:
            for r2 in runs:
                if r1.node == r2.node or r1.fence > r2.fence or (r1.fence == r2.fence and r1.start_ms > r2.start_ms):
                    continue
                if r1.end_ms <= r2.start_ms or r2.end_ms <= r1.start_ms:
                    continue   # no overlap
                if r1.fence == r2.fence or r1.start_ms >= r2.start_ms:
                    self.violate("double_run", r1.node, job,
                                 "fence %d ran on node %d from %d ms while fence %d ran on node %d since %d ms"
                                 % (r1.fence, r1.node, r1.start_ms, r2.fence, r2.node, r2.start_ms))
                    continue
                informed = self.first_heard_ms(r1.node, r2.node, r2.start_ms)
                self.fenced_overlap_ms.append(r1.end_ms - r2.start_ms)
                if informed < r2.end_ms and r1.end_ms > informed + grace:
                    self.violate("double_run", r1.node, job,
                                 "fence %d ran on node %d until %d ms; fence %d started on node %d at %d ms and "
                                 "could reach it from %d ms (grace %d ms)"
                                 % (r1.fence, r1.node, r1.end_ms, r2.fence, r2.node, r2.start_ms, informed, grace))

    def check_lost_work(self, job: str, run: RunRecord, runs: list[RunRecord], bound: int) -> None:
        """Work lost by this run's start: what the run it continues had done when this run's
        node could last hear it, minus where this one starts (SPEC.md 11, node mode)."""
        if run.restore_origin is not None:
            origin_node, origin_fence = run.restore_origin
            candidates = [r for r in runs if r.node == origin_node and r.fence == origin_fence
                          and r.start_ms <= run.start_ms and r is not run]
        else:
            candidates = [r for r in runs if r.start_ms <= run.start_ms and r is not run]
        if not candidates:
            return
        previous = max(candidates, key=lambda r: (r.start_ms, r.fence))
        self.resumes += 1
        if previous.node != run.node:
            self.failovers += 1
        # When the previous run had done what this one starts from (the restored checkpoint
        # was taken then), and the first moment after it at which this node stopped hearing it.
        restored_at = previous.start_ms + max(0, run.start_progress - previous.start_progress) * previous.unit_ms
        heard_until = self.first_unheard_ms(previous.node, run.node, min(restored_at, run.start_ms), run.start_ms)
        heard_until = min(heard_until, previous.end_ms)
        reached = previous.progress_at(heard_until)
        lost_ms = max(0, reached - run.start_progress) * run.unit_ms
        self.lost_work_ms.append(lost_ms)
        holders = [(node, progress) for node, fence, progress in run.checkpoint_holders
                   if fence == previous.fence and node != previous.node and progress > run.start_progress]
        if lost_ms > bound and holders and all(self.separated(node, run.node, run.start_ms) for node, _ in holders):
            # Every node holding the work was cut off with the run (its primary and all its
            # backups): no node the mesh could reach had it (SPEC.md 11, `checkpoints_cut_off`).
            self.known_limit("checkpoints_cut_off", run.node, job,
                             "fence %d on node %d started at progress %d; the work of node %d fence %d (%d ms) "
                             "was held only by nodes cut off from it: %s"
                             % (run.fence, run.node, run.start_progress, previous.node, previous.fence, lost_ms,
                                ", ".join("node %d (progress %d)" % h for h in holders)))
        elif lost_ms > bound:
            self.violate("lost_work", run.node, job,
                         "fence %d on node %d started at progress %d; the run it continues (node %d fence %d) "
                         "had reached %d when last heard at %d ms: %d ms lost, bound %d ms"
                         % (run.fence, run.node, run.start_progress, previous.node, previous.fence,
                            reached, heard_until, lost_ms, bound))


class NodeSimulation(RunChecks):
    def __init__(self, config: NodeSimConfig, root: Path):
        self.config = config
        self.root = Path(root)
        self.rng = random.Random(config.seed)
        self.params = DEFAULT_PARAMS
        self.layout = launcher.create_testnet(self.root / "net", config.nodes, name="sim",
                                              params=self.params, rng=random.Random(self.rng.getrandbits(64)),
                                              bid_sample=config.bid_sample)
        self.dirs = [Path(entry["dir"]) for entry in self.layout["nodes"]]
        self.keys = [bytes.fromhex(entry["public_key"]) for entry in self.layout["nodes"]]
        with contextlib.redirect_stderr(io.StringIO()):
            self.owner = load_identity(self.layout["owners"][0]["key_file"], None)
        self.mesh_id = bytes.fromhex(self.layout["mesh_id"])
        self.network = MemoryNetwork()
        self.clock = trio.testing.MockClock(autojump_threshold=0)
        self.live: list[Node | None] = [None] * config.nodes
        self.scopes: list[trio.CancelScope | None] = [None] * config.nodes
        self.down_events: list[trio.Event | None] = [None] * config.nodes
        self.incarnations = [0] * config.nodes
        self.runs: list[RunRecord] = []
        self.episodes: list[Episode] = []
        RunChecks.__init__(self, self.episodes, self.params.checkpoint_ms, self.params.detection_bound_ms,
                           config.delay_ms)
        self.job_ids: list[bytes] = []
        self.job_units: dict[str, int] = {}
        self.completed_ms: dict[str, int] = {}
        self.counters = {"crashes": 0, "restarts": 0, "partitions": 0, "submit_refused": 0, "moves": 0,
                         "move_refused": 0}
        self.decided: set[bytes] = set()
        self.last_change_ms = 0          # the last certified decision applied, or exit, at any node
        self.agreement_checked = 0       # samples at which every member was compared
        self.end_ms = 0
        self.final_epoch = 0

    # --- violations -------------------------------------------------------------------------
    # --- nodes ------------------------------------------------------------------------------
    def _new_node(self, index: int) -> Node:
        self.incarnations[index] += 1
        runner = functools.partial(SimRunner, node=index, incarnation=self.incarnations[index], recorder=self,
                                   ignore_restore=self.config.broken_runner == "ignore_restore")
        with contextlib.redirect_stderr(io.StringIO()):   # the testnet keystores' insecure warning
            transport = memory_transport_factory(self.network, self.config.delay_ms)
            node = Node(self.dirs[index], transport_factory=transport, runner_factory=runner,
                        rng=random.Random(self.rng.getrandbits(64)))
        self._watch_decisions(node)
        return node

    def _watch_decisions(self, node: Node) -> None:
        """Count certified decisions as the drain applies them (observation only)."""
        apply = node.drain.apply

        async def counting_apply(decision):
            if decision.certificate:
                self.decided.add(decision.instance)
                self.last_change_ms = now_ms()
            await apply(decision)
        node.drain.apply = counting_apply

    async def _host(self, index: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        node = self._new_node(index)
        down = trio.Event()
        self.down_events[index] = down
        scope = trio.CancelScope()
        self.scopes[index] = scope
        try:
            with scope:
                self.live[index] = node
                await node.run(task_status=task_status)
        finally:
            self.live[index] = None
            node.close()
            down.set()

    async def crash(self, index: int) -> None:
        if self.live[index] is None:
            return
        self.counters["crashes"] += 1
        self.scopes[index].cancel()
        await self.down_events[index].wait()

    async def restart(self, nursery, index: int) -> None:
        if self.live[index] is not None:
            return
        self.counters["restarts"] += 1
        await self._start(nursery, index)

    async def _start(self, nursery, index: int) -> None:
        """Start a node with virtual time held still. Its control server binds its Unix
        socket in a worker thread (trio does, for the path lookup); with the clock jumping
        while that thread runs, the start would take a different virtual time in every run.
        So: wait until every other task is blocked, freeze the clock, start, unfreeze."""
        self.clock.autojump_threshold = math.inf
        try:
            await trio.testing.wait_all_tasks_blocked()
            await nursery.start(self._host, index)
        finally:
            self.clock.autojump_threshold = 0

    # --- the runner's reports -----------------------------------------------------------------
    def started(self, runner: SimRunner, record: RunRecord, restore) -> None:
        node = self.live[runner.node]
        held = node.checkpoints.latest(bytes.fromhex(record.job)) if node is not None else None
        record.held = None if held is None else (held.fence, held.seq, held.progress)
        record.checkpoint_holders = tuple(
            (index, newest.fence, newest.progress) for index, other in enumerate(self.live)
            if other is not None and index != runner.node
            for newest in [other.checkpoints.latest(bytes.fromhex(record.job))] if newest is not None)
        self.runs.append(record)
        # resume: from the newest checkpoint this node holds, never less.
        if held is not None:
            if restore is None:
                view = node.core.job_view(bytes.fromhex(record.job))
                if view is None or view["attempt"] == 0:
                    self.violate("resume", runner.node, record.job,
                                 "started from scratch at fence %d though it holds checkpoint seq %d "
                                 "(progress %d)" % (record.fence, held.seq, held.progress))
            elif record.start_progress < held.progress or record.restore_seq != held.seq:
                self.violate("resume", runner.node, record.job,
                             "started at fence %d from progress %d (seq %s); it holds seq %d, progress %d"
                             % (record.fence, record.start_progress, record.restore_seq, held.seq, held.progress))

    def exiting(self, runner: SimRunner, record: RunRecord) -> None:
        """The run did its units: note whom its exit can reach (the core broadcasts it now)."""
        self.last_change_ms = now_ms()
        node = self.live[runner.node]
        targets = set(node.core.broadcast_targets()) if node is not None else set()
        record.exit_reached = tuple(i for i, key in enumerate(self.keys) if key in targets and self.live[i] is not None
                                    and not self.separated(runner.node, i, record.end_ms))

    # --- schedule ------------------------------------------------------------------------------
    def _draw_jobs(self) -> list[tuple[int, JobManifest]]:
        cfg, rng = self.config, self.rng
        jobs = []
        for k in range(cfg.jobs):
            at = rng.randint(*cfg.submit_window_ms)
            units = rng.randint(*cfg.units)
            gpus = rng.randrange(2)
            manifest = JobManifest(
                owner=self.owner.public_key, name="sim-%d" % k, nonce=rng.getrandbits(32), entrypoint="counter",
                args=("--units", str(units), "--unit-ms", str(cfg.unit_ms)),
                resources=cfg.job_resources or Resources(gpus=gpus, gpu_mem_mib=1000 * gpus, cpu_milli=100,
                                                         mem_mib=64),
                strategy=cfg.job_strategy, constraints=Constraints(zones=(), labels=(), attested=()),
                priority=0, backups=rng.randint(1, min(2, cfg.nodes - 1)), max_retries=2, created_ms=0, epoch=0)
            jobs.append((at, manifest))
        return sorted(jobs, key=lambda item: item[0])

    def _scripted_episode(self, _at_ms: int, kind: str, target, duration_ms: int) -> Episode:
        start = now_ms()
        if kind == "move":
            return Episode("move", (), start, start)
        if target in ("primary", "backup", "primary+backup"):
            viewer = next(node for node in self.live if node is not None and node.core.is_member())
            view = viewer.core.job_view(self.job_ids[0])
            roles = {"primary": view["primary"], "backup": view["backups"][0] if view["backups"] else None}
            target = tuple(self._index(roles[role]) for role in target.split("+"))
        nodes = tuple(target) if isinstance(target, (tuple, list)) else (target,)
        return Episode(kind, nodes, start, min(self.config.heal_ms, start + duration_ms))

    def _draw_episode(self, start: int) -> Episode:
        cfg, rng = self.config, self.rng
        kind = rng.choice(cfg.faults)
        duration = rng.randint(*cfg.episode_ms)
        end = min(cfg.heal_ms, start + duration)
        if kind == "move":
            return Episode("move", (), start, start)
        if kind == "crash":
            # Mostly a primary of a running job: the failover path is what this mode is for.
            primaries = sorted({i for node in self.live if node is not None for job in node.core.jobs()
                                if job["state"] in ("placed", "running", "migrating") and job["primary"]
                                for i in [self.keys.index(job["primary"])] if job["primary"] in self.keys})
            up = [i for i in range(cfg.nodes) if self.live[i] is not None]
            pool = primaries if primaries and rng.randrange(4) else up
            return Episode("crash", (rng.choice(pool),), start, end)
        size = rng.randint(1, max(1, cfg.nodes // 2))
        return Episode("partition", tuple(sorted(rng.sample(range(cfg.nodes), size))), start, end)

    def _cut(self, group: tuple, heal: bool) -> None:
        for a in group:
            for b in range(self.config.nodes):
                if b not in group:
                    (self.network.heal if heal else self.network.cut)(self.keys[a], self.keys[b])

    async def _submit(self, manifest: JobManifest) -> None:
        up = [i for i in range(self.config.nodes) if self.live[i] is not None and self.live[i].core.is_member()
              and not self._isolated(i, now_ms())]
        if not up:
            self.counters["submit_refused"] += 1
            return
        node = self.live[self.rng.choice(up)]
        manifest = replace(manifest, created_ms=now_ms(), epoch=node.core.epoch)
        envelope = encode_message(self.owner, self.mesh_id, manifest)
        try:
            job_id = await node.submit(envelope)
        except MeshError:
            self.counters["submit_refused"] += 1
            return
        self.job_ids.append(job_id)
        self.job_units[job_id.hex()] = int(manifest.args[1])

    # --- connectivity -----------------------------------------------------------------------------
    def _isolated(self, index: int, at_ms: int) -> bool:
        """Whether ``index`` is down, or cut off from a quorum of the nodes, at ``at_ms``."""
        n = self.config.nodes
        for ep in self.episodes:
            if ep.start_ms <= at_ms < ep.end_ms and index in ep.nodes:
                if ep.kind == "crash" or 3 * len(ep.nodes) <= 2 * n:
                    return True
            if ep.kind == "partition" and ep.start_ms <= at_ms < ep.end_ms and index not in ep.nodes:
                if 3 * (n - len(ep.nodes)) <= 2 * n:
                    return True
        return False

    # --- main --------------------------------------------------------------------------------------
    async def main(self) -> None:
        cfg = self.config
        jobs = self._draw_jobs()
        async with trio.open_nursery() as nursery:
            for index in range(cfg.nodes):
                await self._start(nursery, index)
            # One timeline: submissions at their drawn times, and fault episodes one after
            # another (each drawn when it starts: a crash mostly hits a current primary).
            script = list(cfg.script)
            if script:
                fault_at = script[0][0]
            else:
                fault_at = cfg.fault_start_ms + self.rng.randint(0, 300) if cfg.faults else math.inf
            while jobs or fault_at < cfg.heal_ms:
                if fault_at < cfg.heal_ms and (not jobs or fault_at <= jobs[0][0]):
                    await trio.sleep_until(fault_at / 1000)
                    if script:
                        await self._run_episode(nursery, self._scripted_episode(*script.pop(0)))
                        fault_at = max(script[0][0], now_ms()) if script else math.inf
                    else:
                        await self._run_episode(nursery, self._draw_episode(fault_at))
                        fault_at = now_ms() + self.rng.randint(*cfg.gap_ms)
                else:
                    at, manifest = jobs.pop(0)
                    await trio.sleep_until(max(at, now_ms()) / 1000)
                    await self._submit(manifest)
            # Heal: everything up and connected (episodes already ended by heal_ms).
            await trio.sleep_until(max(cfg.heal_ms, now_ms()) / 1000)
            for index in range(cfg.nodes):
                await self.restart(nursery, index)
            nursery.start_soon(self._watch_agreement)
            deadline = cfg.heal_ms + cfg.units[1] * cfg.unit_ms + cfg.liveness_bound_ms
            while now_ms() < deadline and not self._all_finished():
                await trio.sleep(POLL_MS / 1000)
            await trio.sleep(SETTLE_MS / 1000)
            self.end_ms = now_ms()
            self._final_checks(deadline)
            nursery.cancel_scope.cancel()

    async def _run_episode(self, nursery, episode: Episode) -> None:
        self.episodes.append(episode)
        if episode.kind == "move":
            await self._move_a_job()
        elif episode.kind == "crash":
            await self.crash(episode.nodes[0])
            await trio.sleep_until(episode.end_ms / 1000)
            await self.restart(nursery, episode.nodes[0])
        else:
            self.counters["partitions"] += 1
            self._cut(episode.nodes, heal=False)
            await trio.sleep_until(episode.end_ms / 1000)
            self._cut(episode.nodes, heal=True)

    async def _move_a_job(self) -> None:
        """The owner asks a live member to move a running job (the first submitted one
        still running, as that member sees it) to wherever the mesh picks (SPEC.md R2)."""
        up = [node for i, node in enumerate(self.live) if node is not None and node.core.is_member()
              and not self._isolated(i, now_ms())]
        if not up:
            return
        node = self.rng.choice(up)
        running = [view for jid in self.job_ids for view in [node.core.job_view(jid)]
                   if view is not None and view["state"] == "running"]
        if not running:
            return
        request = MoveRequest(job_id=running[0]["job_id"], fence=running[0]["fence"], to_node=b"",
                              requested_ms=now_ms())
        try:
            await node.move(encode_message(self.owner, self.mesh_id, request))
            self.counters["moves"] += 1
        except MeshError:
            self.counters["move_refused"] += 1

    async def _watch_agreement(self) -> None:
        """After the heal: whenever AGREEMENT_MS have passed since the last decision or exit
        anywhere, every member holds each job with the same (state, primary, fence)."""
        reported: set[bytes] = set()
        while True:
            await trio.sleep(POLL_MS / 1000)
            at = now_ms()
            if at - self.last_change_ms < AGREEMENT_MS:
                continue
            if any(node is None or not node.core.is_member() for node in self.live):
                continue
            self.agreement_checked += 1
            for job_id in self.job_ids:
                views = {}
                for index, node in enumerate(self.live):
                    view = node.core.job_view(job_id)
                    views[index] = None if view is None else (view["state"], self._index(view["primary"]),
                                                              view["fence"])
                if len(set(views.values())) > 1 and job_id not in reported:
                    reported.add(job_id)
                    self.violate("agreement_1s", None, job_id.hex(), "%d ms after the last decision or exit "
                                 "(at %d ms) members disagree: %s" % (at - self.last_change_ms,
                                                                      self.last_change_ms, views))

    def _all_finished(self) -> bool:
        """Every node up and a member, every job done by some run, and nothing running."""
        if any(node is None or not node.core.is_member() for node in self.live):
            return False
        if any(run.end == "running" for run in self.runs):
            return False
        done = {run.job for run in self.runs if run.end == "exit" and run.end_progress == run.units}
        for job_id in self.job_ids:
            if job_id.hex() not in done:
                return False
            self.completed_ms.setdefault(job_id.hex(), min(
                run.end_ms for run in self.runs if run.job == job_id.hex() and run.end == "exit"))
        return True

    # --- checks ---------------------------------------------------------------------------------------
    def _final_checks(self, deadline: int) -> None:
        cfg = self.config
        for run in self.runs:
            if run.end == "running":
                run.end_ms = self.end_ms
                run.end_progress = run.progress_at(self.end_ms)
        self.check_runs(self.runs)
        members = [(i, node) for i, node in enumerate(self.live) if node is not None and node.core.is_member()]
        self.final_epoch = max((node.core.epoch for _, node in members), default=0)
        if len(members) < cfg.nodes:
            self.violate("liveness", None, "", "only nodes %s are members at %d ms" % ([i for i, _ in members],
                                                                                     self.end_ms))
        for job_id in self.job_ids:
            self._check_outcome(job_id, [r for r in self.runs if r.job == job_id.hex()], members, deadline)

    def _check_outcome(self, job_id: bytes, runs: list[RunRecord], members: list, deadline: int) -> None:
        job = job_id.hex()
        exits = sorted((r for r in runs if r.end == "exit" and r.end_progress == r.units), key=lambda r: r.end_ms)
        if not exits:
            self.violate("liveness", None, job, "no run did its %d units by %d ms (runs: %s)"
                         % (self.job_units[job], deadline, _runs_line(runs)))
            return
        first = exits[0]
        # A run started after the job completed: allowed only on a node that missed the exit.
        for run in runs:
            if run.start_ms < first.end_ms or run is first:
                continue
            if run.node not in first.exit_reached:
                self.known_limit("rerun_after_exit", run.node, job,
                                 "ran again at fence %d from %d ms: it missed node %d's exit at %d ms"
                                 % (run.fence, run.start_ms, first.node, first.end_ms))
            else:
                self.violate("rerun_after_exit", run.node, job,
                             "ran again at fence %d from %d ms though node %d's exit at %d ms reached it%s"
                             % (run.fence, run.start_ms, first.node, first.end_ms,
                                self._restart_hint(run.node, [first])))
        # Every member ends with the job completed by its newest exit (highest fence), or by an
        # older one that could not reach the newest run's node (a fenced primary cut off from
        # the mesh ran to its end; or the newest run is a rerun on a node that missed it).
        newest = max(exits, key=lambda r: (r.fence, r.end_ms))
        older = {(self.keys[r.node], r.fence): r for r in exits if r is not newest}
        for index, node in members:
            view = node.core.job_view(job_id)
            final = None if view is None else (view["state"], view["primary"], view["fence"])
            shown = None if final is None else (final[0], self._index(final[1]), final[2])
            if final == ("completed", self.keys[newest.node], newest.fence):
                continue
            exit_run = older.get(final[1:]) if final is not None and final[0] == "completed" else None
            missed = self.missed_exit(index, exits)
            if exit_run is not None and self._stale_exit_allowed(exit_run, newest):
                self.known_limit("stale_exit", index, job, "holds %s: node %d's exit at %d ms under fence %d, "
                                 "not known to node %d, which completed it at fence %d"
                                 % (shown, exit_run.node, exit_run.end_ms, exit_run.fence, newest.node, newest.fence))
            elif missed is not None and final is not None and final[0] in LIVE_JOB_STATES:
                self.known_limit("missed_exit", index, job, "holds %s: it missed node %d's exit at %d ms"
                                 % (shown, missed.node, missed.end_ms))
            else:
                self.violate("agreement", index, job, "holds %s; the job completed on %s%s"
                             % (shown, ", ".join("node %d fence %d" % (r.node, r.fence) for r in exits),
                                self._restart_hint(index, exits)))

    def _restart_hint(self, index: int, exits: list[RunRecord]) -> str:
        """Whether ``index`` restarted after an exit that it made or that reached it (did its
        replay lose it?)."""
        for ep in self.episodes:
            if ep.kind == "crash" and index in ep.nodes and any(
                    (index in r.exit_reached or index == r.node) and ep.start_ms >= r.end_ms for r in exits):
                return " (it had the exit; it crashed at %d ms and restarted at %d ms)" % (ep.start_ms, ep.end_ms)
        return ""

    def _stale_exit_allowed(self, old: RunRecord, newest: RunRecord) -> bool:
        """An exit under an older fence that members may keep: made by a fenced run the
        double-run rule still let run (its node could not know yet), or one the newest run's
        node never received (it ran the job again: rerun_after_exit)."""
        if newest.node not in old.exit_reached and old.end_ms <= newest.start_ms:
            return True
        informed = self.first_heard_ms(old.node, newest.node, newest.start_ms)
        return newest.start_ms <= old.end_ms <= informed + self.detection_bound_ms

    def _index(self, key) -> int | None:
        return self.keys.index(key) if key in self.keys else None

def _runs_line(runs: list[RunRecord]) -> str:
    return "; ".join("node %d fence %d %d-%s ms %s->%s %s" % (r.node, r.fence, r.start_ms, r.end_ms, r.start_progress,
                                                             r.end_progress, r.end) for r in runs) or "none"


def run_node_simulation(nodes: int = 4, jobs: int = 4, seed: int = 0, faults: tuple[str, ...] = NODE_FAULTS,
                        **options) -> NodeSimResult:
    """One seed of the node-mode simulator; see the module docstring."""
    config = NodeSimConfig(nodes=nodes, jobs=jobs, seed=seed, faults=tuple(faults), **options)
    return run_config(config)


def run_config(config: NodeSimConfig) -> NodeSimResult:
    unknown = [f for f in config.faults if f not in NODE_FAULT_KINDS]
    if unknown:
        raise ValueError("node mode knows the faults %s, not %s" % (",".join(NODE_FAULT_KINDS), unknown))
    started = time.perf_counter()
    warnings = _WarningCounter()
    node_log = logging.getLogger("meshnode.node")
    saved_level, saved_propagate = node_log.level, node_log.propagate
    node_log.addHandler(warnings)
    node_log.propagate = False
    if node_log.level == logging.NOTSET or node_log.level > logging.WARNING:
        node_log.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="meshsim-") as tmp, deterministic_trio(config.seed) as deterministic:
            sim = NodeSimulation(config, Path(tmp))
            trio.run(sim.main, clock=sim.clock)
    finally:
        node_log.removeHandler(warnings)
        node_log.setLevel(saved_level)
        node_log.propagate = saved_propagate
        gc.unfreeze()   # Node.run freezes the heap at every start; a sweep must not keep every seed's
        gc.collect()
    return NodeSimResult(
        config=config, violations=sim.violations, violation_count=sim.violation_count,
        known_limits=sim.known_limits, known_limits_count=sim.known_limits_count, runs=sim.runs,
        episodes=sim.episodes, decisions=len(sim.decided), failovers=sim.failovers, resumes=sim.resumes,
        lost_work_ms=sim.lost_work_ms, fenced_overlap_ms=sim.fenced_overlap_ms, completed_ms=sim.completed_ms,
        virtual_ms=sim.end_ms, wall_s=time.perf_counter() - started,
        final_epoch=sim.final_epoch,
        counters=dict(sim.counters, node_warnings=warnings.counts), deterministic_scheduling=deterministic)


def summarize(results: list[NodeSimResult], wall_s: float) -> dict:
    """One JSON-able summary of a node-mode sweep (``meshnode sim --driver node --json``)."""
    lost = sorted(ms for r in results for ms in r.lost_work_ms)
    by_check: dict[str, int] = {}
    known: dict[str, int] = {}
    for r in results:
        for v in r.violations:
            by_check[v.check] = by_check.get(v.check, 0) + 1
        for check, count in r.known_limits_count.items():
            known[check] = known.get(check, 0) + count
    failed = [r for r in results if not r.ok]
    first = results[0].config if results else None
    return {
        "driver": "node",
        "seeds": len(results),
        "first_seed": first.seed if first else None,
        "nodes": first.nodes if first else None,
        "jobs": first.jobs if first else None,
        "faults": list(first.faults) if first else [],
        "violations": sum(r.violation_count for r in results),
        "violations_by_check": by_check,
        "known_limits_by_check": known,
        "seeds_with_known_limits": sum(1 for r in results if r.known_limits_count),
        "failed_seeds": [r.config.seed for r in failed][:100],
        "runs": sum(len(r.runs) for r in results),
        "crashes": sum(r.counters["crashes"] for r in results),
        "partitions": sum(r.counters["partitions"] for r in results),
        "moves": sum(r.counters["moves"] for r in results),
        "moves_refused": sum(r.counters["move_refused"] for r in results),
        "resumes": sum(r.resumes for r in results),
        "failovers": sum(r.failovers for r in results),
        "lost_work_ms": {"max": lost[-1] if lost else None, "p50": percentile(lost, 0.5),
                         "p99": percentile(lost, 0.99),
                         "bound": DEFAULT_PARAMS.checkpoint_ms + first.unit_ms + first.delay_ms if first else None},
        "fenced_overlap_ms_max": max((ms for r in results for ms in r.fenced_overlap_ms), default=0),
        "decisions": sum(r.decisions for r in results),
        "node_warnings": _sum_counts(r.counters["node_warnings"] for r in results),
        "virtual_ms_max": max((r.virtual_ms for r in results), default=0),
        "deterministic_scheduling": all(r.deterministic_scheduling for r in results),
        "wall_s": round(wall_s, 3),
        "reproduce": ["reproduce with seed=%d: %s" % (r.config.seed, r.config.reproduce()) for r in failed][:10],
    }


def _sum_counts(dicts) -> dict:
    total: dict[str, int] = {}
    for counts in dicts:
        for key, count in counts.items():
            total[key] = total.get(key, 0) + count
    return total
