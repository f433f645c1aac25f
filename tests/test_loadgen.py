"""`meshnode load` (testnet/loadgen.py): targets and weights, the open loop against in-process
`serve` servers on 127.0.0.1, and the endpoint table through the control API."""

import socket
import threading

import pytest
import trio

from meshnode.control.client import ControlError
from meshnode.workload.serve import LoadWindow, ServeServer
from protocol.errors import MeshError
from testnet import loadgen
from testnet.loadgen import Target, WeightedPicker, parse_target, run_load, targets_from_endpoints


@pytest.fixture
def servers():
    """Two `serve` HTTP servers on free 127.0.0.1 ports, answering in threads."""
    started = []
    for _ in range(2):
        server = ServeServer(("127.0.0.1", 0), LoadWindow(), service_ms=1)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def free_port_nobody_listens_on() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_targets_parse_with_weights_and_bad_ones_are_refused():
    assert (parse_target("127.0.0.1:8080").name, parse_target("127.0.0.1:8080").weight) == ("127.0.0.1:8080", 1.0)
    assert parse_target("svc.local:81=2.5").weight == 2.5
    assert parse_target("[::1]:81").host == "::1"
    for bad in ("127.0.0.1", "127.0.0.1:http", ":80", "h:0", "h:70000", "h:80=0", "h:80=-1", "h:80=x", "h:80=inf"):
        with pytest.raises(MeshError, match="--target"):
            parse_target(bad)


def test_weighted_picker_gives_each_target_its_exact_share_spread_out():
    heavy, light = Target("a", 1, 3.0), Target("b", 2, 1.0)
    picker = WeightedPicker([heavy, light])
    picks = [picker.pick().host for _ in range(8)]
    assert picks.count("a") == 6 and picks.count("b") == 2
    assert "bb" not in "".join(picks)   # smooth: the light one is never picked twice in a row


async def test_open_loop_load_reaches_every_server_in_its_weights_share(servers):
    heavy = Target("127.0.0.1", servers[0].server_address[1], 3.0)
    light = Target("127.0.0.1", servers[1].server_address[1], 1.0)
    dead = Target("127.0.0.1", free_port_nobody_listens_on(), 1.0)
    result = await run_load([heavy, light, dead], rps=100, duration_s=0.4, timeout_s=10)
    rows = {row["target"]: row for row in result["targets"]}
    assert (result["sent"], result["ok"], result["errors"]) == (40, 32, 8)
    assert (rows[heavy.name]["sent"], rows[heavy.name]["ok"]) == (24, 24)
    assert (rows[light.name]["sent"], rows[light.name]["ok"]) == (8, 8)
    assert rows[dead.name]["error_kinds"] == {"connect": 8}
    assert rows[heavy.name]["latency_ms"]["n"] == 24 and rows[heavy.name]["latency_ms"]["p50"] >= 1.0
    # The servers saw the same: each counts a request just after its answer, so wait (bounded) for the count.
    with trio.move_on_after(30):
        while (servers[0].load.served, servers[1].load.served) != (24, 8):
            await trio.sleep(0.01)
    assert (servers[0].load.served, servers[1].load.served) == (24, 8)


async def test_requests_due_beyond_max_in_flight_are_shed_not_queued():
    """A service that accepts connections but never answers: the generator keeps at most
    max_in_flight requests open and counts the rest as shed."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    target = Target("127.0.0.1", listener.getsockname()[1])
    result = await run_load([target], rps=200, duration_s=0.1, timeout_s=2.0, max_in_flight=5)
    listener.close()
    assert result["sent"] == 20 and result["ok"] == 0
    assert result["targets"][0]["error_kinds"] == {"shed": 15, "timeout": 5}


async def test_bad_rates_and_no_targets_are_refused():
    with pytest.raises(MeshError, match="no target"):
        await run_load([], 10, 1)
    with pytest.raises(MeshError, match="--rps"):
        await run_load([Target("h", 1)], 0, 1)
    with pytest.raises(MeshError, match="--duration-s"):
        await run_load([Target("h", 1)], 10, -1)


def test_endpoint_table_rows_become_weighted_targets():
    rows = [{"replica": 0, "address": "127.0.0.1", "port": 9000, "weight": 750},
            {"replica": 1, "address": "127.0.0.1", "port": 9001, "weight": 250},
            {"replica": 2, "address": "127.0.0.1", "port": 9002, "weight": 0}]   # decayed away: no requests
    targets = targets_from_endpoints({"endpoints": rows})
    assert [(t.port, t.weight) for t in targets] == [(9000, 750.0), (9001, 250.0)]
    with pytest.raises(MeshError, match="lacks an address"):
        targets_from_endpoints([{"replica": 0, "port": 1}])
    with pytest.raises(MeshError, match="no endpoint with a weight above 0"):
        targets_from_endpoints(rows[2:])


class FakeControlClient:
    """A node's control client as a context manager; subclasses answer ``call``."""

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_node_without_the_endpoints_call_gives_a_clear_error(monkeypatch):
    class NodeWithoutEndpoints(FakeControlClient):
        def call(self, op, **args):
            raise ControlError("unknown op %r (known: jobs, status)" % op)

    import meshnode.control.client as client
    monkeypatch.setattr(client, "ControlClient", NodeWithoutEndpoints)
    with pytest.raises(MeshError, match="does not serve a job's endpoints.*--target HOST:PORT"):
        loadgen.endpoints_of_job("net/node-0", "ea9aec16873a")


def test_cli_refuses_job_without_node(capsys):
    from meshnode.cli import main
    assert main(["load", "--job", "ea9a", "--rps", "1", "--duration-s", "1"]) == 2
    assert "--job needs --node DIR" in capsys.readouterr().err


def test_job_targets_are_asked_by_job_id_as_the_control_api_names_it(monkeypatch):
    asked = []

    class Node(FakeControlClient):
        def call(self, op, **args):
            asked.append((op, args))
            return {"endpoints": [{"replica": 0, "address": "127.0.0.2", "port": 18080, "weight": 1000}]}

    import meshnode.control.client as client
    monkeypatch.setattr(client, "ControlClient", Node)
    targets = loadgen.endpoints_of_job("net/node-0", "ea9aec16873a")
    assert asked == [("endpoints", {"job_id": "ea9aec16873a"})]
    assert [(t.name, t.weight) for t in targets] == [("127.0.0.2:18080", 1000.0)]


def test_weighted_picker_keeps_its_round_robin_across_a_change_of_targets():
    a, b, c = Target("a", 1, 1.0), Target("b", 2, 1.0), Target("c", 3, 2.0)
    picker = WeightedPicker([a, b])
    assert [picker.pick().host for _ in range(3)] == ["a", "b", "a"]
    picker.set_targets([b, c])   # a retired, c cloned with twice b's weight
    picks = [picker.pick().host for _ in range(6)]
    assert picks.count("c") == 4 and picks.count("b") == 2 and "a" not in picks


async def test_load_follows_a_changed_target_list_and_reports_every_target_driven(servers):
    first = Target("127.0.0.1", servers[0].server_address[1])
    second = Target("127.0.0.1", servers[1].server_address[1])

    async def follow(retarget):
        retarget([Target(second.host, second.port, 2.0)])   # the table changed at once
        await trio.sleep_forever()                          # cancelled when the sending ends

    result = await run_load([first], rps=100, duration_s=0.1, timeout_s=10, follow=follow)
    rows = {row["target"]: row for row in result["targets"]}
    assert result["endpoint_updates"] == 1
    # Trio may run the follower or the sender's first request first (its scheduling order is
    # randomised on purpose); from the second request, 10 ms later, every one goes to the new
    # target, and both targets are reported.
    sent_first, sent_second = rows[first.name]["sent"], rows[second.name]["sent"]
    assert sent_first in (0, 1) and sent_first + sent_second == 10
    assert rows[second.name]["ok"] == sent_second
    assert rows[second.name]["weight"] == 2.0


async def test_following_the_endpoint_table_reads_it_again_at_each_event_of_the_job(monkeypatch):
    """A subscription, not a poll: the table is read once subscribed and after each event
    that names the job; another job's events read nothing."""
    tables = iter([[{"replica": 0, "address": "127.0.0.2", "port": 18080, "weight": 1000}],
                   [{"replica": 0, "address": "127.0.0.2", "port": 18080, "weight": 500},
                    {"replica": 1, "address": "127.0.0.3", "port": 18080, "weight": 1500}]])
    events = [{"kind": "replica_action", "detail": {"job_id": "ffff"}},
              {"kind": "replica_action", "detail": {"job_id": "ea9aec16873a00"}}]
    asked = []

    class Node:
        def __init__(self, path, timeout_s=None):
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

        async def call(self, op, **args):
            asked.append((op, args))
            return {"endpoints": next(tables)}

        def subscribe(self, **args):
            asked.append(("subscribe", args))
            return Stream()

    class Stream:
        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

        def __aiter__(self):
            return self

        async def __anext__(self):
            if not events:
                raise StopAsyncIteration
            return events.pop(0)

    import meshnode.control.client as client
    monkeypatch.setattr(client, "AsyncControlClient", Node)
    seen = []
    await loadgen.follow_endpoints("net/node-0", "EA9AEC16873A", lambda targets: seen.append(
        [(t.name, t.weight) for t in targets]))
    assert asked[0] == ("subscribe", {"kinds": list(loadgen.TABLE_EVENTS)})
    assert [op for op, _args in asked[1:]] == ["endpoints", "endpoints"]
    assert seen == [[("127.0.0.2:18080", 1000.0)], [("127.0.0.2:18080", 500.0), ("127.0.0.3:18080", 1500.0)]]
