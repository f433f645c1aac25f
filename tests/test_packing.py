"""Fragmentation and packing policies on hand-made clusters whose right answer is worked
out in the comments (protocol/packing.py; SPEC.md 7, "GPU shares and packing")."""

from __future__ import annotations

import pytest

from protocol.gpu_shares import NodeShares, ShareError, TaskDemand
from protocol.packing import (BestFit, DotProduct, FragmentationGradient, FragmentationGradientPacked,
                              PackingCluster, RandomFit, WorkloadDistribution, make_policy)

WHOLE = TaskDemand.whole(1000, 0, 1)
SHARE_600 = TaskDemand.fractional(1000, 0, 600)
SHARE_600_NO_CPU = TaskDemand.fractional(0, 0, 600)


def node_with(name: str, gpu_free: list[int], cpu_free: int = 8000, model: str = "T4") -> NodeShares:
    """A node whose GPUs have ``gpu_free`` milli free (the rest held by one share each)."""
    node = NodeShares(name, model, len(gpu_free), 8000, 65536)
    for index, free in enumerate(gpu_free):
        if free < 1000:
            node.allocate("%s-held-%d" % (name, index), TaskDemand.fractional(0, 0, 1000 - free), (index,))
    if cpu_free < 8000:
        node.allocate("%s-cpu" % name, TaskDemand(8000 - cpu_free, 0), ())
    return node


def test_fragment_is_the_free_milli_each_task_type_cannot_use():
    workload = WorkloadDistribution([WHOLE, SHARE_600])  # p = 1/2 each
    # GPUs [1000, 500], CPU enough: the whole-GPU type cannot use the 500 (fragment 500);
    # the 600-share cannot use the 500 either (fragment 500): F = 500.
    assert workload.node_fragment_milli(node_with("a", [1000, 500])) == 500
    # GPUs [1000, 650]: the whole type loses 650, the 600-share loses nothing: F = 325.
    assert workload.node_fragment_milli(node_with("b", [1000, 650])) == 325
    # Too little CPU for either type: all 1500 free milli is fragment.
    assert workload.node_fragment_milli(node_with("c", [1000, 500], cpu_free=500)) == 1500
    # No GPU free, no fragment.
    assert workload.node_fragment_milli(node_with("d", [0, 0])) == 0


def test_cpu_only_types_and_other_models_see_all_free_gpu_as_fragment():
    cpu_only = TaskDemand(1000, 0)
    v100_only = TaskDemand.whole(1000, 0, 1, frozenset({"V100M32"}))
    workload = WorkloadDistribution([cpu_only, v100_only, WHOLE, WHOLE])  # p = 1/4, 1/4, 1/2
    node = node_with("t4", [1000, 1000])
    # cpu-only: 2000; V100-only on a T4: 2000; whole on T4: 0 -> F = 1000
    assert workload.node_fragment_milli(node) == 1000


def test_gpu_milli_weighting_counts_each_type_by_the_gpu_milli_it_asks():
    tasks = [TaskDemand(1000, 0), TaskDemand.fractional(0, 0, 250), TaskDemand.whole(0, 0, 2)]
    weighted = WorkloadDistribution(tasks).reweighted("gpu_milli")
    assert weighted.total_count == 250 + 2000
    # GPUs [1000, 1000]: the 250-share fits (no fragment), the 2-GPU task fits: F = 0.
    assert weighted.node_fragment_milli(node_with("a", [1000, 1000])) == 0
    # GPUs [1000, 500]: the 250-share loses nothing, the 2-GPU type loses all 1500:
    # F = (250 * 0 + 2000 * 1500) / 2250.
    assert weighted.node_fragment_milli(node_with("b", [1000, 500])) == pytest.approx(2000 * 1500 / 2250)
    with pytest.raises(ShareError):
        WorkloadDistribution(tasks, weighting="bogus")
    with pytest.raises(ShareError):
        WorkloadDistribution([])


def _choose(policy, nodes, demand, seed=0):
    return PackingCluster(nodes, policy, seed).choose(demand)


def test_fgd_fills_the_broken_gpu_where_best_fit_breaks_a_whole_one():
    # Workload: whole GPUs only. A share of 500 arrives. Node 0 has one whole GPU (1000 free
    # in all); node 1 has GPUs [1000, 500] (1500 free).
    # best-fit: least free left -> node 0 (500 left vs 1000), which breaks its whole GPU.
    # FGD: node 0 grows F from 0 to 500 (+500); node 1 on its 500 GPU goes [1000, 0], F from
    # 500 to 0 (-500) -> node 1, GPU 1.
    workload = WorkloadDistribution([WHOLE])
    share = TaskDemand.fractional(0, 0, 500)
    assert _choose(BestFit(), [node_with("a", [1000]), node_with("b", [1000, 500])], share) == (0, (0,))
    assert _choose(FragmentationGradient(workload), [node_with("a", [1000]), node_with("b", [1000, 500])],
                   share) == (1, (1,))
    assert _choose(FragmentationGradientPacked(workload), [node_with("a", [1000]), node_with("b", [1000, 500])],
                   share) == (1, (1,))


def test_pack_weighs_task_types_by_gpu_milli_and_keeps_room_for_the_two_gpu_task():
    # Workload: six 600-shares and one 2-GPU task. One node, GPUs [1000, 1000, 700]; a
    # 300-share arrives. Fragments (share type, 2-GPU type) before: (0, 700).
    # On a 1000 GPU -> [700, 1000, 700]: (0, 2400: the 2-GPU task no longer fits).
    # On the 700 GPU -> [1000, 1000, 400]: (400, 400).
    # Per task (FGD):    growth 6*0 + 1*1700 = 1700  vs  6*400 + 1*(-300) = 2100 -> a 1000 GPU.
    # Per GPU milli (pack): 3600*0 + 2000*1700 = 3.4e6 vs 3600*400 + 2000*(-300) = 0.84e6
    #                    -> the 700 GPU, keeping two whole GPUs for the 2-GPU task.
    workload = WorkloadDistribution([SHARE_600_NO_CPU] * 6 + [TaskDemand.whole(0, 0, 2)])
    share = TaskDemand.fractional(0, 0, 300)
    assert _choose(FragmentationGradient(workload), [node_with("a", [1000, 1000, 700])], share) == (0, (0,))
    assert _choose(FragmentationGradientPacked(workload), [node_with("a", [1000, 1000, 700])], share) == (0, (2,))


def test_fgd_picks_the_gpu_on_a_node_that_grows_fragmentation_least():
    # One node, GPUs [1000, 700, 400]; workload: 600-shares only. A 300-share arrives.
    # On 1000 -> [700, 700, 400]: F 400 -> 400 (0); on 700 -> [1000, 400, 400]: 400 -> 800 (+400);
    # on 400 -> [1000, 700, 100]: 400 -> 100 (-300). FGD takes the GPU with 400 free (index 2).
    workload = WorkloadDistribution([SHARE_600])
    node = node_with("a", [1000, 700, 400])
    assert _choose(FragmentationGradient(workload), [node], TaskDemand.fractional(0, 0, 300)) == (0, (2,))


def test_dot_product_prefers_the_least_aligned_free_vector():
    # A 500-share with 1000 CPU. Node 0: 8 of 8 CPU free and a GPU with 1000 free:
    # 1/8 * 8/8 + 0.5 * 1.0 = 0.625. Node 1: 2 of 8 CPU free, a GPU with 600 free:
    # 1/8 * 2/8 + 0.5 * 0.6 = 0.33125 -> node 1.
    demand = TaskDemand.fractional(1000, 0, 500)
    nodes = [node_with("a", [1000]), node_with("b", [600], cpu_free=2000)]
    assert _choose(DotProduct(), nodes, demand) == (1, (0,))


def test_pack_keeps_the_fresh_node_whole_where_fgd_draws():
    # Workload: whole GPUs. A whole-GPU task grows F by 0 anywhere it fits. Node 0 is
    # fresh [1000, 1000]; node 1 is started [0, 1000] (a whole GPU already taken).
    # pack: equal growth, then least GPU milli left -> node 1, keeping node 0 whole.
    workload = WorkloadDistribution([WHOLE])
    started = NodeShares("b", "T4", 2, 8000, 65536)
    started.allocate("first", WHOLE, (0,))
    assert _choose(FragmentationGradientPacked(workload), [node_with("a", [1000, 1000]), started], WHOLE) == (1, (1,))
    # FGD draws among the two at random: both occur over seeds (as Kubernetes' ties do).
    picks = set()
    for seed in range(20):
        started = NodeShares("b", "T4", 2, 8000, 65536)
        started.allocate("first", WHOLE, (0,))
        picks.add(_choose(FragmentationGradient(workload), [node_with("a", [1000, 1000]), started], WHOLE, seed)[0])
    assert picks == {0, 1}


def test_pack_breaks_exact_ties_by_lowest_node_index():
    workload = WorkloadDistribution([WHOLE])
    nodes = [node_with("n%d" % i, [1000, 1000]) for i in range(5)]
    assert _choose(FragmentationGradientPacked(workload), nodes, WHOLE) == (0, (0,))


def test_random_fit_is_seeded_and_reaches_every_feasible_node():
    demand = TaskDemand.fractional(0, 0, 500)
    def nodes():
        return [node_with("a", [1000]), node_with("full", [0]), node_with("c", [1000, 1000])]
    picks = [_choose(RandomFit(), nodes(), demand, seed) for seed in range(30)]
    assert picks == [_choose(RandomFit(), nodes(), demand, seed) for seed in range(30)]
    assert {p[0] for p in picks} == {0, 2}


def test_a_task_that_fits_nowhere_is_refused_and_changes_nothing():
    workload = WorkloadDistribution([WHOLE])
    cluster = PackingCluster([node_with("a", [500, 500])], make_policy("pack", workload))
    assert cluster.place("t", WHOLE) is None
    assert cluster.gpu_milli_allocated == 1000
    with pytest.raises(ShareError):
        make_policy("nope", workload)


def test_cached_scores_follow_node_changes():
    """Each placement changes node 1, so it is rescored every time (a stale cached GPU
    option would point at a GPU that no longer has that much free). Workload: whole GPUs;
    500-shares arrive; node 0 is [1000, 1000], node 1 is [1000, 500].
    s1: node 1's 500 GPU (-500). s2: +500 on either node; pack: fewer GPU milli left ->
    node 1, GPU 0 -> [500, 0]. s3: node 1's 500 GPU again (-500) -> [0, 0].
    Releasing s1 frees node 1's GPU 1 -> [0, 500]; s4 fills it (-500)."""
    workload = WorkloadDistribution([WHOLE])
    cluster = PackingCluster([node_with("a", [1000, 1000]), node_with("b", [1000, 500])],
                             make_policy("pack", workload))
    share = TaskDemand.fractional(0, 0, 500)
    placed = []
    for name in ("s1", "s2", "s3"):
        index, allocation = cluster.place(name, share)
        placed.append((index, allocation.gpus))
    assert placed == [(1, (1,)), (1, (0,)), (1, (0,))]
    assert cluster.nodes[1].gpu_milli_free == [0, 0]
    cluster.release("s1")
    assert cluster.nodes[1].gpu_milli_free == [0, 500]
    assert cluster.place("s4", share)[1].gpus == (1,)
    assert cluster.nodes[0].gpu_milli_free == [1000, 1000]


def _fragment_by_definition(workload: WorkloadDistribution, node: NodeShares) -> int:
    """SPEC.md 7 G1, type by type, without the prefix sums the fast path uses."""
    free = sum(node.gpu_milli_free)
    total = 0
    for (cpu, count, milli, models), weight in workload.type_counts.items():
        usable = sum(1 for f in node.gpu_milli_free if f >= milli)
        if count == 0 or (models and node.model not in models) or node.cpu_milli_free < cpu or usable < count:
            total += weight * free
        else:
            total += weight * sum(f for f in node.gpu_milli_free if f < milli)
    return total


@pytest.mark.parametrize("seed", range(30))
def test_fast_fragment_equals_the_definition(seed):
    import random
    rng = random.Random(seed)
    demands = []
    for _ in range(rng.randrange(1, 25)):
        cpu = rng.choice([0, 2000, 4000, 8000, 16000])
        models = frozenset(rng.sample(["T4", "A10"], rng.randrange(0, 2)))
        kind = rng.randrange(3)
        demands.append(TaskDemand(cpu, 0) if kind == 0 else
                       TaskDemand.fractional(cpu, 0, rng.choice([100, 250, 500, 800]), models) if kind == 1 else
                       TaskDemand.whole(cpu, 0, rng.choice([1, 2, 4]), models))
    for weighting in ("tasks", "gpu_milli"):
        workload = WorkloadDistribution(demands).reweighted(weighting)
        for _ in range(20):
            gpus = rng.choice([1, 2, 4, 8])
            node = node_with("n", [rng.choice([0, 100, 300, 500, 750, 1000]) for _ in range(gpus)],
                             cpu_free=rng.choice([0, 1000, 4000, 8000]), model=rng.choice(["T4", "A10"]))
            fast = workload.fragment_weighted(node.model, node.cpu_milli_free, tuple(sorted(node.gpu_milli_free)))
            assert fast == _fragment_by_definition(workload, node), "seed=%d" % seed
