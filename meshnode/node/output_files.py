"""Files a workload leaves in its working directory, read and written without escaping it
(SPEC.md 9.8).

A path names a regular file by its components relative to a root directory: no empty
component, no ``.`` or ``..``, no absolute path, no NUL, at most MAX_DEPTH deep. Both ends
open every component with ``O_NOFOLLOW`` relative to the one before (``dir_fd``), so a
symbolic link anywhere on the path -- one the workload made on the primary, or one
already in the owner's ``--out`` directory -- fails instead of leading outside.
"""

from __future__ import annotations

import os
import stat

from meshnode.node.output_log import LOG_FILES
from protocol.errors import MeshError, RemoteProtocolError
from protocol.messages import MAX_OUTPUT_FILES, MAX_OUTPUT_PATH_BYTES, OutputFile

MAX_DEPTH = 16
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def path_parts(path: str) -> list[str]:
    """The components of a safe relative path; RemoteProtocolError naming what is wrong."""
    if not path or len(path.encode("utf-8", "surrogateescape")) > MAX_OUTPUT_PATH_BYTES:
        raise RemoteProtocolError("path %r: expected 1..%d bytes" % (path[:64], MAX_OUTPUT_PATH_BYTES))
    if "\0" in path:
        raise RemoteProtocolError("path %r contains NUL" % path[:64])
    if path.startswith("/"):
        raise RemoteProtocolError("path %r is absolute" % path[:64])
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise RemoteProtocolError("path %r has an empty, '.' or '..' component" % path[:64])
    if len(parts) > MAX_DEPTH:
        raise RemoteProtocolError("path %r is deeper than %d" % (path[:64], MAX_DEPTH))
    return parts


def list_files(root: str) -> list[OutputFile]:
    """Regular files under ``root``, sorted, not following symbolic links, without the
    node's own output log (``job logs`` reads that); at most MAX_OUTPUT_FILES."""
    found: list[OutputFile] = []

    def walk(directory: str, prefix: str, depth: int) -> None:
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            if len(found) >= MAX_OUTPUT_FILES:
                return
            relative = prefix + entry.name
            if not prefix and entry.name in LOG_FILES:
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode) and depth + 1 < MAX_DEPTH:
                walk(entry.path, relative + "/", depth + 1)
            elif stat.S_ISREG(info.st_mode) and len(relative.encode("utf-8", "surrogateescape")) <= MAX_OUTPUT_PATH_BYTES:
                try:
                    found.append(OutputFile(path=relative, size=info.st_size, mtime_ms=info.st_mtime_ns // 1_000_000))
                except ValueError:
                    continue   # a name that is not UTF-8 text cannot be named on the wire
    if os.path.isdir(root):
        walk(root, "", 0)
    return found


def _open_under(root: str, parts: list[str], flags: int, mode: int = 0o600, make_dirs: bool = False) -> int:
    """A file descriptor for ``root/parts``, each directory opened with O_NOFOLLOW."""
    directory = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            if make_dirs:
                try:
                    os.mkdir(part, 0o700, dir_fd=directory)
                except FileExistsError:
                    pass
            child = os.open(part, _DIR_FLAGS, dir_fd=directory)
            os.close(directory)
            directory = child
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
    finally:
        os.close(directory)


def read_file(root: str, path: str, offset: int, max_bytes: int) -> tuple[int, bytes]:
    """(size, up to ``max_bytes`` from ``offset``) of the regular file ``path`` under ``root``."""
    parts = path_parts(path)
    if len(parts) == 1 and parts[0] in LOG_FILES:
        raise RemoteProtocolError("%s is the job's output log: read it with `meshnode job logs`" % path)
    try:
        fd = _open_under(root, parts, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise RemoteProtocolError("cannot open %s: %s" % (path, exc.strerror or exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RemoteProtocolError("%s is not a regular file" % path)
        return info.st_size, os.pread(fd, max_bytes, offset)
    finally:
        os.close(fd)


class OutputWriter:
    """Writes fetched files under the owner's ``--out`` directory, refusing any path that
    would leave it (the primary's list is remote input)."""

    def __init__(self, out_dir: str):
        self.out_dir = os.path.abspath(out_dir)
        try:
            os.makedirs(self.out_dir, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise MeshError("cannot create %s: %s" % (out_dir, exc.strerror)) from None

    def open(self, path: str) -> int:
        """A new file for ``path`` (refused if it exists: nothing is overwritten)."""
        try:
            parts = path_parts(path)
        except RemoteProtocolError as exc:
            raise MeshError("refusing a file from the node: %s" % exc) from None
        try:
            return _open_under(self.out_dir, parts, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, make_dirs=True)
        except FileExistsError:
            raise MeshError("%s already exists in %s; choose an empty --out directory"
                            % (path, self.out_dir)) from None
        except OSError as exc:
            raise MeshError("cannot write %s under %s: %s (a symbolic link on the way is refused)"
                            % (path, self.out_dir, exc.strerror or exc)) from None
