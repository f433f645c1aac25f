"""Adaptive failure detector (SPEC.md section 9.1): hiccups never suspect, crashes always do."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.failure_detector import FailureDetector

PEER = b"p" * 32


def feed(detector, intervals, start=0):
    now = start
    detector.track(PEER, now)
    for interval in intervals:
        now += interval
        detector.heartbeat(PEER, now)
    return now


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=0, max_size=80), st.integers(0, 1000),
       st.integers(60, 250))
def test_never_before_min_silence_always_a_heartbeat_before_the_bound(intervals, silence, min_silence):
    detector = FailureDetector(heartbeat_ms=50, detection_bound_ms=300, min_silence_ms=min_silence)
    last = feed(detector, intervals)
    suspected = detector.is_suspected(PEER, last + silence)
    assert [p for p, _ in detector.suspects(last + silence)] == ([PEER] if suspected else [])
    if silence < min_silence:
        assert not suspected
    if silence >= 300 - 50:  # one heartbeat period is left for the tick, delivery and scheduling
        assert suspected


def test_adapts_to_jitter_within_the_clamps():
    calm = FailureDetector(heartbeat_ms=50, detection_bound_ms=300, min_silence_ms=100)
    feed(calm, [50] * 60)
    jittery = FailureDetector(heartbeat_ms=50, detection_bound_ms=300, min_silence_ms=100)
    rng = random.Random(7)
    feed(jittery, [rng.randint(10, 90) for _ in range(60)])
    assert calm.threshold_ms(PEER) == 50 + 5612 * (50 // 4) // 1000  # mean + z * sigma floor
    assert calm.threshold_ms(PEER) < jittery.threshold_ms(PEER) <= 300


def test_calm_threshold_is_mean_plus_z_sigma_floor():
    detector = FailureDetector(heartbeat_ms=40, detection_bound_ms=1000, min_silence_ms=10)
    feed(detector, [40] * 20)
    # sigma floors at heartbeat/4 = 10 ms: 40 + 5.612 * 10 = 96 ms
    assert detector.threshold_ms(PEER) == 96


def test_unknown_history_waits_for_the_upper_clamp():
    detector = FailureDetector(heartbeat_ms=50, detection_bound_ms=300, min_silence_ms=100)
    detector.track(PEER, 0)
    assert not detector.is_suspected(PEER, 249)
    assert detector.suspects(250) == [(PEER, 250)]


def test_default_threshold_is_a_heartbeat_short_of_the_bound_whatever_the_jitter():
    detector = FailureDetector(heartbeat_ms=50, detection_bound_ms=300)
    rng = random.Random(3)
    last = feed(detector, [rng.randint(1, 200) for _ in range(64)])
    assert detector.threshold_ms(PEER) == 250
    assert not detector.is_suspected(PEER, last + 249) and detector.is_suspected(PEER, last + 250)


def test_reordered_heartbeat_does_not_rewind_the_clock():
    detector = FailureDetector(heartbeat_ms=50, detection_bound_ms=300)
    last = feed(detector, [50] * 10)
    detector.heartbeat(PEER, last - 30)
    assert detector.silent_ms(PEER, last + 10) == 10


def test_forget_stops_suspicion_and_bad_config_is_refused():
    detector = FailureDetector(heartbeat_ms=50, detection_bound_ms=300)
    detector.track(PEER, 0)
    detector.forget(PEER)
    assert detector.suspects(10_000) == []
    with pytest.raises(ValueError):
        FailureDetector(heartbeat_ms=50, detection_bound_ms=300, min_silence_ms=251)
