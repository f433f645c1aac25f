"""Gang recovery under kill -9 on a real testnet (issue 17): `meshnode bench gang`.

``run_gang_bench`` starts a testnet WITH workloads and one gang of ``allreduce`` ranks
(SPEC.md GA5: a ring all-reduce over TCP every step, a progress log per rank in its
workdir), then K times:

1. waits until the gang runs: every rank running on a live node and logging steps;
2. picks a seeded rank and sleeps a seeded 0..``KILL_PHASE_MS``, then SIGKILLs that
   rank's node (every rank on that node dies with it);
3. recovery_ms: kill -> every rank doing work again, from the progress logs alone: the
   moved ranks resume on their new nodes from their replicated checkpoints, the ring is
   rebuilt and every rank logs the first step after the one the gang went back to;
4. lost_work_ms: kill -> when the step the gang went back to was first done
   (testnet/bench_stats.lost_work over the moved rank's logs; the largest if several moved);
5. healthy_restarted: ranks on surviving nodes whose workload process changed (a pid
   gone or a new one, sampled from /proc right before the kill and after recovery), or
   that /proc showed no process for before the kill and a node reported started
   (job_started) meanwhile: a gang recovered without teardown restarts none;
6. gangs_lost: kills after which the gang did not run again within RECOVERY_TIMEOUT_S,
   or was torn down (a new attempt, a new fence for every rank) or failed;
7. resizes: changes of the gang's world size seen between kills (an elastic gang shrinking
   or growing back);
8. restarts the killed node (bench failover's `_restart`) so the mesh keeps its capacity.

The pure parts (what the logs say about one kill, which ranks were restarted) are
functions of their inputs, unit-tested from synthetic logs (tests/test_bench_gang.py).
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from protocol.errors import MeshError
from protocol.gang_placement import gang_worker_id
from testnet import launcher
from testnet.bench_failover import (BENCH_JOB_TERMS, OVERLAP_TOLERANCE_US, STARTED_KINDS, FailoverRun,
                                    read_progress, run_on_counter_testnet, workload_processes)
from testnet.bench_stats import (ProgressLine, lost_work, machine_info, overlapping_runs, parse_progress_log,
                                 summary_ms)

UNIT_MS = 5                  # the allreduce's pause between steps
KILL_PHASE_MS = 500          # the kill lands uniformly in this window after the gang is ready
READY_TIMEOUT_S = 60.0       # the gang running on live nodes, every rank logging
RECOVERY_TIMEOUT_S = 40.0    # a rank waits 30 s for new peers (GA5) before it gives up
RECENT_PROGRESS_US = 1_000_000
# Progress logs grow ~200 lines a second per rank: the polls read only their ends. Before a
# kill, 64 KiB is ~2,800 steps (14 s), far more than the checkpoint the gang goes back to.
READY_TAIL_BYTES = 4096
BEFORE_KILL_BYTES = 64 * 1024
MAX_KILLS = 1000
PROGRESS_LOG = "{{workdir}}/progress.log"  # doubled braces: the manifest text goes through str.format

GANG_MANIFEST = """
name = "bench-gang"
entrypoint = "allreduce"
args = ["--dim", "64", "--unit-ms", "%d", "--progress-log", "%s"]
backups = %d
""" + BENCH_JOB_TERMS + """[gang]
workers = %d
topology = "none"
"""


# --- what the logs say about one kill (pure) ---------------------------------------------------

@dataclass(frozen=True)
class GangRecovery:
    restored_step: int     # the step every rank went on from (the moved ranks' checkpoint)
    recovery_ms: float     # kill -> the last rank logged the first step after restored_step
    lost_work_ms: float    # kill -> when restored_step was first done (the largest over the moved ranks)
    successors: dict       # moved rank -> the node it runs on now


def gang_recovery(rank_logs: dict[int, dict[int, list[ProgressLine]]], moved: list[int], victim: int,
                  kill_wall_us: int, unit_ms: float) -> GangRecovery | None:
    """One kill's recovery from the ranks' progress logs (rank -> node -> lines), or None
    while some rank has not logged work after the recovery yet.

    A moved rank resumed on a node other than ``victim`` in a run whose lines start after
    the kill; the ring agreed on the smallest step any rank held (GA5), its checkpoint's,
    so every rank's first step after the recovery is ``restored_step + 1``."""
    successors, lost = {}, []
    for rank in moved:
        logs = rank_logs.get(rank, {})
        resumed = [(lines_after[0].wall_us, node) for node, lines in logs.items() if node != victim
                   for lines_after in [[line for line in lines if line.wall_us > kill_wall_us]] if lines_after]
        if not resumed:
            return None
        successor = min(resumed)[1]
        found = lost_work(logs, victim, kill_wall_us, successor, unit_ms)
        if found is None:
            return None
        successors[rank], lost = successor, lost + [found]
    restored = min(found.restored_unit for found in lost)
    resumed_us = []
    for rank, logs in rank_logs.items():
        first = [line.wall_us for node, lines in logs.items() if node != victim for line in lines
                 if line.wall_us > kill_wall_us and line.unit == restored + 1]
        if not first:
            return None
        resumed_us.append(min(first))
    return GangRecovery(restored, round((max(resumed_us) - kill_wall_us) / 1000, 3),
                        max(found.lost_ms for found in lost), successors)


def read_log_from(path: Path, start: int) -> list[ProgressLine]:
    """The progress lines of ``path`` from byte ``start`` on (a line cut by ``start`` is
    dropped: its digits would read as another step); [] if there is no such file."""
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode("ascii", errors="replace")
    except FileNotFoundError:
        return []
    if start > 0:
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return parse_progress_log(text)


def restarted_ranks(before: dict[int, set], after: dict[int, set]) -> list[int]:
    """Ranks whose workload processes changed (one gone, or a new one) between two samples."""
    return sorted(rank for rank, pids in before.items() if pids and after.get(rank, set()) != pids)


# --- the run on a real testnet ---------------------------------------------------------------

class GangRun(FailoverRun):
    not_ready, ready_timeout_s = "the gang was not running on live nodes", READY_TIMEOUT_S

    def __init__(self, root: Path, layout: dict, jobs: list, rng: random.Random):
        super().__init__(root, layout, jobs, rng)
        self.gang_id = jobs[0][0]
        self.world_sizes: list[int] = []
        self.per_kill: list[dict] = []

    def _worker_hex(self, rank: int) -> str:
        return gang_worker_id(self.gang_id, rank).hex()

    async def _gang_view(self) -> dict | None:
        """The gang's row as the live nodes see it; the newest view (highest fences) wins. (Its
        state may lag: only a rank's primary and backups see it running, so the progress logs,
        not the row's state, say whether the gang works.)"""
        rows = []
        for index in self._alive():
            row = await self._job_row(index, self.gang_id.hex())
            if row is not None and row.get("gang"):
                rows.append(row)
        return max(rows, key=lambda r: (r["fence"], sum(w["fence"] for w in r["gang"]["workers"])), default=None)

    def _log_path(self, rank: int, node: dict) -> Path:
        return Path(node["dir"]) / "workloads" / self._worker_hex(rank) / "progress.log"

    def _log_sizes(self, world: int) -> dict[tuple, int]:
        """(rank, node index) -> the size of that rank's progress log there now."""
        sizes = {}
        for rank in range(world):
            for node in self.layout["nodes"]:
                try:
                    sizes[(rank, node["index"])] = self._log_path(rank, node).stat().st_size
                except FileNotFoundError:
                    continue
        return sizes

    def _rank_logs(self, world: int, starts: dict[tuple, int] | None = None) -> dict[int, dict]:
        """rank -> node -> progress lines: whole logs, or each from ``starts[(rank, node)]``."""
        if starts is None:
            return {rank: read_progress(self.layout, self._worker_hex(rank)) for rank in range(world)}
        logs: dict[int, dict] = {rank: {} for rank in range(world)}
        for rank in range(world):
            for node in self.layout["nodes"]:
                lines = read_log_from(self._log_path(rank, node), starts.get((rank, node["index"]), 0))
                if lines:
                    logs[rank][node["index"]] = lines
        return logs

    def _log_tails(self, world: int, back_bytes: int) -> dict[int, dict]:
        sizes = self._log_sizes(world)
        return self._rank_logs(world, {key: max(0, size - back_bytes) for key, size in sizes.items()})

    def _rank_pids(self, world: int) -> dict[int, set]:
        found = workload_processes(self.root)
        return {rank: set(found.get(self._worker_hex(rank), ())) for rank in range(world)}

    async def _wait_gang_ready(self) -> dict:
        """The gang's row once every rank is on a live node and logged a step there in the last second."""
        with trio.fail_after(READY_TIMEOUT_S):
            while True:
                row = await self._gang_view()
                alive = self._alive()
                if row is not None and row["gang"]["workers"] and row["state"] not in ("failed", "completed"):
                    workers = row["gang"]["workers"]
                    nodes = [self.index_of.get(w["primary"]) for w in workers]
                    if all(n in alive for n in nodes):
                        now_us = time.time_ns() // 1000
                        logs = await trio.to_thread.run_sync(self._log_tails, len(workers), READY_TAIL_BYTES)
                        if all(logs[r].get(n) and now_us - logs[r][n][-1].wall_us < RECENT_PROGRESS_US
                               for r, n in enumerate(nodes)):
                            return row
                await trio.sleep(0.1)

    async def one_kill(self, nursery, number: int) -> None:
        row = await self._wait_gang_ready()
        workers = row["gang"]["workers"]
        world = len(workers)
        if not self.world_sizes or self.world_sizes[-1] != world:
            self.world_sizes.append(world)   # an elastic gang shrank or grew back since the last kill
        nodes = [self.index_of[w["primary"]] for w in workers]
        rank = self.rng.randrange(world)
        victim = nodes[rank]
        moved = [r for r, n in enumerate(nodes) if n == victim]
        healthy_before = {r: pids for r, pids in (await trio.to_thread.run_sync(self._rank_pids, world)).items()
                          if r not in moved}
        self.events.clear()
        await trio.sleep(self.rng.uniform(0, KILL_PHASE_MS / 1000))
        kill_wall_us = time.time_ns() // 1000
        launcher.signal_node(self.root, victim, signal.SIGKILL)
        starts = {key: max(0, size - BEFORE_KILL_BYTES)   # logs a rank starts after the kill: whole
                  for key, size in (await trio.to_thread.run_sync(self._log_sizes, world)).items()}
        record = {"kill": number, "rank": rank, "node": victim, "moved_ranks": moved, "world": world,
                  # healthy ranks whose process was seen before the kill: the ones a restart would show in
                  "healthy_watched": sum(1 for pids in healthy_before.values() if pids)}
        found = None
        with trio.move_on_after(RECOVERY_TIMEOUT_S):
            while found is None:
                await trio.sleep(0.1)
                logs = await trio.to_thread.run_sync(self._rank_logs, world, starts)
                found = gang_recovery(logs, moved, victim, kill_wall_us, UNIT_MS)
        if found is not None and found.restored_step == 0:   # from scratch: all the work so far is lost
            logs = await trio.to_thread.run_sync(self._rank_logs, world)
            found = gang_recovery(logs, moved, victim, kill_wall_us, UNIT_MS)
        if found is None:
            record["gang_lost"] = "no rank-wide progress within %d s" % RECOVERY_TIMEOUT_S
        else:
            record.update(recovery_ms=found.recovery_ms, lost_work_ms=found.lost_work_ms,
                          restored_step=found.restored_step, successors=found.successors)
            after = await self._gang_view()
            # A new attempt (the gang's own fence) is a teardown: every rank placed afresh (GA4).
            if after is None or after["state"] == "failed" or after["fence"] != row["fence"]:
                record["gang_lost"] = "the gang was torn down and placed afresh, or failed"
        by_pid = restarted_ranks(healthy_before, await trio.to_thread.run_sync(self._rank_pids, world))
        unseen = {rank: pids for rank, pids in healthy_before.items() if not pids}
        record["healthy_restarted"] = sorted(set(by_pid) | set(self._started_again(unseen, victim)))
        self.per_kill.append(record)
        await self._restart(nursery, victim)

    def _started_again(self, healthy: dict, victim: int) -> list[int]:
        """Of ``healthy`` ranks (those whose process the /proc sample before the kill missed,
        being restarted then), those some node reported started (job_started) since the
        kill's cycle began. (A rank thawed after a halt, F3b, reports job_started too, but
        its process is the same: the pids decide for every rank they saw.)"""
        rank_of = {self._worker_hex(rank): rank for rank in healthy}
        return sorted({rank_of[event["detail"]["job_id"]] for index, event in self.events.events
                       if index != victim and event.get("kind") in STARTED_KINDS
                       and event.get("detail", {}).get("job_id") in rank_of})

    def double_runs_from_logs(self) -> int:
        """Ranks that ran on two nodes at once, by their progress logs (as bench failover's jobs)."""
        world = max(self.world_sizes, default=0)
        return sum(len(overlapping_runs(logs, OVERLAP_TOLERANCE_US)) for logs in self._rank_logs(world).values())


def run_gang_bench(nodes: int, workers: int, kills: int, *, root=None, keep: bool = False,
                   seed: int | None = None) -> dict:
    if not 1 <= kills <= MAX_KILLS or not 2 <= workers <= 16 or nodes < workers + 1:
        raise MeshError("--kills must be 1..%d, --workers 2..16, --nodes > --workers" % MAX_KILLS)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-gang-"))
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    manifest = GANG_MANIFEST % (UNIT_MS, PROGRESS_LOG, min(4, nodes - workers), workers)
    run, log_double_runs, stale_starts = run_on_counter_testnet(root, nodes, 1, rng, GangRun, kills, keep,
                                                                 manifest)
    per_kill = run.per_kill
    return {
        "bench": "gang", "nodes": nodes, "workers": workers, "seed": seed, "unit_ms": UNIT_MS,
        "kills": len(per_kill),
        "recovery_ms": summary_ms(k["recovery_ms"] for k in per_kill if "recovery_ms" in k),
        "lost_work_ms": summary_ms(k["lost_work_ms"] for k in per_kill if "lost_work_ms" in k),
        "healthy_restarted": sum(len(k["healthy_restarted"]) for k in per_kill),
        "gangs_lost": sum(1 for k in per_kill if "gang_lost" in k),
        "resizes": max(0, len(run.world_sizes) - 1),
        "double_runs": len(run.proc_double_runs) + log_double_runs + len(stale_starts),
        "double_runs_proc": len(run.proc_double_runs), "double_runs_logs": log_double_runs,
        "stale_fence_starts": stale_starts, "aborted": run.aborted,
        "rejoin_failures": run.rejoin_failures, "rejoins_asked": run.rejoins_asked,
        "per_kill": per_kill, "machine": machine,
    }
