"""Strict quotas by admission (SPEC.md Q2b-Q2d): the quota home rule, the grant, the
validators' check from the proposal alone, and four cores where concurrent submissions of
one owner through different members stay within its quota (they did not under Q2's
per-member bid rule: each member counted only its own bids)."""

import dataclasses

from protocol import codec
from protocol.messages import JobRefusal, Proposal, QuotaGrant, decode_message, encode_message, job_id
from protocol.quota_admission import (GRANT_PERSIST_PREFIX, grant_error, grant_for, home_ranking, quota_home,
                                      quota_homes)
from protocol.signing import short_id
from tests.test_mesh_core import GENESIS, IDS, KEYS, OWNER, Net
from tests.test_quota import POOLS, manifest

POOLED = dataclasses.replace(GENESIS, pools=POOLS)   # OWNER: 1 GPU in pool 'training'
HOME = quota_home(sorted(KEYS), OWNER.public_key, "training")
HOMES = quota_homes(Net(genesis=POOLED).cores[KEYS[0]].view, OWNER.public_key, "training")
IDENTITY_OF = {identity.public_key: identity for identity in IDS}


def submit(net, at, job):
    net.submit(at, encode_message(OWNER, POOLED.mesh_id, job))
    return job_id(job)


def live_gpu_milli(net, jids) -> int:
    """What the owner's jobs hold, by the primaries' own ledgers (the truth, not a table)."""
    return sum(1000 * len(core.ledger.allocated(jid).gpus) for core in net.cores.values() for jid in jids
               if core.ledger.allocated(jid) is not None)


# --- the home rule and the grant -------------------------------------------------------------------
def test_the_home_is_one_member_every_member_computes_alike_and_moves_only_when_it_leaves():
    members = sorted(KEYS)
    home = quota_home(members, OWNER.public_key, "training")
    assert home in members and quota_home(list(reversed(members)), OWNER.public_key, "training") == home
    others = [m for m in members if m != home]
    assert quota_home([home] + others[1:], OWNER.public_key, "training") == home   # a non-home leaves: unchanged
    assert quota_home(others, OWNER.public_key, "training") in others                # the home leaves: another
    # The pool is length-prefixed: ("ab", owner) and ("a", owner + "b"...) hash apart.
    assert len({quota_home(members, bytes([i]) * 32, "training") for i in range(32)}) > 1


def test_the_deputies_are_the_shortest_prefix_of_the_ranking_holding_over_a_third_of_the_stake():
    from protocol.quorum import EpochView
    members = sorted(KEYS)
    ranking = home_ranking(members, OWNER.public_key, "training")
    equal = EpochView(0, {key: 10 for key in members})
    assert quota_homes(equal, OWNER.public_key, "training") == tuple(ranking[:2])   # 20 of 40 > 40 / 3
    heavy = EpochView(0, {key: 100 if key == ranking[0] else 10 for key in members})
    assert quota_homes(heavy, OWNER.public_key, "training") == (ranking[0],)        # 100 of 130 alone
    light = EpochView(0, {key: 1 if key == ranking[0] else 10 for key in members})
    assert quota_homes(light, OWNER.public_key, "training") == tuple(ranking[:2])   # 11 of 31 > 31 / 3


def test_a_grant_is_checked_against_its_job_and_its_signer_from_its_bytes_alone():
    net = Net(genesis=POOLED)
    view = net.cores[KEYS[0]].view
    job = manifest(1)
    grant = grant_for(job)
    assert (grant.job_id, grant.epoch, grant.owner, grant.pool, grant.gpu_milli) == (
        job_id(job), 0, OWNER.public_key, "training", 1000)
    good = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, grant)
    assert grant_error(good, job, view, POOLED.mesh_id) is None
    not_home = next(key for key in KEYS if key not in HOMES)
    forged = encode_message(IDENTITY_OF[not_home], POOLED.mesh_id, grant)
    assert "not a quota home" in grant_error(forged, job, view, POOLED.mesh_id)
    other_job = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, grant_for(manifest(2)))
    assert "not this job's" in grant_error(other_job, job, view, POOLED.mesh_id)
    smaller = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, dataclasses.replace(grant, gpu_milli=500))
    assert "not this job's" in grant_error(smaller, job, view, POOLED.mesh_id)
    assert "quota grant" in grant_error(encode_message(OWNER, POOLED.mesh_id, job), job, view, POOLED.mesh_id)


def test_a_member_refuses_a_grant_not_signed_by_the_home():
    net = Net(genesis=POOLED)
    member = net.cores[next(key for key in KEYS if key not in HOMES)]
    not_home = next(key for key in KEYS if key not in HOMES + (member.me,))
    forged = encode_message(IDENTITY_OF[not_home], POOLED.mesh_id, grant_for(manifest(1)))
    member.step(forged, 0, not_home)
    assert member.counters["rejected_quota_grant"] == 1
    assert member.bidding.scheduling.admission.grants == {}


# --- four cores: concurrent submissions through different members ---------------------------------------
def test_concurrent_submissions_of_one_owner_through_different_members_stay_within_its_quota():
    """On main (Q2, a per-member bid rule) each of the four members bid for the job it was
    handed, each counting only its own bids: 4 GPUs placed against a 1-GPU quota."""
    net = Net(genesis=POOLED)
    jids = [submit(net, key, manifest(nonce, created_ms=nonce)) for nonce, key in enumerate(KEYS, start=1)]
    peak = 0
    for _ in range(40):
        net.run(25)
        peak = max(peak, live_gpu_milli(net, jids))
    assert peak == 1000
    states = [net.cores[KEYS[0]].job_view(jid)["state"] for jid in jids]
    assert states.count("placed") == 1 and states.count("pending") == 3
    placed = jids[states.index("placed")]
    assert placed == jids[0]   # the home grants in queue order (Q3): the oldest first
    # Its exit frees the quota: the home grants the next job, which is placed; never two at once.
    primary = net.cores[KEYS[0]].job_view(placed)["primary"]
    net.emit(primary, net.cores[primary].job_exited(placed, 0, net.now))
    for _ in range(40):
        net.run(25)
        peak = max(peak, live_gpu_milli(net, jids))
    assert peak == 1000
    assert [net.cores[KEYS[0]].job_view(jid)["state"] for jid in jids[1:]].count("placed") == 1


def grant_signers(net, jid) -> set:
    return {decode_message(core.bidding.scheduling.admission.grants[jid], POOLED.mesh_id)[0].signer
            for core in net.cores.values() if jid in core.bidding.scheduling.admission.grants}


def test_with_the_home_up_only_the_home_grants():
    net = Net(genesis=POOLED)
    jids = [submit(net, key, manifest(nonce, created_ms=nonce)) for nonce, key in enumerate(KEYS, start=1)]
    net.run(3000)   # longer than any deputy's hand-over
    assert grant_signers(net, jids[0]) == {HOME}
    assert all(grant_signers(net, jid) == set() for jid in jids[1:])   # over the quota: no one grants them


def test_a_deputy_grants_what_a_silent_home_leaves_waiting():
    net = Net(genesis=POOLED)
    net.down.add(HOME)
    entry = next(key for key in KEYS if key not in HOMES)
    jid = submit(net, entry, manifest(1))
    net.run(500)
    assert net.cores[entry].job_view(jid)["state"] == "pending"   # the deputy waits its hand-over first
    report = net.cores[entry].pending_report(jid, net.now)["quota"]
    assert report.startswith("waiting for a quota grant from quota home %s (deputies %s)" % (
        short_id(HOME), short_id(HOMES[1])))
    net.run(1500)
    assert grant_signers(net, jid) == {HOMES[1]}
    assert all(net.cores[key].job_view(jid)["state"] == "placed" for key in KEYS if key != HOME)


def test_a_proposal_without_the_homes_grant_is_rejected_by_validators():
    net = Net(genesis=POOLED)
    proposals = []
    original_send = net.send

    def send(src, messages):
        for message in messages:
            if codec.unpack(message.data)[2] == "proposal":
                proposals.append(message.data)
        original_send(src, messages)
    net.send = send
    jid = submit(net, KEYS[1], manifest(1))
    net.run(300)
    assert net.cores[KEYS[2]].job_view(jid)["state"] == "placed"
    _envelope, proposal = decode_message(proposals[0], POOLED.mesh_id, expect=Proposal)
    validator = net.cores[KEYS[2]]
    validate = validator.placement._validator(proposal.instance)
    assert validate(proposal.value, proposal.justification) is None
    kinds = [codec.unpack(data)[2] for data in proposal.justification]
    assert kinds[-1] == "quota_grant" and kinds.count("quota_grant") == 1
    without = proposal.justification[:-1]
    assert "needs exactly one quota grant" in validate(proposal.value, without)
    not_home = next(key for key in KEYS if key not in HOMES)
    forged = encode_message(IDENTITY_OF[not_home], POOLED.mesh_id, grant_for(manifest(1)))
    assert "not a quota home" in validate(proposal.value, without + (forged,))
    twice = proposal.justification + (proposal.justification[-1],)
    assert "exactly one" in validate(proposal.value, twice)


def test_a_refused_job_keeps_its_grant_and_is_placed_again_without_a_new_one():
    net = Net(genesis=POOLED)
    jid = submit(net, KEYS[1], manifest(1))
    net.run(300)
    core = net.cores[KEYS[0]]
    primary = core.job_view(jid)["primary"]
    grant = core.bidding.scheduling.admission.grants[jid]
    fence = core.job_view(jid)["fence"]
    refusal = encode_message(IDENTITY_OF[primary], POOLED.mesh_id, JobRefusal(job_id=jid, fence=fence))
    for key in KEYS:
        net.emit(key, net.cores[key].step(refusal, net.now, primary))
    assert core.job_view(jid)["state"] == "pending"
    assert core.bidding.scheduling.admission.counted(OWNER.public_key, "training", net.now).gpu_milli == 1000
    net.run(600)
    assert all(c.job_view(jid)["state"] == "placed" for c in net.cores.values())
    assert all(c.bidding.scheduling.admission.grants[jid] == grant for c in net.cores.values())


def test_grants_are_persisted_and_a_restarted_member_takes_them_back():
    net = Net(genesis=POOLED)
    persisted = {key: [] for key in KEYS}
    original = net.persist

    def persist(src, ready):
        persisted[src].extend(r for r in ready.persist if r.table == "jobs")
        original(src, ready)
    net.persist = persist
    jid = submit(net, KEYS[1], manifest(1))
    net.run(300)
    rows = [r for r in persisted[HOME] if r.key == GRANT_PERSIST_PREFIX + jid.hex()]
    assert len(rows) == 1 and decode_message(rows[0].value["envelope"], POOLED.mesh_id, expect=QuotaGrant)
    from protocol.mesh import MeshCore
    from protocol.policy import LocalCapacity, NodePolicy
    import random
    restarted = MeshCore(identity=IDENTITY_OF[HOME], genesis=POOLED, policy=NodePolicy(),
                         capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * 2), rng=random.Random(0), now_ms=net.now,
                         history=net.certificates[HOME], job_outcomes=[rows[0].value["envelope"]])
    assert restarted.bidding.scheduling.admission.grants[jid] == rows[0].value["envelope"]


# --- SPEC.md Q2b's vectors ------------------------------------------------------------------------------
def test_spec_q2b_quota_home_vector_follows_the_formula():
    import hashlib
    import pathlib
    import re
    from testnet.spec_tables import generated_block
    spec = (pathlib.Path(__file__).resolve().parent.parent / "SPEC.md").read_text(encoding="utf-8")
    block = generated_block(spec, "quota home vector")
    owner = bytes.fromhex(re.search(r"owner: ([0-9a-f]{64})", block).group(1))
    pool = re.search(r"pool: (\S+)", block).group(1).encode()
    rows = re.findall(r"member ([0-9a-f]{64}) digest ([0-9a-f]{64})", block)
    assert len(rows) == 4
    for member, digest in rows:
        expected = hashlib.sha256(b"meshnode quota home v1" + owner + bytes([len(pool)]) + pool
                                  + bytes.fromhex(member)).hexdigest()
        assert digest == expected
    home = re.search(r"home: ([0-9a-f]{64})", block).group(1)
    ranked = [member for member, digest in sorted(rows, key=lambda row: bytes.fromhex(row[1]), reverse=True)]
    assert home == ranked[0]
    assert re.search(r"homes, stake 1 each: ([0-9a-f ]+)", block).group(1).split() == ranked[:2]   # 2 of 4 > 4 / 3
    # The 4.4 quota_grant vector: the sample job's grant, by its home (the only member).
    from testnet.spec_tables import sample_body, vector_genesis, vector_key
    from protocol.messages import JobManifest
    envelope_hex = re.search(r"kind: quota_grant\n(?:.*\n)*?envelope: ([0-9a-f]+)", spec).group(1)
    envelope, grant = decode_message(bytes.fromhex(envelope_hex), vector_genesis().mesh_id, expect=QuotaGrant)
    job = JobManifest.from_body(sample_body(JobManifest))
    assert grant == grant_for(job) and envelope.signer == vector_key()
    assert quota_home([vector_key()], job.owner, job.scheduling.pool) == vector_key()


def test_only_a_quota_that_limits_something_needs_a_grant():
    net = Net(genesis=POOLED)
    admission = net.cores[KEYS[0]].bidding.scheduling.admission
    assert admission.needs_grant(manifest(1))                  # OWNER: 1 GPU in 'training'
    assert not admission.needs_grant(manifest(1, pool=""))     # the default pool: Quota(), every dimension 2^40
    unpooled = Net().cores[KEYS[0]].bidding.scheduling.admission
    assert not unpooled.needs_grant(manifest(1))               # no pools declared: no quotas


def test_a_restarted_home_counts_a_grant_of_a_job_it_forgot_for_a_bounded_time():
    """A home that crashed after granting a job, before it held the job's placement, takes
    the grant back from its store but not the job: it counts the grant (or it would grant
    the quota again) for 8 maximal round timeouts, then presumes the job gone (Q2b)."""
    import random
    from protocol.mesh import MeshCore
    from protocol.policy import LocalCapacity, NodePolicy
    from protocol.quota_admission import UNKNOWN_JOB_GRANT_ROUNDS
    grant = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, grant_for(manifest(1)))
    restarted = MeshCore(identity=IDENTITY_OF[HOME], genesis=POOLED, policy=NodePolicy(),
                         capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * 2), rng=random.Random(0), now_ms=1000,
                         job_outcomes=[grant])
    admission = restarted.bidding.scheduling.admission
    assert admission.counted(OWNER.public_key, "training", 1000).gpu_milli == 1000
    later = 1000 + UNKNOWN_JOB_GRANT_ROUNDS * POOLED.params.round_timeout_max_ms
    assert admission.counted(OWNER.public_key, "training", later - 1).gpu_milli == 1000
    assert admission.counted(OWNER.public_key, "training", later).gpu_milli == 0
    # Meanwhile a second job of the owner waits: the quota (1 GPU) is taken by the forgotten one.
    restarted.step(encode_message(OWNER, POOLED.mesh_id, manifest(2)), 1000, KEYS[0])
    ready = restarted.tick(1001)
    assert not [m for m in ready.messages if codec.unpack(m.data)[2] == "quota_grant"]
    ready = restarted.tick(later)
    assert [m for m in ready.messages if codec.unpack(m.data)[2] == "quota_grant"]


def test_a_restarted_home_re_sends_the_grants_it_persisted_of_jobs_still_pending():
    """Simulator seed 42: the home granted a job whose grant no member got (a partition),
    crashed, and took the grant back from its store, but no longer re-sent it (it kept
    only in memory which grants it signed): the job waited 8.8 s, until a deputy's count
    had room for it through a whole hand-over. A home re-sends each grant it signed of a
    job still pending, also after a restart (Q2b)."""
    import random
    from protocol.mesh import MeshCore
    from protocol.policy import LocalCapacity, NodePolicy
    job = manifest(1)
    grant = encode_message(IDENTITY_OF[HOME], POOLED.mesh_id, grant_for(job))
    restarted = MeshCore(identity=IDENTITY_OF[HOME], genesis=POOLED, policy=NodePolicy(),
                         capacity=LocalCapacity(gpu_mem_total_mib=(80_000,) * 2), rng=random.Random(0), now_ms=1000,
                         job_outcomes=[grant])
    entry = next(key for key in KEYS if key != HOME)
    restarted.step(encode_message(OWNER, POOLED.mesh_id, job), 1000, entry)   # the entry node re-sends the job
    every_ms = POOLED.params.round_timeout_max_ms
    broadcasts = [now for now in range(1001, 1002 + 2 * every_ms, 50) for m in restarted.tick(now).messages
                  if m.data == grant and m.to is None]
    assert len(broadcasts) == 2 and broadcasts[1] - broadcasts[0] >= every_ms   # once per maximal round timeout


def test_a_home_counts_a_cancelled_job_until_its_primary_has_had_time_to_stop_it():
    """Simulator seed 140: the home applied a job's cancel 1.2 s before the job's primary
    did, freed its quota at once and granted the next job, which ran beside the cancelled
    one. The home now counts the cancelled job for the cancel's grace (Q2b) first."""
    from protocol.messages import Cancel
    from protocol.quota_admission import CANCEL_STOP_GRACE_ROUNDS
    net = Net(genesis=POOLED, gpus=tuple(0 if key == HOME else 2 for key in KEYS))   # the home runs nothing
    first, second = manifest(1, created_ms=1), manifest(2, created_ms=2)
    jids = [submit(net, KEYS[0], first), submit(net, KEYS[0], second)]
    net.run(1000)
    view = net.cores[KEYS[0]].job_view
    assert [view(jid)["state"] for jid in jids] == ["placed", "pending"]
    primary = view(jids[0])["primary"]
    assert primary != HOME   # else the home's own cancel stops the run, and there is no race
    # Only the home hears the cancel; the primary is cut off (it runs the job meanwhile).
    net.down.add(primary)
    home = net.cores[HOME]
    cancel = encode_message(OWNER, POOLED.mesh_id, Cancel(job_id=jids[0], requested_ms=net.now))
    home.cancel(cancel, net.now)   # its Ready (the cancel's broadcast) is dropped: nobody else hears it
    assert home.job_view(jids[0])["state"] == "cancelled"
    grace_ms = CANCEL_STOP_GRACE_ROUNDS * POOLED.params.round_timeout_max_ms
    net.run(grace_ms - 200)
    assert grant_signers(net, jids[1]) == set()          # the primary may still run the first job
    assert net.cores[primary].ledger.allocated(jids[0]) is not None
    net.run(1000)
    assert grant_signers(net, jids[1]) == {HOME}         # the grace is over: the quota is the second's


def test_a_home_counts_a_cancelled_job_for_the_grace_though_the_primarys_vector_no_longer_lists_it():
    """A vector without the run is no sign that the primary stopped it: one that restarted
    lists it again when it re-runs it, not having heard the cancel (simulator seed 110), so
    the home holds the quota for the whole grace even after the primary stopped it (Q2e)."""
    from protocol.messages import Cancel
    from protocol.quota_admission import CANCEL_STOP_GRACE_ROUNDS
    net = Net(genesis=POOLED, gpus=tuple(0 if key == HOME else 2 for key in KEYS))   # the home runs nothing
    jids = [submit(net, KEYS[0], manifest(1, created_ms=1)), submit(net, KEYS[0], manifest(2, created_ms=2))]
    net.run(1000)
    primary = net.cores[KEYS[0]].job_view(jids[0])["primary"]
    fence = net.cores[primary].job_table.get(jids[0]).fence
    net.emit(primary, net.cores[primary].workload_started(jids[0], fence, 0, net.now))
    net.run(300)
    assert net.cores[HOME].job_view(jids[0])["state"] == "running"
    cancel = encode_message(OWNER, POOLED.mesh_id, Cancel(job_id=jids[0], requested_ms=net.now))
    _, ready = net.cores[KEYS[0]].cancel(cancel, net.now)
    net.emit(KEYS[0], ready)
    grace_ms = CANCEL_STOP_GRACE_ROUNDS * POOLED.params.round_timeout_max_ms
    net.run(grace_ms - 200)
    home_capability = net.cores[HOME].capability
    assert not home_capability.shows_running(primary, jids[0], fence)   # the primary stopped it, and said so
    assert grant_signers(net, jids[1]) == set()                      # yet the home waits out the grace
    net.run(1000)
    assert grant_signers(net, jids[1]) == {HOME}
    assert live_gpu_milli(net, jids) == 1000
