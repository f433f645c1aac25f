"""The workload SDK: the process side of the node <-> workload channel (SPEC.md 9.4).

A workload is a subprocess the node's runner (``meshnode.node.runner``) starts with two
inherited file descriptors: one end of a Unix ``socketpair`` (``$MESHNODE_SDK_FD``),
over which the node sends one RESTORE frame, and a shared-memory state slot
(``$MESHNODE_SLOT_FD``, ``meshnode.workload.state_slot``). Usage::

    from meshnode.workload import Workload
    w = Workload.connect()              # blocks until the node sends RESTORE
    count = decode(w.restored_state) if w.restored_state is not None else 0
    while working:
        ...
        w.set_state(encode(count), progress=count)   # a copy into shared memory

``set_state`` copies the state into the slot (a memcpy and a CRC-32: about a
microsecond for a small state, well under a millisecond at the 900 KiB cap), and the
node reads the newest one every ``checkpoint_ms`` without waiting for this process to
run. A workload may call ``set_state`` as often as it likes; call it from one thread.
A daemon thread watches the socket: when the node goes away it reaches EOF and ends the
process, a second guard next to the runner's parent-death signal that a workload never
outlives its node.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import dataclasses
import time
from dataclasses import dataclass

from keys.errors import ConfigError
from meshnode.workload.state_slot import MAX_COUNT, SlotWriter
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.state_size import MAX_STATE_BYTES

SDK_FD_ENV = "MESHNODE_SDK_FD"
SLOT_FD_ENV = "MESHNODE_SLOT_FD"
WORKDIR_ENV = "MESHNODE_WORKDIR"
# A gang's rank (SPEC.md GA5): set only for a gang's workers.
GANG_ID_ENV = "MESHNODE_GANG_ID"
GANG_RANK_ENV = "MESHNODE_GANG_RANK"
GANG_WORLD_SIZE_ENV = "MESHNODE_GANG_WORLD_SIZE"
GANG_PEERS_ENV = "MESHNODE_GANG_PEERS"
GANG_PEERS_FILE_ENV = "MESHNODE_GANG_PEERS_FILE"   # the node rewrites it when a rank moves
GANG_PEERS_FILE = "gang_peers"                      # its name in the workload's working directory
UNREACHABLE_HOST = "0.0.0.0"   # a rank with no node: its replacement is being decided (GA7)

# Frame layout (SPEC.md 9.4): u32 big-endian length of what follows, then a u8 type.
FRAME_HEADER = struct.Struct(">IB")
RESTORE = 1
RESTORE_FIELDS = struct.Struct(">BQQQI")   # has_state, fence, seq, progress, checkpoint_ms
SIGNALS = 2                                # workload -> node: its own load (SPEC.md 9.4a)
SIGNALS_FIELDS = struct.Struct(">QQQ")     # request_rate_milli, latency_p99_us, progress_rate_milli
MAX_SIGNAL_VALUE = 1 << 40                 # what a vector carries at most (JobSignals' schema)
MAX_FRAME_BODY_BYTES = 1 + RESTORE_FIELDS.size + MAX_STATE_BYTES
EXIT_NODE_GONE = 70  # exit status when the node's end of the channel closes


def encode_frame(frame_type: int, fields: bytes, state: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(1 + len(fields) + len(state), frame_type) + fields + state


def encode_signals(request_rate: float, latency_p99_ms: float, progress_rate: float) -> bytes:
    """A SIGNALS frame: requests/s, p99 latency in ms and progress units/s, as thousandths
    (rounded down; negative as 0, beyond MAX_SIGNAL_VALUE as MAX_SIGNAL_VALUE)."""
    values = [min(MAX_SIGNAL_VALUE, max(0, int(v * 1000))) for v in (request_rate, latency_p99_ms, progress_rate)]
    return encode_frame(SIGNALS, SIGNALS_FIELDS.pack(*values))


def decode_signals(body: bytes) -> tuple[int, int, int]:
    """A SIGNALS frame's body (after the type byte) as (request_rate_milli, latency_p99_us,
    progress_rate_milli), each capped at MAX_SIGNAL_VALUE; RemoteProtocolError if its length is wrong."""
    if len(body) != SIGNALS_FIELDS.size:
        raise RemoteProtocolError("SIGNALS frame body is %d bytes, expected %d" % (len(body), SIGNALS_FIELDS.size))
    return tuple(min(MAX_SIGNAL_VALUE, v) for v in SIGNALS_FIELDS.unpack(body))


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


def _inherited_fd(name: str) -> int:
    text = os.environ.get(name)
    if not text or not text.isdigit():
        raise ConfigError("%s is not set: this process was not started by a meshnode runner" % name)
    return int(text)


@dataclass(frozen=True)
class GangInfo:
    """This worker's place in its gang (SPEC.md GA5): its rank, the world size, and every
    rank's (host, port), its own included (it listens there for its peers)."""
    gang_id: str
    rank: int
    world_size: int
    peers: tuple
    peers_file: str = ""   # where the node publishes the peers when a rank moves ("" = never)

    @classmethod
    def from_environment(cls, environ=os.environ) -> "GangInfo | None":
        """None when this workload is no gang's worker; ConfigError when the variables are bad."""
        if GANG_RANK_ENV not in environ:
            return None
        try:
            rank, world = int(environ[GANG_RANK_ENV]), int(environ[GANG_WORLD_SIZE_ENV])
            peers = parse_peers(environ[GANG_PEERS_ENV])
        except (KeyError, ValueError) as exc:
            raise ConfigError("gang environment is malformed: %s" % exc) from None
        if not 0 <= rank < world == len(peers):
            raise ConfigError("gang environment: rank %d of %d with %d peers" % (rank, world, len(peers)))
        return cls(environ.get(GANG_ID_ENV, ""), rank, world, peers, environ.get(GANG_PEERS_FILE_ENV, ""))

    def published_peers(self) -> "tuple | None":
        """The peers the node publishes now when they differ from these and every rank is
        reachable (no wait); None otherwise (no file, unreadable, unchanged, or a rank whose
        replacement is still being decided)."""
        if not self.peers_file:
            return None
        try:
            with open(self.peers_file, encoding="ascii") as fh:
                peers = parse_peers(fh.read().strip())
        except (OSError, ValueError):
            return None
        if peers == self.peers or any(host == UNREACHABLE_HOST for host, _port in peers):
            return None
        return peers

    def with_peers(self, peers: tuple) -> "GangInfo | None":
        """This gang with ``peers``, this worker's rank being where its own address is; None
        when it is not among them (a shrink left it out)."""
        me = self.peers[self.rank]
        if me not in peers:
            return None
        return dataclasses.replace(self, peers=peers, rank=peers.index(me), world_size=len(peers))


def parse_peers(text: str) -> tuple:
    """``host:port,host:port,...`` (rank order) as ((host, port), ...); ValueError if malformed."""
    return tuple((host, int(port)) for host, port in (entry.rsplit(":", 1) for entry in text.split(",")))


def format_peers(gang, host_of) -> str:
    """The node side: a GangRank's peers as ``parse_peers`` reads them."""
    return ",".join("%s:%d" % (host_of(node) if node is not None else UNREACHABLE_HOST, port)
                    for node, port in gang.peers)


def multiaddr_host(addr: str) -> str:
    """The host of a multiaddr such as "/ip4/10.0.0.2/tcp/4001/p2p/..." (loopback if none)."""
    parts = addr.split("/")
    return next((value for proto, value in zip(parts, parts[1:]) if proto in ("ip4", "ip6", "dns", "dns4", "dns6")),
                "127.0.0.1")


def gang_environment(gang, host_of) -> dict:
    """The node side of GA5: the variables for a worker of ``gang`` (a GangRank), each
    peer's host from ``host_of(node key)``; a rank with no node yet is unreachable."""
    if gang is None:
        return {}
    return {GANG_ID_ENV: gang.gang_id.hex(), GANG_RANK_ENV: str(gang.rank),
            GANG_WORLD_SIZE_ENV: str(gang.world_size), GANG_PEERS_ENV: format_peers(gang, host_of)}


class Workload:
    """The workload's handle on its node. Create it with ``Workload.connect()``.
    ``gang``: this worker's GangInfo when it is a gang's rank, else None."""

    def __init__(self, sock: socket.socket, slot: SlotWriter, restored_state: bytes | None,
                 restored_progress: int, fence: int, checkpoint_ms: int):
        self._sock = sock
        self._slot = slot
        self.restored_state = restored_state
        self.restored_progress = restored_progress
        self.fence = fence
        self.checkpoint_ms = checkpoint_ms
        self.gang = GangInfo.from_environment()
        self._send_lock = threading.Lock()
        self._watchdog = threading.Thread(target=self._exit_when_node_goes, name="meshnode-sdk", daemon=True)
        self._watchdog.start()

    @classmethod
    def connect(cls) -> "Workload":
        """Attach to the node that started this process and read the restore point."""
        sock = socket.socket(fileno=_inherited_fd(SDK_FD_ENV))
        slot = SlotWriter(_inherited_fd(SLOT_FD_ENV))
        frame = read_frame_blocking(sock)
        if frame is None or frame[0] != RESTORE:
            raise RemoteProtocolError("the node did not open the channel with a RESTORE frame")
        (has_state, fence, _seq, progress, checkpoint_ms), state = split_frame(frame[1], RESTORE_FIELDS)
        return cls(sock, slot, state if has_state else None, progress, fence, checkpoint_ms)

    def set_state(self, state: bytes, progress: int) -> None:
        """Offer ``state`` as the newest checkpoint; ``progress`` is a monotonic work count."""
        if len(state) > MAX_STATE_BYTES:
            raise LocalProtocolError("workload state is %d bytes, over the %d cap" % (len(state), MAX_STATE_BYTES))
        if not 0 <= progress <= MAX_COUNT:
            raise LocalProtocolError("progress must be an integer in [0, 2^63 - 1], got %r" % (progress,))
        self._slot.write(state, progress, time.time_ns() // 1_000_000)

    def report_load(self, request_rate: float = 0.0, latency_p99_ms: float = 0.0, progress_rate: float = 0.0) -> None:
        """Tell the node this workload's load (SPEC.md 9.4a): requests answered per second,
        their p99 latency in ms, progress units per second, each over a recent window. The
        node carries the newest in its signed vector, where reflex rules read it (R3a). About
        once a second is plenty; any thread may call it. A node that is gone ends the process
        (the watchdog), so a failed send is ignored here."""
        frame = encode_signals(request_rate, latency_p99_ms, progress_rate)
        with self._send_lock:
            try:
                self._sock.sendall(frame)
            except OSError:
                pass

    def _exit_when_node_goes(self) -> None:
        try:
            while self._sock.recv(4096):
                pass  # the node sends nothing after RESTORE; stray bytes are ignored
        except OSError:
            pass  # a broken channel means the node is gone
        # The node closed our channel: it died or stopped us. Never outlive it.
        os._exit(EXIT_NODE_GONE)
