"""Reservations and backfill (SPEC.md Q5) in the timed trace replay (`meshnode replay
--timed --reservations`): the mesh's own rule, ``backfill_error`` of protocol/job_queue.py,
applied on each node as every member applies it to its bids.

A queued task that has no room now is the **holder** of every node whose total capacity
would hold it (and of its GPU model) and that has no room for it now: the first such task
in queue order holds that node, as a member's holder is the first job ahead of a job that
it declined for want of capacity. A task behind it may start on a held node only if it
ends before the holder could start there (its declared runtime: here its traced remaining
duration, as if every user declared exactly what the task ran), or leaves the holder
room at that time; a node no one holds takes anything that fits. A task kept off every
node that has room only by reservations waits: it is no reason to preempt (P8 preempts
for a job every member declined for capacity, and `reserved` is no capacity decline).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from protocol.job_queue import Room, backfill_error
from protocol.messages import job_id


def node_total(node) -> Room:
    return Room(node.gpu_count, node.cpu_milli_total, node.memory_mib_total)


def node_free(node) -> Room:
    """Whole free GPUs, as Q5 counts them (a GPU share frees no whole GPU)."""
    return Room(node.whole_gpus_free(), node.cpu_milli_free, node.memory_mib_free)


class Holders:
    """The holder of each node during one offer of the queue (or one arrival)."""

    def __init__(self, cluster, tasks, manifest, remaining_ms, running_since, now_ms: int) -> None:
        self.cluster = cluster
        self.tasks = tasks
        self.manifest = manifest              # task index -> the manifest the mesh would sign
        self.remaining_ms = remaining_ms      # task index -> work left (ms), once started
        self.running_since = running_since    # running task index -> start of its stint (ms)
        self.now_ms = now_ms
        self.holder_of: dict[int, SimpleNamespace] = {}   # node index -> the holding task, as a record

    def add(self, index: int) -> None:
        """Task ``index`` found no room: it holds each node it would fit empty but not now."""
        demand = self.tasks[index].demand
        need = Room.of(self.manifest(index).resources)
        record = None
        for node_index, node in enumerate(self.cluster.nodes):
            if node_index in self.holder_of or node.fits(demand) or not node_total(node).holds(need):
                continue
            if demand.gpu_count and not demand.allows_model(node.model):
                continue
            record = record or self._record(index)
            self.holder_of[node_index] = record

    def allowed(self, index: int):
        """``allowed(node index)`` for task ``index``: the nodes it may start on under Q5."""
        if not self.holder_of:
            return None
        record = self._record(index)

        def allowed(node_index: int) -> bool:
            holder = self.holder_of.get(node_index)
            if holder is None:
                return True
            node = self.cluster.nodes[node_index]
            return backfill_error(record, holder, node_free(node), self._running_on(node), self.now_ms) is None
        return allowed

    def _running_on(self, node) -> list:
        """(end ms, Room) of each task running on ``node``, by its traced remaining duration."""
        return [(self.running_since[task] + self.remaining_ms[task], Room.of(self.manifest(task).resources))
                for task in node.allocations() if task in self.running_since]

    def _record(self, index: int) -> SimpleNamespace:
        """Task ``index`` as Q5 reads a job record: its manifest, declaring its remaining run."""
        task = self.tasks[index]
        manifest = self.manifest(index)
        runtime = self.remaining_ms.get(index, (task.deletion_s - task.scheduled_s) * 1000)
        declared = dataclasses.replace(manifest, scheduling=dataclasses.replace(
            manifest.scheduling, max_runtime_ms=max(1, runtime)))
        return SimpleNamespace(manifest=declared, job_id=job_id(manifest))
