"""No overcommit, ever (SPEC.md R1): each way a node came to hold more than its capacity,
in a small Net of MeshCores (tests/test_mesh_core.py's), and what it does now instead.

What a node holds is judged by what its core orders its driver to run (the "run" and
"stop" decisions), the simulator checker's rule too (testnet/sim_checks.py).
"""

import dataclasses
import hashlib
import random

from keys.genesis import DEFAULT_PARAMS, Genesis
from protocol import codec
from protocol.mesh import MeshCore
from protocol.messages import Checkpoint, JobRefusal, decode_message, encode_message, job_id, placement_instance_id
from protocol.policy import LocalCapacity, NodePolicy
from protocol.ready import NO_INSTANCE, Decision, Ready
from test_mesh_core import GENESIS, IDS, KEYS, MESH, ZONES, Net, make_job


class DiskNet(Net):
    """A Net whose nodes keep what their cores persist, and restart from it."""

    def __init__(self, gpus=(1, 1, 1, 1), genesis=GENESIS):
        super().__init__(gpus=gpus, genesis=genesis)
        self.genesis, self.gpus = genesis, gpus
        self.disk = {key: {} for key in KEYS}
        self.restarted_at = {key: 0 for key in KEYS}   # index into decisions of the last restart

    def persist(self, src, ready):
        super().persist(src, ready)
        for record in ready.persist:
            if record.table != "certificates":
                self.disk[src][(record.table, record.key)] = record

    def restart(self, key):
        """The node crashes (its workloads die with it) and starts again from its disk."""
        index = KEYS.index(key)
        disk = self.disk[key].values()
        safety = [r for r in disk if r.table in ("votes", "locks", "evidence")
                  or (r.table == "reservations" and r.value.get("held"))]
        outcomes = [r.value["envelope"] for r in disk if r.table == "jobs"]
        self.cores[key] = MeshCore(
            identity=IDS[index], genesis=self.genesis, policy=NodePolicy(zone=ZONES[index]),
            capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * self.gpus[index]), rng=random.Random(100 + index),
            now_ms=self.now, history=list(self.certificates[key]), safety_records=safety, job_outcomes=outcomes)
        self.drains.pop(key, None)
        self.restarted_at[key] = len(self.decisions[key])
        return self.cores[key]

    def exit(self, key, jid, code=0):
        """The node's workload exits: its driver reports it (no stop order comes for it)."""
        self.decisions[key].append(Decision("exited", NO_INSTANCE, (jid,), b""))
        self.emit(key, self.cores[key].job_exited(jid, code, self.now))


def running(net, key) -> dict:
    """job id -> WorkloadRun the node's driver runs now, from the core's orders since its last restart."""
    runs = {}
    for decision in net.decisions[key][net.restarted_at[key]:]:
        if decision.value_kind in ("stop", "exited"):
            for jid in decision.value:
                runs.pop(jid, None)
        elif decision.value_kind == "run":
            runs.update((run.job_id, run) for run in decision.value)
    return runs


def assert_fits(net, key):
    """R1 on what the node runs: whole GPUs, each held by one workload, as many as asked."""
    runs = running(net, key).values()
    gpus = [g for run in runs for g in run.gpus]
    assert len(gpus) == len(set(gpus)) <= net.gpus[KEYS.index(key)], [(r.job_id.hex()[:8], r.gpus) for r in runs]
    assert all(len(run.gpus) == run.manifest.resources.gpus for run in runs)


def answer(core, jid):
    """'bid' or 'decline': the node's answer for a job's first placement (keyed by its instance)."""
    return core.bidding.mine[placement_instance_id(jid, 0)][0]


def test_r1_a_restarted_node_still_holds_what_its_bids_reserved():
    """Root cause: reservations lived in memory only. A node that bid, crashed and restarted
    bid the same GPU again for another job, and both bids could be decided. Now its
    reservation (and the bid itself) is persisted before the bid is sent and restored."""
    net = DiskNet(gpus=(1, 1, 1, 1))
    net.down = {KEYS[2], KEYS[3]}            # 2 of 4 equal stakes: nothing can be decided yet
    first, first_envelope = make_job(nonce=1, backups=0)
    net.submit(KEYS[0], first_envelope)
    net.run(20)
    node = KEYS[0]
    assert answer(net.cores[node], job_id(first)) == "bid"
    core = net.restart(node)
    iid = placement_instance_id(job_id(first), 0)
    assert core.ledger.reserved(iid) is not None and core.ledger.free_gpus() == ()
    second, second_envelope = make_job(nonce=2, backups=0)
    net.submit(node, second_envelope)
    assert answer(core, job_id(second)) == "decline"   # its only GPU is promised already
    net.down.clear()
    net.run(1500)
    for key in KEYS:
        views = [net.cores[k].job_view(j) for k in KEYS for j in (job_id(first), job_id(second))]
        assert all(v["state"] in ("placed", "running") for v in views)
        assert_fits(net, key)
    assert (net.cores[KEYS[1]].job_view(job_id(first))["primary"]
            != net.cores[KEYS[1]].job_view(job_id(second))["primary"])


def test_r1_a_bid_holds_its_reservation_for_as_long_as_its_instance_runs():
    """Root cause: a reservation expired after 8 maximal round timeouts while its bid could
    still be decided in a later round (a testnet saw round 47), so its GPU was promised
    to another job too. Now a live bid's reservation has no deadline."""
    genesis = Genesis(name="fast", created_ms=0, authorities=(), members=GENESIS.members,
                      params=dataclasses.replace(DEFAULT_PARAMS, round_timeout_max_ms=400))
    net = DiskNet(gpus=(1, 1, 1, 1), genesis=genesis)
    net.down = {KEYS[2], KEYS[3]}
    first, first_envelope = make_job(nonce=1, backups=0, mesh=genesis.mesh_id)
    net.submit(KEYS[0], first_envelope)
    net.run(8 * 400 + 600)                   # past the old lifetime; the instance still runs
    core = net.cores[KEYS[0]]
    assert job_id(first) in core.instances
    assert core.ledger.reserved(placement_instance_id(job_id(first), 0)) is not None
    second, second_envelope = make_job(nonce=2, backups=0, mesh=genesis.mesh_id)
    net.submit(KEYS[0], second_envelope)
    assert answer(core, job_id(second)) == "decline"
    net.down.clear()
    net.run(2000)
    for key in KEYS:
        assert_fits(net, key)


def test_r1_a_restart_rebuilds_the_ledger_from_the_final_job_table():
    """Root cause: a restart replayed the placements one by one into the ledger, and the
    exits only afterwards: a job placed where an exited one had been did not fit in between,
    stayed placed there with no allocation, and its GPU was bid away again. Now the ledger
    is rebuilt from the job table the history and the outcomes end in."""
    net = DiskNet(gpus=(1, 0, 0, 0))         # only node 0 can take a 1-GPU job
    node = KEYS[0]
    first, first_envelope = make_job(nonce=1, backups=0)
    net.submit(KEYS[1], first_envelope)
    net.run(100)
    assert net.cores[KEYS[1]].job_view(job_id(first))["primary"] == node
    net.exit(node, job_id(first))
    second, second_envelope = make_job(nonce=2, backups=0)
    net.submit(KEYS[1], second_envelope)
    net.run(100)
    assert net.cores[KEYS[1]].job_view(job_id(second))["primary"] == node
    core = net.restart(node)
    assert core.job_view(job_id(first))["state"] == "completed"
    assert core.ledger.allocated(job_id(second)) is not None and core.ledger.free_gpus() == ()
    net.run(300)                             # the restart's sync answers; its workload runs again
    assert set(running(net, node)) == {job_id(second)}
    third, third_envelope = make_job(nonce=3, backups=0)
    net.submit(KEYS[1], third_envelope)
    net.run(100)
    assert answer(core, job_id(third)) == "decline"
    assert_fits(net, node)


def test_r1_a_backup_without_room_refuses_a_migrated_job_and_it_is_placed_again():
    """Root cause: a migration onto a backup allocated best effort ("capacity_short") and the
    backup ran the job anyway. Now a backup with no room refuses it: a signed job_refusal,
    every node puts the job back to pending as a new attempt that uses up no retry, and it
    is placed once capacity frees."""
    net = DiskNet(gpus=(1, 1, 0, 0))         # nodes 2 and 3 have no GPU: node 1 is the only backup
    migrating, migrating_envelope = make_job(nonce=1, backups=1, max_retries=0)
    jid = job_id(migrating)
    net.submit(KEYS[2], migrating_envelope)
    net.run(100)
    view = net.cores[KEYS[2]].job_view(jid)
    primary, backup = view["primary"], view["backups"][0]
    assert {primary, backup} == {KEYS[0], KEYS[1]}
    filler, filler_envelope = make_job(nonce=2, backups=0)
    net.submit(KEYS[2], filler_envelope)
    net.run(100)
    assert net.cores[KEYS[2]].job_view(job_id(filler))["primary"] == backup   # the backup is full now
    net.down.add(primary)
    net.run(1000)                            # evicted; the job moves to the full backup, which refuses it
    survivors = [k for k in KEYS if k != primary]
    for key in survivors:
        assert_fits(net, key)
        view = net.cores[key].job_view(jid)
        assert (view["state"], view["primary"], view["attempt"]) == ("pending", None, 1), key.hex()[:8]
    assert net.cores[backup].counters["job_refused"] == 1
    assert jid not in running(net, backup)
    net.exit(backup, job_id(filler))
    net.run(3000)                            # room again: the pending attempt is placed there
    for key in survivors:
        view = net.cores[key].job_view(jid)
        assert (view["state"], view["primary"], view["attempt"]) == ("placed", backup, 1)
        assert_fits(net, key)
    assert jid in running(net, backup)


def test_r1_an_evicted_primary_keeps_the_allocation_of_a_job_no_backup_took():
    """Root cause: an evicted node freed the allocation of every job it was the primary of,
    also of one with no backup left, which stays its job in every table (F5): once it
    rejoined it ran the job again on capacity its ledger had given away (bids made since).
    Now it frees only the jobs that moved; while it is no member it runs nothing."""
    net = DiskNet(gpus=(1, 1, 1, 1))
    lonely, lonely_envelope = make_job(nonce=1, backups=0)
    jid = job_id(lonely)
    net.submit(KEYS[1], lonely_envelope)
    net.run(100)
    primary = net.cores[KEYS[1]].job_view(jid)["primary"]
    stale = net.cores[primary]
    assert running(net, primary)[jid].gpus == (0,)
    net.down.add(primary)
    net.run(1000)                            # evicted by the others; no backup takes the job
    assert all(primary not in net.cores[k].view.stakes for k in KEYS if k != primary)
    net.down.discard(primary)
    net.run(200)                             # it hears of its eviction
    assert not stale.is_member() and stale.job_view(jid)["primary"] == primary
    assert all(net.cores[k].job_view(jid)["primary"] == primary for k in KEYS)
    assert stale.ledger.allocated(jid) is not None and stale.ledger.free_gpus() == ()
    assert not running(net, primary)         # fenced: it runs nothing until it is a member again


def _certificate_deciding(job_envelope, gpus):
    """The commit certificate of a job's placement on node 0, decided in a Net of its own."""
    net = Net(gpus=gpus)
    net.submit(KEYS[1], job_envelope)
    net.run(100)
    (certificate,) = net.certificates[KEYS[0]]
    return certificate


def test_r1_a_placement_whose_reservation_is_gone_takes_free_gpus_or_is_refused():
    """Root cause: a placement decided after its primary's reservation was gone (released
    when its instance gave up there while others still decided, or expired) was allocated
    best effort: on other GPUs than the placement names while the job ran on the named
    ones, or not at all while it ran anyway. Now the primary runs it on the GPUs its ledger
    picked, or refuses it."""
    late, late_envelope = make_job(nonce=1, backups=0, max_retries=0)
    jid = job_id(late)
    certificate = _certificate_deciding(late_envelope, gpus=(2, 0, 0, 0))   # names node 0's GPU 0
    for gpus, refused in (((2, 0, 0, 0), False), ((1, 0, 0, 0), True)):
        net = DiskNet(gpus=gpus)
        holder, holder_envelope = make_job(nonce=2, backups=0)
        net.submit(KEYS[1], holder_envelope)
        net.run(100)
        assert net.cores[KEYS[1]].job_view(job_id(holder))["primary"] == KEYS[0]
        assert running(net, KEYS[0])[job_id(holder)].gpus == (0,)
        for key in KEYS:                     # the late certificate reaches every node
            net.emit(key, net.cores[key].step(certificate, net.now, KEYS[1]))
        net.run(100)
        view = net.cores[KEYS[2]].job_view(jid)
        if refused:
            assert (view["state"], view["attempt"], view["primary"]) == ("pending", 1, None)
            assert jid not in running(net, KEYS[0]) and net.cores[KEYS[0]].counters["job_refused"] == 1
            refusal = [d for d in net.events[KEYS[0]] if d.kind == "job_refused"]
            assert refusal and refusal[0].detail["by"] == KEYS[0].hex()
        else:
            assert view["primary"] == KEYS[0] and running(net, KEYS[0])[jid].gpus == (1,)
        for key in KEYS:
            assert_fits(net, key)


def test_a_refusal_counts_only_from_the_current_primary_at_the_current_fence():
    net = Net(gpus=(1, 1, 1, 1))
    job, envelope = make_job(nonce=1, backups=0)
    jid = job_id(job)
    net.submit(KEYS[1], envelope)
    net.run(100)
    primary = net.cores[KEYS[1]].job_view(jid)["primary"]
    other = next(k for k in KEYS if k not in (primary, KEYS[1]))
    core = net.cores[KEYS[1]]
    impostor = encode_message(IDS[KEYS.index(other)], core.mesh_id, JobRefusal(job_id=jid, fence=1))
    stale = encode_message(IDS[KEYS.index(primary)], core.mesh_id, JobRefusal(job_id=jid, fence=0))
    for data in (impostor, stale):
        core.step(data, net.now)
    assert core.counters["job_refusal_stale"] == 2 and core.job_view(jid)["state"] in ("placed", "running")


def test_r1_a_later_attempt_placed_elsewhere_frees_what_an_earlier_one_held_here():
    """A node that missed how an attempt it ran here ended (an exit or refusal it did not
    hear) learns the next attempt from its placement certificate: the earlier attempt's
    allocation goes with it, or its capacity would be held for nothing, for good."""
    retried, envelope = make_job(nonce=1, backups=0, max_retries=1)
    jid = job_id(retried)
    elsewhere = Net(gpus=(1, 1, 0, 0))       # the same start: placed on the first node ...
    elsewhere.submit(KEYS[2], envelope)
    elsewhere.run(100)
    first = elsewhere.cores[KEYS[2]].job_view(jid)["primary"]
    second = KEYS[1] if first == KEYS[0] else KEYS[0]
    exited = elsewhere.cores[first].job_exited(jid, 1, elsewhere.now)
    exits = [m for m in exited.messages if codec.unpack(m.data)[2] == "job_exit"]
    elsewhere.emit(first, Ready(messages=exits))   # its exit gets out, then it is gone ...
    elsewhere.down.add(first)                # ... and the retry goes to the second node
    elsewhere.run(300)
    view = elsewhere.cores[KEYS[2]].job_view(jid)
    assert (view["attempt"], view["primary"]) == (1, second)
    (retry_certificate,) = [c for c in elsewhere.certificates[second]
                            if decode_message(c, MESH)[1].instance == placement_instance_id(jid, 1)]
    net = DiskNet(gpus=(1, 1, 0, 0))
    net.submit(KEYS[2], envelope)
    net.run(100)
    node = net.cores[first]
    assert node.ledger.allocated(jid) is not None
    net.emit(first, node.step(retry_certificate, net.now, second))   # the exit never reached it
    net.deliver()
    assert node.job_view(jid)["primary"] == second and node.ledger.allocated(jid) is None
    assert node.ledger.free_gpus() == (0,) and jid not in running(net, first)


def test_r1_a_refused_job_placed_afresh_resumes_from_the_checkpoint_a_replica_hands_over():
    """Root cause of the revert: a job refused for want of room was placed again on a node
    that held none of its checkpoints, which ran it from progress 0 (the node-mode
    simulator saw 1,210 and 2,640 ms of lost work). Now every node holding the refused
    work's newest checkpoint hands it, as its primary signed it, to the new attempt's
    primary and backups; the primary waits for it before it runs, and resumes from it."""
    net = DiskNet(gpus=(1, 1, 1, 1))
    job, envelope = make_job(nonce=1, backups=1, max_retries=0)
    jid = job_id(job)
    net.submit(KEYS[2], envelope)
    net.run(100)
    view = net.cores[KEYS[2]].job_view(jid)
    primary, backup = view["primary"], view["backups"][0]
    net.emit(primary, net.cores[primary].local_checkpoint(jid, 5, 50, net.now, b"state-at-50", net.now))
    net.run(50)
    assert net.cores[backup].job_view(jid)["last_checkpoint_seq"] == 5
    filler, filler_envelope = make_job(nonce=2, backups=0)
    filler_entry = next(k for k in KEYS if k not in (primary, backup))
    net.submit(filler_entry, filler_envelope)
    net.run(100)
    while net.cores[filler_entry].job_view(job_id(filler))["primary"] != backup:   # fill the backup
        net.exit(net.cores[filler_entry].job_view(job_id(filler))["primary"], job_id(filler), code=1)
        net.run(300)
    net.down.add(primary)
    net.run(3000)                            # evicted; the full backup refuses it; placed afresh elsewhere
    assert net.cores[backup].counters["job_refused"] == 1
    new_primary = net.cores[backup].job_view(jid)["primary"]
    assert new_primary not in (None, primary, backup)
    run = running(net, new_primary)[jid]
    assert run.resume and run.fence == net.cores[new_primary].job_view(jid)["fence"]
    handed = [r.value for (table, _key), r in net.disk[new_primary].items()
              if table == "checkpoints" and r.value["job_id"] == jid]
    assert [(c["seq"], c["progress"], c["origin"], c["fence"]) for c in handed] == [(5, 50, primary, 1)]
    assert net.cores[new_primary].counters["checkpoint_handoff_timeout"] == 0
    # Only the node that was primary at the checkpoint's fence hands over, and only newer work.
    core = net.cores[new_primary]

    def relayed(signer, seq):
        message = Checkpoint(job_id=jid, fence=1, seq=seq, progress=10 * seq, taken_ms=net.now, state=b"s",
                             state_hash=hashlib.sha256(b"s").digest())
        return [r.value["seq"] for r in core.step(encode_message(signer, MESH, message), net.now).persist
                if r.table == "checkpoints"]

    assert relayed(IDS[KEYS.index(backup)], 9) == []          # never the job's primary at fence 1
    assert relayed(IDS[KEYS.index(primary)], 4) == []         # older than the one it holds
    assert relayed(IDS[KEYS.index(primary)], 6) == [6]        # newer work of the same attempt line
