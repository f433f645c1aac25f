"""`meshnode testnet`: a local mesh of real node processes (on 127.0.0.1, or each in a network
namespace of its own with --netns), and fault injection."""

from __future__ import annotations

import shutil
import signal

from rich.table import Table

from meshnode.cli.output import add_json_flag, emit
from testnet import launcher


def register(subparsers) -> None:
    testnet = subparsers.add_parser("testnet", help="start, inspect, fault and stop a local testnet")
    sub = testnet.add_subparsers(dest="testnet_command", metavar="SUBCOMMAND")
    sub.required = True
    up = sub.add_parser("up", help="create and start N nodes; return once the mesh is connected")
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--owners", type=int, default=1, help="workload owner keys to create")
    up.add_argument("--no-workloads", action="store_true", help="place jobs but start no processes")
    up.add_argument("--netns", action="store_true",
                    help="each node in a network namespace of its own on a virtual bridge (root; enables partition)")
    _common(up)
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="every node's process state and connections")
    _common(status)
    status.set_defaults(func=cmd_status)
    for name, help_text in (("kill", "SIGKILL node I"), ("stop", "stop node I cleanly (SIGTERM)"),
                            ("start", "start node I again"), ("pause", "freeze node I (SIGSTOP)"),
                            ("resume", "unfreeze node I (SIGCONT)")):
        parser = sub.add_parser(name, help=help_text)
        parser.add_argument("index", type=int, metavar="I")
        _common(parser)
        parser.set_defaults(func=cmd_fault, action=name)
    add = sub.add_parser("add", help="create and start a new, not yet admitted node (then `meshnode join`)")
    add.add_argument("--stake", type=int, default=100, help="stake the testnet authority vouches for")
    _common(add)
    add.set_defaults(func=cmd_add)
    partition = sub.add_parser("partition", help="cut the network between groups of nodes (--netns testnets)")
    partition.add_argument("groups", nargs="+", metavar="I,J,...",
                           help="a group of node indices; nodes named in no group form one more group")
    _common(partition)
    partition.set_defaults(func=cmd_partition)
    heal = sub.add_parser("heal", help="remove the partition: every node reaches every other again")
    _common(heal)
    heal.set_defaults(func=cmd_heal)
    down = sub.add_parser("down", help="stop every node and workload of the testnet")
    down.add_argument("--purge", action="store_true", help="also delete DIR")
    _common(down)
    down.set_defaults(func=cmd_down)


def _common(parser) -> None:
    parser.add_argument("--dir", required=True, metavar="DIR", help="the testnet's directory")
    add_json_flag(parser)


def render_rows(rows) -> Table:
    table = Table(title="testnet", title_justify="left")
    for column in ("#", "pid", "process", "host", "port", "zone", "key", "connected", "epoch"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) if row.get(c) is not None else "-"
                        for c in ("index", "pid", "process", "host", "port", "zone", "key", "connected", "epoch")))
    return table


def cmd_up(args) -> int:
    rows = launcher.up(args.dir, args.nodes, args.owners, run_workloads=not args.no_workloads, netns=args.netns)
    layout = launcher.load_layout(args.dir)
    emit(args, {"mesh_id": layout["mesh_id"], "nodes": rows, "owners": layout["owners"]},
         lambda console: (console.print(render_rows(rows)),
                          console.print("owner keys: " + ", ".join(o["key_file"] for o in layout["owners"])),
                          print_metrics_urls(console, rows, layout.get("netns")),
                          print_netns(console, layout.get("netns"))))
    return 0


def cmd_status(args) -> int:
    layout = launcher.load_layout(args.dir)
    rows = [launcher.node_status(n) for n in layout["nodes"]]
    result = {"nodes": rows}
    if layout.get("netns"):
        result["netns"] = layout["netns"]
    netns = layout.get("netns")
    emit(args, result, lambda console: (console.print(render_rows(rows)), print_metrics_urls(console, rows, netns),
                                        print_netns(console, netns)))
    return 0


def print_netns(console, netns) -> None:
    if netns:
        groups = netns["partition"]
        console.print("network: namespaces %s-n*, bridge %s in %s; %s" % (
            netns["hub"][:-len("-hub")], netns["bridge"], netns["hub"],
            "partitioned " + " | ".join(",".join(map(str, g)) for g in groups) if groups else "not partitioned"),
            soft_wrap=True)


def cmd_partition(args) -> int:
    groups = launcher.partition(args.dir, args.groups)
    emit(args, {"partition": groups}, lambda console: console.print(
        "partitioned: " + " | ".join(",".join(map(str, g)) for g in groups)))
    return 0


def cmd_heal(args) -> int:
    launcher.heal(args.dir)
    emit(args, {"partition": None}, lambda console: console.print("healed: every node reaches every other"))
    return 0


def print_metrics_urls(console, rows, netns=None) -> None:
    """One line per node (README "Metrics"): `curl URL` reads its Prometheus metrics.

    With --netns the endpoint is on 127.0.0.1 of the node's own namespace: curl it from there.
    """
    for row in rows:
        if row.get("metrics"):
            where = "ip netns exec %s curl " % netns["nodes"][row["index"]] if netns else ""
            console.print("node %d metrics: %s%s" % (row["index"], where, row["metrics"]), soft_wrap=True)


def cmd_fault(args) -> int:
    if args.action == "start":
        pid = launcher.start_node(args.dir, args.index)
        launcher.wait_ready(args.dir, indices=[args.index])
    elif args.action == "stop":
        launcher.stop_node(args.dir, args.index)
        pid = None
    else:
        signum = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP, "resume": signal.SIGCONT}[args.action]
        launcher.signal_node(args.dir, args.index, signum)
        pid = launcher.load_layout(args.dir)["nodes"][args.index]["pid"]
    result = {"index": args.index, "action": args.action, "pid": pid}
    emit(args, result, lambda console: console.print("node %d: %s" % (args.index, args.action)))
    return 0


def cmd_add(args) -> int:
    entry = launcher.add_node(args.dir, args.stake)
    layout = launcher.load_layout(args.dir)
    result = dict(entry, bootstrap=launcher.bootstrap_multiaddr(layout["nodes"][0]))
    emit(args, result, lambda console: console.print(
        "node %d started at %s; admit it with:\n  meshnode join --node %s --bootstrap %s"
        % (entry["index"], entry["dir"], entry["dir"], result["bootstrap"])))
    return 0


def cmd_down(args) -> int:
    leftovers = launcher.down(args.dir)
    if args.purge:
        shutil.rmtree(args.dir, ignore_errors=True)
    result = {"stopped": True, "leftover_processes": leftovers}
    emit(args, result, lambda console: console.print(
        "testnet stopped" + (" (killed %d stragglers)" % len(leftovers) if leftovers else "")))
    return 0
