"""Preemption on a real testnet (SPEC.md P8): a full mesh, a high-priority job, a victim
that resumes from its checkpoint once the room returns.

``run_preempt_bench`` starts a 4-node testnet with workloads (simulated GPUs: 8, 4, 2
and 1, testnet/launcher.py) and fills every GPU with preemptible priority-10 ``counter``
jobs, one per node, each asking for all of that node's GPUs (submitted largest first,
so each lands where it fits). Then, ``rounds`` times, one at a time:

1. submits a 1-GPU priority-900 counter job J that ends after ``HIGH_UNITS`` units;
   every member declines it (no free GPU), the mesh decides a preemption;
2. time_to_place_ms: submit -> J's placement applied at some node (event ``placed``),
   time_to_start_ms: submit -> J's workload started (event ``job_started``);
3. the victim, from the ``job_preempted`` event of its node (which also states the lost
   work the node measured, ``lost_work_core_ms``: its clock since the victim's newest
   checkpoint when it freed it);
4. once J completes, resume_ms: J's exit -> the victim's workload started again;
5. lost_work_ms from the victim's progress logs alone (testnet/bench_stats.lost_work):
   the time between the unit its resumed run restarted from and the last unit its
   stopped run logged: the work done twice.

Double runs are counted from the progress logs (two runs of one job overlapping in
time) and by a /proc sampler. The testnet is always torn down.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

from keys.keystore import load_identity
from meshnode.control.client import AsyncControlClient, ControlError
from meshnode.workload.manifest import parse_manifest
from protocol.errors import MeshError
from protocol.messages import encode_message, job_id
from testnet import launcher
from testnet.bench_consensus import subscribe
from testnet.bench_failover import EventLog, read_progress, sample_double_runs
from testnet.bench_stats import lost_work, machine_info, overlapping_runs, segments, summary_ms

UNIT_MS = 2
# A pause this long in a victim's progress log ends a run: resumed from the final checkpoint
# taken as it was preempted (P8d), the next run goes on from the next unit, on the same node.
RUN_GAP_US = 1_000_000
HIGH_UNITS = 750               # J runs about 1.5 s
STEP_TIMEOUT_S = 30.0
SETTLE_S = 1.0                 # after the fill, and between rounds: checkpoints flow, vectors go out
OVERLAP_TOLERANCE_US = 2 * UNIT_MS * 1000
MAX_ROUNDS = 100
PROGRESS_LOG = "{{workdir}}/progress.log"  # doubled braces: the manifest text goes through str.format

COUNTER_MANIFEST = """
name = "%s"
entrypoint = "counter"
args = [%s"--unit-ms", "%d", "--progress-log", "%s"]
strategy = "throughput"
priority = %d
backups = 1
max_retries = %d
nonce = {nonce}
[resources]
gpus = %d
gpu_mem_mib = 1024
cpu_milli = 100
mem_mib = 64
[scheduling]
preemptible = %s
"""


def filler_manifest(gpus: int) -> str:
    return COUNTER_MANIFEST % ("bench-preempt-filler", "", UNIT_MS, PROGRESS_LOG, 10, 3, gpus, "true")


def high_manifest() -> str:
    units = '"--units", "%d", ' % HIGH_UNITS
    return COUNTER_MANIFEST % ("bench-preempt-high", units, UNIT_MS, PROGRESS_LOG, 900, 0, 1, "false")


def _is(kind: str, job_hex: str, after_ns: int = 0):
    def match(index, event):
        detail = event.get("detail", {})
        return (event.get("kind") == kind and detail.get("job_id") == job_hex
                and detail.get("mono_ns", 0) >= after_ns)
    return match


class PreemptRun:
    def __init__(self, root: Path, layout: dict, rng: random.Random, rounds: int):
        self.root, self.layout, self.rng, self.rounds = root, layout, rng, rounds
        self.mesh_id = bytes.fromhex(layout["mesh_id"])
        self.owner_key = layout["owners"][0]["key_file"]
        self.events = EventLog()
        self.fillers: list[str] = []
        self.highs: list[str] = []
        self.per_round: list[dict] = []
        self.proc_double_runs: set[str] = set()
        self.aborted: str | None = None

    async def _call(self, index: int, op: str, **args):
        async with AsyncControlClient(self.layout["nodes"][index]["dir"], timeout_s=None) as client:
            return await client.call(op, **args)

    async def _submit(self, manifest: str, first: int) -> bytes:
        """Sign the job for the epoch a member is in and submit it there (a node the load
        got evicted refuses it: the next one is tried). Returns the job id."""
        owner = load_identity(self.owner_key, None)
        problems = []
        for k in range(len(self.layout["nodes"])):
            index = (first + k) % len(self.layout["nodes"])
            try:
                epoch = (await self._call(index, "status"))["epoch"]
                job = parse_manifest(manifest.format(nonce=self.rng.getrandbits(40)), owner.public_key,
                                     time.time_ns() // 1_000_000, epoch=epoch)
                await self._call(index, "submit", job=encode_message(owner, self.mesh_id, job))
                return job_id(job)
            except (ControlError, MeshError, OSError) as exc:
                problems.append("node %d: %s" % (index, exc))
        raise trio.TooSlowError("no node took the job (%s)" % "; ".join(problems))

    async def _wait(self, predicate, what: str):
        found = await self.events.first(predicate, STEP_TIMEOUT_S)
        if found is None:
            raise trio.TooSlowError(what)
        return found

    async def fill(self) -> None:
        """One preemptible job per node, as many GPUs as it has, largest first."""
        sizes = sorted((launcher.GPU_PROFILES[n["index"] % len(launcher.GPU_PROFILES)][1]
                        for n in self.layout["nodes"]), reverse=True)
        for gpus in sizes:
            jid = await self._submit(filler_manifest(gpus), 0)
            await self._wait(_is("job_started", jid.hex()), "filler job of %d GPUs did not start" % gpus)
            self.fillers.append(jid.hex())
        await trio.sleep(SETTLE_S)

    async def one_round(self, number: int) -> None:
        self.events.clear()
        submitted_ns = time.monotonic_ns()
        jid = await self._submit(high_manifest(), number % len(self.layout["nodes"]))
        job_hex = jid.hex()
        self.highs.append(job_hex)
        record = {"round": number, "job": job_hex}
        _, placed = await self._wait(_is("placed", job_hex, submitted_ns), "J not placed")
        record["time_to_place_ms"] = (placed["detail"]["mono_ns"] - submitted_ns) / 1e6
        node, started = await self._wait(_is("job_started", job_hex, submitted_ns), "J not started")
        record["time_to_start_ms"] = (started["detail"]["mono_ns"] - submitted_ns) / 1e6
        record["node"] = node

        def preempted_for_j(index, event):
            return event.get("kind") == "job_preempted" and event.get("detail", {}).get("by") == job_hex
        found = await self.events.first(preempted_for_j, 1.0)
        if found is None:   # placed without a preemption (room freed some other way)
            record["preempted"] = None
            await self._wait(_is("job_exited", job_hex, submitted_ns), "J did not end")
            self.per_round.append(record)
            return
        victim_node, preempted = found
        victim_hex = preempted["detail"]["job_id"]
        preempted_wall_us = time.time_ns() // 1000
        record.update(preempted=victim_hex, victim_node=victim_node,
                      lost_work_core_ms=preempted["detail"].get("lost_work_ms"))
        _, exited = await self._wait(_is("job_exited", job_hex, submitted_ns), "J did not end")
        successor, resumed = await self._wait(_is("job_started", victim_hex, exited["detail"]["mono_ns"]),
                                              "the victim did not resume")
        record["resume_ms"] = (resumed["detail"]["mono_ns"] - exited["detail"]["mono_ns"]) / 1e6
        record["successor"] = successor
        await self._measure_lost_work(victim_hex, victim_node, preempted_wall_us, successor, record)
        self.per_round.append(record)

    async def _measure_lost_work(self, victim_hex: str, victim_node: int, preempted_wall_us: int, successor: int,
                                 record: dict) -> None:
        """From the victim's progress logs: its stopped run ends at the last line its node
        logged in the run under way when the preemption was announced."""
        with trio.move_on_after(STEP_TIMEOUT_S):
            while True:
                logs = await trio.to_thread.run_sync(read_progress, self.layout, victim_hex)
                runs = [s for s in segments(victim_node, logs.get(victim_node, []), RUN_GAP_US)
                        if s.first_us < preempted_wall_us]
                if runs:
                    stop_us = runs[-1].last_us
                    lost = lost_work(logs, victim_node, stop_us, successor, UNIT_MS, RUN_GAP_US)
                    if lost is not None:
                        record["lost_work_ms"] = lost.lost_ms
                        record["lost_units"] = lost.lost_units
                        record["restored_unit"] = lost.restored_unit
                        return
                await trio.sleep(0.1)
        record["lost_work_unmeasured"] = True

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.layout["nodes"]:
                await nursery.start(subscribe, node["dir"], node["index"], self.events.on_event)
            nursery.start_soon(sample_double_runs, self.root, self.proc_double_runs)
            try:
                await self.fill()
                for number in range(self.rounds):
                    await self.one_round(number)
                    await trio.sleep(SETTLE_S)
            except trio.TooSlowError as exc:
                self.aborted = "%s within %d s" % (exc, STEP_TIMEOUT_S)
            nursery.cancel_scope.cancel()

    def double_runs_from_logs(self) -> int:
        return sum(len(overlapping_runs(read_progress(self.layout, job_hex), OVERLAP_TOLERANCE_US))
                   for job_hex in self.fillers + self.highs)


def run_preempt_bench(rounds: int, *, root=None, keep: bool = False, seed: int | None = None,
                      before_teardown=None) -> dict:
    """``before_teardown(layout, run)``: called while the testnet still runs (tests look
    at what the nodes say: `why`, certificates)."""
    if not 1 <= rounds <= MAX_ROUNDS:
        raise MeshError("--rounds must be 1..%d" % MAX_ROUNDS)
    nodes = len(launcher.GPU_PROFILES)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-preempt-"))
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    run, failed = None, True
    try:
        launcher.up(root, nodes, owners=1, run_workloads=True)
        run = PreemptRun(root, launcher.load_layout(root), random.Random(seed), rounds)
        trio.run(run.run)
        failed = run.aborted is not None
        if before_teardown is not None:
            before_teardown(run.layout, run)
    finally:
        if (root / launcher.LAYOUT_FILE).exists():
            launcher.down(root)
        log_double_runs = 0 if run is None else run.double_runs_from_logs()
        _keep_or_remove(root, failed or keep)
    rows = run.per_round
    preempted = [r for r in rows if r.get("preempted")]
    return {
        "bench": "preempt", "nodes": nodes, "rounds": len(rows), "seed": seed, "unit_ms": UNIT_MS,
        "preemptions": len(preempted),
        "time_to_place_ms": summary_ms(r["time_to_place_ms"] for r in rows),
        "time_to_start_ms": summary_ms(r["time_to_start_ms"] for r in rows),
        "lost_work_ms": summary_ms(r["lost_work_ms"] for r in preempted if "lost_work_ms" in r),
        "lost_work_core_ms": summary_ms(r["lost_work_core_ms"] for r in preempted
                                        if r.get("lost_work_core_ms") is not None),
        "resume_ms": summary_ms(r["resume_ms"] for r in preempted if "resume_ms" in r),
        "resumed": sum(1 for r in preempted if "resume_ms" in r),
        "double_runs": len(run.proc_double_runs) + log_double_runs,
        "aborted": run.aborted, "per_round": rows, "machine": machine,
    }


def _keep_or_remove(root: Path, keep: bool) -> None:
    if keep:
        print("bench: testnet directory kept at %s" % root, file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
