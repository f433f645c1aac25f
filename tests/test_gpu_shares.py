"""Per-GPU accounting (protocol/gpu_shares.py; SPEC.md 7, "GPU shares and packing"):
shapes, refusals, and the never-overcommit invariant under seeded random allocate/free."""

from __future__ import annotations

import random

import pytest

from protocol.gpu_shares import MILLI_PER_GPU, NodeShares, ShareError, TaskDemand
from protocol.packing import POLICY_NAMES, PackingCluster, WorkloadDistribution, make_policy


@pytest.mark.parametrize("kwargs", [
    dict(cpu_milli=-1, memory_mib=0),
    dict(cpu_milli=0, memory_mib=0, gpu_count=0, gpu_milli_each=500),   # a share of no GPU
    dict(cpu_milli=0, memory_mib=0, gpu_count=1, gpu_milli_each=0),     # one GPU, nothing of it
    dict(cpu_milli=0, memory_mib=0, gpu_count=1, gpu_milli_each=1001),
    dict(cpu_milli=0, memory_mib=0, gpu_count=2, gpu_milli_each=500),   # shares span one GPU only
    dict(cpu_milli=0, memory_mib=0, gpu_count=-1, gpu_milli_each=1000),
])
def test_demand_shapes_outside_the_three_are_refused(kwargs):
    with pytest.raises(ShareError):
        TaskDemand(**kwargs)


def test_two_shares_share_one_gpu_and_a_third_does_not_fit():
    node = NodeShares("n", "T4", 1, 8000, 8192)
    share = TaskDemand.fractional(1000, 1024, 400)
    node.allocate("a", share, (0,))
    node.allocate("b", share, (0,))
    assert node.gpu_milli_free == [200]
    assert not node.fits(share)
    with pytest.raises(ShareError, match="GPU 0 has 200 milli free"):
        node.allocate("c", share, (0,))
    node.free("a")
    assert node.gpu_milli_free == [600] and node.fits(share)


def test_whole_gpus_need_wholly_free_gpus_and_a_listed_model():
    node = NodeShares("n", "T4", 2, 8000, 8192)
    node.allocate("share", TaskDemand.fractional(0, 0, 100), (0,))
    two = TaskDemand.whole(0, 0, 2)
    assert not node.fits(two)
    with pytest.raises(ShareError):
        node.allocate("two", two, (0, 1))
    one_v100 = TaskDemand.whole(0, 0, 1, frozenset({"V100M16", "V100M32"}))
    assert not node.fits(one_v100)
    with pytest.raises(ShareError, match="model"):
        node.allocate("v", one_v100, (1,))
    assert node.fits(TaskDemand.whole(0, 0, 1, frozenset({"A10", "T4"})))
    assert node.default_gpus(TaskDemand.whole(0, 0, 1)) == (1,)


def test_bad_allocations_are_refused_and_change_nothing():
    node = NodeShares("n", "P100", 2, 4000, 4096)
    node.allocate("a", TaskDemand.fractional(1000, 1000, 500), (1,))
    before = (list(node.gpu_milli_free), node.cpu_milli_free, node.memory_mib_free)
    for task_id, demand, gpus in [
        ("a", TaskDemand.fractional(0, 0, 1), (0,)),                 # task already placed
        ("b", TaskDemand.fractional(0, 0, 1), (2,)),                 # no such GPU
        ("b", TaskDemand.fractional(0, 0, 1), ()),                   # GPU count mismatch
        ("b", TaskDemand.whole(0, 0, 2), (0, 0)),                    # the same GPU twice
        ("b", TaskDemand.fractional(3001, 0, 1), (0,)),              # CPU
        ("b", TaskDemand.fractional(0, 3097, 1), (0,)),              # memory
    ]:
        with pytest.raises(ShareError):
            node.allocate(task_id, demand, gpus)
        assert (list(node.gpu_milli_free), node.cpu_milli_free, node.memory_mib_free) == before
    with pytest.raises(ShareError):
        node.free("nobody")


def _random_demand(rng: random.Random) -> TaskDemand:
    cpu, mem = rng.randrange(0, 6000, 500), rng.randrange(0, 6000, 512)
    kind = rng.randrange(3)
    models = frozenset(rng.sample(["T4", "P100", "A10"], rng.randrange(0, 2)))
    if kind == 0:
        return TaskDemand(cpu, mem)
    if kind == 1:
        return TaskDemand.fractional(cpu, mem, rng.choice([50, 230, 470, 500, 810, 1000]), models)
    return TaskDemand.whole(cpu, mem, rng.choice([1, 2, 4]), models)


def _check_invariant(node: NodeShares) -> None:
    """Recompute the node's books from its allocations alone and compare."""
    held = [0] * node.gpu_count
    whole_holders = [0] * node.gpu_count
    holders = [0] * node.gpu_count
    cpu = mem = 0
    for allocation in node.allocations().values():
        cpu += allocation.cpu_milli
        mem += allocation.memory_mib
        for index in allocation.gpus:
            held[index] += allocation.gpu_milli_each
            holders[index] += 1
            whole_holders[index] += allocation.gpu_milli_each == MILLI_PER_GPU
    assert cpu <= node.cpu_milli_total and mem <= node.memory_mib_total
    assert node.cpu_milli_free == node.cpu_milli_total - cpu
    assert node.memory_mib_free == node.memory_mib_total - mem
    for index in range(node.gpu_count):
        assert held[index] <= MILLI_PER_GPU, "GPU %d overcommitted" % index
        assert node.gpu_milli_free[index] == MILLI_PER_GPU - held[index]
        assert not whole_holders[index] or holders[index] == 1, "a whole GPU is shared"


@pytest.mark.parametrize("seed", range(40))
def test_random_allocate_free_never_overcommits(seed):
    """Any GPU choice may be tried, legal or not: the node takes it iff it fits, and its
    books always equal what its allocations add up to."""
    rng = random.Random(seed)
    node = NodeShares("n", rng.choice(["T4", "P100"]), rng.choice([1, 2, 4, 8]), 16000, 16384)
    live = []
    for step in range(300):
        if live and rng.random() < 0.35:
            node.free(live.pop(rng.randrange(len(live))))
        else:
            demand = _random_demand(rng)
            gpus = tuple(rng.sample(range(node.gpu_count), min(demand.gpu_count, node.gpu_count)))
            legal = (demand.gpu_count <= node.gpu_count
                     and demand.cpu_milli <= node.cpu_milli_free and demand.memory_mib <= node.memory_mib_free
                     and (not gpus or demand.allows_model(node.model))
                     and all(node.gpu_milli_free[i] >= demand.gpu_milli_each for i in gpus))
            try:
                node.allocate(step, demand, gpus)
                live.append(step)
                assert legal, "seed=%d step=%d: an illegal allocation was taken" % (seed, step)
            except ShareError:
                assert not legal, "seed=%d step=%d: a legal allocation was refused" % (seed, step)
        _check_invariant(node)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("seed", range(5))
def test_policies_place_only_where_it_fits_and_fail_only_when_nothing_fits(policy, seed):
    rng = random.Random(seed)
    nodes = [NodeShares("n%d" % i, rng.choice(["T4", "P100", "A10"]), rng.choice([1, 2, 4, 8]),
                        rng.choice([8000, 16000, 32000]), rng.choice([8192, 32768])) for i in range(12)]
    demands = [_random_demand(rng) for _ in range(60)]
    cluster = PackingCluster(nodes, make_policy(policy, WorkloadDistribution(demands)), seed)
    live = []
    for step in range(400):
        if live and rng.random() < 0.3:
            cluster.release(live.pop(rng.randrange(len(live))))
        else:
            demand = rng.choice(demands)
            fits_somewhere = any(n.fits(demand) for n in nodes)
            placed = cluster.place(step, demand)
            assert (placed is not None) == fits_somewhere
            if placed:
                live.append(step)
        for node in nodes:
            _check_invariant(node)
        assert cluster.gpu_milli_allocated == sum(n.gpu_count * MILLI_PER_GPU - n.gpu_milli_free_total
                                                  for n in nodes)
