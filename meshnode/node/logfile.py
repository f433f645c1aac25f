"""The node's log file, written once per batch of work instead of once per line.

Python's FileHandler flushes its stream after every record: one write(2) per line, and
a node logs one INFO line per event, 6-7 events per placement at n = 4 (issue 18: the
log line and its flush were ~5% of a node's CPU per placement). Here INFO and DEBUG
lines stay in the stream's buffer until the driver calls ``flush_log()``, which it does
once it has drained a batch (the receive loop's batch, a tick, a submit, a workload
report: every ``Node._handle``) and before it waits again. So a line is on disk before
the node next sleeps; a kill -9 can lose at most the lines of the batch being handled,
which no one outside the process has seen the effects of yet (its messages are sent
after ``record_ready``, its events published after the line is buffered, but both in
the same uninterrupted run of the task). WARNING and above are flushed at once: they
often come just before the process ends. Closing the handler (``logging.shutdown`` at
exit) flushes too.

The timestamp's date and time part is formatted once per second, not once per line
(``time.strftime`` was ~1% of a node's CPU per placement), and a record skips the caller
lookup and the thread and process names the format does not show; the text is unchanged.
"""

from __future__ import annotations

import logging
import time

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class SecondCachedFormatter(logging.Formatter):
    """``logging.Formatter`` with the default ``asctime`` text, its strftime part reused
    while the second stands still."""

    def __init__(self, fmt: str = LOG_FORMAT) -> None:
        super().__init__(fmt)
        self._second: int | None = None
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return self.default_msec_format % (self._second_text, record.msecs)


class BatchedFileHandler(logging.FileHandler):
    """A FileHandler whose lines below WARNING wait in the buffer for ``flush_pending``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.pending = False   # lines written to the buffer since the last flush

    def emit(self, record: logging.LogRecord) -> None:
        self.pending = True
        super().emit(record)   # StreamHandler.emit calls self.flush(): a no-op below WARNING
        if record.levelno >= logging.WARNING:
            self.flush_pending()

    def flush(self) -> None:
        """Deferred: the driver flushes once per batch (``flush_pending``)."""

    def flush_pending(self) -> None:
        if self.pending:
            self.pending = False
            super().flush()

    def close(self) -> None:
        self.flush_pending()
        super().close()


_handler: BatchedFileHandler | None = None


def setup_logging(log_path, level: str) -> None:
    """The root logger writes to ``log_path`` only, at ``level``, batched (module docstring)."""
    global _handler
    # What a record gathers and the format never shows: the caller's file and line (a stack
    # walk per line), thread, process and task names ("Optimization" in Python's logging
    # documentation). A node process logs through this handler only.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = BatchedFileHandler(log_path)
    handler.setFormatter(SecondCachedFormatter())
    root = logging.getLogger()
    for old in root.handlers:
        if old is _handler:
            old.close()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    _handler = handler


def flush_log() -> None:
    """Write the buffered log lines out (the driver calls this once per drained batch)."""
    if _handler is not None:
        _handler.flush_pending()
