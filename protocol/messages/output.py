"""Reading a job's output from the node that runs it (SPEC.md 9.8): the request a job's
owner (or the primary's own operator) signs, and the primary's signed answer.

These travel on the transport's request streams (SPEC.md 8 "Requests"), never on the
consensus stream, so a log chunk never waits in front of a heartbeat.
"""

from __future__ import annotations

from typing import ClassVar

from protocol.messages.fields import record
from protocol.schema import Bool, Bytes, Int, Key, List, Nested, Record, Text

OUTPUT_TARGETS = ("log", "files", "file")
MAX_OUTPUT_CHUNK_BYTES = 256 * 1024   # bytes of one answer: far below the 1 MiB frame
MAX_OUTPUT_FILES = 1024               # files one "files" answer lists
MAX_OUTPUT_PATH_BYTES = 512


@record
class OutputRead(Record):
    """Asks a job's primary for part of the job's output. ``target``: "log" (the workload's
    stdout and stderr, from logical ``offset``), "files" (the list of files in its working
    directory), "file" (``path``'s bytes from ``offset``). ``via``: the member that carries
    it to the primary; the primary answers no one else (9.8)."""
    KIND: ClassVar = "output_read"
    job_id: bytes
    target: str
    path: str
    offset: int
    max_bytes: int
    via: bytes
    requested_ms: int
    SCHEMA: ClassVar = {"job_id": Key(), "target": Text(choices=OUTPUT_TARGETS),
                        "path": Text(0, MAX_OUTPUT_PATH_BYTES), "offset": Int(),
                        "max_bytes": Int(1, MAX_OUTPUT_CHUNK_BYTES), "via": Key(), "requested_ms": Int()}


@record
class OutputFile(Record):
    """One regular file in a job's working directory: its path relative to it."""
    path: str
    size: int
    mtime_ms: int
    SCHEMA: ClassVar = {"path": Text(1, MAX_OUTPUT_PATH_BYTES), "size": Int(), "mtime_ms": Int()}


@record
class OutputData(Record):
    """A primary's answer to one OutputRead (``read``: SHA-256 of that request's envelope).
    ``error`` is empty, or why nothing was read. ``start``..``end``: what the log still
    holds (or 0..size of the file); ``data`` begins at ``offset``. ``running``: the
    workload runs on the signer now, so the log may grow."""
    KIND: ClassVar = "output_data"
    job_id: bytes
    read: bytes
    error: str
    state: str
    running: bool
    start: int
    offset: int
    end: int
    data: bytes
    files: tuple
    SCHEMA: ClassVar = {"job_id": Key(), "read": Key(), "error": Text(0, 256), "state": Text(0, 32),
                        "running": Bool(), "start": Int(), "offset": Int(), "end": Int(),
                        "data": Bytes(0, MAX_OUTPUT_CHUNK_BYTES),
                        "files": List(Nested(OutputFile), MAX_OUTPUT_FILES)}
