"""Placement latency and throughput on a real local testnet (DESIGN.md "What is measured").

``run_consensus_bench`` starts its own testnet of N ``meshnode run`` processes with
workloads off (placements are decided, no process is started; the jobs ask for no
GPU, CPU or memory, so capacity never runs out), subscribes to EVERY node's event
stream, then submits J signed jobs round-robin over the nodes with C in flight (with
C >= N, each of the C submitters keeps to one node: C / N per node).

* latency of a job = the latest ``mono_ns`` among the N nodes' ``decided`` events for
  its placement instance (each published when that node holds the commit certificate)
  minus ``time.monotonic_ns()`` taken just before the submit request is sent.
  CLOCK_MONOTONIC is one clock for every process on a Linux machine, so the node's
  stamp and ours are comparable.
* throughput = decided jobs / (first submit -> last decision at every node).
* node CPU: all node processes' CPU time during the run, per placement, and (measured
  over IDLE_SAMPLE_S before the first submit) what the idle mesh burns anyway, in cores:
  heartbeats, pings and timer ticks, the floor under every per-placement figure.

The testnet is always torn down (try/finally, Ctrl-C included); its directory is
deleted unless ``keep`` is set or the run failed (the node logs are the evidence).
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from keys.keystore import load_identity
from meshnode.control.client import AsyncControlClient, ControlError, ControlUnavailable
from meshnode.workload.manifest import parse_manifest
from protocol.errors import MeshError
from protocol.messages import encode_message, job_id
from testnet import launcher
from testnet.bench_stats import machine_info, summary_ms

JOB_TIMEOUT_S = 30.0        # a job not decided everywhere by then counts as undecided
MAX_JOBS = 100_000
MAX_CONCURRENCY = 256
IDLE_SAMPLE_S = 2.0         # node CPU is sampled this long before the first submit

CONSENSUS_MANIFEST = """
name = "bench-consensus"
entrypoint = "counter"
strategy = "throughput"
backups = 1
max_retries = 0
nonce = {nonce}
[resources]
gpus = 0
cpu_milli = 0
mem_mib = 0
"""


# The events DecisionCollector reads. Asking for these only (SPEC.md 10.7) keeps the
# benchmark from being dropped as a slow subscriber while it measures a loaded mesh.
COLLECTED_EVENT_KINDS = ["decided", "placed"]


async def subscribe(node_dir, index: int, on_event, *, task_status=trio.TASK_STATUS_IGNORED,
                    kinds: list[str] | None = None) -> None:
    """Feed ``on_event(index, event)`` every event node ``index`` publishes (of ``kinds``, if
    given); started once live.

    A stream the node ends is an error here: the benchmark's nodes are meant to stay up."""
    args = {"kinds": kinds} if kinds else {}
    async with AsyncControlClient(node_dir, timeout_s=None).subscribe(**args) as events:
        task_status.started()
        async for event in events:
            on_event(index, event)
    raise ControlUnavailable("node %d ended its event stream" % index)


def process_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds a live process has used (0 if it is gone)."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sign_jobs(owner_key_file, mesh_id: bytes, count: int, rng: random.Random, manifest_text: str,
              now_ms: int) -> list[tuple[bytes, bytes]]:
    """``count`` signed jobs with distinct random nonces: [(job id, envelope bytes)]."""
    owner = load_identity(owner_key_file, None)
    signed = []
    for nonce in rng.sample(range(1 << 40), count):
        job = parse_manifest(manifest_text.format(nonce=nonce), owner.public_key, now_ms, epoch=0)
        signed.append((job_id(job), encode_message(owner, mesh_id, job)))
    return signed


def job_signer(owner_key_file, mesh_id: bytes, manifest_text: str):
    """sign(nonce) -> (job id, envelope) of a job stamped ``created_ms`` = now, as a client
    stamps a submission: which placement slot takes a job depends on it (SPEC.md P7)."""
    owner = load_identity(owner_key_file, None)

    def sign(nonce: int) -> tuple[bytes, bytes]:
        job = parse_manifest(manifest_text.format(nonce=nonce), owner.public_key, time.time_ns() // 1_000_000,
                             epoch=0)
        return job_id(job), encode_message(owner, mesh_id, job)
    return sign


@dataclass
class DecisionCollector:
    """Per job: when each node published ``decided`` for its placement instance (with
    placement slots, ``placed`` for the job: one slot decision places many, SPEC.md P7)."""
    nodes: int
    slots: bool = False
    decided_ns: dict[str, dict[int, int]] = field(default_factory=dict)
    everywhere: dict[str, trio.Event] = field(default_factory=dict)
    rounds_over_zero: int = 0
    evictions: set = field(default_factory=set)  # eviction instances decided during the run

    def expect(self, job_hex: str) -> None:
        self.decided_ns[job_hex] = {}
        self.everywhere[job_hex] = trio.Event()

    def on_event(self, index: int, event: dict) -> None:
        detail = event.get("detail", {})
        if event.get("kind") == "decided" and detail.get("value_kind") == "eviction":
            self.evictions.add(detail.get("instance"))  # an overloaded node missed the detection bound
        if self.slots:
            if event.get("kind") != "placed":
                return
        elif event.get("kind") != "decided" or detail.get("value_kind", "placement") != "placement":
            return
        job_hex = detail.get("job_id") if self.slots else (detail.get("instance") or detail.get("job_id"))
        per_node = self.decided_ns.get(job_hex)
        if per_node is None or index in per_node:
            return
        per_node[index] = detail["mono_ns"]
        if detail.get("round", 0) > 0:
            self.rounds_over_zero += 1
        if len(per_node) == self.nodes:
            self.everywhere[job_hex].set()


async def measure(layout: dict, signed: list, concurrency: int,
                  job_timeout_s: float = JOB_TIMEOUT_S, slots: bool = False) -> dict:
    """Submit ``signed`` over the running testnet ``layout``; the raw per-job numbers.
    ``signed``: (job id, envelope) pairs, or zero-argument callables that sign one when
    it is submitted (``slots``: its ``created_ms`` picks its placement slot)."""
    node_dirs = [n["dir"] for n in layout["nodes"]]
    collector = DecisionCollector(len(node_dirs), slots=slots)
    submitted_ns: dict[str, int] = {}
    undecided: list[str] = []
    refused: list[str] = []  # "node I: why" -- e.g. the node was evicted: the mesh is not healthy
    overloaded: list[int] = []  # retry_after_ms of each submit refused for overload, then retried
    queue = iter(enumerate(signed))

    async def worker(pinned: int | None) -> None:
        # With C >= N submitters each keeps to one node (``pinned``), so a node holds C / N
        # submit connections: with one to every node, 64 submitters passed a node's 64
        # control connections and it closed idle ones under their feet (SPEC.md 10.5).
        connections: dict[int, AsyncControlClient] = {}  # opened before the first submit is timed
        try:
            for k, job in queue:
                target = k % len(node_dirs) if pinned is None else pinned
                if target not in connections:
                    connections[target] = AsyncControlClient(node_dirs[target], timeout_s=None)
                    await connections[target].connect()
                while True:
                    jid, envelope = job() if callable(job) else job   # signed again: a later slot
                    job_hex = jid.hex()
                    collector.expect(job_hex)
                    submitted_ns[job_hex] = time.monotonic_ns()
                    try:
                        result = await connections[target].call("submit", job=envelope)
                        break
                    except ControlError as exc:
                        retry_after_ms, result = exc.retry_after_ms, None
                        if retry_after_ms is None:
                            refused.append("node %d: %s" % (target, exc))
                            break
                    # SPEC 10.5: the node holds too many undecided jobs; try again when it says.
                    overloaded.append(retry_after_ms)
                    del submitted_ns[job_hex], collector.everywhere[job_hex], collector.decided_ns[job_hex]
                    await trio.sleep(retry_after_ms / 1000)
                if result is None:
                    continue
                if result.get("job_id") != job_hex:
                    raise MeshError("node %d named job %s, expected %s" % (target, result.get("job_id"), job_hex))
                with trio.move_on_after(job_timeout_s):
                    await collector.everywhere[job_hex].wait()
                if not collector.everywhere[job_hex].is_set():
                    undecided.append(job_hex)
        finally:
            for connection in connections.values():
                await connection.aclose()

    pids = [n.get("pid") for n in layout["nodes"]]
    async with trio.open_nursery() as nursery:
        for i, node_dir in enumerate(node_dirs):
            await nursery.start(functools.partial(subscribe, kinds=COLLECTED_EVENT_KINDS), node_dir, i,
                                collector.on_event)
        idle_before_s = sum(process_cpu_s(pid) for pid in pids)
        idle_started = time.monotonic()
        await trio.sleep(IDLE_SAMPLE_S)
        cpu_before_s = sum(process_cpu_s(pid) for pid in pids)
        idle_cores = (cpu_before_s - idle_before_s) / (time.monotonic() - idle_started)
        async with trio.open_nursery() as workers:
            for index in range(concurrency):
                workers.start_soon(worker, index % len(node_dirs) if concurrency >= len(node_dirs) else None)
        node_cpu_s = sum(process_cpu_s(pid) for pid in pids) - cpu_before_s
        nursery.cancel_scope.cancel()
    latencies_ms, last_ns = [], 0
    for job_hex, per_node in collector.decided_ns.items():
        if len(per_node) == len(node_dirs):
            latest = max(per_node.values())
            last_ns = max(last_ns, latest)
            latencies_ms.append((latest - submitted_ns[job_hex]) / 1e6)
    first_ns = min(submitted_ns.values())
    span_s = (last_ns - first_ns) / 1e9 if latencies_ms else 0.0
    return {"latencies_ms": latencies_ms, "undecided": len(undecided), "refused": refused, "span_s": span_s,
            "overloaded": overloaded,
            "decided_in_later_round": collector.rounds_over_zero, "evictions": len(collector.evictions),
            "node_cpu_s": node_cpu_s,
            "node_idle_cpu_cores": idle_cores}


def tear_down(root: Path, failed: bool, keep: bool) -> None:
    """Stop the testnet in ``root``; keep its directory (node logs) if the run failed or ``keep``."""
    if (root / launcher.LAYOUT_FILE).exists():
        launcher.down(root)
    if failed or keep:
        print("bench: testnet directory kept at %s" % root, file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def run_consensus_bench(nodes: int, jobs: int, concurrency: int, *, root=None, keep: bool = False,
                        seed: int | None = None, job_timeout_s: float = JOB_TIMEOUT_S,
                        heartbeat_ms: int | None = None, slot_ms: int = 0, bid_sample: int = 0) -> dict:
    """Start a testnet, measure, tear it down; one JSON-ready result.

    ``heartbeat_ms``: run the testnet with that heartbeat period and a detection bound of
    the same multiple of it as the defaults (6x).
    ``slot_ms``: the genesis ``placement_slot_ms`` (SPEC.md P7); jobs are then signed as
    they are submitted, so their creation times fall in the slots of their submission.
    ``bid_sample``: the genesis ``bid_sample`` (SPEC.md 5.6; 0: every member bids)."""
    if not 1 <= jobs <= MAX_JOBS or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise MeshError("--jobs must be 1..%d and --concurrency 1..%d" % (MAX_JOBS, MAX_CONCURRENCY))
    params = launcher.params_with_heartbeat(heartbeat_ms)
    if not 0 <= slot_ms <= 60_000:
        raise MeshError("--slot-ms must be 0..60000")
    params = dataclasses.replace(params, placement_slot_ms=slot_ms)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-consensus-"))
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    failed = True
    try:
        started = time.monotonic()
        launcher.up(root, nodes, owners=1, run_workloads=False, params=params, bid_sample=bid_sample)
        ready_s = time.monotonic() - started
        layout = launcher.load_layout(root)
        owner_key, mesh_id = layout["owners"][0]["key_file"], bytes.fromhex(layout["mesh_id"])
        if slot_ms:
            sign = job_signer(owner_key, mesh_id, CONSENSUS_MANIFEST)
            signed = [functools.partial(sign, nonce) for nonce in random.Random(seed).sample(range(1 << 40), jobs)]
        else:
            signed = sign_jobs(owner_key, mesh_id, jobs, random.Random(seed), CONSENSUS_MANIFEST,
                               time.time_ns() // 1_000_000)
        raw = trio.run(measure, layout, signed, concurrency, job_timeout_s, bool(slot_ms))
        failed = False
    finally:
        tear_down(root, failed, keep)
    decided = len(raw["latencies_ms"])
    return {
        "bench": "consensus", "nodes": nodes, "jobs": jobs, "concurrency": concurrency, "seed": seed,
        "heartbeat_ms": params.heartbeat_ms, "detection_bound_ms": params.detection_bound_ms,
        "placement_slot_ms": params.placement_slot_ms,
        "bid_sample": bid_sample,
        "decided": decided, "undecided": raw["undecided"], "refused": len(raw["refused"]),
        "refused_first": raw["refused"][0] if raw["refused"] else None,
        # submits the entry node refused as overloaded (SPEC 10.5), each retried after its hint
        "overloaded_retries": len(raw["overloaded"]),
        "decided_in_later_round": raw["decided_in_later_round"], "evictions": raw["evictions"],
        "latency_ms": summary_ms(raw["latencies_ms"]),
        "throughput_per_s": round(decided / raw["span_s"], 1) if raw["span_s"] > 0 else None,
        # CPU all node processes used per placement (idle heartbeats included): with
        # nproc cores, throughput can never exceed nproc * 1000 / this.
        "node_cpu_ms_per_placement": round(1000 * raw["node_cpu_s"] / decided, 2) if decided else None,
        # Summed over the nodes, in cores (1.0 = one core busy), before any job was submitted.
        "node_idle_cpu_cores": round(raw["node_idle_cpu_cores"], 3),
        "testnet_ready_s": round(ready_s, 2), "machine": machine,
    }
