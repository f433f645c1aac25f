"""A reflex rule moving a job off a hot node on a real testnet (SPEC.md R3): `meshnode bench reflex`.

As `bench move` (testnet/bench_move.py), one counter job runs on a testnet WITH
workloads, but its manifest holds a reflex rule (`gpu_temp above 85 for REFLEX_FOR_MS,
migrate`) and no owner asks anything: K times, once the job runs with checkpoints, the
bench forces its primary's simulated GPUs to 90 C (the control API's
set_simulated_telemetry, as `meshnode testnet telemetry I --temp 90`) and measures, from
that moment (``mono_ns``, one system-wide clock): decided_ms until the new primary's
``moved`` event (the rule's duration, the vectors' cadence and the vote), latency_ms until
the workload started there, and lost_work_ms from the progress logs. The old primary is
cooled again once the job left it. The testnet is always torn down.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from protocol.errors import MeshError
from testnet.bench_failover import FAILOVER_MANIFEST, run_on_counter_testnet
from testnet.bench_move import MAX_MOVES, MoveRun, move_figures
from testnet.bench_stats import machine_info

REFLEX_FOR_MS = 1000
HOT_MILLI_C = 90_000
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

    async def one_move(self, number: int) -> None:
        await super().one_move(number)
        hot = self.moves[-1]["from"]
        if hot in self._alive():
            await self._call(hot, "set_simulated_telemetry", clear=True)


def run_reflex_bench(nodes: int, moves: int, *, root=None, keep: bool = False, seed: int | None = None) -> dict:
    if not 1 <= moves <= MAX_MOVES or nodes < 2:
        raise MeshError("--moves must be 1..%d, --nodes >= 2" % MAX_MOVES)
    machine = machine_info()
    root = Path(root or tempfile.mkdtemp(prefix="meshnode-bench-reflex-"))
    seed = seed if seed is not None else random.SystemRandom().getrandbits(32)
    run, log_double_runs, stale_starts = run_on_counter_testnet(root, nodes, 1, random.Random(seed), ReflexRun, moves,
                                                                keep, REFLEX_MANIFEST)
    return dict(move_figures(run, log_double_runs, stale_starts), bench="reflex", nodes=nodes, seed=seed,
                rule_duration_ms=REFLEX_FOR_MS, machine=machine)
