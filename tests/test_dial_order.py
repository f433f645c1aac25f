"""Start-up of a larger mesh (issue 18, n = 32 on 2 cores): one dial per pair of members
(SPEC.md 8 "Dial order") and a readiness wait that does not load the nodes it waits for.

The rule is tested sans-IO (``dials_first``, ``redial_delay_ms``), in the node driver on
the memory network under MockClock (who defers to whom), and once on two real libp2p
transports on loopback (the pair ends with one connection, made by the lower key).
"""

from __future__ import annotations

import random

import trio

from keys.identity import SigningIdentity
from meshnode.net.transport import DEFER_TO_PEER_MS, dials_first, redial_delay_ms
from meshnode.net.memory_transport import MemoryNetwork
from meshnode.node.driver import Node
from testnet import launcher
from tests.test_failover_node import memory_factory

LIBP2P_TEST_TIMEOUT_S = 30   # a deadline for a hung link, not a speed bar


def test_exactly_one_side_of_every_pair_dials_first():
    keys = [SigningIdentity(bytes([i]) * 32).public_key for i in range(1, 9)]
    for a in keys:
        for b in keys:
            if a != b:
                assert dials_first(a, b) != dials_first(b, a)
    assert dials_first(min(keys), max(keys))


def test_the_deferring_side_waits_for_its_peer_then_backs_off_as_usual():
    rng = random.Random(3)
    assert 0.9 * DEFER_TO_PEER_MS <= redial_delay_ms(0, rng, DEFER_TO_PEER_MS) <= 1.1 * DEFER_TO_PEER_MS
    # After its own dial failed (the peer may be down) the ordinary backoff applies.
    assert 180 <= redial_delay_ms(1, rng, DEFER_TO_PEER_MS) <= 220
    assert 90 <= redial_delay_ms(0, rng) <= 110  # no deferral: unchanged


async def test_each_node_defers_to_the_members_with_lower_keys(tmp_path, mock_clock):
    mock_clock.autojump_threshold = 0
    launcher.create_testnet(tmp_path / "net", 4, run_workloads=False)
    network = MemoryNetwork()
    nodes = [Node(tmp_path / "net" / ("node-%d" % i), transport_factory=memory_factory(network), run_workloads=False)
             for i in range(4)]
    keys = {node.identity.public_key for node in nodes}
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            await trio.sleep(1.0)
            for node in nodes:
                own = node.identity.public_key
                assert node.transport.deferred_to == {key for key in keys if key < own}
                assert node.transport.peers() == keys - {own}
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            node.close()


async def test_two_libp2p_nodes_dialling_each_other_make_one_connection():
    from meshnode.net.libp2p_transport import open_libp2p_transport

    seeds = sorted((bytes([1]) * 32, bytes([2]) * 32), key=lambda seed: SigningIdentity(seed).public_key)
    low_key, high_key = (SigningIdentity(seed).public_key for seed in seeds)
    defer_ms = 300   # short, so that the test outlives it
    with trio.fail_after(LIBP2P_TEST_TIMEOUT_S):
        async with open_libp2p_transport(seeds[0], ["/ip4/127.0.0.1/tcp/0"]) as low:
            async with open_libp2p_transport(seeds[1], ["/ip4/127.0.0.1/tcp/0"]) as high:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(low.connect, high_key, high.listen_addrs[0])
                    nursery.start_soon(high.connect, low_key, low.listen_addrs[0], defer_ms)
                while not (low.peers() and high.peers()):
                    await trio.sleep(0.01)
                await trio.sleep(3 * defer_ms / 1000)  # past the deferral: the high side must not dial
                for transport, peer_key, initiator in ((low, high_key, True), (high, low_key, False)):
                    peer_id = transport._links[peer_key].peer_id
                    connections = transport._host.get_network().get_connections(peer_id)
                    assert [conn.muxed_conn.is_initiator for conn in connections] == [initiator]


async def test_a_pair_that_dialled_each_other_keeps_the_same_one_connection_on_both_sides():
    """Both dial at once (a redial after a loss, or a peer started without the deferral):
    each side keeps the connection the lower key dialled and closes the other."""
    from meshnode.net.libp2p_transport import open_libp2p_transport

    seeds = sorted((bytes([1]) * 32, bytes([2]) * 32), key=lambda seed: SigningIdentity(seed).public_key)
    low_key, high_key = (SigningIdentity(seed).public_key for seed in seeds)
    with trio.fail_after(LIBP2P_TEST_TIMEOUT_S):
        async with open_libp2p_transport(seeds[0], ["/ip4/127.0.0.1/tcp/0"]) as low:
            async with open_libp2p_transport(seeds[1], ["/ip4/127.0.0.1/tcp/0"]) as high:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(low.connect, high_key, high.listen_addrs[0])
                    nursery.start_soon(high.connect, low_key, low.listen_addrs[0])

                def directions(transport, peer_key):
                    if peer_key not in transport._links:
                        return None
                    peer_id = transport._links[peer_key].peer_id
                    return [conn.muxed_conn.is_initiator
                            for conn in transport._host.get_network().get_connections(peer_id) if not conn.is_closed]

                while not (directions(low, high_key) == [True] and directions(high, low_key) == [False]):
                    await trio.sleep(0.01)
                await low.send(high_key, b"still linked")
                assert await high.incoming.receive() == (low_key, b"still linked")
                assert low.peers() == {high_key} and high.peers() == {low_key}


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_ready_asks_one_node_per_round_while_the_mesh_connects(monkeypatch):
    """32 nodes, all connected after 2 s: the old wait asked all 32 every 0.1 s (672 calls)."""
    nodes = 32
    layout = {"nodes": [{"index": i, "dir": "node-%d" % i, "pid": 1000 + i} for i in range(nodes)]}
    clock = _FakeClock()
    calls = []

    def node_status(entry):
        calls.append(entry["index"])
        connected = nodes - 1 if clock.now >= 2.0 else min(entry["index"], nodes - 2)
        return {"index": entry["index"], "connected": connected}

    monkeypatch.setattr(launcher, "load_layout", lambda root: layout)
    monkeypatch.setattr(launcher, "process_state", lambda pid: "running")
    monkeypatch.setattr(launcher, "node_status", node_status)
    rows = launcher.wait_ready("net", 60, clock=clock.monotonic, sleep=clock.sleep)
    assert [row["index"] for row in rows] == list(range(nodes))
    assert all(row["connected"] == nodes - 1 for row in rows)
    assert len(calls) <= 21 + nodes


def test_wait_ready_times_out_naming_every_node(monkeypatch):
    layout = {"nodes": [{"index": i, "dir": "node-%d" % i, "pid": 1000 + i} for i in range(3)]}
    clock = _FakeClock()
    monkeypatch.setattr(launcher, "load_layout", lambda root: layout)
    monkeypatch.setattr(launcher, "process_state", lambda pid: "running")
    monkeypatch.setattr(launcher, "node_status", lambda entry: {"index": entry["index"], "connected": 0})
    try:
        launcher.wait_ready("net", 5, clock=clock.monotonic, sleep=clock.sleep)
    except launcher.MeshError as error:
        assert "not ready after 5 s" in str(error) and "'index': 2" in str(error)
    else:
        raise AssertionError("wait_ready returned for a mesh that never connected")


def test_wait_ready_accepts_a_quorum_of_peers_at_the_timeout(monkeypatch):
    """7 nodes never all connected: at the timeout, 4 peers each (5 of 7 > 2/3) is enough,
    3 peers (4 of 7) is not."""
    layout = {"nodes": [{"index": i, "dir": "node-%d" % i, "pid": 1000 + i} for i in range(7)]}
    monkeypatch.setattr(launcher, "load_layout", lambda root: layout)
    monkeypatch.setattr(launcher, "process_state", lambda pid: "running")
    for peers, ready in ((4, True), (3, False)):
        clock = _FakeClock()
        monkeypatch.setattr(launcher, "node_status", lambda entry, peers=peers: {"index": entry["index"], "connected": peers})
        try:
            rows = launcher.wait_ready("net", 5, clock=clock.monotonic, sleep=clock.sleep)
        except launcher.MeshError:
            assert not ready
        else:
            assert ready and len(rows) == 7 and clock.now >= 5


def test_larger_meshes_get_a_longer_ready_timeout():
    assert launcher.ready_timeout_s(4) == launcher.READY_TIMEOUT_S
    assert launcher.ready_timeout_s(32) == 96


def test_testnet_up_help_states_the_readiness_rule_and_its_timeout(capsys):
    """Issue 18: `up` accepts a mesh where each node reaches a quorum once max(60, 3 x N) s passed."""
    import pytest
    from meshnode.cli import main
    with pytest.raises(SystemExit):
        main(["testnet", "up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "max(60, 3 x N) seconds" in text and "connected to a quorum" in text
    assert launcher.ready_timeout_s(4) == 60 and launcher.ready_timeout_s(32) == 3 * 32
