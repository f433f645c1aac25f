"""SPEC.md R3: a manifest's reflex rule moves its job off a hot primary, decided by the vote
from the primary's signed capability vectors; evidence, cooldown and target are checked."""

import dataclasses

import pytest

from protocol import codec
from protocol.errors import RemoteProtocolError
from protocol.flows.move import decode_request
from protocol.messages import JobManifest, JobMove, Reflex, ReflexTrigger, encode_message, job_id, move_instance_id
from tests.test_job_move import assert_move_certificate_binds_its_instance
from tests.test_mesh_core import IDS, KEYS, MESH, OWNER, Net, make_job

HOT_UTIL = 95_000


def rule(for_ms=2000, cooldown_ms=60_000, signal="gpu_util", above=80, zone=""):
    return Reflex(signal=signal, above=above, below=None, for_ms=for_ms, zone=zone, action="migrate",
                  cooldown_ms=cooldown_ms)


def running_reflex_job(*rules, net_gpus=(4, 2, 2, 2), **manifest_changes):
    """(net, job id, primary): a 1-GPU job with ``rules`` (and ``manifest_changes``), running
    on KEYS[0] (most GPUs), every node's vector known to all."""
    net = Net(gpus=net_gpus)
    job, _ = make_job(backups=1)
    job = dataclasses.replace(job, reflexes=tuple(rules), **manifest_changes)
    net.submit(KEYS[1], encode_message(OWNER, MESH, job))
    net.run(50)
    jid = job_id(job)
    primary = net.cores[KEYS[1]].job_view(jid)["primary"]
    net.emit(primary, net.cores[primary].workload_started(jid, 1, 0, net.now))
    for key, core in net.cores.items():
        net.emit(key, core.update_telemetry((), 0, net.now))
    net.run(20)
    return net, jid, primary


def telemetry(net, key, util_milli):
    gpus = tuple(dataclasses.replace(g, util_milli=util_milli) for g in net.cores[key].capability._gpu_states())
    net.emit(key, net.cores[key].update_telemetry(gpus, 0, net.now))


def hold(net, key, util_milli, ms, every_ms=250):
    """``key``'s GPUs read ``util_milli`` for ``ms``, every other node's stay idle."""
    for _ in range(ms // every_ms):
        for other in net.cores:
            telemetry(net, other, util_milli if other == key else 0)
        net.run(every_ms)


def reflex_moves(net, key):
    return [m for m in net.certified(key, "job_move")
            if isinstance(decode_request(m.value.request, MESH)[1], ReflexTrigger)]


def test_r3_a_rule_that_holds_for_its_duration_moves_the_job_once():
    net, jid, primary = running_reflex_job(rule(for_ms=2000))
    hold(net, primary, HOT_UTIL, 3500)
    moves = [reflex_moves(net, k) for k in KEYS]
    assert all(len(m) == 1 and m[0].value == moves[0][0].value for m in moves)
    move = moves[0][0].value
    _envelope, trigger = decode_request(move.request, MESH)
    assert (trigger.job_id, trigger.fence, trigger.rule) == (jid, 1, 0)
    assert move.from_node == primary and move.to_node != primary
    for core in net.cores.values():
        view = core.job_view(jid)
        assert (view["primary"], view["fence"], view["migrations"]) == (move.to_node, 2, 1)
    moved = [e for e in net.events[KEYS[2]] if e.kind == "moved"]
    assert moved[-1].detail["reflex"] == 0 and moved[-1].detail["signal"] == "gpu_util" and moved[-1].detail["held_ms"] >= 2000
    # Decided once: the nodes that noticed later joined the same instance.
    assert sum(net.cores[k].counters["reflex_noticed"] for k in KEYS) >= 1


def test_r3_a_condition_interrupted_before_its_duration_moves_nothing():
    net, jid, primary = running_reflex_job(rule(for_ms=2000))
    for _ in range(3):
        hold(net, primary, HOT_UTIL, 1500)
        hold(net, primary, 10_000, 500)
    hold(net, primary, HOT_UTIL - 20_000, 3000)   # 75%: not above 80
    assert not any(reflex_moves(net, k) for k in KEYS)
    assert all(c.job_view(jid)["primary"] == primary for c in net.cores.values())


def test_r3_a_rule_of_another_zone_moves_nothing():
    net, jid, primary = running_reflex_job(rule(for_ms=1000, zone="elsewhere"))
    hold(net, primary, HOT_UTIL, 2500)
    assert not any(reflex_moves(net, k) for k in KEYS)


def _evidence(net, primary, count):
    return [env for env, _cap in net.cores[primary].capability.history.of(primary)][-count:]


def test_r3_validators_refuse_forged_or_insufficient_evidence():
    net, jid, primary = running_reflex_job(rule(for_ms=1500, cooldown_ms=0))
    for other in net.cores:
        net.cores[other].moves.notice_reflexes = lambda *args: None   # nobody triggers: we do
    hold(net, primary, HOT_UTIL, 3500)
    core = net.cores[KEYS[2]]
    record = core.job_table.get(jid)
    history = net.cores[primary].capability.history.of(primary)
    hot = [env for env, cap in history if cap.gpus[0].util_milli == HOT_UTIL]
    assert len(hot) >= 3
    target = next(k for k in KEYS if k != primary)
    vector_envelope, vector = core.capability.signed_vector(target, net.now)
    iid = move_instance_id(jid, 1)

    def error(evidence, rule_index=0, signer=IDS[3], fence=1):
        trigger = ReflexTrigger(job_id=jid, fence=fence, rule=rule_index, evidence=tuple(evidence))
        data = encode_message(signer, MESH, trigger)
        move = JobMove(request=data, from_node=primary, to_node=target, backups=tuple(
            b for b in record.backups if b != target) or (primary,), capability=vector_envelope)
        return core.moves.move_error(iid, move, signer.public_key, trigger, vector.node, vector, core.view)

    assert error(hot) is None
    assert "consecutive" in error(hot[:1] + hot[2:])
    assert "the rule asks 1500 ms" in error(hot[-2:])
    assert "not the primary's" in error(hot[:-1] + [vector_envelope])
    assert "no reflex rule 1" in error(hot, rule_index=1)
    assert "another instance" in error(hot, fence=0)
    cool = [env for env, cap in history if cap.gpus[0].util_milli == 0][-1:]
    assert "does not show the condition" in error(cool + hot[:1]) or "consecutive" in error(cool + hot[:1])
    outsider = type(OWNER)(b"\x07" * 32)
    assert "not signed by a member" in error(hot, signer=outsider)


def test_r3_no_second_reflex_move_within_the_cooldown_and_one_after_it():
    net, jid, primary = running_reflex_job(rule(for_ms=1000, cooldown_ms=6000))
    hold(net, primary, HOT_UTIL, 2000)
    first = net.cores[KEYS[1]].job_view(jid)["primary"]
    assert first != primary and len(reflex_moves(net, KEYS[1])) == 1
    net.emit(first, net.cores[first].workload_started(jid, 2, 0, net.now))
    net.run(20)
    hold(net, first, HOT_UTIL, 4000)   # hot for 4 s, but within 6 s of the first reflex
    assert len(reflex_moves(net, KEYS[1])) == 1
    assert all(c.job_view(jid)["primary"] == first for c in net.cores.values())
    hold(net, first, HOT_UTIL, 4000)
    assert len(reflex_moves(net, KEYS[1])) == 2
    assert all(c.job_view(jid)["primary"] not in (first,) for c in net.cores.values())


def test_r3_a_reflex_never_moves_onto_a_node_showing_the_condition():
    net, jid, primary = running_reflex_job(rule(for_ms=1000))
    for _ in range(10):   # every node hot: nowhere to go
        for key in net.cores:
            telemetry(net, key, HOT_UTIL)
        net.run(250)
    assert not any(reflex_moves(net, k) for k in KEYS)
    assert any(e.kind == "move_no_target" for k in KEYS for e in net.events[k])


def test_r3_a_reflex_move_certificate_binds_its_instance_for_cert_verify():
    net, jid, primary = running_reflex_job(rule(for_ms=1000))
    hold(net, primary, HOT_UTIL, 2000)
    assert_move_certificate_binds_its_instance(net, jid)


def test_4_2_a_manifest_without_reflexes_keeps_its_body_and_an_empty_list_is_refused():
    job, _ = make_job()
    body = job.to_body()
    assert "reflexes" not in body
    with pytest.raises(RemoteProtocolError, match="reflexes: an empty list is left out"):
        JobManifest.from_body({**body, "reflexes": []})
    with_rule = dataclasses.replace(job, reflexes=(rule(),))
    assert JobManifest.from_body(codec.unpack(codec.pack(with_rule.to_body()))) == with_rule
    assert job_id(with_rule) != job_id(job)


def test_r3_a_reflex_never_moves_onto_a_node_with_an_unhealthy_gpu():
    net, jid, primary = running_reflex_job(rule(for_ms=1000))
    others = [k for k in KEYS if k != primary]
    for _ in range(10):   # the others read ECC errors on one GPU: sick, though not hot
        for key in net.cores:
            gpus = [dataclasses.replace(g, util_milli=HOT_UTIL if key == primary else 0)
                    for g in net.cores[key].capability._gpu_states()]
            if key in others:
                gpus[0] = dataclasses.replace(gpus[0], ecc_errors=1)
            net.emit(key, net.cores[key].update_telemetry(tuple(gpus), 0, net.now))
        net.run(250)
    assert not any(reflex_moves(net, k) for k in KEYS)
    assert any(e.kind == "move_no_target" and "unhealthy GPU" in e.detail["why"] for k in KEYS
               for e in net.events[k])


def test_r3_a_short_simulator_sweep_with_reflexes_and_faults_keeps_every_check():
    from testnet.sim import SimConfig, Simulation
    results = [Simulation(SimConfig(nodes=4, jobs=4, seed=seed, reflex_per_mille=600, byzantine_milli=200)).run()
               for seed in (0, 9, 13)]   # seeds whose worlds move on GPU and on job signals, and clone (P1b, R4)
    assert [r.violation_count for r in results] == [0, 0, 0]
    assert not any(r.liveness_missing for r in results)
    assert sum(r.counters["reflex_moves"] for r in results) > 0
    assert sum(r.counters["reflex_moves_job_signal"] for r in results) > 0   # R3a: on reported latency
    assert sum(r.counters["replica_actions"] for r in results) > 0   # R4


def test_r3_the_simulator_audit_catches_a_reflex_applied_twice():
    from types import SimpleNamespace
    from testnet.sim_reflex import ReflexAudit
    net, jid, primary = running_reflex_job(rule(for_ms=1000))
    hold(net, primary, HOT_UTIL, 2000)
    decision = reflex_moves(net, KEYS[1])[0]
    failures = []
    audit = ReflexAudit(MESH, SimpleNamespace(fail=lambda *args: failures.append(args)))
    node = SimpleNamespace(index=1, incarnation=0)
    audit.check(node, decision)
    assert not failures
    audit.check(node, decision)
    assert failures and failures[0][0] == "reflex_applied_twice"


def test_r3_the_cooldown_counts_on_one_node_clock_only():
    from protocol.reflexes import cooldown_bounds
    r = rule(for_ms=1000, cooldown_ms=5000)
    a, b = KEYS[0], KEYS[1]
    assert cooldown_bounds(r, None, a) == (1000, 0)
    assert cooldown_bounds(r, (a, 700), a) == (1000, 5700)    # back on the node it left: that node's clock
    assert cooldown_bounds(r, (b, 700), a) == (5000, 0)       # elsewhere: the condition holds the cooldown long
