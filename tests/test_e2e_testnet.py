"""End to end, as a tester runs it: real `meshnode` processes on 127.0.0.1.

Few and bounded (each wait has a deadline); everything else is tested below this layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from testnet import launcher

pytestmark = pytest.mark.e2e
DEADLINE_S = 30


def meshnode(*args, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "meshnode.cli", *args], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, MESHNODE_KEYSTORE_KDF="insecure-test"))
    if check and result.returncode != 0:
        raise AssertionError("meshnode %s failed (%d): %s%s" % (" ".join(args), result.returncode,
                                                                result.stdout, result.stderr))
    return result


def meshnode_json(*args):
    return json.loads(meshnode(*args, "--json").stdout)


def wait_for(predicate, what: str, deadline_s: float = DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


def job_everywhere(node_dirs, job_id):
    """The job's row at every node, once every node holds its certificate."""
    rows = []
    for node_dir in node_dirs:
        jobs = {j["job_id"]: j for j in meshnode_json("jobs", "--node", node_dir)["jobs"]}
        row = jobs.get(job_id)
        if row is None or row["state"] in ("submitted", "pending"):
            return None
        rows.append(row)
    return rows


def certificate_files(node_dir):
    import sqlite3
    with sqlite3.connect(os.path.join(node_dir, "node.sqlite")) as db:
        return {row[0]: row[1] for row in db.execute("select instance, certificate from certificates")}


def test_testnet_places_joins_and_leaves_nothing(tmp_path):
    root = tmp_path / "net"
    up = meshnode_json("testnet", "up", "--nodes", "4", "--dir", str(root))
    try:
        assert len(up["nodes"]) == 4 and all(n["connected"] == 3 for n in up["nodes"])
        layout = launcher.load_layout(root)
        owner_key = layout["owners"][0]["key_file"]
        node_dirs = [n["dir"] for n in layout["nodes"]]

        # A workload owner submits with the CLI to node 1; the whole mesh decides.
        submitted = meshnode_json("submit", "jobs/counter.toml", "--key", owner_key, "--node", node_dirs[1],
                                  "--wait")
        job_id = submitted["job_id"]
        rows = wait_for(lambda: job_everywhere(node_dirs, job_id), "the placement at every node")
        assert len({(r["primary"], tuple(r["backups"])) for r in rows}) == 1
        # Every node holds a commit certificate of the one decided value, and each verifies
        # offline. (With votes to every member, SPEC 6.11, each member may certify its own
        # quorum of precommits: the same value, not always the same signers' bytes.)
        certs = [certificate_files(d) for d in node_dirs]
        assert all(job_id in c for c in certs), "a node persisted no certificate for the job"
        verified = []
        for index, (node_dir, node_certs) in enumerate(zip(node_dirs, certs)):
            cert_path = tmp_path / ("cert-%d.bin" % index)
            cert_path.write_bytes(node_certs[job_id])
            verified.append(meshnode_json("cert", "verify", str(cert_path), "--genesis",
                                          os.path.join(node_dir, "genesis.bin")))
        assert all(v["valid"] is True for v in verified)
        assert len({(v["instance"], v["value_kind"], v["value_hash"]) for v in verified}) == 1

        # A fifth operator's node joins through membership consensus...
        added = meshnode_json("testnet", "add", "--dir", str(root))
        meshnode_json("join", "--node", added["dir"], "--bootstrap", added["bootstrap"])
        wait_for(lambda: all(meshnode_json("status", "--node", d)["members"] == 5 for d in node_dirs + [added["dir"]]),
                 "five members at every node")
        assert meshnode_json("status", "--node", added["dir"])["member"] is True

        # ...and takes part in the next placement: it decides it like everyone else.
        second = meshnode_json("submit", "jobs/counter.toml", "--key", owner_key, "--node", added["dir"])
        rows = wait_for(lambda: job_everywhere(node_dirs + [added["dir"]], second["job_id"]),
                        "the second placement at all five nodes")
        assert len({r["primary"] for r in rows}) == 1
    finally:
        meshnode("testnet", "down", "--dir", str(root), check=False)
    assert launcher.testnet_processes(root) == []


def job_table_everywhere(node_dirs):
    """(state, primary, fence) of every job, when every node is a member of the whole mesh
    and all of them list exactly that (`meshnode jobs --json` on each); else None."""
    tables = []
    for node_dir in node_dirs:
        status = meshnode_json("status", "--node", node_dir)
        if not status["member"] or status["members"] != len(node_dirs):
            return None
        rows = meshnode_json("jobs", "--node", node_dir)["jobs"]
        tables.append({row["job_id"]: (row["state"], row["primary"], row["fence"]) for row in rows})
    return tables[0] if all(table == tables[0] for table in tables) else None


def test_after_a_kill_a_migration_and_a_restart_every_member_lists_each_job_alike(tmp_path):
    """Issue 15: after kills, restarts and migrations every member's `jobs --json` agrees on
    each job's state, primary and fence. The last decision is the killed node's readmission;
    after it the members are polled until they agree (the one-second bound is checked in
    virtual time by the node-mode simulator's agreement_1s, SPEC 11)."""
    root = tmp_path / "net"
    meshnode_json("testnet", "up", "--nodes", "4", "--dir", str(root))
    try:
        layout = launcher.load_layout(root)
        owner_key = layout["owners"][0]["key_file"]
        node_dirs = [n["dir"] for n in layout["nodes"]]
        keys = [meshnode_json("status", "--node", d)["node"] for d in node_dirs]
        moved, stays = (meshnode_json("submit", "jobs/counter.toml", "--key", owner_key, "--node", node_dirs[i],
                                      "--wait")["job_id"] for i in (1, 2))
        primary = wait_for(lambda: job_everywhere(node_dirs, moved), "the placement at every node")[0]["primary"]
        killed = keys.index(primary)
        survivors = [d for i, d in enumerate(node_dirs) if i != killed]
        meshnode("testnet", "kill", str(killed), "--dir", str(root))

        def migrated():
            rows = job_everywhere(survivors, moved)
            return rows and all(r["primary"] != primary and r["fence"] >= 2 for r in rows)
        wait_for(migrated, "the killed primary's job on its backup at every survivor", deadline_s=60)
        meshnode("testnet", "start", str(killed), "--dir", str(root))   # evicted: it rejoins
        agreed = wait_for(lambda: job_table_everywhere(node_dirs), "one job table at all four members", deadline_s=90)
        assert set(agreed) == {moved, stays}
        state, now_primary, fence = agreed[moved]
        assert state == "running" and now_primary != primary and fence >= 2
        assert agreed[stays][0] == "running"
        assert job_table_everywhere(node_dirs) == agreed   # and it stays so
    finally:
        meshnode("testnet", "down", "--dir", str(root), check=False)
    assert launcher.testnet_processes(root) == []


def test_testnet_processes_skips_the_callers_own_ancestors(tmp_path):
    """`flock L meshnode bench --dir ROOT` names ROOT too: tearing the testnet down must not
    SIGKILL the wrapper that started it. A process working in ROOT is still found."""
    worker = subprocess.Popen(["sleep", "30"], cwd=tmp_path)
    try:
        probe = ("import sys; from testnet.launcher import testnet_processes; "
                 "print(' '.join(map(str, testnet_processes(sys.argv[1]))))")
        wrapper = subprocess.run(["sh", "-c", 'echo $$; "$0" -c "$1" "$2"', sys.executable, probe, str(tmp_path)],
                                 capture_output=True, text=True, timeout=30, check=True)
        wrapper_pid, listed = wrapper.stdout.splitlines()
        found = {int(pid) for pid in listed.split()}
        assert worker.pid in found
        assert int(wrapper_pid) not in found
    finally:
        worker.kill()
        worker.wait()
