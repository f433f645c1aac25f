"""The node driver after an eviction (SPEC.md F5, F7): four real ``Node`` objects on an
in-memory network under trio's autojumping MockClock (no sockets between nodes, no
processes). A node cut off from the others for longer than the detection bound is
evicted; when the partition heals it learns its eviction from its peers, refuses
submissions and cancels with a clear error, and stays quiet. Without stake vouched for
by its attestation it cannot rejoin and says so.
"""

import time
from contextlib import asynccontextmanager

import pytest
import trio

from keys.attestation import issue_attestation
from keys.genesis import DEFAULT_PARAMS
from keys.identity import SigningIdentity
from keys.keystore import load_identity
from meshnode.net.memory_transport import MEMORY_ADDR_PREFIX, MemoryNetwork, MemoryTransport
from meshnode.node.driver import Node
from protocol.errors import MeshError
from protocol.messages import Constraints, JobManifest, Resources, encode_message
from testnet import launcher

NODES = 4
CUT_OFF = 3


def memory_factory(network: MemoryNetwork):
    """Node's transport factory: the genesis' TCP addresses are dialled on the memory network."""
    def factory(seed: bytes, _listen):
        transport = network.transport(SigningIdentity(seed).public_key)

        async def connect(peer_key: bytes, _addr: str, defer_to_peer_ms: int = 0) -> None:
            await MemoryTransport.connect(transport, peer_key, MEMORY_ADDR_PREFIX + peer_key.hex(), defer_to_peer_ms)
        transport.connect = connect
        return transport
    return factory


@pytest.fixture
def testnet_dir(tmp_path):
    launcher.create_testnet(tmp_path / "net", NODES, run_workloads=False)
    layout = launcher.load_layout(tmp_path / "net")
    # The cut-off node's attestation vouches no stake, so it cannot rejoin by itself.
    entry = layout["nodes"][CUT_OFF]
    authority = load_identity(tmp_path / "net" / "authority.key", None)
    now_ms = time.time_ns() // 1_000_000
    (tmp_path / "net" / ("node-%d" % CUT_OFF) / launcher.ATTESTATION_FILE).write_bytes(
        issue_attestation(authority, bytes.fromhex(entry["public_key"]), {}, 0, now_ms, now_ms + 10**9))
    return tmp_path / "net", layout


def owner_job(layout, cpu_milli: int = 100) -> bytes:
    owner = load_identity(layout["owners"][0]["key_file"], None)
    job = JobManifest(owner=owner.public_key, name="late", nonce=7, entrypoint="counter", args=(),
                      resources=Resources(gpus=0, gpu_mem_mib=0, cpu_milli=cpu_milli, mem_mib=64),
                      strategy="throughput", constraints=Constraints(zones=(), labels=(), attested=()),
                      priority=0, backups=0, max_retries=0, created_ms=0, epoch=0)
    return encode_message(owner, bytes.fromhex(layout["mesh_id"]), job)


async def test_an_evicted_node_refuses_submissions_and_stays_quiet(testnet_dir, mock_clock):
    mock_clock.autojump_threshold = 0
    root, layout = testnet_dir
    network = MemoryNetwork()
    nodes = [Node(root / ("node-%d" % i), transport_factory=memory_factory(network), run_workloads=False)
             for i in range(NODES)]
    keys = [node.identity.public_key for node in nodes]
    cut_off = nodes[CUT_OFF]
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            await trio.sleep(1.0)  # heartbeats flow: every member is watched
            assert all(node.core.epoch == 0 for node in nodes)
            for key in keys[:CUT_OFF]:
                network.cut(keys[CUT_OFF], key)
            await trio.sleep(2 * DEFAULT_PARAMS.detection_bound_ms / 1000 + 1.0)
            assert all(node.core.epoch == 1 and not node.core.view.is_member(keys[CUT_OFF])
                       for node in nodes[:CUT_OFF])
            assert cut_off.core.epoch == 0  # it cannot know yet; it cannot evict anyone alone
            for key in keys[:CUT_OFF]:
                network.heal(keys[CUT_OFF], key)
            await trio.sleep(1.0)
            assert not cut_off.core.is_member() and cut_off.core.evicted_at_epoch == 0
            status = await cut_off_status(cut_off)
            assert status["member"] is False and status["evicted_at_epoch"] == 0
            with pytest.raises(MeshError, match="this node was evicted at epoch 0;.*meshnode join"):
                await cut_off.submit(owner_job(layout))
            # Quiet: no open instance of its own, and one rejoin_unvouched notice, not one per tick.
            assert not cut_off.core.instances
            sent_before = network._open[keys[CUT_OFF]].counters["frames_sent"]
            await trio.sleep(2.0)
            assert network._open[keys[CUT_OFF]].counters["frames_sent"] - sent_before <= 4  # anti-entropy syncs
            assert all(node.core.epoch == 1 for node in nodes[:CUT_OFF])
            # The members still take jobs.
            await nodes[0].submit(owner_job(layout))
            await trio.sleep(1.0)
            assert all(len(node.core.jobs()) == 1 and node.core.jobs()[0]["state"] == "placed"
                       for node in nodes[:CUT_OFF])
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            node.close()


async def cut_off_status(node) -> dict:
    from meshnode.node.api import ControlApi
    return await ControlApi(node).status({})


async def test_checkpoint_stats_reports_write_and_replication_latency_apart(testnet_dir):
    """`checkpoint_stats` (read by `meshnode bench failover`): stored_ms - taken_ms of the
    checkpoints a node stored as the job's primary and, apart, as a backup."""
    import hashlib
    from meshnode.node.api import ControlApi
    root, _ = testnet_dir
    node = Node(root / "node-0", run_workloads=False)
    try:
        other = bytes(range(32))
        for seq, origin in ((1, node.identity.public_key), (2, other)):
            state = b"state-%d" % seq
            node._store_checkpoint({"job_id": bytes(32), "fence": 1, "seq": seq, "progress": seq,
                                    "taken_ms": time.time_ns() // 1_000_000 - 25 * seq, "state": state,
                                    "state_hash": hashlib.sha256(state).digest(), "origin": origin})
        stats = await ControlApi(node).checkpoint_stats({})
        assert len(stats["write_ms"]) == 1 and 25 <= stats["write_ms"][0] < 25 + 1000
        assert len(stats["replication_ms"]) == 1 and 50 <= stats["replication_ms"][0] < 50 + 1000
        assert stats["interval_error_us"] == []  # no workload runs here
    finally:
        node.close()


def count_ticks(nodes) -> dict:
    """id(node) -> how many times its driver ticked its core from now on."""
    ticks = {id(node): 0 for node in nodes}
    for node in nodes:
        def counting_tick(now_ms, node=node, tick=node.core.tick):
            ticks[id(node)] += 1
            return tick(now_ms)
        node.core.tick = counting_tick
    return ticks


async def test_an_idle_node_ticks_once_a_heartbeat_period_and_wakes_for_a_job(testnet_dir, mock_clock):
    """Issue 18 (SPEC.md F3a): the driver ticks the core when MeshCore.next_tick_ms says,
    not every 5 ms; an idle member ticks about once per heartbeat period, suspects nobody,
    and a submitted job (an instance opens) is still placed at once."""
    mock_clock.autojump_threshold = 0
    root, layout = testnet_dir
    async with memory_mesh(root) as nodes:
        await trio.sleep(1.0)
        ticks = count_ticks(nodes)
        await trio.sleep(2.0)
        periods = 2000 // DEFAULT_PARAMS.heartbeat_ms
        # One per period, plus the anti-entropy syncs and the moments a subject's
        # silence would reach its threshold; a 5 ms loop would make 400.
        assert all(periods <= count <= 2 * periods for count in ticks.values()), ticks
        assert not any(node.core.liveness.suspicions for node in nodes)
        await nodes[0].submit(owner_job(layout))
        await trio.sleep(0.5)   # (MockClock) rounds of 5 ms ticks while the instance is open
        assert all(len(node.core.jobs()) == 1 and node.core.jobs()[0]["state"] == "placed" for node in nodes)


async def test_a_node_with_an_open_instance_ticks_at_its_deadlines_not_every_5_ms(testnet_dir, mock_clock):
    """Issue 18 (SPEC.md F3a): while a placement waits for room (every member declined it: its
    round is held, P3a), the node ticks for its heartbeats and the instance's timers, not every
    5 ms (400 ticks in 2 s before); the placement stays open and the job pending."""
    mock_clock.autojump_threshold = 0
    root, layout = testnet_dir
    async with memory_mesh(root) as nodes:
        await trio.sleep(1.0)
        await nodes[0].submit(owner_job(layout, cpu_milli=1 << 20))   # more CPU than any node has
        await trio.sleep(0.5)
        assert all(node.core.instances for node in nodes)
        ticks = count_ticks(nodes)
        await trio.sleep(2.0)
        periods = 2000 // DEFAULT_PARAMS.heartbeat_ms
        assert all(node.core.instances for node in nodes)
        assert all(periods <= count <= 2 * periods for count in ticks.values()), ticks
        assert all(node.core.jobs()[0]["state"] == "pending" for node in nodes)


@asynccontextmanager
async def memory_mesh(root, count: int = NODES, **node_options):
    """The testnet's ``count`` nodes running on one in-memory network; stopped and closed on exit.
    ``node_options`` go to each ``Node`` (by default it runs no workloads)."""
    network = MemoryNetwork()
    node_options = {"run_workloads": False, **node_options}
    nodes = [Node(root / ("node-%d" % i), transport_factory=memory_factory(network), **node_options)
             for i in range(count)]
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            yield nodes
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            node.close()
