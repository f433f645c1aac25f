"""The node: a thin trio driver of the pure protocol core (STYLE.md "The driver is thin").

One nursery per node. Frames from the transport feed ``MeshCore.step``, a timer (every
5 ms while the core has work, at its next deadline while idle) feeds ``MeshCore.tick``, telemetry feeds ``update_telemetry`` and the workload runner
feeds ``local_checkpoint``. Every call returns a ``Ready`` batch that ``_handle`` drains
in the contract's order (protocol/ready.py): persist, send, apply decisions, publish
events. Core calls are synchronous and trio is single-threaded, so the core is never
entered twice at once.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import time
from collections import deque
from pathlib import Path

import trio

from keys.genesis import load_genesis
from keys.keystore import PassphraseSource, load_identity
from meshnode.control.server import ControlServer, EventHub
from meshnode.node import config as node_config
from meshnode.node.api import CHECKPOINT_STATS_WINDOW, ControlApi
from meshnode.node.checkpoint_store import CheckpointStore, StoredCheckpoint
from meshnode.node.clock import now_ms, wall_ms
from meshnode.node.dirlock import DirectoryLock
from meshnode.node.logfile import flush_log, setup_logging
from meshnode.node.metrics import NodeMetrics, serve_metrics, stop_metrics
from meshnode.node.output_service import OutputService
from meshnode.node.runner import WorkloadRunner
from meshnode.node.store import NodeStore
from meshnode.node.telemetry import Telemetry, TelemetryError
from meshnode.net.limits import RefusalReport
from meshnode.net.transport import DEFER_TO_PEER_MS, dials_first
from meshnode.workload.sdk import GANG_PEERS_FILE, GANG_PEERS_FILE_ENV, format_peers, gang_environment, multiaddr_host
from protocol.errors import LocalProtocolError, MeshError
from protocol.mesh import MeshCore
from protocol.messages import JobManifest, JobSignals, decode_message, is_heartbeat_frame, job_id as compute_job_id
from protocol.drain import ReadyDrain
from protocol.ready import Decision, Event, Ready
from protocol.workload_orders import WorkloadRun

log = logging.getLogger("meshnode.node")

TICK_MS = 5                 # core timer resolution while it has work: heartbeats are 50 ms, detection 300 ms
# The longest an idle node sleeps between ticks: a heartbeat period. The core reads a longer
# gap between ticks as this node having been paused (SPEC.md F3).
MAX_TICK_GAP_MS = 50
TELEMETRY_MS = 1000         # DESIGN.md: a capability vector every second and on change
TELEMETRY_ERROR_LOG_MS = 60_000   # a failing GPU is logged at most once a minute
SIGNALS_FRESH_MS = 5000     # a workload's load report older than this is no longer its load (SPEC.md R3a)
CONNECT_RETRY_MS = 500
RECEIVE_BATCH_FRAMES = 32       # queued frames stepped before the receive loop yields
# ... or fewer, once stepping them took this long: the tick (heartbeats, suspicions, round
# timeouts) waits for the batch, and on a starved host 32 slot frames held it past the
# suspicion threshold (issue 18, n = 16 with jobs in flight).
RECEIVE_BATCH_MS = 10
RECEIVE_BACKLOG_BATCHES = 256   # Ready batches queued behind the drain before frames wait unread
# Frames taken from the transport's queue ahead of stepping, so heartbeats among them are
# stepped first (SPEC.md F1c); the transport's own queue holds as many again.
RECEIVE_UNREAD_MAX = 1024
BACKLOG_WAIT_MS = 1
REFUSAL_REPORT_MS = 10_000  # at most one "peer_traffic_refused" summary per 10 s (SPEC.md 8)


REPLICA_INDEX_ENV = "MESHNODE_REPLICA_INDEX"
SERVICE_PORT_ENV = "MESHNODE_SERVICE_PORT"
SERVICE_HOST_ENV = "MESHNODE_SERVICE_HOST"


def replica_environment(run: WorkloadRun, own_host: str) -> dict:
    """SPEC.md R4e/R4f: a serving job's run learns which replica it is, the port to serve on
    and the host the endpoint table names for this node (``own_host``: nodes sharing one
    machine on distinct loopback addresses then serve one port each without colliding).
    A job with no port and no replicas gets none of them: its environment is as before."""
    port = run.manifest.service.port
    if not port and not run.replica:
        return {}
    return {REPLICA_INDEX_ENV: str(run.replica), SERVICE_PORT_ENV: str(port), SERVICE_HOST_ENV: own_host}


class Node:
    def __init__(self, data_dir, *, transport_factory=None, run_workloads: bool = True,
                 runner_factory=None, rng: random.Random | None = None):
        self.paths = node_config.node_paths(data_dir)
        self.config = node_config.load_config(data_dir)
        self.genesis = load_genesis(self.paths.genesis)
        self.identity = load_identity(self.paths.keystore, _passphrase_source(self.config, data_dir))
        self.policy = node_config.node_policy(self.config, data_dir)
        self.telemetry = Telemetry.open(self.config.gpu)
        self.store = NodeStore(self.paths.database)
        self.checkpoints = CheckpointStore(self.paths.root / "checkpoints.sqlite",
                                           keep=self.genesis.params.checkpoint_keep)
        self.events = EventHub()
        self.run_workloads = run_workloads
        self._transport_factory = transport_factory
        # Injection points for the node-mode simulator (testnet/sim_nodes.py); the defaults
        # are what `meshnode run` uses. runner_factory is called like WorkloadRunner and
        # returns an object with its interface (serve, start, stop, stop_for_handover, running, jobs_info,
        # workdir); rng seeds the core (default: 16 bytes from the OS).
        self._runner_factory = runner_factory or WorkloadRunner
        self._rng = rng
        self.transport = None
        self.runner: WorkloadRunner | None = None
        self.core: MeshCore | None = None
        self.output = OutputService(self)   # job logs and files, for the control socket and for peers (SPEC 9.8)
        self.started_ms = 0
        self.job_fences: dict[bytes, int] = {}   # jobs this node runs -> fence they run under
        self.frozen_fences: dict[bytes, int] = {}   # jobs a halt froze (SPEC.md F3b) -> the fence they ran under
        # Between a "halt" order and the next "resume" (or this node's eviction), in the order the
        # drain executes them: the core itself may already be past the halt when a stop is run.
        self.holding = False
        self.drain = ReadyDrain(persist=self._persist, send=self._send, apply=self._apply, publish=self._publish)
        # stored_ms - taken_ms of the newest checkpoints stored here: as their primary (slot
        # read to local store) and as a backup (+ replication). Wall clocks of one host or
        # of synchronised hosts; `meshnode bench failover` reads them (op checkpoint_stats).
        self.checkpoint_write_ms: deque[int] = deque(maxlen=CHECKPOINT_STATS_WINDOW)
        self.checkpoint_replication_ms: deque[int] = deque(maxlen=CHECKPOINT_STATS_WINDOW)
        self._members_told_epoch: int | None = None  # the epoch whose members the transport knows
        self._tick_wait: trio.CancelScope | None = None   # the tick loop's sleep, while it sleeps
        self._refusals = RefusalReport(REFUSAL_REPORT_MS)
        self.metrics = NodeMetrics(self)   # this node's own registry (README "Metrics")
        self.metrics_server = None         # the HTTP endpoint, when node.toml sets metrics_listen
        self.telemetry_errors = 0          # GPU readings that failed since start (TelemetryError)
        self._telemetry_errors_logged = 0
        self._telemetry_error_logged_ms: int | None = None

    # --- start-up ------------------------------------------------------------------------------

    def _make_core(self) -> MeshCore:
        gpus = self.telemetry.sample(0)
        capacity = node_config.local_capacity(self.config, tuple(g.mem_total_mib for g in gpus),
                                              gpus[0].model if gpus else "")
        rng = self._rng if self._rng is not None else random.Random(os.urandom(16))
        return MeshCore(identity=self.identity, genesis=self.genesis, policy=self.policy,
                        capacity=capacity, rng=rng, now_ms=now_ms(),
                        history=self.store.certificates_in_order(), safety_records=self.store.safety_records(),
                        job_outcomes=self.store.job_outcomes(),
                        capability_seq_floor=self.store.capability_seq_floor())

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.started_ms = now_ms()
        self.core = self._make_core()
        factory = self._transport_factory or _libp2p_factory
        if self.config.metrics_port is not None:  # first: a busy port fails before any peer hears of us
            self.metrics_server = serve_metrics(self.metrics, self.config.metrics_port)
            log.info("metrics on %s", self.metrics_url)
        try:
            async with factory(self.identity.seed, list(self.config.listen)) as transport:
                self.transport = transport
                transport.serve_requests(self.output.answer)
                if hasattr(transport, "take_where_read"):
                    transport.take_where_read = self._take_heartbeat_where_read
                async with trio.open_nursery() as nursery:
                    self.runner = self._runner_factory(
                        self.paths.root, self.genesis.params.checkpoint_ms, self._on_checkpoint, self._on_exit,
                        commands={name: list(argv) for name, argv in self.config.entrypoints},
                        allowed_entrypoints=frozenset(self.config.allowed_entrypoints))
                    await nursery.start(self.runner.serve)
                    api = ControlApi(self)
                    server = ControlServer(self.paths.control_socket, api.handlers(), self.events)
                    await nursery.start(server.serve)
                    nursery.start_soon(self._receive_loop)
                    nursery.start_soon(self._tick_loop)
                    nursery.start_soon(self._telemetry_loop)
                    nursery.start_soon(self._connect_peers)
                    log.info("node %s up, listening on %s", self.identity.peer_id, transport.listen_addrs)
                    task_status.started(self)
                    _freeze_startup_heap()
                    # No workload starts here, not even after a restart. The replayed certificates
                    # may make this node the primary of jobs that an eviction decided while it
                    # was down moved, under a higher fence, to a survivor. So the core's first
                    # tick (SPEC.md F3, F6) asks peers for a sync and holds those jobs: a
                    # member's heartbeat at our epoch yields "resume"; an eviction certificate
                    # yields our eviction, and nothing starts.
                    await trio.sleep_forever()
        finally:
            if self.metrics_server is not None:
                stop_metrics(self.metrics_server)
                self.metrics_server = None

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_server is None:
            return None
        return "http://%s:%d/metrics" % (node_config.METRICS_HOST, self.metrics_server.server_port)

    async def _connect_peers(self) -> None:
        """Dial every member with an address, and the bootstrap peers; the transport redials.

        Of two members the lower key dials and the other defers to it (SPEC.md 8 "Dial
        order"), so a mesh starting at once makes one connection per pair. Bootstrap
        peers are dialled at once: they do not know us yet."""
        bootstrap = {peer.public_key: peer.addr for peer in self.config.bootstrap}
        members = {}
        for member in self.core.member_records():
            if member.public_key != self.identity.public_key and member.addrs and member.public_key not in bootstrap:
                members[member.public_key] = member.addrs[0]
        for key, addr in bootstrap.items():
            await self.transport.connect(key, addr)
        for key, addr in members.items():
            defer_ms = 0 if dials_first(self.identity.public_key, key) else DEFER_TO_PEER_MS
            await self.transport.connect(key, addr, defer_to_peer_ms=defer_ms)

    def _publish_gang_peers(self, job_id: bytes, gang) -> str:
        """Write a rank's peers where its workload reads them (GA5), whole or not at all."""
        path = os.path.join(self.runner.workdir(job_id), GANG_PEERS_FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="ascii") as fh:
            fh.write(format_peers(gang, self.member_host))
        os.replace(path + ".tmp", path)
        return path

    def member_host(self, key: bytes) -> str:
        """The host part of a member's first address (a gang's peer, SPEC.md GA5)."""
        record = next((m for m in self.core.member_records() if m.public_key == key), None)
        return multiaddr_host(record.addrs[0]) if record is not None and record.addrs else "127.0.0.1"

    # --- the loops -----------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        incoming = self.transport.incoming
        unread: deque = deque()   # frames taken from the transport, heartbeats already stepped
        while True:
            if not unread:
                try:
                    await self._take(*await incoming.receive(), unread)
                except trio.EndOfChannel:
                    return
            await self._take_queued(incoming, unread)
            # The frames already queued are stepped before this task yields: the writers run
            # once after the whole batch, so answers to one peer leave in one write and the
            # scheduler passes once, not once per frame (issue 18). Bounded in frames and in
            # time, so the tick loop still runs between batches on a flooded node.
            batch_started_ms = now_ms()
            for _ in range(RECEIVE_BATCH_FRAMES):
                if not unread or now_ms() - batch_started_ms >= RECEIVE_BATCH_MS:
                    break
                sender, data = unread.popleft()
                await self._handle(self.core.step(data, now_ms(), sender), tick_sooner=False)
            # Once per batch, not per frame: the tick loop cannot run before this task
            # yields, and asking the core for its next deadline was 4-6% of a node's CPU.
            self._tick_sooner()
            flush_log()   # the batch's log lines, in one write (meshnode/node/logfile.py)
            # Backpressure: a batch fed while another drains only queues (protocol/drain.py),
            # so a starved node would read frames faster than it sends their answers, until
            # the drain's loop guard stops it (seen at n = 16 on 2 loaded cores). Frames left
            # unread wait in the transport's bounded queue, which drops and counts (SPEC 8).
            while self.drain.backlog() > RECEIVE_BACKLOG_BATCHES:
                await trio.sleep(BACKLOG_WAIT_MS / 1000)
            await trio.lowlevel.checkpoint()

    async def _take_queued(self, incoming, unread: deque) -> None:
        """Move the frames the transport holds into ``unread``, stepping heartbeats at once
        (SPEC.md F1c): a heartbeat read behind seconds of queued consensus frames made its
        sender look silent (issue 18, n = 16 with jobs in flight: frames 17-19 s old, and a
        suspicion storm the starved nodes then paid for too)."""
        while len(unread) < RECEIVE_UNREAD_MAX:
            try:
                sender, data = incoming.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            await self._take(sender, data, unread)

    def _take_heartbeat_where_read(self, sender: bytes, data: bytes) -> bool:
        """SPEC F1d: a heartbeat that only feeds the failure detector is taken in the transport's
        reader, not queued for this task: on an idle node the queue's wake-up, the decode
        through ``step`` and the drain of its empty Ready were most of a heartbeat's cost
        (issue 18). It cannot bring the next tick sooner (it only moves a last-heard time on)."""
        return is_heartbeat_frame(data) and self.core.take_heartbeat(data, now_ms(), sender)

    async def _take(self, sender: bytes, data: bytes, unread: deque) -> None:
        if is_heartbeat_frame(data):
            await self._handle(self.core.step(data, now_ms(), sender), tick_sooner=False)  # asked after the batch
        else:
            unread.append((sender, data))

    async def _tick_loop(self) -> None:
        """Tick when the core has work (MeshCore.next_tick_ms), at most every TICK_MS and at
        least every MAX_TICK_GAP_MS: an idle node wakes for its heartbeats, not 200 times a
        second. Any other input may bring the next tick forward (_tick_sooner)."""
        while True:
            await self._handle(self.core.tick(now_ms()))
            self._tell_transport_members()
            with trio.move_on_after(self._tick_wait_ms() / 1000) as wait:
                self._tick_wait = wait
                await trio.sleep_forever()
            self._tick_wait = None

    def _tick_wait_ms(self) -> int:
        now = now_ms()
        return min(max(self.core.next_tick_ms(now) - now, TICK_MS), MAX_TICK_GAP_MS)

    def _tick_sooner(self) -> None:
        """After an input: the core may now have work sooner than the tick loop sleeps for
        (a consensus instance opened, a suspicion arrived)."""
        wait = self._tick_wait
        if wait is not None and wait.deadline > trio.current_time() + TICK_MS / 1000:   # else it cannot be sooner
            wait.deadline = min(wait.deadline, trio.current_time() + self._tick_wait_ms() / 1000)

    def _tell_transport_members(self) -> None:
        """Members pass the transport's limits on non-members; it learns them anew at
        each epoch (joins and evictions change them)."""
        if self._members_told_epoch != self.core.epoch:
            self._members_told_epoch = self.core.epoch
            self.transport.set_members(frozenset(m.public_key for m in self.core.member_records()))

    def _report_refusals(self) -> None:
        """Say in the log and the event stream that peers' traffic is being refused, by
        reason, at most once per REFUSAL_REPORT_MS (SPEC.md 8): under attack the
        counters in `status` grow, and this is what an operator watching sees."""
        counters = dict(self.core.counters)
        counters.update(self.transport.counters)
        grown = self._refusals.poll(counters, now_ms())
        if grown is None:
            return
        log.warning("refused or dropped peer traffic since the last report: %s",
                    " ".join("%s=%d" % item for item in sorted(grown.items())))
        self.events.publish(Event("peer_traffic_refused", now_ms(),
                                  {"counts": grown, "interval_ms": REFUSAL_REPORT_MS, "mono_ns": time.monotonic_ns()}))

    async def _telemetry_loop(self) -> None:
        while True:
            try:
                gpus, fault = await self._sample_gpus(), ""
            except TelemetryError as exc:
                # A lost GPU must not stop the node (its peers would evict it, and its jobs
                # without GPUs could still run): the core keeps the last good readings and
                # declines GPU jobs `node_unhealthy` until a reading succeeds (SPEC.md 10.3).
                gpus, fault = (), str(exc)
                self._log_telemetry_error(fault)
            rtts = [r for r in (self.transport.rtt_us(k) for k in self.transport.peers()) if r is not None]
            rtt_us = sum(rtts) // len(rtts) if rtts else 0
            await self._handle(self.core.update_telemetry(gpus, rtt_us, now_ms(),
                                                          simulated=self.telemetry.simulated, fault=fault,
                                                          job_signals=self._job_signals()))
            self._report_refusals()
            # Every 100 ms while a job with reflex rules runs here (SPEC.md P1b), else every second.
            await trio.sleep(self.core.capability.reading_period_ms(TELEMETRY_MS) / 1000)

    async def _sample_gpus(self) -> tuple:
        """Real GPUs are read in a worker thread: on an H100 under load an NVML read took
        p99 13.8 ms and up to 44 ms (BENCHMARKS.md, `bench telemetry`), which in this loop
        would delay heartbeats and ticks. The simulated profile is cheap and stays in the
        loop, so MockClock tests keep their exact schedule."""
        if self.telemetry.simulated:
            return self.telemetry.sample(now_ms())
        return await trio.to_thread.run_sync(self.telemetry.sample, now_ms())

    def _log_telemetry_error(self, fault: str) -> None:
        """At most one warning per TELEMETRY_ERROR_LOG_MS, with the count since the last:
        a GPU gone for a day would otherwise write a line every second. The core's events
        `telemetry_failed` / `telemetry_recovered` mark each outage's start and end."""
        self.telemetry_errors += 1
        now = now_ms()
        if self._telemetry_error_logged_ms is None or now - self._telemetry_error_logged_ms >= TELEMETRY_ERROR_LOG_MS:
            log.warning("GPU telemetry failed (%d times since the last warning): %s",
                        self.telemetry_errors - self._telemetry_errors_logged, fault)
            self._telemetry_error_logged_ms = now
            self._telemetry_errors_logged = self.telemetry_errors

    # --- the Ready contract --------------------------------------------------------------------

    async def _handle(self, ready: Ready, tick_sooner: bool = True) -> None:
        """Every Ready goes through the one drain (protocol/drain.py): a batch fed while
        another is being drained (a started workload's report) waits its turn.
        ``tick_sooner=False``: the caller (the receive loop) asks after its batch."""
        await self.drain.drain_async(ready)
        if tick_sooner:
            self._tick_sooner()
            flush_log()   # the receive loop flushes after its batch

    async def _persist(self, ready: Ready) -> None:
        # 1. persist before sending: the messages may promise what the records say.
        for record in ready.persist:
            if record.table == "checkpoints":
                self._store_checkpoint(record.value)
        other = [r for r in ready.persist if r.table != "checkpoints"]
        certified = [d for d in ready.decisions if d.certificate]  # local orders and notices carry none
        self.store.record_ready(Ready(persist=other, decisions=certified, events=ready.events))

    async def _send(self, messages: list) -> None:
        # 2. send (best effort; the protocol tolerates loss). Queued without yielding: the
        # transport's writer for each peer then sends all of them in one write.
        send = self.transport.send_nowait
        for outbound in messages:
            if outbound.to is None:
                for key in self.core.broadcast_targets():
                    send(key, outbound.data)
            elif outbound.to != self.identity.public_key:
                send(outbound.to, outbound.data)

    async def _publish(self, events: list) -> None:
        # 4. log and publish events.
        self.metrics.observe_events(events)
        mono_ns = time.monotonic_ns()  # system-wide on Linux: benchmarks compare across processes
        logged = log.isEnabledFor(logging.INFO)   # else the line is not formatted at all
        for event in events:
            detail = dict(event.detail, mono_ns=mono_ns)
            if logged:
                log.info("%s %s", event.kind, _loggable(event.detail))
            self.events.publish(Event(event.kind, event.at_ms, detail))

    def _store_checkpoint(self, value: dict) -> None:
        record = StoredCheckpoint(job_id=value["job_id"], fence=value["fence"], seq=value["seq"],
                                  progress=value["progress"], taken_ms=value["taken_ms"], state=value["state"],
                                  state_hash=value["state_hash"], origin=value["origin"], stored_ms=wall_ms())
        latency = record.stored_ms - record.taken_ms
        if record.origin == self.identity.public_key:
            self.checkpoint_write_ms.append(latency)
        else:
            self.checkpoint_replication_ms.append(latency)
        if not self.checkpoints.put(record):
            log.info("checkpoint %s seq %d refused by the local store (stale fence or seq)",
                     record.job_id.hex()[:12], record.seq)

    async def _apply(self, decision: Decision) -> None:
        """3. The core's workload orders ("stop", then "run": protocol/workload_orders.py),
        executed as given. Certified decisions need nothing more here: whatever they change
        about this node's workloads comes as orders in the same batch."""
        self.metrics.observe_decision(decision)
        kind = decision.value_kind
        if kind == "stop":
            for job_id in decision.value:
                await self._stop_workload(job_id, "ordered by the core", hand_over=True)
        elif kind == "run":
            for run in decision.value:
                await self._start_workload(run)
        elif kind == "gang_peers":   # a rank moved: the others rebuild their ring with it (GA5)
            for job_id, gang in decision.value:
                self._publish_gang_peers(job_id, gang)
        elif kind == "halt":
            # The core saw this node stall past the detection bound (SPEC.md F3): its workloads
            # may already run elsewhere, so none may work on; they are frozen, not killed (F3b).
            self.holding = True
            await self._freeze_all()
        elif kind == "resume":
            self.holding = False
            # F3: not evicted after all. The jobs it may run again get run orders (same
            # fence: thawed); a frozen one it may not (cancelled meanwhile) is stopped.
            for job_id in [j for j in self.frozen_fences if j not in decision.value]:
                await self._stop_workload(job_id, "not resumed after the halt")
        elif kind == "eviction" and decision.value.node == self.identity.public_key:
            # This node was evicted: its workloads may already run elsewhere. Its stop orders
            # cover the jobs it ordered; anything else the runner still runs stops too.
            self.holding = False
            await self._stop_all("this node was evicted (epoch %d)" % decision.value.epoch)

    # --- workloads -------------------------------------------------------------------------------

    async def _start_workload(self, run: WorkloadRun) -> None:
        job_id, fence, manifest = run.job_id, run.fence, run.manifest
        if await self._thawed(run):
            return
        if not self.run_workloads or job_id in self.runner.running():
            return
        restore = None
        latest = self.checkpoints.latest(job_id) if run.resume or not run.replica else None
        # F3: a checkpoint under this very fence is of this run, so always of its work: after a
        # restart the core has forgotten the checkpoints it held (R1 "Resume"), and a placed
        # attempt above 0 was restarted from progress 0 (`meshnode sim ... --seed 33`).
        if latest is not None and (run.resume or latest.fence == fence):
            restore = (latest.state, latest.progress, latest.seq)
        if not run.replica:   # a further replica keeps no checkpoints (SPEC.md R4e)
            self.checkpoints.raise_fence(job_id, fence)
        args = [arg.replace("{workdir}", self.runner.workdir(job_id)) for arg in manifest.args]
        try:
            extra_env = {**gang_environment(run.gang, self.member_host),
                         **replica_environment(run, self.member_host(self.identity.public_key))}
            if run.gang is not None:
                extra_env[GANG_PEERS_FILE_ENV] = self._publish_gang_peers(job_id, run.gang)
            pid = await self.runner.start(job_id, manifest.entrypoint, args, list(run.gpus), restore, fence,
                                          extra_env)
        except MeshError as exc:
            log.warning("cannot start job %s: %s", job_id.hex()[:12], exc)
            await self._handle(self.core.job_exited(job_id, 127, now_ms()))
            return
        if not run.replica:   # its checkpoints go to the core; a replica's are not taken
            self.job_fences[job_id] = fence
        for gpu in run.gpus:
            self.telemetry.set_load(gpu, 90_000, manifest.resources.gpu_mem_mib)
        await self._handle(self.core.workload_started(job_id, fence, restore[2] if restore else 0, now_ms()))
        log.info("started job %s pid %d fence %d from %s", job_id.hex()[:12], pid, fence,
                 "checkpoint seq %d" % restore[2] if restore else "scratch")
        flush_log()   # at once: `bench failover` reads workload starts from the log of a node it kills

    async def _stop_workload(self, job_id: bytes, why: str, hand_over: bool = False) -> None:
        """``hand_over``: the core ordered the stop; if a move took the job away (SPEC.md R2),
        the core sends the run's final checkpoint, read as it stopped, to the new primary.
        A job frozen by a halt stays frozen until the halt's resume (F3b)."""
        if job_id in self.frozen_fences:
            if self.holding:
                return
            del self.frozen_fences[job_id]
        fence, final = self.job_fences.pop(job_id, None), None
        if job_id in self.runner.running():
            if hand_over:
                final = await self.runner.stop_for_handover(job_id)
            else:
                await self.runner.stop(job_id)
            log.info("stopped job %s: %s", job_id.hex()[:12], why)
        if hand_over:   # R2a: the new primary starts once this says the run stopped (fence None: none ran here)
            await self._handle(self.core.hand_over_moved(job_id, fence, final, now_ms()))

    async def _stop_all(self, why: str) -> None:
        for job_id in list(self.runner.running()):
            await self._stop_workload(job_id, why)

    def _job_signals(self) -> tuple:
        """The fresh load reports of the jobs this node runs (SPEC.md 9.4a, R3a)."""
        if self.runner is None:
            return ()
        fresh = self.runner.fresh_signals(SIGNALS_FRESH_MS / 1000)
        return tuple(JobSignals(job_id=job_id, request_rate_milli=rate, latency_p99_us=p99,
                                progress_rate_milli=progress)
                     for job_id, (rate, p99, progress) in sorted(fresh.items()) if job_id in self.job_fences)

    async def _freeze_all(self) -> None:
        """SPEC.md F3b: freeze every workload of a halted node, to thaw it if the halt ends with
        the same job here under the same fence. A runner that cannot freeze (the simulator's)
        stops them, as a halt did before."""
        freeze = getattr(self.runner, "freeze", None)
        for job_id in list(self.runner.running()):
            fence = self.job_fences.get(job_id)
            if freeze is not None and fence is not None and freeze(job_id):
                self.frozen_fences[job_id] = self.job_fences.pop(job_id)   # its checkpoints are not taken
                log.info("froze job %s: halted (self-fencing check)", job_id.hex()[:12])
            else:
                await self._stop_workload(job_id, "halted (self-fencing check)")

    async def _thawed(self, run: WorkloadRun) -> bool:
        """A run order for a job a halt froze: under its fence, the frozen process goes on (the
        healthy worker is not restarted; a gang's rank is told where its peers are now, GA5);
        under another, it is stopped and the order runs."""
        job_id, fence = run.job_id, run.fence
        held = self.frozen_fences.pop(job_id, None)
        if held is None:
            return False
        if held == fence and self.runner.thaw(job_id):
            self.job_fences[job_id] = fence
            if run.gang is not None:
                self._publish_gang_peers(job_id, run.gang)
            seq = self.runner.running()[job_id]["seq"]
            log.info("thawed job %s fence %d at checkpoint seq %d", job_id.hex()[:12], fence, seq)
            await self._handle(self.core.workload_started(job_id, fence, seq, now_ms()))
            return True
        await self.runner.stop(job_id)
        log.info("stopped job %s: frozen under fence %d, now ordered under %d", job_id.hex()[:12], held, fence)
        return False

    async def _on_checkpoint(self, job_id: bytes, seq: int, progress: int, taken_ms: int, state: bytes) -> None:
        if job_id not in self.job_fences:
            return
        # The core's Ready persists this checkpoint (the store's fencing rule applies there)
        # before it is sent to the backups.
        try:
            ready = self.core.local_checkpoint(job_id, seq, progress, taken_ms, state, now_ms())
        except LocalProtocolError as exc:
            # The core no longer sees us as this job's primary: we were fenced, or a move took
            # the job away (its final checkpoint, this state included, is handed over, R2).
            log.warning("job %s fenced: %s", job_id.hex()[:12], exc)
            await self._stop_workload(job_id, "fenced", hand_over=True)
            return
        await self._handle(ready)

    async def _on_exit(self, job_id: bytes, exit_code: int) -> None:
        self.job_fences.pop(job_id, None)
        self.frozen_fences.pop(job_id, None)
        await self._handle(self.core.job_exited(job_id, exit_code, now_ms()))

    # --- control API entry points ---------------------------------------------------------

    def _refuse_if_evicted(self) -> None:
        core = self.core
        if core.evicted_at_epoch is not None and not core.is_member():
            raise MeshError("this node was evicted at epoch %d; it asks to rejoin by itself, or rejoin with "
                            "`meshnode join`" % core.evicted_at_epoch)

    async def submit(self, job_envelope: bytes) -> bytes:
        self._refuse_if_evicted()
        # With the core's caches: its own decode of these bytes is then a hit, not a second
        # signature check (issue 18: every submit verified the owner's signature twice).
        envelope, job = decode_message(job_envelope, self.genesis.mesh_id, JobManifest, allow_any_mesh=True,
                                       caches=self.core.ctx.caches)
        await self._handle(self.core.submit(job_envelope, now_ms(), self.config.max_undecided_submits))
        return compute_job_id(job)

    async def move(self, request: bytes) -> bytes:
        """An owner-signed MoveRequest (SPEC.md R2): refused with its reason, or on its way."""
        self._refuse_if_evicted()
        job_id, ready = self.core.request_move(request, now_ms())
        await self._handle(ready)
        return job_id

    async def cancel(self, request: bytes) -> bytes:
        self._refuse_if_evicted()
        job_id, ready = self.core.cancel(request, now_ms())
        await self._handle(ready)
        return job_id

    async def join(self, bootstrap_key: bytes, addr: str) -> dict:
        """Ask the mesh, through ``bootstrap_key``, to admit this node (SPEC.md F7)."""
        await self.transport.connect(bootstrap_key, addr)
        await self._handle(self.core.request_join(bootstrap_key, now_ms()))
        return {"requested": True, "bootstrap": bootstrap_key.hex(), "epoch": self.core.epoch}

    def close(self) -> None:
        self.telemetry.close()
        self.store.close()
        self.checkpoints.close()


def _passphrase_source(config, data_dir) -> PassphraseSource:
    if config.passphrase.kind == "insecure":
        return None
    return PassphraseSource.literal(node_config.read_passphrase(config, data_dir))


def _libp2p_factory(seed: bytes, listen: list[str]):
    from meshnode.net.libp2p_transport import open_libp2p_transport  # libp2p import costs 0.6 s
    return open_libp2p_transport(seed, listen)


def _loggable(detail: dict) -> str:
    return " ".join("%s=%s" % (k, v.hex()[:12] if isinstance(v, bytes) else v) for k, v in detail.items())


def _freeze_startup_heap() -> None:
    """Move everything allocated so far (libp2p's 1300+ modules, the genesis, replayed
    history) out of the garbage collector's view. Measured on a testnet node without
    this: full collections took 60-146 ms, long enough to skip checkpoint pulls and to
    make peers see a 150 ms pause as a 300 ms silence."""
    gc.collect()
    gc.freeze()


async def run_node(data_dir, *, run_workloads: bool = True, on_started=None) -> None:
    """``meshnode run``: until SIGINT/SIGTERM, then a clean shutdown (state is already persisted).
    ``on_started(node)`` runs once the node is up (`meshnode dev` prints how to use it)."""
    lock = DirectoryLock(data_dir)
    if Path(data_dir).is_dir():   # a missing directory gets Node's own one-line error
        lock.acquire()
    try:
        await _run_locked_node(data_dir, run_workloads, on_started)
    except BaseExceptionGroup as group:
        # A start-up error we raise on purpose (a busy metrics port, say) reaches us wrapped
        # in the nurseries' groups; alone, it is the one line the CLI prints (exit 2).
        error = _only_mesh_error(group)
        if error is None:
            raise
        raise error from None
    finally:
        lock.release()


def _only_mesh_error(group: BaseExceptionGroup) -> MeshError | None:
    leaves = []
    stack = [group]
    while stack:
        item = stack.pop()
        if isinstance(item, BaseExceptionGroup):
            stack.extend(item.exceptions)
        else:
            leaves.append(item)
    return leaves[0] if len(leaves) == 1 and isinstance(leaves[0], MeshError) else None


async def _run_locked_node(data_dir, run_workloads: bool, on_started) -> None:
    node = Node(data_dir, run_workloads=run_workloads)
    setup_logging(node.paths.log, node.config.log_level)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.run)
                if on_started is not None:
                    on_started(node)

                async def stop_on_signal():
                    async for signum in signals:
                        log.info("signal %d: shutting down", signum)
                        nursery.cancel_scope.cancel()
                        return
                nursery.start_soon(stop_on_signal)
    finally:
        node.close()
        try:
            os.unlink(node.paths.control_socket)
        except FileNotFoundError:
            pass

