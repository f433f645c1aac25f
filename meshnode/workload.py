"""The workload SDK: the process side of the node <-> workload channel (SPEC.md 9.4).

A workload is a subprocess the node's runner (``meshnode.runner``) starts with one end
of a Unix ``socketpair`` inherited as file descriptor ``$MESHNODE_SDK_FD``. Usage::

    from meshnode.workload import Workload
    w = Workload.connect()              # blocks until the node sends RESTORE
    count = decode(w.restored_state) if w.restored_state is not None else 0
    while working:
        ...
        w.set_state(encode(count), progress=count)   # cheap: stores a reference

The channel is *pull*-based: ``set_state`` only remembers the latest (state, progress)
in memory (one tuple assignment, well under a microsecond), and a daemon responder
thread answers the runner's PULL frames, every ``checkpoint_ms``, with the newest state
or UNCHANGED. So a workload may call ``set_state`` as often as it likes (the ``counter``
kind calls it every millisecond) and pays for serialising and sending only once per
checkpoint. When the node goes away the socket reaches EOF and the responder ends the
process: a second guard, next to the runner's parent-death signal, that a workload
never outlives its node.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from protocol.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from protocol.messages import MAX_STATE_BYTES

SDK_FD_ENV = "MESHNODE_SDK_FD"
WORKDIR_ENV = "MESHNODE_WORKDIR"

# Frame layout (SPEC.md 9.4): u32 big-endian length of what follows, then a u8 type.
FRAME_HEADER = struct.Struct(">IB")
RESTORE, PULL, STATE, UNCHANGED = 1, 2, 3, 4
RESTORE_FIELDS = struct.Struct(">BQQQI")   # has_state, fence, seq, progress, checkpoint_ms
PULL_FIELDS = struct.Struct(">Q")          # pull_id
STATE_FIELDS = struct.Struct(">QQQ")       # pull_id, progress, taken_ms
UNCHANGED_FIELDS = struct.Struct(">Q")     # pull_id
MAX_FRAME_BODY_BYTES = 1 + RESTORE_FIELDS.size + MAX_STATE_BYTES
EXIT_NODE_GONE = 70  # exit status when the node's end of the channel closes

_U64_MAX = (1 << 64) - 1


def encode_frame(frame_type: int, fields: bytes, state: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(1 + len(fields) + len(state), frame_type) + fields + state


def split_frame(body: bytes, fields: struct.Struct) -> tuple[tuple, bytes]:
    """Split a frame body (after the type byte) into its fixed fields and trailing state."""
    if len(body) < fields.size:
        raise RemoteProtocolError("frame body is %d bytes, needs at least %d" % (len(body), fields.size))
    return fields.unpack_from(body), body[fields.size:]


def _recv_exactly(sock: socket.socket, count: int) -> bytes | None:
    chunks, remaining = [], count
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_frame_blocking(sock: socket.socket) -> tuple[int, bytes] | None:
    """Read one frame; None at a clean EOF. Raises RemoteProtocolError on a bad frame."""
    header = _recv_exactly(sock, FRAME_HEADER.size)
    if header is None:
        return None
    length, frame_type = FRAME_HEADER.unpack(header)
    if not 1 <= length <= MAX_FRAME_BODY_BYTES:
        raise RemoteProtocolError("frame length %d out of range" % length)
    body = _recv_exactly(sock, length - 1)
    if body is None:
        raise RemoteProtocolError("channel closed inside a frame")
    return frame_type, body


class Workload:
    """The workload's handle on its node. Create it with ``Workload.connect()``."""

    def __init__(self, sock: socket.socket, restored_state: bytes | None, restored_progress: int,
                 fence: int, checkpoint_ms: int):
        self._sock = sock
        self.restored_state = restored_state
        self.restored_progress = restored_progress
        self.fence = fence
        self.checkpoint_ms = checkpoint_ms
        # (version, state, progress, taken_ms); replaced whole so the responder thread
        # always reads a consistent tuple without a lock (one atomic reference swap).
        self._latest: tuple[int, bytes, int, int] | None = None
        self._version = 0
        self._responder = threading.Thread(target=self._respond, name="meshnode-sdk", daemon=True)
        self._responder.start()

    @classmethod
    def connect(cls) -> "Workload":
        """Attach to the node that started this process and read the restore point."""
        fd_text = os.environ.get(SDK_FD_ENV)
        if not fd_text or not fd_text.isdigit():
            raise ConfigError("%s is not set: this process was not started by a meshnode runner" % SDK_FD_ENV)
        sock = socket.socket(fileno=int(fd_text))
        frame = read_frame_blocking(sock)
        if frame is None or frame[0] != RESTORE:
            raise RemoteProtocolError("the node did not open the channel with a RESTORE frame")
        (has_state, fence, _seq, progress, checkpoint_ms), state = split_frame(frame[1], RESTORE_FIELDS)
        return cls(sock, state if has_state else None, progress, fence, checkpoint_ms)

    def set_state(self, state: bytes, progress: int) -> None:
        """Offer ``state`` as the newest checkpoint; ``progress`` is a monotonic work count."""
        if len(state) > MAX_STATE_BYTES:
            raise LocalProtocolError("workload state is %d bytes, over the %d cap" % (len(state), MAX_STATE_BYTES))
        if not 0 <= progress <= _U64_MAX:
            raise LocalProtocolError("progress must be a non-negative 64-bit integer, got %r" % (progress,))
        self._version += 1
        self._latest = (self._version, bytes(state), progress, time.time_ns() // 1_000_000)

    def _respond(self) -> None:
        sent_version = 0
        try:
            while True:
                frame = read_frame_blocking(self._sock)
                if frame is None:
                    break
                frame_type, body = frame
                if frame_type != PULL:
                    raise RemoteProtocolError("unexpected frame type %d from the node" % frame_type)
                (pull_id,), _ = split_frame(body, PULL_FIELDS)
                latest = self._latest
                if latest is None or latest[0] == sent_version:
                    self._sock.sendall(encode_frame(UNCHANGED, UNCHANGED_FIELDS.pack(pull_id)))
                    continue
                version, state, progress, taken_ms = latest
                self._sock.sendall(encode_frame(STATE, STATE_FIELDS.pack(pull_id, progress, taken_ms), state))
                sent_version = version
        except (OSError, RemoteProtocolError):
            pass  # a broken channel means the node is gone or confused: end below
        # The node closed our channel: it died or stopped us. Never outlive it.
        os._exit(EXIT_NODE_GONE)
