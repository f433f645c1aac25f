"""Workload orders: what the driver must start and stop here, said by the core.

The job table and the ledger decide which jobs this node runs: those it is the primary
of, live, and holds the allocation of (R1: a job it has no room for is refused, never run),
while it is a member and not halted (self-fencing, F3, or the restart sync, F6). After
every input the core compares that with what it last ordered and appends two local
decisions to the Ready batch (protocol/ready.py): "stop" (job ids, stopped first) and
"run" (``WorkloadRun`` items). The driver executes them and derives nothing itself.
A run the driver could not start, or a workload that exits, comes back as
``job_exited``; a run already executing under the same fence is never ordered twice.
A third order, "gang_peers" (``(job id, GangRank)`` items), tells the driver that a rank
it runs has peers at new addresses (another rank moved, SPEC.md GA5): its workload keeps
running and rebuilds its ring with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.job_lifecycle import resumes_from_checkpoint
from protocol.job_table import LIVE_JOB_STATES
from protocol.ready import Decision, NO_INSTANCE, Ready


@dataclass(frozen=True)
class WorkloadRun:
    job_id: bytes
    fence: int           # the workload writes checkpoints under this fence (SPEC P6)
    gpus: tuple          # GPU indices the ledger allocated to it here
    resume: bool         # from this node's newest checkpoint; False: a fresh retry (P6, R1)
    manifest: object     # the owner-signed JobManifest: entrypoint, args, resources
    gang: object = None  # a gang's rank: flows/gang.py GangRank (rank, world size, peers), else None
    replica: int = 0     # R4: 0 the primary; >= 1 a further replica, whose job_id is its replica_key


class WorkloadOrders:
    def __init__(self, epochs, jobs, liveness, ledger, handoff_waits: dict, gang_rank=lambda jid: None,
                 stop_waits: dict | None = None) -> None:
        self.epochs = epochs
        self.jobs = jobs
        self.liveness = liveness
        self.ledger = ledger
        self.handoff_waits = handoff_waits   # jobs waiting for a checkpoint to resume from (R1): not yet
        self.stop_waits = stop_waits if stop_waits is not None else {}   # moved jobs whose old run may run (R2a)
        self.gang_rank = gang_rank           # job id -> its GangRank, if it is a gang's worker
        self.ordered: dict[bytes, int] = {}   # job id -> fence it was ordered to run under
        self.gang_told: dict[bytes, object] = {}   # a gang rank's job id -> the GangRank its run was last told
        self.replicas = None   # the ReplicaFlow (set by the core): the replicas this node holds (R4)
        # The inputs of the last reconcile that ordered nothing (None: it ordered something, or
        # a gang rank runs here, whose peers change without any of them). The same inputs
        # order nothing again, so it is not recounted: most inputs change no job of this node.
        self._quiet_inputs: tuple | None = None

    def exited(self, jid: bytes) -> None:
        """The driver reports the workload gone: nothing to stop any more."""
        self.ordered.pop(jid, None)
        self.gang_told.pop(jid, None)
        self._quiet_inputs = None

    def _inputs(self, replicas) -> tuple:
        """Everything ``reconcile`` reads but the ordered runs themselves (which only it and
        ``exited`` change): the watched fields of this node's jobs (JobTable.mine_version), the allocations, the
        waits, membership and halts, and the replicas' runs by value."""
        return (self.jobs.mine_version(), self.ledger.allocations_version, tuple(self.handoff_waits),
                tuple(self.stop_waits), self.epochs.is_member(), self.liveness.halted,
                self.liveness.startup_sync_due,
                tuple((key, replica.fence, None if claim is None else tuple(claim.gpus), index)
                      for key, _record, index, replica, claim in replicas))

    def reconcile(self, out: Ready) -> None:
        replicas = self.replicas.runnable() if self.replicas is not None else ()
        if not self.ordered and not self.jobs.may_have_mine() and not replicas:
            return   # nothing ordered, nothing to order: most inputs of most nodes
        inputs = self._inputs(replicas)
        if inputs == self._quiet_inputs:
            return
        self._quiet_inputs = None
        wanted: dict[bytes, object] = {}
        replica_runs: dict[bytes, WorkloadRun] = {}
        # Nothing before the first tick's restart check (F6) has had its say on our history.
        if self.epochs.is_member() and not self.liveness.halted and not self.liveness.startup_sync_due:
            allocated = self.ledger.allocated
            wanted = {r.job_id: r for r in self.jobs.mine()
                      if r.state in LIVE_JOB_STATES and allocated(r.job_id) is not None
                      and r.job_id not in self.handoff_waits and r.job_id not in self.stop_waits}
            # R4: a replica runs like a primary, from scratch (replicas keep no checkpoints).
            replica_runs = {key: WorkloadRun(key, replica.fence, tuple(claim.gpus), resume=False,
                                             manifest=record.manifest, replica=index)
                            for key, record, index, replica, claim in replicas}
        stops = tuple(jid for jid, fence in self.ordered.items()
                      if (jid not in wanted and jid not in replica_runs)
                      or (wanted[jid].fence if jid in wanted else replica_runs[jid].fence) != fence)
        runs = tuple(WorkloadRun(r.job_id, r.fence, tuple(r.gpus), resume=resumes_from_checkpoint(r),
                                 manifest=r.manifest, gang=self.gang_rank(r.job_id))
                     for jid, r in wanted.items() if self.ordered.get(jid) != r.fence)
        runs += tuple(run for key, run in replica_runs.items() if self.ordered.get(key) != run.fence)
        moved = tuple((jid, rank) for jid, rank in ((jid, self.gang_rank(jid)) for jid in wanted
                                                     if jid in self.gang_told and self.ordered.get(jid) == wanted[jid].fence)
                      if rank != self.gang_told[jid])
        if moved:
            self.gang_told.update(moved)
            out.decisions.append(Decision("gang_peers", NO_INSTANCE, moved, b""))
        if not stops and not runs:
            if not moved and not self.gang_told and not any(self.gang_rank(jid) is not None for jid in wanted):
                self._quiet_inputs = inputs
            return
        for jid in stops:
            del self.ordered[jid]
            self.gang_told.pop(jid, None)
        if stops:
            out.decisions.append(Decision("stop", NO_INSTANCE, stops, b""))
        if runs:
            self.ordered.update((run.job_id, run.fence) for run in runs)
            self.gang_told.update((run.job_id, run.gang) for run in runs if run.gang is not None)
            out.decisions.append(Decision("run", NO_INSTANCE, runs, b""))
