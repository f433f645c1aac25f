"""SPEC.md P1b: while a job with reflex rules runs at its primary, the primary reads its GPUs
every 100 ms and signs a vector at a threshold crossing and when a rule's evidence
completes, so a reflex acts within one reading of its duration, not at the 1 s refresh."""

import dataclasses

from protocol.capability import CAPABILITY_REFRESH_BUSY_MS, REFLEX_READING_MS
from protocol.flows.move import decode_request
from protocol.messages import CapabilityVector, decode_message
from tests.test_mesh_core import KEYS, MESH
from tests.test_reflex import HOT_UTIL, reflex_moves, rule, running_reflex_job

READING_MS = REFLEX_READING_MS


def read(net, key, util_milli):
    """``key`` reads its GPUs at ``util_milli``; every other node reads them idle."""
    for other, core in net.cores.items():
        gpus = tuple(dataclasses.replace(g, util_milli=util_milli if other == key else 0)
                     for g in core.capability._gpu_states())
        net.emit(other, core.update_telemetry(gpus, 0, net.now))


def own_seq(net, key):
    return net.cores[key].capability.vector.seq


def test_p1b_the_primary_reads_fast_only_while_a_reflex_job_runs_there():
    net, _jid, primary = running_reflex_job(rule(for_ms=300))
    assert net.cores[primary].capability.reading_period_ms(1000) == READING_MS
    assert all(net.cores[k].capability.reading_period_ms(1000) == 1000 for k in KEYS if k != primary)


def test_p1b_a_crossing_is_signed_at_once_drift_is_not_and_the_duration_completes_on_time():
    net, jid, primary = running_reflex_job(rule(for_ms=300, cooldown_ms=0))
    net.run(CAPABILITY_REFRESH_BUSY_MS)   # the refresh is not due during what follows
    read(net, primary, 10_000)
    before = own_seq(net, primary)
    read(net, primary, HOT_UTIL)          # crosses 80 %: a new vector now
    crossed_at, crossing = net.now, own_seq(net, primary)
    assert crossing == before + 1
    for util in (HOT_UTIL + 1000, HOT_UTIL - 2000):   # drift above the threshold: nothing signed
        net.run(READING_MS)
        read(net, primary, util)
        assert own_seq(net, primary) == crossing
    net.run(300 - 2 * READING_MS)
    read(net, primary, HOT_UTIL)          # the rule's 300 ms are complete: the vector that proves it
    completing = net.cores[primary].capability.vector
    assert completing.seq == crossing + 1 and completing.taken_ms - crossed_at == 300
    net.run(60)
    moves = reflex_moves(net, KEYS[1])
    assert len(moves) == 1 and moves[0].value.from_node == primary
    evidence = decode_request(moves[0].value.request, MESH)[1].evidence   # the crossing and the completing vector
    assert [decode_message(e, MESH, expect=CapabilityVector)[1].seq for e in evidence] == [crossing, crossing + 1]


def test_p1b_a_steady_condition_without_fast_vectors_waits_for_the_refresh():
    """The check of the test above fails without P1b's completing vector: only the refresh
    (1 s after the crossing) would prove a 300 ms rule."""
    net, jid, primary = running_reflex_job(rule(for_ms=300, cooldown_ms=0))
    net.run(CAPABILITY_REFRESH_BUSY_MS)
    read(net, primary, 10_000)
    read(net, primary, HOT_UTIL)
    for _ in range(300 // READING_MS + 1):
        net.run(READING_MS)
        read(net, primary, HOT_UTIL)
        if reflex_moves(net, KEYS[1]):
            break
    net.run(60)
    assert reflex_moves(net, KEYS[1]), "no reflex move within the rule's duration + one reading + the vote"


def test_p1b_a_condition_broken_between_vectors_is_signed_so_the_evidence_restarts():
    net, jid, primary = running_reflex_job(rule(for_ms=300, cooldown_ms=0))
    net.run(CAPABILITY_REFRESH_BUSY_MS)
    read(net, primary, 10_000)
    read(net, primary, HOT_UTIL)
    net.run(READING_MS)
    seq = own_seq(net, primary)
    read(net, primary, 10_000)            # one cool reading: a crossing, signed
    assert own_seq(net, primary) == seq + 1
    read(net, primary, HOT_UTIL)
    for _ in range(2):
        net.run(READING_MS)
        read(net, primary, HOT_UTIL)
    net.run(60)
    assert not reflex_moves(net, KEYS[1])   # 300 ms since the first crossing, but not unbroken


def test_p1b_while_a_condition_holds_a_vector_goes_out_every_duration():
    """A member that missed a vector of the chain gets a new one a duration later (not at
    the 1 s refresh): while the rule holds, the primary signs a vector each for_ms."""
    net, jid, primary = running_reflex_job(rule(for_ms=300, cooldown_ms=60_000))
    for core in net.cores.values():
        core.moves.notice_reflexes = lambda *args: None   # nobody acts: the job stays hot here
    net.run(CAPABILITY_REFRESH_BUSY_MS)
    read(net, primary, 10_000)
    read(net, primary, HOT_UTIL)
    signed = [(net.now, own_seq(net, primary))]
    for _ in range(900 // READING_MS):
        net.run(READING_MS)
        read(net, primary, HOT_UTIL)
        if own_seq(net, primary) != signed[-1][1]:
            signed.append((net.now, own_seq(net, primary)))
    assert [at - signed[0][0] for at, _seq in signed] == [0, 300, 600, 900]
