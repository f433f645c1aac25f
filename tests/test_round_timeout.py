"""SPEC.md 6.12: a placement round's timeout follows the node's measured decision time."""

from __future__ import annotations

from test_mesh_core import KEYS, Net, make_job

from keys.genesis import DEFAULT_PARAMS
from protocol.instances import DecisionTimes
from protocol.messages import job_id

GENESIS_TIMEOUT_MS = DEFAULT_PARAMS.round_timeout_ms


def test_no_decision_measured_keeps_the_genesis_timeout():
    assert DecisionTimes().round_timeout_ms(200) == 200


def test_the_timeout_is_four_times_the_90th_percentile_within_one_to_two_genesis_timeouts():
    times = DecisionTimes()
    for elapsed in [10] * 9 + [70]:       # nearest-rank p90 of ten samples is the 9th: 10 ms
        times.add(elapsed)
    assert times.round_timeout_ms(200) == 200        # 40 ms: never under the genesis timeout
    times.add(70)                                    # eleven samples: p90 is the 10th, 70 ms
    assert times.round_timeout_ms(200) == 280
    for _ in range(32):                              # only the newest 32 samples count
        times.add(5_000)
    assert times.round_timeout_ms(200) == 400        # at most two genesis timeouts


def place_slowly(net: Net, nonce: int, hop_ms: int) -> bytes:
    """Submit a job and deliver the network one wave of messages per ``hop_ms``."""
    job, envelope = make_job(nonce=nonce, gpus=0)
    net.submit(KEYS[nonce % 4], envelope)
    for _ in range(40):
        for _ in range(len(net.queue)):
            src, target, data = net.queue.popleft()
            net.emit(target, net.cores[target].step(data, net.now, src))
        net.now += hop_ms
        for core in net.cores.values():
            net.emit(next(k for k, c in net.cores.items() if c is core), core.tick(net.now))
    return job_id(job)


def test_placements_that_take_long_lengthen_the_next_placements_round_timeout():
    net = Net()
    for nonce in range(3):
        jid = place_slowly(net, nonce, hop_ms=30)
        assert all(net.cores[k].job_view(jid)["state"] == "placed" for k in KEYS)
    table = net.cores[KEYS[0]].instance_table
    measured = sorted(table.decision_times.samples)
    # job, bid, proposal, prevote, precommit: 5 waves of 30 ms from the submit at the entry
    # node, fewer where a node starts the instance when the job reaches it.
    assert len(measured) == 3 and 90 <= measured[-1] <= 150
    adapted = table.decision_times.round_timeout_ms(GENESIS_TIMEOUT_MS)
    assert adapted == min(max(GENESIS_TIMEOUT_MS, 4 * measured[-1]), 2 * GENESIS_TIMEOUT_MS)
    job, envelope = make_job(nonce=99, gpus=0)
    net.submit(KEYS[0], envelope)
    instance = table.instances[job_id(job)]
    assert instance.round_timeout_ms == adapted > GENESIS_TIMEOUT_MS


def test_only_placements_adapt_an_eviction_keeps_the_genesis_timeout():
    # An eviction's round 0 may be led by the dead node: its timeout is the failover path.
    flows = Net().cores[KEYS[0]].flows
    assert flows.get("placement").adapts_round_timeout
    for kind in ("eviction", "membership", "placement_slot", "preemption"):
        flow = flows.get(kind)
        assert flow is not None and not flow.adapts_round_timeout, kind
