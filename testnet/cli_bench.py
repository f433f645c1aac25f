"""`meshnode bench`: benchmarks on a real local testnet (DESIGN.md "What is measured").

Each subcommand starts its own testnet, measures, always tears it down, and prints
ONE JSON object (the numbers BENCHMARKS.md records, with the machine they ran on).
"""

from __future__ import annotations

import json
import signal
import sys

from meshnode.cli.output import examples


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="measure placement and failover on a local testnet", epilog=examples(
        "meshnode bench consensus --nodes 4 --jobs 200 --concurrency 16 --json",
        "meshnode bench failover --nodes 5 --kills 30 --json",
        "meshnode bench move --nodes 4 --moves 20 --json",
        "meshnode bench preempt --rounds 10 --json",
        "meshnode bench gang --nodes 6 --workers 4 --kills 20 --seed 1 --json"))
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    sub.required = True

    consensus = sub.add_parser("consensus", help="placement latency (submit -> certificate at every node) "
                                                 "and throughput", epilog=examples(
        "meshnode bench consensus --nodes 4 --jobs 200 --concurrency 16 --json",
        "meshnode bench consensus --nodes 16 --jobs 50 --heartbeat-ms 200 --json   # a larger mesh on few cores"))
    consensus.add_argument("--nodes", type=int, default=4, metavar="N", help="testnet nodes (default 4)")
    consensus.add_argument("--jobs", type=int, default=200, metavar="N", help="jobs to place (default 200)")
    consensus.add_argument("--concurrency", type=int, default=1, help="submissions in flight")
    consensus.add_argument("--heartbeat-ms", type=int, default=None, metavar="MS",
                           help="genesis heartbeat period (detection bound scales with it; default 50)")
    consensus.add_argument("--slot-ms", type=int, default=0, metavar="MS",
                           help="genesis placement_slot_ms: batch first placements per MS window (SPEC.md P7)")
    consensus.add_argument("--bid-sample", type=int, default=0, metavar="K",
                           help="genesis bid_sample: about K members bid per job (SPEC.md 5.6; default 0: all)")
    _common(consensus)
    consensus.set_defaults(func=cmd_consensus)

    failover = sub.add_parser("failover", help="kill -9 job primaries: detection, recovery, lost work",
                              epilog=examples(
        "meshnode bench failover --nodes 5 --kills 30 --json",
        "meshnode bench failover --soak-s 300 --pause-ms 150 --cpu-load 2 --json   # pauses: no evictions"))
    failover.add_argument("--nodes", type=int, default=5, metavar="N", help="testnet nodes (default 5)")
    failover.add_argument("--kills", type=int, default=30, metavar="N", help="primaries to SIGKILL (default 30)")
    failover.add_argument("--jobs", type=int, default=1, help="counter jobs running at once")
    failover.add_argument("--soak-s", type=float, default=None, metavar="S",
                          help="instead of kills: pause random nodes (SIGSTOP/SIGCONT) for S seconds and "
                               "count suspicions and evictions")
    failover.add_argument("--pause-ms", type=int, default=150, help="with --soak-s: length of each pause")
    failover.add_argument("--cpu-load", type=int, default=0, metavar="N",
                          help="with --soak-s: N busy-loop processes competing for the CPUs")
    failover.add_argument("--cpu-load-nice", type=int, default=10, metavar="NICE",
                          help="with --cpu-load: the busy loops' nice value (10 = how a node runs its own "
                               "workloads; 0 = as urgent as the nodes)")
    _common(failover)
    failover.set_defaults(func=cmd_failover)

    idle = sub.add_parser("idle", help="idle CPU per node process, and suspicions or evictions while idle",
                          epilog=examples(
        "meshnode bench idle --nodes 16 --seconds 60 --json",
        "meshnode bench idle --nodes 4 --seconds 60 --heartbeat-ms 100 --json"))
    idle.add_argument("--nodes", type=int, default=4, metavar="N", help="testnet nodes (default 4)")
    idle.add_argument("--seconds", type=float, default=60.0, metavar="S",
                      help="how long CPU is measured, after a 5 s warm-up (default 60)")
    idle.add_argument("--heartbeat-ms", type=int, default=None, metavar="MS",
                      help="genesis heartbeat period (detection bound scales with it; default 50)")
    idle.add_argument("--dir", default=None, metavar="DIR", help="testnet directory (default: a new temporary one)")
    idle.add_argument("--keep", action="store_true", help="keep the testnet directory (node logs)")
    idle.add_argument("--json", action="store_true", help="accepted for symmetry: the result is always one JSON object")
    idle.set_defaults(func=cmd_idle)
    telemetry = sub.add_parser("telemetry", help="read this machine's GPUs as a node does (NVML or the simulated "
                                                 "profile): readings, cost per sample, health verdicts",
                               epilog=examples(
        "meshnode bench telemetry --seconds 20 --json",
        "meshnode bench telemetry --source nvml --period-ms 100 --json   # fail unless NVML answers"))
    telemetry.add_argument("--source", choices=("auto", "nvml", "simulated"), default="auto",
                           help="auto: NVML if a GPU answers, else the simulated profile (default)")
    telemetry.add_argument("--seconds", type=float, default=10.0, metavar="S", help="how long to sample (default 10)")
    telemetry.add_argument("--period-ms", type=int, default=100, metavar="MS",
                           help="time between samples (default 100)")
    telemetry.add_argument("--json", action="store_true",
                           help="accepted for symmetry: the result is always one JSON object")
    telemetry.set_defaults(func=cmd_telemetry)
    for name, what, moves, func in (
            ("move", "move a running job by its owner's request: latency, lost work, double runs (SPEC.md R2)",
             20, cmd_move),
            ("reflex", "a job's reflex rule moves it off its primary made hot: time to decide and to run again, "
                       "lost work, double runs (SPEC.md R3); then as many rounds of a serve job cloned, rerouted and decayed "
                       "(R4)", 10, cmd_reflex)):
        move = sub.add_parser(name, help=what, epilog=examples(
            "meshnode bench %s --nodes 4 --moves %d --json" % (name, moves),
            *(["meshnode bench reflex --nodes 4 --moves 3 --hold-s 300 --json   # then 5 minutes just below: "
               "false triggers"] if name == "reflex" else [])))
        move.add_argument("--nodes", type=int, default=4, metavar="N", help="testnet nodes (default 4)")
        move.add_argument("--moves", type=int, default=moves, metavar="N",
                          help="moves of the running job (default %d)" % moves)
        if name == "reflex":
            move.add_argument("--hold-s", type=float, default=0.0, metavar="S",
                              help="then hold every node's GPUs at 84 C, just below the rule's 85 C, for S "
                                   "seconds and count reflex moves (`false_triggers`; 300 for the issue's 5 minutes)")
        _common(move)
        move.set_defaults(func=func)
    preempt = sub.add_parser("preempt", help="a high-priority job into a full 4-node mesh: preemption, lost "
                                             "work, time to place, resume (SPEC.md P8)", epilog=examples(
        "meshnode bench preempt --rounds 10 --json"))
    preempt.add_argument("--rounds", type=int, default=10, metavar="N",
                         help="high-priority jobs submitted one after another (default 10)")
    _common(preempt)
    preempt.set_defaults(func=cmd_preempt)

    gang = sub.add_parser("gang", help="kill -9 the nodes of a gang's ranks: recovery without teardown, lost "
                                       "work, healthy workers restarted, gangs lost (SPEC.md GA4, GA5)",
                          epilog=examples("meshnode bench gang --nodes 6 --workers 4 --kills 20 --seed 1 --json"))
    gang.add_argument("--nodes", type=int, default=6, metavar="N", help="testnet nodes (default 6)")
    gang.add_argument("--workers", type=int, default=4, metavar="N", help="ranks of the allreduce gang (default 4)")
    gang.add_argument("--kills", type=int, default=20, metavar="N", help="rank nodes to SIGKILL (default 20)")
    _common(gang)
    gang.set_defaults(func=cmd_gang)

    hostile = sub.add_parser("hostile", help="hostile peers against a node of a running testnet: connect/close "
                                             "churn, stalled half frames; can a member still connect",
                             epilog=examples("meshnode testnet up --nodes 4 --dir net",
                                             "meshnode bench hostile --dir net --node 0 --json"))
    hostile.add_argument("--dir", required=True, metavar="DIR", help="a testnet started by `meshnode testnet up`")
    hostile.add_argument("--node", type=int, default=0, metavar="N", help="the node attacked (default 0)")
    hostile.add_argument("--cycles", type=int, default=1000, help="inbound connections opened and closed")
    hostile.add_argument("--clients", type=int, default=4, help="attacking hosts side by side for the churn")
    hostile.add_argument("--stalled", type=int, default=30, help="peers that stall half-way through a 1 MiB frame")
    hostile.add_argument("--holders", type=int, default=200, help="peers that hold a stream open and trickle frames")
    hostile.add_argument("--hold-s", type=float, default=30.0, metavar="S", help="how long the holders hold (and "
                                                                                 "the quiet period measured before)")
    hostile.add_argument("--seed", type=int, default=None, help="seed for the attackers' keys")
    hostile.add_argument("--json", action="store_true",
                         help="accepted for symmetry: the result is always one JSON object")
    hostile.set_defaults(func=cmd_hostile)


def _common(parser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="seed for nonces and kill moments")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="testnet directory (default: a new temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the testnet directory (node logs)")
    parser.add_argument("--json", action="store_true",
                        help="accepted for symmetry: the result is always one JSON object")


def _interrupt_on_sigterm() -> None:
    """SIGTERM (e.g. from `timeout`) ends the run like Ctrl-C, so the testnet is torn down."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt("signal %d" % signum)
    signal.signal(signal.SIGTERM, interrupt)


def _print(result: dict) -> None:
    json.dump(result, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


def cmd_consensus(args) -> int:
    from testnet.bench_consensus import run_consensus_bench
    _interrupt_on_sigterm()
    result = run_consensus_bench(args.nodes, args.jobs, args.concurrency, root=args.dir, keep=args.keep,
                                 seed=args.seed, heartbeat_ms=args.heartbeat_ms, slot_ms=args.slot_ms,
                                 bid_sample=args.bid_sample)
    _print(result)
    return 0 if result["undecided"] == 0 and result["refused"] == 0 else 1


def cmd_failover(args) -> int:
    from testnet.bench_failover import run_failover_bench
    _interrupt_on_sigterm()
    if args.soak_s is not None:
        from testnet.bench_soak import run_soak_bench
        result = run_soak_bench(args.nodes, args.soak_s, args.pause_ms, args.cpu_load, jobs=args.jobs,
                                root=args.dir, keep=args.keep, seed=args.seed, cpu_load_nice=args.cpu_load_nice)
        _print(result)
        return 0 if result["evictions"] == 0 and result["double_runs"] == 0 else 1
    result = run_failover_bench(args.nodes, args.kills, jobs=args.jobs, root=args.dir, keep=args.keep,
                                seed=args.seed)
    _print(result)
    clean = result["lost_workloads"] == 0 and result["double_runs"] == 0 and result["aborted"] is None
    return 0 if clean else 1


def cmd_idle(args) -> int:
    from testnet.bench_idle import run_idle_bench
    _interrupt_on_sigterm()
    result = run_idle_bench(args.nodes, args.seconds, root=args.dir, keep=args.keep,
                            heartbeat_ms=args.heartbeat_ms)
    _print(result)
    return 0 if result["evictions"] == 0 else 1


def cmd_telemetry(args) -> int:
    from testnet.bench_telemetry import run_telemetry_bench
    result = run_telemetry_bench(args.source, args.seconds, args.period_ms)
    _print(result)
    return 0 if result["read_errors"] == 0 else 1


def cmd_move(args) -> int:
    from testnet.bench_move import run_move_bench
    return _moved_cleanly(run_move_bench, args)


def cmd_reflex(args) -> int:
    from functools import partial
    from testnet.bench_reflex import run_reflex_bench
    return _moved_cleanly(partial(run_reflex_bench, hold_s=args.hold_s), args)


def _moved_cleanly(bench, args) -> int:
    """Run a move bench (owner moves or reflexes); exit 1 unless every move happened cleanly."""
    _interrupt_on_sigterm()
    result = bench(args.nodes, args.moves, root=args.dir, keep=args.keep, seed=args.seed)
    _print(result)
    clean = (result["not_moved"] == 0 and result["lost_workloads"] == 0 and result["double_runs"] == 0
             and result["aborted"] is None and not result.get("false_triggers"))
    return 0 if clean else 1


def cmd_preempt(args) -> int:
    from testnet.bench_preempt import run_preempt_bench
    _interrupt_on_sigterm()
    result = run_preempt_bench(args.rounds, root=args.dir, keep=args.keep, seed=args.seed)
    _print(result)
    clean = (result["aborted"] is None and result["double_runs"] == 0
             and result["resumed"] == result["preemptions"] == result["rounds"])
    return 0 if clean else 1


def cmd_gang(args) -> int:
    from testnet.bench_gang import run_gang_bench
    _interrupt_on_sigterm()
    result = run_gang_bench(args.nodes, args.workers, args.kills, root=args.dir, keep=args.keep, seed=args.seed)
    _print(result)
    clean = (result["aborted"] is None and result["healthy_restarted"] == 0 and result["gangs_lost"] == 0
             and result["double_runs"] == 0)
    return 0 if clean else 1


def cmd_hostile(args) -> int:
    from keys.errors import ConfigError
    from testnet.bench_hostile import run_hostile_bench
    for name in ("cycles", "clients", "stalled", "holders", "hold_s"):
        if getattr(args, name) < (1 if name == "clients" else 0):
            raise ConfigError("--%s must be %s" % (name.replace("_", "-"), "at least 1" if name == "clients" else "0 or more"))
    result = run_hostile_bench(args.dir, args.node, args.cycles, args.stalled, args.clients, args.holders, args.hold_s,
                               seed=args.seed)
    _print(result)
    ok = result["node_alive"] and all(result[k]["dialled_in"] for k in ("member_after_churn", "member_after_stall",
                                                                         "member_after_hold"))
    return 0 if ok else 1
