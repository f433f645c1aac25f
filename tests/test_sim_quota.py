"""SPEC.md Q2f: the simulator checks Q2d's quota bound as a safety property. Per honest
home or deputy and (owner, pool), the jobs it granted that honest nodes run hold at most
the quota (but a cancelled job its primary runs past the home's Q2e grace); a run that
breaks it fails like an overcommit."""

from protocol.quota import Usage
from testnet.sim_quota import QuotaBoundCheck
from tests.test_quota import OWNER, manifest

QUOTA = Usage(gpu_milli=1000, cpu_milli=1 << 40, mem_mib=1 << 40)   # one GPU in pool 'training'
GRACE_MS = 1600
HONEST = frozenset({0, 1, 2})   # node 3 is Byzantine
ONE, TWO, THREE = manifest(1), manifest(2), manifest(3, gpu_milli=500)
JID = {job: bytes([job.nonce]) * 32 for job in (ONE, TWO, THREE)}


def checker():
    failures = []
    check = QuotaBoundCheck(lambda owner, pool: QUOTA if (owner, pool) == (OWNER.public_key, "training") else None,
                            GRACE_MS, lambda *failure: failures.append(failure))
    return check, failures


def running(*jobs):
    return {JID[job]: job for job in jobs}


def test_one_honest_homes_grants_running_over_the_quota_fail_the_run():
    check, failures = checker()
    check.granted(0, JID[ONE], 10)
    check.granted(0, JID[TWO], 20)
    check.check(30, running(ONE), HONEST)
    assert failures == []
    check.check(40, running(ONE, TWO), HONEST)     # 2000 GPU milli on node 0's grants, quota 1000
    assert len(failures) == 1
    kind, node, _instance, detail = failures[0]
    assert (kind, node) == ("quota", 0) and "gpu_milli 2000 > 1000" in detail and "granted by node 0" in detail
    check.check(50, running(ONE, TWO), HONEST)     # the same breach is reported once
    assert len(failures) == 1 and check.peak_signer_over_gpu_milli == 1000


def test_two_honest_homes_that_did_not_hear_each_other_stay_within_k_times_the_quota():
    """Q2d: each honest home grants within the quota by its own count; with k of them an
    owner's jobs hold at most k x L. Jobs only a Byzantine home granted are not bounded."""
    check, failures = checker()
    check.granted(0, JID[ONE], 10)     # the home
    check.granted(1, JID[TWO], 20)     # a deputy that missed the home's grant
    check.granted(3, JID[THREE], 30)   # a Byzantine deputy, over the quota
    check.check(40, running(ONE, TWO, THREE), HONEST)
    assert failures == []
    assert (check.peak_honest_over_gpu_milli, check.peak_honest_signers, check.peak_signer_over_gpu_milli) == (
        1000, 2, 0)


def test_a_job_granted_by_an_honest_and_a_byzantine_home_counts_for_the_honest_one():
    check, failures = checker()
    check.granted(3, JID[ONE], 10)
    check.granted(0, JID[ONE], 15)     # the late honest home: it counts the job from now on
    check.granted(0, JID[THREE], 20)
    check.check(30, running(ONE, THREE), HONEST)
    assert [failure[:2] for failure in failures] == [("quota", 0)]


def test_a_cancelled_job_run_past_the_homes_grace_is_q2es_exception_not_before():
    """Q2e: the home counts a cancelled job from its first tick after the cancel for the
    grace; a primary still running it after that runs it beside what the home granted."""
    for now_ms, breached in ((100 + GRACE_MS - 1, True), (100 + GRACE_MS, False)):
        check, failures = checker()
        check.granted(0, JID[ONE], 10)
        check.cancelled(0, JID[ONE], 95)
        check.ticked(1, 100)           # another node's tick does not start node 0's grace
        check.ticked(0, 100)           # node 0's first tick since the cancel: the grace starts
        check.ticked(0, 150)
        check.granted(0, JID[TWO], now_ms)
        check.check(now_ms, running(ONE, TWO), HONEST)
        assert bool(failures) == breached, now_ms


def test_a_sim_whose_homes_grant_past_the_quota_fails_the_quota_check(monkeypatch):
    """The check is wired into the simulator: homes that count nothing (a broken count)
    let one owner's jobs run over its quota on their grants, and the seed fails."""
    from protocol.quota_admission import QuotaAdmission
    from testnet.sim import SimConfig, Simulation
    monkeypatch.setattr(QuotaAdmission, "over_by", lambda self, record, now_ms: [])
    result = Simulation(SimConfig(nodes=4, jobs=10, seed=2, quota_gpus=1, job_ms=3000, fractional_per_mille=300)).run()
    assert "quota" in {violation.check for violation in result.violations}, result.counters
    assert result.counters["quota_signer_over_peak_gpu_milli"] > 0


def test_sim_seed_110_a_restarted_primarys_vector_without_the_run_does_not_free_a_cancelled_jobs_quota():
    """Simulator seed 110 (Byzantine 0.3): node 4 (honest), primary of a running job at
    fence 1, crashed; the job was cancelled while it was down; it restarted, replayed the
    job as placed (its first vectors do not list the run) and ran it again at fence 1, not
    having heard the cancel. Its home (node 3), which then applied the cancel, took the
    vector without the run for the primary's stop (Q2e's former clause (a)), granted the
    owner's next jobs at once, and they ran beside the cancelled one: 2250 GPU milli on a
    2000 quota. The home now counts a cancelled job for the whole grace."""
    from testnet.sim import SimConfig, Simulation
    result = Simulation(SimConfig(nodes=5, jobs=20, seed=110, byzantine_milli=300, job_ms=1500,
                                  job_fail_per_mille=100, cancel_per_mille=100, fractional_per_mille=300,
                                  quota_gpus=2, reservations=True, preempt=True)).run()
    assert not result.violations, result.violations
    assert result.counters.get("quota_signer_over_peak_gpu_milli", 0) <= 0
