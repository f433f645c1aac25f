"""Clients of a node's control socket ``DIR/control.sock`` (SPEC.md "Control API").

Framing (shared with the server in meshnode/control/server.py): a 4-byte big-endian length,
then that many bytes of one canonical msgpack map, at most ``codec.MAX_FRAME_BYTES``.
A request is ``{"id": int, "op": str, "args": map}``; its reply is ``{"id", "ok": true,
"result"}`` or ``{"id", "ok": false, "error": str}``. After a successful ``subscribe``
reply the connection carries only ``{"event": map}`` frames until either side closes;
a final ``{"id", "ok": false, "error"}`` frame says why the server ended it.

``ControlClient`` is synchronous (the CLI); ``AsyncControlClient`` is trio (tools and
tests that already run trio). The TUI, on asyncio, has its own in meshnode/tui/client.py.
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

import trio

from keys.errors import ConfigError
from protocol import codec
from protocol.errors import MeshError, RemoteProtocolError

LENGTH_PREFIX_BYTES = 4
CALL_TIMEOUT_S = 10.0
_RECV_CHUNK_BYTES = 65536


class ControlError(MeshError):
    """The node refused a request (``ok: false``); the message is the node's error text."""


def encode_frame(value: dict) -> bytes:
    payload = codec.pack(value)
    return struct.pack(">I", len(payload)) + payload


class FrameBuffer:
    """Splits a byte stream into frames; no IO, so the server and both clients share it."""

    def __init__(self, max_frame_bytes: int = codec.MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._data = bytearray()

    def feed(self, data: bytes) -> None:
        self._data += data

    @property
    def buffered_bytes(self) -> int:
        return len(self._data)

    def next_payload(self) -> bytes | None:
        """The next complete frame's payload, or None if more bytes are needed.

        Raises RemoteProtocolError when a length prefix announces more than the cap:
        the stream cannot be resynchronised after that, so the caller must close it.
        """
        if len(self._data) < LENGTH_PREFIX_BYTES:
            return None
        (length,) = struct.unpack_from(">I", self._data)
        if length > self.max_frame_bytes:
            raise RemoteProtocolError("frame of %d bytes announced, over the %d cap" % (length, self.max_frame_bytes))
        end = LENGTH_PREFIX_BYTES + length
        if len(self._data) < end:
            return None
        payload = bytes(self._data[LENGTH_PREFIX_BYTES:end])
        del self._data[:end]
        return payload


def decode_map(payload: bytes) -> dict:
    value = codec.unpack(payload)
    if not isinstance(value, dict):
        raise RemoteProtocolError("control frame is not a map")
    return value


def socket_path(node_dir_or_socket) -> Path:
    """Accept a node data directory (the usual ``--node DIR``) or the socket path itself."""
    path = Path(node_dir_or_socket)
    return path / "control.sock" if path.is_dir() else path


def _not_running(path: Path, why: str) -> ConfigError:
    return ConfigError("node not running at %s (%s)" % (path.parent, why))


def _reply_result(reply: dict, request_id: int, op: str):
    if reply.get("id") != request_id:
        raise RemoteProtocolError("%s: reply id %r does not match request %d" % (op, reply.get("id"), request_id))
    if reply.get("ok") is True:
        return reply.get("result")
    raise ControlError("%s: %s" % (op, reply.get("error", "request failed")))


class ControlClient:
    """Synchronous client: one connection, one request in flight. Use as a context manager."""

    def __init__(self, node_dir_or_socket, timeout_s: float = CALL_TIMEOUT_S):
        self.path = socket_path(node_dir_or_socket)
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._frames = FrameBuffer()
        self._next_id = 1

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            if not os.path.exists(self.path):
                raise _not_running(self.path, "no %s" % self.path.name)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except OSError as exc:
                sock.close()
                raise _not_running(self.path, "%s: %s" % (self.path.name, exc.strerror or exc)) from None
            self._sock = sock
            self._frames = FrameBuffer()
        return self._sock

    def _send(self, op: str, args: dict) -> int:
        sock = self._connect()
        request_id = self._next_id
        self._next_id += 1
        try:
            sock.sendall(encode_frame({"id": request_id, "op": op, "args": args}))
        except OSError as exc:
            self.close()
            raise ControlError("%s: connection to the node failed: %s" % (op, exc)) from None
        return request_id

    def _receive(self, op: str) -> dict | None:
        """The next frame, or None at a clean end of stream."""
        while True:
            payload = self._frames.next_payload()
            if payload is not None:
                return decode_map(payload)
            try:
                data = self._sock.recv(_RECV_CHUNK_BYTES)
            except socket.timeout:
                self.close()
                raise ControlError("%s: no reply from the node within %.1f s" % (op, self.timeout_s)) from None
            except OSError as exc:
                self.close()
                raise ControlError("%s: connection to the node failed: %s" % (op, exc)) from None
            if not data:
                if self._frames.buffered_bytes:
                    raise RemoteProtocolError("%s: connection closed inside a frame" % op)
                return None
            self._frames.feed(data)

    def call(self, op: str, **args):
        """Send one request; return its result or raise ControlError with the node's message."""
        request_id = self._send(op, args)
        reply = self._receive(op)
        if reply is None:
            self.close()
            raise ControlError("%s: the node closed the connection without replying" % op)
        return _reply_result(reply, request_id, op)

    def subscribe(self, **args):
        """Yield event maps until the node ends the stream (ControlError if it says why).

        The connection is given over to the stream, so no blocking timeout applies."""
        request_id = self._send("subscribe", args)
        self._sock.settimeout(None)
        try:
            first = self._receive("subscribe")
            if first is None:
                return
            _reply_result(first, request_id, "subscribe")
            while (frame := self._receive("subscribe")) is not None:
                if "event" in frame:
                    yield frame["event"]
                else:
                    _reply_result(frame, request_id, "subscribe")
        finally:
            self.close()


class AsyncControlClient:
    """trio client; each ``call`` and ``subscribe`` uses its own short connection."""

    def __init__(self, node_dir_or_socket):
        self.path = socket_path(node_dir_or_socket)
        self._next_id = 1

    async def _open(self) -> trio.SocketStream:
        if not os.path.exists(self.path):
            raise _not_running(self.path, "no %s" % self.path.name)
        try:
            return await trio.open_unix_socket(str(self.path))
        except OSError as exc:
            raise _not_running(self.path, "%s: %s" % (self.path.name, exc.strerror or exc)) from None

    @staticmethod
    async def _read_frame(stream: trio.SocketStream, frames: FrameBuffer) -> dict | None:
        """The next frame, or None at a clean end of stream."""
        while True:
            payload = frames.next_payload()
            if payload is not None:
                return decode_map(payload)
            data = await stream.receive_some(_RECV_CHUNK_BYTES)
            if not data:
                if frames.buffered_bytes:
                    raise RemoteProtocolError("connection closed inside a frame")
                return None
            frames.feed(data)

    async def call(self, op: str, **args):
        request_id = self._next_id
        self._next_id += 1
        async with await self._open() as stream:
            await stream.send_all(encode_frame({"id": request_id, "op": op, "args": args}))
            reply = await self._read_frame(stream, FrameBuffer())
        if reply is None:
            raise ControlError("%s: the node closed the connection without replying" % op)
        return _reply_result(reply, request_id, op)

    async def subscribe(self, **args):
        """Async generator of event maps; use inside ``async with aclosing(...)``."""
        request_id = self._next_id
        self._next_id += 1
        async with await self._open() as stream:
            await stream.send_all(encode_frame({"id": request_id, "op": "subscribe", "args": args}))
            frames = FrameBuffer()
            acknowledged = False
            while (frame := await self._read_frame(stream, frames)) is not None:
                if "event" in frame and acknowledged:
                    yield frame["event"]
                else:
                    _reply_result(frame, request_id, "subscribe")
                    acknowledged = True
