"""Control API (SPEC.md "Control API"): socket safety, framing, ops, subscriptions.

Socket tests use real Unix sockets in tmp_path (local only) with no clock at all; the
stall timeout is tested on a lockstep memory stream under MockClock, because autojump
would also fire while a real socket waits on the kernel.
"""

import asyncio
import os
import socket
import stat
import struct

import pytest
import trio
import trio.testing

from keys.errors import ConfigError
from meshnode.control.client import (NEED_DATA, AsyncControlClient, ClientProtocol, ControlClient, ControlError,
                                     ControlUnavailable)
from meshnode.control.server import SEND_STALL_S, ControlServer, EventHub
from meshnode.control.wire import FrameBuffer, encode_frame
from protocol import codec
from protocol.errors import LocalProtocolError, MeshError, RemoteProtocolError
from protocol.ready import Event


@pytest.fixture
def node_dir(tmp_path):
    directory = tmp_path / "n"
    directory.mkdir(mode=0o700)
    return directory


async def _echo(args):
    return {"echo": args}


async def _refuse(args):
    raise MeshError("job not found: %s" % args.get("job", "?"))


async def _buggy(args):
    return {}["missing"]


async def _unencodable(args):
    return {"ratio": 0.5}


HANDLERS = {"echo": _echo, "refuse": _refuse, "buggy": _buggy, "unencodable": _unencodable}


async def start_server(nursery, node_dir, hub=None, **kwargs):
    server = ControlServer(node_dir / "control.sock", HANDLERS, hub, **kwargs)
    await nursery.start(server.serve)
    return server


async def raw_exchange(path, data: bytes) -> list[dict]:
    """Send raw bytes, half-close, and read every frame the server sends back."""
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        frames, replies = FrameBuffer(), []
        while data := await stream.receive_some(65536):
            frames.feed(data)
            while (payload := frames.next_payload()) is not None:
                replies.append(codec.unpack(payload))
        return replies


async def test_socket_is_created_mode_0600_and_removed_on_exit(node_dir):
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir)
        info = os.lstat(node_dir / "control.sock")
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        nursery.cancel_scope.cancel()
    assert not (node_dir / "control.sock").exists()


async def test_refuses_group_writable_directory(node_dir):
    os.chmod(node_dir, 0o770)
    with pytest.raises(ConfigError, match="group- or world-writable"):
        await ControlServer(node_dir / "control.sock", HANDLERS).serve()


async def test_stale_socket_is_replaced_but_live_one_refuses_second_node(node_dir):
    stale = trio.socket.socket(trio.socket.AF_UNIX)
    await stale.bind(str(node_dir / "control.sock"))
    stale.close()  # the file stays, nobody listens: a crashed node's leftover
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir)
        with pytest.raises(ConfigError, match="already running"):
            await ControlServer(node_dir / "control.sock", HANDLERS).serve()
        nursery.cancel_scope.cancel()


async def test_request_response_unknown_op_and_handler_errors(node_dir):
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir)
        client = AsyncControlClient(node_dir)
        assert await client.call("echo", job="ab", n=3) == {"echo": {"job": "ab", "n": 3}}
        with pytest.raises(ControlError, match="unknown op 'nope'"):
            await client.call("nope")
        with pytest.raises(ControlError, match="job not found: j1"):
            await client.call("refuse", job="j1")
        with pytest.raises(ControlError, match="internal error in buggy"):
            await client.call("buggy")
        with pytest.raises(ControlError, match="not encodable"):
            await client.call("unencodable")
        assert await client.call("echo") == {"echo": {}}  # still serving after all that
        nursery.cancel_scope.cancel()


async def test_malformed_frames_get_errors_and_the_connection_survives(node_dir):
    good = encode_frame({"id": 7, "op": "echo", "args": {"x": 1}})
    not_msgpack = struct.pack(">I", 2) + b"\xc1\xc1"
    not_a_map = struct.pack(">I", len(codec.pack([1]))) + codec.pack([1])
    missing_args = encode_frame({"id": 8, "op": "echo"})
    bad_id = encode_frame({"id": "x", "op": "echo", "args": {}})
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir)
        replies = await raw_exchange(node_dir / "control.sock",
                                     not_msgpack + not_a_map + missing_args + bad_id + good)
        assert [r["ok"] for r in replies] == [False, False, False, False, True]
        assert "not valid msgpack" in replies[0]["error"]
        assert "not a map" in replies[1]["error"]
        assert replies[2]["id"] == 8 and "exactly the keys" in replies[2]["error"]
        assert "request.id" in replies[3]["error"]
        assert replies[4] == {"id": 7, "ok": True, "result": {"echo": {"x": 1}}}
        nursery.cancel_scope.cancel()


async def test_oversized_frame_closes_that_connection_only(node_dir):
    oversized = struct.pack(">I", codec.MAX_FRAME_BYTES + 1) + b"\x00" * 16
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, node_dir)
        replies = await raw_exchange(node_dir / "control.sock", oversized + encode_frame({"id": 1, "op": "echo", "args": {}}))
        assert len(replies) == 1 and replies[0]["ok"] is False and "over the" in replies[0]["error"]
        assert server.bad_frames == 1
        assert await AsyncControlClient(node_dir).call("echo", y=2) == {"echo": {"y": 2}}
        nursery.cancel_scope.cancel()


async def test_sync_client_against_server(node_dir):
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir)

        def use_sync_client():
            with ControlClient(node_dir) as client:
                first = client.call("echo", a="b")
                with pytest.raises(ControlError, match="unknown op"):
                    client.call("nope")
                return first, client.call("echo", c=1)

        assert await trio.to_thread.run_sync(use_sync_client) == ({"echo": {"a": "b"}}, {"echo": {"c": 1}})
        nursery.cancel_scope.cancel()


def test_client_says_node_not_running(node_dir):
    with pytest.raises(ControlUnavailable, match="node not running at .*no control.sock"):
        ControlClient(node_dir).call("status")


async def test_subscribe_streams_events_then_client_close_unsubscribes(node_dir):
    hub = EventHub()
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir, hub)
        events = AsyncControlClient(node_dir).subscribe()
        send_events = [Event("decided", 10, {"job": b"\x01" * 4}), Event("bid", 11, {"gpus": [0, 1]})]

        async def publish_when_subscribed():
            while hub.subscriber_count == 0:
                await trio.sleep(0)  # yields only; no clock involved
            for event in send_events:
                hub.publish(event)

        nursery.start_soon(publish_when_subscribed)
        received = [await events.__anext__(), await events.__anext__()]
        await events.aclose()
        assert received == [{"kind": e.kind, "at_ms": e.at_ms, "detail": e.detail} for e in send_events]
        while hub.subscriber_count:
            await trio.sleep(0)
        nursery.cancel_scope.cancel()


async def test_a_subscriber_that_names_kinds_gets_only_those(node_dir):
    """SPEC.md 10.7: the events of other kinds are never queued for it, so a burst of them
    cannot make it a slow subscriber."""
    hub = EventHub(queue_events=4)
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir, hub)
        events = AsyncControlClient(node_dir).subscribe(kinds=["decided", "placed"])

        async def publish_when_subscribed():
            while hub.subscriber_count == 0:
                await trio.sleep(0)
            for n in range(50):   # far more than the queue holds, none of them asked for
                hub.publish(Event("bid", n))
            hub.publish(Event("placed", 100, {"job_id": "ab"}))
            hub.publish(Event("decided", 101))

        nursery.start_soon(publish_when_subscribed)
        received = [await events.__anext__(), await events.__anext__()]
        await events.aclose()
        assert [(e["kind"], e["at_ms"]) for e in received] == [("placed", 100), ("decided", 101)]
        assert hub.dropped_subscribers == 0
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("args, error", [
    ({"kinds": []}, "kinds must be a list of 1..32"),
    ({"kinds": "decided"}, "kinds must be a list"),
    ({"kinds": ["decided", "decided"]}, "distinct"),
    ({"kinds": [7]}, "kinds must be a list"),
    ({"kinds": ["decided"], "since": 3}, "unknown argument 'since'"),
])
async def test_a_bad_subscribe_is_refused_naming_what_is_wrong(node_dir, args, error):
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir, EventHub())
        with pytest.raises(ControlError, match=error):
            async with AsyncControlClient(node_dir).subscribe(**args):
                pass
        nursery.cancel_scope.cancel()


async def test_slow_subscriber_is_dropped_with_a_final_error_frame(node_dir):
    hub = EventHub(queue_events=4)
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir, hub)
        stream = await trio.open_unix_socket(str(node_dir / "control.sock"))
        await stream.send_all(encode_frame({"id": 5, "op": "subscribe", "args": {}}))
        frames, received = FrameBuffer(), []
        while not received:  # the acknowledgement
            frames.feed(await stream.receive_some(65536))
            if (payload := frames.next_payload()) is not None:
                received.append(codec.unpack(payload))
        await trio.testing.wait_all_tasks_blocked()  # the server now waits on its empty queue
        for n in range(10):  # no checkpoint in between: one event is handed to the waiting
            hub.publish(Event("tick", n))  # sender, 4 fill the queue, the 6th overflows it
        assert hub.subscriber_count == 0 and hub.dropped_subscribers == 1
        while data := await stream.receive_some(65536):
            frames.feed(data)
            while (payload := frames.next_payload()) is not None:
                received.append(codec.unpack(payload))
        await stream.aclose()
        assert received[0] == {"id": 5, "ok": True, "result": {"subscribed": True}}
        assert [f["event"]["at_ms"] for f in received[1:6]] == [0, 1, 2, 3, 4]
        assert received[6]["ok"] is False and "too slow" in received[6]["error"]
        assert len(received) == 7
        assert await AsyncControlClient(node_dir).call("echo") == {"echo": {}}
        nursery.cancel_scope.cancel()


async def test_events_queued_while_the_server_sends_go_out_in_one_write():
    hub = EventHub()
    server = ControlServer("/unused/control.sock", HANDLERS, hub)
    to_server, server_reads = trio.testing.memory_stream_one_way_pair()
    server_writes, from_server = trio.testing.memory_stream_one_way_pair()
    writes = []
    pump = server_writes.send_all_hook

    async def count_then_pump():
        writes.append("send_all")
        await pump()
    server_writes.send_all_hook = count_then_pump
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.handle_connection, trio.StapledStream(server_writes, server_reads))
        await to_server.send_all(encode_frame({"id": 3, "op": "subscribe", "args": {}}))
        frames, received = FrameBuffer(), []

        async def read_frames(count):
            while len(received) < count:
                frames.feed(await from_server.receive_some(65536))
                while (payload := frames.next_payload()) is not None:
                    received.append(codec.unpack(payload))
        await read_frames(1)
        await trio.testing.wait_all_tasks_blocked()  # the server waits on its empty queue
        writes.clear()
        for n in range(5):  # no checkpoint in between: all five wait for the server's turn
            hub.publish(Event("decided", n))
        await read_frames(6)
        assert [f["event"]["at_ms"] for f in received[1:]] == [0, 1, 2, 3, 4]
        assert len(writes) == 1
        await to_server.aclose()
        nursery.cancel_scope.cancel()


async def test_stalled_client_is_disconnected_after_the_stall_timeout(mock_clock):
    mock_clock.autojump_threshold = 0
    server = ControlServer("/unused/control.sock", HANDLERS, EventHub())
    server_end, client_end = trio.testing.lockstep_stream_pair()  # a send blocks until it is read
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client_end.send_all, encode_frame({"id": 1, "op": "echo", "args": {}}))
        start = trio.current_time()
        await server.handle_connection(server_end)  # the client never reads the reply
        assert trio.current_time() - start == pytest.approx(SEND_STALL_S)
        assert server.connections == 0


def test_frame_buffer_splits_and_caps():
    frames = FrameBuffer(max_frame_bytes=8)
    frames.feed(encode_frame({"a": 1})[:3])
    assert frames.next_payload() is None
    frames.feed(encode_frame({"a": 1})[3:] + struct.pack(">I", 9))
    assert codec.unpack(frames.next_payload()) == {"a": 1}
    with pytest.raises(RemoteProtocolError, match="over the 8 cap"):
        frames.next_payload()


# --- the one client: a sans-IO core and its two faces ------------------------------------------

def _reply(request_id, **fields) -> bytes:
    return encode_frame({"id": request_id, **fields})


def test_client_protocol_turns_bytes_into_results_refusals_and_events():
    protocol = ClientProtocol()
    assert codec.unpack(protocol.request("status", {})[4:]) == {"id": 1, "op": "status", "args": {}}
    with pytest.raises(LocalProtocolError, match="one request at a time"):
        protocol.request("jobs", {})
    reply = _reply(1, ok=True, result={"epoch": 3})
    protocol.receive_data(reply[:5])
    assert protocol.next_reply() is NEED_DATA
    protocol.receive_data(reply[5:])
    assert protocol.next_reply() == {"epoch": 3}
    protocol.request("why", {"job_id": "ab"})
    protocol.receive_data(_reply(2, ok=False, error="job not found: ab"))
    with pytest.raises(ControlError, match="why: job not found: ab"):
        protocol.next_reply()
    protocol.request("subscribe", {})  # a refusal leaves the connection usable
    protocol.receive_data(_reply(3, ok=True, result={"subscribed": True})
                          + encode_frame({"event": {"kind": "decided", "at_ms": 1, "detail": {}}}))
    assert protocol.next_reply() == {"subscribed": True}
    assert protocol.next_event() == {"kind": "decided", "at_ms": 1, "detail": {}}
    assert protocol.next_event() is NEED_DATA
    with pytest.raises(LocalProtocolError):
        protocol.request("status", {})  # the connection now belongs to the stream
    protocol.receive_data(_reply(3, ok=False, error="subscriber too slow"))
    with pytest.raises(ControlError, match="too slow"):
        protocol.next_event()
    protocol.receive_data(b"")
    assert protocol.next_event() is None  # the node closed the stream


def test_client_protocol_bad_replies_and_a_closed_connection():
    protocol = ClientProtocol()
    protocol.request("status", {})
    protocol.receive_data(_reply(9, ok=True, result={}))
    with pytest.raises(RemoteProtocolError, match="reply id 9 does not match request 1"):
        protocol.next_reply()
    protocol = ClientProtocol()
    protocol.request("status", {})
    protocol.receive_data(b"")
    with pytest.raises(ControlUnavailable, match="closed the connection without replying"):
        protocol.next_reply()
    protocol = ClientProtocol()
    protocol.request("status", {})
    protocol.receive_data(_reply(1, ok=True, result={})[:6])
    protocol.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside a frame"):
        protocol.next_reply()


async def test_async_client_keeps_one_connection_for_its_calls(node_dir):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, node_dir)
        async with AsyncControlClient(node_dir) as client:
            for n in range(3):
                assert await client.call("echo", n=n) == {"echo": {"n": n}}
            assert server.connections == 1
        nursery.cancel_scope.cancel()


async def test_sync_client_subscription_ends_when_the_node_ends_it(node_dir):
    hub = EventHub()
    async with trio.open_nursery() as nursery:
        await start_server(nursery, node_dir, hub)

        def follow():
            with ControlClient(node_dir).subscribe() as events:
                return [event["kind"] for event in events]

        async def publish_then_end():
            while hub.subscriber_count == 0:
                await trio.sleep(0)
            hub.publish(Event("decided", 1))
            for subscription in list(hub._subscribers):
                subscription.drop("node stopping")

        nursery.start_soon(publish_then_end)
        with pytest.raises(ControlError, match="subscribe: node stopping"):
            await trio.to_thread.run_sync(follow)
        nursery.cancel_scope.cancel()


async def test_async_client_runs_on_asyncio_too(node_dir):
    """The TUI's loop is asyncio: the same client, driven by asyncio.run in a thread."""
    hub = EventHub()

    async def on_asyncio():
        async with AsyncControlClient(node_dir) as client:
            echoed = await client.call("echo", loop="asyncio")
            async with client.subscribe() as events:
                await client.call("publish")
                return echoed, (await events.__anext__())["kind"]

    async def publish(args):
        hub.publish(Event("decided", 7))
        return {}

    async with trio.open_nursery() as nursery:
        server = ControlServer(node_dir / "control.sock", dict(HANDLERS, publish=publish), hub)
        await nursery.start(server.serve)
        assert await trio.to_thread.run_sync(asyncio.run, on_asyncio()) == ({"echo": {"loop": "asyncio"}}, "decided")
        nursery.cancel_scope.cancel()


def test_sync_client_gives_up_on_a_silent_node(node_dir):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(node_dir / "control.sock"))
    listener.listen(1)  # connects succeed; nothing ever answers
    try:
        with ControlClient(node_dir, timeout_s=0.05) as client:
            with pytest.raises(ControlUnavailable, match="no reply from the node within"):
                client.call("status")
    finally:
        listener.close()


# --- idle and excess clients (issue 19: 400 idle connections locked the CLI out) -----------------

async def _exchange_on(stream, request: dict) -> dict:
    await stream.send_all(encode_frame(request))
    frames = FrameBuffer()
    while (payload := frames.next_payload()) is None:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection instead of replying"
        frames.feed(data)
    return codec.unpack(payload)


async def test_idle_clients_are_shed_oldest_first_so_the_operator_always_gets_in(mock_clock):
    mock_clock.autojump_threshold = 0
    server = ControlServer("/unused/control.sock", HANDLERS, EventHub(), max_connections=64)
    async with trio.open_nursery() as nursery:
        idle_clients = []
        for _ in range(400):  # connect and never say anything
            server_end, client_end = trio.testing.memory_stream_pair()
            idle_clients.append(client_end)
            nursery.start_soon(server.handle_connection, server_end)
            await trio.testing.wait_all_tasks_blocked()
        assert server.connections == 64 and server.evicted_connections == 400 - 64
        # The oldest idle ones were shed (their streams ended); the newest are still held.
        assert await idle_clients[0].receive_some(1) == b""
        assert await idle_clients[400 - 64 - 1].receive_some(1) == b""
        with trio.move_on_after(0.001) as still_open:
            await idle_clients[-1].receive_some(1)
        assert still_open.cancelled_caught

        operator_server_end, operator = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_connection, operator_server_end)
        assert (await _exchange_on(operator, {"id": 7, "op": "echo", "args": {"x": 1}}))["result"] == {"echo": {"x": 1}}
        assert server.connections == 64
        nursery.cancel_scope.cancel()


async def test_a_connection_answering_a_request_is_never_shed(mock_clock):
    mock_clock.autojump_threshold = 0
    release = trio.Event()

    async def slow(args):
        await release.wait()
        return {"done": True}

    server = ControlServer("/unused/control.sock", {"slow": slow, **HANDLERS}, EventHub(), max_connections=1)
    async with trio.open_nursery() as nursery:
        busy_server_end, busy = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_connection, busy_server_end)
        await busy.send_all(encode_frame({"id": 1, "op": "slow", "args": {}}))
        await trio.testing.wait_all_tasks_blocked()
        late_server_end, late = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_connection, late_server_end)
        refusal = await _exchange_on(late, {"id": 2, "op": "echo", "args": {}})
        assert refusal["ok"] is False and "too many control connections" in refusal["error"]
        release.set()
        assert (await _exchange_on(busy, {"id": 3, "op": "echo", "args": {}}))["ok"] is True
        nursery.cancel_scope.cancel()


async def test_a_silent_connection_is_closed_after_the_idle_timeout(mock_clock):
    mock_clock.autojump_threshold = 0
    server = ControlServer("/unused/control.sock", HANDLERS, EventHub(), idle_timeout_s=60.0)
    async with trio.open_nursery() as nursery:
        server_end, client = trio.testing.memory_stream_pair()
        nursery.start_soon(server.handle_connection, server_end)
        for _ in range(3):  # a client that asks now and then keeps its connection
            await trio.sleep(59.0)
            assert (await _exchange_on(client, {"id": 1, "op": "echo", "args": {}}))["ok"] is True
        start = trio.current_time()
        assert await client.receive_some(1) == b""
        assert trio.current_time() - start == pytest.approx(60.0)
        assert server.connections == 0 and server.idle_closed_connections == 1
        nursery.cancel_scope.cancel()


async def test_clients_reconnect_when_the_node_shed_their_idle_connection(node_dir):
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, node_dir, max_connections=1)
        first = AsyncControlClient(node_dir)
        assert await first.call("echo", n=1) == {"echo": {"n": 1}}
        second = AsyncControlClient(node_dir)
        assert await second.call("echo", n=2) == {"echo": {"n": 2}}  # takes the idle first's slot
        assert server.evicted_connections == 1
        assert await first.call("echo", n=3) == {"echo": {"n": 3}}  # notices, reconnects, no error
        await first.aclose()
        await second.aclose()

        def sync_calls():
            with ControlClient(node_dir) as one, ControlClient(node_dir) as other:
                assert one.call("echo", n=4) == {"echo": {"n": 4}}
                assert other.call("echo", n=5) == {"echo": {"n": 5}}
                return one.call("echo", n=6)
        assert await trio.to_thread.run_sync(sync_calls) == {"echo": {"n": 6}}
        nursery.cancel_scope.cancel()
