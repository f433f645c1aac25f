"""`meshnode replay`: the Alibaba GPU trace through the project's packing policies
(testnet/replay.py; SPEC.md 7, "GPU shares and packing")."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from protocol.packing import POLICY_NAMES, WorkloadDistribution
from testnet.replay import DEFAULT_CLUSTER, DEFAULT_LOAD, DEFAULT_PODS, TraceError, fill, load_cluster, load_tasks


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="replay the Alibaba GPU trace through the packing policies",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER, metavar="NODES.csv",
                        help="node list (default: the openb cluster, 1213 nodes)")
    parser.add_argument("--pods", type=Path, default=DEFAULT_PODS, metavar="PODS.csv",
                        help="task list (default: openb_pod_list_default.csv)")
    parser.add_argument("--policy", action="append", default=None, metavar="NAME",
                        help="one of %s, or 'all' (repeatable; default all)" % ", ".join(POLICY_NAMES))
    parser.add_argument("--seed", type=int, default=0, help="seed for the policies that draw (default 0)")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD,
                        help="stop once the GPU demand offered reaches LOAD x capacity (default 1.3)")
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
                   "seed": args.seed, "policies": results}
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
