"""Four real node drivers with pools in the genesis (SPEC.md 5.5, Q2-Q4): a job over its
owner's quota waits, `meshnode why` names the quota, the queue position and when it may
start, and the job is placed once the owner's first job is cancelled. Memory network,
trio's autojumping MockClock; the CLI runs as from a shell, over the real control socket."""

import json

import pytest
import trio

from keys.genesis import Pool, Quota
from keys.keystore import load_identity
from meshnode.cli import main
from protocol.errors import MeshError
from protocol.quota_admission import quota_homes
from protocol.signing import short_id
from protocol.messages import Cancel, Constraints, JobManifest, Resources, Scheduling, encode_message
from testnet import launcher
from tests.test_job_output import NODES, run_mesh

POOLS = (Pool(name="training", default=Quota(gpu_milli=1000)),)   # one GPU per owner


def pooled_job(owner, mesh_id: bytes, nonce: int, pool="training") -> bytes:
    job = JobManifest(owner=owner.public_key, name="train-%d" % nonce, nonce=nonce, entrypoint="counter", args=(),
                      resources=Resources(gpus=1, gpu_mem_mib=1024, cpu_milli=100, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=1, max_retries=0, created_ms=nonce, epoch=0,
                      scheduling=Scheduling(pool=pool, max_runtime_ms=60_000))
    return encode_message(owner, mesh_id, job)


async def test_a_job_over_its_owners_quota_waits_and_why_says_which_quota(tmp_path, mock_clock, capsys):
    mock_clock.autojump_threshold = 0
    layout = launcher.create_testnet(tmp_path / "net", NODES, owners=1, run_workloads=False, pools=POOLS)
    owner = load_identity(layout["owners"][0]["key_file"], None)
    mesh_id = bytes.fromhex(layout["mesh_id"])

    async def test(nodes):
        first = await nodes[0].submit(pooled_job(owner, mesh_id, 1))
        await trio.sleep(1.0)
        assert nodes[0].core.job_view(first)["state"] == "placed"
        second = await nodes[0].submit(pooled_job(owner, mesh_id, 2))
        await trio.sleep(1.0)
        assert all(node.core.job_view(second)["state"] == "pending" for node in nodes)

        capsys.readouterr()
        argv = ["why", second.hex()[:10], "--node", str(nodes[0].paths.root), "--json"]
        assert await trio.to_thread.run_sync(main, argv) == 0
        why = json.loads(capsys.readouterr().out)
        # Every node declines it; one whose GPU the first job took may answer for capacity
        # first (P3 checks capacity before the quota, and a grant wait can outlast its vector).
        declines = why["declines"]
        assert "over_quota" in declines and set(declines) <= {"over_quota", "not_enough_gpus"}
        assert sum(len(nodes) for nodes in declines.values()) == NODES
        queue = why["queue"]
        assert (queue["pool"], queue["position"], queue["queue_length"]) == ("training", 1, 1)
        homes = quota_homes(nodes[0].core.view, owner.public_key, "training")
        assert queue["quota"] == ("waiting for a quota grant from quota home %s (deputies %s): pool 'training' "
                                  "quota: gpu_milli 1000 held + 1000 asked > 1000 (over by 1000); not preemptible, so it "
                                  "cannot borrow (Q6)" % (short_id(homes[0]), ", ".join(short_id(h) for h in homes[1:])))
        assert queue["estimate"]["reason"] == "quota frees when job %s ends" % first.hex()[:8]
        assert 55_000 < queue["estimate"]["in_ms"] <= 60_000

        with_unknown_pool = pooled_job(owner, mesh_id, 3, pool="serving")
        with pytest.raises(MeshError, match=r"scheduling.pool: unknown pool 'serving' \(the mesh's pools: 'training'\)"):
            await nodes[1].submit(with_unknown_pool)

        await nodes[0].cancel(encode_message(owner, mesh_id, Cancel(job_id=first, requested_ms=0)))
        await trio.sleep(1.0)
        assert all(node.core.job_view(second)["state"] == "placed" for node in nodes)

    await run_mesh(tmp_path / "net", test)
