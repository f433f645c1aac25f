"""False evictions under pauses and CPU load (DESIGN.md "What is measured").

``run_soak_bench`` starts a testnet WITH workloads and ``jobs`` counter jobs, starts
``cpu_load`` busy-loop processes (they compete with the nodes for the cores; at nice
``cpu_load_nice``, by default the priority a node gives its own workloads), then for
``soak_s`` seconds repeatedly pauses a random node with SIGSTOP for ``pause_ms`` and
resumes it with SIGCONT, with a seeded random 0.3..1.0 s between pauses. A pause shorter
than the detection bound must never evict anyone (SPEC.md F2: a pause P is never
suspected while P + heartbeat_ms + delivery jitter < min_silence_ms).

Reported, from the event streams of every node (subscribed before the first pause):
``suspicions`` ("suspect" events), ``evictions`` (distinct eviction instances decided),
``self_fence_checks`` (a node that found its own ticks too far apart), the epochs the
nodes end in, and double runs (the failover bench's /proc sampler and progress logs).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from meshnode.control.client import ControlError
from meshnode.node.runner import WORKLOAD_NICE
from protocol.errors import MeshError
from testnet import launcher
from testnet.bench_failover import OVERLAP_TOLERANCE_US, FailoverRun, start_counter_testnet
from testnet.bench_stats import machine_info, summary_ms

GAP_MIN_S, GAP_MAX_S = 0.3, 1.0
MAX_SOAK_S = 3600
MAX_CPU_LOAD = 16
SETTLE_S = 2.0       # after the last pause: late suspicions and evictions still count


def start_cpu_burners(count: int, nice: int) -> list[subprocess.Popen]:
    """``count`` processes that spin on a core each until killed, at CPU priority ``nice``
    (WORKLOAD_NICE is how the node runs its own workloads; 0 competes as an equal)."""
    return [subprocess.Popen([sys.executable, "-c", "import os; os.nice(%d)\nwhile True: pass" % nice],
                             stdin=subprocess.DEVNULL, start_new_session=True) for _ in range(count)]


def stop_processes(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


class SoakRun(FailoverRun):
    """The failover bench's subscriptions, samplers and double-run checks, with pauses instead of kills."""

    def __init__(self, root: Path, layout: dict, jobs, rng: random.Random):
        super().__init__(root, layout, jobs, rng)
        self.pauses: list[dict] = []
        self.epochs: list[int] = []

    async def _pause(self, index: int, pause_ms: int) -> None:
        """SIGSTOP then SIGCONT; the SIGCONT is sent even when the run is cancelled."""
        stopped = time.monotonic()
        launcher.signal_node(self.root, index, signal.SIGSTOP)
        try:
            with trio.CancelScope(shield=True):
                await trio.sleep(pause_ms / 1000)
        finally:
            launcher.signal_node(self.root, index, signal.SIGCONT)
        self.pauses.append({"node": index, "paused_ms": round((time.monotonic() - stopped) * 1000, 3)})

    async def soak(self, soak_s: float, pause_ms: int) -> None:
        async with trio.open_nursery() as nursery:
            await self.watch_and_submit(nursery)
            for job_id, _ in self.jobs:
                await self._wait_job_ready(job_id.hex())
            self.events.clear()
            deadline = trio.current_time() + soak_s
            while trio.current_time() < deadline:
                await trio.sleep(self.rng.uniform(GAP_MIN_S, GAP_MAX_S))
                await self._pause(self.rng.randrange(len(self.layout["nodes"])), pause_ms)
            await trio.sleep(SETTLE_S)
            for node in self.layout["nodes"]:
                try:
                    self.epochs.append((await self._call(node["index"], "status"))["epoch"])
                except (ControlError, MeshError, OSError):
                    self.epochs.append(None)  # the node is gone: counted as its own finding
            nursery.cancel_scope.cancel()

    def counts(self) -> dict:
        events = [event for _index, event in self.events.events]
        evictions = {e["detail"].get("instance") for e in events
                     if e.get("kind") == "decided" and e["detail"].get("value_kind") == "eviction"}
        return {"suspicions": sum(1 for e in events if e.get("kind") == "suspect"),
                "evictions": len(evictions),
                "evicted_events": sum(1 for e in events if e.get("kind") == "evicted"),
                "self_fence_checks": sum(1 for e in events if e.get("kind") == "self_fence_check")}


def run_soak_bench(nodes: int, soak_s: float, pause_ms: int, cpu_load: int, *, jobs: int = 1, root=None,
                   keep: bool = False, seed: int | None = None, cpu_load_nice: int = WORKLOAD_NICE) -> dict:
    if not 1 <= soak_s <= MAX_SOAK_S or not 1 <= pause_ms <= 60_000 or not 0 <= cpu_load <= MAX_CPU_LOAD:
        raise MeshError("--soak-s must be 1..%d, --pause-ms 1..60000, --cpu-load 0..%d" % (MAX_SOAK_S, MAX_CPU_LOAD))
    if not 0 <= cpu_load_nice <= 19:
        raise MeshError("--cpu-load-nice must be 0..19")
    if nodes < 3 or not 1 <= jobs <= 16:
        raise MeshError("--nodes must be >= 3 and --jobs 1..16")
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-soak-"))
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    run, burners, failed = None, [], True
    log_double_runs = 0
    try:
        layout, signed = start_counter_testnet(root, nodes, jobs, rng)
        run = SoakRun(root, layout, signed, rng)
        burners = start_cpu_burners(cpu_load, cpu_load_nice)
        trio.run(run.soak, soak_s, pause_ms)
        failed = False
    finally:
        stop_processes(burners)
        if (root / launcher.LAYOUT_FILE).exists():
            launcher.down(root)
        if run is not None:
            log_double_runs = run.double_runs_from_logs()
        if failed or keep:
            print("bench: testnet directory kept at %s" % root, file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    counts = run.counts()
    return {
        "bench": "failover-soak", "nodes": nodes, "jobs": jobs, "seed": seed, "soak_s": soak_s,
        "pause_ms": pause_ms, "cpu_load": cpu_load, "cpu_load_nice": cpu_load_nice, "pauses": len(run.pauses),
        "paused_ms": summary_ms(p["paused_ms"] for p in run.pauses), **counts,
        "final_epochs": run.epochs, "double_runs": len(run.proc_double_runs) + log_double_runs,
        "double_runs_proc": len(run.proc_double_runs), "double_runs_logs": log_double_runs,
        "overlap_tolerance_us": OVERLAP_TOLERANCE_US, "events_dropped": run.events.dropped, "machine": machine,
    }
