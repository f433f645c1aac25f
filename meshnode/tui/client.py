"""A small asyncio client of a node's control socket, for the TUI (SPEC.md control API).

Textual runs on asyncio while the node and its own control client run on trio, so
the TUI speaks the same framing here: a 4-byte big-endian length, then one canonical
msgpack map. Requests are ``{"id", "op", "args"}``; each gets ``{"id", "ok",
"result"|"error"}``. ``subscribe`` turns its connection into a stream of
``{"event": {...}}`` frames, so events get a connection of their own and never
interleave with request replies.
"""

from __future__ import annotations

import asyncio
import struct

from meshnode.control.client import LENGTH_PREFIX_BYTES, ControlError, decode_map, encode_frame
from protocol import codec
from protocol.errors import MeshError, RemoteProtocolError

REQUEST_TIMEOUT_S = 5.0  # a live node answers in milliseconds; longer means it is gone


class ControlUnavailable(MeshError):
    """The node's control socket cannot be reached, or the connection broke."""


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """Read one length-prefixed canonical msgpack map. Raises ControlUnavailable at EOF."""
    try:
        header = await reader.readexactly(LENGTH_PREFIX_BYTES)
        (length,) = struct.unpack(">I", header)
        if length > codec.MAX_FRAME_BYTES:
            raise RemoteProtocolError("control frame of %d bytes is over the cap" % length)
        payload = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise ControlUnavailable("control connection closed: %s" % exc) from None
    return decode_map(payload)


class TuiControlClient:
    """One request connection; ``events()`` opens a second one for the subscription.

    A refused request raises ``ControlError`` (shared with meshnode.control.client);
    anything that means the node is gone raises ``ControlUnavailable``.
    """

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 1
        self._lock = asyncio.Lock()  # one request in flight: replies come back in order

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_unix_connection(self.socket_path, limit=codec.MAX_FRAME_BYTES + 4)
        except OSError as exc:
            raise ControlUnavailable("cannot reach %s: %s" % (self.socket_path, exc.strerror or exc)) from None

    async def connect(self) -> None:
        self._reader, self._writer = await self._open()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self._reader = None

    async def request(self, op: str, args: dict | None = None):
        """Send one request and return its ``result``; raise ControlError on ``ok: false``."""
        async with self._lock:
            if self._writer is None:
                await self.connect()
            request_id = self._next_id
            self._next_id += 1
            try:
                self._writer.write(encode_frame({"id": request_id, "op": op, "args": args or {}}))
                await self._writer.drain()
                async with asyncio.timeout(REQUEST_TIMEOUT_S):  # not wait_for: it can swallow a cancel
                    reply = await read_frame(self._reader)
            except (ConnectionError, TimeoutError, ControlUnavailable, RemoteProtocolError) as exc:
                await self.close()  # the stream is in an unknown state: start over next time
                raise ControlUnavailable("%s: %s" % (op, exc or type(exc).__name__)) from None
        if reply.get("id") != request_id:
            await self.close()
            raise ControlUnavailable("%s: reply id %r does not match %d" % (op, reply.get("id"), request_id))
        if not reply.get("ok"):
            raise ControlError("%s: %s" % (op, reply.get("error", "request failed")))
        return reply.get("result")

    async def events(self):
        """Yield each event map of a ``subscribe`` stream until the connection ends."""
        reader, writer = await self._open()
        try:
            writer.write(encode_frame({"id": 0, "op": "subscribe", "args": {}}))
            await writer.drain()
            while True:
                frame = await read_frame(reader)
                if "event" in frame:
                    yield frame["event"]
                elif frame.get("ok") is False:
                    raise ControlError(str(frame.get("error", "subscribe refused")))
        except ConnectionError as exc:
            raise ControlUnavailable("event stream closed: %s" % exc) from None
        finally:
            writer.close()
