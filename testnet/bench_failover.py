"""Failure detection, recovery and lost work under kill -9 (DESIGN.md "What is measured").

``run_failover_bench`` starts a testnet WITH workloads, submits ``counter`` jobs
(backups >= 1, 1 ms units, a progress log per node in the job's workdir), then K times:

1. waits until a job runs on a live primary that has taken checkpoints;
2. sleeps a seeded random 0..``KILL_PHASE_MS`` (a random moment relative to the
   checkpoint cycle) and SIGKILLs the primary's node process;
3. detection_ms: kill -> the first suspicion / eviction-start event any survivor
   publishes about the killed node (``mono_ns`` stamps, one system-wide clock);
4. recovery_ms: kill -> the job's workload started on a survivor (its "started"
   event; without one, the first progress line the new run logs);
5. lost_work_ms: from the progress logs alone (testnet/bench_stats.lost_work), never
   from the checkpoint path being measured;
6. restarts the killed node, so the mesh keeps N nodes. The node learns of its eviction
   from its peers and asks to rejoin by itself (SPEC.md F7); only if it is still not a
   member after AUTO_REJOIN_GRACE_S does the bench ask it through `meshnode join`.
   The next kill comes no sooner than SETTLE_AFTER_RESTART_S after that: one failure
   at a time. (Killing a primary while the previous victim boots and rejoins measures a
   double fault on this 2-core host: the booting process starves the others' event
   loops, checkpoints stop reaching the backups, and lost work reached 270 ms.)

The checkpoint path is measured too (``checkpoint``): every node keeps its newest
``stored_ms - taken_ms`` latencies, as primary (slot read to local store: ``write_ms``)
and as backup (+ signing, libp2p and the backup's store: ``replication_ms``), and the
tick jitter of the workloads it runs; the bench reads them (op ``checkpoint_stats``)
once per node process, right before killing it or at the end.

Double runs are counted two ways: a /proc sampler that sees two live workload
processes of one job at once, and progress logs of one job on two nodes that overlap
in time. The testnet is always torn down (try/finally, Ctrl-C included).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import trio

from meshnode.control.client import AsyncControlClient, ControlError
from protocol.errors import MeshError
from testnet import launcher
from testnet.bench_consensus import sign_jobs, subscribe
from testnet.bench_stats import (lost_work, machine_info, overlapping_runs, parse_progress_log, parse_workload_starts,
                                 stale_fence_starts, summary_ms)

UNIT_MS = 1
KILL_PHASE_MS = 500          # the kill lands uniformly in this window after the job is ready
READY_TIMEOUT_S = 30.0       # job running with checkpoints on a live primary
RECOVERY_TIMEOUT_S = 10.0    # longer than this and the workload counts as lost
REJOIN_TIMEOUT_S = 60.0
AUTO_REJOIN_GRACE_S = 5.0    # the restarted node rejoins by itself; after this the bench asks it
SETTLE_AFTER_RESTART_S = 2.0
POLL_S = 0.02
PROC_SAMPLE_S = 0.25
OVERLAP_TOLERANCE_US = 10_000
MAX_EVENTS = 200_000
MAX_KILLS = 1000
PROGRESS_LOG = "{{workdir}}/progress.log"  # doubled braces: the manifest text goes through str.format

# Event kinds, as published by protocol/mesh.py (see its module docstring).
DETECTION_KINDS = frozenset({"suspected", "suspicion", "suspect", "eviction_started", "emergency_started",
                             "evicting"})
STARTED_KINDS = frozenset({"workload_started", "started", "job_started"})

# What every benchmark job asks (bench gang's too): no GPU, a tenth of a CPU, retries to spare.
BENCH_JOB_TERMS = """strategy = "throughput"
max_retries = 16
nonce = {nonce}
[resources]
gpus = 0
cpu_milli = 100
mem_mib = 64
"""
FAILOVER_MANIFEST = """
name = "bench-failover"
entrypoint = "counter"
args = ["--unit-ms", "%d", "--progress-log", "%s"]
backups = 2
""" % (UNIT_MS, PROGRESS_LOG) + BENCH_JOB_TERMS


class EventLog:
    """Events from every node since the current kill's cycle began (bounded)."""

    def __init__(self):
        self.events: list[tuple[int, dict]] = []
        self.dropped = 0
        self._changed = trio.Event()

    def on_event(self, index: int, event: dict) -> None:
        if len(self.events) >= MAX_EVENTS:
            self.dropped += 1
            return
        self.events.append((index, event))
        self._changed.set()
        self._changed = trio.Event()

    def clear(self) -> None:
        self.events.clear()

    async def first(self, predicate, timeout_s: float):
        """The first logged (index, event) with ``predicate`` true, waiting up to ``timeout_s``."""
        checked = 0
        with trio.move_on_after(timeout_s):
            while True:
                for item in self.events[checked:]:
                    if predicate(*item):
                        return item
                checked = len(self.events)
                await self._changed.wait()
        return None


def _detail_names(detail: dict, key_hex: str, fields) -> bool:
    """Whether any of ``fields`` in ``detail`` names ``key_hex`` (full or abbreviated hex)."""
    return any(isinstance(detail.get(f), str) and detail[f] and key_hex.startswith(detail[f]) for f in fields)


def workload_processes(root: Path) -> dict[str, list[int]]:
    """Live counter workload processes of this testnet, by job id hex (their workdir's name)."""
    found: dict[str, list[int]] = {}
    for pid in launcher.testnet_processes(root):
        try:
            cmdline = Path("/proc/%d/cmdline" % pid).read_bytes()
            cwd = os.readlink("/proc/%d/cwd" % pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if b"meshnode.workload.builtin" in cmdline:
            found.setdefault(os.path.basename(cwd), []).append(pid)
    return found


async def sample_double_runs(root: Path, found: set) -> None:
    """Forever: add to ``found`` each job with two live workload processes at once."""
    while True:
        for job_hex, pids in (await trio.to_thread.run_sync(workload_processes, root)).items():
            if len(pids) > 1:
                found.add(job_hex)
        await trio.sleep(PROC_SAMPLE_S)


def read_progress(layout: dict, job_hex: str) -> dict:
    logs = {}
    for node in layout["nodes"]:
        path = Path(node["dir"]) / "workloads" / job_hex / "progress.log"
        try:
            logs[node["index"]] = parse_progress_log(path.read_text(errors="replace"))
        except FileNotFoundError:
            continue
    return logs


class FailoverRun:
    # What a kill waits for (one_kill), and the abort that says it never came.
    not_ready, ready_timeout_s = "the job was not running with checkpoints on a live primary", READY_TIMEOUT_S

    def __init__(self, root: Path, layout: dict, jobs: list[tuple[bytes, bytes]], rng: random.Random):
        self.root = root
        self.layout = layout
        self.jobs = jobs
        self.rng = rng
        self.index_of = {n["public_key"]: n["index"] for n in layout["nodes"]}
        self.events = EventLog()
        self.kills: list[dict] = []
        self.proc_double_runs: set[str] = set()
        self.rejoin_failures = 0
        self.rejoins_asked = 0
        self.not_reconnected: list[dict] = []
        self.aborted: str | None = None
        # Checkpoint-path samples (op checkpoint_stats), read once per node process: right
        # before it is killed, or at the end from the survivors, so none is counted twice.
        self.checkpoint_samples: dict[str, list[int]] = {"write_ms": [], "replication_ms": [],
                                                         "interval_error_us": []}

    def _alive(self) -> list[int]:
        layout = launcher.load_layout(self.root)
        return [n["index"] for n in layout["nodes"] if launcher.process_state(n.get("pid")) == "running"]

    async def _call(self, index: int, op: str, **args):
        async with AsyncControlClient(self.layout["nodes"][index]["dir"], timeout_s=None) as client:
            return await client.call(op, **args)

    async def _collect_checkpoint_stats(self, index: int) -> None:
        try:
            stats = await self._call(index, "checkpoint_stats")
        except (ControlError, MeshError, OSError):
            return  # a node that cannot answer has no samples to give
        for name, samples in self.checkpoint_samples.items():
            samples.extend(stats.get(name, ()))

    async def _subscribe(self, nursery, index: int) -> None:
        async def follow(task_status=trio.TASK_STATUS_IGNORED):
            try:
                await subscribe(self.layout["nodes"][index]["dir"], index, self.events.on_event,
                                task_status=task_status)
            except (ControlError, MeshError, trio.BrokenResourceError, OSError):
                pass  # the node died (we killed it); it is re-subscribed after its restart
        await nursery.start(follow)

    async def _proc_sampler(self) -> None:
        await sample_double_runs(self.root, self.proc_double_runs)

    async def _job_row(self, index: int, job_hex: str) -> dict | None:
        try:
            rows = (await self._call(index, "jobs"))["jobs"]
        except (ControlError, MeshError, OSError):
            return None
        return next((r for r in rows if r["job_id"] == job_hex), None)

    async def _wait_job_ready(self, job_hex: str) -> int:
        """The index of a live primary running ``job_hex`` with at least one checkpoint taken.

        Every live node is asked and the view with the highest fence wins: a node that
        was evicted (or just restarted) may still hold an old view of the job."""
        with trio.fail_after(READY_TIMEOUT_S):
            while True:
                alive = self._alive()
                rows = [r for r in [await self._job_row(i, job_hex) for i in alive] if r is not None]
                row = max(rows, key=lambda r: r["fence"], default=None)
                primary = self.index_of.get(row["primary"]) if row and row["primary"] else None
                if primary in alive:  # only the primary and its backups see the job "running"
                    own = await self._job_row(primary, job_hex)
                    if (own and own["state"] == "running" and own["fence"] == row["fence"]
                            and own["checkpoint_seq"] is not None and own["checkpoint_age_ms"] < 1000):
                        return primary
                await trio.sleep(POLL_S * 5)

    async def one_kill(self, nursery, number: int) -> None:
        job_id, _ = self.jobs[number % len(self.jobs)]
        job_hex = job_id.hex()
        primary = await self._wait_job_ready(job_hex)
        victim_key = self.layout["nodes"][primary]["public_key"]
        await self._collect_checkpoint_stats(primary)
        self.events.clear()
        await trio.sleep(self.rng.uniform(0, KILL_PHASE_MS / 1000))
        kill_mono_ns, kill_wall_us = time.monotonic_ns(), time.time_ns() // 1000
        launcher.signal_node(self.root, primary, signal.SIGKILL)
        record = {"kill": number, "job": job_hex[:12], "node": primary}

        def detection(index, event):
            detail = event.get("detail", {})
            return (index != primary and event.get("kind") in DETECTION_KINDS
                    and detail.get("mono_ns", 0) >= kill_mono_ns
                    and (_detail_names(detail, victim_key, ("suspect", "node", "peer", "key"))
                         or not any(f in detail for f in ("suspect", "node", "peer", "key"))))

        def started(index, event):
            detail = event.get("detail", {})
            return (index != primary and event.get("kind") in STARTED_KINDS
                    and detail.get("mono_ns", 0) >= kill_mono_ns
                    and _detail_names(detail, job_hex, ("job_id", "job", "instance")))

        found = await self.events.first(detection, RECOVERY_TIMEOUT_S)
        record["detection_ms"] = None if found is None else (found[1]["detail"]["mono_ns"] - kill_mono_ns) / 1e6
        record["detected_by"] = None if found is None else "%s@%d" % (found[1]["kind"], found[0])
        found = await self.events.first(started, RECOVERY_TIMEOUT_S)
        record["successor"] = None if found is None else found[0]
        record["recovery_ms"] = None if found is None else (found[1]["detail"]["mono_ns"] - kill_mono_ns) / 1e6
        await self._measure_lost_work(job_hex, primary, kill_wall_us, record)
        self.kills.append(record)
        await self._restart(nursery, primary)
        await trio.sleep(SETTLE_AFTER_RESTART_S)

    async def _measure_lost_work(self, job_hex: str, primary: int, kill_wall_us: int, record: dict) -> None:
        """Wait for the resumed run's first progress line, then read every node's log."""
        deadline = trio.current_time() + RECOVERY_TIMEOUT_S
        while trio.current_time() < deadline:
            logs = await trio.to_thread.run_sync(read_progress, self.layout, job_hex)
            successors = [i for i, lines in logs.items()
                          if i != primary and lines and lines[-1].wall_us > kill_wall_us]
            if record["successor"] is not None and record["successor"] not in successors:
                successors = []
            if successors:
                successor = successors[0]
                lost = lost_work(logs, primary, kill_wall_us, successor, UNIT_MS)
                if lost is not None:
                    record["successor"] = successor
                    resumed_us = next(l.wall_us for l in logs[successor] if l.wall_us > kill_wall_us)
                    record["first_progress_ms"] = (resumed_us - kill_wall_us) / 1000
                    record["lost_work_ms"] = lost.lost_ms
                    record["lost_units"] = lost.lost_units
                    record["restored_unit"] = lost.restored_unit
                    return
            await trio.sleep(POLL_S * 5)
        record["lost_workload"] = True

    async def _restart(self, nursery, index: int) -> None:
        """Start the killed node again and wait until it is connected and a member (again)."""
        while launcher.process_alive(launcher.load_layout(self.root)["nodes"][index]["pid"]):
            await trio.sleep(0.01)
        launcher.start_node(self.root, index)
        alive = self._alive()
        try:
            await trio.to_thread.run_sync(lambda: launcher.wait_ready(self.root, REJOIN_TIMEOUT_S, indices=alive))
        except MeshError as exc:  # recorded; the membership wait below decides whether it counts
            self.not_reconnected.append({"node": index, "error": str(exc)[:500]})
        await self._subscribe(nursery, index)
        started = trio.current_time()
        with trio.move_on_after(REJOIN_TIMEOUT_S) as scope:
            asked = False
            while True:
                status = await self._call(index, "status")
                # A restarted node first syncs: "member" alone may still be its stale view.
                if status["member"] and not status.get("halted"):
                    break
                if not asked and trio.current_time() - started > AUTO_REJOIN_GRACE_S and not status["member"]:
                    others = [i for i in alive if i != index]
                    entry = self.layout["nodes"][others[0]]
                    await self._call(index, "join", bootstrap=launcher.bootstrap_multiaddr(entry))
                    self.rejoins_asked += 1
                    asked = True
                await trio.sleep(0.1)
        if scope.cancelled_caught:
            self.rejoin_failures += 1

    async def watch_and_submit(self, nursery: trio.Nursery) -> None:
        """Subscribe to every node's events, start the /proc sampler, submit the jobs."""
        for node in self.layout["nodes"]:
            await self._subscribe(nursery, node["index"])
        nursery.start_soon(self._proc_sampler)
        for k, (_, envelope) in enumerate(self.jobs):
            await self._call(k % len(self.layout["nodes"]), "submit", job=envelope)

    async def run(self, kills: int) -> None:
        async with trio.open_nursery() as nursery:
            await self.watch_and_submit(nursery)
            for number in range(kills):
                try:
                    await self.one_kill(nursery, number)
                except trio.TooSlowError:
                    self.aborted = "kill %d: %s within %d s" % (number, self.not_ready, self.ready_timeout_s)
                    break
            for index in self._alive():
                await self._collect_checkpoint_stats(index)
            nursery.cancel_scope.cancel()

    def double_runs_from_logs(self) -> int:
        pairs = 0
        for job_id, _ in self.jobs:
            pairs += len(overlapping_runs(read_progress(self.layout, job_id.hex()), OVERLAP_TOLERANCE_US))
        return pairs

    def stale_fence_starts(self) -> list[dict]:
        """Workload starts under a fence another node had already superseded (node logs)."""
        starts = []
        for node in self.layout["nodes"]:
            try:
                text = (Path(node["dir"]) / "node.log").read_text(errors="replace")
            except FileNotFoundError:
                continue
            starts += parse_workload_starts(node["index"], text)
        return [{"at": s.at, "node": s.node, "job": s.job_hex[:12], "fence": s.fence}
                for s in stale_fence_starts(starts)]


def start_counter_testnet(root: Path, nodes: int, jobs: int, rng: random.Random,
                          manifest: str = FAILOVER_MANIFEST, loopback_hosts: bool = False) -> tuple[dict, list]:
    """Start a testnet that runs workloads and sign ``jobs`` counter jobs for it: (layout, jobs)."""
    launcher.up(root, nodes, owners=1, run_workloads=True, loopback_hosts=loopback_hosts)
    layout = launcher.load_layout(root)
    signed = sign_jobs(layout["owners"][0]["key_file"], bytes.fromhex(layout["mesh_id"]), jobs, rng,
                       manifest, time.time_ns() // 1_000_000)
    return layout, signed


def run_on_counter_testnet(root: Path, nodes: int, jobs: int, rng: random.Random, make_run, count: int,
                           keep: bool, manifest: str = FAILOVER_MANIFEST, loopback_hosts: bool = False) -> tuple:
    """Start a counter testnet, run ``make_run(root, layout, jobs, rng).run(count)`` on it and
    always tear it down: (the run, double runs in the progress logs, starts under a
    superseded fence). The directory is kept if the run aborted (its logs) or ``keep``."""
    failed, run = True, None
    log_double_runs, stale_starts = 0, []
    try:
        layout, signed = start_counter_testnet(root, nodes, jobs, rng, manifest, loopback_hosts)
        run = make_run(root, layout, signed, rng)
        trio.run(run.run, count)
        failed = run.aborted is not None  # keep the logs of an aborted run
    finally:
        if (root / launcher.LAYOUT_FILE).exists():
            launcher.down(root)
        if run is not None:
            log_double_runs = run.double_runs_from_logs()
            stale_starts = run.stale_fence_starts()
        if failed or keep:
            print("bench: testnet directory kept at %s" % root, file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return run, log_double_runs, stale_starts


def run_failover_bench(nodes: int, kills: int, *, jobs: int = 1, root=None, keep: bool = False,
                       seed: int | None = None) -> dict:
    if not 1 <= kills <= MAX_KILLS or not 1 <= jobs <= 16 or nodes < 3:
        raise MeshError("--kills must be 1..%d, --jobs 1..16, --nodes >= 3" % MAX_KILLS)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-failover-"))
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    run, log_double_runs, stale_starts = run_on_counter_testnet(root, nodes, jobs, rng, FailoverRun, kills, keep)
    per_kill = run.kills
    return {
        "bench": "failover", "nodes": nodes, "kills": len(per_kill), "jobs": jobs, "seed": seed,
        "unit_ms": UNIT_MS,
        "detection_ms": summary_ms(k["detection_ms"] for k in per_kill if k["detection_ms"] is not None),
        "recovery_ms": summary_ms(k["recovery_ms"] for k in per_kill if k["recovery_ms"] is not None),
        "first_progress_ms": summary_ms(k["first_progress_ms"] for k in per_kill if "first_progress_ms" in k),
        "lost_work_ms": summary_ms(k["lost_work_ms"] for k in per_kill if "lost_work_ms" in k),
        "checkpoint": {
            "write_ms": summary_ms(run.checkpoint_samples["write_ms"]),
            "replication_ms": summary_ms(run.checkpoint_samples["replication_ms"]),
            "interval_error_ms": summary_ms(e / 1000 for e in run.checkpoint_samples["interval_error_us"]),
        },
        "undetected": sum(1 for k in per_kill if k["detection_ms"] is None),
        "lost_workloads": sum(1 for k in per_kill if k.get("lost_workload")),
        "double_runs": len(run.proc_double_runs) + log_double_runs + len(stale_starts),
        "double_runs_proc": len(run.proc_double_runs), "double_runs_logs": log_double_runs,
        "stale_fence_starts": stale_starts, "aborted": run.aborted,
        "rejoin_failures": run.rejoin_failures, "rejoins_asked": run.rejoins_asked,
        "not_reconnected": run.not_reconnected, "events_dropped": run.events.dropped,
        "per_kill": per_kill, "machine": machine,
    }
