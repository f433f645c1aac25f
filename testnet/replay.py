"""Replay of the Alibaba GPU cluster trace (cluster-trace-gpu-v2023, "openb") through the
project's own packing code (protocol/gpu_shares.py, protocol/packing.py).

The fill experiment is the FGD paper's: offer the trace's tasks in order, cycling through
the file, to an empty cluster; a task that fits nowhere is skipped and counted; stop once
the GPU milli offered reaches ``load`` (1.3) times the cluster's GPU capacity. Reported per
policy: the share of GPU capacity allocated then, the share when the first task failed,
the number of failed tasks, the fragmentation rate (protocol/packing.py) against the
trace's own task-type distribution, and the wall time.

The timed replay (``timed``) follows the trace's arrival times and durations on a few
nodes, queues by priority (the QoS class), and preempts by the mesh's own victim rule
(testnet/replay_preemption.py); testnet/replay_mesh.py runs a slice through the simulated
mesh to compare its decisions with this replay's prediction.
"""

from __future__ import annotations

import csv
import bisect
import heapq
import random
import time
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import MeshError
from protocol.gpu_shares import MILLI_PER_GPU, MAX_GPUS_PER_NODE, NodeShares, ShareError, TaskDemand
from protocol.messages import job_id
from protocol.packing import PackingCluster, WorkloadDistribution, make_policy
from testnet.replay_preemption import (DEFAULT_CHECKPOINT_MS, QOS_CLASSES, CheckpointClock, choose, manifest_for,
                                       node_key, running_job)
from testnet.replay_reservations import Holders

DATA_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "alibaba-gpu-v2023"
DEFAULT_CLUSTER = DATA_DIR / "openb_node_list_gpu_node.csv"
DEFAULT_PODS = DATA_DIR / "openb_pod_list_default.csv"
DEFAULT_LOAD = 1.3
MAX_ROWS = 1_000_000  # per file
MAX_OFFERED = 10_000_000  # tasks offered in one fill run


class TraceError(MeshError):
    """A trace file is unreadable or has a bad row; the message names file, line and column."""


@dataclass(frozen=True)
class NodeSpec:
    name: str
    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int

    def fresh(self) -> NodeShares:
        return NodeShares(self.name, self.model, self.gpus, self.cpu_milli, self.memory_mib)


@dataclass(frozen=True)
class TraceTask:
    name: str
    demand: TaskDemand
    qos: str | None
    creation_s: int | None
    scheduled_s: int | None
    deletion_s: int | None
    line: int = 0  # in the pod list, for errors


def _rows(path: Path, required: tuple[str, ...]):
    """(line number, row dict) for each data row; checks the header names ``required``."""
    try:
        handle = open(path, newline="", encoding="utf-8-sig")  # a spreadsheet may write a BOM
    except OSError as exc:
        raise TraceError("%s: cannot read: %s" % (path, exc.strerror or exc))
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
            if header is None:
                raise TraceError("%s: empty file (expected a header with %s)" % (path, ", ".join(required)))
            header = [h.strip() for h in header]
            missing = [c for c in required if c not in header]
            if missing:
                raise TraceError("%s line 1: missing column %s" % (path, ", ".join(missing)))
            for row in reader:
                if reader.line_num - 1 > MAX_ROWS:
                    raise TraceError("%s: more than %d rows" % (path, MAX_ROWS))
                if not row or all(not cell.strip() for cell in row):
                    continue
                if len(row) != len(header):
                    raise TraceError("%s line %d: %d fields, the header has %d"
                                     % (path, reader.line_num, len(row), len(header)))
                yield reader.line_num, dict(zip(header, (cell.strip() for cell in row)))
        except csv.Error as exc:
            raise TraceError("%s line %d: %s" % (path, reader.line_num, exc))
        except UnicodeDecodeError as exc:
            raise TraceError("%s: not UTF-8 text (%s)" % (path, exc.reason))


def _int(path: Path, line: int, row: dict, column: str, default: int | None = None,
         low: int = 0, high: int | None = None) -> int | None:
    text = row.get(column, "")
    if text == "":
        if default is not None or column not in row:
            return default
        raise TraceError("%s line %d column %s: empty (expected an integer)" % (path, line, column))
    try:
        value = int(text)
    except ValueError:
        raise TraceError("%s line %d column %s: expected an integer, got %r" % (path, line, column, text[:40]))
    if value < low or (high is not None and value > high):
        raise TraceError("%s line %d column %s: %d is outside %d..%s"
                         % (path, line, column, value, low, "" if high is None else high))
    return value


def _optional_int(path: Path, line: int, row: dict, column: str) -> int | None:
    return _int(path, line, row, column, default=None) if row.get(column, "") != "" else None


def load_cluster(path: Path) -> list[NodeSpec]:
    """Nodes from a node list (columns sn, cpu_milli, memory_mib, gpu; model optional)."""
    path = Path(path)
    nodes, names = [], set()
    for line, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu")):
        name = row["sn"]
        if not name:
            raise TraceError("%s line %d column sn: empty node name" % (path, line))
        if name in names:
            raise TraceError("%s line %d column sn: node %r listed twice" % (path, line, name))
        names.add(name)
        nodes.append(NodeSpec(name, row.get("model", ""),
                              _int(path, line, row, "gpu", high=MAX_GPUS_PER_NODE),
                              _int(path, line, row, "cpu_milli"), _int(path, line, row, "memory_mib")))
    if not nodes:
        raise TraceError("%s: no nodes" % path)
    return nodes


def load_tasks(path: Path) -> list[TraceTask]:
    """Tasks from a pod list (columns name, cpu_milli, memory_mib, num_gpu; gpu_milli,
    gpu_spec, qos and the times optional: a missing column or empty cell is absent).
    A one-GPU task without gpu_milli takes the whole GPU; a multi-GPU task takes whole
    GPUs (its gpu_milli, if given, must be 0 or 1000)."""
    path = Path(path)
    tasks = []
    for line, row in _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu")):
        gpus = _int(path, line, row, "num_gpu", high=MAX_GPUS_PER_NODE)
        milli = _optional_int(path, line, row, "gpu_milli")
        if gpus == 0:
            if milli:
                raise TraceError("%s line %d column gpu_milli: %d for a task with num_gpu 0" % (path, line, milli))
            milli = 0
        elif milli is None or (gpus > 1 and milli == 0):
            milli = MILLI_PER_GPU
        elif gpus > 1 and milli != MILLI_PER_GPU:
            raise TraceError("%s line %d column gpu_milli: a %d-GPU task takes whole GPUs (%d), got %d"
                             % (path, line, gpus, MILLI_PER_GPU, milli))
        elif not 0 < milli <= MILLI_PER_GPU:
            raise TraceError("%s line %d column gpu_milli: %d is outside 1..%d" % (path, line, milli, MILLI_PER_GPU))
        models = frozenset(m.strip() for m in row.get("gpu_spec", "").split("|") if m.strip())
        try:
            demand = TaskDemand(_int(path, line, row, "cpu_milli"), _int(path, line, row, "memory_mib"),
                                gpus, milli, models)
        except ShareError as exc:
            raise TraceError("%s line %d: %s" % (path, line, exc))
        tasks.append(TraceTask(row["name"], demand, row.get("qos") or None,
                               _optional_int(path, line, row, "creation_time"),
                               _optional_int(path, line, row, "scheduled_time"),
                               _optional_int(path, line, row, "deletion_time"), line))
    if not tasks:
        raise TraceError("%s: no tasks" % path)
    return tasks


def shuffled(tasks: list[TraceTask], seed: int) -> list[TraceTask]:
    """The tasks in a seeded random order: the same workload, another arrival order
    (how much of a policy's result is the trace's particular order)."""
    order = list(tasks)
    random.Random(seed).shuffle(order)
    return order


def fill(nodes: list[NodeSpec], tasks: list[TraceTask], policy_name: str, seed: int = 0,
         load: float = DEFAULT_LOAD, workload: WorkloadDistribution | None = None) -> dict:
    """One fill run (module docstring); returns the per-policy figures."""
    started = time.perf_counter()
    workload = workload or WorkloadDistribution(t.demand for t in tasks)
    cluster = PackingCluster([spec.fresh() for spec in nodes], make_policy(policy_name, workload), seed)
    capacity = cluster.gpu_milli_capacity
    if capacity == 0:
        raise TraceError("the cluster has no GPUs")
    if not any(t.demand.gpu_count for t in tasks):
        raise TraceError("no task asks for a GPU: the offered GPU load never grows")
    target = load * capacity
    offered_milli = offered = failed = 0
    share_at_first_failure = None
    while offered_milli < target:
        if offered >= MAX_OFFERED:
            raise TraceError("more than %d tasks offered before the load was reached" % MAX_OFFERED)
        task = tasks[offered % len(tasks)]
        offered += 1
        offered_milli += task.demand.gpu_milli_total
        if cluster.place(offered, task.demand) is None:
            failed += 1
            if share_at_first_failure is None:
                share_at_first_failure = cluster.gpu_milli_allocated / capacity
    free = capacity - cluster.gpu_milli_allocated
    fragment = cluster.fragment_milli(workload)
    return {
        "gpu_alloc_share": round(cluster.gpu_milli_allocated / capacity, 4),
        "share_at_first_failure": None if share_at_first_failure is None else round(share_at_first_failure, 4),
        "failed": failed,
        "fragmentation": round(fragment / free, 4) if free else 0.0,
        "fragmented_gpus": round(fragment / MILLI_PER_GPU, 1),
        "unallocated_gpus": round(free / MILLI_PER_GPU, 1),
        "tasks_offered": offered,
        "wall_s": round(time.perf_counter() - started, 2),
    }


def percentile(values: list[int], fraction_milli: int) -> int | None:
    """Nearest-rank percentile (p50: 500, p99: 990); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, -(-len(ordered) * fraction_milli // 1000)) - 1]


def sample_nodes(nodes: list[NodeSpec], count: int, seed: int) -> list[NodeSpec]:
    """``count`` nodes drawn with ``seed``, in file order (the file is sorted by node type)."""
    if not 1 <= count <= len(nodes):
        raise TraceError("--nodes must be in 1..%d (the cluster's size), got %d" % (len(nodes), count))
    chosen = set(random.Random(seed).sample(range(len(nodes)), count))
    return [spec for i, spec in enumerate(nodes) if i in chosen]


def _check_timed_columns(tasks: list[TraceTask]) -> None:
    """The timed replay reads qos and the three times; it invents none of them."""
    if all(t.scheduled_s is None for t in tasks) or all(t.deletion_s is None for t in tasks):
        raise TraceError("--timed needs the scheduled_time and deletion_time columns (this trace has no values there)")
    for task in tasks:
        where = "line %d (task %s)" % (task.line, task.name)
        if task.qos is None:
            raise TraceError("%s: no qos; --timed maps the QoS class to a priority (known: %s)"
                             % (where, ", ".join(QOS_CLASSES)))
        if task.qos not in QOS_CLASSES:
            raise TraceError("%s column qos: unknown class %r (known: %s)" % (where, task.qos[:40], ", ".join(QOS_CLASSES)))
        if task.creation_s is None:
            raise TraceError("%s: no creation_time; --timed replays arrivals" % where)
        if task.scheduled_s is not None and task.deletion_s is not None and task.deletion_s < task.scheduled_s:
            raise TraceError("%s: deletion_time %d is before scheduled_time %d"
                             % (where, task.deletion_s, task.scheduled_s))


def _seconds(milliseconds: int | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1000


def timed(nodes: list[NodeSpec], tasks: list[TraceTask], policy_name: str, seed: int = 0,
          workload: WorkloadDistribution | None = None, preempt: bool = True,
          checkpoint_ms: int = DEFAULT_CHECKPOINT_MS, reservations: bool = False) -> dict:
    """Replay with the trace's times: each task arrives at its creation time and, once
    placed, runs for its traced duration (deletion - scheduled). Pending tasks wait in one
    queue, higher priority first, then in arrival order (QoS classes: QOS_CLASSES); a freed
    resource is offered to the queue in that order, skipping tasks that still do not fit.
    With ``preempt``, a task that fits nowhere asks the mesh's victim rule (P8, through
    testnet/replay_preemption.py) for lower-priority preemptible tasks to stop on one node;
    they go back to the queue and resume from their newest checkpoint, losing the work
    since. Tasks without the times (pending in the trace: no scheduled or deletion time)
    are not replayed; tasks that fit on no node of this cluster even when it is empty are
    counted apart, not queued. With ``reservations``, a task that has no room holds the
    nodes it waits for and others backfill them only as SPEC.md Q5 allows
    (testnet/replay_reservations.py). A missing qos or time column, or an unknown qos, is an
    error."""
    started_wall = time.perf_counter()
    _check_timed_columns(tasks)
    workload = workload or WorkloadDistribution(t.demand for t in tasks)
    cluster = PackingCluster([spec.fresh() for spec in nodes], make_policy(policy_name, workload), seed)
    empty = [spec.fresh() for spec in nodes]
    checkpoints = CheckpointClock(checkpoint_ms, seed)
    events: list[tuple[int, int, int, int]] = []  # (time ms, 0 = completion / 1 = arrival, task, stint)
    untimed = unplaceable = 0
    for index, task in enumerate(tasks):
        if task.scheduled_s is None or task.deletion_s is None:
            untimed += 1
        elif not any(node.fits(task.demand) for node in empty):
            unplaceable += 1
        else:
            events.append((task.creation_s * 1000, 1, index, 0))
    if not events:
        raise TraceError("no task has creation, scheduled and deletion times that this cluster can run")
    heapq.heapify(events)
    shapes: dict[TaskDemand, int] = {}
    shape_of = [shapes.setdefault(task.demand, len(shapes)) for task in tasks]
    priority_of = [QOS_CLASSES[task.qos][0] for task in tasks]
    may_preempt = preempt and any(QOS_CLASSES[t.qos][1] for t in tasks)
    manifests: dict[int, object] = {}
    index_of_job: dict[bytes, int] = {}

    def manifest(index: int):
        if index not in manifests:
            manifests[index] = made = manifest_for(index, tasks[index].demand, tasks[index].qos)
            index_of_job[job_id(made)] = index
        return manifests[index]

    queue: list[tuple[int, int, int]] = []  # (-priority, arrival ms, task): the order tasks are offered
    remaining_ms = {}      # task -> work left (ms), from its newest checkpoint
    running_since = {}     # running task -> when this stint started (ms)
    stint = {}             # task -> stints started (a completion event of an older stint is stale)
    preempted = {}         # task -> times preempted
    delays: dict[str, list[int]] = {}
    lost: dict[str, list[int]] = {}
    preemptions = 0

    def start(index: int, now: int, holders: Holders | None = None) -> bool:
        allowed = holders.allowed(index) if holders is not None else None
        if cluster.place(index, tasks[index].demand, allowed) is None:
            return False
        begin(index, now)
        return True

    def holders_at(now: int) -> Holders | None:
        return Holders(cluster, tasks, manifest, remaining_ms, running_since, now) if reservations else None

    def fits_somewhere(index: int) -> bool:
        """Whether a task that did not start was kept off by reservations alone (Q5)."""
        return reservations and any(node.fits(tasks[index].demand) for node in cluster.nodes)

    def begin(index: int, now: int) -> None:
        task = tasks[index]
        if index not in remaining_ms:
            remaining_ms[index] = (task.deletion_s - task.scheduled_s) * 1000
            delays.setdefault(task.qos, []).append(now - task.creation_s * 1000)
        running_since[index] = now
        stint[index] = stint.get(index, 0) + 1
        heapq.heappush(events, (now + remaining_ms[index], 0, index, stint[index]))

    def try_preemption(index: int, now: int) -> bool:
        """Stop the victims the rule picks and start ``index`` in their place."""
        running_on = [[] for _ in cluster.nodes]
        for victim in running_since:
            if QOS_CLASSES[tasks[victim].qos][1] and priority_of[victim] < priority_of[index]:
                age = checkpoints.age_ms(victim, running_since[victim], now)
                running_on[cluster.node_of(victim)].append(
                    running_job(manifest(victim), preempted.get(victim, 0), age))
        choice = choose(manifest(index), tasks[index].demand, cluster.nodes, running_on,
                        lambda jid: manifests.get(index_of_job.get(jid)), preempted.get(index, 0))
        if choice is None:
            return False
        nonlocal preemptions
        for victim_ref in choice.victims:
            victim = index_of_job[victim_ref.job_id]
            started = running_since.pop(victim)
            age = checkpoints.age_ms(victim, started, now)
            cluster.release(victim)
            remaining_ms[victim] -= (now - started) - age  # the work up to its newest checkpoint is kept
            preempted[victim] = preempted.get(victim, 0) + 1
            lost.setdefault(tasks[victim].qos, []).append(age)
            preemptions += 1
            bisect.insort(queue, (-priority_of[victim], tasks[victim].creation_s * 1000, victim))
        placed = cluster.place(index, tasks[index].demand)
        if placed is None or node_key(cluster.nodes[placed[0]].name) != choice.node:
            raise AssertionError("the victim rule's fit and the ledger disagree on task %s" % tasks[index].name)
        begin(index, now)
        return True

    def offer_queue(now: int) -> None:
        """Offer the queue in its order; a shape that did not fit is skipped for the rest of
        the pass (capacity only shrinks), until a preemption frees some; a task whose
        preemption found no victims is not asked again in this pass."""
        blocked: set[int] = set()
        no_victims: set[tuple[int, int]] = set()
        holders = holders_at(now)
        position = 0
        while position < len(queue):
            index = queue[position][2]
            shape = shape_of[index]
            if shape not in blocked and start(index, now, holders):
                del queue[position]
                continue
            if shape not in blocked and fits_somewhere(index):
                position += 1     # held off by a reservation: it waits, and holds nothing
                continue
            blocked.add(shape)
            if holders is not None:
                holders.add(index)
            key = (shape, priority_of[index])
            if may_preempt and key not in no_victims:
                del queue[position]
                if try_preemption(index, now):
                    blocked.clear()
                    holders = holders_at(now)
                    position = 0
                    continue
                no_victims.add(key)
                queue.insert(position, (-priority_of[index], tasks[index].creation_s * 1000, index))
            position += 1

    while events:
        now, kind, index, of_stint = heapq.heappop(events)
        if kind == 1:
            # The tasks already waiting did not fit (nor preempt) at the last offer and nothing
            # was freed since, so only the newcomer is new to try.
            holders = holders_at(now)
            if holders is not None:
                # Nothing was freed since the last offer: every task queued ahead has no room.
                key = (-priority_of[index], tasks[index].creation_s * 1000, index)
                for ahead in queue[:bisect.bisect_left(queue, key)]:
                    holders.add(ahead[2])
            if start(index, now, holders):
                continue
            if fits_somewhere(index):
                bisect.insort(queue, (-priority_of[index], tasks[index].creation_s * 1000, index))
                continue
            if may_preempt and try_preemption(index, now):
                offer_queue(now)  # the victims wait now, and what they freed beyond the task's need is free
            else:
                bisect.insort(queue, (-priority_of[index], tasks[index].creation_s * 1000, index))
            continue
        if of_stint != stint[index] or index not in running_since:
            continue  # the task was preempted since this completion was due
        del running_since[index]
        cluster.release(index)
        offer_queue(now)
    waiting_at_end: dict[str, int] = {}
    for _priority, _arrival, index in queue:
        qos = tasks[index].qos
        waiting_at_end[qos] = waiting_at_end.get(qos, 0) + 1
    classes = {}
    for qos in sorted(set(delays) | set(waiting_at_end)):
        values = delays.get(qos, [])
        losses = lost.get(qos, [])
        priority, preemptible = QOS_CLASSES[qos]
        classes[qos] = {"priority": priority, "preemptible": preemptible,
                        "started": len(values), "never_started": waiting_at_end.get(qos, 0),
                        "delay_p50_s": _seconds(percentile(values, 500)),
                        "delay_p99_s": _seconds(percentile(values, 990)),
                        "preemptions": len(losses), "lost_work_p50_ms": percentile(losses, 500),
                        "lost_work_p99_ms": percentile(losses, 990), "lost_work_max_ms": max(losses, default=None)}
    all_lost = [v for values in lost.values() for v in values]
    return {"qos": classes, "started": sum(len(v) for v in delays.values()),
            "never_started": sum(waiting_at_end.values()), "untimed": untimed, "unplaceable": unplaceable,
            "preemptions": preemptions, "preempted_tasks": len(preempted),
            "lost_work_total_s": round(sum(all_lost) / 1000, 3),
            "wall_s": round(time.perf_counter() - started_wall, 2)}
