"""The control socket's framing, shared by the server and the client (SPEC.md "Control API").

A frame is a 4-byte big-endian length, then that many bytes of one canonical msgpack
map, at most ``codec.MAX_FRAME_BYTES``. A request is ``{"id": int, "op": str, "args":
map}``; its reply is ``{"id", "ok": true, "result"}`` or ``{"id", "ok": false, "error":
str}``. After a successful ``subscribe`` reply the connection carries only ``{"event":
map}`` frames until either side closes; a final ``{"id", "ok": false, "error"}`` frame
says why the server ended it. No IO here: both ends feed bytes in and take frames out.
"""

from __future__ import annotations

import struct

from protocol import codec
from protocol.errors import RemoteProtocolError

LENGTH_PREFIX_BYTES = 4


def encode_frame(value: dict) -> bytes:
    payload = codec.pack(value)
    return struct.pack(">I", len(payload)) + payload


class FrameBuffer:
    """Splits a byte stream into frames; no IO, so the server and the client share it."""

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
