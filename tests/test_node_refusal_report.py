"""A node under attack says so (SPEC.md 8 "Limits against hostile peers"): refused peer
traffic becomes one `peer_traffic_refused` event and one log warning per 10 s, with
counts by reason; and the transport knows the members it must never hold back.
Real ``Node`` objects on the in-memory network under trio's autojumping MockClock.
"""

import logging

import trio

from meshnode.net.memory_transport import MemoryNetwork
from meshnode.node.driver import REFUSAL_REPORT_MS, Node
from testnet import launcher
from tests.test_failover_node import memory_factory

NODES = 4


async def test_refused_traffic_is_reported_at_most_once_per_interval(tmp_path, mock_clock, caplog):
    mock_clock.autojump_threshold = 0
    launcher.create_testnet(tmp_path / "net", NODES, run_workloads=False)
    network = MemoryNetwork()
    nodes = [Node(tmp_path / "net" / ("node-%d" % i), transport_factory=memory_factory(network), run_workloads=False)
             for i in range(NODES)]
    watched = nodes[0]
    published = []
    publish = watched.events.publish
    watched.events.publish = lambda event: (published.append(event), publish(event))
    caplog.set_level(logging.WARNING, logger="meshnode.node")
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            await trio.sleep(1.0)
            transport = network._open[watched.identity.public_key]
            assert transport.members == frozenset(node.identity.public_key for node in nodes)
            assert not [e for e in published if e.kind == "peer_traffic_refused"]

            transport.counters["refused_address_rate"] += 40
            watched.core.counters["undecodable"] += 3
            await trio.sleep(1.5)
            reports = [e for e in published if e.kind == "peer_traffic_refused"]
            assert [e.detail["counts"] for e in reports] == [{"refused_address_rate": 40, "undecodable": 3}]
            assert "refused_address_rate=40 undecodable=3" in caplog.text

            for _ in range(8):  # an attack that goes on: still one report per interval
                transport.counters["bad_frame"] += 1
                await trio.sleep(1.0)
            assert len([e for e in published if e.kind == "peer_traffic_refused"]) == 1
            await trio.sleep(REFUSAL_REPORT_MS / 1000)
            reports = [e for e in published if e.kind == "peer_traffic_refused"]
            assert [e.detail["counts"] for e in reports][1:] == [{"bad_frame": 8}]
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            node.close()
