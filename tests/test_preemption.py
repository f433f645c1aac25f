"""Preemption (SPEC.md P8): the victim rule, its validation, and the whole path in a Net
of four MeshCores: a high-priority job into a full mesh preempts the preemptible job that
loses the least work, which resumes from its checkpoint once the room returns."""

import dataclasses

import pytest

from protocol.job_table import FENCE_PER_ATTEMPT
from protocol.messages import (CapabilityVector, Constraints, GpuState, JobManifest, Preemption, PreemptionVictim,
                               Resources, RunningJob, Scheduling, encode_message, job_id, placement_instance_id,
                               preemption_instance_id)
from protocol.preemption import choose_preemption, choose_victims
from test_mesh_core import KEYS, MESH, OWNER, Net


def job_of(nonce, priority=0, preemptible=False, gpus=1, cpu_milli=500, max_retries=0):
    job = JobManifest(owner=OWNER.public_key, name="job%d" % nonce, nonce=nonce, entrypoint="counter", args=(),
                      resources=Resources(gpus=gpus, gpu_mem_mib=1000, cpu_milli=cpu_milli, mem_mib=512),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=priority, backups=1, max_retries=max_retries, created_ms=0, epoch=0,
                      scheduling=Scheduling(preemptible=preemptible))
    return job, encode_message(OWNER, MESH, job)


def vector(running, gpus=4, gpus_free=(), cpu_free=0, mem_free=0, node=KEYS[0]):
    states = tuple(GpuState(index=i, model="sim", mem_total_mib=80_000, mem_used_mib=0, util_milli=0,
                            temp_milli_c=0, sm_clock_mhz=0, throttle_reasons=0, ecc_errors=0, power_mw=0)
                   for i in range(gpus))
    return CapabilityVector(node=node, epoch=0, seq=1, taken_ms=0, zone="zone-a", rail_group="", gpus=states,
                            gpus_free=tuple(gpus_free), cpu_milli_free=cpu_free, mem_mib_free=mem_free, labels=(),
                            simulated=True,
                            running=tuple(RunningJob(job_id=job_id(j), fence=1, checkpoint_seq=1,
                                                     checkpoint_age_ms=age, lost_work_ms=0) for j, age in running))


def manifests(*jobs):
    by_id = {job_id(j): j for j in jobs}
    return by_id.get


# --- the victim rule -------------------------------------------------------------------------------

def test_the_smallest_set_is_chosen_then_the_youngest_checkpoints():
    high, _ = job_of(100, priority=500, gpus=2)
    small = [job_of(n, priority=10, preemptible=True)[0] for n in (1, 2, 3)]
    big, _ = job_of(4, priority=10, preemptible=True, gpus=2)
    cap = vector([(small[0], 5), (small[1], 60), (small[2], 7), (big, 90)], cpu_free=10_000, mem_free=10_000)
    # One 2-GPU victim beats two 1-GPU ones, however old its checkpoint.
    assert [c.job_id for c in choose_victims(high, cap, manifests(*small, big))] == [job_id(big)]
    # Without it: the two youngest checkpoints (5 and 7 ms), in job id order.
    cap = vector([(small[0], 5), (small[1], 60), (small[2], 7)], gpus=3, cpu_free=10_000, mem_free=10_000)
    chosen = choose_victims(high, cap, manifests(*small))
    assert [c.job_id for c in chosen] == sorted([job_id(small[0]), job_id(small[2])])


def test_equal_or_higher_priority_and_non_preemptible_jobs_are_never_victims():
    high, _ = job_of(100, priority=500)
    equal, _ = job_of(1, priority=500, preemptible=True)
    higher, _ = job_of(2, priority=900, preemptible=True)
    pinned, _ = job_of(3, priority=0, preemptible=False)
    cap = vector([(equal, 0), (higher, 0), (pinned, 0)], gpus=3, cpu_free=10_000, mem_free=10_000)
    assert choose_victims(high, cap, manifests(equal, higher, pinned)) is None
    lower, _ = job_of(4, priority=499, preemptible=True)
    cap = vector([(equal, 0), (higher, 0), (pinned, 0), (lower, 1000)], cpu_free=10_000, mem_free=10_000)
    assert [c.job_id for c in choose_victims(high, cap, manifests(equal, higher, pinned, lower))] == [job_id(lower)]


def test_a_job_that_fits_already_or_cannot_fit_preempts_nothing():
    high, _ = job_of(100, priority=500, cpu_milli=4000)
    low, _ = job_of(1, priority=1, preemptible=True)
    fits = vector([(low, 0)], gpus=2, gpus_free=(1,), cpu_free=10_000, mem_free=10_000)
    assert choose_victims(high, fits, manifests(low)) is None
    short_of_cpu = vector([(low, 0)], gpus=1, cpu_free=100, mem_free=10_000)   # 100 + 500 < 4000
    assert choose_victims(high, short_of_cpu, manifests(low)) is None


def test_a_job_with_no_refusal_left_is_no_victim():
    high, _ = job_of(100, priority=500)
    low, _ = job_of(1, priority=1, preemptible=True)
    cap = vector([(low, 0)], gpus=1, cpu_free=10_000, mem_free=10_000)
    spent = dataclasses.replace(cap, running=(dataclasses.replace(cap.running[0], fence=8 * FENCE_PER_ATTEMPT + 1),))
    assert choose_victims(high, spent, manifests(low)) is None


def test_the_node_losing_least_work_is_chosen_among_capacity_decliners():
    envelope_high = job_of(100, priority=500)
    high = envelope_high[0]
    a, b = job_of(1, priority=1, preemptible=True)[0], job_of(2, priority=1, preemptible=True)[0]
    vectors = {KEYS[0]: vector([(a, 80)], gpus=1, cpu_free=10_000, mem_free=10_000, node=KEYS[0]),
               KEYS[1]: vector([(b, 20)], gpus=1, cpu_free=10_000, mem_free=10_000, node=KEYS[1])}
    value = choose_preemption(envelope_high[1], high, 0, vectors, set(KEYS), manifests(a, b))
    assert value == Preemption(job=envelope_high[1], attempt=0, node=KEYS[1],
                               victims=(PreemptionVictim(job_id=job_id(b), fence=1),))
    # A node that declined for another reason (policy, zone) is no candidate.
    assert choose_preemption(envelope_high[1], high, 0, vectors, {KEYS[0]}, manifests(a, b)).node == KEYS[0]


# --- the whole path in a Net -----------------------------------------------------------------------

def fill(net, jobs):
    """Submit and run ``jobs`` (one per 1-GPU node), each checkpointed once; vectors sent."""
    for job, envelope in jobs:
        net.submit(KEYS[0], envelope)
        net.run(100)
    for job, _ in jobs:
        view = net.cores[KEYS[0]].job_view(job_id(job))
        primary = view["primary"]
        net.emit(primary, net.cores[primary].workload_started(job_id(job), view["fence"], 0, net.now))
    ages = {}
    for index, (job, _) in enumerate(jobs):
        primary = net.cores[KEYS[0]].job_view(job_id(job))["primary"]
        net.emit(primary, net.cores[primary].local_checkpoint(job_id(job), 1, 10, net.now - 10 * index, b"s%d" % index,
                                                             net.now - 10 * index))
        ages[job_id(job)] = 10 * index
    net.deliver()
    net.now += 1000
    for key in KEYS:
        net.emit(key, net.cores[key].update_telemetry((), 100, net.now))
    net.deliver()
    return ages


def preempted_net():
    net = Net(gpus=(1, 1, 1, 1))
    lows = [job_of(n, priority=10, preemptible=True) for n in (1, 2, 3, 4)]
    ages = fill(net, lows)
    assert all(net.cores[KEYS[0]].job_view(job_id(j))["state"] == "running" for j, _ in lows)
    high, envelope = job_of(100, priority=900)
    net.submit(KEYS[2], envelope)
    net.run(3000)
    return net, lows, ages, high


def test_a_high_priority_job_preempts_the_victim_losing_least_work_and_it_resumes_later():
    net, lows, ages, high = preempted_net()
    youngest = min(ages, key=ages.get)
    decided = [d.value for d in net.certified(KEYS[1], "preemption")]
    assert len(decided) == 1 and [v.job_id for v in decided[0].victims] == [youngest]
    node = decided[0].node
    for key in KEYS:
        core = net.cores[key]
        assert core.job_view(job_id(high))["primary"] == node
        victim = core.job_view(youngest)
        assert victim["state"] == "pending" and victim["preempted_by"] == job_id(high)
        assert core.ledger.held_totals()[0] <= 1
    stops = [d for d in net.decisions[node] if d.value_kind == "stop" and youngest in d.value]
    assert stops, "the victim's workload was ordered to stop"
    preempted = [e for e in net.events[node] if e.kind == "job_preempted"]
    assert preempted[0].detail["by"] == job_id(high).hex() and preempted[0].detail["lost_work_ms"] >= 0
    # The high-priority job ends: the victim is placed again and resumes from its checkpoint.
    fence = net.cores[node].job_view(job_id(high))["fence"]
    net.emit(node, net.cores[node].workload_started(job_id(high), fence, 0, net.now))
    net.emit(node, net.cores[node].job_exited(job_id(high), 0, net.now))
    net.run(2000)
    victim = net.cores[KEYS[0]].job_view(youngest)
    assert victim["state"] in ("placed", "running") and victim["primary"] == node
    runs = [run for d in net.decisions[node] if d.value_kind == "run" for run in d.value if run.job_id == youngest]
    assert runs[-1].resume and runs[-1].fence > runs[0].fence
    assert net.cores[node].job_view(youngest)["last_checkpoint_seq"] == 1   # the handed-over checkpoint


def test_no_preemption_for_a_job_of_equal_priority():
    net = Net(gpus=(1, 1, 1, 1))
    fill(net, [job_of(n, priority=10, preemptible=True) for n in (1, 2, 3, 4)])
    same, envelope = job_of(100, priority=10)
    net.submit(KEYS[2], envelope)
    net.run(3000)
    assert not net.certified(KEYS[0], "preemption")
    assert net.cores[KEYS[0]].job_view(job_id(same))["state"] == "pending"


def test_validators_reject_a_preemption_that_breaks_the_victim_rule(monkeypatch):
    from protocol.flows.preemption import PreemptionFlow
    monkeypatch.setattr(PreemptionFlow, "consider", lambda self, now_ms, out: None)   # held, nothing started
    net = Net(gpus=(1, 1, 1, 1))
    lows = [job_of(n, priority=10, preemptible=True) for n in (1, 2, 3, 4)]
    ages = fill(net, lows)
    high, envelope = job_of(100, priority=900)
    net.submit(KEYS[2], envelope)
    net.run(3000)
    core = net.cores[KEYS[3]]
    piid = placement_instance_id(job_id(high), 0)
    pinst = core.instances[piid]
    assert core.placement.round_on_hold(pinst, net.now)
    value, justification = core.preemptions._proposal_value(pinst, core.job_table.get(job_id(high)), net.now)
    validate = core.preemptions.validators(preemption_instance_id(piid))[0]

    def check(changed, proof=justification):
        return validate(encode_value(changed), proof)

    assert check(value) is None
    oldest = max(ages, key=ages.get)
    oldest_node = core.job_view(oldest)["primary"]
    wrong_victim = dataclasses.replace(value, node=oldest_node, victims=(
        PreemptionVictim(job_id=oldest, fence=core.job_view(oldest)["fence"]),))
    assert "victim rule" in check(wrong_victim)
    two = sorted(value.victims + (PreemptionVictim(job_id=oldest, fence=1),), key=lambda v: v.job_id)
    assert "victim rule" in check(dataclasses.replace(value, victims=tuple(two)))   # not minimal
    assert "no decline" in check(value, justification[1:])
    assert "victim rule" in check(value, justification[:4])   # the chosen node's vector left out
    assert "not this job attempt" in check(dataclasses.replace(value, attempt=1))
    # The same choice for a job of the victims' priority follows no rule: nothing may go.
    same, same_envelope = job_of(100, priority=10)
    assert check(dataclasses.replace(value, job=same_envelope)) is not None


def test_the_spec_vector_decodes_and_its_hash_and_instance_follow_p8a():
    import hashlib
    import pathlib

    from protocol.messages import decode_message, decode_value, value_hash
    from testnet import spec_tables
    spec = (pathlib.Path(__file__).parent.parent / "SPEC.md").read_text()
    lines = dict(line.split(": ", 1) for line in spec_tables.generated_block(spec, "preemption vector")
                 .strip("`\n").splitlines())
    data = bytes.fromhex(lines["preemption_value"])
    value = decode_value("preemption", data)
    assert len(value.victims) == 2 and value.attempt == 0
    envelope, job = decode_message(value.job, spec_tables.vector_mesh_id(), allow_any_mesh=True)
    assert envelope.signer == job.owner
    assert lines["value_hash"] == value_hash(data).hex()
    assert lines["instance"] == hashlib.sha256(b"preempt" + job_id(job)).hexdigest()
    reordered = value.to_body()
    reordered["victims"] = reordered["victims"][::-1]
    with pytest.raises(Exception):
        decode_value("preemption", encode_value_body(reordered))   # victims out of order: no Preemption


def encode_value_body(body):
    from protocol import codec
    return codec.pack(body)


def encode_value(value):
    from protocol import codec
    return codec.pack(value.to_body())


# --- the simulator, `meshnode sim --preempt` ---------------------------------------------------------

SAFETY_CHECKS = ("agreement", "validity", "certificate", "overcommit", "own_votes", "evidence", "ledger",
                 "core_error")


def test_sim_preempt_without_faults_preempts_and_every_check_holds():
    """Seeds 71 and 73 stalled (liveness) while a round's leader lacked a member's decline:
    no hold (P3a) anywhere but at the entry, so no preemption could be proposed (P8b)."""
    from testnet.sim import SimConfig, run_simulation
    results = [run_simulation(SimConfig(nodes=4, jobs=30, seed=seed, faults=(), job_ms=1500, preempt=True))
               for seed in (71, 73)]
    assert [r.violation_count for r in results] == [0, 0], [v.line() for r in results for v in r.violations]
    assert sum(r.counters.get("preemptions", 0) for r in results) > 0


def test_sim_preempt_with_faults_and_byzantine_stake_keeps_safety():
    """Over capacity with faults, some jobs wait past the liveness bound (as they do with
    preemption off: BENCHMARKS.md); no safety check may fail."""
    from testnet.sim import FAULTS, SimConfig, run_simulation
    results = []
    for seed in range(12):   # until a seed preempts (which ones do depends on the whole history)
        results.append(run_simulation(SimConfig(nodes=4, jobs=20, seed=seed, faults=FAULTS, byzantine_milli=200,
                                                job_ms=1500, preempt=True)))
        if results[-1].counters.get("preemptions", 0):
            break
    assert not [v.line() for r in results for v in r.violations if v.check != "liveness"]
    assert sum(r.counters.get("preemptions", 0) for r in results) > 0


def test_why_says_which_job_preempted_a_job():
    from rich.console import Console

    from meshnode.cli.node import render_why
    for state, said in (("pending", "preempted by"), ("running", "it was preempted by job")):
        console = Console(record=True, width=200)
        render_why(console, {"job_id": "ab" * 32, "state": state, "declines": {}, "hint": None,
                             "preempted_by": "cd" * 32})
        text = console.export_text()
        assert said in text and "cdcdcdcd" in text


def test_a_bid_arriving_after_the_last_bid_window_closed_is_proposed_at_once():
    """Room freed mid-round (an exit, a preemption) brings a bid after the leader's bid
    window closed, while a member stays silent: the leader proposes with it then, not a
    round timeout later (seed 35 of the --preempt sweep waited round after round)."""
    net = Net(gpus=(0, 0, 1, 0))
    late, silent = KEYS[2], KEYS[3]
    for nonce in range(1, 50):
        job, envelope = job_of(nonce)
        if net.cores[KEYS[0]].view.leader(job_id(job), 0) in KEYS[:2]:
            break
    net.down.update((late, silent))
    net.submit(KEYS[0], envelope)
    net.run(150)   # the window and its extension closed with two declines and no bid
    assert net.cores[KEYS[0]].job_view(job_id(job))["state"] == "pending"
    net.down.discard(late)
    net.emit(late, net.cores[late].step(envelope, net.now, KEYS[0]))
    net.run(20)    # far less than a round's timeout (200 ms)
    assert net.cores[KEYS[0]].job_view(job_id(job))["primary"] == late


def test_a_held_decline_of_ours_from_before_a_restart_is_answered_afresh_not_raised():
    """P3a: the leader forwards every decline it holds, ours too; a node that restarted
    since holds no answer of its own for the instance (a sweep raised KeyError here)."""
    from protocol.ready import Ready
    net = Net(gpus=(0, 0, 0, 0))
    job, envelope = job_of(1)
    net.submit(KEYS[0], envelope)
    net.run(300)
    core = net.cores[KEYS[1]]
    inst = core.instances[job_id(job)]
    assert core.placement.round_on_hold(inst, net.now)
    del core.bidding.mine[job_id(job)]          # as after a restart: our decline came back forwarded
    out = Ready()
    assert core.placement.bid_again(inst, core.job_table.get(job_id(job)), net.now, out) is False
    assert core.bidding.mine[job_id(job)][0] == "decline"   # answered afresh: still no room


def preempted_until_stopped():
    """preempted_net, stopped as the preempting node orders the victim's run to stop (where
    its driver reads the final checkpoint): (net, lows, high, node, victim, its fence)."""
    net = Net(gpus=(1, 1, 1, 1))
    lows = [job_of(n, priority=10, preemptible=True) for n in (1, 2, 3, 4)]
    fill(net, lows)
    high, envelope = job_of(100, priority=900)
    net.submit(KEYS[2], envelope)
    for _ in range(600):
        net.run(5)
        stopped = [(key, e) for key in KEYS for e in net.events[key] if e.kind == "job_preempted"]
        if stopped:
            node, event = stopped[0]
            return net, lows, high, node, bytes.fromhex(event.detail["job_id"]), event.detail["fence"]
    raise AssertionError("no preemption")


def test_a_victim_is_checkpointed_as_it_is_stopped_and_resumes_from_that_final_checkpoint():
    """P8d: the preempting node's driver stops the victim's run and reads its state as it
    stops (as for a move, R2); that final checkpoint, newer than the periodic one, is what
    the victim's next attempt resumes from, here on the same node once the job ends."""
    net, lows, high, node, victim, fence = preempted_until_stopped()
    core = net.cores[node]
    ready = core.hand_over_moved(victim, fence, (2, 25, net.now, b"final"), net.now)
    handed = [e for e in ready.events if e.kind == "checkpoint_handed_over"]
    assert handed and handed[0].detail["final"] and handed[0].detail["preempted"]
    assert [r.value["seq"] for r in ready.persist if r.table == "checkpoints"] == [2]
    net.emit(node, ready)
    assert core.hand_over_moved(victim, fence, (3, 30, net.now, b"again"), net.now).events == []   # once
    net.run(1000)
    high_fence = core.job_view(job_id(high))["fence"]
    net.emit(node, core.workload_started(job_id(high), high_fence, 0, net.now))
    net.emit(node, core.job_exited(job_id(high), 0, net.now))
    net.run(2000)
    assert core.job_view(victim)["primary"] == node
    runs = [run for d in net.decisions[node] if d.value_kind == "run" for run in d.value if run.job_id == victim]
    assert runs[-1].resume and core.job_view(victim)["last_checkpoint_seq"] == 2   # the final one


def test_a_victim_placed_elsewhere_resumes_from_the_final_checkpoint_of_the_node_that_preempted_it():
    """P8d with R1's hand-over: the final checkpoint, read as the run stopped, goes to the
    victim's next primary, another node, when the preempting node applies that placement."""
    net, lows, high, node, victim, fence = preempted_until_stopped()
    net.emit(node, net.cores[node].hand_over_moved(victim, fence, (2, 25, net.now, b"final"), net.now))
    # Room elsewhere: another low job ends, and the victim is placed there.
    other = next(job_id(j) for j, _ in lows if job_id(j) != victim
                 and net.cores[KEYS[0]].job_view(job_id(j))["primary"] != node)
    holder = net.cores[KEYS[0]].job_view(other)["primary"]
    net.emit(holder, net.cores[holder].job_exited(other, 0, net.now))
    net.run(1000)
    view = net.cores[holder].job_view(victim)
    assert view["state"] == "placed" and view["primary"] == holder
    assert view["last_checkpoint_seq"] == 2
    runs = [run for d in net.decisions[holder] if d.value_kind == "run" for run in d.value if run.job_id == victim]
    assert runs and runs[-1].resume


def test_without_a_final_checkpoint_the_periodic_one_is_handed_over_in_time():
    """A node whose driver reads no final checkpoint (the simulator's) still hands the
    victim's newest periodic checkpoint to its next primary within that primary's wait."""
    net, lows, high, node, victim, fence = preempted_until_stopped()
    other = next(job_id(j) for j, _ in lows if job_id(j) != victim
                 and net.cores[KEYS[0]].job_view(job_id(j))["primary"] != node)
    holder = net.cores[KEYS[0]].job_view(other)["primary"]
    net.emit(holder, net.cores[holder].job_exited(other, 0, net.now))
    net.run(1000)
    assert net.cores[holder].job_view(victim)["last_checkpoint_seq"] == 1
    assert not [e for e in net.events[holder] if e.kind == "checkpoint_handoff_timeout"]
