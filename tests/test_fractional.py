"""Fractional GPUs, GPU models and the ``pack`` strategy (SPEC.md P4c, R1, G1): the ledger
counts each GPU in thousandths, vectors sign the free milli, bids reserve a share of one
GPU that every validator checks, ``pack`` fills started GPUs, and a simulated mesh never
puts more than 1000 milli on one GPU."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keys.identity import SigningIdentity
from protocol.gpu_shares import MILLI_PER_GPU
from protocol.ledger import ResourceLedger
from protocol.messages import (Bid, CapabilityVector, Constraints, GpuState, JobManifest, Resources, encode_message,
                               job_id)
from protocol.pack_scoring import MESH_WORKLOAD, pack_score, pack_share_gpu
from protocol.placement import BidFacts, capability_check, choose_placement, eligibility, reservable_gpu_mem_mib
from protocol.policy import NodePolicy
from testnet.sim import SimConfig, Simulation
from testnet.sim_nodes import run_node_simulation

MESH = hashlib.sha256(b"fractional mesh").digest()


def ident(i):
    return SigningIdentity(hashlib.sha256(b"frac-node%d" % i).digest())


def gpu(index, model="H100"):
    return GpuState(index=index, model=model, mem_total_mib=80_000, mem_used_mib=0, util_milli=0,
                    temp_milli_c=40_000, sm_clock_mhz=1500, throttle_reasons=0, ecc_errors=0, power_mw=100_000)


def cap(node, milli_free=(MILLI_PER_GPU,), model="H100", cpu=8000):
    return CapabilityVector(node=node, epoch=0, seq=1, taken_ms=1000, zone="zone-a", rail_group="",
                            gpus=tuple(gpu(i, model) for i in range(len(milli_free))),
                            gpus_free=tuple(i for i, m in enumerate(milli_free) if m == MILLI_PER_GPU),
                            cpu_milli_free=cpu, mem_mib_free=32768, labels=(), simulated=True, running=(),
                            gpu_milli_free=tuple(milli_free))


def share_job(milli=250, model="", strategy="pack", gpus=1, nonce=0):
    return JobManifest(owner=ident(99).public_key, name="share", nonce=nonce, entrypoint="counter", args=(),
                       resources=Resources(gpus=gpus, gpu_mem_mib=1000, cpu_milli=100, mem_mib=64, gpu_milli=milli,
                                           gpu_model=model),
                       strategy=strategy, constraints=Constraints(zones=(), labels=(), attested=()),
                       priority=0, backups=0, max_retries=0, created_ms=0, epoch=0)


def bid_facts(i, manifest, capability, reserved):
    key = ident(i).public_key
    capability = CapabilityVector(**{**capability.__dict__, "node": key})
    bid = Bid(instance=job_id(manifest), epoch=0, capability=encode_message(ident(i), MESH, capability),
              reserved_gpus=reserved, rtt_us=1000, attestations=())
    return BidFacts(key, bid, capability, ())


# --- the ledger (R1 per GPU) -------------------------------------------------------------------

def share(milli, cpu=100, mem=64, gpu_mem=0, model=""):
    return Resources(gpus=1, gpu_mem_mib=gpu_mem, cpu_milli=cpu, mem_mib=mem, gpu_milli=milli, gpu_model=model)


def test_four_quarter_shares_fill_one_gpu_and_a_fifth_does_not_fit():
    book = ResourceLedger((80_000, 80_000), cpu_milli=8000, mem_mib=8192)
    claims = [book.reserve(b"q%d" % k, share(250)) for k in range(4)]
    assert [c.gpus for c in claims] == [(0,)] * 4   # the fullest GPU that fits: shares pack
    assert book.gpu_milli_free() == (0, 1000) and book.free_gpus() == (1,)
    assert book.reserve(b"whole", Resources(gpus=2, gpu_mem_mib=0, cpu_milli=0, mem_mib=0)) is None
    assert book.reserve(b"fifth", share(250)).gpus == (1,)
    assert book.reserve(b"big", share(900)) is None        # 750 left on GPU 1
    book.allocate(b"q0", b"job0")
    book.free(b"job0")
    assert book.gpu_milli_free() == (250, 750)
    assert book.reserve(b"again", share(250)).gpus == (0,)   # 250 free on GPU 0 is the fuller fit
    assert book.held_gpu_milli() == (1000, 250)


def test_a_restored_share_keeps_its_gpu_and_a_model_the_node_lacks_is_refused():
    book = ResourceLedger((80_000, 80_000), cpu_milli=8000, mem_mib=8192, gpu_model="H100")
    assert book.reserve(b"r", share(500), prefer=(1,)).gpus == (1,)
    assert book.allocate_now(b"job", share(100, model="A10")) is None
    assert book.allocate_now(b"job", share(100, model="H100")).gpus == (1,)


ops = st.lists(st.tuples(st.sampled_from(["reserve", "release", "allocate", "allocate_now", "free", "expire"]),
                         st.integers(0, 7), st.integers(0, 2), st.sampled_from([0, 1, 100, 250, 500, 999]),
                         st.integers(0, 3000), st.integers(0, 2000)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_claims_milli_on_one_gpu_never_sum_past_1000(operations):
    """R1 with shares: on every GPU the claims' thousandths sum to at most 1000 and equal what
    the ledger says is held; CPU and memory never pass capacity."""
    book = ResourceLedger((1000, 2000, 3000), cpu_milli=4000, mem_mib=4096)
    now = 0
    for op, key, gpus, milli, cpu, mem in operations:
        k = bytes([key])
        wanted = share(milli, cpu, mem) if milli else Resources(gpus=gpus, gpu_mem_mib=0, cpu_milli=cpu, mem_mib=mem)
        now += 10
        if op == "reserve":
            book.reserve(k, wanted, expires_ms=now + cpu % 100)
        elif op == "release":
            book.release(k)
        elif op == "allocate":
            book.allocate(k, b"job" + k)
        elif op == "allocate_now":
            book.allocate_now(b"job" + k, wanted)
        elif op == "free":
            book.free(b"job" + k)
        else:
            book.expire(now)
        held = book.held_gpu_milli()
        assert all(milli_held <= MILLI_PER_GPU for milli_held in held)
        assert tuple(MILLI_PER_GPU - free for free in book.gpu_milli_free()) == held
        claims = list(book.reservations().values()) + list(book.allocations().values())
        for claim in claims:
            if claim.gpu_milli:   # a share sits on one GPU
                assert len(claim.gpus) == 1
        assert sum(c.cpu_milli for c in claims) == book.held_totals()[1] <= 4000
        assert sum(c.mem_mib for c in claims) == book.held_totals()[2] <= 4096


# --- bids and validators (P4, P4c) ------------------------------------------------------------

def test_validators_check_a_share_bid_against_the_signed_free_milli():
    manifest = share_job(milli=500, strategy="throughput")
    vector = cap(b"\x01" * 32, milli_free=(250, 600))
    assert capability_check(manifest, vector, {}, reserved_gpus=(1,)) == (True, None, "")
    ok, reason, _ = capability_check(manifest, vector, {}, reserved_gpus=(0,))   # 250 free: a lie
    assert not ok and reason == "not_enough_gpus"
    full = cap(b"\x01" * 32, milli_free=(250, 400))
    assert capability_check(manifest, full, {}) == (False, "not_enough_gpus", "no GPU with 500 milli free")
    # A vector without gpu_milli_free states whole GPUs: the one in gpus_free has 1000.
    legacy = CapabilityVector(**{**cap(b"\x01" * 32, (MILLI_PER_GPU, 0)).__dict__, "gpu_milli_free": ()})
    assert capability_check(manifest, legacy, {}, reserved_gpus=(0,))[0]
    assert not capability_check(manifest, legacy, {}, reserved_gpus=(1,))[0]


def test_a_job_naming_a_gpu_model_fits_only_gpus_of_that_model():
    manifest = share_job(model="A10-24GB", strategy="throughput")
    assert capability_check(manifest, cap(b"\x01" * 32, model="H100"), {}) == (
        False, "gpu_model_missing", "0 GPUs of model A10-24GB, 1 needed")
    assert capability_check(manifest, cap(b"\x01" * 32, model="A10-24GB"), {}, reserved_gpus=(0,))[0]
    mixed = CapabilityVector(**{**cap(b"\x01" * 32, (1000, 1000)).__dict__,
                                "gpus": (gpu(0, "H100"), gpu(1, "A10-24GB"))})
    # The node's own reservation sees the other model's GPU as unusable (-1 MiB free).
    assert reservable_gpu_mem_mib(mixed, manifest) == {0: -1, 1: 80_000}
    assert not capability_check(manifest, mixed, {}, reserved_gpus=(0,))[0]
    assert eligibility(manifest, mixed, NodePolicy(), {})[0]


def test_pack_growth_matches_the_worked_example_of_p4c():
    """SPEC.md P4c's example, number for number: a quarter share on a GPU with 750 free grows
    the weighted fragmentation by -3,750,000, on a fresh GPU by -2,750,000."""
    assert MESH_WORKLOAD.total_count == 15750
    manifest = share_job(milli=250)
    started = pack_score(manifest.resources, cap(b"\x01" * 32, (750,)), {0}, (0,))
    fresh = pack_score(manifest.resources, cap(b"\x01" * 32, (1000,)), {0}, (0,))
    assert started[0] == -3_750_000 and fresh[0] == -2_750_000


def test_pack_puts_a_share_on_the_started_gpu_and_throughput_spreads():
    manifest = share_job(milli=250)
    started = bid_facts(1, manifest, cap(b"\x00" * 32, (750, 1000)), (0,))
    fresh = bid_facts(2, manifest, cap(b"\x00" * 32, (1000, 1000)), (0,))
    assert choose_placement(b"job", manifest, job_id(manifest), [fresh, started]).primary == started.signer
    spread = share_job(milli=250, strategy="throughput")
    started = bid_facts(1, spread, cap(b"\x00" * 32, (750, 1000)), (0,))
    fresh = bid_facts(2, spread, cap(b"\x00" * 32, (1000, 1000)), (0,))
    assert choose_placement(b"job", spread, job_id(spread), [fresh, started]).primary == fresh.signer


def test_pack_keeps_a_whole_node_free_for_whole_gpu_jobs():
    """Two whole GPUs: pack picks the node they fill exactly, not the 8-GPU node."""
    manifest = share_job(milli=0, gpus=2)
    exact = bid_facts(1, manifest, cap(b"\x00" * 32, (1000, 1000)), (0, 1))
    big = bid_facts(2, manifest, cap(b"\x00" * 32, (1000,) * 8), (0, 1))
    assert choose_placement(b"job", manifest, job_id(manifest), [big, exact]).primary == exact.signer


# --- the mesh: simulator and node driver ------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fractional_sweep_never_puts_more_than_1000_milli_on_a_gpu(seed):
    """All faults, Byzantine stake on odd seeds; the checker counts every GPU's milli on what
    each honest node runs (overcommit) and in its ledger."""
    config = SimConfig(nodes=4, jobs=10, seed=seed, byzantine_milli=250 if seed % 2 else 0,
                       fractional_per_mille=1000)
    sim = Simulation(config)
    result = sim.run()
    assert result.ok, [v.line() for v in result.violations[:3]]
    shared = 0
    for node in sim.nodes:
        if node.core is None:
            continue
        on_gpu: dict[int, int] = {}
        for claim in node.core.ledger.allocations().values():
            for index in claim.gpus:
                on_gpu[index] = on_gpu.get(index, 0) + 1
        shared += sum(1 for count in on_gpu.values() if count > 1)
    assert shared, "some GPU must hold two shares, or the sweep shows nothing"


def test_four_quarter_jobs_share_one_gpu_on_real_nodes_and_a_fifth_waits():
    """Node mode (real drivers, stores, a simulated runner): only node 3's GPU is an A10, so
    five quarter-GPU A10 jobs meet one GPU: four run on it at once, the fifth starts only
    when one of them exits."""
    quarter = Resources(gpus=1, gpu_mem_mib=1000, cpu_milli=100, mem_mib=64, gpu_milli=250, gpu_model="A10-24GB")
    result = run_node_simulation(seed=5, jobs=5, faults=(), job_resources=quarter, job_strategy="pack",
                                 units=(200, 200), submit_window_ms=(100, 150))
    assert result.ok, [v.line() for v in result.violations]
    runs = sorted(result.runs, key=lambda run: run.start_ms)
    assert len(runs) == 5 and {(run.node, run.gpus) for run in runs} == {(3, (0,))}
    first, fifth = runs[:4], runs[4]
    assert max(run.start_ms for run in first) < min(run.end_ms for run in first)   # four at once
    assert fifth.start_ms >= min(run.end_ms for run in first)                      # the fifth waited
    assert len(result.completed_ms) == 5


@pytest.mark.parametrize("seed", range(5))
def test_the_mesh_pack_score_is_replays_pack_policy_on_the_bids_gpu(seed):
    """`meshnode replay --policy pack` and the mesh score with one function: for a node state
    and the GPU option replay's pack policy picks, a bid naming a GPU with that free milli
    scores exactly what the policy scored (SPEC.md P4c, G1)."""
    import random

    from protocol.gpu_shares import NodeShares, TaskDemand
    from protocol.pack_scoring import PACK_POLICY
    rng = random.Random(seed)
    for _ in range(50):
        frees = [rng.choice((0, 100, 250, 500, 750, 900, 1000)) for _ in range(rng.choice((1, 2, 4, 8)))]
        cpu = rng.choice((0, 4000, 32000))
        node = NodeShares("n", "", len(frees), 64000, 1 << 20)
        node.gpu_milli_free, node.cpu_milli_free = list(frees), cpu
        milli = rng.choice((100, 250, 500, 0))
        manifest = share_job(milli=milli, gpus=1 if milli else rng.choice((1, 2)))
        resources = manifest.resources
        demand = (TaskDemand.fractional(resources.cpu_milli, resources.mem_mib, milli) if milli
                  else TaskDemand.whole(resources.cpu_milli, resources.mem_mib, resources.gpus))
        if not node.fits(demand):
            continue
        score, option = PACK_POLICY.score(node, demand)
        gpus = node.default_gpus(demand, option)
        vector = cap(b"\x01" * 32, tuple(frees), cpu=cpu)
        assert pack_score(resources, vector, set(range(len(frees))), gpus) == score
        if milli:   # and a node bidding for it reserves a GPU replay's policy would have picked
            fitting = [i for i, free in enumerate(frees) if free >= milli]
            assert frees[pack_share_gpu(resources, vector, set(range(len(frees))), fitting)] == option


def test_a_restarted_node_holds_its_persisted_share_reservation_again():
    """R1 after a restart: a share's reservation comes back from its persisted record on the
    same GPU with the same milli, so the node never promises that quarter twice."""
    import random

    from protocol.mesh import MeshCore
    from protocol.policy import LocalCapacity
    from tests.test_single_member import SOLO, genesis_of

    genesis, _ = genesis_of(100)

    def core(records=()):
        return MeshCore(identity=SOLO, genesis=genesis, policy=NodePolicy(zone="zone-a"),
                        capacity=LocalCapacity(gpu_mem_total_mib=(80_000, 80_000)), rng=random.Random(7),
                        now_ms=0, safety_records=records)
    before = core()
    before.ledger.reserve(b"w" * 32, share(1000 - 250))        # GPU 0 holds 750
    claim = before.ledger.reserve(b"k" * 32, share(250))       # the fullest fit: GPU 0 again
    assert claim.gpus == (0,)
    records = tuple(MeshCore._reservation_record(key, held, None)
                    for key, held in before.ledger.reservations().items())
    after = core(records)
    restored = after.ledger.reserved(b"k" * 32)
    assert (restored.gpus, restored.gpu_milli) == ((0,), 250)
    assert after.ledger.gpu_milli_free() == (0, 1000)
