"""An in-process network of ``Transport``s for driver tests (no sockets, no tasks).

It keeps the contract of meshnode/net/transport.py that the driver relies on: per-peer
order, bounded incoming queues with counted drops, receiver-side size limit,
``send`` that never raises for a dead peer, and a connection that comes back by
itself when a dialled peer reopens (here at once instead of after a redial delay,
so tests under ``trio.testing.MockClock`` need no waiting). Links can be cut and
healed to model partitions.
"""

from __future__ import annotations

import collections

import trio

from keys.errors import ConfigError
from meshnode.net.transport import (INCOMING_FRAMES_MAX_DEFAULT, MAX_FRAME_BYTES_DEFAULT, MAX_INBOUND_REQUESTS,
                                    MAX_REQUEST_BYTES, REQUEST_TIMEOUT_MS, RequestFailed, RequestHandler)
from protocol.errors import LocalProtocolError

MEMORY_ADDR_PREFIX = "/memory/"


def _link(a: bytes, b: bytes) -> frozenset[bytes]:
    return frozenset((a, b))


class MemoryNetwork:
    """The medium: which transports are open, who dialled whom, which links are cut."""

    def __init__(self, rtt_us: int = 100):
        self.rtt_us = rtt_us
        self._open: dict[bytes, MemoryTransport] = {}
        self._dialled: set[tuple[bytes, bytes]] = set()  # (dialler, target)
        self._cut: set[frozenset[bytes]] = set()

    def transport(
        self,
        key: bytes,
        max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
        incoming_frames_max: int = INCOMING_FRAMES_MAX_DEFAULT,
    ) -> "MemoryTransport":
        if key in self._open:
            raise LocalProtocolError("a transport for this key is already open")
        transport = MemoryTransport(self, key, max_frame_bytes, incoming_frames_max)
        self._open[key] = transport
        return transport

    def cut(self, a: bytes, b: bytes) -> None:
        """Partition a from b (both directions) until ``heal``."""
        self._cut.add(_link(a, b))

    def heal(self, a: bytes, b: bytes) -> None:
        self._cut.discard(_link(a, b))

    def is_live(self, a: bytes, b: bytes) -> bool:
        return (
            a != b
            and a in self._open
            and b in self._open
            and ((a, b) in self._dialled or (b, a) in self._dialled)
            and _link(a, b) not in self._cut
        )

    def _close(self, transport: "MemoryTransport") -> None:
        if self._open.get(transport.local_key) is transport:
            del self._open[transport.local_key]
        # A restarted node dials again; what the closed one dialled is forgotten.
        self._dialled = {pair for pair in self._dialled if pair[0] != transport.local_key}


class MemoryTransport:
    """One node's endpoint on a ``MemoryNetwork``; see meshnode.net.transport.Transport."""

    def __init__(self, network: MemoryNetwork, key: bytes, max_frame_bytes: int, incoming_frames_max: int):
        self._network = network
        self.local_key = key
        self.max_frame_bytes = max_frame_bytes
        self.counters: collections.Counter[str] = collections.Counter()
        self.listen_addrs = [MEMORY_ADDR_PREFIX + key.hex()]
        self._incoming_send, self.incoming = trio.open_memory_channel[tuple[bytes, bytes]](incoming_frames_max)
        self.closed = False
        self._request_handler: RequestHandler | None = None
        self._inbound_requests = 0
        self.deferred_to: set[bytes] = set()  # peers given to connect with defer_to_peer_ms

    def serve_requests(self, handler: RequestHandler) -> None:
        self._request_handler = handler

    async def request(self, peer_key: bytes, data: bytes, timeout_ms: int = REQUEST_TIMEOUT_MS) -> bytes:
        await trio.lowlevel.checkpoint()
        if len(data) > MAX_REQUEST_BYTES:
            raise LocalProtocolError("request of %d bytes over limit %d" % (len(data), MAX_REQUEST_BYTES))
        if self.closed or not self._network.is_live(self.local_key, peer_key):
            self.counters["request_failed"] += 1
            raise RequestFailed("peer %s is not connected" % peer_key.hex()[:16])
        answer = None
        with trio.move_on_after(timeout_ms / 1000):
            answer = await self._network._open[peer_key]._answer(self.local_key, data)
        if answer is None or len(answer) > self.max_frame_bytes:
            self.counters["request_failed"] += 1
            raise RequestFailed("peer %s did not answer" % peer_key.hex()[:16])
        return answer

    async def _answer(self, requester: bytes, data: bytes) -> bytes | None:
        if self._request_handler is None or self._inbound_requests >= MAX_INBOUND_REQUESTS:
            self.counters["request_refused"] += 1
            return None
        self._inbound_requests += 1
        try:
            return await self._request_handler(requester, data)
        finally:
            self._inbound_requests -= 1

    async def send(self, peer_key: bytes, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.send_nowait(peer_key, data)

    def send_nowait(self, peer_key: bytes, data: bytes) -> None:
        if len(data) > self.max_frame_bytes:
            raise LocalProtocolError("frame of %d bytes over limit %d" % (len(data), self.max_frame_bytes))
        if self.closed or not self._network.is_live(self.local_key, peer_key):
            self.counters["send_failed"] += 1
            return
        self.counters["frames_sent"] += 1
        self._network._open[peer_key]._deliver(self.local_key, data)

    def _deliver(self, sender_key: bytes, data: bytes) -> None:
        if len(data) > self.max_frame_bytes:
            self.counters["dropped_oversize"] += 1
            return
        try:
            self._incoming_send.send_nowait((sender_key, data))
        except trio.WouldBlock:
            self.counters["dropped_queue_full"] += 1
            return
        self.counters["frames_received"] += 1

    def peers(self) -> set[bytes]:
        if self.closed:
            return set()
        return {key for key in self._network._open if self._network.is_live(self.local_key, key)}

    def rtt_us(self, peer_key: bytes) -> int | None:
        return self._network.rtt_us if peer_key in self.peers() else None

    def set_members(self, peer_keys: frozenset[bytes]) -> None:
        # Only the libp2p transport limits non-members (SPEC.md 8); kept for inspection.
        self.members = frozenset(peer_keys)

    async def connect(self, peer_key: bytes, multiaddr: str, defer_to_peer_ms: int = 0) -> None:
        await trio.lowlevel.checkpoint()
        if not multiaddr.startswith(MEMORY_ADDR_PREFIX) or multiaddr[len(MEMORY_ADDR_PREFIX) :] != peer_key.hex():
            raise ConfigError("not the memory address of that peer: %r" % multiaddr)
        if self.closed:
            raise LocalProtocolError("transport is closed")
        # No dial timing here: a deferred dial (SPEC.md 8 "Dial order") counts as made
        # at once, and is noted for the tests of who defers to whom.
        if defer_to_peer_ms:
            self.deferred_to.add(peer_key)
        self._network._dialled.add((self.local_key, peer_key))
        if not self._network.is_live(self.local_key, peer_key):
            self.counters["dial_failed"] += 1

    def close(self) -> None:
        """Leave the network: peers see the connection drop; ``incoming`` ends."""
        if not self.closed:
            self.closed = True
            self._network._close(self)
            self._incoming_send.close()

    async def __aenter__(self) -> "MemoryTransport":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
