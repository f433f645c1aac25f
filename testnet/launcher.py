"""A local testnet of real `meshnode run` processes on 127.0.0.1, and its fault injector.

``testnet up`` writes one data directory per node (insecure testnet keystore, node
config, shared genesis), starts each node in its own process session so the testnet
outlives the command, and waits until every node's control socket reports the whole
mesh connected. ``DIR/testnet.json`` records the layout and pids, so later commands
(kill, pause, down, ...) work from any shell. Every process the testnet started can be
found again through /proc (its command line or working directory is under DIR), which
is how ``down`` proves that nothing is left. With ``--netns`` (testnet/netns.py) each node
runs in a network namespace of its own instead, and ``partition``/``heal`` cut and restore
the network between them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from keys.attestation import issue_attestation
from keys.errors import ConfigError
from keys.genesis import DEFAULT_PARAMS, Genesis, ProtocolParams
from keys.identity import SigningIdentity, generate_identity, short_id
from keys.keystore import create_keystore, load_identity
from meshnode.control.client import ControlClient
from meshnode.node.config import (METRICS_HOST, BootstrapPeer, GpuProfile, NodeConfig, PassphraseSource, node_paths,
                                  write_config)
from protocol.errors import MeshError
from protocol.messages import Member
from testnet import netns as netns_mod

LAYOUT_FILE = "testnet.json"
READY_TIMEOUT_S = 60
STOP_GRACE_S = 5
STARTUP_LOG_TAIL_BYTES = 4096  # read from the end of a dead node's log to say why it died
MAX_NODES = 64
ATTESTATION_FILE = "attestation.bin"
ATTESTATION_VALID_MS = 30 * 24 * 3600 * 1000
JURISDICTIONS = ("eu", "us")  # attested per node, alternating, for sovereign placements

# Heterogeneous simulated hardware over two zones (issue: at least 2 zones).
GPU_PROFILES = (
    ("H100-80GB", 8, 81920, "zone-a", "rail-1"),
    ("A100-40GB", 4, 40960, "zone-b", "rail-2"),
    ("L4-24GB", 2, 24576, "zone-a", "rail-3"),
    ("A10-24GB", 1, 24576, "zone-b", "rail-4"),
)
MAX_RAIL_GROUPS = 16


def rail_group_of(index: int, rail_groups: int) -> str:
    """Node ``index``'s rail group (README "Local testnet"): with ``rail_groups`` = G > 0,
    ``rail-(index mod G + 1)``, so with an even G every rail group stays inside one zone
    (zones alternate zone-a, zone-b); with 0, its hardware profile's own rail (rail-1..rail-4,
    so no two nodes of one zone share one)."""
    if rail_groups > 0:
        return "rail-%d" % (index % rail_groups + 1)
    return GPU_PROFILES[index % len(GPU_PROFILES)][4]


@dataclass
class NodeEntry:
    index: int
    dir: str
    public_key: str
    port: int
    zone: str
    metrics_port: int | None = None   # its Prometheus endpoint on 127.0.0.1 (README "Metrics")
    pid: int | None = None
    host: str = "127.0.0.1"           # its listen address: 10.77.0.x in its own namespace with --netns
    rail_group: str = ""              # signed in its capability vector (SPEC.md GA2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _layout_path(root: Path) -> Path:
    return root / LAYOUT_FILE


def load_layout(root) -> dict:
    path = _layout_path(Path(root))
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("no testnet at %s (run `meshnode testnet up --dir %s` first)" % (root, root)) from None
    except (OSError, ValueError) as exc:
        raise ConfigError("%s is unreadable: %s" % (path, exc)) from None


def save_layout(root: Path, layout: dict) -> None:
    tmp = _layout_path(root).with_suffix(".tmp")
    tmp.write_text(json.dumps(layout, indent=2))
    os.replace(tmp, _layout_path(root))


def loopback_host(index: int) -> str:
    """Node ``index``'s own loopback address (Linux routes all of 127.0.0.0/8 to lo)."""
    return "127.0.0.%d" % (index + 1)


def create_testnet(root, nodes: int, owners: int = 1, *, name: str = "testnet",
                   run_workloads: bool = True, stake: int = 100, params: ProtocolParams = DEFAULT_PARAMS,
                   rng: random.Random | None = None, metrics: bool = False,
                   hosts: list[str] | None = None, pools: tuple = (), reservations: bool = False,
                   rail_groups: int = 0, loopback_hosts: bool = False, bid_sample: int = 0) -> dict:
    """Write keys, genesis (protocol ``params``) and configs for ``nodes`` nodes; start nothing.

    With ``rng`` (the node-mode simulator, testnet/sim_nodes.py) every key is drawn from it,
    ports are fixed and timestamps are 0, so one rng state writes one mesh byte for byte
    (same mesh id, keys and attestations); its nodes are not meant for TCP then.
    With ``metrics`` (``testnet up``) each node serves Prometheus metrics on a port of its own;
    nodes run in one process (driver tests) leave it off and bind nothing.
    ``pools`` and ``reservations`` go into the genesis (SPEC.md 5.5), and ``bid_sample``
    (5.6; 0: every member bids). ``rail_groups``: see
    ``rail_group_of``.
    With ``hosts`` (``testnet up --netns``) node i listens on ``hosts[i]``, port
    netns.NODE_PORT, in a network namespace of its own, instead of a free port on 127.0.0.1.
    With ``loopback_hosts`` node i listens on 127.0.0.(i+1) (a free port): each node has an
    address of its own on one machine, so replicas of a job serve its one port (SPEC.md R4f).
    """
    root = Path(root)
    if rng is None:
        new_identity, now_ms = generate_identity, time.time_ns() // 1_000_000
    else:
        def new_identity():
            return SigningIdentity(rng.randbytes(32))
        now_ms = 0
    if not 1 <= nodes <= MAX_NODES:
        raise ConfigError("--nodes must be 1..%d" % MAX_NODES)
    if not 0 <= rail_groups <= MAX_RAIL_GROUPS:
        raise ConfigError("--rail-groups must be 0..%d" % MAX_RAIL_GROUPS)
    if _layout_path(root).exists():
        raise ConfigError("%s already holds a testnet (run `meshnode testnet down --dir %s --purge`)" % (root, root))
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    owner_entries = []
    (root / "owners").mkdir(exist_ok=True)
    for k in range(owners):
        identity = new_identity()
        path = root / "owners" / ("owner-%d.key" % k)
        create_keystore(path, identity, None)
        owner_entries.append({"key_file": str(path), "public_key": identity.public_key.hex()})
    # The testnet's attestation authority vouches for node attributes and for the stake
    # of nodes that join later (SPEC.md F7: a join cannot grant itself stake).
    authority = new_identity()
    create_keystore(root / "authority.key", authority, None)
    identities = [new_identity() for _ in range(nodes)]
    if hosts is None:
        hosts = [loopback_host(i) if loopback_hosts else "127.0.0.1" for i in range(nodes)]
        ports = [free_port() if rng is None else 20000 + i for i in range(nodes)]
    else:
        ports = [netns_mod.NODE_PORT] * nodes
    metrics_ports = [free_port() if metrics else None for _ in range(nodes)]
    members = []
    for i, identity in enumerate(identities):
        zone = GPU_PROFILES[i % len(GPU_PROFILES)][3]
        members.append(Member(public_key=identity.public_key, stake=stake, zone=zone,
                              labels={"testnet": name}, addrs=("/ip4/%s/tcp/%d" % (hosts[i], ports[i]),)))
    try:
        genesis = Genesis(name=name, created_ms=now_ms, members=tuple(members), params=params,
                          authorities=(authority.public_key,), pools=pools, reservations=reservations,
                          bid_sample=bid_sample)
    except ValueError as exc:   # the record's schema names the field
        raise ConfigError("invalid genesis: %s" % exc) from None
    entries = []
    for i, identity in enumerate(identities):
        zone = GPU_PROFILES[i % len(GPU_PROFILES)][3]
        node_dir = root / ("node-%d" % i)
        node_dir.mkdir(exist_ok=True)
        os.chmod(node_dir, 0o700)
        paths = node_paths(node_dir)
        create_keystore(paths.keystore, identity, None)
        paths.genesis.write_bytes(genesis.encode())
        # The attestation vouches the node's genesis stake too: a genesis member that is
        # evicted (it crashed, or paused past the bound) rejoins through the ordinary join
        # path (SPEC.md F7), which admits only vouched stake.
        _write_node_files(node_dir, identity, authority, genesis, i, ports[i], owner_entries, name, stake=stake,
                          issued_ms=now_ms, metrics_port=metrics_ports[i], host=hosts[i],
                          rail_group=rail_group_of(i, rail_groups))
        entries.append(NodeEntry(i, str(node_dir), identity.public_key.hex(), ports[i], zone,
                                 metrics_ports[i], host=hosts[i], rail_group=rail_group_of(i, rail_groups)).__dict__)
    layout = {"name": name, "mesh_id": genesis.mesh_id.hex(), "nodes": entries, "owners": owner_entries,
              "run_workloads": run_workloads, "rail_groups": rail_groups}
    save_layout(root, layout)
    return layout


def _write_node_files(node_dir: Path, identity, authority, genesis: Genesis, index: int, port: int,
                      owner_entries: list, name: str, stake: int, bootstrap=(), issued_ms: int | None = None,
                      metrics_port: int | None = None, host: str = "127.0.0.1", rail_group: str = "") -> None:
    """Config and attestation of one node; the attestation vouches ``stake`` for its (re)joins."""
    model, count, mem_mib, zone, _rail = GPU_PROFILES[index % len(GPU_PROFILES)]
    if issued_ms is None:
        issued_ms = time.time_ns() // 1_000_000
    attestation = issue_attestation(authority, identity.public_key,
                                    {"jurisdiction": JURISDICTIONS[index % 2], "zone": zone}, stake,
                                    issued_ms, issued_ms + ATTESTATION_VALID_MS, genesis.mesh_id)
    (node_dir / ATTESTATION_FILE).write_bytes(attestation)
    write_config(node_dir, NodeConfig(
        listen=("/ip4/%s/tcp/%d" % (host, port),), bootstrap=tuple(bootstrap), zone=zone, rail_group=rail_group,
        passphrase=PassphraseSource("insecure"),
        allowed_owners=tuple(bytes.fromhex(o["public_key"]) for o in owner_entries),
        attestation_files=(ATTESTATION_FILE,),
        gpu=GpuProfile(source="simulated", model=model, count=count, mem_mib=mem_mib, seed=index),
        labels=(("testnet", name),),
        metrics_listen="" if metrics_port is None else "%s:%d" % (METRICS_HOST, metrics_port)))


def add_node(root, stake: int = 100) -> dict:
    """Prepare and start a NEW node that is not yet a member; `meshnode join` admits it."""
    root = Path(root)
    layout = load_layout(root)
    index = len(layout["nodes"])
    if index >= MAX_NODES:
        raise ConfigError("a testnet holds at most %d nodes" % MAX_NODES)
    genesis_bytes = node_paths(layout["nodes"][0]["dir"]).genesis.read_bytes()
    genesis = Genesis.decode(genesis_bytes)
    authority = load_identity(root / "authority.key", None)
    identity = generate_identity()
    netns = layout.get("netns")
    if netns is None:
        host, port = "127.0.0.1", free_port()
    else:
        host, port = netns_mod.node_address(index), netns_mod.NODE_PORT
    metrics_port = free_port() if any(n.get("metrics_port") for n in layout["nodes"]) else None
    node_dir = root / ("node-%d" % index)
    node_dir.mkdir()
    os.chmod(node_dir, 0o700)
    paths = node_paths(node_dir)
    create_keystore(paths.keystore, identity, None)
    paths.genesis.write_bytes(genesis_bytes)
    first = layout["nodes"][0]
    bootstrap = [BootstrapPeer(bytes.fromhex(first["public_key"]),
                               "/ip4/%s/tcp/%d" % (first.get("host", "127.0.0.1"), first["port"]))]
    rail_group = rail_group_of(index, layout.get("rail_groups", 0))
    _write_node_files(node_dir, identity, authority, genesis, index, port, layout["owners"], layout["name"],
                      stake=stake, bootstrap=bootstrap, metrics_port=metrics_port, host=host, rail_group=rail_group)
    zone = GPU_PROFILES[index % len(GPU_PROFILES)][3]
    layout["nodes"].append(NodeEntry(index, str(node_dir), identity.public_key.hex(), port, zone,
                                     metrics_port, host=host, rail_group=rail_group).__dict__)
    if netns is not None:
        netns_mod.add_node_name(netns)
        save_layout(root, layout)  # the name is recorded before it exists, so `down` finds it
        netns_mod.create_node(netns, index)
    save_layout(root, layout)
    start_node(root, index)
    wait_control(root, index)
    return layout["nodes"][index]


def wait_control(root, index: int, timeout_s: float = READY_TIMEOUT_S) -> dict:
    """Block until node ``index`` answers on its control socket (it may not be a member yet)."""
    entry = _entry(load_layout(root), index)
    deadline = time.monotonic() + timeout_s
    while True:
        row = node_status(entry)
        if row["process"] == "dead":
            raise startup_failure(index, entry["dir"])
        if row["connected"] is not None:
            return row
        if time.monotonic() > deadline:
            raise MeshError("node %d has no control socket after %d s" % (index, timeout_s))
        time.sleep(0.1)


def _last_line(path: Path) -> str | None:
    """The last non-blank line of a log, read from its end only (logs grow without bound)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - STARTUP_LOG_TAIL_BYTES))
            tail = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1] if lines else None


def startup_failure(index: int, node_dir) -> MeshError:
    """Why node ``index`` died starting: the last line its process printed (stdout.log holds
    the one-line error or traceback of a node that never got as far as opening node.log),
    else node.log's, naming the file it came from."""
    for name in ("stdout.log", "node.log"):
        line = _last_line(Path(node_dir) / name)
        if line is not None:
            return MeshError("node %d exited during start-up: %s (see %s)" % (index, line, Path(node_dir) / name))
    return MeshError("node %d exited during start-up and logged nothing (%s)" % (index, node_dir))


def bootstrap_multiaddr(entry: dict) -> str:
    from keys.identity import peer_id_from_public_key
    return "/ip4/%s/tcp/%d/p2p/%s" % (entry.get("host", "127.0.0.1"), entry["port"],
                                      peer_id_from_public_key(bytes.fromhex(entry["public_key"])))


def _node_command(layout: dict, entry: dict) -> list[str]:
    command = [sys.executable, "-m", "meshnode.cli", "run", "--node", entry["dir"]]
    if not layout["run_workloads"]:
        command.append("--no-workloads")
    if layout.get("netns"):
        # `ip netns exec` execs the command, so the pid is the node's own; only the network
        # is separate (the data dir, and its control socket, stay on the shared filesystem).
        command = netns_mod.exec_prefix(layout["netns"], entry["index"]) + command
    return command


def start_node(root, index: int) -> int:
    root = Path(root)
    layout = load_layout(root)
    entry = _entry(layout, index)
    if entry.get("pid") and process_alive(entry["pid"]):
        raise ConfigError("node %d is already running (pid %d)" % (index, entry["pid"]))
    log = open(Path(entry["dir"]) / "stdout.log", "ab")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(_node_command(layout, entry), stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    log.close()
    entry["pid"] = process.pid
    save_layout(root, layout)
    return process.pid


def node_entry(root, index: int) -> dict:
    """Node ``index``'s layout entry (its dir, port, key); a ConfigError if there is none."""
    return _entry(load_layout(root), index)


def _entry(layout: dict, index: int) -> dict:
    if not 0 <= index < len(layout["nodes"]):
        raise ConfigError("no node %d in this testnet (0..%d)" % (index, len(layout["nodes"]) - 1))
    return layout["nodes"][index]


def process_alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    if state == "Z":  # a zombie is dead; reap it if it is ours
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        return False
    return True


def process_state(pid: int | None) -> str:
    if not pid or not process_alive(pid):
        return "dead"
    with open("/proc/%d/stat" % pid) as fh:
        return "paused" if fh.read().rsplit(")", 1)[1].split()[0] == "T" else "running"


def node_status(entry: dict, timeout_s: float = 1.0) -> dict:
    state = process_state(entry.get("pid"))
    public_key = bytes.fromhex(entry["public_key"])
    row = {"index": entry["index"], "node": short_id(public_key), "public_key": entry["public_key"],
           "pid": entry.get("pid"), "process": state, "port": entry["port"],
           "host": entry.get("host", "127.0.0.1"), "zone": entry["zone"], "rail_group": entry.get("rail_group", ""),
           "connected": None, "epoch": None,
           "metrics": "http://%s:%d/metrics" % (METRICS_HOST, entry["metrics_port"])
           if entry.get("metrics_port") else None}
    if state == "running":
        try:
            with ControlClient(entry["dir"], timeout_s=timeout_s) as client:
                status = client.call("status")
            row.update(connected=status["connected"], epoch=status["epoch"], members=status["members"])
        except MeshError as exc:
            row["error"] = str(exc)
    return row


def wait_ready(root, timeout_s: float = READY_TIMEOUT_S, indices=None, *, clock=time.monotonic,
               sleep=time.sleep) -> list[dict]:
    """Block until every (listed) running node sees all other running nodes connected; at
    ``timeout_s``, accept a mesh in which every node is connected to a quorum (with the
    testnet's equal stakes: itself and its peers more than 2/3 of the running nodes), which
    is what placing jobs needs, and raise only if some node lacks even that.

    Each round asks the nodes in turn, from the one the last round stopped at, and stops
    at the first that is not ready: while a mesh connects that is about one status call
    per round, not one per node (32 nodes asked every 0.1 s were 320 control calls a
    second on the cores the mesh was starting on). Only a round in which every node
    answers ready ends the wait. ``clock`` and ``sleep`` are injected by tests."""
    layout = load_layout(root)
    nodes = [n for n in layout["nodes"] if indices is None or n["index"] in indices]
    deadline = clock() + timeout_s
    start = 0
    while True:
        for node in nodes:
            if process_state(node.get("pid")) == "dead":
                raise startup_failure(node["index"], node["dir"])
        peers_expected = sum(1 for n in layout["nodes"] if process_state(n.get("pid")) == "running") - 1
        rows = []
        for offset in range(len(nodes)):
            row = node_status(nodes[(start + offset) % len(nodes)])
            rows.append(row)
            if row["connected"] is None or row["connected"] < peers_expected:
                start = (start + offset) % len(nodes)
                break
        else:
            return sorted(rows, key=lambda r: r["index"])
        if clock() > deadline:
            rows = [node_status(n) for n in nodes]
            if all(row["connected"] is not None and 3 * (row["connected"] + 1) > 2 * (peers_expected + 1)
                   for row in rows):
                return rows
            raise MeshError("testnet not ready after %d s: %s" % (timeout_s, rows))
        sleep(0.1)


def ready_timeout_s(nodes: int) -> float:
    """How long ``up`` waits for ``nodes`` to connect: READY_TIMEOUT_S, or 3 s a node for
    larger meshes (on 2 cores each of 32 nodes took about 16 s just to start answering)."""
    return max(READY_TIMEOUT_S, 3 * nodes)


def params_with_heartbeat(heartbeat_ms: int | None, params: ProtocolParams = DEFAULT_PARAMS) -> ProtocolParams:
    """``params`` with a heartbeat period of ``heartbeat_ms`` and a detection bound the same
    multiple of it as the defaults' (6x): a lighter idle load on few cores, at the price of
    slower detection."""
    if heartbeat_ms is None:
        return params
    if not 10 <= heartbeat_ms <= 10_000:
        raise ConfigError("--heartbeat-ms must be 10..10000")
    scale = DEFAULT_PARAMS.detection_bound_ms // DEFAULT_PARAMS.heartbeat_ms
    return dataclasses.replace(params, heartbeat_ms=heartbeat_ms, detection_bound_ms=scale * heartbeat_ms)


def up(root, nodes: int, owners: int = 1, run_workloads: bool = True,
       params: ProtocolParams = DEFAULT_PARAMS, netns: bool = False, on_step=lambda text: None,
       pools: tuple = (), reservations: bool = False, rail_groups: int = 0,
       loopback_hosts: bool = False, bid_sample: int = 0) -> list[dict]:
    """Create and start a testnet; with ``netns`` each node gets a network namespace of its
    own; ``on_step(text)`` hears of each step (a CLI's progress line); ``rail_groups``: see
    ``rail_group_of``; ``loopback_hosts`` and ``bid_sample``: see ``create_testnet``."""
    if netns and loopback_hosts:
        raise ConfigError("--netns and --loopback-hosts exclude each other (a namespace gives each node its address)")
    if netns:
        netns_mod.check_available()
    on_step("writing keys, genesis and configs for %d nodes" % nodes)
    hosts = [netns_mod.node_address(i) for i in range(nodes)] if netns else None
    layout = create_testnet(root, nodes, owners, run_workloads=run_workloads, params=params, metrics=True,
                            hosts=hosts, pools=pools, reservations=reservations, rail_groups=rail_groups,
                            loopback_hosts=loopback_hosts, bid_sample=bid_sample)
    try:
        if netns:
            layout["netns"] = netns_mod.plan(layout["mesh_id"], nodes)
            save_layout(Path(root), layout)  # names first: `down` removes them even if we die below
            netns_mod.create_hub(layout["netns"])
            for i in range(nodes):
                netns_mod.create_node(layout["netns"], i)
        for i in range(nodes):
            on_step("starting node %d of %d" % (i + 1, nodes))
            start_node(root, i)
        on_step("waiting for the %d nodes to connect to each other" % nodes)
        return wait_ready(root, ready_timeout_s(nodes))
    except BaseException:
        down(root)
        raise


def partition(root, group_texts: list[str]) -> list[list[int]]:
    """Cut the network between groups of nodes (nodes named nowhere form one more group)."""
    layout = load_layout(root)
    netns = _netns_of(root, layout)
    groups = netns_mod.parse_groups(group_texts, len(layout["nodes"]))
    netns_mod.partition(netns, groups)
    netns["partition"] = groups
    save_layout(Path(root), layout)
    return groups


def heal(root) -> None:
    layout = load_layout(root)
    netns = _netns_of(root, layout)
    netns_mod.heal(netns)
    netns["partition"] = None
    save_layout(Path(root), layout)


def _netns_of(root, layout: dict) -> dict:
    if not layout.get("netns"):
        raise ConfigError("the testnet at %s shares 127.0.0.1; partitions need one started with "
                          "`meshnode testnet up --netns`" % root)
    return layout["netns"]


def signal_node(root, index: int, signum: int) -> None:
    entry = _entry(load_layout(root), index)
    pid = entry.get("pid")
    if not pid or not process_alive(pid):
        raise ConfigError("node %d is not running" % index)
    os.kill(pid, signum)


def stop_node(root, index: int, grace_s: float = STOP_GRACE_S) -> None:
    entry = _entry(load_layout(root), index)
    _terminate(entry.get("pid"), grace_s)


def _terminate(pid: int | None, grace_s: float) -> None:
    if not pid or not process_alive(pid):
        return
    os.kill(pid, signal.SIGCONT)  # a paused node cannot handle SIGTERM
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while process_alive(pid):
            time.sleep(0.01)


def testnet_processes(root) -> list[int]:
    """Every live process whose command line or working directory is under ``root``."""
    root = str(Path(root).resolve())
    # Our own ancestors may name ``root`` too (``flock L meshnode bench --dir ROOT``, a
    # shell script given ROOT): they started the testnet and are not part of it.
    ours = _ancestors(os.getpid())
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in ours:
            continue
        try:
            cmdline = Path("/proc/%s/cmdline" % name).read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink("/proc/%s/cwd" % name)
        except (FileNotFoundError, PermissionError, ProcessLookupError, NotADirectoryError):
            continue
        if (root in cmdline or cwd.startswith(root)) and process_alive(int(name)):
            found.append(int(name))
    return found


def _ancestors(pid: int) -> set[int]:
    """``pid`` and every process above it, from /proc/PID/stat's parent field."""
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path("/proc/%d/stat" % pid).read_text()
        except (FileNotFoundError, ProcessLookupError):
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then ppid
    return found


def down(root, grace_s: float = STOP_GRACE_S) -> list[int]:
    """Stop every node (SIGTERM, then SIGKILL), then kill any straggler; return what was left.

    With --netns it then deletes the partition table and every namespace named in the layout
    (their veths and bridge go with them); a namespace that cannot be deleted is an error.
    """
    layout = load_layout(root)
    for entry in layout["nodes"]:
        _terminate(entry.get("pid"), grace_s)
        entry["pid"] = None
    save_layout(Path(root), layout)
    deadline = time.monotonic() + grace_s
    while testnet_processes(root) and time.monotonic() < deadline:
        time.sleep(0.05)  # workloads die with their node (PR_SET_PDEATHSIG); give them a moment
    leftovers = testnet_processes(root)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if layout.get("netns"):
        left = netns_mod.destroy(layout["netns"])
        if left:
            raise MeshError("could not delete network namespace(s) %s" % ", ".join(left))
        layout["netns"]["partition"] = None
        save_layout(Path(root), layout)
    return leftovers
