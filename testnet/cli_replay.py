"""`meshnode replay`: the Alibaba GPU trace through the project's packing policies
(testnet/replay.py; SPEC.md 7, "GPU shares and packing")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshnode.cli.output import examples
from protocol.packing import POLICY_NAMES, WorkloadDistribution
from testnet.replay_mesh import compare
from testnet.replay_preemption import DEFAULT_CHECKPOINT_MS
from testnet.replay import (DEFAULT_CLUSTER, DEFAULT_LOAD, DEFAULT_PODS, TraceError, fill, load_cluster, load_tasks,
                            sample_nodes, shuffled, timed)

DEFAULT_TIMED_NODES = 6
MAX_MESH_SLICE = 2000  # tasks: the simulator runs every message of every placement
JSON_KEYS = """
--json prints one object; "policies" maps each policy to its figures:
  fill:  gpu_alloc_share, share_at_first_failure, failed, fragmentation (the FGD paper's
         rate: expected fragment / free GPU milli), fragmented_gpus, unallocated_gpus,
         tasks_offered, wall_s
  timed: started, never_started, untimed (no times: pending in the trace), unplaceable
         (fits no node even empty), preemptions, preempted_tasks, lost_work_total_s,
         wall_s, and "qos": class -> priority, preemptible, started, never_started,
         delay_p50_s, delay_p99_s (arrival to first start), preemptions (of that class's
         tasks), lost_work_p50_ms, lost_work_p99_ms, lost_work_max_ms
  --mesh-slice prints "mesh_slice": tasks, nodes, placed_by_mesh, placed_by_replay,
         placed_by_both, same_node, same_node_shape, only_mesh, only_replay,
         node_states_agree, gpu_alloc_share_mesh, gpu_alloc_share_replay,
         skipped_multi_model, safety_violations, virtual_ms, wall_s
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="replay the Alibaba GPU trace through the packing policies",
                                   description=__doc__.splitlines()[0],
                                   epilog=examples("meshnode replay --json", "meshnode replay --shuffle 3 --json",
                                                   "meshnode replay --timed --nodes 6 --policy pack --json",
                                                   "meshnode replay --timed --reservations --nodes 6 --policy pack --json",
                                                   "meshnode replay --mesh-slice 60 --nodes 4 --json")
                                   + JSON_KEYS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER, metavar="NODES.csv",
                        help="node list (default: the openb cluster, 1213 nodes)")
    parser.add_argument("--pods", type=Path, default=DEFAULT_PODS, metavar="PODS.csv",
                        help="task list (default: openb_pod_list_default.csv)")
    parser.add_argument("--policy", action="append", default=None, metavar="NAME",
                        help="one of %s, or 'all' (repeatable; default all)" % ", ".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0, help="seed for the policies that draw (default 0)")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD,
                        help="stop once the GPU demand offered reaches LOAD x capacity (default 1.3)")
    parser.add_argument("--shuffle", type=int, default=None, metavar="S",
                        help="offer the tasks in the order a seeded shuffle (seed S) gives, not file order")
    parser.add_argument("--timed", action="store_true",
                        help="replay with the trace's arrival times and durations on --nodes nodes, with "
                             "priorities from the QoS class (LS, Guaranteed 200; Burstable 100; BE 0, the only "
                             "preemptible class) and preemption by the mesh's victim rule (SPEC P8): per QoS "
                             "class, queueing delay p50/p99 and preemptions with the work each lost; needs the "
                             "qos and time columns")
    parser.add_argument("--no-preempt", action="store_true",
                        help="with --timed: queue by priority but never preempt (the baseline)")
    parser.add_argument("--reservations", action="store_true",
                        help="with --timed: a task with no room holds the nodes it waits for; others backfill "
                             "them only if they end first (declared runtime: the traced duration) or leave it "
                             "room (SPEC Q5, the mesh's own rule)")
    parser.add_argument("--checkpoint-ms", type=int, default=DEFAULT_CHECKPOINT_MS, metavar="MS",
                        help="with --timed: how often a running task checkpoints; a preempted task resumes from "
                             "its newest checkpoint and loses the work since (default %d)" % DEFAULT_CHECKPOINT_MS)
    parser.add_argument("--nodes", type=int, default=DEFAULT_TIMED_NODES, metavar="N",
                        help="with --timed or --mesh-slice: nodes drawn (seeded) from the cluster (default %d)" % DEFAULT_TIMED_NODES)
    parser.add_argument("--mesh-slice", type=int, default=None, metavar="N",
                        help="run the first N tasks on --nodes nodes through the simulated mesh (consensus on, "
                             "`meshnode sim`'s simulator) with strategy pack, and compare where the mesh placed "
                             "them with the replay's prediction (testnet/replay_mesh.py)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def policies_from(names: list[str] | None) -> list[str]:
    if not names or "all" in names:
        return list(POLICY_NAMES)
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise TraceError("unknown policy %s (known: %s, all)" % (", ".join(unknown), ", ".join(POLICY_NAMES)))
    return list(dict.fromkeys(names))


def run(args: argparse.Namespace) -> int:
    if not 0 < args.load <= 100:
        raise TraceError("--load must be in (0, 100], got %g" % args.load)
    names = policies_from(args.policy)
    nodes = load_cluster(args.cluster)
    tasks = load_tasks(args.pods)
    workload = WorkloadDistribution(t.demand for t in tasks)
    results = {}
    if args.shuffle is not None:
        if args.timed:
            raise TraceError("--shuffle reorders the fill experiment; --timed follows the trace's times")
        tasks = shuffled(tasks, args.shuffle)
    if args.reservations and not args.timed:
        raise TraceError("--reservations holds capacity over time: use it with --timed")
    if args.checkpoint_ms < 1:
        raise TraceError("--checkpoint-ms must be >= 1, got %d" % args.checkpoint_ms)
    if args.mesh_slice is not None:
        if args.timed or args.shuffle is not None:
            raise TraceError("--mesh-slice takes the first N tasks in trace order; not with --timed or --shuffle")
        if not 1 <= args.mesh_slice <= min(len(tasks), MAX_MESH_SLICE):
            raise TraceError("--mesh-slice must be in 1..%d, got %d" % (min(len(tasks), MAX_MESH_SLICE),
                                                                        args.mesh_slice))
        return run_mesh_slice(args, sample_nodes(nodes, args.nodes, args.seed), tasks[:args.mesh_slice])
    if args.timed:
        return run_timed(args, names, sample_nodes(nodes, args.nodes, args.seed), tasks, workload)
    for name in names:
        results[name] = fill(nodes, tasks, name, seed=args.seed, load=args.load, workload=workload)
        if not args.json:
            r = results[name]
            print("%-12s alloc %.4f  at first failure %-6s  failed %5d  frag %.4f  %6.1f s"
                  % (name, r["gpu_alloc_share"], r["share_at_first_failure"], r["failed"], r["fragmentation"],
                     r["wall_s"]), flush=True)
    if args.json:
        summary = {"cluster": str(args.cluster), "pods": str(args.pods), "nodes": len(nodes),
                   "gpus": sum(n.gpus for n in nodes), "tasks": len(tasks), "load": args.load,
                   "seed": args.seed, "shuffle": args.shuffle, "policies": results}
        json.dump(summary, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    return 0


def run_mesh_slice(args, nodes, tasks) -> int:
    result = compare(nodes, tasks, seed=args.seed)
    if args.json:
        json.dump({"cluster": str(args.cluster), "pods": str(args.pods), "seed": args.seed, "mesh_slice": result},
                  sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        print("%d tasks on %d nodes: mesh placed %d, replay %d; same node %d, same node shape %d; node states %s; "
              "GPU share mesh %.4f replay %.4f; %d safety violations; %.1f s"
              % (result["tasks"], result["nodes"], result["placed_by_mesh"], result["placed_by_replay"],
                 result["same_node"], result["same_node_shape"],
                 "agree" if result["node_states_agree"] else "DIFFER", result["gpu_alloc_share_mesh"],
                 result["gpu_alloc_share_replay"], result["safety_violations"], result["wall_s"]))
    return 0


def run_timed(args, names, nodes, tasks, workload) -> int:
    results = {}
    for name in names:
        results[name] = r = timed(nodes, tasks, name, seed=args.seed, workload=workload,
                                  preempt=not args.no_preempt, checkpoint_ms=args.checkpoint_ms,
                                  reservations=args.reservations)
        if not args.json:
            by_class = "  ".join("%s p50 %s s p99 %s s (%d waiting, %d preempted)"
                                 % (q, c["delay_p50_s"], c["delay_p99_s"], c["never_started"], c["preemptions"])
                                 for q, c in r["qos"].items())
            print("%-12s started %5d  %s  %6.1f s" % (name, r["started"], by_class, r["wall_s"]), flush=True)
    if args.json:
        summary = {"cluster": str(args.cluster), "pods": str(args.pods), "timed": True, "nodes": len(nodes),
                   "gpus": sum(n.gpus for n in nodes), "tasks": len(tasks), "seed": args.seed,
                   "preempt": not args.no_preempt, "checkpoint_ms": args.checkpoint_ms,
                   "reservations": args.reservations,
                   "policies": results}
        json.dump(summary, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":  # `python -m testnet.cli_replay ...` from a worktree not installed in the venv
    parser = argparse.ArgumentParser(prog="meshnode")
    register(parser.add_subparsers(dest="command", required=True))
    from protocol.errors import MeshError
    try:
        parsed = parser.parse_args(["replay", *sys.argv[1:]])
        sys.exit(parsed.func(parsed))
    except MeshError as exc:
        print("meshnode: error: %s" % exc, file=sys.stderr)
        sys.exit(2)
