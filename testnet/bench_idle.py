"""Idle cost of a mesh: CPU seconds per node process while nothing is submitted (DESIGN.md
"What is measured": idle CPU per node flat in n), and whether the idle mesh stays quiet.

``run_idle_bench`` starts a testnet of N real node processes (no workloads), waits until
every node is connected and WARMUP_S has passed (start-up syncs and dials settle), then
reads each node process's user + system CPU seconds from /proc at the start and the end
of ``seconds``. Every node's event stream is watched from the start for suspicions and
evictions: an idle mesh on a loaded host must show neither (SPEC.md F2, F4). The testnet
is always torn down (try/finally, Ctrl-C included).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import trio

from protocol.errors import MeshError
from protocol.monitors import MONITORS_PER_MEMBER
from testnet import launcher
from testnet.bench_consensus import process_cpu_s, subscribe, tear_down
from testnet.bench_stats import machine_info

WARMUP_S = 5.0
MAX_NODES = 64
MAX_SECONDS = 3600.0


class QuietWatch:
    """Counts what an idle mesh should never do: suspect or evict a member."""

    def __init__(self) -> None:
        self.suspicions = 0
        self.evictions: set = set()

    def on_event(self, index: int, event: dict) -> None:
        kind, detail = event.get("kind"), event.get("detail", {})
        if kind == "suspect":
            self.suspicions += 1
        elif kind == "decided" and detail.get("value_kind") == "eviction":
            self.evictions.add(detail.get("instance"))


def _loadavg() -> list[float]:
    with open("/proc/loadavg") as fh:
        return [float(x) for x in fh.read().split()[:3]]


async def measure_idle(layout: dict, seconds: float, warmup_s: float = WARMUP_S) -> dict:
    """CPU seconds each node process used over ``seconds`` of idling, after ``warmup_s``."""
    watch = QuietWatch()
    pids = [n.get("pid") for n in layout["nodes"]]
    async with trio.open_nursery() as nursery:
        for index, node in enumerate(layout["nodes"]):
            await nursery.start(subscribe, node["dir"], index, watch.on_event)
        await trio.sleep(warmup_s)
        load_before = _loadavg()
        before = [process_cpu_s(pid) for pid in pids]
        started = time.monotonic()
        await trio.sleep(seconds)
        after = [process_cpu_s(pid) for pid in pids]
        elapsed = time.monotonic() - started
        load_after = _loadavg()
        nursery.cancel_scope.cancel()
    return {"cpu_s": [b - a for a, b in zip(before, after)], "elapsed_s": elapsed, "suspicions": watch.suspicions,
            "evictions": len(watch.evictions), "loadavg_before": load_before, "loadavg_after": load_after}


def run_idle_bench(nodes: int, seconds: float, *, root=None, keep: bool = False,
                   heartbeat_ms: int | None = None) -> dict:
    """Start a testnet, let it idle, tear it down; one JSON-ready result."""
    if not 1 <= nodes <= MAX_NODES or not 0 < seconds <= MAX_SECONDS:
        raise MeshError("--nodes must be 1..%d and --seconds in (0, %d]" % (MAX_NODES, MAX_SECONDS))
    params = launcher.params_with_heartbeat(heartbeat_ms)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-idle-"))
    failed = True
    try:
        launcher.up(root, nodes, owners=1, run_workloads=False, params=params)
        raw = trio.run(measure_idle, launcher.load_layout(root), seconds)
        failed = False
    finally:
        tear_down(root, failed, keep)
    cpu = raw["cpu_s"]
    per_s = [c / raw["elapsed_s"] for c in cpu]
    return {
        "bench": "idle", "nodes": nodes, "seconds": round(raw["elapsed_s"], 2), "warmup_s": WARMUP_S,
        "heartbeat_ms": params.heartbeat_ms, "detection_bound_ms": params.detection_bound_ms,
        "monitors_per_member": min(MONITORS_PER_MEMBER, nodes - 1),
        # CPU seconds each node process used per second of idling (1.0 = one core busy).
        "node_cpu_cores": {"mean": round(statistics.fmean(per_s), 4), "median": round(statistics.median(per_s), 4),
                           "min": round(min(per_s), 4), "max": round(max(per_s), 4)},
        "node_cpu_s": [round(c, 3) for c in cpu],
        "mesh_cpu_cores": round(sum(per_s), 3),
        "suspicions": raw["suspicions"], "evictions": raw["evictions"],
        "loadavg_before": raw["loadavg_before"], "loadavg_after": raw["loadavg_after"],
        "cpus": os.cpu_count(), "machine": machine,
    }
