"""The shared-memory state slot (SPEC.md 9.4): what the node reads, whatever the writer did."""

import os
import struct
import zlib

import pytest

from meshnode.workload.state_slot import (FAILED_READS_LIMIT, HEADER, REGION_BYTES, SLOT_BYTES, SLOT_HEADER, SlotReader,
                                 SlotWriter, create_region)
from keys.errors import ConfigError
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_STATE_BYTES


@pytest.fixture
def region_fd():
    fd = create_region()
    yield fd
    os.close(fd)


def test_reader_sees_each_write_once_and_only_the_newest(region_fd):
    writer, reader = SlotWriter(region_fd), SlotReader(region_fd)
    assert reader.read() is None  # nothing offered yet
    writer.write(b"one", progress=1, taken_ms=100)
    writer.write(b"two!", progress=2, taken_ms=101)
    assert reader.read() == (2, 101, b"two!")
    assert reader.read() is None  # unchanged since the last read
    writer.write(b"", progress=3, taken_ms=102)
    assert reader.read() == (3, 102, b"")


def test_a_writer_stopped_mid_write_leaves_the_previous_state_readable(region_fd):
    writer, reader = SlotWriter(region_fd), SlotReader(region_fd)
    writer.write(b"complete", progress=7, taken_ms=5)
    # Write 2 goes to the other slot; the writer dies after marking its start.
    os.pwrite(region_fd, struct.pack("<Q", 2), HEADER.size + 0 * SLOT_BYTES)
    assert reader.read() == (7, 5, b"complete")


def test_a_torn_copy_is_refused_and_counted(region_fd):
    writer, reader = SlotWriter(region_fd), SlotReader(region_fd)
    writer.write(b"state", progress=1, taken_ms=1)
    # Write 1 sits in slot 1; corrupt its bytes as a lapping writer would.
    os.pwrite(region_fd, b"XXXXX", HEADER.size + SLOT_BYTES + SLOT_HEADER.size)
    assert reader.read() is None
    assert reader.torn_reads > 0
    writer.write(b"fresh", progress=2, taken_ms=2)
    assert reader.read() == (2, 2, b"fresh")


def test_a_slot_never_consistent_is_a_protocol_violation(region_fd):
    """Each failed read costs the node READ_ATTEMPTS copies and CRCs: a workload that keeps
    its slot corrupted is killed rather than read in vain forever."""
    writer, reader = SlotWriter(region_fd), SlotReader(region_fd)
    writer.write(b"state", progress=1, taken_ms=1)
    os.pwrite(region_fd, b"XXXXX", HEADER.size + SLOT_BYTES + SLOT_HEADER.size)
    for _ in range(FAILED_READS_LIMIT - 1):
        assert reader.read() is None
    with pytest.raises(RemoteProtocolError, match="in a row"):
        reader.read()


def test_a_length_over_the_cap_is_a_protocol_violation(region_fd):
    reader = SlotReader(region_fd)
    slot1 = HEADER.size + SLOT_BYTES
    os.pwrite(region_fd, SLOT_HEADER.pack(1, 1, 0, 0, MAX_STATE_BYTES + 1, zlib.crc32(b"")), slot1)
    os.pwrite(region_fd, struct.pack("<Q", 1), 8)
    with pytest.raises(RemoteProtocolError, match="over"):
        reader.read()


@pytest.mark.parametrize("progress, taken_ms", [(1 << 63, 0), (0, (1 << 64) - 1)])
def test_a_count_over_the_checkpoint_records_range_is_a_protocol_violation(region_fd, progress, taken_ms):
    """A u64 the Checkpoint record cannot hold would fail its schema inside the node's
    checkpoint callback (a ValueError that would end the node): the reader refuses it."""
    SlotWriter(region_fd).write(b"state", progress=progress, taken_ms=taken_ms)  # as a non-Python writer may
    with pytest.raises(RemoteProtocolError, match="over"):
        SlotReader(region_fd).read()


def test_the_workload_cannot_resize_the_region(region_fd):
    """A shrunk mapping would SIGBUS the node: the size is sealed."""
    for size in (0, REGION_BYTES + 4096):
        with pytest.raises(PermissionError):
            os.ftruncate(region_fd, size)


def test_an_oversized_state_is_refused_by_the_writer(region_fd):
    with pytest.raises(ValueError):
        SlotWriter(region_fd).write(bytes(MAX_STATE_BYTES + 1), progress=0, taken_ms=0)


def test_a_region_of_another_layout_is_refused(region_fd, tmp_path):
    os.pwrite(region_fd, b"XXXX", 0)
    with pytest.raises(ConfigError, match="magic"):
        SlotReader(region_fd)
    small = os.open(tmp_path / "small", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(small, 4096)
        with pytest.raises(ConfigError, match="bytes"):
            SlotWriter(small)
    finally:
        os.close(small)
