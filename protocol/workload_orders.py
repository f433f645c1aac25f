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
        # The primaries' runs wanted at the last reconcile (None: recount them all next time),
        # and what they were counted under. A reconcile then recounts only the jobs that
        # changed (issue 18): the node a job is placed on rescanned all its jobs twice per
        # placement, so its work per placement grew with the jobs it ran.
        self._wanted: dict[bytes, object] | None = None
        self._wanted_eligible = False
        self._gang_wanted: set[bytes] = set()      # wanted jobs that are a gang's ranks
        self._replicas_ordered: set[bytes] = set()  # replica keys among ``ordered``
        self._waits_seen: tuple = (frozenset(), frozenset())
        self._exited: set[bytes] = set()            # runs the driver reported gone since
        self._jobs_changed = jobs.changes_feed()

    def exited(self, jid: bytes) -> None:
        """The driver reports the workload gone: nothing to stop any more."""
        self.ordered.pop(jid, None)
        self.gang_told.pop(jid, None)
        self._replicas_ordered.discard(jid)
        self._exited.add(jid)
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
        # Nothing before the first tick's restart check (F6) has had its say on our history.
        eligible = self.epochs.is_member() and not self.liveness.halted and not self.liveness.startup_sync_due
        changed = self._take_changed()
        if (self.full_recounts or self._wanted is None or eligible != self._wanted_eligible
                or replicas or self._replicas_ordered or self.gang_told or self._gang_wanted):
            self._recount_all(out, inputs, replicas, eligible)
        else:
            self._recount(out, inputs, changed)

    # Set by tests: every reconcile recounts every job, as before issue 18 (the reference).
    full_recounts = False

    def _take_changed(self) -> set[bytes]:
        """The jobs whose runs may have changed since the last reconcile: their watched
        fields, their allocations, their waits, or their runs reported gone."""
        changed = self.jobs.take_changes(self._jobs_changed)
        changed |= self.ledger.take_allocations_changed()
        waits = (frozenset(self.handoff_waits), frozenset(self.stop_waits))
        if waits != self._waits_seen:
            changed |= (waits[0] ^ self._waits_seen[0]) | (waits[1] ^ self._waits_seen[1])
            self._waits_seen = waits
        changed |= self._exited
        self._exited = set()
        return changed

    def _runs_here(self, record) -> bool:
        """A job this node runs as its primary (the module docstring), while eligible."""
        return (record is not None and record.primary == self.jobs.me and record.state in LIVE_JOB_STATES
                and self.ledger.allocated(record.job_id) is not None
                and record.job_id not in self.handoff_waits and record.job_id not in self.stop_waits)

    def _recount(self, out: Ready, inputs: tuple, changed: set[bytes]) -> None:
        """Only the ``changed`` jobs (no replicas, no gang ranks here: ``reconcile``)."""
        wanted = self._wanted
        if self._wanted_eligible:
            for jid in changed:
                record = self.jobs.get(jid)
                if self._runs_here(record):
                    wanted[jid] = record
                    if self.gang_rank(jid) is not None:
                        self._gang_wanted.add(jid)
                else:
                    wanted.pop(jid, None)
        ordered = self.ordered
        stops = [jid for jid in changed if jid in ordered and (jid not in wanted or wanted[jid].fence != ordered[jid])]
        if len(stops) > 1:
            stops = [jid for jid in ordered if jid in stops]   # the order they were run in, as _recount_all
        runs = tuple(WorkloadRun(r.job_id, r.fence, tuple(r.gpus), resume=resumes_from_checkpoint(r),
                                 manifest=r.manifest, gang=self.gang_rank(r.job_id))
                     for r in (wanted[jid] for jid in sorted(changed) if jid in wanted)
                     if ordered.get(r.job_id) != r.fence)
        if not stops and not runs:
            if not self._gang_wanted:
                self._quiet_inputs = inputs
            return
        self._issue(out, tuple(stops), runs)

    def _recount_all(self, out: Ready, inputs: tuple, replicas, eligible: bool) -> None:
        wanted: dict[bytes, object] = {}
        replica_runs: dict[bytes, WorkloadRun] = {}
        if eligible:
            allocated = self.ledger.allocated
            wanted = {r.job_id: r for r in self.jobs.mine()
                      if r.state in LIVE_JOB_STATES and allocated(r.job_id) is not None
                      and r.job_id not in self.handoff_waits and r.job_id not in self.stop_waits}
            # R4: a replica runs like a primary, from scratch (replicas keep no checkpoints).
            replica_runs = {key: WorkloadRun(key, replica.fence, tuple(claim.gpus), resume=False,
                                             manifest=record.manifest, replica=index)
                            for key, record, index, replica, claim in replicas}
        self._wanted, self._wanted_eligible = dict(wanted), eligible
        self._gang_wanted = {jid for jid in wanted if self.gang_rank(jid) is not None}
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
            if not moved and not self.gang_told and not self._gang_wanted:
                self._quiet_inputs = inputs
            return
        self._issue(out, stops, runs)

    def _issue(self, out: Ready, stops: tuple, runs: tuple) -> None:
        for jid in stops:
            del self.ordered[jid]
            self.gang_told.pop(jid, None)
            self._replicas_ordered.discard(jid)
        if stops:
            out.decisions.append(Decision("stop", NO_INSTANCE, stops, b""))
        if runs:
            self.ordered.update((run.job_id, run.fence) for run in runs)
            self.gang_told.update((run.job_id, run.gang) for run in runs if run.gang is not None)
            self._replicas_ordered.update(run.job_id for run in runs if run.replica)
            out.decisions.append(Decision("run", NO_INSTANCE, runs, b""))
