"""The ``pack`` placement strategy over signed bids (SPEC.md P4c): the same fragmentation
score ``meshnode replay`` places the Alibaba trace with (protocol/packing.py, policy
``pack``), computed from each bid's signed capability vector and the GPUs it reserves,
so the leader and every validator rank the bids alike.

The mesh has no trace to learn its future workload from, so the target workload is fixed
(SPEC.md P4c): shares of a quarter and a half GPU and 1, 2, 4 and 8 whole GPUs, CPU-free,
each weighed by the GPU milli it asks for. A placement that leaves free milli only in
pieces none of those can use scores worse, so shares fill started GPUs and whole GPUs and
whole nodes stay free for the jobs that need them.
"""

from __future__ import annotations

from protocol.gpu_shares import MILLI_PER_GPU, NodeShares, TaskDemand
from protocol.ledger import demand_of
from protocol.messages import CapabilityVector, Resources
from protocol.packing import FragmentationGradientPacked, WorkloadDistribution

# (GPU count, milli each) of the reference task types, one task each before weighting.
REFERENCE_TASK_TYPES = ((1, 250), (1, 500), (1, MILLI_PER_GPU), (2, MILLI_PER_GPU), (4, MILLI_PER_GPU),
                        (8, MILLI_PER_GPU))
MESH_WORKLOAD = WorkloadDistribution([TaskDemand(0, 0, count, milli) for count, milli in REFERENCE_TASK_TYPES],
                                     weighting="gpu_milli")
PACK_POLICY = FragmentationGradientPacked(MESH_WORKLOAD)


def gpu_milli_free_map(capability: CapabilityVector) -> dict[int, int]:
    """Free thousandths per GPU index, as the vector signs them (SPEC.md P1); a vector with
    no ``gpu_milli_free`` states whole GPUs only: 1000 for those in ``gpus_free``, else 0."""
    if capability.gpu_milli_free:
        return dict(enumerate(capability.gpu_milli_free))
    whole = set(capability.gpus_free)
    return {g.index: MILLI_PER_GPU if g.index in whole else 0 for g in capability.gpus}


def shares_view(capability: CapabilityVector, healthy: set[int]) -> NodeShares:
    """The node as the accounting sees it, from its signed vector: one entry per GPU in
    ``gpus`` (indices 0..G-1), an unhealthy GPU's free milli counted as 0 (no capacity)."""
    free = gpu_milli_free_map(capability)
    count = max((g.index + 1 for g in capability.gpus), default=0)
    node = NodeShares("bid", "", count, max(0, capability.cpu_milli_free), max(0, capability.mem_mib_free))
    node.gpu_milli_free = [free.get(i, 0) if i in healthy else 0 for i in range(count)]
    return node


def pack_share_gpu(resources: Resources, capability: CapabilityVector, healthy: set[int],
                   candidates: list[int]) -> int | None:
    """The GPU a node bidding for a ``pack`` share reserves, among ``candidates`` (the GPUs
    that fit it): the one replay's pack policy would pick, least score, then the least free
    milli, then the lowest index (SPEC.md P4c). None without candidates."""
    node = shares_view(capability, healthy)
    demand = demand_of(resources)
    scored = [(PACK_POLICY.score_at(node, demand, node.gpu_milli_free[i]), node.gpu_milli_free[i], i)
              for i in candidates if 0 <= i < node.gpu_count]
    return min(scored)[2] if scored else None


def pack_score(resources: Resources, capability: CapabilityVector, healthy: set[int],
               reserved_gpus: tuple) -> tuple[int, int, int]:
    """(fragmentation growth, GPU milli free after, CPU milli free after) of placing the job
    on the GPUs the bid reserves; smaller is better. Only called for bids that passed the
    capability check (their reserved GPUs fit)."""
    node = shares_view(capability, healthy)
    demand = demand_of(resources)
    if not demand.gpu_count:
        option = None
    elif demand.is_fractional:
        index = reserved_gpus[0]
        option = node.gpu_milli_free[index] if 0 <= index < node.gpu_count else demand.gpu_milli_each
    else:
        option = MILLI_PER_GPU
    return PACK_POLICY.score_at(node, demand, option)
