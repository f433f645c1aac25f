"""The node's local control API: a trio server on the Unix socket ``DIR/control.sock``.

The CLI and the TUI reach a running node only through this socket, so it is the
node's local trust boundary: the socket is created mode 0600 (umask set before bind,
then chmod, then verified) inside a data directory no other user can write to, and
the server refuses to start otherwise. Framing and message shapes are in
meshnode/control/wire.py and SPEC.md "Control API".

The driver registers the operations: ``handlers`` maps an op name to an async
function of the request's ``args`` map that returns a canonical-encodable result or
raises MeshError (its text becomes the error reply). ``subscribe`` is built in: it
streams the events the driver publishes to ``EventHub`` until the client closes.

A client can never take the server down: a malformed frame gets an error reply (the
connection stays open when the frame boundary is intact, and is closed when it is
not), every queue is bounded, and a subscriber that does not keep up is dropped.

Nor can clients that connect and say nothing lock the operator out. Connections are
capped (``max_connections``); a request connection silent for ``IDLE_TIMEOUT_S`` is
closed, and when every slot is taken a new client takes the slot of the request
connection idle the longest (no request in flight; subscribers are capped on their own
by ``EventHub``). Only when every slot is busy answering is a new client refused. The
clients in meshnode/control/client.py notice a connection the node closed before they
reuse it, and reconnect.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from keys.errors import ConfigError
from meshnode.control.wire import FrameBuffer, decode_map, encode_frame
from protocol.errors import LocalProtocolError, MeshError, RemoteProtocolError
from protocol.ready import Event

log = logging.getLogger(__name__)

Handler = Callable[[dict], Awaitable[Any]]

MAX_CONNECTIONS = 64
MAX_SUBSCRIBERS = 32
SUBSCRIBER_QUEUE_EVENTS = 256      # events buffered per subscriber before it counts as slow
SEND_STALL_S = 5.0                 # a client that accepts no bytes for this long is disconnected
IDLE_TIMEOUT_S = 60.0              # a request connection that sends nothing for this long is closed
MAX_OP_CHARS = 64
_SUN_PATH_MAX_BYTES = 107          # sockaddr_un.sun_path is 108 bytes including the NUL
_RECV_CHUNK_BYTES = 65536


MAX_SUBSCRIBED_KINDS = 32
MAX_EVENT_KIND_CHARS = 64


def subscribed_kinds(args: dict) -> frozenset[str] | None:
    """The event kinds a ``subscribe`` asks for (SPEC.md 10.7): None for every kind (args
    ``{}``). A benchmark that follows decisions at every node of a 16-node mesh under load
    was dropped as too slow while it was sent every bid and vote it never read."""
    unknown = sorted(set(args) - {"kinds"})
    if unknown:
        raise MeshError("subscribe: unknown argument %r (known: kinds)" % unknown[0])
    if "kinds" not in args:
        return None
    kinds = args["kinds"]
    if (not isinstance(kinds, list) or not 1 <= len(kinds) <= MAX_SUBSCRIBED_KINDS
            or not all(isinstance(k, str) and 1 <= len(k) <= MAX_EVENT_KIND_CHARS for k in kinds)
            or len(set(kinds)) != len(kinds)):
        raise MeshError("subscribe: kinds must be a list of 1..%d distinct event kinds of 1..%d characters"
                        % (MAX_SUBSCRIBED_KINDS, MAX_EVENT_KIND_CHARS))
    return frozenset(kinds)


class Subscription:
    """One subscriber's bounded queue of encoded event frames, of the kinds it asked for
    (None: all)."""

    def __init__(self, hub: "EventHub", queue_events: int, kinds: frozenset[str] | None = None):
        self._hub = hub
        self.kinds = kinds
        self.send_channel, self.receive_channel = trio.open_memory_channel(queue_events)
        self.dropped_reason: str | None = None

    def _offer(self, frame: bytes) -> None:
        try:
            self.send_channel.send_nowait(frame)
        except trio.WouldBlock:
            self.drop("subscriber too slow: more than %d events queued" % self.receive_channel.statistics().max_buffer_size)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.drop("subscriber gone")

    def drop(self, reason: str) -> None:
        """Stop feeding this subscriber; what is already queued is still delivered."""
        if self.dropped_reason is None:
            self.dropped_reason = reason
            self._hub._subscribers.discard(self)
            self.send_channel.close()


def _queued_frames(subscription: Subscription) -> bytes:
    """Every event frame already queued for ``subscription``, joined.

    Sent with the frame just received in one write: under load events queue faster than
    one send per event (a syscall and a wake-up of the subscriber each; 10% of a node's
    busy time in a profile at 16 placements in flight). The queue is bounded
    (SUBSCRIBER_QUEUE_EVENTS), so is the batch.
    """
    frames = []
    while True:
        try:
            frames.append(subscription.receive_channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return b"".join(frames)


class EventHub:
    """Fan-out of node events to control subscribers. ``publish`` never blocks the driver."""

    def __init__(self, max_subscribers: int = MAX_SUBSCRIBERS, queue_events: int = SUBSCRIBER_QUEUE_EVENTS):
        self.max_subscribers = max_subscribers
        self.queue_events = queue_events
        self._subscribers: set[Subscription] = set()
        self.dropped_subscribers = 0

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def subscribe(self, kinds: frozenset[str] | None = None) -> Subscription:
        if len(self._subscribers) >= self.max_subscribers:
            raise MeshError("too many subscribers (%d)" % self.max_subscribers)
        subscription = Subscription(self, self.queue_events, kinds)
        self._subscribers.add(subscription)
        return subscription

    def publish(self, event: Event) -> None:
        """Queue ``event`` for every subscriber. Raises LocalProtocolError if it is not encodable."""
        if not self._subscribers:
            return
        frame = None
        for subscription in list(self._subscribers):
            if subscription.kinds is not None and event.kind not in subscription.kinds:
                continue
            if frame is None:
                frame = encode_frame({"event": {"kind": event.kind, "at_ms": event.at_ms, "detail": event.detail}})
            subscription._offer(frame)
            if subscription.dropped_reason is not None:
                self.dropped_subscribers += 1


def check_request(value: dict) -> tuple[int, str, dict]:
    """Validate a request map strictly; raises RemoteProtocolError naming the field."""
    if set(value) != {"id", "op", "args"}:
        raise RemoteProtocolError("request must have exactly the keys id, op, args; got %s" % sorted(value))
    request_id, op, args = value["id"], value["op"], value["args"]
    if isinstance(request_id, bool) or not isinstance(request_id, int) or not 0 <= request_id < (1 << 63):
        raise RemoteProtocolError("request.id: expected an integer in [0, 2^63)")
    if not isinstance(op, str) or not 1 <= len(op) <= MAX_OP_CHARS:
        raise RemoteProtocolError("request.op: expected text of 1..%d characters" % MAX_OP_CHARS)
    if not isinstance(args, dict):
        raise RemoteProtocolError("request.args: expected a map")
    return request_id, op, args


def _request_id_of(value) -> int:
    request_id = value.get("id") if isinstance(value, dict) else None
    return request_id if isinstance(request_id, int) and not isinstance(request_id, bool) \
        and 0 <= request_id < (1 << 63) else 0


def _error_frame(request_id: int, message: str) -> bytes:
    return encode_frame({"id": request_id, "ok": False, "error": message[:4096]})


@dataclass(eq=False)
class _Connection:
    """One client's slot: what eviction needs to know about it."""
    scope: trio.CancelScope
    last_active: int            # when it last connected, asked or was answered, in server-wide order
    busy: bool = False          # a request is being answered: never evicted
    subscriber: bool = False    # an event stream: capped by EventHub, never evicted as idle


class ControlServer:
    def __init__(self, path, handlers: dict[str, Handler], events: EventHub | None = None,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S):
        if "subscribe" in handlers:
            raise LocalProtocolError("the control op 'subscribe' is built in; do not register it")
        self.path = Path(path)
        self.handlers = dict(handlers)
        self.events = events
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self._open: set[_Connection] = set()
        # Activity is ordered by a counter, not the clock: two clients active within one
        # clock tick still have a definite order, so "the longest idle" is always one client.
        self._activity = itertools.count()
        self.bad_frames = 0
        self.evicted_connections = 0   # idle connections closed to make room for a new client
        self.idle_closed_connections = 0

    @property
    def connections(self) -> int:
        return len(self._open)

    # --- socket set-up ------------------------------------------------------------------------

    def _check_directory(self) -> None:
        directory = self.path.parent
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            raise ConfigError("node directory %s does not exist" % directory) from None
        if info.st_uid != os.getuid():
            raise ConfigError("node directory %s is owned by uid %d, not by this user" % (directory, info.st_uid))
        if info.st_mode & 0o022:
            raise ConfigError("node directory %s is group- or world-writable (mode %03o): run chmod 700 %s"
                              % (directory, stat.S_IMODE(info.st_mode), directory))
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX_BYTES:
            raise ConfigError("control socket path %s is longer than %d bytes" % (self.path, _SUN_PATH_MAX_BYTES))

    def _remove_stale_socket(self) -> None:
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise ConfigError("%s exists and is not a socket" % self.path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(self.path)  # left by a node that died: nobody is listening
            return
        finally:
            probe.close()
        raise ConfigError("a node is already running at %s (its control socket answers)" % self.path.parent)

    async def _bind(self) -> trio.socket.SocketType:
        self._check_directory()
        self._remove_stale_socket()
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others may connect
        try:
            await sock.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        info = os.lstat(self.path)
        if not stat.S_ISSOCK(info.st_mode) or stat.S_IMODE(info.st_mode) != 0o600 or info.st_uid != os.getuid():
            sock.close()
            raise ConfigError("control socket %s did not get mode 0600 (got %03o)" % (self.path, stat.S_IMODE(info.st_mode)))
        sock.listen(MAX_CONNECTIONS)
        return sock

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; the socket file is removed on the way out."""
        sock = await self._bind()
        try:
            listener = trio.SocketListener(sock)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self.handle_connection, [listener])
                task_status.started(self.path)
        finally:
            with trio.CancelScope(shield=True):
                sock.close()
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass

    # --- connections --------------------------------------------------------------------------

    async def handle_connection(self, stream: trio.abc.Stream) -> None:
        """Serve one client until it closes. Works on any trio stream (tests use memory streams)."""
        async with stream:
            if len(self._open) >= self.max_connections and not self._evict_longest_idle():
                await self._send_or_give_up(stream, _error_frame(
                    0, "too many control connections (%d, all answering requests)" % self.max_connections))
                return
            connection = _Connection(trio.CancelScope(), next(self._activity))
            self._open.add(connection)
            try:
                with connection.scope:
                    await self._serve_requests(stream, connection)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away mid-reply; nothing to answer
            finally:
                self._open.discard(connection)

    def _evict_longest_idle(self) -> bool:
        """Free the slot of the request connection idle the longest; False when none is idle."""
        idle = [c for c in self._open if not c.busy and not c.subscriber]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.last_active)
        self._open.discard(oldest)  # the slot is free now, not when its task gets to run
        oldest.scope.cancel()
        self.evicted_connections += 1
        return True

    async def _send_or_give_up(self, stream: trio.abc.Stream, frame: bytes) -> bool:
        """Send one frame unless the client stalls; False means the stream must be closed."""
        with trio.move_on_after(SEND_STALL_S):
            try:
                await stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The client left. Raising here would escape the subscription nursery as an
                # ExceptionGroup that handle_connection cannot catch, and end the node.
                return False
            return True
        return False

    async def _serve_requests(self, stream: trio.abc.Stream, connection: _Connection) -> None:
        frames = FrameBuffer()
        while True:
            connection.busy = False
            try:
                payload = frames.next_payload()
            except RemoteProtocolError as exc:  # an oversized length: the stream cannot resync
                self.bad_frames += 1
                await self._send_or_give_up(stream, _error_frame(0, str(exc)))
                return
            if payload is None:
                data = None
                with trio.move_on_after(self.idle_timeout_s):
                    data = await stream.receive_some(_RECV_CHUNK_BYTES)
                if data is None:
                    self.idle_closed_connections += 1
                    return
                if not data:
                    return
                frames.feed(data)
                continue
            connection.busy, connection.last_active = True, next(self._activity)
            value = None
            try:
                value = decode_map(payload)
                request_id, op, args = check_request(value)
            except RemoteProtocolError as exc:
                self.bad_frames += 1
                if not await self._send_or_give_up(stream, _error_frame(_request_id_of(value), str(exc))):
                    return
                continue
            if op == "subscribe":
                connection.subscriber = True
                await self._stream_events(stream, request_id, args)
                return
            if not await self._send_or_give_up(stream, await self._reply(request_id, op, args)):
                return
            connection.last_active = next(self._activity)

    async def _reply(self, request_id: int, op: str, args: dict) -> bytes:
        handler = self.handlers.get(op)
        if handler is None:
            return _error_frame(request_id, "unknown op %r (known: %s)" % (op, ", ".join(sorted(self.handlers) + ["subscribe"])))
        try:
            result = await handler(args)
        except MeshError as exc:
            return _error_frame(request_id, str(exc))
        except Exception:  # noqa: BLE001 -- a handler bug must not take the node down; it is logged
            log.exception("control op %s failed", op)
            return _error_frame(request_id, "internal error in %s (see the node log)" % op)
        try:
            return encode_frame({"id": request_id, "ok": True, "result": result})
        except LocalProtocolError as exc:
            log.error("control op %s returned an unencodable result: %s", op, exc)
            return _error_frame(request_id, "internal error in %s: result not encodable" % op)

    async def _stream_events(self, stream: trio.abc.Stream, request_id: int, args: dict) -> None:
        if self.events is None:
            await self._send_or_give_up(stream, _error_frame(request_id, "this node publishes no events"))
            return
        try:
            subscription = self.events.subscribe(subscribed_kinds(args))
        except MeshError as exc:
            await self._send_or_give_up(stream, _error_frame(request_id, str(exc)))
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._cancel_when_client_closes, stream, nursery.cancel_scope)
                if not await self._send_or_give_up(stream, encode_frame({"id": request_id, "ok": True,
                                                                          "result": {"subscribed": True}})):
                    nursery.cancel_scope.cancel()
                    return
                async for frame in subscription.receive_channel:
                    if not await self._send_or_give_up(stream, frame + _queued_frames(subscription)):
                        nursery.cancel_scope.cancel()
                        return
                # The hub closed our queue: it dropped us. Say why, after what was queued.
                await self._send_or_give_up(stream, _error_frame(request_id, subscription.dropped_reason or "stream ended"))
                nursery.cancel_scope.cancel()
        finally:
            subscription.drop("connection closed")

    async def _cancel_when_client_closes(self, stream: trio.abc.Stream, scope: trio.CancelScope) -> None:
        # A subscriber sends nothing after "subscribe"; EOF (or anything else) ends the stream.
        try:
            await stream.receive_some(_RECV_CHUNK_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()
