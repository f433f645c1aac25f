"""Borrowing (SPEC.md Q6): a preemptible job beyond its owner's quota runs on borrowed
quota, granted as borrowed by its quota home and counted apart from the quota; an in-quota
job that finds no room reclaims borrowed capacity in its pool whatever the borrower's
priority, borrowed victims first. The pure rules, then four cores end to end."""

import dataclasses
from pathlib import Path

from protocol import codec
from protocol.messages import JobManifest, QuotaGrant, Scheduling, decode_message, encode_message, job_id
from protocol.preemption import Quota, choose_victims
from protocol.quota_admission import grant_error, grant_for, quota_homes
from protocol.signing import short_id
from tests.test_mesh_core import KEYS, OWNER, Net
from tests.test_preemption import encode_value, manifests, vector
from tests.test_quota import OTHER_OWNER, manifest
from tests.test_quota_grants import HOME, IDENTITY_OF, POOLED

SPEC = Path(__file__).resolve().parent.parent / "SPEC.md"


def preemptible(nonce, owner=OWNER, priority=0, created_ms=0):
    job = manifest(nonce, owner=owner, priority=priority, created_ms=created_ms)
    return dataclasses.replace(job, scheduling=dataclasses.replace(job.scheduling, preemptible=True))


# --- the grant ---------------------------------------------------------------------------------------
def test_a_borrowed_grant_is_only_for_a_preemptible_job_and_an_in_quota_grant_keeps_its_bytes():
    net = Net(genesis=POOLED)
    view = net.cores[KEYS[0]].view
    borrower, pinned = preemptible(1), manifest(2)
    assert "borrowed" not in grant_for(borrower).to_body()            # left out when false: old bytes
    assert grant_for(borrower, True).to_body()["borrowed"] is True
    home = IDENTITY_OF[HOME]
    good = encode_message(home, POOLED.mesh_id, grant_for(borrower, True))
    assert grant_error(good, borrower, view, POOLED.mesh_id) is None
    assert grant_error(good, borrower, view, POOLED.mesh_id, borrowed=True) is None
    assert "expected in-quota" in grant_error(good, borrower, view, POOLED.mesh_id, borrowed=False)
    not_preemptible = encode_message(home, POOLED.mesh_id, grant_for(pinned, True))
    assert "not preemptible" in grant_error(not_preemptible, pinned, view, POOLED.mesh_id)
    # A member refuses it too (it would let a non-preemptible job run beyond its quota).
    member = net.cores[next(key for key in KEYS if key != HOME)]
    member.step(encode_message(OWNER, POOLED.mesh_id, pinned), 0, OWNER.public_key)
    member.step(not_preemptible, 0, HOME)
    assert member.counters["rejected_quota_grant"] == 1


def test_spec_q6_borrowed_grant_vector_is_the_preemptible_sample_jobs_borrowed_grant():
    from testnet import spec_tables
    lines = dict(line.split(": ", 1) for line in spec_tables.generated_block(SPEC.read_text(), "borrowed grant vector")
                 .splitlines() if ": " in line)
    job = JobManifest.from_body(codec.unpack(bytes.fromhex(lines["job_body"])))
    assert job.scheduling.preemptible and lines["job_id"] == job_id(job).hex()
    envelope, grant = decode_message(bytes.fromhex(lines["envelope"]), spec_tables.vector_mesh_id(), expect=QuotaGrant)
    assert codec.pack(grant.to_body()).hex() == lines["grant_body"]
    assert grant == grant_for(job, True) and envelope.signer == job.owner   # the vector key signs its own
    # The same grant in quota is 4.4's quota_grant bytes for the non-preemptible sample (no `borrowed` key).
    assert b"borrowed" in bytes.fromhex(lines["grant_body"])
    assert b"borrowed" not in codec.pack(grant_for(job).to_body())


# --- the victim rule (Q6's reclaim) ---------------------------------------------------------------
def test_an_in_quota_job_reclaims_a_borrowed_job_of_its_pool_whatever_its_priority():
    reclaimer = manifest(100, owner=OTHER_OWNER)                     # priority 0
    borrower = preemptible(1, priority=500)
    other_pool = dataclasses.replace(borrower, nonce=2, scheduling=Scheduling(pool="", preemptible=True))
    cap = vector([(borrower, 50), (other_pool, 10)])
    of = manifests(borrower, other_pool)
    both = frozenset({job_id(borrower), job_id(other_pool)})
    assert choose_victims(reclaimer, cap, of) is None                      # P8 alone: higher priority
    assert choose_victims(reclaimer, cap, of, Quota(False, both)) is None  # not in quota: no reclaim
    chosen = choose_victims(reclaimer, cap, of, Quota(True, both))
    assert [c.job_id for c in chosen] == [job_id(borrower)]                # its pool only


def test_borrowed_victims_go_first_then_the_least_work_lost():
    high = manifest(100, priority=900)
    in_quota, borrowed = preemptible(1, priority=10), preemptible(2, priority=10)
    cap = vector([(in_quota, 5), (borrowed, 500)])      # the in-quota one loses less work
    of = manifests(in_quota, borrowed)
    assert [c.job_id for c in choose_victims(high, cap, of)] == [job_id(in_quota)]   # P8: least work lost
    chosen = choose_victims(high, cap, of, Quota(False, frozenset({job_id(borrowed)})))
    assert [c.job_id for c in chosen] == [job_id(borrowed)]


# --- four cores --------------------------------------------------------------------------------------
def run_jobs(net, jobs, owner_of):
    """Submit ``jobs`` one by one, start each and checkpoint it (ages 10 ms apart, the first
    youngest), then let every node send a fresh vector (what the victim rule reads)."""
    for job in jobs:
        net.submit(KEYS[0], encode_message(owner_of(job), POOLED.mesh_id, job))
        net.run(300)
    for index, job in enumerate(jobs):
        view = net.cores[KEYS[0]].job_view(job_id(job))
        assert view["state"] == "placed", view
        primary = view["primary"]
        core = net.cores[primary]
        net.emit(primary, core.workload_started(job_id(job), view["fence"], 0, net.now))
        net.emit(primary, core.local_checkpoint(job_id(job), 1, 10, net.now - 10 * index, b"s", net.now - 10 * index))
    net.deliver()
    net.now += 1000
    for key in KEYS:
        net.emit(key, net.cores[key].update_telemetry((), 100, net.now))
    net.deliver()


def idle_net():
    net = Net(gpus=(1, 1, 1, 1), genesis=POOLED)
    for key in KEYS:   # every member's vector: the homes grant as borrowed only while a node has room
        net.emit(key, net.cores[key].update_telemetry((), 100, net.now))
    net.deliver()
    return net


def owner_of(job):
    return OWNER if job.owner == OWNER.public_key else OTHER_OWNER


def borrowed_of(net, jid) -> bool | None:
    admission = net.cores[KEYS[0]].bidding.scheduling.admission
    grant = admission.granted.get(jid)
    return None if grant is None else grant[0].borrowed


def test_an_owner_beyond_its_quota_borrows_and_an_in_quota_job_reclaims_a_borrowed_gpu():
    net = idle_net()
    mine = [preemptible(n, created_ms=n) for n in (1, 2, 3)]     # OWNER: a 1-GPU quota in 'training'
    other = manifest(10, owner=OTHER_OWNER, created_ms=10)          # 4-GPU quota: in quota
    run_jobs(net, mine + [other], owner_of)
    assert [borrowed_of(net, job_id(j)) for j in mine] == [False, True, True]
    assert borrowed_of(net, job_id(other)) is False
    home = quota_homes(net.cores[KEYS[0]].view, OWNER.public_key, "training")[0]
    counted = net.cores[home].bidding.scheduling.admission.counted(OWNER.public_key, "training", net.now)
    assert counted.gpu_milli == 1000                               # the borrowed two count nothing
    why = net.cores[KEYS[0]].borrowing_report(job_id(mine[1]), net.now)
    assert why == ("running on borrowed quota (pool 'training': owner %s's quota gpu_milli 1000 cpu_milli 8000, "
                   "in use gpu_milli 1000 cpu_milli 500): may be preempted by in-quota work" % short_id(OWNER.public_key))
    assert net.cores[KEYS[0]].borrowing_report(job_id(mine[0]), net.now) is None
    # The mesh is full. Another owner's in-quota job of priority 0 reclaims a borrowed GPU;
    # the in-quota jobs (OWNER's first, the other owner's) are never victims.
    reclaimer = manifest(11, owner=OTHER_OWNER, created_ms=11)
    net.submit(KEYS[2], encode_message(OTHER_OWNER, POOLED.mesh_id, reclaimer))
    net.run(3000)
    decided = [d.value for d in net.certified(KEYS[1], "preemption")]
    assert len(decided) == 1
    (victim,) = [v.job_id for v in decided[0].victims]
    assert victim == job_id(mine[1])   # borrowed, and the younger checkpoint of the two borrowed
    view = net.cores[KEYS[0]].job_view(job_id(reclaimer))
    assert view["state"] == "placed" and view["primary"] == decided[0].node
    assert net.cores[KEYS[0]].job_view(victim)["state"] == "pending"
    assert net.cores[KEYS[0]].job_view(victim)["preempted_by"] == job_id(reclaimer)
    # It waits for capacity with its borrowed grant, and resumes once the reclaimer ends.
    node = view["primary"]
    net.emit(node, net.cores[node].workload_started(job_id(reclaimer), view["fence"], 0, net.now))
    net.emit(node, net.cores[node].job_exited(job_id(reclaimer), 0, net.now))
    net.run(2000)
    assert net.cores[KEYS[0]].job_view(victim)["state"] == "placed"
    runs = [run for d in net.decisions[node] if d.value_kind == "run" for run in d.value if run.job_id == victim]
    assert runs[-1].resume


def test_a_non_preemptible_job_over_quota_waits_and_a_borrower_reclaims_nothing():
    net = idle_net()
    first, pinned = preemptible(1, created_ms=1), manifest(2, created_ms=2)
    net.submit(KEYS[0], encode_message(OWNER, POOLED.mesh_id, first))
    net.run(300)
    net.submit(KEYS[0], encode_message(OWNER, POOLED.mesh_id, pinned))
    net.run(1500)
    assert borrowed_of(net, job_id(pinned)) is None   # waits for the quota, as Q2b
    assert net.cores[KEYS[0]].job_view(job_id(pinned))["state"] == "pending"
    report = net.cores[KEYS[0]].pending_report(job_id(pinned), net.now)["quota"]
    assert report.startswith("waiting for a quota grant") and "not preemptible" in report


def test_validators_reject_a_reclaim_without_the_grants_that_prove_it():
    from protocol.flows.preemption import PreemptionFlow
    from protocol.messages import placement_instance_id, preemption_instance_id
    net = idle_net()
    mine = [preemptible(n, created_ms=n) for n in (1, 2, 3)]
    run_jobs(net, mine + [manifest(10, owner=OTHER_OWNER, created_ms=10)], owner_of)
    consider = PreemptionFlow.consider
    PreemptionFlow.consider = lambda self, now_ms, out: None   # held, nothing started
    try:
        reclaimer = manifest(11, owner=OTHER_OWNER, created_ms=11)
        net.submit(KEYS[2], encode_message(OTHER_OWNER, POOLED.mesh_id, reclaimer))
        net.run(3000)
        core = net.cores[KEYS[3]]
        piid = placement_instance_id(job_id(reclaimer), 0)
        value, justification = core.preemptions._proposal_value(core.instances[piid],
                                                                core.job_table.get(job_id(reclaimer)), net.now)
    finally:
        PreemptionFlow.consider = consider
    validate = core.preemptions.validators(preemption_instance_id(piid))[0]
    kinds = [decode_message(data, POOLED.mesh_id)[0].kind for data in justification]
    assert kinds[-2:] == ["quota_grant", "quota_grant"]   # the reclaimer's, then the victim's borrowed one
    assert validate(encode_value(value), justification) is None
    assert "victim rule" in validate(encode_value(value), justification[:-1])   # not shown borrowed
    assert "victim rule" in validate(encode_value(value), justification[:-2] + justification[-1:])   # not in quota
    swapped = justification[:-2] + (justification[-1], justification[-2])
    assert validate(encode_value(value), swapped) is None   # order of grants does not matter
    forged = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, grant_for(mine[0], True))   # an in-quota job
    assert "neither" in validate(encode_value(value), justification + (forged,))


# --- the simulator ------------------------------------------------------------------------------------
def test_the_sims_borrowing_audit_flags_a_reclaim_of_an_in_quota_job_and_a_borrowed_pinned_job():
    from types import SimpleNamespace

    from protocol.messages import PreemptionVictim
    from testnet.sim_borrowing import BorrowingAudit
    failures = []
    checker = SimpleNamespace(fail=lambda check, node, instance, detail: failures.append(check))
    low_borrowed, low_in_quota, high = preemptible(1, priority=900), preemptible(2, priority=900), manifest(3)
    pinned = manifest(4)
    granted = {job_id(low_borrowed): (grant_for(low_borrowed, True), 0),
               job_id(low_in_quota): (grant_for(low_in_quota), 0), job_id(high): (grant_for(high), 0),
               job_id(pinned): (dataclasses.replace(grant_for(pinned), borrowed=True), 0)}
    core = SimpleNamespace(bidding=SimpleNamespace(scheduling=SimpleNamespace(admission=SimpleNamespace(
        granted=granted))))
    audit = BorrowingAudit(checker, {job_id(j): j for j in (low_borrowed, low_in_quota, high, pinned)}, lambda: [core])
    audit.preempted(0, b"i", job_id(high), (PreemptionVictim(job_id=job_id(low_borrowed), fence=1),))
    assert failures == [] and audit.counters["reclaims"] == 1
    audit.preempted(0, b"i", job_id(high), (PreemptionVictim(job_id=job_id(low_in_quota), fence=1),))
    assert failures == ["reclaim_of_in_quota_job"]
    audit.placed(0, b"i", job_id(pinned))
    assert failures[-1] == "borrowed_not_preemptible" and audit.counters["borrowed_placements"] == 1


def test_sim_quota_sweep_borrows_and_every_check_holds():
    from testnet.sim import SimConfig, run_simulation
    results = [run_simulation(SimConfig(nodes=4, jobs=10, seed=seed, faults=(), job_ms=1500, preempt=True,
                                        quota_gpus=1)) for seed in (0, 2)]
    assert all(r.violations == [] for r in results), [r.violations for r in results]
    assert sum(r.counters.get("borrowed_placements", 0) for r in results) > 0
    assert max(r.counters.get("quota_overshoot_peak_gpu_milli", 0) for r in results) == 0
