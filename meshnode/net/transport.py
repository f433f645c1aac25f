"""The node's network transport: the interface, the wire framing and the redial backoff.

The node driver talks to peers only through ``Transport`` (SPEC.md section
"Transport"). Two implementations pass one conformance suite
(tests/test_transport.py): ``libp2p_transport`` (TCP + Noise + yamux, the only
module of the project that imports libp2p) and ``memory_transport`` (an in-process
network for driver tests under ``trio.testing.MockClock``).

Framing (SPEC.md "Transport / Frames") is sans-IO here so it can be tested without a
socket: a frame on a stream is ``uvarint(length) || kind || payload`` where
``length = 1 + len(payload)``. The receiver rejects a length above its limit as soon
as the length prefix is read, before buffering any of the body.
"""

from __future__ import annotations

import collections
import random
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

import trio

from protocol.errors import MeshError, RemoteProtocolError

PROTOCOL_ID = "/meshnode/1.0.0"
# One request and its answer per stream (SPEC.md "Transport / Requests"): bulk reads such
# as a job's output never queue in front of heartbeats on the persistent stream.
REQUEST_PROTOCOL_ID = "/meshnode/request/1.0.0"
MAX_REQUEST_BYTES = 64 * 1024
REQUEST_TIMEOUT_MS = 10_000
MAX_INBOUND_REQUESTS = 16      # answered at once, all peers; more are refused (reset)

MAX_FRAME_BYTES_DEFAULT = 1 << 20
INCOMING_FRAMES_MAX_DEFAULT = 1024

# Frame kinds (SPEC.md "Transport / Frames"). DATA carries one application message;
# PING/PONG carry an opaque 8-byte token that the pong echoes, for our own RTT
# measurement (libp2p's ping reports whole milliseconds only).
FRAME_KIND_DATA = 0
FRAME_KIND_PING = 1
FRAME_KIND_PONG = 2
PING_TOKEN_BYTES = 8

# Redial backoff after a lost or failed connection (SPEC.md "Transport / Redial").
REDIAL_DELAY_MS_MIN = 100
REDIAL_DELAY_MS_MAX = 2000
# Of two members the one with the lower key dials; the other waits this long for that
# connection before it dials too (SPEC.md 8 "Dial order"). Long enough for a loaded
# lower peer to reach it in its list, short beside a mesh's lifetime.
DEFER_TO_PEER_MS = 5000


class RequestFailed(MeshError):
    """A request got no answer: the peer is not connected, refused it, or did not answer in time."""


# A request handler gets (the requester's public key as authenticated by the handshake,
# the request bytes) and returns the answer, or None to refuse without one.
RequestHandler = Callable[[bytes, bytes], Awaitable["bytes | None"]]


class FrameTooLarge(RemoteProtocolError):
    """The peer announced a frame longer than our limit; the stream must be reset."""


class Transport(Protocol):
    """What the node driver needs from the network (SPEC.md "Transport / Interface").

    Frames to one peer arrive in the order they were sent, or not at all; delivery is
    best effort and a lost connection loses what was in flight.
    """

    local_key: bytes
    """Our Ed25519 public key (32 bytes)."""
    incoming: trio.MemoryReceiveChannel[tuple[bytes, bytes]]
    """(sender public key as authenticated by the handshake, payload). Bounded: when
    full, new frames are dropped and counted in ``dropped_queue_full``."""
    counters: collections.Counter[str]
    listen_addrs: list[str]

    async def send(self, peer_key: bytes, data: bytes) -> None:
        """Queue ``data`` for ``peer_key``; never blocks on a slow peer and never raises
        for a dead or unknown one (counted in ``send_failed``). Raises
        ``LocalProtocolError`` if ``data`` is over this transport's max_frame_bytes."""
        ...

    def send_nowait(self, peer_key: bytes, data: bytes) -> None:
        """``send`` without its checkpoint: the node queues a whole Ready's messages (and a
        whole batch of received frames' answers) before its writers run, so frames to one
        peer leave in one write (issue 18: a checkpoint per message was a scheduler pass
        and a separate Noise/yamux write per frame)."""
        ...

    def peers(self) -> set[bytes]:
        """Public keys of peers with a live, authenticated connection."""
        ...

    def rtt_us(self, peer_key: bytes) -> int | None:
        """Smoothed round-trip time to a connected peer, or None if not known."""
        ...

    def set_members(self, peer_keys: frozenset[bytes]) -> None:
        """The mesh's current members: they pass the limits that hold non-members back
        (SPEC.md 8 "Limits against hostile peers"). Peers given to ``connect`` count
        as members too."""
        ...

    def serve_requests(self, handler: RequestHandler) -> None:
        """Answer requests from connected peers with ``handler`` (at most
        MAX_INBOUND_REQUESTS at once; a request over MAX_REQUEST_BYTES is refused)."""
        ...

    async def request(self, peer_key: bytes, data: bytes, timeout_ms: int = REQUEST_TIMEOUT_MS) -> bytes:
        """Send one request to a connected peer and return its answer (at most
        max_frame_bytes). Raises ``RequestFailed`` when no answer comes (counted
        ``request_failed``), ``LocalProtocolError`` if ``data`` is over MAX_REQUEST_BYTES."""
        ...

    async def connect(self, peer_key: bytes, multiaddr: str, defer_to_peer_ms: int = 0) -> None:
        """Dial ``peer_key`` at ``multiaddr`` and keep redialling it with backoff while
        this transport is open. Returns after the first attempt; a failed attempt is
        counted in ``dial_failed``, never raised. Raises ``ConfigError`` for a
        malformed address. With ``defer_to_peer_ms`` the peer is expected to dial us:
        the first dial, and the first redial after each lost connection, wait that long
        and happen only if the peer's connection has not come (SPEC.md 8 "Dial order")."""
        ...


def dials_first(local_key: bytes, peer_key: bytes) -> bool:
    """Whether we dial ``peer_key`` at once (SPEC.md 8 "Dial order"): of two members, the
    lower public key (compared as bytes) dials and the higher waits DEFER_TO_PEER_MS.
    Both dialling at once made every pair two connections at start-up (a 32-node mesh:
    992 Noise handshakes instead of 496, on the same few cores) and py-libp2p later
    trims a pair's extra connection on each side independently."""
    return local_key < peer_key


def encode_uvarint(value: int) -> bytes:
    if value < 0:
        raise ValueError("uvarint is unsigned")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_frame(kind: int, payload: bytes) -> bytes:
    return encode_uvarint(1 + len(payload)) + bytes([kind]) + payload


class FrameDecoder:
    """Incremental decoder for one stream's bytes; holds at most one partial frame.

    ``feed`` yields every complete frame as ``(kind, payload)`` (iterate it to the
    end) and raises ``RemoteProtocolError`` (``FrameTooLarge`` for an oversized
    length) at the first bad frame, after the good ones before it; after that the
    stream is unusable and must be reset.
    """

    def __init__(self, max_frame_bytes: int):
        self._max_length = max_frame_bytes + 1  # the kind byte is not payload
        self._max_prefix_bytes = (self._max_length.bit_length() + 6) // 7
        self._buffer = bytearray()

    @property
    def buffered_bytes(self) -> int:
        """Bytes of a frame not yet complete that this decoder holds."""
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[tuple[int, bytes]]:
        self._buffer += data
        while True:
            header = self._parse_length()
            if header is None:
                return
            length, prefix_bytes = header
            end = prefix_bytes + length
            if len(self._buffer) < end:
                return
            kind = self._buffer[prefix_bytes]
            payload = bytes(self._buffer[prefix_bytes + 1 : end])
            del self._buffer[:end]
            _check_frame(kind, payload)
            yield kind, payload

    def _parse_length(self) -> tuple[int, int] | None:
        value = 0
        for index, byte in enumerate(self._buffer):
            if index >= self._max_prefix_bytes:
                raise FrameTooLarge("frame length prefix longer than %d bytes" % self._max_prefix_bytes)
            value |= (byte & 0x7F) << (7 * index)
            # The partial value only grows, so an over-limit length is refused here,
            # before a single body byte is buffered.
            if value > self._max_length:
                raise FrameTooLarge("frame of at least %d bytes over limit %d" % (value, self._max_length))
            if not byte & 0x80:
                if byte == 0 and index > 0:
                    raise RemoteProtocolError("non-minimal frame length prefix")
                if value == 0:
                    raise RemoteProtocolError("empty frame (no kind byte)")
                return value, index + 1
        return None


def _check_frame(kind: int, payload: bytes) -> None:
    if kind == FRAME_KIND_DATA:
        return
    if kind in (FRAME_KIND_PING, FRAME_KIND_PONG):
        if len(payload) != PING_TOKEN_BYTES:
            raise RemoteProtocolError("ping/pong token must be %d bytes" % PING_TOKEN_BYTES)
        return
    raise RemoteProtocolError("unknown frame kind %d" % kind)


class RttEstimator:
    """Round-trip time to one peer from our PING/PONG frames, smoothed like TCP's SRTT.

    The clock of a ping starts when the frame is handed to the stream (``ping_written``),
    not when it is queued (``ping_queued``): the time a ping waits behind data frames in
    the send queue, or for the first stream to open, is ours, not the network's, and
    counting it made loopback peers read 40-100 ms. Only the newest ping is outstanding;
    a pong for an older one, or for a ping never written, gives no sample.
    """

    def __init__(self) -> None:
        self.srtt_us: int | None = None
        self._token: bytes | None = None
        self._written_s: float | None = None

    def ping_queued(self, token: bytes) -> None:
        self._token, self._written_s = token, None

    def ping_written(self, token: bytes, now_s: float) -> None:
        if token == self._token and self._written_s is None:
            self._written_s = now_s

    def pong(self, token: bytes, now_s: float) -> int | None:
        """The new sample in microseconds, or None if ``token`` answers no ping in flight."""
        if token != self._token or self._written_s is None:
            return None
        sample_us = max(0, round((now_s - self._written_s) * 1_000_000))
        self._token = self._written_s = None
        # The smoothing of TCP's SRTT (RFC 6298): new = 7/8 old + 1/8 sample.
        self.srtt_us = sample_us if self.srtt_us is None else (7 * self.srtt_us + sample_us) // 8
        return sample_us


def redial_delay_ms(failed_attempts: int, rng: random.Random, defer_to_peer_ms: int = 0) -> int:
    """Exponential backoff from REDIAL_DELAY_MS_MIN, capped at REDIAL_DELAY_MS_MAX,
    with +-10% jitter so peers that lost each other do not redial in lockstep. A side
    that defers to its peer (``defer_to_peer_ms``) waits at least that long before its
    first attempt (``failed_attempts == 0``), jittered the same way."""
    base_ms = min(REDIAL_DELAY_MS_MIN << min(failed_attempts, 16), REDIAL_DELAY_MS_MAX)
    if failed_attempts == 0:
        base_ms = max(base_ms, defer_to_peer_ms)
    return int(base_ms * rng.uniform(0.9, 1.1))


async def cancel_on_signals(cancel_scope: trio.CancelScope, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Turn Ctrl-C / SIGTERM into a cancellation of ``cancel_scope``.

    Run it in the nursery that holds the transport (``nursery.start_soon(
    cancel_on_signals, nursery.cancel_scope)``): without it trio raises
    KeyboardInterrupt inside whichever task runs, often one of libp2p's (measured:
    a BaseExceptionGroup out of yamux's reader, a traceback and exit status 1),
    and the transport's orderly shutdown is skipped.
    """
    with trio.open_signal_receiver(*signals) as received:
        async for _ in received:
            cancel_scope.cancel()
            return
