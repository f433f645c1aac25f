"""The limits against hostile peers, sans-IO (SPEC.md 8 "Limits against hostile peers").

Plain numbers for the clock: every rule is checked at exact instants.
"""

from __future__ import annotations

from meshnode.net.limits import (
    InboundGate,
    KeyedRateLimiter,
    MemoryBudget,
    PeerLimits,
    RefusalReport,
    TokenBucket,
)

MEMBER, STRANGER, OTHER = b"m" * 32, b"s" * 32, b"o" * 32


def test_token_bucket_spends_its_burst_then_refills_at_its_rate():
    bucket = TokenBucket(rate_per_s=2.0, burst=3, now_s=100.0)
    assert [bucket.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(100.4)          # 0.8 of a token
    assert bucket.take(100.5)              # one token after 0.5 s
    assert not bucket.take(100.5)
    assert bucket.tokens(200.0) == 3.0     # never more than the burst


def test_keyed_limiter_keeps_keys_apart_and_its_table_bounded():
    limiter = KeyedRateLimiter(rate_per_s=1.0, burst=1, keys_max=3)
    assert limiter.allow("a", 0.0) and not limiter.allow("a", 0.0)
    assert limiter.allow("b", 0.0)
    for index in range(100):               # a key-cycling attacker
        limiter.allow("x%d" % index, 0.5)
    assert len(limiter) == 3
    # "a" was forgotten, not blocked for ever: a fresh bucket.
    assert limiter.allow("a", 0.5)


def test_handshakes_are_capped_per_address_and_in_total():
    gate = InboundGate(PeerLimits(handshakes_max=3, handshakes_per_address_max=2))
    assert gate.begin_handshake("10.0.0.1", 0.0) is None
    assert gate.begin_handshake("10.0.0.1", 0.0) is None
    assert gate.begin_handshake("10.0.0.1", 0.0) == "refused_address_handshakes"
    assert gate.begin_handshake("10.0.0.2", 0.0) is None
    assert gate.begin_handshake("10.0.0.3", 0.0) == "refused_handshakes_busy"
    gate.end_handshake("10.0.0.1")
    assert gate.handshakes_in_progress == 2
    assert gate.begin_handshake("10.0.0.3", 0.0) is None


def test_handshake_rate_per_address():
    gate = InboundGate(PeerLimits(handshake_rate_per_address_per_s=10.0, handshake_burst_per_address=5))
    outcomes = []
    for _ in range(6):
        outcomes.append(gate.begin_handshake("10.0.0.1", 0.0))
        gate.end_handshake("10.0.0.1") if outcomes[-1] is None else None
    assert outcomes == [None] * 5 + ["refused_address_rate"]
    assert gate.begin_handshake("10.0.0.2", 0.0) is None   # another address is not slowed
    assert gate.begin_handshake("10.0.0.1", 0.1) is None   # one token back after 100 ms


def test_handshake_rate_of_all_addresses_together():
    gate = InboundGate(PeerLimits(handshake_rate_per_s=10.0, handshake_burst=3))
    outcomes = []
    for index in range(4):                                # four addresses, one handshake each
        outcomes.append(gate.begin_handshake("10.0.0.%d" % index, 0.0))
    assert outcomes == [None, None, None, "refused_handshake_rate"]
    assert gate.begin_handshake("10.0.0.9", 0.1) is None


def test_members_pass_every_key_limit():
    gate = InboundGate(PeerLimits(nonmember_connections_max=1, nonmember_connect_burst_per_peer=1))
    full = {OTHER: 0.0}
    for _ in range(10):
        assert gate.admit_peer(MEMBER, True, full, 0.0) == (None, None)


def test_a_non_member_reconnecting_fast_is_refused():
    gate = InboundGate(PeerLimits(nonmember_connect_rate_per_peer_per_s=1.0, nonmember_connect_burst_per_peer=2))
    assert [gate.admit_peer(STRANGER, False, {}, 0.0)[0] for _ in range(3)] == [None, None, "refused_peer_rate"]
    assert gate.admit_peer(STRANGER, False, {}, 1.0) == (None, None)


def test_full_non_member_slots_go_to_the_idlest_only_when_it_is_idle_long_enough():
    gate = InboundGate(PeerLimits(nonmember_connections_max=2, nonmember_idle_evict_ms=5000))
    connected = {OTHER: 10.0, b"q" * 32: 12.0}
    assert gate.admit_peer(STRANGER, False, connected, 14.0) == ("refused_nonmembers_full", None)
    assert gate.admit_peer(STRANGER, False, connected, 15.0) == (None, OTHER)


def test_memory_budget_per_peer_and_shared_by_non_members():
    limits = PeerLimits(member_held_bytes_max=1000, nonmember_held_bytes_max=400, nonmember_held_bytes_total_max=700)
    budget = MemoryBudget(limits)
    assert budget.hold("s1", STRANGER, False, 400)
    assert not budget.hold("s2", STRANGER, False, 1)         # the peer's own limit
    assert budget.hold("o1", OTHER, False, 300)
    assert not budget.hold("x1", b"x" * 32, False, 1)        # the non-members' pool is full
    assert budget.hold("m1", MEMBER, True, 1000)              # members never wait for that pool
    assert not budget.hold("m2", MEMBER, True, 1)
    assert budget.held_bytes == 1700 and budget.nonmember_bytes == 700
    assert budget.hold("s1", STRANGER, False, 100)            # a holder shrinks
    assert budget.hold("x1", b"x" * 32, False, 300)
    for holder in ("s1", "o1", "x1", "m1", "m1"):
        budget.release(holder)
    assert budget.held_bytes == 0 and budget.held_by(MEMBER) == 0


def test_refused_hold_changes_nothing():
    budget = MemoryBudget(PeerLimits(nonmember_held_bytes_max=100, nonmember_held_bytes_total_max=100))
    assert budget.hold("s1", STRANGER, False, 60)
    assert not budget.hold("s1", STRANGER, False, 101)
    assert budget.held_by(STRANGER) == 60 and budget.nonmember_bytes == 60


def test_refusal_report_summarises_at_most_once_per_interval():
    report = RefusalReport(interval_ms=10_000, reasons=("bad_frame", "refused_peer_rate"))
    counters = {"bad_frame": 0, "frames_received": 50}
    assert report.poll(counters, 0) is None                     # nothing refused: nothing said
    counters["bad_frame"] = 3
    assert report.poll(counters, 1_000) == {"bad_frame": 3}     # the first refusal is told at once
    counters["bad_frame"], counters["refused_peer_rate"] = 10, 2
    assert report.poll(counters, 5_000) is None                 # then no more than one per interval
    assert report.poll(counters, 11_000) == {"bad_frame": 7, "refused_peer_rate": 2}
    assert report.poll(counters, 30_000) is None                # quiet again


def test_handshake_timeout_grows_with_the_handshakes_sharing_the_cpu():
    """SPEC.md 8.1: 3000 ms for each 4 handshakes in progress (itself included), at most
    10000 ms; a fixed 3000 ms failed members' handshakes in a 32-node start on 2 cores."""
    gate = InboundGate(PeerLimits(handshakes_per_address_max=64, handshake_burst_per_address=64))
    timeouts = []
    for i in range(13):
        assert gate.begin_handshake("10.0.0.1", 0.0) is None
        timeouts.append(gate.handshake_timeout_s())
    assert timeouts[:4] == [3.0] * 4 and timeouts[4:8] == [6.0] * 4 and timeouts[8:12] == [9.0] * 4
    assert timeouts[12] == 10.0
    for _ in range(13):
        gate.end_handshake("10.0.0.1")
    assert gate.handshake_timeout_s() == 3.0
