"""`meshnode testnet`: a local mesh of real node processes (on 127.0.0.1, or each in a network
namespace of its own with --netns), and fault injection."""

from __future__ import annotations

import argparse

import shutil
import signal

from meshnode.cli.output import add_json_flag, emit, examples, print_command, progress
from meshnode.cli.pools_file import load_pools
from meshnode.control.client import ControlClient
from meshnode.tui.tables import compact_table, plain_text
from protocol.errors import MeshError
from protocol.placement import (THROTTLE_HW_POWER_BRAKE, THROTTLE_HW_SLOWDOWN, THROTTLE_HW_THERMAL,
                                THROTTLE_SW_POWER_CAP, THROTTLE_SW_THERMAL)
from testnet import launcher


FAULTS = (  # (command, what it does to node I)
    ("kill", "SIGKILL node I: the mesh evicts it and migrates its jobs"),
    ("stop", "stop node I cleanly (SIGTERM)"),
    ("start", "start node I again, and wait until it answers"),
    ("pause", "freeze node I (SIGSTOP)"),
    ("resume", "unfreeze node I (SIGCONT)"),
)
UP_READINESS = """Create N nodes in DIR, start them, and return once the mesh is ready.

Ready: every node is connected to every other running node. At the timeout,
max(60, 3 x N) seconds (on 2 cores a 32-node mesh takes over a minute to finish its
handshakes), a mesh in which every node is connected to a quorum (itself and its
peers more than 2/3 of the running nodes: what placing jobs needs) is accepted
too; otherwise `up` fails naming each node's connections. A node that exits
while starting fails it at once."""
STATUS_COLUMNS = ("#", "node", "pid", "process", "port", "zone", "rail", "connected", "epoch")


def register(subparsers) -> None:
    testnet = subparsers.add_parser("testnet", help="start, inspect, fault and stop a local testnet", epilog=examples(
        "meshnode testnet up --nodes 4 --dir net", "meshnode testnet kill 2 --dir net",
        "meshnode testnet down --dir net --purge"))
    sub = testnet.add_subparsers(dest="testnet_command", metavar="SUBCOMMAND")
    sub.required = True
    up = sub.add_parser("up", help="create and start N nodes; return once the mesh is connected",
                        description=UP_READINESS, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=examples(
        "meshnode testnet up --nodes 4 --dir net",
        "meshnode testnet up --nodes 16 --heartbeat-ms 200 --dir net     # a larger mesh on few cores",
        "meshnode testnet up --nodes 4 --pools jobs/pools/lab.toml --dir net  # pools and quotas (SPEC.md 5.5)",
        "meshnode testnet up --nodes 6 --rail-groups 2 --dir net   # rail-1 on nodes 0,2,4 (zone-a), rail-2 on 1,3,5",
        "meshnode testnet up --nodes 4 --loopback-hosts --dir net   # node i on 127.0.0.(i+1): replicas serve one port",
        "meshnode testnet up --nodes 16 --bid-sample 6 --dir net   # about 6 members bid per job (SPEC.md 5.6)"))
    up.add_argument("--nodes", type=int, default=4, metavar="N", help="how many nodes (default 4)")
    up.add_argument("--owners", type=int, default=1, metavar="N",
                    help="workload owner keys to create, in DIR/owners/ (default 1)")
    up.add_argument("--no-workloads", action="store_true", help="place jobs but start no processes")
    up.add_argument("--heartbeat-ms", type=int, default=None, metavar="MS",
                    help="heartbeat period; the detection bound scales with it (6 periods; default 50)")
    up.add_argument("--pools", metavar="FILE",
                    help="pools, per-owner quotas and reservations for the genesis (TOML, as jobs/pools/lab.toml)")
    up.add_argument("--rail-groups", type=int, default=0, metavar="G",
                    help="node i's capability vector carries rail group rail-(i mod G + 1); an even G keeps each "
                         "in one zone (default 0: every node's own rail)")
    up.add_argument("--bid-sample", type=int, default=0, metavar="K",
                    help="genesis bid_sample: about K members bid per job (SPEC.md 5.6; default 0: every member)")
    up.add_argument("--netns", action="store_true",
                    help="each node in a network namespace of its own on a virtual bridge (root; enables partition)")
    up.add_argument("--loopback-hosts", action="store_true",
                    help="node i listens on 127.0.0.(i+1): a serving job's replicas each bind its one port "
                         "(SPEC.md R4f; jobs/serve-replicas.toml)")
    _common(up)
    up.set_defaults(func=cmd_up)
    status = sub.add_parser("status", help="every node's process state and connections",
                            epilog=examples("meshnode testnet status --dir net"))
    _common(status)
    status.set_defaults(func=cmd_status)
    for name, help_text in FAULTS:
        parser = sub.add_parser(name, help=help_text, epilog=examples("meshnode testnet %s 2 --dir net" % name))
        parser.add_argument("index", type=int, metavar="I", help="the node's index: the # column of `testnet status`")
        _common(parser)
        parser.set_defaults(func=cmd_fault, action=name)
    add = sub.add_parser("add", help="create and start a new, not yet admitted node (then `meshnode join`)",
                         epilog=examples("meshnode testnet add --dir net --stake 100"))
    add.add_argument("--stake", type=int, default=100, help="stake the testnet authority vouches for (default 100)")
    _common(add)
    add.set_defaults(func=cmd_add)
    telemetry = sub.add_parser("telemetry", help="force the simulated GPU readings of node I (or --clear them)",
                               epilog=examples("meshnode testnet telemetry 0 --temp 88 --throttle thermal --util 95 --dir net",
                                               "meshnode testnet telemetry 0 --clear --dir net"))
    telemetry.add_argument("index", type=int, metavar="I", help="the node's index in the testnet (0, 1, ...)")
    telemetry.add_argument("--util", type=int, metavar="PERCENT", help="utilisation, 0..100")
    telemetry.add_argument("--temp", type=int, metavar="CELSIUS", help="temperature, 0..200")
    telemetry.add_argument("--throttle", metavar="REASONS",
                           help="comma-separated: %s" % ", ".join(THROTTLE_NAMES))
    telemetry.add_argument("--ecc", type=int, metavar="N", help="uncorrected ECC errors")
    telemetry.add_argument("--read-error", action="store_true", help="make reading the GPUs fail")
    telemetry.add_argument("--gpu", type=int, metavar="G", help="only GPU G (default: every GPU of the node)")
    telemetry.add_argument("--clear", action="store_true", help="report the simulated model's readings again")
    _common(telemetry)
    telemetry.set_defaults(func=cmd_telemetry)
    partition = sub.add_parser("partition", help="cut the network between groups of nodes (--netns testnets)",
                               epilog=examples("meshnode testnet partition 0,1,2,3 4 --dir net",
                                               "meshnode testnet partition 2 --dir net   # node 2 alone"))
    partition.add_argument("groups", nargs="+", metavar="I,J,...",
                           help="a group of node indices; nodes named in no group form one more group")
    _common(partition)
    partition.set_defaults(func=cmd_partition)
    heal = sub.add_parser("heal", help="remove the partition: every node reaches every other again",
                          epilog=examples("meshnode testnet heal --dir net"))
    _common(heal)
    heal.set_defaults(func=cmd_heal)
    down = sub.add_parser("down", help="stop every node and workload of the testnet",
                          epilog=examples("meshnode testnet down --dir net --purge"))
    down.add_argument("--purge", action="store_true", help="also delete DIR")
    _common(down)
    down.set_defaults(func=cmd_down)


# Names for nvml.h clock-event reason bits (protocol/placement.py says which make a GPU unhealthy).
THROTTLE_NAMES = {"none": 0, "idle": 0x1, "power_cap": THROTTLE_SW_POWER_CAP, "hw_slowdown": THROTTLE_HW_SLOWDOWN,
                  "thermal": THROTTLE_SW_THERMAL | THROTTLE_HW_THERMAL, "sw_thermal": THROTTLE_SW_THERMAL,
                  "hw_thermal": THROTTLE_HW_THERMAL, "power_brake": THROTTLE_HW_POWER_BRAKE}


def _common(parser) -> None:
    parser.add_argument("--dir", required=True, metavar="DIR", help="the testnet's directory")
    add_json_flag(parser)


def render_rows(rows):
    """The testnet's nodes: the index that fault commands take, and the node label every
    other table names the node by."""
    return compact_table("testnet", STATUS_COLUMNS, [
        tuple(plain_text(row.get(c)) for c in ("index", "node", "pid", "process", "port", "zone", "rail_group",
                                               "connected", "epoch"))
        for row in rows])


def cmd_up(args) -> int:
    params = launcher.params_with_heartbeat(args.heartbeat_ms)
    scheduling = {}
    if args.pools:
        scheduling["pools"], scheduling["reservations"] = load_pools(args.pools)
    with progress(args, "creating the testnet in %s" % args.dir) as shown:
        rows = launcher.up(args.dir, args.nodes, args.owners, run_workloads=not args.no_workloads, params=params,
                           netns=args.netns, on_step=shown.update, rail_groups=args.rail_groups,
                           loopback_hosts=args.loopback_hosts, bid_sample=args.bid_sample, **scheduling)
    layout = launcher.load_layout(args.dir)

    def render(console):
        console.print(render_rows(rows))
        for owner in layout["owners"]:
            print_command(console, "owner key: %s" % owner["key_file"])
        print_metrics_urls(console, rows, layout.get("netns"))
        print_netns(console, layout.get("netns"))
    emit(args, {"mesh_id": layout["mesh_id"], "nodes": rows, "owners": layout["owners"]}, render)
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
        with progress(args, "starting node %d" % args.index):
            pid = launcher.start_node(args.dir, args.index)
            launcher.wait_ready(args.dir, indices=[args.index])
    elif args.action == "stop":
        with progress(args, "stopping node %d" % args.index):
            launcher.stop_node(args.dir, args.index)
        pid = None
    else:
        signum = {"kill": signal.SIGKILL, "pause": signal.SIGSTOP, "resume": signal.SIGCONT}[args.action]
        launcher.signal_node(args.dir, args.index, signum)
        pid = launcher.load_layout(args.dir)["nodes"][args.index]["pid"]
    result = {"index": args.index, "action": args.action, "pid": pid}
    emit(args, result, lambda console: console.print("node %d: %s" % (args.index, args.action)))
    return 0


def join_command(node_dir: str, bootstrap: str) -> str:
    return "meshnode join --node %s --bootstrap %s" % (node_dir, bootstrap)


def cmd_add(args) -> int:
    with progress(args, "creating and starting a new node"):
        entry = launcher.add_node(args.dir, args.stake)
    layout = launcher.load_layout(args.dir)
    result = dict(entry, bootstrap=launcher.bootstrap_multiaddr(layout["nodes"][0]))

    def render(console):
        console.print("node %d started at %s; admit it with:" % (entry["index"], entry["dir"]))
        print_command(console, join_command(entry["dir"], result["bootstrap"]))
    emit(args, result, render)
    return 0


def telemetry_request(args) -> dict:
    """The set_simulated_telemetry arguments for the command line, in GpuState's units."""
    forced = {"util_milli": _in_range("--util", args.util, 100, 1000),
              "temp_milli_c": _in_range("--temp", args.temp, 200, 1000),
              "throttle_reasons": None if args.throttle is None else _throttle_bits(args.throttle),
              "ecc_errors": _in_range("--ecc", args.ecc, (1 << 63) - 1, 1)}
    forced = {name: value for name, value in forced.items() if value is not None}
    if args.read_error:
        forced["read_error"] = True
    if args.clear and forced:
        raise MeshError("testnet telemetry: --clear takes no readings to force")
    if not args.clear and not forced:
        raise MeshError("testnet telemetry: name a reading to force (--util, --temp, --throttle, --ecc, "
                        "--read-error) or --clear")
    request = {"clear": True} if args.clear else forced
    if args.gpu is not None:
        request["gpu"] = args.gpu
    return request


def _in_range(flag: str, value: int | None, high: int, scale: int) -> int | None:
    if value is None:
        return None
    if not 0 <= value <= high:
        raise MeshError("testnet telemetry: %s must be in 0..%d, not %d" % (flag, high, value))
    return value * scale


def _throttle_bits(text: str) -> int:
    bits = 0
    for name in text.split(","):
        if name.strip() not in THROTTLE_NAMES:
            raise MeshError("testnet telemetry: --throttle %r: use %s" % (name, ", ".join(THROTTLE_NAMES)))
        bits |= THROTTLE_NAMES[name.strip()]
    return bits


def cmd_telemetry(args) -> int:
    request = telemetry_request(args)
    entry = launcher.node_entry(args.dir, args.index)
    with ControlClient(entry["dir"]) as client:
        result = client.call("set_simulated_telemetry", **request)
    result = dict(result, index=args.index)
    emit(args, result, lambda console: console.print(
        "node %d: %s" % (args.index, "; ".join("gpu%s %s" % (gpu[3:], " ".join(
            "%s=%s" % item for item in sorted(fault.items()))) for gpu, fault in sorted(result["faults"].items()))
            or "simulated readings")))
    return 0


def cmd_down(args) -> int:
    with progress(args, "stopping the testnet in %s" % args.dir):
        leftovers = launcher.down(args.dir)
        if args.purge:
            shutil.rmtree(args.dir, ignore_errors=True)
    result = {"stopped": True, "leftover_processes": leftovers}
    emit(args, result, lambda console: console.print(
        "testnet stopped" + (" (killed %d stragglers)" % len(leftovers) if leftovers else "")))
    return 0
