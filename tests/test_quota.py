"""Pools, quotas, queue order, estimated start and the backfill rule (SPEC.md 5.5, Q1-Q5):
the pure rules, then four cores where a job over its owner's quota waits and why."""

import dataclasses

import pytest

from protocol import codec

from keys.genesis import DEFAULT_PARAMS, Genesis, OwnerQuota, Pool, Quota
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.job_queue import (Room, backfill_error, capacity_estimate, pool_queue, queue_position, quota_estimate,
                                reservation_holder, start_estimate)
from protocol.job_table import JobRecord
from protocol.messages import (Constraints, JobManifest, Resources, Scheduling, decode_message, encode_message,
                               job_id)
from protocol.quota import Quotas, Usage, demand
from protocol.quota_admission import quota_home, quota_homes
from protocol.signing import short_id
from tests.test_mesh_core import GENESIS, IDS, KEYS, OWNER, Net

OTHER_OWNER = IDS[3]   # any key will do as a second owner
TRAINING = Pool(name="training", default=Quota(gpu_milli=4000),
                owners=(OwnerQuota(owner=OWNER.public_key, quota=Quota(gpu_milli=1000, cpu_milli=8000)),))
POOLS = (TRAINING, Pool(name="", default=Quota()))


def manifest(nonce=1, gpus=1, gpu_milli=0, pool="training", priority=0, created_ms=0, runtime_ms=0, owner=OWNER,
             cpu_milli=500):
    return JobManifest(owner=owner.public_key, name="job%d" % nonce, nonce=nonce, entrypoint="counter", args=(),
                       resources=Resources(gpus=gpus, gpu_mem_mib=1000, cpu_milli=cpu_milli, mem_mib=512,
                                           gpu_milli=gpu_milli),
                       strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                       priority=priority, backups=1, max_retries=0, created_ms=created_ms, epoch=0,
                       scheduling=Scheduling(pool=pool, max_runtime_ms=runtime_ms))


def record(job, state="pending", primary=None, placed_ms=None):
    """A job record as a member holds it; a pending one has its placement instance running."""
    return JobRecord(job_id(job), b"", job, 0, state=state, primary=primary, placed_ms=placed_ms,
                     instance=b"\x01" * 32)


# --- the genesis (5.5) -------------------------------------------------------------------------
def test_a_genesis_without_pools_encodes_as_before_and_with_pools_round_trips():
    plain = Genesis(name="g", created_ms=0, members=GENESIS.members, params=DEFAULT_PARAMS, authorities=())
    assert "pools" not in plain.to_body() and "reservations" not in plain.to_body()
    pooled = dataclasses.replace(plain, pools=POOLS, reservations=True)
    assert Genesis.decode(pooled.encode()) == pooled
    assert pooled.mesh_id != plain.mesh_id
    body = dict(plain.to_body(), pools=[])
    from protocol import codec
    with pytest.raises(RemoteProtocolError, match="left out at its default"):
        Genesis.decode(codec.pack(body))
    with pytest.raises(ValueError, match="listed twice"):
        dataclasses.replace(plain, pools=(TRAINING, TRAINING))


# --- quotas (Q1, Q2) ---------------------------------------------------------------------------
def test_demand_counts_whole_gpus_in_thousandths_and_shares_as_asked():
    assert demand(manifest(gpus=2).resources) == Usage(2000, 500, 512)
    assert demand(manifest(gpus=1, gpu_milli=250).resources) == Usage(250, 500, 512)


def test_usage_counts_live_jobs_of_the_owner_and_pool_only():
    quotas = Quotas(POOLS)
    jobs = [record(manifest(1), "running"), record(manifest(2), "placed"), record(manifest(3), "migrating"),
            record(manifest(4), "pending"), record(manifest(5), "completed"), record(manifest(6), "failed"),
            record(manifest(7), "cancelled"), record(manifest(8, pool=""), "running"),
            record(manifest(9, owner=OTHER_OWNER), "running")]
    assert quotas.usage(jobs, OWNER.public_key, "training") == Usage(3000, 1500, 1536)


def test_over_quota_names_the_pool_the_dimension_and_by_how_much():
    quotas = Quotas(POOLS)
    running = record(manifest(1), "running")
    assert quotas.over_quota(manifest(2), []) is None
    problem = quotas.over_quota(manifest(2, gpus=2), [running])
    assert problem == "pool 'training' quota: gpu_milli 1000 held + 2000 asked > 1000 (over by 2000)"
    # another owner gets the pool's default (4 GPUs); the default pool here has no limit
    assert quotas.over_quota(manifest(3, gpus=4, owner=OTHER_OWNER), [running]) is None
    assert quotas.over_quota(manifest(4, gpus=5, owner=OTHER_OWNER), []) is not None
    assert quotas.over_quota(manifest(5, gpus=64, pool=""), []) is None


@pytest.mark.parametrize("ended", ["completed", "failed", "cancelled", "pending"])
def test_an_exit_a_cancel_or_a_refusal_frees_the_quota(ended):
    quotas = Quotas(POOLS)
    first = record(manifest(1), "running")
    assert quotas.over_quota(manifest(2), [first]) is not None
    first.state = ended    # "pending": refused or failed with retries left, placed afresh later
    assert quotas.over_quota(manifest(2), [first]) is None


def test_an_unknown_pool_is_named_with_the_known_ones():
    quotas = Quotas(POOLS)
    assert quotas.unknown_pool_error(manifest(pool="serving")) == "unknown pool 'serving' (the mesh's pools: 'training')"
    assert Quotas().unknown_pool_error(manifest(pool="")) is None
    assert Quotas().limit("", OWNER.public_key) is None


# --- queue order and estimated start (Q3, Q4) ----------------------------------------------------
def test_queue_order_is_priority_then_created_then_id_per_pool():
    a = record(manifest(1, priority=5, created_ms=30))
    b = record(manifest(2, priority=9, created_ms=40))
    c = record(manifest(3, priority=5, created_ms=10))
    d = record(manifest(4, priority=5, created_ms=10, cpu_milli=600))   # same time: by job id
    other_pool = record(manifest(5, pool="", priority=100))
    placed = record(manifest(6, priority=100), "running")
    jobs = [a, b, c, d, other_pool, placed]
    tied = sorted([c, d], key=lambda r: r.job_id)
    assert [r.job_id for r in pool_queue(jobs, "training")] == [b.job_id] + [r.job_id for r in tied] + [a.job_id]
    assert queue_position(jobs, a) == (4, 4)
    assert queue_position(jobs, other_pool) == (1, 1)
    assert queue_position(jobs, placed) == (0, 4)


def test_quota_estimate_waits_for_the_owners_jobs_that_end_first():
    quotas = Quotas(POOLS)
    waiting = record(manifest(9))
    soon = record(manifest(1, runtime_ms=5_000), "running", placed_ms=1_000)
    assert quota_estimate(waiting, [soon], quotas, 2_000).start_ms == 6_000
    undeclared = record(manifest(2), "running", placed_ms=0)
    assert quota_estimate(waiting, [undeclared], quotas, 2_000).start_ms is None
    assert "declared no max_runtime_ms" in quota_estimate(waiting, [undeclared], quotas, 2_000).reason
    assert quota_estimate(record(manifest(3, gpus=2)), [], quotas, 0).reason.startswith("never")
    assert quota_estimate(waiting, [], quotas, 7).start_ms == 7


def test_capacity_estimate_takes_the_node_that_frees_enough_first():
    a, b = KEYS[0], KEYS[1]
    waiting = record(manifest(9, gpus=2, owner=OTHER_OWNER))
    on_a = record(manifest(1, gpus=1, runtime_ms=9_000, owner=OTHER_OWNER), "running", primary=a, placed_ms=0)
    on_b = record(manifest(2, gpus=2, runtime_ms=4_000, owner=OTHER_OWNER), "running", primary=b, placed_ms=0)
    free = {a: Room(1, 8000, 32768), b: Room(0, 8000, 32768)}
    assert capacity_estimate(waiting, [on_a, on_b], free, 1_000).start_ms == 4_000
    assert capacity_estimate(waiting, [], {a: Room(2, 8000, 32768)}, 1_000).start_ms == 1_000
    on_b_forever = record(manifest(3, gpus=2, owner=OTHER_OWNER), "running", primary=b, placed_ms=0)
    assert capacity_estimate(waiting, [on_b_forever], {b: Room(0, 8000, 32768)}, 0).start_ms is None
    # both: the later of quota and capacity
    mine = record(manifest(8))
    quota_holder = record(manifest(7, runtime_ms=20_000), "running", primary=a, placed_ms=0)
    assert start_estimate(mine, [quota_holder], Quotas(POOLS), {b: Room(1, 8000, 32768)}, 0).start_ms == 20_000


# --- reservation and backfill (Q5) -------------------------------------------------------------------
def test_the_reservation_holder_is_the_first_job_ahead_declined_here_for_capacity():
    me = KEYS[0]
    big = record(manifest(1, gpus=4, created_ms=0))
    big.declines[me] = ("not_enough_gpus", "")
    small = record(manifest(2, gpus=1, created_ms=5))
    total = Room(4, 8000, 32768)
    assert reservation_holder(small, [big, small], me, total) is big
    assert reservation_holder(big, [big, small], me, total) is None        # nothing ahead of it
    assert reservation_holder(small, [big, small], me, Room(2, 8000, 32768)) is None   # never fits here
    big.instance = b""            # its placement gave up (P3a hint: resubmit): it reserves nothing
    assert reservation_holder(small, [big, small], me, total) is None
    big.instance = b"\x01" * 32
    big.declines[me] = ("zone_not_allowed", "")
    assert reservation_holder(small, [big, small], me, total) is None


def test_backfill_only_ends_before_the_reservation_or_leaves_it_whole():
    big = record(manifest(1, gpus=4))
    free = Room(2, 8000, 32768)
    running = [(10_000, Room(2, 1000, 1000))]          # two GPUs free at 10 s: the big job starts then
    assert backfill_error(record(manifest(2, gpus=1, runtime_ms=8_000)), big, free, running, 1_000) is None
    late = backfill_error(record(manifest(3, gpus=1, runtime_ms=9_001)), big, free, running, 1_000)
    assert late == "capacity reserved for job %s from 9000 ms; this job runs 9001 ms" % big.job_id.hex()[:8]
    assert "declares no max_runtime_ms" in backfill_error(record(manifest(4, gpus=1)), big, free, running, 1_000)
    # with 3 GPUs free now, 5 are at 10 s: the big job still fits then beside a long job
    assert backfill_error(record(manifest(5, gpus=1)), big, Room(3, 8000, 32768), running, 1_000) is None
    # the big job fits now: a long job may not take any of its GPUs
    assert backfill_error(record(manifest(5, gpus=1)), big, Room(4, 8000, 32768), running, 1_000) is not None
    unknown = backfill_error(record(manifest(6, gpus=1, runtime_ms=1)), big, free, [(None, Room(2, 0, 0))], 0)
    assert "unknown" in unknown


# --- four cores: a job over its owner's quota waits, and says why ------------------------------------
POOLED = dataclasses.replace(GENESIS, pools=POOLS)


def submit(net, at, job):
    envelope = encode_message(OWNER, POOLED.mesh_id, job)
    net.submit(at, envelope)
    return job_id(job)


def test_a_job_over_its_owners_quota_waits_until_the_first_ends():
    net = Net(genesis=POOLED)
    first = submit(net, KEYS[1], manifest(1, runtime_ms=60_000))
    net.run(100)
    assert all(core.job_view(first)["state"] == "placed" for core in net.cores.values())
    second = submit(net, KEYS[1], manifest(2, created_ms=1))
    net.run(200)
    entry = net.cores[KEYS[1]]
    view = entry.job_view(second)
    assert view["state"] == "pending"
    assert sorted(view["declines"]) == ["over_quota"] and sorted(view["declines"]["over_quota"]) == sorted(KEYS)
    report = entry.pending_report(second, net.now)
    assert report["pool"] == "training" and (report["position"], report["queue_length"]) == (1, 1)
    home, deputy = quota_homes(entry.view, OWNER.public_key, "training")   # 20 of the 40 stake: over a third
    assert report["quota"] == ("waiting for a quota grant from quota home %s (deputies %s): pool 'training' quota: "
                               "gpu_milli 1000 held + 1000 asked > 1000 (over by 1000); not preemptible, so it cannot "
                               "borrow (Q6)" % (short_id(home), short_id(deputy)))
    assert report["estimate"]["start_ms"] == 60_000 + entry.job_table.get(first).placed_ms
    assert report["estimate"]["reason"] == "quota frees when job %s ends" % first.hex()[:8]
    primary = entry.job_view(first)["primary"]
    net.emit(primary, net.cores[primary].job_exited(first, 0, net.now))
    net.run(300)
    assert all(core.job_view(second)["state"] == "placed" for core in net.cores.values())
    assert len({core.job_view(second)["primary"] for core in net.cores.values()}) == 1


def test_a_cancel_frees_the_quota_too():
    from protocol.messages import Cancel
    net = Net(genesis=POOLED)
    first = submit(net, KEYS[0], manifest(1))
    net.run(100)
    second = submit(net, KEYS[0], manifest(2, created_ms=1))
    net.run(200)
    assert net.cores[KEYS[0]].job_view(second)["state"] == "pending"
    # It runs, as its primary reports (Q2e: the home frees a cancelled job's quota once the
    # primary has had the cancel's grace to stop it, not at the cancel alone).
    from protocol.quota_admission import CANCEL_STOP_GRACE_ROUNDS
    primary = net.cores[KEYS[0]].job_view(first)["primary"]
    fence = net.cores[primary].job_table.get(first).fence
    net.emit(primary, net.cores[primary].workload_started(first, fence, 0, net.now))
    net.run(200)
    cancel = encode_message(OWNER, POOLED.mesh_id, Cancel(job_id=first, requested_ms=net.now))
    _, ready = net.cores[KEYS[0]].cancel(cancel, net.now)
    net.emit(KEYS[0], ready)
    net.run(CANCEL_STOP_GRACE_ROUNDS * POOLED.params.round_timeout_max_ms + 300)
    assert all(core.job_view(second)["state"] == "placed" for core in net.cores.values())


def test_a_job_naming_an_unknown_pool_is_refused_at_submit():
    net = Net(genesis=POOLED)
    with pytest.raises(LocalProtocolError, match="scheduling.pool: unknown pool 'serving'"):
        submit(net, KEYS[0], manifest(1, pool="serving"))


def test_spec_5_5_vector_genesis_with_pools():
    """SPEC.md 5.5's vector: the sample genesis of 4.4 with pools and reservations."""
    import hashlib
    import pathlib
    import re
    from testnet.spec_tables import vector_genesis, vector_key
    spec = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")
    encoded = bytes.fromhex(re.search(r"genesis_with_pools: ([0-9a-f]+)", spec).group(1))
    mesh_id = re.search(r"mesh_id_with_pools: ([0-9a-f]{64})", spec).group(1)
    expected = dataclasses.replace(vector_genesis(), reservations=True, pools=(
        Pool("", Quota()), Pool("training", Quota(gpu_milli=2000, cpu_milli=16000, mem_mib=65536),
                                (OwnerQuota(vector_key(), Quota(gpu_milli=4000)),))))
    assert Genesis.decode(encoded) == expected and expected.encode() == encoded
    assert mesh_id == hashlib.sha256(b"meshnode/v1/genesis\x00" + encoded).hexdigest() == expected.mesh_id.hex()


# --- four cores with reservations on (Q5) ------------------------------------------------------------
def fill_and_wait_for_a_big_job(reservations: bool):
    """Four 2-GPU nodes, each running a 1-GPU job for at most 10 s; then a 2-GPU job every
    member declines for want of GPUs."""
    genesis = dataclasses.replace(GENESIS, reservations=reservations)
    net = Net(genesis=genesis)
    fillers = []
    for nonce in range(4):
        job = manifest(10 + nonce, pool="", runtime_ms=10_000, created_ms=nonce)
        fillers.append(job_id(job))
        net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, job))
        net.run(60)
    assert sorted(net.cores[KEYS[0]].job_view(jid)["primary"] for jid in fillers) == sorted(KEYS)
    big = manifest(20, gpus=2, pool="", created_ms=10)
    net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, big))
    net.run(100)
    assert net.cores[KEYS[0]].job_view(job_id(big))["state"] == "pending"
    return net, genesis, fillers, job_id(big)


def submit_small(net, genesis, nonce, runtime_ms, created_ms):
    job = manifest(nonce, pool="", runtime_ms=runtime_ms, created_ms=created_ms)
    net.submit(KEYS[0], encode_message(OWNER, genesis.mesh_id, job))
    net.run(100)
    return job_id(job)


def test_q5_a_small_job_backfills_only_if_it_ends_before_the_big_one_could_start():
    net, genesis, fillers, big = fill_and_wait_for_a_big_job(reservations=True)
    long_small = submit_small(net, genesis, 30, runtime_ms=20_000, created_ms=20)
    view = net.cores[KEYS[0]].job_view(long_small)
    assert view["state"] == "pending" and sorted(view["declines"]["reserved"]) == sorted(KEYS)
    short_small = submit_small(net, genesis, 31, runtime_ms=5_000, created_ms=30)
    assert net.cores[KEYS[0]].job_view(short_small)["state"] == "placed"    # backfilled
    # One filler ends: its node has 2 GPUs free (unless the short job backfilled it) and the
    # big job is placed; the long small job is decided afresh once the big one is not waiting.
    free_node = next(jid for jid in fillers
                     if net.cores[KEYS[0]].job_view(jid)["primary"] != net.cores[KEYS[0]].job_view(short_small)["primary"])
    primary = net.cores[KEYS[0]].job_view(free_node)["primary"]
    net.emit(primary, net.cores[primary].job_exited(free_node, 0, net.now))
    net.run(300)
    assert all(core.job_view(big)["state"] == "placed" for core in net.cores.values())
    assert net.cores[KEYS[0]].job_view(big)["primary"] == primary
    assert net.cores[KEYS[0]].job_view(long_small)["state"] == "placed"


def test_q5_without_reservations_a_small_job_takes_what_the_big_one_waits_for():
    net, genesis, _fillers, _big = fill_and_wait_for_a_big_job(reservations=False)
    long_small = submit_small(net, genesis, 30, runtime_ms=20_000, created_ms=20)
    assert net.cores[KEYS[0]].job_view(long_small)["state"] == "placed"


# --- a short simulator sweep with quotas and reservations on ----------------------------------------
def test_sim_sweep_with_quotas_and_reservations_has_no_violations_and_holds_jobs():
    """`meshnode sim --quota-gpus 1 --reservations`: faults, Byzantine stake under 1/3, jobs
    ending and cancelled. Every check stays at 0, and some jobs end the run held by their
    owner's quota (counted apart, SPEC Q2), so the rule was exercised."""
    from testnet.sim import FAULTS, SimConfig, Simulation
    failures, held, declined = [], 0, 0
    for seed in range(4):
        sim = Simulation(SimConfig(nodes=5, jobs=4, seed=seed, byzantine_milli=200 if seed % 2 else 0, faults=FAULTS,
                                   heartbeats=False, quota_gpus=1, reservations=True, job_ms=300,
                                   job_fail_per_mille=100, cancel_per_mille=100))
        result = sim.run()
        if not result.ok:
            failures.append("%s -> %s" % (result.config.reproduce(), [v.line() for v in result.violations[:2]]))
        held += result.counters["quota_held_jobs"]
        # Q2's bound, on the checker's truth of what honest nodes run, at every first decision
        assert 0 <= result.counters["quota_overshoot_peak_gpu_milli"] <= (len(sim.honest) - 1) * 1000
        # Q2b: by what honest nodes run, one owner never exceeds its quota (its home grants)
        assert result.counters.get("quota_overshoot_running_peak_gpu_milli", 0) == 0
        declined += sum(1 for node in sim.nodes if node.core is not None for record in node.core.job_table
                        if any(reason == "over_quota" for reason, _ in record.declines.values()))
    assert not failures, "\n".join(failures)
    assert held + declined > 0


def test_sim_quota_overshoot_peak_counts_what_honest_nodes_run_for_one_owner():
    """The sweep's `quota_overshoot_peak_gpu_milli_max` (Q2's bound): an owner's demand on
    honest nodes by the checker's truth, less its quota; the most seen so far is kept."""
    from protocol.messages import Resources as R
    from testnet.sim import SimConfig, Simulation
    sim = Simulation(SimConfig(nodes=4, jobs=4, seed=1, quota_gpus=1))
    first, second = sim.world.jobs[0], sim.world.jobs[1]
    sim.owner_of_job[second.job_id] = sim.owner_of_job[first.job_id]   # one owner's two jobs
    sim.checker.loads[0].jobs[first.job_id] = (R(gpus=2, gpu_mem_mib=1, cpu_milli=1, mem_mib=1), (0, 1))
    sim._note_quota_overshoot()
    assert sim.counters["quota_overshoot_peak_gpu_milli"] == 1000
    sim.checker.loads[1].jobs[second.job_id] = (R(gpus=1, gpu_mem_mib=1, cpu_milli=1, mem_mib=1, gpu_milli=500), (0,))
    sim._note_quota_overshoot()
    assert sim.counters["quota_overshoot_peak_gpu_milli"] == 1500
    sim.checker.loads[0].jobs.clear()
    sim._note_quota_overshoot()
    assert sim.counters["quota_overshoot_peak_gpu_milli"] == 1500   # the peak, not the end


def test_a_job_over_its_owners_whole_quota_is_refused_at_submit():
    net = Net(genesis=POOLED)
    with pytest.raises(LocalProtocolError, match="asks more than its owner's whole quota in pool 'training': "
                                                 "gpu_milli 2000 > 1000"):
        submit(net, KEYS[0], manifest(1, gpus=2))



def test_q2_counts_the_jobs_this_member_bid_for_as_held():
    quotas = Quotas(POOLS)
    bid_for = record(manifest(1))                     # pending, this member holds a bid for it
    assert quotas.over_quota(manifest(2), [], bid_for=[bid_for]) == (
        "pool 'training' quota: gpu_milli 1000 held + 1000 asked > 1000 (over by 1000); "
        "held counts 1 job(s) this node bid for")
    assert quotas.over_quota(manifest(1), [], bid_for=[bid_for]) is None    # not itself
    other_pool = record(manifest(3, pool=""))
    assert quotas.over_quota(manifest(2), [], bid_for=[other_pool]) is None


def test_q2b_the_home_grants_one_of_two_jobs_that_only_together_exceed_the_quota():
    net = Net(genesis=POOLED)
    home = net.cores[quota_home(sorted(KEYS), OWNER.public_key, "training")]
    first, second = manifest(1), manifest(2, created_ms=1)
    for job in (first, second):   # both arrive before either is decided
        home.step(encode_message(OWNER, POOLED.mesh_id, job), net.now, KEYS[1])
    ready = home.tick(net.now + 1)
    grants = [m.data for m in ready.messages if codec.unpack(m.data)[2] == "quota_grant"]
    assert len(grants) == 1 and decode_message(grants[0], POOLED.mesh_id)[1].job_id == job_id(first)   # queue order
    assert home.bidding.scheduling.admission.grant_of(home.job_table.get(job_id(second))) is None
    # Without a grant every member declines the job, however much room it has (Q2b).
    other = net.cores[next(key for key in KEYS if key != home.me)]
    other.step(encode_message(OWNER, POOLED.mesh_id, second), net.now, KEYS[1])
    answer = other.bidding.mine.get(other.job_table.get(job_id(second)).instance)
    assert answer[0] == "decline" and decode_message(answer[1], POOLED.mesh_id)[1].reason == "over_quota"


def test_sim_liveness_counts_a_later_attempt_decided_at_a_node_that_missed_the_first():
    """Seed 177 (quotas on, before the O(k) detector changed its history): node 2 was down
    while the job's first attempt was decided; the job failed, and node 2 decided its second
    attempt at 1,186 ms. The job was decided there: the liveness check once asked for the
    first attempt's certificate only."""
    from testnet.sim_checks import DecisionChecker
    checker = DecisionChecker(b"m" * 32, [], lambda data, views: None)
    jid, first, second = b"j" * 32, b"1" * 32, b"2" * 32
    checker.first_placement_of[jid] = first
    checker.placing_instances[jid] = [first]
    checker.decided_at[first] = {0: 300, 1: 310}
    assert [late for _, _, _, late, _ in checker.late_jobs({jid: 0}, [0, 1, 2], 5000)] == [[2]]
    checker.placing_instances[jid].append(second)
    checker.decided_at[second] = {2: 1186}
    assert checker.late_jobs({jid: 0}, [0, 1, 2], 5000) == []
    assert [late for _, _, _, late, _ in checker.late_jobs({jid: 0}, [0, 1, 2], 1000)] == [[2]]

