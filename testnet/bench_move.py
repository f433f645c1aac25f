"""Live migration of a healthy job on a real testnet (SPEC.md R2): `meshnode bench move`.

``run_move_bench`` starts a testnet WITH workloads and one ``counter`` job (1 ms units,
a progress log per node in the job's workdir, as `bench failover`), then K times:

1. waits until the job runs on a live primary that has taken checkpoints;
2. sleeps a seeded random 0..``MOVE_PHASE_MS`` (a random moment in the checkpoint cycle)
   and sends the owner's signed move request (mesh picks the node) to a random node;
3. decided_ms: request -> the new primary's ``moved`` event; latency_ms: request -> the
   job's workload started on the new node (its ``job_started`` event; ``mono_ns``
   stamps, one system-wide clock);
4. lost_work_ms: from the progress logs alone (testnet/bench_stats.lost_work), with the
   old run's last logged unit as its end: the work the new run does again.

Double runs are counted as `bench failover` counts them (a /proc sampler, overlapping
progress logs, workload starts under a superseded fence). The testnet is always torn down.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import trio

from keys.keystore import load_identity
from meshnode.control.client import ControlError
from protocol.errors import MeshError
from protocol.messages import MoveRequest, encode_message
from testnet.bench_failover import STARTED_KINDS, FailoverRun, _detail_names, read_progress, run_on_counter_testnet
from testnet.bench_stats import lost_work, machine_info, summary_ms

MOVE_PHASE_MS = 500        # the request lands uniformly in this window after the job is ready
MOVE_TIMEOUT_S = 10.0      # request -> running on the new node; longer counts as a failed move
ENTRY_RETRIES = 20         # a node that has not yet seen the job run refuses the request: try again
MAX_MOVES = 1000


class MoveRun(FailoverRun):
    def __init__(self, root: Path, layout: dict, jobs: list, rng: random.Random):
        super().__init__(root, layout, jobs, rng)
        self.owner = load_identity(layout["owners"][0]["key_file"], None)
        self.mesh_id = bytes.fromhex(layout["mesh_id"])
        self.moves: list[dict] = []
        self.refused: list[str] = []

    async def _request(self, job_id: bytes, fence: int) -> tuple[int, int]:
        """Send the owner's request to a random node; (its index, mono_ns when sent)."""
        request = encode_message(self.owner, self.mesh_id, MoveRequest(
            job_id=job_id, fence=fence, to_node=b"", requested_ms=time.time_ns() // 1_000_000))
        for _ in range(ENTRY_RETRIES):
            entry = self.rng.choice(self._alive())
            sent_ns = time.monotonic_ns()
            try:
                await self._call(entry, "move", request=request)
                return entry, sent_ns
            except ControlError as exc:
                self.refused.append(str(exc)[:200])
                await trio.sleep(0.05)
        raise MeshError("every node refused the move: %s" % self.refused[-1])

    async def _trigger(self, job_id: bytes, fence: int, primary: int) -> tuple[int, int]:
        """Make the job move: here its owner's request (bench reflex: its primary turns hot)."""
        return await self._request(job_id, fence)

    async def one_move(self, number: int) -> None:
        job_id, _ = self.jobs[0]
        job_hex = job_id.hex()
        primary = await self._wait_job_ready(job_hex)
        fence = (await self._job_row(primary, job_hex))["fence"]
        self.events.clear()
        await trio.sleep(self.rng.uniform(0, MOVE_PHASE_MS / 1000))
        entry, sent_ns = await self._trigger(job_id, fence, primary)
        record = {"move": number, "from": primary, "entry": entry, "fence": fence}

        def event_of(kind_ok):
            def match(index, event):
                detail = event.get("detail", {})
                return (index != primary and kind_ok(event.get("kind")) and detail.get("mono_ns", 0) >= sent_ns
                        and _detail_names(detail, job_hex, ("job_id",)))
            return match

        moved = await self.events.first(event_of(lambda kind: kind == "moved"), MOVE_TIMEOUT_S)
        record["decided_ms"] = None if moved is None else (moved[1]["detail"]["mono_ns"] - sent_ns) / 1e6
        started = await self.events.first(event_of(lambda kind: kind in STARTED_KINDS), MOVE_TIMEOUT_S)
        record["to"] = None if started is None else started[0]
        record["latency_ms"] = None if started is None else (started[1]["detail"]["mono_ns"] - sent_ns) / 1e6
        if started is not None:
            await self._measure_moved_work(job_hex, primary, started[0], record)
        self.moves.append(record)

    async def _measure_moved_work(self, job_hex: str, old: int, new: int, record: dict) -> None:
        """Once the new run logged progress: the old run's last line is where it stopped."""
        deadline = trio.current_time() + MOVE_TIMEOUT_S
        while trio.current_time() < deadline:
            logs = await trio.to_thread.run_sync(read_progress, self.layout, job_hex)
            if logs.get(old) and logs.get(new):
                stopped_us = logs[old][-1].wall_us
                lost = lost_work(logs, old, stopped_us, new, 1)
                if lost is not None:
                    record["lost_work_ms"] = lost.lost_ms
                    record["lost_units"] = lost.lost_units
                    record["restored_unit"] = lost.restored_unit
                    record["gap_ms"] = (next(l.wall_us for l in logs[new] if l.wall_us > stopped_us)
                                        - stopped_us) / 1000
                    return
            await trio.sleep(0.05)
        record["lost_workload"] = True

    async def after_moves(self) -> None:
        """What a bench measures once the moves are done, events still watched (bench reflex: a hold)."""

    async def run(self, moves: int) -> None:
        async with trio.open_nursery() as nursery:
            await self.watch_and_submit(nursery)
            for number in range(moves):
                try:
                    await self.one_move(number)
                except (trio.TooSlowError, MeshError) as exc:
                    self.aborted = "move %d: %s" % (number, exc or "the job was not running on a live primary")
                    break
            if self.aborted is None:
                await self.after_moves()
            for index in self._alive():
                await self._collect_checkpoint_stats(index)
            nursery.cancel_scope.cancel()


def run_move_bench(nodes: int, moves: int, *, root=None, keep: bool = False, seed: int | None = None) -> dict:
    if not 1 <= moves <= MAX_MOVES or nodes < 2:
        raise MeshError("--moves must be 1..%d, --nodes >= 2" % MAX_MOVES)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-move-"))
    seed = seed if seed is not None else random.SystemRandom().getrandbits(32)
    rng = random.Random(seed)
    run, log_double_runs, stale_starts = run_on_counter_testnet(root, nodes, 1, rng, MoveRun, moves, keep)
    return dict(move_figures(run, log_double_runs, stale_starts), bench="move", nodes=nodes, seed=seed,
                entry_refusals=len(run.refused), machine=machine)


def move_figures(run: MoveRun, log_double_runs: int, stale_starts: list) -> dict:
    """What `bench move` and `bench reflex` report of the moves of ``run``."""
    per_move = run.moves
    return {
        "moves": len(per_move), "unit_ms": 1,
        "latency_ms": summary_ms(m["latency_ms"] for m in per_move if m["latency_ms"] is not None),
        "decided_ms": summary_ms(m["decided_ms"] for m in per_move if m["decided_ms"] is not None),
        "lost_work_ms": summary_ms(m["lost_work_ms"] for m in per_move if "lost_work_ms" in m),
        "gap_ms": summary_ms(m["gap_ms"] for m in per_move if "gap_ms" in m),
        "not_moved": sum(1 for m in per_move if m["latency_ms"] is None),
        "lost_workloads": sum(1 for m in per_move if m.get("lost_workload")),
        "double_runs": len(run.proc_double_runs) + log_double_runs + len(stale_starts),
        "double_runs_proc": len(run.proc_double_runs), "double_runs_logs": log_double_runs,
        "stale_fence_starts": stale_starts, "aborted": run.aborted, "per_move": per_move,
    }
