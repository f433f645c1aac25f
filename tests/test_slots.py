"""SPEC.md P7, placement slots: in a mesh with ``placement_slot_ms`` > 0 one instance
places the first attempt of every job created in the same slot window, and a job its
slot left out is placed by its own instance, on the slot's certificate. MeshCore end to
end on the 4-core FIFO router of test_mesh_core."""

import dataclasses
import hashlib
import json

from keys.genesis import DEFAULT_PARAMS
from meshnode.cli import main
from protocol import codec
from protocol.job_table import JobRecord
from protocol.flows.slot import slot_budgets
from protocol.messages import (Cancel, Placement, PlacementSlot, Proposal, decode_message, encode_message, job_id,
                               placement_slot_id)
from tests.test_mesh_core import GENESIS, IDS, KEYS, OWNER, Net, make_job

SLOT_MS = 50
SLOT_GENESIS = dataclasses.replace(GENESIS, params=dataclasses.replace(DEFAULT_PARAMS, placement_slot_ms=SLOT_MS))
SLOT_MESH = SLOT_GENESIS.mesh_id


def slot_job(nonce, created_ms=0, **kwargs):
    return make_job(nonce=nonce, created_ms=created_ms, mesh=SLOT_MESH, **kwargs)


def placed_jobs(value: PlacementSlot) -> list[bytes]:
    return sorted(job_id(decode_message(p.job, SLOT_MESH)[1]) for p in value.placements)


def test_p7_one_instance_places_every_job_created_in_the_same_slot_window():
    net = Net(gpus=(4, 4, 4, 4), genesis=SLOT_GENESIS)
    jobs = [slot_job(n, created_ms=10 * n) for n in range(1, 5)]  # created at 10..40 ms: slot 0
    for index, (_job, envelope) in enumerate(jobs):
        net.submit(KEYS[index], envelope)
    net.run(200)
    slot = placement_slot_id(0, 0)
    for key in KEYS:
        decided = net.certified(key, "placement_slot")
        assert [d.instance for d in decided] == [slot]
        assert not net.certified(key, "placement")  # no job needed an instance of its own
        assert placed_jobs(decided[0].value) == sorted(job_id(job) for job, _ in jobs)
        for job, _ in jobs:
            view = net.cores[key].job_view(job_id(job))
            assert (view["state"], view["fence"], view["attempt"], view["instance"]) == ("placed", 1, 0, slot)
    assert len({net.certified(key, "placement_slot")[0].value for key in KEYS}) == 1
    # Each job holds one GPU at its primary; every losing bid's reservation was released.
    assert sum(core.ledger.held_totals()[0] for core in net.cores.values()) == len(jobs)


def test_p7_jobs_of_two_slot_windows_are_placed_by_two_slot_instances():
    net = Net(genesis=SLOT_GENESIS)
    first, first_envelope = slot_job(1, created_ms=0)
    second, second_envelope = slot_job(2, created_ms=SLOT_MS + 10)
    net.submit(KEYS[0], first_envelope)
    net.submit(KEYS[1], second_envelope)
    net.run(300)
    for key in KEYS:
        decided = {d.instance: placed_jobs(d.value) for d in net.certified(key, "placement_slot")}
        assert decided == {placement_slot_id(0, 0): [job_id(first)], placement_slot_id(0, 1): [job_id(second)]}


def late_job_net():
    """Job 1's slot is decided before job 2, created in the same window, reaches anyone."""
    net = Net(genesis=SLOT_GENESIS)
    early, early_envelope = slot_job(1, created_ms=0)
    late, late_envelope = slot_job(2, created_ms=20)
    net.submit(KEYS[0], early_envelope)
    net.run(200)
    assert all(len(net.certified(key, "placement_slot")) == 1 for key in KEYS)
    net.submit(KEYS[1], late_envelope)
    net.run(400)
    return net, early, late


def test_p7c_a_job_that_arrives_after_its_slot_was_decided_is_placed_by_its_own_instance():
    net, early, late = late_job_net()
    for key in KEYS:
        own = net.certified(key, "placement")
        assert [d.instance for d in own] == [job_id(late)]  # attempt 0's own instance: the job id
        assert job_id(decode_message(own[0].value.job, SLOT_MESH)[1]) == job_id(late)
        view = net.cores[key].job_view(job_id(late))
        assert (view["state"], view["fence"], view["instance"]) == ("placed", 1, job_id(late))
        assert placed_jobs(net.certified(key, "placement_slot")[0].value) == [job_id(early)]


def test_p7c_its_own_instance_needs_the_certificate_of_a_slot_that_left_it_out():
    net, early, late = late_job_net()
    core = net.cores[KEYS[2]]
    slot_certificate = net.certified(KEYS[2], "placement_slot")[0].certificate
    late_envelope = core.job_table.records[job_id(late)].envelope
    value = codec.pack(Placement(job=late_envelope, primary=KEYS[0], backups=(), gpus=(0,)).to_body())
    validate = core.placement._validator(job_id(late))
    assert "needs the slot's commit certificate" in validate(value, ())
    assert "needs the slot's commit certificate" in validate(value, (slot_certificate, slot_certificate))
    # With the certificate the slot rule holds; what is left is P4b's (no bids, no placement).
    assert validate(value, (slot_certificate,)) == "placement does not follow from its bids"
    # The job the slot did place can never be placed again by its own instance.
    early_envelope = core.job_table.records[job_id(early)].envelope
    early_value = codec.pack(Placement(job=early_envelope, primary=KEYS[0], backups=(), gpus=(0,)).to_body())
    assert core.placement._validator(job_id(early))(early_value, (slot_certificate,)) == "the job's slot placed it"


def test_p7b_a_validator_refuses_slot_values_that_break_the_binding():
    core = Net(genesis=SLOT_GENESIS).cores[KEYS[0]]
    job_a, envelope_a = slot_job(1, created_ms=0)
    job_b, envelope_b = slot_job(2, created_ms=SLOT_MS + 20)  # slot 1
    validate = core.slots._validator(placement_slot_id(0, 0))

    def placement(envelope):
        return Placement(job=envelope, primary=KEYS[1], backups=(), gpus=(0,))

    def check(epoch, slot, *placements, justification=()):
        value = PlacementSlot(epoch=epoch, slot=slot, placements=tuple(placements))
        return validate(codec.pack(value.to_body()), justification)

    assert "is not one of this slot's" in check(0, 0, placement(envelope_a), placement(envelope_b))
    assert "is placed twice" in check(0, 0, placement(envelope_a), placement(envelope_a))
    assert "instance is not the slot" in check(0, 1, placement(envelope_b))
    assert "instance is not the slot" in check(1, 0, placement(envelope_a))
    assert "does not follow from its bids" in check(0, 0, placement(envelope_a))
    record_b = JobRecord(job_id(job_b), envelope_b, job_b, 0)
    kind, bid_b = core.bidding.make_bid_or_decline(job_id(job_b), 0, record_b, 0)
    assert kind == "bid"
    assert check(0, 0, placement(envelope_a), justification=(bid_b,)) == "a bid for a job the slot does not place"
    empty = codec.pack({"epoch": 0, "slot": 0, "placements": []})
    assert "invalid slot proposal" in validate(empty, ())


def test_p7_a_mesh_without_slots_refuses_every_slot_value():
    plain = Net().cores[KEYS[0]]
    _job, envelope = make_job(nonce=1)
    value = PlacementSlot(epoch=0, slot=0, placements=(Placement(job=envelope, primary=KEYS[1], backups=(),
                                                                 gpus=(0,)),))
    problem = plain.slots._validator(placement_slot_id(0, 0))(codec.pack(value.to_body()), ())
    assert problem == "this mesh does not place jobs in slots"


def test_p7_with_bid_sampling_the_job_goes_to_the_sample_and_the_leader_only():
    net = Net(genesis=SLOT_GENESIS, bid_sample=1)
    _job, envelope = slot_job(1, created_ms=0)
    entry = net.cores[KEYS[0]]
    ready = entry.submit(envelope, 0)
    job_sends = [m.to for m in ready.messages if m.data == envelope]
    assert None not in job_sends  # no broadcast
    inst = entry.instances[placement_slot_id(0, 0)]
    sampled = {k for k in KEYS if k != KEYS[0] and entry.bidding.sampled(job_id(_job), 0, len(KEYS), k)}
    assert set(job_sends) == (sampled | {inst.leader}) - {KEYS[0]}
    net.emit(KEYS[0], ready)
    net.run(400)
    assert all(len(net.certified(key, "placement_slot")) == 1 for key in KEYS)  # the others learn it from the slot


def round0_sample(jid: bytes, sample: int = 1) -> set:
    """SPEC P3's sampling rule for round 0 with ``bid_sample = sample`` among the 4 members."""
    return {k for k in KEYS if int.from_bytes(hashlib.sha256(b"bidder" + jid + k).digest()[:8], "big") * 4
            < sample << 64}


def test_p7c_a_job_its_slot_left_out_for_want_of_an_eligible_bid_is_placed_by_its_own_instance():
    # Only node 3 has 4 GPUs (the small job needs none). The 4-GPU job's round-0 sample leaves node 3 out, so the slot
    # (round 0) places only the small job; the big one goes on in its own instance, whose
    # later rounds widen the sample to node 3.
    small, small_envelope = next(
        (j, e) for j, e in (slot_job(n, created_ms=0, gpus=0) for n in range(100, 300)) if round0_sample(job_id(j)))
    big, big_envelope = next(
        (j, e) for j, e in (slot_job(n, created_ms=10, gpus=4, backups=0) for n in range(2, 200))
        if round0_sample(job_id(j)) and KEYS[3] not in round0_sample(job_id(j)))
    net = Net(gpus=(2, 2, 2, 4), genesis=SLOT_GENESIS, bid_sample=1)
    net.submit(KEYS[0], small_envelope)
    net.submit(KEYS[1], big_envelope)
    net.run(3000)
    for key in KEYS:
        assert [placed_jobs(d.value) for d in net.certified(key, "placement_slot")] == [[job_id(small)]]
        own = net.certified(key, "placement")
        assert [(d.instance, d.value.primary) for d in own] == [(job_id(big), KEYS[3])]


def test_p7c_a_proposal_of_a_slot_jobs_own_instance_without_the_certificate_starts_nothing():
    """Anyone may send a proposal; for a job still in its slot, only one carrying the slot's
    certificate (that leaves the job out) starts the job's own instance beside it."""
    net = Net(genesis=SLOT_GENESIS)
    job, envelope = slot_job(1, created_ms=0)
    net.submit(KEYS[0], envelope)  # not run: the slot is still gathering bids
    core = net.cores[KEYS[0]]
    value = codec.pack(Placement(job=envelope, primary=KEYS[1], backups=(), gpus=(0,)).to_body())
    forged = encode_message(IDS[3], SLOT_MESH, Proposal(job_id(job), 0, 0, "placement", value, (), None, None))
    core.step(forged, 0, KEYS[3])
    assert job_id(job) not in core.instances
    assert core.counters["late_placement_without_slot_certificate"] == 1
    assert core.job_view(job_id(job))["instance"] == placement_slot_id(0, 0)


def test_p7_cancelling_a_job_waiting_for_its_slot_releases_every_bid_reservation():
    net = Net(genesis=SLOT_GENESIS)
    job, envelope = slot_job(1, created_ms=0)
    net.submit(KEYS[0], envelope)
    net.deliver()  # every member bid (P7a): each holds a GPU for the job
    assert all(core.ledger.held_totals()[0] == 1 for core in net.cores.values())
    _jid, ready = net.cores[KEYS[0]].cancel(encode_message(OWNER, SLOT_MESH, Cancel(job_id=job_id(job),
                                                                                     requested_ms=1)), net.now)
    net.emit(KEYS[0], ready)
    net.deliver()
    assert all(core.ledger.held_totals() == (0, 0, 0) for core in net.cores.values())


def test_p7b_a_slot_value_stays_within_its_byte_budget_and_the_rest_go_on_alone():
    """Jobs near the 64 KiB manifest limit: the slot takes what fits its value budget (so a
    round change or a left-out job's proposal, which carry it, still fit a frame)."""
    net = Net(gpus=(5, 5, 5, 5), genesis=SLOT_GENESIS)
    big_args = tuple("x" * 1000 for _ in range(60))
    jobs = []
    for nonce in range(1, 17):  # 16 x 60 KB: more than a 4-member slot's value budget
        job = dataclasses.replace(slot_job(nonce, created_ms=nonce)[0], args=big_args)
        jobs.append((job, encode_message(OWNER, SLOT_MESH, job)))
        net.submit(KEYS[nonce % 4], jobs[-1][1])
    net.run(600)
    for key in KEYS:
        [slot] = net.certified(key, "placement_slot")
        assert len(codec.pack(slot.value.to_body())) <= slot_budgets(len(KEYS))[0]
        assert 0 < len(slot.value.placements) < len(jobs)
        placed = set(placed_jobs(slot.value)) | {d.instance for d in net.certified(key, "placement")}
        assert placed == {job_id(job) for job, _ in jobs}


def test_p7_a_slot_certificate_verifies_offline_with_meshnode_cert_verify(tmp_path, capsys):
    net = Net(genesis=SLOT_GENESIS)
    for nonce in (1, 2):
        net.submit(KEYS[nonce], slot_job(nonce, created_ms=nonce)[1])
    net.run(200)
    [slot] = net.certified(KEYS[0], "placement_slot")
    (tmp_path / "genesis.bin").write_bytes(SLOT_GENESIS.encode())
    (tmp_path / "slot.cert").write_bytes(slot.certificate)
    assert main(["cert", "verify", str(tmp_path / "slot.cert"), "--genesis", str(tmp_path / "genesis.bin"),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["valid"] and result["value_kind"] == "placement_slot"
    assert result["instance"] == placement_slot_id(0, 0).hex()
