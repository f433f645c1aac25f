"""The node's log file is written once per batch (issue 18 item 3; meshnode/node/logfile.py):
a node logged one INFO line per event and Python's FileHandler flushed after each one.
Counted, not timed: the stream's flushes."""

import logging
import time

import pytest

from meshnode.node import driver, logfile
from protocol.ready import Event, Ready
from tests.test_driver_batching import RecordingCore, driver_without_network, receive_all


LEAN_RECORD_FLAGS = ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing")


class CountingStream:
    """The handler's file, counting the flushes that reach it."""

    def __init__(self, stream):
        self.stream, self.flushes = stream, 0

    def write(self, text):
        return self.stream.write(text)

    def flush(self):
        self.flushes += 1
        self.stream.flush()

    def close(self):
        self.stream.close()


@pytest.fixture
def node_log(tmp_path):
    """The node's logging set up on ``tmp_path/node.log``, its stream counting flushes;
    the root logger's handlers and level put back afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    flags = {name: getattr(logging, name) for name in LEAN_RECORD_FLAGS}
    path = tmp_path / "node.log"
    logfile.setup_logging(path, "info")
    handler = root.handlers[0]
    handler.stream = stream = CountingStream(handler.stream)
    yield path, stream
    handler.close()
    root.handlers[:], root.level = saved
    logfile._handler = None
    for name, value in flags.items():   # the node's process-wide settings, not pytest's
        setattr(logging, name, value)


def test_info_lines_wait_for_the_batch_flush_and_warnings_do_not(node_log):
    path, stream = node_log
    log = logging.getLogger("meshnode.node")
    for i in range(5):
        log.info("event %d", i)
    assert stream.flushes == 0 and path.read_text() == ""
    logfile.flush_log()
    assert stream.flushes == 1 and path.read_text().count("INFO meshnode.node: event") == 5
    logfile.flush_log()
    assert stream.flushes == 1   # nothing pending: no write
    log.warning("going down")
    assert stream.flushes == 2 and "WARNING meshnode.node: going down" in path.read_text()


def test_the_cached_timestamp_reads_as_the_standard_one():
    formatter, standard = logfile.SecondCachedFormatter(), logging.Formatter(logfile.LOG_FORMAT)
    base = time.time()
    for offset in (0.0, 0.001, 0.5, 0.999, 1.0, 61.25, 3600.7):
        record = logging.LogRecord("meshnode.node", logging.INFO, __file__, 1, "decided %s", ("x",), None)
        record.created, record.msecs = base + offset, ((base + offset) % 1) * 1000 // 1
        assert formatter.format(record) == standard.format(record)


class EventCore(RecordingCore):
    """Every frame stepped yields one event (as a placement's frames do)."""

    def step(self, data: bytes, now_ms: int, sender: bytes) -> Ready:
        super().step(data, now_ms, sender)
        return Ready(events=[Event("decided", now_ms, {"job": data})])

    def next_tick_ms(self, now_ms: int) -> int:
        return now_ms + 40


async def test_a_received_batch_writes_its_event_lines_in_one_flush(tmp_path, node_log):
    # Issue 18: one INFO line and one flush (a write(2)) per event; 12 frames, 12 events.
    path, stream = node_log
    node = driver_without_network(tmp_path)
    node.core = EventCore()
    frames = [b"frame %d" % i for i in range(12)]
    try:
        await receive_all(node, frames)
        assert stream.flushes == 1
        assert path.read_text().count("INFO meshnode.node: decided job=") == len(frames)
    finally:
        node.close()


async def test_an_event_line_is_not_formatted_when_info_is_off(tmp_path, monkeypatch):
    node = driver_without_network(tmp_path)
    logger = logging.getLogger("meshnode.node")
    level = logger.level
    logger.setLevel(logging.WARNING)   # setLevel, not the attribute: it clears isEnabledFor's cache

    def formatted(_detail):
        raise AssertionError("formatted a line no handler takes")
    monkeypatch.setattr(driver, "_loggable", formatted)
    try:
        await node._publish([Event("decided", 1, {"job": b"x"})])
    finally:
        logger.setLevel(level)
        node.close()
