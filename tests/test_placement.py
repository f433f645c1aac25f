"""Placement scoring and local reservations (SPEC.md 7: P3, P4, P4b, R1)."""

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keys.identity import SigningIdentity
from protocol.caches import CoreCaches
from protocol.errors import RemoteProtocolError
from protocol.messages import (Attestation, Bid, CapabilityVector, Constraints, GpuState, JobManifest, Resources,
                               encode_message, job_id)
from protocol.placement import (BidFacts, attested_attributes, choose_placement, eligibility, parse_bid,
                                select_justification, tie_break)
from protocol.policy import NodePolicy
from protocol.ledger import ResourceLedger

MESH = hashlib.sha256(b"test mesh").digest()
AUTHORITY = SigningIdentity(hashlib.sha256(b"authority").digest())


def ident(i):
    return SigningIdentity(hashlib.sha256(b"node%d" % i).digest())


def gpu(index, total=80_000, used=0):
    return GpuState(index=index, model="sim", mem_total_mib=total, mem_used_mib=used, util_milli=0,
                    temp_milli_c=40_000, sm_clock_mhz=1500, throttle_reasons=0, ecc_errors=0, power_mw=100_000)


def cap(node, zone="zone-a", gpus=2, free=None, cpu=8000, mem=32768, labels=(), used=0):
    free = tuple(range(gpus)) if free is None else free
    return CapabilityVector(node=node, epoch=0, seq=1, taken_ms=1000, zone=zone, rail_group="",
                            gpus=tuple(gpu(i, used=used) for i in range(gpus)), gpus_free=free,
                            cpu_milli_free=cpu, mem_mib_free=mem, labels=labels, simulated=True, running=())


def job(strategy="throughput", gpus=1, gpu_mem=1000, zones=(), labels=(), attested=(), backups=1, nonce=0):
    return JobManifest(owner=ident(99).public_key, name="j", nonce=nonce, entrypoint="counter", args=(),
                       resources=Resources(gpus=gpus, gpu_mem_mib=gpu_mem, cpu_milli=1000, mem_mib=1024),
                       strategy=strategy, constraints=Constraints(zones=zones, labels=labels, attested=attested),
                       priority=0, backups=backups, max_retries=0, created_ms=0, epoch=0)


def facts(i, manifest, rtt=1000, attested=(), **cap_kwargs):
    key = ident(i).public_key
    capability = cap(key, **cap_kwargs)
    envelope = encode_message(ident(i), MESH, capability)
    bid = Bid(instance=job_id(manifest), epoch=0, capability=envelope,
              reserved_gpus=tuple(range(manifest.resources.gpus)), rtt_us=rtt, attestations=())
    return BidFacts(key, bid, capability, tuple(sorted(attested)))


def place(manifest, bids):
    return choose_placement(b"job-envelope", manifest, job_id(manifest), bids)


def test_latency_strategy_picks_lowest_rtt_and_is_order_independent():
    m = job("latency")
    bids = [facts(i, m, rtt=rtt) for i, rtt in enumerate([900, 300, 700, 500])]
    expected = place(m, bids)
    assert expected.primary == ident(1).public_key
    for seed in range(5):
        shuffled = bids[:]
        random.Random(seed).shuffle(shuffled)
        assert place(m, shuffled) == expected


def test_throughput_strategy_prefers_free_gpus_then_gpu_memory_then_cpu():
    m = job("throughput")
    bids = [facts(0, m, gpus=2), facts(1, m, gpus=4), facts(2, m, gpus=4, used=1000), facts(3, m, gpus=4, cpu=4000)]
    assert place(m, bids).primary == ident(1).public_key
    assert place(m, [bids[2], bids[3]]).primary == ident(3).public_key  # more GPU memory beats more CPU


def test_sovereign_strategy_only_places_on_attested_nodes():
    m = job("sovereign", zones=("eu",), attested=(("jurisdiction", "eu"),))
    self_declared = facts(0, m, zone="eu", gpus=8)
    attested = facts(1, m, zone="eu", gpus=1, attested=(("jurisdiction", "eu"), ("zone", "eu")))
    zone_not_attested = facts(2, m, zone="eu", gpus=8, attested=(("jurisdiction", "eu"),))
    chosen = place(m, [self_declared, attested, zone_not_attested])
    assert chosen.primary == ident(1).public_key and chosen.backups == ()
    assert place(m, [self_declared, zone_not_attested]) is None


def test_backups_are_other_nodes_preferring_another_zone():
    m = job("latency", backups=2)
    bids = [facts(0, m, rtt=100, zone="a"), facts(1, m, rtt=200, zone="a"), facts(2, m, rtt=300, zone="b"),
            facts(3, m, rtt=400, zone="a")]
    chosen = place(m, bids)
    assert chosen.primary == ident(0).public_key
    assert chosen.backups == (ident(2).public_key, ident(1).public_key)


def test_backup_count_is_what_the_owner_asked_or_fewer():
    bids_for = lambda m: [facts(i, m, rtt=i) for i in range(3)]
    assert place(job("latency", backups=0), bids_for(job("latency", backups=0))).backups == ()
    assert len(place(job("latency", backups=4), bids_for(job("latency", backups=4))).backups) == 2


def test_ties_break_by_hash_of_instance_and_node_key():
    for nonce in range(6):
        m = job("latency", nonce=nonce)
        bids = [facts(i, m, rtt=500) for i in range(4)]
        instance = job_id(m)
        best = min(bids, key=lambda f: tie_break(instance, f.signer))
        assert place(m, bids).primary == best.signer


def test_duplicate_signer_in_justification_is_rejected():
    m = job()
    with pytest.raises(RemoteProtocolError):
        place(m, [facts(0, m), facts(0, m)])


def test_bid_naming_gpus_that_are_not_free_is_ignored():
    m = job()
    good = facts(1, m, gpus=1)
    lying = facts(0, m, gpus=4, free=(2, 3))  # reserved_gpus=(0,) but GPU 0 is not free
    assert place(m, [lying, good]).primary == good.signer


def test_select_justification_keeps_the_winner():
    m = job("latency")
    bids = [facts(i, m, rtt=1000 - i) for i in range(40)]
    kept = select_justification(m, job_id(m), bids)
    assert len(kept) == 32
    assert place(m, kept) == place(m, bids)


@pytest.mark.parametrize("manifest_kwargs, cap_kwargs, policy, reason", [
    ({}, {}, NodePolicy(allowed_owners=frozenset()), "owner_not_allowed"),
    ({}, {}, NodePolicy(allowed_entrypoints=frozenset({"train"})), "entrypoint_not_allowed"),
    ({"gpus": 3}, {"gpus": 2}, NodePolicy(), "not_enough_gpus"),
    ({"gpu_mem": 90_000}, {}, NodePolicy(), "not_enough_gpu_memory"),
    ({}, {"cpu": 10}, NodePolicy(), "not_enough_cpu"),
    ({}, {"mem": 10}, NodePolicy(), "not_enough_memory"),
    ({"zones": ("eu",)}, {}, NodePolicy(), "zone_not_allowed"),
    ({"labels": (("fast", "yes"),)}, {}, NodePolicy(), "labels_missing"),
    ({"attested": (("tier", "3"),)}, {}, NodePolicy(), "attestation_missing"),
])
def test_eligibility_decline_reasons(manifest_kwargs, cap_kwargs, policy, reason):
    ok, got, detail = eligibility(job(**manifest_kwargs), cap(ident(0).public_key, **cap_kwargs), policy, {})
    assert (ok, got) == (False, reason) and detail
    assert eligibility(job(), cap(ident(0).public_key), NodePolicy(), {}) == (True, None, "")


def test_parse_bid_verifies_signatures_and_attestations():
    m = job(attested=(("tier", "3"),))
    node = ident(0)
    capability_env = encode_message(node, MESH, cap(node.public_key))
    good_att = encode_message(AUTHORITY, MESH, Attestation(subject=node.public_key, attributes=(("tier", "3"),),
                                                           stake=0, issued_ms=0, expires_ms=5000))
    expired = encode_message(AUTHORITY, MESH, Attestation(subject=node.public_key, attributes=(("x", "1"),),
                                                          stake=0, issued_ms=0, expires_ms=1000))
    self_signed = encode_message(node, MESH, Attestation(subject=node.public_key, attributes=(("y", "1"),),
                                                         stake=0, issued_ms=0, expires_ms=5000))
    bid = Bid(instance=job_id(m), epoch=0, capability=capability_env, reserved_gpus=(0,), rtt_us=5,
              attestations=(good_att, expired, self_signed))
    members = {node.public_key: 1}
    parsed = parse_bid(encode_message(node, MESH, bid), MESH, job_id(m), 0, members, [AUTHORITY.public_key])
    assert parsed.attested == (("tier", "3"),)
    assert place(m, [parsed]).primary == node.public_key
    # Another node's capability vector inside my bid is refused.
    other_cap = encode_message(ident(1), MESH, cap(ident(1).public_key))
    stolen = Bid(instance=job_id(m), epoch=0, capability=other_cap, reserved_gpus=(0,), rtt_us=5, attestations=())
    with pytest.raises(RemoteProtocolError):
        parse_bid(encode_message(node, MESH, stolen), MESH, job_id(m), 0, members, [])
    with pytest.raises(RemoteProtocolError):  # not a member
        parse_bid(encode_message(node, MESH, bid), MESH, job_id(m), 0, {}, [])
    with pytest.raises(RemoteProtocolError):  # wrong epoch
        parse_bid(encode_message(node, MESH, bid), MESH, job_id(m), 1, members, [])
    assert attested_attributes([good_att], node.public_key, MESH, [AUTHORITY.public_key], 5000) == ()


def test_remembered_bid_checks_still_apply_membership_and_authorities():
    """parse_bid remembers verified bids by bytes; the caller's member set and trusted
    authorities must still decide, call by call, and choose_placement's memo must follow
    its inputs."""
    m = job()
    node = ident(0)
    att = encode_message(AUTHORITY, MESH, Attestation(subject=node.public_key, attributes=(("tier", "3"),),
                                                      stake=0, issued_ms=0, expires_ms=5000))
    data = encode_message(node, MESH, Bid(instance=job_id(m), epoch=0, reserved_gpus=(0,), rtt_us=5,
                                          capability=encode_message(node, MESH, cap(node.public_key)),
                                          attestations=(att,)))
    members = {node.public_key: 1}
    caches = CoreCaches()
    first = parse_bid(data, MESH, job_id(m), 0, members, [AUTHORITY.public_key], caches=caches)
    assert parse_bid(data, MESH, job_id(m), 0, members, [AUTHORITY.public_key], caches=caches) is first
    assert parse_bid(data, MESH, job_id(m), 0, members, [AUTHORITY.public_key]) is not first  # no caches: no memo
    assert first.attested == (("tier", "3"),)
    assert parse_bid(data, MESH, job_id(m), 0, members, [], caches=caches).attested == ()
    with pytest.raises(RemoteProtocolError):
        parse_bid(data, MESH, job_id(m), 0, {}, [AUTHORITY.public_key], caches=caches)
    envelope = encode_message(ident(99), MESH, m)
    assert choose_placement(envelope, m, job_id(m), [first], caches=caches).primary == node.public_key
    assert choose_placement(envelope, m, job_id(m), [], caches=caches) is None
    unfit = job(gpus=3)  # same bids, another job: the memo must not answer for it
    assert choose_placement(envelope, unfit, job_id(m), [first], caches=caches) is None


# --- reservations (SPEC.md R1) ----------------------------------------------------------------

def res(gpus=0, gpu_mem=0, cpu=0, mem=0):
    return Resources(gpus=gpus, gpu_mem_mib=gpu_mem, cpu_milli=cpu, mem_mib=mem)


def test_reservation_lifecycle():
    book = ResourceLedger((1000, 2000), cpu_milli=4000, mem_mib=4096)
    claim = book.reserve(b"i1", res(1, 1500, 1000, 1024), expires_ms=100)
    assert claim.gpus == (1,)  # the only GPU with 1500 MiB
    assert book.reserve(b"i2", res(1, 1500), expires_ms=100) is None
    assert book.reserve(b"i1", res(1, 1500), expires_ms=100) == claim  # idempotent re-bid
    assert book.allocate(b"i1", b"job1").expires_ms is None
    assert book.expire(10_000) == []  # allocations never expire
    assert book.free(b"job1") and book.free_gpus() == (0, 1)
    book.reserve(b"i3", res(2), expires_ms=50)
    assert book.expire(49) == [] and book.expire(50) == [b"i3"]
    assert book.held_totals() == (0, 0, 0)


def test_a_live_bid_never_expires_and_a_restored_one_only_until_its_instance_runs_again():
    """SPEC.md R1: a bid may be decided in any later round, so its reservation has no deadline;
    only one restored after a restart has one, until its bid is made or re-sent again."""
    book = ResourceLedger((1000,), cpu_milli=4000, mem_mib=4096)
    live = book.reserve(b"live", res(0, 0, 100, 100))
    assert live.expires_ms is None and book.expire(1 << 62) == []
    book.reserve(b"restored", res(1, 500, 100, 100), expires_ms=50, prefer=(0,))
    book.reserve(b"again", res(0, 0, 100, 100), expires_ms=50)
    assert book.reserve(b"restored", res(1, 500, 100, 100)).expires_ms is None   # bid again: held
    book.keep(b"again")
    assert book.expire(100) == [] and book.reserved(b"again").expires_ms is None
    book.reserve(b"orphan", res(0, 0, 100, 100), expires_ms=50)
    assert book.expire(100) == [b"orphan"]


def test_the_journal_lists_every_reservation_change_for_the_core_to_persist():
    book = ResourceLedger((1000, 1000), cpu_milli=4000, mem_mib=4096)
    first = book.reserve(b"i1", res(1, 500, 100, 100))
    second = book.reserve(b"i2", res(1, 500, 100, 100))
    book.allocate(b"i1", b"job1")
    book.release(b"i2")
    book.allocate_now(b"job3", res(0, 0, 100, 100))   # no reservation: nothing to persist
    assert book.take_journal() == [(b"i1", first), (b"i2", second), (b"i1", None), (b"i2", None)]
    assert book.take_journal() == []
    book.clear()
    assert book.held_totals() == (0, 0, 0) and book.allocated(b"job1") is None and not book.journal


ops = st.lists(st.tuples(st.sampled_from(["reserve", "release", "allocate", "allocate_now", "free", "expire"]),
                         st.integers(0, 7), st.integers(0, 3), st.integers(0, 3000), st.integers(0, 5000),
                         st.integers(0, 2000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_reserved_plus_allocated_never_exceeds_capacity(operations):
    mem_per_gpu = (1000, 2000, 3000)
    book = ResourceLedger(mem_per_gpu, cpu_milli=4000, mem_mib=4096)
    now = 0
    for op, key, gpus, gpu_mem, cpu, mem in operations:
        k = bytes([key])
        now += 10
        if op == "reserve":
            fresh = book.reserved(k) is None
            claim = book.reserve(k, res(gpus, gpu_mem, cpu, mem), expires_ms=now + cpu % 100)
            if claim is not None and fresh:
                assert all(mem_per_gpu[i] >= gpu_mem for i in claim.gpus)
        elif op == "release":
            book.release(k)
        elif op == "allocate":
            book.allocate(k, b"job" + k)
        elif op == "allocate_now":
            book.allocate_now(b"job" + k, res(gpus, gpu_mem, cpu, mem))
        elif op == "free":
            book.free(b"job" + k)
        else:
            book.expire(now)
        claims = [c for c in list(book._reserved.values()) + list(book._allocated.values())]
        held = [g for c in claims for g in c.gpus]
        assert len(held) == len(set(held)) <= len(mem_per_gpu)
        assert sum(c.cpu_milli for c in claims) == book.held_totals()[1] <= 4000
        assert sum(c.mem_mib for c in claims) == book.held_totals()[2] <= 4096
        assert set(held) == set(range(3)) - set(book.free_gpus())


def test_attempts_count_failures_and_refusals_apart():
    """SPEC.md P6, R1: a refusal places the job afresh without using up a retry, at most
    MAX_REFUSALS times (then it counts as a failure); every node reads both counts from the
    attempt, so from a placement's instance id alone."""
    from dataclasses import replace

    from protocol.messages import (MAX_REFUSALS, next_attempt, placement_attempt, placement_attempts,
                                   placement_instance_id)
    m = replace(job(), max_retries=2)
    span = 3
    assert [next_attempt(a, m, refused=False) for a in (0, 1, 2)] == [1, 2, None]   # two retries
    assert next_attempt(0, m, refused=True) == span                                 # no retry used
    assert next_attempt(span, m, refused=False) == span + 1 and next_attempt(span + 2, m, refused=False) is None
    last = span * MAX_REFUSALS
    assert next_attempt(last, m, refused=True) == last + 1        # refusals used up: counts as a failure
    assert next_attempt(last + 2, m, refused=True) is None
    assert placement_attempts(m) == span * (MAX_REFUSALS + 1)
    jid = job_id(m)
    assert all(placement_attempt(placement_instance_id(jid, a), m) == a for a in range(placement_attempts(m)))
    assert placement_attempt(placement_instance_id(jid, placement_attempts(m)), m) is None
