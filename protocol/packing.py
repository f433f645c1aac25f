"""Placement policies for GPU-sharing workloads, and the fragmentation they fight
(SPEC.md 7, G1 "GPU shares and packing"). No IO; deterministic given a seed.

Fragmentation follows Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing
Workloads with Fragmentation Gradient Descent" (USENIX ATC 2023). The *target workload*
is a distribution over task types (CPU milli, GPU count, GPU milli each, allowed models),
each with an integer weight (its count in a reference task list, or that times its
GPU milli: ``WorkloadDistribution`` weightings). For a node n and a task type m, the
fragment F_n(m) is the node's free GPU milli that m cannot use:

* all of it, when m asks for no GPU, may not use n's model, or does not fit on n
  (too little free CPU, or fewer than m's GPU count of GPUs with m's milli free);
* otherwise the free milli of the GPUs whose free milli is below m's milli each.

A node's fragmentation is the expectation over the workload, F_n = sum_m p_m F_n(m); the
cluster's is the sum over nodes, and its fragmentation rate is that over the cluster's
free GPU milli. Memory is not part of the measure (the paper counts CPU and GPU); it is
part of whether a task fits when placed. Counts are integers, so F_n is computed as the
integer sum_m count_m F_n(m) and every comparison is exact: validators agree bit for bit.

Policies score a (node, task) pair from the node's ``state_key`` alone, lower is better,
which is what lets ``PackingCluster`` score each distinct node state once per task
shape and cache it until a node's state changes.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections import Counter

from protocol.gpu_shares import MILLI_PER_GPU, Allocation, NodeShares, ShareError, TaskDemand

MAX_CACHED_STATES = 500_000  # distinct node states remembered; beyond it the caches restart
MAX_TASK_SHAPES = 100_000
WEIGHTINGS = ("tasks", "gpu_milli")


class WorkloadDistribution:
    """The target workload: task types and their counts (integers)."""

    def __init__(self, demands, weighting: str = "tasks"):
        tasks = Counter((d.cpu_milli, d.gpu_count, d.gpu_milli_each, d.gpu_models) for d in demands)
        if not tasks:
            raise ShareError("a target workload needs at least one task")
        self._weigh(tasks, weighting)

    def _weigh(self, tasks: Counter, weighting: str) -> None:
        if weighting not in WEIGHTINGS:
            raise ShareError("unknown workload weighting %r (known: %s)" % (weighting, ", ".join(WEIGHTINGS)))
        self.task_counts = tasks
        self.weighting = weighting
        # "tasks": each task counts 1 (the paper). "gpu_milli": each counts its GPU milli, so the
        # measure is the fragment a unit of future GPU demand sees; CPU-only types weigh 0 (their
        # fragment is all free GPU milli wherever they go, so they never sway a choice anyway).
        counts = {key: n * (1 if weighting == "tasks" else key[1] * key[2]) for key, n in tasks.items()}
        counts = {key: w for key, w in counts.items() if w}
        self.type_counts = dict(sorted(counts.items(), key=lambda kv: (kv[0][:3], sorted(kv[0][3]))))
        self.total_count = sum(counts.values())
        self._tables: dict[str, list[tuple[int, int, list[int], list[int]]]] = {}
        self._fragment_cache: dict[tuple, int] = {}

    def reweighted(self, weighting: str) -> "WorkloadDistribution":
        """The same task types under another weighting."""
        if weighting == self.weighting:
            return self
        other = WorkloadDistribution.__new__(WorkloadDistribution)
        other._weigh(self.task_counts, weighting)
        return other

    def _table(self, model: str):
        """Per GPU shape (count, milli each) usable on ``model``: the task types' CPU asks,
        ascending, and the running count of types asking at most that much CPU."""
        table = self._tables.get(model)
        if table is None:
            by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for (cpu, count, milli, models), n in self.type_counts.items():
                if count == 0 or (models and model not in models):
                    continue  # these types can use none of the node's GPUs: all free milli is fragment
                by_shape.setdefault((count, milli), []).append((cpu, n))
            table = []
            for (count, milli), asks in sorted(by_shape.items()):
                asks.sort()
                cpus, running, total = [], [], 0
                for cpu, n in asks:
                    total += n
                    cpus.append(cpu)
                    running.append(total)
                table.append((count, milli, cpus, running))
            self._tables[model] = table
        return table

    def fragment_weighted(self, model: str, cpu_milli_free: int, gpu_milli_free_sorted: tuple[int, ...]) -> int:
        """``total_count * F_n``: the node's expected fragment in GPU milli, times the
        workload's task count (an exact integer)."""
        key = (model, cpu_milli_free, gpu_milli_free_sorted)
        cached = self._fragment_cache.get(key)
        if cached is not None:
            return cached
        free_total = sum(gpu_milli_free_sorted)
        weighted = free_total * self.total_count
        if free_total:
            for count, milli, cpus, running in self._table(model):
                usable = 0
                fragment = 0
                for free in gpu_milli_free_sorted:
                    if free >= milli:
                        usable += 1
                    else:
                        fragment += free
                if usable < count:
                    continue
                fits_cpu = bisect_right(cpus, cpu_milli_free)
                if fits_cpu:
                    weighted -= running[fits_cpu - 1] * (free_total - fragment)
        if len(self._fragment_cache) >= MAX_CACHED_STATES:
            self._fragment_cache.clear()
        self._fragment_cache[key] = weighted
        return weighted

    def node_fragment_milli(self, node: NodeShares) -> float:
        if not self.total_count:
            return 0.0
        return self.fragment_weighted(node.model, node.cpu_milli_free,
                                      tuple(sorted(node.gpu_milli_free))) / self.total_count


def _gpu_options(node: NodeShares, demand: TaskDemand) -> list[int]:
    """The distinct free-milli values of the GPUs a share could go on (ascending), or
    [MILLI_PER_GPU] for whole GPUs, [] for none: GPUs with equal free milli are
    interchangeable for every score."""
    if demand.gpu_count == 0:
        return []
    if demand.is_fractional:
        return sorted({free for free in node.gpu_milli_free if free >= demand.gpu_milli_each})
    return [MILLI_PER_GPU]


def _after(node: NodeShares, demand: TaskDemand, option: int | None) -> tuple[int, tuple[int, ...]]:
    """(cpu free, sorted GPU free) after placing ``demand`` with ``option`` on ``node``."""
    frees = sorted(node.gpu_milli_free)
    if demand.gpu_count:
        taken = 0
        for i, free in enumerate(frees):
            if free == option and taken < demand.gpu_count:
                frees[i] = free - demand.gpu_milli_each
                taken += 1
    return node.cpu_milli_free - demand.cpu_milli, tuple(sorted(frees))


class PackingPolicy:
    """Base: ``score`` returns (score, GPU option) for a node the demand fits on, lower
    score better; the cluster takes the best, and among equal scores a seeded random
    node (``random_ties``, as Kubernetes' scheduler does) or the lowest node index."""

    name = "abstract"
    random_ties = True
    random_gpu = False  # choose the GPU at random among those that fit, after the node

    def bind(self, cluster: "PackingCluster") -> None:
        """Called once with the cluster (policies that normalise by its largest node)."""

    def score(self, node: NodeShares, demand: TaskDemand):
        raise NotImplementedError


class RandomFit(PackingPolicy):
    """Any node the task fits on, any GPU there, uniformly at random."""

    name = "random-fit"
    random_gpu = True

    def score(self, node, demand):
        return 0, None


class BestFit(PackingPolicy):
    """The node left with the least free CPU and GPU, each over the cluster's largest
    node's, weighted equally; on it the fullest GPU a share fits on."""

    name = "best-fit"

    def bind(self, cluster):
        self.cpu_scale = max(1, max(n.cpu_milli_total for n in cluster.nodes))
        self.gpu_scale = max(1, max(n.gpu_count for n in cluster.nodes) * MILLI_PER_GPU)

    def score(self, node, demand):
        options = _gpu_options(node, demand)
        cpu_left = node.cpu_milli_free - demand.cpu_milli
        gpu_left = node.gpu_milli_free_total - demand.gpu_milli_total
        # integer form of 0.5 * cpu_left / cpu_scale + 0.5 * gpu_left / gpu_scale
        return cpu_left * self.gpu_scale + gpu_left * self.cpu_scale, (options[0] if options else None)


class DotProduct(PackingPolicy):
    """Tetris' alignment, used for packing: the node whose free (CPU, GPU) vector, over
    its own capacity, has the least dot product with the task's demand over the same
    capacity; a share goes to the fullest GPU it fits on (the GPU term is that GPU's)."""

    name = "dot-product"

    def score(self, node, demand):
        options = _gpu_options(node, demand)
        cpu_term = (demand.cpu_milli / max(1, node.cpu_milli_total)) * \
            (node.cpu_milli_free / max(1, node.cpu_milli_total))
        if demand.gpu_count == 0:
            return cpu_term, None
        if demand.is_fractional:
            gpu_term = (demand.gpu_milli_each / MILLI_PER_GPU) * (options[0] / MILLI_PER_GPU)
        else:
            gpus = node.gpu_count
            gpu_term = (demand.gpu_count / gpus) * (node.whole_gpus_free() / gpus)
        return cpu_term + gpu_term, options[0]


class FragmentationGradient(PackingPolicy):
    """FGD: the node and GPU whose expected fragmentation grows least (the paper's
    policy; ties broken at random among nodes, on a node by the fuller GPU)."""

    name = "fgd"

    def __init__(self, workload: WorkloadDistribution):
        self.workload = workload

    def growth(self, node: NodeShares, demand: TaskDemand):
        """(growth of ``total_count * F_n``, GPU option) for the best option on ``node``."""
        best = None
        for option in _gpu_options(node, demand) or [None]:
            growth = self.growth_at(node, demand, option)
            if best is None or growth < best[0]:
                best = (growth, option)
        return best

    def growth_at(self, node: NodeShares, demand: TaskDemand, option: int | None) -> int:
        """The growth of ``total_count * F_n`` when ``demand`` goes on a GPU with ``option``
        milli free (MILLI_PER_GPU for whole GPUs, None for none): the mesh's ``pack``
        strategy scores a bid's own GPU choice with it (protocol/pack_scoring.py)."""
        fragment = self.workload.fragment_weighted
        before = fragment(node.model, node.cpu_milli_free, tuple(sorted(node.gpu_milli_free)))
        cpu_after, gpus_after = _after(node, demand, option)
        return fragment(node.model, cpu_after, gpus_after) - before

    def score(self, node, demand):
        return self.growth(node, demand)


class FragmentationGradientPacked(FragmentationGradient):
    """Ours (``pack``), FGD with two changes (SPEC.md 7, "GPU shares and packing"):

    1. the target workload weighs each task type by the GPU milli it asks for, not 1
       per task: an 8-GPU task is 8000 units of future demand, a 0.1-GPU share 100, so
       keeping room for the large tasks (the ones a fragmented cluster fails first)
       counts in proportion to the GPUs they would use;
    2. among placements that grow that fragmentation equally, the one that keeps whole
       GPUs and whole nodes free: the node left with the fewest free GPU milli (fill a
       started node before opening a fresh one), then the fewest free CPU milli;
       remaining ties go to the lowest node index (no randomness: a validator
       recomputes the same choice)."""

    name = "pack"
    random_ties = False

    def __init__(self, workload: WorkloadDistribution):
        super().__init__(workload.reweighted("gpu_milli"))

    def score(self, node, demand):
        growth, option = self.growth(node, demand)
        return self._key(growth, node, demand), option

    def score_at(self, node: NodeShares, demand: TaskDemand, option: int | None) -> tuple[int, int, int]:
        """The score of one given GPU option (a bid names its GPU; validators score that one)."""
        return self._key(self.growth_at(node, demand, option), node, demand)

    @staticmethod
    def _key(growth: int, node: NodeShares, demand: TaskDemand) -> tuple[int, int, int]:
        gpu_left = node.gpu_milli_free_total - demand.gpu_milli_total
        cpu_left = node.cpu_milli_free - demand.cpu_milli
        return growth, gpu_left, cpu_left


def make_policy(name: str, workload: WorkloadDistribution) -> PackingPolicy:
    if name == RandomFit.name:
        return RandomFit()
    if name == BestFit.name:
        return BestFit()
    if name == DotProduct.name:
        return DotProduct()
    if name == FragmentationGradient.name:
        return FragmentationGradient(workload)
    if name == FragmentationGradientPacked.name:
        return FragmentationGradientPacked(workload)
    raise ShareError("unknown packing policy %r (known: %s)" % (name, ", ".join(POLICY_NAMES)))


POLICY_NAMES = (RandomFit.name, BestFit.name, DotProduct.name, FragmentationGradient.name,
                FragmentationGradientPacked.name)


class PackingCluster:
    """Nodes, their allocations, and one policy placing tasks on them.

    Nodes in equal states (``NodeShares.state_key``) are grouped; a task is scored once
    per group and the score cached per (group state, task shape) until the cache is
    restarted, so a placement costs one dictionary lookup per distinct node state."""

    def __init__(self, nodes: list[NodeShares], policy: PackingPolicy, seed: int = 0):
        if len({n.name for n in nodes}) != len(nodes):
            raise ShareError("node names must be unique")
        self.nodes = nodes
        self.policy = policy
        self.rng = random.Random(seed)
        self.gpu_milli_capacity = sum(n.gpu_count for n in nodes) * MILLI_PER_GPU
        self.gpu_milli_allocated = sum(n.gpu_count * MILLI_PER_GPU - n.gpu_milli_free_total for n in nodes)
        self._task_node: dict[object, int] = {}
        self._shape_ids: dict[TaskDemand, int] = {}
        policy.bind(self)
        self._restart_caches()

    def _restart_caches(self) -> None:
        self._state_ids: dict[tuple, int] = {}
        self._node_state: list[int] = []
        self._groups: dict[int, list[int]] = {}  # state id -> node indices in that state, ascending
        self._scores: dict[int, dict[int, object]] = {}  # shape id -> state id -> (score, option) or None
        for index, node in enumerate(self.nodes):
            state = self._state_id(node)
            self._node_state.append(state)
            self._groups.setdefault(state, []).append(index)

    def _state_id(self, node: NodeShares) -> int:
        key = node.state_key()
        state = self._state_ids.get(key)
        if state is None:
            state = self._state_ids[key] = len(self._state_ids)
        return state

    def _moved(self, index: int) -> None:
        """Node ``index`` changed: regroup it."""
        old = self._node_state[index]
        members = self._groups[old]
        members.remove(index)
        if not members:
            del self._groups[old]
        if len(self._state_ids) >= MAX_CACHED_STATES:
            self._restart_caches()
            return
        new = self._state_id(self.nodes[index])
        self._node_state[index] = new
        group = self._groups.setdefault(new, [])
        group.append(index)
        group.sort()

    def choose(self, demand: TaskDemand, allowed=None) -> tuple[int, tuple[int, ...]] | None:
        """(node index, GPUs) the policy picks for ``demand``, or None if it fits nowhere.
        ``allowed(node index) -> bool``: only those nodes (a reservation holds the others, Q5)."""
        shape = self._shape_ids.get(demand)
        if shape is None:
            if len(self._shape_ids) >= MAX_TASK_SHAPES:
                self._shape_ids.clear()
                self._scores.clear()
            shape = self._shape_ids[demand] = len(self._shape_ids)
        scores = self._scores.setdefault(shape, {})
        best = None
        best_states: list[int] = []
        policy = self.policy
        nodes = self.nodes
        groups = self._groups
        if allowed is not None:
            groups = {state: kept for state, members in groups.items()
                      if (kept := [index for index in members if allowed(index)])}
        for state, members in groups.items():
            scored = scores.get(state, False)
            if scored is False:
                node = nodes[members[0]]
                scored = policy.score(node, demand) if node.fits(demand) else None
                scores[state] = scored
            if scored is None:
                continue
            value = scored[0]
            if best is None or value < best:
                best, best_states = value, [state]
            elif value == best:
                best_states.append(state)
        if best is None:
            return None
        if policy.random_ties:
            candidates = sorted(i for state in best_states for i in groups[state])
            index = candidates[self.rng.randrange(len(candidates))]
        else:
            index = min(groups[state][0] for state in best_states)
        node = nodes[index]
        if policy.random_gpu and demand.gpu_count:
            fitting = [i for i, free in enumerate(node.gpu_milli_free) if free >= demand.gpu_milli_each]
            if demand.is_fractional:
                return index, (fitting[self.rng.randrange(len(fitting))],)
            return index, tuple(sorted(self.rng.sample(
                [i for i in fitting if node.gpu_milli_free[i] == MILLI_PER_GPU], demand.gpu_count)))
        return index, node.default_gpus(demand, scores[self._node_state[index]][1])

    def place(self, task_id: object, demand: TaskDemand, allowed=None) -> tuple[int, Allocation] | None:
        """Place ``demand`` where the policy chooses (among the ``allowed`` nodes, as ``choose``);
        None (and nothing changes) if it fits nowhere."""
        if task_id in self._task_node:
            raise ShareError("task %r is already placed" % (task_id,))
        choice = self.choose(demand, allowed)
        if choice is None:
            return None
        index, gpus = choice
        allocation = self.nodes[index].allocate(task_id, demand, gpus)
        self._task_node[task_id] = index
        self.gpu_milli_allocated += demand.gpu_milli_total
        self._moved(index)
        return index, allocation

    def is_placed(self, task_id: object) -> bool:
        return task_id in self._task_node

    def node_of(self, task_id: object) -> int:
        """The index of the node holding ``task_id``."""
        return self._task_node[task_id]

    def release(self, task_id: object) -> Allocation:
        index = self._task_node.pop(task_id, None)
        if index is None:
            raise ShareError("task %r is not placed" % (task_id,))
        allocation = self.nodes[index].free(task_id)
        self.gpu_milli_allocated -= allocation.gpu_milli_each * len(allocation.gpus)
        self._moved(index)
        return allocation

    def fragment_milli(self, workload: WorkloadDistribution) -> float:
        """The cluster's expected fragment (GPU milli) for ``workload``."""
        return sum(workload.fragment_weighted(n.model, n.cpu_milli_free, tuple(sorted(n.gpu_milli_free)))
                   for n in self.nodes) / workload.total_count

    def fragmentation_rate(self, workload: WorkloadDistribution) -> float:
        """The share of the free GPU milli the workload cannot use (0 when none is free)."""
        free = self.gpu_milli_capacity - self.gpu_milli_allocated
        return self.fragment_milli(workload) / free if free else 0.0
