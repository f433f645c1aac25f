"""GPU health in placement (SPEC.md 7: P3 declines, P3a holds, P4 "GPU health" and scoring).

Pure tests of the health rule and the rank key, then cores on the in-order test network
(tests/test_mesh_core.py's Net): a hot node declines `node_unhealthy` and is not chosen,
and every core decides the same placement from the same signed vectors.
"""

import itertools

import pytest

from protocol.ledger import ResourceLedger
from protocol.messages import Bid, CapabilityVector, GpuState, encode_message, job_id
from protocol.placement import (UNHEALTHY_TEMP_MILLI_C, BidFacts, capability_check, choose_placement, gpu_health_faults,
                                gpu_healthy, gpu_strain, reservable_gpu_mem_mib, select_justification)
from tests.test_mesh_core import KEYS, Net, make_job
from tests.test_placement import MESH, ident, job

COOL = dict(util_milli=0, temp_milli_c=40_000, throttle_reasons=0x1, ecc_errors=0)
HOT = dict(COOL, temp_milli_c=88_000)


def gpu(index, util_milli=0, temp_milli_c=40_000, throttle_reasons=0, ecc_errors=0, used=0):
    return GpuState(index=index, model="sim", mem_total_mib=80_000, mem_used_mib=used, util_milli=util_milli,
                    temp_milli_c=temp_milli_c, sm_clock_mhz=1500, throttle_reasons=throttle_reasons,
                    ecc_errors=ecc_errors, power_mw=100_000)


def bid_facts(i, manifest, gpus, reserved=None, rtt=1000):
    """Node i's bid for ``manifest`` with the given GpuStates (all free); it reserves the
    lowest indices its own reservation would take, unless ``reserved`` says otherwise."""
    key = ident(i).public_key
    capability = CapabilityVector(node=key, epoch=0, seq=1, taken_ms=1000, zone="zone-a", rail_group="",
                                  gpus=tuple(gpus), gpus_free=tuple(g.index for g in gpus), cpu_milli_free=8000,
                                  mem_mib_free=32768, labels=(), simulated=True, running=())
    if reserved is None:
        reserved = tuple([g.index for g in gpus if gpu_healthy(g)][:manifest.resources.gpus])
    bid = Bid(instance=job_id(manifest), epoch=0, capability=encode_message(ident(i), MESH, capability),
              reserved_gpus=reserved, rtt_us=rtt, attestations=())
    return BidFacts(key, bid, capability, ())


@pytest.mark.parametrize("readings, faults", [
    (COOL, []),
    (dict(COOL, util_milli=100_000, temp_milli_c=84_999, throttle_reasons=0x4), []),  # busy, power-capped
    (dict(COOL, temp_milli_c=UNHEALTHY_TEMP_MILLI_C), ["85 C"]),
    (dict(COOL, throttle_reasons=0x20), ["throttled 0x20"]),                        # SW thermal slowdown
    (dict(COOL, throttle_reasons=0x1 | 0x40 | 0x80), ["throttled 0xc0"]),           # HW thermal, power brake
    (dict(COOL, throttle_reasons=0x8), ["throttled 0x8"]),                          # HW slowdown
    (dict(COOL, ecc_errors=1), ["1 ECC errors"]),
    (dict(COOL, ecc_errors=3, temp_milli_c=90_000), ["3 ECC errors", "90 C"]),
])
def test_p4_gpu_health_rule(readings, faults):
    assert gpu_health_faults(gpu(0, **readings)) == faults
    assert gpu_healthy(gpu(0, **readings)) == (not faults)


def test_p4_strain_bands_utilisation_heat_and_the_power_cap():
    assert gpu_strain(gpu(0)) == 0
    assert gpu_strain(gpu(0, util_milli=24_999, temp_milli_c=60_999)) == 0   # jitter inside a band
    assert gpu_strain(gpu(0, util_milli=25_000)) == 1
    assert gpu_strain(gpu(0, temp_milli_c=70_000)) == 2
    assert gpu_strain(gpu(0, util_milli=100_000, temp_milli_c=84_000, throttle_reasons=0x4)) == 4 + 4 + 1


def test_p3_a_node_whose_fitting_gpus_are_all_unhealthy_declines_node_unhealthy():
    manifest = job(gpus=2)
    hot = bid_facts(0, manifest, [gpu(0, **HOT), gpu(1, ecc_errors=2), gpu(2)], reserved=())
    ok, reason, detail = capability_check(manifest, hot.capability, {})
    assert (ok, reason) == (False, "node_unhealthy")
    assert detail == "1 of 3 fitting GPUs healthy, 2 needed: gpu0 88 C; gpu1 2 ECC errors"
    # A shortage of GPUs or memory is still said as such: health is asked of fitting GPUs only.
    assert capability_check(job(gpus=4), hot.capability, {})[1] == "not_enough_gpus"
    assert capability_check(job(gpus=0), hot.capability, {})[0]    # no GPU needed: health is no matter


def test_p4_a_bid_naming_an_unhealthy_gpu_is_invalid_and_a_reservation_never_takes_one():
    manifest = job(gpus=1)
    gpus = [gpu(0, **HOT), gpu(1)]
    liar = bid_facts(0, manifest, gpus, reserved=(0,))
    assert capability_check(manifest, liar.capability, {}, liar.bid.reserved_gpus)[1] == "not_enough_gpus"
    assert choose_placement(b"job", manifest, job_id(manifest), [liar]) is None
    # R1: the node's own reservation reads the hot GPU as -1 MiB free, so it takes GPU 1,
    # even for a job asking no GPU memory at all.
    ledger = ResourceLedger((80_000, 80_000), 8000, 32768)
    free = reservable_gpu_mem_mib(liar.capability)
    assert free == {0: -1, 1: 80_000}
    assert ledger.reserve(b"k", job(gpus=1, gpu_mem=0).resources, 10_000, free).gpus == (1,)


def test_p4_a_hot_node_is_not_chosen_while_a_healthy_one_has_room():
    manifest = job(gpus=1)
    # Node 0 would win on free GPUs (8 against 2), but all of its GPUs are hot or throttled.
    sick = bid_facts(0, manifest, [gpu(i, **HOT) if i % 2 else gpu(i, throttle_reasons=0x40) for i in range(8)],
                     reserved=(0,))
    healthy = bid_facts(1, manifest, [gpu(0), gpu(1)])
    placement = choose_placement(b"job", manifest, job_id(manifest), [sick, healthy])
    assert placement.primary == healthy.signer and placement.backups == ()
    # With one healthy GPU left, node 0 counts one free GPU, not eight, and loses on that.
    partly = bid_facts(0, manifest, [gpu(0)] + [gpu(i, **HOT) for i in range(1, 8)])
    assert choose_placement(b"job", manifest, job_id(manifest), [partly, healthy]).primary == healthy.signer


@pytest.mark.parametrize("strategy", ["throughput", "latency"])
def test_p4_cooler_less_busy_gpus_rank_first_and_leader_and_validators_agree(strategy):
    manifest = job(gpus=1, strategy=strategy, backups=2)
    bids = [
        bid_facts(0, manifest, [gpu(0, util_milli=60_000, temp_milli_c=72_000)] + [gpu(i) for i in range(1, 8)],
                  rtt=100),                                                    # busy GPU 0, most room, nearest
        bid_facts(1, manifest, [gpu(0, temp_milli_c=66_000), gpu(1)], rtt=900),   # warm: strain 1
        bid_facts(2, manifest, [gpu(0), gpu(1)], rtt=5000),                        # cool, idle: strain 0
        bid_facts(3, manifest, [gpu(0, throttle_reasons=0x4), gpu(1)], rtt=800),   # power-capped: strain 1
    ]
    iid = job_id(manifest)
    placements = {choose_placement(b"job", manifest, iid, list(order)) for order in itertools.permutations(bids)}
    assert len(placements) == 1   # the same whatever order the bids arrived in
    placement = placements.pop()
    assert placement.primary == bids[2].signer
    # Strain 1 next (latency: by RTT; throughput: by free compute, equal here, then RTT).
    assert placement.backups == (bids[3].signer, bids[1].signer)
    # A validator recomputes from the leader's justification alone, and gets the same value.
    justification = select_justification(manifest, iid, bids)
    assert choose_placement(b"job", manifest, iid, justification) == placement


# --- cores: the decline, the decision, and a held job when a GPU cools (P3, P3a, P4b) ----------------

def hot_gpus(count, temp_milli_c=88_000):
    return tuple(gpu(i, temp_milli_c=temp_milli_c) for i in range(count))


def test_p3_p4b_every_core_places_away_from_the_hot_node_which_declines_node_unhealthy():
    net = Net(gpus=(4, 2, 2, 2))   # node 0 has the most free GPUs: it would be the primary
    net.emit(KEYS[0], net.cores[KEYS[0]].update_telemetry(hot_gpus(4), 100, net.now, simulated=True))
    net.deliver()
    job, envelope = make_job(backups=1)
    net.submit(KEYS[1], envelope)
    net.run(100)
    placements = {p.value for k in KEYS for p in net.certified(k, "placement")}
    assert len(placements) == 1 and all(net.certified(k, "placement") for k in KEYS)
    placement = placements.pop()
    assert KEYS[0] != placement.primary and KEYS[0] not in placement.backups
    declines = net.cores[KEYS[1]].job_view(job_id(job))["declines"]   # at the entry node
    assert declines == {"node_unhealthy": [KEYS[0]]}


def test_p3a_a_job_every_node_declined_as_unhealthy_is_placed_once_a_gpu_cools():
    net = Net()
    for key in KEYS:
        net.emit(key, net.cores[key].update_telemetry(hot_gpus(2), 100, net.now, simulated=True))
    net.deliver()
    job, envelope = make_job()
    net.submit(KEYS[1], envelope)
    net.run(3000)
    view = net.cores[KEYS[1]].job_view(job_id(job))
    assert view["state"] == "pending" and sorted(view["declines"]["node_unhealthy"]) == sorted(KEYS)
    # Node 2's GPUs cool below the threshold: nothing freed in its ledger, but its health
    # changed, so it decides the held job afresh and bids.
    net.emit(KEYS[2], net.cores[KEYS[2]].update_telemetry(hot_gpus(2, 84_000), 100, net.now, simulated=True))
    net.run(200)
    assert {net.cores[k].job_view(job_id(job))["primary"] for k in KEYS} == {KEYS[2]}


def test_10_3_a_failed_gpu_reading_keeps_the_last_good_ones_and_declines_gpu_jobs():
    net = Net(gpus=(4, 2, 2, 2))
    core = net.cores[KEYS[0]]
    good = hot_gpus(4, 40_000)
    net.emit(KEYS[0], core.update_telemetry(good, 100, net.now, simulated=True))
    for at in (1000, 2000):
        net.now = at
        net.emit(KEYS[0], core.update_telemetry((), 100, at, simulated=True, fault="GPU 2: lost"))
    net.deliver()
    assert [e.kind for e in net.events[KEYS[0]] if e.kind.startswith("telemetry")] == ["telemetry_failed"]
    assert core.capability.current(net.now)[1].gpus == good   # stale, not empty
    gpu_job, gpu_envelope = make_job(nonce=1)
    cpu_job, cpu_envelope = make_job(nonce=2, gpus=0)
    net.submit(KEYS[1], gpu_envelope)
    net.submit(KEYS[1], cpu_envelope)
    net.run(100)
    entry = net.cores[KEYS[1]]
    assert entry.job_view(job_id(gpu_job))["primary"] != KEYS[0]
    assert entry.job_view(job_id(gpu_job))["declines"] == {"node_unhealthy": [KEYS[0]]}
    assert entry.job_view(job_id(cpu_job))["state"] == "placed"   # a job without GPUs is not refused
    assert KEYS[0] not in entry.job_view(job_id(cpu_job))["declines"].get("node_unhealthy", [])
    net.emit(KEYS[0], core.update_telemetry(good, 100, net.now, simulated=True))
    assert [e.kind for e in net.events[KEYS[0]] if e.kind.startswith("telemetry")] == [
        "telemetry_failed", "telemetry_recovered"]
