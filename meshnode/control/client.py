"""The one client of a node's control socket ``DIR/control.sock`` (SPEC.md "Control API").

``ClientProtocol`` is the whole client side of the protocol, with no IO (h11's pattern):
it turns a request into bytes, and the node's bytes into a result, an event, the end of
a stream or an error. Two faces only move bytes for it:

* ``ControlClient``: blocking sockets, for the CLI, the testnet launcher and scripts;
* ``AsyncControlClient``: anyio streams, so one implementation serves trio (testnet
  benchmarks, driver tests) and asyncio (the Textual TUI).

Both keep one connection for requests, one request in flight at a time, and give each
subscription a connection of its own (``subscribe()``: a context manager that returns
once the node acknowledged, and iterates the node's event maps). Errors:

* ``ControlError``: the node refused the request (``ok: false``); the text is the node's;
* ``ControlUnavailable``: no node answers: not running, the connection broke, or no
  reply within the timeout; the connection is closed, the next call opens a new one;
* ``RemoteProtocolError``: the node sent something that is not the protocol; the
  connection is closed too.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import anyio

from meshnode.control.wire import FrameBuffer, decode_map, encode_frame
from protocol.errors import LocalProtocolError, MeshError, RemoteProtocolError

SOCKET_NAME = "control.sock"
CALL_TIMEOUT_S = 10.0
RECV_CHUNK_BYTES = 65536


class ControlError(MeshError):
    """The node refused a request (``ok: false``); the message is the node's error text."""

    @property
    def retry_after_ms(self) -> int | None:
        """SPEC 10.5: for a submit refused because the entry node has too many jobs undecided
        ("overloaded: ... retry in N ms"), N; None for any other refusal."""
        match = _OVERLOADED.search(str(self))
        return int(match.group(1)) if match else None


_OVERLOADED = re.compile(r"overloaded: .* retry in (\d+) ms$")


class ControlUnavailable(MeshError):
    """The node's control socket cannot be reached, the connection broke, or no reply came in time."""


class _Need:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _Need()  # ClientProtocol needs more bytes from the node before it can answer


def socket_path(node_dir_or_socket) -> Path:
    """Accept a node data directory (the usual ``--node DIR``) or the socket path itself."""
    path = Path(node_dir_or_socket)
    return path / SOCKET_NAME if path.is_dir() else path


def not_running(path: Path, why: str) -> ControlUnavailable:
    return ControlUnavailable("node not running at %s (%s)" % (path.parent, why))


def closed_by_node(sock: socket.socket | None) -> bool:
    """True when the node has closed this idle connection (it sheds idle clients: see
    meshnode/control/server.py). Checked before a request is sent, so a request is never
    written to a connection that cannot answer it, and none is ever sent twice."""
    if sock is None:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False  # open, nothing to read: the usual case
    except OSError:
        return True


def socket_missing(path: Path) -> ControlUnavailable:
    """The error for a socket path that does not exist: a node directory that is there but
    has no socket means the node is not running; a ``--node`` that names no directory at
    all is a wrong path, and saying "not running at /" would send the user looking elsewhere."""
    directory = path.parent if path.name == SOCKET_NAME else path
    if not directory.is_dir():
        return ControlUnavailable("no node directory at %s" % directory)
    return not_running(path, "no %s" % path.name)


class ClientProtocol:
    """One connection's client side, sans IO.

    ``request(op, args)`` gives the bytes to send; feed what the node sends to
    ``receive_data`` (``b""`` when it closed the connection) and ask ``next_reply()``
    for the request's result, then, after an acknowledged ``subscribe``, ``next_event()``
    for each event. Both return ``NEED_DATA`` until enough bytes have arrived.
    """

    def __init__(self):
        self._frames = FrameBuffer()
        self._closed_by_node = False
        self._next_id = 1
        self._in_flight: tuple[int, str] | None = None   # (request id, op)
        self._subscription: int | None = None            # id of the acknowledged subscribe

    def request(self, op: str, args: dict) -> bytes:
        if self._in_flight is not None or self._subscription is not None:
            raise LocalProtocolError("%s: one request at a time, and none on a subscription's connection" % op)
        request_id = self._next_id
        self._next_id += 1
        self._in_flight = (request_id, op)
        return encode_frame({"id": request_id, "op": op, "args": args})

    def receive_data(self, data: bytes) -> None:
        if data:
            self._frames.feed(data)
        else:
            self._closed_by_node = True

    def _next_frame(self, op: str):
        """The next frame, NEED_DATA, or None when the node has closed the connection."""
        payload = self._frames.next_payload()
        if payload is not None:
            return decode_map(payload)
        if not self._closed_by_node:
            return NEED_DATA
        if self._frames.buffered_bytes:
            raise RemoteProtocolError("%s: connection closed inside a frame" % op)
        return None

    def next_reply(self):
        """The in-flight request's result; raises ControlError if the node refused it."""
        if self._in_flight is None:
            raise LocalProtocolError("no request in flight")
        request_id, op = self._in_flight
        frame = self._next_frame(op)
        if frame is NEED_DATA:
            return NEED_DATA
        self._in_flight = None
        if frame is None:
            raise ControlUnavailable("%s: the node closed the connection without replying" % op)
        result = _reply_result(frame, request_id, op)
        if op == "subscribe":
            self._subscription = request_id
        return result

    def next_event(self):
        """The next event map of the subscription, or None when the node ended the stream.

        Raises ControlError when the node ended it with a reason (a subscriber too slow)."""
        if self._subscription is None:
            raise LocalProtocolError("no acknowledged subscription on this connection")
        frame = self._next_frame("subscribe")
        if frame is NEED_DATA or frame is None:
            return frame
        if "event" in frame:
            return frame["event"]
        _reply_result(frame, self._subscription, "subscribe")
        raise RemoteProtocolError("subscribe: a second acknowledgement on the stream")


def _reply_result(reply: dict, request_id: int, op: str):
    if reply.get("id") != request_id:
        raise RemoteProtocolError("%s: reply id %r does not match request %d" % (op, reply.get("id"), request_id))
    if reply.get("ok") is True:
        return reply.get("result")
    raise ControlError("%s: %s" % (op, reply.get("error", "request failed")))


# --- the blocking face ------------------------------------------------------------------------

class ControlClient:
    """Blocking client. Use as a context manager; ``timeout_s=None`` waits forever."""

    def __init__(self, node_dir_or_socket, timeout_s: float | None = CALL_TIMEOUT_S):
        self.path = socket_path(node_dir_or_socket)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._protocol = ClientProtocol()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def connect(self) -> None:
        if closed_by_node(self._sock):
            self.close()
        if self._sock is not None:
            return
        if not os.path.exists(self.path):
            raise socket_missing(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError as exc:
            sock.close()
            raise not_running(self.path, "%s: %s" % (self.path.name, exc.strerror or exc)) from None
        self._sock, self._protocol = sock, ClientProtocol()

    def call(self, op: str, **args):
        """Send one request; return its result or raise ControlError with the node's message."""
        self.connect()
        try:
            self._sock.sendall(self._protocol.request(op, args))
            return self._until(self._protocol.next_reply, op)
        except socket.timeout:
            self.close()
            raise ControlUnavailable("%s: no reply from the node within %.1f s" % (op, self.timeout_s)) from None
        except OSError as exc:
            self.close()
            raise ControlUnavailable("%s: connection to the node failed: %s" % (op, exc)) from None
        except (ControlUnavailable, RemoteProtocolError):
            self.close()
            raise

    def _until(self, step, op: str):
        while (value := step()) is NEED_DATA:
            self._protocol.receive_data(self._sock.recv(RECV_CHUNK_BYTES))
        return value

    def subscribe(self, **args) -> "EventStream":
        """The node's events, on a connection of their own: ``with client.subscribe() as events``."""
        return EventStream(ControlClient(self.path, self.timeout_s), args)


class EventStream:
    """A subscription: entering returns once the node acknowledged; iterating yields event
    maps, with no timeout, until the node ends the stream. Iterating unentered enters."""

    def __init__(self, connection: ControlClient, args: dict):
        self._connection = connection
        self._args = args
        self._open = False

    def __enter__(self) -> "EventStream":
        if not self._open:
            self._connection.call("subscribe", **self._args)
            self._connection._sock.settimeout(None)  # the stream may be quiet for any time
            self._open = True
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._connection.close()

    def __iter__(self) -> "EventStream":
        return self

    def __next__(self) -> dict:
        self.__enter__()
        connection = self._connection
        if connection._sock is None:
            raise StopIteration
        try:
            event = connection._until(connection._protocol.next_event, "subscribe")
        except OSError as exc:
            self.close()
            raise ControlUnavailable("subscribe: connection to the node failed: %s" % exc) from None
        except MeshError:
            self.close()
            raise
        if event is None:
            self.close()
            raise StopIteration
        return event


# --- the async face (trio or asyncio, through anyio) --------------------------------------------

_STREAM_FAILURES = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


class AsyncControlClient:
    """Async client for trio and asyncio. ``async with`` it, or ``await aclose()``."""

    def __init__(self, node_dir_or_socket, timeout_s: float | None = CALL_TIMEOUT_S):
        self.path = socket_path(node_dir_or_socket)
        self.timeout_s = timeout_s
        self._stream: anyio.abc.ByteStream | None = None
        self._protocol = ClientProtocol()
        # One request in flight: replies come back in order. fast_acquire: no scheduler round trip
        # when the lock is free (the usual case), a third of a call's CPU on a benchmark's hot path.
        self._lock = anyio.Lock(fast_acquire=True)

    async def __aenter__(self) -> "AsyncControlClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await anyio.aclose_forcefully(stream)

    async def connect(self) -> None:
        if self._stream is not None and closed_by_node(self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None)):
            await self.aclose()
        if self._stream is not None:
            return
        if not os.path.exists(self.path):
            raise socket_missing(self.path)
        try:
            stream = await anyio.connect_unix(str(self.path))
        except OSError as exc:
            raise not_running(self.path, "%s: %s" % (self.path.name, exc.strerror or exc)) from None
        self._stream, self._protocol = stream, ClientProtocol()

    async def call(self, op: str, **args):
        """Send one request; return its result or raise ControlError with the node's message."""
        async with self._lock:
            await self.connect()
            try:
                if self.timeout_s is None:  # no cancel scope at all: benchmarks call on their hot path
                    return await self._exchange(op, args)
                with anyio.fail_after(self.timeout_s):
                    return await self._exchange(op, args)
            except TimeoutError:
                await self.aclose()
                raise ControlUnavailable("%s: no reply from the node within %.1f s" % (op, self.timeout_s)) from None
            except _STREAM_FAILURES as exc:
                await self.aclose()
                raise ControlUnavailable("%s: connection to the node failed: %s"
                                         % (op, exc or type(exc).__name__)) from None
            except (ControlUnavailable, RemoteProtocolError):
                await self.aclose()
                raise

    async def _exchange(self, op: str, args: dict):
        await self._stream.send(self._protocol.request(op, args))
        return await self._until(self._protocol.next_reply)

    async def _until(self, step):
        while (value := step()) is NEED_DATA:
            try:
                data = await self._stream.receive(RECV_CHUNK_BYTES)
            except anyio.EndOfStream:
                data = b""
            self._protocol.receive_data(data)
        return value

    def subscribe(self, **args) -> "AsyncEventStream":
        """The node's events, on a connection of their own: ``async with client.subscribe() as events``."""
        return AsyncEventStream(AsyncControlClient(self.path, self.timeout_s), args)


class AsyncEventStream:
    """A subscription: entering returns once the node acknowledged; ``async for`` yields
    event maps, with no timeout, until the node ends the stream. Iterating unentered enters."""

    def __init__(self, connection: AsyncControlClient, args: dict):
        self._connection = connection
        self._args = args
        self._open = False

    async def __aenter__(self) -> "AsyncEventStream":
        if not self._open:
            await self._connection.call("subscribe", **self._args)
            self._open = True
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._connection.aclose()

    def __aiter__(self) -> "AsyncEventStream":
        return self

    async def __anext__(self) -> dict:
        await self.__aenter__()
        connection = self._connection
        if connection._stream is None:
            raise StopAsyncIteration
        try:
            event = await connection._until(connection._protocol.next_event)
        except _STREAM_FAILURES as exc:
            await self.aclose()
            raise ControlUnavailable("subscribe: connection to the node failed: %s" % (exc or type(exc).__name__)) from None
        except MeshError:
            await self.aclose()
            raise
        if event is None:
            await self.aclose()
            raise StopAsyncIteration
        return event
