"""One node per data directory (an exclusive ``flock`` on ``DIR/node.lock``).

Two nodes on one directory would sign with one key from two processes, write one SQLite
store, and the second would, on its way out, unlink the first one's control socket. The
lock is taken before anything in the directory is opened, held for the life of the
process (the kernel drops it when the process dies, however it dies), and a second
``meshnode run`` is refused in one line naming the process that holds it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from keys.errors import ConfigError

LOCK_NAME = "node.lock"


class DirectoryLock:
    def __init__(self, root) -> None:
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ConfigError (one line); touches nothing else in the directory."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError("cannot open %s: %s" % (self.path, exc.strerror or exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError("%s is in use by a running node (pid %s): stop it first, or give this node its "
                              "own directory" % (self.path.parent, holder)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor drops the flock
            self._fd = None
