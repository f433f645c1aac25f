"""The libp2p transport: TCP + Noise + yamux, one persistent stream per peer direction.

The only module of meshnode that imports libp2p (about 0.6 s and 1300 modules):
import it only where a node really talks to the network. Every measured trap of
py-libp2p 0.8.1 (/work/shared/LIBP2P_NOTES.md) is handled here, each at the line
that handles it:

- Noise is the only security protocol and yamux the only muxer offered, so a peer
  offering plaintext, secio or TLS is refused (SPEC.md "Transport / Security").
- ``max_connections_per_peer=1`` avoids the 250 ms happy-eyeballs wait of each dial.
- The swarm's own dial retries and its 60 s "negative cache" of failed peers are
  switched off / cleared before each dial: redialling is ours (transport.redial_delay_ms).
- The swarm's auto-connector (it dials every known peer up to 150 connections) is
  stopped: the node decides whom to dial.
- Frames are length-prefixed by us (meshnode.net.transport.FrameDecoder): libp2p's
  ``stream.read(n)`` returns up to n bytes.
- yamux's receive-window credit goes back in batches, not one WINDOW_UPDATE frame
  per read (``_release_window_in_batches``).
- TCP_NODELAY is on for every connection, both directions: libp2p's TCP transport
  wraps its sockets in ``trio.SocketStream``, which sets it (checked by a test).
- Shutdown resets our streams, disconnects every peer and closes the host before
  the host context is left: leaving ``host.run()`` alone keeps the TCP listener
  (a trio system task) accepting and authenticating connections for a dead host.
- libp2p's loggers are quieted after import (they print multi-line errors on every
  refused or dropped connection); set LIBP2P_DEBUG to keep them.
- Inbound connections are served by our handler, not the swarm's
  (``_serve_inbound_connection``): py-libp2p 0.8.1's holds a slot of its inbound
  limiter (250) until the whole swarm stops, so after 250 connections had come and
  gone a node refused every new one until it restarted. Ours returns the slot when the
  connection closes and applies the limits of meshnode.net.limits (SPEC.md 8).
- yamux's receive buffers are bounded (``_BoundedYamux``): py-libp2p 0.8.1 buffers
  whatever a peer sends on a stream, window or not, and never limits inbound streams.
- A peer's frame stream is decoded in yamux's connection reader as its bytes arrive
  (``_InboundFrames``), not read by a task woken per frame; our frames are written as
  one yamux DATA frame per batch (``_write_frames_to``), not through libp2p's four locks
  per write. Both were task switches per frame (issue 18).
- A whole DATA frame of a peer's frame stream is taken before yamux's per-frame loop
  (``_DataFramesFirst``), the socket is read and written directly where it would not block
  (``_DirectSocket``), and the node may take a frame where it is read (``take_where_read``:
  heartbeats, SPEC F1d): an idle node's heartbeats were most of its CPU (issue 18).

Concurrency: each connected peer has a ``_PeerLink`` whose tasks (frame writer,
pinger, pong reader) run under the link's cancel scope and end with the connection.
Inbound streams are served in libp2p's own handler tasks, which wait for the stream's
end; their frames are taken in yamux's connection reader.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import multiaddr
import multiaddr.exceptions
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.io.exceptions import ConnectionClosedError
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.io.utils import read_exactly
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as NOISE_MAX_PLAINTEXT_BYTES
from libp2p.security.noise.io import SIZE_NOISE_MESSAGE_LEN as NOISE_LENGTH_BYTES
from libp2p.security.noise.io import NoiseTransportReadWriter
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE as YAMUX_WINDOW_BYTES
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE as YAMUX_HEADER_BYTES
from libp2p.stream_muxer.yamux.yamux import MAX_MESSAGE_SIZE as YAMUX_MAX_MESSAGE_BYTES
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA as YAMUX_TYPE_DATA
from libp2p.stream_muxer.yamux.yamux import YAMUX_HEADER_FORMAT
from libp2p.network.stream.net_stream import StreamState

from keys.identity import peer_id_bytes, public_key_from_peer_id
from meshnode.net.limits import InboundGate, KeyedRateLimiter, MemoryBudget, PeerLimits
from meshnode.net.transport import (
    FRAME_KIND_DATA,
    FRAME_KIND_PING,
    FRAME_KIND_PONG,
    INCOMING_FRAMES_MAX_DEFAULT,
    MAX_FRAME_BYTES_DEFAULT,
    MAX_INBOUND_REQUESTS,
    MAX_REQUEST_BYTES,
    PING_TOKEN_BYTES,
    PROTOCOL_ID,
    REQUEST_PROTOCOL_ID,
    REQUEST_TIMEOUT_MS,
    RequestFailed,
    RequestHandler,
    FrameDecoder,
    FrameTooLarge,
    RttEstimator,
    encode_frame,
    dials_first,
    redial_delay_ms,
)
from keys.errors import ConfigError
from protocol.errors import LocalProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

SEND_QUEUE_FRAMES_DEFAULT = 1024
PEERS_MAX_DEFAULT = 256
# One PING at connect, then one per peer every 10 s (SPEC.md 8): the RTT only feeds the mean
# a bid reports, and a PING a second to every peer was O(n) of an idle node's CPU (issue 18).
PING_INTERVAL_MS_DEFAULT = 10_000
NON_MEMBER_PING_RECHECK_MS = 1000
# As long as an acceptor may take for a handshake under load (PeerLimits.handshake_timeout_max_ms):
# a dialler that gave up at 5 s threw away handshakes its loaded peer was about to finish.
DIAL_TIMEOUT_MS = 10_000
STREAM_OPEN_TIMEOUT_MS = 2000
WRITE_TIMEOUT_MS = 2000
SHUTDOWN_TIMEOUT_MS = 3000
READ_CHUNK_BYTES = 64 * 1024
WRITE_BATCH_BYTES = 64 * 1024  # queued frames coalesced into one write, up to this size
_UNSENT_MARKER = -1   # an outbox item (never on the wire): finish the frame written at once in part
# Receive-window credit is returned to the peer once this much has been read (go-yamux's
# rule: half the window), not after every read; see _release_window_in_batches.
WINDOW_RELEASE_BYTES = YAMUX_WINDOW_BYTES // 2

# Errors a libp2p call raises for a dead peer or stream; anything else is a bug and
# propagates. libp2p's own errors share the root BaseLibp2pError.
_NETWORK_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


class _QuietLibp2pRecords(logging.Filter):
    """Drops records that libp2p modules log straight on the root logger."""

    def __init__(self, package_dir: str):
        super().__init__()
        self._package_dir = package_dir

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL or not record.pathname.startswith(self._package_dir)


def _quiet_libp2p_logging() -> None:
    if os.environ.get("LIBP2P_DEBUG"):
        return
    import libp2p

    # Levels are not enough: some modules set their own (auto_connector: INFO), and
    # their records would propagate to the node's root handlers. Stop them all here.
    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.handlers = [logging.NullHandler()]
    libp2p_logger.propagate = False
    package_dir = os.path.dirname(libp2p.__file__)
    root = logging.getLogger()
    if not any(isinstance(f, _QuietLibp2pRecords) for f in root.filters):
        root.addFilter(_QuietLibp2pRecords(package_dir))


_quiet_libp2p_logging()


def _libp2p_peer_id(public_key: bytes) -> ID:
    return ID(peer_id_bytes(public_key))


def _ed25519_key(peer_id: ID) -> bytes | None:
    """The peer's public key as authenticated by Noise, or None for a non-Ed25519 peer."""
    try:
        return public_key_from_peer_id(peer_id.to_base58())
    except RemoteProtocolError:
        return None


def _release_window_in_batches(stream: INetStream) -> None:
    """Make ``stream`` return receive-window credit in batches of WINDOW_RELEASE_BYTES.

    py-libp2p 0.8.1's yamux sends a WINDOW_UPDATE frame after every read of a stream
    (its "partial slack" and "release on read" branches both fire for small reads), so
    each of our small frames cost a second yamux frame back: another Noise message, a
    send syscall and a wake-up of the peer for nothing. Measured with two transports in
    one process, one 300-byte frame in lockstep: 3043 window updates for 3000 frames and
    about 0.9 ms CPU per frame, against 6 updates and about 0.55-0.7 ms with this rule.
    The rule is the yamux spec's (credit may be returned in any batching that keeps the
    window open): the peer's send window never falls below half before it is refilled.
    Only our protocol's streams are changed, per stream instance.
    """
    muxed = getattr(stream, "muxed_stream", None)
    if not isinstance(muxed, YamuxStream):
        return

    async def release_after_read(*, bytes_read: int = 0) -> None:
        # Synchronous up to the send: trio cannot interleave another read of this stream.
        muxed._pending_recv_release += bytes_read
        if muxed._pending_recv_release < WINDOW_RELEASE_BYTES:
            return
        increment, muxed._pending_recv_release = muxed._pending_recv_release, 0
        muxed.recv_window += increment
        await muxed.send_window_update(increment)

    # YamuxStream.read() calls this hook after taking bytes out of its buffer.
    muxed._auto_tune_and_send_window_update = release_after_read


class _DirectSocket:
    """A raw TCP connection whose reads and writes go to its socket directly, through
    libp2p's and trio's stream layers only where the socket would block.

    Reads take everything the socket holds (up to READ_CHUNK_BYTES) and serve the next
    small reads from it: py-libp2p 0.8.1's Noise reads each message as two exact reads,
    its 2-byte length and then its body, so one recv serves several messages.

    Each read or write through libp2p's stack (RawConnection, TrioTCPStream's read or write
    lock, trio's SocketStream and socket wrappers) took two locks and two or three trio
    checkpoints, each a pass through the scheduler, before its syscall: 15% of an idle
    node's CPU (issue 18). Here a recv or send the socket can serve at once is made at
    once; one that would block waits in ``trio.lowlevel.wait_readable`` / ``wait_writable``
    (where it can be cancelled, as before), and every READS_BEFORE_YIELD-th read in a row
    that did not wait yields, so a peer that floods the socket cannot starve the node's
    other tasks. One task reads (the handshake's, then yamux's connection reader) and
    writes go under yamux's connection write lock (both its own and ours,
    ``_write_frames_to``), so nothing interleaves. Errors are what libp2p's stack raises:
    a reset or broken connection raises ``ConnectionClosedError``; a socket closed here
    reads as the end (b"") and takes writes silently. Without a trio socket underneath
    (a test double) everything goes to the wrapped connection, as every other attribute does."""

    READS_BEFORE_YIELD = 16

    def __init__(self, conn):
        self._conn = conn
        self._chunk = b""
        self._offset = 0
        trio_socket = getattr(getattr(getattr(conn, "stream", None), "stream", None), "socket", None)
        self._socket = getattr(trio_socket, "_sock", None) if isinstance(trio_socket, trio.socket.SocketType) else None
        self._reads_without_wait = 0
        self._probably_empty = False

    def __getattr__(self, name):
        return getattr(self._conn, name)

    async def read(self, n: int | None = None) -> bytes:
        if self._offset >= len(self._chunk):
            chunk = await self._receive()
            if n is None or len(chunk) <= n:
                return chunk
            self._chunk, self._offset = chunk, 0
        start = self._offset
        end = len(self._chunk) if n is None else min(start + n, len(self._chunk))
        self._offset = end
        return self._chunk[start:end]

    async def _receive(self) -> bytes:
        sock = self._socket
        if sock is None:
            return await self._conn.read(READ_CHUNK_BYTES)
        while True:
            if self._probably_empty:
                # The last recv took less than a chunk, so the socket held no more then: wait
                # for it first rather than make a recv that fails (a syscall and an exception
                # per wake-up, most of them for one heartbeat).
                self._probably_empty = False
                self._reads_without_wait = 0
                try:
                    await trio.lowlevel.wait_readable(sock)
                except trio.ClosedResourceError:
                    return b""
            elif self._reads_without_wait >= self.READS_BEFORE_YIELD:
                self._reads_without_wait = 0
                await trio.lowlevel.checkpoint()
            try:
                data = sock.recv(READ_CHUNK_BYTES)
            except BlockingIOError:
                self._probably_empty = True
                continue
            except OSError as error:
                if sock.fileno() == -1:
                    return b""
                raise ConnectionClosedError("TCP connection reset by remote peer: %r" % error, transport="tcp") from error
            self._reads_without_wait += 1
            self._probably_empty = len(data) < READ_CHUNK_BYTES
            return data

    def send_now(self, data: bytes) -> int:
        """As much of ``data`` as the socket takes without waiting (0: none, or no socket)."""
        sock = self._socket
        if sock is None:
            return 0
        try:
            return sock.send(data)
        except BlockingIOError:
            return 0
        except OSError as error:
            raise ConnectionClosedError("TCP connection reset by remote peer: %r" % error, transport="tcp") from error

    async def write(self, data: bytes) -> None:
        sock = self._socket
        if sock is None:
            await self._conn.write(data)
            return
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            try:
                sent += sock.send(view[sent:])
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError:
                    return
            except OSError as error:
                if sock.fileno() == -1:
                    return
                raise ConnectionClosedError("TCP connection reset by remote peer: %r" % error, transport="tcp") from error


class _BufferedNoise(NoiseTransport):
    """Noise over ``_DirectSocket`` (a handshake and every message after it)."""

    async def secure_inbound(self, conn):
        return await super().secure_inbound(_DirectSocket(conn))

    async def secure_outbound(self, conn, peer_id):
        return await super().secure_outbound(_DirectSocket(conn), peer_id)


class _BoundedBuffer(bytearray):
    """One yamux stream's receive buffer (an entry of ``Yamux.stream_buffers``) that
    refuses what a peer may not make us hold.

    py-libp2p 0.8.1's yamux (stream_muxer/yamux/yamux.py, ``handle_incoming``) appends
    every DATA frame to the stream's buffer and only logs "peer exceeded receive
    window": a peer could pin any amount of memory in a stream nobody reads. Here a
    frame that would take the buffer past the window we granted (a yamux protocol
    violation), or the peer past its MemoryBudget, is not stored and the connection is
    closed (yamux's answer to a protocol error).
    """

    def __init__(self, muxer: "_BoundedYamux", stream_id: int):
        super().__init__()
        self._muxer = muxer
        self._stream_id = stream_id
        self.holder = object()
        # Our frame stream's reader (_InboundFrames.take), once it is attached: bytes then go
        # to it as they arrive, in yamux's connection reader, and nothing is kept here.
        self.sink = None

    def extend(self, data) -> None:
        if self.sink is not None:
            refused = self.sink(bytes(data))
            if refused is not None:
                self._muxer.refuse(refused)
            return
        size = len(self) + len(data)
        stream = self._muxer.streams.get(self._stream_id)
        window = max(YAMUX_WINDOW_BYTES, stream.target_recv_window if stream is not None else 0)
        if size > window:
            self._muxer.refuse("dropped_window_exceeded")
        elif not self._muxer.hold(self.holder, size):
            self._muxer.refuse("dropped_memory_budget")
        else:
            super().extend(data)

    def __delitem__(self, index) -> None:
        super().__delitem__(index)
        self._muxer.hold(self.holder, len(self))

    def clear(self) -> None:
        super().clear()
        self._muxer.release(self.holder)


class _BoundedStreamBuffers(dict):
    """``Yamux.stream_buffers`` whose buffers are _BoundedBuffer, released from the
    MemoryBudget however yamux drops them, and that caps the streams of a connection
    (py-libp2p 0.8.1 accepts any number of inbound streams; each may hold a window)."""

    def __init__(self, muxer: "_BoundedYamux"):
        super().__init__()
        self._muxer = muxer

    def __setitem__(self, stream_id: int, _empty_buffer: bytearray) -> None:
        super().__setitem__(stream_id, _BoundedBuffer(self._muxer, stream_id))
        if len(self) > self._muxer.streams_max():
            self._muxer.refuse("dropped_stream_limit")

    def __delitem__(self, stream_id: int) -> None:
        self._muxer.release(self[stream_id].holder)
        super().__delitem__(stream_id)

    def pop(self, stream_id: int, *default):
        buffer = super().pop(stream_id, *default)
        if isinstance(buffer, _BoundedBuffer):
            self._muxer.release(buffer.holder)
        return buffer

    def clear(self) -> None:
        for buffer in self.values():
            self._muxer.release(buffer.holder)
        super().clear()


class _BoundedYamux(Yamux):
    """Yamux with bounded receive buffers and streams (see _BoundedBuffer); the muxer
    class handed to new_host, bound to one transport by ``_bounded_yamux_for``."""

    transport: "Libp2pTransport"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream_buffers = _BoundedStreamBuffers(self)
        self._peer_key = _ed25519_key(self.peer_id) or b""
        self._refused = False
        self.secured_conn = _DataFramesFirst(self, self.secured_conn)
        # Yamux's connection write lock (py-libp2p 0.8.1 takes it only as ``async with``), as a
        # semaphore: a frame the node's task wrote in part at once (``_write_at_once``) holds it
        # until the link's writer task has written the rest; a trio.Lock is released only by
        # the task that took it.
        self._write_lock = trio.Semaphore(1)

    def _is_member(self) -> bool:
        return self.transport.is_member(self._peer_key)

    def streams_max(self) -> int:
        limits = self.transport.limits
        return limits.streams_per_member_connection_max if self._is_member() else limits.streams_per_nonmember_connection_max

    def hold(self, holder: object, size: int) -> bool:
        return self.transport.memory.hold(holder, self._peer_key, self._is_member(), size)

    def release(self, holder: object) -> None:
        self.transport.memory.release(holder)

    def refuse(self, reason: str) -> None:
        """Count ``reason`` and close the connection (once)."""
        if self._refused:
            return
        self._refused = True
        self.transport.counters[reason] += 1
        log.debug("closing connection of %s: %s", self.peer_id, reason)
        # Not in the muxer's own nursery: yamux cancels that one as soon as its reader
        # stops, which would cut the swarm's clean-up (and its "disconnected") short.
        self.transport._nursery.start_soon(self.close)


class _DataFramesFirst:
    """The secured connection as yamux's connection reader reads it: a DATA frame of one of
    our frame streams that is whole in the decrypted bytes goes straight to the stream's
    reader (``_InboundFrames.take``); yamux's loop sees only the other frames.

    py-libp2p 0.8.1's loop (``Yamux.handle_incoming``) spends per frame two ``read_exactly``
    calls through four layers, a ``fail_after`` scope, the streams lock and five debug lines
    formatted whatever the log level; on an idle node (heartbeats only) that loop was 32% of
    the process's CPU (issue 18). A frame taken here is handled as yamux would handle it:
    the stream's receive window is debited and its buffer, whose sink is our reader, gets
    the bytes. Everything else passes through unchanged, whole frames in order: control
    frames (SYN, ACK, FIN, RST, window updates, pings, GO_AWAY), DATA of streams that are
    not ours (requests, identify) and a DATA frame not yet whole (yamux reads its body with
    its own timeout). Yamux takes its streams lock for a frame; this needs none: nothing
    here waits between looking the stream up and handing the bytes over, and a stream
    being reset by another task (under that lock) has had its reader ended first, which
    drops what still comes. Bytes are read one Noise message at a time, only when none are
    left to route or hand out, so at most one message and a partial header are held here."""

    def __init__(self, muxer: "_BoundedYamux", session):
        self._muxer = muxer
        self._session = session
        # Noise messages are read and written here, on our socket, when the session is libp2p's
        # Noise over _DirectSocket (always, but for test doubles): its paths added three layers
        # of calls and three debug lines per message.
        noise = getattr(session, "conn", None)
        socket = getattr(getattr(noise, "read_writer", None), "read_write_closer", None)
        direct = isinstance(noise, NoiseTransportReadWriter) and isinstance(socket, _DirectSocket)
        self._noise, self._socket = (noise, socket) if direct else (None, None)
        self._buffer = b""
        self._offset = 0
        self._handing = 0          # bytes at the buffer's head that belong to yamux's current frame
        self.frames_taken = 0      # DATA frames routed here (tests count them)
        self.messages_read = 0     # Noise messages read off the socket here (and these)
        self.writes = 0            # writes encrypted and written on the socket here

    def __getattr__(self, name):
        return getattr(self._session, name)

    async def write(self, data: bytes) -> None:
        """Every write of the connection (yamux's and ours, under its write lock): encrypted
        here and written on our socket in one call, as the session would (Noise messages of
        at most NOISE_MAX_PLAINTEXT_BYTES, each behind its 2-byte length), without its layers."""
        if self._noise is None:
            await self._session.write(data)
            return
        await self._socket.write(self._encrypt(data))

    @property
    def writes_direct(self) -> bool:
        return self._noise is not None

    def _encrypt(self, data: bytes) -> bytes:
        messages = []
        for start in range(0, max(len(data), 1), NOISE_MAX_PLAINTEXT_BYTES):
            encrypted = self._noise.encrypt(data[start:start + NOISE_MAX_PLAINTEXT_BYTES])
            messages += (len(encrypted).to_bytes(NOISE_LENGTH_BYTES, "big"), encrypted)
        self.writes += 1
        return b"".join(messages)

    def write_now(self, data: bytes) -> bytes:
        """Encrypt ``data`` and write what the socket takes now, without waiting; the rest,
        already encrypted, is returned: it must be written (``write_encrypted``) before
        anything else on the connection. Only under the connection's write lock, and only
        where ``writes_direct``."""
        encrypted = self._encrypt(data)
        return encrypted[self._socket.send_now(encrypted):]

    async def write_encrypted(self, data: bytes) -> None:
        await self._socket.write(data)

    async def read(self, n: int | None = None) -> bytes:
        while True:
            if not self._handing:
                self._take_whole_frames()
            available = len(self._buffer) - self._offset
            if self._handing and available:
                size = min(self._handing, available) if n is None else min(self._handing, available, n)
                start = self._offset
                self._offset += size
                self._handing -= size
                return self._buffer[start:self._offset]
            message = await self._next_message()
            self._buffer = self._buffer[self._offset:] + message
            self._offset = 0

    async def _next_message(self) -> bytes:
        """One decrypted Noise message (2-byte length, then the ciphertext); raises at the end
        of the connection (IncompleteReadError) or on a message that fails to decrypt, as the
        session's own read does. What the session still holds (read before yamux started) is
        taken from it first."""
        session, noise = self._session, self._noise
        if noise is None or getattr(session, "low_watermark", 0) != getattr(session, "high_watermark", 0):
            return await session.read(None)
        length = int.from_bytes(await read_exactly(self._socket, NOISE_LENGTH_BYTES), "big")
        message = noise.decrypt(await read_exactly(self._socket, length))
        self.messages_read += 1
        return message

    def _take_whole_frames(self) -> None:
        """Route the whole DATA frames of our streams at the buffer's head; stop at the first
        frame yamux must see (``_handing`` is then its size, header and body)."""
        buffer, muxer = self._buffer, self._muxer
        while len(buffer) - self._offset >= YAMUX_HEADER_BYTES:
            header_end = self._offset + YAMUX_HEADER_BYTES
            _version, kind, flags, stream_id, length = struct.unpack(YAMUX_HEADER_FORMAT, buffer[self._offset:header_end])
            body_size = length if kind == YAMUX_TYPE_DATA else 0
            if kind != YAMUX_TYPE_DATA or flags or len(buffer) - header_end < length:
                self._handing = YAMUX_HEADER_BYTES + body_size
                return
            stream = muxer.streams.get(stream_id)
            target = muxer.stream_buffers.get(stream_id)
            if stream is None or not isinstance(target, _BoundedBuffer) or target.sink is None:
                self._handing = YAMUX_HEADER_BYTES + body_size
                return
            self._offset = header_end + length
            self.frames_taken += 1
            stream.recv_window = max(0, stream.recv_window - length)
            target.extend(buffer[header_end:self._offset])
            event = muxer.stream_events.get(stream_id)
            if event is not None:
                event.set()


def _bounded_yamux_for(transport: "Libp2pTransport") -> type[_BoundedYamux]:
    return type("BoundedYamux", (_BoundedYamux,), {"transport": transport})


def _use_muxer(host: IHost, muxer_class: type[_BoundedYamux]) -> None:
    """Make ``host`` build ``muxer_class`` for every connection, both directions.

    py-libp2p 0.8.1's ``MuxerMultistream.new_conn`` (stream_muxer/muxer_multistream.py)
    builds its own ``Yamux`` for /yamux/1.0.0 whatever class ``muxer_opt`` names. This
    replacement, on our host's instance only, negotiates the same way and builds ours;
    yamux is the only muxer we offer, so the negotiated protocol is always yamux.
    """
    muxers = host.get_network().upgrader.muxer_multistream

    async def new_conn(conn, peer_id: ID):
        protocol, _ = await muxers._selector.select(conn, conn.is_initiator, muxers.negotiate_timeout)
        return muxers._annotate_connection(muxer_class(conn, peer_id, is_initiator=conn.is_initiator), conn, protocol)

    muxers.new_conn = new_conn


def _keep_one_connection_per_pair(network: INetwork, transport: "Libp2pTransport") -> None:
    """Make ``network`` (our swarm instance only) resolve a pair's duplicate connections
    the same way on both sides: keep the newest connection that the lower key dialled,
    close the others (SPEC.md 8 "Dial order").

    py-libp2p 0.8.1's ``Swarm._trim_connections`` (called when a peer has more than
    max_connections_per_peer) closes the connection with the fewest streams, then the
    oldest, once it is past a 20 s grace period; each side judged its own list, so a
    pair that dialled each other could close both connections, lose the link and redial
    (measured on a 32-node testnet on 2 cores: 178 such closes in a minute, and the
    mesh never stayed fully connected). Both sides agree on who dialled a connection,
    so this rule keeps the same one on each. Only members' (and dialled peers')
    connections: a stranger's are left to libp2p's rule.
    """
    libp2p_trim = network._trim_connections

    def trim(peer_id: ID) -> None:
        peer_key = _ed25519_key(peer_id)
        if peer_key is None or not transport.is_member(peer_key):
            libp2p_trim(peer_id)
            return
        connections = [conn for conn in network.connections.get(peer_id, []) if not conn.is_closed]
        if len(connections) <= 1:
            return
        we_dial = dials_first(transport.local_key, peer_key)
        preferred = [conn for conn in connections if conn.muxed_conn.is_initiator == we_dial]
        keep = (preferred or connections)[-1]   # the list is in the order they were added
        for conn in connections:
            if conn is not keep:
                network.cleanup_connection_health(peer_id, conn)
                transport._nursery.start_soon(_close_quietly, conn)
        network.connections[peer_id] = [keep]

    network._trim_connections = trim


class _PeerLink:
    """Our state for one connected peer; lives as long as its connection."""

    def __init__(self, key: bytes, peer_id: ID, send_queue_frames: int):
        self.key = key
        self.peer_id = peer_id
        self.outbox_send, self.outbox_receive = trio.open_memory_channel[tuple[int, bytes]](send_queue_frames)
        self.outbound_stream: INetStream | None = None
        self.inbound_stream: INetStream | None = None
        self.inbound_reader: _InboundFrames | None = None   # reads inbound_stream
        self.cancel_scope = trio.CancelScope()
        self.lost = trio.Event()
        self.rtt = RttEstimator()
        self.last_active_s = trio.current_time()  # last frame received: idle non-members go first
        # Frames in the outbox or in the writer's hands, not yet written: a frame is written at
        # once only when there are none (a memory channel hands an item straight to a waiting
        # receiver, so the channel's own count misses the one the writer is about to write).
        self.queued = 0
        # A frame written at once in part: (connection's reader-writer, its write lock, the
        # encrypted rest), for the writer task to finish before anything else.
        self.unsent: tuple | None = None


class _InboundFrames:
    """The reading side of one peer's frame stream, decoded in yamux's connection reader.

    Before, yamux's reader put each DATA frame's bytes in the stream's buffer and woke a
    task of ours that read them (yamux's read path: a lock, an event, copies) and queued
    the frames for the driver: a task switch per frame on top of the reader's and the
    driver's (issue 18: trio was 27-45% of a node's CPU). Now the stream's buffer hands
    the bytes to ``take`` as they arrive and complete frames go straight to the
    transport's incoming queue. The stream's task (``wait_for_end``) wakes only to end the
    stream (a reset, the connection closing, a bad or oversized frame, a partial frame
    over its memory budget) or when a partial frame's read timeout is due (SPEC.md 8).
    Window credit goes back as before: once half the window was taken."""

    def __init__(self, transport: "Libp2pTransport", peer_key: bytes, stream: INetStream):
        self._transport = transport
        self._peer_key = peer_key
        self._stream = stream
        self._decoder = FrameDecoder(transport.max_frame_bytes)
        self._holder = object()      # this stream's partial frame in transport.memory
        self._muxed: YamuxStream | None = None
        self._buffer: _BoundedBuffer | None = None
        self._unreleased = 0         # bytes taken whose window credit the peer has not had back
        self._frame_started_s: float | None = None
        self._ended: str | None = None   # why the stream ends: a counter's name, "" for the peer's end
        self._wake = trio.Event()

    def attach(self) -> bool:
        """Take the stream's bytes from now on (and those already buffered); False if the
        stream is not a yamux stream of ours or is already gone."""
        muxed = getattr(self._stream, "muxed_stream", None)
        if not isinstance(muxed, YamuxStream):
            return False
        buffer = muxed.conn.stream_buffers.get(muxed.stream_id)
        if not isinstance(buffer, _BoundedBuffer) or muxed.stream_id not in muxed.conn.stream_events:
            return False
        self._muxed, self._buffer = muxed, buffer
        # Whatever arrived with or after the protocol negotiation, before this handler ran.
        pending = bytes(buffer)
        buffer.clear()
        buffer.sink = self.take
        muxed.conn.stream_events[muxed.stream_id] = _StreamEndSignal(self, muxed)
        if pending:
            refused = self.take(pending)
            if refused is not None:
                self.end(refused)
        if muxed.reset_received or muxed.recv_closed:
            self.end("")
        return True

    def detach(self) -> None:
        if self._buffer is not None and self._buffer.sink == self.take:
            self._buffer.sink = _discard
        self._transport.memory.release(self._holder)

    def end(self, why: str) -> None:
        if self._ended is None:
            self._ended = why
        self._wake.set()

    def take(self, data: bytes) -> str | None:
        """The bytes of one yamux DATA frame of this stream; the reason to close the
        connection if they pass the receive window we granted, else None."""
        if self._ended is not None:
            return None   # the stream is being reset
        transport, peer_key = self._transport, self._peer_key
        self._unreleased += len(data)
        if self._unreleased > max(YAMUX_WINDOW_BYTES, self._muxed.target_recv_window):
            return "dropped_window_exceeded"
        completed = False
        try:
            for kind, payload in self._decoder.feed(data):
                completed = True
                transport._accept_inbound_frame(peer_key, self._stream, kind, payload)
        except FrameTooLarge:
            self.end("dropped_oversize")
            return None
        except RemoteProtocolError:
            self.end("bad_frame")
            return None
        if self._unreleased >= WINDOW_RELEASE_BYTES:
            increment, self._unreleased = self._unreleased, 0
            transport._nursery.start_soon(self._return_credit, increment)
        buffered = self._decoder.buffered_bytes
        if not buffered:
            self._frame_started_s = None
        elif completed or self._frame_started_s is None:
            # A frame begun must end in time: a peer that sends a long prefix and stalls
            # pins up to max_frame_bytes until then. The task times it.
            self._frame_started_s = trio.current_time()
            self._wake.set()
        if not transport.memory.hold(self._holder, peer_key, transport.is_member(peer_key), buffered):
            self.end("dropped_memory_budget")
        return None

    async def _return_credit(self, increment: int) -> None:
        self._muxed.recv_window += increment
        try:
            await self._muxed.send_window_update(increment)
        except _NETWORK_ERRORS:
            pass

    async def wait_for_end(self) -> str:
        timeout_s = self._transport.limits.frame_read_timeout_ms / 1000
        while self._ended is None:
            started = self._frame_started_s
            with trio.move_on_at(math.inf if started is None else started + timeout_s) as scope:
                await self._wake.wait()
            self._wake = trio.Event()
            if scope.cancelled_caught and self._ended is None and self._frame_started_s == started:
                self._ended = "dropped_frame_timeout"
        return self._ended


async def _write_frames_to(stream: INetStream, data: bytes) -> None:
    """Write ``data`` on our outbound frame stream: as one yamux DATA frame when it fits
    the peer's window and one yamux message, else by libp2p's own ``write``.

    py-libp2p 0.8.1's write path (NetStream.write -> YamuxStream.write -> _write_frame)
    takes four locks and a checkpoint per write and formats a debug line whatever the log
    level: eight task steps per frame sent, measured (issue 18). Here the window is
    checked and debited and the header built with no await in between (trio runs one
    task at a time, so a WINDOW_UPDATE cannot interleave), and the frame goes out under
    the connection's write lock, which keeps yamux frames whole on the connection: one
    task step per batch, with the socket written directly (_DirectSocket)."""
    muxed = _fits_one_data_frame(stream, len(data))
    if muxed is None:
        await stream.write(data)   # waits for window, splits, raises on a closed stream
        return
    frame = _data_frame(muxed, data)
    lock = muxed.conn._write_lock
    # A free lock is taken without trio's fairness checkpoint (a pass through the scheduler
    # per frame): this task has just been woken for this batch and yields when it waits.
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        await muxed.conn.secured_conn.write(frame)
    finally:
        lock.release()


def _fits_one_data_frame(stream: INetStream, size: int) -> YamuxStream | None:
    """The yamux stream under ``stream`` when ``size`` bytes go out on it as one DATA frame
    now (open, within the peer's window and one yamux message), else None."""
    muxed = getattr(stream, "muxed_stream", None)
    if (not isinstance(muxed, YamuxStream) or getattr(stream, "_state", None) is not StreamState.OPEN
            or muxed.send_closed or muxed.closed or size > muxed.send_window
            or size > YAMUX_MAX_MESSAGE_BYTES - YAMUX_HEADER_BYTES):
        return None
    return muxed


def _data_frame(muxed: YamuxStream, data: bytes) -> bytes:
    """``data`` as a yamux DATA frame of ``muxed``, the peer's window debited (no await
    between the check and this: trio runs one task at a time)."""
    muxed.send_window -= len(data)
    return struct.pack(YAMUX_HEADER_FORMAT, 0, YAMUX_TYPE_DATA, 0, muxed.stream_id, len(data)) + data


def _discard(_data: bytes) -> None:
    """A detached stream's bytes, between the end of its reader and its reset."""
    return None


class _StreamEndSignal:
    """Stands in for yamux's wake-up event of our frame stream. Yamux sets it after every
    DATA frame, and our bytes never wait in yamux's buffer, so only the stream's end (a
    reset, the connection going) wakes the reader's task. A FIN alone, which our peers
    never send on this stream (they reset it), is seen when the connection goes."""

    def __init__(self, reader: _InboundFrames, muxed: YamuxStream):
        self._reader = reader
        self._muxed = muxed
        self._ended = trio.Event()

    def set(self) -> None:
        muxed = self._muxed
        if muxed.reset_received or muxed.recv_closed or muxed.closed or muxed.conn.event_shutting_down.is_set():
            self._reader.end("")
            self._ended.set()

    def is_set(self) -> bool:
        return self._ended.is_set()

    async def wait(self) -> None:
        await self._ended.wait()


class _ConnectionEvents(INotifee):
    def __init__(self, transport: "Libp2pTransport"):
        self._transport = transport

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._transport._on_connected(conn.muxed_conn.peer_id)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._transport._on_disconnected(conn.muxed_conn.peer_id)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        pass


class Libp2pTransport:
    """meshnode.net.transport.Transport over py-libp2p; built by ``open_libp2p_transport``."""

    def __init__(
        self,
        host: IHost,
        local_key: bytes,
        nursery: trio.Nursery,
        max_frame_bytes: int,
        incoming_frames_max: int,
        send_queue_frames: int,
        peers_max: int,
        ping_interval_ms: int,
        rng: random.Random,
        limits: PeerLimits,
    ):
        self._host = host
        self.local_key = local_key
        self._nursery = nursery
        self.max_frame_bytes = max_frame_bytes
        self._send_queue_frames = send_queue_frames
        self._peers_max = peers_max
        self._ping_interval_s = ping_interval_ms / 1000
        self._rng = rng
        self.counters: collections.Counter[str] = collections.Counter()
        self._incoming_send, self.incoming = trio.open_memory_channel[tuple[bytes, bytes]](incoming_frames_max)
        self._incoming_frames_max = incoming_frames_max
        self._links: dict[bytes, _PeerLink] = {}
        self._dial_addrs: dict[bytes, multiaddr.Multiaddr] = {}
        self._closing = False
        self.limits = limits
        self._members: frozenset[bytes] = frozenset()
        self._gate = InboundGate(limits)
        self.memory = MemoryBudget(limits)
        """What peers make us hold: partial frames and unread yamux buffers."""
        self._nonmember_frames = KeyedRateLimiter(limits.nonmember_frame_rate_per_s, limits.nonmember_frame_burst,
                                                  limits.addresses_tracked_max)
        self._request_handler: RequestHandler | None = None
        self._inbound_requests = 0
        self.take_where_read: Callable[[bytes, bytes], bool] | None = None
        """Set by the node: offered each DATA frame that passed the limits, in yamux's
        connection reader, before it is queued; True: taken (a heartbeat that only fed the
        failure detector, SPEC F1d), not queued. It must not wait or raise on bad input."""

    @property
    def listen_addrs(self) -> list[str]:
        return [str(addr) for addr in self._host.get_addrs()]

    def peers(self) -> set[bytes]:
        return set(self._links)

    def rtt_us(self, peer_key: bytes) -> int | None:
        link = self._links.get(peer_key)
        return None if link is None else link.rtt.srtt_us

    def set_members(self, peer_keys: frozenset[bytes]) -> None:
        self._members = frozenset(peer_keys)

    def is_member(self, peer_key: bytes) -> bool:
        """Members, and peers the node asked us to keep connected, pass every per-key
        limit and have their own memory budget (SPEC.md 8 "Limits against hostile peers")."""
        return peer_key in self._members or peer_key in self._dial_addrs

    async def send(self, peer_key: bytes, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        self.send_nowait(peer_key, data)

    def send_nowait(self, peer_key: bytes, data: bytes) -> None:
        if len(data) > self.max_frame_bytes:
            raise LocalProtocolError("frame of %d bytes over limit %d" % (len(data), self.max_frame_bytes))
        link = self._links.get(peer_key)
        if link is None:
            self.counters["send_failed"] += 1
            return
        self._enqueue(link, FRAME_KIND_DATA, data)

    async def connect(self, peer_key: bytes, address: str, defer_to_peer_ms: int = 0) -> None:
        try:
            target = multiaddr.Multiaddr(address)
        except (multiaddr.exceptions.Error, ValueError) as error:
            raise ConfigError("bad multiaddr %r: %s" % (address, error)) from None
        peer_id = _libp2p_peer_id(peer_key)
        if "p2p" in [protocol.name for protocol in target.protocols()]:
            if target.value_for_protocol("p2p") != peer_id.to_base58():
                raise ConfigError("multiaddr %r names another peer than the key given" % address)
            target = target.decapsulate(multiaddr.Multiaddr("/p2p/" + peer_id.to_base58()))
        if self._closing:
            raise LocalProtocolError("transport is closed")
        first_time = peer_key not in self._dial_addrs
        if first_time and len(self._dial_addrs) >= self._peers_max:
            raise LocalProtocolError("more than %d peers to keep connected" % self._peers_max)
        self._dial_addrs[peer_key] = target
        if defer_to_peer_ms:
            # The peer dials us (SPEC.md 8 "Dial order"): our first dial waits in
            # _keep_connected, where failed_attempts == 0 means "defer".
            connected = peer_key in self._links
        else:
            connected = await self._dial(peer_key, peer_id)
        if first_time:
            self._nursery.start_soon(self._keep_connected, peer_key, peer_id, connected or bool(defer_to_peer_ms),
                                     defer_to_peer_ms)

    # -- connection lifecycle -------------------------------------------------------

    async def _serve_inbound_connection(self, read_write_closer, listen_addr: multiaddr.Multiaddr) -> None:
        """Our replacement of ``Swarm._handle_inbound_connection`` (py-libp2p 0.8.1,
        network/swarm.py), installed on our swarm instance by open_libp2p_transport.

        The swarm's own handler takes a slot of its inbound limiter (max_connections -
        min_connections = 250) and, after the upgrade, waits for the whole swarm to stop
        (``self.manager.wait_finished()``) before giving the slot back: every inbound
        connection ever made kept its slot, and after 250 had come and gone every new
        one was refused until the process restarted. This handler lives exactly as long
        as its connection: it must not return earlier, because trio's serve_listeners
        closes the socket when the handler returns. The swarm-wide connection cap,
        the Noise-only upgrade and the registration (upgrade_inbound_raw_conn, add_conn)
        are still libp2p's; the connection gate and metrics it skips are unused here.
        """
        remote = read_write_closer.get_remote_address()
        address = remote[0] if remote else "?"
        refused = "dropped_closing" if self._closing else self._gate.begin_handshake(address, trio.current_time())
        if refused is not None:
            self.counters[refused] += 1
            with trio.CancelScope(shield=True):
                await _close_quietly(read_write_closer)
            return
        raw_conn = RawConnection(read_write_closer, False)
        try:
            try:
                with trio.fail_after(self._gate.handshake_timeout_s()):   # counts this one: taken above
                    muxed_conn = await self._host.get_network().upgrade_inbound_raw_conn(raw_conn, listen_addr)
            finally:
                self._gate.end_handshake(address)
        except (*_NETWORK_ERRORS, trio.TooSlowError) as error:
            self.counters["handshake_failed"] += 1
            log.debug("inbound connection from %s failed: %r", address, error)
            with trio.CancelScope(shield=True):
                await _close_quietly(raw_conn)
            return
        await muxed_conn.event_closed.wait()

    async def _dial(self, peer_key: bytes, peer_id: ID) -> bool:
        if peer_key in self._links:
            return True
        network = self._host.get_network()
        # The swarm refuses to dial a peer for 60 s after a failed dial (its "negative
        # cache"); a restarted peer must be reachable at our next redial.
        network.unblock_peer(peer_id)
        try:
            with trio.fail_after(DIAL_TIMEOUT_MS / 1000):
                await self._host.connect(PeerInfo(peer_id, [self._dial_addrs[peer_key]]))
        except (*_NETWORK_ERRORS, trio.TooSlowError) as error:
            self.counters["dial_failed"] += 1
            log.debug("dial %s failed: %r", peer_id, error)
            return False
        return peer_key in self._links

    async def _keep_connected(self, peer_key: bytes, peer_id: ID, connected: bool, defer_to_peer_ms: int) -> None:
        """Redial ``peer_key`` whenever its connection is gone (SPEC.md "Transport / Redial"
        and "Dial order")."""
        failed_attempts = 0 if connected else 1
        while True:
            link = self._links.get(peer_key)
            if link is not None:
                failed_attempts = 0
                await link.lost.wait()
                continue
            await trio.sleep(redial_delay_ms(failed_attempts, self._rng, defer_to_peer_ms) / 1000)
            if peer_key in self._links:  # the peer's own dial came meanwhile
                continue
            if await self._dial(peer_key, peer_id):
                failed_attempts = 0
            else:
                failed_attempts += 1

    def _on_connected(self, peer_id: ID) -> None:
        if self._admit(peer_id) is None and not self._closing:
            self._nursery.start_soon(self._host.disconnect, peer_id)

    def _admit(self, peer_id: ID) -> _PeerLink | None:
        """The link of an authenticated peer, made on its first connection event or
        inbound stream (whichever libp2p delivers first); None if refused."""
        if self._closing:
            return None
        peer_key = _ed25519_key(peer_id)
        if peer_key is None or (peer_key not in self._links and len(self._links) >= self._peers_max):
            self.counters["peer_rejected"] += 1
            return None
        if peer_key not in self._links:
            nonmembers = {key: link.last_active_s for key, link in self._links.items() if not self.is_member(key)}
            refused, evict = self._gate.admit_peer(peer_key, self.is_member(peer_key), nonmembers, trio.current_time())
            if refused is not None:
                self.counters[refused] += 1
                return None
            if evict is not None:
                self.counters["evicted_idle_nonmember"] += 1
                evicted = self._links[evict]
                self._drop_link(evicted)
                self._nursery.start_soon(self._host.disconnect, evicted.peer_id)
        return self._ensure_link(peer_key, peer_id)

    def _on_disconnected(self, peer_id: ID) -> None:
        peer_key = _ed25519_key(peer_id)
        link = self._links.get(peer_key) if peer_key is not None else None
        if link is None:
            return
        # With simultaneous dials a peer can briefly have two connections; the link
        # goes only with the last one.
        if any(not conn.is_closed for conn in self._host.get_network().get_connections(peer_id)):
            return
        self._drop_link(link)

    def _drop_link(self, link: _PeerLink) -> None:
        del self._links[link.key]
        link.cancel_scope.cancel()
        if link.inbound_reader is not None:
            link.inbound_reader.end("")
        link.lost.set()
        link.outbox_send.close()
        self._drop_queued(link)

    def _drop_queued(self, link: _PeerLink) -> None:
        while True:
            try:
                kind, _wire = link.outbox_receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            if kind == FRAME_KIND_DATA:
                self.counters["send_failed"] += 1

    def _ensure_link(self, peer_key: bytes, peer_id: ID) -> _PeerLink:
        link = self._links.get(peer_key)
        if link is None:
            link = _PeerLink(peer_key, peer_id, self._send_queue_frames)
            self._links[peer_key] = link
            self._nursery.start_soon(self._run_link, link)
        return link

    async def _run_link(self, link: _PeerLink) -> None:
        with link.cancel_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_frames, link, nursery)
                nursery.start_soon(self._ping_periodically, link)

    # -- outbound direction -----------------------------------------------------------

    def _enqueue(self, link: _PeerLink, kind: int, payload: bytes) -> None:
        wire = encode_frame(kind, payload)
        if kind == FRAME_KIND_DATA and self._write_at_once(link, wire):
            return
        try:
            link.outbox_send.send_nowait((kind, wire))
            link.queued += 1
        except trio.WouldBlock:
            self.counters["dropped_send_queue_full"] += 1
        except trio.ClosedResourceError:  # the link was just lost
            self.counters["send_failed"] += 1

    def _write_at_once(self, link: _PeerLink, wire: bytes) -> bool:
        """Write a frame in the sending task, without waking the link's writer, when nothing
        waits to go before it (no queued frame, no batch in the writer's hands) and it fits
        one yamux DATA frame of the open stream: the frame is encrypted and the socket takes
        what it can now. A rest the socket did not take is the writer's to finish, first,
        holding the connection's write lock until then (so nothing interleaves). False: not
        written, queue it. Why (issue 18): a heartbeat to each of k monitors per period woke k
        writer tasks, a pass through trio's scheduler each, on an otherwise idle node."""
        stream = link.outbound_stream
        if stream is None or link.queued or link.unsent is not None:
            return False
        muxed = _fits_one_data_frame(stream, len(wire))
        secured = muxed.conn.secured_conn if muxed is not None else None
        if not isinstance(secured, _DataFramesFirst) or not secured.writes_direct:
            return False
        lock = muxed.conn._write_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            return False
        try:
            rest = secured.write_now(_data_frame(muxed, wire))
        except _NETWORK_ERRORS as error:
            lock.release()
            self.counters["send_failed"] += 1   # lost with its connection, whose end comes next
            log.debug("write to %s failed: %r", link.peer_id, error)
            return True
        self.counters["frames_sent"] += 1
        self.counters["frames_written_at_once"] += 1
        if not rest:
            lock.release()
            return True
        link.unsent = (secured, lock, rest)
        link.outbox_send.send_nowait((_UNSENT_MARKER, b""))   # wakes the writer; the outbox was empty
        link.queued += 1
        return True

    async def _finish_unsent(self, link: _PeerLink) -> None:
        secured, lock, rest = link.unsent
        link.unsent = None
        try:
            with trio.move_on_after(WRITE_TIMEOUT_MS / 1000) as scope:
                await secured.write_encrypted(rest)
            failed = scope.cancelled_caught
        except _NETWORK_ERRORS:
            failed = True
        finally:
            lock.release()
        if failed and link.outbound_stream is not None:
            # A Noise message cut short corrupts what follows on the connection, as a batch
            # written in part does (_write_frames): counted, and the stream reset.
            self.counters["send_failed"] += 1
            await self._discard_outbound_stream(link, link.outbound_stream)

    async def _write_frames(self, link: _PeerLink, nursery: trio.Nursery) -> None:
        try:
            async for kind, wire in link.outbox_receive:
                batch = [(kind, wire)]
                try:
                    await self._write_batch(link, nursery, batch)
                finally:
                    link.queued -= len(batch)
        finally:
            if link.unsent is not None:   # the link is gone, and its connection with it
                link.unsent[1].release()
                link.unsent = None

    async def _write_batch(self, link: _PeerLink, nursery: trio.Nursery, batch: list) -> None:
        """The frames queued for ``link`` from ``batch``'s first on (taken into ``batch``), up
        to WRITE_BATCH_BYTES, in one write; first the rest of a frame written at once in part."""
        if link.unsent is not None:
            await self._finish_unsent(link)
        if batch[0][0] == _UNSENT_MARKER:
            return
        batch_bytes = len(batch[0][1])
        while batch_bytes < WRITE_BATCH_BYTES:
            try:
                kind, wire = link.outbox_receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):  # EndOfChannel: the link closed meanwhile
                break
            batch.append((kind, wire))
            batch_bytes += len(wire)
        data_frames = sum(1 for kind, _ in batch if kind == FRAME_KIND_DATA)
        stream = link.outbound_stream or await self._open_outbound_stream(link, nursery)
        if stream is None:
            self.counters["send_failed"] += data_frames
            return
        now_s = trio.current_time()
        for kind, wire in batch:
            if kind == FRAME_KIND_PING:
                link.rtt.ping_written(wire[-PING_TOKEN_BYTES:], now_s)
        try:
            with trio.CancelScope(deadline=trio.current_time() + WRITE_TIMEOUT_MS / 1000) as write_scope:
                await _write_frames_to(stream, b"".join(wire for _, wire in batch))
            if write_scope.cancelled_caught:
                raise trio.TooSlowError
        except (*_NETWORK_ERRORS, trio.TooSlowError) as error:
            # A partly written frame corrupts the stream: reset it, the next frame
            # opens a new one.
            self.counters["send_failed"] += data_frames
            log.debug("write to %s failed: %r", link.peer_id, error)
            await self._discard_outbound_stream(link, stream)
            return
        self.counters["frames_sent"] += data_frames

    async def _open_outbound_stream(self, link: _PeerLink, nursery: trio.Nursery) -> INetStream | None:
        try:
            with trio.fail_after(STREAM_OPEN_TIMEOUT_MS / 1000):
                stream = await self._host.new_stream(link.peer_id, [TProtocol(PROTOCOL_ID)])
        except (*_NETWORK_ERRORS, trio.TooSlowError) as error:
            self.counters["stream_open_failed"] += 1
            log.debug("stream to %s failed: %r", link.peer_id, error)
            return None
        _release_window_in_batches(stream)
        link.outbound_stream = stream
        nursery.start_soon(self._read_pongs, link, stream)
        return stream

    async def _discard_outbound_stream(self, link: _PeerLink, stream: INetStream) -> None:
        if link.outbound_stream is stream:
            link.outbound_stream = None
        await stream.reset()

    async def _read_pongs(self, link: _PeerLink, stream: INetStream) -> None:
        """Reads the peer's pongs on our outbound stream; its end (a reset after an
        oversized frame, EOF) makes the next frame open a fresh stream."""
        decoder = FrameDecoder(PING_TOKEN_BYTES)
        try:
            while True:
                chunk = await stream.read(READ_CHUNK_BYTES)
                if not chunk:
                    break
                for kind, payload in decoder.feed(chunk):
                    if kind != FRAME_KIND_PONG:
                        raise RemoteProtocolError("frame kind %d on our outbound stream" % kind)
                    link.rtt.pong(payload, trio.current_time())
        except RemoteProtocolError as error:
            self.counters["bad_frame"] += 1
            log.debug("bad frame from %s: %s", link.peer_id, error)
        except (StreamEOF, *_NETWORK_ERRORS):
            pass
        await self._discard_outbound_stream(link, stream)

    async def _ping_periodically(self, link: _PeerLink) -> None:
        while True:
            # Members only: the RTT figures are about them, and a stranger's stream is
            # one more negotiation for nothing (a hostile peer never answers it).
            if not self.is_member(link.key):
                # The driver names the members at its first tick, often after the first links
                # are up: look again soon, not a whole interval later.
                await trio.sleep(min(self._ping_interval_s, NON_MEMBER_PING_RECHECK_MS / 1000))
                continue
            token = self._rng.randbytes(PING_TOKEN_BYTES)
            link.rtt.ping_queued(token)
            self._enqueue(link, FRAME_KIND_PING, token)
            await trio.sleep(self._ping_interval_s)

    # -- inbound direction ------------------------------------------------------------

    async def _serve_inbound_stream(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id
        link = self._admit(peer_id)
        if link is None:
            await stream.reset()
            return
        # One persistent inbound stream per peer: a new one replaces the old. Its reader is
        # ended here: yamux does not wake anyone for a reset of our own.
        reader = _InboundFrames(self, link.key, stream)
        previous, link.inbound_stream = link.inbound_stream, stream
        previous_reader, link.inbound_reader = link.inbound_reader, reader
        if previous_reader is not None:
            previous_reader.end("")
        if previous is not None:
            await previous.reset()
        try:
            if reader.attach():
                ended = await reader.wait_for_end()
                if ended:
                    self.counters[ended] += 1
                    log.debug("inbound stream of %s ended: %s", peer_id, ended)
        finally:
            reader.detach()
        if link.inbound_stream is stream:
            link.inbound_stream = link.inbound_reader = None
        try:
            await stream.reset()
        except _NETWORK_ERRORS:
            pass

    def _accept_inbound_frame(self, peer_key: bytes, stream: INetStream, kind: int, payload: bytes) -> None:
        """One complete frame of a peer's frame stream, in yamux's connection reader
        (_InboundFrames.take): nothing here may wait."""
        now_s = trio.current_time()
        link = self._links.get(peer_key)
        if link is not None:
            link.last_active_s = now_s
        if not self.is_member(peer_key):
            # Non-members share what members need: their frames are rate limited per
            # peer and queued only while the queue is mostly empty, so members'
            # heartbeats and votes always find room (SPEC.md 8).
            if not self._nonmember_frames.allow(peer_key, now_s):
                self.counters["dropped_nonmember_rate"] += 1
                return
            if kind == FRAME_KIND_DATA and self._incoming_backlog() * self.limits.nonmember_incoming_share_divisor >= self._incoming_frames_max:
                self.counters["dropped_nonmember_share"] += 1
                return
        if kind == FRAME_KIND_DATA:
            if self.take_where_read is not None and self.take_where_read(peer_key, payload):
                self.counters["frames_received"] += 1
                self.counters["frames_taken_where_read"] += 1
                return
            try:
                self._incoming_send.send_nowait((peer_key, payload))
            except trio.WouldBlock:
                self.counters["dropped_queue_full"] += 1
            except trio.ClosedResourceError:
                self.counters["dropped_closing"] += 1
            else:
                self.counters["frames_received"] += 1
        elif kind == FRAME_KIND_PING:
            self._nursery.start_soon(self._write_pong, stream, payload)
        else:
            raise RemoteProtocolError("frame kind %d on an inbound stream" % kind)

    @staticmethod
    async def _write_pong(stream: INetStream, token: bytes) -> None:
        try:
            with trio.fail_after(WRITE_TIMEOUT_MS / 1000):
                await stream.write(encode_frame(FRAME_KIND_PONG, token))
        except (StreamEOF, *_NETWORK_ERRORS, trio.TooSlowError):
            pass   # the peer's RTT goes unmeasured this time; a broken stream ends by itself

    def _incoming_backlog(self) -> int:
        return self._incoming_send.statistics().current_buffer_used
    # -- requests (SPEC.md "Transport / Requests") -------------------------------------

    def serve_requests(self, handler: RequestHandler) -> None:
        self._request_handler = handler

    async def request(self, peer_key: bytes, data: bytes, timeout_ms: int = REQUEST_TIMEOUT_MS) -> bytes:
        if len(data) > MAX_REQUEST_BYTES:
            raise LocalProtocolError("request of %d bytes over limit %d" % (len(data), MAX_REQUEST_BYTES))
        link = self._links.get(peer_key)
        if link is None or self._closing:
            self.counters["request_failed"] += 1
            raise RequestFailed("peer %s is not connected" % peer_key.hex()[:16])
        why = "no answer within %d ms" % timeout_ms
        with trio.move_on_after(timeout_ms / 1000):
            try:
                stream = await self._host.new_stream(link.peer_id, [TProtocol(REQUEST_PROTOCOL_ID)])
            except _NETWORK_ERRORS as error:
                why = "cannot open a request stream: %r" % error
            else:
                try:
                    await stream.write(encode_frame(FRAME_KIND_DATA, data))
                    answer = await self._read_one_frame(stream, self.max_frame_bytes)
                    if answer is not None:
                        self.counters["requests_answered"] += 1
                        return answer
                    why = "the peer closed the stream without an answer"
                except RemoteProtocolError as error:
                    why = "bad answer: %s" % error
                except (StreamEOF, *_NETWORK_ERRORS) as error:
                    why = "stream failed: %r" % error
                finally:
                    with trio.CancelScope(shield=True):
                        await self._reset_quietly(stream)
        self.counters["request_failed"] += 1
        raise RequestFailed("peer %s: %s" % (peer_key.hex()[:16], why))

    @staticmethod
    async def _read_one_frame(stream: INetStream, max_bytes: int) -> bytes | None:
        """The payload of the first DATA frame on ``stream``, None at EOF before one."""
        decoder = FrameDecoder(max_bytes)
        while True:
            try:
                chunk = await stream.read(READ_CHUNK_BYTES)
            except StreamEOF:
                return None
            if not chunk:
                return None
            for kind, payload in decoder.feed(chunk):
                if kind != FRAME_KIND_DATA:
                    raise RemoteProtocolError("frame kind %d on a request stream" % kind)
                return payload

    @staticmethod
    async def _reset_quietly(stream: INetStream) -> None:
        try:
            await stream.reset()
        except _NETWORK_ERRORS:
            pass

    async def _serve_request_stream(self, stream: INetStream) -> None:
        """One request, one answer. Only from an authenticated peer with a link (the same
        admission as the frame stream); at most MAX_INBOUND_REQUESTS at once."""
        link = self._admit(stream.muxed_conn.peer_id)
        if link is None or self._request_handler is None or self._inbound_requests >= MAX_INBOUND_REQUESTS:
            self.counters["request_refused"] += 1
            await self._reset_quietly(stream)
            return
        self._inbound_requests += 1
        try:
            with trio.move_on_after(REQUEST_TIMEOUT_MS / 1000):
                request = await self._read_one_frame(stream, MAX_REQUEST_BYTES)
                answer = None if request is None else await self._request_handler(link.key, request)
                if answer is None:
                    self.counters["request_refused"] += 1
                else:
                    await stream.write(encode_frame(FRAME_KIND_DATA, answer))
                    # Half-close: the requester reads the whole answer, then resets.
                    await stream.close()
                    return
        except RemoteProtocolError as error:
            self.counters["bad_frame"] += 1
            log.debug("bad request from %s: %s", link.peer_id, error)
        except (StreamEOF, *_NETWORK_ERRORS):
            pass
        finally:
            self._inbound_requests -= 1
        await self._reset_quietly(stream)

    # -- shutdown ---------------------------------------------------------------------

    async def _close(self) -> None:
        """Reset our streams and disconnect every peer before the host goes away."""
        self._closing = True
        self._host.remove_stream_handler(TProtocol(PROTOCOL_ID))
        self._host.remove_stream_handler(TProtocol(REQUEST_PROTOCOL_ID))
        streams = []
        for link in list(self._links.values()):
            link.cancel_scope.cancel()
            streams += [s for s in (link.outbound_stream, link.inbound_stream) if s is not None]
        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(stream.reset)
        async with trio.open_nursery() as nursery:
            for peer_id in self._host.get_connected_peers():
                nursery.start_soon(self._host.disconnect, peer_id)
        # Leaving host.run() does not close the TCP listener (it lives in a trio
        # system task) and the "closed" host would go on accepting and authenticating
        # connections until trio.run ends; close() stops it.
        await self._host.close()
        self._incoming_send.close()


async def _close_quietly(closer) -> None:
    try:
        await closer.close()
    except _NETWORK_ERRORS:
        pass


@asynccontextmanager
async def open_libp2p_transport(
    seed: bytes,
    listen_addrs: list[str],
    max_frame_bytes: int = MAX_FRAME_BYTES_DEFAULT,
    *,
    incoming_frames_max: int = INCOMING_FRAMES_MAX_DEFAULT,
    send_queue_frames: int = SEND_QUEUE_FRAMES_DEFAULT,
    peers_max: int = PEERS_MAX_DEFAULT,
    ping_interval_ms: int = PING_INTERVAL_MS_DEFAULT,
    rng: random.Random | None = None,
    limits: PeerLimits = PeerLimits(),
) -> AsyncIterator[Libp2pTransport]:
    """A libp2p host whose identity is the Ed25519 ``seed``, listening on
    ``listen_addrs`` (multiaddrs such as "/ip4/127.0.0.1/tcp/0"), as a Transport."""
    try:
        addrs = [multiaddr.Multiaddr(address) for address in listen_addrs]
    except (multiaddr.exceptions.Error, ValueError) as error:
        raise ConfigError("bad listen multiaddr: %s" % error) from None
    key_pair = create_new_key_pair(seed)  # wraps nacl SigningKey(seed): peer ID == signing key
    muxer_class = _bounded_yamux_for(None)  # bound to the transport below, before any connection
    host = new_host(
        key_pair=key_pair,
        # Noise only: the default also offers TLS, secio and plaintext (a downgrade).
        sec_opt={NOISE_PROTOCOL_ID: _BufferedNoise(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): muxer_class},
        # max_connections_per_peer=1: else every dial waits 250 ms (happy eyeballs).
        # The upgrade timeout bounds how long a silent peer holds a handshake slot (our
        # handler applies the scaled one, InboundGate.handshake_timeout_s; this is its cap).
        connection_config=ConnectionConfig(max_connections_per_peer=1,
                                           inbound_upgrade_timeout=limits.handshake_timeout_max_ms / 1000),
        listen_addrs=addrs,
    )
    # Our redial loop has the backoff; the swarm's own retries would add 0.7 s per dial.
    host.get_network().retry_config = RetryConfig(max_retries=0)
    _use_muxer(host, muxer_class)
    transport_box: list[Libp2pTransport] = []

    async def serve_inbound_connection(read_write_closer, listen_addr: multiaddr.Multiaddr) -> None:
        if not transport_box:  # not started yet
            await _close_quietly(read_write_closer)
            return
        await transport_box[0]._serve_inbound_connection(read_write_closer, listen_addr)

    # Set before host.run() listens: the swarm's listener looks the handler up by
    # attribute on each connection, so this instance attribute shadows the method.
    host.get_network()._handle_inbound_connection = serve_inbound_connection
    local_key = public_key_from_peer_id(host.get_id().to_base58())
    async with host.run(addrs):
        # The auto-connector would dial every peer in the peerstore up to a target of
        # 150 connections; whom to dial is the node's decision (_keep_connected).
        await host.get_network().auto_connector.stop()
        async with trio.open_nursery() as nursery:
            transport = Libp2pTransport(
                host,
                local_key,
                nursery,
                max_frame_bytes,
                incoming_frames_max,
                send_queue_frames,
                peers_max,
                ping_interval_ms,
                rng or random.Random(seed),
                limits,
            )
            muxer_class.transport = transport
            _keep_one_connection_per_pair(host.get_network(), transport)
            transport_box.append(transport)
            host.get_network().register_notifee(_ConnectionEvents(transport))
            host.set_stream_handler(TProtocol(PROTOCOL_ID), transport._serve_inbound_stream)
            host.set_stream_handler(TProtocol(REQUEST_PROTOCOL_ID), transport._serve_request_stream)
            try:
                yield transport
            finally:
                nursery.cancel_scope.cancel()
                # Shielded so that a cancelled caller (Ctrl-C) still leaves cleanly.
                with trio.move_on_after(SHUTDOWN_TIMEOUT_MS / 1000) as shutdown_scope:
                    shutdown_scope.shield = True
                    await transport._close()
