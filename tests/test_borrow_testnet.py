"""Borrowing end to end on a 4-node testnet (SPEC.md Q6): real node processes on 127.0.0.1,
simulated GPUs (8, 4, 2 and 1), counter workloads, two owners.

Owner B fills the 8- and 4-GPU nodes with jobs of the unlimited default pool, leaving
3 GPUs free. Owner A, whose quota in pool `batch` is 1 GPU, submits 3 preemptible 1-GPU
jobs there: 1 runs in quota, 2 on borrowed quota, all 3 running; `why` says which. Then B
submits a 1-GPU job of priority 0 to `batch`, in B's quota: there is no free GPU, so it
reclaims the GPU of one of A's borrowed jobs (whose priority, 10, is higher: P8 alone
would not stop it). The victim goes back to pending, and once B's job ends it resumes
from its checkpoint, not from scratch.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import trio

from keys.genesis import Pool, Quota
from testnet import launcher
from testnet.bench_consensus import subscribe
from testnet.bench_preempt import COUNTER_MANIFEST, HIGH_UNITS, SETTLE_S, UNIT_MS, PROGRESS_LOG, PreemptRun, _is

pytestmark = pytest.mark.e2e

POOLS = (Pool(name="batch", default=Quota(gpu_milli=1000)), Pool(name="", default=Quota()))


def manifest(name: str, gpus: int, priority: int, preemptible: bool, pool: str, units: int = 0) -> str:
    text = COUNTER_MANIFEST % (name, '"--units", "%d", ' % units if units else "", UNIT_MS, PROGRESS_LOG, priority,
                               3, gpus, "true" if preemptible else "false")
    return text + 'pool = "%s"\n' % pool


class BorrowRun(PreemptRun):
    def __init__(self, root: Path, layout: dict):
        super().__init__(root, layout, random.Random(20), 1)
        self.owner_a, self.owner_b = (o["key_file"] for o in layout["owners"][:2])
        self.said: dict = {}

    async def _started(self, text: str, owner: str, first: int = 0) -> str:
        self.owner_key = owner
        jid = (await self._submit(text, first)).hex()
        await self._wait(_is("job_started", jid), "job %s did not start" % jid[:8])
        return jid

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for node in self.layout["nodes"]:
                await nursery.start(subscribe, node["dir"], node["index"], self.events.on_event)
            try:
                await self.scenario()
            except trio.TooSlowError as exc:
                self.aborted = str(exc)
            nursery.cancel_scope.cancel()

    async def scenario(self) -> None:
        for gpus in (8, 4):
            self.fillers.append(await self._started(manifest("filler", gpus, 10, False, ""), self.owner_b))
        borrowers = [await self._started(manifest("borrower", 1, 10, True, "batch"), self.owner_a) for _ in range(3)]
        self.fillers += borrowers
        await trio.sleep(SETTLE_S)   # checkpoints taken, vectors sent
        self.said["why"] = {jid: await self._call(0, "why", job_id=jid) for jid in borrowers}
        self.owner_key = self.owner_b
        submitted_ns = time.monotonic_ns()
        reclaimer = (await self._submit(manifest("reclaimer", 1, 0, False, "batch", HIGH_UNITS), 1)).hex()
        self.highs.append(reclaimer)
        record = {"job": reclaimer, "borrowers": borrowers}
        await self._wait(_is("placed", reclaimer, submitted_ns), "the reclaimer was not placed")

        def preempted_by_reclaimer(index, event):
            return event.get("kind") == "job_preempted" and event.get("detail", {}).get("by") == reclaimer
        victim_node, preempted = await self._wait(preempted_by_reclaimer, "no job was preempted for the reclaimer")
        victim = preempted["detail"]["job_id"]
        preempted_wall_us = time.time_ns() // 1000
        record.update(preempted=victim, victim_node=victim_node)
        self.said["victim_why"] = await self._call(0, "why", job_id=victim)
        _, exited = await self._wait(_is("job_exited", reclaimer, submitted_ns), "the reclaimer did not end")
        successor, _ = await self._wait(_is("job_started", victim, exited["detail"]["mono_ns"]),
                                        "the victim did not resume")
        await self._measure_lost_work(victim, victim_node, preempted_wall_us, successor, record)
        self.per_round.append(record)


def test_an_owner_beyond_its_quota_borrows_and_another_owners_in_quota_job_reclaims_a_gpu():
    root = Path(tempfile.mkdtemp(prefix="meshnode-borrow-"))
    run = None
    try:
        launcher.up(root, len(launcher.GPU_PROFILES), owners=2, run_workloads=True, pools=POOLS)
        run = BorrowRun(root, launcher.load_layout(root))
        trio.run(run.run)
    finally:
        if (root / launcher.LAYOUT_FILE).exists():
            launcher.down(root)
        double_runs = 0 if run is None else run.double_runs_from_logs()
        shutil.rmtree(root, ignore_errors=True)
    assert run.aborted is None, run.aborted
    (row,) = run.per_round
    borrowing = {jid: why.get("borrowing") for jid, why in run.said["why"].items()}
    assert all(why["state"] == "running" for why in run.said["why"].values())
    borrowed = [jid for jid, text in borrowing.items() if text]
    assert len(borrowed) == 2, borrowing   # 1 in quota, 2 on borrowed quota
    assert all(borrowing[jid].startswith("running on borrowed quota (pool 'batch': ") and
               borrowing[jid].endswith("may be preempted by in-quota work") for jid in borrowed)
    assert row["preempted"] in borrowed                          # the reclaim took a borrowed GPU
    assert run.said["victim_why"]["preempted_by"] == row["job"]
    assert run.said["victim_why"]["borrowing"].startswith("waiting for capacity on borrowed quota")
    assert row["restored_unit"] > 0                                # resumed from its checkpoint
    assert double_runs == 0
