"""libp2p-only transport properties (SPEC.md "Transport / Security", "Shutdown").

Real hosts on 127.0.0.1, each test bounded by trio.fail_after.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from contextlib import asynccontextmanager

import pytest
import trio

from keys.identity import SigningIdentity, peer_id_bytes
from meshnode.net.libp2p_transport import _DirectSocket, open_libp2p_transport

SEED_NODE = bytes([5]) * 32
SEED_PLAINTEXT = bytes([6]) * 32
KEY_NODE = SigningIdentity(SEED_NODE).public_key
KEY_PLAINTEXT = SigningIdentity(SEED_PLAINTEXT).public_key
TEST_TIMEOUT_S = 8


def plaintext_only_host():
    """A host offering only /plaintext/2.0.0: what a downgrade attacker would offer."""
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.network.config import ConnectionConfig, RetryConfig
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    key_pair = create_new_key_pair(SEED_PLAINTEXT)
    host = new_host(
        key_pair=key_pair,
        sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
        connection_config=ConnectionConfig(max_connections_per_peer=1),
    )
    host.get_network().retry_config = RetryConfig(max_retries=0)
    return host


async def test_host_identity_is_the_signing_key():
    with trio.fail_after(TEST_TIMEOUT_S):
        async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"]) as transport:
            assert transport.local_key == KEY_NODE
            assert transport.listen_addrs[0].endswith("/p2p/" + SigningIdentity(SEED_NODE).peer_id)


async def test_plaintext_peer_is_refused_both_ways():
    import multiaddr
    from libp2p.exceptions import BaseLibp2pError
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo

    from meshnode.net.transport import PROTOCOL_ID

    intruder = plaintext_only_host()
    with trio.fail_after(TEST_TIMEOUT_S):
        async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"]) as node:
            async with intruder.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                node_addr = multiaddr.Multiaddr(node.listen_addrs[0].split("/p2p/")[0])
                with pytest.raises(BaseLibp2pError):
                    await intruder.connect(PeerInfo(ID(peer_id_bytes(KEY_NODE)), [node_addr]))
                with pytest.raises(BaseLibp2pError):
                    await intruder.new_stream(ID(peer_id_bytes(KEY_NODE)), [PROTOCOL_ID])

                intruder_addr = str(intruder.get_addrs()[0]).split("/p2p/")[0]
                await node.connect(KEY_PLAINTEXT, intruder_addr)
                assert node.counters["dial_failed"] == 1

                assert node.peers() == set()
                assert node.counters["frames_received"] == 0
                with pytest.raises(trio.WouldBlock):
                    node.incoming.receive_nowait()
                await intruder.close()


def test_sigint_leaves_without_a_traceback(tmp_path):
    """Ctrl-C while two connected transports run under cancel_on_signals: the
    transports shut down in order, the process exits 0, nothing on stderr."""
    script = textwrap.dedent(
        """
        import trio
        from meshnode.net.libp2p_transport import open_libp2p_transport
        from meshnode.net.transport import cancel_on_signals

        async def run_two_nodes():
            addr = "/ip4/127.0.0.1/tcp/0"
            async with open_libp2p_transport(bytes([1]) * 32, [addr]) as a:
                async with open_libp2p_transport(bytes([2]) * 32, [addr]) as b:
                    await a.connect(b.local_key, b.listen_addrs[0])
                    while not b.peers():
                        await trio.sleep(0.01)
                    await a.send(b.local_key, b"hello")
                    await b.incoming.receive()
                    print("ready", flush=True)
                    await trio.sleep_forever()

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_on_signals, nursery.cancel_scope)
                nursery.start_soon(run_two_nodes)

        trio.run(main)
        print("clean", flush=True)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert (process.returncode, stdout, stderr) == (0, "clean\n", "")


SEED_PEER = bytes([7]) * 32
KEY_PEER = SigningIdentity(SEED_PEER).public_key
QUIET_PINGS_MS = 3_600_000   # one ping at connect, then none during the test


async def _wait_connected(a, b) -> None:
    while not (a.peers() and b.peers()):
        await trio.sleep(0.005)


@asynccontextmanager
async def quiet_connected_pair():
    """Two transports on loopback, connected, with pings too rare to disturb a count."""
    async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"], ping_interval_ms=QUIET_PINGS_MS) as a:
        async with open_libp2p_transport(SEED_PEER, ["/ip4/127.0.0.1/tcp/0"], ping_interval_ms=QUIET_PINGS_MS) as b:
            b.set_members(frozenset({KEY_NODE}))  # else b holds a's bursts back as a stranger's
            await a.connect(KEY_PEER, b.listen_addrs[0])
            await _wait_connected(a, b)
            yield a, b


async def test_small_frames_return_window_credit_in_batches():
    """py-libp2p's yamux would send a WINDOW_UPDATE frame back for every read; ours goes
    back only after half the window was read, so 100 small frames use up exactly their
    bytes of the sender's window."""
    from meshnode.net.transport import FRAME_KIND_DATA, encode_frame

    payload = b"x" * 300

    async def send_window_after_round_trip(a, b) -> int:
        # Any window update b sent while reading precedes this frame on the connection,
        # so a has applied it once the frame is here.
        await b.send(KEY_NODE, b"sync")
        assert await a.incoming.receive() == (KEY_PEER, b"sync")
        return a._links[KEY_PEER].outbound_stream.muxed_stream.send_window

    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"open the stream")
            assert await b.incoming.receive() == (KEY_NODE, b"open the stream")
            window_before = await send_window_after_round_trip(a, b)
            for _ in range(100):
                await a.send(KEY_PEER, payload)
            for _ in range(100):
                assert await b.incoming.receive() == (KEY_NODE, payload)
            window_after = await send_window_after_round_trip(a, b)
            assert window_before - window_after == 100 * len(encode_frame(FRAME_KIND_DATA, payload))


async def test_frames_larger_than_the_window_still_flow():
    """Credit comes back once half the window is read, so a sender never waits for ever."""
    from meshnode.net.libp2p_transport import YAMUX_WINDOW_BYTES

    frames = [bytes([i]) * 200_000 for i in range(5)]   # 1 MB in all, 4x the window
    assert sum(map(len, frames)) > 3 * YAMUX_WINDOW_BYTES
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            for frame in frames:
                await a.send(KEY_PEER, frame)
            assert [await b.incoming.receive() for _ in frames] == [(KEY_NODE, f) for f in frames]
            assert a.counters["send_failed"] == 0


def _tcp_socket(swarm_connection):
    """The TCP socket under one libp2p connection (SwarmConn -> yamux -> Noise -> raw)."""
    raw = swarm_connection.muxed_conn.secured_conn.conn.conn
    return raw.stream.stream.socket


async def test_connections_have_tcp_nodelay_both_ways():
    """Small frames must not wait for Nagle + delayed ACK (a 40 ms stall on loopback)."""
    import socket

    with trio.fail_after(TEST_TIMEOUT_S):
        async with open_libp2p_transport(SEED_NODE, ["/ip4/127.0.0.1/tcp/0"]) as a:
            async with open_libp2p_transport(SEED_PEER, ["/ip4/127.0.0.1/tcp/0"]) as b:
                await a.connect(KEY_PEER, b.listen_addrs[0])
                await _wait_connected(a, b)
                dialled = a._host.get_network().get_connections(a._links[KEY_PEER].peer_id)
                accepted = b._host.get_network().get_connections(b._links[KEY_NODE].peer_id)
                sockets = [_tcp_socket(c) for c in dialled + accepted]
                assert len(sockets) == 2
                assert [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets] == [1, 1]


class _ChunkedConnection:
    """A raw connection that hands out the given chunks, one per read, then EOF."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.reads = 0
        self.is_initiator = True

    async def read(self, n=None):
        self.reads += 1
        return self.chunks.pop(0) if self.chunks else b""


async def test_buffered_reads_serve_noises_small_reads_from_one_socket_read():
    # Two Noise-style messages (2-byte length, body) in one chunk, a third split over two.
    raw = _ChunkedConnection([b"\x00\x03abc\x00\x02de\x00", b"\x04fghi"])
    conn = _DirectSocket(raw)
    reads = [await conn.read(2), await conn.read(3), await conn.read(2), await conn.read(2)]
    assert reads == [b"\x00\x03", b"abc", b"\x00\x02", b"de"] and raw.reads == 1
    assert await conn.read(2) == b"\x00"   # at most n, never past what the chunk holds
    assert await conn.read(1) == b"\x04" and await conn.read(10) == b"fghi" and raw.reads == 2
    assert await conn.read(2) == b"" and raw.reads == 3   # EOF passes through
    assert conn.is_initiator is True   # everything else is the wrapped connection's


class _TaskSteps(trio.abc.Instrument):
    """Counts the steps of tasks by the name of the function they run."""

    def __init__(self):
        self.steps: dict[str, int] = {}

    def before_task_step(self, task) -> None:
        name = task.name.rsplit(".", 1)[-1]
        self.steps[name] = self.steps.get(name, 0) + 1


async def test_frames_take_fewer_task_steps_both_ways():
    """A received frame goes from yamux's connection reader to the incoming queue: the
    frame stream's own task does not run once per frame; a sent frame takes half the
    steps of the peer's writer (issue 18: trio's scheduling was the largest share of a
    node's CPU). 50 frames in lockstep, each read before the next is sent."""
    frames = 50
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"open the stream")
            assert await b.incoming.receive() == (KEY_NODE, b"open the stream")
            assert b._links[KEY_NODE].inbound_stream is not None
            counter = _TaskSteps()
            trio.lowlevel.add_instrument(counter)
            try:
                for index in range(frames):
                    await a.send(KEY_PEER, b"frame %d" % index)
                    assert await b.incoming.receive() == (KEY_NODE, b"frame %d" % index)
            finally:
                trio.lowlevel.remove_instrument(counter)
            # libp2p 0.8.1 runs a stream's handler (ours) in a task of _handle_muxed_stream;
            # before this change it stepped 200 times here (4 per frame).
            assert counter.steps.get("_handle_muxed_stream", 0) <= 2, counter.steps
            # The sender's writer: libp2p's write path stepped it 8 times per frame, ours 4, and
            # 1 once the socket is written directly and a free write lock taken without a
            # checkpoint (_DirectSocket, _write_frames_to).
            assert counter.steps.get("_write_frames", 0) <= frames + 4, counter.steps
            # The receiver's yamux reader: 2.6 steps per frame through trio's stream layers
            # (their locks and checkpoints), about one (its wake-up) reading the socket directly.
            assert counter.steps.get("_handle_incoming_with_ready_signal", 0) <= 1.5 * frames, counter.steps
            assert b.counters["frames_received"] == frames + 1


def _tasks_named(name: str) -> int:
    """Tasks of this trio run whose function is ``name``."""
    count, nurseries = 0, list(trio.lowlevel.current_root_task().child_nurseries)
    while nurseries:
        for task in nurseries.pop().child_tasks:
            count += task.name.rsplit(".", 1)[-1] == name
            nurseries.extend(task.child_nurseries)
    return count


async def test_a_replaced_frame_stream_leaves_no_task_behind():
    """A peer's new frame stream replaces its old one, which we reset ourselves: yamux wakes
    nobody for that, so its reader is ended by the replacement (else each replacement
    would leave a task waiting for ever)."""
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"first stream")
            assert await b.incoming.receive() == (KEY_NODE, b"first stream")
            handlers = _tasks_named("_handle_muxed_stream")
            a._links[KEY_PEER].outbound_stream = None   # a's next frame opens a new stream; the old is not reset
            await a.send(KEY_PEER, b"second stream")
            assert await b.incoming.receive() == (KEY_NODE, b"second stream")
            for _ in range(50):
                await trio.lowlevel.checkpoint()
            assert _tasks_named("_handle_muxed_stream") == handlers


def _muxer_of(transport, peer_key):
    """Our yamux muxer of the one connection to ``peer_key``."""
    network = transport._host.get_network()
    (connection,) = network.get_connections(transport._links[peer_key].peer_id)
    return connection.muxed_conn


async def test_whole_data_frames_of_our_streams_skip_yamuxs_loop():
    """A DATA frame of a peer's frame stream, whole in a decrypted Noise message, is taken
    before yamux's per-frame loop (issue 18: two read_exactly calls through four layers, a
    fail_after, the streams lock and five debug lines per frame, 32% of an idle node).
    Control frames (the stream's SYN, window credit) still pass through it."""
    frames = 50
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"open the stream")   # the SYN and this: yamux's loop
            assert await b.incoming.receive() == (KEY_NODE, b"open the stream")
            reader, writer = _muxer_of(b, KEY_NODE).secured_conn, _muxer_of(a, KEY_PEER).secured_conn
            before, messages_before, writes_before = reader.frames_taken, reader.messages_read, writer.writes
            for index in range(frames):
                await a.send(KEY_PEER, b"frame %d" % index)
                assert await b.incoming.receive() == (KEY_NODE, b"frame %d" % index)
            assert reader.frames_taken - before == frames
            # Their Noise messages were written and read on the socket directly, not through the
            # session's layers.
            assert reader.messages_read - messages_before >= frames and writer.writes - writes_before >= frames
            # Large frames still flow, in order: whole ones taken here, split ones by yamux.
            big = [bytes([index]) * 100_000 for index in range(4)]
            for payload in big:
                await a.send(KEY_PEER, payload)
            assert [(await b.incoming.receive())[1] for _ in big] == big


async def test_a_frame_the_node_takes_where_read_is_not_queued():
    """SPEC F1d: the node's ``take_where_read`` sees each DATA frame in yamux's reader; a frame
    it takes never reaches the incoming queue (nor wakes the node's receive loop)."""
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            offered = []

            def take(peer_key: bytes, data: bytes) -> bool:
                offered.append((peer_key, data))
                return data.startswith(b"beat")

            b.take_where_read = take
            for data in (b"beat 1", b"vote 1", b"beat 2", b"vote 2"):
                await a.send(KEY_PEER, data)
            assert await b.incoming.receive() == (KEY_NODE, b"vote 1")
            assert await b.incoming.receive() == (KEY_NODE, b"vote 2")
            assert offered == [(KEY_NODE, d) for d in (b"beat 1", b"vote 1", b"beat 2", b"vote 2")]
            assert b.counters["frames_taken_where_read"] == 2 and b.counters["frames_received"] == 4


async def test_a_frame_to_an_idle_link_is_written_at_once_without_waking_its_writer():
    """Issue 18: each heartbeat woke the link's writer task (a pass through trio's scheduler)
    to write one small frame; a frame with nothing queued before it is now written by the
    sending task, and the writer sleeps."""
    frames = 50
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"open the stream")
            assert await b.incoming.receive() == (KEY_NODE, b"open the stream")
            counter = _TaskSteps()
            trio.lowlevel.add_instrument(counter)
            try:
                for index in range(frames):
                    a.send_nowait(KEY_PEER, b"frame %d" % index)
                    assert await b.incoming.receive() == (KEY_NODE, b"frame %d" % index)
            finally:
                trio.lowlevel.remove_instrument(counter)
            # A frame finds the link busy only when another write holds the connection then (a
            # window update, a pong): then it is queued, as before.
            assert a.counters["frames_written_at_once"] >= frames * 9 // 10
            assert counter.steps.get("_write_frames", 0) <= 10, counter.steps


async def test_a_frame_the_socket_takes_in_part_is_finished_by_the_writer_before_the_next():
    """A frame written at once that the socket takes only in part: its encrypted rest is
    written by the link's writer, under the connection's write lock, before any later frame,
    so every frame arrives whole and in order."""
    with trio.fail_after(TEST_TIMEOUT_S):
        async with quiet_connected_pair() as (a, b):
            await a.send(KEY_PEER, b"open the stream")
            assert await b.incoming.receive() == (KEY_NODE, b"open the stream")
            socket = _muxer_of(a, KEY_PEER).secured_conn._socket
            whole_send = socket.send_now
            socket.send_now = lambda data: whole_send(data[:3])   # a nearly full socket buffer
            payloads = [b"frame %d " % index * (index + 1) for index in range(30)]
            for payload in payloads:
                a.send_nowait(KEY_PEER, payload)
                await trio.lowlevel.checkpoint()
            received = [await b.incoming.receive() for _ in payloads]
            assert received == [(KEY_NODE, payload) for payload in payloads]
            socket.send_now = whole_send
            await a.send(KEY_PEER, b"after")
            assert await b.incoming.receive() == (KEY_NODE, b"after")
            assert a.counters["send_failed"] == 0
