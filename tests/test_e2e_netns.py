"""End to end on a testnet with real network separation (`meshnode testnet up --netns`).

Five real node processes, each in a network namespace of its own on a bridge in a namespace
the testnet creates (10.77.0.0/24, never the host's interfaces); `testnet partition` is an
nftables rule on that bridge, so the cut is a real packet filter between processes. Needs
root, `ip netns` and `nft`; skipped cleanly otherwise. Every wait has a deadline, and the
testnet is torn down (and proven gone) whatever happens.

Equal stakes, so a side decides only with more than 2/3 of the stake (SPEC 6.1): 4 of 5
nodes do, 3 of 5 do not. The test cuts off the node that runs the first job, so the
minority holds a live workload when the partition starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from meshnode.control.client import ControlClient
from testnet import launcher, netns
from test_e2e_testnet import meshnode, meshnode_json, wait_for

NODES = 5
STEP_DEADLINE_S = 45
UNPLACED_WATCH_S = 2.0   # how long the minority is watched placing nothing


def _netns_usable() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nft") is None:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not _netns_usable(), reason="needs root, `ip netns` and `nft`")]


def jobs_at(node_dir) -> dict:
    """``meshnode jobs --json`` of one node, by job id (through its control socket, as the CLI does)."""
    with ControlClient(node_dir, timeout_s=5) as client:
        return {j["job_id"]: j for j in client.call("jobs")["jobs"]}


def status_at(node_dir) -> dict:
    with ControlClient(node_dir, timeout_s=5) as client:
        return client.call("status")


def view(row) -> tuple:
    return (row["state"], row["primary"], row["fence"]) if row else None


def agreed(node_dirs, job_ids):
    """Each job's (state, primary, fence) when every node holds the same, else None."""
    views = [jobs_at(d) for d in node_dirs]
    result = {}
    for job_id in job_ids:
        seen = {view(v.get(job_id)) for v in views}
        if len(seen) != 1 or None in seen:
            return None
        result[job_id] = seen.pop()
    return result


def runners(root, job_id) -> list[int]:
    """Node index of every live workload process of ``job_id``, one entry per process (a
    workload runs in its work dir, DIR/node-N/workloads/JOB_ID)."""
    found = []
    for pid in launcher.testnet_processes(root):
        try:
            cwd = os.readlink("/proc/%d/cwd" % pid)
        except OSError:
            continue
        node_dir, sep, rest = cwd.partition("/workloads/")
        if sep and rest == job_id:
            found.append(int(node_dir.rsplit("node-", 1)[1]))
    return sorted(found)


def test_netns_partition_majority_places_minority_does_not_heal_converges(tmp_path):
    root = tmp_path / "net"
    bounded = tmp_path / "bounded.toml"   # a short job: the majority's new placement, done in ~0.3 s of CPU
    bounded.write_text('name = "bounded"\nentrypoint = "counter"\nargs = ["--unit-ms", "1", "--units", "300"]\n'
                       'backups = 1\n[resources]\ngpus = 0\ncpu_milli = 250\nmem_mib = 128\n')
    names = None
    try:
        up = meshnode_json("testnet", "up", "--netns", "--nodes", str(NODES), "--dir", str(root))
        layout = launcher.load_layout(root)
        names = layout["netns"]
        assert all(n["connected"] == NODES - 1 for n in up["nodes"])
        assert [n["host"] for n in layout["nodes"]] == ["10.77.0.%d" % (i + 1) for i in range(NODES)]
        assert set(names["nodes"] + [names["hub"]]) <= set(_netns_list())
        owner_key = layout["owners"][0]["key_file"]
        dirs = [n["dir"] for n in layout["nodes"]]
        index_of = {n["public_key"]: n["index"] for n in layout["nodes"]}

        first = meshnode_json("submit", "jobs/counter.toml", "--key", owner_key, "--node", dirs[0], "--wait")
        cut = index_of[first["primary"]]
        majority = [i for i in range(NODES) if i != cut]
        wait_for(lambda: runners(root, first["job_id"]) == [cut], "the first job's workload at its primary")

        partition_called_at = time.monotonic()
        meshnode("testnet", "partition", ",".join(map(str, majority)), str(cut), "--dir", str(root))
        partitioned_at = time.monotonic()   # the rules went in between these two moments
        assert "meshnode_partition" in _hub_tables(names)

        # The majority (4/5 of the stake) evicts the cut-off node and moves its job.
        moved = wait_for(lambda: _moved_everywhere([dirs[i] for i in majority], first["job_id"], first["primary"]),
                         "the majority to move the first job off node %d" % cut, STEP_DEADLINE_S)
        evicted_at = time.monotonic()
        assert moved[2] > 1 and index_of[moved[1]] in majority

        # ...and keeps placing: a new job is decided at every node of the majority.
        second = meshnode_json("submit", str(bounded), "--key", owner_key, "--node", dirs[majority[0]], "--wait")
        assert index_of[second["primary"]] in majority
        wait_for(lambda: agreed([dirs[i] for i in majority], [second["job_id"]]),
                 "the majority to agree on the second job", STEP_DEADLINE_S)

        # The minority (1/5) places nothing: a job submitted there stays unplaced, and the
        # majority's job is not placed there either (its `jobs --json`).
        third = meshnode_json("submit", str(bounded), "--key", owner_key, "--node", dirs[cut])
        watch_until = time.monotonic() + UNPLACED_WATCH_S
        while time.monotonic() < watch_until:
            at_cut = {j["job_id"]: j for j in meshnode_json("jobs", "--node", dirs[cut])["jobs"]}
            assert at_cut[third["job_id"]]["primary"] is None, at_cut[third["job_id"]]
            assert at_cut[third["job_id"]]["state"] in ("submitted", "pending")
            assert second["job_id"] not in at_cut or at_cut[second["job_id"]]["primary"] is None
            assert status_at(dirs[cut])["epoch"] == 0   # it certified no epoch change on its own
        assert runners(root, third["job_id"]) == []

        meshnode("testnet", "heal", "--dir", str(root))
        healed_at = time.monotonic()
        assert "meshnode_partition" not in _hub_tables(names)

        # After the heal the whole mesh converges: every node a member again, in one epoch,
        # holding the same (state, primary, fence) for both jobs placed by a quorum...
        def converged():
            statuses = [status_at(d) for d in dirs]
            if {(s["epoch"], s["members"], s["member"]) for s in statuses} != {(statuses[0]["epoch"], NODES, True)}:
                return None
            return agreed(dirs, [first["job_id"], second["job_id"]])
        final = wait_for(converged, "every node to agree after the heal", STEP_DEADLINE_S)
        converged_after_s = time.monotonic() - healed_at
        # ...and the cut-off node's stale run was stopped: the first job runs exactly once,
        # at the primary everyone agrees on, under the newest fence.
        state, primary, fence = final[first["job_id"]]
        assert state == "running" and fence > 1
        try:
            wait_for(lambda: runners(root, first["job_id"]) == [index_of[primary]],
                     "one run of the first job, at its agreed primary", STEP_DEADLINE_S)
        except AssertionError:
            raise AssertionError("the first job runs at nodes %s, its primary is node %d; runs: %s" % (
                runners(root, first["job_id"]), index_of[primary], _run_log(dirs, first["job_id"]))) from None
        fenced_after_s = time.monotonic() - healed_at
        # Reported, not asserted: the job submitted to the cut-off node (a known gap: its
        # submission is not re-sent after the node is readmitted).
        third_views = [view(jobs_at(d).get(third["job_id"])) for d in dirs]
        print("\nnetns partition: evicted %.2f-%.2f s after the cut; converged %.2f s after the heal; "
              "stale run gone %.2f s after the heal; job submitted to the cut-off node: %s; load %s"
              % (evicted_at - partitioned_at, evicted_at - partition_called_at, converged_after_s, fenced_after_s, third_views,
                 open("/proc/loadavg").read().split()[:3]))
    finally:
        if (root / launcher.LAYOUT_FILE).exists():
            meshnode("testnet", "down", "--dir", str(root), check=False)
    assert launcher.testnet_processes(root) == []
    if names is not None:
        ours = set(names["nodes"] + [names["hub"]])
        assert not ours & set(_netns_list()), "namespaces left behind"
        host_links = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True,
                                    text=True).stdout
        assert not [line for line in host_links.splitlines() if any(n in line for n in ours)], host_links


def _run_log(node_dirs, job_id) -> list[str]:
    """Every node's log lines that start or stop a run of ``job_id`` (for a failure's message)."""
    lines = []
    for index, node_dir in enumerate(node_dirs):
        with open(os.path.join(node_dir, "node.log"), errors="replace") as log:
            lines += ["node %d: %s" % (index, line.strip()) for line in log
                      if ("started job " + job_id[:12]) in line or ("stopped job " + job_id[:12]) in line]
    return lines


def _moved_everywhere(node_dirs, job_id, old_primary):
    views = {view(jobs_at(d).get(job_id)) for d in node_dirs}
    if len(views) != 1:
        return None
    only = views.pop()
    return only if only and only[1] != old_primary else None


def _netns_list() -> list[str]:
    out = subprocess.run(["ip", "-o", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _hub_tables(names) -> str:
    return subprocess.run(["ip", "netns", "exec", names["hub"], "nft", "list", "tables"], capture_output=True,
                          text=True).stdout


def test_down_after_a_crashed_up_removes_what_the_layout_names(tmp_path):
    """`up` died half way (hub and node 0 made, node 1 not, a partition in force, no process):
    `down` deletes by the names the layout recorded before they were created."""
    root = tmp_path / "net"
    layout = launcher.create_testnet(root, 2, hosts=[netns.node_address(0), netns.node_address(1)])
    names = layout["netns"] = netns.plan(layout["mesh_id"], 2)
    launcher.save_layout(root, layout)
    try:
        netns.create_hub(names)
        netns.create_node(names, 0)
        launcher.partition(root, ["0"])
        assert "meshnode_partition" in _hub_tables(names)
        assert {names["hub"], names["nodes"][0]} <= set(_netns_list())
    finally:
        down = meshnode("testnet", "down", "--dir", str(root), check=False)
    assert down.returncode == 0, down.stderr
    assert not set(names["nodes"] + [names["hub"]]) & set(_netns_list())
