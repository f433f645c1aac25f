"""Declines decided afresh (SPEC.md P3a, Q5): the three causes of the combined scheduling
sweep's stalls (BENCHMARKS.md "The combined sweep's stalls"), each on four cores.

- a round that cannot hold (a member never declines) still hands freed room to the job at
  once, not at its next round change (sweep seed 332);
- a cancelled job whose instance still runs here never reserves capacity (seed 348);
- a job its owner's quota holds reserves nothing for itself under Q5 (seed 322).
"""

import dataclasses

from keys.genesis import OwnerQuota, Pool, Quota
from protocol.messages import Cancel, CommitCertificate, decode_message, encode_message, job_id
from tests.test_mesh_core import GENESIS, KEYS, OWNER, Net
from tests.test_quota import manifest

SILENT = KEYS[3]   # down from the start: it never declines, so no round of a job can hold


def fill_three_nodes(genesis, pools=("", "", "")):
    """Nodes 0-2 (2 GPUs each) run one 1-GPU job each, ending by 10 s; node 3 is down."""
    net = Net(genesis=genesis)
    net.down.add(SILENT)
    fillers = []
    for nonce, pool in enumerate(pools):
        job = manifest(10 + nonce, pool=pool, runtime_ms=10_000, created_ms=nonce)
        fillers.append(job_id(job))
        net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, job))
        net.run(600)   # a round led by the silent node times out first (200 ms)
    primaries = {net.cores[KEYS[0]].job_view(jid)["primary"] for jid in fillers}
    assert primaries == set(KEYS[:3])
    return net, fillers


def submit_waiting(net, genesis, job):
    net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, job))
    net.run(60)
    jid = job_id(job)
    assert all(net.cores[key].job_view(jid)["state"] == "pending" for key in KEYS[:3])
    return jid


def exit_filler(net, filler):
    primary = net.cores[KEYS[0]].job_view(filler)["primary"]
    net.emit(primary, net.cores[primary].job_exited(filler, 0, net.now))
    return primary


def instance_round(net, key, jid):
    core = net.cores[key]
    return core.instances[core.job_table.get(jid).instance].round


def test_p3a_room_freed_mid_round_goes_to_a_job_whose_round_cannot_hold():
    net, fillers = fill_three_nodes(GENESIS)
    big = submit_waiting(net, GENESIS, manifest(20, gpus=2, pool=""))
    waiting_in = instance_round(net, KEYS[0], big)
    primary = exit_filler(net, fillers[0])
    net.run(100)   # the leader waits one bid window extension for a backup's bid
    assert all(net.cores[key].job_view(big)["state"] == "placed" for key in KEYS[:3])
    assert net.cores[KEYS[0]].job_view(big)["primary"] == primary
    certificate = net.certified(KEYS[0], "placement")[-1].certificate
    assert decode_message(certificate, GENESIS.mesh_id, expect=CommitCertificate)[1].round == waiting_in


def test_r1_a_cancelled_job_whose_instance_runs_on_reserves_nothing():
    net, fillers = fill_three_nodes(GENESIS)
    big = submit_waiting(net, GENESIS, manifest(20, gpus=2, pool=""))
    entry = net.cores[KEYS[0]]
    _, ready = entry.cancel(encode_message(OWNER, GENESIS.mesh_id, Cancel(job_id=big, requested_ms=net.now)), net.now)
    net.emit(KEYS[0], ready)
    net.run(10)
    primary = exit_filler(net, fillers[0])
    instance = net.cores[primary].job_table.get(big).instance
    net.run(1_000)   # several round changes of the job's instance, which still runs here
    assert net.cores[primary].job_view(big)["state"] == "cancelled"
    assert instance not in net.cores[primary].ledger.reservations()
    assert len(net.cores[primary].ledger.free_gpus()) == 2


def test_q5_a_job_its_quota_holds_reserves_no_capacity():
    """The owner holds 1 of its 2 GPUs in `training` (a filler): its 2-GPU job is declined
    for capacity first (P3 checks capacity before Q2), and its quota holds it too. Behind it,
    a 1-GPU job without a declared runtime must not wait for it (before: `reserved` on every
    member until the quota freed)."""
    genesis = dataclasses.replace(GENESIS, reservations=True, pools=(
        Pool("", Quota()), Pool("training", Quota(), (OwnerQuota(OWNER.public_key, Quota(gpu_milli=2000)),))))
    net, _fillers = fill_three_nodes(genesis, pools=("training", "", ""))
    big = submit_waiting(net, genesis, manifest(20, gpus=2, pool="training", created_ms=10))
    assert set(net.cores[KEYS[0]].job_view(big)["declines"]) == {"not_enough_gpus"}
    assert net.cores[KEYS[0]].pending_report(big, net.now)["quota"] is not None
    small = job_id(manifest(21, gpus=1, pool="", created_ms=20))
    net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, manifest(21, gpus=1, pool="", created_ms=20)))
    net.run(100)
    assert all(net.cores[key].job_view(small)["state"] == "placed" for key in KEYS[:3])
