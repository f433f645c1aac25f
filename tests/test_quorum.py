"""EpochView: quorum thresholds and stake-weighted leaders (SPEC.md 6.1, 6.2)."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from consensus_net import identities
from keys.genesis import DEFAULT_PARAMS, Genesis
from protocol.messages import Member
from protocol.quorum import EpochView

KEYS = [i.public_key for i in identities(8)]


def view_of(*stakes: int) -> EpochView:
    return EpochView(3, dict(zip(KEYS, stakes)))


def test_6_1_exactly_two_thirds_is_not_a_quorum_and_one_more_unit_is():
    view = view_of(1, 1, 1, 1, 1, 1)          # total 6: 4 is exactly 2/3
    assert not view.has_quorum(KEYS[:4])
    assert view.has_quorum(KEYS[:5])
    view = view_of(200, 100, 1)               # total 301: 200 < 2/3, 201 > 2/3
    assert not view.has_quorum([KEYS[0]])
    assert view.has_quorum([KEYS[0], KEYS[2]])


def test_6_1_each_signer_counts_once_and_non_members_count_nothing():
    view = view_of(1, 1, 1, 1)
    assert not view.has_quorum([KEYS[0], KEYS[0], KEYS[0], KEYS[1]])
    assert not view.has_quorum(KEYS[:2] + KEYS[5:8])   # keys 5..7 are not members
    assert view.stake_of(KEYS) == 4


def test_6_1_more_than_one_third_needs_an_honest_signer():
    view = view_of(1, 1, 1, 1, 1, 1)          # a Byzantine coalition below 1/3 holds at most 1
    assert not view.exceeds_one_third(KEYS[:2])   # exactly 1/3
    assert view.exceeds_one_third(KEYS[:3])


def _spec_leader(view, instance: bytes, round: int) -> bytes:
    """SPEC.md 6.2 written out: each round draws over the members other than the last leader."""
    previous = None
    for r in range(round + 1):
        candidates = [key for key in sorted(view.stakes) if key != previous or len(view.stakes) == 1]
        x = int.from_bytes(hashlib.sha256(b"meshnode/v1/leader\x00" + instance + r.to_bytes(8, "big")).digest(),
                           "big") % sum(view.stakes[key] for key in candidates)
        cumulative = 0
        for key in candidates:
            cumulative += view.stakes[key]
            if cumulative > x:
                break
        previous = key
    return previous


def test_6_2_leader_matches_the_normative_formula():
    view = view_of(5, 1, 3, 2)
    for round in range(50):
        instance = hashlib.sha256(b"job %d" % round).digest()
        assert view.leader(instance, round) == _spec_leader(view, instance, round)
    instance = hashlib.sha256(b"one instance").digest()
    for round in reversed(range(40)):  # later rounds first: the cache must not depend on call order
        assert view.leader(instance, round) == _spec_leader(view, instance, round)


def test_6_2_no_member_leads_two_rounds_in_a_row():
    view = view_of(100, 1, 1, 1)   # one member holds almost all the stake
    for i in range(200):
        instance = hashlib.sha256(b"%d" % i).digest()
        leaders = [view.leader(instance, r) for r in range(12)]
        assert all(a != b for a, b in zip(leaders, leaders[1:]))
    single = EpochView(0, {KEYS[0]: 5})
    assert [single.leader(bytes(32), r) for r in range(3)] == [KEYS[0]] * 3


def test_6_2_leaders_are_chosen_in_proportion_to_stake():
    """Round 0 exactly; a later round in proportion among the members other than the last leader."""
    stakes = (1, 2, 3, 4)
    view = view_of(*stakes)
    trials = 20_000
    counts = Counter(view.leader(hashlib.sha256(b"%d" % i).digest(), 0) for i in range(trials))
    for key, stake in zip(KEYS, stakes):
        assert abs(counts[key] / trials - stake / 10) < 0.015
    after = Counter()
    for i in range(trials):
        instance = hashlib.sha256(b"%d" % i).digest()
        if view.leader(instance, 0) == KEYS[3]:
            after[view.leader(instance, 1)] += 1
    for key, stake in zip(KEYS[:3], stakes[:3]):
        assert abs(after[key] / sum(after.values()) - stake / 6) < 0.03


def test_from_genesis_takes_the_members_stakes():
    members = tuple(Member(k, s, "zone-a", (), ()) for k, s in zip(KEYS[:3], (1, 2, 3)))
    genesis = Genesis("test", 0, members, DEFAULT_PARAMS, ())
    view = EpochView.from_genesis(genesis)
    assert view.epoch == 0 and view.total_stake == 6 and dict(view.stakes) == {m.public_key: m.stake for m in members}


def test_a_view_rejects_empty_or_non_positive_stake():
    with pytest.raises(ValueError):
        EpochView(0, {})
    with pytest.raises(ValueError):
        EpochView(0, {KEYS[0]: 0})


def test_6_2_spec_test_vector():
    view = EpochView(0, {bytes([i]) * 32: i + 1 for i in range(4)})
    assert [view.leader(bytes(32), r) for r in range(6)] == [bytes([k]) * 32 for k in (3, 2, 3, 1, 2, 3)]


def test_6_2_the_leader_cache_is_bounded_and_never_changes_an_answer():
    from protocol.quorum import LEADER_CACHE_INSTANCES
    view = view_of(5, 1, 3, 2)
    first = hashlib.sha256(b"first").digest()
    expected = [view.leader(first, r) for r in range(6)]
    for i in range(LEADER_CACHE_INSTANCES + 10):   # push ``first`` out of the cache
        view.leader(hashlib.sha256(b"%d" % i).digest(), 1)
    assert len(view._leader_cache) <= LEADER_CACHE_INSTANCES
    assert [view.leader(first, r) for r in reversed(range(6))] == expected[::-1]
