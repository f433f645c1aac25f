"""SPEC.md R2: an owner moves a healthy running job to another node, decided by the vote;
the old primary's final checkpoint is handed to the new one, which resumes from it."""

import hashlib
import random

import pytest

from protocol.errors import RemoteProtocolError
from protocol.flows.binding import certificate_binding_error
from protocol.flows.move import move_backups
from protocol.messages import (Checkpoint, JobMove, MoveRequest, decode_message, encode_message, job_id,
                               move_instance_id, SyncRequest)
from protocol.mesh import MeshCore
from protocol.ready import Outbound, Ready
from protocol.policy import LocalCapacity, NodePolicy
from tests.test_mesh_core import GENESIS, IDS, KEYS, MESH, OWNER, Net, make_job


def running_job(gpus=(4, 2, 2, 2)):
    """(net, job id, primary): a 1-GPU job with one backup, placed on KEYS[0] (most GPUs),
    running with checkpoint seq 1 taken, and every node's capability vector known to all."""
    net = Net(gpus=gpus)
    job, envelope = make_job(backups=1)
    net.submit(KEYS[1], envelope)
    net.run(50)
    jid = job_id(job)
    primary = net.cores[KEYS[1]].job_view(jid)["primary"]
    net.emit(primary, net.cores[primary].workload_started(jid, 1, 0, net.now))
    net.emit(primary, net.cores[primary].local_checkpoint(jid, 1, 10, net.now, b"state-1", net.now))
    for key, core in net.cores.items():
        net.emit(key, core.update_telemetry((), 0, net.now))
    net.run(20)
    return net, jid, primary


def move_request(jid, fence, to_node=b"", signer=OWNER):
    return encode_message(signer, MESH, MoveRequest(job_id=jid, fence=fence, to_node=to_node, requested_ms=7))


def ask(net, at, request):
    got, ready = net.cores[at].request_move(request, net.now)
    net.emit(at, ready)
    return got


def orders(net, key, kind):
    return [d.value for d in net.decisions[key] if d.value_kind == kind]


def test_r2_a_move_is_decided_everywhere_and_the_new_primary_resumes_from_the_final_checkpoint():
    net, jid, primary = running_job()
    old_backups = net.cores[primary].job_view(jid)["backups"]
    assert ask(net, primary, move_request(jid, 1)) == jid
    net.run(30)
    moves = [net.certified(k, "job_move") for k in KEYS]
    assert all(len(m) == 1 and m[0].value == moves[0][0].value for m in moves)
    target = moves[0][0].value.to_node
    assert target != primary
    for core in net.cores.values():
        view = core.job_view(jid)
        assert (view["primary"], view["fence"], view["migrations"]) == (target, 2, 1)
        assert view["backups"] == move_backups(type("R", (), {"backups": old_backups, "primary": primary})(),
                                               target, core.view.stakes)
    assert orders(net, primary, "stop")[-1] == (jid,)
    assert net.cores[primary].ledger.allocated(jid) is None
    # The new primary holds the capacity but waits for the old run's final checkpoint.
    assert net.cores[target].ledger.allocated(jid) is not None
    assert not orders(net, target, "run")
    net.emit(primary, net.cores[primary].hand_over_moved(jid, 1, (2, 25, net.now, b"final"), net.now))
    net.run(10)
    run, = orders(net, target, "run")[-1]
    assert (run.job_id, run.fence, run.resume) == (jid, 2, True)
    assert net.cores[target].job_view(jid)["last_checkpoint_seq"] == 2
    # Once the new run started, a late checkpoint of the old primary is refused (fenced).
    net.emit(target, net.cores[target].workload_started(jid, 2, 2, net.now))
    late = Checkpoint(job_id=jid, fence=1, seq=3, progress=30, taken_ms=net.now, state=b"late",
                      state_hash=hashlib.sha256(b"late").digest())
    before = net.cores[target].counters["checkpoint_stale_fence"]
    ready = net.cores[target].step(encode_message(IDS[KEYS.index(primary)], MESH, late), net.now)
    assert not ready.persist and net.cores[target].counters["checkpoint_stale_fence"] == before + 1


def test_r2a_the_new_run_waits_for_the_old_run_to_stop_however_long_and_a_lost_hand_over_is_sent_again():
    net, jid, primary = running_job()
    target = next(k for k in KEYS if k not in (primary, net.cores[primary].job_view(jid)["backups"][0]))
    ask(net, KEYS[3], move_request(jid, 1, to_node=target))
    net.run(30)
    assert all(c.job_view(jid)["primary"] == target for c in net.cores.values())
    net.run(5000)   # the old primary's driver has not reported its run stopped: no timer starts the new one
    assert not orders(net, target, "run")
    # The run stopped (nothing offered since checkpoint 1); the hand-over is lost on the way.
    lost = net.cores[primary].hand_over_moved(jid, 1, None, net.now)
    assert [decode_message(m.data, MESH)[1].KIND for m in lost.messages if m.to == target] == [
        "checkpoint", "run_stopped"]
    lost.messages.clear()
    net.emit(primary, lost)
    net.run(500)
    assert not orders(net, target, "run")
    net.run(1000)   # sent again while the new primary's vector does not show the new run
    run, = orders(net, target, "run")[-1]
    assert (run.fence, run.resume) == (2, True) and net.cores[target].job_view(jid)["last_checkpoint_seq"] == 1
    assert net.cores[primary].counters["move_handover_resent"] >= 1
    net.emit(target, net.cores[target].workload_started(jid, 2, 1, net.now))
    net.emit(target, net.cores[target].update_telemetry((), 0, net.now))
    net.run(50)
    sent = net.cores[primary].counters["move_handover_resent"]
    net.run(3000)   # the new run shows in its vector: nothing more is sent
    assert net.cores[primary].counters["move_handover_resent"] == sent


def test_r2b_a_sync_request_of_the_new_primary_brings_a_lost_hand_over_at_once():
    # Simulator seed 166: the new primary restarted while the hand-over was in flight, and
    # the old one would not resend for 1 s (its last send under 250 ms old at the vector).
    net, jid, primary = running_job()
    target = next(k for k in KEYS if k not in (primary, net.cores[primary].job_view(jid)["backups"][0]))
    ask(net, KEYS[3], move_request(jid, 1, to_node=target))
    net.run(30)
    lost = net.cores[primary].hand_over_moved(jid, 1, None, net.now)
    lost.messages.clear()
    net.emit(primary, lost)
    net.run(100)
    assert not orders(net, target, "run")
    sync = net.cores[target].ctx.sign(SyncRequest(epoch=net.cores[target].epoch))
    net.emit(target, Ready(messages=[Outbound(primary, sync)]))
    net.run(50)   # well before the 1000 ms resend
    run, = orders(net, target, "run")[-1]
    assert (run.fence, run.resume) == (2, True)
    assert net.cores[primary].counters["move_handover_resent"] == 1


def test_r2a_the_new_run_starts_once_the_dead_old_primary_is_evicted_and_not_before():
    net, jid, primary = running_job()
    target = next(k for k in KEYS if k not in (primary, net.cores[primary].job_view(jid)["backups"][0]))
    ask(net, KEYS[3], move_request(jid, 1, to_node=target))
    net.run(30)
    net.down.add(primary)   # it dies before its run's stop is reported: no hand-over ever comes
    net.run(200)
    assert not orders(net, target, "run")
    net.run(4000)   # evicted (F5): its self-fencing stopped the run (F3)
    assert primary not in net.cores[target].view.stakes
    run, = orders(net, target, "run")[-1]
    assert run.fence >= 2 and net.cores[target].counters["move_old_primary_gone"] == 1


def test_r2a_a_run_stopped_names_the_checkpoint_to_wait_for_and_a_forged_one_is_ignored():
    net, jid, primary = running_job()
    target = next(k for k in KEYS if k not in (primary, net.cores[primary].job_view(jid)["backups"][0]))
    ask(net, KEYS[3], move_request(jid, 1, to_node=target))
    net.run(30)
    from protocol.messages import RunStopped
    core = net.cores[target]
    other = next(k for k in KEYS if k not in (primary, target))
    forged = encode_message(IDS[KEYS.index(other)], MESH, RunStopped(job_id=jid, fence=1, seq=0))
    net.emit(target, core.step(forged, net.now))
    ahead = encode_message(IDS[KEYS.index(primary)], MESH, RunStopped(job_id=jid, fence=1, seq=2))
    net.emit(target, core.step(ahead, net.now))   # its checkpoint 2 has not come: still waiting
    net.run(10)
    assert not orders(net, target, "run") and core.counters["run_stopped_stale"] == 1
    final = Checkpoint(job_id=jid, fence=1, seq=2, progress=20, taken_ms=net.now, state=b"final",
                       state_hash=hashlib.sha256(b"final").digest())
    net.emit(target, core.step(encode_message(IDS[KEYS.index(primary)], MESH, final), net.now))
    net.run(10)
    run, = orders(net, target, "run")[-1]
    assert run.fence == 2 and core.job_view(jid)["last_checkpoint_seq"] == 2


@pytest.mark.parametrize("case, match", [
    ("not_owner", "only the job's owner"),
    ("to_itself", "already runs on"),
    ("stale_fence", "at fence 1 .*stale or replayed"),
    ("no_room", "has no room for it: not_enough_gpus"),
    ("not_member", "not a member"),
    ("unknown_job", "unknown job"),
])
def test_r2_a_move_that_cannot_happen_is_refused_with_its_reason_and_nothing_changes(case, match):
    net, jid, primary = running_job(gpus=(4, 2, 2, 0))
    no_gpu = KEYS[3]
    request = {
        "not_owner": move_request(jid, 1, signer=IDS[2]),
        "to_itself": move_request(jid, 1, to_node=primary),
        "stale_fence": move_request(jid, 0),
        "no_room": move_request(jid, 1, to_node=no_gpu),
        "not_member": move_request(jid, 1, to_node=hashlib.sha256(b"stranger").digest()),
        "unknown_job": move_request(hashlib.sha256(b"nope").digest(), 1),
    }[case]
    before = {k: c.job_view(jid) for k, c in net.cores.items()}
    with pytest.raises(RemoteProtocolError, match=match):
        net.cores[KEYS[1]].request_move(request, net.now)
    # The same request broadcast by a Byzantine entry node starts nothing anywhere.
    for core in net.cores.values():
        core.step(request, net.now)
    net.run(100)
    assert {k: c.job_view(jid) for k, c in net.cores.items()} == before
    assert not any(net.certified(k, "job_move") for k in KEYS)


def test_r2_a_replayed_request_is_stale_once_the_job_moved():
    net, jid, primary = running_job()
    request = move_request(jid, 1)
    ask(net, primary, request)
    net.run(30)
    target = net.cores[primary].job_view(jid)["primary"]
    net.emit(target, net.cores[target].workload_started(jid, 2, 0, net.now))
    net.run(150)
    with pytest.raises(RemoteProtocolError, match="stale or replayed"):
        net.cores[target].request_move(request, net.now)
    for core in net.cores.values():
        core.step(request, net.now)
    net.run(100)
    assert all(c.job_view(jid)["fence"] == 2 for c in net.cores.values())


def test_r2_a_pending_job_cannot_be_moved():
    net = Net(gpus=(0, 0, 0, 0))
    job, envelope = make_job()
    net.submit(KEYS[0], envelope)
    net.run(50)
    with pytest.raises(RemoteProtocolError, match="pending, not running"):
        net.cores[KEYS[0]].request_move(move_request(job_id(job), 0), net.now)


def test_r2_validators_refuse_a_move_that_breaks_the_rule():
    net, jid, primary = running_job(gpus=(4, 2, 2, 0))
    core = net.cores[KEYS[1]]
    flow = core.moves
    record = core.job_table.get(jid)
    request = MoveRequest(job_id=jid, fence=1, to_node=b"", requested_ms=7)
    envelope = move_request(jid, 1)
    iid = move_instance_id(jid, 1)

    def error(to_node, backups=None, vector_of=None):
        vector_envelope, vector = core.capability.signed_vector(vector_of or to_node, net.now)
        move = JobMove(request=envelope, from_node=primary, to_node=to_node,
                       backups=move_backups(record, to_node, core.view.stakes) if backups is None else backups,
                       capability=vector_envelope)
        return flow.move_error(iid, move, OWNER.public_key, request, vector.node, vector, core.view)

    assert error(KEYS[2]) is None
    assert "no room" in error(KEYS[3])
    assert "another node's capability vector" in error(KEYS[2], vector_of=KEYS[1])
    assert "backups do not follow" in error(KEYS[2], backups=(KEYS[3],))
    assert "its own primary" in error(primary)


def test_r2_a_move_certificate_binds_its_instance_for_cert_verify():
    """flows/binding.py: `meshnode cert verify` accepts a job_move certificate only under the
    instance its request names (votes sign only the value's hash)."""
    net, jid, primary = running_job()
    ask(net, primary, move_request(jid, 1))
    net.run(30)
    assert_move_certificate_binds_its_instance(net, jid)


def assert_move_certificate_binds_its_instance(net, jid):
    data = net.certificates[KEYS[2]][-1]
    _envelope, cert = decode_message(data, MESH)
    assert cert.value_kind == "job_move"
    assert certificate_binding_error("job_move", cert.instance, cert.value, cert.epoch, MESH, 0) is None
    assert "another instance" in certificate_binding_error("job_move", move_instance_id(jid, 2), cert.value,
                                                           cert.epoch, MESH, 0)


def test_r2_a_hand_over_the_new_primary_already_holds_ends_its_wait():
    """The old run offered nothing after its last checkpoint, which the new primary (a
    backup) already holds: the old primary re-sends it, and the run starts from it at once."""
    net, jid, primary = running_job()
    backup = net.cores[primary].job_view(jid)["backups"][0]
    assert net.cores[backup].job_view(jid)["last_checkpoint_seq"] == 1
    ask(net, primary, move_request(jid, 1, to_node=backup))
    net.run(30)
    assert not orders(net, backup, "run")
    net.emit(primary, net.cores[primary].hand_over_moved(jid, 1, None, net.now))
    net.run(10)
    run, = orders(net, backup, "run")[-1]
    assert (run.fence, run.resume) == (2, True) and net.cores[backup].job_view(jid)["last_checkpoint_seq"] == 1
    assert net.cores[backup].counters["checkpoint_handoff_timeout"] == 0
    assert not net.cores[backup].lifecycle.stop_waits


def test_r2_a_move_learnt_after_an_eviction_ends_where_it_ends_when_learnt_before():
    """The owner moves the job off a primary that is dead; the eviction of that primary is
    decided after the move. A node that applies the two in the other order (here: a restart
    replaying its certificates eviction first) still ends with the job where the move put
    it, at the same fence (as P5 replays evictions for a late placement)."""
    net, jid, primary = running_job()
    backup = net.cores[primary].job_view(jid)["backups"][0]
    target = next(k for k in KEYS if k not in (primary, backup))
    net.down.add(primary)
    ask(net, KEYS[3] if target != KEYS[3] else KEYS[2], move_request(jid, 1, to_node=target))
    net.run(600)
    witness = next(k for k in KEYS if k not in (primary, target))
    kinds = [decode_message(c, MESH)[1].value_kind for c in net.certificates[witness]]
    assert "job_move" in kinds and "eviction" in kinds and kinds.index("job_move") < kinds.index("eviction")
    in_order = net.cores[witness].job_view(jid)
    assert (in_order["primary"], in_order["fence"]) == (target, 2)
    placement, *later = net.certificates[witness]
    swapped = [placement] + sorted(later, key=lambda c: kinds[net.certificates[witness].index(c)] != "eviction")
    replayed = MeshCore(identity=IDS[KEYS.index(witness)], genesis=GENESIS, policy=NodePolicy(zone="zone-a"),
                        capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * 2), rng=random.Random(9), now_ms=net.now,
                        history=swapped)
    view = replayed.job_view(jid)
    assert (view["primary"], view["backups"], view["fence"]) == (target, in_order["backups"], 2)
    assert replayed.counters["move_after_evictions"] == 1
