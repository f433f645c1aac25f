"""Preemption end to end on a 4-node testnet (SPEC.md P8, issue 20), as `meshnode bench
preempt` runs it: real node processes on 127.0.0.1, simulated GPUs, counter workloads.

A full mesh of preemptible priority-10 jobs, one high-priority job: a victim is
preempted, the high-priority job runs to its end, and the victim resumes from its
checkpoint (not from scratch). While the testnet still runs, `meshnode why VICTIM` says
who preempted it and the certificates of its preemption verify offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testnet.bench_preempt import run_preempt_bench

pytestmark = pytest.mark.e2e


def meshnode(*args) -> str:
    result = subprocess.run([sys.executable, "-m", "meshnode.cli", *args], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, MESHNODE_KEYSTORE_KDF="insecure-test"))
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return result.stdout


def test_a_high_priority_job_preempts_a_victim_that_resumes_from_its_checkpoint(tmp_path):
    said = {}

    def inspect(layout, run):
        row = run.per_round[0]
        node_dir = layout["nodes"][0]["dir"]
        # `why` names the preemptor once node 0 applied the victim's resumed attempt (P8): the
        # bench saw it resume at its own node, node 0 may apply it a moment later. Bounded.
        for _ in range(20):
            said["why"] = json.loads(meshnode("why", row["preempted"], "--node", node_dir, "--json"))
            if said["why"]["preempted_by"] is not None:
                break
            time.sleep(0.25)
        out = tmp_path / "certs"
        meshnode("cert", "export", "--node", node_dir, "--job", row["preempted"], "--out", str(out), "--json")
        said["certificates"] = sorted(p.name for p in out.glob("*.cert"))
        for path in out.glob("*.cert"):
            meshnode("cert", "verify", str(path), "--genesis", str(out / "genesis.bin"))

    result = run_preempt_bench(1, root=tmp_path / "net", seed=7, before_teardown=inspect)
    assert result["aborted"] is None and result["preemptions"] == 1 and result["resumed"] == 1
    row = result["per_round"][0]
    assert row["restored_unit"] > 0            # resumed from a checkpoint, not from scratch
    assert result["double_runs"] == 0
    assert said["why"]["preempted_by"] == row["job"]
    assert any("-preemption-" in name for name in said["certificates"])
    assert any("-placement-" in name for name in said["certificates"])
