"""A slice of the trace through the simulated mesh (consensus on), against the replay's
prediction: does the mesh decide what `meshnode replay` predicts for policy ``pack``?

The simulator's world (identities, stakes, zones) is drawn from the seed as usual; then
its N nodes take the shapes of N trace nodes (GPUs of the node's model, CPU, memory; no
owner restriction) and its jobs become the slice's tasks, strategy ``pack``, submitted one
every ``gap_ms`` in trace order, so each is decided before the next arrives. The
prediction places the same demands in the same order with the mesh's own pack policy
(protocol/pack_scoring.py: the fixed reference workload of SPEC.md P4c, not the trace's
distribution that `replay --policy pack` learns). Exact agreement is not promised: among
equally scored nodes the replay takes the lowest index and the mesh its own tie-break over
bids, and GPU choice within a node may differ; so this reports both per-job node agreement
agreement up to nodes of one shape, and whether the multiset of node states (each node's model and per-GPU held milli) agrees.

Trace tasks that allow several GPU models but not all are skipped (a manifest names one
model) and counted.
"""

from __future__ import annotations

from dataclasses import replace

from protocol.gpu_shares import MILLI_PER_GPU, TaskDemand
from protocol.messages import Constraints, JobManifest, Resources, job_id
from protocol.pack_scoring import MESH_WORKLOAD
from protocol.packing import FragmentationGradientPacked, PackingCluster
from protocol.messages.wire import encode_message
from testnet.replay import NodeSpec, TraceError, TraceTask
from testnet.sim import SimConfig, Simulation
from testnet.sim_world import ENTRYPOINTS, GENESIS_MS, GPU_MEM_MIB, JobSpec, World
from protocol.policy import LocalCapacity

DEFAULT_GAP_MS = 400


def mesh_resources(demand: TaskDemand) -> Resources | None:
    """The manifest resources of a trace demand; None when it allows several models but not all."""
    if len(demand.gpu_models) > 1:
        return None
    return Resources(gpus=demand.gpu_count, gpu_mem_mib=0, cpu_milli=demand.cpu_milli, mem_mib=demand.memory_mib,
                     gpu_milli=demand.gpu_milli_each if demand.is_fractional else 0,
                     gpu_model=next(iter(demand.gpu_models), ""))


def trace_world(world: World, nodes: list[NodeSpec], tasks: list[TraceTask], gap_ms: int) -> World:
    """``world`` with the trace nodes' shapes and the tasks as its jobs (module docstring)."""
    specs = []
    for spec, trace_node in zip(world.nodes, nodes):
        capacity = LocalCapacity(gpu_mem_total_mib=(GPU_MEM_MIB,) * trace_node.gpus, cpu_milli=trace_node.cpu_milli,
                                 mem_mib=trace_node.memory_mib, gpu_model=trace_node.model or "unknown",
                                 rail_group=spec.capacity.rail_group)
        specs.append(replace(spec, capacity=capacity, policy=replace(spec.policy, allowed_owners=None)))
    jobs = []
    mesh_id = world.mesh_id
    for number, task in enumerate(tasks):
        owner = world.owners[number % len(world.owners)]
        job = JobManifest(owner=owner.public_key, name="trace-%d" % number, nonce=number, entrypoint=ENTRYPOINTS[0],
                          args=(), resources=mesh_resources(task.demand), strategy="pack",
                          constraints=Constraints(zones=(), labels=(), attested=()), priority=0, backups=0,
                          max_retries=0, created_ms=GENESIS_MS + number, epoch=0)
        jobs.append(JobSpec(job, encode_message(owner, mesh_id, job), job_id(job), number * gap_ms))
    return replace(world, nodes=specs, jobs=jobs, byzantine=set())


def predict(nodes: list[NodeSpec], tasks: list[TraceTask]) -> PackingCluster:
    """The replay's placement of ``tasks`` in order with the mesh's pack policy."""
    cluster = PackingCluster([spec.fresh() for spec in nodes], FragmentationGradientPacked(MESH_WORKLOAD))
    for number, task in enumerate(tasks):
        cluster.place(number, task.demand)
    return cluster


def compare(nodes: list[NodeSpec], tasks: list[TraceTask], seed: int = 0, gap_ms: int = DEFAULT_GAP_MS) -> dict:
    """Run the slice through the simulator and compare with the prediction (module docstring)."""
    usable = [t for t in tasks if mesh_resources(t.demand) is not None]
    if not usable:
        raise TraceError("no task of the slice names at most one GPU model")
    if len(nodes) < 1:
        raise TraceError("the slice needs at least one node")
    config = SimConfig(nodes=len(nodes), jobs=1, seed=seed, faults=())
    sim = Simulation(config, world_transform=lambda world: trace_world(world, nodes, usable, gap_ms))
    result = sim.run()
    number_of = {spec.job_id: number for number, spec in enumerate(sim.world.jobs)}
    decided_node: dict[int, int] = {}
    decided_states = []
    for index, node in enumerate(sim.nodes):
        ledger = node.core.ledger
        for jid in ledger.allocations():
            decided_node[number_of[jid]] = index
        decided_states.append((nodes[index].model, tuple(sorted(ledger.held_gpu_milli()))))
    cluster = predict(nodes, usable)
    predicted_node = {n: cluster.node_of(n) for n in range(len(usable)) if cluster.is_placed(n)}
    predicted_states = [(n.model, tuple(sorted(MILLI_PER_GPU - free for free in n.gpu_milli_free)))
                        for n in cluster.nodes]
    both = set(decided_node) & set(predicted_node)
    return {
        "tasks": len(usable), "skipped_multi_model": len(tasks) - len(usable), "nodes": len(nodes),
        "placed_by_mesh": len(decided_node), "placed_by_replay": len(predicted_node),
        "placed_by_both": len(both), "same_node": sum(1 for n in both if decided_node[n] == predicted_node[n]),
        "same_node_shape": sum(1 for n in both if _shape(nodes[decided_node[n]]) == _shape(nodes[predicted_node[n]])),
        "only_mesh": len(set(decided_node) - both), "only_replay": len(set(predicted_node) - both),
        "node_states_agree": sorted(decided_states) == sorted(predicted_states),
        "gpu_alloc_share_mesh": _share(decided_states), "gpu_alloc_share_replay": _share(predicted_states),
        "safety_violations": result.violation_count, "virtual_ms": result.virtual_ms, "wall_s": round(result.wall_s, 2),
    }


def _shape(node: NodeSpec) -> tuple:
    """Nodes of one shape are interchangeable for placement: which one a tie goes to is a tie-break."""
    return node.model, node.gpus, node.cpu_milli, node.memory_mib


def _share(states) -> float:
    gpus = sum(len(held) for _model, held in states)
    return round(sum(sum(held) for _model, held in states) / (gpus * MILLI_PER_GPU), 4) if gpus else 0.0
