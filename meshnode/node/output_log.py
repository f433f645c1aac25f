"""A workload's stdout and stderr, kept in its working directory as a bounded ring (SPEC.md 9.2, 9.8).

The runner pipes the workload's output through the node into two segment files:
``output.log`` (the newest bytes, appended) and ``output.log.old`` (the segment before
it). When ``output.log`` reaches ``segment_bytes`` it becomes ``output.log.old``
(replacing the older one) and a new ``output.log`` starts, so at most
``2 * segment_bytes`` are kept per job and the oldest output goes first.

Every byte has a logical offset: its position in everything the job ever wrote on this
node. ``output.log.start`` holds the offset of ``output.log``'s first byte (absent: 0),
so a reader that follows the log resumes at the offset it reached, without duplicates,
across rotations; what rotated out is reported as a gap, never silently skipped.
"""

from __future__ import annotations

import os

LOG_NAME = "output.log"
OLD_LOG_NAME = "output.log.old"
START_NAME = "output.log.start"
LOG_FILES = (LOG_NAME, OLD_LOG_NAME, START_NAME)
SEGMENT_BYTES = 4 << 20       # so at most 8 MiB of output per job and node


def job_workdir(data_dir, job_id: bytes) -> str:
    """The job's working directory on this node (absolute; SPEC.md 9.2)."""
    return os.path.join(os.path.abspath(os.fspath(data_dir)), "workloads", job_id.hex())


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


class OutputLog:
    """The ring in ``workdir``. One writer (the runner) appends; readers may be other
    instances over the same directory (the node serving ``job logs``)."""

    def __init__(self, workdir: str, segment_bytes: int | None = None):
        self.segment_bytes = SEGMENT_BYTES if segment_bytes is None else segment_bytes
        if self.segment_bytes < 1:
            raise ValueError("segment_bytes must be positive")
        self.workdir = workdir
        self._writer = None

    def _path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def _current_start(self) -> int:
        try:
            with open(self._path(START_NAME), "rb") as fh:
                return int(fh.read(32).strip() or b"0")
        except FileNotFoundError:
            return 0
        except ValueError:
            return 0   # a damaged marker: offsets restart, the bytes are still served

    def bounds(self) -> tuple[int, int]:
        """(offset of the oldest byte kept, offset after the newest)."""
        start = self._current_start()
        return start - _size(self._path(OLD_LOG_NAME)), start + _size(self._path(LOG_NAME))

    # --- writing ---------------------------------------------------------------------------
    def append(self, data: bytes) -> None:
        while data:
            if self._writer is None:
                self._writer = open(self._path(LOG_NAME), "ab")
            room = self.segment_bytes - self._writer.tell()
            if room <= 0:
                self._rotate()
                continue
            self._writer.write(data[:room])
            self._writer.flush()
            data = data[room:]

    def _rotate(self) -> None:
        size = self._writer.tell()
        self._writer.close()
        self._writer = None
        new_start = self._current_start() + size
        marker = self._path(START_NAME + ".tmp")
        with open(marker, "wb") as fh:
            fh.write(b"%d\n" % new_start)
        os.replace(self._path(LOG_NAME), self._path(OLD_LOG_NAME))
        os.replace(marker, self._path(START_NAME))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # --- reading ---------------------------------------------------------------------------
    def read(self, offset: int, max_bytes: int) -> tuple[int, int, bytes, int]:
        """(start, from_offset, data, end): up to ``max_bytes`` from ``offset``. An offset
        older than what is kept reads from ``start`` (the caller sees the gap); one past
        the end (the log was removed) reads nothing from ``end``."""
        start, end = self.bounds()
        offset = min(max(offset, start), end)
        current_start = self._current_start()
        parts, want, position = [], max_bytes, offset
        for name, segment_start in ((OLD_LOG_NAME, start), (LOG_NAME, current_start)):
            if want <= 0:
                break
            segment_end = segment_start + (_size(self._path(name)) if name == LOG_NAME else current_start - start)
            if position >= segment_end:
                continue
            try:
                with open(self._path(name), "rb") as fh:
                    fh.seek(position - segment_start)
                    chunk = fh.read(min(want, segment_end - position))
            except FileNotFoundError:
                continue
            parts.append(chunk)
            position += len(chunk)
            want -= len(chunk)
        return start, offset, b"".join(parts), end
