"""Real network separation for a local testnet (`meshnode testnet up --netns`), Linux, root.

Each node runs in a network namespace of its own with one interface, ``eth0``, addressed
10.77.0.(index + 1)/24. Its other end is a veth port of a bridge that lives in one more
namespace, the testnet's hub: no interface, address, route or nftables rule is added to the
host's own namespace, so two testnets (or the host's real 10.77.0.0/24, if any) never meet.
A partition is a real packet filter: an nftables table of the ``bridge`` family in the hub
drops every IPv4 frame the bridge would forward between two groups, so established TCP
connections stall as on a cut cable (no reset, no error), and ``heal`` deletes the table.

The names are derived from the mesh id and written to the layout file before anything is
created, so ``down`` (or ``down`` after a crash of ``up``) removes exactly what it made by
those names. Deleting a namespace deletes its veth end, the peer end with it, and the
bridge and nftables table inside it; ``down`` also deletes the table explicitly first.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from keys.errors import ConfigError
from protocol.errors import MeshError

SUBNET = "10.77.0.0/24"
NODE_PORT = 4001           # every node has a port space of its own, so all can use one port
BRIDGE = "br0"
TABLE = "meshnode_partition"
NETNS_DIR = "/run/netns"   # where `ip netns add` pins a namespace by name
COMMAND_TIMEOUT_S = 10


def node_address(index: int) -> str:
    """Node ``index``'s IPv4 address inside its namespace (index 0..63 -> .1 .. .64)."""
    return "10.77.0.%d" % (index + 1)


def check_available() -> None:
    """Raise a one-line ConfigError unless this process can make namespaces and nftables rules."""
    if os.geteuid() != 0:
        raise ConfigError("--netns needs root (it creates network namespaces, veth pairs and nftables rules)")
    if shutil.which("ip") is None:
        raise ConfigError("--netns needs `ip netns` (Debian: apt-get install iproute2)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if probe.returncode != 0:
        raise ConfigError("--netns needs `ip netns`, which failed here: %s" % _first_line(probe.stderr))
    if shutil.which("nft") is None:
        raise ConfigError("--netns needs nftables for partitions (Debian: apt-get install nftables)")


def plan(mesh_id_hex: str, nodes: int) -> dict:
    """The names a testnet of ``nodes`` nodes will create (recorded in the layout first)."""
    tag = "mn" + mesh_id_hex[:8]
    return {"hub": tag + "-hub", "nodes": [tag + "-n%d" % i for i in range(nodes)], "bridge": BRIDGE,
            "table": TABLE, "subnet": SUBNET, "partition": None}


def add_node_name(netns: dict) -> str:
    """Append (and return) the namespace name of the next node to the plan."""
    name = netns["hub"][:-len("-hub")] + "-n%d" % len(netns["nodes"])
    netns["nodes"].append(name)
    return name


def existing_namespaces() -> set[str]:
    result = _run(["ip", "-o", "netns", "list"])
    return {line.split()[0] for line in result.splitlines() if line.strip()}


def create_hub(netns: dict) -> None:
    hub = netns["hub"]
    if hub in existing_namespaces():
        raise MeshError("network namespace %s already exists (a testnet with this mesh id?)" % hub)
    _run(["ip", "netns", "add", hub])
    _run(["ip", "-n", hub, "link", "add", netns["bridge"], "type", "bridge"])
    _run(["ip", "-n", hub, "link", "set", netns["bridge"], "up"])


def create_node(netns: dict, index: int) -> None:
    """Namespace of node ``index``: lo up, eth0 with its address, the veth peer on the hub's bridge."""
    name, hub, port = netns["nodes"][index], netns["hub"], "n%d" % index
    if name in existing_namespaces():
        raise MeshError("network namespace %s already exists" % name)
    _run(["ip", "netns", "add", name])
    _run(["ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", hub])
    _run(["ip", "-n", hub, "link", "set", port, "master", netns["bridge"]])
    _run(["ip", "-n", hub, "link", "set", port, "up"])
    _run(["ip", "-n", name, "addr", "add", node_address(index) + "/24", "dev", "eth0"])
    _run(["ip", "-n", name, "link", "set", "lo", "up"])
    _run(["ip", "-n", name, "link", "set", "eth0", "up"])


def exec_prefix(netns: dict, index: int) -> list[str]:
    """Prefix of a command line that runs the rest inside node ``index``'s namespace."""
    return ["ip", "netns", "exec", netns["nodes"][index]]


def parse_groups(texts: list[str], nodes: int) -> list[list[int]]:
    """``["0,1,2", "3"]`` -> [[0, 1, 2], [3], rest]: nodes named nowhere form one more group."""
    groups, seen = [], set()
    for text in texts:
        group = []
        for part in text.split(","):
            try:
                index = int(part)
            except ValueError:
                raise ConfigError("a partition group is node indices separated by commas (like 0,1,2), got %r"
                                  % text) from None
            if not 0 <= index < nodes:
                raise ConfigError("no node %d in this testnet (0..%d)" % (index, nodes - 1))
            if index in seen:
                raise ConfigError("node %d is named in two partition groups" % index)
            seen.add(index)
            group.append(index)
        groups.append(group)
    rest = [i for i in range(nodes) if i not in seen]
    if rest:
        groups.append(rest)
    if len(groups) < 2:
        raise ConfigError("a partition needs at least two groups (every node is in one group here)")
    return groups


def partition_rules(netns: dict, groups: list[list[int]]) -> str:
    """The nft script that (re)defines the hub's table: drop IPv4 between any two groups.

    Declaring the table before deleting it makes the delete succeed whether or not a
    partition was in force, and the whole script is one transaction: the old rules are
    replaced, never absent in between.
    """
    table = "bridge " + netns["table"]
    lines = ["table %s" % table, "delete table %s" % table, "table %s {" % table, "  chain forward {",
             "    type filter hook forward priority 0; policy accept;"]
    for a, source in enumerate(groups):
        for b, destination in enumerate(groups):
            if a != b:
                lines.append("    ip saddr { %s } ip daddr { %s } drop"
                             % (", ".join(map(node_address, source)), ", ".join(map(node_address, destination))))
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def partition(netns: dict, groups: list[list[int]]) -> None:
    _run(["ip", "netns", "exec", netns["hub"], "nft", "-f", "-"], stdin=partition_rules(netns, groups))


def heal(netns: dict) -> None:
    table = "bridge " + netns["table"]
    _run(["ip", "netns", "exec", netns["hub"], "nft", "-f", "-"],
         stdin="table %s\ndelete table %s\n" % (table, table))


def destroy(netns: dict) -> list[str]:
    """Delete the partition table and every namespace of the plan that exists; return what is left."""
    present = existing_namespaces()
    if netns["hub"] in present:
        try:
            heal(netns)
        except MeshError:
            pass  # the namespace goes next, and the table with it
    for name in netns["nodes"] + [netns["hub"]]:
        if name in present:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    return sorted(set(netns["nodes"] + [netns["hub"]]) & existing_namespaces())


def _run(command: list[str], stdin: str | None = None) -> str:
    try:
        result = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MeshError("`%s` failed: %s" % (" ".join(command), exc)) from None
    if result.returncode != 0:
        raise MeshError("`%s` failed: %s" % (" ".join(command), _first_line(result.stderr or result.stdout)))
    return result.stdout


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"
