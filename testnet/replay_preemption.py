"""Preemption in the timed trace replay: the mesh's own victim rule (protocol/preemption.py,
SPEC.md P8) called on the replay's cluster through a small adapter.

The rule reads signed records the replay does not have, so this module builds them from
the replay's state, and only that:
- each trace task becomes a ``JobManifest`` once (priority and preemptibility from its QoS
  class, ``QOS_CLASSES``; resources from its demand; ``max_retries`` 0, so a task's
  attempt number counts its preemptions and R1's refusal limit applies as in the mesh);
- each node's exact state becomes a ``CapabilityVector`` (free whole GPUs, CPU, memory and
  the running jobs with their fences and checkpoint ages);
- the trace's ``gpu_spec`` is a set of allowed models where a manifest names one
  (``gpu_model``): the adapter leaves ``gpu_model`` empty and counts only the nodes of an
  allowed model as capacity decliners (the others would decline for the model, not for
  capacity, and P8 never preempts there);
- the manifest's id stands in for the signed job envelope (a replay signs nothing).

Checkpoints: a running task checkpoints every ``checkpoint_ms`` from a phase drawn from
the seed and the task (trace times are whole seconds, so without a phase every age would
be 0); its checkpoint age is the work it loses if preempted now, and it resumes from that
checkpoint with the rest of its traced duration plus the lost work still to do.
"""

from __future__ import annotations

import functools
import hashlib
import random

from protocol.gpu_shares import MILLI_PER_GPU, NodeShares
from protocol.job_table import FENCE_PER_ATTEMPT
from protocol.messages import (CapabilityVector, Constraints, GpuState, JobManifest, Resources, RunningJob,
                               Scheduling, job_id)
from protocol.messages.jobs import MAX_RUNNING_LISTED
from protocol.preemption import choose_preemption

# QoS class -> (priority, preemptible). The trace README names LS (latency sensitive),
# Burstable and BE (best effort); the file also has 7 Guaranteed tasks (Kubernetes' QoS
# class for pods whose requests equal their limits). Latency-sensitive and guaranteed
# tasks are served first and never stopped; burstable ones come next and are not stopped
# either (Kubernetes evicts them only under node pressure, which a replay does not model);
# best-effort tasks are the ones the mesh may stop and resume from a checkpoint.
QOS_CLASSES = {"LS": (200, False), "Guaranteed": (200, False), "Burstable": (100, False), "BE": (0, True)}
DEFAULT_CHECKPOINT_MS = 100
REPLAY_OWNER = hashlib.sha256(b"meshnode replay owner").digest()


def node_key(name: str) -> bytes:
    return hashlib.sha256(b"meshnode replay node " + name.encode()).digest()


def manifest_for(index: int, demand, qos: str) -> JobManifest:
    """Trace task ``index`` as the manifest the rule reads (module docstring)."""
    priority, preemptible = QOS_CLASSES[qos]
    share = demand.gpu_milli_each if demand.is_fractional else 0
    return JobManifest(
        owner=REPLAY_OWNER, name="trace-task", nonce=index, entrypoint="replay", args=(),
        resources=Resources(gpus=demand.gpu_count, gpu_mem_mib=0, cpu_milli=demand.cpu_milli,
                            mem_mib=demand.memory_mib, gpu_milli=share),
        strategy="pack", constraints=Constraints(zones=(), labels=(), attested=()), priority=priority,
        backups=0, max_retries=0, created_ms=0, epoch=0, scheduling=Scheduling(preemptible=preemptible))


class CheckpointClock:
    """When each running task last checkpointed (module docstring)."""

    def __init__(self, period_ms: int, seed: int):
        if period_ms < 1:
            raise ValueError("the checkpoint period must be >= 1 ms, got %d" % period_ms)
        self.period_ms = period_ms
        self.seed = seed
        self._phases: dict[int, int] = {}

    def phase_ms(self, index: int) -> int:
        """When, after each (re)start, task ``index`` first checkpoints: drawn once per task."""
        phase = self._phases.get(index)
        if phase is None:
            phase = self._phases[index] = random.Random("%d/%d" % (self.seed, index)).randrange(self.period_ms)
        return phase

    def age_ms(self, index: int, started_ms: int, now_ms: int) -> int:
        """Work since the newest checkpoint of a task running since ``started_ms`` (it resumed
        from a checkpoint then, or started fresh: either way nothing after is saved yet)."""
        ran = now_ms - started_ms
        phase = self.phase_ms(index)
        return ran if ran < phase else (ran - phase) % self.period_ms


@functools.lru_cache(maxsize=4096)
def _gpu_states(model: str, count: int) -> tuple:
    return tuple(GpuState(index=i, model=model or "unknown", mem_total_mib=0, mem_used_mib=0, util_milli=0,
                          temp_milli_c=0, sm_clock_mhz=0, throttle_reasons=0, ecc_errors=0, power_mw=0)
                 for i in range(count))


def _gpus(node: NodeShares) -> tuple:
    return _gpu_states(node.model, node.gpu_count)


def vector_for(node: NodeShares, running: list[RunningJob]) -> CapabilityVector:
    """``node``'s exact state as its signed vector would say it; ``running`` lists the jobs
    it may stop, youngest checkpoint first (the rule never looks past its 16 youngest)."""
    return CapabilityVector(
        node=node_key(node.name), epoch=0, seq=0, taken_ms=0, zone="replay", rail_group="", gpus=_gpus(node),
        gpus_free=tuple(i for i, free in enumerate(node.gpu_milli_free) if free == MILLI_PER_GPU),
        cpu_milli_free=node.cpu_milli_free, mem_mib_free=node.memory_mib_free, labels=(), simulated=True,
        running=tuple(sorted(running, key=lambda r: (r.checkpoint_age_ms, r.job_id))[:MAX_RUNNING_LISTED]),
        gpu_milli_free=tuple(node.gpu_milli_free))


def choose(job: JobManifest, demand, nodes: list[NodeShares], running_on: list[list[RunningJob]],
           manifest_of, preemptions: int):
    """The P8 choice for ``job`` on the replay's nodes: the Preemption (node key, victims)
    or None. Its attempt is its count of ``preemptions`` (max_retries 0). Only the nodes of
    an allowed model where the job fits when empty but not now are capacity decliners."""
    vectors = {}
    for node, running in zip(nodes, running_on):
        if node.fits(demand) or not _fits_empty(node, demand) or not running:
            continue  # not a capacity decliner, or nothing to stop there: the rule would pick nothing
        vectors[node_key(node.name)] = vector_for(node, running)
    if not vectors:
        return None
    jid = job_id(job)
    return choose_preemption(jid, job, preemptions, vectors, set(vectors), manifest_of)


def _fits_empty(node: NodeShares, demand) -> bool:
    return (demand.cpu_milli <= node.cpu_milli_total and demand.memory_mib <= node.memory_mib_total
            and demand.gpu_count <= node.gpu_count and (demand.gpu_count == 0 or demand.allows_model(node.model)))


def running_job(manifest: JobManifest, preemptions: int, checkpoint_age_ms: int) -> RunningJob:
    """What a vector lists for a running task: fence of its attempt (the count of its
    preemptions, max_retries being 0), and its checkpoint age."""
    return RunningJob(job_id=job_id(manifest), fence=preemptions * FENCE_PER_ATTEMPT + 1, checkpoint_seq=0,
                      checkpoint_age_ms=checkpoint_age_ms, lost_work_ms=0)
