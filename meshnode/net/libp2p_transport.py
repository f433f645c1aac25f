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

Concurrency: each connected peer has a ``_PeerLink`` whose tasks (frame writer,
pinger, pong reader) run under the link's cancel scope and end with the connection.
Inbound streams are served in libp2p's own handler tasks.
"""

from __future__ import annotations

import collections
import logging
import os
import random
from collections.abc import AsyncIterator
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
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE as YAMUX_WINDOW_BYTES
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream

from keys.identity import peer_id_bytes, public_key_from_peer_id
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
    redial_delay_ms,
)
from keys.errors import ConfigError
from protocol.errors import LocalProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

SEND_QUEUE_FRAMES_DEFAULT = 1024
PEERS_MAX_DEFAULT = 256
PING_INTERVAL_MS_DEFAULT = 1000
DIAL_TIMEOUT_MS = 5000
STREAM_OPEN_TIMEOUT_MS = 2000
WRITE_TIMEOUT_MS = 2000
SHUTDOWN_TIMEOUT_MS = 3000
READ_CHUNK_BYTES = 64 * 1024
WRITE_BATCH_BYTES = 64 * 1024  # queued frames coalesced into one write, up to this size
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


class _PeerLink:
    """Our state for one connected peer; lives as long as its connection."""

    def __init__(self, key: bytes, peer_id: ID, send_queue_frames: int):
        self.key = key
        self.peer_id = peer_id
        self.outbox_send, self.outbox_receive = trio.open_memory_channel[tuple[int, bytes]](send_queue_frames)
        self.outbound_stream: INetStream | None = None
        self.inbound_stream: INetStream | None = None
        self.cancel_scope = trio.CancelScope()
        self.lost = trio.Event()
        self.rtt = RttEstimator()


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
        self._links: dict[bytes, _PeerLink] = {}
        self._dial_addrs: dict[bytes, multiaddr.Multiaddr] = {}
        self._closing = False
        self._request_handler: RequestHandler | None = None
        self._inbound_requests = 0

    @property
    def listen_addrs(self) -> list[str]:
        return [str(addr) for addr in self._host.get_addrs()]

    def peers(self) -> set[bytes]:
        return set(self._links)

    def rtt_us(self, peer_key: bytes) -> int | None:
        link = self._links.get(peer_key)
        return None if link is None else link.rtt.srtt_us

    async def send(self, peer_key: bytes, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if len(data) > self.max_frame_bytes:
            raise LocalProtocolError("frame of %d bytes over limit %d" % (len(data), self.max_frame_bytes))
        link = self._links.get(peer_key)
        if link is None:
            self.counters["send_failed"] += 1
            return
        self._enqueue(link, FRAME_KIND_DATA, data)

    async def connect(self, peer_key: bytes, address: str) -> None:
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
        connected = await self._dial(peer_key, peer_id)
        if first_time:
            self._nursery.start_soon(self._keep_connected, peer_key, peer_id, connected)

    # -- connection lifecycle -------------------------------------------------------

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

    async def _keep_connected(self, peer_key: bytes, peer_id: ID, connected: bool) -> None:
        """Redial ``peer_key`` whenever its connection is gone (SPEC.md "Transport / Redial")."""
        failed_attempts = 0 if connected else 1
        while True:
            link = self._links.get(peer_key)
            if link is not None:
                failed_attempts = 0
                await link.lost.wait()
                continue
            await trio.sleep(redial_delay_ms(failed_attempts, self._rng) / 1000)
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
        del self._links[peer_key]
        link.cancel_scope.cancel()
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
        try:
            link.outbox_send.send_nowait((kind, encode_frame(kind, payload)))
        except trio.WouldBlock:
            self.counters["dropped_send_queue_full"] += 1
        except trio.ClosedResourceError:  # the link was just lost
            self.counters["send_failed"] += 1

    async def _write_frames(self, link: _PeerLink, nursery: trio.Nursery) -> None:
        async for kind, wire in link.outbox_receive:
            batch = [(kind, wire)]
            batch_bytes = len(wire)
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
                continue
            now_s = trio.current_time()
            for kind, wire in batch:
                if kind == FRAME_KIND_PING:
                    link.rtt.ping_written(wire[-PING_TOKEN_BYTES:], now_s)
            try:
                with trio.fail_after(WRITE_TIMEOUT_MS / 1000):
                    await stream.write(b"".join(wire for _, wire in batch))
            except (*_NETWORK_ERRORS, trio.TooSlowError) as error:
                # A partly written frame corrupts the stream: reset it, the next frame
                # opens a new one.
                self.counters["send_failed"] += data_frames
                log.debug("write to %s failed: %r", link.peer_id, error)
                await self._discard_outbound_stream(link, stream)
                continue
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
        peer_key = link.key
        _release_window_in_batches(stream)
        # One persistent inbound stream per peer: a new one replaces the old.
        previous, link.inbound_stream = link.inbound_stream, stream
        if previous is not None:
            await previous.reset()
        decoder = FrameDecoder(self.max_frame_bytes)
        try:
            while True:
                chunk = await stream.read(READ_CHUNK_BYTES)
                if not chunk:
                    break
                for kind, payload in decoder.feed(chunk):
                    await self._on_inbound_frame(peer_key, stream, kind, payload)
        except FrameTooLarge as error:
            self.counters["dropped_oversize"] += 1
            log.debug("oversized frame from %s: %s", peer_id, error)
        except RemoteProtocolError as error:
            self.counters["bad_frame"] += 1
            log.debug("bad frame from %s: %s", peer_id, error)
        except (StreamEOF, *_NETWORK_ERRORS, trio.TooSlowError):
            pass
        if link.inbound_stream is stream:
            link.inbound_stream = None
        await stream.reset()

    async def _on_inbound_frame(self, peer_key: bytes, stream: INetStream, kind: int, payload: bytes) -> None:
        if kind == FRAME_KIND_DATA:
            try:
                self._incoming_send.send_nowait((peer_key, payload))
            except trio.WouldBlock:
                self.counters["dropped_queue_full"] += 1
            except trio.ClosedResourceError:
                self.counters["dropped_closing"] += 1
            else:
                self.counters["frames_received"] += 1
        elif kind == FRAME_KIND_PING:
            with trio.fail_after(WRITE_TIMEOUT_MS / 1000):
                await stream.write(encode_frame(FRAME_KIND_PONG, payload))
        else:
            raise RemoteProtocolError("frame kind %d on an inbound stream" % kind)

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
) -> AsyncIterator[Libp2pTransport]:
    """A libp2p host whose identity is the Ed25519 ``seed``, listening on
    ``listen_addrs`` (multiaddrs such as "/ip4/127.0.0.1/tcp/0"), as a Transport."""
    try:
        addrs = [multiaddr.Multiaddr(address) for address in listen_addrs]
    except (multiaddr.exceptions.Error, ValueError) as error:
        raise ConfigError("bad listen multiaddr: %s" % error) from None
    key_pair = create_new_key_pair(seed)  # wraps nacl SigningKey(seed): peer ID == signing key
    host = new_host(
        key_pair=key_pair,
        # Noise only: the default also offers TLS, secio and plaintext (a downgrade).
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
        # Else every dial waits 250 ms (happy eyeballs).
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        listen_addrs=addrs,
    )
    # Our redial loop has the backoff; the swarm's own retries would add 0.7 s per dial.
    host.get_network().retry_config = RetryConfig(max_retries=0)
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
            )
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
