"""A reflex rule moving a job off a hot node on a real testnet (SPEC.md R3): `meshnode bench reflex`.

As `bench move` (testnet/bench_move.py), one counter job runs on a testnet WITH
workloads, but its manifest holds a reflex rule (`gpu_temp above 85 for REFLEX_FOR_MS,
migrate`) and no owner asks anything: K times, once the job runs with checkpoints, the
bench forces its primary's simulated GPUs to 90 C (the control API's
set_simulated_telemetry, as `meshnode testnet telemetry I --temp 90`) and measures, from
that moment (``mono_ns``, one system-wide clock): decided_ms until the new primary's
``moved`` event (the rule's duration, the vectors' cadence and the vote), latency_ms until
the workload started there, and lost_work_ms from the progress logs. The old primary is
cooled again once the job left it.

Then, with ``hold_s`` > 0, false triggers: with one more serve job running (the clone
rounds' rules), every live node's GPUs are held at ``BELOW_MILLI_C`` (84 C, one degree
under the migrate rule's threshold) and ``BELOW_UTIL_MILLI`` (79 %, one under the clone
rules') for ``hold_s`` seconds, and every reflex action decided meanwhile is a false
trigger: a ``moved`` event with a ``reflex`` (counted once per fence it moved the job to)
or a ``replica_action`` of a rule (once per action number); the issue's bar is 0 over 5
minutes.

Between the two, K rounds of the clone, reroute and decay actions (testnet/bench_clone.py):
``clone_ms``, ``rerouted_share``, ``decay_ms``. The nodes listen on distinct loopback
addresses, so a job's replicas serve one port. The testnet is always torn down.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import trio

from protocol.errors import MeshError
from testnet.bench_clone import CLONE_FOR_MS, CloneRounds, clone_figures, reflex_replica_actions_since
from testnet.bench_failover import FAILOVER_MANIFEST, run_on_counter_testnet
from testnet.bench_move import MAX_MOVES, MoveRun, move_figures
from testnet.bench_stats import machine_info

REFLEX_FOR_MS = 1000
HOT_MILLI_C = 90_000
BELOW_MILLI_C = 84_000     # held just below the rule's 85 C while false triggers are counted
BELOW_UTIL_MILLI = 79_000  # and just below the clone rules' 80 % (bench_clone.py)
MAX_HOLD_S = 3600
REFLEX_MANIFEST = FAILOVER_MANIFEST + """
[[reflex]]
signal = "gpu_temp"
above = 85
for_ms = %d
action = "migrate"
cooldown_ms = 0
""" % REFLEX_FOR_MS


class ReflexRun(MoveRun):
    async def _trigger(self, job_id: bytes, fence: int, primary: int) -> tuple[int, int]:
        sent_ns = time.monotonic_ns()
        await self._call(primary, "set_simulated_telemetry", temp_milli_c=HOT_MILLI_C)
        return primary, sent_ns

    hold_s = 0.0
    clone_rounds = 0
    clones: CloneRounds | None = None
    false_triggers: int | None = None
    false_triggers_by_action: dict | None = None
    hold_observed_s: float | None = None

    async def one_move(self, number: int) -> None:
        await super().one_move(number)
        hot = self.moves[-1]["from"]
        if hot in self._alive():
            await self._call(hot, "set_simulated_telemetry", clear=True)

    async def after_moves(self) -> None:
        """The clone rounds, then every live node just below the migrate rule's threshold
        for hold_s: count reflex moves."""
        self.clones = CloneRounds(self)
        for number in range(self.clone_rounds):
            await self.clones.one_round(number)
        if not self.hold_s:
            return
        await self._wait_job_ready(self.jobs[0][0].hex())
        serving_hex = await self.clones.start_held_job(self.clone_rounds)
        self.events.clear()
        nodes = self._alive()
        started_ns = time.monotonic_ns()
        for index in nodes:
            await self._call(index, "set_simulated_telemetry", temp_milli_c=BELOW_MILLI_C,
                             util_milli=BELOW_UTIL_MILLI)
        await trio.sleep(self.hold_s)
        for index in nodes:
            if index in self._alive():
                await self._call(index, "set_simulated_telemetry", clear=True)
        self.hold_observed_s = (time.monotonic_ns() - started_ns) / 1e9
        self.false_triggers_by_action = {
            "migrate": reflex_moves_since(self.events.events, started_ns),
            "replica": reflex_replica_actions_since(self.events.events, serving_hex, started_ns)}
        self.false_triggers = sum(self.false_triggers_by_action.values())


def run_reflex_bench(nodes: int, moves: int, *, root=None, keep: bool = False, seed: int | None = None,
                     hold_s: float = 0.0) -> dict:
    if not 1 <= moves <= MAX_MOVES or nodes < 2:
        raise MeshError("--moves must be 1..%d, --nodes >= 2" % MAX_MOVES)
    if not 0 <= hold_s <= MAX_HOLD_S:
        raise MeshError("--hold-s must be 0..%d" % MAX_HOLD_S)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-reflex-"))
    seed = seed if seed is not None else random.SystemRandom().getrandbits(32)

    def make_run(*args):
        run = ReflexRun(*args)
        run.hold_s = hold_s
        run.clone_rounds = moves
        return run

    run, log_double_runs, stale_starts = run_on_counter_testnet(root, nodes, 1, random.Random(seed), make_run, moves,
                                                                keep, REFLEX_MANIFEST, loopback_hosts=True)
    # The serve jobs of the clone rounds run on two nodes at once by design (replicas): double
    # runs are those of the migrated counter job alone.
    counter_jobs = {job.hex() for job, _envelope in run.jobs}
    run.proc_double_runs &= counter_jobs
    stale_starts = [s for s in stale_starts if any(job.startswith(s["job"]) for job in counter_jobs)]
    clones = clone_figures(run.clones.rounds if run.clones else [])
    return dict(move_figures(run, log_double_runs, stale_starts), bench="reflex", nodes=nodes, seed=seed,
                rule_duration_ms=REFLEX_FOR_MS, clone_rule_duration_ms=CLONE_FOR_MS, machine=machine,
                **hold_figures(run), **clones)


def reflex_moves_since(events, since_ns: int) -> int:
    """Reflex moves decided from ``since_ns`` on among (node index, event) pairs: every node
    reports each decided move (`moved`, with `reflex` when a rule caused it), so one is
    counted once per (job, fence it moved the job to)."""
    return len({(event["detail"].get("job_id"), event["detail"].get("fence"))
                for _index, event in events
                if event.get("kind") == "moved" and "reflex" in event.get("detail", {})
                and event["detail"].get("mono_ns", 0) >= since_ns})


def hold_figures(run: ReflexRun) -> dict:
    """false_triggers over the hold (None when no hold ran), and how it was held."""
    return {"false_triggers": run.false_triggers, "false_triggers_by_action": run.false_triggers_by_action,
            "hold_s": run.hold_s, "hold_observed_s": run.hold_observed_s,
            "hold_temp_milli_c": BELOW_MILLI_C if run.hold_s else None, "threshold_milli_c": 85_000,
            "hold_util_milli": BELOW_UTIL_MILLI if run.hold_s else None, "util_threshold_milli": 80_000}
