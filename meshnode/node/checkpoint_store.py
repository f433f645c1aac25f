"""Checkpoints in local SQLite, fenced and bounded (SPEC.md 9.5-9.7).

Both the node running a workload and its backup nodes keep checkpoints here. Rules:

* **Fencing** (SPEC.md 9.6): a checkpoint whose fence is lower than the highest fence
  this store has seen for its job is refused, and so is one whose seq is not greater
  than the newest stored seq at the same fence. The highest fence per job lives in its
  own table, so it survives pruning and ``drop()``, and ``raise_fence()`` can record an
  eviction's new fence before any checkpoint at that fence exists: from then on the
  evicted node's late checkpoints are refused.
* **Bound** (SPEC.md 9.7): only the newest ``keep`` checkpoints per job are kept
  (genesis ``checkpoint_keep``), so a job costs at most keep x MAX_STATE_BYTES, and the
  WAL file is capped by ``journal_size_limit``.
* **Integrity**: ``latest()`` re-hashes the state; a row whose hash does not match is
  skipped (and counted) and the next older one is returned.

Threads: one sqlite3 connection, used under a lock. SQLite admits one writer at a time
anyway, so a second connection would only trade Python-side waiting for SQLITE_BUSY
retries on the WAL write lock. ``AsyncCheckpointStore`` runs every call in a trio
worker thread behind a CapacityLimiter(1), so the event loop never waits on disk and at
most one worker thread is ever parked on the lock.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from dataclasses import dataclass

import sqlite_utils
import trio

from keys.errors import ConfigError
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_STATE_BYTES, Checkpoint

WAL_SIZE_LIMIT_BYTES = 64 << 20
BUSY_TIMEOUT_MS = 5000  # another connection of the node (certificates, votes) may hold the write lock
_COLUMNS = "job_id, fence, seq, progress, taken_ms, state, state_hash, origin, stored_ms"


@dataclass(frozen=True)
class StoredCheckpoint:
    job_id: bytes       # 32-byte job id (SHA-256 of the manifest)
    fence: int          # placement fence: bumped by every migration of the job
    seq: int            # checkpoint number within the job, increasing
    progress: int       # the workload's own monotonic work count
    taken_ms: int       # wall clock when the workload offered this state
    state: bytes
    state_hash: bytes   # SHA-256 of state
    origin: bytes       # public key of the node that ran the workload
    stored_ms: int      # wall clock when this store accepted it

    @classmethod
    def from_message(cls, message: Checkpoint, origin: bytes, stored_ms: int) -> "StoredCheckpoint":
        return cls(message.job_id, message.fence, message.seq, message.progress, message.taken_ms,
                   message.state, message.state_hash, origin, stored_ms)

    @classmethod
    def taken(cls, job_id: bytes, fence: int, seq: int, progress: int, taken_ms: int, state: bytes,
              origin: bytes, stored_ms: int) -> "StoredCheckpoint":
        """A checkpoint this node just took from its own workload (hash computed here)."""
        return cls(job_id, fence, seq, progress, taken_ms, state, hashlib.sha256(state).digest(),
                   origin, stored_ms)

    def to_message(self) -> Checkpoint:
        return Checkpoint(job_id=self.job_id, fence=self.fence, seq=self.seq, progress=self.progress,
                          taken_ms=self.taken_ms, state=self.state, state_hash=self.state_hash)


class CheckpointStore:
    def __init__(self, path, keep: int):
        if keep < 1:
            raise ConfigError("checkpoint_keep must be at least 1, got %d" % keep)
        self.keep = keep
        self.refused_count = 0        # puts refused by the fencing rule
        self.corrupt_skipped_count = 0  # rows latest() skipped for a bad hash
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False,
                                         timeout=BUSY_TIMEOUT_MS / 1000)
            # WAL: readers never block the writer, and a process killed mid-write leaves the
            # database intact (the torn WAL tail is ignored on the next open).
            # synchronous=NORMAL: fsync only at WAL checkpoints, not per commit. A killed
            # *process* loses nothing committed (the WAL is in the page cache); only a power
            # loss can drop the newest commits, and those are replicated to the job's backup
            # nodes (SPEC.md 9.5). Measured: NORMAL upsert p50 ~90 us vs FULL ~0.4 ms
            # (LIBP2P_NOTES.md), at 10 checkpoints/s per job.
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA journal_size_limit=%d" % WAL_SIZE_LIMIT_BYTES)
            self._create_tables()
        except sqlite3.DatabaseError as exc:
            raise ConfigError("cannot open checkpoint database %s: %s" % (path, exc)) from None

    def _create_tables(self) -> None:
        # sqlite-utils for the schema (readable, idempotent); the hot path below is raw
        # sqlite3, about 75 us cheaper per call (LIBP2P_NOTES.md).
        db = sqlite_utils.Database(self._conn)
        db["checkpoints"].create(
            {"job_id": bytes, "fence": int, "seq": int, "progress": int, "taken_ms": int, "state": bytes,
             "state_hash": bytes, "origin": bytes, "stored_ms": int},
            pk=("job_id", "fence", "seq"), not_null={"job_id", "fence", "seq", "state", "state_hash"},
            if_not_exists=True)
        db["checkpoint_fences"].create({"job_id": bytes, "fence": int}, pk="job_id", if_not_exists=True)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def put(self, record: StoredCheckpoint) -> bool:
        """Store ``record``; False if the fencing rule refuses it (SPEC.md 9.6).

        The state is not re-hashed here: both constructors already guarantee the hash
        (``taken`` computes it, a decoded ``Checkpoint`` message checks it), and SHA-256
        of a 900 KB state costs ~7 ms on this 2-core box without SHA extensions.
        ``latest()`` re-hashes on the way out, which is what catches corruption at rest.
        """
        if len(record.job_id) != 32 or len(record.state) > MAX_STATE_BYTES:
            raise RemoteProtocolError("checkpoint has a bad job id or oversized state")
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                accepted = self._put_locked(record)
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        if not accepted:
            self.refused_count += 1
        return accepted

    def _put_locked(self, record: StoredCheckpoint) -> bool:
        conn = self._conn
        row = conn.execute("SELECT fence FROM checkpoint_fences WHERE job_id = ?", (record.job_id,)).fetchone()
        if row is not None and record.fence < row[0]:
            return False
        (top_seq,) = conn.execute("SELECT MAX(seq) FROM checkpoints WHERE job_id = ? AND fence = ?",
                                  (record.job_id, record.fence)).fetchone()
        if top_seq is not None and record.seq <= top_seq:
            return False
        conn.execute("INSERT INTO checkpoints (%s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)" % _COLUMNS,
                     (record.job_id, record.fence, record.seq, record.progress, record.taken_ms,
                      record.state, record.state_hash, record.origin, record.stored_ms))
        if row is None or record.fence > row[0]:
            conn.execute("INSERT OR REPLACE INTO checkpoint_fences (job_id, fence) VALUES (?, ?)",
                         (record.job_id, record.fence))
        conn.execute("DELETE FROM checkpoints WHERE job_id = ? AND rowid NOT IN (SELECT rowid FROM checkpoints"
                     " WHERE job_id = ? ORDER BY fence DESC, seq DESC LIMIT ?)",
                     (record.job_id, record.job_id, self.keep))
        return True

    def raise_fence(self, job_id: bytes, fence: int) -> bool:
        """Record that ``job_id`` now runs at ``fence``; False if a higher fence is already known."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute("SELECT fence FROM checkpoint_fences WHERE job_id = ?",
                                         (job_id,)).fetchone()
                raised = row is None or fence > row[0]
                if raised:
                    self._conn.execute("INSERT OR REPLACE INTO checkpoint_fences (job_id, fence) VALUES (?, ?)",
                                       (job_id, fence))
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
        return raised or row[0] == fence

    def fence(self, job_id: bytes) -> int | None:
        with self._lock:
            row = self._conn.execute("SELECT fence FROM checkpoint_fences WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def latest(self, job_id: bytes) -> StoredCheckpoint | None:
        """The newest checkpoint of ``job_id`` whose state matches its hash, or None."""
        with self._lock:  # keys first: reading every state blob of a job would cost keep x 900 KB
            keys = self._conn.execute("SELECT fence, seq FROM checkpoints WHERE job_id = ?"
                                      " ORDER BY fence DESC, seq DESC", (job_id,)).fetchall()
        for fence, seq in keys:
            with self._lock:
                row = self._conn.execute("SELECT %s FROM checkpoints WHERE job_id = ? AND fence = ? AND seq = ?"
                                         % _COLUMNS, (job_id, fence, seq)).fetchone()
            if row is None:
                continue  # pruned by a put() between the two reads
            record = StoredCheckpoint(*row)
            if hashlib.sha256(record.state).digest() == record.state_hash:
                return record
            self.corrupt_skipped_count += 1
        return None

    def jobs(self) -> list[bytes]:
        with self._lock:
            return [row[0] for row in self._conn.execute("SELECT DISTINCT job_id FROM checkpoints ORDER BY job_id")]

    def drop(self, job_id: bytes) -> None:
        """Forget a finished job's checkpoints; its fence stays, so late stale ones are still refused."""
        with self._lock:
            self._conn.execute("DELETE FROM checkpoints WHERE job_id = ?", (job_id,))

    def integrity_ok(self) -> bool:
        with self._lock:
            return self._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


class AsyncCheckpointStore:
    """The store for trio code: each call runs in a worker thread, one at a time."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self._limiter = trio.CapacityLimiter(1)

    async def _call(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def put(self, record: StoredCheckpoint) -> bool:
        return await self._call(self.store.put, record)

    async def raise_fence(self, job_id: bytes, fence: int) -> bool:
        return await self._call(self.store.raise_fence, job_id, fence)

    async def latest(self, job_id: bytes) -> StoredCheckpoint | None:
        return await self._call(self.store.latest, job_id)

    async def jobs(self) -> list[bytes]:
        return await self._call(self.store.jobs)

    async def drop(self, job_id: bytes) -> None:
        await self._call(self.store.drop, job_id)
