"""`meshnode sim`: run the deterministic simulator over one or many seeds.

Exit status 0 only when every seed passed every checker (SPEC.md section 11). Any
failing seed prints the one command line that replays it exactly. ``--driver core``
(the default) drives bare MeshCores (testnet/sim.py); ``--driver node`` runs the real
node driver with its stores and a simulated runner (testnet/sim_nodes.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from rich.console import Console
from rich.table import Table

from meshnode.cli.output import examples
from testnet import launcher
from testnet.sim import FAULTS, SimConfig, SimResult, run_simulation
from testnet.sim_nodes import NODE_FAULT_KINDS, NODE_FAULTS, NodeSimConfig, NodeSimResult, run_config
from testnet.sim_nodes import summarize as summarize_nodes

MAX_SEEDS = 1_000_000
MAX_SHOWN_VIOLATIONS = 10


def register(subparsers) -> None:
    parser = subparsers.add_parser("sim", help="run the deterministic fault-injecting simulator",
                                   description=__doc__.splitlines()[0], epilog=examples(
        "meshnode sim --nodes 7 --jobs 20 --seeds 200 --faults crash,partition,loss --byzantine 0.2 --json",
        "meshnode sim --driver node --nodes 4 --jobs 4 --seeds 50 --json    # the real node driver",
        "meshnode sim --nodes 5 --jobs 12 --seeds 20 --quota-gpus 3 --reservations --job-ms 300 --json",
        "meshnode sim --nodes 4 --jobs 6 --seeds 200 --byzantine 0.2 --reflex 0.5 --json   # reflexes (R3)",
        "meshnode sim --nodes 4 --jobs 12 --seeds 20 --preempt --job-ms 1500 --json   # priorities, preemption"))
    parser.add_argument("--driver", choices=("core", "node"), default="core",
                        help="core: MeshCores on a simulated network (default); node: the real node driver "
                             "(Node, its SQLite stores, a simulated workload runner) under a mock clock")
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (default 4)")
    parser.add_argument("--jobs", type=int, default=4, help="jobs submitted per run (default 4)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=1, help="number of consecutive seeds to run (default 1)")
    parser.add_argument("--byzantine", type=float, default=0.0, metavar="F",
                        help="Byzantine share of the stake, 0..1 (under 1/3: bound never reached; "
                             ">= 0.334: at least that much, expect stalls)")
    parser.add_argument("--faults", default=None, metavar="LIST",
                        help="comma-separated faults from %s (node driver: %s; move only when named), "
                             "or 'none' (default: all)" % (",".join(FAULTS), ",".join(NODE_FAULT_KINDS)))
    parser.add_argument("--no-heartbeats", action="store_true", help="run cores without heartbeats (scale runs)")
    parser.add_argument("--bid-sample", type=int, default=None, metavar="K",
                        help="only about K members bid per job (MeshCore bid_sample; for large meshes)")
    parser.add_argument("--slot-ms", type=int, default=0, metavar="MS",
                        help="genesis placement_slot_ms: one instance places the jobs created in each MS "
                             "window (SPEC.md P7; default 0, one instance per job)")
    parser.add_argument("--job-ms", type=int, default=0, metavar="MS",
                        help="jobs end: each run lasts a drawn time around MS, then its workload exits "
                             "(default 0: jobs run until the run ends)")
    parser.add_argument("--fail", type=float, default=0.0, metavar="F",
                        help="with --job-ms, the share of exits that fail (exit 1, the job is retried)")
    parser.add_argument("--cancel", type=float, default=0.0, metavar="F",
                        help="the share of jobs their owner cancels, at a drawn time after submitting")
    parser.add_argument("--fractional", type=float, default=0.0, metavar="P",
                        help="the share of jobs asking for a share of one GPU (resources.gpu_milli), "
                             "most with strategy pack (default 0)")
    parser.add_argument("--quota-gpus", type=int, default=0, metavar="N",
                        help="the genesis limits each owner to N GPUs in the default pool (SPEC.md 5.5, Q2; "
                             "default 0: no quotas); jobs held by it at the end are counted, not stalls; with "
                             "--preempt, preemptible jobs over it borrow and in-quota jobs reclaim (Q6), counted "
                             "as borrowed_placements, reclaims and borrowed_victims")
    parser.add_argument("--reservations", action="store_true",
                        help="genesis reservations on: waiting jobs hold capacity, others backfill (SPEC.md Q5)")
    parser.add_argument("--move", type=float, default=0.0, metavar="F",
                        help="the share of jobs their owner moves to another node (SPEC.md R2), at a drawn time "
                             "in the fault window (a refused request is retried)")
    parser.add_argument("--reflex", type=float, default=0.0, metavar="F",
                        help="the share of jobs with reflex rules: a rule that migrates them off a hot primary "
                             "(SPEC.md R3), or (every other job) replica rules that clone, reroute and decay "
                             "while hot and decay the clones away once cool (R4); nodes' GPUs run hot in drawn "
                             "spells (default 0)")
    parser.add_argument("--preempt", action="store_true",
                        help="a preemption workload: GPU jobs, more than fit, of mixed priorities, half preemptible "
                             "(SPEC.md P8; use with --job-ms so room returns)")
    parser.add_argument("--gangs", type=float, default=0.0, metavar="F",
                        help="the share of jobs that are gangs (2-3 workers or elastic 2..4, any topology)")
    parser.add_argument("--gang-kills", type=int, default=0, metavar="K",
                        help="K times (every 1.5 s from 1.5 s on) crash an honest node running a gang's rank for "
                             "1.2 s, so it is evicted and the rank replaced or the gang shrunk, and grown back once "
                             "it returns (SPEC.md GA7-GA9)")
    parser.add_argument("--workers", type=int, default=1, help="processes running seeds in parallel (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.set_defaults(func=run)


def parse_faults(text: str, known: tuple[str, ...] = FAULTS) -> tuple[str, ...]:
    if text.strip() in ("", "none"):
        return ()
    faults = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in faults if f not in known]
    if unknown:
        raise argparse.ArgumentTypeError("unknown faults %s (known: %s)" % (unknown, ",".join(known)))
    return tuple(f for f in known if f in faults)


def percentile(values: list[int], fraction_milli: int) -> int | None:
    """Nearest-rank percentile (p50: 500, p99: 990)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * fraction_milli // 1000))
    return ordered[rank - 1]


def summarize(results: list[SimResult], wall_s: float) -> dict:
    latencies = [ms for r in results for ms in r.latencies_ms]
    decisions = sum(r.decisions for r in results)
    placements = sum(r.placements for r in results)
    messages = sum(r.messages for r in results)
    failed = [r for r in results if not r.ok]
    by_check: dict[str, int] = {}
    for r in results:
        for v in r.violations:
            by_check[v.check] = by_check.get(v.check, 0) + 1
    first = results[0].config if results else None
    return {
        "seeds": len(results),
        "first_seed": first.seed if first else None,
        "nodes": first.nodes if first else None,
        "jobs": first.jobs if first else None,
        "faults": list(first.faults) if first else [],
        "violations": sum(r.violation_count for r in results),
        "violations_by_check": by_check,
        "failed_seeds": [r.config.seed for r in failed][:100],
        "stalled_seeds": sum(1 for r in results if r.liveness_missing),
        # Seeds whose newest epoch has 1/3 or more Byzantine stake (honest members evicted):
        # BFT promises no liveness there; their undecided jobs are counted, not violations.
        "liveness_unpromised_seeds": sum(1 for r in results if r.counters.get("liveness_unpromised_jobs")),
        # --quota-gpus / --reservations (SPEC.md Q2, Q5): jobs waiting by those rules at the
        # end, and the most an owner held beyond its GPU quota (concurrent placements, Q2).
        "quota_held_jobs": sum(r.counters.get("quota_held_jobs", 0) for r in results),
        "quota_overshoot_gpu_milli_max": max((r.counters.get("quota_overshoot_gpu_milli", 0) for r in results),
                                             default=0),
        # --reflex (SPEC.md R3a): of the reflex moves, those decided on a job's reported latency.
        "reflex_moves_job_signal": sum(r.counters.get("reflex_moves_job_signal", 0) for r in results),
        # The same, at any moment: the most an owner held beyond it right after an honest node
        # applied one of its placements (Q2's bound: at most (honest members - 1) x quota).
        "quota_overshoot_peak_gpu_milli_max": max((r.counters.get("quota_overshoot_peak_gpu_milli", 0)
                                                  for r in results), default=0),
        # The same by what honest nodes run (their drivers' runs, not the checker's model of
        # placements: a job cancelled before its placement applied is placed but never run).
        "quota_overshoot_running_peak_gpu_milli_max": max(
            (r.counters.get("quota_overshoot_running_peak_gpu_milli", 0) for r in results), default=0),
        # SPEC.md Q2f: the most one honest home's (or deputy's) running grants exceeded the
        # quota (a violation when above 0, but for Q2e's late cancels); the most all honest
        # homes' running grants of one owner exceeded it together, and how many homes granted.
        "quota_signer_over_peak_gpu_milli_max": max(
            (r.counters.get("quota_signer_over_peak_gpu_milli", 0) for r in results), default=0),
        "quota_honest_granted_over_peak_gpu_milli_max": max(
            (r.counters.get("quota_honest_granted_over_peak_gpu_milli", 0) for r in results), default=0),
        "quota_honest_signers_max": max((r.counters.get("quota_honest_signers_max", 0) for r in results), default=0),
        # --reflex (SPEC.md R3): reflex moves decided, over all seeds.
        "reflex_moves": sum(r.counters.get("reflex_moves", 0) for r in results),
        # --reflex (SPEC.md R4): replica actions (clone, reroute, decay, fill) decided, over all seeds.
        "replica_actions": sum(r.counters.get("replica_actions", 0) for r in results),
        # Seeds with a job placed past the base deadline but within what SPEC 11 owes it, by
        # reason (testnet/sim_liveness.py); and stalled seeds by why their jobs are late.
        "late_seeds_by_reason": _seeds_by_reason(results, "late_reasons"),
        "stalled_seeds_by_reason": _seeds_by_reason(results, "stalled_reasons"),
        "decisions": decisions,
        "messages": messages,
        "messages_per_decision": round(messages / decisions, 1) if decisions else None,
        "placements": placements,
        "preemptions": sum(r.counters.get("preemptions", 0) for r in results),
        # SPEC.md Q6 (with --quota-gpus): placements on borrowed grants, preemptions that
        # reclaimed (a victim of equal or higher priority), and victims that were borrowed.
        "borrowed_placements": sum(r.counters.get("borrowed_placements", 0) for r in results),
        "reclaims": sum(r.counters.get("reclaims", 0) for r in results),
        "borrowed_victims": sum(r.counters.get("borrowed_victims", 0) for r in results),
        "gangs": sum(r.counters.get("gangs", 0) for r in results),
        "gangs_placed": sum(r.counters.get("gangs_placed", 0) for r in results),
        "gang_kills": sum(r.counters.get("gang_kills", 0) for r in results),
        "gang_replacements": sum(r.counters.get("gang_replacements", 0) for r in results),
        "gang_resizes": sum(r.counters.get("gang_resizes", 0) for r in results),
        "gang_grows": sum(r.counters.get("gang_grows", 0) for r in results),
        "gang_ranks_restarted": sum(r.counters.get("gang_ranks_restarted", 0) for r in results),
        "messages_per_placement": round(messages / placements, 1) if placements else None,
        "latency_ms": {"p50": percentile(latencies, 500), "p99": percentile(latencies, 990)},
        "virtual_ms_max": max((r.virtual_ms for r in results), default=0),
        "byzantine_stake_max_milli": max((1000 * r.byzantine_stake[0] // r.byzantine_stake[1]
                                          for r in results), default=0),
        "wall_s": round(wall_s, 3),
        "reproduce": [r.config.reproduce() for r in failed][:10],
    }


def _seeds_by_reason(results: list[SimResult], field: str) -> dict[str, list[int]]:
    """reason -> the seeds (at most 100) with a job late for that reason."""
    seeds: dict[str, list[int]] = {}
    for r in results:
        for reason in sorted(getattr(r, field)):
            seeds.setdefault(reason, []).append(r.config.seed)
    return {reason: listed[:100] for reason, listed in sorted(seeds.items())}


def _run_seed(config: SimConfig) -> SimResult:
    return run_simulation(config)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.seeds <= MAX_SEEDS:
        raise SystemExit("meshnode sim: --seeds must be in 1..%d" % MAX_SEEDS)
    if args.driver == "node":
        if args.reflex or args.gang_kills:
            raise SystemExit("meshnode sim: --reflex and --gang-kills run with --driver core only")
        return run_node_driver(args)
    if not 0.0 <= args.byzantine < 1.0:
        raise SystemExit("meshnode sim: --byzantine must be in [0, 1)")
    if args.quota_gpus < 0:
        raise SystemExit("meshnode sim: --quota-gpus must be >= 0")
    shares = (args.fail, args.cancel, args.move, args.fractional, args.gangs, args.reflex)
    if args.gang_kills < 0:
        raise SystemExit("meshnode sim: --gang-kills must be >= 0")
    if args.job_ms < 0 or not all(0.0 <= share <= 1.0 for share in shares):
        raise SystemExit("meshnode sim: --job-ms must be >= 0, --fail, --cancel, --move, --fractional, --gangs and "
                         "--reflex in [0, 1]")
    try:
        faults = parse_faults(",".join(FAULTS) if args.faults is None else args.faults)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit("meshnode sim: %s" % exc)
    configs = [SimConfig(nodes=args.nodes, jobs=args.jobs, seed=args.seed + k,
                         byzantine_milli=round(args.byzantine * 1000), faults=faults,
                         heartbeats=not args.no_heartbeats, bid_sample=args.bid_sample, slot_ms=args.slot_ms,
                         job_ms=args.job_ms, job_fail_per_mille=round(args.fail * 1000),
                         cancel_per_mille=round(args.cancel * 1000), move_per_mille=round(args.move * 1000),
                         fractional_per_mille=round(args.fractional * 1000), quota_gpus=args.quota_gpus,
                         reservations=args.reservations, preempt=args.preempt, gang_kills=args.gang_kills,
                         gang_per_mille=round(args.gangs * 1000), reflex_per_mille=round(args.reflex * 1000))
               for k in range(args.seeds)]
    started = time.perf_counter()
    if args.workers > 1 and len(configs) > 1:
        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            results = pool.map(_run_seed, configs, chunksize=max(1, len(configs) // (args.workers * 8)))
    else:
        results = [_run_seed(c) for c in configs]
    summary = summarize(results, time.perf_counter() - started)
    failed = [r for r in results if not r.ok]
    out = sys.stderr if args.json else sys.stdout
    for result in failed[:MAX_SHOWN_VIOLATIONS]:
        for violation in result.violations[:3]:
            print("seed %d: %s" % (result.config.seed, violation.line()), file=out)
        print("reproduce with: %s" % result.config.reproduce(), file=out)
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        render(Console(), summary, results)
    return 1 if failed else 0


def render(console: Console, summary: dict, results: list[SimResult]) -> None:
    table = Table(title="meshnode sim", title_justify="left")
    for column in ("seed", "byz stake", "decisions", "msgs/decision", "p50 ms", "p99 ms", "virtual ms",
                   "violations"):
        table.add_column(column, justify="right")
    shown = results if len(results) <= 20 else [r for r in results if not r.ok][:20]
    for r in shown:
        stake, total = r.byzantine_stake
        table.add_row(str(r.config.seed), "%d/%d" % (stake, total), str(r.decisions),
                      "%.1f" % r.messages_per_decision, str(percentile(r.latencies_ms, 500)),
                      str(percentile(r.latencies_ms, 990)), str(r.virtual_ms),
                      ("[red]%d[/red]" % r.violation_count) if r.violation_count else "0")
    console.print(table)
    lat = summary["latency_ms"]
    console.print("%d seeds, %d violations (%s), %d stalled, %d decisions, %s messages/decision, "
                  "latency p50 %s ms p99 %s ms (virtual), %.2f s wall"
                  % (summary["seeds"], summary["violations"], summary["violations_by_check"] or "none",
                     summary["stalled_seeds"], summary["decisions"], summary["messages_per_decision"],
                     lat["p50"], lat["p99"], summary["wall_s"]))
    for title, key in (("placed late, within what SPEC 11 owes them", "late_seeds_by_reason"),
                       ("stalled", "stalled_seeds_by_reason")):
        for reason, seeds in summary[key].items():
            console.print("%s (%s): %d seeds %s" % (title, reason, len(seeds), " ".join(map(str, seeds[:20]))))
    if summary["liveness_unpromised_seeds"]:
        console.print("%d seeds ended in an epoch with 1/3 or more Byzantine stake (honest members "
                      "evicted): liveness is not promised there, their undecided jobs are not violations"
                      % summary["liveness_unpromised_seeds"])


# --- --driver node ------------------------------------------------------------------------------

def _run_node_seed(config: NodeSimConfig) -> NodeSimResult:
    return run_config(config)


def run_node_driver(args: argparse.Namespace) -> int:
    """``meshnode sim --driver node``: the real node driver, seed by seed (testnet/sim_nodes.py)."""
    core_only = [flag for flag, given in (("--byzantine", args.byzantine), ("--no-heartbeats", args.no_heartbeats),
                                          ("--slot-ms", args.slot_ms))
                 if given]
    if core_only:
        raise SystemExit("meshnode sim: %s apply to --driver core only" % ", ".join(core_only))
    if not 4 <= args.nodes <= launcher.MAX_NODES:
        raise SystemExit("meshnode sim: --driver node runs 4..%d nodes" % launcher.MAX_NODES)
    if not 1 <= args.jobs <= 64:
        raise SystemExit("meshnode sim: --driver node runs 1..64 jobs")
    try:
        faults = parse_faults(",".join(NODE_FAULTS) if args.faults is None else args.faults, NODE_FAULT_KINDS)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit("meshnode sim: %s" % exc)
    configs = [NodeSimConfig(nodes=args.nodes, jobs=args.jobs, seed=args.seed + k, faults=faults,
                             bid_sample=args.bid_sample or 0)   # the genesis field (SPEC.md 5.6)
               for k in range(args.seeds)]
    started = time.perf_counter()
    if args.workers > 1 and len(configs) > 1:
        with multiprocessing.get_context("fork").Pool(args.workers) as pool:
            results = pool.map(_run_node_seed, configs, chunksize=1)
    else:
        results = [_run_node_seed(c) for c in configs]
    summary = summarize_nodes(results, time.perf_counter() - started)
    if len(results) == 1:
        summary["result"] = results[0].to_json()   # one seed: its runs, episodes and verdicts in full
    failed = [r for r in results if not r.ok]
    out = sys.stderr if args.json else sys.stdout
    for result in failed[:MAX_SHOWN_VIOLATIONS]:
        for violation in result.violations[:3]:
            print("seed %d: %s" % (result.config.seed, violation.line()), file=out)
        print("reproduce with seed=%d: %s" % (result.config.seed, result.config.reproduce()), file=out)
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        render_nodes(Console(), summary, results)
    return 1 if failed else 0


def render_nodes(console: Console, summary: dict, results: list[NodeSimResult]) -> None:
    table = Table(title="meshnode sim --driver node", title_justify="left")
    for column in ("seed", "runs", "crash", "cut", "failover", "lost ms", "epoch", "virt ms", "known", "viol"):
        table.add_column(column, justify="right")
    shown = results if len(results) <= 20 else [r for r in results if not r.ok][:20]
    for r in shown:
        table.add_row(str(r.config.seed), str(len(r.runs)), str(r.counters["crashes"]), str(r.counters["partitions"]),
                      str(r.failovers), str(max(r.lost_work_ms, default=0)), str(r.final_epoch), str(r.virtual_ms),
                      str(sum(r.known_limits_count.values())),
                      ("[red]%d[/red]" % r.violation_count) if r.violation_count else "0")
    console.print(table)
    lost = summary["lost_work_ms"]
    console.print("%d seeds, %d violations (%s), %d runs, %d failovers, lost work p50 %s ms p99 %s ms max %s ms "
                  "(bound %s ms), %.2f s wall"
                  % (summary["seeds"], summary["violations"], summary["violations_by_check"] or "none",
                     summary["runs"], summary["failovers"], lost["p50"], lost["p99"], lost["max"], lost["bound"],
                     summary["wall_s"]))
    if summary["known_limits_by_check"]:
        console.print("known limits (SPEC.md 7: exits are messages, sent once) in %d seeds: %s"
                      % (summary["seeds_with_known_limits"], summary["known_limits_by_check"]))
