"""SPEC.md R4: replicas of a job, and clone / reroute / decay decided as replica actions from
the primary's signed vectors; bounds, cooldown, one application per action number, the
ledger, evictions and the endpoint table."""

import dataclasses

from protocol import codec
from protocol.messages import REPLICA_WEIGHT, Reflex, ReplicaAction, Service, replica_instance_id, replica_key
from protocol.replicas import endpoint_table
from tests.test_mesh_core import KEYS, MESH, make_job
from tests.test_reflex import hold, running_reflex_job, telemetry

HOT, COOL = 95_000, 5_000


def rule(action, amount, above=80, below=None, for_ms=1000, cooldown_ms=0):
    return Reflex(signal="gpu_util", above=above, below=below, for_ms=for_ms, zone="", action=action,
                  cooldown_ms=cooldown_ms, amount=amount)


def running_replicated_job(*rules, service=Service(port=8080, min_replicas=1, max_replicas=3), **net):
    """(net, job id, primary): a 1-GPU job with ``rules`` and ``service``, running, every
    node's vector known to all."""
    return running_reflex_job(*rules, service=service, **net)


def readings(net, times):
    """Every live node reads its GPUs ``times`` times, each reading new (so each is a new vector)."""
    for i in range(times):
        for key in KEYS:
            if key not in net.down:
                telemetry(net, key, 1000 + 100 * i)
        net.run(300)


def hold_on(net, keys, util_milli, ms, every_ms=250):
    """The GPUs of the nodes ``keys`` read ``util_milli`` for ``ms``, every other node's stay idle."""
    for _ in range(ms // every_ms):
        for other in net.cores:
            if other not in net.down:
                telemetry(net, other, util_milli if other in keys else 0)
        net.run(every_ms)


def actions(net, key):
    return [d.value for d in net.certified(key, "replica_action")]


def records(net, jid):
    return {key: net.cores[key].job_table.get(jid) for key in KEYS}


def test_r4_clone_adds_one_replica_on_another_healthy_node_once_and_every_member_agrees():
    net, jid, primary = running_replicated_job(rule("clone", 1))
    hold(net, primary, HOT, 1500)
    net.run(200)
    decided = {key: actions(net, key) for key in KEYS}
    assert all(len(a) == 1 for a in decided.values()), decided   # one clone, at every member
    clone = decided[KEYS[0]][0]
    assert clone.seq == 0 and len(clone.nodes) == 1 and clone.nodes[0] != primary
    tables = {key: endpoint_table(r, lambda node: node.hex()[:4]) for key, r in records(net, jid).items()}
    assert len({repr(t) for t in tables.values()}) == 1   # the same table at every member
    table = tables[KEYS[0]]
    assert [(row["replica"], row["node"], row["weight"], row["port"]) for row in table] == [
        (0, primary, REPLICA_WEIGHT, 8080), (1, clone.nodes[0], REPLICA_WEIGHT, 8080)]
    # The new replica's node holds it through its ledger (R1) and is ordered to run it.
    holder = net.cores[clone.nodes[0]]
    assert holder.ledger.allocated(replica_key(jid, 1)) is not None
    runs = [run for d in net.decisions[clone.nodes[0]] if d.value_kind == "run" for run in d.value]
    assert [(run.job_id, run.replica) for run in runs] == [(replica_key(jid, 1), 1)]
    events = [e for e in net.events[KEYS[2]] if e.kind == "replica_action"]
    assert events[0].detail["action"] == "clone" and events[0].detail["held_ms"] >= 1000


def test_r4_never_beyond_max_replicas_and_the_bound_is_checked_by_validators():
    net, jid, primary = running_replicated_job(rule("clone", 3), service=Service(max_replicas=2))
    hold(net, primary, HOT, 3000)
    net.run(200)
    assert [len(a.nodes) for a in actions(net, KEYS[0])] == [1]   # amount 3, but max_replicas 2
    record = net.cores[KEYS[0]].job_table.get(jid)
    assert len(record.replicas) == 1
    # A value adding another replica is refused by every validator, naming the bound.
    flow = net.cores[KEYS[3]].replicas
    extra = ReplicaAction(job_id=jid, seq=1, anchor=9, trigger=b"", nodes=(), capabilities=(), replicas=(),
                          weights=())
    error = flow.action_value_error(replica_instance_id(jid, 1, 9), extra, net.cores[KEYS[3]].view)
    assert "min_replicas already" in error


def test_r4_fill_brings_a_job_to_its_min_replicas_without_any_rule():
    net, jid, primary = running_replicated_job(service=Service(port=9000, min_replicas=3, max_replicas=3))
    readings(net, 4)
    record = net.cores[KEYS[0]].job_table.get(jid)
    assert 1 + len(record.replicas) == 3
    nodes = {primary} | {r.node for r in record.replicas.values()}
    assert len(nodes) == 3   # three replicas on three nodes
    assert all(a.trigger == b"" for a in actions(net, KEYS[0]))


def test_r4_reroute_and_decay_change_weights_and_a_below_rule_decays_the_clone_away():
    net, jid, primary = running_replicated_job(
        rule("clone", 1, cooldown_ms=60_000), rule("reroute", 50, cooldown_ms=60_000),
        rule("decay", 50, cooldown_ms=60_000), rule("decay", 100, above=None, below=20, for_ms=1000, cooldown_ms=0))
    # The example: the original hot, the clone idle (no request reaches it before the
    # reroute). The clone reads the mean over the replicas (R4g); reroute and decay read the
    # original they shed load from, so they follow the clone with it still idle.
    hold_on(net, {primary}, HOT, 4000)
    net.run(300)
    record = net.cores[KEYS[0]].job_table.get(jid)
    kinds = [e.detail["action"] for e in net.events[KEYS[0]] if e.kind == "replica_action"]
    assert kinds == ["clone", "reroute", "decay"], kinds   # each once: their cooldowns
    assert len(record.replicas) == 1
    # reroute 50%: half the original's 1000 to the clone; decay 50%: the original's 500 halved.
    assert (record.primary_weight, record.replicas[1].weight) == (250, 1500)
    # Cooled down, the below rule retires the clone (weight 0) and its node frees its claim.
    clone_node = next(iter(record.replicas.values())).node
    hold(net, primary, COOL, 3000)
    net.run(300)
    assert record.replicas == {}
    assert net.cores[clone_node].ledger.allocated(replica_key(jid, 1)) is None
    assert [e.detail["action"] for e in net.events[KEYS[0]] if e.kind == "replica_action"][-1] == "decay"
    # All members ended with the same weights and actions.
    assert len({(r.replica_seq, r.primary_weight, repr(r.replicas)) for r in records(net, jid).values()}) == 1


def test_r4_a_second_value_at_the_same_action_number_is_stale():
    net, jid, primary = running_replicated_job(rule("clone", 1))
    hold(net, primary, HOT, 1500)
    net.run(200)
    core = net.cores[KEYS[2]]
    done = actions(net, KEYS[2])[0]
    again = dataclasses.replace(done, anchor=done.anchor + 1)   # another noticer's value, same number
    error = core.replicas.action_value_error(replica_instance_id(jid, 0, again.anchor), again, core.view)
    assert "stale" in error
    from protocol.ready import Ready
    before = core.job_table.get(jid).replica_seq
    core.replicas.apply(replica_instance_id(jid, 0, again.anchor), "replica_action", again, b"", 0, net.now, Ready())
    assert core.job_table.get(jid).replica_seq == before and core.counters["replica_action_stale"] == 1


def test_r4_a_replica_on_an_evicted_node_is_dropped_and_a_fill_replaces_it():
    net, jid, primary = running_replicated_job(service=Service(port=9000, min_replicas=2, max_replicas=2))
    readings(net, 3)
    record = net.cores[primary].job_table.get(jid)
    victim = record.replicas[1].node
    net.down.add(victim)
    net.run(3000)
    readings(net, 4)
    record = net.cores[primary].job_table.get(jid)
    assert 1 not in record.replicas and len(record.replicas) == 1
    assert next(iter(record.replicas.values())).node not in (victim, primary)


def test_r4_replica_action_value_round_trips_and_its_certificate_verifies_offline():
    from protocol.certificate import verify_commit_certificate
    from protocol.flows.binding import certificate_binding_error
    from protocol.messages import decode_message
    from protocol.quorum import EpochView
    from tests.test_mesh_core import GENESIS
    net, jid, primary = running_replicated_job(rule("clone", 1))
    hold(net, primary, HOT, 1500)
    net.run(200)
    value = actions(net, KEYS[0])[0]
    assert ReplicaAction.from_body(codec.unpack(codec.pack(value.to_body()))) == value
    # As `meshnode cert verify` checks it: the quorum's signatures, then what binds the value.
    data = next(c for c in net.certificates[KEYS[2]] if decode_message(c, MESH)[1].value_kind == "replica_action")
    cert, decided = verify_commit_certificate(data, MESH, EpochView.from_genesis(GENESIS))
    assert decided == codec.pack(value.to_body()) and cert.instance == replica_instance_id(jid, 0, value.anchor)
    assert certificate_binding_error("replica_action", cert.instance, cert.value, cert.epoch, MESH, 0) is None
    assert "another instance" in certificate_binding_error("replica_action", replica_instance_id(jid, 1, 0),
                                                           cert.value, cert.epoch, MESH, 0)
    flow = net.cores[KEYS[0]].replicas
    assert flow.binding_error(replica_instance_id(jid, 0, value.anchor), "replica_action", value, 0) is None
    assert "another instance" in flow.binding_error(replica_instance_id(jid, 1, value.anchor), "replica_action",
                                                    value, 0)


def test_r4_a_short_simulator_sweep_with_replica_rules_and_faults_keeps_every_check():
    from testnet.sim import SimConfig, Simulation
    results = [Simulation(SimConfig(nodes=4, jobs=6, seed=seed, reflex_per_mille=600, byzantine_milli=200)).run()
               for seed in range(3)]
    assert [r.violation_count for r in results] == [0, 0, 0]
    assert sum(r.counters["replica_actions"] for r in results) > 0


def test_r4_the_simulator_audit_catches_a_replica_action_applied_twice_and_beyond_max():
    from types import SimpleNamespace
    from testnet.sim_reflex import ReflexAudit
    net, jid, primary = running_replicated_job(rule("clone", 1), service=Service(max_replicas=2))
    hold(net, primary, HOT, 1500)
    net.run(200)
    applied = [e for e in net.events[KEYS[1]] if e.kind == "replica_action"]
    failures = []
    audit = ReflexAudit(MESH, SimpleNamespace(fail=lambda *args: failures.append(args)))
    node = SimpleNamespace(index=1, incarnation=0, core=net.cores[KEYS[1]])
    audit.on_replica_events(node, applied)
    assert not failures
    audit.on_replica_events(node, applied)
    assert [f[0] for f in failures] == ["reflex_applied_twice"]
    record = net.cores[KEYS[1]].job_table.get(jid)
    record.manifest = dataclasses.replace(record.manifest, service=Service(max_replicas=1))   # as if one too many
    audit.on_replica_events(SimpleNamespace(index=1, incarnation=1, core=net.cores[KEYS[1]]), applied)
    assert failures[-1][0] == "replica_bounds"


def test_r4_a_replica_run_learns_its_index_the_service_port_and_host_and_plain_jobs_get_nothing():
    from meshnode.node.driver import replica_environment
    from protocol.workload_orders import WorkloadRun
    job, _ = make_job()
    serving = dataclasses.replace(job, service=Service(port=8080, max_replicas=2))
    assert replica_environment(WorkloadRun(b"k" * 32, 1, (), False, serving, replica=1), "127.0.0.3") == {
        "MESHNODE_REPLICA_INDEX": "1", "MESHNODE_SERVICE_PORT": "8080", "MESHNODE_SERVICE_HOST": "127.0.0.3"}
    assert replica_environment(WorkloadRun(b"j" * 32, 1, (), False, serving), "127.0.0.1") == {
        "MESHNODE_REPLICA_INDEX": "0", "MESHNODE_SERVICE_PORT": "8080", "MESHNODE_SERVICE_HOST": "127.0.0.1"}
    assert replica_environment(WorkloadRun(b"j" * 32, 1, (), False, job), "127.0.0.1") == {}


def test_r4f_serve_listens_on_the_host_its_node_names_else_loopback():
    from meshnode.workload.serve import service_host
    assert service_host({"MESHNODE_SERVICE_HOST": "127.0.0.3"}) == "127.0.0.3"
    assert service_host({}) == "127.0.0.1"


def test_r4_an_action_learnt_before_its_predecessor_waits_for_it_and_every_member_ends_alike():
    from protocol.ready import Ready
    net, jid, primary = running_replicated_job(rule("clone", 1), service=Service(min_replicas=2, max_replicas=3))
    readings(net, 2)                     # the fill: action 0
    holding = {primary, *(r.node for r in net.cores[KEYS[0]].job_table.get(jid).replicas.values())}
    hold_on(net, holding, HOT, 2000)     # the clone: action 1
    net.run(200)
    first, second = actions(net, KEYS[0])[:2]
    fresh = running_replicated_job(rule("clone", 1), service=Service(min_replicas=2, max_replicas=3))[0]
    late = fresh.cores[KEYS[3]]          # a member that has applied neither
    record = late.job_table.get(jid)
    record.replicas.clear(), setattr(record, "replica_seq", 0), setattr(record, "next_replica", 1)
    flow = late.replicas
    flow.apply(replica_instance_id(jid, 1, second.anchor), "replica_action", second, b"", 0, 0, Ready())
    assert record.replica_seq == 0 and late.counters["replica_action_parked"] == 1   # waits for action 0
    flow.apply(replica_instance_id(jid, 0, first.anchor), "replica_action", first, b"", 0, 0, Ready())
    assert record.replica_seq == 2 and not flow.parked
    assert {i: r.node for i, r in record.replicas.items()} == {
        i: r.node for i, r in net.cores[KEYS[0]].job_table.get(jid).replicas.items()}


def test_r4_a_primary_moved_onto_a_replicas_node_replaces_that_replica_and_a_fill_follows():
    from tests.test_job_move import ask, move_request
    net, jid, primary = running_replicated_job(service=Service(port=9000, min_replicas=2, max_replicas=2))
    readings(net, 3)
    replica_node = net.cores[primary].job_table.get(jid).replicas[1].node
    ask(net, primary, move_request(jid, 1, to_node=replica_node))
    net.run(300)
    assert all(net.cores[k].job_table.get(jid).primary == replica_node for k in KEYS)
    assert net.cores[replica_node].ledger.allocated(replica_key(jid, 1)) is None   # one run of the job there
    net.emit(replica_node, net.cores[replica_node].workload_started(jid, 2, 0, net.now))
    readings(net, 4)
    tables = {repr(sorted((i, r.node) for i, r in net.cores[k].job_table.get(jid).replicas.items())) for k in KEYS}
    record = net.cores[KEYS[0]].job_table.get(jid)
    assert len(tables) == 1 and list(record.replicas) == [2] and record.replicas[2].node not in (replica_node,)


def test_r4_a_clone_never_goes_to_a_node_with_an_unhealthy_gpu_and_validators_refuse_one():
    net, jid, primary = running_replicated_job(rule("clone", 1))
    others = [k for k in KEYS if k != primary]
    sick, healthy = others[:2], others[2]
    for _ in range(6):   # the primary hot, two other nodes with an ECC error on one GPU
        for key in KEYS:
            gpus = net.cores[key].capability._gpu_states()
            gpus = tuple(dataclasses.replace(g, util_milli=HOT if key == primary else 0,
                                             ecc_errors=1 if key in sick and g.index == 0 else 0) for g in gpus)
            net.emit(key, net.cores[key].update_telemetry(gpus, 0, net.now))
        net.run(250)
    net.run(200)
    [clone] = actions(net, KEYS[0])
    assert clone.nodes == (healthy,)
    core = net.cores[KEYS[1]]   # the same clone to a sick node instead: refused by the node rule
    bad = dataclasses.replace(clone, nodes=(sick[0],),
                              capabilities=(core.capability.signed_vector(sick[0], net.now)[0],))
    record = core.job_table.get(jid)
    error = core.replicas.nodes_error(record, record.manifest.reflexes[0], bad, core.view)
    assert "has an unhealthy GPU" in error, error


def test_r4_bounds_and_weight_arithmetic_never_retire_the_primary_or_below_min_replicas():
    from types import SimpleNamespace
    from protocol.replicas import Replica, action_error, weight_changes
    job, _ = make_job()
    record = SimpleNamespace(manifest=dataclasses.replace(job, service=Service(min_replicas=2, max_replicas=3)),
                             primary_weight=1000, replicas={1: Replica(KEYS[1], 1, 1000)})
    away = rule("decay", 100, above=None, below=20)
    assert "fewer than min_replicas (2)" in action_error(record, away)   # 2 replicas, min 2: no retire
    record.replicas[2] = Replica(KEYS[2], 2, 1000)
    assert action_error(record, away) is None and weight_changes(record, away) == [(2, 0)]   # the newest goes
    assert "retire it" in action_error(record, rule("decay", 100))   # an above rule decays the primary: never to 0
    assert "max_replicas (3)" in action_error(record, rule("clone", 1))
    assert weight_changes(record, rule("reroute", 50)) == [(0, 500), (1, 500), (2, 2000)]
    assert weight_changes(record, rule("decay", 50)) == [(0, 500)]


def test_r4f_a_loopback_hosts_testnet_gives_each_node_its_own_address_and_netns_excludes_it(tmp_path):
    import pytest
    from keys.errors import ConfigError
    from keys.genesis import Genesis
    from testnet import launcher
    layout = launcher.create_testnet(tmp_path / "net", 3, run_workloads=False, loopback_hosts=True)
    assert [n["host"] for n in layout["nodes"]] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    genesis = Genesis.decode(launcher.node_paths(layout["nodes"][2]["dir"]).genesis.read_bytes())
    assert [m.addrs[0].split("/")[2] for m in genesis.members] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    with pytest.raises(ConfigError, match="--loopback-hosts"):
        launcher.up(tmp_path / "other", 2, netns=True, loopback_hosts=True)


def test_r4g_a_rule_reads_the_mean_over_every_replica_and_validators_refuse_evidence_without_a_replica():
    net, jid, primary = running_replicated_job(rule("clone", 1), rule("decay", 100, above=None, below=20),
                                               service=Service(port=8080, min_replicas=2, max_replicas=3))
    readings(net, 3)   # the fill: replica 1
    record = net.cores[KEYS[0]].job_table.get(jid)
    replica = record.replicas[1].node
    # The primary hot, its replica idle: the mean (47.5 %) is under 80 %: no clone; and over
    # 20 %: no decay either.
    hold_on(net, {primary}, HOT, 2000)
    net.run(300)
    assert [a.trigger != b"" for a in actions(net, KEYS[0])] == [False]
    # A primary-only trigger (R3's evidence) is refused: the replica's chain is missing.
    core = net.cores[KEYS[2]]
    history = core.capability.history.of(primary)[-5:]
    from protocol.messages import ReflexTrigger, encode_message
    from tests.test_mesh_core import IDS
    trigger = encode_message(IDS[2], MESH, ReflexTrigger(job_id=jid, fence=record.fence, rule=0,
                                                               evidence=tuple(e for e, _c in history)))
    forged = ReplicaAction(job_id=jid, seq=1, anchor=history[-1][1].seq, trigger=trigger, nodes=(KEYS[3],),
                           capabilities=(core.capability.peer_envelopes[KEYS[3]],), replicas=(), weights=())
    error = core.replicas.action_value_error(replica_instance_id(jid, 1, forged.anchor), forged, core.view)
    assert "one of each replica" in error
    # Both loaded: the mean is over 80 %, the clone is decided, with both nodes' chains.
    hold_on(net, {primary, replica}, HOT, 2000)
    net.run(300)
    clones = [a for a in actions(net, KEYS[0]) if a.trigger]
    assert len(clones) == 1 and len(net.cores[KEYS[0]].job_table.get(jid).replicas) == 2
    from protocol.messages import decode_message
    signers = {decode_message(e, MESH)[0].signer for e in decode_message(clones[0].trigger, MESH)[1].evidence}
    assert signers == {primary, replica}


def replica_events(net, key, action):
    return [e for e in net.events[key] if e.kind == "replica_action" and e.detail["action"] == action]


def test_r4h_a_replica_that_fails_is_replaced_on_another_node_once_and_one_that_completes_is_not():
    net, jid, primary = running_replicated_job(service=Service(port=9000, min_replicas=3, max_replicas=3))
    readings(net, 3)   # the fill: replicas 1 and 2
    record = net.cores[primary].job_table.get(jid)
    assert sorted(record.replicas) == [1, 2]
    crashed = record.replicas[1].node
    net.emit(crashed, net.cores[crashed].job_exited(replica_key(jid, 1), 137, net.now))   # killed
    net.run(300)
    readings(net, 2)
    for key in KEYS:   # decided once, the same at every member: replica 1 retired, 3 in its place
        table = net.cores[key].job_table.get(jid)
        assert sorted(table.replicas) == [2, 3] and len(replica_events(net, key, "replace")) == 1, key
        assert table.replicas[3].node not in (crashed, primary, table.replicas[2].node)
    assert net.cores[crashed].ledger.allocated(replica_key(jid, 1)) is None   # its claim freed
    replacement = net.cores[primary].job_table.get(jid).replicas[3].node
    runs = [run for d in net.decisions[replacement] if d.value_kind == "run" for run in d.value]
    assert (replica_key(jid, 3), 3) in [(run.job_id, run.replica) for run in runs]
    # A replica that completes (exit 0) is not replaced: it stays down until a decay retires it.
    done = net.cores[primary].job_table.get(jid).replicas[2].node
    net.emit(done, net.cores[done].job_exited(replica_key(jid, 2), 0, net.now))
    readings(net, 3)
    assert len(replica_events(net, KEYS[0], "replace")) == 1
    assert sorted(net.cores[KEYS[0]].job_table.get(jid).replicas) == [2, 3]


def test_r4h_a_forged_or_wrong_replica_end_is_refused_by_validators():
    net, jid, primary = running_replicated_job(service=Service(port=9000, min_replicas=2, max_replicas=2))
    readings(net, 3)
    core = net.cores[KEYS[2]]
    record = core.job_table.get(jid)
    holder = record.replicas[1].node
    from protocol.flows.replica import REPLACEMENT_ANCHOR
    from protocol.messages import JobExit, encode_message
    from tests.test_mesh_core import IDS
    spare = next(k for k in KEYS if k not in (primary, holder))
    def value(signer_index, code=1, fence=None):
        end = encode_message(IDS[signer_index], MESH, JobExit(job_id=replica_key(jid, 1),
                                                               fence=record.replicas[1].fence if fence is None else fence,
                                                               exit_code=code))
        return ReplicaAction(job_id=jid, seq=record.replica_seq, anchor=REPLACEMENT_ANCHOR + 1, trigger=end,
                             nodes=(spare,), capabilities=(core.capability.peer_envelopes[spare],),
                             replicas=(1,), weights=(0,))
    iid = replica_instance_id(jid, record.replica_seq, REPLACEMENT_ANCHOR + 1)
    good = value(KEYS.index(holder))
    assert core.replicas.action_value_error(iid, good, core.view) is None
    assert "signed by its node" in core.replicas.action_value_error(iid, value(KEYS.index(spare)), core.view)
    assert "signed by its node" in core.replicas.action_value_error(iid, value(KEYS.index(holder), fence=9), core.view)
    assert "completed" in core.replicas.action_value_error(iid, value(KEYS.index(holder), code=0), core.view)


def test_r4h_a_replica_with_no_room_on_its_node_is_placed_on_another_node_with_room():
    from protocol.messages import Resources
    # KEYS[1] has the most free GPUs (3): the clone goes there. Its ledger fills meanwhile,
    # unannounced (its vector still shows room), so it refuses the replica when it applies.
    net, jid, primary = running_replicated_job(rule("clone", 1), net_gpus=(4, 3, 2, 2))
    net.cores[KEYS[1]].ledger.allocate_now(b"\x01" * 32, Resources(gpus=3, gpu_mem_mib=1, cpu_milli=1, mem_mib=1))
    for _ in range(8):   # only the primary reads its GPUs: the others' vectors stay as they were
        telemetry(net, primary, HOT)
        net.run(250)
    net.run(300)
    refused = [e for e in net.events[KEYS[1]] if e.kind == "replica_ended"]
    assert [e.detail["why"] for e in refused] == ["no_room"]
    for key in KEYS:
        table = net.cores[key].job_table.get(jid)
        assert list(table.replicas) == [2] and table.replicas[2].node not in (KEYS[1], primary), key
        assert [e.detail["why"] for e in replica_events(net, key, "replace")] == ["no_room"]
    holder = net.cores[primary].job_table.get(jid).replicas[2].node
    assert net.cores[holder].ledger.allocated(replica_key(jid, 2)) is not None   # it runs there, once


def test_r4h_a_replacement_with_no_target_gives_up_soon_and_leaves_the_jobs_other_actions_free():
    # min_replicas 4 on 4 nodes (the primary counts): the primary and its 3 replicas fill the mesh, so when a
    # replica fails no member is left that does not run the job already: no leader has a value.
    net, jid, primary = running_replicated_job(rule("reroute", 50, cooldown_ms=60_000),
                                               service=Service(port=9000, min_replicas=4, max_replicas=4))
    readings(net, 3)
    record = net.cores[primary].job_table.get(jid)
    assert sorted(record.replicas) == [1, 2, 3]
    crashed = record.replicas[1].node
    net.emit(crashed, net.cores[crashed].job_exited(replica_key(jid, 1), 137, net.now))
    net.run(4000)   # REPLACEMENT_MAX_ROUNDS rounds of growing timeouts (200 + 400 + 800 ms)
    for key in KEYS:
        assert any(e.kind == "replica_action_gave_up" for e in net.events[key]), key
        assert jid not in net.cores[key].replicas.noticing, key
    assert replica_events(net, KEYS[0], "replace") == []
    # The job's other actions are not held behind the end that found no target: the reroute
    # rule still acts (on main it waited the replacement's 64 rounds, then forever).
    seen = {key: len(net.events[key]) for key in KEYS}
    hold_on(net, {primary}, HOT, 3000)
    net.run(300)
    for key in KEYS:
        kinds = [e.detail["action"] for e in net.events[key][seen[key]:] if e.kind == "replica_action"]
        assert kinds == ["reroute"], (key, kinds)
