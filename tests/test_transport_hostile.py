"""The libp2p transport against hostile peers (SPEC.md 8 "Limits against hostile peers").

Real hosts on 127.0.0.1, each test bounded by trio.fail_after. What is measured is
what our transport holds (its MemoryBudget, its counters), not the process's RSS.
"""

from __future__ import annotations

import random

import trio

from keys.identity import SigningIdentity
from meshnode.net.libp2p_transport import open_libp2p_transport
from meshnode.net.limits import PeerLimits
from meshnode.net.hostile_probe import connect_close_cycles, overfill_yamux_window, stalled_frame_peers

SEED_NODE = bytes([21]) * 32
SEED_MEMBER = bytes([22]) * 32
SEED_STRANGER = bytes([23]) * 32
KEY_NODE = SigningIdentity(SEED_NODE).public_key
KEY_MEMBER = SigningIdentity(SEED_MEMBER).public_key
KEY_STRANGER = SigningIdentity(SEED_STRANGER).public_key
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def _exchange(node, member) -> None:
    """The member connects to the node and each gets a message from the other."""
    await member.connect(KEY_NODE, node.listen_addrs[0])
    while KEY_MEMBER not in node.peers():
        await trio.sleep(0.01)
    await member.send(KEY_NODE, b"vote")
    assert await node.incoming.receive() == (KEY_MEMBER, b"vote")
    await node.send(KEY_MEMBER, b"heartbeat")
    assert await member.incoming.receive() == (KEY_NODE, b"heartbeat")


async def test_inbound_slots_come_back_after_1000_connections():
    """py-libp2p 0.8.1 kept a slot of its 250-slot inbound limiter for every connection
    ever accepted: the 251st was refused, and so was every later one, members too."""
    churn_friendly = PeerLimits(handshake_rate_per_address_per_s=10_000, handshake_burst_per_address=10_000,
                                handshake_rate_per_s=10_000, handshake_burst=10_000,
                                nonmember_connect_rate_per_peer_per_s=10_000, nonmember_connect_burst_per_peer=10_000)
    with trio.fail_after(240):
        async with open_libp2p_transport(SEED_NODE, LOOPBACK, limits=churn_friendly) as node:
            node.set_members(frozenset({KEY_MEMBER}))
            result = await connect_close_cycles(node.listen_addrs[0], KEY_NODE, 1000, clients=4,
                                                rng=random.Random(1))
            assert result == {"connected": 1000, "refused": 0}
            async with open_libp2p_transport(SEED_MEMBER, LOOPBACK) as member:
                await _exchange(node, member)
            assert node.counters["handshake_failed"] == 0


async def test_stalled_half_frames_are_bounded_then_released():
    """30 peers each send a maximum-length prefix and 1 MiB - 1 of body, then stall.
    Non-members together hold at most their pool; every partial frame is dropped when
    the frame read timeout passes, and a member still gets through meanwhile."""
    limits = PeerLimits(nonmember_held_bytes_total_max=4 << 20, frame_read_timeout_ms=1500,
                        handshake_rate_per_address_per_s=1000, handshake_burst_per_address=1000,
                        handshake_rate_per_s=1000, handshake_burst=1000)
    with trio.fail_after(120):
        async with open_libp2p_transport(SEED_NODE, LOOPBACK, limits=limits) as node:
            node.set_members(frozenset({KEY_MEMBER}))
            peak = 0

            async def watch_memory():
                nonlocal peak
                while True:
                    peak = max(peak, node.memory.nonmember_bytes)
                    await trio.sleep(0.005)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_memory)
                async with stalled_frame_peers(node.listen_addrs[0], KEY_NODE, 30, rng=random.Random(2)) as sent:
                    assert sent >= 4                   # enough peers got their half frame in
                    assert node.counters["dropped_memory_budget"] > 0
                    async with open_libp2p_transport(SEED_MEMBER, LOOPBACK) as member:
                        await _exchange(node, member)
                    while node.memory.nonmember_bytes:  # the frame read timeout
                        await trio.sleep(0.05)
                    assert node.counters["dropped_frame_timeout"] > 0
                nursery.cancel_scope.cancel()
            assert 0 < peak <= 4 << 20
            assert node.memory.held_bytes == 0


async def test_a_stream_sent_past_its_window_closes_the_connection():
    """py-libp2p 0.8.1's yamux buffers a DATA frame past the stream's window and only
    logs it; we refuse to hold it and close the connection (a yamux protocol error)."""
    with trio.fail_after(30):
        async with open_libp2p_transport(SEED_NODE, LOOPBACK) as node:
            assert await overfill_yamux_window(node.listen_addrs[0], KEY_NODE, rng=random.Random(3))
            assert node.counters["dropped_window_exceeded"] == 1
            assert node.memory.held_bytes == 0
            while node.peers():
                await trio.sleep(0.01)


async def test_a_strangers_burst_is_cut_to_its_share_and_members_pass():
    """Non-member frames are rate limited per peer and queued only while the incoming
    queue is mostly empty; every member frame of the same burst arrives, in order."""
    with trio.fail_after(30):
        async with open_libp2p_transport(SEED_NODE, LOOPBACK) as node, \
                open_libp2p_transport(SEED_STRANGER, LOOPBACK) as stranger, \
                open_libp2p_transport(SEED_MEMBER, LOOPBACK) as member:
            node.set_members(frozenset({KEY_MEMBER}))
            await stranger.connect(KEY_NODE, node.listen_addrs[0])
            await _exchange(node, member)
            for index in range(200):
                await stranger.send(KEY_NODE, b"junk %d" % index)
                await member.send(KEY_NODE, b"vote %d" % index)
            held_back = ("dropped_nonmember_rate", "dropped_nonmember_share")
            while node.counters["frames_received"] + sum(node.counters[c] for c in held_back) < 1 + 400:
                await trio.sleep(0.01)
            received = []
            while True:
                try:
                    received.append(node.incoming.receive_nowait())
                except trio.WouldBlock:
                    break
            from_member = [data for sender, data in received if sender == KEY_MEMBER]
            from_stranger = [data for sender, data in received if sender == KEY_STRANGER]
            assert from_member == [b"vote %d" % index for index in range(200)]
            assert len(from_stranger) <= PeerLimits().nonmember_frame_burst + 10
            assert sum(node.counters[c] for c in held_back) >= 200 - len(from_stranger)


class _FakeStream:
    target_recv_window = 256 * 1024


class _FakeMuxer:
    """What _BoundedStreamBuffers and _BoundedBuffer ask of their yamux connection."""

    def __init__(self, limits: PeerLimits, streams_max: int = 4):
        from meshnode.net.limits import MemoryBudget

        self.memory = MemoryBudget(limits)
        self.streams: dict[int, _FakeStream] = {}
        self.refused: list[str] = []
        self._streams_max = streams_max

    def streams_max(self) -> int:
        return self._streams_max

    def hold(self, holder, size: int) -> bool:
        return self.memory.hold(holder, KEY_STRANGER, False, size)

    def release(self, holder) -> None:
        self.memory.release(holder)

    def refuse(self, reason: str) -> None:
        self.refused.append(reason)


def _open(muxer: _FakeMuxer, buffers, stream_id: int) -> None:
    muxer.streams[stream_id] = _FakeStream()
    buffers[stream_id] = bytearray()   # what yamux does for a new stream


def test_yamux_buffers_are_accounted_however_yamux_drops_them():
    """The bookkeeping under _BoundedYamux, deterministic: every way py-libp2p 0.8.1's
    yamux takes bytes out of a stream buffer (reads, pop, clear, del) is released."""
    from meshnode.net.libp2p_transport import _BoundedStreamBuffers

    muxer = _FakeMuxer(PeerLimits(nonmember_held_bytes_max=600 * 1024, nonmember_held_bytes_total_max=1 << 20))
    buffers = _BoundedStreamBuffers(muxer)
    for stream_id in (1, 3, 5):
        _open(muxer, buffers, stream_id)
    buffers[1].extend(bytes(200 * 1024))
    buffers[3].extend(bytes(200 * 1024))
    assert muxer.memory.held_bytes == 400 * 1024 and not muxer.refused
    buffers[5].extend(bytes(256 * 1024))              # within its window, over the peer's budget
    assert muxer.refused == ["dropped_memory_budget"] and len(buffers[5]) == 0
    del buffers[1][: 100 * 1024]                        # a read
    assert muxer.memory.held_bytes == 300 * 1024
    buffers[3].clear()
    assert muxer.memory.held_bytes == 100 * 1024
    buffers.pop(1)
    assert muxer.memory.held_bytes == 0
    buffers[5].extend(bytes(256 * 1024 + 1))          # past the window granted
    assert muxer.refused[-1] == "dropped_window_exceeded" and len(buffers[5]) == 0
    buffers[5].extend(bytes(10))
    buffers.clear()                                     # the connection goes
    assert muxer.memory.held_bytes == 0


def test_yamux_streams_per_connection_are_capped():
    from meshnode.net.libp2p_transport import _BoundedStreamBuffers

    muxer = _FakeMuxer(PeerLimits(), streams_max=2)
    buffers = _BoundedStreamBuffers(muxer)
    _open(muxer, buffers, 1)
    _open(muxer, buffers, 3)
    assert not muxer.refused
    _open(muxer, buffers, 5)
    assert muxer.refused == ["dropped_stream_limit"]
