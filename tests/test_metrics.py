"""A node's Prometheus metrics (README "Metrics", meshnode/node/metrics.py).

Driver tests: real ``Node`` objects on the in-memory network under trio's MockClock, their
registries read with prometheus_client's own text exposition and parser. One test serves
the endpoint over HTTP, on 127.0.0.1 only.
"""

import socket
import urllib.request

import pytest
import trio
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from keys.errors import ConfigError
from meshnode.cli import main
from meshnode.net.memory_transport import MemoryNetwork
from meshnode.node import config as node_config
from meshnode.node.driver import Node
from testnet import launcher
from tests.test_failover_node import memory_factory, owner_job


def scrape(node) -> dict:
    """(sample name, sorted labels) -> value, from the registry's text exposition."""
    text = generate_latest(node.metrics.registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def placement_latency_count(samples: dict) -> float:
    return samples.get(("meshnode_decision_latency_seconds_count", (("kind", "placement"),)), 0)


async def test_a_placement_moves_the_decision_latency_histogram_at_every_node(tmp_path, mock_clock):
    mock_clock.autojump_threshold = 0
    root = tmp_path / "net"
    layout = launcher.create_testnet(root, 4, run_workloads=False)
    network = MemoryNetwork()
    nodes = [Node(root / ("node-%d" % i), transport_factory=memory_factory(network), run_workloads=False)
             for i in range(4)]
    try:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            await trio.sleep(1.0)
            before = [scrape(node) for node in nodes]
            assert [placement_latency_count(s) for s in before] == [0, 0, 0, 0]
            job_id = (await nodes[0].submit(owner_job(layout))).hex()
            await trio.sleep(1.0)
            after = [scrape(node) for node in nodes]
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes:
            node.close()
    for samples in after:
        assert placement_latency_count(samples) == 1
        assert samples[("meshnode_decisions_total", (("kind", "placement"),))] == 1
        assert samples[("meshnode_jobs", (("state", "placed"),))] == 1
        assert samples[("meshnode_members", ())] == 4 and samples[("meshnode_halted", ())] == 0
        assert samples[("meshnode_messages_sent_total", ())] > 0
        assert samples[("meshnode_messages_received_total", ())] > 0
        assert len([k for k in samples if k[0] == "meshnode_peer_rtt_seconds"]) <= 3
    # Simulated GPUs of the testnet's first profile (8 x H100) are in node 0's own capability vector.
    gpu_rows = [k for k in after[0] if k[0] == "meshnode_gpu_temperature_celsius"]
    assert len(gpu_rows) == 8 and all(after[0][k] > 0 for k in gpu_rows)
    assert job_id  # the job the histogram counted
    # One registry per node: four nodes in one process, and nothing in the global registry.
    assert len({id(node.metrics.registry) for node in nodes}) == 4
    assert REGISTRY.get_sample_value("meshnode_decisions_total", {"kind": "placement"}) is None


async def test_the_endpoint_serves_on_127_0_0_1_only(tmp_path):
    root = tmp_path / "net"
    launcher.create_testnet(root, 1, run_workloads=False)
    node_dir = root / "node-0"
    config = node_config.load_config(node_dir)
    node_config.write_config(node_dir, config.__class__(**{**config.__dict__, "metrics_listen": "127.0.0.1:0"}))
    node = Node(node_dir, transport_factory=memory_factory(MemoryNetwork()), run_workloads=False)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            host, port = node.metrics_server.server_address[:2]
            url = node.metrics_url

            def fetch() -> tuple[str, str]:
                with urllib.request.urlopen(url, timeout=10) as response:
                    return response.headers["Content-Type"], response.read().decode()
            content_type, body = await trio.to_thread.run_sync(fetch)
            nursery.cancel_scope.cancel()
    finally:
        node.close()
    assert (host, url) == ("127.0.0.1", "http://127.0.0.1:%d/metrics" % port) and port > 0
    assert content_type.startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    # Read on the node's thread through the trio token: the one-member mesh, not halted.
    assert samples["meshnode_members"] == 1 and samples["meshnode_halted"] == 0
    assert node.metrics_server is None  # stopped with the node


@pytest.mark.parametrize("value, port", [("", None), ("127.0.0.1:9464", 9464), ("127.0.0.1:0", 0)])
def test_metrics_listen_round_trips(tmp_path, value, port):
    config = node_config.NodeConfig(metrics_listen=value)
    node_config.write_config(tmp_path, config)
    loaded = node_config.load_config(tmp_path)
    assert loaded == config and loaded.metrics_port == port


@pytest.mark.parametrize("value", ["0.0.0.0:9464", "localhost:9464", "127.0.0.1:70000", "9464", 9464])
def test_metrics_listen_refuses_anything_but_localhost(tmp_path, value):
    (tmp_path / "node.toml").write_text("[node]\nmetrics_listen = %s\n" % (
        value if isinstance(value, int) else '"%s"' % value))
    with pytest.raises(ConfigError) as error:
        node_config.load_config(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "node.metrics_listen: expected \"127.0.0.1:PORT\"" in message


def test_a_busy_metrics_port_stops_run_with_one_line(tmp_path, capsys):
    root = tmp_path / "net"
    launcher.create_testnet(root, 1, run_workloads=False)
    node_dir = root / "node-0"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = node_config.load_config(node_dir)
        node_config.write_config(node_dir, config.__class__(
            **{**config.__dict__, "metrics_listen": "127.0.0.1:%d" % port}))
        code = main(["run", "--node", str(node_dir)])
    _out, err = capsys.readouterr()
    # (The line before it warns that a testnet keystore is not encrypted.)
    assert code == 2 and "Traceback" not in err and err.splitlines()[-1].startswith("meshnode: error: "), err
    assert "node.metrics_listen: cannot listen on 127.0.0.1:%d" % port in err
