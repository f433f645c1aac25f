"""`meshnode bench hostile`: hostile peers against one node of a running testnet
(SPEC.md 8 "Limits against hostile peers").

Unlike the other benchmarks it starts no testnet: it attacks node ``--node`` of the
one in ``--dir`` (started by `meshnode testnet up`) and reports, as one JSON object:

1. churn: ``cycles`` inbound connections, each completed (Noise, yamux) and closed;
2. stall: ``stalled`` peers that each send a maximum-length frame prefix and 1 MiB - 1
   of body, then stall, held past the frame read timeout;
3. hold: ``holders`` peers that keep a stream open and send a small frame every second,
   for ``hold_s``: the target's CPU seconds then against as long a quiet period
   before, and whether its epoch moved (a member evicted or readmitted);
4. before the attacks (the baseline) and after each, whether a member can still open a
   connection to the target (``_member_dials_in``);
5. the target's RSS before, during and after, and its transport counters' growth.
"""

from __future__ import annotations

import os
import random
import time

import trio

from keys.keystore import load_identity
from meshnode.control.client import ControlClient
from meshnode.node.config import node_paths
from protocol.errors import MeshError
from testnet import launcher

MEMBER_CONNECT_TIMEOUT_S = 30
MEMBER_DIAL_IN_TIMEOUT_S = 10
STALL_HOLD_S = 7.0  # past the default 5 s frame read timeout


def rss_kib(pid: int) -> int:
    with open("/proc/%d/status" % pid) as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise MeshError("no VmRSS for pid %d" % pid)


def _status(entry: dict) -> dict:
    with ControlClient(entry["dir"], timeout_s=5.0) as client:
        return client.call("status")


def _member_dials_in(root, target: dict, member_index: int) -> dict:
    """Can a member still open a connection TO the target? Node ``member_index`` is
    stopped and its key dials the target from this process (the target's own redials
    go to the stopped node's port and fail, so only an inbound connection can count);
    then the node is started again and the time until the target counts every member
    connected again is measured."""
    from meshnode.net.libp2p_transport import open_libp2p_transport

    member = launcher.load_layout(root)["nodes"][member_index]
    identity = load_identity(node_paths(member["dir"]).keystore, None)
    target_key, address = bytes.fromhex(target["public_key"]), launcher.bootstrap_multiaddr(target)
    expected = _status(target)["members"] - 1
    launcher.stop_node(root, member_index)

    async def dial_in() -> int | None:
        async with open_libp2p_transport(identity.seed, ["/ip4/127.0.0.1/tcp/0"]) as transport:
            started = trio.current_time()
            await transport.connect(target_key, address)
            with trio.move_on_after(MEMBER_DIAL_IN_TIMEOUT_S):
                while target_key not in transport.peers():
                    await trio.sleep(0.01)
                return round((trio.current_time() - started) * 1000)
        return None

    connect_ms = trio.run(dial_in)
    restarted = time.monotonic()
    launcher.start_node(root, member_index)
    whole_ms = None
    while time.monotonic() < restarted + MEMBER_CONNECT_TIMEOUT_S:
        if _status(target)["connected"] >= expected:
            whole_ms = round((time.monotonic() - restarted) * 1000)
            break
        time.sleep(0.05)
    return {"member": member_index, "dialled_in": connect_ms is not None, "dial_in_ms": connect_ms,
            "restarted_member_connected_ms": whole_ms}


def cpu_s(pid: int) -> float:
    with open("/proc/%d/stat" % pid) as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _grown(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in sorted(after) if after[key] != before.get(key, 0)}


def run_hostile_bench(root, target_index: int = 0, cycles: int = 1000, stalled: int = 30, clients: int = 4,
                      holders: int = 200, hold_s: float = 30.0, seed: int | None = None) -> dict:
    from meshnode.net.hostile_probe import connect_close_cycles, stalled_frame_peers, stream_holders

    layout = launcher.load_layout(root)
    if not 0 <= target_index < len(layout["nodes"]):
        raise MeshError("no node %d in this testnet" % target_index)
    target = layout["nodes"][target_index]
    if launcher.process_state(target.get("pid")) != "running":
        raise MeshError("node %d is not running; start the testnet with `meshnode testnet up`" % target_index)
    if len(layout["nodes"]) < 2:
        raise MeshError("the member check needs a testnet of at least 2 nodes")
    member_index = (target_index + 1) % len(layout["nodes"])
    address = launcher.bootstrap_multiaddr(target)
    key = bytes.fromhex(target["public_key"])
    rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "big"))
    pid = target["pid"]
    result = {"target": target_index, "pid": pid, "rss_kib": {"before": rss_kib(pid)},
              "loadavg_before": open("/proc/loadavg").read().split()[:3]}
    counters_before = _status(target).get("transport", {})
    result["member_before"] = _member_dials_in(root, target, member_index)  # the baseline

    started = time.monotonic()
    churn = trio.run(lambda: connect_close_cycles(address, key, cycles, clients=clients, rng=rng))
    result["churn"] = dict(churn, cycles=cycles, clients=clients, seconds=round(time.monotonic() - started, 1))
    result["rss_kib"]["after_churn"] = rss_kib(pid)
    result["member_after_churn"] = _member_dials_in(root, target, member_index)

    async def stall() -> dict:
        async with stalled_frame_peers(address, key, stalled, rng=rng) as sent:
            during = rss_kib(pid)
            counters = _status(target).get("transport", {})
            await trio.sleep(STALL_HOLD_S)
            held = rss_kib(pid)
        return {"peers": stalled, "half_frames_sent": sent, "rss_kib_during": during, "rss_kib_held": held,
                "counters_during": _grown(counters_before, counters)}

    result["stall"] = trio.run(stall)
    time.sleep(2.0)
    result["rss_kib"]["after_stall"] = rss_kib(pid)
    result["member_after_stall"] = _member_dials_in(root, target, member_index)

    time.sleep(3.0)  # the restarted member settles
    epoch_quiet, cpu_quiet = _status(target)["epoch"], cpu_s(pid)
    time.sleep(hold_s)
    quiet = {"cpu_s": round(cpu_s(pid) - cpu_quiet, 2), "epochs": _status(target)["epoch"] - epoch_quiet}

    async def hold() -> dict:
        async with stream_holders(address, key, holders, rng=rng) as state:
            epoch, cpu = _status(target)["epoch"], cpu_s(pid)
            await trio.sleep(hold_s)
            return {"peers": holders, "connected": state["connected"], "still_holding": state["holding"],
                    "cpu_s": round(cpu_s(pid) - cpu, 2), "epochs": _status(target)["epoch"] - epoch,
                    "rss_kib": rss_kib(pid)}

    result["hold"] = dict(trio.run(hold), seconds=hold_s, quiet_before=quiet)
    result["member_after_hold"] = _member_dials_in(root, target, member_index)
    result["node_alive"] = launcher.process_state(pid) == "running"
    result["transport_counters_grown"] = _grown(counters_before, _status(target).get("transport", {}))
    result["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    return result
