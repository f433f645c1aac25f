"""The state slot: shared memory through which a workload offers checkpoints (SPEC.md 9.4).

Why shared memory and not a request/answer over the socket: a checkpoint taken by asking
the workload waits until the workload's process is scheduled and its SDK thread holds
the GIL. Workloads run at a lower CPU priority than their node (runner.WORKLOAD_NICE),
so on a loaded host that wait was measured at up to 560 ms, and the checkpoint it
delays is work a kill loses. Here the workload copies its newest state into the slot as
part of ``set_state`` and the node reads it whenever its checkpoint timer fires,
whether or not the workload is running at that moment.

The node creates the memory (``memfd_create``), sizes it, seals its size (so the
workload cannot shrink it under the node's mapping and crash the node with SIGBUS) and
passes the descriptor to the workload. Layout, all integers little-endian::

    0   magic "MNS1"  u32 layout version (1)
    8   published     u64: number of the newest complete write (0: none yet)
    16  slot 0, then slot 1 at 16 + SLOT_BYTES
    slot = begin:u64 end:u64 progress:u64 taken_ms:u64 length:u32 crc32:u32 state[MAX_STATE_BYTES]

Write number ``k`` goes to slot ``k % 2``: ``begin = k``, the fields and state, ``end =
k``, then ``published = k``. So the slot a reader finds through ``published`` is not the
one being written, and a writer stopped in the middle of a write (descheduled, paused,
killed) leaves the previous state readable. A reader copies the slot and accepts it only
if ``begin == end == published`` it read first and the CRC-32 of the state matches: a
copy torn by a writer that lapped it twice fails that check and is retried; the CRC also
stands in for memory barriers, which Python cannot issue, on weakly ordered CPUs.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import zlib

from keys.errors import ConfigError
from protocol.errors import RemoteProtocolError
from protocol.state_size import MAX_STATE_BYTES

MAGIC = b"MNS1"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<4sIQ")            # magic, layout version, published
SLOT_HEADER = struct.Struct("<QQQQII")     # begin, end, progress, taken_ms, length, crc32
SLOT_BYTES = SLOT_HEADER.size + MAX_STATE_BYTES
REGION_BYTES = HEADER.size + 2 * SLOT_BYTES
READ_ATTEMPTS = 4   # a writer must lap the reader twice per attempt to tear it; 4 is plenty
FAILED_READS_LIMIT = 16  # reads in a row without a consistent copy: the slot is corrupted on purpose
MAX_COUNT = (1 << 63) - 1  # progress and taken_ms: the checkpoint record's integers are signed 64-bit
_PUBLISHED_AT = 8


def _slot_offset(number: int) -> int:
    return HEADER.size + (number % 2) * SLOT_BYTES


def create_region() -> int:
    """A sealed, zeroed memfd of REGION_BYTES with the header written; the caller owns the fd."""
    fd = os.memfd_create("meshnode-state", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, REGION_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        os.pwrite(fd, HEADER.pack(MAGIC, LAYOUT_VERSION, 0), 0)
    except OSError:
        os.close(fd)
        raise
    return fd


def _map(fd: int, writable: bool) -> mmap.mmap:
    size = os.fstat(fd).st_size
    if size != REGION_BYTES:
        raise ConfigError("state slot is %d bytes, expected %d (another meshnode version?)" % (size, REGION_BYTES))
    region = mmap.mmap(fd, REGION_BYTES, mmap.MAP_SHARED,
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    magic, version, _ = HEADER.unpack_from(region, 0)
    if magic != MAGIC or version != LAYOUT_VERSION:
        region.close()
        raise ConfigError("state slot has magic %r version %d, expected %r version %d"
                          % (magic, version, MAGIC, LAYOUT_VERSION))
    return region


class SlotWriter:
    """The workload's side. Not thread-safe: one thread calls ``write``."""

    def __init__(self, fd: int):
        self._region = _map(fd, writable=True)
        self._published = HEADER.unpack_from(self._region, 0)[2]

    def write(self, state: bytes, progress: int, taken_ms: int) -> None:
        if len(state) > MAX_STATE_BYTES:
            raise ValueError("state is %d bytes, over %d" % (len(state), MAX_STATE_BYTES))
        number = self._published + 1
        offset = _slot_offset(number)
        region = self._region
        struct.pack_into("<Q", region, offset, number)                       # begin
        region[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + len(state)] = state
        SLOT_HEADER.pack_into(region, offset, number, number, progress, taken_ms, len(state), zlib.crc32(state))
        struct.pack_into("<Q", region, _PUBLISHED_AT, number)
        self._published = number

    def close(self) -> None:
        self._region.close()


class SlotReader:
    """The node's side: ``read`` returns the newest complete state once, then None until
    the workload writes again."""

    def __init__(self, fd: int):
        self._region = _map(fd, writable=False)
        self.last_number = 0
        self.torn_reads = 0
        self.failed_reads_in_a_row = 0

    def read(self) -> tuple[int, int, bytes] | None:
        """(progress, taken_ms, state) of a write not returned before, or None.

        Raises RemoteProtocolError if the workload wrote a length over MAX_STATE_BYTES or a
        progress or taken_ms over MAX_COUNT, or if FAILED_READS_LIMIT reads in a row found no
        consistent copy (each read costs the node up to READ_ATTEMPTS copies and CRCs);
        returns None (counting ``torn_reads``) if one read found none."""
        region = self._region
        for _ in range(READ_ATTEMPTS):
            number = struct.unpack_from("<Q", region, _PUBLISHED_AT)[0]
            if number == self.last_number:
                self.failed_reads_in_a_row = 0
                return None
            offset = _slot_offset(number)
            begin, end, progress, taken_ms, length, crc = SLOT_HEADER.unpack_from(region, offset)
            if length > MAX_STATE_BYTES:
                raise RemoteProtocolError("workload state slot claims %d bytes, over %d" % (length, MAX_STATE_BYTES))
            state = region[offset + SLOT_HEADER.size:offset + SLOT_HEADER.size + length]
            if begin == end == number == struct.unpack_from("<Q", region, offset)[0] and zlib.crc32(state) == crc:
                if progress > MAX_COUNT or taken_ms > MAX_COUNT:
                    # Checked on a consistent copy: the workload itself published it. Passed on,
                    # it would fail the Checkpoint record's schema inside the node's callback.
                    raise RemoteProtocolError("workload state slot has progress %d, taken_ms %d: over %d"
                                              % (progress, taken_ms, MAX_COUNT))
                self.last_number = number
                self.failed_reads_in_a_row = 0
                return progress, taken_ms, state
            self.torn_reads += 1
        self.failed_reads_in_a_row += 1
        if self.failed_reads_in_a_row >= FAILED_READS_LIMIT:
            raise RemoteProtocolError("no consistent state in the workload's slot in %d reads in a row"
                                      % self.failed_reads_in_a_row)
        return None

    def close(self) -> None:
        self._region.close()
